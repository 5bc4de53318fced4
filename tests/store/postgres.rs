//! PgStore beyond the conformance suite: migrations, table persistence, purging expired rows,
//! outages and timeouts, advisory locks, configuration errors.
#![allow(clippy::unwrap_used, clippy::expect_used)]
use crate::common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::postgres::{PgServer, shared, unique_schema};
use tollgate::ConfigErrorKind;
use tollgate::key::Key;
use tollgate::rate::{Algorithm, Limit, LimitTable, RateCheck, RatePolicy};
use tollgate::store::{BeginRequest, ClaimRequest, LockRequest};
use tollgate::store::{
    Hold, IdempotencyBegin, IdempotencyState, IdempotencyStore, LimitsStore, LockAttempt,
    LockStore, PgStore, RateStore, Saved, Store, StoreErrorKind,
};

/// A pool the application would make itself on `server`: plain connections, no settings.
fn given_pool(server: &PgServer) -> deadpool_postgres::Pool {
    let mut config = deadpool_postgres::Config::new();
    config.url = Some(server.url());
    config
        .create_pool(
            Some(deadpool_postgres::Runtime::Tokio1),
            tokio_postgres::NoTls,
        )
        .unwrap()
}

async fn server() -> &'static PgServer {
    tokio::task::spawn_blocking(shared).await.unwrap()
}

/// The number of rows of `table` in `schema`.
async fn rows(client: &tokio_postgres::Client, schema: &str, table: &str) -> i64 {
    client
        .query_one(&format!("SELECT count(*) FROM \"{schema}\".{table}"), &[])
        .await
        .unwrap()
        .get(0)
}

/// `'u'` (unlogged) or `'p'` (logged) for `table` in `schema`.
async fn persistence(client: &tokio_postgres::Client, schema: &str, table: &str) -> char {
    let row = client
        .query_one(
            "SELECT c.relpersistence FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
             WHERE n.nspname = $1 AND c.relname = $2",
            &[&schema, &table],
        )
        .await
        .unwrap();
    char::from(row.get::<_, i8>(0) as u8)
}

fn policy(algorithm: Algorithm, limit: Limit) -> Arc<RatePolicy> {
    let ns = format!("t{}:rl", rand::random::<u32>());
    Arc::new(RatePolicy::new(ns, algorithm, vec![limit]).unwrap())
}

fn caller(name: &str) -> Key {
    Key::new("test", name.as_bytes())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migrate_is_idempotent_and_safe_to_run_at_once() {
    let server = server().await;
    let schema = unique_schema();
    let stores: Vec<PgStore> = (0..6)
        .map(|_| server.builder().schema(schema.clone()).build().unwrap())
        .collect();
    // six copies starting together
    let results = futures_util::future::join_all(stores.iter().map(PgStore::migrate)).await;
    for result in results {
        result.expect("every concurrent migration succeeds");
    }
    // and again, one after the other
    stores[0].migrate().await.unwrap();
    stores[1].migrate().await.unwrap();
    let client = server.client().await;
    let versions: Vec<i32> = client
        .query(&format!("SELECT version FROM \"{schema}\".migrations"), &[])
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(versions, vec![9, 10, 11, 12]);
    let won = stores[2]
        .claim(ClaimRequest::new("k", "a", None), crate::common::soon())
        .await
        .unwrap();
    assert!(won.won);
    let lost = stores[3]
        .claim(ClaimRequest::new("k", "b", None), crate::common::soon())
        .await
        .unwrap();
    assert!(!lost.won && lost.holder == "a", "one schema, seen by all");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rate_tables_are_unlogged_unless_asked_and_the_rest_always_logged() {
    let server = server().await;
    let client = server.client().await;
    let schema = unique_schema();
    let store = server
        .builder()
        .schema(schema.clone())
        .connect()
        .await
        .unwrap();
    assert_eq!(persistence(&client, &schema, "rate_limits").await, 'u');
    assert_eq!(persistence(&client, &schema, "rate_log").await, 'u');
    assert_eq!(persistence(&client, &schema, "rate_attempts").await, 'u');
    for table in ["holds", "fences", "releases", "idempotency", "migrations"] {
        assert_eq!(persistence(&client, &schema, table).await, 'p', "{table}");
    }
    // state written while unlogged stays when the tables become logged
    let p = policy(Algorithm::SlidingLog, Limit::per_minute("m", 3));
    assert!(
        store
            .check_rate(&p, RateCheck::new(caller("a"), 1))
            .await
            .unwrap()
            .admitted
    );
    let logged = server
        .builder()
        .schema(schema.clone())
        .unlogged_rate_limits(false)
        .connect()
        .await
        .unwrap();
    assert_eq!(persistence(&client, &schema, "rate_limits").await, 'p');
    assert_eq!(persistence(&client, &schema, "rate_log").await, 'p');
    assert_eq!(persistence(&client, &schema, "rate_attempts").await, 'p');
    let out = logged
        .check_rate(&p, RateCheck::new(caller("a"), 1))
        .await
        .unwrap();
    assert_eq!(out.limits[0].remaining, 1);
    // and back
    store.migrate().await.unwrap();
    assert_eq!(persistence(&client, &schema, "rate_limits").await, 'u');
    assert_eq!(persistence(&client, &schema, "rate_log").await, 'u');
    assert_eq!(persistence(&client, &schema, "rate_attempts").await, 'u');
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn purge_removes_expired_rows_and_keeps_live_ones() {
    let server = server().await;
    let client = server.client().await;
    let store = server.builder().purge_batch(2).connect().await.unwrap();
    let schema = store.schema().to_owned();
    let brief = Duration::from_millis(100);
    let long = Duration::from_secs(60);
    // expiring soon: 7 claims, a lock, an idempotency claim, a sliding log and a GCRA state
    for i in 0..7 {
        assert!(
            store
                .claim(
                    ClaimRequest::new(format!("brief-{i}"), "h", Some(brief)),
                    crate::common::soon()
                )
                .await
                .unwrap()
                .won
        );
    }
    let lock = store
        .lock_acquire(
            LockRequest::new(Hold::new("lock-brief", "t"), "lock-brief:fence", brief),
            crate::common::soon(),
        )
        .await
        .unwrap();
    assert!(matches!(lock, LockAttempt::Acquired { .. }));
    let idem = store
        .idempotency_begin(
            BeginRequest::new(Hold::new("idem-brief", "t"), "fp", brief),
            crate::common::soon(),
        )
        .await
        .unwrap();
    assert_eq!(idem, IdempotencyBegin::Claimed);
    let log = policy(Algorithm::SlidingLog, Limit::new("l", 5, brief));
    let gcra = policy(Algorithm::Gcra, Limit::new("g", 1, brief));
    assert!(
        store
            .check_rate(&log, RateCheck::new(caller("a"), 3))
            .await
            .unwrap()
            .admitted
    );
    assert!(
        store
            .check_rate(&gcra, RateCheck::new(caller("a"), 1))
            .await
            .unwrap()
            .admitted
    );
    // live: a claim kept forever, a claim, a lock and a record for a minute, a minute's log
    assert!(
        store
            .claim(
                ClaimRequest::new("forever", "h", None),
                crate::common::soon()
            )
            .await
            .unwrap()
            .won
    );
    assert!(
        store
            .claim(
                ClaimRequest::new("minute", "h", Some(long)),
                crate::common::soon()
            )
            .await
            .unwrap()
            .won
    );
    let held = store
        .lock_acquire(
            LockRequest::new(Hold::new("lock-long", "t"), "lock-long:fence", long),
            crate::common::soon(),
        )
        .await
        .unwrap();
    assert!(matches!(held, LockAttempt::Acquired { .. }));
    let record = store
        .idempotency_begin(
            BeginRequest::new(Hold::new("idem-long", "t"), "fp", long),
            crate::common::soon(),
        )
        .await
        .unwrap();
    assert_eq!(record, IdempotencyBegin::Claimed);
    let minute = policy(Algorithm::SlidingLog, Limit::per_minute("m", 5));
    assert!(
        store
            .check_rate(&minute, RateCheck::new(caller("b"), 2))
            .await
            .unwrap()
            .admitted
    );
    assert_eq!(rows(&client, &schema, "rate_log").await, 2);

    tokio::time::sleep(Duration::from_millis(250)).await;
    // 7 claims + 1 lock + 1 record + 2 rate rows, in batches of 2 per table
    assert_eq!(store.purge_expired().await.unwrap(), 11);
    assert_eq!(
        store.purge_expired().await.unwrap(),
        0,
        "nothing left to purge"
    );
    assert_eq!(
        rows(&client, &schema, "holds").await,
        3,
        "forever, minute, lock-long"
    );
    assert_eq!(rows(&client, &schema, "idempotency").await, 1);
    assert_eq!(rows(&client, &schema, "rate_limits").await, 1);
    assert_eq!(
        rows(&client, &schema, "rate_log").await,
        1,
        "the expired log went with its row"
    );
    // fencing counters live 30 days: both stay, so tokens keep rising
    assert_eq!(rows(&client, &schema, "fences").await, 2);

    // the live state is untouched
    assert!(
        !store
            .claim(
                ClaimRequest::new("forever", "x", None),
                crate::common::soon()
            )
            .await
            .unwrap()
            .won
    );
    assert!(
        !store
            .claim(
                ClaimRequest::new("minute", "x", None),
                crate::common::soon()
            )
            .await
            .unwrap()
            .won
    );
    let busy = store
        .lock_acquire(
            LockRequest::new(Hold::new("lock-long", "x"), "lock-long:fence", long),
            crate::common::soon(),
        )
        .await
        .unwrap();
    assert!(matches!(busy, LockAttempt::Held { .. }));
    let running = store
        .idempotency_begin(
            BeginRequest::new(Hold::new("idem-long", "x"), "fp", long),
            crate::common::soon(),
        )
        .await
        .unwrap();
    assert!(matches!(running, IdempotencyBegin::InFlight { .. }));
    let out = store
        .check_rate(&minute, RateCheck::new(caller("b"), 0))
        .await
        .unwrap();
    assert_eq!(out.limits[0].remaining, 3);
    // and the purged keys are free
    assert!(
        store
            .claim(
                ClaimRequest::new("brief-0", "x", None),
                crate::common::soon()
            )
            .await
            .unwrap()
            .won
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_background_purge_runs_and_stops_with_the_store() {
    let server = server().await;
    let client = server.client().await;
    let store = server
        .builder()
        .purge_interval(Duration::from_millis(100))
        .connect()
        .await
        .unwrap();
    let schema = store.schema().to_owned();
    for i in 0..3 {
        let ttl = Some(Duration::from_millis(50));
        assert!(
            store
                .claim(
                    ClaimRequest::new(format!("c{i}"), "h", ttl),
                    crate::common::soon()
                )
                .await
                .unwrap()
                .won
        );
    }
    let deadline = Instant::now() + Duration::from_secs(5);
    while rows(&client, &schema, "holds").await > 0 {
        assert!(Instant::now() < deadline, "the background purge never ran");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // dropped: no purge task is left behind to delete what expires afterwards
    let clone = store.clone();
    drop(store);
    assert!(
        clone
            .claim(
                ClaimRequest::new("late", "h", Some(Duration::from_millis(50))),
                crate::common::soon()
            )
            .await
            .unwrap()
            .won
    );
    drop(clone);
    tokio::time::sleep(Duration::from_millis(400)).await;
    assert_eq!(rows(&client, &schema, "holds").await, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopped_server_gives_an_error_within_the_timeout_then_recovers() {
    let mut server = tokio::task::spawn_blocking(PgServer::start).await.unwrap();
    let timeout = Duration::from_millis(500);
    let store = PgStore::builder(server.url())
        .timeout(timeout)
        .purge_interval(None)
        .connect()
        .await
        .unwrap();
    assert!(
        store
            .claim(ClaimRequest::new("kept", "a", None), crate::common::soon())
            .await
            .unwrap()
            .won
    );
    let p = policy(Algorithm::Gcra, Limit::per_minute("m", 5));
    let server = tokio::task::spawn_blocking(move || {
        server.stop();
        server
    })
    .await
    .unwrap();
    let mut server = server;
    for _ in 0..3 {
        let started = Instant::now();
        let errors = [
            store.ping().await.unwrap_err(),
            store
                .check_rate(&p, RateCheck::new(caller("a"), 1))
                .await
                .unwrap_err(),
            store
                .claim(ClaimRequest::new("other", "b", None), crate::common::soon())
                .await
                .unwrap_err(),
        ];
        let elapsed = started.elapsed();
        assert!(
            elapsed < 3 * timeout + Duration::from_millis(300),
            "three calls took {elapsed:?}"
        );
        for error in errors {
            assert!(
                matches!(
                    error.kind(),
                    StoreErrorKind::Unavailable | StoreErrorKind::Timeout
                ),
                "{error}"
            );
        }
    }
    server = tokio::task::spawn_blocking(move || {
        server.restart();
        server
    })
    .await
    .unwrap();
    // the pool replaces its dead connections by itself
    store
        .ping()
        .await
        .expect("the store recovers after a restart");
    let again = store
        .claim(ClaimRequest::new("kept", "b", None), crate::common::soon())
        .await
        .unwrap();
    assert!(
        !again.won && again.holder == "a",
        "claims are logged: kept across the restart"
    );
    drop(server);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_blocked_on_the_server_times_out() {
    let server = server().await;
    let store = server
        .builder()
        .timeout(Duration::from_millis(300))
        .connect()
        .await
        .unwrap();
    assert!(
        store
            .claim(ClaimRequest::new("busy", "a", None), crate::common::soon())
            .await
            .unwrap()
            .won
    );
    // another session holds the claim's row, uncommitted
    let mut client = server.client().await;
    let tx = client.transaction().await.unwrap();
    tx.execute(
        &format!(
            "SELECT 1 FROM \"{}\".holds WHERE key = 'busy' FOR UPDATE",
            store.schema()
        ),
        &[],
    )
    .await
    .unwrap();
    let started = Instant::now();
    let error = store
        .claim(ClaimRequest::new("busy", "b", None), crate::common::soon())
        .await
        .unwrap_err();
    let elapsed = started.elapsed();
    assert_eq!(error.kind(), StoreErrorKind::Timeout, "{error}");
    assert!(
        // bounded (the row stays locked until the rollback below)
        elapsed >= Duration::from_millis(290) && elapsed < Duration::from_secs(3),
        "{elapsed:?}"
    );
    tx.rollback().await.unwrap();
    // the store goes on, on another connection
    let lost = store
        .claim(ClaimRequest::new("busy", "b", None), crate::common::soon())
        .await
        .unwrap();
    assert!(!lost.won);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nothing_listening_is_unavailable_at_once() {
    let port = common::free_port();
    let store = PgStore::builder(format!("postgres://postgres@127.0.0.1:{port}/postgres"))
        .timeout(Duration::from_secs(2))
        .purge_interval(None)
        .build()
        .unwrap();
    let started = Instant::now();
    let error = store.ping().await.unwrap_err();
    assert_eq!(error.kind(), StoreErrorKind::Unavailable, "{error}");
    assert!(started.elapsed() < Duration::from_secs(1));
    let error = store.migrate().await.unwrap_err();
    assert_eq!(error.kind(), StoreErrorKind::Unavailable, "{error}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn calls_before_the_migration_are_protocol_errors() {
    let server = server().await;
    let store = server.builder().build().unwrap();
    let error = store
        .claim(ClaimRequest::new("k", "a", None), crate::common::soon())
        .await
        .unwrap_err();
    assert_eq!(error.kind(), StoreErrorKind::Protocol, "{error}");
    store.migrate().await.unwrap();
    assert!(
        store
            .claim(ClaimRequest::new("k", "a", None), crate::common::soon())
            .await
            .unwrap()
            .won
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_advisory_lock_excludes_a_second_transaction_until_commit() {
    let server = server().await;
    let store = server.builder().connect().await.unwrap();
    let mut first = store.pool().get().await.unwrap();
    let mut second = store.pool().get().await.unwrap();
    let tx1 = first.transaction().await.unwrap();
    PgStore::advisory_xact_lock(&tx1, "invoice-17")
        .await
        .unwrap();
    {
        let tx2 = second.transaction().await.unwrap();
        assert!(
            !PgStore::try_advisory_xact_lock(&tx2, "invoice-17")
                .await
                .unwrap()
        );
        assert!(
            PgStore::try_advisory_xact_lock(&tx2, "invoice-18")
                .await
                .unwrap()
        );
        tx2.rollback().await.unwrap();
    }
    // a waiting transaction goes on only once the holder commits
    let waiter = tokio::spawn(async move {
        let tx2 = second.transaction().await.unwrap();
        PgStore::advisory_xact_lock(&tx2, "invoice-17")
            .await
            .unwrap();
        let taken_at = Instant::now();
        tx2.commit().await.unwrap();
        taken_at
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!waiter.is_finished(), "the second transaction waits");
    let committed_at = Instant::now();
    tx1.commit().await.unwrap();
    let taken_at = tokio::time::timeout(Duration::from_secs(5), waiter)
        .await
        .expect("the waiter gets the lock")
        .unwrap();
    assert!(taken_at >= committed_at);
    // released by the commit: free again
    let mut third = store.pool().get().await.unwrap();
    let tx3 = third.transaction().await.unwrap();
    assert!(
        PgStore::try_advisory_xact_lock(&tx3, "invoice-17")
            .await
            .unwrap()
    );
    tx3.commit().await.unwrap();
}

#[tokio::test]
async fn invalid_settings_are_config_errors() {
    let bad_schema = PgStore::builder("postgres://127.0.0.1/app")
        .schema("drop table x;")
        .build()
        .unwrap_err();
    assert_eq!(bad_schema.kind(), ConfigErrorKind::Store);
    let bad_url = PgStore::builder("postgres://127.0.0.1:notaport/app")
        .build()
        .unwrap_err();
    assert_eq!(bad_url.kind(), ConfigErrorKind::Store);
    let error = PgStore::builder("postgres://127.0.0.1/app")
        .schema("Upper")
        .connect()
        .await
        .unwrap_err();
    assert_eq!(error.kind(), StoreErrorKind::Config);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_from_a_given_pool_works_in_its_schema() {
    let server = server().await;
    let pool = given_pool(server);
    let schema = unique_schema();
    let store = PgStore::pool_builder(pool)
        .schema(schema.clone())
        .connect()
        .await
        .unwrap();
    assert_eq!(store.schema(), schema);
    let p = policy(Algorithm::SlidingCounter, Limit::per_minute("m", 1));
    assert!(
        store
            .check_rate(&p, RateCheck::new(caller("a"), 1))
            .await
            .unwrap()
            .admitted
    );
    assert!(
        !store
            .check_rate(&p, RateCheck::new(caller("a"), 1))
            .await
            .unwrap()
            .admitted
    );
    let shared_store = common::postgres::store().await;
    assert_ne!(shared_store.schema(), store.schema());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_sent_again_answers_as_its_first_run() {
    let server = server().await;
    let store = server.builder().connect().await.unwrap();
    let client = server.client().await;
    let s = store.schema();
    let acquired = store
        .lock_acquire(
            LockRequest::new(Hold::new("lock", "t"), "lock:fence", Duration::from_secs(5)),
            crate::common::soon(),
        )
        .await
        .unwrap();
    assert!(matches!(acquired, LockAttempt::Acquired { .. }));
    let release = format!("SELECT \"{s}\".release_hold('lock', 't', $1, 60000)");
    let released = |call| released_by(&client, &release, call);
    assert!(released("call-1").await);
    assert!(released("call-1").await, "the same call re-sent");
    assert!(!released("call-2").await, "another call finds it gone");
    // the same for an idempotency claim
    let claimed = store
        .idempotency_begin(
            BeginRequest::new(Hold::new("idem", "t"), "fp", Duration::from_secs(5)),
            crate::common::soon(),
        )
        .await
        .unwrap();
    assert_eq!(claimed, IdempotencyBegin::Claimed);
    let release = format!("SELECT \"{s}\".idem_release('idem', 't', $1, 60000)");
    let released = |call| released_by(&client, &release, call);
    assert!(released("call-3").await);
    assert!(released("call-3").await, "the same call re-sent");
    assert!(!released("call-4").await);
}

/// Runs the release statement `release` as release call `call`: whether it released.
async fn released_by(client: &tokio_postgres::Client, release: &str, call: &str) -> bool {
    client
        .query_one(release, &[&call])
        .await
        .unwrap()
        .get::<_, bool>(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn checks_naming_the_same_limits_in_any_order_never_deadlock() {
    let server = server().await;
    let store = server.builder().pool_size(16).connect().await.unwrap();
    let ns = format!("t{}:rl", rand::random::<u32>());
    let (a, b) = (Limit::per_minute("a", 40), Limit::per_minute("b", 1000));
    let forward =
        Arc::new(RatePolicy::new(&ns, Algorithm::SlidingLog, vec![a.clone(), b.clone()]).unwrap());
    let backward = Arc::new(RatePolicy::new(&ns, Algorithm::SlidingLog, vec![b, a]).unwrap());
    let who = caller("hot");
    let checks = (0..200).map(|i| {
        let policy = if i % 2 == 0 { &forward } else { &backward };
        store.check_rate(policy, RateCheck::new(who, 1))
    });
    let results = futures_util::future::join_all(checks).await;
    let admitted = results
        .into_iter()
        .map(|r| r.expect("no deadlock, no timeout").admitted)
        .filter(|admitted| *admitted)
        .count();
    assert_eq!(admitted, 40, "the narrower limit, shared by both orders");
}

/// One step of a caller: a check of `cost`, or the previous check sent again (a lost reply).
#[derive(Debug, Clone, Copy)]
enum Step {
    Check(u64),
    Again,
}

fn steps() -> impl proptest::strategy::Strategy<Value = Vec<Step>> {
    use proptest::prelude::*;
    let step = prop_oneof![
        4 => (0u64..=4).prop_map(Step::Check),
        1 => Just(Step::Again),
    ];
    proptest::collection::vec(step, 1..40)
}

/// Runs `steps` for one caller on `store` under `policy`: per step whether it was admitted and
/// what each limit has left (windows of hours: a few milliseconds between steps change neither).
async fn replay_steps(
    store: &dyn RateStore,
    policy: &Arc<RatePolicy>,
    steps: &[Step],
) -> Vec<(bool, Vec<u64>)> {
    let key = caller(&format!("p{}", rand::random::<u64>()));
    let mut last = RateCheck::new(key, 0);
    let mut seen = Vec::new();
    for step in steps {
        let check = match *step {
            Step::Check(cost) => RateCheck::new(key, cost),
            Step::Again => last,
        };
        last = check;
        let outcome = store.check_rate(policy, check).await.unwrap();
        let remaining = outcome.limits.iter().map(|l| l.remaining).collect();
        seen.push((outcome.admitted, remaining));
    }
    seen
}

/// PostgreSQL decides a policy of one limit (its fast path) and of several (the general path)
/// as the reference, `MemoryStore`, does: random costs, looks (cost 0) and re-sent attempts, for
/// every algorithm. The second limit of the larger policy has room enough never to decide.
#[test]
fn one_limit_and_several_limits_decide_as_the_reference_does() {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let server = shared();
    let pg = runtime.block_on(server.builder().connect()).unwrap();
    let memory = tollgate::store::MemoryStore::new();
    common::check(24, steps(), |steps| {
        runtime.block_on(async {
            for algorithm in [
                Algorithm::SlidingLog,
                Algorithm::SlidingCounter,
                Algorithm::Gcra,
            ] {
                let tight = Limit::new("tight", 7, Duration::from_secs(3600));
                let roomy = Limit::new("roomy", 1_000, Duration::from_secs(7200));
                let one = policy(algorithm, tight.clone());
                let ns = format!("t{}:rl", rand::random::<u32>());
                let several = Arc::new(RatePolicy::new(ns, algorithm, vec![tight, roomy]).unwrap());
                for policy in [&one, &several] {
                    let expected = replay_steps(&memory, policy, &steps).await;
                    let got = replay_steps(&pg, policy, &steps).await;
                    proptest::prop_assert_eq!(
                        &got,
                        &expected,
                        "{:?} with {} limit(s)",
                        algorithm,
                        policy.limits().len()
                    );
                }
            }
            Ok(())
        })
    });
}

/// Polls `query` (one `bigint`) on `client` until it returns `want`, for at most `within`:
/// whether it did.
async fn becomes(
    client: &tokio_postgres::Client,
    query: &str,
    want: i64,
    within: Duration,
) -> bool {
    let until = Instant::now() + within;
    loop {
        let got: i64 = client.query_one(query, &[]).await.unwrap().get(0);
        if got == want {
            return true;
        }
        if Instant::now() >= until {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// `n` parallel claims of `code` on `store`: how many won.
async fn claims_won(store: &PgStore, code: &str, n: usize) -> usize {
    let claims = (0..n).map(|i| {
        store.claim(
            ClaimRequest::new(code.to_owned(), format!("redeemer-{i}"), None),
            crate::common::soon(),
        )
    });
    futures_util::future::join_all(claims)
        .await
        .into_iter()
        .filter(|outcome| outcome.as_ref().expect("every claim answers").won)
        .count()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_held_by_a_partition_arrives_late_and_changes_nothing() {
    let server = server().await;
    let proxy = common::proxy::Proxy::start(server.addr()).await;
    let direct = server.builder().connect().await.unwrap();
    let schema = direct.schema().to_owned();
    let held = PgStore::builder(format!("postgres://postgres@{}/postgres", proxy.addr()))
        .schema(schema.clone())
        .timeout(Duration::from_millis(400))
        .pool_size(1)
        .purge_interval(None)
        .build()
        .unwrap();
    // its one connection has prepared the claim and read the clock: the claim below is sent
    // whole into the partition
    let warm_up = held.claim(
        ClaimRequest::new("warm-up", "w", None),
        crate::common::soon(),
    );
    assert!(warm_up.await.unwrap().won);
    let conn = held.pool().get().await.unwrap();
    let pid: i32 = conn
        .query_one("SELECT pg_backend_pid()", &[])
        .await
        .unwrap()
        .get(0);
    drop(conn);
    proxy.silence();
    let coupon = "coupon:held";
    let started = Instant::now();
    let error = held
        .claim(
            ClaimRequest::new(coupon, "late", None),
            crate::common::soon(),
        )
        .await
        .unwrap_err();
    assert_eq!(error.kind(), StoreErrorKind::Timeout, "{error}");
    assert!(started.elapsed() < Duration::from_secs(1));
    // the undo, on the connection that replaced the silenced one: nothing to undo yet
    let undone = held.delete_if_held(Hold::new(coupon, "late"));
    assert!(!undone.await.unwrap());
    proxy.unsilence();
    // the held bytes reach the server, which runs them in order, then ends the session
    let client = server.client().await;
    let gone = format!("SELECT count(*) FROM pg_stat_activity WHERE pid = {pid}");
    assert!(becomes(&client, &gone, 0, Duration::from_secs(10)).await);
    let kept = format!("SELECT count(*) FROM \"{schema}\".holds WHERE key = '{coupon}'");
    assert!(
        becomes(&client, &kept, 0, Duration::ZERO).await,
        "the late claim wrote"
    );
    assert_eq!(claims_won(&direct, coupon, 50).await, 1, "redeemed once");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migrate_on_a_current_schema_takes_no_table_lock() {
    let server = server().await;
    let store = server
        .builder()
        .migration_timeout(Duration::from_secs(3))
        .connect()
        .await
        .unwrap();
    let s = store.schema();
    let mut client = server.client().await;
    let tx = client.transaction().await.unwrap();
    let tables = [
        "rate_limits",
        "rate_log",
        "holds",
        "fences",
        "idempotency",
        "releases",
    ];
    let names: Vec<String> = tables.iter().map(|t| format!("\"{s}\".{t}")).collect();
    tx.batch_execute(&format!(
        "LOCK TABLE {} IN ACCESS EXCLUSIVE MODE",
        names.join(", ")
    ))
    .await
    .unwrap();
    let started = Instant::now();
    store
        .migrate()
        .await
        .expect("no wait for the locked tables");
    // the tables stay locked until the rollback below: waiting would take the whole
    // migration timeout (3 s)
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "{:?}",
        started.elapsed()
    );
    tx.rollback().await.unwrap();
    let versions: Vec<i32> = client
        .query(&format!("SELECT version FROM \"{s}\".migrations"), &[])
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(versions, vec![9, 10, 11, 12]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn checks_and_migrations_at_once_never_deadlock() {
    let server = server().await;
    let store = server
        .builder()
        .timeout(Duration::from_secs(5))
        .connect()
        .await
        .unwrap();
    let s = store.schema().to_owned();
    let migrator = server.builder().schema(s.clone()).build().unwrap();
    let p = policy(Algorithm::SlidingLog, Limit::per_minute("m", 100_000));
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let workers: Vec<_> = (0..6)
        .map(|w| {
            let (store, p, stop) = (store.clone(), p.clone(), stop.clone());
            tokio::spawn(async move {
                let mut i = 0u32;
                while !stop.load(std::sync::atomic::Ordering::SeqCst) {
                    i += 1;
                    let name = format!("w{w}-{}", i % 4);
                    if w % 2 == 0 {
                        let check = store.check_rate(&p, RateCheck::new(caller(&name), 1));
                        check.await.expect("a check during migrations");
                    } else {
                        let (key, lease) = (format!("idem:{name}"), Duration::from_secs(5));
                        let begin = store.idempotency_begin(
                            BeginRequest::new(Hold::new(key.clone(), "t"), "fp", lease),
                            crate::common::soon(),
                        );
                        assert_eq!(begin.await.unwrap(), IdempotencyBegin::Claimed);
                        let release = store.idempotency_release(Hold::new(key, "t"));
                        assert!(release.await.expect("a release during migrations"));
                    }
                }
            })
        })
        .collect();
    let client = server.client().await;
    for _ in 0..15 {
        // forgotten: the next migration runs its DDL
        let forget = format!("DELETE FROM \"{s}\".migrations");
        client.execute(&forget, &[]).await.unwrap();
        migrator.migrate().await.expect("no deadlock");
    }
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    for worker in workers {
        worker.await.expect("every call of the load succeeded");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_blocked_on_a_given_pool_is_cancelled_on_the_server() {
    let server = server().await;
    // no statement_timeout on the pool's connections
    let pool = given_pool(server);
    let store = PgStore::pool_builder(pool)
        .schema(unique_schema())
        .timeout(Duration::from_millis(300))
        .purge_interval(None)
        .connect()
        .await
        .unwrap();
    let s = store.schema().to_owned();
    // an expired claim, so free, whose row another session holds
    let mut client = server.client().await;
    let expired = format!("INSERT INTO \"{s}\".holds VALUES ('blocked', 'old', 1)");
    client.execute(&expired, &[]).await.unwrap();
    let tx = client.transaction().await.unwrap();
    let lock = format!("SELECT 1 FROM \"{s}\".holds WHERE key = 'blocked' FOR UPDATE");
    tx.execute(&lock, &[]).await.unwrap();
    let started = Instant::now();
    let error = store
        .claim(
            ClaimRequest::new("blocked", "new", None),
            crate::common::soon(),
        )
        .await
        .unwrap_err();
    assert_eq!(error.kind(), StoreErrorKind::Timeout, "{error}");
    // bounded (the row stays locked until the commit below)
    assert!(
        started.elapsed() < Duration::from_secs(3),
        "{:?}",
        started.elapsed()
    );
    // the server gave up on it too: nothing waits for the row
    let watcher = server.client().await;
    let waiting = format!(
        "SELECT count(*) FROM pg_stat_activity \
         WHERE wait_event_type = 'Lock' AND query LIKE '%\"{s}\".claim(%'"
    );
    assert!(becomes(&watcher, &waiting, 0, Duration::from_secs(1)).await);
    tx.commit().await.unwrap();
    tokio::time::sleep(Duration::from_millis(200)).await;
    let holder = format!("SELECT holder FROM \"{s}\".holds WHERE key = 'blocked'");
    let holder: String = watcher.query_one(&holder, &[]).await.unwrap().get(0);
    assert_eq!(holder, "old", "the cancelled claim did not happen");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_is_one_round_trip() {
    let server = server().await;
    let proxy = common::proxy::Proxy::start(server.addr()).await;
    let direct = server.builder().connect().await.unwrap();
    let store = PgStore::builder(format!("postgres://postgres@{}/postgres", proxy.addr()))
        .schema(direct.schema())
        .timeout(Duration::from_secs(5))
        .pool_size(1)
        .purge_interval(None)
        .build()
        .unwrap();
    // prepared on the connection, the clock read
    let claim = |key: &str| store.claim(ClaimRequest::new(key, "a", None), crate::common::soon());
    assert!(claim("warm-up").await.unwrap().won);
    // 50 ms each way: BEGIN, the claim and COMMIT one after the other would take 300 ms, two
    // round trips 200 ms
    proxy.delay(Duration::from_millis(50));
    // the fastest of five: a loaded machine may delay any one of them
    let mut fastest = Duration::MAX;
    for i in 0..5 {
        let started = Instant::now();
        assert!(claim(&format!("timed-{i}")).await.unwrap().won);
        let elapsed = started.elapsed();
        assert!(elapsed >= Duration::from_millis(100), "{elapsed:?}");
        fastest = fastest.min(elapsed);
    }
    assert!(fastest < Duration::from_millis(200), "{fastest:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upgrade_drops_the_functions_without_deadlines() {
    let server = server().await;
    let store = server.builder().connect().await.unwrap();
    let s = store.schema();
    let client = server.client().await;
    // a schema of version 1, as far as it matters here: its version row and a function of it
    let old_claim = format!(
        "CREATE FUNCTION \"{s}\".claim(
           p_key text, p_holder text, p_ttl_ms bigint, OUT o_won boolean, OUT o_holder text
         ) LANGUAGE sql AS $$ SELECT true, p_holder $$"
    );
    client
        .batch_execute(&format!(
            "DELETE FROM \"{s}\".migrations;
             INSERT INTO \"{s}\".migrations (version) VALUES (1);
             {old_claim}"
        ))
        .await
        .unwrap();
    store.migrate().await.unwrap();
    let overloads = format!(
        "SELECT p.pronargs::bigint FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace
         WHERE n.nspname = '{s}' AND p.proname = 'claim'"
    );
    let args: Vec<i64> = client
        .query(&overloads, &[])
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(args, vec![4], "one claim: the one with a deadline");
    let versions = format!("SELECT max(version)::bigint FROM \"{s}\".migrations");
    assert!(becomes(&client, &versions, 12, Duration::ZERO).await);
    // a copy of version 1 started since, which migrates whatever the version row says, put its
    // functions back: the next migration finds them and runs its DDL again
    client.batch_execute(&old_claim).await.unwrap();
    store.migrate().await.unwrap();
    let count = format!("SELECT count(*) FROM ({overloads}) AS o");
    assert!(becomes(&client, &count, 1, Duration::ZERO).await);
}

/// A new schema as a copy of `version` made it: its `migrations` row, then `fixture` (that
/// version's `schema.sql`), its rate tables unlogged. Its name.
async fn schema_of_version(client: &tokio_postgres::Client, version: i32, fixture: &str) -> String {
    let s = unique_schema();
    client
        .batch_execute(&format!(
            "CREATE SCHEMA \"{s}\";
             CREATE TABLE \"{s}\".migrations (
               version integer PRIMARY KEY,
               applied_at timestamptz NOT NULL DEFAULT now()
             );
             INSERT INTO \"{s}\".migrations (version) VALUES ({version});"
        ))
        .await
        .unwrap();
    let sql = fixture
        .replace("__SCHEMA__", &format!("\"{s}\""))
        .replace("__RATE_TABLES__", "UNLOGGED");
    client.batch_execute(&sql).await.unwrap();
    s
}

/// `schema.sql` of version 3, as it was: a schema that version made, for the upgrade tests.
const SCHEMA_V3: &str = include_str!("fixtures/schema_v3.sql");

/// Every function in `schema`, with its argument types.
async fn functions(client: &tokio_postgres::Client, schema: &str) -> Vec<String> {
    let sql = "SELECT p.oid::regprocedure::text FROM pg_proc p
               JOIN pg_namespace n ON n.oid = p.pronamespace WHERE n.nspname = $1";
    let rows = client.query(sql, &[&schema]).await.unwrap();
    rows.iter().map(|r| r.get(0)).collect()
}

/// One rate check of quota 3 per limit (windows of one and two minutes) sent as a copy of
/// version 3 sends it, one check in `check_rates`: its reply.
async fn check_as_v3(
    client: &tokio_postgres::Client,
    s: &str,
    algorithm: i16,
    keys: &[&str],
    attempt: i64,
) -> Vec<i64> {
    let n = keys.len();
    let quotas = vec![3i64; n];
    let windows: Vec<i64> = (1..=n as i64).map(|i| i * 60_000_000).collect();
    let keys: Vec<String> = keys.iter().map(|k| (*k).to_owned()).collect();
    let sql = format!(
        "SELECT \"{s}\".check_rates($1, $2, $3, $4, $5, $6, $7, \"{s}\".now_us() + 10000000)"
    );
    let row = client
        .query_one(
            &sql,
            &[
                &vec![algorithm],
                &vec![n as i32],
                &keys,
                &quotas,
                &windows,
                &vec![1i64],
                &vec![attempt],
            ],
        )
        .await
        .unwrap();
    let reply: Vec<i64> = row.get(0);
    assert_eq!(
        reply[..2],
        [1, reply.len() as i64 - 2],
        "one check: {reply:?}"
    );
    reply[2..].to_vec()
}

/// What each limit has left in a reply of `check_as_v3`.
fn remaining(reply: &[i64]) -> Vec<i64> {
    reply[2..].iter().step_by(2).copied().collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_schema_of_version_3_upgrades_and_keeps_its_limits() {
    let server = server().await;
    let client = server.client().await;
    // the schema as a copy of version 3 made it
    let s = schema_of_version(&client, 3, SCHEMA_V3).await;
    let before = functions(&client, &s).await;
    // each algorithm, on one limit and on two, charged once by version 3
    let checks: [(i16, &[&str]); 6] = [
        (1, &["log"]),
        (2, &["counter"]),
        (3, &["gcra"]),
        (1, &["log:1", "log:2"]),
        (2, &["counter:1", "counter:2"]),
        (3, &["gcra:1", "gcra:2"]),
    ];
    for (i, (algorithm, keys)) in checks.iter().enumerate() {
        let reply = check_as_v3(&client, &s, *algorithm, keys, i as i64).await;
        assert_eq!(reply[0], 1, "{keys:?}: {reply:?}");
        assert!(
            remaining(&reply).iter().all(|&r| r == 2),
            "{keys:?}: {reply:?}"
        );
    }

    let store = server.builder().schema(s.clone()).connect().await.unwrap();
    let versions = format!("SELECT max(version)::bigint FROM \"{s}\".migrations");
    assert!(becomes(&client, &versions, 12, Duration::ZERO).await);
    // every function a copy of version 3 calls, or that one it calls calls, is still there
    let after = functions(&client, &s).await;
    let gone: Vec<&String> = before.iter().filter(|f| !after.contains(f)).collect();
    assert!(gone.is_empty(), "dropped by the upgrade: {gone:?}");
    assert!(after.len() > before.len(), "the step functions are new");

    for (i, (algorithm, keys)) in checks.iter().enumerate() {
        // the attempt version 3 charged, sent again, is not charged again
        let again = check_as_v3(&client, &s, *algorithm, keys, i as i64).await;
        assert_eq!(again[0], 1, "{keys:?}: {again:?}");
        assert!(
            remaining(&again).iter().all(|&r| r == 2),
            "{keys:?}: {again:?}"
        );
        // and a new one is charged on what version 3 counted
        let next = check_as_v3(&client, &s, *algorithm, keys, 100 + i as i64).await;
        assert_eq!(next[0], 1, "{keys:?}: {next:?}");
        assert!(
            remaining(&next).iter().all(|&r| r == 1),
            "{keys:?}: {next:?}"
        );
    }
    // the store of this version checks rates on the upgraded schema
    for algorithm in [
        Algorithm::SlidingLog,
        Algorithm::SlidingCounter,
        Algorithm::Gcra,
    ] {
        let p = policy(algorithm, Limit::per_minute("m", 2));
        let first = store.check_rate(&p, RateCheck::new(caller("a"), 1));
        assert_eq!(first.await.unwrap().limits[0].remaining, 1, "{algorithm:?}");
        let second = store.check_rate(&p, RateCheck::new(caller("a"), 1));
        assert!(second.await.unwrap().admitted, "{algorithm:?}");
        let third = store.check_rate(&p, RateCheck::new(caller("a"), 1));
        assert!(!third.await.unwrap().admitted, "{algorithm:?}");
    }
}

/// `schema.sql` of version 4, as it was.
const SCHEMA_V4: &str = include_str!("fixtures/schema_v4.sql");

/// One check (or, with `settles`, a settlement of what attempt `of` reserved) of quota 3 per
/// limit (windows of one and two minutes) sent as a copy of version 4 sends it, alone in a call
/// of `decide_rates`: its reply.
async fn decide_as_v4(
    client: &tokio_postgres::Client,
    s: &str,
    algorithm: i16,
    keys: &[&str],
    (cost, attempt): (i64, i64),
    settles: Option<(i64, i64)>,
) -> Vec<i64> {
    let n = keys.len();
    let quotas = vec![3i64; n];
    let windows: Vec<i64> = (1..=n as i64).map(|i| i * 60_000_000).collect();
    let keys: Vec<String> = keys.iter().map(|k| (*k).to_owned()).collect();
    let (reserved, of) = settles.unwrap_or((-1, 0));
    let sql = format!(
        "SELECT \"{s}\".decide_rates($1, $2, $3, $4, $5, $6, $7, $8, $9, \"{s}\".now_us() + 10000000)"
    );
    let row = client
        .query_one(
            &sql,
            &[
                &vec![algorithm],
                &vec![n as i32],
                &keys,
                &quotas,
                &windows,
                &vec![cost],
                &vec![attempt],
                &vec![reserved],
                &vec![of],
            ],
        )
        .await
        .unwrap();
    let reply: Vec<i64> = row.get(0);
    assert_eq!(reply[..2], [1, 2 + 2 * n as i64], "one check: {reply:?}");
    reply[2..].to_vec()
}

/// A schema of version 4 upgrades to this version: the checks its copies charged stay charged
/// once, and a copy of version 4 still checks, re-sends and settles through the functions it
/// calls, with the replies it reads.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_schema_of_version_4_upgrades_and_its_copies_keep_working() {
    let server = server().await;
    let client = server.client().await;
    // the schema as a copy of version 4 made it
    let s = schema_of_version(&client, 4, SCHEMA_V4).await;
    let before = functions(&client, &s).await;
    let checks: [(i16, &[&str]); 6] = [
        (1, &["log"]),
        (2, &["counter"]),
        (3, &["gcra"]),
        (1, &["log:1", "log:2"]),
        (2, &["counter:1", "counter:2"]),
        (3, &["gcra:1", "gcra:2"]),
    ];
    for (i, (algorithm, keys)) in checks.iter().enumerate() {
        let reply = decide_as_v4(&client, &s, *algorithm, keys, (1, i as i64), None).await;
        assert_eq!(reply[0], 1, "{keys:?}: {reply:?}");
        assert!(
            remaining(&reply).iter().all(|&r| r == 2),
            "{keys:?}: {reply:?}"
        );
    }

    let store = server.builder().schema(s.clone()).connect().await.unwrap();
    let versions = format!("SELECT max(version)::bigint FROM \"{s}\".migrations");
    assert!(becomes(&client, &versions, 12, Duration::ZERO).await);
    // gone: only version 4's steps and settlements, which its functions alone called
    let after = functions(&client, &s).await;
    let replaced = [
        "rate_counter_step(",
        "rate_gcra_step(",
        "settle_rate(",
        "settle_limit(",
    ];
    for gone in before.iter().filter(|f| !after.contains(f)) {
        assert!(replaced.iter().any(|r| gone.contains(r)), "dropped: {gone}");
    }

    for (i, (algorithm, keys)) in checks.iter().enumerate() {
        let i = i as i64;
        // the attempt version 4 charged, sent again, is not charged again
        let again = decide_as_v4(&client, &s, *algorithm, keys, (1, i), None).await;
        assert_eq!(again[0], 1, "{keys:?}: {again:?}");
        assert!(
            remaining(&again).iter().all(|&r| r == 2),
            "{keys:?}: {again:?}"
        );
        // a copy of version 4 reserves, re-sends, settles (refunding) and re-sends the settlement
        for _ in 0..2 {
            let next = decide_as_v4(&client, &s, *algorithm, keys, (1, 100 + i), None).await;
            assert!(
                remaining(&next).iter().all(|&r| r == 1),
                "{keys:?}: {next:?}"
            );
        }
        for _ in 0..2 {
            let settled = decide_as_v4(
                &client,
                &s,
                *algorithm,
                keys,
                (0, 200 + i),
                Some((1, 100 + i)),
            )
            .await;
            assert_eq!(settled[0], 1, "{keys:?}: {settled:?}");
            assert!(
                remaining(&settled).iter().all(|&r| r == 2),
                "{keys:?}: {settled:?}"
            );
        }
    }
    // and the store of this version on the upgraded schema
    for algorithm in [
        Algorithm::SlidingLog,
        Algorithm::SlidingCounter,
        Algorithm::Gcra,
    ] {
        let p = policy(algorithm, Limit::per_minute("m", 2));
        let a = RateCheck::new(caller("a"), 1);
        assert_eq!(
            admitted(&store, &p, a).await.limits[0].remaining,
            1,
            "{algorithm:?}"
        );
        assert_eq!(
            admitted(&store, &p, a).await.limits[0].remaining,
            1,
            "{algorithm:?}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_commit_waiting_for_a_standby_is_cancelled_at_the_deadline() {
    let server = tokio::task::spawn_blocking(PgServer::start).await.unwrap();
    let store = server
        .builder()
        .timeout(Duration::from_millis(400))
        .connect()
        .await
        .unwrap();
    let claim = |key: &str, who: &str| {
        store.claim(ClaimRequest::new(key, who, None), crate::common::soon())
    };
    assert!(claim("warm-up", "w").await.unwrap().won);
    // a synchronous standby that never answers: every commit that wrote waits for it
    let admin = server.client().await;
    let standby = |names: &'static str| {
        let sql = format!("ALTER SYSTEM SET synchronous_standby_names = '{names}'");
        let admin = &admin;
        async move {
            admin.batch_execute(&sql).await.unwrap();
            admin
                .batch_execute("SELECT pg_reload_conf()")
                .await
                .unwrap();
            tokio::time::sleep(Duration::from_millis(300)).await;
        }
    };
    standby("nobody").await;
    let started = Instant::now();
    let error = claim("coupon", "first").await.unwrap_err();
    assert_eq!(error.kind(), StoreErrorKind::Timeout, "{error}");
    // bounded (the standby never answers)
    assert!(
        started.elapsed() < Duration::from_secs(3),
        "{:?}",
        started.elapsed()
    );
    // the cancel request ended the wait; the commit stays, locally
    let waiting = "SELECT count(*) FROM pg_stat_activity WHERE wait_event = 'SyncRep'";
    assert!(becomes(&admin, waiting, 0, Duration::from_secs(2)).await);
    standby("").await;
    let kept = format!(
        "SELECT count(*) FROM \"{}\".holds WHERE key = 'coupon' AND holder = 'first'",
        store.schema()
    );
    assert!(becomes(&admin, &kept, 1, Duration::ZERO).await);
    // the undo after the deadline finds it, and the coupon is won once after
    assert!(
        store
            .delete_if_held(Hold::new("coupon", "first"))
            .await
            .unwrap()
    );
    assert_eq!(claims_won(&store, "coupon", 50).await, 1);
}

/// Sends `write` on `store`'s one connection while the proxy holds its bytes, so that it times
/// out; then heals the partition and waits until the server has run the held bytes and ended
/// that session.
async fn held_then_delivered<T: std::fmt::Debug>(
    store: &PgStore,
    proxy: &common::proxy::Proxy,
    client: &tokio_postgres::Client,
    write: tollgate::store::StoreFuture<T>,
) {
    let conn = store.pool().get().await.unwrap();
    let pid: i32 = conn
        .query_one("SELECT pg_backend_pid()", &[])
        .await
        .unwrap()
        .get(0);
    drop(conn);
    proxy.silence();
    let error = write.await.unwrap_err();
    assert_eq!(error.kind(), StoreErrorKind::Timeout, "{error}");
    // a call on the connection that replaced the silenced one
    store.ping().await.unwrap();
    proxy.unsilence();
    let gone = format!("SELECT count(*) FROM pg_stat_activity WHERE pid = {pid}");
    assert!(becomes(client, &gone, 0, Duration::from_secs(10)).await);
}

/// A lock acquisition, an idempotency claim and a rate check held by a partition and delivered
/// after their connection was replaced change nothing: the lock and the key are free, and the
/// caller's quota is whole.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lock_a_record_and_a_rate_check_held_by_a_partition_change_nothing() {
    let server = server().await;
    let proxy = common::proxy::Proxy::start(server.addr()).await;
    let direct = server.builder().connect().await.unwrap();
    let held = PgStore::builder(format!("postgres://postgres@{}/postgres", proxy.addr()))
        .schema(direct.schema().to_owned())
        .timeout(Duration::from_millis(400))
        .pool_size(1)
        .purge_interval(None)
        .build()
        .unwrap();
    let client = server.client().await;
    let policy = Arc::new(
        RatePolicy::new("held:rl", Algorithm::Gcra, vec![Limit::per_minute("m", 10)]).unwrap(),
    );
    let caller = Key::new("held", b"caller");
    let lease = Duration::from_secs(600);
    // every statement prepared and the clock read on the one connection, before the partition
    assert!(
        held.claim(ClaimRequest::new("warm", "w", None), crate::common::soon())
            .await
            .unwrap()
            .won
    );
    held.lock_acquire(
        LockRequest::new(Hold::new("warm-l", "w"), "warm-f", lease),
        crate::common::soon(),
    )
    .await
    .unwrap();
    held.idempotency_begin(
        BeginRequest::new(Hold::new("warm-i", "w"), "f", lease),
        crate::common::soon(),
    )
    .await
    .unwrap();
    held.check_rate(&policy, RateCheck::new(Key::new("held", b"warm"), 1))
        .await
        .unwrap();

    let lock = held.lock_acquire(
        LockRequest::new(Hold::new("l", "t"), "f", lease),
        crate::common::soon(),
    );
    held_then_delivered(&held, &proxy, &client, lock).await;
    let begin = held.idempotency_begin(
        BeginRequest::new(Hold::new("i", "t"), "f", lease),
        crate::common::soon(),
    );
    held_then_delivered(&held, &proxy, &client, begin).await;
    let check = held.check_rate(&policy, RateCheck::new(caller, 4));
    held_then_delivered(&held, &proxy, &client, check).await;

    let other = direct.lock_acquire(
        LockRequest::new(Hold::new("l", "u"), "f", lease),
        crate::common::soon(),
    );
    assert!(
        matches!(other.await.unwrap(), LockAttempt::Acquired { .. }),
        "the lock is free"
    );
    let begin = direct.idempotency_begin(
        BeginRequest::new(Hold::new("i", "u"), "f", lease),
        crate::common::soon(),
    );
    assert_eq!(
        begin.await.unwrap(),
        IdempotencyBegin::Claimed,
        "the key is free"
    );
    let look = direct
        .check_rate(&policy, RateCheck::new(caller, 0))
        .await
        .unwrap();
    assert_eq!(look.limits[0].remaining, 10, "the late check charged");
}

/// Checks that wait together go out as one call of `check_rates`, each decided as alone: two
/// copies, 20 callers with a quota of 5 and two limits, 400 checks at once, every algorithm —
/// exactly 5 admitted per caller, the last of them with nothing left, and no deadlock between
/// batches that lock the same callers' rows in one transaction each.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_checks_in_batches_admit_exactly_each_quota() {
    let server = server().await;
    let schema = unique_schema();
    let copies: Vec<PgStore> = futures_util::future::join_all((0..2).map(|_| {
        server
            .builder()
            .schema(schema.clone())
            .timeout(Duration::from_secs(5))
            .connect()
    }))
    .await
    .into_iter()
    .map(Result::unwrap)
    .collect();
    for algorithm in [
        Algorithm::SlidingLog,
        Algorithm::SlidingCounter,
        Algorithm::Gcra,
    ] {
        let ns = format!("t{}:rl", rand::random::<u32>());
        let limits = vec![Limit::per_minute("m", 5), Limit::per_hour("h", 50)];
        let p = Arc::new(RatePolicy::new(ns, algorithm, limits).unwrap());
        let checks = (0..400u32).map(|i| {
            let (store, p) = (copies[i as usize % 2].clone(), Arc::clone(&p));
            async move {
                let who = format!("c{}", i % 20);
                let out = store.check_rate(&p, RateCheck::new(caller(&who), 1)).await;
                (who, out.unwrap())
            }
        });
        let outcomes = futures_util::future::join_all(checks).await;
        let mut admitted = std::collections::HashMap::<String, Vec<u64>>::new();
        for (who, out) in outcomes {
            if out.admitted {
                admitted
                    .entry(who)
                    .or_default()
                    .push(out.limits[0].remaining);
            } else {
                assert!(
                    out.retry_after > Duration::ZERO,
                    "{algorithm}: a denial waits"
                );
            }
        }
        assert_eq!(admitted.len(), 20, "{algorithm}");
        for (who, mut remaining) in admitted {
            remaining.sort_unstable();
            assert_eq!(remaining, [0, 1, 2, 3, 4], "{algorithm}: {who}");
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The attempt ledger (docs/ledger.md) on PostgreSQL
// ---------------------------------------------------------------------------------------------

/// A migrated store on the shared server whose calls have `timeout`: its attempts are
/// remembered until their deadline plus twice that.
async fn store_with_timeout(timeout: Duration) -> PgStore {
    server()
        .await
        .builder()
        .timeout(timeout)
        .connect()
        .await
        .unwrap()
}

/// What `caller` has left on each limit of `policy`: a look.
async fn left(store: &PgStore, policy: &Arc<RatePolicy>, caller: Key) -> Vec<u64> {
    let look = store.check_rate(policy, RateCheck::new(caller, 0)).await;
    look.unwrap().limits.iter().map(|l| l.remaining).collect()
}

/// `check` on `store`, which must answer and admit it: the outcome.
async fn admitted(
    store: &PgStore,
    policy: &Arc<RatePolicy>,
    check: RateCheck,
) -> tollgate::rate::RateOutcome {
    let outcome = store.check_rate(policy, check).await.unwrap();
    assert!(outcome.admitted, "{check:?}: {outcome:?}");
    outcome
}

/// A check retried after its first call's deadline has passed, and after another check of the
/// caller, is remembered still (until its deadline plus twice the timeout): charged once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_check_retried_after_its_deadline_is_charged_once() {
    let timeout = Duration::from_millis(300);
    let store = store_with_timeout(timeout).await;
    for algorithm in [Algorithm::Gcra, Algorithm::SlidingCounter] {
        let p = policy(algorithm, Limit::per_hour("h", 10));
        let who = caller("retried");
        let a = RateCheck::new(who, 1);
        admitted(&store, &p, a).await;
        tokio::time::sleep(timeout + Duration::from_millis(100)).await;
        admitted(&store, &p, RateCheck::new(who, 1)).await;
        let again = admitted(&store, &p, a).await;
        assert_eq!(again.limits[0].remaining, 8, "{algorithm}: a, b, a again");
        assert_eq!(left(&store, &p, who).await, [8], "{algorithm}");
    }
}

/// A settlement re-sent after another settlement of the caller, past the timeout, is applied
/// once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_settlement_re_sent_after_the_timeout_is_applied_once() {
    let timeout = Duration::from_millis(300);
    let store = store_with_timeout(timeout).await;
    for algorithm in [
        Algorithm::SlidingLog,
        Algorithm::SlidingCounter,
        Algorithm::Gcra,
    ] {
        let p = policy(algorithm, Limit::per_hour("h", 10));
        let who = caller("settling");
        let (a, b) = (
            RateCheck::reservation(who, 3),
            RateCheck::reservation(who, 3),
        );
        admitted(&store, &p, a).await;
        admitted(&store, &p, b).await;
        let settled = admitted(&store, &p, a.settle(1)).await;
        assert_eq!(settled.limits[0].remaining, 6, "{algorithm}: a refunded 2");
        tokio::time::sleep(timeout + Duration::from_millis(100)).await;
        let settled = admitted(&store, &p, b.settle(1)).await;
        assert_eq!(settled.limits[0].remaining, 8, "{algorithm}: b refunded 2");
        let again = admitted(&store, &p, a.settle(1)).await;
        assert_eq!(again.limits[0].remaining, 8, "{algorithm}: applied once");
        assert_eq!(left(&store, &p, who).await, [8], "{algorithm}");
    }
}

/// A check re-sent after eight other checks of its caller is charged once: there is no "last
/// attempts" bound.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_check_re_sent_after_eight_others_is_charged_once() {
    let store = store_with_timeout(Duration::from_secs(2)).await;
    for algorithm in [
        Algorithm::SlidingLog,
        Algorithm::SlidingCounter,
        Algorithm::Gcra,
    ] {
        let ns = format!("t{}:rl", rand::random::<u32>());
        let limits = vec![Limit::per_hour("h", 100), Limit::per_day("d", 1000)];
        let p = Arc::new(RatePolicy::new(ns, algorithm, limits).unwrap());
        let who = caller("many");
        let a = RateCheck::new(who, 1);
        admitted(&store, &p, a).await;
        for _ in 0..8 {
            admitted(&store, &p, RateCheck::new(who, 1)).await;
        }
        let again = admitted(&store, &p, a).await;
        let remaining: Vec<u64> = again.limits.iter().map(|l| l.remaining).collect();
        assert_eq!(remaining, [91, 991], "{algorithm}: a re-sent");
        assert_eq!(left(&store, &p, who).await, [91, 991], "{algorithm}");
    }
}

/// A sliding-log reservation settled for nothing, then re-sent, is not charged again: its
/// ledger row makes it a replay though its log entry is gone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_log_reservation_refunded_then_re_sent_is_not_charged_again() {
    let store = store_with_timeout(Duration::from_secs(2)).await;
    let p = policy(Algorithm::SlidingLog, Limit::per_hour("h", 10));
    let who = caller("refunded");
    let reserved = RateCheck::reservation(who, 3);
    assert_eq!(admitted(&store, &p, reserved).await.limits[0].remaining, 7);
    let settled = admitted(&store, &p, reserved.settle(0)).await;
    assert_eq!(settled.limits[0].remaining, 10, "all refunded");
    let again = admitted(&store, &p, reserved).await;
    assert_eq!(again.limits[0].remaining, 10, "the reservation re-sent");
    assert_eq!(left(&store, &p, who).await, [10]);
}

/// A reservation settled after its charge has left the limit refunds nothing: it never gives
/// back quota that another attempt spent since.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_settlement_after_the_window_rolled_refunds_nothing() {
    let store = store_with_timeout(Duration::from_secs(2)).await;
    let limit = Limit::new("s", 10, Duration::from_secs(1));
    let ps: Vec<Arc<RatePolicy>> = [Algorithm::Gcra, Algorithm::SlidingCounter]
        .into_iter()
        .map(|algorithm| policy(algorithm, limit.clone()))
        .collect();
    let who = caller("rolled");
    let reservations: Vec<RateCheck> = ps.iter().map(|_| RateCheck::reservation(who, 10)).collect();
    for (p, a) in ps.iter().zip(&reservations) {
        admitted(&store, p, *a).await;
    }
    tokio::time::sleep(Duration::from_millis(2_150)).await;
    for (p, a) in ps.iter().zip(&reservations) {
        let algorithm = p.algorithm();
        admitted(&store, p, RateCheck::new(who, 10)).await;
        let settled = admitted(&store, p, a.settle(0)).await;
        assert_eq!(
            settled.limits[0].remaining, 0,
            "{algorithm}: nothing refunded"
        );
        let c = store.check_rate(p, RateCheck::new(who, 10)).await.unwrap();
        assert!(!c.admitted, "{algorithm}: the quota is spent: {c:?}");
    }
}

/// A refund of a reservation whose charge the limit still counts returns it, on every limit, and
/// a settlement of a plain check refunds nothing (its place was not kept); an overrun is charged
/// either way.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_a_reservation_is_refunded() {
    let store = store_with_timeout(Duration::from_secs(2)).await;
    for algorithm in [
        Algorithm::SlidingLog,
        Algorithm::SlidingCounter,
        Algorithm::Gcra,
    ] {
        let ns = format!("t{}:rl", rand::random::<u32>());
        let limits = vec![Limit::per_hour("h", 100), Limit::per_day("d", 1000)];
        let p = Arc::new(RatePolicy::new(ns, algorithm, limits).unwrap());
        let who = caller("refunds");
        let reserved = RateCheck::reservation(who, 30);
        admitted(&store, &p, reserved).await;
        let out = admitted(&store, &p, reserved.settle(10)).await;
        let remaining: Vec<u64> = out.limits.iter().map(|l| l.remaining).collect();
        assert_eq!(remaining, [90, 990], "{algorithm}: a reservation refunded");
        let plain = RateCheck::new(who, 30);
        admitted(&store, &p, plain).await;
        let out = admitted(&store, &p, plain.settle(10)).await;
        let remaining: Vec<u64> = out.limits.iter().map(|l| l.remaining).collect();
        assert_eq!(
            remaining,
            [60, 960],
            "{algorithm}: a plain check refunds nothing"
        );
        let out = admitted(&store, &p, RateCheck::new(who, 5).settle(25)).await;
        let remaining: Vec<u64> = out.limits.iter().map(|l| l.remaining).collect();
        assert_eq!(remaining, [40, 940], "{algorithm}: an overrun");
        // the same refund made again changes nothing
        let out = admitted(&store, &p, reserved.settle(0)).await;
        let remaining: Vec<u64> = out.limits.iter().map(|l| l.remaining).collect();
        assert_eq!(remaining, [40, 940], "{algorithm}: applied once");
    }
}

/// Each outcome carries the database clock it was decided at.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn outcomes_carry_the_instant_they_were_decided_at() {
    let store = store_with_timeout(Duration::from_secs(2)).await;
    let p = policy(Algorithm::Gcra, Limit::per_hour("h", 10));
    let wall = |t: std::time::SystemTime| {
        t.duration_since(std::time::UNIX_EPOCH).unwrap().as_micros() as u64
    };
    let before = wall(std::time::SystemTime::now());
    let reserved = RateCheck::reservation(caller("clock"), 2);
    let first = admitted(&store, &p, reserved).await.decided_at_us.unwrap();
    let settled = admitted(&store, &p, reserved.settle(1)).await;
    let second = settled.decided_at_us.unwrap();
    let after = wall(std::time::SystemTime::now());
    // the server runs on this machine: one clock
    assert!(before <= first && first <= second && second <= after);
}

/// The ledger's rows are purged once they expire: a charged attempt's at its deadline plus twice
/// the timeout, a reservation's not before its place expires.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn expired_attempts_are_purged() {
    let server = server().await;
    let client = server.client().await;
    let store = server
        .builder()
        .timeout(Duration::from_millis(100))
        .connect()
        .await
        .unwrap();
    let schema = store.schema().to_owned();
    let quick = policy(Algorithm::Gcra, Limit::per_hour("h", 1000));
    let slow = policy(Algorithm::Gcra, Limit::new("s", 1, Duration::from_secs(60)));
    admitted(&store, &quick, RateCheck::new(caller("a"), 1)).await;
    admitted(&store, &quick, RateCheck::reservation(caller("b"), 0)).await;
    // kept for its place: a minute
    admitted(&store, &slow, RateCheck::reservation(caller("c"), 1)).await;
    assert_eq!(
        rows(&client, &schema, "rate_attempts").await,
        2,
        "a look leaves none"
    );
    tokio::time::sleep(Duration::from_millis(600)).await;
    store.purge_expired().await.unwrap();
    assert_eq!(rows(&client, &schema, "rate_attempts").await, 1);
}

/// A check whose step fails in a batch fails alone, with its cause: the others are decided. A
/// trigger fails every write of one caller's row, among 50 callers checked at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_check_failing_in_a_batch_fails_alone() {
    let server = server().await;
    let store = server.builder().pool_size(4).connect().await.unwrap();
    let s = store.schema().to_owned();
    let p = policy(Algorithm::Gcra, Limit::per_hour("h", 10));
    let callers: Vec<Key> = (0..50).map(|i| caller(&format!("c{i}"))).collect();
    // the last one queues behind the first calls: it goes out in a batch
    let failing = p.store_keys(&callers[49])[0].clone();
    server
        .client()
        .await
        .batch_execute(&format!(
            "CREATE FUNCTION \"{s}\".refuse() RETURNS trigger LANGUAGE plpgsql AS $$
             BEGIN RAISE EXCEPTION 'refused by the test for %', NEW.key; END $$;
             CREATE TRIGGER refuse BEFORE INSERT OR UPDATE ON \"{s}\".rate_limits
             FOR EACH ROW WHEN (NEW.key = '{failing}') EXECUTE FUNCTION \"{s}\".refuse()"
        ))
        .await
        .unwrap();
    let checks = callers
        .iter()
        .map(|who| store.check_rate(&p, RateCheck::new(*who, 1)));
    let outcomes = futures_util::future::join_all(checks).await;
    for (i, outcome) in outcomes.iter().enumerate() {
        match outcome {
            Ok(outcome) => {
                assert!(i != 49, "the refused check was decided");
                assert!(outcome.admitted, "{i}");
            }
            Err(e) => {
                assert_eq!(i, 49, "another check failed: {e}");
                assert_eq!(e.kind(), StoreErrorKind::Protocol, "{e}");
                assert!(e.to_string().contains("refused by the test"), "{e}");
            }
        }
    }
    assert!(outcomes[49].is_err());
    // the others were charged once
    for who in &callers[..49] {
        assert_eq!(left(&store, &p, *who).await, [9]);
    }
}

/// A GCRA reservation of 2^50 and its settlements, among concurrent checks of the same caller,
/// fail nothing: costs arrive clamped, so no arithmetic overflows.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn huge_reservations_and_settlements_fail_nothing() {
    let store = store_with_timeout(Duration::from_secs(5)).await;
    let p = policy(Algorithm::Gcra, Limit::per_hour("h", 1_000_000));
    let who = caller("huge");
    let huge = RateCheck::reservation(who, 1 << 50);
    let mut checks: Vec<RateCheck> = (0..40).map(|_| RateCheck::new(who, 1)).collect();
    checks.extend([
        huge,
        huge.settle(0),
        huge.settle(1 << 50),
        huge.settle(u64::MAX),
        RateCheck::reservation(who, 1).settle(u64::MAX),
    ]);
    let outcomes = futures_util::future::join_all(checks.iter().map(|c| store.check_rate(&p, *c)));
    for (check, outcome) in checks.iter().zip(outcomes.await) {
        outcome.unwrap_or_else(|e| panic!("{check:?}: {e}"));
    }
}

/// A refund returns only what the limit still counts of the reservation's own charge: on GCRA
/// the part of its span still ahead of now, never the span of a charge made after it; on a
/// sliding counter from the previous window, without touching the current one's charges.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refund_returns_only_what_is_left_of_its_own_charge() {
    let store = store_with_timeout(Duration::from_secs(2)).await;
    let limit = Limit::new("s", 10, Duration::from_secs(1));

    // GCRA: a's span ends half a second after it, b's after a's; 0.3 s later a settles for 0
    let p = policy(Algorithm::Gcra, limit.clone());
    let who = caller("gcra");
    let a = RateCheck::reservation(who, 5);
    admitted(&store, &p, a).await;
    admitted(&store, &p, RateCheck::new(who, 5)).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let settled = admitted(&store, &p, a.settle(0)).await;
    // left: b's span, 0.5 s of 1 s
    assert_eq!(
        settled.limits[0].remaining, 5,
        "only what is left of a's span"
    );

    // sliding counter: a reserves all 10 at the start of a window; in the next, b spends 3 and a
    // settles for 0: the previous window's 10 go, b's 3 stay
    let p = policy(Algorithm::SlidingCounter, limit);
    let who = caller("counter");
    let ms = || {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_millis() as u64
    };
    tokio::time::sleep(Duration::from_millis(1_050 - ms() % 1_000)).await;
    let a = RateCheck::reservation(who, 10);
    admitted(&store, &p, a).await;
    // 0.4 s into the next window: the previous one weighs 6 there
    tokio::time::sleep(Duration::from_millis(1_400 - ms() % 1_000)).await;
    admitted(&store, &p, RateCheck::new(who, 3)).await;
    let settled = admitted(&store, &p, a.settle(0)).await;
    assert_eq!(settled.limits[0].remaining, 7, "b's 3 stay");
}

/// `schema.sql` of version 5, as it was.
const SCHEMA_V5: &str = include_str!("fixtures/schema_v5.sql");

/// A schema of version 5 upgrades to this version: a copy of version 5 still checks through the
/// `decide_rates` it calls, with the reply it reads, and this version's store blocks a caller
/// on the upgraded schema.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_schema_of_version_5_upgrades_and_its_copies_keep_working() {
    let server = server().await;
    let client = server.client().await;
    // the schema as a copy of version 5 made it
    let s = schema_of_version(&client, 5, SCHEMA_V5).await;
    let as_v5 = format!(
        "SELECT \"{s}\".decide_rates($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, \
         \"{s}\".now_us() + 10000000)"
    );
    let decide = |attempt: i64| {
        let (client, sql) = (&client, &as_v5);
        async move {
            let row = client
                .query_one(
                    sql,
                    &[
                        &vec![3i16],
                        &vec![1i32],
                        &vec!["v5:gcra".to_owned()],
                        &vec![3i64],
                        &vec![60_000_000i64],
                        &vec![1i64],
                        &vec![attempt],
                        &vec![false],
                        &vec![-1i64],
                        &vec![0i64],
                        &vec![false],
                        &2_000_000i64,
                    ],
                )
                .await
                .unwrap();
            row.get::<_, Vec<i64>>(0)
        }
    };
    let before = decide(1).await;
    assert_eq!((before[2], before[5]), (1, 2), "{before:?}");

    let store = server.builder().schema(s.clone()).connect().await.unwrap();
    let versions = format!("SELECT max(version)::bigint FROM \"{s}\".migrations");
    assert!(becomes(&client, &versions, 12, Duration::ZERO).await);
    // the copy of version 5: its attempt re-sent is not charged again, a new one is
    let again = decide(1).await;
    assert_eq!((again[2], again[5]), (1, 2), "{again:?}");
    let next = decide(2).await;
    assert_eq!((next[2], next[5]), (1, 1), "{next:?}");

    // this version blocks on the upgraded schema
    let limit = Limit::new("b", 1, Duration::from_secs(60)).block_for(Duration::from_secs(90));
    let p = policy(Algorithm::Gcra, limit);
    assert!(
        admitted(&store, &p, RateCheck::new(caller("block"), 1))
            .await
            .admitted
    );
    let denied = store
        .check_rate(&p, RateCheck::new(caller("block"), 1))
        .await
        .unwrap();
    assert!(!denied.admitted);
    assert_eq!(denied.retry_after, Duration::from_secs(90));
}

/// `schema.sql` of version 6, as it was.
const SCHEMA_V6: &str = include_str!("fixtures/schema_v6.sql");

/// A schema of version 6 upgrades to this version: a record a copy of version 6 claimed reads
/// without an age, one this version claims with its age, and the copy of version 6 still begins
/// records through the `idem_begin` it calls.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_schema_of_version_6_upgrades_and_its_records_read_alike() {
    let server = server().await;
    let client = server.client().await;
    // the schema as a copy of version 6 made it
    let s = schema_of_version(&client, 6, SCHEMA_V6).await;
    let as_v6 = format!(
        "SELECT o_tag FROM \"{s}\".idem_begin($1, 'fp', 't', 60000, \"{s}\".now_us() + 10000000)"
    );
    let begin_v6 = |key: &'static str| {
        let (client, sql) = (&client, &as_v6);
        async move {
            let row = client.query_one(sql, &[&key]).await.unwrap();
            row.get::<_, i16>(0)
        }
    };
    assert_eq!(begin_v6("old").await, 0);

    let store = server.builder().schema(s.clone()).connect().await.unwrap();
    let versions = format!("SELECT max(version)::bigint FROM \"{s}\".migrations");
    assert!(becomes(&client, &versions, 12, Duration::ZERO).await);
    match store.idempotency_state("old").await.unwrap() {
        IdempotencyState::InFlight { lease_left, age } => {
            assert!(lease_left <= Duration::from_secs(60), "{lease_left:?}");
            assert_eq!(age, None, "claimed before the schema kept it");
        }
        other => panic!("expected in flight, got {other:?}"),
    }
    // the copy of version 6 on the upgraded schema: its record now keeps its age
    assert_eq!(begin_v6("copy").await, 0);
    let new = BeginRequest::new(Hold::new("new", "t"), "fp", Duration::from_secs(60));
    let deadline = tokio::time::Instant::now() + Duration::from_secs(2);
    assert_eq!(
        store.idempotency_begin(new, deadline).await.unwrap(),
        IdempotencyBegin::Claimed
    );
    for key in ["copy", "new"] {
        match store.idempotency_state(key).await.unwrap() {
            IdempotencyState::InFlight { age: Some(age), .. } => {
                assert!(age < Duration::from_secs(2), "{key}: {age:?}");
            }
            other => panic!("{key}: expected in flight with an age, got {other:?}"),
        }
    }
}

/// `schema.sql` of version 7, as it was.
const SCHEMA_V7: &str = include_str!("fixtures/schema_v7.sql");

/// A schema of version 7 upgrades to this version: a reservation that a copy of version 7
/// charged stays charged, and its settlement (its place names no life) refunds nothing; the
/// next charge names the row's life, and that reservation's settlement refunds as always.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_schema_of_version_7_upgrades_and_its_rows_are_named_by_the_next_charge() {
    let server = server().await;
    let client = server.client().await;
    // the schema as a copy of version 7 made it
    let s = schema_of_version(&client, 7, SCHEMA_V7).await;
    let caller = Key::new("test", b"upgraded");
    let mut charged = Vec::new();
    for (code, algorithm) in [(2i16, Algorithm::SlidingCounter), (3, Algorithm::Gcra)] {
        let day = Limit::new("d", 10, Duration::from_secs(86_400));
        let p = Arc::new(RatePolicy::new(format!("v7{code}:rl"), algorithm, vec![day]).unwrap());
        let first = RateCheck::reservation(caller, 4);
        // the copy of version 7 reserves 4
        let sql = format!(
            "SELECT \"{s}\".check_rate($1::smallint, $2::text[], $3::bigint[], $4::bigint[],
               4::bigint, $5::bigint, true, 10000000::bigint, \"{s}\".now_us() + 10000000)"
        );
        let attempt = i64::from_ne_bytes(first.attempt().to_ne_bytes());
        let reply: Vec<i64> = client
            .query_one(
                &sql,
                &[
                    &code,
                    &p.store_keys(&caller),
                    &vec![10i64],
                    &vec![86_400_000_000i64],
                    &attempt,
                ],
            )
            .await
            .unwrap()
            .get(0);
        assert_eq!((reply[0], reply[3]), (1, 6), "{algorithm:?}: {reply:?}");
        charged.push((p, first));
    }

    let store = server.builder().schema(s.clone()).connect().await.unwrap();
    let versions = format!("SELECT max(version)::bigint FROM \"{s}\".migrations");
    assert!(becomes(&client, &versions, 12, Duration::ZERO).await);
    for (p, first) in charged {
        let algorithm = p.algorithm();
        let settled = store.check_rate(&p, first.settle(0)).await.unwrap();
        assert_eq!(
            settled.limits[0].remaining, 6,
            "{algorithm:?}: a place of version 7 refunds nothing"
        );
        let second = RateCheck::reservation(caller, 2);
        let out = store.check_rate(&p, second).await.unwrap();
        assert_eq!(
            (out.admitted, out.limits[0].remaining),
            (true, 4),
            "{algorithm:?}"
        );
        let settled = store.check_rate(&p, second.settle(0)).await.unwrap();
        assert_eq!(
            settled.limits[0].remaining, 6,
            "{algorithm:?}: the life named by the second charge"
        );
    }
}

/// A rolling deploy: copies of version 7 keep checking (counter and GCRA reservations, through
/// the `check_rate` they call) while a copy of this version upgrades the schema under them. No
/// call fails or deadlocks, and afterwards this version settles a reservation of its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_schema_of_version_7_upgrades_under_its_copies_load() {
    let server = server().await;
    let client = server.client().await;
    let s = schema_of_version(&client, 7, SCHEMA_V7).await;
    let sql = format!(
        "SELECT \"{s}\".check_rate($1::smallint, $2::text[], $3::bigint[], $4::bigint[],
           1::bigint, $5::bigint, true, 10000000::bigint, \"{s}\".now_us() + 10000000)"
    );
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut workers = Vec::new();
    for w in 0..4i16 {
        let (copy, sql, stop) = (server.client().await, sql.clone(), Arc::clone(&stop));
        workers.push(tokio::spawn(async move {
            let mut calls = 0u32;
            while !stop.load(std::sync::atomic::Ordering::SeqCst) || calls == 0 {
                calls += 1;
                let keys = vec![format!("v7load:{w}:{}", calls % 8)];
                let algorithm = 2 + w % 2;
                let attempt = i64::from(calls) << 8 | i64::from(w);
                let reply: Vec<i64> = copy
                    .query_one(
                        &sql,
                        &[
                            &algorithm,
                            &keys,
                            &vec![1_000_000i64],
                            &vec![60_000_000i64],
                            &attempt,
                        ],
                    )
                    .await
                    .expect("a check of a copy of version 7 during the upgrade")
                    .get(0);
                assert_eq!(reply[0], 1, "{reply:?}");
            }
            calls
        }));
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    let store = server.builder().schema(s.clone()).connect().await.unwrap();
    let versions = format!("SELECT max(version)::bigint FROM \"{s}\".migrations");
    assert!(becomes(&client, &versions, 12, Duration::ZERO).await);
    tokio::time::sleep(Duration::from_millis(200)).await;
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    for worker in workers {
        assert!(worker.await.expect("every call of the load succeeded") > 0);
    }
    let p = policy(Algorithm::Gcra, Limit::per_minute("m", 10));
    let reserved = RateCheck::reservation(caller("after"), 4);
    assert_eq!(left(&store, &p, caller("after")).await, vec![10]);
    assert!(store.check_rate(&p, reserved).await.unwrap().admitted);
    let settled = store.check_rate(&p, reserved.settle(1)).await.unwrap();
    assert_eq!(settled.limits[0].remaining, 9);
}

/// The instant `outcome` was decided at, µs of store time.
fn decided_at(outcome: &tollgate::rate::RateOutcome) -> u64 {
    outcome.decided_at_us.expect("PostgreSQL names the instant")
}

/// A held check on a sliding log of 4 per second: its 4 units are dated at the hold's end, so
/// they count until 1 s after it (1.3 s after the charge), not 1 s after the charge; a charge
/// without a hold made after it does not shorten the log's life.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_held_check_on_a_sliding_log_counts_until_a_window_after_its_hold() {
    let store = server().await.builder().connect().await.unwrap();
    let hold = Duration::from_millis(300);
    let p = policy(Algorithm::SlidingLog, Limit::per_second("s", 4));
    let five = policy(Algorithm::SlidingLog, Limit::per_second("s", 5));
    let (who, other) = (caller("held-log"), caller("held-log-5"));
    let sent = Instant::now();
    let held = admitted(&store, &p, RateCheck::new(who, 4).held(hold)).await;
    let received = Instant::now();
    let t = decided_at(&held);
    assert_eq!(held.limits[0].remaining, 0);
    assert_eq!(
        held.limits[0].reset,
        Duration::from_millis(1300),
        "{held:?}"
    );
    // on a log of 5: held 4, then 1 without a hold, which logs its entry 300 ms earlier
    let t5 = decided_at(&admitted(&store, &five, RateCheck::new(other, 4).held(hold)).await);
    admitted(&store, &five, RateCheck::new(other, 1)).await;

    tokio::time::sleep_until((sent + Duration::from_millis(1100)).into()).await;
    let late = store.check_rate(&p, RateCheck::new(who, 1)).await.unwrap();
    let at = decided_at(&late);
    assert!(
        at < t + 1_300_000,
        "the check came too late to test: {late:?}"
    );
    assert!(
        !late.admitted,
        "the held units left with the window: {late:?}"
    );
    assert_eq!(
        late.retry_after,
        Duration::from_micros(t + 1_300_000 - at),
        "the wait runs to a window after the hold's end"
    );
    // the entry without a hold has left, the held ones have not: the log lives on
    let two = store
        .check_rate(&five, RateCheck::new(other, 2))
        .await
        .unwrap();
    assert!(decided_at(&two) < t5 + 1_300_000);
    assert!(
        !two.admitted,
        "the log expired with its entry without a hold: {two:?}"
    );
    assert_eq!(two.limits[0].remaining, 1, "{two:?}");

    tokio::time::sleep_until((received + Duration::from_millis(1350)).into()).await;
    let after = admitted(&store, &p, RateCheck::new(who, 1)).await;
    assert_eq!(after.limits[0].remaining, 3, "{after:?}");
}

/// A held check on GCRA (10 per second) starts from the hold's end: 10 held 100 ms do not fit
/// an empty state (they would end 1.1 s ahead), 9 do, and leave no room for a check right after.
/// The denial answers the state as it is; a look ignores the hold.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_held_check_on_gcra_is_charged_from_the_holds_end() {
    let store = server().await.builder().connect().await.unwrap();
    let hold = Duration::from_millis(100);
    let p = policy(Algorithm::Gcra, Limit::per_second("s", 10));
    let who = caller("held-gcra");
    let look = store
        .check_rate(&p, RateCheck::new(who, 0).held(hold))
        .await
        .unwrap();
    assert!(look.admitted);
    assert_eq!(look.limits[0].remaining, 10, "a look holds nothing");
    let ten = store
        .check_rate(&p, RateCheck::new(who, 10).held(hold))
        .await
        .unwrap();
    assert!(!ten.admitted, "{ten:?}");
    assert_eq!(ten.retry_after, hold, "{ten:?}");
    assert_eq!(ten.limits[0].remaining, 10, "the state as it is: {ten:?}");
    let nine = admitted(&store, &p, RateCheck::new(who, 9).held(hold)).await;
    assert_eq!(nine.limits[0].remaining, 0, "{nine:?}");
    let plain = store.check_rate(&p, RateCheck::new(who, 1)).await.unwrap();
    assert!(!plain.admitted, "{plain:?}");
    // the hold's end plus 9 emission intervals, less the time since: about 100 ms
    assert!(plain.retry_after <= hold, "{plain:?}");
    assert!(
        plain.retry_after > hold - Duration::from_millis(50),
        "{plain:?}"
    );
    // a sliding counter ignores the hold
    let counter = policy(Algorithm::SlidingCounter, Limit::per_second("s", 10));
    admitted(&store, &counter, RateCheck::new(who, 10).held(hold)).await;
}

/// A reset that reaches the server late times out (the operator's `tollgate reset` exits);
/// another copy charges the caller meanwhile; then the reset arrives, after its deadline, and
/// runs on a session still open (so that its transaction commits, as it does across a network
/// that delivers late what it held): it erases nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_late_reset_erases_nothing_charged_since() {
    let server = server().await;
    let proxy = common::proxy::Proxy::start(server.addr()).await;
    let direct = server.builder().connect().await.unwrap();
    let timeout = Duration::from_millis(400);
    let held = PgStore::builder(format!("postgres://postgres@{}/postgres", proxy.addr()))
        .schema(direct.schema().to_owned())
        .timeout(timeout)
        .pool_size(1)
        .purge_interval(None)
        .build()
        .unwrap();
    let client = server.client().await;
    let p = policy(Algorithm::Gcra, Limit::per_minute("m", 10));
    let who = caller("late-reset");
    // the reset prepared and the clock read on the one connection, before the delay
    held.reset_rate(&p, who).await.unwrap();
    let charged = admitted(&direct, &p, RateCheck::new(who, 4)).await;
    assert_eq!(charged.limits[0].remaining, 6);
    let conn = held.pool().get().await.unwrap();
    let pid: i32 = conn
        .query_one("SELECT pg_backend_pid()", &[])
        .await
        .unwrap()
        .get(0);
    drop(conn);
    // every byte reaches the other side a second after it was sent: the reset at its deadline
    // plus 600 ms, the end of its session right after it, its cancel request later still
    proxy.delay(Duration::from_millis(1000));
    let sent = Instant::now();
    let reset = held.reset_rate(&p, who).await.unwrap_err();
    assert_eq!(reset.kind(), StoreErrorKind::Timeout, "{reset}");
    // another copy charges the caller before the reset arrives
    let charged = admitted(&direct, &p, RateCheck::new(who, 3)).await;
    assert_eq!(charged.limits[0].remaining, 3);
    assert!(
        sent.elapsed() < Duration::from_millis(900),
        "charged too late to test"
    );
    // the reset arrives and runs, then its session ends
    let gone = format!("SELECT count(*) FROM pg_stat_activity WHERE pid = {pid}");
    assert!(becomes(&client, &gone, 0, Duration::from_secs(10)).await);
    assert_eq!(
        left(&direct, &p, who).await,
        [3],
        "the late reset erased the charge made after it timed out"
    );
    // a reset in time still erases
    direct.reset_rate(&p, who).await.unwrap();
    assert_eq!(left(&direct, &p, who).await, [10]);
}

/// `schema.sql` of version 8, as it was.
const SCHEMA_V8: &str = include_str!("fixtures/schema_v8.sql");

/// A schema of version 8 upgrades to this version: a copy of version 8 still checks through the
/// `decide_rates` it calls and resets through its `reset_rate` without a deadline, and this
/// version's held checks count on the upgraded schema.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_schema_of_version_8_upgrades_and_its_copies_keep_working() {
    let server = server().await;
    let client = server.client().await;
    let s = schema_of_version(&client, 8, SCHEMA_V8).await;
    let as_v8 = format!(
        "SELECT \"{s}\".decide_rates($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, \
         \"{s}\".now_us() + 10000000)"
    );
    let decide = |algorithm: i16, key: &'static str, attempt: i64| {
        let (client, sql) = (&client, &as_v8);
        async move {
            let row = client
                .query_one(
                    sql,
                    &[
                        &vec![algorithm],
                        &vec![1i32],
                        &vec![key.to_owned()],
                        &vec![3i64],
                        &vec![60_000_000i64],
                        &vec![0i64],
                        &vec![1i64],
                        &vec![attempt],
                        &vec![false],
                        &vec![-1i64],
                        &vec![0i64],
                        &vec![false],
                        &2_000_000i64,
                    ],
                )
                .await
                .unwrap();
            row.get::<_, Vec<i64>>(0)
        }
    };
    for (algorithm, key) in [(1i16, "v8:log"), (3, "v8:gcra")] {
        let before = decide(algorithm, key, 1).await;
        assert_eq!((before[2], before[5]), (1, 2), "{key}: {before:?}");
    }

    let store = server.builder().schema(s.clone()).connect().await.unwrap();
    let versions = format!("SELECT max(version)::bigint FROM \"{s}\".migrations");
    assert!(becomes(&client, &versions, 12, Duration::ZERO).await);
    // the copy of version 8: its attempt re-sent is not charged again, a new one is, and its
    // reset erases
    for (algorithm, key) in [(1i16, "v8:log"), (3, "v8:gcra")] {
        let again = decide(algorithm, key, 1).await;
        assert_eq!((again[2], again[5]), (1, 2), "{key}: {again:?}");
        let next = decide(algorithm, key, 2).await;
        assert_eq!((next[2], next[5]), (1, 1), "{key}: {next:?}");
        client
            .execute(
                &format!("SELECT \"{s}\".reset_rate($1::text[])"),
                &[&vec![key.to_owned()]],
            )
            .await
            .unwrap();
        let after = decide(algorithm, key, 3).await;
        assert_eq!((after[2], after[5]), (1, 2), "{key}: {after:?}");
    }

    // this version's held check on the upgraded schema
    let p = policy(Algorithm::Gcra, Limit::per_second("s", 10));
    let held = RateCheck::new(caller("v8-held"), 10).held(Duration::from_millis(100));
    assert!(!store.check_rate(&p, held).await.unwrap().admitted);
    store.reset_rate(&p, caller("v8-held")).await.unwrap();
}

/// Held checks on policies of several limits, and under a penalty: each limit decides the hold
/// (GCRA denies on the limit it overflows, a log dates its entries on every limit), and a held
/// check denied by a limit with a penalty blocks the caller.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn held_checks_on_several_limits_and_under_a_penalty() {
    let store = server().await.builder().connect().await.unwrap();
    let hold = Duration::from_millis(100);
    let limits = |a: u64, b: u64| {
        vec![
            Limit::new("s", a, Duration::from_secs(1)),
            Limit::new("m", b, Duration::from_secs(60)),
        ]
    };
    let ns = format!("t{}:rl", rand::random::<u32>());
    let gcra = Arc::new(RatePolicy::new(ns.clone(), Algorithm::Gcra, limits(10, 100)).unwrap());
    let who = caller("held-several");
    let ten = store
        .check_rate(&gcra, RateCheck::new(who, 10).held(hold))
        .await
        .unwrap();
    assert!(!ten.admitted, "{ten:?}");
    assert_eq!(ten.retry_after, hold);
    let left: Vec<u64> = ten.limits.iter().map(|l| l.remaining).collect();
    assert_eq!(left, [10, 100], "nothing charged");
    let nine = admitted(&store, &gcra, RateCheck::new(who, 9).held(hold)).await;
    let left: Vec<u64> = nine.limits.iter().map(|l| l.remaining).collect();
    // on the minute, 9 units from 100 ms on end 5.5 s ahead: more than 9 emission intervals
    assert_eq!(left, [0, 90], "{nine:?}");

    let ns = format!("t{}:rl", rand::random::<u32>());
    let log = Arc::new(RatePolicy::new(ns, Algorithm::SlidingLog, limits(4, 10)).unwrap());
    let held = admitted(&store, &log, RateCheck::new(who, 4).held(hold * 3)).await;
    let resets: Vec<Duration> = held.limits.iter().map(|l| l.reset).collect();
    assert_eq!(
        resets,
        [Duration::from_millis(1300), Duration::from_millis(60_300)],
        "each log dates the entries at the hold's end"
    );

    let ns = format!("t{}:rl", rand::random::<u32>());
    let blocking = Limit::new("b", 10, Duration::from_secs(1)).block_for(Duration::from_secs(5));
    let penalized = Arc::new(RatePolicy::new(ns, Algorithm::Gcra, vec![blocking]).unwrap());
    let denied = store
        .check_rate(&penalized, RateCheck::new(who, 10).held(hold))
        .await
        .unwrap();
    assert!(!denied.admitted, "{denied:?}");
    assert_eq!(
        denied.retry_after,
        Duration::from_secs(5),
        "blocked: {denied:?}"
    );
    let after = store
        .check_rate(&penalized, RateCheck::new(who, 1))
        .await
        .unwrap();
    assert!(!after.admitted, "the block holds: {after:?}");
}

/// A rolling deploy: copies of version 8 keep checking (log and GCRA, through the
/// `decide_rates` they call) while a copy of this version upgrades the schema under them. No
/// call fails or deadlocks, and afterwards this version's held checks count.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_schema_of_version_8_upgrades_under_its_copies_load() {
    let server = server().await;
    let client = server.client().await;
    let s = schema_of_version(&client, 8, SCHEMA_V8).await;
    let sql = format!(
        "SELECT \"{s}\".decide_rates($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, \
         10000000::bigint, \"{s}\".now_us() + 10000000)"
    );
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut workers = Vec::new();
    for w in 0..4i16 {
        let (copy, sql, stop) = (server.client().await, sql.clone(), Arc::clone(&stop));
        workers.push(tokio::spawn(async move {
            let mut calls = 0u32;
            while !stop.load(std::sync::atomic::Ordering::SeqCst) || calls == 0 {
                calls += 1;
                let keys = vec![format!("v8load:{w}:{}", calls % 8)];
                // sliding log and GCRA, the algorithms that take a hold now
                let algorithm = if w % 2 == 0 { 1i16 } else { 3 };
                let attempt = i64::from(calls) << 8 | i64::from(w);
                let reply: Vec<i64> = copy
                    .query_one(
                        &sql,
                        &[
                            &vec![algorithm],
                            &vec![1i32],
                            &keys,
                            &vec![1_000_000i64],
                            &vec![60_000_000i64],
                            &vec![0i64],
                            &vec![1i64],
                            &vec![attempt],
                            &vec![true],
                            &vec![-1i64],
                            &vec![0i64],
                            &vec![false],
                        ],
                    )
                    .await
                    .expect("a check of a copy of version 8 during the upgrade")
                    .get(0);
                assert_eq!(reply[2], 1, "{reply:?}");
            }
            calls
        }));
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    let store = server.builder().schema(s.clone()).connect().await.unwrap();
    let versions = format!("SELECT max(version)::bigint FROM \"{s}\".migrations");
    assert!(becomes(&client, &versions, 12, Duration::ZERO).await);
    tokio::time::sleep(Duration::from_millis(200)).await;
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    for worker in workers {
        assert!(worker.await.expect("every call of the load succeeded") > 0);
    }
    let p = policy(Algorithm::SlidingLog, Limit::per_second("s", 4));
    let held = RateCheck::reservation(caller("after"), 4).held(Duration::from_millis(300));
    let out = admitted(&store, &p, held).await;
    assert_eq!(out.limits[0].reset, Duration::from_millis(1300));
}

/// The base migration, as a schema of version 9 has it.
const SCHEMA_V9: &str = include_str!("../../src/store/postgres/migrations/0009_base.sql");

/// A schema of version 9 takes the numbered files of versions 10 to 12: its tables of limits,
/// the functions that count calls and those of lines, recorded; a second migration runs nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_schema_of_version_9_takes_the_later_files_once() {
    let server = server().await;
    let client = server.client().await;
    let s = schema_of_version(&client, 9, SCHEMA_V9).await;
    let exists = format!("SELECT (to_regclass('\"{s}\".limit_tables') IS NOT NULL)::int::bigint");
    assert!(becomes(&client, &exists, 0, Duration::ZERO).await);
    let store = server.builder().schema(s.clone()).connect().await.unwrap();
    let versions = format!("SELECT array_agg(version ORDER BY version) FROM \"{s}\".migrations");
    let recorded: Vec<i32> = client.query_one(&versions, &[]).await.unwrap().get(0);
    assert_eq!(recorded, [9, 10, 11, 12]);
    assert!(becomes(&client, &exists, 1, Duration::ZERO).await);
    let table = LimitTable::with_defaults(1, [(None, vec![Limit::per_second("s", 1)])]);
    let saved = store.save_limits("t:rl", 0, &table, "").await.unwrap();
    assert_eq!(saved, Saved::Saved(1));
    store.migrate().await.unwrap();
    let recorded: Vec<i32> = client.query_one(&versions, &[]).await.unwrap().get(0);
    assert_eq!(recorded, [9, 10, 11, 12]);
}
