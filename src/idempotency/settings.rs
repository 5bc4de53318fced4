//! What every request of an idempotency layer shares: its settings, made by the builder.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use http::{HeaderName, Method, StatusCode};

use http::Response;

use super::body::IdempotencyBody;
use super::budget::BufferBudget;
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

/// What the layer does with a keyed request whose [scope](super::IdempotencyLayerBuilder::scope)
/// cannot be read — the caller is not named: the header is missing, no authentication layer ran.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum MissingScope {
    /// Answer `400 Bad Request` with problem details (gRPC: INVALID_ARGUMENT); nothing is claimed,
    /// read or stored.
    #[default]
    Reject,
    /// Answer with this status — `401 Unauthorized` where the scope is the caller's credential —
    /// and the same problem details (gRPC: UNAUTHENTICATED for `401`, PERMISSION_DENIED for
    /// `403`, else INVALID_ARGUMENT).
    RejectWith(StatusCode),
    /// Keep the keys of every such request in one namespace that all of them share, apart from
    /// every scope's: chosen on purpose, where those requests come from one trusted client. A
    /// request there that reuses another's key is replayed the other's response.
    Shared,
}

impl MissingScope {
    /// The status and gRPC code of the refusal; `None` for the shared namespace.
    pub(super) fn refusal(self) -> Option<(StatusCode, crate::grpc::Code)> {
        use crate::key::MissingKey;
        match self {
            Self::Reject => MissingKey::Reject.refusal(),
            Self::RejectWith(status) => MissingKey::RejectWith(status).refusal(),
            Self::Shared => None,
        }
    }
}

/// Everything a request needs besides the scope extractor; shared by every clone.
pub(crate) struct Settings {
    pub(crate) store: Arc<dyn IdempotencyStore>,
    pub(crate) prefix: String,
    pub(crate) header: HeaderName,
    pub(crate) required: bool,
    pub(crate) missing_scope: MissingScope,
    pub(crate) methods: Vec<Method>,
    pub(crate) fingerprint_headers: Vec<HeaderName>,
    /// Response headers never stored, so never replayed: `Set-Cookie` and the configured ones.
    pub(crate) unstored_headers: Vec<HeaderName>,
    pub(crate) body_limit: usize,
    /// How long a request body may take to arrive whole.
    pub(crate) body_timeout: Duration,
    /// The bytes of request bodies buffered across all requests at once, and per caller.
    pub(crate) buffered: Arc<BufferBudget>,
    /// A body's room in the budget is its caller's, by the scope: false where the layer is
    /// unscoped (every request has the one scope).
    pub(crate) share_by_scope: bool,
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
            .field("missing_scope", &self.missing_scope)
            .field("methods", &self.methods)
            .field("fingerprint_headers", &self.fingerprint_headers)
            .field("body_limit", &self.body_limit)
            .field("body_timeout", &self.body_timeout)
            .field("buffered", &self.buffered)
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
