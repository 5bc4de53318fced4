//! The in-process limiter behind [`OnStoreError::LocalFallback`](super::OnStoreError).

use std::sync::Arc;

use http::HeaderValue;

use super::headers;
use crate::error::ConfigError;
use crate::rate::{Clock, LocalRates, RateCheck, RateOutcome, RatePolicy};

/// Limits in process while the store is out of reach: the layer's limits, each quota divided by
/// the number of copies, decided by the same algorithms as the store's.
#[derive(Debug)]
pub(crate) struct Fallback {
    rates: LocalRates,
    /// The divided quotas.
    policy: Arc<RatePolicy>,
    /// Their `RateLimit-Policy`: a fallback decision's headers show the share it enforced.
    policy_header: HeaderValue,
}

impl Fallback {
    /// A fallback for `policy` shared by `copies` copies (at least 1).
    pub(crate) fn new(policy: &RatePolicy, copies: u32) -> Result<Self, ConfigError> {
        let divided = policy.divided(copies);
        Ok(Self {
            rates: LocalRates::new(Clock::new()),
            policy_header: headers::policy(&divided)?,
            policy: Arc::new(divided),
        })
    }

    /// Decides `check` against the divided quotas.
    pub(crate) fn check(&self, check: RateCheck) -> RateOutcome {
        self.rates.check(&self.policy, check)
    }

    pub(crate) fn policy(&self) -> &Arc<RatePolicy> {
        &self.policy
    }

    pub(crate) fn policy_header(&self) -> &HeaderValue {
        &self.policy_header
    }
}
