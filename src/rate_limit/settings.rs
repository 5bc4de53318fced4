//! What a layer is configured with: its [`Settings`].

use std::sync::Arc;

use http::request::Parts;

use super::deny_cache::DenyCache;
use super::invalidated::Listener;
use super::tiers::Tiers;
use crate::key::MissingKey;
use crate::pace::OncePerSecond;
use crate::policy::OnStoreError;
use crate::store::RateStore;

/// The response to a denied HTTP request, built from its decision.
pub(crate) type RejectionFn =
    Arc<dyn Fn(&super::RateLimitDecision) -> http::Response<bytes::Bytes> + Send + Sync>;

/// Adds metadata to a denied gRPC call's trailers-only response.
pub(crate) type GrpcMetadataFn =
    Arc<dyn Fn(&super::RateLimitDecision, &mut http::HeaderMap) + Send + Sync>;

/// The cost of a request, computed from its head.
pub(crate) type CostFn = Arc<dyn Fn(&Parts) -> u64 + Send + Sync>;

/// The actual cost of an admitted request, read from its response head.
pub(crate) type SettleFn = Arc<dyn Fn(&http::response::Parts) -> Option<u64> + Send + Sync>;

/// Where the actual cost of an admitted request comes from.
#[derive(Clone)]
pub(crate) enum Settle {
    /// The response head, read by the layer's function.
    Head(SettleFn),
    /// The bytes of the response body sent, counted as they go out.
    BodyBytes,
}

/// Everything a request needs besides the key extractor; shared by every clone of the service.
pub(crate) struct Settings {
    pub(crate) store: Arc<dyn RateStore>,
    /// The policies a request is checked against, one per request.
    pub(crate) tiers: Tiers,
    pub(crate) cost: Option<CostFn>,
    /// Where the actual cost comes from, to settle what the request reserved.
    pub(crate) settle: Option<Settle>,
    pub(crate) on_store_error: OnStoreError,
    pub(crate) missing_key: MissingKey,
    /// The detail of a rejected request without a key: where the key is read from.
    pub(crate) missing_key_message: Box<str>,
    pub(crate) headers: bool,
    /// Decide and count, never reject.
    pub(crate) shadow: bool,
    /// Builds denials' HTTP responses instead of the problem details.
    pub(crate) rejection: Option<RejectionFn>,
    /// Adds to denied gRPC calls' metadata.
    pub(crate) grpc_metadata: Option<GrpcMetadataFn>,
    /// `RateLimit` members carry the caller's `pk`.
    pub(crate) partition_key: bool,
    /// Denials by the store, of every tier (a cached denial answers for its own tier only).
    pub(crate) deny_cache: Option<Arc<DenyCache>>,
    /// Drops the cached denials that the store says are stale.
    pub(crate) listener: Listener,
    /// Store failures are logged at warn at most once a second (the rest at debug): an outage
    /// under load must not flood the log.
    pub(crate) last_warning: OncePerSecond,
}

impl Settings {
    /// What a request reserves or is charged: its [`cost`](super::RateLimitLayerBuilder::cost)
    /// (1 without one). A request that will be settled reserves at least 1, so that an
    /// estimate of 0 — often a number the client wrote — is still checked (refused once the
    /// budget is spent) and settled to what it used; a cost of 0 that nothing settles passes
    /// free, as the function decided.
    pub(crate) fn cost_of(&self, parts: &Parts) -> u64 {
        let cost = self.cost.as_ref().map_or(1, |cost| cost(parts));
        if self.settle.is_some() {
            cost.max(1)
        } else {
            cost
        }
    }
}

debug_fields!(Settings {
    store,
    tiers,
    on_store_error,
    missing_key,
    headers,
    shadow
});
