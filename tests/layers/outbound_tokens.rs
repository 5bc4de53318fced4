//! Requests and tokens in one outbound check (`Limit::counting_calls`), against a stand-in
//! provider of 100 requests and 10,000 tokens a second (each a token bucket), on a
//! `MemoryStore`, a real `redis-server` and a real PostgreSQL: four copies of sixteen workers
//! each, every call declaring its tokens (50 to 250, at random) in `x-tokens`, calling as fast
//! as they can through hyper's client, never go over either of the provider's limits and use
//! nearly all of what their own limits allow. The provider's buckets judge each call when the
//! limit let it out (see [`let_out`](crate::let_out)).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::extract::State;
use axum::routing::post;
use bytes::Bytes;
use http::{HeaderMap, Request, StatusCode};
use http_body_util::Full;
use tokio::net::TcpListener;
use tokio::task::JoinSet;
use tokio::time::Instant;
use tower::ServiceExt;

use tollgate::key::Global;
use tollgate::outbound::OutboundLimitLayer;
use tollgate::rate_limit::{Algorithm, Limit, RateLimitLayer};
use tollgate::store::RateStore;

use crate::let_out::{caller, let_out, refused};

/// The provider's limits: requests and tokens a second (and at once).
const PROVIDER_REQUESTS: f64 = 100.0;
const PROVIDER_TOKENS: f64 = 10_000.0;
/// The copies' limits, by GCRA on the store's clock: a tenth under the provider's, which
/// absorbs how much later some calls are stamped than others after the store's decision on a
/// busy machine.
const OUR_REQUESTS: u64 = 90;
const OUR_TOKENS: u64 = 9_000;
/// The tokens a call declares, at random: from 50 to 250, where the tokens run out first (150
/// a call on average: 60 calls a second), or from 20 to 100, where the requests do (90 calls a
/// second of 60 tokens on average).
const TOKENS_FIRST: std::ops::RangeInclusive<u64> = 50..=250;
const REQUESTS_FIRST: std::ops::RangeInclusive<u64> = 20..=100;
const COPIES: usize = 4;
const WORKERS: usize = 16;
/// How long the workers call.
const RUN: Duration = Duration::from_secs(10);

/// A call the provider took: when the limit let it out, when it arrived (both since the run's
/// start), and its tokens.
#[derive(Debug, Clone, Copy)]
struct Call {
    let_out: Duration,
    arrived: Duration,
    tokens: u64,
}

/// The stand-in provider: every call it took, and how many came without a readable `x-tokens`
/// or stamp.
#[derive(Debug, Default)]
struct Provider {
    calls: Vec<Call>,
    unreadable: usize,
}

type Shared = Arc<Mutex<Provider>>;

async fn call(
    State((provider, start)): State<(Shared, Instant)>,
    headers: HeaderMap,
) -> StatusCode {
    let arrived = start.elapsed();
    let tokens = headers
        .get("x-tokens")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    let mut p = provider.lock().unwrap();
    let (Some(tokens), Some(let_out)) = (tokens, let_out(&headers)) else {
        p.unreadable += 1;
        return StatusCode::BAD_REQUEST;
    };
    p.calls.push(Call {
        let_out,
        arrived,
        tokens,
    });
    StatusCode::OK
}

async fn provider(start: Instant) -> (SocketAddr, Shared) {
    let shared = Shared::default();
    let app = Router::new()
        .route("/v1/calls", post(call))
        .with_state((Arc::clone(&shared), start));
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    (addr, shared)
}

/// The calls the provider's buckets refuse, judged at `at`: (for the requests, for the
/// tokens).
fn over(calls: &[Call], at: impl Fn(&Call) -> Duration) -> (usize, usize) {
    let weighed = calls.iter().map(|c| (at(c), [1.0, c.tokens as f64]));
    let [requests, tokens] = refused(weighed, [PROVIDER_REQUESTS, PROVIDER_TOKENS]);
    (requests, tokens)
}

/// A copy's limit: requests counted per call, tokens as each call's cost (its `x-tokens`).
fn outbound(store: impl RateStore, prefix: &str) -> OutboundLimitLayer<Global> {
    RateLimitLayer::builder(store)
        .prefix(prefix)
        .limit(Limit::per_second("requests", OUR_REQUESTS).counting_calls())
        .limit(Limit::per_second("tokens", OUR_TOKENS))
        .algorithm(Algorithm::Gcra)
        .cost(|parts| {
            parts
                .headers
                .get("x-tokens")
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.parse().ok())
                .unwrap_or(*TOKENS_FIRST.end())
        })
        // the layer's default patience: a large call may wait while smaller ones fit
        .queue(Duration::from_secs(30))
        .build_outbound()
        .unwrap()
}

fn post_to(addr: SocketAddr, tokens: u64) -> Request<Full<Bytes>> {
    Request::post(format!("http://{addr}/v1/calls"))
        .header("x-tokens", tokens)
        .body(Full::default())
        .unwrap()
}

/// Four copies × sixteen workers calling as fast as they can for ten seconds, each call of
/// tokens in `range` at random: the provider's buckets, judging each call when the limit let it
/// out, refuse none (neither limit is passed), and the calls let out within the run use at
/// least 85% of what the copies' limits allow (their burst, then their rate) of the limit that
/// runs out first.
async fn stay_under_the_providers_limits<S: RateStore>(
    backend: &str,
    range: std::ops::RangeInclusive<u64>,
    make: impl Fn() -> S,
) {
    let start = Instant::now();
    let (addr, provider) = provider(start).await;
    let prefix = format!("tok{:08x}", rand::random::<u32>());
    let mut workers = JoinSet::new();
    for _ in 0..COPIES {
        let caller = caller(outbound(make(), &prefix), start);
        for _ in 0..WORKERS {
            let (caller, range) = (caller.clone(), range.clone());
            workers.spawn(async move {
                let (mut errors, mut longest) = (Vec::new(), Duration::ZERO);
                while start.elapsed() < RUN {
                    let tokens = rand::random_range(range.clone());
                    let sent = Instant::now();
                    match caller.clone().oneshot(post_to(addr, tokens)).await {
                        Ok(StatusCode::OK) => {}
                        Ok(status) => errors.push(status.to_string()),
                        Err(error) => errors.push(error),
                    }
                    longest = longest.max(sent.elapsed());
                }
                (errors, longest)
            });
        }
    }
    let ends = workers.join_all().await;
    let longest = ends.iter().map(|(_, l)| *l).max().unwrap_or_default();
    let errors: Vec<String> = ends.into_iter().flat_map(|(e, _)| e).collect();
    let p = provider.lock().unwrap();
    assert_eq!(p.unreadable, 0);
    assert!(errors.is_empty(), "{errors:?}");
    let on_arrival = over(&p.calls, |c| c.arrived);
    assert_eq!(
        over(&p.calls, |c| c.let_out),
        (0, 0),
        "calls over the provider's limits (requests, tokens) when the limit let them out; \
         judged on arrival: {on_arrival:?}"
    );
    // the calls the limit let out within the run (the last ones waited past its end)
    let within: Vec<u64> = p
        .calls
        .iter()
        .filter(|c| c.let_out < RUN)
        .map(|c| c.tokens)
        .collect();
    let (requests, tokens) = (within.len() as u64, within.iter().sum::<u64>());
    let secs = RUN.as_secs();
    // what our limits allow in the run: a burst of one window, then the rate
    let (allowed_requests, allowed_tokens) = (OUR_REQUESTS * (secs + 1), OUR_TOKENS * (secs + 1));
    let used =
        (requests as f64 / allowed_requests as f64).max(tokens as f64 / allowed_tokens as f64);
    let of_provider = (requests as f64 / (PROVIDER_REQUESTS * secs as f64))
        .max(tokens as f64 / (PROVIDER_TOKENS * secs as f64));
    eprintln!(
        "{backend}, {range:?} tokens a call: {requests} requests and {tokens} tokens in {secs} \
         s: {:.1}% of what the copies' limits allow, {:.1}% of the provider's quota; the \
         longest call took {longest:?}; judged on arrival, the provider would have refused \
         {on_arrival:?}",
        used * 100.0,
        of_provider * 100.0
    );
    assert!(
        used >= 0.85,
        "{backend}, {range:?}: {requests} requests, {tokens} tokens: {:.1}% of what the limits allow",
        used * 100.0
    );
}

mod on_memory {
    use tollgate::store::MemoryStore;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_tokens_run_out_first() {
        let store = MemoryStore::new();
        super::stay_under_the_providers_limits("memory", super::TOKENS_FIRST, || store.clone())
            .await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_requests_run_out_first() {
        let store = MemoryStore::new();
        super::stay_under_the_providers_limits("memory", super::REQUESTS_FIRST, || store.clone())
            .await;
    }
}

mod on_redis {
    use crate::common::RedisServer;
    use crate::rate_limit_invalidations::redis_store;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_tokens_run_out_first() {
        let server = RedisServer::start();
        super::stay_under_the_providers_limits("redis", super::TOKENS_FIRST, || {
            redis_store(&server)
        })
        .await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_requests_run_out_first() {
        let server = RedisServer::start();
        super::stay_under_the_providers_limits("redis", super::REQUESTS_FIRST, || {
            redis_store(&server)
        })
        .await;
    }
}

mod on_postgres {
    use crate::common::postgres;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_tokens_run_out_first() {
        let store = postgres::store().await;
        super::stay_under_the_providers_limits("postgres", super::TOKENS_FIRST, || store.clone())
            .await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_requests_run_out_first() {
        let store = postgres::store().await;
        super::stay_under_the_providers_limits("postgres", super::REQUESTS_FIRST, || store.clone())
            .await;
    }
}
