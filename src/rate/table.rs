//! [`LimitTable`]: the limits a layer's counters are judged against, as the store keeps them.

use std::collections::{BTreeMap, HashMap};
use std::fmt::Write as _;
use std::time::{Duration, SystemTime};

use super::{Algorithm, Limit, RatePolicy};
use crate::error::ConfigError;
use crate::key::Key;

/// The limits in force for one rate-limit layer, kept in the store beside its counters so that
/// every copy judges a counter against the same quota.
///
/// Three layers of limits, the first that has an entry wins:
///
/// 1. a caller's **override** ([`set_caller`](Self::set_caller)): a tenant's plan;
/// 2. a tier's **replacement** ([`set_tier`](Self::set_tier)), made by an operator;
/// 3. the tier's **defaults**: the limits the service was built with, recorded with the
///    [revision](Self::revision) of the code that wrote them.
///
/// A tier is `None` for the layer's own limits, or a named tier's name. A caller's override is
/// counted under the layer's own limits' names, so what a caller spent of a limit stays spent
/// when its override changes that limit's quota (as with
/// [`limits_by`](crate::rate_limit::RateLimitLayerBuilder::limits_by)).
///
/// ```
/// use std::time::Duration;
/// use tollgate::key::Key;
/// use tollgate::rate::{Limit, LimitTable};
///
/// let mut table = LimitTable::with_defaults(1, [(None, vec![Limit::per_minute("api", 100)])]);
/// let acme = Key::new("tenant", b"acme");
/// table.set_caller(acme, vec![Limit::per_minute("api", 5_000)]);
/// assert_eq!(table.for_caller(acme).unwrap()[0].quota(), 5_000);
/// assert_eq!(table.for_tier(None).unwrap()[0].quota(), 100);
///
/// // what the store keeps, read back
/// let text = table.encode();
/// assert_eq!(LimitTable::decode(&text).unwrap(), table);
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct LimitTable {
    revision: u64,
    /// A concurrency limit's table ([`in_flight`](Self::in_flight)).
    in_flight: bool,
    /// The algorithm of the layer that wrote the defaults, which every limit is checked for.
    algorithm: Option<Algorithm>,
    defaults: BTreeMap<Option<String>, Vec<Limit>>,
    tiers: BTreeMap<Option<String>, Vec<Limit>>,
    callers: HashMap<Key, Vec<Limit>>,
}

/// The first line of every encoded table, with the format's version.
const HEADER: &str = "tollgate-limits 1";

/// The name of a concurrency limit's one limit in its table (see [`LimitTable::in_flight`]).
pub const IN_FLIGHT: &str = "in-flight";

impl LimitTable {
    /// A table of `defaults` (each tier's limits as the code builds them) written by the code's
    /// revision `revision`, with no override or replacement.
    pub fn with_defaults(
        revision: u64,
        defaults: impl IntoIterator<Item = (Option<String>, Vec<Limit>)>,
    ) -> Self {
        Self {
            revision,
            defaults: defaults.into_iter().collect(),
            ..Self::default()
        }
    }

    /// A concurrency limit's table of `defaults` (each tier's limit of requests in flight, as
    /// the code builds them) written by the code's revision `revision`. Each tier, replacement
    /// and override holds one limit, named [`IN_FLIGHT`], of a quota of at least 1 and no
    /// window ([`in_flight_of`](Self::in_flight_of) reads it).
    ///
    /// ```
    /// use tollgate::key::Key;
    /// use tollgate::rate::LimitTable;
    ///
    /// let mut table = LimitTable::in_flight(0, [(None, 4), (Some("pro".to_owned()), 16)]);
    /// let acme = Key::new("tenant", b"acme");
    /// table.set_caller(acme, LimitTable::in_flight_limits(64));
    /// assert_eq!(LimitTable::in_flight_of(table.for_caller(acme).unwrap()), Some(64));
    /// assert_eq!(LimitTable::in_flight_of(table.for_tier(Some("pro")).unwrap()), Some(16));
    /// assert_eq!(table.check("app:cc"), Ok(()));
    /// ```
    pub fn in_flight(
        revision: u64,
        defaults: impl IntoIterator<Item = (Option<String>, u32)>,
    ) -> Self {
        Self {
            revision,
            in_flight: true,
            defaults: defaults
                .into_iter()
                .map(|(tier, limit)| (tier, Self::in_flight_limits(limit)))
                .collect(),
            ..Self::default()
        }
    }

    /// A concurrency limit's entry: at most `limit` requests in flight.
    pub fn in_flight_limits(limit: u32) -> Vec<Limit> {
        vec![Limit::new(IN_FLIGHT, u64::from(limit), Duration::ZERO)]
    }

    /// The limit of requests in flight of a concurrency limit's entry; `None` for any other.
    pub fn in_flight_of(limits: &[Limit]) -> Option<u32> {
        match limits {
            [limit]
                if limit.name() == IN_FLIGHT
                    && limit.window_us() == 0
                    && limit.block_us() == 0
                    && !limit.is_leased() =>
            {
                u32::try_from(limit.quota()).ok().filter(|&n| n >= 1)
            }
            _ => None,
        }
    }

    /// Whether this is a concurrency limit's table ([`in_flight`](Self::in_flight)).
    pub fn is_in_flight(&self) -> bool {
        self.in_flight
    }

    /// The same table, its limits counted by `algorithm` (the layer's), which
    /// [`check`](Self::check) holds them to.
    pub fn with_algorithm(mut self, algorithm: Algorithm) -> Self {
        self.algorithm = Some(algorithm);
        self
    }

    /// The algorithm of the layer that wrote the defaults, if it said.
    pub fn algorithm(&self) -> Option<Algorithm> {
        self.algorithm
    }

    /// Checks every tier's limits in force and every override as a layer of the table's
    /// algorithm (the sliding log when it names none) under `namespace` would build them: a
    /// quota of zero, a name used twice, a window past the algorithm's bounds are refused,
    /// naming the tier or caller.
    ///
    /// # Errors
    ///
    /// A [`ConfigError`] of kind [`Limit`](crate::ConfigErrorKind::Limit), or of
    /// [`Prefix`](crate::ConfigErrorKind::Prefix) for a bad `namespace`.
    pub fn check(&self, namespace: &str) -> Result<(), ConfigError> {
        crate::keyspace::check_prefix(namespace)?;
        let algorithm = self.algorithm.unwrap_or_default();
        let in_flight = self.in_flight;
        let check = |limits: &[Limit]| {
            if !in_flight {
                return RatePolicy::new(namespace, algorithm, limits.to_vec()).map(drop);
            }
            match Self::in_flight_of(limits) {
                Some(_) => Ok(()),
                None => Err(ConfigError::new(
                    crate::ConfigErrorKind::Limit,
                    format!(
                        "a concurrency limit needs one limit {IN_FLIGHT:?} of 1 to {} requests in flight",
                        u32::MAX
                    ),
                )),
            }
        };
        for tier in self.tiers() {
            let limits = self.for_tier(tier).unwrap_or_default();
            check(limits).map_err(|e| match tier {
                Some(tier) => e.within(&format!("tier {tier:?}")),
                None => e,
            })?;
        }
        for (key, limits) in self.overrides() {
            check(limits).map_err(|e| e.within(&format!("caller {key}")))?;
        }
        Ok(())
    }

    /// The revision of the code whose defaults the table holds.
    pub fn revision(&self) -> u64 {
        self.revision
    }

    /// The defaults of tier `tier` (`None`: the layer's own), as the code wrote them.
    pub fn defaults(&self, tier: Option<&str>) -> Option<&[Limit]> {
        self.defaults
            .get(&tier.map(str::to_owned))
            .map(Vec::as_slice)
    }

    /// Takes `other`'s defaults and their revision, keeping every override and replacement.
    pub fn adopt_defaults(&mut self, other: &LimitTable) {
        self.revision = other.revision;
        self.in_flight = other.in_flight;
        self.algorithm = other.algorithm;
        self.defaults.clone_from(&other.defaults);
    }

    /// Adds the defaults of each tier of `other` that this table has none of (a tier new in
    /// the code); whether it added any.
    pub fn add_missing_defaults(&mut self, other: &LimitTable) -> bool {
        let mut added = false;
        for (tier, limits) in &other.defaults {
            if !self.defaults.contains_key(tier) {
                self.defaults.insert(tier.clone(), limits.clone());
                added = true;
            }
        }
        added
    }

    /// What names the defaults — their revision, algorithm and limits — in a copy's
    /// registration: `r<revision>-<12 hex digits of their digest>`. Two tables of the same
    /// defaults have the same id.
    pub fn defaults_id(&self) -> String {
        use sha2::{Digest, Sha256};
        let defaults = LimitTable {
            revision: self.revision,
            in_flight: self.in_flight,
            algorithm: self.algorithm,
            defaults: self.defaults.clone(),
            ..LimitTable::default()
        };
        let digest = Sha256::digest(defaults.encode().as_bytes());
        let mut id = format!("r{}-", self.revision);
        for byte in &digest[..6] {
            let _ = write!(id, "{byte:02x}");
        }
        id
    }

    /// Whether the defaults equal `other`'s (its revision aside).
    pub fn same_defaults(&self, other: &LimitTable) -> bool {
        self.defaults == other.defaults
    }

    /// The limits in force for tier `tier`: its replacement, else its defaults; `None` for a
    /// tier the table does not know.
    pub fn for_tier(&self, tier: Option<&str>) -> Option<&[Limit]> {
        let tier = tier.map(str::to_owned);
        self.tiers
            .get(&tier)
            .or_else(|| self.defaults.get(&tier))
            .map(Vec::as_slice)
    }

    /// Caller `key`'s override, if it has one.
    pub fn for_caller(&self, key: Key) -> Option<&[Limit]> {
        self.callers.get(&key).map(Vec::as_slice)
    }

    /// The tiers the table knows, the layer's own (`None`) first.
    pub fn tiers(&self) -> impl Iterator<Item = Option<&str>> {
        self.defaults.keys().map(Option::as_deref)
    }

    /// Every tier's replacement, by tier.
    pub fn replacements(&self) -> impl Iterator<Item = (Option<&str>, &[Limit])> {
        self.tiers.iter().map(|(t, l)| (t.as_deref(), l.as_slice()))
    }

    /// Every caller's override, ordered by key.
    pub fn overrides(&self) -> Vec<(Key, &[Limit])> {
        let mut all: Vec<_> = self
            .callers
            .iter()
            .map(|(key, limits)| (*key, limits.as_slice()))
            .collect();
        all.sort_by_key(|(key, _)| encoded(key));
        all
    }

    /// Replaces tier `tier`'s limits (`None`: the layer's own) with `limits`.
    pub fn set_tier(&mut self, tier: Option<&str>, limits: Vec<Limit>) {
        self.tiers.insert(tier.map(str::to_owned), limits);
    }

    /// Takes tier `tier` back to its defaults; whether it had a replacement.
    pub fn unset_tier(&mut self, tier: Option<&str>) -> bool {
        self.tiers.remove(&tier.map(str::to_owned)).is_some()
    }

    /// Gives caller `key` limits of its own.
    pub fn set_caller(&mut self, key: Key, limits: Vec<Limit>) {
        self.callers.insert(key, limits);
    }

    /// Takes caller `key` back to its tier's limits; whether it had an override.
    pub fn unset_caller(&mut self, key: Key) -> bool {
        self.callers.remove(&key).is_some()
    }

    /// The table as the store keeps it: one line per limit (see [`decode`](Self::decode)).
    pub fn encode(&self) -> String {
        let mut out = format!("{HEADER}\nrevision {}\n", self.revision);
        if self.in_flight {
            let _ = writeln!(out, "kind {IN_FLIGHT}");
        }
        if let Some(algorithm) = self.algorithm {
            let _ = writeln!(out, "algorithm {algorithm}");
        }
        let tier = |t: &Option<String>| t.clone().unwrap_or_else(|| "-".to_owned());
        for (t, limits) in &self.defaults {
            write_limits(&mut out, "default", &tier(t), limits);
        }
        for (t, limits) in &self.tiers {
            write_limits(&mut out, "tier", &tier(t), limits);
        }
        for (key, limits) in self.overrides() {
            write_limits(&mut out, "caller", &encoded(&key), limits);
        }
        out
    }

    /// Reads a table that [`encode`](Self::encode) wrote. Lines it does not know (`version`,
    /// `at` and `note` of a change's record, and those of a later format) are skipped.
    ///
    /// # Errors
    ///
    /// A [`TableError`] naming the line at fault.
    pub fn decode(text: &str) -> Result<Self, TableError> {
        let mut lines = text.lines().enumerate();
        match lines.next() {
            Some((_, HEADER)) => {}
            _ => return Err(TableError::at(1, "not a table of limits")),
        }
        let mut table = Self::default();
        for (i, line) in lines {
            let fault = |what: &'static str| TableError::at(i + 1, what);
            let mut words = line.split(' ');
            let section = words.next().unwrap_or_default();
            if section == "revision" {
                table.revision = number(words.next()).ok_or_else(|| fault("bad revision"))?;
                continue;
            }
            if section == "kind" {
                if words.next() != Some(IN_FLIGHT) {
                    return Err(fault("bad kind"));
                }
                table.in_flight = true;
                continue;
            }
            if section == "algorithm" {
                let algorithm = words.next().and_then(|a| a.parse().ok());
                table.algorithm = Some(algorithm.ok_or_else(|| fault("bad algorithm"))?);
                continue;
            }
            let (Some(owner), Some(limit)) = (words.next(), read_limit(&mut words)) else {
                if matches!(section, "default" | "tier" | "caller") {
                    return Err(fault("bad limit"));
                }
                continue;
            };
            let tier = || (owner != "-").then(|| owner.to_owned());
            match section {
                "default" => table.defaults.entry(tier()).or_default().push(limit),
                "tier" => table.tiers.entry(tier()).or_default().push(limit),
                "caller" => {
                    let key = Key::from_encoded(owner).ok_or_else(|| fault("bad caller key"))?;
                    table.callers.entry(key).or_default().push(limit);
                }
                _ => {}
            }
        }
        Ok(table)
    }
}

fn encoded(key: &Key) -> String {
    let mut out = String::with_capacity(22);
    key.write_encoded(&mut out);
    out
}

/// `<section> <owner> <name> <quota> <window µs> <block µs> <kind>`, one line each; the kind
/// is `0` (counts the cost), `1` ([leased](Limit::leased)), `c` ([counts
/// calls](Limit::counting_calls)) or `1c` (both; no policy takes it). A version that knows only
/// `0` and `1` refuses a limit that counts calls rather than count its cost.
fn write_limits(out: &mut String, section: &str, owner: &str, limits: &[Limit]) {
    for limit in limits {
        let kind = match (limit.is_leased(), limit.counts_calls()) {
            (false, false) => "0",
            (true, false) => "1",
            (false, true) => "c",
            (true, true) => "1c",
        };
        let _ = writeln!(
            out,
            "{section} {owner} {} {} {} {} {kind}",
            limit.name(),
            limit.quota(),
            limit.window_us(),
            limit.block_us(),
        );
    }
}

fn read_limit<'a>(words: &mut impl Iterator<Item = &'a str>) -> Option<Limit> {
    let name = words.next().filter(|n| !n.is_empty())?;
    let quota = number(words.next())?;
    let window = Duration::from_micros(number(words.next())?);
    let block = number(words.next())?;
    let kind = words.next()?;
    let mut limit = Limit::new(name, quota, window);
    if block > 0 {
        limit = limit.block_for(Duration::from_micros(block));
    }
    match kind {
        "0" => Some(limit),
        "1" => Some(limit.leased()),
        "c" => Some(limit.counting_calls()),
        "1c" => Some(limit.leased().counting_calls()),
        _ => None,
    }
}

fn number(word: Option<&str>) -> Option<u64> {
    word?.parse().ok()
}

/// A stored table that could not be read: the store holds something no version of tollgate
/// wrote.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TableError {
    line: usize,
    what: &'static str,
}

impl TableError {
    fn at(line: usize, what: &'static str) -> Self {
        Self { line, what }
    }
}

impl std::fmt::Display for TableError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "stored limits, line {}: {}", self.line, self.what)
    }
}

impl std::error::Error for TableError {}

/// A table as the store holds it: the table and its version, which every save raises by one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredTable {
    /// Raised by one at every save; the first save makes version 1.
    pub version: u64,
    /// The limits.
    pub table: LimitTable,
}

/// One save of a table, as its history keeps it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TableChange {
    /// The version the save made.
    pub version: u64,
    /// When the store took it, by the store's clock.
    pub at: SystemTime,
    /// What the one who saved it said of it.
    pub note: String,
    /// The table as saved.
    pub table: LimitTable,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_table_reads_back_as_written() {
        let mut table = LimitTable::with_defaults(
            3,
            [
                (
                    None,
                    vec![Limit::per_second("burst", 10), Limit::per_hour("h", 1000)],
                ),
                (
                    Some("pro".to_owned()),
                    vec![Limit::per_second("burst", 100).leased()],
                ),
                (
                    Some("llm".to_owned()),
                    vec![
                        Limit::per_second("requests", 100).counting_calls(),
                        Limit::per_second("tokens", 10_000),
                    ],
                ),
            ],
        );
        table.set_tier(
            Some("pro"),
            vec![Limit::per_second("burst", 50).block_for(Duration::from_millis(1500))],
        );
        table.set_caller(Key::new("t", b"a"), vec![Limit::per_second("burst", 7)]);
        table.set_caller(Key::new("t", b"b"), vec![Limit::per_second("burst", 8)]);
        table.set_caller(
            Key::new("t", b"c"),
            vec![Limit::per_second("requests", 5).counting_calls()],
        );
        let text = table.encode();
        assert!(
            text.contains("default llm requests 100 1000000 0 c\n"),
            "{text}"
        );
        assert_eq!(LimitTable::decode(&text), Ok(table.clone()));
        let both = Limit::per_second("b", 1).leased().counting_calls();
        let odd = LimitTable::with_defaults(1, [(None, vec![both])]);
        assert_eq!(LimitTable::decode(&odd.encode()), Ok(odd));
        // a change's record carries lines of its own, skipped
        let record = text.replacen('\n', "\nversion 4\nat 17\nnote raised\n", 1);
        assert_eq!(LimitTable::decode(&record), Ok(table));
    }

    #[test]
    fn a_concurrency_limits_table_reads_back_and_holds_its_entries_to_one_limit() {
        let mut table = LimitTable::in_flight(2, [(None, 4), (Some("pro".to_owned()), 16)]);
        table.set_caller(Key::new("t", b"a"), LimitTable::in_flight_limits(64));
        let text = table.encode();
        assert!(text.contains("\nkind in-flight\n"), "{text}");
        let read = LimitTable::decode(&text).unwrap();
        assert!(read.is_in_flight());
        assert_eq!(read, table);
        assert_ne!(
            read.defaults_id(),
            LimitTable::with_defaults(2, []).defaults_id()
        );
        assert_eq!(table.check("app:cc"), Ok(()));
        // a rate limit's entry, or a limit of zero, is no concurrency limit's
        let mut rate = table.clone();
        rate.set_tier(None, vec![Limit::per_second("s", 1)]);
        assert!(rate.check("app:cc").is_err());
        let mut zero = table;
        zero.set_caller(Key::new("t", b"b"), LimitTable::in_flight_limits(0));
        let error = zero.check("app:cc").unwrap_err().to_string();
        assert!(error.starts_with("caller "), "{error}");
        assert_eq!(
            LimitTable::decode("tollgate-limits 1\nkind slots")
                .unwrap_err()
                .to_string(),
            "stored limits, line 2: bad kind"
        );
    }

    #[test]
    fn what_no_version_wrote_is_refused_by_line() {
        let refused = |text: &str| LimitTable::decode(text).unwrap_err().to_string();
        assert_eq!(refused(""), "stored limits, line 1: not a table of limits");
        assert_eq!(
            refused("tollgate-limits 1\ndefault - a 10 x 0 0"),
            "stored limits, line 2: bad limit"
        );
        assert_eq!(
            refused("tollgate-limits 1\ncaller nokey a 1 1 0 0"),
            "stored limits, line 2: bad caller key"
        );
        assert_eq!(
            refused("tollgate-limits 1\nrevision -1"),
            "stored limits, line 2: bad revision"
        );
        assert_eq!(
            refused("tollgate-limits 1\nalgorithm fast"),
            "stored limits, line 2: bad algorithm"
        );
    }

    #[test]
    fn a_check_names_the_tier_or_caller_at_fault() {
        let good = LimitTable::with_defaults(0, [(None, vec![Limit::per_second("s", 1)])]);
        assert_eq!(good.check("t:rl"), Ok(()));
        let mut zero = good.clone();
        zero.set_tier(None, vec![Limit::per_second("s", 0)]);
        assert!(
            zero.check("t:rl")
                .unwrap_err()
                .to_string()
                .contains("quota")
        );
        let mut caller = good;
        let key = Key::new("t", b"a");
        caller.set_caller(key, vec![Limit::per_second("s", 0)]);
        let error = caller.check("t:rl").unwrap_err().to_string();
        assert!(error.starts_with(&format!("caller {key}: ")), "{error}");
        // a quota the sliding log cannot keep, which GCRA can
        let big = LimitTable::with_defaults(0, [(None, vec![Limit::per_second("s", 200_000)])]);
        assert!(big.check("t:rl").is_err());
        assert_eq!(big.with_algorithm(Algorithm::Gcra).check("t:rl"), Ok(()));
    }
}
