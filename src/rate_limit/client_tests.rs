//! The rate client seen through the layer: how long a cached denial lasts, which denials are
//! cached, and who each answer names as its source.

use std::convert::Infallible;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use http::{Request, Response, StatusCode};
use tower::{Service, ServiceExt, service_fn};

use crate::key::Header;
use crate::rate::{LimitState, RateCheck, RateOutcome, RatePolicy};
use crate::rate_client::{DenyCache, MAX_AGE};
use crate::rate_limit::{DecisionSource, Limit, RateLimitDecision, RateLimitLayer};
use crate::store::{RateStore, StoreFuture};

/// A store that denies every check for a second, replying 200 ms after it was asked.
#[derive(Debug, Clone, Default)]
struct SlowDenial {
    checks: Arc<AtomicUsize>,
}

const LATENCY: std::time::Duration = std::time::Duration::from_millis(200);
const WAIT: std::time::Duration = std::time::Duration::from_secs(1);

impl RateStore for SlowDenial {
    fn check_rate(&self, _: &Arc<RatePolicy>, _: RateCheck) -> StoreFuture<RateOutcome> {
        self.checks.fetch_add(1, Ordering::SeqCst);
        Box::pin(async {
            tokio::time::sleep(LATENCY).await;
            Ok(RateOutcome {
                admitted: false,
                retry_after: WAIT,
                limits: vec![LimitState {
                    remaining: 0,
                    reset: WAIT,
                }],
                decided_at_us: None,
            })
        })
    }

    fn timeout(&self) -> std::time::Duration {
        WAIT
    }

    fn reset_rate(&self, _: &Arc<RatePolicy>, _: crate::key::Key) -> StoreFuture<()> {
        Box::pin(async { Ok(()) })
    }
}

async fn decision<S>(svc: &mut S) -> RateLimitDecision
where
    S: Service<Request<()>, Response = Response<crate::rate_limit::ResponseBody<()>>>,
    S::Error: std::fmt::Debug,
{
    let request = Request::get("/").header("x-caller", "a").body(()).unwrap();
    let response = svc.ready().await.unwrap().call(request).await.unwrap();
    assert_eq!(response.status(), StatusCode::TOO_MANY_REQUESTS);
    response
        .extensions()
        .get::<RateLimitDecision>()
        .cloned()
        .unwrap()
}

/// The store denied for 1 s at some moment between sending and the reply: the cached
/// denial ends 1 s after sending, not 1 s after the reply 200 ms later.
#[tokio::test(start_paused = true)]
async fn a_slow_reply_does_not_stretch_the_cached_denial() {
    let store = SlowDenial::default();
    let checks = Arc::clone(&store.checks);
    let layer = RateLimitLayer::builder(store)
        .limit(Limit::per_second("s", 1))
        .key(Header::from_static("x-caller"))
        .build()
        .unwrap();
    let ok = |_: Request<()>| async { Ok::<_, Infallible>(Response::new(())) };
    let mut svc = tower_layer::Layer::layer(&layer, service_fn(ok));
    let sent = tokio::time::Instant::now();
    assert_eq!(decision(&mut svc).await.source(), DecisionSource::Store);
    assert_eq!(sent.elapsed(), LATENCY);
    // 900 ms after sending: still denied locally, for the 100 ms left
    tokio::time::advance(std::time::Duration::from_millis(700)).await;
    let cached = decision(&mut svc).await;
    assert_eq!(cached.source(), DecisionSource::DenyCache);
    assert_eq!(cached.retry_after(), std::time::Duration::from_millis(100));
    assert_eq!(
        cached.limits()[0].1.reset,
        std::time::Duration::from_millis(100)
    );
    assert_eq!(checks.load(Ordering::SeqCst), 1);
    // 1 s and 1 ms after sending the denial is over: the store is asked again
    tokio::time::advance(std::time::Duration::from_millis(101)).await;
    assert_eq!(
        decision(&mut svc).await.source(),
        DecisionSource::Store,
        "the cached denial outlived the store's"
    );
    assert_eq!(checks.load(Ordering::SeqCst), 2);
}

/// A store that denies every check at once for a minute (a caller over an hourly limit,
/// say), counting the checks it is asked.
#[derive(Debug, Default)]
struct LongDenial {
    checks: Arc<AtomicUsize>,
}

const LONG: std::time::Duration = std::time::Duration::from_secs(60);

impl RateStore for LongDenial {
    fn check_rate(&self, _: &Arc<RatePolicy>, _: RateCheck) -> StoreFuture<RateOutcome> {
        self.checks.fetch_add(1, Ordering::SeqCst);
        Box::pin(async {
            Ok(RateOutcome {
                admitted: false,
                retry_after: LONG,
                limits: vec![LimitState {
                    remaining: 0,
                    reset: LONG,
                }],
                decided_at_us: None,
            })
        })
    }

    fn timeout(&self) -> std::time::Duration {
        LONG
    }

    fn reset_rate(&self, _: &Arc<RatePolicy>, _: crate::key::Key) -> StoreFuture<()> {
        Box::pin(async { Ok(()) })
    }
}

/// A denial whose check was sent before the caller was forgotten (a reset or refund that
/// arrived while the check was on its way) is not cached: the store may have decided it
/// before the reset. One sent afterwards is.
#[tokio::test(start_paused = true)]
async fn a_denial_sent_before_an_invalidation_is_not_cached() {
    let layer = RateLimitLayer::builder(LongDenial::default())
        .limit(Limit::per_hour("h", 1))
        .key(Header::from_static("x-caller"))
        .deny_cache(false)
        .build()
        .unwrap();
    let ok = |_: Request<()>| async { Ok::<_, Infallible>(Response::new(())) };
    let mut svc = tower_layer::Layer::layer(&layer, service_fn(ok));
    let denial = decision(&mut svc).await;
    let key = denial.key;
    let cache = DenyCache::default();
    let sent = tokio::time::Instant::now();
    tokio::time::advance(std::time::Duration::from_millis(1)).await;
    cache.forget(key);
    cache.remember(&denial.verdict(), sent);
    assert!(
        cache.check(RateCheck::new(key, 1)).is_none(),
        "a denial from before the reset"
    );
    tokio::time::advance(std::time::Duration::from_millis(1)).await;
    cache.remember(&denial.verdict(), tokio::time::Instant::now());
    assert!(
        cache.check(RateCheck::new(key, 1)).is_some(),
        "a denial from after it"
    );
    tokio::time::advance(std::time::Duration::from_millis(1)).await;
    cache.clear();
    assert!(cache.check(RateCheck::new(key, 1)).is_none(), "cleared");
}

/// However long the store's wait, a denial is served from the cache for at most
/// `MAX_AGE`, then the store is asked again: a reset or refund made through another copy
/// whose broadcast was lost frees the caller here within that time. The answers still count
/// down the store's wait.
#[tokio::test(start_paused = true)]
async fn a_long_denial_is_asked_again_after_the_cache_max_age() {
    let store = LongDenial::default();
    let checks = Arc::clone(&store.checks);
    let layer = RateLimitLayer::builder(store)
        .limit(Limit::per_hour("h", 1))
        .key(Header::from_static("x-caller"))
        .build()
        .unwrap();
    let ok = |_: Request<()>| async { Ok::<_, Infallible>(Response::new(())) };
    let mut svc = tower_layer::Layer::layer(&layer, service_fn(ok));
    assert_eq!(decision(&mut svc).await.source(), DecisionSource::Store);
    tokio::time::advance(MAX_AGE - std::time::Duration::from_millis(1)).await;
    let cached = decision(&mut svc).await;
    assert_eq!(cached.source(), DecisionSource::DenyCache);
    assert_eq!(
        cached.retry_after(),
        LONG - MAX_AGE + std::time::Duration::from_millis(1)
    );
    assert_eq!(checks.load(Ordering::SeqCst), 1);
    tokio::time::advance(std::time::Duration::from_millis(1)).await;
    assert_eq!(decision(&mut svc).await.source(), DecisionSource::Store);
    assert_eq!(checks.load(Ordering::SeqCst), 2);
}

/// A store whose outcomes carry no store clock (`decided_at_us: None`), as a store written
/// outside the crate may answer.
#[derive(Debug, Default)]
struct NoClock(crate::store::MemoryStore);

impl RateStore for NoClock {
    fn check_rate(&self, p: &Arc<RatePolicy>, check: RateCheck) -> StoreFuture<RateOutcome> {
        let pending = self.0.check_rate(p, check);
        Box::pin(async move {
            let outcome = pending.await?;
            Ok(RateOutcome {
                decided_at_us: None,
                ..outcome
            })
        })
    }

    fn timeout(&self) -> std::time::Duration {
        self.0.timeout()
    }

    fn reset_rate(&self, p: &Arc<RatePolicy>, key: crate::key::Key) -> StoreFuture<()> {
        self.0.reset_rate(p, key)
    }
}

/// Every answer names who gave it, whatever the store's outcome carries: on a leased tier, the
/// checks of a caller not warm yet and the request a slice is fetched with are the store's,
/// and only what a slice admits is the lease's.
#[tokio::test]
async fn an_answer_names_its_source_whatever_the_outcome_carries() {
    let layer = RateLimitLayer::builder(NoClock::default())
        .limit(Limit::per_hour("h", 1000).leased())
        .key(Header::from_static("x-caller"))
        .build()
        .unwrap();
    let ok = |_: Request<()>| async { Ok::<_, Infallible>(Response::new(())) };
    let mut svc = tower_layer::Layer::layer(&layer, service_fn(ok));
    let mut sources = Vec::new();
    for _ in 0..6 {
        let request = Request::get("/").header("x-caller", "a").body(()).unwrap();
        let response = svc.ready().await.unwrap().call(request).await.unwrap();
        let decision = response.extensions().get::<RateLimitDecision>().unwrap();
        assert!(decision.admitted());
        sources.push(decision.source());
    }
    let store = DecisionSource::Store;
    let lease = DecisionSource::Lease;
    // three checks alone, then the fourth request with its slice, then two from the slice
    assert_eq!(sources, [store, store, store, store, lease, lease]);
}

/// A memory store whose leased slices (reservations) and settlements wait while its gate is
/// shut, charged as they arrive: their answers are held back, as a slow network would.
#[derive(Debug)]
struct Gated {
    inner: crate::store::MemoryStore,
    open: tokio::sync::watch::Sender<bool>,
    /// The reservations and settlements held back now.
    held: Arc<AtomicUsize>,
}

impl RateStore for Gated {
    fn check_rate(&self, p: &Arc<RatePolicy>, check: RateCheck) -> StoreFuture<RateOutcome> {
        let gated = check.is_reservation() || check.settles().is_some();
        let mut open = self.open.subscribe();
        let held = Arc::clone(&self.held);
        let ran = self.inner.check_rate(p, check);
        Box::pin(async move {
            let outcome = ran.await;
            if gated && !*open.borrow() {
                held.fetch_add(1, Ordering::SeqCst);
                let _ = open.wait_for(|open| *open).await;
                held.fetch_sub(1, Ordering::SeqCst);
            }
            outcome
        })
    }

    fn timeout(&self) -> std::time::Duration {
        std::time::Duration::from_secs(5)
    }

    fn reset_rate(&self, p: &Arc<RatePolicy>, key: crate::key::Key) -> StoreFuture<()> {
        self.inner.reset_rate(p, key)
    }
}

/// What a copy says it holds unspent bounds what the store counts and nobody was admitted, at
/// every moment: a slice whose fetch the store charged but whose answer has not landed, and a
/// slice given back whose settlement has not landed, are counted as held.
#[tokio::test]
async fn slices_on_their_way_are_counted_as_held() {
    const QUOTA: u64 = 1_000;
    let store = Arc::new(Gated {
        inner: crate::store::MemoryStore::new(),
        open: tokio::sync::watch::Sender::new(false),
        held: Arc::default(),
    });
    let layer = RateLimitLayer::builder(Arc::clone(&store))
        .limit(Limit::per_hour("h", QUOTA).leased())
        .key(Header::from_static("x-caller"))
        .build()
        .unwrap();
    let ok = |_: Request<()>| async { Ok::<_, Infallible>(Response::new(())) };
    let svc = tower_layer::Layer::layer(&layer, service_fn(ok));
    let send = |mut svc: crate::rate_limit::RateLimit<_, Header>| async move {
        let request = Request::get("/").header("x-caller", "a").body(()).unwrap();
        let response = svc.ready().await.unwrap().call(request).await.unwrap();
        assert_eq!(response.status(), StatusCode::OK);
    };
    // three checks alone, then the fourth request fetches a slice: held back, charged
    for _ in 0..3 {
        send(svc.clone()).await;
    }
    let fourth = tokio::spawn(send(svc.clone()));
    while store.held.load(Ordering::SeqCst) == 0 {
        tokio::task::yield_now().await;
    }
    let key = crate::key::Key::new("header:x-caller", b"a");
    let policy = layer.policy();
    let left = || async {
        let look = store.inner.check_rate(&policy, RateCheck::new(key, 0));
        look.await.unwrap().limits[0].remaining
    };
    let slice = QUOTA - 3 - left().await;
    assert!(slice > 1, "a slice of {slice}");
    assert_eq!(
        layer.leases_unspent(),
        slice,
        "a slice fetched, its answer not landed"
    );
    store.open.send_replace(true);
    fourth.await.unwrap();
    assert_eq!(
        layer.leases_unspent(),
        slice - 1,
        "the fourth request took one"
    );
    // given back: charged until the settlement lands
    store.open.send_replace(false);
    let giving_back = tokio::spawn({
        let layer = layer.clone();
        async move { layer.give_back_leases().await }
    });
    while store.held.load(Ordering::SeqCst) == 0 {
        tokio::task::yield_now().await;
    }
    assert_eq!(left().await, QUOTA - 4, "the store has settled it");
    assert_eq!(
        layer.leases_unspent(),
        slice - 1,
        "its answer has not landed"
    );
    store.open.send_replace(true);
    giving_back.await.unwrap();
    assert_eq!(layer.leases_unspent(), 0);
    assert_eq!(
        left().await,
        QUOTA - 4,
        "exactly what was admitted stays charged"
    );
}
