//! Where an answer of the rate client came from: [`DecisionSource`].

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
