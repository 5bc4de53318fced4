//! A slice's fetch: run in a task of the copy's, which installs the slice whatever becomes of
//! the request that started it (that request only waits for the answer), and resolves a lost
//! answer through the attempt ledger ([`lost`](super::lost)).

use std::sync::Arc;

use tokio::time::Instant;

use super::{Lease, LeaseFuture, Leases, Slice, lost};
use crate::key::Key;
use crate::rate::{RateCheck, RateOutcome};
use crate::rate_client::source::DecisionSource;
use crate::store::{StoreError, StoreErrorKind};

/// A fetch, run in a task of the copy's.
type BoxFuture = std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>>;

/// The request a fetch was started for, while it waits: the cost to admit from the slice, and
/// where its answer goes.
struct Waiting {
    cost: u64,
    answer: tokio::sync::oneshot::Sender<Result<Option<RateOutcome>, StoreError>>,
}

impl Leases {
    /// A slice of `size` for `check`'s caller, `check`'s cost admitted from it; when the store
    /// has no room for the slice, a check of the request alone. The fetch is the copy's: the
    /// request only waits for it, and a request that goes away leaves the slice to the copy.
    pub(super) fn fetch(self: &Arc<Self>, check: RateCheck, size: u64) -> LeaseFuture {
        let leases = Arc::clone(self);
        let (answer, landed) = tokio::sync::oneshot::channel();
        let waiting = Waiting {
            cost: check.cost(),
            answer,
        };
        // outside a runtime there is no task to run it in: the request runs it itself
        let inline = self.start_fetch(check.key(), size, Some(waiting));
        Box::pin(async move {
            if let Some(fetch) = inline {
                fetch.await;
            }
            let installed = landed.await.map_err(|_| {
                StoreError::new(
                    StoreErrorKind::Unavailable,
                    "a slice's fetch ended unanswered",
                )
            })?;
            match installed? {
                Some(outcome) => Ok((outcome, DecisionSource::Store)),
                None => leases.direct(check).await,
            }
        })
    }

    /// Fetches a slice of `size` for `key` in the background.
    pub(super) fn spawn_fetch(self: &Arc<Self>, key: Key, size: u64) {
        // outside a runtime the slice is not fetched (nothing was sent): the caller's entry
        // is freed for the next request to fetch one
        drop(self.start_fetch(key, size, None));
    }

    /// Starts fetching a slice of `size` for `key` in a task of its own, which installs it
    /// (`waiting`'s cost admitted from it, while its request is there) whatever becomes of the
    /// request, and resolves it through the ledger when its answer is lost. Outside a runtime,
    /// the fetch to run instead.
    fn start_fetch(
        self: &Arc<Self>,
        key: Key,
        size: u64,
        waiting: Option<Waiting>,
    ) -> Option<BoxFuture> {
        let slice = RateCheck::reservation(key, size).quiet().held(self.lease);
        let fetching = Fetching::new(self, key);
        let fetch: BoxFuture = Box::pin(Arc::clone(self).run_fetch(slice, fetching, waiting));
        match tokio::runtime::Handle::try_current() {
            Ok(runtime) => {
                runtime.spawn(fetch);
                None
            }
            Err(_) => Some(fetch),
        }
    }

    /// The fetch of `slice`: the store's answer installed, handed to the request waiting for
    /// it if one still does, and a lost answer resolved (see [`lost`]).
    async fn run_fetch(
        self: Arc<Self>,
        slice: RateCheck,
        fetching: Fetching,
        waiting: Option<Waiting>,
    ) {
        let made_at = Instant::now();
        // charged once the store decides, held once installed: in transit until then
        let carried = self.in_transit.carry(slice.cost());
        let answer = lost::bounded(self.store.as_ref(), &self.policy, slice).await;
        // counted before the fetch is over, for a graceful shutdown that waits for both
        let lost = answer
            .as_ref()
            .is_err_and(lost::is_lost)
            .then(|| self.resolutions.start());
        if let Some(None) = lost {
            tracing::debug!(
                target: "tollgate::rate_limit",
                "a slice's answer was lost with too many being resolved: it is not"
            );
        }
        // a request that went away takes nothing from the slice
        let cost = waiting
            .as_ref()
            .filter(|waiting| !waiting.answer.is_closed())
            .map_or(0, |waiting| waiting.cost);
        let installed = self.install(slice, cost, answer, (&fetching, made_at));
        // a lost slice stays in transit while it is resolved
        let carried = matches!(lost, Some(Some(_))).then_some(carried);
        drop(fetching);
        self.hand_over(slice, cost, installed, waiting);
        if let Some(Some(resolving)) = lost {
            let (store, policy) = (Arc::clone(&self.store), Arc::clone(&self.policy));
            // the layer may go meanwhile: the resolution does not keep it
            drop(self);
            lost::resolve(store, policy, slice, made_at).await;
            drop((resolving, carried));
        }
    }

    /// Hands what came of `slice` to the request `waiting` for it, `cost` of it admitted; when
    /// that request went away meanwhile, `cost` goes back to the slice.
    fn hand_over(
        &self,
        slice: RateCheck,
        cost: u64,
        installed: Result<Option<RateOutcome>, StoreError>,
        waiting: Option<Waiting>,
    ) {
        match waiting {
            Some(waiting) => {
                if let Err(Ok(Some(_))) = waiting.answer.send(installed) {
                    self.unspend(slice, cost);
                }
            }
            None => {
                if let Err(error) = installed {
                    tracing::debug!(target: "tollgate::rate_limit", %error, "could not lease a slice");
                }
            }
        }
    }

    /// Returns `cost` to the slice `slice`, admitted to a request that went away before it
    /// heard so. (A slice retired meanwhile was settled with the cost spent.)
    fn unspend(&self, slice: RateCheck, cost: u64) {
        let key = slice.key();
        let mut shard = self.shard(&key);
        let held = shard
            .get_mut(&key)
            .and_then(|lease| lease.slices.iter_mut().find(|s| s.check == slice));
        if let Some(held) = held {
            held.used = held.used.saturating_sub(cost);
        }
    }

    /// Takes the store's answer to the slice `slice`, sent at `made_at`: when admitted, the slice
    /// is the caller's, `cost` of it spent, and the outcome of that admission is returned; when
    /// denied, `None`.
    fn install(
        self: &Arc<Self>,
        slice: RateCheck,
        cost: u64,
        answer: Result<RateOutcome, StoreError>,
        (fetching, made_at): (&Fetching, Instant),
    ) -> Result<Option<RateOutcome>, StoreError> {
        let key = slice.key();
        let now = Instant::now();
        let mut shard = self.shard(&key);
        let Some(lease) = shard.get_mut(&key).filter(|lease| fetching.is_for(lease)) else {
            drop(shard);
            // the caller's entry was swept, or forgotten on a reset (and maybe made anew), while
            // the slice was fetched: the slice may have been charged before the reset, so it is
            // given back — a settlement returns only what the store still counts
            if let Ok(outcome) = &answer
                && outcome.admitted
            {
                self.give_back(vec![slice.settle(cost)]);
            }
            return answer.map(|outcome| outcome.admitted.then_some(outcome));
        };
        lease.fetching = false;
        let outcome = answer?;
        lease.observe(&outcome);
        if !outcome.admitted {
            return Ok(None);
        }
        lease.slices.push(Slice {
            check: slice,
            used: cost,
            taken_at: now,
            ends: made_at + self.life(&outcome),
        });
        let admitted = RateOutcome {
            decided_at_us: outcome.decided_at_us,
            ..lease.outcome()
        };
        drop(shard);
        self.ensure_sweeper();
        Ok(Some(admitted))
    }
}

/// A slice being fetched for a caller: once the fetch is over, or dropped half-way (its request
/// went), the caller may fetch again, and who waits for it is woken (even when the caller's
/// entry is gone: reset, or swept).
struct Fetching {
    leases: Arc<Leases>,
    key: Key,
    fetched: Arc<tokio::sync::Notify>,
}

impl Fetching {
    /// Marks `key`'s fetch under way, when its entry is there to mark.
    fn new(leases: &Arc<Leases>, key: Key) -> Self {
        let fetched = leases
            .shard(&key)
            .get(&key)
            .map(|lease| Arc::clone(&lease.fetched))
            .unwrap_or_default();
        Self {
            leases: Arc::clone(leases),
            key,
            fetched,
        }
    }
}

impl Fetching {
    /// Whether `lease` is the entry this fetch was started for (not one made anew since).
    fn is_for(&self, lease: &Lease) -> bool {
        Arc::ptr_eq(&lease.fetched, &self.fetched)
    }
}

impl Drop for Fetching {
    fn drop(&mut self) {
        let mut shard = self.leases.shard(&self.key);
        if let Some(lease) = shard.get_mut(&self.key).filter(|lease| self.is_for(lease)) {
            lease.fetching = false;
        }
        drop(shard);
        self.fetched.notify_waiters();
    }
}
