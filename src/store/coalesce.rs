//! Rate checks coalesced into calls, for a store whose one call can decide many checks in turn
//! (a Redis script, a PostgreSQL function): [`Coalescer`] queues the checks, and a driver sends
//! them as batches through the store's [`BatchCall`].
//!
//! A check goes out at once when no call is in flight, and while the load is light: fewer than
//! four checks in flight, in at most two calls. Otherwise it queues: a full batch (`max_batch`
//! checks) goes out as soon as it has formed, whatever is in flight — calls are pipelined on the
//! store's connections, so throughput does not depend on the distance to the store — and what
//! queued short of a full batch goes out when a call returns, or once its first check has waited
//! half a millisecond (at a distance a call takes longer). With no load that is one check per
//! call, as without batching; under load a batch holds the arrivals of one round trip (or
//! `max_batch`), and the store pays its cost per call (reading and parsing the command, the call,
//! the clock, the reply) once per batch, as the client pays its encoding, write and wake-up.
//!
//! A check goes out only if its caller has time left for the answer: the calls' round trips are
//! measured (a moving average of their durations), and a check whose deadline is nearer than one
//! round trip fails at once, unsent and uncharged, rather than in flight. Under overload the
//! queue thus sheds what cannot be answered in time, and what is sent comes back: decisions go on
//! at the store's capacity instead of every call timing out. A call tells the store a deadline
//! half a round trip before its earliest caller's, so that a check decided in time is also
//! answered in time.
//!
//! A caller waits for its answer without a timer of its own: the driver answers it, with the
//! call's outcome or, once its deadline has passed, with a timeout (the call goes on for the
//! others, within the store's timeout). Checks queue in the order of their deadlines (they share
//! one timeout), so the driver's one timer is set for the next deadline of all the callers it
//! holds: under load, one timer per call rather than one per check.
//!
//! The store decides the checks of a call in turn, each exactly as it would be decided alone at
//! that instant after the ones before it. A check whose step fails fails alone; a call that fails
//! (a timeout, a dropped connection) fails every check it carried, with the same kind: ambiguous
//! for each, as a single call would be. A caller that gave up before its batch went out is left
//! out of it. A store whose call serves one key at a time (Redis Cluster: one slot per script)
//! sends a batch as a call per caller key, each answered on its own: a stalled node holds up only
//! the callers whose keys it serves.

use std::collections::VecDeque;
use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use futures_util::StreamExt;
use futures_util::stream::FuturesUnordered;
use tokio::sync::{Notify, oneshot};
use tokio::time::Instant;
use tracing::{Instrument, Span};

use super::{StoreError, StoreErrorKind, StoreFuture};
use crate::rate::{RateCheck, RateOutcome, RatePolicy};

/// The most checks one call carries unless configured otherwise.
pub(crate) const DEFAULT_MAX_BATCH: usize = 32;

/// The most calls in flight at once while the load is light.
const MAX_CALLS: usize = 2;

/// Below this many checks in flight the load is light: a check goes out at once, in a second call
/// beside the one in flight, rather than wait for it.
const LIGHT_LOAD: usize = 4;

/// The longest a check waits for a short batch to fill while calls are in flight (unless one of
/// them returns first): at a distance a call takes milliseconds, and waiting for it would add
/// them to every check's latency; close by, a call returns sooner.
const LINGER: Duration = Duration::from_micros(500);

/// The most checks in flight at once, in as many calls as they fill: a bound on what a store
/// that stopped answering holds, not on throughput.
const MAX_CARRIED: usize = 4096;

/// A check as sent: its policy, the check, and its caller's deadline.
pub(crate) type Sent<'a> = (&'a RatePolicy, RateCheck, Instant);

/// What one call answers: per check its outcome, in order; or the failure of the whole call.
pub(crate) type Decided = Result<Vec<Result<RateOutcome, StoreError>>, StoreError>;

/// A store's call that decides a batch of checks.
pub(crate) trait BatchCall: Send + Sync + 'static {
    /// Decides `checks` in one call, in turn, each as it would be decided alone; the store
    /// decides nothing of a call it receives from `deadline` on.
    fn decide(
        &self,
        checks: &[Sent<'_>],
        deadline: Instant,
    ) -> impl Future<Output = Decided> + Send;

    /// Whether one call serves one caller key at a time (Redis Cluster: one slot per script).
    fn per_key(&self) -> bool {
        false
    }
}

/// The rate checks of one store waiting to go out, and the store's call.
pub(crate) struct Coalescer<C> {
    call: C,
    timeout: Duration,
    max_batch: usize,
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
    /// The caller's span: the span of the call its check goes out in is a child of the first
    /// caller's in the batch (with no subscriber, none).
    caller: Span,
    reply: Reply,
}

/// Where a caller waits for its check's outcome.
type Reply = oneshot::Sender<Result<RateOutcome, StoreError>>;

/// What goes out next.
enum Next {
    Batch(Vec<Waiting>),
    /// A short batch waits, at most until then.
    Hold(Instant),
    /// Nothing waits.
    Idle,
}

impl<C: BatchCall> Coalescer<C> {
    /// Checks decided by `call`, each within `timeout`, at most `max_batch` to a call.
    pub(crate) fn new(call: C, timeout: Duration, max_batch: usize) -> Self {
        Self {
            call,
            timeout,
            max_batch: max_batch.max(1),
            round_trip_us: AtomicU64::new(0),
            queue: Mutex::default(),
            queued: Notify::new(),
        }
    }

    /// Decides `check` against `policy`: in the next batch, or alone when batches are off.
    pub(crate) fn check(
        self: &Arc<Self>,
        policy: &Arc<RatePolicy>,
        check: RateCheck,
    ) -> StoreFuture<RateOutcome> {
        let this = Arc::clone(self);
        let policy = Arc::clone(policy);
        if self.max_batch == 1 {
            return Box::pin(async move {
                let one = [(&*policy, check, Instant::now() + this.timeout)];
                let mut decided = this.decide(&one).await?;
                decided.pop().unwrap_or_else(|| Err(missing()))
            });
        }
        Box::pin(async move {
            let (reply, answer) = oneshot::channel();
            if this.enqueue(policy, check, reply) {
                tokio::spawn(Driver::new(&this).run());
            }
            // no timer of its own: the driver answers by the deadline (see the module's doc)
            answer.await.unwrap_or_else(|_| Err(missing()))
        })
    }

    /// One call for `checks`, its round trip measured. Its deadline is the earliest caller's,
    /// less the reply's way back (half a round trip): a call that reaches the store later decides
    /// nothing, and one decided in time is answered in time.
    async fn decide(&self, checks: &[Sent<'_>]) -> Decided {
        let started = Instant::now();
        let earliest = checks.iter().map(|(_, _, d)| *d).min();
        let earliest = earliest.unwrap_or(started + self.timeout);
        let back = self.round_trip() / 2;
        let deadline = earliest.checked_sub(back).unwrap_or(earliest);
        let decided = self.call.decide(checks, deadline).await;
        if decided.is_ok() {
            self.measured(started.elapsed());
        }
        decided
    }

    fn queue(&self) -> MutexGuard<'_, Queue> {
        self.queue.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Queues `check`, its deadline the timeout from now: set in the queue's lock, so that the
    /// queue stays in the order of deadlines. Whether nothing is in flight, so that the caller
    /// must start sending.
    fn enqueue(&self, policy: Arc<RatePolicy>, check: RateCheck, reply: Reply) -> bool {
        let caller = Span::current();
        let mut queue = self.queue();
        queue.waiting.push_back(Waiting {
            policy,
            check,
            deadline: Instant::now() + self.timeout,
            caller,
            reply,
        });
        let start = !std::mem::replace(&mut queue.sending, true);
        let wake = !start && (queue.eager || queue.waiting.len().is_multiple_of(self.max_batch));
        drop(queue);
        if wake {
            self.queued.notify_one();
        }
        start
    }

    /// The checks that go out next, at most `room`: a full batch, or, when `any` (nothing in
    /// flight, or the load is light) or once the first has waited [`LINGER`] (or until its
    /// deadline), whatever waits; leaving out callers that gave up and failing those with too
    /// little time left. When nothing goes out: until when a short batch may wait (with no room,
    /// until the first deadline, when that caller times out), or, when nothing waits, `Idle`
    /// (and then, when the driver is `idle`, nothing in flight, it stops).
    fn next_batch(&self, idle: bool, any: bool, room: usize) -> Next {
        let now = Instant::now();
        let round_trip = self.round_trip();
        let mut queue = self.queue();
        queue.eager = any;
        if room == 0 {
            // the calls in flight carry all they may: what waits is answered at its deadline
            while let Some(waiting) = queue.waiting.pop_front() {
                if waiting.deadline > now {
                    let deadline = waiting.deadline;
                    queue.waiting.push_front(waiting);
                    return Next::Hold(deadline);
                }
                let _ = waiting.reply.send(Err(StoreError::timeout()));
            }
            return Next::Idle;
        }
        let max_batch = self.max_batch.min(room);
        if !any && queue.waiting.len() < max_batch {
            // a caller's deadline is its arrival plus the timeout
            let first = queue.waiting.front().map(|w| {
                let linger = w.deadline.checked_sub(self.timeout).unwrap_or(now) + LINGER;
                linger.min(w.deadline)
            });
            match first {
                Some(until) if until > now => return Next::Hold(until),
                Some(_) => {}
                None => return Next::Idle,
            }
        }
        let mut batch = Vec::with_capacity(queue.waiting.len().min(max_batch));
        while batch.len() < max_batch {
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

    /// The calls `batch` goes out as: one, or one per caller key.
    fn calls_of(&self, batch: Vec<Waiting>) -> Vec<Vec<Waiting>> {
        if self.call.per_key() && batch.len() > 1 {
            per_key(batch)
        } else {
            vec![batch]
        }
    }

    /// One call for `batch`, in the context of its first caller's span: what it decides, and the
    /// callers waiting for it.
    fn send(&self, batch: Vec<Waiting>) -> (impl Future<Output = Decided> + Send + '_, Flight) {
        let caller = batch.first().map_or_else(Span::none, |w| w.caller.clone());
        let mut checks = Vec::with_capacity(batch.len());
        let mut replies = Vec::with_capacity(batch.len());
        for waiting in batch {
            checks.push((waiting.policy, waiting.check, waiting.deadline));
            replies.push(Some((waiting.deadline, waiting.reply)));
        }
        let call = async move {
            let sent: Vec<Sent<'_>> = checks.iter().map(|(p, c, d)| (&**p, *c, *d)).collect();
            self.decide(&sent).instrument(caller).await
        };
        (call, Flight { replies, due: 0 })
    }
}

/// The callers of a call in flight, in the order of their checks (and of their deadlines), each
/// until it is answered: by the call, or with a timeout once its deadline passed.
struct Flight {
    replies: Vec<Option<(Instant, Reply)>>,
    /// The first caller not answered yet by its deadline: those before it timed out.
    due: usize,
}

impl Flight {
    /// The deadline the next caller to time out waits until.
    fn next_deadline(&self) -> Option<Instant> {
        let (deadline, _) = self.replies.get(self.due)?.as_ref()?;
        Some(*deadline)
    }

    /// Answers every caller whose deadline is past `now` with a timeout.
    fn expire(&mut self, now: Instant) {
        while let Some(Some((deadline, _))) = self.replies.get(self.due)
            && *deadline <= now
        {
            if let Some((_, reply)) = self.replies[self.due].take() {
                let _ = reply.send(Err(StoreError::timeout()));
            }
            self.due += 1;
        }
    }

    /// Tells each caller still waiting what the call decided for its check.
    fn answer(self, decided: Decided) {
        match decided {
            Ok(decided) => {
                for (reply, outcome) in self.replies.into_iter().zip(decided) {
                    // a caller that gave up meanwhile has no one to tell
                    if let Some((_, reply)) = reply {
                        let _ = reply.send(outcome);
                    }
                }
            }
            Err(error) => {
                for (_, reply) in self.replies.into_iter().flatten() {
                    let _ = reply.send(Err(error.shared()));
                }
            }
        }
    }
}

/// Sends batches until none waits. Made when a check finds nothing in flight; dropped unfinished
/// (its runtime shut down, perhaps before it ever ran), it leaves nothing in flight behind, and
/// the callers still waiting learn that their check was dropped.
struct Driver<C: BatchCall> {
    coalescer: Arc<Coalescer<C>>,
    done: bool,
}

impl<C: BatchCall> Driver<C> {
    fn new(coalescer: &Arc<Coalescer<C>>) -> Self {
        Self {
            coalescer: Arc::clone(coalescer),
            done: false,
        }
    }

    async fn run(mut self) {
        let this = &self.coalescer;
        let mut calls = FuturesUnordered::new();
        // the callers of each call in flight, by the call's number
        let mut flights: Vec<(u64, Flight)> = Vec::new();
        let mut sent = 0_u64;
        // the checks the calls in flight carry
        let mut carried = 0;
        // the driver's one timer: set again only when what it waits for moves
        let sleep = tokio::time::sleep_until(Instant::now());
        tokio::pin!(sleep);
        let mut set = None;
        loop {
            let mut wake = None;
            loop {
                let any = calls.is_empty() || light(calls.len(), carried);
                let room = MAX_CARRIED.saturating_sub(carried);
                let batch = match this.next_batch(calls.is_empty(), any, room) {
                    Next::Batch(batch) => batch,
                    Next::Hold(until) => {
                        wake = Some(until);
                        break;
                    }
                    Next::Idle => break,
                };
                for call in this.calls_of(batch) {
                    carried += call.len();
                    sent += 1;
                    let (call, flight) = this.send(call);
                    flights.push((sent, flight));
                    calls.push(async move { (sent, call.await) });
                }
            }
            if calls.is_empty() {
                break;
            }
            // the next caller in flight to reach its deadline is answered then
            let due = flights.iter().filter_map(|(_, f)| f.next_deadline()).min();
            wake = wake.into_iter().chain(due).min();
            if let Some(until) = wake
                && set != wake
            {
                sleep.as_mut().reset(until);
                set = wake;
            }
            // a call that returns frees its checks' room; a check that queues may make a full
            // batch, or go out at once while the load is light; a short batch waits so long
            tokio::select! {
                Some((number, decided)) = calls.next() => {
                    if let Some(at) = flights.iter().position(|(n, _)| *n == number) {
                        let (_, flight) = flights.swap_remove(at);
                        carried -= flight.replies.len();
                        flight.answer(decided);
                    }
                }
                () = this.queued.notified() => {}
                () = &mut sleep, if wake.is_some() => set = None,
            }
            if let Some(due) = due {
                let now = Instant::now();
                if due <= now {
                    for (_, flight) in &mut flights {
                        flight.expire(now);
                    }
                }
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

impl<C: BatchCall> Drop for Driver<C> {
    fn drop(&mut self) {
        if !self.done {
            let mut queue = self.coalescer.queue();
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
