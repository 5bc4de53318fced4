//! [`RateLimitLayer`]: what a layer is, and what it answers about its callers beside requests
//! (peeks, resets, leased slices).

use std::sync::Arc;

use http::request::Parts;
use tower_layer::Layer;

use super::limits::StoreLimits;
use super::service::RateLimit;
use super::settings::Settings;
use crate::key::{Global, Key, KeyExtractor};
use crate::rate::{RateOutcome, RatePolicy};
use crate::store::StoreError;

/// Applies [`RateLimit`] to a service: limits kept in a shared [`RateStore`](crate::store::RateStore).
///
/// Clones share their configuration; all of a layer's state lives in the store, so every clone —
/// and every copy of the service on the same store — enforces the same limits.
///
/// ```
/// use tollgate::key::PeerIp;
/// use tollgate::rate_limit::{Algorithm, Limit, RateLimitLayer};
/// use tollgate::store::MemoryStore;
///
/// let layer = RateLimitLayer::builder(MemoryStore::new())
///     .limit(Limit::per_second("burst", 10))
///     .limit(Limit::per_hour("hourly", 1000))
///     .algorithm(Algorithm::SlidingCounter)
///     .key(PeerIp::new())
///     .build()
///     .unwrap();
/// # let _ = layer;
/// ```
pub struct RateLimitLayer<K = Global> {
    pub(super) settings: Arc<Settings>,
    pub(super) extractor: Arc<K>,
}

impl<K> Clone for RateLimitLayer<K> {
    fn clone(&self) -> Self {
        Self {
            settings: Arc::clone(&self.settings),
            extractor: Arc::clone(&self.extractor),
        }
    }
}

debug_fields!(RateLimitLayer<K> { settings, extractor });

impl<K> RateLimitLayer<K> {
    /// The limits this layer checks (its own: those of the default tier), as in force on this
    /// copy now.
    pub fn policy(&self) -> Arc<RatePolicy> {
        Arc::clone(&self.settings.client.tiers().default_tier().policy)
    }

    /// The limits of tier `name` (see [`RateLimitLayerBuilder::tier`](super::RateLimitLayerBuilder::tier)), or the layer's own when
    /// it has no tier of that name — as for a request.
    pub fn tier_policy(&self, name: &str) -> Arc<RatePolicy> {
        Arc::clone(&self.settings.client.tiers().named(name).policy)
    }

    /// The layer's limits in force as the store keeps them, to read and change — `None` for a
    /// layer not built with [`build_in_store`](super::RateLimitLayerBuilder::build_in_store).
    pub fn limits(&self) -> Option<StoreLimits> {
        self.settings
            .client
            .in_store
            .is_some()
            .then(|| StoreLimits::new(Arc::clone(&self.settings.client)))
    }

    /// The key a request with head `parts` counts against, as the layer finds it; `None` when
    /// the extractor finds none. With [`peek`](Self::peek) and [`reset`](Self::reset) it serves
    /// an admin endpoint.
    pub fn key_of(&self, parts: &Parts) -> Option<Key>
    where
        K: KeyExtractor,
    {
        self.extractor.extract(parts)
    }

    /// Caller `key`'s state of each of the layer's own limits (of its own, where the
    /// [limits in force](Self::limits) give it some), without spending any: a check of
    /// cost 0 in the store (`admitted` says whether no limit is over its quota). Bounded by the
    /// store's timeout, as every check. Under tiers, [`peek_tier`](Self::peek_tier) names the
    /// tier and [`peek_request`](Self::peek_request) lets the layer choose it as for a request.
    ///
    /// ```
    /// # tokio_test_block_on(async {
    /// use tollgate::key::{Header, KeyExtractor};
    /// use tollgate::rate_limit::{Limit, RateLimitLayer};
    /// use tollgate::store::MemoryStore;
    ///
    /// let by_api_key = Header::from_static("x-api-key");
    /// let layer = RateLimitLayer::builder(MemoryStore::new())
    ///     .limit(Limit::per_hour("hourly", 100))
    ///     .key(by_api_key.clone())
    ///     .build()
    ///     .unwrap();
    /// let alice = by_api_key.key(b"alice");
    /// let quota = layer.peek(alice).await.unwrap();
    /// assert_eq!(quota.limits[0].remaining, 100);
    /// layer.reset(alice).await.unwrap();
    /// # });
    /// # fn tokio_test_block_on<F: std::future::Future>(f: F) -> F::Output {
    /// #     tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(f)
    /// # }
    /// ```
    pub async fn peek(&self, key: Key) -> Result<RateOutcome, StoreError> {
        let client = &self.settings.client;
        let tier = client.tiers().for_caller(key);
        client.peek(&tier, key).await
    }

    /// [`peek`](Self::peek) at the caller of a request with head `parts`, under the limits the
    /// request would be counted against: its key as the layer finds it, its tier as
    /// [`tier_by`](super::RateLimitLayerBuilder::tier_by) chooses it. `None` when the request carries
    /// no key.
    pub async fn peek_request(&self, parts: &Parts) -> Result<Option<RateOutcome>, StoreError>
    where
        K: KeyExtractor,
    {
        let Some(key) = self.extractor.extract(parts) else {
            return Ok(None);
        };
        let client = &self.settings.client;
        let tier = client.tiers().for_request(parts, Some(key));
        client.peek(&tier, key).await.map(Some)
    }

    /// [`peek`](Self::peek) at caller `key`'s state of tier `name`'s limits (the layer's own
    /// when it has no tier of that name, as for a request).
    pub async fn peek_tier(&self, name: &str, key: Key) -> Result<RateOutcome, StoreError> {
        let client = &self.settings.client;
        let tier = Arc::clone(client.tiers().named(name));
        client.peek(&tier, key).await
    }

    /// Forgets what caller `key` has spent of this layer's limits — of every tier, and of the
    /// per-request limits ([`limits_by`](super::RateLimitLayerBuilder::limits_by)) this copy has met —
    /// in the store (every copy sees it at once) and in this copy's deny cache. The store
    /// broadcasts the reset: another copy that cached a denial of `key` drops it within about a
    /// round trip, and admits; if the broadcast is lost, it asks the store again within a second
    /// (the deny cache's longest hold). See [Invalidations](crate::store#invalidations).
    pub async fn reset(&self, key: Key) -> Result<(), StoreError> {
        self.settings.client.reset(key).await
    }

    /// Gives back what this copy holds unspent of its [leased](crate::rate::Limit::leased)
    /// slices, with one settlement each, and waits for the store's answers: for a graceful
    /// shutdown, so that the quota is the other copies' at once. A slice being fetched is waited
    /// for and given back once it lands; one whose answer was lost, once the store's ledger
    /// says what it charged (within a few store timeouts). (Slices left when the layer is
    /// dropped are given back in the background.) Requests admitted afterwards lease again.
    pub async fn give_back_leases(&self) {
        self.settings.client.give_back_leases().await;
    }

    /// The layer's rate client: what an outbound limit corrects and waits through.
    pub(crate) fn rate_client(&self) -> Arc<crate::rate_client::RateClient> {
        Arc::clone(&self.settings.client)
    }

    /// What this copy holds unspent of its leased slices, over every caller and tier: charged
    /// in the store, not admitted yet — slices on their way counted as held (a fetch the store
    /// may have charged, whose answer has not landed; a slice given back or resolved, until its
    /// settlement lands). The most by which a caller may be admitted less than its quota is,
    /// at every moment, the sum of this over the copies.
    pub fn leases_unspent(&self) -> u64 {
        self.settings.client.leases_unspent()
    }
}

impl<K> RateLimitLayer<K> {
    /// Holds the requests waiting for room back while `gate` says so (a layer with a queue).
    pub(crate) fn hold_back(&self, gate: crate::rate_client::Gate) {
        if let Some(queue) = &self.settings.client.queue {
            queue.gate(gate);
        }
    }

    /// The key extractor, shared with the services the layer makes.
    pub(crate) fn extractor(&self) -> Arc<K> {
        Arc::clone(&self.extractor)
    }
}

impl<S, K> Layer<S> for RateLimitLayer<K> {
    type Service = RateLimit<S, K>;

    fn layer(&self, inner: S) -> Self::Service {
        RateLimit::new(
            inner,
            Arc::clone(&self.settings),
            Arc::clone(&self.extractor),
        )
    }
}
