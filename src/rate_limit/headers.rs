//! The IETF `RateLimit-Policy`, `RateLimit` and `Retry-After` headers
//! (draft-ietf-httpapi-ratelimit-headers; Structured Field Lists per RFC 9651).

use std::fmt::Write;
use std::time::Duration;

use bytes::BytesMut;
use http::{HeaderName, HeaderValue};

use crate::error::{ConfigError, ConfigErrorKind};
use crate::rate::{LimitState, RatePolicy};

pub(crate) const RATELIMIT: HeaderName = HeaderName::from_static("ratelimit");
pub(crate) const RATELIMIT_POLICY: HeaderName = HeaderName::from_static("ratelimit-policy");

/// Whole seconds, rounded up.
pub(crate) fn ceil_secs(d: Duration) -> u64 {
    d.as_secs() + u64::from(d.subsec_nanos() > 0)
}

/// `Retry-After`: whole seconds, rounded up, at least 1 — a client told 0 would retry at once.
pub(crate) fn retry_after(d: Duration) -> HeaderValue {
    HeaderValue::from(ceil_secs(d).max(1))
}

/// `"burst";q=10;w=1, "hourly";q=1000;w=3600`, one member per limit in configuration order.
pub(crate) fn policy(policy: &RatePolicy) -> Result<HeaderValue, ConfigError> {
    let mut out = String::new();
    for (i, limit) in policy.limits().iter().enumerate() {
        if i > 0 {
            out.push_str(", ");
        }
        // Names are validated to [A-Za-z0-9_.-], so they need no escaping inside an sf-string.
        let _ = write!(
            out,
            "\"{}\";q={};w={}",
            limit.name(),
            limit.quota(),
            ceil_secs(limit.window())
        );
    }
    HeaderValue::from_str(&out).map_err(|_| {
        ConfigError::new(
            ConfigErrorKind::Limit,
            "limits do not form a valid RateLimit-Policy header",
        )
    })
}

/// `"burst";r=0;t=1, "hourly";r=990;t=3412`: quota left and seconds until it grows again.
/// Written straight into the header's buffer: one allocation per response.
pub(crate) fn state(policy: &RatePolicy, states: &[LimitState]) -> Option<HeaderValue> {
    let names: usize = policy.limits().iter().map(|l| l.name().len()).sum();
    let mut out = BytesMut::with_capacity(names + 32 * states.len());
    for (i, (limit, state)) in policy.limits().iter().zip(states).enumerate() {
        if i > 0 {
            out.extend_from_slice(b", ");
        }
        let _ = write!(
            out,
            "\"{}\";r={};t={}",
            limit.name(),
            state.remaining,
            ceil_secs(state.reset)
        );
    }
    HeaderValue::from_maybe_shared(out.freeze()).ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rate::{Algorithm, Limit};

    #[test]
    fn retry_after_rounds_up_and_is_at_least_one() {
        assert_eq!(retry_after(Duration::ZERO), "1");
        assert_eq!(retry_after(Duration::from_millis(1)), "1");
        assert_eq!(retry_after(Duration::from_millis(1000)), "1");
        assert_eq!(retry_after(Duration::from_millis(1001)), "2");
        assert_eq!(retry_after(Duration::from_secs(3412)), "3412");
    }

    #[test]
    fn formats_as_the_draft_shows() {
        let p = RatePolicy::new(
            "t",
            Algorithm::SlidingLog,
            vec![
                Limit::per_second("burst", 10),
                Limit::per_hour("hourly", 1000),
            ],
        )
        .unwrap();
        assert_eq!(
            policy(&p).unwrap(),
            r#""burst";q=10;w=1, "hourly";q=1000;w=3600"#
        );
        let states = [
            LimitState {
                remaining: 0,
                reset: Duration::from_millis(300),
            },
            LimitState {
                remaining: 990,
                reset: Duration::from_secs(3412),
            },
        ];
        assert_eq!(
            state(&p, &states).unwrap(),
            r#""burst";r=0;t=1, "hourly";r=990;t=3412"#
        );
    }
}
