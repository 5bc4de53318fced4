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
//! | `GET /api/hello` | `200 {"message":"hello",...}`, rate-limited per caller; with `APP_BLOCK`, a caller over a limit is blocked that long on every copy |
//! | `POST /coupons/{code}/redeem` | `200` for exactly one redemption across all copies, `409` for every other (with `Retry-After` while one awaits its replicas), `503` when the store does not answer |
//! | `POST /reports/{name}/rebuild` | rebuilds under a lock: `200` with the fencing token, `409` while another copy holds it |
//! | `POST /payments` | `201 {"id",...}` once per `Idempotency-Key` across all copies; retries replay it |
//! | `POST /llm/complete` | `200 {"tokens": N}` for JSON `{"tokens": N}` with `x-api-key`; reserves `x-max-tokens` (default 1) of the key's `APP_TOKEN_LIMITS` budget and is charged the N it used; `429` with `Retry-After` when the reservation does not fit |
//! | `POST /jobs/{tenant}/run` | runs a job for `APP_JOB_MS`: `200 {"tenant","permit"}` for at most `APP_JOB_CONCURRENCY` per tenant at once across all copies (or the limit `APP_JOB_TIERS` gives the plan in `x-plan`), `429` with `Retry-After` beyond |
//! | `POST /transfers` | with `DATABASE_URL`: JSON `{"from","to","amount"}` and a required `Idempotency-Key`; inserts one row into the app's table `app_transfers` in the transaction that records the response: `201 {"id",...}` once per key across all copies, replays with `idempotent-replayed: true`, `409` while in flight, `422` for another body under the key |
//! | `GET /transfers/count` | with `DATABASE_URL`: `200 {"count": N}`, the rows of `app_transfers` |
//! | `POST /webhooks/{source}` | processes a delivery once per `Webhook-Id` and sender across all copies: `200 {"source","webhook_id","bytes","run"}`, every repeated delivery answered with the first one's `run` (waiting for it while it runs); `400` without the header |
//! | `GET /admin/callers/{key}` | with `APP_ADMIN_TOKEN` (`Authorization: Bearer …`): what API key `{key}` has left of `/api/*`'s limits and of its token budget, spending nothing |
//! | `POST /admin/callers/{key}/reset` | with `APP_ADMIN_TOKEN`: forgets what API key `{key}` has spent, on every copy: `204` |
//! | `GET /metrics`   | the crate's series in Prometheus text, not rate-limited             |
//!
//! A caller is the `x-api-key` header when present, otherwise the peer IP address. New groups of
//! routes get their own `*_routes` function, merged in [`router`].

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
use tollgate::concurrency::{ConcurrencyLimitLayer, Permit};
use tollgate::idempotency::IdempotencyLayer;
use tollgate::key::{self, BoxedKey, Cidr, ForwardedIp, Header, Key, KeyExtractor, Or};
use tollgate::lock::{LockError, Locks};
use tollgate::rate_limit::{Algorithm, Limit, OnStoreError, RateLimitDecision, RateLimitLayer};
use tollgate::store::{OnceTx, PgStore, Store};
use tower::util::MapRequestLayer;

use crate::env::{EnvError, Vars, process_var, whole_number};

#[path = "ops.rs"]
mod ops;
pub use ops::{PLAN_HEADER, WEBHOOK_ID_HEADER, parse_job_tiers};

/// The shared parsers of the app's variables, here too so that tests reach them as `app::…`.
pub use crate::env::{DEFAULT_LIMITS, parse_algorithm, parse_limits, parse_port, redact_url};

/// The header that names an API caller.
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
// Configuration
// ---------------------------------------------------------------------------------------------

/// The app's configuration, read from the environment by [`AppConfig::from_env`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AppConfig {
    /// `PORT`: served on `127.0.0.1:<port>` (0: any free port).
    pub port: u16,
    /// `REDIS_URL`: the shared store; `None` means an in-memory store for this process only.
    pub redis_url: Option<String>,
    /// `APP_LIMITS`: the limits of `/api/*`, all checked together.
    pub limits: Vec<Limit>,
    /// `APP_ALGORITHM`: how the limits count.
    pub algorithm: Algorithm,
    /// `REDIS_CLUSTER_URLS`: the nodes of a Redis Cluster, the alternative to `REDIS_URL`.
    pub redis_cluster_urls: Vec<String>,
    /// `REDIS_SENTINELS`: the sentinels of a Redis behind Sentinel, the third alternative.
    pub redis_sentinels: Vec<String>,
    /// `REDIS_SENTINEL_MASTER`: the master name the sentinels monitor.
    pub redis_sentinel_master: Option<String>,
    /// `DATABASE_URL`: a PostgreSQL database (`postgres://…`), the alternative to Redis.
    pub database_url: Option<String>,
    /// `REDIS_WAIT_REPLICAS`: how many replicas must acknowledge every claim, lock and payment
    /// record before it counts (0: none).
    pub wait_replicas: u32,
    /// `APP_STORE_TIMEOUT_MS`: how long a store call may take before it fails (unset: the
    /// store's default, 250 ms).
    pub store_timeout: Option<Duration>,
    /// `APP_TRUSTED_PROXIES`: the proxies whose `X-Forwarded-For` names the client (none: the
    /// peer is the client).
    pub trusted_proxies: Vec<Cidr>,
    /// `APP_ON_STORE_ERROR`: what `/api/*` does while the store is down.
    pub on_store_error: OnStoreError,
    /// `APP_TRANSFER_DELAY_MS`: how long `POST /transfers` waits after its insert, before its
    /// transaction commits.
    pub transfer_delay: Duration,
    /// `APP_PAYMENT_DELAY_MS`: how long `POST /payments` works before it answers.
    pub payment_delay: Duration,
    /// `APP_REPORT_MS`: how long `POST /reports/{name}/rebuild` works under its lock.
    pub report_work: Duration,
    /// `APP_JOB_*`: the jobs of `POST /jobs/{tenant}/run`.
    pub jobs: JobConfig,
    /// `APP_TOKEN_LIMITS`: the token budget of `POST /llm/complete`, per API key, counted with
    /// `APP_ALGORITHM`.
    pub token_limits: Vec<Limit>,
    /// `APP_ADMIN_TOKEN`: the bearer token of `/admin/*`; unset, those routes are not served.
    pub admin_token: Option<String>,
    /// `APP_BLOCK` (`30s`, say): a caller that goes over a limit of `/api/*` is blocked that
    /// long on every copy; unset, no penalty.
    pub block: Option<Duration>,
}

/// The token budget when `APP_TOKEN_LIMITS` is not set.
pub const DEFAULT_TOKEN_LIMITS: &str = "tokens:1000/60s";

/// The header in which a caller of `POST /llm/complete` says how many tokens it may use: what
/// it reserves (1 when absent).
pub const MAX_TOKENS_HEADER: HeaderName = HeaderName::from_static("x-max-tokens");

/// The header in which `POST /llm/complete` reports the tokens it used: what it is charged.
pub const TOKENS_USED_HEADER: HeaderName = HeaderName::from_static("x-tokens-used");

/// The jobs of `POST /jobs/{tenant}/run`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JobConfig {
    /// `APP_JOB_MS` (default 200): how long a job runs.
    pub duration: Duration,
    /// `APP_JOB_CONCURRENCY` (default 2): at most this many jobs per tenant at once, across
    /// every copy.
    pub concurrency: u32,
    /// `APP_JOB_LEASE_MS` (default 3000): how soon a copy that dies gives its jobs' permits back.
    pub lease: Duration,
    /// `APP_JOB_TIERS` (`pro=10,enterprise=50`): the limits of the plans a request names in
    /// `x-plan`, in place of `APP_JOB_CONCURRENCY`.
    pub tiers: Vec<(String, u32)>,
}

impl Default for JobConfig {
    fn default() -> Self {
        Self {
            duration: Duration::from_millis(200),
            concurrency: 2,
            lease: Duration::from_millis(3000),
            tiers: Vec::new(),
        }
    }
}

/// What `APP_TRUSTED_PROXIES` must look like.
const TRUSTED_PROXIES_FORMAT: &str = "comma-separated CIDRs of the proxies in front of the app, e.g. APP_TRUSTED_PROXIES=10.0.0.0/8,fd00::/8";

/// What `APP_ON_STORE_ERROR` must look like.
const ON_STORE_ERROR_FORMAT: &str =
    "allow (the default), deny, or fallback:N with N the number of copies, e.g. fallback:2";

/// Parses `APP_ON_STORE_ERROR`: `allow`, `deny` or `fallback:N` (N >= 1 copies).
pub fn parse_on_store_error(value: &str) -> Result<OnStoreError, String> {
    match value.trim() {
        "allow" => Ok(OnStoreError::Allow),
        "deny" => Ok(OnStoreError::Deny),
        other => {
            let copies = other
                .strip_prefix("fallback:")
                .ok_or_else(|| format!("unknown policy {other:?}"))?;
            match whole_number(copies).and_then(|n| u32::try_from(n).ok()) {
                Some(copies) if copies >= 1 => Ok(OnStoreError::LocalFallback { copies }),
                _ => Err(format!("{copies:?} is not a number of copies (1 or more)")),
            }
        }
    }
}

impl AppConfig {
    /// Who a request without an API key counts against: its peer's network or, from a trusted
    /// proxy, the client's it names.
    pub fn client_ip(&self) -> ForwardedIp {
        ForwardedIp::new(self.trusted_proxies.iter().copied())
    }

    /// The kind of store configured: `memory`, `redis`, `redis-cluster`, `redis-sentinel` or
    /// `postgres`.
    pub fn store_kind(&self) -> &'static str {
        if self.database_url.is_some() {
            "postgres"
        } else if !self.redis_sentinels.is_empty() {
            "redis-sentinel"
        } else if !self.redis_cluster_urls.is_empty() {
            "redis-cluster"
        } else if self.redis_url.is_some() {
            "redis"
        } else {
            "memory"
        }
    }

    /// The configuration of an empty environment, served on any free port (`PORT=0`): a base
    /// for tests, which change what they need with `..AppConfig::defaults()?`.
    pub fn defaults() -> Result<Self, EnvError> {
        Self::from_lookup(|_| None).map(|config| Self { port: 0, ..config })
    }

    /// Reads `PORT`, `REDIS_URL`, `APP_LIMITS` and `APP_ALGORITHM`. A variable that is unset or
    /// empty takes its default.
    pub fn from_env() -> Result<Self, EnvError> {
        Self::from_lookup(process_var)
    }

    /// Like [`AppConfig::from_env`], with the variables read through `lookup`.
    pub fn from_lookup(lookup: impl Fn(&str) -> Option<String>) -> Result<Self, EnvError> {
        let vars = Vars::new(lookup);
        let port = vars.port(DEFAULT_PORT, PORT_FORMAT)?;
        let limits = vars.limits()?;
        let algorithm = vars.algorithm()?;
        let redis_url = vars.redis_url();
        let redis_cluster_urls = vars.list("REDIS_CLUSTER_URLS");
        let redis_sentinels = vars.list("REDIS_SENTINELS");
        let redis_sentinel_master = vars
            .get("REDIS_SENTINEL_MASTER")
            .map(|m| m.trim().to_owned());
        let database_url = vars
            .get("DATABASE_URL")
            .map(|url| url.trim().to_owned())
            .filter(|url| !url.is_empty());
        let stores = [
            ("REDIS_URL", redis_url.is_some()),
            ("REDIS_CLUSTER_URLS", !redis_cluster_urls.is_empty()),
            ("REDIS_SENTINELS", !redis_sentinels.is_empty()),
            ("DATABASE_URL", database_url.is_some()),
        ];
        let mut set = stores.iter().filter(|(_, set)| *set).map(|(var, _)| *var);
        if let (Some(first), Some(second)) = (set.next(), set.next()) {
            return Err(EnvError::new(
                second,
                "(set)",
                format!("{first} is set as well"),
                "one of REDIS_URL, REDIS_CLUSTER_URLS, REDIS_SENTINELS or DATABASE_URL, not several",
            ));
        }
        if !redis_sentinels.is_empty() && redis_sentinel_master.is_none() {
            return Err(EnvError::new(
                "REDIS_SENTINEL_MASTER",
                "",
                "REDIS_SENTINELS is set, but not the master name",
                "the name the sentinels monitor, e.g. REDIS_SENTINEL_MASTER=mymaster",
            ));
        }
        let trusted_proxies = vars
            .list("APP_TRUSTED_PROXIES")
            .iter()
            .map(|cidr| cidr.parse::<Cidr>())
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| {
                let value = vars.get("APP_TRUSTED_PROXIES").unwrap_or_default();
                EnvError::new(
                    "APP_TRUSTED_PROXIES",
                    &value,
                    e.to_string(),
                    TRUSTED_PROXIES_FORMAT,
                )
            })?;
        let on_store_error = match vars.get("APP_ON_STORE_ERROR") {
            Some(value) => parse_on_store_error(&value).map_err(|problem| {
                EnvError::new("APP_ON_STORE_ERROR", &value, problem, ON_STORE_ERROR_FORMAT)
            })?,
            None => OnStoreError::Allow,
        };
        let wait_replicas = match vars.get("REDIS_WAIT_REPLICAS") {
            Some(value) => whole_number(value.trim())
                .and_then(|n| u32::try_from(n).ok())
                .ok_or_else(|| {
                    EnvError::new(
                        "REDIS_WAIT_REPLICAS",
                        &value,
                        "not a whole number of replicas",
                        "a number of replicas, e.g. REDIS_WAIT_REPLICAS=1",
                    )
                })?,
            None => 0,
        };
        let payment_ms = u64::try_from(DEFAULT_PAYMENT_DELAY.as_millis()).unwrap_or(100);
        let ms = "milliseconds, e.g. 200";
        let store_timeout = match vars.get("APP_STORE_TIMEOUT_MS") {
            Some(_) => match vars.number("APP_STORE_TIMEOUT_MS", 0, ms)? {
                0 => {
                    return Err(EnvError::new(
                        "APP_STORE_TIMEOUT_MS",
                        "0",
                        "a store call needs some time",
                        ms,
                    ));
                }
                n => Some(Duration::from_millis(n)),
            },
            None => None,
        };
        let payment_delay = vars.number("APP_PAYMENT_DELAY_MS", payment_ms, ms)?;
        let report_ms = u64::try_from(DEFAULT_REPORT_WORK.as_millis()).unwrap_or(300);
        let report_work = vars.number("APP_REPORT_MS", report_ms, ms)?;
        let transfer_delay = vars.number("APP_TRANSFER_DELAY_MS", 0, ms)?;
        let default = JobConfig::default();
        let default_ms = |d: Duration| u64::try_from(d.as_millis()).unwrap_or(u64::MAX);
        let jobs = JobConfig {
            duration: Duration::from_millis(vars.number(
                "APP_JOB_MS",
                default_ms(default.duration),
                ms,
            )?),
            concurrency: match vars.number(
                "APP_JOB_CONCURRENCY",
                u64::from(default.concurrency),
                "a number of jobs, e.g. 2",
            )? {
                n @ 1..=0xFFFF_FFFF => u32::try_from(n).unwrap_or(u32::MAX),
                _ => {
                    return Err(EnvError::new(
                        "APP_JOB_CONCURRENCY",
                        "0",
                        "at least one job must run",
                        "a number of jobs, e.g. 2",
                    ));
                }
            },
            lease: Duration::from_millis(vars.number(
                "APP_JOB_LEASE_MS",
                default_ms(default.lease),
                ms,
            )?),
            tiers: match vars.get("APP_JOB_TIERS") {
                Some(value) => parse_job_tiers(&value).map_err(|problem| {
                    EnvError::new(
                        "APP_JOB_TIERS",
                        &value,
                        problem,
                        "plans and their job limits, e.g. APP_JOB_TIERS=pro=10,enterprise=50",
                    )
                })?,
                None => Vec::new(),
            },
        };
        Ok(Self {
            port,
            redis_url,
            limits,
            algorithm,
            redis_cluster_urls,
            redis_sentinels,
            redis_sentinel_master,
            database_url,
            wait_replicas,
            store_timeout,
            trusted_proxies,
            on_store_error,
            payment_delay: Duration::from_millis(payment_delay),
            report_work: Duration::from_millis(report_work),
            transfer_delay: Duration::from_millis(transfer_delay),
            jobs,
            token_limits: vars.limits_of("APP_TOKEN_LIMITS", DEFAULT_TOKEN_LIMITS)?,
            admin_token: vars
                .get("APP_ADMIN_TOKEN")
                .filter(|token| !token.is_empty()),
            block: match vars.get("APP_BLOCK") {
                Some(value) => Some(tollgate::rate::parse_duration(&value).map_err(|e| {
                    EnvError::new(
                        "APP_BLOCK",
                        &value,
                        e.to_string(),
                        "how long a caller over a limit is blocked, e.g. APP_BLOCK=30s",
                    )
                })?),
                None => None,
            },
        })
    }
}

// ---------------------------------------------------------------------------------------------
// State and routes
// ---------------------------------------------------------------------------------------------

/// Who a request to `/api/*` counts against: its `x-api-key`, else its client's network — the
/// peer, or the client that the trusted proxies (`APP_TRUSTED_PROXIES`; none by default) name.
pub type CallerKey = Or<Header, ForwardedIp>;

/// What every handler can reach. Cheap to clone: everything in it is shared.
#[derive(Debug, Clone)]
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
    /// Idempotency of `POST /payments`, scoped by API key.
    payments: IdempotencyLayer<Header>,
    /// At most `APP_JOB_CONCURRENCY` jobs per tenant at once.
    jobs: ConcurrencyLimitLayer<BoxedKey>,
    /// The token budget of `POST /llm/complete`: reserve, then settle.
    tokens: RateLimitLayer<Header>,
    /// `POST /webhooks/{source}`: once per `Webhook-Id` and sender.
    webhooks: IdempotencyLayer<BoxedKey>,
    /// With `DATABASE_URL`: the database of `POST /transfers`, and the idempotency layer that
    /// runs each transfer in a transaction recording its response.
    transfers: Option<(PgStore, IdempotencyLayer<Header>)>,
}

/// The tenant named by a `/jobs/{tenant}/...` path.
fn tenant_of(parts: &Parts) -> Option<String> {
    let mut segments = parts.uri.path().split('/').skip(1);
    match (segments.next(), segments.next()) {
        (Some("jobs"), Some(tenant)) if !tenant.is_empty() => Some(tenant.to_owned()),
        _ => None,
    }
}

impl AppState {
    /// Builds the app's middleware on `store` as `config` says; fails on invalid limits.
    pub fn new(store: Arc<dyn Store>, config: AppConfig) -> Result<Self, ConfigError> {
        let api_limit = RateLimitLayer::builder(Arc::clone(&store))
            .prefix(API_PREFIX)
            .limits(config.limits.iter().map(|limit| match config.block {
                Some(block) => limit.clone().block_for(block),
                None => limit.clone(),
            }))
            .algorithm(config.algorithm)
            .key(Header::new(API_KEY_HEADER).or(config.client_ip()))
            .on_store_error(config.on_store_error)
            .build()?;
        let payments = IdempotencyLayer::builder(Arc::clone(&store))
            .prefix("tollgate-app")
            .required(true)
            .scope(Header::new(API_KEY_HEADER))
            .build()?;
        let mut jobs = ConcurrencyLimitLayer::builder(Arc::clone(&store))
            .prefix("tollgate-app")
            .limit(config.jobs.concurrency)
            .lease(config.jobs.lease)
            .retry_after(config.jobs.duration)
            .advertise("jobs")
            .key(key::from_fn("tenant", tenant_of).boxed());
        for (plan, limit) in &config.jobs.tiers {
            jobs = jobs.tier(plan.clone(), *limit);
        }
        if !config.jobs.tiers.is_empty() {
            jobs = jobs.tier_by(|parts| parts.headers.get(PLAN_HEADER)?.to_str().ok());
        }
        let jobs = jobs.build()?;
        let tokens = RateLimitLayer::builder(Arc::clone(&store))
            .prefix("tollgate-app:llm")
            .limits(config.token_limits.iter().cloned())
            .algorithm(config.algorithm)
            .key(Header::new(API_KEY_HEADER))
            .on_store_error(config.on_store_error)
            .cost(|request| header_number(&request.headers, &MAX_TOKENS_HEADER).unwrap_or(1))
            .settle(|response| header_number(&response.headers, &TOKENS_USED_HEADER))
            .build()?;
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
            webhooks,
            transfers: None,
        })
    }

    /// Serves `POST /transfers` and `GET /transfers/count` on `database` (whose table
    /// `app_transfers` [`prepare_transfers`] creates): each transfer runs once per
    /// `Idempotency-Key`, its row and its recorded response in one transaction.
    pub fn with_transfers(mut self, database: PgStore) -> Result<Self, ConfigError> {
        // the key is required: every transfer gets its transaction
        let layer = IdempotencyLayer::in_transaction(database.clone())
            .prefix("tollgate-app")
            .scope(Header::new(API_KEY_HEADER))
            .build()?;
        self.transfers = Some((database, layer));
        Ok(self)
    }
}

/// The whole app. Serve it with `into_make_service_with_connect_info::<SocketAddr>()` so that
/// callers without an API key are keyed by their address.
pub fn router(state: AppState) -> Router {
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
}

/// Jobs: at most `APP_JOB_CONCURRENCY` per tenant at once across all copies — permits with
/// leases in the store.
fn job_routes(state: &AppState) -> Router<AppState> {
    Router::new()
        .route("/jobs/{tenant}/run", post(run_job))
        .route_layer(state.jobs.clone())
}

/// `POST /jobs/{tenant}/run`: runs for `APP_JOB_MS` holding one of the tenant's permits, then
/// answers `200` with the permit's fencing token. Beyond the limit the layer answers `429`.
async fn run_job(
    State(state): State<AppState>,
    Path(tenant): Path<String>,
    permit: Option<Extension<Permit>>,
) -> (StatusCode, Json<Value>) {
    tokio::time::sleep(state.config.jobs.duration).await;
    let permit = permit.map(|Extension(p)| p.fencing_token());
    (
        StatusCode::OK,
        Json(json!({ "tenant": tenant, "permit": permit })),
    )
}

/// Transfers: with a database, each `Idempotency-Key` runs once across all copies, in the
/// transaction that records its response; without one, `503` saying what is missing.
fn transfer_routes(state: &AppState) -> Router<AppState> {
    match &state.transfers {
        Some((_, layer)) => Router::new()
            .route(
                "/transfers",
                post(create_transfer).route_layer(layer.clone()),
            )
            .route("/transfers/count", get(count_transfers)),
        None => Router::new()
            .route("/transfers", post(no_database))
            .route("/transfers/count", get(no_database)),
    }
}

/// Creates the app's own table of transfers, if it does not exist.
pub async fn prepare_transfers(database: &PgStore) -> Result<(), tollgate::store::StoreError> {
    use tollgate::store::{StoreError, StoreErrorKind::Unavailable};
    let client = database
        .pool()
        .get()
        .await
        .map_err(|e| StoreError::new(Unavailable, e))?;
    client
        .batch_execute(
            "CREATE TABLE IF NOT EXISTS app_transfers (
               id text PRIMARY KEY,
               from_account text NOT NULL,
               to_account text NOT NULL,
               amount bigint NOT NULL,
               created_at timestamptz NOT NULL DEFAULT now())",
        )
        .await
        .map_err(|e| StoreError::new(Unavailable, e))
}

/// The body of `POST /transfers`.
#[derive(Debug, serde::Deserialize)]
struct TransferRequest {
    from: String,
    to: String,
    amount: i64,
}

/// `POST /transfers`: inserts the transfer in the transaction the idempotency layer opened,
/// waits `APP_TRANSFER_DELAY_MS`, and answers `201` with its id; the layer records the answer
/// in the same transaction and commits. A database error answers `503`: not recorded, rolled
/// back, and a retry runs again.
async fn create_transfer(
    State(state): State<AppState>,
    tx: OnceTx,
    body: Bytes,
) -> (StatusCode, Json<Value>) {
    let transfer: TransferRequest = match json_body(&body, "transfer") {
        Ok(transfer) => transfer,
        Err(refused) => return refused,
    };
    let id = uuid::Uuid::new_v4().to_string();
    let insert = "INSERT INTO app_transfers (id, from_account, to_account, amount) \
                  VALUES ($1, $2, $3, $4)";
    let inserted = match tx.prepare_cached(insert).await {
        Ok(statement) => {
            let params: [&(dyn ToSql + Sync); 4] =
                [&id, &transfer.from, &transfer.to, &transfer.amount];
            tx.execute(&statement, &params).await
        }
        Err(error) => Err(error),
    };
    if let Err(error) = inserted {
        tracing::warn!(%error, "could not insert a transfer");
        return (
            StatusCode::SERVICE_UNAVAILABLE,
            Json(
                json!({ "error": "the database is unavailable; retry with the same Idempotency-Key" }),
            ),
        );
    }
    tokio::time::sleep(state.config.transfer_delay).await;
    (
        StatusCode::CREATED,
        Json(json!({
            "id": id,
            "from": transfer.from,
            "to": transfer.to,
            "amount": transfer.amount,
        })),
    )
}

/// `GET /transfers/count`: the rows of the app's table of transfers.
async fn count_transfers(State(state): State<AppState>) -> (StatusCode, Json<Value>) {
    let Some((database, _)) = &state.transfers else {
        return no_database().await;
    };
    let counted = match database.pool().get().await {
        Ok(client) => client
            .query_one("SELECT count(*) FROM app_transfers", &[])
            .await
            .and_then(|row| row.try_get::<_, i64>(0))
            .map_err(|e| e.to_string()),
        Err(e) => Err(e.to_string()),
    };
    match counted {
        Ok(count) => (StatusCode::OK, Json(json!({ "count": count }))),
        Err(error) => {
            tracing::warn!(%error, "could not count the transfers");
            (
                StatusCode::SERVICE_UNAVAILABLE,
                Json(json!({ "error": "the database is unavailable" })),
            )
        }
    }
}

/// The transfer routes without a database.
async fn no_database() -> (StatusCode, Json<Value>) {
    (
        StatusCode::SERVICE_UNAVAILABLE,
        Json(json!({ "error": "transfers need a PostgreSQL database: set DATABASE_URL" })),
    )
}

/// `name` as a whole number, if it is one.
fn header_number(headers: &HeaderMap, name: &HeaderName) -> Option<u64> {
    headers.get(name)?.to_str().ok()?.trim().parse().ok()
}

/// The LLM gateway: a token budget per API key, charged what each completion used.
fn llm_routes(state: &AppState) -> Router<AppState> {
    Router::new()
        .route("/llm/complete", post(complete))
        .route_layer(state.tokens.clone())
}

/// The body of `POST /llm/complete`.
#[derive(Debug, serde::Deserialize)]
struct Completion {
    tokens: u64,
}

/// `POST /llm/complete`: "uses" the tokens the body names and reports them in `x-tokens-used`,
/// which the budget is charged after the response (it reserved `x-max-tokens`).
async fn complete(body: Bytes) -> Response {
    match serde_json::from_slice::<Completion>(&body) {
        Ok(Completion { tokens }) => (
            StatusCode::OK,
            [(TOKENS_USED_HEADER, tokens.to_string())],
            Json(json!({ "tokens": tokens })),
        )
            .into_response(),
        Err(error) => (
            StatusCode::BAD_REQUEST,
            [(TOKENS_USED_HEADER, "0".to_owned())],
            Json(json!({ "error": format!("invalid completion: {error}") })),
        )
            .into_response(),
    }
}

/// `POST /coupons/{code}/redeem`: exactly one `200` per coupon across every copy of the app. The
/// store unreachable or late → `503`: a redemption is never reported that was not recorded, and
/// an attempt whose answer was lost is undone once the store refuses it for good, so that the
/// coupon is not consumed by nobody. A redemption that replicas have not acknowledged yet
/// (`REDIS_WAIT_REPLICAS`) is in progress: `409` with `Retry-After`, not "already redeemed".
async fn redeem_coupon(State(state): State<AppState>, Path(code): Path<String>) -> Response {
    match state
        .claims
        .claim_once(format!("coupon:{code}"), None)
        .await
    {
        Ok(claim) if claim.won() => (
            StatusCode::OK,
            Json(json!({ "coupon": code, "status": "redeemed", "redemption": claim.holder() })),
        )
            .into_response(),
        Ok(claim) if claim.pending() => (
            StatusCode::CONFLICT,
            [(axum::http::header::RETRY_AFTER, "1")],
            Json(json!({ "coupon": code, "status": "in_progress" })),
        )
            .into_response(),
        Ok(_) => (
            StatusCode::CONFLICT,
            Json(json!({ "coupon": code, "status": "already_redeemed" })),
        )
            .into_response(),
        Err(error) => {
            tracing::warn!(%error, "coupon store unavailable");
            (
                StatusCode::SERVICE_UNAVAILABLE,
                [(axum::http::header::RETRY_AFTER, "1")],
                Json(json!({ "coupon": code, "status": "unavailable" })),
            )
                .into_response()
        }
    }
}

/// `POST /reports/{name}/rebuild`: the rebuild runs under a lock whose lease is kept alive while
/// it works; the fencing token is what the report's storage would check.
async fn rebuild_report(
    State(state): State<AppState>,
    Path(name): Path<String>,
) -> (StatusCode, Json<Value>) {
    let work = state.config.report_work;
    let rebuilt = state
        .locks
        .with_lock(format!("report:{name}"), REPORT_LEASE, |lease| async move {
            tokio::time::sleep(work).await;
            lease.fencing_token()
        })
        .await;
    match rebuilt {
        Ok(token) => (
            StatusCode::OK,
            Json(json!({ "report": name, "status": "rebuilt", "fencing_token": token })),
        ),
        Err(LockError::Busy { lease_left }) => (
            StatusCode::CONFLICT,
            Json(json!({
                "report": name,
                "status": "busy",
                "retry_after_ms": lease_left.as_millis() as u64,
            })),
        ),
        Err(LockError::Lost) => (
            StatusCode::CONFLICT,
            Json(json!({ "report": name, "status": "lease_lost" })),
        ),
        Err(error) => {
            tracing::warn!(%error, "lock store unavailable");
            (
                StatusCode::SERVICE_UNAVAILABLE,
                Json(json!({ "report": name, "status": "unavailable" })),
            )
        }
    }
}

/// The body of `POST /payments`.
#[derive(Debug, serde::Deserialize)]
struct PaymentRequest {
    amount: i64,
    currency: String,
}

/// `body` as JSON of a `T`, or the `400` that says why it is not a valid `what`.
fn json_body<T: serde::de::DeserializeOwned>(
    body: &[u8],
    what: &str,
) -> Result<T, (StatusCode, Json<Value>)> {
    serde_json::from_slice(body).map_err(|error| {
        (
            StatusCode::BAD_REQUEST,
            Json(json!({ "error": format!("invalid {what}: {error}") })),
        )
    })
}

/// `POST /payments`: works for `APP_PAYMENT_DELAY_MS`, then answers `201` with a fresh payment
/// id. Behind the idempotency layer: runs once per key across all copies.
async fn create_payment(State(state): State<AppState>, body: Bytes) -> (StatusCode, Json<Value>) {
    let payment: PaymentRequest = match json_body(&body, "payment") {
        Ok(payment) => payment,
        Err(refused) => return refused,
    };
    tokio::time::sleep(state.config.payment_delay).await;
    (
        StatusCode::CREATED,
        Json(json!({
            "id": uuid::Uuid::new_v4().to_string(),
            "amount": payment.amount,
            "currency": payment.currency,
        })),
    )
}

/// Copies axum's `ConnectInfo<SocketAddr>` into a plain `SocketAddr` request extension, where
/// tollgate's `PeerIp` finds it without the crate's `axum` feature.
fn peer_addr_extension(mut request: Request) -> Request {
    if let Some(ConnectInfo(addr)) = request
        .extensions()
        .get::<ConnectInfo<SocketAddr>>()
        .copied()
    {
        request.extensions_mut().insert(addr);
    }
    request
}

/// `GET /healthz`: 200 while the store answers, 503 when it does not.
async fn healthz(State(state): State<AppState>) -> (StatusCode, Json<Value>) {
    let store = state.config.store_kind();
    match tokio::time::timeout(HEALTH_TIMEOUT, state.store.ping()).await {
        Ok(Ok(())) => (
            StatusCode::OK,
            Json(json!({ "status": "ok", "store": store })),
        ),
        Ok(Err(error)) => {
            tracing::warn!(%error, "health check: the store does not answer");
            unavailable(store)
        }
        Err(_) => {
            tracing::warn!(timeout = ?HEALTH_TIMEOUT, "health check: the store timed out");
            unavailable(store)
        }
    }
}

/// The health answer while the store does not answer (details go to the log, not to callers).
fn unavailable(store: &str) -> (StatusCode, Json<Value>) {
    (
        StatusCode::SERVICE_UNAVAILABLE,
        Json(json!({ "status": "unavailable", "store": store })),
    )
}

/// `GET /api/hello`: says hello and who the caller counts as. API keys are never echoed: the
/// caller's key is shown as the digest tollgate stores.
async fn hello(
    headers: HeaderMap,
    peer: Option<Extension<SocketAddr>>,
    decision: Option<Extension<RateLimitDecision>>,
) -> Json<Hello> {
    let key = decision.map(|Extension(d)| d.key());
    let by_api_key = headers
        .get(API_KEY_HEADER)
        .is_some_and(|value| !value.is_empty());
    let caller = if by_api_key {
        Caller {
            by: "api-key",
            ip: None,
            key,
        }
    } else {
        Caller {
            by: "peer-ip",
            ip: Some(peer.map(|Extension(addr)| addr.ip())),
            key,
        }
    };
    Json(Hello {
        message: "hello",
        caller,
    })
}

/// The body of `GET /api/hello`, serialized as it is (no intermediate JSON tree).
#[derive(Serialize)]
struct Hello {
    message: &'static str,
    caller: Caller,
}

/// Who the caller counts as: `{"by": "api-key", "key": ...}` or `{"by": "peer-ip", "ip": ...,
/// "key": ...}`; `key` is the digest the limits are kept under.
#[derive(Serialize)]
struct Caller {
    by: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    ip: Option<Option<IpAddr>>,
    #[serde(serialize_with = "digest")]
    key: Option<Key>,
}

fn digest<S: Serializer>(key: &Option<Key>, serializer: S) -> Result<S::Ok, S::Error> {
    match key {
        Some(key) => serializer.collect_str(key),
        None => serializer.serialize_none(),
    }
}
