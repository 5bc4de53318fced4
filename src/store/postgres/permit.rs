//! [`PermitStore`] on PostgreSQL: the permits of a concurrency limit and their queue, each one
//! function call.

use std::time::Duration;

use tokio::time::Instant;
use tokio_postgres::Row;

use super::call::Param;
use super::sql::Sql;
use super::{PgStore, boolean, flag, left_ms, ms, protocol, tag};
use crate::store::{
    Hold, PermitAttempt, PermitStore, RELEASE_MARKER_TTL, StoreError, StoreFuture, fence_ttl, kit,
};
use crate::store::{PermitRequest, PermitUsage};

/// `(tag, value, ahead)`: see [`kit::permit_attempt`].
fn decode_permit(row: &Row) -> Result<PermitAttempt, StoreError> {
    let ahead: Option<i64> = row.try_get(2).map_err(protocol)?;
    kit::permit_attempt(
        tag(row)?.into(),
        row.try_get(1).map_err(protocol)?,
        ahead.unwrap_or(0),
    )
}

impl PermitStore for PgStore {
    fn timeout(&self) -> Duration {
        self.inner.settings.timeout
    }

    fn permit_acquire(
        &self,
        request: PermitRequest,
        deadline: Instant,
    ) -> StoreFuture<PermitAttempt> {
        let params: Vec<Param> = vec![
            Box::new(request.hold.key),
            Box::new(request.fence_key),
            Box::new(request.hold.token),
            Box::new(i64::from(request.limit)),
            Box::new(ms(request.lease)),
            Box::new(ms(fence_ttl(request.lease))),
            Box::new(request.wait.map_or(0, ms)),
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

    fn permit_usage(&self, key: &str) -> StoreFuture<PermitUsage> {
        let params: Vec<Param> = vec![Box::new(key.to_owned())];
        self.call(
            "permit_usage",
            |s| &s.permit_usage,
            params,
            None,
            decode_permit_usage,
        )
    }

    fn permit_limits(&self) -> Option<&dyn crate::store::LimitsStore> {
        Some(self)
    }

    fn permit_invalidations(&self) -> Option<crate::store::Invalidations> {
        crate::store::RateStore::invalidations(self)
    }
}

/// `(leases_left_ms[], waiting)`.
fn decode_permit_usage(row: &Row) -> Result<PermitUsage, StoreError> {
    let leases: Vec<i64> = row.try_get(0).map_err(protocol)?;
    let waiting: i64 = row.try_get(1).map_err(protocol)?;
    Ok(PermitUsage::new(
        leases.into_iter().map(left_ms).collect(),
        u32::try_from(waiting).unwrap_or(u32::MAX),
    ))
}
