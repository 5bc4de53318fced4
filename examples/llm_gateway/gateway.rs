//! The gateway: `POST /v1/chat/completions` streamed from a stand-in model, metered per tenant
//! — a token budget reserved from the request's `max_tokens` and settled on the usage the
//! stream reports last, idempotent retries, a limit of calls in flight — and `GET /v1/usage`.
//! See `docs/metering.md`.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::header::CONTENT_TYPE;
use axum::http::{HeaderValue, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post_service};
use bytes::Bytes;
use futures_util::StreamExt;
use http_body::Frame;
use http_body_util::{BodyExt, Full, StreamBody};
use serde_json::{Value, json};
use tollgate::ConfigError;
use tollgate::concurrency::ConcurrencyLimitLayer;
use tollgate::idempotency::{IdempotencyLayer, RequestBody};
use tollgate::key::Extension;
use tollgate::rate_limit::{
    Estimate, EstimateError, EstimateLayer, Limit, RateLimitLayer, SseUsage,
};
use tollgate::stack::Stack;
use tollgate::store::Store;
use tower::ServiceBuilder;

/// A tenant, as authentication finds it from its API key: what every limit counts against.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Tenant {
    /// The tenant's id.
    pub id: String,
    /// Its plan: `free` or `pro`.
    pub plan: &'static str,
}

impl AsRef<[u8]> for Tenant {
    fn as_ref(&self) -> &[u8] {
        self.id.as_bytes()
    }
}

/// The API keys the gateway accepts — **for a demo only**, public in this repository: `demo`
/// (tenant `acme`, plan `free`) and `demo-pro` (tenant `globex`, plan `pro`).
pub const DEMO_KEYS: &[(&str, &str, &str)] =
    &[("demo", "acme", "free"), ("demo-pro", "globex", "pro")];

/// Tokens a tenant may use a minute, by plan.
pub const FREE_TOKENS_PER_MINUTE: u64 = 2_000;
/// Tokens a `pro` tenant may use a minute.
pub const PRO_TOKENS_PER_MINUTE: u64 = 20_000;
/// Calls a tenant may have in flight, by plan.
pub const FREE_IN_FLIGHT: u32 = 2;
/// Calls a `pro` tenant may have in flight.
pub const PRO_IN_FLIGHT: u32 = 8;
/// The most tokens one call may ask for, and reserve.
pub const MAX_TOKENS_CEILING: u64 = 1_000;
/// The largest request body the gateway reads.
pub const MAX_BODY: usize = 64 * 1024;

/// How the gateway is put together.
#[derive(Debug, Clone)]
pub struct Options {
    /// The key prefix in the store.
    pub prefix: String,
    /// How long the stand-in model takes per word.
    pub word_delay: Duration,
}

impl Default for Options {
    fn default() -> Self {
        Self {
            prefix: "llm-gateway".to_owned(),
            word_delay: Duration::from_millis(20),
        }
    }
}

/// The token budget, read by `GET /v1/usage`.
type Budget = RateLimitLayer<Extension<Tenant>>;

/// The gateway on `store`.
///
/// # Errors
///
/// A limit the layers refuse.
pub fn gateway(store: &Arc<dyn Store>, options: &Options) -> Result<Router, ConfigError> {
    let budget: Budget = RateLimitLayer::builder(Arc::clone(store))
        .limit(Limit::per_minute("tokens", FREE_TOKENS_PER_MINUTE))
        .tier("pro", [Limit::per_minute("tokens", PRO_TOKENS_PER_MINUTE)])
        .tier_by(plan_of)
        .prefix(format!("{}:tokens", options.prefix))
        .key(Extension::<Tenant>::new())
        // reserve what the call may use, then settle on the usage its stream reports last
        .cost(|parts| Estimate::of(parts).unwrap_or(1))
        .settle_stream(|_| SseUsage::openai())
        .build()?;
    let idempotency = IdempotencyLayer::builder(Arc::clone(store))
        .prefix(&options.prefix)
        .scope(Extension::<Tenant>::new())
        .build()?;
    let in_flight = ConcurrencyLimitLayer::builder(Arc::clone(store))
        .limit(FREE_IN_FLIGHT)
        .tier("pro", PRO_IN_FLIGHT)
        .tier_by(plan_of)
        .prefix(&options.prefix)
        .key(Extension::<Tenant>::new())
        .advertise("in-flight")
        .build()?;
    let delay = options.word_delay;
    // outermost first: the estimate, the budget, replays, the calls in flight (docs/customizing.md)
    let layers = Stack::new()
        .estimate(EstimateLayer::new(MAX_BODY, max_tokens))
        .budget(budget.clone())
        .idempotency(idempotency)
        .in_flight(in_flight);
    let completions = ServiceBuilder::new()
        .map_response(|response: axum::http::Response<_>| response.map(Body::new))
        .layer(layers)
        .service_fn(move |request| model(request, delay));
    Ok(Router::new()
        .route_service("/v1/chat/completions", post_service(completions))
        .route("/v1/usage", get(usage))
        .with_state(budget)
        .layer(middleware::from_fn(authenticate)))
}

/// The plan of the request's tenant: its tier.
fn plan_of(parts: &axum::http::request::Parts) -> Option<&str> {
    parts.extensions.get::<Tenant>().map(|tenant| tenant.plan)
}

/// The tenant of the request's `x-api-key` in its extensions, or `401`.
async fn authenticate(mut request: Request, next: Next) -> Response {
    let key = request
        .headers()
        .get("x-api-key")
        .and_then(|v| v.to_str().ok());
    let tenant = DEMO_KEYS
        .iter()
        .find(|(known, _, _)| Some(*known) == key)
        .map(|&(_, id, plan)| Tenant {
            id: id.to_owned(),
            plan,
        });
    let Some(tenant) = tenant else {
        let body = json!({ "error": "an API key of the gateway is needed in x-api-key" });
        return (StatusCode::UNAUTHORIZED, axum::Json(body)).into_response();
    };
    request.extensions_mut().insert(tenant);
    next.run(request).await
}

/// The call's `max_tokens`, held to 1..=[`MAX_TOKENS_CEILING`]: what it reserves.
fn max_tokens(_: &axum::http::request::Parts, body: &[u8]) -> Result<u64, EstimateError> {
    let call: Value =
        serde_json::from_slice(body).map_err(|_| EstimateError::new("the body is not JSON"))?;
    let max = call["max_tokens"]
        .as_u64()
        .ok_or(EstimateError::new("max_tokens (a whole number) is missing"))?;
    Ok(max.clamp(1, MAX_TOKENS_CEILING))
}

/// What the stand-in model answers, word by word.
const WORDS: &[&str] = &[
    "Metered", "calls", "settle", "on", "the", "usage", "the", "stream", "reports", "last,",
    "across", "every", "copy.",
];

/// The stand-in model: streams OpenAI-style chunks, a word each `delay`, at most `max_tokens`
/// words, then a chunk with the usage (a token per word of the prompt and of the answer) and
/// `[DONE]`.
async fn model(
    request: axum::http::Request<RequestBody<Full<Bytes>>>,
    delay: Duration,
) -> Result<axum::http::Response<Body>, Infallible> {
    let (parts, body) = request.into_parts();
    let body = body
        .collect()
        .await
        .map(|b| b.to_bytes())
        .unwrap_or_default();
    let call: Value = serde_json::from_slice(&body).unwrap_or_default();
    let prompt = call["messages"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|message| message["content"].as_str())
        .map(|content| content.split_whitespace().count() as u64)
        .sum::<u64>();
    let max = Estimate::of(&parts).unwrap_or(1);
    let words: Vec<&str> = WORDS.iter().copied().take(max as usize).collect();
    let completion = words.len() as u64;
    let mut events: Vec<String> = words
        .into_iter()
        .map(|word| {
            format!(
                "data: {}\n\n",
                json!({"choices": [{"delta": {"content": format!("{word} ")}}]})
            )
        })
        .collect();
    let usage = json!({
        "choices": [],
        "usage": {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
    });
    events.push(format!("data: {usage}\n\ndata: [DONE]\n\n"));
    let frames = futures_util::stream::iter(events).then(move |event| async move {
        tokio::time::sleep(delay).await;
        Ok::<_, Infallible>(Frame::data(Bytes::from(event)))
    });
    let mut response = axum::http::Response::new(Body::new(StreamBody::new(frames)));
    let event_stream = HeaderValue::from_static("text/event-stream");
    response.headers_mut().insert(CONTENT_TYPE, event_stream);
    Ok(response)
}

/// `GET /v1/usage`: the tenant's plan and what it has left of its budget.
async fn usage(State(budget): State<Budget>, request: Request) -> Response {
    let (parts, _) = request.into_parts();
    let Some(tenant) = parts.extensions.get::<Tenant>().cloned() else {
        return StatusCode::UNAUTHORIZED.into_response();
    };
    match budget.peek_request(&parts).await {
        Ok(Some(outcome)) => {
            let left = &outcome.limits[0];
            let quota = match tenant.plan {
                "pro" => PRO_TOKENS_PER_MINUTE,
                _ => FREE_TOKENS_PER_MINUTE,
            };
            axum::Json(json!({
                "tenant": tenant.id,
                "plan": tenant.plan,
                "tokens_left": left.remaining,
                "quota": quota,
            }))
            .into_response()
        }
        _ => {
            let body = json!({ "error": "the store is unavailable" });
            (StatusCode::SERVICE_UNAVAILABLE, axum::Json(body)).into_response()
        }
    }
}
