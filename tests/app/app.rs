//! The example app (`examples/app`) against real redis-server processes: limits shared by two
//! copies, caller keys, response headers, health, configuration parsing and the binary's exit codes.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use crate::common;
use crate::router as app;

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use app::{AppConfig, AppState};
use axum::Router;
use axum::body::Body;
use axum::extract::ConnectInfo;
use bytes::Bytes;
use common::RedisServer;
use http::{Request, Response, StatusCode};
use http_body_util::BodyExt;
use serde_json::Value;
use tollgate::rate_limit::{Algorithm, Limit};
use tollgate::store::{MemoryStore, Store};
use tower::ServiceExt;

// ---------------------------------------------------------------------------------------------
// helpers
// ---------------------------------------------------------------------------------------------

fn config(limits: &str, algorithm: Algorithm, redis_url: Option<String>) -> AppConfig {
    AppConfig {
        port: 0,
        redis_url,
        limits: app::parse_limits(limits).unwrap(),
        algorithm,
        redis_cluster_urls: Vec::new(),
        redis_sentinels: Vec::new(),
        redis_sentinel_master: None,
        redis_primary_password: None,
        database_url: None,
        wait_replicas: 0,
        store_timeout: None,
        trusted_proxies: Vec::new(),
        on_store_error: tollgate::rate_limit::OnStoreError::Allow,
        payment_delay: app::DEFAULT_PAYMENT_DELAY,
        report_work: app::DEFAULT_REPORT_WORK,
        transfer_delay: Duration::ZERO,
        jobs: app::JobConfig::default(),
        token_limits: app::parse_limits(app::DEFAULT_TOKEN_LIMITS).unwrap(),
        admin_token: None,
        api_keys: test_keys(),
        block: None,
        lease: false,
    }
}

/// [`TEST_CALLERS`], and `sk_live_dave`, the key of tenant `dave-co`.
fn test_keys() -> app::ApiKeys {
    let table = format!(
        "{},sk_live_dave:dave-co:free",
        crate::own_keys_var(&TEST_CALLERS)
    );
    app::ApiKeys::parse(&table).unwrap()
}

/// The callers these tests name, each with the API key of its own name.
const TEST_CALLERS: [&str; 11] = [
    "shared-key",
    "alice",
    "bob",
    "carol",
    "dave",
    "erin",
    "frank",
    "gina",
    "h",
    "ivan",
    "probe",
];

/// One copy of the app with its own connection to `server`, as a separate process would have.
fn copy_on(server: &RedisServer, limits: &str, algorithm: Algorithm) -> Router {
    let store: Arc<dyn Store> = Arc::new(server.store());
    let config = config(limits, algorithm, Some(server.url()));
    app::router(AppState::new(store, config).unwrap())
}

/// A caller of the app, as the request names it.
#[derive(Clone, Copy)]
enum Caller<'a> {
    ApiKey(&'a str),
    /// A connection from this address, as axum's `serve` with connect info reports it.
    Peer(&'a str),
    /// An API key on a connection from this address.
    Both(&'a str, &'a str),
    Nobody,
}

fn request(path: &str, caller: Caller<'_>) -> Request<Body> {
    let mut builder = Request::get(path);
    if let Caller::ApiKey(key) | Caller::Both(key, _) = caller {
        builder = builder.header("x-api-key", key);
    }
    let mut request = builder.body(Body::empty()).unwrap();
    if let Caller::Peer(addr) | Caller::Both(_, addr) = caller {
        let addr: SocketAddr = addr.parse().unwrap();
        request.extensions_mut().insert(ConnectInfo(addr));
    }
    request
}

async fn call(app: &Router, path: &str, caller: Caller<'_>) -> Response<Body> {
    app.clone().oneshot(request(path, caller)).await.unwrap()
}

async fn status(app: &Router, path: &str, caller: Caller<'_>) -> StatusCode {
    call(app, path, caller).await.status()
}

async fn json(response: Response<Body>) -> Value {
    let body = response.into_body().collect().await.unwrap().to_bytes();
    serde_json::from_slice(&body).unwrap()
}

fn header<'a>(response: &'a Response<Body>, name: &str) -> &'a str {
    response
        .headers()
        .get(name)
        .unwrap_or_else(|| panic!("no {name} header"))
        .to_str()
        .unwrap()
}

/// `"burst";r=0;t=60, "hourly";r=98;t=3600` → `[("burst", 0, 60), ("hourly", 98, 3600)]`.
fn parse_ratelimit(value: &str) -> Vec<(String, u64, u64)> {
    value
        .split(", ")
        .map(|member| {
            let mut parts = member.split(';');
            let name = parts.next().unwrap().trim_matches('"').to_owned();
            let mut r = None;
            let mut t = None;
            for param in parts {
                let (k, v) = param.split_once('=').unwrap();
                match k {
                    "r" => r = Some(v.parse().unwrap()),
                    "t" => t = Some(v.parse().unwrap()),
                    other => panic!("unexpected parameter {other} in {value}"),
                }
            }
            (name, r.unwrap(), t.unwrap())
        })
        .collect()
}

// ---------------------------------------------------------------------------------------------
// 1. two copies on one Redis share one limit, for every algorithm
// ---------------------------------------------------------------------------------------------

async fn two_copies_admit_exactly_the_limit(algorithm: Algorithm) {
    let server = RedisServer::start();
    // A long window: GCRA refills one request every 3 minutes, so the burst is all there is.
    let copies = [
        copy_on(&server, "burst:20/3600s", algorithm),
        copy_on(&server, "burst:20/3600s", algorithm),
    ];
    exactly_the_limit(copies, algorithm).await;
}

/// Two copies on one PostgreSQL schema, each with its own pool.
async fn two_copies_on_postgres_admit_exactly_the_limit(algorithm: Algorithm) {
    let server = tokio::task::spawn_blocking(common::postgres::shared)
        .await
        .unwrap();
    let schema = common::postgres::unique_schema();
    let mut copies = Vec::new();
    for _ in 0..2 {
        let store = server
            .builder()
            .schema(schema.clone())
            .connect()
            .await
            .expect("a migrated store");
        let config = config("burst:20/3600s", algorithm, None);
        copies.push(app::router(AppState::new(Arc::new(store), config).unwrap()));
    }
    let copies: [Router; 2] = copies.try_into().unwrap();
    exactly_the_limit(copies, algorithm).await;
}

/// 100 parallel requests of one caller over `copies`, whose limit is 20 per hour: exactly 20
/// are admitted, and both copies see the quota spent.
async fn exactly_the_limit(copies: [Router; 2], algorithm: Algorithm) {
    let mut tasks = tokio::task::JoinSet::new();
    for i in 0..100 {
        let copy = copies[i % 2].clone();
        tasks.spawn(async move {
            let response = copy
                .oneshot(request("/api/hello", Caller::ApiKey("shared-key")))
                .await
                .unwrap();
            response.status()
        });
    }
    let statuses = tasks.join_all().await;
    let ok = statuses.iter().filter(|s| **s == StatusCode::OK).count();
    let limited = statuses
        .iter()
        .filter(|s| **s == StatusCode::TOO_MANY_REQUESTS)
        .count();
    assert_eq!(
        (ok, limited),
        (20, 80),
        "{algorithm}: 100 parallel requests over two copies"
    );
    // Both copies see the spent quota.
    for copy in &copies {
        assert_eq!(
            status(copy, "/api/hello", Caller::ApiKey("shared-key")).await,
            StatusCode::TOO_MANY_REQUESTS
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_copies_share_the_limit_sliding_log() {
    two_copies_admit_exactly_the_limit(Algorithm::SlidingLog).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_copies_share_the_limit_sliding_counter() {
    two_copies_admit_exactly_the_limit(Algorithm::SlidingCounter).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_copies_share_the_limit_gcra() {
    two_copies_admit_exactly_the_limit(Algorithm::Gcra).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn on_postgres_two_copies_share_the_limit_sliding_log() {
    two_copies_on_postgres_admit_exactly_the_limit(Algorithm::SlidingLog).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn on_postgres_two_copies_share_the_limit_sliding_counter() {
    two_copies_on_postgres_admit_exactly_the_limit(Algorithm::SlidingCounter).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn on_postgres_two_copies_share_the_limit_gcra() {
    two_copies_on_postgres_admit_exactly_the_limit(Algorithm::Gcra).await;
}

// ---------------------------------------------------------------------------------------------
// 2. who counts as a caller
// ---------------------------------------------------------------------------------------------

#[tokio::test]
async fn api_keys_are_independent_callers() {
    let server = RedisServer::start();
    let app = copy_on(&server, "burst:3/3600s", Algorithm::SlidingLog);
    for _ in 0..3 {
        assert_eq!(
            status(&app, "/api/hello", Caller::ApiKey("alice")).await,
            StatusCode::OK
        );
    }
    assert_eq!(
        status(&app, "/api/hello", Caller::ApiKey("alice")).await,
        StatusCode::TOO_MANY_REQUESTS
    );
    // bob's quota is untouched by alice's
    for _ in 0..3 {
        assert_eq!(
            status(&app, "/api/hello", Caller::ApiKey("bob")).await,
            StatusCode::OK
        );
    }
    assert_eq!(
        status(&app, "/api/hello", Caller::ApiKey("bob")).await,
        StatusCode::TOO_MANY_REQUESTS
    );
    // an API key is its own caller whatever address it comes from
    assert_eq!(
        status(&app, "/api/hello", Caller::Both("carol", "10.0.0.1:1000")).await,
        StatusCode::OK
    );
}

#[tokio::test]
async fn without_an_api_key_the_peer_ip_is_the_caller() {
    let server = RedisServer::start();
    let app = copy_on(&server, "burst:3/3600s", Algorithm::SlidingLog);
    for port in [1000, 1001, 1002] {
        let addr = format!("10.0.0.1:{port}");
        let response = call(&app, "/api/hello", Caller::Peer(&addr)).await;
        assert_eq!(response.status(), StatusCode::OK);
        let body = json(response).await;
        assert_eq!(body["caller"]["by"], "peer-ip");
        assert_eq!(body["caller"]["ip"], "10.0.0.1");
    }
    // another connection (port) from the same address is the same caller
    assert_eq!(
        status(&app, "/api/hello", Caller::Peer("10.0.0.1:2000")).await,
        StatusCode::TOO_MANY_REQUESTS
    );
    // another address is another caller
    assert_eq!(
        status(&app, "/api/hello", Caller::Peer("10.0.0.2:1000")).await,
        StatusCode::OK
    );
    // an API key from the exhausted address counts against the key, not the address
    let response = call(
        &app,
        "/api/hello",
        Caller::Both("sk_live_dave", "10.0.0.1:3000"),
    )
    .await;
    assert_eq!(response.status(), StatusCode::OK);
    let body = json(response).await;
    assert_eq!(body["caller"]["by"], "api-key");
    assert_eq!(body["caller"]["tenant"], "dave-co");
    assert!(
        !body.to_string().contains("sk_live"),
        "the API key is echoed: {body}"
    );
    // no key and no address: rejected, not a panic or a 500
    assert_eq!(
        status(&app, "/api/hello", Caller::Nobody).await,
        StatusCode::BAD_REQUEST
    );
}

/// An API key the table does not know is refused, whatever it is: a client rotating fresh keys
/// from one address gets ten `401`s and no quota of anyone's, and its address keeps its own
/// quota for anonymous calls. A plan header chooses nothing.
#[tokio::test]
async fn unknown_api_keys_are_refused_and_rotating_them_buys_nothing() {
    let server = RedisServer::start();
    let app = copy_on(&server, "burst:3/3600s", Algorithm::SlidingLog);
    for i in 0..10 {
        let key = format!("rotated-{i}");
        let response = call(&app, "/api/hello", Caller::Both(&key, "10.0.0.7:1000")).await;
        assert_eq!(response.status(), StatusCode::UNAUTHORIZED, "{key}");
        let policy = header(&response, "ratelimit-policy");
        assert!(
            policy.starts_with(r#""auth-failures""#),
            "only as a failure: {policy}"
        );
    }
    let mut admitted = 0;
    for _ in 0..5 {
        if status(&app, "/api/hello", Caller::Peer("10.0.0.7:1000")).await == StatusCode::OK {
            admitted += 1;
        }
    }
    assert_eq!(
        admitted, 3,
        "the address's own quota, untouched by the refused keys"
    );
    // a known key sent with a plan header of its choosing: still its own tenant and quota
    let mut request = request("/api/hello", Caller::ApiKey("alice"));
    request
        .headers_mut()
        .insert("x-plan", http::HeaderValue::from_static("enterprise"));
    let response = app.clone().oneshot(request).await.unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    assert_eq!(json(response).await["caller"]["tenant"], "alice");
}

/// Guessing API keys from one address: exactly `AUTH_FAILURES` unknown keys a minute are told
/// `401`, the rest `429`; the address's known keys and other addresses' guesses are not held up.
#[tokio::test]
async fn guessing_api_keys_from_one_address_is_limited() {
    let server = RedisServer::start();
    let app = copy_on(&server, "burst:100/3600s", Algorithm::SlidingLog);
    let guesses = app::AUTH_FAILURES + 5;
    let mut statuses = Vec::new();
    for i in 0..guesses {
        let key = format!("guess-{i}");
        statuses.push(status(&app, "/api/hello", Caller::Both(&key, "10.0.0.9:1000")).await);
    }
    let refused = statuses
        .iter()
        .filter(|s| **s == StatusCode::UNAUTHORIZED)
        .count();
    let limited = statuses
        .iter()
        .filter(|s| **s == StatusCode::TOO_MANY_REQUESTS)
        .count();
    assert_eq!(
        (refused as u64, limited),
        (app::AUTH_FAILURES, 5),
        "{statuses:?}"
    );
    let known = Caller::Both("alice", "10.0.0.9:2000");
    assert_eq!(status(&app, "/api/hello", known).await, StatusCode::OK);
    let elsewhere = Caller::Both("guess-0", "10.0.0.10:1000");
    assert_eq!(
        status(&app, "/api/hello", elsewhere).await,
        StatusCode::UNAUTHORIZED
    );
}

/// Served over real TCP the way `examples/app/main.rs` serves it: the peer address comes from the
/// connection.
#[tokio::test]
async fn served_over_tcp_the_connection_address_keys_the_caller() {
    let server = RedisServer::start();
    let app = copy_on(&server, "burst:3/3600s", Algorithm::Gcra);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let serving = tokio::spawn(async move {
        axum::serve(
            listener,
            app.into_make_service_with_connect_info::<SocketAddr>(),
        )
        .await
    });

    let client = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .build_http::<http_body_util::Empty<Bytes>>();
    let get = |api_key: Option<&str>| {
        let mut builder = Request::get(format!("http://{addr}/api/hello"));
        if let Some(key) = api_key {
            builder = builder.header("x-api-key", key);
        }
        client.request(builder.body(http_body_util::Empty::new()).unwrap())
    };
    for _ in 0..3 {
        let response = get(None).await.unwrap();
        assert_eq!(response.status(), StatusCode::OK);
        let body = response.into_body().collect().await.unwrap().to_bytes();
        let body: Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(body["caller"]["ip"], "127.0.0.1");
    }
    assert_eq!(
        get(None).await.unwrap().status(),
        StatusCode::TOO_MANY_REQUESTS
    );
    assert_eq!(get(Some("erin")).await.unwrap().status(), StatusCode::OK);
    serving.abort();
}

// ---------------------------------------------------------------------------------------------
// 3. headers and health
// ---------------------------------------------------------------------------------------------

#[tokio::test]
async fn responses_carry_the_rate_limit_headers() {
    let server = RedisServer::start();
    let app = copy_on(
        &server,
        "burst:2/60s,hourly:100/3600s",
        Algorithm::SlidingLog,
    );
    let policy = r#""burst";q=2;w=60, "hourly";q=100;w=3600"#;
    let caller = Caller::ApiKey("frank");

    let first = call(&app, "/api/hello", caller).await;
    assert_eq!(first.status(), StatusCode::OK);
    assert_eq!(header(&first, "ratelimit-policy"), policy);
    let state = parse_ratelimit(header(&first, "ratelimit"));
    assert_eq!(state[0].0, "burst");
    assert_eq!(state[0].1, 1);
    assert_eq!(state[1].0, "hourly");
    assert_eq!(state[1].1, 99);
    assert!(first.headers().get("retry-after").is_none());
    let body = json(first).await;
    assert_eq!(body["message"], "hello");
    assert_eq!(body["caller"]["by"], "api-key");

    assert_eq!(status(&app, "/api/hello", caller).await, StatusCode::OK);

    let denied = call(&app, "/api/hello", caller).await;
    assert_eq!(denied.status(), StatusCode::TOO_MANY_REQUESTS);
    let retry_after: u64 = header(&denied, "retry-after").parse().unwrap();
    assert!((1..=60).contains(&retry_after), "Retry-After {retry_after}");
    assert_eq!(header(&denied, "ratelimit-policy"), policy);
    let state = parse_ratelimit(header(&denied, "ratelimit"));
    // burst exhausted; the denied request charged nothing, so hourly shows its real remainder
    assert_eq!(state[0].0, "burst");
    assert_eq!(state[0].1, 0);
    assert!((1..=60).contains(&state[0].2), "burst t={}", state[0].2);
    assert_eq!(state[1].0, "hourly");
    assert_eq!(state[1].1, 98);
    assert!((1..=3600).contains(&state[1].2), "hourly t={}", state[1].2);
}

#[tokio::test]
async fn healthz_follows_the_store() {
    let mut server = RedisServer::start();
    let app = copy_on(&server, "burst:2/60s", Algorithm::SlidingLog);

    let healthy = call(&app, "/healthz", Caller::Nobody).await;
    assert_eq!(healthy.status(), StatusCode::OK);
    let body = json(healthy).await;
    assert_eq!(body["status"], "ok");
    assert_eq!(body["store"], "redis");

    server.kill();
    let down = call(&app, "/healthz", Caller::Nobody).await;
    assert_eq!(down.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(json(down).await["status"], "unavailable");
    // failure policy Allow: the API stays up, unlimited, while the store is down
    for _ in 0..3 {
        assert_eq!(
            status(&app, "/api/hello", Caller::ApiKey("gina")).await,
            StatusCode::OK
        );
    }

    server.restart();
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let status = status(&app, "/healthz", Caller::Nobody).await;
        if status == StatusCode::OK {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "still {status} 10 s after restart"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test]
async fn memory_store_limits_one_process() {
    let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
    let app =
        app::router(AppState::new(store, config("burst:1/3600s", Algorithm::Gcra, None)).unwrap());
    let healthy = call(&app, "/healthz", Caller::Nobody).await;
    assert_eq!(healthy.status(), StatusCode::OK);
    assert_eq!(json(healthy).await["store"], "memory");
    assert_eq!(
        status(&app, "/api/hello", Caller::ApiKey("h")).await,
        StatusCode::OK
    );
    assert_eq!(
        status(&app, "/api/hello", Caller::ApiKey("h")).await,
        StatusCode::TOO_MANY_REQUESTS
    );
    assert_eq!(
        status(&app, "/nowhere", Caller::Nobody).await,
        StatusCode::NOT_FOUND
    );
}

// ---------------------------------------------------------------------------------------------
// 4. configuration
// ---------------------------------------------------------------------------------------------

#[test]
fn limits_parse_to_exact_limits() {
    assert_eq!(
        app::parse_limits("burst:5/1s,minute:100/60s").unwrap(),
        vec![
            Limit::new("burst", 5, Duration::from_secs(1)),
            Limit::new("minute", 100, Duration::from_secs(60)),
        ]
    );
    assert_eq!(
        app::parse_limits(" a.b-c_1:1/86400s , x:7/3s ").unwrap(),
        vec![
            Limit::new("a.b-c_1", 1, Duration::from_secs(86_400)),
            Limit::new("x", 7, Duration::from_secs(3)),
        ]
    );
    assert_eq!(
        app::parse_limits("requests:100/1s/calls,tokens:10000/1s").unwrap(),
        vec![
            Limit::per_second("requests", 100).counting_calls(),
            Limit::per_second("tokens", 10_000),
        ]
    );
    assert_eq!(
        app::parse_limits(app::DEFAULT_LIMITS).unwrap(),
        vec![
            Limit::per_second("burst", 5),
            Limit::per_minute("minute", 100)
        ]
    );
}

#[test]
fn invalid_limits_are_errors() {
    for bad in [
        "",
        "bad",
        "burst",
        "burst:5",
        "burst:5/1",
        "burst:5/1m",
        "burst:5/1s/call",
        "burst:5/calls",
        "burst:5/s",
        "burst:/1s",
        "burst:five/1s",
        "burst:-5/1s",
        "burst:+5/1s",
        "burst:5/1.5s",
        "burst: 5/1s",
        "burst:0/1s",
        "burst:5/0s",
        ":5/1s",
        "bu rst:5/1s",
        "b{x}:5/1s",
        "burst:5/1s,",
        "burst:5/1s,,minute:1/60s",
        "burst:5/1s,burst:10/60s",
        "burst:99999999999999999999/1s",
        "burst:1000000000/31536000s",
    ] {
        assert!(
            app::parse_limits(bad).is_err(),
            "{bad:?} parsed: {:?}",
            app::parse_limits(bad)
        );
    }
}

#[test]
fn algorithms_parse_by_name() {
    assert_eq!(
        app::parse_algorithm("sliding-log").unwrap(),
        Algorithm::SlidingLog
    );
    assert_eq!(
        app::parse_algorithm("sliding-counter").unwrap(),
        Algorithm::SlidingCounter
    );
    assert_eq!(app::parse_algorithm("gcra").unwrap(), Algorithm::Gcra);
    for bad in ["", "fast", "GCRA", "sliding_log", "token-bucket"] {
        assert!(app::parse_algorithm(bad).is_err(), "{bad:?} parsed");
    }
}

#[test]
fn ports_parse() {
    assert_eq!(app::parse_port("3999").unwrap(), 3999);
    assert_eq!(app::parse_port("0").unwrap(), 0);
    assert_eq!(app::parse_port("65535").unwrap(), 65535);
    for bad in ["", "65536", "-1", "+80", "http", "80 80", "3000x"] {
        assert!(app::parse_port(bad).is_err(), "{bad:?} parsed");
    }
}

fn lookup<'a>(vars: &'a [(&'a str, &'a str)]) -> impl Fn(&str) -> Option<String> + 'a {
    move |name| {
        vars.iter()
            .find(|(k, _)| *k == name)
            .map(|(_, v)| (*v).to_owned())
    }
}

#[test]
fn config_defaults_and_overrides() {
    let defaults = AppConfig::from_lookup(lookup(&[])).unwrap();
    assert_eq!(
        defaults,
        AppConfig {
            port: 3000,
            redis_url: None,
            limits: vec![
                Limit::per_second("burst", 5),
                Limit::per_minute("minute", 100)
            ],
            algorithm: Algorithm::SlidingLog,
            redis_cluster_urls: Vec::new(),
            redis_sentinels: Vec::new(),
            redis_sentinel_master: None,
            redis_primary_password: None,
            database_url: None,
            wait_replicas: 0,
            store_timeout: None,
            trusted_proxies: Vec::new(),
            on_store_error: tollgate::rate_limit::OnStoreError::Allow,
            payment_delay: app::DEFAULT_PAYMENT_DELAY,
            report_work: app::DEFAULT_REPORT_WORK,
            transfer_delay: Duration::ZERO,
            jobs: app::JobConfig::default(),
            token_limits: app::parse_limits(app::DEFAULT_TOKEN_LIMITS).unwrap(),
            admin_token: None,
            api_keys: app::ApiKeys::demo(),
            block: None,
            lease: false,
        }
    );
    // empty counts as unset
    let empty = AppConfig::from_lookup(lookup(&[
        ("PORT", ""),
        ("REDIS_URL", " "),
        ("APP_LIMITS", ""),
        ("APP_ALGORITHM", ""),
    ]))
    .unwrap();
    assert_eq!(empty, defaults);

    let set = AppConfig::from_lookup(lookup(&[
        ("PORT", "3999"),
        ("REDIS_URL", "redis://127.0.0.1:6390/"),
        ("APP_LIMITS", "burst:10/60s"),
        ("APP_ALGORITHM", "gcra"),
        ("APP_STORE_TIMEOUT_MS", "800"),
        ("APP_REPORT_MS", "2000"),
    ]))
    .unwrap();
    assert_eq!(
        set,
        AppConfig {
            port: 3999,
            redis_url: Some("redis://127.0.0.1:6390/".to_owned()),
            limits: vec![Limit::per_minute("burst", 10)],
            algorithm: Algorithm::Gcra,
            redis_cluster_urls: Vec::new(),
            redis_sentinels: Vec::new(),
            redis_sentinel_master: None,
            redis_primary_password: None,
            database_url: None,
            wait_replicas: 0,
            store_timeout: Some(Duration::from_millis(800)),
            trusted_proxies: Vec::new(),
            on_store_error: tollgate::rate_limit::OnStoreError::Allow,
            payment_delay: app::DEFAULT_PAYMENT_DELAY,
            report_work: Duration::from_secs(2),
            transfer_delay: Duration::ZERO,
            jobs: app::JobConfig::default(),
            token_limits: app::parse_limits(app::DEFAULT_TOKEN_LIMITS).unwrap(),
            admin_token: None,
            api_keys: app::ApiKeys::demo(),
            block: None,
            lease: false,
        }
    );
}

/// `APP_LIMITS` is held to the chosen algorithm's own bounds: only the sliding log, which keeps
/// an entry per unit, caps a quota (at `MAX_LOG_QUOTA`); GCRA and the counter take any.
#[test]
fn app_limits_are_held_to_the_chosen_algorithms_bounds() {
    let huge = "api:100000000/1s";
    for algorithm in ["gcra", "sliding-counter"] {
        let config = AppConfig::from_lookup(lookup(&[
            ("APP_LIMITS", huge),
            ("APP_ALGORITHM", algorithm),
        ]))
        .unwrap();
        assert_eq!(config.limits[0].quota(), 100_000_000, "{algorithm}");
    }
    for algorithm in [None, Some("sliding-log")] {
        let mut vars = vec![("APP_LIMITS", huge)];
        vars.extend(algorithm.map(|a| ("APP_ALGORITHM", a)));
        let err = AppConfig::from_lookup(lookup(&vars)).unwrap_err();
        assert_eq!(err.var, "APP_LIMITS");
        assert!(err.to_string().contains("at most 100000"), "{err}");
    }
    let at_cap = AppConfig::from_lookup(lookup(&[("APP_LIMITS", "api:100000/1s")])).unwrap();
    assert_eq!(at_cap.limits[0].quota(), tollgate::rate::MAX_LOG_QUOTA);
}

#[test]
fn config_errors_name_the_variable_and_the_format() {
    let cases = [
        ("PORT", "abc", "TCP port"),
        ("APP_LIMITS", "bad", "name:count/<seconds>s"),
        ("APP_ALGORITHM", "fast", "sliding-log"),
    ];
    for (var, value, expected) in cases {
        let err = AppConfig::from_lookup(lookup(&[(var, value)])).unwrap_err();
        assert_eq!(err.var, var);
        let message = err.to_string();
        assert!(message.contains(var), "{message}");
        assert!(message.contains(value), "{message}");
        assert!(message.contains(expected), "{message}");
    }
}

#[test]
fn a_database_url_names_postgres_and_excludes_redis() {
    let url = "postgres://app:secret@127.0.0.1:5432/app";
    let config = AppConfig::from_lookup(lookup(&[("DATABASE_URL", url)])).unwrap();
    assert_eq!(config.database_url.as_deref(), Some(url));
    assert_eq!(config.store_kind(), "postgres");
    let both = AppConfig::from_lookup(lookup(&[
        ("REDIS_URL", "redis://127.0.0.1:6379/"),
        ("DATABASE_URL", url),
    ]))
    .unwrap_err();
    assert_eq!(both.var, "DATABASE_URL");
    assert!(
        both.to_string().contains("REDIS_URL is set as well"),
        "{both}"
    );
}

#[test]
fn sentinels_and_durable_writes_are_read_from_the_environment() {
    let sentinels = "redis://127.0.0.1:26379/, redis://127.0.0.1:26380/";
    let config = AppConfig::from_lookup(lookup(&[
        ("REDIS_SENTINELS", sentinels),
        ("REDIS_SENTINEL_MASTER", "mymaster"),
        ("REDIS_WAIT_REPLICAS", "1"),
    ]))
    .unwrap();
    assert_eq!(
        config.redis_sentinels,
        ["redis://127.0.0.1:26379/", "redis://127.0.0.1:26380/"]
    );
    assert_eq!(config.redis_sentinel_master.as_deref(), Some("mymaster"));
    assert_eq!(config.wait_replicas, 1);
    assert_eq!(config.store_kind(), "redis-sentinel");
    let without_master = AppConfig::from_lookup(lookup(&[("REDIS_SENTINELS", sentinels)]));
    assert_eq!(without_master.unwrap_err().var, "REDIS_SENTINEL_MASTER");
    let two_stores = AppConfig::from_lookup(lookup(&[
        ("REDIS_URL", "redis://127.0.0.1:6379/"),
        ("REDIS_SENTINELS", sentinels),
        ("REDIS_SENTINEL_MASTER", "mymaster"),
    ]));
    assert_eq!(two_stores.unwrap_err().var, "REDIS_SENTINELS");
    let bad_wait = AppConfig::from_lookup(lookup(&[("REDIS_WAIT_REPLICAS", "one")]));
    assert_eq!(bad_wait.unwrap_err().var, "REDIS_WAIT_REPLICAS");
    let cluster = AppConfig::from_lookup(lookup(&[("REDIS_CLUSTER_URLS", "redis://a:7000/")]));
    assert_eq!(cluster.unwrap().store_kind(), "redis-cluster");
}

#[test]
fn trusted_proxies_and_the_failure_policy_are_read_from_the_environment() {
    let config = AppConfig::from_lookup(lookup(&[
        ("APP_TRUSTED_PROXIES", "10.0.0.0/8, fd00::/8"),
        ("APP_ON_STORE_ERROR", "fallback:2"),
    ]))
    .unwrap();
    assert_eq!(config.trusted_proxies.len(), 2);
    assert_eq!(
        config.on_store_error,
        tollgate::rate_limit::OnStoreError::LocalFallback { copies: 2 }
    );
    for (var, value) in [
        ("APP_TRUSTED_PROXIES", "10.0.0.0/33"),
        ("APP_TRUSTED_PROXIES", "not-a-cidr"),
        ("APP_ON_STORE_ERROR", "fallback:0"),
        ("APP_ON_STORE_ERROR", "sometimes"),
    ] {
        let error = AppConfig::from_lookup(lookup(&[(var, value)])).unwrap_err();
        assert_eq!(error.var, var, "{value}");
        assert!(error.to_string().contains(value), "{error}");
    }
    let deny = AppConfig::from_lookup(lookup(&[("APP_ON_STORE_ERROR", "deny")])).unwrap();
    assert_eq!(
        deny.on_store_error,
        tollgate::rate_limit::OnStoreError::Deny
    );
}

/// Behind a trusted proxy, callers without an API key count by the network the proxy names:
/// 30 addresses of one IPv6 /64 are one caller.
#[tokio::test]
async fn behind_trusted_proxies_an_ipv6_64_is_one_caller() {
    let server = RedisServer::start();
    let store: Arc<dyn Store> = Arc::new(server.store());
    let mut config = config("minute:5/60s", Algorithm::SlidingLog, Some(server.url()));
    config.trusted_proxies = vec!["10.0.0.0/8".parse().unwrap()];
    let app = app::router(AppState::new(store, config).unwrap());
    let mut admitted = 0;
    for i in 1..=30u16 {
        let mut req = Request::get("/api/hello")
            .header("x-forwarded-for", format!("2001:db8:5:6:{i:x}::{i:x}"))
            .body(Body::empty())
            .unwrap();
        req.extensions_mut()
            .insert(ConnectInfo("10.0.0.2:4000".parse::<SocketAddr>().unwrap()));
        if app.clone().oneshot(req).await.unwrap().status() == StatusCode::OK {
            admitted += 1;
        }
    }
    assert_eq!(
        admitted, 5,
        "a rotating IPv6 client got more than one bucket"
    );
}

#[test]
fn passwords_are_redacted_from_urls() {
    assert_eq!(
        app::redact_url("redis://127.0.0.1:6379/"),
        "redis://127.0.0.1:6379/"
    );
    assert_eq!(
        app::redact_url("redis://user:s3cret@host:6379/0"),
        "redis://user:***@host:6379/0"
    );
    assert_eq!(
        app::redact_url("redis://:s3cret@host:6379"),
        "redis://:***@host:6379"
    );
    assert_eq!(app::redact_url("redis://s3cret@host"), "redis://***@host");
    assert_eq!(
        app::redact_url("postgres://app:s3cret@db:5432/app"),
        "postgres://app:***@db:5432/app"
    );
    assert_eq!(
        app::redact_url("postgresql://app@db/app"),
        "postgresql://app@db/app"
    );
    assert_eq!(
        app::redact_url("host=db user=app password=s3cret dbname=app"),
        "host=db user=app password=*** dbname=app"
    );
    assert_eq!(app::redact_url("not a url"), "not a url");
}

// ---------------------------------------------------------------------------------------------
// 4b. the real binary
// ---------------------------------------------------------------------------------------------

/// Builds the example once (`cargo build --example app`) and returns its path.
fn app_binary() -> &'static PathBuf {
    static BINARY: OnceLock<PathBuf> = OnceLock::new();
    BINARY.get_or_init(|| {
        let mut build = Command::new(env!("CARGO"));
        // the variables cargo sets for this test (CARGO_PKG_*, CARGO_MANIFEST_DIR, ...) would make
        // the build of the example differ from the test's own, and rebuild the dependencies
        for (var, _) in std::env::vars_os() {
            let var = var.to_string_lossy().into_owned();
            if var.starts_with("CARGO_")
                && !matches!(var.as_str(), "CARGO_HOME" | "CARGO_TARGET_DIR")
            {
                build.env_remove(var);
            }
        }
        let output = build
            .args(["build", "--example", "app", "--message-format=json"])
            .arg("--manifest-path")
            .arg(concat!(env!("CARGO_MANIFEST_DIR"), "/Cargo.toml"))
            .stderr(Stdio::inherit())
            .output()
            .expect("run cargo build --example app");
        assert!(output.status.success(), "cargo build --example app failed");
        String::from_utf8_lossy(&output.stdout)
            .lines()
            .filter_map(|line| serde_json::from_str::<Value>(line).ok())
            .filter(|msg| msg["reason"] == "compiler-artifact" && msg["target"]["name"] == "app")
            .find_map(|msg| msg["executable"].as_str().map(PathBuf::from))
            .expect("cargo reported no executable for the app example")
    })
}

/// The binary with only `vars` set among the variables the app reads.
pub(crate) fn app_command(vars: &[(&str, &str)]) -> Command {
    let mut command = Command::new(app_binary());
    for var in [
        "PORT",
        "REDIS_URL",
        "REDIS_CLUSTER_URLS",
        "REDIS_SENTINELS",
        "DATABASE_URL",
        "APP_LIMITS",
        "APP_ALGORITHM",
        "APP_LEASE",
        "APP_BLOCK",
        "APP_JOB_MS",
        "APP_JOB_CONCURRENCY",
        "APP_JOB_LEASE_MS",
        "APP_PAYMENT_DELAY_MS",
        "APP_REPORT_MS",
        "APP_TRANSFER_DELAY_MS",
        "APP_TOKEN_LIMITS",
        "APP_API_KEYS",
        "APP_ADMIN_TOKEN",
        "APP_JOB_TIERS",
        "APP_TRUSTED_PROXIES",
        "APP_ON_STORE_ERROR",
        "APP_STORE_TIMEOUT_MS",
        "REDIS_SENTINEL_MASTER",
        "REDIS_WAIT_REPLICAS",
        "REDIS_CA_CERT",
        "RUST_LOG",
    ] {
        command.env_remove(var);
    }
    if !vars.iter().any(|(var, _)| *var == "APP_API_KEYS") {
        command.env("APP_API_KEYS", crate::own_keys_var(&TEST_CALLERS));
    }
    command.envs(vars.iter().copied());
    command.stdin(Stdio::null());
    command
}

/// Waits up to `limit` for `child` to exit; kills it and fails otherwise.
fn wait_with_deadline(mut child: Child, limit: Duration) -> std::process::Output {
    let deadline = Instant::now() + limit;
    while child.try_wait().unwrap().is_none() {
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("the app did not exit within {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    child.wait_with_output().unwrap()
}

#[test]
fn the_binary_exits_2_on_bad_configuration() {
    let cases: [(&str, &str, &str); 7] = [
        ("APP_LIMITS", "bad", "name:count/<seconds>s"),
        ("APP_LIMITS", "burst:0/1s", "at least 1"),
        ("APP_ALGORITHM", "fast", "sliding-log"),
        ("PORT", "http", "TCP port"),
        ("REDIS_URL", "definitely not a url", "Redis URL"),
        ("APP_STORE_TIMEOUT_MS", "0", "a store call needs some time"),
        ("APP_STORE_TIMEOUT_MS", "soon", "milliseconds"),
    ];
    for (var, value, expected) in cases {
        let mut vars = vec![(var, value)];
        if var != "PORT" {
            // should the check fail, the app at least does not take port 3000
            vars.push(("PORT", "0"));
        }
        let child = app_command(&vars)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let output = wait_with_deadline(child, Duration::from_secs(30));
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert_eq!(output.status.code(), Some(2), "{var}={value}: {stderr}");
        assert!(
            stderr.contains(&format!("error: invalid {var}=")),
            "{var}={value}: {stderr}"
        );
        assert!(stderr.contains(expected), "{var}={value}: {stderr}");
        assert!(
            !String::from_utf8_lossy(&output.stdout).contains("listening"),
            "{var}={value}: served anyway"
        );
    }
}

/// Kills the child on drop, so a failing assertion leaves no server behind.
pub(crate) struct Running(pub(crate) Child);

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Starts the binary with `vars` (and `PORT=0`, and `APP_STORE_TIMEOUT_MS=2000` unless `vars`
/// set it); the running child and the URL it announced.
pub(crate) fn serve(vars: &[(&str, &str)]) -> (Running, String) {
    let mut vars = vars.to_vec();
    vars.push(("PORT", "0"));
    // a store call may take this long on a loaded machine before it counts as failed
    if !vars.iter().any(|(name, _)| *name == "APP_STORE_TIMEOUT_MS") {
        vars.push(("APP_STORE_TIMEOUT_MS", "2000"));
    }
    let mut child = Running(
        app_command(&vars)
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    let stdout = child.0.stdout.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    let line = rx
        .recv_timeout(Duration::from_secs(30))
        .expect("the app printed no address");
    let url = line
        .strip_prefix("tollgate example app listening on ")
        .unwrap_or_else(|| panic!("unexpected first line {line:?}"))
        .to_owned();
    (child, url)
}

/// `GET <url><path>` as caller `api_key`.
fn get_from(url: &str, path: &str, api_key: &str) -> hyper_util::client::legacy::ResponseFuture {
    let client = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .build_http::<http_body_util::Empty<Bytes>>();
    let request = Request::get(format!("{url}{path}"))
        .header("x-api-key", api_key)
        .body(http_body_util::Empty::new())
        .unwrap();
    client.request(request)
}

/// What the store has charged `api_key` of a daily GCRA limit of `quota` on `server`: the units
/// its arrival time is ahead of the store's clock (a unit frees every day / quota, far longer
/// than a test).
fn gcra_charged(server: &RedisServer, quota: u64) -> u64 {
    let mut conn = server.conn();
    let keys: Vec<String> = redis::cmd("KEYS").arg("*:gcra").query(&mut conn).unwrap();
    assert_eq!(keys.len(), 1, "{keys:?}");
    let value: String = redis::cmd("GET").arg(&keys[0]).query(&mut conn).unwrap();
    let tat: u64 = value.split(':').next().unwrap().parse().unwrap();
    let (secs, micros): (u64, u64) = redis::cmd("TIME").query(&mut conn).unwrap();
    let interval = 86_400_000_000 / quota;
    tat.saturating_sub(secs * 1_000_000 + micros)
        .div_ceil(interval)
}

/// `APP_LEASE=on`: a caller's requests are admitted from a slice the binary leased, charged in
/// the store ahead of them; stopped with SIGTERM, the binary gives back what it held unspent
/// before it exits, so the store counts exactly what it admitted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_binary_gives_back_its_leased_quota_when_stopped() {
    let server = RedisServer::start();
    let (mut child, url) = serve(&[
        ("REDIS_URL", &server.url()),
        ("APP_LEASE", "on"),
        ("APP_ALGORITHM", "gcra"),
        ("APP_LIMITS", "day:1000/86400s"),
    ]);
    for _ in 0..20 {
        let reply = get_from(&url, "/api/hello", "dave").await.unwrap();
        assert_eq!(reply.status(), StatusCode::OK);
    }
    let held = gcra_charged(&server, 1000);
    assert!(
        held > 20,
        "no slice was leased: {held} charged for 20 admitted"
    );
    let pid = child.0.id().to_string();
    let status = Command::new("kill").args(["-TERM", &pid]).status().unwrap();
    assert!(status.success());
    let deadline = Instant::now() + Duration::from_secs(10);
    while child.0.try_wait().unwrap().is_none() {
        assert!(
            Instant::now() < deadline,
            "the app did not stop within 10 s"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(
        gcra_charged(&server, 1000),
        20,
        "what the slices held unspent ({held} charged) was not given back"
    );
}

#[tokio::test]
async fn the_binary_serves_and_announces_its_address() {
    let server = RedisServer::start();
    let (_child, url) = serve(&[
        ("REDIS_URL", &server.url()),
        ("APP_LIMITS", "burst:2/3600s"),
    ]);
    let get = |path: &str| get_from(&url, path, "ivan");
    assert_eq!(get("/healthz").await.unwrap().status(), StatusCode::OK);
    assert_eq!(get("/api/hello").await.unwrap().status(), StatusCode::OK);
    assert_eq!(get("/api/hello").await.unwrap().status(), StatusCode::OK);
    let denied = get("/api/hello").await.unwrap();
    assert_eq!(denied.status(), StatusCode::TOO_MANY_REQUESTS);
    assert!(denied.headers().contains_key("retry-after"));
    let again = get("/api/hello").await.unwrap();
    assert_eq!(again.status(), StatusCode::TOO_MANY_REQUESTS);

    // the series, in Prometheus text, not rate-limited
    for _ in 0..2 {
        let metrics = get("/metrics").await.unwrap();
        assert_eq!(metrics.status(), StatusCode::OK);
        let text = metrics.into_body().collect().await.unwrap().to_bytes();
        let text = String::from_utf8(text.to_vec()).unwrap();
        let limiter = format!("limiter=\"{}:rl\"", app::API_PREFIX);
        for (labels, count) in [
            ("outcome=\"admitted\",source=\"store\"", 2),
            ("outcome=\"denied\",source=\"store\"", 1),
            ("outcome=\"denied\",source=\"deny_cache\"", 1),
        ] {
            let line = format!("tollgate_rate_limit_decisions_total{{{limiter},{labels}}} {count}");
            assert!(text.lines().any(|l| l == line), "{line} in:\n{text}");
        }
        assert!(
            text.contains("tollgate_store_call_duration_seconds"),
            "store calls in:\n{text}"
        );
    }
}

/// `APP_STORE_TIMEOUT_MS` bounds the binary's store calls: with every Redis reply 300 ms late,
/// a copy given 5 s redeems a coupon, and a copy given 150 ms answers `503`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_binary_bounds_its_store_calls_by_app_store_timeout_ms() {
    let server = RedisServer::start();
    let proxy = common::proxy::Proxy::start(server.addr()).await;
    proxy.delay_replies(Duration::from_millis(300));
    let redis_url = proxy.url();
    let redeem = |url: String, code: &str| {
        let client =
            hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
                .build_http::<http_body_util::Empty<Bytes>>();
        let request = Request::post(format!("{url}/coupons/{code}/redeem"))
            .body(http_body_util::Empty::new())
            .unwrap();
        async move { client.request(request).await.unwrap().status() }
    };
    let (_patient, patient) = serve(&[("REDIS_URL", &redis_url), ("APP_STORE_TIMEOUT_MS", "5000")]);
    assert_eq!(redeem(patient, "T1").await, StatusCode::OK);
    let (_hasty, hasty) = serve(&[("REDIS_URL", &redis_url), ("APP_STORE_TIMEOUT_MS", "150")]);
    assert_eq!(redeem(hasty, "T2").await, StatusCode::SERVICE_UNAVAILABLE);
}

/// On `DATABASE_URL`: a database that is down at start is not fatal — `/healthz` answers 503
/// and names `postgres` — and once it is up the app migrates its schema by itself and limits
/// exactly.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_binary_on_postgres_waits_for_the_database_and_then_limits() {
    let mut server = tokio::task::spawn_blocking(common::postgres::PgServer::start)
        .await
        .unwrap();
    let database = server.url();
    tokio::task::block_in_place(|| server.stop());
    let (_child, url) = serve(&[("DATABASE_URL", &database), ("APP_LIMITS", "burst:2/3600s")]);
    let health = get_from(&url, "/healthz", "ivan").await.unwrap();
    assert_eq!(health.status(), StatusCode::SERVICE_UNAVAILABLE);
    let body = health.into_body().collect().await.unwrap().to_bytes();
    let body: Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(body["store"], "postgres");

    tokio::task::block_in_place(|| server.restart());
    // migrated in the background: the first decision by the store carries the RateLimit fields
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let response = get_from(&url, "/api/hello", "probe").await.unwrap();
        if response.headers().contains_key("ratelimit") {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "not limiting 20 s after the database came up"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let health = get_from(&url, "/healthz", "ivan").await.unwrap();
    assert_eq!(health.status(), StatusCode::OK);
    for expected in [
        StatusCode::OK,
        StatusCode::OK,
        StatusCode::TOO_MANY_REQUESTS,
    ] {
        let response = get_from(&url, "/api/hello", "ivan").await.unwrap();
        assert_eq!(response.status(), expected);
    }
}
