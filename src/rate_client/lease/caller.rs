//! One caller's state on this copy ([`Lease`]): its slices, what it spent of them, and the size
//! of its next one.

use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use super::{Lease, Slice, WARM};
use crate::rate::{LimitState, RateCheck, RateOutcome};

impl Lease {
    pub(super) fn new(now: Instant) -> Self {
        Self {
            slices: Vec::new(),
            fetching: false,
            fetched: Arc::default(),
            size: 0,
            seen: 0,
            since: now,
            states: Vec::new(),
            room: u64::MAX,
            touched: now,
        }
    }

    /// Admits `cost` from the oldest slice with room, if one has.
    pub(super) fn admit(&mut self, cost: u64) -> Option<RateOutcome> {
        let slice = self.slices.iter_mut().find(|s| s.left() >= cost)?;
        slice.used += cost;
        Some(self.outcome())
    }

    /// The outcome of an admission from a slice: the store's last states, with what the
    /// slices hold unspent counted as left.
    pub(super) fn outcome(&self) -> RateOutcome {
        let unspent: u64 = self.slices.iter().map(Slice::left).sum();
        RateOutcome {
            admitted: true,
            retry_after: Duration::ZERO,
            limits: self
                .states
                .iter()
                .map(|state| LimitState {
                    remaining: state.remaining.saturating_add(unspent),
                    reset: state.reset,
                })
                .collect(),
            decided_at_us: None,
        }
    }

    /// Takes out the slices that expired or are spent, adding their settlements to
    /// `returned`, and sizes the next slice on how the last one went.
    pub(super) fn retire(&mut self, now: Instant, returned: &mut Vec<RateCheck>) {
        let mut i = 0;
        while i < self.slices.len() {
            let slice = self.slices[i];
            let expired = now >= slice.ends;
            if !expired && slice.left() > 0 {
                i += 1;
                continue;
            }
            self.slices.remove(i);
            returned.extend(slice.give_back());
            let lasted = now.duration_since(slice.taken_at);
            let lease = slice.ends.duration_since(slice.taken_at);
            self.size = if !expired && lasted < lease / 2 {
                // spent in under half a lease: twice as much next time
                slice.check.cost().saturating_mul(2)
            } else {
                slice.used.max(1)
            };
        }
    }

    /// When the slices are three-quarters spent and none is being fetched: the size of the next
    /// one, to fetch now (`None` when `cap` allows no slice).
    pub(super) fn prefetch(&mut self, cap: Option<u64>) -> Option<u64> {
        let taken: u64 = self.slices.iter().map(|s| s.check.cost()).sum();
        let left: u64 = self.slices.iter().map(Slice::left).sum();
        if self.fetching || left.saturating_mul(4) > taken {
            return None;
        }
        let size = self.size.max(taken).min(cap?);
        self.fetching = true;
        Some(size)
    }

    /// For a request that no slice has room for: the size of a slice to fetch with it, or
    /// `None` for a check of the request alone (a caller not warm yet, a slice already being
    /// fetched, too little quota left).
    pub(super) fn next_fetch(
        &mut self,
        now: Instant,
        cost: u64,
        lease: Duration,
        cap: Option<u64>,
    ) -> Option<u64> {
        if self.fetching {
            return None;
        }
        if self.size == 0 {
            // not leased yet: count the caller's requests within a lease
            if now.duration_since(self.since) >= lease {
                (self.seen, self.since) = (0, now);
            }
            self.seen += 1;
            if self.seen < WARM {
                return None;
            }
            self.size = self.seen.saturating_mul(cost).saturating_mul(2);
        }
        let size = self.size.max(cost.saturating_mul(2)).min(cap?);
        self.fetching = true;
        Some(size)
    }

    /// Takes in what the store answered for this caller.
    pub(super) fn observe(&mut self, outcome: &RateOutcome) {
        if outcome.limits.is_empty() {
            return;
        }
        self.room = outcome
            .limits
            .iter()
            .map(|s| s.remaining)
            .min()
            .unwrap_or(0);
        self.states.clone_from(&outcome.limits);
    }
}
