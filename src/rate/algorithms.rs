//! The three algorithms in process, as plain functions over a caller's state: the same decisions
//! as the Redis rate script (`src/store/scripts/rate.lua`), for `MemoryStore` and the local
//! fallback.
//!
//! Time is store time in microseconds. Each function gets one [`Slot`] per limit of the policy —
//! the live state and its expiry, or an empty slot — and leaves in it what the store would keep.

use std::collections::VecDeque;

use super::{LimitState, RateCheck, RateOutcome, RatePolicy, Settlement};

/// One caller's state for one limit, with the attempts that charged it lately.
#[derive(Debug)]
pub(crate) enum State {
    /// A sliding log: per unit of admitted cost its score and attempt, ascending by score; and
    /// the settlements applied to it lately.
    Log {
        entries: VecDeque<(u64, u64)>,
        recent: Recent,
    },
    /// A sliding counter: window index, current and previous window's cost.
    Counter {
        index: u64,
        cur: u64,
        prev: u64,
        recent: Recent,
    },
    /// A GCRA theoretical arrival time: whole microseconds plus `rem` / quota of one.
    Tat { tat: u64, rem: u64, recent: Recent },
}

impl State {
    /// Whether `attempt` charged this state: a second run of it is admitted without a charge.
    fn charged_by(&self, attempt: u64) -> bool {
        match self {
            Self::Log { entries, recent } => {
                recent.contains(attempt) || entries.iter().any(|&(_, a)| a == attempt)
            }
            Self::Counter { recent, .. } | Self::Tat { recent, .. } => recent.contains(attempt),
        }
    }

    /// The recent attempts of a state: of a counter or GCRA, those that charged it; of a log,
    /// its settlements.
    fn take_recent(&mut self) -> Recent {
        match self {
            Self::Log { recent, .. } | Self::Counter { recent, .. } | Self::Tat { recent, .. } => {
                std::mem::take(recent)
            }
        }
    }
}

/// How many recent attempts a counter or GCRA state keeps, as the PostgreSQL functions do (on
/// Redis, each call keeps a record of the checks it charged instead: see `rate.lua`).
const RECENT: usize = 8;

/// How long an attempt is remembered: the deadline of a check on the memory store, after
/// which a re-sent one would be refused by the Redis store. (The memory store's own calls are
/// never re-sent; an application's retry is.)
const REMEMBERED_US: u64 = 1_000_000;

/// The attempts that charged a counter or GCRA state lately (kept on its first limit), oldest
/// first, each with the store time in microseconds after which a re-send of it no longer
/// counts: a re-sent attempt is recognised among them whatever charged the caller in between.
#[derive(Debug, Default)]
pub(crate) struct Recent(Vec<(u64, u64)>);

impl Recent {
    fn contains(&self, attempt: u64) -> bool {
        self.0.iter().any(|&(id, _)| id == attempt)
    }

    /// The attempts still remembered at `now` (at most `RECENT - 1`), then `attempt`.
    fn remember(mut self, attempt: u64, now: u64) -> Self {
        let gone = self
            .0
            .iter()
            .take_while(|&&(_, until)| until <= now)
            .count();
        let over = (self.0.len() - gone).saturating_sub(RECENT - 1);
        self.0.drain(..gone + over);
        self.0.push((attempt, now.saturating_add(REMEMBERED_US)));
        self
    }
}

/// A limit's state as kept between decisions: `None` when there is none (or it expired).
#[derive(Debug, Default)]
pub(crate) struct Slot {
    pub(crate) state: Option<State>,
    /// Store time in microseconds after which the state is gone.
    pub(crate) expires_at: u64,
}

/// Decides `check` against every limit of `policy` at store time `now`, all or nothing; `slots`
/// holds one slot per limit, in order. An attempt that already charged the first limit is
/// admitted again without a charge, as the scripts do.
pub(crate) fn check(
    policy: &RatePolicy,
    slots: &mut [Slot],
    now: u64,
    check: RateCheck,
) -> RateOutcome {
    let attempt = Attempt {
        cost: check.cost(),
        id: check.attempt(),
        settles: check.settles(),
        replay: slots
            .first()
            .and_then(|slot| slot.state.as_ref())
            .is_some_and(|state| state.charged_by(check.attempt())),
    };
    let outcome = match policy.algorithm() {
        super::Algorithm::SlidingLog => sliding_log(policy, slots, now, attempt),
        super::Algorithm::SlidingCounter => sliding_counter(policy, slots, now, attempt),
        super::Algorithm::Gcra => gcra(policy, slots, now, attempt),
    };
    RateOutcome {
        decided_at_us: Some(now),
        ..outcome
    }
}

/// The attempt being decided.
#[derive(Debug, Clone, Copy)]
struct Attempt {
    /// Of a settlement: the actual cost.
    cost: u64,
    id: u64,
    /// A settlement: always admitted, it corrects what the settled attempt charged.
    settles: Option<Settlement>,
    /// A second run: admitted, nothing charged.
    replay: bool,
}

fn ceil_us(x: f64) -> u64 {
    if x > 0.0 { x.ceil() as u64 } else { 0 }
}

fn outcome(admitted: bool, retry_us: u64, limits: Vec<LimitState>) -> RateOutcome {
    RateOutcome {
        admitted,
        retry_after: std::time::Duration::from_micros(retry_us),
        limits,
        decided_at_us: None,
    }
}

fn state(remaining: u64, reset_us: u64) -> LimitState {
    LimitState {
        remaining,
        reset: std::time::Duration::from_micros(reset_us),
    }
}

/// Mirrors `sliding_log` of `scripts/rate.lua`.
fn sliding_log(policy: &RatePolicy, slots: &mut [Slot], now: u64, attempt: Attempt) -> RateOutcome {
    let cost = attempt.cost;
    let mut logs: Vec<VecDeque<(u64, u64)>> = Vec::with_capacity(slots.len());
    let mut admitted = true;
    let mut retry = 0u64;
    for (slot, limit) in slots.iter_mut().zip(policy.limits()) {
        let window = limit.window_us();
        let mut log = match &mut slot.state {
            Some(State::Log { entries, .. }) => std::mem::take(entries),
            _ => VecDeque::new(),
        };
        let horizon = now.saturating_sub(window);
        while log.front().is_some_and(|&(s, _)| s <= horizon) {
            log.pop_front();
        }
        let count = log.len() as u64;
        let decides = !attempt.replay && attempt.settles.is_none();
        if decides && count.saturating_add(cost) > limit.quota() {
            admitted = false;
            let wait = if cost <= limit.quota() {
                let idx = (count + cost - limit.quota() - 1) as usize;
                log[idx].0 + window - now
            } else {
                window
            };
            retry = retry.max(wait);
        }
        logs.push(log);
    }
    let mut limits = Vec::with_capacity(slots.len());
    let kept = slots.iter_mut().zip(policy.limits()).zip(logs).enumerate();
    for (i, ((slot, limit), mut log)) in kept {
        let window = limit.window_us();
        let mut recent = take_recent(slot);
        if let Some(settled) = attempt.settles.filter(|_| !attempt.replay) {
            let cap = limit.quota().saturating_mul(2);
            if settle_log(&mut log, settled, attempt, cap, now) {
                slot.expires_at = now + window.div_ceil(1000) * 1000;
            }
            if i == 0 {
                recent = recent.remember(attempt.id, now);
            }
        } else if admitted && !attempt.replay && cost > 0 {
            // a cost of 0 only looks: nothing is written
            charge_log(&mut log, cost, attempt.id, now);
            slot.expires_at = now + window.div_ceil(1000) * 1000;
        }
        let reset = log.front().map_or(0, |&(oldest, _)| oldest + window - now);
        limits.push(state(limit.quota().saturating_sub(log.len() as u64), reset));
        // an empty log is deleted; a denied request keeps the trimmed log and its expiry
        slot.state = (!log.is_empty()).then_some(State::Log {
            entries: log,
            recent,
        });
    }
    outcome(admitted, retry, limits)
}

/// Adds `cost` units of attempt `id` at `now` (admitted: within the quota, so `cost` is small).
fn charge_log(log: &mut VecDeque<(u64, u64)>, cost: u64, id: u64, now: u64) {
    let units = usize::try_from(cost).unwrap_or(0);
    log.extend(std::iter::repeat_n((now, id), units));
}

/// Mirrors `settle_log` of `scripts/rate.lua`: the units of the settled attempt go from its
/// reserved count to the actual one — added with score `now` (at most `cap` units in the log, and
/// named after the settlement) or removed, those the log still holds. Whether units were added.
fn settle_log(
    log: &mut VecDeque<(u64, u64)>,
    settled: Settlement,
    attempt: Attempt,
    cap: u64,
    now: u64,
) -> bool {
    let (reserved, actual) = (settled.reserved, attempt.cost);
    if actual > reserved {
        let room = cap.saturating_sub(log.len() as u64);
        let added = (actual - reserved).min(room);
        let added = usize::try_from(added).unwrap_or(0);
        log.extend(std::iter::repeat_n((now, attempt.id), added));
        return added > 0;
    }
    let mut refund = reserved - actual;
    // all of the settled attempt's units share one score: the newest such ones go
    let mut i = log.len();
    while refund > 0 && i > 0 {
        i -= 1;
        if log[i].1 == settled.of {
            log.remove(i);
            refund -= 1;
        }
    }
    false
}

/// Mirrors `sliding_counter` of `scripts/rate.lua` (milliseconds of store time).
fn sliding_counter(
    policy: &RatePolicy,
    slots: &mut [Slot],
    now_us: u64,
    attempt: Attempt,
) -> RateOutcome {
    let cost = attempt.cost;
    let now = (now_us / 1000) as f64;
    let costf = cost as f64;
    let mut states = Vec::with_capacity(slots.len());
    let mut admitted = true;
    let mut retry = 0f64;
    for (slot, limit) in slots.iter().zip(policy.limits()) {
        let quota = limit.quota() as f64;
        let window = limit.window_us() as f64 / 1000.0;
        let index = (now / window).floor();
        let elapsed = now - index * window;
        let (cur, prev) = counts(slot, index);
        let decides = !attempt.replay && attempt.settles.is_none();
        if decides && (cur + costf) * window + prev * (window - elapsed) > quota * window {
            admitted = false;
            retry = retry.max(counter_wait(quota, window, elapsed, costf, cur, prev));
        }
        states.push((quota, window, index, elapsed, cur, prev));
    }
    let mut limits = Vec::with_capacity(slots.len());
    for (i, (slot, (quota, window, index, elapsed, mut cur, mut prev))) in
        slots.iter_mut().zip(states).enumerate()
    {
        let mut write = admitted && !attempt.replay && cost > 0 && attempt.settles.is_none();
        if write {
            cur += costf;
        }
        if let Some(settled) = attempt.settles.filter(|_| !attempt.replay) {
            (cur, prev) = settle_counter(cur, prev, settled.reserved, cost, quota);
            write = true;
        }
        if write {
            let ttl_ms = (2.0 * window - elapsed).ceil();
            slot.state = Some(State::Counter {
                index: index as u64,
                cur: cur as u64,
                prev: prev as u64,
                recent: remembered(i, slot, attempt.id, now_us),
            });
            slot.expires_at = now_us - now_us % 1000 + ttl_ms as u64 * 1000;
        }
        limits.push(counter_state(quota, window, elapsed, cur, prev));
    }
    outcome(admitted, ceil_us(retry * 1000.0), limits)
}

/// A sliding counter's (current, previous) counts in window `index`, from its slot.
fn counts(slot: &Slot, index: f64) -> (f64, f64) {
    match slot.state {
        Some(State::Counter {
            index: i,
            cur,
            prev,
            ..
        }) if i as f64 == index => (cur as f64, prev as f64),
        Some(State::Counter { index: i, cur, .. }) if i as f64 == index - 1.0 => (0.0, cur as f64),
        _ => (0.0, 0.0),
    }
}

/// A sliding counter's (current, previous) counts once a settlement of `reserved` for `actual`
/// is applied: the difference goes to this window (past the quota by at most one more quota); a
/// refund beyond it comes out of the previous one.
fn settle_counter(cur: f64, prev: f64, reserved: u64, actual: u64, quota: f64) -> (f64, f64) {
    if actual >= reserved {
        let delta = (actual - reserved) as f64;
        ((cur + delta).min(cur.max(2.0 * quota)), prev)
    } else {
        let refund = (reserved - actual) as f64;
        if cur >= refund {
            (cur - refund, prev)
        } else {
            (0.0, (prev + cur - refund).max(0.0))
        }
    }
}

/// How long a sliding counter denies `cost` (milliseconds): until the previous window's share
/// has faded enough, or, when this window's count alone leaves no room, into the next window.
fn counter_wait(quota: f64, window: f64, elapsed: f64, cost: f64, cur: f64, prev: f64) -> f64 {
    let room = quota - cost - cur;
    if cost > quota {
        window
    } else if room >= 0.0 {
        (window - elapsed) - room * window / prev
    } else {
        (window - elapsed) + window - (quota - cost) * window / cur
    }
}

/// A sliding counter's remainder and reset, window and elapsed time in milliseconds.
fn counter_state(quota: f64, window: f64, elapsed: f64, cur: f64, prev: f64) -> LimitState {
    let used = cur + prev * (window - elapsed) / window;
    let whole = (used - 1e-9).ceil();
    let remaining = (quota - whole).max(0.0);
    // as the script: within this window while the previous one's share can fall far enough,
    // else in the next one, as this window's cost fades — the same wait as a denial's
    let reset = if whole <= 0.0 {
        0.0
    } else if prev > 0.0 && whole - 1.0 - cur >= 0.0 {
        (window - elapsed) - (whole - 1.0 - cur) * window / prev
    } else {
        (window - elapsed) + window - (whole - 1.0) * window / cur
    };
    state(remaining as u64, ceil_us(reset * 1000.0))
}

/// The recent attempts of the `i`th limit's `slot` once `attempt` charged it at `now`: kept on
/// the first limit only, as the script keeps them.
fn remembered(i: usize, slot: &mut Slot, attempt: u64, now: u64) -> Recent {
    if i > 0 {
        return Recent::default();
    }
    take_recent(slot).remember(attempt, now)
}

/// The recent attempts `slot` keeps, taken out of it.
fn take_recent(slot: &mut Slot) -> Recent {
    slot.state
        .as_mut()
        .map(State::take_recent)
        .unwrap_or_default()
}

/// Mirrors `gcra` of `scripts/rate.lua`: offsets from now in 1/quota microseconds, exact in integers.
fn gcra(policy: &RatePolicy, slots: &mut [Slot], now: u64, attempt: Attempt) -> RateOutcome {
    let cost = attempt.cost;
    let mut states = Vec::with_capacity(slots.len());
    let mut admitted = true;
    let mut retry = 0u64;
    for (slot, limit) in slots.iter().zip(policy.limits()) {
        let (quota, window) = (u128::from(limit.quota()), u128::from(limit.window_us()));
        let (tat, rem) = match slot.state {
            Some(State::Tat { tat, rem, .. }) if tat >= now => (tat, rem),
            _ => (now, 0),
        };
        states.push((tat, rem));
        if attempt.replay || attempt.settles.is_some() {
            continue;
        }
        if let Some(wait) = gcra_wait(tat - now, rem, cost, quota, window) {
            admitted = false;
            retry = retry.max(wait);
        }
    }
    let mut limits = Vec::with_capacity(slots.len());
    let charged = slots
        .iter_mut()
        .zip(policy.limits())
        .zip(states)
        .enumerate();
    for (i, ((slot, limit), (mut tat, mut rem))) in charged {
        let (quota, window) = (u128::from(limit.quota()), u128::from(limit.window_us()));
        let mut write = admitted && !attempt.replay && cost > 0 && attempt.settles.is_none();
        if write {
            let units = u128::from(rem) + u128::from(cost) * window;
            tat += u64::try_from(units / quota).unwrap_or(u64::MAX / 2);
            rem = u64::try_from(units % quota).unwrap_or(0);
        }
        if let Some(settled) = attempt.settles.filter(|_| !attempt.replay) {
            let ahead = u128::from(tat - now) * quota + u128::from(rem);
            let ahead = settle_gcra(ahead, settled.reserved, cost, quota, window);
            tat = now + u64::try_from(ahead / quota).unwrap_or(u64::MAX / 2);
            rem = u64::try_from(ahead % quota).unwrap_or(0);
            write = true;
        }
        if write {
            let ttl_ms = (tat - now).div_ceil(1000) + 1;
            slot.state = Some(State::Tat {
                tat,
                rem,
                recent: remembered(i, slot, attempt.id, now),
            });
            slot.expires_at = now.saturating_add(ttl_ms * 1000);
        }
        limits.push(gcra_state(tat - now, rem, quota, window));
    }
    outcome(admitted, retry, limits)
}

/// How long a request of `cost` waits, if it does not fit now: the bucket `offset` µs and `rem`
/// 1/quota µs ahead of now; a cost over the quota waits a whole window.
fn gcra_wait(offset: u64, rem: u64, cost: u64, quota: u128, window: u128) -> Option<u64> {
    if u128::from(cost) > quota {
        return Some(u64::try_from(window).unwrap_or(u64::MAX));
    }
    let ahead = u128::from(offset) * quota + u128::from(rem) + u128::from(cost) * window;
    let over = ahead.checked_sub(window * quota).filter(|over| *over > 0)?;
    Some(u64::try_from(over.div_ceil(quota)).unwrap_or(u64::MAX))
}

/// A GCRA offset from now (in 1/quota µs) once a settlement of `reserved` for `actual` is
/// applied: moved by the difference, to at least now and, past the quota, by at most one more.
fn settle_gcra(ahead: u128, reserved: u64, actual: u64, quota: u128, window: u128) -> u128 {
    if actual >= reserved {
        let moved = ahead + u128::from(actual - reserved) * window;
        moved.min(ahead.max(2 * window * quota))
    } else {
        ahead.saturating_sub(u128::from(reserved - actual) * window)
    }
}

/// A GCRA limit's remainder and reset, its theoretical arrival time `offset` µs (and `rem` /
/// `quota` of one more) from now.
fn gcra_state(offset: u64, rem: u64, quota: u128, window: u128) -> LimitState {
    let ahead = u128::from(offset) * quota + u128::from(rem);
    let used = ahead.div_ceil(window);
    let remaining = quota.saturating_sub(used);
    // the next unit frees when the offset drops to (used - 1) emission intervals
    let reset = if used > 0 {
        (ahead - (used - 1) * window).div_ceil(quota)
    } else {
        0
    };
    state(
        u64::try_from(remaining).unwrap_or(0),
        u64::try_from(reset).unwrap_or(u64::MAX),
    )
}
