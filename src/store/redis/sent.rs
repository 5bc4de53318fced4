//! Where recent rate checks went out: the records of the calls that carried each, so that a check
//! sent again (its caller retrying the same [`RateCheck`](crate::rate::RateCheck)) names every
//! call that may have charged it, and `rate.lua` reads those calls' records instead of charging
//! a second time.
//!
//! Every place of an attempt is kept, not only the newest: a send that reached the store after
//! its deadline did nothing and left no record, and naming only it would hide an earlier call
//! that charged. A place is kept as long as its call's record lives in the store (the call's
//! deadline plus the retention): later, the record is gone and naming it would change nothing.
//! Expired places go in insertion order, so the map costs O(1) per check, and holds at most the
//! sends of that span.

use std::collections::hash_map::Entry;
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
    places: HashMap<u64, Places, BuildHasherDefault<IdHasher>>,
    /// When each place expires, in the order they were kept.
    expiries: VecDeque<(Instant, u64)>,
}

/// The places of one attempt, each with when it expires: the newest, and those before it still
/// kept (empty, and not allocated, for an attempt sent once).
struct Places {
    newest: (Place, Instant),
    earlier: Vec<(Place, Instant)>,
}

impl SentChecks {
    /// A map keeping each place for `keep`.
    pub(super) fn new(keep: Duration) -> Self {
        Self {
            shards: (0..SHARDS).map(|_| Mutex::default()).collect(),
            keep,
        }
    }

    /// Keeps that `attempt` goes out at `place` now; every place it went out at before, within
    /// the time a place is kept, newest first.
    pub(super) fn went(&self, attempt: u64, place: Place, now: Instant) -> Vec<Place> {
        // attempt ids are random: their low bits pick a shard as well as any hash
        let shard = &self.shards[(attempt % SHARDS as u64) as usize];
        let mut shard = shard.lock().unwrap_or_else(PoisonError::into_inner);
        shard.forget_expired(now);
        let until = now + self.keep;
        shard.expiries.push_back((until, attempt));
        let here = (place, until);
        match shard.places.entry(attempt) {
            Entry::Vacant(vacant) => {
                vacant.insert(Places {
                    newest: here,
                    earlier: Vec::new(),
                });
                Vec::new()
            }
            Entry::Occupied(mut kept) => {
                let kept = kept.get_mut();
                let before = std::mem::replace(&mut kept.newest, here);
                kept.earlier.push(before);
                kept.earlier
                    .iter()
                    .rev()
                    .filter(|(_, until)| *until > now)
                    .map(|(place, _)| place.clone())
                    .collect()
            }
        }
    }
}

impl Shard {
    fn forget_expired(&mut self, now: Instant) {
        while let Some(&(until, attempt)) = self.expiries.front() {
            if until > now {
                break;
            }
            self.expiries.pop_front();
            let Entry::Occupied(mut kept) = self.places.entry(attempt) else {
                continue;
            };
            // each place has an expiry of its own in the queue: this one drops those expired
            let places = kept.get_mut();
            places.earlier.retain(|&(_, kept)| kept > now);
            if places.newest.1 <= now {
                match places.earlier.pop() {
                    Some(newest) => places.newest = newest,
                    None => {
                        kept.remove();
                    }
                }
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
        assert_eq!(sent.went(7, place("r1", 3), start), []);
        assert_eq!(sent.went(8, place("r1", 4), start), []);
        let later = start + Duration::from_millis(400);
        assert_eq!(sent.went(7, place("r2", 1), later), [place("r1", 3)]);
        // 7's first place expired with its time; its second is kept on
        let after = start + Duration::from_millis(600);
        assert_eq!(sent.went(7, place("r3", 2), after), [place("r2", 1)]);
        assert_eq!(sent.went(8, place("r3", 5), after), [], "8 was forgotten");
        let shard = sent.shards[8 % SHARDS].lock().unwrap();
        assert_eq!(shard.places.len(), 1, "what expired is gone");
    }

    /// A send that did nothing (received after its deadline) leaves no record: the next send
    /// names it and every place before it that may still hold a charge.
    #[tokio::test(start_paused = true)]
    async fn a_check_sent_again_names_every_place_it_went_out_at() {
        let sent = SentChecks::new(Duration::from_millis(500));
        let start = Instant::now();
        let at = |ms| start + Duration::from_millis(ms);
        assert_eq!(sent.went(7, place("r1", 1), at(0)), []);
        assert_eq!(sent.went(7, place("r2", 2), at(100)), [place("r1", 1)]);
        assert_eq!(
            sent.went(7, place("r3", 1), at(200)),
            [place("r2", 2), place("r1", 1)],
            "newest first"
        );
        assert_eq!(
            sent.went(7, place("r4", 1), at(550)),
            [place("r3", 1), place("r2", 2)],
            "r1 expired"
        );
        assert_eq!(sent.went(7, place("r5", 1), at(1100)), [], "all expired");
        let shard = sent.shards[7 % SHARDS].lock().unwrap();
        let kept = &shard.places[&7];
        assert_eq!((&kept.newest.0, kept.earlier.len()), (&place("r5", 1), 0));
    }
}
