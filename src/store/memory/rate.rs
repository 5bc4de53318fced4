//! [`RateStore`] in process: checks decided by `LocalRates`, resets and invalidations told to
//! every layer on the store.

use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use super::{MemoryStore, NOMINAL_TIMEOUT, done, invalidation, ready};
use crate::key::Key;
use crate::rate::{LimitState, RateCheck, RateOutcome, RatePolicy};
use crate::store::{
    Invalidation, Invalidations, LimitsStore, RateStore, StoreError, StoreErrorKind, StoreFuture,
};

/// The answer to a new caller of a full store: denied for a second, nothing charged.
fn full_denial(policy: &RatePolicy) -> RateOutcome {
    let wait = Duration::from_secs(1);
    let full = LimitState {
        remaining: 0,
        reset: wait,
    };
    RateOutcome {
        admitted: false,
        retry_after: wait,
        limits: vec![full; policy.limits().len()],
        decided_at_us: None,
    }
}

impl RateStore for MemoryStore {
    fn check_rate(&self, policy: &Arc<RatePolicy>, check: RateCheck) -> StoreFuture<RateOutcome> {
        let check = check.bounded(policy);
        let outcome = match self.inner.rates.check(policy, check) {
            Ok(outcome) => outcome,
            // A settlement is admitted by definition: one that would keep a caller there is no
            // room for (an overrun of a caller forgotten since its reservation) cannot be
            // answered as a denial. It fails as a write beyond Redis's `maxmemory` does, and its
            // layer keeps the request charged what it reserved.
            Err(_full) if check.settles().is_some() => {
                return done(Err(StoreError::new(
                    StoreErrorKind::Protocol,
                    "MemoryStore full: a settlement that would keep a new caller is refused (see MemoryStore::with_capacity)",
                )));
            }
            Err(_full) => full_denial(policy),
        };
        if invalidation::refunded(&check, &outcome) {
            self.inner.invalidations.send(Invalidation::Caller {
                namespace: Arc::from(policy.namespace()),
                key: check.key(),
            });
        }
        ready(outcome)
    }

    /// Nominal: the memory store answers at once; a check is remembered as one on a store of
    /// this timeout would be (see the [attempt ledger](crate::store#the-attempt-ledger)).
    fn timeout(&self) -> Duration {
        NOMINAL_TIMEOUT
    }

    fn reset_rate(&self, policy: &Arc<RatePolicy>, key: Key) -> StoreFuture<()> {
        self.inner.rates.reset(policy, key);
        self.inner.invalidations.send(Invalidation::Caller {
            namespace: Arc::from(policy.namespace()),
            key,
        });
        ready(())
    }

    /// Every layer on this store (or a clone of it) hears the resets and refunds made through
    /// any other, at once.
    fn invalidations(&self) -> Option<Invalidations> {
        Some(self.inner.invalidations.subscribe())
    }

    fn limits_store(&self) -> Option<&dyn LimitsStore> {
        Some(self)
    }

    fn line_up(
        &self,
        policy: &Arc<RatePolicy>,
        key: Key,
        waiter: u64,
        keep: Duration,
        deadline: Instant,
    ) -> StoreFuture<u32> {
        self.line_up_at(&policy.line_key(&key), waiter, keep, deadline)
    }

    fn leave_line(&self, policy: &Arc<RatePolicy>, key: Key, waiter: u64) -> StoreFuture<()> {
        self.leave_line_now(&policy.line_key(&key), waiter)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rate::{Algorithm, Limit};

    /// A full store: a check of a new caller is denied (nothing charged), but a settlement of
    /// a caller the store does not hold is refused with an error, never answered as a denial; a
    /// held caller settles as always.
    #[tokio::test(start_paused = true)]
    async fn a_settlement_for_a_caller_absent_from_a_full_store_fails_and_is_not_a_denial() {
        for algorithm in [
            Algorithm::SlidingLog,
            Algorithm::SlidingCounter,
            Algorithm::Gcra,
        ] {
            let store = MemoryStore::with_capacity(1);
            let limits = vec![Limit::per_minute("m", 10)];
            let policy = Arc::new(RatePolicy::new("cap", algorithm, limits).unwrap());
            let (alice, bob) = (Key::new("t", b"alice"), Key::new("t", b"bob"));
            // bob's reservation was made on a store that has since forgotten it (a restart)
            let reserved = RateCheck::reservation(bob, 4);
            assert!(
                store
                    .check_rate(&policy, RateCheck::new(alice, 1))
                    .await
                    .unwrap()
                    .admitted
            );
            let denied = store
                .check_rate(&policy, RateCheck::new(bob, 1))
                .await
                .unwrap();
            assert!(
                !denied.admitted,
                "{algorithm}: a new caller of a full store"
            );
            let overrun = store.check_rate(&policy, reserved.settle(9)).await;
            assert_eq!(
                overrun.unwrap_err().kind(),
                StoreErrorKind::Protocol,
                "{algorithm}: an overrun with no room"
            );
            // a refund is recorded too (so that it applies once): it needs room as well
            let refund = store.check_rate(&policy, reserved.settle(0)).await;
            assert_eq!(
                refund.unwrap_err().kind(),
                StoreErrorKind::Protocol,
                "{algorithm}"
            );
            let held = RateCheck::reservation(alice, 2);
            assert!(store.check_rate(&policy, held).await.unwrap().admitted);
            let settled = store.check_rate(&policy, held.settle(5)).await.unwrap();
            assert!(settled.admitted, "{algorithm}");
            assert_eq!(
                settled.limits[0].remaining, 4,
                "{algorithm}: 1 + 5 of 10 spent"
            );
        }
    }
}
