//! What is limited: [`Limit`], [`Algorithm`], and the validated [`RatePolicy`] a store checks.

use std::fmt;
use std::time::Duration;

use crate::error::{ConfigError, ConfigErrorKind};
use crate::key::Key;
use crate::keyspace::{self, check_prefix};

/// One named quota: at most `quota` cost per `window`.
///
/// The name shows in the `RateLimit` / `RateLimit-Policy` headers and in store keys, so it is
/// restricted to ASCII letters, digits, `-`, `_` and `.` (checked when the layer is built).
///
/// With the `serde` feature a limit deserializes from `{ name, quota, window }`, the window a
/// whole number and a unit: `ms`, `s`, `m`, `h` or `d` (`"250ms"`, `"1s"`, `"1h"`), or a number
/// of seconds.
///
/// ```
/// # #[cfg(feature = "serde")] {
/// use std::time::Duration;
/// use tollgate::rate::Limit;
///
/// let limit: Limit = serde_json::from_str(r#"{"name": "burst", "quota": 10, "window": "1s"}"#)
///     .unwrap();
/// assert_eq!(limit, Limit::new("burst", 10, Duration::from_secs(1)));
/// # }
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "serde", derive(serde::Deserialize))]
#[cfg_attr(feature = "serde", serde(try_from = "LimitSpec"))]
pub struct Limit {
    name: String,
    quota: u64,
    window: Duration,
    block_for: Option<Duration>,
    leased: bool,
    calls: bool,
}

/// A limit as a configuration file writes it.
#[cfg(feature = "serde")]
#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct LimitSpec {
    name: String,
    quota: u64,
    window: WindowSpec,
    #[serde(default)]
    block_for: Option<WindowSpec>,
    #[serde(default)]
    leased: bool,
    #[serde(default)]
    counting_calls: bool,
}

/// A window: `"250ms"`, `"1s"`, `"5m"`, `"1h"`, `"1d"`, or whole seconds; anything else is
/// refused with what to write instead.
#[cfg(feature = "serde")]
struct WindowSpec(Duration);

#[cfg(feature = "serde")]
impl<'de> serde::Deserialize<'de> for WindowSpec {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer.deserialize_any(WindowVisitor).map(WindowSpec)
    }
}

#[cfg(feature = "serde")]
struct WindowVisitor;

#[cfg(feature = "serde")]
impl serde::de::Visitor<'_> for WindowVisitor {
    type Value = Duration;

    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("a window: whole seconds (60) or a duration such as \"250ms\", \"1s\", \"5m\", \"1h\" or \"1d\"")
    }

    fn visit_u64<E: serde::de::Error>(self, secs: u64) -> Result<Duration, E> {
        Ok(Duration::from_secs(secs))
    }

    fn visit_i64<E: serde::de::Error>(self, secs: i64) -> Result<Duration, E> {
        u64::try_from(secs)
            .map(Duration::from_secs)
            .map_err(|_| E::custom(format!("invalid window {secs}: a window is not negative")))
    }

    fn visit_f64<E: serde::de::Error>(self, secs: f64) -> Result<Duration, E> {
        Err(E::custom(format!(
            "invalid window {secs}: write whole seconds, or a duration such as \"1500ms\""
        )))
    }

    fn visit_str<E: serde::de::Error>(self, text: &str) -> Result<Duration, E> {
        parse_window(text).map_err(E::custom)
    }
}

#[cfg(feature = "serde")]
impl TryFrom<LimitSpec> for Limit {
    type Error = String;

    fn try_from(spec: LimitSpec) -> Result<Self, String> {
        let mut limit = Self::new(spec.name, spec.quota, spec.window.0);
        if let Some(block) = spec.block_for {
            limit = limit.block_for(block.0);
        }
        if spec.counting_calls {
            limit = limit.counting_calls();
        }
        Ok(if spec.leased { limit.leased() } else { limit })
    }
}

/// Reads a duration as configuration files write a window or a `block_for`: a whole number and
/// a unit, `ms`, `s`, `m`, `h` or `d` (`"250ms"`, `"30s"`, `"1h"`). For settings that come from
/// elsewhere, such as an environment variable.
///
/// ```
/// use std::time::Duration;
/// use tollgate::rate::{parse_duration, Limit};
///
/// let block = parse_duration("30s").unwrap();
/// assert_eq!(block, Duration::from_secs(30));
/// let limit = Limit::per_minute("api", 100).block_for(block);
/// assert_eq!(limit.penalty(), Some(block));
/// assert!(parse_duration("30 seconds").is_err());
/// ```
///
/// # Errors
///
/// A [`ConfigError`] of kind [`Limit`](ConfigErrorKind::Limit) that says what to write instead.
pub fn parse_duration(text: &str) -> Result<Duration, ConfigError> {
    parse_window(text).map_err(limit_error)
}

/// `<whole number><ms|s|m|h|d>`.
fn parse_window(text: &str) -> Result<Duration, String> {
    let text = text.trim();
    let digits = text.bytes().take_while(u8::is_ascii_digit).count();
    let (number, unit) = text.split_at(digits);
    let invalid = || {
        format!(
            "invalid window {text:?}: expected e.g. \"250ms\", \"1s\", \"5m\", \"1h\" or \"1d\""
        )
    };
    let number: u64 = number.parse().map_err(|_| invalid())?;
    let unit_ms: u64 = match unit.trim() {
        "ms" => 1,
        "s" => 1_000,
        "m" => 60_000,
        "h" => 3_600_000,
        "d" => 86_400_000,
        _ => return Err(invalid()),
    };
    number
        .checked_mul(unit_ms)
        .map(Duration::from_millis)
        .ok_or_else(invalid)
}

impl Limit {
    /// `quota` per `window`, e.g. `Limit::new("burst", 10, Duration::from_secs(1))`.
    pub fn new(name: impl Into<String>, quota: u64, window: Duration) -> Self {
        Self {
            name: name.into(),
            quota,
            window,
            block_for: None,
            leased: false,
            calls: false,
        }
    }

    /// A limit that counts calls, not cost: every check of a cost above 0 charges it 1, whatever
    /// the cost, beside limits of the same policy that charge the cost — "100 requests and
    /// 10,000 tokens a second" in one check, all or nothing: a check is admitted only if every
    /// limit admits it, and a denial waits for the latest of the limits that deny.
    ///
    /// A look (cost 0) charges it nothing; a reservation charges it 1, and its settlement,
    /// refund or overrun, never changes it: the call was made. Every algorithm and every store
    /// counts it alike. A policy with such a limit cannot be [leased](Self::leased) (a slice
    /// is a number of units of one kind; refused when the policy is built). In a configuration
    /// file (feature `serde`): `counting_calls = true`; in the `name:count/<seconds>s` syntax
    /// of the CLI and the example app: a `/calls` suffix, `requests:100/1s/calls`.
    ///
    /// ```
    /// use tollgate::rate::{Algorithm, Limit, RatePolicy};
    ///
    /// let requests = Limit::per_second("requests", 100).counting_calls();
    /// let tokens = Limit::per_second("tokens", 10_000);
    /// assert!(requests.counts_calls());
    /// assert!(!tokens.counts_calls());
    /// let policy = RatePolicy::new("app:rl", Algorithm::Gcra, vec![requests.clone(), tokens]);
    /// assert!(policy.is_ok());
    /// // a slice of a leased quota is a number of units of one kind
    /// let leased = vec![requests.clone().leased(), Limit::per_second("tokens", 10_000).leased()];
    /// let refused = RatePolicy::new("app:rl", Algorithm::Gcra, leased).unwrap_err();
    /// assert!(refused.to_string().contains("\"requests\" counts calls and is leased"));
    /// # #[cfg(feature = "serde")] {
    /// let from_config: Limit = serde_json::from_str(
    ///     r#"{"name": "requests", "quota": 100, "window": "1s", "counting_calls": true}"#,
    /// )
    /// .unwrap();
    /// assert_eq!(from_config, requests);
    /// # }
    /// ```
    pub fn counting_calls(self) -> Self {
        Self {
            calls: true,
            ..self
        }
    }

    /// Whether this limit [counts calls](Self::counting_calls) rather than cost.
    pub fn counts_calls(&self) -> bool {
        self.calls
    }

    /// What a check of `cost` charges this limit: `cost`, or for a limit that counts calls 1
    /// (0 for a look).
    pub(crate) fn charge_of(&self, cost: u64) -> u64 {
        if self.calls { cost.min(1) } else { cost }
    }

    /// Leased quota: each copy of the service takes a slice of a caller's quota in one store
    /// check and admits from it locally until it is spent or its lease ends (a tenth of the
    /// window, at most ten seconds); what is left of a slice goes back with a settlement. A caller
    /// is decided per request until it sends several requests within a lease, and again as its
    /// quota runs low. For hot keys — a global limit, a large tenant — where one store key
    /// would otherwise serve every request of every copy.
    ///
    /// Never more is admitted than the quota: every slice is charged in the store before a
    /// request is admitted from it. A caller may be admitted less, by at most the slices that
    /// copies hold unspent; a reset through any copy drops every copy's slices of the caller.
    /// Every limit of a tier is leased, or none; a leased limit has no
    /// [penalty](Self::block_for) and does not [count calls](Self::counting_calls), and a layer
    /// that settles actual costs leases nothing. See
    /// the guide's "Leased quota". In a configuration file (feature `serde`): `leased = true`.
    ///
    /// ```
    /// use tollgate::rate::Limit;
    ///
    /// let global = Limit::per_second("api", 50_000).leased();
    /// assert!(global.is_leased());
    /// assert!(!Limit::per_second("api", 50_000).is_leased());
    /// # #[cfg(feature = "serde")] {
    /// let from_config: Limit = serde_json::from_str(
    ///     r#"{"name": "api", "quota": 50000, "window": "1s", "leased": true}"#,
    /// )
    /// .unwrap();
    /// assert_eq!(from_config, global);
    /// # }
    /// ```
    pub fn leased(self) -> Self {
        Self {
            leased: true,
            ..self
        }
    }

    /// Whether this limit's quota is [leased](Self::leased) to the copies.
    pub fn is_leased(&self) -> bool {
        self.leased
    }

    /// A penalty: a check that this limit denies also blocks the caller for `duration` (store
    /// time, from the denial), on every copy. While blocked, every check of the caller under the
    /// policy is denied and charges nothing; its wait is at least the block's end, and this
    /// limit answers a remaining of 0 and a reset of the time the block has left. A denial
    /// while blocked does not extend the block; a reset of the caller ends it. See the guide's
    /// "Penalties: `block_for`".
    ///
    /// Checked when the policy is built: from a millisecond to 366 days. In a configuration file
    /// (feature `serde`): `block_for = "30s"`, written as a window is.
    ///
    /// ```
    /// use std::time::Duration;
    /// use tollgate::rate::{Algorithm, Limit, RatePolicy};
    ///
    /// let limit = Limit::per_second("burst", 10).block_for(Duration::from_secs(30));
    /// assert_eq!(limit.penalty(), Some(Duration::from_secs(30)));
    /// let zero = Limit::per_second("burst", 10).block_for(Duration::ZERO);
    /// assert!(RatePolicy::new("app:rl", Algorithm::Gcra, vec![zero]).is_err());
    /// # #[cfg(feature = "serde")] {
    /// let from_config: Limit = serde_json::from_str(
    ///     r#"{"name": "burst", "quota": 10, "window": "1s", "block_for": "30s"}"#,
    /// )
    /// .unwrap();
    /// assert_eq!(from_config, limit);
    /// # }
    /// ```
    pub fn block_for(self, duration: Duration) -> Self {
        Self {
            block_for: Some(duration),
            ..self
        }
    }

    /// How long a denial by this limit blocks the caller ([`block_for`](Self::block_for)), if
    /// it does.
    pub fn penalty(&self) -> Option<Duration> {
        self.block_for
    }

    /// The penalty in microseconds; 0 without one.
    pub(crate) fn block_us(&self) -> u64 {
        self.block_for
            .map_or(0, |d| u64::try_from(d.as_micros()).unwrap_or(u64::MAX))
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

    /// `quota` per day (24 hours, as `"1d"` in a configuration file).
    ///
    /// ```
    /// use std::time::Duration;
    /// use tollgate::rate::Limit;
    ///
    /// assert_eq!(Limit::per_day("daily", 10_000).window(), Duration::from_secs(86_400));
    /// ```
    pub fn per_day(name: impl Into<String>, quota: u64) -> Self {
        Self::new(name, quota, Duration::from_secs(86_400))
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
/// A rate-limit layer builds one from its configuration; a store reads it to decide.
#[derive(Debug, Clone)]
pub struct RatePolicy {
    namespace: String,
    algorithm: Algorithm,
    limits: Vec<Limit>,
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
            return Err(limit_error("a rate limit needs at least one limit"));
        }
        for (i, limit) in limits.iter().enumerate() {
            if limits[..i].iter().any(|l| l.name() == limit.name()) {
                let name = limit.name();
                return Err(limit_error(format!("limit name {name:?} is used twice")));
            }
            check_limit(limit, algorithm)?;
        }
        check_leases(&limits)?;
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

    /// Whether the policy's quota is [leased](Limit::leased) to the copies (all its limits are).
    pub fn is_leased(&self) -> bool {
        self.limits.iter().all(Limit::is_leased)
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
        let write = |limit| {
            let mut out = String::new();
            self.write_store_key(&mut out, key, limit);
            out
        };
        self.limits().iter().map(write).collect()
    }

    /// Every store key of caller `key` under this policy, which a reset deletes: its limits'
    /// ([`store_keys`](Self::store_keys)), then the block of each, its limit's key plus
    /// `:block` — of every limit, whether this policy gives it a [penalty](Limit::block_for) or
    /// not: a copy configured with one may have blocked the caller.
    pub fn reset_keys(&self, key: &Key) -> Vec<String> {
        let mut keys = self.store_keys(key);
        for limit in self.limits() {
            let mut out = String::new();
            self.write_block_key(&mut out, key, limit);
            keys.push(out);
        }
        keys
    }

    /// The key of caller `key`'s line of waiters under this policy (see
    /// [`RateStore::line_up`](crate::store::RateStore::line_up)): its first limit's store key
    /// plus `:line`, in the slot of the caller's other keys. A store may keep more than one key
    /// per line, each this key plus a suffix of its own.
    pub fn line_key(&self, key: &Key) -> String {
        let mut out = String::new();
        if let Some(first) = self.limits().first() {
            self.write_store_key(&mut out, key, first);
        }
        out.push_str(":line");
        out
    }

    /// Writes the key of the block of `limit` (one of this policy's) for caller `key` into
    /// `out`, in place of what it held: the limit's store key plus `:block`.
    pub(crate) fn write_block_key(&self, out: &mut String, key: &Key, limit: &Limit) {
        keyspace::write_rate_block(
            out,
            &self.namespace,
            key,
            limit.name(),
            self.algorithm.tag(),
        );
    }

    /// Writes the store key of `limit` (one of this policy's) for caller `key` into `out`, in
    /// place of what it held: one buffer serves every key of a call.
    pub(crate) fn write_store_key(&self, out: &mut String, key: &Key, limit: &Limit) {
        keyspace::write_rate(
            out,
            &self.namespace,
            key,
            limit.name(),
            self.algorithm.tag(),
        );
    }
}

fn limit_error(message: impl Into<String>) -> ConfigError {
    ConfigError::new(ConfigErrorKind::Limit, message)
}

/// Checks one limit's name, quota and window, and that the algorithm counts it exactly.
/// Leased limits are decided together, by slices charged in one check: every limit of a policy
/// is leased or none is, and none of them blocks (a slice denied for its size is no denial of
/// the caller's).
fn check_leases(limits: &[Limit]) -> Result<(), ConfigError> {
    let leased: Vec<&str> = limits
        .iter()
        .filter(|l| l.leased)
        .map(Limit::name)
        .collect();
    if leased.is_empty() {
        return Ok(());
    }
    if leased.len() < limits.len() {
        return Err(limit_error(format!(
            "limits {leased:?} are leased and others are not: lease every limit of a tier or none \
             (they are decided in one store check)"
        )));
    }
    if let Some(limit) = limits.iter().find(|l| l.calls) {
        return Err(limit_error(format!(
            "limit {:?} counts calls and is leased: a leased slice is a number of units of one \
             kind, so a leased tier has no limit that counts calls",
            limit.name
        )));
    }
    match limits.iter().find(|l| l.block_for.is_some()) {
        Some(limit) => Err(limit_error(format!(
            "limit {:?} is leased and has a block_for: a leased limit has no penalty",
            limit.name
        ))),
        None => Ok(()),
    }
}

fn check_limit(limit: &Limit, algorithm: Algorithm) -> Result<(), ConfigError> {
    let name = limit.name();
    if name.len() > 64 || !keyspace::is_name(name) {
        return Err(limit_error(format!(
            "invalid limit name {name:?}: use 1 to 64 ASCII letters, digits, '-', '_' or '.'"
        )));
    }
    if limit.quota() == 0 {
        return Err(limit_error(format!("limit {name:?} has a zero quota")));
    }
    if limit.window() < Duration::from_millis(1) {
        return Err(limit_error(format!(
            "limit {name:?} has a window under one millisecond"
        )));
    }
    // The log keeps an entry per unit of cost: a quota beyond this is a memory and latency hazard
    // in Redis (one request could add that many members).
    if algorithm == Algorithm::SlidingLog && limit.quota() > MAX_LOG_QUOTA {
        return Err(limit_error(format!(
            "limit {name:?}: the sliding log keeps an entry per unit, so its quota is at most {MAX_LOG_QUOTA}; use the sliding counter or GCRA"
        )));
    }
    // GCRA counts in 1/quota microseconds: quota * window (µs) must stay exact in a double, as
    // must quota * window (ms) for the counter.
    if algorithm == Algorithm::Gcra
        && u128::from(limit.quota()) * limit.window().as_micros() >= 1 << 52
    {
        return Err(limit_error(format!(
            "limit {name:?} is out of range for GCRA: quota x window in microseconds must stay below 2^52"
        )));
    }
    // Scripts compute quota * window in doubles: keep that exact.
    if limit.window() > Duration::from_secs(366 * 86_400)
        || u128::from(limit.quota()) * limit.window().as_millis() >= 1 << 52
    {
        return Err(limit_error(format!("limit {name:?} is out of range")));
    }
    check_penalty(limit)
}

/// Checks a limit's `block_for`: at least a millisecond, at most 366 days, as a window.
fn check_penalty(limit: &Limit) -> Result<(), ConfigError> {
    let Some(block) = limit.penalty() else {
        return Ok(());
    };
    let name = limit.name();
    if block < Duration::from_millis(1) {
        return Err(limit_error(format!(
            "limit {name:?} has a block_for under one millisecond: leave block_for out for no penalty"
        )));
    }
    if block > Duration::from_secs(366 * 86_400) {
        return Err(limit_error(format!(
            "limit {name:?} has a block_for over 366 days"
        )));
    }
    Ok(())
}

#[cfg(feature = "serde")]
impl<'de> serde::Deserialize<'de> for Algorithm {
    /// `"sliding-log"`, `"sliding-counter"` or `"gcra"`.
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let name = <std::borrow::Cow<'de, str>>::deserialize(deserializer)?;
        name.parse().map_err(serde::de::Error::custom)
    }
}
