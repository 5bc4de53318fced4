//! [`TierRecipe`]: how a rate-limit layer's tiers are made — from the limits its code writes,
//! or from the limits in force that the store keeps ([`LimitTable`]).

use std::collections::HashMap;
use std::sync::Arc;

use super::tiers::{LimitsFn, Tier, TierFn, TierOptions, Tiers};
use crate::error::ConfigError;
use crate::in_force::Recipe;
use crate::rate::{Limit, LimitTable};

/// What a layer's tiers are made of: the names and limits its code gives them, the closures
/// that choose among them, and what every tier is built with.
pub(crate) struct TierRecipe {
    /// The layer's own limits, as the code writes them.
    pub(crate) own: Vec<Limit>,
    /// The named tiers, as the code writes them.
    pub(crate) named: Vec<(String, Vec<Limit>)>,
    pub(crate) select: Option<TierFn>,
    pub(crate) limits_by: Option<LimitsFn>,
    pub(crate) options: TierOptions,
    /// The `limiter` label of the metrics: the namespace.
    pub(crate) limiter: Arc<str>,
}

debug_fields!(TierRecipe { own, named });

impl TierRecipe {
    /// The tiers: each with the limits `table` has in force for it, else those the code writes;
    /// and each caller's override in `table` a tier of its own (under the layer's own names,
    /// one per distinct set of limits). An error names the tier or caller at fault.
    pub(crate) fn tiers(&self, table: Option<&LimitTable>) -> Result<Tiers, ConfigError> {
        let limits = |tier: Option<&str>, code: &[Limit]| {
            table
                .and_then(|t| t.for_tier(tier))
                .unwrap_or(code)
                .to_vec()
        };
        let own = Tier::new(None, limits(None, &self.own), &self.options)?;
        let named = self
            .named
            .iter()
            .map(|(name, code)| {
                let limits = limits(Some(name), code);
                Tier::new(Some(name.clone()), limits, &self.options)
            })
            .collect::<Result<Vec<_>, _>>()?;
        let mut tiers = Tiers::new(own, named, self.select.clone())?;
        if let Some(limits_by) = &self.limits_by {
            tiers = tiers.with_limits_by(Arc::clone(limits_by), self.options.clone());
        }
        // a tier of the table this copy's code does not name (another version's) is not its
        // business: it is left out, not refused
        let Some(table) = table else {
            return Ok(tiers);
        };
        let mut built: HashMap<&[Limit], Arc<Tier>> = HashMap::new();
        let mut callers = HashMap::new();
        for (key, limits) in table.overrides() {
            let tier = match built.get(limits) {
                Some(tier) => Arc::clone(tier),
                None => {
                    let tier = Tier::new(None, limits.to_vec(), &self.options)
                        .map_err(|e| e.within(&format!("caller {key}")))?;
                    let tier = Arc::new(tier);
                    built.insert(limits, Arc::clone(&tier));
                    tier
                }
            };
            callers.insert(key, tier);
        }
        Ok(tiers.with_callers(callers))
    }
}

impl Recipe for TierRecipe {
    type Built = Tiers;

    fn namespace(&self) -> &str {
        &self.options.namespace
    }

    fn limiter(&self) -> &Arc<str> {
        &self.limiter
    }

    fn defaults(&self, revision: u64) -> LimitTable {
        let named = self
            .named
            .iter()
            .map(|(name, limits)| (Some(name.clone()), limits.clone()));
        LimitTable::with_defaults(
            revision,
            std::iter::once((None, self.own.clone())).chain(named),
        )
        .with_algorithm(self.options.algorithm)
    }

    fn build(&self, table: &LimitTable) -> Result<Tiers, ConfigError> {
        self.tiers(Some(table))
    }

    fn has_tier(&self, tier: Option<&str>) -> bool {
        tier.is_none_or(|tier| self.named.iter().any(|(name, _)| name == tier))
    }

    /// The tiers replaced give back, in the background, what they hold of leased slices.
    fn replaced(&self, old: Arc<Tiers>) {
        let leased: Vec<_> = old
            .all()
            .into_iter()
            .filter_map(|tier| tier.leases.clone())
            .collect();
        if leased.is_empty() {
            return;
        }
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(async move {
                for leases in leased {
                    leases.give_back_all().await;
                }
            });
        }
    }
}
