//! One statement on a pooled connection, bounded by the store timeout, and how its failures
//! become [`StoreError`]s.

use std::time::Duration;

use deadpool_postgres::{Object, Pool, PoolError};
use tokio::time::{Instant, timeout_at};
use tokio_postgres::Row;
use tokio_postgres::error::SqlState;
use tokio_postgres::types::ToSql;

use crate::store::{StoreError, StoreErrorKind};

/// A statement parameter, owned so that the call's future is `'static`.
pub(super) type Param = Box<dyn ToSql + Send + Sync>;

/// Runs statements on the pool, each within `timeout` all told: the pool checkout, the
/// statement's preparation (once per connection, then cached) and its execution.
#[derive(Clone)]
pub(super) struct Calls {
    pub(super) pool: Pool,
    pub(super) timeout: Duration,
}

/// How one try of a statement failed.
enum Failure {
    /// The connection broke: the statement may or may not have run, and may be sent again.
    Dropped(StoreError),
    Other(StoreError),
}

impl Calls {
    /// Runs `sql` with `params` and returns its one row. A statement whose connection broke is
    /// sent once more on another connection within the same timeout: every operation of the
    /// store is safe to run twice (the second run answers as the first did).
    pub(super) async fn row(
        &self,
        operation: &'static str,
        sql: &str,
        params: &[Param],
    ) -> Result<Row, StoreError> {
        let started = std::time::Instant::now();
        let deadline = Instant::now() + self.timeout;
        let result = match self.once(sql, params, deadline).await {
            Ok(row) => Ok(row),
            Err(Failure::Dropped(_)) => match self.once(sql, params, deadline).await {
                Ok(row) => Ok(row),
                Err(Failure::Dropped(e) | Failure::Other(e)) => Err(e),
            },
            Err(Failure::Other(e)) => Err(e),
        };
        crate::metrics::store_call(
            operation,
            started.elapsed(),
            result.as_ref().err().map(StoreError::kind),
        );
        result
    }

    async fn once(&self, sql: &str, params: &[Param], deadline: Instant) -> Result<Row, Failure> {
        let client = match timeout_at(deadline, self.pool.get()).await {
            Ok(Ok(client)) => client,
            Ok(Err(e)) => return Err(Failure::Other(pool_error(e))),
            Err(_) => return Err(Failure::Other(StoreError::timeout())),
        };
        let refs: Vec<&(dyn ToSql + Sync)> =
            params.iter().map(|p| &**p as &(dyn ToSql + Sync)).collect();
        let run = async {
            let statement = client.prepare_cached(sql).await?;
            client.query_one(&statement, &refs).await
        };
        let outcome = timeout_at(deadline, run).await;
        match outcome {
            Ok(Ok(row)) => Ok(row),
            Ok(Err(e)) if client.is_closed() => Err(Failure::Dropped(pg_error(e))),
            Ok(Err(e)) => Err(Failure::Other(pg_error(e))),
            Err(_) => {
                // its reply may still come, or never (a hung server): the connection is not
                // handed to the next caller
                drop(Object::take(client));
                Err(Failure::Other(StoreError::timeout()))
            }
        }
    }
}

/// A failure to get a connection from the pool.
pub(super) fn pool_error(e: PoolError) -> StoreError {
    match e {
        PoolError::Timeout(_) => StoreError::timeout(),
        // the connection could not be made: refused, reset, or turned away by the server
        PoolError::Backend(e) => StoreError::new(StoreErrorKind::Unavailable, e),
        PoolError::Closed => {
            StoreError::new(StoreErrorKind::Unavailable, "the connection pool is closed")
        }
        other => StoreError::new(StoreErrorKind::Protocol, other.to_string()),
    }
}

/// A failure of a statement: by its SQLSTATE when the server sent one, else by whether the
/// connection broke.
pub(super) fn pg_error(e: tokio_postgres::Error) -> StoreError {
    let kind = match e.code() {
        Some(code) => sqlstate_kind(code),
        None if e.is_closed() || caused_by_io(&e) => StoreErrorKind::Unavailable,
        None => StoreErrorKind::Protocol,
    };
    StoreError::new(kind, e)
}

fn sqlstate_kind(code: &SqlState) -> StoreErrorKind {
    let class = &code.code()[..2.min(code.code().len())];
    if *code == SqlState::QUERY_CANCELED {
        // statement_timeout: the server gave up as the client would have
        StoreErrorKind::Timeout
    } else if matches!(class, "08" | "53" | "57")
        // a standby: the write did not happen, the primary is elsewhere
        || *code == SqlState::READ_ONLY_SQL_TRANSACTION
    {
        StoreErrorKind::Unavailable
    } else {
        StoreErrorKind::Protocol
    }
}

fn caused_by_io(e: &tokio_postgres::Error) -> bool {
    let mut source = std::error::Error::source(e);
    while let Some(cause) = source {
        if cause.is::<std::io::Error>() {
            return true;
        }
        source = cause.source();
    }
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sqlstates_map_to_kinds() {
        assert_eq!(
            sqlstate_kind(&SqlState::QUERY_CANCELED),
            StoreErrorKind::Timeout
        );
        assert_eq!(
            sqlstate_kind(&SqlState::ADMIN_SHUTDOWN),
            StoreErrorKind::Unavailable
        );
        assert_eq!(
            sqlstate_kind(&SqlState::CONNECTION_FAILURE),
            StoreErrorKind::Unavailable
        );
        assert_eq!(
            sqlstate_kind(&SqlState::TOO_MANY_CONNECTIONS),
            StoreErrorKind::Unavailable
        );
        assert_eq!(
            sqlstate_kind(&SqlState::READ_ONLY_SQL_TRANSACTION),
            StoreErrorKind::Unavailable
        );
        assert_eq!(
            sqlstate_kind(&SqlState::UNDEFINED_FUNCTION),
            StoreErrorKind::Protocol
        );
    }
}
