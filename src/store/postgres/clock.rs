//! Deadlines on PostgreSQL's clock: readings of `clock_timestamp()` (the schema's `now_us()`)
//! for the [`StoreClock`], as `redis/clock.rs` reads `TIME`.

use std::sync::Arc;
use std::time::Duration;

use deadpool_postgres::{Client, Object, Pool};
use tokio::time::{Instant, timeout_at};

use super::call::{Calls, WriteDeadline, pg_error, pool_error};
use crate::store::deadline::Mapped;
use crate::store::{StoreClock, StoreError, StoreErrorKind};

/// How long a background reading of the clock may take.
const READING_TIMEOUT: Duration = Duration::from_secs(1);

impl Calls {
    /// `write`'s deadline in microseconds of the database clock, no later than that clock reads
    /// at the deadline: mapped once per call, from a recent reading or from one taken first on
    /// `client`. An aging reading is refreshed in the background, on a connection of the pool.
    pub(super) async fn store_deadline(
        &self,
        client: &Client,
        write: &mut WriteDeadline,
    ) -> Result<i64, StoreError> {
        if let Some(at) = write.store_us {
            return Ok(at);
        }
        let mapped = match self.clock.map(write.local) {
            Mapped::At { store_us, refresh } => {
                if refresh {
                    refresh_in_background(&self.clock, &self.pool, &self.now);
                }
                store_us
            }
            Mapped::Unknown => {
                read_clock(&self.clock, client, &self.now).await?;
                match self.clock.map(write.local) {
                    Mapped::At { store_us, .. } => store_us,
                    Mapped::Unknown => {
                        return Err(StoreError::new(
                            StoreErrorKind::Protocol,
                            "the database clock could not be read",
                        ));
                    }
                }
            }
        };
        let at = i64::try_from(mapped).unwrap_or(i64::MAX);
        write.store_us = Some(at);
        Ok(at)
    }
}

/// Reads the database clock (`sql`: the schema's `now_us()`) into `clock`.
async fn read_clock(clock: &StoreClock, client: &Client, sql: &str) -> Result<(), StoreError> {
    let statement = client.prepare_cached(sql).await.map_err(pg_error)?;
    let row = client.query_one(&statement, &[]).await.map_err(pg_error)?;
    let micros: i64 = row
        .try_get(0)
        .map_err(|e| StoreError::new(StoreErrorKind::Protocol, e))?;
    let micros = u64::try_from(micros).map_err(|_| {
        StoreError::new(
            StoreErrorKind::Protocol,
            "the database clock reads before 1970",
        )
    })?;
    clock.observe(micros, Instant::now());
    Ok(())
}

fn refresh_in_background(clock: &Arc<StoreClock>, pool: &Pool, sql: &str) {
    let Ok(runtime) = tokio::runtime::Handle::try_current() else {
        clock.refresh_failed();
        return;
    };
    let (clock, pool, sql) = (Arc::clone(clock), pool.clone(), sql.to_owned());
    runtime.spawn(async move {
        if read_in_background(&clock, &pool, &sql).await.is_err() {
            clock.refresh_failed();
        }
    });
}

/// A reading on a connection of `pool`, within [`READING_TIMEOUT`]; a connection that did not
/// answer in time is not handed out again.
async fn read_in_background(clock: &StoreClock, pool: &Pool, sql: &str) -> Result<(), StoreError> {
    let until = Instant::now() + READING_TIMEOUT;
    let client = match timeout_at(until, pool.get()).await {
        Ok(client) => client.map_err(pool_error)?,
        Err(_) => return Err(StoreError::timeout()),
    };
    match timeout_at(until, read_clock(clock, &client, sql)).await {
        Ok(read) => read,
        Err(_) => {
            drop(Object::take(client));
            Err(StoreError::timeout())
        }
    }
}
