//! [`RateLimitLayer`] and its builder.

use std::fmt;
use std::sync::Arc;

use http::request::Parts;
use tower_layer::Layer;

use super::decision::RateLimitDecision;
use super::fallback;
use super::headers::QuotaUnit;
use super::invalidated::Listener;
use super::service::RateLimit;
use super::settings::{CostFn, GrpcMetadataFn, RejectionFn, Settings, Settle};
use super::tiers::{LimitsFn, Tier, TierFn, TierOptions, Tiers};
use crate::error::ConfigError;
use crate::key::MissingKey;
use crate::key::{Global, Key, KeyExtractor};
use crate::keyspace;
use crate::pace::OncePerSecond;
use crate::policy::OnStoreError;
use crate::rate::{Algorithm, Limit, RateCheck, RateOutcome, RatePolicy};
use crate::store::{RateStore, StoreError};

/// Applies [`RateLimit`] to a service: limits kept in a shared [`RateStore`].
///
/// Clones share their configuration; all of a layer's state lives in the store, so every clone —
/// and every copy of the service on the same store — enforces the same limits.
///
/// ```
/// use tollgate::key::PeerIp;
/// use tollgate::rate_limit::{Algorithm, Limit, RateLimitLayer};
/// use tollgate::store::MemoryStore;
///
/// let layer = RateLimitLayer::builder(MemoryStore::new())
///     .limit(Limit::per_second("burst", 10))
///     .limit(Limit::per_hour("hourly", 1000))
///     .algorithm(Algorithm::SlidingCounter)
///     .key(PeerIp::new())
///     .build()
///     .unwrap();
/// # let _ = layer;
/// ```
pub struct RateLimitLayer<K = Global> {
    settings: Arc<Settings>,
    extractor: Arc<K>,
}

impl<K> Clone for RateLimitLayer<K> {
    fn clone(&self) -> Self {
        Self {
            settings: Arc::clone(&self.settings),
            extractor: Arc::clone(&self.extractor),
        }
    }
}

debug_fields!(RateLimitLayer<K> { settings, extractor });

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
                fallback_capacity: fallback::DEFAULT_CAPACITY,
                fallback_admits_when_full: false,
            },
            extractor: Global,
        }
    }
}

impl<K> RateLimitLayer<K> {
    /// The limits this layer checks (its own: those of the default tier).
    pub fn policy(&self) -> &RatePolicy {
        &self.settings.tiers.default_tier().policy
    }

    /// The limits of tier `name` (see [`RateLimitLayerBuilder::tier`]), or the layer's own when
    /// it has no tier of that name — as for a request.
    pub fn tier_policy(&self, name: &str) -> &RatePolicy {
        &self.settings.tiers.named(name).policy
    }

    /// The key a request with head `parts` counts against, as the layer finds it; `None` when
    /// the extractor finds none. With [`peek`](Self::peek) and [`reset`](Self::reset) it serves
    /// an admin endpoint.
    pub fn key_of(&self, parts: &Parts) -> Option<Key>
    where
        K: KeyExtractor,
    {
        self.extractor.extract(parts)
    }

    /// Caller `key`'s state of each of the layer's own limits, without spending any: a check of
    /// cost 0 in the store (`admitted` says whether no limit is over its quota). Bounded by the
    /// store's timeout, as every check. Under tiers, [`peek_tier`](Self::peek_tier) names the
    /// tier and [`peek_request`](Self::peek_request) lets the layer choose it as for a request.
    ///
    /// ```
    /// # tokio_test_block_on(async {
    /// use tollgate::key::{Header, KeyExtractor};
    /// use tollgate::rate_limit::{Limit, RateLimitLayer};
    /// use tollgate::store::MemoryStore;
    ///
    /// let by_api_key = Header::from_static("x-api-key");
    /// let layer = RateLimitLayer::builder(MemoryStore::new())
    ///     .limit(Limit::per_hour("hourly", 100))
    ///     .key(by_api_key.clone())
    ///     .build()
    ///     .unwrap();
    /// let alice = by_api_key.key(b"alice");
    /// let quota = layer.peek(alice).await.unwrap();
    /// assert_eq!(quota.limits[0].remaining, 100);
    /// layer.reset(alice).await.unwrap();
    /// # });
    /// # fn tokio_test_block_on<F: std::future::Future>(f: F) -> F::Output {
    /// #     tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(f)
    /// # }
    /// ```
    pub async fn peek(&self, key: Key) -> Result<RateOutcome, StoreError> {
        let policy = &self.settings.tiers.default_tier().policy;
        self.settings
            .store
            .check_rate(policy, RateCheck::new(key, 0))
            .await
    }

    /// [`peek`](Self::peek) at the caller of a request with head `parts`, under the limits the
    /// request would be counted against: its key as the layer finds it, its tier as
    /// [`tier_by`](RateLimitLayerBuilder::tier_by) chooses it. `None` when the request carries
    /// no key.
    pub async fn peek_request(&self, parts: &Parts) -> Result<Option<RateOutcome>, StoreError>
    where
        K: KeyExtractor,
    {
        let Some(key) = self.extractor.extract(parts) else {
            return Ok(None);
        };
        let tier = self.settings.tiers.for_request(parts);
        let check = RateCheck::new(key, 0);
        self.settings
            .store
            .check_rate(&tier.policy, check)
            .await
            .map(Some)
    }

    /// [`peek`](Self::peek) at caller `key`'s state of tier `name`'s limits (the layer's own
    /// when it has no tier of that name, as for a request).
    pub async fn peek_tier(&self, name: &str, key: Key) -> Result<RateOutcome, StoreError> {
        let policy = &self.settings.tiers.named(name).policy;
        self.settings
            .store
            .check_rate(policy, RateCheck::new(key, 0))
            .await
    }

    /// Forgets what caller `key` has spent of this layer's limits — of every tier, and of the
    /// per-request limits ([`limits_by`](RateLimitLayerBuilder::limits_by)) this copy has met —
    /// in the store (every copy sees it at once) and in this copy's deny cache. The store
    /// broadcasts the reset: another copy that cached a denial of `key` drops it within about a
    /// round trip, and admits; if the broadcast is lost, it asks the store again within a second
    /// (the deny cache's longest hold). See [Invalidations](crate::store#invalidations).
    pub async fn reset(&self, key: Key) -> Result<(), StoreError> {
        let settings = &self.settings;
        if let Some(cache) = &settings.deny_cache {
            cache.forget(key);
        }
        for tier in settings.tiers.all() {
            // the caller's slices were charged before the reset, which erases them: given back,
            // they would refund nothing
            if let Some(leases) = &tier.leases {
                leases.discard(key);
            }
            settings.store.reset_rate(&tier.policy, key).await?;
        }
        // a denial cached while the reset was on its way
        if let Some(cache) = &settings.deny_cache {
            cache.forget(key);
        }
        Ok(())
    }

    /// Gives back what this copy holds unspent of its [leased](crate::rate::Limit::leased)
    /// slices, with one settlement each, and waits for the store's answers: for a graceful
    /// shutdown, so that the quota is the other copies' at once. A slice being fetched is waited
    /// for and given back once it lands; one whose answer was lost, once the store's ledger
    /// says what it charged (within a few store timeouts). (Slices left when the layer is
    /// dropped are given back in the background.) Requests admitted afterwards lease again.
    pub async fn give_back_leases(&self) {
        for tier in self.settings.tiers.all() {
            if let Some(leases) = &tier.leases {
                let given = leases.give_back_all().await;
                // a denial this copy cached of those callers is stale now (the settlements are
                // quiet: other copies' cached denials end within their second)
                if let Some(cache) = &self.settings.deny_cache {
                    given.into_iter().for_each(|key| cache.forget(key));
                }
            }
        }
    }

    /// What this copy holds unspent of its leased slices, over every caller and tier: charged
    /// in the store, not admitted yet. The most by which a caller may be admitted less than its
    /// quota is the sum of this over the copies.
    pub fn leases_unspent(&self) -> u64 {
        self.settings
            .tiers
            .all()
            .iter()
            .filter_map(|tier| tier.leases.as_ref())
            .map(|leases| leases.unspent())
            .sum()
    }
}

impl<S, K> Layer<S> for RateLimitLayer<K> {
    type Service = RateLimit<S, K>;

    fn layer(&self, inner: S) -> Self::Service {
        RateLimit::new(
            inner,
            Arc::clone(&self.settings),
            Arc::clone(&self.extractor),
        )
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
    fallback_capacity: usize,
    fallback_admits_when_full: bool,
}

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
    /// plan read from a table is read-only configuration, the same on every copy.
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

    /// The cost of each request (default 1). With [`settle`](Self::settle) or
    /// [`settle_body_size`](Self::settle_body_size), the amount a request reserves: it is
    /// admitted only when that fits, and a reservation is at least 1 — a request whose cost is 0
    /// is checked like any other (refused once the budget is spent) and then charged what it
    /// used. Without a settlement a cost of 0 passes without a store call: free, as the function
    /// decided.
    ///
    /// The function's input is the client's request, so a number read from it is the client's
    /// word: give it a floor and a ceiling (`docs/security.md` says which inputs the layers
    /// trust).
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")] async fn main() {
    /// use http::{Request, Response, StatusCode};
    /// use tower::{ServiceBuilder, ServiceExt};
    /// use tollgate::key::Header;
    /// use tollgate::rate_limit::{Limit, RateLimitLayer};
    /// use tollgate::store::MemoryStore;
    ///
    /// let tokens = RateLimitLayer::builder(MemoryStore::new())
    ///     .limit(Limit::per_minute("tokens", 1000))
    ///     .key(Header::from_static("x-api-key"))
    ///     // the client's estimate, kept between a floor and a ceiling
    ///     .cost(|req| {
    ///         let max = req.headers.get("x-max-tokens").and_then(|v| v.to_str().ok()?.parse().ok());
    ///         max.unwrap_or(256).clamp(1, 4096)
    ///     })
    ///     .settle(|res| res.headers.get("x-tokens-used")?.to_str().ok()?.parse().ok())
    ///     .build()
    ///     .unwrap();
    /// let llm = ServiceBuilder::new().layer(tokens).service_fn(|_req: Request<String>| async {
    ///     let response = Response::builder().header("x-tokens-used", "500").body(String::new());
    ///     Ok::<_, std::convert::Infallible>(response.unwrap())
    /// });
    /// let call = || {
    ///     let request = Request::post("/complete").header("x-api-key", "alice");
    ///     request.header("x-max-tokens", "0").body(String::new()).unwrap()
    /// };
    /// // an estimate of 0 pays what it used, and is refused once the budget is spent
    /// let statuses = [
    ///     llm.clone().oneshot(call()).await.unwrap().status(),
    ///     llm.clone().oneshot(call()).await.unwrap().status(),
    ///     llm.clone().oneshot(call()).await.unwrap().status(),
    /// ];
    /// assert_eq!(statuses, [StatusCode::OK, StatusCode::OK, StatusCode::TOO_MANY_REQUESTS]);
    /// # }
    /// ```
    pub fn cost(mut self, cost: impl Fn(&Parts) -> u64 + Send + Sync + 'static) -> Self {
        self.draft.cost = Some(Arc::new(cost));
        self
    }

    /// Reserve, then settle: once the inner service has answered an admitted request, its
    /// charge is corrected from what it reserved ([`cost`](Self::cost)) to the actual amount
    /// `actual` reads from the response head (a header, an extension the handler set) — the
    /// difference refunded or added, in one atomic store step applied once
    /// ([`RateCheck::settle`](crate::rate::RateCheck::settle)). An overrun takes the balance
    /// past the quota (by at most one more quota per limit): the caller is then denied until
    /// the debt has left the window.
    ///
    /// The settlement is made before the response head goes out, so that its `RateLimit`
    /// headers (and its [`RateLimitDecision`]) show the settled balance. A request is charged
    /// what it reserved when `actual` answers `None`, when the inner service fails without a
    /// response, when the store cannot settle (logged), and when the store did not decide it
    /// (the local fallback, shadow denials).
    ///
    /// gRPC: a handler reports its usage in its response metadata, which is the head (tonic
    /// sends a failed call's `Status` metadata in its trailers-only head, so failed calls settle
    /// too). Usage that only trailing metadata carries (after a streamed body) is not read: such
    /// a call is charged what it reserved.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")] async fn main() {
    /// use http::{Request, Response};
    /// use tower::{ServiceBuilder, ServiceExt};
    /// use tollgate::key::Header;
    /// use tollgate::rate_limit::{Limit, RateLimitLayer};
    /// use tollgate::store::MemoryStore;
    ///
    /// let tokens = RateLimitLayer::builder(MemoryStore::new())
    ///     .limit(Limit::per_minute("tokens", 1000))
    ///     .key(Header::from_static("x-api-key"))
    ///     // reserve what the caller says it may use...
    ///     .cost(|req| {
    ///         let max = req.headers.get("x-max-tokens").and_then(|v| v.to_str().ok()?.parse().ok());
    ///         max.unwrap_or(1)
    ///     })
    ///     // ...and charge what the handler reports it used
    ///     .settle(|res| res.headers.get("x-tokens-used")?.to_str().ok()?.parse().ok())
    ///     .build()
    ///     .unwrap();
    /// let llm = ServiceBuilder::new().layer(tokens).service_fn(|_req: Request<String>| async {
    ///     let response = Response::builder().header("x-tokens-used", "120").body(String::new());
    ///     Ok::<_, std::convert::Infallible>(response.unwrap())
    /// });
    /// let call = Request::post("/complete")
    ///     .header("x-api-key", "alice")
    ///     .header("x-max-tokens", "300")
    ///     .body(String::new())
    ///     .unwrap();
    /// let response = llm.oneshot(call).await.unwrap();
    /// // charged 120, not the 300 reserved
    /// assert_eq!(response.headers()["ratelimit"], r#""tokens";r=880;t=60"#);
    /// # }
    /// ```
    pub fn settle(
        mut self,
        actual: impl Fn(&http::response::Parts) -> Option<u64> + Send + Sync + 'static,
    ) -> Self {
        self.draft.settle = Some(Settle::Head(Arc::new(actual)));
        self
    }

    /// Reserve, then settle on the bytes sent: an admitted request reserves its
    /// [`cost`](Self::cost) (the most its response may be: required), and once its response
    /// body has gone out — or been dropped midway, a client gone — the charge is corrected to
    /// the bytes of body actually sent, in the background, as [`settle`](Self::settle) does. A
    /// request that ends before its response head (its client left, or the inner service failed
    /// without a response) was sent nothing: it is settled to 0.
    /// A byte budget per caller for downloads, exports and proxies. The response's `RateLimit`
    /// headers, sent before its body, show the balance with the reservation charged.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")] async fn main() {
    /// use http::{Request, Response};
    /// use http_body_util::BodyExt;
    /// use tower::{ServiceBuilder, ServiceExt};
    /// use tollgate::key::Header;
    /// use tollgate::rate_limit::{Algorithm, Limit, QuotaUnit, RateLimitLayer};
    /// use tollgate::store::MemoryStore;
    ///
    /// let bytes = RateLimitLayer::builder(MemoryStore::new())
    ///     .limit(Limit::per_hour("egress", 1_000_000))
    ///     .algorithm(Algorithm::SlidingCounter)
    ///     .key(Header::from_static("x-api-key"))
    ///     .cost(|_| 64 * 1024) // no response is larger
    ///     .settle_body_size()
    ///     .quota_unit(QuotaUnit::ContentBytes)
    ///     .build()
    ///     .unwrap();
    /// let export = ServiceBuilder::new().layer(bytes.clone()).service_fn(|_: Request<String>| async {
    ///     Ok::<_, std::convert::Infallible>(Response::new("x".repeat(300)))
    /// });
    /// let call = Request::get("/export").header("x-api-key", "alice").body(String::new()).unwrap();
    /// let response = export.oneshot(call).await.unwrap();
    /// let body = response.into_body().collect().await.unwrap().to_bytes();
    /// assert_eq!(body.len(), 300);
    /// # tokio::task::yield_now().await;
    /// let alice = bytes.key_of(&Request::get("/").header("x-api-key", "alice").body(()).unwrap().into_parts().0);
    /// let left = bytes.peek(alice.unwrap()).await.unwrap();
    /// // charged the 300 bytes sent, not the 64 KiB reserved
    /// assert_eq!(left.limits[0].remaining, 1_000_000 - 300);
    /// # }
    /// ```
    pub fn settle_body_size(mut self) -> Self {
        self.draft.settle = Some(Settle::BodyBytes);
        self
    }

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
    /// [`QuotaUnit::ContentBytes`](super::QuotaUnit::ContentBytes) when the cost is a size.
    pub fn quota_unit(mut self, unit: QuotaUnit) -> Self {
        self.draft.quota_unit = Some(unit);
        self
    }

    /// Shadow mode (default off), to roll a new limit out: every request is decided and charged
    /// as usual, its decision recorded and its headers set, but none is rejected — a denial is
    /// logged (at info, target `tollgate::rate_limit`) and marked
    /// [`RateLimitDecision::shadow`](super::RateLimitDecision::shadow), and the request goes on,
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
    /// [`RateStore::invalidations`] on its first request), and within a second when the
    /// broadcast is lost. A flood from one caller then costs about one store call per copy and
    /// second. It caches the store's decision and never admits on its own.
    pub fn deny_cache(mut self, enabled: bool) -> Self {
        self.draft.deny_cache = enabled;
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
    /// [`DecisionSource::LocalFallback`](super::DecisionSource::LocalFallback) and no limit
    /// states ([`RateLimitDecision::limits`](super::RateLimitDecision::limits) is empty, and the
    /// response carries neither `RateLimit` nor `RateLimit-Policy`); a denial waits 1 s (`429`,
    /// `Retry-After: 1`). A warning is logged, at most once a second.
    pub fn fallback_admits_when_full(mut self, admit: bool) -> Self {
        self.draft.fallback_admits_when_full = admit;
        self
    }

    /// Validates the configuration. An error names the layer by its prefix, and the tier and
    /// limit at fault: `rate limit "tollgate": tier "pro": limit "burst": …`.
    pub fn build(self) -> Result<RateLimitLayer<K>, ConfigError>
    where
        K: KeyExtractor,
    {
        let layer = format!("rate limit {:?}", self.draft.prefix);
        self.validated().map_err(|e| e.within(&layer))
    }

    fn validated(self) -> Result<RateLimitLayer<K>, ConfigError>
    where
        K: KeyExtractor,
    {
        let mut draft = self.draft;
        let tiers = draft.tiers()?;
        Ok(RateLimitLayer {
            settings: Arc::new(Settings {
                store: draft.store,
                tiers,
                cost: draft.cost,
                settle: draft.settle,
                on_store_error: draft.on_store_error,
                missing_key: draft.missing_key,
                missing_key_message: format!(
                    "the request carries no rate-limit key: it is read from {}",
                    self.extractor.describe()
                )
                .into(),
                headers: draft.headers,
                shadow: draft.shadow,
                partition_key: draft.partition_key,
                rejection: draft.rejection,
                grpc_metadata: draft.grpc_metadata,
                deny_cache: (draft.deny_cache && !draft.shadow).then(Arc::default),
                listener: Listener::default(),
                last_warning: OncePerSecond::new(),
            }),
            extractor: Arc::new(self.extractor),
        })
    }
}

impl Draft {
    /// The layer's tiers: its own limits, the named tiers, and the per-request limits, each
    /// checked.
    fn tiers(&mut self) -> Result<Tiers, ConfigError> {
        // checked as written: the namespace adds `:rl`, which the user never wrote
        keyspace::check_prefix(&self.prefix)?;
        let options = TierOptions {
            namespace: keyspace::rate_namespace(&self.prefix),
            algorithm: self.algorithm,
            unit: self
                .quota_unit
                .or(self.cost.is_some().then_some(QuotaUnit::Request)),
            on_store_error: self.on_store_error,
            fallback_capacity: self.fallback_capacity,
            fallback_admits_when_full: self.fallback_admits_when_full,
            store: Arc::clone(&self.store),
            settles: self.settle.is_some(),
        };
        let own = Tier::new(None, std::mem::take(&mut self.limits), &options)?;
        let named = std::mem::take(&mut self.tiers)
            .into_iter()
            .map(|(name, limits)| Tier::new(Some(name), limits, &options))
            .collect::<Result<Vec<_>, _>>()?;
        if matches!(self.settle, Some(Settle::BodyBytes)) && self.cost.is_none() {
            return Err(ConfigError::new(
                crate::error::ConfigErrorKind::Limit,
                "settle_body_size needs .cost(..): the most a response may use, reserved first",
            ));
        }
        if self.tier_by.is_some() && named.is_empty() {
            return Err(ConfigError::new(
                crate::error::ConfigErrorKind::Limit,
                "tier_by needs named tiers to choose among",
            ));
        }
        let tiers = Tiers::new(own, named, self.tier_by.take())?;
        Ok(match self.limits_by.take() {
            Some(limits_by) => tiers.with_limits_by(limits_by, options),
            None => tiers,
        })
    }
}
