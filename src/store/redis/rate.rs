//! [`RateStore`] on Redis: checks (coalesced in `rates.rs`), resets (`reset.lua`) and
//! invalidations.

use std::sync::Arc;
use std::time::Duration;

use redis::Value;
use tokio::time::Instant;

use super::clock::store_deadline;
use super::script_call::ScriptCall;
use super::{RedisStore, invalidation, redis_call, store_error, unexpired};
use crate::key::Key;
use crate::rate::{RateCheck, RateOutcome, RatePolicy};
use crate::store::span::Command;
use crate::store::{Invalidations, LimitsStore, RateStore, StoreFuture, millis};

/// `line.lua`'s keys and waiter for `waiter` in caller `key`'s line under `policy`.
fn line_call(policy: &RatePolicy, key: Key, waiter: u64) -> ScriptCall {
    let line = policy.line_key(&key);
    let lapse = format!("{line}:lapse");
    ScriptCall::default()
        .key(line)
        .key(lapse)
        .arg(format!("{waiter:016x}"))
}

impl RateStore for RedisStore {
    fn check_rate(&self, policy: &Arc<RatePolicy>, check: RateCheck) -> StoreFuture<RateOutcome> {
        let check = check.bounded(policy);
        let pending = self.rates.check(policy, check);
        // what a refund's publication needs is made only when one is published
        let (link, timeout, policy) = (Arc::clone(&self.link), self.timeout, Arc::clone(policy));
        crate::store::publishing_refunds(pending, check, move || async move {
            let namespace: Arc<str> = Arc::from(policy.namespace());
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
    ///
    /// The reset carries a deadline, as every write does (see
    /// [Deadlines](crate::store#deadlines)): one that reaches Redis after it deletes nothing and
    /// fails with [`Timeout`](crate::store::StoreErrorKind::Timeout). So a reset that timed out
    /// either ran by then or never will: it cannot land later and erase what the caller was
    /// charged since.
    fn reset_rate(&self, policy: &Arc<RatePolicy>, key: Key) -> StoreFuture<()> {
        let call = policy
            .reset_keys(&key)
            .into_iter()
            .fold(ScriptCall::default(), ScriptCall::key);
        let namespace: Arc<str> = Arc::from(policy.namespace());
        let (clock, link) = (Arc::clone(&self.clock), Arc::clone(&self.link));
        let deadline = Instant::now() + self.timeout;
        let trip = redis_call("reset_rate", Command::Evalsha, self.scripts.reset.name);
        self.call(trip, move |mut conn, scripts| async move {
            let at = store_deadline(&clock, &link, &mut conn, deadline).await?;
            let reply: Value = call
                .arg(at)
                .invoke(&scripts.reset, &mut conn)
                .await
                .map_err(store_error)?;
            let _deleted: i64 = unexpired(reply)?;
            invalidation::publish_or_log(conn, namespace, key).await;
            Ok(())
        })
    }

    /// `line.lua` on the line's two sorted sets, with the call's deadline (see
    /// [Lines](crate::store#lines)).
    fn line_up(
        &self,
        policy: &Arc<RatePolicy>,
        key: Key,
        waiter: u64,
        keep: Duration,
        deadline: Instant,
    ) -> StoreFuture<u32> {
        let call = line_call(policy, key, waiter).arg(millis(keep));
        let (clock, link) = (Arc::clone(&self.clock), Arc::clone(&self.link));
        let trip = redis_call("line_up", Command::Evalsha, self.scripts.line.name);
        self.call(trip, move |mut conn, scripts| async move {
            let at = store_deadline(&clock, &link, &mut conn, deadline).await?;
            let reply: Value = call
                .arg(at)
                .invoke(&scripts.line, &mut conn)
                .await
                .map_err(store_error)?;
            let ahead: i64 = unexpired(reply)?;
            Ok(u32::try_from(ahead).unwrap_or(u32::MAX))
        })
    }

    fn leave_line(&self, policy: &Arc<RatePolicy>, key: Key, waiter: u64) -> StoreFuture<()> {
        let call = line_call(policy, key, waiter).arg(0).arg(0);
        let trip = redis_call("leave_line", Command::Evalsha, self.scripts.line.name);
        self.call(trip, move |mut conn, scripts| async move {
            let _: i64 = call
                .invoke(&scripts.line, &mut conn)
                .await
                .map_err(store_error)?;
            Ok(())
        })
    }

    /// One Pub/Sub connection per store, made on the first call; `None` on a connection the
    /// application handed over, which the store cannot open again.
    fn invalidations(&self) -> Option<Invalidations> {
        self.subscriber.subscribe()
    }

    fn limits_store(&self) -> Option<&dyn LimitsStore> {
        Some(self)
    }
}
