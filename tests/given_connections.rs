//! Stores on connections the application made itself: a redis-rs `ConnectionManager` and a
//! Cluster connection, on real servers. They serve every layer, and the store timeout still
//! bounds every call.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::time::{Duration, Instant};

use common::RedisServer;
use common::cluster::RedisCluster;
use tollgate::claim::Claims;
use tollgate::store::{RedisStore, Store, StoreErrorKind};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_given_connection_manager_serves_and_is_bounded_by_the_timeout() {
    let server = RedisServer::start();
    let client = redis::Client::open(server.url()).unwrap();
    let manager = redis::aio::ConnectionManager::new(client).await.unwrap();
    let store = RedisStore::from_connection_manager(manager, Duration::from_millis(200));
    store.ping().await.unwrap();
    let claims = Claims::new(store.clone());
    assert!(claims.claim_once("coupon", None).await.unwrap().won());
    assert!(!claims.claim_once("coupon", None).await.unwrap().won());
    assert!(format!("{store:?}").contains("given"));

    server.pause();
    let start = Instant::now();
    let error = store.ping().await.unwrap_err();
    let waited = start.elapsed();
    server.resume();
    assert_eq!(error.kind(), StoreErrorKind::Timeout);
    assert!(waited < Duration::from_secs(2), "a call waited {waited:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_given_cluster_connection_serves() {
    let cluster = RedisCluster::shared();
    let client = redis::cluster::ClusterClient::new(cluster.urls()).unwrap();
    let conn = client.get_async_connection().await.unwrap();
    let store = RedisStore::from_cluster_connection(conn, Duration::from_millis(500));
    let claims = Claims::new(store);
    for i in 0..10 {
        let name = format!("given-{i}-{}", rand::random::<u64>());
        assert!(claims.claim_once(&name, None).await.unwrap().won());
        assert!(!claims.claim_once(&name, None).await.unwrap().won());
    }
}
