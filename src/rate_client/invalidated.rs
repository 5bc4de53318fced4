//! Keeps a rate client's copy-local state in step with its store's invalidation broadcast: a caller
//! reset or refunded through any copy loses its cached denial here, and a caller reset loses the
//! slices this copy leased of its quota, as soon as the store's word arrives.

use std::sync::{Arc, OnceLock, Weak};

use super::client::RateClient;
use crate::store::{Invalidation, Invalidations};
use crate::task::AbortOnDrop;

/// A rate client's subscription to its store's invalidations, made once, on the first request made
/// inside a Tokio runtime. The task it runs stops when the client goes (its layer's last clone
/// and service dropped), or when the store's broadcast ends.
#[derive(Debug, Default)]
pub(crate) struct Listener {
    /// `None` inside: the store broadcasts nothing.
    task: OnceLock<Option<AbortOnDrop>>,
}

impl Listener {
    /// Subscribes `client` to its store's invalidations, unless done already, or outside a Tokio
    /// runtime.
    pub(crate) fn ensure(&self, client: &Arc<RateClient>) {
        if self.task.get().is_some() || tokio::runtime::Handle::try_current().is_err() {
            return;
        }
        self.task.get_or_init(|| {
            let invalidations = client.store.invalidations()?;
            let task = tokio::spawn(drop_invalidated(invalidations, Arc::downgrade(client)));
            Some(AbortOnDrop(task))
        });
    }
}

/// Drops what `invalidations` make stale, while the client lives:
/// - of a caller reset or refunded under one of the layer's namespaces (another layer's
///   policies on the same store are none of this one's business), its cached denial and — a
///   leased tier's invalidation can only be a reset, as a slice's settlement is
///   [quiet](crate::rate::RateCheck::quiet) and leased tiers settle nothing else — its slices,
///   given back (the store refunds nothing of a charge the reset erased);
/// - when some invalidations were missed, every cached denial (slices are kept: a reset missed
///   here is spent past by at most one lease's slices).
async fn drop_invalidated(mut invalidations: Invalidations, client: Weak<RateClient>) {
    while let Some(invalidation) = invalidations.next().await {
        let Some(client) = client.upgrade() else {
            return;
        };
        match invalidation {
            Invalidation::Caller { namespace, key } => {
                let tiers = client.tiers.all();
                let ours = tiers.iter().filter(|t| t.policy.namespace() == &*namespace);
                let mut known = false;
                for tier in ours {
                    known = true;
                    if let Some(leases) = &tier.leases {
                        leases.forget(key);
                    }
                }
                if let Some(cache) = client.deny_cache.as_ref().filter(|_| known) {
                    cache.forget(key);
                }
            }
            // `Missed`, and whatever a later version adds: dropping every denial is always safe
            _ => {
                if let Some(cache) = &client.deny_cache {
                    cache.clear();
                }
            }
        }
    }
}
