//! Slices going back: on a reset, when the layer goes or is asked to, and when they expire
//! (the sweeper, for callers that went quiet).

use std::sync::{Arc, PoisonError, Weak};
use std::time::Duration;

use tokio::time::Instant;

use super::{Leases, Slice};
use crate::key::Key;
use crate::rate::RateCheck;

impl Leases {
    /// Forgets `key` on a reset, giving its slices back: the store refunds nothing of a slice
    /// charged before the reset (a refund comes only out of the life of the state it charged;
    /// see the [attempt ledger](crate::store#the-attempt-ledger)), and what is left of one taken
    /// after it, before its word arrived. The caller is leased anew from its next requests.
    pub(crate) fn forget(&self, key: Key) {
        let lease = self.shard(&key).remove(&key);
        if let Some(lease) = lease {
            self.give_back(lease.slices.iter().filter_map(Slice::give_back).collect());
        }
    }

    /// Forgets `key` right before this copy resets it, giving nothing back: every slice it holds
    /// was charged before the reset, which erases that charge, so a settlement of it would change
    /// nothing either way.
    pub(crate) fn discard(&self, key: Key) {
        self.shard(&key).remove(&key);
    }

    /// Takes every slice out, to give back: the layer is going.
    fn drain(&self) -> Vec<RateCheck> {
        let mut settlements = Vec::new();
        for shard in &self.shards {
            let mut shard = shard.lock().unwrap_or_else(PoisonError::into_inner);
            for lease in shard.values_mut() {
                settlements.extend(lease.slices.drain(..).filter_map(|s| s.give_back()));
            }
        }
        settlements
    }

    /// The fetches under way, to wait for.
    fn fetches(&self) -> Vec<tokio::sync::futures::OwnedNotified> {
        let mut fetches = Vec::new();
        for shard in &self.shards {
            let shard = shard.lock().unwrap_or_else(PoisonError::into_inner);
            fetches.extend(
                shard
                    .values()
                    .filter(|lease| lease.fetching)
                    .map(|lease| Arc::clone(&lease.fetched).notified_owned()),
            );
        }
        fetches
    }

    /// Gives back every slice's unspent quota now, those being fetched included once they land
    /// (within the store's timeout) and those whose answer was lost once resolved, and waits
    /// for the store's answers: the callers given back quota.
    pub(crate) async fn give_back_all(&self) -> Vec<Key> {
        let fetches = self.fetches();
        if !fetches.is_empty() {
            let landed = futures_util::future::join_all(fetches);
            let _ = tokio::time::timeout(self.store.timeout() * 2, landed).await;
        }
        self.resolutions.ended(self.store.timeout()).await;
        let settlements = self.drain();
        let carried: Vec<_> = settlements
            .iter()
            .map(|settlement| self.in_transit.carry(super::unspent(settlement)))
            .collect();
        let pending: Vec<_> = settlements
            .iter()
            .map(|settlement| self.store.settle(&self.policy, *settlement))
            .collect();
        for settled in pending {
            if let Err(error) = settled.await {
                tracing::warn!(
                    target: "tollgate::rate_limit",
                    %error, "could not give back what a leased slice left unspent"
                );
            }
        }
        drop(carried);
        settlements.iter().map(RateCheck::key).collect()
    }

    /// What the copy holds unspent of its slices, over every caller, and what is in transit:
    /// slices being fetched, given back or resolved, which the store may count.
    pub(crate) fn unspent(&self) -> u64 {
        let held: u64 = self
            .shards
            .iter()
            .map(|shard| {
                let shard = shard.lock().unwrap_or_else(PoisonError::into_inner);
                shard
                    .values()
                    .flat_map(|lease| &lease.slices)
                    .map(Slice::left)
                    .sum::<u64>()
            })
            .sum();
        held + self.in_transit.units()
    }

    /// Retires the expired slices of every caller and forgets the callers idle for two leases.
    fn sweep_once(&self) {
        let now = Instant::now();
        let mut returned = Vec::new();
        for shard in &self.shards {
            let mut shard = shard.lock().unwrap_or_else(PoisonError::into_inner);
            shard.retain(|_, lease| {
                lease.retire(now, &mut returned);
                !lease.slices.is_empty()
                    || lease.fetching
                    || now.duration_since(lease.touched) < 2 * self.lease
            });
        }
        self.give_back(returned);
    }
}

/// Every `every`, the expired slices of quiet callers go back, until the leases are gone.
pub(super) async fn sweep(leases: Weak<Leases>, every: Duration) {
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        match leases.upgrade() {
            Some(leases) => leases.sweep_once(),
            None => return,
        }
    }
}

impl Drop for Leases {
    fn drop(&mut self) {
        let settlements = self.drain();
        self.give_back(settlements);
    }
}
