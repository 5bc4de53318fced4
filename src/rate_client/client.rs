//! [`RateClient`]: a layer's one way to its store's rate checks.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, ready};

use arc_swap::{ArcSwap, Guard};
use tokio::time::Instant;

use super::deny_cache::DenyCache;
use super::invalidated::{Invalidated, Listener};
use super::lease::{LeaseFuture, Take};
use super::queue::Queue;
use super::recipe::TierRecipe;
use super::source::DecisionSource;
use super::tiers::{Tier, Tiers};
use super::verdict::Verdict;
use crate::in_force::{Follows, InForce, Place};
use crate::key::Key;
use crate::on_error::OnStoreError;
use crate::pace::OncePerSecond;
use crate::rate::{RateCheck, RateOutcome};
use crate::store::{RateStore, StoreError, StoreFuture};

/// What a copy keeps of one layer's rate limits, in front of the store: the tiers with their
/// leased slices and fallbacks, the deny cache and the invalidation listener that keeps them
/// fresh. The layer asks it one thing, [`decide`](Self::decide), and gets a [`Verdict`] that
/// names its source.
pub(crate) struct RateClient {
    pub(crate) store: Arc<dyn RateStore>,
    /// The policies a request is checked against, one per request: replaced whole when the
    /// limits in force change.
    pub(crate) tiers: ArcSwap<Tiers>,
    /// The limits in force, for a layer built with them in the store.
    pub(crate) in_store: Option<InForce<TierRecipe>>,
    /// Denials by the store, of every tier (a cached denial answers for its own tier only);
    /// `None` when off.
    pub(crate) deny_cache: Option<DenyCache>,
    /// Drops the cached denials and slices that the store says are stale.
    listener: Listener,
    pub(crate) on_store_error: OnStoreError,
    /// Where denied requests wait for room, when they may.
    pub(crate) queue: Option<Queue>,
    /// Store failures are logged at warn at most once a second (the rest at debug): an outage
    /// under load must not flood the log.
    pub(crate) last_warning: OncePerSecond,
}

debug_fields!(RateClient {
    store,
    tiers,
    in_store,
    on_store_error
});

/// How [`RateClient::decide`] answers.
pub(crate) enum Decided {
    /// At once, without a round trip: from a leased slice, or a cached denial.
    Now(Verdict),
    /// Once the store answers (or a slice being fetched lands).
    Pending(Pending),
}

impl RateClient {
    /// A client of `store` for `tiers`; with a deny cache when `deny_cache`.
    pub(crate) fn new(
        store: Arc<dyn RateStore>,
        tiers: Tiers,
        deny_cache: bool,
        on_store_error: OnStoreError,
    ) -> Self {
        Self {
            store,
            tiers: ArcSwap::from_pointee(tiers),
            in_store: None,
            deny_cache: deny_cache.then(DenyCache::default),
            listener: Listener::default(),
            on_store_error,
            queue: None,
            last_warning: OncePerSecond::new(),
        }
    }

    /// Lets denied requests wait for room in `queue`.
    pub(crate) fn with_queue(mut self, queue: Queue) -> Self {
        self.queue = Some(queue);
        self
    }

    /// Follows the limits in force that the store keeps, made of `in_store`'s recipe (see
    /// [`start_in_store`](Self::start_in_store)).
    pub(crate) fn with_limits_in_store(mut self, in_store: InForce<TierRecipe>) -> Self {
        self.in_store = Some(in_store);
        self
    }

    /// The tiers in force.
    pub(crate) fn tiers(&self) -> Guard<Arc<Tiers>> {
        self.tiers.load()
    }

    /// Decides `check` under `tier`: a slice of the caller's with room admits it, then a denial
    /// of the store still in force denies it, then the store (through the leases, on a leased
    /// tier) decides. With a [queue](super::queue), a denied request may then wait for room.
    /// A request's patience counts from `arrived`, or from now when `None`.
    pub(crate) fn decide(
        self: &Arc<Self>,
        tier: &Arc<Tier>,
        check: RateCheck,
        arrived: Option<Instant>,
    ) -> Decided {
        match &self.queue {
            Some(queue) => self.decide_queued(queue, tier, check, arrived),
            None => self.decide_now(tier, check),
        }
    }

    /// Decides `check` under `tier` once, without waiting for room.
    pub(super) fn decide_now(self: &Arc<Self>, tier: &Arc<Tier>, check: RateCheck) -> Decided {
        // the deny cache and leased slices hear of resets and refunds made through other copies
        if self.deny_cache.is_some() || tier.leases.is_some() {
            self.listener.ensure(|| self.store.invalidations(), self);
        }
        let leased =
            |outcome| Verdict::new(outcome, DecisionSource::Lease, Arc::clone(tier), check);
        // a slice with room answers first: it was charged in the store, whatever was denied since
        let leases = tier.leases.as_ref();
        if let Some(outcome) = leases.and_then(|l| l.admit(check.key(), check.cost())) {
            return Decided::Now(leased(outcome));
        }
        if let Some(denied) = self.cached_denial(tier, check) {
            return Decided::Now(denied);
        }
        let answer = match leases.map(|leases| leases.take(check)) {
            None => Answer::Store(self.store.check_rate(&tier.policy, check)),
            Some(Take::Store(pending)) => Answer::Leases(pending),
            Some(Take::Local(outcome)) => return Decided::Now(leased(outcome)),
        };
        Decided::Pending(Pending(Waiting::Answer {
            client: Arc::clone(self),
            answer,
            tier: Arc::clone(tier),
            check,
            sent_at: Instant::now(),
        }))
    }

    /// A denial of `check`'s caller under `tier` still in force.
    fn cached_denial(&self, tier: &Arc<Tier>, check: RateCheck) -> Option<Verdict> {
        self.deny_cache
            .as_ref()?
            .check(check)
            // a denial under another tier (the caller changed plans) says nothing of this one
            .filter(|denied| Arc::ptr_eq(&denied.tier, tier))
    }

    /// Caller `key`'s state of `tier`'s limits, spending nothing: a check of cost 0 in the store.
    pub(crate) fn peek(&self, tier: &Tier, key: Key) -> StoreFuture<RateOutcome> {
        self.store.check_rate(&tier.policy, RateCheck::new(key, 0))
    }

    /// Forgets what caller `key` has spent of every tier, in the store and on this copy.
    pub(crate) async fn reset(&self, key: Key) -> Result<(), StoreError> {
        if let Some(cache) = &self.deny_cache {
            cache.forget(key);
        }
        for tier in self.tiers().all() {
            // the caller's slices were charged before the reset, which erases them: given back,
            // they would refund nothing
            if let Some(leases) = &tier.leases {
                leases.discard(key);
            }
            self.store.reset_rate(&tier.policy, key).await?;
        }
        // a denial cached while the reset was on its way
        if let Some(cache) = &self.deny_cache {
            cache.forget(key);
        }
        Ok(())
    }

    /// Gives back what this copy holds unspent of its leased slices, and waits for the store's
    /// answers.
    pub(crate) async fn give_back_leases(&self) {
        for tier in self.tiers().all() {
            if let Some(leases) = &tier.leases {
                let given = leases.give_back_all().await;
                // a denial this copy cached of those callers is stale now (the settlements are
                // quiet: other copies' cached denials end within their second)
                if let Some(cache) = &self.deny_cache {
                    given.into_iter().for_each(|key| cache.forget(key));
                }
            }
        }
    }

    /// What this copy holds unspent of its leased slices, over every caller and tier.
    pub(crate) fn leases_unspent(&self) -> u64 {
        self.tiers()
            .all()
            .iter()
            .filter_map(|tier| tier.leases.as_ref())
            .map(|leases| leases.unspent())
            .sum()
    }
}

impl Follows for RateClient {
    type Recipe = TierRecipe;

    fn in_force(&self) -> Option<&InForce<TierRecipe>> {
        self.in_store.as_ref()
    }

    fn place(&self) -> Place<'_, Tiers> {
        Place {
            store: self.store.limits_store(),
            built: &self.tiers,
        }
    }
}

/// The limits in force kept in the store (see `in_force.rs`).
impl RateClient {
    /// Reads the limits in force and makes them this copy's; then follows them, at each refresh
    /// and each broadcast of a change, as long as the client lives.
    pub(crate) async fn start_in_store(self: &Arc<Self>) {
        if self.in_store.is_some() {
            Self::start_following(self).await;
            // a change made through another copy is heard of at once where the store broadcasts
            self.listener.ensure(|| self.store.invalidations(), self);
        }
    }
}

impl Invalidated for RateClient {
    /// Of a caller reset or refunded under one of the layer's namespaces (another layer's
    /// policies on the same store are none of this one's business): its cached denial and — a
    /// leased tier's invalidation can only be a reset, as a slice's settlement is
    /// [quiet](crate::rate::RateCheck::quiet) and leased tiers settle nothing else — its slices,
    /// given back (the store refunds nothing of a charge the reset erased).
    fn caller(&self, namespace: &str, key: Key) {
        let tiers = self.tiers().all();
        let ours = tiers.iter().filter(|t| t.policy.namespace() == namespace);
        let mut known = false;
        for tier in ours {
            known = true;
            if let Some(leases) = &tier.leases {
                leases.forget(key);
            }
        }
        if let Some(cache) = self.deny_cache.as_ref().filter(|_| known) {
            cache.forget(key);
        }
    }

    /// Of this layer's limits changed through another copy: read them again now.
    fn limits(self: &Arc<Self>, namespace: &str) {
        Self::heard_of_change(self, namespace);
    }

    /// Every cached denial goes; slices are kept: a reset missed here is spent past by at most
    /// one lease's slices.
    fn missed(&self) {
        if let Some(cache) = &self.deny_cache {
            cache.clear();
        }
    }
}

/// The store's answer on its way: from the store itself, or through a leased tier's slices.
enum Answer {
    Store(StoreFuture<RateOutcome>),
    Leases(LeaseFuture),
}

/// A check at the store, or a request waiting for room: resolves to its [`Verdict`], the
/// failure policy's when the store fails.
pub(crate) struct Pending(Waiting);

/// What a [`Pending`] check waits for.
enum Waiting {
    /// The store's answer.
    Answer {
        client: Arc<RateClient>,
        answer: Answer,
        tier: Arc<Tier>,
        check: RateCheck,
        /// When the check went to the store: a cached denial counts from then.
        sent_at: Instant,
    },
    /// Room, in the caller's line (see [`queue`](super::queue)).
    Room(Pin<Box<dyn Future<Output = Verdict> + Send>>),
}

impl Decided {
    /// The answer of a request that waits for room in `waiting`.
    pub(super) fn queued(waiting: impl Future<Output = Verdict> + Send + 'static) -> Self {
        Self::Pending(Pending(Waiting::Room(Box::pin(waiting))))
    }

    /// The verdict, once decided.
    pub(crate) async fn resolve(self) -> Verdict {
        match self {
            Self::Now(verdict) => verdict,
            Self::Pending(pending) => pending.await,
        }
    }
}

impl Future for Pending {
    type Output = Verdict;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Verdict> {
        let (client, answer, tier, check, sent_at) = match &mut self.0 {
            Waiting::Room(waiting) => return waiting.as_mut().poll(cx),
            Waiting::Answer {
                client,
                answer,
                tier,
                check,
                sent_at,
            } => (client, answer, tier, check, sent_at),
        };
        let answer = match answer {
            Answer::Store(pending) => {
                ready!(pending.as_mut().poll(cx)).map(|outcome| (outcome, DecisionSource::Store))
            }
            Answer::Leases(pending) => ready!(pending.as_mut().poll(cx)),
        };
        Poll::Ready(client.verdict(answer, Arc::clone(tier), *check, *sent_at))
    }
}
