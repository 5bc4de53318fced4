//! Where recent rate checks went out: the record of the call that carried each, so that a check
//! sent again (its caller retrying the same [`RateCheck`](crate::rate::RateCheck)) names the
//! call that may have charged it, and `rate.lua` reads that call's record instead of charging a
//! second time.
//!
//! A place is kept as long as its call's record lives in the store (the call's deadline plus the
//! retention): later, the record is gone and naming it would change nothing. Expired places go in
//! insertion order, so the map costs O(1) per check, and holds at most the checks of that span.

use std::collections::{HashMap, VecDeque};
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use tokio::time::Instant;

/// Shards of the map: checks of one batch are sent by one task, but batches of two calls in
/// flight and single checks (`max_batch(1)`) come from many.
const SHARDS: usize = 16;

/// The calls recent checks went out in.
pub(super) struct SentChecks {
    shards: Box<[Mutex<Shard>]>,
    /// How long a place is kept.
    keep: Duration,
}

/// Where a check went: the `check`-th check (1-based) of the call whose record is `record`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Place {
    pub(super) record: Arc<str>,
    pub(super) check: usize,
}

#[derive(Default)]
struct Shard {
    places: HashMap<u64, (Place, Instant), BuildHasherDefault<IdHasher>>,
    /// When each place expires, in the order they were kept.
    expiries: VecDeque<(Instant, u64)>,
}

impl SentChecks {
    /// A map keeping each place for `keep`.
    pub(super) fn new(keep: Duration) -> Self {
        Self {
            shards: (0..SHARDS).map(|_| Mutex::default()).collect(),
            keep,
        }
    }

    /// Keeps that `attempt` goes out at `place` now; where it went before, if it did within
    /// the time a place is kept.
    pub(super) fn went(&self, attempt: u64, place: Place, now: Instant) -> Option<Place> {
        // attempt ids are random: their low bits pick a shard as well as any hash
        let shard = &self.shards[(attempt % SHARDS as u64) as usize];
        let mut shard = shard.lock().unwrap_or_else(PoisonError::into_inner);
        shard.forget_expired(now);
        let until = now + self.keep;
        let before = shard.places.insert(attempt, (place, until));
        shard.expiries.push_back((until, attempt));
        before
            .filter(|&(_, until)| until > now)
            .map(|(place, _)| place)
    }
}

impl Shard {
    fn forget_expired(&mut self, now: Instant) {
        while let Some(&(until, attempt)) = self.expiries.front() {
            if until > now {
                break;
            }
            self.expiries.pop_front();
            // a place kept again since has a later expiry of its own
            if self
                .places
                .get(&attempt)
                .is_some_and(|&(_, kept)| kept <= now)
            {
                self.places.remove(&attempt);
            }
        }
    }
}

/// Attempt ids are random 64-bit numbers: they are their own hash.
#[derive(Default)]
struct IdHasher(u64);

impl Hasher for IdHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0 << 8) | u64::from(b);
        }
    }

    fn write_u64(&mut self, n: u64) {
        self.0 = n;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn place(record: &str, check: usize) -> Place {
        Place {
            record: Arc::from(record),
            check,
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_check_sent_again_learns_where_it_went_until_that_is_forgotten() {
        let sent = SentChecks::new(Duration::from_millis(500));
        let start = Instant::now();
        assert_eq!(sent.went(7, place("r1", 3), start), None);
        assert_eq!(sent.went(8, place("r1", 4), start), None);
        let later = start + Duration::from_millis(400);
        assert_eq!(sent.went(7, place("r2", 1), later), Some(place("r1", 3)));
        // 7's first place expired with its time; its second is kept on
        let after = start + Duration::from_millis(600);
        assert_eq!(sent.went(7, place("r3", 2), after), Some(place("r2", 1)));
        assert_eq!(sent.went(8, place("r3", 5), after), None, "8 was forgotten");
        let shard = sent.shards[8 % SHARDS].lock().unwrap();
        assert_eq!(shard.places.len(), 1, "what expired is gone");
    }
}
