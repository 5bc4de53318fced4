//! Durable writes with group commit: the writes that wait for replicas at the same moment go out
//! as one pipeline, followed by one `WAIT`.
//!
//! `WAIT` counts the replicas that acknowledged every earlier write of its connection, and blocks
//! that connection until then. So one `WAIT` after a pipeline of writes acknowledges them all,
//! and writes that arrive while it waits queue for the next pipeline instead of behind it. A few
//! connections of their own (never the rate checks' connection) each carry one pipeline at a
//! time: durable throughput grows with the load, not with the number of replica round trips.
//!
//! On Cluster a pipeline holds the writes of one hash tag (one slot, hence one node): writes of
//! other slots go in pipelines of their own, on the same connections.
//!
//! `WAITAOF` works the same way (it too counts every earlier write of its connection), for a
//! write that must be on disk — the primary's append-only file, the replicas', or both — rather
//! than in the replicas' memory.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use futures_util::StreamExt;
use futures_util::stream::FuturesUnordered;
use redis::{Pipeline, Value};
use tokio::sync::{Notify, oneshot};
use tokio::time::Instant;
use tracing::{Instrument, Span};

use super::connection::{Connection, Link};
use super::script_call::ScriptCall;
use super::{redis_call, status_code, store_error};
use crate::store::span::{self, Command};
use crate::store::{StoreError, StoreErrorKind};

/// How many connections carry durable writes.
pub(super) const CONNECTIONS: usize = 2;

/// The most writes one pipeline carries.
const MAX_GROUP: usize = 64;

/// A script's reply, and the failure to report if it counts only once acknowledged (`None`:
/// acknowledged).
pub(super) type Acked = (Value, Option<StoreError>);

/// What acknowledges a durable write.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Ack {
    /// `WAIT`: `n` replicas received it.
    Replicas(u32),
    /// `WAITAOF`: the primary's append-only file (when `local`) and `replicas` replicas' have
    /// it on disk.
    Aof { local: bool, replicas: u32 },
}

impl Ack {
    /// The acknowledgement of `wait_replicas(replicas)`; none for 0.
    pub(super) fn replicas(replicas: u32) -> Option<Self> {
        (replicas > 0).then_some(Self::Replicas(replicas))
    }

    /// The acknowledgement of `wait_aof(local, replicas)`; none when it asks for nothing.
    pub(super) fn aof(local: bool, replicas: u32) -> Option<Self> {
        (local || replicas > 0).then_some(Self::Aof { local, replicas })
    }

    /// How many replicas must acknowledge.
    pub(super) fn replica_count(self) -> u32 {
        match self {
            Self::Replicas(n) | Self::Aof { replicas: n, .. } => n,
        }
    }

    /// Adds the command that waits for this acknowledgement up to `wait_ms` to `pipe`.
    fn add_wait(self, pipe: &mut Pipeline, wait_ms: u64) {
        match self {
            Self::Replicas(n) => {
                pipe.cmd("WAIT").arg(n).arg(wait_ms);
            }
            Self::Aof { local, replicas } => {
                pipe.cmd("WAITAOF")
                    .arg(u32::from(local))
                    .arg(replicas)
                    .arg(wait_ms);
            }
        }
    }

    /// What the wait's `reply` says: `None` when the writes before it are acknowledged, else
    /// the failure their callers get (the writes ran: each undoes what it made). An answer
    /// that is no count at all is an error of the whole pipeline.
    fn judge(self, reply: Value) -> Result<Option<StoreError>, StoreError> {
        let count = |v: &Value| match v {
            Value::Int(n) => u32::try_from(*n).ok(),
            _ => None,
        };
        let short = |what: String| {
            Some(StoreError::new(
                StoreErrorKind::Unavailable,
                format!("the write reached {what} in time"),
            ))
        };
        match (self, reply) {
            (_, Value::ServerError(e)) => Ok(Some(wait_refused(self, &e.to_string()))),
            (Self::Replicas(n), reply) => {
                let acked = count(&reply).ok_or_else(|| {
                    StoreError::protocol("WAIT answered otherwise than with a count")
                })?;
                Ok(if acked < n {
                    short(format!("{acked} of {n} replicas"))
                } else {
                    None
                })
            }
            (Self::Aof { local, replicas }, Value::Array(counts)) => {
                let (on_primary, on_replicas) = match counts.as_slice() {
                    [p, r] => (count(p), count(r)),
                    _ => (None, None),
                };
                let (Some(on_primary), Some(on_replicas)) = (on_primary, on_replicas) else {
                    return Err(StoreError::protocol(
                        "WAITAOF answered otherwise than with two counts",
                    ));
                };
                Ok(if on_primary < u32::from(local) {
                    short("the append-only file of the primary".to_owned())
                } else if on_replicas < replicas {
                    short(format!(
                        "the append-only file of {on_replicas} of {replicas} replicas"
                    ))
                } else {
                    None
                })
            }
            (Self::Aof { .. }, _) => Err(StoreError::protocol(
                "WAITAOF answered otherwise than with two counts",
            )),
        }
    }
}

/// The server refused the wait itself: no `WAITAOF` before Redis 7.2, none with `local` while
/// `appendonly` is off. Said so, as a configuration error: no retry helps.
fn wait_refused(ack: Ack, message: &str) -> StoreError {
    let hint = match ack {
        Ack::Aof { .. } if message.to_ascii_lowercase().contains("unknown command") => {
            " (WAITAOF needs Redis 7.2 or later, or Valkey; on an older server use wait_replicas)"
        }
        Ack::Aof { .. } if message.contains("appendonly") => {
            " (wait_aof with `local` needs `appendonly yes` on the primary)"
        }
        _ => "",
    };
    StoreError::new(
        StoreErrorKind::Config,
        format!("the server refused the durable writes' wait: {message}{hint}"),
    )
}

/// The durable writes of one store.
pub(super) struct DurableWrites {
    links: Vec<Arc<Link>>,
    ack: Ack,
    /// On Cluster, a pipeline holds writes of one hash tag.
    per_tag: bool,
    queue: Mutex<Queue>,
    queued: Notify,
}

#[derive(Default)]
struct Queue {
    waiting: VecDeque<Write>,
    /// A driver is sending: new writes wait for it.
    sending: bool,
}

/// A write waiting for its pipeline.
struct Write {
    source: &'static str,
    call: ScriptCall,
    /// When its caller gives up: the `WAIT` of its pipeline ends before.
    deadline: Instant,
    /// The caller's span, the parent of its pipeline's (with no subscriber, none).
    caller: Span,
    reply: oneshot::Sender<Result<Acked, StoreError>>,
}

impl DurableWrites {
    pub(super) fn new(links: Vec<Link>, ack: Ack) -> Self {
        let per_tag = links
            .first()
            .is_some_and(|l| matches!(l.get(), Connection::Cluster(_)));
        Self {
            links: links.into_iter().map(Arc::new).collect(),
            ack,
            per_tag,
            queue: Mutex::default(),
            queued: Notify::new(),
        }
    }

    pub(super) fn ack(&self) -> Ack {
        self.ack
    }

    /// Runs the script of `source` with `call` in the next pipeline; its reply and how many
    /// replicas acknowledged it by `deadline`.
    pub(super) async fn write(
        self: &Arc<Self>,
        source: &'static str,
        call: ScriptCall,
        deadline: Instant,
    ) -> Result<Acked, StoreError> {
        let (reply, answer) = oneshot::channel();
        if self.enqueue(Write {
            source,
            call,
            deadline,
            caller: Span::current(),
            reply,
        }) {
            tokio::spawn(Arc::clone(self).drive());
        }
        match tokio::time::timeout_at(deadline, answer).await {
            Ok(Ok(acked)) => acked,
            Ok(Err(_)) => Err(StoreError::new(
                StoreErrorKind::Unavailable,
                "the durable write was dropped before an answer came",
            )),
            Err(_) => Err(StoreError::timeout()),
        }
    }

    fn queue(&self) -> MutexGuard<'_, Queue> {
        self.queue.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Queues `write`; whether no driver runs, so that the caller must start one.
    fn enqueue(&self, write: Write) -> bool {
        let mut queue = self.queue();
        queue.waiting.push_back(write);
        let start = !std::mem::replace(&mut queue.sending, true);
        drop(queue);
        if !start {
            self.queued.notify_one();
        }
        start
    }

    /// The writes of the next pipeline, leaving out callers that gave up (or whose deadline
    /// passed); `None` when none waits, and then, when nothing is in flight (`idle`), the driver
    /// stops.
    fn next_group(&self, idle: bool) -> Option<Vec<Write>> {
        let mut queue = self.queue();
        let now = Instant::now();
        queue
            .waiting
            .retain(|w| !w.reply.is_closed() && w.deadline > now);
        let mut group: Vec<Write> = Vec::new();
        let mut i = 0;
        while i < queue.waiting.len() && group.len() < MAX_GROUP {
            let fits = !self.per_tag
                || group
                    .first()
                    .is_none_or(|first| first.call.hash_tag() == queue.waiting[i].call.hash_tag());
            match fits.then(|| queue.waiting.remove(i)).flatten() {
                Some(write) => group.push(write),
                None => i += 1,
            }
        }
        if group.is_empty() {
            queue.sending = !idle;
            return None;
        }
        Some(group)
    }

    /// Sends pipelines, one at a time per connection, until no write waits.
    async fn drive(self: Arc<Self>) {
        let mut guard = Driving(Arc::clone(&self), false);
        let mut free: Vec<usize> = (0..self.links.len()).collect();
        let mut calls = FuturesUnordered::new();
        loop {
            while let Some(&link) = free.last() {
                let Some(group) = self.next_group(calls.is_empty()) else {
                    break;
                };
                free.pop();
                let this = &self;
                calls.push(async move {
                    this.send(&this.links[link], group).await;
                    link
                });
            }
            if calls.is_empty() {
                guard.1 = true;
                return;
            }
            if free.is_empty() {
                if let Some(link) = calls.next().await {
                    free.push(link);
                }
            } else {
                tokio::select! {
                    Some(link) = calls.next() => free.push(link),
                    () = self.queued.notified() => {}
                }
            }
        }
    }

    /// One pipeline, in its span: a child of the first write's caller's span, the others'
    /// round trip as well. Tells each caller its reply and whether it was acknowledged.
    async fn send(&self, link: &Arc<Link>, group: Vec<Write>) {
        let call = redis_call("durable_write", Command::Batch, "");
        let span = match group.first() {
            Some(first) => first
                .caller
                .in_scope(|| span::call_span(&call, || link.server())),
            None => span::call_span(&call, || link.server()),
        };
        span::record_batch(&span, group.len());
        let sent = self.round_trip(link, &group).instrument(span.clone()).await;
        span::record_result(&span, &sent, status_code);
        let (replies, short) = match sent {
            Ok(sent) => sent,
            Err(error) => return fail(group, &error),
        };
        for (write, reply) in group.into_iter().zip(replies) {
            let answer = match reply {
                Value::ServerError(e) => Err(store_error(e.into())),
                reply => Ok((reply, short.as_ref().map(StoreError::shared))),
            };
            let _ = write.reply.send(answer);
        }
    }

    /// The group's scripts, then `WAIT` (or `WAITAOF`) until the earliest deadline among them
    /// (less room for the reply): each script's reply, and the failure their callers get if
    /// too few acknowledged them.
    async fn round_trip(
        &self,
        link: &Arc<Link>,
        group: &[Write],
    ) -> Result<(Vec<Value>, Option<StoreError>), StoreError> {
        let earliest = group.iter().map(|w| w.deadline).min();
        let left = earliest.map_or(Duration::ZERO, |d| {
            d.saturating_duration_since(Instant::now())
        });
        let wait_ms = u64::try_from((left * 3 / 4).as_millis())
            .unwrap_or(0)
            .max(1);
        let mut pipe = Pipeline::with_capacity(group.len() + 1);
        pipe.ignore_errors();
        for write in group {
            write.call.add_eval(&mut pipe, write.source);
        }
        self.ack.add_wait(&mut pipe, wait_ms);
        let mut conn = link.get();
        let sent = tokio::time::timeout(left, pipe.query_async::<Vec<Value>>(&mut conn)).await;
        let mut replies = match sent {
            Ok(Ok(replies)) if replies.len() == group.len() + 1 => {
                link.answered();
                replies
            }
            Ok(Ok(_)) => {
                return Err(StoreError::protocol(
                    "WAIT pipeline: a reply of the wrong length",
                ));
            }
            Ok(Err(e)) => {
                let error = store_error(e);
                if error.kind() == StoreErrorKind::Unavailable {
                    self.unreachable();
                }
                return Err(error);
            }
            Err(_) => {
                link.timed_out();
                self.unreachable();
                return Err(StoreError::timeout());
            }
        };
        let short = match replies.pop() {
            Some(reply) => self.ack.judge(reply)?,
            None => return Err(StoreError::protocol("a pipeline without its wait's reply")),
        };
        Ok((replies, short))
    }
}

impl DurableWrites {
    /// One connection found the store unreachable: all of them go to look for it (behind
    /// sentinels, each asks them where the primary is now), so that none is left on a primary
    /// that is gone until a write of its own fails there.
    fn unreachable(&self) {
        for link in &self.links {
            link.unreachable();
        }
    }
}

/// A running driver; dropped unfinished (its runtime shut down), it leaves no driver marked as
/// running, and the writes still waiting learn that they were dropped.
struct Driving(Arc<DurableWrites>, bool);

impl Drop for Driving {
    fn drop(&mut self) {
        if !self.1 {
            let mut queue = self.0.queue();
            queue.sending = false;
            queue.waiting.clear();
        }
    }
}

fn fail(group: Vec<Write>, error: &StoreError) {
    for write in group {
        let _ = write.reply.send(Err(error.shared()));
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;
    use crate::fuzz::{check, redis_reply};

    fn ack() -> impl Strategy<Value = Ack> {
        prop_oneof![
            any::<u32>().prop_map(Ack::Replicas),
            (any::<bool>(), any::<u32>())
                .prop_map(|(local, replicas)| Ack::Aof { local, replicas }),
        ]
    }

    #[test]
    fn any_wait_reply_is_judged_without_panicking() {
        check(512, (ack(), redis_reply()), |(ack, reply)| {
            let server_error = matches!(reply, Value::ServerError(_));
            match ack.judge(reply) {
                // a count read, or the server's refusal of the wait itself
                Ok(_) => {}
                Err(e) => {
                    prop_assert!(!server_error);
                    prop_assert_eq!(e.kind(), StoreErrorKind::Protocol);
                }
            }
            Ok(())
        });
    }

    #[test]
    fn counts_acknowledge_exactly_when_they_reach_what_was_asked() {
        let case = (ack(), any::<i64>(), any::<i64>());
        check(1024, case, |(ack, primary, replicas)| {
            let count = |n: i64| u32::try_from(n).ok();
            let (reply, enough) = match ack {
                Ack::Replicas(n) => (Value::Int(replicas), count(replicas).map(|r| r >= n)),
                Ack::Aof { local, replicas: n } => (
                    Value::Array(vec![Value::Int(primary), Value::Int(replicas)]),
                    count(primary)
                        .zip(count(replicas))
                        .map(|(p, r)| p >= u32::from(local) && r >= n),
                ),
            };
            match (ack.judge(reply), enough) {
                (Ok(None), Some(true)) => {}
                (Ok(Some(short)), Some(false)) => {
                    prop_assert_eq!(short.kind(), StoreErrorKind::Unavailable);
                }
                (Err(e), None) => prop_assert_eq!(e.kind(), StoreErrorKind::Protocol),
                (judged, enough) => {
                    prop_assert!(false, "{ack:?}: judged {judged:?}, expected {enough:?}");
                }
            }
            Ok(())
        });
    }
}
