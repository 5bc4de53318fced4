//! The limits in force, kept in the store: how a layer reads them at its start, follows their
//! changes, and changes them — the same for a rate limit's tiers and a concurrency limit's.
//!
//! A layer decides with what one [`StoredTable`] builds ([`Recipe::build`]), held with the
//! table in an [`InForce`]. It reads the store's at its start — seeding it with the code's
//! limits when there is none, replacing the defaults when its code's revision is higher — and
//! again every `refresh` and at each broadcast of a change; a change made through it is in force
//! on it at once.
//!
//! Reads, changes and the start's seeding take turns on one copy, so a later read always
//! answers for a later moment of the store than an earlier one: what it finds is installed
//! whenever it differs from what the copy holds, its version lower or not. A store whose version
//! went back (restored from a backup, failed over to a replica that missed a change) is the
//! store in force, and a store that lost the table (restarted empty, flushed) gets the copy's
//! table back, saved anew as version 1.

use std::fmt;
use std::sync::{Arc, Mutex, PoisonError, Weak};
use std::time::Duration;

use arc_swap::ArcSwap;

use crate::error::{ConfigError, ConfigErrorKind};
use crate::key::Key;
use crate::metrics;
use crate::pace::OncePerSecond;
use crate::rate::{Limit, LimitTable, StoredTable, TableChange};
use crate::store::{CopySeen, LimitsStore, Saved, StoreError, StoreErrorKind};

/// How many times a change reads the table again when another change was saved between its
/// read and its save.
const CHANGE_TRIES: usize = 8;

/// How a layer's limits are made: the defaults its code writes, and what it decides with,
/// built of the table in force.
pub(crate) trait Recipe: Send + Sync + 'static {
    /// What the layer decides with.
    type Built: Send + Sync + 'static;

    /// The namespace the table is kept under.
    fn namespace(&self) -> &str;

    /// The `limiter` label of the metrics.
    fn limiter(&self) -> &Arc<str>;

    /// The limits the code writes, as a table's defaults of revision `revision`.
    fn defaults(&self, revision: u64) -> LimitTable;

    /// What the layer decides with under `table`; an error names the tier or caller at fault.
    fn build(&self, table: &LimitTable) -> Result<Self::Built, ConfigError>;

    /// Whether the layer has a tier of this name (`None`: its own, which it always has).
    fn has_tier(&self, tier: Option<&str>) -> bool;

    /// What was decided with until now, replaced: a rate limit's tiers give back their leased
    /// slices.
    fn replaced(&self, old: Arc<Self::Built>) {
        drop(old);
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

/// A layer built without its limits in the store, asked to change them.
pub(crate) fn not_in_store() -> LimitsError {
    LimitsError::Invalid(ConfigError::new(
        ConfigErrorKind::Limit,
        "the layer was built without limits in the store (build_in_store)",
    ))
}

/// What the limits in force are read from and installed into: the layer's store, and what it
/// decides with.
pub(crate) struct Place<'a, B> {
    /// `None`: the store keeps no limits.
    pub(crate) store: Option<&'a dyn LimitsStore>,
    pub(crate) built: &'a ArcSwap<B>,
}

/// A layer's limits in force, and where they are read from and installed into.
pub(crate) type Parts<'a, R> = (&'a InForce<R>, Place<'a, <R as Recipe>::Built>);

/// The shared state of a layer that follows the limits in force.
pub(crate) trait Follows: Send + Sync + Sized + 'static {
    /// How its limits are made.
    type Recipe: Recipe;

    /// Its limits in force, for a layer built with them in the store.
    fn in_force(&self) -> Option<&InForce<Self::Recipe>>;

    /// Where they are read from and installed into.
    fn place(&self) -> Place<'_, <Self::Recipe as Recipe>::Built>;

    /// Its limits in force and where they go, for a change; refused for a layer built without
    /// them in the store.
    fn changing(&self) -> Result<Parts<'_, Self::Recipe>, LimitsError> {
        let in_force = self.in_force().ok_or_else(not_in_store)?;
        Ok((in_force, self.place()))
    }

    /// Its limits in force and where they are read from, for a read: a handle exists only for
    /// a layer built with them, so the error is one no caller meets.
    fn reading(&self) -> Result<Parts<'_, Self::Recipe>, StoreError> {
        self.changing()
            .map_err(|_| StoreError::new(StoreErrorKind::Config, "no limits in the store"))
    }

    /// The limits in force on this copy; version 0 and no limits for a layer built without them.
    fn held_in_force(&self) -> StoredTable {
        self.in_force().map_or_else(
            || StoredTable {
                version: 0,
                table: LimitTable::default(),
            },
            InForce::in_force,
        )
    }

    /// Reads the limits in force and makes them the layer's (see [`InForce`]); then follows them
    /// every refresh, as long as `this` lives.
    async fn start_following(this: &Arc<Self>) {
        let Some(in_force) = this.in_force() else {
            return;
        };
        in_force.start(&this.place()).await;
        let (weak, every) = (Arc::downgrade(this), in_force.refresh);
        tokio::spawn(follow(weak, every));
    }

    /// The limits of `namespace` changed through another copy: read them again now, if they
    /// are this layer's.
    fn heard_of_change(this: &Arc<Self>, namespace: &str) {
        if this.in_force().is_none_or(|i| i.namespace() != namespace) {
            return;
        }
        let this = Arc::clone(this);
        tokio::spawn(async move {
            if let Some(in_force) = this.in_force()
                && let Err(error) = in_force.refresh(&this.place()).await
            {
                in_force.warn_unread(&error);
            }
        });
    }
}

/// Reads the limits in force every `every`, and registers the copy, while `follower` lives.
async fn follow<T: Follows>(follower: Weak<T>, every: Duration) {
    loop {
        tokio::time::sleep(every).await;
        let Some(follower) = follower.upgrade() else {
            return;
        };
        if let Some(in_force) = follower.in_force() {
            let place = follower.place();
            let done = in_force.refresh(&place).await.map(drop);
            if let Err(error) = done.and(in_force.register(&place).await) {
                in_force.warn_unread(&error);
            }
        }
    }
}

/// What a layer keeps of its limits in force.
pub(crate) struct InForce<R> {
    pub(crate) recipe: R,
    /// The revision of the code's limits (see [`LimitTable::revision`]).
    pub(crate) revision: u64,
    /// The limits the code writes, as a table's defaults of that revision.
    code: LimitTable,
    /// How often the table is read again.
    pub(crate) refresh: Duration,
    /// The table in force on this copy; version 0 until one was read.
    held: Mutex<StoredTable>,
    /// Reads and changes take turns (see the module's docs).
    turns: tokio::sync::Mutex<()>,
    /// Failures to read the table are logged at warn at most once a second.
    read_warning: OncePerSecond,
    /// This copy's id in the store's list of copies, and what it was built with.
    copy: String,
    built: String,
    /// When this copy last registered.
    registered: Mutex<Option<tokio::time::Instant>>,
}

impl<R> fmt::Debug for InForce<R> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("InForce")
            .field("revision", &self.revision)
            .field("refresh", &self.refresh)
            .field("built", &self.built)
            .finish_non_exhaustive()
    }
}

impl<R: Recipe> InForce<R> {
    pub(crate) fn new(recipe: R, revision: u64, refresh: Duration) -> Self {
        let code = recipe.defaults(revision);
        let built = code.defaults_id();
        let held = StoredTable {
            version: 0,
            table: code.clone(),
        };
        Self {
            recipe,
            revision,
            code,
            refresh,
            held: Mutex::new(held),
            turns: tokio::sync::Mutex::new(()),
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

    /// The namespace the table is kept under.
    pub(crate) fn namespace(&self) -> &str {
        self.recipe.namespace()
    }

    fn table_store<'a, B>(&self, place: &Place<'a, B>) -> Result<&'a dyn LimitsStore, StoreError> {
        place
            .store
            .ok_or_else(|| StoreError::new(StoreErrorKind::Config, "this store keeps no limits"))
    }

    /// The start's read: seeds the store with the code's limits when it has none, makes the
    /// code's defaults the table's when its revision is higher, adds the code's tiers the table
    /// lacks — and installs the result. Logged when the store cannot be read.
    pub(crate) async fn start(&self, place: &Place<'_, R::Built>) {
        let adopted = {
            let _turn = self.turns.lock().await;
            self.adopt(place).await
        };
        if let Err(error) = adopted.and(self.register(place).await) {
            tracing::warn!(
                target: "tollgate::limits",
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
    pub(crate) async fn register(&self, place: &Place<'_, R::Built>) -> Result<(), StoreError> {
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
    pub(crate) async fn copies(
        &self,
        place: &Place<'_, R::Built>,
    ) -> Result<Vec<CopySeen>, StoreError> {
        self.table_store(place)?.copies(self.namespace()).await
    }

    /// A failed refresh, logged at warn at most once a second.
    pub(crate) fn warn_unread(&self, error: &StoreError) {
        if self.read_warning.ready() {
            tracing::warn!(
                target: "tollgate::limits",
                limiter = self.namespace(),
                %error,
                "could not read the limits in force: deciding with those read last (logged at most once a second)"
            );
        }
    }

    /// Seeds or updates the store's table with the code's defaults, and installs it. Run in
    /// turn.
    async fn adopt(&self, place: &Place<'_, R::Built>) -> Result<(), StoreError> {
        let code = &self.code;
        let store = self.table_store(place)?;
        for _ in 0..CHANGE_TRIES {
            let (expected, current) = match store.load_limits(self.namespace()).await? {
                None => (0, None),
                Some(stored) => (stored.version, Some(stored.table)),
            };
            let mut table = current.clone().unwrap_or_else(|| code.clone());
            if self.revision > table.revision() {
                table.adopt_defaults(code);
            } else {
                table.add_missing_defaults(code);
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
        self.read(place).await.map(drop)
    }

    /// Reads the table again and installs it if it differs from the one held; the version held
    /// after.
    pub(crate) async fn refresh(&self, place: &Place<'_, R::Built>) -> Result<u64, StoreError> {
        let _turn = self.turns.lock().await;
        self.read(place).await
    }

    /// [`refresh`](Self::refresh), in turn already. A store that has no table while this copy
    /// holds one lost it: the copy's is saved back (as the start's would be when it never read
    /// one).
    async fn read(&self, place: &Place<'_, R::Built>) -> Result<u64, StoreError> {
        let store = self.table_store(place)?;
        let held = self.held();
        match store.load_limits(self.namespace()).await? {
            Some(stored) => self.install(stored, place),
            None if held.version == 0 => return self.adopt_once(place).await,
            None => {
                tracing::warn!(
                    target: "tollgate::limits",
                    limiter = self.namespace(),
                    held = held.version,
                    "the store has lost the limits in force: saving back those this copy holds"
                );
                let note = format!("restored by a copy that held version {}", held.version);
                match store
                    .save_limits(self.namespace(), 0, &held.table, &note)
                    .await?
                {
                    Saved::Saved(version) => self.install(
                        StoredTable {
                            version,
                            table: held.table,
                        },
                        place,
                    ),
                    // another copy saved it back first
                    Saved::Conflict(_) => {
                        if let Some(stored) = store.load_limits(self.namespace()).await? {
                            self.install(stored, place);
                        }
                    }
                }
            }
        }
        Ok(self.held().version)
    }

    /// The start's seeding, from a read that found no table before the copy held one.
    async fn adopt_once(&self, place: &Place<'_, R::Built>) -> Result<u64, StoreError> {
        Box::pin(self.adopt(place)).await?;
        Ok(self.held().version)
    }

    /// Makes `stored` this copy's limits in force, with what they build, unless the copy holds
    /// it already. Called in turn, so `stored` is never older than what is held: a lower
    /// version is the store's going back, and is followed. A table that cannot be built keeps
    /// what the copy decides with (logged).
    fn install(&self, stored: StoredTable, place: &Place<'_, R::Built>) {
        // built outside the lock: the turn keeps every other install out meanwhile
        let held = {
            let held = self.held.lock().unwrap_or_else(PoisonError::into_inner);
            if stored == *held {
                return;
            }
            held.version
        };
        let built = match self.recipe.build(&stored.table) {
            Ok(built) => built,
            Err(error) => {
                tracing::error!(
                    target: "tollgate::limits",
                    limiter = self.namespace(),
                    version = stored.version,
                    %error,
                    "the limits in force cannot be built by this copy: it keeps deciding with those it held"
                );
                return;
            }
        };
        let drift = !stored.table.same_defaults(&self.code);
        if drift && held == 0 {
            tracing::warn!(
                target: "tollgate::limits",
                limiter = self.namespace(),
                version = stored.version,
                revision = stored.table.revision(),
                own_revision = self.revision,
                "the limits this copy was built with differ from the defaults in force, which apply: raise the layer's limits_revision to replace them"
            );
        }
        if stored.version < held {
            tracing::warn!(
                target: "tollgate::limits",
                limiter = self.namespace(),
                version = stored.version,
                held,
                "the store's limits in force went back to an older version: following it"
            );
        }
        metrics::limits_in_force(self.recipe.limiter(), stored.version, drift);
        // what the layer decides with first, then the version it says it holds: a version seen
        // in force is one every decision made after makes with
        let replaced = place.built.swap(Arc::new(built));
        *self.held.lock().unwrap_or_else(PoisonError::into_inner) = stored;
        self.recipe.replaced(replaced);
    }

    /// The limits in force on this copy.
    pub(crate) fn in_force(&self) -> StoredTable {
        self.held()
    }

    /// Changes the limits in force with `edit`, saved with `note`, the result checked to build
    /// (see [`change_table`]), and in force on this copy once saved.
    pub(crate) async fn change(
        &self,
        place: &Place<'_, R::Built>,
        note: &str,
        edit: impl Fn(&mut LimitTable) -> Result<(), ConfigError>,
    ) -> Result<Changed, LimitsError> {
        let store = self.table_store(place)?;
        let fresh = || Some(self.code.clone());
        let check = |table: &LimitTable| self.recipe.build(table).map(drop);
        let _turn = self.turns.lock().await;
        let (changed, stored) =
            change_table(store, self.namespace(), note, fresh, edit, check).await?;
        self.install(stored, place);
        Ok(changed)
    }

    /// The changes of the limits in force, the newest first.
    pub(crate) async fn history(
        &self,
        place: &Place<'_, R::Built>,
    ) -> Result<Vec<TableChange>, StoreError> {
        self.table_store(place)?
            .limits_history(self.namespace())
            .await
    }

    /// Whether the layer has tier `tier` (`None`: its own).
    fn check_tier(&self, tier: Option<&str>) -> Result<(), LimitsError> {
        match tier {
            Some(name) if !self.recipe.has_tier(tier) => {
                Err(LimitsError::Invalid(unknown_tier(name)))
            }
            _ => Ok(()),
        }
    }

    /// Gives caller `key` limits of its own.
    pub(crate) async fn set_caller(
        &self,
        place: &Place<'_, R::Built>,
        key: Key,
        limits: Vec<Limit>,
        note: &str,
    ) -> Result<Changed, LimitsError> {
        let edit = |table: &mut LimitTable| {
            table.set_caller(key, limits.clone());
            Ok(())
        };
        self.change(place, note, edit).await
    }

    /// Takes caller `key` back to its tier's limits; refused when it has none of its own.
    pub(crate) async fn unset_caller(
        &self,
        place: &Place<'_, R::Built>,
        key: Key,
        note: &str,
    ) -> Result<Changed, LimitsError> {
        let edit = |table: &mut LimitTable| {
            if table.unset_caller(key) {
                Ok(())
            } else {
                Err(refused(format!("caller {key} has no limits of its own")))
            }
        };
        self.change(place, note, edit).await
    }

    /// Replaces tier `tier`'s limits (`None`: the layer's own); refused for a tier the layer's
    /// code does not name.
    pub(crate) async fn set_tier(
        &self,
        place: &Place<'_, R::Built>,
        tier: Option<&str>,
        limits: Vec<Limit>,
        note: &str,
    ) -> Result<Changed, LimitsError> {
        self.check_tier(tier)?;
        let edit = |table: &mut LimitTable| {
            table.set_tier(tier, limits.clone());
            Ok(())
        };
        self.change(place, note, edit).await
    }

    /// Takes tier `tier` (`None`: the layer's own) back to its defaults; refused for a tier the
    /// layer does not have, or one not replaced.
    pub(crate) async fn unset_tier(
        &self,
        place: &Place<'_, R::Built>,
        tier: Option<&str>,
        note: &str,
    ) -> Result<Changed, LimitsError> {
        self.check_tier(tier)?;
        let edit = |table: &mut LimitTable| {
            if table.unset_tier(tier) {
                Ok(())
            } else {
                let tier = tier.map_or("the layer's own".to_owned(), |t| format!("{t:?}"));
                Err(refused(format!("tier {tier} is not replaced")))
            }
        };
        self.change(place, note, edit).await
    }
}

fn refused(message: String) -> ConfigError {
    ConfigError::new(ConfigErrorKind::Limit, message)
}

/// A tier the layer's code does not name.
pub(crate) fn unknown_tier(tier: &str) -> ConfigError {
    ConfigError::new(
        ConfigErrorKind::Limit,
        format!("unknown tier {tier:?}: the layer's tiers are those its code names"),
    )
}

/// Changes the table of `namespace` in `store` with `edit` (one made by `fresh` when the store
/// has none; none at all is refused), checked by `check`, saved with `note` on condition that
/// nobody saved another since it was read — read and edited anew when someone did: what it
/// did, and the table in force after.
async fn change_table(
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
                        ConfigErrorKind::Limit,
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

/// Changes the table of `namespace` in `store` without a layer (for operators' tools): `edit`
/// applied to the table the store holds — none is refused — and the result checked as its kind
/// counts it ([`LimitTable::check`]).
pub(crate) async fn change_stored(
    store: &dyn LimitsStore,
    namespace: &str,
    note: &str,
    edit: impl Fn(&mut LimitTable) -> Result<(), ConfigError>,
) -> Result<Changed, LimitsError> {
    let check = |table: &LimitTable| table.check(namespace);
    let (changed, _) = change_table(store, namespace, note, || None, edit, check).await?;
    Ok(changed)
}
