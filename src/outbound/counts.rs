//! [`ProviderCounts`]: how a provider's own counts — `RateLimit`, `x-ratelimit-*` — are read
//! from its answers.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use http::HeaderMap;
use http::header::HeaderName;

/// How an [`OutboundLimitLayer`](super::OutboundLimitLayer) reads the counts a provider sends
/// on its answers (set with [`provider_counts`](super::OutboundLimitLayer::provider_counts); on
/// by default):
///
/// - a **remaining count of 0** pauses the calls of that key until the count's reset, as a
///   `429`'s `Retry-After` does (the same [`Pause`](super::Pause) caps: at most 5 minutes; 1 s
///   when the reset is missing or unusable), on every copy with
///   [`share_pauses`](super::OutboundLimitLayer::share_pauses);
/// - a **positive remaining count lower than the store's** charges the difference to the
///   key's limits, so that a provider that lowers its limit is followed within a round trip
///   (one correction of a key at a time: on a copy, and across copies that share their pauses);
///   not in a tier with a limit that [counts calls](crate::rate::Limit::counting_calls), whose
///   units differ and which no settlement changes.
///
/// By default it reads, from the first that gives a remaining count:
///
/// | header | example | reset read as |
/// | --- | --- | --- |
/// | `RateLimit` (IETF draft, structured) | `"default";r=0;t=30` (several items: the one with the least `r`) | seconds |
/// | `RateLimit` (earlier draft) | `limit=100, remaining=0, reset=30` | seconds |
/// | `RateLimit-Remaining` + `RateLimit-Reset` | `0`, `30` | seconds |
/// | `x-ratelimit-remaining-requests` + `x-ratelimit-reset-requests` | `0`, `6m0s` | see below |
/// | `x-ratelimit-remaining` + `x-ratelimit-reset` | `0`, `1767225600` | see below |
///
/// What the provider sends may be wrong, and is never trusted further than this:
///
/// | value | taken as |
/// | --- | --- |
/// | remaining: digits | that count (more than a `u64` holds: the most a `u64` holds, which corrects nothing) |
/// | remaining: missing, negative, fractional, unparsable | nothing: the next header is read |
/// | reset: seconds (`30`, `1.5`) | that long |
/// | reset: a duration (`1s`, `6m0s`, `1h2m3.5s`, `20ms`) | that long |
/// | reset: a Unix time in seconds (≥ 10⁹) or milliseconds (≥ 10¹²), or an HTTP date | the time until then; none when past |
/// | reset: missing, negative, unparsable, past | none (a pause then lasts [`Pause::without_retry_after`](super::Pause::without_retry_after)) |
/// | reset: longer than [`Pause::longest`](super::Pause::longest) | `longest` |
///
/// ```
/// use std::time::Duration;
/// use http::HeaderMap;
/// use tollgate::outbound::ProviderCounts;
///
/// let counts = ProviderCounts::default();
/// let mut headers = HeaderMap::new();
/// headers.insert("x-ratelimit-remaining-requests", "0".parse().unwrap());
/// headers.insert("x-ratelimit-reset-requests", "6m0s".parse().unwrap());
/// let count = counts.read(&headers).unwrap();
/// assert_eq!((count.remaining, count.reset), (0, Some(Duration::from_secs(360))));
///
/// let mut headers = HeaderMap::new();
/// headers.insert("ratelimit", r#""minute";r=12;t=30, "day";r=900;t=3600"#.parse().unwrap());
/// let count = counts.read(&headers).unwrap();
/// assert_eq!((count.remaining, count.reset), (12, Some(Duration::from_secs(30))));
///
/// headers.insert("ratelimit", "r=-1".parse().unwrap());
/// assert_eq!(counts.read(&headers), None, "a negative count is no count");
/// assert_eq!(ProviderCounts::off().read(&headers), None);
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProviderCounts {
    /// Whether the `RateLimit` headers are read.
    standard: bool,
    /// The pairs of remaining and reset headers read, in order.
    pairs: Vec<(HeaderName, HeaderName)>,
}

impl Default for ProviderCounts {
    fn default() -> Self {
        Self {
            standard: true,
            pairs: vec![
                (
                    HeaderName::from_static("x-ratelimit-remaining-requests"),
                    HeaderName::from_static("x-ratelimit-reset-requests"),
                ),
                (
                    HeaderName::from_static("x-ratelimit-remaining"),
                    HeaderName::from_static("x-ratelimit-reset"),
                ),
            ],
        }
    }
}

/// A provider's count of a key, as its answer reported it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ProviderCount {
    /// What the provider says is left.
    pub remaining: u64,
    /// When its count grows again, from now; `None` when it did not say in a usable way.
    pub reset: Option<Duration>,
}

impl ProviderCounts {
    /// Reads no count: only `429` and `503` answers pause calls.
    pub fn off() -> Self {
        Self {
            standard: false,
            pairs: Vec::new(),
        }
    }

    /// Reads only `remaining` and `reset` (say `x-ratelimit-remaining-tokens` and
    /// `x-ratelimit-reset-tokens` for a layer that counts tokens): for a provider whose other
    /// counts are not those of this layer's limits.
    pub fn only(remaining: HeaderName, reset: HeaderName) -> Self {
        Self {
            standard: false,
            pairs: vec![(remaining, reset)],
        }
    }

    /// The count an answer with `headers` reports, if it reports one this reads.
    pub fn read(&self, headers: &HeaderMap) -> Option<ProviderCount> {
        if self.standard
            && let Some(count) = standard(headers)
        {
            return Some(count);
        }
        self.pairs.iter().find_map(|(remaining, reset)| {
            let remaining = text(headers, remaining).and_then(count)?;
            let reset = text(headers, reset).and_then(reset_in);
            Some(ProviderCount { remaining, reset })
        })
    }
}

/// The first value of header `name`, as text.
fn text<'h>(headers: &'h HeaderMap, name: &HeaderName) -> Option<&'h str> {
    headers.get(name)?.to_str().ok()
}

/// The IETF draft's headers: `RateLimit` (structured, or the earlier `remaining=`, `reset=`
/// list), or `RateLimit-Remaining` and `RateLimit-Reset`.
fn standard(headers: &HeaderMap) -> Option<ProviderCount> {
    if let Some(value) = headers.get("ratelimit").and_then(|v| v.to_str().ok())
        && let Some(count) = ratelimit_field(value)
    {
        return Some(count);
    }
    let remaining = headers
        .get("ratelimit-remaining")
        .and_then(|v| v.to_str().ok())
        .and_then(count)?;
    let reset = headers
        .get("ratelimit-reset")
        .and_then(|v| v.to_str().ok())
        .and_then(seconds);
    Some(ProviderCount { remaining, reset })
}

/// A `RateLimit` field: its items' `r` and `t` (the item with the least `r`, and of those the
/// latest reset), or the earlier draft's `remaining` and `reset` parameters.
fn ratelimit_field(value: &str) -> Option<ProviderCount> {
    let mut least: Option<ProviderCount> = None;
    let (mut remaining, mut reset) = (None, None);
    for item in value.split(',') {
        let (mut r, mut t) = (None, None);
        for param in item.split(';') {
            let Some((name, value)) = param.split_once('=') else {
                continue;
            };
            let value = value.trim().trim_matches('"');
            match name.trim().to_ascii_lowercase().as_str() {
                "r" => r = count(value),
                "t" => t = seconds(value),
                "remaining" => remaining = count(value),
                "reset" => reset = seconds(value),
                _ => {}
            }
        }
        if let Some(r) = r {
            let item = ProviderCount {
                remaining: r,
                reset: t,
            };
            least = Some(match least {
                Some(kept) if (kept.remaining, item.reset) <= (item.remaining, kept.reset) => kept,
                _ => item,
            });
        }
    }
    least.or_else(|| remaining.map(|remaining| ProviderCount { remaining, reset }))
}

/// A remaining count: digits only (as many as they come: more than a `u64` holds is the
/// most it holds).
fn count(value: &str) -> Option<u64> {
    let value = value.trim();
    if value.is_empty() || !value.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    Some(value.parse().unwrap_or(u64::MAX))
}

/// A delta in seconds, whole or decimal (`30`, `1.5`); none when negative or unparsable.
fn seconds(value: &str) -> Option<Duration> {
    let value = value.trim();
    let digits = |part: &str| !part.is_empty() && part.bytes().all(|b| b.is_ascii_digit());
    let well_formed = match value.split_once('.') {
        Some((whole, fraction)) => digits(whole) && digits(fraction),
        None => digits(value),
    };
    if !well_formed {
        return None;
    }
    let secs: f64 = value.parse().ok()?;
    // more than a Duration holds (hundreds of digits): the longest, capped by the pause
    Some(Duration::try_from_secs_f64(secs).unwrap_or(Duration::MAX))
}

/// An `x-ratelimit-reset`: seconds, a Unix time in seconds or milliseconds, a duration
/// (`6m0s`), or an HTTP date; as the time from now.
fn reset_in(value: &str) -> Option<Duration> {
    let value = value.trim();
    if let Some(secs) = seconds(value) {
        return from_epoch_or_delta(secs);
    }
    if let Some(duration) = go_duration(value) {
        return Some(duration);
    }
    let at = httpdate::parse_http_date(value).ok()?;
    at.duration_since(SystemTime::now()).ok()
}

/// Seconds that name a Unix time — in seconds from 10⁹ (2001), in milliseconds from 10¹² —
/// as the time from now until then (none when past); other seconds as they are.
fn from_epoch_or_delta(secs: Duration) -> Option<Duration> {
    const EPOCH_SECONDS: u64 = 1_000_000_000;
    const EPOCH_MILLIS: u64 = 1_000_000_000_000;
    let at = match secs.as_secs() {
        s if s >= EPOCH_MILLIS => secs / 1_000,
        s if s >= EPOCH_SECONDS => secs,
        _ => return Some(secs),
    };
    let now = SystemTime::now().duration_since(UNIX_EPOCH).ok()?;
    at.checked_sub(now).filter(|left| !left.is_zero())
}

/// A duration as Go writes it: numbers with units, `h`, `m`, `s`, `ms`, `us` (`µs`), `ns`
/// (`1h2m3.5s`, `6m0s`, `20ms`).
fn go_duration(value: &str) -> Option<Duration> {
    let mut rest = value;
    let mut total = Duration::ZERO;
    if rest.is_empty() {
        return None;
    }
    while !rest.is_empty() {
        let number_len = rest
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .unwrap_or(rest.len());
        let number = seconds(&rest[..number_len])?;
        rest = &rest[number_len..];
        let unit_len = rest
            .find(|c: char| c.is_ascii_digit() || c == '.')
            .unwrap_or(rest.len());
        let scale = match &rest[..unit_len] {
            "h" => 3_600.0,
            "m" => 60.0,
            "s" => 1.0,
            "ms" => 1e-3,
            "us" | "µs" => 1e-6,
            "ns" => 1e-9,
            _ => return None,
        };
        rest = &rest[unit_len..];
        let part = Duration::try_from_secs_f64(number.as_secs_f64() * scale).ok()?;
        total = total.saturating_add(part);
    }
    Some(total)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    fn headers(pairs: &[(&'static str, &str)]) -> HeaderMap {
        let mut headers = HeaderMap::new();
        for (name, value) in pairs {
            headers.append(*name, value.parse().unwrap());
        }
        headers
    }

    fn read(pairs: &[(&'static str, &str)]) -> Option<(u64, Option<Duration>)> {
        ProviderCounts::default()
            .read(&headers(pairs))
            .map(|c| (c.remaining, c.reset))
    }

    const S: fn(u64) -> Option<Duration> = |s| Some(Duration::from_secs(s));

    #[test]
    fn the_ietf_structured_field() {
        assert_eq!(
            read(&[("ratelimit", r#""default";r=0;t=30"#)]),
            Some((0, S(30)))
        );
        assert_eq!(read(&[("ratelimit", "default;r=5;t=1")]), Some((5, S(1))));
        // several items: the least remaining; of equals, the latest reset
        let two = r#""a";r=50;t=1, "b";r=3;t=60, "c";r=3;t=90"#;
        assert_eq!(read(&[("ratelimit", two)]), Some((3, S(90))));
        // no t: a count without a reset
        assert_eq!(read(&[("ratelimit", r#""a";r=0"#)]), Some((0, None)));
        // an unusable t: the count still stands
        assert_eq!(read(&[("ratelimit", r#""a";r=0;t=-5"#)]), Some((0, None)));
        assert_eq!(read(&[("ratelimit", r#""a";r=0;t=soon"#)]), Some((0, None)));
    }

    #[test]
    fn the_earlier_drafts() {
        let combined = "limit=100, remaining=0, reset=30";
        assert_eq!(read(&[("ratelimit", combined)]), Some((0, S(30))));
        let split = [("ratelimit-remaining", "7"), ("ratelimit-reset", "12")];
        assert_eq!(read(&split), Some((7, S(12))));
        assert_eq!(read(&[("ratelimit-remaining", "7")]), Some((7, None)));
    }

    #[test]
    fn openai_style_durations() {
        let at = |reset| {
            read(&[
                ("x-ratelimit-remaining-requests", "0"),
                ("x-ratelimit-reset-requests", reset),
            ])
        };
        assert_eq!(at("1s"), Some((0, S(1))));
        assert_eq!(at("6m0s"), Some((0, S(360))));
        assert_eq!(at("20ms"), Some((0, Some(Duration::from_millis(20)))));
        assert_eq!(
            at("1h2m3.5s"),
            Some((0, Some(Duration::from_millis(3_723_500))))
        );
        assert_eq!(at("250us"), Some((0, Some(Duration::from_micros(250)))));
        assert_eq!(at("1.5"), Some((0, Some(Duration::from_millis(1_500)))));
        for odd in ["", "s", "1x", "1s2", "-1s", "1..5s", "m1", "1 s", "∞"] {
            assert_eq!(at(odd), Some((0, None)), "{odd:?}");
        }
    }

    #[test]
    fn plain_seconds_and_unix_times() {
        let at =
            |reset: &str| read(&[("x-ratelimit-remaining", "0"), ("x-ratelimit-reset", reset)]);
        assert_eq!(at("30"), Some((0, S(30))));
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap()
            .as_secs();
        let (_, in_secs) = at(&(now + 60).to_string()).unwrap();
        assert!(in_secs.unwrap() > Duration::from_secs(58), "{in_secs:?}");
        assert!(in_secs.unwrap() <= Duration::from_secs(60), "{in_secs:?}");
        let (_, in_millis) = at(&((now + 60) * 1_000).to_string()).unwrap();
        assert!(
            in_millis.unwrap() > Duration::from_secs(58),
            "{in_millis:?}"
        );
        assert!(
            in_millis.unwrap() <= Duration::from_secs(60),
            "{in_millis:?}"
        );
        // a time past: no usable reset
        assert_eq!(at(&(now - 60).to_string()), Some((0, None)));
        let date = httpdate::fmt_http_date(SystemTime::now() + Duration::from_secs(120));
        let (_, by_date) = at(&date).unwrap();
        assert!(by_date.unwrap() > Duration::from_secs(110), "{by_date:?}");
        assert_eq!(at("Sun, 06 Nov 1994 08:49:37 GMT"), Some((0, None)));
        // as many digits as they come: centuries away (the pause caps it)
        let (_, far) = at(&"9".repeat(400)).unwrap();
        assert!(
            far.unwrap() > Duration::from_secs(100 * 365 * 86_400),
            "{far:?}"
        );
        let (_, far) = read(&[("ratelimit", &format!("r=0;t={}", "9".repeat(400)))]).unwrap();
        assert_eq!(far, Some(Duration::MAX));
        for odd in ["-30", "NaN", "inf", "1e9", "0x10", "thirty", ""] {
            assert_eq!(at(odd), Some((0, None)), "{odd:?}");
        }
    }

    #[test]
    fn odd_remaining_counts_are_no_counts() {
        for odd in ["-1", "1.5", "five", "", " ", "0x0", "+3", "1,2"] {
            let pairs = [("x-ratelimit-remaining", odd), ("x-ratelimit-reset", "1")];
            assert_eq!(read(&pairs), None, "{odd:?}");
            if odd.contains(',') {
                continue;
            }
            assert_eq!(
                read(&[("ratelimit", &format!("\"a\";r={odd};t=1"))]),
                None,
                "{odd:?}"
            );
        }
        let huge = "9".repeat(40);
        assert_eq!(
            read(&[("x-ratelimit-remaining", &huge)]),
            Some((u64::MAX, None))
        );
        assert_eq!(read(&[("x-ratelimit-remaining", " 4 ")]), Some((4, None)));
        // not UTF-8 text
        let mut bytes = HeaderMap::new();
        bytes.insert(
            "x-ratelimit-remaining",
            http::HeaderValue::from_bytes(b"\xff").unwrap(),
        );
        assert_eq!(ProviderCounts::default().read(&bytes), None);
    }

    #[test]
    fn which_header_is_read() {
        // the IETF field first, then the request counts, then the plain ones
        let all = [
            ("x-ratelimit-remaining", "1"),
            ("x-ratelimit-remaining-requests", "2"),
            ("ratelimit", "\"a\";r=3"),
        ];
        assert_eq!(read(&all), Some((3, None)));
        assert_eq!(read(&all[..2]), Some((2, None)));
        // an unusable field gives way to the next
        let odd = [("ratelimit", "\"a\";r=x"), ("x-ratelimit-remaining", "1")];
        assert_eq!(read(&odd), Some((1, None)));
        let tokens = ProviderCounts::only(
            HeaderName::from_static("x-ratelimit-remaining-tokens"),
            HeaderName::from_static("x-ratelimit-reset-tokens"),
        );
        let pairs = headers(&[
            ("ratelimit", "\"a\";r=0;t=9"),
            ("x-ratelimit-remaining-tokens", "500"),
            ("x-ratelimit-reset-tokens", "2s"),
        ]);
        let count = tokens.read(&pairs).unwrap();
        assert_eq!((count.remaining, count.reset), (500, S(2)));
        assert_eq!(ProviderCounts::off().read(&pairs), None);
        assert_eq!(read(&[]), None);
    }
}
