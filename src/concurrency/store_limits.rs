//! [`ConcurrencyLimits`]: a concurrency limit's limits in force, to read and change.

use std::sync::Arc;

use super::settings::Settings;
use crate::error::ConfigError;
use crate::in_force::{Changed, Follows, LimitsError, change_stored};
use crate::key::Key;
use crate::rate::{LimitTable, StoredTable, TableChange};
use crate::store::{CopySeen, LimitsStore, StoreError};

/// The limits of requests in flight of a layer built with
/// [`build_in_store`](super::ConcurrencyLimitLayerBuilder::build_in_store), read from and
/// changed in the store for every copy at once. Made by
/// [`ConcurrencyLimitLayer::limits`](super::ConcurrencyLimitLayer::limits).
///
/// A change is checked first (a limit of zero is refused, a tier must be one the layer's code
/// names), saved on condition that nobody saved another since it was read, recorded with its
/// note in the history, in force on this copy at once and on every other at the store's
/// broadcast of it — within its [refresh](super::ConcurrencyLimitLayerBuilder::limits_refresh)
/// plus a round trip where the broadcast is lost.
///
/// What a change does to the permits in use: none is taken back. A lowered limit refuses new
/// requests (or keeps them waiting, with a [queue](super::ConcurrencyLimitLayerBuilder::queue))
/// until fewer than the new limit are in flight; a raised one admits them at once. A request
/// counts against the limit in force when it arrived.
///
/// ```
/// # #[tokio::main(flavor = "current_thread")] async fn main() {
/// use tollgate::concurrency::ConcurrencyLimitLayer;
/// use tollgate::key::Header;
/// use tollgate::rate_limit::Changed;
/// use tollgate::store::MemoryStore;
///
/// let by_tenant = Header::from_static("x-tenant");
/// let layer = ConcurrencyLimitLayer::builder(MemoryStore::new())
///     .limit(2)
///     .key(by_tenant.clone())
///     .build_in_store()
///     .await
///     .unwrap();
/// let limits = layer.limits().unwrap();
/// let acme = by_tenant.key(b"acme");
/// let changed = limits.set_caller(acme, 20, "acme runs batch jobs").await.unwrap();
/// assert_eq!(changed, Changed::Saved(2));
/// assert_eq!(layer.caller_limit(acme), 20);
/// // a limit of zero is refused, and the limits in force stay
/// assert!(limits.set_caller(acme, 0, "").await.is_err());
/// assert_eq!(limits.in_force().version, 2);
/// # }
/// ```
#[derive(Debug, Clone)]
pub struct ConcurrencyLimits {
    settings: Arc<Settings>,
}

impl ConcurrencyLimits {
    pub(super) fn new(settings: Arc<Settings>) -> Self {
        Self { settings }
    }

    /// The limits in force on this copy, and their version.
    pub fn in_force(&self) -> StoredTable {
        self.settings.held_in_force()
    }

    /// Reads the limits in force from the store now (as the layer does every refresh); the
    /// version this copy holds after.
    ///
    /// # Errors
    ///
    /// The store's failure; the copy keeps deciding with what it held.
    pub async fn refresh(&self) -> Result<u64, StoreError> {
        let (in_force, place) = self.settings.reading()?;
        in_force.refresh(&place).await
    }

    /// Lets caller `key` have `limit` requests in flight, in place of its tier's limit.
    ///
    /// # Errors
    ///
    /// [`LimitsError::Invalid`] for a limit of zero; else see [`LimitsError`].
    pub async fn set_caller(
        &self,
        key: Key,
        limit: u32,
        note: &str,
    ) -> Result<Changed, LimitsError> {
        let (in_force, place) = self.settings.changing()?;
        let limits = LimitTable::in_flight_limits(limit);
        in_force.set_caller(&place, key, limits, note).await
    }

    /// Takes caller `key` back to its tier's limit.
    ///
    /// # Errors
    ///
    /// [`LimitsError::Invalid`] when the caller has no limit of its own; else see
    /// [`LimitsError`].
    pub async fn unset_caller(&self, key: Key, note: &str) -> Result<Changed, LimitsError> {
        let (in_force, place) = self.settings.changing()?;
        in_force.unset_caller(&place, key, note).await
    }

    /// Replaces tier `tier`'s limit (`None`: the layer's own) for every copy.
    ///
    /// # Errors
    ///
    /// [`LimitsError::Invalid`] for a limit of zero or a tier the layer does not have; else
    /// see [`LimitsError`].
    pub async fn set_tier(
        &self,
        tier: Option<&str>,
        limit: u32,
        note: &str,
    ) -> Result<Changed, LimitsError> {
        let (in_force, place) = self.settings.changing()?;
        let limits = LimitTable::in_flight_limits(limit);
        in_force.set_tier(&place, tier, limits, note).await
    }

    /// Takes tier `tier` (`None`: the layer's own) back to the limit its code writes.
    ///
    /// # Errors
    ///
    /// [`LimitsError::Invalid`] for a tier the layer does not have, or one not replaced; else
    /// see [`LimitsError`].
    pub async fn unset_tier(&self, tier: Option<&str>, note: &str) -> Result<Changed, LimitsError> {
        let (in_force, place) = self.settings.changing()?;
        in_force.unset_tier(&place, tier, note).await
    }

    /// The copies of the layer the store has seen lately, with what each was built with (see
    /// [`StoreLimits::copies`](crate::rate_limit::StoreLimits::copies)).
    ///
    /// # Errors
    ///
    /// The store's failure.
    pub async fn copies(&self) -> Result<Vec<CopySeen>, StoreError> {
        let (in_force, place) = self.settings.reading()?;
        in_force.copies(&place).await
    }

    /// The changes of the limits in force, the newest first (the last
    /// [`HISTORY_KEPT`](crate::store::HISTORY_KEPT)).
    ///
    /// # Errors
    ///
    /// The store's failure.
    pub async fn history(&self) -> Result<Vec<TableChange>, StoreError> {
        let (in_force, place) = self.settings.reading()?;
        in_force.history(&place).await
    }
}

/// Changes the limits in force of the concurrency limit with `prefix` kept in `store`, without
/// a layer — for operators' tools, such as `tollgate limits set --in-flight`: as
/// [`rate_limit::change_limits`](crate::rate_limit::change_limits) does for a rate limit. Each
/// entry must be one limit of requests in flight ([`LimitTable::in_flight_limits`]).
///
/// ```
/// # #[tokio::main(flavor = "current_thread")] async fn main() {
/// use tollgate::concurrency::{ConcurrencyLimitLayer, change_limits};
/// use tollgate::rate::LimitTable;
/// use tollgate::rate_limit::Changed;
/// use tollgate::store::MemoryStore;
///
/// let store = MemoryStore::new();
/// let layer = ConcurrencyLimitLayer::builder(store.clone())
///     .limit(4)
///     .prefix("jobs")
///     .build_in_store()
///     .await
///     .unwrap();
/// let changed = change_limits(&store, "jobs", "fewer at once", |table| {
///     table.set_tier(None, LimitTable::in_flight_limits(2));
///     Ok(())
/// })
/// .await
/// .unwrap();
/// assert_eq!(changed, Changed::Saved(2));
/// layer.limits().unwrap().refresh().await.unwrap();
/// assert_eq!(layer.limit(), 2);
/// # }
/// ```
///
/// # Errors
///
/// [`LimitsError::Invalid`] when the store holds no limits under the prefix, or the change is
/// refused; else see [`LimitsError`].
pub async fn change_limits(
    store: &dyn LimitsStore,
    prefix: &str,
    note: &str,
    edit: impl Fn(&mut LimitTable) -> Result<(), ConfigError>,
) -> Result<Changed, LimitsError> {
    let namespace =
        crate::store::keys::concurrency_namespace(prefix).map_err(LimitsError::Invalid)?;
    change_stored(store, &namespace, note, edit).await
}
