//! What every clone of a concurrency-limit layer shares.

use std::sync::Arc;
use std::time::Duration;

use http::request::Parts;

use super::permit::LocalPermits;
use crate::key::MissingKey;
use crate::on_error::OnStoreError;
use crate::pace::OncePerSecond;
use crate::store::PermitStore;

/// Chooses a request's tier by name, from its head.
pub(crate) type TierBy = Arc<dyn Fn(&Parts) -> Option<&str> + Send + Sync>;

/// What every clone of a layer shares.
pub(crate) struct Settings {
    pub(crate) store: Arc<dyn PermitStore>,
    /// The layer's own limit.
    pub(crate) limit: u32,
    /// The named tiers' limits, and how a request picks one.
    pub(crate) tiers: Vec<(Box<str>, u32)>,
    pub(crate) tier_by: Option<TierBy>,
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
}

impl Settings {
    /// The limit of tier `name`, or the layer's own.
    pub(crate) fn tier_limit(&self, name: &str) -> u32 {
        let tier = self.tiers.iter().find(|(tier, _)| &**tier == name);
        tier.map_or(self.limit, |&(_, limit)| limit)
    }

    /// The limit a request with head `parts` counts against.
    pub(crate) fn limit_for(&self, parts: &Parts) -> u32 {
        let name = self.tier_by.as_ref().and_then(|select| select(parts));
        name.map_or(self.limit, |name| self.tier_limit(name))
    }
}

debug_fields!(Settings {
    store,
    limit,
    tiers,
    lease,
    retry_after,
    queue,
    on_store_error,
    missing_key,
    prefix
});
