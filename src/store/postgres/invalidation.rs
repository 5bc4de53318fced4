//! The invalidation broadcast on PostgreSQL: `pg_notify` in a reset's transaction and after a
//! refund, and one connection per store, outside the pool, that `LISTEN`s (see
//! [Invalidations](crate::store#invalidations)).
//!
//! The channel is named from the store's schema, `<schema>_invalidated` (the subscriber's
//! connection takes it as its `application_name`, as `pg_stat_activity` shows); a notification's
//! payload is `<namespace> <caller>`, the policy's namespace and the caller's key as store keys
//! write it. A notification is delivered when its transaction commits, so a reset is heard only
//! once it is visible.

use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt;
use tokio_postgres::tls::MakeTlsConnect;
use tokio_postgres::{AsyncMessage, Client, Socket};

use crate::key::Key;
use crate::store::invalidation::{Hub, PING_EVERY, Subscriber};
use crate::store::{Invalidation, Invalidations};
use crate::task::AbortOnDrop;

/// The least time a connection, its `LISTEN` or a check of it is given.
const LEAST_WAIT: Duration = Duration::from_secs(1);

/// The channel of a store on `schema`: PostgreSQL takes names of at most 63 bytes.
pub(super) fn channel(schema: &str) -> String {
    let mut channel = format!("{schema}_invalidated");
    channel.truncate(63);
    channel
}

/// The payload telling that caller `key` under `namespace` may have room again.
pub(super) fn payload(namespace: &str, key: Key) -> String {
    format!("{namespace} {key}")
}

/// The payload telling that the limits in force of the layer of `namespace` changed.
pub(super) fn limits_payload(namespace: &str) -> String {
    format!("{namespace} {LIMITS}")
}

/// What stands for the caller in a change of limits: never a caller's key (22 characters).
const LIMITS: &str = "limits";

/// How the subscriber's own connection is made: as the pool's are.
#[derive(Clone)]
pub(super) enum Source {
    /// Plain text.
    Plain(tokio_postgres::Config),
    /// Over TLS.
    #[cfg(feature = "postgres-tls")]
    Tls(tokio_postgres::Config, super::tls::Connector),
}

/// A store's subscriber, and where it connects.
pub(super) struct Listening {
    subscriber: Subscriber,
    /// `None` on a pool the application made: the store cannot open a connection of its own.
    source: Option<Source>,
    channel: Arc<str>,
    timeout: Duration,
}

impl Listening {
    /// The subscriber of a store on `schema` that connects as `source` says, with calls bounded
    /// by `timeout`.
    pub(super) fn new(source: Option<Source>, schema: &str, timeout: Duration) -> Self {
        Self {
            subscriber: Subscriber::default(),
            source,
            channel: Arc::from(channel(schema)),
            timeout: timeout.max(LEAST_WAIT),
        }
    }

    /// A new subscription; `None` without a way to connect.
    pub(super) fn subscribe(&self) -> Option<Invalidations> {
        let source = self.source.clone()?;
        let (channel, timeout) = (Arc::clone(&self.channel), self.timeout);
        Some(self.subscriber.subscribe(move |hub, _| {
            let (source, channel) = (source.clone(), Arc::clone(&channel));
            async move {
                match source {
                    Source::Plain(config) => {
                        session(config, tokio_postgres::NoTls, &channel, hub, timeout).await
                    }
                    #[cfg(feature = "postgres-tls")]
                    Source::Tls(config, tls) => session(config, tls, &channel, hub, timeout).await,
                }
            }
        }))
    }
}

/// One connection's life: connect, `LISTEN`, then tell `hub` every notification until the
/// connection drops or stops answering, or nobody subscribes any more.
async fn session<T>(
    config: tokio_postgres::Config,
    tls: T,
    channel: &str,
    hub: Hub,
    timeout: Duration,
) -> Result<(), String>
where
    T: MakeTlsConnect<Socket>,
    T::Stream: Send + 'static,
{
    let mut config = config;
    // what an operator sees in `pg_stat_activity`
    config.application_name(channel);
    let connecting = tokio::time::timeout(timeout, config.connect(tls));
    let (client, mut connection) = connecting
        .await
        .map_err(|_| "connecting timed out".to_owned())?
        .map_err(|e| e.to_string())?;
    let told = hub.clone();
    let mut reading = AbortOnDrop(tokio::spawn(async move {
        let mut messages = futures_util::stream::poll_fn(move |cx| connection.poll_message(cx));
        while let Some(Ok(message)) = messages.next().await {
            if let AsyncMessage::Notification(notification) = message
                && let Some(invalidation) = parse(notification.payload())
            {
                told.send(invalidation);
            }
        }
    }));
    let listen = format!("LISTEN \"{channel}\"");
    tokio::time::timeout(timeout, client.batch_execute(&listen))
        .await
        .map_err(|_| "LISTEN timed out".to_owned())?
        .map_err(|e| e.to_string())?;
    // whatever was notified while nobody listened is lost
    hub.listening();
    tokio::select! {
        _ = &mut reading.0 => {}
        () = watch(&client, &hub, timeout) => {}
    }
    Ok(())
}

/// Returns once `client`'s connection stops answering, or nobody hears `hub` any more.
async fn watch(client: &Client, hub: &Hub, timeout: Duration) {
    let mut ping = tokio::time::interval(PING_EVERY);
    ping.reset();
    loop {
        ping.tick().await;
        if !hub.is_heard() {
            return;
        }
        let answered = tokio::time::timeout(timeout, client.simple_query("")).await;
        if !matches!(answered, Ok(Ok(_))) {
            return;
        }
    }
}

/// The invalidation a payload carries; `None` for one that is not ours.
fn parse(payload: &str) -> Option<Invalidation> {
    let (namespace, key) = payload.split_once(' ')?;
    if key == LIMITS {
        return Some(Invalidation::Limits {
            namespace: Arc::from(namespace),
        });
    }
    Some(Invalidation::Caller {
        namespace: Arc::from(namespace),
        key: Key::from_encoded(key)?,
    })
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;
    use crate::fuzz::check;

    /// A namespace as a layer's prefix makes it: visible ASCII without braces.
    const NAMESPACE: &str = "[!-z|~]{1,24}";

    #[test]
    fn any_payload_is_an_invalidation_written_so_or_ignored() {
        let text = prop_oneof![
            ".{0,48}",
            "[!-z|~]{0,12} [A-Za-z0-9_-]{21,23}",
            "[!-z|~]{0,12} [A-Za-z0-9_ -]{22}.{0,4}",
        ];
        check(1024, text, |text| {
            match parse(&text) {
                Some(Invalidation::Caller { namespace, key }) => {
                    prop_assert_eq!(payload(&namespace, key), text);
                }
                Some(Invalidation::Limits { namespace }) => {
                    prop_assert_eq!(limits_payload(&namespace), text);
                }
                _ => {}
            }
            Ok(())
        });
    }

    #[test]
    fn a_payload_reads_back_as_its_namespace_and_caller() {
        check(512, (NAMESPACE, any::<Vec<u8>>()), |(namespace, value)| {
            let key = Key::new("fuzz", &value);
            let expected = Invalidation::Caller {
                namespace: Arc::from(namespace.as_str()),
                key,
            };
            prop_assert_eq!(parse(&payload(&namespace, key)), Some(expected));
            let limits = Invalidation::Limits {
                namespace: Arc::from(namespace.as_str()),
            };
            prop_assert_eq!(parse(&limits_payload(&namespace)), Some(limits));
            Ok(())
        });
    }
}
