//! [`LocalRates`]: rate-limit state inside one process, decided by the in-process algorithms.
//!
//! The callers are kept in an [`ExpiringMap`] (see `crate::expiring`: shards, an expiry index,
//! a capacity counted over all shards), so the state is bounded and shared between threads
//! without one global lock:
//!
//! - Callers are routed to a shard by their [`Key`] alone, so all limits of a caller — under
//!   every policy namespace — live in one shard: a decision over several limits is one step
//!   under one lock.
//! - A caller's expiry is the latest of its slots'. A decision that pushes it later does not
//!   move the caller in the expiry index; the index moves it when it comes due and the caller
//!   turns out to live longer. A caller left without slots is removed at once.
//! - At most `capacity` callers: a new caller beyond that is refused ([`Full`]) once the expired
//!   callers of every shard have been removed. A live caller is never evicted to make room: that
//!   would hand it a fresh quota. A check that keeps nothing (a look at cost 0, a cost beyond
//!   the quota) needs no room.
//! - Namespaces and limit names are numbered per shard, under its lock.

use std::collections::HashMap;
use std::time::{SystemTime, UNIX_EPOCH};

use tokio::time::Instant;

use super::algorithms::{self, Ledger, Slot};
use super::{Algorithm, RateCheck, RateOutcome, RatePolicy};
use crate::expiring::{Expiring, ExpiringMap, Full};
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

/// Callers' rate state kept in process, with the semantics of the store scripts.
///
/// A caller is a policy namespace and a [`Key`]; it holds one slot per limit name and algorithm.
/// That is exactly what tells the shared store's keys `<namespace>:{<key>}:<limit>:<algorithm>`
/// apart, so two policies share state here exactly when they would share keys there.
#[derive(Debug)]
pub(crate) struct LocalRates {
    clock: Clock,
    callers: ExpiringMap<CallerId, Caller, Names>,
}

/// Namespaces and limit names by number, in each shard. They come from configuration, never
/// from requests, so there are few, and they are kept as long as the table.
#[derive(Debug, Default)]
struct Names(HashMap<Box<str>, u32>);

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
struct CallerId {
    namespace: u32,
    key: [u8; 16],
}

#[derive(Debug)]
struct Caller {
    /// The latest expiry of its slots and ledger: the caller is gone after it.
    expires_at: u64,
    slots: Vec<Limited>,
    /// The attempts that charged it, under every policy of its namespace.
    ledger: Ledger,
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
            callers: ExpiringMap::new(capacity),
        }
    }

    /// Checks the cost of `check` against every limit of `policy` for its caller and, only if
    /// all have room, charges all of them — in one step under the caller's shard lock. A caller
    /// not held yet is [`Full`] when `capacity` live callers are held.
    pub(crate) fn check(&self, policy: &RatePolicy, check: RateCheck) -> Result<RateOutcome, Full> {
        let now = self.clock.now_us();
        let shard = self.callers.shard(check.key().as_bytes());
        if let Ok(outcome) = self.decide_in(shard, policy, now, check) {
            return Ok(outcome);
        }
        // Expired callers in other shards do not count against the capacity either. They are
        // removed with this shard's lock released: holding two shard locks could deadlock.
        self.callers.remove_expired_everywhere(now);
        self.decide_in(shard, policy, now, check)
    }

    /// Forgets caller `key`'s state for every limit of `policy`, and nothing else: what deleting
    /// its store keys does.
    pub(crate) fn reset(&self, policy: &RatePolicy, key: Key) {
        let shard = self.callers.shard(key.as_bytes());
        let mut callers = self.callers.lock(shard, self.clock.now_us());
        let (id, limits) = callers.side().number(policy, key);
        callers.update(&id, |caller| {
            caller
                .slots
                .retain(|s| s.algorithm != policy.algorithm() || !limits.contains(&s.name));
        });
    }

    /// The number of live callers.
    pub(crate) fn len(&self) -> usize {
        self.callers.live(self.clock.now_us())
    }

    /// Decides under `shard`'s lock; [`Full`] for a new caller when there is no room for it.
    fn decide_in(
        &self,
        shard: usize,
        policy: &RatePolicy,
        now: u64,
        check: RateCheck,
    ) -> Result<RateOutcome, Full> {
        let mut callers = self.callers.lock(shard, now);
        let (id, limits) = callers.side().number(policy, check.key());
        // A new caller's outcome is thrown away with its state when there is no room for it:
        // the algorithms only compute. One that keeps nothing (a look at cost 0, a cost beyond
        // the quota) needs no room.
        callers.upsert(
            id,
            || Caller::new(limits.len()),
            |caller| caller.decide(policy, &limits, now, check),
        )
    }
}

impl Names {
    /// The caller of `key` under `policy`'s namespace, and `policy`'s limit names, by number.
    fn number(&mut self, policy: &RatePolicy, key: Key) -> (CallerId, Vec<u32>) {
        let id = CallerId {
            namespace: self.of(policy.namespace()),
            key: *key.as_bytes(),
        };
        let limits = policy.limits().iter().map(|l| self.of(l.name())).collect();
        (id, limits)
    }

    /// The number of `name`, numbered on first sight.
    fn of(&mut self, name: &str) -> u32 {
        if let Some(&id) = self.0.get(name) {
            return id;
        }
        let id = u32::try_from(self.0.len()).unwrap_or(u32::MAX);
        self.0.insert(Box::from(name), id);
        id
    }
}

impl Expiring for Caller {
    /// A caller without slots or remembered attempts keeps nothing: it is gone.
    fn expires_at(&self) -> u64 {
        if self.slots.is_empty() && self.ledger.expires_at() == 0 {
            0
        } else {
            self.expires_at
        }
    }
}

impl Caller {
    fn new(limits: usize) -> Self {
        Self {
            expires_at: 0,
            slots: Vec::with_capacity(limits),
            ledger: Ledger::default(),
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
        let outcome = algorithms::check(policy, &mut slots, &mut self.ledger, now, check);
        for (&i, slot) in at.iter().zip(slots) {
            self.slots[i].slot = slot;
        }
        self.slots.retain(|l| {
            (l.slot.state.is_some() && l.slot.expires_at > now) || l.slot.blocked_until > now
        });
        self.expires_at = self
            .slots
            .iter()
            .map(|l| l.slot.expires_at.max(l.slot.blocked_until))
            .max()
            .unwrap_or(0)
            .max(self.ledger.expires_at());
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

/// `slot` if it is live at `now`; an empty slot otherwise, which keeps a block that has not
/// ended (a block outlives the state it was decided on).
fn live(slot: Slot, now: u64) -> Slot {
    if slot.expires_at > now {
        slot
    } else {
        Slot {
            blocked_until: if slot.blocked_until > now {
                slot.blocked_until
            } else {
                0
            },
            ..Slot::default()
        }
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

    /// The index, the maps and the count agree, and every caller held has state.
    fn assert_consistent(rates: &LocalRates) {
        rates.callers.assert_consistent(|_, _, caller| {
            assert!(!caller.slots.is_empty() || caller.ledger.expires_at() > 0);
            assert_eq!(caller.expires_at(), caller.expires_at);
        });
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
        rates
            .callers
            .remove_expired_everywhere(rates.clock.now_us());
        assert_eq!(rates.callers.held(), 0);
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
        // past their limits' expiry and the time their attempts are remembered
        tokio::time::advance(std::time::Duration::from_secs(4)).await;
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
        assert_eq!(rates.callers.held(), 0);
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
