//! [`PgStore::once`]: work that runs exactly once per key, in a transaction that records its
//! output in the same commit as its own writes.

use std::fmt;
use std::ops::Deref;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use deadpool_postgres::Object;

use bytes::Bytes;
use tokio_postgres::error::SqlState;
use tokio_postgres::types::ToSql;

use super::PgStore;
use super::call::{pg_error, pool_error};
use crate::store::kit::observed;
use crate::store::transaction::{CommitError, Run, RunBegun, RunFuture, RunStart};
use crate::store::{StoreError, StoreErrorKind, StoreFuture, TransactionStore, millis};

/// What [`PgStore::once`] answers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Once {
    /// The work ran now and committed, together with this output.
    Ran(Bytes),
    /// An earlier run committed this output: the work did not run again.
    Replayed(Bytes),
}

/// Why [`PgStore::once`] did not answer with an output.
#[derive(Debug)]
#[non_exhaustive]
pub enum OnceError<E> {
    /// Another run of the same key is in progress (its transaction is open): try again later.
    InFlight,
    /// The key was used with another fingerprint: a different request reused it.
    Mismatch,
    /// The work failed: nothing of it stands, and the key is free for another run.
    Work(E),
    /// The store failed. Nothing of this run stands and the key is free — once the server has
    /// ended a broken connection's transaction, which a retry meanwhile finds
    /// [`InFlight`](Self::InFlight); a commit whose answer was lost has been looked up before
    /// this is said.
    Store(StoreError),
    /// The commit's answer was lost and the store could not be asked how it ended: the run may
    /// stand. Run it again with the same key to learn: its output if it committed, or a run.
    Unknown(StoreError),
}

impl<E: fmt::Display> fmt::Display for OnceError<E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::InFlight => f.write_str("another run of this key is in progress"),
            Self::Mismatch => f.write_str("the key was used with another fingerprint"),
            Self::Work(e) => write!(f, "the work failed: {e}"),
            Self::Store(e) => write!(f, "the store failed: {e}"),
            Self::Unknown(e) => write!(f, "the run's outcome is unknown: {e}"),
        }
    }
}

impl<E: std::error::Error + 'static> std::error::Error for OnceError<E> {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Self::Work(e) => Some(e),
            Self::Store(e) | Self::Unknown(e) => Some(e),
            _ => None,
        }
    }
}

impl<E> From<StoreError> for OnceError<E> {
    fn from(e: StoreError) -> Self {
        Self::Store(e)
    }
}

/// A seed of the key's advisory-lock hash, apart from `lock_key`'s.
const LOCK_SEED: i64 = 0x1d3c_5a79_0f2e_4b68;

/// How long the server lets a run of [`PgStore::once`] stay idle in its transaction.
const ONCE_IDLE: Duration = Duration::from_secs(30);

/// Takes the key's advisory lock for the transaction, if free.
const TRY_LOCK: &str = "SELECT pg_try_advisory_xact_lock(hashtextextended($1, $2))";

/// Takes the key's advisory lock for the transaction, waiting for it.
const LOCK: &str = "SELECT pg_advisory_xact_lock(hashtextextended($1, $2))";

/// The transaction of a run, on a connection of the store's pool: what the work (or the handler
/// behind [`IdempotencyLayer::in_transaction`](crate::idempotency::IdempotencyLayer::in_transaction))
/// writes its rows through. It dereferences to the connection's [`tokio_postgres::Client`],
/// inside the open transaction: run statements on it; do not commit, roll back or open
/// another transaction on it — the run ends it, with its record.
///
/// In an axum handler (feature `axum`) take it as an argument: `async fn handler(tx: OnceTx)`.
///
/// Clones share the transaction; it is the run's until its work returns (the handler's until
/// its response is complete): keep no clone beyond that. A transaction dropped before its end
/// (the work cancelled, a panic) takes its connection out of the pool, so that the server rolls
/// it back, and nothing of it stands.
#[derive(Clone)]
pub struct OnceTx {
    open: Arc<Open>,
}

impl fmt::Debug for OnceTx {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("OnceTx")
            .field("ended", &self.open.ended.load(Ordering::Relaxed))
            .finish_non_exhaustive()
    }
}

impl OnceTx {
    /// Prepares `sql` once per pooled connection and reuses it: a statement the handler runs
    /// on every request then costs one round trip instead of two (a prepare and a run).
    pub async fn prepare_cached(
        &self,
        sql: &str,
    ) -> Result<tokio_postgres::Statement, tokio_postgres::Error> {
        self.open.object().prepare_cached(sql).await
    }
}

impl Deref for OnceTx {
    type Target = tokio_postgres::Client;

    fn deref(&self) -> &tokio_postgres::Client {
        self.open.client()
    }
}

/// A connection with an open transaction.
struct Open {
    /// `Some` until dropped.
    client: Option<Object>,
    /// Committed or rolled back: the connection may go back to the pool.
    ended: AtomicBool,
}

impl Open {
    fn object(&self) -> &Object {
        match &self.client {
            Some(client) => client,
            None => unreachable!("an open transaction has its connection until dropped"),
        }
    }

    fn client(&self) -> &tokio_postgres::Client {
        self.object()
    }
}

impl Drop for Open {
    fn drop(&mut self) {
        if !self.ended.load(Ordering::Acquire)
            && let Some(client) = self.client.take()
        {
            // the transaction is still open: the connection must not go back to the pool; closed,
            // it is rolled back on the server
            drop(Object::take(client));
        }
    }
}

/// How a run began.
enum Begun {
    /// The key's transaction is open, its lock held: run the work.
    Running(Running),
    /// A run committed: its output.
    Recorded(Bytes),
    /// A run committed with another fingerprint.
    Mismatch,
    /// Another run holds the key.
    InFlight,
}

/// A run whose transaction is open and holds its key's lock.
struct Running {
    store: PgStore,
    tx: OnceTx,
    key: String,
    fingerprint: String,
    retention: Duration,
}

impl fmt::Debug for Running {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Running").field("key", &self.key).finish()
    }
}

impl PgStore {
    /// Runs `work` exactly once per `key`: in a transaction of its own that also records the
    /// output `work` returns, in the same commit — so that both stand or neither does. The work
    /// writes its rows through the transaction it is given (an [`OnceTx`], which dereferences to
    /// the connection). A key whose run committed answers [`Once::Replayed`] with the recorded
    /// output (for `retention`), without running `work`.
    ///
    /// - **Concurrent runs** of a key are kept apart by a transaction-level advisory lock: a
    ///   second one answers [`OnceError::InFlight`] at once, without waiting; nothing holds the
    ///   key longer than the transaction, so a run that fails, is cancelled, times out or whose
    ///   process dies frees it as its transaction ends (on the server: when the connection goes,
    ///   or when the transaction has been idle for 30 s).
    /// - **Isolation**: the transaction is PostgreSQL's default, READ COMMITTED: the work reads
    ///   what is committed as each statement starts, as it would without tollgate; the lock
    ///   keeps runs of one key apart, not the work's rows from other writers.
    /// - **A lost commit answer** (the connection broke during `COMMIT`) is resolved before
    ///   anything is said: once the run's transaction is over on the server, the record is
    ///   looked up — found, the run committed ([`Once::Ran`]); not found, nothing of it stands.
    /// - `fingerprint` names the request the key was used with; another one is
    ///   [`OnceError::Mismatch`].
    /// - Cost: a replay is one round trip; a run two besides the work's own (the transaction's
    ///   start with the lock and the lookup, pipelined; the record with the commit).
    ///
    /// Needs the store's schema migrated (table `once_records`).
    pub async fn once<E>(
        &self,
        key: &str,
        fingerprint: &str,
        retention: Duration,
        work: impl AsyncFnOnce(&OnceTx) -> Result<Bytes, E>,
    ) -> Result<Once, OnceError<E>> {
        let start = RunStart::new(key, fingerprint, retention, ONCE_IDLE);
        let running = match self.begin_once(start).await? {
            Begun::Running(running) => running,
            Begun::Recorded(output) => return Ok(Once::Replayed(output)),
            Begun::Mismatch => return Err(OnceError::Mismatch),
            Begun::InFlight => return Err(OnceError::InFlight),
        };
        let output = match work(running.tx()).await {
            Ok(output) => output,
            Err(e) => {
                running.roll_back().await;
                return Err(OnceError::Work(e));
            }
        };
        match running.commit(&output).await {
            Ok(()) => Ok(Once::Ran(output)),
            Err(CommitError::Mismatch) => Err(OnceError::Mismatch),
            Err(CommitError::NotCommitted(e)) => Err(OnceError::Store(e)),
            Err(CommitError::Unknown(e)) => Err(OnceError::Unknown(e)),
        }
    }

    /// Begins a run of `key`: its record if one committed, or its transaction, open and
    /// holding the key's lock.
    ///
    /// Bounded by the store timeout. The server ends the transaction should it stay idle for
    /// `idle` (its copy cut off from the database, or dead without closing its connection).
    async fn begin_once(&self, start: RunStart) -> Result<Begun, StoreError> {
        // a transaction begun too late is dropped with its connection: the server rolls it back
        let started = std::time::Instant::now();
        let begin = self.begin_within(start);
        let begun = tokio::time::timeout(self.timeout(), begin)
            .await
            .unwrap_or_else(|_| Err(StoreError::timeout()));
        observed("once_begin", started, &begun);
        begun
    }

    async fn begin_within(&self, start: RunStart) -> Result<Begun, StoreError> {
        let RunStart {
            key,
            fingerprint,
            retention,
            idle,
            ..
        } = start;
        let client = self.pool().get().await.map_err(pool_error)?;
        let sql = &self.inner.shared.sql;
        // prepared together (once per connection): the commit then sends the record and COMMIT
        // at once, with nothing to wait for in between
        let (lock, lookup, _) = tokio::try_join!(
            client.prepare_cached(TRY_LOCK),
            client.prepare_cached(&sql.once_lookup),
            client.prepare_cached(&sql.once_record),
        )
        .map_err(pg_error)?;
        let tx = OnceTx {
            open: Arc::new(Open {
                client: Some(client),
                ended: AtomicBool::new(false),
            }),
        };
        // one round trip: the lookup's snapshot is taken after the lock, so it sees every run
        // that committed before it was taken
        // the lock and the lookup are bounded by the store timeout; the handler's statements by
        // the session's own statement_timeout, as without the layer
        let begin = format!(
            "BEGIN; SET LOCAL idle_in_transaction_session_timeout = {}; \
             SET LOCAL statement_timeout = {}",
            setting_ms(idle),
            setting_ms(self.timeout())
        );
        let lock_params: [&(dyn ToSql + Sync); 2] = [&key, &LOCK_SEED];
        let lookup_params: [&(dyn ToSql + Sync); 1] = [&key];
        let (_, locked, row, _) = tokio::try_join!(
            tx.batch_execute(&begin),
            tx.query_one(&lock, &lock_params),
            tx.query_opt(&lookup, &lookup_params),
            tx.batch_execute("SET LOCAL statement_timeout TO DEFAULT"),
        )
        .map_err(pg_error)?;
        let running = Running {
            store: self.clone(),
            tx,
            key,
            fingerprint,
            retention,
        };
        // a record answers whoever holds the lock (a replay takes it for a moment too); the
        // transaction of an answer that is not a run ends in the background
        let begun = match (row, locked.try_get::<_, bool>(0).map_err(pg_error)?) {
            (Some(row), _) => recorded(&row, &running.fingerprint)?,
            (None, false) => Begun::InFlight,
            (None, true) => return Ok(Begun::Running(running)),
        };
        tokio::spawn(running.roll_back());
        Ok(begun)
    }

    /// After a commit whose answer was lost: waits until the run's transaction is over on the
    /// server (its advisory lock free), then looks the record up. Connections that broke with
    /// the one of the commit are passed over, for up to twenty store timeouts.
    async fn resolve(&self, key: &str) -> Result<Option<tokio_postgres::Row>, StoreError> {
        let patience = self.timeout() * 20;
        let give_up = tokio::time::Instant::now() + patience;
        loop {
            let attempt =
                tokio::time::timeout(patience + self.timeout(), self.committed(key, patience));
            match attempt.await.unwrap_or_else(|_| Err(StoreError::timeout())) {
                Err(e)
                    if e.kind() == StoreErrorKind::Unavailable
                        && tokio::time::Instant::now() < give_up =>
                {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                answer => return answer,
            }
        }
    }

    /// The record of `key` once no transaction holds the key's lock (waiting up to `patience`).
    async fn committed(
        &self,
        key: &str,
        patience: Duration,
    ) -> Result<Option<tokio_postgres::Row>, StoreError> {
        let mut client = self.pool().get().await.map_err(pool_error)?;
        let tx = client.transaction().await.map_err(pg_error)?;
        let wait = format!("SET LOCAL lock_timeout = {}", millis(patience));
        tx.batch_execute(&wait).await.map_err(pg_error)?;
        tx.query_one(LOCK, &[&key, &LOCK_SEED])
            .await
            .map_err(|e| match e.code() {
                Some(code) if *code == SqlState::LOCK_NOT_AVAILABLE => {
                    StoreError::new(StoreErrorKind::Timeout, e)
                }
                _ => pg_error(e),
            })?;
        let lookup = &self.inner.shared.sql.once_lookup;
        tx.query_opt(lookup, &[&key]).await.map_err(pg_error)
    }
}

impl Running {
    /// The run's transaction.
    fn tx(&self) -> &OnceTx {
        &self.tx
    }

    /// Records `output` and commits, in one round trip; a commit whose answer was lost is
    /// looked up before anything is said.
    async fn commit(self, output: &[u8]) -> Result<(), CommitError> {
        let started = std::time::Instant::now();
        let committed = self.record_and_commit(output).await;
        let failure = match &committed {
            Ok(()) => Ok(()),
            Err(CommitError::NotCommitted(e) | CommitError::Unknown(e)) => Err(e.shared()),
            Err(CommitError::Mismatch) => Ok(()),
        };
        observed("once_commit", started, &failure);
        committed
    }

    /// [`commit`](Self::commit), without its measurement.
    async fn record_and_commit(self, output: &[u8]) -> Result<(), CommitError> {
        let sql = &self.store.inner.shared.sql;
        let retention_ms = i64::try_from(millis(self.retention)).unwrap_or(i64::MAX);
        let params: [&(dyn ToSql + Sync); 4] =
            [&self.key, &self.fingerprint, &output, &retention_ms];
        let bound = format!(
            "SET LOCAL statement_timeout = {}",
            setting_ms(self.store.timeout())
        );
        let commit = async {
            let record = self
                .tx
                .open
                .object()
                .prepare_cached(&sql.once_record)
                .await?;
            // the record is bounded by the store timeout; the commit (deferred constraints and
            // triggers of the handler's rows) by the session's own
            tokio::try_join!(
                self.tx.batch_execute(&bound),
                self.tx.execute(&record, &params),
                self.tx
                    .batch_execute("SET LOCAL statement_timeout TO DEFAULT; COMMIT"),
            )
            .map(drop)
        };
        // no answer within the store timeout is as ambiguous as a broken connection
        let committed = tokio::time::timeout(self.store.timeout(), commit)
            .await
            .map_err(|_| StoreError::timeout());
        match committed {
            Err(unanswered) => self.resolve(unanswered).await,
            Ok(committed) => self.settle(committed).await,
        }
    }

    /// The commit's answer came: committed, or (an error without a code: the connection broke)
    /// looked up, or rolled back.
    async fn settle(self, committed: Result<(), tokio_postgres::Error>) -> Result<(), CommitError> {
        match committed {
            Ok(()) => {
                self.tx.open.ended.store(true, Ordering::Release);
                Ok(())
            }
            // no answer from the server: the commit may have happened
            Err(e) if e.code().is_none() => self.resolve(pg_error(e)).await,
            Err(e) => {
                self.roll_back().await;
                Err(CommitError::NotCommitted(pg_error(e)))
            }
        }
    }

    /// After a commit whose answer was lost (`lost`): the record looked up once the run's
    /// transaction is over on the server. Its connection is dropped first, and with it the
    /// transaction if it is still open.
    async fn resolve(self, lost: StoreError) -> Result<(), CommitError> {
        let Running {
            store,
            key,
            fingerprint,
            ..
        } = self;
        match store.resolve(&key).await {
            Ok(Some(row)) => match recorded(&row, &fingerprint) {
                Ok(Begun::Recorded(_)) => Ok(()),
                Ok(_) => Err(CommitError::Mismatch),
                Err(e) => Err(CommitError::Unknown(e)),
            },
            Ok(None) => Err(CommitError::NotCommitted(lost)),
            Err(e) => Err(CommitError::Unknown(e)),
        }
    }

    /// Rolls the run back: nothing of it stands, and the key is free.
    async fn roll_back(self) {
        let rollback = self.tx.batch_execute("ROLLBACK");
        // unanswered, the connection is dropped (not ended): the server rolls back without it
        if let Ok(Ok(())) = tokio::time::timeout(self.store.timeout(), rollback).await {
            self.tx.open.ended.store(true, Ordering::Release);
        }
    }
}

impl TransactionStore for PgStore {
    fn begin_run(&self, start: RunStart) -> StoreFuture<RunBegun> {
        let store = self.clone();
        Box::pin(async move {
            Ok(match store.begin_once(start).await? {
                Begun::Running(running) => RunBegun::Running(Box::new(running)),
                Begun::Recorded(output) => RunBegun::Recorded(output),
                Begun::Mismatch => RunBegun::Mismatch,
                Begun::InFlight => RunBegun::InFlight,
            })
        })
    }
}

impl Run for Running {
    fn lend(&self, extensions: &mut http::Extensions) {
        extensions.insert(self.tx.clone());
    }

    fn commit(self: Box<Self>, output: Bytes) -> RunFuture<Result<(), CommitError>> {
        Box::pin(async move { Running::commit(*self, &output).await })
    }

    fn roll_back(self: Box<Self>) -> RunFuture<()> {
        Box::pin(Running::roll_back(*self))
    }
}

/// `d` as a PostgreSQL timeout setting in milliseconds: at least 1 (0 would turn it off), at
/// most what the setting takes.
fn setting_ms(d: Duration) -> u64 {
    millis(d).clamp(1, i32::MAX as u64)
}

/// A recorded run as the beginning of a run with `fingerprint`.
fn recorded(row: &tokio_postgres::Row, fingerprint: &str) -> Result<Begun, StoreError> {
    let recorded: &str = row.try_get(0).map_err(pg_error)?;
    if recorded != fingerprint {
        return Ok(Begun::Mismatch);
    }
    let output: &[u8] = row.try_get(1).map_err(pg_error)?;
    Ok(Begun::Recorded(Bytes::copy_from_slice(output)))
}
