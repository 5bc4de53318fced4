//! Ambiguous store answers below the example app: claims, locks and the idempotency layer on a
//! real redis-server behind a [`Proxy`] that delays replies (a command that ran, answered too
//! late) or cuts the connection. Each test fails without the handling it names.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use crate::common;

use std::convert::Infallible;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use common::RedisServer;
use common::proxy::Proxy;
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use tollgate::claim::Claims;
use tollgate::idempotency::{IdempotencyBody, IdempotencyLayer, RequestBody};
use tollgate::lock::{LockError, Locks};
use tollgate::store::{RedisStore, StoreErrorKind};
use tower::{Layer, Service, ServiceExt};

const STORE_TIMEOUT: Duration = Duration::from_millis(250);
/// Replies this late have run on the server but miss the store timeout.
const LATE: Duration = Duration::from_millis(400);

fn through(proxy: &Proxy) -> RedisStore {
    RedisStore::builder(proxy.url())
        .timeout(STORE_TIMEOUT)
        .build()
        .unwrap()
}

fn unique(name: &str) -> String {
    format!("{name}-{:016x}", rand::random::<u64>())
}

/// Polls `attempt` every 50 ms for up to `within`; how long it took to succeed.
async fn eventually<F, Fut>(within: Duration, mut attempt: F) -> Option<Duration>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let start = Instant::now();
    while start.elapsed() < within {
        if attempt().await {
            return Some(start.elapsed());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    None
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unanswered_claim_once_is_undone_once_the_store_answers() {
    let server = RedisServer::start();
    let proxy = Proxy::start(server.addr()).await;
    let late = Claims::new(through(&proxy));
    let direct = Claims::new(server.store());
    let name = unique("coupon");
    assert!(late.claim_once("warm-up", None).await.unwrap().won());

    proxy.delay_replies(LATE);
    let error = late.claim_once(&name, None).await.unwrap_err();
    assert_eq!(error.kind(), StoreErrorKind::Timeout);
    proxy.delay_replies(Duration::ZERO);

    // the undo's marker exists only if it found the attempt's holder in the claim: the attempt
    // did make the claim on the server
    let undone = eventually(Duration::from_secs(3), || async {
        keys(&server, "tollgate:claim:*:released") == 1
    })
    .await;
    assert!(
        undone.is_some(),
        "the attempt reported as failed still holds the claim 3 s after the store answers again"
    );
    assert!(direct.claim_once(&name, None).await.unwrap().won());
    assert!(
        !direct.claim_once(&name, None).await.unwrap().won(),
        "won once"
    );
}

fn keys(server: &RedisServer, pattern: &str) -> usize {
    let found: Vec<String> = redis::cmd("KEYS")
        .arg(pattern)
        .query(&mut server.conn())
        .unwrap();
    found.len()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unanswered_claim_once_as_is_won_by_its_holders_retry() {
    let server = RedisServer::start();
    let proxy = Proxy::start(server.addr()).await;
    let late = Claims::new(through(&proxy));
    let name = unique("order");
    assert!(late.claim_once("warm-up", None).await.unwrap().won());

    proxy.delay_replies(LATE);
    assert!(late.claim_once_as(&name, "order-1", None).await.is_err());
    proxy.delay_replies(Duration::ZERO);
    // longer than any background undo takes: there must be none for a caller-chosen holder
    tokio::time::sleep(Duration::from_secs(1)).await;
    let retry = late.claim_once_as(&name, "order-1", None).await.unwrap();
    assert!(
        retry.won(),
        "the holder's retry learns that its lost attempt won"
    );
    let other = late.claim_once_as(&name, "order-2", None).await.unwrap();
    assert!(!other.won());
    assert_eq!(other.holder(), "order-1");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unanswered_lock_attempt_is_undone_once_the_store_answers() {
    let server = RedisServer::start();
    let proxy = Proxy::start(server.addr()).await;
    let late = Locks::new(through(&proxy));
    let direct = Locks::new(server.store());
    let name = unique("report");
    let lease = Duration::from_secs(60);
    late.try_acquire("warm-up", lease)
        .await
        .unwrap()
        .release()
        .await
        .unwrap();

    proxy.delay_replies(LATE);
    assert!(matches!(
        late.try_acquire(&name, lease).await,
        Err(LockError::Store(_))
    ));
    proxy.delay_replies(Duration::ZERO);

    // the undo's marker exists only if it found the attempt's token in the lock: the attempt
    // did take the lock on the server
    let undone = eventually(Duration::from_secs(3), || async {
        keys(&server, "tollgate:lock:*:released") == 2 // the warm-up's and the undo's
    })
    .await;
    assert!(
        undone.is_some(),
        "the attempt reported as failed still holds the lock (lease 60 s) 3 s after the store answers"
    );
    let guard = direct.try_acquire(&name, lease).await.unwrap();
    guard.release().await.unwrap();
}

type Svc = tower::util::BoxCloneService<
    Request<Full<Bytes>>,
    Response<IdempotencyBody<Full<Bytes>>>,
    Infallible,
>;

/// An idempotency layer on `store` with a one-second lease, over a handler that takes 200 ms
/// and answers `201` with `body` (none when empty); counts its runs.
fn payments(store: RedisStore, body: &'static str, runs: Arc<AtomicUsize>) -> Svc {
    let layer = IdempotencyLayer::builder(store)
        .unscoped()
        .lease(Duration::from_secs(1))
        .build()
        .unwrap();
    let handler = tower::service_fn(move |_: Request<RequestBody<Full<Bytes>>>| {
        let run = runs.fetch_add(1, Ordering::SeqCst) + 1;
        async move {
            tokio::time::sleep(Duration::from_millis(200)).await;
            let body = if body.is_empty() {
                Bytes::new()
            } else {
                Bytes::from(format!("{body} {run}"))
            };
            let mut response = Response::new(Full::new(body));
            *response.status_mut() = StatusCode::CREATED;
            Ok::<_, Infallible>(response)
        }
    });
    tower::util::BoxCloneService::new(layer.layer(handler))
}

/// Warms `svc` up: pays under fresh keys until one is answered `201` (its connection open, its
/// scripts loaded), for at most 10 s.
async fn warm_up(svc: &mut Svc) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let (status, ..) = answer(svc, &unique("warm-up")).await;
        if status == StatusCode::CREATED {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "setup: no payment succeeded for 10 s: {status}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Returns once the handler counting its runs in `runs` has been entered again since it had
/// run `before` times: the request's claim was confirmed, and the handler works for 200 ms.
async fn handler_entered(runs: &AtomicUsize, before: usize) {
    common::wait_for("the handler entered", || {
        runs.load(Ordering::SeqCst) > before
    })
    .await;
}

fn pay(key: &str) -> Request<Full<Bytes>> {
    Request::post("/payments")
        .header("idempotency-key", key)
        .body(Full::new(Bytes::from_static(b"{}")))
        .unwrap()
}

/// Status, body and whether the body ended normally.
async fn answer(svc: &mut Svc, key: &str) -> (StatusCode, Bytes, bool) {
    let response = svc.ready().await.unwrap().call(pay(key)).await.unwrap();
    let status = response.status();
    let retry_after = response.headers().get("retry-after").cloned();
    match response.into_body().collect().await {
        Ok(body) => {
            if status == StatusCode::SERVICE_UNAVAILABLE {
                assert_eq!(retry_after.unwrap(), "1");
            }
            (status, body.to_bytes(), true)
        }
        Err(_) => (status, Bytes::new(), false),
    }
}

/// The layer's answer when the store did not confirm the record: problem details, in place of
/// the handler's head and body.
const UNRECORDED: &str = "{\"type\":\"about:blank\",\"title\":\"Service Unavailable\",\"status\":503,\"detail\":\"the response could not be recorded; retry with the same Idempotency-Key to learn the outcome\"}\n";

/// The store goes away while the handler runs, for longer than the lease: whether the response
/// has a body or none, the caller gets `503` with `Retry-After` — never the handler's `201`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_record_the_store_never_confirms_is_answered_503_never_201() {
    let server = RedisServer::start();
    let proxy = Proxy::start(server.addr()).await;
    let runs = Arc::new(AtomicUsize::new(0));
    for (body, key) in [("paid", unique("with-body")), ("", unique("bodiless"))] {
        let mut svc = payments(through(&proxy), body, Arc::clone(&runs));
        warm_up(&mut svc).await;
        let cut = {
            let (proxy, runs) = (&proxy, &runs);
            let before = runs.load(Ordering::SeqCst);
            async move {
                handler_entered(runs, before).await;
                proxy.cut();
            }
        };
        // the store goes away while the handler runs and stays away longer than the lease
        let (first, ()) = tokio::join!(answer(&mut svc, &key), cut);
        let (status, got, complete) = first;
        assert_eq!(
            status,
            StatusCode::SERVICE_UNAVAILABLE,
            "a success whose record was never confirmed went out as {status}"
        );
        assert!(complete, "the 503 is a whole answer");
        assert_eq!(got, UNRECORDED, "the handler's body never went out");
        proxy.heal();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_record_stored_but_unconfirmed_is_replayed_to_the_retry() {
    let server = RedisServer::start();
    let proxy = Proxy::start(server.addr()).await;
    let runs = Arc::new(AtomicUsize::new(0));
    let mut svc = payments(through(&proxy), "paid", Arc::clone(&runs));
    warm_up(&mut svc).await;
    let warm_runs = runs.load(Ordering::SeqCst);
    let key = unique("late");
    let late = {
        let (proxy, runs) = (&proxy, &runs);
        let before = runs.load(Ordering::SeqCst);
        async move {
            handler_entered(runs, before).await;
            proxy.delay_replies(LATE);
        }
    };
    // the completion runs on the server, but no confirmation arrives within the lease
    let (first, ()) = tokio::join!(answer(&mut svc, &key), late);
    assert_eq!(
        first.0,
        StatusCode::SERVICE_UNAVAILABLE,
        "an unconfirmed record went out as {}",
        first.0
    );
    assert_eq!(first.1, UNRECORDED);
    proxy.delay_replies(Duration::ZERO);
    let (status, body, complete) = answer(&mut svc, &key).await;
    assert_eq!(status, StatusCode::CREATED);
    assert!(complete);
    assert_eq!(
        body,
        format!("paid {}", warm_runs + 1),
        "the retry replays the stored record"
    );
    assert_eq!(
        runs.load(Ordering::SeqCst),
        warm_runs + 1,
        "one run of the payment: never run twice"
    );
}
