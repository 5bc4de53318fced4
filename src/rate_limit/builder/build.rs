//! Building a layer: the configuration checked, its tiers and rate client made.

use std::sync::Arc;

use super::{Draft, RateLimitLayerBuilder};
use crate::error::{ConfigError, ConfigErrorKind};
use crate::headers::QuotaUnit;
use crate::key::KeyExtractor;
use crate::keyspace;
use crate::rate_client::{RateClient, Tier, TierOptions, Tiers};
use crate::rate_limit::RateLimitLayer;
use crate::rate_limit::settings::{Settings, Settle};

impl<K> RateLimitLayerBuilder<K> {
    /// Validates the configuration. An error names the layer by its prefix, and the tier and
    /// limit at fault: `rate limit "tollgate": tier "pro": limit "burst": …`.
    pub fn build(self) -> Result<RateLimitLayer<K>, ConfigError>
    where
        K: KeyExtractor,
    {
        let layer = format!("rate limit {:?}", self.draft.prefix);
        self.validated().map_err(|e| e.within(&layer))
    }

    fn validated(self) -> Result<RateLimitLayer<K>, ConfigError>
    where
        K: KeyExtractor,
    {
        let mut draft = self.draft;
        let tiers = draft.tiers()?;
        // shadow mode reaches the store with every request
        let deny_cache = draft.deny_cache && !draft.shadow;
        let client = RateClient::new(draft.store, tiers, deny_cache, draft.on_store_error);
        Ok(RateLimitLayer {
            settings: Arc::new(Settings {
                client: Arc::new(client),
                cost: draft.cost,
                settle: draft.settle,
                missing_key: draft.missing_key,
                missing_key_message: format!(
                    "the request carries no rate-limit key: it is read from {}",
                    self.extractor.describe()
                )
                .into(),
                headers: draft.headers,
                shadow: draft.shadow,
                partition_key: draft.partition_key,
                rejection: draft.rejection,
                grpc_metadata: draft.grpc_metadata,
            }),
            extractor: Arc::new(self.extractor),
        })
    }
}

impl Draft {
    /// The layer's tiers: its own limits, the named tiers, and the per-request limits, each
    /// checked.
    fn tiers(&mut self) -> Result<Tiers, ConfigError> {
        // checked as written: the namespace adds `:rl`, which the user never wrote
        keyspace::check_prefix(&self.prefix)?;
        let options = TierOptions {
            namespace: keyspace::rate_namespace(&self.prefix),
            algorithm: self.algorithm,
            unit: self
                .quota_unit
                .or(self.cost.is_some().then_some(QuotaUnit::Request)),
            on_store_error: self.on_store_error,
            fallback_capacity: self.fallback_capacity,
            fallback_admits_when_full: self.fallback_admits_when_full,
            store: Arc::clone(&self.store),
            settles: self.settle.is_some(),
        };
        let own = Tier::new(None, std::mem::take(&mut self.limits), &options)?;
        let named = std::mem::take(&mut self.tiers)
            .into_iter()
            .map(|(name, limits)| Tier::new(Some(name), limits, &options))
            .collect::<Result<Vec<_>, _>>()?;
        if matches!(self.settle, Some(Settle::BodyBytes)) && self.cost.is_none() {
            return Err(ConfigError::new(
                ConfigErrorKind::Limit,
                "settle_body_size needs .cost(..): the most a response may use, reserved first",
            ));
        }
        if self.tier_by.is_some() && named.is_empty() {
            return Err(ConfigError::new(
                ConfigErrorKind::Limit,
                "tier_by needs named tiers to choose among",
            ));
        }
        let tiers = Tiers::new(own, named, self.tier_by.take())?;
        Ok(match self.limits_by.take() {
            Some(limits_by) => tiers.with_limits_by(limits_by, options),
            None => tiers,
        })
    }
}
