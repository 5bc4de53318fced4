//! The `config` example as a user starts from it: its own TOML file, on the memory store, on
//! Redis and on PostgreSQL by URL.
#![allow(clippy::unwrap_used, clippy::expect_used)]
use crate::common;
use crate::config_service as service;

use std::sync::OnceLock;
use std::time::Duration;

use axum::body::Body;
use http::{Request, StatusCode};
use http_body_util::BodyExt;
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};
use tollgate::rate::Limit;
use tower::ServiceExt;

/// The example's own file, as shipped, each limit's window stretched to at least a minute: a
/// busy machine then cannot spread a test's requests over two of the burst's 1 s windows.
fn config() -> service::Config {
    let text = include_str!("../../examples/config/tollgate.toml");
    let mut config: service::Config = toml::from_str(text).expect("the shipped file parses");
    let minute = |limits: &mut Vec<Limit>| {
        for limit in limits.iter_mut() {
            let window = limit.window().max(Duration::from_secs(60));
            *limit = Limit::new(limit.name(), limit.quota(), window);
        }
    };
    minute(&mut config.rate_limit.limits);
    config.rate_limit.tiers.values_mut().for_each(minute);
    config
}

fn recorder() -> PrometheusHandle {
    static RECORDER: OnceLock<PrometheusHandle> = OnceLock::new();
    RECORDER
        .get_or_init(|| PrometheusBuilder::new().build_recorder().handle())
        .clone()
}

async fn send(app: &axum::Router, request: Request<Body>) -> (StatusCode, String) {
    let response = app.clone().oneshot(request).await.unwrap();
    let status = response.status();
    let body = response.into_body().collect().await.unwrap().to_bytes();
    (status, String::from_utf8_lossy(&body).into_owned())
}

/// What the file promises: 5 a second per caller (50 on the paid plan), a JSON rejection, one
/// execution per `Idempotency-Key`, which is required.
async fn serves_as_configured(url: Option<String>) {
    let store = service::open(url).await.unwrap();
    let app = service::router(&config(), store, recorder()).unwrap();
    let hello = |key: &str, plan: Option<&str>| {
        let mut request = Request::get("/api/hello").header("x-api-key", key);
        if let Some(plan) = plan {
            request = request.header("x-plan", plan);
        }
        request.body(Body::empty()).unwrap()
    };
    let caller = format!("c{}", rand::random::<u32>());
    let mut statuses = Vec::new();
    for _ in 0..7 {
        statuses.push(send(&app, hello(&caller, None)).await.0);
    }
    let admitted = statuses.iter().filter(|s| **s == StatusCode::OK).count();
    assert_eq!(admitted, 5, "{statuses:?}");
    let (status, body) = send(&app, hello(&caller, None)).await;
    assert_eq!(status, StatusCode::TOO_MANY_REQUESTS);
    let secs = body
        .strip_prefix(r#"{"error":"rate_limited","retry_in_seconds":"#)
        .and_then(|rest| rest.strip_suffix('}'))
        .and_then(|secs| secs.parse::<u64>().ok());
    assert!(secs.is_some_and(|s| (1..=120).contains(&s)), "{body}");
    let paid = format!("p{}", rand::random::<u32>());
    for _ in 0..10 {
        assert_eq!(
            send(&app, hello(&paid, Some("paid"))).await.0,
            StatusCode::OK
        );
    }
    let order = |key: &str| {
        let request = Request::post("/orders").header("x-api-key", &caller);
        let request = if key.is_empty() {
            request
        } else {
            request.header("idempotency-key", key)
        };
        request.body(Body::from("one book")).unwrap()
    };
    let key = format!("order-{}", rand::random::<u32>());
    let (status, first) = send(&app, order(&key)).await;
    assert_eq!(status, StatusCode::CREATED, "{first}");
    assert_eq!(send(&app, order(&key)).await, (StatusCode::CREATED, first));
    assert_eq!(send(&app, order("")).await.0, StatusCode::BAD_REQUEST);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_shipped_file_serves_on_the_memory_store() {
    serves_as_configured(None).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_shipped_file_serves_on_redis_by_url() {
    let server = common::RedisServer::start();
    serves_as_configured(Some(server.url())).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_shipped_file_serves_on_postgresql_by_url() {
    let server = common::postgres::PgServer::start();
    serves_as_configured(Some(server.url())).await;
}

#[test]
fn a_store_url_that_is_wrong_says_what_is_wrong() {
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let error = runtime
        .block_on(service::open(Some("http://localhost:6379".into())))
        .err()
        .unwrap();
    assert!(
        error.contains("the scheme http:// is not Redis's"),
        "{error}"
    );
}
