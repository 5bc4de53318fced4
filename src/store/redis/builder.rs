//! [`RedisStoreBuilder`], [`RedisClusterBuilder`] and [`RedisSentinelBuilder`].

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use redis::RedisError;
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::io::tcp::TcpSettings;

use super::connection::{Connection, Link, Opener, PrimaryClient, ask_sentinels, open_single};
use super::durable::{self, Ack};
use super::url;
use super::{RedisStore, store_error};
use crate::error::{ConfigError, ConfigErrorKind};
use crate::store::coalesce::DEFAULT_MAX_BATCH;
use crate::store::{Redacted, StoreError, StoreErrorKind, redacted_list};

/// Configures a [`RedisStore`] on a standalone Redis; made by [`RedisStore::builder`].
///
/// Its `Debug` shows the URL without its password
/// ([`redact_connection_string`](crate::store::redact_connection_string)).
#[derive(Clone)]
pub struct RedisStoreBuilder {
    url: String,
    common: Common,
}

/// Configures a [`RedisStore`] on a Redis Cluster; made by [`RedisStore::cluster_builder`].
///
/// A cluster store connects when it is built, as it reads the slot map:
/// [`connect`](Self::connect) is async and needs the cluster to answer. Its `Debug` shows the
/// nodes' URLs without their passwords.
#[derive(Clone)]
pub struct RedisClusterBuilder {
    nodes: Vec<String>,
    common: Common,
}

/// Configures a [`RedisStore`] on a Redis behind Sentinel; made by
/// [`RedisStore::sentinel_builder`].
///
/// The store asks the sentinels for the primary when it connects, and again whenever the primary
/// stops answering — a refused or dropped connection, a `READONLY` error from a primary demoted
/// to a replica, timeouts — and moves to the one they name. Calls in between fail within the
/// store timeout, and the calling layer applies its failure policy. Its `Debug` shows the
/// sentinels' URLs without their passwords.
#[derive(Clone)]
pub struct RedisSentinelBuilder {
    sentinels: Vec<String>,
    master: String,
    /// The primary's user name and password, when it asks for them (`requirepass`, ACL users).
    primary_auth: Option<(Option<String>, String)>,
    common: Common,
}

// The URLs may carry passwords: each shows redacted.
impl fmt::Debug for RedisStoreBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisStoreBuilder")
            .field("url", &Redacted(&self.url))
            .field("common", &self.common)
            .finish()
    }
}

impl fmt::Debug for RedisClusterBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisClusterBuilder")
            .field("nodes", &redacted_list(&self.nodes))
            .field("common", &self.common)
            .finish()
    }
}

impl fmt::Debug for RedisSentinelBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let auth = self
            .primary_auth
            .as_ref()
            .map(|(user, _)| (user, "<redacted>"));
        f.debug_struct("RedisSentinelBuilder")
            .field("sentinels", &redacted_list(&self.sentinels))
            .field("master", &self.master)
            .field("primary_auth", &auth)
            .field("common", &self.common)
            .finish()
    }
}

/// What every builder is configured with besides where the servers are.
#[derive(Debug, Clone)]
struct Common {
    timeout: Duration,
    ack: Option<Ack>,
    max_batch: usize,
    tls: Tls,
}

impl Default for Common {
    fn default() -> Self {
        Self {
            timeout: DEFAULT_TIMEOUT,
            ack: None,
            max_batch: DEFAULT_MAX_BATCH,
            tls: Tls::default(),
        }
    }
}

impl Common {
    fn settings(&self) -> Settings {
        Settings {
            timeout: self.timeout,
            max_batch: self.max_batch,
        }
    }
}

/// The certificates of `rediss://` connections: the CA to trust instead of the platform's
/// roots, and the client's own certificate and key for mutual TLS. Set only with a TLS feature.
#[derive(Clone, Default)]
#[cfg_attr(
    not(any(feature = "tls-rustls", feature = "tls-native-tls")),
    allow(dead_code)
)]
struct Tls {
    ca_cert: Option<Vec<u8>>,
    client: Option<(Vec<u8>, Vec<u8>)>,
}

impl fmt::Debug for Tls {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // the client key is a secret: neither certificate is printed
        f.debug_struct("Tls")
            .field("ca_cert", &self.ca_cert.is_some())
            .field("client_cert", &self.client.is_some())
            .finish()
    }
}

impl Tls {
    fn is_set(&self) -> bool {
        self.ca_cert.is_some() || self.client.is_some()
    }

    /// The client of `url` (`TCP_NODELAY` on), with these certificates for `rediss://`.
    fn client(
        &self,
        url: &str,
        auth: Option<&(Option<String>, String)>,
    ) -> redis::RedisResult<redis::Client> {
        let mut info = no_delay(url)?;
        if let Some((user, password)) = auth {
            let mut settings = info.redis_settings().clone().set_password(password);
            if let Some(user) = user {
                settings = settings.set_username(user);
            }
            info = info.set_redis_settings(settings);
        }
        #[cfg(any(feature = "tls-rustls", feature = "tls-native-tls"))]
        if self.is_set() {
            return redis::Client::build_with_tls(info, self.certificates());
        }
        redis::Client::open(info)
    }

    #[cfg(any(feature = "tls-rustls", feature = "tls-native-tls"))]
    fn certificates(&self) -> redis::TlsCertificates {
        redis::TlsCertificates {
            client_tls: self
                .client
                .as_ref()
                .map(|(cert, key)| redis::ClientTlsConfig {
                    client_cert: cert.clone(),
                    client_key: key.clone(),
                }),
            root_cert: self.ca_cert.clone(),
        }
    }
}

/// The setters every Redis builder has: durability, batching and TLS.
macro_rules! common_setters {
    () => {
        durability_setters!();
        max_batch_setter!();
        tls_setters!();
    };
}

/// The TLS setters of every builder.
macro_rules! tls_setters {
    () => {
        /// Trusts `pem`, a CA certificate in PEM, for `rediss://` connections instead of the
        /// platform's roots (features `tls-rustls` or `tls-native-tls`): a managed Redis whose
        /// certificate is signed by its own CA.
        #[cfg(any(feature = "tls-rustls", feature = "tls-native-tls"))]
        pub fn tls_ca_cert(mut self, pem: impl Into<Vec<u8>>) -> Self {
            self.common.tls.ca_cert = Some(pem.into());
            self
        }

        /// Presents `cert` and `key` (PEM) to a server that asks for a client certificate
        /// (mutual TLS; features `tls-rustls` or `tls-native-tls`).
        #[cfg(any(feature = "tls-rustls", feature = "tls-native-tls"))]
        pub fn tls_client_cert(
            mut self,
            cert: impl Into<Vec<u8>>,
            key: impl Into<Vec<u8>>,
        ) -> Self {
            self.common.tls.client = Some((cert.into(), key.into()));
            self
        }
    };
}

/// The durable-write setters every builder has.
macro_rules! durability_setters {
    () => {
        /// Durable writes (default 0: off): claims, lock acquisitions and extensions, and
        /// idempotency claims and records succeed only once `replicas` replicas acknowledged them
        /// (`WAIT`) within the store timeout; otherwise the call fails with a store error, and
        /// the caller undoes what it can and reports no success. Rate checks never wait. These
        /// writes use a connection of their own, so that a `WAIT` never holds up rate decisions.
        pub fn wait_replicas(mut self, replicas: u32) -> Self {
            self.common.ack = Ack::replicas(replicas);
            self
        }

        /// Durable writes on disk (`WAITAOF`, Redis 7.2 or later, or Valkey): as
        /// [`wait_replicas`](Self::wait_replicas), but a write counts only once it is in the
        /// primary's append-only file (when `local`; the primary needs `appendonly yes`) and in
        /// that of `replicas` replicas, fsynced. A server without `WAITAOF` fails every durable
        /// write with a [`StoreErrorKind::Config`](crate::store::StoreErrorKind::Config) error
        /// that says so. `wait_aof(false, 0)` turns durable writes off; the last of the two
        /// setters called wins.
        pub fn wait_aof(mut self, local: bool, replicas: u32) -> Self {
            self.common.ack = Ack::aof(local, replicas);
            self
        }
    };
}

/// The `max_batch` setter every builder has.
macro_rules! max_batch_setter {
    () => {
        /// The most rate checks one call to Redis carries (default 32). Checks that wait for
        /// the store at the same moment go out together, as one call of one script that
        /// decides them in turn — each exactly as it would be decided alone — so that Redis and
        /// the client pay the cost of a call once per batch. The first check goes at once; checks
        /// that arrive while calls are in flight wait for the next one, which goes out as soon as
        /// it is full (calls are pipelined, however many are in flight), when a call returns, or
        /// after half a millisecond. 1 sends every check alone.
        pub fn max_batch(mut self, checks: usize) -> Self {
            self.common.max_batch = checks.max(1);
            self
        }
    };
}

/// What every store is made with.
#[derive(Debug, Clone, Copy)]
pub(super) struct Settings {
    pub(super) timeout: Duration,
    pub(super) max_batch: usize,
}

impl Settings {
    /// A store on a given connection: default batches.
    pub(super) fn given(timeout: Duration) -> Self {
        Self {
            timeout,
            max_batch: DEFAULT_MAX_BATCH,
        }
    }
}

/// The default bound on every store call.
const DEFAULT_TIMEOUT: Duration = Duration::from_millis(250);

impl RedisStoreBuilder {
    pub(super) fn new(url: String) -> Self {
        Self {
            url,
            common: Common::default(),
        }
    }

    /// The bound on every store call, connecting included (default 250 ms). Keep it well below
    /// the request timeouts of the service: it is how long a request may wait while Redis is down.
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.common.timeout = timeout;
        self
    }

    common_setters!();

    /// Builds the store. Connects lazily, so a Redis that is down now is not an error: calls fail
    /// (within the timeout) until it is back. [`ConfigError`] when the URL does not parse, or
    /// when called outside a Tokio runtime.
    pub fn build(self) -> Result<RedisStore, ConfigError> {
        // the URL is not repeated: it may carry a password
        let invalid = |e: RedisError| {
            ConfigError::new(ConfigErrorKind::Store, format!("invalid Redis URL: {e}"))
        };
        if let Some(problem) = url::problem(&self.url) {
            let message = format!("invalid Redis URL: {problem}");
            return Err(ConfigError::new(ConfigErrorKind::Store, message));
        }
        // redis-rs sets its connection up on the runtime at once, and panics without one
        if tokio::runtime::Handle::try_current().is_err() {
            return Err(ConfigError::new(
                ConfigErrorKind::Store,
                "a RedisStore is built inside a Tokio runtime: in an async fn under \
                 #[tokio::main], or after `let _guard = runtime.enter();`",
            ));
        }
        let client = self.common.tls.client(&self.url, None).map_err(invalid)?;
        let config = manager_config(self.common.timeout);
        let open = || {
            ConnectionManager::new_lazy_with_config(client.clone(), config.clone())
                .map(|manager| {
                    let opener = Opener::Single {
                        client: client.clone(),
                        config: config.clone(),
                    };
                    Link::new(Connection::Single(manager), opener)
                })
                .map_err(invalid)
        };
        Ok(RedisStore::new(
            open()?,
            durable(self.common.ack, open)?,
            self.common.settings(),
        ))
    }
}

impl RedisClusterBuilder {
    pub(super) fn new(nodes: Vec<String>) -> Self {
        Self {
            nodes,
            common: Common::default(),
        }
    }

    /// The bound on every store call (default 250 ms); connecting may take up to eight times as
    /// long.
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.common.timeout = timeout;
        self
    }

    common_setters!();

    /// A client per node, as the builder's nodes and TLS settings say: the invalidation
    /// subscriber's way in.
    fn node_clients(&self) -> Result<Arc<[redis::Client]>, StoreError> {
        self.nodes
            .iter()
            .map(|url| self.common.tls.client(url, None))
            .collect::<Result<Arc<[_]>, _>>()
            .map_err(|e| StoreError::new(StoreErrorKind::Config, e))
    }

    /// Connects to the cluster through the builder's nodes and reads its slot map; the cluster
    /// must answer now. A node URL that does not parse is a [`StoreErrorKind::Config`] error.
    pub async fn connect(self) -> Result<RedisStore, StoreError> {
        check_urls("node", &self.nodes)?;
        let builder = redis::cluster::ClusterClient::builder(self.nodes.clone())
            .tcp_settings(TcpSettings::default().set_nodelay(true))
            .connection_timeout(self.common.timeout)
            .response_timeout(self.common.timeout)
            .retries(2);
        let tls = &self.common.tls;
        #[cfg(feature = "tls-rustls")]
        let builder = match tls.is_set() {
            true => builder.certs(tls.certificates()),
            false => builder,
        };
        #[cfg(not(feature = "tls-rustls"))]
        if tls.is_set() {
            return Err(StoreError::new(
                StoreErrorKind::Config,
                "certificates for a Redis Cluster need the `tls-rustls` feature",
            ));
        }
        let client = builder
            .build()
            .map_err(|e| StoreError::new(StoreErrorKind::Config, e))?;
        let nodes = self.node_clients()?;
        let timeout = self.common.timeout;
        let open = || async {
            let conn = tokio::time::timeout(timeout * 8, client.get_async_connection())
                .await
                .map_err(|_| StoreError::timeout())?
                .map_err(store_error)?;
            let opener = Opener::Cluster {
                client: client.clone(),
                timeout,
                nodes: Arc::clone(&nodes),
            };
            Ok::<_, StoreError>(Link::new(Connection::Cluster(conn), opener))
        };
        let durable = match self.common.ack {
            None => None,
            Some(ack) => {
                let mut links = Vec::with_capacity(durable::CONNECTIONS);
                for _ in 0..durable::CONNECTIONS {
                    links.push(open().await?);
                }
                Some((ack, links))
            }
        };
        Ok(RedisStore::new(
            open().await?,
            durable,
            self.common.settings(),
        ))
    }
}

impl RedisSentinelBuilder {
    pub(super) fn new(sentinels: Vec<String>, master: String) -> Self {
        Self {
            sentinels,
            master,
            primary_auth: None,
            common: Common::default(),
        }
    }

    /// The password the primary (and, after a failover, the replica promoted in its place) asks
    /// for (`requirepass`), sent with `AUTH` on every connection to it; with a user name for an
    /// ACL user. The sentinels' own password, if they have one, goes in their URLs. Kept out of
    /// `Debug` and of every error and log line.
    ///
    /// ```
    /// use tollgate::store::RedisStore;
    ///
    /// let builder = RedisStore::sentinel_builder(["redis://127.0.0.1:26379"], "mymaster")
    ///     .primary_password(None, "s3cret");
    /// assert!(!format!("{builder:?}").contains("s3cret"));
    /// ```
    pub fn primary_password(mut self, user: Option<&str>, password: impl Into<String>) -> Self {
        self.primary_auth = Some((user.map(str::to_owned), password.into()));
        self
    }

    /// The bound on every store call (default 250 ms); asking the sentinels may take that long
    /// per sentinel.
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.common.timeout = timeout;
        self
    }

    common_setters!();

    /// The client of `url`, a sentinel or a primary, with the builder's certificates for
    /// `rediss://`.
    fn client_maker(&self) -> PrimaryClient {
        let tls = self.common.tls.clone();
        Arc::new(move |url: &str| tls.client(url, None))
    }

    /// The client of a primary's URL: [`client_maker`](Self::client_maker)'s, with the
    /// primary's credentials.
    fn primary_maker(&self) -> PrimaryClient {
        let (tls, auth) = (self.common.tls.clone(), self.primary_auth.clone());
        Arc::new(move |url: &str| tls.client(url, auth.as_ref()))
    }

    /// Asks the sentinels for the primary and connects to it; a sentinel must answer now. A
    /// sentinel URL that does not parse is a [`StoreErrorKind::Config`] error.
    pub async fn connect(self) -> Result<RedisStore, StoreError> {
        check_urls("sentinel", &self.sentinels)?;
        let (settings, timeout) = (self.common.settings(), self.common.timeout);
        let (client, primary_client) = (self.client_maker(), self.primary_maker());
        let sentinels = self
            .sentinels
            .iter()
            .map(|url| client(url))
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| StoreError::new(StoreErrorKind::Config, e))?;
        if sentinels.is_empty() {
            return Err(StoreError::new(StoreErrorKind::Config, "no sentinel given"));
        }
        let Some(primary) = ask_sentinels(&sentinels, &self.master, timeout).await else {
            return Err(StoreError::new(
                StoreErrorKind::Unavailable,
                format!("no sentinel named a primary for {:?}", self.master),
            ));
        };
        let config = manager_config(timeout);
        let opener = Opener::Sentinel {
            sentinels: sentinels.into(),
            master: self.master.into(),
            config: config.clone(),
            timeout,
            primary_client: Arc::clone(&primary_client),
            known: Arc::default(),
        };
        let open = || {
            primary_client(&primary)
                .and_then(|primary| open_single(primary, config.clone()))
                .map(|conn| Link::to(conn, opener.clone(), primary.clone()))
                .map_err(store_error)
        };
        Ok(RedisStore::new(
            open()?,
            durable(self.common.ack, open)?,
            settings,
        ))
    }
}

/// How every connection manager of a store is configured: bounded by the store timeout, and
/// quick to give up on a connection that cannot be made — two retries 10 and 20 ms apart — so
/// that the call fails with its cause (refused, a host that does not resolve, a database Redis
/// refuses) well within the timeout rather than wearing it out in back-off and failing as a
/// timeout. The next call connects again; the store's failure policy takes over meanwhile.
fn manager_config(timeout: Duration) -> ConnectionManagerConfig {
    ConnectionManagerConfig::new()
        .set_connection_timeout(Some(timeout))
        .set_response_timeout(Some(timeout))
        .set_number_of_retries(2)
        .set_min_delay(Duration::from_millis(10))
        .set_max_delay(Duration::from_millis(40))
}

/// `url` with `TCP_NODELAY` on: calls are pipelined on one connection, and with Nagle's algorithm
/// a call written while another is unacknowledged would wait for that ACK — which a server a few
/// milliseconds away sends with its reply — so that calls would go out one round trip apart.
fn no_delay(url: &str) -> redis::RedisResult<redis::ConnectionInfo> {
    use redis::IntoConnectionInfo;
    Ok(url
        .into_connection_info()?
        .set_tcp_settings(TcpSettings::default().set_nodelay(true)))
}

/// With durable writes, their connections of their own (opened by `open`, as the store's is).
fn durable<E>(
    ack: Option<Ack>,
    open: impl Fn() -> Result<Link, E>,
) -> Result<Option<(Ack, Vec<Link>)>, E> {
    let Some(ack) = ack else { return Ok(None) };
    let links = (0..durable::CONNECTIONS)
        .map(|_| open())
        .collect::<Result<_, _>>()?;
    Ok(Some((ack, links)))
}

/// Refuses the first malformed URL among `urls` (of a Cluster `node` or a `sentinel`), saying
/// what is wrong with it.
fn check_urls(what: &str, urls: &[String]) -> Result<(), StoreError> {
    for (i, url) in urls.iter().enumerate() {
        if let Some(problem) = url::problem(url) {
            let message = format!("invalid Redis URL of {what} {}: {problem}", i + 1);
            return Err(StoreError::new(StoreErrorKind::Config, message));
        }
    }
    Ok(())
}
