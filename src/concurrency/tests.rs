//! The layer on a [`MemoryStore`], and its failure policies on a store that always fails.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use tokio::time::Instant;
use tower::{Service, ServiceBuilder, ServiceExt, service_fn};

use super::*;
use crate::error::ConfigErrorKind;
use crate::key::Header;
use crate::store::{Hold, MemoryStore, PermitAttempt, StoreError, StoreFuture};

/// A store that is always down.
#[derive(Debug)]
struct Down;

impl PermitStore for Down {
    fn timeout(&self) -> Duration {
        Duration::from_millis(50)
    }

    fn permit_acquire(&self, _: PermitRequest, _: Instant) -> StoreFuture<PermitAttempt> {
        Box::pin(async { Err(StoreError::timeout()) })
    }

    fn permit_extend(&self, _: Hold, _: Duration, _: Instant) -> StoreFuture<bool> {
        Box::pin(async { Err(StoreError::timeout()) })
    }

    fn permit_release(&self, _: Hold) -> StoreFuture<bool> {
        Box::pin(async { Err(StoreError::timeout()) })
    }
}

use crate::store::PermitRequest;
use crate::store::PermitStore;

type Svc = tower::util::BoxCloneService<
    Request<Full<Bytes>>,
    Response<PermitBody<Full<Bytes>>>,
    Infallible,
>;

/// A service behind `layer` that answers with the fencing token of its permit (or `none`).
fn service(layer: ConcurrencyLimitLayer<Header>) -> Svc {
    let inner = service_fn(|req: Request<Full<Bytes>>| async move {
        let fence = req
            .extensions()
            .get::<Permit>()
            .map_or_else(|| "none".to_owned(), |p| p.fencing_token().to_string());
        Ok::<_, Infallible>(Response::new(Full::new(Bytes::from(fence))))
    });
    tower::util::BoxCloneService::new(ServiceBuilder::new().layer(layer).service(inner))
}

fn builder(store: impl PermitStore) -> ConcurrencyLimitLayerBuilder<Header> {
    ConcurrencyLimitLayer::builder(store).key(Header::from_static("x-tenant"))
}

fn call(tenant: &str) -> Request<Full<Bytes>> {
    Request::post("/jobs")
        .header("x-tenant", tenant)
        .body(Full::default())
        .unwrap()
}

async fn text(response: Response<PermitBody<Full<Bytes>>>) -> String {
    let body = response.into_body().collect().await.unwrap().to_bytes();
    String::from_utf8(body.to_vec()).unwrap()
}

/// Lets the background releases run.
async fn settle() {
    tokio::time::sleep(Duration::from_millis(20)).await;
}

#[tokio::test]
async fn at_most_limit_in_flight_per_key_and_a_permit_per_response() {
    let layer = builder(MemoryStore::new())
        .limit(2)
        .retry_after(Duration::from_millis(1500))
        .build()
        .unwrap();
    let svc = service(layer);
    let first = svc.clone().oneshot(call("acme")).await.unwrap();
    let second = svc.clone().oneshot(call("acme")).await.unwrap();
    assert_eq!(
        (first.status(), second.status()),
        (StatusCode::OK, StatusCode::OK)
    );
    let refused = svc.clone().oneshot(call("acme")).await.unwrap();
    assert_eq!(refused.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(refused.headers()["retry-after"], "2");
    assert_eq!(
        refused.headers()["content-type"],
        "application/problem+json"
    );
    assert_eq!(
        text(refused).await,
        "{\"type\":\"https://iana.org/assignments/http-problem-types#quota-exceeded\",\
         \"title\":\"Too Many Requests\",\"status\":429,\
         \"detail\":\"too many requests in flight for this key: at most 2\"}\n"
    );
    // another tenant is not affected
    assert_eq!(
        svc.clone().oneshot(call("other")).await.unwrap().status(),
        StatusCode::OK
    );

    // a body read to its end gives its permit back
    let fence: u64 = text(first).await.parse().unwrap();
    settle().await;
    let third = svc.clone().oneshot(call("acme")).await.unwrap();
    assert_eq!(third.status(), StatusCode::OK);
    assert!(text(third).await.parse::<u64>().unwrap() > fence);
    drop(second);
}

#[tokio::test]
async fn a_dropped_response_gives_its_permit_back() {
    let layer = builder(MemoryStore::new()).limit(1).build().unwrap();
    let svc = service(layer);
    let held = svc.clone().oneshot(call("acme")).await.unwrap();
    let refused = svc.clone().oneshot(call("acme")).await.unwrap();
    assert_eq!(refused.status(), StatusCode::TOO_MANY_REQUESTS);
    // without a hint, the first lease's end (10 s by default)
    assert_eq!(refused.headers()["retry-after"], "10");
    drop(held);
    settle().await;
    assert_eq!(
        svc.oneshot(call("acme")).await.unwrap().status(),
        StatusCode::OK
    );
}

#[tokio::test]
async fn a_failed_handler_gives_its_permit_back() {
    let layer = builder(MemoryStore::new()).limit(1).build().unwrap();
    let failing = service_fn(|_: Request<Full<Bytes>>| async {
        Err::<Response<Full<Bytes>>, _>("handler failed")
    });
    let mut svc = ServiceBuilder::new().layer(layer.clone()).service(failing);
    assert!(svc.ready().await.unwrap().call(call("acme")).await.is_err());
    settle().await;
    let ok = service(layer).oneshot(call("acme")).await.unwrap();
    assert_eq!(ok.status(), StatusCode::OK);
}

#[tokio::test]
async fn grpc_calls_are_refused_with_resource_exhausted() {
    let svc = service(builder(MemoryStore::new()).limit(1).build().unwrap());
    let grpc = || {
        Request::post("/pkg.Jobs/Run")
            .header("x-tenant", "acme")
            .header("content-type", "application/grpc")
            .body(Full::default())
            .unwrap()
    };
    let _held = svc.clone().oneshot(grpc()).await.unwrap();
    let refused = svc.oneshot(grpc()).await.unwrap();
    assert_eq!(refused.status(), StatusCode::OK);
    assert_eq!(refused.headers()["grpc-status"], "8");
}

#[tokio::test]
async fn a_request_without_a_key_is_refused_or_let_through() {
    let no_key = || Request::post("/jobs").body(Full::default()).unwrap();
    let svc = service(builder(MemoryStore::new()).limit(1).build().unwrap());
    let refused = svc.oneshot(no_key()).await.unwrap();
    assert_eq!(refused.status(), StatusCode::BAD_REQUEST);
    assert!(text(refused).await.contains("header x-tenant"));
    let layer = builder(MemoryStore::new())
        .limit(1)
        .on_missing_key(MissingKey::Allow)
        .build()
        .unwrap();
    let svc = service(layer);
    let _first = svc.clone().oneshot(no_key()).await.unwrap();
    let second = svc.oneshot(no_key()).await.unwrap();
    assert_eq!(second.status(), StatusCode::OK);
    assert_eq!(text(second).await, "none", "unlimited, without a permit");
}

/// The answer to a request without a key may be another status: a `401` where the key is the
/// caller's credential, UNAUTHENTICATED for a gRPC call.
#[tokio::test]
async fn a_request_without_a_key_may_be_answered_401() {
    let layer = builder(MemoryStore::new())
        .limit(1)
        .on_missing_key(MissingKey::RejectWith(StatusCode::UNAUTHORIZED))
        .build()
        .unwrap();
    let no_key = Request::post("/jobs").body(Full::default()).unwrap();
    let refused = service(layer.clone()).oneshot(no_key).await.unwrap();
    assert_eq!(refused.status(), StatusCode::UNAUTHORIZED);
    assert!(text(refused).await.contains("header x-tenant"));
    let grpc = Request::post("/jobs")
        .header("content-type", "application/grpc")
        .body(Full::default())
        .unwrap();
    let refused = service(layer).oneshot(grpc).await.unwrap();
    assert_eq!(refused.headers()["grpc-status"], "16");
}

#[tokio::test]
async fn a_store_that_fails_is_met_by_the_failure_policy() {
    let allow = service(builder(Down).limit(1).build().unwrap());
    let let_through = allow.oneshot(call("acme")).await.unwrap();
    assert_eq!(let_through.status(), StatusCode::OK);
    assert_eq!(text(let_through).await, "none");

    let deny = builder(Down).limit(1).on_store_error(OnStoreError::Deny);
    let refused = service(deny.build().unwrap())
        .oneshot(call("acme"))
        .await
        .unwrap();
    assert_eq!(refused.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(refused.headers()["retry-after"], "1");

    // 5 permits over 2 copies: 3 in this one
    let fallback = OnStoreError::LocalFallback { copies: 2 };
    let layer = builder(Down)
        .limit(5)
        .on_store_error(fallback)
        .build()
        .unwrap();
    let local = Arc::clone(layer.settings.local.as_ref().unwrap());
    let svc = service(layer);
    let mut held = Vec::new();
    for _ in 0..3 {
        let admitted = svc.clone().oneshot(call("acme")).await.unwrap();
        assert_eq!(admitted.status(), StatusCode::OK);
        held.push(admitted);
    }
    let refused = svc.clone().oneshot(call("acme")).await.unwrap();
    assert_eq!(refused.status(), StatusCode::TOO_MANY_REQUESTS);
    let key = Header::from_static("x-tenant").key(b"acme");
    assert_eq!(local.held(key), 3);
    held.clear();
    assert_eq!(local.held(key), 0, "given back as the responses went");
    assert_eq!(
        svc.oneshot(call("acme")).await.unwrap().status(),
        StatusCode::OK
    );
}

#[test]
fn configurations_that_cannot_work_are_refused() {
    let kind = |b: ConcurrencyLimitLayerBuilder<Header>| b.build().unwrap_err().kind();
    assert_eq!(kind(builder(MemoryStore::new())), ConfigErrorKind::Limit);
    assert_eq!(
        kind(builder(MemoryStore::new()).limit(0)),
        ConfigErrorKind::Limit
    );
    let brief = builder(MemoryStore::new())
        .limit(1)
        .lease(Duration::from_millis(1));
    assert_eq!(kind(brief), ConfigErrorKind::Duration);
    let nobody = OnStoreError::LocalFallback { copies: 0 };
    let fallback = builder(MemoryStore::new()).limit(1).on_store_error(nobody);
    assert_eq!(kind(fallback), ConfigErrorKind::FailurePolicy);
    let braces = builder(MemoryStore::new()).limit(1).prefix("a{b}");
    assert_eq!(kind(braces), ConfigErrorKind::Prefix);
}

#[tokio::test]
async fn waiters_are_admitted_in_arrival_order_within_their_patience() {
    let layer = builder(MemoryStore::new())
        .limit(1)
        .queue(Duration::from_secs(5))
        .build()
        .unwrap();
    let svc = service(layer);
    let first = svc.clone().oneshot(call("acme")).await.unwrap();
    let mut waiters = Vec::new();
    for _ in 0..3 {
        waiters.push(tokio::spawn(svc.clone().oneshot(call("acme"))));
        // each one queued before the next arrives
        tokio::time::sleep(Duration::from_millis(30)).await;
    }
    let mut last: u64 = text(first).await.parse().unwrap();
    for waiter in waiters {
        let admitted = waiter.await.unwrap().unwrap();
        assert_eq!(admitted.status(), StatusCode::OK);
        // its body read to the end gives the permit to the next waiter
        let fence: u64 = text(admitted).await.parse().unwrap();
        assert!(fence > last);
        last = fence;
    }
}

#[tokio::test]
async fn a_waiter_past_its_patience_is_refused_and_leaves_the_queue() {
    let layer = builder(MemoryStore::new())
        .limit(1)
        .queue(Duration::from_millis(200))
        .build()
        .unwrap();
    let svc = service(layer);
    let held = svc.clone().oneshot(call("acme")).await.unwrap();
    let started = tokio::time::Instant::now();
    let refused = svc.clone().oneshot(call("acme")).await.unwrap();
    assert_eq!(refused.status(), StatusCode::TOO_MANY_REQUESTS);
    assert!(started.elapsed() >= Duration::from_millis(100), "it waited");
    drop(held);
    settle().await;
    // nobody is left waiting ahead: the next request gets the permit
    let next = svc.oneshot(call("acme")).await.unwrap();
    assert_eq!(next.status(), StatusCode::OK);
}

/// A request counts against its tier's limit, under its key: a pro request gets three at once
/// where a request of no tier (or of an unknown one) gets one.
#[tokio::test]
async fn tiers_give_each_plan_its_own_limit() {
    let layer = builder(MemoryStore::new())
        .limit(1)
        .tier("pro", 3)
        .tier_by(|parts| parts.headers.get("x-plan")?.to_str().ok())
        .build()
        .unwrap();
    let svc = service(layer);
    let planned = |plan: &str| {
        Request::post("/jobs")
            .header("x-tenant", "acme")
            .header("x-plan", plan)
            .body(Full::default())
            .unwrap()
    };
    let mut held = Vec::new();
    for i in 0..3 {
        let response = svc.clone().oneshot(planned("pro")).await.unwrap();
        assert_eq!(response.status(), StatusCode::OK, "pro request {i}");
        held.push(response);
    }
    let fourth = svc.clone().oneshot(planned("pro")).await.unwrap();
    assert_eq!(fourth.status(), StatusCode::TOO_MANY_REQUESTS);
    assert!(text(fourth).await.contains("at most 3"));
    for plain in [call("acme"), planned("gold")] {
        let refused = svc.clone().oneshot(plain).await.unwrap();
        assert_eq!(refused.status(), StatusCode::TOO_MANY_REQUESTS);
        assert!(text(refused).await.contains("at most 1"));
    }
    drop(held);
    settle().await;
    assert_eq!(
        svc.oneshot(call("acme")).await.unwrap().status(),
        StatusCode::OK
    );
}

#[test]
fn tiers_without_tier_by_or_with_a_zero_limit_are_refused() {
    let refused = |b: ConcurrencyLimitLayerBuilder<Header>| b.build().unwrap_err().to_string();
    assert!(refused(builder(MemoryStore::new()).limit(1).tier("pro", 3)).contains("tier_by"));
    let zero = builder(MemoryStore::new())
        .limit(1)
        .tier("pro", 0)
        .tier_by(|_| Some("pro"));
    assert!(
        refused(zero).starts_with("concurrency limit \"tollgate\": tier \"pro\" needs"),
        "the layer and the tier are named"
    );
    let twice = builder(MemoryStore::new())
        .limit(1)
        .tier("pro", 2)
        .tier("pro", 3)
        .tier_by(|_| Some("pro"));
    assert!(refused(twice).contains("twice"));
}

#[tokio::test]
async fn an_advertised_limit_is_in_the_ietf_headers_of_its_tier() {
    let layer = builder(MemoryStore::new())
        .limit(1)
        .tier("pro", 3)
        .tier_by(|parts| parts.headers.get("x-plan")?.to_str().ok())
        .advertise("jobs")
        .retry_after(Duration::from_millis(1500))
        .build()
        .unwrap();
    let mut svc = service(layer);
    let held = svc.ready().await.unwrap().call(call("a")).await.unwrap();
    assert_eq!(
        held.headers()["ratelimit-policy"],
        r#""jobs";q=1;qu="concurrent-requests""#
    );
    assert!(held.headers().get("ratelimit").is_none(), "admitted");
    let refused = svc.ready().await.unwrap().call(call("a")).await.unwrap();
    assert_eq!(refused.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(
        refused.headers()["ratelimit-policy"],
        r#""jobs";q=1;qu="concurrent-requests""#
    );
    assert_eq!(refused.headers()["ratelimit"], r#""jobs";r=0;t=2"#);
    assert!(text(refused).await.ends_with(
        r#""violated-policies":["jobs"]}
"#
    ));
    let mut pro = call("b");
    pro.headers_mut().insert("x-plan", "pro".parse().unwrap());
    let pro = svc.ready().await.unwrap().call(pro).await.unwrap();
    assert_eq!(
        pro.headers()["ratelimit-policy"],
        r#""jobs";q=3;qu="concurrent-requests""#
    );
    drop(held);
}

#[test]
fn an_advertised_name_is_checked() {
    let error = builder(MemoryStore::new())
        .limit(1)
        .advertise("in flight")
        .build()
        .unwrap_err();
    assert_eq!(error.kind(), ConfigErrorKind::Limit);
    assert!(error.to_string().contains("\"in flight\""), "{error}");
}

/// A limit in flight outside an idempotency layer — the wrong way round: each replay takes a
/// permit. The layer says so, once, at warn; a replay through the right order says nothing.
#[test]
fn a_replay_that_takes_a_permit_is_said_once() {
    use crate::idempotency::{IdempotencyLayer, RequestBody};

    let (log, _default) = crate::captured::Captured::install(tracing::Level::WARN);
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let warnings = || log.text().matches("took a permit").count();
    runtime.block_on(async {
        let store = MemoryStore::new();
        let handler = service_fn(|_: Request<RequestBody<Full<Bytes>>>| async {
            Ok::<_, Infallible>(Response::new(Full::from("paid")))
        });
        let idempotency = || {
            IdempotencyLayer::builder(store.clone())
                .unscoped()
                .build()
                .unwrap()
        };
        let limit = || {
            ConcurrencyLimitLayer::builder(store.clone())
                .limit(2)
                .build()
                .unwrap()
        };
        let pay = |key: &str| {
            Request::post("/pay")
                .header("idempotency-key", key)
                .body(Full::<Bytes>::default())
                .unwrap()
        };
        let right = ServiceBuilder::new()
            .layer(idempotency())
            .layer(limit())
            .service(handler);
        for _ in 0..3 {
            let response = right.clone().oneshot(pay("k-1")).await.unwrap();
            response.into_body().collect().await.unwrap();
        }
        assert_eq!(warnings(), 0);
        let wrong = ServiceBuilder::new()
            .layer(limit())
            .layer(idempotency())
            .service(handler);
        for replayed in [false, true, true] {
            let response = wrong.clone().oneshot(pay("k-2")).await.unwrap();
            assert_eq!(
                response.headers().contains_key("idempotent-replayed"),
                replayed
            );
            response.into_body().collect().await.unwrap();
            // the permit goes back in a task of its own
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    });
    assert_eq!(warnings(), 1);
}
