//! [`TransactionStore`]: runs of a handler inside a transaction of the store that records their
//! output in the same commit — the capability behind
//! [`IdempotencyLayer::in_transaction`](crate::idempotency::IdempotencyLayer::in_transaction).

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

use bytes::Bytes;

use super::{StoreError, StoreFuture};

/// Runs of work, each in a transaction of the store that also records the work's output, so
/// that both stand or neither does: the capability the idempotency layer's
/// [transaction path](crate::idempotency::IdempotencyLayer::in_transaction) needs.
///
/// A run holds its key for as long as its transaction is open, and no longer: a run that fails,
/// is dropped, or whose process dies frees the key as its transaction ends. Bounded by the
/// store's timeout, as every store call.
pub trait TransactionStore: fmt::Debug + Send + Sync + 'static {
    /// Begins a run of `start.key`: the recorded output of a run that committed, or a
    /// transaction, open and holding the key — or word that another run holds it, or that the
    /// key was recorded with another fingerprint. The transaction ends on the server should it
    /// stay idle for `start.idle` (its copy cut off from the store, or dead).
    fn begin_run(&self, start: RunStart) -> StoreFuture<RunBegun>;
}

/// What [`TransactionStore::begin_run`] begins.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct RunStart {
    /// The key the run is recorded under.
    pub key: String,
    /// Names the request the key was used with: another one is a mismatch.
    pub fingerprint: String,
    /// How long the record is kept after the commit.
    pub retention: Duration,
    /// How long the transaction may stay idle before the server ends it.
    pub idle: Duration,
}

impl RunStart {
    /// A run of `key` for the request named by `fingerprint`, recorded for `retention`, its
    /// transaction ended by the server once idle for `idle`.
    pub fn new(key: &str, fingerprint: &str, retention: Duration, idle: Duration) -> Self {
        Self {
            key: key.to_owned(),
            fingerprint: fingerprint.to_owned(),
            retention,
            idle,
        }
    }
}

/// How a run began: the answer to [`TransactionStore::begin_run`].
#[derive(Debug)]
pub enum RunBegun {
    /// The key's transaction is open and holds the key: run the work.
    Running(Box<dyn Run>),
    /// A run of the key committed: its output.
    Recorded(Bytes),
    /// A run of the key committed with another fingerprint.
    Mismatch,
    /// Another run holds the key.
    InFlight,
}

/// A run whose transaction is open and holds its key. Dropped without [`commit`](Run::commit)
/// or [`roll_back`](Run::roll_back), its transaction is rolled back.
pub trait Run: fmt::Debug + Send + 'static {
    /// Hands the work its transaction: puts the store's handle of it (for PostgreSQL an
    /// [`OnceTx`](crate::store::OnceTx)) in the request's `extensions`.
    fn lend(&self, extensions: &mut http::Extensions);

    /// Records `output` and commits. A commit whose answer was lost is looked up before
    /// anything is said.
    fn commit(self: Box<Self>, output: Bytes) -> RunFuture<Result<(), CommitError>>;

    /// Rolls the run back: nothing of it stands, and the key is free.
    fn roll_back(self: Box<Self>) -> RunFuture<()>;
}

/// The future of a [`Run`]'s ending: owned and `Send`.
pub type RunFuture<T> = Pin<Box<dyn Future<Output = T> + Send + 'static>>;

/// Why a run's commit did not stand.
#[derive(Debug)]
#[non_exhaustive]
pub enum CommitError {
    /// Nothing of the run stands (the key is free).
    NotCommitted(StoreError),
    /// The commit's answer was lost and its outcome could not be looked up: the run may stand.
    Unknown(StoreError),
    /// The key was recorded by a run with another fingerprint.
    Mismatch,
}

impl fmt::Display for CommitError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::NotCommitted(e) => write!(f, "the run did not commit: {e}"),
            Self::Unknown(e) => write!(f, "the run's commit is unknown: {e}"),
            Self::Mismatch => f.write_str("the key was recorded with another fingerprint"),
        }
    }
}

impl std::error::Error for CommitError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Self::NotCommitted(e) | Self::Unknown(e) => Some(e),
            Self::Mismatch => None,
        }
    }
}
