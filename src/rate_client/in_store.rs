//! The limits in force, kept in the store: how a client reads them at its start, follows their
//! changes, and changes them.
//!
//! A copy decides with one [`StoredTable`] at a time, held with the tiers built of it. It reads
//! the store's at its start — seeding it with the code's limits when there is none, replacing
//! the defaults when its code's revision is higher — and again every `refresh`; a change made
//! through it is in force on it at once. A table is installed only when newer than the one held,
//! so a slow read never takes a copy back.

use std::fmt;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use arc_swap::ArcSwap;

use super::recipe::{Recipe, unknown_tier};
use super::tiers::Tiers;
use crate::error::ConfigError;
use crate::metrics;
use crate::pace::OncePerSecond;
use crate::rate::{LimitTable, StoredTable, TableChange};
use crate::store::{CopySeen, LimitsStore, RateStore, Saved, StoreError, StoreErrorKind};

/// How many times a change reads the table again when another change was saved between its
/// read and its save.
const CHANGE_TRIES: usize = 8;

/// What a client keeps of its limits in force.
pub(crate) struct InStore {
    pub(crate) recipe: Recipe,
    /// The revision of the code's limits (see [`LimitTable::revision`]).
    pub(crate) revision: u64,
    /// How often the table is read again.
    pub(crate) refresh: Duration,
    /// The table in force on this copy; version 0 until one was read.
    held: Mutex<StoredTable>,
    /// Failures to read the table are logged at warn at most once a second.
    read_warning: OncePerSecond,
    /// This copy's id in the store's list of copies, and what it was built with.
    copy: String,
    built: String,
    /// When this copy last registered.
    registered: Mutex<Option<tokio::time::Instant>>,
}

debug_fields!(InStore {
    recipe,
    revision,
    refresh
});

impl InStore {
    pub(crate) fn new(recipe: Recipe, revision: u64, refresh: Duration) -> Self {
        let held = StoredTable {
            version: 0,
            table: recipe.defaults(revision),
        };
        let built = held.table.defaults_id();
        Self {
            recipe,
            revision,
            refresh,
            held: Mutex::new(held),
            read_warning: OncePerSecond::new(),
            copy: uuid::Uuid::new_v4().simple().to_string(),
            built,
            registered: Mutex::new(None),
        }
    }

    fn held(&self) -> StoredTable {
        self.held
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }
}

/// What a change of the limits in force did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Changed {
    /// It was saved as this version, in force on this copy at once and on every other within
    /// its refresh.
    Saved(u64),
    /// Nothing: the limits in force (this version) already were so.
    Unchanged(u64),
}

impl Changed {
    /// The version in force after the change.
    pub fn version(self) -> u64 {
        match self {
            Self::Saved(version) | Self::Unchanged(version) => version,
        }
    }
}

/// Why the limits in force could not be changed or read; the limits in force are unchanged.
#[derive(Debug)]
#[non_exhaustive]
pub enum LimitsError {
    /// The change is refused: a quota of zero, a window the backend cannot keep, a tier the
    /// layer does not have, a caller the table has no override for.
    Invalid(ConfigError),
    /// The store failed; a save that timed out may still have been made (read the limits
    /// again: a change made twice is [`Changed::Unchanged`] the second time).
    Store(StoreError),
    /// Other changes were saved between every read and save of this one.
    Contended,
}

impl fmt::Display for LimitsError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Invalid(e) => write!(f, "refused: {e}"),
            Self::Store(e) => write!(f, "the store failed: {e}"),
            Self::Contended => f.write_str("other changes kept being saved first: try again"),
        }
    }
}

impl std::error::Error for LimitsError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Self::Invalid(e) => Some(e),
            Self::Store(e) => Some(e),
            Self::Contended => None,
        }
    }
}

impl From<StoreError> for LimitsError {
    fn from(e: StoreError) -> Self {
        Self::Store(e)
    }
}

/// What the limits in force are read from and installed into: the client's store and tiers.
pub(crate) struct Place<'a> {
    pub(crate) store: &'a dyn RateStore,
    pub(crate) tiers: &'a ArcSwap<Tiers>,
}

impl InStore {
    /// The namespace the layer's table is kept under: its own tier's.
    pub(crate) fn namespace(&self) -> &str {
        &self.recipe.options.namespace
    }

    fn table_store<'a>(&self, place: &Place<'a>) -> Result<&'a dyn LimitsStore, StoreError> {
        place
            .store
            .limits_store()
            .ok_or_else(|| StoreError::new(StoreErrorKind::Config, "this store keeps no limits"))
    }

    /// The start's read: seeds the store with the code's limits when it has none, makes the
    /// code's defaults the table's when its revision is higher, adds the code's tiers the table
    /// lacks — and installs the result. Logged when the store cannot be read.
    pub(crate) async fn start(&self, place: &Place<'_>) {
        if let Err(error) = self.adopt(place).await.and(self.register(place).await) {
            tracing::warn!(
                target: "tollgate::rate_limit",
                limiter = self.namespace(),
                %error,
                "could not read the limits in force: deciding with the limits this copy was built with until a read succeeds"
            );
        }
    }

    /// How long a registration of this copy lasts: three refreshes, and at least ten seconds.
    pub(crate) fn copy_ttl(&self) -> Duration {
        (self.refresh * 3).max(Duration::from_secs(10))
    }

    /// Registers this copy in the store's list of the layer's copies, unless it did within a
    /// third of its registration's time.
    pub(crate) async fn register(&self, place: &Place<'_>) -> Result<(), StoreError> {
        let ttl = self.copy_ttl();
        let now = tokio::time::Instant::now();
        {
            let mut registered = self
                .registered
                .lock()
                .unwrap_or_else(PoisonError::into_inner);
            if registered.is_some_and(|at| now < at + ttl / 3) {
                return Ok(());
            }
            *registered = Some(now);
        }
        let store = self.table_store(place)?;
        let registered = store.register_copy(self.namespace(), &self.copy, &self.built, ttl);
        if let Err(error) = registered.await {
            *self
                .registered
                .lock()
                .unwrap_or_else(PoisonError::into_inner) = None;
            return Err(error);
        }
        Ok(())
    }

    /// The copies of the layer the store has seen lately, with what each was built with.
    pub(crate) async fn copies(&self, place: &Place<'_>) -> Result<Vec<CopySeen>, StoreError> {
        self.table_store(place)?.copies(self.namespace()).await
    }

    /// A failed refresh, logged at warn at most once a second.
    pub(crate) fn warn_unread(&self, error: &StoreError) {
        if self.read_warning.ready() {
            tracing::warn!(
                target: "tollgate::rate_limit",
                limiter = self.namespace(),
                %error,
                "could not read the limits in force: deciding with those read last (logged at most once a second)"
            );
        }
    }

    async fn adopt(&self, place: &Place<'_>) -> Result<(), StoreError> {
        let code = self.recipe.defaults(self.revision);
        let store = self.table_store(place)?;
        for _ in 0..CHANGE_TRIES {
            let (expected, current) = match store.load_limits(self.namespace()).await? {
                None => (0, None),
                Some(stored) => (stored.version, Some(stored.table)),
            };
            let mut table = current.clone().unwrap_or_else(|| code.clone());
            if self.revision > table.revision() {
                table.adopt_defaults(&code);
            } else {
                table.add_missing_defaults(&code);
            }
            if current.as_ref() == Some(&table) {
                let version = expected;
                self.install(StoredTable { version, table }, place);
                return Ok(());
            }
            let note = format!("defaults of revision {}", self.revision);
            match store
                .save_limits(self.namespace(), expected, &table, &note)
                .await?
            {
                Saved::Saved(version) => {
                    self.install(StoredTable { version, table }, place);
                    return Ok(());
                }
                Saved::Conflict(_) => continue,
            }
        }
        // another copy keeps changing it: take what is there
        self.refresh(place).await.map(drop)
    }

    /// Reads the table again and installs it if it is newer than the one held; the version
    /// held after.
    pub(crate) async fn refresh(&self, place: &Place<'_>) -> Result<u64, StoreError> {
        let store = self.table_store(place)?;
        if let Some(stored) = store.load_limits(self.namespace()).await? {
            self.install(stored, place);
        }
        Ok(self.held().version)
    }

    /// Makes `stored` this copy's limits in force, with its tiers, unless the copy holds that
    /// version or a newer one already. A table whose tiers cannot be built keeps the tiers held
    /// (logged). The tiers replaced give back what they hold of leased slices.
    fn install(&self, stored: StoredTable, place: &Place<'_>) {
        let mut held = self.held.lock().unwrap_or_else(PoisonError::into_inner);
        if stored.version <= held.version {
            return;
        }
        let tiers = match self.recipe.tiers(Some(&stored.table)) {
            Ok(tiers) => tiers,
            Err(error) => {
                tracing::error!(
                    target: "tollgate::rate_limit",
                    limiter = self.namespace(),
                    version = stored.version,
                    %error,
                    "the limits in force cannot be built by this copy: it keeps deciding with those it held"
                );
                return;
            }
        };
        let drift = !stored
            .table
            .same_defaults(&self.recipe.defaults(self.revision));
        if drift && held.version == 0 {
            tracing::warn!(
                target: "tollgate::rate_limit",
                limiter = self.namespace(),
                version = stored.version,
                revision = stored.table.revision(),
                own_revision = self.revision,
                "the limits this copy was built with differ from the defaults in force, which apply: raise the layer's limits_revision to replace them"
            );
        }
        let limiter = Arc::clone(&tiers.default_tier().limiter);
        metrics::limits_in_force(&limiter, stored.version, drift);
        *held = stored;
        let replaced = place.tiers.swap(Arc::new(tiers));
        drop(held);
        give_back_in_background(&replaced);
    }

    /// The limits in force on this copy.
    pub(crate) fn in_force(&self) -> StoredTable {
        self.held()
    }

    /// Changes the limits in force with `edit`, saved with `note`, each tier checked to build
    /// (see [`change_table`]), and in force on this copy once saved.
    pub(crate) async fn change(
        &self,
        place: &Place<'_>,
        note: &str,
        edit: impl Fn(&mut LimitTable) -> Result<(), ConfigError>,
    ) -> Result<Changed, LimitsError> {
        let store = self.table_store(place)?;
        let fresh = || Some(self.recipe.defaults(self.revision));
        let check = |table: &LimitTable| self.recipe.tiers(Some(table)).map(drop);
        let (changed, stored) =
            change_table(store, self.namespace(), note, fresh, edit, check).await?;
        self.install(stored, place);
        Ok(changed)
    }

    /// The changes of the limits in force, the newest first.
    pub(crate) async fn history(&self, place: &Place<'_>) -> Result<Vec<TableChange>, StoreError> {
        self.table_store(place)?
            .limits_history(self.namespace())
            .await
    }

    /// Whether the layer has tier `tier` (`None`: its own).
    pub(crate) fn check_tier(&self, tier: Option<&str>) -> Result<(), ConfigError> {
        match tier {
            Some(name) if !self.recipe.has_tier(tier) => Err(unknown_tier(name)),
            _ => Ok(()),
        }
    }
}

/// Changes the table of `namespace` in `store` with `edit` (one made by `fresh` when the store
/// has none; none at all is refused), checked by `check`, saved with `note` on condition that
/// nobody saved another since it was read — read and edited anew when someone did: what it
/// did, and the table in force after.
pub(crate) async fn change_table(
    store: &dyn LimitsStore,
    namespace: &str,
    note: &str,
    fresh: impl Fn() -> Option<LimitTable>,
    edit: impl Fn(&mut LimitTable) -> Result<(), ConfigError>,
    check: impl Fn(&LimitTable) -> Result<(), ConfigError>,
) -> Result<(Changed, StoredTable), LimitsError> {
    for _ in 0..CHANGE_TRIES {
        let stored = match store.load_limits(namespace).await? {
            Some(stored) => stored,
            None => {
                let table = fresh().ok_or_else(|| {
                    LimitsError::Invalid(ConfigError::new(
                        crate::error::ConfigErrorKind::Limit,
                        format!(
                            "the store holds no limits under {namespace}: no copy built with \
                             build_in_store has started on it, or its prefix is another"
                        ),
                    ))
                })?;
                StoredTable { version: 0, table }
            }
        };
        let mut table = stored.table.clone();
        edit(&mut table).map_err(LimitsError::Invalid)?;
        if table == stored.table && stored.version > 0 {
            return Ok((Changed::Unchanged(stored.version), stored));
        }
        check(&table).map_err(LimitsError::Invalid)?;
        match store
            .save_limits(namespace, stored.version, &table, note)
            .await?
        {
            Saved::Saved(version) => {
                return Ok((Changed::Saved(version), StoredTable { version, table }));
            }
            Saved::Conflict(_) => continue,
        }
    }
    Err(LimitsError::Contended)
}

/// Gives back, in the background, the slices that the tiers of `replaced` hold.
fn give_back_in_background(replaced: &Arc<Tiers>) {
    let leased: Vec<_> = replaced
        .all()
        .into_iter()
        .filter_map(|tier| tier.leases.clone())
        .collect();
    if leased.is_empty() {
        return;
    }
    if let Ok(runtime) = tokio::runtime::Handle::try_current() {
        runtime.spawn(async move {
            for leases in leased {
                leases.give_back_all().await;
            }
        });
    }
}
