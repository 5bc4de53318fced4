//! Resets and refunds reach every copy's deny cache through the store's invalidation broadcast:
//! two copies (two `RateLimitLayer`s, each on a store client of its own, one server), the caller
//! denied from copy A's cache, reset or refunded through copy B — and A admits well within the
//! cache's one-second hold, on Redis (standalone, Sentinel and Cluster), PostgreSQL and a shared
//! `MemoryStore`. With the subscriber's connection killed, the one-second bound still holds and
//! the subscription comes back. A reservation settled after a reset through another copy refunds
//! nothing of what was spent since.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::convert::Infallible;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{HeaderValue, Request, Response, StatusCode};
use http_body_util::Full;
use tokio::sync::Notify;
use tower::ServiceBuilder;
use tower::util::BoxCloneSyncService;

use super::rate_limit_layer::{CLIENT, Calls, Svc, cost_header, get, get_costing, send, stack};
use crate::common::cluster::RedisCluster;
use crate::common::sentinel::SentinelSetup;
use crate::common::{RedisServer, postgres};
use tollgate::key::Header;
use tollgate::rate_limit::{Algorithm, DecisionSource, Limit, RateLimitLayer};
use tollgate::store::{MemoryStore, PgStore, RateStore, RedisStore};

/// The deny cache's longest hold: past it a copy asks the store again, broadcast or not.
const MAX_AGE: Duration = Duration::from_secs(1);

/// A copy with an hourly limit of `quota` on `store`, keyed by `x-client`, its keys under
/// `prefix`; a request costs its `x-cost` header (1 without).
fn copy(store: impl RateStore, prefix: &str, quota: u64) -> RateLimitLayer<Header> {
    RateLimitLayer::builder(store)
        .limit(Limit::per_hour("hourly", quota))
        .prefix(prefix)
        .cost(cost_header)
        .key(Header::new(CLIENT))
        .build()
        .unwrap()
}

/// A prefix no other test uses (the Cluster is shared).
fn unique_prefix() -> String {
    format!("inv{:08x}", rand::random::<u32>())
}

/// Sends requests of `client` through `copy` until the store denies one, then one more, which
/// the deny cache must answer.
async fn denied_from_cache(copy: &Svc, client: &str) {
    for sent in 0.. {
        let reply = send(copy, get(client)).await;
        if reply.status == StatusCode::TOO_MANY_REQUESTS {
            assert_eq!(reply.decision().source(), DecisionSource::Store);
            break;
        }
        assert!(sent < 100, "the store never denied {client}");
    }
    let cached = send(copy, get(client)).await;
    assert_eq!(cached.status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(cached.decision().source(), DecisionSource::DenyCache);
}

/// Polls `copy` with requests of `client` every 20 ms until one is admitted; how long after
/// `since` that was. Fails after 10 s.
async fn admitted_after(copy: &Svc, client: &str, since: Instant) -> Duration {
    loop {
        let reply = send(copy, get(client)).await;
        if reply.status == StatusCode::OK {
            assert_eq!(reply.decision().source(), DecisionSource::Store);
            return since.elapsed();
        }
        assert!(
            since.elapsed() < Duration::from_secs(10),
            "{client} still denied 10 s later"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Copy A caches a denial; a reset through copy B frees the caller on A well before the cache's
/// hold would. `subscribed` resolves once A's store listens (A's first request starts it).
async fn a_reset_reaches_the_other_copy(
    a: RateLimitLayer<Header>,
    b: RateLimitLayer<Header>,
    subscribed: impl Future<Output = ()>,
) {
    let copy_a = stack(a, &Calls::default());
    assert_eq!(send(&copy_a, get("ann")).await.status, StatusCode::OK);
    subscribed.await;
    denied_from_cache(&copy_a, "ann").await;

    b.reset(Header::new(CLIENT).key(b"ann")).await.unwrap();
    let admitted = admitted_after(&copy_a, "ann", Instant::now()).await;
    assert!(
        admitted < MAX_AGE / 2,
        "admitted {admitted:?} after the reset: not by the broadcast"
    );
}

/// Until `urls` (Redis nodes) count at least one pattern subscription between them, and a
/// moment more, for the subscriber's `Missed` to pass.
async fn pattern_subscribed(urls: Vec<String>) {
    let count = move || {
        urls.iter()
            .map(|url| {
                let mut conn = redis::Client::open(url.as_str())
                    .and_then(|c| c.get_connection())
                    .unwrap();
                redis::cmd("PUBSUB")
                    .arg("NUMPAT")
                    .query::<i64>(&mut conn)
                    .unwrap()
            })
            .sum::<i64>()
    };
    let deadline = Instant::now() + Duration::from_secs(10);
    while tokio::task::block_in_place(&count) < 1 {
        assert!(Instant::now() < deadline, "no subscriber within 10 s");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    tokio::time::sleep(Duration::from_millis(100)).await;
}

/// A store client on `server` with a 2 s timeout.
pub(super) fn redis_store(server: &RedisServer) -> RedisStore {
    RedisStore::builder(server.url())
        .timeout(Duration::from_secs(2))
        .build()
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reset_reaches_the_other_copy_at_once_on_redis() {
    let server = RedisServer::start();
    let prefix = unique_prefix();
    let a = copy(redis_store(&server), &prefix, 2);
    let b = copy(redis_store(&server), &prefix, 2);
    a_reset_reaches_the_other_copy(a, b, pattern_subscribed(vec![server.url()])).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reset_reaches_the_other_copy_at_once_on_redis_cluster() {
    let cluster = RedisCluster::shared();
    let prefix = unique_prefix();
    let a = copy(cluster.store().await, &prefix, 2);
    let b = copy(cluster.store().await, &prefix, 2);
    a_reset_reaches_the_other_copy(a, b, pattern_subscribed(cluster.urls())).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reset_reaches_the_other_copy_at_once_behind_sentinel() {
    let setup = SentinelSetup::start_with("tollgate-invalidations", 1).await;
    let sentinel = || {
        RedisStore::sentinel_builder(setup.sentinel_urls(), setup.master_name())
            .timeout(Duration::from_secs(2))
            .connect()
    };
    let prefix = unique_prefix();
    let a = copy(sentinel().await.unwrap(), &prefix, 2);
    let b = copy(sentinel().await.unwrap(), &prefix, 2);
    let primary = format!("redis://127.0.0.1:{}/", setup.primary_port());
    a_reset_reaches_the_other_copy(a, b, pattern_subscribed(vec![primary])).await;
}

/// Two store clients, as two copies have, on the shared PostgreSQL server in a schema of their
/// own: the server, the schema and the two stores.
async fn two_pg_copies() -> (&'static postgres::PgServer, String, PgStore, PgStore) {
    let server = tokio::task::spawn_blocking(postgres::shared).await.unwrap();
    let schema = postgres::unique_schema();
    let pg = || {
        PgStore::builder(server.url())
            .schema(&schema)
            .timeout(Duration::from_secs(2))
            .purge_interval(None)
            .connect()
    };
    let (a, b) = (pg().await.unwrap(), pg().await.unwrap());
    (server, schema, a, b)
}

/// Returns once a subscriber listens to `schema`'s invalidations on `server`: its connection
/// names itself after its channel.
async fn pg_listening(server: &postgres::PgServer, schema: &str) {
    let inspect = server.client().await;
    let deadline = Instant::now() + Duration::from_secs(10);
    let sql = "SELECT count(*) FROM pg_stat_activity WHERE application_name = $1";
    let name = format!("{schema}_invalidated");
    while inspect
        .query_one(sql, &[&name])
        .await
        .unwrap()
        .get::<_, i64>(0)
        < 1
    {
        assert!(Instant::now() < deadline, "no subscriber within 10 s");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reset_reaches_the_other_copy_at_once_on_postgres() {
    let (server, schema, store_a, store_b) = two_pg_copies().await;
    let prefix = unique_prefix();
    let (a, b) = (copy(store_a, &prefix, 2), copy(store_b, &prefix, 2));
    a_reset_reaches_the_other_copy(a, b, pg_listening(server, &schema)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reset_reaches_the_other_copy_at_once_on_one_memory_store() {
    let store = MemoryStore::new();
    let a = copy(store.clone(), "mem", 2);
    let b = copy(store, "mem", 2);
    a_reset_reaches_the_other_copy(a, b, async {}).await;
}

/// A copy whose inner service answers once `gate` is notified, reporting the usage its request
/// asked for in `x-use` as `x-used`; the layer settles reservations from it. `entered` says
/// that a request reached the inner service.
fn settling_copy(
    layer: RateLimitLayer<Header>,
    gate: Arc<Notify>,
    entered: Arc<AtomicBool>,
) -> Svc {
    let inner = tower::service_fn(move |req: Request<String>| {
        let (gate, entered) = (Arc::clone(&gate), Arc::clone(&entered));
        let used = req.headers().get("x-use").cloned();
        async move {
            entered.store(true, Ordering::SeqCst);
            gate.notified().await;
            let mut res = Response::new(Full::new(Bytes::from_static(b"done")));
            if let Some(used) = used {
                res.headers_mut().insert("x-used", used);
            }
            Ok::<_, Infallible>(res)
        }
    });
    BoxCloneSyncService::new(ServiceBuilder::new().layer(layer).service(inner))
}

/// A refund through copy B frees the caller that copy A denied from its cache: B reserved the
/// whole hourly quota and settles for a tenth of it, and A admits well before its cache's hold
/// would end. `subscribed` resolves once A's store listens (A's first request starts it).
async fn a_refund_reaches_the_other_copy(
    store_a: impl RateStore,
    store_b: impl RateStore,
    subscribed: impl Future<Output = ()>,
) {
    let prefix = unique_prefix();
    let copy_a = stack(copy(store_a, &prefix, 10), &Calls::default());
    let b = RateLimitLayer::builder(store_b)
        .limit(Limit::per_hour("hourly", 10))
        .prefix(&prefix)
        .cost(cost_header)
        .settle(|res| res.headers.get("x-used")?.to_str().ok()?.parse().ok())
        .key(Header::new(CLIENT))
        .build()
        .unwrap();
    let (gate, entered) = (Arc::new(Notify::new()), Arc::new(AtomicBool::new(false)));
    let copy_b = settling_copy(b, Arc::clone(&gate), Arc::clone(&entered));

    assert_eq!(send(&copy_a, get("ann")).await.status, StatusCode::OK);
    subscribed.await;
    let mut reserve = get_costing("ann", 9);
    reserve
        .headers_mut()
        .insert("x-use", HeaderValue::from_static("1"));
    let settled = tokio::spawn(async move { send(&copy_b, reserve).await });
    crate::common::wait_for("B's request reserved its 9", || {
        entered.load(Ordering::SeqCst)
    })
    .await;
    denied_from_cache(&copy_a, "ann").await;

    gate.notify_one();
    let released = Instant::now();
    let admitted = admitted_after(&copy_a, "ann", released).await;
    assert!(
        admitted < MAX_AGE / 2,
        "admitted {admitted:?} after the refund: not by the broadcast"
    );
    let settled = settled.await.unwrap();
    assert_eq!(settled.status, StatusCode::OK);
    // 10, less A's first request and B's settled use: decided before A was admitted again
    assert_eq!(
        settled.decision().limits()[0].1.remaining,
        8,
        "B's settled balance"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refund_through_one_copy_reaches_the_other_at_once_on_redis() {
    let server = RedisServer::start();
    let subscribed = pattern_subscribed(vec![server.url()]);
    a_refund_reaches_the_other_copy(redis_store(&server), redis_store(&server), subscribed).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refund_through_one_copy_reaches_the_other_at_once_on_redis_cluster() {
    let cluster = RedisCluster::shared();
    let (a, b) = (cluster.store().await, cluster.store().await);
    a_refund_reaches_the_other_copy(a, b, pattern_subscribed(cluster.urls())).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refund_through_one_copy_reaches_the_other_at_once_on_one_memory_store() {
    let store = MemoryStore::new();
    a_refund_reaches_the_other_copy(store.clone(), store, async {}).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refund_through_one_copy_reaches_the_other_at_once_on_postgres() {
    let (server, schema, store_a, store_b) = two_pg_copies().await;
    a_refund_reaches_the_other_copy(store_a, store_b, pg_listening(server, &schema)).await;
}

/// With the subscriber's connection killed, a reset still frees the caller on the other copy
/// within the cache's hold; the subscription comes back by itself, and the next reset reaches
/// the other copy at once again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_subscriber_keeps_the_one_second_bound_and_comes_back() {
    let server = RedisServer::start();
    let prefix = unique_prefix();
    let copy_a = stack(copy(redis_store(&server), &prefix, 2), &Calls::default());
    let b = copy(redis_store(&server), &prefix, 2);
    let ann = Header::new(CLIENT).key(b"ann");
    assert_eq!(send(&copy_a, get("ann")).await.status, StatusCode::OK);
    pattern_subscribed(vec![server.url()]).await;
    denied_from_cache(&copy_a, "ann").await;

    let killed: i64 = redis::cmd("CLIENT")
        .arg("KILL")
        .arg("TYPE")
        .arg("pubsub")
        .query(&mut server.conn())
        .unwrap();
    assert_eq!(killed, 1, "the one subscriber connection");
    b.reset(ann).await.unwrap();
    let admitted = admitted_after(&copy_a, "ann", Instant::now()).await;
    assert!(
        admitted <= MAX_AGE + Duration::from_millis(200),
        "admitted {admitted:?} after a reset the subscriber missed"
    );

    pattern_subscribed(vec![server.url()]).await;
    denied_from_cache(&copy_a, "ann").await;
    b.reset(ann).await.unwrap();
    let admitted = admitted_after(&copy_a, "ann", Instant::now()).await;
    assert!(
        admitted < MAX_AGE / 2,
        "admitted {admitted:?} after the reset: the subscription did not come back"
    );
}

/// The subscriber lives no longer than somebody listens: once the only layer on a store is
/// dropped, its Pub/Sub connection closes, though the store itself is still held.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_subscriber_closes_when_its_last_layer_goes() {
    let server = RedisServer::start();
    let store = redis_store(&server);
    let copy_a = stack(copy(store.clone(), &unique_prefix(), 2), &Calls::default());
    assert_eq!(send(&copy_a, get("ann")).await.status, StatusCode::OK);
    pattern_subscribed(vec![server.url()]).await;

    drop(copy_a);
    let numpat = || -> i64 {
        redis::cmd("PUBSUB")
            .arg("NUMPAT")
            .query(&mut server.conn())
            .unwrap()
    };
    let deadline = Instant::now() + Duration::from_secs(5);
    while tokio::task::block_in_place(numpat) > 0 {
        assert!(
            Instant::now() < deadline,
            "the subscriber outlived its layer by 5 s"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    drop(store);
}

/// A reset through copy A while copy B's reservation is in flight: the quota others spend after
/// the reset stays spent when B settles (B reserved 8 of 10 and used none; after the reset C
/// spends 5 through A; B's settlement refunds nothing of C's) — exactly 5 left, under every
/// algorithm, on every store.
async fn a_settlement_after_a_reset_refunds_nothing_others_spent<S: RateStore + Clone>(
    store_a: S,
    store_b: S,
) {
    for algorithm in [
        Algorithm::SlidingLog,
        Algorithm::SlidingCounter,
        Algorithm::Gcra,
    ] {
        let prefix = unique_prefix();
        let builder = |store: S| {
            RateLimitLayer::builder(store)
                .limit(Limit::per_hour("hourly", 10))
                .algorithm(algorithm)
                .prefix(&prefix)
                .cost(cost_header)
                .key(Header::new(CLIENT))
        };
        let a = builder(store_a.clone()).build().unwrap();
        let copy_a = stack(a.clone(), &Calls::default());
        let b = builder(store_b.clone())
            .settle(|res| res.headers.get("x-used")?.to_str().ok()?.parse().ok())
            .build()
            .unwrap();
        let (gate, entered) = (Arc::new(Notify::new()), Arc::new(AtomicBool::new(false)));
        let copy_b = settling_copy(b, Arc::clone(&gate), Arc::clone(&entered));
        let mut reserve = get_costing("ann", 8);
        reserve
            .headers_mut()
            .insert("x-use", HeaderValue::from_static("0"));
        let settled = tokio::spawn(async move { send(&copy_b, reserve).await });
        crate::common::wait_for("B's request reserved its 8", || {
            entered.load(Ordering::SeqCst)
        })
        .await;
        let ann = Header::new(CLIENT).key(b"ann");
        a.reset(ann).await.unwrap();
        let spent = send(&copy_a, get_costing("ann", 5)).await;
        assert_eq!(
            spent.status,
            StatusCode::OK,
            "{algorithm}: C's 5 after the reset"
        );
        assert_eq!(spent.decision().limits()[0].1.remaining, 5, "{algorithm}");
        gate.notify_one();
        assert_eq!(settled.await.unwrap().status, StatusCode::OK, "{algorithm}");
        assert_eq!(
            a.peek(ann).await.unwrap().limits[0].remaining,
            5,
            "{algorithm}: B's settlement refunded what C spent"
        );
        let over = send(&copy_a, get_costing("ann", 6)).await;
        assert_eq!(
            over.status,
            StatusCode::TOO_MANY_REQUESTS,
            "{algorithm}: 11 of 10"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_settlement_after_a_reset_refunds_nothing_others_spent_on_memory() {
    let store = MemoryStore::new();
    a_settlement_after_a_reset_refunds_nothing_others_spent(store.clone(), store).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_settlement_after_a_reset_refunds_nothing_others_spent_on_redis() {
    let server = RedisServer::start();
    a_settlement_after_a_reset_refunds_nothing_others_spent(
        redis_store(&server),
        redis_store(&server),
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_settlement_after_a_reset_refunds_nothing_others_spent_on_postgres() {
    let (_, _, store_a, store_b) = two_pg_copies().await;
    a_settlement_after_a_reset_refunds_nothing_others_spent(store_a, store_b).await;
}
