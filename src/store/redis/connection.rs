//! The connection a [`RedisStore`](super::RedisStore) talks through, and its replacement when it
//! stops answering.
//!
//! A connection can go dark without closing: the peer's host crashed, a path or a NAT entry
//! died, packets are dropped and no reset ever comes. redis-rs then waits on it for as long as
//! TCP takes to give up — minutes — while every call times out. So the store watches its calls:
//! once they have only timed out, with no reply at all, for a second and a few calls in a row,
//! it opens a new connection and lets the old one go. Replacements back off (one per second at
//! first, then at most one per 16 s) while nothing answers, and a reply resets the watch.

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use redis::aio::{ConnectionLike, ConnectionManager, ConnectionManagerConfig};
use redis::cluster::ClusterClient;
use redis::cluster_async::ClusterConnection;
use redis::{
    Cmd, ConnectionAddr, ConnectionInfo, IntoConnectionInfo, Pipeline, RedisFuture, Value,
};
use tokio::time::Instant;

use crate::store::span::Server;

/// Every connection kind, so that one code path serves them all.
#[derive(Clone)]
pub(super) enum Connection {
    Single(ConnectionManager),
    Cluster(ClusterConnection),
    /// A connection of the application's own kind (a pool's, a wrapper): treated as standalone.
    Other(Box<dyn AnyConnection>),
}

/// A redis-rs connection of any kind that can be cloned: what
/// [`RedisStore::from_connection`](super::RedisStore::from_connection) takes.
pub(super) trait AnyConnection: ConnectionLike + Send + Sync {
    fn clone_box(&self) -> Box<dyn AnyConnection>;
}

impl<C> AnyConnection for C
where
    C: ConnectionLike + Clone + Send + Sync + 'static,
{
    fn clone_box(&self) -> Box<dyn AnyConnection> {
        Box::new(self.clone())
    }
}

impl Clone for Box<dyn AnyConnection> {
    fn clone(&self) -> Self {
        self.clone_box()
    }
}

impl ConnectionLike for Connection {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        match self {
            Self::Single(c) => c.req_packed_command(cmd),
            Self::Cluster(c) => c.req_packed_command(cmd),
            Self::Other(c) => c.req_packed_command(cmd),
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
            Self::Other(c) => c.req_packed_commands(pipeline, offset, count),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            Self::Single(c) => c.get_db(),
            Self::Cluster(c) => c.get_db(),
            Self::Other(c) => c.get_db(),
        }
    }
}

/// How to open the connection again.
#[derive(Clone)]
pub(super) enum Opener {
    Single {
        client: redis::Client,
        config: ConnectionManagerConfig,
    },
    Cluster {
        client: ClusterClient,
        timeout: Duration,
        /// A client per node the store was given: the invalidation subscriber's way in.
        nodes: Arc<[redis::Client]>,
    },
    /// A connection the application handed over: it reconnects (or not) as the application
    /// made it; the store cannot open another.
    Given,
    /// The primary that the sentinels name for `master`.
    Sentinel {
        sentinels: Arc<[redis::Client]>,
        master: Arc<str>,
        config: ConnectionManagerConfig,
        timeout: Duration,
        /// The client of a primary's URL: with the sentinels' certificates under TLS.
        primary_client: PrimaryClient,
        /// The primary the store's connections last moved to, shared by all of them.
        known: Arc<KnownPrimary>,
    },
}

/// Behind sentinels, the primary that one of a store's connections last learned of: the others
/// move there before their next call, instead of each learning it from a failure of its own.
#[derive(Debug, Default)]
pub(super) struct KnownPrimary {
    /// Bumped on every move.
    generation: AtomicU64,
    primary: RwLock<String>,
}

impl KnownPrimary {
    /// Tells the other connections that `primary` is the one now; its generation.
    fn publish(&self, primary: &str) -> u64 {
        match self.primary.write() {
            Ok(mut current) => primary.clone_into(&mut current),
            Err(poisoned) => primary.clone_into(&mut poisoned.into_inner()),
        }
        self.generation.fetch_add(1, Ordering::AcqRel) + 1
    }

    fn primary(&self) -> String {
        match self.primary.read() {
            Ok(primary) => primary.clone(),
            Err(poisoned) => poisoned.into_inner().clone(),
        }
    }
}

impl Opener {
    pub(super) fn kind(&self) -> &'static str {
        match self {
            Self::Single { .. } => "standalone",
            Self::Cluster { .. } => "cluster",
            Self::Sentinel { .. } => "sentinel",
            Self::Given => "given",
        }
    }
}

/// Makes the client of a primary's URL.
pub(super) type PrimaryClient =
    Arc<dyn Fn(&str) -> Result<redis::Client, redis::RedisError> + Send + Sync>;

/// The URL of the primary that the first sentinel to answer names for `master`: `rediss://`
/// when the sentinels are asked over TLS (their data nodes are then TLS-only as well).
pub(super) async fn ask_sentinels(
    sentinels: &[redis::Client],
    master: &str,
    timeout: Duration,
) -> Option<String> {
    for sentinel in sentinels {
        let asked = tokio::time::timeout(timeout, async {
            let mut conn = sentinel.get_multiplexed_async_connection().await.ok()?;
            let named: Option<(String, u16)> = redis::cmd("SENTINEL")
                .arg("get-master-addr-by-name")
                .arg(master)
                .query_async(&mut conn)
                .await
                .ok()?;
            let (scheme, fragment) = match sentinel.get_connection_info().addr() {
                redis::ConnectionAddr::TcpTls { insecure: true, .. } => ("rediss", "#insecure"),
                redis::ConnectionAddr::TcpTls { .. } => ("rediss", ""),
                _ => ("redis", ""),
            };
            named.map(|(host, port)| format!("{scheme}://{host}:{port}/{fragment}"))
        });
        if let Ok(Some(primary)) = asked.await {
            return Some(primary);
        }
    }
    None
}

/// Calls that must time out in a row, for at least [`DARK_FOR`], before the connection is
/// replaced.
const DARK_CALLS: u32 = 3;
/// How long calls must have timed out without any reply before the connection is replaced.
const DARK_FOR: Duration = Duration::from_secs(1);
/// The first pause between replacements while nothing answers, and the longest.
const FIRST_BACKOFF: Duration = Duration::from_secs(1);
const MAX_BACKOFF: Duration = Duration::from_secs(16);
/// Behind sentinels: how often one connection asks them at most, unless it is replaced.
const ASK_EVERY: Duration = Duration::from_millis(200);

/// The store's connection, replaced when it goes dark.
pub(super) struct Link {
    current: RwLock<Connection>,
    opener: Opener,
    epoch: Instant,
    /// Calls timed out since the last reply.
    timeouts: AtomicU32,
    /// When the first of them timed out, in milliseconds since `epoch`.
    dark_since: AtomicU64,
    /// No replacement before this, in milliseconds since `epoch`.
    next_replacement: AtomicU64,
    /// The pause after the next replacement, in milliseconds.
    backoff: AtomicU64,
    /// A connection is being opened in the background.
    opening: AtomicBool,
    /// Behind sentinels: a request to ask them again, and whether it asks to reopen.
    asking: AtomicBool,
    reopen: AtomicBool,
    /// Behind sentinels: the primary the connection goes to, and when they were last asked (in
    /// milliseconds since `epoch`).
    primary: RwLock<String>,
    asked: AtomicU64,
    /// The generation of the store's [`KnownPrimary`] this connection is on.
    seen: AtomicU64,
    /// Where calls go, for their spans; unknown on Cluster and on a given connection.
    server: RwLock<Option<Server>>,
}

impl Link {
    pub(super) fn new(conn: Connection, opener: Opener) -> Self {
        Self::to(conn, opener, String::new())
    }

    /// A link behind sentinels, on `primary` now.
    pub(super) fn to(conn: Connection, opener: Opener, primary: String) -> Self {
        let server = match &opener {
            Opener::Single { client, .. } => server_of(client.get_connection_info()),
            Opener::Sentinel { .. } => server_at(&primary),
            Opener::Cluster { .. } | Opener::Given => None,
        };
        Self {
            current: RwLock::new(conn),
            opener,
            epoch: Instant::now(),
            timeouts: AtomicU32::new(0),
            dark_since: AtomicU64::new(0),
            next_replacement: AtomicU64::new(0),
            backoff: AtomicU64::new(as_ms(FIRST_BACKOFF)),
            opening: AtomicBool::new(false),
            asking: AtomicBool::new(false),
            reopen: AtomicBool::new(false),
            primary: RwLock::new(primary),
            asked: AtomicU64::new(0),
            seen: AtomicU64::new(0),
            server: RwLock::new(server),
        }
    }

    /// Where calls go now, if known.
    pub(super) fn server(&self) -> Option<Server> {
        match self.server.read() {
            Ok(server) => server.clone(),
            Err(poisoned) => poisoned.into_inner().clone(),
        }
    }

    pub(super) fn kind(&self) -> &'static str {
        self.opener.kind()
    }

    /// How the connection is opened again.
    pub(super) fn opener(&self) -> &Opener {
        &self.opener
    }

    /// The connection to send the next call on: behind sentinels, on the primary that another
    /// of the store's connections moved to, if one did since.
    pub(super) fn get(&self) -> Connection {
        if let Opener::Sentinel { known, .. } = &self.opener {
            self.catch_up(known);
        }
        // a panic while holding the lock cannot leave a half-written connection behind
        match self.current.read() {
            Ok(conn) => conn.clone(),
            Err(poisoned) => poisoned.into_inner().clone(),
        }
    }

    /// A call got a reply (of any kind): the connection is alive.
    pub(super) fn answered(&self) {
        if self.timeouts.load(Ordering::Relaxed) != 0 {
            self.timeouts.store(0, Ordering::Relaxed);
            self.backoff.store(as_ms(FIRST_BACKOFF), Ordering::Relaxed);
        }
    }

    /// A call found the store unreachable: refused, dropped, or a primary turned replica
    /// (`READONLY`). Behind sentinels, asks them again (at most every `ASK_EVERY`) and moves to the
    /// primary they name; elsewhere redis-rs reconnects by itself.
    pub(super) fn unreachable(self: &Arc<Self>) {
        if matches!(self.opener, Opener::Sentinel { .. }) {
            self.follow(false);
        }
    }

    /// A call timed out without a reply; replaces the connection once it looks dark.
    pub(super) fn timed_out(self: &Arc<Self>) {
        // a primary that died without a reset answers with silence
        self.unreachable();
        let now = self.now_ms();
        if self.timeouts.fetch_add(1, Ordering::Relaxed) == 0 {
            self.dark_since.store(now, Ordering::Relaxed);
            return;
        }
        let dark_for = now.saturating_sub(self.dark_since.load(Ordering::Relaxed));
        let due = self.next_replacement.load(Ordering::Relaxed);
        if self.timeouts.load(Ordering::Relaxed) < DARK_CALLS
            || dark_for < as_ms(DARK_FOR)
            || now < due
        {
            return;
        }
        let backoff = self.backoff.load(Ordering::Relaxed);
        // one caller replaces; the others see the new deadline
        if self
            .next_replacement
            .compare_exchange(due, now + backoff, Ordering::Relaxed, Ordering::Relaxed)
            .is_err()
        {
            return;
        }
        let doubled = (backoff * 2).min(as_ms(MAX_BACKOFF));
        self.backoff.store(doubled, Ordering::Relaxed);
        self.replace();
    }

    /// Opens a new connection in place of the current one.
    fn replace(self: &Arc<Self>) {
        if matches!(self.opener, Opener::Given) {
            tracing::warn!(
                target: "tollgate::store",
                "the Redis connection handed to the store stopped answering"
            );
            return;
        }
        tracing::warn!(
            target: "tollgate::store",
            "the Redis connection stopped answering; opening a new one"
        );
        match &self.opener {
            Opener::Given => {}
            Opener::Single { client, config } => {
                match ConnectionManager::new_lazy_with_config(client.clone(), config.clone()) {
                    Ok(manager) => self.set(Connection::Single(manager)),
                    Err(error) => tracing::warn!(
                        target: "tollgate::store", %error, "could not open a new Redis connection"
                    ),
                }
            }
            Opener::Sentinel { .. } => self.follow(true),
            Opener::Cluster {
                client, timeout, ..
            } => {
                if self.opening.swap(true, Ordering::Relaxed) {
                    return;
                }
                let (link, client, timeout) = (Arc::clone(self), client.clone(), *timeout);
                tokio::spawn(async move {
                    match tokio::time::timeout(timeout * 8, client.get_async_connection()).await {
                        Ok(Ok(conn)) => link.set(Connection::Cluster(conn)),
                        Ok(Err(error)) => tracing::warn!(
                            target: "tollgate::store", %error, "could not open a new cluster connection"
                        ),
                        Err(_) => tracing::warn!(
                            target: "tollgate::store", "opening a new cluster connection timed out"
                        ),
                    }
                    link.opening.store(false, Ordering::Relaxed);
                });
            }
        }
    }

    /// Asks the sentinels for the primary in the background and moves there: when it is not the
    /// one the connection goes to, or always when `reopen`. At most one asks at a time, and
    /// (unless `reopen`) at most every [`ASK_EVERY`]; a request that comes meanwhile is deferred,
    /// never dropped: the last request of a failover may be the first after the promotion, and
    /// a connection that missed it would stay on the dead primary until a call of its own
    /// failed there.
    fn follow(self: &Arc<Self>, reopen: bool) {
        if !matches!(self.opener, Opener::Sentinel { .. }) {
            return;
        }
        if reopen {
            self.reopen.store(true, Ordering::Relaxed);
        }
        self.asking.store(true, Ordering::Release);
        if self.opening.swap(true, Ordering::AcqRel) {
            return; // the running follower sees the request
        }
        tokio::spawn(Arc::clone(self).follower());
    }

    /// Serves the requests to follow the primary until none is left.
    async fn follower(self: Arc<Self>) {
        loop {
            while self.asking.swap(false, Ordering::AcqRel) {
                let reopen = self.reopen.swap(false, Ordering::Relaxed);
                let due = self.asked.load(Ordering::Relaxed) + as_ms(ASK_EVERY);
                let now = self.now_ms();
                if !reopen && now < due {
                    tokio::time::sleep(Duration::from_millis(due - now)).await;
                }
                self.asked.store(self.now_ms(), Ordering::Relaxed);
                self.ask_and_move(reopen).await;
            }
            self.opening.store(false, Ordering::Release);
            // a request made after the last check, while `opening` was still set
            if !self.asking.load(Ordering::Acquire) || self.opening.swap(true, Ordering::AcqRel) {
                return;
            }
        }
    }

    /// Moves to the primary another connection of the store moved to, if it did since this
    /// one last looked. Opening is lazy: no I/O here.
    fn catch_up(&self, known: &KnownPrimary) {
        let generation = known.generation.load(Ordering::Acquire);
        let seen = self.seen.load(Ordering::Relaxed);
        if generation == seen
            || self
                .seen
                .compare_exchange(seen, generation, Ordering::AcqRel, Ordering::Relaxed)
                .is_err()
        {
            return; // up to date, or another call is catching up
        }
        let primary = known.primary();
        if primary.is_empty() || self.primary() == primary {
            return;
        }
        self.open_on(primary);
    }

    /// One question to the sentinels; moves to the primary they name when it is another, or
    /// always when `reopen`.
    async fn ask_and_move(&self, reopen: bool) {
        let Opener::Sentinel {
            sentinels,
            master,
            timeout,
            known,
            ..
        } = &self.opener
        else {
            return;
        };
        let Some(primary) = ask_sentinels(sentinels, master, *timeout).await else {
            return;
        };
        let moved = self.primary().as_str() != primary;
        if !moved && !reopen {
            return;
        }
        if moved {
            tracing::warn!(target: "tollgate::store", %primary, "the sentinels name a new primary; moving to it");
        }
        if !self.open_on(primary.clone()) {
            return;
        }
        if moved && known.primary() != primary {
            let generation = known.publish(&primary);
            self.seen.store(generation, Ordering::Release);
        }
    }

    /// Behind sentinels, replaces the connection with one to `primary` (lazily: no I/O);
    /// whether it could be made.
    fn open_on(&self, primary: String) -> bool {
        let Opener::Sentinel {
            config,
            primary_client,
            ..
        } = &self.opener
        else {
            return false;
        };
        match primary_client(&primary).and_then(|client| open_single(client, config.clone())) {
            Ok(conn) => {
                self.set(conn);
                let server = server_at(&primary);
                match self.server.write() {
                    Ok(mut current) => *current = server,
                    Err(poisoned) => *poisoned.into_inner() = server,
                }
                self.set_primary(primary);
                true
            }
            Err(error) => {
                tracing::warn!(target: "tollgate::store", %error, "could not open a connection to the primary");
                false
            }
        }
    }

    fn primary(&self) -> String {
        match self.primary.read() {
            Ok(primary) => primary.clone(),
            Err(poisoned) => poisoned.into_inner().clone(),
        }
    }

    fn set_primary(&self, primary: String) {
        match self.primary.write() {
            Ok(mut current) => *current = primary,
            Err(poisoned) => *poisoned.into_inner() = primary,
        }
    }

    fn set(&self, conn: Connection) {
        match self.current.write() {
            Ok(mut current) => *current = conn,
            Err(poisoned) => *poisoned.into_inner() = conn,
        }
    }

    fn now_ms(&self) -> u64 {
        as_ms(self.epoch.elapsed())
    }
}

/// The host and port of a TCP connection's `info`.
fn server_of(info: &ConnectionInfo) -> Option<Server> {
    match info.addr() {
        ConnectionAddr::Tcp(host, port) | ConnectionAddr::TcpTls { host, port, .. } => {
            Some(Server {
                address: host.as_str().into(),
                port: *port,
            })
        }
        _ => None,
    }
}

/// The host and port of the server at `url`.
fn server_at(url: &str) -> Option<Server> {
    url.into_connection_info().ok().as_ref().and_then(server_of)
}

fn as_ms(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

/// A lazy connection manager to the standalone server (or primary) of `client`.
pub(super) fn open_single(
    client: redis::Client,
    config: ConnectionManagerConfig,
) -> Result<Connection, redis::RedisError> {
    ConnectionManager::new_lazy_with_config(client, config).map(Connection::Single)
}
