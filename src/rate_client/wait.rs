//! How a request waits in its caller's line (see [`queue`](super::queue)): the rate client's
//! decision for a layer with a queue.

use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;
use tracing::Instrument;

use super::client::{Decided, RateClient};
use super::queue::{Place, Queue};
use super::source::DecisionSource;
use super::tiers::Tier;
use super::verdict::Verdict;
use crate::key::Key;
use crate::rate::RateCheck;

/// The shortest pause between two checks of one waiter: a store that says room comes now, yet
/// denies, is not asked in a busy loop.
const LEAST_PAUSE: Duration = Duration::from_millis(1);

/// The first pause before a waiter asks a store that failed again, when the queue waits for
/// the store; doubled at each failure, up to 32 times this (1.6 s).
const STORE_RETRY: Duration = Duration::from_millis(50);

impl RateClient {
    /// Decides `check` under `tier` for a layer with a queue: at once when the caller has room
    /// and nobody of its waits on this copy; otherwise in the caller's line, for up to the
    /// queue's patience.
    pub(super) fn decide_queued(
        self: &Arc<Self>,
        queue: &Queue,
        tier: &Arc<Tier>,
        check: RateCheck,
        arrived: Option<Instant>,
    ) -> Decided {
        let arrived = arrived.unwrap_or_else(Instant::now);
        // the builder holds patience to a day: no overflow, but never a panic either
        let deadline = arrived.checked_add(queue.patience).unwrap_or(arrived);
        let client = Arc::clone(self);
        let tier = Arc::clone(tier);
        if queue.has_line(&tier, check.key()) {
            return Decided::queued(async move { client.wait(tier, check, None, deadline).await });
        }
        match self.decide_now(&tier, check) {
            Decided::Now(verdict) if !queue.waits_on(&verdict, deadline) => Decided::Now(verdict),
            Decided::Now(denied) => {
                Decided::queued(
                    async move { client.wait(tier, check, Some(denied), deadline).await },
                )
            }
            Decided::Pending(pending) => Decided::queued(async move {
                let verdict = pending.await;
                let waits = client.queue.as_ref();
                if waits.is_some_and(|queue| queue.waits_on(&verdict, deadline)) {
                    client.wait(tier, check, Some(verdict), deadline).await
                } else {
                    verdict
                }
            }),
        }
    }

    /// Waits in `check`'s caller's line until it is admitted, or refused: its room comes after
    /// `deadline`, or the line is full. `denied` is its denial, when it asked before joining.
    /// In a span `rate_limit.wait` (target `tollgate::rate_limit`) that records the outcome
    /// and the time waited.
    async fn wait(
        self: Arc<Self>,
        tier: Arc<Tier>,
        check: RateCheck,
        denied: Option<Verdict>,
        deadline: Instant,
    ) -> Verdict {
        let span = tracing::debug_span!(
            target: "tollgate::rate_limit",
            "rate_limit.wait",
            tollgate.limiter = &*tier.limiter,
            tollgate.key = %check.key(),
            tollgate.outcome = tracing::field::Empty,
            tollgate.waited_ms = tracing::field::Empty,
        );
        let verdict = self
            .wait_in_line(tier, check, denied, deadline)
            .instrument(span.clone())
            .await;
        span.record(
            "tollgate.outcome",
            if verdict.admitted {
                "admitted"
            } else {
                "denied"
            },
        );
        span.record(
            "tollgate.waited_ms",
            u64::try_from(verdict.waited.as_millis()).unwrap_or(u64::MAX),
        );
        verdict
    }

    async fn wait_in_line(
        self: Arc<Self>,
        tier: Arc<Tier>,
        check: RateCheck,
        mut denied: Option<Verdict>,
        deadline: Instant,
    ) -> Verdict {
        let Some(queue) = self.queue.as_ref() else {
            return self.decide_now(&tier, check).resolve().await;
        };
        let arrived = deadline.checked_sub(queue.patience).unwrap_or(deadline);
        let Some(place) = queue.join(&tier, check.key()) else {
            // a full line: decided as without a queue
            return match denied {
                Some(denied) => denied,
                None => self.decide_now(&tier, check).resolve().await,
            };
        };
        let line_turn = Arc::clone(&place.turn);
        let turn = match line_turn.try_lock() {
            Ok(turn) => Some(turn),
            Err(_) => {
                // others wait before it: its denial is stale by the time its turn comes
                denied = None;
                tokio::time::timeout_at(deadline, line_turn.lock())
                    .await
                    .ok()
            }
        };
        let mut attempt = check;
        let mut store_retries = 0u32;
        let mut standing = Standing::new(&place);
        let verdict = loop {
            if turn.is_none() {
                // its patience ended before its turn came: the first of its line has had no
                // room yet, so nor would it — refused without asking the store
                let room = place.room_at().map_or(Duration::ZERO, |at| {
                    at.saturating_duration_since(Instant::now())
                });
                let mut refused = held_back(&tier, attempt, room);
                if place.store_is_down() {
                    refused.source = DecisionSource::StoreUnavailable;
                }
                break refused;
            }
            if let Some(until) = queue.held_until(check.key()).await {
                // held back (a provider's pause): no check until it ends
                if until > deadline {
                    let retry_after = until.saturating_duration_since(Instant::now());
                    break held_back(&tier, attempt, retry_after);
                }
                tokio::time::sleep_until(until).await;
                denied = None;
                // a longer pause may have come meanwhile
                continue;
            }
            if standing.ahead > 0 {
                match standing.look(&self, &tier, check, &place).await {
                    // its denial is stale: others were admitted since
                    None => denied = None,
                    Some(_) if Instant::now() >= deadline => {
                        break held_back(&tier, attempt, standing.gap);
                    }
                    Some(pause) => {
                        let pause = pause.min(deadline.saturating_duration_since(Instant::now()));
                        place.expect_room(Instant::now() + pause);
                        tokio::time::sleep(pause).await;
                        continue;
                    }
                }
            }
            let verdict = match denied.take() {
                Some(denied) => denied,
                None => {
                    attempt = attempt.again();
                    self.decide_now(&tier, attempt).resolve().await
                }
            };
            let store_down = verdict.source == DecisionSource::StoreUnavailable;
            place.store_down(store_down);
            if !queue.waits_on(&verdict, deadline) {
                break verdict;
            }
            let pause = if store_down {
                // the store's next try: sooner at first, then spaced out; the last at the deadline
                let backoff = STORE_RETRY.saturating_mul(1 << store_retries.min(5));
                store_retries += 1;
                backoff.min(deadline.saturating_duration_since(Instant::now()))
            } else {
                store_retries = 0;
                standing
                    .denied(&self, &tier, check, &place, verdict.retry_after)
                    .await
            };
            place.expect_room(Instant::now() + pause);
            tokio::time::sleep(pause).await;
        };
        if verdict.admitted {
            place.admitted();
        }
        // its place goes before the turn: the next first finds the line as this one left it
        drop(place);
        drop(turn);
        let waited = arrived.elapsed();
        crate::metrics::rate_wait(&tier.limiter, verdict.admitted, waited);
        Verdict { waited, ..verdict }
    }
}

/// Where the first of a line stands in its caller's line in the store
/// ([Lines](crate::store#lines)): a first that went away left its place, and what it knew, to
/// the next.
struct Standing {
    waiter: u64,
    /// Waiters of other copies ahead at its last line-up (0: none, or not lined up).
    ahead: u32,
    /// The store's last word on when room comes.
    gap: Duration,
    /// How long it pauses before it looks again while others stand ahead.
    poll: Duration,
}

impl Standing {
    fn new(place: &Place<'_>) -> Self {
        let (waiter, ahead) = place.waiter();
        Self {
            waiter,
            ahead,
            gap: LEAST_PAUSE,
            poll: LEAST_PAUSE,
        }
    }

    /// Denied, with room in `room_in`: lines up (keeping its place) until its room comes; the
    /// pause until then.
    async fn denied(
        &mut self,
        client: &RateClient,
        tier: &Tier,
        check: RateCheck,
        place: &Place<'_>,
        room_in: Duration,
    ) -> Duration {
        self.gap = room_in.max(LEAST_PAUSE);
        self.poll = LEAST_PAUSE;
        let ahead = client
            .line_up(tier, check.key(), self.waiter, self.gap)
            .await;
        self.stood(client, tier, place, ahead);
        self.gap
    }

    /// It stood with `ahead` waiters ahead at its last line-up; its line stands in the store's.
    fn stood(&mut self, client: &RateClient, tier: &Tier, place: &Place<'_>, ahead: u32) {
        self.ahead = ahead;
        place.stands(&client.store, &tier.policy, ahead);
    }

    /// With others ahead: `None` when it may ask — nobody stands ahead any more, or the limits
    /// have room for every one ahead and for it (a burst of room is not served one copy at a
    /// time); else the pause before it looks again: short while the line moves, then longer,
    /// up to the store's last word on when room comes. The room is judged against those ahead
    /// at this line-up, not the last: a copy whose waiter was just admitted lines up at the
    /// end, and the room left is for those ahead of it first.
    async fn look(
        &mut self,
        client: &RateClient,
        tier: &Tier,
        check: RateCheck,
        place: &Place<'_>,
    ) -> Option<Duration> {
        let before = self.ahead;
        let (ahead, room) = tokio::join!(
            client.line_up(tier, check.key(), self.waiter, self.gap),
            client.room_for(tier, check),
        );
        self.stood(client, tier, place, ahead);
        if ahead == 0 || room > u64::from(ahead) {
            return None;
        }
        self.poll = if ahead < before {
            LEAST_PAUSE
        } else {
            self.poll.saturating_mul(2).min(self.gap)
        };
        Some(self.poll)
    }
}

impl RateClient {
    /// Lines `waiter` up in `key`'s line under `tier` in the store, its place kept for `room_in`
    /// (when the store said room comes) plus twice the store's timeout (its next line-up's
    /// round trip); how many stand ahead of it. A store that fails to answer keeps no order:
    /// none stands ahead, and the waiter asks for room as it would without a line.
    async fn line_up(&self, tier: &Tier, key: Key, waiter: u64, room_in: Duration) -> u32 {
        let timeout = self.store.timeout();
        let keep = room_in.saturating_add(timeout.saturating_mul(2));
        let deadline = Instant::now() + timeout;
        let lined = self
            .store
            .line_up(&tier.policy, key, waiter, keep, deadline)
            .await;
        lined.unwrap_or_else(|error| {
            tracing::debug!(
                target: "tollgate::rate_limit", %error, %key,
                "could not line up in the store; asking for room without a line"
            );
            0
        })
    }

    /// How many calls of `check`'s cost the limits of `tier` have room for now: a look at the
    /// caller's limits, which charges nothing. 0 when the store does not answer.
    async fn room_for(&self, tier: &Tier, check: RateCheck) -> u64 {
        let look = RateCheck::new(check.key(), 0);
        let Ok(outcome) = self.store.check_rate(&tier.policy, look).await else {
            return 0;
        };
        let limits = tier.policy.limits();
        if outcome.limits.len() != limits.len() {
            return 0;
        }
        limits
            .iter()
            .zip(&outcome.limits)
            .map(|(limit, state)| {
                state
                    .remaining
                    .checked_div(limit.charge_of(check.cost()))
                    .unwrap_or(u64::MAX)
            })
            .min()
            .unwrap_or(u64::MAX)
    }
}

/// The refusal of `check` under `tier`, held back for `retry_after` more, past its patience:
/// the store was not asked.
fn held_back(tier: &Arc<Tier>, check: RateCheck, retry_after: Duration) -> Verdict {
    Verdict {
        admitted: false,
        source: DecisionSource::Store,
        check,
        retry_after,
        tier: Arc::clone(tier),
        states: Vec::new(),
        waited: Duration::ZERO,
    }
}
