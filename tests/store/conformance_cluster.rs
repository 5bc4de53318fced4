//! The conformance suite on a three-master Redis Cluster, and the spread of keys over it.
#![allow(clippy::unwrap_used, clippy::expect_used)]
use crate::common;

use std::sync::Arc;

use common::cluster::RedisCluster;
use tollgate::key::Key;
use tollgate::rate::{Algorithm, Limit, RateCheck, RatePolicy};
use tollgate::store::RateStore;

tollgate::store_suite!((RedisCluster::shared().store().await, ()));
tollgate::limits_store_suite!((RedisCluster::shared().store().await, ()));
tollgate::rate_lines_suite!((RedisCluster::shared().store().await, ()));

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn callers_spread_over_all_masters() {
    let cluster = RedisCluster::shared();
    let store = cluster.store().await;
    let ns = format!("spread{}:rl", rand::random::<u32>());
    let policy = Arc::new(
        RatePolicy::new(
            ns.clone(),
            Algorithm::SlidingCounter,
            vec![Limit::per_minute("a", 10), Limit::per_hour("b", 100)],
        )
        .unwrap(),
    );
    for caller in 0..300u32 {
        let key = Key::new("test", &caller.to_be_bytes());
        // two limits, one script: both keys share the caller's hash tag, so no CROSSSLOT
        assert!(
            store
                .check_rate(&policy, RateCheck::new(key, 1))
                .await
                .unwrap()
                .admitted
        );
    }
    // per caller its two limits' keys and the record of the call that charged them
    let added = cluster.key_counts(&format!("{ns}:*"));
    assert_eq!(added.iter().sum::<usize>(), 900, "{added:?}");
    for (node, n) in added.iter().enumerate() {
        // 300 callers over ~5461 slots each: every master gets a fair share
        assert!(*n >= 150, "master {node} got only {n} keys: {added:?}");
        assert_eq!(
            n % 3,
            0,
            "a caller's three keys live on one master: {added:?}"
        );
    }
}
