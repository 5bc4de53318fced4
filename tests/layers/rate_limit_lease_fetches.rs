//! A slice's fetch belongs to the copy, not to the request that started it: a request dropped
//! mid-fetch (hyper drops the future of a closed connection) leaves the slice to the copy, which
//! gives it back; a fetch whose reply is lost (slower than the store's timeout) is resolved
//! through the ledger (the same attempt re-sent is answered as before, charged nothing) and
//! given back. Either way the store ends up counting exactly what was admitted.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::convert::Infallible;
use std::time::Duration;

use http::{Request, Response, StatusCode};
use tower::{Service, ServiceExt};

use super::rate_limit_leases::{
    QUOTA, copy, copy_builder, fire, left_becomes, one, shortfall_is_held, unique, unspent_becomes,
};
use crate::common::proxy::Proxy;
use crate::common::{RedisServer, postgres};
use tollgate::key::Header;
use tollgate::rate_limit::{Algorithm, OnStoreError, RateLimitLayer};
use tollgate::store::{MemoryStore, PgStore, RateStore, RedisStore};

/// Requests the tests drop half-way: the one that starts a fetch, and those that wait for it.
const DROPPED: usize = 5;

/// A copy whose store fails a call after `timeout` (the request then refused: `503`).
fn strict_copy(
    store: impl RateStore,
    algorithm: Algorithm,
    prefix: &str,
) -> RateLimitLayer<Header> {
    copy_builder(store, algorithm, prefix)
        .on_store_error(OnStoreError::Deny)
        .build()
        .unwrap()
}

/// Every algorithm, each test's loop.
const ALGORITHMS: [Algorithm; 3] = [
    Algorithm::Gcra,
    Algorithm::SlidingCounter,
    Algorithm::SlidingLog,
];

/// A Redis store through `proxy`, with `timeout`.
fn through(proxy: &Proxy, timeout: Duration) -> RedisStore {
    RedisStore::builder(proxy.url())
        .timeout(timeout)
        .build()
        .unwrap()
}

/// Sends one request of `caller` through `copy` and drops it half-way: unpolled when `polled`
/// is `None`, else after polling it that long (it must still be waiting then).
async fn drop_half_way(copy: &RateLimitLayer<Header>, caller: &str, polled: Option<Duration>) {
    let mut service = tower::Layer::layer(
        copy,
        tower::service_fn(|_: Request<()>| async { Ok::<_, Infallible>(Response::new(())) }),
    );
    let request = Request::get("/")
        .header("x-api-key", caller)
        .body(())
        .unwrap();
    let pending = service.ready().await.unwrap().call(request);
    if let Some(patience) = polled {
        let finished = tokio::time::timeout(patience, pending).await;
        assert!(finished.is_err(), "the request was answered: {finished:?}");
    }
}

/// On one thread: the fetch's task runs once the five requests are gone (an answer that came
/// first would admit the later ones from the slice, and they would count as admitted).
#[tokio::test(flavor = "current_thread")]
async fn in_memory_a_request_dropped_mid_fetch_leaks_no_slice() {
    for algorithm in ALGORITHMS {
        let layer = copy(MemoryStore::new(), algorithm, &unique("lease"));
        let caller = unique("gone");
        assert_eq!(fire(&layer, &caller, 3).await.admitted, 3);
        for _ in 0..DROPPED {
            drop_half_way(&layer, &caller, None).await;
        }
        a_dropped_fetch_leaks_nothing_after(&layer, &caller, 3).await;
    }
}

/// Replies a second late; each dropped request is polled 100 ms, long enough for its command to
/// run in the store, and all are gone before the first reply comes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_redis_a_request_dropped_mid_fetch_leaks_no_slice() {
    let server = RedisServer::start();
    let proxy = Proxy::start(server.addr()).await;
    for algorithm in ALGORITHMS {
        let store = through(&proxy, Duration::from_secs(3));
        let layer = copy(store, algorithm, &unique("lease"));
        let caller = unique("gone");
        assert_eq!(fire(&layer, &caller, 3).await.admitted, 3);
        proxy.delay_replies(Duration::from_secs(1));
        for _ in 0..DROPPED {
            drop_half_way(&layer, &caller, Some(Duration::from_millis(100))).await;
        }
        proxy.delay_replies(Duration::ZERO);
        // the replies held back reach the client before the store is asked anything else
        tokio::time::sleep(Duration::from_millis(1200)).await;
        a_dropped_fetch_leaks_nothing_after(&layer, &caller, 3).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_postgres_a_request_dropped_mid_fetch_leaks_no_slice() {
    let server = tokio::task::spawn_blocking(postgres::shared).await.unwrap();
    let proxy = Proxy::start(server.addr()).await;
    for algorithm in ALGORITHMS {
        let layer = copy(
            pg_through(&proxy, Duration::from_secs(3)).await,
            algorithm,
            &unique("lease"),
        );
        let caller = unique("gone");
        assert_eq!(fire(&layer, &caller, 3).await.admitted, 3);
        proxy.delay_replies(Duration::from_secs(1));
        for _ in 0..DROPPED {
            drop_half_way(&layer, &caller, Some(Duration::from_millis(100))).await;
        }
        proxy.delay_replies(Duration::ZERO);
        // the replies held back reach the client before the store is asked anything else
        tokio::time::sleep(Duration::from_millis(1200)).await;
        a_dropped_fetch_leaks_nothing_after(&layer, &caller, 3).await;
    }
}

/// After `admitted` requests and the dropped ones (the first of which started a fetch, the
/// others waiting for it): once the copy gives its slices back (the fetch under way waited for)
/// the store counts the admitted, and the caller goes on, charged exactly what is admitted.
async fn a_dropped_fetch_leaks_nothing_after(
    copy: &RateLimitLayer<Header>,
    caller: &str,
    admitted: u64,
) {
    // the slice the first dropped request fetched (twice its four requests) is the copy's
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while copy.leases_unspent() == 0 && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let held = copy.leases_unspent();
    copy.give_back_leases().await;
    left_becomes(copy, caller, QUOTA - admitted).await;
    assert_eq!(held, 8, "the copy held {held} of the slice fetched");
    assert_eq!(copy.leases_unspent(), 0);
    let after = fire(copy, caller, 20).await;
    assert_eq!(after.admitted, 20, "{after:?}");
    copy.give_back_leases().await;
    left_becomes(copy, caller, QUOTA - admitted - 20).await;
}

/// A store on the shared PostgreSQL reached through `proxy`, in a schema of its own (migrated
/// first with time to spare).
async fn pg_through(proxy: &Proxy, timeout: Duration) -> PgStore {
    let schema = postgres::unique_schema();
    let builder = || {
        PgStore::builder(format!("postgres://postgres@{}/postgres", proxy.addr()))
            .schema(schema.as_str())
            .pool_size(4)
            .purge_interval(None)
    };
    builder()
        .timeout(Duration::from_secs(5))
        .connect()
        .await
        .unwrap();
    builder().timeout(timeout).connect().await.unwrap()
}

/// Three requests checked one by one; the fourth fetches a slice whose reply comes 300 ms late,
/// past the store's 200 ms timeout: the request is refused (`503`), the store had charged the
/// slice. The copy resolves it (re-sent, answered as before, then given back): the store counts
/// the three, and the caller goes on, charged exactly what is admitted.
async fn a_lost_reply_leaks_nothing(layer: &RateLimitLayer<Header>, proxy: &Proxy) {
    let caller = unique("lost");
    assert_eq!(fire(layer, &caller, 3).await.admitted, 3);
    proxy.delay_replies(Duration::from_millis(300));
    assert_eq!(one(layer, &caller).await.0, StatusCode::SERVICE_UNAVAILABLE);
    proxy.delay_replies(Duration::ZERO);
    // the store charged the slice: the copy holds it while it is resolved, and spends none of it
    assert!(shortfall_is_held(layer, layer, &caller, 3).await > 0);
    // a graceful shutdown waits for the lost slice to be resolved and given back
    layer.give_back_leases().await;
    left_becomes(layer, &caller, QUOTA - 3).await;
    unspent_becomes(layer, 0).await;
    let after = fire(layer, &caller, 20).await;
    assert_eq!(after.admitted, 20, "{after:?}");
    layer.give_back_leases().await;
    left_becomes(layer, &caller, QUOTA - 23).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_redis_a_fetch_whose_reply_is_lost_leaks_no_slice() {
    let server = RedisServer::start();
    let proxy = Proxy::start(server.addr()).await;
    for algorithm in ALGORITHMS {
        let store = through(&proxy, Duration::from_millis(200));
        let layer = strict_copy(store, algorithm, &unique("lease"));
        a_lost_reply_leaks_nothing(&layer, &proxy).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_postgres_a_fetch_whose_reply_is_lost_leaks_no_slice() {
    let server = tokio::task::spawn_blocking(postgres::shared).await.unwrap();
    let proxy = Proxy::start(server.addr()).await;
    for algorithm in ALGORITHMS {
        let store = pg_through(&proxy, Duration::from_millis(200)).await;
        let layer = strict_copy(store, algorithm, &unique("lease"));
        a_lost_reply_leaks_nothing(&layer, &proxy).await;
    }
}
