//! [`OnStoreError`]: what a layer does when its store fails — one policy for the rate-limit and
//! the concurrency-limit layers.

/// What a rate-limit or concurrency-limit layer does when its store fails or does not answer in
/// time.
///
/// With the `serde` feature it reads as `"allow"`, `"deny"` or
/// `{ "local_fallback": { "copies": n } }`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[cfg_attr(feature = "serde", derive(serde::Deserialize))]
#[cfg_attr(
    feature = "serde",
    serde(rename_all = "snake_case", deny_unknown_fields)
)]
#[non_exhaustive]
pub enum OnStoreError {
    /// Let the request through and log a warning: a rate limit marks its decision
    /// [`DecisionSource::StoreUnavailable`](crate::rate_limit::DecisionSource::StoreUnavailable),
    /// a concurrency limit lets it run without a permit. Availability over strictness: the
    /// default.
    #[default]
    Allow,
    /// Answer `503 Service Unavailable` with `Retry-After: 1` (gRPC: UNAVAILABLE).
    Deny,
    /// Limit in process while the store is out of reach, each limit divided by `copies` — the
    /// number of copies expected to share the load — so that together they stay near it: a rate
    /// limit's quotas, and a concurrency limit's permits per key (rounded up).
    LocalFallback {
        /// How many copies of the service share the traffic (at least 1).
        copies: u32,
    },
}
