//! [`RateLimitConfig`]: a rate-limit layer's settings as a configuration file writes them
//! (feature `serde`).

use std::collections::BTreeMap;

use serde::Deserialize;

use super::builder::RateLimitLayerBuilder;
use crate::on_error::OnStoreError;
use crate::rate::{Algorithm, Limit};

/// A rate-limit layer's settings from a configuration file; what is left out keeps the
/// builder's default. Applied with [`RateLimitLayerBuilder::config`]; the key extractor, the cost
/// and the rejection stay code.
///
/// ```
/// use tollgate::rate_limit::{Algorithm, RateLimitConfig, RateLimitLayer};
/// use tollgate::store::MemoryStore;
///
/// let config: RateLimitConfig = serde_json::from_str(
///     r#"{
///         "limits": [
///             { "name": "burst", "quota": 10, "window": "1s" },
///             { "name": "hourly", "quota": 1000, "window": "1h" }
///         ],
///         "tiers": { "paid": [{ "name": "hourly", "quota": 100000, "window": "1h" }] },
///         "algorithm": "gcra",
///         "on_store_error": { "local_fallback": { "copies": 3 } }
///     }"#,
/// )
/// .unwrap();
/// let layer = RateLimitLayer::builder(MemoryStore::new())
///     .config(config)
///     .tier_by(|parts| parts.extensions.get::<&'static str>().copied())
///     .build()
///     .unwrap();
/// assert_eq!(layer.policy().algorithm(), Algorithm::Gcra);
/// assert_eq!(layer.policy().limits().len(), 2);
/// assert_eq!(layer.tier_policy("paid").limits()[0].quota(), 100_000);
/// ```
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default, deny_unknown_fields)]
#[non_exhaustive]
pub struct RateLimitConfig {
    /// The limits, added to the builder's.
    pub limits: Vec<Limit>,
    /// Named tiers and their limits, added to the builder's (see
    /// [`RateLimitLayerBuilder::tier`]); the closure that chooses among them stays code.
    pub tiers: BTreeMap<String, Vec<Limit>>,
    /// `"sliding-log"`, `"sliding-counter"` or `"gcra"`.
    pub algorithm: Option<Algorithm>,
    /// The key prefix.
    pub prefix: Option<String>,
    /// `"allow"`, `"deny"` or `{ "local_fallback": { "copies": n } }`.
    pub on_store_error: Option<OnStoreError>,
    /// Whether admitted responses carry the `RateLimit` headers.
    pub headers_on_success: Option<bool>,
    /// Whether the deny cache is on.
    pub deny_cache: Option<bool>,
    /// Shadow mode: decide and count, never reject.
    pub shadow: Option<bool>,
    /// Whether `RateLimit` members carry the caller's `pk`.
    pub partition_key: Option<bool>,
}

impl<K> RateLimitLayerBuilder<K> {
    /// Applies `config` (feature `serde`): its limits are added, every setting it gives
    /// replaces the builder's.
    pub fn config(mut self, config: RateLimitConfig) -> Self {
        self = self.limits(config.limits);
        for (name, limits) in config.tiers {
            self = self.tier(name, limits);
        }
        if let Some(algorithm) = config.algorithm {
            self = self.algorithm(algorithm);
        }
        if let Some(prefix) = config.prefix {
            self = self.prefix(prefix);
        }
        if let Some(policy) = config.on_store_error {
            self = self.on_store_error(policy);
        }
        if let Some(enabled) = config.headers_on_success {
            self = self.headers_on_success(enabled);
        }
        if let Some(enabled) = config.deny_cache {
            self = self.deny_cache(enabled);
        }
        if let Some(enabled) = config.shadow {
            self = self.shadow(enabled);
        }
        if let Some(enabled) = config.partition_key {
            self = self.partition_key(enabled);
        }
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rate_limit::RateLimitLayer;
    use crate::store::MemoryStore;

    fn build(toml: &str) -> Result<(), String> {
        let config: RateLimitConfig = toml::from_str(toml).map_err(|e| e.to_string())?;
        let layer = RateLimitLayer::builder(MemoryStore::new())
            .config(config)
            .tier_by(|_| None::<&str>)
            .build();
        layer.map(drop).map_err(|e| e.to_string())
    }

    #[test]
    fn a_window_that_is_not_one_says_what_to_write_and_where() {
        let error = build(
            "[[limits]]\nname = \"burst\"\nquota = 10\nwindow = \"1s\"\n\n\
             [[limits]]\nname = \"hourly\"\nquota = 100\nwindow = 1.5\n",
        )
        .unwrap_err();
        assert!(
            error.contains("invalid window 1.5: write whole seconds"),
            "{error}"
        );
        assert!(error.contains("line 9"), "the entry's line: {error}");
        let error =
            build("limits = [{ name = \"m\", quota = 1, window = \"5 minutes\" }]").unwrap_err();
        assert!(error.contains("invalid window \"5 minutes\""), "{error}");
    }

    #[test]
    fn errors_name_the_tier_and_the_prefix_as_written() {
        let error = build(
            "limits = [{ name = \"m\", quota = 5, window = 60 }]\n\
             [tiers]\npaid = [{ name = \"burst\", quota = 0, window = \"1s\" }]\n",
        )
        .unwrap_err();
        assert_eq!(
            error,
            "rate limit \"tollgate\": tier \"paid\": limit \"burst\" has a zero quota"
        );
        let error = build(
            "prefix = \"myapp:{api}\"\nlimits = [{ name = \"m\", quota = 5, window = 60 }]\n",
        )
        .unwrap_err();
        assert!(error.contains("\"myapp:{api}\""), "{error}");
        assert!(
            !error.contains(":rl"),
            "a namespace the user never wrote: {error}"
        );
    }
}
