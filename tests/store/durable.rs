//! Durable writes (`wait_replicas`) on real redis-server processes: a primary with a replica
//! acknowledges claims, locks and idempotency records; a primary whose replica is gone refuses
//! them — and undoes what it wrote — while rate checks on the same store go on unhindered.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use crate::common;

use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::RedisServer;
use common::proxy::Proxy;
use tollgate::claim::Claims;
use tollgate::key::Key;
use tollgate::lock::{LockError, Locks};
use tollgate::rate::{Algorithm, Limit, RateCheck, RatePolicy};
use tollgate::store::{BeginRequest, CompleteRequest};
use tollgate::store::{
    Hold, IdempotencyBegin, IdempotencyState, IdempotencyStore, RateStore, RedisStore,
    StoreErrorKind,
};

/// A replica of `primary`, killed on drop (with its directory).
struct Replica {
    child: Child,
    _dir: tempfile::TempDir,
}

impl Replica {
    fn of(primary: &RedisServer) -> Self {
        Self::via(primary, primary.port())
    }

    /// A replica of `primary` that reaches it at `port` (a proxy's, say).
    fn via(primary: &RedisServer, port: u16) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let own = common::free_port();
        let child = Command::new("redis-server")
            .args(["--port", &own.to_string(), "--bind", "127.0.0.1"])
            .args(["--save", "", "--appendonly", "no"])
            .args(["--replicaof", "127.0.0.1", &port.to_string()])
            .arg("--dir")
            .arg(dir.path())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("redis-server on PATH (sudo apt-get install redis-server)");
        let replica = Self { child, _dir: dir };
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if primary
                .info_field("replication", "connected_slaves")
                .as_deref()
                == Some("1")
                && primary
                    .info_field("replication", "slave0")
                    .is_some_and(|s| s.contains("state=online"))
            {
                return replica;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        panic!("the replica did not come online within 10 s");
    }
}

impl Drop for Replica {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A store on `server` whose writes one replica must acknowledge within `timeout` (3/4 of it
/// for the `WAIT`).
fn durable(server: &RedisServer, timeout: Duration) -> RedisStore {
    RedisStore::builder(server.url())
        .timeout(timeout)
        .wait_replicas(1)
        .build()
        .unwrap()
}

/// A write nobody acknowledged: refused (too few replicas within the wait), or — on a busy
/// machine — not answered within the store timeout; a failure either way, never a success.
fn assert_refused(error: &tollgate::store::StoreError) {
    assert!(
        matches!(
            error.kind(),
            StoreErrorKind::Unavailable | StoreErrorKind::Timeout
        ),
        "{error}"
    );
}

fn unique(name: &str) -> String {
    format!("{name}-{:016x}", rand::random::<u64>())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acknowledged_writes_succeed() {
    let server = RedisServer::start();
    let _replica = Replica::of(&server);
    // generous: a replica starved of CPU on a busy machine still acknowledges within it
    let store = durable(&server, Duration::from_secs(4));
    assert_eq!(store.wait_replicas(), 1);
    let claims = Claims::new(store.clone());
    let name = unique("coupon");
    assert!(claims.claim_once(&name, None).await.unwrap().won());
    assert!(!claims.claim_once(&name, None).await.unwrap().won());
    let locks = Locks::new(store.clone());
    let guard = locks
        .try_acquire(unique("lock"), Duration::from_secs(5))
        .await
        .unwrap();
    guard.extend().await.unwrap();
    guard.release().await.unwrap();
    let key = unique("idem");
    let begin = store
        .idempotency_begin(
            BeginRequest::new(Hold::new(key.clone(), "t"), "fp", Duration::from_secs(5)),
            crate::common::soon(),
        )
        .await
        .unwrap();
    assert_eq!(begin, IdempotencyBegin::Claimed);
    let record = bytes::Bytes::from_static(b"record");
    assert!(
        store
            .idempotency_complete(
                CompleteRequest::new(Hold::new(key, "t"), record, Duration::from_secs(60)),
                crate::common::soon()
            )
            .await
            .unwrap()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unacknowledged_writes_fail_closed_and_are_undone() {
    let server = RedisServer::start();
    let store = durable(&server, Duration::from_secs(2)); // no replica: nothing can acknowledge
    let claims = Claims::new(store.clone());
    let name = unique("coupon");
    let error = claims.claim_once(&name, None).await.unwrap_err();
    assert_refused(&error);
    let locks = Locks::new(store.clone());
    let lock = unique("lock");
    assert!(matches!(
        locks.try_acquire(&lock, Duration::from_secs(60)).await,
        Err(LockError::Store(_))
    ));
    let key = unique("idem");
    assert!(
        store
            .idempotency_begin(
                BeginRequest::new(Hold::new(key.clone(), "t"), "fp", Duration::from_secs(60)),
                crate::common::soon()
            )
            .await
            .is_err()
    );
    // what was written but never acknowledged is undone before the failure is told: a plain
    // store sees nothing held at once
    let plain = server.store();
    assert!(
        Claims::new(plain.clone())
            .claim_once(&name, None)
            .await
            .unwrap()
            .won(),
        "a refused claim still holds the coupon"
    );
    assert!(
        Locks::new(plain.clone())
            .try_acquire(&lock, Duration::from_secs(1))
            .await
            .is_ok(),
        "a refused lock acquisition still holds the lock"
    );
    let begin = plain
        .idempotency_begin(
            BeginRequest::new(Hold::new(key, "u"), "fp", Duration::from_secs(60)),
            crate::common::soon(),
        )
        .await
        .unwrap();
    assert_eq!(
        begin,
        IdempotencyBegin::Claimed,
        "a refused idempotency claim still holds the key"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiting_write_does_not_hold_up_rate_checks() {
    let server = RedisServer::start();
    let store = durable(&server, Duration::from_secs(2)); // no replica: every WAIT runs to its timeout
    let policy = Arc::new(
        RatePolicy::new("t:rl", Algorithm::Gcra, vec![Limit::per_second("s", 1000)]).unwrap(),
    );
    let check = || store.check_rate(&policy, RateCheck::new(Key::new("t", b"k"), 1));
    check().await.unwrap(); // the scripts are loaded
    let claims = Claims::new(store.clone());
    let waiting = tokio::spawn({
        let claims = claims.clone();
        async move { claims.claim_once(unique("slow"), None).await }
    });
    tokio::time::sleep(Duration::from_millis(20)).await;
    let mut decided = 0;
    for _ in 0..20 {
        assert!(check().await.unwrap().admitted);
        decided += 1;
    }
    assert!(
        !waiting.is_finished(),
        "setup: the WAIT returned before {decided} rate checks were decided"
    );
    assert!(waiting.await.unwrap().is_err(), "no replica acknowledged");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_a_cluster_without_replicas_writes_are_refused_and_undone() {
    let cluster = common::cluster::RedisCluster::shared();
    let store = RedisStore::cluster_builder(cluster.urls())
        .timeout(Duration::from_secs(2))
        .wait_replicas(1)
        .connect()
        .await
        .unwrap();
    let plain = cluster.store().await;
    for i in 0..6 {
        // names over every master
        let name = unique(&format!("coupon-{i}"));
        let error = Claims::new(store.clone())
            .claim_once(&name, None)
            .await
            .unwrap_err();
        assert_eq!(error.kind(), StoreErrorKind::Unavailable, "{error}");
        let start = Instant::now();
        while !Claims::new(plain.clone())
            .claim_once(&name, None)
            .await
            .unwrap()
            .won()
        {
            assert!(
                start.elapsed() < Duration::from_secs(3),
                "the refused claim was not undone"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

/// A primary whose one replica reaches it through a proxy: its replication link can be delayed
/// or held.
async fn behind_a_proxy() -> (RedisServer, Proxy, Replica) {
    let server = RedisServer::start();
    let proxy = Proxy::start(server.addr()).await;
    let replica = Replica::via(&server, proxy.addr().port());
    // the replica acknowledges writes before the test begins
    let warm = Claims::new(durable(&server, Duration::from_secs(2)));
    let deadline = Instant::now() + Duration::from_secs(10);
    while warm.claim_once(unique("warm"), None).await.is_err() {
        assert!(
            Instant::now() < deadline,
            "setup: the replica never acknowledged a write"
        );
    }
    (server, proxy, replica)
}

/// While a claim waits for its replica, another copy learns that the coupon is in progress — not
/// that it is taken; when the replica never acknowledges, the claim is undone and the coupon is
/// won by the next redemption.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_waiting_for_its_replicas_is_pending_to_others_and_free_once_refused() {
    let (server, proxy, _replica) = behind_a_proxy().await;
    let (a, b) = (
        durable(&server, Duration::from_secs(2)),
        durable(&server, Duration::from_secs(2)),
    );
    let (a, b) = (Claims::new(a), Claims::new(b));
    assert!(
        a.claim_once(unique("warm"), None).await.unwrap().won(),
        "setup: acknowledged"
    );
    proxy.silence();
    let claims_held = || {
        let keys: Vec<String> = redis::cmd("KEYS")
            .arg("tollgate:claim:*")
            .query(&mut server.conn())
            .unwrap();
        keys.len()
    };
    let before = claims_held();
    let coupon = unique("coupon");
    let waiting = tokio::spawn({
        let (a, coupon) = (a.clone(), coupon.clone());
        async move { a.claim_once(&coupon, None).await }
    });
    common::wait_for("a's claim written (waiting for its replica)", || {
        claims_held() > before
    })
    .await;
    let meanwhile = b.claim_once(&coupon, None).await.unwrap();
    assert!(
        !meanwhile.won() && meanwhile.pending(),
        "in progress: {meanwhile:?}"
    );
    assert_refused(&waiting.await.unwrap().unwrap_err());
    proxy.unsilence();
    let after = b.claim_once(&coupon, None).await.unwrap();
    assert!(after.won(), "the refused claim was undone: {after:?}");
}

/// A holder claiming again (to learn the outcome of an attempt whose answer was lost) while the
/// replica does not acknowledge: the answer is a failure, but the claim it won before stays its
/// own — nobody else wins it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reclaim_refused_by_its_replicas_keeps_the_claim_it_won_before() {
    let (server, proxy, _replica) = behind_a_proxy().await;
    let store = durable(&server, Duration::from_secs(2));
    let claims = Claims::new(store.clone());
    let coupon = unique("coupon");
    assert!(
        claims
            .claim_once_as(&coupon, "order-1", None)
            .await
            .unwrap()
            .won()
    );
    proxy.silence();
    assert_refused(
        &claims
            .claim_once_as(&coupon, "order-1", None)
            .await
            .unwrap_err(),
    );
    proxy.unsilence();
    let other = Claims::new(server.store());
    let lost = other.claim_once_as(&coupon, "order-2", None).await.unwrap();
    assert!(
        !lost.won(),
        "another holder won a claim order-1 had won: {lost:?}"
    );
    assert_eq!(lost.holder(), "order-1");
}

/// A completion that the replica has not acknowledged is not replayed: the next request with the
/// key is told that it is still running, until a completion is acknowledged.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unacknowledged_completion_reads_as_running_not_completed() {
    let (server, proxy, _replica) = behind_a_proxy().await;
    let store = durable(&server, Duration::from_secs(2));
    let key = format!("t:idem:{{{}}}", unique("payment"));
    let lease = Duration::from_secs(30);
    let begin = |token: &str| {
        store.idempotency_begin(
            BeginRequest::new(Hold::new(key.clone(), token), "fp", lease),
            common::soon(),
        )
    };
    let complete = || {
        let record = bytes::Bytes::from_static(b"paid");
        store.idempotency_complete(
            CompleteRequest::new(Hold::new(key.clone(), "t"), record, lease),
            common::soon(),
        )
    };
    assert_eq!(begin("t").await.unwrap(), IdempotencyBegin::Claimed);
    proxy.silence();
    assert_refused(&complete().await.unwrap_err());
    let retry = begin("u").await.unwrap();
    assert!(
        matches!(retry, IdempotencyBegin::InFlight { .. }),
        "{retry:?}"
    );
    // an operator reading the record is told the same
    let read = store.idempotency_state(&key).await.unwrap();
    assert!(
        matches!(read, IdempotencyState::InFlight { age: Some(_), .. }),
        "{read:?}"
    );
    proxy.unsilence();
    // the layer sends the completion again within the lease
    let deadline = Instant::now() + Duration::from_secs(10);
    while complete().await.is_err() {
        assert!(Instant::now() < deadline, "the replica never acknowledged");
    }
    let deadline = Instant::now() + Duration::from_secs(2);
    loop {
        match begin("u").await.unwrap() {
            IdempotencyBegin::Completed(record) => {
                assert_eq!(&record[..], b"paid");
                let read = store.idempotency_state(&key).await.unwrap();
                match read {
                    IdempotencyState::Completed { response, .. } => {
                        break assert_eq!(&response[..], b"paid");
                    }
                    other => panic!("replayed, but read as {other:?}"),
                }
            }
            other => assert!(
                Instant::now() < deadline,
                "not replayed once acknowledged: {other:?}"
            ),
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Group commit: with the replica 10 ms away each way (a `WAIT` costs 20 ms), 200 concurrent
/// claims over two copies are all acknowledged within a 1 s timeout — one `WAIT` after each
/// pipeline of writes, not one per write behind each other.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_hundred_concurrent_durable_claims_are_acknowledged_in_time() {
    let (server, proxy, _replica) = behind_a_proxy().await;
    proxy.delay(Duration::from_millis(10));
    let copies = [
        durable(&server, Duration::from_secs(1)),
        durable(&server, Duration::from_secs(1)),
    ];
    for copy in &copies {
        assert!(
            Claims::new(copy.clone())
                .claim_once(unique("warm"), None)
                .await
                .unwrap()
                .won()
        );
    }
    let claims = (0..200).map(|i| {
        let claims = Claims::new(copies[i % 2].clone());
        tokio::spawn(async move { claims.claim_once(unique("coupon"), None).await })
    });
    let outcomes = futures_util::future::join_all(claims).await;
    let won = outcomes
        .iter()
        .filter(|o| matches!(o, Ok(Ok(claim)) if claim.won()))
        .count();
    let failed: Vec<_> = outcomes
        .iter()
        .filter_map(|o| o.as_ref().unwrap().as_ref().err())
        .take(3)
        .collect();
    assert_eq!(won, 200, "acknowledged in time; first failures: {failed:?}");
}

/// A store on `server` whose writes count once in the primary's append-only file
/// (`wait_aof(true, 0)`), within a timeout a busy machine's fsyncs fit in.
fn on_disk(server: &RedisServer) -> RedisStore {
    RedisStore::builder(server.url())
        .timeout(Duration::from_secs(4))
        .wait_aof(true, 0)
        .build()
        .unwrap()
}

/// Whether `server` knows `command` (`WAITAOF`: Redis 7.2 and later, Valkey).
fn knows_command(server: &RedisServer, command: &str) -> bool {
    let docs: redis::Value = redis::cmd("COMMAND")
        .arg("INFO")
        .arg(command)
        .query(&mut server.conn())
        .unwrap();
    matches!(docs, redis::Value::Array(ref entries) if entries.iter().any(|e| *e != redis::Value::Nil))
}

/// `wait_aof(true, 0)` on a primary with an fsynced append-only file: where the server has
/// `WAITAOF`, a claim counts once the file has it, and exactly one of two claims wins; where it
/// has not (Redis 7.0), every durable write fails with a configuration error that names the
/// command — and, like any unacknowledged write, is undone before the failure is told.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wait_aof_counts_a_write_once_on_disk_or_says_why_it_cannot() {
    let server = RedisServer::start_with_aof();
    let store = on_disk(&server);
    assert_eq!(store.wait_replicas(), 0);
    let claims = Claims::new(store.clone());
    let name = unique("coupon");
    let first = claims.claim_once(&name, None).await;
    if knows_command(&server, "waitaof") {
        assert!(first.unwrap().won(), "the first claim, on disk");
        assert!(!claims.claim_once(&name, None).await.unwrap().won());
    } else {
        let error = first.unwrap_err();
        assert_eq!(error.kind(), StoreErrorKind::Config, "{error}");
        assert!(
            error.to_string().contains("WAITAOF needs Redis 7.2"),
            "{error}"
        );
        assert!(
            Claims::new(server.store())
                .claim_once(&name, None)
                .await
                .unwrap()
                .won(),
            "a claim whose wait was refused still holds the coupon"
        );
    }
}

/// `wait_aof(true, ..)` against a primary without an append-only file: no write can ever be
/// acknowledged, and the error says what to change rather than "unavailable".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wait_aof_on_a_primary_without_an_append_only_file_says_so() {
    let server = RedisServer::start();
    let store = on_disk(&server);
    let error = Locks::new(store)
        .try_acquire(unique("lock"), Duration::from_secs(5))
        .await
        .unwrap_err();
    let LockError::Store(error) = error else {
        panic!("a store error, not {error:?}");
    };
    assert_eq!(error.kind(), StoreErrorKind::Config, "{error}");
    let hint = if knows_command(&server, "waitaof") {
        "appendonly"
    } else {
        "WAITAOF needs Redis 7.2"
    };
    assert!(error.to_string().contains(hint), "{error}");
}
