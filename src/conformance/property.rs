//! Random sequences of rate checks held against the [reference model](super::model).
//!
//! A [`Case`] is a few policies and a sequence of [`Op`]s by one or two callers: checks and
//! reservations, re-sends of them, settlements and their re-sends, resets and waits. [`run`]
//! sends them to a store one after another and compares every reply — admitted or not, the
//! wait, each limit's remaining quota and reset — with the model's answer at the time the
//! store decided ([`RateOutcome::decided_at_us`]). [`search`] runs many random cases at once
//! and shrinks a failing one to the fewest operations that still fail, so that it can join
//! [`CORPUS`], the cases run every time.
//!
//! Re-sends go out within 1.5 × the store's timeout of the first send: the ledger remembers an
//! attempt for its deadline plus twice the timeout, so no answer depends on where exactly a
//! store draws that line.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use super::model::Model;
use crate::key::Key;
use crate::rate::{Algorithm, Limit, RateCheck, RateOutcome, RatePolicy};
use crate::store::RateStore;

/// One step of a case.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    /// A new check by caller `caller` under policy `policy` (indexes, taken modulo the case's
    /// numbers), of `cost`; a reservation when `reserve`.
    Check {
        /// The caller.
        caller: u8,
        /// The policy.
        policy: u8,
        /// The cost.
        cost: u64,
        /// Whether it is a reservation.
        reserve: bool,
    },
    /// A reservation by `caller` under `policy` of `cost`, its units admitted over up to
    /// `hold_ms` after the charge (a leased slice: [`RateCheck::held`]).
    Held {
        /// The caller.
        caller: u8,
        /// The policy.
        policy: u8,
        /// The cost.
        cost: u64,
        /// The hold, in milliseconds.
        hold_ms: u32,
    },
    /// The `back`-th latest check sent again (0: the latest); skipped when it went out more
    /// than 1.5 × the timeout ago.
    Resend {
        /// How far back.
        back: u8,
    },
    /// The `back`-th latest check settled for `actual`; a check settled before makes the same
    /// attempt again, skipped as [`Op::Resend`] is.
    Settle {
        /// How far back.
        back: u8,
        /// The actual cost.
        actual: u64,
    },
    /// The `back`-th latest settlement sent again; skipped as [`Op::Resend`] is.
    ResendSettlement {
        /// How far back.
        back: u8,
    },
    /// Caller `caller`'s limits of policy `policy` reset.
    Reset {
        /// The caller.
        caller: u8,
        /// The policy.
        policy: u8,
    },
    /// A wait of 1.2 × the store's timeout: the deadline of every check sent before has passed.
    PastTimeout,
    /// A wait of `ms` milliseconds.
    Sleep {
        /// Milliseconds.
        ms: u32,
    },
}

impl Op {
    /// A check by `caller` on policy `policy` of `cost`, charged at once.
    pub const fn check(caller: u8, policy: u8, cost: u64) -> Self {
        Self::Check {
            caller,
            policy,
            cost,
            reserve: false,
        }
    }

    /// A reservation by `caller` on policy `policy` of `cost`, to be settled.
    pub const fn reserve(caller: u8, policy: u8, cost: u64) -> Self {
        Self::Check {
            caller,
            policy,
            cost,
            reserve: true,
        }
    }
}

/// A policy of a case: its algorithm and limits, each a quota and a window in milliseconds.
pub type PolicySpec = (Algorithm, &'static [(u64, u64)]);

/// A case: its policies and its operations.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Case {
    /// The policies, in one namespace of the case's own.
    pub policies: Vec<PolicySpec>,
    /// The limits that [count calls](Limit::counting_calls), each as (policy, limit) indexes:
    /// beside the others of their policy, which count the cost.
    pub counting_calls: Vec<(usize, usize)>,
    /// The operations, in order.
    pub ops: Vec<Op>,
}

/// Where a store's answer differs from the model's.
#[derive(Debug, Clone)]
pub struct Mismatch {
    /// The operation's index in the case.
    pub at: usize,
    /// What went wrong.
    pub what: String,
}

impl fmt::Display for Mismatch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "operation {}: {}", self.at, self.what)
    }
}

/// The cases every store passes, each once found by [`search`] (or written for a rule of the
/// ledger), shrunk.
pub const CORPUS: &[(&str, &[PolicySpec], &[Op])] = &[
    (
        "a refund made after the charge left the window returns nothing",
        &[
            (Algorithm::Gcra, &[(10, 300)]),
            (Algorithm::SlidingCounter, &[(10, 300)]),
        ],
        &[
            Op::reserve(0, 0, 10),
            Op::reserve(0, 1, 10),
            Op::Sleep { ms: 650 },
            Op::check(0, 0, 10),
            Op::check(0, 1, 10),
            Op::Settle { back: 3, actual: 0 },
            Op::Settle { back: 2, actual: 0 },
            Op::check(0, 0, 10),
            Op::check(0, 1, 10),
        ],
    ),
    (
        "a counter refund in the next window comes out of the previous one",
        &[(Algorithm::SlidingCounter, &[(10, 400)])],
        &[
            Op::reserve(0, 0, 6),
            Op::Sleep { ms: 450 },
            Op::check(0, 0, 2),
            Op::Settle { back: 1, actual: 1 },
            Op::check(0, 0, 0),
        ],
    ),
    (
        "a check retried past its deadline, after another charged the caller, is charged once",
        &[
            (Algorithm::Gcra, &[(10, 60_000)]),
            (Algorithm::SlidingCounter, &[(10, 60_000)]),
        ],
        &[
            Op::check(0, 0, 1),
            Op::check(0, 1, 1),
            Op::PastTimeout,
            Op::check(0, 0, 1),
            Op::check(0, 1, 1),
            Op::Resend { back: 3 },
            Op::Resend { back: 2 },
        ],
    ),
    (
        "a settlement re-sent after another settled is applied once",
        &[
            (Algorithm::SlidingLog, &[(10, 60_000)]),
            (Algorithm::SlidingCounter, &[(10, 60_000)]),
            (Algorithm::Gcra, &[(10, 60_000)]),
        ],
        &[
            Op::reserve(0, 0, 4),
            Op::reserve(0, 0, 4),
            Op::Settle { back: 1, actual: 1 },
            Op::PastTimeout,
            Op::Settle { back: 0, actual: 2 },
            Op::ResendSettlement { back: 1 },
            Op::reserve(1, 1, 4),
            Op::reserve(1, 1, 4),
            Op::Settle { back: 1, actual: 1 },
            Op::Settle { back: 0, actual: 2 },
            Op::ResendSettlement { back: 1 },
            Op::reserve(1, 2, 4),
            Op::reserve(1, 2, 4),
            Op::Settle { back: 1, actual: 1 },
            Op::Settle { back: 0, actual: 2 },
            Op::ResendSettlement { back: 1 },
        ],
    ),
    (
        "a check re-sent after eight others is charged once",
        &[
            (Algorithm::SlidingCounter, &[(20, 60_000)]),
            (Algorithm::Gcra, &[(20, 60_000)]),
        ],
        &[
            Op::check(0, 0, 1),
            Op::check(0, 0, 1),
            Op::check(0, 0, 1),
            Op::check(0, 0, 1),
            Op::check(0, 0, 1),
            Op::check(0, 0, 1),
            Op::check(0, 0, 1),
            Op::check(0, 0, 1),
            Op::check(0, 0, 1),
            Op::Resend { back: 8 },
            Op::check(0, 1, 1),
            Op::check(0, 1, 1),
            Op::check(0, 1, 1),
            Op::check(0, 1, 1),
            Op::check(0, 1, 1),
            Op::check(0, 1, 1),
            Op::check(0, 1, 1),
            Op::check(0, 1, 1),
            Op::check(0, 1, 1),
            Op::Resend { back: 8 },
        ],
    ),
    (
        "a reservation refunded by its settlement and sent again is not charged again",
        &[(Algorithm::SlidingLog, &[(10, 60_000)])],
        &[
            Op::reserve(0, 0, 3),
            Op::Settle { back: 0, actual: 0 },
            Op::Resend { back: 0 },
            Op::check(0, 0, 0),
        ],
    ),
    (
        // found on the memory store, which kept its attempts on a limit's state: once that
        // expired, the settlement made again was applied again
        "a settlement made again after its limit's state expired is applied once",
        &[
            (Algorithm::Gcra, &[(3, 200), (8, 1_000)]),
            (Algorithm::SlidingCounter, &[(4, 300)]),
        ],
        &[
            Op::check(1, 0, 1),
            Op::reserve(0, 0, 0),
            Op::Settle { back: 1, actual: 9 },
            Op::reserve(0, 1, 5),
            Op::Sleep { ms: 500 },
            Op::Settle {
                back: 2,
                actual: u64::MAX,
            },
        ],
    ),
    (
        "a settlement of a reservation of 2^50 among other checks",
        &[
            (Algorithm::Gcra, &[(10, 60_000)]),
            (Algorithm::SlidingLog, &[(10, 60_000)]),
        ],
        &[
            Op::Check {
                caller: 0,
                policy: 0,
                cost: 1 << 50,
                reserve: true,
            },
            Op::Settle { back: 0, actual: 0 },
            Op::reserve(0, 0, 2),
            Op::Settle {
                back: 0,
                actual: u64::MAX,
            },
            Op::Check {
                caller: 0,
                policy: 1,
                cost: 1 << 50,
                reserve: true,
            },
            Op::Settle { back: 0, actual: 1 },
            Op::check(0, 0, 1),
            Op::check(0, 1, 1),
        ],
    ),
    (
        "a refund after a reset returns nothing of what was charged since",
        &[
            (Algorithm::SlidingCounter, &[(10, 60_000)]),
            (Algorithm::Gcra, &[(5, 400), (12, 60_000)]),
        ],
        &[
            Op::reserve(0, 0, 8),
            Op::reserve(0, 1, 4),
            Op::Reset {
                caller: 0,
                policy: 0,
            },
            Op::Reset {
                caller: 0,
                policy: 1,
            },
            Op::check(0, 0, 5),
            Op::check(0, 1, 3),
            Op::Settle { back: 3, actual: 0 },
            Op::Settle { back: 2, actual: 1 },
            Op::check(0, 0, 6),
            Op::check(0, 1, 2),
        ],
    ),
    (
        "held charges: a log dates them at the hold's end, GCRA charges from it",
        &[
            (Algorithm::SlidingLog, &[(5, 300)]),
            (Algorithm::Gcra, &[(5, 300)]),
        ],
        &[
            Op::Held {
                caller: 0,
                policy: 0,
                cost: 3,
                hold_ms: 150,
            },
            Op::check(0, 0, 1),
            Op::Held {
                caller: 0,
                policy: 1,
                cost: 5,
                hold_ms: 150,
            },
            Op::Held {
                caller: 0,
                policy: 1,
                cost: 2,
                hold_ms: 150,
            },
            Op::Sleep { ms: 350 },
            Op::check(0, 0, 3),
            Op::check(0, 1, 3),
            Op::Settle { back: 4, actual: 1 },
            Op::check(0, 0, 1),
        ],
    ),
];

/// Cases of limits that [count calls](Limit::counting_calls) beside limits that count the cost:
/// each as [`CORPUS`]'s, with the (policy, limit) indexes of the limits that count calls.
#[allow(clippy::type_complexity)]
pub const CALLS_CORPUS: &[(&str, &[PolicySpec], &[(usize, usize)], &[Op])] = &[(
    "a limit that counts calls is charged 1 per check and never settled",
    &[
        (Algorithm::SlidingLog, &[(3, 60_000), (20, 60_000)]),
        (Algorithm::SlidingCounter, &[(3, 60_000), (20, 60_000)]),
        (Algorithm::Gcra, &[(3, 60_000), (20, 60_000)]),
    ],
    &[(0, 0), (1, 0), (2, 0)],
    &[
        Op::reserve(0, 0, 11),
        Op::reserve(0, 1, 11),
        Op::reserve(0, 2, 11),
        Op::Settle { back: 2, actual: 2 },
        Op::Settle { back: 1, actual: 2 },
        Op::Settle { back: 0, actual: 2 },
        Op::check(0, 0, 0),
        Op::check(0, 0, 19),
        Op::check(0, 1, 19),
        Op::check(0, 2, 19),
        Op::check(0, 0, 5),
        Op::check(0, 1, 5),
        Op::check(0, 2, 5),
        Op::reserve(1, 0, 2),
        Op::reserve(1, 1, 2),
        Op::reserve(1, 2, 2),
        Op::Settle {
            back: 2,
            actual: 30,
        },
        Op::Settle {
            back: 1,
            actual: 30,
        },
        Op::Settle {
            back: 0,
            actual: 30,
        },
        Op::check(1, 0, 1),
        Op::check(1, 1, 1),
        Op::check(1, 2, 1),
    ],
)];

/// The cases of [`CORPUS`] and [`CALLS_CORPUS`].
pub fn corpus() -> Vec<(&'static str, Case)> {
    let plain = CORPUS.iter().map(|(name, policies, ops)| {
        let case = Case {
            policies: policies.to_vec(),
            counting_calls: Vec::new(),
            ops: ops.to_vec(),
        };
        (*name, case)
    });
    let calls = CALLS_CORPUS.iter().map(|(name, policies, calls, ops)| {
        let case = Case {
            policies: policies.to_vec(),
            counting_calls: calls.to_vec(),
            ops: ops.to_vec(),
        };
        (*name, case)
    });
    plain.chain(calls).collect()
}

/// What a run keeps of the attempts it sent.
struct Sent {
    check: RateCheck,
    policy: usize,
    at: Instant,
}

/// Runs `case` against `store`, one operation after another, holding every answer against the
/// model; the first mismatch.
pub async fn run(store: &impl RateStore, case: &Case) -> Result<(), Mismatch> {
    let policies = policies_of(case).map_err(|e| Mismatch {
        at: 0,
        what: format!("the case's policies: {e}"),
    })?;
    let timeout = store.timeout();
    let mut run = Run {
        policies,
        callers: [Key::new("caller", b"a"), Key::new("caller", b"b")],
        timeout,
        fresh: timeout.mul_f64(1.5),
        model: Model::new(timeout * 3),
        checks: Vec::new(),
        settlements: Vec::new(),
    };
    for (at, op) in case.ops.iter().enumerate() {
        let mismatch = |what: String| Mismatch { at, what };
        let Some((check, policy)) = run.step(store, *op).await.map_err(mismatch)? else {
            continue;
        };
        let policy = &run.policies[policy];
        let got = store
            .check_rate(policy, check)
            .await
            .map_err(|e| mismatch(format!("the store failed: {e}")))?;
        let Some(now) = got.decided_at_us else {
            return Err(mismatch("the store's answer has no decided_at_us".into()));
        };
        let want = run.model.decide(policy, check, now);
        if !agree(&got, &want) {
            return Err(mismatch(format!(
                "{op:?} ({:?}) at store time {now}: the store answered {got:?}, the model {want:?}",
                policy.algorithm()
            )));
        }
    }
    Ok(())
}

/// The case's policies under a namespace of their own; a limit's name is its policy's, so two
/// policies never share a key.
fn policies_of(case: &Case) -> Result<Vec<Arc<RatePolicy>>, crate::error::ConfigError> {
    let namespace = format!("p{}:rl", uuid::Uuid::new_v4().simple());
    case.policies
        .iter()
        .enumerate()
        .map(|(i, (algorithm, limits))| {
            let limits = limits
                .iter()
                .enumerate()
                .map(|(j, &(quota, ms))| {
                    let limit = Limit::new(format!("p{i}l{j}"), quota, Duration::from_millis(ms));
                    if case.counting_calls.contains(&(i, j)) {
                        limit.counting_calls()
                    } else {
                        limit
                    }
                })
                .collect();
            RatePolicy::new(namespace.as_str(), *algorithm, limits).map(Arc::new)
        })
        .collect()
}

/// A run in progress: its policies and callers, the model, and the attempts sent so far.
struct Run {
    policies: Vec<Arc<RatePolicy>>,
    callers: [Key; 2],
    timeout: Duration,
    /// How recent an attempt must be to be sent again.
    fresh: Duration,
    model: Model,
    checks: Vec<Sent>,
    settlements: Vec<Sent>,
}

impl Run {
    /// Carries out `op`: a wait or a reset, done here; or the check (and its policy) to send.
    async fn step(
        &mut self,
        store: &impl RateStore,
        op: Op,
    ) -> Result<Option<(RateCheck, usize)>, String> {
        let sent = match op {
            Op::Sleep { ms } => {
                tokio::time::sleep(Duration::from_millis(u64::from(ms))).await;
                None
            }
            Op::PastTimeout => {
                tokio::time::sleep(self.timeout.mul_f64(1.2)).await;
                None
            }
            Op::Reset { caller, policy } => {
                let policy = &self.policies[usize::from(policy) % self.policies.len()];
                let key = self.callers[usize::from(caller) % 2];
                store
                    .reset_rate(policy, key)
                    .await
                    .map_err(|e| format!("reset failed: {e}"))?;
                self.model.reset(policy, key);
                None
            }
            Op::Check {
                caller,
                policy,
                cost,
                reserve,
            } => {
                let key = self.callers[usize::from(caller) % 2];
                let check = if reserve {
                    RateCheck::reservation(key, cost)
                } else {
                    RateCheck::new(key, cost)
                };
                let policy = usize::from(policy) % self.policies.len();
                Some(record(&mut self.checks, check, policy))
            }
            Op::Held {
                caller,
                policy,
                cost,
                hold_ms,
            } => {
                let key = self.callers[usize::from(caller) % 2];
                let hold = Duration::from_millis(u64::from(hold_ms));
                let check = RateCheck::reservation(key, cost).held(hold);
                let policy = usize::from(policy) % self.policies.len();
                Some(record(&mut self.checks, check, policy))
            }
            Op::Resend { back } => latest(&self.checks, back, self.fresh),
            Op::Settle { back, actual } => {
                let i = self.checks.len().checked_sub(1 + usize::from(back));
                i.and_then(|i| {
                    let (check, policy) =
                        (self.checks[i].check.settle(actual), self.checks[i].policy);
                    // a check settled again makes the same attempt: a re-send of the first
                    // settlement, skipped as a Resend is once that went out too long ago (a
                    // store may remember it longer than the model, never shorter)
                    let stale = self.settlements.iter().any(|s| {
                        s.check.attempt() == check.attempt() && s.at.elapsed() >= self.fresh
                    });
                    (!stale).then(|| record(&mut self.settlements, check, policy))
                })
            }
            Op::ResendSettlement { back } => latest(&self.settlements, back, self.fresh),
        };
        Ok(sent)
    }
}

/// Keeps `check` of policy `policy` among `sent`, sent now; what to send.
fn record(sent: &mut Vec<Sent>, check: RateCheck, policy: usize) -> (RateCheck, usize) {
    sent.push(Sent {
        check,
        policy,
        at: Instant::now(),
    });
    (check, policy)
}

/// The `back`-th latest of `sent`, if it went out within `fresh`.
fn latest(sent: &[Sent], back: u8, fresh: Duration) -> Option<(RateCheck, usize)> {
    let i = sent.len().checked_sub(1 + usize::from(back))?;
    (sent[i].at.elapsed() < fresh).then_some((sent[i].check, sent[i].policy))
}

/// Whether two answers agree: exactly, but for waits and resets within a microsecond (the
/// stores round a double's microseconds up).
fn agree(got: &RateOutcome, want: &RateOutcome) -> bool {
    let near = |a: Duration, b: Duration| a.abs_diff(b) <= Duration::from_micros(1);
    got.admitted == want.admitted
        && near(got.retry_after, want.retry_after)
        && got.limits.len() == want.limits.len()
        && got
            .limits
            .iter()
            .zip(&want.limits)
            .all(|(g, w)| g.remaining == w.remaining && near(g.reset, w.reset))
}

/// A small deterministic generator (SplitMix64): a case is made again from its seed.
#[derive(Debug, Clone)]
struct Random(u64);

impl Random {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }

    fn pick<T: Copy>(&mut self, from: &[T]) -> T {
        from[self.below(from.len() as u64) as usize]
    }
}

/// Limits a generated policy may have (quota, window in ms).
const LIMITS: &[&[(u64, u64)]] = &[
    &[(4, 300)],
    &[(10, 500)],
    &[(6, 800)],
    &[(5, 400), (12, 60_000)],
    &[(3, 200), (8, 1_000)],
];

/// The case of `seed`: up to `len` operations, waits scaled to `timeout`.
pub fn generate(seed: u64, len: usize, timeout: Duration) -> Case {
    let mut r = Random(seed);
    let algorithms = [
        Algorithm::SlidingLog,
        Algorithm::SlidingCounter,
        Algorithm::Gcra,
    ];
    let policies: Vec<PolicySpec> = (0..1 + r.below(2))
        .map(|_| (r.pick(&algorithms), r.pick(LIMITS)))
        .collect();
    // a third of the policies have a limit that counts calls: the first, beside one that
    // counts the cost when there are two
    let counting_calls = (0..policies.len())
        .filter(|_| r.below(3) == 0)
        .map(|i| (i, 0))
        .collect();
    let t = u32::try_from(timeout.as_millis()).unwrap_or(1_000);
    let waits = [5, t / 2, 150, 350, 700];
    let ops = (0..len)
        .map(|_| match r.below(21) {
            0..=7 => Op::Check {
                caller: r.below(2) as u8,
                policy: r.below(2) as u8,
                cost: r.pick(&[0, 1, 1, 1, 2, 3, 5, 11, 1 << 50]),
                reserve: r.below(2) == 0,
            },
            8..=10 => Op::Resend {
                back: r.below(4) as u8,
            },
            11..=13 => Op::Settle {
                back: r.below(3) as u8,
                actual: r.pick(&[0, 0, 1, 2, 4, 9, u64::MAX]),
            },
            14 | 15 => Op::ResendSettlement {
                back: r.below(3) as u8,
            },
            16 | 17 => Op::Reset {
                caller: r.below(2) as u8,
                policy: r.below(2) as u8,
            },
            18 => Op::PastTimeout,
            19 => Op::Held {
                caller: r.below(2) as u8,
                policy: r.below(2) as u8,
                cost: r.pick(&[1, 2, 3, 5, 11]),
                hold_ms: r.pick(&[50, 150, 300]),
            },
            _ => Op::Sleep { ms: r.pick(&waits) },
        })
        .collect();
    Case {
        policies,
        counting_calls,
        ops,
    }
}

/// Runs the cases of `seeds` against `store` at once (each in keys of its own); for the first
/// that fails, the shrunk case and its mismatch.
pub async fn search(
    store: &impl RateStore,
    seeds: std::ops::Range<u64>,
    len: usize,
) -> Option<(u64, Case, Mismatch)> {
    let timeout = store.timeout();
    let cases: Vec<(u64, Case)> = seeds.map(|s| (s, generate(s, len, timeout))).collect();
    let runs = cases.iter().map(|(_, case)| run(store, case));
    let results = futures_util::future::join_all(runs).await;
    let (seed, case, mismatch) = cases
        .into_iter()
        .zip(results)
        .find_map(|((seed, case), result)| result.err().map(|m| (seed, case, m)))?;
    let (case, mismatch) = shrink(store, case, mismatch).await;
    Some((seed, case, mismatch))
}

/// `case` with operations removed, one at a time from the end, as long as it still fails.
pub async fn shrink(
    store: &impl RateStore,
    mut case: Case,
    mut mismatch: Mismatch,
) -> (Case, Mismatch) {
    case.ops.truncate(mismatch.at + 1);
    let mut i = case.ops.len();
    while i > 0 {
        i -= 1;
        let mut smaller = case.clone();
        smaller.ops.remove(i);
        if let Err(m) = run(store, &smaller).await {
            smaller.ops.truncate(m.at + 1);
            i = i.min(smaller.ops.len());
            (case, mismatch) = (smaller, m);
        }
    }
    (case, mismatch)
}
