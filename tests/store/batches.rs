//! Coalesced rate checks against a real redis-server: checks that wait for the store together go
//! out as one call, and every caller's decision is exactly the one it gets alone.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use crate::common;

use std::sync::Arc;
use std::time::Duration;

use futures_util::FutureExt;
use futures_util::future::join_all;
use proptest::prelude::*;
use tollgate::key::Key;
use tollgate::rate::{Algorithm, Limit, RateCheck, RateOutcome, RatePolicy};
use tollgate::store::{RateStore, RedisStore};

use common::{RedisServer, check};

/// Windows of days: no window starts or ends while a case runs, so that store time moves
/// nothing but resets and waits between the batched run and the one check at a time.
const DAY: Duration = Duration::from_secs(86_400);

/// How far the resets and waits of the two runs may be apart: the time between them.
const SLACK: Duration = Duration::from_secs(5);

/// One check of a case: which caller, which policy, what cost.
#[derive(Debug, Clone, Copy)]
struct Op {
    caller: u8,
    policy: usize,
    cost: u64,
}

/// A policy of a case: its algorithm and limits (quota, window in days).
type PolicySpec = (Algorithm, Vec<(u64, u64)>);

fn algorithm() -> impl Strategy<Value = Algorithm> {
    prop_oneof![
        Just(Algorithm::SlidingLog),
        Just(Algorithm::SlidingCounter),
        Just(Algorithm::Gcra),
    ]
}

fn policy_spec() -> impl Strategy<Value = PolicySpec> {
    (
        algorithm(),
        prop::collection::vec((1u64..8, prop_oneof![Just(1u64), Just(2), Just(7)]), 1..3),
    )
}

fn op(policies: usize) -> impl Strategy<Value = Op> {
    (
        0u8..4,
        0..policies,
        prop_oneof![3 => 1u64..3, 1 => Just(0u64), 1 => 3u64..10],
    )
        .prop_map(|(caller, policy, cost)| Op {
            caller,
            policy,
            cost,
        })
}

/// Policies, and waves of checks: the checks of one wave wait for the store together.
fn case() -> impl Strategy<Value = (Vec<PolicySpec>, Vec<Vec<Op>>)> {
    prop::collection::vec(policy_spec(), 1..4).prop_flat_map(|specs| {
        let n = specs.len();
        (
            Just(specs),
            prop::collection::vec(prop::collection::vec(op(n), 1..24), 1..5),
        )
    })
}

/// The policies of `specs`, in one namespace, each limit named after its policy: two policies
/// never share a key under different quotas and windows, whose state each would read under its
/// own (a GCRA remainder kept in 1/quota units of another quota), where a microsecond between
/// the two runs could change an outcome.
fn policies(specs: &[PolicySpec]) -> Vec<Arc<RatePolicy>> {
    let namespace = format!("b{}:rl", rand::random::<u64>());
    specs
        .iter()
        .enumerate()
        .map(|(p, (algorithm, limits))| {
            let limits = limits
                .iter()
                .enumerate()
                .map(|(i, &(quota, days))| {
                    Limit::new(format!("p{p}l{i}"), quota, DAY * days as u32)
                })
                .collect();
            Arc::new(RatePolicy::new(namespace.clone(), *algorithm, limits).unwrap())
        })
        .collect()
}

fn key(caller: u8) -> Key {
    Key::new("batch-test", &[caller])
}

fn reset_stats(server: &RedisServer) {
    let _: () = redis::cmd("CONFIG")
        .arg("RESETSTAT")
        .query(&mut server.conn())
        .unwrap();
}

fn near(a: Duration, b: Duration) -> bool {
    a.abs_diff(b) <= SLACK
}

/// Asserts that `batched` decided as `alone` did: the same admissions and remaining quotas, the
/// same waits and resets up to the time between the runs.
fn same(batched: &RateOutcome, alone: &RateOutcome, what: &str) -> Result<(), TestCaseError> {
    prop_assert_eq!(batched.admitted, alone.admitted, "{}: admitted", what);
    prop_assert_eq!(batched.limits.len(), alone.limits.len(), "{}", what);
    prop_assert!(
        near(batched.retry_after, alone.retry_after),
        "{}: retry after {:?} against {:?}",
        what,
        batched.retry_after,
        alone.retry_after
    );
    for (b, a) in batched.limits.iter().zip(&alone.limits) {
        prop_assert_eq!(b.remaining, a.remaining, "{}: remaining", what);
        prop_assert!(
            near(b.reset, a.reset),
            "{}: reset {:?} against {:?}",
            what,
            b.reset,
            a.reset
        );
    }
    Ok(())
}

/// The property, on `batched` (at most `max_batch` checks per call) against `alone`: every wave's
/// checks wait together, and the same checks one at a time decide alike. The runtime has one
/// thread, so a wave's checks all queue before the first call goes out: the calls are exactly
/// one per `max_batch` checks of each wave.
#[test]
fn batched_decisions_equal_the_decisions_alone() {
    let server = RedisServer::start();
    let runtime = current_thread();
    let _runtime = runtime.enter();
    for max_batch in [5, 32] {
        let batched = RedisStore::builder(server.url())
            .timeout(Duration::from_secs(2))
            .max_batch(max_batch)
            .build()
            .unwrap();
        let alone = RedisStore::builder(server.url())
            .timeout(Duration::from_secs(2))
            .max_batch(1)
            .build()
            .unwrap();
        // the script loaded before the calls are counted
        let warm = one_limit(Algorithm::Gcra, 1);
        runtime
            .block_on(batched.check_rate(&warm, RateCheck::new(key(0), 0)))
            .unwrap();
        check(48, case(), |(specs, waves)| {
            let (on_batched, on_alone) = (policies(&specs), policies(&specs));
            runtime.block_on(async {
                let mut decided = Vec::new();
                reset_stats(&server);
                for wave in &waves {
                    let checks = wave.iter().map(|op| {
                        let check = RateCheck::new(key(op.caller), op.cost);
                        batched.check_rate(&on_batched[op.policy], check)
                    });
                    for outcome in join_all(checks).await {
                        decided.push(outcome.unwrap());
                    }
                }
                let calls: u64 = waves
                    .iter()
                    .map(|w| w.len().div_ceil(max_batch) as u64)
                    .sum();
                prop_assert_eq!(
                    server.lua_calls(),
                    calls,
                    "calls of batches of {}",
                    max_batch
                );
                reset_stats(&server);
                let ops: Vec<Op> = waves.iter().flatten().copied().collect();
                for (i, op) in ops.iter().enumerate() {
                    let check = RateCheck::new(key(op.caller), op.cost);
                    let outcome = alone.check_rate(&on_alone[op.policy], check).await.unwrap();
                    same(
                        &decided[i],
                        &outcome,
                        &format!("check {i} {op:?} of {specs:?}"),
                    )?;
                }
                prop_assert_eq!(server.lua_calls(), ops.len() as u64, "calls one at a time");
                Ok(())
            })
        });
    }
}

/// A runtime on this thread: the order in which checks queue is the order of the code.
fn current_thread() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

fn one_limit(algorithm: Algorithm, quota: u64) -> Arc<RatePolicy> {
    let namespace = format!("b{}:rl", rand::random::<u64>());
    let limits = vec![Limit::new("l", quota, DAY)];
    Arc::new(RatePolicy::new(namespace, algorithm, limits).unwrap())
}

#[test]
fn a_caller_that_gave_up_before_its_batch_went_out_is_not_charged() {
    let server = RedisServer::start();
    let runtime = current_thread();
    let _runtime = runtime.enter();
    let store = server.store();
    for algorithm in [
        Algorithm::SlidingLog,
        Algorithm::SlidingCounter,
        Algorithm::Gcra,
    ] {
        let policy = one_limit(algorithm, 10);
        runtime.block_on(async {
            // queued (the call goes out once this task yields), then dropped
            let gave_up = store.check_rate(&policy, RateCheck::new(key(1), 3));
            assert!(gave_up.now_or_never().is_none());
            let outcome = store
                .check_rate(&policy, RateCheck::new(key(1), 1))
                .await
                .unwrap();
            assert!(outcome.admitted);
            assert_eq!(outcome.limits[0].remaining, 9, "{algorithm}: charged once");
        });
    }
}

#[test]
fn a_store_outlives_a_runtime_that_was_about_to_send() {
    let server = RedisServer::start();
    let runtime = current_thread();
    let _runtime = runtime.enter();
    let store = server.store();
    let policy = one_limit(Algorithm::Gcra, 10);
    {
        let brief = current_thread();
        brief.block_on(async {
            // the call is to go out on this runtime, which goes away first
            let pending = store.check_rate(&policy, RateCheck::new(key(2), 1));
            assert!(pending.now_or_never().is_none());
        });
    }
    let outcome = runtime
        .block_on(store.check_rate(&policy, RateCheck::new(key(2), 1)))
        .expect("checks go out on the runtime that remains");
    assert!(outcome.admitted);
    assert_eq!(outcome.limits[0].remaining, 9);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_callers_of_one_key_get_exactly_the_quota_in_batches() {
    let server = RedisServer::start();
    let store = server.store();
    for algorithm in [
        Algorithm::SlidingLog,
        Algorithm::SlidingCounter,
        Algorithm::Gcra,
    ] {
        let policy = one_limit(algorithm, 37);
        reset_stats(&server);
        let tasks: Vec<_> = (0..200)
            .map(|_| {
                let (store, policy) = (store.clone(), Arc::clone(&policy));
                tokio::spawn(async move {
                    store
                        .check_rate(&policy, RateCheck::new(key(3), 1))
                        .await
                        .unwrap()
                        .admitted
                })
            })
            .collect();
        let mut admitted = 0;
        for task in tasks {
            admitted += u32::from(task.await.unwrap());
        }
        assert_eq!(admitted, 37, "{algorithm}: exactly the quota");
        let calls = server.lua_calls();
        assert!(calls < 200, "{algorithm}: {calls} calls for 200 checks");
    }
}

#[test]
fn under_light_load_a_check_does_not_wait_for_the_call_in_flight() {
    let server = RedisServer::start();
    let runtime = current_thread();
    let _runtime = runtime.enter();
    let store = RedisStore::builder(server.url())
        .timeout(Duration::from_secs(5))
        .build()
        .unwrap();
    let policy = one_limit(Algorithm::Gcra, 100);
    runtime.block_on(async {
        store
            .check_rate(&policy, RateCheck::new(key(9), 0))
            .await
            .unwrap();
        reset_stats(&server);
        // Redis paused: every call stays in flight until it resumes
        server.pause();
        let check = |caller| {
            let (store, policy) = (store.clone(), Arc::clone(&policy));
            tokio::spawn(async move {
                store
                    .check_rate(&policy, RateCheck::new(key(caller), 1))
                    .await
            })
        };
        let settle = || async {
            for _ in 0..10 {
                tokio::task::yield_now().await;
            }
        };
        let mut checks = vec![check(1)];
        settle().await;
        // one check in flight: the next goes out beside it, in a second call
        checks.push(check(2));
        settle().await;
        // two calls in flight: these wait, and go out together
        checks.extend([check(3), check(4), check(5)]);
        settle().await;
        server.resume();
        for check in checks {
            assert!(check.await.unwrap().unwrap().admitted);
        }
    });
    assert_eq!(server.lua_calls(), 3, "calls: [1], [2], then [3, 4, 5]");
}

/// What `n` checks of one cost each, one caller each, sent at a steady `per_second` by
/// `store`, came to: per check its caller's number, when it was sent (from the first) and its
/// outcome (`Ok(admitted)`).
async fn steady_load(
    store: &RedisStore,
    policy: &Arc<RatePolicy>,
    n: u32,
    per_second: u32,
) -> Vec<(u32, Duration, Result<bool, tollgate::store::StoreError>)> {
    let started = tokio::time::Instant::now();
    let mut ticker = tokio::time::interval(Duration::from_secs(1) / per_second);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
    let mut tasks = Vec::with_capacity(n as usize);
    for i in 0..n {
        ticker.tick().await;
        let (store, policy) = (store.clone(), Arc::clone(policy));
        tasks.push(tokio::spawn(async move {
            let sent = started.elapsed();
            let check = RateCheck::new(far_caller(i), 1);
            let outcome = store.check_rate(&policy, check).await;
            (i, sent, outcome.map(|o| o.admitted))
        }));
    }
    let mut results = Vec::with_capacity(tasks.len());
    for task in tasks {
        results.push(task.await.unwrap());
    }
    results
}

fn far_caller(i: u32) -> Key {
    Key::new("far", &i.to_be_bytes())
}

/// With the store 5 ms away each way, one call of `max_batch(8)` decides at most 800 checks a
/// second. Offered twice that for 3 s, calls are pipelined: of the checks sent after the first
/// second, at least 90% are decided; and a check reported failed charged nothing, whenever its
/// call arrived.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn at_a_distance_load_beyond_one_call_is_decided_and_no_failed_check_is_charged() {
    let server = RedisServer::start();
    let proxy = common::proxy::Proxy::start(server.addr()).await;
    proxy.delay(Duration::from_millis(5));
    let store = RedisStore::builder(proxy.url())
        .timeout(Duration::from_millis(300))
        .max_batch(8)
        .build()
        .unwrap();
    let policy = Arc::new(
        RatePolicy::new("far:rl", Algorithm::Gcra, vec![Limit::per_minute("m", 10)]).unwrap(),
    );
    // the connection open and the store's clock read before the load starts
    let warm = RateCheck::new(Key::new("far", b"warm"), 0);
    store.check_rate(&policy, warm).await.unwrap();

    let results = steady_load(&store, &policy, 4800, 1600).await;
    let steady: Vec<_> = results
        .iter()
        .filter(|(_, sent, _)| *sent >= Duration::from_secs(1))
        .collect();
    let decided = steady.iter().filter(|(_, _, o)| o.is_ok()).count();
    assert!(
        decided * 10 >= steady.len() * 9,
        "{decided} of {} checks decided in steady state",
        steady.len()
    );
    assert!(
        results.iter().all(|(_, _, o)| !matches!(o, Ok(false))),
        "a caller of its first check was denied"
    );

    // whatever was held in flight has arrived (and was refused past its deadline)
    tokio::time::sleep(Duration::from_millis(500)).await;
    let direct = server.store();
    let failed: Vec<u32> = results
        .iter()
        .filter(|(_, _, o)| o.is_err())
        .map(|(i, _, _)| *i)
        .collect();
    for chunk in failed.chunks(64) {
        let looks = join_all(chunk.iter().map(|&i| {
            let (direct, policy) = (direct.clone(), Arc::clone(&policy));
            async move {
                let look = RateCheck::new(far_caller(i), 0);
                (i, direct.check_rate(&policy, look).await.unwrap())
            }
        }))
        .await;
        for (i, look) in looks {
            assert_eq!(
                look.limits[0].remaining, 10,
                "caller {i}: its check was reported failed, and charged"
            );
        }
    }
}

/// base64url without padding, as the store writes a caller's digest into its keys' hash tag.
fn base64url(bytes: &[u8]) -> String {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_";
    let mut out = String::new();
    for chunk in bytes.chunks(3) {
        let n = chunk
            .iter()
            .enumerate()
            .fold(0u32, |n, (i, &b)| n | u32::from(b) << (16 - 8 * i));
        for i in 0..=chunk.len() {
            out.push(ALPHABET[(n >> (18 - 6 * i) & 63) as usize] as char);
        }
    }
    out
}

/// On a three-master Cluster with one master stopped (SIGSTOP), callers whose keys the other
/// two serve are decided as before: at least 90% of their checks, while every check of the
/// stopped master's callers fails; none waits for another's node.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopped_cluster_master_holds_up_only_its_own_callers() {
    use common::cluster::{RedisCluster, key_slot};
    let cluster = tokio::task::spawn_blocking(|| {
        RedisCluster::start_announcing(&RedisCluster::free_ports(), None)
    })
    .await
    .unwrap();
    let store = RedisStore::cluster_builder(cluster.urls())
        .timeout(Duration::from_millis(300))
        .connect()
        .await
        .unwrap();
    let policy = Arc::new(
        RatePolicy::new("far:rl", Algorithm::Gcra, vec![Limit::per_minute("m", 10)]).unwrap(),
    );
    let master_of = |i: u32| {
        let tag = base64url(far_caller(i).as_bytes());
        cluster.master_of_slot(key_slot(&format!("{{{tag}}}")))
    };
    // every master answers before one stops, and the slot of a known key is where it lives
    let stopped = master_of(0).unwrap();
    assert!(
        store
            .check_rate(&policy, RateCheck::new(far_caller(0), 1))
            .await
            .unwrap()
            .admitted
    );
    let masters: Vec<Option<u16>> = (0..1200).map(master_of).collect();
    let pid: String = {
        let mut conn = redis::Client::open(format!("redis://127.0.0.1:{stopped}/"))
            .unwrap()
            .get_connection()
            .unwrap();
        let info: String = redis::cmd("INFO").arg("server").query(&mut conn).unwrap();
        info.lines()
            .find_map(|l| l.strip_prefix("process_id:"))
            .unwrap()
            .trim()
            .to_owned()
    };
    let signal = |sig: &str| {
        let status = std::process::Command::new("kill")
            .args([sig, &pid])
            .status()
            .unwrap();
        assert!(status.success(), "kill {sig} {pid}");
    };
    signal("-STOP");
    // 1.2 s of load: over before the other masters would call the stopped one failing (2 s)
    let results = steady_load(&store, &policy, 1200, 1000).await;
    signal("-CONT");
    let (mut others, mut decided, mut its_own) = (0, 0, 0);
    for (i, _, outcome) in &results {
        if masters[*i as usize] == Some(stopped) {
            its_own += 1;
            assert!(
                outcome.is_err(),
                "caller {i} of the stopped master was decided"
            );
        } else {
            others += 1;
            decided += usize::from(outcome.is_ok());
        }
    }
    assert!(its_own > 0 && others > 0, "{its_own} / {others}");
    assert!(
        decided * 10 >= others * 9,
        "{decided} of {others} checks of the other masters' callers decided"
    );
}

/// A stopped server answers nothing, and holds every call it is sent: each caller is still
/// answered by its deadline (the store's timeout from its check), with a timeout, not when its
/// call gives up. 4,200 checks at once fill what the calls in flight may carry (4,096); 200 more
/// a little later wait in the queue until the first calls time out, and then go out, in calls
/// that would give up later than their callers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopped_server_answers_every_caller_by_its_deadline() {
    let server = RedisServer::start();
    let timeout = Duration::from_millis(400);
    let store = RedisStore::builder(server.url())
        .timeout(timeout)
        .build()
        .unwrap();
    let policy = one_limit(Algorithm::Gcra, 10);
    // the connection open and the store's clock read before the server stops
    let warm = RateCheck::new(Key::new("far", b"warm"), 0);
    store.check_rate(&policy, warm).await.unwrap();
    server.pause();
    let ask = |i: u32| {
        let (store, policy) = (store.clone(), Arc::clone(&policy));
        tokio::spawn(async move {
            let asked = tokio::time::Instant::now();
            let outcome = store
                .check_rate(&policy, RateCheck::new(far_caller(i), 1))
                .await;
            (asked.elapsed(), outcome)
        })
    };
    let mut tasks: Vec<_> = (0..4_200).map(ask).collect();
    tokio::time::sleep(timeout / 2).await;
    tasks.extend((4_200..4_400).map(ask));
    let mut latest = Duration::ZERO;
    for task in tasks {
        let (took, outcome) = task.await.unwrap();
        let error = outcome.expect_err("a check was decided by a stopped server");
        assert_eq!(
            error.kind(),
            tollgate::store::StoreErrorKind::Timeout,
            "{error}"
        );
        latest = latest.max(took);
    }
    server.resume();
    // the answer comes at the deadline, give or take the scheduling of a busy machine
    assert!(
        latest <= timeout + Duration::from_millis(100),
        "a caller was answered {latest:?} after its check, past its deadline ({timeout:?})"
    );
}
