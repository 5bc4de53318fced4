//! Integration tests of the idempotency layer ([`IdempotencyLayer`]) against real `redis-server`
//! processes: one test (or more) per row of the table in the `tollgate::idempotency` docs —
//! pass-through, missing and malformed keys, body limits, exactly-once execution across two
//! separately built copies, waiting duplicates, fingerprints, failures that release the key,
//! byte-for-byte replays with trailers (gRPC included), streaming, client disconnects, leases and
//! takeover, a killed, restarted and frozen store, scopes, retention and the keys written, and
//! axum.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use crate::common;

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use futures_util::stream;
use http::request::Parts;
use http::{HeaderMap, HeaderName, HeaderValue, Method, Request, Response, StatusCode, header};
use http_body::Frame;
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, Either, Full, StreamBody};
use tokio::sync::{Barrier, mpsc};
use tower::util::BoxCloneService;
use tower::{Layer, ServiceExt};

use common::RedisServer;
use tollgate::idempotency::{IdempotencyBody, IdempotencyLayer, OnConcurrent, RequestBody};
use tollgate::key::{Header, KeyExtractor};
use tollgate::store::{BeginRequest, CompleteRequest};
use tollgate::store::{
    Hold, IdempotencyBegin, IdempotencyStore, MemoryStore, RedisStore, Store, StoreFuture,
};

/// A failure of an inner service or of its response body. (A concrete type: `BoxError` in
/// these positions trips rustc's higher-ranked `Send` checks of async blocks.)
#[derive(Debug)]
struct Failure(String);

impl std::fmt::Display for Failure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Failure {}

/// Request body of the tower-level tests.
type ReqBody = UnsyncBoxBody<Bytes, Infallible>;
/// Response body of the inner services.
type Body = UnsyncBoxBody<Bytes, Failure>;
/// What the inner service receives.
type Inner = Request<RequestBody<ReqBody>>;
/// What the layered service answers.
type Reply = Response<IdempotencyBody<Body>>;
/// A layered service.
type Svc = BoxCloneService<Request<ReqBody>, Reply, Failure>;
/// The future of an inner service.
type HandlerFuture = Pin<Box<dyn Future<Output = Result<Response<Body>, Failure>> + Send>>;

const REPLAYED: &str = "idempotent-replayed";

/// Counts the executions of an inner service.
#[derive(Clone, Default)]
struct Calls(Arc<AtomicUsize>);

impl Calls {
    /// Counts one run; its number, from 1.
    fn hit(&self) -> usize {
        self.0.fetch_add(1, Ordering::SeqCst) + 1
    }

    fn get(&self) -> usize {
        self.0.load(Ordering::SeqCst)
    }

    /// Returns once the handler has been entered `runs` times (its request claimed the key).
    async fn reached(&self, runs: usize) {
        common::wait_for(&format!("the handler entered {runs} times"), || {
            self.get() >= runs
        })
        .await;
    }
}

/// Sends `request()` until it is answered other than `409` (the key's run is over), for at
/// most 5 s.
async fn once_settled(svc: &Svc, request: impl Fn() -> Request<ReqBody>) -> Answer {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let answer = send(svc, request()).await;
        if answer.status != StatusCode::CONFLICT || Instant::now() >= deadline {
            return answer;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn body(data: impl Into<Bytes>) -> Body {
    Full::new(data.into())
        .map_err(|never| match never {})
        .boxed_unsync()
}

fn req_body(data: impl Into<Bytes>) -> ReqBody {
    Full::new(data.into()).boxed_unsync()
}

/// A body of the given frames, as a stream.
fn frames(items: Vec<Result<Frame<Bytes>, Failure>>) -> Body {
    StreamBody::new(stream::iter(items)).boxed_unsync()
}

/// A stream fed by a channel: one data frame per message, ending when the sender is dropped.
fn channel_stream<E>(
    rx: mpsc::Receiver<Bytes>,
) -> impl futures_util::Stream<Item = Result<Frame<Bytes>, E>> + Send + 'static {
    stream::unfold(rx, |mut rx| async move {
        rx.recv()
            .await
            .map(|chunk| (Ok::<_, E>(Frame::data(chunk)), rx))
    })
}

/// A response body fed by a channel.
fn channel_body(rx: mpsc::Receiver<Bytes>) -> Body {
    StreamBody::new(channel_stream(rx)).boxed_unsync()
}

/// A request body fed by a channel, without a length.
fn channel_req_body(rx: mpsc::Receiver<Bytes>) -> ReqBody {
    StreamBody::new(channel_stream(rx)).boxed_unsync()
}

/// The bytes of the body the inner service received.
async fn read(inner: RequestBody<ReqBody>) -> Bytes {
    let collected = match inner {
        Either::Left(full) => full.collect().await,
        Either::Right(passed) => passed.collect().await,
    };
    match collected {
        Ok(collected) => collected.to_bytes(),
        Err(never) => match never {},
    }
}

/// `layer` around the inner service `handler`.
fn stack<K, F>(layer: &IdempotencyLayer<K>, handler: F) -> Svc
where
    K: KeyExtractor,
    F: FnMut(Inner) -> HandlerFuture + Clone + Send + 'static,
{
    BoxCloneService::new(layer.layer(tower::service_fn(handler)))
}

/// An inner service that counts its runs, buffers the request body and lets `respond` answer
/// with the run number, the request head and the body.
fn handler<F, Fut>(
    calls: &Calls,
    respond: F,
) -> impl FnMut(Inner) -> HandlerFuture + Clone + Send + 'static
where
    F: Fn(usize, Parts, Bytes) -> Fut + Clone + Send + Sync + 'static,
    Fut: Future<Output = Result<Response<Body>, Failure>> + Send + 'static,
{
    let calls = calls.clone();
    move |req: Inner| {
        let run = calls.hit();
        let respond = respond.clone();
        Box::pin(async move {
            let (parts, req_body) = req.into_parts();
            let bytes = read(req_body).await;
            respond(run, parts, bytes).await
        }) as HandlerFuture
    }
}

/// A fresh uuid-like id.
fn fresh_id() -> String {
    let v: u128 = rand::random();
    let h = format!("{v:032x}");
    format!(
        "{}-{}-{}-{}-{}",
        &h[0..8],
        &h[8..12],
        &h[12..16],
        &h[16..20],
        &h[20..32]
    )
}

/// "Creates an order": sleeps `delay`, then answers 201 with a JSON body holding a fresh id, the
/// run number and the request it saw, and headers that test a byte-for-byte replay (repeated
/// `set-cookie`, a non-UTF-8 value).
fn order(
    calls: &Calls,
    delay: Duration,
) -> impl FnMut(Inner) -> HandlerFuture + Clone + Send + 'static {
    handler(
        calls,
        move |run, parts: Parts, req_body: Bytes| async move {
            tokio::time::sleep(delay).await;
            let json = serde_json::json!({
                "id": fresh_id(),
                "run": run,
                "method": parts.method.as_str(),
                "uri": parts.uri.to_string(),
                "echo": String::from_utf8_lossy(&req_body),
            });
            Ok(Response::builder()
                .status(StatusCode::CREATED)
                .header(header::CONTENT_TYPE, "application/json")
                .header(header::SET_COOKIE, "a=1")
                .header(header::SET_COOKIE, "b=2")
                .header("x-bin", HeaderValue::from_bytes(b"\x80\xff").unwrap())
                .header("x-run", run)
                .body(body(json.to_string()))
                .unwrap())
        },
    )
}

/// A request with optional idempotency key and extra headers.
fn request(
    method: Method,
    uri: &str,
    key: Option<&str>,
    headers: &[(&str, &str)],
    data: impl Into<Bytes>,
) -> Request<ReqBody> {
    let mut builder = Request::builder().method(method).uri(uri);
    if let Some(key) = key {
        builder = builder.header("idempotency-key", key);
    }
    for (name, value) in headers {
        builder = builder.header(*name, *value);
    }
    builder.body(req_body(data)).unwrap()
}

/// `POST /orders` with key `key` and body `data`.
fn keyed(key: &str, data: &'static str) -> Request<ReqBody> {
    request(Method::POST, "/orders", Some(key), &[], data)
}

/// A unique idempotency key (the tests of one server share its records).
fn unique(name: &str) -> String {
    format!("{name}-{:016x}", rand::random::<u64>())
}

/// A response, taken apart.
#[derive(Debug, Clone)]
struct Answer {
    status: StatusCode,
    headers: HeaderMap,
    body: Bytes,
    trailers: Option<HeaderMap>,
}

impl Answer {
    fn replayed(&self) -> bool {
        match self.headers.get(REPLAYED) {
            None => false,
            Some(v) => {
                assert_eq!(v, "true", "{REPLAYED} is either absent or `true`");
                true
            }
        }
    }

    fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body).unwrap_or_else(|e| {
            panic!(
                "body is not JSON ({e}): {:?}",
                String::from_utf8_lossy(&self.body)
            )
        })
    }

    fn id(&self) -> String {
        self.json()["id"].as_str().unwrap().to_owned()
    }

    fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }

    fn retry_after(&self) -> u64 {
        self.headers
            .get(header::RETRY_AFTER)
            .unwrap_or_else(|| panic!("a {} without Retry-After", self.status))
            .to_str()
            .unwrap()
            .parse()
            .unwrap()
    }
}

async fn answer(res: Reply) -> Answer {
    let (parts, res_body) = res.into_parts();
    let collected = res_body.collect().await.unwrap();
    let trailers = collected.trailers().cloned();
    Answer {
        status: parts.status,
        headers: parts.headers,
        body: collected.to_bytes(),
        trailers,
    }
}

/// Sends `req` through `svc` and reads the whole answer (within 10 s: never a hang).
fn send(svc: &Svc, req: Request<ReqBody>) -> impl Future<Output = Answer> + Send + 'static {
    let call = svc.clone().oneshot(req);
    async move {
        tokio::time::timeout(Duration::from_secs(10), async {
            answer(call.await.unwrap()).await
        })
        .await
        .expect("the layer answered within 10 s")
    }
}

/// Headers in iteration order, as bytes: what "byte for byte" compares.
fn header_list(headers: &HeaderMap) -> Vec<(String, Vec<u8>)> {
    headers
        .iter()
        .map(|(n, v)| (n.as_str().to_owned(), v.as_bytes().to_vec()))
        .collect()
}

/// Asserts that `replay` is `first` byte for byte, plus `Idempotent-Replayed: true` — but for
/// `Set-Cookie`, which is never stored and so never replayed.
fn assert_replay_of(replay: &Answer, first: &Answer) {
    assert!(!first.replayed(), "the first answer is not marked replayed");
    assert!(replay.replayed(), "a replay is marked replayed");
    assert_eq!(replay.status, first.status);
    let mut headers = replay.headers.clone();
    headers.remove(REPLAYED);
    assert!(
        !headers.contains_key(http::header::SET_COOKIE),
        "a replay carries Set-Cookie"
    );
    let mut expected = first.headers.clone();
    expected.remove(http::header::SET_COOKIE);
    assert_eq!(header_list(&headers), header_list(&expected));
    assert_eq!(replay.body, first.body);
    assert_eq!(replay.trailers, first.trailers);
}

/// The default layer on a store of `server`.
fn default_layer(server: &RedisServer) -> IdempotencyLayer {
    IdempotencyLayer::builder(server.store())
        .unscoped()
        .build()
        .unwrap()
}

/// Every key on the test server with its PTTL.
fn redis_keys(server: &RedisServer) -> Vec<(String, i64)> {
    let mut conn = server.conn();
    let keys: Vec<String> = redis::cmd("KEYS").arg("*").query(&mut conn).unwrap();
    keys.into_iter()
        .map(|k| {
            let ttl: i64 = redis::cmd("PTTL").arg(&k).query(&mut conn).unwrap();
            (k, ttl)
        })
        .collect()
}

// ---------------------------------------------------------------------------------------------
// Pass-through and key syntax
// ---------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread")]
async fn uncovered_methods_and_keyless_requests_pass_through_untouched() {
    let server = RedisServer::start();
    let calls = Calls::default();
    // Echoes the body it received and sets one header: nothing else may appear.
    let echo = handler(&calls, |run, parts: Parts, req_body: Bytes| async move {
        Ok(Response::builder()
            .status(StatusCode::OK)
            .header("x-run", run)
            .header("x-method", parts.method.as_str())
            .body(body(req_body))
            .unwrap())
    });
    let svc = stack(&default_layer(&server), echo.clone());

    // GET (and PUT, DELETE) are not covered: the handler runs every time, key or no key,
    // even a malformed key, and the response is the handler's own.
    for (i, (method, key)) in [
        (Method::GET, Some("k-get")),
        (Method::GET, Some("k-get")),
        (Method::GET, None),
        (Method::GET, Some("bad key with spaces")),
        (Method::PUT, Some("k-put")),
        (Method::PUT, Some("k-put")),
        (Method::DELETE, Some("k-put")),
    ]
    .into_iter()
    .enumerate()
    {
        let a = send(
            &svc,
            request(method.clone(), "/orders", key, &[], "payload"),
        )
        .await;
        assert_eq!(a.status, StatusCode::OK, "{method} {key:?}");
        assert_eq!(a.body, "payload");
        assert!(!a.replayed());
        assert_eq!(a.headers.len(), 2, "{:?}", a.headers);
        assert_eq!(a.headers["x-run"], (i + 1).to_string());
        assert_eq!(a.headers["x-method"], method.as_str());
    }
    assert_eq!(calls.get(), 7);

    // POST without a key, not required: passes through each time.
    for run in [8, 9] {
        let a = send(&svc, request(Method::POST, "/orders", None, &[], "p")).await;
        assert_eq!(a.status, StatusCode::OK);
        assert_eq!(a.headers["x-run"], run.to_string());
        assert!(!a.replayed());
    }
    assert_eq!(calls.get(), 9);
    assert!(
        redis_keys(&server).is_empty(),
        "requests passed through leave nothing in the store"
    );

    // Required: a covered request without a key is refused with a reason; others still pass.
    let required = IdempotencyLayer::builder(server.store())
        .unscoped()
        .required(true)
        .build()
        .unwrap();
    let svc = stack(&required, echo);
    for method in [Method::POST, Method::PATCH] {
        let a = send(&svc, request(method.clone(), "/orders", None, &[], "p")).await;
        assert_eq!(a.status, StatusCode::BAD_REQUEST, "{method}");
        let text = a.text();
        assert!(
            text.contains("Idempotency-Key") && text.contains("required"),
            "the 400 says why: {text:?}"
        );
    }
    assert_eq!(calls.get(), 9, "a refused request does not run the handler");
    let a = send(&svc, request(Method::GET, "/orders", None, &[], "p")).await;
    assert_eq!(a.status, StatusCode::OK);
    let a = send(
        &svc,
        request(Method::POST, "/orders", Some("k-req"), &[], "p"),
    )
    .await;
    assert_eq!(a.status, StatusCode::OK);
    assert_eq!(calls.get(), 11);
}

#[tokio::test(flavor = "multi_thread")]
async fn malformed_keys_get_400_and_both_key_forms_name_one_key() {
    let server = RedisServer::start();
    let calls = Calls::default();
    let svc = stack(&default_layer(&server), order(&calls, Duration::ZERO));

    let long = "k".repeat(256);
    let long_quoted = format!("\"{long}\"");
    let cases: Vec<(&str, Vec<&[u8]>, &str)> = vec![
        ("empty", vec![b""], "empty"),
        ("empty quoted", vec![b"\"\""], "empty"),
        ("256 characters", vec![long.as_bytes()], "longer than 255"),
        (
            "256 quoted",
            vec![long_quoted.as_bytes()],
            "longer than 255",
        ),
        ("space", vec![b"a b"], "visible ASCII"),
        ("tab", vec![b"a\tb"], "visible ASCII"),
        ("0x80 byte", vec![b"k\x80"], "visible ASCII"),
        ("UTF-8", vec![b"caf\xc3\xa9"], "visible ASCII"),
        ("unterminated quote", vec![b"\"abc"], "quoted string"),
        ("quote inside", vec![b"\"a\"b\""], "quoted string"),
        ("bad escape", vec![b"\"a\\x\""], "quoted string"),
        ("two headers", vec![b"abc", b"abc"], "one Idempotency-Key"),
        (
            "two different headers",
            vec![b"abc", b"def"],
            "one Idempotency-Key",
        ),
    ];
    for (what, values, reason) in cases {
        let mut req = request(Method::POST, "/orders", None, &[], "{}");
        for value in values {
            req.headers_mut()
                .append("idempotency-key", HeaderValue::from_bytes(value).unwrap());
        }
        let a = send(&svc, req).await;
        assert_eq!(a.status, StatusCode::BAD_REQUEST, "{what}");
        assert!(
            a.text().contains(reason),
            "{what}: the 400 says why ({reason:?}): {:?}",
            a.text()
        );
        assert!(!a.replayed());
    }
    assert_eq!(calls.get(), 0, "no malformed key ran the handler");

    // 255 characters is the longest key accepted, bare or quoted.
    let k255 = "k".repeat(255);
    let a = send(&svc, keyed(&k255, "{}")).await;
    assert_eq!(a.status, StatusCode::CREATED);
    assert!(!a.replayed());
    let quoted = format!("\"{k255}\"");
    let b = send(&svc, keyed(&quoted, "{}")).await;
    assert_replay_of(&b, &a);
    assert_eq!(calls.get(), 1);

    // `"abc"` and `abc` name the same key, in both orders; escapes are undone.
    let first = send(&svc, keyed("\"abc\"", "{}")).await;
    assert_eq!(first.status, StatusCode::CREATED);
    assert_replay_of(&send(&svc, keyed("abc", "{}")).await, &first);
    let first = send(&svc, keyed("xyz", "{}")).await;
    assert_replay_of(&send(&svc, keyed("\"xyz\"", "{}")).await, &first);
    let first = send(&svc, keyed("\"a\\\"b\\\\c\"", "{}")).await;
    assert_eq!(first.status, StatusCode::CREATED);
    assert_replay_of(&send(&svc, keyed("a\"b\\c", "{}")).await, &first);
    assert_eq!(calls.get(), 4);
    // ... and a different key is a different key
    let other = send(&svc, keyed("abd", "{}")).await;
    assert!(!other.replayed());
    assert_eq!(calls.get(), 5);
}

#[tokio::test(flavor = "multi_thread")]
async fn bodies_over_the_limit_get_413_without_running_the_handler() {
    let server = RedisServer::start();
    let calls = Calls::default();
    let layer = IdempotencyLayer::builder(server.store())
        .unscoped()
        .body_limit(16)
        .build()
        .unwrap();
    let svc = stack(&layer, order(&calls, Duration::ZERO));

    // Declared with Content-Length.
    let seventeen = "0123456789abcdefg";
    let req = request(
        Method::POST,
        "/orders",
        Some("big-1"),
        &[("content-length", "17")],
        seventeen,
    );
    let a = send(&svc, req).await;
    assert_eq!(a.status, StatusCode::PAYLOAD_TOO_LARGE);
    assert!(a.text().contains("larger"), "{:?}", a.text());

    // A Content-Length that claims too much is refused before reading anything.
    let req = request(
        Method::POST,
        "/orders",
        Some("big-2"),
        &[("content-length", "1000000")],
        "tiny",
    );
    assert_eq!(send(&svc, req).await.status, StatusCode::PAYLOAD_TOO_LARGE);

    // Streamed, without Content-Length: 3 chunks of 8 bytes from a channel.
    let (tx, rx) = mpsc::channel(4);
    for _ in 0..3 {
        tx.send(Bytes::from_static(b"01234567")).await.unwrap();
    }
    drop(tx);
    let req = Request::post("/orders")
        .header("idempotency-key", "big-3")
        .body(channel_req_body(rx))
        .unwrap();
    assert!(req.headers().get(header::CONTENT_LENGTH).is_none());
    let a = send(&svc, req).await;
    assert_eq!(a.status, StatusCode::PAYLOAD_TOO_LARGE);
    assert_eq!(calls.get(), 0, "no oversized request ran the handler");

    // Exactly the limit passes (streamed too), and a refused key was never claimed.
    let (tx, rx) = mpsc::channel(4);
    tx.send(Bytes::from_static(b"01234567")).await.unwrap();
    tx.send(Bytes::from_static(b"89abcdef")).await.unwrap();
    drop(tx);
    let req = Request::post("/orders")
        .header("idempotency-key", "big-3")
        .body(channel_req_body(rx))
        .unwrap();
    let a = send(&svc, req).await;
    assert_eq!(a.status, StatusCode::CREATED);
    assert_eq!(a.json()["echo"], "0123456789abcdef");
    let req = request(
        Method::POST,
        "/orders",
        Some("big-1"),
        &[("content-length", "16")],
        "0123456789abcdef",
    );
    let a = send(&svc, req).await;
    assert_eq!(a.status, StatusCode::CREATED);
    assert!(!a.replayed());
    assert_eq!(calls.get(), 2);
}

// ---------------------------------------------------------------------------------------------
// Exactly once, across copies
// ---------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread")]
async fn fifty_parallel_duplicates_across_two_copies_execute_once() {
    let server = RedisServer::start();
    let calls = Calls::default();
    // Two copies of the service: each its own layer and its own store (connection).
    let copies = [
        stack(
            &default_layer(&server),
            order(&calls, Duration::from_millis(100)),
        ),
        stack(
            &default_layer(&server),
            order(&calls, Duration::from_millis(100)),
        ),
    ];
    let barrier = Arc::new(Barrier::new(50));
    let mut tasks = Vec::new();
    for i in 0..50 {
        let svc = copies[i % 2].clone();
        let barrier = Arc::clone(&barrier);
        tasks.push(tokio::spawn(async move {
            barrier.wait().await;
            send(&svc, keyed("coupon-1", "{\"amount\":100}")).await
        }));
    }
    let mut answers = Vec::new();
    for task in tasks {
        answers.push(task.await.unwrap());
    }
    assert_eq!(calls.get(), 1, "the handler ran exactly once");

    let (conflicts, done): (Vec<_>, Vec<_>) = answers
        .into_iter()
        .partition(|a| a.status == StatusCode::CONFLICT);
    assert!(
        !conflicts.is_empty(),
        "duplicates sent while the first runs get 409"
    );
    for c in &conflicts {
        assert!(c.retry_after() >= 1);
        assert!(!c.replayed());
        assert!(c.text().contains("still being processed"), "{:?}", c.text());
    }
    let executed: Vec<_> = done.iter().filter(|a| !a.replayed()).collect();
    assert_eq!(executed.len(), 1, "exactly one answer is the execution");
    let first = executed[0].clone();
    assert_eq!(first.status, StatusCode::CREATED);
    assert_eq!(first.json()["run"], 1);
    assert_eq!(first.json()["echo"], "{\"amount\":100}");
    for a in &done {
        assert_eq!(a.status, StatusCode::CREATED);
        assert_eq!(
            a.id(),
            first.id(),
            "every non-409 answer carries the same id"
        );
        if a.replayed() {
            assert_replay_of(a, &first);
        }
    }

    // A later retry, through either copy, is the replay: status, headers, body byte for byte.
    for svc in &copies {
        let replay = send(svc, keyed("coupon-1", "{\"amount\":100}")).await;
        assert_replay_of(&replay, &first);
        // the first caller's session cookies are never handed to whoever replays
        assert_eq!(first.headers.get_all(header::SET_COOKIE).iter().count(), 2);
        assert_eq!(replay.headers.get_all(header::SET_COOKIE).iter().count(), 0);
        assert_eq!(replay.headers["x-bin"].as_bytes(), b"\x80\xff");
    }
    assert_eq!(calls.get(), 1);
}

#[tokio::test(flavor = "multi_thread")]
async fn waiting_duplicates_get_the_first_response_and_no_409() {
    let server = RedisServer::start();
    let calls = Calls::default();
    let build = || {
        IdempotencyLayer::builder(server.store())
            .unscoped()
            .on_concurrent(OnConcurrent::Wait(Duration::from_secs(2)))
            .build()
            .unwrap()
    };
    let copies = [
        stack(&build(), order(&calls, Duration::from_millis(100))),
        stack(&build(), order(&calls, Duration::from_millis(100))),
    ];
    let barrier = Arc::new(Barrier::new(20));
    let mut tasks = Vec::new();
    for i in 0..20 {
        let svc = copies[i % 2].clone();
        let barrier = Arc::clone(&barrier);
        tasks.push(tokio::spawn(async move {
            barrier.wait().await;
            send(&svc, keyed("wait-1", "{}")).await
        }));
    }
    let mut answers = Vec::new();
    for task in tasks {
        answers.push(task.await.unwrap());
    }
    assert_eq!(calls.get(), 1);
    assert!(answers.iter().all(|a| a.status == StatusCode::CREATED));
    let executed: Vec<_> = answers.iter().filter(|a| !a.replayed()).collect();
    assert_eq!(executed.len(), 1);
    for a in &answers {
        if a.replayed() {
            assert_replay_of(a, executed[0]);
        }
    }

    // A waiter whose predecessor fails runs the handler itself once the key is released.
    let flaky = Calls::default();
    let fail_first = handler(&flaky, |run, _parts: Parts, _body: Bytes| async move {
        tokio::time::sleep(Duration::from_millis(200)).await;
        let status = if run == 1 {
            StatusCode::INTERNAL_SERVER_ERROR
        } else {
            StatusCode::CREATED
        };
        Ok(Response::builder()
            .status(status)
            .header("x-run", run)
            .body(body(format!("run {run}")))
            .unwrap())
    });
    let svc = stack(&build(), fail_first);
    let first = tokio::spawn({
        let svc = svc.clone();
        async move { send(&svc, keyed("wait-2", "{}")).await }
    });
    flaky.reached(1).await;
    let second = send(&svc, keyed("wait-2", "{}")).await;
    let first = first.await.unwrap();
    assert_eq!(first.status, StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(first.body, "run 1");
    assert_eq!(second.status, StatusCode::CREATED);
    assert_eq!(second.body, "run 2");
    assert!(!second.replayed());
    assert_eq!(flaky.get(), 2);

    // Wait is bounded: a handler slower than the wait still gets 409.
    let slow = Calls::default();
    let layer = IdempotencyLayer::builder(server.store())
        .unscoped()
        .on_concurrent(OnConcurrent::Wait(Duration::from_millis(200)))
        .build()
        .unwrap();
    let svc = stack(&layer, order(&slow, Duration::from_millis(1200)));
    let first = tokio::spawn({
        let svc = svc.clone();
        async move { send(&svc, keyed("wait-3", "{}")).await }
    });
    slow.reached(1).await;
    let started = Instant::now();
    let second = send(&svc, keyed("wait-3", "{}")).await;
    let waited = started.elapsed();
    // 409 (not the replay the 1.2 s handler ends in): the wait ended before the handler did
    assert_eq!(second.status, StatusCode::CONFLICT);
    assert!(second.retry_after() >= 1);
    assert!(waited >= Duration::from_millis(180), "waited {waited:?}");
    assert_eq!(first.await.unwrap().status, StatusCode::CREATED);
    assert_eq!(slow.get(), 1);
}

// ---------------------------------------------------------------------------------------------
// Fingerprints
// ---------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread")]
async fn a_key_reused_for_another_request_gets_422() {
    let server = RedisServer::start();
    let calls = Calls::default();
    let svc = stack(&default_layer(&server), order(&calls, Duration::ZERO));
    let post = |method: Method, uri: &str, headers: &[(&str, &str)], data: &'static str| {
        request(method, uri, Some("fp-1"), headers, data)
    };

    let first = send(&svc, post(Method::POST, "/orders?x=1", &[], "{\"a\":1}")).await;
    assert_eq!(first.status, StatusCode::CREATED);
    for (what, req) in [
        ("body", post(Method::POST, "/orders?x=1", &[], "{\"a\":2}")),
        (
            "body whitespace",
            post(Method::POST, "/orders?x=1", &[], "{\"a\": 1}"),
        ),
        ("empty body", post(Method::POST, "/orders?x=1", &[], "")),
        ("query", post(Method::POST, "/orders?x=2", &[], "{\"a\":1}")),
        ("no query", post(Method::POST, "/orders", &[], "{\"a\":1}")),
        ("path", post(Method::POST, "/other?x=1", &[], "{\"a\":1}")),
        (
            "method",
            post(Method::PATCH, "/orders?x=1", &[], "{\"a\":1}"),
        ),
    ] {
        let a = send(&svc, req).await;
        assert_eq!(a.status, StatusCode::UNPROCESSABLE_ENTITY, "{what}");
        assert_eq!(a.headers["content-type"], "application/problem+json");
        let problem: serde_json::Value = serde_json::from_str(&a.text()).unwrap();
        assert_eq!(problem["type"], "about:blank", "{what}");
        assert_eq!(problem["title"], "Unprocessable Entity", "{what}");
        assert_eq!(problem["status"], 422, "{what}");
        assert_eq!(
            problem["detail"], "this Idempotency-Key was used with a different request",
            "{what}"
        );
        assert!(!a.replayed());
    }
    // Same request: the replay. Headers outside the fingerprint do not matter by default.
    let same = send(
        &svc,
        post(
            Method::POST,
            "/orders?x=1",
            &[("content-type", "text/plain"), ("x-trace", "2")],
            "{\"a\":1}",
        ),
    )
    .await;
    assert_replay_of(&same, &first);
    assert_eq!(calls.get(), 1);

    // A mismatch is refused while the first request still runs, too (422, not 409).
    let slow = stack(
        &default_layer(&server),
        order(&calls, Duration::from_millis(1000)),
    );
    let running = tokio::spawn({
        let slow = slow.clone();
        async move { send(&slow, keyed("fp-2", "{\"a\":1}")).await }
    });
    calls.reached(2).await;
    let a = send(&slow, keyed("fp-2", "{\"a\":2}")).await;
    assert_eq!(a.status, StatusCode::UNPROCESSABLE_ENTITY);
    let a = send(&slow, keyed("fp-2", "{\"a\":1}")).await;
    assert_eq!(a.status, StatusCode::CONFLICT);
    assert_eq!(running.await.unwrap().status, StatusCode::CREATED);
    assert_eq!(calls.get(), 2);

    // Chosen headers join the fingerprint.
    let layer = IdempotencyLayer::builder(server.store())
        .unscoped()
        .fingerprint_headers([header::CONTENT_TYPE])
        .build()
        .unwrap();
    let svc = stack(&layer, order(&calls, Duration::ZERO));
    let json = [("content-type", "application/json")];
    let first = send(&svc, request(Method::POST, "/o", Some("fp-3"), &json, "{}")).await;
    assert_eq!(first.status, StatusCode::CREATED);
    let same = send(&svc, request(Method::POST, "/o", Some("fp-3"), &json, "{}")).await;
    assert_replay_of(&same, &first);
    for headers in [&[("content-type", "text/plain")][..], &[]] {
        let a = send(
            &svc,
            request(Method::POST, "/o", Some("fp-3"), headers, "{}"),
        )
        .await;
        assert_eq!(a.status, StatusCode::UNPROCESSABLE_ENTITY, "{headers:?}");
    }
    assert_eq!(calls.get(), 3);
}

// ---------------------------------------------------------------------------------------------
// Failures release the key
// ---------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread")]
async fn failed_handlers_release_the_key_and_a_retry_runs_again() {
    let server = RedisServer::start();
    let layer = default_layer(&server);

    // 5xx: passed on, not stored; the retry runs again until one succeeds, which is stored.
    let calls = Calls::default();
    let svc = stack(
        &layer,
        handler(&calls, |run, _parts: Parts, _body: Bytes| async move {
            let status = if run <= 2 {
                StatusCode::INTERNAL_SERVER_ERROR
            } else {
                StatusCode::CREATED
            };
            Ok(Response::builder()
                .status(status)
                .body(body(format!("run {run}")))
                .unwrap())
        }),
    );
    for run in 1..=2 {
        let a = send(&svc, keyed("fail-500", "{}")).await;
        assert_eq!(a.status, StatusCode::INTERNAL_SERVER_ERROR);
        assert_eq!(a.body, format!("run {run}"));
        assert!(!a.replayed());
    }
    let ok = send(&svc, keyed("fail-500", "{}")).await;
    assert_eq!(
        (ok.status, ok.body.clone()),
        (StatusCode::CREATED, "run 3".into())
    );
    assert_replay_of(&send(&svc, keyed("fail-500", "{}")).await, &ok);
    assert_eq!(calls.get(), 3);

    // An error from the inner service reaches the caller; the retry runs again.
    let calls = Calls::default();
    let svc = stack(
        &layer,
        handler(&calls, |run, _parts: Parts, _body: Bytes| async move {
            if run == 1 {
                return Err(Failure("database is down".into()));
            }
            Ok(Response::new(body(format!("run {run}"))))
        }),
    );
    let err = svc
        .clone()
        .oneshot(keyed("fail-err", "{}"))
        .await
        .expect_err("the inner error is passed on");
    assert_eq!(err.to_string(), "database is down");
    let a = send(&svc, keyed("fail-err", "{}")).await;
    assert_eq!((a.status, a.body.clone()), (StatusCode::OK, "run 2".into()));
    assert!(!a.replayed());
    assert_eq!(calls.get(), 2);

    // A panic, in the handler's future or in its `call`: the caller gets a 500 (not a hang), and
    // the retry runs again.
    let calls = Calls::default();
    let svc = stack(
        &layer,
        handler(&calls, |run, _parts: Parts, _body: Bytes| async move {
            tokio::time::sleep(Duration::from_millis(20)).await;
            assert!(run != 1, "deliberate panic in the handler's future");
            Ok(Response::new(body(format!("run {run}"))))
        }),
    );
    let a = send(&svc, keyed("fail-panic", "{}")).await;
    assert_eq!(a.status, StatusCode::INTERNAL_SERVER_ERROR);
    assert!(a.text().contains("handler failed"), "{:?}", a.text());
    assert!(!a.replayed());
    let a = send(&svc, keyed("fail-panic", "{}")).await;
    assert_eq!((a.status, a.body.clone()), (StatusCode::OK, "run 2".into()));
    assert_eq!(calls.get(), 2);

    let sync_calls = Calls::default();
    let counter = sync_calls.clone();
    let svc = stack(&layer, move |_req: Inner| {
        let run = counter.hit();
        assert!(run != 1, "deliberate panic in the service's call");
        Box::pin(async move { Ok(Response::new(body(format!("run {run}")))) }) as HandlerFuture
    });
    let a = send(&svc, keyed("fail-panic-call", "{}")).await;
    assert_eq!(a.status, StatusCode::INTERNAL_SERVER_ERROR);
    let a = send(&svc, keyed("fail-panic-call", "{}")).await;
    assert_eq!((a.status, a.body.clone()), (StatusCode::OK, "run 2".into()));
    assert_eq!(sync_calls.get(), 2);

    // A response body that fails midway: the caller sees the error, nothing is stored.
    let calls = Calls::default();
    let svc = stack(
        &layer,
        handler(&calls, |run, _parts: Parts, _body: Bytes| async move {
            let tail = if run == 1 {
                Err(Failure("connection to the backend lost".into()))
            } else {
                Ok(Frame::data(Bytes::from_static(b" and the rest")))
            };
            Ok(Response::new(frames(vec![
                Ok(Frame::data(Bytes::from(format!("run {run}")))),
                tail,
            ])))
        }),
    );
    let res = svc.clone().oneshot(keyed("fail-body", "{}")).await.unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    let err = res.into_body().collect().await.expect_err("the body fails");
    assert_eq!(err.to_string(), "connection to the backend lost");
    // The error reaches the caller before the key is released: an immediate retry may still meet
    // the claim (`a_retry_right_after_a_broken_body_runs_again` tests that); here, once it is
    // released.
    let a = once_settled(&svc, || keyed("fail-body", "{}")).await;
    assert_eq!(a.body, "run 2 and the rest");
    assert!(!a.replayed());
    assert_eq!(calls.get(), 2);
}

#[tokio::test(flavor = "multi_thread")]
async fn store_when_decides_which_statuses_are_stored() {
    let server = RedisServer::start();
    fn bad_request(calls: &Calls) -> impl FnMut(Inner) -> HandlerFuture + Clone + Send + 'static {
        handler(calls, |run, _parts: Parts, _body: Bytes| async move {
            Ok(Response::builder()
                .status(StatusCode::BAD_REQUEST)
                .body(body(format!("invalid, run {run}")))
                .unwrap())
        })
    }

    // Default (all but 5xx): a 400 is a result like any other, replayed.
    let calls = Calls::default();
    let svc = stack(&default_layer(&server), bad_request(&calls));
    let first = send(&svc, keyed("sw-1", "{}")).await;
    assert_eq!(first.status, StatusCode::BAD_REQUEST);
    assert_replay_of(&send(&svc, keyed("sw-1", "{}")).await, &first);
    assert_eq!(calls.get(), 1);

    // Only successes stored: the 400 is not, and the retry runs again.
    let calls = Calls::default();
    let layer = IdempotencyLayer::builder(server.store())
        .unscoped()
        .store_when(|s| s.is_success())
        .build()
        .unwrap();
    let svc = stack(&layer, bad_request(&calls));
    for run in 1..=2 {
        let a = send(&svc, keyed("sw-2", "{}")).await;
        assert_eq!(a.status, StatusCode::BAD_REQUEST);
        assert_eq!(a.body, format!("invalid, run {run}"));
        assert!(!a.replayed());
    }
    assert_eq!(calls.get(), 2);
}

// ---------------------------------------------------------------------------------------------
// Trailers, gRPC, streaming
// ---------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread")]
async fn replays_include_trailers() {
    let server = RedisServer::start();
    let calls = Calls::default();
    let svc = stack(
        &default_layer(&server),
        handler(&calls, |run, _parts: Parts, _body: Bytes| async move {
            let mut trailers = HeaderMap::new();
            trailers.insert("x-checksum", HeaderValue::from_static("abc123"));
            trailers.append("x-note", HeaderValue::from_static("one"));
            trailers.append("x-note", HeaderValue::from_static("two"));
            trailers.insert("x-run", HeaderValue::from(run));
            Ok(Response::builder()
                .header("x-head", "h")
                .body(frames(vec![
                    Ok(Frame::data(Bytes::from_static(b"hello "))),
                    Ok(Frame::data(Bytes::from_static(b"world"))),
                    Ok(Frame::trailers(trailers)),
                ]))
                .unwrap())
        }),
    );
    let first = send(&svc, keyed("tr-1", "{}")).await;
    assert_eq!(first.body, "hello world");
    let trailers = first
        .trailers
        .clone()
        .expect("the first answer has trailers");
    assert_eq!(trailers["x-checksum"], "abc123");
    assert_eq!(trailers["x-run"], "1");
    let notes: Vec<_> = trailers.get_all("x-note").iter().collect();
    assert_eq!(notes, ["one", "two"]);
    let replay = send(&svc, keyed("tr-1", "{}")).await;
    assert_replay_of(&replay, &first);
    assert_eq!(
        header_list(replay.trailers.as_ref().unwrap()),
        header_list(&trailers)
    );
    assert_eq!(calls.get(), 1);
}

/// A gRPC request: `content-type: application/grpc`, the key as `idempotency-key` metadata.
fn grpc_request(key: &str, message: &'static [u8]) -> Request<ReqBody> {
    let mut framed = vec![0u8];
    framed.extend_from_slice(&u32::try_from(message.len()).unwrap().to_be_bytes());
    framed.extend_from_slice(message);
    Request::post("/shop.Orders/Create")
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .header("idempotency-key", key)
        .body(req_body(framed))
        .unwrap()
}

#[tokio::test(flavor = "multi_thread")]
async fn grpc_replays_carry_grpc_status_trailers() {
    let server = RedisServer::start();
    let calls = Calls::default();
    // Create: a message and `grpc-status: 0` in the trailers. Lookup: no message, only trailers
    // (grpc-status 5, NOT_FOUND, a client-side outcome that is stored like a 4xx).
    let svc = stack(
        &default_layer(&server),
        handler(&calls, |run, parts: Parts, _body: Bytes| async move {
            let mut trailers = HeaderMap::new();
            let mut items = Vec::new();
            if parts.headers["idempotency-key"]
                .as_bytes()
                .starts_with(b"grpc-ok")
            {
                items.push(Ok(Frame::data(Bytes::from(format!(
                    "\0\0\0\0\x05run{run:02}"
                )))));
                trailers.insert("grpc-status", HeaderValue::from_static("0"));
            } else {
                trailers.insert("grpc-status", HeaderValue::from_static("5"));
                trailers.insert(
                    "grpc-message",
                    HeaderValue::from_static("no%20such%20order"),
                );
            }
            items.push(Ok(Frame::trailers(trailers)));
            Ok(Response::builder()
                .header("content-type", "application/grpc")
                .body(frames(items))
                .unwrap())
        }),
    );
    let first = send(&svc, grpc_request("grpc-ok-1", b"order")).await;
    assert_eq!(first.status, StatusCode::OK);
    assert_eq!(first.body, "\0\0\0\0\x05run01");
    assert_eq!(first.trailers.as_ref().unwrap()["grpc-status"], "0");
    let replay = send(&svc, grpc_request("grpc-ok-1", b"order")).await;
    assert_replay_of(&replay, &first);
    assert_eq!(replay.trailers.as_ref().unwrap()["grpc-status"], "0");

    let first = send(&svc, grpc_request("grpc-nf-1", b"order")).await;
    assert!(first.body.is_empty());
    assert_eq!(first.trailers.as_ref().unwrap()["grpc-status"], "5");
    let replay = send(&svc, grpc_request("grpc-nf-1", b"order")).await;
    assert_replay_of(&replay, &first);
    assert_eq!(
        replay.trailers.as_ref().unwrap()["grpc-message"],
        "no%20such%20order"
    );
    assert_eq!(calls.get(), 2);

    // The layer's own refusals are gRPC-native (HTTP 200, grpc-status in the headers).
    let bad = send(&svc, grpc_request("", b"order")).await;
    assert_eq!(bad.status, StatusCode::OK);
    assert_eq!(bad.headers["content-type"], "application/grpc");
    assert_eq!(bad.headers["grpc-status"], "3");
    assert!(bad.body.is_empty());
    let mismatch = send(&svc, grpc_request("grpc-ok-1", b"other")).await;
    assert_eq!(mismatch.status, StatusCode::OK);
    assert_eq!(mismatch.headers["grpc-status"], "9");
    assert_eq!(calls.get(), 2);
}

/// A gRPC handler that fails reports it in `grpc-status` (HTTP is 200): UNAVAILABLE in a
/// trailers-only response, INTERNAL in the trailers. Like a 5xx, such a failure must release the
/// key so that the client's retry runs the handler again, rather than replaying the failure for
/// the whole retention.
#[tokio::test(flavor = "multi_thread")]
async fn grpc_server_failures_are_not_stored() {
    let server = RedisServer::start();
    let calls = Calls::default();
    let svc = stack(
        &default_layer(&server),
        handler(&calls, |run, parts: Parts, _body: Bytes| async move {
            let trailers_only = parts.headers["idempotency-key"] == "grpc-fail-1";
            let mut res = Response::builder().header("content-type", "application/grpc");
            let res_body = if run > 2 {
                let mut trailers = HeaderMap::new();
                trailers.insert("grpc-status", HeaderValue::from_static("0"));
                frames(vec![
                    Ok(Frame::data(Bytes::from_static(b"\0\0\0\0\x02ok"))),
                    Ok(Frame::trailers(trailers)),
                ])
            } else if trailers_only {
                res = res.header("grpc-status", "14");
                body(Bytes::new())
            } else {
                let mut trailers = HeaderMap::new();
                trailers.insert("grpc-status", HeaderValue::from_static("13"));
                frames(vec![Ok(Frame::trailers(trailers))])
            };
            Ok(res.body(res_body).unwrap())
        }),
    );
    let a = send(&svc, grpc_request("grpc-fail-1", b"x")).await;
    assert_eq!(a.headers["grpc-status"], "14");
    let b = send(&svc, grpc_request("grpc-fail-2", b"x")).await;
    assert_eq!(b.trailers.as_ref().unwrap()["grpc-status"], "13");
    assert_eq!(calls.get(), 2);
    // the retries run the handler again
    let a = send(&svc, grpc_request("grpc-fail-1", b"x")).await;
    assert!(
        !a.replayed(),
        "a grpc-status 14 (UNAVAILABLE) response was stored and replayed"
    );
    let b = send(&svc, grpc_request("grpc-fail-2", b"x")).await;
    assert!(
        !b.replayed(),
        "a grpc-status 13 (INTERNAL) response was stored and replayed"
    );
    assert_eq!(calls.get(), 4);
}

/// A handler that answers `status` with a body the test feeds through a channel, chunk by chunk
/// (one channel per run, taken from `feeds` in turn).
fn fed(
    calls: &Calls,
    status: StatusCode,
    feeds: Vec<mpsc::Receiver<Bytes>>,
) -> impl FnMut(Inner) -> HandlerFuture + Clone + Send + 'static {
    let feeds = Arc::new(Mutex::new(feeds.into_iter()));
    handler(calls, move |_run, _parts: Parts, _body: Bytes| {
        let rx = feeds.lock().unwrap().next().expect("a feed per run");
        async move {
            Ok(Response::builder()
                .status(status)
                .header("content-type", "text/event-stream")
                .body(channel_body(rx))
                .unwrap())
        }
    })
}

/// How long a step that must happen may take, and how long the tests watch for one that must not.
const STEP: Duration = Duration::from_secs(5);
const QUIET: Duration = Duration::from_millis(200);

/// The next data frame of `res_body`, within [`STEP`].
async fn next_data(res_body: &mut IdempotencyBody<Body>) -> Bytes {
    tokio::time::timeout(STEP, res_body.frame())
        .await
        .expect("a frame within 5 s")
        .expect("a frame, not the end")
        .unwrap()
        .into_data()
        .unwrap()
}

/// A response to be recorded reaches the caller — head included — only once it is recorded:
/// nothing of it streams while the handler produces it. The retry replays it whole.
#[tokio::test(flavor = "multi_thread")]
async fn a_recorded_response_reaches_the_first_caller_whole_once_recorded() {
    let server = RedisServer::start();
    let calls = Calls::default();
    let (tx, rx) = mpsc::channel(1);
    let svc = stack(
        &default_layer(&server),
        fed(&calls, StatusCode::OK, vec![rx]),
    );
    let mut first = tokio::spawn(svc.clone().oneshot(keyed("st-1", "{}")));
    for chunk in ["one,", "two,", "three"] {
        tx.send(Bytes::from(chunk)).await.unwrap();
        let early = tokio::time::timeout(QUIET, &mut first).await;
        assert!(early.is_err(), "the head went out before the body ended");
    }
    drop(tx);
    let res = tokio::time::timeout(STEP, first)
        .await
        .expect("the head arrives once the body ended and was recorded")
        .unwrap()
        .unwrap();
    let first = answer(res).await;
    assert_eq!(first.status, StatusCode::OK);
    assert_eq!(first.headers["content-type"], "text/event-stream");
    assert_eq!(first.body, "one,two,three");
    assert_eq!(first.trailers, None);

    let replay = send(&svc, keyed("st-1", "{}")).await;
    assert_replay_of(&replay, &first);
    assert_eq!(calls.get(), 1);
}

/// A response that grows over the storage cap is not recorded: the moment it does, the key is
/// released and the caller gets the head and what was held, then the rest as it is produced.
#[tokio::test(flavor = "multi_thread")]
async fn a_response_over_the_storage_cap_streams_from_then_on_and_is_not_recorded() {
    let server = RedisServer::start();
    let calls = Calls::default();
    let layer = IdempotencyLayer::builder(server.store())
        .unscoped()
        .response_limit(8)
        .build()
        .unwrap();
    let (tx, rx) = mpsc::channel(1);
    let (retry_tx, retry_rx) = mpsc::channel(1);
    let svc = stack(&layer, fed(&calls, StatusCode::OK, vec![rx, retry_rx]));
    let mut first = tokio::spawn(svc.clone().oneshot(keyed("st-cap", "{}")));
    for chunk in ["one,", "two,"] {
        tx.send(Bytes::from(chunk)).await.unwrap();
        let early = tokio::time::timeout(QUIET, &mut first).await;
        assert!(early.is_err(), "the head went out within the cap");
    }
    // 8 bytes so far, at the cap: the next chunk passes it
    tx.send(Bytes::from("three,")).await.unwrap();
    let res = tokio::time::timeout(STEP, first)
        .await
        .expect("the head arrives once the response passed the cap")
        .unwrap()
        .unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    assert!(res.headers().get(REPLAYED).is_none());
    let mut res_body = res.into_body();
    let mut held = BytesMut::new();
    while held.len() < "one,two,three,".len() {
        held.extend_from_slice(&next_data(&mut res_body).await);
    }
    assert_eq!(held, "one,two,three,");
    // the key is released already: a retry runs while the first body still streams
    retry_tx.send(Bytes::from("again")).await.unwrap();
    drop(retry_tx);
    let retry = send(&svc, keyed("st-cap", "{}")).await;
    assert_eq!(retry.status, StatusCode::OK);
    assert!(!retry.replayed());
    assert_eq!(retry.body, "again");
    // from here on each chunk reaches the first caller as it is produced
    for chunk in ["four,", "five"] {
        tx.send(Bytes::from(chunk)).await.unwrap();
        assert_eq!(next_data(&mut res_body).await, chunk);
    }
    drop(tx);
    let end = tokio::time::timeout(STEP, res_body.frame()).await.unwrap();
    assert!(end.is_none(), "the body ends when the handler's does");
    assert_eq!(calls.get(), 2);
    // the retry's response, within the cap, was recorded
    assert_replay_of(&send(&svc, keyed("st-cap", "{}")).await, &retry);
    assert_eq!(calls.get(), 2);
}

/// A response not to be stored by its status (a 5xx by default) streams to the caller at once,
/// and the key is released before its body ends.
#[tokio::test(flavor = "multi_thread")]
async fn an_unstored_response_streams_at_once_and_releases_the_key() {
    let server = RedisServer::start();
    let calls = Calls::default();
    let (tx, rx) = mpsc::channel(1);
    let (retry_tx, retry_rx) = mpsc::channel(1);
    let svc = stack(
        &default_layer(&server),
        fed(&calls, StatusCode::BAD_GATEWAY, vec![rx, retry_rx]),
    );
    let res = tokio::time::timeout(STEP, svc.clone().oneshot(keyed("st-5xx", "{}")))
        .await
        .expect("the head arrives before the body is produced")
        .unwrap();
    assert_eq!(res.status(), StatusCode::BAD_GATEWAY);
    let mut res_body = res.into_body();
    for chunk in ["upstream ", "failed"] {
        tx.send(Bytes::from(chunk)).await.unwrap();
        assert_eq!(next_data(&mut res_body).await, chunk);
    }
    drop(tx);
    let end = tokio::time::timeout(STEP, res_body.frame()).await.unwrap();
    assert!(end.is_none());
    retry_tx.send(Bytes::from("failed again")).await.unwrap();
    drop(retry_tx);
    let retry = send(&svc, keyed("st-5xx", "{}")).await;
    assert_eq!(retry.status, StatusCode::BAD_GATEWAY);
    assert!(!retry.replayed());
    assert_eq!(retry.body, "failed again");
    assert_eq!(calls.get(), 2);
}

/// The store forgets the claim (a restart without persistence: here `FLUSHALL`) while the
/// handler produces its body: the record is refused, and the caller gets `503` with
/// `Retry-After` — never the handler's `201`, whose head it must not have seen.
#[tokio::test(flavor = "multi_thread")]
async fn a_record_refused_while_the_body_is_produced_is_a_503_never_a_201() {
    let server = RedisServer::start();
    let calls = Calls::default();
    let (tx, rx) = mpsc::channel(1);
    let (retry_tx, retry_rx) = mpsc::channel(1);
    let svc = stack(
        &default_layer(&server),
        fed(&calls, StatusCode::CREATED, vec![rx, retry_rx]),
    );
    let mut first = tokio::spawn(svc.clone().oneshot(keyed("lost", "{}")));
    tx.send(Bytes::from("paid")).await.unwrap();
    let early = tokio::time::timeout(QUIET, &mut first).await;
    assert!(early.is_err(), "the 201 head went out before the record");
    assert_eq!(redis_keys(&server).len(), 1, "the claim is held");
    let () = redis::cmd("FLUSHALL").query(&mut server.conn()).unwrap();
    drop(tx);
    let res = tokio::time::timeout(STEP, first)
        .await
        .expect("an answer once the body ended")
        .unwrap()
        .unwrap();
    let refused = answer(res).await;
    assert_eq!(refused.status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(refused.retry_after(), 1);
    assert_eq!(refused.headers["content-type"], "application/problem+json");
    assert_eq!(
        refused.json()["detail"],
        "the response could not be recorded; retry with the same Idempotency-Key to learn the outcome"
    );
    assert!(!refused.replayed());
    assert_eq!(calls.get(), 1);

    // the store forgot the request: the retry runs it again, and that one is recorded
    retry_tx.send(Bytes::from("paid again")).await.unwrap();
    drop(retry_tx);
    let retry = send(&svc, keyed("lost", "{}")).await;
    assert_eq!(retry.status, StatusCode::CREATED);
    assert!(!retry.replayed());
    assert_eq!(retry.body, "paid again");
    assert_replay_of(&send(&svc, keyed("lost", "{}")).await, &retry);
    assert_eq!(calls.get(), 2);
}

/// The gRPC form: the claim is lost before the call's trailers (`grpc-status: 0`) come; the
/// caller gets UNAVAILABLE, trailers-only — neither the message nor an OK status.
#[tokio::test(flavor = "multi_thread")]
async fn a_grpc_call_whose_record_is_refused_fails_with_unavailable() {
    let server = RedisServer::start();
    let calls = Calls::default();
    let (tx, rx) = mpsc::channel::<Frame<Bytes>>(1);
    let feed = Arc::new(Mutex::new(Some(rx)));
    let svc = stack(
        &default_layer(&server),
        handler(&calls, move |_run, _parts: Parts, _body: Bytes| {
            let rx = feed.lock().unwrap().take().expect("one call");
            async move {
                let frames = stream::unfold(rx, |mut rx| async move {
                    rx.recv().await.map(|frame| (Ok::<_, Failure>(frame), rx))
                });
                Ok(Response::builder()
                    .header("content-type", "application/grpc")
                    .body(StreamBody::new(frames).boxed_unsync())
                    .unwrap())
            }
        }),
    );
    let mut first = tokio::spawn(svc.clone().oneshot(grpc_request("grpc-lost", b"order")));
    tx.send(Frame::data(Bytes::from_static(b"\0\0\0\0\x02ok")))
        .await
        .unwrap();
    let early = tokio::time::timeout(QUIET, &mut first).await;
    assert!(early.is_err(), "the head went out before the record");
    let () = redis::cmd("FLUSHALL").query(&mut server.conn()).unwrap();
    let mut trailers = HeaderMap::new();
    trailers.insert("grpc-status", HeaderValue::from_static("0"));
    tx.send(Frame::trailers(trailers)).await.unwrap();
    drop(tx);
    let res = tokio::time::timeout(STEP, first)
        .await
        .expect("an answer once the body ended")
        .unwrap()
        .unwrap();
    let refused = answer(res).await;
    assert_eq!(refused.status, StatusCode::OK);
    assert_eq!(refused.headers["content-type"], "application/grpc");
    assert_eq!(refused.headers["grpc-status"], "14", "UNAVAILABLE");
    assert_eq!(refused.body, "", "the handler's message never went out");
    assert_eq!(refused.trailers, None, "trailers-only: no OK trailers");
    assert_eq!(calls.get(), 1);
}

#[tokio::test(flavor = "multi_thread")]
async fn responses_over_the_storage_cap_are_delivered_but_not_stored() {
    let server = RedisServer::start();
    let calls = Calls::default();
    let layer = IdempotencyLayer::builder(server.store())
        .unscoped()
        .response_limit(16)
        .build()
        .unwrap();
    // Streams `n` chunks of 8 bytes, a little apart; `n` is the request body.
    let svc = stack(
        &layer,
        handler(&calls, |_run, _parts: Parts, req_body: Bytes| async move {
            let n: usize = std::str::from_utf8(&req_body).unwrap().parse().unwrap();
            let (tx, rx) = mpsc::channel(1);
            tokio::spawn(async move {
                for i in 0..n {
                    tokio::time::sleep(Duration::from_millis(10)).await;
                    tx.send(Bytes::from(format!("chunk-{i:02}"))).await.unwrap();
                }
            });
            Ok(Response::new(channel_body(rx)))
        }),
    );
    let expected = "chunk-00chunk-01chunk-02";
    for run in 1..=2 {
        let a = send(&svc, keyed("cap-1", "3")).await;
        assert_eq!(a.body, expected, "run {run}: delivered in full");
        assert!(!a.replayed());
    }
    assert_eq!(calls.get(), 2, "24 bytes over a 16-byte cap: not stored");

    // Exactly the cap is stored.
    let first = send(&svc, keyed("cap-2", "2")).await;
    assert_eq!(first.body, "chunk-00chunk-01");
    assert_replay_of(&send(&svc, keyed("cap-2", "2")).await, &first);
    assert_eq!(calls.get(), 3);
}

/// A [`RedisStore`] whose idempotency writes (complete, release) take 50 ms longer, as over a
/// slow network or with a large record: everything else goes straight to Redis.
#[derive(Debug, Clone)]
struct SlowWrites(RedisStore);

const SLOW_WRITE: Duration = Duration::from_millis(50);

/// Only the idempotency capability: the layer asks for nothing else.
impl IdempotencyStore for SlowWrites {
    fn timeout(&self) -> Duration {
        IdempotencyStore::timeout(&self.0) + SLOW_WRITE
    }

    fn idempotency_begin(
        &self,
        request: BeginRequest,
        deadline: tokio::time::Instant,
    ) -> StoreFuture<IdempotencyBegin> {
        let BeginRequest {
            hold,
            fingerprint,
            lease,
            ..
        } = request;
        let Hold { key, token } = hold;
        self.0.idempotency_begin(
            BeginRequest::new(Hold::new(key, token), fingerprint, lease),
            deadline,
        )
    }

    fn idempotency_complete(
        &self,
        request: CompleteRequest,
        deadline: tokio::time::Instant,
    ) -> StoreFuture<bool> {
        let CompleteRequest {
            hold,
            response,
            retention,
            ..
        } = request;
        let Hold { key, token } = hold;
        let write = self.0.idempotency_complete(
            CompleteRequest::new(Hold::new(key, token), response, retention),
            deadline,
        );
        Box::pin(async move {
            tokio::time::sleep(SLOW_WRITE).await;
            write.await
        })
    }

    fn idempotency_release(&self, hold: Hold) -> StoreFuture<bool> {
        let Hold { key, token } = hold;
        let write = self.0.idempotency_release(Hold::new(key, token));
        Box::pin(async move {
            tokio::time::sleep(SLOW_WRITE).await;
            write.await
        })
    }

    fn idempotency_extend(
        &self,
        hold: Hold,
        lease: Duration,
        deadline: tokio::time::Instant,
    ) -> StoreFuture<bool> {
        let Hold { key, token } = hold;
        self.0
            .idempotency_extend(Hold::new(key, token), lease, deadline)
    }
}

/// Read-your-writes: once the first caller has its whole answer, a retry with the same key is
/// the replay (or, after a failure, runs again) — not a 409 because the record is still being
/// written or the key still being released. The store's writes take 50 ms here (see
/// [`SlowWrites`]), which makes a premature end of the body show every time rather than now and
/// then under load.
#[tokio::test(flavor = "multi_thread")]
async fn a_retry_right_after_the_answer_is_a_replay() {
    let server = RedisServer::start();
    let calls = Calls::default();
    let layer = IdempotencyLayer::builder(SlowWrites(server.store()))
        .unscoped()
        .build()
        .unwrap();
    // The request body says what to answer: a small body, 512 KiB, or a 500.
    let svc = stack(
        &layer,
        handler(&calls, |run, _parts: Parts, req_body: Bytes| async move {
            let (status, len) = match &req_body[..] {
                b"big" => (StatusCode::OK, 512 * 1024),
                b"fail" => (StatusCode::INTERNAL_SERVER_ERROR, 16),
                _ => (StatusCode::OK, 16),
            };
            let mut data = format!("run {run:08} ").into_bytes();
            data.resize(len, b'.');
            Ok(Response::builder().status(status).body(body(data)).unwrap())
        }),
    );
    let mut conflicts = Vec::new();
    for kind in ["small", "big", "fail"] {
        let key = format!("ryw-{kind}");
        let first = send(&svc, request(Method::POST, "/o", Some(&key), &[], kind)).await;
        assert!(!first.replayed());
        let retry = send(&svc, request(Method::POST, "/o", Some(&key), &[], kind)).await;
        if retry.status == StatusCode::CONFLICT {
            conflicts.push(key);
        } else if kind == "fail" {
            assert_eq!(retry.status, StatusCode::INTERNAL_SERVER_ERROR);
            assert!(!retry.replayed(), "a failure was stored");
        } else {
            assert_replay_of(&retry, &first);
        }
    }
    assert!(
        conflicts.is_empty(),
        "retries sent right after the first answer ended got 409: {conflicts:?}"
    );
    assert_eq!(calls.get(), 4);
}

/// The same for a response body that fails midway: the caller sees the error, and its retry runs
/// the handler again at once — the key must be released before the error reaches the caller.
#[tokio::test(flavor = "multi_thread")]
async fn a_retry_right_after_a_broken_body_runs_again() {
    let server = RedisServer::start();
    let calls = Calls::default();
    let layer = IdempotencyLayer::builder(SlowWrites(server.store()))
        .unscoped()
        .build()
        .unwrap();
    let svc = stack(
        &layer,
        handler(&calls, |run, _parts: Parts, _body: Bytes| async move {
            Ok(Response::new(frames(vec![
                Ok(Frame::data(Bytes::from(format!("run {run}")))),
                Err(Failure("the backend went away".into())),
            ])))
        }),
    );
    for run in 1..=2 {
        let res = svc.clone().oneshot(keyed("broken", "{}")).await.unwrap();
        assert_eq!(res.status(), StatusCode::OK, "run {run}: not a 409");
        assert!(res.headers().get(REPLAYED).is_none());
        let err = res.into_body().collect().await.expect_err("the body fails");
        assert_eq!(err.to_string(), "the backend went away");
    }
    assert_eq!(calls.get(), 2);
}

/// A handler whose response body panics while it streams: the first caller must not take the
/// truncated body for a complete one, and the key must be released (a retry runs again) rather
/// than held until the lease runs out.
#[tokio::test(flavor = "multi_thread")]
async fn a_panic_while_the_body_streams_releases_the_key() {
    let server = RedisServer::start();
    let calls = Calls::default();
    let svc = stack(
        &default_layer(&server),
        handler(&calls, |run, _parts: Parts, _body: Bytes| async move {
            let chunks = stream::unfold(0, move |i| async move {
                match i {
                    0 => Some((Ok(Frame::data(Bytes::from_static(b"part"))), 1)),
                    1 if run == 1 => panic!("deliberate panic in the response body"),
                    1 => Some((Ok(Frame::data(Bytes::from_static(b" and rest"))), 2)),
                    _ => None,
                }
            });
            Ok(Response::new(StreamBody::new(chunks).boxed_unsync()))
        }),
    );
    let res = svc
        .clone()
        .oneshot(keyed("body-panic", "{}"))
        .await
        .unwrap();
    let read = tokio::time::timeout(Duration::from_secs(5), res.into_body().collect())
        .await
        .expect("no hang");
    assert!(
        read.is_err(),
        "a body cut short by a panic ended as if complete: {:?}",
        read.map(|c| c.to_bytes())
    );
    let retry = send(&svc, keyed("body-panic", "{}")).await;
    assert_eq!(
        retry.status,
        StatusCode::OK,
        "the retry after a panic got {}: {:?}",
        retry.status,
        retry.text()
    );
    assert_eq!(retry.body, "part and rest");
    assert_eq!(calls.get(), 2);
}

// ---------------------------------------------------------------------------------------------
// Disconnects, leases, takeover
// ---------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread")]
async fn a_client_that_goes_away_still_gets_the_replay_on_retry() {
    let server = RedisServer::start();
    let calls = Calls::default();
    let svc = stack(
        &default_layer(&server),
        order(&calls, Duration::from_millis(1000)),
    );
    // The client goes away once the handler has begun.
    tokio::select! {
        answer = svc.clone().oneshot(keyed("dc-1", "{\"pay\":1}")) => {
            panic!("answered before the client gave up: {:?}", answer.map(|r| r.status()))
        }
        () = calls.reached(1) => {}
    }
    // The orphaned run still holds the key.
    let during = send(&svc, keyed("dc-1", "{\"pay\":1}")).await;
    assert_eq!(during.status, StatusCode::CONFLICT);

    let retry = once_settled(&svc, || keyed("dc-1", "{\"pay\":1}")).await;
    assert_eq!(retry.status, StatusCode::CREATED);
    assert!(retry.replayed(), "the orphaned run's response was stored");
    assert_eq!(retry.json()["run"], 1);
    assert_eq!(retry.json()["echo"], "{\"pay\":1}");
    assert_eq!(calls.get(), 1, "the handler ran exactly once");
}

#[tokio::test(flavor = "multi_thread")]
async fn the_lease_is_kept_alive_while_the_handler_runs() {
    let server = RedisServer::start();
    let calls = Calls::default();
    let layer = IdempotencyLayer::builder(server.store())
        .unscoped()
        .lease(Duration::from_secs(1))
        .build()
        .unwrap();
    let svc = stack(&layer, order(&calls, Duration::from_secs(4)));
    let first = tokio::spawn({
        let svc = svc.clone();
        async move { send(&svc, keyed("lease-1", "{}")).await }
    });
    calls.reached(1).await;
    // Well past the 1 s lease: the claim is still held (extended), and never for long.
    for _ in 0..3 {
        tokio::time::sleep(Duration::from_millis(800)).await;
        let keys = redis_keys(&server);
        assert_eq!(keys.len(), 1, "{keys:?}");
        assert!(keys[0].1 > 0 && keys[0].1 <= 1000, "{keys:?}");
        let dup = send(&svc, keyed("lease-1", "{}")).await;
        assert_eq!(dup.status, StatusCode::CONFLICT);
    }
    let first = first.await.unwrap();
    assert_eq!(first.status, StatusCode::CREATED);
    assert_replay_of(&send(&svc, keyed("lease-1", "{}")).await, &first);
    assert_eq!(calls.get(), 1);
}

/// A crashed copy's claim expires after its lease; its late completion, extension or release
/// is refused by token, and the new owner's record stands.
async fn lease_takeover(store: impl Store) {
    let key = format!("t:idem:{{{}}}", unique("takeover"));
    let fp = "fingerprint-1".to_owned();
    let begin = |token: &str, lease_ms: u64| {
        store.idempotency_begin(
            BeginRequest::new(
                Hold::new(key.clone(), token.to_owned()),
                fp.clone(),
                Duration::from_millis(lease_ms),
            ),
            crate::common::soon(),
        )
    };
    assert_eq!(begin("A", 300).await.unwrap(), IdempotencyBegin::Claimed);
    match begin("X", 30_000).await.unwrap() {
        IdempotencyBegin::InFlight { lease_left } => {
            assert!(lease_left > Duration::ZERO && lease_left <= Duration::from_millis(300));
        }
        other => panic!("expected InFlight, got {other:?}"),
    }
    let other_fp = store
        .idempotency_begin(
            BeginRequest::new(
                Hold::new(key.clone(), "Y"),
                "fingerprint-2",
                Duration::from_secs(30),
            ),
            crate::common::soon(),
        )
        .await
        .unwrap();
    assert_eq!(other_fp, IdempotencyBegin::Mismatch);
    let lease = Duration::from_millis(300);
    assert!(
        !store
            .idempotency_extend(Hold::new(key.clone(), "B"), lease, crate::common::soon())
            .await
            .unwrap()
    );
    assert!(
        !store
            .idempotency_release(Hold::new(key.clone(), "B"))
            .await
            .unwrap()
    );
    assert!(
        !store
            .idempotency_complete(
                CompleteRequest::new(Hold::new(key.clone(), "B"), Bytes::from_static(b"x"), lease),
                crate::common::soon()
            )
            .await
            .unwrap()
    );
    assert!(matches!(
        begin("X", 30_000).await.unwrap(),
        IdempotencyBegin::InFlight { .. }
    ));

    // A "crashes": its lease runs out, B takes the key over.
    tokio::time::sleep(Duration::from_millis(400)).await;
    assert!(
        !store
            .idempotency_extend(Hold::new(key.clone(), "A"), lease, crate::common::soon())
            .await
            .unwrap()
    );
    assert_eq!(begin("B", 30_000).await.unwrap(), IdempotencyBegin::Claimed);
    let retention = Duration::from_secs(60);
    let a_bytes = Bytes::from_static(b"A's late response");
    let b_bytes = Bytes::from_static(b"B's response \x00\xff");
    assert!(
        !store
            .idempotency_complete(
                CompleteRequest::new(Hold::new(key.clone(), "A"), a_bytes, retention),
                crate::common::soon()
            )
            .await
            .unwrap(),
        "the stale owner cannot complete"
    );
    assert!(
        !store
            .idempotency_extend(Hold::new(key.clone(), "A"), lease, crate::common::soon())
            .await
            .unwrap()
    );
    assert!(
        !store
            .idempotency_release(Hold::new(key.clone(), "A"))
            .await
            .unwrap()
    );
    assert!(matches!(
        begin("C", 30_000).await.unwrap(),
        IdempotencyBegin::InFlight { .. }
    ));
    assert!(
        store
            .idempotency_complete(
                CompleteRequest::new(Hold::new(key.clone(), "B"), b_bytes.clone(), retention),
                crate::common::soon()
            )
            .await
            .unwrap()
    );
    assert_eq!(
        begin("C", 30_000).await.unwrap(),
        IdempotencyBegin::Completed(b_bytes.clone())
    );
    // A completed record belongs to no one: no release, extension or second completion.
    assert!(
        !store
            .idempotency_release(Hold::new(key.clone(), "B"))
            .await
            .unwrap()
    );
    assert!(
        !store
            .idempotency_extend(Hold::new(key.clone(), "B"), lease, crate::common::soon())
            .await
            .unwrap()
    );
    assert!(
        !store
            .idempotency_complete(
                CompleteRequest::new(
                    Hold::new(key.clone(), "B"),
                    Bytes::from_static(b"again"),
                    retention
                ),
                crate::common::soon()
            )
            .await
            .unwrap()
    );
    assert_eq!(
        begin("D", 30_000).await.unwrap(),
        IdempotencyBegin::Completed(b_bytes)
    );
    let mismatch = store
        .idempotency_begin(
            BeginRequest::new(Hold::new(key.clone(), "E"), "fingerprint-2", lease),
            crate::common::soon(),
        )
        .await
        .unwrap();
    assert_eq!(mismatch, IdempotencyBegin::Mismatch);
}

#[tokio::test(flavor = "multi_thread")]
async fn an_expired_lease_is_taken_over_and_the_stale_owner_refused_redis() {
    let server = RedisServer::start();
    lease_takeover(server.store()).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn an_expired_lease_is_taken_over_and_the_stale_owner_refused_memory() {
    lease_takeover(MemoryStore::new()).await;
}

// ---------------------------------------------------------------------------------------------
// Store failures
// ---------------------------------------------------------------------------------------------

/// Polls with fresh keys until a keyed request succeeds; how long that took.
async fn until_served(svc: &Svc, calls: &Calls, what: &str) -> Duration {
    let started = Instant::now();
    loop {
        let before = calls.get();
        let a = send(svc, keyed(&unique("probe"), "{}")).await;
        if a.status == StatusCode::CREATED {
            assert_eq!(calls.get(), before + 1);
            return started.elapsed();
        }
        assert_eq!(a.status, StatusCode::SERVICE_UNAVAILABLE, "{what}");
        assert_eq!(calls.get(), before, "{what}: a 503 never runs the handler");
        assert!(
            started.elapsed() < Duration::from_secs(8),
            "{what}: still unavailable after 8 s"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn an_unavailable_store_fails_closed_with_503() {
    let mut server = RedisServer::start();
    let calls = Calls::default();
    let timeout = server.store().timeout();
    let svc = stack(&default_layer(&server), order(&calls, Duration::ZERO));
    assert_eq!(
        send(&svc, keyed("warm", "{}")).await.status,
        StatusCode::CREATED
    );
    assert_eq!(calls.get(), 1);

    // Killed.
    server.kill();
    for i in 0..3 {
        let started = Instant::now();
        let a = send(&svc, keyed(&format!("down-{i}"), "{}")).await;
        assert_eq!(a.status, StatusCode::SERVICE_UNAVAILABLE);
        assert!(a.retry_after() >= 1);
        assert!(a.text().contains("not processed"), "{:?}", a.text());
        assert!(started.elapsed() < timeout + Duration::from_secs(1));
    }
    assert_eq!(
        calls.get(),
        1,
        "the handler is not run while the store is down"
    );
    let get = send(
        &svc,
        request(Method::GET, "/orders", Some("down-0"), &[], ""),
    )
    .await;
    assert_eq!(
        get.status,
        StatusCode::CREATED,
        "uncovered requests still pass"
    );
    assert_eq!(calls.get(), 2);

    // Restarted: served again, without rebuilding anything.
    server.restart();
    let took = until_served(&svc, &calls, "after restart").await;
    assert!(took < Duration::from_secs(5), "took {took:?}");
    let replay = send(&svc, keyed("after-restart", "{}")).await;
    assert_eq!(replay.status, StatusCode::CREATED);

    // Frozen (SIGSTOP): 503 within the store timeout and a margin.
    server.pause();
    let before = calls.get();
    let started = Instant::now();
    let a = send(&svc, keyed("frozen", "{}")).await;
    let took = started.elapsed();
    server.resume();
    assert_eq!(a.status, StatusCode::SERVICE_UNAVAILABLE);
    assert!(a.retry_after() >= 1);
    assert!(
        took >= timeout.saturating_sub(Duration::from_millis(50))
            && took < timeout + Duration::from_millis(700),
        "took {took:?}"
    );
    assert_eq!(calls.get(), before);
    let took = until_served(&svc, &calls, "after resume").await;
    assert!(took < Duration::from_secs(5), "took {took:?}");
}

/// A claim sent just before the store froze is executed by Redis when it thaws, after the layer
/// has answered 503 (`Retry-After: 1`) without running the handler. The client's retry after
/// that second must run the request — not meet 409 for the whole lease (30 s by default) because
/// of a claim nobody owns.
#[tokio::test(flavor = "multi_thread")]
async fn a_store_timeout_leaves_no_claim_behind() {
    let server = RedisServer::start();
    let calls = Calls::default();
    let svc = stack(&default_layer(&server), order(&calls, Duration::ZERO));
    assert_eq!(
        send(&svc, keyed("warm", "{}")).await.status,
        StatusCode::CREATED
    );
    server.pause();
    let a = send(&svc, keyed("frozen-then-retried", "{}")).await;
    server.resume();
    assert_eq!(a.status, StatusCode::SERVICE_UNAVAILABLE);
    let retry_after = a.retry_after();
    assert_eq!(calls.get(), 1);
    tokio::time::sleep(Duration::from_secs(retry_after) + Duration::from_millis(100)).await;
    let retry = send(&svc, keyed("frozen-then-retried", "{}")).await;
    assert_eq!(
        retry.status,
        StatusCode::CREATED,
        "the retry {retry_after} s after the 503 got {}: {:?}",
        retry.status,
        retry.text()
    );
    assert!(!retry.replayed());
    assert_eq!(calls.get(), 2);
}

// ---------------------------------------------------------------------------------------------
// Scope, retention, keys
// ---------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread")]
async fn scopes_keep_callers_apart() {
    let server = RedisServer::start();
    let calls = Calls::default();
    let layer = IdempotencyLayer::builder(server.store())
        .scope(Header::from_static("x-api-key"))
        .build()
        .unwrap();
    let svc = stack(&layer, order(&calls, Duration::ZERO));
    let as_caller = |api_key: Option<&str>| {
        let headers: Vec<(&str, &str)> = api_key.map(|k| ("x-api-key", k)).into_iter().collect();
        request(Method::POST, "/orders", Some("shared-key"), &headers, "{}")
    };
    let alice = send(&svc, as_caller(Some("alice-secret"))).await;
    let bob = send(&svc, as_caller(Some("bob-secret"))).await;
    assert!(!alice.replayed() && !bob.replayed());
    assert_eq!(calls.get(), 2, "each caller's key is its own");
    assert_ne!(alice.id(), bob.id());
    assert_replay_of(&send(&svc, as_caller(Some("alice-secret"))).await, &alice);
    assert_replay_of(&send(&svc, as_caller(Some("bob-secret"))).await, &bob);
    // No scope at all is refused, not filed in a namespace every such request would share.
    let anonymous = send(&svc, as_caller(None)).await;
    assert_eq!(anonymous.status, StatusCode::BAD_REQUEST);
    assert!(!anonymous.replayed());
    assert_eq!(calls.get(), 2);

    // Two layers with different scopes on one server do not see each other's records either.
    let global = stack(&default_layer(&server), order(&calls, Duration::ZERO));
    let a = send(&global, as_caller(Some("alice-secret"))).await;
    assert!(!a.replayed());
    assert_eq!(calls.get(), 3);
}

#[tokio::test(flavor = "multi_thread")]
async fn records_expire_after_the_retention_and_keys_are_hashed() {
    let server = RedisServer::start();
    let calls = Calls::default();
    let layer = IdempotencyLayer::builder(server.store())
        .unscoped()
        .retention(Duration::from_millis(300))
        .build()
        .unwrap();
    let svc = stack(&layer, order(&calls, Duration::ZERO));
    let first = send(&svc, keyed("ret-1", "{}")).await;
    assert_replay_of(&send(&svc, keyed("ret-1", "{}")).await, &first);
    let keys = redis_keys(&server);
    assert_eq!(keys.len(), 1);
    assert!(keys[0].1 > 0 && keys[0].1 <= 300, "{keys:?}");
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(redis_keys(&server).is_empty(), "the record expired");
    let again = send(&svc, keyed("ret-1", "{}")).await;
    assert!(!again.replayed());
    assert_eq!(again.json()["run"], 2);
    assert_eq!(calls.get(), 2);

    // The keys written: hashed, namespaced, all with an expiry; neither the raw key nor the
    // scope appears in a key name or a stored value.
    let raw = "RAW-key-{evil}:*\\x";
    let secret = "SECRET-api-key-4711";
    let server = RedisServer::start();
    let scoped = IdempotencyLayer::builder(server.store())
        .scope(Header::from_static("x-api-key"))
        .build()
        .unwrap();
    let svc = stack(&scoped, order(&calls, Duration::from_millis(300)));
    let running = tokio::spawn({
        let svc = svc.clone();
        async move {
            send(
                &svc,
                request(
                    Method::POST,
                    "/o",
                    Some(raw),
                    &[("x-api-key", secret)],
                    "{}",
                ),
            )
            .await
        }
    });
    tokio::time::sleep(Duration::from_millis(100)).await;
    let mut seen = redis_keys(&server);
    running.await.unwrap();
    let long = "L".repeat(255);
    let a = send(
        &svc,
        request(
            Method::POST,
            "/o",
            Some(&long),
            &[("x-api-key", secret)],
            "{}",
        ),
    )
    .await;
    assert_eq!(a.status, StatusCode::CREATED);
    seen.extend(redis_keys(&server));
    assert_eq!(seen.len(), 3, "one in flight, then two completed: {seen:?}");
    let mut conn = server.conn();
    for (key, ttl) in &seen {
        assert!(*ttl > 0, "{key} has no expiry");
        assert!(*ttl <= 24 * 3600 * 1000, "{key}: {ttl} ms");
        let digest = key
            .strip_prefix("tollgate:idem:{")
            .and_then(|k| k.strip_suffix('}'))
            .unwrap_or_else(|| panic!("unexpected key {key:?}"));
        assert_eq!(digest.len(), 22, "{key}");
        assert!(
            digest
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_'),
            "{key}"
        );
        let values: Vec<Vec<u8>> = redis::cmd("HGETALL").arg(key).query(&mut conn).unwrap();
        for value in values {
            let value = String::from_utf8_lossy(&value);
            for forbidden in [raw, secret, long.as_str()] {
                assert!(!value.contains(forbidden), "{key} stores {forbidden:?}");
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// axum
// ---------------------------------------------------------------------------------------------

mod axum_app {
    use super::*;

    use axum::Json;
    use axum::Router;
    use axum::extract::State;
    use axum::routing::{get, post};

    async fn create(
        State(calls): State<Calls>,
        Json(order): Json<serde_json::Value>,
    ) -> (
        StatusCode,
        [(HeaderName, &'static str); 1],
        Json<serde_json::Value>,
    ) {
        let run = calls.hit();
        (
            StatusCode::CREATED,
            [(HeaderName::from_static("x-app"), "orders")],
            Json(serde_json::json!({"id": fresh_id(), "run": run, "order": order})),
        )
    }

    async fn health(State(calls): State<Calls>) -> String {
        format!("ok {}", calls.hit())
    }

    fn json_post(key: Option<&str>, json: &'static str) -> Request<axum::body::Body> {
        let mut builder = Request::post("/orders").header("content-type", "application/json");
        if let Some(key) = key {
            builder = builder.header("idempotency-key", key);
        }
        builder.body(axum::body::Body::from(json)).unwrap()
    }

    async fn call(router: &Router, req: Request<axum::body::Body>) -> Answer {
        let res = router.clone().oneshot(req).await.unwrap();
        let (parts, res_body) = res.into_parts();
        let collected = res_body.collect().await.unwrap();
        let trailers = collected.trailers().cloned();
        Answer {
            status: parts.status,
            headers: parts.headers,
            body: collected.to_bytes(),
            trailers,
        }
    }

    /// [`assert_replay_of`] under axum, which adds `content-length` to a response whose body
    /// size is known: the first answer's body keeps the handler's size, so both carry the same.
    fn assert_axum_replay_of(replay: &Answer, first: &Answer) {
        assert_eq!(
            first.headers[header::CONTENT_LENGTH],
            first.body.len().to_string()
        );
        assert_replay_of(replay, first);
    }

    /// The same behaviour under `Router::layer` and `Router::route_layer`.
    async fn exercise(router: &Router, calls: &Calls, prefix: &str) {
        let key = format!("{prefix}-1");
        let first = call(router, json_post(Some(&key), "{\"sku\":\"a\"}")).await;
        assert_eq!(first.status, StatusCode::CREATED);
        assert_eq!(first.headers["x-app"], "orders");
        assert_eq!(first.json()["order"]["sku"], "a");
        let runs = calls.get();
        let replay = call(router, json_post(Some(&key), "{\"sku\":\"a\"}")).await;
        assert_axum_replay_of(&replay, &first);
        let mismatch = call(router, json_post(Some(&key), "{\"sku\":\"b\"}")).await;
        assert_eq!(mismatch.status, StatusCode::UNPROCESSABLE_ENTITY);
        let bad = call(router, json_post(Some(""), "{}")).await;
        assert_eq!(bad.status, StatusCode::BAD_REQUEST);
        assert_eq!(calls.get(), runs);
        // keyless POST passes (not required), GET passes
        let keyless = call(router, json_post(None, "{}")).await;
        assert_eq!(keyless.status, StatusCode::CREATED);
        let health = call(
            router,
            Request::get("/health")
                .body(axum::body::Body::empty())
                .unwrap(),
        )
        .await;
        assert_eq!(health.status, StatusCode::OK);
        assert_eq!(calls.get(), runs + 2);
        // A 4xx of axum's own (no JSON content type) is a stored result too.
        let key = format!("{prefix}-2");
        let rejected = call(
            router,
            Request::post("/orders")
                .header("idempotency-key", key.as_str())
                .body(axum::body::Body::from("{}"))
                .unwrap(),
        )
        .await;
        assert_eq!(rejected.status, StatusCode::UNSUPPORTED_MEDIA_TYPE);
        let again = call(
            router,
            Request::post("/orders")
                .header("idempotency-key", key.as_str())
                .body(axum::body::Body::from("{}"))
                .unwrap(),
        )
        .await;
        assert_axum_replay_of(&again, &rejected);
    }

    #[tokio::test(flavor = "multi_thread")]
    async fn axum_router_layer_and_route_layer() {
        let server = RedisServer::start();
        let calls = Calls::default();
        let layer = IdempotencyLayer::builder(server.store())
            .unscoped()
            .build()
            .unwrap();

        let router = Router::new()
            .route("/orders", post(create))
            .route("/health", get(health))
            .with_state(calls.clone())
            .layer(layer.clone());
        exercise(&router, &calls, "layer").await;

        let router = Router::new()
            .route("/orders", post(create))
            .route("/health", get(health))
            .route_layer(layer.clone())
            .with_state(calls.clone());
        exercise(&router, &calls, "route-layer").await;
        // route_layer leaves unmatched routes alone: a 404, not a 400 for the missing key
        let required = IdempotencyLayer::builder(server.store())
            .unscoped()
            .required(true)
            .build()
            .unwrap();
        let router = Router::new()
            .route("/orders", post(create))
            .route_layer(required)
            .with_state(calls.clone());
        let missing = call(
            &router,
            Request::post("/nowhere")
                .body(axum::body::Body::empty())
                .unwrap(),
        )
        .await;
        assert_eq!(missing.status, StatusCode::NOT_FOUND);
        let keyless = call(&router, json_post(None, "{}")).await;
        assert_eq!(keyless.status, StatusCode::BAD_REQUEST);
    }

    #[tokio::test(flavor = "multi_thread")]
    async fn axum_server_replays_over_tcp() {
        use hyper_util::client::legacy::Client;
        use hyper_util::rt::TokioExecutor;

        let server = RedisServer::start();
        let calls = Calls::default();
        let layer = IdempotencyLayer::builder(server.store())
            .unscoped()
            .build()
            .unwrap();
        let router = Router::new()
            .route("/orders", post(create))
            .with_state(calls.clone())
            .layer(layer);
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move { axum::serve(listener, router).await });

        let client = Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();
        let post_order = || {
            Request::post(format!("http://{addr}/orders"))
                .header("content-type", "application/json")
                .header("idempotency-key", "tcp-1")
                .body(Full::new(Bytes::from_static(b"{\"sku\":\"tcp\"}")))
                .unwrap()
        };
        let mut answers = Vec::new();
        for _ in 0..2 {
            let res = client.request(post_order()).await.unwrap();
            let (parts, res_body) = res.into_parts();
            answers.push((
                parts.status,
                parts.headers,
                res_body.collect().await.unwrap().to_bytes(),
            ));
        }
        let (first, replay) = (&answers[0], &answers[1]);
        assert_eq!(first.0, StatusCode::CREATED);
        assert!(first.1.get(REPLAYED).is_none());
        assert_eq!(replay.0, StatusCode::CREATED);
        assert_eq!(replay.1[REPLAYED], "true");
        assert_eq!(replay.1["x-app"], "orders");
        assert_eq!(replay.2, first.2);
        assert_eq!(calls.get(), 1);
    }
}

/// The scope is a choice: a layer without `.scope(..)` or `.unscoped()` does not build.
#[test]
fn the_scope_must_be_chosen() {
    let error = IdempotencyLayer::builder(MemoryStore::new())
        .build()
        .unwrap_err();
    assert_eq!(error.kind(), tollgate::ConfigErrorKind::Scope);
    assert!(error.to_string().contains(".unscoped()"), "{error}");
    assert!(
        IdempotencyLayer::builder(MemoryStore::new())
            .unscoped()
            .build()
            .is_ok()
    );
}

/// Headers named sensitive are never stored, so a replay never carries them.
#[tokio::test(flavor = "multi_thread")]
async fn sensitive_headers_are_never_replayed() {
    let server = RedisServer::start();
    let calls = Calls::default();
    let layer = IdempotencyLayer::builder(server.store())
        .unscoped()
        .unstored_headers([HeaderName::from_static("x-run")])
        .build()
        .unwrap();
    let svc = stack(&layer, order(&calls, Duration::ZERO));
    let first = send(&svc, keyed("sensitive", "{}")).await;
    assert!(first.headers.contains_key("x-run"));
    let replay = send(&svc, keyed("sensitive", "{}")).await;
    assert!(replay.replayed());
    assert!(
        !replay.headers.contains_key("x-run"),
        "a sensitive header was replayed"
    );
    assert!(!replay.headers.contains_key(header::SET_COOKIE));
    assert_eq!(replay.headers["x-bin"].as_bytes(), b"\x80\xff");
    assert_eq!(calls.get(), 1);
}

/// A `store_when` that panics is a failed handler: 500, the key released, a retry runs again.
#[tokio::test(flavor = "multi_thread")]
async fn a_panicking_store_when_releases_the_key() {
    let server = RedisServer::start();
    let calls = Calls::default();
    let panicked = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let once = Arc::clone(&panicked);
    let layer = IdempotencyLayer::builder(server.store())
        .unscoped()
        .store_when(move |_status| {
            if !once.swap(true, std::sync::atomic::Ordering::SeqCst) {
                panic!("a predicate that panics");
            }
            true
        })
        .build()
        .unwrap();
    let svc = stack(&layer, order(&calls, Duration::ZERO));
    let first = send(&svc, keyed("predicate", "{}")).await;
    assert_eq!(first.status, StatusCode::INTERNAL_SERVER_ERROR);
    assert!(panicked.load(std::sync::atomic::Ordering::SeqCst));
    let retry = send(&svc, keyed("predicate", "{}")).await;
    assert_eq!(
        retry.status,
        StatusCode::CREATED,
        "the key was released: the retry runs"
    );
    assert!(!retry.replayed());
    assert_eq!(calls.get(), 2);
    assert_replay_of(&send(&svc, keyed("predicate", "{}")).await, &retry);
}

/// A request body that arrives as the test sends it: a slow upload.
struct Upload(mpsc::Receiver<Bytes>);

impl http_body::Body for Upload {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        self.0
            .poll_recv(cx)
            .map(|chunk| chunk.map(|c| Ok(Frame::data(c))))
    }
}

/// A keyed `POST /orders` whose body the returned sender delivers, chunk by chunk.
fn uploading(key: &str) -> (Request<ReqBody>, mpsc::Sender<Bytes>) {
    let (tx, rx) = mpsc::channel(4);
    let body = http_body_util::BodyExt::boxed_unsync(Upload(rx));
    let req = Request::post("/orders")
        .header("idempotency-key", key)
        .body(body)
        .unwrap();
    (req, tx)
}

/// The inner service's concurrency permit is taken for the call, not while a slow client
/// uploads its body: behind a limit of one, a second request is served meanwhile.
#[tokio::test(flavor = "multi_thread")]
async fn a_slow_upload_holds_no_permit_of_the_inner_service() {
    let server = RedisServer::start();
    let calls = Calls::default();
    let layer = IdempotencyLayer::builder(server.store())
        .unscoped()
        .build()
        .unwrap();
    let limited = tower::ServiceBuilder::new()
        .layer(layer)
        .concurrency_limit(1)
        .service_fn(order(&calls, Duration::ZERO));
    let svc: Svc = BoxCloneService::new(limited);
    let (slow, upload) = uploading(&unique("slow"));
    let slow = tokio::spawn(send(&svc, slow));
    upload
        .send(Bytes::from_static(b"{\"part\":"))
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(50)).await;
    let fast = tokio::time::timeout(
        Duration::from_secs(5),
        send(&svc, keyed(&unique("fast"), "{}")),
    )
    .await
    .expect("a second request waited for the slow upload's permit");
    assert_eq!(fast.status, StatusCode::CREATED);
    upload.send(Bytes::from_static(b"1}")).await.unwrap();
    drop(upload);
    assert_eq!(slow.await.unwrap().status, StatusCode::CREATED);
    assert_eq!(calls.get(), 2);
}

/// Bodies buffered across requests share one budget: past it, a request gets 503 and
/// Retry-After, and is served once the budget frees.
#[tokio::test(flavor = "multi_thread")]
async fn buffered_bodies_share_one_budget() {
    let server = RedisServer::start();
    let calls = Calls::default();
    let layer = IdempotencyLayer::builder(server.store())
        .unscoped()
        .max_buffered(10)
        .build()
        .unwrap();
    let svc = stack(&layer, order(&calls, Duration::ZERO));
    let (slow, upload) = uploading(&unique("holding"));
    let slow = tokio::spawn(send(&svc, slow));
    upload.send(Bytes::from_static(b"{\"a\":12")).await.unwrap(); // 7 bytes held
    common::wait_for("the layer read the upload", || {
        upload.capacity() == upload.max_capacity()
    })
    .await;
    let key = unique("refused");
    let refused = send(&svc, keyed(&key, "{\"b\":1}")).await; // 7 more: over 10
    assert_eq!(refused.status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(refused.headers["retry-after"], "1");
    upload.send(Bytes::from_static(b"}")).await.unwrap();
    drop(upload);
    assert_eq!(slow.await.unwrap().status, StatusCode::CREATED);
    let served = send(&svc, keyed(&key, "{\"b\":1}")).await;
    assert_eq!(
        served.status,
        StatusCode::CREATED,
        "the budget was given back"
    );
    assert_eq!(calls.get(), 2);
}

/// The handler runs in a task of its own, but in the caller's span: the fields of a
/// `TraceLayer` span stay on the handler's events.
#[test]
fn the_handler_runs_in_the_callers_span() {
    use tracing::Instrument;
    let subscriber = tracing_subscriber::fmt()
        .with_writer(std::io::sink)
        .finish();
    let _default = tracing::subscriber::set_default(subscriber);
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let seen = Arc::new(std::sync::Mutex::new(None::<String>));
    let layer = IdempotencyLayer::builder(MemoryStore::new())
        .unscoped()
        .build()
        .unwrap();
    let record = Arc::clone(&seen);
    let svc = layer.layer(tower::service_fn(move |_req: Inner| {
        let span = tracing::Span::current();
        *record.lock().unwrap() = span.metadata().map(|m| m.name().to_owned());
        async { Ok::<_, Failure>(Response::new(body("ok"))) }
    }));
    runtime.block_on(async {
        let span = tracing::info_span!("http-request");
        let answer = svc
            .oneshot(keyed("traced", "{}"))
            .instrument(span)
            .await
            .unwrap();
        assert_eq!(answer.status(), StatusCode::OK);
    });
    assert_eq!(seen.lock().unwrap().as_deref(), Some("http-request"));
}

/// A custom rejection builds every refusal's HTTP response from why it was refused — a bad key
/// (400), a body over the limit (413), a duplicate in flight (409), a reused key (422) and a
/// store that is down (503) — with `Retry-After` added where a retry may succeed; gRPC calls keep
/// their trailers-only status.
#[tokio::test(flavor = "multi_thread")]
async fn a_custom_rejection_shapes_every_refusal() {
    let mut server = RedisServer::start();
    let calls = Calls::default();
    let layer = IdempotencyLayer::builder(server.store())
        .unscoped()
        .required(true)
        .body_limit(16)
        .rejection(|why| {
            let body = serde_json::json!({
                "error": why.code(),
                "message": why.detail(),
                "retry_in": why.retry_after().map(|d| d.as_secs()),
            });
            Response::builder()
                .status(why.status())
                .header(header::CONTENT_TYPE, "application/vnd.shop.error+json")
                .body(Bytes::from(body.to_string()))
                .unwrap()
        })
        .build()
        .unwrap();
    let (release, gate) = tokio::sync::watch::channel(false);
    let svc = stack(
        &layer,
        handler(&calls, move |_, _, _| {
            let mut gate = gate.clone();
            async move {
                let _ = gate.wait_for(|open| *open).await;
                Ok(Response::new(body("done")))
            }
        }),
    );
    let check = |a: &Answer, status: StatusCode, code: &str, retry: Option<u64>| {
        assert_eq!(a.status, status, "{code}");
        assert_eq!(a.headers["content-type"], "application/vnd.shop.error+json");
        let json = a.json();
        assert_eq!(json["error"], code);
        assert_eq!(json["retry_in"], serde_json::json!(retry), "{code}");
        assert!(json["message"].as_str().unwrap().len() > 10, "{code}");
        assert_eq!(
            a.headers
                .get(header::RETRY_AFTER)
                .map(|v| v.to_str().unwrap()),
            retry.map(|s| s.to_string()).as_deref(),
            "{code}"
        );
    };

    let unkeyed = send(&svc, request(Method::POST, "/orders", None, &[], "{}")).await;
    check(&unkeyed, StatusCode::BAD_REQUEST, "invalid_key", None);
    assert_eq!(
        unkeyed.json()["message"],
        "the Idempotency-Key header is required"
    );
    let large = send(&svc, keyed("big", "a body longer than sixteen bytes")).await;
    check(
        &large,
        StatusCode::PAYLOAD_TOO_LARGE,
        "body_too_large",
        None,
    );

    let key = unique("custom");
    let first = tokio::spawn(send(
        &svc,
        request(Method::POST, "/orders", Some(&key), &[], "{}"),
    ));
    // the first request holds the key once its handler runs (and waits at the gate)
    let deadline = Instant::now() + Duration::from_secs(10);
    while calls.get() == 0 {
        assert!(Instant::now() < deadline, "the first request never ran");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let running = send(
        &svc,
        request(Method::POST, "/orders", Some(&key), &[], "{}"),
    )
    .await;
    check(&running, StatusCode::CONFLICT, "in_flight", Some(1));
    release.send(true).unwrap();
    assert_eq!(first.await.unwrap().status, StatusCode::OK);
    let reused = send(
        &svc,
        request(Method::POST, "/orders", Some(&key), &[], "{\"x\":1}"),
    )
    .await;
    check(&reused, StatusCode::UNPROCESSABLE_ENTITY, "mismatch", None);

    let grpc = send(&svc, grpc_request("big", b"a message longer than sixteen")).await;
    assert_eq!(grpc.status, StatusCode::OK);
    assert_eq!(
        grpc.headers["grpc-status"], "8",
        "RESOURCE_EXHAUSTED, trailers-only"
    );

    server.kill();
    let down = send(&svc, keyed(&unique("down"), "{}")).await;
    check(
        &down,
        StatusCode::SERVICE_UNAVAILABLE,
        "store_unavailable",
        Some(1),
    );
    assert_eq!(calls.get(), 1, "only the first keyed request ran");
}

/// A layer reading its key from another header names that header in every refusal that speaks
/// of the key (a webhook's `webhook-id`), never `Idempotency-Key`.
#[tokio::test(flavor = "multi_thread")]
async fn a_configured_key_header_is_named_in_its_refusals() {
    let calls = Calls::default();
    let layer = IdempotencyLayer::builder(MemoryStore::new())
        .unscoped()
        .header(HeaderName::from_static("webhook-id"))
        .required(true)
        .build()
        .unwrap();
    let svc = stack(&layer, order(&calls, Duration::ZERO));
    let detail = |a: &Answer| {
        let problem: serde_json::Value = serde_json::from_str(&a.text()).unwrap();
        problem["detail"].as_str().unwrap().to_owned()
    };
    let unkeyed = send(&svc, request(Method::POST, "/hooks", None, &[], "{}")).await;
    assert_eq!(unkeyed.status, StatusCode::BAD_REQUEST);
    assert_eq!(detail(&unkeyed), "the webhook-id header is required");
    let hook = |body: &'static str| {
        request(
            Method::POST,
            "/hooks",
            None,
            &[("webhook-id", "msg_1")],
            body,
        )
    };
    assert_eq!(
        send(&svc, hook("{\"a\":1}")).await.status,
        StatusCode::CREATED
    );
    let other = send(&svc, hook("{\"a\":2}")).await;
    assert_eq!(other.status, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(
        detail(&other),
        "this webhook-id was used with a different request"
    );
    let empty = send(
        &svc,
        request(Method::POST, "/hooks", None, &[("webhook-id", "")], "{}"),
    )
    .await;
    assert_eq!(empty.status, StatusCode::BAD_REQUEST);
    assert_eq!(detail(&empty), "the webhook-id is empty");
    assert_eq!(calls.get(), 1, "only the first delivery ran");
}
