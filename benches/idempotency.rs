//! Idempotency benchmark: `cargo bench --bench idempotency`.
//!
//! Starts its own redis-server and measures, in one run, the cost of the idempotency layer over a
//! plain handler: store round trips (`INFO commandstats`, EVALSHA calls) and time per request for
//! a first execution and for a replay, sequentially (one request at a time, so the figure is
//! latency), and the lease extensions of a handler that outlives a third of its lease.
#![allow(clippy::unwrap_used, clippy::expect_used)]

#[path = "../tests/common/mod.rs"]
mod common;

use std::convert::Infallible;
use std::time::{Duration, Instant};

use bytes::Bytes;
use common::RedisServer;
use http::{Request, Response};
use http_body_util::{BodyExt, Full};
use tollgate::idempotency::IdempotencyLayer;
use tollgate::store::RedisStore;
use tower::{ServiceBuilder, ServiceExt};

const N: usize = 3000;

fn evalsha_calls(server: &RedisServer) -> u64 {
    server
        .info_field("commandstats", "cmdstat_evalsha")
        .and_then(|s| {
            s.split(',')
                .find_map(|kv| kv.strip_prefix("calls=")?.parse().ok())
        })
        .unwrap_or(0)
}

fn payment(key: Option<&str>) -> Request<Full<Bytes>> {
    let mut req = Request::post("/payments");
    if let Some(key) = key {
        req = req.header("idempotency-key", key);
    }
    req.body(Full::new(Bytes::from_static(
        br#"{"amount":100,"currency":"EUR"}"#,
    )))
    .unwrap()
}

async fn handler(_req: Request<impl Send>) -> Result<Response<Full<Bytes>>, Infallible> {
    Ok(Response::new(Full::new(Bytes::from_static(
        br#"{"id":"9b2f","amount":100,"currency":"EUR"}"#,
    ))))
}

/// Mean time per request of `n` sequential requests made by `make(i)`.
async fn per_request<S, B>(
    svc: &S,
    n: usize,
    make: impl Fn(usize) -> Request<Full<Bytes>>,
) -> Duration
where
    S: tower::Service<Request<Full<Bytes>>, Response = Response<B>, Error = Infallible> + Clone,
    B: http_body::Body,
    B::Error: std::fmt::Debug,
{
    let start = Instant::now();
    for i in 0..n {
        let res = svc.clone().oneshot(make(i)).await.unwrap();
        res.into_body().collect().await.unwrap();
    }
    start.elapsed() / n as u32
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let server = RedisServer::start();
    let store = RedisStore::builder(server.url())
        .timeout(Duration::from_secs(1))
        .build()
        .unwrap();
    let plain = ServiceBuilder::new().service_fn(handler);
    let layered = ServiceBuilder::new()
        .layer(
            IdempotencyLayer::builder(store.clone())
                .unscoped()
                .build()
                .unwrap(),
        )
        .service_fn(handler);

    // warm up connections and scripts
    per_request(&layered, 200, |i| payment(Some(&format!("warm-{i}")))).await;
    per_request(&plain, 200, |_| payment(None)).await;

    let plain_time = per_request(&plain, N, |_| payment(None)).await;

    let before = evalsha_calls(&server);
    let first_time = per_request(&layered, N, |i| payment(Some(&format!("first-{i}")))).await;
    let first_trips = (evalsha_calls(&server) - before) as f64 / N as f64;

    per_request(&layered, 1, |_| payment(Some("replayed"))).await;
    let before = evalsha_calls(&server);
    let replay_time = per_request(&layered, N, |_| payment(Some("replayed"))).await;
    let replay_trips = (evalsha_calls(&server) - before) as f64 / N as f64;

    // a handler that outlives its 300 ms lease: extended at 100 and 200 ms
    let slow = ServiceBuilder::new()
        .layer(
            IdempotencyLayer::builder(store.clone())
                .unscoped()
                .lease(Duration::from_millis(300))
                .build()
                .unwrap(),
        )
        .service_fn(|req: Request<_>| async move {
            tokio::time::sleep(Duration::from_millis(250)).await;
            handler(req).await
        });
    let before = evalsha_calls(&server);
    per_request(&slow, 8, |i| payment(Some(&format!("slow-{i}")))).await;
    let slow_trips = (evalsha_calls(&server) - before) as f64 / 8.0;

    let us = |d: Duration| d.as_secs_f64() * 1e6;
    println!("\n## Idempotency layer (RedisStore, sequential requests, {N} each)\n");
    println!("| request | store round trips | µs per request | added over a plain handler |");
    println!("| --- | ---: | ---: | ---: |");
    println!(
        "| plain handler, no layer | 0 | {:.1} | — |",
        us(plain_time)
    );
    println!(
        "| first execution | {first_trips:.2} | {:.1} | {:.1} µs |",
        us(first_time),
        us(first_time) - us(plain_time)
    );
    println!(
        "| replay | {replay_trips:.2} | {:.1} | {:.1} µs |",
        us(replay_time),
        us(replay_time) - us(plain_time)
    );
    println!("| first execution, 250 ms handler, 300 ms lease | {slow_trips:.2} | — | — |");
    println!(
        "\nA first execution is a claim and a completion; a replay one lookup; a handler that \
         outlives a third of its lease adds one extension per third."
    );
}
