//! [`MemoryStore`]: the store semantics inside one process.

use std::collections::{HashMap, VecDeque};
use std::future;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use tokio::time::Instant;

use super::{ClaimOutcome, FENCE_TTL, IdemBegin, LockAttempt, Store, StoreFuture, millis};
use crate::key::Key;
use crate::rate_limit::{Algorithm, LimitState, RateOutcome, RatePolicy};

/// A store inside one process, with the same semantics as [`RedisStore`](super::RedisStore).
///
/// It serves tests, documentation and a service that runs as a single copy. Limits, claims and
/// locks held here are **not** seen by other processes: run several copies on a `MemoryStore`
/// each and every copy admits the full limit. Time is tokio's clock, so `tokio::time::pause` and
/// `advance` move its windows in tests. Expired entries are swept as the store is used.
///
/// ```
/// # #[tokio::main(flavor = "current_thread")] async fn main() {
/// use std::sync::Arc;
/// use tollgate::key::Key;
/// use tollgate::rate_limit::{Algorithm, Limit, RatePolicy};
/// use tollgate::store::{MemoryStore, Store};
///
/// let store = MemoryStore::new();
/// let policy = Arc::new(RatePolicy::new("demo", Algorithm::SlidingLog, vec![Limit::per_second("s", 2)]).unwrap());
/// let key = Key::new("user", b"alice");
/// assert!(store.check_rate(&policy, key, 1).await.unwrap().admitted);
/// assert!(store.check_rate(&policy, key, 1).await.unwrap().admitted);
/// assert!(!store.check_rate(&policy, key, 1).await.unwrap().admitted);
/// # }
/// ```
#[derive(Debug, Clone)]
pub struct MemoryStore {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    started: Instant,
    started_us: u64,
    map: Mutex<Map>,
}

#[derive(Debug, Default)]
struct Map {
    entries: HashMap<String, Entry>,
    ops_since_sweep: u32,
}

#[derive(Debug)]
struct Entry {
    value: Value,
    /// Store time in microseconds after which the entry is gone.
    expires_at: u64,
}

#[derive(Debug)]
enum Value {
    /// Scores of a sliding log, ascending.
    Log(VecDeque<u64>),
    /// A sliding counter: window index, current and previous window's cost.
    Counter { index: u64, cur: u64, prev: u64 },
    /// A GCRA theoretical arrival time: whole microseconds plus `rem` / quota of one.
    Tat { tat: u64, rem: u64 },
    /// A claim's holder or a lock's token.
    Str(String),
    /// A fencing counter.
    Fence(u64),
    /// An idempotency record.
    Idem(IdemRecord),
}

#[derive(Debug)]
struct IdemRecord {
    fingerprint: String,
    /// The owner's token while running.
    token: Option<String>,
    response: Option<Bytes>,
}

const SWEEP_EVERY: u32 = 4096;

impl Default for MemoryStore {
    fn default() -> Self {
        Self::new()
    }
}

impl MemoryStore {
    /// An empty store.
    pub fn new() -> Self {
        let started_us = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| u64::try_from(d.as_micros()).unwrap_or(u64::MAX / 2));
        Self {
            inner: Arc::new(Inner {
                started: Instant::now(),
                started_us,
                map: Mutex::new(Map::default()),
            }),
        }
    }

    /// The number of live entries (for tests of expiry).
    pub fn len(&self) -> usize {
        let now = self.now_us();
        self.lock()
            .entries
            .values()
            .filter(|e| e.expires_at > now)
            .count()
    }

    /// Whether the store holds no live entry.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Store time: wall clock at creation plus tokio's monotonic clock since.
    fn now_us(&self) -> u64 {
        let elapsed = u64::try_from(self.inner.started.elapsed().as_micros()).unwrap_or(0);
        self.inner.started_us.saturating_add(elapsed)
    }

    fn lock(&self) -> MutexGuard<'_, Map> {
        // A panic while holding the lock cannot leave an entry half-written (every update is a
        // single assignment), so a poisoned map is still consistent.
        self.inner.map.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(crate) fn check_rate_now(&self, policy: &RatePolicy, key: Key, cost: u64) -> RateOutcome {
        let now = self.now_us();
        let keys = policy.store_keys(&key);
        let mut map = self.lock();
        map.sweep_if_due(now);
        match policy.algorithm {
            Algorithm::SlidingLog => sliding_log(&mut map, now, &keys, policy, cost),
            Algorithm::SlidingCounter => sliding_counter(&mut map, now, &keys, policy, cost),
            Algorithm::Gcra => gcra(&mut map, now, &keys, policy, cost),
        }
    }
}

impl Map {
    fn sweep_if_due(&mut self, now: u64) {
        self.ops_since_sweep += 1;
        if self.ops_since_sweep >= SWEEP_EVERY {
            self.ops_since_sweep = 0;
            self.entries.retain(|_, e| e.expires_at > now);
        }
    }

    fn live(&mut self, key: &str, now: u64) -> Option<&mut Value> {
        match self.entries.get_mut(key) {
            Some(e) if e.expires_at > now => Some(&mut e.value),
            _ => None,
        }
    }

    fn put(&mut self, key: &str, value: Value, expires_at: u64) {
        self.entries
            .insert(key.to_owned(), Entry { value, expires_at });
    }
}

/// `now` plus `d` in microseconds, as the store counts expiry: whole milliseconds, at least one.
fn expiry(now: u64, d: Duration) -> u64 {
    now.saturating_add(millis(d).saturating_mul(1000))
}

fn ceil_us(x: f64) -> u64 {
    if x > 0.0 { x.ceil() as u64 } else { 0 }
}

fn outcome(admitted: bool, retry_us: u64, limits: Vec<LimitState>) -> RateOutcome {
    RateOutcome {
        admitted,
        retry_after: std::time::Duration::from_micros(retry_us),
        limits,
    }
}

fn state(remaining: u64, reset_us: u64) -> LimitState {
    LimitState {
        remaining,
        reset: std::time::Duration::from_micros(reset_us),
    }
}

/// Mirrors `scripts/sliding_log.lua`.
fn sliding_log(
    map: &mut Map,
    now: u64,
    keys: &[String],
    policy: &RatePolicy,
    cost: u64,
) -> RateOutcome {
    let mut logs: Vec<VecDeque<u64>> = Vec::with_capacity(keys.len());
    let mut admitted = true;
    let mut retry = 0u64;
    for (key, limit) in keys.iter().zip(&policy.limits) {
        let window = limit.window_us();
        let mut log = match map.live(key, now) {
            Some(Value::Log(log)) => std::mem::take(log),
            _ => VecDeque::new(),
        };
        let horizon = now.saturating_sub(window);
        while log.front().is_some_and(|&s| s <= horizon) {
            log.pop_front();
        }
        let count = log.len() as u64;
        if count.saturating_add(cost) > limit.quota() {
            admitted = false;
            let wait = if cost <= limit.quota() {
                let idx = (count + cost - limit.quota() - 1) as usize;
                log[idx] + window - now
            } else {
                window
            };
            retry = retry.max(wait);
        }
        logs.push(log);
    }
    let mut limits = Vec::with_capacity(keys.len());
    for ((key, limit), mut log) in keys.iter().zip(&policy.limits).zip(logs) {
        let window = limit.window_us();
        if admitted {
            // admitted: count + cost <= quota, so cost is small
            log.extend(std::iter::repeat_n(now, usize::try_from(cost).unwrap_or(0)));
        }
        let reset = log.front().map_or(0, |&oldest| oldest + window - now);
        limits.push(state(limit.quota().saturating_sub(log.len() as u64), reset));
        if log.is_empty() {
            map.entries.remove(key);
        } else if admitted {
            map.put(key, Value::Log(log), now + window.div_ceil(1000) * 1000);
        } else if let Some(Value::Log(slot)) = map.live(key, now) {
            *slot = log;
        }
    }
    outcome(admitted, retry, limits)
}

/// Mirrors `scripts/sliding_counter.lua` (milliseconds of store time).
fn sliding_counter(
    map: &mut Map,
    now_us: u64,
    keys: &[String],
    policy: &RatePolicy,
    cost: u64,
) -> RateOutcome {
    let now = (now_us / 1000) as f64;
    let costf = cost as f64;
    let mut states = Vec::with_capacity(keys.len());
    let mut admitted = true;
    let mut retry = 0f64;
    for (key, limit) in keys.iter().zip(&policy.limits) {
        let quota = limit.quota() as f64;
        let window = limit.window_us() as f64 / 1000.0;
        let index = (now / window).floor();
        let elapsed = now - index * window;
        let (cur, prev) = match map.live(key, now_us) {
            Some(&mut Value::Counter {
                index: i,
                cur,
                prev,
            }) if i as f64 == index => (cur as f64, prev as f64),
            Some(&mut Value::Counter { index: i, cur, .. }) if i as f64 == index - 1.0 => {
                (0.0, cur as f64)
            }
            _ => (0.0, 0.0),
        };
        if (cur + costf) * window + prev * (window - elapsed) > quota * window {
            admitted = false;
            let room = quota - costf - cur;
            let wait = if costf > quota {
                window
            } else if room >= 0.0 {
                (window - elapsed) - room * window / prev
            } else {
                (window - elapsed) + window - (quota - costf) * window / cur
            };
            retry = retry.max(wait);
        }
        states.push((quota, window, index, elapsed, cur, prev));
    }
    let mut limits = Vec::with_capacity(keys.len());
    for (key, (quota, window, index, elapsed, mut cur, prev)) in keys.iter().zip(states) {
        if admitted {
            cur += costf;
            let ttl_ms = (2.0 * window - elapsed).ceil();
            map.put(
                key,
                Value::Counter {
                    index: index as u64,
                    cur: cur as u64,
                    prev: prev as u64,
                },
                now_us - now_us % 1000 + ttl_ms as u64 * 1000,
            );
        }
        let used = cur + prev * (window - elapsed) / window;
        let whole = (used - 1e-9).ceil();
        let remaining = (quota - whole).max(0.0);
        let reset = if whole <= 0.0 {
            0.0
        } else if prev > 0.0 && whole - 1.0 - cur >= 0.0 {
            (window - elapsed) - (whole - 1.0 - cur) * window / prev
        } else {
            window - elapsed
        };
        limits.push(state(remaining as u64, ceil_us(reset * 1000.0)));
    }
    outcome(admitted, ceil_us(retry * 1000.0), limits)
}

/// Mirrors `scripts/gcra.lua`: offsets from now in 1/quota microseconds, exact in integers.
fn gcra(map: &mut Map, now: u64, keys: &[String], policy: &RatePolicy, cost: u64) -> RateOutcome {
    let mut states = Vec::with_capacity(keys.len());
    let mut admitted = true;
    let mut retry = 0u64;
    for (key, limit) in keys.iter().zip(&policy.limits) {
        let (quota, window) = (u128::from(limit.quota()), u128::from(limit.window_us()));
        let (tat, rem) = match map.live(key, now) {
            Some(&mut Value::Tat { tat, rem }) if tat >= now => (tat, rem),
            _ => (now, 0),
        };
        states.push((tat, rem));
        if cost > limit.quota() {
            admitted = false;
            retry = retry.max(limit.window_us());
            continue;
        }
        let ahead = u128::from(tat - now) * quota + u128::from(rem) + u128::from(cost) * window;
        if ahead > window * quota {
            admitted = false;
            let wait = (ahead - window * quota).div_ceil(quota);
            retry = retry.max(u64::try_from(wait).unwrap_or(u64::MAX));
        }
    }
    let mut limits = Vec::with_capacity(keys.len());
    for ((key, limit), (mut tat, mut rem)) in keys.iter().zip(&policy.limits).zip(states) {
        let (quota, window) = (u128::from(limit.quota()), u128::from(limit.window_us()));
        if admitted {
            let units = u128::from(rem) + u128::from(cost) * window;
            tat += u64::try_from(units / quota).unwrap_or(u64::MAX / 2);
            rem = u64::try_from(units % quota).unwrap_or(0);
            let ttl_ms = (tat - now).div_ceil(1000) + 1;
            map.put(
                key,
                Value::Tat { tat, rem },
                now.saturating_add(ttl_ms * 1000),
            );
        }
        let ahead = u128::from(tat - now) * quota + u128::from(rem);
        let used = ahead.div_ceil(window);
        let remaining = quota.saturating_sub(used);
        let reset = if used > 0 {
            (ahead - (used - 1) * window).div_ceil(quota)
        } else {
            0
        };
        limits.push(state(
            u64::try_from(remaining).unwrap_or(0),
            u64::try_from(reset).unwrap_or(u64::MAX),
        ));
    }
    outcome(admitted, retry, limits)
}

impl Store for MemoryStore {
    fn check_rate(
        &self,
        policy: &Arc<RatePolicy>,
        key: Key,
        cost: u64,
    ) -> StoreFuture<RateOutcome> {
        Box::pin(future::ready(Ok(self.check_rate_now(policy, key, cost))))
    }

    fn claim(
        &self,
        key: String,
        holder: String,
        ttl: Option<Duration>,
    ) -> StoreFuture<ClaimOutcome> {
        let now = self.now_us();
        let mut map = self.lock();
        map.sweep_if_due(now);
        let outcome = match map.live(&key, now) {
            Some(Value::Str(current)) => ClaimOutcome {
                won: false,
                holder: current.clone(),
            },
            Some(_) => ClaimOutcome {
                won: false,
                holder: String::new(),
            },
            None => {
                let expires_at = ttl.map_or(u64::MAX, |ttl| expiry(now, ttl));
                map.put(&key, Value::Str(holder.clone()), expires_at);
                ClaimOutcome { won: true, holder }
            }
        };
        Box::pin(future::ready(Ok(outcome)))
    }

    fn lock_acquire(
        &self,
        key: String,
        fence_key: String,
        token: String,
        lease: Duration,
    ) -> StoreFuture<LockAttempt> {
        let now = self.now_us();
        let mut map = self.lock();
        map.sweep_if_due(now);
        let attempt = if map.live(&key, now).is_some() {
            let expires_at = map.entries.get(&key).map_or(now, |e| e.expires_at);
            LockAttempt::Held {
                lease_left: Duration::from_millis((expires_at - now) / 1000),
            }
        } else {
            map.put(&key, Value::Str(token), expiry(now, lease));
            let fence = match map.live(&fence_key, now) {
                Some(Value::Fence(last)) => *last + 1,
                _ => now,
            };
            map.put(&fence_key, Value::Fence(fence), expiry(now, FENCE_TTL));
            LockAttempt::Acquired { fence }
        };
        Box::pin(future::ready(Ok(attempt)))
    }

    fn extend_if_held(&self, key: String, token: String, lease: Duration) -> StoreFuture<bool> {
        let now = self.now_us();
        let mut map = self.lock();
        let held = matches!(map.live(&key, now), Some(Value::Str(t)) if *t == token);
        if held && let Some(entry) = map.entries.get_mut(&key) {
            entry.expires_at = expiry(now, lease);
        }
        Box::pin(future::ready(Ok(held)))
    }

    fn delete_if_held(&self, key: String, token: String) -> StoreFuture<bool> {
        let now = self.now_us();
        let mut map = self.lock();
        let held = matches!(map.live(&key, now), Some(Value::Str(t)) if *t == token);
        if held {
            map.entries.remove(&key);
        }
        Box::pin(future::ready(Ok(held)))
    }

    fn idem_begin(
        &self,
        key: String,
        fingerprint: String,
        token: String,
        lease: Duration,
    ) -> StoreFuture<IdemBegin> {
        let now = self.now_us();
        let mut map = self.lock();
        map.sweep_if_due(now);
        let expires_at = map.entries.get(&key).map_or(now, |e| e.expires_at);
        let begin = match map.live(&key, now) {
            None => {
                let record = IdemRecord {
                    fingerprint,
                    token: Some(token),
                    response: None,
                };
                map.put(&key, Value::Idem(record), expiry(now, lease));
                IdemBegin::Claimed
            }
            Some(Value::Idem(record)) if record.fingerprint != fingerprint => IdemBegin::Mismatch,
            Some(Value::Idem(IdemRecord {
                response: Some(response),
                ..
            })) => IdemBegin::Completed(response.clone()),
            Some(_) => IdemBegin::InFlight {
                lease_left: Duration::from_millis((expires_at - now) / 1000),
            },
        };
        Box::pin(future::ready(Ok(begin)))
    }

    fn idem_complete(
        &self,
        key: String,
        token: String,
        response: Bytes,
        retention: Duration,
    ) -> StoreFuture<bool> {
        let now = self.now_us();
        let mut map = self.lock();
        let stored = match map.live(&key, now) {
            Some(Value::Idem(record)) if record.token.as_deref() == Some(token.as_str()) => {
                record.token = None;
                record.response = Some(response);
                true
            }
            _ => false,
        };
        if stored && let Some(entry) = map.entries.get_mut(&key) {
            entry.expires_at = expiry(now, retention);
        }
        Box::pin(future::ready(Ok(stored)))
    }

    fn idem_release(&self, key: String, token: String) -> StoreFuture<bool> {
        let now = self.now_us();
        let mut map = self.lock();
        let owned = matches!(map.live(&key, now), Some(Value::Idem(r)) if r.token.as_deref() == Some(token.as_str()));
        if owned {
            map.entries.remove(&key);
        }
        Box::pin(future::ready(Ok(owned)))
    }

    fn idem_extend(&self, key: String, token: String, lease: Duration) -> StoreFuture<bool> {
        let now = self.now_us();
        let mut map = self.lock();
        let owned = matches!(map.live(&key, now), Some(Value::Idem(r)) if r.token.as_deref() == Some(token.as_str()));
        if owned && let Some(entry) = map.entries.get_mut(&key) {
            entry.expires_at = expiry(now, lease);
        }
        Box::pin(future::ready(Ok(owned)))
    }

    fn ping(&self) -> StoreFuture<()> {
        Box::pin(future::ready(Ok(())))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rate_limit::Limit;

    /// With the clock frozen, a burst admits exactly the quota, also when the emission interval
    /// is not a whole number of microseconds (or under one).
    #[tokio::test(start_paused = true)]
    async fn gcra_bursts_are_exact_with_fractional_intervals() {
        let store = MemoryStore::new();
        for quota in [3, 7, 3_000, 30_001, 300_007] {
            let policy = RatePolicy::new(
                "t:rl",
                Algorithm::Gcra,
                vec![Limit::new(
                    format!("q{quota}"),
                    quota,
                    std::time::Duration::from_secs(1),
                )],
            )
            .unwrap();
            let key = Key::new("t", b"burst");
            let mut admitted = 0u64;
            for _ in 0..quota + quota / 100 + 5 {
                admitted += u64::from(store.check_rate_now(&policy, key, 1).admitted);
            }
            assert_eq!(admitted, quota, "quota {quota}");
            // and a cost that fits the quota exactly, on a fresh key
            let fresh = Key::new("t", b"whole");
            assert!(store.check_rate_now(&policy, fresh, quota).admitted);
            assert!(!store.check_rate_now(&policy, fresh, 1).admitted);
        }
    }

    #[tokio::test(start_paused = true)]
    async fn huge_costs_and_durations_neither_panic_nor_wrap() {
        let store = MemoryStore::new();
        for algorithm in [
            Algorithm::SlidingLog,
            Algorithm::SlidingCounter,
            Algorithm::Gcra,
        ] {
            let policy =
                RatePolicy::new("t:rl", algorithm, vec![Limit::per_second("s", 5)]).unwrap();
            let out = store.check_rate_now(&policy, Key::new("t", b"k"), u64::MAX);
            assert!(!out.admitted, "{algorithm}");
        }
        let won = store
            .claim("c".into(), "a".into(), Some(std::time::Duration::MAX))
            .await
            .unwrap();
        assert!(won.won);
        let lost = store.claim("c".into(), "b".into(), None).await.unwrap();
        assert!(
            !lost.won,
            "a claim for Duration::MAX is kept, not expired at once"
        );
    }
}
