//! [`OutboundLimitLayer`]: a rate limit on the calls a client makes.

use std::sync::{Arc, PoisonError};
use std::time::Duration;

use tower_layer::Layer;

use super::counts::ProviderCounts;
use super::pause::{Pause, PauseBook};
use super::service::{OutboundLimit, Shared};
use crate::error::ConfigError;
use crate::key::{Global, KeyExtractor};
use crate::rate_limit::{RateLimitLayer, RateLimitLayerBuilder};
use crate::store::LockStore;

/// How long a call waits for room unless the builder's
/// [`queue`](crate::rate_limit::RateLimitLayerBuilder::queue) says otherwise.
pub(crate) const DEFAULT_PATIENCE: Duration = Duration::from_secs(30);

/// Applies [`OutboundLimit`] to a client: made by
/// [`RateLimitLayerBuilder::build_outbound`](crate::rate_limit::RateLimitLayerBuilder::build_outbound).
/// See the [module](super).
///
/// Clones share their configuration, and the pauses the provider asked for on this copy.
pub struct OutboundLimitLayer<K = Global> {
    pub(super) rate: RateLimitLayer<K>,
    pub(super) shared: Arc<Shared>,
}

impl<K> Clone for OutboundLimitLayer<K> {
    fn clone(&self) -> Self {
        Self {
            rate: self.rate.clone(),
            shared: Arc::clone(&self.shared),
        }
    }
}

debug_fields!(OutboundLimitLayer<K> { rate, shared });

impl<K> OutboundLimitLayer<K> {
    /// The layer of `rate`'s limits, whose calls wait up to `patience`.
    pub(crate) fn new(rate: RateLimitLayer<K>, patience: Duration) -> Self {
        let book = Arc::new(PauseBook::default());
        // the calls waiting for room are held back while the provider's pause lasts
        let gate_book = Arc::clone(&book);
        rate.hold_back(Arc::new(move |key| {
            let book = Arc::clone(&gate_book);
            Box::pin(async move { book.paused_until(key).await })
        }));
        let client = rate.rate_client();
        Self {
            rate,
            shared: Arc::new(Shared {
                patience,
                book,
                client,
                corrections: Arc::default(),
            }),
        }
    }

    /// How a provider's `429` or `503` pauses the calls of its key (default
    /// [`Pause::default`]); for every clone of the layer.
    pub fn pause(self, pause: Pause) -> Self {
        *self
            .shared
            .book
            .pause
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = pause;
        self
    }

    /// How the provider's own counts on its answers (`RateLimit`, `x-ratelimit-remaining`,
    /// ...) are read (default [`ProviderCounts::default`]; [`ProviderCounts::off`] reads none);
    /// for every clone of the layer. A count of 0 pauses the key's calls until its reset, as a
    /// `429` does (shared with [`share_pauses`](Self::share_pauses)); a positive count below
    /// the store's — the least remaining of the limits — charges the difference to every limit
    /// of the call's tier, once the answer is in (one correction of a key at a time on a copy,
    /// and across the copies with [`share_pauses`](Self::share_pauses)).
    pub fn provider_counts(self, counts: ProviderCounts) -> Self {
        *self
            .shared
            .book
            .counts
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = counts;
        self
    }

    /// Makes a call wait out a store that fails, instead of following the builder's
    /// [`on_store_error`](crate::rate_limit::RateLimitLayerBuilder::on_store_error): the call
    /// waits in its key's line, whose first asks the store again after 50 ms, then after
    /// twice as long each time (up to 1.6 s), and once more when its patience ends; it is made
    /// as soon as the store admits it, and fails with
    /// [`OutboundError::StoreUnavailable`](super::OutboundError::StoreUnavailable) when the
    /// store still fails then (a check already sent may take up to the store's timeout more).
    /// For every clone of the layer. For a worker that would rather wait than call a provider
    /// unpaced or not at all.
    pub fn wait_for_store(self) -> Self {
        if let Some(queue) = &self.shared.client.queue {
            queue.wait_for_store();
        }
        self
    }

    /// Shares the provider's pauses with every copy through `store` (any store of this crate;
    /// set once, for every clone of the layer): a copy that gets a `429` or `503` writes the
    /// pause there (a claim that expires with it; one in force is kept, not lengthened), and
    /// every copy reads it before each call of that key, and before each check of a call
    /// waiting for room — one more round trip each, none while the copy knows of a pause. A
    /// store that fails is logged, and the call goes on to its limits. The copies also take
    /// turns there to correct a key's count to the [provider's](Self::provider_counts).
    pub fn share_pauses(self, store: impl LockStore) -> Self {
        let namespace = Arc::from(self.rate.policy().namespace());
        let store: Arc<dyn LockStore> = Arc::new(store);
        let _ = self.shared.book.shared.set((store, namespace));
        self
    }

    /// The rate limit that decides the calls: its policy, peeks, resets and limits in force.
    pub fn rate_limit(&self) -> &RateLimitLayer<K> {
        &self.rate
    }
}

impl<K> RateLimitLayerBuilder<K> {
    /// Builds the layer for a client: a limit on the calls it makes (see
    /// [`outbound`](crate::outbound)). The same as [`build`](Self::build), but a call the limits
    /// deny waits for room — up to the [`queue`](Self::queue)'s patience, 30 s unless set —
    /// and fails with [`OutboundError::Limited`](super::OutboundError::Limited) past it; no
    /// `RateLimit` headers are added to the provider's answers.
    ///
    /// # Errors
    ///
    /// As [`build`](Self::build).
    pub fn build_outbound(self) -> Result<OutboundLimitLayer<K>, ConfigError>
    where
        K: KeyExtractor,
    {
        let (builder, patience) = self.headers_on_success(false).patience_or(DEFAULT_PATIENCE);
        Ok(OutboundLimitLayer::new(builder.build()?, patience))
    }
}

impl<S, K> Layer<S> for OutboundLimitLayer<K> {
    type Service = OutboundLimit<S, K>;

    fn layer(&self, inner: S) -> Self::Service {
        OutboundLimit::new(
            self.rate.layer(inner),
            self.rate.extractor(),
            Arc::clone(&self.shared),
        )
    }
}
