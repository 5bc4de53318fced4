//! [`RedisStore`]: Redis or Valkey through redis-rs, standalone or Cluster.

use std::fmt;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use redis::{ErrorKind, FromRedisValue, RedisError, Script, Value};
use tokio::time::Instant;

mod builder;
mod clock;
mod connection;
mod durable;
mod idempotency;
mod invalidation;
mod library;
mod limits;
mod lock;
mod permit;
mod rate;
mod rates;
mod script_call;
mod sent;
mod url;

use builder::Settings;
pub use builder::{RedisClusterBuilder, RedisSentinelBuilder, RedisStoreBuilder};
use clock::store_deadline;
use connection::{Connection, Link};
use durable::{Ack, DurableWrites};
use invalidation::Listening;
use rates::{Rates, bounded, rates};
use script_call::ScriptCall;

use super::{
    RELEASE_MARKER_TTL, Store, StoreClock, StoreError, StoreErrorKind, StoreFuture, kit, millis,
};
use crate::error::ConfigError;
use crate::keyspace;
use crate::store::span::{self, Call, Command, System};

/// A store on Redis or Valkey, shared by every copy of a service.
///
/// Cheap to clone: clones share one multiplexed connection that reconnects by itself. Every call
/// is bounded by the store timeout (default 250 ms) — while Redis is down a call fails with
/// [`StoreErrorKind::Timeout`] or [`StoreErrorKind::Unavailable`] instead of waiting for
/// reconnects, and the calling layer applies its failure policy.
///
/// Each operation is one Lua script (sent by `EVALSHA`, loaded again after a restart or
/// `SCRIPT FLUSH`) or one conditional command. Rate checks, the hot path, call the script as a
/// function of a library the server keeps (`FCALL`, Redis 7 and later, Valkey), which makes its
/// helpers once instead of at every call; a server without functions, or a user it does not let
/// load or call them, gets the script. Scripts read the time with `TIME`, and every key one
/// script touches shares a hash tag, so the same scripts run on Redis Cluster.
///
/// Rate checks are coalesced: checks that wait for Redis at the same moment go out as one call
/// that decides them in turn, each exactly as alone (see
/// [`max_batch`](RedisStoreBuilder::max_batch)). With light load a check goes out at once.
///
/// Three ways to reach Redis: [`builder`](Self::builder) (standalone),
/// [`cluster_builder`](Self::cluster_builder) (Cluster) and
/// [`sentinel_builder`](Self::sentinel_builder) (a primary behind Sentinel, followed through
/// failovers). Each can ask for durable writes with `wait_replicas(n)`: claims, locks and
/// idempotency records then count only once `n` replicas acknowledged them.
///
/// ```no_run
/// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
/// use std::time::Duration;
/// use tollgate::store::RedisStore;
///
/// let store = RedisStore::builder("redis://127.0.0.1:6379/")
///     .timeout(Duration::from_millis(100))
///     .build()?;
/// let behind_sentinel = RedisStore::sentinel_builder(
///     ["redis://10.0.0.1:26379/", "redis://10.0.0.2:26379/", "redis://10.0.0.3:26379/"],
///     "mymaster",
/// )
/// .wait_replicas(1)
/// .connect()
/// .await?;
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct RedisStore {
    link: Arc<Link>,
    /// With durable writes: the replicas that must acknowledge, and their connections.
    durable: Option<Arc<DurableWrites>>,
    timeout: Duration,
    scripts: Arc<Scripts>,
    /// Rate checks, coalesced on the store's connection.
    rates: Arc<Rates>,
    /// What the store's clock reads at least: deadlines are sent on it.
    clock: Arc<StoreClock>,
    /// Hears the resets and refunds of every copy, for the layers on this store.
    subscriber: Arc<Listening>,
}

/// The token-checked release that undoes a durable write nobody acknowledged.
struct Undo {
    script: fn(&Scripts) -> &Lua,
    call: ScriptCall,
}

/// What a write script's reply says it did, for durable writes.
struct Effect<R> {
    /// A success that counts only once replicas acknowledged it (a claim won, a record
    /// stored); other answers (lost, held, in flight) wrote nothing that must be acknowledged.
    counts: fn(&R) -> bool,
    /// What this very call made, and an unacknowledged failure undoes; a re-run of a write
    /// made before is not undone (it may have been acknowledged and told).
    made: fn(&R) -> bool,
}

// two function pointers: copied, whatever `R` is
impl<R> Clone for Effect<R> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<R> Copy for Effect<R> {}

/// The pending marker of a durable write, dropped once replicas acknowledged it.
struct Pending {
    marker: String,
    holder: String,
}

impl fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisStore")
            .field("kind", &self.link.kind())
            .field("timeout", &self.timeout)
            .finish_non_exhaustive()
    }
}

/// A Lua script, its source and its name (its file's, as spans name it): calls send its hash
/// (`EVALSHA`), durable writes its source.
struct Lua {
    script: Script,
    source: &'static str,
    name: &'static str,
}

impl Lua {
    fn new(name: &'static str, source: &'static str) -> Self {
        Self {
            script: Script::new(source),
            source,
            name,
        }
    }
}

/// Loads `src/store/redis/scripts/<name>.lua` as a [`Lua`] named `<name>`.
macro_rules! lua {
    ($name:literal) => {
        Lua::new($name, include_str!(concat!("scripts/", $name, ".lua")))
    };
}
use lua;

impl std::ops::Deref for Lua {
    type Target = Script;

    fn deref(&self) -> &Script {
        &self.script
    }
}

struct Scripts {
    claim: Lua,
    lock_acquire: Lua,
    compare_and_pexpire: Lua,
    compare_and_delete: Lua,
    idem_begin: Lua,
    idem_complete: Lua,
    idem_release: Lua,
    idem_extend: Lua,
    permit_acquire: Lua,
    permit_extend: Lua,
    permit_release: Lua,
    confirm: Lua,
    reset: Lua,
    line: Lua,
    lock_state: Lua,
    permit_usage: Lua,
    idem_state: Lua,
    limits_save: Lua,
    limits_load: Lua,
    limits_copies: Lua,
}

impl Scripts {
    fn new() -> Self {
        Self {
            claim: lua!("claim"),
            lock_acquire: lua!("lock_acquire"),
            compare_and_pexpire: lua!("compare_and_pexpire"),
            compare_and_delete: lua!("compare_and_delete"),
            idem_begin: lua!("idem_begin"),
            idem_complete: lua!("idem_complete"),
            idem_release: lua!("idem_release"),
            idem_extend: lua!("idem_extend"),
            permit_acquire: lua!("permit_acquire"),
            permit_extend: lua!("permit_extend"),
            permit_release: lua!("permit_release"),
            confirm: lua!("confirm"),
            reset: lua!("reset"),
            line: lua!("line"),
            lock_state: lua!("lock_state"),
            permit_usage: lua!("permit_usage"),
            idem_state: lua!("idem_state"),
            limits_save: lua!("limits_save"),
            limits_load: lua!("limits_load"),
            limits_copies: lua!("limits_copies"),
        }
    }
}

impl RedisStore {
    /// A builder for a standalone Redis at `url`, e.g. `redis://127.0.0.1:6379/`.
    pub fn builder(url: impl Into<String>) -> RedisStoreBuilder {
        RedisStoreBuilder::new(url.into())
    }

    /// A builder for a Redis Cluster reached through any of `nodes` (`redis://host:port` each).
    pub fn cluster_builder<I, S>(nodes: I) -> RedisClusterBuilder
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        RedisClusterBuilder::new(nodes.into_iter().map(Into::into).collect())
    }

    /// A builder for a Redis behind Sentinel: the sentinels at `sentinels` (`redis://host:port/`
    /// each) name the primary of `master`, and the store follows it through failovers.
    pub fn sentinel_builder<I, S>(sentinels: I, master: impl Into<String>) -> RedisSentinelBuilder
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        RedisSentinelBuilder::new(
            sentinels.into_iter().map(Into::into).collect(),
            master.into(),
        )
    }

    /// A store on a connection the application made already, bounded by `timeout` per call: a
    /// redis-rs `ConnectionManager` (it reconnects by itself). The store cannot replace a given
    /// connection that goes dark; durable writes (`wait_replicas`) need a builder, which opens
    /// their connection of its own.
    ///
    /// ```no_run
    /// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
    /// use std::time::Duration;
    /// use tollgate::store::RedisStore;
    ///
    /// let client = redis::Client::open("redis://127.0.0.1:6379/")?;
    /// let manager = redis::aio::ConnectionManager::new(client).await?;
    /// let store = RedisStore::from_connection_manager(manager, Duration::from_millis(250));
    /// # Ok(()) }
    /// ```
    pub fn from_connection_manager(
        manager: redis::aio::ConnectionManager,
        timeout: Duration,
    ) -> Self {
        let link = Link::new(Connection::Single(manager), connection::Opener::Given);
        Self::new(link, None, Settings::given(timeout))
    }

    /// A store on a Redis Cluster connection the application made already, bounded by
    /// `timeout` per call. As with [`from_connection_manager`](Self::from_connection_manager),
    /// the store cannot replace it.
    pub fn from_cluster_connection(
        conn: redis::cluster_async::ClusterConnection,
        timeout: Duration,
    ) -> Self {
        let link = Link::new(Connection::Cluster(conn), connection::Opener::Given);
        Self::new(link, None, Settings::given(timeout))
    }

    /// A store on any redis-rs connection the application made that can be cloned — a pool's
    /// connection handle, a wrapper that counts or traces calls — bounded by `timeout` per call.
    /// Clones must share one connection or pool: the store clones it for every call. It is
    /// treated as a standalone Redis (for Cluster, use
    /// [`from_cluster_connection`](Self::from_cluster_connection)); as with the other given
    /// connections, the store cannot replace it when it goes dark.
    ///
    /// ```no_run
    /// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
    /// use std::time::Duration;
    /// use tollgate::store::RedisStore;
    ///
    /// let client = redis::Client::open("redis://127.0.0.1:6379/")?;
    /// let conn = client.get_multiplexed_async_connection().await?;
    /// let store = RedisStore::from_connection(conn, Duration::from_millis(250));
    /// # Ok(()) }
    /// ```
    pub fn from_connection<C>(conn: C, timeout: Duration) -> Self
    where
        C: redis::aio::ConnectionLike + Clone + Send + Sync + 'static,
    {
        let link = Link::new(Connection::Other(Box::new(conn)), connection::Opener::Given);
        Self::new(link, None, Settings::given(timeout))
    }

    /// A store on a standalone Redis at `url` with default settings. Connects lazily: this fails
    /// only when the URL is invalid, never because Redis is down.
    pub fn open(url: impl Into<String>) -> Result<Self, ConfigError> {
        Self::builder(url).build()
    }

    fn new(link: Link, durable: Option<(Ack, Vec<Link>)>, settings: Settings) -> Self {
        let link = Arc::new(link);
        let clock = Arc::new(StoreClock::default());
        let rates = rates(
            Arc::clone(&link),
            Arc::clone(&clock),
            settings.timeout,
            settings.max_batch,
        );
        Self {
            subscriber: Arc::new(Listening::new(link.opener(), settings.timeout)),
            link,
            durable: durable.map(|(ack, links)| Arc::new(DurableWrites::new(links, ack))),
            timeout: settings.timeout,
            scripts: Arc::new(Scripts::new()),
            rates: Arc::new(rates),
            clock,
        }
    }

    /// The same store with at most `checks` rate checks per call to Redis (see
    /// [`RedisStoreBuilder::max_batch`]); for a store on a given connection.
    #[must_use]
    pub fn with_max_batch(self, checks: usize) -> Self {
        let rates = rates(
            Arc::clone(&self.link),
            Arc::clone(&self.clock),
            self.timeout,
            checks,
        );
        Self {
            rates: Arc::new(rates),
            ..self
        }
    }

    /// How many replicas must acknowledge a claim, lock or idempotency write (0: none).
    pub fn wait_replicas(&self) -> u32 {
        self.durable.as_ref().map_or(0, |d| d.ack().replica_count())
    }

    /// Runs a write script — a claim, a lock acquisition or extension, an idempotency claim or
    /// record — with `deadline` (on the store's clock) as its last argument: received later, it
    /// does nothing. With durable writes it goes out in the next group of durable writes,
    /// acknowledged by one `WAIT` (see `durable.rs`): when its reply is a success that counts
    /// only once acknowledged and too few replicas acknowledged it, the answer is a store
    /// failure, and what this very call made is undone first; once they have, its `pending`
    /// marker is dropped.
    #[allow(clippy::too_many_arguments)]
    fn write<T, R>(
        &self,
        operation: &'static str,
        script: fn(&Scripts) -> &Lua,
        call: ScriptCall,
        deadline: Instant,
        effect: Effect<R>,
        decode: fn(R) -> Result<T, StoreError>,
        undo: Option<Undo>,
        pending: Option<Pending>,
    ) -> StoreFuture<T>
    where
        T: Send + 'static,
        R: FromRedisValue + Send + 'static,
    {
        let clock = Arc::clone(&self.clock);
        let link = Arc::clone(&self.link);
        let deadline = deadline.min(Instant::now() + self.timeout);
        let Some(durable) = self.durable.clone() else {
            let trip = redis_call(operation, Command::Evalsha, script(&self.scripts).name);
            return self.call(trip, move |mut conn, scripts| async move {
                let at = store_deadline(&clock, &link, &mut conn, deadline).await?;
                let reply: Value = call
                    .arg(at)
                    .invoke(script(&scripts), &mut conn)
                    .await
                    .map_err(store_error)?;
                decode(unexpired(reply)?)
            });
        };
        let (mut conn, scripts) = (self.link.get(), Arc::clone(&self.scripts));
        // timed, but not watched as the store's connection: a slow `WAIT` is the replicas', and
        // the durable connections watch themselves
        let timeout = self.timeout;
        measured(operation, timeout, async move {
            let at = store_deadline(&clock, &link, &mut conn, deadline).await?;
            let source = script(&scripts).source;
            let (reply, short) = durable.write(source, call.arg(at), deadline).await?;
            let reply: R = unexpired(reply)?;
            if let Some(short) = short.filter(|_| (effect.counts)(&reply)) {
                // undone before the failure is told: the write ran (its reply is here), so the
                // undo cannot overtake it, on any connection
                if let Some(undo) = undo.filter(|_| (effect.made)(&reply)) {
                    let undone: Result<i64, _> =
                        undo.call.invoke((undo.script)(&scripts), &mut conn).await;
                    if let Err(error) = undone {
                        tracing::warn!(target: "tollgate::store", %error, "could not undo an unacknowledged write");
                    }
                }
                return Err(short);
            }
            if let Some(pending) = pending {
                confirm_in_background(&scripts, conn, pending);
            }
            decode(reply)
        })
    }

    /// The lifetime of the pending marker of a durable write (0: writes are not durable): it
    /// outlives the write's `WAIT`, so that nobody takes a write still waiting to be confirmed.
    fn pending_ms(&self) -> u64 {
        if self.durable.is_some() {
            millis(self.timeout) * 2
        } else {
            0
        }
    }

    /// The token-checked release that undoes a write of `key` by `token`.
    fn release_of(key: &str, token: &str, script: fn(&Scripts) -> &Lua) -> Undo {
        Undo {
            script,
            call: release_call(key, token),
        }
    }

    /// The per-call timeout.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// Runs a token-checked release or extension (no `WAIT`: neither must reach a replica
    /// before it counts); whether the key held the token.
    fn token_checked(
        &self,
        operation: &'static str,
        script: fn(&Scripts) -> &Lua,
        call: ScriptCall,
    ) -> StoreFuture<bool> {
        let trip = redis_call(operation, Command::Evalsha, script(&self.scripts).name);
        self.call(trip, move |mut conn, scripts| async move {
            let held: i64 = call
                .invoke(script(&scripts), &mut conn)
                .await
                .map_err(store_error)?;
            Ok(held == 1)
        })
    }

    /// Runs `op`, the round trip `call` describes, on the store's connection within the store
    /// timeout.
    fn call<T, F, Fut>(&self, call: Call<'static>, op: F) -> StoreFuture<T>
    where
        T: Send + 'static,
        F: FnOnce(Connection, Arc<Scripts>) -> Fut + Send + 'static,
        Fut: Future<Output = Result<T, StoreError>> + Send + 'static,
    {
        self.call_on(call, &self.link, op)
    }

    /// Runs `op`, the round trip `call` describes, on `link`'s connection within the store
    /// timeout, in its span, and tells the link's watch whether a reply came.
    fn call_on<T, F, Fut>(&self, call: Call<'static>, link: &Arc<Link>, op: F) -> StoreFuture<T>
    where
        T: Send + 'static,
        F: FnOnce(Connection, Arc<Scripts>) -> Fut + Send + 'static,
        Fut: Future<Output = Result<T, StoreError>> + Send + 'static,
    {
        let link = Arc::clone(link);
        let conn = link.get();
        let scripts = Arc::clone(&self.scripts);
        let timeout = self.timeout;
        Box::pin(async move { bounded(&call, 1, &link, timeout, op(conn, scripts)).await })
    }
}

/// Runs `op`, store operation `operation`, within `timeout`, and tells the metrics how long it
/// took and how it failed.
fn measured<T: Send + 'static>(
    operation: &'static str,
    timeout: Duration,
    op: impl Future<Output = Result<T, StoreError>> + Send + 'static,
) -> StoreFuture<T> {
    Box::pin(kit::timed(operation, timeout, op))
}

/// Drops the pending marker of an acknowledged write, on `conn`, in the background: the caller
/// need not wait (a marker left behind expires on its own).
fn confirm_in_background(scripts: &Arc<Scripts>, mut conn: Connection, pending: Pending) {
    let scripts = Arc::clone(scripts);
    tokio::spawn(async move {
        let call = ScriptCall::default()
            .key(pending.marker)
            .arg(pending.holder);
        let confirmed: Result<i64, _> = call.invoke(&scripts.confirm, &mut conn).await;
        if let Err(error) = confirmed {
            tracing::debug!(target: "tollgate::store", %error, "could not drop a pending marker; it expires");
        }
    });
}

/// The arguments of a token-checked release (`compare_and_delete.lua`, `idem_release.lua`):
/// the key, its release marker, the token, the marker's lifetime and a random id of this call,
/// so that the call re-sent answers as it did.
fn release_call(key: &str, token: &str) -> ScriptCall {
    ScriptCall::default()
        .key(key)
        .key(keyspace::release_marker(key))
        .arg(token)
        .arg(millis(RELEASE_MARKER_TTL))
        .arg(kit::release_call_id())
}

/// The arguments of a token-checked extension (`compare_and_pexpire.lua`, `idem_extend.lua`):
/// the key, the token and the new lease.
fn extend_call(key: String, token: String, lease: Duration) -> ScriptCall {
    ScriptCall::default().key(key).arg(token).arg(millis(lease))
}

/// A call to Redis of store operation `operation`, sending `command` (of script `script`), as
/// its span describes it.
fn redis_call(operation: &'static str, command: Command, script: &'static str) -> Call<'static> {
    Call {
        system: System::Redis,
        command,
        target: script,
        operation,
    }
}

/// A time left as a read script answers it, in milliseconds: `-1` (no expiry) as
/// [`MAX_EXPIRY`](crate::store::MAX_EXPIRY), `-2` (gone) and below as zero.
fn left_ms(ms: i64) -> Duration {
    match ms {
        -1 => crate::store::MAX_EXPIRY,
        ms => Duration::from_millis(u64::try_from(ms).unwrap_or(0)),
    }
}

/// The error code Redis answered for `error` (`NOSCRIPT`, `MOVED`, `READONLY`, ...), if it did.
fn status_code(error: &StoreError) -> Option<&str> {
    span::cause::<RedisError>(error).and_then(RedisError::code)
}

pub(super) fn store_error(e: RedisError) -> StoreError {
    let text = e.to_string();
    let kind = if e.kind() == ErrorKind::AuthenticationFailed
        || ["refused to switch database", "WRONGPASS", "NOAUTH"]
            .iter()
            .any(|refusal| text.contains(refusal))
    {
        // a wrong password or database: retrying will not help, the configuration must change
        StoreErrorKind::Config
    } else if e.is_timeout() {
        StoreErrorKind::Timeout
    } else if e.is_io_error()
        || e.is_connection_dropped()
        || e.is_connection_refusal()
        || e.is_cluster_error()
        // a primary demoted to a replica: the write did not happen, the store is elsewhere now
        || e.code() == Some("READONLY")
        || text.contains("READONLY")
    {
        StoreErrorKind::Unavailable
    } else {
        StoreErrorKind::Protocol
    };
    StoreError::new(kind, e)
}

/// A write script's reply, unless it is `-1`: received after its deadline, the script did
/// nothing.
fn unexpired<R: FromRedisValue>(reply: Value) -> Result<R, StoreError> {
    if reply == Value::Int(-1) {
        return Err(StoreError::expired());
    }
    R::from_redis_value(reply).map_err(|e| StoreError::new(StoreErrorKind::Protocol, e))
}

impl Store for RedisStore {
    fn ping(&self) -> StoreFuture<()> {
        self.call(
            redis_call("ping", Command::Ping, ""),
            |mut conn, _| async move {
                redis::cmd("PING")
                    .query_async::<String>(&mut conn)
                    .await
                    .map(drop)
                    .map_err(store_error)
            },
        )
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;
    use crate::fuzz::{check, redis_reply};

    /// Reads `reply` as a write script's answer of type `R`: a value, an expired write, or a
    /// protocol error.
    fn read<R: FromRedisValue>(reply: &Value) -> Result<(), TestCaseError> {
        match unexpired::<R>(reply.clone()) {
            Ok(_) => prop_assert_ne!(reply, &Value::Int(-1)),
            Err(e) if *reply == Value::Int(-1) => {
                prop_assert_eq!(e.kind(), StoreErrorKind::Timeout);
            }
            Err(e) => prop_assert_eq!(e.kind(), StoreErrorKind::Protocol),
        }
        Ok(())
    }

    #[test]
    fn any_write_reply_is_read_as_each_answer_type_or_refused() {
        check(512, redis_reply(), |reply| {
            // the types the write scripts' answers are read as
            read::<i64>(&reply)?;
            read::<(i64, i64)>(&reply)?;
            read::<(i64, Option<String>)>(&reply)?;
            read::<Vec<i64>>(&reply)?;
            read::<Vec<Value>>(&reply)?;
            Ok(())
        });
    }

    #[test]
    fn a_time_left_is_read_as_written_and_a_negative_one_as_none_left() {
        check(512, crate::fuzz::hostile_i64(), |ms| {
            let left = left_ms(ms);
            match ms {
                -1 => prop_assert_eq!(left, crate::store::MAX_EXPIRY),
                ms if ms < 0 => prop_assert_eq!(left, Duration::ZERO),
                ms => prop_assert_eq!(left.as_millis(), u128::from(ms.unsigned_abs())),
            }
            Ok(())
        });
    }
}
