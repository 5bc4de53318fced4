//! [`IdempotencyLayer`] and its builder.

use std::sync::Arc;
use std::time::Duration;

use http::{HeaderName, Method, StatusCode, header};
use tower_layer::Layer;

use super::budget::BufferBudget;
use super::rejection::IdempotencyRejection;
use super::service::Idempotency;
use super::settings::{MissingScope, OnConcurrent, Settings, grpc_outcome_is_final};
use crate::error::{ConfigError, ConfigErrorKind};
use crate::key::{Global, KeyExtractor};
use crate::keyspace::{self, check_prefix};
use crate::store::{IdempotencyStore, TransactionStore};

/// The bytes of request bodies the layer buffers across all requests at once, by default.
const DEFAULT_BUFFER_BUDGET: usize = 64 << 20;

/// How long a request body may take to arrive whole, by default.
const DEFAULT_BODY_TIMEOUT: Duration = Duration::from_secs(30);

/// How long a body waits for room in a full budget before it is refused, by default.
const DEFAULT_BUFFER_WAIT: Duration = Duration::from_secs(1);

/// The budget of buffered request bodies as the builder was told it.
#[derive(Debug)]
struct BudgetDraft {
    total: usize,
    /// One caller's share; by default an eighth of the total, but at least the body limit.
    per_caller: Option<usize>,
    wait: Duration,
}

/// Applies [`Idempotency`] to a service: `Idempotency-Key` records kept in a shared
/// [`IdempotencyStore`].
///
/// ```
/// use std::time::Duration;
/// use tollgate::idempotency::IdempotencyLayer;
/// use tollgate::key::Header;
/// use tollgate::store::MemoryStore;
///
/// let layer = IdempotencyLayer::builder(MemoryStore::new())
///     .required(true)
///     .scope(Header::from_static("authorization"))
///     .retention(Duration::from_secs(24 * 3600))
///     .build()
///     .unwrap();
/// # let _ = layer;
/// ```
pub struct IdempotencyLayer<K = Global> {
    settings: Arc<Settings>,
    scope: Arc<K>,
}

impl<K> Clone for IdempotencyLayer<K> {
    fn clone(&self) -> Self {
        Self {
            settings: Arc::clone(&self.settings),
            scope: Arc::clone(&self.scope),
        }
    }
}

debug_fields!(IdempotencyLayer<K> { settings, scope });

impl IdempotencyLayer {
    /// Starts a builder on `store` (a [`RedisStore`](crate::store::RedisStore) so that every copy
    /// of the service sees the records).
    pub fn builder(store: impl IdempotencyStore) -> IdempotencyLayerBuilder {
        IdempotencyLayerBuilder {
            settings: Settings {
                store: Arc::new(store),
                prefix: keyspace::DEFAULT_PREFIX.to_owned(),
                header: HeaderName::from_static("idempotency-key"),
                required: false,
                missing_scope: MissingScope::Reject,
                methods: vec![Method::POST, Method::PATCH],
                fingerprint_headers: Vec::new(),
                unstored_headers: vec![header::SET_COOKIE],
                body_limit: 1 << 20,
                body_timeout: DEFAULT_BODY_TIMEOUT,
                share_by_scope: false,
                // made anew by `build`, from `budget`
                buffered: Arc::new(BufferBudget::new(0, 0, Duration::ZERO)),
                response_limit: 1 << 20,
                lease: Duration::from_secs(30),
                retention: Duration::from_secs(24 * 3600),
                on_concurrent: OnConcurrent::Reject,
                store_when: Arc::new(|status: StatusCode| !status.is_server_error()),
                store_grpc_when: Arc::new(grpc_outcome_is_final),
                rejection: None,
                transaction: None,
            },
            scope: Global,
            scope_chosen: false,
            budget: BudgetDraft {
                total: DEFAULT_BUFFER_BUDGET,
                per_caller: None,
                wait: DEFAULT_BUFFER_WAIT,
            },
        }
    }

    /// Starts a builder whose handlers run **in a transaction of `store`** that records their
    /// response in its own commit: the handler finds the transaction in its request's
    /// extensions as an [`OnceTx`](crate::store::OnceTx) (an `OnceTx` argument in axum with the
    /// crate's `axum` feature, else `Extension<OnceTx>`; `request.extensions().get::<OnceTx>()`
    /// in tonic), writes its rows through it and
    /// answers; the layer records the response in the same transaction and commits. Both stand
    /// or neither does: a handler that fails, panics or whose copy dies leaves nothing, and its
    /// key is free at once; a committed request replays to every retry.
    ///
    /// - The key is [required](IdempotencyLayerBuilder::required) by default: a handler that
    ///   needs its transaction gets one on every request it sees (`400` without a key). With
    ///   `.required(false)`, requests without a key pass through without a transaction: take
    ///   `Option<OnceTx>` (or `Option<Extension<OnceTx>>`) then.
    /// - Concurrent requests with one key are kept out (`409`) by a transaction-level advisory
    ///   lock taken as the transaction begins: nothing holds the key longer than the
    ///   transaction, which lasts as long as the handler and its response. A request with
    ///   another body under a key still running gets `409` too (the running request's
    ///   fingerprint is not committed yet), and `422` once it has committed. The server ends a
    ///   transaction left idle for a [lease](IdempotencyLayerBuilder::lease) (a copy cut off
    ///   from the database), which frees its key.
    /// - Isolation: READ COMMITTED, PostgreSQL's default, as the handler would have without the
    ///   layer; the lock keeps requests with one key apart, not the handler's rows from other
    ///   writers (take row locks, or raise the level with `SET TRANSACTION ISOLATION LEVEL …` as
    ///   its first statement, where it needs more).
    /// - A commit whose answer was lost is looked up before anything is said: committed, the
    ///   caller gets the response; not, `503` and nothing stands.
    /// - Responses the layer would not store (5xx, a retryable gRPC status) are rolled back with
    ///   the handler's rows; so are responses over the [storage
    ///   cap](IdempotencyLayerBuilder::response_limit) and bodies that fail, answered `503`.
    /// - Each running request holds one of the store's pooled connections until it ends: give
    ///   the layer a [`PgStore`](crate::store::PgStore) of its own (its own
    ///   [pool size](crate::store::PgStoreBuilder::pool_size)) when the same database also
    ///   serves rate limits, so that slow handlers cannot starve them.
    /// - Cost: a replay is one round trip; a first execution two besides the handler's own
    ///   statements (the transaction's start with the lock and the lookup, pipelined; the record
    ///   with the commit), as for the store-backed layer (claim, complete). The handler's
    ///   statements cost one round trip each when prepared with
    ///   [`OnceTx::prepare_cached`](crate::store::OnceTx::prepare_cached).
    ///
    /// ```
    /// # #[cfg(feature = "postgres")]
    /// # fn layer(store: tollgate::store::PgStore) {
    /// use tollgate::idempotency::IdempotencyLayer;
    /// let layer = IdempotencyLayer::in_transaction(store).unscoped().build();
    /// assert!(layer.is_ok());
    /// # }
    /// ```
    pub fn in_transaction<S>(store: S) -> IdempotencyLayerBuilder
    where
        S: IdempotencyStore + TransactionStore + Clone,
    {
        let mut builder = Self::builder(store.clone()).required(true);
        builder.settings.transaction = Some(Arc::new(store));
        builder
    }
}

impl<S, K> Layer<S> for IdempotencyLayer<K> {
    type Service = Idempotency<S, K>;

    fn layer(&self, inner: S) -> Self::Service {
        Idempotency::new(inner, Arc::clone(&self.settings), Arc::clone(&self.scope))
    }
}

/// Configures an [`IdempotencyLayer`]; made by [`IdempotencyLayer::builder`].
pub struct IdempotencyLayerBuilder<K = Global> {
    settings: Settings,
    scope: K,
    /// Whether [`scope`](Self::scope) or [`unscoped`](Self::unscoped) was called: one must be.
    scope_chosen: bool,
    budget: BudgetDraft,
}

debug_fields!(IdempotencyLayerBuilder<K> { settings, scope, budget });

impl<K> IdempotencyLayerBuilder<K> {
    /// The header carrying the key (default `Idempotency-Key`; gRPC metadata arrives as the same
    /// lowercase header).
    pub fn header(mut self, name: HeaderName) -> Self {
        self.settings.header = name;
        self
    }

    /// Whether covered requests without a key get `400` (default false: they pass through).
    pub fn required(mut self, required: bool) -> Self {
        self.settings.required = required;
        self
    }

    /// The methods covered (default POST and PATCH); others pass through untouched.
    pub fn methods(mut self, methods: impl IntoIterator<Item = Method>) -> Self {
        self.settings.methods = methods.into_iter().collect();
        self
    }

    /// Whose keys these are: the authenticated caller — an API key or user header — so that two
    /// clients choosing the same key never see each other's responses. In one shared namespace,
    /// a client that reuses (or guesses) another's key with the same request is replayed the
    /// other's response. A keyed request whose scope cannot be extracted is refused (`400`; see
    /// [`missing_scope`](Self::missing_scope)). The scope must be chosen, by this or
    /// [`unscoped`](Self::unscoped): the layer does not build without.
    ///
    /// The scope names who is calling, so it should come from what authenticated the caller —
    /// an extension that the authentication layer sets, or the credential itself — not from a
    /// header any client may write or leave out.
    pub fn scope<K2: KeyExtractor>(self, scope: K2) -> IdempotencyLayerBuilder<K2> {
        IdempotencyLayerBuilder {
            settings: Settings {
                share_by_scope: true,
                ..self.settings
            },
            scope,
            scope_chosen: true,
            budget: self.budget,
        }
    }

    /// What a keyed request whose [scope](Self::scope) cannot be read gets (default
    /// [`MissingScope::Reject`]: `400`, nothing claimed, read or stored). Requests without an
    /// `Idempotency-Key` pass through as [`required`](Self::required) says, whatever this is.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")] async fn main() {
    /// use http::{Request, Response, StatusCode};
    /// use http_body_util::Full;
    /// use tower::{ServiceBuilder, ServiceExt};
    /// use tollgate::idempotency::{IdempotencyLayer, MissingScope};
    /// use tollgate::key::Header;
    /// use tollgate::store::MemoryStore;
    ///
    /// let layer = IdempotencyLayer::builder(MemoryStore::new())
    ///     .scope(Header::from_static("x-api-key"))
    ///     .missing_scope(MissingScope::RejectWith(StatusCode::UNAUTHORIZED))
    ///     .build()
    ///     .unwrap();
    /// let service = ServiceBuilder::new()
    ///     .layer(layer)
    ///     .service_fn(|_| async { Ok::<_, std::convert::Infallible>(Response::new(Full::new("paid".into()))) });
    /// let anonymous = Request::post("/payments")
    ///     .header("idempotency-key", "order-1")
    ///     .body(Full::new("{}".into()))
    ///     .unwrap();
    /// let response = service.oneshot(anonymous).await.unwrap();
    /// assert_eq!(response.status(), StatusCode::UNAUTHORIZED);
    /// # }
    /// ```
    pub fn missing_scope(mut self, missing: MissingScope) -> Self {
        self.settings.missing_scope = missing;
        self
    }

    /// One namespace of keys for every caller, chosen on purpose: right when keys are unguessable
    /// (random UUIDs that clients never share) or when a single client calls the service.
    pub fn unscoped(self) -> IdempotencyLayerBuilder<Global> {
        IdempotencyLayerBuilder {
            settings: Settings {
                share_by_scope: false,
                ..self.settings
            },
            scope: Global,
            scope_chosen: true,
            budget: self.budget,
        }
    }

    /// Headers that join method, path + query and body in the request fingerprint (default
    /// none).
    pub fn fingerprint_headers(mut self, headers: impl IntoIterator<Item = HeaderName>) -> Self {
        self.settings.fingerprint_headers = headers.into_iter().collect();
        self
    }

    /// Response headers never stored for replay (and so never replayed), besides `Set-Cookie`,
    /// which is never stored: say `authorization-info` or a per-caller token. A replay may reach
    /// another client than the first — one that guessed the key within the same scope.
    pub fn unstored_headers(mut self, headers: impl IntoIterator<Item = HeaderName>) -> Self {
        self.settings.unstored_headers =
            std::iter::once(header::SET_COOKIE).chain(headers).collect();
        self
    }

    /// The largest request body buffered for fingerprinting (default 1 MiB); larger requests get
    /// `413`.
    pub fn body_limit(mut self, bytes: usize) -> Self {
        self.settings.body_limit = bytes;
        self
    }

    /// How long a request body may take to arrive whole (default 30 s); a slower one gets
    /// `408 Request Timeout` (gRPC: DEADLINE_EXCEEDED) and gives its room in the
    /// [budget](Self::max_buffered) back, so that a client that declares a body and goes silent
    /// holds memory for this long at most.
    pub fn body_timeout(mut self, timeout: Duration) -> Self {
        self.settings.body_timeout = timeout;
        self
    }

    /// The most bytes of request bodies buffered across all requests at once (default 64 MiB),
    /// so that slow or many uploads cannot exhaust memory. A body that finds the budget full
    /// waits up to [`buffer_wait`](Self::buffer_wait) for room, then gets `503` with
    /// `Retry-After: 1`. Clones of the layer share the budget.
    pub fn max_buffered(mut self, bytes: usize) -> Self {
        self.budget.total = bytes;
        self
    }

    /// The most bytes of request bodies one caller — one [scope](Self::scope) — has buffered at
    /// once (default an eighth of [`max_buffered`](Self::max_buffered), but at least the
    /// [body limit](Self::body_limit)): a caller whose own uploads hold its share gets `503` at
    /// once, while the rest of the budget serves every other caller. An
    /// [unscoped](Self::unscoped) layer names no caller: its requests share the budget only.
    pub fn max_buffered_per_caller(mut self, bytes: usize) -> Self {
        self.budget.per_caller = Some(bytes);
        self
    }

    /// How long a request body waits for room once the [budget](Self::max_buffered) is full
    /// (default 1 s), before it is refused with `503`.
    pub fn buffer_wait(mut self, wait: Duration) -> Self {
        self.budget.wait = wait;
        self
    }

    /// The largest response body stored for replay (default 1 MiB), and so the most the layer
    /// holds of one response before its record is confirmed. A larger response still reaches its
    /// caller in full, but is not stored: once it passes the cap the key is released, the caller
    /// gets what was held and then the rest as it is produced, and a retry runs the handler
    /// again.
    pub fn response_limit(mut self, bytes: usize) -> Self {
        self.settings.response_limit = bytes;
        self
    }

    /// The lease of an in-flight claim (default 30 s): extended every third of it while the
    /// handler runs; a copy that dies mid-request frees the key after it.
    pub fn lease(mut self, lease: Duration) -> Self {
        self.settings.lease = lease;
        self
    }

    /// How long completed responses are kept for replay (default 24 h).
    pub fn retention(mut self, retention: Duration) -> Self {
        self.settings.retention = retention;
        self
    }

    /// What a duplicate does while the first request runs (default [`OnConcurrent::Reject`]).
    pub fn on_concurrent(mut self, on_concurrent: OnConcurrent) -> Self {
        self.settings.on_concurrent = on_concurrent;
        self
    }

    /// Which responses are stored for replay, by status (default: all but 5xx). A response to be
    /// stored reaches its caller once its record is confirmed; one that is not streams to its
    /// caller at once and releases the key, so that a retry runs the handler again.
    pub fn store_when(
        mut self,
        predicate: impl Fn(StatusCode) -> bool + Send + Sync + 'static,
    ) -> Self {
        self.settings.store_when = Arc::new(predicate);
        self
    }

    /// Which gRPC responses are stored for replay, by their `grpc-status` code (read from the
    /// trailers, or the headers of a trailers-only response). Default: all but the failures a
    /// retry may cure — CANCELLED (1), UNKNOWN (2), DEADLINE_EXCEEDED (4), RESOURCE_EXHAUSTED (8),
    /// ABORTED (10), INTERNAL (13), UNAVAILABLE (14) and DATA_LOSS (15). A gRPC failure arrives
    /// as HTTP 200, so [`store_when`](Self::store_when) alone cannot see it.
    pub fn store_grpc_when(
        mut self,
        predicate: impl Fn(i32) -> bool + Send + Sync + 'static,
    ) -> Self {
        self.settings.store_grpc_when = Arc::new(predicate);
        self
    }

    /// Builds the HTTP response the layer gives instead of the handler's — `400` for a bad
    /// key, `409` while the first request runs, `413`, `422` for a key reused with another
    /// request, `503` when the store fails — from why it refused, in place of the default
    /// problem details (RFC 9457, type `about:blank`). `Retry-After` is added where a retry may
    /// soon succeed. gRPC calls keep their trailers-only status.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")] async fn main() {
    /// use http::{Request, Response, StatusCode, header};
    /// use http_body_util::{BodyExt, Full};
    /// use tower::{ServiceBuilder, ServiceExt};
    /// use tollgate::idempotency::IdempotencyLayer;
    /// use tollgate::store::MemoryStore;
    ///
    /// let layer = IdempotencyLayer::builder(MemoryStore::new())
    ///     .unscoped()
    ///     .required(true)
    ///     .rejection(|why| {
    ///         Response::builder()
    ///             .status(why.status())
    ///             .header(header::CONTENT_TYPE, "application/json")
    ///             .body(format!(r#"{{"error":"{}","message":"{}"}}"#, why.code(), why.detail()).into())
    ///             .unwrap_or_default()
    ///     })
    ///     .build()
    ///     .unwrap();
    /// let service = ServiceBuilder::new()
    ///     .layer(layer)
    ///     .service_fn(|_| async { Ok::<_, std::convert::Infallible>(Response::new(Full::new("done".into()))) });
    ///
    /// let unkeyed = Request::post("/payments").body(Full::new("{}".into())).unwrap();
    /// let response = service.oneshot(unkeyed).await.unwrap();
    /// assert_eq!(response.status(), StatusCode::BAD_REQUEST);
    /// let body = response.into_body().collect().await.unwrap().to_bytes();
    /// assert_eq!(body, r#"{"error":"invalid_key","message":"the Idempotency-Key header is required"}"#);
    /// # }
    /// ```
    pub fn rejection(
        mut self,
        build: impl Fn(&IdempotencyRejection) -> http::Response<bytes::Bytes> + Send + Sync + 'static,
    ) -> Self {
        self.settings.rejection = Some(Arc::new(build));
        self
    }

    /// The prefix of the store keys (default `tollgate`): `<prefix>:idem:{<digest>}`.
    pub fn prefix(mut self, prefix: impl Into<String>) -> Self {
        self.settings.prefix = prefix.into();
        self
    }

    /// Validates the configuration; an error names the layer by its prefix:
    /// `idempotency "tollgate": …`.
    pub fn build(self) -> Result<IdempotencyLayer<K>, ConfigError> {
        let layer = format!("idempotency {:?}", self.settings.prefix);
        self.validated().map_err(|e| e.within(&layer))
    }

    fn validated(self) -> Result<IdempotencyLayer<K>, ConfigError> {
        if !self.scope_chosen {
            return Err(ConfigError::new(
                ConfigErrorKind::Scope,
                "choose whose idempotency keys these are: .scope(extractor), or .unscoped() for one namespace of all callers",
            ));
        }
        let mut settings = self.settings;
        let budget = self.budget;
        let per_caller = budget
            .per_caller
            .unwrap_or((budget.total / 8).max(settings.body_limit))
            .min(budget.total);
        if per_caller < settings.body_limit.min(budget.total) {
            return Err(ConfigError::new(
                ConfigErrorKind::Limit,
                "the buffer share per caller is smaller than the body limit: bodies the limit allows would be refused",
            ));
        }
        settings.buffered = Arc::new(BufferBudget::new(budget.total, per_caller, budget.wait));
        if settings.body_timeout.is_zero() {
            return Err(ConfigError::new(
                ConfigErrorKind::Duration,
                "the body timeout must be positive",
            ));
        }
        if settings.lease < Duration::from_millis(10) {
            return Err(ConfigError::new(
                ConfigErrorKind::Duration,
                "the idempotency lease must be at least 10 ms",
            ));
        }
        if settings.retention < Duration::from_millis(1) {
            return Err(ConfigError::new(
                ConfigErrorKind::Duration,
                "the idempotency retention must be positive",
            ));
        }
        if settings.methods.is_empty() {
            return Err(ConfigError::new(
                ConfigErrorKind::Methods,
                "the idempotency layer covers no method",
            ));
        }
        check_prefix(&settings.prefix)?;
        Ok(IdempotencyLayer {
            settings: Arc::new(settings),
            scope: Arc::new(self.scope),
        })
    }
}
