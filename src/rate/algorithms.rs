//! The three algorithms in process, as plain functions over a caller's state: the same decisions
//! as the Redis rate script (`src/store/redis/scripts/rate.lua`) and the reference model
//! (`conformance::model`), for `MemoryStore` and the local fallback.
//!
//! Time is store time in microseconds. Each function gets one [`Slot`] per limit of the policy —
//! the live state and its expiry, or an empty slot — and leaves in it what the store would keep;
//! the caller's [`Ledger`] remembers the attempts that charged it (see the attempt ledger in the
//! store docs).

use std::collections::{BTreeSet, HashMap, VecDeque};

use super::{LimitState, RateCheck, RateOutcome, RatePolicy, Settlement};

/// A sliding log entry's name: its attempt and unit (0 for an attempt's only unit), as the
/// script names its members `id` or `id:unit`.
type Name = (u64, u64);

/// One caller's state for one limit.
#[derive(Debug)]
pub(crate) enum State {
    /// A sliding log: per unit of admitted cost its score and name, ascending by score.
    Log(VecDeque<(u64, Name)>),
    /// A sliding counter: window index, current and previous window's cost, and the attempt
    /// that began the state's life.
    Counter {
        index: u64,
        cur: u64,
        prev: u64,
        born: u64,
    },
    /// A GCRA theoretical arrival time: whole microseconds plus `rem` / quota of one, and the
    /// attempt that began the state's life.
    Tat { tat: u64, rem: u64, born: u64 },
}

/// How long a charged attempt is remembered past its decision: a memory store's call has the
/// deadline of a store with a timeout of a second, and is remembered, as on the shared stores,
/// until that deadline plus twice the timeout.
pub(crate) const REMEMBERED_US: u64 = 3_000_000;

/// Where a reservation's charge went on one limit; a counter's or GCRA's names the life of the
/// state it charged (`born`), so that a refund never comes out of a state begun since.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Place {
    /// A sliding log: the entries named by the attempt.
    Log,
    /// A sliding counter: the window it was added to.
    Window { index: u64, born: u64 },
    /// GCRA: the arrival time right after the charge.
    End { tat: u64, rem: u64, born: u64 },
}

/// The attempts that charged a caller: until when each is remembered, and where a reservation's
/// charge went. Forgotten in order of expiry, at O(expired).
#[derive(Debug, Default)]
pub(crate) struct Ledger {
    entries: HashMap<u64, Entry>,
    /// (until, attempt) per entry; an item whose entry has moved on is skipped.
    expiries: BTreeSet<(u64, u64)>,
}

#[derive(Debug)]
struct Entry {
    /// Until when a re-send of the attempt charges nothing.
    charged_until: u64,
    /// A reservation's place per limit, and until when it is kept.
    place: Option<(Box<[Place]>, u64)>,
    /// When the entry goes: the later of the two.
    until: u64,
}

impl Ledger {
    /// Forgets what expired by `now`.
    fn forget(&mut self, now: u64) {
        while let Some(&(until, id)) = self.expiries.first() {
            if until > now {
                break;
            }
            self.expiries.pop_first();
            if self.entries.get(&id).is_some_and(|e| e.until == until) {
                self.entries.remove(&id);
            }
        }
    }

    /// Whether `id` charged and is still remembered at `now`.
    fn charged(&self, id: u64, now: u64) -> bool {
        self.entries.get(&id).is_some_and(|e| e.charged_until > now)
    }

    /// Remembers `id` as charged until `charged_until`, with a reservation's place.
    fn remember(&mut self, id: u64, charged_until: u64, place: Option<(Box<[Place]>, u64)>) {
        let entry = self.entries.entry(id).or_insert(Entry {
            charged_until: 0,
            place: None,
            until: 0,
        });
        entry.charged_until = entry.charged_until.max(charged_until);
        if place.is_some() {
            entry.place = place;
        }
        let until = entry
            .charged_until
            .max(entry.place.as_ref().map_or(0, |p| p.1));
        if until > entry.until {
            entry.until = until;
            self.expiries.insert((until, id));
        }
    }

    /// The place of reservation `of`, if it is still kept at `now`; dropped.
    fn take_place(&mut self, of: u64, now: u64) -> Option<Box<[Place]>> {
        let (place, until) = self.entries.get_mut(&of)?.place.take()?;
        (until > now).then_some(place)
    }

    /// When the last entry goes (0: none).
    pub(crate) fn expires_at(&self) -> u64 {
        self.expiries.last().map_or(0, |&(until, _)| until)
    }
}

/// A limit's state as kept between decisions: `None` when there is none (or it expired).
#[derive(Debug, Default)]
pub(crate) struct Slot {
    pub(crate) state: Option<State>,
    /// Store time in microseconds after which the state is gone.
    pub(crate) expires_at: u64,
    /// Store time in microseconds until which the caller is blocked by this limit's penalty
    /// (see [`Limit::block_for`](super::Limit::block_for)); kept apart from the state, which
    /// may expire first.
    pub(crate) blocked_until: u64,
}

/// Decides `check` against every limit of `policy` at store time `now`, all or nothing; `slots`
/// holds one slot per limit, in order, and `ledger` the caller's attempts.
pub(crate) fn check(
    policy: &RatePolicy,
    slots: &mut [Slot],
    ledger: &mut Ledger,
    now: u64,
    check: RateCheck,
) -> RateOutcome {
    ledger.forget(now);
    // a look (cost 0) charges nothing, so it is never a re-send
    let counts = check.cost() > 0 || check.settles().is_some();
    let replay = counts && ledger.charged(check.attempt(), now);
    let (admitted, retry, limits) = match check.settles() {
        Some(settled) => {
            let place = (settled.refundable && !replay)
                .then(|| ledger.take_place(settled.of, now))
                .flatten();
            let limits = settle(policy, slots, now, check, settled, replay, place.as_deref());
            if !replay {
                ledger.remember(check.attempt(), now + REMEMBERED_US, None);
            }
            (true, 0, limits)
        }
        None => {
            let blocked = blocked_for(policy, slots, now);
            let (admitted, retry, limits, place) =
                charge(policy, slots, now, check, replay, blocked);
            if admitted && check.cost() > 0 {
                let place = place.map(|place| {
                    let until = place
                        .iter()
                        .zip(policy.limits())
                        .map(|(p, l)| place_until(*p, l.window_us(), now))
                        .max()
                        .unwrap_or(now);
                    (place, until)
                });
                ledger.remember(check.attempt(), now + REMEMBERED_US, place);
            }
            (admitted, retry, limits)
        }
    };
    RateOutcome {
        admitted,
        retry_after: std::time::Duration::from_micros(retry),
        limits,
        decided_at_us: Some(now),
    }
}

/// Until when a place is kept: a counter's until the end of the window after its own, a GCRA
/// span until it has drained; after that a refund from it returns nothing.
fn place_until(place: Place, window: u64, now: u64) -> u64 {
    match place {
        Place::Log => now,
        Place::Window { index, .. } => (index + 2) * (window / 1000) * 1000,
        Place::End { tat, .. } => now + ((tat - now).div_ceil(1000) + 1) * 1000,
    }
}

fn ceil_us(x: f64) -> u64 {
    if x > 0.0 { x.ceil() as u64 } else { 0 }
}

fn state(remaining: u64, reset_us: u64) -> LimitState {
    LimitState {
        remaining,
        reset: std::time::Duration::from_micros(reset_us),
    }
}

/// The name of the `u`-th unit of an attempt of `cost`.
fn name(id: u64, cost: u64, u: u64) -> Name {
    if cost == 1 && u == 1 {
        (id, 0)
    } else {
        (id, u)
    }
}

/// A sliding log from `slot`, trimmed of what left the window at `now`.
fn log_of(slot: &mut Slot, window: u64, now: u64) -> VecDeque<(u64, Name)> {
    let mut log = match slot.state.take() {
        Some(State::Log(log)) => log,
        _ => VecDeque::new(),
    };
    let horizon = now.saturating_sub(window);
    while log.front().is_some_and(|&(s, _)| s <= horizon) {
        log.pop_front();
    }
    log
}

/// A sliding counter's window index at store time `now_us`, and the milliseconds elapsed in it:
/// windows of `window_us` on whole milliseconds of store time, as every store places them.
fn counter_window(window_us: u64, now_us: u64) -> (f64, f64) {
    let now = (now_us / 1000) as f64;
    let window = window_us as f64 / 1000.0;
    let index = (now / window).floor();
    (index, now - index * window)
}

/// What is left at store time `at_us` of the sliding counter's window of `window_us` it falls
/// in (µs): how long a copy may spend a slice charged to it.
pub(crate) fn counter_window_left(window_us: u64, at_us: u64) -> u64 {
    let (index, _) = counter_window(window_us, at_us);
    let end_us = ((index + 1.0) * window_us as f64).floor();
    (end_us as u64).saturating_sub(at_us)
}

/// A sliding counter's window index and the milliseconds elapsed in it at `now`, and its
/// (current, previous) counts from `slot`.
fn counter_of(slot: &Slot, window_us: u64, now_us: u64) -> (f64, f64, f64, f64) {
    let (index, elapsed) = counter_window(window_us, now_us);
    let (cur, prev) = match slot.state {
        Some(State::Counter {
            index: i,
            cur,
            prev,
            ..
        }) if i as f64 == index => (cur as f64, prev as f64),
        Some(State::Counter { index: i, cur, .. }) if i as f64 == index - 1.0 => (0.0, cur as f64),
        _ => (0.0, 0.0),
    };
    (index, elapsed, cur, prev)
}

/// A GCRA arrival time and remainder from `slot` at `now`: now when it has passed.
fn tat_of(slot: &Slot, now: u64) -> (u64, u64) {
    match slot.state {
        Some(State::Tat { tat, rem, .. }) if tat >= now => (tat, rem),
        _ => (now, 0),
    }
}

/// The attempt that began the life of a counter or GCRA state still living in `slot` at `now`
/// (a counter of this window or the one before, an arrival time not passed); `None` when a
/// charge now begins a new one.
fn born_of(slot: &Slot, window_us: u64, now_us: u64) -> Option<u64> {
    match slot.state.as_ref()? {
        State::Counter { index, born, .. } => {
            let (current, _) = counter_window(window_us, now_us);
            (*index as f64 == current || *index as f64 == current - 1.0).then_some(*born)
        }
        State::Tat { tat, born, .. } => (*tat >= now_us).then_some(*born),
        State::Log(_) => None,
    }
}

/// What deciding a check's limits found: whether all had room and the wait when not, whether
/// the attempt turned out charged before (a log holding it), the logs as read, and per limit
/// whether it denied the cost.
struct Decision {
    admitted: bool,
    retry: u64,
    replay: bool,
    logs: Vec<VecDeque<(u64, Name)>>,
    denied: Vec<bool>,
}

/// Decides `check` on every limit, charging nothing; a replay is admitted, a caller `blocked`
/// (µs left) denied.
fn decide(
    policy: &RatePolicy,
    slots: &mut [Slot],
    now: u64,
    check: RateCheck,
    (mut replay, blocked): (bool, u64),
) -> Decision {
    let (cost, id, hold) = (check.cost(), check.attempt(), check.hold_us());
    let mut logs: Vec<VecDeque<(u64, Name)>> = Vec::new();
    let mut denied = Vec::with_capacity(slots.len());
    let (mut admitted, mut retry) = (true, 0u64);
    for (slot, limit) in slots.iter_mut().zip(policy.limits()) {
        let (q, w, cost) = (limit.quota(), limit.window_us(), limit.charge_of(cost));
        let wait = match policy.algorithm() {
            super::Algorithm::SlidingLog => {
                let log = log_of(slot, w, now);
                let wait = if replay {
                    None
                } else {
                    log_wait(&log, q, w, now, cost)
                };
                // a log that would deny holding this attempt's first unit: charged before
                let first = name(id, cost, 1);
                let logged = wait.is_some()
                    && cost > 0
                    && !log.is_empty()
                    && log.iter().any(|&(_, n)| n == first);
                logs.push(log);
                if logged {
                    replay = true;
                    None
                } else {
                    wait
                }
            }
            super::Algorithm::SlidingCounter if !replay => counter_wait(slot, q, w, now, cost),
            super::Algorithm::Gcra if !replay => gcra_wait(slot, (q, w), (now, hold), cost),
            _ => None,
        };
        denied.push(wait.is_some());
        if let Some(wait) = wait {
            admitted = false;
            retry = retry.max(wait);
        }
    }
    if replay {
        (admitted, retry) = (true, 0);
    } else if blocked > 0 {
        (admitted, retry) = (false, retry.max(blocked));
    }
    Decision {
        admitted,
        retry,
        replay,
        logs,
        denied,
    }
}

/// A check: every limit decided, then, admitted and costing, charged; a caller `blocked` (the
/// time its block has left, µs; 0: none) is denied and charged nothing. Whether admitted, the
/// wait (µs), the limits, and a reservation's place when it charged.
fn charge(
    policy: &RatePolicy,
    slots: &mut [Slot],
    now: u64,
    check: RateCheck,
    replay: bool,
    blocked: u64,
) -> (bool, u64, Vec<LimitState>, Option<Box<[Place]>>) {
    let (cost, id, hold) = (check.cost(), check.attempt(), check.hold_us());
    let algorithm = policy.algorithm();
    let decision = decide(policy, slots, now, check, (replay, blocked));
    let (admitted, mut retry, replay) = (decision.admitted, decision.retry, decision.replay);
    let charges = admitted && !replay && cost > 0;
    let mut place = Vec::with_capacity(if charges { slots.len() } else { 0 });
    let mut limits = Vec::with_capacity(slots.len());
    let mut logs = decision.logs.into_iter();
    for (slot, limit) in slots.iter_mut().zip(policy.limits()) {
        let (q, w, cost) = (limit.quota(), limit.window_us(), limit.charge_of(cost));
        match algorithm {
            super::Algorithm::SlidingLog => {
                let mut log = logs.next().unwrap_or_default();
                if charges {
                    // units a copy may admit until `now + hold` are dated then
                    if add_units(&mut log, (id, cost), 1..=cost, now + hold) > 0 {
                        keep_until(slot, now, w + hold);
                    }
                    place.push(Place::Log);
                }
                limits.push(keep_log(slot, log, q, w, now));
            }
            super::Algorithm::SlidingCounter => {
                let (index, elapsed, cur, prev) = counter_of(slot, w, now);
                let mut cur = cur as u64;
                if charges {
                    cur += cost;
                    let born = born_of(slot, w, now).unwrap_or(id);
                    write_counter(slot, (index, elapsed), w, (cur, prev as u64, born), now);
                    place.push(Place::Window {
                        index: index as u64,
                        born,
                    });
                }
                limits.push(counter_state(q, w, elapsed, cur as f64, prev));
            }
            super::Algorithm::Gcra => {
                let (mut tat, mut rem) = tat_of(slot, now);
                if charges {
                    // units a copy may admit until `now + hold` are charged from then at the
                    // earliest
                    (tat, rem) = tat_of(slot, now + hold);
                    let units = u128::from(rem) + u128::from(cost) * u128::from(w);
                    tat += u64::try_from(units / u128::from(q)).unwrap_or(u64::MAX / 4);
                    rem = u64::try_from(units % u128::from(q)).unwrap_or(0);
                    let born = born_of(slot, w, now).unwrap_or(id);
                    write_tat(slot, (tat, rem, born), now);
                    place.push(Place::End { tat, rem, born });
                }
                limits.push(gcra_state(tat - now, rem, q, w));
            }
        }
    }
    if !admitted {
        let denied = (cost > 0).then_some(&decision.denied[..]);
        retry = retry.max(penalize(policy, slots, &mut limits, denied, now));
    }
    let place = (charges && check.is_reservation()).then(|| place.into_boxed_slice());
    (admitted, retry, limits, place)
}

/// The time (µs) the caller's block under `policy` has left at `now`: the latest end among its
/// limits with a penalty; 0 when it is not blocked.
fn blocked_for(policy: &RatePolicy, slots: &[Slot], now: u64) -> u64 {
    slots
        .iter()
        .zip(policy.limits())
        .filter(|(_, limit)| limit.block_us() > 0)
        .map(|(slot, _)| slot.blocked_until.saturating_sub(now))
        .max()
        .unwrap_or(0)
}

/// The penalties of a denied check, in its answer `limits`: a limit that blocks the caller
/// answers 0 remaining and the time its block has left. A caller blocked already stays as it
/// is (a denial does not extend a block); one that is not is blocked, from `now`, on each limit
/// with a penalty that `denied` the check (`None`: a look, which blocks nothing). The longest
/// block's time left (µs).
fn penalize(
    policy: &RatePolicy,
    slots: &mut [Slot],
    limits: &mut [LimitState],
    denied: Option<&[bool]>,
    now: u64,
) -> u64 {
    let blocked = blocked_for(policy, slots, now) > 0;
    let mut longest = 0;
    for (i, (slot, limit)) in slots.iter_mut().zip(policy.limits()).enumerate() {
        let block = limit.block_us();
        let starts = !blocked && block > 0 && denied.is_some_and(|d| d[i]);
        if starts {
            slot.blocked_until = now.saturating_add(block);
        }
        if block > 0 && slot.blocked_until > now {
            let left = slot.blocked_until - now;
            limits[i] = state(0, left);
            longest = longest.max(left);
        }
    }
    longest
}

/// A settlement applied to every limit (nothing changed when it is a `replay`): the debt added
/// now, or the refund returned from where the reservation's charge went (`place`), only what
/// the limit still counts. The limits as they stand after it.
fn settle(
    policy: &RatePolicy,
    slots: &mut [Slot],
    now: u64,
    check: RateCheck,
    settled: Settlement,
    replay: bool,
    place: Option<&[Place]>,
) -> Vec<LimitState> {
    let (reserved, actual) = (settled.reserved, check.cost());
    let debt = if replay {
        0
    } else {
        actual.saturating_sub(reserved)
    };
    let refund = if replay || !settled.refundable {
        0
    } else {
        reserved.saturating_sub(actual)
    };
    let mut limits = Vec::with_capacity(slots.len());
    for (i, (slot, limit)) in slots.iter_mut().zip(policy.limits()).enumerate() {
        let (q, w) = (limit.quota(), limit.window_us());
        let place = place.and_then(|p| p.get(i).copied());
        // a limit that counts calls counted the call: a settlement changes nothing of it
        let calls = limit.counts_calls();
        let change = Change {
            debt: if calls { 0 } else { debt },
            refund: if calls { 0 } else { refund },
            by: check.attempt(),
        };
        limits.push(match policy.algorithm() {
            super::Algorithm::SlidingLog => {
                let units = (settled.of, reserved, actual);
                settle_log(slot, (q, w), now, change, units)
            }
            super::Algorithm::SlidingCounter => settle_counter(slot, (q, w), now, change, place),
            super::Algorithm::Gcra => settle_gcra(slot, (q, w), now, change, place),
        });
    }
    limits
}

/// What a settlement changes of each limit: a debt added, or a refund taken back; `by`, the
/// settlement's own attempt (a state its debt begins is born of it).
#[derive(Clone, Copy)]
struct Change {
    debt: u64,
    refund: u64,
    by: u64,
}

/// A settlement on a log: the debt's units added after the reserved ones, the refunded units of
/// the attempt (`of`, what it reserved, what it used) removed.
fn settle_log(
    slot: &mut Slot,
    (q, w): (u64, u64),
    now: u64,
    Change { debt, refund, .. }: Change,
    (of, reserved, actual): (u64, u64, u64),
) -> LimitState {
    let mut log = log_of(slot, w, now);
    if debt > 0 {
        let room = (2 * q).saturating_sub(log.len() as u64);
        let units = reserved + 1..=reserved + debt.min(room);
        if add_units(&mut log, (of, reserved), units, now) > 0 {
            keep_until(slot, now, w);
        }
    }
    if refund > 0 {
        let names: Vec<Name> = (actual + 1..=reserved)
            .map(|u| name(of, reserved, u))
            .collect();
        log.retain(|(_, n)| !names.contains(n));
    }
    keep_log(slot, log, q, w, now)
}

/// A settlement on a sliding counter: the debt goes to this window, a refund comes out of the
/// window the reservation went to while that still counts and the state is the one it charged.
fn settle_counter(
    slot: &mut Slot,
    (q, w): (u64, u64),
    now: u64,
    Change { debt, refund, by }: Change,
    place: Option<Place>,
) -> LimitState {
    let (index, elapsed, cur, prev) = counter_of(slot, w, now);
    let (mut cur, mut prev) = (cur as u64, prev as u64);
    let life = born_of(slot, w, now);
    let write = if debt > 0 {
        cur = (cur + debt).min(cur.max(2 * q));
        true
    } else {
        match place {
            Some(Place::Window { index: p, born }) if refund > 0 && life == Some(born) => {
                if p as f64 == index {
                    cur -= refund.min(cur);
                    true
                } else if p as f64 == index - 1.0 {
                    prev -= refund.min(prev);
                    true
                } else {
                    false
                }
            }
            _ => false,
        }
    };
    if write {
        let born = life.unwrap_or(by);
        write_counter(slot, (index, elapsed), w, (cur, prev, born), now);
    }
    counter_state(q, w, elapsed, cur as f64, prev as f64)
}

/// A settlement on GCRA: the debt moves the theoretical arrival time on, a refund back by what
/// of the reservation's span is still ahead, while the state is the one it charged.
fn settle_gcra(
    slot: &mut Slot,
    (q, w): (u64, u64),
    now: u64,
    Change { debt, refund, by }: Change,
    place: Option<Place>,
) -> LimitState {
    let (tat, rem) = tat_of(slot, now);
    let life = born_of(slot, w, now);
    let (qq, ww) = (u128::from(q), u128::from(w));
    let mut ahead = u128::from(tat - now) * qq + u128::from(rem);
    let write = if debt > 0 {
        ahead = (ahead + u128::from(debt) * ww).min(ahead.max(2 * ww * qq));
        true
    } else if let (
        true,
        Some(Place::End {
            tat: end,
            rem: end_rem,
            born,
        }),
    ) = (refund > 0, place)
        && life == Some(born)
    {
        let left =
            (u128::from(end) * qq + u128::from(end_rem)).saturating_sub(u128::from(now) * qq);
        ahead -= (u128::from(refund) * ww).min(left).min(ahead);
        true
    } else {
        false
    };
    let tat = now + u64::try_from(ahead / qq).unwrap_or(u64::MAX / 4);
    let rem = u64::try_from(ahead % qq).unwrap_or(0);
    if write {
        write_tat(slot, (tat, rem, life.unwrap_or(by)), now);
    }
    gcra_state(tat - now, rem, q, w)
}

/// Adds the units `units` of an attempt (`of`, its cost) to `log`, scored `score`, each only if
/// the log does not hold it yet (as ZADD NX); how many were added. The log stays in order of
/// score: a held charge's units may be scored after some added since.
fn add_units(
    log: &mut VecDeque<(u64, Name)>,
    (of, cost): (u64, u64),
    units: std::ops::RangeInclusive<u64>,
    score: u64,
) -> u64 {
    let mut added = 0;
    for u in units {
        let unit = name(of, cost, u);
        if !log.iter().any(|&(_, n)| n == unit) {
            let at = log.partition_point(|&(s, _)| s <= score);
            log.insert(at, (score, unit));
            added += 1;
        }
    }
    added
}

/// Keeps a log `slot` for at least `ttl` µs from `now` (whole milliseconds, as PEXPIRE), never
/// shorter than it was: entries a held charge dated later may outlive those added since.
fn keep_until(slot: &mut Slot, now: u64, ttl: u64) {
    slot.expires_at = slot.expires_at.max(now + ttl.div_ceil(1000) * 1000);
}

/// Keeps `log` in `slot` (an empty log is deleted); the limit's remaining and reset.
fn keep_log(slot: &mut Slot, log: VecDeque<(u64, Name)>, q: u64, w: u64, now: u64) -> LimitState {
    let reset = log.front().map_or(0, |&(oldest, _)| oldest + w - now);
    let limit = state(q.saturating_sub(log.len() as u64), reset);
    slot.state = (!log.is_empty()).then_some(State::Log(log));
    limit
}

/// How long a sliding log denies `cost`, `None` when it fits: room appears once the
/// (count + cost - quota) oldest entries have left the window.
fn log_wait(log: &VecDeque<(u64, Name)>, q: u64, w: u64, now: u64, cost: u64) -> Option<u64> {
    let count = log.len() as u64;
    if count.saturating_add(cost) <= q {
        return None;
    }
    if cost > q {
        return Some(w);
    }
    let idx = usize::try_from(count + cost - q - 1).unwrap_or(0);
    Some(log[idx].0 + w - now)
}

/// Writes a sliding counter's window `index` (window `w` µs, `elapsed` ms into it): a new
/// window expires at the end of the next one; the same window keeps its expiry.
fn write_counter(
    slot: &mut Slot,
    (index, elapsed): (f64, f64),
    w: u64,
    (cur, prev, born): (u64, u64, u64),
    now: u64,
) {
    let same = matches!(slot.state, Some(State::Counter { index: i, .. }) if i as f64 == index);
    if !same {
        let ttl_ms = (2.0 * (w as f64 / 1000.0) - elapsed).ceil() as u64;
        slot.expires_at = now - now % 1000 + ttl_ms * 1000;
    }
    slot.state = Some(State::Counter {
        index: index as u64,
        cur,
        prev,
        born,
    });
}

/// Writes a GCRA arrival time (and the life it belongs to), expiring a millisecond after it.
fn write_tat(slot: &mut Slot, (tat, rem, born): (u64, u64, u64), now: u64) {
    let ttl_ms = (tat - now).div_ceil(1000) + 1;
    slot.state = Some(State::Tat { tat, rem, born });
    slot.expires_at = now.saturating_add(ttl_ms * 1000);
}

/// How long a sliding counter denies `cost` (µs), `None` when it fits: until the previous
/// window's share has faded enough, or, when this window's count alone leaves no room, into the
/// next window.
fn counter_wait(slot: &Slot, q: u64, w: u64, now: u64, cost: u64) -> Option<u64> {
    let (_, elapsed, cur, prev) = counter_of(slot, w, now);
    let (quota, window, cost) = (q as f64, w as f64 / 1000.0, cost as f64);
    if (cur + cost) * window + prev * (window - elapsed) <= quota * window {
        return None;
    }
    let room = quota - cost - cur;
    let wait = if cost > quota {
        window
    } else if room >= 0.0 {
        (window - elapsed) - room * window / prev
    } else {
        (window - elapsed) + window - (quota - cost) * window / cur
    };
    Some(ceil_us(wait * 1000.0))
}

/// A sliding counter's remainder and reset at store time `now_us`, from the counts of its current
/// window (`cur`) and the one before (`prev`) as they stand then: the Redis script answers a
/// counter's limit by those counts, and the answer is read from them here, as for every store.
#[cfg(feature = "redis")]
pub(crate) fn counter_answer(q: u64, w: u64, now_us: u64, cur: u64, prev: u64) -> LimitState {
    let (_, elapsed) = counter_window(w, now_us);
    counter_state(q, w, elapsed, cur as f64, prev as f64)
}

/// A sliding counter's remainder and reset, elapsed time in milliseconds.
fn counter_state(q: u64, w: u64, elapsed: f64, cur: f64, prev: f64) -> LimitState {
    let (quota, window) = (q as f64, w as f64 / 1000.0);
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

/// How long a GCRA limit denies `cost`, `None` when it fits; a cost over the quota waits a
/// whole window.
fn gcra_wait(slot: &Slot, (q, w): (u64, u64), (now, hold): (u64, u64), cost: u64) -> Option<u64> {
    if cost > q {
        return Some(w);
    }
    // a held charge starts from `now + hold` at the earliest
    let (tat, rem) = tat_of(slot, now + if cost > 0 { hold } else { 0 });
    let (q, w) = (u128::from(q), u128::from(w));
    let ahead = u128::from(tat - now) * q + u128::from(rem) + u128::from(cost) * w;
    let over = ahead.checked_sub(w * q).filter(|over| *over > 0)?;
    Some(u64::try_from(over.div_ceil(q)).unwrap_or(u64::MAX))
}

/// A GCRA limit's remainder and reset, its theoretical arrival time `offset` µs (and `rem` /
/// `quota` of one more) from now: the Redis script answers a GCRA limit by those two, and the
/// answer is read from them here, as for every store.
pub(crate) fn gcra_state(offset: u64, rem: u64, q: u64, w: u64) -> LimitState {
    let (q, w) = (u128::from(q), u128::from(w));
    let ahead = u128::from(offset) * q + u128::from(rem);
    let used = ahead.div_ceil(w);
    let remaining = q.saturating_sub(used);
    // the next unit frees when the offset drops to (used - 1) emission intervals
    let reset = if used > 0 {
        (ahead - (used - 1) * w).div_ceil(q)
    } else {
        0
    };
    state(
        u64::try_from(remaining).unwrap_or(0),
        u64::try_from(reset).unwrap_or(u64::MAX),
    )
}

#[cfg(test)]
mod tests {
    use super::counter_window_left;

    #[test]
    fn a_counter_slice_lives_to_its_windows_end_on_the_stores_clock() {
        // windows of 1 s on whole milliseconds of store time
        assert_eq!(counter_window_left(1_000_000, 5_000_000), 1_000_000);
        assert_eq!(counter_window_left(1_000_000, 5_999_400), 600);
        assert_eq!(counter_window_left(1_000_000, 5_250_123), 749_877);
        // a window of 1.5 ms: windows end at 1.5 ms, 3 ms, ...
        assert_eq!(counter_window_left(1_500, 2_100), 900);
    }
}
