//! Writes held by a partition and delivered late: the store's connection goes dark with its bytes
//! held (not lost), the callers time out, the store replaces the connection and undoes what its
//! callers gave up on — and only then does the partition heal and deliver the held commands, on
//! the old connection, after their undo. Each must change nothing: the store refuses a write
//! received after its deadline.
//!
//! The held connections run through the test's [`Proxy`] (`silence` holds every open
//! connection's bytes, `unsilence` delivers them in order, as TCP does once a partition heals);
//! `MONITOR` on every node proves that the held commands did reach Redis.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use crate::common;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::RedisServer;
use common::proxy::Proxy;
use tokio::time::Instant;
use tollgate::claim::Claims;
use tollgate::key::Key;
use tollgate::lock::Locks;
use tollgate::rate::{Algorithm, Limit, RateCheck, RatePolicy};
use tollgate::store::{BeginRequest, PermitRequest};
use tollgate::store::{
    Hold, IdempotencyStore, PermitAttempt, PermitStore, RateStore, RedisStore, Store,
    StoreErrorKind,
};

/// The store timeout in these tests.
const STORE_TIMEOUT: Duration = Duration::from_millis(500);

fn unique(prefix: &str) -> String {
    format!("{prefix}-{:08x}", rand::random::<u32>())
}

/// How many calls of Lua (scripts and functions) the monitors have seen so far.
fn script_calls(monitors: &[Arc<Mutex<String>>]) -> usize {
    monitors
        .iter()
        .map(|m| {
            let seen = m.lock().unwrap();
            seen.matches("\"EVALSHA\"").count() + seen.matches("\"FCALL\"").count()
        })
        .sum()
}

/// What the partition held: five writes whose callers all gave up.
struct Held {
    coupon: String,
    lock: String,
    record: String,
    permits: String,
    caller: Key,
    policy: Arc<RatePolicy>,
}

/// Sends a claim, a lock acquisition, an idempotency claim, a permit acquisition and a rate
/// check into the dark
/// connection, as the last calls before the store replaces it: each times out once the store has
/// a new connection, so that the undos of the claim and the lock run on the new connection —
/// before the held writes.
///
/// The store replaces a connection once at least 3 calls in a row timed out over a second or
/// more; with a timeout of 500 ms: a ping at 0 (timed out at 0.5 s), the writes at 1.45 s, three
/// pings at 1.2 s (timed out at 1.7 s: replaced), the writes time out at 1.95 s.
async fn send_into_the_partition(store: &RedisStore, proxies: &[Proxy]) -> Held {
    let held = Held {
        coupon: unique("coupon"),
        lock: unique("lock"),
        record: format!("late:idem:{{{}}}", unique("record")),
        permits: format!("late:cc:{{{}}}", unique("permits")),
        caller: Key::new("late", unique("caller").as_bytes()),
        policy: Arc::new(
            RatePolicy::new("late:rl", Algorithm::Gcra, vec![Limit::per_minute("m", 10)]).unwrap(),
        ),
    };
    for proxy in proxies {
        proxy.silence();
    }
    let silenced = Instant::now();
    assert!(store.ping().await.is_err(), "setup: the connection is dark");
    let pings = {
        let store = store.clone();
        tokio::spawn(async move {
            tokio::time::sleep_until(silenced + Duration::from_millis(1200)).await;
            let ping = || store.ping();
            let (a, b, c) = tokio::join!(ping(), ping(), ping());
            assert!(
                a.is_err() && b.is_err() && c.is_err(),
                "setup: pings in the dark"
            );
        })
    };
    tokio::time::sleep_until(silenced + Duration::from_millis(1450)).await;
    let claims = Claims::new(store.clone());
    let locks = Locks::new(store.clone());
    let (claim, lock, begin, permit, check) = tokio::join!(
        claims.claim_once(&held.coupon, None),
        locks.try_acquire(&held.lock, Duration::from_secs(600)),
        store.idempotency_begin(
            BeginRequest::new(
                Hold::new(held.record.clone(), "t"),
                "fp",
                Duration::from_secs(600)
            ),
            Instant::now() + STORE_TIMEOUT
        ),
        store.permit_acquire(
            PermitRequest::new(
                Hold::new(&held.permits, "t"),
                format!("{}:fence", held.permits),
                1,
                Duration::from_secs(600),
                None
            ),
            Instant::now() + STORE_TIMEOUT
        ),
        store.check_rate(&held.policy, RateCheck::new(held.caller, 4)),
    );
    pings.await.unwrap();
    assert_eq!(claim.unwrap_err().kind(), StoreErrorKind::Timeout, "claim");
    assert!(lock.is_err(), "lock: {lock:?}");
    assert_eq!(begin.unwrap_err().kind(), StoreErrorKind::Timeout, "begin");
    assert_eq!(
        permit.unwrap_err().kind(),
        StoreErrorKind::Timeout,
        "permit"
    );
    assert_eq!(check.unwrap_err().kind(), StoreErrorKind::Timeout, "check");
    held
}

/// Waits until `store` answers again (on a connection it opened after the silence).
async fn wait_for_a_new_connection(store: &RedisStore) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while store.ping().await.is_err() {
        assert!(
            Instant::now() < deadline,
            "the store did not replace its dark connection within 10 s"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Waits until the undos of the claim and the lock (token-checked deletes) have reached Redis
/// on the store's new connection, while the partition still holds the writes they undo.
async fn wait_for_the_undos(monitors: &[Arc<Mutex<String>>]) {
    let release = redis::Script::new(include_str!(
        "../../src/store/redis/scripts/compare_and_delete.lua"
    ));
    let undos = || {
        monitors
            .iter()
            .map(|m| m.lock().unwrap().matches(release.get_hash()).count())
            .sum::<usize>()
    };
    common::wait_for("the undos of the claim and the lock reached Redis", || {
        undos() >= 2
    })
    .await;
}

/// Heals the partition and waits until the five held writes have reached Redis.
async fn deliver_late(proxies: &[Proxy], monitors: &[Arc<Mutex<String>>]) {
    let before = script_calls(monitors);
    for proxy in proxies {
        proxy.unsilence();
    }
    let deadline = Instant::now() + Duration::from_secs(5);
    while script_calls(monitors) < before + 5 {
        assert!(
            Instant::now() < deadline,
            "setup: the held writes did not reach Redis after the partition healed ({} of 5)",
            script_calls(monitors) - before
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // and ran
    tokio::time::sleep(Duration::from_millis(100)).await;
}

/// The setup held: the claim's undo ran on another connection before the held claim arrived.
fn assert_undone_first(monitors: &[Arc<Mutex<String>>]) {
    let claim = redis::Script::new(include_str!("../../src/store/redis/scripts/claim.lua"));
    let release = redis::Script::new(include_str!(
        "../../src/store/redis/scripts/compare_and_delete.lua"
    ));
    let seen: String = monitors.iter().map(|m| m.lock().unwrap().clone()).collect();
    // the client address of a MONITOR line: `+<time> [<db> <addr>] ...`
    let client = |line: &str| line.split(['[', ']']).nth(1).map(str::to_owned);
    let lines: Vec<&str> = seen.lines().collect();
    let late = lines
        .iter()
        .position(|l| l.contains(claim.get_hash()))
        .expect("setup: the held claim reached Redis");
    let undone = lines[..late]
        .iter()
        .any(|l| l.contains(release.get_hash()) && client(l) != client(lines[late]));
    assert!(
        undone,
        "setup: the claim's undo did not run on a new connection before the held claim arrived"
    );
}

/// After the late delivery: the coupon is won exactly once by 50 parallel redemptions over two
/// copies, the lock is free, the idempotency key is free, the one permit is free and the rate
/// check charged nothing.
async fn assert_nothing_changed(copies: [&RedisStore; 2], held: &Held) {
    let claims = copies.map(|s| Claims::new(s.clone()));
    let redemptions = (0..50).map(|i| {
        let claims = claims[i % 2].clone();
        let coupon = held.coupon.clone();
        tokio::spawn(async move { claims.claim_once(&coupon, None).await.unwrap().won() })
    });
    let won = futures_util::future::join_all(redemptions)
        .await
        .into_iter()
        .filter(|won| *won.as_ref().unwrap())
        .count();
    assert_eq!(
        won, 1,
        "50 redemptions of a coupon whose first one timed out"
    );

    let lock = Locks::new(copies[1].clone())
        .try_acquire(&held.lock, Duration::from_secs(5))
        .await;
    assert!(
        lock.is_ok(),
        "the lock is free after its stale attempt: {lock:?}"
    );

    let begin = copies[1]
        .idempotency_begin(
            BeginRequest::new(
                Hold::new(held.record.clone(), "u"),
                "fp",
                Duration::from_secs(5),
            ),
            common::soon(),
        )
        .await
        .unwrap();
    assert_eq!(begin, tollgate::store::IdempotencyBegin::Claimed);

    let permit = copies[1]
        .permit_acquire(
            PermitRequest::new(
                Hold::new(&held.permits, "u"),
                format!("{}:fence", held.permits),
                1,
                Duration::from_secs(5),
                None,
            ),
            common::soon(),
        )
        .await
        .unwrap();
    assert!(
        matches!(permit, PermitAttempt::Acquired { .. }),
        "the late acquisition took the one permit: {permit:?}"
    );

    let look = copies[1]
        .check_rate(&held.policy, RateCheck::new(held.caller, 0))
        .await
        .unwrap();
    assert_eq!(
        look.limits[0].remaining, 10,
        "the late rate check charged its cost"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn writes_held_by_a_partition_change_nothing_when_they_arrive_late() {
    let server = RedisServer::start();
    let proxies = [Proxy::start(server.addr()).await];
    let store = RedisStore::builder(proxies[0].url())
        .timeout(STORE_TIMEOUT)
        .build()
        .unwrap();
    // the connection is open and the store has read Redis's clock
    assert!(
        Claims::new(store.clone())
            .claim_once(unique("warm"), None)
            .await
            .unwrap()
            .won()
    );
    let monitors = [common::monitor(server.addr()).await];
    let held = send_into_the_partition(&store, &proxies).await;
    wait_for_a_new_connection(&store).await;
    wait_for_the_undos(&monitors).await;
    deliver_late(&proxies, &monitors).await;
    assert_undone_first(&monitors);
    let other = RedisStore::builder(server.url())
        .timeout(STORE_TIMEOUT)
        .build()
        .unwrap();
    assert_nothing_changed([&store, &other], &held).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_writes_held_by_a_partition_change_nothing_when_they_arrive_late() {
    let ports = common::cluster::RedisCluster::free_ports();
    let mut proxies = Vec::new();
    for &port in &ports {
        proxies.push(Proxy::start(std::net::SocketAddr::from(([127, 0, 0, 1], port))).await);
    }
    let announce: Vec<u16> = proxies.iter().map(|p| p.addr().port()).collect();
    let cluster = {
        let ports = ports.clone();
        tokio::task::spawn_blocking(move || {
            common::cluster::RedisCluster::start_announcing(&ports, Some(&announce))
        })
        .await
        .unwrap()
    };
    let connect = || {
        RedisStore::cluster_builder(proxies.iter().map(Proxy::url))
            .timeout(STORE_TIMEOUT)
            .connect()
    };
    let store = connect().await.unwrap();
    let claims = Claims::new(store.clone());
    // names over every master, so that each node's connection is open and its clock read
    for i in 0..30 {
        assert!(
            claims
                .claim_once(format!("warm-{i}-{}", unique("c")), None)
                .await
                .unwrap()
                .won()
        );
    }
    let mut monitors = Vec::new();
    for &port in &ports {
        monitors.push(common::monitor(std::net::SocketAddr::from(([127, 0, 0, 1], port))).await);
    }
    let held = send_into_the_partition(&store, &proxies).await;
    wait_for_a_new_connection(&store).await;
    wait_for_the_undos(&monitors).await;
    deliver_late(&proxies, &monitors).await;
    assert_undone_first(&monitors);
    let other = connect().await.unwrap();
    assert_nothing_changed([&store, &other], &held).await;
    drop(cluster);
}
