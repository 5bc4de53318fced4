//! What every request of an idempotency layer shares: its settings, made by the builder.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use http::{HeaderName, Method, StatusCode};

use http::Response;

use super::body::IdempotencyBody;
use super::rejection::{Rejection, RejectionFn};
use crate::grpc::Wire;
use crate::store::{IdempotencyStore, TransactionStore};

/// Decides from its status whether a response is stored for replay.
pub(crate) type StoreWhen = Arc<dyn Fn(StatusCode) -> bool + Send + Sync>;

/// Decides from its `grpc-status` whether a gRPC response is stored for replay.
pub(crate) type StoreGrpcWhen = Arc<dyn Fn(i32) -> bool + Send + Sync>;

/// The gRPC codes of failures a retry may cure: CANCELLED, UNKNOWN, DEADLINE_EXCEEDED,
/// RESOURCE_EXHAUSTED, ABORTED, INTERNAL, UNAVAILABLE, DATA_LOSS.
pub(super) fn grpc_outcome_is_final(code: i32) -> bool {
    !matches!(code, 1 | 2 | 4 | 8 | 10 | 13 | 14 | 15)
}

/// What a request does when another request with the same key is still running.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum OnConcurrent {
    /// Answer `409 Conflict` with `Retry-After: 1` at once (gRPC: ABORTED).
    #[default]
    Reject,
    /// Wait up to this long for the first request to finish, then replay its response (or run,
    /// if it failed and released the key); `409` when it is still running then.
    Wait(Duration),
}

/// Everything a request needs besides the scope extractor; shared by every clone.
pub(crate) struct Settings {
    pub(crate) store: Arc<dyn IdempotencyStore>,
    pub(crate) prefix: String,
    pub(crate) header: HeaderName,
    pub(crate) required: bool,
    pub(crate) methods: Vec<Method>,
    pub(crate) fingerprint_headers: Vec<HeaderName>,
    /// Response headers never stored, so never replayed: `Set-Cookie` and the configured ones.
    pub(crate) unstored_headers: Vec<HeaderName>,
    pub(crate) body_limit: usize,
    /// The bytes of request bodies buffered across all requests at once.
    pub(crate) buffered: Arc<tokio::sync::Semaphore>,
    pub(crate) response_limit: usize,
    pub(crate) lease: Duration,
    pub(crate) retention: Duration,
    pub(crate) on_concurrent: OnConcurrent,
    pub(crate) store_when: StoreWhen,
    pub(crate) store_grpc_when: StoreGrpcWhen,
    /// Builds rejections' HTTP responses instead of the problem details.
    pub(crate) rejection: Option<RejectionFn>,
    /// Handlers run in a transaction of this store that records their response in its commit.
    pub(crate) transaction: Option<Arc<dyn TransactionStore>>,
}

impl fmt::Debug for Settings {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Settings")
            .field("store", &self.store)
            .field("prefix", &self.prefix)
            .field("header", &self.header)
            .field("required", &self.required)
            .field("methods", &self.methods)
            .field("fingerprint_headers", &self.fingerprint_headers)
            .field("body_limit", &self.body_limit)
            .field("response_limit", &self.response_limit)
            .field("lease", &self.lease)
            .field("retention", &self.retention)
            .field("on_concurrent", &self.on_concurrent)
            .field("in_transaction", &self.in_transaction())
            .finish_non_exhaustive()
    }
}

impl Settings {
    /// Whether handlers run in a transaction that records their response.
    pub(super) fn in_transaction(&self) -> bool {
        self.transaction.is_some()
    }

    /// `rejection` as this layer answers it (see [`Rejection::into_response`]).
    pub(super) fn reject<B>(
        &self,
        rejection: Rejection,
        wire: Wire,
    ) -> Response<IdempotencyBody<B>> {
        rejection.into_response(self.rejection.as_ref(), &self.header, wire)
    }
}
