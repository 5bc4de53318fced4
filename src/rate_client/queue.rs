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
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex, OnceLock, PoisonError};
use std::time::Duration;

use tokio::time::Instant;

use super::source::DecisionSource;
use super::verdict::Verdict;
use crate::key::Key;

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
    lines: Mutex<HashMap<Key, Line>>,
    /// Set once, by an outbound limit.
    gate: OnceLock<Gate>,
}

debug_fields!(Queue {
    patience,
    max_waiting,
    lines
});

/// A caller's line: whose turn it is to ask the store, and how many wait.
#[derive(Debug)]
struct Line {
    /// Held by the first of the line; handed on in arrival order (Tokio's mutex is fair).
    turn: Arc<tokio::sync::Mutex<()>>,
    waiting: usize,
}

/// A request's place in its caller's line: leaves it when dropped (admitted, refused or gone).
pub(super) struct Place<'a> {
    queue: &'a Queue,
    key: Key,
    /// The line's turn: whoever holds it asks the store.
    pub(super) turn: Arc<tokio::sync::Mutex<()>>,
}

impl Queue {
    pub(crate) fn new(patience: Duration, max_waiting: usize) -> Self {
        Self {
            patience,
            max_waiting,
            lines: Mutex::default(),
            gate: OnceLock::new(),
        }
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

    fn lines(&self) -> std::sync::MutexGuard<'_, HashMap<Key, Line>> {
        self.lines.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Whether requests of caller `key` wait on this copy.
    pub(super) fn has_line(&self, key: Key) -> bool {
        self.lines().contains_key(&key)
    }

    /// A place at the end of `key`'s line; `None` when the line is full.
    pub(super) fn join(&self, key: Key) -> Option<Place<'_>> {
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
    pub(super) fn waits_on(verdict: &Verdict, deadline: Instant) -> bool {
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
