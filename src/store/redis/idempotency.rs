//! [`IdempotencyStore`] on Redis: idempotency claims and records, each one script.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use redis::Value;
use tokio::time::Instant;

use super::clock::store_deadline;
use super::script_call::ScriptCall;
use super::{
    Effect, Pending, RedisStore, extend_call, left_ms, redis_call, release_call, store_error,
    unexpired,
};
use crate::keyspace;
use crate::store::span::Command;
use crate::store::{BeginRequest, CompleteRequest, IdempotencyState};
use crate::store::{
    Hold, IdempotencyBegin, IdempotencyStore, StoreError, StoreFuture, kit, millis,
};

impl IdempotencyStore for RedisStore {
    fn timeout(&self) -> Duration {
        self.timeout
    }

    fn idempotency_begin(
        &self,
        request: BeginRequest,
        deadline: Instant,
    ) -> StoreFuture<IdempotencyBegin> {
        let Hold { key, token } = request.hold;
        let undo = Self::release_of(&key, &token, |s| &s.idem_release);
        let marker = keyspace::pending_marker(&key);
        let call = ScriptCall::default()
            .key(key)
            .key(marker)
            .arg(request.fingerprint)
            .arg(token)
            .arg(millis(request.lease));
        self.write(
            "idempotency_begin",
            |s| &s.idem_begin,
            call,
            deadline,
            // {4}: claimed by this token already, only its lease reset
            Effect {
                counts: |reply: &Vec<Value>| matches!(reply.first(), Some(Value::Int(0 | 4))),
                made: |reply| reply.first() == Some(&Value::Int(0)),
            },
            decode_idem_begin,
            Some(undo),
            None,
        )
    }

    fn idempotency_complete(
        &self,
        request: CompleteRequest,
        deadline: Instant,
    ) -> StoreFuture<bool> {
        let Hold { key, token } = request.hold;
        let marker = keyspace::pending_marker(&key);
        let pending = Pending {
            marker: marker.clone(),
            holder: token.clone(),
        };
        let call = ScriptCall::default()
            .key(key)
            .key(marker)
            .arg(token)
            .arg(request.response.as_ref())
            .arg(millis(request.retention))
            .arg(self.pending_ms());
        // a completion nobody acknowledged is not undone: it stays pending (read as still
        // running) and the layer sends it again within the lease
        self.write(
            "idempotency_complete",
            |s| &s.idem_complete,
            call,
            deadline,
            Effect {
                counts: |stored: &i64| *stored == 1,
                made: |_| false,
            },
            |stored| Ok(stored == 1),
            None,
            Some(pending),
        )
    }

    fn idempotency_release(&self, hold: Hold) -> StoreFuture<bool> {
        let Hold { key, token } = hold;
        self.token_checked(
            "idempotency_release",
            |s| &s.idem_release,
            release_call(&key, &token),
        )
    }

    fn idempotency_extend(
        &self,
        hold: Hold,
        lease: Duration,
        deadline: Instant,
    ) -> StoreFuture<bool> {
        let Hold { key, token } = hold;
        // no replica need acknowledge an extension before it counts: a failover loses at most
        // the lease it added
        let clock = Arc::clone(&self.clock);
        let link = Arc::clone(&self.link);
        let deadline = deadline.min(Instant::now() + self.timeout);
        let call = redis_call(
            "idempotency_extend",
            Command::Evalsha,
            self.scripts.idem_extend.name,
        );
        self.call(call, move |mut conn, scripts| async move {
            let at = store_deadline(&clock, &link, &mut conn, deadline).await?;
            let reply: Value = extend_call(key, token, lease)
                .arg(at)
                .invoke(&scripts.idem_extend, &mut conn)
                .await
                .map_err(store_error)?;
            let extended: i64 = unexpired(reply)?;
            Ok(extended == 1)
        })
    }

    fn idempotency_state(&self, key: &str) -> StoreFuture<IdempotencyState> {
        let call = ScriptCall::default()
            .key(key)
            .key(keyspace::pending_marker(key));
        let span = redis_call(
            "idempotency_state",
            Command::Evalsha,
            self.scripts.idem_state.name,
        );
        self.call(span, move |mut conn, scripts| async move {
            let reply: Vec<Value> = call
                .invoke(&scripts.idem_state, &mut conn)
                .await
                .map_err(store_error)?;
            decode_idem_state(reply)
        })
    }
}

/// Decodes `{0}`, `{1, lease_left_ms, age_ms}` or `{2, retention_left_ms, response, age_ms}`
/// (`age_ms` -1: not kept).
fn decode_idem_state(reply: Vec<Value>) -> Result<IdempotencyState, StoreError> {
    let age = |ms: i64| (ms >= 0).then(|| left_ms(ms));
    let reply: Vec<Value> = reply.into_iter().take(5).collect();
    match &reply[..] {
        [Value::Int(0)] => Ok(IdempotencyState::Absent),
        [Value::Int(1), Value::Int(ms), Value::Int(old)] => Ok(IdempotencyState::InFlight {
            lease_left: left_ms(*ms),
            age: age(*old),
        }),
        [
            Value::Int(2),
            Value::Int(ms),
            Value::BulkString(response),
            Value::Int(old),
        ] => Ok(IdempotencyState::Completed {
            response: Bytes::copy_from_slice(response),
            retention_left: left_ms(*ms),
            age: age(*old),
        }),
        _ => Err(StoreError::protocol(
            "idempotency_state answered an unexpected reply",
        )),
    }
}

/// Decodes `{0}`, `{1, lease_left_ms}`, `{2}` or `{3, response}`.
fn decode_idem_begin(reply: Vec<Value>) -> Result<IdempotencyBegin, StoreError> {
    let mut reply = reply.into_iter();
    let Some(Value::Int(tag)) = reply.next() else {
        return Err(StoreError::protocol("idempotency script returned no tag"));
    };
    match (tag, reply.next()) {
        (0 | 2 | 4, None) => kit::idempotency_begin(tag, None, None),
        (1, Some(Value::Int(ms))) => kit::idempotency_begin(tag, Some(ms), None),
        (3, Some(Value::BulkString(response))) => {
            kit::idempotency_begin(tag, None, Some(Bytes::from(response)))
        }
        _ => Err(StoreError::protocol(
            "idempotency script returned an unexpected reply",
        )),
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;
    use crate::fuzz::{bytes, check, hostile_i64, redis_replies};
    use crate::store::StoreErrorKind;

    #[test]
    fn any_reply_is_a_state_or_a_protocol_error() {
        check(512, redis_replies(5), |reply| {
            let shape_ok = matches!(
                reply.first(),
                Some(Value::Int(0..=2)) if (1..=4).contains(&reply.len())
            );
            match decode_idem_state(reply) {
                Ok(_) => prop_assert!(shape_ok),
                Err(e) => prop_assert_eq!(e.kind(), StoreErrorKind::Protocol),
            }
            Ok(())
        });
    }

    #[test]
    fn a_state_reply_reads_as_the_script_wrote_it() {
        let case = (0i64..3, hostile_i64(), hostile_i64(), bytes(32));
        check(512, case, |(tag, ms, old, response)| {
            let age = |ms: i64| (ms >= 0).then(|| left_ms(ms));
            let (reply, expected) = match tag {
                0 => (vec![Value::Int(0)], IdempotencyState::Absent),
                1 => (
                    vec![Value::Int(1), Value::Int(ms), Value::Int(old)],
                    IdempotencyState::InFlight {
                        lease_left: left_ms(ms),
                        age: age(old),
                    },
                ),
                _ => (
                    vec![
                        Value::Int(2),
                        Value::Int(ms),
                        Value::BulkString(response.clone()),
                        Value::Int(old),
                    ],
                    IdempotencyState::Completed {
                        response: Bytes::from(response),
                        retention_left: left_ms(ms),
                        age: age(old),
                    },
                ),
            };
            prop_assert_eq!(decode_idem_state(reply).unwrap(), expected);
            Ok(())
        });
    }

    #[test]
    fn any_begin_reply_is_an_answer_or_a_protocol_error() {
        check(512, redis_replies(3), |reply| {
            let tag = match reply.first() {
                Some(Value::Int(tag)) => Some(*tag),
                _ => None,
            };
            match decode_idem_begin(reply) {
                Ok(_) => prop_assert!(matches!(tag, Some(0..=4))),
                Err(e) => prop_assert_eq!(e.kind(), StoreErrorKind::Protocol),
            }
            Ok(())
        });
    }

    #[test]
    fn a_begin_reply_reads_as_the_script_wrote_it() {
        check(
            512,
            (0i64..5, hostile_i64(), bytes(32)),
            |(tag, ms, response)| {
                let (reply, expected) = match tag {
                    1 => (
                        vec![Value::Int(1), Value::Int(ms)],
                        IdempotencyBegin::InFlight {
                            lease_left: Duration::from_millis(u64::try_from(ms).unwrap_or(0)),
                        },
                    ),
                    2 => (vec![Value::Int(2)], IdempotencyBegin::Mismatch),
                    3 => (
                        vec![Value::Int(3), Value::BulkString(response.clone())],
                        IdempotencyBegin::Completed(Bytes::from(response)),
                    ),
                    tag => (vec![Value::Int(tag)], IdempotencyBegin::Claimed),
                };
                prop_assert_eq!(decode_idem_begin(reply).unwrap(), expected);
                Ok(())
            },
        );
    }
}
