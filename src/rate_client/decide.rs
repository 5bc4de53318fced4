//! How a store's answer — or its failure — becomes a [`RateLimitDecision`].

use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use super::decision::{DecisionSource, RateLimitDecision};
use super::settings::Settings;
use super::tiers::Tier;
use crate::key::Key;
use crate::policy::OnStoreError;
use crate::rate::{RateCheck, RateOutcome};
use crate::store::StoreError;

/// Turns the store's answer for `tier`, or its failure, into a decision, as `settings`' failure
/// policy says; `sent_at` is when the check went to the store.
pub(crate) fn decide(
    settings: &Settings,
    result: Result<RateOutcome, StoreError>,
    tier: Arc<Tier>,
    check: RateCheck,
    sent_at: Instant,
) -> RateLimitDecision {
    let (key, cost) = (check.key(), check.cost());
    let (outcome, source) = match result {
        // no store decided it: admitted from a slice this copy leased, after waiting for it
        Ok(outcome)
            if outcome.admitted && outcome.decided_at_us.is_none() && tier.leases.is_some() =>
        {
            (outcome, DecisionSource::Lease)
        }
        Ok(outcome) => (outcome, DecisionSource::Store),
        Err(error) => on_store_failure(settings, &error, &tier, check),
    };
    let decision = RateLimitDecision {
        admitted: outcome.admitted,
        shadow: settings.shadow,
        source,
        key,
        cost,
        retry_after: outcome.retry_after,
        tier,
        states: outcome.limits,
    };
    decision.report();
    if let Some(cache) = &settings.deny_cache
        && !decision.admitted
        && decision.source == DecisionSource::Store
    {
        cache.remember(&decision, sent_at);
    }
    decision
}

/// The decision of a request admitted from a slice `tier` leased on this copy.
pub(crate) fn leased(
    settings: &Settings,
    outcome: RateOutcome,
    tier: Arc<Tier>,
    key: Key,
    cost: u64,
) -> RateLimitDecision {
    let decision = RateLimitDecision {
        admitted: true,
        shadow: settings.shadow,
        source: DecisionSource::Lease,
        key,
        cost,
        retry_after: Duration::ZERO,
        tier,
        states: outcome.limits,
    };
    decision.report();
    decision
}

/// The outcome the failure policy gives when the store failed to check `tier`, and who
/// gave it.
fn on_store_failure(
    settings: &Settings,
    error: &StoreError,
    tier: &Tier,
    check: RateCheck,
) -> (RateOutcome, DecisionSource) {
    let key = check.key();
    if settings.last_warning.ready() {
        tracing::warn!(
            target: "tollgate::rate_limit",
            %error, %key, policy = ?settings.on_store_error,
            "rate-limit store failed; applying the failure policy (logged at most once a second)"
        );
    } else {
        tracing::debug!(
            target: "tollgate::rate_limit",
            %error, %key, policy = ?settings.on_store_error,
            "rate-limit store failed; applying the failure policy"
        );
    }
    if let Some(fallback) = &tier.fallback {
        return (fallback.check(check), DecisionSource::LocalFallback);
    }
    let admitted = settings.on_store_error != OnStoreError::Deny;
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
