//! The example app's admin routes (`/admin/callers/{key}[/reset]`) as an attacker meets them: a
//! wrong token resets nothing, repeated wrong tokens from one address are refused with `429`
//! (even once the right one comes), and every call is logged with its peer and the key as a
//! short digest; and the secrets of the app's configuration stay out of its `Debug`.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use crate::router as app;

use std::io::Write;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, OnceLock};

use app::{AppConfig, AppState};
use axum::Router;
use axum::body::Body;
use axum::extract::ConnectInfo;
use http::{Request, StatusCode};
use tollgate::store::{MemoryStore, Store};
use tower::ServiceExt;

const ADMIN: &str = "s3cret-admin-token";

/// ann's API key: what an operator names in the admin path.
const ANN_KEY: &str = "sk_live_ann_0123";

fn config() -> AppConfig {
    AppConfig {
        limits: app::parse_limits("hourly:2/3600s").unwrap(),
        admin_token: Some(ADMIN.to_owned()),
        api_keys: app::ApiKeys::parse(&format!("{ANN_KEY}:ann:free")).unwrap(),
        ..AppConfig::defaults().unwrap()
    }
}

fn app() -> Router {
    let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
    app::router(AppState::new(store, config()).unwrap())
}

fn from(peer: &str, mut request: Request<Body>) -> Request<Body> {
    let peer: SocketAddr = peer.parse().unwrap();
    request.extensions_mut().insert(ConnectInfo(peer));
    request
}

fn admin(peer: &str, method: &str, path: &str, token: &str) -> Request<Body> {
    let request = Request::builder()
        .method(method)
        .uri(path)
        .header("authorization", format!("Bearer {token}"))
        .body(Body::empty())
        .unwrap();
    from(peer, request)
}

fn hello() -> Request<Body> {
    let request = Request::get("/api/hello")
        .header("x-api-key", ANN_KEY)
        .body(Body::empty())
        .unwrap();
    from("198.51.100.1:1", request)
}

async fn status(app: &Router, request: Request<Body>) -> StatusCode {
    app.clone().oneshot(request).await.unwrap().status()
}

const RESET: &str = "/admin/callers/sk_live_ann_0123/reset";
const PEEK: &str = "/admin/callers/sk_live_ann_0123";

#[tokio::test]
async fn a_wrong_token_is_refused_and_resets_nothing() {
    let app = app();
    for expected in [
        StatusCode::OK,
        StatusCode::OK,
        StatusCode::TOO_MANY_REQUESTS,
    ] {
        assert_eq!(status(&app, hello()).await, expected);
    }
    for token in ["guess", "", "s3cret-admin-toke", "s3cret-admin-token-"] {
        let refused = status(&app, admin("192.0.2.1:1", "POST", RESET, token)).await;
        assert_eq!(refused, StatusCode::UNAUTHORIZED, "{token:?}");
    }
    let no_header = from(
        "192.0.2.1:1",
        Request::post(RESET).body(Body::empty()).unwrap(),
    );
    assert_eq!(status(&app, no_header).await, StatusCode::UNAUTHORIZED);
    assert_eq!(
        status(&app, hello()).await,
        StatusCode::TOO_MANY_REQUESTS,
        "still spent: nothing was reset"
    );
    let reset = status(&app, admin("192.0.2.2:1", "POST", RESET, ADMIN)).await;
    assert_eq!(reset, StatusCode::NO_CONTENT);
    assert_eq!(status(&app, hello()).await, StatusCode::OK);
    // a key the table does not know is no caller to reset
    let unknown = admin("192.0.2.2:1", "POST", "/admin/callers/nobody/reset", ADMIN);
    assert_eq!(status(&app, unknown).await, StatusCode::NOT_FOUND);
}

#[tokio::test]
async fn repeated_wrong_tokens_from_one_address_get_429_even_with_the_right_token() {
    let app = app();
    // right tokens cost no failure: ten calls, then still the whole allowance of failures
    for _ in 0..10 {
        let peek = status(&app, admin("192.0.2.7:1", "GET", PEEK, ADMIN)).await;
        assert_eq!(peek, StatusCode::OK);
    }
    let mut statuses = Vec::new();
    for i in 0..8 {
        let guess = format!("guess-{i}");
        statuses.push(status(&app, admin("192.0.2.7:2", "POST", RESET, &guess)).await);
    }
    let refused = statuses
        .iter()
        .filter(|s| **s == StatusCode::UNAUTHORIZED)
        .count();
    let limited = statuses
        .iter()
        .filter(|s| **s == StatusCode::TOO_MANY_REQUESTS)
        .count();
    assert_eq!(refused as u64, app::ADMIN_FAILURES, "{statuses:?}");
    assert_eq!(limited, 8 - refused, "{statuses:?}");
    assert_eq!(
        &statuses[..refused],
        vec![StatusCode::UNAUTHORIZED; refused]
    );
    // the address is locked out, right token or not (another port is the same address)
    let right = status(&app, admin("192.0.2.7:3", "POST", RESET, ADMIN)).await;
    assert_eq!(right, StatusCode::TOO_MANY_REQUESTS);
    // another address is not
    let other = status(&app, admin("192.0.2.8:1", "GET", PEEK, ADMIN)).await;
    assert_eq!(other, StatusCode::OK);
}

/// Twenty wrong tokens at once from one address: each reserves a failure before its token is
/// read, so exactly `ADMIN_FAILURES` reach the check and every other one is `429`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wrong_tokens_sent_at_once_get_exactly_the_allowance_of_401s() {
    let app = app();
    let calls = (0..20).map(|i| {
        let request = admin("192.0.2.9:1", "POST", RESET, &format!("guess-{i}"));
        app.clone().oneshot(request)
    });
    let statuses: Vec<StatusCode> = futures_util::future::join_all(calls)
        .await
        .into_iter()
        .map(|response| response.unwrap().status())
        .collect();
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
        (app::ADMIN_FAILURES, 15),
        "{statuses:?}"
    );
}

/// The admin routes' log lines, from every test of this binary.
#[derive(Clone, Default)]
struct Captured(Arc<Mutex<Vec<u8>>>);

/// The log of the app's admin routes (target `app::router::ops`, at info), captured by the one
/// global subscriber of this test binary. Global, not scoped to the test's thread: an event
/// whose call site another test's thread registered first would be missed by a scoped one.
fn admin_log() -> &'static Captured {
    static LOG: OnceLock<Captured> = OnceLock::new();
    LOG.get_or_init(|| {
        let captured = Captured::default();
        let writer = captured.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_writer(move || writer.clone())
            .with_ansi(false)
            .with_env_filter(tracing_subscriber::EnvFilter::new("app::router::ops=info"))
            .finish();
        tracing::subscriber::set_global_default(subscriber)
            .expect("no other global subscriber in this test binary");
        captured
    })
}

impl Write for Captured {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(bytes);
        Ok(bytes.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Captured {
    fn lines(&self) -> Vec<String> {
        let text = String::from_utf8(self.0.lock().unwrap().clone()).unwrap();
        text.lines().map(str::to_owned).collect()
    }
}

#[tokio::test]
async fn every_admin_call_is_logged_with_its_peer_and_the_key_masked() {
    let captured = admin_log();
    let app = app();
    let masked = app::masked(ANN_KEY);
    assert_eq!(masked.len(), "key#".len() + 8);

    assert_eq!(
        status(&app, admin("192.0.2.30:4100", "GET", PEEK, ADMIN)).await,
        StatusCode::OK
    );
    assert_eq!(
        status(&app, admin("192.0.2.31:4200", "POST", RESET, "wrong-token")).await,
        StatusCode::UNAUTHORIZED
    );
    assert_eq!(
        status(&app, admin("192.0.2.32:4300", "POST", RESET, ADMIN)).await,
        StatusCode::NO_CONTENT
    );
    let lines = captured.lines();
    let line_of = |peer: &str| {
        lines
            .iter()
            .find(|line| line.contains("admin call") && line.contains(peer))
            .unwrap_or_else(|| panic!("no admin line names {peer}: {lines:#?}"))
    };
    let peek = line_of("peer=192.0.2.30:4100");
    assert!(peek.contains("client=192.0.2.30 "), "{peek}");
    assert!(peek.contains(&format!("key={masked}")), "{peek}");
    assert!(
        peek.contains("tenant=\"ann\"") || peek.contains("tenant=ann"),
        "{peek}"
    );
    assert!(
        peek.contains("action=\"peek\"") || peek.contains("action=peek"),
        "{peek}"
    );
    let refused = line_of("peer=192.0.2.31:4200");
    assert!(refused.contains("WARN"), "{refused}");
    assert!(refused.contains(&format!("key={masked}")), "{refused}");
    let reset = line_of("peer=192.0.2.32:4300");
    assert!(reset.contains("reset"), "{reset}");
    assert!(reset.contains(&format!("key={masked}")), "{reset}");
    for line in &lines {
        assert!(!line.contains(ANN_KEY), "the raw key is logged: {line}");
        assert!(!line.contains(ADMIN), "the admin token is logged: {line}");
        assert!(
            !line.contains("wrong-token"),
            "a presented token is logged: {line}"
        );
    }
}

/// `{:?}` of the configuration and of the state shows neither the admin token nor an API key
/// nor a store password, whichever store variable holds it.
#[test]
fn debug_shows_no_token_key_or_store_password() {
    let passwords = [
        "pw-redis-1",
        "pw-cluster-2",
        "pw-sentinel-3",
        "pw-postgres-4",
    ];
    let config = AppConfig {
        redis_url: Some(format!("redis://app:{}@cache:6379/0", passwords[0])),
        redis_cluster_urls: vec![format!("redis://:{}@node-a:7000/", passwords[1])],
        redis_sentinels: vec![format!("redis://{}@sentinel:26379/", passwords[2])],
        database_url: Some(format!("postgres://app:{}@db:5432/app", passwords[3])),
        ..config()
    };
    let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
    let state = AppState::new(store, config.clone()).unwrap();
    for shown in [
        format!("{config:?}"),
        format!("{config:#?}"),
        format!("{state:?}"),
    ] {
        for secret in passwords.iter().chain([&ADMIN, &ANN_KEY]) {
            assert!(!shown.contains(secret), "{secret} in {shown}");
        }
        assert!(
            shown.contains("<redacted>"),
            "the token's presence is shown: {shown}"
        );
        assert!(shown.contains("cache:6379"), "the hosts stay: {shown}");
        assert!(shown.contains("ann"), "the tenants stay: {shown}");
    }
}

/// The demo table parses, says it is the demo, and knows its two public keys; a table given in
/// `APP_API_KEYS` is no demo, and an error in it never echoes a key.
#[test]
fn api_key_tables_parse_and_their_errors_show_no_key() {
    let demo = app::ApiKeys::demo();
    assert!(demo.is_demo());
    assert_eq!(demo.caller(b"demo").map(|c| c.plan()), Some("free"));
    assert_eq!(demo.caller(b"demo-pro").map(|c| c.plan()), Some("pro"));
    assert_eq!(demo.caller(b"demo-enterprise"), None);
    let set = AppConfig::from_lookup(|var| {
        (var == "APP_API_KEYS").then(|| "sk_1:acme:pro, sk_2:acme:pro".to_owned())
    })
    .unwrap();
    assert!(!set.api_keys.is_demo());
    assert_eq!(
        set.api_keys.caller(b"sk_2").map(|c| c.tenant()),
        Some("acme")
    );
    for bad in [
        "sk_secret_1:acme",
        "sk_secret_1:acme:pro:x",
        "sk_secret_1::pro",
        "sk_secret_1:a:p,sk_secret_1:b:p",
    ] {
        let error = AppConfig::from_lookup(|var| (var == "APP_API_KEYS").then(|| bad.to_owned()))
            .unwrap_err();
        assert_eq!(error.var, "APP_API_KEYS");
        assert!(!error.to_string().contains("sk_secret"), "{error}");
    }
}

/// `PUT` / `DELETE /admin/callers/{key}/limits` through one copy of the app govern the other:
/// two copies built with different `APP_LIMITS` on one store admit the quota in force, a
/// tenant's own limits set through one are in force on both, limits the layer refuses are `422`
/// and change nothing, and a tenant without limits of its own is `404`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn limits_set_through_one_copy_govern_both() {
    let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
    let copy = |limits: &str| {
        let config = AppConfig {
            limits: app::parse_limits(limits).unwrap(),
            ..config()
        };
        let store = Arc::clone(&store);
        async move {
            let state = AppState::new(Arc::clone(&store), config.clone()).unwrap();
            let state = state.with_limits_in_store(store, &config, 0).await.unwrap();
            app::router(state)
        }
    };
    let (a, b) = (copy("hourly:2/3600s").await, copy("hourly:9/3600s").await);
    let limits = "/admin/callers/sk_live_ann_0123/limits";
    let put = |body: &'static str| {
        let request = Request::put(limits)
            .header("authorization", format!("Bearer {ADMIN}"))
            .header("x-note", "ann on trial")
            .body(Body::from(body))
            .unwrap();
        from("203.0.113.9:1", request)
    };
    assert_eq!(status(&b, hello()).await, StatusCode::OK);
    assert_eq!(status(&a, hello()).await, StatusCode::OK);
    assert_eq!(status(&b, hello()).await, StatusCode::TOO_MANY_REQUESTS);

    assert_eq!(
        status(&a, put("hourly:0/3600s")).await,
        StatusCode::UNPROCESSABLE_ENTITY
    );
    assert_eq!(status(&b, hello()).await, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(status(&a, put("hourly:3/3600s")).await, StatusCode::OK);
    // in force on b at once (the store's broadcast), what ann spent kept: one more
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(3);
    while status(&b, hello()).await != StatusCode::OK {
        assert!(
            tokio::time::Instant::now() < deadline,
            "b never took ann's limits"
        );
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    assert_eq!(status(&a, hello()).await, StatusCode::TOO_MANY_REQUESTS);

    let delete = || admin("203.0.113.9:1", "DELETE", limits, ADMIN);
    assert_eq!(status(&b, delete()).await, StatusCode::OK);
    assert_eq!(status(&a, delete()).await, StatusCode::NOT_FOUND);
}
