//! The app's operator and integration routes: `GET /admin/callers/{key}`,
//! `POST /admin/callers/{key}/reset` and `PUT` / `DELETE /admin/callers/{key}/limits` (behind
//! `APP_ADMIN_TOKEN`), and `POST /webhooks/{source}`,
//! each delivery processed once across all copies by its `Webhook-Id`.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::request::Parts;
use axum::http::{HeaderMap, HeaderName, Request, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post, put};
use axum::{Json, Router};
use serde_json::{Value, json};
use sha2::{Digest, Sha256};
use tollgate::ConfigError;
use tollgate::idempotency::{IdempotencyLayer, OnConcurrent};
use tollgate::key::{self, BoxedKey, ForwardedIp, KeyExtractor as _};
use tollgate::rate::RateOutcome;
use tollgate::rate_limit::{
    Changed, Limit, LimitsError, OnStoreError, RateLimitLayer, StoreLimits,
};
use tollgate::store::Store;

use super::identity::{Caller, masked};
use super::{AppConfig, AppState, ByCaller};

/// The header a webhook delivery names itself by (Standard Webhooks).
pub const WEBHOOK_ID_HEADER: HeaderName = HeaderName::from_static("webhook-id");

/// How long a delivery that arrives while the first still runs waits for its answer.
const DELIVERY_PATIENCE: Duration = Duration::from_secs(10);

/// How many admin calls a client address may make a minute.
pub const ADMIN_CALLS: u64 = 60;

/// How many admin calls with a wrong or missing token a client address may make in 15 minutes;
/// beyond, every admin call from it is refused with `429` until the oldest has aged out.
pub const ADMIN_FAILURES: u64 = 5;

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

/// The rate limits of `/admin/*`, per client address (the peer, or the client the trusted
/// proxies name): every call ([`ADMIN_CALLS`] a minute), and calls refused for their token
/// ([`ADMIN_FAILURES`] in 15 minutes). Kept in the shared store, so a guesser gains nothing by
/// spreading its attempts over the copies; while the store is down admin calls are refused
/// (`503`): they need it anyway.
pub(super) fn admin_limits(
    store: &Arc<dyn Store>,
    config: &AppConfig,
) -> Result<(RateLimitLayer<ForwardedIp>, RateLimitLayer<ForwardedIp>), ConfigError> {
    let calls = RateLimitLayer::builder(Arc::clone(store))
        .prefix("tollgate-app:admin")
        .limit(Limit::per_minute("admin-calls", ADMIN_CALLS))
        .key(config.client_ip())
        .on_store_error(OnStoreError::Deny)
        .build()?;
    // every call reserves one failure; the token's verdict settles it: a call it let through is
    // refunded, so only refusals add up
    let failures = RateLimitLayer::builder(Arc::clone(store))
        .prefix("tollgate-app:admin-failures")
        .limit(Limit::new(
            "admin-failures",
            ADMIN_FAILURES,
            Duration::from_secs(15 * 60),
        ))
        .key(config.client_ip())
        .on_store_error(OnStoreError::Deny)
        .cost(|_| 1)
        .settle(|response| Some(u64::from(response.status == StatusCode::UNAUTHORIZED)))
        .build()?;
    Ok((calls, failures))
}

/// `GET /admin/callers/{key}` and `POST /admin/callers/{key}/reset`, for the tenant of API key
/// `{key}`, when `APP_ADMIN_TOKEN` is set; every call carries `Authorization: Bearer <token>`.
pub(super) fn admin_routes(state: &AppState) -> Router<AppState> {
    if state.config.admin_token.is_none() {
        return Router::new();
    }
    Router::new()
        .route("/admin/callers/{key}", get(peek_caller))
        .route("/admin/callers/{key}/reset", post(reset_caller))
        .route(
            "/admin/callers/{key}/limits",
            put(set_caller_limits).delete(unset_caller_limits),
        )
        .route_layer(state.admin_failures.clone())
        .route_layer(state.admin_calls.clone())
}

/// Whether `headers` carry `Authorization: Bearer <APP_ADMIN_TOKEN>`.
///
/// The SHA-256 digests of the two tokens are compared, all 32 bytes whatever differs (an XOR
/// folded over them, with no early exit): hashing first makes both sides the same length, so
/// the time taken tells nothing of the token's length, and what a timing difference could still
/// give away is a digest's bytes, which do not lead back to the token. (`subtle`'s
/// `ConstantTimeEq` is the same fold; one comparison does not need a dependency.)
fn holds_admin_token(state: &AppState, headers: &HeaderMap) -> bool {
    let Some(expected) = state.config.admin_token.as_deref() else {
        return false;
    };
    let Some(given) = headers
        .get(header::AUTHORIZATION)
        .and_then(|value| value.as_bytes().strip_prefix(b"Bearer "))
    else {
        return false;
    };
    let (expected, given) = (Sha256::digest(expected.as_bytes()), Sha256::digest(given));
    let difference = expected
        .iter()
        .zip(given.iter())
        .fold(0u8, |acc, (a, b)| acc | (a ^ b));
    std::hint::black_box(difference) == 0
}

/// An admin call refused before it touched anything: its status and why.
struct Refusal(StatusCode, &'static str);

impl IntoResponse for Refusal {
    fn into_response(self) -> Response {
        (self.0, Json(json!({ "error": self.1 }))).into_response()
    }
}

/// One admin call, for its log line: what it does, from which peer (and which client, as the
/// trusted proxies name it: the one the admin limits count), to which API key.
struct AdminCall<'a> {
    action: &'static str,
    peer: String,
    client: String,
    key: &'a str,
}

impl<'a> AdminCall<'a> {
    fn new(action: &'static str, state: &AppState, head: &Parts, key: &'a str) -> Self {
        let unknown = || "unknown".to_owned();
        let peer = head.extensions.get::<SocketAddr>();
        let client = state.config.client_ip().client_ip(head);
        Self {
            action,
            peer: peer.map_or_else(unknown, SocketAddr::to_string),
            client: client.map_or_else(unknown, |ip| ip.to_string()),
            key,
        }
    }

    /// The caller the call is about, once its token is checked; else the refusal: `401` for a
    /// wrong token (which the failure limit counts), `404` for a key the table does not know.
    fn authorize(&self, state: &AppState, headers: &HeaderMap) -> Result<Caller, Refusal> {
        if !holds_admin_token(state, headers) {
            tracing::warn!(
                action = self.action, peer = %self.peer, client = %self.client,
                key = %masked(self.key),
                "admin call refused: wrong or missing admin token"
            );
            return Err(Refusal(
                StatusCode::UNAUTHORIZED,
                "an admin call needs Authorization: Bearer <APP_ADMIN_TOKEN>",
            ));
        }
        match state.config.api_keys.caller(self.key.as_bytes()) {
            Some(caller) => Ok(caller.clone()),
            None => {
                self.log(None, "unknown key");
                Err(Refusal(StatusCode::NOT_FOUND, "no such API key"))
            }
        }
    }

    /// The log line of an authorized call: the peer, the tenant it touched and the key as a
    /// short digest (never the key).
    fn log(&self, caller: Option<&Caller>, outcome: &str) {
        tracing::info!(
            action = self.action, peer = %self.peer, client = %self.client,
            key = %masked(self.key), tenant = caller.map_or("", Caller::tenant), outcome,
            "admin call"
        );
    }
}

/// The head of a request of `caller`, as the layers see it behind the authentication middleware.
fn head_of(caller: &Caller) -> Parts {
    let (mut head, ()) = Request::new(()).into_parts();
    head.extensions.insert(caller.clone());
    head
}

/// What the tenant of API key `{key}` has left of `/api/*`'s limits and of its token budget,
/// spending nothing: `{"tenant", "api": [...], "tokens": [...]}`, each limit `{"limit",
/// "quota", "remaining", "reset_ms"}`.
async fn peek_caller(
    State(state): State<AppState>,
    Path(key): Path<String>,
    head: Parts,
) -> Response {
    let call = AdminCall::new("peek", &state, &head, &key);
    let caller = match call.authorize(&state, &head.headers) {
        Ok(caller) => caller,
        Err(refused) => return refused.into_response(),
    };
    let head = head_of(&caller);
    let api = state.api_limit.peek_request(&head).await;
    let tokens = state.tokens.peek(ByCaller::new().key(&caller)).await;
    match (api, tokens) {
        (Ok(Some(api)), Ok(tokens)) => {
            call.log(Some(&caller), "ok");
            let api = limits(state.api_limit.policy().limits(), &api);
            let tokens = limits(state.tokens.policy().limits(), &tokens);
            Json(json!({ "tenant": caller.tenant(), "api": api, "tokens": tokens })).into_response()
        }
        (Ok(None), Ok(_)) => {
            call.log(Some(&caller), "no key");
            let body = json!({ "error": "the caller has no key" });
            (StatusCode::INTERNAL_SERVER_ERROR, Json(body)).into_response()
        }
        (Err(error), _) | (_, Err(error)) => {
            call.log(Some(&caller), "store failed");
            store_failed(&error)
        }
    }
}

/// Forgets what the tenant of API key `{key}` has spent, on every copy: `204`.
async fn reset_caller(
    State(state): State<AppState>,
    Path(key): Path<String>,
    head: Parts,
) -> Response {
    let call = AdminCall::new("reset", &state, &head, &key);
    let caller = match call.authorize(&state, &head.headers) {
        Ok(caller) => caller,
        Err(refused) => return refused.into_response(),
    };
    let tenant = ByCaller::new().key(&caller);
    let api = state.api_limit.reset(tenant).await;
    let tokens = state.tokens.reset(tenant).await;
    match api.and(tokens) {
        Ok(()) => {
            call.log(Some(&caller), "reset");
            StatusCode::NO_CONTENT.into_response()
        }
        Err(error) => {
            call.log(Some(&caller), "store failed");
            store_failed(&error)
        }
    }
}

/// Gives the tenant of API key `{key}` limits of its own on `/api/*`, for every copy: the body
/// is `name:count/<seconds>s,…` (the syntax of `APP_LIMITS`), the note the `x-note` header.
/// `200` `{"version", "changed"}`; `422` for limits the layer refuses (nothing changes); `409`
/// when the limits are not kept in the store.
async fn set_caller_limits(
    State(state): State<AppState>,
    Path(key): Path<String>,
    head: Parts,
    body: String,
) -> Response {
    let call = AdminCall::new("set limits", &state, &head, &key);
    let caller = match call.authorize(&state, &head.headers) {
        Ok(caller) => caller,
        Err(refused) => return refused.into_response(),
    };
    let parsed = crate::env::parse_limits_for(body.trim(), state.config.algorithm);
    let new = match parsed {
        Ok(limits) => limits,
        Err(problem) => return unprocessable(&problem),
    };
    let note = note_of(&head.headers);
    let Some((limits, tenant)) = caller_limits(&state, &caller) else {
        return not_in_store();
    };
    let changed = limits.set_caller(tenant, new, &note).await;
    call.log(Some(&caller), "limits set");
    changed_response(changed)
}

/// Takes the tenant of API key `{key}` back to the limits of `/api/*`: `200`, or `404` when it
/// had none of its own.
async fn unset_caller_limits(
    State(state): State<AppState>,
    Path(key): Path<String>,
    head: Parts,
) -> Response {
    let call = AdminCall::new("unset limits", &state, &head, &key);
    let caller = match call.authorize(&state, &head.headers) {
        Ok(caller) => caller,
        Err(refused) => return refused.into_response(),
    };
    let Some((limits, tenant)) = caller_limits(&state, &caller) else {
        return not_in_store();
    };
    // what the store holds now, not what this copy heard of last
    if let Err(error) = limits.refresh().await {
        return store_failed(&error);
    }
    if limits.in_force().table.for_caller(tenant).is_none() {
        let body = json!({ "error": "the tenant has no limits of its own" });
        return (StatusCode::NOT_FOUND, Json(body)).into_response();
    }
    let changed = limits.unset_caller(tenant, &note_of(&head.headers)).await;
    call.log(Some(&caller), "limits unset");
    changed_response(changed)
}

/// The limits in force of `/api/*` and the tenant's key under them; `None` when the limits are
/// the code's.
fn caller_limits(state: &AppState, caller: &Caller) -> Option<(StoreLimits, tollgate::key::Key)> {
    let limits = state.api_limit.limits()?;
    let tenant = state.api_limit.key_of(&head_of(caller))?;
    Some((limits, tenant))
}

/// The `x-note` header, or nothing.
fn note_of(headers: &HeaderMap) -> String {
    headers
        .get("x-note")
        .and_then(|note| note.to_str().ok())
        .unwrap_or_default()
        .to_owned()
}

fn changed_response(changed: Result<Changed, LimitsError>) -> Response {
    match changed {
        Ok(changed) => {
            let body = json!({
                "version": changed.version(),
                "changed": matches!(changed, Changed::Saved(_)),
            });
            Json(body).into_response()
        }
        Err(LimitsError::Invalid(problem)) => unprocessable(&problem.to_string()),
        Err(LimitsError::Store(error)) => store_failed(&error),
        Err(other) => {
            let body = json!({ "error": other.to_string() });
            (StatusCode::CONFLICT, Json(body)).into_response()
        }
    }
}

fn unprocessable(problem: &str) -> Response {
    let body = json!({ "error": format!("refused, nothing changed: {problem}") });
    (StatusCode::UNPROCESSABLE_ENTITY, Json(body)).into_response()
}

fn not_in_store() -> Response {
    let body = json!({ "error": "the limits of /api/* are not kept in the store on this copy" });
    (StatusCode::CONFLICT, Json(body)).into_response()
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
