//! The stand-in provider: `POST /v1/calls`, at most `limit` calls a second (a bucket of `limit`
//! refilled at `limit` a second), `429` with `Retry-After: 1` past them.

use std::net::{Ipv4Addr, SocketAddr};
use std::sync::{Arc, Mutex, PoisonError};

use axum::Router;
use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::post;
use tokio::net::TcpListener;
use tokio::time::Instant;

use crate::env::Failure;

/// What the provider counted.
#[derive(Debug)]
pub struct StandIn {
    bucket: Mutex<Bucket>,
}

#[derive(Debug)]
struct Bucket {
    limit: f64,
    tokens: f64,
    filled: Instant,
    taken: u64,
    refused: u64,
}

impl StandIn {
    fn bucket(&self) -> std::sync::MutexGuard<'_, Bucket> {
        self.bucket.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The calls it answered `200`.
    pub fn taken(&self) -> u64 {
        self.bucket().taken
    }

    /// The calls it refused.
    pub fn refused(&self) -> u64 {
        self.bucket().refused
    }
}

async fn call(
    State(stand_in): State<Arc<StandIn>>,
) -> (StatusCode, [(&'static str, &'static str); 1]) {
    let mut bucket = stand_in.bucket();
    let now = Instant::now();
    let refill = now.duration_since(bucket.filled).as_secs_f64() * bucket.limit;
    bucket.tokens = (bucket.tokens + refill).min(bucket.limit);
    bucket.filled = now;
    if bucket.tokens < 1.0 {
        bucket.refused += 1;
        return (StatusCode::TOO_MANY_REQUESTS, [("retry-after", "1")]);
    }
    bucket.tokens -= 1.0;
    bucket.taken += 1;
    (StatusCode::OK, [("content-type", "text/plain")])
}

/// Starts the stand-in on a free port of 127.0.0.1.
pub async fn start(limit: u32) -> Result<(SocketAddr, Arc<StandIn>), Failure> {
    let stand_in = Arc::new(StandIn {
        bucket: Mutex::new(Bucket {
            limit: f64::from(limit),
            tokens: f64::from(limit),
            filled: Instant::now(),
            taken: 0,
            refused: 0,
        }),
    });
    let app = Router::new()
        .route("/v1/calls", post(call))
        .with_state(Arc::clone(&stand_in));
    let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
        .await
        .map_err(|e| Failure::runtime(format!("cannot start the stand-in provider: {e}")))?;
    let addr = listener
        .local_addr()
        .map_err(|e| Failure::runtime(format!("cannot start the stand-in provider: {e}")))?;
    tokio::spawn(async move {
        if let Err(error) = axum::serve(listener, app).await {
            eprintln!("warning: the stand-in provider stopped: {error}");
        }
    });
    Ok((addr, stand_in))
}
