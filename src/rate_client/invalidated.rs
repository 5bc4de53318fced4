//! Keeps a rate client's copy-local state in step with its store's invalidation broadcast: a
//! caller reset or refunded through any copy loses its cached denial here, and a caller reset
//! loses the slices this copy leased of its quota, as soon as the store's word arrives.

use std::sync::{Arc, OnceLock, Weak};

use crate::key::Key;
use crate::store::{Invalidation, Invalidations};
use crate::task::AbortOnDrop;

/// What a copy keeps that the store's invalidations make stale.
pub(crate) trait Invalidated: Send + Sync + 'static {
    /// Caller `key` was reset or refunded under `namespace` through some copy.
    fn caller(&self, namespace: &str, key: Key);

    /// Some invalidations may have been missed.
    fn missed(&self);

    /// The limits in force of the layer of `namespace` were changed through some copy.
    fn limits(self: &Arc<Self>, namespace: &str) {
        let _ = namespace;
    }
}

/// A subscription to a store's invalidations, made once, on the first request made inside a
/// Tokio runtime. The task it runs stops when what it keeps fresh goes (its layer's last clone
/// and service dropped), or when the store's broadcast ends.
#[derive(Debug, Default)]
pub(crate) struct Listener {
    /// `None` inside: the store broadcasts nothing.
    task: OnceLock<Option<AbortOnDrop>>,
}

impl Listener {
    /// Subscribes `kept` to the store's invalidations (`subscribe`), unless done already, or
    /// outside a Tokio runtime.
    pub(crate) fn ensure<T: Invalidated>(
        &self,
        subscribe: impl FnOnce() -> Option<Invalidations>,
        kept: &Arc<T>,
    ) {
        if self.task.get().is_some() || tokio::runtime::Handle::try_current().is_err() {
            return;
        }
        self.task.get_or_init(|| {
            let invalidations = subscribe()?;
            let task = tokio::spawn(drop_invalidated(invalidations, Arc::downgrade(kept)));
            Some(AbortOnDrop(task))
        });
    }
}

/// Tells `kept` what `invalidations` make stale, while it lives.
async fn drop_invalidated<T: Invalidated>(mut invalidations: Invalidations, kept: Weak<T>) {
    while let Some(invalidation) = invalidations.next().await {
        let Some(kept) = kept.upgrade() else {
            return;
        };
        match invalidation {
            Invalidation::Caller { namespace, key } => kept.caller(&namespace, key),
            Invalidation::Limits { namespace } => kept.limits(&namespace),
            // `Missed`, and whatever a later version adds: dropping every denial is always safe
            _ => kept.missed(),
        }
    }
}
