//! Where an answer came from ([`DecisionSource`]), and the answer itself ([`Verdict`]).

use std::sync::Arc;
use std::time::Duration;

use super::tiers::Tier;
use crate::rate::{LimitState, RateCheck, RateOutcome};

/// Where a [`RateLimitDecision`](crate::rate_limit::RateLimitDecision) came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum DecisionSource {
    /// The shared store decided.
    Store,
    /// The store failed; [`OnStoreError::Allow`](crate::rate_limit::OnStoreError::Allow) or
    /// [`OnStoreError::Deny`](crate::rate_limit::OnStoreError::Deny) decided.
    StoreUnavailable,
    /// The store failed; the in-process fallback limiter decided.
    LocalFallback,
    /// The store denied this caller moments ago, until a time not yet reached: denied again
    /// without a round trip (see
    /// [`RateLimitLayerBuilder::deny_cache`](crate::rate_limit::RateLimitLayerBuilder::deny_cache)).
    DenyCache,
    /// Admitted from a slice of the caller's quota that this copy leased from the store (see
    /// [`Limit::leased`](crate::rate::Limit::leased)), without a round trip.
    Lease,
}

impl DecisionSource {
    /// The `source` label of the decisions counter.
    pub(crate) fn label(self) -> &'static str {
        match self {
            Self::Store => "store",
            Self::StoreUnavailable => "store_unavailable",
            Self::LocalFallback => "local_fallback",
            Self::DenyCache => "deny_cache",
            Self::Lease => "lease",
        }
    }
}

/// The rate client's answer to a check: what was decided, by whom, under which tier.
#[derive(Debug, Clone)]
pub(crate) struct Verdict {
    pub(crate) admitted: bool,
    pub(crate) source: DecisionSource,
    /// The check answered: its caller, cost and attempt (what a settlement settles).
    pub(crate) check: RateCheck,
    pub(crate) retry_after: Duration,
    /// The tier whose limits decided (their fallback shares for a fallback answer).
    pub(crate) tier: Arc<Tier>,
    /// Per limit of the tier's policy; empty when the store did not answer.
    pub(crate) states: Vec<LimitState>,
}

impl Verdict {
    /// The answer `outcome` to `check` under `tier`, given by `source`.
    pub(crate) fn new(
        outcome: RateOutcome,
        source: DecisionSource,
        tier: Arc<Tier>,
        check: RateCheck,
    ) -> Self {
        Self {
            admitted: outcome.admitted,
            source,
            check,
            retry_after: outcome.retry_after,
            tier,
            states: outcome.limits,
        }
    }
}
