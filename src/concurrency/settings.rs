//! What every clone of a concurrency-limit layer shares.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use arc_swap::ArcSwap;
use http::request::Parts;

use super::limits::{InFlight, InFlightRecipe};
use super::permit::LocalPermits;
use crate::in_force::{Follows, InForce, Place};
use crate::key::{Key, MissingKey};
use crate::on_error::OnStoreError;
use crate::pace::OncePerSecond;
use crate::rate_client::{Invalidated, Listener};
use crate::store::PermitStore;

/// Chooses a request's tier by name, from its head.
pub(crate) type TierBy = Arc<dyn Fn(&Parts) -> Option<&str> + Send + Sync>;

/// What every clone of a layer shares.
pub(crate) struct Settings {
    pub(crate) store: Arc<dyn PermitStore>,
    /// The limits: the layer's own, the named tiers', callers' own.
    pub(crate) limits: ArcSwap<InFlight>,
    /// How a request picks a tier.
    pub(crate) tier_by: Option<TierBy>,
    /// The limits in force, for a layer built with them in the store.
    pub(crate) in_store: Option<InForce<InFlightRecipe>>,
    /// Hears of the limits in force changed through other copies.
    pub(crate) listener: Listener,
    /// The policy name the IETF headers advertise the limit under, if they do.
    pub(crate) advertise: Option<Box<str>>,
    pub(crate) lease: Duration,
    pub(crate) retry_after: Option<Duration>,
    /// How long a request may wait in the queue for a permit.
    pub(crate) queue: Option<Duration>,
    pub(crate) on_store_error: OnStoreError,
    /// The local fallback's permits, with [`OnStoreError::LocalFallback`].
    pub(crate) local: Option<Arc<LocalPermits>>,
    pub(crate) missing_key: MissingKey,
    pub(crate) missing_key_message: Box<str>,
    pub(crate) prefix: Arc<str>,
    /// The metrics label: `<prefix>:cc`.
    pub(crate) limiter: Arc<str>,
    /// A failing store is logged at warn at most once a second.
    pub(crate) store_warning: OncePerSecond,
    /// Whether a replay of an idempotency layer inside was said to have taken a permit.
    pub(crate) replay_warned: AtomicBool,
}

impl Settings {
    /// A replay of an idempotency layer inside this one took a permit: the layers are stacked
    /// the wrong way round for a limit in flight (said once per layer, at warn).
    pub(crate) fn replay_took_a_permit(&self) {
        if !self.replay_warned.swap(true, Ordering::Relaxed) {
            tracing::warn!(
                target: "tollgate::concurrency",
                limiter = &*self.limiter,
                "a replay of an idempotency layer inside this concurrency limit took a permit: \
                 replays of a completed key at once are refused beyond the limit. Put the \
                 concurrency limit inside the idempotency layer (tollgate::stack::Stack does)"
            );
        }
    }

    /// The limit a request with head `parts` by caller `key` counts against.
    pub(crate) fn limit_for(&self, parts: &Parts, key: Option<&Key>) -> u32 {
        let tier = self.tier_by.as_ref().and_then(|select| select(parts));
        self.limits.load().of(tier, key)
    }

    /// Reads the limits in force and makes them the layer's; then follows them, at each
    /// refresh and each broadcast of a change, as long as the layer lives.
    pub(crate) async fn start_in_store(self: &Arc<Self>) {
        if self.in_store.is_some() {
            Self::start_following(self).await;
            self.listener
                .ensure(|| self.store.permit_invalidations(), self);
        }
    }
}

impl Follows for Settings {
    type Recipe = InFlightRecipe;

    fn in_force(&self) -> Option<&InForce<InFlightRecipe>> {
        self.in_store.as_ref()
    }

    fn place(&self) -> Place<'_, InFlight> {
        Place {
            store: self.store.permit_limits(),
            built: &self.limits,
        }
    }
}

/// A concurrency limit keeps nothing of a caller's to drop: it hears only of changes of its
/// limits in force.
impl Invalidated for Settings {
    fn caller(&self, _: &str, _: Key) {}

    fn missed(&self) {}

    fn limits(self: &Arc<Self>, namespace: &str) {
        Self::heard_of_change(self, namespace);
    }
}

debug_fields!(Settings {
    store,
    limits,
    in_store,
    lease,
    retry_after,
    queue,
    on_store_error,
    missing_key,
    prefix
});
