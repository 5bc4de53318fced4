//! The limits a concurrency-limit layer decides with ([`InFlight`]), and how they are made of
//! the limits in force that the store keeps ([`InFlightRecipe`]).

use std::collections::HashMap;
use std::sync::Arc;

use crate::error::{ConfigError, ConfigErrorKind};
use crate::in_force::Recipe;
use crate::key::Key;
use crate::rate::LimitTable;

/// The limits of requests in flight a layer decides with: its own, its tiers', and callers'
/// own — replaced whole when the limits in force change.
#[derive(Debug)]
pub(crate) struct InFlight {
    own: u32,
    tiers: Vec<(Box<str>, u32)>,
    callers: HashMap<Key, u32>,
}

impl InFlight {
    /// The layer's own limit.
    pub(crate) fn own(&self) -> u32 {
        self.own
    }

    /// The limit of tier `name`, or the layer's own.
    pub(crate) fn tier(&self, name: &str) -> u32 {
        let tier = self.tiers.iter().find(|(tier, _)| &**tier == name);
        tier.map_or(self.own, |&(_, limit)| limit)
    }

    /// The limit of a request of tier `tier` by caller `key`: the caller's own, else its
    /// tier's, else the layer's.
    pub(crate) fn of(&self, tier: Option<&str>, key: Option<&Key>) -> u32 {
        if let Some(&limit) = key.and_then(|key| self.callers.get(key)) {
            return limit;
        }
        tier.map_or(self.own, |name| self.tier(name))
    }
}

/// How a concurrency-limit layer's limits are made: its code's, or those in force.
pub(crate) struct InFlightRecipe {
    /// `<prefix>:cc`: the namespace and the metrics' `limiter` label.
    pub(crate) namespace: Arc<str>,
    pub(crate) own: u32,
    pub(crate) tiers: Vec<(Box<str>, u32)>,
}

impl InFlightRecipe {
    /// The limits as the code writes them.
    pub(crate) fn code(&self) -> InFlight {
        InFlight {
            own: self.own,
            tiers: self.tiers.clone(),
            callers: HashMap::new(),
        }
    }
}

impl Recipe for InFlightRecipe {
    type Built = InFlight;

    fn namespace(&self) -> &str {
        &self.namespace
    }

    fn limiter(&self) -> &Arc<str> {
        &self.namespace
    }

    fn defaults(&self, revision: u64) -> LimitTable {
        let named = self
            .tiers
            .iter()
            .map(|(name, n)| (Some(name.to_string()), *n));
        LimitTable::in_flight(revision, std::iter::once((None, self.own)).chain(named))
    }

    /// Each tier's limit in force, else the code's; each caller's own. A table of a rate
    /// limit, or an entry that is not one limit of requests in flight, is refused.
    fn build(&self, table: &LimitTable) -> Result<InFlight, ConfigError> {
        if !table.is_in_flight() {
            return Err(ConfigError::new(
                ConfigErrorKind::Limit,
                "the table is a rate limit's, not a concurrency limit's",
            ));
        }
        table.check(&self.namespace)?;
        let limit = |tier: Option<&str>, code: u32| {
            table
                .for_tier(tier)
                .and_then(LimitTable::in_flight_of)
                .unwrap_or(code)
        };
        let tiers = self
            .tiers
            .iter()
            .map(|(name, code)| (name.clone(), limit(Some(name), *code)))
            .collect();
        let callers = table
            .overrides()
            .into_iter()
            .filter_map(|(key, limits)| Some((key, LimitTable::in_flight_of(limits)?)))
            .collect();
        Ok(InFlight {
            own: limit(None, self.own),
            tiers,
            callers,
        })
    }

    fn has_tier(&self, tier: Option<&str>) -> bool {
        tier.is_none_or(|tier| self.tiers.iter().any(|(name, _)| &**name == tier))
    }
}
