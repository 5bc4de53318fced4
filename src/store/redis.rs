//! [`RedisStore`]: Redis or Valkey through redis-rs, standalone or Cluster.

use std::fmt;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;

use redis::aio::{ConnectionLike, ConnectionManager, ConnectionManagerConfig};
use redis::cluster_async::ClusterConnection;
use redis::{Cmd, Pipeline, RedisError, RedisFuture, Script, Value};

use super::{
    ClaimOutcome, IdempotencyBegin, IdempotencyStore, LockAttempt, LockStore, RELEASE_MARKER_TTL,
    RateStore, Store, StoreError, StoreErrorKind, StoreFuture, fence_ttl, millis,
};
use crate::error::{ConfigError, ConfigErrorKind};
use crate::keys;
use crate::rate::{Algorithm, LimitState, RateCheck, RateOutcome, RatePolicy};

/// A store on Redis or Valkey, shared by every copy of a service.
///
/// Cheap to clone: clones share one multiplexed connection that reconnects by itself. Every call
/// is bounded by the store timeout (default 250 ms) — while Redis is down a call fails with
/// [`StoreErrorKind::Timeout`] or [`StoreErrorKind::Unavailable`] instead of waiting for
/// reconnects, and the calling layer applies its failure policy.
///
/// Each operation is one Lua script (sent by `EVALSHA`, loaded again after a restart or
/// `SCRIPT FLUSH`) or one conditional command. Scripts read the time with `TIME`, and every key
/// one script touches shares a hash tag, so the same scripts run on Redis Cluster.
///
/// ```no_run
/// # fn main() -> Result<(), Box<dyn std::error::Error>> {
/// use std::time::Duration;
/// use tollgate::store::RedisStore;
///
/// let store = RedisStore::builder("redis://127.0.0.1:6379/")
///     .timeout(Duration::from_millis(100))
///     .build()?;
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct RedisStore {
    conn: Connection,
    timeout: Duration,
    scripts: Arc<Scripts>,
}

impl fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let kind = match self.conn {
            Connection::Single(_) => "standalone",
            Connection::Cluster(_) => "cluster",
        };
        f.debug_struct("RedisStore")
            .field("kind", &kind)
            .field("timeout", &self.timeout)
            .finish_non_exhaustive()
    }
}

/// Either connection kind, so that one code path serves standalone and Cluster.
#[derive(Clone)]
enum Connection {
    Single(ConnectionManager),
    Cluster(ClusterConnection),
}

impl ConnectionLike for Connection {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        match self {
            Self::Single(c) => c.req_packed_command(cmd),
            Self::Cluster(c) => c.req_packed_command(cmd),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        match self {
            Self::Single(c) => c.req_packed_commands(pipeline, offset, count),
            Self::Cluster(c) => c.req_packed_commands(pipeline, offset, count),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            Self::Single(c) => c.get_db(),
            Self::Cluster(c) => c.get_db(),
        }
    }
}

struct Scripts {
    sliding_log: Script,
    sliding_counter: Script,
    gcra: Script,
    claim: Script,
    lock_acquire: Script,
    compare_and_pexpire: Script,
    compare_and_delete: Script,
    idem_begin: Script,
    idem_complete: Script,
    idem_release: Script,
    idem_extend: Script,
}

impl Scripts {
    fn new() -> Self {
        Self {
            sliding_log: Script::new(include_str!("scripts/sliding_log.lua")),
            sliding_counter: Script::new(include_str!("scripts/sliding_counter.lua")),
            gcra: Script::new(include_str!("scripts/gcra.lua")),
            claim: Script::new(include_str!("scripts/claim.lua")),
            lock_acquire: Script::new(include_str!("scripts/lock_acquire.lua")),
            compare_and_pexpire: Script::new(include_str!("scripts/compare_and_pexpire.lua")),
            compare_and_delete: Script::new(include_str!("scripts/compare_and_delete.lua")),
            idem_begin: Script::new(include_str!("scripts/idem_begin.lua")),
            idem_complete: Script::new(include_str!("scripts/idem_complete.lua")),
            idem_release: Script::new(include_str!("scripts/idem_release.lua")),
            idem_extend: Script::new(include_str!("scripts/idem_extend.lua")),
        }
    }
}

/// Configures a [`RedisStore`] on a standalone Redis; made by [`RedisStore::builder`].
#[derive(Debug, Clone)]
pub struct RedisStoreBuilder {
    url: String,
    timeout: Duration,
}

/// Configures a [`RedisStore`] on a Redis Cluster; made by [`RedisStore::cluster_builder`].
///
/// A cluster store connects when it is built, as it reads the slot map:
/// [`connect`](Self::connect) is async and needs the cluster to answer.
#[derive(Debug, Clone)]
pub struct RedisClusterBuilder {
    nodes: Vec<String>,
    timeout: Duration,
}

/// What a token-checked script does to a key that holds the token.
#[derive(Debug, Clone, Copy)]
enum TokenOp {
    Extend(Duration),
    Release,
}

/// The default bound on every store call.
const DEFAULT_TIMEOUT: Duration = Duration::from_millis(250);

impl RedisStore {
    /// A builder for a standalone Redis at `url`, e.g. `redis://127.0.0.1:6379/`.
    pub fn builder(url: impl Into<String>) -> RedisStoreBuilder {
        RedisStoreBuilder {
            url: url.into(),
            timeout: DEFAULT_TIMEOUT,
        }
    }

    /// A builder for a Redis Cluster reached through any of `nodes` (`redis://host:port` each).
    pub fn cluster_builder<I, S>(nodes: I) -> RedisClusterBuilder
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        RedisClusterBuilder {
            nodes: nodes.into_iter().map(Into::into).collect(),
            timeout: DEFAULT_TIMEOUT,
        }
    }

    /// A store on a standalone Redis at `url` with default settings. Connects lazily: this fails
    /// only when the URL is invalid, never because Redis is down.
    pub fn open(url: impl Into<String>) -> Result<Self, ConfigError> {
        Self::builder(url).build()
    }

    fn new(conn: Connection, timeout: Duration) -> Self {
        Self {
            conn,
            timeout,
            scripts: Arc::new(Scripts::new()),
        }
    }

    /// The per-call timeout.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// Runs one of the token-checked scripts, which answer 1 when the key held the token. They
    /// take `KEYS[1]` the key and `ARGV[1]` the token; an extension takes `ARGV[2]` the lease in
    /// milliseconds, a release `KEYS[2]` the key's release marker, `ARGV[2]` its lifetime and
    /// `ARGV[3]` a random id of this call — so that the call re-sent answers as it did.
    fn token_checked(
        &self,
        script: fn(&Scripts) -> &Script,
        key: String,
        token: String,
        op: TokenOp,
    ) -> StoreFuture<bool> {
        self.call(move |mut conn, scripts| async move {
            let mut invocation = script(&scripts).prepare_invoke();
            match op {
                TokenOp::Extend(lease) => invocation.key(key).arg(token).arg(millis(lease)),
                TokenOp::Release => invocation
                    .key(key.as_str())
                    .key(keys::release_marker(&key))
                    .arg(token)
                    .arg(millis(RELEASE_MARKER_TTL))
                    .arg(format!("{:016x}", uuid::Uuid::new_v4().as_u64_pair().0)),
            };
            let held: i64 = invocation
                .invoke_async(&mut conn)
                .await
                .map_err(store_error)?;
            Ok(held == 1)
        })
    }

    /// Runs `op` on a connection within the store timeout.
    fn call<T, F, Fut>(&self, op: F) -> StoreFuture<T>
    where
        T: Send + 'static,
        F: FnOnce(Connection, Arc<Scripts>) -> Fut + Send + 'static,
        Fut: Future<Output = Result<T, StoreError>> + Send + 'static,
    {
        let conn = self.conn.clone();
        let scripts = Arc::clone(&self.scripts);
        let timeout = self.timeout;
        Box::pin(async move {
            match tokio::time::timeout(timeout, op(conn, scripts)).await {
                Ok(result) => result,
                Err(_) => Err(StoreError::timeout()),
            }
        })
    }
}

impl RedisStoreBuilder {
    /// The bound on every store call, connecting included (default 250 ms). Keep it well below
    /// the request timeouts of the service: it is how long a request may wait while Redis is down.
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// Builds the store. Connects lazily, so a Redis that is down now is not an error: calls fail
    /// (within the timeout) until it is back. [`ConfigError`] when the URL does not parse.
    pub fn build(self) -> Result<RedisStore, ConfigError> {
        // the URL is not repeated: it may carry a password
        let invalid = |e: RedisError| {
            ConfigError::new(ConfigErrorKind::Store, format!("invalid Redis URL: {e}"))
        };
        let client = redis::Client::open(self.url.as_str()).map_err(invalid)?;
        let config = ConnectionManagerConfig::new()
            .set_connection_timeout(Some(self.timeout))
            .set_response_timeout(Some(self.timeout))
            .set_number_of_retries(2)
            .set_max_delay(Duration::from_millis(500));
        let manager = ConnectionManager::new_lazy_with_config(client, config).map_err(invalid)?;
        Ok(RedisStore::new(Connection::Single(manager), self.timeout))
    }
}

impl RedisClusterBuilder {
    /// The bound on every store call (default 250 ms); connecting may take up to eight times as
    /// long.
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// Connects to the cluster through the builder's nodes and reads its slot map; the cluster
    /// must answer now. A node URL that does not parse is a [`StoreErrorKind::Config`] error.
    pub async fn connect(self) -> Result<RedisStore, StoreError> {
        let client = redis::cluster::ClusterClient::builder(self.nodes)
            .connection_timeout(self.timeout)
            .response_timeout(self.timeout)
            .retries(2)
            .build()
            .map_err(|e| StoreError::new(StoreErrorKind::Config, e))?;
        let conn = tokio::time::timeout(self.timeout * 8, client.get_async_connection())
            .await
            .map_err(|_| StoreError::timeout())?
            .map_err(store_error)?;
        Ok(RedisStore::new(Connection::Cluster(conn), self.timeout))
    }
}

pub(super) fn store_error(e: RedisError) -> StoreError {
    let kind = if e.is_timeout() {
        StoreErrorKind::Timeout
    } else if e.is_io_error()
        || e.is_connection_dropped()
        || e.is_connection_refusal()
        || e.is_cluster_error()
    {
        StoreErrorKind::Unavailable
    } else {
        StoreErrorKind::Protocol
    };
    StoreError::new(kind, e)
}

fn protocol(msg: &str) -> StoreError {
    StoreError::new(StoreErrorKind::Protocol, msg.to_owned())
}

/// Decodes `{admitted, retry_us, remaining_1, reset_us_1, ...}`.
fn decode_rate(reply: &[i64], limits: usize) -> Result<RateOutcome, StoreError> {
    if reply.len() != 2 + 2 * limits {
        return Err(protocol("rate script returned a reply of the wrong length"));
    }
    let us = |v: i64| Duration::from_micros(u64::try_from(v).unwrap_or(0));
    let limits = reply[2..]
        .chunks_exact(2)
        .map(|pair| LimitState {
            remaining: u64::try_from(pair[0]).unwrap_or(0),
            reset: us(pair[1]),
        })
        .collect();
    Ok(RateOutcome {
        admitted: reply[0] == 1,
        retry_after: us(reply[1]),
        limits,
    })
}

impl RateStore for RedisStore {
    fn check_rate(&self, policy: &Arc<RatePolicy>, check: RateCheck) -> StoreFuture<RateOutcome> {
        let policy = Arc::clone(policy);
        self.call(move |mut conn, scripts| async move {
            let script = match policy.algorithm() {
                Algorithm::SlidingLog => &scripts.sliding_log,
                Algorithm::SlidingCounter => &scripts.sliding_counter,
                Algorithm::Gcra => &scripts.gcra,
            };
            let mut invocation = script.prepare_invoke();
            for key in keys::rate(&policy, &check.key()) {
                invocation.key(key);
            }
            invocation.arg(check.cost()).arg(check.attempt_hex());
            for limit in policy.limits() {
                invocation.arg(limit.quota()).arg(limit.window_us());
            }
            let reply: Vec<i64> = invocation
                .invoke_async(&mut conn)
                .await
                .map_err(store_error)?;
            decode_rate(&reply, policy.limits().len())
        })
    }
}

impl LockStore for RedisStore {
    fn claim(
        &self,
        key: String,
        holder: String,
        ttl: Option<Duration>,
    ) -> StoreFuture<ClaimOutcome> {
        self.call(move |mut conn, scripts| async move {
            let ttl_ms = ttl.map_or(0, millis);
            let (won, holder): (i64, Option<String>) = scripts
                .claim
                .key(key)
                .arg(holder)
                .arg(ttl_ms)
                .invoke_async(&mut conn)
                .await
                .map_err(store_error)?;
            Ok(ClaimOutcome {
                won: won == 1,
                holder: holder.unwrap_or_default(),
            })
        })
    }

    fn lock_acquire(
        &self,
        key: String,
        fence_key: String,
        token: String,
        lease: Duration,
    ) -> StoreFuture<LockAttempt> {
        self.call(move |mut conn, scripts| async move {
            let (acquired, value): (i64, i64) = scripts
                .lock_acquire
                .key(key)
                .key(fence_key)
                .arg(token)
                .arg(millis(lease))
                .arg(millis(fence_ttl(lease)))
                .invoke_async(&mut conn)
                .await
                .map_err(store_error)?;
            let value = u64::try_from(value).unwrap_or(0);
            Ok(if acquired == 1 {
                LockAttempt::Acquired { fence: value }
            } else {
                LockAttempt::Held {
                    lease_left: Duration::from_millis(value),
                }
            })
        })
    }

    fn extend_if_held(&self, key: String, token: String, lease: Duration) -> StoreFuture<bool> {
        self.token_checked(
            |s| &s.compare_and_pexpire,
            key,
            token,
            TokenOp::Extend(lease),
        )
    }

    fn delete_if_held(&self, key: String, token: String) -> StoreFuture<bool> {
        self.token_checked(|s| &s.compare_and_delete, key, token, TokenOp::Release)
    }
}

impl IdempotencyStore for RedisStore {
    fn idempotency_begin(
        &self,
        key: String,
        fingerprint: String,
        token: String,
        lease: Duration,
    ) -> StoreFuture<IdempotencyBegin> {
        self.call(move |mut conn, scripts| async move {
            let reply: Vec<Value> = scripts
                .idem_begin
                .key(key)
                .arg(fingerprint)
                .arg(token)
                .arg(millis(lease))
                .invoke_async(&mut conn)
                .await
                .map_err(store_error)?;
            decode_idem_begin(reply)
        })
    }

    fn idempotency_complete(
        &self,
        key: String,
        token: String,
        response: Bytes,
        retention: Duration,
    ) -> StoreFuture<bool> {
        self.call(move |mut conn, scripts| async move {
            let stored: i64 = scripts
                .idem_complete
                .key(key)
                .arg(token)
                .arg(response.as_ref())
                .arg(millis(retention))
                .invoke_async(&mut conn)
                .await
                .map_err(store_error)?;
            Ok(stored == 1)
        })
    }

    fn idempotency_release(&self, key: String, token: String) -> StoreFuture<bool> {
        self.token_checked(|s| &s.idem_release, key, token, TokenOp::Release)
    }

    fn idempotency_extend(&self, key: String, token: String, lease: Duration) -> StoreFuture<bool> {
        self.token_checked(|s| &s.idem_extend, key, token, TokenOp::Extend(lease))
    }
}

impl Store for RedisStore {
    fn ping(&self) -> StoreFuture<()> {
        self.call(|mut conn, _| async move {
            redis::cmd("PING")
                .query_async::<String>(&mut conn)
                .await
                .map(drop)
                .map_err(store_error)
        })
    }
}

/// Decodes `{0}`, `{1, lease_left_ms}`, `{2}` or `{3, response}`.
fn decode_idem_begin(reply: Vec<Value>) -> Result<IdempotencyBegin, StoreError> {
    let mut reply = reply.into_iter();
    let Some(Value::Int(tag)) = reply.next() else {
        return Err(protocol("idempotency script returned no tag"));
    };
    match (tag, reply.next()) {
        (0, None) => Ok(IdempotencyBegin::Claimed),
        (1, Some(Value::Int(ms))) => Ok(IdempotencyBegin::InFlight {
            lease_left: Duration::from_millis(u64::try_from(ms).unwrap_or(0)),
        }),
        (2, None) => Ok(IdempotencyBegin::Mismatch),
        (3, Some(Value::BulkString(response))) => {
            Ok(IdempotencyBegin::Completed(Bytes::from(response)))
        }
        _ => Err(protocol("idempotency script returned an unexpected reply")),
    }
}
