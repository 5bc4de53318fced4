//! How a layer answers: when the store fails, when a key is missing, which headers and
//! rejections it sends, shadow mode, the deny cache, waiting for room and the local fallback.

use std::sync::Arc;

use super::RateLimitLayerBuilder;
use crate::headers::QuotaUnit;
use crate::key::MissingKey;
use crate::on_error::OnStoreError;
use crate::rate_limit::RateLimitDecision;

impl<K> RateLimitLayerBuilder<K> {
    /// What to do when the store fails or times out (default [`OnStoreError::Allow`]).
    pub fn on_store_error(mut self, policy: OnStoreError) -> Self {
        self.draft.on_store_error = policy;
        self
    }

    /// What to do with a request whose key cannot be extracted (default [`MissingKey::Reject`]).
    pub fn on_missing_key(mut self, missing_key: MissingKey) -> Self {
        self.draft.missing_key = missing_key;
        self
    }

    /// Whether admitted responses carry `RateLimit` and `RateLimit-Policy` (default true;
    /// rejections always do).
    pub fn headers_on_success(mut self, enabled: bool) -> Self {
        self.draft.headers = enabled;
        self
    }

    /// Builds the response to a denied HTTP request (`429`) from its decision, in place of the
    /// default problem details (RFC 9457: type
    /// `https://iana.org/assignments/http-problem-types#quota-exceeded`, with the
    /// `violated-policies`). `Retry-After`, `RateLimit` and `RateLimit-Policy` are added to what
    /// it returns, and the decision to its extensions. gRPC calls keep their trailers-only
    /// `RESOURCE_EXHAUSTED`.
    ///
    /// ```
    /// use http::{Response, StatusCode, header};
    /// use tollgate::rate_limit::{Limit, RateLimitLayer};
    /// use tollgate::store::MemoryStore;
    ///
    /// let layer = RateLimitLayer::builder(MemoryStore::new())
    ///     .limit(Limit::per_minute("minute", 60))
    ///     .rejection(|decision| {
    ///         let wait = decision.retry_after().as_secs().max(1);
    ///         Response::builder()
    ///             .status(StatusCode::TOO_MANY_REQUESTS)
    ///             .header(header::CONTENT_TYPE, "application/json")
    ///             .body(format!(r#"{{"error":"slow down","retry_in":{wait}}}"#).into())
    ///             .unwrap_or_default()
    ///     })
    ///     .build()
    ///     .unwrap();
    /// # let _ = layer;
    /// ```
    pub fn rejection(
        mut self,
        build: impl Fn(&RateLimitDecision) -> http::Response<bytes::Bytes> + Send + Sync + 'static,
    ) -> Self {
        self.draft.rejection = Some(Arc::new(build));
        self
    }

    /// Adds metadata to the trailers-only response of a denied gRPC call (`RESOURCE_EXHAUSTED`,
    /// or `UNAVAILABLE` when the store is down and the failure policy denies), after
    /// `grpc-status`, `grpc-message`, `retry-after` and the `RateLimit` fields — say a
    /// `grpc-status-details-bin` with a `google.rpc.RetryInfo`, or a header a client library
    /// reads. Metadata names and values are HTTP header names and values; what it sets
    /// replaces what was there.
    ///
    /// ```
    /// use http::HeaderValue;
    /// use tollgate::rate_limit::{Limit, RateLimitLayer};
    /// use tollgate::store::MemoryStore;
    ///
    /// let layer = RateLimitLayer::builder(MemoryStore::new())
    ///     .limit(Limit::per_minute("minute", 60))
    ///     .grpc_metadata(|decision, metadata| {
    ///         let wait_ms = decision.retry_after().as_millis().to_string();
    ///         if let Ok(value) = HeaderValue::from_str(&wait_ms) {
    ///             metadata.insert("x-retry-after-ms", value);
    ///         }
    ///     })
    ///     .build()
    ///     .unwrap();
    /// # let _ = layer;
    /// ```
    pub fn grpc_metadata(
        mut self,
        add: impl Fn(&RateLimitDecision, &mut http::HeaderMap) + Send + Sync + 'static,
    ) -> Self {
        self.draft.grpc_metadata = Some(Arc::new(add));
        self
    }

    /// Whether `RateLimit` members carry the caller's partition key, `pk` (default off): a
    /// Structured Field Byte Sequence derived from the key's digest — never the raw key — that
    /// tells a client which of its partitions (API keys, addresses) the figures are for.
    pub fn partition_key(mut self, enabled: bool) -> Self {
        self.draft.partition_key = enabled;
        self
    }

    /// What the quota counts, said as `qu` in `RateLimit-Policy` (default: requests, and `qu`
    /// said only when a [`cost`](Self::cost) closure is set). Use
    /// [`QuotaUnit::ContentBytes`](crate::rate_limit::QuotaUnit::ContentBytes) when the cost is a size.
    pub fn quota_unit(mut self, unit: QuotaUnit) -> Self {
        self.draft.quota_unit = Some(unit);
        self
    }

    /// Shadow mode (default off), to roll a new limit out: every request is decided and charged
    /// as usual, its decision recorded and its headers set, but none is rejected — a denial is
    /// logged (at info, target `tollgate::rate_limit`) and marked
    /// [`RateLimitDecision::shadow`](crate::rate_limit::RateLimitDecision::shadow), and the request goes on,
    /// as does one without a key. The deny cache is off: every request reaches the store.
    pub fn shadow(mut self, enabled: bool) -> Self {
        self.draft.shadow = enabled;
        self
    }

    /// Whether a copy, once the store has denied a caller until some time, denies that caller's
    /// requests (of the same or larger cost) locally until then, without a store round trip
    /// (default true) — for at most a second at a time, then it asks the store again. A reset
    /// or a refund made through any copy frees the caller on every copy within about a round
    /// trip of the store's broadcast (the layer subscribes to
    /// [`RateStore::invalidations`](crate::store::RateStore::invalidations) on its first request), and within a second when the
    /// broadcast is lost. A flood from one caller then costs about one store call per copy and
    /// second. It caches the store's decision and never admits on its own.
    pub fn deny_cache(mut self, enabled: bool) -> Self {
        self.draft.deny_cache = enabled;
        self
    }

    /// Lets a request the limits deny wait up to `patience` for room, instead of a 429 (default:
    /// refused at once). A denied request whose room comes within its patience (counted from
    /// its arrival) waits on its copy in its caller's line, served in arrival order; the first
    /// of the line asks the store again when the store said room comes, and the next as soon
    /// as the one before is admitted. Across copies the store decides as always: what is
    /// admitted is exactly what the limits admit. A request whose room comes later (or whose
    /// cost is larger than a limit's quota) is refused at once with `Retry-After`; one that
    /// finds its caller's line full ([`max_waiting`](Self::max_waiting)) is decided as without
    /// a queue; one whose client leaves gives up its place.
    ///
    /// A request waits at most `patience` (at most a day: [`build`](Self::build) fails
    /// otherwise) plus the round trip of its last check. How long it
    /// waited is [`RateLimitDecision::waited`] and the metric
    /// [`RATE_LIMIT_WAIT`](crate::metrics::RATE_LIMIT_WAIT). Denials by the failure policy
    /// (the store down) are not waited on; in [shadow mode](Self::shadow) nothing waits. The
    /// fairness, bounds and costs are in the guide's
    /// [Waiting for room](crate::guide::customizing#waiting-for-room).
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread", start_paused = true)] async fn main() {
    /// use std::time::Duration;
    ///
    /// use http::{Request, Response};
    /// use tollgate::rate_limit::{Limit, RateLimitDecision, RateLimitLayer};
    /// use tollgate::store::MemoryStore;
    /// use tower::{Service, ServiceBuilder, ServiceExt};
    ///
    /// let layer = RateLimitLayer::builder(MemoryStore::new())
    ///     .limit(Limit::per_second("requests", 1))
    ///     .queue(Duration::from_secs(2))
    ///     .build()
    ///     .unwrap();
    /// let mut svc = ServiceBuilder::new()
    ///     .layer(layer)
    ///     .service_fn(|_: Request<()>| async { Ok::<_, std::convert::Infallible>(Response::new(())) });
    /// let mut call = async || svc.ready().await.unwrap().call(Request::new(())).await.unwrap();
    /// let waited = |r: &Response<_>| r.extensions().get::<RateLimitDecision>().unwrap().waited();
    ///
    /// assert_eq!(waited(&call().await), Duration::ZERO);
    /// let second = call().await;
    /// assert_eq!(second.status(), 200, "admitted once the second began");
    /// assert!(waited(&second) >= Duration::from_millis(990));
    /// # }
    /// ```
    pub fn queue(mut self, patience: std::time::Duration) -> Self {
        self.draft.queue = Some(patience);
        self
    }

    /// The [`queue`](Self::queue)'s patience, `default` when none was set.
    pub(crate) fn patience_or(
        mut self,
        default: std::time::Duration,
    ) -> (Self, std::time::Duration) {
        let patience = *self.draft.queue.get_or_insert(default);
        (self, patience)
    }

    /// How many requests of one caller may wait for room on one copy at once, with a
    /// [`queue`](Self::queue) (default 1,024; at least 1, or [`build`](Self::build) fails): one
    /// more is decided as without a queue. A copy keeps one line per caller that waits, and
    /// nothing for a caller that does not.
    pub fn max_waiting(mut self, requests: usize) -> Self {
        self.draft.max_waiting = requests;
        self
    }

    /// How many callers the [`OnStoreError::LocalFallback`] limiter holds at most (default
    /// 65,536; at least 1, or [`build`](Self::build) fails). A caller is one key with all its
    /// limits; callers whose limits have all expired do not count. While this many callers are
    /// live, a new caller is denied, or admitted if
    /// [`fallback_admits_when_full`](Self::fallback_admits_when_full) says so; a caller already
    /// held keeps its count — none is ever evicted to make room, which would hand it a fresh
    /// quota. Memory grows with it: a few hundred bytes per caller.
    pub fn fallback_capacity(mut self, callers: usize) -> Self {
        self.draft.fallback_capacity = callers;
        self
    }

    /// What a full [`OnStoreError::LocalFallback`] limiter (see
    /// [`fallback_capacity`](Self::fallback_capacity)) does with a new caller: deny it (`false`,
    /// the default) or admit it without counting it (`true`). Either way the decision has source
    /// [`DecisionSource::LocalFallback`](crate::rate_limit::DecisionSource::LocalFallback) and no limit
    /// states ([`RateLimitDecision::limits`](crate::rate_limit::RateLimitDecision::limits) is empty, and the
    /// response carries neither `RateLimit` nor `RateLimit-Policy`); a denial waits 1 s (`429`,
    /// `Retry-After: 1`). A warning is logged, at most once a second.
    pub fn fallback_admits_when_full(mut self, admit: bool) -> Self {
        self.draft.fallback_admits_when_full = admit;
        self
    }
}
