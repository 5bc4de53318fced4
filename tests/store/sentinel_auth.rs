//! Behind Sentinel, a primary that asks for a password (`requirepass`): the store sends
//! `RedisSentinelBuilder::primary_password` to the primary the sentinels name; without it every
//! call is refused, and no password shows in an error.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;
use std::time::Duration;

use crate::common::free_port;
use crate::common::sentinel::{Watched, query};
use tollgate::key::Key;
use tollgate::rate::{Algorithm, Limit, RateCheck, RatePolicy};
use tollgate::store::{RateStore, RedisStore};

const PASSWORD: &str = "primary-s3cret";
const MASTER: &str = "guarded";

/// A primary with a password and one sentinel that knows it, both on free ports.
struct Guarded {
    _primary: Watched,
    _sentinel: Watched,
    sentinel_port: u16,
    _dir: tempfile::TempDir,
}

async fn guarded() -> Guarded {
    let dir = tempfile::tempdir().unwrap();
    let (primary_port, sentinel_port) = (free_port(), free_port());
    let log = dir.path().join("primary.log");
    let args: Vec<String> = [
        "--port",
        &primary_port.to_string(),
        "--bind",
        "127.0.0.1",
        "--save",
        "",
        "--appendonly",
        "no",
        "--requirepass",
        PASSWORD,
        "--logfile",
        &log.display().to_string(),
    ]
    .map(String::from)
    .to_vec();
    let primary = Watched::spawn(primary_port, &args, &log);
    let conf = dir.path().join("sentinel.conf");
    let sentinel_log = dir.path().join("sentinel.log");
    std::fs::write(
        &conf,
        format!(
            "port {sentinel_port}\nbind 127.0.0.1\ndir {dir}\nlogfile {log}\n\
             sentinel monitor {MASTER} 127.0.0.1 {primary_port} 1\n\
             sentinel auth-pass {MASTER} {PASSWORD}\n",
            dir = dir.path().display(),
            log = sentinel_log.display(),
        ),
    )
    .unwrap();
    let sentinel = Watched::spawn(
        sentinel_port,
        &[conf.display().to_string(), "--sentinel".into()],
        &sentinel_log,
    );
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let named: Result<Option<(String, u16)>, String> = query(
            sentinel_port,
            redis::cmd("SENTINEL")
                .arg("get-master-addr-by-name")
                .arg(MASTER),
        )
        .await;
        if matches!(named, Ok(Some((_, port))) if port == primary_port) {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the sentinel never named the primary: {named:?}\n{}",
            sentinel.log_tail(20)
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    Guarded {
        _primary: primary,
        _sentinel: sentinel,
        sentinel_port,
        _dir: dir,
    }
}

fn policy() -> Arc<RatePolicy> {
    Arc::new(RatePolicy::new("auth:rl", Algorithm::Gcra, vec![Limit::per_minute("m", 10)]).unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_primary_with_a_password_is_reached_with_it_and_refuses_without() {
    let guarded = guarded().await;
    let sentinels = [format!("redis://127.0.0.1:{}/", guarded.sentinel_port)];
    let check = RateCheck::new(Key::new("user", b"alice"), 1);

    let without = RedisStore::sentinel_builder(sentinels.clone(), MASTER)
        .timeout(Duration::from_millis(500))
        .connect()
        .await;
    if let Ok(store) = without {
        let refused = store.check_rate(&policy(), check).await;
        let error = refused.expect_err("a primary with a password refuses a call without it");
        assert!(!format!("{error} {error:?}").contains(PASSWORD));
    }

    let store = RedisStore::sentinel_builder(sentinels, MASTER)
        .primary_password(None, PASSWORD)
        .timeout(Duration::from_millis(500))
        .connect()
        .await
        .expect("the store behind the sentinel");
    assert!(!format!("{store:?}").contains(PASSWORD));
    let admitted = store.check_rate(&policy(), check).await.unwrap();
    assert!(admitted.admitted);
    assert_eq!(admitted.limits[0].remaining, 9);
}
