//! Rate checks on Redis, coalesced: checks that wait for the store at the same moment go out as
//! one call of `rate.lua`.
//!
//! A check goes out at once when no call is in flight, and while the load is light: fewer than
//! four checks in flight, in at most two calls. Otherwise it queues: a full batch (`max_batch`
//! checks) goes out as soon as it has formed, whatever is in flight — calls are pipelined on the
//! multiplexed connection, so throughput does not depend on the distance to the store — and what
//! queued short of a full batch goes out when a call returns, or once its first check has waited
//! half a millisecond (at a distance a call takes longer). With no load that is one check per
//! call, as without batching; under load a batch holds the arrivals of one round trip (or
//! `max_batch`), and Redis pays its cost per call (reading and parsing the command, the script
//! call, `TIME`, the reply) once per batch, as the client pays its encoding, write and wake-up.
//!
//! A check goes out only if its caller has time left for the answer: the store's round trips are
//! measured (a moving average of the calls' durations), and a check whose deadline is nearer than
//! one round trip fails at once, unsent and uncharged, rather than in flight. Under overload the
//! queue thus sheds what cannot be answered in time, and what is sent comes back: decisions go on
//! at the store's capacity instead of every call timing out.
//!
//! The script decides the checks in turn, each exactly as it would be decided alone at that
//! instant of store time after the ones before it. A check whose script step fails fails alone; a
//! call that fails (a timeout, a dropped connection) fails every check it carried, with the same
//! kind: ambiguous for each, as a single call would be. A caller that gave up before its batch
//! went out is left out of it.
//!
//! On Redis Cluster a call holds the checks of one caller key, hence of one hash slot; the calls
//! for different keys of one batch go out together, each to its node, and each is answered on its
//! own: a stalled node holds up only the callers whose keys it serves.
//!
//! Every call leaves a record of the checks it charged (see `rate.lua`), kept for twice the store
//! timeout past its deadline: a call re-sent reads its own, and a check sent again in a later call
//! names the record of the call it went out in before ([`SentChecks`]), so that neither is charged
//! twice. The record is one key per call, in the slot of its first check.

use std::collections::VecDeque;
use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use futures_util::StreamExt;
use futures_util::stream::FuturesUnordered;
use redis::aio::ConnectionLike;
use redis::{Cmd, ErrorKind, RedisResult, ServerErrorKind, Value};
use tokio::sync::{Notify, oneshot};
use tokio::time::Instant;

use super::clock::store_deadline;
use super::connection::{Connection, Link};
use super::sent::{Place, SentChecks};
use super::{Lua, store_error};
use crate::keys;
use crate::rate::{Algorithm, LimitState, RateCheck, RateOutcome, RatePolicy};
use crate::store::{StoreClock, StoreError, StoreErrorKind, StoreFuture};

/// The most checks one call carries unless configured otherwise.
pub(super) const DEFAULT_MAX_BATCH: usize = 32;

/// The most calls in flight at once while the load is light.
const MAX_CALLS: usize = 2;

/// The longest a check waits for a short batch to fill while calls are in flight (unless one of
/// them returns first): at a distance a call takes milliseconds, and waiting for it would add
/// them to every check's latency; close by, a call returns sooner.
const LINGER: Duration = Duration::from_micros(500);

/// The most checks in flight at once, in as many calls as they fill: a bound on what a store
/// that stopped answering holds, not on throughput.
const MAX_CARRIED: usize = 4096;

/// Below this many checks in flight the load is light: a check goes out at once, in a second call
/// beside the one in flight, rather than wait for it.
const LIGHT_LOAD: usize = 4;

/// The rate checks of one store: its connection, the script, and the checks waiting to go out.
pub(super) struct Rates {
    link: Arc<Link>,
    clock: Arc<StoreClock>,
    script: Lua,
    timeout: Duration,
    max_batch: usize,
    /// On Cluster, calls are split per caller key.
    per_key: bool,
    /// Where recent checks went out, for a check sent again.
    sent: SentChecks,
    /// A moving average of the calls' round trips, in microseconds (0: none measured yet).
    round_trip_us: AtomicU64,
    queue: Mutex<Queue>,
    /// Tells the driver that a check queued.
    queued: Notify,
}

#[derive(Default)]
struct Queue {
    waiting: VecDeque<Waiting>,
    /// A driver is sending: new checks wait for it.
    sending: bool,
    /// The driver would send a check now, whatever the batch: it wants to hear of every one
    /// (otherwise only of full batches).
    eager: bool,
}

/// A check waiting for its batch.
struct Waiting {
    policy: Arc<RatePolicy>,
    check: RateCheck,
    /// When its caller gives up: received later, the check charges nothing.
    deadline: Instant,
    reply: oneshot::Sender<Result<RateOutcome, StoreError>>,
}

/// What goes out next.
enum Next {
    Batch(Vec<Waiting>),
    /// A short batch waits, at most until then.
    Hold(Instant),
    /// Nothing waits.
    Idle,
}

/// A check as sent: its policy, the check, and its caller's deadline.
type Sent<'a> = (&'a RatePolicy, RateCheck, Instant);

impl Rates {
    pub(super) fn new(
        link: Arc<Link>,
        clock: Arc<StoreClock>,
        timeout: Duration,
        max_batch: usize,
    ) -> Self {
        let per_key = matches!(link.get(), Connection::Cluster(_));
        Self {
            link,
            clock,
            script: Lua::new(include_str!("../scripts/rate.lua")),
            timeout,
            max_batch: max_batch.max(1),
            per_key,
            sent: SentChecks::new(retention(timeout)),
            round_trip_us: AtomicU64::new(0),
            queue: Mutex::default(),
            queued: Notify::new(),
        }
    }

    /// Decides `check` against `policy`: in the next batch, or alone when batches are off.
    pub(super) fn check(
        self: &Arc<Self>,
        policy: &Arc<RatePolicy>,
        check: RateCheck,
    ) -> StoreFuture<RateOutcome> {
        let this = Arc::clone(self);
        let policy = Arc::clone(policy);
        let deadline = Instant::now() + self.timeout;
        if self.max_batch == 1 {
            return Box::pin(async move {
                let one = [(&*policy, check, deadline)];
                let mut decided = this.call(&one).await?;
                decided.pop().unwrap_or_else(|| Err(missing()))
            });
        }
        Box::pin(async move {
            let (reply, answer) = oneshot::channel();
            if this.enqueue(Waiting {
                policy,
                check,
                deadline,
                reply,
            }) {
                tokio::spawn(Driver::new(&this).run());
            }
            match tokio::time::timeout_at(deadline, answer).await {
                Ok(Ok(outcome)) => outcome,
                Ok(Err(_)) => Err(missing()),
                Err(_) => Err(StoreError::timeout()),
            }
        })
    }

    fn queue(&self) -> MutexGuard<'_, Queue> {
        self.queue.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Queues `waiting`; whether nothing is in flight, so that the caller must start sending.
    fn enqueue(&self, waiting: Waiting) -> bool {
        let mut queue = self.queue();
        queue.waiting.push_back(waiting);
        let start = !std::mem::replace(&mut queue.sending, true);
        let wake = !start && (queue.eager || queue.waiting.len().is_multiple_of(self.max_batch));
        drop(queue);
        if wake {
            self.queued.notify_one();
        }
        start
    }

    /// The checks that go out next: a full batch, or, when `any` (nothing in flight, or the load
    /// is light) or once the first has waited [`LINGER`], whatever waits; leaving out callers
    /// that gave up and failing those with too little time left. When nothing goes out: until
    /// when a short batch may wait, or, when nothing waits, `Idle` (and then, when the driver is
    /// `idle`, nothing in flight, it stops).
    fn next_batch(&self, idle: bool, any: bool) -> Next {
        let now = Instant::now();
        let round_trip = self.round_trip();
        let mut queue = self.queue();
        queue.eager = any;
        if !any && queue.waiting.len() < self.max_batch {
            // a caller's deadline is its arrival plus the timeout
            let first = queue
                .waiting
                .front()
                .map(|w| w.deadline.checked_sub(self.timeout).unwrap_or(now) + LINGER);
            match first {
                Some(until) if until > now => return Next::Hold(until),
                Some(_) => {}
                None => return Next::Idle,
            }
        }
        let mut batch = Vec::with_capacity(queue.waiting.len().min(self.max_batch));
        while batch.len() < self.max_batch {
            match queue.waiting.pop_front() {
                Some(waiting) if waiting.reply.is_closed() => {}
                Some(waiting) if waiting.deadline.saturating_duration_since(now) < round_trip => {
                    let _ = waiting.reply.send(Err(too_late(round_trip)));
                }
                Some(waiting) => batch.push(waiting),
                None => break,
            }
        }
        if batch.is_empty() {
            queue.sending = !(idle && queue.waiting.is_empty());
            return Next::Idle;
        }
        Next::Batch(batch)
    }

    /// The calls' round trip as measured lately (zero before the first).
    fn round_trip(&self) -> Duration {
        Duration::from_micros(self.round_trip_us.load(Ordering::Relaxed))
    }

    /// Learns that a call took `took`.
    fn measured(&self, took: Duration) {
        let took = u64::try_from(took.as_micros()).unwrap_or(u64::MAX);
        let was = self.round_trip_us.load(Ordering::Relaxed);
        let now = if was == 0 {
            took
        } else {
            was - was / 8 + took / 8
        };
        self.round_trip_us.store(now, Ordering::Relaxed);
    }

    /// The calls `batch` goes out as: one, or on Cluster one per caller key.
    fn calls_of(&self, batch: Vec<Waiting>) -> Vec<Vec<Waiting>> {
        if self.per_key && batch.len() > 1 {
            per_key(batch)
        } else {
            vec![batch]
        }
    }

    /// Sends one call for `batch` and tells each caller its answer.
    async fn send_one(&self, batch: Vec<Waiting>) {
        let checks: Vec<_> = batch
            .iter()
            .map(|w| (&*w.policy, w.check, w.deadline))
            .collect();
        let started = Instant::now();
        let decided = self.call(&checks).await;
        if decided.is_ok() {
            self.measured(started.elapsed());
        }
        match decided {
            Ok(decided) => {
                for (waiting, outcome) in batch.into_iter().zip(decided) {
                    // a caller that gave up meanwhile has no one to tell
                    let _ = waiting.reply.send(outcome);
                }
            }
            Err(error) => {
                for waiting in batch {
                    let _ = waiting.reply.send(Err(error.shared()));
                }
            }
        }
    }

    /// One call of the script for `checks`, bounded by the store timeout; the link's watch
    /// learns whether a reply came.
    async fn call(
        &self,
        checks: &[Sent<'_>],
    ) -> Result<Vec<Result<RateOutcome, StoreError>>, StoreError> {
        let mut conn = self.link.get();
        let reply = bounded("rate_check", &self.link, self.timeout, async {
            // the earliest caller's, less the reply's way back (half a round trip): a call that
            // comes later than that decides nothing, and one decided in time is answered in time
            let earliest = checks.iter().map(|(_, _, d)| *d).min();
            let earliest = earliest.unwrap_or_else(|| Instant::now() + self.timeout);
            let back = self.round_trip() / 2;
            let earliest = earliest.checked_sub(back).unwrap_or(earliest);
            let deadline = store_deadline(&self.clock, &self.link, &mut conn, earliest).await?;
            let records = self.records(checks);
            let evalsha = command(
                "EVALSHA",
                self.script.get_hash(),
                checks,
                deadline,
                &records,
            );
            match send(&mut conn, &evalsha).await {
                Err(e) if e.kind() == ErrorKind::Server(ServerErrorKind::NoScript) => {
                    // loads the script as it runs it
                    let eval = command("EVAL", self.script.source, checks, deadline, &records);
                    send(&mut conn, &eval).await
                }
                sent => sent,
            }
            .map_err(store_error)
        })
        .await?;
        decode(reply, checks)
    }
}

impl Rates {
    /// The records a call of `checks` names: a new one of its own, and where each check went
    /// before, if it did lately; each check is kept as going out in this call.
    fn records(&self, checks: &[Sent<'_>]) -> Records {
        let mut own = String::new();
        if let Some((policy, check, _)) = checks.first() {
            let call = uuid::Uuid::new_v4().as_u64_pair().0;
            keys::write_rate_record(&mut own, policy, &check.key(), call);
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
            let before = self.sent.went(check.attempt(), here, now).map(|place| {
                let at = records.keys.iter().position(|k| *k == place.record);
                let number = at.unwrap_or_else(|| {
                    records.keys.push(place.record);
                    records.keys.len() - 1
                });
                (number + 1, place.check)
            });
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
/// went out in before; per check, the number of that record and the check's place in that call.
struct Records {
    keys: Vec<Arc<str>>,
    before: Vec<Option<(usize, usize)>>,
    retain_ms: u64,
}

/// Sends `cmd`; an error reply is an error (Cluster connections hand it over as a value).
async fn send(conn: &mut Connection, cmd: &Cmd) -> RedisResult<Value> {
    match conn.req_packed_command(cmd).await? {
        Value::ServerError(error) => Err(error.into()),
        reply => Ok(reply),
    }
}

/// Runs `op`, store operation `operation`, within `timeout`; tells `link`'s watch whether a
/// reply came, and the metrics how long it took and how it failed.
pub(super) async fn bounded<T>(
    operation: &'static str,
    link: &Arc<Link>,
    timeout: Duration,
    op: impl Future<Output = Result<T, StoreError>>,
) -> Result<T, StoreError> {
    let started = std::time::Instant::now();
    let result = match tokio::time::timeout(timeout, op).await {
        Ok(result) => result,
        Err(_) => Err(StoreError::timeout()),
    };
    crate::metrics::store_call(
        operation,
        started.elapsed(),
        result.as_ref().err().map(StoreError::kind),
    );
    match &result {
        Err(e) if e.kind() == StoreErrorKind::Timeout => link.timed_out(),
        Err(e) if e.kind() == StoreErrorKind::Unavailable => link.unreachable(),
        _ => link.answered(),
    }
    result
}

/// Sends batches until none waits. Made when a check finds nothing in flight; dropped unfinished
/// (its runtime shut down, perhaps before it ever ran), it leaves nothing in flight behind, and
/// the callers still waiting learn that their check was dropped.
struct Driver {
    rates: Arc<Rates>,
    done: bool,
}

impl Driver {
    fn new(rates: &Arc<Rates>) -> Self {
        Self {
            rates: Arc::clone(rates),
            done: false,
        }
    }

    async fn run(mut self) {
        let rates = &self.rates;
        let mut calls = FuturesUnordered::new();
        // the checks the calls in flight carry
        let mut carried = 0;
        loop {
            let mut hold = None;
            while carried < MAX_CARRIED {
                let any = calls.is_empty() || light(calls.len(), carried);
                let batch = match rates.next_batch(calls.is_empty(), any) {
                    Next::Batch(batch) => batch,
                    Next::Hold(until) => {
                        hold = Some(until);
                        break;
                    }
                    Next::Idle => break,
                };
                for call in rates.calls_of(batch) {
                    carried += call.len();
                    calls.push(async move {
                        let checks = call.len();
                        rates.send_one(call).await;
                        checks
                    });
                }
            }
            if calls.is_empty() {
                break;
            }
            // a call that returns frees its checks' room; a check that queues may make a full
            // batch, or go out at once while the load is light; a short batch waits so long
            let linger = async move {
                match hold {
                    Some(until) => tokio::time::sleep_until(until).await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                Some(checks) = calls.next() => carried -= checks,
                () = rates.queued.notified() => {}
                () = linger => {}
            }
        }
        self.done = true;
    }
}

/// Whether another call may go out beside the `calls` in flight, which carry `carried` checks:
/// while the load is light, a check need not wait for the call in flight.
fn light(calls: usize, carried: usize) -> bool {
    calls < MAX_CALLS && carried < LIGHT_LOAD
}

impl Drop for Driver {
    fn drop(&mut self) {
        if !self.done {
            let mut queue = self.rates.queue();
            queue.sending = false;
            queue.waiting.clear();
        }
    }
}

/// `batch` split by caller key, in order within each part.
fn per_key(batch: Vec<Waiting>) -> Vec<Vec<Waiting>> {
    let mut parts: Vec<Vec<Waiting>> = Vec::new();
    for waiting in batch {
        let key = waiting.check.key();
        match parts.iter_mut().find(|p| p[0].check.key() == key) {
            Some(part) => part.push(waiting),
            None => parts.push(vec![waiting]),
        }
    }
    parts
}

/// `<verb> <script> numkeys keys... args...` for `checks` (see `rate.lua`): the `records`, every
/// check's keys, then the call's `deadline` (on the store's clock), the records' number and
/// retention, each distinct policy once, then per check its policy, cost and attempt (with where
/// it went before, if it did).
fn command(verb: &str, script: &str, checks: &[Sent<'_>], deadline: u64, records: &Records) -> Cmd {
    let keys: usize = checks.iter().map(|(p, _, _)| p.limits().len()).sum();
    let mut cmd = redis::cmd(verb);
    cmd.arg(script).arg(records.keys.len() + keys);
    for record in &records.keys {
        cmd.arg(&**record);
    }
    let mut key = String::new();
    for (policy, check, _) in checks {
        for limit in policy.limits() {
            keys::write_rate(&mut key, policy, &check.key(), limit);
            cmd.arg(key.as_str());
        }
    }
    // a batch holds few policies (usually one): a scan finds each check's
    let mut policies: Vec<&RatePolicy> = Vec::new();
    let numbers: Vec<usize> = checks
        .iter()
        .map(|(policy, _, _)| {
            let found = policies.iter().position(|p| std::ptr::eq(*p, *policy));
            1 + found.unwrap_or_else(|| {
                policies.push(policy);
                policies.len() - 1
            })
        })
        .collect();
    cmd.arg(deadline)
        .arg(records.keys.len())
        .arg(records.retain_ms)
        .arg(policies.len());
    for policy in &policies {
        let algorithm: u8 = match policy.algorithm() {
            Algorithm::SlidingLog => 1,
            Algorithm::SlidingCounter => 2,
            Algorithm::Gcra => 3,
        };
        cmd.arg(algorithm).arg(policy.limits().len());
        for limit in policy.limits() {
            cmd.arg(limit.quota()).arg(limit.window_us());
        }
    }
    for (((_, check, _), number), before) in checks.iter().zip(numbers).zip(&records.before) {
        cmd.arg(number).arg(check.cost());
        match before {
            Some((record, place)) => {
                let attempt = String::from_utf8_lossy(&check.attempt_hex()).into_owned();
                cmd.arg(format!("{attempt}@{record}:{place}"))
            }
            None => cmd.arg(&check.attempt_hex()[..]),
        };
    }
    cmd
}

/// Reads each check's answer from the script's reply.
fn decode(
    reply: Value,
    checks: &[Sent<'_>],
) -> Result<Vec<Result<RateOutcome, StoreError>>, StoreError> {
    let Value::Array(items) = reply else {
        return Err(protocol("the rate script returned no array"));
    };
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
        for _ in policy.limits() {
            limits.push(LimitState {
                remaining: u64::try_from(reply.int()?).unwrap_or(0),
                reset: reply.duration()?,
            });
        }
        decided.push(Ok(RateOutcome {
            admitted: admitted == 1,
            retry_after,
            limits,
        }));
    }
    match reply.0.next() {
        None => Ok(decided),
        Some(_) => Err(protocol("the rate script returned a reply too long")),
    }
}

/// The rate script's reply, read in order.
struct Reply(std::vec::IntoIter<Value>);

impl Reply {
    fn int(&mut self) -> Result<i64, StoreError> {
        match self.0.next() {
            Some(Value::Int(v)) => Ok(v),
            _ => Err(protocol(
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

fn protocol(message: &str) -> StoreError {
    StoreError::new(StoreErrorKind::Protocol, message.to_owned())
}

/// The error of a check not sent because its caller's deadline is nearer than a `round_trip`.
fn too_late(round_trip: Duration) -> StoreError {
    StoreError::new(
        StoreErrorKind::Timeout,
        format!(
            "the rate check was not sent: its caller had less time left than a round trip to \
             the store ({} µs); nothing was charged",
            round_trip.as_micros()
        ),
    )
}

/// The error of a caller whose batch went away unanswered (its driver was stopped).
fn missing() -> StoreError {
    StoreError::new(
        StoreErrorKind::Unavailable,
        "the rate check was dropped before an answer came",
    )
}
