//! [`PermitStore`] on Redis: the permits of a concurrency limit and their queue, each one script.

use std::time::Duration;

use tokio::time::Instant;

use super::script_call::ScriptCall;
use super::{Effect, RedisStore, Undo, extend_call, left_ms, redis_call, store_error};
use crate::keyspace;
use crate::store::span::Command;
use crate::store::{
    Hold, PermitAttempt, PermitStore, RELEASE_MARKER_TTL, StoreError, StoreFuture, fence_ttl, kit,
    millis,
};
use crate::store::{PermitRequest, PermitUsage};

/// The arguments of `permit_release.lua`: the permits, their recent release calls, the token,
/// the lifetime of a call's note and a random id of this call, so that the call re-sent answers
/// as it did.
fn permit_release_call(hold: &Hold) -> ScriptCall {
    let (queue, waiting) = keyspace::permit_queue(&hold.key);
    ScriptCall::default()
        .key(&hold.key)
        .key(keyspace::release_marker(&hold.key))
        .key(queue)
        .key(waiting)
        .arg(&hold.token)
        .arg(millis(RELEASE_MARKER_TTL))
        .arg(kit::release_call_id())
}

impl PermitStore for RedisStore {
    fn timeout(&self) -> Duration {
        self.timeout
    }

    fn permit_acquire(
        &self,
        request: PermitRequest,
        deadline: Instant,
    ) -> StoreFuture<PermitAttempt> {
        let undo = Undo {
            script: |s| &s.permit_release,
            call: permit_release_call(&request.hold),
        };
        let (queue, waiting) = keyspace::permit_queue(&request.hold.key);
        let call = ScriptCall::default()
            .key(request.hold.key)
            .key(request.fence_key)
            .key(queue)
            .key(waiting)
            .arg(request.hold.token)
            .arg(request.limit)
            .arg(millis(request.lease))
            .arg(millis(fence_ttl(request.lease)))
            .arg(request.wait.map_or(0, millis));
        self.write(
            "permit_acquire",
            |s| &s.permit_acquire,
            call,
            deadline,
            // 2: held by this holder already, only its lease reset
            Effect {
                counts: |reply: &Vec<i64>| reply.first().is_some_and(|tag| *tag >= 1),
                made: |reply| reply.first() == Some(&1),
            },
            |reply| match reply[..] {
                [tag, value] => kit::permit_attempt(tag, value, 0),
                [tag, value, ahead] => kit::permit_attempt(tag, value, ahead),
                _ => Err(StoreError::protocol(format!(
                    "permit_acquire answered {reply:?}"
                ))),
            },
            Some(undo),
            None,
        )
    }

    fn permit_extend(&self, hold: Hold, lease: Duration, deadline: Instant) -> StoreFuture<bool> {
        self.write(
            "permit_extend",
            |s| &s.permit_extend,
            extend_call(hold.key, hold.token, lease),
            deadline,
            Effect {
                counts: |held: &i64| *held == 1,
                made: |_| false,
            },
            |held| Ok(held == 1),
            None,
            None,
        )
    }

    fn permit_release(&self, hold: Hold) -> StoreFuture<bool> {
        self.token_checked(
            "permit_release",
            |s| &s.permit_release,
            permit_release_call(&hold),
        )
    }

    fn permit_usage(&self, key: &str) -> StoreFuture<PermitUsage> {
        let (_, waiting) = keyspace::permit_queue(key);
        let call = ScriptCall::default().key(key).key(waiting);
        let span = redis_call(
            "permit_usage",
            Command::Evalsha,
            self.scripts.permit_usage.name,
        );
        self.call(span, move |mut conn, scripts| async move {
            let reply: Vec<i64> = call
                .invoke(&scripts.permit_usage, &mut conn)
                .await
                .map_err(store_error)?;
            let Some((&waiting, leases)) = reply.split_first() else {
                return Err(StoreError::protocol("permit_usage answered nothing"));
            };
            let leases = leases.iter().map(|&ms| left_ms(ms)).collect();
            Ok(PermitUsage::new(
                leases,
                u32::try_from(waiting).unwrap_or(u32::MAX),
            ))
        })
    }

    fn permit_limits(&self) -> Option<&dyn crate::store::LimitsStore> {
        Some(self)
    }

    fn permit_invalidations(&self) -> Option<crate::store::Invalidations> {
        crate::store::RateStore::invalidations(self)
    }
}
