//! What a layer is configured with: its [`Settings`], and the policies for a failing store and a
//! missing key.

use std::fmt;
use std::sync::Arc;

use http::request::Parts;

use super::deny_cache::DenyCache;
use super::tiers::Tiers;
use crate::store::RateStore;

/// What a rate-limit layer does when its store fails or does not answer in time.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[cfg_attr(feature = "serde", derive(serde::Deserialize))]
#[cfg_attr(
    feature = "serde",
    serde(rename_all = "snake_case", deny_unknown_fields)
)]
#[non_exhaustive]
pub enum OnStoreError {
    /// Let the request through, log a warning, and mark the decision
    /// [`DecisionSource::StoreUnavailable`](super::DecisionSource::StoreUnavailable). Availability over strictness: the default.
    #[default]
    Allow,
    /// Answer `503 Service Unavailable` with `Retry-After: 1` (gRPC: UNAVAILABLE).
    Deny,
    /// Limit in process while the store is out of reach, each quota divided by `copies` — the
    /// number of copies expected to share the load — so that together they stay near the limit.
    LocalFallback {
        /// How many copies of the service share the traffic (at least 1).
        copies: u32,
    },
}

/// What a rate-limit layer does with a request whose key cannot be extracted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum MissingKey {
    /// Answer `400 Bad Request` with a short body naming the problem (gRPC: INVALID_ARGUMENT).
    #[default]
    Reject,
    /// Let the request through unlimited.
    Allow,
}

/// The response to a denied HTTP request, built from its decision.
pub(crate) type RejectionFn =
    Arc<dyn Fn(&super::RateLimitDecision) -> http::Response<bytes::Bytes> + Send + Sync>;

/// Adds metadata to a denied gRPC call's trailers-only response.
pub(crate) type GrpcMetadataFn =
    Arc<dyn Fn(&super::RateLimitDecision, &mut http::HeaderMap) + Send + Sync>;

/// The cost of a request, computed from its head.
pub(crate) type CostFn = Arc<dyn Fn(&Parts) -> u64 + Send + Sync>;

/// Everything a request needs besides the key extractor; shared by every clone of the service.
pub(crate) struct Settings {
    pub(crate) store: Arc<dyn RateStore>,
    /// The policies a request is checked against, one per request.
    pub(crate) tiers: Tiers,
    pub(crate) cost: Option<CostFn>,
    pub(crate) on_store_error: OnStoreError,
    pub(crate) missing_key: MissingKey,
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
    pub(crate) deny_cache: Option<DenyCache>,
    /// Store failures are logged at warn at most once a second (the rest at debug): an outage
    /// under load must not flood the log.
    pub(crate) last_warning: OncePerSecond,
}

/// Lets one event through per second.
#[derive(Debug)]
pub(crate) struct OncePerSecond {
    start: std::time::Instant,
    last: std::sync::atomic::AtomicU64,
}

impl OncePerSecond {
    pub(crate) fn new() -> Self {
        Self {
            start: std::time::Instant::now(),
            last: std::sync::atomic::AtomicU64::new(0),
        }
    }

    /// Whether a second has passed since the last event let through.
    pub(crate) fn ready(&self) -> bool {
        use std::sync::atomic::Ordering;
        // +1: the first call is let through at once
        let now = self.start.elapsed().as_secs() + 1;
        let last = self.last.load(Ordering::Relaxed);
        now > last
            && self
                .last
                .compare_exchange(last, now, Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
    }
}

impl fmt::Debug for Settings {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Settings")
            .field("store", &self.store)
            .field("tiers", &self.tiers)
            .field("on_store_error", &self.on_store_error)
            .field("missing_key", &self.missing_key)
            .field("headers", &self.headers)
            .field("shadow", &self.shadow)
            .finish_non_exhaustive()
    }
}
