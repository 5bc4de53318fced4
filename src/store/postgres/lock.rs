//! [`LockStore`] on PostgreSQL: claims and fenced locks, each one function call.

use std::time::Duration;

use tokio::time::Instant;
use tokio_postgres::Row;

use super::call::Param;
use super::sql::Sql;
use super::{PgStore, boolean, flag, left_ms, ms, protocol, tag};
use crate::store::{
    ClaimOutcome, Hold, LockAttempt, LockState, LockStore, RELEASE_MARKER_TTL, StoreError,
    StoreFuture, fence_ttl, kit,
};
use crate::store::{ClaimRequest, LockRequest};

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

impl LockStore for PgStore {
    fn timeout(&self) -> Duration {
        self.inner.settings.timeout
    }

    fn claim(&self, request: ClaimRequest, deadline: Instant) -> StoreFuture<ClaimOutcome> {
        let params: Vec<Param> = vec![
            Box::new(request.key),
            Box::new(request.holder),
            Box::new(request.ttl.map_or(0, ms)),
        ];
        self.call("claim", |s| &s.claim, params, Some(deadline), decode_claim)
    }

    fn lock_acquire(&self, request: LockRequest, deadline: Instant) -> StoreFuture<LockAttempt> {
        let Hold { key, token } = request.hold;
        let params: Vec<Param> = vec![
            Box::new(key),
            Box::new(request.fence_key),
            Box::new(token),
            Box::new(ms(request.lease)),
            Box::new(ms(fence_ttl(request.lease))),
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

    fn lock_state(&self, key: &str, fence_key: &str) -> StoreFuture<LockState> {
        let params: Vec<Param> = vec![Box::new(key.to_owned()), Box::new(fence_key.to_owned())];
        self.call(
            "lock_state",
            |s| &s.lock_state,
            params,
            None,
            decode_lock_state,
        )
    }
}

/// `(holder, lease_left_ms, fence)`: holder `NULL` when the lock is free.
fn decode_lock_state(row: &Row) -> Result<LockState, StoreError> {
    let holder: Option<String> = row.try_get(0).map_err(protocol)?;
    let left: Option<i64> = row.try_get(1).map_err(protocol)?;
    let fence: Option<i64> = row.try_get(2).map_err(protocol)?;
    let fence = fence
        .map(|fence| {
            u64::try_from(fence)
                .map_err(|_| StoreError::protocol(format!("lock_state read the fence {fence}")))
        })
        .transpose()?;
    let lease_left = match (&holder, left) {
        (Some(_), Some(ms)) => left_ms(ms),
        _ => Duration::ZERO,
    };
    Ok(LockState::new(holder, lease_left, fence))
}
