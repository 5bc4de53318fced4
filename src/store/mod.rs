//! Where shared state lives: the store capabilities, and the backends that provide them.
//!
//! Every operation is one round trip and atomic on the server: one Lua script, one conditional
//! command or one PL/pgSQL function call (a read that changes nothing: one `SELECT`), never a
//! read-modify-write across round trips. Time
//! comes from the store (`TIME` inside the scripts, `clock_timestamp()` in the functions), so
//! clock skew between copies of a service cannot change a decision.
//!
//! The operations come in four capabilities, one trait each, so that a backend or a wrapper
//! implements what it serves and a layer asks only for what it uses:
//!
//! | trait | operations | used by |
//! | --- | --- | --- |
//! | [`RateStore`] | [`check_rate`](RateStore::check_rate) | rate limits |
//! | [`LockStore`] | claims, lock acquisition, token-checked extend and delete; a lock's state | claims and locks |
//! | [`IdempotencyStore`] | begin, complete, release and extend a record; its state | idempotency keys |
//! | [`PermitStore`] | acquire, extend and release one of N permits; the permits in use and waiters | concurrency limits |
//!
//! The reads ([`lock_state`](LockStore::lock_state), [`permit_usage`](PermitStore::permit_usage),
//! [`idempotency_state`](IdempotencyStore::idempotency_state)) change nothing: they serve tools
//! that show an operator what a service keeps, on the keys [`keys`] names. A backend written
//! before them keeps the traits' defaults, which fail with [`StoreErrorKind::Unsupported`].
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
//! A connection string may hold a password: the builders' `Debug` shows it through
//! [`redact_connection_string`], which an application's own logs and errors can call as well,
//! and no error of the crate repeats it.
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
//! store timeout from when they were made): one that arrives late charges nothing. So does a
//! reset on Redis and PostgreSQL: one that timed out (`tollgate reset` exiting 2) has run by its
//! deadline or never will, and cannot land later to erase what the caller was charged since.
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
//! store's timeout, whatever else charged the caller in between; a [reservation](crate::rate::RateCheck::reservation)
//! also keeps where its charge went, so that its [settlement](crate::rate::RateCheck::settle) refunds only
//! what the limit still counts and never quota that others spent. One reference model,
//! [`conformance::model`], defines every answer, and each store is held against it
//! ([`conformance::property`]). The rules in depth:
//! [`guide::ledger`](crate::guide::ledger).
//!
//! | store | an attempt is remembered | a re-send | a late first send | a settlement after the window rolled | a settlement after a reset | a re-sent settlement |
//! | --- | --- | --- | --- | --- | --- | --- |
//! | [`MemoryStore`] | 3 s after its decision (the deadline of a 1 s timeout, plus twice that) | admitted, charged nothing | — (its calls are never late) | refunds only what the limit still counts | refunds nothing | applied once |
//! | [`RedisStore`] (standalone, Sentinel, Cluster; Redis or Valkey) | its call's deadline + 2 × timeout (a record per call; the copy that re-sends names every call of the attempt whose record may live, so a send that arrived late and left none hides no earlier charge) | admitted, charged nothing | refused ([`Timeout`](StoreErrorKind::Timeout)), nothing changed | refunds only what the limit still counts | refunds nothing | applied once |
//! | [`PgStore`] | its deadline + 2 × timeout (a row per attempt) | admitted, charged nothing | refused ([`Timeout`](StoreErrorKind::Timeout)), nothing changed | refunds only what the limit still counts | refunds nothing | applied once |
//!
//! A settlement of a plain check ([`RateCheck::new`](crate::rate::RateCheck::new)) refunds nothing: only a reservation's
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
//! served for at most a second. A change of a layer's [limits in force](LimitsStore) is
//! broadcast the same way ([`Invalidation::Limits`]; the payload `limits` in place of a caller),
//! and every copy of the layer reads them again at once; when it is lost, within its refresh.
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
//! publish is one command sent after the answer, which never waits for it. A settlement of a
//! [quiet](crate::rate::RateCheck::quiet) reservation (a leased slice given back) is never
//! published: a leased tier's layer takes every word it hears as a reset.
//!
//! # Lines
//!
//! Requests that wait for room ([`queue`](crate::rate_limit::RateLimitLayerBuilder::queue),
//! every [outbound limit](crate::outbound)) wait in their copy's line of their caller, and the
//! first of each copy's line stands in the caller's line in the store
//! ([`RateStore::line_up`]): the copies' waiters ask for room in the order they began to wait,
//! rather than racing for each moment of room. A waiter that has someone ahead of it does not
//! ask for room; it lines up again when the store said room comes, and asks once nobody stands
//! ahead — or once a look at the limits (a check of cost 0) shows room for every waiter ahead
//! and for it, so that a burst of room is not served one copy at a time. Admitted, it leaves
//! the line, and its copy's next waiter lines up at the end: copies that all wait take turns,
//! whatever their numbers of requests. A waiter keeps its place for
//! the time until its room plus twice the store's timeout; a copy that stops (or a line-up lost
//! on the way) holds the others back at most that long. A check's admission is the limits'
//! alone: a line orders the asking, never the answer, and a request that finds nobody of its
//! copy waiting asks at once.
//!
//! | store | a line | a line-up | leaving |
//! | --- | --- | --- | --- |
//! | [`MemoryStore`] | an entry of waiters in arrival order, each with the end of its place | drops the lapsed places, keeps or appends the waiter | removes it |
//! | [`RedisStore`] | two sorted sets beside the caller's keys (`<line key>` by arrival, `<line key>:lapse` by the end of each place), kept as long as the last place | `line.lua`: one script, with the call's deadline | `line.lua` with no keep |
//! | [`PgStore`] | rows of `permit_queue` under the line key, purged with it | `line_up()`, with the call's deadline | `leave_line()` |
//!
//! [`PgStore`]: https://docs.rs/tollgate/latest/tollgate/store/struct.PgStore.html
//! [`conformance::model`]: https://docs.rs/tollgate/latest/tollgate/conformance/model/index.html
//! [`conformance::property`]: https://docs.rs/tollgate/latest/tollgate/conformance/property/index.html

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

#[cfg(any(feature = "redis", feature = "postgres"))]
pub(crate) mod coalesce;
#[cfg(any(feature = "redis", feature = "postgres"))]
pub(crate) mod deadline;
mod error;
mod idempotency_store;
mod invalidation;
pub mod keys;
#[cfg(any(feature = "redis", feature = "postgres"))]
mod kit;
mod limits_store;
mod lock_store;
mod memory;
mod permit_store;
#[cfg(feature = "postgres")]
mod postgres;
mod rate_store;
mod redact;
#[cfg(feature = "redis")]
mod redis;
mod response;
#[cfg(any(feature = "redis", feature = "postgres"))]
mod span;
mod transaction;

#[cfg(any(feature = "redis", feature = "postgres"))]
pub(crate) use deadline::StoreClock;
pub use error::{StoreError, StoreErrorKind};
pub use idempotency_store::{
    BeginRequest, CompleteRequest, IdempotencyBegin, IdempotencyState, IdempotencyStore,
};
#[cfg(any(feature = "redis", feature = "postgres"))]
pub(crate) use invalidation::publishing_refunds;
pub use invalidation::{Invalidation, Invalidations};
pub use limits_store::{CopySeen, HISTORY_KEPT, LimitsStore, NOTE_MAX, Saved};
pub use lock_store::{ClaimOutcome, ClaimRequest, LockAttempt, LockRequest, LockState, LockStore};
pub use memory::MemoryStore;
pub use permit_store::{PermitAttempt, PermitRequest, PermitStore, PermitUsage};
#[cfg(feature = "postgres")]
pub use postgres::{Once, OnceError, OnceTx, PgStore, PgStoreBuilder};
pub use rate_store::RateStore;
#[cfg(any(feature = "redis", feature = "postgres"))]
pub(crate) use redact::Redacted;
pub use redact::redact_connection_string;
#[cfg(feature = "redis")]
pub(crate) use redact::redacted_list;
#[cfg(feature = "redis")]
pub use redis::{RedisClusterBuilder, RedisSentinelBuilder, RedisStore, RedisStoreBuilder};
pub(crate) use response::StoredResponse;
pub use transaction::{CommitError, Run, RunBegun, RunFuture, RunStart, TransactionStore};

/// The future a store operation returns: owned, `Send`, and bounded by the store's timeout.
pub type StoreFuture<T> = Pin<Box<dyn Future<Output = Result<T, StoreError>> + Send + 'static>>;

/// Every capability, plus a health check: a store that can back every layer of this crate.
pub trait Store: RateStore + LockStore + IdempotencyStore + PermitStore {
    /// Succeeds when the store answers.
    fn ping(&self) -> StoreFuture<()>;
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

impl<T: Store + ?Sized> Store for Arc<T> {
    fn ping(&self) -> StoreFuture<()> {
        (**self).ping()
    }
}
