//! Integration tests of the HTTP rate-limit layer ([`RateLimitLayer`]) against real
//! `redis-server` processes: exactness across separately built copies, all-or-nothing limits and
//! cost, the exact syntax of the IETF headers, sliding windows, hostile keys, gRPC rejections,
//! the store failure policies (killed, frozen and restarted servers), missing keys and the decision
//! extensions.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use crate::common;

use std::convert::Infallible;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::request::Parts;
use http::{HeaderMap, HeaderName, HeaderValue, Request, Response, StatusCode};
use http_body::Body as _;
use http_body_util::{BodyExt, Full};
use tower::util::BoxCloneSyncService;
use tower::{ServiceBuilder, ServiceExt};

use common::RedisServer;
use tollgate::key::{Header, KeyExtractor};
use tollgate::rate_limit::ResponseBody;
use tollgate::rate_limit::{
    Algorithm, DecisionSource, Limit, MissingKey, OnStoreError, QuotaUnit, RateLimitDecision,
    RateLimitLayer,
};
use tollgate::store::RedisStore;

pub(super) const CLIENT: HeaderName = HeaderName::from_static("x-client");
const SAW: HeaderName = HeaderName::from_static("x-saw-decision");

pub(super) type Svc =
    BoxCloneSyncService<Request<String>, Response<ResponseBody<Full<Bytes>>>, Infallible>;

/// Counts the calls that reach the inner service.
#[derive(Clone, Default)]
pub(super) struct Calls(Arc<AtomicUsize>);

impl Calls {
    fn get(&self) -> usize {
        self.0.load(Ordering::SeqCst)
    }
}

/// The layer around an inner service that answers `200 hello`, counts its calls, and reports in
/// `x-saw-decision` the decision it found in the request extensions.
pub(super) fn stack<K: KeyExtractor>(layer: RateLimitLayer<K>, calls: &Calls) -> Svc {
    let calls = Arc::clone(&calls.0);
    let inner = tower::service_fn(move |req: Request<String>| {
        calls.fetch_add(1, Ordering::SeqCst);
        let saw = req
            .extensions()
            .get::<RateLimitDecision>()
            .map(|d| format!("admitted={};source={:?}", d.admitted(), d.source()));
        async move {
            let mut res = Response::new(Full::new(Bytes::from_static(b"hello")));
            if let Some(saw) = saw {
                res.headers_mut()
                    .insert(SAW, HeaderValue::from_str(&saw).unwrap());
            }
            Ok::<_, Infallible>(res)
        }
    });
    BoxCloneSyncService::new(ServiceBuilder::new().layer(layer).service(inner))
}

/// A store on `server` with timeout `timeout`.
fn store(server: &RedisServer, timeout: Duration) -> RedisStore {
    RedisStore::builder(server.url())
        .timeout(timeout)
        .build()
        .expect("redis store")
}

/// A response, taken apart.
#[derive(Debug)]
pub(super) struct Reply {
    pub(super) status: StatusCode,
    headers: HeaderMap,
    decision: Option<RateLimitDecision>,
    body: Bytes,
    /// Whether the body said it was at its end before it was read.
    empty_body_hint: bool,
}

impl Reply {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .get(name)
            .map(|v| v.to_str().expect("ASCII header"))
    }

    pub(super) fn decision(&self) -> &RateLimitDecision {
        self.decision
            .as_ref()
            .expect("a RateLimitDecision in the response extensions")
    }

    fn retry_after_secs(&self) -> u64 {
        self.header("retry-after")
            .expect("a Retry-After header")
            .parse()
            .expect("Retry-After is whole seconds")
    }
}

pub(super) async fn send(svc: &Svc, req: Request<String>) -> Reply {
    let res = svc.clone().oneshot(req).await.unwrap();
    let (parts, body) = res.into_parts();
    let empty_body_hint = body.is_end_stream();
    let body = body.collect().await.unwrap().to_bytes();
    Reply {
        status: parts.status,
        headers: parts.headers,
        decision: parts.extensions.get::<RateLimitDecision>().cloned(),
        body,
        empty_body_hint,
    }
}

/// `GET /` from caller `client` (header `x-client`, any bytes).
pub(super) fn get(client: impl AsRef<[u8]>) -> Request<String> {
    Request::get("/")
        .header(CLIENT, HeaderValue::from_bytes(client.as_ref()).unwrap())
        .body(String::new())
        .unwrap()
}

/// `GET /` from caller `client` costing `cost`.
pub(super) fn get_costing(client: &str, cost: u64) -> Request<String> {
    let mut req = get(client);
    req.headers_mut().insert("x-cost", HeaderValue::from(cost));
    req
}

/// The `x-cost` header, else 1.
pub(super) fn cost_header(parts: &Parts) -> u64 {
    parts
        .headers
        .get("x-cost")
        .and_then(|v| v.to_str().ok())
        .and_then(|s| s.parse().ok())
        .unwrap_or(1)
}

/// A gRPC call from caller `client`.
fn grpc_call(client: &str, content_type: &'static str) -> Request<String> {
    let mut req = get(client);
    *req.method_mut() = http::Method::POST;
    *req.uri_mut() = "/pkg.Service/Method".parse().unwrap();
    req.headers_mut().insert(
        http::header::CONTENT_TYPE,
        HeaderValue::from_static(content_type),
    );
    req.headers_mut()
        .insert("te", HeaderValue::from_static("trailers"));
    req
}

/// Polls `svc` with requests of `client` until one is admitted by the store; panics after
/// `within`.
async fn until_store_admits(svc: &Svc, client: &str, within: Duration) -> Reply {
    let deadline = Instant::now() + within;
    loop {
        let reply = send(svc, get(client)).await;
        if reply.status == StatusCode::OK
            && reply.decision.as_ref().map(RateLimitDecision::source) == Some(DecisionSource::Store)
        {
            return reply;
        }
        assert!(
            Instant::now() < deadline,
            "the layer did not reach the store again within {within:?}; last reply: {reply:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

// ---------------------------------------------------------------------------------------------
// 1. Exactness across copies
// ---------------------------------------------------------------------------------------------

/// Two separately built stacks, each with its own `RedisStore` on one server, share one limit of
/// 20 per minute: 200 concurrent requests of one caller spread over both admit exactly 20.
async fn two_copies_admit_exactly_the_limit(algorithm: Algorithm) {
    let server = RedisServer::start();
    let build = || {
        RateLimitLayer::builder(store(&server, Duration::from_secs(5)))
            .limit(Limit::per_minute("minute", 20))
            .algorithm(algorithm)
            .key(Header::new(CLIENT))
            .build()
            .unwrap()
    };
    let (calls_a, calls_b) = (Calls::default(), Calls::default());
    let copies = [stack(build(), &calls_a), stack(build(), &calls_b)];

    let tasks: Vec<_> = (0..200)
        .map(|i| {
            let svc = copies[i % 2].clone();
            tokio::spawn(async move { send(&svc, get("alice")).await })
        })
        .collect();
    let mut replies = Vec::new();
    for task in tasks {
        replies.push(task.await.unwrap());
    }

    for reply in &replies {
        // A store timeout would be admitted by the default failure policy: rule it out. Denials
        // may come from the store or from a copy's cache of an earlier store denial.
        let decision = reply.decision();
        if decision.admitted() {
            assert_eq!(decision.source(), DecisionSource::Store, "{algorithm}");
        } else {
            assert!(
                matches!(
                    decision.source(),
                    DecisionSource::Store | DecisionSource::DenyCache
                ),
                "{algorithm}: denied by {:?}",
                decision.source()
            );
        }
    }
    let ok = replies
        .iter()
        .filter(|r| r.status == StatusCode::OK)
        .count();
    let denied: Vec<&Reply> = replies
        .iter()
        .filter(|r| r.status == StatusCode::TOO_MANY_REQUESTS)
        .collect();
    assert_eq!(ok, 20, "{algorithm}: exactly the limit is admitted");
    assert_eq!(denied.len(), 180, "{algorithm}: all others are denied");
    assert_eq!(
        calls_a.get() + calls_b.get(),
        20,
        "{algorithm}: denied requests never reach the inner service"
    );
    for reply in denied {
        assert!(reply.retry_after_secs() >= 1);
        assert!(!reply.decision().admitted());
    }

    // Another caller is untouched by alice's exhaustion, on either copy.
    assert_eq!(send(&copies[1], get("bob")).await.status, StatusCode::OK);
    assert_eq!(send(&copies[0], get("bob")).await.status, StatusCode::OK);
    // And alice stays denied on both copies.
    assert_eq!(
        send(&copies[0], get("alice")).await.status,
        StatusCode::TOO_MANY_REQUESTS
    );
    assert_eq!(
        send(&copies[1], get("alice")).await.status,
        StatusCode::TOO_MANY_REQUESTS
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn two_copies_admit_exactly_the_limit_sliding_log() {
    two_copies_admit_exactly_the_limit(Algorithm::SlidingLog).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn two_copies_admit_exactly_the_limit_sliding_counter() {
    two_copies_admit_exactly_the_limit(Algorithm::SlidingCounter).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn two_copies_admit_exactly_the_limit_gcra() {
    two_copies_admit_exactly_the_limit(Algorithm::Gcra).await;
}

// ---------------------------------------------------------------------------------------------
// 2. All-or-nothing over several limits, and cost
// ---------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread")]
async fn several_limits_are_all_or_nothing_and_cost_is_charged() {
    let server = RedisServer::start();
    let layer = RateLimitLayer::builder(server.store())
        .limit(Limit::per_second("a", 5))
        .limit(Limit::per_minute("b", 8))
        .key(Header::new(CLIENT))
        .cost(cost_header)
        .build()
        .unwrap();
    let calls = Calls::default();
    let svc = stack(layer, &calls);

    // Cost 5 fills "a" and leaves 3 of "b".
    let r = send(&svc, get_costing("c1", 5)).await;
    assert_eq!(r.status, StatusCode::OK);
    assert_eq!(r.decision().cost(), 5);
    assert_eq!(r.header("ratelimit"), Some(r#""a";r=0;t=1, "b";r=3;t=60"#));

    // "a" is full: denied, and "b" is not charged.
    let r = send(&svc, get_costing("c1", 1)).await;
    assert_eq!(r.status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(r.header("retry-after"), Some("1"));
    assert_eq!(r.header("ratelimit"), Some(r#""a";r=0;t=1, "b";r=3;t=60"#));

    // "a" empties after its 1 s window; "b" (3 left) now blocks a cost of 4 — and "a" is not
    // charged by that denial.
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let r = send(&svc, get_costing("c1", 4)).await;
    assert_eq!(r.status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(r.header("ratelimit"), Some(r#""a";r=5;t=0, "b";r=3;t=59"#));
    assert_eq!(r.header("retry-after"), Some("59"));

    // Cost 3 fits both.
    let r = send(&svc, get_costing("c1", 3)).await;
    assert_eq!(r.status, StatusCode::OK);
    assert_eq!(r.header("ratelimit"), Some(r#""a";r=2;t=1, "b";r=0;t=59"#));

    // "b" is full: a cost of 1 is denied and "a" keeps its 2.
    let r = send(&svc, get_costing("c1", 1)).await;
    assert_eq!(r.status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(r.header("ratelimit"), Some(r#""a";r=2;t=1, "b";r=0;t=59"#));

    // A cost above a quota never fits: denied for the longest such window, nothing charged.
    let r = send(&svc, get_costing("c2", 9)).await;
    assert_eq!(r.status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(r.header("retry-after"), Some("60"));
    assert_eq!(r.header("ratelimit"), Some(r#""a";r=5;t=0, "b";r=8;t=0"#));
    let r = send(&svc, get("c2")).await;
    assert_eq!(r.status, StatusCode::OK);
    assert_eq!(r.decision().cost(), 1, "no x-cost header: cost 1");
    assert_eq!(r.header("ratelimit"), Some(r#""a";r=4;t=1, "b";r=7;t=60"#));

    // Cost 0 passes without a check, even for the exhausted caller.
    let r = send(&svc, get_costing("c1", 0)).await;
    assert_eq!(r.status, StatusCode::OK);
    assert_eq!(r.body, "hello");

    assert_eq!(
        calls.get(),
        4,
        "only the admitted requests reached the inner service"
    );
}

// ---------------------------------------------------------------------------------------------
// 3. Header syntax
// ---------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread")]
async fn headers_have_the_exact_draft_syntax() {
    let server = RedisServer::start();
    let build = |prefix: &str, on_success: bool| {
        RateLimitLayer::builder(server.store())
            .prefix(prefix)
            .limit(Limit::per_second("burst", 3))
            .limit(Limit::per_minute("minute", 100))
            .key(Header::new(CLIENT))
            .headers_on_success(on_success)
            .build()
            .unwrap()
    };
    let policy = r#""burst";q=3;w=1, "minute";q=100;w=60"#;
    let svc = stack(build("with", true), &Calls::default());

    let expected = [
        r#""burst";r=2;t=1, "minute";r=99;t=60"#,
        r#""burst";r=1;t=1, "minute";r=98;t=60"#,
        r#""burst";r=0;t=1, "minute";r=97;t=60"#,
    ];
    let started = Instant::now();
    for state in expected {
        let r = send(&svc, get("h")).await;
        assert_eq!(r.status, StatusCode::OK);
        assert_eq!(r.header("ratelimit-policy"), Some(policy));
        assert_eq!(r.header("ratelimit"), Some(state));
        assert_eq!(r.header("retry-after"), None);
        assert_eq!(r.body, "hello");
    }
    let r = send(&svc, get("h")).await;
    assert!(
        started.elapsed() < Duration::from_millis(900),
        "the burst took too long for exact expectations"
    );
    assert_eq!(r.status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(r.header("retry-after"), Some("1"));
    assert_eq!(r.retry_after_secs(), 1);
    assert_eq!(r.header("ratelimit-policy"), Some(policy));
    // Denied: nothing charged, so "minute" shows its real remainder.
    assert_eq!(
        r.header("ratelimit"),
        Some(r#""burst";r=0;t=1, "minute";r=97;t=60"#)
    );
    assert_eq!(r.headers.get_all("ratelimit").iter().count(), 1);
    assert_eq!(r.headers.get_all("ratelimit-policy").iter().count(), 1);

    // headers_on_success(false): admitted responses carry neither header, rejections both.
    let svc = stack(build("without", false), &Calls::default());
    for _ in 0..3 {
        let r = send(&svc, get("h")).await;
        assert_eq!(r.status, StatusCode::OK);
        assert_eq!(r.header("ratelimit-policy"), None);
        assert_eq!(r.header("ratelimit"), None);
        assert!(r.decision().admitted(), "the decision is still recorded");
    }
    let r = send(&svc, get("h")).await;
    assert_eq!(r.status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(r.header("retry-after"), Some("1"));
    assert_eq!(r.header("ratelimit-policy"), Some(policy));
    assert_eq!(
        r.header("ratelimit"),
        Some(r#""burst";r=0;t=1, "minute";r=97;t=60"#)
    );
}

// ---------------------------------------------------------------------------------------------
// 4. The window slides
// ---------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread")]
async fn the_window_slides_through_the_layer() {
    let server = RedisServer::start();
    let layer = RateLimitLayer::builder(server.store())
        .limit(Limit::new("w", 2, Duration::from_secs(1)))
        .key(Header::new(CLIENT))
        .build()
        .unwrap();
    let svc = stack(layer, &Calls::default());
    let t0 = tokio::time::Instant::now();
    let at = |ms: u64| tokio::time::sleep_until(t0 + Duration::from_millis(ms));

    // A at 0 ms, B at 600 ms; C right after B is denied.
    assert_eq!(send(&svc, get("s")).await.status, StatusCode::OK);
    at(600).await;
    assert_eq!(send(&svc, get("s")).await.status, StatusCode::OK);
    let r = send(&svc, get("s")).await;
    assert_eq!(r.status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(r.header("retry-after"), Some("1"));

    // At 1200 ms A has left the window, B has not: exactly one more (a fixed 1 s window would
    // admit two here).
    at(1200).await;
    assert_eq!(send(&svc, get("s")).await.status, StatusCode::OK);
    assert_eq!(
        send(&svc, get("s")).await.status,
        StatusCode::TOO_MANY_REQUESTS
    );

    // At 1750 ms B has left as well: one more, then denied again.
    at(1750).await;
    assert_eq!(send(&svc, get("s")).await.status, StatusCode::OK);
    assert_eq!(
        send(&svc, get("s")).await.status,
        StatusCode::TOO_MANY_REQUESTS
    );
}

// ---------------------------------------------------------------------------------------------
// 5. Hostile keys
// ---------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread")]
async fn hostile_keys_get_their_own_bucket_and_tidy_redis_keys() {
    let server = RedisServer::start();
    let prefix = "hostile";
    let layer = RateLimitLayer::builder(server.store())
        .prefix(prefix)
        .limit(Limit::per_minute("m", 2))
        .key(Header::new(CLIENT))
        .build()
        .unwrap();
    let svc = stack(layer, &Calls::default());

    let non_utf8: Vec<u8> = (0x80..=0xffu8).collect();
    let values: Vec<Vec<u8>> = vec![
        b"{".to_vec(),
        b"}".to_vec(),
        b"*".to_vec(),
        b":".to_vec(),
        b"{}".to_vec(),
        b"a{b}c".to_vec(),
        b"}{".to_vec(),
        b"{user}:*:m:log".to_vec(),
        b"hostile:rl:{x}".to_vec(),
        vec![b'k'; 4096],
        non_utf8.clone(),
        [&b"x"[..], &non_utf8].concat(),
    ];
    // Each value is exhausted in turn; a value sharing a bucket with an earlier one would be
    // denied at once.
    for value in &values {
        for n in 0..2 {
            let r = send(&svc, get(value)).await;
            assert_eq!(
                r.status,
                StatusCode::OK,
                "request {n} of key {:?} should be admitted",
                String::from_utf8_lossy(&value[..value.len().min(20)])
            );
        }
        let r = send(&svc, get(value)).await;
        assert_eq!(r.status, StatusCode::TOO_MANY_REQUESTS);
    }

    let mut conn = server.conn();
    let all: Vec<Vec<u8>> = redis::cmd("KEYS").arg("*").query(&mut conn).unwrap();
    // the records of the calls that charged them, each in its first caller's slot and short-lived
    let (records, keys): (Vec<_>, Vec<_>) = all
        .into_iter()
        .partition(|k| k.windows(9).any(|w| w == b":charged:"));
    assert!(!records.is_empty(), "calls that charged leave records");
    assert_eq!(keys.len(), values.len(), "one key per caller and limit");
    let mut tags = std::collections::HashSet::new();
    for key in &keys {
        let text = std::str::from_utf8(key).expect("keys are ASCII");
        assert!(key.len() < 100, "key too long: {text}");
        assert!(
            text.starts_with(&format!("{prefix}:")),
            "key outside the prefix: {text}"
        );
        assert_eq!(text.matches('{').count(), 1, "one hash tag: {text}");
        assert_eq!(text.matches('}').count(), 1, "one hash tag: {text}");
        let open = text.find('{').unwrap();
        let close = text.find('}').unwrap();
        let tag = &text[open + 1..close];
        assert_eq!(tag.len(), 22, "a 22-character tag: {text}");
        assert!(
            tag.bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_'),
            "a base64url tag: {text}"
        );
        assert!(tags.insert(tag.to_owned()), "each caller its own tag");
        assert!(
            text.bytes().all(|b| b.is_ascii_graphic()),
            "visible ASCII only: {text}"
        );
        let pttl: i64 = redis::cmd("PTTL").arg(key).query(&mut conn).unwrap();
        assert!(pttl > 0, "key {text} has no expiry (PTTL {pttl})");
        // its window, and at most half a window more (docs/operations.md)
        assert!(pttl <= 90_000, "key {text} expires after its window");
    }
    for record in &records {
        let text = std::str::from_utf8(record).expect("keys are ASCII");
        let tag = &text[text.find('{').unwrap() + 1..text.find('}').unwrap()];
        assert!(
            tags.contains(tag),
            "a record outside its callers' slots: {text}"
        );
        let pttl: i64 = redis::cmd("PTTL").arg(record).query(&mut conn).unwrap();
        assert!(pttl > 0 && pttl <= 10_000, "record {text}: PTTL {pttl}");
    }
}

// ---------------------------------------------------------------------------------------------
// 6. gRPC
// ---------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread")]
async fn grpc_calls_over_the_limit_get_resource_exhausted() {
    let server = RedisServer::start();
    let layer = RateLimitLayer::builder(server.store())
        .limit(Limit::per_minute("m", 1))
        .key(Header::new(CLIENT))
        .build()
        .unwrap();
    let calls = Calls::default();
    let svc = stack(layer, &calls);

    for content_type in ["application/grpc", "application/grpc+proto"] {
        let client = format!("g-{content_type}");
        let r = send(&svc, grpc_call(&client, content_type)).await;
        assert_eq!(r.status, StatusCode::OK);
        assert_eq!(r.body, "hello", "the admitted call reaches the service");

        let r = send(&svc, grpc_call(&client, content_type)).await;
        assert_eq!(r.status, StatusCode::OK, "gRPC rejections are HTTP 200");
        assert_eq!(r.header("content-type"), Some("application/grpc"));
        assert_eq!(r.header("grpc-status"), Some("8"));
        let message = r.header("grpc-message").expect("a grpc-message");
        assert!(!message.is_empty());
        assert_eq!(r.header("retry-after"), Some("60"));
        assert_eq!(r.header("ratelimit-policy"), Some(r#""m";q=1;w=60"#));
        assert_eq!(r.header("ratelimit"), Some(r#""m";r=0;t=60"#));
        assert!(r.body.is_empty(), "trailers-only: an empty body");
        assert!(r.empty_body_hint, "the body is at its end from the start");
        assert!(!r.decision().admitted());
    }
    assert_eq!(calls.get(), 2);
}

// ---------------------------------------------------------------------------------------------
// 7. Store down
// ---------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread")]
async fn killed_store_with_default_policy_allows_and_marks() {
    let mut server = RedisServer::start();
    let timeout = Duration::from_millis(300);
    let layer = RateLimitLayer::builder(store(&server, timeout))
        .limit(Limit::per_minute("m", 1))
        .key(Header::new(CLIENT))
        .build()
        .unwrap();
    let calls = Calls::default();
    let svc = stack(layer, &calls);
    assert_eq!(
        send(&svc, get("k")).await.decision().source(),
        DecisionSource::Store
    );

    server.kill();
    for _ in 0..3 {
        let started = Instant::now();
        let r = send(&svc, get("k")).await;
        assert!(
            started.elapsed() < timeout + Duration::from_secs(1),
            "a request waited {:?} with the store down",
            started.elapsed()
        );
        assert_eq!(r.status, StatusCode::OK);
        assert_eq!(r.body, "hello");
        assert!(r.decision().admitted());
        assert_eq!(r.decision().source(), DecisionSource::StoreUnavailable);
        assert!(r.decision().limits().is_empty());
        assert_eq!(
            r.header("x-saw-decision"),
            Some("admitted=true;source=StoreUnavailable")
        );
    }
    // Many at once: none waits past the store timeout either.
    let tasks: Vec<_> = (0..50)
        .map(|i| {
            let svc = svc.clone();
            tokio::spawn(async move {
                let started = Instant::now();
                let reply = send(&svc, get(format!("k{i}"))).await;
                (reply, started.elapsed())
            })
        })
        .collect();
    for task in tasks {
        let (reply, took) = task.await.unwrap();
        assert!(
            took < timeout + Duration::from_secs(1),
            "a request waited {took:?} with the store down"
        );
        assert_eq!(reply.status, StatusCode::OK);
        assert_eq!(reply.decision().source(), DecisionSource::StoreUnavailable);
    }
    assert_eq!(calls.get(), 54);
}

#[tokio::test(flavor = "multi_thread")]
async fn killed_store_with_deny_policy_answers_503() {
    let mut server = RedisServer::start();
    let timeout = Duration::from_millis(300);
    let layer = RateLimitLayer::builder(store(&server, timeout))
        .limit(Limit::per_minute("m", 100))
        .key(Header::new(CLIENT))
        .on_store_error(OnStoreError::Deny)
        .build()
        .unwrap();
    let calls = Calls::default();
    let svc = stack(layer, &calls);
    assert_eq!(send(&svc, get("k")).await.status, StatusCode::OK);

    server.kill();
    let started = Instant::now();
    let r = send(&svc, get("k")).await;
    assert!(started.elapsed() < timeout + Duration::from_secs(1));
    assert_eq!(r.status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(r.header("retry-after"), Some("1"));
    assert!(!r.body.is_empty());
    assert!(!r.decision().admitted());
    assert_eq!(r.decision().source(), DecisionSource::StoreUnavailable);

    // A gRPC call gets UNAVAILABLE, trailers-only.
    let r = send(&svc, grpc_call("k", "application/grpc")).await;
    assert_eq!(r.status, StatusCode::OK);
    assert_eq!(r.header("grpc-status"), Some("14"));
    assert_eq!(r.header("retry-after"), Some("1"));
    assert!(r.body.is_empty());

    assert_eq!(
        calls.get(),
        1,
        "nothing reached the service while the store was down"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn killed_store_with_local_fallback_admits_the_copy_share() {
    let mut server = RedisServer::start();
    let layer = RateLimitLayer::builder(store(&server, Duration::from_millis(300)))
        .limit(Limit::per_minute("m", 10))
        .key(Header::new(CLIENT))
        .on_store_error(OnStoreError::LocalFallback { copies: 2 })
        .build()
        .unwrap();
    let calls = Calls::default();
    let svc = stack(layer, &calls);
    server.kill();

    let tasks: Vec<_> = (0..12)
        .map(|_| {
            let svc = svc.clone();
            tokio::spawn(async move { send(&svc, get("f")).await })
        })
        .collect();
    let mut replies = Vec::new();
    for task in tasks {
        replies.push(task.await.unwrap());
    }
    for r in &replies {
        assert_eq!(r.decision().source(), DecisionSource::LocalFallback);
    }
    let ok = replies
        .iter()
        .filter(|r| r.status == StatusCode::OK)
        .count();
    let denied: Vec<_> = replies
        .iter()
        .filter(|r| r.status == StatusCode::TOO_MANY_REQUESTS)
        .collect();
    assert_eq!(ok, 5, "10 per minute shared by 2 copies: 5 for this one");
    assert_eq!(denied.len(), 7);
    for r in denied {
        assert!(r.retry_after_secs() >= 1);
    }
    assert_eq!(calls.get(), 5);

    // Another caller has its own fallback bucket.
    assert_eq!(send(&svc, get("g")).await.status, StatusCode::OK);
}

#[tokio::test(flavor = "multi_thread")]
async fn frozen_store_never_hangs_a_request() {
    let server = RedisServer::start();
    let timeout = Duration::from_millis(500);
    let allow = stack(
        RateLimitLayer::builder(store(&server, timeout))
            .limit(Limit::per_minute("m", 100))
            .key(Header::new(CLIENT))
            .build()
            .unwrap(),
        &Calls::default(),
    );
    let deny = stack(
        RateLimitLayer::builder(store(&server, timeout))
            .prefix("deny")
            .limit(Limit::per_minute("m", 100))
            .key(Header::new(CLIENT))
            .on_store_error(OnStoreError::Deny)
            .build()
            .unwrap(),
        &Calls::default(),
    );
    // Connect both before the freeze.
    assert_eq!(send(&allow, get("p")).await.status, StatusCode::OK);
    assert_eq!(send(&deny, get("p")).await.status, StatusCode::OK);

    server.pause();
    let started = Instant::now();
    let tasks: Vec<_> = (0..6)
        .map(|i| {
            let svc = if i % 2 == 0 {
                allow.clone()
            } else {
                deny.clone()
            };
            tokio::spawn(async move {
                let started = Instant::now();
                let reply = send(&svc, get("p")).await;
                (i, reply, started.elapsed())
            })
        })
        .collect();
    let mut results = Vec::new();
    for task in tasks {
        results.push(task.await.unwrap());
    }
    server.resume();
    assert!(started.elapsed() < timeout + Duration::from_secs(1));
    for (i, reply, took) in results {
        assert!(
            took < timeout + Duration::from_secs(1),
            "a request waited {took:?} on a frozen store"
        );
        assert_eq!(reply.decision().source(), DecisionSource::StoreUnavailable);
        if i % 2 == 0 {
            assert_eq!(reply.status, StatusCode::OK);
        } else {
            assert_eq!(reply.status, StatusCode::SERVICE_UNAVAILABLE);
        }
    }

    // Thawed: the store decides again.
    until_store_admits(&allow, "p", Duration::from_secs(5)).await;
    until_store_admits(&deny, "p", Duration::from_secs(5)).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn restarted_store_is_used_again_without_rebuilding() {
    let mut server = RedisServer::start();
    let layer = RateLimitLayer::builder(store(&server, Duration::from_millis(300)))
        .limit(Limit::per_minute("m", 3))
        .key(Header::new(CLIENT))
        .build()
        .unwrap();
    let svc = stack(layer, &Calls::default());
    assert_eq!(
        send(&svc, get("r")).await.decision().source(),
        DecisionSource::Store
    );

    server.kill();
    let r = send(&svc, get("r")).await;
    assert_eq!(r.status, StatusCode::OK);
    assert_eq!(r.decision().source(), DecisionSource::StoreUnavailable);

    server.restart();
    until_store_admits(&svc, "probe", Duration::from_secs(5)).await;
    // The restarted (empty) server enforces the limit again, exactly.
    for _ in 0..3 {
        let r = send(&svc, get("fresh")).await;
        assert_eq!(r.status, StatusCode::OK);
        assert_eq!(r.decision().source(), DecisionSource::Store);
    }
    let r = send(&svc, get("fresh")).await;
    assert_eq!(r.status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(r.decision().source(), DecisionSource::Store);
}

// ---------------------------------------------------------------------------------------------
// 8. Missing key
// ---------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread")]
async fn missing_key_is_rejected_or_allowed_as_configured() {
    let server = RedisServer::start();
    let calls = Calls::default();
    let reject = stack(
        RateLimitLayer::builder(server.store())
            .limit(Limit::per_minute("m", 1))
            .key(Header::new(CLIENT))
            .build()
            .unwrap(),
        &calls,
    );
    let bare = || Request::get("/").body(String::new()).unwrap();

    let r = send(&reject, bare()).await;
    assert_eq!(r.status, StatusCode::BAD_REQUEST);
    assert!(!r.body.is_empty() && r.body.len() < 200, "a short body");
    assert!(r.decision.is_none());
    assert_eq!(r.header("ratelimit"), None);
    // An empty header value is no key either.
    let r = send(&reject, get("")).await;
    assert_eq!(r.status, StatusCode::BAD_REQUEST);
    // A gRPC call without a key gets INVALID_ARGUMENT, trailers-only.
    let mut grpc = bare();
    grpc.headers_mut().insert(
        http::header::CONTENT_TYPE,
        HeaderValue::from_static("application/grpc"),
    );
    let r = send(&reject, grpc).await;
    assert_eq!(r.status, StatusCode::OK);
    assert_eq!(r.header("grpc-status"), Some("3"));
    assert!(r.body.is_empty());
    assert_eq!(calls.get(), 0);

    let calls = Calls::default();
    let allow = stack(
        RateLimitLayer::builder(server.store())
            .prefix("allow")
            .limit(Limit::per_minute("m", 1))
            .key(Header::new(CLIENT))
            .on_missing_key(MissingKey::Allow)
            .build()
            .unwrap(),
        &calls,
    );
    for _ in 0..3 {
        let r = send(&allow, bare()).await;
        assert_eq!(r.status, StatusCode::OK);
        assert_eq!(r.body, "hello");
    }
    // Keyed requests are still limited.
    assert_eq!(send(&allow, get("x")).await.status, StatusCode::OK);
    assert_eq!(
        send(&allow, get("x")).await.status,
        StatusCode::TOO_MANY_REQUESTS
    );
    assert_eq!(calls.get(), 4);
}

// ---------------------------------------------------------------------------------------------
// 9. Decision extensions
// ---------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread")]
async fn decisions_are_in_the_extensions() {
    let server = RedisServer::start();
    let svc = stack(
        RateLimitLayer::builder(server.store())
            .limit(Limit::per_second("s", 2))
            .limit(Limit::per_minute("m", 10))
            .key(Header::new(CLIENT))
            .build()
            .unwrap(),
        &Calls::default(),
    );
    let (parts, _) = get("d").into_parts();
    let expected_key = Header::new(CLIENT).extract(&parts).unwrap();

    let r = send(&svc, get("d")).await;
    assert_eq!(r.status, StatusCode::OK);
    assert_eq!(
        r.header("x-saw-decision"),
        Some("admitted=true;source=Store"),
        "the inner service sees the decision in the request extensions"
    );
    let d = r.decision();
    assert!(d.admitted());
    assert_eq!(d.source(), DecisionSource::Store);
    assert_eq!(d.key(), expected_key);
    assert_eq!(d.cost(), 1);
    assert_eq!(d.retry_after(), Duration::ZERO);
    let names: Vec<&str> = d.limits().iter().map(|(n, _)| *n).collect();
    assert_eq!(names, ["s", "m"]);
    assert_eq!(d.limits()[0].1.remaining, 1);
    assert_eq!(d.limits()[1].1.remaining, 9);
    assert!(d.limits()[0].1.reset <= Duration::from_secs(1));
    assert!(d.limits()[1].1.reset <= Duration::from_secs(60));
    assert!(d.limits()[1].1.reset > Duration::from_secs(59));

    assert_eq!(send(&svc, get("d")).await.status, StatusCode::OK);
    let r = send(&svc, get("d")).await;
    assert_eq!(r.status, StatusCode::TOO_MANY_REQUESTS);
    let d = r.decision();
    assert!(!d.admitted());
    assert_eq!(d.source(), DecisionSource::Store);
    assert_eq!(d.key(), expected_key);
    assert!(d.retry_after() > Duration::ZERO && d.retry_after() <= Duration::from_secs(1));
    assert_eq!(d.limits().len(), 2);
    assert_eq!(d.limits()[0].1.remaining, 0);
    assert_eq!(d.limits()[1].1.remaining, 8, "a denial charges nothing");
}

// ---------------------------------------------------------------------------------------------
// Local deny cache
// ---------------------------------------------------------------------------------------------

fn reset_stats(server: &RedisServer) {
    let _: () = redis::cmd("CONFIG")
        .arg("RESETSTAT")
        .query(&mut server.conn())
        .unwrap();
}

#[tokio::test(flavor = "multi_thread")]
async fn deny_cache_answers_repeat_denials_without_the_store() {
    let server = RedisServer::start();
    let build = |prefix: &str, cache: bool| {
        RateLimitLayer::builder(server.store())
            .prefix(prefix)
            .limit(Limit::new("w", 3, Duration::from_secs(1)))
            .key(Header::new(CLIENT))
            .cost(cost_header)
            .deny_cache(cache)
            .build()
            .unwrap()
    };
    let svc = stack(build("cached", true), &Calls::default());

    assert_eq!(send(&svc, get_costing("c", 2)).await.status, StatusCode::OK);
    let r = send(&svc, get_costing("c", 2)).await;
    assert_eq!(r.status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(r.decision().source(), DecisionSource::Store);

    // The same or a larger cost: denied in process, with the full 429.
    reset_stats(&server);
    for cost in [2, 3, 2, 5] {
        let r = send(&svc, get_costing("c", cost)).await;
        assert_eq!(r.status, StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(r.decision().source(), DecisionSource::DenyCache);
        assert_eq!(r.decision().cost(), cost);
        assert_eq!(r.header("retry-after"), Some("1"));
        assert_eq!(
            r.header("ratelimit-policy"),
            Some(r#""w";q=3;qu="requests";w=1"#)
        );
        assert_eq!(r.header("ratelimit"), Some(r#""w";r=1;t=1"#));
    }
    assert_eq!(server.lua_calls(), 0, "no round trip for cached denials");

    // A smaller cost may still fit: it goes to the store, and is admitted.
    let r = send(&svc, get_costing("c", 1)).await;
    assert_eq!(r.status, StatusCode::OK);
    assert_eq!(r.decision().source(), DecisionSource::Store);
    assert_eq!(server.lua_calls(), 1);
    // Other callers are not affected by c's cached denial.
    let r = send(&svc, get_costing("other", 3)).await;
    assert_eq!(r.status, StatusCode::OK);

    // Once the window has moved on, the store decides again and admits.
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let r = send(&svc, get_costing("c", 2)).await;
    assert_eq!(r.status, StatusCode::OK);
    assert_eq!(r.decision().source(), DecisionSource::Store);

    // deny_cache(false): every denial is a round trip.
    let svc = stack(build("uncached", false), &Calls::default());
    assert_eq!(send(&svc, get_costing("c", 3)).await.status, StatusCode::OK);
    reset_stats(&server);
    for _ in 0..4 {
        let r = send(&svc, get_costing("c", 1)).await;
        assert_eq!(r.status, StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(r.decision().source(), DecisionSource::Store);
    }
    assert_eq!(server.lua_calls(), 4);
}

/// An IPv6 client holds a whole /64: 30 requests from 30 of its addresses, relayed by a trusted
/// proxy, count as one caller and admit exactly the limit.
#[tokio::test(flavor = "multi_thread")]
async fn thirty_addresses_of_one_ipv6_64_share_one_bucket() {
    let server = RedisServer::start();
    let layer = RateLimitLayer::builder(store(&server, Duration::from_millis(500)))
        .prefix(format!("v6{}", rand::random::<u32>()))
        .limit(Limit::per_minute("m", 5))
        .key(tollgate::key::ForwardedIp::trusting(["10.0.0.0/8"]).unwrap())
        .build()
        .unwrap();
    let calls = Calls::default();
    let svc = stack(layer, &calls);
    let mut admitted = 0;
    for i in 0..30u16 {
        let client = format!("2001:db8:7:42:{i:x}:{:x}::1", i * 7 + 1);
        let mut req = Request::get("/")
            .header("x-forwarded-for", format!("{client}, 10.0.0.9"))
            .body(String::new())
            .unwrap();
        req.extensions_mut()
            .insert("10.0.0.1:4000".parse::<std::net::SocketAddr>().unwrap());
        if send(&svc, req).await.status == StatusCode::OK {
            admitted += 1;
        }
    }
    assert_eq!(
        admitted, 5,
        "a rotating IPv6 client got more than one bucket"
    );
    assert_eq!(calls.get(), 5);
}

#[tokio::test(flavor = "multi_thread")]
async fn shadow_mode_decides_and_counts_but_never_rejects() {
    let server = RedisServer::start();
    let layer = RateLimitLayer::builder(store(&server, Duration::from_secs(1)))
        .limit(Limit::per_hour("hourly", 2))
        .algorithm(Algorithm::Gcra)
        .key(Header::new(CLIENT))
        .shadow(true)
        .build()
        .unwrap();
    let calls = Calls::default();
    let svc = stack(layer, &calls);
    let mut admitted = 0;
    for i in 0..5 {
        let reply = send(&svc, get("alice")).await;
        assert_eq!(reply.status, StatusCode::OK, "request {i} goes through");
        let decision = reply.decision();
        assert!(decision.shadow());
        admitted += u32::from(decision.admitted());
        let remaining = if i < 2 { 1 - i } else { 0 };
        assert_eq!(
            reply
                .header("ratelimit")
                .map(|v| v.split(";t=").next().unwrap_or("").to_owned()),
            Some(format!("\"hourly\";r={remaining}")),
            "request {i}"
        );
        assert_eq!(reply.header("retry-after"), None);
        assert_eq!(
            reply.headers.get(SAW).unwrap(),
            &format!("admitted={};source=Store", i < 2)
        );
    }
    assert_eq!(admitted, 2, "exactly the quota is counted as admitted");
    assert_eq!(calls.get(), 5);
    // no key: through as well
    let keyless = Request::get("/").body(String::new()).unwrap();
    assert_eq!(send(&svc, keyless).await.status, StatusCode::OK);
    assert_eq!(calls.get(), 6);
}

#[tokio::test(flavor = "multi_thread")]
async fn peek_spends_nothing_and_reset_admits_again_across_copies() {
    let server = RedisServer::start();
    let by_client = Header::new(CLIENT);
    let copy = || {
        RateLimitLayer::builder(store(&server, Duration::from_secs(1)))
            .limit(Limit::per_hour("hourly", 3))
            .algorithm(Algorithm::SlidingLog)
            .key(by_client.clone())
            .build()
            .unwrap()
    };
    let (first, second) = (copy(), copy());
    let calls = Calls::default();
    let (svc_a, svc_b) = (stack(first.clone(), &calls), stack(second.clone(), &calls));
    let alice = by_client.key(b"alice");
    let (parts, ()) = get("alice").map(drop).into_parts();
    assert_eq!(first.key_of(&parts), Some(alice));

    assert_eq!(first.peek(alice).await.unwrap().limits[0].remaining, 3);
    for svc in [&svc_a, &svc_b, &svc_a] {
        assert_eq!(send(svc, get("alice")).await.status, StatusCode::OK);
    }
    // denied by the store, then by copy A's deny cache
    for _ in 0..2 {
        assert_eq!(
            send(&svc_a, get("alice")).await.status,
            StatusCode::TOO_MANY_REQUESTS
        );
    }
    let look = second.peek(alice).await.unwrap();
    assert_eq!(look.limits[0].remaining, 0);
    assert_eq!(
        second.peek(alice).await.unwrap().limits[0].remaining,
        0,
        "a look is free"
    );

    first.reset(alice).await.unwrap();
    assert_eq!(
        second.peek(alice).await.unwrap().limits[0].remaining,
        3,
        "every copy sees it"
    );
    let reply = send(&svc_a, get("alice")).await;
    assert_eq!(
        reply.status,
        StatusCode::OK,
        "copy A's cached denial is forgotten"
    );
    assert_eq!(reply.decision().source(), DecisionSource::Store);
    assert_eq!(send(&svc_b, get("bob")).await.status, StatusCode::OK);
    assert_eq!(first.peek(alice).await.unwrap().limits[0].remaining, 2);
}

#[tokio::test(flavor = "multi_thread")]
async fn partition_keys_and_quota_units_are_said_as_the_draft_has_them() {
    let server = RedisServer::start();
    let build = |unit: Option<QuotaUnit>| {
        let builder = RateLimitLayer::builder(store(&server, Duration::from_secs(1)))
            .limit(Limit::per_hour("hourly", 100))
            .key(Header::new(CLIENT))
            .cost(cost_header)
            .partition_key(true);
        match unit {
            Some(unit) => builder.quota_unit(unit),
            None => builder,
        }
        .build()
        .unwrap()
    };
    let calls = Calls::default();
    let by_requests = stack(build(None), &calls);
    let alice = send(&by_requests, get_costing("alice", 2)).await;
    assert_eq!(
        alice.header("ratelimit-policy"),
        Some(r#""hourly";q=100;qu="requests";w=3600"#)
    );
    let field = alice.header("ratelimit").unwrap().to_owned();
    let pk = field
        .split(";pk=:")
        .nth(1)
        .and_then(|rest| rest.strip_suffix(':'))
        .expect("a pk parameter");
    assert_eq!(field, format!(r#""hourly";r=98;t=3600;pk=:{pk}:"#));
    assert_eq!(pk.len(), 12);
    assert!(!pk.contains("alice"));
    let again = send(&by_requests, get("alice")).await;
    assert!(
        again
            .header("ratelimit")
            .unwrap()
            .ends_with(&format!(";pk=:{pk}:"))
    );
    let bob = send(&by_requests, get("bob")).await;
    assert!(
        !bob.header("ratelimit").unwrap().contains(pk),
        "another caller, another pk"
    );

    let by_bytes = stack(build(Some(QuotaUnit::ContentBytes)), &calls);
    assert_eq!(
        send(&by_bytes, get("carol"))
            .await
            .header("ratelimit-policy"),
        Some(r#""hourly";q=100;qu="content-bytes";w=3600"#)
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_custom_rejection_keeps_the_headers_and_grpc_its_status() {
    let server = RedisServer::start();
    let layer = RateLimitLayer::builder(store(&server, Duration::from_secs(1)))
        .limit(Limit::per_hour("hourly", 1))
        .key(Header::new(CLIENT))
        .rejection(|decision| {
            Response::builder()
                .status(StatusCode::TOO_MANY_REQUESTS)
                .header("content-type", "application/json")
                .body(Bytes::from(format!(
                    r#"{{"error":"slow down","cost":{}}}"#,
                    decision.cost()
                )))
                .unwrap()
        })
        .grpc_metadata(|decision, metadata| {
            let cost = HeaderValue::from(decision.cost());
            metadata.insert("x-denied-cost", cost);
            metadata.insert("grpc-message", HeaderValue::from_static("over%20quota"));
        })
        .build()
        .unwrap();
    let calls = Calls::default();
    let svc = stack(layer, &calls);
    assert_eq!(send(&svc, get("dora")).await.status, StatusCode::OK);
    let denied = send(&svc, get("dora")).await;
    assert_eq!(denied.status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(denied.header("content-type"), Some("application/json"));
    assert_eq!(denied.body, r#"{"error":"slow down","cost":1}"#);
    assert!(denied.header("retry-after").is_some());
    assert_eq!(
        denied.header("ratelimit-policy"),
        Some(r#""hourly";q=1;w=3600"#)
    );
    assert!(!denied.decision().admitted());
    assert_eq!(denied.header("x-denied-cost"), None, "gRPC metadata only");
    let grpc = send(&svc, grpc_call("dora", "application/grpc")).await;
    assert_eq!(grpc.header("grpc-status"), Some("8"));
    assert_eq!(grpc.header("x-denied-cost"), Some("1"));
    assert_eq!(grpc.header("grpc-message"), Some("over%20quota"));
    assert!(grpc.header("retry-after").is_some());
    assert!(grpc.body.is_empty());
    assert_eq!(calls.get(), 1);
}

/// The `x-plan` header names the tier.
fn plan(parts: &Parts) -> Option<&str> {
    parts.headers.get("x-plan").and_then(|v| v.to_str().ok())
}

/// `GET /` from `client` on `plan` (none: no `x-plan`).
fn get_on(client: &str, plan: Option<&str>) -> Request<String> {
    let mut req = get(client);
    if let Some(plan) = plan {
        req.headers_mut()
            .insert("x-plan", HeaderValue::from_str(plan).unwrap());
    }
    req
}

/// Tiers on two separately built copies: each tier admits exactly its own quota of 24 parallel
/// requests, for every algorithm; a request with no plan or an unknown plan gets the layer's own
/// limits (one bucket for both); each decision names its tier.
#[tokio::test(flavor = "multi_thread")]
async fn each_tier_admits_exactly_its_quota_across_copies() {
    let server = RedisServer::start();
    for algorithm in [
        Algorithm::SlidingLog,
        Algorithm::SlidingCounter,
        Algorithm::Gcra,
    ] {
        let prefix = format!("tiers-{algorithm:?}");
        let copy = || {
            RateLimitLayer::builder(store(&server, Duration::from_secs(2)))
                .prefix(prefix.clone())
                .algorithm(algorithm)
                .limit(Limit::per_hour("hourly", 2))
                .tier("free", [Limit::per_hour("hourly", 5)])
                .tier(
                    "paid",
                    [
                        Limit::per_hour("hourly", 11),
                        Limit::new("daily", 100, Duration::from_secs(86_400)),
                    ],
                )
                .tier_by(plan)
                .key(Header::new(CLIENT))
                .build()
                .unwrap()
        };
        let calls = Calls::default();
        let copies = [stack(copy(), &calls), stack(copy(), &calls)];
        for (tier, quota) in [(Some("free"), 5), (Some("paid"), 11), (None, 2)] {
            let sent = (0..24).map(|i| {
                let svc = copies[i % 2].clone();
                // no plan and an unknown plan share the layer's own bucket
                let on = tier.or((i % 3 == 0).then_some("gold"));
                async move { send(&svc, get_on("alice", on)).await }
            });
            let replies = futures_util::future::join_all(sent).await;
            let admitted = replies
                .iter()
                .filter(|r| r.status == StatusCode::OK)
                .count();
            assert_eq!(admitted, quota, "{algorithm:?} tier {tier:?}");
            for reply in &replies {
                assert_eq!(reply.decision().tier(), tier, "{algorithm:?}");
            }
            let denied = replies
                .iter()
                .find(|r| r.status == StatusCode::TOO_MANY_REQUESTS)
                .expect("a denial");
            let expected_policy = match tier {
                Some("free") => r#""hourly";q=5;w=3600"#,
                Some(_) => r#""hourly";q=11;w=3600, "daily";q=100;w=86400"#,
                None => r#""hourly";q=2;w=3600"#,
            };
            assert_eq!(denied.header("ratelimit-policy"), Some(expected_policy));
        }
        assert_eq!(calls.get(), 5 + 11 + 2, "{algorithm:?}");
    }
}

/// A caller denied in one tier (by the store, then by the deny cache) is admitted at once in
/// another, which keeps its own count; `peek_tier` looks at one tier, `reset` forgets them all.
#[tokio::test(flavor = "multi_thread")]
async fn a_tier_change_starts_afresh_and_reset_forgets_every_tier() {
    let server = RedisServer::start();
    let by_client = Header::new(CLIENT);
    let layer = RateLimitLayer::builder(server.store())
        .limit(Limit::per_hour("hourly", 1))
        .tier("free", [Limit::per_hour("hourly", 2)])
        .tier("paid", [Limit::per_hour("hourly", 4)])
        .tier_by(plan)
        .key(by_client.clone())
        .build()
        .unwrap();
    assert_eq!(layer.tier_policy("paid").limits()[0].quota(), 4);
    assert_eq!(layer.tier_policy("gold").limits()[0].quota(), 1);
    let svc = stack(layer.clone(), &Calls::default());
    let alice = by_client.key(b"alice");

    for _ in 0..2 {
        assert_eq!(
            send(&svc, get_on("alice", Some("free"))).await.status,
            StatusCode::OK
        );
    }
    let mut seen = Vec::new();
    for _ in 0..2 {
        let reply = send(&svc, get_on("alice", Some("free"))).await;
        assert_eq!(reply.status, StatusCode::TOO_MANY_REQUESTS);
        seen.push(reply.decision().source());
    }
    assert_eq!(seen, [DecisionSource::Store, DecisionSource::DenyCache]);

    let upgraded = send(&svc, get_on("alice", Some("paid"))).await;
    assert_eq!(
        upgraded.status,
        StatusCode::OK,
        "free's cached denial is not paid's"
    );
    assert_eq!(upgraded.decision().source(), DecisionSource::Store);
    assert_eq!(upgraded.header("ratelimit"), Some(r#""hourly";r=3;t=3600"#));
    assert_eq!(
        send(&svc, get_on("alice", None)).await.status,
        StatusCode::OK
    );

    let remaining = |outcome: tollgate::rate::RateOutcome| outcome.limits[0].remaining;
    assert_eq!(remaining(layer.peek_tier("free", alice).await.unwrap()), 0);
    assert_eq!(remaining(layer.peek_tier("paid", alice).await.unwrap()), 3);
    assert_eq!(remaining(layer.peek(alice).await.unwrap()), 0);
    assert_eq!(remaining(layer.peek_tier("gold", alice).await.unwrap()), 0);

    layer.reset(alice).await.unwrap();
    assert_eq!(remaining(layer.peek_tier("free", alice).await.unwrap()), 2);
    assert_eq!(remaining(layer.peek_tier("paid", alice).await.unwrap()), 4);
    assert_eq!(remaining(layer.peek(alice).await.unwrap()), 1);
    let again = send(&svc, get_on("alice", Some("free"))).await;
    assert_eq!(again.status, StatusCode::OK);
    assert_eq!(again.decision().source(), DecisionSource::Store);
}

/// Tiers are checked when the layer is built.
#[test]
fn tier_configurations_are_validated() {
    let builder = || {
        RateLimitLayer::builder(tollgate::store::MemoryStore::new()).limit(Limit::per_hour("h", 1))
    };
    let error = |b: tollgate::rate_limit::RateLimitLayerBuilder| b.build().unwrap_err().to_string();
    assert!(error(builder().tier("free", [Limit::per_hour("h", 2)])).contains("tier_by"));
    assert!(error(builder().tier_by(plan)).contains("named tiers"));
    let twice = builder()
        .tier("free", [Limit::per_hour("h", 2)])
        .tier("free", [Limit::per_hour("h", 3)])
        .tier_by(plan);
    assert!(error(twice).contains("used twice"));
    let spaced = builder()
        .tier("free plan", [Limit::per_hour("h", 2)])
        .tier_by(plan);
    assert!(error(spaced).contains("invalid tier name"));
    let empty = builder().tier("free", []).tier_by(plan);
    assert!(error(empty).contains("at least one limit"));
    assert!(
        builder()
            .tier("free", [Limit::per_hour("h", 2)])
            .tier_by(plan)
            .build()
            .is_ok()
    );
}

/// A reset through copy B frees the caller on copy A, whose deny cache held A's denial for an
/// hourly limit: within the cache's longest hold (a second), A asks the store again and admits.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reset_through_one_copy_frees_the_caller_on_the_other_within_a_second() {
    let server = RedisServer::start();
    let layer = |server: &RedisServer| {
        RateLimitLayer::builder(store(server, Duration::from_secs(2)))
            .limit(Limit::per_hour("hourly", 2))
            .key(Header::new(CLIENT))
            .build()
            .unwrap()
    };
    let (a, b) = (layer(&server), layer(&server));
    let calls = Calls::default();
    let copy_a = stack(a, &calls);
    for _ in 0..2 {
        assert_eq!(send(&copy_a, get("ann")).await.status, StatusCode::OK);
    }
    let denied = send(&copy_a, get("ann")).await;
    assert_eq!(denied.status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(denied.decision().source(), DecisionSource::Store);
    let cached = send(&copy_a, get("ann")).await;
    assert_eq!(cached.decision().source(), DecisionSource::DenyCache);
    assert!(cached.retry_after_secs() > 3_000, "an hourly limit's wait");

    b.reset(Header::new(CLIENT).key(b"ann")).await.unwrap();
    let reset_at = Instant::now();
    let admitted = loop {
        let reply = send(&copy_a, get("ann")).await;
        if reply.status == StatusCode::OK {
            break reset_at.elapsed();
        }
        assert!(
            reset_at.elapsed() < Duration::from_secs(10),
            "copy A still denies from its cache 10 s after the reset"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert!(
        admitted <= Duration::from_millis(1_200),
        "admitted {admitted:?} after the reset"
    );
}

/// Per-request limits from the application's data (`limits_by`) on two copies: a tenant with a
/// plan gets exactly its plan's quota across both, the rest the layer's own; a raised plan keeps
/// what the tenant spent; a reset clears the plan's limits too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn per_request_limits_from_a_plan_table_hold_across_copies() {
    use std::collections::HashMap;
    use std::sync::RwLock;

    let server = RedisServer::start();
    let plans: Arc<RwLock<HashMap<String, u64>>> = Arc::default();
    plans.write().unwrap().insert("acme".into(), 3);
    let layer = |server: &RedisServer| {
        let table = Arc::clone(&plans);
        RateLimitLayer::builder(store(server, Duration::from_secs(2)))
            .limit(Limit::per_hour("hourly", 1))
            .key(Header::new(CLIENT))
            .deny_cache(false)
            .limits_by(move |parts| {
                let tenant = parts.headers.get(CLIENT)?.to_str().ok()?;
                let quota = *table.read().unwrap().get(tenant)?;
                Some(vec![Limit::per_hour("hourly", quota)])
            })
            .build()
            .unwrap()
    };
    let (a, b) = (layer(&server), layer(&server));
    let calls = Calls::default();
    let copies = [stack(a, &calls), stack(b.clone(), &calls)];
    let admitted = |tenant: &'static str, n: usize| {
        let copies = copies.clone();
        async move {
            let mut admitted = 0;
            for i in 0..n {
                if send(&copies[i % 2], get(tenant)).await.status == StatusCode::OK {
                    admitted += 1;
                }
            }
            admitted
        }
    };
    assert_eq!(admitted("acme", 10).await, 3, "the plan's quota");
    assert_eq!(admitted("other", 10).await, 1, "the layer's own");
    plans.write().unwrap().insert("acme".into(), 5);
    assert_eq!(
        admitted("acme", 10).await,
        2,
        "the raised plan, less what was spent"
    );
    let policy = send(&copies[0], get("acme")).await;
    assert_eq!(
        policy.header("ratelimit-policy"),
        Some(r#""hourly";q=5;w=3600"#)
    );
    b.reset(Header::new(CLIENT).key(b"acme")).await.unwrap();
    assert_eq!(admitted("acme", 10).await, 5, "reset");
}

// ---------------------------------------------------------------------------------------------
// Penalties
// ---------------------------------------------------------------------------------------------

/// A caller denied on copy A is blocked on copy B too, for the block's whole duration and no
/// longer, though the limit itself has room again after its one-second window: the 429s carry
/// the block's time left in `Retry-After` and the limit's `RateLimit` reset.
#[tokio::test(flavor = "multi_thread")]
async fn a_block_on_one_copy_holds_on_every_copy_then_ends() {
    let server = RedisServer::start();
    let limit = Limit::new("burst", 2, Duration::from_secs(1)).block_for(Duration::from_secs(3));
    let copy = |server: &RedisServer| {
        let layer = RateLimitLayer::builder(store(server, Duration::from_secs(1)))
            .limit(limit.clone())
            .key(Header::new(CLIENT))
            .build()
            .unwrap();
        stack(layer, &Calls::default())
    };
    let (a, b) = (copy(&server), copy(&server));
    assert_eq!(send(&a, get("p")).await.status, StatusCode::OK);
    assert_eq!(send(&b, get("p")).await.status, StatusCode::OK);
    let denied = send(&a, get("p")).await;
    let blocked_at = Instant::now();
    assert_eq!(denied.status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(denied.header("retry-after"), Some("3"));
    assert_eq!(denied.header("ratelimit"), Some("\"burst\";r=0;t=3"));
    assert_eq!(denied.decision().retry_after(), Duration::from_secs(3));

    let on_b = send(&b, get("p")).await;
    assert_eq!(
        on_b.status,
        StatusCode::TOO_MANY_REQUESTS,
        "blocked on copy B"
    );
    let secs = on_b.retry_after_secs();
    assert!((1..=3).contains(&secs), "{secs}");
    assert_eq!(
        on_b.header("ratelimit"),
        Some(&*format!("\"burst\";r=0;t={secs}"))
    );
    assert_eq!(
        secs,
        on_b.decision()
            .retry_after()
            .as_micros()
            .div_ceil(1_000_000) as u64
    );

    // the window has passed, the block has not
    tokio::time::sleep_until((blocked_at + Duration::from_millis(1_500)).into()).await;
    for copy in [&a, &b] {
        let r = send(copy, get("p")).await;
        assert_eq!(r.status, StatusCode::TOO_MANY_REQUESTS);
        assert!(r.retry_after_secs() <= 2, "{:?}", r.header("retry-after"));
        assert!(r.decision().retry_after() <= Duration::from_millis(1_500));
    }
    assert_eq!(send(&a, get("q")).await.status, StatusCode::OK, "others");

    tokio::time::sleep_until((blocked_at + Duration::from_millis(3_100)).into()).await;
    assert_eq!(send(&b, get("p")).await.status, StatusCode::OK, "copy B");
    assert_eq!(send(&a, get("p")).await.status, StatusCode::OK, "copy A");
}
