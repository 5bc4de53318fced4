//! The rate client's answer to a check: [`Verdict`].

use std::sync::Arc;
use std::time::Duration;

use super::source::DecisionSource;
use super::tiers::Tier;
use crate::rate::{LimitState, RateCheck, RateOutcome};

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
    /// How long the request waited for room (see [`queue`](super::queue)).
    pub(crate) waited: Duration,
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
            waited: Duration::ZERO,
        }
    }
}
