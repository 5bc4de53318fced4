//! The app's operator and integration routes: `GET /admin/callers/{key}` and
//! `POST /admin/callers/{key}/reset` (behind `APP_ADMIN_TOKEN`), and `POST /webhooks/{source}`,
//! each delivery processed once across all copies by its `Webhook-Id`.

use std::time::Duration;

use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::request::Parts;
use axum::http::{HeaderMap, HeaderName, Request, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde_json::{Value, json};
use tollgate::ConfigError;
use tollgate::idempotency::{IdempotencyLayer, OnConcurrent};
use tollgate::key::{self, BoxedKey, KeyExtractor as _};
use tollgate::rate::RateOutcome;
use tollgate::rate_limit::Limit;
use tollgate::store::Store;

use super::{API_KEY_HEADER, AppState};

/// The header a webhook delivery names itself by (Standard Webhooks).
pub const WEBHOOK_ID_HEADER: HeaderName = HeaderName::from_static("webhook-id");

/// How long a delivery that arrives while the first still runs waits for its answer.
const DELIVERY_PATIENCE: Duration = Duration::from_secs(10);

/// The plan header `POST /jobs/{tenant}/run` picks its `APP_JOB_TIERS` tier by.
pub const PLAN_HEADER: HeaderName = HeaderName::from_static("x-plan");

/// The sender of `/webhooks/{source}`: its path's second segment.
fn source_of(parts: &Parts) -> Option<String> {
    super::segment_after(parts, "webhooks")
}

/// The idempotency layer of `/webhooks/{source}`: the delivery id is the key, scoped per sender;
/// deliveries that arrive while the first runs wait for its answer rather than get `409`.
pub(super) fn webhook_layer(
    store: &std::sync::Arc<dyn Store>,
) -> Result<IdempotencyLayer<BoxedKey>, ConfigError> {
    IdempotencyLayer::builder(std::sync::Arc::clone(store))
        .prefix("tollgate-app:webhooks")
        .scope(key::from_fn("source", source_of).boxed())
        .header(WEBHOOK_ID_HEADER)
        .required(true)
        .on_concurrent(OnConcurrent::Wait(DELIVERY_PATIENCE))
        .build()
}

/// `POST /webhooks/{source}`, once per `Webhook-Id` and sender across all copies.
pub(super) fn webhook_routes(state: &AppState) -> Router<AppState> {
    Router::new()
        .route("/webhooks/{source}", post(deliver))
        .route_layer(state.webhooks.clone())
}

/// Processes a delivery: answers `200` with a run id of its own, which every repeated delivery
/// gets again (the idempotency layer replays the first answer).
async fn deliver(Path(source): Path<String>, headers: HeaderMap, body: Bytes) -> Json<Value> {
    let id = headers
        .get(WEBHOOK_ID_HEADER)
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_owned();
    Json(json!({
        "source": source,
        "webhook_id": id,
        "bytes": body.len(),
        // a run of its own: every repeated delivery is answered with the first one's
        "run": uuid::Uuid::new_v4().to_string(),
    }))
}

/// `GET /admin/callers/{key}` and `POST /admin/callers/{key}/reset`, for the API key `{key}`,
/// when `APP_ADMIN_TOKEN` is set; every call carries `Authorization: Bearer <token>`.
pub(super) fn admin_routes(state: &AppState) -> Router<AppState> {
    if state.config.admin_token.is_none() {
        return Router::new();
    }
    Router::new()
        .route("/admin/callers/{key}", get(peek_caller))
        .route("/admin/callers/{key}/reset", post(reset_caller))
}

/// `401`, unless `headers` carry the admin token.
fn unauthorized(state: &AppState, headers: &HeaderMap) -> Option<Response> {
    let expected = state.config.admin_token.as_deref().unwrap_or_default();
    let given = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "));
    if !expected.is_empty() && given == Some(expected) {
        return None;
    }
    let refused = json!({ "error": "an admin call needs Authorization: Bearer <APP_ADMIN_TOKEN>" });
    Some((StatusCode::UNAUTHORIZED, Json(refused)).into_response())
}

/// The head of a request of API key `key` (and plan `plan`), as the layers would see it.
fn head_of(key: &str, plan: Option<&str>) -> Option<Parts> {
    let mut request = Request::get("/api/hello").header(API_KEY_HEADER, key);
    if let Some(plan) = plan {
        request = request.header(PLAN_HEADER, plan);
    }
    request.body(()).ok().map(|r| r.into_parts().0)
}

/// What API key `{key}` has left of `/api/*`'s limits and of its token budget, spending
/// nothing: `{"key", "api": [...], "tokens": [...]}`, each limit `{"limit", "quota",
/// "remaining", "reset_ms"}`.
async fn peek_caller(
    State(state): State<AppState>,
    Path(key): Path<String>,
    headers: HeaderMap,
) -> Response {
    if let Some(refused) = unauthorized(&state, &headers) {
        return refused;
    }
    let Some(head) = head_of(&key, None) else {
        return not_a_key();
    };
    let api = state.api_limit.peek_request(&head).await;
    let tokens = match state.tokens.key_of(&head) {
        Some(caller) => state.tokens.peek(caller).await.map(Some),
        None => Ok(None),
    };
    match (api, tokens) {
        (Ok(Some(api)), Ok(Some(tokens))) => {
            let api = limits(state.api_limit.policy().limits(), &api);
            let tokens = limits(state.tokens.policy().limits(), &tokens);
            Json(json!({ "key": key, "api": api, "tokens": tokens })).into_response()
        }
        (Ok(_), Ok(_)) => not_a_key(),
        (Err(error), _) | (_, Err(error)) => store_failed(&error),
    }
}

/// Forgets what API key `{key}` has spent, on every copy: `204`.
async fn reset_caller(
    State(state): State<AppState>,
    Path(key): Path<String>,
    headers: HeaderMap,
) -> Response {
    if let Some(refused) = unauthorized(&state, &headers) {
        return refused;
    }
    let Some(caller) = head_of(&key, None).and_then(|head| state.api_limit.key_of(&head)) else {
        return not_a_key();
    };
    let api = state.api_limit.reset(caller).await;
    let tokens = state.tokens.reset(caller).await;
    match api.and(tokens) {
        Ok(()) => StatusCode::NO_CONTENT.into_response(),
        Err(error) => store_failed(&error),
    }
}

/// `400`: the path names no usable API key.
fn not_a_key() -> Response {
    let body = json!({ "error": "not a valid API key" });
    (StatusCode::BAD_REQUEST, Json(body)).into_response()
}

fn limits(limits: &[Limit], outcome: &RateOutcome) -> Vec<Value> {
    limits
        .iter()
        .zip(&outcome.limits)
        .map(|(limit, state)| {
            json!({
                "limit": limit.name(),
                "quota": limit.quota(),
                "remaining": state.remaining,
                "reset_ms": u64::try_from(state.reset.as_millis()).unwrap_or(u64::MAX),
            })
        })
        .collect()
}

fn store_failed(error: &tollgate::store::StoreError) -> Response {
    tracing::warn!(%error, "an admin call failed in the store");
    let body = json!({ "error": "the store did not answer; try again" });
    (StatusCode::SERVICE_UNAVAILABLE, Json(body)).into_response()
}

/// `APP_JOB_TIERS`: `name=limit` pairs, comma-separated (`pro=10,enterprise=50`).
pub fn parse_job_tiers(value: &str) -> Result<Vec<(String, u32)>, String> {
    value
        .split(',')
        .map(str::trim)
        .filter(|entry| !entry.is_empty())
        .map(|entry| {
            let (name, limit) = entry
                .split_once('=')
                .ok_or_else(|| format!("{entry:?} is not name=limit"))?;
            let limit = limit
                .trim()
                .parse::<u32>()
                .ok()
                .filter(|limit| *limit >= 1)
                .ok_or_else(|| format!("{entry:?}: the limit is not a number of jobs >= 1"))?;
            Ok((name.trim().to_owned(), limit))
        })
        .collect()
}
