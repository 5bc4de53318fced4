//! What the tests of metered endpoints share (`composition`, `streamed_usage`): a tenant's
//! budget read once its settlements have landed, and their rules run on every backend.
#![allow(clippy::unwrap_used)]

use std::time::Duration;

use tollgate::key::Header;
use tollgate::rate_limit::RateLimitLayer;

/// What tenant `acme` (header `x-tenant`) has left, once it stays the same for a moment:
/// settlements of a streamed body are made in the background, once the body is dropped.
pub(super) async fn acme_left(layer: &RateLimitLayer<Header>) -> u64 {
    let acme = Header::from_static("x-tenant").key(b"acme");
    let mut last = None;
    for _ in 0..100 {
        let now = layer.peek(acme).await.unwrap().limits[0].remaining;
        if last == Some(now) {
            return now;
        }
        last = Some(now);
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("acme's budget did not settle: {last:?}");
}

/// Each rule, a function of a store, as a test on a `MemoryStore`, a redis-server and a
/// PostgreSQL of its own.
macro_rules! on_memory_redis_postgres {
    ($($rule:ident),* $(,)?) => {
        mod on_memory {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $rule() {
                    super::$rule(tollgate::store::MemoryStore::new()).await;
                }
            )*
        }
        mod on_redis {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $rule() {
                    let server = crate::common::RedisServer::start();
                    let store = crate::rate_limit_invalidations::redis_store(&server);
                    super::$rule(store).await;
                }
            )*
        }
        mod on_postgres {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $rule() {
                    super::$rule(crate::common::postgres::store().await).await;
                }
            )*
        }
    };
}
