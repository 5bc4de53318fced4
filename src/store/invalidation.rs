//! Invalidations: a store tells every layer subscribed to it that a caller may have room again.
//!
//! A rate-limit layer caches denials (its deny cache); a reset or a refund made through any copy
//! makes such a denial stale. A store that offers [`RateStore::invalidations`](super::RateStore::invalidations) broadcasts those
//! events to every subscriber — in the process ([`MemoryStore`](super::MemoryStore)), or through
//! the server to every copy (Redis Pub/Sub, PostgreSQL `NOTIFY`) — and each layer drops the
//! caller's cached denial when one arrives.
//!
//! A broadcast can be lost (a subscriber connection down, a subscriber that fell behind): it is a
//! shortcut, never what correctness rests on. A layer still serves a cached denial for at most a
//! second; and a subscriber that may have missed invalidations says so with
//! [`Invalidation::Missed`], on which a layer drops every cached denial.

use std::sync::Arc;

use tokio::sync::broadcast;

#[cfg(any(feature = "redis", feature = "postgres"))]
use super::StoreFuture;
use crate::key::Key;
use crate::rate::{RateCheck, RateOutcome};

/// How many invalidations a subscriber may fall behind before it misses some (and is told
/// [`Invalidation::Missed`]).
const BACKLOG: usize = 1024;

/// One event of a store's invalidation broadcast.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Invalidation {
    /// Caller `key` was reset, or refunded, under a policy of namespace `namespace` (see
    /// [`RatePolicy::namespace`](crate::rate::RatePolicy::namespace)): a denial of it cached
    /// before may be stale.
    Caller {
        /// The namespace of the policy whose state changed, e.g. `tollgate:rl`.
        namespace: Arc<str>,
        /// The caller.
        key: Key,
    },
    /// The limits in force of the rate-limit layer of namespace `namespace` were changed (see
    /// [`LimitsStore`](super::LimitsStore)): a copy reads them again.
    Limits {
        /// The namespace of the layer whose limits changed, e.g. `tollgate:rl`.
        namespace: Arc<str>,
    },
    /// Invalidations may have been lost (the subscriber fell behind, or its connection to the
    /// server dropped and was made again): any cached denial may be stale.
    Missed,
}

/// A subscription to a store's invalidations: what [`RateStore::invalidations`](super::RateStore::invalidations) returns.
///
/// ```
/// # #[tokio::main(flavor = "current_thread")] async fn main() {
/// use std::sync::Arc;
/// use tollgate::key::Key;
/// use tollgate::rate::{Algorithm, Limit, RatePolicy};
/// use tollgate::store::{Invalidation, MemoryStore, RateStore};
///
/// let store = MemoryStore::new();
/// let mut invalidations = store.invalidations().unwrap();
/// let policy = Arc::new(RatePolicy::new("app:rl", Algorithm::Gcra, vec![Limit::per_hour("h", 1)]).unwrap());
/// let alice = Key::new("user", b"alice");
/// store.reset_rate(&policy, alice).await.unwrap();
/// let expected = Invalidation::Caller { namespace: "app:rl".into(), key: alice };
/// assert_eq!(invalidations.next().await, Some(expected));
/// # }
/// ```
#[derive(Debug)]
pub struct Invalidations {
    receiver: broadcast::Receiver<Invalidation>,
}

impl Invalidations {
    /// A subscription that reads `receiver`: for a store of another crate, which sends on the
    /// matching [`broadcast::Sender`] what it learns.
    pub fn new(receiver: broadcast::Receiver<Invalidation>) -> Self {
        Self { receiver }
    }

    /// The next invalidation; [`Invalidation::Missed`] when this subscriber fell behind and
    /// some were dropped; `None` once the store's broadcast has ended (the store was dropped).
    pub async fn next(&mut self) -> Option<Invalidation> {
        match self.receiver.recv().await {
            Ok(invalidation) => Some(invalidation),
            Err(broadcast::error::RecvError::Lagged(_)) => Some(Invalidation::Missed),
            Err(broadcast::error::RecvError::Closed) => None,
        }
    }
}

/// The sending side that a store keeps: every subscription reads what it sends.
#[derive(Debug, Clone)]
pub(crate) struct Hub {
    sender: broadcast::Sender<Invalidation>,
    /// Whether a connection of the running listener has listened before: only a connection
    /// made again can have missed something its subscribers needed.
    #[cfg(any(feature = "redis", feature = "postgres"))]
    listened: std::sync::Arc<std::sync::atomic::AtomicBool>,
}

impl Default for Hub {
    fn default() -> Self {
        Self {
            sender: broadcast::Sender::new(BACKLOG),
            #[cfg(any(feature = "redis", feature = "postgres"))]
            listened: std::sync::Arc::default(),
        }
    }
}

impl Hub {
    /// A new subscription.
    pub(crate) fn subscribe(&self) -> Invalidations {
        Invalidations::new(self.sender.subscribe())
    }

    /// Tells every subscription; nothing when there is none.
    pub(crate) fn send(&self, invalidation: Invalidation) {
        let _ = self.sender.send(invalidation);
    }

    /// A listener's connection listens: when one listened before it, whatever was published
    /// in between is lost, and every subscription is told [`Invalidation::Missed`]. The first
    /// connection tells nothing: a denial cached before it is bounded by the deny cache's
    /// longest hold, and dropping every denial then would only cost store calls.
    #[cfg(any(feature = "redis", feature = "postgres"))]
    pub(crate) fn listening(&self) {
        use std::sync::atomic::Ordering;
        if self.listened.swap(true, Ordering::AcqRel) {
            self.send(Invalidation::Missed);
        }
    }

    /// Whether anybody still subscribes: a listener with nobody to tell may stop.
    #[cfg(any(feature = "redis", feature = "postgres"))]
    pub(crate) fn is_heard(&self) -> bool {
        self.sender.receiver_count() > 0
    }
}

/// Whether `outcome`, the answer to settlement `check`, calls for an invalidation: the check
/// settles a reservation for less than it reserved (a refund), it is not
/// [quiet](RateCheck::quiet), and the caller has room on every limit after it. A settlement that leaves some limit without room frees nobody, so it is not
/// published.
pub(crate) fn refunded(check: &RateCheck, outcome: &RateOutcome) -> bool {
    let Some(settled) = check.settles() else {
        return false;
    };
    settled.refundable
        && !check.is_quiet()
        && check.cost() < settled.reserved
        && outcome.limits.iter().all(|limit| limit.remaining > 0)
}

/// `pending`, the answer to `check`, followed — for a settlement that [`refunded`] — by
/// `publish` in the background, so that the settlement's answer does not wait for the broadcast.
#[cfg(any(feature = "redis", feature = "postgres"))]
pub(crate) fn publishing_refunds<P, F>(
    pending: StoreFuture<RateOutcome>,
    check: RateCheck,
    publish: P,
) -> StoreFuture<RateOutcome>
where
    P: FnOnce() -> F + Send + 'static,
    F: std::future::Future<Output = ()> + Send + 'static,
{
    if check.settles().is_none() {
        return pending;
    }
    Box::pin(async move {
        let outcome = pending.await?;
        if refunded(&check, &outcome) {
            tokio::spawn(publish());
        }
        Ok(outcome)
    })
}

/// The first pause after a subscriber connection failed or dropped, and the longest.
#[cfg(any(feature = "redis", feature = "postgres"))]
const FIRST_BACKOFF: std::time::Duration = std::time::Duration::from_millis(100);
#[cfg(any(feature = "redis", feature = "postgres"))]
const MAX_BACKOFF: std::time::Duration = std::time::Duration::from_secs(10);

/// How often a networked subscriber checks a quiet connection: one that went dark (no reset,
/// no close) is replaced within about this time plus the wait for its answer.
#[cfg(any(feature = "redis", feature = "postgres"))]
pub(crate) const PING_EVERY: std::time::Duration = std::time::Duration::from_secs(1);

/// A networked store's subscriber: one task and connection per store, whatever the number of
/// layers it tells. The task stops when the store goes (its last clone dropped), or ends by
/// itself when nobody subscribes any more; the next subscription starts it again.
#[cfg(any(feature = "redis", feature = "postgres"))]
#[derive(Debug, Default)]
pub(crate) struct Subscriber {
    hub: Hub,
    task: std::sync::Mutex<Option<crate::task::AbortOnDrop>>,
}

#[cfg(any(feature = "redis", feature = "postgres"))]
impl Subscriber {
    /// A new subscription, the listening task started if it is not running: it runs
    /// `session(hub, attempt)` — connect, subscribe, [`Hub::listening`], then tell
    /// `hub` what arrives until the connection drops (`Ok`) or fails to be made (`Err`, its
    /// cause) — again and again, with back-off, for as long as anybody subscribes.
    pub(crate) fn subscribe<F, Fut>(&self, session: F) -> Invalidations
    where
        F: Fn(Hub, usize) -> Fut + Send + 'static,
        Fut: std::future::Future<Output = Result<(), String>> + Send + 'static,
    {
        // subscribed first, so that the task finds somebody to tell
        let invalidations = self.hub.subscribe();
        let mut task = self
            .task
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if task.as_ref().is_none_or(|running| running.0.is_finished()) {
            // a new listener: its subscribers are all newer than what the last one missed
            self.hub
                .listened
                .store(false, std::sync::atomic::Ordering::Release);
            let listening = keep_listening(self.hub.clone(), session);
            *task = Some(crate::task::AbortOnDrop(tokio::spawn(listening)));
        }
        invalidations
    }
}

/// Runs `session` until nobody hears `hub` any more, pausing between attempts: briefly after a
/// connection that dropped, longer and longer while none can be made.
#[cfg(any(feature = "redis", feature = "postgres"))]
async fn keep_listening<F, Fut>(hub: Hub, session: F)
where
    F: Fn(Hub, usize) -> Fut,
    Fut: std::future::Future<Output = Result<(), String>>,
{
    let (mut backoff, mut attempt) = (FIRST_BACKOFF, 0usize);
    while hub.is_heard() {
        match session(hub.clone(), attempt).await {
            Ok(()) => {
                backoff = FIRST_BACKOFF;
                tracing::debug!(target: "tollgate::store", "the invalidation subscriber's connection dropped");
            }
            Err(error) => {
                attempt = attempt.wrapping_add(1);
                tracing::debug!(target: "tollgate::store", %error, "could not subscribe to invalidations");
            }
        }
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(MAX_BACKOFF);
    }
}
