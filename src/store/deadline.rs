//! Deadlines on the store's clock: a write that reaches the store after its caller gave up on it
//! does nothing, whenever it arrives.
//!
//! A caller knows its deadline as an [`Instant`] of its own clock; the store knows only its own
//! time. [`StoreClock`] turns the one into the other conservatively, from readings of the store's
//! clock (`TIME`, `clock_timestamp()`): a reading `r` taken by the store before the reply that
//! carried it arrived here at `seen` proves that, at any later local instant `t`, the store's
//! clock reads at least `r + (t - seen) × (1 - DRIFT)` — provided the store's clock never steps
//! back and runs at most `DRIFT` slower than ours. The deadline sent is that bound at the
//! caller's deadline, less [`MARGIN`]: once the caller's deadline has passed here, the store's
//! clock is past the deadline it was sent, so a late arrival is refused by the store itself.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use tokio::time::Instant;

/// How much slower than ours the store's clock may run: 0.1 %, ten times what NTP slews.
const DRIFT_PER_MILLE: u32 = 1;

/// Subtracted from every deadline sent: room for the clocks of a Cluster's nodes to differ, and
/// for the rounding of the readings.
pub(crate) const MARGIN: Duration = Duration::from_millis(2);

/// A reading older than this is refreshed before it is used again (in the background when it is
/// younger than [`STALE`]): its drift allowance grows with its age.
pub(crate) const REFRESH: Duration = Duration::from_secs(1);

/// A reading older than this is not used: a fresh one is taken first.
pub(crate) const STALE: Duration = Duration::from_secs(30);

/// A lower bound on a store's clock, learnt from its readings.
#[derive(Debug, Default)]
pub(crate) struct StoreClock {
    reading: Mutex<Option<Reading>>,
    /// A reading is being taken in the background: no other caller starts one.
    refreshing: AtomicBool,
}

#[derive(Debug, Clone, Copy)]
struct Reading {
    /// The store's time in microseconds since the Unix epoch.
    store_us: u64,
    /// When the reply that carried it arrived.
    seen: Instant,
}

impl Reading {
    /// The least the store's clock can read at `at` (no earlier than `seen`).
    fn bound_at(self, at: Instant) -> u64 {
        let elapsed = at.saturating_duration_since(self.seen);
        let slowed = elapsed - elapsed * DRIFT_PER_MILLE / 1000;
        self.store_us
            .saturating_add(u64::try_from(slowed.as_micros()).unwrap_or(u64::MAX))
    }
}

/// What the clock can tell about a deadline.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Mapped {
    /// The deadline on the store's clock, in microseconds; `refresh` when this caller should
    /// take a new reading (in the background, then [`observe`](StoreClock::observe) it, or
    /// tell [`refresh_failed`](StoreClock::refresh_failed)).
    At { store_us: u64, refresh: bool },
    /// No usable reading: take one first.
    Unknown,
}

impl StoreClock {
    /// Learns the store's time `store_us`, read by a reply that arrived at `seen`.
    pub(crate) fn observe(&self, store_us: u64, seen: Instant) {
        let new = Reading { store_us, seen };
        let mut reading = self.reading.lock().unwrap_or_else(PoisonError::into_inner);
        // the newer reading holds: of one healthy clock it proves at least what the older did;
        // one behind the older's bound is of a clock behind what was assumed (a new primary's
        // after a failover, a clock stepped back), which deadlines must now follow
        match *reading {
            Some(old) if old.seen > seen => {}
            _ => *reading = Some(new),
        }
        drop(reading);
        self.refreshing.store(false, Ordering::Release);
    }

    /// A background reading failed: the next caller may start another.
    pub(crate) fn refresh_failed(&self) {
        self.refreshing.store(false, Ordering::Release);
    }

    /// `deadline` as a time of the store's clock no later than the store's clock at `deadline`.
    pub(crate) fn map(&self, deadline: Instant) -> Mapped {
        let reading = *self.reading.lock().unwrap_or_else(PoisonError::into_inner);
        let Some(reading) = reading else {
            return Mapped::Unknown;
        };
        let age = Instant::now().saturating_duration_since(reading.seen);
        if age >= STALE {
            return Mapped::Unknown;
        }
        let margin = u64::try_from(MARGIN.as_micros()).unwrap_or(0);
        Mapped::At {
            store_us: reading.bound_at(deadline).saturating_sub(margin).max(1),
            refresh: age >= REFRESH && !self.refreshing.swap(true, Ordering::AcqRel),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn a_deadline_maps_to_no_later_than_the_store_clock_then() {
        let clock = StoreClock::default();
        let now = Instant::now();
        assert_eq!(clock.map(now), Mapped::Unknown);
        clock.observe(1_000_000_000, now);
        let deadline = now + Duration::from_millis(250);
        // 250 ms on, less 0.1 % and the margin
        assert_eq!(
            clock.map(deadline),
            Mapped::At {
                store_us: 1_000_000_000 + 249_750 - 2_000,
                refresh: false
            }
        );
        // a reading that arrives out of order (seen before the one held) is not taken
        clock.observe(999_000_000, now - Duration::from_millis(1));
        assert!(
            matches!(clock.map(deadline), Mapped::At { store_us, .. } if store_us > 1_000_000_000)
        );
        tokio::time::advance(REFRESH).await;
        assert!(matches!(
            clock.map(Instant::now()),
            Mapped::At { refresh: true, .. }
        ));
        // one caller refreshes at a time
        assert!(matches!(
            clock.map(Instant::now()),
            Mapped::At { refresh: false, .. }
        ));
        clock.refresh_failed();
        assert!(matches!(
            clock.map(Instant::now()),
            Mapped::At { refresh: true, .. }
        ));
        tokio::time::advance(STALE).await;
        assert_eq!(clock.map(Instant::now()), Mapped::Unknown);
    }

    /// A newer reading behind what the older one predicts — a new primary whose clock is behind
    /// the old one's, a clock stepped back — is taken: a deadline sent from then on is no later
    /// than that clock at the caller's deadline, so a late command is still refused there.
    #[tokio::test(start_paused = true)]
    async fn a_clock_found_behind_is_followed() {
        let clock = StoreClock::default();
        let start = Instant::now();
        clock.observe(1_000_000_000, start);
        tokio::time::advance(Duration::from_millis(100)).await;
        // the new primary reads 400 ms behind what the old one would
        let now = Instant::now();
        clock.observe(1_000_000_000 + 100_000 - 400_000, now);
        let deadline = now + Duration::from_millis(250);
        let Mapped::At { store_us, .. } = clock.map(deadline) else {
            panic!("a reading is held");
        };
        assert_eq!(
            store_us,
            1_000_000_000 + 100_000 - 400_000 + 249_750 - 2_000
        );
    }
}
