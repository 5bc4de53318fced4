//! [`LockStore`]: conditional writes with a holder, the capability claims and locks need.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use super::{Hold, StoreError, StoreFuture};

/// Conditional writes with a holder: the capability claims and locks need.
///
/// Each operation is atomic and bounded by the store's timeout, as for [`RateStore`](super::RateStore). A write
/// that takes a `deadline` runs only if the store receives it before then: see
/// [Deadlines](crate::store#deadlines).
///
/// A write's arguments come as one request ([`ClaimRequest`], [`LockRequest`]): the methods' docs name its fields.
pub trait LockStore: fmt::Debug + Send + Sync + 'static {
    /// How long a call may take before it fails with [`StoreErrorKind::Timeout`](super::StoreErrorKind::Timeout): the
    /// deadline callers give their writes.
    fn timeout(&self) -> Duration;

    /// Sets `key` to `holder` only if `key` does not exist (SET NX), expiring after `ttl` (`None`:
    /// never). The loser learns the current holder in the same atomic step. A key that `holder`
    /// holds already counts as won: the same attempt run twice wins twice. Received after
    /// `deadline`, it does nothing.
    fn claim(&self, request: ClaimRequest, deadline: Instant) -> StoreFuture<ClaimOutcome>;

    /// Sets lock `hold.key` to `hold.token` for `lease` if it is free and, only then, draws the
    /// next fencing token from `fence_key` (same hash slot): above both the counter's last value
    /// and the store time in microseconds, so it strictly increases per lock name even across a
    /// counter lost or restored stale. The same attempt again (a lock that holds the token already)
    /// is acquired again with the same fencing token and a fresh lease. Received after `deadline`,
    /// it does nothing.
    fn lock_acquire(&self, request: LockRequest, deadline: Instant) -> StoreFuture<LockAttempt>;

    /// Resets `hold.key`'s expiry to `lease` from now, only while it holds `hold.token`; `false`
    /// when it does not (expired, released, or taken over by another owner). Received after
    /// `deadline`, it does nothing.
    fn extend_if_held(&self, hold: Hold, lease: Duration, deadline: Instant) -> StoreFuture<bool>;

    /// Deletes `hold.key` only while it holds `hold.token`; `false` when it does not. A call
    /// re-sent after a lost reply answers as its first run did.
    fn delete_if_held(&self, hold: Hold) -> StoreFuture<bool>;

    /// Reads lock `key` and its fencing counter `fence_key` (same hash slot), changing neither:
    /// who holds the lock, for how long still, and the last fencing token drawn — on the store's
    /// clock, in one atomic step. For tools that show a lock to an operator, and for the
    /// provider's pauses an [outbound limit](crate::outbound) shares (which are claims).
    ///
    /// The default fails with [`StoreErrorKind::Unsupported`](super::StoreErrorKind::Unsupported), so
    /// that a backend written before this method keeps building.
    fn lock_state(&self, key: &str, fence_key: &str) -> StoreFuture<LockState> {
        let _ = (key, fence_key);
        Box::pin(std::future::ready(Err(StoreError::unsupported(
            "lock_state",
        ))))
    }
}

/// The answer to [`LockStore::lock_state`]: a lock as the store holds it.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct LockState {
    /// The token of the owner holding the lock; `None` when the lock is free (never taken,
    /// released, or its lease ended).
    pub holder: Option<String>,
    /// How long the holder's lease has left, in whole milliseconds; zero when free.
    pub lease_left: Duration,
    /// The last fencing token drawn for the lock name — the holder's, while it is held; `None`
    /// when none was drawn within the counter's lifetime ([`fence_ttl`](super::fence_ttl)).
    pub fence: Option<u64>,
}

impl LockState {
    /// A lock held by `holder` for `lease_left` more, with fencing token `fence`; `holder`
    /// `None`: free, its counter at `fence`.
    pub fn new(holder: Option<String>, lease_left: Duration, fence: Option<u64>) -> Self {
        Self {
            holder,
            lease_left,
            fence,
        }
    }
}

/// What [`LockStore::claim`] writes: `key` set to `holder` only if `key` does not exist,
/// expiring after `ttl` (`None`: never).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct ClaimRequest {
    /// The store key.
    pub key: String,
    /// Who claims it.
    pub holder: String,
    /// How long the claim lasts; `None`: for ever.
    pub ttl: Option<Duration>,
}

impl ClaimRequest {
    /// `key` for `holder`, for `ttl`.
    pub fn new(key: impl Into<String>, holder: impl Into<String>, ttl: Option<Duration>) -> Self {
        Self {
            key: key.into(),
            holder: holder.into(),
            ttl,
        }
    }
}

/// What [`LockStore::lock_acquire`] takes: lock `hold.key` for `hold.token`, for `lease`, its
/// fencing counter at `fence_key`.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct LockRequest {
    /// The lock's key and its owner's token.
    pub hold: Hold,
    /// The lock's fencing counter (same hash slot as the lock).
    pub fence_key: String,
    /// How long the lock lasts unless extended.
    pub lease: Duration,
}

impl LockRequest {
    /// `hold` for `lease`, fenced by the counter at `fence_key`.
    pub fn new(hold: Hold, fence_key: impl Into<String>, lease: Duration) -> Self {
        Self {
            hold,
            fence_key: fence_key.into(),
            lease,
        }
    }
}

/// The answer to [`LockStore::claim`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClaimOutcome {
    /// Whether this caller's write won.
    pub won: bool,
    /// The holder stored by the winner (this caller's holder when `won`), read in the same
    /// atomic step as the failed write.
    pub holder: String,
    /// Whether the claim this caller lost to is still pending: made with durable writes
    /// (`wait_replicas`) and not yet acknowledged by the replicas, so it may yet be undone — the
    /// name is in progress, not taken. Always `false` on a store without durable writes.
    pub pending: bool,
}

/// The answer to [`LockStore::lock_acquire`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LockAttempt {
    /// The lock is ours; the fencing token of this acquisition.
    Acquired {
        /// Strictly greater than every earlier token of the same lock name.
        fence: u64,
    },
    /// Another owner holds the lock for about this long still.
    Held {
        /// The other owner's remaining lease.
        lease_left: Duration,
    },
}

impl<T: LockStore + ?Sized> LockStore for Arc<T> {
    fn timeout(&self) -> Duration {
        (**self).timeout()
    }

    fn claim(&self, request: ClaimRequest, deadline: Instant) -> StoreFuture<ClaimOutcome> {
        (**self).claim(request, deadline)
    }

    fn lock_acquire(&self, request: LockRequest, deadline: Instant) -> StoreFuture<LockAttempt> {
        (**self).lock_acquire(request, deadline)
    }

    fn extend_if_held(&self, hold: Hold, lease: Duration, deadline: Instant) -> StoreFuture<bool> {
        (**self).extend_if_held(hold, lease, deadline)
    }

    fn delete_if_held(&self, hold: Hold) -> StoreFuture<bool> {
        (**self).delete_if_held(hold)
    }

    fn lock_state(&self, key: &str, fence_key: &str) -> StoreFuture<LockState> {
        (**self).lock_state(key, fence_key)
    }
}
