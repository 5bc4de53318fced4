//! [`StoreLimits`]: a layer's limits in force, as the store keeps them, to read and change.

use std::sync::Arc;

use crate::in_force::{Changed, Follows, LimitsError, change_stored};
use crate::key::Key;
use crate::rate::{Limit, LimitTable, StoredTable, TableChange};
use crate::rate_client::RateClient;
use crate::store::{CopySeen, LimitsStore, StoreError};

/// The limits in force of a layer built with
/// [`build_in_store`](super::RateLimitLayerBuilder::build_in_store): read from and changed in
/// the store, for every copy at once. Made by [`RateLimitLayer::limits`](super::RateLimitLayer::limits).
///
/// A change is checked first — every tier and override must build as the layer's own limits
/// would (a quota of zero, a duplicate name, a window past the algorithm's bounds are refused),
/// and a tier must be one the layer's code names — then saved on condition that nobody saved
/// another since it was read, recorded with its note in the table's history, and in force on
/// this copy at once; on every other copy within its
/// [refresh](super::RateLimitLayerBuilder::limits_refresh) plus a round trip. A refused change
/// leaves the limits in force as they were.
///
/// What a change does to what callers hold: spent quota is kept by limit name (a caller whose
/// quota is raised from 100 to 5,000 keeps the 90 it spent); a caller's block stays until it
/// ends; leased slices are given back by every copy when it takes the change, and new ones are
/// sized by the new quota.
///
/// ```
/// # #[tokio::main(flavor = "current_thread")] async fn main() {
/// use tollgate::key::Header;
/// use tollgate::rate_limit::{Changed, Limit, RateLimitLayer};
/// use tollgate::store::MemoryStore;
///
/// let by_tenant = Header::from_static("x-tenant");
/// let layer = RateLimitLayer::builder(MemoryStore::new())
///     .limit(Limit::per_minute("minute", 100))
///     .key(by_tenant.clone())
///     .build_in_store()
///     .await
///     .unwrap();
/// let limits = layer.limits().unwrap();
/// let acme = by_tenant.key(b"acme");
/// let changed = limits
///     .set_caller(acme, vec![Limit::per_minute("minute", 5000)], "acme on the big plan")
///     .await
///     .unwrap();
/// assert_eq!(changed, Changed::Saved(2));
/// assert_eq!(layer.peek(acme).await.unwrap().limits[0].remaining, 5000);
/// // a quota of zero is refused, and the limits in force stay
/// let refused = limits.set_caller(acme, vec![Limit::per_minute("minute", 0)], "").await;
/// assert!(refused.is_err());
/// assert_eq!(limits.in_force().version, 2);
/// assert_eq!(limits.history().await.unwrap()[0].note, "acme on the big plan");
/// # }
/// ```
#[derive(Debug, Clone)]
pub struct StoreLimits {
    client: Arc<RateClient>,
}

impl StoreLimits {
    pub(super) fn new(client: Arc<RateClient>) -> Self {
        Self { client }
    }

    /// The limits in force on this copy, and their version.
    pub fn in_force(&self) -> StoredTable {
        self.client.held_in_force()
    }

    /// Reads the limits in force from the store now (as the layer does every refresh); the
    /// version this copy holds after.
    ///
    /// # Errors
    ///
    /// The store's failure; the copy keeps deciding with what it held.
    pub async fn refresh(&self) -> Result<u64, StoreError> {
        let (in_force, place) = self.client.reading()?;
        in_force.refresh(&place).await
    }

    /// Gives caller `key` limits of its own — a tenant's plan — in place of its tier's,
    /// counted under the layer's own limit names.
    ///
    /// # Errors
    ///
    /// See [`LimitsError`].
    pub async fn set_caller(
        &self,
        key: Key,
        limits: Vec<Limit>,
        note: &str,
    ) -> Result<Changed, LimitsError> {
        let (in_force, place) = self.client.changing()?;
        in_force.set_caller(&place, key, limits, note).await
    }

    /// Takes caller `key` back to its tier's limits.
    ///
    /// # Errors
    ///
    /// [`LimitsError::Invalid`] when the caller has no override; else see [`LimitsError`].
    pub async fn unset_caller(&self, key: Key, note: &str) -> Result<Changed, LimitsError> {
        let (in_force, place) = self.client.changing()?;
        in_force.unset_caller(&place, key, note).await
    }

    /// Replaces tier `tier`'s limits (`None`: the layer's own) for every copy.
    ///
    /// # Errors
    ///
    /// [`LimitsError::Invalid`] for a tier the layer does not have; else see [`LimitsError`].
    pub async fn set_tier(
        &self,
        tier: Option<&str>,
        limits: Vec<Limit>,
        note: &str,
    ) -> Result<Changed, LimitsError> {
        let (in_force, place) = self.client.changing()?;
        in_force.set_tier(&place, tier, limits, note).await
    }

    /// Takes tier `tier` (`None`: the layer's own) back to its defaults.
    ///
    /// # Errors
    ///
    /// [`LimitsError::Invalid`] for a tier the layer does not have, or one not replaced; else
    /// see [`LimitsError`].
    pub async fn unset_tier(&self, tier: Option<&str>, note: &str) -> Result<Changed, LimitsError> {
        let (in_force, place) = self.client.changing()?;
        in_force.unset_tier(&place, tier, note).await
    }

    /// The copies of the layer the store has seen lately (each registers at its start and
    /// again every few refreshes, and counts as gone when it has not for three refreshes or
    /// ten seconds), with what each was built with: a copy whose
    /// [`built`](crate::store::CopySeen::built) differs from
    /// [`defaults_id`](crate::rate::LimitTable::defaults_id) of the limits in force was built
    /// with other defaults, which do not apply.
    ///
    /// # Errors
    ///
    /// The store's failure.
    pub async fn copies(&self) -> Result<Vec<CopySeen>, StoreError> {
        let (in_force, place) = self.client.reading()?;
        in_force.copies(&place).await
    }

    /// The changes of the limits in force, the newest first (the last
    /// [`HISTORY_KEPT`](crate::store::HISTORY_KEPT)).
    ///
    /// # Errors
    ///
    /// The store's failure.
    pub async fn history(&self) -> Result<Vec<TableChange>, StoreError> {
        let (in_force, place) = self.client.reading()?;
        in_force.history(&place).await
    }
}

/// Changes the limits in force of the layer with `prefix` kept in `store`, without a layer — for
/// operators' tools, such as `tollgate limits set`: reads the table, applies `edit`, checks
/// every tier and override as the table's algorithm counts them
/// ([`LimitTable::check`](crate::rate::LimitTable::check)), and saves it with `note` on
/// condition that nobody saved another since the read (read and edited anew when someone did).
/// Every copy of the layer takes it within its refresh.
///
/// ```
/// # #[tokio::main(flavor = "current_thread")] async fn main() {
/// use tollgate::key::Key;
/// use tollgate::rate_limit::{Changed, Limit, RateLimitLayer, change_limits};
/// use tollgate::store::MemoryStore;
///
/// let store = MemoryStore::new();
/// let layer = RateLimitLayer::builder(store.clone())
///     .limit(Limit::per_minute("api", 100))
///     .prefix("app")
///     .build_in_store()
///     .await
///     .unwrap();
/// let changed = change_limits(&store, "app", "a quieter default", |table| {
///     table.set_tier(None, vec![Limit::per_minute("api", 50)]);
///     Ok(())
/// })
/// .await
/// .unwrap();
/// assert_eq!(changed, Changed::Saved(2));
/// layer.limits().unwrap().refresh().await.unwrap();
/// assert_eq!(layer.policy().limits()[0].quota(), 50);
/// // a prefix no layer keeps its limits under
/// assert!(change_limits(&store, "other", "", |_| Ok(())).await.is_err());
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
    edit: impl Fn(&mut LimitTable) -> Result<(), crate::ConfigError>,
) -> Result<Changed, LimitsError> {
    let namespace = crate::store::keys::rate_namespace(prefix).map_err(LimitsError::Invalid)?;
    change_stored(store, &namespace, note, edit).await
}
