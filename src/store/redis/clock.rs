//! Deadlines on Redis's clock: `TIME` readings for the [`StoreClock`].

use std::sync::Arc;
use std::time::Duration;

use redis::FromRedisValue;
use redis::aio::ConnectionLike;
use tokio::time::Instant;

use super::connection::{Connection, Link};
use super::store_error;
use crate::store::deadline::Mapped;
use crate::store::{StoreClock, StoreError, StoreErrorKind};

/// How long a background reading of the clock may take.
const READING_TIMEOUT: Duration = Duration::from_secs(1);

/// `deadline` in microseconds of Redis's clock, no later than that clock reads at `deadline`:
/// from a recent reading, or from one taken first on `conn`. An aging reading is refreshed in the
/// background, on a connection of `link`.
pub(super) async fn store_deadline(
    clock: &Arc<StoreClock>,
    link: &Arc<Link>,
    conn: &mut Connection,
    deadline: Instant,
) -> Result<u64, StoreError> {
    if let Mapped::At { store_us, refresh } = clock.map(deadline) {
        if refresh {
            refresh_in_background(clock, link);
        }
        return Ok(store_us);
    }
    read_clock(clock, conn).await?;
    match clock.map(deadline) {
        Mapped::At { store_us, .. } => Ok(store_us),
        Mapped::Unknown => Err(StoreError::new(
            StoreErrorKind::Protocol,
            "Redis's clock could not be read",
        )),
    }
}

/// Reads Redis's clock (`TIME`) into `clock`.
async fn read_clock(clock: &StoreClock, conn: &mut Connection) -> Result<(), StoreError> {
    let reply = conn
        .req_packed_command(&redis::cmd("TIME"))
        .await
        .map_err(store_error)?;
    let (secs, micros) = <(u64, u64)>::from_redis_value(reply)
        .map_err(|e| StoreError::new(StoreErrorKind::Protocol, e))?;
    clock.observe(
        secs.saturating_mul(1_000_000).saturating_add(micros),
        Instant::now(),
    );
    Ok(())
}

fn refresh_in_background(clock: &Arc<StoreClock>, link: &Arc<Link>) {
    let Ok(runtime) = tokio::runtime::Handle::try_current() else {
        clock.refresh_failed();
        return;
    };
    let (clock, mut conn) = (Arc::clone(clock), link.get());
    runtime.spawn(async move {
        let read = tokio::time::timeout(READING_TIMEOUT, read_clock(&clock, &mut conn)).await;
        if !matches!(read, Ok(Ok(()))) {
            clock.refresh_failed();
        }
    });
}
