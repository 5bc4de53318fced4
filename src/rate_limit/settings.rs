//! What a layer is configured with: its [`Settings`].

use std::sync::Arc;

use http::request::Parts;

use crate::key::{Key, MissingKey};
use crate::rate::RateCheck;
use crate::rate_client::RateClient;

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

/// A meter of the usage a response's body reports as it streams, made from its head.
pub(crate) type MeterFn =
    Arc<dyn Fn(&http::response::Parts) -> Box<dyn super::Meter> + Send + Sync>;

/// Where the actual cost of an admitted request comes from.
#[derive(Clone)]
pub(crate) enum Settle {
    /// The response head, read by the layer's function.
    Head(SettleFn),
    /// The bytes of the response body sent, counted as they go out.
    BodyBytes,
    /// The usage the response body reports as it streams, read by a meter made from its head.
    Stream(MeterFn),
}

/// Everything a request needs besides the key extractor; shared by every clone of the service.
pub(crate) struct Settings {
    /// The store's rate checks, behind what this copy keeps: tiers, slices, cached denials.
    pub(crate) client: Arc<RateClient>,
    pub(crate) cost: Option<CostFn>,
    /// Where the actual cost comes from, to settle what the request reserved.
    pub(crate) settle: Option<Settle>,
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

    /// The check of `cost` for `key`: a check that will be settled is a reservation, whose
    /// store keeps where it went.
    pub(crate) fn check(&self, key: Key, cost: u64) -> RateCheck {
        if self.settle.is_some() {
            RateCheck::reservation(key, cost)
        } else {
            RateCheck::new(key, cost)
        }
    }
}

debug_fields!(Settings {
    client,
    missing_key,
    headers,
    shadow
});
