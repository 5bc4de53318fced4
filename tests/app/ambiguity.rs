//! Ambiguous store answers, as users of the example app (`examples/app`) meet them: a write that
//! ran but whose reply came too late, a store that died while a handler ran, a connection that
//! went dark without closing. In each, what a client was told must match what the store keeps:
//! a coupon is redeemed exactly once, a payment reported as done is replayed and never run again,
//! and a dead connection is replaced rather than waited on forever.
//!
//! The app runs in-process (as in `app.rs`) on real redis-server processes, its store
//! reaching Redis through the test's [`Proxy`].
//!
//! The silenced-connection test has a Cluster variant: its nodes announce the ports of proxies
//! in front of them (`--cluster-announce-port`), so that every connection the cluster client
//! opens, to any node, runs through a proxy the test can silence.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use crate::common;
use crate::router as app;

use std::collections::BTreeSet;
use std::fmt;
use std::sync::Arc;
use std::time::{Duration, Instant};

use app::{AppConfig, AppState};
use axum::Router;
use axum::body::Body;
use bytes::{Bytes, BytesMut};
use common::RedisServer;
use common::proxy::Proxy;
use http::{Request, StatusCode};
use http_body_util::BodyExt;
use serde_json::Value;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tollgate::store::{RedisStore, Store};
use tower::ServiceExt;

/// The store timeout of every copy of the app in these tests.
const STORE_TIMEOUT: Duration = Duration::from_millis(250);

/// How long any one request may take before the test gives up on it (no test hangs).
const REQUEST_BOUND: Duration = Duration::from_secs(10);

// ---------------------------------------------------------------------------------------------
// helpers
// ---------------------------------------------------------------------------------------------

fn config(payment_delay: Duration) -> AppConfig {
    AppConfig {
        limits: app::parse_limits("burst:1000/1s").unwrap(),
        payment_delay,
        api_keys: crate::own_keys(&["merchant-1"]),
        ..AppConfig::defaults().unwrap()
    }
}

/// One copy of the app with a store of its own (its own connection), reaching Redis through
/// `proxy`.
fn copy_through(proxy: &Proxy, payment_delay: Duration) -> Router {
    let store = RedisStore::builder(proxy.url())
        .timeout(STORE_TIMEOUT)
        .build()
        .unwrap();
    let store: Arc<dyn Store> = Arc::new(store);
    app::router(AppState::new(store, config(payment_delay)).unwrap())
}

/// A copy of the app that reaches Redis directly with a patient store (5 s): it checks what the
/// store keeps once the faults are over, where a slow answer on a loaded machine must not read
/// as a wrong one.
fn verifier(server: &RedisServer) -> Router {
    let store = RedisStore::builder(server.url())
        .timeout(Duration::from_secs(5))
        .build()
        .unwrap();
    let store: Arc<dyn Store> = Arc::new(store);
    app::router(AppState::new(store, config(Duration::ZERO)).unwrap())
}

/// Warms `copy` up: redeems fresh coupons until one succeeds (its connection is open and the
/// claim script loaded), for at most 10 s.
async fn warm_up(copy: &Router) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let warm = send(copy.clone(), redeem(&unique("warm"))).await;
        if warm.status == StatusCode::OK {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "setup: a copy could not redeem a fresh coupon for 10 s: {warm}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// What a client got: the head, the body as far as it came, and how the body ended.
#[derive(Debug, Clone)]
struct Answer {
    status: StatusCode,
    replayed: bool,
    body: Bytes,
    /// `None`: the body ended normally; else why it did not.
    body_error: Option<String>,
}

impl Answer {
    /// The payment id in the body, complete or not.
    fn id(&self) -> Option<String> {
        let json: Value = serde_json::from_slice(&self.body).ok()?;
        json["id"].as_str().map(str::to_owned)
    }

    /// The payment id of a complete success: a `201` whose body ended normally.
    fn success_id(&self) -> Option<String> {
        if self.status == StatusCode::CREATED && self.body_error.is_none() {
            self.id()
        } else {
            None
        }
    }
}

impl fmt::Display for Answer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.status.as_u16())?;
        if self.replayed {
            write!(f, " (replayed)")?;
        }
        write!(f, " {}", String::from_utf8_lossy(&self.body))?;
        if let Some(error) = &self.body_error {
            write!(f, " [body failed: {error}]")?;
        }
        Ok(())
    }
}

/// Sends `request` to `app` and reads the whole answer, frame by frame, so that a body that
/// fails keeps what came before its error. Panics when no head comes within [`REQUEST_BOUND`].
async fn send(app: Router, request: Request<Body>) -> Answer {
    let what = format!("{} {}", request.method(), request.uri());
    let response = tokio::time::timeout(REQUEST_BOUND, app.oneshot(request))
        .await
        .unwrap_or_else(|_| panic!("{what}: no response within {REQUEST_BOUND:?}"))
        .unwrap();
    let status = response.status();
    let replayed = response
        .headers()
        .get("idempotent-replayed")
        .is_some_and(|v| v == "true");
    let mut body = response.into_body();
    let mut data = BytesMut::new();
    let read = async {
        loop {
            match body.frame().await {
                None => return None,
                Some(Ok(frame)) => {
                    if let Some(chunk) = frame.data_ref() {
                        data.extend_from_slice(chunk);
                    }
                }
                Some(Err(error)) => return Some(error.to_string()),
            }
        }
    };
    let body_error = tokio::time::timeout(REQUEST_BOUND, read)
        .await
        .unwrap_or_else(|_| Some(format!("the body did not end within {REQUEST_BOUND:?}")));
    Answer {
        status,
        replayed,
        body: data.freeze(),
        body_error,
    }
}

fn redeem(code: &str) -> Request<Body> {
    Request::post(format!("/coupons/{code}/redeem"))
        .body(Body::empty())
        .unwrap()
}

const PAYMENT: &str = r#"{"amount": 1999, "currency": "EUR"}"#;

fn pay(key: &str) -> Request<Body> {
    Request::post("/payments")
        .header("content-type", "application/json")
        .header("x-api-key", "merchant-1")
        .header("idempotency-key", key)
        .body(Body::from(PAYMENT))
        .unwrap()
}

fn unique(prefix: &str) -> String {
    format!("{prefix}-{:08x}", rand::random::<u32>())
}

/// A raw RESP `PING` on `conn`: whether `+PONG` came back within `wait`.
async fn pings(conn: &mut TcpStream, wait: Duration) -> bool {
    if conn.write_all(b"PING\r\n").await.is_err() {
        return false;
    }
    let mut buf = [0u8; 7];
    matches!(
        tokio::time::timeout(wait, conn.read_exact(&mut buf)).await,
        Ok(Ok(_)) if &buf == b"+PONG\r\n"
    )
}

// ---------------------------------------------------------------------------------------------
// a) a claim that ran, answered too late
// ---------------------------------------------------------------------------------------------

/// The store ran the redemption's claim, but its reply came after the store timeout: the client
/// was told `503`, so that claim must not keep the coupon. Once the store answers, the claim is
/// undone in the background, a retry redeems the coupon, and from then on every redemption (on
/// either copy) is `409`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_late_answered_coupon_redeems_exactly_once() {
    let server = RedisServer::start();
    let proxy = Proxy::start(server.addr()).await;
    let copies = [
        copy_through(&proxy, app::DEFAULT_PAYMENT_DELAY),
        copy_through(&proxy, app::DEFAULT_PAYMENT_DELAY),
    ];
    // Warm up: each copy connects and the claim script is loaded, so that the delayed
    // redemption below is one command that reaches Redis at once (a connection handshake or a
    // NOSCRIPT round trip under the delay would time out before the claim is even sent).
    for copy in &copies {
        warm_up(copy).await;
    }
    let commands = common::monitor(server.addr()).await;
    let mark = commands.lock().unwrap().len();

    let code = unique("C");
    let mut log: Vec<(String, StatusCode)> = Vec::new();
    proxy.delay_replies(Duration::from_millis(400));
    let started = Instant::now();
    let first = send(copies[0].clone(), redeem(&code)).await;
    let took = started.elapsed();
    log.push(("first (replies 400 ms late)".to_owned(), first.status));
    assert_eq!(
        first.status,
        StatusCode::SERVICE_UNAVAILABLE,
        "the store's reply came 400 ms late with a {STORE_TIMEOUT:?} timeout, yet the \
         redemption was answered {first} after {took:?}"
    );
    assert!(
        took < Duration::from_millis(1500),
        "the 503 took {took:?}: the store timeout is {STORE_TIMEOUT:?}"
    );
    // The claim did reach Redis and run: this is the ambiguous case, not a request never sent.
    let deadline = Instant::now() + Duration::from_secs(2);
    while !commands.lock().unwrap()[mark..].contains(":claim:") {
        assert!(
            Instant::now() < deadline,
            "setup: the timed-out redemption never reached Redis (MONITOR saw no claim \
             command), so this test would prove nothing: {:?}",
            &commands.lock().unwrap()[mark..]
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    proxy.delay_replies(Duration::ZERO);

    // Retry, as the client told 503 would, until the coupon is redeemed.
    let retrying = Instant::now();
    let mut attempt = 0;
    let won_after = loop {
        let copy = &copies[attempt % 2];
        let answer = send(copy.clone(), redeem(&code)).await;
        log.push((
            format!("retry {attempt} (copy {})", attempt % 2),
            answer.status,
        ));
        attempt += 1;
        if answer.status == StatusCode::OK {
            break retrying.elapsed();
        }
        assert!(
            retrying.elapsed() < Duration::from_secs(5),
            "coupon {code} was never redeemed: for 5 s after the store answered again no retry \
             succeeded. 409s mean the claim written by the first redemption (whose client was \
             told it had failed, 503) was never undone, so the coupon is used up by a redemption \
             nobody got. Answers: {log:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    println!("coupon redeemed {won_after:?} after the store answered again");

    // A late undo of the first claim must not undo the retry's: wait past it, then every
    // further redemption, on either copy, is a conflict.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let check = verifier(&server);
    for i in 0..10 {
        let answer = send(check.clone(), redeem(&code)).await;
        log.push((format!("after the win {i}"), answer.status));
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let wins = log.iter().filter(|(_, s)| *s == StatusCode::OK).count();
    if let Some(first_win) = log.iter().position(|(_, s)| *s == StatusCode::OK)
        && let Some(again) = log[first_win + 1..]
            .iter()
            .find(|(_, s)| *s == StatusCode::OK)
    {
        panic!(
            "coupon {code} was redeemed twice: after {:?} came another 200 ({}). Answers: {log:?}",
            log[first_win].0, again.0
        );
    }
    assert_eq!(
        wins, 1,
        "coupon {code}: {wins} redemptions succeeded: {log:?}"
    );
    let after: Vec<_> = log
        .iter()
        .skip_while(|(_, s)| *s != StatusCode::OK)
        .skip(1)
        .filter(|(_, s)| *s != StatusCode::CONFLICT)
        .collect();
    assert!(
        after.is_empty(),
        "coupon {code}: once redeemed, every redemption must be 409, got {after:?}"
    );
}

// ---------------------------------------------------------------------------------------------
// b) the store died while the handler ran
// ---------------------------------------------------------------------------------------------

/// Redis (with an fsync-always AOF, so the claim survives) is killed while the payment handler
/// runs and restarted a second later. Whatever the first caller was told, a client that was told
/// success only ever sees that one execution again; a client that was not may see a second run,
/// but never two payments that were both delivered as complete successes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_payment_whose_store_died_mid_handler_is_never_a_success_without_its_record() {
    let mut server = RedisServer::start_with_aof();
    let proxy = Proxy::start(server.addr()).await;
    let app = copy_through(&proxy, Duration::from_millis(600));
    // Warm up: connected, scripts loaded, so the claim below is immediate.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let warm = send(app.clone(), pay(&unique("warm"))).await;
        if warm.success_id().is_some() {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "setup: no payment succeeded with Redis up for 10 s: {warm}"
        );
    }

    let key = unique("order");
    let first = tokio::spawn(send(app.clone(), pay(&key)));
    tokio::time::sleep(Duration::from_millis(150)).await;
    tokio::task::block_in_place(|| server.kill());
    tokio::time::sleep(Duration::from_secs(1)).await;
    tokio::task::block_in_place(|| server.restart());
    let restarted = Instant::now();
    let first = first.await.expect("the first payment request panicked");
    let claim_back = redis::cmd("KEYS")
        .arg("tollgate-app:idem:*")
        .query::<Vec<String>>(&mut server.conn())
        .map(|keys| keys.len());
    println!("first answer: {first}; idempotency keys in Redis after the restart: {claim_back:?}");

    // Retry with the same key until the key is settled one way or the other.
    let mut retries: Vec<Answer> = Vec::new();
    let settled = loop {
        let answer = send(app.clone(), pay(&key)).await;
        retries.push(answer.clone());
        if answer.status != StatusCode::CONFLICT && answer.status != StatusCode::SERVICE_UNAVAILABLE
        {
            break answer;
        }
        if restarted.elapsed() >= Duration::from_secs(10) {
            let told = match first.success_id() {
                Some(paid) => format!(
                    "the first caller was told payment {paid} succeeded (a complete 201), yet its \
                     response was never recorded: a success without its record"
                ),
                None => format!("the first caller got no complete success ({first})"),
            };
            panic!(
                "{told}; for 10 s after Redis came back every retry of key {key} was 409 or 503 \
                 (last: {answer}): the key stays in flight although its handler finished long \
                 ago, so the claim the store brought back was neither completed nor released."
            );
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    // And a few more: the key's answer does not change any more (asked with a patient store:
    // a slow answer must not read as another one).
    let check = verifier(&server);
    let mut later = Vec::new();
    for _ in 0..3 {
        let answer = send(check.clone(), pay(&key)).await;
        retries.push(answer.clone());
        later.push(answer);
    }
    let history = || {
        let retries: Vec<String> = retries.iter().map(ToString::to_string).collect();
        format!("first: {first}; retries: {retries:#?}")
    };

    let ids: BTreeSet<String> = std::iter::once(&first)
        .chain(&retries)
        .filter_map(Answer::id)
        .collect();
    let successes: BTreeSet<String> = std::iter::once(&first)
        .chain(&retries)
        .filter_map(Answer::success_id)
        .collect();
    match first.success_id() {
        Some(paid) => {
            // The client was told success: every retry is the replay of that one payment.
            assert!(
                settled.success_id().as_deref() == Some(paid.as_str()) && settled.replayed,
                "the first caller got a complete 201 for payment {paid}, so a retry must replay \
                 it (201, idempotent-replayed: true, the same id), but it got {settled}: a \
                 success was reported that the store never recorded. {}",
                history()
            );
            for answer in &later {
                assert!(
                    answer.success_id().as_deref() == Some(paid.as_str()) && answer.replayed,
                    "payment {paid} was reported done, yet a later retry got {answer}. {}",
                    history()
                );
            }
            assert_eq!(
                ids.len(),
                1,
                "the first caller was told payment {paid} succeeded, yet the handler ran again: \
                 payment ids seen {ids:?}. {}",
                history()
            );
        }
        None => {
            // Not a complete success: the retry may run the payment again or replay it.
            let Some(done) = settled.success_id() else {
                panic!(
                    "the first answer was not a complete success, and the retry that settled \
                     key {key} was not one either: {settled}. {}",
                    history()
                );
            };
            for answer in &later {
                assert!(
                    answer.success_id().as_deref() == Some(done.as_str()) && answer.replayed,
                    "key {key} settled as payment {done}, yet a later retry got {answer}. {}",
                    history()
                );
            }
            assert!(
                ids.len() <= 2,
                "the payment handler ran more than twice for one key: ids {ids:?}. {}",
                history()
            );
        }
    }
    assert_eq!(
        successes.len(),
        1,
        "key {key}: two different payments were each delivered as a complete success: \
         {successes:?}. {}",
        history()
    );
}

// ---------------------------------------------------------------------------------------------
// c) a connection that went dark
// ---------------------------------------------------------------------------------------------

/// The store's connection goes dark (stays open, carries nothing), while new connections to the
/// same Redis work: within 5 s the store notices and redemptions succeed again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silenced_store_connection_is_replaced_within_five_seconds() {
    let server = RedisServer::start();
    let proxy = Proxy::start(server.addr()).await;
    let app = copy_through(&proxy, app::DEFAULT_PAYMENT_DELAY);
    // Phase 1: the store's connection is open and works.
    warm_up(&app).await;
    // a witness connection of our own, opened before the silence like the store's
    let mut witness = TcpStream::connect(proxy.addr()).await.unwrap();
    assert!(
        pings(&mut witness, Duration::from_secs(2)).await,
        "setup: PING through the proxy"
    );

    // Phase 2: silence, then redeem fresh coupons until one succeeds.
    proxy.silence();
    let silenced = Instant::now();
    // The harness does what it says (checked alongside): the old connection is dark.
    let witness =
        tokio::spawn(async move { pings(&mut witness, Duration::from_millis(500)).await });
    let mut answers: Vec<(Duration, StatusCode)> = Vec::new();
    let recovered = loop {
        let answer = send(app.clone(), redeem(&unique("fresh"))).await;
        answers.push((silenced.elapsed(), answer.status));
        if answer.status == StatusCode::OK {
            break Some(silenced.elapsed());
        }
        assert_eq!(
            answer.status,
            StatusCode::SERVICE_UNAVAILABLE,
            "a fresh coupon while the store's connection is dark: {answer}"
        );
        if silenced.elapsed() >= Duration::from_secs(5) {
            break None;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert!(
        !witness.await.unwrap(),
        "setup: a connection opened before silence() still answered PING"
    );
    let mut fresh = TcpStream::connect(proxy.addr()).await.unwrap();
    assert!(
        pings(&mut fresh, Duration::from_secs(2)).await,
        "setup: a connection opened after silence() did not answer PING"
    );
    let Some(recovered) = recovered else {
        panic!(
            "5 s after the store's connection went dark (open, silent) no redemption had \
             succeeded, although new connections to Redis work: the store keeps sending on the \
             dead connection instead of replacing it. Answers (time since the silence, status): \
             {answers:?}"
        );
    };
    println!("a redemption succeeded again {recovered:?} after the connection went dark");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silenced_cluster_connection_is_replaced_within_five_seconds() {
    let ports = common::cluster::RedisCluster::free_ports();
    let mut proxies = Vec::new();
    for &port in &ports {
        proxies.push(Proxy::start(std::net::SocketAddr::from(([127, 0, 0, 1], port))).await);
    }
    let announce: Vec<u16> = proxies.iter().map(|p| p.addr().port()).collect();
    let _cluster = tokio::task::spawn_blocking(move || {
        common::cluster::RedisCluster::start_announcing(&ports, Some(&announce))
    })
    .await
    .unwrap();
    let store = RedisStore::cluster_builder(proxies.iter().map(Proxy::url))
        .timeout(STORE_TIMEOUT)
        .connect()
        .await
        .unwrap();
    let claims = tollgate::claim::Claims::new(store);
    // names over every master, so that each node's connection is in use
    for i in 0..30 {
        let name = format!("warm-{i}-{}", unique("c"));
        assert!(
            claims.claim_once(&name, None).await.unwrap().won(),
            "setup: warming up"
        );
    }

    for proxy in &proxies {
        proxy.silence();
    }
    let silenced = Instant::now();
    let mut errors = Vec::new();
    let recovered = loop {
        match claims.claim_once(unique("fresh"), None).await {
            Ok(claim) => {
                assert!(claim.won(), "a fresh name is won");
                break Some(silenced.elapsed());
            }
            Err(error) => errors.push((silenced.elapsed(), error.kind())),
        }
        if silenced.elapsed() >= Duration::from_secs(5) {
            break None;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let Some(recovered) = recovered else {
        panic!(
            "5 s after every cluster connection went dark (open, silent) no claim had succeeded, \
             although new connections work: the store keeps the dead cluster connection. \
             Errors (time since the silence, kind): {errors:?}"
        );
    };
    assert!(
        !errors.is_empty(),
        "setup: the silence did not reach the store's connections"
    );
    println!("a claim succeeded again {recovered:?} after the cluster connections went dark");
}

// ---------------------------------------------------------------------------------------------
// d) the store's connections held by a partition and healed mid-traffic
// ---------------------------------------------------------------------------------------------

/// Two copies redeem fresh coupons and take payments while their store connections go dark with
/// their bytes held, for two seconds, and then heal — the held commands arriving after the copies
/// replaced their connections and undid what timed out. Every coupon is redeemed exactly once in
/// the end: none twice, and none consumed by nobody (a coupon whose redemption failed is redeemed
/// by the next attempt, on either copy). Every payment answered `201` replays its id.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_copies_through_a_partition_that_holds_and_heals_redeem_each_coupon_once() {
    let server = RedisServer::start();
    let proxy = Proxy::start(server.addr()).await;
    let copies = [
        copy_through(&proxy, Duration::ZERO),
        copy_through(&proxy, Duration::ZERO),
    ];
    for copy in &copies {
        warm_up(copy).await;
    }
    let started = Instant::now();
    let traffic = |worker: usize| {
        let copies = copies.clone();
        tokio::spawn(async move {
            let (mut coupons, mut paid) = (Vec::new(), Vec::new());
            let mut i = worker;
            while started.elapsed() < Duration::from_secs(5) {
                let copy = copies[i % 2].clone();
                let code = unique("coupon");
                let answer = send(copy.clone(), redeem(&code)).await;
                assert!(
                    [StatusCode::OK, StatusCode::SERVICE_UNAVAILABLE].contains(&answer.status),
                    "a fresh coupon: {answer}"
                );
                coupons.push((code, answer.status == StatusCode::OK));
                let key = unique("payment");
                let payment = send(copy, pay(&key)).await;
                if payment.status.is_success() {
                    paid.push((key, payment.success_id()));
                }
                i += 1;
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            (coupons, paid)
        })
    };
    let workers: Vec<_> = (0..6).map(traffic).collect();
    tokio::time::sleep(Duration::from_millis(500)).await;
    proxy.silence();
    // Redemptions sent at once go out on the dark connections (no copy can know yet): their
    // commands are held past the store timeout, undone, and delivered when the partition heals.
    // Whatever the traffic's timing, these are ghost-claim candidates.
    let in_the_dark: Vec<_> = (0..8)
        .map(|i| {
            let copy = copies[i % 2].clone();
            tokio::spawn(async move {
                let code = unique("dark");
                let answer = send(copy, redeem(&code)).await;
                (code, answer)
            })
        })
        .collect();
    tokio::time::sleep(Duration::from_secs(2)).await;
    proxy.unsilence();
    let (mut coupons, mut paid) = (Vec::new(), Vec::new());
    for attempt in in_the_dark {
        let (code, answer) = attempt.await.unwrap();
        assert_eq!(
            answer.status,
            StatusCode::SERVICE_UNAVAILABLE,
            "a redemption sent into the partition: {answer}"
        );
        coupons.push((code, false));
    }
    for worker in workers {
        let (c, p) = worker.await.unwrap();
        coupons.extend(c);
        paid.extend(p);
    }
    let failed = coupons.iter().filter(|(_, redeemed)| !redeemed).count();
    assert!(failed > 0, "setup: no redemption failed in the partition");
    // the undos of the last redemptions in the dark are sent once their deadlines have passed
    tokio::time::sleep(Duration::from_millis(500)).await;
    let check = verifier(&server);
    for (code, redeemed) in &coupons {
        let answer = send(check.clone(), redeem(code)).await;
        let expected = if *redeemed {
            StatusCode::CONFLICT
        } else {
            StatusCode::OK
        };
        assert_eq!(
            answer.status, expected,
            "coupon {code} (redeemed during the traffic: {redeemed}): {answer}"
        );
    }
    assert!(!paid.is_empty(), "setup: no payment succeeded");
    for (key, id) in &paid {
        let id = id
            .as_ref()
            .unwrap_or_else(|| panic!("{key}: a 2xx without a complete body"));
        let replay = send(check.clone(), pay(key)).await;
        assert!(replay.replayed, "{key}: {replay}");
        assert_eq!(
            replay.id().as_ref(),
            Some(id),
            "{key}: the replay names another payment"
        );
    }
}
