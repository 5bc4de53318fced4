//! Leased quota ([`Limit::leased`](crate::rate::Limit::leased)): a copy takes a slice of a
//! caller's quota in one store check — a reservation, charged like any check — and admits from
//! it locally until it is spent or its lease ends; what is left goes back with a settlement,
//! under the ledger's rules.
//!
//! - **Never more than the quota**: a request is admitted from a slice only after the store
//!   charged the slice, so the store's count is never below what the copies admitted.
//! - **The shortfall**: at most what the copies hold unspent of their slices; a slice is at most
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
//!   leased tier hears is a reset, on which the caller's slices are given back (the layer's
//!   listener calls [`Leases::forget`]; the store refunds nothing of a charge the reset erased). The slices left are given back when the layer
//!   goes ([`Leases`] dropped) or on [`RateLimitLayer::give_back_leases`].
//!
//! [`RateLimitLayer::give_back_leases`]: super::RateLimitLayer::give_back_leases

use std::collections::HashMap;
use std::hash::{BuildHasher, RandomState};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, PoisonError, Weak};
use std::time::Duration;

use tokio::time::Instant;

use crate::key::Key;
use crate::rate::{Algorithm, LimitState, RateCheck, RateOutcome, RatePolicy};
use crate::store::{RateStore, StoreFuture};
use crate::task::AbortOnDrop;

mod fetch;
mod lost;

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

/// How a request of a leased tier is decided.
pub(crate) enum Take {
    /// Admitted from a slice: the outcome to answer with, decided here.
    Local(RateOutcome),
    /// Decided by the store: a slice fetched with the request's cost in it, or a check of the
    /// request alone. The future records what the store answered.
    Store(StoreFuture<RateOutcome>),
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
                        Take::Local(outcome) => Ok(outcome),
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
            .map(|limit| counter_window_left(limit.window_us(), at))
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
    fn direct(self: &Arc<Self>, check: RateCheck) -> StoreFuture<RateOutcome> {
        let leases = Arc::clone(self);
        let pending = self.store.check_rate(&self.policy, check);
        Box::pin(async move {
            let outcome = pending.await?;
            leases.record(check.key(), &outcome);
            Ok(outcome)
        })
    }

    /// Records the store's answer to a check of `key`'s request alone.
    fn record(&self, key: Key, outcome: &RateOutcome) {
        if let Some(lease) = self.shard(&key).get_mut(&key) {
            lease.observe(outcome);
        }
    }

    /// Sends the settlements that return what `slices` left unspent, in the background.
    fn give_back(&self, settlements: Vec<RateCheck>) {
        for settlement in settlements {
            let pending = self.store.check_rate(&self.policy, settlement);
            spawn(async move {
                if let Err(error) = pending.await {
                    tracing::debug!(
                        target: "tollgate::rate_limit",
                        %error, "could not give back what a leased slice left unspent"
                    );
                }
            });
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
            .set(AbortOnDrop(tokio::spawn(sweep(leases, every))));
    }

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
        let pending: Vec<_> = settlements
            .iter()
            .map(|settlement| self.store.check_rate(&self.policy, *settlement))
            .collect();
        for settled in pending {
            if let Err(error) = settled.await {
                tracing::warn!(
                    target: "tollgate::rate_limit",
                    %error, "could not give back what a leased slice left unspent"
                );
            }
        }
        settlements.iter().map(RateCheck::key).collect()
    }

    /// What the copy holds unspent of its slices, over every caller.
    pub(crate) fn unspent(&self) -> u64 {
        self.shards
            .iter()
            .map(|shard| {
                let shard = shard.lock().unwrap_or_else(PoisonError::into_inner);
                shard
                    .values()
                    .flat_map(|lease| &lease.slices)
                    .map(Slice::left)
                    .sum::<u64>()
            })
            .sum()
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

/// What is left at store time `at_us` of the sliding counter's window of `window_us` it falls
/// in, as the stores place windows (on whole milliseconds of store time).
fn counter_window_left(window_us: u64, at_us: u64) -> u64 {
    let window_ms = window_us as f64 / 1000.0;
    let index = ((at_us / 1000) as f64 / window_ms).floor();
    let end_us = ((index + 1.0) * window_ms * 1000.0).floor();
    (end_us as u64).saturating_sub(at_us)
}

/// Runs `task` in the background, when there is a runtime to run it on (outside one, a
/// settlement is not sent: its slice stays charged until its window passes).
fn spawn(task: impl std::future::Future<Output = ()> + Send + 'static) {
    if let Ok(runtime) = tokio::runtime::Handle::try_current() {
        runtime.spawn(task);
    }
}

/// Every `every`, the expired slices of quiet callers go back, until the leases are gone.
async fn sweep(leases: Weak<Leases>, every: Duration) {
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

impl Lease {
    fn new(now: Instant) -> Self {
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
    fn admit(&mut self, cost: u64) -> Option<RateOutcome> {
        let slice = self.slices.iter_mut().find(|s| s.left() >= cost)?;
        slice.used += cost;
        Some(self.outcome())
    }

    /// The outcome of an admission from a slice: the store's last states, with what the
    /// slices hold unspent counted as left.
    fn outcome(&self) -> RateOutcome {
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
    fn retire(&mut self, now: Instant, returned: &mut Vec<RateCheck>) {
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
    fn prefetch(&mut self, cap: Option<u64>) -> Option<u64> {
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
    fn next_fetch(
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
    fn observe(&mut self, outcome: &RateOutcome) {
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

#[cfg(test)]
mod tests {
    use super::counter_window_left;

    #[test]
    fn a_counter_slice_lives_to_its_windows_end_on_the_stores_clock() {
        // windows of 1 s on whole milliseconds of store time
        assert_eq!(counter_window_left(1_000_000, 5_000_000), 1_000_000);
        assert_eq!(counter_window_left(1_000_000, 5_999_400), 600);
        assert_eq!(counter_window_left(1_000_000, 5_250_123), 749_877);
        // a window of 1.5 ms: windows end at 1.5 ms, 3 ms, ...
        assert_eq!(counter_window_left(1_500, 2_100), 900);
    }
}
