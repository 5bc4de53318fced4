//! [`RateLimitLayerBuilder`]: what a layer limits — limits, tiers, algorithm and key. What a
//! request costs is configured in `costs.rs`, how the layer answers in `answers.rs`, and it is all
//! checked in `build.rs`.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use http::request::Parts;

use super::layer::RateLimitLayer;
use super::settings::{CostFn, GrpcMetadataFn, RejectionFn, Settle};
use crate::headers::QuotaUnit;
use crate::key::{Global, KeyExtractor, MissingKey};
use crate::keyspace;
use crate::on_error::OnStoreError;
use crate::rate::{Algorithm, Limit};
use crate::rate_client::{DEFAULT_MAX_WAITING, FALLBACK_CAPACITY, LimitsFn, TierFn};
use crate::store::RateStore;

mod answers;
mod build;
mod costs;

impl RateLimitLayer {
    /// Starts a builder on `store` (a [`RedisStore`](crate::store::RedisStore) to share limits
    /// between copies).
    pub fn builder(store: impl RateStore) -> RateLimitLayerBuilder {
        RateLimitLayerBuilder {
            draft: Draft {
                store: Arc::new(store),
                limits: Vec::new(),
                tiers: Vec::new(),
                tier_by: None,
                limits_by: None,
                algorithm: Algorithm::default(),
                prefix: keyspace::DEFAULT_PREFIX.to_owned(),
                cost: None,
                settle: None,
                on_store_error: OnStoreError::Allow,
                missing_key: MissingKey::Reject,
                headers: true,
                shadow: false,
                partition_key: false,
                quota_unit: None,
                rejection: None,
                grpc_metadata: None,
                deny_cache: true,
                queue: None,
                max_waiting: DEFAULT_MAX_WAITING,
                fallback_capacity: FALLBACK_CAPACITY,
                fallback_admits_when_full: false,
                in_store: false,
                limits_revision: 0,
                limits_refresh: DEFAULT_LIMITS_REFRESH,
            },
            extractor: Global,
        }
    }
}

/// Configures a [`RateLimitLayer`]; made by [`RateLimitLayer::builder`].
pub struct RateLimitLayerBuilder<K = Global> {
    draft: Draft,
    extractor: K,
}

/// Everything a builder collects but the key extractor.
struct Draft {
    store: Arc<dyn RateStore>,
    limits: Vec<Limit>,
    tiers: Vec<(String, Vec<Limit>)>,
    tier_by: Option<TierFn>,
    limits_by: Option<LimitsFn>,
    algorithm: Algorithm,
    prefix: String,
    cost: Option<CostFn>,
    settle: Option<Settle>,
    on_store_error: OnStoreError,
    missing_key: MissingKey,
    headers: bool,
    shadow: bool,
    partition_key: bool,
    quota_unit: Option<QuotaUnit>,
    rejection: Option<RejectionFn>,
    grpc_metadata: Option<GrpcMetadataFn>,
    deny_cache: bool,
    /// How long a denied request may wait for room.
    queue: Option<Duration>,
    max_waiting: usize,
    fallback_capacity: usize,
    fallback_admits_when_full: bool,
    /// Whether the limits in force are the store's (`build_in_store`).
    in_store: bool,
    limits_revision: u64,
    limits_refresh: Duration,
}

/// How often a layer built with [`build_in_store`](RateLimitLayerBuilder::build_in_store) reads
/// its limits in force again, unless told otherwise.
pub const DEFAULT_LIMITS_REFRESH: Duration = Duration::from_secs(1);

impl<K: fmt::Debug> fmt::Debug for RateLimitLayerBuilder<K> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RateLimitLayerBuilder")
            .field("limits", &self.draft.limits)
            .field("tiers", &self.draft.tiers)
            .field("algorithm", &self.draft.algorithm)
            .field("prefix", &self.draft.prefix)
            .field("key", &self.extractor)
            .finish_non_exhaustive()
    }
}

impl<K> RateLimitLayerBuilder<K> {
    /// Adds a limit. A request is admitted only when every limit has room, and then charged to all.
    pub fn limit(mut self, limit: Limit) -> Self {
        self.draft.limits.push(limit);
        self
    }

    /// Adds several limits.
    pub fn limits(mut self, limits: impl IntoIterator<Item = Limit>) -> Self {
        self.draft.limits.extend(limits);
        self
    }

    /// Adds tier `name` with limits of its own, for the requests that
    /// [`tier_by`](Self::tier_by) puts in it; the rest keep the layer's own limits (see
    /// [`limit`](Self::limit)). Each tier is a policy of its own, built here once: its own store
    /// keys (`<prefix>:rl:<name>:{<caller>}:…`, so a caller who changes tier starts afresh in
    /// it), its own `RateLimit-Policy`, local fallback and `limiter` metrics label
    /// (`<prefix>:rl:<name>`), and the layer's algorithm and settings. Names are ASCII letters,
    /// digits, `-`, `_` and `.`, each used once.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")] async fn main() {
    /// use http::{Request, Response, StatusCode};
    /// use tower::{ServiceBuilder, ServiceExt};
    /// use tollgate::key::Header;
    /// use tollgate::rate_limit::{Limit, RateLimitDecision, RateLimitLayer};
    /// use tollgate::store::MemoryStore;
    ///
    /// /// What authentication put into the request, e.g. from a JWT claim.
    /// #[derive(Clone)]
    /// struct Plan(&'static str);
    ///
    /// let layer = RateLimitLayer::builder(MemoryStore::new())
    ///     .limit(Limit::per_hour("hourly", 1)) // anonymous and unknown plans
    ///     .tier("free", [Limit::per_hour("hourly", 2)])
    ///     .tier("paid", [Limit::per_hour("hourly", 10_000)])
    ///     .tier_by(|parts| parts.extensions.get::<Plan>().map(|plan| plan.0))
    ///     .key(Header::from_static("x-api-key"))
    ///     .build()
    ///     .unwrap();
    /// let service = ServiceBuilder::new()
    ///     .layer(layer)
    ///     .service_fn(|_| async { Ok::<_, std::convert::Infallible>(Response::new(String::new())) });
    ///
    /// let call = |plan| {
    ///     let mut request = Request::get("/").header("x-api-key", "alice").body(String::new()).unwrap();
    ///     request.extensions_mut().insert(Plan(plan));
    ///     service.clone().oneshot(request)
    /// };
    /// let first = call("paid").await.unwrap();
    /// assert_eq!(first.headers()["ratelimit-policy"], r#""hourly";q=10000;w=3600"#);
    /// assert_eq!(first.extensions().get::<RateLimitDecision>().unwrap().tier(), Some("paid"));
    /// assert_eq!(call("free").await.unwrap().status(), StatusCode::OK);
    /// assert_eq!(call("free").await.unwrap().status(), StatusCode::OK);
    /// assert_eq!(call("free").await.unwrap().status(), StatusCode::TOO_MANY_REQUESTS);
    /// // a plan with no tier of its own gets the layer's limits
    /// let gold = call("gold").await.unwrap();
    /// assert_eq!(gold.headers()["ratelimit-policy"], r#""hourly";q=1;w=3600"#);
    /// # }
    /// ```
    pub fn tier(
        mut self,
        name: impl Into<String>,
        limits: impl IntoIterator<Item = Limit>,
    ) -> Self {
        self.draft
            .tiers
            .push((name.into(), limits.into_iter().collect()));
        self
    }

    /// Names each request's [`tier`](Self::tier) from its head — typically from what
    /// authentication put into the extensions, such as a plan claim of a verified JWT. A
    /// request for which it answers `None`, or a name that is not a tier, is checked against the
    /// layer's own limits (an unknown name is logged at warn, at most once a second): a
    /// misspelt or new plan is never unlimited and never an error. Without named tiers,
    /// [`build`](Self::build) fails if one is given, and vice versa.
    pub fn tier_by(
        mut self,
        select: impl Fn(&Parts) -> Option<&str> + Send + Sync + 'static,
    ) -> Self {
        self.draft.tier_by = Some(Arc::new(select));
        self
    }

    /// The algorithm for every limit of this layer (default [`Algorithm::SlidingLog`]).
    pub fn algorithm(mut self, algorithm: Algorithm) -> Self {
        self.draft.algorithm = algorithm;
        self
    }

    /// The prefix of this layer's store keys (default `tollgate`); keys are
    /// `<prefix>:rl:{<caller>}:<limit>:<algorithm>`. Two layers with the same prefix and limit
    /// names share counters.
    pub fn prefix(mut self, prefix: impl Into<String>) -> Self {
        self.draft.prefix = prefix.into();
        self
    }

    /// Who a request counts against (default [`Global`]: everybody shares one bucket).
    pub fn key<K2: KeyExtractor>(self, extractor: K2) -> RateLimitLayerBuilder<K2> {
        RateLimitLayerBuilder {
            draft: self.draft,
            extractor,
        }
    }

    /// Limits of a request's own, from the application's data — a tenant's plan read from a
    /// table — beside the static tiers: where `limits_by` gives limits, the request is checked
    /// against them; where it gives `None`, against its tier's (or the layer's own). Each
    /// distinct set of limits is validated and built once, then kept (up to 1,024 sets); limits
    /// that are invalid fall back to the request's tier, logged at warn.
    ///
    /// The limits live under the layer's own store keys, by name: a caller whose plan raises a
    /// limit keeps what it has spent of it. The closure runs on every request, so it reads
    /// data the application keeps at hand (loaded at start-up and refreshed, or a cache): a
    /// plan read from a table is read-only configuration, the same on every copy. Plans that
    /// change while the service runs belong in the store instead, where every copy reads the
    /// same: [`build_in_store`](Self::build_in_store) and
    /// [`StoreLimits::set_caller`](super::StoreLimits::set_caller).
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")] async fn main() {
    /// use std::collections::HashMap;
    /// use std::sync::{Arc, RwLock};
    /// use http::Request;
    /// use tollgate::key::Header;
    /// use tollgate::rate_limit::{Limit, RateLimitLayer};
    /// use tollgate::store::MemoryStore;
    ///
    /// // tenant -> requests per minute, refreshed from the plans table by a task of the app
    /// let plans: Arc<RwLock<HashMap<String, u64>>> = Arc::default();
    /// plans.write().unwrap().insert("acme".into(), 5000);
    /// let table = Arc::clone(&plans);
    /// let layer = RateLimitLayer::builder(MemoryStore::new())
    ///     .limit(Limit::per_minute("minute", 100))
    ///     .key(Header::from_static("x-tenant"))
    ///     .limits_by(move |parts| {
    ///         let tenant = parts.headers.get("x-tenant")?.to_str().ok()?;
    ///         let quota = *table.read().ok()?.get(tenant)?;
    ///         Some(vec![Limit::per_minute("minute", quota)])
    ///     })
    ///     .build()
    ///     .unwrap();
    /// let head = |tenant| Request::get("/").header("x-tenant", tenant).body(()).unwrap().into_parts().0;
    /// let acme = layer.peek_request(&head("acme")).await.unwrap().unwrap();
    /// let other = layer.peek_request(&head("other")).await.unwrap().unwrap();
    /// assert_eq!((acme.limits[0].remaining, other.limits[0].remaining), (5000, 100));
    /// # }
    /// ```
    pub fn limits_by(
        mut self,
        limits: impl Fn(&Parts) -> Option<Vec<Limit>> + Send + Sync + 'static,
    ) -> Self {
        self.draft.limits_by = Some(Arc::new(limits));
        self
    }

    /// The revision of the limits this builder sets, for a layer built with
    /// [`build_in_store`](Self::build_in_store) (default 0): a copy whose revision is higher
    /// than the one that wrote the defaults in force makes its own the defaults, for every
    /// copy; one whose revision is the same or lower decides with the store's. Raise it with
    /// each change of the limits in the code that should replace those in force; a roll-back
    /// to an earlier revision leaves the newer defaults in force.
    pub fn limits_revision(mut self, revision: u64) -> Self {
        self.draft.limits_revision = revision;
        self
    }

    /// How often a layer built with [`build_in_store`](Self::build_in_store) reads its limits
    /// in force again (default [`DEFAULT_LIMITS_REFRESH`], at least 10 ms): a change made
    /// through another copy or the command-line tool is in force on this one within it, plus a
    /// round trip.
    pub fn limits_refresh(mut self, every: Duration) -> Self {
        self.draft.limits_refresh = every.max(Duration::from_millis(10));
        self
    }
}
