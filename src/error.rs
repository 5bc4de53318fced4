//! Configuration errors, reported when a layer or store is built rather than at request time.

use std::fmt;

/// A boxed error, as body errors and error sources are passed on.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// A configuration is invalid: a zero quota or window, a bad limit name, a key prefix that could
/// split a hash tag, an unparseable store URL, and so on. [`kind`](Self::kind) says which part;
/// the message names the value.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigError {
    kind: ConfigErrorKind,
    message: String,
}

/// What part of a configuration a [`ConfigError`] is about.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum ConfigErrorKind {
    /// A store key prefix: it must be visible ASCII without braces.
    Prefix,
    /// A rate limit: its name, quota or window, or the set of limits.
    Limit,
    /// A failure policy, such as a local fallback for zero copies.
    FailurePolicy,
    /// A duration out of range, such as an idempotency lease or retention.
    Duration,
    /// The methods an idempotency layer covers.
    Methods,
    /// An idempotency layer whose scope was not chosen.
    Scope,
    /// How to reach the store: a URL that does not parse, or none at all.
    Store,
}

impl ConfigError {
    pub(crate) fn new(kind: ConfigErrorKind, message: impl Into<String>) -> Self {
        Self {
            kind,
            message: message.into(),
        }
    }

    /// What part of the configuration is wrong.
    pub fn kind(&self) -> ConfigErrorKind {
        self.kind
    }

    /// The same error, said of `place` (`tier "paid"`, say): `<place>: <message>`.
    pub(crate) fn within(mut self, place: &str) -> Self {
        self.message = format!("{place}: {}", self.message);
        self
    }
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for ConfigError {}
