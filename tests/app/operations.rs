//! The example app's operator and integration routes on two copies: a caller denied on copy A
//! and reset through copy B's admin endpoint is admitted on A within a second (Redis and
//! PostgreSQL); the admin peek; webhooks processed once per `Webhook-Id`; job tiers from
//! `APP_JOB_TIERS` and the plans of `APP_API_KEYS`.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use crate::common;
use crate::router as app;

use std::sync::Arc;
use std::time::{Duration, Instant};

use app::{AppConfig, AppState, JobConfig};
use axum::Router;
use axum::body::Body;
use axum::extract::ConnectInfo;
use common::RedisServer;
use common::postgres;
use http::{Request, Response, StatusCode};
use http_body_util::BodyExt;
use serde_json::Value;
use tollgate::store::{RedisStore, Store};
use tower::ServiceExt;

const ADMIN: &str = "s3cret-admin";

fn config() -> AppConfig {
    AppConfig {
        limits: app::parse_limits("hourly:2/3600s").unwrap(),
        admin_token: Some(ADMIN.to_owned()),
        api_keys: crate::own_keys(&["ann", "bob", "carol", "eve", "acme=pro", "solo"]),
        jobs: JobConfig {
            duration: Duration::from_millis(1500),
            concurrency: 1,
            lease: Duration::from_millis(3000),
            tiers: app::parse_job_tiers("pro=3").unwrap(),
        },
        ..AppConfig::defaults().unwrap()
    }
}

fn copies_of(stores: Vec<Arc<dyn Store>>) -> Vec<Router> {
    stores
        .into_iter()
        .map(|store| app::router(AppState::new(store, config()).unwrap()))
        .collect()
}

/// Two copies on `server`, each with its own connection, as two processes.
fn redis_copies(server: &RedisServer) -> Vec<Router> {
    let store = || {
        let store = RedisStore::builder(server.url())
            .timeout(Duration::from_secs(2))
            .build()
            .unwrap();
        Arc::new(store) as Arc<dyn Store>
    };
    copies_of(vec![store(), store()])
}

/// Two copies on one schema of the shared PostgreSQL server, each with its own pool.
async fn pg_copies() -> Vec<Router> {
    let server = tokio::task::spawn_blocking(postgres::shared).await.unwrap();
    let schema = postgres::unique_schema();
    let mut stores: Vec<Arc<dyn Store>> = Vec::new();
    for _ in 0..2 {
        let store = server.builder().schema(schema.clone()).connect().await;
        stores.push(Arc::new(store.expect("a migrated store")));
    }
    copies_of(stores)
}

async fn send(app: &Router, request: Request<Body>) -> (StatusCode, http::HeaderMap, Value) {
    let response: Response<Body> = app.clone().oneshot(request).await.unwrap();
    let (parts, body) = response.into_parts();
    let bytes = body.collect().await.unwrap().to_bytes();
    let json = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
    (parts.status, parts.headers, json)
}

fn hello(key: &str) -> Request<Body> {
    Request::get("/api/hello")
        .header("x-api-key", key)
        .body(Body::empty())
        .unwrap()
}

fn admin(method: &str, path: &str, token: &str) -> Request<Body> {
    let mut request = Request::builder()
        .method(method)
        .uri(path)
        .header("authorization", format!("Bearer {token}"))
        .body(Body::empty())
        .unwrap();
    // the admin routes are limited per client address
    let peer: std::net::SocketAddr = "192.0.2.10:4000".parse().unwrap();
    request.extensions_mut().insert(ConnectInfo(peer));
    request
}

/// Denied on A (and cached there), reset through B's admin endpoint: A admits within a second.
async fn a_reset_through_b_frees_the_caller_on_a(copies: Vec<Router>) {
    let (a, b) = (&copies[0], &copies[1]);
    for _ in 0..2 {
        assert_eq!(send(a, hello("ann")).await.0, StatusCode::OK);
    }
    assert_eq!(send(a, hello("ann")).await.0, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(send(a, hello("ann")).await.0, StatusCode::TOO_MANY_REQUESTS);
    let (status, _, peek) = send(b, admin("GET", "/admin/callers/ann", ADMIN)).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(peek["api"][0]["limit"], "hourly");
    assert_eq!(peek["api"][0]["remaining"], 0);
    assert_eq!(peek["tokens"][0]["remaining"], 1000, "a budget of its own");

    let reset = send(b, admin("POST", "/admin/callers/ann/reset", ADMIN)).await;
    assert_eq!(reset.0, StatusCode::NO_CONTENT);
    let reset_at = Instant::now();
    loop {
        if send(a, hello("ann")).await.0 == StatusCode::OK {
            break;
        }
        assert!(
            reset_at.elapsed() < Duration::from_millis(1_200),
            "copy A still denies {:?} after the reset through B",
            reset_at.elapsed()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let (_, _, peek) = send(a, admin("GET", "/admin/callers/ann", ADMIN)).await;
    assert_eq!(peek["api"][0]["remaining"], 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_redis_a_reset_through_one_copy_frees_the_caller_on_the_other() {
    let server = RedisServer::start();
    a_reset_through_b_frees_the_caller_on_a(redis_copies(&server)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_postgres_a_reset_through_one_copy_frees_the_caller_on_the_other() {
    a_reset_through_b_frees_the_caller_on_a(pg_copies().await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admin_calls_need_the_token_and_are_off_without_one() {
    let server = RedisServer::start();
    let copies = redis_copies(&server);
    let wrong = send(
        &copies[0],
        admin("POST", "/admin/callers/ann/reset", "guess"),
    )
    .await;
    assert_eq!(wrong.0, StatusCode::UNAUTHORIZED);
    let unset = AppConfig {
        admin_token: None,
        ..config()
    };
    let store: Arc<dyn Store> = Arc::new(server.store());
    let app = app::router(AppState::new(store, unset).unwrap());
    let off = send(&app, admin("GET", "/admin/callers/ann", ADMIN)).await;
    assert_eq!(off.0, StatusCode::NOT_FOUND);
}

fn delivery(source: &str, id: Option<&str>) -> Request<Body> {
    let mut request = Request::post(format!("/webhooks/{source}"));
    if let Some(id) = id {
        request = request.header("webhook-id", id);
    }
    request
        .body(Body::from(r#"{"type":"invoice.paid"}"#))
        .unwrap()
}

/// Fifty parallel deliveries of one webhook over two copies: every one answered `200` with the
/// first run's id; the same id from another sender is a delivery of its own.
async fn fifty_deliveries_one_run(copies: Vec<Router>) {
    let mut tasks = tokio::task::JoinSet::new();
    for i in 0..50 {
        let app = copies[i % 2].clone();
        tasks.spawn(async move { send(&app, delivery("billing", Some("msg_2KWPBg"))).await });
    }
    let mut runs = std::collections::BTreeSet::new();
    while let Some(answer) = tasks.join_next().await {
        let (status, _, body) = answer.unwrap();
        assert_eq!(status, StatusCode::OK, "{body}");
        runs.insert(body["run"].as_str().unwrap().to_owned());
    }
    assert_eq!(runs.len(), 1, "processed once: {runs:?}");
    let (status, _, other) = send(&copies[1], delivery("crm", Some("msg_2KWPBg"))).await;
    assert_eq!(status, StatusCode::OK);
    assert!(
        !runs.contains(other["run"].as_str().unwrap()),
        "another sender's delivery"
    );
    let (status, _, refused) = send(&copies[0], delivery("billing", None)).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    let detail = refused["detail"].as_str().unwrap_or_default();
    assert!(
        detail.to_ascii_lowercase().contains("webhook-id"),
        "{refused}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_redis_fifty_parallel_deliveries_of_one_webhook_run_once() {
    let server = RedisServer::start();
    fifty_deliveries_one_run(redis_copies(&server)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_postgres_fifty_parallel_deliveries_of_one_webhook_run_once() {
    fifty_deliveries_one_run(pg_copies().await).await;
}

/// A job of `tenant` sent with its API key (each tenant's key is its name), claiming `plan` in
/// an `x-plan` header, which the app ignores.
fn job(tenant: &str, plan: Option<&str>) -> Request<Body> {
    let mut request = Request::post(format!("/jobs/{tenant}/run")).header("x-api-key", tenant);
    if let Some(plan) = plan {
        request = request.header("x-plan", plan);
    }
    request.body(Body::empty()).unwrap()
}

/// `APP_JOB_TIERS=pro=3`: six parallel jobs of a tenant whose `APP_API_KEYS` plan is `pro`,
/// over two copies, exactly three run; of a tenant on `free`, exactly one
/// (`APP_JOB_CONCURRENCY`), though every request claims `x-plan: pro`; refusals advertise the
/// limit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn job_tiers_from_the_environment_hold_across_copies() {
    let server = RedisServer::start();
    let copies = redis_copies(&server);
    for (tenant, plan, limit) in [("acme", None, 3), ("solo", Some("pro"), 1)] {
        let mut tasks = tokio::task::JoinSet::new();
        for i in 0..6 {
            let app = copies[i % 2].clone();
            tasks.spawn(async move { send(&app, job(tenant, plan)).await });
        }
        let mut ran = 0;
        while let Some(answer) = tasks.join_next().await {
            let (status, headers, _) = answer.unwrap();
            let policy = format!(r#""jobs";q={limit};qu="concurrent-requests""#);
            assert_eq!(headers["ratelimit-policy"], policy.as_str());
            match status {
                StatusCode::OK => ran += 1,
                StatusCode::TOO_MANY_REQUESTS => {
                    assert!(
                        headers["ratelimit"]
                            .to_str()
                            .unwrap()
                            .starts_with(r#""jobs";r=0;t="#)
                    );
                }
                other => panic!("unexpected {other}"),
            }
        }
        assert_eq!(ran, limit, "{tenant}");
    }
}

#[test]
fn job_tiers_are_parsed_or_refused_with_the_format() {
    assert_eq!(
        app::parse_job_tiers("pro=10, enterprise=50").unwrap(),
        vec![("pro".to_owned(), 10), ("enterprise".to_owned(), 50)]
    );
    assert!(
        app::parse_job_tiers("pro")
            .unwrap_err()
            .contains("name=limit")
    );
    assert!(app::parse_job_tiers("pro=0").unwrap_err().contains(">= 1"));
    let error = AppConfig::from_lookup(|var| (var == "APP_JOB_TIERS").then(|| "pro=x".to_owned()))
        .unwrap_err();
    assert_eq!(error.var, "APP_JOB_TIERS");
}

/// `APP_BLOCK=2s` with a limit of two a second: a caller that goes over on copy A is refused on
/// both copies after the window has passed, until the block ends; then admitted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn app_block_holds_a_caller_over_the_limit_on_every_copy() {
    let server = RedisServer::start();
    let config = AppConfig {
        limits: app::parse_limits("burst:2/1s").unwrap(),
        block: Some(tollgate::rate::parse_duration("2s").unwrap()),
        ..config()
    };
    let store = || {
        let store = RedisStore::builder(server.url())
            .timeout(Duration::from_secs(2))
            .build()
            .unwrap();
        Arc::new(store) as Arc<dyn Store>
    };
    let copies: Vec<Router> = (0..2)
        .map(|_| app::router(AppState::new(store(), config.clone()).unwrap()))
        .collect();
    let (a, b) = (&copies[0], &copies[1]);
    assert_eq!(send(a, hello("bob")).await.0, StatusCode::OK);
    assert_eq!(send(b, hello("bob")).await.0, StatusCode::OK);
    let (status, headers, _) = send(a, hello("bob")).await;
    let blocked_at = Instant::now();
    assert_eq!(status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(headers["retry-after"], "2");
    tokio::time::sleep(Duration::from_millis(1_200)).await;
    for copy in [a, b] {
        assert_eq!(
            send(copy, hello("bob")).await.0,
            StatusCode::TOO_MANY_REQUESTS,
            "blocked"
        );
    }
    assert_eq!(send(b, hello("eve")).await.0, StatusCode::OK, "others");
    tokio::time::sleep_until((blocked_at + Duration::from_millis(2_100)).into()).await;
    assert_eq!(
        send(b, hello("bob")).await.0,
        StatusCode::OK,
        "the block has ended"
    );
}

#[test]
fn app_block_is_parsed_or_refused_with_the_format() {
    let lookup =
        |value: &'static str| move |var: &str| (var == "APP_BLOCK").then(|| value.to_owned());
    let config = AppConfig::from_lookup(lookup("30s")).unwrap();
    assert_eq!(config.block, Some(Duration::from_secs(30)));
    let error = AppConfig::from_lookup(lookup("30 seconds")).unwrap_err();
    assert_eq!(error.var, "APP_BLOCK");
    assert!(error.to_string().contains("APP_BLOCK=30s"), "{error}");
}

/// `APP_LEASE=on` with 100 a minute on two copies: 400 requests of one caller, spread over both,
/// admit at most 100, and less by no more than the slices the copies can hold.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn app_lease_admits_at_most_the_limit_over_two_copies() {
    let server = RedisServer::start();
    let config = AppConfig {
        limits: app::parse_limits("minute:100/60s").unwrap(),
        lease: true,
        ..config()
    };
    let copies: Vec<Router> = (0..2)
        .map(|_| {
            let store = Arc::new(RedisStore::open(server.url()).unwrap()) as Arc<dyn Store>;
            app::router(AppState::new(store, config.clone()).unwrap())
        })
        .collect();
    let mut admitted = 0;
    for i in 0..400 {
        match send(&copies[i % 2], hello("carol")).await.0 {
            StatusCode::OK => admitted += 1,
            StatusCode::TOO_MANY_REQUESTS => {}
            other => panic!("unexpected {other}"),
        }
    }
    assert!(admitted <= 100, "{admitted} admitted");
    // two copies hold at most two slices each of an eighth of the quota
    assert!(admitted >= 100 - 4 * 12, "{admitted} admitted");
}

#[test]
fn app_lease_is_on_or_off_and_not_with_a_block() {
    let lookup = |vars: &'static [(&'static str, &'static str)]| {
        move |var: &str| {
            vars.iter()
                .find(|(name, _)| *name == var)
                .map(|(_, value)| (*value).to_owned())
        }
    };
    assert!(!AppConfig::from_lookup(lookup(&[])).unwrap().lease);
    assert!(
        !AppConfig::from_lookup(lookup(&[("APP_LEASE", "off")]))
            .unwrap()
            .lease
    );
    assert!(
        AppConfig::from_lookup(lookup(&[("APP_LEASE", "on")]))
            .unwrap()
            .lease
    );
    let error = AppConfig::from_lookup(lookup(&[("APP_LEASE", "yes")])).unwrap_err();
    assert_eq!(error.var, "APP_LEASE");
    assert!(error.to_string().contains("on or off"), "{error}");
    let both = AppConfig::from_lookup(lookup(&[("APP_LEASE", "on"), ("APP_BLOCK", "30s")]));
    assert!(both.unwrap_err().to_string().contains("no penalty"));
}
