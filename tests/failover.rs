//! Failovers, as users of the example app (`examples/app`) meet them: the primary behind Sentinel
//! killed and a replica promoted, a Redis Cluster master killed and its replica taking over.
//! Two copies of the app run in-process (as in `tests/app/app.rs`), each with a store of its
//! own, and are never restarted: they must find the new primary by themselves.
//!
//! With durable writes (`wait_replicas(1)`) a coupon is redeemed exactly once across the
//! failover — a redemption a replica did not acknowledge is refused (503) and undone, never
//! reported as done and then lost. Without them, the writes the old primary took but had not
//! passed on are lost with it; one test measures how many, and only documents it.
//!
//! Topologies: a primary with two replicas (so that the promoted one still has a replica to
//! acknowledge `WAIT 1`), three sentinels; a cluster of three masters with two replicas each
//! (the same reason, per shard). The tests run one at a time, in a binary of their own: they
//! measure failover times.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

#[path = "../examples/app/router.rs"]
pub mod app;
#[path = "../examples/shared/env.rs"]
pub mod env;

use std::collections::BTreeMap;
use std::fmt;
use std::sync::Arc;
use std::time::{Duration, Instant};

use app::{AppConfig, AppState};
use axum::Router;
use axum::body::Body;
use bytes::{Bytes, BytesMut};
use common::cluster::{self, RedisCluster};
use common::sentinel::SentinelSetup;
use http::{Request, StatusCode};
use http_body_util::BodyExt;
use serde_json::Value;
use tollgate::key::Key;
use tollgate::store::{RedisStore, Store};
use tower::ServiceExt;

/// The store timeout of every copy of the app in these tests.
const STORE_TIMEOUT: Duration = Duration::from_secs(1);

/// How long any one request may take before the test gives up on it (no test hangs).
const REQUEST_BOUND: Duration = Duration::from_secs(10);

/// How long a payment may take while the store does not confirm its record: the idempotency
/// layer retries storing it for up to its lease (30 s by default), then tells the caller it was
/// not recorded. Right after a failover, while the replicas reattach to the new primary, `WAIT`
/// may go unanswered that long.
const RECORD_BOUND: Duration = Duration::from_secs(30 + 5);

/// How soon after the primary is killed both copies must serve again (Sentinel).
const SENTINEL_RECOVERY_BOUND: Duration = Duration::from_secs(10);

/// How soon after a master is killed both copies must serve its slots again (Cluster).
const CLUSTER_RECOVERY_BOUND: Duration = Duration::from_secs(15);

/// Parallel redemptions of each coupon, spread over the two copies.
const ATTEMPTS: usize = 4;

/// The tests measure failover times on a small machine: one at a time.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

// ---------------------------------------------------------------------------------------------
// helpers
// ---------------------------------------------------------------------------------------------

/// The app's configuration as its environment would give it (every other variable unset, at
/// its default): `vars` are `(name, value)` pairs.
fn config(vars: &[(&str, String)]) -> AppConfig {
    let mut all = vec![
        ("PORT", "0".to_owned()),
        ("APP_LIMITS", "burst:1000/1s".to_owned()),
        ("APP_ALGORITHM", "sliding-log".to_owned()),
        ("APP_API_KEYS", "merchant-1:merchant-1:free".to_owned()),
    ];
    all.extend(vars.iter().cloned());
    AppConfig::from_lookup(|name| {
        all.iter()
            .find(|(n, _)| *n == name)
            .map(|(_, value)| value.clone())
    })
    .unwrap_or_else(|e| panic!("the app's configuration {all:?}: {e}"))
}

/// One copy of the app on a store of its own behind the sentinels of `setup`.
async fn sentinel_copy(setup: &SentinelSetup, wait_replicas: u32) -> Router {
    let mut builder = RedisStore::sentinel_builder(setup.sentinel_urls(), setup.master_name())
        .timeout(STORE_TIMEOUT);
    if wait_replicas > 0 {
        builder = builder.wait_replicas(wait_replicas);
    }
    let store = builder
        .connect()
        .await
        .expect("a store behind the sentinels");
    let store: Arc<dyn Store> = Arc::new(store);
    let config = config(&[
        ("REDIS_SENTINELS", setup.sentinel_urls().join(",")),
        ("REDIS_SENTINEL_MASTER", setup.master_name().to_owned()),
        ("REDIS_WAIT_REPLICAS", wait_replicas.to_string()),
    ]);
    app::router(AppState::new(store, config).unwrap())
}

/// One copy of the app on a cluster store of its own.
async fn cluster_copy(cluster: &RedisCluster, wait_replicas: u32) -> Router {
    let store = RedisStore::cluster_builder(cluster.urls())
        .timeout(STORE_TIMEOUT)
        .wait_replicas(wait_replicas)
        .connect()
        .await
        .expect("a cluster store");
    let store: Arc<dyn Store> = Arc::new(store);
    let config = config(&[
        ("REDIS_CLUSTER_URLS", cluster.urls().join(",")),
        ("REDIS_WAIT_REPLICAS", wait_replicas.to_string()),
    ]);
    app::router(AppState::new(store, config).unwrap())
}

/// What a client got: the head and the body.
#[derive(Debug, Clone)]
struct Answer {
    status: StatusCode,
    replayed: bool,
    body: Bytes,
}

impl Answer {
    fn json(&self) -> Value {
        serde_json::from_slice(&self.body).unwrap_or(Value::Null)
    }
}

impl fmt::Display for Answer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.status.as_u16())?;
        if self.replayed {
            write!(f, " (replayed)")?;
        }
        write!(f, " {}", String::from_utf8_lossy(&self.body))
    }
}

/// Sends `request` to `app` and reads the whole answer; panics when it takes longer than
/// [`REQUEST_BOUND`].
async fn send(app: Router, request: Request<Body>) -> Answer {
    send_within(app, request, REQUEST_BOUND).await
}

/// [`send`], with `bound` in place of [`REQUEST_BOUND`].
async fn send_within(app: Router, request: Request<Body>, bound: Duration) -> Answer {
    let what = format!("{} {}", request.method(), request.uri());
    let answer = async {
        let response = app.oneshot(request).await.unwrap();
        let status = response.status();
        let replayed = response
            .headers()
            .get("idempotent-replayed")
            .is_some_and(|v| v == "true");
        let mut body = response.into_body();
        let mut data = BytesMut::new();
        while let Some(frame) = body.frame().await {
            if let Some(chunk) = frame.unwrap().data_ref() {
                data.extend_from_slice(chunk);
            }
        }
        Answer {
            status,
            replayed,
            body: data.freeze(),
        }
    };
    tokio::time::timeout(bound, answer)
        .await
        .unwrap_or_else(|_| panic!("{what}: no complete answer within {bound:?}"))
}

fn redeem(code: &str) -> Request<Body> {
    Request::post(format!("/coupons/{code}/redeem"))
        .body(Body::empty())
        .unwrap()
}

fn rebuild(report: &str) -> Request<Body> {
    Request::post(format!("/reports/{report}/rebuild"))
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

/// The Redis key of coupon `code`'s claim in the example app (`tollgate-app` prefix, claim
/// name `coupon:<code>`), as tollgate lays claim keys out: `<prefix>:claim:{<digest>}`.
fn coupon_key(code: &str) -> String {
    let digest = Key::new("claim", format!("coupon:{code}").as_bytes());
    format!("tollgate-app:claim:{{{digest}}}")
}

/// Every redemption answer of the test, per coupon.
#[derive(Default)]
struct Ledger {
    answers: BTreeMap<String, Vec<(String, StatusCode)>>,
}

impl Ledger {
    fn record(&mut self, code: &str, phase: &str, statuses: &[StatusCode]) {
        let entry = self.answers.entry(code.to_owned()).or_default();
        entry.extend(statuses.iter().map(|s| (phase.to_owned(), *s)));
    }

    fn wins(&self, code: &str) -> usize {
        self.answers.get(code).map_or(0, |answers| {
            answers.iter().filter(|(_, s)| *s == StatusCode::OK).count()
        })
    }

    /// The coupons redeemed more than once, with all their answers.
    fn redeemed_twice(&self) -> Vec<(&String, &Vec<(String, StatusCode)>)> {
        self.answers
            .iter()
            .filter(|(code, _)| self.wins(code) > 1)
            .collect()
    }

    fn history(&self, code: &str) -> String {
        format!("{:?}", self.answers.get(code))
    }
}

/// `attempts` redemptions of `code` at once, spread over `copies`: their statuses.
async fn redeem_parallel(copies: &[Router], code: &str, attempts: usize) -> Vec<StatusCode> {
    let handles: Vec<_> = (0..attempts)
        .map(|i| {
            let app = copies[i % copies.len()].clone();
            let code = code.to_owned();
            tokio::spawn(async move { send(app, redeem(&code)).await.status })
        })
        .collect();
    let mut statuses = Vec::new();
    for handle in handles {
        statuses.push(handle.await.expect("a redemption panicked"));
    }
    statuses
}

/// Statuses counted, for messages: `{200: 1, 409: 3}`.
fn tally(statuses: &[StatusCode]) -> BTreeMap<u16, usize> {
    let mut counts = BTreeMap::new();
    for status in statuses {
        *counts.entry(status.as_u16()).or_default() += 1;
    }
    counts
}

/// How a copy came back after a failover.
#[derive(Debug)]
struct Recovery {
    /// From the failure until the first successful redemption, if one came within the bound.
    served_after: Option<Duration>,
    /// The coupon of that redemption.
    code: Option<String>,
    /// The answers before it.
    before: BTreeMap<u16, usize>,
    /// The last answer that was not a success.
    last_failure: Option<String>,
}

/// Redeems the next fresh coupon of `codes` on `app` every 50 ms until one succeeds (200), for
/// at most `bound` after `since`. Each coupon is tried once: a refused redemption is undone by
/// the store, not retried.
async fn first_success(
    app: Router,
    codes: Vec<String>,
    since: Instant,
    bound: Duration,
) -> Recovery {
    let mut before = Vec::new();
    let mut last_failure = None;
    for code in codes {
        let left = bound.saturating_sub(since.elapsed());
        if left.is_zero() {
            break;
        }
        let Ok(answer) = tokio::time::timeout(left, send(app.clone(), redeem(&code))).await else {
            last_failure = Some(format!("{code}: no answer before the bound"));
            break;
        };
        if answer.status == StatusCode::OK {
            return Recovery {
                served_after: Some(since.elapsed()),
                code: Some(code),
                before: tally(&before),
                last_failure,
            };
        }
        before.push(answer.status);
        last_failure = Some(format!("{code}: {answer}"));
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    Recovery {
        served_after: None,
        code: None,
        before: tally(&before),
        last_failure,
    }
}

/// Rebuilds `report` on `app` (retrying while another holder is busy, up to 5 s): its fencing
/// token.
async fn fencing_token(app: &Router, report: &str) -> u64 {
    let started = Instant::now();
    loop {
        let answer = send(app.clone(), rebuild(report)).await;
        if answer.status == StatusCode::OK {
            return answer.json()["fencing_token"]
                .as_u64()
                .unwrap_or_else(|| panic!("a rebuild without a fencing token: {answer}"));
        }
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "report {report} could not be rebuilt for 5 s: last answer {answer}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Warms a copy up (connected, scripts loaded): one redemption must succeed.
async fn warm_up(app: &Router, code: &str) {
    let warm = send(app.clone(), redeem(code)).await;
    assert_eq!(
        warm.status,
        StatusCode::OK,
        "setup: warming up with coupon {code}: {warm}"
    );
}

// ---------------------------------------------------------------------------------------------
// a) Sentinel, durable writes: nothing lost, nothing twice
// ---------------------------------------------------------------------------------------------

/// Two copies on `sentinel_builder(..).wait_replicas(1)`. Coupons redeemed before the failover
/// stay redeemed after it; a redemption the replicas never acknowledged (replication cut) is
/// refused and undone, so that it redeems exactly once later; both copies find the promoted
/// replica by themselves within 10 s; fencing tokens keep rising and a completed payment
/// replays across the failover.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sentinel_failover_with_wait_redeems_every_coupon_exactly_once() {
    let _serial = SERIAL.lock().await;
    let started = Instant::now();
    let mut setup = SentinelSetup::start("tollgate-durable").await;
    println!(
        "setup: primary {}, replicas {:?} (through proxy {}), sentinels {:?}, ready after {:?}",
        setup.primary_port(),
        setup.replica_ports(),
        setup.proxy_port(),
        setup.sentinel_ports(),
        started.elapsed()
    );
    let copies = [
        sentinel_copy(&setup, 1).await,
        sentinel_copy(&setup, 1).await,
    ];
    for (i, copy) in copies.iter().enumerate() {
        warm_up(copy, &format!("warm-{i}")).await;
    }
    let mut ledger = Ledger::default();

    // Before the failover: C1..C20, each redeemed exactly once across both copies.
    let codes: Vec<String> = (1..=20).map(|i| format!("C{i}")).collect();
    for code in &codes {
        let statuses = redeem_parallel(&copies, code, ATTEMPTS).await;
        ledger.record(code, "before the failover", &statuses);
        let counts = tally(&statuses);
        assert_eq!(
            counts.get(&200).copied().unwrap_or(0),
            1,
            "coupon {code}, {ATTEMPTS} parallel redemptions with the replicas in sync: {counts:?}"
        );
        assert_eq!(
            counts.get(&409).copied().unwrap_or(0),
            ATTEMPTS - 1,
            "coupon {code}: every redemption but the winner must be 409: {counts:?}"
        );
    }
    assert!(
        setup.primary_has(&coupon_key("C1")).await,
        "test assumption: coupon C1's claim is stored at {} (the key layout of src/keys.rs)",
        coupon_key("C1")
    );
    // A 200 with wait_replicas(1) means a replica has the claim.
    for code in &codes {
        let having = setup.replicas_having(&coupon_key(code)).await;
        assert!(
            having >= 1,
            "coupon {code} was redeemed (200) with wait_replicas(1), yet no replica holds its \
             claim {}",
            coupon_key(code)
        );
    }

    // A payment completed before the failover, replayed before it too.
    let paid = send(copies[0].clone(), pay("order-before-failover")).await;
    assert_eq!(
        paid.status,
        StatusCode::CREATED,
        "a payment before the failover: {paid}"
    );
    let paid_id = paid.json()["id"].as_str().unwrap().to_owned();
    let replay = send(copies[1].clone(), pay("order-before-failover")).await;
    assert!(
        replay.status == StatusCode::CREATED && replay.replayed,
        "the payment replayed before the failover: {replay}"
    );
    assert_eq!(replay.json()["id"], paid.json()["id"], "{replay} vs {paid}");

    // Fencing tokens before the failover.
    let token_1 = fencing_token(&copies[0], "daily").await;
    let token_2 = fencing_token(&copies[1], "daily").await;
    assert!(
        token_2 > token_1,
        "fencing tokens must rise: {token_1} then {token_2}"
    );

    // Replication cut: a redemption (a lock, a payment) that no replica acknowledges is refused.
    setup.cut_replication().await;
    for (i, copy) in copies.iter().enumerate() {
        let asked = Instant::now();
        let answer = send(copy.clone(), redeem("C21")).await;
        let took = asked.elapsed();
        ledger.record("C21", "replication cut", &[answer.status]);
        println!("C21 on copy {i} with replication cut: {answer} after {took:?}");
        assert_ne!(
            answer.status,
            StatusCode::OK,
            "C21 was redeemed (200) on copy {i} while no replica could acknowledge it \
             (wait_replicas(1)): a redemption that dies with the primary"
        );
        assert_eq!(
            answer.status,
            StatusCode::SERVICE_UNAVAILABLE,
            "C21 on copy {i}, replication cut: expected 503 (not acknowledged), got {answer}{}",
            if answer.status == StatusCode::CONFLICT {
                " — C21 was never redeemed (every earlier attempt was told 503), so a 409 means \
                 the claim of a refused attempt was still in place: it is undone only afterwards, \
                 in the background"
            } else {
                ""
            }
        );
    }
    let locked = send(copies[0].clone(), rebuild("during-cut")).await;
    println!("a rebuild with replication cut: {locked}");
    assert_ne!(
        locked.status,
        StatusCode::OK,
        "a lock no replica acknowledged was reported as held (rebuild 200): {locked}"
    );
    let unacked_payment = send(copies[1].clone(), pay("order-during-cut")).await;
    println!("a payment with replication cut: {unacked_payment}");
    assert_ne!(
        unacked_payment.status,
        StatusCode::CREATED,
        "a payment whose idempotency record no replica acknowledged was reported done: \
         {unacked_payment}"
    );
    let c21_on_primary = setup.primary_has(&coupon_key("C21")).await;
    let healed_in = setup.heal_replication().await;
    println!(
        "replication healed; replicas caught up in {healed_in:?}; C21's claim on the primary \
         after its refused redemptions: {c21_on_primary}"
    );

    // The failover.
    let mut probe_codes = [Vec::new(), Vec::new()];
    for (i, codes) in probe_codes.iter_mut().enumerate() {
        *codes = (0..400).map(|n| format!("probe-{i}-{n}")).collect();
    }
    let killed = setup.kill_primary();
    let probes: Vec<_> = copies
        .iter()
        .zip(probe_codes)
        .map(|(copy, codes)| {
            tokio::spawn(first_success(
                copy.clone(),
                codes,
                killed,
                SENTINEL_RECOVERY_BOUND,
            ))
        })
        .collect();
    let promotion = setup.wait_for_new_primary(Duration::from_secs(20)).await;
    let promoted = promotion.map(|(_, after)| after);
    let new_primary = promotion.map(|(port, _)| port);
    let all_agree = match new_primary {
        Some(port) => {
            setup
                .wait_for_all_sentinels_to_name(port, Duration::from_secs(10))
                .await
        }
        None => None,
    };
    let mut recoveries = Vec::new();
    for probe in probes {
        recoveries.push(probe.await.expect("a probe panicked"));
    }
    println!(
        "primary {} killed: a sentinel named the new primary {new_primary:?} after \
         {promoted:?}, all sentinels after {all_agree:?}",
        setup.primary_port()
    );
    for (i, recovery) in recoveries.iter().enumerate() {
        println!(
            "copy {i}: first successful redemption {:?} after the kill ({:?}); answers before: \
             {:?}; last failure: {:?}",
            recovery.served_after, recovery.code, recovery.before, recovery.last_failure
        );
    }
    assert!(
        promoted.is_some(),
        "no sentinel named a new primary within 20 s of the kill:\n{}",
        setup.sentinel_logs(15)
    );
    assert!(
        setup.replica_ports().contains(&new_primary.unwrap()),
        "the sentinels named {new_primary:?}, not one of the replicas {:?}",
        setup.replica_ports()
    );
    for (i, recovery) in recoveries.iter().enumerate() {
        assert!(
            recovery.served_after.is_some(),
            "copy {i} did not redeem a coupon within {SENTINEL_RECOVERY_BOUND:?} of the kill \
             (promotion after {promoted:?}): {recovery:?}"
        );
        ledger.record(
            recovery.code.as_deref().unwrap(),
            "probe",
            &[StatusCode::OK],
        );
    }

    // Right after its first success, a copy serves on every connection it has: fresh coupons
    // redeemed at once all succeed — no connection of its store is left on the dead primary
    // until a call of its own fails there.
    for (i, copy) in copies.iter().enumerate() {
        let fresh: Vec<String> = (0..8).map(|n| format!("fresh-{i}-{n}")).collect();
        let sends: Vec<_> = fresh
            .iter()
            .map(|code| tokio::spawn(send(copy.clone(), redeem(code))))
            .collect();
        for (code, sent) in fresh.iter().zip(sends) {
            let answer = sent.await.expect("a redemption panicked");
            ledger.record(code, "right after recovery", &[answer.status]);
            assert_eq!(
                answer.status,
                StatusCode::OK,
                "copy {i}, fresh coupon {code} right after the copy's first success: {answer}"
            );
        }
    }

    // After the failover: nothing redeemed before is redeemed again.
    for code in &codes {
        let statuses = redeem_parallel(&copies, code, ATTEMPTS).await;
        ledger.record(code, "after the failover", &statuses);
        assert!(
            statuses.iter().all(|s| *s == StatusCode::CONFLICT),
            "coupon {code}, redeemed before the failover, answered {:?} after it (must be 409 \
             only): {}",
            tally(&statuses),
            ledger.history(code)
        );
    }
    // C21 was refused and undone: it redeems now, once.
    let retrying = Instant::now();
    while ledger.wins("C21") == 0 && retrying.elapsed() < Duration::from_secs(5) {
        let statuses = redeem_parallel(&copies, "C21", ATTEMPTS).await;
        ledger.record("C21", "after the failover", &statuses);
        if ledger.wins("C21") == 0 {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    let statuses = redeem_parallel(&copies, "C21", ATTEMPTS).await;
    ledger.record("C21", "after its redemption", &statuses);
    assert_eq!(
        ledger.wins("C21"),
        1,
        "C21 (refused while replication was cut) must redeem exactly once over the whole test; \
         409s only mean its unacknowledged claim was never undone: {}",
        ledger.history("C21")
    );
    for (i, recovery) in recoveries.iter().enumerate() {
        let code = recovery.code.as_deref().unwrap();
        let statuses = redeem_parallel(&copies, code, 2).await;
        ledger.record(code, "again", &statuses);
        assert!(
            statuses.iter().all(|s| *s == StatusCode::CONFLICT),
            "copy {i}'s first coupon after the failover ({code}) redeemed again: {}",
            ledger.history(code)
        );
    }

    // Fencing tokens keep rising; the payment replays.
    let token_3 = fencing_token(&copies[0], "daily").await;
    let token_4 = fencing_token(&copies[1], "daily").await;
    println!(
        "fencing tokens: {token_1}, {token_2} before the failover; {token_3}, {token_4} after"
    );
    assert!(
        token_3 > token_2 && token_4 > token_3,
        "fencing tokens must keep rising across the failover: {token_1}, {token_2} before, \
         {token_3}, {token_4} after"
    );
    let replay = send(copies[1].clone(), pay("order-before-failover")).await;
    println!("the payment from before the failover, retried after it: {replay}");
    assert!(
        replay.status == StatusCode::CREATED && replay.replayed,
        "the payment completed before the failover must replay after it: {replay}"
    );
    assert_eq!(
        replay.json()["id"].as_str(),
        Some(paid_id.as_str()),
        "the payment replayed with another id: {replay}"
    );
    let after_cut = send(copies[0].clone(), rebuild("during-cut")).await;
    // it may run now, and its record wait for a replica that is still reattaching
    let retried_payment =
        send_within(copies[0].clone(), pay("order-during-cut"), RECORD_BOUND).await;
    println!(
        "after the failover: the report locked during the cut rebuilds: {after_cut}; the payment \
         refused during the cut, retried: {retried_payment}"
    );

    let twice = ledger.redeemed_twice();
    assert!(twice.is_empty(), "coupons redeemed twice: {twice:?}");
    for code in &codes {
        assert_eq!(ledger.wins(code), 1, "{code}: {}", ledger.history(code));
    }
    println!("test took {:?}", started.elapsed());
}

// ---------------------------------------------------------------------------------------------
// b) Sentinel without durable writes: what asynchronous replication loses
// ---------------------------------------------------------------------------------------------

/// The same setup without `wait_replicas`: the replication links are cut, a batch of coupons is
/// redeemed on the primary (each a 200), and the primary is killed. The promoted replica never
/// saw those redemptions: the figure printed is how many of them can be redeemed a second time.
/// This documents asynchronous replication; it asserts only that both copies serve again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sentinel_failover_without_wait_shows_what_async_replication_loses() {
    let _serial = SERIAL.lock().await;
    let started = Instant::now();
    let mut setup = SentinelSetup::start("tollgate-async").await;
    let copies = [
        sentinel_copy(&setup, 0).await,
        sentinel_copy(&setup, 0).await,
    ];
    for (i, copy) in copies.iter().enumerate() {
        warm_up(copy, &format!("warm-{i}")).await;
    }
    // Redeemed while replication works: these reach the replicas.
    let synced: Vec<String> = (1..=10).map(|i| format!("S{i}")).collect();
    for code in &synced {
        let statuses = redeem_parallel(&copies, code, ATTEMPTS).await;
        assert_eq!(tally(&statuses).get(&200), Some(&1), "{code}: {statuses:?}");
    }
    setup
        .wait_replicas_in_sync(Duration::from_secs(5))
        .await
        .expect("the replicas caught up before the cut");

    setup.cut_replication().await;
    let batch: Vec<String> = (1..=20).map(|i| format!("L{i}")).collect();
    let mut redeemed = Vec::new();
    for code in &batch {
        let statuses = redeem_parallel(&copies, code, ATTEMPTS).await;
        let counts = tally(&statuses);
        assert_eq!(
            counts.get(&200),
            Some(&1),
            "coupon {code} with the replication cut and no wait_replicas: {counts:?}"
        );
        redeemed.push(code.clone());
    }
    let killed = setup.kill_primary();
    let probes: Vec<_> = copies
        .iter()
        .enumerate()
        .map(|(i, copy)| {
            let codes = (0..400).map(|n| format!("probe-{i}-{n}")).collect();
            tokio::spawn(first_success(
                copy.clone(),
                codes,
                killed,
                SENTINEL_RECOVERY_BOUND,
            ))
        })
        .collect();
    let promoted = setup.wait_for_promotion(Duration::from_secs(20)).await;
    let mut recoveries = Vec::new();
    for probe in probes {
        recoveries.push(probe.await.expect("a probe panicked"));
    }
    println!("primary killed: a sentinel named a new primary after {promoted:?}");
    for (i, recovery) in recoveries.iter().enumerate() {
        println!(
            "copy {i}: first successful redemption {:?} after the kill; answers before: {:?}; \
             last failure: {:?}",
            recovery.served_after, recovery.before, recovery.last_failure
        );
    }
    for (i, recovery) in recoveries.iter().enumerate() {
        assert!(
            recovery.served_after.is_some(),
            "copy {i} did not redeem a coupon within {SENTINEL_RECOVERY_BOUND:?} of the kill \
             (promotion after {promoted:?}): {recovery:?}\n{}",
            setup.sentinel_logs(15)
        );
    }

    let mut lost = Vec::new();
    for code in &redeemed {
        let statuses = redeem_parallel(&copies, code, 2).await;
        if statuses.contains(&StatusCode::OK) {
            lost.push(code.clone());
        }
    }
    let mut synced_again = Vec::new();
    for code in &synced {
        let statuses = redeem_parallel(&copies, code, 2).await;
        if statuses.contains(&StatusCode::OK) {
            synced_again.push(code.clone());
        }
    }
    println!(
        "without wait_replicas: {} of {} coupons redeemed (200) on the old primary while \
         replication was cut were redeemed AGAIN after the failover: {lost:?}",
        lost.len(),
        redeemed.len()
    );
    println!(
        "coupons redeemed while replication worked, redeemed again after the failover: {} of \
         {} {synced_again:?}",
        synced_again.len(),
        synced.len()
    );
    println!("test took {:?}", started.elapsed());
}

// ---------------------------------------------------------------------------------------------
// c) Cluster: a master killed, its replica takes over
// ---------------------------------------------------------------------------------------------

/// Two copies on `cluster_builder(..).wait_replicas(1)` over three masters with two replicas
/// each. Coupons on every master are redeemed; one master is killed. Its replica takes over, both
/// copies redeem coupons of its slots again within 15 s, and no coupon — on any master — is ever
/// redeemed twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_master_killed_replica_takes_over_nothing_twice() {
    let _serial = SERIAL.lock().await;
    let started = Instant::now();
    let mut cluster =
        tokio::task::spawn_blocking(|| RedisCluster::start_with_replicas_per_master(2))
            .await
            .expect("the cluster started");
    let masters = cluster.masters();
    println!(
        "cluster: masters {masters:?} of nodes {:?}, ready after {:?}",
        cluster.ports(),
        started.elapsed()
    );
    assert_eq!(masters.len(), 3, "setup: {:?}", cluster.cluster_nodes());
    let copies = [
        cluster_copy(&cluster, 1).await,
        cluster_copy(&cluster, 1).await,
    ];
    for (i, copy) in copies.iter().enumerate() {
        warm_up(copy, &format!("warm-{i}")).await;
    }

    // Coupons spread over the masters: six on each, found by their claim key's slot.
    let master_of = |code: &str| cluster.master_of_slot(cluster::key_slot(&coupon_key(code)));
    let slot_owner: BTreeMap<u16, u16> = {
        let nodes = cluster.cluster_nodes();
        (0..16_384u16)
            .filter_map(|slot| {
                nodes
                    .iter()
                    .find(|n| n.is_master() && n.serves(slot))
                    .map(|n| (slot, n.port))
            })
            .collect()
    };
    assert_eq!(slot_owner.len(), 16_384, "setup: every slot has a master");
    let owner = |code: &str| slot_owner[&cluster::key_slot(&coupon_key(code))];
    let mut per_master: BTreeMap<u16, Vec<String>> = BTreeMap::new();
    let mut n = 0;
    while per_master.len() < 3 || per_master.values().any(|c| c.len() < 6) {
        let code = format!("K{n}");
        n += 1;
        let codes = per_master.entry(owner(&code)).or_default();
        if codes.len() < 6 {
            codes.push(code);
        }
    }
    // the slot computed here is the slot Redis computes
    let first = &per_master[&masters[0]][0];
    let slot: u16 = common::sentinel::query(
        masters[0],
        redis::cmd("CLUSTER").arg("KEYSLOT").arg(coupon_key(first)),
    )
    .await
    .unwrap();
    assert_eq!(
        slot,
        cluster::key_slot(&coupon_key(first)),
        "CRC16 key slot"
    );
    assert_eq!(master_of(first), Some(masters[0]));

    let mut ledger = Ledger::default();
    for codes in per_master.values() {
        for code in codes {
            let statuses = redeem_parallel(&copies, code, ATTEMPTS).await;
            ledger.record(code, "before the failover", &statuses);
            let counts = tally(&statuses);
            assert_eq!(
                counts.get(&200).copied().unwrap_or(0),
                1,
                "coupon {code} (master {}), {ATTEMPTS} parallel redemptions: {counts:?}",
                owner(code)
            );
        }
    }

    // Kill the master of the first coupon's slots; probe coupons of its slots.
    let victim = masters[0];
    let replicas_of_victim: Vec<u16> = {
        let nodes = cluster.cluster_nodes();
        let id = nodes.iter().find(|n| n.port == victim).unwrap().id.clone();
        nodes
            .iter()
            .filter(|n| n.master_id.as_deref() == Some(id.as_str()))
            .map(|n| n.port)
            .collect()
    };
    let mut probe_codes: [Vec<String>; 2] = [Vec::new(), Vec::new()];
    let mut m = 0;
    while probe_codes.iter().any(|c| c.len() < 300) {
        let code = format!("P{m}");
        if owner(&code) == victim {
            probe_codes[m % 2].push(code);
        }
        m += 1;
    }
    let killed = cluster.kill_node(victim);
    let probes: Vec<_> = copies
        .iter()
        .zip(probe_codes)
        .map(|(copy, codes)| {
            tokio::spawn(first_success(
                copy.clone(),
                codes,
                killed,
                CLUSTER_RECOVERY_BOUND,
            ))
        })
        .collect();
    // (blocking polls: on a thread of their own, so that the copies keep running)
    let takeover =
        tokio::task::block_in_place(|| cluster.wait_for_takeover(victim, Duration::from_secs(30)));
    let mut recoveries = Vec::new();
    for probe in probes {
        recoveries.push(probe.await.expect("a probe panicked"));
    }
    println!(
        "master {victim} (replicas {replicas_of_victim:?}) killed: taken over by {:?} after \
         {:?} (its slots served by it and cluster_state:ok on every live node)",
        takeover.map(|t| t.0),
        takeover.map(|t| t.1)
    );
    for (i, recovery) in recoveries.iter().enumerate() {
        println!(
            "copy {i}: first successful redemption on the killed master's slots {:?} after the \
             kill ({:?}); answers before: {:?}; last failure: {:?}",
            recovery.served_after, recovery.code, recovery.before, recovery.last_failure
        );
    }
    let Some((new_master, _)) = takeover else {
        panic!(
            "no replica took over the slots of master {victim} within 30 s: {:#?}",
            cluster.cluster_nodes()
        );
    };
    assert!(
        replicas_of_victim.contains(&new_master),
        "the slots of {victim} went to {new_master}, not one of its replicas {replicas_of_victim:?}"
    );
    for (i, recovery) in recoveries.iter().enumerate() {
        assert!(
            recovery.served_after.is_some(),
            "copy {i} did not redeem a coupon of the killed master's slots within \
             {CLUSTER_RECOVERY_BOUND:?} of the kill (takeover after {takeover:?}): {recovery:?}"
        );
        ledger.record(
            recovery.code.as_deref().unwrap(),
            "probe",
            &[StatusCode::OK],
        );
    }

    // Nothing redeemed before is redeemed again, on any master.
    for (master, codes) in &per_master {
        for code in codes {
            let statuses = redeem_parallel(&copies, code, ATTEMPTS).await;
            ledger.record(code, "after the failover", &statuses);
            assert!(
                statuses.iter().all(|s| *s == StatusCode::CONFLICT),
                "coupon {code} (master {master}{}), redeemed before the failover, answered {:?} \
                 after it (must be 409 only): {}",
                if *master == victim { ", killed" } else { "" },
                tally(&statuses),
                ledger.history(code)
            );
        }
    }
    // The killed master's slots are served again: fresh coupons there redeem exactly once.
    let mut fresh = Vec::new();
    let mut k = 0;
    while fresh.len() < 5 {
        let code = format!("F{k}");
        if owner(&code) == victim {
            fresh.push(code);
        }
        k += 1;
    }
    for code in &fresh {
        let statuses = redeem_parallel(&copies, code, ATTEMPTS).await;
        ledger.record(code, "fresh after the failover", &statuses);
        assert_eq!(
            tally(&statuses).get(&200),
            Some(&1),
            "fresh coupon {code} on the promoted master {new_master}: {:?}",
            tally(&statuses)
        );
    }
    for recovery in &recoveries {
        let code = recovery.code.as_deref().unwrap();
        let statuses = redeem_parallel(&copies, code, 2).await;
        ledger.record(code, "again", &statuses);
    }
    let twice = ledger.redeemed_twice();
    assert!(twice.is_empty(), "coupons redeemed twice: {twice:?}");
    println!("test took {:?}", started.elapsed());
}
