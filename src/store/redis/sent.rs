//! Where recent rate checks went out: the records of the calls that carried each, so that a check
//! sent again (its caller retrying the same [`RateCheck`](crate::rate::RateCheck)) names every
//! call that may have charged it, and `rate.lua` reads those calls' records instead of charging
//! a second time.
//!
//! Every place of an attempt is kept, not only the newest: a send that reached the store after
//! its deadline did nothing and left no record, and naming only it would hide an earlier call
//! that charged. A place is kept as long as its call's record lives in the store (the call's
//! deadline plus the retention): later, the record is gone and naming it would change nothing.
//! The places are kept in spans of that length, a map per span: a check looks in this span's map
//! and the one before, and the map of the span before that is let go whole, since every place in
//! it has expired. So a check costs one insertion and one probe, nothing is removed one by one,
//! and the maps hold at most the sends of two spans.

use std::collections::HashMap;
use std::collections::hash_map::Entry;
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

type Map = HashMap<u64, Places, BuildHasherDefault<IdHasher>>;

#[derive(Default)]
struct Shard {
    /// The attempts sent since `since`, with their places.
    current: Map,
    /// Those sent in the span before, and not since.
    previous: Map,
    since: Option<Instant>,
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
        shard.turn(now, self.keep);
        let here = (place, now + self.keep);
        // an attempt sent in the span before moves to this one's map
        let before = match shard.previous.is_empty() {
            true => None,
            false => shard.previous.remove(&attempt),
        };
        match (shard.current.entry(attempt), before) {
            (Entry::Vacant(vacant), None) => {
                vacant.insert(Places {
                    newest: here,
                    earlier: Vec::new(),
                });
                Vec::new()
            }
            (Entry::Vacant(vacant), Some(places)) => vacant.insert(places).push(here, now),
            // an attempt is in one map at a time
            (Entry::Occupied(mut kept), _) => kept.get_mut().push(here, now),
        }
    }
}

impl Shard {
    /// Begins a span once `keep` has passed since this one began: the map of the span before
    /// is let go (every place in it has expired), and this one's becomes the span before.
    fn turn(&mut self, now: Instant, keep: Duration) {
        let since = *self.since.get_or_insert(now);
        if now < since + keep {
            return;
        }
        if now < since + keep * 2 {
            std::mem::swap(&mut self.current, &mut self.previous);
        } else {
            // this span's places have expired too
            self.previous.clear();
        }
        // cleared, not dropped: the next span reuses its room
        self.current.clear();
        self.since = Some(now);
    }
}

impl Places {
    /// Keeps `here` as the newest place; those before it not expired by `now`, newest first.
    fn push(&mut self, here: (Place, Instant), now: Instant) -> Vec<Place> {
        let before = std::mem::replace(&mut self.newest, here);
        self.earlier.push(before);
        self.earlier.retain(|(_, until)| *until > now);
        self.earlier
            .iter()
            .rev()
            .map(|(place, _)| place.clone())
            .collect()
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
        // a span later, 7's and 8's places of `after` are the only ones held
        let shard = sent.shards[8 % SHARDS].lock().unwrap();
        assert_eq!(shard.current.len() + shard.previous.len(), 1);
        drop(shard);
        let shard = sent.shards[7 % SHARDS].lock().unwrap();
        assert_eq!(shard.current.len() + shard.previous.len(), 1);
    }

    /// Nothing expired is held past two spans, however many attempts went out.
    #[tokio::test(start_paused = true)]
    async fn the_maps_let_expired_places_go_a_span_later() {
        let sent = SentChecks::new(Duration::from_millis(500));
        let start = Instant::now();
        let at = |ms| start + Duration::from_millis(ms);
        for attempt in 0..1_000 {
            assert_eq!(sent.went(attempt, place("r1", 1), at(0)), []);
        }
        let held = |sent: &SentChecks| -> usize {
            sent.shards
                .iter()
                .map(|shard| {
                    let shard = shard.lock().unwrap();
                    shard.current.len() + shard.previous.len()
                })
                .sum()
        };
        // one more send per shard, a span later: the first sends are still in the span before
        for attempt in 1_000..1_016 {
            assert_eq!(sent.went(attempt, place("r2", 1), at(500)), []);
        }
        assert_eq!(held(&sent), 1_016);
        // an attempt of the span before, sent again once its place expired, names nothing
        assert_eq!(sent.went(3, place("r3", 1), at(499 + 500)), []);
        // two spans on, the first sends are let go
        for attempt in 2_000..2_016 {
            assert_eq!(sent.went(attempt, place("r4", 1), at(1_000)), []);
        }
        assert_eq!(held(&sent), 16 + 16 + 1);
        for attempt in 3_000..3_016 {
            assert_eq!(sent.went(attempt, place("r5", 1), at(3_000)), []);
        }
        assert_eq!(held(&sent), 16, "every earlier place expired");
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
        let kept = &shard.current[&7];
        assert_eq!((&kept.newest.0, kept.earlier.len()), (&place("r5", 1), 0));
    }
}
