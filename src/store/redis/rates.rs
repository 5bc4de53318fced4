//! Rate checks on Redis: one call of `rate.lua` decides a batch of checks, coalesced by the
//! store's [`Coalescer`] (see `store/coalesce.rs` for when checks go out together). On Redis
//! Cluster a call holds the checks of one caller key, hence of one hash slot.
//!
//! Every call leaves a record of the checks it charged (see `rate.lua`), kept for twice the store
//! timeout past its deadline: a call re-sent reads its own, and a check sent again in a later call
//! names the records of every call it went out in before while they live ([`SentChecks`]), so
//! that neither is charged twice — a send received after its deadline left no record, and never
//! hides one before it that charged. The record is one key per call, in the slot of its first
//! check; on Cluster a call holds one caller's checks, so every record a call names is in that
//! caller's slot.
//!
//! A reservation under a sliding counter or GCRA also names its place, a key in its caller's slot
//! where the script keeps where its charge went; its settlement names the same key, reads and
//! drops it (see `rate.lua`). Every call answers the store time it decided at.

use std::fmt::Write as _;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use redis::{Cmd, Value};
use tokio::time::Instant;
use tracing::Instrument;

use super::clock::store_deadline;
use super::connection::{Connection, Link};
use super::library::Library;
use super::sent::{Place, SentChecks};
use super::{Lua, redis_call, status_code, store_error};
use crate::keyspace;
use crate::rate::{Algorithm, Limit, LimitState, RateCheck, RateOutcome, RatePolicy};
use crate::store::coalesce::{BatchCall, Coalescer, Decided, Sent};
use crate::store::kit;
use crate::store::span::{self, Call};
use crate::store::{StoreClock, StoreError, StoreErrorKind};

/// The rate checks of one store, coalesced into calls of `rate.lua`.
pub(super) type Rates = Coalescer<RateCall>;

/// The rate checks of the store on `link`, each within `timeout`, at most `max_batch` to a call.
pub(super) fn rates(
    link: Arc<Link>,
    clock: Arc<StoreClock>,
    timeout: Duration,
    max_batch: usize,
) -> Rates {
    let call = RateCall {
        per_key: matches!(link.get(), Connection::Cluster(_)),
        link,
        clock,
        script: Library::new(super::lua!("rate")),
        timeout,
        // a place is kept as long as its call's record lives: the call's deadline (a timeout
        // after it went out) plus the retention
        sent: SentChecks::new(timeout + retention(timeout)),
    };
    Coalescer::new(call, timeout, max_batch)
}

/// One call of `rate.lua`: the store's connection, its clock and the script.
pub(super) struct RateCall {
    link: Arc<Link>,
    clock: Arc<StoreClock>,
    script: Library,
    timeout: Duration,
    /// On Cluster, a call holds one caller key's checks.
    per_key: bool,
    /// Where recent checks went out, for a check sent again.
    sent: SentChecks,
}

impl BatchCall for RateCall {
    fn decide(
        &self,
        checks: &[Sent<'_>],
        deadline: Instant,
    ) -> impl Future<Output = Decided> + Send {
        self.call(checks, deadline)
    }

    fn per_key(&self) -> bool {
        self.per_key
    }
}

impl RateCall {
    /// One call of the script for `checks`, bounded by the store timeout, `deadline` sent on
    /// Redis's clock; the link's watch learns whether a reply came.
    async fn call(&self, checks: &[Sent<'_>], deadline: Instant) -> Decided {
        let mut conn = self.link.get();
        let call = redis_call("rate_check", self.script.command(), self.script.file());
        let reply = bounded(&call, checks.len(), &self.link, self.timeout, async {
            let deadline = store_deadline(&self.clock, &self.link, &mut conn, deadline).await?;
            let records = self.records(checks);
            let sent_by =
                |verb: &str, called: &str| command(verb, called, checks, deadline, &records);
            self.script
                .run(&mut conn, sent_by)
                .await
                .map_err(store_error)
        })
        .await?;
        decode(reply, checks)
    }
}

impl RateCall {
    /// The records a call of `checks` names: a new one of its own, and every one each check went
    /// out in lately (a late send left none, but one before it may hold a charge); each check is
    /// kept as going out in this call.
    fn records(&self, checks: &[Sent<'_>]) -> Records {
        let mut own = String::new();
        if let Some((policy, check, _)) = checks.first() {
            let call = uuid::Uuid::new_v4().as_u64_pair().0;
            keyspace::write_rate_record(&mut own, policy.namespace(), &check.key(), call);
        }
        let own: Arc<str> = Arc::from(own);
        let mut records = Records {
            keys: vec![Arc::clone(&own)],
            before: Vec::with_capacity(checks.len()),
            retain_ms: u64::try_from(retention(self.timeout).as_millis()).unwrap_or(u64::MAX),
        };
        let now = Instant::now();
        for (i, (_, check, _)) in checks.iter().enumerate() {
            let here = Place {
                record: Arc::clone(&own),
                check: i + 1,
            };
            let before = self.sent.went(check.attempt(), here, now);
            let before = before
                .into_iter()
                .map(|place| (records.number(place.record), place.check))
                .collect();
            records.before.push(before);
        }
        records
    }
}

/// How long a call's record outlives its deadline, and a check's place is kept: twice the store
/// timeout, so that a caller that retries a check as soon as its call timed out names it in time.
fn retention(timeout: Duration) -> Duration {
    timeout * 2
}

/// The records a call names (see `rate.lua`): its own first, then those of the calls its checks
/// went out in before; per check, every place it went out at before: the number of that call's
/// record and the check's place in that call.
struct Records {
    keys: Vec<Arc<str>>,
    before: Vec<Vec<(usize, usize)>>,
    retain_ms: u64,
}

impl Records {
    /// The number (from 1) of `record` among the call's, named once however many checks went
    /// out in it.
    fn number(&mut self, record: Arc<str>) -> usize {
        match self.keys.iter().position(|k| *k == record) {
            Some(at) => at + 1,
            None => {
                self.keys.push(record);
                self.keys.len()
            }
        }
    }
}

/// Runs `op`, the round trip `call` describes carrying `batch` of the store's operations, within
/// `timeout`, in its span; tells `link`'s watch whether a reply came, and the metrics how long
/// it took and how it failed.
pub(super) async fn bounded<T>(
    call: &Call<'_>,
    batch: usize,
    link: &Arc<Link>,
    timeout: Duration,
    op: impl Future<Output = Result<T, StoreError>>,
) -> Result<T, StoreError> {
    let span = span::call_span(call, || link.server());
    span::record_batch(&span, batch);
    let result = kit::timed(call.operation, timeout, op)
        .instrument(span.clone())
        .await;
    span::record_result(&span, &result, status_code);
    match &result {
        Err(e) if e.kind() == StoreErrorKind::Timeout => link.timed_out(),
        Err(e) if e.kind() == StoreErrorKind::Unavailable => link.unreachable(),
        _ => link.answered(),
    }
    result
}

/// The distinct policies of `checks`, and each check's policy as a number from 1.
fn numbered<'a>(checks: &[Sent<'a>]) -> (Vec<&'a RatePolicy>, Vec<usize>) {
    // a batch holds few policies (usually one): a scan finds each check's
    let mut policies: Vec<&RatePolicy> = Vec::new();
    let numbers = checks
        .iter()
        .map(|(policy, _, _)| {
            let found = policies.iter().position(|p| std::ptr::eq(*p, *policy));
            1 + found.unwrap_or_else(|| {
                policies.push(policy);
                policies.len() - 1
            })
        })
        .collect();
    (policies, numbers)
}

/// The attempt whose place `check` names under `policy` (see `rate.lua`): a reservation its own,
/// where it keeps where its charge goes; a settlement of one that of its reservation, whose unused
/// part it may refund. The sliding log keeps none (its entries are named by their attempt).
fn place(policy: &RatePolicy, check: &RateCheck) -> Option<u64> {
    if policy.algorithm() == Algorithm::SlidingLog {
        return None;
    }
    match check.settles() {
        Some(settled) => settled.refundable.then_some(settled.of),
        None => check.is_reservation().then(|| check.attempt()),
    }
}

/// `<verb> <script> numkeys keys... args...` for `checks` (see `rate.lua`): the `records`, every
/// check's keys (its limits', its limits' blocks, then its place, if it names one), then the
/// call's `deadline` (on the store's clock), the records' number and retention, each distinct
/// policy once (its limits' quotas and windows, a window with its limit's penalty), then per
/// check its policy, cost (marked as a reservation's, with its hold; of a settlement: what it
/// settles) and attempt
/// (with every place it went out at before, if it did).
fn command(verb: &str, script: &str, checks: &[Sent<'_>], deadline: u64, records: &Records) -> Cmd {
    let keys: usize = checks
        .iter()
        .map(|(p, c, _)| {
            let blocks = p.limits().iter().filter(|l| l.penalty().is_some()).count();
            p.limits().len() + blocks + usize::from(place(p, c).is_some())
        })
        .sum();
    let mut cmd = redis::cmd(verb);
    cmd.arg(script).arg(records.keys.len() + keys);
    for record in &records.keys {
        cmd.arg(&**record);
    }
    push_keys(&mut cmd, checks);
    let (policies, numbers) = numbered(checks);
    cmd.arg(deadline)
        .arg(records.keys.len())
        .arg(records.retain_ms)
        .arg(policies.len());
    for policy in &policies {
        push_policy(&mut cmd, policy);
    }
    for (((_, check, _), number), before) in checks.iter().zip(numbers).zip(&records.before) {
        cmd.arg(number);
        match check.settles() {
            // a settlement: `s<reserved>:<actual>:<the settled attempt>`, `S...` of a reservation
            Some(settled) => {
                let of = crate::rate::hex(settled.of);
                let of = String::from_utf8_lossy(&of);
                let kind = if settled.refundable { 'S' } else { 's' };
                cmd.arg(format!("{kind}{}:{}:{of}", settled.reserved, check.cost()))
            }
            None if check.hold_us() > 0 => {
                let kind = if check.is_reservation() { 'r' } else { 'c' };
                cmd.arg(format!("{kind}{}+{}", check.cost(), check.hold_us()))
            }
            None if check.is_reservation() => cmd.arg(format!("r{}", check.cost())),
            None => cmd.arg(check.cost()),
        };
        if before.is_empty() {
            cmd.arg(&check.attempt_hex()[..]);
        } else {
            let mut attempt = String::from_utf8_lossy(&check.attempt_hex()).into_owned();
            for (record, place) in before {
                let _ = write!(attempt, "@{record}:{place}");
            }
            cmd.arg(attempt);
        }
    }
    cmd
}

/// Every check's keys: its limits', its limits' blocks, then its place, if it names one.
fn push_keys(cmd: &mut Cmd, checks: &[Sent<'_>]) {
    let mut key = String::new();
    for (policy, check, _) in checks {
        for limit in policy.limits() {
            policy.write_store_key(&mut key, &check.key(), limit);
            cmd.arg(key.as_str());
        }
        for limit in policy.limits().iter().filter(|l| l.penalty().is_some()) {
            policy.write_block_key(&mut key, &check.key(), limit);
            cmd.arg(key.as_str());
        }
        if let Some(attempt) = place(policy, check) {
            keyspace::write_rate_place(&mut key, policy.namespace(), &check.key(), attempt);
            cmd.arg(key.as_str());
        }
    }
}

/// A policy as the script reads it: its algorithm, its number of limits, then each limit's
/// quota (of a limit that counts calls, `<quota>c`) and window (with its penalty,
/// `<window>:<block>`, where it has one).
fn push_policy(cmd: &mut Cmd, policy: &RatePolicy) {
    let algorithm: u8 = match policy.algorithm() {
        Algorithm::SlidingLog => 1,
        Algorithm::SlidingCounter => 2,
        Algorithm::Gcra => 3,
    };
    cmd.arg(algorithm).arg(policy.limits().len());
    for limit in policy.limits() {
        if limit.counts_calls() {
            cmd.arg(format!("{}c", limit.quota()));
        } else {
            cmd.arg(limit.quota());
        }
        match limit.penalty() {
            Some(_) => cmd.arg(format!("{}:{}", limit.window_us(), limit.block_us())),
            None => cmd.arg(limit.window_us()),
        };
    }
}

/// Reads each check's answer from the script's reply, decided at the store time it ends with.
fn decode(
    reply: Value,
    checks: &[Sent<'_>],
) -> Result<Vec<Result<RateOutcome, StoreError>>, StoreError> {
    let Value::Array(mut items) = reply else {
        return Err(StoreError::protocol("the rate script returned no array"));
    };
    let decided_at_us = match items.pop() {
        Some(Value::Int(now)) => u64::try_from(now).ok(),
        _ => None,
    }
    .ok_or_else(|| StoreError::protocol("the rate script returned no store time"))?;
    let mut reply = Reply(items.into_iter());
    let mut decided = Vec::with_capacity(checks.len());
    for (policy, _, _) in checks {
        let admitted = reply.int()?;
        if admitted == -1 {
            decided.push(Err(StoreError::new(
                StoreErrorKind::Protocol,
                reply.message(),
            )));
            continue;
        }
        if admitted == -2 {
            reply.int()?;
            decided.push(Err(StoreError::expired()));
            continue;
        }
        let retry_after = reply.duration()?;
        let mut limits = Vec::with_capacity(policy.limits().len());
        for limit in policy.limits() {
            let (a, b) = (reply.int()?, reply.int()?);
            limits.push(limit_state(policy.algorithm(), limit, decided_at_us, a, b));
        }
        decided.push(Ok(RateOutcome {
            decided_at_us: Some(decided_at_us),
            admitted: admitted == 1,
            retry_after,
            limits,
        }));
    }
    match reply.0.next() {
        None => Ok(decided),
        Some(_) => Err(StoreError::protocol(
            "the rate script returned a reply too long",
        )),
    }
}

/// A limit's state from the two numbers the script answers it by (see `rate.lua`): `-1` and the
/// time its block has left (µs) for a limit that blocks the caller; else, of a sliding log, the
/// units left and when the next one frees (µs); of a sliding counter, its current and previous
/// windows' counts at the store time `now_us` the call decided at; of GCRA, its theoretical
/// arrival time's offset from then (µs) and remainder. A counter's and GCRA's answers are read
/// off their state here, by the formulas every store's answers come from.
fn limit_state(algorithm: Algorithm, limit: &Limit, now_us: u64, a: i64, b: i64) -> LimitState {
    let b = u64::try_from(b).unwrap_or(0);
    let Ok(a) = u64::try_from(a) else {
        // blocked (-1; any other number below 0 says no more)
        return LimitState {
            remaining: 0,
            reset: Duration::from_micros(b),
        };
    };
    match algorithm {
        Algorithm::SlidingLog => LimitState {
            remaining: a,
            reset: Duration::from_micros(b),
        },
        Algorithm::SlidingCounter => {
            crate::rate::counter_answer(limit.quota(), limit.window_us(), now_us, a, b)
        }
        Algorithm::Gcra => crate::rate::gcra_state(a, b, limit.quota(), limit.window_us()),
    }
}

/// The rate script's reply, read in order.
struct Reply(std::vec::IntoIter<Value>);

impl Reply {
    fn int(&mut self) -> Result<i64, StoreError> {
        match self.0.next() {
            Some(Value::Int(v)) => Ok(v),
            _ => Err(StoreError::protocol(
                "the rate script returned a reply of the wrong shape",
            )),
        }
    }

    /// Microseconds.
    fn duration(&mut self) -> Result<Duration, StoreError> {
        Ok(Duration::from_micros(
            u64::try_from(self.int()?).unwrap_or(0),
        ))
    }

    /// The error of a check that failed.
    fn message(&mut self) -> String {
        match self.0.next() {
            Some(Value::BulkString(message)) => String::from_utf8_lossy(&message).into_owned(),
            _ => String::from("the rate script failed"),
        }
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;
    use crate::fuzz::{check, hostile_i64, redis_reply};
    use crate::key::Key;
    use crate::rate::Limit;

    /// A policy of `n` limits.
    fn policy(n: usize) -> RatePolicy {
        policy_of(Algorithm::SlidingLog, n)
    }

    /// A policy of `n` limits under `algorithm`.
    fn policy_of(algorithm: Algorithm, n: usize) -> RatePolicy {
        let limits = (0..n)
            .map(|i| Limit::per_second(format!("l{i}"), 10))
            .collect();
        RatePolicy::new("fuzz", algorithm, limits).unwrap()
    }

    /// What the script answers for one check.
    #[derive(Debug, Clone)]
    enum Answer {
        Decided {
            admitted: bool,
            retry_us: u32,
            limits: Vec<(u32, u32)>,
        },
        Failed(Vec<u8>),
        Expired(i64),
    }

    fn answer(n: usize) -> impl Strategy<Value = Answer> {
        let decided = (
            any::<bool>(),
            any::<u32>(),
            prop::collection::vec(any::<(u32, u32)>(), n),
        )
            .prop_map(|(admitted, retry_us, limits)| Answer::Decided {
                admitted,
                retry_us,
                limits,
            });
        prop_oneof![
            6 => decided,
            1 => crate::fuzz::bytes(16).prop_map(Answer::Failed),
            1 => hostile_i64().prop_map(Answer::Expired),
        ]
    }

    /// Each check's number of limits and the script's answer to it, then the store time.
    fn answers() -> impl Strategy<Value = (Vec<(usize, Answer)>, u32)> {
        let one = (1usize..4).prop_flat_map(|n| (Just(n), answer(n)));
        (prop::collection::vec(one, 1..4), any::<u32>())
    }

    fn written(answers: &[(usize, Answer)], now: u32) -> Vec<Value> {
        let mut reply = Vec::new();
        for (_, answer) in answers {
            match answer {
                Answer::Decided {
                    admitted,
                    retry_us,
                    limits,
                } => {
                    reply.push(Value::Int(i64::from(*admitted)));
                    reply.push(Value::Int(i64::from(*retry_us)));
                    for (remaining, reset) in limits {
                        reply.push(Value::Int(i64::from(*remaining)));
                        reply.push(Value::Int(i64::from(*reset)));
                    }
                }
                Answer::Failed(message) => {
                    reply.extend([Value::Int(-1), Value::BulkString(message.clone())]);
                }
                Answer::Expired(any) => reply.extend([Value::Int(-2), Value::Int(*any)]),
            }
        }
        reply.push(Value::Int(i64::from(now)));
        reply
    }

    /// Decodes `reply` for checks of `limits` limits each, under sliding logs.
    fn decoded(
        reply: Value,
        limits: &[usize],
    ) -> Result<Vec<Result<RateOutcome, StoreError>>, StoreError> {
        decoded_as(reply, limits, Algorithm::SlidingLog)
    }

    /// Decodes `reply` for checks of `limits` limits each, under `algorithm`.
    fn decoded_as(
        reply: Value,
        limits: &[usize],
        algorithm: Algorithm,
    ) -> Result<Vec<Result<RateOutcome, StoreError>>, StoreError> {
        let policies: Vec<RatePolicy> = limits.iter().map(|&n| policy_of(algorithm, n)).collect();
        let now = Instant::now();
        let sent: Vec<Sent<'_>> = policies
            .iter()
            .map(|p| (p, RateCheck::new(Key::new("fuzz", b"caller"), 1), now))
            .collect();
        decode(reply, &sent)
    }

    #[test]
    fn any_reply_decodes_to_one_answer_per_check_or_a_protocol_error() {
        let limits = prop::collection::vec(1usize..4, 1..4);
        let algorithms = [
            Algorithm::SlidingLog,
            Algorithm::SlidingCounter,
            Algorithm::Gcra,
        ];
        check(512, (redis_reply(), limits), |(reply, limits)| {
            // a counter's and GCRA's numbers are read through their formulas, whatever they are
            for algorithm in algorithms {
                match decoded_as(reply.clone(), &limits, algorithm) {
                    Ok(answers) => prop_assert_eq!(answers.len(), limits.len()),
                    Err(e) => prop_assert_eq!(e.kind(), StoreErrorKind::Protocol),
                }
            }
            Ok(())
        });
    }

    #[test]
    fn a_reply_reads_as_the_script_wrote_it() {
        check(512, answers(), |(answers, now)| {
            let limits: Vec<usize> = answers.iter().map(|(n, _)| *n).collect();
            let reply = Value::Array(written(&answers, now));
            let decoded = decoded(reply, &limits).unwrap();
            prop_assert_eq!(decoded.len(), answers.len());
            for (outcome, (_, answer)) in decoded.into_iter().zip(answers) {
                match (outcome, answer) {
                    (
                        Ok(outcome),
                        Answer::Decided {
                            admitted,
                            retry_us,
                            limits,
                        },
                    ) => {
                        let states = limits
                            .iter()
                            .map(|&(remaining, reset)| LimitState {
                                remaining: u64::from(remaining),
                                reset: Duration::from_micros(u64::from(reset)),
                            })
                            .collect();
                        let expected = RateOutcome {
                            decided_at_us: Some(u64::from(now)),
                            admitted,
                            retry_after: Duration::from_micros(u64::from(retry_us)),
                            limits: states,
                        };
                        prop_assert_eq!(outcome, expected);
                    }
                    (Err(e), Answer::Failed(_)) => {
                        prop_assert_eq!(e.kind(), StoreErrorKind::Protocol);
                    }
                    (Err(e), Answer::Expired(_)) => {
                        prop_assert_eq!(e.kind(), StoreErrorKind::Timeout);
                    }
                    (outcome, answer) => prop_assert!(false, "{answer:?} read as {outcome:?}"),
                }
            }
            Ok(())
        });
    }

    /// A sliding counter's and GCRA's limits are answered by their state, read here as every
    /// store reads it; a limit that blocks the caller by -1 and the time its block has left.
    #[test]
    fn a_limit_is_read_off_the_state_it_is_answered_by() {
        let limit = Limit::per_second("l", 10);
        let state = |remaining, reset_us| LimitState {
            remaining,
            reset: Duration::from_micros(reset_us),
        };
        // 250 ms into a window of 1 s: 3 now and 4 before count 3 + 4 * 0.75 = 6; a unit frees
        // when the previous window's share falls to 2, at 500 ms
        let counter = limit_state(Algorithm::SlidingCounter, &limit, 5_250_000, 3, 4);
        assert_eq!(counter, state(4, 250_000));
        // a TAT 250 ms ahead spans 2.5 emission intervals of 100 ms: 3 units, the next one free
        // once it is 200 ms ahead
        let gcra = limit_state(Algorithm::Gcra, &limit, 5_250_000, 250_000, 0);
        assert_eq!(gcra, state(7, 50_000));
        let log = limit_state(Algorithm::SlidingLog, &limit, 5_250_000, 6, 70_000);
        assert_eq!(log, state(6, 70_000));
        for algorithm in [
            Algorithm::SlidingLog,
            Algorithm::SlidingCounter,
            Algorithm::Gcra,
        ] {
            let blocked = limit_state(algorithm, &limit, 5_250_000, -1, 900_000);
            assert_eq!(blocked, state(0, 900_000), "{algorithm:?}");
        }
    }

    /// Whatever numbers a limit is answered by, reading them never panics: a counter's and
    /// GCRA's go through their formulas, and a limit of any quota and window reads them.
    #[test]
    fn any_numbers_read_as_a_limit_state() {
        let case = (
            hostile_i64(),
            hostile_i64(),
            any::<i64>(),
            1u64..u64::from(u32::MAX),
            1u64..100_000,
        );
        check(512, case, |(a, b, now, quota, window_ms)| {
            let limit = Limit::new("l", quota, Duration::from_millis(window_ms));
            let now = now.unsigned_abs();
            for algorithm in [
                Algorithm::SlidingLog,
                Algorithm::SlidingCounter,
                Algorithm::Gcra,
            ] {
                let state = limit_state(algorithm, &limit, now, a, b);
                if a < 0 {
                    prop_assert_eq!(state.remaining, 0);
                }
            }
            Ok(())
        });
    }

    #[test]
    fn a_reply_cut_short_or_spoilt_never_panics() {
        let case = (answers(), any::<usize>(), redis_reply(), any::<bool>());
        check(512, case, |((answers, now), at, spoilt, cut)| {
            let limits: Vec<usize> = answers.iter().map(|(n, _)| *n).collect();
            let mut reply = written(&answers, now);
            let at = at % reply.len();
            if cut {
                reply.truncate(at);
            } else {
                reply[at] = spoilt;
            }
            let decoded = decoded(Value::Array(reply), &limits);
            if cut {
                prop_assert_eq!(decoded.unwrap_err().kind(), StoreErrorKind::Protocol);
            }
            Ok(())
        });
    }

    /// A check sent before names every record its attempt went out in, each once among the
    /// call's keys, in one argument: `<attempt>@j:p@j:p`.
    #[test]
    fn a_check_sent_again_names_every_earlier_call_in_its_argument() {
        let policy = policy(1);
        let now = Instant::now();
        let again = RateCheck::new(Key::new("fuzz", b"caller"), 1);
        let fresh = RateCheck::new(Key::new("fuzz", b"caller"), 1);
        let checks: Vec<Sent<'_>> = vec![(&policy, again, now), (&policy, fresh, now)];
        let records = Records {
            keys: ["own", "late", "first"].map(Arc::from).to_vec(),
            before: vec![vec![(2, 1), (3, 4)], vec![]],
            retain_ms: 1000,
        };
        let cmd = command("EVALSHA", "sha", &checks, 42, &records);
        let args: Vec<String> = cmd
            .args_iter()
            .map(|arg| match arg {
                redis::Arg::Simple(bytes) => String::from_utf8_lossy(bytes).into_owned(),
                _ => String::new(),
            })
            .collect();
        // EVALSHA sha numkeys, the records, a limit key per check
        assert_eq!(args[..6], ["EVALSHA", "sha", "5", "own", "late", "first"]);
        let hex = |check: &RateCheck| String::from_utf8_lossy(&check.attempt_hex()).into_owned();
        let tail = &args[args.len() - 6..];
        assert_eq!(
            tail,
            [
                "1".to_owned(),
                "1".to_owned(),
                format!("{}@2:1@3:4", hex(&again)),
                "1".to_owned(),
                "1".to_owned(),
                hex(&fresh),
            ]
        );
    }
}
