//! Waiting for room instead of a 429 (`RateLimitLayerBuilder::queue`), on a `MemoryStore`, a
//! real `redis-server` and a real PostgreSQL: four copies of fifty callers each, waiting on one
//! quota of 100 a second, are admitted exactly 100 a second, every one within its patience; a
//! request whose room comes too late, or whose line is full, is refused at once; a copy serves
//! its waiters in arrival order, and one that goes away gives up its place.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::convert::Infallible;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use http::{Request, Response, StatusCode};
use tokio::task::JoinSet;
use tokio::time::Instant;
use tower::util::BoxCloneService;
use tower::{Service, ServiceBuilder, ServiceExt};

use tollgate::key::Header;
use tollgate::rate_limit::{Limit, RateLimitDecision, RateLimitLayer, RateLimitLayerBuilder};
use tollgate::store::RateStore;

/// A prefix no other test uses.
fn unique(name: &str) -> String {
    format!("{name}{:08x}", rand::random::<u32>())
}

/// A copy's service: each request is tenant `acme`'s; the handler notes when it ran and on which
/// copy.
type Svc = BoxCloneService<Request<()>, Response<()>, Infallible>;

/// When each admitted request ran, and on which copy.
type Ran = Arc<Mutex<Vec<(Instant, usize)>>>;

fn copy(layer: RateLimitLayer<Header>, index: usize, ran: &Ran) -> Svc {
    let ran = Arc::clone(ran);
    let handler = tower::service_fn(move |_: Request<()>| {
        ran.lock().unwrap().push((Instant::now(), index));
        async { Ok::<_, Infallible>(Response::new(())) }
    });
    BoxCloneService::new(
        ServiceBuilder::new()
            .layer(layer)
            .service(handler)
            .map_response(|r: Response<_>| r.map(|_| ())),
    )
}

fn builder(store: impl RateStore, prefix: &str) -> RateLimitLayerBuilder<Header> {
    RateLimitLayer::builder(store)
        .prefix(prefix)
        .key(Header::from_static("x-tenant"))
}

fn acme() -> Request<()> {
    Request::builder()
        .header("x-tenant", "acme")
        .body(())
        .unwrap()
}

/// One request of `acme` through `svc`: its status, how long it took, how long it waited.
async fn call(svc: &mut Svc) -> (StatusCode, Duration, Duration) {
    let started = Instant::now();
    let response = svc.ready().await.unwrap().call(acme()).await.unwrap();
    let waited = response
        .extensions()
        .get::<RateLimitDecision>()
        .map(RateLimitDecision::waited)
        .unwrap();
    (response.status(), started.elapsed(), waited)
}

/// The quota every copy waits on.
const QUOTA: usize = 100;
const COPIES: usize = 4;
const CALLERS: usize = 50;
/// How long the callers keep starting requests.
const RUN: Duration = Duration::from_secs(3);
/// How long a request may wait: each caller is admitted about every two seconds (200 callers,
/// 100 a second), so none needs all of it.
const PATIENCE: Duration = Duration::from_secs(3);
/// What a request may take beyond its patience: its last check's round trip, and a loaded
/// machine's scheduling.
const SLACK: Duration = Duration::from_millis(400);
/// How much later than its admission a request may run, on a loaded machine.
const JITTER: Duration = Duration::from_millis(200);

/// Four copies, fifty callers on each, every caller sending its next request as soon as the
/// last is answered: the sliding log admits 100 at once, then 100 as each second's charges
/// leave the window. No second admits more than the quota, and the waiting callers use all of
/// it (four seconds' quota, one more at most for those still waiting when the callers stop);
/// nearly every request waits for its room (about two seconds, within its patience of three)
/// rather than being refused; nobody waits past its patience, and every copy has its share.
///
/// The shares and the refusals hold where the store is a round trip away (`Round::Trip`), as
/// the store of several copies is: each step of a copy's waiters (a line-up, a look, a check)
/// then lets the other copies' waiters line up beside it. On one `MemoryStore` (`Round::None`)
/// every step is done at once: room that comes back within a few milliseconds goes in a chain
/// to the waiters of the copy the runtime happens to poll, before another copy's waiter is
/// polled to line up, so the shares measure the scheduler (copies of 40% and 6% were seen on an
/// idle machine, and up to 14% refused); there the test holds what the limits admit and when.
async fn four_copies_wait_on_one_quota<S: RateStore>(round: Round, make: impl Fn() -> S) {
    let prefix = unique("queue");
    let ran: Ran = Arc::default();
    let copies: Vec<Svc> = (0..COPIES)
        .map(|index| {
            let layer = builder(make(), &prefix)
                .limit(Limit::per_second("requests", QUOTA as u64))
                .queue(PATIENCE)
                .build()
                .unwrap();
            copy(layer, index, &ran)
        })
        .collect();
    let start = Instant::now();
    let mut callers = JoinSet::new();
    for svc in &copies {
        for _ in 0..CALLERS {
            let mut svc = svc.clone();
            callers.spawn(async move {
                let mut seen = Vec::new();
                while start.elapsed() < RUN {
                    seen.push(call(&mut svc).await);
                }
                seen
            });
        }
    }
    let seen: Vec<_> = callers.join_all().await.into_iter().flatten().collect();

    // room goes to each copy's first waiter as it asks, not to the request that waits longest
    // over all copies: a few may find their room too late, and are refused then (up to 7% seen
    // with both cores busy, where timers fire late; under 2% on an idle machine)
    let refused = seen.iter().filter(|(s, ..)| *s != StatusCode::OK).count();
    assert!(
        round == Round::None || refused * 10 <= seen.len(),
        "{refused} of {} refused",
        seen.len()
    );
    let longest = seen.iter().map(|(_, took, _)| *took).max().unwrap();
    assert!(longest <= PATIENCE + SLACK, "a request took {longest:?}");
    let waited = seen.iter().map(|(.., waited)| *waited).max().unwrap();
    assert!(
        waited >= Duration::from_millis(1_500) && waited <= PATIENCE + SLACK,
        "the longest wait was {waited:?}"
    );

    // the sliding log admits at most the quota within any second, and the waiting callers use
    // all of it: the quota at once, then again as each second's charges leave the window (told
    // by the moments the requests ran, which a loaded machine delays by up to `JITTER`)
    let mut ran = ran.lock().unwrap().clone();
    ran.sort_by_key(|(at, _)| *at);
    let mut from = 0;
    for (to, (at, _)) in ran.iter().enumerate() {
        while *at - ran[from].0 >= Duration::from_secs(1) - JITTER {
            from += 1;
        }
        assert!(
            to - from < QUOTA,
            "{} admitted within {:?}",
            to - from + 1,
            *at - ran[from].0
        );
    }
    // the callers send for three seconds: four seconds' quota at least, then those still
    // waiting, at most one more
    assert!(
        (4 * QUOTA..=5 * QUOTA).contains(&ran.len()),
        "{} admitted",
        ran.len()
    );
    for index in 0..COPIES {
        let share = ran.iter().filter(|(_, copy)| *copy == index).count();
        assert!(
            round == Round::None || share >= ran.len() / COPIES / 2,
            "copy {index} was admitted {share} of {}",
            ran.len()
        );
    }
}

/// Where the copies' store is: a round trip away, or in their process (one `MemoryStore`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Round {
    Trip,
    None,
}

/// A request whose room comes after its patience is refused at once, with the store's wait.
async fn room_after_the_patience_is_refused_at_once<S: RateStore>(store: S) {
    let layer = builder(store, &unique("late"))
        .limit(Limit::new("requests", 1, Duration::from_secs(30)))
        .queue(Duration::from_secs(2))
        .build()
        .unwrap();
    let mut svc = copy(layer, 0, &Ran::default());
    assert_eq!(call(&mut svc).await.0, StatusCode::OK);
    let started = Instant::now();
    let response = svc.ready().await.unwrap().call(acme()).await.unwrap();
    let took = started.elapsed();
    assert_eq!(response.status(), StatusCode::TOO_MANY_REQUESTS);
    assert!(took < Duration::from_millis(500), "refused after {took:?}");
    let retry_after: u64 = response.headers()["retry-after"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!(
        (29..=30).contains(&retry_after),
        "Retry-After {retry_after}"
    );
}

/// A line holds `max_waiting` requests: the next ones are refused at once; those in it are
/// admitted one per window, in the order they arrived; one that goes away gives its place up.
async fn a_line_is_served_in_order_and_holds_max_waiting<S: RateStore>(store: S) {
    let window = Duration::from_millis(600);
    let layer = builder(store, &unique("line"))
        .limit(Limit::new("requests", 1, window))
        .queue(Duration::from_secs(5))
        .max_waiting(3)
        .build()
        .unwrap();
    let ran = Ran::default();
    let mut svc = copy(layer, 0, &ran);
    assert_eq!(call(&mut svc).await.0, StatusCode::OK);

    // three wait, in this order; a fourth and a fifth find the line full
    let mut waiting = Vec::new();
    for index in 1..=3 {
        let mut svc = svc.clone();
        waiting.push(tokio::spawn(async move {
            (index, call(&mut svc).await, Instant::now())
        }));
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    for _ in 0..2 {
        let (status, took, waited) = call(&mut svc).await;
        assert_eq!(status, StatusCode::TOO_MANY_REQUESTS);
        assert!(took < Duration::from_millis(300), "refused after {took:?}");
        assert_eq!(waited, Duration::ZERO);
    }
    // the second goes away: its place is given up, and a new request takes it
    waiting.remove(1).abort();
    tokio::time::sleep(Duration::from_millis(20)).await;
    let mut last = svc.clone();
    waiting.push(tokio::spawn(async move {
        (4, call(&mut last).await, Instant::now())
    }));

    let mut order = Vec::new();
    for waiter in waiting {
        let (index, (status, took, waited), done) = waiter.await.unwrap();
        assert_eq!(status, StatusCode::OK, "waiter {index}");
        assert!(
            waited > window / 2 && waited <= took,
            "waiter {index}: {waited:?}"
        );
        order.push((done, index));
    }
    order.sort();
    let order: Vec<_> = order.into_iter().map(|(_, index)| index).collect();
    assert_eq!(order, [1, 3, 4], "admitted in arrival order");
    assert_eq!(ran.lock().unwrap().len(), 4);
}

mod on_memory {
    use tollgate::store::MemoryStore;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn four_copies_wait_on_one_quota() {
        let store = MemoryStore::new();
        super::four_copies_wait_on_one_quota(super::Round::None, || store.clone()).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn room_after_the_patience_is_refused_at_once() {
        super::room_after_the_patience_is_refused_at_once(MemoryStore::new()).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_line_is_served_in_order_and_holds_max_waiting() {
        super::a_line_is_served_in_order_and_holds_max_waiting(MemoryStore::new()).await;
    }
}

mod on_redis {
    use crate::common::RedisServer;
    use crate::rate_limit_invalidations::redis_store;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn four_copies_wait_on_one_quota() {
        let server = RedisServer::start();
        super::four_copies_wait_on_one_quota(super::Round::Trip, || redis_store(&server)).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn room_after_the_patience_is_refused_at_once() {
        let server = RedisServer::start();
        super::room_after_the_patience_is_refused_at_once(redis_store(&server)).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_line_is_served_in_order_and_holds_max_waiting() {
        let server = RedisServer::start();
        super::a_line_is_served_in_order_and_holds_max_waiting(redis_store(&server)).await;
    }
}

mod on_postgres {
    use crate::common::postgres;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn four_copies_wait_on_one_quota() {
        let store = postgres::store().await;
        super::four_copies_wait_on_one_quota(super::Round::Trip, || store.clone()).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn room_after_the_patience_is_refused_at_once() {
        super::room_after_the_patience_is_refused_at_once(postgres::store().await).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_line_is_served_in_order_and_holds_max_waiting() {
        super::a_line_is_served_in_order_and_holds_max_waiting(postgres::store().await).await;
    }
}
