//! [`LocalRates`]: rate-limit state inside one process, decided by the in-process algorithms.

use std::collections::HashMap;
use std::sync::{Mutex, MutexGuard};
use std::time::{SystemTime, UNIX_EPOCH};

use tokio::time::Instant;

use super::algorithms::{self, Slot};
use super::{RateCheck, RateOutcome, RatePolicy};
use crate::keys;

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

/// Callers' rate state kept in process, under the same keys a shared store would use.
#[derive(Debug)]
pub(crate) struct LocalRates {
    clock: Clock,
    table: Mutex<Table>,
}

#[derive(Debug, Default)]
struct Table {
    slots: HashMap<String, Slot>,
    ops_since_sweep: u32,
}

/// Expired state is swept once per this many decisions.
const SWEEP_EVERY: u32 = 4096;

impl LocalRates {
    /// An empty table on `clock`.
    pub(crate) fn new(clock: Clock) -> Self {
        Self {
            clock,
            table: Mutex::new(Table::default()),
        }
    }

    /// Checks the cost of `check` against every limit of `policy` for its caller and, only if
    /// all have room, charges all of them — in one step under the table's lock.
    pub(crate) fn check(&self, policy: &RatePolicy, check: RateCheck) -> RateOutcome {
        let now = self.clock.now_us();
        let keys = keys::rate(policy, &check.key());
        let mut table = self.lock();
        table.sweep_if_due(now);
        let mut slots: Vec<Slot> = keys.iter().map(|k| table.take_live(k, now)).collect();
        let outcome = algorithms::check(policy, &mut slots, now, check);
        for (key, slot) in keys.into_iter().zip(slots) {
            if slot.state.is_some() {
                table.slots.insert(key, slot);
            }
        }
        outcome
    }

    /// The number of live entries.
    pub(crate) fn len(&self) -> usize {
        let now = self.clock.now_us();
        let table = self.lock();
        table.slots.values().filter(|s| s.expires_at > now).count()
    }

    fn lock(&self) -> MutexGuard<'_, Table> {
        // Every update is a whole-slot assignment made after the decision, so a panic while the
        // lock is held cannot leave a slot half-written: a poisoned table is still consistent.
        self.table.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl Table {
    fn sweep_if_due(&mut self, now: u64) {
        self.ops_since_sweep += 1;
        if self.ops_since_sweep >= SWEEP_EVERY {
            self.ops_since_sweep = 0;
            self.slots.retain(|_, s| s.expires_at > now);
        }
    }

    /// Takes out the slot of `key` if it is live; an empty slot otherwise.
    fn take_live(&mut self, key: &str, now: u64) -> Slot {
        match self.slots.remove(key) {
            Some(slot) if slot.expires_at > now => slot,
            _ => Slot::default(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::key::Key;
    use crate::rate::{Algorithm, Limit};

    /// With the clock frozen, a burst admits exactly the quota, also when the emission interval
    /// is not a whole number of microseconds (or under one).
    #[tokio::test(start_paused = true)]
    async fn gcra_bursts_are_exact_with_fractional_intervals() {
        let rates = LocalRates::new(Clock::new());
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
            let mut admitted = 0u64;
            for _ in 0..quota + quota / 100 + 5 {
                admitted += u64::from(rates.check(&policy, RateCheck::new(key, 1)).admitted);
            }
            assert_eq!(admitted, quota, "quota {quota}");
            // and a cost that fits the quota exactly, on a fresh key
            let fresh = Key::new("t", b"whole");
            assert!(rates.check(&policy, RateCheck::new(fresh, quota)).admitted);
            assert!(!rates.check(&policy, RateCheck::new(fresh, 1)).admitted);
        }
    }

    #[tokio::test(start_paused = true)]
    async fn huge_costs_neither_panic_nor_wrap() {
        let rates = LocalRates::new(Clock::new());
        for algorithm in [
            Algorithm::SlidingLog,
            Algorithm::SlidingCounter,
            Algorithm::Gcra,
        ] {
            let policy =
                RatePolicy::new("t:rl", algorithm, vec![Limit::per_second("s", 5)]).unwrap();
            let out = rates.check(&policy, RateCheck::new(Key::new("t", b"k"), u64::MAX));
            assert!(!out.admitted, "{algorithm}");
        }
    }
}
