//! The `metrics` series (feature `metrics`, on for the tests) as a recorder sees them, on a real
//! redis-server: exact counts per phase. One test: the recorder is global to this binary.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::convert::Infallible;
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use metrics_util::debugging::{DebugValue, DebuggingRecorder, Snapshotter};
use tower::{ServiceBuilder, ServiceExt};

use common::RedisServer;
use tollgate::idempotency::{IdempotencyLayer, RequestBody};
use tollgate::key::Header;
use tollgate::lock::Locks;
use tollgate::metrics::{
    IDEMPOTENCY_REQUESTS, LIMITS_IN_FORCE, LOCK_ACQUISITIONS, RATE_LIMIT_DECISIONS,
    RATE_LIMIT_WAIT, STORE_CALL_DURATION, STORE_ERRORS,
};
use tollgate::rate_limit::{Algorithm, Limit, RateLimitLayer};
use tollgate::store::RedisStore;

/// What one phase recorded: per series name and labels (sorted `k=v` joined by `,`), the
/// counter's increase or the histogram's number of samples.
fn recorded(snapshotter: &Snapshotter) -> Vec<(String, String, u64)> {
    let mut out: Vec<_> = snapshotter
        .snapshot()
        .into_vec()
        .into_iter()
        .filter_map(|(key, _, _, value)| {
            let key = key.key();
            let mut labels: Vec<String> = key
                .labels()
                .map(|l| format!("{}={}", l.key(), l.value()))
                .collect();
            labels.sort();
            let n = match value {
                DebugValue::Counter(n) => n,
                DebugValue::Histogram(samples) => samples.len() as u64,
                DebugValue::Gauge(_) => return None,
            };
            (n > 0).then(|| (key.name().to_owned(), labels.join(","), n))
        })
        .collect();
    out.sort();
    out
}

fn series(name: &str, labels: &str, n: u64) -> (String, String, u64) {
    (name.to_owned(), labels.to_owned(), n)
}

fn get(client: &str) -> Request<Full<Bytes>> {
    Request::get("/")
        .header("x-client", client)
        .body(Full::default())
        .unwrap()
}

async fn hello(_: Request<Full<Bytes>>) -> Result<Response<Full<Bytes>>, Infallible> {
    Ok(Response::new(Full::from("hello")))
}

async fn pay(_: Request<RequestBody<Full<Bytes>>>) -> Result<Response<Full<Bytes>>, Infallible> {
    Ok(Response::new(Full::from("paid")))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_series_counts_exactly_what_happened() {
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    recorder
        .install()
        .expect("the only recorder of this binary");
    let mut server = RedisServer::start();
    let store = RedisStore::builder(server.url())
        .timeout(Duration::from_millis(300))
        .max_batch(1)
        .build()
        .unwrap();

    // rate limits: 2 admitted, 1 denied by the store, 2 by the deny cache
    let layer = RateLimitLayer::builder(store.clone())
        .prefix("m")
        .limit(Limit::per_hour("h", 2))
        .algorithm(Algorithm::Gcra)
        .key(Header::from_static("x-client"))
        .build()
        .unwrap();
    let svc = ServiceBuilder::new()
        .layer(layer)
        .service(tower::service_fn(hello));
    let mut statuses = Vec::new();
    for _ in 0..5 {
        statuses.push(svc.clone().oneshot(get("alice")).await.unwrap().status());
    }
    assert_eq!(statuses.iter().filter(|s| **s == StatusCode::OK).count(), 2);
    let limiter = "limiter=m:rl";
    assert_eq!(
        recorded(&snapshotter),
        vec![
            series(
                RATE_LIMIT_DECISIONS,
                &format!("{limiter},outcome=admitted,source=store"),
                2
            ),
            series(
                RATE_LIMIT_DECISIONS,
                &format!("{limiter},outcome=denied,source=deny_cache"),
                2
            ),
            series(
                RATE_LIMIT_DECISIONS,
                &format!("{limiter},outcome=denied,source=store"),
                1
            ),
            series(STORE_CALL_DURATION, "operation=rate_check", 3),
        ]
    );

    // idempotency: executed, replayed, mismatch
    let idempotent = ServiceBuilder::new()
        .layer(
            IdempotencyLayer::builder(store.clone())
                .unscoped()
                .build()
                .unwrap(),
        )
        .service(tower::service_fn(pay));
    let post = |body: &'static str| {
        Request::post("/pay")
            .header("idempotency-key", "k-1")
            .body(Full::from(body))
            .unwrap()
    };
    for (body, status) in [
        ("a", StatusCode::OK),
        ("a", StatusCode::OK),
        ("b", StatusCode::UNPROCESSABLE_ENTITY),
    ] {
        let response = idempotent.clone().oneshot(post(body)).await.unwrap();
        assert_eq!(response.status(), status);
        // the whole body: the record is stored before it ends
        response.into_body().collect().await.unwrap();
    }
    let phase = recorded(&snapshotter);
    for expected in [
        series(IDEMPOTENCY_REQUESTS, "outcome=executed", 1),
        series(IDEMPOTENCY_REQUESTS, "outcome=mismatch", 1),
        series(IDEMPOTENCY_REQUESTS, "outcome=replayed", 1),
        series(STORE_CALL_DURATION, "operation=idempotency_begin", 3),
        series(STORE_CALL_DURATION, "operation=idempotency_complete", 1),
    ] {
        assert!(phase.contains(&expected), "{expected:?} in {phase:?}");
    }

    // locks: acquired, busy, released
    let locks = Locks::new(store.clone());
    let guard = locks
        .try_acquire("report", Duration::from_secs(10))
        .await
        .unwrap();
    assert!(
        locks
            .try_acquire("report", Duration::from_secs(10))
            .await
            .is_err()
    );
    guard.release().await.unwrap();
    assert_eq!(
        recorded(&snapshotter),
        vec![
            series(LOCK_ACQUISITIONS, "outcome=acquired", 1),
            series(LOCK_ACQUISITIONS, "outcome=busy", 1),
            series(STORE_CALL_DURATION, "operation=lock_acquire", 2),
            series(STORE_CALL_DURATION, "operation=lock_release", 1),
        ]
    );

    // waiting for room: the second request waits, then is admitted
    let queued = ServiceBuilder::new()
        .layer(
            RateLimitLayer::builder(store.clone())
                .prefix("q")
                .limit(Limit::new("s", 1, Duration::from_millis(400)))
                .queue(Duration::from_secs(2))
                .key(Header::from_static("x-client"))
                .build()
                .unwrap(),
        )
        .service(tower::service_fn(hello));
    for _ in 0..2 {
        let status = queued.clone().oneshot(get("carol")).await.unwrap().status();
        assert_eq!(status, StatusCode::OK);
    }
    // the request that waited stood in the store's line once, and left it once admitted: in
    // the background, after its answer, so it is awaited here
    let left = series(STORE_CALL_DURATION, "operation=leave_line", 1);
    let mut phase = recorded(&snapshotter);
    for _ in 0..200 {
        if phase.contains(&left) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
        phase.extend(recorded(&snapshotter));
    }
    for expected in [
        series(STORE_CALL_DURATION, "operation=line_up", 1),
        left,
        series(
            RATE_LIMIT_DECISIONS,
            "limiter=q:rl,outcome=admitted,source=store",
            2,
        ),
        series(RATE_LIMIT_WAIT, "limiter=q:rl,outcome=admitted", 1),
    ] {
        assert!(phase.contains(&expected), "{expected:?} in {phase:?}");
    }
    assert!(
        !phase
            .iter()
            .any(|(name, labels, _)| name == RATE_LIMIT_DECISIONS && labels.contains("denied")),
        "a request that waited is decided once: {phase:?}"
    );

    // the store down: one decision by the failure policy, one timed-out call
    server.pause();
    let status = svc.clone().oneshot(get("bob")).await.unwrap().status();
    server.resume();
    assert_eq!(status, StatusCode::OK, "allowed while the store is down");
    assert_eq!(
        recorded(&snapshotter),
        vec![
            series(
                RATE_LIMIT_DECISIONS,
                &format!("{limiter},outcome=admitted,source=store_unavailable"),
                1
            ),
            series(STORE_CALL_DURATION, "operation=rate_check", 1),
            series(STORE_ERRORS, "kind=timeout,operation=rate_check", 1),
        ]
    );
    server.kill();

    // idempotency in the handler's transaction on PostgreSQL: executed, then replayed
    let pg = common::postgres::store().await;
    let in_transaction = ServiceBuilder::new()
        .layer(
            IdempotencyLayer::in_transaction(pg)
                .unscoped()
                .build()
                .unwrap(),
        )
        .service(tower::service_fn(pay));
    recorded(&snapshotter); // the migration's calls
    for replayed in [false, true] {
        let response = in_transaction.clone().oneshot(post("a")).await.unwrap();
        assert_eq!(response.status(), StatusCode::OK);
        assert_eq!(
            response.headers().contains_key("idempotent-replayed"),
            replayed
        );
        response.into_body().collect().await.unwrap();
    }
    assert_eq!(
        recorded(&snapshotter),
        vec![
            series(IDEMPOTENCY_REQUESTS, "outcome=executed", 1),
            series(IDEMPOTENCY_REQUESTS, "outcome=replayed", 1),
            series(STORE_CALL_DURATION, "operation=once_begin", 2),
            series(STORE_CALL_DURATION, "operation=once_commit", 1),
        ]
    );

    // the limits in force: a copy built with other defaults than those in force says so
    let pg = common::postgres::store().await;
    let copy = |quota| {
        RateLimitLayer::builder(pg.clone())
            .prefix("lim")
            .limit(Limit::per_hour("h", quota))
            .build_in_store()
    };
    let (_seeded, _other) = (copy(5).await.unwrap(), copy(9).await.unwrap());
    assert_eq!(
        gauges(&snapshotter, LIMITS_IN_FORCE),
        vec![
            ("drift=false,limiter=lim:rl".to_owned(), 1.0),
            ("drift=true,limiter=lim:rl".to_owned(), 1.0),
        ]
    );
}

/// The values of the gauge `name`, per labels (sorted `k=v` joined by `,`).
fn gauges(snapshotter: &Snapshotter, name: &str) -> Vec<(String, f64)> {
    let mut out: Vec<_> = snapshotter
        .snapshot()
        .into_vec()
        .into_iter()
        .filter(|(key, _, _, _)| key.key().name() == name)
        .filter_map(|(key, _, _, value)| {
            let mut labels: Vec<String> = key
                .key()
                .labels()
                .map(|l| format!("{}={}", l.key(), l.value()))
                .collect();
            labels.sort();
            match value {
                DebugValue::Gauge(value) => Some((labels.join(","), value.into_inner())),
                _ => None,
            }
        })
        .collect();
    out.sort_by(|a, b| a.0.cmp(&b.0));
    out
}
