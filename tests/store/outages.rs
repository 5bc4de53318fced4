//! Outages: Redis killed under load and restarted, connections cut by a proxy, Redis slowed
//! down, PostgreSQL stopped under load and restarted. In each: no panic, no request hangs past
//! the store timeout, each layer's failure policy holds, no handler runs twice, and service
//! resumes by itself once the store is back.
#![allow(clippy::unwrap_used, clippy::expect_used)]
use crate::common;

use std::convert::Infallible;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use common::RedisServer;
use common::postgres::PgServer;
use common::proxy::Proxy;
use http::{Request, Response, StatusCode};
use http_body_util::Full;
use tollgate::claim::Claims;
use tollgate::idempotency::IdempotencyLayer;
use tollgate::key::Header;
use tollgate::lock::{LockError, Locks};
use tollgate::rate_limit::{
    DecisionSource, Limit, OnStoreError, RateLimitDecision, RateLimitLayer,
};
use tollgate::store::{PgStore, RateStore, RedisStore};
use tower::{ServiceBuilder, ServiceExt};

const TIMEOUT: Duration = Duration::from_millis(300);
/// A request may take the store timeout plus scheduling slack on a busy 2-core machine.
const BOUND: Duration = Duration::from_millis(1500);

fn store(url: String) -> RedisStore {
    RedisStore::builder(url).timeout(TIMEOUT).build().unwrap()
}

fn rate_limited(
    store: impl RateStore,
    policy: OnStoreError,
    quota: u64,
) -> impl tower::Service<
    Request<Full<bytes::Bytes>>,
    Response = Response<tollgate::rate_limit::ResponseBody<Full<bytes::Bytes>>>,
    Error = Infallible,
    Future: Send,
> + Clone
+ Send {
    let layer = RateLimitLayer::builder(store)
        .limit(Limit::per_minute("m", quota))
        .key(Header::from_static("x-caller"))
        .on_store_error(policy)
        .deny_cache(false)
        .prefix(format!("o{}", rand::random::<u32>()))
        .build()
        .unwrap();
    ServiceBuilder::new().layer(layer).service_fn(|_req| async {
        Ok::<_, Infallible>(Response::new(Full::new(bytes::Bytes::from_static(b"ok"))))
    })
}

fn get(caller: &str) -> Request<Full<bytes::Bytes>> {
    Request::get("/")
        .header("x-caller", caller)
        .body(Full::default())
        .unwrap()
}

/// Sends `get(caller)` and returns (status, decision source, time taken).
async fn timed<S>(svc: &S, caller: &str) -> Timed
where
    S: tower::Service<
            Request<Full<bytes::Bytes>>,
            Response = Response<tollgate::rate_limit::ResponseBody<Full<bytes::Bytes>>>,
            Error = Infallible,
        > + Clone,
{
    let start = Instant::now();
    let res = svc.clone().oneshot(get(caller)).await.unwrap();
    let source = res
        .extensions()
        .get::<RateLimitDecision>()
        .map(|d| d.source());
    (res.status(), source, start.elapsed())
}

/// Polls until a request is decided by the store again; returns how long that took.
async fn recovery<S>(svc: &S) -> Duration
where
    S: tower::Service<
            Request<Full<bytes::Bytes>>,
            Response = Response<tollgate::rate_limit::ResponseBody<Full<bytes::Bytes>>>,
            Error = Infallible,
        > + Clone,
{
    let start = Instant::now();
    loop {
        let (_, source, _) = timed(svc, &format!("probe-{}", rand::random::<u32>())).await;
        if source == Some(DecisionSource::Store) {
            return start.elapsed();
        }
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "no recovery within 10 s"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A request's status, decision source and time taken.
type Timed = (StatusCode, Option<DecisionSource>, Duration);

/// A worker of [`under_load`]: what each of its requests got.
type Worker = tokio::task::JoinHandle<Vec<Timed>>;

/// `workers` tasks sending checks through `svc` until `stop`, each as a caller of its own.
fn under_load<S>(svc: &S, workers: usize, stop: &Arc<std::sync::atomic::AtomicBool>) -> Vec<Worker>
where
    S: tower::Service<
            Request<Full<bytes::Bytes>>,
            Response = Response<tollgate::rate_limit::ResponseBody<Full<bytes::Bytes>>>,
            Error = Infallible,
            Future: Send,
        > + Clone
        + Send
        + Sync
        + 'static,
{
    (0..workers)
        .map(|w| {
            let (svc, stop) = (svc.clone(), Arc::clone(stop));
            tokio::spawn(async move {
                let mut seen = Vec::new();
                while !stop.load(Ordering::SeqCst) {
                    seen.push(timed(&svc, &format!("worker-{w}")).await);
                }
                seen
            })
        })
        .collect()
}

/// Joins the workers of [`under_load`] and checks that, with the Allow policy, every request
/// went through within the bound and the outage was seen.
async fn allowed_through_the_outage(workers: Vec<Worker>) {
    let mut all = Vec::new();
    for w in workers {
        all.extend(w.await.expect("no worker panicked"));
    }
    assert!(
        all.iter().all(|(status, _, _)| *status == StatusCode::OK),
        "Allow admits"
    );
    let slowest = all.iter().map(|(_, _, t)| *t).max().unwrap();
    assert!(slowest < BOUND, "a request took {slowest:?}");
    let unavailable = all
        .iter()
        .filter(|(_, s, _)| *s == Some(DecisionSource::StoreUnavailable))
        .count();
    assert!(unavailable > 0, "the outage was seen");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_killed_under_load_and_restarted() {
    let mut server = RedisServer::start();
    let svc = rate_limited(store(server.url()), OnStoreError::Allow, 100_000);
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let workers = under_load(&svc, 8, &stop);
    tokio::time::sleep(Duration::from_millis(400)).await;
    server.kill();
    tokio::time::sleep(Duration::from_millis(800)).await;
    server.restart();
    let recovered = recovery(&svc).await;
    println!("rate limit recovered {recovered:?} after the restart");
    tokio::time::sleep(Duration::from_millis(200)).await;
    stop.store(true, Ordering::SeqCst);
    allowed_through_the_outage(workers).await;
    assert!(
        recovered < Duration::from_secs(5),
        "recovered in {recovered:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_policy_holds_while_redis_is_down() {
    let mut server = RedisServer::start();
    let allow = rate_limited(store(server.url()), OnStoreError::Allow, 2);
    let deny = rate_limited(store(server.url()), OnStoreError::Deny, 2);
    let fallback = rate_limited(
        store(server.url()),
        OnStoreError::LocalFallback { copies: 2 },
        10,
    );
    server.kill();
    for _ in 0..5 {
        let (status, source, took) = timed(&allow, "a").await;
        assert_eq!(
            (status, source),
            (StatusCode::OK, Some(DecisionSource::StoreUnavailable))
        );
        assert!(took < BOUND);
        let (status, _, took) = timed(&deny, "a").await;
        assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
        assert!(took < BOUND);
    }
    let mut admitted = 0;
    for _ in 0..12 {
        let (status, source, took) = timed(&fallback, "a").await;
        assert_eq!(source, Some(DecisionSource::LocalFallback));
        assert!(took < BOUND);
        admitted += usize::from(status == StatusCode::OK);
    }
    assert_eq!(admitted, 5, "10 per minute shared by 2 copies");
    server.restart();
    assert!(recovery(&deny).await < Duration::from_secs(5));
    assert!(recovery(&fallback).await < Duration::from_secs(5));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_cut_and_healed() {
    let server = RedisServer::start();
    let proxy = Proxy::start(server.addr()).await;
    let svc = rate_limited(store(proxy.url()), OnStoreError::Deny, 100_000);
    assert_eq!(timed(&svc, "a").await.0, StatusCode::OK);
    proxy.cut();
    for _ in 0..5 {
        let (status, _, took) = timed(&svc, "a").await;
        assert_eq!(
            status,
            StatusCode::SERVICE_UNAVAILABLE,
            "Deny while cut off"
        );
        assert!(took < BOUND, "took {took:?}");
    }
    proxy.heal();
    let recovered = recovery(&svc).await;
    println!("recovered {recovered:?} after the network healed");
    assert!(recovered < Duration::from_secs(5));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_redis_never_holds_a_request_past_the_timeout() {
    let server = RedisServer::start();
    let proxy = Proxy::start(server.addr()).await;
    let svc = rate_limited(store(proxy.url()), OnStoreError::Allow, 100_000);
    assert_eq!(timed(&svc, "a").await.1, Some(DecisionSource::Store));
    proxy.delay(Duration::from_secs(2));
    for _ in 0..3 {
        let (status, source, took) = timed(&svc, "a").await;
        assert_eq!(
            (status, source),
            (StatusCode::OK, Some(DecisionSource::StoreUnavailable))
        );
        assert!(took < BOUND, "took {took:?}");
    }
    proxy.delay(Duration::ZERO);
    assert!(recovery(&svc).await < Duration::from_secs(5));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idempotency_fails_closed_and_never_runs_twice() {
    let mut server = RedisServer::start();
    let runs = Arc::new(AtomicUsize::new(0));
    let counter = runs.clone();
    let svc = ServiceBuilder::new()
        .layer(
            IdempotencyLayer::builder(store(server.url()))
                .unscoped()
                .required(true)
                .build()
                .unwrap(),
        )
        .service_fn(move |_req: Request<_>| {
            let n = counter.fetch_add(1, Ordering::SeqCst);
            async move {
                Ok::<_, Infallible>(Response::new(Full::new(bytes::Bytes::from(format!(
                    "run {n}"
                )))))
            }
        });
    let pay = |key: &str| {
        Request::post("/pay")
            .header("idempotency-key", key)
            .body(Full::new(bytes::Bytes::from_static(b"{}")))
            .unwrap()
    };
    server.kill();
    for i in 0..5 {
        let start = Instant::now();
        let res = svc.clone().oneshot(pay(&format!("k{i}"))).await.unwrap();
        assert_eq!(res.status(), StatusCode::SERVICE_UNAVAILABLE);
        assert!(res.headers().contains_key("retry-after"));
        assert!(start.elapsed() < BOUND);
    }
    assert_eq!(runs.load(Ordering::SeqCst), 0, "fail closed: nothing ran");
    server.restart();
    let start = Instant::now();
    loop {
        let res = svc.clone().oneshot(pay("k0")).await.unwrap();
        if res.status() == StatusCode::OK {
            http_body_util::BodyExt::collect(res.into_body())
                .await
                .unwrap();
            break;
        }
        assert_eq!(res.status(), StatusCode::SERVICE_UNAVAILABLE);
        assert!(start.elapsed() < Duration::from_secs(10), "no recovery");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    for i in 0..5 {
        let res = svc.clone().oneshot(pay(&format!("k{i}"))).await.unwrap();
        assert_eq!(res.status(), StatusCode::OK);
        // the end of the body comes once the response is recorded
        http_body_util::BodyExt::collect(res.into_body())
            .await
            .unwrap();
    }
    let replay = svc.clone().oneshot(pay("k0")).await.unwrap();
    assert_eq!(replay.headers()["idempotent-replayed"], "true");
    assert_eq!(runs.load(Ordering::SeqCst), 5, "each key ran exactly once");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claims_and_locks_fail_closed() {
    let mut server = RedisServer::start();
    let claims = Claims::new(store(server.url()));
    let locks = Locks::new(store(server.url()));
    assert!(claims.claim_once("warm-up", None).await.unwrap().won());
    server.kill();
    let start = Instant::now();
    assert!(
        claims.claim_once("coupon", None).await.is_err(),
        "no claim is reported won"
    );
    assert!(matches!(
        locks.try_acquire("report", Duration::from_secs(5)).await,
        Err(LockError::Store(_))
    ));
    assert!(start.elapsed() < 2 * BOUND);
    server.restart();
    let start = Instant::now();
    let won = loop {
        if let Ok(claim) = claims.claim_once("coupon", None).await {
            break claim;
        }
        assert!(start.elapsed() < Duration::from_secs(10), "no recovery");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert!(won.won());
    assert!(!claims.claim_once("coupon", None).await.unwrap().won());
    locks
        .try_acquire("report", Duration::from_secs(5))
        .await
        .unwrap()
        .release()
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flood_costs_a_handful_of_store_calls() {
    let server = RedisServer::start();
    let copies: Vec<_> = (0..2)
        .map(|_| {
            let layer = RateLimitLayer::builder(store(server.url()))
                .limit(Limit::per_minute("m", 10))
                .key(Header::from_static("x-caller"))
                .build()
                .unwrap();
            ServiceBuilder::new().layer(layer).service_fn(
                |_req: Request<Full<bytes::Bytes>>| async {
                    Ok::<_, Infallible>(Response::new(Full::new(bytes::Bytes::new())))
                },
            )
        })
        .collect();
    // load the script first: concurrent first calls would each find it missing and load it
    for svc in &copies {
        let res = svc.clone().oneshot(get("warm-up")).await.unwrap();
        assert_eq!(res.status(), StatusCode::OK);
    }
    redis::cmd("CONFIG")
        .arg("RESETSTAT")
        .query::<()>(&mut server.conn())
        .unwrap();
    // 1000 requests per copy, 4 in flight each: 100x the limit
    let floods = copies.iter().map(|svc| {
        let svc = svc.clone();
        async move {
            let mut admitted = 0;
            for _ in 0..250 {
                let batch = (0..4).map(|_| svc.clone().oneshot(get("flooder")));
                for res in futures_util::future::join_all(batch).await {
                    admitted += usize::from(res.unwrap().status() == StatusCode::OK);
                }
            }
            admitted
        }
    });
    let admitted: usize = futures_util::future::join_all(floods)
        .await
        .into_iter()
        .sum();
    assert_eq!(admitted, 10, "exactly the limit");
    let calls = server.lua_calls();
    // 10 admissions, then per copy the denials in flight when the first came back
    assert!(calls <= 10 + 2 * 5, "{calls} store calls for 2000 requests");
    // other callers are unaffected
    let res = copies[0].clone().oneshot(get("bystander")).await.unwrap();
    assert_eq!(res.status(), StatusCode::OK);
}

/// A store on `server` with the outage tests' timeout, migrated.
async fn pg_store(server: &PgServer) -> PgStore {
    server
        .builder()
        .timeout(TIMEOUT)
        .connect()
        .await
        .expect("a migrated store")
}

/// PostgreSQL stopped (fast shutdown: every connection dropped) under load and restarted: rate
/// checks never exceed the bound and are let through (Allow) while it is down, payments either
/// ran or answered 503 and each key runs exactly once in the end, a coupon is never reported won
/// while the database is down and is won exactly once after — and all of it recovers by itself.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_stopped_under_load_and_restarted() {
    let mut server = tokio::task::spawn_blocking(PgServer::start).await.unwrap();
    let store = pg_store(&server).await;
    let svc = rate_limited(store.clone(), OnStoreError::Allow, 100_000);
    let runs = Arc::new(AtomicUsize::new(0));
    let counter = runs.clone();
    let payments = ServiceBuilder::new()
        .layer(
            IdempotencyLayer::builder(store.clone())
                .unscoped()
                .required(true)
                .build()
                .unwrap(),
        )
        .service_fn(move |_req: Request<_>| {
            counter.fetch_add(1, Ordering::SeqCst);
            async { Ok::<_, Infallible>(Response::new(Full::new(bytes::Bytes::from("paid")))) }
        });
    let pay = |key: &str| {
        Request::post("/pay")
            .header("idempotency-key", key)
            .body(Full::new(bytes::Bytes::from_static(b"{}")))
            .unwrap()
    };
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let limiters = under_load(&svc, 6, &stop);
    let payer = {
        let (payments, stop) = (payments.clone(), stop.clone());
        tokio::spawn(async move {
            let mut answers = Vec::new();
            let mut i = 0;
            while !stop.load(Ordering::SeqCst) {
                i += 1;
                let key = format!("pay-{i}");
                let start = Instant::now();
                let res = payments.clone().oneshot(pay(&key)).await.unwrap();
                let status = res.status();
                // the end of the body comes once the response is recorded
                let _ = http_body_util::BodyExt::collect(res.into_body()).await;
                answers.push((key, status, start.elapsed()));
            }
            answers
        })
    };
    tokio::time::sleep(Duration::from_millis(400)).await;
    tokio::task::block_in_place(|| server.stop());
    let claims = Claims::new(store.clone());
    assert!(
        claims.claim_once("coupon-pg", None).await.is_err(),
        "no claim is reported won while the database is down"
    );
    let start = Instant::now();
    let refused = payments.clone().oneshot(pay("pay-down")).await.unwrap();
    assert_eq!(refused.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert!(refused.headers().contains_key("retry-after"));
    assert!(
        start.elapsed() < BOUND,
        "a refusal took {:?}",
        start.elapsed()
    );
    tokio::time::sleep(Duration::from_millis(500)).await;
    tokio::task::block_in_place(|| server.restart());
    let recovered = recovery(&svc).await;
    println!("rate limit recovered {recovered:?} after the restart");
    tokio::time::sleep(Duration::from_millis(200)).await;
    stop.store(true, Ordering::SeqCst);

    allowed_through_the_outage(limiters).await;

    let answers = payer.await.expect("the payer did not panic");
    for (key, status, took) in &answers {
        assert!(
            matches!(*status, StatusCode::OK | StatusCode::SERVICE_UNAVAILABLE),
            "{key}: {status}"
        );
        assert!(*took < 2 * BOUND, "{key} took {took:?}");
    }
    // every refused payment runs once when retried, every completed one is a replay
    let keys = answers.iter().map(|(key, _, _)| key.as_str());
    for key in keys.chain(["pay-down"]) {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let res = payments.clone().oneshot(pay(key)).await.unwrap();
            let status = res.status();
            let _ = http_body_util::BodyExt::collect(res.into_body()).await;
            if status == StatusCode::OK {
                break;
            }
            assert!(Instant::now() < deadline, "{key}: still {status}");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    assert_eq!(
        runs.load(Ordering::SeqCst),
        answers.len() + 1,
        "each key ran exactly once"
    );
    assert!(claims.claim_once("coupon-pg", None).await.unwrap().won());
    assert!(!claims.claim_once("coupon-pg", None).await.unwrap().won());
}
