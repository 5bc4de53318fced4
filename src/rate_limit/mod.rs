//! Rate limiting shared by every copy of a service.
//!
//! [`RateLimitLayer`] checks each request against one or more [`Limit`]s for a caller named by a
//! [`KeyExtractor`](crate::key::KeyExtractor). The check is one atomic script in the
//! [`Store`](crate::store::Store), with the store's clock: several copies of the service on one
//! Redis admit together exactly what one copy would.
//!
//! - **All or nothing**: a request is admitted only when every limit has room for its cost; then
//!   all limits are charged. A denied request charges nothing.
//! - **Denied**: `429 Too Many Requests` with `Retry-After` (whole seconds until this request could
//!   be admitted, rounded up, at least 1) and the IETF headers, one member per limit in
//!   configuration order:
//!   `RateLimit-Policy: "burst";q=10;w=1, "hourly";q=1000;w=3600` and
//!   `RateLimit: "burst";r=0;t=1, "hourly";r=990;t=3412` (`r`: quota left after this decision,
//!   `t`: seconds until that limit's quota grows again). gRPC calls get a trailers-only response
//!   with `grpc-status: 8` (RESOURCE_EXHAUSTED) instead, so that clients see
//!   `Code::ResourceExhausted`.
//! - **Admitted**: the inner service's response, with the same two headers (see
//!   [`RateLimitLayerBuilder::headers_on_success`]).
//! - **Store down**: as [`OnStoreError`] says — by default the request is allowed and a warning
//!   logged.
//! - **Floods**: once the store has denied a caller until some time, this copy denies that
//!   caller's requests locally until then, without a round trip (a cache of the store's decision
//!   that can only deny; [`RateLimitLayerBuilder::deny_cache`]).
//! - **No key** (say, no API key header and no fallback): as [`MissingKey`] says — by default
//!   `400 Bad Request`.
//!
//! A key the client chooses is a key the client can change: keyed by an API-key header that is
//! not checked first, a client sends a fresh made-up key with every request and gets a fresh
//! bucket each time. Put the layer after authentication, or stack a per-IP limit in front of a
//! per-key one.
//!
//! Every response carries a [`RateLimitDecision`] in its extensions (admitted requests carry it in
//! their request extensions too), and each decision is a `tracing` event with target
//! `tollgate::rate_limit`.
//!
//! ```
//! # #[tokio::main(flavor = "current_thread")] async fn main() {
//! use http::{Request, Response, StatusCode};
//! use tower::{ServiceBuilder, ServiceExt};
//! use tollgate::key::Header;
//! use tollgate::rate_limit::{Limit, RateLimitLayer};
//! use tollgate::store::MemoryStore;
//!
//! let layer = RateLimitLayer::builder(MemoryStore::new())
//!     .limit(Limit::per_minute("minute", 2))
//!     .key(Header::from_static("x-api-key"))
//!     .build()
//!     .unwrap();
//! let service = ServiceBuilder::new()
//!     .layer(layer)
//!     .service_fn(|_req: Request<String>| async { Ok::<_, std::convert::Infallible>(Response::new(String::from("hi"))) });
//!
//! let call = || Request::get("/").header("x-api-key", "alice").body(String::new()).unwrap();
//! assert_eq!(service.clone().oneshot(call()).await.unwrap().status(), StatusCode::OK);
//! let second = service.clone().oneshot(call()).await.unwrap();
//! assert_eq!(second.headers()["ratelimit"], r#""minute";r=0;t=60"#);
//! let third = service.clone().oneshot(call()).await.unwrap();
//! assert_eq!(third.status(), StatusCode::TOO_MANY_REQUESTS);
//! assert_eq!(third.headers()["retry-after"], "60");
//! assert_eq!(third.headers()["ratelimit-policy"], r#""minute";q=2;w=60"#);
//! # }
//! ```

mod deny_cache;
mod future;
mod headers;
mod layer;
mod policy;
mod service;
#[cfg(test)]
mod tests;

use std::sync::Arc;
use std::time::Duration;

use http::{HeaderMap, HeaderName, HeaderValue, Response, StatusCode, header};

pub use future::ResponseFuture;
pub use layer::{RateLimitLayer, RateLimitLayerBuilder};
pub use policy::{Algorithm, Limit, LimitState, MAX_LOG_QUOTA, RateOutcome, RatePolicy};
pub use service::RateLimit;

use crate::body::ResponseBody;
use crate::grpc;
use crate::key::Key;
use crate::store::StoreError;
use layer::Settings;

const RATELIMIT: HeaderName = HeaderName::from_static("ratelimit");
const RATELIMIT_POLICY: HeaderName = HeaderName::from_static("ratelimit-policy");

/// What a rate-limit layer does when its store fails or does not answer in time.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum OnStoreError {
    /// Let the request through, log a warning, and mark the decision
    /// [`DecisionSource::StoreUnavailable`]. Availability over strictness: the default.
    #[default]
    Allow,
    /// Answer `503 Service Unavailable` with `Retry-After: 1` (gRPC: UNAVAILABLE).
    Deny,
    /// Limit in process while the store is out of reach, each quota divided by `copies` — the
    /// number of copies expected to share the load — so that together they stay near the limit.
    LocalFallback {
        /// How many copies of the service share the traffic (at least 1).
        copies: u32,
    },
}

/// What a rate-limit layer does with a request whose key cannot be extracted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum MissingKey {
    /// Answer `400 Bad Request` with a short body naming the problem (gRPC: INVALID_ARGUMENT).
    #[default]
    Reject,
    /// Let the request through unlimited.
    Allow,
}

/// Where a [`RateLimitDecision`] came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum DecisionSource {
    /// The shared store decided.
    Store,
    /// The store failed; [`OnStoreError::Allow`] or [`OnStoreError::Deny`] decided.
    StoreUnavailable,
    /// The store failed; the in-process fallback limiter decided.
    LocalFallback,
    /// The store denied this caller moments ago, until a time not yet reached: denied again
    /// without a round trip (see [`RateLimitLayerBuilder::deny_cache`]).
    DenyCache,
}

/// The rate-limit decision for one request, in the response extensions (and, for admitted
/// requests, the request extensions).
#[derive(Debug, Clone)]
pub struct RateLimitDecision {
    admitted: bool,
    source: DecisionSource,
    key: Key,
    cost: u64,
    retry_after: Duration,
    /// The limits that decided (the fallback's shares for a fallback decision).
    policy: Arc<RatePolicy>,
    /// Per limit of `policy`; empty when the store did not answer.
    states: Vec<LimitState>,
}

impl RateLimitDecision {
    /// Whether the request was let through.
    pub fn admitted(&self) -> bool {
        self.admitted
    }

    /// Who decided.
    pub fn source(&self) -> DecisionSource {
        self.source
    }

    /// The caller's key.
    pub fn key(&self) -> Key {
        self.key
    }

    /// The request's cost.
    pub fn cost(&self) -> u64 {
        self.cost
    }

    /// For a denied request, the time until it could be admitted.
    pub fn retry_after(&self) -> Duration {
        self.retry_after
    }

    /// Each limit's name and state after the decision, in configuration order; empty when the
    /// store did not answer.
    pub fn limits(&self) -> Vec<(&str, LimitState)> {
        self.policy
            .limits()
            .iter()
            .map(Limit::name)
            .zip(self.states.iter().copied())
            .collect()
    }

    fn write_headers(&self, settings: &Settings, headers: &mut HeaderMap) {
        if self.states.is_empty() {
            return;
        }
        // the fallback limiter's quotas are its share, and its headers say so
        let policy_header = match (&settings.fallback, self.source) {
            (Some((_, _, header)), DecisionSource::LocalFallback) => header,
            _ => &settings.policy_header,
        };
        headers.insert(RATELIMIT_POLICY, policy_header.clone());
        if let Some(value) = headers::state(&self.policy, &self.states) {
            headers.insert(RATELIMIT, value);
        }
    }
}

impl Settings {
    /// Turns the store's answer, or its failure, into a decision, as the failure policy says.
    fn decide(
        &self,
        result: Result<RateOutcome, StoreError>,
        key: Key,
        cost: u64,
    ) -> RateLimitDecision {
        let (outcome, source) = match result {
            Ok(outcome) => (outcome, DecisionSource::Store),
            Err(error) => {
                if self.last_warning.ready() {
                    tracing::warn!(
                        target: "tollgate::rate_limit",
                        %error, %key, policy = ?self.on_store_error,
                        "rate-limit store failed; applying the failure policy (logged at most once a second)"
                    );
                } else {
                    tracing::debug!(
                        target: "tollgate::rate_limit",
                        %error, %key, policy = ?self.on_store_error,
                        "rate-limit store failed; applying the failure policy"
                    );
                }
                match (&self.fallback, self.on_store_error) {
                    (Some((store, policy, _)), _) => (
                        store.check_rate_now(policy, key, cost),
                        DecisionSource::LocalFallback,
                    ),
                    (None, policy) => {
                        let admitted = policy != OnStoreError::Deny;
                        let outcome = RateOutcome {
                            admitted,
                            retry_after: if admitted {
                                Duration::ZERO
                            } else {
                                Duration::from_secs(1)
                            },
                            limits: Vec::new(),
                        };
                        (outcome, DecisionSource::StoreUnavailable)
                    }
                }
            }
        };
        let policy = match (&self.fallback, source) {
            (Some((_, divided, _)), DecisionSource::LocalFallback) => Arc::clone(divided),
            _ => Arc::clone(&self.policy),
        };
        let decision = RateLimitDecision {
            admitted: outcome.admitted,
            source,
            key,
            cost,
            retry_after: outcome.retry_after,
            policy,
            states: outcome.limits,
        };
        tracing::debug!(
            target: "tollgate::rate_limit",
            %key, cost, admitted = decision.admitted, source = ?decision.source,
            retry_after_ms = decision.retry_after.as_millis() as u64,
            "rate-limit decision"
        );
        if let Some(cache) = &self.deny_cache
            && !decision.admitted
            && decision.source == DecisionSource::Store
        {
            cache.remember(&decision);
        }
        decision
    }
}

/// A response the layer gives instead of calling the inner service.
#[derive(Debug)]
enum Rejection {
    Denied(RateLimitDecision),
    MissingKey,
}

impl Rejection {
    fn into_response<B>(self, settings: &Settings, grpc: bool) -> Response<ResponseBody<B>> {
        match self {
            Self::MissingKey if grpc => grpc::trailers_only(
                grpc::Code::InvalidArgument,
                "the request carries no rate-limit key",
            ),
            Self::MissingKey => plain(
                StatusCode::BAD_REQUEST,
                "the request carries no rate-limit key\n",
            ),
            Self::Denied(decision) => {
                let unavailable = decision.source == DecisionSource::StoreUnavailable;
                let mut response = match (grpc, unavailable) {
                    (true, false) => {
                        grpc::trailers_only(grpc::Code::ResourceExhausted, "rate limit exceeded")
                    }
                    (true, true) => {
                        grpc::trailers_only(grpc::Code::Unavailable, "rate-limit store unavailable")
                    }
                    (false, false) => plain(StatusCode::TOO_MANY_REQUESTS, "rate limit exceeded\n"),
                    (false, true) => plain(
                        StatusCode::SERVICE_UNAVAILABLE,
                        "rate-limit store unavailable\n",
                    ),
                };
                let headers = response.headers_mut();
                headers.insert(
                    header::RETRY_AFTER,
                    headers::retry_after(decision.retry_after),
                );
                decision.write_headers(settings, headers);
                response.extensions_mut().insert(decision);
                response
            }
        }
    }
}

fn plain<B>(status: StatusCode, body: &'static str) -> Response<ResponseBody<B>> {
    let mut response = Response::new(ResponseBody::full(body));
    *response.status_mut() = status;
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    response
}
