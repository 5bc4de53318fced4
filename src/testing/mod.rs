//! The rule's check in your own tests (feature `testing`): a throwaway `redis-server`, several
//! copies of your service on it, and many requests at once across them.
//!
//! A lock, counter or "already done" set kept in process memory holds while one copy runs and
//! breaks with two. The check that catches it: build the service twice — each copy with its own
//! in-process state, as separate processes would have — on one store, send 50 parallel
//! redemptions of one coupon spread over both, and count: exactly one succeeds.
//!
//! ```
//! use std::convert::Infallible;
//! use std::sync::Arc;
//! use std::sync::atomic::{AtomicBool, Ordering};
//!
//! use http::{Request, Response, StatusCode};
//! use tollgate::testing::Copies;
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() {
//! // A coupon service that remembers redemptions in process memory: the bug this finds.
//! let service = || {
//!     let redeemed = Arc::new(AtomicBool::new(false));
//!     tower::service_fn(move |_: Request<()>| {
//!         let first = !redeemed.swap(true, Ordering::SeqCst);
//!         let status = if first { StatusCode::OK } else { StatusCode::CONFLICT };
//!         async move { Ok::<_, Infallible>(Response::builder().status(status).body(()).unwrap()) }
//!     })
//! };
//! let statuses = Copies::new(2, |_| service())
//!     .fire(50, |_| Request::post("/coupons/X/redeem").body(()).unwrap())
//!     .await;
//! // each copy redeemed it once: two successes where one was promised
//! assert_eq!(statuses.count(StatusCode::OK), 2);
//! assert_eq!(statuses.count(StatusCode::CONFLICT), 48);
//! # }
//! ```
//!
//! With the state in the store (a [`Claims`](crate::claim::Claims) on a [`RedisServer`]'s
//! store, say), the same test counts one `200` and 49 `409`s.

mod copies;
mod redis;

pub use copies::{Copies, Statuses};
pub use redis::{RedisServer, StartError};
