//! The example app's token budget (`POST /llm/complete`): each request reserves `x-max-tokens`
//! and is charged the tokens it used after the response — on one copy and on two copies of one
//! Redis or one PostgreSQL database, under each algorithm.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use crate::common;
use crate::router as app;

use std::sync::Arc;

use app::{AppConfig, AppState};
use axum::Router;
use axum::body::Body;
use common::RedisServer;
use common::postgres;
use http::{Request, StatusCode};
use http_body_util::BodyExt;
use serde_json::Value;
use tollgate::rate_limit::Algorithm;
use tollgate::store::Store;
use tower::ServiceExt;

const ALGORITHMS: [Algorithm; 3] = [
    Algorithm::SlidingLog,
    Algorithm::SlidingCounter,
    Algorithm::Gcra,
];

fn config(algorithm: Algorithm, callers: &[&str]) -> AppConfig {
    AppConfig {
        api_keys: crate::own_keys(callers),
        limits: app::parse_limits("burst:1000/1s").unwrap(),
        algorithm,
        // a window of a day: nothing refills while a test runs, whatever the algorithm
        token_limits: app::parse_limits("tokens:1000/86400s").unwrap(),
        ..AppConfig::defaults().unwrap()
    }
}

fn copies_of(stores: &[Arc<dyn Store>], algorithm: Algorithm, callers: &[&str]) -> Vec<Router> {
    stores
        .iter()
        .map(|store| {
            let config = config(algorithm, callers);
            app::router(AppState::new(Arc::clone(store), config).unwrap())
        })
        .collect()
}

/// `POST /llm/complete` for `key`, using `tokens`, reserving `max` when given: its status, and
/// the tokens the handler reports when it ran.
async fn complete(
    app: Router,
    key: String,
    tokens: u64,
    max: Option<u64>,
) -> (StatusCode, Option<u64>) {
    let mut request = Request::post("/llm/complete").header("x-api-key", key);
    if let Some(max) = max {
        request = request.header("x-max-tokens", max);
    }
    let body = Body::from(format!("{{\"tokens\": {tokens}}}"));
    let response = app.oneshot(request.body(body).unwrap()).await.unwrap();
    let status = response.status();
    let used = response
        .headers()
        .get("x-tokens-used")
        .map(|v| v.to_str().unwrap().parse().unwrap());
    if status == StatusCode::TOO_MANY_REQUESTS {
        assert!(response.headers().contains_key("retry-after"));
        assert_eq!(
            response.headers()["content-type"],
            "application/problem+json"
        );
        assert_eq!(used, None, "the handler did not run");
    }
    let bytes = response.into_body().collect().await.unwrap().to_bytes();
    if status == StatusCode::OK {
        let body: Value = serde_json::from_slice(&bytes).unwrap();
        assert_eq!(body["tokens"], tokens);
    }
    (status, used)
}

/// Sends `n` completions one after another, alternating over `apps`: how many ran.
async fn sequential(apps: &[Router], key: &str, n: usize, tokens: u64, max: Option<u64>) -> usize {
    let mut ran = 0;
    for i in 0..n {
        let (status, _) = complete(apps[i % apps.len()].clone(), key.to_owned(), tokens, max).await;
        match status {
            StatusCode::OK => ran += 1,
            StatusCode::TOO_MANY_REQUESTS => {}
            other => panic!("unexpected {other}"),
        }
    }
    ran
}

/// The three checks of a budget of 1000 tokens, on `stores` (one copy of the app on each).
async fn budget_is_charged_what_was_used(stores: &[Arc<dyn Store>]) {
    for algorithm in ALGORITHMS {
        let key = |name: &str| format!("{name}-{}", uuid::Uuid::new_v4().simple());
        let (unreserved, reserved, parallel, zero) = (
            key("unreserved"),
            key("reserved"),
            key("parallel"),
            key("zero"),
        );
        let callers = [&*unreserved, &*reserved, &*parallel, &*zero];
        let apps = copies_of(stores, algorithm, &callers);
        // no reservation (1 each): 900 used after three, the fourth fits and overruns to 1200
        let ran = sequential(&apps, &unreserved, 8, 300, None).await;
        assert_eq!(ran, 4, "{algorithm}: 300 each, unreserved");
        // 300 reserved, 100 used: the ninth reservation (800 used + 300) does not fit
        let ran = sequential(&apps, &reserved, 12, 100, Some(300)).await;
        assert_eq!(ran, 8, "{algorithm}: 100 each, 300 reserved");
        // declaring 0 reserves 1 and pays its usage: 500 each, the third finds the budget spent
        let ran = sequential(&apps, &zero, 4, 500, Some(0)).await;
        assert_eq!(ran, 2, "{algorithm}: 500 each, 0 declared");
        // 10 at once reserving what they use: 3 fit
        let calls = (0..10).map(|i| {
            complete(
                apps[i % apps.len()].clone(),
                parallel.clone(),
                300,
                Some(300),
            )
        });
        let answers = futures_util::future::join_all(calls).await;
        let ran = answers
            .iter()
            .filter(|(status, _)| *status == StatusCode::OK)
            .count();
        let refused = answers
            .iter()
            .filter(|(status, _)| *status == StatusCode::TOO_MANY_REQUESTS)
            .count();
        assert_eq!((ran, refused), (3, 7), "{algorithm}: 300 at once");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_copy_charges_the_tokens_used() {
    let server = RedisServer::start();
    budget_is_charged_what_was_used(&[Arc::new(server.store())]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_copies_charge_the_tokens_used() {
    let server = RedisServer::start();
    let stores: Vec<Arc<dyn Store>> = vec![Arc::new(server.store()), Arc::new(server.store())];
    budget_is_charged_what_was_used(&stores).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_postgres_two_copies_charge_the_tokens_used() {
    let server = tokio::task::spawn_blocking(postgres::shared).await.unwrap();
    let schema = postgres::unique_schema();
    let mut stores: Vec<Arc<dyn Store>> = Vec::new();
    for _ in 0..2 {
        stores.push(Arc::new(
            server
                .builder()
                .schema(schema.clone())
                .connect()
                .await
                .unwrap(),
        ));
    }
    budget_is_charged_what_was_used(&stores).await;
}

#[tokio::test]
async fn on_the_memory_store_one_copy_charges_the_tokens_used() {
    budget_is_charged_what_was_used(&[Arc::new(tollgate::store::MemoryStore::new())]).await;
}

/// What a completion reserves: its `x-max-tokens` held to at least 1 — a declared 0 is not
/// free — and at most the ceiling; 1 when absent or not a number.
#[test]
fn a_reservation_is_held_between_one_and_the_ceiling() {
    let reserved = |value: Option<&str>| {
        let mut headers = http::HeaderMap::new();
        if let Some(value) = value {
            headers.insert("x-max-tokens", value.parse().unwrap());
        }
        app::reserved_tokens(&headers, 1000)
    };
    assert_eq!(reserved(Some("0")), 1);
    assert_eq!(reserved(None), 1);
    assert_eq!(reserved(Some("many")), 1);
    assert_eq!(reserved(Some("-5")), 1);
    assert_eq!(reserved(Some("300")), 300);
    assert_eq!(reserved(Some("1000")), 1000);
    assert_eq!(reserved(Some("18446744073709551615")), 1000);
}

/// A completion needs an API key: without one, or with one the table does not know, `401` and
/// nothing runs.
#[tokio::test]
async fn a_completion_without_a_known_api_key_is_refused() {
    let store: Arc<dyn Store> = Arc::new(tollgate::store::MemoryStore::new());
    let app = copies_of(&[store], Algorithm::Gcra, &["acme"]).remove(0);
    for key in [None, Some("guess")] {
        let mut request = Request::post("/llm/complete");
        if let Some(key) = key {
            request = request.header("x-api-key", key);
        }
        let request = request.body(Body::from(r#"{"tokens": 5}"#)).unwrap();
        let response = app.clone().oneshot(request).await.unwrap();
        assert_eq!(response.status(), StatusCode::UNAUTHORIZED, "{key:?}");
        assert!(!response.headers().contains_key("x-tokens-used"), "ran");
    }
}
