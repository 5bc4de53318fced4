//! The tollgate example app: a small JSON API whose rate limits hold across every copy of it that
//! shares one Redis (or one PostgreSQL database).
//!
//! ```text
//! cargo run --release --example app
//! REDIS_URL=redis://127.0.0.1:6379/ PORT=4001 cargo run --release --example app
//! DATABASE_URL=postgres://app@127.0.0.1:5432/app PORT=4002 cargo run --release --example app
//! ```
//!
//! | variable        | default                     | meaning                                        |
//! | --------------- | --------------------------- | ---------------------------------------------- |
//! | `PORT`          | `3000`                      | serve on `127.0.0.1:$PORT` (0: any free port)  |
//! | `REDIS_URL`     | unset: in-memory store      | the store all copies share                     |
//! | `REDIS_CLUSTER_URLS` | unset                  | or: comma-separated node URLs of a Redis Cluster |
//! | `REDIS_SENTINELS` | unset                     | or: comma-separated `redis://host:port/` of the sentinels |
//! | `REDIS_SENTINEL_MASTER` | unset               | the master name they monitor (with `REDIS_SENTINELS`) |
//! | `REDIS_PRIMARY_PASSWORD` | unset              | the password of the primary they name, if it asks for one |
//! | `REDIS_CA_CERT` | unset                       | a PEM CA certificate to trust for a `rediss://` `REDIS_URL` |
//! | `REDIS_WAIT_REPLICAS` | `0`                   | replicas that must acknowledge every claim, lock and payment record |
//! | `APP_STORE_TIMEOUT_MS` | `250`                | how long a store call may take before it fails (then `503`, or the failure policy) |
//! | `DATABASE_URL`  | unset                       | or: a PostgreSQL database, `postgres://user:password@host:port/db` (schema `tollgate`, migrated at start) |
//! | `APP_TRUSTED_PROXIES` | unset: none trusted   | CIDRs of proxies whose `X-Forwarded-For` names the client |
//! | `APP_ON_STORE_ERROR` | `allow`                | `/api/*` while the store is down: `allow`, `deny` or `fallback:N` (N copies) |
//! | `APP_PAYMENT_DELAY_MS` | `100`                | how long `POST /payments` works                 |
//! | `APP_REPORT_MS` | `300`                       | how long `POST /reports/{name}/rebuild` works under its lock |
//! | `APP_TRANSFER_DELAY_MS` | `0`                 | how long `POST /transfers` waits after its insert, before its commit (with `DATABASE_URL`) |
//! | `APP_API_KEYS`  | the demo keys `demo`, `demo-pro` | the API keys the app accepts (`x-api-key`): `key:tenant:plan,…`; the default is public, for a demo only |
//! | `APP_ADMIN_TOKEN` | unset: no `/admin/*`      | the bearer token of `/admin/callers/*`         |
//! | `APP_TOKEN_LIMITS` | `tokens:1000/60s`        | token budget of `POST /llm/complete` per tenant (syntax of `APP_LIMITS`) |
//! | `APP_JOB_MS`    | `200`                       | how long a job of `POST /jobs/{tenant}/run` runs |
//! | `APP_JOB_CONCURRENCY` | `2`                   | jobs per tenant at once, across all copies     |
//! | `APP_JOB_LEASE_MS` | `3000`                   | how soon a dead copy's job permits come back   |
//! | `APP_JOB_TIERS` | unset                       | jobs at once for the plans of `APP_API_KEYS`: `pro=10,enterprise=50` |
//! | `APP_LIMITS`    | `burst:5/1s,minute:100/60s` | limits of `/api/*`: `name:count/<seconds>s,…`  |
//! | `APP_ALGORITHM` | `sliding-log`               | `sliding-log`, `sliding-counter` or `gcra`     |
//! | `APP_LEASE`     | `off`                       | `on`: `/api/*`'s quota leased to each copy in slices (not with `APP_BLOCK`) |
//! | `APP_LIMITS_REVISION` | `0`                   | the revision of `APP_LIMITS` and `APP_JOB_CONCURRENCY`: the store keeps `/api/*`'s limits and the jobs' limit in force for every copy (`tollgate limits` changes them); a copy of a higher revision makes its own the defaults in force |
//! | `RUST_LOG`      | `info`                      | log filter (`tollgate=debug` shows decisions)  |
//!
//! An invalid value exits with status 2 and a message naming the variable; other startup
//! failures (the port is taken) exit with status 1.

#[path = "../shared/env.rs"]
pub mod env;
pub mod router;

use std::io::IsTerminal;
use std::net::SocketAddr;
use std::process::ExitCode;
use std::sync::Arc;

use tollgate::store::Store;
use tracing_subscriber::EnvFilter;
use tracing_subscriber::filter::LevelFilter;

use env::{EnvError, Failure};
use metrics_exporter_prometheus::PrometheusBuilder;
use router::{AppConfig, AppState};

/// What the app warns of when no store variable is set.
const MEMORY_STORE_WARNING: &str = "no store is set: using an in-memory store, so rate limits \
     hold for this one process only (copies of the app do not share them). Set e.g. \
     REDIS_URL=redis://127.0.0.1:6379/ or DATABASE_URL=postgres://app@127.0.0.1:5432/app to \
     share them.";

#[tokio::main]
async fn main() -> ExitCode {
    init_tracing();
    env::exit(run().await)
}

async fn run() -> Result<(), Failure> {
    let config = AppConfig::from_env()?;
    let mut database = None;
    let store: Arc<dyn Store> = if let Some(url) = &config.database_url {
        let store = postgres_store(url, config.store_timeout).await?;
        database = Some(store.clone());
        Arc::new(store)
    } else if !config.redis_sentinels.is_empty() {
        sentinel_store(&config).await?
    } else if !config.redis_cluster_urls.is_empty() {
        cluster_store(&config).await?
    } else {
        open_store(config.redis_url.as_deref(), &config)?
    };
    if config.database_url.is_none() {
        check_store(store.as_ref(), config.redis_url.as_deref()).await;
    }

    let port = config.port;
    if config.api_keys.is_demo() {
        tracing::warn!(
            "APP_API_KEYS is not set: accepting the public demo keys `demo` and `demo-pro` \
             (for a demo only; set APP_API_KEYS=key:tenant:plan,… for anything else)"
        );
    }
    tracing::info!(
        limits = %env::describe_limits(&config.limits),
        algorithm = %config.algorithm,
        "rate limit of /api/*"
    );
    let revision = limits_revision()?;
    let mut state = AppState::new(Arc::clone(&store), config.clone())
        .map_err(|e| Failure::config(format!("invalid rate-limit configuration: {e}")))?
        .with_limits_in_store(store, &config, revision)
        .await
        .map_err(|e| Failure::config(format!("invalid rate-limit configuration: {e}")))?;
    let in_force = state.api_limits();
    tracing::info!(
        limits = %env::describe_limits(in_force.limits()),
        revision,
        "rate limit of /api/* in force, kept in the store (tollgate limits show --prefix {})",
        router::API_PREFIX
    );
    if let Some(database) = database {
        state = state
            .with_transfers(database)
            .map_err(|e| Failure::config(format!("invalid transfers configuration: {e}")))?;
    }

    let (listener, addr) = env::listen(port).await?;
    println!("tollgate example app listening on http://{addr}");

    let metrics = PrometheusBuilder::new()
        .install_recorder()
        .map_err(|e| Failure::runtime(format!("could not install the metrics recorder: {e}")))?;
    let leases = state.clone();
    let app = router::router(state)
        .merge(router::metrics_routes(metrics))
        .into_make_service_with_connect_info::<SocketAddr>();
    axum::serve(listener, app)
        .with_graceful_shutdown(shutdown_signal())
        .await
        .map_err(|e| Failure::runtime(format!("server failed: {e}")))?;
    // the quota this copy leased and did not spend is the other copies' at once
    leases.give_back_leases().await;
    tracing::info!("stopped");
    Ok(())
}

/// `fmt` logging to stderr, filtered by `RUST_LOG` (default `info`). An invalid `RUST_LOG` is reported and
/// replaced by `info` rather than stopping the app.
fn init_tracing() {
    let builder = EnvFilter::builder().with_default_directive(LevelFilter::INFO.into());
    let filter = match builder.from_env() {
        Ok(filter) => filter,
        Err(e) => {
            eprintln!("warning: ignoring invalid RUST_LOG ({e}); logging at info");
            EnvFilter::new("info")
        }
    };
    // Logs go to stderr; stdout carries only the address line, for scripts to read.
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .init();
}

/// `APP_LIMITS_REVISION`: a whole number, 0 when unset.
fn limits_revision() -> Result<u64, Failure> {
    match std::env::var("APP_LIMITS_REVISION") {
        Err(_) => Ok(0),
        Ok(value) => value.trim().parse().map_err(|_| {
            Failure::config(format!(
                "APP_LIMITS_REVISION={value:?}: expected a whole number, e.g. APP_LIMITS_REVISION=2"
            ))
        }),
    }
}

/// The store named by `REDIS_URL`, or a per-process memory store when it is unset.
fn open_store(redis_url: Option<&str>, config: &AppConfig) -> Result<Arc<dyn Store>, EnvError> {
    let Some(url) = redis_url else {
        return env::open_store(None, MEMORY_STORE_WARNING);
    };
    let wait_replicas = config.wait_replicas;
    let store = env::redis_store(url, wait_replicas, config.store_timeout)?;
    tracing::info!(url = %env::redact_url(url), wait_replicas, "state is kept in Redis");
    Ok(store)
}

/// A store on the PostgreSQL database at `DATABASE_URL`, its schema (`tollgate`) created or
/// brought up to date, and the app's table of transfers created. A database that does not answer at startup is not fatal, as for Redis:
/// the migration is retried in the background every second, and until it is done calls fail
/// (the failure policies apply) and `/healthz` answers 503.
async fn postgres_store(
    url: &str,
    timeout: Option<std::time::Duration>,
) -> Result<tollgate::store::PgStore, Failure> {
    use tollgate::store::PgStore;
    const DATABASE_URL_FORMAT: &str =
        "a PostgreSQL URL, e.g. DATABASE_URL=postgres://app:secret@127.0.0.1:5432/app";
    let safe = env::redact_url(url);
    let mut builder = PgStore::builder(url).migration_timeout(std::time::Duration::from_secs(5));
    if let Some(timeout) = timeout {
        builder = builder.timeout(timeout);
    }
    let store = builder.build().map_err(|e| {
        Failure::config(
            EnvError::new("DATABASE_URL", &safe, e.to_string(), DATABASE_URL_FORMAT).to_string(),
        )
    })?;
    match prepare(&store).await {
        Ok(()) => {
            tracing::info!(url = %safe, schema = store.schema(), "state is kept in PostgreSQL");
        }
        Err(error) => {
            tracing::warn!(
                %error, url = %safe,
                "PostgreSQL does not answer yet: migrating in the background; /api/* is not limited and /healthz answers 503 until it does"
            );
            let retry = store.clone();
            tokio::spawn(async move {
                while prepare(&retry).await.is_err() {
                    tokio::time::sleep(std::time::Duration::from_secs(1)).await;
                }
                tracing::info!(
                    schema = retry.schema(),
                    "PostgreSQL answers: schema migrated"
                );
            });
        }
    }
    Ok(store)
}

/// The store's schema migrated and the app's table created.
async fn prepare(store: &tollgate::store::PgStore) -> Result<(), tollgate::store::StoreError> {
    store.migrate().await?;
    router::prepare_transfers(store).await
}

/// A store on the primary that the sentinels (`REDIS_SENTINELS`) name for
/// `REDIS_SENTINEL_MASTER`, following it through failovers. A sentinel must answer at startup.
#[cfg(feature = "redis")]
async fn sentinel_store(config: &AppConfig) -> Result<Arc<dyn Store>, Failure> {
    use tollgate::store::{RedisStore, StoreErrorKind};
    let master = config.redis_sentinel_master.clone().unwrap_or_default();
    let safe: Vec<String> = config
        .redis_sentinels
        .iter()
        .map(|u| env::redact_url(u))
        .collect();
    let mut builder =
        RedisStore::sentinel_builder(config.redis_sentinels.iter().cloned(), master.as_str())
            .wait_replicas(config.wait_replicas);
    if let Some(password) = &config.redis_primary_password {
        builder = builder.primary_password(None, password.as_str());
    }
    if let Some(timeout) = config.store_timeout {
        builder = builder.timeout(timeout);
    }
    match builder.connect().await {
        Ok(store) => {
            tracing::info!(
                sentinels = %safe.join(","), %master, wait_replicas = config.wait_replicas,
                "state is kept in Redis behind Sentinel"
            );
            Ok(Arc::new(store))
        }
        Err(e) if e.kind() == StoreErrorKind::Config => Err(Failure::config(
            EnvError::new(
                "REDIS_SENTINELS",
                &safe.join(","),
                e.to_string(),
                "comma-separated sentinel URLs, e.g. redis://127.0.0.1:26379/,redis://127.0.0.1:26380/",
            )
            .to_string(),
        )),
        Err(e) => Err(Failure::runtime(format!(
            "no sentinel at {} named the primary of {master:?}: {e}",
            safe.join(",")
        ))),
    }
}

#[cfg(not(feature = "redis"))]
async fn sentinel_store(config: &AppConfig) -> Result<Arc<dyn Store>, Failure> {
    Err(Failure::config(format!(
        "REDIS_SENTINELS={} needs tollgate's `redis` feature",
        env::redact_url(&config.redis_sentinels.join(","))
    )))
}

/// A store on the Redis Cluster reached through `urls` (`REDIS_CLUSTER_URLS`). Unlike a
/// standalone Redis, a cluster must answer at startup: its slot map is read then.
#[cfg(feature = "redis")]
async fn cluster_store(config: &AppConfig) -> Result<Arc<dyn Store>, Failure> {
    use tollgate::store::{RedisStore, StoreErrorKind};
    let urls = &config.redis_cluster_urls;
    let safe: Vec<String> = urls.iter().map(|u| env::redact_url(u)).collect();
    let mut builder =
        RedisStore::cluster_builder(urls.iter().cloned()).wait_replicas(config.wait_replicas);
    if let Some(timeout) = config.store_timeout {
        builder = builder.timeout(timeout);
    }
    match builder.connect().await {
        Ok(store) => {
            tracing::info!(nodes = %safe.join(","), "state is kept in a Redis Cluster");
            Ok(Arc::new(store))
        }
        Err(e) if e.kind() == StoreErrorKind::Config => Err(Failure::config(
            EnvError::new(
                "REDIS_CLUSTER_URLS",
                &safe.join(","),
                e.to_string(),
                "comma-separated Redis URLs of cluster nodes, e.g. redis://127.0.0.1:7000/,redis://127.0.0.1:7001/",
            )
            .to_string(),
        )),
        Err(e) => Err(Failure::runtime(format!(
            "cannot reach the Redis Cluster at {}: {e}",
            safe.join(",")
        ))),
    }
}

#[cfg(not(feature = "redis"))]
async fn cluster_store(config: &AppConfig) -> Result<Arc<dyn Store>, Failure> {
    Err(Failure::config(format!(
        "REDIS_CLUSTER_URLS={} needs tollgate's `redis` feature",
        env::redact_url(&config.redis_cluster_urls.join(","))
    )))
}

/// Reports at startup whether the store answers. A store that is down is not fatal: requests are
/// let through (the failure policy is Allow) and `/healthz` answers 503 until it is back.
async fn check_store(store: &dyn Store, redis_url: Option<&str>) {
    if let Err(error) = store.ping().await {
        let url = redis_url.map(env::redact_url).unwrap_or_default();
        tracing::warn!(
            %error, %url,
            "the store does not answer yet: /api/* is not limited and /healthz answers 503 until it does"
        );
    }
}

/// Resolves on Ctrl-C or, on Unix, SIGTERM.
async fn shutdown_signal() {
    let ctrl_c = async {
        if let Err(e) = tokio::signal::ctrl_c().await {
            tracing::warn!(error = %e, "cannot listen for Ctrl-C");
            std::future::pending::<()>().await;
        }
    };
    #[cfg(unix)]
    let terminate = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut signal) => {
                signal.recv().await;
            }
            Err(e) => {
                tracing::warn!(error = %e, "cannot listen for SIGTERM");
                std::future::pending::<()>().await;
            }
        }
    };
    #[cfg(not(unix))]
    let terminate = std::future::pending::<()>();
    tokio::select! {
        () = ctrl_c => {}
        () = terminate => {}
    }
    tracing::info!("shutting down");
}
