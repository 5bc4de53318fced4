//! Rate checks as a function of a Lua library (`FCALL`) on a real redis-server: the library is
//! loaded once and kept by the server, loaded again by the check that finds it gone (charged
//! once), on every primary of a Cluster; a user the server does not let load or call functions
//! gets the script (`EVALSHA`), with the same decisions.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use crate::common;

use std::sync::Arc;
use std::time::Duration;

use common::RedisServer;
use common::cluster::RedisCluster;
use tollgate::key::Key;
use tollgate::rate::{Algorithm, Limit, RateCheck, RatePolicy};
use tollgate::store::{RateStore, RedisStore};

const ALGORITHMS: [Algorithm; 3] = [
    Algorithm::SlidingLog,
    Algorithm::SlidingCounter,
    Algorithm::Gcra,
];

/// A policy of its own under `algorithm`: 3 a day.
fn three_a_day(algorithm: Algorithm) -> Arc<RatePolicy> {
    let ns = format!("fn{}:rl", rand::random::<u32>());
    let limit = Limit::new("d", 3, Duration::from_secs(86_400));
    Arc::new(RatePolicy::new(ns, algorithm, vec![limit]).unwrap())
}

/// Whether each of `checks` of cost 1 by `caller` was admitted, in turn.
async fn admitted(
    store: &RedisStore,
    policy: &Arc<RatePolicy>,
    caller: &Key,
    checks: usize,
) -> Vec<bool> {
    let mut admitted = Vec::new();
    for _ in 0..checks {
        let outcome = store.check_rate(policy, RateCheck::new(*caller, 1));
        admitted.push(outcome.await.unwrap().admitted);
    }
    admitted
}

/// The names of the libraries of rate checks on the server behind `conn`.
fn libraries(conn: &mut redis::Connection) -> Vec<String> {
    let list: redis::Value = redis::cmd("FUNCTION").arg("LIST").query(conn).unwrap();
    let text = format!("{list:?}");
    let mut names: Vec<String> = text
        .split('"')
        .filter(|s| s.starts_with("tollgate_rate_"))
        .map(str::to_owned)
        .collect();
    names.sort();
    names.dedup();
    names
}

#[tokio::test]
async fn checks_run_as_the_function_of_one_library_the_server_keeps() {
    let server = RedisServer::start();
    let store = server.store();
    for algorithm in ALGORITHMS {
        let policy = three_a_day(algorithm);
        let caller = Key::new("t", b"kept");
        let decided = admitted(&store, &policy, &caller, 4).await;
        assert_eq!(decided, [true, true, true, false], "{algorithm}");
    }
    let names = libraries(&mut server.conn());
    assert_eq!(names.len(), 1, "one library: {names:?}");
    let hash = names[0].strip_prefix("tollgate_rate_").unwrap();
    assert!(
        hash.len() == 16 && hash.bytes().all(|b| b.is_ascii_hexdigit()),
        "named by the script's hash: {hash}"
    );
    // the first call found no function and loaded it; every call since was a function's
    assert_eq!(server.calls("function|load"), 1);
    assert_eq!(server.calls("fcall"), 12 + 1);
    assert_eq!(server.calls("evalsha") + server.calls("eval"), 0);
}

/// The library reads a call's policies by their text and keeps what it read from call to call
/// (at most 64, then it reads afresh): a policy is never taken for another. Each of 70 policies,
/// twice over (the second time after the library started afresh), admits exactly its own quota,
/// with one limit or two.
#[tokio::test]
async fn policies_the_library_keeps_are_never_taken_for_others() {
    let server = RedisServer::start();
    let store = server.store();
    for algorithm in ALGORITHMS {
        for round in 0..2 {
            for quota in 1..=70u64 {
                let mut limits = vec![Limit::new("m", quota, Duration::from_secs(60))];
                if quota % 2 == 0 {
                    limits.push(Limit::new("h", 1000, Duration::from_secs(3600)));
                }
                let policy = Arc::new(RatePolicy::new("read:rl", algorithm, limits).unwrap());
                let caller = Key::new("t", format!("{algorithm}:{round}:{quota}").as_bytes());
                let all = store.check_rate(&policy, RateCheck::new(caller, quota));
                let all = all.await.unwrap();
                let more = store.check_rate(&policy, RateCheck::new(caller, 1));
                let more = more.await.unwrap();
                let what = format!("{algorithm}, round {round}, a quota of {quota}");
                assert!(all.admitted, "{what}: its quota at once");
                assert_eq!(all.limits[0].remaining, 0, "{what}");
                assert!(!more.admitted, "{what}: one more");
            }
        }
    }
    assert_eq!(server.calls("evalsha") + server.calls("eval"), 0);
}

#[tokio::test]
async fn a_server_that_lost_the_library_gets_it_again_and_the_check_is_charged_once() {
    let server = RedisServer::start();
    let store = server.store();
    for algorithm in ALGORITHMS {
        let policy = three_a_day(algorithm);
        let caller = Key::new("t", b"flushed");
        assert_eq!(admitted(&store, &policy, &caller, 2).await, [true, true]);
        // as a restart without persistence would leave it
        let _: () = redis::cmd("FUNCTION")
            .arg("FLUSH")
            .query(&mut server.conn())
            .unwrap();
        assert!(libraries(&mut server.conn()).is_empty());
        // the check that found it gone is decided once: one unit left, then none
        assert_eq!(
            admitted(&store, &policy, &caller, 2).await,
            [true, false],
            "{algorithm}"
        );
        assert_eq!(libraries(&mut server.conn()).len(), 1, "{algorithm}");
    }
}

/// A store on `server` as `user`, whom the server lets do what `rules` (ACL) say.
fn store_as(server: &RedisServer, user: &str, rules: &[&str]) -> RedisStore {
    let mut acl = redis::cmd("ACL");
    acl.arg("SETUSER")
        .arg(user)
        .arg("on")
        .arg(">secret")
        .arg("~*");
    for rule in rules {
        acl.arg(*rule);
    }
    let _: () = acl.query(&mut server.conn()).unwrap();
    RedisStore::builder(format!(
        "redis://{user}:secret@127.0.0.1:{}/",
        server.port()
    ))
    .timeout(Duration::from_millis(500))
    .build()
    .unwrap()
}

/// A user refused `FCALL` and `FUNCTION` (`fcalls` 0: refused before it runs), or only
/// `FUNCTION LOAD` (`fcalls` 1: the first call found no function, whose load was refused), gets
/// the script from then on, with the same decisions.
#[tokio::test]
async fn a_user_that_may_not_call_or_load_functions_gets_the_script() {
    let cases = [
        ("scripts", &["+@all", "-fcall", "-function"][..], 0),
        ("no-loading", &["+@all", "-function"][..], 1),
    ];
    for (user, rules, fcalls) in cases {
        let server = RedisServer::start();
        let store = store_as(&server, user, rules);
        for algorithm in ALGORITHMS {
            let policy = three_a_day(algorithm);
            let decided = admitted(&store, &policy, &Key::new("t", b"refused"), 4).await;
            assert_eq!(decided, [true, true, true, false], "{user}: {algorithm}");
        }
        assert!(libraries(&mut server.conn()).is_empty(), "{user}");
        assert_eq!(server.calls("fcall"), fcalls, "{user}");
        assert_eq!(server.calls("evalsha"), 12, "{user}");
    }
}

#[tokio::test]
async fn every_primary_of_a_cluster_gets_the_library_again_once_it_lost_it() {
    let cluster = RedisCluster::shared();
    let store = cluster.store().await;
    let nodes = || {
        cluster.urls().into_iter().map(|url| {
            redis::Client::open(url)
                .and_then(|c| c.get_connection())
                .unwrap()
        })
    };
    let policy = three_a_day(Algorithm::Gcra);
    // callers enough to reach every primary
    let callers: Vec<Key> = (0..32u8).map(|i| Key::new("t", &[b'c', i])).collect();
    for caller in &callers {
        assert_eq!(admitted(&store, &policy, caller, 1).await, [true]);
    }
    for mut node in nodes() {
        assert!(!libraries(&mut node).is_empty(), "every primary has it");
        let _: () = redis::cmd("FUNCTION")
            .arg("FLUSH")
            .query(&mut node)
            .unwrap();
    }
    for caller in &callers {
        assert_eq!(
            admitted(&store, &policy, caller, 3).await,
            [true, true, false],
            "charged once"
        );
    }
    for mut node in nodes() {
        assert!(!libraries(&mut node).is_empty(), "loaded again");
    }
}
