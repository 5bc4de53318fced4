//! Unit tests of the layer on a `MemoryStore`, with tokio's clock paused.

use std::convert::Infallible;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use http::{Request, Response, StatusCode};
use tower::{Service, ServiceExt, service_fn};

use super::*;
use crate::key::Header;
use crate::rate::{RateCheck, RateOutcome, RatePolicy};
use crate::store::{MemoryStore, RateStore, StoreError, StoreErrorKind, StoreFuture};

/// A store that counts rate checks and can be switched to failing.
#[derive(Debug, Clone, Default)]
struct Counting {
    inner: MemoryStore,
    checks: Arc<AtomicUsize>,
    down: Arc<std::sync::atomic::AtomicBool>,
}

/// Serves rate checks only: the layer asks for nothing else.
impl RateStore for Counting {
    fn check_rate(&self, p: &Arc<RatePolicy>, check: RateCheck) -> StoreFuture<RateOutcome> {
        self.checks.fetch_add(1, Ordering::SeqCst);
        if self.down.load(Ordering::SeqCst) {
            return Box::pin(async { Err(StoreError::new(StoreErrorKind::Unavailable, "down")) });
        }
        self.inner.check_rate(p, check)
    }

    fn timeout(&self) -> std::time::Duration {
        RateStore::timeout(&self.inner)
    }

    fn reset_rate(&self, p: &Arc<RatePolicy>, key: crate::key::Key) -> StoreFuture<()> {
        self.inner.reset_rate(p, key)
    }
}

fn request(caller: &str) -> Request<()> {
    Request::get("/")
        .header("x-caller", caller)
        .body(())
        .unwrap()
}

type Svc = RateLimit<
    tower::util::ServiceFn<fn(Request<()>) -> std::future::Ready<Result<Response<()>, Infallible>>>,
    Header,
>;

fn ok(_: Request<()>) -> std::future::Ready<Result<Response<()>, Infallible>> {
    std::future::ready(Ok(Response::new(())))
}

fn service(builder: RateLimitLayerBuilder) -> Svc {
    let layer = builder
        .key(Header::from_static("x-caller"))
        .build()
        .unwrap();
    tower_layer::Layer::layer(&layer, service_fn(ok as fn(_) -> _))
}

async fn respond(svc: &mut Svc, caller: &str) -> <Svc as Service<Request<()>>>::Response {
    send(svc, request(caller)).await
}

async fn send(svc: &mut Svc, request: Request<()>) -> <Svc as Service<Request<()>>>::Response {
    svc.ready().await.unwrap().call(request).await.unwrap()
}

async fn status(svc: &mut Svc, caller: &str) -> StatusCode {
    respond(svc, caller).await.status()
}

#[tokio::test(start_paused = true)]
async fn window_slides_with_the_clock() {
    let mut svc =
        service(RateLimitLayer::builder(MemoryStore::new()).limit(Limit::per_second("s", 2)));
    assert_eq!(status(&mut svc, "a").await, StatusCode::OK);
    tokio::time::advance(Duration::from_millis(500)).await;
    assert_eq!(status(&mut svc, "a").await, StatusCode::OK);
    assert_eq!(status(&mut svc, "a").await, StatusCode::TOO_MANY_REQUESTS);
    // the first request leaves the window at 1000 ms, the second at 1500 ms
    tokio::time::advance(Duration::from_millis(501)).await;
    assert_eq!(status(&mut svc, "a").await, StatusCode::OK);
    assert_eq!(status(&mut svc, "a").await, StatusCode::TOO_MANY_REQUESTS);
    tokio::time::advance(Duration::from_millis(500)).await;
    assert_eq!(status(&mut svc, "a").await, StatusCode::OK);
}

#[tokio::test(start_paused = true)]
async fn deny_cache_spares_the_store_and_expires_on_time() {
    let store = Counting::default();
    let checks = store.checks.clone();
    let mut svc = service(RateLimitLayer::builder(store).limit(Limit::per_minute("m", 3)));
    for _ in 0..3 {
        assert_eq!(status(&mut svc, "flood").await, StatusCode::OK);
    }
    for _ in 0..100 {
        assert_eq!(
            status(&mut svc, "flood").await,
            StatusCode::TOO_MANY_REQUESTS
        );
    }
    // three admissions and the one denial that filled the cache
    assert_eq!(checks.load(Ordering::SeqCst), 4);
    // other callers still go to the store
    assert_eq!(status(&mut svc, "other").await, StatusCode::OK);
    assert_eq!(checks.load(Ordering::SeqCst), 5);
    // once the denial's time is up, the store decides again
    tokio::time::advance(Duration::from_secs(60)).await;
    assert_eq!(status(&mut svc, "flood").await, StatusCode::OK);
    assert_eq!(checks.load(Ordering::SeqCst), 6);
}

#[tokio::test(start_paused = true)]
async fn cached_denials_carry_honest_headers() {
    let mut svc =
        service(RateLimitLayer::builder(MemoryStore::new()).limit(Limit::per_minute("m", 1)));
    assert_eq!(status(&mut svc, "a").await, StatusCode::OK);
    let first = svc.ready().await.unwrap().call(request("a")).await.unwrap();
    assert_eq!(first.headers()["retry-after"], "60");
    // within the cache's hold: the cached denial counts the store's wait down
    tokio::time::advance(Duration::from_millis(900)).await;
    let cached = svc.ready().await.unwrap().call(request("a")).await.unwrap();
    assert_eq!(cached.status(), StatusCode::TOO_MANY_REQUESTS);
    let decision = cached.extensions().get::<RateLimitDecision>().unwrap();
    assert_eq!(decision.source(), DecisionSource::DenyCache);
    assert_eq!(decision.retry_after(), Duration::from_millis(59_100));
    // past it the store is asked again, and says the same
    tokio::time::advance(Duration::from_millis(19_100)).await;
    let asked = svc.ready().await.unwrap().call(request("a")).await.unwrap();
    assert_eq!(asked.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(asked.headers()["retry-after"], "40");
    assert_eq!(asked.headers()["ratelimit"], r#""m";r=0;t=40"#);
    let decision = asked.extensions().get::<RateLimitDecision>().unwrap();
    assert_eq!(decision.source(), DecisionSource::Store);
}

#[tokio::test(start_paused = true)]
async fn deny_cache_can_be_switched_off() {
    let store = Counting::default();
    let checks = store.checks.clone();
    let mut svc = service(
        RateLimitLayer::builder(store)
            .limit(Limit::per_minute("m", 1))
            .deny_cache(false),
    );
    for _ in 0..5 {
        status(&mut svc, "a").await;
    }
    assert_eq!(checks.load(Ordering::SeqCst), 5);
}

#[tokio::test(start_paused = true)]
async fn failure_policies() {
    let store = Counting::default();
    store.down.store(true, Ordering::SeqCst);
    let build = |policy| {
        service(
            RateLimitLayer::builder(store.clone())
                .limit(Limit::per_minute("m", 4))
                .on_store_error(policy),
        )
    };

    let mut allow = build(OnStoreError::Allow);
    for _ in 0..10 {
        let res = respond(&mut allow, "a").await;
        assert_eq!(res.status(), StatusCode::OK);
        let decision = res.extensions().get::<RateLimitDecision>().unwrap();
        assert_eq!(decision.source(), DecisionSource::StoreUnavailable);
        assert!(res.headers().get("ratelimit").is_none());
    }

    let mut deny = build(OnStoreError::Deny);
    let res = respond(&mut deny, "a").await;
    assert_eq!(res.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(res.headers()["retry-after"], "1");

    let mut fallback = build(OnStoreError::LocalFallback { copies: 2 });
    let statuses: Vec<_> = futures_util::future::join_all((0..4).map(|_| {
        let mut svc = fallback.clone();
        async move { status(&mut svc, "a").await }
    }))
    .await;
    assert_eq!(
        statuses.iter().filter(|s| **s == StatusCode::OK).count(),
        2,
        "4 / 2 copies"
    );
    let res = respond(&mut fallback, "a").await;
    assert_eq!(res.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(
        res.extensions()
            .get::<RateLimitDecision>()
            .unwrap()
            .source(),
        DecisionSource::LocalFallback
    );
}

#[tokio::test]
async fn missing_keys_and_free_requests() {
    let mut strict =
        service(RateLimitLayer::builder(MemoryStore::new()).limit(Limit::per_minute("m", 1)));
    let res = send(&mut strict, Request::new(())).await;
    assert_eq!(res.status(), StatusCode::BAD_REQUEST);

    let mut lenient = service(
        RateLimitLayer::builder(MemoryStore::new())
            .limit(Limit::per_minute("m", 1))
            .on_missing_key(MissingKey::Allow),
    );
    for _ in 0..3 {
        let res = send(&mut lenient, Request::new(())).await;
        assert_eq!(res.status(), StatusCode::OK);
    }

    let mut free = service(
        RateLimitLayer::builder(MemoryStore::new())
            .limit(Limit::per_minute("m", 1))
            .cost(|parts| u64::from(parts.uri.path() != "/free")),
    );
    for _ in 0..3 {
        let req = Request::get("/free")
            .header("x-caller", "a")
            .body(())
            .unwrap();
        assert_eq!(
            free.ready()
                .await
                .unwrap()
                .call(req)
                .await
                .unwrap()
                .status(),
            StatusCode::OK
        );
    }
    assert_eq!(status(&mut free, "a").await, StatusCode::OK);
    assert_eq!(status(&mut free, "a").await, StatusCode::TOO_MANY_REQUESTS);
}

#[test]
fn invalid_configurations_are_refused_at_build_time() {
    let build = |limits: Vec<Limit>| {
        RateLimitLayer::builder(MemoryStore::new())
            .limits(limits)
            .build()
    };
    assert!(build(vec![]).is_err());
    assert!(build(vec![Limit::per_second("zero", 0)]).is_err());
    assert!(build(vec![Limit::new("w", 1, Duration::ZERO)]).is_err());
    assert!(build(vec![Limit::per_second("bad name", 1)]).is_err());
    assert!(build(vec![Limit::per_second("a\"b", 1)]).is_err());
    assert!(
        build(vec![
            Limit::per_second("dup", 1),
            Limit::per_minute("dup", 5)
        ])
        .is_err()
    );
    assert!(
        RateLimitLayer::builder(MemoryStore::new())
            .limit(Limit::per_second("s", 1))
            .on_store_error(OnStoreError::LocalFallback { copies: 0 })
            .build()
            .is_err()
    );
    assert!(
        RateLimitLayer::builder(MemoryStore::new())
            .limit(Limit::per_second("s", 1))
            .prefix("a{b")
            .build()
            .is_err()
    );
    assert!(build(vec![Limit::per_second("ok", 1)]).is_ok());
}

/// A layer stacked outside another (per caller around per path) adds its `RateLimit` members
/// to the inner one's and keeps its decision beside the inner one's.
#[tokio::test(start_paused = true)]
async fn stacked_layers_append_their_members_and_decisions() {
    let store = MemoryStore::new();
    let inner = RateLimitLayer::builder(store.clone())
        .prefix("inner")
        .limit(Limit::per_minute("per-path", 5))
        .build()
        .unwrap();
    let outer = RateLimitLayer::builder(store)
        .prefix("outer")
        .limit(Limit::per_minute("per-caller", 3))
        .key(Header::from_static("x-caller"))
        .build()
        .unwrap();
    let svc = tower::ServiceBuilder::new()
        .layer(outer)
        .layer(inner)
        .service(service_fn(ok as fn(_) -> _));
    let response = svc.oneshot(request("a")).await.unwrap();
    let lines = |name: &str| -> Vec<String> {
        response
            .headers()
            .get_all(name)
            .iter()
            .map(|v| v.to_str().unwrap().to_owned())
            .collect()
    };
    assert_eq!(
        lines("ratelimit-policy"),
        [r#""per-path";q=5;w=60"#, r#""per-caller";q=3;w=60"#]
    );
    assert_eq!(
        lines("ratelimit"),
        [r#""per-path";r=4;t=60"#, r#""per-caller";r=2;t=60"#]
    );
    let all = response.extensions().get::<RateLimitDecisions>().unwrap();
    let names: Vec<_> = all.iter().map(|d| d.limits()[0].0.to_owned()).collect();
    assert_eq!(names, ["per-path", "per-caller"]);
    let outermost = response.extensions().get::<RateLimitDecision>().unwrap();
    assert_eq!(outermost.limits()[0].0, "per-caller");
}

/// The status and body text that `layer` answers `request` with.
async fn answer<K: crate::key::KeyExtractor>(
    layer: &RateLimitLayer<K>,
    request: Request<()>,
) -> (StatusCode, String) {
    use http_body_util::{BodyExt, Full};
    let inner = service_fn(|_: Request<()>| async {
        Ok::<_, Infallible>(Response::new(Full::new(bytes::Bytes::new())))
    });
    let response = tower_layer::Layer::layer(layer, inner)
        .oneshot(request)
        .await
        .unwrap();
    let status = response.status();
    let body = response.into_body().collect().await.unwrap().to_bytes();
    (status, String::from_utf8_lossy(&body).into_owned())
}

#[tokio::test]
async fn a_request_without_a_key_learns_where_the_key_is_read_from() {
    let layer = RateLimitLayer::builder(MemoryStore::new())
        .limit(Limit::per_minute("m", 1))
        .key(Header::from_static("x-caller"))
        .build()
        .unwrap();
    let (status, body) = answer(&layer, Request::new(())).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert!(
        body.contains(
            "\"detail\":\"the request carries no rate-limit key: it is read from header x-caller\""
        ),
        "{body}"
    );
}

/// A key read by a function is the service's business: a request without one is told so
/// without the function's name; and the answer's status is the service's choice (a `401` where
/// the key is the caller's credential).
#[tokio::test]
async fn a_missing_key_may_be_answered_401_and_names_nothing_internal() {
    let layer = RateLimitLayer::builder(MemoryStore::new())
        .limit(Limit::per_minute("m", 1))
        .key(crate::key::from_fn("api-key", |parts| {
            parts
                .headers
                .get("authorization")
                .map(|v| v.as_bytes().to_vec())
        }))
        .on_missing_key(MissingKey::RejectWith(StatusCode::UNAUTHORIZED))
        .build()
        .unwrap();
    let (status, body) = answer(&layer, Request::new(())).await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);
    assert!(
        body.contains("\"status\":401")
            && body.contains(
                "\"detail\":\"the request carries no rate-limit key: it is read from the request\""
            ),
        "{body}"
    );
    assert!(!body.contains("api-key") && !body.contains("fn:"), "{body}");
    let keyed = Request::get("/")
        .header("authorization", "k")
        .body(())
        .unwrap();
    assert_eq!(answer(&layer, keyed).await.0, StatusCode::OK);
}

/// An admin endpoint peeks at a caller as a request of it would be counted: its key from a
/// function, its tier as `tier_by` chooses it — and resets it by the function's key.
#[tokio::test]
async fn peek_request_follows_tier_by_and_from_fn_keys_can_be_named() {
    let by_user = crate::key::from_fn("user", |p: &http::request::Parts| {
        p.headers.get("x-user").map(|v| v.as_bytes().to_vec())
    });
    let layer = RateLimitLayer::builder(MemoryStore::new())
        .limit(Limit::per_minute("m", 5))
        .tier("pro", vec![Limit::per_minute("m", 50)])
        .tier_by(|p| p.headers.get("x-plan")?.to_str().ok())
        .key(by_user.clone())
        .build()
        .unwrap();
    let head = |plan: &str| {
        let req = Request::get("/")
            .header("x-user", "ann")
            .header("x-plan", plan);
        req.body(()).unwrap().into_parts().0
    };
    let mut svc = tower_layer::Layer::layer(
        &layer,
        service_fn(|_: Request<()>| async { Ok::<_, Infallible>(Response::new(())) }),
    );
    let pro = Request::from_parts(head("pro"), ());
    assert_eq!(
        svc.ready().await.unwrap().call(pro).await.unwrap().status(),
        StatusCode::OK
    );
    let peeked = layer.peek_request(&head("pro")).await.unwrap().unwrap();
    assert_eq!(peeked.limits[0].remaining, 49, "the pro tier's limits");
    assert_eq!(
        layer.peek(by_user.key(b"ann")).await.unwrap().limits[0].remaining,
        5
    );
    let anonymous = Request::get("/").body(()).unwrap().into_parts().0;
    assert!(layer.peek_request(&anonymous).await.unwrap().is_none());
    layer.reset(by_user.key(b"ann")).await.unwrap();
    let peeked = layer.peek_request(&head("pro")).await.unwrap().unwrap();
    assert_eq!(peeked.limits[0].remaining, 50);
}

/// A request that waits for room does so in a span `rate_limit.wait` that says how it ended and
/// how long it waited; a request admitted at once opens none.
#[test]
fn a_wait_is_a_span_with_its_outcome_and_time() {
    let (log, _default) = crate::captured::Captured::install(tracing::Level::DEBUG);
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .start_paused(true)
        .build()
        .unwrap();
    runtime.block_on(async {
        let layer = RateLimitLayer::builder(MemoryStore::new())
            .limit(Limit::per_second("s", 1))
            .queue(Duration::from_secs(2))
            .build()
            .unwrap();
        let svc = tower::Layer::layer(
            &layer,
            service_fn(|_: Request<()>| async { Ok::<_, Infallible>(Response::new(())) }),
        );
        for _ in 0..2 {
            let response = svc.clone().oneshot(Request::new(())).await.unwrap();
            assert_eq!(response.status(), StatusCode::OK);
        }
    });
    let log = log.text();
    let waits: Vec<&str> = log
        .lines()
        .filter(|line| line.contains("rate_limit.wait") && line.contains("close"))
        .collect();
    assert_eq!(waits.len(), 1, "{log}");
    assert!(
        waits[0].contains("tollgate.outcome=\"admitted\""),
        "{}",
        waits[0]
    );
    let waited: u64 = waits[0]
        .split("tollgate.waited_ms=")
        .nth(1)
        .and_then(|rest| rest.split(|c: char| !c.is_ascii_digit()).next())
        .and_then(|ms| ms.parse().ok())
        .unwrap();
    assert!((990..=1_010).contains(&waited), "{}", waits[0]);
}

/// A cost larger than a limit's quota can never be admitted: it is refused at once rather than
/// waiting out its patience (and holding its caller's line); a patience of more than a day is
/// refused when the layer is built.
#[tokio::test(start_paused = true)]
async fn a_cost_no_limit_can_hold_does_not_wait() {
    let layer = RateLimitLayer::builder(MemoryStore::new())
        .limit(Limit::per_second("s", 10))
        .cost(|parts| parts.headers.get("x-cost").map_or(1, |_| 20))
        .queue(Duration::from_secs(5))
        .build()
        .unwrap();
    let svc = tower::Layer::layer(
        &layer,
        service_fn(|_: Request<()>| async { Ok::<_, Infallible>(Response::new(())) }),
    );
    let started = tokio::time::Instant::now();
    let big = Request::builder().header("x-cost", "20").body(()).unwrap();
    let response = svc.clone().oneshot(big).await.unwrap();
    assert_eq!(response.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(started.elapsed(), Duration::ZERO, "refused without waiting");
    // the line is free: a small request passes at once
    let response = svc.oneshot(Request::new(())).await.unwrap();
    assert_eq!(response.status(), StatusCode::OK);

    let too_patient = RateLimitLayer::builder(MemoryStore::new())
        .limit(Limit::per_second("s", 10))
        .queue(Duration::from_secs(2 * 24 * 60 * 60))
        .build();
    let error = too_patient.unwrap_err();
    assert!(error.to_string().contains("at most a day"), "{error}");
}

/// A request waiting for room holds nothing of the inner service's: its readiness (a permit of
/// a concurrency limit, a slot of a buffer) is taken once it is admitted, so another caller's
/// request goes through meanwhile.
#[tokio::test(start_paused = true)]
async fn a_waiting_request_holds_no_readiness_of_the_inner_service() {
    let layer = RateLimitLayer::builder(MemoryStore::new())
        .limit(Limit::per_second("s", 1))
        .key(Header::from_static("x-k"))
        .queue(Duration::from_secs(2))
        .build()
        .unwrap();
    let svc = tower::ServiceBuilder::new()
        .layer(layer)
        .concurrency_limit(1)
        .service_fn(|_: Request<()>| async { Ok::<_, Infallible>(Response::new(())) });
    let of = |k: &str| Request::builder().header("x-k", k).body(()).unwrap();
    assert_eq!(
        svc.clone().oneshot(of("alice")).await.unwrap().status(),
        200
    );
    let waiting = tokio::spawn(svc.clone().oneshot(of("alice")));
    tokio::time::sleep(Duration::from_millis(10)).await;
    let started = tokio::time::Instant::now();
    assert_eq!(svc.clone().oneshot(of("bob")).await.unwrap().status(), 200);
    assert_eq!(
        started.elapsed(),
        Duration::ZERO,
        "bob did not wait for alice's room"
    );
    let alice = waiting.await.unwrap().unwrap();
    assert_eq!(alice.status(), 200);
    let waited = alice
        .extensions()
        .get::<RateLimitDecision>()
        .unwrap()
        .waited();
    assert!(waited >= Duration::from_millis(990), "{waited:?}");
}
