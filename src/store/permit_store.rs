//! [`PermitStore`]: permits with leases and a fair queue, the capability the concurrency-limit
//! layer needs.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use super::{Hold, Invalidations, LimitsStore, StoreError, StoreFuture};

/// Permits: at most `limit` holders of a key at once, each with a lease and a fencing token —
/// the capability the [concurrency-limit layer](crate::concurrency) needs.
///
/// Each operation is atomic and bounded by the store's timeout, as for [`RateStore`](super::RateStore). A write
/// that takes a `deadline` runs only if the store receives it before then: see
/// [Deadlines](crate::store#deadlines).
///
/// A write's arguments come as one request ([`PermitRequest`]): the methods' docs name its fields.
pub trait PermitStore: fmt::Debug + Send + Sync + 'static {
    /// How long a call may take before it fails with [`StoreErrorKind::Timeout`](super::StoreErrorKind::Timeout): the
    /// deadline callers give their writes.
    fn timeout(&self) -> Duration;

    /// Takes one of the `limit` permits of `hold.key` for `hold.token`, for `lease`, if one is free
    /// for it and, only then, draws a fencing token from `fence_key` (same hash slot) as
    /// [`LockStore::lock_acquire`](super::LockStore::lock_acquire) does: strictly increasing per key. A permit that `hold.token`
    /// holds already is taken again with a fresh lease and a fresh fencing token: the same attempt
    /// run twice takes one permit. Received after `deadline`, it does nothing.
    ///
    /// Permits go to waiters first, in arrival order. With `wait` set, a holder that finds no
    /// permit free for it keeps a place in the key's queue for `wait` from now (each attempt renews
    /// it; [`permit_release`](Self::permit_release) gives it up); a permit is free for it while
    /// fewer waiters arrived before it than permits are free (leases that ended do not count).
    /// Without `wait`, a permit is free only when more are free than waiters queue.
    fn permit_acquire(
        &self,
        request: PermitRequest,
        deadline: Instant,
    ) -> StoreFuture<PermitAttempt>;

    /// Resets the permit's lease to `lease` from now, only while `hold.token` holds one of
    /// `hold.key`'s permits; `false` when it does not (released or expired). Received after
    /// `deadline`, it does nothing.
    fn permit_extend(&self, hold: Hold, lease: Duration, deadline: Instant) -> StoreFuture<bool>;

    /// Gives the permit back, only while `hold.token` holds one; `false` when it does not. A call
    /// re-sent after a lost reply answers as its first run did. A place `hold.token` keeps in the
    /// key's queue is given up too.
    fn permit_release(&self, hold: Hold) -> StoreFuture<bool>;

    /// Reads the permits of `key` and its queue of waiters, changing neither: the permits whose
    /// lease has not ended, each with the time it has left, and the waiters whose place has not
    /// lapsed — on the store's clock, in one atomic step. For tools that show a concurrency
    /// limit to an operator; the layer never calls it.
    ///
    /// The default fails with [`StoreErrorKind::Unsupported`](super::StoreErrorKind::Unsupported), so
    /// that a backend written before this method keeps building.
    fn permit_usage(&self, key: &str) -> StoreFuture<PermitUsage> {
        let _ = key;
        Box::pin(std::future::ready(Err(StoreError::unsupported(
            "permit_usage",
        ))))
    }

    /// Where the limits in force of a concurrency limit built with
    /// [`build_in_store`](crate::concurrency::ConcurrencyLimitLayerBuilder::build_in_store) are
    /// kept; `None` (the default): this store keeps none.
    fn permit_limits(&self) -> Option<&dyn LimitsStore> {
        None
    }

    /// A subscription to the store's broadcast of changes made through any copy — of the limits
    /// in force, here (see [`RateStore::invalidations`](super::RateStore::invalidations));
    /// `None` (the default): the store broadcasts nothing, and each copy reads the limits in
    /// force again every refresh.
    fn permit_invalidations(&self) -> Option<Invalidations> {
        None
    }
}

/// The answer to [`PermitStore::permit_usage`]: the permits of a key in use, and its waiters.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct PermitUsage {
    /// The time each permit in use has left on its lease, in whole milliseconds, shortest
    /// first: as many entries as permits are held.
    pub leases_left: Vec<Duration>,
    /// How many waiters keep a place in the key's queue.
    pub waiting: u32,
}

impl PermitUsage {
    /// Permits held with `leases_left` (sorted here, shortest first), `waiting` waiters queued.
    pub fn new(mut leases_left: Vec<Duration>, waiting: u32) -> Self {
        leases_left.sort_unstable();
        Self {
            leases_left,
            waiting,
        }
    }

    /// How many permits are in use.
    pub fn in_use(&self) -> usize {
        self.leases_left.len()
    }
}

/// What [`PermitStore::permit_acquire`] takes: one of the `limit` permits of `hold.key` for
/// `hold.token`, for `lease`, fenced by the counter at `fence_key`; with `wait`, a place in the
/// key's queue for that long.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct PermitRequest {
    /// The permits' key and the holder's token.
    pub hold: Hold,
    /// The key's fencing counter (same hash slot as the permits).
    pub fence_key: String,
    /// How many permits the key has.
    pub limit: u32,
    /// How long a permit lasts unless extended.
    pub lease: Duration,
    /// How long the holder keeps its place in the queue; `None`: it does not queue.
    pub wait: Option<Duration>,
}

impl PermitRequest {
    /// One of `limit` permits of `hold.key` for `lease`, fenced at `fence_key`, queueing for
    /// `wait`.
    pub fn new(
        hold: Hold,
        fence_key: impl Into<String>,
        limit: u32,
        lease: Duration,
        wait: Option<Duration>,
    ) -> Self {
        Self {
            hold,
            fence_key: fence_key.into(),
            limit,
            lease,
            wait,
        }
    }
}

/// The answer to [`PermitStore::permit_acquire`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PermitAttempt {
    /// A permit is ours; the fencing token of this acquisition.
    Acquired {
        /// Strictly greater than every earlier token of the same key.
        fence: u64,
    },
    /// No permit is free for this holder: every permit is held, or waiters that arrived
    /// before it take those that are free.
    Full {
        /// The shortest remaining lease among the held permits (zero when none is held).
        next_free: Duration,
        /// How many waiters are ahead of this holder in the key's queue.
        ahead: u32,
    },
}

impl<T: PermitStore + ?Sized> PermitStore for Arc<T> {
    fn timeout(&self) -> Duration {
        (**self).timeout()
    }

    fn permit_acquire(
        &self,
        request: PermitRequest,
        deadline: Instant,
    ) -> StoreFuture<PermitAttempt> {
        (**self).permit_acquire(request, deadline)
    }

    fn permit_extend(&self, hold: Hold, lease: Duration, deadline: Instant) -> StoreFuture<bool> {
        (**self).permit_extend(hold, lease, deadline)
    }

    fn permit_release(&self, hold: Hold) -> StoreFuture<bool> {
        (**self).permit_release(hold)
    }

    fn permit_usage(&self, key: &str) -> StoreFuture<PermitUsage> {
        (**self).permit_usage(key)
    }

    fn permit_limits(&self) -> Option<&dyn LimitsStore> {
        (**self).permit_limits()
    }

    fn permit_invalidations(&self) -> Option<Invalidations> {
        (**self).permit_invalidations()
    }
}
