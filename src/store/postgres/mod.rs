//! [`PgStore`]: the store capabilities on PostgreSQL.
//!
//! Every operation is one round trip: one call of a PL/pgSQL function that
//! [`PgStore::migrate`] installs (the numbered files of `migrations/` beside this file), in a transaction of its own
//! (`BEGIN`, its `statement_timeout`, the call and `COMMIT`, pipelined). Each function locks the
//! rows it decides on, then reads the database clock (`clock_timestamp()`, in microseconds) —
//! so concurrent calls on one key are decided one after the other, each at its own instant, and
//! no application clock ever decides a window or a lease. The functions decide what the Lua
//! scripts of the Redis store decide, with the same replies in substance, but are written for
//! PostgreSQL: row and advisory locks where Redis runs one script at a time, one locking read
//! per row, the single-limit rate check inlined. The conformance suite, which runs unchanged on
//! both, checks that they agree.
//!
//! The client is `tokio-postgres` with a `deadpool-postgres` pool: light, no compile-time
//! database, prepared statements cached per connection. Bring your own pool (e.g. one with a
//! TLS connector) with [`PgStore::from_pool`] or [`PgStore::pool_builder`].

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use deadpool_postgres::Pool;
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tokio_postgres::Row;

mod advisory;
mod builder;
mod call;
mod clock;
mod idempotency;
mod invalidation;
mod limits;
mod lock;
mod migrate;
mod once;
mod permit;
mod rate;
mod sql;
mod tls;

pub use builder::PgStoreBuilder;
use builder::Settings;
use call::{Calls, Param};
pub use once::{Once, OnceError, OnceTx};
use rate::{RateCall, retention_us};
use sql::Sql;

use super::{Store, StoreClock, StoreError, StoreErrorKind, StoreFuture, millis};
use crate::store::coalesce::Coalescer;
use crate::store::kit;

/// A store on PostgreSQL, shared by every copy of a service.
///
/// Cheap to clone: clones share one connection pool. Every call — pool checkout, statement
/// preparation (once per connection), execution and commit — is bounded by the store timeout
/// (default 250 ms), and fails with a [`StoreError`] of kind [`Timeout`](StoreErrorKind::Timeout),
/// [`Unavailable`](StoreErrorKind::Unavailable) (no connection, a broken one, a server shutting
/// down or read-only) or [`Protocol`](StoreErrorKind::Protocol) (any other error the server
/// sent), never a hang. A call whose connection broke is sent once more on another connection
/// within the same timeout: every operation is safe to run twice.
///
/// ```no_run
/// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
/// use std::time::Duration;
/// use tollgate::store::{PgStore, Store};
///
/// // builds the pool and creates or updates the schema `tollgate`
/// let store = PgStore::connect("postgres://app:secret@db.internal/app").await?;
/// store.ping().await?;
///
/// // or with settings, migrating once at deploy time
/// let store = PgStore::builder("postgres://app:secret@db.internal/app")
///     .timeout(Duration::from_millis(100))
///     .schema("limits")
///     .build()?;
/// store.migrate().await?;
/// # Ok(()) }
/// ```
///
/// # Schema
///
/// [`migrate`](Self::migrate) creates, in the configured schema (default `tollgate`):
///
/// | table | holds | logged |
/// | --- | --- | --- |
/// | `rate_limits` | per caller and limit: a GCRA arrival time, a sliding counter's windows, or a sliding log's size | `UNLOGGED` by default |
/// | `rate_log` | a sliding log: one row per admitted attempt and limit, with its cost | as `rate_limits` |
/// | `rate_attempts` | the attempt ledger: per charged attempt (check or settlement) until its deadline plus twice the timeout, and a reservation's place (see [the attempt ledger](crate::store#the-attempt-ledger)) | as `rate_limits` |
/// | `holds` | claims and locks: key, holder or token, expiry (none: kept until deleted) | yes |
/// | `fences` | per lock name the last fencing token | yes |
/// | `releases` | release markers: the release call that deleted a claim, lock or idempotency claim | yes |
/// | `idempotency` | idempotency records: fingerprint, owner token, lease or retention, the response as `bytea` | yes |
///
/// Keys are the same strings the Redis store uses (digests, never raw user input).
///
/// # Durability
///
/// Rate-limit state is `UNLOGGED` unless [`unlogged_rate_limits(false)`](PgStoreBuilder::unlogged_rate_limits):
/// it skips the write-ahead log, so checks cost less, but PostgreSQL empties unlogged tables
/// when it restarts after a crash, and they are not replicated to standbys. Losing it only
/// forgets what callers spent — every caller starts with a full quota, as after a Redis restart
/// without persistence — which rate limits tolerate. Claims, locks, fencing counters and
/// idempotency records are always logged: losing them could run a payment twice or hand out a
/// fencing token again.
///
/// # Row lock or advisory lock
///
/// | | row lock ([`Locks`](crate::lock::Locks) on a `PgStore`) | advisory lock ([`advisory_xact_lock`](Self::advisory_xact_lock)) |
/// | --- | --- | --- |
/// | what it is | a row in `holds`: token, lease, fencing counter | `pg_advisory_xact_lock` on a digest of the name |
/// | spans | many round trips, processes, any work (HTTP calls, files) | one transaction on one connection |
/// | released by | token-checked release, or the lease running out | the commit or rollback, nothing else |
/// | a holder that dies | loses the lock when its lease expires | loses it with its connection at once |
/// | lease, renewal | yes ([`with_lock`](crate::lock::Locks::with_lock) keeps it alive) | none |
/// | fencing token | strictly increasing per name | none |
/// | use it for | work outside the database, or longer than a transaction | serialising writes that all happen inside that one transaction |
///
/// # Timeouts and deadlines
///
/// Each call bounds itself on the server as well, whatever pool it runs on: it sets its own
/// `statement_timeout` (`SET LOCAL`, in its own transaction) to what is left of the store
/// timeout, so a call waiting for a lock is cancelled when its caller gives up. Every write
/// carries its deadline on the database clock (see [Deadlines](super#deadlines)) and checks it
/// after taking its locks, right before it writes: received late, it does nothing. A call and
/// the release of the same key are serialised by an advisory lock on the key, so a release
/// sent after a write's deadline waits for that write, if it is still running, and sees it.
///
/// Not bounded by `statement_timeout`: a commit waiting for a synchronous standby (PostgreSQL
/// switches the timeout off for the commit). When the deadline passes during the commit, the
/// client sends a cancel request (without TLS: PostgreSQL takes it before, and without,
/// authentication; where only TLS gets through, e.g. a TLS-only proxy, it does not arrive) and
/// the call fails with a timeout. The cancelled wait leaves the commit in place locally, not yet
/// on the standby — a failover before the standby catches up may lose it. A cancel request that
/// cannot reach the server bounds nothing there: the commit waits as long as the server lets it,
/// and a release of that key waits behind it.
///
/// # Expired rows
///
/// A row whose expiry has passed counts as absent at once. Deleting it is
/// [`purge_expired`](Self::purge_expired)'s work: batched deletes through an index on the
/// expiry, so a purge costs O(expired rows), never a scan of the live ones. A store built in a
/// tokio runtime runs it in the background (see
/// [`purge_interval`](PgStoreBuilder::purge_interval)); a sliding log is also trimmed by every
/// check of its caller.
#[derive(Clone)]
pub struct PgStore {
    inner: Arc<Inner>,
}

struct Inner {
    shared: Arc<Shared>,
    settings: Settings,
    /// Rate checks, coalesced into calls of `decide_rates`.
    rates: Arc<Coalescer<RateCall>>,
    /// The background purge, stopped when the last clone of the store goes.
    purge_task: Option<JoinHandle<()>>,
    /// Hears the resets and refunds of every copy, for the layers on this store.
    listening: invalidation::Listening,
}

/// What calls, and the purge task, need.
struct Shared {
    calls: Calls,
    sql: Sql,
    purge_batch: i32,
}

impl Drop for Inner {
    fn drop(&mut self) {
        if let Some(task) = &self.purge_task {
            task.abort();
        }
    }
}

impl fmt::Debug for PgStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let settings = &self.inner.settings;
        f.debug_struct("PgStore")
            .field("schema", &settings.schema)
            .field("timeout", &settings.timeout)
            .field("unlogged_rate_limits", &settings.unlogged_rate_limits)
            .field("purge_interval", &settings.purge_interval)
            .finish_non_exhaustive()
    }
}

impl PgStore {
    /// A builder for a store on the database at `url`, e.g.
    /// `postgres://user:password@host:5432/db` (or a `key=value` connection string).
    pub fn builder(url: impl Into<String>) -> PgStoreBuilder {
        PgStoreBuilder::from_url(url.into())
    }

    /// A builder for a store on a pool the application made: its connections, TLS and size
    /// are the pool's; the builder sets the timeout, schema and purge.
    pub fn pool_builder(pool: Pool) -> PgStoreBuilder {
        PgStoreBuilder::from_pool(pool)
    }

    /// A store on `pool` with default settings (schema `tollgate`, 250 ms per call). Migrate
    /// the schema first (see [`migrate`](Self::migrate)).
    ///
    /// ```no_run
    /// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
    /// use deadpool_postgres::{Config, Runtime};
    /// use tollgate::store::PgStore;
    ///
    /// let mut config = Config::new();
    /// config.url = Some("postgres://app@127.0.0.1/app".into());
    /// let pool = config.create_pool(Some(Runtime::Tokio1), tokio_postgres::NoTls)?;
    /// let store = PgStore::from_pool(pool);
    /// store.migrate().await?;
    /// # Ok(()) }
    /// ```
    pub fn from_pool(pool: Pool) -> Self {
        Self::new(pool, None, Settings::default())
    }

    /// A store on the database at `url` with default settings, its schema created or updated
    /// ([`PgStoreBuilder::connect`]).
    pub async fn connect(url: impl Into<String>) -> Result<Self, StoreError> {
        Self::builder(url).connect().await
    }

    fn new(pool: Pool, listen: Option<invalidation::Source>, settings: Settings) -> Self {
        let sql = Sql::new(&settings.schema);
        let shared = Arc::new(Shared {
            calls: Calls {
                pool,
                timeout: settings.timeout,
                clock: Arc::new(StoreClock::default()),
                now: sql.now.clone(),
                server: settings.server.clone(),
            },
            sql,
            purge_batch: i32::try_from(settings.purge_batch).unwrap_or(i32::MAX),
        });
        let purge_task = settings
            .purge_interval
            .and_then(|every| spawn_purge(&shared, every));
        let rates = Coalescer::new(
            RateCall {
                shared: Arc::clone(&shared),
                retention_us: retention_us(settings.timeout),
            },
            settings.timeout,
            settings.max_batch,
        );
        let listening = invalidation::Listening::new(listen, &settings.schema, settings.timeout);
        Self {
            inner: Arc::new(Inner {
                shared,
                settings,
                rates: Arc::new(rates),
                purge_task,
                listening,
            }),
        }
    }

    /// Creates the schema, its tables, indexes and functions, or brings them up to this
    /// crate's version, so that it is safe to run at every start of every copy, and from
    /// several copies at once. It first reads the schema's version, locking none of its
    /// tables: a schema at this version (or a later one) with its rate tables as configured
    /// is left alone, with no DDL. Otherwise it runs the DDL in one transaction, under an
    /// advisory lock on the schema's name, after waiting for the running calls and locking
    /// every table in the order the calls lock them (they wait for it meanwhile). A migration
    /// drops the functions of earlier versions: copies still running an earlier version of this
    /// crate then fail their calls with [`Protocol`](StoreErrorKind::Protocol) errors. Bounded
    /// by the [`migration_timeout`](PgStoreBuilder::migration_timeout) (default 30 s).
    pub async fn migrate(&self) -> Result<(), StoreError> {
        let settings = &self.inner.settings;
        migrate::migrate(
            &self.inner.shared.calls.pool,
            &settings.schema,
            settings.unlogged_rate_limits,
            settings.migration_timeout,
        )
        .await
    }

    /// Deletes every row that has expired, in batches (see
    /// [`purge_batch`](PgStoreBuilder::purge_batch)); the number deleted. Each statement is
    /// bounded by the store timeout. Rows in use by a running operation are left for the next
    /// purge.
    pub async fn purge_expired(&self) -> Result<u64, StoreError> {
        purge(&self.inner.shared).await
    }

    /// The schema of the store's tables.
    pub fn schema(&self) -> &str {
        &self.inner.settings.schema
    }

    /// The per-call timeout.
    pub fn timeout(&self) -> Duration {
        self.inner.settings.timeout
    }

    /// The connection pool, e.g. for the transactions that take
    /// [advisory locks](Self::advisory_xact_lock).
    pub fn pool(&self) -> &Pool {
        &self.inner.shared.calls.pool
    }

    /// Runs the statement `sql` picks with `params` — a write with its `deadline` — and
    /// decodes its one row.
    fn call<T: Send + 'static>(
        &self,
        operation: &'static str,
        sql: fn(&Sql) -> &String,
        params: Vec<Param>,
        deadline: Option<Instant>,
        decode: fn(&Row) -> Result<T, StoreError>,
    ) -> StoreFuture<T> {
        let shared = Arc::clone(&self.inner.shared);
        Box::pin(async move {
            let row = shared
                .calls
                .row(operation, 1, sql(&shared.sql), &params, deadline)
                .await?;
            decode(&row)
        })
    }
}

/// Deletes expired rows until every table has fewer than a batch left.
async fn purge(shared: &Shared) -> Result<u64, StoreError> {
    let mut total = 0u64;
    loop {
        let params: Vec<Param> = vec![Box::new(shared.purge_batch)];
        let row = shared
            .calls
            .row("purge_expired", 1, &shared.sql.purge_expired, &params, None)
            .await?;
        let decoded: Result<(i32, i64), _> = (|| Ok((row.try_get(0)?, row.try_get(1)?)))();
        let (most, deleted) = decoded
            .map_err(|e: tokio_postgres::Error| StoreError::new(StoreErrorKind::Protocol, e))?;
        total = total.saturating_add(u64::try_from(deleted).unwrap_or(0));
        if most < shared.purge_batch {
            return Ok(total);
        }
    }
}

/// Purges every `every` on the current runtime, if there is one.
fn spawn_purge(shared: &Arc<Shared>, every: Duration) -> Option<JoinHandle<()>> {
    let runtime = tokio::runtime::Handle::try_current().ok()?;
    let shared = Arc::clone(shared);
    Some(runtime.spawn(async move {
        let mut ticks = tokio::time::interval(every);
        ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        // the first tick is now: a store just built has nothing to purge yet
        ticks.tick().await;
        loop {
            ticks.tick().await;
            if let Err(error) = purge(&shared).await {
                tracing::warn!(target: "tollgate::store", %error, "could not purge expired rows");
            }
        }
    }))
}

/// Milliseconds for a function argument (see [`millis`]).
fn ms(d: Duration) -> i64 {
    i64::try_from(millis(d)).unwrap_or(1 << 53)
}

fn protocol(e: tokio_postgres::Error) -> StoreError {
    StoreError::protocol(e)
}

/// A time left as a read answers it, in milliseconds: `-1` (no expiry) as
/// [`MAX_EXPIRY`](crate::store::MAX_EXPIRY), anything else below zero as zero.
fn left_ms(ms: i64) -> Duration {
    match ms {
        -1 => crate::store::MAX_EXPIRY,
        ms => Duration::from_millis(u64::try_from(ms).unwrap_or(0)),
    }
}

/// A release's answer.
fn boolean(row: &Row) -> Result<bool, StoreError> {
    row.try_get(0).map_err(protocol)
}

/// The tag that starts a write's reply; `-1`, received after its deadline, is an error: it did
/// nothing.
fn tag(row: &Row) -> Result<i16, StoreError> {
    match row.try_get(0).map_err(protocol)? {
        -1 => Err(StoreError::expired()),
        tag => Ok(tag),
    }
}

/// `1` or `0`: extend_hold, idem_complete, idem_extend.
fn flag(row: &Row) -> Result<bool, StoreError> {
    match tag(row)? {
        1 => Ok(true),
        0 => Ok(false),
        other => Err(kit::unexpected("a flag", other.into())),
    }
}

impl Store for PgStore {
    fn ping(&self) -> StoreFuture<()> {
        self.call("ping", |s| &s.ping, Vec::new(), None, |_| Ok(()))
    }
}
