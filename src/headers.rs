//! The IETF `RateLimit-Policy`, `RateLimit` and `Retry-After` headers
//! (draft-ietf-httpapi-ratelimit-headers; Structured Field Lists per RFC 9651).

use std::fmt::Write;

use bytes::BytesMut;
use http::{HeaderName, HeaderValue};

use crate::error::{ConfigError, ConfigErrorKind};
use crate::key::{BASE64, Key, write_base64};
use crate::rate::{LimitState, RatePolicy};

pub(crate) const RATELIMIT: HeaderName = HeaderName::from_static("ratelimit");
pub(crate) const RATELIMIT_POLICY: HeaderName = HeaderName::from_static("ratelimit-policy");

pub(crate) use crate::rejection::{ceil_secs, retry_after};

/// What a quota counts, the `qu` parameter of `RateLimit-Policy`
/// (draft-ietf-httpapi-ratelimit-headers).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum QuotaUnit {
    /// Requests (`qu="requests"`), the draft's default: a request costs 1, or what the cost
    /// closure says in requests.
    #[default]
    Request,
    /// Bytes of content (`qu="content-bytes"`): the cost closure gives a request's size.
    ContentBytes,
    /// Requests in flight at once (`qu="concurrent-requests"`): what the concurrency limit
    /// advertises.
    ConcurrentRequests,
}

impl QuotaUnit {
    pub(crate) fn token(self) -> &'static str {
        match self {
            Self::Request => "requests",
            Self::ContentBytes => "content-bytes",
            Self::ConcurrentRequests => "concurrent-requests",
        }
    }
}

/// `"burst";q=10;w=1, "hourly";q=1000;w=3600`, one member per limit in configuration order;
/// with `unit`, each member says it: `"burst";q=10;qu="content-bytes";w=1` (a limit that
/// counts calls, `qu="requests"`).
pub(crate) fn policy(
    policy: &RatePolicy,
    unit: Option<QuotaUnit>,
) -> Result<HeaderValue, ConfigError> {
    let mut out = String::new();
    for (i, limit) in policy.limits().iter().enumerate() {
        if i > 0 {
            out.push_str(", ");
        }
        // Names are validated to [A-Za-z0-9_.-], so they need no escaping inside an sf-string.
        let _ = write!(out, "\"{}\";q={}", limit.name(), limit.quota());
        if let Some(unit) = unit {
            // a limit that counts calls counts requests, whatever the others count
            let unit = if limit.counts_calls() {
                QuotaUnit::Request
            } else {
                unit
            };
            let _ = write!(out, ";qu=\"{}\"", unit.token());
        }
        let _ = write!(out, ";w={}", ceil_secs(limit.window()));
    }
    HeaderValue::from_str(&out).map_err(|_| {
        ConfigError::new(
            ConfigErrorKind::Limit,
            "limits do not form a valid RateLimit-Policy header",
        )
    })
}

/// `"burst";r=0;t=1, "hourly";r=990;t=3412`: quota left and seconds until it grows again; with
/// a partition key, each member carries it: `"burst";r=0;t=1;pk=:q83vEjRWeJq8:`. Written
/// straight into the header's buffer: one allocation per response.
pub(crate) fn state(
    policy: &RatePolicy,
    states: &[LimitState],
    partition: Option<Key>,
) -> Option<HeaderValue> {
    let names: usize = policy.limits().iter().map(|l| l.name().len()).sum();
    let mut out = BytesMut::with_capacity(names + 48 * states.len());
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
        if let Some(key) = partition {
            out.extend_from_slice(b";pk=:");
            out.extend_from_slice(partition_key(key).as_bytes());
            out.extend_from_slice(b":");
        }
    }
    HeaderValue::from_maybe_shared(out.freeze()).ok()
}

/// The `pk` of caller `key`: the first 9 bytes of its digest (itself a one-way hash of what the
/// caller sent) in base64, 12 characters of a Structured Field Byte Sequence. It tells a
/// client's partitions apart without naming them.
fn partition_key(key: Key) -> String {
    let mut out = String::with_capacity(12);
    write_base64(&key.as_bytes()[..9], BASE64, &mut out);
    out
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

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
            policy(&p, None).unwrap(),
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
            state(&p, &states, None).unwrap(),
            r#""burst";r=0;t=1, "hourly";r=990;t=3412"#
        );
        assert_eq!(
            policy(&p, Some(QuotaUnit::ContentBytes)).unwrap(),
            r#""burst";q=10;qu="content-bytes";w=1, "hourly";q=1000;qu="content-bytes";w=3600"#
        );
        let key = Key::new("t", b"alice");
        let pk = partition_key(key);
        assert_eq!(pk.len(), 12);
        assert!(!pk.contains("alice"));
        assert_eq!(
            state(&p, &states[..1], Some(key)).unwrap(),
            format!(r#""burst";r=0;t=1;pk=:{pk}:"#).as_str()
        );
    }
}
