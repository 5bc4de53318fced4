//! Flood benchmark: `cargo bench --bench flood`.
//!
//! HTTP requests per second of one caller flooding a rate-limited axum route far over its limit,
//! beside the same route without any limiter, measured side by side in one run over real TCP
//! (keep-alive HTTP/1.1 connections from a load generator in the same process). Once the store
//! has denied the caller, the local deny cache answers without a round trip; the run without the
//! cache shows what each denial would cost otherwise.
#![allow(clippy::unwrap_used, clippy::expect_used)]

#[path = "../tests/common/mod.rs"]
mod common;

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use axum::Router;
use axum::routing::get;
use bytes::Bytes;
use common::RedisServer;
use http_body_util::{BodyExt, Empty};
use hyper_util::rt::TokioIo;
use tollgate::key::Header;
use tollgate::rate_limit::{Limit, RateLimitLayer};
use tollgate::store::RedisStore;

const CONNECTIONS: usize = 32;
const ROUNDS: usize = 3;

fn secs() -> Duration {
    let s = std::env::var("BENCH_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(3.0);
    Duration::from_secs_f64(s)
}

async fn serve(router: Router) -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, router).await.unwrap() });
    addr
}

fn hello() -> Router {
    Router::new().route("/hello", get(|| async { "hello" }))
}

fn limited(store: RedisStore, deny_cache: bool) -> Router {
    let layer = RateLimitLayer::builder(store)
        .limit(Limit::per_hour("hour", 10))
        .key(Header::from_static("x-api-key"))
        .deny_cache(deny_cache)
        .prefix(format!("flood{}", rand::random::<u32>()))
        .build()
        .unwrap();
    hello().layer(layer)
}

/// Requests per second over `CONNECTIONS` keep-alive connections for `secs()`; also returns how
/// many answers were 429.
async fn load(addr: SocketAddr) -> (f64, u64) {
    let deadline = Instant::now() + secs();
    let mut tasks = Vec::new();
    for _ in 0..CONNECTIONS {
        tasks.push(tokio::spawn(async move {
            let stream = tokio::net::TcpStream::connect(addr).await.unwrap();
            stream.set_nodelay(true).unwrap();
            let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
                .await
                .unwrap();
            tokio::spawn(conn);
            let (mut done, mut denied) = (0u64, 0u64);
            while Instant::now() < deadline {
                let req = http::Request::get("/hello")
                    .header("host", "bench")
                    .header("x-api-key", "flooder")
                    .body(Empty::<Bytes>::new())
                    .unwrap();
                sender.ready().await.unwrap();
                let res = sender.send_request(req).await.unwrap();
                denied += u64::from(res.status() == 429);
                res.into_body().collect().await.unwrap();
                done += 1;
            }
            (done, denied)
        }));
    }
    let start = Instant::now();
    let (mut done, mut denied) = (0, 0);
    for t in tasks {
        let (d, n) = t.await.unwrap();
        done += d;
        denied += n;
    }
    (done as f64 / start.elapsed().as_secs_f64(), denied)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let server = RedisServer::start();
    let store = || {
        RedisStore::builder(server.url())
            .timeout(Duration::from_secs(1))
            .build()
            .unwrap()
    };
    let plain = serve(hello()).await;
    let cached = serve(limited(store(), true)).await;
    let uncached = serve(limited(store(), false)).await;
    // warm up: connections, scripts, and the caller's first denial
    for addr in [plain, cached, uncached] {
        load(addr).await;
    }
    let (mut p, mut c, mut u) = (Vec::new(), Vec::new(), Vec::new());
    let mut denied_share = 0.0;
    for _ in 0..ROUNDS {
        p.push(load(plain).await.0);
        let (rate, denied) = load(cached).await;
        denied_share = denied as f64 / (rate * secs().as_secs_f64());
        c.push(rate);
        u.push(load(uncached).await.0);
    }
    let (p, c, u) = (median(p), median(c), median(u));
    println!(
        "\n## Denied flood: one caller far over its limit ({CONNECTIONS} connections, HTTP/1.1, median of {ROUNDS})\n"
    );
    println!("| server | req/s | vs no limiter |");
    println!("| --- | ---: | ---: |");
    println!("| axum hello, no limiter | {p:.0} | 1.00x |");
    println!(
        "| rate-limited, deny cache on (default) | {c:.0} | {:.2}x |",
        c / p
    );
    println!(
        "| rate-limited, deny cache off: a Redis round trip per denial | {u:.0} | {:.2}x |",
        u / p
    );
    println!(
        "\n{:.1}% of the flood's answers were 429.",
        denied_share * 100.0
    );
}
