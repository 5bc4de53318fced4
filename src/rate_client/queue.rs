//! Waiting for room instead of a refusal
//! ([`queue`](crate::rate_limit::RateLimitLayerBuilder::queue)).
//!
//! A request the limits deny, whose room comes within its patience, waits on this copy in its
//! caller's line: one line per caller, served in arrival order. Only the first of a line asks
//! again, when the store said room comes, so a copy sends about one check per caller and moment
//! of room however many of its requests wait; the next in line asks as soon as the one before
//! it is admitted. A request that arrives while its caller's line is not empty joins it rather
//! than asking first: it cannot overtake those already waiting on its copy.
//!
//! Across copies the store decides, as for every request, and keeps the order in which they
//! ask ([Lines](crate::store#lines)): a copy's first waiter, once denied, stands in its caller's
//! line in the store ([`RateStore::line_up`]), and asks for room only when no waiter of another
//! copy stands ahead of it, or when a look at the limits shows room for all those ahead and for
//! it; until then it lines up again when the store said room comes, and soon after while the
//! line moves.
//! Admitted, it leaves the line, and the next waiter of its copy lines up at the end: copies
//! that all wait take turns, whatever their numbers of requests. What the limits admit is
//! exactly what they admit without waiting: a line orders the asking, never the answer.
//!
//! A request waits at most its patience, counted from its arrival, plus the round trip of its
//! last check: a waiter whose room comes later than that is refused at once, with the store's
//! `Retry-After`; one whose patience ends before its turn comes is refused then, without asking
//! the store (the first of its line had no room yet), with the time the first expects room. A
//! cost larger than a limit's quota never waits. A line holds at most
//! [`max_waiting`](crate::rate_limit::RateLimitLayerBuilder::max_waiting) requests; one more is
//! decided as without a queue. A request that goes away (the client left) leaves its line as
//! its future is dropped. Lines are a caller's under one tier.

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock, PoisonError};
use std::time::Duration;

use tokio::time::Instant;

use super::source::DecisionSource;
use super::tiers::Tier;
use super::verdict::Verdict;
use crate::key::Key;
use crate::rate::RatePolicy;
use crate::store::RateStore;

/// When a request arrived, when a layer before the rate limit already counts its patience (an
/// outbound limit, which may first have waited out a provider's pause): in its extensions.
#[derive(Debug, Clone, Copy)]
pub(crate) struct ArrivedAt(pub(crate) Instant);

/// The longest patience a queue takes: a day (a longer one is refused when the layer is built,
/// so that no deadline overflows the clock).
pub(crate) const LONGEST_PATIENCE: Duration = Duration::from_secs(24 * 60 * 60);

/// How many requests of one caller may wait on one copy, unless told otherwise.
pub(crate) const DEFAULT_MAX_WAITING: usize = 1_024;

/// Until when a caller's requests are held back whatever their limits say (a provider's pause
/// of an outbound limit), if they are: asked by the first of a line before each check.
pub(crate) type Gate =
    Arc<dyn Fn(Key) -> Pin<Box<dyn Future<Output = Option<Instant>> + Send>> + Send + Sync>;

/// The lines of the callers that wait on this copy.
pub(crate) struct Queue {
    /// How long a request may wait, from its arrival.
    pub(crate) patience: Duration,
    /// How many requests may wait in one caller's line.
    pub(crate) max_waiting: usize,
    lines: Mutex<HashMap<LineOf, Line>>,
    /// Set once, by an outbound limit.
    gate: OnceLock<Gate>,
    /// Whether a request waits out a store that fails (an outbound limit's choice), rather
    /// than taking the failure policy's answer.
    waits_for_store: AtomicBool,
}

debug_fields!(Queue {
    patience,
    max_waiting,
    lines
});

/// Whose line: a caller's under one tier (the tier's address; a tier rebuilt by a change of
/// limits starts a line of its own, and the old one drains).
type LineOf = (usize, Key);

/// A caller's line: whose turn it is to ask the store, and how many wait.
struct Line {
    /// Held by the first of the line; handed on in arrival order (Tokio's mutex is fair).
    turn: Arc<tokio::sync::Mutex<()>>,
    waiting: usize,
    /// When the first of the line expects room (the store's word at its last check).
    room_at: Option<Instant>,
    /// Whether the store failed the first of the line's last check.
    store_down: bool,
    /// Who the line's first waiter is in the store's line of the caller: the same for every
    /// first of this line until one is admitted (a first that goes away hands its place on).
    waiter: u64,
    /// How many stood ahead of it at its last line-up.
    ahead: u32,
    /// Where it stands, once lined up: the line it leaves.
    stands: Option<Stands>,
}

debug_fields!(Line {
    waiting,
    room_at,
    store_down,
    waiter,
    ahead
});

/// The store's line a copy's line stands in.
struct Stands {
    store: Arc<dyn RateStore>,
    policy: Arc<RatePolicy>,
}

/// A request's place in its caller's line: leaves it when dropped (admitted, refused or gone).
pub(super) struct Place<'a> {
    queue: &'a Queue,
    line: LineOf,
    /// The line's turn: whoever holds it asks the store.
    pub(super) turn: Arc<tokio::sync::Mutex<()>>,
    /// Whether it leaves admitted: its line's place in the store's line goes with it.
    admitted: AtomicBool,
}

impl Place<'_> {
    /// Who the line's first waiter is in the store's line, and how many stood ahead of it at
    /// its last line-up.
    pub(super) fn waiter(&self) -> (u64, u32) {
        self.queue
            .lines()
            .get(&self.line)
            .map_or((0, 0), |line| (line.waiter, line.ahead))
    }

    /// The line stands in `policy`'s line of the caller on `store`, with `ahead` waiters ahead.
    pub(super) fn stands(&self, store: &Arc<dyn RateStore>, policy: &Arc<RatePolicy>, ahead: u32) {
        if let Some(line) = self.queue.lines().get_mut(&self.line) {
            line.ahead = ahead;
            line.stands = Some(Stands {
                store: Arc::clone(store),
                policy: Arc::clone(policy),
            });
        }
    }

    /// It leaves admitted: the line's place in the store's line goes with it.
    pub(super) fn admitted(&self) {
        self.admitted.store(true, Ordering::Relaxed);
    }

    /// The first of the line expects room at `at`.
    pub(super) fn expect_room(&self, at: Instant) {
        if let Some(line) = self.queue.lines().get_mut(&self.line) {
            line.room_at = Some(at);
        }
    }

    /// The store failed (`true`) or answered the first of the line's last check.
    pub(super) fn store_down(&self, down: bool) {
        if let Some(line) = self.queue.lines().get_mut(&self.line) {
            line.store_down = down;
        }
    }

    /// Whether the store failed the first of the line's last check.
    pub(super) fn store_is_down(&self) -> bool {
        self.queue
            .lines()
            .get(&self.line)
            .is_some_and(|line| line.store_down)
    }

    /// When the first of the line expects room, if it said.
    pub(super) fn room_at(&self) -> Option<Instant> {
        self.queue
            .lines()
            .get(&self.line)
            .and_then(|line| line.room_at)
    }
}

/// The line of `key` under `tier`.
fn line_of(tier: &Arc<Tier>, key: Key) -> LineOf {
    (Arc::as_ptr(tier) as usize, key)
}

impl Queue {
    pub(crate) fn new(patience: Duration, max_waiting: usize) -> Self {
        Self {
            patience,
            max_waiting,
            lines: Mutex::default(),
            gate: OnceLock::new(),
            waits_for_store: AtomicBool::new(false),
        }
    }

    /// Lets requests wait out a store that fails, until their patience ends, instead of
    /// taking the failure policy's answer.
    pub(crate) fn wait_for_store(&self) {
        self.waits_for_store.store(true, Ordering::Relaxed);
    }

    /// Whether requests wait out a store that fails.
    pub(crate) fn waits_for_store(&self) -> bool {
        self.waits_for_store.load(Ordering::Relaxed)
    }

    /// Holds each line back while `gate` says so (set once; later calls change nothing).
    pub(crate) fn gate(&self, gate: Gate) {
        let _ = self.gate.set(gate);
    }

    /// Until when `key`'s requests are held back, if they are.
    pub(super) async fn held_until(&self, key: Key) -> Option<Instant> {
        let gate = self.gate.get()?;
        gate(key).await
    }

    fn lines(&self) -> std::sync::MutexGuard<'_, HashMap<LineOf, Line>> {
        self.lines.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Whether requests of caller `key` under `tier` wait on this copy.
    pub(super) fn has_line(&self, tier: &Arc<Tier>, key: Key) -> bool {
        self.lines().contains_key(&line_of(tier, key))
    }

    /// A place at the end of `key`'s line under `tier`; `None` when the line is full.
    pub(super) fn join(&self, tier: &Arc<Tier>, key: Key) -> Option<Place<'_>> {
        let of = line_of(tier, key);
        let mut lines = self.lines();
        let line = lines.entry(of).or_insert_with(|| Line {
            turn: Arc::default(),
            waiting: 0,
            room_at: None,
            store_down: false,
            waiter: new_waiter(),
            ahead: 0,
            stands: None,
        });
        if line.waiting >= self.max_waiting {
            return None;
        }
        line.waiting += 1;
        Some(Place {
            queue: self,
            line: of,
            turn: Arc::clone(&line.turn),
            admitted: AtomicBool::new(false),
        })
    }

    /// Whether a request denied by `verdict` waits: for room, when the limits denied it (not
    /// the failure policy) for a cost every limit can hold (a limit that counts calls holds one
    /// call of any cost), with room coming before `deadline`; or for the store, when it failed,
    /// the queue waits for it, and `deadline` is not reached.
    pub(super) fn waits_on(&self, verdict: &Verdict, deadline: Instant) -> bool {
        if verdict.admitted {
            return false;
        }
        if verdict.source == DecisionSource::StoreUnavailable {
            return self.waits_for_store() && Instant::now() < deadline;
        }
        let fits = verdict
            .tier
            .policy
            .limits()
            .iter()
            .all(|limit| limit.charge_of(verdict.check.cost()) <= limit.quota());
        fits && matches!(
            verdict.source,
            DecisionSource::Store | DecisionSource::DenyCache
        ) && Instant::now()
            .checked_add(verdict.retry_after)
            .is_some_and(|room| room <= deadline)
    }
}

/// A waiter id for the store's line.
fn new_waiter() -> u64 {
    uuid::Uuid::new_v4().as_u64_pair().0
}

impl Drop for Place<'_> {
    /// Leaves the line; its line leaves the store's line when it was admitted (the next of its
    /// copy lines up anew, at the end) or nobody of its copy waits any more. A first that goes
    /// otherwise (refused, cancelled) hands its place on to the next of its copy.
    fn drop(&mut self) {
        let mut lines = self.queue.lines();
        let Some(line) = lines.get_mut(&self.line) else {
            return;
        };
        line.waiting -= 1;
        let admitted = self.admitted.load(Ordering::Relaxed);
        let leaves = admitted || line.waiting == 0;
        let stood = if leaves { line.stands.take() } else { None };
        let waiter = line.waiter;
        if admitted {
            line.waiter = new_waiter();
            // a line that stood in the store's line: the next of its copy lines up at the end
            // before it asks, behind the other copies' waiters
            line.ahead = u32::from(stood.is_some());
        }
        if line.waiting == 0 {
            lines.remove(&self.line);
        }
        drop(lines);
        if let Some(Stands { store, policy }) = stood
            && let Ok(runtime) = tokio::runtime::Handle::try_current()
        {
            let leave = store.leave_line(&policy, self.line.1, waiter);
            runtime.spawn(async move {
                if let Err(error) = leave.await {
                    tracing::debug!(
                        target: "tollgate::rate_limit", %error,
                        "could not leave the store's line; the place lapses on its own"
                    );
                }
            });
        }
    }
}
