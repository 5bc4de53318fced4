//! Limits on the calls a service **makes**: one quota of a third-party API — a payment
//! provider, a partner's API, an LLM provider's requests and tokens a minute — shared by every
//! copy's calls, which wait for room instead of failing.
//!
//! A copy that paces its calls in process (governor, `reqwest-leaky-bucket`, tower's
//! `RateLimit`) gets the provider's whole quota to itself: with N copies the service sends N
//! times the quota, and the provider answers `429`. An [`OutboundLimitLayer`] decides each call
//! in the store, as a [`RateLimitLayer`](crate::rate_limit::RateLimitLayer) decides each
//! request — it *is* one, built with
//! [`build_outbound`](crate::rate_limit::RateLimitLayerBuilder::build_outbound), with the
//! same keys, limits, algorithms, tiers, costs, settlements and failure policies — and wraps a
//! client instead of a server:
//!
//! - **Any client that is a `tower::Service<http::Request<_>>`**: hyper-util's client, a tonic
//!   `Channel`; and, with the feature `reqwest`, a `reqwest_middleware::ClientWithMiddleware`
//!   (the layer is a `reqwest_middleware::Middleware`).
//! - **Waiting, not failing**: a call the limits deny waits for its room (see
//!   [`queue`](crate::rate_limit::RateLimitLayerBuilder::queue): in arrival order on its copy;
//!   the copies take turns, in a line the store keeps, see [Lines](crate::store#lines)), up to
//!   the layer's patience
//!   (30 s unless [`queue`](crate::rate_limit::RateLimitLayerBuilder::queue) says otherwise).
//!   Past it the call fails with [`OutboundError::Limited`], saying when room comes. A call
//!   whose future is dropped leaves its line.
//! - **Costs known after the call**: `cost` reserves an estimate read from the request;
//!   `settle` / `settle_stream` charge what the provider's response says it used.
//! - **Learning from the provider**: a `429` or `503` with `Retry-After` pauses the calls of
//!   that key until then (see [`Pause`] for how a missing, unparsable or huge value is taken):
//!   on this copy at once, and on every copy with
//!   [`share_pauses`](OutboundLimitLayer::share_pauses). So does an answer whose own count
//!   (`RateLimit`, `x-ratelimit-remaining`, ...) says the quota is spent, until its reset; and a
//!   lower count than the store's brings the store's down to it (see [`ProviderCounts`]).
//! - **A store that fails** follows the builder's `on_store_error`, or, with
//!   [`wait_for_store`](OutboundLimitLayer::wait_for_store), keeps the call waiting for the
//!   store until its patience ends ([`OutboundError::StoreUnavailable`] then).
//! - **Patience** counts from the call: a provider's pause waited out is part of it.
//!
//! ```
//! # #[tokio::main(flavor = "current_thread", start_paused = true)] async fn main() {
//! use std::time::Duration;
//!
//! use http::{Request, Response};
//! use tollgate::outbound::OutboundError;
//! use tollgate::rate_limit::{Limit, RateLimitLayer};
//! use tollgate::store::MemoryStore; // a RedisStore or PgStore to share the quota between copies
//! use tower::{ServiceBuilder, ServiceExt};
//!
//! let provider = RateLimitLayer::builder(MemoryStore::new())
//!     .limit(Limit::per_second("requests", 1))
//!     .queue(Duration::from_millis(1_500)) // a call waits up to 1.5 s for room
//!     .build_outbound()
//!     .unwrap();
//! let client = ServiceBuilder::new()
//!     .layer(provider)
//!     .service_fn(|_: Request<()>| async { Ok::<_, std::io::Error>(Response::new(())) });
//! let call = || client.clone().oneshot(Request::new(()));
//! assert!(call().await.is_ok());
//! assert!(call().await.is_ok(), "waited a second for room");
//! // two at once: the first waits a second; the second's room comes a second later still,
//! // past its patience — it fails then, saying when
//! let (first, second) = tokio::join!(call(), call());
//! assert!(first.is_ok());
//! let Err(OutboundError::Limited(limited)) = second else { panic!("{second:?}") };
//! assert!(limited.waited() >= Duration::from_millis(900));
//! assert!(limited.retry_after() >= Duration::from_millis(900));
//! # }
//! ```

mod correct;
mod counts;
mod error;
mod layer;
mod pause;
#[cfg(feature = "reqwest")]
mod reqwest;
mod service;

pub use counts::{ProviderCount, ProviderCounts};
pub use error::{Limited, OutboundError};
pub use layer::OutboundLimitLayer;
pub use pause::Pause;
pub use service::{OutboundLimit, ResponseFuture};
