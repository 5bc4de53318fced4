//! The policies for a failing store and a missing key.

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

pub use crate::key::MissingKey;
