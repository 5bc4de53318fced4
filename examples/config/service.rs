//! The `config` example's service: its file's shape, its store and its routes; `main.rs` runs
//! it, and `tests/layers/config_example.rs` drives it.

use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::routing::{get, post};
use bytes::Bytes;
use http::{HeaderValue, Response, StatusCode, header};
use metrics_exporter_prometheus::PrometheusHandle;
use serde::Deserialize;
use tollgate::idempotency::IdempotencyLayer;
use tollgate::key::{Global, Header, KeyExtractor};
use tollgate::rate_limit::{RateLimitConfig, RateLimitLayer};
use tollgate::store::{MemoryStore, PgStore, RedisStore, Store, redact_connection_string};

/// The file's shape. Its `Debug` shows the store URL without its password.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    #[serde(default = "default_port")]
    /// Where the service listens (`PORT` overrides it).
    pub port: u16,
    /// The store's URL (`STORE_URL` overrides it); none: in memory.
    pub store: Option<String>,
    /// `GET /api/hello`'s limits, tiers and switches.
    pub rate_limit: RateLimitConfig,
    #[serde(default)]
    /// `POST /orders`' idempotency.
    pub idempotency: Idempotency,
}

impl std::fmt::Debug for Config {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let store = self.store.as_deref().map(redact_connection_string);
        f.debug_struct("Config")
            .field("port", &self.port)
            .field("store", &store)
            .field("rate_limit", &self.rate_limit)
            .field("idempotency", &self.idempotency)
            .finish()
    }
}

/// The `[idempotency]` table.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Idempotency {
    /// Whether a request without an `Idempotency-Key` is refused (`400`).
    #[serde(default)]
    required: bool,
    /// `"24h"`, `"30m"`, …
    retention: Option<String>,
}

fn default_port() -> u16 {
    3000
}

/// The store `url` names: Redis (`redis://`, `rediss://`) or PostgreSQL (`postgres://`); none:
/// in memory.
pub async fn open(url: Option<String>) -> Result<Arc<dyn Store>, String> {
    let Some(url) = url else {
        tracing::warn!("no store is set: limits and records hold for this one process only");
        // tollgate: allow(one copy only, when no store URL is set; it warns so)
        return Ok(Arc::new(MemoryStore::new()));
    };
    if url.starts_with("postgres://") || url.starts_with("postgresql://") {
        let store = PgStore::connect(url).await.map_err(|e| e.to_string())?;
        return Ok(Arc::new(store));
    }
    let store = RedisStore::open(url).map_err(|e| e.to_string())?;
    Ok(Arc::new(store))
}

/// The routes of `config` on `store`, `/metrics` rendered by `recorder`.
pub fn router(
    config: &Config,
    store: Arc<dyn Store>,
    recorder: PrometheusHandle,
) -> Result<Router, String> {
    let limits = RateLimitLayer::builder(Arc::clone(&store))
        .config(config.rate_limit.clone())
        // demo only: the client names itself and its plan. A service keys by what its
        // authentication established and chooses the tier from it (`key::Extension`,
        // docs/security.md); the example app shows how.
        .key(Header::from_static("x-api-key").or(Global))
        .tier_by(|parts| parts.headers.get("x-plan").and_then(|v| v.to_str().ok()))
        .rejection(|decision| {
            let body = format!(
                r#"{{"error":"rate_limited","retry_in_seconds":{}}}"#,
                decision.retry_after_secs()
            );
            json(StatusCode::TOO_MANY_REQUESTS, body)
        })
        .build()
        .map_err(|e| e.to_string())?;
    let mut orders = IdempotencyLayer::builder(store)
        .required(config.idempotency.required)
        .scope(Header::from_static("x-api-key").or(Global));
    if let Some(retention) = &config.idempotency.retention {
        orders = orders.retention(duration(retention)?);
    }
    let orders = orders.build().map_err(|e| e.to_string())?;
    Ok(Router::new()
        .route(
            "/api/hello",
            get(|| async { "hello\n" }).route_layer(limits),
        )
        .route("/orders", post(create_order).route_layer(orders))
        .route("/metrics", get(move || async move { recorder.render() })))
}

/// `POST /orders`: a new order id per execution, so that a replay is easy to tell apart.
async fn create_order(body: Bytes) -> Response<String> {
    let id = uuid::Uuid::new_v4();
    let body = format!(r#"{{"id":"{id}","bytes":{}}}"#, body.len());
    json(StatusCode::CREATED, body)
}

fn json<B: From<String>>(status: StatusCode, body: String) -> Response<B> {
    let mut response = Response::new(B::from(body));
    *response.status_mut() = status;
    let json = HeaderValue::from_static("application/json");
    response.headers_mut().insert(header::CONTENT_TYPE, json);
    response
}

/// `"24h"`, `"30m"`, `"45s"`: a retention.
fn duration(text: &str) -> Result<Duration, String> {
    let (number, unit) = text.split_at(text.trim_end_matches(char::is_alphabetic).len());
    let number: u64 = number
        .parse()
        .map_err(|_| format!("invalid retention {text:?}: write e.g. \"24h\""))?;
    let secs = match unit {
        "s" => 1,
        "m" => 60,
        "h" => 3_600,
        "d" => 86_400,
        _ => return Err(format!("invalid retention {text:?}: write e.g. \"24h\"")),
    };
    Ok(Duration::from_secs(number * secs))
}
