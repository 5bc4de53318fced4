//! Where shared state lives: the [`Store`] trait of atomic operations, and its backends.
//!
//! Every operation is one round trip and atomic on the server: one Lua script or one conditional
//! command, never a read-modify-write across round trips. Time comes from the store (`TIME` inside
//! the scripts), so clock skew between copies of a service cannot change a decision.
//!
//! - [`RedisStore`] (feature `redis`): Redis or Valkey, shared by every copy of the service.
//! - [`MemoryStore`]: the same semantics inside one process — for tests, docs and a single copy.
//!   Two processes with a `MemoryStore` each do **not** share limits.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;

use crate::key::Key;
use crate::rate_limit::{RateOutcome, RatePolicy};

mod memory;
#[cfg(feature = "redis")]
mod redis;

pub use memory::MemoryStore;
#[cfg(feature = "redis")]
pub use redis::{RedisStore, RedisStoreBuilder};

/// The future a [`Store`] operation returns: owned, `Send`, and bounded by the store's timeout.
pub type StoreFuture<T> = Pin<Box<dyn Future<Output = Result<T, StoreError>> + Send + 'static>>;

/// The atomic operations every backend provides.
///
/// Implementations must finish every future within their own timeout (a store that is down must
/// not hang a request) and must make each operation atomic with respect to every other caller of
/// the same backend, in any process.
pub trait Store: fmt::Debug + Send + Sync + 'static {
    /// Checks `cost` against every limit of `policy` for caller `key` and, only if all have room,
    /// charges all of them — in one atomic step.
    fn check_rate(&self, policy: &Arc<RatePolicy>, key: Key, cost: u64)
    -> StoreFuture<RateOutcome>;

    /// Sets `key` to `holder` only if `key` does not exist (SET NX), expiring after `ttl` (`None`:
    /// never). The loser learns the current holder in the same atomic step.
    fn claim(
        &self,
        key: String,
        holder: String,
        ttl: Option<Duration>,
    ) -> StoreFuture<ClaimOutcome>;

    /// Sets lock `key` to `token` for `lease` if it is free and, only then, draws the next fencing
    /// token from `fence_key` (same hash slot), which strictly increases per lock name.
    fn lock_acquire(
        &self,
        key: String,
        fence_key: String,
        token: String,
        lease: Duration,
    ) -> StoreFuture<LockAttempt>;

    /// Resets `key`'s expiry to `lease` from now, only while it holds `token`; `false` when it
    /// does not (expired, released, or taken over by another owner).
    fn extend_if_held(&self, key: String, token: String, lease: Duration) -> StoreFuture<bool>;

    /// Deletes `key` only while it holds `token`; `false` when it does not.
    fn delete_if_held(&self, key: String, token: String) -> StoreFuture<bool>;

    /// Looks up idempotency record `key` and, when there is none, claims it for a request with
    /// `fingerprint`, owned by `token`, for `lease` — in one atomic step.
    fn idem_begin(
        &self,
        key: String,
        fingerprint: String,
        token: String,
        lease: Duration,
    ) -> StoreFuture<IdemBegin>;

    /// Stores the encoded `response` in record `key`, kept for `retention`, only while `token`
    /// still owns the claim; `false` (and nothing written) otherwise.
    fn idem_complete(
        &self,
        key: String,
        token: String,
        response: Bytes,
        retention: Duration,
    ) -> StoreFuture<bool>;

    /// Deletes record `key` only while `token` still owns its claim.
    fn idem_release(&self, key: String, token: String) -> StoreFuture<bool>;

    /// Extends the claim on record `key` to `lease` from now, only while `token` owns it.
    fn idem_extend(&self, key: String, token: String, lease: Duration) -> StoreFuture<bool>;

    /// Succeeds when the store answers.
    fn ping(&self) -> StoreFuture<()>;
}

/// The answer to [`Store::idem_begin`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum IdemBegin {
    /// The key was new: this request owns it now and should run.
    Claimed,
    /// Another request with the same key and fingerprint is running.
    InFlight {
        /// The running request's remaining lease.
        lease_left: Duration,
    },
    /// The key was used with a different fingerprint.
    Mismatch,
    /// The key's request completed; its encoded response.
    Completed(Bytes),
}

/// The answer to [`Store::claim`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClaimOutcome {
    /// Whether this caller's write won.
    pub won: bool,
    /// The holder stored by the winner (this caller's holder when `won`), read in the same
    /// atomic step as the failed write.
    pub holder: String,
}

/// The answer to [`Store::lock_acquire`].
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

/// How long a lock name's fencing counter is kept after its last acquisition. A counter that
/// expires restarts above every earlier token (see `scripts/lock_acquire.lua`).
pub(crate) const FENCE_TTL: Duration = Duration::from_secs(30 * 86_400);

impl<T: Store + ?Sized> Store for Arc<T> {
    fn check_rate(
        &self,
        policy: &Arc<RatePolicy>,
        key: Key,
        cost: u64,
    ) -> StoreFuture<RateOutcome> {
        (**self).check_rate(policy, key, cost)
    }

    fn claim(
        &self,
        key: String,
        holder: String,
        ttl: Option<Duration>,
    ) -> StoreFuture<ClaimOutcome> {
        (**self).claim(key, holder, ttl)
    }

    fn lock_acquire(
        &self,
        key: String,
        fence_key: String,
        token: String,
        lease: Duration,
    ) -> StoreFuture<LockAttempt> {
        (**self).lock_acquire(key, fence_key, token, lease)
    }

    fn extend_if_held(&self, key: String, token: String, lease: Duration) -> StoreFuture<bool> {
        (**self).extend_if_held(key, token, lease)
    }

    fn delete_if_held(&self, key: String, token: String) -> StoreFuture<bool> {
        (**self).delete_if_held(key, token)
    }

    fn idem_begin(
        &self,
        key: String,
        fingerprint: String,
        token: String,
        lease: Duration,
    ) -> StoreFuture<IdemBegin> {
        (**self).idem_begin(key, fingerprint, token, lease)
    }

    fn idem_complete(
        &self,
        key: String,
        token: String,
        response: Bytes,
        retention: Duration,
    ) -> StoreFuture<bool> {
        (**self).idem_complete(key, token, response, retention)
    }

    fn idem_release(&self, key: String, token: String) -> StoreFuture<bool> {
        (**self).idem_release(key, token)
    }

    fn idem_extend(&self, key: String, token: String, lease: Duration) -> StoreFuture<bool> {
        (**self).idem_extend(key, token, lease)
    }

    fn ping(&self) -> StoreFuture<()> {
        (**self).ping()
    }
}

/// Milliseconds for a store command, at least 1 (0 would mean "no expiry" or be rejected).
pub(crate) fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX).max(1)
}

/// What went wrong talking to a store.
#[derive(Debug)]
pub struct StoreError {
    kind: StoreErrorKind,
    source: Option<Box<dyn std::error::Error + Send + Sync>>,
}

/// The kind of a [`StoreError`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum StoreErrorKind {
    /// No answer within the store's timeout.
    Timeout,
    /// The store could not be reached, or the connection broke.
    Unavailable,
    /// The store answered with an error or with something this crate does not understand.
    Protocol,
}

impl StoreError {
    /// A new error of `kind`, caused by `source`.
    pub fn new(
        kind: StoreErrorKind,
        source: impl Into<Box<dyn std::error::Error + Send + Sync>>,
    ) -> Self {
        Self {
            kind,
            source: Some(source.into()),
        }
    }

    /// A timeout.
    pub fn timeout() -> Self {
        Self {
            kind: StoreErrorKind::Timeout,
            source: None,
        }
    }

    /// The kind of failure.
    pub fn kind(&self) -> StoreErrorKind {
        self.kind
    }
}

impl fmt::Display for StoreError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let what = match self.kind {
            StoreErrorKind::Timeout => "store timed out",
            StoreErrorKind::Unavailable => "store unavailable",
            StoreErrorKind::Protocol => "store protocol error",
        };
        match &self.source {
            Some(source) => write!(f, "{what}: {source}"),
            None => f.write_str(what),
        }
    }
}

impl std::error::Error for StoreError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.source
            .as_deref()
            .map(|e| e as &(dyn std::error::Error + 'static))
    }
}
