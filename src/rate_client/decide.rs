//! How a store's answer — or its failure — becomes a [`Verdict`].

use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use super::client::RateClient;
use super::source::DecisionSource;
use super::tiers::Tier;
use super::verdict::Verdict;
use crate::on_error::OnStoreError;
use crate::rate::{RateCheck, RateOutcome};
use crate::store::StoreError;

impl RateClient {
    /// The verdict on `check` under `tier` from `answer` (the outcome and who gave it), or from
    /// the failure policy when the store failed; `sent_at` is when the check went to the store.
    /// A denial by the store is remembered in the deny cache.
    pub(super) fn verdict(
        &self,
        answer: Result<(RateOutcome, DecisionSource), StoreError>,
        tier: Arc<Tier>,
        check: RateCheck,
        sent_at: Instant,
    ) -> Verdict {
        let (outcome, source) = match answer {
            Ok(answer) => answer,
            Err(error) => self.on_store_failure(&error, &tier, check),
        };
        let verdict = Verdict::new(outcome, source, tier, check);
        if let Some(cache) = &self.deny_cache
            && !verdict.admitted
            && verdict.source == DecisionSource::Store
        {
            cache.remember(&verdict, sent_at);
        }
        verdict
    }

    /// The outcome the failure policy gives when the store failed to check `tier`, and who
    /// gave it.
    fn on_store_failure(
        &self,
        error: &StoreError,
        tier: &Tier,
        check: RateCheck,
    ) -> (RateOutcome, DecisionSource) {
        let key = check.key();
        if self.last_warning.ready() {
            tracing::warn!(
                target: "tollgate::rate_limit",
                %error, %key, policy = ?self.on_store_error,
                "rate-limit store failed; applying the failure policy (logged at most once a second)"
            );
        } else {
            tracing::debug!(
                target: "tollgate::rate_limit",
                %error, %key, policy = ?self.on_store_error,
                "rate-limit store failed; applying the failure policy"
            );
        }
        // a queue that waits for the store: a denial, which the waiter waits out
        let waits = self
            .queue
            .as_ref()
            .is_some_and(super::queue::Queue::waits_for_store);
        if let Some(fallback) = tier.fallback.as_ref().filter(|_| !waits) {
            return (fallback.check(check), DecisionSource::LocalFallback);
        }
        let admitted = !waits && self.on_store_error != OnStoreError::Deny;
        let outcome = RateOutcome {
            admitted,
            retry_after: if admitted {
                Duration::ZERO
            } else {
                Duration::from_secs(1)
            },
            limits: Vec::new(),
            decided_at_us: None,
        };
        (outcome, DecisionSource::StoreUnavailable)
    }
}
