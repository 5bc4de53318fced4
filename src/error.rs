//! Configuration errors, reported when a layer is built rather than at request time.

use std::fmt;

/// A layer's configuration is invalid: a zero quota or window, a bad limit name, an unparseable
/// CIDR, and so on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigError(String);

impl ConfigError {
    pub(crate) fn new(msg: impl Into<String>) -> Self {
        Self(msg.into())
    }
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for ConfigError {}
