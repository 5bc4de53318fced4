//! [`PgStore`]: the store capabilities on PostgreSQL.
//!
//! Every operation is one round trip: one call of a PL/pgSQL function that
//! [`PgStore::migrate`] installs (`schema.sql` beside this file), in a transaction of its own
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
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use deadpool_postgres::Pool;
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tokio_postgres::Row;

mod advisory;
mod builder;
mod call;
mod clock;
#[cfg(feature = "axum")]
mod extract;
mod invalidation;
mod migrate;
mod once;
mod sql;
mod tls;

pub use builder::PgStoreBuilder;
use builder::Settings;
use call::{Calls, Param};
#[cfg(feature = "axum")]
pub use extract::NoTransaction;
pub(crate) use once::{Begun, Running};
pub use once::{Once, OnceError, OnceTx};
use sql::Sql;

use super::{
    ClaimOutcome, Hold, IdempotencyBegin, IdempotencyStore, Invalidations, LockAttempt, LockStore,
    PermitAttempt, PermitStore, RELEASE_MARKER_TTL, RateStore, Store, StoreClock, StoreError,
    StoreErrorKind, StoreFuture, fence_ttl, millis,
};
use crate::key::Key;
use crate::rate::{Algorithm, LimitState, RateCheck, RateOutcome, RatePolicy};
use crate::store::coalesce::{BatchCall, Coalescer, Decided, Sent};
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
        total += u64::try_from(deleted).unwrap_or(0);
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

/// An id as the database keeps it: the same 64 bits, as a `bigint`.
fn signed(id: u64) -> i64 {
    i64::from_ne_bytes(id.to_ne_bytes())
}

fn protocol(e: tokio_postgres::Error) -> StoreError {
    StoreError::protocol(e)
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

/// `(tag, holder)`: 1 claimed by this call, 2 held by this holder already, 0 by another.
fn decode_claim(row: &Row) -> Result<ClaimOutcome, StoreError> {
    let won = match tag(row)? {
        1 | 2 => true,
        0 => false,
        other => return Err(kit::unexpected("claim", other.into())),
    };
    Ok(ClaimOutcome {
        won,
        holder: row.try_get(1).map_err(protocol)?,
        pending: false,
    })
}

/// `(tag, value)`: 1 acquired with fence `value`, 0 held for `value` ms more (-1: no expiry).
fn decode_lock(row: &Row) -> Result<LockAttempt, StoreError> {
    let acquired = match tag(row)? {
        1 => true,
        0 => false,
        other => return Err(kit::unexpected("lock_acquire", other.into())),
    };
    Ok(kit::lock_attempt(
        acquired,
        row.try_get(1).map_err(protocol)?,
    ))
}

/// `(tag, value, ahead)`: see [`kit::permit_attempt`].
fn decode_permit(row: &Row) -> Result<PermitAttempt, StoreError> {
    let ahead: Option<i64> = row.try_get(2).map_err(protocol)?;
    kit::permit_attempt(
        tag(row)?.into(),
        row.try_get(1).map_err(protocol)?,
        ahead.unwrap_or(0),
    )
}

impl RateStore for PgStore {
    fn check_rate(&self, policy: &Arc<RatePolicy>, check: RateCheck) -> StoreFuture<RateOutcome> {
        let check = check.bounded(policy);
        let pending = self.inner.rates.check(policy, check);
        let shared = Arc::clone(&self.inner.shared);
        let channel = invalidation::channel(&self.inner.settings.schema);
        let payload = invalidation::payload(policy.namespace(), check.key());
        super::publishing_refunds(pending, check, move || async move {
            let params: Vec<Param> = vec![Box::new(channel), Box::new(payload)];
            let notified = shared
                .calls
                .row("invalidate", 1, &shared.sql.notify, &params, None)
                .await;
            if let Err(error) = notified {
                tracing::debug!(
                    target: "tollgate::store", %error,
                    "could not notify a refund; cached denials of the caller end within a second"
                );
            }
        })
    }

    fn timeout(&self) -> Duration {
        self.inner.settings.timeout
    }

    /// Deletes the caller's rows and notifies the reset (see
    /// [Invalidations](crate::store#invalidations)) in one transaction.
    fn reset_rate(&self, policy: &Arc<RatePolicy>, key: Key) -> StoreFuture<()> {
        let params: Vec<Param> = vec![
            Box::new(policy.reset_keys(&key)),
            Box::new(invalidation::channel(&self.inner.settings.schema)),
            Box::new(invalidation::payload(policy.namespace(), key)),
        ];
        self.call("reset_rate", |s| &s.reset_rate, params, None, |_| Ok(()))
    }

    /// One connection per store outside the pool, made on the first call; `None` for a store
    /// on a pool the application made ([`PgStore::from_pool`], [`PgStore::pool_builder`]),
    /// which cannot open a connection of its own.
    fn invalidations(&self) -> Option<Invalidations> {
        self.inner.listening.subscribe()
    }
}

/// One call of `decide_rates`: a batch of checks in one transaction.
struct RateCall {
    shared: Arc<Shared>,
    /// How long after its deadline a charged attempt is remembered, in µs: twice the timeout.
    retention_us: i64,
}

/// Twice `timeout` in microseconds (at most 2^53, so that a deadline plus it stays far from
/// overflowing).
fn retention_us(timeout: Duration) -> i64 {
    let twice = timeout.as_micros().saturating_mul(2).min(1 << 53);
    i64::try_from(twice).unwrap_or(1 << 53)
}

impl BatchCall for RateCall {
    fn decide(
        &self,
        checks: &[Sent<'_>],
        deadline: Instant,
    ) -> impl Future<Output = Decided> + Send {
        self.call(checks, deadline)
    }
}

impl RateCall {
    /// `checks` in one call. When the call fails with an error of the database (a step that
    /// raised: the transaction rolled back, nothing of the batch was committed), each check is
    /// decided again in a call of its own, within the same deadline: only a check whose own
    /// step fails fails, with its cause.
    async fn call(&self, checks: &[Sent<'_>], deadline: Instant) -> Decided {
        let decided = self.one_call(checks, deadline).await;
        match decided {
            Err(e) if checks.len() > 1 && call::failed_in_the_database(&e) => {
                let alone = checks.iter().map(|check| async move {
                    let mut decided = self.one_call(std::slice::from_ref(check), deadline).await?;
                    decided.pop().unwrap_or_else(|| Err(missing_outcome()))
                });
                Ok(futures_util::future::join_all(alone).await)
            }
            decided => decided,
        }
    }

    async fn one_call(&self, checks: &[Sent<'_>], deadline: Instant) -> Decided {
        let params = rate_params(checks, self.retention_us);
        let limits: Vec<usize> = checks.iter().map(|(p, _, _)| p.limits().len()).collect();
        let row = self
            .shared
            .calls
            .row(
                "rate_check",
                checks.len(),
                &self.shared.sql.decide_rates,
                &params,
                Some(deadline),
            )
            .await?;
        let reply: Vec<i64> = row
            .try_get(0)
            .map_err(|e| StoreError::new(StoreErrorKind::Protocol, e))?;
        decode_rates(&reply, &limits)
    }
}

/// A reply that left a check out.
fn missing_outcome() -> StoreError {
    StoreError::new(
        StoreErrorKind::Protocol,
        "decide_rates returned no outcome for a check",
    )
}

/// The parameters of `decide_rates` for `checks` (its deadline aside): per check its algorithm,
/// number of limits, cost, attempt and whether it is a reservation, and every check's keys,
/// quotas, windows and penalties (µs, 0: none) in turn; then per check what it settles, if it is a settlement; then how
/// long a charged attempt is remembered after its deadline, `retention_us`.
fn rate_params(checks: &[Sent<'_>], retention_us: i64) -> Vec<Param> {
    let mut algorithms: Vec<i16> = Vec::with_capacity(checks.len());
    let mut counts: Vec<i32> = Vec::with_capacity(checks.len());
    let (mut keys, mut quotas, mut windows) = (Vec::new(), Vec::new(), Vec::new());
    let mut blocks: Vec<i64> = Vec::new();
    let mut costs: Vec<i64> = Vec::with_capacity(checks.len());
    let mut attempts: Vec<i64> = Vec::with_capacity(checks.len());
    let mut reservations: Vec<bool> = Vec::with_capacity(checks.len());
    // of a settlement, what its check reserved, the check's attempt and whether it was a
    // reservation; -1, 0 and false otherwise
    let mut reserved: Vec<i64> = Vec::with_capacity(checks.len());
    let mut settled: Vec<i64> = Vec::with_capacity(checks.len());
    let mut refundable: Vec<bool> = Vec::with_capacity(checks.len());
    for (policy, check, _) in checks {
        algorithms.push(match policy.algorithm() {
            Algorithm::SlidingLog => 1,
            Algorithm::SlidingCounter => 2,
            Algorithm::Gcra => 3,
        });
        let limits = policy.limits();
        counts.push(i32::try_from(limits.len()).unwrap_or(i32::MAX));
        keys.extend(policy.store_keys(&check.key()));
        for limit in limits {
            quotas.push(i64::try_from(limit.quota()).unwrap_or(i64::MAX));
            windows.push(i64::try_from(limit.window_us()).unwrap_or(i64::MAX));
            blocks.push(i64::try_from(limit.block_us()).unwrap_or(i64::MAX));
        }
        // bounded by the client already (RateCheck::bounded); this cannot overflow a sum
        costs.push(i64::try_from(check.cost().min(1 << 62)).unwrap_or(1 << 62));
        attempts.push(signed(check.attempt()));
        reservations.push(check.is_reservation());
        let settles = check.settles();
        reserved.push(settles.map_or(-1, |s| i64::try_from(s.reserved.min(1 << 62)).unwrap_or(0)));
        settled.push(settles.map_or(0, |s| signed(s.of)));
        refundable.push(settles.is_some_and(|s| s.refundable));
    }
    vec![
        Box::new(algorithms),
        Box::new(counts),
        Box::new(keys),
        Box::new(quotas),
        Box::new(windows),
        Box::new(blocks),
        Box::new(costs),
        Box::new(attempts),
        Box::new(reservations),
        Box::new(reserved),
        Box::new(settled),
        Box::new(refundable),
        Box::new(retention_us),
    ]
}

/// Each check's outcome from the reply of `decide_rates`: per check decided, its number, its
/// reply's length and the reply; `limits` holds each check's number of limits, as sent.
fn decode_rates(reply: &[i64], limits: &[usize]) -> Decided {
    let garbled = || {
        StoreError::new(
            StoreErrorKind::Protocol,
            "decide_rates returned a reply of the wrong shape",
        )
    };
    let mut decided: Vec<Option<Result<RateOutcome, StoreError>>> = Vec::new();
    decided.resize_with(limits.len(), || None);
    let mut rest = reply;
    while let [number, len, tail @ ..] = rest {
        let check = usize::try_from(*number - 1).map_err(|_| garbled())?;
        let len = usize::try_from(*len).map_err(|_| garbled())?;
        let (Some(n), Some(one)) = (limits.get(check), tail.get(..len)) else {
            return Err(garbled());
        };
        let slot = decided.get_mut(check).ok_or_else(garbled)?;
        *slot = Some(decode_rate(one, *n));
        rest = &tail[len..];
    }
    if !rest.is_empty() {
        return Err(garbled());
    }
    decided
        .into_iter()
        .map(|outcome| outcome.ok_or_else(garbled))
        .collect()
}

/// `{admitted, retry_after_us, decided_at_us, then per limit remaining, reset_us}` for `n`
/// limits, or `{-2, 0}`: received after its deadline, charged nothing.
fn decode_rate(reply: &[i64], n: usize) -> Result<RateOutcome, StoreError> {
    if reply == [-2, 0] {
        return Err(StoreError::expired());
    }
    if reply.len() != 3 + 2 * n {
        return Err(StoreError::new(
            StoreErrorKind::Protocol,
            format!("check_rate returned {} numbers for {n} limits", reply.len()),
        ));
    }
    let micros = |v: i64| Duration::from_micros(u64::try_from(v).unwrap_or(0));
    let limits = reply[3..]
        .chunks_exact(2)
        .map(|pair| LimitState {
            remaining: u64::try_from(pair[0]).unwrap_or(0),
            reset: micros(pair[1]),
        })
        .collect();
    Ok(RateOutcome {
        decided_at_us: u64::try_from(reply[2]).ok(),
        admitted: reply[0] == 1,
        retry_after: micros(reply[1]),
        limits,
    })
}

impl LockStore for PgStore {
    fn timeout(&self) -> Duration {
        self.inner.settings.timeout
    }

    fn claim(
        &self,
        key: String,
        holder: String,
        ttl: Option<Duration>,
        deadline: Instant,
    ) -> StoreFuture<ClaimOutcome> {
        let params: Vec<Param> = vec![Box::new(key), Box::new(holder), Box::new(ttl.map_or(0, ms))];
        self.call("claim", |s| &s.claim, params, Some(deadline), decode_claim)
    }

    fn lock_acquire(
        &self,
        hold: Hold,
        fence_key: String,
        lease: Duration,
        deadline: Instant,
    ) -> StoreFuture<LockAttempt> {
        let Hold { key, token } = hold;
        let params: Vec<Param> = vec![
            Box::new(key),
            Box::new(fence_key),
            Box::new(token),
            Box::new(ms(lease)),
            Box::new(ms(fence_ttl(lease))),
        ];
        let sql: fn(&Sql) -> &String = |s| &s.lock_acquire;
        self.call("lock_acquire", sql, params, Some(deadline), decode_lock)
    }

    fn extend_if_held(&self, hold: Hold, lease: Duration, deadline: Instant) -> StoreFuture<bool> {
        let Hold { key, token } = hold;
        let params: Vec<Param> = vec![Box::new(key), Box::new(token), Box::new(ms(lease))];
        self.call(
            "lock_extend",
            |s| &s.extend_hold,
            params,
            Some(deadline),
            flag,
        )
    }

    fn delete_if_held(&self, hold: Hold) -> StoreFuture<bool> {
        let Hold { key, token } = hold;
        let params: Vec<Param> = vec![
            Box::new(key),
            Box::new(token),
            Box::new(kit::release_call_id()),
            Box::new(ms(RELEASE_MARKER_TTL)),
        ];
        self.call("lock_release", |s| &s.release_hold, params, None, boolean)
    }
}

impl PermitStore for PgStore {
    fn timeout(&self) -> Duration {
        self.inner.settings.timeout
    }

    fn permit_acquire(
        &self,
        hold: Hold,
        fence_key: String,
        limit: u32,
        lease: Duration,
        wait: Option<Duration>,
        deadline: Instant,
    ) -> StoreFuture<PermitAttempt> {
        let params: Vec<Param> = vec![
            Box::new(hold.key),
            Box::new(fence_key),
            Box::new(hold.token),
            Box::new(i64::from(limit)),
            Box::new(ms(lease)),
            Box::new(ms(fence_ttl(lease))),
            Box::new(wait.map_or(0, ms)),
        ];
        let sql: fn(&Sql) -> &String = |s| &s.permit_acquire;
        self.call("permit_acquire", sql, params, Some(deadline), decode_permit)
    }

    fn permit_extend(&self, hold: Hold, lease: Duration, deadline: Instant) -> StoreFuture<bool> {
        let params: Vec<Param> = vec![
            Box::new(hold.key),
            Box::new(hold.token),
            Box::new(ms(lease)),
        ];
        let sql: fn(&Sql) -> &String = |s| &s.permit_extend;
        self.call("permit_extend", sql, params, Some(deadline), flag)
    }

    fn permit_release(&self, hold: Hold) -> StoreFuture<bool> {
        let params: Vec<Param> = vec![
            Box::new(hold.key),
            Box::new(hold.token),
            Box::new(kit::release_call_id()),
            Box::new(ms(RELEASE_MARKER_TTL)),
        ];
        let sql: fn(&Sql) -> &String = |s| &s.permit_release;
        self.call("permit_release", sql, params, None, boolean)
    }
}

impl IdempotencyStore for PgStore {
    fn timeout(&self) -> Duration {
        self.inner.settings.timeout
    }

    fn idempotency_begin(
        &self,
        hold: Hold,
        fingerprint: String,
        lease: Duration,
        deadline: Instant,
    ) -> StoreFuture<IdempotencyBegin> {
        let Hold { key, token } = hold;
        let params: Vec<Param> = vec![
            Box::new(key),
            Box::new(fingerprint),
            Box::new(token),
            Box::new(ms(lease)),
        ];
        let sql: fn(&Sql) -> &String = |s| &s.idem_begin;
        self.call(
            "idempotency_begin",
            sql,
            params,
            Some(deadline),
            decode_idem_begin,
        )
    }

    fn idempotency_complete(
        &self,
        hold: Hold,
        response: Bytes,
        retention: Duration,
        deadline: Instant,
    ) -> StoreFuture<bool> {
        let Hold { key, token } = hold;
        let params: Vec<Param> = vec![
            Box::new(key),
            Box::new(token),
            Box::new(response.to_vec()),
            Box::new(ms(retention)),
        ];
        let sql: fn(&Sql) -> &String = |s| &s.idem_complete;
        self.call("idempotency_complete", sql, params, Some(deadline), flag)
    }

    fn idempotency_release(&self, hold: Hold) -> StoreFuture<bool> {
        let Hold { key, token } = hold;
        let params: Vec<Param> = vec![
            Box::new(key),
            Box::new(token),
            Box::new(kit::release_call_id()),
            Box::new(ms(RELEASE_MARKER_TTL)),
        ];
        let sql: fn(&Sql) -> &String = |s| &s.idem_release;
        self.call("idempotency_release", sql, params, None, boolean)
    }

    fn idempotency_extend(
        &self,
        hold: Hold,
        lease: Duration,
        deadline: Instant,
    ) -> StoreFuture<bool> {
        let Hold { key, token } = hold;
        let params: Vec<Param> = vec![Box::new(key), Box::new(token), Box::new(ms(lease))];
        let sql: fn(&Sql) -> &String = |s| &s.idem_extend;
        self.call("idempotency_extend", sql, params, Some(deadline), flag)
    }
}

/// `(tag, lease_left_ms, response)`: 0 claimed, 1 running elsewhere, 2 another fingerprint,
/// 3 completed.
fn decode_idem_begin(row: &Row) -> Result<IdempotencyBegin, StoreError> {
    let tag = tag(row)?;
    let lease_left_ms: Option<i64> = row.try_get(1).map_err(protocol)?;
    let response: Option<Vec<u8>> = row.try_get(2).map_err(protocol)?;
    kit::idempotency_begin(tag.into(), lease_left_ms, response.map(Bytes::from))
}

impl Store for PgStore {
    fn ping(&self) -> StoreFuture<()> {
        self.call("ping", |s| &s.ping, Vec::new(), None, |_| Ok(()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rate_replies_decode_in_limit_order() {
        let outcome = decode_rate(&[0, 1_500, 1_700_000, 3, 2_000_000, 0, 700], 2).unwrap();
        assert!(!outcome.admitted);
        assert_eq!(outcome.decided_at_us, Some(1_700_000));
        assert_eq!(outcome.retry_after, Duration::from_micros(1_500));
        assert_eq!(
            outcome.limits,
            vec![
                LimitState {
                    remaining: 3,
                    reset: Duration::from_secs(2)
                },
                LimitState {
                    remaining: 0,
                    reset: Duration::from_micros(700)
                },
            ]
        );
        // a negative number (a clock step back) reads as zero; a short reply is an error
        let outcome = decode_rate(&[1, -5, 9, 1, -1], 1).unwrap();
        assert_eq!(outcome.retry_after, Duration::ZERO);
        assert_eq!(outcome.limits[0].reset, Duration::ZERO);
        let short = decode_rate(&[1, 0, 9, 1], 1).unwrap_err();
        assert_eq!(short.kind(), StoreErrorKind::Protocol);
        // received after its deadline: charged nothing, a timeout
        let late = decode_rate(&[-2, 0], 1).unwrap_err();
        assert_eq!(late.kind(), StoreErrorKind::Timeout);
    }

    #[test]
    fn ids_keep_their_bits() {
        assert_eq!(signed(u64::MAX), -1);
        assert_eq!(signed(7), 7);
    }
}
