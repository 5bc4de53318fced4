//! Building a layer: the configuration checked, its tiers and rate client made.

use std::sync::Arc;

use super::{Draft, RateLimitLayerBuilder};
use crate::error::{ConfigError, ConfigErrorKind};
use crate::headers::QuotaUnit;
use crate::in_force::InForce;
use crate::key::KeyExtractor;
use crate::keyspace;
use crate::rate_client::{LONGEST_PATIENCE, Queue, RateClient, TierOptions, TierRecipe};
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

    /// Builds the layer with its limits kept in the store, shared by every copy: the limits
    /// this builder sets are the defaults, and the store's table of the layer's namespace
    /// decides what is in force (see [`LimitTable`](crate::rate::LimitTable) and
    /// `docs/limits.md`). Reads the table first: seeds it with these limits when the store
    /// has none; replaces its defaults when [`limits_revision`](Self::limits_revision) is
    /// higher than the revision that wrote them; else decides with the store's (and logs,
    /// once, when they differ from these). Then reads it again every
    /// [`limits_refresh`](Self::limits_refresh). Changes go through
    /// [`RateLimitLayer::limits`].
    ///
    /// A store that cannot be read at the start does not fail the build: the layer decides with
    /// these limits until a read succeeds (logged).
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")] async fn main() {
    /// use tollgate::rate_limit::{Limit, RateLimitLayer};
    /// use tollgate::store::MemoryStore;
    ///
    /// let store = MemoryStore::new();
    /// let first = RateLimitLayer::builder(store.clone())
    ///     .limit(Limit::per_minute("api", 100))
    ///     .build_in_store()
    ///     .await
    ///     .unwrap();
    /// // a copy built with other limits decides with those in force
    /// let second = RateLimitLayer::builder(store.clone())
    ///     .limit(Limit::per_minute("api", 200))
    ///     .build_in_store()
    ///     .await
    ///     .unwrap();
    /// assert_eq!(second.policy().limits()[0].quota(), 100);
    /// // unless its revision is higher
    /// let third = RateLimitLayer::builder(store)
    ///     .limit(Limit::per_minute("api", 300))
    ///     .limits_revision(1)
    ///     .build_in_store()
    ///     .await
    ///     .unwrap();
    /// assert_eq!(third.policy().limits()[0].quota(), 300);
    /// # }
    /// ```
    ///
    /// # Errors
    ///
    /// As [`build`](Self::build); and a [`ConfigError`] of kind
    /// [`Store`](ConfigErrorKind::Store) when the store keeps no limits
    /// ([`RateStore::limits_store`](crate::store::RateStore::limits_store)).
    pub async fn build_in_store(mut self) -> Result<RateLimitLayer<K>, ConfigError>
    where
        K: KeyExtractor,
    {
        if self.draft.store.limits_store().is_none() {
            return Err(ConfigError::new(
                ConfigErrorKind::Store,
                "this store keeps no limits: build_in_store needs one that does",
            ));
        }
        self.draft.in_store = true;
        let layer = self.build()?;
        layer.settings.client.start_in_store().await;
        Ok(layer)
    }

    fn validated(self) -> Result<RateLimitLayer<K>, ConfigError>
    where
        K: KeyExtractor,
    {
        let mut draft = self.draft;
        let recipe = draft.recipe()?;
        let tiers = recipe.tiers(None)?;
        // shadow mode reaches the store with every request
        let deny_cache = draft.deny_cache && !draft.shadow;
        let mut client = RateClient::new(draft.store, tiers, deny_cache, draft.on_store_error);
        if let Some(patience) = draft.queue.filter(|_| !draft.shadow) {
            if patience > LONGEST_PATIENCE {
                return Err(ConfigError::new(
                    ConfigErrorKind::Limit,
                    "a queue's patience is at most a day",
                ));
            }
            if draft.max_waiting == 0 {
                return Err(ConfigError::new(
                    ConfigErrorKind::Limit,
                    "max_waiting must be at least 1 for a queue to hold anyone",
                ));
            }
            client = client.with_queue(Queue::new(patience, draft.max_waiting));
        }
        if draft.in_store {
            let in_store = InForce::new(recipe, draft.limits_revision, draft.limits_refresh);
            client = client.with_limits_in_store(in_store);
        }
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
    /// What the layer's tiers are made of: its own limits, the named tiers, and the
    /// per-request limits, each checked.
    fn recipe(&mut self) -> Result<TierRecipe, ConfigError> {
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
        let own = std::mem::take(&mut self.limits);
        let named = std::mem::take(&mut self.tiers);
        let needs_cost = match self.settle {
            Some(Settle::BodyBytes) => Some("settle_body_size"),
            Some(Settle::Stream(_)) => Some("settle_stream"),
            _ => None,
        };
        if let Some(settle) = needs_cost.filter(|_| self.cost.is_none()) {
            return Err(ConfigError::new(
                ConfigErrorKind::Limit,
                format!("{settle} needs .cost(..): the most a response may use, reserved first"),
            ));
        }
        if self.tier_by.is_some() && named.is_empty() {
            return Err(ConfigError::new(
                ConfigErrorKind::Limit,
                "tier_by needs named tiers to choose among",
            ));
        }
        Ok(TierRecipe {
            limiter: Arc::from(options.namespace.as_str()),
            own,
            named,
            select: self.tier_by.take(),
            limits_by: self.limits_by.take(),
            options,
        })
    }
}
