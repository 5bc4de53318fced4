//! [`IdempotencyStore`]: records claimed with a token and a lease, the capability the
//! idempotency layer needs.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use tokio::time::Instant;

use super::{Hold, StoreError, StoreFuture};

/// Idempotency records claimed with a token and a lease: the capability the idempotency layer
/// needs.
///
/// Each operation is atomic and bounded by the store's timeout, as for [`RateStore`](super::RateStore); all but
/// [`idempotency_begin`](Self::idempotency_begin) act only while `hold.token` owns the record. A
/// write that takes a `deadline` runs only if the store receives it before then: see
/// [Deadlines](crate::store#deadlines).
///
/// A write's arguments come as one request ([`BeginRequest`], [`CompleteRequest`]): the methods' docs name its fields.
pub trait IdempotencyStore: fmt::Debug + Send + Sync + 'static {
    /// How long a call may take before it fails with [`StoreErrorKind::Timeout`](super::StoreErrorKind::Timeout): the
    /// deadline callers give their writes.
    fn timeout(&self) -> Duration;

    /// Looks up idempotency record `hold.key` and, when there is none, claims it for a request with
    /// `fingerprint`, owned by `hold.token`, for `lease` — in one atomic step. A record that
    /// `hold.token` claimed and still runs is claimed again (its lease reset). Received after
    /// `deadline`, it does nothing.
    fn idempotency_begin(
        &self,
        request: BeginRequest,
        deadline: Instant,
    ) -> StoreFuture<IdempotencyBegin>;

    /// Stores the encoded `response` in record `hold.key`, kept for `retention`, only while
    /// `hold.token` still owns the claim; `false` (and nothing written) otherwise. A record that
    /// `hold.token` completed with this very `response` already answers `true` again, unchanged.
    /// Received after `deadline`, it does nothing.
    fn idempotency_complete(
        &self,
        request: CompleteRequest,
        deadline: Instant,
    ) -> StoreFuture<bool>;

    /// Deletes record `hold.key` only while `hold.token` still owns its claim and it is not
    /// completed. A call re-sent after a lost reply answers as its first run did.
    fn idempotency_release(&self, hold: Hold) -> StoreFuture<bool>;

    /// Extends the claim on record `hold.key` to `lease` from now, only while `hold.token` owns it
    /// and it is not completed. Received after `deadline`, it does nothing.
    fn idempotency_extend(
        &self,
        hold: Hold,
        lease: Duration,
        deadline: Instant,
    ) -> StoreFuture<bool>;

    /// Reads idempotency record `key`, changing nothing: absent, in flight with the time its
    /// claim's lease has left, or completed with its encoded response and the time it is kept
    /// still, each with its age (since its request claimed it) — on the store's clock, in one atomic step. A completion that replicas have not
    /// acknowledged yet (durable writes) reads as in flight, as
    /// [`idempotency_begin`](Self::idempotency_begin) answers it. For tools that show a record
    /// to an operator; the layer never calls it.
    ///
    /// The default fails with [`StoreErrorKind::Unsupported`](super::StoreErrorKind::Unsupported), so
    /// that a backend written before this method keeps building.
    fn idempotency_state(&self, key: &str) -> StoreFuture<IdempotencyState> {
        let _ = key;
        Box::pin(std::future::ready(Err(StoreError::unsupported(
            "idempotency_state",
        ))))
    }
}

/// The answer to [`IdempotencyStore::idempotency_state`]: a record as the store holds it.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum IdempotencyState {
    /// No record under the key: never used, released, or expired.
    Absent,
    /// A request with the key runs.
    InFlight {
        /// The time its claim's lease has left, in whole milliseconds.
        lease_left: Duration,
        /// How long ago the request claimed the record, in whole milliseconds; `None` for a
        /// record written by a version of the store that did not keep it.
        age: Option<Duration>,
    },
    /// The key's request completed.
    Completed {
        /// The encoded response, as [`IdempotencyBegin::Completed`] replays it.
        response: Bytes,
        /// How long the record is kept still, in whole milliseconds.
        retention_left: Duration,
        /// How long ago the request claimed the record, in whole milliseconds; `None` for a
        /// record written by a version of the store that did not keep it.
        age: Option<Duration>,
    },
}

impl IdempotencyState {
    /// The status of the completed response, when the record is completed and holds a response
    /// as the [idempotency layer](crate::idempotency) encodes it; `None` otherwise.
    ///
    /// ```
    /// use tollgate::store::IdempotencyState;
    ///
    /// assert_eq!(IdempotencyState::Absent.response_status(), None);
    /// ```
    pub fn response_status(&self) -> Option<http::StatusCode> {
        match self {
            Self::Completed { response, .. } => {
                super::StoredResponse::decode(response).map(|r| r.status)
            }
            _ => None,
        }
    }
}

/// What [`IdempotencyStore::idempotency_begin`] takes: record `hold.key`, claimed for a request
/// with `fingerprint` by `hold.token`, for `lease`.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct BeginRequest {
    /// The record's key and the claimer's token.
    pub hold: Hold,
    /// Names the request the key is used with.
    pub fingerprint: String,
    /// How long the claim lasts unless extended.
    pub lease: Duration,
}

impl BeginRequest {
    /// `hold` for the request named by `fingerprint`, for `lease`.
    pub fn new(hold: Hold, fingerprint: impl Into<String>, lease: Duration) -> Self {
        Self {
            hold,
            fingerprint: fingerprint.into(),
            lease,
        }
    }
}

/// What [`IdempotencyStore::idempotency_complete`] stores: the encoded `response` in record
/// `hold.key`, kept for `retention`.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct CompleteRequest {
    /// The record's key and the claimer's token.
    pub hold: Hold,
    /// The encoded response.
    pub response: Bytes,
    /// How long the record is kept.
    pub retention: Duration,
}

impl CompleteRequest {
    /// `response` for `hold`, kept for `retention`.
    pub fn new(hold: Hold, response: impl Into<Bytes>, retention: Duration) -> Self {
        Self {
            hold,
            response: response.into(),
            retention,
        }
    }
}

/// The answer to [`IdempotencyStore::idempotency_begin`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum IdempotencyBegin {
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

impl<T: IdempotencyStore + ?Sized> IdempotencyStore for Arc<T> {
    fn timeout(&self) -> Duration {
        (**self).timeout()
    }

    fn idempotency_begin(
        &self,
        request: BeginRequest,
        deadline: Instant,
    ) -> StoreFuture<IdempotencyBegin> {
        (**self).idempotency_begin(request, deadline)
    }

    fn idempotency_complete(
        &self,
        request: CompleteRequest,
        deadline: Instant,
    ) -> StoreFuture<bool> {
        (**self).idempotency_complete(request, deadline)
    }

    fn idempotency_release(&self, hold: Hold) -> StoreFuture<bool> {
        (**self).idempotency_release(hold)
    }

    fn idempotency_extend(
        &self,
        hold: Hold,
        lease: Duration,
        deadline: Instant,
    ) -> StoreFuture<bool> {
        (**self).idempotency_extend(hold, lease, deadline)
    }

    fn idempotency_state(&self, key: &str) -> StoreFuture<IdempotencyState> {
        (**self).idempotency_state(key)
    }
}
