//! Configuration from the environment, shared by the `grpc` and `hyper` examples (the latter
//! includes this file with `#[path = "../grpc/config.rs"]`).
//!
//! | variable     | default                     | meaning                                        |
//! | ------------ | --------------------------- | ---------------------------------------------- |
//! | `PORT`       | per example                 | serve on `127.0.0.1:$PORT` (0: any free port)  |
//! | `REDIS_URL`  | unset: in-memory store      | the store all copies share                     |
//! | `APP_LIMITS` | `burst:5/1s,minute:100/60s` | the limits: `name:count/<seconds>s,…`          |
//!
//! A variable that is unset or empty takes its default; an invalid one is an [`EnvError`] naming
//! it (the examples then exit with status 2).

use std::sync::Arc;
use std::time::Duration;
use std::{env, fmt};

use tollgate::rate_limit::{Algorithm, Limit, RatePolicy};
use tollgate::store::{MemoryStore, Store};

/// The limits when `APP_LIMITS` is not set.
pub const DEFAULT_LIMITS: &str = "burst:5/1s,minute:100/60s";

/// What `PORT` must look like.
pub const PORT_FORMAT: &str = "a TCP port number from 0 to 65535, e.g. PORT=50051";

/// What `APP_LIMITS` must look like.
pub const LIMITS_FORMAT: &str =
    "comma-separated name:count/<seconds>s entries, e.g. APP_LIMITS=burst:5/1s,minute:100/60s";

/// What `REDIS_URL` must look like.
pub const REDIS_URL_FORMAT: &str = "a Redis URL, e.g. REDIS_URL=redis://127.0.0.1:6379/";

/// An example server's configuration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Config {
    /// `PORT`: served on `127.0.0.1:<port>` (0: any free port).
    pub port: u16,
    /// `REDIS_URL`: the shared store; `None` means an in-memory store for this process only.
    pub redis_url: Option<String>,
    /// `APP_LIMITS`: the rate limits, all checked together.
    pub limits: Vec<Limit>,
}

impl Config {
    /// Reads `PORT` (default `default_port`), `REDIS_URL` and `APP_LIMITS` from the environment.
    pub fn from_env(default_port: u16) -> Result<Self, EnvError> {
        Self::from_lookup(default_port, |name| match env::var(name) {
            Ok(value) => Some(value),
            Err(env::VarError::NotPresent) => None,
            // Not UTF-8: keep it visible (and invalid) rather than pretend it is unset.
            Err(env::VarError::NotUnicode(raw)) => Some(raw.to_string_lossy().into_owned()),
        })
    }

    /// Like [`Config::from_env`], with the variables read through `lookup`.
    pub fn from_lookup(
        default_port: u16,
        lookup: impl Fn(&str) -> Option<String>,
    ) -> Result<Self, EnvError> {
        let var = |name: &str| lookup(name).filter(|v| !v.trim().is_empty());
        let port = match var("PORT") {
            Some(value) => parse_port(&value)
                .map_err(|problem| EnvError::new("PORT", &value, problem, PORT_FORMAT))?,
            None => default_port,
        };
        let limits_value = var("APP_LIMITS").unwrap_or_else(|| DEFAULT_LIMITS.to_owned());
        let limits = parse_limits(&limits_value).map_err(|problem| {
            EnvError::new("APP_LIMITS", &limits_value, problem, LIMITS_FORMAT)
        })?;
        let redis_url = var("REDIS_URL").map(|url| url.trim().to_owned());
        Ok(Self {
            port,
            redis_url,
            limits,
        })
    }

    /// The limits as `name:count/<seconds>s,…`, for the startup message.
    pub fn describe_limits(&self) -> String {
        self.limits
            .iter()
            .map(|l| format!("{}:{}/{}s", l.name(), l.quota(), l.window().as_secs()))
            .collect::<Vec<_>>()
            .join(",")
    }

    /// The store named by `REDIS_URL`, or — with a warning on stderr — a memory store whose
    /// limits and idempotency records hold for this one process only.
    pub fn open_store(&self) -> Result<Arc<dyn Store>, EnvError> {
        let Some(url) = self.redis_url.as_deref() else {
            eprintln!(
                "warning: REDIS_URL is not set: using an in-memory store, so rate limits and \
                 idempotency records hold for this one process only (copies of the server do \
                 not share them). Set e.g. REDIS_URL=redis://127.0.0.1:6379/ to share them."
            );
            return Ok(Arc::new(MemoryStore::new()));
        };
        redis_store(url)
    }
}

#[cfg(feature = "redis")]
fn redis_store(url: &str) -> Result<Arc<dyn Store>, EnvError> {
    match tollgate::store::RedisStore::builder(url).build() {
        Ok(store) => Ok(Arc::new(store)),
        Err(e) => Err(EnvError::new(
            "REDIS_URL",
            &redact_url(url),
            e.to_string(),
            REDIS_URL_FORMAT,
        )),
    }
}

#[cfg(not(feature = "redis"))]
fn redis_store(url: &str) -> Result<Arc<dyn Store>, EnvError> {
    Err(EnvError::new(
        "REDIS_URL",
        &redact_url(url),
        "tollgate was built without its `redis` feature",
        "REDIS_URL unset, or a build with the `redis` feature",
    ))
}

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

/// Parses `APP_LIMITS`: comma-separated `name:count/<seconds>s` entries, e.g.
/// `burst:5/1s,minute:100/60s`; counts and windows are whole numbers of at least 1, names are
/// used once.
pub fn parse_limits(value: &str) -> Result<Vec<Limit>, String> {
    let limits = value
        .split(',')
        .map(|entry| parse_limit(entry.trim()))
        .collect::<Result<Vec<_>, _>>()?;
    // The crate's own validation: names, duplicates, ranges.
    RatePolicy::new("check", Algorithm::default(), limits.clone()).map_err(|e| e.to_string())?;
    Ok(limits)
}

/// Parses one `name:count/<seconds>s` entry.
fn parse_limit(entry: &str) -> Result<Limit, String> {
    if entry.is_empty() {
        return Err("empty entry (two commas in a row, or one at an end)".to_owned());
    }
    let shape = || format!("{entry:?} is not name:count/<seconds>s");
    let (name, rest) = entry.split_once(':').ok_or_else(shape)?;
    let (count, window) = rest.split_once('/').ok_or_else(shape)?;
    let seconds = window.strip_suffix('s').ok_or_else(|| {
        format!("window {window:?} in {entry:?} is not a number of seconds ending in 's'")
    })?;
    let whole = |s: &str| -> Option<u64> {
        if s.is_empty() || !s.bytes().all(|b| b.is_ascii_digit()) {
            return None;
        }
        s.parse().ok()
    };
    let count = whole(count)
        .ok_or_else(|| format!("count {count:?} in {entry:?} is not a whole number"))?;
    let seconds = whole(seconds).ok_or_else(|| {
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

/// `url` with the password, if any, replaced by `***`, for error messages.
pub fn redact_url(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return url.to_owned();
    };
    let authority_end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    let (authority, path) = rest.split_at(authority_end);
    let Some((userinfo, host)) = authority.rsplit_once('@') else {
        return url.to_owned();
    };
    let user = match userinfo.split_once(':') {
        Some((user, _password)) => format!("{user}:***"),
        // `redis://secret@host` is a password-only URL for Redis.
        None if !userinfo.is_empty() => "***".to_owned(),
        None => String::new(),
    };
    format!("{scheme}://{user}@{host}{path}")
}

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
