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

    /// Succeeds when the store answers.
    fn ping(&self) -> StoreFuture<()>;
}

impl<T: Store + ?Sized> Store for Arc<T> {
    fn check_rate(
        &self,
        policy: &Arc<RatePolicy>,
        key: Key,
        cost: u64,
    ) -> StoreFuture<RateOutcome> {
        (**self).check_rate(policy, key, cost)
    }

    fn ping(&self) -> StoreFuture<()> {
        (**self).ping()
    }
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
