//! The example app's routes, shared state and configuration.
//!
//! Kept apart from `main.rs` so that integration tests can build several copies of the app on one
//! Redis, exactly as several processes would run: a test binary declares it at its root (in
//! `tests/app/main.rs`, `#[path = "../../examples/app/router.rs"] pub mod router;` — `pub`, so
//! that `unreachable_pub` and `dead_code` stay quiet). The configuration is read with the
//! examples' shared `crate::env` (`examples/shared/env.rs`), which an including crate declares at
//! its root too: `#[path = "../../examples/shared/env.rs"] pub mod env;`.
//!
//! Routes:
//!
//! | route            | what it does                                                        |
//! | ---------------- | ------------------------------------------------------------------- |
//! | `GET /healthz`   | `200 {"status":"ok"}` while the store answers `PING`, else `503`    |
//! | `GET /api/hello` | `200 {"message":"hello",...}`, rate-limited per caller — the tenant of an API key checked against `APP_API_KEYS`, else (anonymous) the client's address; `401` for a key the table does not know (`429` beyond `AUTH_FAILURES` such keys a minute from one address); with `APP_BLOCK`, a caller over a limit is blocked that long on every copy |
//! | `POST /coupons/{code}/redeem` | `200` for exactly one redemption across all copies, `409` for every other (with `Retry-After` while one awaits its replicas), `503` when the store does not answer |
//! | `POST /reports/{name}/rebuild` | rebuilds under a lock: `200` with the fencing token, `409` while another copy holds it |
//! | `POST /payments` | `201 {"id",...}` once per `Idempotency-Key` and tenant across all copies; retries replay it; `401` without an API key |
//! | `POST /llm/complete` | `200 {"tokens": N}` for JSON `{"tokens": N}` with an API key (else `401`); reserves `x-max-tokens` (default 1, held to at least 1 and at most the smallest quota of `APP_TOKEN_LIMITS`: a declared 0 is not free) of the tenant's budget and is charged the N it used; `429` with `Retry-After` when the reservation does not fit |
//! | `POST /jobs/{tenant}/run` | with an API key of `{tenant}` (else `401`, or `403` for another tenant's key): runs a job for `APP_JOB_MS`: `200 {"tenant","permit"}` for at most `APP_JOB_CONCURRENCY` per tenant at once across all copies (or the limit `APP_JOB_TIERS` gives the tenant's plan in `APP_API_KEYS`), `429` with `Retry-After` beyond |
//! | `POST /transfers` | with `DATABASE_URL` and an API key: JSON `{"from","to","amount"}` and a required `Idempotency-Key`; inserts one row into the app's table `app_transfers` in the transaction that records the response: `201 {"id",...}` once per key across all copies, replays with `idempotent-replayed: true`, `409` while in flight, `422` for another body under the key |
//! | `GET /transfers/count` | with `DATABASE_URL`: `200 {"count": N}`, the rows of `app_transfers` |
//! | `POST /webhooks/{source}` | processes a delivery once per `Webhook-Id` and sender across all copies: `200 {"source","webhook_id","bytes","run"}`, every repeated delivery answered with the first one's `run` (waiting for it while it runs); `400` without the header. Demo-only: the sender is the path and no signature is checked, which a real receiver does first |
//! | `GET /admin/callers/{key}` | with `APP_ADMIN_TOKEN` (`Authorization: Bearer …`, compared in constant time): what the tenant of API key `{key}` has left of `/api/*`'s limits and of its token budget, spending nothing; `404` for a key the table does not know |
//! | `POST /admin/callers/{key}/reset` | with `APP_ADMIN_TOKEN`: forgets what the tenant of API key `{key}` has spent, on every copy: `204` |
//! | `PUT /admin/callers/{key}/limits` | with `APP_ADMIN_TOKEN`: limits of its own on `/api/*` for the tenant of API key `{key}`, on every copy (body `name:count/<seconds>s,…`, note in `x-note`): `200` `{"version", "changed"}`, `422` for limits refused |
//! | `DELETE /admin/callers/{key}/limits` | with `APP_ADMIN_TOKEN`: the tenant back to `/api/*`'s limits: `200`, `404` when it had none of its own |
//!
//! Admin calls are rate-limited per client address (`ADMIN_CALLS` a minute, and `ADMIN_FAILURES`
//! refused tokens in 15 minutes, after which even the right token waits), and each is logged with
//! the peer address, the tenant and the key as a short digest.
//! | `GET /metrics`   | the crate's series in Prometheus text, not rate-limited             |
//!
//! A caller is the tenant of the `x-api-key` the app found in its table (`APP_API_KEYS`; a demo
//! table when unset, which the app warns of), put in the request's extensions by the
//! authentication middleware (`identity.rs`); without the header, `/api/*` counts the client's
//! address and the routes that act for a tenant answer `401`. No header chooses a plan. New
//! groups of routes get their own `*_routes` function, merged in [`router`].

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::{ConnectInfo, Path, Request, State};
use axum::http::header::CONTENT_TYPE;
use axum::http::request::Parts;
use axum::http::{HeaderMap, HeaderName, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Extension, Json, Router};
use metrics_exporter_prometheus::PrometheusHandle;
use serde::{Serialize, Serializer};
use serde_json::{Value, json};
use tokio_postgres::types::ToSql;
use tollgate::ConfigError;
use tollgate::claim::Claims;
use tollgate::concurrency::{ConcurrencyLimitLayer, ConcurrencyLimitLayerBuilder, Permit};
use tollgate::idempotency::IdempotencyLayer;
use tollgate::key::{self, BoxedKey, Cidr, ForwardedIp, Key, KeyExtractor, MissingKey, Or};
use tollgate::lock::{LockError, Locks};
use tollgate::rate_limit::{
    Algorithm, Limit, OnStoreError, RateLimitDecision, RateLimitLayer, RateLimitLayerBuilder,
};
use tollgate::store::{OnceTx, PgStore, Store};
use tower::util::MapRequestLayer;

use identity::{authenticate, require_caller};

use crate::env::{EnvError, Vars, process_var, whole_number};

#[path = "config.rs"]
mod config;
#[path = "handlers.rs"]
mod handlers;
#[path = "identity.rs"]
mod identity;
#[path = "ops.rs"]
mod ops;
pub use config::{
    AppConfig, DEFAULT_TOKEN_LIMITS, JobConfig, MAX_TOKENS_HEADER, TOKENS_USED_HEADER,
    parse_on_store_error,
};
pub use handlers::prepare_transfers;
use handlers::*;
pub use identity::{API_KEYS_FORMAT, AUTH_FAILURES, ApiKeys, Caller, DEMO_API_KEYS, masked};
pub use ops::{ADMIN_CALLS, ADMIN_FAILURES, WEBHOOK_ID_HEADER, parse_job_tiers};

/// The shared parsers of the app's variables, here too so that tests reach them as `app::…`.
pub use crate::env::{DEFAULT_LIMITS, parse_algorithm, parse_limits, parse_port, redact_url};

/// The header that carries an API key, checked against `APP_API_KEYS`.
pub const API_KEY_HEADER: HeaderName = HeaderName::from_static("x-api-key");

/// The port served when `PORT` is not set.
pub const DEFAULT_PORT: u16 = 3000;

/// What `PORT` must look like.
pub const PORT_FORMAT: &str = "a TCP port number from 0 to 65535, e.g. PORT=3000";

/// The key prefix of the `/api/*` rate limit in the store. Each rate-limited group of routes gets
/// its own prefix, so that equal limit names in two groups never share counters.
pub const API_PREFIX: &str = "tollgate-app:api";

/// How long `POST /payments` works by default.
pub const DEFAULT_PAYMENT_DELAY: Duration = Duration::from_millis(100);

/// How long `POST /reports/{name}/rebuild` works by default.
pub const DEFAULT_REPORT_WORK: Duration = Duration::from_millis(300);

/// The lease of a report lock; kept alive while the rebuild runs.
const REPORT_LEASE: Duration = Duration::from_secs(10);

/// How long `/healthz` waits for the store (the store has its own, shorter, timeout too).
const HEALTH_TIMEOUT: Duration = Duration::from_secs(1);

// ---------------------------------------------------------------------------------------------
// State and routes
// ---------------------------------------------------------------------------------------------

/// Who a request to `/api/*` counts against: its authenticated tenant, else (anonymous) its
/// client's network — the peer, or the client that the trusted proxies (`APP_TRUSTED_PROXIES`;
/// none by default) name.
pub type CallerKey = Or<ByCaller, ForwardedIp>;

/// The authenticated caller's tenant, as the authentication middleware put it in the request.
pub type ByCaller = key::Extension<Caller>;

/// What every handler can reach. Cheap to clone: everything in it is shared. Its `Debug` shows
/// the configuration's (redacted) and the store's kind, never a secret.
#[derive(Clone)]
pub struct AppState {
    /// The store every copy of the app shares (or a per-process one in development).
    pub store: Arc<dyn Store>,
    /// The configuration the app was started with.
    pub config: Arc<AppConfig>,
    /// The rate limit of `/api/*`.
    api_limit: RateLimitLayer<CallerKey>,
    /// "Already done" claims: redeemed coupons.
    pub claims: Claims,
    /// Locks: report rebuilds.
    pub locks: Locks,
    /// Idempotency of `POST /payments`, scoped by tenant.
    payments: IdempotencyLayer<ByCaller>,
    /// At most `APP_JOB_CONCURRENCY` jobs per tenant at once (its plan's, with `APP_JOB_TIERS`).
    jobs: ConcurrencyLimitLayer<ByCaller>,
    /// The token budget of `POST /llm/complete`: reserve, then settle.
    tokens: RateLimitLayer<ByCaller>,
    /// Requests with an unknown API key, per client address.
    auth_failures: RateLimitLayer<ForwardedIp>,
    /// Every admin call, per client address.
    admin_calls: RateLimitLayer<ForwardedIp>,
    /// Refused admin calls (a wrong token), per client address: an admitted call with the right
    /// token is refunded.
    admin_failures: RateLimitLayer<ForwardedIp>,
    /// `POST /webhooks/{source}`: once per `Webhook-Id` and sender.
    webhooks: IdempotencyLayer<BoxedKey>,
    /// With `DATABASE_URL`: the database of `POST /transfers`, and the idempotency layer that
    /// runs each transfer in a transaction recording its response.
    transfers: Option<(PgStore, IdempotencyLayer<ByCaller>)>,
}

impl std::fmt::Debug for AppState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AppState")
            .field("store", &self.config.store_kind())
            .field("config", &self.config)
            .field("transfers", &self.transfers.is_some())
            .finish_non_exhaustive()
    }
}

/// The path segment after a first segment `group` (`/<group>/<this>/...`), if there is one.
fn segment_after(parts: &Parts, group: &str) -> Option<String> {
    let mut segments = parts.uri.path().split('/').skip(1);
    match (segments.next(), segments.next()) {
        (Some(first), Some(next)) if first == group && !next.is_empty() => Some(next.to_owned()),
        _ => None,
    }
}

/// The rate limit of `/api/*`, as `config` sets it, on `store`.
fn api_limit(store: &Arc<dyn Store>, config: &AppConfig) -> RateLimitLayerBuilder<CallerKey> {
    RateLimitLayer::builder(Arc::clone(store))
        .prefix(API_PREFIX)
        .limits(
            config
                .limits
                .iter()
                .map(|limit| match (config.block, config.lease) {
                    (Some(block), _) => limit.clone().block_for(block),
                    (None, true) => limit.clone().leased(),
                    (None, false) => limit.clone(),
                }),
        )
        .algorithm(config.algorithm)
        .key(ByCaller::new().or(config.client_ip()))
        .on_store_error(config.on_store_error)
}

/// The limit of `/jobs` in flight per tenant, with the plans' tiers.
fn jobs_limit(
    store: &Arc<dyn Store>,
    config: &AppConfig,
) -> ConcurrencyLimitLayerBuilder<ByCaller> {
    let mut jobs = ConcurrencyLimitLayer::builder(Arc::clone(store))
        .prefix("tollgate-app")
        .limit(config.jobs.concurrency)
        .lease(config.jobs.lease)
        .retry_after(config.jobs.duration)
        .advertise("jobs")
        .key(ByCaller::new())
        .on_missing_key(MissingKey::RejectWith(StatusCode::UNAUTHORIZED));
    for (plan, limit) in &config.jobs.tiers {
        jobs = jobs.tier(plan.clone(), *limit);
    }
    if !config.jobs.tiers.is_empty() {
        // the plan of the tenant's entry in APP_API_KEYS, never one the request names
        jobs = jobs.tier_by(|parts| parts.extensions.get::<Caller>().map(Caller::plan));
    }
    jobs
}

impl AppState {
    /// Builds the app's middleware on `store` as `config` says; fails on invalid limits.
    pub fn new(store: Arc<dyn Store>, config: AppConfig) -> Result<Self, ConfigError> {
        let api_limit = api_limit(&store, &config).build()?;
        // `require_caller` in front: a payment without a tenant never reaches the layer
        let payments = IdempotencyLayer::builder(Arc::clone(&store))
            .prefix("tollgate-app")
            .required(true)
            .scope(ByCaller::new())
            .build()?;
        let jobs = jobs_limit(&store, &config).build()?;
        let ceiling = max_tokens_ceiling(&config.token_limits);
        let tokens = RateLimitLayer::builder(Arc::clone(&store))
            .prefix("tollgate-app:llm")
            .limits(config.token_limits.iter().cloned())
            .algorithm(config.algorithm)
            .key(ByCaller::new())
            .on_missing_key(MissingKey::RejectWith(StatusCode::UNAUTHORIZED))
            .on_store_error(config.on_store_error)
            .cost(move |request| reserved_tokens(&request.headers, ceiling))
            .settle(|response| header_number(&response.headers, &TOKENS_USED_HEADER))
            .build()?;
        let (admin_calls, admin_failures) = ops::admin_limits(&store, &config)?;
        let auth_failures = identity::auth_failures(&store, &config)?;
        let webhooks = ops::webhook_layer(&store)?;
        Ok(Self {
            claims: Claims::new(Arc::clone(&store)).with_prefix("tollgate-app")?,
            locks: Locks::new(Arc::clone(&store)).with_prefix("tollgate-app")?,
            store,
            config: Arc::new(config),
            api_limit,
            payments,
            jobs,
            tokens,
            auth_failures,
            admin_calls,
            admin_failures,
            webhooks,
            transfers: None,
        })
    }

    /// Gives back what this copy holds unspent of its leased slices (`APP_LEASE=on`), and waits
    /// for the store: at a graceful shutdown, so that the other copies have that quota at once.
    pub async fn give_back_leases(&self) {
        self.api_limit.give_back_leases().await;
    }

    /// Keeps the limits of `/api/*` and of `/jobs` in flight in the store, shared by every copy
    /// (see `docs/limits.md`): those of `config` are the defaults of revision `revision`, the
    /// store's are in force, and `tollgate limits` changes them for every copy.
    pub async fn with_limits_in_store(
        mut self,
        store: Arc<dyn Store>,
        config: &AppConfig,
        revision: u64,
    ) -> Result<Self, ConfigError> {
        self.api_limit = api_limit(&store, config)
            .limits_revision(revision)
            .build_in_store()
            .await?;
        self.jobs = jobs_limit(&store, config)
            .limits_revision(revision)
            .build_in_store()
            .await?;
        Ok(self)
    }

    /// The limits of `/api/*` in force on this copy.
    pub fn api_limits(&self) -> Arc<tollgate::rate::RatePolicy> {
        self.api_limit.policy()
    }

    /// Serves `POST /transfers` and `GET /transfers/count` on `database` (whose table
    /// `app_transfers` [`prepare_transfers`] creates): each transfer runs once per
    /// `Idempotency-Key`, its row and its recorded response in one transaction.
    pub fn with_transfers(mut self, database: PgStore) -> Result<Self, ConfigError> {
        // the key is required: every transfer gets its transaction
        let layer = IdempotencyLayer::in_transaction(database.clone())
            .prefix("tollgate-app")
            .scope(ByCaller::new())
            .build()?;
        self.transfers = Some((database, layer));
        Ok(self)
    }
}

/// The whole app. Serve it with `into_make_service_with_connect_info::<SocketAddr>()` so that
/// callers without an API key are keyed by their address.
pub fn router(state: AppState) -> Router {
    let authentication = axum::middleware::from_fn_with_state(state.clone(), authenticate);
    Router::new()
        .merge(health_routes())
        .merge(api_routes(&state))
        .merge(coupon_routes())
        .merge(report_routes())
        .merge(payment_routes(&state))
        .merge(job_routes(&state))
        .merge(llm_routes(&state))
        .merge(transfer_routes(&state))
        .merge(ops::webhook_routes(&state))
        .merge(ops::admin_routes(&state))
        // Before every route: the caller the layers key by comes from the table, not the client.
        .layer(authentication)
        // Outermost, so that the rate limits below see the peer address.
        .layer(MapRequestLayer::new(peer_addr_extension))
        .with_state(state)
}

/// `GET /metrics`: the crate's series (see `tollgate::metrics`) in Prometheus text, as
/// `handle` renders them; not rate-limited.
pub fn metrics_routes(handle: PrometheusHandle) -> Router {
    Router::new().route(
        "/metrics",
        get(move || {
            let handle = handle.clone();
            async move {
                (
                    [(CONTENT_TYPE, "text/plain; version=0.0.4")],
                    handle.render(),
                )
            }
        }),
    )
}

/// Liveness and readiness: not rate-limited.
fn health_routes() -> Router<AppState> {
    Router::new().route("/healthz", get(healthz))
}

/// The public API, rate-limited per caller.
fn api_routes(state: &AppState) -> Router<AppState> {
    Router::new()
        .route("/api/hello", get(hello))
        // `route_layer`: unknown paths get a plain 404 and cost the caller nothing.
        .route_layer(state.api_limit.clone())
}

/// Coupons: one redemption each, across all copies — a claim, one conditional write.
fn coupon_routes() -> Router<AppState> {
    Router::new().route("/coupons/{code}/redeem", post(redeem_coupon))
}

/// Reports: one rebuild at a time across all copies — a lock with a fencing token.
fn report_routes() -> Router<AppState> {
    Router::new().route("/reports/{name}/rebuild", post(rebuild_report))
}

/// Payments: each `Idempotency-Key` runs once across all copies; retries get the replay.
fn payment_routes(state: &AppState) -> Router<AppState> {
    Router::new()
        .route("/payments", post(create_payment))
        .route_layer(state.payments.clone())
        .route_layer(axum::middleware::from_fn(require_caller))
}

/// Jobs: at most `APP_JOB_CONCURRENCY` per tenant at once across all copies — permits with
/// leases in the store.
fn job_routes(state: &AppState) -> Router<AppState> {
    Router::new()
        .route("/jobs/{tenant}/run", post(run_job))
        .route_layer(state.jobs.clone())
        .route_layer(axum::middleware::from_fn(identity::require_own_tenant))
}

/// The largest reservation of `POST /llm/complete`: the smallest quota of its budget (a larger
/// one could never be admitted).
fn max_tokens_ceiling(limits: &[Limit]) -> u64 {
    limits.iter().map(Limit::quota).min().unwrap_or(1).max(1)
}

/// What a completion reserves: its `x-max-tokens`, 1 when absent or not a number, held to
/// `1..=ceiling` — a declared 0 would pass unchecked and unsettled, a declared billion could
/// never fit.
pub fn reserved_tokens(headers: &HeaderMap, ceiling: u64) -> u64 {
    header_number(headers, &MAX_TOKENS_HEADER)
        .unwrap_or(1)
        .clamp(1, ceiling.max(1))
}
