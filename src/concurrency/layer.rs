//! [`ConcurrencyLimitLayer`] and its builder.

use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwap;
use http::request::Parts;
use tower_layer::Layer;

use super::limits::InFlightRecipe;
use super::permit::LocalPermits;
use super::service::ConcurrencyLimit;
use super::settings::{Settings, TierBy};
use super::store_limits::ConcurrencyLimits;
use super::{MissingKey, OnStoreError};
use crate::error::{ConfigError, ConfigErrorKind};
use crate::in_force::InForce;
use crate::key::{Global, Key, KeyExtractor};
use crate::keyspace;
use crate::pace::OncePerSecond;
use crate::rate_client::Listener;
use crate::store::PermitStore;

/// Applies [`ConcurrencyLimit`] to a service: at most `limit` requests in flight per key, counted
/// in a shared [`PermitStore`].
///
/// Clones share their configuration; every permit lives in the store, so every clone — and every
/// copy of the service on the same store — enforces the same bound.
///
/// ```
/// use std::time::Duration;
/// use tollgate::concurrency::ConcurrencyLimitLayer;
/// use tollgate::key::Header;
/// use tollgate::store::MemoryStore;
///
/// let layer = ConcurrencyLimitLayer::builder(MemoryStore::new())
///     .limit(2)
///     .key(Header::from_static("x-tenant"))
///     .lease(Duration::from_secs(3))
///     .retry_after(Duration::from_secs(1))
///     .build()
///     .unwrap();
/// # let _ = layer;
/// ```
pub struct ConcurrencyLimitLayer<K = Global> {
    pub(super) settings: Arc<Settings>,
    extractor: Arc<K>,
}

impl<K> Clone for ConcurrencyLimitLayer<K> {
    fn clone(&self) -> Self {
        Self {
            settings: Arc::clone(&self.settings),
            extractor: Arc::clone(&self.extractor),
        }
    }
}

debug_fields!(ConcurrencyLimitLayer<K> { settings, extractor });

/// How long a permit's lease runs unless configured otherwise.
pub(crate) const DEFAULT_LEASE: Duration = Duration::from_secs(10);

impl ConcurrencyLimitLayer {
    /// Starts a builder on `store` (a [`RedisStore`](crate::store::RedisStore) or a `PgStore`
    /// (feature `postgres`) to share the bound between copies). Set the
    /// [`limit`](ConcurrencyLimitLayerBuilder::limit); every request counts against one global
    /// key until a [`key`](ConcurrencyLimitLayerBuilder::key) extractor is set.
    pub fn builder(store: impl PermitStore) -> ConcurrencyLimitLayerBuilder {
        ConcurrencyLimitLayerBuilder {
            store: Arc::new(store),
            limit: None,
            lease: DEFAULT_LEASE,
            retry_after: None,
            queue: None,
            on_store_error: OnStoreError::Allow,
            missing_key: MissingKey::Reject,
            prefix: keyspace::DEFAULT_PREFIX.to_owned(),
            tiers: Vec::new(),
            tier_by: None,
            advertise: None,
            in_store: false,
            limits_revision: 0,
            limits_refresh: crate::rate_limit::DEFAULT_LIMITS_REFRESH,
            extractor: Global,
        }
    }
}

impl<K> ConcurrencyLimitLayer<K> {
    /// At most this many requests per key in flight: the layer's own limit in force, for
    /// requests of no tier.
    pub fn limit(&self) -> u32 {
        self.settings.limits.load().own()
    }

    /// The limit in force of tier `name`, or the layer's own when it has no tier of that name —
    /// as for a request.
    pub fn tier_limit(&self, name: &str) -> u32 {
        self.settings.limits.load().tier(name)
    }

    /// The limit in force of caller `key`'s requests of no tier: its own, when the limits in
    /// force give it one ([`ConcurrencyLimits::set_caller`]), else the layer's.
    pub fn caller_limit(&self, key: Key) -> u32 {
        self.settings.limits.load().of(None, Some(&key))
    }

    /// The limits in force, to read and change for every copy at once; `None` for a layer not
    /// built with [`build_in_store`](ConcurrencyLimitLayerBuilder::build_in_store).
    pub fn limits(&self) -> Option<ConcurrencyLimits> {
        self.settings
            .in_store
            .is_some()
            .then(|| ConcurrencyLimits::new(Arc::clone(&self.settings)))
    }
}

impl<S, K> Layer<S> for ConcurrencyLimitLayer<K> {
    type Service = ConcurrencyLimit<S, K>;

    fn layer(&self, inner: S) -> Self::Service {
        ConcurrencyLimit::new(
            inner,
            Arc::clone(&self.settings),
            Arc::clone(&self.extractor),
        )
    }
}

/// Builds a [`ConcurrencyLimitLayer`].
pub struct ConcurrencyLimitLayerBuilder<K = Global> {
    store: Arc<dyn PermitStore>,
    limit: Option<u32>,
    lease: Duration,
    retry_after: Option<Duration>,
    queue: Option<Duration>,
    on_store_error: OnStoreError,
    missing_key: MissingKey,
    prefix: String,
    tiers: Vec<(Box<str>, u32)>,
    tier_by: Option<TierBy>,
    advertise: Option<String>,
    in_store: bool,
    limits_revision: u64,
    limits_refresh: Duration,
    extractor: K,
}

debug_fields!(ConcurrencyLimitLayerBuilder<K> { store, limit, tiers, lease, extractor });

impl<K> ConcurrencyLimitLayerBuilder<K> {
    /// At most `limit` (at least 1) requests per key in flight, across every copy: the limit
    /// of requests of no tier.
    pub fn limit(mut self, limit: u32) -> Self {
        self.limit = Some(limit);
        self
    }

    /// Tier `name`'s limit (at least 1): requests that [`tier_by`](Self::tier_by) names `name`
    /// count against it, under the same key, in place of the layer's own — as the rate limit's
    /// tiers do. A request of an unknown tier gets the layer's own limit, never none.
    ///
    /// ```
    /// use tollgate::concurrency::ConcurrencyLimitLayer;
    /// use tollgate::key::Extension;
    /// use tollgate::store::MemoryStore;
    ///
    /// /// What the authentication layer inserts: the caller's tenant and plan.
    /// #[derive(Clone)]
    /// struct Tenant { id: String, plan: &'static str }
    /// impl AsRef<[u8]> for Tenant {
    ///     fn as_ref(&self) -> &[u8] { self.id.as_bytes() }
    /// }
    ///
    /// let layer = ConcurrencyLimitLayer::builder(MemoryStore::new())
    ///     .limit(2)
    ///     .tier("pro", 10)
    ///     .tier_by(|parts| parts.extensions.get::<Tenant>().map(|tenant| tenant.plan))
    ///     .key(Extension::<Tenant>::new())
    ///     .build()
    ///     .unwrap();
    /// assert_eq!((layer.tier_limit("pro"), layer.tier_limit("gold"), layer.limit()), (10, 2, 2));
    /// ```
    pub fn tier(mut self, name: impl Into<String>, limit: u32) -> Self {
        self.tiers.push((name.into().into_boxed_str(), limit));
        self
    }

    /// Chooses each request's tier by name from its head; `None`, or a name of no tier, is the
    /// layer's own limit. Read the plan from what authentication established (an extension it
    /// inserted, a claim of a verified token), never from a header the client writes: a client
    /// that names its own plan takes the largest.
    pub fn tier_by(
        mut self,
        select: impl Fn(&Parts) -> Option<&str> + Send + Sync + 'static,
    ) -> Self {
        self.tier_by = Some(Arc::new(select));
        self
    }

    /// Counts requests per key as `extractor` finds it (the same extractors as the rate limit).
    pub fn key<K2: KeyExtractor>(self, extractor: K2) -> ConcurrencyLimitLayerBuilder<K2> {
        ConcurrencyLimitLayerBuilder {
            store: self.store,
            limit: self.limit,
            lease: self.lease,
            retry_after: self.retry_after,
            queue: self.queue,
            on_store_error: self.on_store_error,
            missing_key: self.missing_key,
            prefix: self.prefix,
            tiers: self.tiers,
            tier_by: self.tier_by,
            advertise: self.advertise,
            in_store: self.in_store,
            limits_revision: self.limits_revision,
            limits_refresh: self.limits_refresh,
            extractor,
        }
    }

    /// The lease of a permit (default 10 s): extended every third of it while the request runs,
    /// so it bounds how long a copy that died keeps its permits.
    pub fn lease(mut self, lease: Duration) -> Self {
        self.lease = lease;
        self
    }

    /// The `Retry-After` of a refused request: about how long a request takes. Without it, the
    /// time until the first held permit's lease ends (an upper bound while its request runs on,
    /// since the lease is extended).
    pub fn retry_after(mut self, hint: Duration) -> Self {
        self.retry_after = Some(hint);
        self
    }

    /// Lets a request that finds no permit free wait for one, for up to `patience`, in the key's
    /// queue: permits go to waiters in the order they arrived, across every copy (a waiter
    /// tries again after a pause of 5 ms, doubling up to 100 ms, and keeps its place meanwhile);
    /// past `patience`, `429`. A waiter that goes away gives its place up. Without it (the
    /// default) a request is refused at once — behind any waiters of other layers on the same
    /// key.
    pub fn queue(mut self, patience: Duration) -> Self {
        self.queue = Some(patience);
        self
    }

    /// What to do when the store fails or does not answer in time (default:
    /// [`OnStoreError::Allow`]).
    pub fn on_store_error(mut self, policy: OnStoreError) -> Self {
        self.on_store_error = policy;
        self
    }

    /// What to do with a request whose key cannot be extracted (default:
    /// [`MissingKey::Reject`]).
    pub fn on_missing_key(mut self, policy: MissingKey) -> Self {
        self.missing_key = policy;
        self
    }

    /// Advertises the limit in the IETF headers under the policy `name`: every response carries
    /// `RateLimit-Policy: "<name>";q=<limit>;qu="concurrent-requests"` (the limit of the
    /// request's tier), and a refusal also `RateLimit: "<name>";r=0;t=<seconds>`. `name` is
    /// restricted as a limit's name is (ASCII letters, digits, `-`, `_`, `.`). Off by default.
    ///
    /// ```
    /// # tokio::runtime::Runtime::new().unwrap().block_on(async {
    /// use std::convert::Infallible;
    /// use http::{Request, Response};
    /// use tollgate::concurrency::ConcurrencyLimitLayer;
    /// use tollgate::store::MemoryStore;
    /// use tower::{Layer, ServiceExt, service_fn};
    ///
    /// let layer = ConcurrencyLimitLayer::builder(MemoryStore::new())
    ///     .limit(4)
    ///     .advertise("in-flight")
    ///     .build()
    ///     .unwrap();
    /// let service = layer.layer(service_fn(|_: Request<String>| async {
    ///     Ok::<_, Infallible>(Response::new(String::new()))
    /// }));
    /// let response = service.oneshot(Request::new(String::new())).await.unwrap();
    /// assert_eq!(
    ///     response.headers()["ratelimit-policy"],
    ///     r#""in-flight";q=4;qu="concurrent-requests""#
    /// );
    /// # });
    /// ```
    pub fn advertise(mut self, name: impl Into<String>) -> Self {
        self.advertise = Some(name.into());
        self
    }

    /// The prefix of the store keys (default `tollgate`): permits live under `<prefix>:cc:`.
    pub fn prefix(mut self, prefix: impl Into<String>) -> Self {
        self.prefix = prefix.into();
        self
    }

    /// The revision of the limits this builder sets, for
    /// [`build_in_store`](Self::build_in_store) (default 0): a copy whose revision is higher
    /// than that of the defaults in force replaces them, as a rate limit's does (see
    /// [`RateLimitLayerBuilder::limits_revision`](crate::rate_limit::RateLimitLayerBuilder::limits_revision)).
    pub fn limits_revision(mut self, revision: u64) -> Self {
        self.limits_revision = revision;
        self
    }

    /// How often a layer built with [`build_in_store`](Self::build_in_store) reads its limits
    /// in force again (default
    /// [`DEFAULT_LIMITS_REFRESH`](crate::rate_limit::DEFAULT_LIMITS_REFRESH), at least 10 ms):
    /// the bound on how long a change made through another copy takes to govern this one when
    /// the store's broadcast of it is lost.
    pub fn limits_refresh(mut self, every: Duration) -> Self {
        self.limits_refresh = every.max(Duration::from_millis(10));
        self
    }

    /// Builds the layer with its limits kept in the store, shared by every copy: the limits
    /// this builder sets are the defaults, and the store's table of the layer's namespace
    /// (`<prefix>:cc`) decides what is in force — as for a rate limit (see
    /// [`RateLimitLayerBuilder::build_in_store`](crate::rate_limit::RateLimitLayerBuilder::build_in_store)
    /// and `docs/limits.md`). Changes go through [`ConcurrencyLimitLayer::limits`].
    ///
    /// A store that cannot be read at the start does not fail the build: the layer decides with
    /// these limits until a read succeeds (logged).
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")] async fn main() {
    /// use tollgate::concurrency::ConcurrencyLimitLayer;
    /// use tollgate::store::MemoryStore;
    ///
    /// let store = MemoryStore::new();
    /// let first = ConcurrencyLimitLayer::builder(store.clone())
    ///     .limit(4)
    ///     .build_in_store()
    ///     .await
    ///     .unwrap();
    /// // a copy built with another limit decides with the one in force
    /// let second = ConcurrencyLimitLayer::builder(store)
    ///     .limit(8)
    ///     .build_in_store()
    ///     .await
    ///     .unwrap();
    /// assert_eq!((first.limit(), second.limit()), (4, 4));
    /// # }
    /// ```
    ///
    /// # Errors
    ///
    /// As [`build`](Self::build); and a [`ConfigError`] of kind
    /// [`Store`](ConfigErrorKind::Store) when the store keeps no limits
    /// ([`PermitStore::permit_limits`]).
    pub async fn build_in_store(mut self) -> Result<ConcurrencyLimitLayer<K>, ConfigError>
    where
        K: KeyExtractor,
    {
        if self.store.permit_limits().is_none() {
            return Err(ConfigError::new(
                ConfigErrorKind::Store,
                "this store keeps no limits: build_in_store needs one that does",
            ));
        }
        self.in_store = true;
        let layer = self.build()?;
        layer.settings.start_in_store().await;
        Ok(layer)
    }

    /// The layer, or what is wrong with its configuration, naming the layer by its prefix:
    /// `concurrency limit "tollgate": …`.
    pub fn build(self) -> Result<ConcurrencyLimitLayer<K>, ConfigError>
    where
        K: KeyExtractor,
    {
        let layer = format!("concurrency limit {:?}", self.prefix);
        self.validated().map_err(|e| e.within(&layer))
    }

    fn validated(self) -> Result<ConcurrencyLimitLayer<K>, ConfigError>
    where
        K: KeyExtractor,
    {
        let limit = self.checked_limits()?;
        if self.lease < Duration::from_millis(3) {
            return Err(ConfigError::new(
                ConfigErrorKind::Duration,
                format!(
                    "a permit's lease must be at least 3 ms, got {:?}",
                    self.lease
                ),
            ));
        }
        keyspace::check_prefix(&self.prefix)?;
        let advertise = match self.advertise {
            Some(name) => Some(advertised(name)?),
            None => None,
        };
        let local = local_permits(self.on_store_error)?;
        let recipe = InFlightRecipe {
            namespace: Arc::from(keyspace::concurrency_namespace(&self.prefix)),
            own: limit,
            tiers: self.tiers,
        };
        let limits = recipe.code();
        let in_store = self
            .in_store
            .then(|| InForce::new(recipe, self.limits_revision, self.limits_refresh));
        let settings = Settings {
            store: self.store,
            limits: ArcSwap::from_pointee(limits),
            tier_by: self.tier_by,
            in_store,
            listener: Listener::default(),
            advertise,
            lease: self.lease,
            retry_after: self.retry_after,
            queue: self.queue,
            on_store_error: self.on_store_error,
            local,
            missing_key: self.missing_key,
            missing_key_message: format!(
                "the request carries no concurrency-limit key: it is read from {}",
                self.extractor.describe()
            )
            .into(),
            limiter: Arc::from(keyspace::concurrency_namespace(&self.prefix)),
            prefix: self.prefix.into(),
            store_warning: OncePerSecond::new(),
            replay_warned: std::sync::atomic::AtomicBool::new(false),
        };
        Ok(ConcurrencyLimitLayer {
            settings: Arc::new(settings),
            extractor: Arc::new(self.extractor),
        })
    }

    /// The layer's own limit, once it and the tiers are checked.
    fn checked_limits(&self) -> Result<u32, ConfigError> {
        let limit_error = |message: String| ConfigError::new(ConfigErrorKind::Limit, message);
        let limit = match self.limit {
            Some(limit) if limit >= 1 => limit,
            limit => {
                return Err(limit_error(format!(
                    "needs .limit(n) with n >= 1, got {limit:?}"
                )));
            }
        };
        for (name, tier) in &self.tiers {
            if name.is_empty() || *tier == 0 {
                return Err(limit_error(format!(
                    "tier {name:?} needs a name and a limit >= 1, got {tier}"
                )));
            }
            if self.tiers.iter().filter(|(other, _)| other == name).count() > 1 {
                return Err(limit_error(format!("tier {name:?} is given twice")));
            }
        }
        if self.tier_by.is_some() == self.tiers.is_empty() {
            return Err(limit_error(
                "tiers and tier_by go together: name the tiers and how a request picks one".into(),
            ));
        }
        Ok(limit)
    }
}

/// The local fallback's permits, with [`OnStoreError::LocalFallback`].
fn local_permits(policy: OnStoreError) -> Result<Option<Arc<LocalPermits>>, ConfigError> {
    match policy {
        OnStoreError::LocalFallback { copies: 0 } => Err(ConfigError::new(
            ConfigErrorKind::FailurePolicy,
            "the local fallback needs copies >= 1",
        )),
        OnStoreError::LocalFallback { copies } => Ok(Some(Arc::new(LocalPermits::new(copies)))),
        _ => Ok(None),
    }
}

/// `name`, checked as a limit's name is: it goes into the headers unescaped.
fn advertised(name: String) -> Result<Box<str>, ConfigError> {
    if !keyspace::is_name(&name) {
        return Err(ConfigError::new(
            ConfigErrorKind::Limit,
            format!("the advertised name {name:?} must be ASCII letters, digits, '-', '_' or '.'"),
        ));
    }
    Ok(name.into_boxed_str())
}
