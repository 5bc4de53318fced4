//! Sends that reach Redis after their deadline, between sends that do not: a re-sent check or
//! settlement whose retry arrived late (a no-op that left no record) is still charged once when
//! sent a third time, and a reset that timed out and arrives late erases nothing charged since.
//! On a redis-server and on a Redis Cluster, each behind [`Proxy`]s that delay or hold bytes.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use crate::common;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use common::RedisServer;
use common::cluster::RedisCluster;
use common::proxy::Proxy;
use tollgate::key::Key;
use tollgate::rate::{Algorithm, Limit, RateCheck, RateOutcome, RatePolicy};
use tollgate::store::{RateStore, RedisStore, StoreErrorKind};

/// The store timeout in these tests.
const TIMEOUT: Duration = Duration::from_millis(500);

/// How late a reply comes: its command ran, its caller gave up.
const LATE_REPLY: Duration = Duration::from_millis(1000);

/// How late a command arrives when sent right after the previous send timed out: past its own
/// deadline (one timeout after it was sent), yet well inside the retention of the first send's
/// record (its deadline plus two timeouts), so that the next send is too.
const LATE_REQUEST: Duration = Duration::from_millis(700);

const ALGORITHMS: [Algorithm; 3] = [
    Algorithm::Gcra,
    Algorithm::SlidingCounter,
    Algorithm::SlidingLog,
];

/// A store whose connections run through proxies: to a redis-server, or to every node of a
/// Redis Cluster of its own, which announces the proxies.
struct Proxied {
    proxies: Vec<Proxy>,
    /// The nodes themselves (for `MONITOR`).
    nodes: Vec<SocketAddr>,
    cluster: bool,
    _server: Option<RedisServer>,
    _cluster: Option<RedisCluster>,
}

impl Proxied {
    async fn standalone() -> Self {
        let server = RedisServer::start();
        Self {
            proxies: vec![Proxy::start(server.addr()).await],
            nodes: vec![server.addr()],
            cluster: false,
            _server: Some(server),
            _cluster: None,
        }
    }

    async fn cluster() -> Self {
        let ports = RedisCluster::free_ports();
        let nodes: Vec<SocketAddr> = ports
            .iter()
            .map(|&p| SocketAddr::from(([127, 0, 0, 1], p)))
            .collect();
        let mut proxies = Vec::new();
        for &node in &nodes {
            proxies.push(Proxy::start(node).await);
        }
        let announce: Vec<u16> = proxies.iter().map(|p| p.addr().port()).collect();
        let cluster = tokio::task::spawn_blocking(move || {
            RedisCluster::start_announcing(&ports, Some(&announce))
        })
        .await
        .unwrap();
        Self {
            proxies,
            nodes,
            cluster: true,
            _server: None,
            _cluster: Some(cluster),
        }
    }

    /// A store (a copy of the service) through the proxies, on connections of its own.
    async fn store(&self) -> RedisStore {
        let urls = self.proxies.iter().map(Proxy::url);
        if self.cluster {
            RedisStore::cluster_builder(urls)
                .timeout(TIMEOUT)
                .connect()
                .await
                .unwrap()
        } else {
            let url = urls.into_iter().next().unwrap();
            RedisStore::builder(url).timeout(TIMEOUT).build().unwrap()
        }
    }

    fn delay_replies(&self, delay: Duration) {
        self.proxies.iter().for_each(|p| p.delay_replies(delay));
    }

    fn delay(&self, delay: Duration) {
        self.proxies.iter().for_each(|p| p.delay(delay));
    }
}

fn policy(algorithm: Algorithm, quota: u64) -> Arc<RatePolicy> {
    let ns = format!("resend{:08x}:rl", rand::random::<u32>());
    let daily = Limit::new("d", quota, Duration::from_secs(86_400));
    Arc::new(RatePolicy::new(ns, algorithm, vec![daily]).unwrap())
}

fn caller() -> Key {
    Key::new(
        "resend",
        format!("{:016x}", rand::random::<u64>()).as_bytes(),
    )
}

/// Remaining of the only limit, looked at (cost 0).
async fn look(store: &RedisStore, policy: &Arc<RatePolicy>, caller: Key) -> u64 {
    let out = store
        .check_rate(policy, RateCheck::new(caller, 0))
        .await
        .unwrap();
    out.limits[0].remaining
}

/// Sends `check` three times: the first runs but its reply comes late, the second (its caller's
/// retry) reaches Redis only after its deadline and does nothing, the third arrives in time,
/// inside the first send's retention. The third's answer.
async fn sent_three_times(
    proxied: &Proxied,
    store: &RedisStore,
    policy: &Arc<RatePolicy>,
    check: RateCheck,
) -> RateOutcome {
    let algorithm = policy.algorithm();
    proxied.delay_replies(LATE_REPLY);
    let first = store.check_rate(policy, check).await.unwrap_err();
    assert_eq!(
        first.kind(),
        StoreErrorKind::Timeout,
        "{algorithm:?}: first"
    );
    proxied.delay_replies(Duration::ZERO);
    proxied.delay(LATE_REQUEST);
    let second = store.check_rate(policy, check).await.unwrap_err();
    assert_eq!(
        second.kind(),
        StoreErrorKind::Timeout,
        "{algorithm:?}: second"
    );
    // the third goes out at once, and reaches Redis right after the second (bytes keep their
    // order on a connection)
    proxied.delay(Duration::ZERO);
    store.check_rate(policy, check).await.unwrap()
}

/// A check charged, its reply late; its retry late to Redis (a no-op); sent a third time: it is
/// admitted and charged once, 10 − 3 = 7 left.
async fn a_check_is_charged_once_after_a_late_resend(proxied: &Proxied) {
    let store = proxied.store().await;
    for algorithm in ALGORITHMS {
        let (p, caller) = (policy(algorithm, 10), caller());
        // the connection is open and the store has read Redis's clock
        assert_eq!(look(&store, &p, caller).await, 10, "{algorithm:?}");
        let a = RateCheck::new(caller, 3);
        let third = sent_three_times(proxied, &store, &p, a).await;
        assert!(third.admitted, "{algorithm:?}: {third:?}");
        assert_eq!(
            third.limits[0].remaining, 7,
            "{algorithm:?}: the third send was charged again"
        );
        assert_eq!(look(&store, &p, caller).await, 7, "{algorithm:?}");
    }
}

/// A reservation of 3 of 20, settled for 8: the overrun of 5 is added once, however it was sent
/// (charged, its reply late; its retry late to Redis; sent a third time): 20 − 8 = 12 left.
async fn an_overrun_is_added_once_after_a_late_resend(proxied: &Proxied) {
    let store = proxied.store().await;
    for algorithm in ALGORITHMS {
        let (p, caller) = (policy(algorithm, 20), caller());
        let a = RateCheck::reservation(caller, 3);
        let reserved = store.check_rate(&p, a).await.unwrap();
        assert_eq!(reserved.limits[0].remaining, 17, "{algorithm:?}");
        let third = sent_three_times(proxied, &store, &p, a.settle(8)).await;
        assert!(third.admitted, "{algorithm:?}: {third:?}");
        assert_eq!(
            third.limits[0].remaining, 12,
            "{algorithm:?}: the overrun was added again"
        );
        assert_eq!(look(&store, &p, caller).await, 12, "{algorithm:?}");
    }
}

/// A reset sent into a connection that goes dark times out (the operator's `tollgate reset`
/// exits 2); another copy charges the caller; then the partition heals and the held reset reaches
/// Redis, after its deadline: it erases nothing.
async fn a_late_reset_erases_nothing_charged_since(proxied: &Proxied) {
    let store = proxied.store().await;
    let (p, caller) = (policy(Algorithm::Gcra, 10), caller());
    // the reset is known to the node of the caller's slot, the clock read
    store.reset_rate(&p, caller).await.unwrap();
    let charged = store.check_rate(&p, RateCheck::new(caller, 4)).await;
    assert_eq!(charged.unwrap().limits[0].remaining, 6);
    let mut monitors = Vec::new();
    for &node in &proxied.nodes {
        monitors.push(common::monitor(node).await);
    }
    proxied.proxies.iter().for_each(Proxy::silence);
    let reset = store.reset_rate(&p, caller).await.unwrap_err();
    assert_eq!(reset.kind(), StoreErrorKind::Timeout, "the reset timed out");
    // another copy, on connections opened after the silence
    let copy = proxied.store().await;
    let charged = copy.check_rate(&p, RateCheck::new(caller, 3)).await;
    assert_eq!(charged.unwrap().limits[0].remaining, 3, "charged after");
    let seen: Vec<usize> = monitors.iter().map(|m| m.lock().unwrap().len()).collect();
    proxied.proxies.iter().for_each(Proxy::unsilence);
    // the held reset names the caller's limit key
    let mut key = p.store_keys(&caller).remove(0);
    key.insert(0, '"');
    key.push('"');
    let arrived = || {
        monitors
            .iter()
            .zip(&seen)
            .any(|(m, &from)| m.lock().unwrap()[from..].contains(&key))
    };
    common::wait_for("the held reset reached Redis", arrived).await;
    tokio::time::sleep(Duration::from_millis(100)).await;
    // it ran (read the clock) and deleted nothing: refused, not unknown to the node
    let since: String = monitors
        .iter()
        .zip(&seen)
        .map(|(m, &from)| m.lock().unwrap()[from..].to_owned())
        .collect();
    assert!(since.contains("lua] \"TIME\""), "{since}");
    assert!(!since.contains("\"DEL\""), "{since}");
    assert_eq!(
        look(&copy, &p, caller).await,
        3,
        "the late reset erased the charge made after it timed out"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_a_check_is_charged_once_after_a_late_resend() {
    a_check_is_charged_once_after_a_late_resend(&Proxied::standalone().await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_a_check_is_charged_once_after_a_late_resend() {
    a_check_is_charged_once_after_a_late_resend(&Proxied::cluster().await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_an_overrun_is_added_once_after_a_late_resend() {
    an_overrun_is_added_once_after_a_late_resend(&Proxied::standalone().await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_an_overrun_is_added_once_after_a_late_resend() {
    an_overrun_is_added_once_after_a_late_resend(&Proxied::cluster().await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_a_late_reset_erases_nothing_charged_since() {
    a_late_reset_erases_nothing_charged_since(&Proxied::standalone().await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_a_late_reset_erases_nothing_charged_since() {
    a_late_reset_erases_nothing_charged_since(&Proxied::cluster().await).await;
}
