//! Concurrency limits shared by every copy of a service: at most `N` requests in flight per key.
//!
//! tower's `ConcurrencyLimitLayer` bounds one process: with five copies, five times as many
//! expensive jobs run per tenant. [`ConcurrencyLimitLayer`] keeps the permits in a shared
//! [`PermitStore`](crate::store::PermitStore) instead, so the bound holds across every copy on the
//! same store.
//!
//! - **Admitted**: the request takes one of the key's `limit` permits and runs; its
//!   [`Permit`] (with a fencing token that strictly increases per key) is in the request's
//!   extensions. The permit is given back when the response body ends or is dropped — so a
//!   streamed response counts as in flight until its last byte.
//! - **Full**: `429 Too Many Requests` (problem details) with `Retry-After`: the configured
//!   [hint](ConcurrencyLimitLayerBuilder::retry_after), or else the time until the first held
//!   permit's lease ends. gRPC calls get `RESOURCE_EXHAUSTED` in a trailers-only response.
//! - **Waiting, opt-in**: with [`queue`](ConcurrencyLimitLayerBuilder::queue), a request waits
//!   for a permit, for a bounded time, in the key's queue in the store: permits go to waiters in
//!   the order they arrived, whichever copy they wait in.
//! - **Leases**: a permit is a lease in the store, extended every third of it while the request
//!   runs. A copy that dies gives its permits back within one lease; a copy cut off from the
//!   store for a whole lease loses its permits, and the request goes on without one (logged).
//! - **Ambiguity**: an acquisition that goes unanswered (a timeout, a dropped connection) is
//!   refused by the store should it arrive after its deadline, and is given back, token-checked,
//!   once that deadline has passed — a late acquisition never holds a permit. A release is safe
//!   to run twice.
//! - **Store down**: as [`OnStoreError`] says — by default the request is allowed and a warning
//!   logged; or `503`; or a local limit per copy.
//! - **No key**: as [`MissingKey`] says — by default `400 Bad Request`.
//!
//! Every decision is counted in [`CONCURRENCY_DECISIONS`](crate::metrics::CONCURRENCY_DECISIONS)
//! and told as a `tracing` event, target `tollgate::concurrency`, at `DEBUG` (`tollgate.outcome`
//! `acquired`, `queued` or `refused`; see [Tracing](crate::guide::operations#tracing)).
//!
//! ```
//! # #[tokio::main(flavor = "current_thread")] async fn main() {
//! use http::{Request, Response, StatusCode};
//! use tower::{ServiceBuilder, ServiceExt};
//! use tollgate::concurrency::{ConcurrencyLimitLayer, Permit};
//! use tollgate::key::Header;
//! use tollgate::store::MemoryStore;
//!
//! let layer = ConcurrencyLimitLayer::builder(MemoryStore::new())
//!     .limit(1)
//!     .key(Header::from_static("x-tenant"))
//!     .build()
//!     .unwrap();
//! let service = ServiceBuilder::new().layer(layer).service_fn(|req: Request<String>| async move {
//!     let permit = req.extensions().get::<Permit>().unwrap();
//!     Ok::<_, std::convert::Infallible>(Response::new(permit.fencing_token().to_string()))
//! });
//! let call = || Request::post("/jobs").header("x-tenant", "acme").body(String::new()).unwrap();
//!
//! // the first response holds the tenant's one permit until its body is done with
//! let first = service.clone().oneshot(call()).await.unwrap();
//! assert_eq!(first.status(), StatusCode::OK);
//! let second = service.clone().oneshot(call()).await.unwrap();
//! assert_eq!(second.status(), StatusCode::TOO_MANY_REQUESTS);
//! assert!(second.headers().contains_key("retry-after"));
//!
//! drop(first); // the permit goes back in the background
//! tokio::task::yield_now().await;
//! assert_eq!(service.clone().oneshot(call()).await.unwrap().status(), StatusCode::OK);
//! # }
//! ```

mod admit;
mod body;
#[cfg(feature = "serde")]
mod config;
mod future;
mod layer;
mod limits;
mod permit;
mod rejection;
mod report;
mod service;
mod settings;
mod store_limits;
#[cfg(test)]
mod tests;

pub use body::PermitBody;
#[cfg(feature = "serde")]
pub use config::ConcurrencyConfig;
pub use future::ResponseFuture;
pub use layer::{ConcurrencyLimitLayer, ConcurrencyLimitLayerBuilder};
pub use permit::Permit;
pub use service::ConcurrencyLimit;
pub use store_limits::{ConcurrencyLimits, change_limits};

pub use crate::key::MissingKey;
pub use crate::on_error::OnStoreError;
