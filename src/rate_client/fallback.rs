//! The in-process limiter behind [`OnStoreError::LocalFallback`](crate::on_error::OnStoreError).

use std::sync::Arc;
use std::time::Duration;

use http::HeaderValue;

use crate::error::{ConfigError, ConfigErrorKind};
use crate::headers::{self, QuotaUnit};
use crate::pace::OncePerSecond;
use crate::rate::{Clock, LocalRates, RateCheck, RateOutcome, RatePolicy};

/// How many callers a fallback holds unless configured otherwise.
pub(crate) const DEFAULT_CAPACITY: usize = 65_536;

/// Limits in process while the store is out of reach: the layer's limits, each quota divided by
/// the number of copies, decided by the same algorithms as the store's.
///
/// It holds at most `capacity` callers; while that many are live, a new caller is denied (or,
/// if so configured, admitted without being counted) — never given room by evicting a caller,
/// which would hand that caller a fresh quota.
#[derive(Debug)]
pub(crate) struct Fallback {
    rates: LocalRates,
    /// The divided quotas.
    policy: Arc<RatePolicy>,
    /// Their `RateLimit-Policy`: a fallback decision's headers show the share it enforced.
    policy_header: HeaderValue,
    /// Whether a new caller is admitted, uncounted, while the fallback is full.
    admit_when_full: bool,
    /// A full fallback is logged at warn at most once a second: a flood must not flood the log.
    full_warning: OncePerSecond,
}

impl Fallback {
    /// A fallback for `policy` shared by `copies` copies (at least 1), holding at most `capacity`
    /// callers (at least 1).
    pub(crate) fn new(
        policy: &RatePolicy,
        copies: u32,
        capacity: usize,
        admit_when_full: bool,
        unit: Option<QuotaUnit>,
    ) -> Result<Self, ConfigError> {
        if capacity == 0 {
            return Err(ConfigError::new(
                ConfigErrorKind::FailurePolicy,
                "the local fallback needs a capacity >= 1",
            ));
        }
        let divided = policy.divided(copies);
        Ok(Self {
            rates: LocalRates::new(Clock::new(), capacity),
            policy_header: headers::policy(&divided, unit)?,
            policy: Arc::new(divided),
            admit_when_full,
            full_warning: OncePerSecond::new(),
        })
    }

    /// Decides `check` against the divided quotas. A new caller of a full fallback gets an
    /// outcome without limit states: denied with a `retry_after` of 1 s, or admitted uncounted.
    pub(crate) fn check(&self, check: RateCheck) -> RateOutcome {
        match self.rates.check(&self.policy, check) {
            // decided in this process: no store's clock
            Ok(outcome) => RateOutcome {
                decided_at_us: None,
                ..outcome
            },
            Err(_full) => self.when_full(check),
        }
    }

    fn when_full(&self, check: RateCheck) -> RateOutcome {
        if self.full_warning.ready() {
            tracing::warn!(
                target: "tollgate::rate_limit",
                key = %check.key(), admitted = self.admit_when_full,
                "local rate-limit fallback full: new callers are not tracked (logged at most once a second)"
            );
        }
        RateOutcome {
            admitted: self.admit_when_full,
            retry_after: if self.admit_when_full {
                Duration::ZERO
            } else {
                Duration::from_secs(1)
            },
            limits: Vec::new(),
            decided_at_us: None,
        }
    }

    pub(crate) fn policy(&self) -> &Arc<RatePolicy> {
        &self.policy
    }

    pub(crate) fn policy_header(&self) -> &HeaderValue {
        &self.policy_header
    }
}
