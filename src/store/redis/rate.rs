//! [`RateStore`] on Redis: checks (coalesced in `rates.rs`), resets and invalidations.

use std::sync::Arc;
use std::time::Duration;

use super::{RedisStore, invalidation, redis_call, store_error};
use crate::key::Key;
use crate::rate::{RateCheck, RateOutcome, RatePolicy};
use crate::store::span::Command;
use crate::store::{Invalidations, RateStore, StoreFuture};

impl RateStore for RedisStore {
    fn check_rate(&self, policy: &Arc<RatePolicy>, check: RateCheck) -> StoreFuture<RateOutcome> {
        let check = check.bounded(policy);
        let pending = self.rates.check(policy, check);
        let (link, timeout) = (Arc::clone(&self.link), self.timeout);
        let namespace: Arc<str> = Arc::from(policy.namespace());
        crate::store::publishing_refunds(pending, check, move || async move {
            let published = invalidation::publish_or_log(link.get(), namespace, check.key());
            let _ = tokio::time::timeout(timeout, published).await;
        })
    }

    fn timeout(&self) -> Duration {
        self.timeout
    }

    /// Deletes the caller's keys, then publishes the reset (see
    /// [Invalidations](crate::store#invalidations)): a reset that failed to publish still
    /// succeeds, and other copies' cached denials of the caller end within a second.
    fn reset_rate(&self, policy: &Arc<RatePolicy>, key: Key) -> StoreFuture<()> {
        let keys = policy.reset_keys(&key);
        let namespace: Arc<str> = Arc::from(policy.namespace());
        let call = redis_call("reset_rate", Command::Del, "");
        self.call(call, move |mut conn, _| async move {
            redis::cmd("DEL")
                .arg(&keys)
                .query_async::<i64>(&mut conn)
                .await
                .map_err(store_error)?;
            invalidation::publish_or_log(conn, namespace, key).await;
            Ok(())
        })
    }

    /// One Pub/Sub connection per store, made on the first call; `None` on a connection the
    /// application handed over, which the store cannot open again.
    fn invalidations(&self) -> Option<Invalidations> {
        self.subscriber.subscribe()
    }
}
