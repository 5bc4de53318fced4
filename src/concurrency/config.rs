//! [`ConcurrencyConfig`]: a concurrency-limit layer's settings as a configuration file writes
//! them (feature `serde`).

use std::collections::BTreeMap;

use serde::Deserialize;

use super::layer::ConcurrencyLimitLayerBuilder;
use crate::on_error::OnStoreError;

/// A concurrency-limit layer's settings from a configuration file; what is left out keeps the
/// builder's default. Applied with [`ConcurrencyLimitLayerBuilder::config`]; the key extractor
/// and the closure that chooses a tier stay code.
///
/// ```
/// use tollgate::concurrency::{ConcurrencyConfig, ConcurrencyLimitLayer};
/// use tollgate::store::MemoryStore;
///
/// /// The caller's plan, inserted by the authentication layer.
/// #[derive(Clone)]
/// struct Plan(&'static str);
///
/// let config: ConcurrencyConfig = toml::from_str(
///     r#"
///     limit = 2
///     prefix = "jobs"
///     on_store_error = { local_fallback = { copies = 3 } }
///
///     [tiers]
///     pro = 10
///     enterprise = 50
///     "#,
/// )
/// .unwrap();
/// let layer = ConcurrencyLimitLayer::builder(MemoryStore::new())
///     .config(config)
///     // the plan that authentication inserted, never a header the client writes
///     .tier_by(|parts| parts.extensions.get::<Plan>().map(|plan| plan.0))
///     .build()
///     .unwrap();
/// assert_eq!(layer.limit(), 2);
/// assert_eq!((layer.tier_limit("pro"), layer.tier_limit("enterprise")), (10, 50));
/// ```
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default, deny_unknown_fields)]
#[non_exhaustive]
pub struct ConcurrencyConfig {
    /// The layer's own limit: requests per key in flight.
    pub limit: Option<u32>,
    /// Named tiers and their limits, added to the builder's (see
    /// [`ConcurrencyLimitLayerBuilder::tier`]); the closure that chooses among them stays code.
    pub tiers: BTreeMap<String, u32>,
    /// The key prefix.
    pub prefix: Option<String>,
    /// `"allow"`, `"deny"` or `{ "local_fallback": { "copies": n } }`.
    pub on_store_error: Option<OnStoreError>,
    /// The policy name the limit is advertised under in the IETF headers (see
    /// [`ConcurrencyLimitLayerBuilder::advertise`]).
    pub advertise: Option<String>,
}

impl<K> ConcurrencyLimitLayerBuilder<K> {
    /// Applies `config` (feature `serde`): its tiers are added, every setting it gives replaces
    /// the builder's.
    pub fn config(mut self, config: ConcurrencyConfig) -> Self {
        if let Some(limit) = config.limit {
            self = self.limit(limit);
        }
        for (name, limit) in config.tiers {
            self = self.tier(name, limit);
        }
        if let Some(prefix) = config.prefix {
            self = self.prefix(prefix);
        }
        if let Some(policy) = config.on_store_error {
            self = self.on_store_error(policy);
        }
        if let Some(name) = config.advertise {
            self = self.advertise(name);
        }
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::concurrency::ConcurrencyLimitLayer;
    use crate::store::MemoryStore;

    #[test]
    fn errors_name_the_layer_and_the_tier_from_the_file() {
        let config: ConcurrencyConfig =
            toml::from_str("limit = 2\nprefix = \"jobs\"\n[tiers]\npro = 0\n").unwrap();
        let error = ConcurrencyLimitLayer::builder(MemoryStore::new())
            .config(config)
            .tier_by(|_| None)
            .build()
            .unwrap_err();
        assert_eq!(
            error.to_string(),
            "concurrency limit \"jobs\": tier \"pro\" needs a name and a limit >= 1, got 0"
        );
    }

    #[test]
    fn unknown_fields_are_refused() {
        let error = toml::from_str::<ConcurrencyConfig>("limits = 2\n").unwrap_err();
        assert!(
            error.to_string().contains("unknown field `limits`"),
            "{error}"
        );
    }
}
