//! The example app's coupons, report locks and payments across copies on one Redis, and on one
//! PostgreSQL database: the checks users run — several copies, many parallel requests, exactly
//! one success — and outages of either store.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use crate::common;
use crate::router as app;

use std::sync::Arc;
use std::time::Duration;

use app::{AppConfig, AppState};
use axum::Router;
use axum::body::Body;
use common::RedisServer;
use common::postgres::{self, PgServer};
use http::{Request, Response, StatusCode};
use http_body_util::BodyExt;
use serde_json::Value;
use tollgate::store::{MemoryStore, RedisStore, Store};
use tower::ServiceExt;

/// How long a report rebuild works here: long enough that ten requests sent together all
/// reach the store while the first holds the lock, on a loaded machine too.
const REBUILD: Duration = Duration::from_secs(2);

fn config(payment_delay: Duration) -> AppConfig {
    AppConfig {
        limits: app::parse_limits("burst:1000/1s").unwrap(),
        payment_delay,
        report_work: REBUILD,
        api_keys: crate::own_keys(&["merchant-1"]),
        ..AppConfig::defaults().unwrap()
    }
}

/// A copy of the app on each of `stores`.
fn copies_of(stores: Vec<Arc<dyn Store>>, payment_delay: Duration) -> Vec<Router> {
    stores
        .into_iter()
        .map(|store| app::router(AppState::new(store, config(payment_delay)).unwrap()))
        .collect()
}

/// `n` copies of the app, each with its own connection to `server`, as separate processes.
/// Their store calls may take 2 s: hundreds at once on a loaded machine are not a failure.
fn copies(server: &RedisServer, n: usize, payment_delay: Duration) -> Vec<Router> {
    let stores = (0..n)
        .map(|_| {
            let store = RedisStore::builder(server.url())
                .timeout(Duration::from_secs(2))
                .build()
                .unwrap();
            Arc::new(store) as Arc<dyn Store>
        })
        .collect();
    copies_of(stores, payment_delay)
}

/// `n` copies of the app on one schema of `server`, each with its own pool, as separate
/// processes; the schema is migrated by the first (every copy migrates at start in the app).
async fn pg_copies(server: &PgServer, n: usize, payment_delay: Duration) -> Vec<Router> {
    let schema = postgres::unique_schema();
    let mut stores: Vec<Arc<dyn Store>> = Vec::new();
    for _ in 0..n {
        let store = server
            .builder()
            .schema(schema.clone())
            .connect()
            .await
            .expect("a migrated store");
        stores.push(Arc::new(store));
    }
    copies_of(stores, payment_delay)
}

/// The PostgreSQL server this test binary shares.
async fn shared_pg() -> &'static PgServer {
    tokio::task::spawn_blocking(postgres::shared).await.unwrap()
}

async fn send(app: Router, request: Request<Body>) -> (StatusCode, http::HeaderMap, Value) {
    let response: Response<Body> = app.oneshot(request).await.unwrap();
    let (parts, body) = response.into_parts();
    let bytes = body.collect().await.unwrap().to_bytes();
    let json = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
    (parts.status, parts.headers, json)
}

fn redeem(code: &str) -> Request<Body> {
    Request::post(format!("/coupons/{code}/redeem"))
        .body(Body::empty())
        .unwrap()
}

/// Sends `parallel` redemptions of one coupon spread over `apps`; returns (200s, 409s).
async fn redeem_in_parallel(apps: &[Router], code: &str, parallel: usize) -> (usize, usize) {
    let mut tasks = tokio::task::JoinSet::new();
    for i in 0..parallel {
        let app = apps[i % apps.len()].clone();
        let code = code.to_owned();
        tasks.spawn(async move { send(app, redeem(&code)).await });
    }
    let (mut ok, mut conflict) = (0, 0);
    while let Some(answer) = tasks.join_next().await {
        let (status, _, body) = answer.unwrap();
        assert_eq!(body["coupon"], code);
        match status {
            StatusCode::OK => {
                ok += 1;
                assert_eq!(body["status"], "redeemed");
            }
            StatusCode::CONFLICT => {
                conflict += 1;
                assert_eq!(body["status"], "already_redeemed");
            }
            other => panic!("unexpected {other}: {body}"),
        }
    }
    (ok, conflict)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_copies_fifty_parallel_redemptions_exactly_one_succeeds() {
    let server = RedisServer::start();
    fifty_redemptions_one_success(copies(&server, 2, Duration::ZERO)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_postgres_two_copies_fifty_parallel_redemptions_exactly_one_succeeds() {
    let apps = pg_copies(shared_pg().await, 2, Duration::ZERO).await;
    fifty_redemptions_one_success(apps).await;
}

async fn fifty_redemptions_one_success(apps: Vec<Router>) {
    for coupon in 0..20 {
        let code = format!("SAVE{coupon}");
        assert_eq!(
            redeem_in_parallel(&apps, &code, 50).await,
            (1, 49),
            "{code}"
        );
        // and it stays redeemed
        assert_eq!(
            send(apps[1].clone(), redeem(&code)).await.0,
            StatusCode::CONFLICT
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn four_copies_five_hundred_parallel_redemptions_exactly_one_succeeds() {
    let server = RedisServer::start();
    five_hundred_redemptions_one_success(copies(&server, 4, Duration::ZERO)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_postgres_four_copies_five_hundred_parallel_redemptions_exactly_one_succeeds() {
    let apps = pg_copies(shared_pg().await, 4, Duration::ZERO).await;
    five_hundred_redemptions_one_success(apps).await;
}

async fn five_hundred_redemptions_one_success(apps: Vec<Router>) {
    for code in ["BIG1", "BIG2", "BIG3"] {
        assert_eq!(
            redeem_in_parallel(&apps, code, 500).await,
            (1, 499),
            "{code}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_process_state_would_fail_the_coupon_check() {
    // Two copies, each on a store of its own (what an in-process set amounts to): both redeem.
    let apps: Vec<Router> = (0..2)
        .map(|_| {
            let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
            app::router(AppState::new(store, config(Duration::ZERO)).unwrap())
        })
        .collect();
    assert_eq!(redeem_in_parallel(&apps, "LOCAL", 50).await, (2, 48));
}

/// The check as a user writes it with `tollgate::testing`: a throwaway `redis-server`, two copies
/// of the app on it (each with its own connection, as separate processes), 50 redemptions at
/// once — and the same two copies on stores of their own, which redeem twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_coupon_check_with_tollgate_testing() {
    use tollgate::testing::{Copies, RedisServer};

    let server = RedisServer::start().unwrap_or_else(|e| panic!("{e}"));
    let shared = Copies::new(2, |_| {
        let store = RedisStore::builder(server.url())
            .timeout(Duration::from_secs(2))
            .build()
            .unwrap();
        app::router(AppState::new(Arc::new(store), config(Duration::ZERO)).unwrap())
    });
    let statuses = shared.fire(50, |_| redeem("SHARED")).await;
    assert_eq!(statuses.count(StatusCode::OK), 1, "\n{statuses}");
    assert_eq!(statuses.count(StatusCode::CONFLICT), 49, "\n{statuses}");
    assert_eq!(statuses.errors(), 0);
    assert_eq!(
        statuses.count_at(0, StatusCode::CONFLICT) + statuses.count_at(1, StatusCode::CONFLICT),
        49
    );

    let apart = Copies::new(2, |_| {
        let store = Arc::new(MemoryStore::new());
        app::router(AppState::new(store, config(Duration::ZERO)).unwrap())
    });
    let statuses = apart.fire(50, |_| redeem("APART")).await;
    assert_eq!(statuses.count_at(0, StatusCode::OK), 1, "\n{statuses}");
    assert_eq!(statuses.count_at(1, StatusCode::OK), 1, "\n{statuses}");
    assert_eq!(statuses.count(StatusCode::CONFLICT), 48, "\n{statuses}");
    let table = statuses.to_string();
    let lines: Vec<&str> = table.lines().collect();
    assert_eq!(
        lines,
        [
            "copy       200   409  error",
            "0            1    24      0",
            "1            1    24      0",
            "total        2    48      0",
        ]
    );
}

/// The same check on a throwaway PostgreSQL server of `tollgate::testing`: two copies, each
/// with its own pool on one schema, 50 redemptions at once, exactly one success.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_postgres_the_coupon_check_with_tollgate_testing() {
    use tollgate::testing::{Copies, PgServer};

    let server = tokio::task::spawn_blocking(PgServer::start)
        .await
        .unwrap()
        .unwrap_or_else(|e| panic!("{e}"));
    let mut stores = Vec::new();
    for _ in 0..2 {
        let store = tollgate::store::PgStore::builder(server.url())
            .timeout(Duration::from_secs(2))
            .connect()
            .await
            .expect("a migrated store");
        stores.push(Arc::new(store));
    }
    let copies = Copies::new(2, |i| {
        let state = AppState::new(stores[i].clone(), config(Duration::ZERO)).unwrap();
        app::router(state)
    });
    let statuses = copies.fire(50, |_| redeem("PG")).await;
    assert_eq!(statuses.count(StatusCode::OK), 1, "\n{statuses}");
    assert_eq!(statuses.count(StatusCode::CONFLICT), 49, "\n{statuses}");
    assert_eq!(statuses.errors(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redemptions_fail_closed_when_redis_is_down() {
    let mut server = RedisServer::start();
    let apps = copies(&server, 2, Duration::ZERO);
    server.kill();
    for app in &apps {
        let (status, _, body) = send(app.clone(), redeem("DOWN")).await;
        assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(body["status"], "unavailable");
    }
    server.restart();
    let start = std::time::Instant::now();
    loop {
        let (status, _, _) = send(apps[0].clone(), redeem("DOWN")).await;
        if status == StatusCode::OK {
            break;
        }
        assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
        assert!(start.elapsed() < Duration::from_secs(10));
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // the 503s recorded nothing: the first answered redemption won, the next one lost
    assert_eq!(
        send(apps[1].clone(), redeem("DOWN")).await.0,
        StatusCode::CONFLICT
    );
}

fn rebuild(name: &str) -> Request<Body> {
    Request::post(format!("/reports/{name}/rebuild"))
        .body(Body::empty())
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn report_rebuilds_are_exclusive_with_increasing_fencing_tokens() {
    let server = RedisServer::start();
    exclusive_rebuilds(copies(&server, 2, Duration::ZERO)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_postgres_report_rebuilds_are_exclusive_with_increasing_fencing_tokens() {
    exclusive_rebuilds(pg_copies(shared_pg().await, 2, Duration::ZERO).await).await;
}

async fn exclusive_rebuilds(apps: Vec<Router>) {
    let mut last = 0u64;
    for round in 0..3 {
        let mut tasks = tokio::task::JoinSet::new();
        for i in 0..10 {
            let app = apps[i % 2].clone();
            tasks.spawn(async move { send(app, rebuild("daily")).await });
        }
        let mut rebuilt = Vec::new();
        let mut busy = 0;
        while let Some(answer) = tasks.join_next().await {
            let (status, _, body) = answer.unwrap();
            match status {
                StatusCode::OK => rebuilt.push(body["fencing_token"].as_u64().unwrap()),
                StatusCode::CONFLICT => {
                    assert_eq!(body["status"], "busy");
                    busy += 1;
                }
                other => panic!("unexpected {other}: {body}"),
            }
        }
        // the rebuild takes 2 s and all ten start together: one runs, nine find it busy
        assert_eq!((rebuilt.len(), busy), (1, 9), "round {round}");
        assert!(
            rebuilt[0] > last,
            "fencing token {} after {last}",
            rebuilt[0]
        );
        last = rebuilt[0];
    }
    // another report has a lock of its own
    assert_eq!(
        send(apps[0].clone(), rebuild("weekly")).await.0,
        StatusCode::OK
    );
}

fn pay(key: Option<&str>, body: &str) -> Request<Body> {
    let mut request = Request::post("/payments")
        .header("content-type", "application/json")
        .header("x-api-key", "merchant-1");
    if let Some(key) = key {
        request = request.header("idempotency-key", key);
    }
    request.body(Body::from(body.to_owned())).unwrap()
}

const PAYMENT: &str = r#"{"amount": 1999, "currency": "EUR"}"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_copies_fifty_parallel_payments_with_one_key_execute_once() {
    let server = RedisServer::start();
    fifty_payments_one_execution(copies(&server, 2, Duration::from_millis(100))).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_postgres_two_copies_fifty_parallel_payments_with_one_key_execute_once() {
    let apps = pg_copies(shared_pg().await, 2, Duration::from_millis(100)).await;
    fifty_payments_one_execution(apps).await;
}

async fn fifty_payments_one_execution(apps: Vec<Router>) {
    let mut tasks = tokio::task::JoinSet::new();
    for i in 0..50 {
        let app = apps[i % 2].clone();
        tasks.spawn(async move { send(app, pay(Some("order-7"), PAYMENT)).await });
    }
    let mut ids = std::collections::HashSet::new();
    let mut conflicts = 0;
    while let Some(answer) = tasks.join_next().await {
        let (status, headers, body) = answer.unwrap();
        match status {
            StatusCode::CREATED => {
                assert_eq!(body["amount"], 1999);
                assert_eq!(body["currency"], "EUR");
                ids.insert(body["id"].as_str().unwrap().to_owned());
            }
            StatusCode::CONFLICT => {
                assert!(headers.contains_key("retry-after"));
                conflicts += 1;
            }
            other => panic!("unexpected {other}: {body}"),
        }
    }
    assert_eq!(ids.len(), 1, "one payment executed: {ids:?}");
    assert!(conflicts < 50);
    let id = ids.into_iter().next().unwrap();

    // a later retry, on either copy, is the replay
    for app in &apps {
        let (status, headers, body) = send(app.clone(), pay(Some("order-7"), PAYMENT)).await;
        assert_eq!(status, StatusCode::CREATED);
        assert_eq!(headers["idempotent-replayed"], "true");
        assert_eq!(body["id"], id.as_str());
    }
    // the same key with another body is refused
    let changed = r#"{"amount": 2999, "currency": "EUR"}"#;
    assert_eq!(
        send(apps[0].clone(), pay(Some("order-7"), changed)).await.0,
        StatusCode::UNPROCESSABLE_ENTITY
    );
    // another key is another payment
    let (status, _, body) = send(apps[1].clone(), pay(Some("order-8"), PAYMENT)).await;
    assert_eq!(status, StatusCode::CREATED);
    assert_ne!(body["id"], id.as_str());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn payments_refuse_bad_requests_and_fail_closed() {
    let mut server = RedisServer::start();
    let apps = copies(&server, 1, Duration::ZERO);
    let app = &apps[0];
    // no key: required
    assert_eq!(
        send(app.clone(), pay(None, PAYMENT)).await.0,
        StatusCode::BAD_REQUEST
    );
    // invalid JSON
    let (status, _, body) = send(app.clone(), pay(Some("bad-json"), "{nope")).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert!(
        body["error"]
            .as_str()
            .unwrap()
            .starts_with("invalid payment")
    );
    // store down: 503, nothing executed (the key is free once Redis is back)
    server.kill();
    let (status, headers, _) = send(app.clone(), pay(Some("during-outage"), PAYMENT)).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    assert!(headers.contains_key("retry-after"));
    server.restart();
    let start = std::time::Instant::now();
    loop {
        let (status, headers, _) = send(app.clone(), pay(Some("during-outage"), PAYMENT)).await;
        if status == StatusCode::CREATED {
            assert!(
                headers.get("idempotent-replayed").is_none(),
                "a first execution"
            );
            break;
        }
        assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
        assert!(start.elapsed() < Duration::from_secs(10));
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Payments act for a tenant: without an API key, or with one the table does not know, `401`
/// and nothing runs or is recorded; two tenants using the same `Idempotency-Key` get payments
/// of their own, neither a replay of the other's.
#[tokio::test]
async fn payments_need_a_tenant_and_keys_are_scoped_by_it() {
    let config = AppConfig {
        api_keys: crate::own_keys(&["merchant-1", "merchant-2"]),
        ..config(Duration::ZERO)
    };
    let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
    let app = app::router(AppState::new(store, config).unwrap());
    let payment = |api_key: Option<&str>| {
        let mut request = Request::post("/payments")
            .header("content-type", "application/json")
            .header("idempotency-key", "order-17");
        if let Some(api_key) = api_key {
            request = request.header("x-api-key", api_key);
        }
        request.body(Body::from(PAYMENT)).unwrap()
    };
    for anonymous in [None, Some("merchant-3")] {
        let (status, headers, _) = send(app.clone(), payment(anonymous)).await;
        assert_eq!(status, StatusCode::UNAUTHORIZED, "{anonymous:?}");
        assert!(headers.get("idempotent-replayed").is_none());
    }
    let (first, _, one) = send(app.clone(), payment(Some("merchant-1"))).await;
    let (second, headers, two) = send(app.clone(), payment(Some("merchant-2"))).await;
    assert_eq!((first, second), (StatusCode::CREATED, StatusCode::CREATED));
    assert!(
        headers.get("idempotent-replayed").is_none(),
        "not merchant-1's"
    );
    assert_ne!(one["id"], two["id"]);
    let (again, headers, replay) = send(app.clone(), payment(Some("merchant-1"))).await;
    assert_eq!(again, StatusCode::CREATED);
    assert_eq!(headers["idempotent-replayed"], "true");
    assert_eq!(replay["id"], one["id"]);
}
