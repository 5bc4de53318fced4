//! [`LocalRates`]: rate-limit state inside one process, decided by the in-process algorithms.
//!
//! The state is bounded and shared between threads without one global lock:
//!
//! - **Shards**: callers are spread over [`SHARDS`] tables by a hash of their [`Key`], each behind
//!   its own lock, so decisions for different callers seldom wait for each other. All limits of a
//!   caller live in its shard: a decision over several limits is one step under one lock.
//! - **Expiry index**: each table orders its callers by expiry, and every operation first removes
//!   the callers whose time is up — exactly those, never a scan of the live ones. A caller's
//!   entry is moved when it comes due and the caller turns out to live longer (not on every
//!   decision that pushes its expiry later), so the index costs O(log n) per caller and lifetime,
//!   amortised.
//! - **Capacity**: at most `capacity` callers over all shards, counted together (not per shard).
//!   A new caller beyond that is refused ([`Full`]) once the expired callers of every shard have
//!   been removed. A live caller is never evicted to make room: that would hand it a fresh quota.

use std::collections::{BTreeSet, HashMap};
use std::hash::{BuildHasher, RandomState};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Mutex, PoisonError};
use std::time::{SystemTime, UNIX_EPOCH};

use tokio::time::Instant;

use super::algorithms::{self, Slot};
use super::{Algorithm, RateCheck, RateOutcome, RatePolicy};
use crate::key::Key;

/// A store clock in one process: the wall clock when it was made plus tokio's monotonic clock
/// since, in microseconds — so `tokio::time::pause` and `advance` move it in tests.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Clock {
    started: Instant,
    started_us: u64,
}

impl Clock {
    pub(crate) fn new() -> Self {
        let started_us = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| u64::try_from(d.as_micros()).unwrap_or(u64::MAX / 2));
        Self {
            started: Instant::now(),
            started_us,
        }
    }

    /// Microseconds of store time.
    pub(crate) fn now_us(&self) -> u64 {
        let elapsed = u64::try_from(self.started.elapsed().as_micros()).unwrap_or(0);
        self.started_us.saturating_add(elapsed)
    }
}

/// The number of shards: enough that a few cores seldom meet on one lock, few enough that an
/// empty table stays small (a few kilobytes).
pub(crate) const SHARDS: usize = 32;

/// Callers' rate state kept in process, with the semantics of the store scripts.
///
/// A caller is a policy namespace and a [`Key`]; it holds one slot per limit name and algorithm.
/// That is exactly what tells the shared store's keys `<namespace>:{<key>}:<limit>:<algorithm>`
/// apart, so two policies share state here exactly when they would share keys there.
#[derive(Debug)]
pub(crate) struct LocalRates {
    clock: Clock,
    shards: Box<[Shard]>,
    /// Picks a caller's shard; keyed at random, so that nobody can aim callers at one shard.
    hasher: RandomState,
    capacity: usize,
    /// Callers held over all shards, the expired ones not removed yet included.
    held: AtomicUsize,
}

/// A new caller refused: the table holds its capacity of live callers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Full;

// One shard per cache line: threads locking neighbouring shards do not slow each other down.
#[derive(Debug, Default)]
#[repr(align(64))]
struct Shard {
    table: Mutex<Table>,
    /// At most the earliest expiry in the table (`u64::MAX` when empty), readable without the
    /// lock: a full table skips the shards where nothing has expired.
    next_expiry: AtomicU64,
}

#[derive(Debug, Default)]
struct Table {
    callers: HashMap<CallerId, Caller>,
    /// Every caller once, at its `indexed_at`, earliest first.
    by_expiry: BTreeSet<(u64, CallerId)>,
    /// Namespaces and limit names by number. They come from configuration, never from requests,
    /// so there are few, and they are kept as long as the table.
    names: HashMap<Box<str>, u32>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
struct CallerId {
    namespace: u32,
    key: [u8; 16],
}

#[derive(Debug)]
struct Caller {
    /// The latest expiry of its slots: the caller is gone after it.
    expires_at: u64,
    /// Its place in the expiry index: never after `expires_at`.
    indexed_at: u64,
    slots: Vec<Limited>,
}

/// A caller's state for one limit name and algorithm.
#[derive(Debug)]
struct Limited {
    name: u32,
    algorithm: Algorithm,
    slot: Slot,
}

impl LocalRates {
    /// An empty table on `clock` for at most `capacity` callers.
    pub(crate) fn new(clock: Clock, capacity: usize) -> Self {
        Self {
            clock,
            shards: (0..SHARDS).map(|_| Shard::default()).collect(),
            hasher: RandomState::new(),
            capacity,
            held: AtomicUsize::new(0),
        }
    }

    /// Checks the cost of `check` against every limit of `policy` for its caller and, only if
    /// all have room, charges all of them — in one step under the caller's shard lock. A caller
    /// not held yet is [`Full`] when `capacity` live callers are held.
    pub(crate) fn check(&self, policy: &RatePolicy, check: RateCheck) -> Result<RateOutcome, Full> {
        let now = self.clock.now_us();
        let shard = self.shard(check.key());
        if let Some(outcome) = self.decide_in(shard, policy, now, check) {
            return Ok(outcome);
        }
        // Expired callers in other shards do not count against the capacity either. They are
        // removed with this shard's lock released: holding two shard locks could deadlock.
        self.remove_expired_everywhere(now);
        self.decide_in(shard, policy, now, check).ok_or(Full)
    }

    /// Forgets caller `key`'s state for every limit of `policy`, and nothing else: what deleting
    /// its store keys does.
    pub(crate) fn reset(&self, policy: &RatePolicy, key: Key) {
        self.shard(key).with(|table| {
            let id = CallerId {
                namespace: table.name(policy.namespace()),
                key: *key.as_bytes(),
            };
            let limits: Vec<u32> = policy
                .limits()
                .iter()
                .map(|l| table.name(l.name()))
                .collect();
            let Some(caller) = table.callers.get_mut(&id) else {
                return;
            };
            caller
                .slots
                .retain(|s| s.algorithm != policy.algorithm() || !limits.contains(&s.name));
            if !table.settle(id) {
                self.give_back(1);
            }
        });
    }

    /// The number of live callers.
    pub(crate) fn len(&self) -> usize {
        let now = self.clock.now_us();
        self.shards
            .iter()
            .map(|shard| shard.with(|table| table.live(now)))
            .sum()
    }

    fn shard(&self, key: Key) -> &Shard {
        let at = self.hasher.hash_one(key.as_bytes()) as usize % SHARDS;
        &self.shards[at]
    }

    /// Decides under `shard`'s lock; `None` for a new caller when there is no room for it.
    fn decide_in(
        &self,
        shard: &Shard,
        policy: &RatePolicy,
        now: u64,
        check: RateCheck,
    ) -> Option<RateOutcome> {
        shard.with(|table| {
            self.give_back(table.remove_expired(now));
            let id = CallerId {
                namespace: table.name(policy.namespace()),
                key: *check.key().as_bytes(),
            };
            let limits: Vec<u32> = policy
                .limits()
                .iter()
                .map(|l| table.name(l.name()))
                .collect();
            let Some(caller) = table.callers.get_mut(&id) else {
                return self.decide_new(table, id, policy, &limits, now, check);
            };
            let outcome = caller.decide(policy, &limits, now, check);
            if !table.settle(id) {
                self.give_back(1);
            }
            Some(outcome)
        })
    }

    /// Decides for a caller not held yet, and keeps it if it has state to keep and there is
    /// room; `None` when there is not.
    fn decide_new(
        &self,
        table: &mut Table,
        id: CallerId,
        policy: &RatePolicy,
        limits: &[u32],
        now: u64,
        check: RateCheck,
    ) -> Option<RateOutcome> {
        let mut caller = Caller::new(limits.len());
        // The algorithms only compute, so the outcome can be thrown away with the state. One
        // that keeps nothing (a look at cost 0, a cost beyond the quota) needs no room.
        let outcome = caller.decide(policy, limits, now, check);
        if caller.slots.is_empty() {
            return Some(outcome);
        }
        if !self.take_room() {
            return None;
        }
        caller.indexed_at = caller.expires_at;
        table.by_expiry.insert((caller.indexed_at, id));
        table.callers.insert(id, caller);
        Some(outcome)
    }

    fn remove_expired_everywhere(&self, now: u64) {
        for shard in &*self.shards {
            if shard.next_expiry.load(Ordering::Relaxed) <= now {
                shard.with(|table| self.give_back(table.remove_expired(now)));
            }
        }
    }

    /// Counts one more caller, if there is room for it.
    fn take_room(&self) -> bool {
        self.held
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |held| {
                (held < self.capacity).then_some(held + 1)
            })
            .is_ok()
    }

    fn give_back(&self, callers: usize) {
        if callers > 0 {
            self.held.fetch_sub(callers, Ordering::Relaxed);
        }
    }
}

impl Shard {
    /// Runs `f` on the table under its lock, then publishes the table's earliest expiry.
    fn with<R>(&self, f: impl FnOnce(&mut Table) -> R) -> R {
        // The algorithms do not panic (huge costs and durations are tested). If one did, its
        // caller's slots would be left empty — that caller's count lost — but the slots are
        // whole values and the index moves only after a decision, so the table stays usable.
        let mut table = self.table.lock().unwrap_or_else(PoisonError::into_inner);
        let out = f(&mut table);
        let earliest = table.by_expiry.first().map_or(u64::MAX, |&(at, _)| at);
        self.next_expiry.store(earliest, Ordering::Relaxed);
        out
    }
}

impl Table {
    /// Removes the callers expired at `now`; how many. A caller whose expiry moved later since
    /// it was indexed is indexed again at its expiry instead.
    fn remove_expired(&mut self, now: u64) -> usize {
        let mut removed = 0;
        while let Some(&(at, id)) = self.by_expiry.first()
            && at <= now
        {
            self.by_expiry.pop_first();
            match self.callers.get_mut(&id) {
                Some(caller) if caller.expires_at > now => {
                    caller.indexed_at = caller.expires_at;
                    self.by_expiry.insert((caller.indexed_at, id));
                }
                _ => removed += usize::from(self.callers.remove(&id).is_some()),
            }
        }
        removed
    }

    /// Keeps the index in step after `id`'s caller was decided; whether it is still held (a
    /// caller left without state is dropped).
    fn settle(&mut self, id: CallerId) -> bool {
        let Some(caller) = self.callers.get_mut(&id) else {
            return false;
        };
        if caller.slots.is_empty() {
            let at = caller.indexed_at;
            self.callers.remove(&id);
            self.by_expiry.remove(&(at, id));
            return false;
        }
        // A later expiry is left to `remove_expired`, which finds it when the index entry comes
        // due: one index move per lifetime, not per decision. An earlier one moves now, or the
        // caller would count against the capacity after it expired.
        if caller.expires_at < caller.indexed_at {
            self.by_expiry.remove(&(caller.indexed_at, id));
            caller.indexed_at = caller.expires_at;
            self.by_expiry.insert((caller.indexed_at, id));
        }
        true
    }

    /// The number of `name`, numbered on first sight.
    fn name(&mut self, name: &str) -> u32 {
        if let Some(&id) = self.names.get(name) {
            return id;
        }
        let id = u32::try_from(self.names.len()).unwrap_or(u32::MAX);
        self.names.insert(Box::from(name), id);
        id
    }

    fn live(&self, now: u64) -> usize {
        self.callers.values().filter(|c| c.expires_at > now).count()
    }
}

impl Caller {
    fn new(limits: usize) -> Self {
        Self {
            expires_at: 0,
            indexed_at: 0,
            slots: Vec::with_capacity(limits),
        }
    }

    /// Decides `check` on the slots of `limits` (the policy's limit names, by number), and
    /// drops the slots left without state or expired (another policy's, under this namespace).
    fn decide(
        &mut self,
        policy: &RatePolicy,
        limits: &[u32],
        now: u64,
        check: RateCheck,
    ) -> RateOutcome {
        let at: Vec<usize> = limits
            .iter()
            .map(|&name| self.position(name, policy.algorithm()))
            .collect();
        let mut slots: Vec<Slot> = at
            .iter()
            .map(|&i| live(std::mem::take(&mut self.slots[i].slot), now))
            .collect();
        let outcome = algorithms::check(policy, &mut slots, now, check);
        for (&i, slot) in at.iter().zip(slots) {
            self.slots[i].slot = slot;
        }
        self.slots
            .retain(|l| l.slot.state.is_some() && l.slot.expires_at > now);
        self.expires_at = self
            .slots
            .iter()
            .map(|l| l.slot.expires_at)
            .max()
            .unwrap_or(0);
        outcome
    }

    /// The index of the slot of limit `name` under `algorithm`, added empty if there is none.
    fn position(&mut self, name: u32, algorithm: Algorithm) -> usize {
        let found = self
            .slots
            .iter()
            .position(|l| l.name == name && l.algorithm == algorithm);
        found.unwrap_or_else(|| {
            self.slots.push(Limited {
                name,
                algorithm,
                slot: Slot::default(),
            });
            self.slots.len() - 1
        })
    }
}

/// `slot` if it is live at `now`; an empty slot otherwise.
fn live(slot: Slot, now: u64) -> Slot {
    if slot.expires_at > now {
        slot
    } else {
        Slot::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rate::{Algorithm, Limit};

    fn rates() -> LocalRates {
        LocalRates::new(Clock::new(), usize::MAX)
    }

    fn admitted(rates: &LocalRates, policy: &RatePolicy, key: Key, cost: u64) -> bool {
        rates
            .check(policy, RateCheck::new(key, cost))
            .unwrap()
            .admitted
    }

    /// With the clock frozen, a burst admits exactly the quota, also when the emission interval
    /// is not a whole number of microseconds (or under one).
    #[tokio::test(start_paused = true)]
    async fn gcra_bursts_are_exact_with_fractional_intervals() {
        let rates = rates();
        for quota in [3, 7, 3_000, 30_001, 300_007] {
            let policy = RatePolicy::new(
                "t:rl",
                Algorithm::Gcra,
                vec![Limit::new(
                    format!("q{quota}"),
                    quota,
                    std::time::Duration::from_secs(1),
                )],
            )
            .unwrap();
            let key = Key::new("t", b"burst");
            let mut count = 0u64;
            for _ in 0..quota + quota / 100 + 5 {
                count += u64::from(admitted(&rates, &policy, key, 1));
            }
            assert_eq!(count, quota, "quota {quota}");
            // and a cost that fits the quota exactly, on a fresh key
            let fresh = Key::new("t", b"whole");
            assert!(admitted(&rates, &policy, fresh, quota));
            assert!(!admitted(&rates, &policy, fresh, 1));
        }
    }

    #[tokio::test(start_paused = true)]
    async fn huge_costs_neither_panic_nor_wrap() {
        let rates = rates();
        for algorithm in [
            Algorithm::SlidingLog,
            Algorithm::SlidingCounter,
            Algorithm::Gcra,
        ] {
            let policy =
                RatePolicy::new("t:rl", algorithm, vec![Limit::per_second("s", 5)]).unwrap();
            assert!(!admitted(&rates, &policy, Key::new("t", b"k"), u64::MAX));
        }
    }

    /// The index, the maps and the count agree: every held caller is indexed once, at its expiry.
    fn assert_consistent(rates: &LocalRates) {
        let mut total = 0;
        for shard in &*rates.shards {
            shard.with(|table| {
                assert_eq!(table.callers.len(), table.by_expiry.len());
                for (id, caller) in &table.callers {
                    assert!(table.by_expiry.contains(&(caller.indexed_at, *id)));
                    assert!(caller.indexed_at <= caller.expires_at);
                    assert!(!caller.slots.is_empty());
                }
                total += table.callers.len();
            });
        }
        assert_eq!(rates.held.load(Ordering::Relaxed), total);
    }

    /// A caller with several limits is one entry; one whose limits all expired is removed by the
    /// next operation on its shard, another caller's alone does not touch it.
    #[tokio::test(start_paused = true)]
    async fn a_caller_is_one_entry_and_leaves_when_its_last_limit_expires() {
        let rates = rates();
        let policy = RatePolicy::new(
            "t:rl",
            Algorithm::SlidingLog,
            vec![Limit::per_second("s", 10), Limit::per_minute("m", 100)],
        )
        .unwrap();
        let alice = Key::new("t", b"alice");
        assert!(admitted(&rates, &policy, alice, 1));
        assert_eq!(rates.len(), 1);
        assert_consistent(&rates);
        // the per-second slot is gone, the per-minute one holds the caller
        tokio::time::advance(std::time::Duration::from_secs(2)).await;
        let out = rates.check(&policy, RateCheck::new(alice, 1)).unwrap();
        assert_eq!(
            (out.limits[0].remaining, out.limits[1].remaining),
            (9, 98),
            "the per-minute limit kept its count"
        );
        tokio::time::advance(std::time::Duration::from_secs(61)).await;
        assert_eq!(rates.len(), 0);
        rates.remove_expired_everywhere(rates.clock.now_us());
        assert_eq!(rates.held.load(Ordering::Relaxed), 0);
        assert_consistent(&rates);
    }

    /// Removing expired callers from a full table reaches every shard, not only the new
    /// caller's: the capacity counts live callers only.
    #[tokio::test(start_paused = true)]
    async fn a_full_table_reclaims_expired_callers_of_every_shard() {
        let rates = LocalRates::new(Clock::new(), 64);
        let short =
            RatePolicy::new("t:rl", Algorithm::Gcra, vec![Limit::per_second("s", 1)]).unwrap();
        for i in 0..64u32 {
            assert!(admitted(&rates, &short, Key::new("t", &i.to_be_bytes()), 1));
        }
        let late = Key::new("t", b"late");
        assert_eq!(rates.check(&short, RateCheck::new(late, 1)), Err(Full));
        tokio::time::advance(std::time::Duration::from_secs(2)).await;
        // 64 new callers, in whatever shards they fall: every expired caller made room
        for i in 64..128u32 {
            assert!(admitted(&rates, &short, Key::new("t", &i.to_be_bytes()), 1));
        }
        assert_eq!(rates.len(), 64);
        assert_consistent(&rates);
    }

    /// A check that stores nothing (a cost no limit can ever admit, a look at cost 0) takes no
    /// room, and is answered also when the table is full.
    #[tokio::test(start_paused = true)]
    async fn a_new_caller_left_without_state_takes_no_room() {
        let rates = LocalRates::new(Clock::new(), 1);
        let policy = RatePolicy::new(
            "t:rl",
            Algorithm::SlidingLog,
            vec![Limit::per_second("s", 2)],
        )
        .unwrap();
        assert!(!admitted(&rates, &policy, Key::new("t", b"a"), 3));
        assert_eq!(rates.held.load(Ordering::Relaxed), 0);
        assert!(admitted(&rates, &policy, Key::new("t", b"b"), 1));
        let look = rates.check(&policy, RateCheck::new(Key::new("t", b"c"), 0));
        assert_eq!(look.map(|o| o.limits[0].remaining), Ok(2));
        assert_eq!(
            rates.check(&policy, RateCheck::new(Key::new("t", b"c"), 1)),
            Err(Full)
        );
        assert_consistent(&rates);
    }
}
