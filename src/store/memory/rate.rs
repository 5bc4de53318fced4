//! [`RateStore`] in process: checks decided by `LocalRates`, resets and invalidations told to
//! every layer on the store.

use std::sync::Arc;
use std::time::Duration;

use super::{MemoryStore, NOMINAL_TIMEOUT, invalidation, ready};
use crate::key::Key;
use crate::rate::{LimitState, RateCheck, RateOutcome, RatePolicy};
use crate::store::{Invalidation, Invalidations, RateStore, StoreFuture};

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
        let outcome = self.inner.rates.check(policy, check);
        let outcome = outcome.unwrap_or_else(|_full| full_denial(policy));
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
}
