//! Keeps a layer's deny cache in step with its store's invalidation broadcast: a caller reset or
//! refunded through any copy loses its cached denial here as soon as the store's word arrives.

use std::sync::{Arc, OnceLock};

use super::deny_cache::DenyCache;
use crate::store::{Invalidation, Invalidations, RateStore};
use crate::task::AbortOnDrop;

/// A layer's subscription to its store's invalidations, made once, on the first request made
/// inside a Tokio runtime. The task it runs stops when the layer goes (its last clone and
/// service dropped), or when the store's broadcast ends.
#[derive(Debug, Default)]
pub(crate) struct Listener {
    /// `None` inside: the store broadcasts nothing.
    task: OnceLock<Option<AbortOnDrop>>,
}

impl Listener {
    /// Subscribes `cache` to `store`'s invalidations of the policies named `namespaces`, unless
    /// done already or outside a Tokio runtime.
    pub(crate) fn ensure<'a>(
        &self,
        store: &dyn RateStore,
        cache: &Arc<DenyCache>,
        namespaces: impl Iterator<Item = &'a str>,
    ) {
        if self.task.get().is_some() || tokio::runtime::Handle::try_current().is_err() {
            return;
        }
        self.task.get_or_init(|| {
            let invalidations = store.invalidations()?;
            let namespaces = namespaces.map(Box::from).collect();
            let cache = Arc::clone(cache);
            let task = tokio::spawn(drop_invalidated(invalidations, cache, namespaces));
            Some(AbortOnDrop(task))
        });
    }
}

/// Drops the cached denials that `invalidations` make stale: of a caller reset or refunded under
/// one of `namespaces` (another layer's policies on the same store are none of this one's
/// business), or every denial when some invalidations were missed.
async fn drop_invalidated(
    mut invalidations: Invalidations,
    cache: Arc<DenyCache>,
    namespaces: Box<[Box<str>]>,
) {
    while let Some(invalidation) = invalidations.next().await {
        match invalidation {
            Invalidation::Caller { namespace, key } => {
                if namespaces.iter().any(|ours| **ours == *namespace) {
                    cache.forget(key);
                }
            }
            // `Missed`, and whatever a later version adds: dropping every denial is always safe
            _ => cache.clear(),
        }
    }
}
