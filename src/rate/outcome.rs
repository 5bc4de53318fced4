//! What a rate check answers: [`RateOutcome`] and each limit's [`LimitState`].

use std::time::Duration;

/// One limit's state after a decision.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LimitState {
    /// Quota left after this decision (an admitted request is charged first; a denied one charges
    /// nothing).
    pub remaining: u64,
    /// Time until this limit's quota grows again; zero when nothing is in use.
    pub reset: Duration,
}

/// A store's answer to a rate check.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RateOutcome {
    /// Whether every limit had room; only then was the cost charged, to all of them.
    pub admitted: bool,
    /// For a denied request, the time until it could be admitted (zero when admitted). A cost
    /// larger than some limit's quota can never be admitted; the wait is then that window.
    pub retry_after: Duration,
    /// Per limit, in configuration order.
    pub limits: Vec<LimitState>,
    /// The store's clock when it decided, in microseconds since the Unix epoch; `None` where no
    /// store decided (the local fallback, the deny cache). What the reference model of the
    /// conformance suite (`conformance::model`, feature `conformance`) is evaluated at.
    pub decided_at_us: Option<u64>,
}
