//! Leased quota ([`Limit::leased`](crate::rate::Limit::leased)): a copy takes a slice of a
//! caller's quota in one store check — a reservation, charged like any check — and admits from
//! it locally until it is spent or its lease ends; what is left goes back with a settlement,
//! under the ledger's rules.
//!
//! - **Never more than the quota**: a request is admitted from a slice only after the store
//!   charged the slice, so the store's count is never below what the copies admitted.
//! - **The shortfall**: at most what the copies hold unspent of their slices, those on their way
//!   counted as held ([`transit`]); a slice is at most
//!   an eighth of the smallest quota and half of what the store last said was left, so slices
//!   shrink as the quota runs low, and a caller close to its limit is checked per request, as
//!   without leases.
//! - **Who gets a slice**: a caller that sent [`WARM`] requests to this copy within one lease;
//!   others are checked per request (a slice for a caller seen once would cost a settlement
//!   more than it saves). A slice is sized to what the caller spent of the one before in a
//!   lease, doubled while it runs out early.
//! - **Fetching ahead**: when a slice is three-quarters spent the next one is fetched in the
//!   background; a request that finds no slice with room while one is fetched waits for it (at
//!   most the store's timeout), then is admitted from it or checked alone.
//! - **A fetch is the copy's**: it runs in a task of its own, and the request that started it
//!   only waits for its answer. A request that goes away mid-fetch (a closed connection) takes
//!   nothing of the slice, which is installed and spent or given back like any other. A fetch
//!   whose answer is lost (a timeout, a broken connection) may have been charged: it is
//!   resolved through the attempt ledger, then given back ([`lost`]).
//! - **Memory**: at most [`CAPACITY`] callers per tier, removed once idle for two leases; a
//!   caller beyond that is checked per request.
//! - **Resets**: a slice's settlement is [quiet](RateCheck::quiet), so the only invalidation a
//!   leased tier hears is a reset, on which the caller's slices are given back (the rate
//!   client's listener calls [`Leases::forget`]; the store refunds nothing of a charge the reset erased). The slices left are given back when the layer
//!   goes ([`Leases`] dropped) or on [`RateLimitLayer::give_back_leases`].
//!
//! [`RateLimitLayer::give_back_leases`]: crate::rate_limit::RateLimitLayer::give_back_leases

use std::collections::HashMap;
use std::hash::{BuildHasher, RandomState};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, PoisonError};
use std::time::Duration;

use tokio::time::Instant;

use super::settle::{self, Unsettled};
use super::source::DecisionSource;
use crate::key::Key;
use crate::rate::{Algorithm, LimitState, RateCheck, RateOutcome, RatePolicy};
use crate::store::{RateStore, StoreFuture};
use crate::task::AbortOnDrop;

mod caller;
mod fetch;
mod give_back;
mod lost;
mod transit;

/// Requests of a caller on this copy within one lease before it is leased a slice.
pub(crate) const WARM: u64 = 4;
/// Callers with a lease entry per tier, at most.
pub(crate) const CAPACITY: usize = 65_536;
/// Shards of the lease table, each behind its own lock.
const SHARDS: usize = 16;

/// The slices of one tier's callers on this copy.
pub(crate) struct Leases {
    store: Arc<dyn RateStore>,
    policy: Arc<RatePolicy>,
    shards: Box<[Mutex<HashMap<Key, Lease>>]>,
    hasher: RandomState,
    /// How long a slice may be spent.
    lease: Duration,
    /// The largest slice: an eighth of the smallest quota.
    largest: u64,
    /// Returns expired slices of callers that went quiet; started with the first slice.
    sweeper: OnceLock<AbortOnDrop>,
    /// Slices whose answer was lost, being resolved.
    resolutions: Arc<lost::Resolutions>,
    /// Units no slice holds that the store may count: slices fetched, given back or resolved.
    in_transit: Arc<transit::InTransit>,
}

debug_fields!(Leases { lease, largest });

/// One caller's state on this copy.
#[derive(Debug)]
struct Lease {
    /// The slices being spent, oldest first (at most two: the current one and the next).
    slices: Vec<Slice>,
    /// A slice is being fetched; `fetched` wakes who waits for it.
    fetching: bool,
    fetched: Arc<tokio::sync::Notify>,
    /// The size of the next slice.
    size: u64,
    /// Requests since `since`, while the caller has no slice yet.
    seen: u64,
    since: Instant,
    /// The limits' states at the store's last answer, and the least quota left among them.
    states: Vec<LimitState>,
    room: u64,
    /// The last request.
    touched: Instant,
}

/// A slice: a reservation charged in the store, and what of it was admitted.
#[derive(Debug, Clone, Copy)]
struct Slice {
    check: RateCheck,
    used: u64,
    taken_at: Instant,
    ends: Instant,
}

impl Slice {
    fn left(&self) -> u64 {
        self.check.cost() - self.used
    }

    /// The settlement that returns what is left, if anything is.
    fn give_back(&self) -> Option<RateCheck> {
        (self.used < self.check.cost()).then(|| self.check.settle(self.used))
    }
}

/// What `settlement` gives back: the part of its slice left unspent.
fn unspent(settlement: &RateCheck) -> u64 {
    settlement.settles().map_or(0, |settled| {
        settled.reserved.saturating_sub(settlement.cost())
    })
}

/// The answer to a request of a leased tier that was not decided at once, and who gave it: the
/// store, or a slice this copy waited for.
pub(crate) type LeaseFuture = StoreFuture<(RateOutcome, DecisionSource)>;

/// How a request of a leased tier is decided.
pub(crate) enum Take {
    /// Admitted from a slice: the outcome to answer with, decided here.
    Local(RateOutcome),
    /// Decided by the store — a slice fetched with the request's cost in it, or a check of the
    /// request alone, whose answer is recorded — or by a slice once the one being fetched lands.
    Store(LeaseFuture),
}

impl Leases {
    /// The leases of `policy`'s callers, their slices charged in `store`.
    pub(crate) fn new(store: Arc<dyn RateStore>, policy: Arc<RatePolicy>) -> Self {
        let limits = policy.limits();
        let window = limits.iter().map(|l| l.window()).min().unwrap_or_default();
        let quota = limits.iter().map(|l| l.quota()).min().unwrap_or(1);
        Self {
            store,
            policy,
            shards: (0..SHARDS).map(|_| Mutex::default()).collect(),
            hasher: RandomState::new(),
            lease: (window / 10).clamp(Duration::from_millis(1), Duration::from_secs(10)),
            largest: (quota / 8).max(1),
            sweeper: OnceLock::new(),
            resolutions: Arc::default(),
            in_transit: Arc::default(),
        }
    }

    fn shard(&self, key: &Key) -> MutexGuard<'_, HashMap<Key, Lease>> {
        let index = self.hasher.hash_one(key) as usize % SHARDS;
        self.shards[index]
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// Admits `cost` of `key`'s quota from a slice this copy holds, if one has room: the
    /// outcome to answer with. Fetches the next slice in the background when these run low.
    pub(crate) fn admit(self: &Arc<Self>, key: Key, cost: u64) -> Option<RateOutcome> {
        let now = Instant::now();
        let mut returned = Vec::new();
        let (outcome, prefetch) = {
            let mut shard = self.shard(&key);
            let lease = shard.get_mut(&key)?;
            lease.touched = now;
            lease.retire(now, &mut returned);
            let outcome = lease.admit(cost);
            let prefetch = outcome
                .is_some()
                .then(|| lease.prefetch(self.cap(lease.room, cost)))
                .flatten();
            (outcome, prefetch)
        };
        self.give_back(returned);
        if let Some(size) = prefetch {
            self.spawn_fetch(key, size);
        }
        outcome
    }

    /// Decides `check` (a request's cost for its caller): from a slice when one has room, else
    /// by the store.
    pub(crate) fn take(self: &Arc<Self>, check: RateCheck) -> Take {
        self.take_or_wait(check, true)
    }

    /// [`take`](Self::take); while a slice is being fetched, a request waits for it when `wait`,
    /// else is checked alone.
    fn take_or_wait(self: &Arc<Self>, check: RateCheck, wait: bool) -> Take {
        /// What the lease table said, acted on once its lock is let go.
        enum Step {
            Local(RateOutcome, Option<u64>),
            Fetch(u64),
            Wait(tokio::sync::futures::OwnedNotified),
            Direct,
        }
        let now = Instant::now();
        let (key, cost) = (check.key(), check.cost());
        let mut returned = Vec::new();
        let step = {
            let mut shard = self.shard(&key);
            if !shard.contains_key(&key) && shard.len() >= CAPACITY / SHARDS {
                Step::Direct
            } else {
                let lease = shard.entry(key).or_insert_with(|| Lease::new(now));
                lease.touched = now;
                lease.retire(now, &mut returned);
                let cap = self.cap(lease.room, cost);
                match lease.admit(cost) {
                    Some(outcome) => Step::Local(outcome, lease.prefetch(cap)),
                    None if lease.fetching && wait => {
                        Step::Wait(Arc::clone(&lease.fetched).notified_owned())
                    }
                    None => match lease.next_fetch(now, cost, self.lease, cap) {
                        Some(size) => Step::Fetch(size),
                        None => Step::Direct,
                    },
                }
            }
        };
        self.ensure_sweeper();
        self.give_back(returned);
        match step {
            Step::Local(outcome, prefetch) => {
                if let Some(size) = prefetch {
                    self.spawn_fetch(key, size);
                }
                Take::Local(outcome)
            }
            Step::Fetch(size) => Take::Store(self.fetch(check, size)),
            Step::Wait(fetched) => {
                let leases = Arc::clone(self);
                let patience = self.store.timeout();
                Take::Store(Box::pin(async move {
                    // a fetch ends within the store's timeout; past it, the request goes alone
                    let _ = tokio::time::timeout(patience, fetched).await;
                    match leases.take_or_wait(check, false) {
                        Take::Local(outcome) => Ok((outcome, DecisionSource::Lease)),
                        Take::Store(pending) => pending.await,
                    }
                }))
            }
            Step::Direct => Take::Store(self.direct(check)),
        }
    }

    /// How long a slice the store charged with `outcome` may be spent, from when its fetch was
    /// sent (no later than the store charged it): its lease, which the store counts it for (see
    /// [`RateCheck::held`]); on a sliding counter, at most to the end of the window it was
    /// charged to, which the store's clock at the charge places.
    fn life(&self, outcome: &RateOutcome) -> Duration {
        if self.policy.algorithm() != Algorithm::SlidingCounter {
            return self.lease;
        }
        let Some(at) = outcome.decided_at_us else {
            return Duration::ZERO;
        };
        let left = self
            .policy
            .limits()
            .iter()
            .map(|limit| crate::rate::counter_window_left(limit.window_us(), at))
            .min()
            .unwrap_or(0);
        self.lease.min(Duration::from_micros(left))
    }

    /// The largest slice that may be taken now for requests of `cost`: none (a check per
    /// request) when that is less than two requests' worth.
    fn cap(&self, room: u64, cost: u64) -> Option<u64> {
        let cap = self.largest.min(room / 2);
        (cap >= cost.saturating_mul(2)).then_some(cap)
    }

    /// A check of the request alone, its answer recorded.
    fn direct(self: &Arc<Self>, check: RateCheck) -> LeaseFuture {
        let leases = Arc::clone(self);
        let pending = self.store.check_rate(&self.policy, check);
        Box::pin(async move {
            let outcome = pending.await?;
            leases.record(check.key(), &outcome);
            Ok((outcome, DecisionSource::Store))
        })
    }

    /// Records the store's answer to a check of `key`'s request alone.
    fn record(&self, key: Key, outcome: &RateOutcome) {
        if let Some(lease) = self.shard(&key).get_mut(&key) {
            lease.observe(outcome);
        }
    }

    /// Sends the settlements that return what slices left unspent, in the background.
    fn give_back(&self, settlements: Vec<RateCheck>) {
        for settlement in settlements {
            let carried = self.in_transit.carry(unspent(&settlement));
            settle::in_background(
                &*self.store,
                &self.policy,
                settlement,
                Unsettled::Slice,
                carried,
            );
        }
    }

    /// Starts the task that gives back the expired slices of callers that went quiet.
    fn ensure_sweeper(self: &Arc<Self>) {
        if self.sweeper.get().is_some() || tokio::runtime::Handle::try_current().is_err() {
            return;
        }
        let leases = Arc::downgrade(self);
        let every = self.lease;
        let _ = self
            .sweeper
            .set(AbortOnDrop(tokio::spawn(give_back::sweep(leases, every))));
    }
}
