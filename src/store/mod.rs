//! Where shared state lives: the store capabilities, and the backends that provide them.
//!
//! Every operation is one round trip and atomic on the server: one Lua script, one conditional
//! command or one PL/pgSQL function call, never a read-modify-write across round trips. Time
//! comes from the store (`TIME` inside the scripts, `clock_timestamp()` in the functions), so
//! clock skew between copies of a service cannot change a decision.
//!
//! The operations come in four capabilities, one trait each, so that a backend or a wrapper
//! implements what it serves and a layer asks only for what it uses:
//!
//! | trait | operations | used by |
//! | --- | --- | --- |
//! | [`RateStore`] | [`check_rate`](RateStore::check_rate) | rate limits |
//! | [`LockStore`] | claims, lock acquisition, token-checked extend and delete | claims and locks |
//! | [`IdempotencyStore`] | begin, complete, release and extend a record | idempotency keys |
//! | [`PermitStore`] | acquire, extend and release one of N permits | concurrency limits |
//!
//! [`Store`] is all four plus a health check: what [`RedisStore`], [`PgStore`] and
//! [`MemoryStore`] provide, and what `Arc<dyn Store>` shares between layers.
//!
//! - [`RedisStore`] (feature `redis`): Redis or Valkey, shared by every copy of the service.
//! - [`PgStore`] (feature `postgres`): PostgreSQL, shared alike; each operation one PL/pgSQL
//!   function call on the database clock.
//! - [`MemoryStore`]: the same semantics inside one process — for tests, docs and a single copy.
//!   Two processes with a `MemoryStore` each do **not** share limits.
//!
//! Every round trip of [`RedisStore`] and [`PgStore`] runs in a `tracing` span at `DEBUG`
//! (target `tollgate::store`) with OpenTelemetry's database attributes — `db.system.name`,
//! `db.operation.name`, `server.address`, and on an error `db.response.status_code` — for
//! `tracing-opentelemetry` to export: see [Tracing](crate::guide::operations#tracing).
//!
//! # Deadlines
//!
//! A call that timed out, or whose connection broke after it was sent, may have run — or may
//! still run: TCP delivers bytes that a partition held once it heals, even on a connection the
//! client has replaced or closed. An undo sent afterwards, on any connection, could then arrive
//! before the command it undoes. So the store, not the caller, decides an attempt's fate: every
//! write that can be left unanswered carries a `deadline`, and a store that receives it later
//! does nothing (the call fails with [`StoreErrorKind::Timeout`]). Once the deadline has passed
//! on the caller's clock, an unanswered attempt has either run or never will, and a
//! token-checked undo sent from then on is final. Rate checks carry the same deadline (their
//! store timeout from when they were made): one that arrives late charges nothing.
//!
//! The deadline is sent on the store's own clock (`TIME` on Redis, `clock_timestamp()` on
//! PostgreSQL), mapped conservatively from the latest reading of that clock: it holds as long as
//! the store's clock runs at most 0.1 % slower than the caller's between two readings, and the
//! nodes of a Cluster agree within 2 ms. A reading behind what the last one predicts (a new
//! primary whose clock is behind the old one's, a clock stepped back) is followed from then on. Releases take no deadline: a release is never regretted, and it is
//! token-checked, so a late one cannot touch another owner's key.
//!
//! # The attempt ledger
//!
//! What follows a rate decision holds on every store alike: a charged attempt (a check admitted
//! with a cost, a settlement applied) is remembered for at least its deadline plus twice the
//! store's timeout, whatever else charged the caller in between; a [reservation](RateCheck::reservation)
//! also keeps where its charge went, so that its [settlement](RateCheck::settle) refunds only
//! what the limit still counts and never quota that others spent. One reference model,
//! [`conformance::model`], defines every answer, and each store is held against it
//! ([`conformance::property`]). The rules in depth:
//! [`guide::ledger`](crate::guide::ledger).
//!
//! | store | an attempt is remembered | a re-send | a late first send | a settlement after the window rolled | a re-sent settlement |
//! | --- | --- | --- | --- | --- | --- |
//! | [`MemoryStore`] | 3 s after its decision (the deadline of a 1 s timeout, plus twice that) | admitted, charged nothing | — (its calls are never late) | refunds only what the limit still counts | applied once |
//! | [`RedisStore`] (standalone, Sentinel, Cluster; Redis or Valkey) | its call's deadline + 2 × timeout (a record per call, named again by the copy that re-sends) | admitted, charged nothing | refused ([`Timeout`](StoreErrorKind::Timeout)), nothing changed | refunds only what the limit still counts | applied once |
//! | [`PgStore`] | its deadline + 2 × timeout (a row per attempt) | admitted, charged nothing | refused ([`Timeout`](StoreErrorKind::Timeout)), nothing changed | refunds only what the limit still counts | applied once |
//!
//! A settlement of a plain check ([`RateCheck::new`]) refunds nothing: only a reservation's
//! place is kept. Costs are sent clamped to what changes no answer, so no cost a request names
//! overflows a store's arithmetic; in a batch, a check whose step fails fails alone.
//!
//! # Invalidations
//!
//! A rate-limit layer caches denials; a reset or a refund through one copy makes another copy's
//! cached denial stale. Each store broadcasts those events to every copy subscribed to it
//! ([`RateStore::invalidations`]), and a layer drops the caller's cached denial on arrival: the
//! caller is admitted on every copy within about a round trip of the broadcast. The broadcast
//! is a shortcut, never what correctness rests on: when it is lost, a cached denial is still
//! served for at most a second.
//!
//! | store | broadcast | subscriber | published | cost |
//! | --- | --- | --- | --- | --- |
//! | [`MemoryStore`] | a `tokio::sync::broadcast` in the process | every layer on the store | after a reset; after a settlement that refunds a reservation and leaves the caller room | none beyond the channel |
//! | [`RedisStore`] (standalone, Sentinel, Cluster) | `PUBLISH <namespace>:invalidated <caller>` after the write | one Pub/Sub connection per store, `PSUBSCRIBE *:rl*:invalidated`, made again with back-off when it drops (behind Sentinel: on the primary the sentinels name; Cluster: on any node, as Cluster delivers a `PUBLISH` to every node) | as above | one `PUBLISH` per reset or refund, delivered to every subscribed copy |
//! | [`PgStore`] | `pg_notify('<schema>_invalidated', '<namespace> <caller>')` (a reset's in its own transaction; a refund's right after the settlement) | one connection per store outside the pool, `LISTEN`, made again with back-off | as above | one notification per reset or refund |
//!
//! A layer subscribes once, on its first request. A store on a connection or pool the
//! application handed over (`RedisStore::from_connection` and the like, `PgStore::from_pool`,
//! `PgStore::pool_builder`) cannot open a subscriber of its own: it publishes, but offers no
//! subscription, and its layers keep the one-second bound. A settlement that asks a refund is
//! published when the store's answer shows room on every limit, whether or not the refund
//! itself returned any (a refund of a charge that has left the window returns nothing); the
//! publish is one command sent after the answer, which never waits for it.
#![cfg_attr(
    not(feature = "postgres"),
    doc = "",
    doc = "[`PgStore`]: https://docs.rs/tollgate/latest/tollgate/store/struct.PgStore.html"
)]
#![cfg_attr(
    feature = "conformance",
    doc = "",
    doc = "[`conformance::model`]: crate::conformance::model",
    doc = "[`conformance::property`]: crate::conformance::property"
)]
#![cfg_attr(
    not(feature = "conformance"),
    doc = "",
    doc = "[`conformance::model`]: https://docs.rs/tollgate/latest/tollgate/conformance/model/index.html",
    doc = "[`conformance::property`]: https://docs.rs/tollgate/latest/tollgate/conformance/property/index.html"
)]

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use tokio::time::Instant;

use crate::key::Key;
use crate::rate::{RateCheck, RateOutcome, RatePolicy};

#[cfg(any(feature = "redis", feature = "postgres"))]
pub(crate) mod coalesce;
#[cfg(any(feature = "redis", feature = "postgres"))]
pub(crate) mod deadline;
mod error;
mod invalidation;
#[cfg(any(feature = "redis", feature = "postgres"))]
mod kit;
mod memory;
#[cfg(feature = "postgres")]
pub(crate) mod postgres;
#[cfg(feature = "redis")]
mod redis;
#[cfg(any(feature = "redis", feature = "postgres"))]
mod span;

#[cfg(any(feature = "redis", feature = "postgres"))]
pub(crate) use deadline::StoreClock;
pub use error::{StoreError, StoreErrorKind};
#[cfg(any(feature = "redis", feature = "postgres"))]
pub(crate) use invalidation::publishing_refunds;
pub use invalidation::{Invalidation, Invalidations};
pub use memory::MemoryStore;
#[cfg(all(feature = "postgres", feature = "axum"))]
pub use postgres::NoTransaction;
#[cfg(feature = "postgres")]
pub use postgres::{Once, OnceError, OnceTx, PgStore, PgStoreBuilder};
#[cfg(feature = "redis")]
pub use redis::{RedisClusterBuilder, RedisSentinelBuilder, RedisStore, RedisStoreBuilder};

/// The future a store operation returns: owned, `Send`, and bounded by the store's timeout.
pub type StoreFuture<T> = Pin<Box<dyn Future<Output = Result<T, StoreError>> + Send + 'static>>;

/// Rate checks: the capability a rate-limit layer needs.
///
/// Implementations must finish every future within their own timeout (a store that is down must not
/// hang a request) and make each check atomic with respect to every other caller of the same
/// backend, in any process.
pub trait RateStore: fmt::Debug + Send + Sync + 'static {
    /// Checks the cost of `check` against every limit of `policy` for its caller and, only if all
    /// have room, charges all of them — in one atomic step. The keys are
    /// [`RatePolicy::store_keys`]. Safe to run twice: the same attempt again is charged once and
    /// admitted again (see [`RateCheck`]).
    fn check_rate(&self, policy: &Arc<RatePolicy>, check: RateCheck) -> StoreFuture<RateOutcome>;

    /// How long a check may take before it fails with [`StoreErrorKind::Timeout`]: a check is
    /// remembered for its deadline plus twice this (see the
    /// [attempt ledger](self#the-attempt-ledger)).
    fn timeout(&self) -> Duration;

    /// Forgets what caller `key` has spent of every limit of `policy` (deletes its
    /// [`RatePolicy::store_keys`]), as if it had never been seen; other policies' state stays.
    /// A store with [`invalidations`](Self::invalidations) then broadcasts
    /// [`Invalidation::Caller`] for `key` under the policy's namespace.
    fn reset_rate(&self, policy: &Arc<RatePolicy>, key: Key) -> StoreFuture<()>;

    /// A subscription to the store's invalidation broadcast (see
    /// [Invalidations](self#invalidations)), or `None` when the store has none (the default): a
    /// rate-limit layer subscribes once, and drops a caller's cached denial when the caller is
    /// reset or refunded through any copy. A store that offers it broadcasts
    /// [`Invalidation::Caller`] after every [`reset_rate`](Self::reset_rate), and after every
    /// settlement of a reservation that refunded quota and left the caller room on every limit;
    /// and [`Invalidation::Missed`] when some may have been lost. Called inside a Tokio runtime.
    fn invalidations(&self) -> Option<Invalidations> {
        None
    }
}

/// Conditional writes with a holder: the capability claims and locks need.
///
/// Each operation is atomic and bounded by the store's timeout, as for [`RateStore`]. A write
/// that takes a `deadline` runs only if the store receives it before then: see
/// [Deadlines](self#deadlines).
pub trait LockStore: fmt::Debug + Send + Sync + 'static {
    /// How long a call may take before it fails with [`StoreErrorKind::Timeout`]: the
    /// deadline callers give their writes.
    fn timeout(&self) -> Duration;

    /// Sets `key` to `holder` only if `key` does not exist (SET NX), expiring after `ttl` (`None`:
    /// never). The loser learns the current holder in the same atomic step. A key that `holder`
    /// holds already counts as won: the same attempt run twice wins twice. Received after
    /// `deadline`, it does nothing.
    fn claim(
        &self,
        key: String,
        holder: String,
        ttl: Option<Duration>,
        deadline: Instant,
    ) -> StoreFuture<ClaimOutcome>;

    /// Sets lock `hold.key` to `hold.token` for `lease` if it is free and, only then, draws the
    /// next fencing token from `fence_key` (same hash slot): above both the counter's last value
    /// and the store time in microseconds, so it strictly increases per lock name even across a
    /// counter lost or restored stale. The same attempt again (a lock that holds the token already)
    /// is acquired again with the same fencing token and a fresh lease. Received after `deadline`,
    /// it does nothing.
    fn lock_acquire(
        &self,
        hold: Hold,
        fence_key: String,
        lease: Duration,
        deadline: Instant,
    ) -> StoreFuture<LockAttempt>;

    /// Resets `hold.key`'s expiry to `lease` from now, only while it holds `hold.token`; `false`
    /// when it does not (expired, released, or taken over by another owner). Received after
    /// `deadline`, it does nothing.
    fn extend_if_held(&self, hold: Hold, lease: Duration, deadline: Instant) -> StoreFuture<bool>;

    /// Deletes `hold.key` only while it holds `hold.token`; `false` when it does not. A call
    /// re-sent after a lost reply answers as its first run did.
    fn delete_if_held(&self, hold: Hold) -> StoreFuture<bool>;
}

/// Permits: at most `limit` holders of a key at once, each with a lease and a fencing token —
/// the capability the [concurrency-limit layer](crate::concurrency) needs.
///
/// Each operation is atomic and bounded by the store's timeout, as for [`RateStore`]. A write
/// that takes a `deadline` runs only if the store receives it before then: see
/// [Deadlines](self#deadlines).
pub trait PermitStore: fmt::Debug + Send + Sync + 'static {
    /// How long a call may take before it fails with [`StoreErrorKind::Timeout`]: the
    /// deadline callers give their writes.
    fn timeout(&self) -> Duration;

    /// Takes one of the `limit` permits of `hold.key` for `hold.token`, for `lease`, if one is free
    /// for it and, only then, draws a fencing token from `fence_key` (same hash slot) as
    /// [`LockStore::lock_acquire`] does: strictly increasing per key. A permit that `hold.token`
    /// holds already is taken again with a fresh lease and a fresh fencing token: the same attempt
    /// run twice takes one permit. Received after `deadline`, it does nothing.
    ///
    /// Permits go to waiters first, in arrival order. With `wait` set, a holder that finds no
    /// permit free for it keeps a place in the key's queue for `wait` from now (each attempt renews
    /// it; [`permit_release`](Self::permit_release) gives it up); a permit is free for it while
    /// fewer waiters arrived before it than permits are free (leases that ended do not count).
    /// Without `wait`, a permit is free only when more are free than waiters queue.
    fn permit_acquire(
        &self,
        hold: Hold,
        fence_key: String,
        limit: u32,
        lease: Duration,
        wait: Option<Duration>,
        deadline: Instant,
    ) -> StoreFuture<PermitAttempt>;

    /// Resets the permit's lease to `lease` from now, only while `hold.token` holds one of
    /// `hold.key`'s permits; `false` when it does not (released or expired). Received after
    /// `deadline`, it does nothing.
    fn permit_extend(&self, hold: Hold, lease: Duration, deadline: Instant) -> StoreFuture<bool>;

    /// Gives the permit back, only while `hold.token` holds one; `false` when it does not. A call
    /// re-sent after a lost reply answers as its first run did. A place `hold.token` keeps in the
    /// key's queue is given up too.
    fn permit_release(&self, hold: Hold) -> StoreFuture<bool>;
}

/// Idempotency records claimed with a token and a lease: the capability the idempotency layer
/// needs.
///
/// Each operation is atomic and bounded by the store's timeout, as for [`RateStore`]; all but
/// [`idempotency_begin`](Self::idempotency_begin) act only while `hold.token` owns the record. A
/// write that takes a `deadline` runs only if the store receives it before then: see
/// [Deadlines](self#deadlines).
pub trait IdempotencyStore: fmt::Debug + Send + Sync + 'static {
    /// How long a call may take before it fails with [`StoreErrorKind::Timeout`]: the
    /// deadline callers give their writes.
    fn timeout(&self) -> Duration;

    /// Looks up idempotency record `hold.key` and, when there is none, claims it for a request with
    /// `fingerprint`, owned by `hold.token`, for `lease` — in one atomic step. A record that
    /// `hold.token` claimed and still runs is claimed again (its lease reset). Received after
    /// `deadline`, it does nothing.
    fn idempotency_begin(
        &self,
        hold: Hold,
        fingerprint: String,
        lease: Duration,
        deadline: Instant,
    ) -> StoreFuture<IdempotencyBegin>;

    /// Stores the encoded `response` in record `hold.key`, kept for `retention`, only while
    /// `hold.token` still owns the claim; `false` (and nothing written) otherwise. A record that
    /// `hold.token` completed with this very `response` already answers `true` again, unchanged.
    /// Received after `deadline`, it does nothing.
    fn idempotency_complete(
        &self,
        hold: Hold,
        response: Bytes,
        retention: Duration,
        deadline: Instant,
    ) -> StoreFuture<bool>;

    /// Deletes record `hold.key` only while `hold.token` still owns its claim and it is not
    /// completed. A call re-sent after a lost reply answers as its first run did.
    fn idempotency_release(&self, hold: Hold) -> StoreFuture<bool>;

    /// Extends the claim on record `hold.key` to `lease` from now, only while `hold.token` owns it
    /// and it is not completed. Received after `deadline`, it does nothing.
    fn idempotency_extend(
        &self,
        hold: Hold,
        lease: Duration,
        deadline: Instant,
    ) -> StoreFuture<bool>;
}

/// Every capability, plus a health check: a store that can back every layer of this crate.
pub trait Store: RateStore + LockStore + IdempotencyStore + PermitStore {
    /// Succeeds when the store answers.
    fn ping(&self) -> StoreFuture<()>;
}

/// The answer to [`IdempotencyStore::idempotency_begin`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum IdempotencyBegin {
    /// The key was new: this request owns it now and should run.
    Claimed,
    /// Another request with the same key and fingerprint is running.
    InFlight {
        /// The running request's remaining lease.
        lease_left: Duration,
    },
    /// The key was used with a different fingerprint.
    Mismatch,
    /// The key's request completed; its encoded response.
    Completed(Bytes),
}

/// The answer to [`LockStore::claim`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClaimOutcome {
    /// Whether this caller's write won.
    pub won: bool,
    /// The holder stored by the winner (this caller's holder when `won`), read in the same
    /// atomic step as the failed write.
    pub holder: String,
    /// Whether the claim this caller lost to is still pending: made with durable writes
    /// (`wait_replicas`) and not yet acknowledged by the replicas, so it may yet be undone — the
    /// name is in progress, not taken. Always `false` on a store without durable writes.
    pub pending: bool,
}

/// The answer to [`LockStore::lock_acquire`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LockAttempt {
    /// The lock is ours; the fencing token of this acquisition.
    Acquired {
        /// Strictly greater than every earlier token of the same lock name.
        fence: u64,
    },
    /// Another owner holds the lock for about this long still.
    Held {
        /// The other owner's remaining lease.
        lease_left: Duration,
    },
}

/// A key held with a random token: what every token-checked operation names. It acts only while
/// `key` still holds `token`, so an owner whose lease ran out can never touch what another owner
/// took over.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Hold {
    /// The store key.
    pub key: String,
    /// The owner's random token.
    pub token: String,
}

impl Hold {
    /// `key` held with `token`.
    pub fn new(key: impl Into<String>, token: impl Into<String>) -> Self {
        Self {
            key: key.into(),
            token: token.into(),
        }
    }
}

/// The answer to [`PermitStore::permit_acquire`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PermitAttempt {
    /// A permit is ours; the fencing token of this acquisition.
    Acquired {
        /// Strictly greater than every earlier token of the same key.
        fence: u64,
    },
    /// No permit is free for this holder: every permit is held, or waiters that arrived
    /// before it take those that are free.
    Full {
        /// The shortest remaining lease among the held permits (zero when none is held).
        next_free: Duration,
        /// How many waiters are ahead of this holder in the key's queue.
        ahead: u32,
    },
}

/// How long a lock name's fencing counter is kept after its last acquisition (part of the store
/// contract: see [`fence_ttl`]). A counter that expires restarts above every earlier token: a
/// store hands out the larger of the counter plus one and its clock in microseconds.
pub const FENCE_TTL: Duration = Duration::from_secs(30 * 86_400);

/// How long a release marker outlives the release it records (part of the store contract):
/// longer than any re-sent command or background retry of that release, which the marker
/// answers as the release did.
pub const RELEASE_MARKER_TTL: Duration = Duration::from_secs(60);

/// The longest expiry a store sets, about 285,000 years: every duration is clamped to it, in
/// every backend alike. Redis refuses expiries near `i64::MAX` milliseconds, and `2^53` stays
/// exact in the scripts' doubles.
pub const MAX_EXPIRY: Duration = Duration::from_millis(1 << 53);

/// A duration as a store keeps it, in milliseconds: at least 1 (0 would mean "no expiry" or be
/// refused), at most [`MAX_EXPIRY`]. Every store clamps alike.
///
/// ```
/// use std::time::Duration;
/// use tollgate::store::millis;
///
/// assert_eq!(millis(Duration::ZERO), 1);
/// assert_eq!(millis(Duration::from_micros(2_500)), 2);
/// assert_eq!(millis(Duration::MAX), 1 << 53);
/// ```
pub fn millis(d: Duration) -> u64 {
    let max = 1u64 << 53;
    u64::try_from(d.as_millis()).unwrap_or(max).clamp(1, max)
}

/// The lifetime a store gives a lock's fencing counter when the lock is taken for `lease`:
/// [`FENCE_TTL`], or twice the lease if longer, so that the counter outlives the lock.
///
/// ```
/// use std::time::Duration;
/// use tollgate::store::{FENCE_TTL, fence_ttl};
///
/// assert_eq!(fence_ttl(Duration::from_secs(30)), FENCE_TTL);
/// let year = Duration::from_secs(365 * 86_400);
/// assert_eq!(fence_ttl(year), year * 2);
/// ```
pub fn fence_ttl(lease: Duration) -> Duration {
    FENCE_TTL.max(lease.saturating_mul(2))
}

impl<T: RateStore + ?Sized> RateStore for Arc<T> {
    fn check_rate(&self, policy: &Arc<RatePolicy>, check: RateCheck) -> StoreFuture<RateOutcome> {
        (**self).check_rate(policy, check)
    }

    fn timeout(&self) -> Duration {
        (**self).timeout()
    }

    fn reset_rate(&self, policy: &Arc<RatePolicy>, key: Key) -> StoreFuture<()> {
        (**self).reset_rate(policy, key)
    }

    fn invalidations(&self) -> Option<Invalidations> {
        (**self).invalidations()
    }
}

impl<T: LockStore + ?Sized> LockStore for Arc<T> {
    fn timeout(&self) -> Duration {
        (**self).timeout()
    }

    fn claim(
        &self,
        key: String,
        holder: String,
        ttl: Option<Duration>,
        deadline: Instant,
    ) -> StoreFuture<ClaimOutcome> {
        (**self).claim(key, holder, ttl, deadline)
    }

    fn lock_acquire(
        &self,
        hold: Hold,
        fence_key: String,
        lease: Duration,
        deadline: Instant,
    ) -> StoreFuture<LockAttempt> {
        (**self).lock_acquire(hold, fence_key, lease, deadline)
    }

    fn extend_if_held(&self, hold: Hold, lease: Duration, deadline: Instant) -> StoreFuture<bool> {
        (**self).extend_if_held(hold, lease, deadline)
    }

    fn delete_if_held(&self, hold: Hold) -> StoreFuture<bool> {
        (**self).delete_if_held(hold)
    }
}

impl<T: PermitStore + ?Sized> PermitStore for Arc<T> {
    fn timeout(&self) -> Duration {
        (**self).timeout()
    }

    fn permit_acquire(
        &self,
        hold: Hold,
        fence_key: String,
        limit: u32,
        lease: Duration,
        wait: Option<Duration>,
        deadline: Instant,
    ) -> StoreFuture<PermitAttempt> {
        (**self).permit_acquire(hold, fence_key, limit, lease, wait, deadline)
    }

    fn permit_extend(&self, hold: Hold, lease: Duration, deadline: Instant) -> StoreFuture<bool> {
        (**self).permit_extend(hold, lease, deadline)
    }

    fn permit_release(&self, hold: Hold) -> StoreFuture<bool> {
        (**self).permit_release(hold)
    }
}

impl<T: IdempotencyStore + ?Sized> IdempotencyStore for Arc<T> {
    fn timeout(&self) -> Duration {
        (**self).timeout()
    }

    fn idempotency_begin(
        &self,
        hold: Hold,
        fingerprint: String,
        lease: Duration,
        deadline: Instant,
    ) -> StoreFuture<IdempotencyBegin> {
        (**self).idempotency_begin(hold, fingerprint, lease, deadline)
    }

    fn idempotency_complete(
        &self,
        hold: Hold,
        response: Bytes,
        retention: Duration,
        deadline: Instant,
    ) -> StoreFuture<bool> {
        (**self).idempotency_complete(hold, response, retention, deadline)
    }

    fn idempotency_release(&self, hold: Hold) -> StoreFuture<bool> {
        (**self).idempotency_release(hold)
    }

    fn idempotency_extend(
        &self,
        hold: Hold,
        lease: Duration,
        deadline: Instant,
    ) -> StoreFuture<bool> {
        (**self).idempotency_extend(hold, lease, deadline)
    }
}

impl<T: Store + ?Sized> Store for Arc<T> {
    fn ping(&self) -> StoreFuture<()> {
        (**self).ping()
    }
}
