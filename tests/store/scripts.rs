//! Every Lua script run twice with the same arguments against a real redis-server, as happens
//! when a command is re-sent after a dropped connection or its reply is lost: the second run
//! answers as the first did and changes nothing more.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use crate::common;

use common::RedisServer;
use redis::{Connection, Script, Value};

fn script(name: &str) -> Script {
    let source = match name {
        "claim" => include_str!("../../src/store/redis/scripts/claim.lua"),
        "lock_acquire" => include_str!("../../src/store/redis/scripts/lock_acquire.lua"),
        "compare_and_delete" => {
            include_str!("../../src/store/redis/scripts/compare_and_delete.lua")
        }
        "compare_and_pexpire" => {
            include_str!("../../src/store/redis/scripts/compare_and_pexpire.lua")
        }
        "idem_begin" => include_str!("../../src/store/redis/scripts/idem_begin.lua"),
        "idem_complete" => include_str!("../../src/store/redis/scripts/idem_complete.lua"),
        "idem_extend" => include_str!("../../src/store/redis/scripts/idem_extend.lua"),
        "idem_release" => include_str!("../../src/store/redis/scripts/idem_release.lua"),
        "rate" => include_str!("../../src/store/redis/scripts/rate.lua"),
        "confirm" => include_str!("../../src/store/redis/scripts/confirm.lua"),
        "reset" => include_str!("../../src/store/redis/scripts/reset.lua"),
        "line" => include_str!("../../src/store/redis/scripts/line.lua"),
        other => panic!("no script {other}"),
    };
    Script::new(source)
}

/// Runs `name` with `keys` and `args`.
fn run(conn: &mut Connection, name: &str, keys: &[&str], args: &[&str]) -> Value {
    let script = script(name);
    let mut invocation = script.prepare_invoke();
    for key in keys {
        invocation.key(*key);
    }
    for arg in args {
        invocation.arg(*arg);
    }
    invocation.invoke(conn).unwrap()
}

/// Runs `name` twice with the same `keys` and `args`; asserts both answers are alike and returns
/// the answer.
fn twice(conn: &mut Connection, name: &str, keys: &[&str], args: &[&str]) -> Value {
    let first = run(conn, name, keys, args);
    let second = run(conn, name, keys, args);
    assert_eq!(second, first, "{name}: the second run answers otherwise");
    first
}

/// A deadline no test reaches: 2255, in microseconds of store time.
const LATER: &str = "9000000000000000";

/// A deadline that has passed: one microsecond into 1970.
const EARLIER: &str = "1";

fn get(conn: &mut Connection, key: &str) -> Option<String> {
    redis::cmd("GET").arg(key).query(conn).unwrap()
}

fn hash(conn: &mut Connection, key: &str) -> Vec<(String, Vec<u8>)> {
    let mut fields: Vec<(String, Vec<u8>)> = redis::cmd("HGETALL").arg(key).query(conn).unwrap();
    fields.sort();
    fields
}

fn int(v: &Value) -> i64 {
    match v {
        Value::Int(n) => *n,
        other => panic!("not an integer: {other:?}"),
    }
}

fn items(v: Value) -> Vec<Value> {
    match v {
        Value::Array(items) => items,
        other => panic!("not an array: {other:?}"),
    }
}

#[test]
fn a_claim_run_twice_is_won_twice() {
    let server = RedisServer::start();
    let mut conn = server.conn();
    let keys = ["c:{1}", "c:{1}:pending"];
    let args = ["holder-a", "0", "0", LATER];
    let won = items(run(&mut conn, "claim", &keys, &args));
    assert_eq!(int(&won[0]), 1, "won, written");
    let again = items(run(&mut conn, "claim", &keys, &args));
    assert_eq!(int(&again[0]), 2, "won again, nothing written");
    assert_eq!([&again[1]], [&won[1]]);
    assert_eq!(get(&mut conn, "c:{1}").as_deref(), Some("holder-a"));
    let lost = items(run(
        &mut conn,
        "claim",
        &keys,
        &["holder-b", "0", "0", LATER],
    ));
    assert_eq!(int(&lost[0]), 0, "another holder loses");
}

/// A durable claim is pending until its marker is dropped: another holder learns that it is in
/// progress, not taken; a durable re-run marks it pending again, and the marker expires.
#[test]
fn a_durable_claim_reads_as_pending_until_confirmed() {
    let server = RedisServer::start();
    let mut conn = server.conn();
    let keys = ["c:{1}", "c:{1}:pending"];
    let won = items(run(&mut conn, "claim", &keys, &["a", "0", "60000", LATER]));
    assert_eq!(int(&won[0]), 1);
    assert_eq!(get(&mut conn, keys[1]).as_deref(), Some("a"));
    let pending = items(run(&mut conn, "claim", &keys, &["b", "0", "60000", LATER]));
    assert_eq!(int(&pending[0]), 3, "in progress, not taken");
    assert_eq!(
        int(&run(&mut conn, "confirm", &keys[1..], &["b"])),
        0,
        "b's own only"
    );
    assert_eq!(int(&run(&mut conn, "confirm", &keys[1..], &["a"])), 1);
    let taken = items(run(&mut conn, "claim", &keys, &["b", "0", "60000", LATER]));
    assert_eq!(int(&taken[0]), 0, "confirmed: taken");
    let again = items(run(&mut conn, "claim", &keys, &["a", "0", "60000", LATER]));
    assert_eq!(int(&again[0]), 2, "the same holder again");
    assert_eq!(
        get(&mut conn, keys[1]).as_deref(),
        Some("a"),
        "pending again"
    );
}

#[test]
fn a_lock_acquisition_run_twice_keeps_its_fencing_token() {
    let server = RedisServer::start();
    let mut conn = server.conn();
    let keys = ["l:{1}", "l:{1}:fence"];
    let args = ["t", "5000", "60000", LATER];
    let acquired = items(run(&mut conn, "lock_acquire", &keys, &args));
    assert_eq!(int(&acquired[0]), 1, "acquired by this call");
    let fence = int(&acquired[1]);
    let again = items(run(&mut conn, "lock_acquire", &keys, &args));
    assert_eq!(
        [int(&again[0]), int(&again[1])],
        [2, fence],
        "held already, the same fencing token"
    );
    assert_eq!(get(&mut conn, keys[1]), Some(fence.to_string()));
    assert_eq!(get(&mut conn, keys[0]).as_deref(), Some("t"));
    let held = items(run(
        &mut conn,
        "lock_acquire",
        &keys,
        &["u", "5000", "60000", LATER],
    ));
    assert_eq!(int(&held[0]), 0, "another owner is refused");
}

#[test]
fn a_release_run_twice_is_released_twice() {
    let server = RedisServer::start();
    let mut conn = server.conn();
    let keys = ["l:{1}", "l:{1}:released"];
    let _: () = redis::cmd("SET")
        .arg(keys[0])
        .arg("t")
        .query(&mut conn)
        .unwrap();
    let released = twice(
        &mut conn,
        "compare_and_delete",
        &keys,
        &["t", "60000", "call-1"],
    );
    assert_eq!(int(&released), 1);
    assert_eq!(get(&mut conn, keys[0]), None);
    let other_call = run(
        &mut conn,
        "compare_and_delete",
        &keys,
        &["t", "60000", "call-2"],
    );
    assert_eq!(int(&other_call), 0, "another call finds the lock gone");
}

#[test]
fn an_extension_run_twice_is_extended_twice() {
    let server = RedisServer::start();
    let mut conn = server.conn();
    let _: () = redis::cmd("SET")
        .arg("l:{1}")
        .arg("t")
        .query(&mut conn)
        .unwrap();
    let extended = twice(
        &mut conn,
        "compare_and_pexpire",
        &["l:{1}"],
        &["t", "5000", LATER],
    );
    assert_eq!(int(&extended), 1);
}

#[test]
fn idempotency_scripts_run_twice_answer_alike() {
    let server = RedisServer::start();
    let mut conn = server.conn();
    let record = "i:{1}";
    let marked = [record, "i:{1}:pending"];
    let begin = ["fp", "t", "30000", LATER];
    let claimed = run(&mut conn, "idem_begin", &marked, &begin);
    assert_eq!(items(claimed), vec![Value::Int(0)], "claimed, written");
    let running = hash(&mut conn, record);
    let again = run(&mut conn, "idem_begin", &marked, &begin);
    assert_eq!(
        items(again),
        vec![Value::Int(4)],
        "claimed already, not in flight"
    );
    assert_eq!(hash(&mut conn, record), running);
    assert_eq!(
        int(&twice(
            &mut conn,
            "idem_extend",
            &[record],
            &["t", "30000", LATER]
        )),
        1
    );
    assert_eq!(hash(&mut conn, record), running);
    let stored = twice(
        &mut conn,
        "idem_complete",
        &marked,
        &["t", "response", "60000", "0", LATER],
    );
    assert_eq!(int(&stored), 1, "stored, not lost");
    let done = hash(&mut conn, record);
    assert!(
        done.contains(&("s".to_owned(), b"done".to_vec())),
        "{done:?}"
    );
    assert!(
        done.contains(&("r".to_owned(), b"response".to_vec())),
        "{done:?}"
    );
    // the owner's token can neither extend nor release a completed record
    assert_eq!(
        int(&run(
            &mut conn,
            "idem_extend",
            &[record],
            &["t", "1", LATER]
        )),
        0
    );
    let keys = [record, "i:{1}:released"];
    assert_eq!(
        int(&run(&mut conn, "idem_release", &keys, &["t", "60000", "c"])),
        0
    );
    assert_eq!(hash(&mut conn, record), done);

    let other = ["i:{2}", "i:{2}:released"];
    run(
        &mut conn,
        "idem_begin",
        &["i:{2}", "i:{2}:pending"],
        &["fp", "t", "30000", LATER],
    );
    let released = twice(&mut conn, "idem_release", &other, &["t", "60000", "call-1"]);
    assert_eq!(int(&released), 1, "released, both times");
    assert!(hash(&mut conn, other[0]).is_empty());
}

/// The state a rate script leaves in `key`: the string, or the log's members and scores.
fn rate_state(conn: &mut Connection, script: &str, key: &str) -> Vec<String> {
    if script == "sliding_log" {
        redis::cmd("ZRANGE")
            .arg(key)
            .arg(0)
            .arg(-1)
            .arg("WITHSCORES")
            .query(conn)
            .unwrap()
    } else {
        get(conn, key).into_iter().collect()
    }
}

/// Runs `rate.lua` as one call whose record is `record`: `args` as the script takes them less the
/// records' number and retention: the deadline, the policies, then per check its policy, cost and
/// attempt. The checks' answers, less the store time the reply ends with.
fn rate(conn: &mut Connection, record: &str, keys: &[&str], args: &[&str]) -> Value {
    Value::Array(rate_at(conn, record, keys, args).0)
}

/// [`rate`]'s answers, and the store time the call decided at (µs).
fn rate_at(conn: &mut Connection, record: &str, keys: &[&str], args: &[&str]) -> (Vec<Value>, i64) {
    let mut full: Vec<&str> = vec![args[0], "1", "60000"];
    let policies: usize = args[1].parse().unwrap();
    let mut at = 2;
    for _ in 0..policies {
        let limits: usize = args[at + 1].parse().unwrap();
        at += 2 + 2 * limits;
    }
    full.extend(&args[1..at]);
    full.extend(&args[at..]);
    let mut all = vec![record];
    all.extend(keys);
    let reply = run(conn, "rate", &all, &full);
    let at = items(reply.clone()).last().map(int).unwrap_or_default();
    (decided(conn, reply), at)
}

/// The units a limit of `quota` per `window_us` under algorithm `code` has left, read as the
/// store reads them from the two numbers `rate.lua` answers it by (`reply[at]` and the next), at
/// the call's store time `now_us`: a sliding log answers them; a sliding counter its current and
/// previous windows' counts; GCRA its TAT's offset from then (µs) and remainder.
fn left(code: &str, quota: i64, window_us: i64, now_us: i64, reply: &[Value], at: usize) -> i64 {
    let (a, b) = (int(&reply[at]), int(&reply[at + 1]));
    match code {
        "1" => a,
        "2" => {
            let window = window_us as f64 / 1000.0;
            let now = (now_us / 1000) as f64;
            let elapsed = now - (now / window).floor() * window;
            let used = a as f64 + b as f64 * (window - elapsed) / window;
            (quota - (used - 1e-9).ceil() as i64).max(0)
        }
        _ => (quota - (a * quota + b + window_us - 1) / window_us).max(0),
    }
}

/// The answers of a reply of `rate.lua`, whose last item, the store time of the call, is checked
/// against the server's clock and dropped.
fn decided(conn: &mut Connection, reply: Value) -> Vec<Value> {
    let mut reply = items(reply);
    let at = int(&reply.pop().expect("the store time"));
    let (secs, micros): (i64, i64) = redis::cmd("TIME").query(conn).unwrap();
    let now = secs * 1_000_000 + micros;
    assert!(
        at <= now && now - at < 5_000_000,
        "decided at {at}, now {now}"
    );
    reply
}

/// The algorithm codes of `rate.lua`.
const ALGORITHMS: [(&str, &str); 3] = [
    ("sliding_log", "1"),
    ("sliding_counter", "2"),
    ("gcra", "3"),
];

#[test]
fn rate_checks_run_twice_are_charged_once() {
    let server = RedisServer::start();
    let mut conn = server.conn();
    for (name, code) in ALGORITHMS {
        for cost in ["1", "2"] {
            let keys = [
                &format!("r:{{{name}{cost}}}:a")[..],
                &format!("r:{{{name}{cost}}}:b"),
            ];
            // two limits: 5 per minute, 9 per hour
            let args = [
                LATER,
                "1",
                code,
                "2",
                "5",
                "60000000",
                "9",
                "3600000000",
                "1",
                cost,
                "00000000000000a1",
            ];
            let (first, at) = rate_at(&mut conn, &format!("rec:{name}{cost}"), &keys, &args);
            let state = [
                rate_state(&mut conn, name, keys[0]),
                rate_state(&mut conn, name, keys[1]),
            ];
            let (second, again) = rate_at(&mut conn, &format!("rec:{name}{cost}"), &keys, &args);
            assert_eq!(int(&first[0]), 1, "{name} cost {cost}: admitted");
            assert_eq!(int(&second[0]), 1, "{name} cost {cost}: admitted again");
            // remaining of each limit, as the first run left it
            let units = |reply: &[Value], now| {
                [
                    left(code, 5, 60_000_000, now, reply, 2),
                    left(code, 9, 3_600_000_000, now, reply, 4),
                ]
            };
            assert_eq!(
                units(&second, again),
                units(&first, at),
                "{name} cost {cost}: the second run charged again"
            );
            let after = [
                rate_state(&mut conn, name, keys[0]),
                rate_state(&mut conn, name, keys[1]),
            ];
            assert_eq!(after, state, "{name} cost {cost}: the second run wrote");
        }
    }
}

/// The common check (one limit, no penalty, no calls counted) is decided by a path of its own in
/// `rate.lua`: it answers and writes exactly as the general one does. Each check goes out twice
/// in one call, at one store time and under one attempt: under a policy of its one limit (the
/// common path), and under a policy of that limit and one that never binds (the general path).
/// Over calls spread across windows — costs of 0, 1, 2, the quota and more, slices held for half
/// a window, calls sent twice — both answer alike for that limit and leave the same state, with
/// the same expiry (to within the time the call took).
#[test]
fn the_common_check_answers_and_writes_as_the_general_one() {
    let server = RedisServer::start();
    let mut conn = server.conn();
    let mut seed: u64 = 0x9e37_79b9_7f4a_7c15;
    let mut next = move |n: u64| {
        seed = seed
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        (seed >> 33) % n
    };
    for (name, code) in &ALGORITHMS[1..] {
        // 4 per 0.4 s; the general policy adds 10^9 per 0.4 s
        let (one, general, wide) = (
            format!("r:{{same-{name}}}:one"),
            format!("r:{{same-{name}}}:general"),
            format!("r:{{same-{name}}}:wide"),
        );
        let mut attempt = 0u64;
        for call in 0..60 {
            let costs: Vec<String> = (0..=next(3))
                .map(|_| match next(7) {
                    0 => "0".to_owned(),
                    1 | 2 => "1".to_owned(),
                    3 => "2".to_owned(),
                    4 => "4".to_owned(),
                    5 => "5".to_owned(),
                    _ => "c1+200000".to_owned(),
                })
                .collect();
            let mut args: Vec<String> = [
                LATER,
                "2",
                code,
                "1",
                "4",
                "400000",
                code,
                "2",
                "4",
                "400000",
                "1000000000",
                "400000",
            ]
            .map(str::to_owned)
            .to_vec();
            let mut keys: Vec<&str> = Vec::new();
            for cost in &costs {
                attempt += 1;
                let id = format!("{attempt:016x}");
                args.extend(["1".to_owned(), cost.clone(), id.clone()]);
                args.extend(["2".to_owned(), cost.clone(), id]);
                keys.extend([&one[..], &general, &wide]);
            }
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            let record = format!("rec:{name}:same:{call}");
            let sent = std::time::Instant::now();
            let mut replies = vec![items(rate(&mut conn, &record, &keys, &args))];
            if call % 5 == 0 {
                // sent again: both paths read the call's record, and what they admitted is
                // admitted again
                replies.push(items(rate(&mut conn, &record, &keys, &args)));
            }
            let mut admitted = Vec::new();
            for (sent, mut reply) in replies.into_iter().enumerate() {
                let mut each = Vec::new();
                for (c, cost) in costs.iter().enumerate() {
                    let common: Vec<i64> = reply.drain(..4).map(|v| int(&v)).collect();
                    let general: Vec<i64> = reply.drain(..6).map(|v| int(&v)).collect();
                    assert_eq!(
                        common,
                        general[..4],
                        "{name}, call {call} (sent {sent}), check {c} (cost {cost}): the common \
                         path answers otherwise"
                    );
                    each.push(common[0]);
                }
                admitted.push(each);
            }
            if let [first, again] = &admitted[..] {
                for (c, (was, is)) in first.iter().zip(again).enumerate() {
                    assert!(
                        *was == 0 || *is == 1,
                        "{name}, call {call}, check {c}: admitted, then denied when sent again"
                    );
                }
            }
            assert_eq!(
                get(&mut conn, &one),
                get(&mut conn, &general),
                "{name}, call {call}: the states differ"
            );
            // the scripts set an expiry as a span from when the write runs (PSETEX), so the two
            // keys' may differ by as long as the calls took; one kept (KEEPTTL) where the other
            // was set anew differs by about a period (a quarter of the window, 100 ms)
            let took = i64::try_from(sent.elapsed().as_millis()).unwrap() + 1;
            let expiry = |conn: &mut Connection, key: &str| -> i64 {
                redis::cmd("PEXPIRETIME").arg(key).query(conn).unwrap()
            };
            let (common, general) = (expiry(&mut conn, &one), expiry(&mut conn, &general));
            assert!(
                (common - general).abs() <= took,
                "{name}, call {call}: the expiries differ ({common}, {general}; the call took \
                 {took} ms)"
            );
            std::thread::sleep(std::time::Duration::from_millis(next(60)));
        }
    }
}

/// A call re-sent after other calls charged the caller reads its own record, and a check sent
/// again in a later call reads the record of the call it went out in: neither charges twice,
/// whatever ran in between; a record that names nothing charged changes nothing.
#[test]
fn checks_sent_again_after_others_are_charged_once() {
    let server = RedisServer::start();
    let mut conn = server.conn();
    for (name, code) in ALGORITHMS {
        let key = format!("r:{{again-{name}}}:a");
        let record = |call: &str| format!("r:{{again-{name}}}:charged:{call}");
        // 10 per minute; one check per call: policy 1, cost 1, the attempt (and where it went)
        let call = |attempt: &'static str| {
            vec![
                LATER, "0", "60000", "1", code, "1", "10", "60000000", "1", "1", attempt,
            ]
        };
        let remaining = |reply: Value| {
            let reply = items(reply);
            assert_eq!(int(&reply[0]), 1, "{name}: admitted");
            let now = reply.last().map(int).unwrap_or_default();
            left(code, 10, 60_000_000, now, &reply, 2)
        };
        let (a, b) = (record("a"), record("b"));
        let mut first = call("00000000000000e1");
        first[1] = "1";
        assert_eq!(remaining(run(&mut conn, "rate", &[&a, &key], &first)), 9);
        let mut second = call("00000000000000e2");
        second[1] = "1";
        assert_eq!(remaining(run(&mut conn, "rate", &[&b, &key], &second)), 8);
        // the first call again, as a connection re-sends it
        assert_eq!(remaining(run(&mut conn, "rate", &[&a, &key], &first)), 8);
        // the first check again, in a third call that names the first call's record
        let c = record("c");
        let mut third = call("00000000000000e1@2:1");
        third[1] = "2";
        assert_eq!(
            remaining(run(&mut conn, "rate", &[&c, &a, &key], &third)),
            8
        );
        // and once more, naming the third call's record: the mark was carried over
        let mut fourth = call("00000000000000e1@2:1");
        fourth[1] = "2";
        assert_eq!(
            remaining(run(&mut conn, "rate", &[&record("d"), &c, &key], &fourth)),
            8
        );
        // a check that names a record of another attempt's call is a new charge
        let mut fifth = call("00000000000000e3@2:1");
        fifth[1] = "2";
        let missing = record("none");
        assert_eq!(
            remaining(run(
                &mut conn,
                "rate",
                &[&record("e"), &missing, &key],
                &fifth
            )),
            7
        );
        // one attempt twice in one call, the second naming the first: charged once
        let mut twice = call("00000000000000f1");
        twice[1] = "1";
        twice.extend(["1", "1", "00000000000000f1@1:1"]);
        let both = items(run(&mut conn, "rate", &[&record("f"), &key, &key], &twice));
        let now = both.last().map(int).unwrap_or_default();
        assert_eq!(
            [
                int(&both[0]),
                left(code, 10, 60_000_000, now, &both, 2),
                int(&both[4]),
                left(code, 10, 60_000_000, now, &both, 6),
            ],
            [1, 6, 1, 6],
            "{name}: the same attempt twice in one call"
        );
        let ttl: i64 = redis::cmd("PTTL").arg(&a).query(&mut conn).unwrap();
        assert!(ttl > 0, "{name}: a record expires ({ttl})");
    }
}

/// A check sent again names every call it went out in: charged once if any of their records
/// says so, whichever comes first, and a record that is gone (a call received after its
/// deadline left none) hides nothing.
#[test]
fn a_check_naming_several_earlier_calls_is_charged_once_if_any_charged() {
    let server = RedisServer::start();
    let mut conn = server.conn();
    for (name, code) in ALGORITHMS {
        let key = format!("r:{{several-{name}}}:a");
        let record = |call: &str| format!("r:{{several-{name}}}:charged:{call}");
        // 10 per minute; one check per call: policy 1, cost 3, the attempt (and where it went)
        let call = |attempt: &'static str, records: &'static str| {
            vec![
                LATER, records, "60000", "1", code, "1", "10", "60000000", "1", "3", attempt,
            ]
        };
        let remaining = |reply: Value| {
            let reply = items(reply);
            assert_eq!(int(&reply[0]), 1, "{name}: admitted");
            let now = reply.last().map(int).unwrap_or_default();
            left(code, 10, 60_000_000, now, &reply, 2)
        };
        let (first, late) = (record("first"), record("late"));
        let sent = call("00000000000000a7", "1");
        assert_eq!(remaining(run(&mut conn, "rate", &[&first, &key], &sent)), 7);
        // the late call left no record: named first, the first call second
        let again = call("00000000000000a7@2:1@3:1", "3");
        let keys = [&record("third")[..], &late, &first, &key];
        assert_eq!(
            remaining(run(&mut conn, "rate", &keys, &again)),
            7,
            "{name}"
        );
        let reversed = call("00000000000000a7@3:1@2:1", "3");
        let keys = [&record("fourth")[..], &late, &first, &key];
        assert_eq!(
            remaining(run(&mut conn, "rate", &keys, &reversed)),
            7,
            "{name}"
        );
        // none of the named records charged it: a new charge
        let other = call("00000000000000b7@2:1@3:1", "3");
        let keys = [&record("fifth")[..], &late, &record("gone"), &key];
        assert_eq!(
            remaining(run(&mut conn, "rate", &keys, &other)),
            4,
            "{name}"
        );
    }
}

#[test]
fn a_check_that_spent_the_last_of_a_quota_is_admitted_again() {
    let server = RedisServer::start();
    let mut conn = server.conn();
    for (name, code) in ALGORITHMS {
        let key = format!("r:{{full-{name}}}:a");
        // 2 per minute; the second attempt takes the last unit
        let once = [
            LATER,
            "1",
            code,
            "1",
            "2",
            "60000000",
            "1",
            "1",
            "00000000000000b1",
        ];
        let last = [
            LATER,
            "1",
            code,
            "1",
            "2",
            "60000000",
            "1",
            "1",
            "00000000000000b2",
        ];
        rate(&mut conn, &format!("rec:{name}:once"), &[&key], &once);
        let (first, at) = rate_at(&mut conn, &format!("rec:{name}:last"), &[&key], &last);
        let state = rate_state(&mut conn, name, &key);
        let (second, again) = rate_at(&mut conn, &format!("rec:{name}:last"), &[&key], &last);
        assert_eq!(
            [int(&first[0]), left(code, 2, 60_000_000, at, &first, 2)],
            [1, 0],
            "{name}: admitted, none left"
        );
        assert_eq!(
            [
                int(&second[0]),
                int(&second[1]),
                left(code, 2, 60_000_000, again, &second, 2)
            ],
            [1, 0, 0],
            "{name}: the same attempt is admitted again"
        );
        assert_eq!(
            rate_state(&mut conn, name, &key),
            state,
            "{name}: charged once"
        );
        let other = [
            LATER,
            "1",
            code,
            "1",
            "2",
            "60000000",
            "1",
            "1",
            "00000000000000b3",
        ];
        let denied = items(rate(
            &mut conn,
            &format!("rec:{name}:other"),
            &[&key],
            &other,
        ));
        assert_eq!(int(&denied[0]), 0, "{name}: another attempt is denied");
    }
}

#[test]
fn a_batch_decides_its_checks_in_turn_and_a_failing_one_alone() {
    let server = RedisServer::start();
    let mut conn = server.conn();
    for (name, code) in ALGORITHMS {
        let key = format!("r:{{batch-{name}}}:a");
        let wrong = format!("r:{{batch-{name}}}:wrong");
        let _: () = redis::cmd("HSET")
            .arg(&wrong)
            .arg("f")
            .arg("v")
            .query(&mut conn)
            .unwrap();
        // 2 per minute: three checks of one caller, one on a key of the wrong type between them
        let mut args = vec![LATER, "1", code, "1", "2", "60000000"];
        for attempt in [
            "00000000000000c1",
            "00000000000000c9",
            "00000000000000c2",
            "00000000000000c3",
        ] {
            args.extend(["1", "1", attempt]);
        }
        let keys = [&key[..], &wrong, &key, &key];
        let (reply, at) = rate_at(&mut conn, &format!("rec:{name}:batch"), &keys, &args);
        let units = |i| left(code, 2, 60_000_000, at, &reply, i);
        assert_eq!(reply.len(), 3 * 4 + 2, "{name}: {reply:?}");
        assert_eq!([int(&reply[0]), units(2)], [1, 1], "{name}: first");
        assert_eq!(int(&reply[4]), -1, "{name}: the failing check");
        assert!(
            matches!(&reply[5], Value::BulkString(m) if String::from_utf8_lossy(m).contains("WRONGTYPE")),
            "{name}: its error: {:?}",
            reply[5]
        );
        assert_eq!([int(&reply[6]), units(8)], [1, 0], "{name}: second");
        assert_eq!(int(&reply[10]), 0, "{name}: third, denied");
    }
}

/// Every write script received after its deadline answers `-1` and changes nothing; so does a
/// rate check, alone in its batch's answer (`-2, 0`), while the checks beside it are decided.
#[test]
fn a_script_received_after_its_deadline_does_nothing() {
    let server = RedisServer::start();
    let mut conn = server.conn();
    let late = |conn: &mut Connection, name: &str, keys: &[&str], args: &[&str]| {
        assert_eq!(run(conn, name, keys, args), Value::Int(-1), "{name}");
    };
    late(
        &mut conn,
        "claim",
        &["c:{1}", "c:{1}:pending"],
        &["h", "0", "0", EARLIER],
    );
    late(
        &mut conn,
        "lock_acquire",
        &["l:{1}", "l:{1}:fence"],
        &["t", "5000", "60000", EARLIER],
    );
    let marked = ["i:{1}", "i:{1}:pending"];
    late(
        &mut conn,
        "idem_begin",
        &marked,
        &["fp", "t", "30000", EARLIER],
    );
    let nothing: Vec<String> = redis::cmd("KEYS").arg("*").query(&mut conn).unwrap();
    assert!(nothing.is_empty(), "{nothing:?}");

    // on keys that exist, the late extensions and completion change nothing either
    let _: () = redis::cmd("SET")
        .arg("l:{1}")
        .arg("t")
        .query(&mut conn)
        .unwrap();
    run(
        &mut conn,
        "idem_begin",
        &marked,
        &["fp", "t", "30000", LATER],
    );
    let record = hash(&mut conn, "i:{1}");
    late(
        &mut conn,
        "compare_and_pexpire",
        &["l:{1}"],
        &["t", "5000", EARLIER],
    );
    late(&mut conn, "idem_extend", &["i:{1}"], &["t", "1", EARLIER]);
    let _: () = redis::cmd("SET")
        .arg("r:{1}:d:gcra")
        .arg("5:0:a1")
        .query(&mut conn)
        .unwrap();
    late(
        &mut conn,
        "reset",
        &["r:{1}:d:gcra", "r:{1}:d:gcra:block"],
        &[EARLIER],
    );
    assert_eq!(get(&mut conn, "r:{1}:d:gcra").as_deref(), Some("5:0:a1"));
    let reset = ["r:{1}:d:gcra", "r:{1}:d:gcra:block"];
    assert_eq!(run(&mut conn, "reset", &reset, &[LATER]), Value::Int(1));
    assert_eq!(get(&mut conn, "r:{1}:d:gcra"), None, "on time, it deletes");
    late(
        &mut conn,
        "idem_complete",
        &marked,
        &["t", "response", "60000", "0", EARLIER],
    );
    let ttl: i64 = redis::cmd("PTTL").arg("l:{1}").query(&mut conn).unwrap();
    assert_eq!(ttl, -1, "the lock's expiry was not touched");
    assert_eq!(hash(&mut conn, "i:{1}"), record);

    for (name, code) in ALGORITHMS {
        let key = format!("r:{{late-{name}}}:a");
        // 2 per minute: a late call of two checks decides neither, then an on-time one both
        let call = |deadline| {
            let mut args = vec![deadline, "1", code, "1", "2", "60000000"];
            args.extend(["1", "1", "00000000000000d1", "1", "1", "00000000000000d2"]);
            args
        };
        let late = items(rate(
            &mut conn,
            &format!("rec:{name}:late"),
            &[&key, &key],
            &call(EARLIER),
        ));
        assert_eq!(
            late,
            vec![Value::Int(-2), Value::Int(0), Value::Int(-2), Value::Int(0)],
            "{name}"
        );
        assert!(
            rate_state(&mut conn, name, &key).is_empty(),
            "{name}: the late call wrote"
        );
        let (reply, at) = rate_at(
            &mut conn,
            &format!("rec:{name}:on-time"),
            &[&key, &key],
            &call(LATER),
        );
        let units = |i| left(code, 2, 60_000_000, at, &reply, i);
        assert_eq!(reply.len(), 4 + 4, "{name}: {reply:?}");
        assert_eq!([int(&reply[0]), units(2)], [1, 1], "{name}: first");
        assert_eq!(
            [int(&reply[4]), units(6)],
            [1, 0],
            "{name}: second, the last unit"
        );
    }
}

/// A line-up run twice keeps the waiter's first place; leaving run twice leaves once; a line-up
/// received late lines nobody up.
#[test]
fn a_line_up_run_twice_keeps_its_place() {
    let server = RedisServer::start();
    let mut conn = server.conn();
    let keys = ["w:{1}:line", "w:{1}:line:lapse"];
    let waiter = |n: u64| format!("{n:016x}");
    let (a, b) = (waiter(0xb), waiter(0xa));
    assert_eq!(
        twice(&mut conn, "line", &keys, &[&a, "60000", LATER]),
        Value::Int(0)
    );
    assert_eq!(
        twice(&mut conn, "line", &keys, &[&b, "60000", LATER]),
        Value::Int(1)
    );
    assert_eq!(
        twice(&mut conn, "line", &keys, &[&a, "60000", LATER]),
        Value::Int(0)
    );
    assert_eq!(
        run(&mut conn, "line", &keys, &[&waiter(0xc), "60000", EARLIER]),
        Value::Int(-1),
        "late"
    );
    assert_eq!(
        twice(&mut conn, "line", &keys, &[&a, "0", "0"]),
        Value::Int(0)
    );
    assert_eq!(
        twice(&mut conn, "line", &keys, &[&b, "60000", LATER]),
        Value::Int(0)
    );
    let waiting: i64 = redis::cmd("ZCARD").arg(keys[0]).query(&mut conn).unwrap();
    assert_eq!(waiting, 1, "b alone: a left, c came too late");
}
