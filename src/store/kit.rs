//! What every networked backend shares: the timed call with its metrics, the reply tags of the
//! write operations and their decoding, the ids of release calls. A backend reads its own wire
//! format into the plain values here; what they mean is decided once.

#[cfg(feature = "redis")]
use std::future::Future;
use std::time::Duration;

use bytes::Bytes;

use super::{IdempotencyBegin, LockAttempt, PermitAttempt, StoreError};

/// Runs `op`, store operation `operation`, within `timeout`, and tells the metrics how long it
/// took and how it failed.
#[cfg(feature = "redis")]
pub(crate) async fn timed<T>(
    operation: &'static str,
    timeout: Duration,
    op: impl Future<Output = Result<T, StoreError>>,
) -> Result<T, StoreError> {
    let started = std::time::Instant::now();
    let result = match tokio::time::timeout(timeout, op).await {
        Ok(result) => result,
        Err(_) => Err(StoreError::timeout()),
    };
    observed(operation, started, &result);
    result
}

/// Tells the metrics that store operation `operation`, started at `started`, ended in `result`.
pub(crate) fn observed<T>(
    operation: &'static str,
    started: std::time::Instant,
    result: &Result<T, StoreError>,
) {
    let kind = result.as_ref().err().map(|e| e.kind().as_str());
    crate::metrics::store_call(operation, started.elapsed(), kind);
}

/// A random id of one release call, as the scripts and functions keep it (16 hex digits): the
/// call re-sent carries the same one, and its marker answers it as the release did.
pub(crate) fn release_call_id() -> String {
    format!("{:016x}", uuid::Uuid::new_v4().as_u64_pair().0)
}

/// The tags of `idempotency_begin`'s reply, the same in every backend: `0` claimed (`4`: claimed
/// again by its owner), `1` running elsewhere, with the lease left, `2` another fingerprint,
/// `3` completed, with the response.
pub(crate) fn idempotency_begin(
    tag: i64,
    lease_left_ms: Option<i64>,
    response: Option<Bytes>,
) -> Result<IdempotencyBegin, StoreError> {
    match (tag, lease_left_ms, response) {
        (0 | 4, _, _) => Ok(IdempotencyBegin::Claimed),
        (1, ms, _) => Ok(IdempotencyBegin::InFlight {
            lease_left: Duration::from_millis(ms.and_then(|v| u64::try_from(v).ok()).unwrap_or(0)),
        }),
        (2, _, _) => Ok(IdempotencyBegin::Mismatch),
        (3, _, response) => Ok(IdempotencyBegin::Completed(response.unwrap_or_default())),
        (tag, _, _) => Err(unexpected("idempotency_begin", tag)),
    }
}

/// The reply of `lock_acquire`, the same in every backend: `acquired` with fencing token
/// `value`, or held by another owner for `value` ms more.
pub(crate) fn lock_attempt(acquired: bool, value: i64) -> LockAttempt {
    let value = u64::try_from(value).unwrap_or(0);
    if acquired {
        LockAttempt::Acquired { fence: value }
    } else {
        LockAttempt::Held {
            lease_left: Duration::from_millis(value),
        }
    }
}

/// The reply of `permit_acquire`, the same in every backend: tag `1` taken (`2`: taken again by
/// its holder) with fencing token `value`; tag `0` no permit free for it, the first held one
/// free in `value` ms, `ahead` waiters before it.
pub(crate) fn permit_attempt(
    tag: i64,
    value: i64,
    ahead: i64,
) -> Result<PermitAttempt, StoreError> {
    let value = u64::try_from(value).unwrap_or(0);
    match tag {
        1 | 2 => Ok(PermitAttempt::Acquired { fence: value }),
        0 => Ok(PermitAttempt::Full {
            next_free: Duration::from_millis(value),
            ahead: u32::try_from(ahead).unwrap_or(u32::MAX),
        }),
        tag => Err(unexpected("permit_acquire", tag)),
    }
}

/// A reply of `operation` whose tag this crate does not know.
pub(crate) fn unexpected(operation: &str, tag: i64) -> StoreError {
    StoreError::protocol(format!("{operation} answered tag {tag}"))
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;
    use crate::fuzz::{bytes, check, hostile_i64};
    use crate::store::StoreErrorKind;

    #[test]
    fn any_begin_tag_is_an_answer_or_a_protocol_error() {
        let case = (
            hostile_i64(),
            prop::option::of(hostile_i64()),
            prop::option::of(bytes(8)),
        );
        check(512, case, |(tag, ms, response)| {
            let response = response.map(Bytes::from);
            match (tag, idempotency_begin(tag, ms, response.clone())) {
                (0 | 4, Ok(begin)) => prop_assert_eq!(begin, IdempotencyBegin::Claimed),
                (1, Ok(IdempotencyBegin::InFlight { lease_left })) => {
                    let ms = ms.and_then(|v| u64::try_from(v).ok()).unwrap_or(0);
                    prop_assert_eq!(lease_left, Duration::from_millis(ms));
                }
                (2, Ok(begin)) => prop_assert_eq!(begin, IdempotencyBegin::Mismatch),
                (3, Ok(begin)) => prop_assert_eq!(
                    begin,
                    IdempotencyBegin::Completed(response.unwrap_or_default())
                ),
                (_, Err(e)) => {
                    prop_assert!(!(0..=4).contains(&tag));
                    prop_assert_eq!(e.kind(), StoreErrorKind::Protocol);
                }
                (tag, begin) => prop_assert!(false, "tag {tag} read as {begin:?}"),
            }
            Ok(())
        });
    }

    #[test]
    fn any_lock_and_permit_answer_is_read_without_panicking() {
        let case = (hostile_i64(), hostile_i64(), hostile_i64());
        check(512, case, |(tag, value, ahead)| {
            let count = u64::try_from(value).unwrap_or(0);
            match lock_attempt(tag >= 1, value) {
                LockAttempt::Acquired { fence } => prop_assert_eq!(fence, count),
                LockAttempt::Held { lease_left } => {
                    prop_assert_eq!(lease_left, Duration::from_millis(count));
                }
            }
            match (tag, permit_attempt(tag, value, ahead)) {
                (1 | 2, Ok(PermitAttempt::Acquired { fence })) => prop_assert_eq!(fence, count),
                (
                    0,
                    Ok(PermitAttempt::Full {
                        next_free,
                        ahead: waiting,
                    }),
                ) => {
                    prop_assert_eq!(next_free, Duration::from_millis(count));
                    let expected = u32::try_from(ahead).unwrap_or(u32::MAX);
                    prop_assert_eq!(waiting, expected);
                }
                (_, Err(e)) => {
                    prop_assert!(!(0..=2).contains(&tag));
                    prop_assert_eq!(e.kind(), StoreErrorKind::Protocol);
                }
                (tag, attempt) => prop_assert!(false, "tag {tag} read as {attempt:?}"),
            }
            Ok(())
        });
    }
}
