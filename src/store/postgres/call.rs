//! One call of a store function on a pooled connection: in a transaction of its own, bounded by
//! the store timeout on both sides, and how its failures become [`StoreError`]s.
//!
//! What bounds what:
//! - the client gives up at the call's deadline (pool checkout, preparation, execution and
//!   commit together) and never hands that connection out again;
//! - the server gives up too: every call sets its own `statement_timeout` (`SET LOCAL`, in its
//!   own transaction), on any pool — a function waiting for a lock is cancelled;
//! - PostgreSQL switches `statement_timeout` off for the commit, so a commit waiting for a
//!   synchronous standby is bounded only by the cancel request the client sends when the
//!   deadline passes. A cancelled wait leaves the commit in place locally (not yet on the
//!   standby); a release sent afterwards waits for it and sees it (see `lock_key` in
//!   `migrations/0009_base.sql`). A cancel request that cannot reach the server (a partition) bounds nothing
//!   there: the commit waits for the standby as long as the server lets it, the call has
//!   failed with a timeout meanwhile, and a release of the key waits behind it.

use std::sync::Arc;
use std::time::Duration;

use deadpool_postgres::{Client, Object, Pool, PoolError};
use futures_util::future::join3;
use tokio::time::{Instant, timeout_at};
use tokio_postgres::error::SqlState;
use tokio_postgres::types::ToSql;
use tokio_postgres::{CancelToken, NoTls, Row};
use tracing::Instrument;

use crate::store::span::{self, Call, Command, Server, System};
use crate::store::{StoreClock, StoreError, StoreErrorKind, kit};

/// A statement parameter, owned so that the call's future is `'static`.
pub(super) type Param = Box<dyn ToSql + Send + Sync>;

/// How long a cancel request may take to reach the server.
const CANCEL_TIMEOUT: Duration = Duration::from_secs(2);

/// Runs calls on the pool, each within `timeout` all told.
pub(super) struct Calls {
    pub(super) pool: Pool,
    pub(super) timeout: Duration,
    /// Readings of the database clock, on which write deadlines are sent.
    pub(super) clock: Arc<StoreClock>,
    /// The statement that reads the database clock.
    pub(super) now: String,
    /// Where calls go, for their spans: known for a store made from a URL.
    pub(super) server: Option<Server>,
}

/// A write's deadline on the caller's clock and, once mapped, on the database's: kept, so that
/// a call sent again carries the same one.
pub(super) struct WriteDeadline {
    pub(super) local: Instant,
    pub(super) store_us: Option<i64>,
}

/// How one try of a call failed.
enum Failure {
    /// The connection broke: the call may or may not have run, and may be sent again.
    Dropped(StoreError),
    Other(StoreError),
}

impl Calls {
    /// Runs `sql` with `params` — and, for a write (`deadline`), the time of its deadline on
    /// the database clock as the last parameter — and returns its one row, in the span of the
    /// call (carrying `batch` of the store's operations). A call whose connection broke is sent
    /// once more on another connection within the same timeout, with the same deadline: every
    /// operation of the store is safe to run twice.
    pub(super) async fn row(
        &self,
        operation: &'static str,
        batch: usize,
        sql: &str,
        params: &[Param],
        deadline: Option<Instant>,
    ) -> Result<Row, StoreError> {
        let call = Call {
            system: System::Postgresql,
            command: Command::Select,
            target: routine(sql),
            operation,
        };
        let span = span::call_span(&call, || self.server.clone());
        span::record_batch(&span, batch);
        let result = self
            .row_once_or_twice(operation, sql, params, deadline)
            .instrument(span.clone())
            .await;
        span::record_result(&span, &result, status_code);
        result
    }

    async fn row_once_or_twice(
        &self,
        operation: &'static str,
        sql: &str,
        params: &[Param],
        deadline: Option<Instant>,
    ) -> Result<Row, StoreError> {
        let started = std::time::Instant::now();
        let bound = Instant::now() + self.timeout;
        let mut write = deadline.map(|d| WriteDeadline {
            local: d.min(bound),
            store_us: None,
        });
        let result = match self.once(sql, params, bound, write.as_mut()).await {
            Ok(row) => Ok(row),
            Err(Failure::Dropped(_)) => match self.once(sql, params, bound, write.as_mut()).await {
                Ok(row) => Ok(row),
                Err(Failure::Dropped(e) | Failure::Other(e)) => Err(e),
            },
            Err(Failure::Other(e)) => Err(e),
        };
        kit::observed(operation, started, &result);
        result
    }

    async fn once(
        &self,
        sql: &str,
        params: &[Param],
        bound: Instant,
        write: Option<&mut WriteDeadline>,
    ) -> Result<Row, Failure> {
        let client = match timeout_at(bound, self.pool.get()).await {
            Ok(Ok(client)) => client,
            Ok(Err(e)) => return Err(Failure::Other(pool_error(e))),
            Err(_) => return Err(Failure::Other(StoreError::timeout())),
        };
        match timeout_at(bound, self.run(&client, sql, params, bound, write)).await {
            Ok(Ok(row)) => Ok(row),
            Ok(Err(e)) if client.is_closed() => Err(Failure::Dropped(e)),
            Ok(Err(e)) => Err(Failure::Other(e)),
            Err(_) => {
                // the server may still be running it — a commit waiting for a synchronous
                // standby, which statement_timeout does not bound — or never hear of it (a
                // partition): it is asked to cancel, and the connection is not handed out again
                cancel_in_background(client.cancel_token());
                drop(Object::take(client));
                Err(Failure::Other(StoreError::timeout()))
            }
        }
    }

    /// The call in a transaction of its own, with a `statement_timeout` of what is left of the
    /// call: `BEGIN; SET LOCAL`, the function, `COMMIT`, in one round trip (tokio-postgres
    /// pipelines requests polled together, and `join3` polls them in this order).
    async fn run(
        &self,
        client: &Client,
        sql: &str,
        params: &[Param],
        bound: Instant,
        write: Option<&mut WriteDeadline>,
    ) -> Result<Row, StoreError> {
        let statement = client.prepare_cached(sql).await.map_err(pg_error)?;
        let at = match write {
            Some(write) => Some(self.store_deadline(client, write).await?),
            None => None,
        };
        let mut refs: Vec<&(dyn ToSql + Sync)> =
            params.iter().map(|p| &**p as &(dyn ToSql + Sync)).collect();
        if let Some(at) = &at {
            refs.push(at);
        }
        let left = bound.saturating_duration_since(Instant::now()).as_millis();
        let begin = format!("BEGIN; SET LOCAL statement_timeout = {}", left.max(1));
        let (begun, row, committed) = join3(
            client.batch_execute(&begin),
            client.query_one(&statement, &refs),
            client.batch_execute("COMMIT"),
        )
        .await;
        begun.map_err(pg_error)?;
        // a failed function aborts the transaction: the COMMIT then rolls it back
        let row = row.map_err(pg_error)?;
        committed.map_err(pg_error)?;
        Ok(row)
    }
}

/// Asks the server to cancel what the connection of `token` runs, without waiting for it. The
/// request goes without TLS: it carries only the backend's id and secret, and the server takes
/// it before (and without) authentication.
fn cancel_in_background(token: CancelToken) {
    let Ok(runtime) = tokio::runtime::Handle::try_current() else {
        return;
    };
    runtime.spawn(async move {
        let sent = tokio::time::timeout(CANCEL_TIMEOUT, token.cancel_query(NoTls)).await;
        if !matches!(sent, Ok(Ok(()))) {
            tracing::debug!(target: "tollgate::store", "could not send a cancel request");
        }
    });
}
/// The function `sql` calls (`"schema".function`), or nothing for a statement that calls none.
fn routine(sql: &str) -> &str {
    let Some(open) = sql.find('(') else {
        return "";
    };
    let head = &sql[..open];
    head.rsplit(' ').next().unwrap_or_default()
}

/// The SQLSTATE PostgreSQL answered for `error`, if it did.
fn status_code(error: &StoreError) -> Option<&str> {
    span::cause::<PgFailure>(error)
        .and_then(|failure| failure.source.code())
        .map(SqlState::code)
}

/// A failure to get a connection from the pool.
pub(super) fn pool_error(e: PoolError) -> StoreError {
    match e {
        PoolError::Timeout(_) => StoreError::timeout(),
        // the connection could not be made: refused, reset, or turned away by the server (a
        // wrong password or database name is configuration, and says so)
        PoolError::Backend(e) => match e.code() {
            Some(_) => pg_error(e),
            None => StoreError::new(StoreErrorKind::Unavailable, PgFailure::new(e)),
        },
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
    StoreError::new(kind, PgFailure::new(e))
}

/// Whether `e` is an error the server raised while it ran a statement (one with a SQLSTATE,
/// neither a timeout nor a lost connection, nor a server that cannot take the call): the
/// transaction rolled back, nothing of the call was committed.
pub(super) fn failed_in_the_database(e: &StoreError) -> bool {
    e.kind() == StoreErrorKind::Protocol
        && std::error::Error::source(e)
            .and_then(|source| source.downcast_ref::<PgFailure>())
            .is_some_and(|failure| failure.source.code().is_some())
}

/// A failure of PostgreSQL, displayed with what the server said (`db error` alone, as
/// tokio-postgres displays it, hides the cause) or with the I/O error beneath; the
/// `tokio_postgres::Error` is its source.
#[derive(Debug)]
struct PgFailure {
    message: String,
    source: tokio_postgres::Error,
}

impl PgFailure {
    fn new(source: tokio_postgres::Error) -> Self {
        let message = match source.as_db_error() {
            Some(db) => {
                let mut message = format!(
                    "{}: {} (SQLSTATE {})",
                    db.severity(),
                    db.message(),
                    db.code().code()
                );
                for (what, text) in [("detail", db.detail()), ("hint", db.hint())] {
                    if let Some(text) = text {
                        message.push_str(&format!("; {what}: {text}"));
                    }
                }
                message
            }
            None => chain(&source),
        };
        Self { message, source }
    }
}

/// `e` and its causes, `: `-separated.
fn chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut message = e.to_string();
    let mut source = e.source();
    while let Some(cause) = source {
        let cause_text = cause.to_string();
        if !message.contains(&cause_text) {
            message.push_str(": ");
            message.push_str(&cause_text);
        }
        source = cause.source();
    }
    message
}

impl std::fmt::Display for PgFailure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for PgFailure {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&self.source)
    }
}

fn sqlstate_kind(code: &SqlState) -> StoreErrorKind {
    let class = &code.code()[..2.min(code.code().len())];
    if matches!(class, "28" | "3D") || *code == SqlState::INSUFFICIENT_PRIVILEGE {
        // a wrong password, role or database name, or a role without the rights: retrying will
        // not help, the configuration must change
        StoreErrorKind::Config
    } else if *code == SqlState::QUERY_CANCELED {
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
    fn a_call_names_its_function() {
        let sql = super::super::sql::Sql::new("tollgate");
        assert_eq!(routine(&sql.claim), "\"tollgate\".claim");
        assert_eq!(routine(&sql.decide_rates), "\"tollgate\".decide_rates");
        assert_eq!(routine(&sql.reset_rate), "\"tollgate\".reset_rate");
        assert_eq!(routine(&sql.ping), "");
    }

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
        for configuration in [
            SqlState::INVALID_PASSWORD,
            SqlState::INVALID_AUTHORIZATION_SPECIFICATION,
            SqlState::INVALID_CATALOG_NAME,
            SqlState::INSUFFICIENT_PRIVILEGE,
        ] {
            assert_eq!(sqlstate_kind(&configuration), StoreErrorKind::Config);
        }
    }
}
