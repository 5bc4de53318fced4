//! [`IdempotencyStore`] on PostgreSQL: idempotency claims and records, each one function call.

use std::time::Duration;

use bytes::Bytes;
use tokio::time::Instant;
use tokio_postgres::Row;

use super::call::Param;
use super::sql::Sql;
use super::{PgStore, boolean, flag, left_ms, ms, protocol, tag};
use crate::store::{BeginRequest, CompleteRequest, IdempotencyState};
use crate::store::{
    Hold, IdempotencyBegin, IdempotencyStore, RELEASE_MARKER_TTL, StoreError, StoreFuture, kit,
};

impl IdempotencyStore for PgStore {
    fn timeout(&self) -> Duration {
        self.inner.settings.timeout
    }

    fn idempotency_begin(
        &self,
        request: BeginRequest,
        deadline: Instant,
    ) -> StoreFuture<IdempotencyBegin> {
        let Hold { key, token } = request.hold;
        let params: Vec<Param> = vec![
            Box::new(key),
            Box::new(request.fingerprint),
            Box::new(token),
            Box::new(ms(request.lease)),
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
        request: CompleteRequest,
        deadline: Instant,
    ) -> StoreFuture<bool> {
        let Hold { key, token } = request.hold;
        let params: Vec<Param> = vec![
            Box::new(key),
            Box::new(token),
            Box::new(request.response.to_vec()),
            Box::new(ms(request.retention)),
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

    fn idempotency_state(&self, key: &str) -> StoreFuture<IdempotencyState> {
        let params: Vec<Param> = vec![Box::new(key.to_owned())];
        let sql: fn(&Sql) -> &String = |s| &s.idem_state;
        self.call("idempotency_state", sql, params, None, decode_idem_state)
    }
}

/// `(done, response, left_ms, age_ms)`: `done` `NULL` when there is no record, `age_ms` when
/// it was made before its creation was kept.
fn decode_idem_state(row: &Row) -> Result<IdempotencyState, StoreError> {
    let done: Option<bool> = row.try_get(0).map_err(protocol)?;
    let response: Option<Vec<u8>> = row.try_get(1).map_err(protocol)?;
    let left: Option<i64> = row.try_get(2).map_err(protocol)?;
    let left = left_ms(left.unwrap_or(0));
    let age: Option<i64> = row.try_get(3).map_err(protocol)?;
    let age = age.map(left_ms);
    Ok(match (done, response) {
        (None, _) => IdempotencyState::Absent,
        (Some(true), Some(response)) => IdempotencyState::Completed {
            response: Bytes::from(response),
            retention_left: left,
            age,
        },
        (Some(true), None) => {
            return Err(StoreError::protocol(
                "idempotency_state read a completed record without a response",
            ));
        }
        (Some(false), _) => IdempotencyState::InFlight {
            lease_left: left,
            age,
        },
    })
}

/// `(tag, lease_left_ms, response)`: 0 claimed, 1 running elsewhere, 2 another fingerprint,
/// 3 completed.
fn decode_idem_begin(row: &Row) -> Result<IdempotencyBegin, StoreError> {
    let tag = tag(row)?;
    let lease_left_ms: Option<i64> = row.try_get(1).map_err(protocol)?;
    let response: Option<Vec<u8>> = row.try_get(2).map_err(protocol)?;
    kit::idempotency_begin(tag.into(), lease_left_ms, response.map(Bytes::from))
}
