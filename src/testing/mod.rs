//! The rule's check in your own tests (feature `testing`): a throwaway `redis-server` or
//! PostgreSQL server, several copies of your service on it, and many requests at once across
//! them.
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
mod postgres;
mod redis;

use std::fmt;
use std::io;
use std::process::Child;
use std::time::{Duration, Instant};

pub use copies::{Copies, Statuses};
pub use postgres::PgServer;
pub use redis::RedisServer;

/// Why a [`RedisServer`] or a [`PgServer`] did not start.
#[derive(Debug)]
#[non_exhaustive]
pub enum StartError {
    /// The server's binaries were not found; `hint` says how to install them.
    NotInstalled {
        /// How to install the server.
        hint: &'static str,
    },
    /// The server, or a step of its set-up, exited at start (with this status and what it
    /// said).
    Exited(String),
    /// The server did not become ready in time.
    NotReady,
    /// Starting or watching a process, or making its dir, failed.
    Io(io::Error),
}

impl fmt::Display for StartError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::NotInstalled { hint } => f.write_str(hint),
            Self::Exited(status) => write!(f, "the test server exited at start: {status}"),
            Self::NotReady => f.write_str("the test server did not become ready in time"),
            Self::Io(e) => write!(f, "could not start the test server: {e}"),
        }
    }
}

impl std::error::Error for StartError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Self::Io(e) => Some(e),
            _ => None,
        }
    }
}

/// Waits up to `within` for `ready` to hold, polling every `every`; an error when `child` exits
/// first or time runs out.
fn wait_ready(
    child: &mut Child,
    within: Duration,
    every: Duration,
    mut ready: impl FnMut() -> bool,
) -> Result<(), StartError> {
    let deadline = Instant::now() + within;
    while Instant::now() < deadline {
        if let Some(status) = child.try_wait().map_err(StartError::Io)? {
            return Err(StartError::Exited(status.to_string()));
        }
        if ready() {
            return Ok(());
        }
        std::thread::sleep(every);
    }
    Err(StartError::NotReady)
}
