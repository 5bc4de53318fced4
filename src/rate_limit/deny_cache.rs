//! The local deny cache: a copy remembers "denied until T" for a caller, and denies that caller's
//! requests of the same or larger cost without a store round trip until T.
//!
//! It caches a store decision, never counts: every algorithm needs at least as long to make room
//! for a larger cost, and other requests only use room up, so a cached denial is one the store
//! would give as well. It cannot admit anything.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use tokio::time::Instant;

use super::decision::{DecisionSource, RateLimitDecision};
use crate::key::Key;

/// Entries beyond this are not cached (expired ones are dropped first): a flood of distinct
/// callers cannot grow the cache without bound.
const CAPACITY: usize = 10_000;

#[derive(Debug, Default)]
pub(crate) struct DenyCache {
    entries: Mutex<Entries>,
}

#[derive(Debug, Default)]
struct Entries {
    map: HashMap<Key, Denial>,
    /// When a full cache was last swept: a flood of distinct callers must not make every denial
    /// scan the whole cache.
    swept: Option<Instant>,
}

#[derive(Debug)]
struct Denial {
    until: Instant,
    at: Instant,
    cost: u64,
    decision: RateLimitDecision,
}

impl DenyCache {
    /// Remembers a denial by the store.
    pub(crate) fn remember(&self, decision: &RateLimitDecision) {
        let now = Instant::now();
        let Some(until) = now.checked_add(decision.retry_after) else {
            return;
        };
        if decision.retry_after.is_zero() {
            return;
        }
        let mut entries = self.entries.lock().unwrap_or_else(|p| p.into_inner());
        if entries.map.len() >= CAPACITY {
            if entries
                .swept
                .is_some_and(|at| now.duration_since(at) < Duration::from_secs(1))
            {
                return;
            }
            entries.swept = Some(now);
            entries.map.retain(|_, denial| denial.until > now);
            if entries.map.len() >= CAPACITY {
                return;
            }
        }
        entries.map.insert(
            decision.key,
            Denial {
                until,
                at: now,
                cost: decision.cost,
                decision: decision.clone(),
            },
        );
    }

    /// A denial for `key` at `cost` still in force, with its waits shortened by the time passed.
    pub(crate) fn check(&self, key: Key, cost: u64) -> Option<RateLimitDecision> {
        let now = Instant::now();
        let mut entries = self.entries.lock().unwrap_or_else(|p| p.into_inner());
        let denial = entries.map.get(&key)?;
        if denial.until <= now {
            entries.map.remove(&key);
            return None;
        }
        if cost < denial.cost {
            return None;
        }
        let elapsed = now - denial.at;
        let mut decision = denial.decision.clone();
        decision.cost = cost;
        decision.source = DecisionSource::DenyCache;
        decision.retry_after = (denial.until - now).max(Duration::from_millis(1));
        for state in &mut decision.states {
            state.reset = state.reset.saturating_sub(elapsed);
        }
        Some(decision)
    }
}
