//! What is limited: [`Limit`], [`Algorithm`], and the validated [`RatePolicy`] a store checks.

use std::fmt;
use std::time::Duration;

use crate::error::{ConfigError, check_prefix};
use crate::key::Key;

/// One named quota: at most `quota` cost per `window`.
///
/// The name shows in the `RateLimit` / `RateLimit-Policy` headers and in store keys, so it is
/// restricted to ASCII letters, digits, `-`, `_` and `.` (checked when the layer is built).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Limit {
    name: String,
    quota: u64,
    window: Duration,
}

impl Limit {
    /// `quota` per `window`, e.g. `Limit::new("burst", 10, Duration::from_secs(1))`.
    pub fn new(name: impl Into<String>, quota: u64, window: Duration) -> Self {
        Self {
            name: name.into(),
            quota,
            window,
        }
    }

    /// `quota` per second.
    pub fn per_second(name: impl Into<String>, quota: u64) -> Self {
        Self::new(name, quota, Duration::from_secs(1))
    }

    /// `quota` per minute.
    pub fn per_minute(name: impl Into<String>, quota: u64) -> Self {
        Self::new(name, quota, Duration::from_secs(60))
    }

    /// `quota` per hour.
    pub fn per_hour(name: impl Into<String>, quota: u64) -> Self {
        Self::new(name, quota, Duration::from_secs(3600))
    }

    /// The name in headers and keys.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The cost admitted per window.
    pub fn quota(&self) -> u64 {
        self.quota
    }

    /// The window.
    pub fn window(&self) -> Duration {
        self.window
    }

    pub(crate) fn window_us(&self) -> u64 {
        u64::try_from(self.window.as_micros()).unwrap_or(u64::MAX)
    }
}

/// The largest quota of a [`Algorithm::SlidingLog`] limit.
pub const MAX_LOG_QUOTA: u64 = 100_000;

/// How a limit counts. Every algorithm is checked atomically in the store with the store's clock.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
#[non_exhaustive]
pub enum Algorithm {
    /// Exact: a log of admitted cost per caller; no interval of length `window` ever admits more
    /// than `quota`. Memory grows with the quota (one entry per unit of cost in the window), so
    /// the quota is at most [`MAX_LOG_QUOTA`].
    #[default]
    SlidingLog,
    /// Two fixed windows weighted by their overlap with the sliding one: O(1) memory, an estimate
    /// that assumes the previous window's requests were spread evenly.
    SlidingCounter,
    /// Generic cell rate algorithm: O(1) memory and smooth. `quota` per `window` means a fresh
    /// caller may spend `quota` at once, then one more every `window / quota`.
    Gcra,
}

impl Algorithm {
    /// The short tag in store keys, so that switching algorithms never reads another's data.
    pub(crate) fn tag(self) -> &'static str {
        match self {
            Self::SlidingLog => "log",
            Self::SlidingCounter => "ctr",
            Self::Gcra => "gcra",
        }
    }
}

impl fmt::Display for Algorithm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::SlidingLog => "sliding-log",
            Self::SlidingCounter => "sliding-counter",
            Self::Gcra => "gcra",
        })
    }
}

impl std::str::FromStr for Algorithm {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "sliding-log" => Ok(Self::SlidingLog),
            "sliding-counter" => Ok(Self::SlidingCounter),
            "gcra" => Ok(Self::Gcra),
            other => Err(format!(
                "unknown algorithm {other:?}: expected sliding-log, sliding-counter or gcra"
            )),
        }
    }
}

/// A validated set of limits checked together, all-or-nothing, under one algorithm.
///
/// Built by [`RateLimitLayer`](super::RateLimitLayer)'s builder; a [`Store`](crate::store::Store)
/// implementation reads it.
#[derive(Debug, Clone)]
pub struct RatePolicy {
    pub(crate) namespace: String,
    pub(crate) algorithm: Algorithm,
    pub(crate) limits: Vec<Limit>,
}

impl RatePolicy {
    /// Validates `limits` (at least one; unique names of ASCII letters, digits, `-`, `_`, `.`;
    /// quotas >= 1; windows of at least a millisecond) under `namespace`, the key prefix (visible
    /// ASCII without braces).
    pub fn new(
        namespace: impl Into<String>,
        algorithm: Algorithm,
        limits: Vec<Limit>,
    ) -> Result<Self, ConfigError> {
        let namespace = namespace.into();
        check_prefix(&namespace)?;
        if limits.is_empty() {
            return Err(ConfigError::new("a rate limit needs at least one limit"));
        }
        for (i, limit) in limits.iter().enumerate() {
            let name = limit.name();
            if name.is_empty()
                || name.len() > 64
                || !name
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
            {
                return Err(ConfigError::new(format!(
                    "invalid limit name {name:?}: use 1 to 64 ASCII letters, digits, '-', '_' or '.'"
                )));
            }
            if limits[..i].iter().any(|l| l.name() == name) {
                return Err(ConfigError::new(format!(
                    "limit name {name:?} is used twice"
                )));
            }
            if limit.quota() == 0 {
                return Err(ConfigError::new(format!("limit {name:?} has a zero quota")));
            }
            if limit.window() < Duration::from_millis(1) {
                return Err(ConfigError::new(format!(
                    "limit {name:?} has a window under one millisecond"
                )));
            }
            // The log keeps an entry per unit of cost: a quota beyond this is a memory and
            // latency hazard in Redis (one request could add that many members).
            if algorithm == Algorithm::SlidingLog && limit.quota() > MAX_LOG_QUOTA {
                return Err(ConfigError::new(format!(
                    "limit {name:?}: the sliding log keeps an entry per unit, so its quota is at most {MAX_LOG_QUOTA}; use the sliding counter or GCRA"
                )));
            }
            // GCRA counts in 1/quota microseconds: quota * window (µs) must stay exact in a
            // double, as must quota * window (ms) for the counter.
            if algorithm == Algorithm::Gcra
                && u128::from(limit.quota()) * limit.window().as_micros() >= 1 << 52
            {
                return Err(ConfigError::new(format!(
                    "limit {name:?} is out of range for GCRA: quota x window in microseconds must stay below 2^52"
                )));
            }
            // Scripts compute quota * window in doubles: keep that exact.
            if limit.window() > Duration::from_secs(366 * 86_400)
                || u128::from(limit.quota()) * limit.window().as_millis() >= 1 << 52
            {
                return Err(ConfigError::new(format!("limit {name:?} is out of range")));
            }
        }
        Ok(Self {
            namespace,
            algorithm,
            limits,
        })
    }

    /// The same limits with every quota divided by `copies` (at least 1 each): the share of one
    /// copy of a service when the shared store is out of reach.
    pub fn divided(&self, copies: u32) -> Self {
        let mut divided = self.clone();
        for limit in &mut divided.limits {
            limit.quota = (limit.quota / u64::from(copies.max(1))).max(1);
        }
        divided
    }

    /// The limits in configuration order.
    pub fn limits(&self) -> &[Limit] {
        &self.limits
    }

    /// The algorithm.
    pub fn algorithm(&self) -> Algorithm {
        self.algorithm
    }

    /// The key prefix, e.g. `tollgate:rl`.
    pub fn namespace(&self) -> &str {
        &self.namespace
    }

    /// The store key of each limit for caller `key`: `<namespace>:{<key>}:<limit>:<algorithm>`.
    /// All of one caller's keys share the hash tag `{<key>}`, so one script may touch them on
    /// Redis Cluster.
    pub fn store_keys(&self, key: &Key) -> Vec<String> {
        self.limits
            .iter()
            .map(|limit| {
                let mut s = String::with_capacity(self.namespace.len() + limit.name.len() + 34);
                s.push_str(&self.namespace);
                s.push_str(":{");
                key.write_encoded(&mut s);
                s.push_str("}:");
                s.push_str(&limit.name);
                s.push(':');
                s.push_str(self.algorithm.tag());
                s
            })
            .collect()
    }
}

/// One limit's state after a decision.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LimitState {
    /// Quota left after this decision (an admitted request is charged first; a denied one charges
    /// nothing).
    pub remaining: u64,
    /// Time until this limit's quota grows again; zero when nothing is in use.
    pub reset: Duration,
}

/// A store's answer to a rate check.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RateOutcome {
    /// Whether every limit had room; only then was the cost charged, to all of them.
    pub admitted: bool,
    /// For a denied request, the time until it could be admitted (zero when admitted). A cost
    /// larger than some limit's quota can never be admitted; the wait is then that window.
    pub retry_after: Duration,
    /// Per limit, in configuration order.
    pub limits: Vec<LimitState>,
}
