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

/// Checks a store key prefix: visible ASCII without braces, so that it can neither select a
/// Redis Cluster hash slot nor split a key's hash tag.
pub(crate) fn check_prefix(prefix: &str) -> Result<(), ConfigError> {
    if !prefix.is_empty()
        && prefix
            .bytes()
            .all(|b| b.is_ascii_graphic() && b != b'{' && b != b'}')
    {
        Ok(())
    } else {
        Err(ConfigError::new(format!(
            "invalid key prefix {prefix:?}: use visible ASCII without braces"
        )))
    }
}
