//! The invalidation broadcast on Redis: a `PUBLISH` after each reset and refund, and one Pub/Sub
//! connection per store that hears them all (see [Invalidations](crate::store#invalidations)).
//!
//! The channel is `<namespace>:invalidated` (`tollgate:rl:invalidated`, a tier's
//! `tollgate:rl:<tier>:invalidated`), the message the caller's key as it appears in store keys;
//! the subscriber takes every rate namespace with one pattern, and each layer keeps what is its
//! own. On Cluster, a plain `PUBLISH` is delivered to the subscribers of every node, so the
//! subscriber listens on any one node; a sharded `SPUBLISH` would reach only the caller's shard,
//! and hearing every caller would take a subscription on every shard. The price: each reset or
//! refund is one message on the cluster bus to every node.
//!
//! Behind Sentinel the subscriber listens on the primary the sentinels name. After a failover
//! it still hears what the new primary publishes: a killed primary's connection drops and the
//! sentinels are asked again, and a demoted one receives the new primary's messages as its
//! replica (Redis replicates `PUBLISH`).
//!
//! While the subscriber's connection is down, what is published is lost; it is made again with
//! back-off, and tells the layers [`Invalidation::Missed`] each time it is made again.

use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt;
use redis::aio::PubSub;
use redis::{Msg, Value};

use super::connection::{Connection, Opener, PrimaryClient, ask_sentinels};
use crate::key::Key;
use crate::store::invalidation::{Hub, PING_EVERY, Subscriber};
use crate::store::{Invalidation, Invalidations};

/// The end of every invalidation channel's name, after the namespace.
const SUFFIX: &str = ":invalidated";
/// The channels of every rate-limit namespace: `<prefix>:rl` and its tiers' `<prefix>:rl:<tier>`.
const PATTERN: &str = "*:rl*:invalidated";
/// The channels of every concurrency limit's namespace, `<prefix>:cc`: changes of its limits in
/// force.
const CONCURRENCY_PATTERN: &str = "*:cc:invalidated";
/// The least time a connection, or its `PING`, is given.
const LEAST_WAIT: Duration = Duration::from_secs(1);

/// The channel of `namespace`'s invalidations.
fn channel(namespace: &str) -> String {
    format!("{namespace}{SUFFIX}")
}

/// Publishes `payload` (a caller's key, or [`LIMITS`]) on `namespace`'s channel.
async fn publish(
    conn: &mut Connection,
    namespace: &str,
    payload: &str,
) -> Result<(), redis::RedisError> {
    redis::cmd("PUBLISH")
        .arg(channel(namespace))
        .arg(payload)
        .query_async::<i64>(conn)
        .await
        .map(drop)
}

/// [`publish`], with a failure logged: the deny caches' one-second bound covers a lost one.
pub(super) async fn publish_or_log(mut conn: Connection, namespace: Arc<str>, key: Key) {
    if let Err(error) = publish(&mut conn, &namespace, &key.to_string()).await {
        tracing::debug!(
            target: "tollgate::store", %error,
            "could not publish an invalidation; cached denials of the caller end within a second"
        );
    }
}

/// The payload that says a layer's limits in force changed: never a caller's key (22
/// characters).
const LIMITS: &str = "limits";

/// Publishes that the limits in force of the layer of `namespace` changed, with a failure
/// logged: the copies read them again within their refresh anyway.
pub(super) async fn publish_limits_or_log(mut conn: Connection, namespace: Arc<str>) {
    if let Err(error) = publish(&mut conn, &namespace, LIMITS).await {
        tracing::debug!(
            target: "tollgate::store", %error,
            "could not publish a change of limits; the copies read them within their refresh"
        );
    }
}

/// Where the subscriber connects.
#[derive(Clone)]
enum Source {
    /// A standalone Redis.
    Single(redis::Client),
    /// Cluster nodes, tried in turn.
    Nodes(Arc<[redis::Client]>),
    /// The primary that the sentinels name.
    Sentinel {
        sentinels: Arc<[redis::Client]>,
        master: Arc<str>,
        primary_client: PrimaryClient,
    },
}

/// A store's subscriber, and where it connects.
pub(super) struct Listening {
    subscriber: Subscriber,
    /// `None` on a connection the application handed over: no way to open another.
    source: Option<Source>,
    /// What a connection, a subscription or a `PING` may take.
    timeout: Duration,
}

impl Listening {
    /// The subscriber of a store whose connection `opener` opens, with calls bounded by
    /// `timeout`.
    pub(super) fn new(opener: &Opener, timeout: Duration) -> Self {
        let source = match opener {
            Opener::Single { client, .. } => Some(Source::Single(client.clone())),
            Opener::Cluster { nodes, .. } => Some(Source::Nodes(Arc::clone(nodes))),
            Opener::Sentinel {
                sentinels,
                master,
                primary_client,
                ..
            } => Some(Source::Sentinel {
                sentinels: Arc::clone(sentinels),
                master: Arc::clone(master),
                primary_client: Arc::clone(primary_client),
            }),
            Opener::Given => None,
        };
        Self {
            subscriber: Subscriber::default(),
            source,
            timeout: timeout.max(LEAST_WAIT),
        }
    }

    /// A new subscription; `None` without a way to connect.
    pub(super) fn subscribe(&self) -> Option<Invalidations> {
        let source = self.source.clone()?;
        let timeout = self.timeout;
        Some(self.subscriber.subscribe(move |hub, attempt| {
            let source = source.clone();
            async move { session(&source, &hub, attempt, timeout).await }
        }))
    }
}

/// One connection's life: connect, subscribe, then tell `hub` what arrives until it drops.
async fn session(
    source: &Source,
    hub: &Hub,
    attempt: usize,
    timeout: Duration,
) -> Result<(), String> {
    let pubsub = tokio::time::timeout(timeout, source.connect(attempt, timeout))
        .await
        .map_err(|_| "subscribing timed out".to_owned())??;
    // whatever was published while nobody listened is lost
    hub.listening();
    serve(pubsub, hub, timeout).await;
    Ok(())
}

impl Source {
    /// A Pub/Sub connection subscribed to every namespace's channel; `attempt` picks the node
    /// of a Cluster.
    async fn connect(&self, attempt: usize, timeout: Duration) -> Result<PubSub, String> {
        let client = match self {
            Self::Single(client) => client.clone(),
            Self::Nodes(nodes) => match nodes.get(attempt % nodes.len().max(1)) {
                Some(node) => node.clone(),
                None => return Err("no cluster node given".to_owned()),
            },
            Self::Sentinel {
                sentinels,
                master,
                primary_client,
            } => {
                let primary = ask_sentinels(sentinels, master, timeout)
                    .await
                    .ok_or_else(|| format!("no sentinel named a primary for {master:?}"))?;
                primary_client(&primary).map_err(|e| e.to_string())?
            }
        };
        let mut pubsub = client.get_async_pubsub().await.map_err(|e| e.to_string())?;
        pubsub
            .psubscribe(&[PATTERN, CONCURRENCY_PATTERN])
            .await
            .map_err(|e| e.to_string())?;
        Ok(pubsub)
    }
}

/// Tells `hub` every invalidation `pubsub` receives, until its connection drops or stops
/// answering, or nobody subscribes any more.
async fn serve(pubsub: PubSub, hub: &Hub, timeout: Duration) {
    let (mut sink, mut stream) = pubsub.split();
    let mut ping = tokio::time::interval(PING_EVERY);
    ping.reset();
    loop {
        tokio::select! {
            message = stream.next() => match message {
                Some(message) => {
                    if let Some(invalidation) = parse(&message) {
                        hub.send(invalidation);
                    }
                }
                None => return,
            },
            _ = ping.tick() => {
                if !hub.is_heard() {
                    return;
                }
                let pong = tokio::time::timeout(timeout, sink.ping::<Value>()).await;
                if !matches!(pong, Ok(Ok(_))) {
                    return;
                }
            }
        }
    }
}

/// The invalidation a message carries; `None` for one on another channel, or not a key.
fn parse(message: &Msg) -> Option<Invalidation> {
    let namespace = message.get_channel_name().strip_suffix(SUFFIX)?;
    let payload = std::str::from_utf8(message.get_payload_bytes()).ok()?;
    if payload == LIMITS {
        return Some(Invalidation::Limits {
            namespace: Arc::from(namespace),
        });
    }
    let key = Key::from_encoded(payload)?;
    Some(Invalidation::Caller {
        namespace: Arc::from(namespace),
        key,
    })
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;
    use crate::fuzz::{bytes, check};

    /// The message a pattern subscription receives on `channel`, carrying `payload`.
    fn message(channel: Value, payload: Value) -> Msg {
        let pattern = Value::BulkString(PATTERN.into());
        let kind = Value::BulkString(b"pmessage".to_vec());
        Msg::from_value(&Value::Array(vec![kind, pattern, channel, payload])).unwrap()
    }

    fn bulk(text: &str) -> Value {
        Value::BulkString(text.as_bytes().to_vec())
    }

    /// A channel or payload as the server could send it: bytes, or a value of another type.
    fn part() -> impl Strategy<Value = Value> {
        prop_oneof![
            bytes(40).prop_map(Value::BulkString),
            "[!-~]{0,12}:invalidated".prop_map(|text| bulk(&text)),
            "[A-Za-z0-9_-]{22}".prop_map(|text| bulk(&text)),
            any::<i64>().prop_map(Value::Int),
            Just(Value::Nil),
        ]
    }

    #[test]
    fn any_message_is_an_invalidation_published_so_or_ignored() {
        check(1024, (part(), part()), |(channel, payload)| {
            let received = message(channel, payload);
            if let Some(Invalidation::Caller { namespace, key }) = parse(&received) {
                let mut text = String::new();
                key.write_encoded(&mut text);
                prop_assert_eq!(received.get_channel_name(), self::channel(&namespace));
                prop_assert_eq!(received.get_payload_bytes(), text.as_bytes());
            }
            Ok(())
        });
    }

    #[test]
    fn a_published_message_reads_back_as_its_namespace_and_caller() {
        let namespace = "[!-z|~]{1,24}";
        check(512, (namespace, any::<Vec<u8>>()), |(namespace, value)| {
            let key = Key::new("fuzz", &value);
            let mut text = String::new();
            key.write_encoded(&mut text);
            let received = message(bulk(&channel(&namespace)), bulk(&text));
            let expected = Invalidation::Caller {
                namespace: Arc::from(namespace.as_str()),
                key,
            };
            prop_assert_eq!(parse(&received), Some(expected));
            Ok(())
        });
    }
}
