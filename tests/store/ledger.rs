//! The attempt ledger on every backend, held against the reference model: the shipped corpus,
//! then random cases (`tollgate::conformance::property`) on the memory store, Redis, Redis
//! Cluster and PostgreSQL.
#![allow(clippy::unwrap_used, clippy::expect_used)]
use crate::common;

use std::time::Duration;

use common::RedisServer;
use common::cluster::RedisCluster;
use tollgate::conformance::property::{self, Case};
use tollgate::store::{MemoryStore, PgStore, RateStore, RedisStore};

/// Random cases per backend, run at once, each of this many operations.
const CASES: u64 = 24;
const LEN: usize = 24;

/// The stores' timeout: short, so that a wait past a deadline is short too.
const TIMEOUT: Duration = Duration::from_millis(300);

/// Runs every case of the corpus, at once; panics naming each that fails.
async fn corpus(store: &impl RateStore) {
    let cases = property::corpus();
    let runs = cases.iter().map(|(_, case)| property::run(store, case));
    let results = futures_util::future::join_all(runs).await;
    let failed: Vec<String> = cases
        .iter()
        .zip(results)
        .filter_map(|((name, case), r)| r.err().map(|m| format!("{name}: {m}\n  {case:?}")))
        .collect();
    assert!(
        failed.is_empty(),
        "corpus cases failed:\n{}",
        failed.join("\n")
    );
}

/// Random cases from a seed range that moves with the day, so that every run tries new ones;
/// a failure names its seed and the shrunk case, to be added to the corpus.
async fn random(store: &impl RateStore) {
    let day = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs() / 86_400);
    let from = std::env::var("TOLLGATE_PROPERTY_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(day * 1_000);
    if let Some((
        seed,
        Case {
            policies,
            counting_calls,
            ops,
        },
        mismatch,
    )) = property::search(store, from..from + CASES, LEN).await
    {
        panic!(
            "seed {seed} (TOLLGATE_PROPERTY_SEED={seed}): {mismatch}\n\
             shrunk case:\n  policies: {policies:?}\n  counting calls: {counting_calls:?}\n  \
             ops: {ops:#?}"
        );
    }
}

fn redis(server: &RedisServer) -> RedisStore {
    RedisStore::builder(server.url())
        .timeout(TIMEOUT)
        .build()
        .expect("redis store")
}

async fn cluster() -> RedisStore {
    RedisStore::cluster_builder(RedisCluster::shared().urls())
        .timeout(TIMEOUT)
        .connect()
        .await
        .expect("cluster store")
}

async fn postgres() -> PgStore {
    let server = tokio::task::spawn_blocking(common::postgres::shared)
        .await
        .expect("start the shared postgres");
    server
        .builder()
        .timeout(TIMEOUT)
        .connect()
        .await
        .expect("migrated store")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_corpus() {
    corpus(&MemoryStore::new()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_random() {
    random(&MemoryStore::new()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_corpus() {
    let server = RedisServer::start();
    corpus(&redis(&server)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_random() {
    let server = RedisServer::start();
    random(&redis(&server)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_corpus() {
    corpus(&cluster().await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_random() {
    random(&cluster().await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_corpus() {
    corpus(&postgres().await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_random() {
    random(&postgres().await).await;
}
