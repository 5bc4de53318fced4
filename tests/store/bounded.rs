//! Hostile callers cannot grow in-process memory without bound: `MemoryStore` and the layer's
//! local fallback hold at most their capacity of live callers (and keys), refuse new ones while
//! full — never by evicting a live caller, which would hand it a fresh quota — and take new ones
//! again once entries expire. Time is tokio's paused clock wherever it matters.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use http::{Request, Response, StatusCode};
use tower::ServiceExt;

use tollgate::error::ConfigErrorKind;
use tollgate::key::{Header, Key};
use tollgate::rate::{Algorithm, LimitState, RateCheck, RateOutcome, RatePolicy};
use tollgate::rate_limit::{
    DecisionSource, Limit, OnStoreError, RateLimitDecision, RateLimitLayer,
};
use tollgate::store::{BeginRequest, ClaimRequest, LockRequest};
use tollgate::store::{
    Hold, IdempotencyStore, LockAttempt, LockStore, MemoryStore, RateStore, StoreError,
    StoreErrorKind, StoreFuture,
};

fn policy(algorithm: Algorithm, limits: Vec<Limit>) -> Arc<RatePolicy> {
    Arc::new(RatePolicy::new("bounded:rl", algorithm, limits).unwrap())
}

fn caller(i: u64) -> Key {
    Key::new("bounded", &i.to_be_bytes())
}

async fn check(store: &MemoryStore, policy: &Arc<RatePolicy>, key: Key) -> RateOutcome {
    store
        .check_rate(policy, RateCheck::new(key, 1))
        .await
        .unwrap()
}

/// What a full store answers a new caller: denied for a second, every limit at zero.
fn assert_full_denial(outcome: &RateOutcome, limits: usize) {
    assert!(!outcome.admitted);
    assert_eq!(outcome.retry_after, Duration::from_secs(1));
    let full = LimitState {
        remaining: 0,
        reset: Duration::from_secs(1),
    };
    assert_eq!(outcome.limits, vec![full; limits]);
}

/// A window longer than the time a charged attempt is remembered (3 s), so that each caller
/// leaves when its limit expires.
const WINDOW: Duration = Duration::from_secs(5);

#[tokio::test(start_paused = true)]
async fn exactly_the_capacity_of_new_callers_is_admitted_while_they_are_live() {
    const N: u64 = 100;
    let store = MemoryStore::with_capacity(N as usize);
    let p = policy(Algorithm::SlidingLog, vec![Limit::new("s", 5, WINDOW)]);
    for i in 0..N {
        assert!(check(&store, &p, caller(i)).await.admitted, "caller {i}");
    }
    assert_eq!(store.len(), N as usize);
    for i in N..N + 10 {
        assert_full_denial(&check(&store, &p, caller(i)).await, 1);
    }
    // 1 ms before the first entries expire: still all live, still full
    tokio::time::advance(WINDOW - Duration::from_millis(1)).await;
    assert_eq!(store.len(), N as usize);
    assert_full_denial(&check(&store, &p, caller(N)).await, 1);
    // at their expiry they are gone, and new callers are admitted again, exactly N of them
    tokio::time::advance(Duration::from_millis(1)).await;
    assert_eq!(store.len(), 0);
    for i in N..2 * N {
        assert!(check(&store, &p, caller(i)).await.admitted, "caller {i}");
    }
    assert_full_denial(&check(&store, &p, caller(2 * N)).await, 1);
    assert_eq!(store.len(), N as usize);
}

/// Entries made at different times leave at their own expiry: exactly the expired ones go,
/// and exactly that much room comes back.
#[tokio::test(start_paused = true)]
async fn expiry_removes_exactly_the_expired_entries() {
    let store = MemoryStore::with_capacity(10);
    let p = policy(Algorithm::SlidingLog, vec![Limit::new("s", 5, WINDOW)]);
    for i in 0..4 {
        assert!(check(&store, &p, caller(i)).await.admitted);
    }
    tokio::time::advance(WINDOW / 2).await;
    for i in 4..10 {
        assert!(check(&store, &p, caller(i)).await.admitted);
    }
    assert_eq!(store.len(), 10);
    tokio::time::advance(WINDOW / 2).await;
    assert_eq!(store.len(), 6, "the first four expired, the other six not");
    let admitted = {
        let mut n = 0;
        for i in 100..110 {
            n += usize::from(check(&store, &p, caller(i)).await.admitted);
        }
        n
    };
    assert_eq!(admitted, 4, "room for exactly the four that expired");
    assert_eq!(store.len(), 10);
}

/// A caller held when the store is full keeps its count: a flood of new callers neither resets
/// it nor takes its place.
#[tokio::test(start_paused = true)]
async fn a_held_caller_keeps_its_quota_at_the_cap() {
    let store = MemoryStore::with_capacity(3);
    let p = policy(Algorithm::SlidingLog, vec![Limit::per_minute("m", 4)]);
    let alice = caller(0);
    for _ in 0..2 {
        assert!(check(&store, &p, alice).await.admitted);
    }
    assert!(check(&store, &p, caller(1)).await.admitted);
    assert!(check(&store, &p, caller(2)).await.admitted);
    for i in 3..1_000 {
        assert_full_denial(&check(&store, &p, caller(i)).await, 1);
    }
    let third = check(&store, &p, alice).await;
    assert!(third.admitted);
    assert_eq!(third.limits[0].remaining, 1);
    assert!(check(&store, &p, alice).await.admitted);
    let fifth = check(&store, &p, alice).await;
    assert!(!fifth.admitted, "the quota is not handed out again");
    assert_eq!(fifth.retry_after, Duration::from_secs(60), "the real wait");
    assert_eq!(store.len(), 3);
}

#[tokio::test(start_paused = true)]
async fn a_flood_of_distinct_callers_stays_at_the_cap() {
    const CAP: usize = 1_000;
    let store = MemoryStore::with_capacity(CAP);
    let p = policy(Algorithm::Gcra, vec![Limit::per_hour("h", 10)]);
    let mut admitted = 0;
    for i in 0..20_000u64 {
        admitted += usize::from(check(&store, &p, caller(i)).await.admitted);
        if i % 1_000 == 999 {
            assert_eq!(store.len(), CAP.min(i as usize + 1));
        }
    }
    assert_eq!(admitted, CAP);
    assert_eq!(store.len(), CAP);
}

/// The count is shared by all shards and taken atomically: threads racing for the last places
/// get exactly the capacity between them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn racing_new_callers_get_exactly_the_capacity() {
    const CAP: usize = 500;
    let store = MemoryStore::with_capacity(CAP);
    let p = policy(Algorithm::Gcra, vec![Limit::per_hour("h", 10)]);
    let tasks: Vec<_> = (0..8u64)
        .map(|t| {
            let (store, p) = (store.clone(), Arc::clone(&p));
            tokio::spawn(async move {
                let mut admitted = 0;
                for i in 0..1_000 {
                    admitted +=
                        usize::from(check(&store, &p, caller(t * 1_000 + i)).await.admitted);
                }
                admitted
            })
        })
        .collect();
    let mut admitted = 0;
    for task in tasks {
        admitted += task.await.unwrap();
    }
    assert_eq!(admitted, CAP);
    assert_eq!(store.len(), CAP);
}

/// A caller is one entry with all its limits; a full store's denial names every limit.
#[tokio::test(start_paused = true)]
async fn a_caller_with_several_limits_is_one_entry() {
    let store = MemoryStore::with_capacity(1);
    let p = policy(
        Algorithm::SlidingCounter,
        vec![
            Limit::per_second("s", 5),
            Limit::per_minute("m", 50),
            Limit::per_hour("h", 500),
        ],
    );
    assert!(check(&store, &p, caller(0)).await.admitted);
    assert_eq!(store.len(), 1);
    assert_full_denial(&check(&store, &p, caller(1)).await, 3);
}

/// Claims, locks and idempotency records have their own capacity; a new key beyond it is an
/// error (as Redis refuses writes past `maxmemory`), never an eviction.
#[tokio::test(start_paused = true)]
async fn a_full_store_refuses_new_keys_with_an_error() {
    let store = MemoryStore::with_capacity(2);
    let ttl = Some(Duration::from_secs(10));
    assert!(
        store
            .claim(ClaimRequest::new("a", "x", ttl), soon())
            .await
            .unwrap()
            .won
    );
    assert!(
        store
            .claim(
                ClaimRequest::new("b", "x", Some(Duration::from_secs(1))),
                soon()
            )
            .await
            .unwrap()
            .won
    );
    assert_eq!(
        refused(store.claim(ClaimRequest::new("c", "x", ttl), soon()).await),
        StoreErrorKind::Protocol
    );
    let begin = store.idempotency_begin(
        BeginRequest::new(Hold::new("i", "t"), "f", Duration::from_secs(5)),
        soon(),
    );
    assert_eq!(refused(begin.await), StoreErrorKind::Protocol);
    // what is held still answers: the holder wins again, another holder loses
    assert!(
        store
            .claim(ClaimRequest::new("a", "x", ttl), soon())
            .await
            .unwrap()
            .won
    );
    assert!(
        !store
            .claim(ClaimRequest::new("a", "y", ttl), soon())
            .await
            .unwrap()
            .won
    );
    // rate callers count apart
    let p = policy(Algorithm::Gcra, vec![Limit::per_second("s", 1)]);
    assert!(check(&store, &p, caller(0)).await.admitted);
    assert_eq!(store.len(), 3);
    // "b" expires: room for one key, not for a lock and its fencing counter
    tokio::time::advance(Duration::from_secs(1)).await;
    let (lock, fence) = ("t:lock:{l}".to_owned(), "t:lock:{l}:fence".to_owned());
    let lease = Duration::from_secs(5);
    let attempt = store.lock_acquire(
        LockRequest::new(Hold::new(lock.clone(), "t"), fence.clone(), lease),
        soon(),
    );
    assert_eq!(refused(attempt.await), StoreErrorKind::Protocol);
    assert!(store.delete_if_held(Hold::new("a", "x")).await.unwrap());
    let attempt = store
        .lock_acquire(LockRequest::new(Hold::new(lock, "t"), fence, lease), soon())
        .await
        .unwrap();
    assert!(matches!(attempt, LockAttempt::Acquired { .. }));
    assert_eq!(
        store.len(),
        3,
        "the lock, its fencing counter and the rate caller"
    );
}

/// The kind of error of a refused operation.
fn refused<T>(result: Result<T, StoreError>) -> StoreErrorKind {
    result.map(|_| ()).unwrap_err().kind()
}

/// A store that is always down, so that the layer's local fallback decides.
#[derive(Debug, Clone)]
struct Down;

impl RateStore for Down {
    fn check_rate(&self, _: &Arc<RatePolicy>, _: RateCheck) -> StoreFuture<RateOutcome> {
        Box::pin(async { Err(StoreError::new(StoreErrorKind::Unavailable, "down")) })
    }

    fn timeout(&self) -> Duration {
        Duration::from_millis(250)
    }

    fn reset_rate(&self, _: &Arc<RatePolicy>, _: tollgate::key::Key) -> StoreFuture<()> {
        Box::pin(async { Err(StoreError::new(StoreErrorKind::Unavailable, "down")) })
    }
}

type Reply = (StatusCode, http::HeaderMap, RateLimitDecision);

async fn send<S>(svc: &S, who: &str) -> Reply
where
    S: tower::Service<Request<()>, Response = Response<tollgate::rate_limit::ResponseBody<()>>>
        + Clone,
    S::Error: std::fmt::Debug,
{
    let request = Request::get("/").header("x-caller", who).body(()).unwrap();
    let response = svc.clone().oneshot(request).await.unwrap();
    let decision = response
        .extensions()
        .get::<RateLimitDecision>()
        .cloned()
        .unwrap();
    (response.status(), response.headers().clone(), decision)
}

fn fallback_layer(
    configure: impl FnOnce(
        tollgate::rate_limit::RateLimitLayerBuilder,
    ) -> tollgate::rate_limit::RateLimitLayerBuilder,
) -> RateLimitLayer<Header> {
    configure(
        RateLimitLayer::builder(Down)
            .limit(Limit::per_minute("m", 4))
            .on_store_error(OnStoreError::LocalFallback { copies: 1 }),
    )
    .key(Header::from_static("x-caller"))
    .build()
    .unwrap()
}

fn ok(_: Request<()>) -> std::future::Ready<Result<Response<()>, Infallible>> {
    std::future::ready(Ok(Response::new(())))
}

#[tokio::test(start_paused = true)]
async fn a_full_fallback_denies_new_callers_for_a_second_and_keeps_the_held_ones() {
    let layer = fallback_layer(|b| b.fallback_capacity(2));
    let svc = tower::ServiceBuilder::new().layer(layer).service_fn(ok);
    for who in ["a", "b"] {
        let (status, _, decision) = send(&svc, who).await;
        assert_eq!(status, StatusCode::OK);
        assert_eq!(decision.source(), DecisionSource::LocalFallback);
    }
    let (status, headers, decision) = send(&svc, "c").await;
    assert_eq!(status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(headers["retry-after"], "1");
    assert!(
        !headers.contains_key("ratelimit"),
        "no limit states: nothing was counted"
    );
    assert_eq!(decision.source(), DecisionSource::LocalFallback);
    assert_eq!(decision.retry_after(), Duration::from_secs(1));
    assert!(decision.limits().is_empty());
    // "a" keeps its count: three more, then the real wait
    for _ in 0..3 {
        assert_eq!(send(&svc, "a").await.0, StatusCode::OK);
    }
    let (status, headers, _) = send(&svc, "a").await;
    assert_eq!(status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(headers["retry-after"], "60");
    // once the held callers' windows are over, a new caller gets in
    tokio::time::advance(Duration::from_secs(60)).await;
    assert_eq!(send(&svc, "c").await.0, StatusCode::OK);
}

#[tokio::test(start_paused = true)]
async fn a_full_fallback_may_admit_new_callers_uncounted() {
    let layer = fallback_layer(|b| b.fallback_capacity(1).fallback_admits_when_full(true));
    let svc = tower::ServiceBuilder::new().layer(layer).service_fn(ok);
    assert_eq!(send(&svc, "a").await.0, StatusCode::OK);
    for _ in 0..10 {
        let (status, headers, decision) = send(&svc, "b").await;
        assert_eq!(status, StatusCode::OK, "admitted, and never counted");
        assert!(!headers.contains_key("ratelimit"));
        assert!(decision.admitted() && decision.limits().is_empty());
        assert_eq!(decision.source(), DecisionSource::LocalFallback);
    }
    // the held caller is limited as ever
    for _ in 0..3 {
        assert_eq!(send(&svc, "a").await.0, StatusCode::OK);
    }
    assert_eq!(send(&svc, "a").await.0, StatusCode::TOO_MANY_REQUESTS);
}

/// The fallback's default capacity is 65,536 callers.
#[tokio::test(start_paused = true)]
async fn the_fallback_holds_65536_callers_by_default() {
    let svc = tower::ServiceBuilder::new()
        .layer(fallback_layer(|b| b))
        .service_fn(ok);
    for i in 0..65_536 {
        assert_eq!(
            send(&svc, &format!("c{i}")).await.0,
            StatusCode::OK,
            "caller {i}"
        );
    }
    let (status, _, decision) = send(&svc, "one-more").await;
    assert_eq!(status, StatusCode::TOO_MANY_REQUESTS);
    assert!(decision.limits().is_empty());
}

#[test]
fn a_fallback_without_room_is_refused_at_build_time() {
    let built = RateLimitLayer::builder(Down)
        .limit(Limit::per_minute("m", 4))
        .on_store_error(OnStoreError::LocalFallback { copies: 1 })
        .fallback_capacity(0)
        .build();
    assert_eq!(built.unwrap_err().kind(), ConfigErrorKind::FailurePolicy);
}

/// A deadline that a store call made now meets.
fn soon() -> tokio::time::Instant {
    tokio::time::Instant::now() + Duration::from_secs(1)
}
