//! The local deny cache: a copy remembers "denied until T" for a caller, and denies that caller's
//! requests of the same or larger cost without a store round trip until T.
//!
//! It caches a store decision, never counts: every algorithm needs at least as long to make room
//! for a larger cost, and other requests only use room up, so a cached denial is one the store
//! would give as well. It cannot admit anything.
//!
//! T is counted from when the check was sent, not from when the reply came: the store decided
//! somewhere in between, so a slow reply must not stretch the denial beyond the store's.
//!
//! A reset, or a settlement that refunded the caller, through any copy makes a cached denial
//! stale. The store broadcasts it (see [`RateStore::invalidations`](crate::store::RateStore::invalidations)),
//! and the rate client drops the caller's entry when the word arrives (`invalidated.rs`): normally the
//! caller is admitted on every copy within about a round trip of the broadcast. When the
//! broadcast is lost (the subscriber's connection down, a store without one), the bound is
//! [`MAX_AGE`]: a denial is served from the cache for at most that long, however long the
//! store's wait, then the store is asked again (a denied caller flooding a copy still costs it
//! at most one store check per `MAX_AGE`). A subscriber that may have missed broadcasts says so,
//! and the whole cache is dropped. A denial whose check was sent before its caller was
//! forgotten (the reset's word overtook the reply) is not cached: the store may have decided it
//! before the reset.
//!
//! Callers are spread over [`SHARDS`] maps by a hash of their key, each behind its own lock, so
//! that requests of different callers seldom wait for one another.

use std::collections::HashMap;
use std::hash::{BuildHasher, RandomState};
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use tokio::time::Instant;

use super::source::DecisionSource;
use super::verdict::Verdict;
use crate::key::Key;
use crate::rate::RateCheck;

/// Entries beyond this are not cached (expired ones are dropped first): a flood of distinct
/// callers cannot grow the cache without bound. Each shard holds its share, `CAPACITY / SHARDS`.
const CAPACITY: usize = 10_000;

const SHARDS: usize = 16;

/// How long a denial is served from the cache before the store is asked again.
pub(crate) const MAX_AGE: Duration = Duration::from_secs(1);

#[derive(Debug)]
pub(crate) struct DenyCache {
    shards: Box<[Mutex<Entries>]>,
    /// Picks a caller's shard; keyed at random, so that nobody can aim callers at one shard.
    hasher: RandomState,
}

#[derive(Debug, Default)]
struct Entries {
    map: HashMap<Key, Denial>,
    /// When this full shard was last swept: a flood of distinct callers must not make every
    /// denial scan the whole shard.
    swept: Option<Instant>,
    /// When a denial of this shard was last forgotten (a reset or refund): a denial whose check
    /// was sent before then may have been decided before the reset, and is not cached.
    invalidated: Option<Instant>,
}

#[derive(Debug)]
struct Denial {
    /// Until when the store's wait runs.
    until: Instant,
    /// Until when the cache serves it: the store's wait, or [`MAX_AGE`] if that is sooner.
    expires: Instant,
    /// When the check that was denied was sent.
    at: Instant,
    cost: u64,
    verdict: Verdict,
}

impl Default for DenyCache {
    fn default() -> Self {
        Self {
            shards: (0..SHARDS).map(|_| Mutex::default()).collect(),
            hasher: RandomState::new(),
        }
    }
}

impl DenyCache {
    /// Remembers a denial by the store for a check sent at `sent_at`.
    pub(crate) fn remember(&self, verdict: &Verdict, sent_at: Instant) {
        let now = Instant::now();
        if verdict.retry_after.is_zero() {
            return;
        }
        let Some(until) = sent_at.checked_add(verdict.retry_after) else {
            return;
        };
        if until <= now {
            // the denial ran out while the reply was on its way
            return;
        }
        let mut entries = self.lock(verdict.check.key());
        if entries.invalidated.is_some_and(|at| sent_at <= at) {
            return;
        }
        if entries.map.len() >= CAPACITY / SHARDS && !entries.make_room(now) {
            return;
        }
        entries.map.insert(
            verdict.check.key(),
            Denial {
                until,
                expires: until.min(sent_at + MAX_AGE),
                at: sent_at,
                cost: verdict.check.cost(),
                verdict: verdict.clone(),
            },
        );
    }

    /// A denial of `check` (its caller at its cost) still in force, with its waits shortened by
    /// the time passed.
    pub(crate) fn check(&self, check: RateCheck) -> Option<Verdict> {
        let (key, cost) = (check.key(), check.cost());
        let now = Instant::now();
        let mut entries = self.lock(key);
        let denial = entries.map.get(&key)?;
        if denial.expires <= now {
            entries.map.remove(&key);
            return None;
        }
        if cost < denial.cost {
            return None;
        }
        let elapsed = now - denial.at;
        let mut verdict = denial.verdict.clone();
        verdict.check = check;
        verdict.source = DecisionSource::DenyCache;
        verdict.retry_after = (denial.until - now).max(Duration::from_millis(1));
        for state in &mut verdict.states {
            state.reset = state.reset.saturating_sub(elapsed);
        }
        Some(verdict)
    }

    /// Forgets the denial of `key`, if any, and any denial of a check sent until now that
    /// arrives later (of a caller in the same shard: a few more store checks, never a stale
    /// denial).
    pub(crate) fn forget(&self, key: Key) {
        let mut entries = self.lock(key);
        entries.map.remove(&key);
        entries.invalidated = Some(Instant::now());
    }

    /// Forgets every denial, and any denial of a check sent until now that arrives later.
    pub(crate) fn clear(&self) {
        let now = Instant::now();
        for shard in &self.shards {
            let mut entries = shard.lock().unwrap_or_else(PoisonError::into_inner);
            entries.map.clear();
            entries.invalidated = Some(now);
        }
    }

    fn lock(&self, key: Key) -> MutexGuard<'_, Entries> {
        let at = self.hasher.hash_one(key) as usize % SHARDS;
        // Every update is one insert or remove: a panic cannot leave a poisoned shard
        // inconsistent.
        self.shards[at]
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }
}

impl Entries {
    /// Drops the expired denials of this full shard, at most once a second; whether that made
    /// room.
    fn make_room(&mut self, now: Instant) -> bool {
        if self
            .swept
            .is_some_and(|at| now.duration_since(at) < Duration::from_secs(1))
        {
            return false;
        }
        self.swept = Some(now);
        self.map.retain(|_, denial| denial.expires > now);
        self.map.len() < CAPACITY / SHARDS
    }
}
