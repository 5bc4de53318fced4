//! Rate limiting shared by every copy of a service.
//!
//! [`RateLimitLayer`] checks each request against one or more [`Limit`]s for a caller named by a
//! [`KeyExtractor`](crate::key::KeyExtractor). The check is one atomic script in the
//! [`RateStore`](crate::store::RateStore), with the store's clock: several copies of the service on one
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
//!   caller's requests locally until then, without a round trip, asking the store again at least
//!   once a second (a cache of the store's decision that can only deny; a reset or refund
//!   through another copy reaches it through the store's broadcast within about a round trip,
//!   and within a second if the broadcast is lost; [`RateLimitLayerBuilder::deny_cache`]).
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
//! `tollgate::rate_limit` at `DEBUG` (a shadow-mode denial at `INFO`), its fields named
//! `tollgate.*` (see [Tracing](crate::guide::operations#tracing)).
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
//!
//! # Beside `tower::limit::RateLimitLayer`
//!
//! tower's `RateLimitLayer` is a different tool: it counts in one service instance's memory and,
//! when the rate is used up, makes `poll_ready` wait until it refills. tollgate's layer
//!
//! - **rejects at once** (429 with `Retry-After`, or a gRPC status) instead of holding the request
//!   back: `poll_ready` only asks the inner service, so a burst never queues up behind a limit;
//! - is **shared**: the counters live in the store, so every clone of the service and every copy
//!   of the process counts against the same limit, per caller key;
//! - is **`Clone`**, as axum and tonic require of a layer's service, without a `Buffer` in front.
//!
//! Use tower's to smooth what one instance sends to a fragile dependency; use this one to
//! enforce what callers may ask of the service as a whole.

mod body;
mod builder;
#[cfg(test)]
mod client_tests;
#[cfg(feature = "serde")]
mod config;
mod decision;
#[cfg(feature = "reqwest")]
mod direct;
mod estimate;
mod future;
mod layer;
mod limits;
mod meter;
mod rejection;
mod respond;
pub(crate) use rejection::Refused;
mod service;
mod settings;
#[cfg(test)]
mod tests;

pub use crate::headers::QuotaUnit;
pub use crate::in_force::{Changed, LimitsError};
pub use crate::key::MissingKey;
pub use crate::on_error::OnStoreError;
pub use crate::rate_client::DecisionSource;
pub use body::ResponseBody;
pub use builder::{DEFAULT_LIMITS_REFRESH, RateLimitLayerBuilder};
#[cfg(feature = "serde")]
pub use config::RateLimitConfig;
pub use decision::{RateLimitDecision, RateLimitDecisions};
pub use estimate::{
    DEFAULT_BODY_TIMEOUT, Estimate, EstimateBody, EstimateError, EstimateFuture, EstimateLayer,
    EstimateService,
};
pub use future::ResponseFuture;
pub use layer::RateLimitLayer;
pub use limits::{StoreLimits, change_limits};
#[cfg(feature = "sse")]
pub use meter::SseUsage;
pub use meter::{Meter, TrailerUsage};
pub use service::RateLimit;

pub use crate::rate::{Algorithm, Limit, LimitState, MAX_LOG_QUOTA};
