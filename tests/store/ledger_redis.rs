//! The attempt ledger (`docs/ledger.md`) on a real redis-server: reservations keep where their
//! charge went, settlements refund only what the limit still counts and are applied once, and
//! every outcome carries the store time of its decision.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use crate::common;

use std::sync::Arc;
use std::time::Duration;

use common::RedisServer;
use tollgate::key::Key;
use tollgate::rate::{Algorithm, Limit, RateCheck, RateOutcome, RatePolicy};
use tollgate::store::{RateStore, RedisStore};

const ALGORITHMS: [Algorithm; 3] = [
    Algorithm::SlidingLog,
    Algorithm::SlidingCounter,
    Algorithm::Gcra,
];

fn policy(algorithm: Algorithm, limits: Vec<Limit>) -> Arc<RatePolicy> {
    let ns = format!("ledger{}:rl", rand::random::<u32>());
    Arc::new(RatePolicy::new(ns, algorithm, limits).unwrap())
}

/// A limit whose windows do not roll while a test runs.
fn daily(quota: u64) -> Limit {
    Limit::new("d", quota, Duration::from_secs(86_400))
}

fn caller() -> Key {
    Key::new("test", b"caller")
}

async fn run(store: &RedisStore, policy: &Arc<RatePolicy>, check: RateCheck) -> RateOutcome {
    store.check_rate(policy, check).await.unwrap()
}

/// Remaining of the first limit after checking `check`, which must be admitted.
async fn admitted(store: &RedisStore, policy: &Arc<RatePolicy>, check: RateCheck) -> u64 {
    let out = run(store, policy, check).await;
    assert!(out.admitted, "{:?}: {out:?}", policy.algorithm());
    out.limits[0].remaining
}

/// Remaining of the first limit, looked at (cost 0).
async fn look(store: &RedisStore, policy: &Arc<RatePolicy>) -> u64 {
    admitted(store, policy, RateCheck::new(caller(), 0)).await
}

/// The store time `out` was decided at, in milliseconds.
fn decided_ms(out: &RateOutcome) -> u64 {
    out.decided_at_us.expect("decided by the store") / 1000
}

/// Sleeps until `ms` of store time (the server runs on this machine's clock).
async fn sleep_until_ms(ms: u64) {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap();
    let at = Duration::from_millis(ms);
    if at > now {
        tokio::time::sleep(at - now).await;
    }
}

/// The place keys of `policy`'s callers, with their values and TTLs in milliseconds.
fn places(server: &RedisServer, policy: &RatePolicy) -> Vec<(String, String, i64)> {
    let mut conn = server.conn();
    let keys: Vec<String> = redis::cmd("KEYS")
        .arg(format!("{}:*:place:*", policy.namespace()))
        .query(&mut conn)
        .unwrap();
    keys.into_iter()
        .map(|key| {
            let value: String = redis::cmd("GET").arg(&key).query(&mut conn).unwrap();
            let ttl: i64 = redis::cmd("PTTL").arg(&key).query(&mut conn).unwrap();
            (key, value, ttl)
        })
        .collect()
}

/// Every outcome of a call carries the store time it was decided at.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn outcomes_carry_the_store_time_of_their_decision() {
    let server = RedisServer::start();
    let store = server.store();
    let time = |conn: &mut redis::Connection| {
        let (secs, micros): (u64, u64) = redis::cmd("TIME").query(conn).unwrap();
        secs * 1_000_000 + micros
    };
    let mut conn = server.conn();
    for algorithm in ALGORITHMS {
        let p = policy(algorithm, vec![Limit::per_minute("m", 1)]);
        let before = time(&mut conn);
        let first = run(&store, &p, RateCheck::new(caller(), 1)).await;
        let denied = run(&store, &p, RateCheck::new(caller(), 1)).await;
        let after = time(&mut conn);
        assert!(first.admitted && !denied.admitted, "{algorithm:?}");
        for out in [&first, &denied] {
            let at = out.decided_at_us.expect("decided by the store");
            assert!(
                before <= at && at <= after,
                "{algorithm:?}: {before} {at} {after}"
            );
        }
        assert!(first.decided_at_us <= denied.decided_at_us, "{algorithm:?}");
    }
}

/// A reservation keeps its place — a counter's window, a GCRA span's end — until the end of that
/// window's successor or of the span; a re-send does not rewrite it, its settlement drops it. The
/// sliding log keeps none (its entries are named by the attempt).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reservation_keeps_its_place_until_settled() {
    let server = RedisServer::start();
    let store = server.store();
    for algorithm in ALGORITHMS {
        let p = policy(
            algorithm,
            vec![Limit::per_minute("m", 10), Limit::per_hour("h", 100)],
        );
        let reserved = RateCheck::reservation(caller(), 4);
        let out = run(&store, &p, reserved).await;
        assert!(out.admitted, "{algorithm:?}");
        let now_ms = decided_ms(&out);
        let kept = places(&server, &p);
        if algorithm == Algorithm::SlidingLog {
            assert!(kept.is_empty(), "{kept:?}");
            continue;
        }
        assert_eq!(kept.len(), 1, "{algorithm:?}: {kept:?}");
        let (key, value, ttl) = kept[0].clone();
        assert!(
            key.ends_with(&format!(":place:{:016x}", reserved.attempt())),
            "{key}"
        );
        // 'p:', then per limit where the charge went and the life it charged: the state's
        // born, the attempt that began it (this reservation's, on a new caller)
        let born = format!("{:016x}", reserved.attempt());
        let Some(fields) = value.strip_prefix("p:") else {
            panic!("{algorithm:?}: a place without its mark: {value}");
        };
        let fields: Vec<&str> = fields.split(':').collect();
        let number = |f: &str| f.parse::<u64>().unwrap_or_else(|_| panic!("{value}"));
        if algorithm == Algorithm::SlidingCounter {
            // per limit the window the charge went to, kept until its successor ends
            assert_eq!(fields.len(), 4, "{value}");
            assert_eq!(
                [number(fields[0]), number(fields[2])],
                [now_ms / 60_000, now_ms / 3_600_000],
                "{value}"
            );
            assert_eq!(
                [fields[1], fields[3]],
                [born.as_str(), born.as_str()],
                "{value}"
            );
            let until = (now_ms / 3_600_000 + 2) * 3_600_000 - now_ms;
            assert!(ttl > 0 && ttl as u64 <= until, "{ttl} {until}");
            assert!(ttl as u64 > until - 1000, "{ttl} {until}");
        } else {
            // per limit the arrival time after the charge: 4 of 10 per minute is 24 s on, 4 of
            // 100 per hour 144 s on, both whole microseconds; kept until the later one
            let at = out.decided_at_us.unwrap();
            assert_eq!(fields.len(), 6, "{value}");
            assert_eq!(
                [fields[0], fields[1], fields[3], fields[4]].map(number),
                [at + 24_000_000, 0, at + 144_000_000, 0],
                "{value}"
            );
            assert_eq!(
                [fields[2], fields[5]],
                [born.as_str(), born.as_str()],
                "{value}"
            );
            assert!(ttl > 143_000 && ttl <= 144_001, "{ttl}");
        }
        // the reservation re-sent: charged once, its place not rewritten
        assert_eq!(admitted(&store, &p, reserved).await, 6, "{algorithm:?}");
        let again = places(&server, &p);
        assert_eq!(again.len(), 1, "{algorithm:?}");
        assert_eq!(again[0].1, value, "{algorithm:?}");
        assert!(again[0].2 <= ttl, "{algorithm:?}: the expiry was set again");
        assert_eq!(
            admitted(&store, &p, reserved.settle(1)).await,
            9,
            "{algorithm:?}"
        );
        assert!(
            places(&server, &p).is_empty(),
            "{algorithm:?}: dropped once settled"
        );
    }
}

/// A refund after the reservation's charge left the window returns nothing: the quota another
/// caller spent since stays spent (GCRA and the sliding counter, 10 per second).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refund_after_the_window_rolled_does_not_return_what_others_spent() {
    let server = RedisServer::start();
    let store = server.store();
    let mut reservations = Vec::new();
    for algorithm in [Algorithm::Gcra, Algorithm::SlidingCounter] {
        let p = policy(algorithm, vec![Limit::per_second("s", 10)]);
        let a = RateCheck::reservation(caller(), 10);
        assert_eq!(admitted(&store, &p, a).await, 0, "{algorithm:?}: A");
        reservations.push((p, a));
    }
    tokio::time::sleep(Duration::from_millis(2150)).await;
    for (p, a) in reservations {
        let algorithm = p.algorithm();
        let b = RateCheck::new(caller(), 10);
        assert_eq!(admitted(&store, &p, b).await, 0, "{algorithm:?}: B");
        let settled = run(&store, &p, a.settle(0)).await;
        assert!(settled.admitted, "{algorithm:?}");
        assert_eq!(
            settled.limits[0].remaining, 0,
            "{algorithm:?}: nothing refunded"
        );
        let c = run(&store, &p, RateCheck::new(caller(), 10)).await;
        assert!(!c.admitted, "{algorithm:?}: C got B's quota back");
    }
}

/// A counter's reservation settled in the next window refunds from the previous window only, its
/// own: what the current window counts (another check's charge) stays.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_counter_refund_in_the_next_window_comes_out_of_the_previous_one() {
    let server = RedisServer::start();
    let store = server.store();
    let p = policy(Algorithm::SlidingCounter, vec![Limit::per_second("s", 10)]);
    // remaining under the counter's estimate at `ms` of store time: cur + prev * (share left)
    let expected = |cur: u64, prev: u64, ms: u64| {
        let elapsed = (ms % 1000) as f64;
        let used = cur as f64 + prev as f64 * (1000.0 - elapsed) / 1000.0;
        10 - (used - 1e-9).ceil() as u64
    };
    let a = RateCheck::reservation(caller(), 6);
    let reserved = run(&store, &p, a).await;
    assert!(reserved.admitted);
    let k = decided_ms(&reserved) / 1000;
    sleep_until_ms((k + 1) * 1000 + 100).await;
    let b = run(&store, &p, RateCheck::new(caller(), 3)).await;
    assert!(b.admitted);
    assert_eq!(decided_ms(&b) / 1000, k + 1, "B in the next window");
    assert_eq!(b.limits[0].remaining, expected(3, 6, decided_ms(&b)));
    sleep_until_ms((k + 1) * 1000 + 500).await;
    let before = run(&store, &p, RateCheck::new(caller(), 0)).await;
    assert_eq!(
        before.limits[0].remaining,
        expected(3, 6, decided_ms(&before))
    );
    let settled = run(&store, &p, a.settle(0)).await;
    assert!(settled.admitted);
    assert_eq!(
        decided_ms(&settled) / 1000,
        k + 1,
        "settled in the next window"
    );
    // the previous window's 6 are gone; the current window's 3 (B's) stay
    assert_eq!(settled.limits[0].remaining, 7, "{settled:?}");
    let after = run(&store, &p, RateCheck::new(caller(), 0)).await;
    if decided_ms(&after) / 1000 == k + 1 {
        assert_eq!(after.limits[0].remaining, 7);
    }
}

/// A log's reservation refunded by its settlement and then re-sent is not charged again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refunded_log_reservation_sent_again_is_not_charged_again() {
    let server = RedisServer::start();
    let store = server.store();
    let p = policy(Algorithm::SlidingLog, vec![daily(10)]);
    let a = RateCheck::reservation(caller(), 3);
    assert_eq!(admitted(&store, &p, a).await, 7);
    assert_eq!(admitted(&store, &p, a.settle(0)).await, 10);
    assert_eq!(admitted(&store, &p, a).await, 10, "the reservation re-sent");
    assert_eq!(look(&store, &p).await, 10);
}

/// A settlement re-sent after another attempt's settlement is applied once: by the store copy
/// that sent it (its record) and by another copy (the reservation's place was dropped; the log's
/// entries are named).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_settlement_sent_again_after_another_is_applied_once() {
    let server = RedisServer::start();
    let store = server.store();
    let copy = server.store();
    for algorithm in ALGORITHMS {
        let p = policy(algorithm, vec![daily(10)]);
        let a = RateCheck::reservation(caller(), 5);
        let b = RateCheck::reservation(caller(), 5);
        assert_eq!(admitted(&store, &p, a).await, 5, "{algorithm:?}");
        assert_eq!(admitted(&store, &p, b).await, 0, "{algorithm:?}");
        let settle_a = a.settle(2);
        assert_eq!(admitted(&store, &p, settle_a).await, 3, "{algorithm:?}");
        assert_eq!(admitted(&store, &p, b.settle(1)).await, 7, "{algorithm:?}");
        assert_eq!(
            admitted(&store, &p, settle_a).await,
            7,
            "{algorithm:?}: re-sent"
        );
        assert_eq!(
            admitted(&copy, &p, settle_a).await,
            7,
            "{algorithm:?}: sent again by another copy"
        );
        assert_eq!(
            admitted(&copy, &p, a.settle(2)).await,
            7,
            "{algorithm:?}: made again"
        );
        assert_eq!(look(&store, &p).await, 7, "{algorithm:?}");
    }
}

/// A plain check (not a reservation) settled for less refunds nothing; its overrun is charged.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plain_check_settled_for_less_refunds_nothing() {
    let server = RedisServer::start();
    let store = server.store();
    for algorithm in ALGORITHMS {
        let p = policy(algorithm, vec![daily(10)]);
        let plain = RateCheck::new(caller(), 4);
        assert_eq!(admitted(&store, &p, plain).await, 6, "{algorithm:?}");
        assert_eq!(
            admitted(&store, &p, plain.settle(0)).await,
            6,
            "{algorithm:?}"
        );
        assert_eq!(look(&store, &p).await, 6, "{algorithm:?}");
        let other = RateCheck::new(caller(), 1);
        assert_eq!(admitted(&store, &p, other).await, 5, "{algorithm:?}");
        assert_eq!(
            admitted(&store, &p, other.settle(3)).await,
            3,
            "{algorithm:?}: overrun"
        );
    }
}

/// In one call of `rate.lua`, a reservation and a settlement of one each name a place key after
/// their limit keys (none under the sliding log): the checks after them read their own keys.
#[test]
fn places_in_a_batch_keep_the_keys_of_the_checks_after_them_in_step() {
    let server = RedisServer::start();
    let mut conn = server.conn();
    let script = redis::Script::new(include_str!("../../src/store/redis/scripts/rate.lua"));
    let (ctr, log, gcra) = ("b:{1}:d:ctr", "b:{1}:d:log", "b:{1}:d:gcra");
    let (place_c, place_g) = (
        "b:{1}:place:00000000000000a1",
        "b:{1}:place:00000000000000a3",
    );
    // three policies, 10 per day each: the counter, the log, GCRA
    let mut args: Vec<&str> = vec!["9000000000000000", "1", "60000", "3"];
    for code in ["2", "1", "3"] {
        args.extend([code, "1", "10", "86400000000"]);
    }
    let mut keys = vec!["b:{1}:charged:1"];
    let checks: [(&str, &str, &str, &[&str]); 9] = [
        ("1", "r4", "00000000000000a1", &[ctr, place_c]),
        ("2", "r4", "00000000000000a2", &[log]),
        ("3", "r4", "00000000000000a3", &[gcra, place_g]),
        ("1", "2", "00000000000000b1", &[ctr]),
        ("2", "2", "00000000000000b2", &[log]),
        ("3", "2", "00000000000000b3", &[gcra]),
        (
            "1",
            "S4:1:00000000000000a1",
            "00000000000000c1",
            &[ctr, place_c],
        ),
        ("2", "S4:1:00000000000000a2", "00000000000000c2", &[log]),
        (
            "3",
            "S4:1:00000000000000a3",
            "00000000000000c3",
            &[gcra, place_g],
        ),
    ];
    for (policy, cost, attempt, named) in checks {
        args.extend([policy, cost, attempt]);
        keys.extend(named);
    }
    args.extend(["1", "1", "00000000000000d1", "2", "1", "00000000000000d2"]);
    args.extend(["3", "1", "00000000000000d3"]);
    keys.extend([ctr, log, gcra]);
    let mut invocation = script.prepare_invoke();
    for key in &keys {
        invocation.key(*key);
    }
    for arg in &args {
        invocation.arg(*arg);
    }
    let reply: Vec<i64> = invocation.invoke(&mut conn).unwrap();
    // per check admitted, retry and its limit's two numbers; then the store time. The limit's
    // units left, read from them: the log answers them; the counter its counts (a fresh day's:
    // none before), GCRA its TAT's offset (µs, and remainder in tenths of a µs): 10 less the
    // emission intervals of 8.64e9 µs it spans, rounded up
    assert_eq!(reply.len(), 12 * 4 + 1, "{reply:?}");
    let left = |check: usize, a: i64, b: i64| match check % 3 {
        0 => 10 - a - b,
        1 => a,
        _ => 10 - (a * 10 + b + 86_400_000_000 - 1) / 86_400_000_000,
    };
    let remaining: Vec<(i64, i64)> = reply
        .chunks(4)
        .take(12)
        .enumerate()
        .map(|(i, c)| (c[0], left(i, c[2], c[3])))
        .collect();
    let expected = [6, 6, 6, 4, 4, 4, 7, 7, 7, 6, 6, 6].map(|left| (1, left));
    assert_eq!(remaining, expected, "{reply:?}");
    let kept: Vec<String> = redis::cmd("KEYS")
        .arg("b:*:place:*")
        .query(&mut conn)
        .unwrap();
    assert!(
        kept.is_empty(),
        "the settlements dropped the places: {kept:?}"
    );
}

/// A GCRA refund returns only the part of the reservation's span still ahead of now: what drained
/// since stays spent, whatever was charged after it (10 per second: a unit is 100 ms).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gcra_refund_returns_only_the_span_still_ahead() {
    let server = RedisServer::start();
    let store = server.store();
    let p = policy(Algorithm::Gcra, vec![Limit::per_second("s", 10)]);
    let a = RateCheck::reservation(caller(), 5);
    let reserved = run(&store, &p, a).await;
    assert_eq!(reserved.limits[0].remaining, 5);
    sleep_until_ms(decided_ms(&reserved) + 300).await;
    // A's span ends 500 ms after it began, B's 300 ms after that
    let b = run(&store, &p, RateCheck::new(caller(), 3)).await;
    assert!(b.admitted);
    let elapsed = decided_ms(&b) - decided_ms(&reserved);
    assert!((300..450).contains(&elapsed), "{elapsed} ms");
    let settled = run(&store, &p, a.settle(0)).await;
    let elapsed = decided_ms(&settled) - decided_ms(&reserved);
    assert!(elapsed < 500, "settled while A's span lasts: {elapsed} ms");
    // what is left of A's span is refunded: B's 300 ms stay ahead, 3 units in use
    assert_eq!(settled.limits[0].remaining, 7, "{settled:?}");
}

/// A state or a place written by a copy of an earlier version (which named no lives): its place
/// (no 'p:' mark) refunds nothing, and the next charge names the state's life, so that its own
/// settlement refunds as always.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn states_and_places_of_an_earlier_version_are_named_by_the_next_charge() {
    let server = RedisServer::start();
    let store = server.store();
    let mut conn = server.conn();
    for algorithm in [Algorithm::SlidingCounter, Algorithm::Gcra] {
        let p = policy(algorithm, vec![daily(10)]);
        let first = RateCheck::reservation(caller(), 4);
        assert_eq!(admitted(&store, &p, first).await, 6, "{algorithm:?}");
        // as an earlier version wrote them: the state without its born, the place unmarked
        let keys: Vec<String> = redis::cmd("KEYS")
            .arg(format!("{}:*", p.namespace()))
            .query(&mut conn)
            .unwrap();
        for key in keys {
            let value: String = redis::cmd("GET").arg(&key).query(&mut conn).unwrap();
            let old = if let Some(place) = value.strip_prefix("p:") {
                let fields: Vec<&str> = place.split(':').collect();
                fields[..fields.len() - 1].join(":")
            } else if value.contains(':') {
                // a GCRA state's trailing ':' came later still
                let value = value.strip_suffix(':').unwrap_or(&value);
                value[..value.rfind(':').unwrap()].to_owned()
            } else {
                continue;
            };
            let _: () = redis::cmd("SET")
                .arg(&key)
                .arg(old)
                .arg("KEEPTTL")
                .query(&mut conn)
                .unwrap();
        }
        assert_eq!(
            admitted(&store, &p, first.settle(0)).await,
            6,
            "{algorithm:?}: an unmarked place refunds nothing"
        );
        let second = RateCheck::reservation(caller(), 2);
        assert_eq!(admitted(&store, &p, second).await, 4, "{algorithm:?}");
        assert_eq!(
            admitted(&store, &p, second.settle(0)).await,
            6,
            "{algorithm:?}: the life named by the second charge"
        );
        assert_eq!(look(&store, &p).await, 6, "{algorithm:?}");
    }
}

/// The state key of `policy`'s one caller and one limit, and its TTL in milliseconds.
fn state_key(server: &RedisServer, policy: &RatePolicy) -> (String, i64) {
    let mut conn = server.conn();
    let tag = match policy.algorithm() {
        Algorithm::SlidingLog => "log",
        Algorithm::SlidingCounter => "ctr",
        _ => "gcra",
    };
    let keys: Vec<String> = redis::cmd("KEYS")
        .arg(format!("{}:*:{tag}", policy.namespace()))
        .query(&mut conn)
        .unwrap();
    assert_eq!(keys.len(), 1, "{keys:?}");
    let ttl: i64 = redis::cmd("PTTL").arg(&keys[0]).query(&mut conn).unwrap();
    (keys[0].clone(), ttl)
}

/// The GCRA state key of `policy`'s one caller: its name, value and TTL in milliseconds.
fn gcra_state(server: &RedisServer, policy: &RatePolicy) -> (String, String, i64) {
    let (key, ttl) = state_key(server, policy);
    let value: String = redis::cmd("GET")
        .arg(&key)
        .query(&mut server.conn())
        .unwrap();
    (key, value, ttl)
}

/// The TAT of a GCRA state, in microseconds of store time.
fn tat_us(value: &str) -> u64 {
    value.split(':').next().unwrap().parse().unwrap()
}

/// The millisecond of store time a key whose state counts until `until_us` (a GCRA state's TAT, a
/// log's newest entry's end of stay) expires at: the end of the period of `g_ms` after the one
/// the millisecond past it (`ceil(until / 1000) + 1`) falls in.
fn expiry_ms(until_us: u64, g_ms: u64) -> i64 {
    i64::try_from((until_us.div_ceil(1000) + 1) / g_ms * g_ms + 2 * g_ms).unwrap()
}

/// A GCRA key outlives its TAT and expires at the end of the period after the TAT's (periods of a
/// quarter of the window, at most 30 s): a write
/// whose TAT stays in the period of the state it replaces keeps the key's expiry (SET KEEPTTL),
/// one that moves on sets the next (PSETEX); a state of an earlier version (no trailing ':', an
/// expiry of its own) gets one at its next write.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gcra_key_keeps_its_expiry_while_its_tat_stays_in_its_period() {
    let server = RedisServer::start();
    let store = server.store();
    // 30,000 per 30 s: a unit moves the TAT 1 ms; periods of a quarter of the window
    let g_ms = 7_500;
    let limit = || Limit::new("d", 30_000, Duration::from_secs(30));
    let p = policy(Algorithm::Gcra, vec![limit()]);
    // the key's expiry as a TTL read right after a write shows it: no later than the rule's (but
    // for the millisecond the server's clock for commands may lag the script's `TIME`), and earlier
    // by no more than the time the test took to read it
    let expires_as_ruled = |out: &RateOutcome, ttl: i64, tat: u64| {
        let seen = i64::try_from(decided_ms(out)).unwrap() + ttl;
        let rule = expiry_ms(tat, g_ms);
        assert!(
            (rule - 1_000..=rule + 1).contains(&seen),
            "{seen} against {rule}"
        );
        assert!(
            seen > i64::try_from(tat / 1000).unwrap(),
            "it outlives its TAT"
        );
    };
    let _: () = redis::cmd("CONFIG")
        .arg("RESETSTAT")
        .query(&mut server.conn())
        .unwrap();
    let first = run(&store, &p, RateCheck::new(caller(), 1)).await;
    let (_, value, ttl) = gcra_state(&server, &p);
    assert!(value.ends_with(':'), "{value}");
    let mut tat = tat_us(&value);
    expires_as_ruled(&first, ttl, tat);
    let (mut kept, mut set) = (0, 1);
    for cost in [100, 100, 100, 20_000, 100, 8_000, 100] {
        let out = run(&store, &p, RateCheck::new(caller(), cost)).await;
        assert!(out.admitted, "{out:?}");
        let (_, value, ttl) = gcra_state(&server, &p);
        let new_tat = tat_us(&value);
        assert_eq!(new_tat, tat.max(out.decided_at_us.unwrap()) + cost * 1000);
        expires_as_ruled(&out, ttl, new_tat);
        if expiry_ms(new_tat, g_ms) == expiry_ms(tat, g_ms) {
            kept += 1;
        } else {
            set += 1;
        }
        tat = new_tat;
    }
    // one PSETEX per call for its record, one per write that set the key's expiry
    assert_eq!(server.calls("set"), kept, "writes that kept the expiry");
    assert_eq!(server.calls("psetex"), 8 + set, "{kept} kept, {set} set");
    assert!(
        kept >= 3,
        "writes within a period keep the expiry: {kept} kept, {set} set"
    );

    // as a copy of an earlier version leaves it: no trailing ':', an expiry of its own
    let older = policy(Algorithm::Gcra, vec![limit()]);
    run(&store, &older, RateCheck::new(caller(), 5_000)).await;
    let (key, value, _) = gcra_state(&server, &older);
    let _: () = redis::cmd("SET")
        .arg(&key)
        .arg(value.trim_end_matches(':'))
        .arg("PX")
        .arg(300)
        .query(&mut server.conn())
        .unwrap();
    let out = run(&store, &older, RateCheck::new(caller(), 1)).await;
    let (_, next, ttl) = gcra_state(&server, &older);
    assert!(next.ends_with(':'), "marked by its next write: {next}");
    assert_eq!(tat_us(&next), tat_us(&value) + 1000);
    expires_as_ruled(&out, ttl, tat_us(&next));
}

/// A sliding log outlives its newest entry's stay in the window, to the end of the period after
/// the one that stay ends in (periods of a quarter of the window, at most 30 s): the checks of a
/// period find its expiry set, and one of a later period moves it on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sliding_log_expires_at_the_end_of_the_period_after_its_newest_entry_leaves() {
    let server = RedisServer::start();
    let store = server.store();
    for window_ms in [20_000, 90_000, 200_000] {
        let g_ms = (window_ms / 4).min(30_000);
        let p = policy(
            Algorithm::SlidingLog,
            vec![Limit::new("d", 1_000, Duration::from_millis(window_ms))],
        );
        let mut latest = 0;
        for cost in [1, 3, 1] {
            let out = run(&store, &p, RateCheck::new(caller(), cost)).await;
            assert!(out.admitted, "{out:?}");
            let (_, ttl) = state_key(&server, &p);
            let decided = out.decided_at_us.unwrap();
            let seen = i64::try_from(decided / 1000).unwrap() + ttl;
            // never shorter than an earlier check set it (give or take the millisecond of the
            // server's clock for commands)
            latest = latest.max(expiry_ms(decided + window_ms * 1000, g_ms));
            assert!(
                (latest - 1_000..=latest + 1).contains(&seen),
                "{window_ms} ms: {seen} against {latest}"
            );
        }
    }
}
