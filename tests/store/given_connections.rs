//! Stores on connections the application made itself: a redis-rs `ConnectionManager`, a
//! Cluster connection and a connection of the application's own kind, on real servers. They serve every layer, and the store timeout still
//! bounds every call.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use crate::common;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use common::RedisServer;
use common::cluster::RedisCluster;
use tollgate::claim::Claims;
use tollgate::key::Key;
use tollgate::rate::{Algorithm, Limit, RateCheck, RatePolicy};
use tollgate::store::{RateStore, RedisStore, Store, StoreErrorKind};

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

/// A connection of the application's own: it counts the commands it carries.
#[derive(Clone)]
struct Counting {
    inner: redis::aio::MultiplexedConnection,
    commands: Arc<AtomicUsize>,
}

impl redis::aio::ConnectionLike for Counting {
    fn req_packed_command<'a>(
        &'a mut self,
        cmd: &'a redis::Cmd,
    ) -> redis::RedisFuture<'a, redis::Value> {
        self.commands.fetch_add(1, Ordering::Relaxed);
        self.inner.req_packed_command(cmd)
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a redis::Pipeline,
        offset: usize,
        count: usize,
    ) -> redis::RedisFuture<'a, Vec<redis::Value>> {
        self.commands.fetch_add(1, Ordering::Relaxed);
        self.inner.req_packed_commands(pipeline, offset, count)
    }

    fn get_db(&self) -> i64 {
        self.inner.get_db()
    }
}

async fn counting(server: &RedisServer) -> Counting {
    let client = redis::Client::open(server.url()).unwrap();
    Counting {
        inner: client.get_multiplexed_async_connection().await.unwrap(),
        commands: Arc::new(AtomicUsize::new(0)),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn any_connection_serves_two_copies_exactly_once_and_is_bounded_by_the_timeout() {
    let server = RedisServer::start();
    let (a, b) = (counting(&server).await, counting(&server).await);
    let (used_a, used_b) = (Arc::clone(&a.commands), Arc::clone(&b.commands));
    let copies = [
        RedisStore::from_connection(a, Duration::from_millis(500)),
        RedisStore::from_connection(b, Duration::from_millis(500)),
    ];
    assert!(format!("{:?}", copies[0]).contains("given"));

    // two copies, 50 parallel redemptions of one coupon: exactly one wins
    let won = common::redemptions_won(&copies, "coupon-1", 50).await;
    assert_eq!(won, 1, "exactly one redemption");

    // rate checks go through it too: exactly the quota of 20 concurrent checks
    let policy = Arc::new(
        RatePolicy::new("given:rl", Algorithm::Gcra, vec![Limit::per_hour("h", 5)]).unwrap(),
    );
    let checks: Vec<_> = (0..20)
        .map(|i| {
            let (store, policy) = (copies[i % 2].clone(), Arc::clone(&policy));
            tokio::spawn(async move {
                let check = RateCheck::new(Key::new("t", b"caller"), 1);
                store.check_rate(&policy, check).await.unwrap().admitted
            })
        })
        .collect();
    let mut admitted = 0;
    for check in checks {
        admitted += u32::from(check.await.unwrap());
    }
    assert_eq!(admitted, 5, "exactly the quota");
    assert!(used_a.load(Ordering::Relaxed) > 0 && used_b.load(Ordering::Relaxed) > 0);

    server.pause();
    let start = Instant::now();
    let error = copies[0].ping().await.unwrap_err();
    let waited = start.elapsed();
    server.resume();
    assert_eq!(error.kind(), StoreErrorKind::Timeout);
    assert!(waited < Duration::from_secs(2), "a call waited {waited:?}");
}
