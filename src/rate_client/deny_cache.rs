//! The local deny cache: a copy remembers "denied until T" for a caller, and denies that caller's
//! requests of the same or larger cost without a store round trip until T.
//!
//! It caches a store decision, never counts: every algorithm needs at least as long to make room
//! for a larger cost, and other requests only use room up, so a cached denial is one the store
//! would give as well. It cannot admit anything.
//!
//! T is counted from when the check was sent, not from when the reply came: the store decided
//! somewhere in between, so a slow reply must not stretch the denial beyond the store's.
//!
//! A reset, or a settlement that refunded the caller, through any copy makes a cached denial
//! stale. The store broadcasts it (see [`RateStore::invalidations`](crate::store::RateStore::invalidations)),
//! and the layer drops the caller's entry when the word arrives (`invalidated.rs`): normally the
//! caller is admitted on every copy within about a round trip of the broadcast. When the
//! broadcast is lost (the subscriber's connection down, a store without one), the bound is
//! [`MAX_AGE`]: a denial is served from the cache for at most that long, however long the
//! store's wait, then the store is asked again (a denied caller flooding a copy still costs it
//! at most one store check per `MAX_AGE`). A subscriber that may have missed broadcasts says so,
//! and the whole cache is dropped. A denial whose check was sent before its caller was
//! forgotten (the reset's word overtook the reply) is not cached: the store may have decided it
//! before the reset.
//!
//! Callers are spread over [`SHARDS`] maps by a hash of their key, each behind its own lock, so
//! that requests of different callers seldom wait for one another.

use std::collections::HashMap;
use std::hash::{BuildHasher, RandomState};
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use tokio::time::Instant;

use super::decision::{DecisionSource, RateLimitDecision};
use crate::key::Key;

/// Entries beyond this are not cached (expired ones are dropped first): a flood of distinct
/// callers cannot grow the cache without bound. Each shard holds its share, `CAPACITY / SHARDS`.
const CAPACITY: usize = 10_000;

const SHARDS: usize = 16;

/// How long a denial is served from the cache before the store is asked again.
pub(crate) const MAX_AGE: Duration = Duration::from_secs(1);

#[derive(Debug)]
pub(crate) struct DenyCache {
    shards: Box<[Mutex<Entries>]>,
    /// Picks a caller's shard; keyed at random, so that nobody can aim callers at one shard.
    hasher: RandomState,
}

#[derive(Debug, Default)]
struct Entries {
    map: HashMap<Key, Denial>,
    /// When this full shard was last swept: a flood of distinct callers must not make every
    /// denial scan the whole shard.
    swept: Option<Instant>,
    /// When a denial of this shard was last forgotten (a reset or refund): a denial whose check
    /// was sent before then may have been decided before the reset, and is not cached.
    invalidated: Option<Instant>,
}

#[derive(Debug)]
struct Denial {
    /// Until when the store's wait runs.
    until: Instant,
    /// Until when the cache serves it: the store's wait, or [`MAX_AGE`] if that is sooner.
    expires: Instant,
    /// When the check that was denied was sent.
    at: Instant,
    cost: u64,
    decision: RateLimitDecision,
}

impl Default for DenyCache {
    fn default() -> Self {
        Self {
            shards: (0..SHARDS).map(|_| Mutex::default()).collect(),
            hasher: RandomState::new(),
        }
    }
}

impl DenyCache {
    /// Remembers a denial by the store for a check sent at `sent_at`.
    pub(crate) fn remember(&self, decision: &RateLimitDecision, sent_at: Instant) {
        let now = Instant::now();
        if decision.retry_after.is_zero() {
            return;
        }
        let Some(until) = sent_at.checked_add(decision.retry_after) else {
            return;
        };
        if until <= now {
            // the denial ran out while the reply was on its way
            return;
        }
        let mut entries = self.lock(decision.key);
        if entries.invalidated.is_some_and(|at| sent_at <= at) {
            return;
        }
        if entries.map.len() >= CAPACITY / SHARDS && !entries.make_room(now) {
            return;
        }
        entries.map.insert(
            decision.key,
            Denial {
                until,
                expires: until.min(sent_at + MAX_AGE),
                at: sent_at,
                cost: decision.cost,
                decision: decision.clone(),
            },
        );
    }

    /// A denial for `key` at `cost` still in force, with its waits shortened by the time passed.
    pub(crate) fn check(&self, key: Key, cost: u64) -> Option<RateLimitDecision> {
        let now = Instant::now();
        let mut entries = self.lock(key);
        let denial = entries.map.get(&key)?;
        if denial.expires <= now {
            entries.map.remove(&key);
            return None;
        }
        if cost < denial.cost {
            return None;
        }
        let elapsed = now - denial.at;
        let mut decision = denial.decision.clone();
        decision.cost = cost;
        decision.source = DecisionSource::DenyCache;
        decision.retry_after = (denial.until - now).max(Duration::from_millis(1));
        for state in &mut decision.states {
            state.reset = state.reset.saturating_sub(elapsed);
        }
        Some(decision)
    }

    /// Forgets the denial of `key`, if any, and any denial of a check sent until now that
    /// arrives later (of a caller in the same shard: a few more store checks, never a stale
    /// denial).
    pub(crate) fn forget(&self, key: Key) {
        let mut entries = self.lock(key);
        entries.map.remove(&key);
        entries.invalidated = Some(Instant::now());
    }

    /// Forgets every denial, and any denial of a check sent until now that arrives later.
    pub(crate) fn clear(&self) {
        let now = Instant::now();
        for shard in &self.shards {
            let mut entries = shard.lock().unwrap_or_else(PoisonError::into_inner);
            entries.map.clear();
            entries.invalidated = Some(now);
        }
    }

    fn lock(&self, key: Key) -> MutexGuard<'_, Entries> {
        let at = self.hasher.hash_one(key) as usize % SHARDS;
        // Every update is one insert or remove: a panic cannot leave a poisoned shard
        // inconsistent.
        self.shards[at]
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }
}

impl Entries {
    /// Drops the expired denials of this full shard, at most once a second; whether that made
    /// room.
    fn make_room(&mut self, now: Instant) -> bool {
        if self
            .swept
            .is_some_and(|at| now.duration_since(at) < Duration::from_secs(1))
        {
            return false;
        }
        self.swept = Some(now);
        self.map.retain(|_, denial| denial.expires > now);
        self.map.len() < CAPACITY / SHARDS
    }
}

#[cfg(test)]
mod tests {
    use std::convert::Infallible;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};

    use http::{Request, Response, StatusCode};
    use tower::{Service, ServiceExt, service_fn};

    use crate::key::Header;
    use crate::rate::{LimitState, RateCheck, RateOutcome, RatePolicy};
    use crate::rate_limit::{DecisionSource, Limit, RateLimitDecision, RateLimitLayer};
    use crate::store::{RateStore, StoreFuture};

    /// A store that denies every check for a second, replying 200 ms after it was asked.
    #[derive(Debug, Clone, Default)]
    struct SlowDenial {
        checks: Arc<AtomicUsize>,
    }

    const LATENCY: std::time::Duration = std::time::Duration::from_millis(200);
    const WAIT: std::time::Duration = std::time::Duration::from_secs(1);

    impl RateStore for SlowDenial {
        fn check_rate(&self, _: &Arc<RatePolicy>, _: RateCheck) -> StoreFuture<RateOutcome> {
            self.checks.fetch_add(1, Ordering::SeqCst);
            Box::pin(async {
                tokio::time::sleep(LATENCY).await;
                Ok(RateOutcome {
                    admitted: false,
                    retry_after: WAIT,
                    limits: vec![LimitState {
                        remaining: 0,
                        reset: WAIT,
                    }],
                    decided_at_us: None,
                })
            })
        }

        fn timeout(&self) -> std::time::Duration {
            WAIT
        }

        fn reset_rate(&self, _: &Arc<RatePolicy>, _: super::Key) -> StoreFuture<()> {
            Box::pin(async { Ok(()) })
        }
    }

    async fn decision<S>(svc: &mut S) -> RateLimitDecision
    where
        S: Service<Request<()>, Response = Response<crate::rate_limit::ResponseBody<()>>>,
        S::Error: std::fmt::Debug,
    {
        let request = Request::get("/").header("x-caller", "a").body(()).unwrap();
        let response = svc.ready().await.unwrap().call(request).await.unwrap();
        assert_eq!(response.status(), StatusCode::TOO_MANY_REQUESTS);
        response
            .extensions()
            .get::<RateLimitDecision>()
            .cloned()
            .unwrap()
    }

    /// The store denied for 1 s at some moment between sending and the reply: the cached
    /// denial ends 1 s after sending, not 1 s after the reply 200 ms later.
    #[tokio::test(start_paused = true)]
    async fn a_slow_reply_does_not_stretch_the_cached_denial() {
        let store = SlowDenial::default();
        let checks = Arc::clone(&store.checks);
        let layer = RateLimitLayer::builder(store)
            .limit(Limit::per_second("s", 1))
            .key(Header::from_static("x-caller"))
            .build()
            .unwrap();
        let ok = |_: Request<()>| async { Ok::<_, Infallible>(Response::new(())) };
        let mut svc = tower_layer::Layer::layer(&layer, service_fn(ok));
        let sent = tokio::time::Instant::now();
        assert_eq!(decision(&mut svc).await.source(), DecisionSource::Store);
        assert_eq!(sent.elapsed(), LATENCY);
        // 900 ms after sending: still denied locally, for the 100 ms left
        tokio::time::advance(std::time::Duration::from_millis(700)).await;
        let cached = decision(&mut svc).await;
        assert_eq!(cached.source(), DecisionSource::DenyCache);
        assert_eq!(cached.retry_after(), std::time::Duration::from_millis(100));
        assert_eq!(
            cached.limits()[0].1.reset,
            std::time::Duration::from_millis(100)
        );
        assert_eq!(checks.load(Ordering::SeqCst), 1);
        // 1 s and 1 ms after sending the denial is over: the store is asked again
        tokio::time::advance(std::time::Duration::from_millis(101)).await;
        assert_eq!(
            decision(&mut svc).await.source(),
            DecisionSource::Store,
            "the cached denial outlived the store's"
        );
        assert_eq!(checks.load(Ordering::SeqCst), 2);
    }

    /// A store that denies every check at once for a minute (a caller over an hourly limit,
    /// say), counting the checks it is asked.
    #[derive(Debug, Default)]
    struct LongDenial {
        checks: Arc<AtomicUsize>,
    }

    const LONG: std::time::Duration = std::time::Duration::from_secs(60);

    impl RateStore for LongDenial {
        fn check_rate(&self, _: &Arc<RatePolicy>, _: RateCheck) -> StoreFuture<RateOutcome> {
            self.checks.fetch_add(1, Ordering::SeqCst);
            Box::pin(async {
                Ok(RateOutcome {
                    admitted: false,
                    retry_after: LONG,
                    limits: vec![LimitState {
                        remaining: 0,
                        reset: LONG,
                    }],
                    decided_at_us: None,
                })
            })
        }

        fn timeout(&self) -> std::time::Duration {
            LONG
        }

        fn reset_rate(&self, _: &Arc<RatePolicy>, _: super::Key) -> StoreFuture<()> {
            Box::pin(async { Ok(()) })
        }
    }

    /// A denial whose check was sent before the caller was forgotten (a reset or refund that
    /// arrived while the check was on its way) is not cached: the store may have decided it
    /// before the reset. One sent afterwards is.
    #[tokio::test(start_paused = true)]
    async fn a_denial_sent_before_an_invalidation_is_not_cached() {
        let layer = RateLimitLayer::builder(LongDenial::default())
            .limit(Limit::per_hour("h", 1))
            .key(Header::from_static("x-caller"))
            .deny_cache(false)
            .build()
            .unwrap();
        let ok = |_: Request<()>| async { Ok::<_, Infallible>(Response::new(())) };
        let mut svc = tower_layer::Layer::layer(&layer, service_fn(ok));
        let denial = decision(&mut svc).await;
        let key = denial.key;
        let cache = super::DenyCache::default();
        let sent = tokio::time::Instant::now();
        tokio::time::advance(std::time::Duration::from_millis(1)).await;
        cache.forget(key);
        cache.remember(&denial, sent);
        assert!(
            cache.check(key, 1).is_none(),
            "a denial from before the reset"
        );
        tokio::time::advance(std::time::Duration::from_millis(1)).await;
        cache.remember(&denial, tokio::time::Instant::now());
        assert!(cache.check(key, 1).is_some(), "a denial from after it");
        tokio::time::advance(std::time::Duration::from_millis(1)).await;
        cache.clear();
        assert!(cache.check(key, 1).is_none(), "cleared");
    }

    /// However long the store's wait, a denial is served from the cache for at most
    /// `MAX_AGE`, then the store is asked again: a reset or refund made through another copy
    /// whose broadcast was lost frees the caller here within that time. The answers still count
    /// down the store's wait.
    #[tokio::test(start_paused = true)]
    async fn a_long_denial_is_asked_again_after_the_cache_max_age() {
        let store = LongDenial::default();
        let checks = Arc::clone(&store.checks);
        let layer = RateLimitLayer::builder(store)
            .limit(Limit::per_hour("h", 1))
            .key(Header::from_static("x-caller"))
            .build()
            .unwrap();
        let ok = |_: Request<()>| async { Ok::<_, Infallible>(Response::new(())) };
        let mut svc = tower_layer::Layer::layer(&layer, service_fn(ok));
        assert_eq!(decision(&mut svc).await.source(), DecisionSource::Store);
        tokio::time::advance(super::MAX_AGE - std::time::Duration::from_millis(1)).await;
        let cached = decision(&mut svc).await;
        assert_eq!(cached.source(), DecisionSource::DenyCache);
        assert_eq!(
            cached.retry_after(),
            LONG - super::MAX_AGE + std::time::Duration::from_millis(1)
        );
        assert_eq!(checks.load(Ordering::SeqCst), 1);
        tokio::time::advance(std::time::Duration::from_millis(1)).await;
        assert_eq!(decision(&mut svc).await.source(), DecisionSource::Store);
        assert_eq!(checks.load(Ordering::SeqCst), 2);
    }
}
