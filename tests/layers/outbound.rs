//! Limits on the calls a service makes (`tollgate::outbound`), against a stand-in provider (an
//! axum server enforcing 100 calls a second as a token bucket — 100 at once, refilled at 100 a
//! second — answering `429` past it), on a `MemoryStore`, a real
//! `redis-server` and a real PostgreSQL: four copies of sixteen workers each, calling as fast as
//! they can through hyper's client, never go over the provider's limit (judged when the limit
//! let each call out, see [`let_out`](crate::let_out)) and use nearly all of it; a provider's
//! `429` with `Retry-After` pauses the copy that got it; a cancelled wait frees its place.
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
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use tokio::net::TcpListener;
use tokio::task::JoinSet;
use tokio::time::Instant;
use tower::{ServiceBuilder, ServiceExt};

use tollgate::key::Global;
use tollgate::outbound::{OutboundError, OutboundLimitLayer, ProviderCounts};
use tollgate::rate_limit::{Algorithm, Limit, RateLimitLayer};
use tollgate::store::{LockStore, RateStore};

use crate::let_out::{Bucket, Caller, Stamp, let_out, refused};

/// The provider's limit: calls a second (and at once).
const PROVIDER_LIMIT: usize = 100;
/// The share of it the copies are given, by GCRA (the provider's token bucket, on the store's
/// clock): the rest absorbs how much longer some calls take than others from the store's
/// decision to the provider, or to their stamp (see [`let_out`](crate::let_out)), on a machine
/// busy with other tests.
const OURS: u64 = 90;
const COPIES: usize = 4;
const WORKERS: usize = 16;

/// The stand-in provider: a token bucket of `limit` calls, refilled at `limit` a second; `429`
/// with `Retry-After: 1` when it is empty (and a count of each).
#[derive(Debug)]
struct Provider {
    /// The bucket, on the provider's clock (from `since`).
    bucket: Bucket,
    since: Instant,
    total: usize,
    over: usize,
    /// When each call arrived, accepted or not.
    arrivals: Vec<Instant>,
    /// When it stops taking calls, for how long: each call then is answered `429` with the
    /// time left as `Retry-After`.
    closed: Option<(Instant, Duration)>,
    /// When it first answered so.
    first_closed: Option<Instant>,
    /// From when `/v1/counted` reports its count spent (`x-ratelimit-remaining-requests: 0`,
    /// reset in 1 s), once; and when it did.
    spent: Option<Instant>,
    spent_at: Option<Instant>,
    /// Calls to `/v1/stamped`: when the limit let each out (stamped from `since`, see
    /// [`let_out`](crate::let_out)) and when it arrived; and those without a stamp.
    stamped: Vec<(Duration, Duration)>,
    unstamped: usize,
}

type Shared = Arc<Mutex<Provider>>;

async fn call(State(provider): State<Shared>) -> (StatusCode, [(&'static str, String); 1]) {
    answer(&provider, Judged::OnArrival)
}

/// [`call`], for calls stamped with when the limit let them out: taken whatever the bucket
/// holds as they arrive, and judged afterwards on their stamps (see [`let_out`]).
async fn stamped_call(
    State(provider): State<Shared>,
    headers: HeaderMap,
) -> (StatusCode, [(&'static str, String); 1]) {
    answer(&provider, Judged::Afterwards(let_out(&headers)))
}

/// When a call the provider is open to is judged by its bucket.
#[derive(Clone, Copy)]
enum Judged {
    /// As it arrives: refused when the bucket is empty.
    OnArrival,
    /// By the test, on when the limit let it out (`None`: the call has no stamp): taken.
    Afterwards(Option<Duration>),
}

/// The provider's answer to a call: `429` while it is closed; else judged as `judged` says.
fn answer(provider: &Shared, judged: Judged) -> (StatusCode, [(&'static str, String); 1]) {
    let mut p = provider.lock().unwrap();
    let now = Instant::now();
    p.arrivals.push(now);
    if let Some((from, long)) = p.closed
        && now >= from
        && now < from + long
    {
        p.first_closed.get_or_insert(now);
        let left = (from + long - now).as_secs_f64().ceil();
        return (
            StatusCode::TOO_MANY_REQUESTS,
            [("retry-after", left.to_string())],
        );
    }
    let at = now.duration_since(p.since);
    if let Judged::Afterwards(let_out) = judged {
        match let_out {
            Some(let_out) => p.stamped.push((let_out, at)),
            None => p.unstamped += 1,
        }
        p.total += 1;
        return (StatusCode::OK, [("x-provider", "ok".to_owned())]);
    }
    if !p.bucket.holds(at, 1.0) {
        p.over += 1;
        return (
            StatusCode::TOO_MANY_REQUESTS,
            [("retry-after", "1".to_owned())],
        );
    }
    p.bucket.take(1.0);
    p.total += 1;
    (StatusCode::OK, [("x-provider", "ok".to_owned())])
}

/// A provider that counts by its own headers: a large remaining count, but once, from
/// `spent` on, a count spent until a second later.
async fn counted(State(provider): State<Shared>) -> [(&'static str, &'static str); 2] {
    let mut p = provider.lock().unwrap();
    let now = Instant::now();
    p.arrivals.push(now);
    if p.spent.is_some_and(|from| now >= from) && p.spent_at.is_none() {
        p.spent_at = Some(now);
        return [
            ("x-ratelimit-remaining-requests", "0"),
            ("x-ratelimit-reset-requests", "1s"),
        ];
    }
    [
        ("x-ratelimit-remaining-requests", "100000"),
        ("x-ratelimit-reset-requests", "1s"),
    ]
}

/// A provider that takes every call and notes when the limit let it out (for the tests to
/// judge afterwards) and when it arrived.
async fn stamped(State(provider): State<Shared>, headers: HeaderMap) -> StatusCode {
    let mut p = provider.lock().unwrap();
    let arrived = p.since.elapsed();
    match let_out(&headers) {
        Some(at) => p.stamped.push((at, arrived)),
        None => p.unstamped += 1,
    }
    StatusCode::OK
}

async fn provider(limit: usize) -> (SocketAddr, Shared) {
    let shared = Arc::new(Mutex::new(Provider {
        bucket: Bucket::new(limit as f64),
        since: Instant::now(),
        total: 0,
        over: 0,
        arrivals: Vec::new(),
        closed: None,
        first_closed: None,
        spent: None,
        spent_at: None,
        stamped: Vec::new(),
        unstamped: 0,
    }));
    let app = Router::new()
        .route("/v1/calls", post(call))
        .route("/v1/stamped-calls", post(stamped_call))
        .route("/v1/counted", post(counted))
        .route("/v1/stamped", post(stamped))
        .route(
            "/v1/left",
            post(|| async { ([("ratelimit", r#""calls";r=3;t=60"#)], "done") }),
        )
        .route(
            "/v1/left-late",
            post(|| async {
                // late enough that calls sent together have all been checked
                tokio::time::sleep(Duration::from_millis(300)).await;
                ([("ratelimit", r#""calls";r=3;t=60"#)], "done")
            }),
        )
        .route(
            "/v1/usage",
            post(|| async { ([("x-tokens-used", "37")], "done") }),
        )
        .with_state(Arc::clone(&shared));
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    (addr, shared)
}

/// A copy's client: hyper's, behind the outbound limit (its stamps from now, for the routes
/// that read none).
fn caller(layer: OutboundLimitLayer<Global>) -> Caller {
    crate::let_out::caller(layer, Instant::now())
}

fn outbound(store: impl RateStore, prefix: &str, patience: Duration) -> OutboundLimitLayer<Global> {
    RateLimitLayer::builder(store)
        .prefix(prefix)
        .limit(Limit::per_second("calls", OURS))
        .algorithm(Algorithm::Gcra)
        .queue(patience)
        .build_outbound()
        .unwrap()
}

fn post_to(addr: SocketAddr) -> Request<Full<Bytes>> {
    Request::post(format!("http://{addr}/v1/calls"))
        .body(Full::default())
        .unwrap()
}

/// How long the workers call.
const RUN: Duration = Duration::from_secs(10);

/// The provider's bucket, judged when the limit let each stamped call out, refused none of them
/// (judging on arrival is reported beside it), and every call was stamped.
fn none_over(p: &Provider) {
    let rate = [PROVIDER_LIMIT as f64];
    let on_arrival = refused(p.stamped.iter().map(|&(_, at)| (at, [1.0])), rate);
    assert_eq!(
        refused(p.stamped.iter().map(|&(at, _)| (at, [1.0])), rate),
        [0],
        "calls over the provider's limit when the limit let them out; judged on arrival: \
         {on_arrival:?}"
    );
    assert_eq!(p.unstamped, 0, "calls without a stamp");
}

/// Four copies × sixteen workers calling as fast as they can for ten seconds: the provider's
/// bucket, judging each call when the limit let it out, refuses none (none goes over its
/// limit), and at least 95% of its quota — 100 a second — is let out within the run.
async fn four_copies_stay_under_the_providers_limit<S: RateStore>(make: impl Fn() -> S) {
    let (addr, provider) = provider(PROVIDER_LIMIT).await;
    let prefix = format!("out{:08x}", rand::random::<u32>());
    let mut workers = JoinSet::new();
    // the run starts with the provider's clock, on which the stamps are read
    let start = provider.lock().unwrap().since;
    for _ in 0..COPIES {
        let layer = outbound(make(), &prefix, Duration::from_secs(5));
        let caller = crate::let_out::caller(layer, start);
        for _ in 0..WORKERS {
            let caller = caller.clone();
            workers.spawn(async move {
                let mut errors = Vec::new();
                while start.elapsed() < RUN {
                    let request = Request::post(format!("http://{addr}/v1/stamped"))
                        .body(Full::default())
                        .unwrap();
                    match caller.clone().oneshot(request).await {
                        Ok(StatusCode::OK) => {}
                        Ok(status) => errors.push(status.to_string()),
                        Err(error) => errors.push(error),
                    }
                }
                errors
            });
        }
    }
    let errors: Vec<String> = workers.join_all().await.into_iter().flatten().collect();
    let p = provider.lock().unwrap();
    assert!(errors.is_empty(), "{errors:?}");
    none_over(&p);
    // the calls the limit let out within the run (the last ones waited past its end)
    let within = p.stamped.iter().filter(|(at, _)| *at < RUN).count();
    let quota = PROVIDER_LIMIT * RUN.as_secs() as usize;
    assert!(within * 100 >= quota * 95, "{within} of {quota} used");
}

/// Halfway through, the provider stops taking calls for two seconds, answering `429` with the
/// time left as `Retry-After`. The copy that gets the first writes the pause in the store, and
/// every copy reads it before its next call: after the first `429`, the provider sees no call
/// until the two seconds have passed (but those already on their way, within a round trip);
/// then the calls go on.
async fn a_providers_429_pauses_every_copy<S: RateStore + LockStore + Clone>(make: impl Fn() -> S) {
    let (addr, provider) = provider(PROVIDER_LIMIT).await;
    let start = Instant::now();
    let closed = Duration::from_secs(2);
    provider.lock().unwrap().closed = Some((start + Duration::from_secs(2), closed));
    let prefix = format!("paused{:08x}", rand::random::<u32>());
    let run = Duration::from_secs(6);
    let mut workers = JoinSet::new();
    for _ in 0..COPIES {
        let store = make();
        let layer = outbound(store.clone(), &prefix, Duration::from_secs(5)).share_pauses(store);
        let caller = caller(layer);
        for _ in 0..WORKERS {
            let caller = caller.clone();
            workers.spawn(async move {
                let mut errors = Vec::new();
                while start.elapsed() < run {
                    match caller.clone().oneshot(post_to(addr)).await {
                        Ok(StatusCode::OK | StatusCode::TOO_MANY_REQUESTS) => {}
                        Ok(status) => errors.push(status.to_string()),
                        Err(error) => errors.push(error),
                    }
                }
                errors
            });
        }
    }
    let errors: Vec<String> = workers.join_all().await.into_iter().flatten().collect();
    assert!(errors.is_empty(), "{errors:?}");
    let p = provider.lock().unwrap();
    let first = p.first_closed.expect("the provider refused a call");
    // calls decided before the pause reached the store may still arrive: a few round trips'
    // worth on a busy machine
    let in_flight = Duration::from_millis(200);
    let during: Vec<_> = p
        .arrivals
        .iter()
        .filter(|at| **at >= first + in_flight && **at < first + closed)
        .map(|at| at.duration_since(first))
        .collect();
    assert!(
        during.is_empty(),
        "calls during the pause, after the first 429: {during:?}"
    );
    let after = p
        .arrivals
        .iter()
        .filter(|at| **at >= first + closed)
        .count();
    assert!(after >= 100, "the calls went on after the pause: {after}");
}

/// Through `reqwest-middleware`: two copies of eight workers, each copy a
/// `ClientWithMiddleware` with the outbound limit, the pauses shared; the provider stops taking
/// calls for a second halfway. Its bucket, judged when the limit let each call out (a stamp
/// added right after the limit's middleware), refuses none; it sees no call during its pause (but
/// those on their way), and takes calls again after it.
async fn reqwest_clients_share_the_quota_and_the_pause<S: RateStore + LockStore + Clone>(
    make: impl Fn() -> S,
) {
    let (addr, provider) = provider(PROVIDER_LIMIT).await;
    // the run starts with the provider's clock, on which the stamps are read
    let start = provider.lock().unwrap().since;
    let closed = Duration::from_secs(1);
    provider.lock().unwrap().closed = Some((start + Duration::from_millis(1_500), closed));
    let prefix = format!("reqwest{:08x}", rand::random::<u32>());
    let run = Duration::from_secs(4);
    let mut workers = JoinSet::new();
    for _ in 0..2 {
        let store = make();
        let layer = outbound(store.clone(), &prefix, Duration::from_secs(5)).share_pauses(store);
        let client = reqwest_middleware::ClientBuilder::new(reqwest::Client::new())
            .with(layer)
            .with(Stamp { start })
            .build();
        for _ in 0..8 {
            let client = client.clone();
            workers.spawn(async move {
                let mut errors = Vec::new();
                while start.elapsed() < run {
                    let url = format!("http://{addr}/v1/stamped-calls");
                    match client.post(url).send().await {
                        Ok(response) if response.status().is_success() => {}
                        Ok(response) if response.status() == StatusCode::TOO_MANY_REQUESTS => {}
                        Ok(response) => errors.push(response.status().to_string()),
                        Err(error) => errors.push(error.to_string()),
                    }
                }
                errors
            });
        }
    }
    let errors: Vec<String> = workers.join_all().await.into_iter().flatten().collect();
    assert!(errors.is_empty(), "{errors:?}");
    let p = provider.lock().unwrap();
    none_over(&p);
    let first = p.first_closed.expect("the provider refused a call");
    let in_flight = Duration::from_millis(200);
    let during = p
        .arrivals
        .iter()
        .filter(|at| **at >= first + in_flight && **at < first + closed)
        .count();
    assert_eq!(during, 0, "calls during the pause, after the first 429");
    let after = p
        .arrivals
        .iter()
        .filter(|at| **at >= first + closed)
        .count();
    assert!(after >= 50, "the calls went on after the pause: {after}");
}

/// A provider that answers `429` with `Retry-After: 1` pauses the copy that got it: its next
/// call waits until the second has passed; and a call cancelled while it waits leaves its place.
async fn a_providers_429_pauses_the_copy<S: RateStore>(store: S) {
    // the provider allows 2 a second; the copy thinks it may make 50
    let (addr, provider) = provider(2).await;
    let prefix = format!("pause{:08x}", rand::random::<u32>());
    let layer = RateLimitLayer::builder(store)
        .prefix(&prefix)
        .limit(Limit::per_second("calls", 50))
        .queue(Duration::from_secs(5))
        .build_outbound()
        .unwrap();
    let caller = caller(layer);
    for _ in 0..2 {
        assert_eq!(
            caller.clone().oneshot(post_to(addr)).await,
            Ok(StatusCode::OK)
        );
    }
    let refused_at = Instant::now();
    assert_eq!(
        caller.clone().oneshot(post_to(addr)).await,
        Ok(StatusCode::TOO_MANY_REQUESTS)
    );
    // paused: the next call reaches the provider only once its second has passed
    assert_eq!(
        caller.clone().oneshot(post_to(addr)).await,
        Ok(StatusCode::OK)
    );
    let arrivals = provider.lock().unwrap().arrivals.clone();
    assert_eq!(arrivals.len(), 4);
    let after = arrivals[3].duration_since(refused_at);
    assert!(
        after >= Duration::from_millis(950),
        "called again after {after:?}"
    );
}

/// A call reserves its estimate and is settled on the usage the provider's answer reports —
/// through hyper's client and through `reqwest-middleware` alike.
async fn the_providers_usage_settles_the_reservation<S: RateStore>(store: S) {
    let (addr, _provider) = provider(1_000).await;
    let layer = RateLimitLayer::builder(store)
        .prefix(format!("usage{:08x}", rand::random::<u32>()))
        .limit(Limit::per_hour("tokens", 1_000))
        .cost(|_| 100)
        .settle(|answer| {
            let used = answer.headers.get("x-tokens-used")?;
            used.to_str().ok()?.parse().ok()
        })
        .build_outbound()
        .unwrap();
    let usage = || {
        Request::post(format!("http://{addr}/v1/usage"))
            .body(Full::default())
            .unwrap()
    };
    let hyper = caller(layer.clone());
    assert_eq!(hyper.oneshot(usage()).await, Ok(StatusCode::OK));
    let reqwest = reqwest_middleware::ClientBuilder::new(reqwest::Client::new())
        .with(layer.clone())
        .build();
    let answer = reqwest.post(format!("http://{addr}/v1/usage")).send().await;
    assert_eq!(answer.unwrap().status(), StatusCode::OK);
    let (parts, ()) = Request::new(()).into_parts();
    let key = layer.rate_limit().key_of(&parts).unwrap();
    let left = layer.rate_limit().peek(key).await.unwrap().limits[0].remaining;
    assert_eq!(
        left,
        1_000 - 2 * 37,
        "charged what the provider reported, not the estimate"
    );
}

/// A line of one: a call waiting for room that is cancelled gives its place to the next.
async fn a_cancelled_wait_frees_its_place<S: RateStore>(store: S) {
    let (addr, _provider) = provider(1_000).await;
    let layer = RateLimitLayer::builder(store)
        .prefix(format!("cancel{:08x}", rand::random::<u32>()))
        .limit(Limit::new("calls", 1, Duration::from_millis(500)))
        .queue(Duration::from_secs(5))
        .max_waiting(1)
        .build_outbound()
        .unwrap();
    let caller = caller(layer);
    assert_eq!(
        caller.clone().oneshot(post_to(addr)).await,
        Ok(StatusCode::OK)
    );
    let waiting = tokio::spawn(caller.clone().oneshot(post_to(addr)));
    tokio::time::sleep(Duration::from_millis(50)).await;
    // the line is full: refused at once
    let full = caller.clone().oneshot(post_to(addr)).await;
    assert!(
        full.as_ref().is_err_and(|e| e.starts_with("limited")),
        "{full:?}"
    );
    waiting.abort();
    tokio::time::sleep(Duration::from_millis(50)).await;
    // its place is free: this one waits, and is made once room comes
    let started = Instant::now();
    assert_eq!(
        caller.clone().oneshot(post_to(addr)).await,
        Ok(StatusCode::OK)
    );
    assert!(started.elapsed() >= Duration::from_millis(300));
}

/// Halfway through, the provider's answer (a `200`) says its count is spent —
/// `x-ratelimit-remaining-requests: 0`, reset in `1s` — once. The copy that reads it writes the
/// pause in the store, and every copy reads it before its next call: for that second the
/// provider sees no call (but those already on their way); then the calls go on.
async fn a_spent_count_pauses_every_copy<S: RateStore + LockStore + Clone>(make: impl Fn() -> S) {
    let (addr, provider) = provider(PROVIDER_LIMIT).await;
    let start = Instant::now();
    provider.lock().unwrap().spent = Some(start + Duration::from_secs(1));
    let prefix = format!("spent{:08x}", rand::random::<u32>());
    let run = Duration::from_secs(3);
    let counted = move || {
        Request::post(format!("http://{addr}/v1/counted"))
            .body(Full::default())
            .unwrap()
    };
    let mut workers = JoinSet::new();
    for _ in 0..COPIES {
        let store = make();
        let layer = outbound(store.clone(), &prefix, Duration::from_secs(5)).share_pauses(store);
        let caller = caller(layer);
        for _ in 0..4 {
            let caller = caller.clone();
            workers.spawn(async move {
                let mut errors = Vec::new();
                while start.elapsed() < run {
                    match caller.clone().oneshot(counted()).await {
                        Ok(StatusCode::OK) => {}
                        Ok(status) => errors.push(status.to_string()),
                        Err(error) => errors.push(error),
                    }
                }
                errors
            });
        }
    }
    let errors: Vec<String> = workers.join_all().await.into_iter().flatten().collect();
    assert!(errors.is_empty(), "{errors:?}");
    let p = provider.lock().unwrap();
    let spent = p.spent_at.expect("the provider reported its count spent");
    let in_flight = Duration::from_millis(200);
    let reset = Duration::from_secs(1);
    let during: Vec<_> = p
        .arrivals
        .iter()
        .filter(|at| **at >= spent + in_flight && **at < spent + reset)
        .map(|at| at.duration_since(spent))
        .collect();
    assert!(
        during.is_empty(),
        "calls while the provider's count was spent: {during:?}"
    );
    let before = p.arrivals.iter().filter(|at| **at < spent).count();
    let after = p.arrivals.iter().filter(|at| **at >= spent + reset).count();
    assert!(before >= 50, "the calls went before: {before}");
    assert!(after >= 50, "the calls went on after the reset: {after}");
}

/// The provider says 3 calls are left (`RateLimit: "calls";r=3;t=60`) where the store counts
/// 9 after the first of 10 a minute: the store's count is brought down to 3, as every copy sees
/// it, once (not again on the next call, which the store counts lower than the provider);
/// with the provider's counts off, nothing is corrected.
async fn a_lower_remaining_count_corrects_the_shared_count<S: RateStore>(make: impl Fn() -> S) {
    let (addr, _provider) = provider(1_000).await;
    let prefix = format!("left{:08x}", rand::random::<u32>());
    let layer = || {
        RateLimitLayer::builder(make())
            .prefix(&prefix)
            .limit(Limit::per_minute("calls", 10))
            .build_outbound()
            .unwrap()
    };
    let (this, other) = (layer(), layer());
    let left = move || {
        Request::post(format!("http://{addr}/v1/left"))
            .body(Full::default())
            .unwrap()
    };
    let (parts, ()) = Request::new(()).into_parts();
    let key = other.rate_limit().key_of(&parts).unwrap();
    let remaining = async |layer: &OutboundLimitLayer<Global>| {
        layer.rate_limit().peek(key).await.unwrap().limits[0].remaining
    };
    let caller = caller(this.clone());
    assert_eq!(caller.clone().oneshot(left()).await, Ok(StatusCode::OK));
    let deadline = Instant::now() + Duration::from_secs(2);
    while remaining(&other).await != 3 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(
        remaining(&other).await,
        3,
        "the provider's count, on every copy"
    );
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(remaining(&this).await, 3, "corrected once");
    // the store now counts 2 left, fewer than the provider's 3: nothing to correct
    assert_eq!(caller.oneshot(left()).await, Ok(StatusCode::OK));
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(remaining(&other).await, 2);

    let off = RateLimitLayer::builder(make())
        .prefix(format!("{prefix}off"))
        .limit(Limit::per_minute("calls", 10))
        .build_outbound()
        .unwrap()
        .provider_counts(ProviderCounts::off());
    assert_eq!(caller_of(&off).oneshot(left()).await, Ok(StatusCode::OK));
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(
        remaining(&off).await,
        9,
        "the provider's counts are not read"
    );

    // through reqwest-middleware alike
    let through_reqwest = RateLimitLayer::builder(make())
        .prefix(format!("{prefix}reqwest"))
        .limit(Limit::per_minute("calls", 10))
        .build_outbound()
        .unwrap();
    let client = reqwest_middleware::ClientBuilder::new(reqwest::Client::new())
        .with(through_reqwest.clone())
        .build();
    let answer = client.post(format!("http://{addr}/v1/left")).send().await;
    assert_eq!(answer.unwrap().status(), StatusCode::OK);
    let deadline = Instant::now() + Duration::from_secs(2);
    while remaining(&through_reqwest).await != 3 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(
        remaining(&through_reqwest).await,
        3,
        "corrected through reqwest"
    );

    // a tier with a limit that counts calls: the provider's count is of another unit than the
    // tokens', and no settlement changes the calls: nothing is corrected
    let mixed = RateLimitLayer::builder(make())
        .prefix(format!("{prefix}mixed"))
        .limit(Limit::per_minute("calls", 10).counting_calls())
        .limit(Limit::per_minute("tokens", 1_000))
        .cost(|_| 50)
        .build_outbound()
        .unwrap();
    assert_eq!(caller_of(&mixed).oneshot(left()).await, Ok(StatusCode::OK));
    tokio::time::sleep(Duration::from_millis(100)).await;
    let states = mixed.rate_limit().peek(key).await.unwrap().limits;
    assert_eq!(
        (states[0].remaining, states[1].remaining),
        (9, 950),
        "not corrected"
    );
}

/// Four copies that share their pauses get the provider's `r=3` on calls made together, where
/// the store counts 6 left: the copies take turns in the store to correct, each reading the
/// count after the one before, so the count is brought to 3 once — not charged the difference
/// by every copy.
async fn copies_correct_together_once<S: RateStore + LockStore + Clone>(make: impl Fn() -> S) {
    let (addr, _provider) = provider(1_000).await;
    let prefix = format!("together{:08x}", rand::random::<u32>());
    let layers: Vec<_> = (0..COPIES)
        .map(|_| {
            let store = make();
            RateLimitLayer::builder(store.clone())
                .prefix(&prefix)
                .limit(Limit::per_minute("calls", 10))
                .build_outbound()
                .unwrap()
                .share_pauses(store)
        })
        .collect();
    let left = || {
        Request::post(format!("http://{addr}/v1/left-late"))
            .body(Full::default())
            .unwrap()
    };
    let calls = layers.iter().map(|layer| caller_of(layer).oneshot(left()));
    let answers = futures_util::future::join_all(calls).await;
    assert!(
        answers.iter().all(|a| *a == Ok(StatusCode::OK)),
        "{answers:?}"
    );
    let (parts, ()) = Request::new(()).into_parts();
    let layer = &layers[0];
    let key = layer.rate_limit().key_of(&parts).unwrap();
    let remaining = async || layer.rate_limit().peek(key).await.unwrap().limits[0].remaining;
    let deadline = Instant::now() + Duration::from_secs(2);
    while remaining().await != 3 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(
        remaining().await,
        3,
        "corrected to the provider's count, once"
    );
}

fn caller_of(layer: &OutboundLimitLayer<Global>) -> Caller {
    caller(layer.clone())
}

/// Waiting out the store: a call made while `redis-server` is down waits, asking again, and is
/// made once the server is back within its patience; past its patience it fails with
/// `StoreUnavailable`, never made. (The failure policy, `Allow` by default, would have made
/// both at once.)
async fn a_call_waits_out_the_store(server: &mut crate::common::RedisServer) {
    let (addr, provider) = provider(1_000).await;
    let store = tollgate::store::RedisStore::builder(server.url())
        .timeout(Duration::from_millis(300))
        .build()
        .unwrap();
    let layer = RateLimitLayer::builder(store)
        .prefix(format!("down{:08x}", rand::random::<u32>()))
        .limit(Limit::per_second("calls", 100))
        .queue(Duration::from_secs(4))
        .build_outbound()
        .unwrap()
        .wait_for_store();
    let client: Client<HttpConnector, Full<Bytes>> =
        Client::builder(TokioExecutor::new()).build_http();
    let limited = ServiceBuilder::new().layer(layer).service(client);
    let status = |answer: Result<http::Response<_>, OutboundError<_>>| match answer {
        Ok(response) => Ok(response.status()),
        Err(OutboundError::StoreUnavailable) => Err("store unavailable".to_owned()),
        Err(other) => Err(other.to_string()),
    };
    assert_eq!(
        status(limited.clone().oneshot(post_to(addr)).await),
        Ok(StatusCode::OK)
    );

    server.kill();
    let waiting = tokio::spawn(limited.clone().oneshot(post_to(addr)));
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(
        provider.lock().unwrap().arrivals.len(),
        1,
        "no call while the store is down"
    );
    let back = Instant::now();
    tokio::task::block_in_place(|| server.restart());
    assert_eq!(status(waiting.await.unwrap()), Ok(StatusCode::OK));
    let arrivals = provider.lock().unwrap().arrivals.clone();
    assert_eq!(arrivals.len(), 2);
    assert!(arrivals[1] >= back, "made once the store was back");

    tokio::task::block_in_place(|| server.kill());
    let called = Instant::now();
    // two: the first of the line asks the store, the second waits behind it
    let (first, second) = tokio::join!(
        limited.clone().oneshot(post_to(addr)),
        limited.oneshot(post_to(addr))
    );
    let waited = called.elapsed();
    assert_eq!(status(first), Err("store unavailable".to_owned()));
    assert_eq!(status(second), Err("store unavailable".to_owned()));
    assert!(
        waited >= Duration::from_secs(4),
        "waited its patience: {waited:?}"
    );
    assert!(
        waited < Duration::from_secs(6),
        "and not much more: {waited:?}"
    );
    assert_eq!(provider.lock().unwrap().arrivals.len(), 2, "never made");
}

mod on_memory {
    use tollgate::store::MemoryStore;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn copies_correct_together_once() {
        let store = MemoryStore::new();
        super::copies_correct_together_once(|| store.clone()).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_spent_count_pauses_every_copy() {
        let store = MemoryStore::new();
        super::a_spent_count_pauses_every_copy(|| store.clone()).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_lower_remaining_count_corrects_the_shared_count() {
        let store = MemoryStore::new();
        super::a_lower_remaining_count_corrects_the_shared_count(|| store.clone()).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_providers_usage_settles_the_reservation() {
        super::the_providers_usage_settles_the_reservation(MemoryStore::new()).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn reqwest_clients_share_the_quota_and_the_pause() {
        let store = MemoryStore::new();
        super::reqwest_clients_share_the_quota_and_the_pause(|| store.clone()).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn four_copies_stay_under_the_providers_limit() {
        let store = MemoryStore::new();
        super::four_copies_stay_under_the_providers_limit(|| store.clone()).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_providers_429_pauses_the_copy() {
        super::a_providers_429_pauses_the_copy(MemoryStore::new()).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_providers_429_pauses_every_copy() {
        let store = MemoryStore::new();
        super::a_providers_429_pauses_every_copy(|| store.clone()).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_cancelled_wait_frees_its_place() {
        super::a_cancelled_wait_frees_its_place(MemoryStore::new()).await;
    }
}

mod on_redis {
    use crate::common::RedisServer;
    use crate::rate_limit_invalidations::redis_store;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn copies_correct_together_once() {
        let server = RedisServer::start();
        super::copies_correct_together_once(|| redis_store(&server)).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_spent_count_pauses_every_copy() {
        let server = RedisServer::start();
        super::a_spent_count_pauses_every_copy(|| redis_store(&server)).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_lower_remaining_count_corrects_the_shared_count() {
        let server = RedisServer::start();
        super::a_lower_remaining_count_corrects_the_shared_count(|| redis_store(&server)).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_call_waits_out_the_store() {
        let mut server = RedisServer::start();
        super::a_call_waits_out_the_store(&mut server).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_providers_usage_settles_the_reservation() {
        let server = RedisServer::start();
        super::the_providers_usage_settles_the_reservation(redis_store(&server)).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn reqwest_clients_share_the_quota_and_the_pause() {
        let server = RedisServer::start();
        super::reqwest_clients_share_the_quota_and_the_pause(|| redis_store(&server)).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn four_copies_stay_under_the_providers_limit() {
        let server = RedisServer::start();
        super::four_copies_stay_under_the_providers_limit(|| redis_store(&server)).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_providers_429_pauses_the_copy() {
        let server = RedisServer::start();
        super::a_providers_429_pauses_the_copy(redis_store(&server)).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_providers_429_pauses_every_copy() {
        let server = RedisServer::start();
        super::a_providers_429_pauses_every_copy(|| redis_store(&server)).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_cancelled_wait_frees_its_place() {
        let server = RedisServer::start();
        super::a_cancelled_wait_frees_its_place(redis_store(&server)).await;
    }
}

mod on_postgres {
    use crate::common::postgres;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn copies_correct_together_once() {
        let store = postgres::store().await;
        super::copies_correct_together_once(|| store.clone()).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_spent_count_pauses_every_copy() {
        let store = postgres::store().await;
        super::a_spent_count_pauses_every_copy(|| store.clone()).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_lower_remaining_count_corrects_the_shared_count() {
        let store = postgres::store().await;
        super::a_lower_remaining_count_corrects_the_shared_count(|| store.clone()).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_providers_usage_settles_the_reservation() {
        super::the_providers_usage_settles_the_reservation(postgres::store().await).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn reqwest_clients_share_the_quota_and_the_pause() {
        let store = postgres::store().await;
        super::reqwest_clients_share_the_quota_and_the_pause(|| store.clone()).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn four_copies_stay_under_the_providers_limit() {
        let store = postgres::store().await;
        super::four_copies_stay_under_the_providers_limit(|| store.clone()).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_providers_429_pauses_the_copy() {
        super::a_providers_429_pauses_the_copy(postgres::store().await).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_providers_429_pauses_every_copy() {
        let store = postgres::store().await;
        super::a_providers_429_pauses_every_copy(|| store.clone()).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_cancelled_wait_frees_its_place() {
        super::a_cancelled_wait_frees_its_place(postgres::store().await).await;
    }
}
