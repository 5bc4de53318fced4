//! [`RateStore`] on PostgreSQL: checks coalesced into calls of `decide_rates`, resets and
//! invalidations.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use super::call::{self, Param};
use super::{PgStore, Shared, invalidation};
use crate::key::Key;
use crate::rate::{Algorithm, LimitState, RateCheck, RateOutcome, RatePolicy};
use crate::store::coalesce::{BatchCall, Decided, Sent};
use crate::store::{
    Invalidations, LimitsStore, RateStore, StoreError, StoreErrorKind, StoreFuture, millis,
};

/// An id as the database keeps it: the same 64 bits, as a `bigint`.
fn signed(id: u64) -> i64 {
    i64::from_ne_bytes(id.to_ne_bytes())
}

impl RateStore for PgStore {
    fn check_rate(&self, policy: &Arc<RatePolicy>, check: RateCheck) -> StoreFuture<RateOutcome> {
        let check = check.bounded(policy);
        let pending = self.inner.rates.check(policy, check);
        // what a refund's notice needs is made only when one is sent
        let (inner, policy) = (Arc::clone(&self.inner), Arc::clone(policy));
        crate::store::publishing_refunds(pending, check, move || async move {
            let shared = &inner.shared;
            let channel = invalidation::channel(&inner.settings.schema);
            let payload = invalidation::payload(policy.namespace(), check.key());
            let params: Vec<Param> = vec![Box::new(channel), Box::new(payload)];
            let notified = shared
                .calls
                .row("invalidate", 1, &shared.sql.notify, &params, None)
                .await;
            if let Err(error) = notified {
                tracing::debug!(
                    target: "tollgate::store", %error,
                    "could not notify a refund; cached denials of the caller end within a second"
                );
            }
        })
    }

    fn timeout(&self) -> Duration {
        self.inner.settings.timeout
    }

    /// Deletes the caller's rows and notifies the reset (see
    /// [Invalidations](crate::store#invalidations)) in one transaction.
    ///
    /// The reset carries a deadline, as every write does (see
    /// [Deadlines](crate::store#deadlines)): one that reaches the database after it deletes
    /// nothing and fails with [`Timeout`](crate::store::StoreErrorKind::Timeout). So a reset
    /// that timed out either ran by then or never will: it cannot land later and erase what the
    /// caller was charged since.
    fn reset_rate(&self, policy: &Arc<RatePolicy>, key: Key) -> StoreFuture<()> {
        let params: Vec<Param> = vec![
            Box::new(policy.reset_keys(&key)),
            Box::new(invalidation::channel(&self.inner.settings.schema)),
            Box::new(invalidation::payload(policy.namespace(), key)),
        ];
        let deadline = Instant::now() + self.inner.settings.timeout;
        self.call(
            "reset_rate",
            |s| &s.reset_rate,
            params,
            Some(deadline),
            decode_reset,
        )
    }

    /// `line_up()` on the line's rows of `permit_queue`, with the call's deadline (see
    /// [Lines](crate::store#lines)).
    fn line_up(
        &self,
        policy: &Arc<RatePolicy>,
        key: Key,
        waiter: u64,
        keep: Duration,
        deadline: Instant,
    ) -> StoreFuture<u32> {
        let keep_ms = i64::try_from(millis(keep)).unwrap_or(i64::MAX);
        let params: Vec<Param> = vec![
            Box::new(policy.line_key(&key)),
            Box::new(format!("{waiter:016x}")),
            Box::new(keep_ms),
        ];
        self.call(
            "line_up",
            |s| &s.line_up,
            params,
            Some(deadline),
            decode_line_up,
        )
    }

    fn leave_line(&self, policy: &Arc<RatePolicy>, key: Key, waiter: u64) -> StoreFuture<()> {
        let params: Vec<Param> = vec![
            Box::new(policy.line_key(&key)),
            Box::new(format!("{waiter:016x}")),
        ];
        self.call("leave_line", |s| &s.leave_line, params, None, |_| Ok(()))
    }

    /// One connection per store outside the pool, made on the first call; `None` for a store
    /// on a pool the application made ([`PgStore::from_pool`], [`PgStore::pool_builder`]),
    /// which cannot open a connection of its own.
    fn invalidations(&self) -> Option<Invalidations> {
        self.inner.listening.subscribe()
    }

    fn limits_store(&self) -> Option<&dyn LimitsStore> {
        Some(self)
    }
}

/// One call of `decide_rates`: a batch of checks in one transaction.
pub(super) struct RateCall {
    pub(super) shared: Arc<Shared>,
    /// How long after its deadline a charged attempt is remembered, in µs: twice the timeout.
    pub(super) retention_us: i64,
}

/// Twice `timeout` in microseconds (at most 2^53, so that a deadline plus it stays far from
/// overflowing).
pub(super) fn retention_us(timeout: Duration) -> i64 {
    let twice = timeout.as_micros().saturating_mul(2).min(1 << 53);
    i64::try_from(twice).unwrap_or(1 << 53)
}

impl BatchCall for RateCall {
    fn decide(
        &self,
        checks: &[Sent<'_>],
        deadline: Instant,
    ) -> impl Future<Output = Decided> + Send {
        self.call(checks, deadline)
    }
}

impl RateCall {
    /// `checks` in one call. When the call fails with an error of the database (a step that
    /// raised: the transaction rolled back, nothing of the batch was committed), each check is
    /// decided again in a call of its own, within the same deadline: only a check whose own
    /// step fails fails, with its cause.
    async fn call(&self, checks: &[Sent<'_>], deadline: Instant) -> Decided {
        let decided = self.one_call(checks, deadline).await;
        match decided {
            Err(e) if checks.len() > 1 && call::failed_in_the_database(&e) => {
                let alone = checks.iter().map(|check| async move {
                    let mut decided = self.one_call(std::slice::from_ref(check), deadline).await?;
                    decided.pop().unwrap_or_else(|| Err(missing_outcome()))
                });
                Ok(futures_util::future::join_all(alone).await)
            }
            decided => decided,
        }
    }

    async fn one_call(&self, checks: &[Sent<'_>], deadline: Instant) -> Decided {
        let params = rate_params(checks, self.retention_us);
        let limits: Vec<usize> = checks.iter().map(|(p, _, _)| p.limits().len()).collect();
        let row = self
            .shared
            .calls
            .row(
                "rate_check",
                checks.len(),
                &self.shared.sql.decide_rates,
                &params,
                Some(deadline),
            )
            .await?;
        let reply: Vec<i64> = row
            .try_get(0)
            .map_err(|e| StoreError::new(StoreErrorKind::Protocol, e))?;
        decode_rates(&reply, &limits)
    }
}

/// The reply of `reset_rate`: the rows it deleted, or -1 when it was received after its deadline
/// and deleted nothing.
fn decode_reset(row: &tokio_postgres::Row) -> Result<(), StoreError> {
    let deleted: i64 = row
        .try_get(0)
        .map_err(|e| StoreError::new(StoreErrorKind::Protocol, e))?;
    if deleted < 0 {
        return Err(StoreError::expired());
    }
    Ok(())
}

/// The reply of `line_up`: how many stand ahead, or -1 when it was received after its deadline
/// and changed nothing.
fn decode_line_up(row: &tokio_postgres::Row) -> Result<u32, StoreError> {
    let ahead: i64 = row
        .try_get(0)
        .map_err(|e| StoreError::new(StoreErrorKind::Protocol, e))?;
    if ahead < 0 {
        return Err(StoreError::expired());
    }
    Ok(u32::try_from(ahead).unwrap_or(u32::MAX))
}

/// A reply that left a check out.
fn missing_outcome() -> StoreError {
    StoreError::new(
        StoreErrorKind::Protocol,
        "decide_rates returned no outcome for a check",
    )
}

/// The parameters of `decide_rates` for `checks` (its deadline aside): per check its algorithm,
/// number of limits, cost, attempt and whether it is a reservation, and every check's keys,
/// quotas (negated of a limit that counts calls), windows and penalties (µs, 0: none) in turn; then per check what it settles, if it is a settlement, and its
/// hold (µs; see [`RateCheck::held`]); then how long a charged attempt is remembered after its
/// deadline, `retention_us`.
fn rate_params(checks: &[Sent<'_>], retention_us: i64) -> Vec<Param> {
    let mut algorithms: Vec<i16> = Vec::with_capacity(checks.len());
    let mut counts: Vec<i32> = Vec::with_capacity(checks.len());
    let (mut keys, mut quotas, mut windows) = (Vec::new(), Vec::new(), Vec::new());
    let mut blocks: Vec<i64> = Vec::new();
    let mut costs: Vec<i64> = Vec::with_capacity(checks.len());
    let mut attempts: Vec<i64> = Vec::with_capacity(checks.len());
    let mut reservations: Vec<bool> = Vec::with_capacity(checks.len());
    // of a settlement, what its check reserved, the check's attempt and whether it was a
    // reservation; -1, 0 and false otherwise
    let mut reserved: Vec<i64> = Vec::with_capacity(checks.len());
    let mut settled: Vec<i64> = Vec::with_capacity(checks.len());
    let mut refundable: Vec<bool> = Vec::with_capacity(checks.len());
    let mut holds: Vec<i64> = Vec::with_capacity(checks.len());
    for (policy, check, _) in checks {
        algorithms.push(match policy.algorithm() {
            Algorithm::SlidingLog => 1,
            Algorithm::SlidingCounter => 2,
            Algorithm::Gcra => 3,
        });
        let limits = policy.limits();
        counts.push(i32::try_from(limits.len()).unwrap_or(i32::MAX));
        keys.extend(policy.store_keys(&check.key()));
        for limit in limits {
            // a limit that counts calls goes with its quota negated (version 11)
            let quota = i64::try_from(limit.quota()).unwrap_or(i64::MAX);
            quotas.push(if limit.counts_calls() { -quota } else { quota });
            windows.push(i64::try_from(limit.window_us()).unwrap_or(i64::MAX));
            blocks.push(i64::try_from(limit.block_us()).unwrap_or(i64::MAX));
        }
        // bounded by the client already (RateCheck::bounded); this cannot overflow a sum
        costs.push(i64::try_from(check.cost().min(1 << 62)).unwrap_or(1 << 62));
        attempts.push(signed(check.attempt()));
        reservations.push(check.is_reservation());
        let settles = check.settles();
        reserved.push(settles.map_or(-1, |s| i64::try_from(s.reserved.min(1 << 62)).unwrap_or(0)));
        settled.push(settles.map_or(0, |s| signed(s.of)));
        refundable.push(settles.is_some_and(|s| s.refundable));
        // at most 2^40 already (RateCheck::held); bounded again so that no sum overflows
        holds.push(i64::try_from(check.hold_us().min(1 << 40)).unwrap_or(1 << 40));
    }
    vec![
        Box::new(algorithms),
        Box::new(counts),
        Box::new(keys),
        Box::new(quotas),
        Box::new(windows),
        Box::new(blocks),
        Box::new(costs),
        Box::new(attempts),
        Box::new(reservations),
        Box::new(reserved),
        Box::new(settled),
        Box::new(refundable),
        Box::new(holds),
        Box::new(retention_us),
    ]
}

/// Each check's outcome from the reply of `decide_rates`: per check decided, its number, its
/// reply's length and the reply; `limits` holds each check's number of limits, as sent.
fn decode_rates(reply: &[i64], limits: &[usize]) -> Decided {
    let garbled = || {
        StoreError::new(
            StoreErrorKind::Protocol,
            "decide_rates returned a reply of the wrong shape",
        )
    };
    let mut decided: Vec<Option<Result<RateOutcome, StoreError>>> = Vec::new();
    decided.resize_with(limits.len(), || None);
    let mut rest = reply;
    while let [number, len, tail @ ..] = rest {
        let check = number
            .checked_sub(1)
            .and_then(|n| usize::try_from(n).ok())
            .ok_or_else(garbled)?;
        let len = usize::try_from(*len).map_err(|_| garbled())?;
        let (Some(n), Some(one)) = (limits.get(check), tail.get(..len)) else {
            return Err(garbled());
        };
        let slot = decided.get_mut(check).ok_or_else(garbled)?;
        *slot = Some(decode_rate(one, *n));
        rest = &tail[len..];
    }
    if !rest.is_empty() {
        return Err(garbled());
    }
    decided
        .into_iter()
        .map(|outcome| outcome.ok_or_else(garbled))
        .collect()
}

/// `{admitted, retry_after_us, decided_at_us, then per limit remaining, reset_us}` for `n`
/// limits, or `{-2, 0}`: received after its deadline, charged nothing.
fn decode_rate(reply: &[i64], n: usize) -> Result<RateOutcome, StoreError> {
    if reply == [-2, 0] {
        return Err(StoreError::expired());
    }
    if reply.len() != 3 + 2 * n {
        return Err(StoreError::new(
            StoreErrorKind::Protocol,
            format!("check_rate returned {} numbers for {n} limits", reply.len()),
        ));
    }
    let micros = |v: i64| Duration::from_micros(u64::try_from(v).unwrap_or(0));
    let limits = reply[3..]
        .chunks_exact(2)
        .map(|pair| LimitState {
            remaining: u64::try_from(pair[0]).unwrap_or(0),
            reset: micros(pair[1]),
        })
        .collect();
    Ok(RateOutcome {
        decided_at_us: u64::try_from(reply[2]).ok(),
        admitted: reply[0] == 1,
        retry_after: micros(reply[1]),
        limits,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rate_replies_decode_in_limit_order() {
        let outcome = decode_rate(&[0, 1_500, 1_700_000, 3, 2_000_000, 0, 700], 2).unwrap();
        assert!(!outcome.admitted);
        assert_eq!(outcome.decided_at_us, Some(1_700_000));
        assert_eq!(outcome.retry_after, Duration::from_micros(1_500));
        assert_eq!(
            outcome.limits,
            vec![
                LimitState {
                    remaining: 3,
                    reset: Duration::from_secs(2)
                },
                LimitState {
                    remaining: 0,
                    reset: Duration::from_micros(700)
                },
            ]
        );
        // a negative number (a clock step back) reads as zero; a short reply is an error
        let outcome = decode_rate(&[1, -5, 9, 1, -1], 1).unwrap();
        assert_eq!(outcome.retry_after, Duration::ZERO);
        assert_eq!(outcome.limits[0].reset, Duration::ZERO);
        let short = decode_rate(&[1, 0, 9, 1], 1).unwrap_err();
        assert_eq!(short.kind(), StoreErrorKind::Protocol);
        // received after its deadline: charged nothing, a timeout
        let late = decode_rate(&[-2, 0], 1).unwrap_err();
        assert_eq!(late.kind(), StoreErrorKind::Timeout);
    }

    #[test]
    fn ids_keep_their_bits() {
        assert_eq!(signed(u64::MAX), -1);
        assert_eq!(signed(7), 7);
    }

    #[test]
    fn a_rate_reply_numbering_its_check_i64_min_is_refused() {
        let garbled = decode_rates(&[i64::MIN, 0], &[1]).unwrap_err();
        assert_eq!(garbled.kind(), StoreErrorKind::Protocol);
    }

    mod properties {
        use proptest::prelude::*;

        use super::*;
        use crate::fuzz::{check, hostile_i64};

        /// A check's outcome as the function writes it: admitted, retry after (µs), decided at
        /// (µs), then per limit the remaining quota and the reset (µs).
        type Written = (bool, u32, u32, Vec<(u32, u32)>);

        /// A reply as `decide_rates` writes it for `outcomes` (check number, length, numbers),
        /// in the order `order` gives.
        fn reply_of(outcomes: &[Written], order: &[usize]) -> Vec<i64> {
            let mut reply = Vec::new();
            for &i in order {
                let (admitted, retry, at, limits) = &outcomes[i];
                reply.extend([i as i64 + 1, 3 + 2 * limits.len() as i64]);
                reply.extend([i64::from(*admitted), i64::from(*retry), i64::from(*at)]);
                for (remaining, reset) in limits {
                    reply.extend([i64::from(*remaining), i64::from(*reset)]);
                }
            }
            reply
        }

        fn outcomes() -> impl Strategy<Value = Vec<Written>> {
            let limits = prop::collection::vec(any::<(u32, u32)>(), 0..4);
            prop::collection::vec((any::<bool>(), any::<u32>(), any::<u32>(), limits), 1..5)
        }

        #[test]
        fn any_numbers_decode_or_are_refused_without_panicking() {
            let reply = prop::collection::vec(hostile_i64(), 0..16);
            let limits = prop::collection::vec(0usize..4, 0..4);
            check(512, (reply, limits), |(reply, limits)| {
                if let Ok(decided) = decode_rates(&reply, &limits) {
                    prop_assert_eq!(decided.len(), limits.len());
                }
                for n in limits {
                    if let Ok(outcome) = decode_rate(&reply, n) {
                        prop_assert_eq!(outcome.limits.len(), n);
                    }
                }
                Ok(())
            });
        }

        #[test]
        fn a_written_reply_decodes_to_its_outcomes_in_any_order() {
            let case = outcomes().prop_flat_map(|outcomes| {
                let order = Just((0..outcomes.len()).collect::<Vec<_>>()).prop_shuffle();
                (Just(outcomes), order)
            });
            check(512, case, |(outcomes, order)| {
                let limits: Vec<usize> = outcomes.iter().map(|o| o.3.len()).collect();
                let decided = decode_rates(&reply_of(&outcomes, &order), &limits).unwrap();
                for (outcome, (admitted, retry, at, states)) in decided.iter().zip(&outcomes) {
                    let outcome = outcome.as_ref().unwrap();
                    prop_assert_eq!(outcome.admitted, *admitted);
                    prop_assert_eq!(
                        outcome.retry_after,
                        Duration::from_micros(u64::from(*retry))
                    );
                    prop_assert_eq!(outcome.decided_at_us, Some(u64::from(*at)));
                    let expected: Vec<LimitState> = states
                        .iter()
                        .map(|&(remaining, reset)| LimitState {
                            remaining: u64::from(remaining),
                            reset: Duration::from_micros(u64::from(reset)),
                        })
                        .collect();
                    prop_assert_eq!(&outcome.limits, &expected);
                }
                Ok(())
            });
        }

        #[test]
        fn a_written_reply_spoilt_is_refused_or_still_complete() {
            let case = (outcomes(), any::<usize>(), hostile_i64(), any::<bool>());
            check(512, case, |(outcomes, at, number, cut)| {
                let limits: Vec<usize> = outcomes.iter().map(|o| o.3.len()).collect();
                let order: Vec<usize> = (0..outcomes.len()).collect();
                let mut reply = reply_of(&outcomes, &order);
                let at = at % reply.len();
                if cut {
                    reply.truncate(at);
                } else {
                    reply[at] = number;
                }
                match decode_rates(&reply, &limits) {
                    Ok(decided) => prop_assert_eq!(decided.len(), limits.len()),
                    Err(e) => prop_assert_eq!(e.kind(), StoreErrorKind::Protocol),
                }
                if cut {
                    prop_assert!(decode_rates(&reply, &limits).is_err());
                }
                Ok(())
            });
        }
    }
}
