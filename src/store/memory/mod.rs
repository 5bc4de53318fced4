//! [`MemoryStore`]: the store semantics inside one process.
//!
//! Its claims, locks, fencing counters and idempotency records are kept as the rate state is
//! (see `rate::local`), in an [`ExpiringMap`] — shards, each behind its own lock and indexed by
//! expiry, bounded by one count over all of them (see `crate::expiring`) — but apart from the
//! rate state, with a capacity of its own.
//!
//! A key's shard is picked by its hash tag — the text between the first `{` and the next `}`, or
//! the whole key when there is none — as Redis Cluster picks a slot: a lock and its fencing
//! counter (`<key>` and `<key>:fence`) share a shard, so acquiring a lock takes one shard lock.
//! An operation on two keys of different shards locks both, in shard order, so that two such
//! operations cannot deadlock. A lock needs room for both of its keys or neither.

use std::future;
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

mod idempotency;
mod limits;
mod line;
mod lock;
mod permit;
mod rate;

use super::invalidation::{self, Hub};
use super::{Store, StoreError, StoreErrorKind, StoreFuture, millis};
use crate::expiring::{Expiring, ExpiringMap, Full, Locked, Room};
use crate::rate::{Clock, LocalRates};
use idempotency::IdemRecord;
use permit::Permits;

/// A store inside one process, with the same semantics as `RedisStore`.
///
/// It serves tests, documentation and a service that runs as a single copy. Limits, claims and
/// locks held here are **not** seen by other processes: run several copies on a `MemoryStore`
/// each and every copy admits the full limit. Time is tokio's clock, so `tokio::time::pause` and
/// `advance` move its windows in tests. Expired entries are removed as the store is used.
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
///
/// # Bounded
///
/// A store holds at most `capacity` rate-limit callers (a caller is one [`Key`](crate::key::Key)
/// under one policy namespace, with all its limits) and, apart from them, at most `capacity`
/// claim, lock, fencing-counter and idempotency keys: [`DEFAULT_CAPACITY`](Self::DEFAULT_CAPACITY)
/// unless chosen with [`with_capacity`](Self::with_capacity). Expired entries never count. A full
/// store never evicts anything live — that would hand a caller a fresh quota, or free a held
/// lock — so what is new is refused:
///
/// - a rate check of a caller not held is denied with a `retry_after` of 1 s, each limit at
///   `remaining: 0` and `reset` 1 s; callers already held are decided as always (and a check
///   that keeps nothing, such as a look at cost 0, is answered as usual);
/// - a settlement of a caller not held fails with a [`StoreError`] of kind
///   [`Protocol`](StoreErrorKind::Protocol) — a settlement is admitted by definition, so it is
///   never answered as a denial; its layer keeps the request charged what it reserved;
/// - a claim, lock or idempotency record under a key not held fails with a [`StoreError`] of
///   kind [`Protocol`](StoreErrorKind::Protocol), as Redis refuses writes beyond `maxmemory`
///   under its `noeviction` policy.
///
/// ```
/// # #[tokio::main(flavor = "current_thread")] async fn main() {
/// use std::sync::Arc;
/// use std::time::Duration;
/// use tollgate::key::Key;
/// use tollgate::rate::{Algorithm, Limit, RateCheck, RatePolicy};
/// use tollgate::store::{MemoryStore, RateStore};
///
/// let store = MemoryStore::with_capacity(1);
/// let policy = Arc::new(RatePolicy::new("demo", Algorithm::Gcra, vec![Limit::per_minute("m", 5)]).unwrap());
/// let check = |name: &str| RateCheck::new(Key::new("user", name.as_bytes()), 1);
/// assert!(store.check_rate(&policy, check("alice")).await.unwrap().admitted);
/// let bob = store.check_rate(&policy, check("bob")).await.unwrap();
/// assert!(!bob.admitted);
/// assert_eq!(bob.retry_after, Duration::from_secs(1));
/// // alice keeps her count: 3 left after this one
/// assert_eq!(store.check_rate(&policy, check("alice")).await.unwrap().limits[0].remaining, 3);
/// # }
/// ```
///
/// State is split into shards, each behind its own lock, so that operations on different callers
/// and keys seldom wait for each other; the capacity counts over all shards together.
#[derive(Debug, Clone)]
pub struct MemoryStore {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    clock: Clock,
    rates: LocalRates,
    entries: Entries,
    /// Resets and refunds, told to every layer on this store.
    invalidations: Hub,
    /// Each rate-limit layer's limits in force.
    tables: limits::Tables,
}

/// Claims, locks, fencing counters and idempotency records, sharded by hash tag.
#[derive(Debug)]
struct Entries {
    map: ExpiringMap<Arc<str>, Entry>,
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
    /// The permits held under a concurrency limit, and the queue of waiters for them.
    Permits(Permits),
    /// A caller's line of waiters for room.
    Line(line::Line),
}

/// What a token-checked operation does to an entry its token matches.
#[derive(Debug, Clone, Copy)]
enum OnMatch {
    /// Delete it.
    Release,
    Expire(Duration),
}

impl Default for MemoryStore {
    fn default() -> Self {
        Self::new()
    }
}

impl MemoryStore {
    /// The capacity of [`MemoryStore::new`]: a million rate-limit callers and, apart, a million
    /// claim, lock and idempotency keys — a few hundred megabytes when all are held, far more
    /// than a test or a single small service needs, and still a bound.
    pub const DEFAULT_CAPACITY: usize = 1_000_000;

    /// An empty store of [`DEFAULT_CAPACITY`](Self::DEFAULT_CAPACITY).
    pub fn new() -> Self {
        Self::with_capacity(Self::DEFAULT_CAPACITY)
    }

    /// An empty store that holds at most `capacity` live rate-limit callers and at most
    /// `capacity` live claim, lock and idempotency keys (see [Bounded](Self#bounded) for what a
    /// full store answers). A capacity of 0 holds nothing: every new caller is denied.
    pub fn with_capacity(capacity: usize) -> Self {
        let clock = Clock::new();
        Self {
            inner: Arc::new(Inner {
                clock,
                rates: LocalRates::new(clock, capacity),
                entries: Entries::new(capacity),
                invalidations: Hub::default(),
                tables: limits::Tables::default(),
            }),
        }
    }

    /// The number of live entries: rate-limit callers plus claim, lock, fencing-counter and
    /// idempotency keys (for tests of expiry and capacity).
    pub fn len(&self) -> usize {
        self.inner.rates.len() + self.inner.entries.map.live(self.now_us())
    }

    /// Whether the store holds no live entry.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn now_us(&self) -> u64 {
        self.inner.clock.now_us()
    }

    /// Applies `on_match` to `key` only if `matches` its live value; whether it did. (Nothing
    /// here is ever re-sent, so a release needs no marker.) An extension comes with its
    /// `deadline`; a release takes none: it is never regretted.
    fn token_checked(
        &self,
        key: &str,
        matches: impl Fn(&Value) -> bool,
        on_match: OnMatch,
        deadline: Option<Instant>,
    ) -> StoreFuture<bool> {
        let check = || {
            let now = self.now_us();
            self.inner.entries.run(key, None, now, |held| {
                let matched = held.live(key, now).is_some_and(&matches);
                if matched {
                    match on_match {
                        OnMatch::Release => held.remove(key),
                        OnMatch::Expire(lease) => held.set_expiry(key, expiry(now, lease)),
                    }
                }
                Ok(matched)
            })
        };
        match deadline {
            Some(deadline) => before(deadline, check),
            None => done(check()),
        }
    }
}

impl Entries {
    fn new(capacity: usize) -> Self {
        Self {
            map: ExpiringMap::new(capacity),
        }
    }

    /// Runs `op` on the shards of `key` and `other`, locked, once their expired keys are gone.
    /// When `op` finds no room for a new key, the expired keys of every shard are removed and
    /// `op` runs once more — so it must change nothing before it fails with [`Full`]; no room
    /// then is an error.
    fn run<T>(
        &self,
        key: &str,
        other: Option<&str>,
        now: u64,
        mut op: impl FnMut(&mut Held<'_>) -> Result<T, Full>,
    ) -> Result<T, StoreError> {
        if let Ok(done) = op(&mut self.lock(key, other, now)) {
            return Ok(done);
        }
        // with this operation's locks released: holding them while taking others could deadlock
        self.map.remove_expired_everywhere(now);
        op(&mut self.lock(key, other, now)).map_err(|Full| {
            StoreError::new(
                StoreErrorKind::Protocol,
                format!(
                    "MemoryStore full: {} live keys held, a new key is refused (see MemoryStore::with_capacity)",
                    self.map.capacity()
                ),
            )
        })
    }

    /// Locks the shards of `key` and `other`, in ascending order.
    fn lock(&self, key: &str, other: Option<&str>, now: u64) -> Held<'_> {
        let a = self.shard(key);
        let (low, high) = match other.map(|k| self.shard(k)) {
            Some(b) if b < a => (b, Some(a)),
            Some(b) if b > a => (a, Some(b)),
            _ => (a, None),
        };
        Held {
            entries: self,
            first: self.map.lock(low, now),
            second: high.map(|i| self.map.lock(i, now)),
            room: self.map.room(),
        }
    }

    fn shard(&self, key: &str) -> usize {
        self.map.shard(hash_tag(key))
    }
}

/// The part of `key` that picks its shard: the text between the first `{` and the next `}` if
/// that is not empty, else the whole key (Redis Cluster's hash tag rule).
fn hash_tag(key: &str) -> &str {
    // Both braces are ASCII: a byte search is exact, and cheaper than a char searcher.
    let Some(open) = key.bytes().position(|b| b == b'{') else {
        return key;
    };
    let rest = &key[open + 1..];
    match rest.bytes().position(|b| b == b'}') {
        Some(len) if len > 0 => &rest[..len],
        _ => key,
    }
}

/// One locked shard of the entries.
type Shard<'a> = Locked<'a, Arc<str>, Entry>;

/// The locked shards of one operation's keys, with the room it took for keys not yet added.
struct Held<'a> {
    entries: &'a Entries,
    first: Shard<'a>,
    second: Option<Shard<'a>>,
    room: Room<'a>,
}

impl<'a> Held<'a> {
    /// The shard of `key`: one of the locked ones, as `key` is one of the operation's.
    fn shard(&self, key: &str) -> &Shard<'a> {
        match &self.second {
            Some(second) if second.shard() == self.entries.shard(key) => second,
            _ => &self.first,
        }
    }

    fn shard_mut(&mut self, key: &str) -> &mut Shard<'a> {
        pick(self.entries, &mut self.first, &mut self.second, key)
    }

    /// `key`'s live value.
    fn live(&self, key: &str, now: u64) -> Option<&Value> {
        match self.shard(key).get(key) {
            Some(e) if e.expires_at > now => Some(&e.value),
            _ => None,
        }
    }

    /// The time a live entry has left, in whole milliseconds.
    fn left(&self, key: &str, now: u64) -> Duration {
        let expires_at = self.shard(key).get(key).map_or(now, |e| e.expires_at);
        Duration::from_millis(expires_at.saturating_sub(now) / 1000)
    }

    fn set_expiry(&mut self, key: &str, expires_at: u64) {
        self.update(key, |entry| entry.expires_at = expires_at);
    }

    /// Runs `f` on `key`'s entry, if held.
    fn update<R>(&mut self, key: &str, f: impl FnOnce(&mut Entry) -> R) -> Option<R> {
        self.shard_mut(key).update(key, f)
    }

    /// Takes room for those of `keys` not held yet, all or none, for the [`put`](Self::put)s
    /// that follow.
    fn make_room(&mut self, keys: &[&str]) -> Result<(), Full> {
        let absent = keys
            .iter()
            .filter(|k| !self.shard(k).contains_key(**k))
            .count();
        self.room.take(absent)
    }

    /// Sets `key`; a key not held yet needs room, taken now or by [`make_room`](Self::make_room).
    fn put(&mut self, key: &str, value: Value, expires_at: u64) -> Result<(), Full> {
        let shard = pick(self.entries, &mut self.first, &mut self.second, key);
        shard.insert(key, Entry { value, expires_at }, &mut self.room)
    }

    fn remove(&mut self, key: &str) {
        self.shard_mut(key).remove(key);
    }
}

/// The shard of `key` among an operation's locked `first` and `second`.
fn pick<'s, 'a>(
    entries: &Entries,
    first: &'s mut Shard<'a>,
    second: &'s mut Option<Shard<'a>>,
    key: &str,
) -> &'s mut Shard<'a> {
    match second {
        Some(second) if second.shard() == entries.shard(key) => second,
        _ => first,
    }
}

impl Expiring for Entry {
    fn expires_at(&self) -> u64 {
        self.expires_at
    }
}

/// `now` plus `d` in microseconds, as the store counts expiry: whole milliseconds, at least one.
fn expiry(now: u64, d: Duration) -> u64 {
    now.saturating_add(millis(d).saturating_mul(1000))
}

/// The timeout a memory store reports: its calls never wait, so this is only the deadline its
/// callers give their writes.
const NOMINAL_TIMEOUT: Duration = Duration::from_secs(1);

/// Runs `write` unless its `deadline` has passed: a write that comes later does nothing (see
/// [Deadlines](super#deadlines)).
fn before<T: Send + 'static>(
    deadline: Instant,
    write: impl FnOnce() -> Result<T, StoreError>,
) -> StoreFuture<T> {
    done(if Instant::now() >= deadline {
        Err(StoreError::expired())
    } else {
        write()
    })
}

fn ready<T: Send + 'static>(value: T) -> StoreFuture<T> {
    done(Ok(value))
}

fn done<T: Send + 'static>(result: Result<T, StoreError>) -> StoreFuture<T> {
    Box::pin(future::ready(result))
}

impl Store for MemoryStore {
    fn ping(&self) -> StoreFuture<()> {
        ready(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::{ClaimRequest, LockRequest};
    use crate::store::{Hold, LockAttempt, LockStore};

    /// A deadline that a call made now meets.
    fn soon() -> Instant {
        Instant::now() + Duration::from_secs(1)
    }
    use crate::keyspace;

    #[tokio::test(start_paused = true)]
    async fn huge_durations_neither_panic_nor_wrap() {
        let store = MemoryStore::new();
        let won = store
            .claim(ClaimRequest::new("c", "a", Some(Duration::MAX)), soon())
            .await
            .unwrap();
        assert!(won.won);
        let lost = store
            .claim(ClaimRequest::new("c", "b", None), soon())
            .await
            .unwrap();
        assert!(
            !lost.won,
            "a claim for Duration::MAX is kept, not expired at once"
        );
    }

    /// Every key is indexed once, not after its expiry, counted once, and in its shard.
    fn assert_consistent(store: &MemoryStore) {
        let entries = &store.inner.entries;
        entries.map.assert_consistent(|shard, key, _| {
            assert_eq!(entries.shard(key), shard, "{key} in its shard");
        });
    }

    #[test]
    fn hash_tags_follow_redis_cluster() {
        assert_eq!(hash_tag("app:lock:{abc}"), "abc");
        assert_eq!(hash_tag("app:lock:{abc}:fence"), "abc");
        assert_eq!(hash_tag("a{b}{c}"), "b");
        assert_eq!(hash_tag("a{}b{c}"), "a{}b{c}", "an empty tag is no tag");
        assert_eq!(hash_tag("a{b"), "a{b");
        assert_eq!(hash_tag("plain"), "plain");
        let store = MemoryStore::new();
        let (lock, fence) = keyspace::lock("app", b"report");
        let entries = &store.inner.entries;
        assert_eq!(entries.shard(&lock), entries.shard(&fence));
    }

    /// Keys without a common hash tag may fall in two shards: both are locked, and the lock
    /// behaves as with one.
    #[tokio::test(start_paused = true)]
    async fn a_lock_and_fence_in_two_shards() {
        let store = MemoryStore::new();
        let entries = &store.inner.entries;
        let Some(key) = (0..1000)
            .map(|i| format!("lock{i}"))
            .find(|k| entries.shard(k) != entries.shard(&format!("{k}:fence")))
        else {
            panic!("no two keys in different shards");
        };
        let fence = format!("{key}:fence");
        let lease = Duration::from_secs(5);
        let first = store.lock_acquire(
            LockRequest::new(Hold::new(key.clone(), "a"), fence.clone(), lease),
            soon(),
        );
        assert!(matches!(first.await.unwrap(), LockAttempt::Acquired { .. }));
        let second = store.lock_acquire(
            LockRequest::new(Hold::new(key.clone(), "b"), fence.clone(), lease),
            soon(),
        );
        assert!(matches!(second.await.unwrap(), LockAttempt::Held { .. }));
        assert_eq!(store.len(), 2);
        assert_consistent(&store);
    }

    /// A lock needs room for its key and its fencing counter, both or neither; a release gives
    /// room back, and so does expiry.
    #[tokio::test(start_paused = true)]
    async fn room_is_taken_and_given_back_exactly() {
        let store = MemoryStore::with_capacity(1);
        let (lock, fence) = keyspace::lock("app", b"l");
        let refused = store
            .lock_acquire(
                LockRequest::new(
                    Hold::new(lock.clone(), "t"),
                    fence.clone(),
                    Duration::from_secs(1),
                ),
                soon(),
            )
            .await;
        assert_eq!(refused.unwrap_err().kind(), StoreErrorKind::Protocol);
        assert_eq!(store.len(), 0, "nothing half-acquired");
        assert_consistent(&store);
        let claim = |name: &str| {
            store.claim(
                ClaimRequest::new(name, "h", Some(Duration::from_secs(1))),
                soon(),
            )
        };
        assert!(claim("a").await.unwrap().won);
        assert!(claim("b").await.is_err());
        assert!(store.delete_if_held(Hold::new("a", "h")).await.unwrap());
        assert!(claim("b").await.unwrap().won);
        tokio::time::advance(Duration::from_secs(1)).await;
        assert!(claim("c").await.unwrap().won, "the expired claim made room");
        assert_consistent(&store);
    }
}
