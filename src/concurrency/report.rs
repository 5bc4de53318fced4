//! What the concurrency-limit layer tells of each decision: the metrics count it, and the traces
//! get one event, target `tollgate::concurrency`, at `DEBUG`, with `tollgate.*` fields.

use std::sync::Arc;

use crate::key::Key;

/// How a request fared at the concurrency limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Outcome {
    /// It holds a permit.
    Acquired,
    /// It found every permit taken and waits in the key's queue (not counted: it ends
    /// acquired or refused).
    Queued,
    /// It was turned away.
    Refused,
}

impl Outcome {
    fn as_str(self) -> &'static str {
        match self {
            Self::Acquired => "acquired",
            Self::Queued => "queued",
            Self::Refused => "refused",
        }
    }
}

/// Reports that the request of `key` under `limit` permits was `outcome` by `source` (`store`,
/// `local_fallback` or `store_unavailable`), for `limiter`.
pub(super) fn report(
    limiter: &Arc<str>,
    key: Key,
    limit: u32,
    outcome: Outcome,
    source: &'static str,
) {
    if outcome != Outcome::Queued {
        crate::metrics::concurrency_decision(limiter, outcome == Outcome::Acquired, source);
    }
    tracing::event!(
        target: "tollgate::concurrency",
        tracing::Level::DEBUG,
        tollgate.outcome = outcome.as_str(),
        tollgate.source = source,
        tollgate.limiter = &**limiter,
        tollgate.key = %key,
        tollgate.limit = limit,
        "concurrency-limit decision"
    );
}
