//! What the `app`, `grpc` and `hyper` examples share: reading `PORT`, `REDIS_URL`, `APP_LIMITS`
//! and `APP_ALGORITHM`, the [`EnvError`] that names a bad variable, opening the store, and the
//! startup steps around them (listening, exit statuses).
//!
//! Each example includes this file at its crate root, `#[path = "../shared/env.rs"] pub mod
//! env;`, and so must every test binary that includes a module of an example that reads its
//! configuration (`examples/app/router.rs`, `examples/grpc/config.rs`), e.g. from
//! `tests/app/main.rs`: `#[path = "../../examples/shared/env.rs"] pub mod env;` — `pub`, so
//! that `unreachable_pub` and `dead_code` stay quiet. This directory has no `main.rs`, so it is
//! no example of its own.
//!
//! A variable that is unset or empty takes its default; an invalid one is an [`EnvError`] naming
//! it, and the examples then exit with status 2.

#[path = "startup.rs"]
mod startup;
pub use startup::*;

use std::fmt;
use std::net::{Ipv4Addr, SocketAddr};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use tokio::net::TcpListener;
use tollgate::rate::{Algorithm, Limit, RatePolicy};
use tollgate::store::{MemoryStore, Store};

/// The limits when `APP_LIMITS` is not set.
pub const DEFAULT_LIMITS: &str = "burst:5/1s,minute:100/60s";

/// What `APP_LIMITS` must look like.
pub const LIMITS_FORMAT: &str =
    "comma-separated name:count/<seconds>s entries, e.g. APP_LIMITS=burst:5/1s,minute:100/60s";

/// What `APP_ALGORITHM` must look like.
pub const ALGORITHM_FORMAT: &str = "one of sliding-log (the default), sliding-counter, gcra";

/// What `REDIS_URL` must look like.
pub const REDIS_URL_FORMAT: &str = "a Redis URL, e.g. REDIS_URL=redis://127.0.0.1:6379/";

/// Exit status for an invalid configuration (or command line).
pub const EXIT_CONFIG: u8 = 2;

/// Exit status for any other failure.
pub const EXIT_FAILURE: u8 = 1;

// ---------------------------------------------------------------------------------------------
// Reading variables
// ---------------------------------------------------------------------------------------------

/// The variable `name` of this process's environment, for [`Vars::new`]; `None` when unset.
pub fn process_var(name: &str) -> Option<String> {
    match std::env::var(name) {
        Ok(value) => Some(value),
        Err(std::env::VarError::NotPresent) => None,
        // Not UTF-8: keep it visible (and invalid) rather than pretend it is unset.
        Err(std::env::VarError::NotUnicode(raw)) => Some(raw.to_string_lossy().into_owned()),
    }
}

/// The variables of one configuration, read through a lookup ([`process_var`], or a table in
/// tests). A variable that is unset, empty or only white space reads as unset, so that it takes
/// its default.
pub struct Vars<L>(L);

impl<L: Fn(&str) -> Option<String>> Vars<L> {
    /// Variables read through `lookup`, which answers `None` for a variable that is unset.
    pub fn new(lookup: L) -> Self {
        Self(lookup)
    }

    /// The value of `name`; `None` when it is unset, empty or only white space.
    pub fn get(&self, name: &str) -> Option<String> {
        (self.0)(name).filter(|v| !v.trim().is_empty())
    }

    /// `PORT`, else `default`; `format` says what `PORT` must look like.
    pub fn port(&self, default: u16, format: &'static str) -> Result<u16, EnvError> {
        match self.get("PORT") {
            Some(value) => {
                parse_port(&value).map_err(|problem| EnvError::new("PORT", &value, problem, format))
            }
            None => Ok(default),
        }
    }

    /// `APP_LIMITS`, else [`DEFAULT_LIMITS`], held to `algorithm`'s bounds.
    pub fn limits(&self, algorithm: Algorithm) -> Result<Vec<Limit>, EnvError> {
        self.limits_of("APP_LIMITS", DEFAULT_LIMITS, algorithm)
    }

    /// Limits in the syntax of `APP_LIMITS` from `name`, else `default`, held to `algorithm`'s
    /// bounds (only the sliding log caps a quota: it keeps an entry per unit).
    pub fn limits_of(
        &self,
        name: &'static str,
        default: &str,
        algorithm: Algorithm,
    ) -> Result<Vec<Limit>, EnvError> {
        let value = self.get(name).unwrap_or_else(|| default.to_owned());
        parse_limits_for(&value, algorithm)
            .map_err(|problem| EnvError::new(name, &value, problem, LIMITS_FORMAT))
    }

    /// `APP_ALGORITHM`, else the default algorithm (`sliding-log`).
    pub fn algorithm(&self) -> Result<Algorithm, EnvError> {
        match self.get("APP_ALGORITHM") {
            Some(value) => parse_algorithm(&value).map_err(|problem| {
                EnvError::new("APP_ALGORITHM", &value, problem, ALGORITHM_FORMAT)
            }),
            None => Ok(Algorithm::default()),
        }
    }

    /// `name`, a whole number, or `default` when unset; `expected` says what it should look
    /// like (`milliseconds, e.g. APP_JOB_MS=200`).
    pub fn number(
        &self,
        name: &'static str,
        default: u64,
        expected: &'static str,
    ) -> Result<u64, EnvError> {
        match self.get(name) {
            Some(value) => whole_number(value.trim())
                .ok_or_else(|| EnvError::new(name, &value, "not a whole number", expected)),
            None => Ok(default),
        }
    }

    /// `name` as a comma-separated list, entries trimmed, empty ones dropped; empty when unset.
    pub fn list(&self, name: &str) -> Vec<String> {
        self.get(name)
            .map(|list| {
                list.split(',')
                    .map(|entry| entry.trim().to_owned())
                    .filter(|entry| !entry.is_empty())
                    .collect()
            })
            .unwrap_or_default()
    }

    /// `REDIS_URL`, trimmed; `None` means an in-memory store for this process only.
    pub fn redis_url(&self) -> Option<String> {
        self.get("REDIS_URL").map(|url| url.trim().to_owned())
    }
}

impl<L> fmt::Debug for Vars<L> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Vars").finish_non_exhaustive()
    }
}

// ---------------------------------------------------------------------------------------------
// Parsing values
// ---------------------------------------------------------------------------------------------

/// Parses `PORT`: a number from 0 to 65535.
pub fn parse_port(value: &str) -> Result<u16, String> {
    let value = value.trim();
    if value.is_empty() || !value.bytes().all(|b| b.is_ascii_digit()) {
        return Err(format!("{value:?} is not a port number"));
    }
    value
        .parse()
        .map_err(|_| format!("{value} is out of range (0 to 65535)"))
}

/// Parses `APP_ALGORITHM`: `sliding-log`, `sliding-counter` or `gcra`.
pub fn parse_algorithm(value: &str) -> Result<Algorithm, String> {
    let value = value.trim();
    value
        .parse()
        .map_err(|_| format!("unknown algorithm {value:?}"))
}

/// Parses `APP_LIMITS`: comma-separated `name:count/<seconds>s` entries, e.g.
/// `burst:5/1s,minute:100/60s`; an entry ending in `/calls` counts calls, whatever their cost
/// (`requests:100/1s/calls,tokens:10000/1s`: see `Limit::counting_calls`). Names are 1 to 64 ASCII letters, digits, `-`, `_` or `.`, each
/// used once; counts and windows are whole numbers of at least 1. Held to the default
/// algorithm's bounds (the sliding log's); [`parse_limits_for`] to another's.
pub fn parse_limits(value: &str) -> Result<Vec<Limit>, String> {
    parse_limits_for(value, Algorithm::default())
}

/// Parses `APP_LIMITS` (see [`parse_limits`]) for limits counted by `algorithm`: a quota over
/// [`MAX_LOG_QUOTA`](tollgate::rate::MAX_LOG_QUOTA) is refused for the sliding log only.
pub fn parse_limits_for(value: &str, algorithm: Algorithm) -> Result<Vec<Limit>, String> {
    let limits = value
        .split(',')
        .map(|entry| parse_limit(entry.trim()))
        .collect::<Result<Vec<_>, _>>()?;
    // The crate's own validation: names, duplicates, ranges, the algorithm's bounds. The
    // namespace is only checked, and any valid one gives the same answer.
    RatePolicy::new("check", algorithm, limits.clone()).map_err(|e| e.to_string())?;
    Ok(limits)
}

/// Parses one `name:count/<seconds>s` entry, or `name:count/<seconds>s/calls`.
fn parse_limit(entry: &str) -> Result<Limit, String> {
    if entry.is_empty() {
        return Err("empty entry (two commas in a row, or one at an end)".to_owned());
    }
    if let Some(limit) = entry.strip_suffix("/calls") {
        return parse_limit(limit).map(Limit::counting_calls);
    }
    let shape = || format!("{entry:?} is not name:count/<seconds>s");
    let (name, rest) = entry.split_once(':').ok_or_else(shape)?;
    let (count, window) = rest.split_once('/').ok_or_else(shape)?;
    let seconds = window.strip_suffix('s').ok_or_else(|| {
        format!("window {window:?} in {entry:?} is not a number of seconds ending in 's'")
    })?;
    let count = whole_number(count)
        .ok_or_else(|| format!("count {count:?} in {entry:?} is not a whole number"))?;
    let seconds = whole_number(seconds).ok_or_else(|| {
        format!("window {window:?} in {entry:?} is not a whole number of seconds")
    })?;
    if count == 0 {
        return Err(format!("count in {entry:?} must be at least 1"));
    }
    if seconds == 0 {
        return Err(format!("window in {entry:?} must be at least 1s"));
    }
    Ok(Limit::new(name, count, Duration::from_secs(seconds)))
}

/// ASCII digits only (no sign, no spaces), within `u64`.
pub fn whole_number(s: &str) -> Option<u64> {
    if s.is_empty() || !s.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    s.parse().ok()
}

/// `limits` as `name:count/<seconds>s[/calls],…`, for startup messages.
pub fn describe_limits(limits: &[Limit]) -> String {
    limits
        .iter()
        .map(|l| {
            let calls = if l.counts_calls() { "/calls" } else { "" };
            format!(
                "{}:{}/{}s{calls}",
                l.name(),
                l.quota(),
                l.window().as_secs()
            )
        })
        .collect::<Vec<_>>()
        .join(",")
}

/// `url` with every password replaced by `***`, for logs and error messages: the crate's own
/// redaction, which reads every connection-string form its stores accept.
pub use tollgate::store::redact_connection_string as redact_url;

/// An environment variable with a value the example cannot use.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EnvError {
    /// The variable, e.g. `APP_LIMITS`.
    pub var: &'static str,
    /// Its value (passwords in URLs masked).
    pub value: String,
    /// What is wrong with it.
    pub problem: String,
    /// What it should look like.
    pub expected: &'static str,
}

impl EnvError {
    /// `var` holds `value`, which is wrong because of `problem`; `expected` says what is right.
    pub fn new(
        var: &'static str,
        value: &str,
        problem: impl Into<String>,
        expected: &'static str,
    ) -> Self {
        Self {
            var,
            value: value.to_owned(),
            problem: problem.into(),
            expected,
        }
    }
}

impl fmt::Display for EnvError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "invalid {}={:?}: {}\n  expected: {}",
            self.var, self.value, self.problem, self.expected
        )
    }
}

impl std::error::Error for EnvError {}
