//! [`LockStore`] on Redis: claims and fenced locks, each one script.

use std::time::Duration;

use tokio::time::Instant;

use redis::Value;

use super::script_call::ScriptCall;
use super::{
    Effect, Pending, RedisStore, extend_call, left_ms, redis_call, release_call, store_error,
};
use crate::keyspace;
use crate::store::span::Command;
use crate::store::{
    ClaimOutcome, Hold, LockAttempt, LockState, LockStore, StoreError, StoreFuture, fence_ttl, kit,
    millis,
};
use crate::store::{ClaimRequest, LockRequest};

impl LockStore for RedisStore {
    fn timeout(&self) -> Duration {
        self.timeout
    }

    fn claim(&self, request: ClaimRequest, deadline: Instant) -> StoreFuture<ClaimOutcome> {
        let undo = Self::release_of(&request.key, &request.holder, |s| &s.compare_and_delete);
        let marker = keyspace::pending_marker(&request.key);
        let pending = Pending {
            marker: marker.clone(),
            holder: request.holder.clone(),
        };
        let call = ScriptCall::default()
            .key(request.key)
            .key(marker)
            .arg(request.holder)
            .arg(request.ttl.map_or(0, millis))
            .arg(self.pending_ms());
        self.write(
            "claim",
            |s| &s.claim,
            call,
            deadline,
            // 2: held by this holder already, not made by this call
            Effect {
                counts: |(tag, _): &(i64, Option<String>)| *tag == 1 || *tag == 2,
                made: |(tag, _)| *tag == 1,
            },
            |(tag, holder)| {
                Ok(ClaimOutcome {
                    won: tag == 1 || tag == 2,
                    holder: holder.unwrap_or_default(),
                    pending: tag == 3,
                })
            },
            Some(undo),
            Some(pending),
        )
    }

    fn lock_acquire(&self, request: LockRequest, deadline: Instant) -> StoreFuture<LockAttempt> {
        let Hold { key, token } = request.hold;
        let undo = Self::release_of(&key, &token, |s| &s.compare_and_delete);
        let call = ScriptCall::default()
            .key(key)
            .key(request.fence_key)
            .arg(token)
            .arg(millis(request.lease))
            .arg(millis(fence_ttl(request.lease)));
        self.write(
            "lock_acquire",
            |s| &s.lock_acquire,
            call,
            deadline,
            // 2: held by this owner already, only its lease reset
            Effect {
                counts: |(tag, _): &(i64, i64)| *tag >= 1,
                made: |(tag, _)| *tag == 1,
            },
            |(acquired, value)| Ok(kit::lock_attempt(acquired >= 1, value)),
            Some(undo),
            None,
        )
    }

    fn extend_if_held(&self, hold: Hold, lease: Duration, deadline: Instant) -> StoreFuture<bool> {
        let Hold { key, token } = hold;
        self.write(
            "lock_extend",
            |s| &s.compare_and_pexpire,
            extend_call(key, token, lease),
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

    fn delete_if_held(&self, hold: Hold) -> StoreFuture<bool> {
        let Hold { key, token } = hold;
        self.token_checked(
            "lock_release",
            |s| &s.compare_and_delete,
            release_call(&key, &token),
        )
    }

    fn lock_state(&self, key: &str, fence_key: &str) -> StoreFuture<LockState> {
        let call = ScriptCall::default().key(key).key(fence_key);
        let span = redis_call("lock_state", Command::Evalsha, self.scripts.lock_state.name);
        self.call(span, move |mut conn, scripts| async move {
            let reply: Vec<Value> = call
                .invoke(&scripts.lock_state, &mut conn)
                .await
                .map_err(store_error)?;
            decode_lock_state(reply)
        })
    }
}

/// Decodes `{holder or nil, lease_left_ms, fence or nil}`.
fn decode_lock_state(reply: Vec<Value>) -> Result<LockState, StoreError> {
    let text = |value: Value| match value {
        Value::Nil => Ok(None),
        Value::BulkString(bytes) => String::from_utf8(bytes)
            .map(Some)
            .map_err(|_| StoreError::protocol("lock_state answered a holder that is not UTF-8")),
        other => Err(StoreError::protocol(format!(
            "lock_state answered {other:?}"
        ))),
    };
    let mut reply = reply.into_iter();
    match (reply.next(), reply.next(), reply.next(), reply.next()) {
        (Some(holder), Some(Value::Int(left)), Some(fence), None) => {
            let holder = text(holder)?;
            let fence = match text(fence)? {
                Some(fence) => Some(fence.parse::<u64>().map_err(|_| {
                    StoreError::protocol(format!("lock_state answered the fence {fence:?}"))
                })?),
                None => None,
            };
            let lease_left = match holder {
                Some(_) => left_ms(left),
                None => Duration::ZERO,
            };
            Ok(LockState::new(holder, lease_left, fence))
        }
        _ => Err(StoreError::protocol(
            "lock_state answered an unexpected reply",
        )),
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;
    use crate::fuzz::{check, hostile_i64, redis_replies};
    use crate::store::StoreErrorKind;

    #[test]
    fn any_lock_state_reply_is_a_state_or_a_protocol_error() {
        check(512, redis_replies(4), |reply| {
            let (length, holder) = (reply.len(), reply.first().cloned());
            match decode_lock_state(reply) {
                Ok(state) => {
                    prop_assert_eq!(length, 3);
                    if state.holder.is_none() {
                        prop_assert_eq!(holder, Some(Value::Nil));
                        prop_assert_eq!(state.lease_left, Duration::ZERO);
                    }
                }
                Err(e) => prop_assert_eq!(e.kind(), StoreErrorKind::Protocol),
            }
            Ok(())
        });
    }

    #[test]
    fn a_lock_state_reads_as_the_script_wrote_it() {
        let case = (
            prop::option::of("[!-~]{1,40}"),
            hostile_i64(),
            prop::option::of(any::<u64>()),
        );
        check(512, case, |(holder, left, fence)| {
            let bulk = |text: String| Value::BulkString(text.into_bytes());
            let reply = vec![
                holder.clone().map_or(Value::Nil, bulk),
                Value::Int(left),
                fence.map_or(Value::Nil, |f| bulk(f.to_string())),
            ];
            let lease_left = match holder {
                Some(_) => left_ms(left),
                None => Duration::ZERO,
            };
            let expected = LockState::new(holder, lease_left, fence);
            prop_assert_eq!(decode_lock_state(reply).unwrap(), expected);
            Ok(())
        });
    }

    #[test]
    fn a_fence_that_is_no_count_is_refused() {
        let bulk = |text: &[u8]| Value::BulkString(text.to_vec());
        for fence in [&b"-1"[..], b"18446744073709551616", b"1e3", b"", b"\xff"] {
            let reply = vec![Value::Nil, Value::Int(0), bulk(fence)];
            let refused = decode_lock_state(reply).unwrap_err();
            assert_eq!(refused.kind(), StoreErrorKind::Protocol, "{fence:?}");
        }
    }
}
