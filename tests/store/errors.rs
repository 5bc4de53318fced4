//! Errors that name their cause: what a user sees when a store is misconfigured or out of reach.
#![allow(clippy::unwrap_used, clippy::expect_used)]
use crate::common;

use std::time::Duration;

use common::postgres::PgServer;
use tollgate::store::{PgStore, StoreError, StoreErrorKind};

/// A server where role `pwuser` (password `right`) must give its password over TCP.
async fn server_with_a_password() -> PgServer {
    let server = PgServer::start();
    let client = server.client().await;
    client
        .batch_execute(
            "CREATE ROLE pwuser LOGIN PASSWORD 'right'; \
             GRANT CREATE ON DATABASE postgres TO pwuser",
        )
        .await
        .unwrap();
    let hba: String = client.query_one("SHOW hba_file", &[]).await.unwrap().get(0);
    let rules = "host all pwuser 127.0.0.1/32 scram-sha-256\n\
                 local all all trust\n\
                 host all all 127.0.0.1/32 trust\n\
                 host all all ::1/128 trust";
    let write = format!(
        "COPY (SELECT unnest(string_to_array('{rules}', E'\\n'))) TO '{}'",
        hba.replace('\'', "''")
    );
    client.batch_execute(&write).await.unwrap();
    client
        .batch_execute("SELECT pg_reload_conf()")
        .await
        .unwrap();
    server
}

async fn connect_error(url: String) -> StoreError {
    let store = PgStore::builder(url)
        .timeout(Duration::from_secs(2))
        .connect()
        .await;
    store.expect_err("the store must not connect")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgresql_says_why_it_turned_the_connection_away() {
    let server = server_with_a_password().await;
    let port = server.port();
    let wrong = connect_error(format!("postgres://pwuser:wrong@127.0.0.1:{port}/postgres")).await;
    assert_eq!(wrong.kind(), StoreErrorKind::Config, "{wrong}");
    let said = wrong.to_string();
    assert!(
        said.contains("password authentication failed for user \"pwuser\""),
        "the server's own words: {said}"
    );
    assert!(
        !said.contains("wrong"),
        "the password is not repeated: {said}"
    );
    let missing = connect_error(format!("postgres://postgres@127.0.0.1:{port}/nosuchdb")).await;
    assert_eq!(missing.kind(), StoreErrorKind::Config, "{missing}");
    assert!(
        missing
            .to_string()
            .contains("database \"nosuchdb\" does not exist"),
        "{missing}"
    );
    // the right password still connects
    let url = format!("postgres://pwuser:right@127.0.0.1:{port}/postgres");
    let right = PgStore::builder(url)
        .schema("pwuser_schema")
        .connect()
        .await;
    if let Err(e) = right {
        panic!("the right password connects: {e}");
    }
}

/// The first error of a store at `url`, as a rate check meets it.
async fn first_redis_error(url: &str) -> StoreError {
    use std::sync::Arc;
    use tollgate::key::Key;
    use tollgate::rate::{Algorithm, Limit, RateCheck, RatePolicy};
    use tollgate::store::{RateStore, RedisStore};
    let store = RedisStore::builder(url)
        .timeout(Duration::from_millis(250))
        .build()
        .unwrap();
    let policy = RatePolicy::new("t:rl", Algorithm::Gcra, vec![Limit::per_minute("m", 5)]);
    let check = RateCheck::new(Key::new("t", b"caller"), 1);
    let outcome = store.check_rate(&Arc::new(policy.unwrap()), check).await;
    outcome.expect_err("the store must not answer")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_says_why_it_cannot_be_reached() {
    let closed = common::free_port();
    let refused = first_redis_error(&format!("redis://127.0.0.1:{closed}/")).await;
    assert_eq!(refused.kind(), StoreErrorKind::Unavailable, "{refused}");
    assert!(
        refused.to_string().contains("Connection refused"),
        "{refused}"
    );
    let unresolvable = first_redis_error("redis://no-such-host.invalid:6379/").await;
    assert_eq!(
        unresolvable.kind(),
        StoreErrorKind::Unavailable,
        "{unresolvable}"
    );
    assert!(
        unresolvable.to_string().contains("lookup address"),
        "{unresolvable}"
    );
    let server = common::RedisServer::start();
    let db = first_redis_error(&format!("redis://{}/99", server.addr())).await;
    assert_eq!(db.kind(), StoreErrorKind::Config, "{db}");
    assert!(db.to_string().contains("DB index is out of range"), "{db}");
}

/// Outside a Tokio runtime a store is refused with a message that says so, not a panic; inside
/// one (entered, not running a task) it opens.
#[test]
fn a_store_built_outside_a_runtime_is_refused_with_a_reason() {
    let outside = std::panic::catch_unwind(|| {
        tollgate::store::RedisStore::open("redis://127.0.0.1:1/").map(drop)
    });
    match outside {
        Ok(Err(e)) => assert!(e.to_string().contains("Tokio runtime"), "{e}"),
        Ok(Ok(())) => panic!("opened without a runtime"),
        Err(_) => panic!("RedisStore::open panicked outside a runtime"),
    }
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let _entered = runtime.enter();
    assert!(tollgate::store::RedisStore::open("redis://127.0.0.1:1/").is_ok());
}

/// A primary demoted to a replica refuses writes with `READONLY`: the store is elsewhere now, so
/// the error is `Unavailable` (what moves a Sentinel-backed store to the new primary), not a
/// protocol error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_demoted_primary_is_unavailable_not_a_protocol_error() {
    use tollgate::key::Key;
    use tollgate::rate::{Algorithm, Limit, RatePolicy};
    use tollgate::store::{RateStore, Store};

    let server = common::RedisServer::start();
    let store = server.store();
    store.ping().await.unwrap();
    let _: () = redis::cmd("REPLICAOF")
        .arg("127.0.0.1")
        .arg(common::free_port())
        .query(&mut server.conn())
        .unwrap();
    let policy = RatePolicy::new(
        "t:rl",
        Algorithm::SlidingLog,
        vec![Limit::per_second("s", 1)],
    );
    let error = store
        .reset_rate(&std::sync::Arc::new(policy.unwrap()), Key::new("s", b"x"))
        .await
        .unwrap_err();
    assert_eq!(error.kind(), StoreErrorKind::Unavailable, "{error}");
}
