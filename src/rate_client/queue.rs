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
//! Across copies the store decides, as for every request: each copy's first waiter asks when
//! room comes, and what the limits admit is exactly what they admit without waiting. A copy's
//! first waiter asks at the moment the store named, so no copy is kept behind another by more
//! than the difference of their round trips.
//!
//! A request waits at most its patience, counted from its arrival, plus the round trip of its
//! last check: a waiter whose room comes later than that is refused at once, with the store's
//! `Retry-After`. A line holds at most [`max_waiting`](crate::rate_limit::RateLimitLayerBuilder::max_waiting) requests; one more is
//! decided as without a queue. A request that goes away (the client left) leaves its line as
//! its future is dropped.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use tokio::time::Instant;

use super::client::{Decided, RateClient};
use super::source::DecisionSource;
use super::tiers::Tier;
use super::verdict::Verdict;
use crate::key::Key;
use crate::rate::RateCheck;

/// How many requests of one caller may wait on one copy, unless told otherwise.
pub(crate) const DEFAULT_MAX_WAITING: usize = 1_024;

/// The shortest pause between two checks of one waiter: a store that says room comes now, yet
/// denies, is not asked in a busy loop.
const LEAST_PAUSE: Duration = Duration::from_millis(1);

/// The lines of the callers that wait on this copy.
#[derive(Debug)]
pub(crate) struct Queue {
    /// How long a request may wait, from its arrival.
    pub(crate) patience: Duration,
    /// How many requests may wait in one caller's line.
    pub(crate) max_waiting: usize,
    lines: Mutex<HashMap<Key, Line>>,
}

/// A caller's line: whose turn it is to ask the store, and how many wait.
#[derive(Debug)]
struct Line {
    /// Held by the first of the line; handed on in arrival order (Tokio's mutex is fair).
    turn: Arc<tokio::sync::Mutex<()>>,
    waiting: usize,
}

/// A request's place in its caller's line: leaves it when dropped (admitted, refused or gone).
struct Place<'a> {
    queue: &'a Queue,
    key: Key,
    turn: Arc<tokio::sync::Mutex<()>>,
}

impl Queue {
    pub(crate) fn new(patience: Duration, max_waiting: usize) -> Self {
        Self {
            patience,
            max_waiting,
            lines: Mutex::default(),
        }
    }

    fn lines(&self) -> std::sync::MutexGuard<'_, HashMap<Key, Line>> {
        self.lines.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Whether requests of caller `key` wait on this copy.
    fn has_line(&self, key: Key) -> bool {
        self.lines().contains_key(&key)
    }

    /// A place at the end of `key`'s line; `None` when the line is full.
    fn join(&self, key: Key) -> Option<Place<'_>> {
        let mut lines = self.lines();
        let line = lines.entry(key).or_insert_with(|| Line {
            turn: Arc::default(),
            waiting: 0,
        });
        if line.waiting >= self.max_waiting {
            return None;
        }
        line.waiting += 1;
        Some(Place {
            queue: self,
            key,
            turn: Arc::clone(&line.turn),
        })
    }

    /// Whether a request denied by `verdict` waits for room: denied by the limits (not by the
    /// failure policy), with room coming before `deadline`.
    fn waits_on(verdict: &Verdict, deadline: Instant) -> bool {
        !verdict.admitted
            && matches!(
                verdict.source,
                DecisionSource::Store | DecisionSource::DenyCache
            )
            && Instant::now() + verdict.retry_after <= deadline
    }
}

impl Drop for Place<'_> {
    fn drop(&mut self) {
        let mut lines = self.queue.lines();
        if let Some(line) = lines.get_mut(&self.key) {
            line.waiting -= 1;
            if line.waiting == 0 {
                lines.remove(&self.key);
            }
        }
    }
}

impl RateClient {
    /// Decides `check` under `tier` for a layer with a queue: at once when the caller has room
    /// and nobody of its waits on this copy; otherwise in the caller's line, for up to the
    /// queue's patience.
    pub(super) fn decide_queued(
        self: &Arc<Self>,
        queue: &Queue,
        tier: &Arc<Tier>,
        check: RateCheck,
    ) -> Decided {
        let deadline = Instant::now() + queue.patience;
        let client = Arc::clone(self);
        let tier = Arc::clone(tier);
        if queue.has_line(check.key()) {
            return Decided::queued(async move { client.wait(tier, check, None, deadline).await });
        }
        match self.decide_now(&tier, check) {
            Decided::Now(verdict) if !Queue::waits_on(&verdict, deadline) => Decided::Now(verdict),
            Decided::Now(denied) => {
                Decided::queued(
                    async move { client.wait(tier, check, Some(denied), deadline).await },
                )
            }
            Decided::Pending(pending) => Decided::queued(async move {
                let verdict = pending.await;
                if Queue::waits_on(&verdict, deadline) {
                    client.wait(tier, check, Some(verdict), deadline).await
                } else {
                    verdict
                }
            }),
        }
    }

    /// Waits in `check`'s caller's line until it is admitted, or refused: its room comes after
    /// `deadline`, or the line is full. `denied` is its denial, when it asked before joining.
    async fn wait(
        self: Arc<Self>,
        tier: Arc<Tier>,
        check: RateCheck,
        mut denied: Option<Verdict>,
        deadline: Instant,
    ) -> Verdict {
        let Some(queue) = self.queue.as_ref() else {
            return self.decide_now(&tier, check).resolve().await;
        };
        let arrived = deadline - queue.patience;
        let Some(place) = queue.join(check.key()) else {
            // a full line: decided as without a queue
            return match denied {
                Some(denied) => denied,
                None => self.decide_now(&tier, check).resolve().await,
            };
        };
        let turn = match place.turn.try_lock() {
            Ok(turn) => Some(turn),
            Err(_) => {
                // others wait before it: its denial is stale by the time its turn comes
                denied = None;
                tokio::time::timeout_at(deadline, place.turn.lock())
                    .await
                    .ok()
            }
        };
        let mut attempt = check;
        let verdict = loop {
            let verdict = match denied.take() {
                Some(denied) => denied,
                None => {
                    attempt = attempt.again();
                    self.decide_now(&tier, attempt).resolve().await
                }
            };
            // past its patience without its turn: the check it just made decides
            if turn.is_none() || !Queue::waits_on(&verdict, deadline) {
                break verdict;
            }
            tokio::time::sleep(verdict.retry_after.max(LEAST_PAUSE)).await;
        };
        drop(turn);
        drop(place);
        let waited = arrived.elapsed();
        crate::metrics::rate_wait(&tier.limiter, verdict.admitted, waited);
        Verdict { waited, ..verdict }
    }
}
