//! [`MemoryStore`]: the store semantics inside one process.

use std::collections::HashMap;
use std::future;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use bytes::Bytes;

use super::{
    ClaimOutcome, IdempotencyBegin, IdempotencyStore, LockAttempt, LockStore, RateStore, Store,
    StoreFuture, fence_ttl, millis,
};
use crate::rate::{Clock, LocalRates, RateCheck, RateOutcome, RatePolicy};

/// A store inside one process, with the same semantics as `RedisStore`.
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
/// use tollgate::rate::{Algorithm, Limit, RateCheck, RatePolicy};
/// use tollgate::store::{MemoryStore, RateStore};
///
/// let store = MemoryStore::new();
/// let policy = Arc::new(RatePolicy::new("demo", Algorithm::SlidingLog, vec![Limit::per_second("s", 2)]).unwrap());
/// let alice = Key::new("user", b"alice");
/// let first = RateCheck::new(alice, 1);
/// assert!(store.check_rate(&policy, first).await.unwrap().admitted);
/// // the same attempt again (a retry after a lost reply) is not charged twice
/// assert_eq!(store.check_rate(&policy, first).await.unwrap().limits[0].remaining, 1);
/// assert!(store.check_rate(&policy, RateCheck::new(alice, 1)).await.unwrap().admitted);
/// assert!(!store.check_rate(&policy, RateCheck::new(alice, 1)).await.unwrap().admitted);
/// # }
/// ```
#[derive(Debug, Clone)]
pub struct MemoryStore {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    clock: Clock,
    rates: LocalRates,
    map: Mutex<Map>,
}

/// Claims, locks, fencing counters and idempotency records.
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
    /// The owner's token, kept once done (so that a second completion is recognised).
    token: String,
    /// The response, once done.
    response: Option<Bytes>,
}

impl Value {
    /// Whether this is a claim or lock held by `token`.
    fn held_by(&self, token: &str) -> bool {
        matches!(self, Self::Str(t) if t == token)
    }

    /// Whether this is an idempotency record whose running claim `token` owns.
    fn owned_by(&self, token: &str) -> bool {
        matches!(self, Self::Idem(r) if r.token == token && r.response.is_none())
    }
}

/// What a token-checked operation does to an entry its token matches.
#[derive(Debug, Clone, Copy)]
enum OnMatch {
    /// Delete it.
    Release,
    Expire(Duration),
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
        let clock = Clock::new();
        Self {
            inner: Arc::new(Inner {
                clock,
                rates: LocalRates::new(clock),
                map: Mutex::new(Map::default()),
            }),
        }
    }

    /// The number of live entries (for tests of expiry).
    pub fn len(&self) -> usize {
        let now = self.now_us();
        let others = self
            .lock()
            .entries
            .values()
            .filter(|e| e.expires_at > now)
            .count();
        others + self.inner.rates.len()
    }

    /// Whether the store holds no live entry.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn now_us(&self) -> u64 {
        self.inner.clock.now_us()
    }

    fn lock(&self) -> MutexGuard<'_, Map> {
        // A panic while holding the lock cannot leave an entry half-written (every update is a
        // single assignment), so a poisoned map is still consistent.
        self.inner.map.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Applies `on_match` to `key` only if `matches` its live value; whether it did. (Nothing
    /// here is ever re-sent, so a release needs no marker.)
    fn token_checked(
        &self,
        key: &str,
        matches: impl FnOnce(&Value) -> bool,
        on_match: OnMatch,
    ) -> StoreFuture<bool> {
        let now = self.now_us();
        let mut map = self.lock();
        let held = map.live(key, now).is_some_and(|v| matches(v));
        if held {
            match on_match {
                OnMatch::Release => {
                    map.entries.remove(key);
                }
                OnMatch::Expire(lease) => map.expire(key, expiry(now, lease)),
            }
        }
        ready(held)
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

    /// The time a live entry has left, in whole milliseconds.
    fn left(&self, key: &str, now: u64) -> Duration {
        let expires_at = self.entries.get(key).map_or(now, |e| e.expires_at);
        Duration::from_millis(expires_at.saturating_sub(now) / 1000)
    }

    fn expire(&mut self, key: &str, expires_at: u64) {
        if let Some(entry) = self.entries.get_mut(key) {
            entry.expires_at = expires_at;
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

fn ready<T: Send + 'static>(value: T) -> StoreFuture<T> {
    Box::pin(future::ready(Ok(value)))
}

impl RateStore for MemoryStore {
    fn check_rate(&self, policy: &Arc<RatePolicy>, check: RateCheck) -> StoreFuture<RateOutcome> {
        ready(self.inner.rates.check(policy, check))
    }
}

impl LockStore for MemoryStore {
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
                won: *current == holder,
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
        ready(outcome)
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
        let fence_expiry = expiry(now, fence_ttl(lease));
        let drawn = match map.live(&fence_key, now) {
            Some(Value::Fence(last)) => Some(*last),
            _ => None,
        };
        let attempt = match map.live(&key, now) {
            // the same attempt again: acquired already, with the fence it drew
            Some(v) if v.held_by(&token) && drawn.is_some() => {
                let fence = drawn.unwrap_or(now);
                map.expire(&key, expiry(now, lease));
                LockAttempt::Acquired { fence }
            }
            Some(v) if !v.held_by(&token) => LockAttempt::Held {
                lease_left: map.left(&key, now),
            },
            _ => {
                map.put(&key, Value::Str(token), expiry(now, lease));
                // above both the last token and the store time: a stale counter cannot repeat one
                let fence = drawn.map_or(now, |last| now.max(last.saturating_add(1)));
                map.put(&fence_key, Value::Fence(fence), fence_expiry);
                LockAttempt::Acquired { fence }
            }
        };
        ready(attempt)
    }

    fn extend_if_held(&self, key: String, token: String, lease: Duration) -> StoreFuture<bool> {
        self.token_checked(&key, |v| v.held_by(&token), OnMatch::Expire(lease))
    }

    fn delete_if_held(&self, key: String, token: String) -> StoreFuture<bool> {
        self.token_checked(&key, |v| v.held_by(&token), OnMatch::Release)
    }
}

impl IdempotencyStore for MemoryStore {
    fn idempotency_begin(
        &self,
        key: String,
        fingerprint: String,
        token: String,
        lease: Duration,
    ) -> StoreFuture<IdempotencyBegin> {
        let now = self.now_us();
        let mut map = self.lock();
        map.sweep_if_due(now);
        let lease_left = map.left(&key, now);
        let begin = match map.live(&key, now) {
            None => {
                let record = IdemRecord {
                    fingerprint,
                    token,
                    response: None,
                };
                map.put(&key, Value::Idem(record), expiry(now, lease));
                IdempotencyBegin::Claimed
            }
            Some(Value::Idem(record)) if record.fingerprint != fingerprint => {
                IdempotencyBegin::Mismatch
            }
            Some(Value::Idem(IdemRecord {
                response: Some(response),
                ..
            })) => IdempotencyBegin::Completed(response.clone()),
            // the same attempt again: claimed already
            Some(v) if v.owned_by(&token) => {
                map.expire(&key, expiry(now, lease));
                IdempotencyBegin::Claimed
            }
            Some(_) => IdempotencyBegin::InFlight { lease_left },
        };
        ready(begin)
    }

    fn idempotency_complete(
        &self,
        key: String,
        token: String,
        response: Bytes,
        retention: Duration,
    ) -> StoreFuture<bool> {
        let now = self.now_us();
        let mut map = self.lock();
        let Some(entry) = map.entries.get_mut(&key).filter(|e| e.expires_at > now) else {
            return ready(false);
        };
        let Value::Idem(record) = &mut entry.value else {
            return ready(false);
        };
        if record.token != token {
            return ready(false);
        }
        if let Some(stored) = &record.response {
            // a second run of the same completion stored this very response
            return ready(*stored == response);
        }
        record.response = Some(response);
        entry.expires_at = expiry(now, retention);
        ready(true)
    }

    fn idempotency_release(&self, key: String, token: String) -> StoreFuture<bool> {
        self.token_checked(&key, |v| v.owned_by(&token), OnMatch::Release)
    }

    fn idempotency_extend(&self, key: String, token: String, lease: Duration) -> StoreFuture<bool> {
        self.token_checked(&key, |v| v.owned_by(&token), OnMatch::Expire(lease))
    }
}

impl Store for MemoryStore {
    fn ping(&self) -> StoreFuture<()> {
        ready(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn huge_durations_neither_panic_nor_wrap() {
        let store = MemoryStore::new();
        let won = store
            .claim("c".into(), "a".into(), Some(Duration::MAX))
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
