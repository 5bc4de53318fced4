//! The reference model of rate checks: what every [`RateStore`](crate::store::RateStore) answers,
//! written for reading, with the store's time as an input.
//!
//! [`Model::decide`] answers a check (or a settlement) at a given store time exactly as a store
//! must, and keeps what the store keeps: each limit's state under its store key, and the
//! [attempt ledger](crate::store#the-attempt-ledger) — what each attempt charged, until when it
//! is remembered, and where a reservation's charge went. [`property`](super::property) drives
//! random sequences of checks, re-sends, late first sends and settlements against a store and
//! holds every answer against this model, evaluated at the time the store reports
//! ([`RateOutcome::decided_at_us`]).
//!
//! The arithmetic is the stores': GCRA in integers (offsets in 1/quota microseconds), the
//! sliding counter in milliseconds and doubles, in the same order of operations.

use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

use crate::rate::{Algorithm, LimitState, RateCheck, RateOutcome, RatePolicy};

/// One limit's state, as a store keeps it under the limit's key.
#[derive(Debug, Clone)]
enum State {
    /// Sliding log: per unit of admitted cost its member name and score (µs); a name is
    /// `(attempt, unit)`, unit 0 for the attempt's only unit.
    Log(BTreeMap<(u64, u64), u64>),
    /// Sliding counter: window index, the window's cost and the previous window's, and the
    /// attempt that began the state's life.
    Counter {
        index: u64,
        cur: u64,
        prev: u64,
        born: u64,
    },
    /// GCRA: theoretical arrival time (µs) and remainder (1/quota µs), and the attempt that
    /// began the state's life.
    Tat { tat: u64, rem: u64, born: u64 },
}

/// Where a reservation's charge went, per limit. A counter's or GCRA's place names the life of
/// the state it charged (`born`: the attempt that began it): a refund comes only out of that
/// life, never out of a state begun since — after a reset, or after the state lapsed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Place {
    /// A sliding log: its entries are named by the attempt.
    Log,
    /// A sliding counter: the index of the window it was added to.
    Window { index: u64, born: u64 },
    /// GCRA: the arrival time right after the charge.
    End { tat: u64, rem: u64, born: u64 },
}

/// An attempt in the ledger.
#[derive(Debug, Clone, Default)]
struct Entry {
    /// Until when (µs) the attempt is remembered as charged.
    charged_until: u64,
    /// A reservation's place, per limit, and until when it is kept.
    place: Option<(Vec<Place>, u64)>,
}

/// The reference model: limit states by store key, and the attempt ledger.
#[derive(Debug, Clone)]
pub struct Model {
    states: HashMap<String, State>,
    /// Blocks by the key of the block (see [`Limit::block_for`](crate::rate::Limit::block_for)):
    /// until when (µs).
    blocks: HashMap<String, u64>,
    ledger: HashMap<u64, Entry>,
    /// How long past its decision a charged attempt is remembered.
    remembered: Duration,
}

impl Model {
    /// An empty store whose charged attempts are remembered for `remembered` past their
    /// decision (a store's deadline plus twice its timeout).
    pub fn new(remembered: Duration) -> Self {
        Self {
            states: HashMap::new(),
            blocks: HashMap::new(),
            ledger: HashMap::new(),
            remembered,
        }
    }

    /// Whether `check`'s attempt is remembered as charged at `now` (µs): a re-send of it then
    /// charges nothing. Near the end of that time a store may answer either way.
    pub fn remembers(&self, check: &RateCheck, now: u64) -> bool {
        self.ledger
            .get(&check.attempt())
            .is_some_and(|e| e.charged_until > now)
    }

    /// Forgets what `key` spent of every limit of `policy`, and its blocks, as a store's reset
    /// does; the ledger stays.
    pub fn reset(&mut self, policy: &RatePolicy, key: crate::key::Key) {
        for k in policy.reset_keys(&key) {
            self.states.remove(&k);
            self.blocks.remove(&k);
        }
    }

    /// The key of the block of each limit of `policy` for `key`, `None` for a limit without a
    /// penalty.
    fn block_keys(policy: &RatePolicy, key: crate::key::Key) -> Vec<Option<String>> {
        let block = |limit: &crate::rate::Limit| {
            limit.penalty().map(|_| {
                let mut out = String::new();
                policy.write_block_key(&mut out, &key, limit);
                out
            })
        };
        policy.limits().iter().map(block).collect()
    }

    /// The time (µs) left at `now` of the latest block of `keys` (the policy's blocks); 0 when
    /// the caller is not blocked.
    fn blocked_for(&self, keys: &[Option<String>], now: u64) -> u64 {
        keys.iter()
            .flatten()
            .filter_map(|k| self.blocks.get(k))
            .map(|until| until.saturating_sub(now))
            .max()
            .unwrap_or(0)
    }

    /// The penalties of a denied check: a caller not blocked yet is blocked, from `now`, on each
    /// limit with a penalty that denied the check (`denied`; `None`: a look, which blocks
    /// nothing); each limit that blocks it then answers 0 remaining and the time its block has
    /// left. The longest block's time left.
    fn penalize(
        &mut self,
        policy: &RatePolicy,
        keys: &[Option<String>],
        limits: &mut [LimitState],
        denied: Option<&[bool]>,
        now: u64,
    ) -> u64 {
        let blocked = self.blocked_for(keys, now) > 0;
        let mut longest = 0;
        for (i, (key, limit)) in keys.iter().zip(policy.limits()).enumerate() {
            let Some(key) = key else { continue };
            if !blocked && denied.is_some_and(|d| d[i]) {
                self.blocks.insert(key.clone(), now + limit.block_us());
            }
            let until = self.blocks.get(key).copied().unwrap_or(0);
            if until > now {
                limits[i] = LimitState {
                    remaining: 0,
                    reset: Duration::from_micros(until - now),
                };
                longest = longest.max(until - now);
            }
        }
        longest
    }

    /// Decides `check` under `policy` at store time `now` (µs), as a store must.
    pub fn decide(&mut self, policy: &RatePolicy, check: RateCheck, now: u64) -> RateOutcome {
        let check = check.bounded(policy);
        let keys = policy.store_keys(&check.key());
        // a look (cost 0) charges nothing, so it is never a re-send
        let counts = check.cost() > 0 || check.settles().is_some();
        let replay = counts && self.remembers(&check, now);
        let outcome = match check.settles() {
            Some(settled) => {
                let place = (settled.refundable && !replay)
                    .then(|| self.take_place(settled.of, now))
                    .flatten();
                let mut limits = Vec::new();
                for (i, (key, limit)) in keys.iter().zip(policy.limits()).enumerate() {
                    let (q, w) = (limit.quota(), limit.window_us());
                    let state = self.states.remove(key);
                    let refund = settled.reserved.saturating_sub(check.cost());
                    let debt = check.cost().saturating_sub(settled.reserved);
                    // a limit that counts calls counted the call: a settlement leaves it
                    let state = if replay || limit.counts_calls() {
                        state
                    } else {
                        let place = place.as_ref().map(|p| p[i]);
                        let refund = if settled.refundable { refund } else { 0 };
                        let unit = Unit {
                            of: settled.of,
                            reserved: settled.reserved,
                            by: check.attempt(),
                        };
                        settle(
                            policy.algorithm(),
                            state,
                            q,
                            w,
                            now,
                            unit,
                            refund,
                            debt,
                            place,
                        )
                    };
                    limits.push(answer(policy.algorithm(), state.as_ref(), q, w, now));
                    if let Some(state) = state {
                        self.states.insert(key.clone(), state);
                    }
                }
                if !replay {
                    self.remember(check.attempt(), now, None);
                }
                RateOutcome {
                    admitted: true,
                    retry_after: Duration::ZERO,
                    limits,
                    decided_at_us: Some(now),
                }
            }
            None => self.charge(policy, &keys, check, now, replay),
        };
        self.ledger
            .retain(|_, e| e.charged_until > now || e.place.as_ref().is_some_and(|p| p.1 > now));
        outcome
    }

    /// A check: decided on every limit, charged on all of them only if each has room.
    fn charge(
        &mut self,
        policy: &RatePolicy,
        keys: &[String],
        check: RateCheck,
        now: u64,
        mut replay: bool,
    ) -> RateOutcome {
        let cost = check.cost();
        let id = check.attempt();
        let algorithm = policy.algorithm();
        let mut states: Vec<Option<State>> = keys
            .iter()
            .zip(policy.limits())
            .map(|(k, l)| live(self.states.remove(k), l.window_us(), now))
            .collect();
        let (mut admitted, mut retry, denied) = decide(policy, &states, now, check, &mut replay);
        let blocks = Self::block_keys(policy, check.key());
        let blocked = self.blocked_for(&blocks, now);
        if replay {
            (admitted, retry) = (true, 0);
        } else if blocked > 0 {
            // blocked: denied, charging nothing, until the block ends
            (admitted, retry) = (false, retry.max(blocked));
        }
        let mut place = Vec::new();
        let mut limits = Vec::new();
        for ((state, limit), key) in states.iter_mut().zip(policy.limits()).zip(keys) {
            let (q, w) = (limit.quota(), limit.window_us());
            if admitted && !replay && cost > 0 {
                place.push(add(
                    algorithm,
                    state,
                    (q, w),
                    (now, check.hold_us()),
                    id,
                    limit.charge_of(cost),
                ));
            }
            limits.push(answer(algorithm, state.as_ref(), q, w, now));
            if let Some(state) = state.take() {
                self.states.insert(key.clone(), state);
            }
        }
        if !admitted {
            let denied = (cost > 0).then_some(&denied[..]);
            retry = retry.max(self.penalize(policy, &blocks, &mut limits, denied, now));
        }
        if admitted && cost > 0 {
            let place = (check.is_reservation() && !replay).then_some(place);
            self.remember(id, now, place.map(|p| (p, policy)));
        }
        RateOutcome {
            admitted,
            retry_after: Duration::from_micros(retry),
            limits,
            decided_at_us: Some(now),
        }
    }

    /// Remembers `id` as charged at `now`, with a reservation's place under `policy`.
    fn remember(&mut self, id: u64, now: u64, place: Option<(Vec<Place>, &RatePolicy)>) {
        let until = now + u64::try_from(self.remembered.as_micros()).unwrap_or(u64::MAX / 4);
        let entry = self.ledger.entry(id).or_default();
        entry.charged_until = entry.charged_until.max(until);
        if let Some((places, policy)) = place {
            let kept = places
                .iter()
                .zip(policy.limits())
                .map(|(p, l)| place_until(*p, l.window_us(), now))
                .max()
                .unwrap_or(now);
            entry.place = Some((places, kept));
        }
    }

    /// The place of reservation `of`, if it is still kept at `now`; dropped from the ledger.
    fn take_place(&mut self, of: u64, now: u64) -> Option<Vec<Place>> {
        let (place, until) = self.ledger.get_mut(&of)?.place.take()?;
        (until > now).then_some(place)
    }
}

/// Decides `check` on every limit of `policy` (`states`, in order) at `now`, charging nothing:
/// whether all have room, the wait, and per limit whether it denied. A log that would deny
/// holding the attempt's first unit makes it a `replay`.
fn decide(
    policy: &RatePolicy,
    states: &[Option<State>],
    now: u64,
    check: RateCheck,
    replay: &mut bool,
) -> (bool, u64, Vec<bool>) {
    let (cost, id) = (check.cost(), check.attempt());
    let (mut admitted, mut retry) = (true, 0u64);
    let mut denied = vec![false; states.len()];
    for (i, (state, limit)) in states.iter().zip(policy.limits()).enumerate() {
        if *replay {
            continue;
        }
        let (q, w, cost) = (limit.quota(), limit.window_us(), limit.charge_of(cost));
        match wait(
            policy.algorithm(),
            state.as_ref(),
            (q, w),
            (now, check.hold_us()),
            cost,
        ) {
            None => {}
            // a log that would deny holding this attempt's first unit: charged before
            Some(_) if first_unit_logged(state.as_ref(), id, cost) => *replay = true,
            Some(wait) => {
                (admitted, denied[i]) = (false, true);
                retry = retry.max(wait);
            }
        }
    }
    (admitted, retry, denied)
}

/// Until when a place is kept: a counter's until the end of the window after its own, a GCRA
/// span until it has drained (rounded as the stores round their expiries).
fn place_until(place: Place, window: u64, now: u64) -> u64 {
    match place {
        Place::Log => now,
        Place::Window { index, .. } => {
            let w = window / 1000;
            (index + 2) * w * 1000
        }
        Place::End { tat, .. } => now + ((tat - now).div_ceil(1000) + 1) * 1000,
    }
}

/// `state` if it still holds something at `now`: a log trimmed of what left the window.
fn live(state: Option<State>, window: u64, now: u64) -> Option<State> {
    match state? {
        State::Log(mut log) => {
            log.retain(|_, score| *score > now.saturating_sub(window));
            (!log.is_empty()).then_some(State::Log(log))
        }
        other => Some(other),
    }
}

/// Whether log `state` holds the first unit of attempt `id` of `cost`.
fn first_unit_logged(state: Option<&State>, id: u64, cost: u64) -> bool {
    let Some(State::Log(log)) = state else {
        return false;
    };
    cost > 0 && !log.is_empty() && log.contains_key(&name(id, cost, 1))
}

/// The member name of the `u`-th unit of an attempt of `cost`.
fn name(id: u64, cost: u64, u: u64) -> (u64, u64) {
    if cost == 1 && u == 1 {
        (id, 0)
    } else {
        (id, u)
    }
}

/// A sliding counter's window index, the time elapsed in it, its (current, previous) costs and
/// whether the state is of this window, at `now` (milliseconds, as doubles).
fn window_of(state: Option<&State>, window: u64, now: u64) -> (f64, f64, f64, f64) {
    let now_ms = (now / 1000) as f64;
    let w = window as f64 / 1000.0;
    let index = (now_ms / w).floor();
    let elapsed = now_ms - index * w;
    let (cur, prev) = match state {
        Some(State::Counter {
            index: i,
            cur,
            prev,
            ..
        }) if *i as f64 == index => (*cur as f64, *prev as f64),
        Some(State::Counter { index: i, cur, .. }) if *i as f64 == index - 1.0 => {
            (0.0, *cur as f64)
        }
        _ => (0.0, 0.0),
    };
    (index, elapsed, cur, prev)
}

/// GCRA's arrival time and remainder at `now`: the state's, or now when it has passed.
fn tat_of(state: Option<&State>, now: u64) -> (u64, u64) {
    match state {
        Some(State::Tat { tat, rem, .. }) if *tat >= now => (*tat, *rem),
        _ => (now, 0),
    }
}

/// The attempt that began the life of a counter or GCRA `state` still living at `now` (a
/// counter of this window or the one before, an arrival time not passed); `None` when a charge
/// now begins a new one.
fn born_of(state: Option<&State>, window: u64, now: u64) -> Option<u64> {
    match state? {
        State::Counter { index, born, .. } => {
            let current = ((now / 1000) as f64 / (window as f64 / 1000.0)).floor();
            (*index as f64 == current || *index as f64 == current - 1.0).then_some(*born)
        }
        State::Tat { tat, born, .. } => (*tat >= now).then_some(*born),
        State::Log(_) => None,
    }
}

/// How long a check of `cost`, its units admitted over up to `hold` µs, waits (µs) under one
/// limit, `None` when it fits now.
fn wait(
    algorithm: Algorithm,
    state: Option<&State>,
    (q, w): (u64, u64),
    (now, hold): (u64, u64),
    cost: u64,
) -> Option<u64> {
    match algorithm {
        Algorithm::SlidingLog => {
            let log = match state {
                Some(State::Log(log)) => log.values().copied().collect::<Vec<_>>(),
                _ => Vec::new(),
            };
            let count = log.len() as u64;
            if count + cost <= q {
                return None;
            }
            if cost > q {
                return Some(w);
            }
            let mut scores = log;
            scores.sort_unstable();
            let idx = (count + cost - q - 1) as usize;
            Some(scores[idx] + w - now)
        }
        Algorithm::SlidingCounter => {
            let (_, elapsed, cur, prev) = window_of(state, w, now);
            let (quota, window, costf) = (q as f64, w as f64 / 1000.0, cost as f64);
            if (cur + costf) * window + prev * (window - elapsed) <= quota * window {
                return None;
            }
            let room = quota - costf - cur;
            let wait = if costf > quota {
                window
            } else if room >= 0.0 {
                (window - elapsed) - room * window / prev
            } else {
                (window - elapsed) + window - (quota - costf) * window / cur
            };
            Some(ceil_us(wait * 1000.0))
        }
        Algorithm::Gcra => {
            if cost > q {
                return Some(w);
            }
            let (tat, rem) = tat_of(state, now + if cost > 0 { hold } else { 0 });
            let (q, w) = (u128::from(q), u128::from(w));
            let ahead = u128::from(tat - now) * q + u128::from(rem) + u128::from(cost) * w;
            let over = ahead.checked_sub(w * q).filter(|over| *over > 0)?;
            Some(u64::try_from(over.div_ceil(q)).unwrap_or(u64::MAX))
        }
    }
}

fn ceil_us(x: f64) -> u64 {
    if x > 0.0 { x.ceil() as u64 } else { 0 }
}

/// Charges `cost` of attempt `id` to one limit at `now`; where it went.
fn add(
    algorithm: Algorithm,
    state: &mut Option<State>,
    (q, w): (u64, u64),
    (now, hold): (u64, u64),
    id: u64,
    cost: u64,
) -> Place {
    match algorithm {
        Algorithm::SlidingLog => {
            let mut log = match state.take() {
                Some(State::Log(log)) => log,
                _ => BTreeMap::new(),
            };
            // units a copy may admit until `now + hold` are dated then
            for u in 1..=cost {
                log.entry(name(id, cost, u)).or_insert(now + hold);
            }
            *state = Some(State::Log(log));
            Place::Log
        }
        Algorithm::SlidingCounter => {
            let (index, _, cur, prev) = window_of(state.as_ref(), w, now);
            let index = index as u64;
            let born = born_of(state.as_ref(), w, now).unwrap_or(id);
            *state = Some(State::Counter {
                index,
                cur: cur as u64 + cost,
                prev: prev as u64,
                born,
            });
            Place::Window { index, born }
        }
        Algorithm::Gcra => {
            // units a copy may admit until `now + hold` are charged from then at the earliest
            let (tat, rem) = tat_of(state.as_ref(), now + hold);
            let units = u128::from(rem) + u128::from(cost) * u128::from(w);
            let tat = tat + u64::try_from(units / u128::from(q)).unwrap_or(u64::MAX / 4);
            let rem = u64::try_from(units % u128::from(q)).unwrap_or(0);
            let born = born_of(state.as_ref(), w, now).unwrap_or(id);
            *state = Some(State::Tat { tat, rem, born });
            Place::End { tat, rem, born }
        }
    }
}

/// The units a settlement names: those of the settled attempt `of`, which charged `reserved`;
/// `by`, the settlement's own attempt.
#[derive(Debug, Clone, Copy)]
struct Unit {
    of: u64,
    reserved: u64,
    by: u64,
}

/// Applies a settlement to one limit at `now`: `debt` added now, or `refund` returned from
/// where the reservation's charge went (`place`), only what the limit still counts.
#[allow(clippy::too_many_arguments)]
fn settle(
    algorithm: Algorithm,
    state: Option<State>,
    q: u64,
    w: u64,
    now: u64,
    unit: Unit,
    refund: u64,
    debt: u64,
    place: Option<Place>,
) -> Option<State> {
    let state = live(state, w, now);
    match algorithm {
        Algorithm::SlidingLog => settle_log(state, q, now, unit, refund, debt),
        Algorithm::SlidingCounter => {
            settle_counter(state, (q, w), now, unit, (refund, debt), place)
        }
        Algorithm::Gcra => settle_gcra(state, (q, w), now, unit, (refund, debt), place),
    }
}

/// A settlement on a log: the debt's units added after the reserved ones, the refunded units
/// removed.
fn settle_log(
    state: Option<State>,
    q: u64,
    now: u64,
    unit: Unit,
    refund: u64,
    debt: u64,
) -> Option<State> {
    let mut log = match state {
        Some(State::Log(log)) => log,
        _ => BTreeMap::new(),
    };
    if debt > 0 {
        let room = (2 * q).saturating_sub(log.len() as u64);
        let last = unit.reserved + debt.min(room);
        for u in unit.reserved + 1..=last {
            log.entry(name(unit.of, unit.reserved, u)).or_insert(now);
        }
    }
    let actual = unit.reserved - refund;
    for u in actual + 1..=unit.reserved {
        if refund > 0 {
            log.remove(&name(unit.of, unit.reserved, u));
        }
    }
    (!log.is_empty()).then_some(State::Log(log))
}

/// A settlement on a sliding counter: the debt goes to this window (a state begun by it is
/// born of the settlement), a refund comes out of the window the reservation went to, while
/// that still counts and the state is the one it charged.
fn settle_counter(
    state: Option<State>,
    (q, w): (u64, u64),
    now: u64,
    unit: Unit,
    (refund, debt): (u64, u64),
    place: Option<Place>,
) -> Option<State> {
    let (index, _, cur, prev) = window_of(state.as_ref(), w, now);
    let (mut cur, mut prev) = (cur as u64, prev as u64);
    let life = born_of(state.as_ref(), w, now);
    if debt > 0 {
        cur = (cur + debt).min(cur.max(2 * q));
    } else if refund > 0 {
        match place {
            Some(Place::Window { index: p, born }) if life == Some(born) => {
                if p as f64 == index {
                    cur -= refund.min(cur);
                } else if p as f64 == index - 1.0 {
                    prev -= refund.min(prev);
                } else {
                    return state;
                }
            }
            _ => return state,
        }
    } else {
        return state;
    }
    Some(State::Counter {
        index: index as u64,
        cur,
        prev,
        born: life.unwrap_or(unit.by),
    })
}

/// A settlement on GCRA: the debt moves the arrival time on (a state begun by it is born of the
/// settlement), a refund back by what of the reservation's span is still ahead, while the state
/// is the one it charged.
fn settle_gcra(
    state: Option<State>,
    (q, w): (u64, u64),
    now: u64,
    unit: Unit,
    (refund, debt): (u64, u64),
    place: Option<Place>,
) -> Option<State> {
    let (tat, rem) = tat_of(state.as_ref(), now);
    let life = born_of(state.as_ref(), w, now);
    let (q, w) = (u128::from(q), u128::from(w));
    let mut ahead = u128::from(tat - now) * q + u128::from(rem);
    if debt > 0 {
        ahead = (ahead + u128::from(debt) * w).min(ahead.max(2 * w * q));
    } else if refund > 0 {
        let Some(Place::End {
            tat: end,
            rem: end_rem,
            born,
        }) = place
        else {
            return state;
        };
        if life != Some(born) {
            return state;
        }
        let left = (u128::from(end) * q + u128::from(end_rem)).saturating_sub(u128::from(now) * q);
        ahead -= (u128::from(refund) * w).min(left).min(ahead);
    } else {
        return state;
    }
    let tat = now + u64::try_from(ahead / q).unwrap_or(u64::MAX / 4);
    let rem = u64::try_from(ahead % q).unwrap_or(0);
    let born = life.unwrap_or(unit.by);
    Some(State::Tat { tat, rem, born })
}

/// One limit's remaining quota and reset at `now`, as the stores answer them.
fn answer(algorithm: Algorithm, state: Option<&State>, q: u64, w: u64, now: u64) -> LimitState {
    let (remaining, reset) = match algorithm {
        Algorithm::SlidingLog => {
            let scores: Vec<u64> = match state {
                Some(State::Log(log)) => log
                    .values()
                    .copied()
                    .filter(|s| *s > now.saturating_sub(w))
                    .collect(),
                _ => Vec::new(),
            };
            let reset = scores.iter().min().map_or(0, |oldest| oldest + w - now);
            (q.saturating_sub(scores.len() as u64), reset)
        }
        Algorithm::SlidingCounter => {
            let (_, elapsed, cur, prev) = window_of(state, w, now);
            let (quota, window) = (q as f64, w as f64 / 1000.0);
            let used = cur + prev * (window - elapsed) / window;
            let whole = (used - 1e-9).ceil();
            let reset = if whole <= 0.0 {
                0.0
            } else if prev > 0.0 && whole - 1.0 - cur >= 0.0 {
                (window - elapsed) - (whole - 1.0 - cur) * window / prev
            } else {
                (window - elapsed) + window - (whole - 1.0) * window / cur
            };
            ((quota - whole).max(0.0) as u64, ceil_us(reset * 1000.0))
        }
        Algorithm::Gcra => {
            let (tat, rem) = tat_of(state, now);
            let (q, w) = (u128::from(q), u128::from(w));
            let ahead = u128::from(tat - now) * q + u128::from(rem);
            let used = ahead.div_ceil(w);
            let reset = if used > 0 {
                (ahead - (used - 1) * w).div_ceil(q)
            } else {
                0
            };
            (
                u64::try_from(q.saturating_sub(used)).unwrap_or(0),
                u64::try_from(reset).unwrap_or(u64::MAX),
            )
        }
    };
    LimitState {
        remaining,
        reset: Duration::from_micros(reset),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::key::Key;
    use crate::rate::Limit;

    const S: u64 = 1_000_000;

    fn policy(algorithm: Algorithm) -> RatePolicy {
        RatePolicy::new("m:rl", algorithm, vec![Limit::per_second("s", 10)]).unwrap()
    }

    /// Issue scenario 1: a refund made after the charge left the window returns nothing.
    #[test]
    fn a_late_refund_returns_nothing_others_spent() {
        for algorithm in [
            Algorithm::SlidingLog,
            Algorithm::SlidingCounter,
            Algorithm::Gcra,
        ] {
            let p = policy(algorithm);
            let mut m = Model::new(Duration::from_secs(3));
            let key = Key::new("t", b"k");
            let t0 = 1_000 * S;
            let a = RateCheck::reservation(key, 10);
            assert!(m.decide(&p, a, t0).admitted);
            let t1 = t0 + 2_150_000;
            assert!(
                m.decide(&p, RateCheck::new(key, 10), t1).admitted,
                "{algorithm}"
            );
            let settled = m.decide(&p, a.settle(0), t1 + 1_000);
            assert_eq!(settled.limits[0].remaining, 0, "{algorithm}");
            assert!(
                !m.decide(&p, RateCheck::new(key, 10), t1 + 2_000).admitted,
                "{algorithm}"
            );
        }
    }

    /// A reset ends the state a reservation charged: its settlement refunds nothing of what was
    /// charged since, on every algorithm.
    #[test]
    fn a_refund_after_a_reset_returns_nothing_others_spent() {
        for algorithm in [
            Algorithm::SlidingLog,
            Algorithm::SlidingCounter,
            Algorithm::Gcra,
        ] {
            let p = policy(algorithm);
            let mut m = Model::new(Duration::from_secs(3));
            let key = Key::new("t", b"k");
            let t0 = 1_000 * S + 100_000;
            let a = RateCheck::reservation(key, 8);
            assert!(m.decide(&p, a, t0).admitted);
            m.reset(&p, key);
            let b = m.decide(&p, RateCheck::new(key, 5), t0 + 1_000);
            assert_eq!(b.limits[0].remaining, 5, "{algorithm}");
            let settled = m.decide(&p, a.settle(0), t0 + 2_000);
            assert_eq!(
                settled.limits[0].remaining, 5,
                "{algorithm}: B's 5 stay charged"
            );
        }
    }

    /// A counter refund made in the next window comes out of the previous one.
    #[test]
    fn a_counter_refund_in_the_next_window_comes_out_of_the_previous_one() {
        let p = policy(Algorithm::SlidingCounter);
        let mut m = Model::new(Duration::from_secs(3));
        let key = Key::new("t", b"k");
        let a = RateCheck::reservation(key, 6);
        assert!(m.decide(&p, a, 1_000 * S + 900_000).admitted);
        // next window, 500 ms in: B spends 4 (6 * 0.5 = 3 of the previous still counted)
        let b = m.decide(&p, RateCheck::new(key, 4), 1_001 * S + 500_000);
        assert_eq!(b.limits[0].remaining, 3);
        let settled = m.decide(&p, a.settle(0), 1_001 * S + 500_000);
        assert_eq!(settled.limits[0].remaining, 6, "B's 4 stay charged");
    }
}
