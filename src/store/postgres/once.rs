//! [`PgStore::once`]: work that runs exactly once per key, in a transaction that records its
//! output in the same commit as its own writes.

use std::fmt;
use std::time::Duration;

use bytes::Bytes;
use tokio_postgres::error::SqlState;
use tokio_postgres::types::ToSql;

use super::PgStore;
use super::call::{pg_error, pool_error};
use crate::store::{StoreError, StoreErrorKind, millis};

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
    /// The store failed. Nothing of this run stands and the key is free — a commit whose answer
    /// was lost has been looked up before this is said.
    Store(StoreError),
}

impl<E: fmt::Display> fmt::Display for OnceError<E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::InFlight => f.write_str("another run of this key is in progress"),
            Self::Mismatch => f.write_str("the key was used with another fingerprint"),
            Self::Work(e) => write!(f, "the work failed: {e}"),
            Self::Store(e) => write!(f, "the store failed: {e}"),
        }
    }
}

impl<E: std::error::Error + 'static> std::error::Error for OnceError<E> {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Self::Work(e) => Some(e),
            Self::Store(e) => Some(e),
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

/// Takes the key's advisory lock for the transaction, if free.
const TRY_LOCK: &str = "SELECT pg_try_advisory_xact_lock(hashtextextended($1, $2))";

/// Takes the key's advisory lock for the transaction, waiting for it.
const LOCK: &str = "SELECT pg_advisory_xact_lock(hashtextextended($1, $2))";

impl PgStore {
    /// Runs `work` exactly once per `key`: in a transaction of its own that also records the
    /// output `work` returns, in the same commit — so that both stand or neither does. The work
    /// writes its rows through the transaction it is given. A key whose run committed answers
    /// [`Once::Replayed`] with the recorded output (for `retention`), without running `work`.
    ///
    /// - **Concurrent runs** of a key are kept apart by a transaction-level advisory lock: a
    ///   second one answers [`OnceError::InFlight`] at once, without waiting; nothing holds the
    ///   key longer than the transaction, so a run that fails, is cancelled, times out or whose
    ///   process dies frees it as its transaction ends (on the server: when the connection goes).
    /// - **Isolation**: the transaction is PostgreSQL's default, READ COMMITTED: the work reads
    ///   what is committed as each statement starts, as it would without tollgate; the lock
    ///   keeps runs of one key apart, not the work's rows from other writers.
    /// - **A lost commit answer** (the connection broke during `COMMIT`) is resolved before
    ///   anything is said: once the run's transaction is over on the server, the record is
    ///   looked up — found, the run committed ([`Once::Ran`]); not found, nothing of it stands.
    /// - `fingerprint` names the request the key was used with; another one is
    ///   [`OnceError::Mismatch`].
    ///
    /// Needs the store's schema migrated (table `once_records`).
    pub async fn once<E>(
        &self,
        key: &str,
        fingerprint: &str,
        retention: Duration,
        work: impl AsyncFnOnce(&tokio_postgres::Transaction<'_>) -> Result<Bytes, E>,
    ) -> Result<Once, OnceError<E>> {
        if let Some(done) = self.recorded(key, fingerprint).await? {
            return done;
        }
        let sql = &self.inner.shared.sql;
        let mut client = self.pool().get().await.map_err(pool_error)?;
        let tx = client.transaction().await.map_err(pg_error)?;
        let locked = tx.query_one(TRY_LOCK, &[&key, &LOCK_SEED]).await;
        if !locked
            .and_then(|row| row.try_get::<_, bool>(0))
            .map_err(pg_error)?
        {
            return Err(OnceError::InFlight);
        }
        // committed in between: the lookup above came before that run's commit
        if let Some(row) = tx
            .query_opt(&sql.once_lookup, &[&key])
            .await
            .map_err(pg_error)?
        {
            return replay(&row, fingerprint);
        }
        let output = work(&tx).await.map_err(OnceError::Work)?;
        let retention_ms = i64::try_from(millis(retention)).unwrap_or(i64::MAX);
        let record: [&(dyn ToSql + Sync); 4] =
            [&key, &fingerprint, &output.as_ref(), &retention_ms];
        tx.execute(&sql.once_record, &record)
            .await
            .map_err(pg_error)?;
        match tx.commit().await {
            Ok(()) => Ok(Once::Ran(output)),
            // no answer from the server: the commit may have happened
            Err(e) if e.code().is_none() => self.resolve(key, fingerprint, pg_error(e)).await,
            Err(e) => Err(OnceError::Store(pg_error(e))),
        }
    }

    /// The recorded run of `key`, if one committed: its replay, or a mismatch.
    async fn recorded<E>(
        &self,
        key: &str,
        fingerprint: &str,
    ) -> Result<Option<Result<Once, OnceError<E>>>, StoreError> {
        let client = self.pool().get().await.map_err(pool_error)?;
        let lookup = &self.inner.shared.sql.once_lookup;
        let row = client.query_opt(lookup, &[&key]).await.map_err(pg_error)?;
        Ok(row.map(|row| replay(&row, fingerprint)))
    }

    /// After a commit whose answer was lost: waits until the run's transaction is over on the
    /// server (its advisory lock free), then looks the record up — found, the run committed;
    /// not found, nothing of it stands (and `lost` is the answer). Connections that broke with
    /// the one of the commit are passed over, for up to twenty store timeouts.
    async fn resolve<E>(
        &self,
        key: &str,
        fingerprint: &str,
        lost: StoreError,
    ) -> Result<Once, OnceError<E>> {
        let patience = self.timeout() * 20;
        let give_up = tokio::time::Instant::now() + patience;
        loop {
            match self.committed(key, patience).await {
                Ok(Some(row)) => {
                    return match replay::<E>(&row, fingerprint) {
                        // it committed: the output is this run's
                        Ok(Once::Replayed(output)) => Ok(Once::Ran(output)),
                        other => other,
                    };
                }
                Ok(None) => return Err(OnceError::Store(lost)),
                Err(e)
                    if e.kind() == StoreErrorKind::Unavailable
                        && tokio::time::Instant::now() < give_up =>
                {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                Err(e) => return Err(OnceError::Store(e)),
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

/// A recorded run as the answer to a request with `fingerprint`.
fn replay<E>(row: &tokio_postgres::Row, fingerprint: &str) -> Result<Once, OnceError<E>> {
    let recorded: &str = row.try_get(0).map_err(pg_error)?;
    if recorded != fingerprint {
        return Err(OnceError::Mismatch);
    }
    let output: &[u8] = row.try_get(1).map_err(pg_error)?;
    Ok(Once::Replayed(Bytes::copy_from_slice(output)))
}
