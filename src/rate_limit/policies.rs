//! The policies for a failing store and a missing key, and the pace of their warnings.

/// What a rate-limit layer does when its store fails or does not answer in time.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[cfg_attr(feature = "serde", derive(serde::Deserialize))]
#[cfg_attr(
    feature = "serde",
    serde(rename_all = "snake_case", deny_unknown_fields)
)]
#[non_exhaustive]
pub enum OnStoreError {
    /// Let the request through, log a warning, and mark the decision
    /// [`DecisionSource::StoreUnavailable`](super::DecisionSource::StoreUnavailable). Availability over strictness: the default.
    #[default]
    Allow,
    /// Answer `503 Service Unavailable` with `Retry-After: 1` (gRPC: UNAVAILABLE).
    Deny,
    /// Limit in process while the store is out of reach, each quota divided by `copies` — the
    /// number of copies expected to share the load — so that together they stay near the limit.
    LocalFallback {
        /// How many copies of the service share the traffic (at least 1).
        copies: u32,
    },
}

/// What a rate-limit layer does with a request whose key cannot be extracted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum MissingKey {
    /// Answer `400 Bad Request` with a short body naming the problem (gRPC: INVALID_ARGUMENT).
    #[default]
    Reject,
    /// Let the request through unlimited.
    Allow,
}

/// Lets one event through per second.
#[derive(Debug)]
pub(crate) struct OncePerSecond {
    start: std::time::Instant,
    last: std::sync::atomic::AtomicU64,
}

impl OncePerSecond {
    pub(crate) fn new() -> Self {
        Self {
            start: std::time::Instant::now(),
            last: std::sync::atomic::AtomicU64::new(0),
        }
    }

    /// Whether a second has passed since the last event let through.
    pub(crate) fn ready(&self) -> bool {
        use std::sync::atomic::Ordering;
        // +1: the first call is let through at once
        let now = self.start.elapsed().as_secs() + 1;
        let last = self.last.load(Ordering::Relaxed);
        now > last
            && self
                .last
                .compare_exchange(last, now, Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
    }
}
