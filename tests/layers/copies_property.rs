//! Several copies of a leased rate limit over one store, held to the leases' bounds through
//! random interleavings on a paused clock: requests one at a time and in bursts, requests that
//! go away mid-fetch, lease ends, resets through any copy, lost replies, and copies that never
//! hear a broadcast. Checked after every step: no window admits more than the algorithm allows
//! (after a reset, more by at most what the copies held of their slices). With a window of a day
//! and no reset, once every slice is given back the store counts exactly what was admitted,
//! plus the checks whose replies were lost. A failing case names its seed and its operations;
//! `TOLLGATE_COPIES_SEED` runs the cases from that seed.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::Duration;

use futures_util::FutureExt;
use http::StatusCode;
use tokio::time::Instant;

use crate::rate_limit_leases::{self, key_of};
use tollgate::key::{Header, Key};
use tollgate::rate::{RateCheck, RateOutcome, RatePolicy};
use tollgate::rate_limit::{Algorithm, Limit, OnStoreError, RateLimitLayer};
use tollgate::store::{Invalidations, MemoryStore, RateStore, StoreError, StoreFuture};

const COPIES: usize = 3;
const QUOTA: u64 = 24;
const CASES: u64 = 60;
const LEN: usize = 100;

/// One step of a case.
#[derive(Debug, Clone, Copy)]
enum Op {
    Request {
        copy: usize,
        caller: usize,
    },
    Burst {
        copy: usize,
        caller: usize,
        n: usize,
    },
    /// A request whose client leaves after its first poll.
    Dropped {
        copy: usize,
        caller: usize,
    },
    Sleep {
        ms: u64,
    },
    Reset {
        copy: usize,
        caller: usize,
    },
    /// The copy's next reply from the store is lost (the call is carried out; its answer never
    /// comes, and the copy hears a timeout).
    Lose {
        copy: usize,
    },
    GiveBack {
        copy: usize,
    },
}

/// A copy's way to the store: the shared memory store, some replies lost, broadcasts heard or
/// not.
#[derive(Debug, Clone)]
struct Wire {
    store: MemoryStore,
    lose: Arc<AtomicU32>,
    /// The cost of plain checks whose replies were lost (charged, never admitted).
    lost_plain: Arc<AtomicU64>,
    hears: bool,
}

impl RateStore for Wire {
    fn check_rate(&self, policy: &Arc<RatePolicy>, check: RateCheck) -> StoreFuture<RateOutcome> {
        let answer = self.store.check_rate(policy, check);
        let lost = self
            .lose
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_ok();
        if !lost {
            return answer;
        }
        let timeout = self.store.timeout();
        let lost_plain = Arc::clone(&self.lost_plain);
        Box::pin(async move {
            let outcome = answer.await?;
            if outcome.admitted && !check.is_reservation() && check.settles().is_none() {
                lost_plain.fetch_add(check.cost(), Ordering::SeqCst);
            }
            tokio::time::sleep(timeout).await;
            Err(StoreError::timeout())
        })
    }

    fn timeout(&self) -> Duration {
        self.store.timeout()
    }

    fn reset_rate(&self, policy: &Arc<RatePolicy>, key: Key) -> StoreFuture<()> {
        self.store.reset_rate(policy, key)
    }

    fn invalidations(&self) -> Option<Invalidations> {
        if self.hears {
            self.store.invalidations()
        } else {
            None
        }
    }
}

/// SplitMix64: a case is made again from its seed.
struct Random(u64);

impl Random {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: u64) -> usize {
        (self.next() % n) as usize
    }
}

fn generate(seed: u64, resets: bool, sleeps: &[u64]) -> Vec<Op> {
    let mut r = Random(seed);
    (0..LEN)
        .map(|_| {
            let (copy, caller) = (r.below(COPIES as u64), r.below(2));
            match r.below(20) {
                0..=7 => Op::Request { copy, caller },
                8..=10 => Op::Burst {
                    copy,
                    caller,
                    n: 2 + r.below(30),
                },
                11 | 12 => Op::Dropped { copy, caller },
                13..=15 => Op::Sleep {
                    ms: sleeps[r.below(sleeps.len() as u64)],
                },
                16 if resets => Op::Reset { copy, caller },
                17 => Op::Lose { copy },
                18 => Op::GiveBack { copy },
                _ => Op::Request { copy, caller },
            }
        })
        .collect()
}

const CALLERS: [&str; 2] = ["alice", "bob"];

/// A run of one case: the copies, and what they admitted.
struct Run {
    copies: Vec<RateLimitLayer<Header>>,
    wires: Vec<Wire>,
    algorithm: Algorithm,
    window: Duration,
    /// Per caller, when each unit was admitted since its last reset.
    admitted: [Vec<Instant>; 2],
    /// Per caller, what the copies held of their slices at its last reset.
    allowance: [u64; 2],
    /// Store time (µs) at `origin`: windows are placed on the store's clock.
    origin: (Instant, u64),
}

impl Run {
    async fn new(algorithm: Algorithm, window: Duration, seed: u64) -> Self {
        let store = MemoryStore::new();
        let lost_plain = Arc::new(AtomicU64::new(0));
        let prefix = format!("p{seed}");
        let mut copies = Vec::new();
        let mut wires = Vec::new();
        for i in 0..COPIES {
            let wire = Wire {
                store: store.clone(),
                lose: Arc::default(),
                lost_plain: Arc::clone(&lost_plain),
                // the last copy never hears a broadcast
                hears: i + 1 < COPIES,
            };
            copies.push(
                RateLimitLayer::builder(wire.clone())
                    .limit(Limit::new("api", QUOTA, window).leased())
                    .algorithm(algorithm)
                    .prefix(prefix.clone())
                    .key(Header::from_static("x-api-key"))
                    .on_store_error(OnStoreError::Deny)
                    .build()
                    .unwrap(),
            );
            wires.push(wire);
        }
        let key = key_of(&copies[0], CALLERS[0]);
        let at = copies[0].peek(key).await.unwrap().decided_at_us.unwrap();
        Self {
            copies,
            wires,
            algorithm,
            window,
            admitted: [Vec::new(), Vec::new()],
            allowance: [0, 0],
            origin: (Instant::now(), at),
        }
    }

    async fn step(&mut self, op: Op) {
        match op {
            Op::Request { copy, caller } => {
                if request(&self.copies[copy], CALLERS[caller]).await {
                    self.admitted[caller].push(Instant::now());
                }
            }
            Op::Burst { copy, caller, n } => {
                // each admission at the time its answer came
                let replies = futures_util::future::join_all((0..n).map(|_| async {
                    let admitted = request(&self.copies[copy], CALLERS[caller]).await;
                    admitted.then(Instant::now)
                }))
                .await;
                self.admitted[caller].extend(replies.into_iter().flatten());
                self.admitted[caller].sort_unstable();
            }
            Op::Dropped { copy, caller } => {
                let reply = request(&self.copies[copy], CALLERS[caller]).now_or_never();
                if reply == Some(true) {
                    self.admitted[caller].push(Instant::now());
                }
            }
            Op::Sleep { ms } => tokio::time::sleep(Duration::from_millis(ms)).await,
            Op::Reset { copy, caller } => {
                let key = key_of(&self.copies[copy], CALLERS[caller]);
                self.allowance[caller] = self.copies.iter().map(|c| c.leases_unspent()).sum();
                self.copies[copy].reset(key).await.unwrap();
                self.admitted[caller].clear();
            }
            Op::Lose { copy } => {
                self.wires[copy].lose.fetch_add(1, Ordering::SeqCst);
            }
            Op::GiveBack { copy } => self.copies[copy].give_back_leases().await,
        }
        // what runs in the background (fetches, give-backs, broadcasts) runs before the check
        tokio::task::yield_now().await;
    }

    /// The most `caller`'s admissions in any window the algorithm counts exceed what it allows
    /// (0: none do).
    fn excess(&self, caller: usize) -> u64 {
        let times = &self.admitted[caller];
        let allowed = QUOTA + self.allowance[caller];
        let w = self.window.as_micros() as u64;
        let mut worst = 0;
        for (j, &end) in times.iter().enumerate() {
            for (i, &start) in times[..=j].iter().enumerate() {
                let count = (j - i + 1) as u64;
                let span = end.duration_since(start).as_micros() as u64;
                let limit = match self.algorithm {
                    // any window: (end - w, end]
                    Algorithm::SlidingLog if span < w => allowed,
                    // any span D: the burst plus D / T
                    Algorithm::Gcra => allowed + span * QUOTA / w,
                    // a window of the store's clock
                    Algorithm::SlidingCounter if self.window_of(start) == self.window_of(end) => {
                        allowed
                    }
                    _ => continue,
                };
                worst = worst.max(count.saturating_sub(limit));
            }
        }
        worst
    }

    fn window_of(&self, at: Instant) -> u64 {
        let store_us = self.origin.1 + at.duration_since(self.origin.0).as_micros() as u64;
        store_us / 1000 / (self.window.as_millis() as u64)
    }

    /// What the store counts as spent of `caller`'s quota, asked past the copies' wires.
    async fn charged(&self, caller: usize) -> u64 {
        let key = key_of(&self.copies[0], CALLERS[caller]);
        let policy = self.copies[0].policy();
        let look = self.wires[0]
            .store
            .check_rate(&policy, RateCheck::new(key, 0));
        QUOTA - look.await.unwrap().limits[0].remaining
    }
}

async fn request(copy: &RateLimitLayer<Header>, caller: &str) -> bool {
    match rate_limit_leases::one(copy, caller).await.0 {
        StatusCode::OK => true,
        StatusCode::TOO_MANY_REQUESTS | StatusCode::SERVICE_UNAVAILABLE => false,
        other => panic!("unexpected status {other}"),
    }
}

fn seeds() -> std::ops::Range<u64> {
    let from = std::env::var("TOLLGATE_COPIES_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(1);
    from..from + CASES
}

const ALGORITHMS: [Algorithm; 3] = [
    Algorithm::SlidingLog,
    Algorithm::SlidingCounter,
    Algorithm::Gcra,
];

/// Runs `ops` on copies of `algorithm` with windows of 2 s: the first operation after which a
/// window admitted too many, and how many.
async fn first_excess(algorithm: Algorithm, seed: u64, ops: &[Op]) -> Option<(usize, u64, usize)> {
    let mut run = Run::new(algorithm, Duration::from_secs(2), seed).await;
    for (at, op) in ops.iter().enumerate() {
        run.step(*op).await;
        for caller in 0..2 {
            let excess = run.excess(caller);
            if excess > 0 {
                return Some((at, excess, caller));
            }
        }
    }
    None
}

/// The fewest operations of `ops` that still fail, one removed at a time.
async fn shrink(algorithm: Algorithm, seed: u64, mut ops: Vec<Op>) -> Vec<Op> {
    let mut i = 0;
    while i < ops.len() {
        let mut fewer = ops.clone();
        fewer.remove(i);
        if first_excess(algorithm, seed, &fewer).await.is_some() {
            ops = fewer;
        } else {
            i += 1;
        }
    }
    ops
}

/// Sequences the random cases found, shrunk; each runs under every algorithm.
const CORPUS: &[(&str, &[Op])] = &[(
    // a slice spent 150 ms into its lease was forgotten a window after its fetch, while its
    // units were admitted less than a window before: a sliding log admitted the quota again
    "a slice spent late, then a window later a burst",
    &[
        Op::Burst {
            copy: 2,
            caller: 0,
            n: 11,
        },
        Op::Sleep { ms: 150 },
        Op::Request { copy: 2, caller: 0 },
        Op::Sleep { ms: 1_850 },
        Op::Burst {
            copy: 2,
            caller: 0,
            n: 25,
        },
    ],
)];

#[tokio::test(start_paused = true)]
async fn the_corpus_admits_no_more_than_a_window_allows() {
    for algorithm in ALGORITHMS {
        for (name, ops) in CORPUS {
            let excess = first_excess(algorithm, 0, ops).await;
            assert_eq!(excess, None, "{algorithm}: {name}");
        }
    }
}

/// Windows of 2 s (leases of 200 ms), resets and all: no window admits more than allowed.
#[tokio::test(start_paused = true)]
async fn copies_never_admit_more_than_a_window_allows() {
    for algorithm in ALGORITHMS {
        for seed in seeds() {
            let ops = generate(seed, true, &[1, 50, 150, 1_850, 2_100]);
            if let Some((at, excess, caller)) = first_excess(algorithm, seed, &ops).await {
                let ops = ops[..=at].to_vec();
                let shrunk = shrink(algorithm, seed, ops).await;
                panic!(
                    "{algorithm}, seed {seed}: after operation {at}, {excess} admitted too many \
                     for {}\nshrunk: {shrunk:#?}",
                    CALLERS[caller]
                );
            }
        }
    }
}

/// A window of a day and no reset: once every copy gave its slices back, the store counts
/// exactly what was admitted and what lost replies charged.
#[tokio::test(start_paused = true)]
async fn given_back_the_store_counts_exactly_what_was_admitted() {
    for algorithm in ALGORITHMS {
        for seed in seeds() {
            let ops = generate(seed, false, &[1, 50, 2_000, 11_000]);
            let mut run = Run::new(algorithm, Duration::from_secs(86_400), seed).await;
            for op in &ops {
                run.step(*op).await;
                for caller in 0..2 {
                    assert!(run.admitted[caller].len() as u64 <= QUOTA);
                }
            }
            for copy in &run.copies {
                copy.give_back_leases().await;
            }
            // a GCRA slice charged from its lease's end: that part has passed a lease later
            tokio::time::sleep(Duration::from_secs(11)).await;
            let lost = run.wires[0].lost_plain.load(Ordering::SeqCst);
            let admitted: u64 = run.admitted.iter().map(|a| a.len() as u64).sum();
            let charged = run.charged(0).await + run.charged(1).await;
            assert_eq!(
                charged,
                admitted + lost,
                "{algorithm}, seed {seed}: {admitted} admitted, {lost} charged by lost replies\n\
                 ops: {ops:?}"
            );
        }
    }
}
