//! [`RedisStore`]: Redis or Valkey through redis-rs, standalone or Cluster.

use std::fmt;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;

use redis::{RedisError, Script, Value};

mod builder;
mod connection;

pub use builder::{RedisClusterBuilder, RedisStoreBuilder};
use connection::{Connection, Link};

use super::{
    ClaimOutcome, IdempotencyBegin, IdempotencyStore, LockAttempt, LockStore, RELEASE_MARKER_TTL,
    RateStore, Store, StoreError, StoreErrorKind, StoreFuture, fence_ttl, millis,
};
use crate::error::ConfigError;
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
    link: Arc<Link>,
    timeout: Duration,
    scripts: Arc<Scripts>,
}

impl fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisStore")
            .field("kind", &self.link.kind())
            .field("timeout", &self.timeout)
            .finish_non_exhaustive()
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
            sliding_log: Script::new(include_str!("../scripts/sliding_log.lua")),
            sliding_counter: Script::new(include_str!("../scripts/sliding_counter.lua")),
            gcra: Script::new(include_str!("../scripts/gcra.lua")),
            claim: Script::new(include_str!("../scripts/claim.lua")),
            lock_acquire: Script::new(include_str!("../scripts/lock_acquire.lua")),
            compare_and_pexpire: Script::new(include_str!("../scripts/compare_and_pexpire.lua")),
            compare_and_delete: Script::new(include_str!("../scripts/compare_and_delete.lua")),
            idem_begin: Script::new(include_str!("../scripts/idem_begin.lua")),
            idem_complete: Script::new(include_str!("../scripts/idem_complete.lua")),
            idem_release: Script::new(include_str!("../scripts/idem_release.lua")),
            idem_extend: Script::new(include_str!("../scripts/idem_extend.lua")),
        }
    }
}

/// What a token-checked script does to a key that holds the token.
#[derive(Debug, Clone, Copy)]
enum TokenOp {
    Extend(Duration),
    Release,
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

    /// A store on a standalone Redis at `url` with default settings. Connects lazily: this fails
    /// only when the URL is invalid, never because Redis is down.
    pub fn open(url: impl Into<String>) -> Result<Self, ConfigError> {
        Self::builder(url).build()
    }

    fn new(link: Link, timeout: Duration) -> Self {
        Self {
            link: Arc::new(link),
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

    /// Runs `op` on a connection within the store timeout, and tells the connection's watch
    /// whether a reply came.
    fn call<T, F, Fut>(&self, op: F) -> StoreFuture<T>
    where
        T: Send + 'static,
        F: FnOnce(Connection, Arc<Scripts>) -> Fut + Send + 'static,
        Fut: Future<Output = Result<T, StoreError>> + Send + 'static,
    {
        let link = Arc::clone(&self.link);
        let conn = link.get();
        let scripts = Arc::clone(&self.scripts);
        let timeout = self.timeout;
        Box::pin(async move {
            let result = match tokio::time::timeout(timeout, op(conn, scripts)).await {
                Ok(result) => result,
                Err(_) => Err(StoreError::timeout()),
            };
            match &result {
                Err(e) if e.kind() == StoreErrorKind::Timeout => link.timed_out(),
                // refused or dropped: redis-rs reconnects by itself
                Err(e) if e.kind() == StoreErrorKind::Unavailable => {}
                _ => link.answered(),
            }
            result
        })
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
