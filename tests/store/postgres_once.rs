//! `PgStore::once` on a real PostgreSQL: work that runs exactly once per key, its rows and its
//! recorded output committed together — across two stores as two copies of a service.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use crate::common::postgres::{self, PgServer};

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use tollgate::store::{Once, OnceError, OnceTx, PgStore};

const HOUR: Duration = Duration::from_secs(3600);

async fn server() -> &'static PgServer {
    tokio::task::spawn_blocking(postgres::shared).await.unwrap()
}

/// Two stores on one migrated schema, and a table of the application's own in it.
async fn two_copies() -> (PgStore, PgStore, String) {
    let server = server().await;
    let schema = postgres::unique_schema();
    let first = server
        .builder()
        .schema(schema.clone())
        .connect()
        .await
        .unwrap();
    let second = server
        .builder()
        .schema(schema.clone())
        .connect()
        .await
        .unwrap();
    let table = format!("{schema}.transfers");
    let client = server.client().await;
    client
        .batch_execute(&format!(
            "CREATE TABLE {table} (id bigserial PRIMARY KEY, note text)"
        ))
        .await
        .unwrap();
    (first, second, table)
}

async fn rows(table: &str) -> i64 {
    let client = server().await.client().await;
    let row = client
        .query_one(&format!("SELECT count(*) FROM {table}"), &[])
        .await
        .unwrap();
    row.get(0)
}

/// The work of a transfer: one row in the application's table, its id as the output.
async fn transfer(
    tx: &OnceTx,
    table: &str,
    pause: Duration,
) -> Result<Bytes, tokio_postgres::Error> {
    let sql = format!("INSERT INTO {table} (note) VALUES ('transfer') RETURNING id");
    let id: i64 = tx.query_one(&sql, &[]).await?.get(0);
    tokio::time::sleep(pause).await;
    Ok(Bytes::from(id.to_string()))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fifty_parallel_runs_of_one_key_over_two_copies_execute_once() {
    let (first, second, table) = two_copies().await;
    let table = Arc::new(table);
    let runs = (0..50).map(|i| {
        let store = if i % 2 == 0 {
            first.clone()
        } else {
            second.clone()
        };
        let table = Arc::clone(&table);
        tokio::spawn(async move {
            let work = async |tx: &OnceTx| transfer(tx, &table, Duration::from_millis(200)).await;
            store.once("transfer-1", "fp", HOUR, work).await
        })
    });
    let answers = futures_util::future::join_all(runs).await;
    let (mut ran, mut outputs, mut in_flight) = (0, Vec::new(), 0);
    for answer in answers {
        match answer.unwrap() {
            Ok(Once::Ran(output)) => {
                ran += 1;
                outputs.push(output);
            }
            Ok(Once::Replayed(output)) => outputs.push(output),
            Err(OnceError::InFlight) => in_flight += 1,
            Err(other) => panic!("unexpected {other}"),
        }
    }
    assert_eq!(ran, 1, "exactly one execution");
    assert_eq!(outputs.len() + in_flight, 50);
    assert!(
        outputs.windows(2).all(|w| w[0] == w[1]),
        "one output: {outputs:?}"
    );
    assert_eq!(rows(&table).await, 1, "exactly one row");
    // a retry after the commit replays it, on either copy
    let replay = second.once("transfer-1", "fp", HOUR, async |tx: &OnceTx| {
        transfer(tx, &table, Duration::ZERO).await
    });
    assert_eq!(replay.await.unwrap(), Once::Replayed(outputs[0].clone()));
    assert_eq!(rows(&table).await, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failed_work_leaves_nothing_and_frees_the_key() {
    let (store, _, table) = two_copies().await;
    let failing = store.once("transfer-2", "fp", HOUR, async |tx: &OnceTx| {
        transfer(tx, &table, Duration::ZERO).await?;
        Err::<Bytes, _>(tx.query_one("SELECT 1/0", &[]).await.unwrap_err())
    });
    assert!(matches!(failing.await, Err(OnceError::Work(_))));
    assert_eq!(rows(&table).await, 0, "the row went with the failed run");
    let retry = store.once("transfer-2", "fp", HOUR, async |tx: &OnceTx| {
        transfer(tx, &table, Duration::ZERO).await
    });
    assert!(matches!(retry.await, Ok(Once::Ran(_))));
    assert_eq!(rows(&table).await, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancelled_run_leaves_nothing_and_frees_the_key() {
    let (store, other, table) = two_copies().await;
    let table = Arc::new(table);
    let began = Arc::new(tokio::sync::Notify::new());
    let running = {
        let (store, table, began) = (store.clone(), Arc::clone(&table), Arc::clone(&began));
        tokio::spawn(async move {
            let work = async |tx: &OnceTx| {
                let id = transfer(tx, &table, Duration::ZERO).await;
                began.notify_one();
                tokio::time::sleep(Duration::from_secs(30)).await;
                id
            };
            store.once("transfer-3", "fp", HOUR, work).await
        })
    };
    tokio::time::timeout(Duration::from_secs(10), began.notified())
        .await
        .expect("setup: the work did not insert its row within 10 s");
    let busy = other.once("transfer-3", "fp", HOUR, async |tx: &OnceTx| {
        transfer(tx, &table, Duration::ZERO).await
    });
    assert!(
        matches!(busy.await, Err(OnceError::InFlight)),
        "the running one holds the key"
    );
    running.abort();
    let _ = running.await;
    // its transaction rolls back as it is dropped: the key is free within moments
    let mut answer = Err(OnceError::InFlight);
    for _ in 0..50 {
        answer = other
            .once("transfer-3", "fp", HOUR, async |tx: &OnceTx| {
                transfer(tx, &table, Duration::ZERO).await
            })
            .await;
        if !matches!(answer, Err(OnceError::InFlight)) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(matches!(answer, Ok(Once::Ran(_))), "{answer:?}");
    assert_eq!(
        rows(&table).await,
        1,
        "only the run that committed left a row"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_reused_with_another_request_is_a_mismatch() {
    let (store, _, table) = two_copies().await;
    let run = |fingerprint: &'static str| {
        let (store, table) = (store.clone(), table.clone());
        async move {
            store
                .once("transfer-4", fingerprint, HOUR, async |tx: &OnceTx| {
                    transfer(tx, &table, Duration::ZERO).await
                })
                .await
        }
    };
    assert!(matches!(run("a").await, Ok(Once::Ran(_))));
    assert!(matches!(run("b").await, Err(OnceError::Mismatch)));
    assert_eq!(rows(&table).await, 1);
}

/// A store reaching the server through a proxy the test controls, on the schema of `direct`.
async fn through(proxy: &crate::common::proxy::Proxy, direct: &PgStore) -> PgStore {
    PgStore::builder(format!("postgres://postgres@{}/postgres", proxy.addr()))
        .schema(direct.schema().to_owned())
        .timeout(Duration::from_secs(2))
        .pool_size(2)
        .purge_interval(None)
        .build()
        .unwrap()
}

/// Cuts every connection through `proxy` after `after`, then lets new ones through.
fn cut_soon(proxy: &Arc<crate::common::proxy::Proxy>, after: Duration) {
    let proxy = Arc::clone(proxy);
    tokio::spawn(async move {
        tokio::time::sleep(after).await;
        proxy.cut();
        tokio::time::sleep(Duration::from_millis(100)).await;
        proxy.heal();
    });
}

/// The connection breaks during `COMMIT`, which the server carries out (its answer is lost):
/// the run is found committed and answers its output — it is not run again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_commit_whose_answer_is_lost_is_found_committed() {
    let (direct, _, table) = two_copies().await;
    let schema = direct.schema().to_owned();
    postgres::slow_commits(&schema, &table).await;
    let proxy = Arc::new(crate::common::proxy::Proxy::start(server().await.addr()).await);
    let store = through(&proxy, &direct).await;
    let answer = store
        .once("transfer-5", "fp", HOUR, async |tx: &OnceTx| {
            let output = transfer(tx, &table, Duration::ZERO).await;
            // the connection breaks while the server commits
            cut_soon(&proxy, Duration::from_millis(400));
            output
        })
        .await;
    let Ok(Once::Ran(output)) = answer else {
        panic!("a committed run answers its output: {answer:?}");
    };
    assert_eq!(rows(&table).await, 1);
    let replay = direct.once("transfer-5", "fp", HOUR, async |tx: &OnceTx| {
        transfer(tx, &table, Duration::ZERO).await
    });
    assert_eq!(replay.await.unwrap(), Once::Replayed(output));
}

/// The connection breaks with `COMMIT` unsent (held by a partition, then dropped): nothing of
/// the run stands, the answer says the store failed, and a retry runs it once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_commit_that_never_arrived_leaves_nothing() {
    let (direct, _, table) = two_copies().await;
    let proxy = Arc::new(crate::common::proxy::Proxy::start(server().await.addr()).await);
    let store = through(&proxy, &direct).await;
    let answer = store
        .once("transfer-6", "fp", HOUR, async |tx: &OnceTx| {
            let output = transfer(tx, &table, Duration::ZERO).await;
            // COMMIT goes into the dark, and the connection breaks
            proxy.silence();
            cut_soon(&proxy, Duration::from_millis(300));
            output
        })
        .await;
    proxy.unsilence();
    assert!(matches!(answer, Err(OnceError::Store(_))), "{answer:?}");
    assert_eq!(rows(&table).await, 0, "nothing of the run stands");
    // the server ends the broken session's transaction once it notices the connection gone:
    // until then its lock keeps the key in flight
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    let retry = loop {
        let retry = direct
            .once("transfer-6", "fp", HOUR, async |tx: &OnceTx| {
                transfer(tx, &table, Duration::ZERO).await
            })
            .await;
        match retry {
            Err(OnceError::InFlight) if std::time::Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            retry => break retry,
        }
    };
    assert!(matches!(retry, Ok(Once::Ran(_))), "{retry:?}");
    assert_eq!(rows(&table).await, 1);
}
