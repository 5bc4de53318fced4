//! [`PgStoreBuilder`]: how a [`PgStore`] reaches PostgreSQL, and its settings.

use std::fmt;
use std::str::FromStr;
use std::time::Duration;

use deadpool_postgres::{Manager, ManagerConfig, Pool, RecyclingMethod, Runtime};

use super::PgStore;
use super::invalidation as listen;
use super::sql::{DEFAULT_SCHEMA, check_schema};
use super::tls;
use crate::error::{ConfigError, ConfigErrorKind};
use crate::store::coalesce::DEFAULT_MAX_BATCH;
use crate::store::span::Server;
use crate::store::{Redacted, StoreError, StoreErrorKind, millis};

/// The per-call timeout unless configured otherwise.
pub(super) const DEFAULT_TIMEOUT: Duration = Duration::from_millis(250);
/// How often expired rows are purged unless configured otherwise.
pub(super) const DEFAULT_PURGE_INTERVAL: Duration = Duration::from_secs(60);
/// Rows deleted per table and statement by a purge, unless configured otherwise.
pub(super) const DEFAULT_PURGE_BATCH: u32 = 1000;
/// The bound of a migration unless configured otherwise.
pub(super) const DEFAULT_MIGRATION_TIMEOUT: Duration = Duration::from_secs(30);
const DEFAULT_POOL_SIZE: usize = 16;

/// Builds a [`PgStore`]: from a connection URL ([`PgStore::builder`]) or from a pool the
/// application made ([`PgStore::pool_builder`]).
///
/// ```
/// use std::time::Duration;
/// use tollgate::store::PgStore;
///
/// let builder = PgStore::builder("postgres://app@127.0.0.1/app")
///     .timeout(Duration::from_millis(100))
///     .schema("limits")
///     .pool_size(8)
///     .unlogged_rate_limits(false)
///     .purge_interval(Duration::from_secs(30));
/// # drop(builder);
/// // a schema name that would need quoting is refused when the store is built
/// assert!(PgStore::builder("postgres://127.0.0.1/app").schema("Bad-Name").build().is_err());
/// // `Debug` shows where it connects, never the password
/// let builder = PgStore::builder("postgres://app:s3cret@db/app");
/// assert!(format!("{builder:?}").contains("postgres://app:***@db/app"));
/// assert!(!format!("{builder:?}").contains("s3cret"));
/// ```
#[must_use]
pub struct PgStoreBuilder {
    source: Source,
    pub(super) settings: Settings,
}

enum Source {
    Url(String),
    Pool(Pool),
}

/// What a store keeps of its builder.
#[derive(Debug, Clone)]
pub(super) struct Settings {
    pub(super) timeout: Duration,
    pub(super) schema: String,
    pub(super) pool_size: usize,
    pub(super) unlogged_rate_limits: bool,
    pub(super) purge_interval: Option<Duration>,
    pub(super) purge_batch: u32,
    pub(super) migration_timeout: Duration,
    pub(super) max_batch: usize,
    /// Where the store's calls go, for their spans: known for a store made from a URL.
    pub(super) server: Option<Server>,
}

impl Default for Settings {
    fn default() -> Self {
        Self {
            timeout: DEFAULT_TIMEOUT,
            schema: DEFAULT_SCHEMA.to_owned(),
            pool_size: DEFAULT_POOL_SIZE,
            unlogged_rate_limits: true,
            purge_interval: Some(DEFAULT_PURGE_INTERVAL),
            purge_batch: DEFAULT_PURGE_BATCH,
            migration_timeout: DEFAULT_MIGRATION_TIMEOUT,
            max_batch: DEFAULT_MAX_BATCH,
            server: None,
        }
    }
}

impl fmt::Debug for PgStoreBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // the URL may carry a password: it shows redacted
        let mut debug = f.debug_struct("PgStoreBuilder");
        match &self.source {
            Source::Url(url) => debug.field("url", &Redacted(url)),
            Source::Pool(_) => debug.field("source", &"pool"),
        };
        debug.field("settings", &self.settings).finish()
    }
}

impl PgStoreBuilder {
    pub(super) fn from_url(url: String) -> Self {
        Self {
            source: Source::Url(url),
            settings: Settings::default(),
        }
    }

    pub(super) fn from_pool(pool: Pool) -> Self {
        Self {
            source: Source::Pool(pool),
            settings: Settings::default(),
        }
    }

    /// The bound of every call — pool checkout, statement preparation, execution and commit
    /// together — default 250 ms, and the deadline of the rate checks. Every call also sets the
    /// server's `statement_timeout` to what is left of it, in its own transaction (`SET
    /// LOCAL`), on any pool, so that the server gives up on a statement when the caller does; a
    /// store made from a URL sets it for its connections' other statements too.
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.settings.timeout = timeout;
        self
    }

    /// The most rate checks one call carries (default 32). Checks that wait for the store at
    /// the same moment go out as one call of one function (`decide_rates`) that decides them in
    /// turn, each exactly as it would be decided alone, in one transaction: the database pays
    /// for a round trip, a transaction and a commit once per batch. The first check goes at
    /// once; checks that arrive while calls are in flight wait for the next one, which goes out
    /// as soon as it is full, when a call returns, or after half a millisecond. 1 sends every
    /// check alone.
    pub fn max_batch(mut self, checks: usize) -> Self {
        self.settings.max_batch = checks.max(1);
        self
    }

    /// The schema of the store's tables and functions, default `tollgate`: 1 to 63 lowercase
    /// ASCII letters, digits and `_`, not starting with a digit (checked by
    /// [`build`](Self::build)).
    pub fn schema(mut self, schema: impl Into<String>) -> Self {
        self.settings.schema = schema.into();
        self
    }

    /// The most connections of a store made from a URL, default 16 (a given pool keeps its
    /// own size).
    pub fn pool_size(mut self, connections: usize) -> Self {
        self.settings.pool_size = connections.max(1);
        self
    }

    /// Whether [`migrate`](PgStore::migrate) makes the rate-limit tables `UNLOGGED` (default
    /// `true`): faster writes, no WAL, emptied when the server restarts after a crash (see
    /// [Durability](PgStore#durability)). Claims, locks, fencing counters and idempotency
    /// records are always logged. A later migration with another choice alters the tables.
    pub fn unlogged_rate_limits(mut self, unlogged: bool) -> Self {
        self.settings.unlogged_rate_limits = unlogged;
        self
    }

    /// How often a background task deletes expired rows ([`PgStore::purge_expired`]),
    /// default every 60 s; `None` turns it off (call `purge_expired` yourself, or not at all:
    /// expired rows count as absent either way). The task runs on the tokio runtime the store
    /// is built on and stops when the last clone of the store is dropped.
    pub fn purge_interval(mut self, interval: impl Into<Option<Duration>>) -> Self {
        self.settings.purge_interval = interval.into().filter(|d| !d.is_zero());
        self
    }

    /// The most rows a purge deletes from one table per statement, default 1000: each
    /// statement stays short, and a purge sends statements until one table has fewer left.
    pub fn purge_batch(mut self, rows: u32) -> Self {
        self.settings.purge_batch = rows.clamp(1, i32::MAX as u32);
        self
    }

    /// The bound of [`PgStore::migrate`], default 30 s (DDL may wait for other migrations and
    /// for locks held by running statements).
    pub fn migration_timeout(mut self, timeout: Duration) -> Self {
        self.settings.migration_timeout = timeout;
        self
    }

    /// The store. Connects lazily: this fails only on an invalid URL or schema, never because
    /// the server is down. The schema must exist: call [`PgStore::migrate`] (or use
    /// [`connect`](Self::connect)). Outside a tokio runtime no purge task is started.
    pub fn build(self) -> Result<PgStore, ConfigError> {
        check_schema(&self.settings.schema)?;
        let mut settings = self.settings;
        let (pool, listen) = match self.source {
            Source::Pool(pool) => (pool, None),
            Source::Url(url) => {
                let (pool, server, listen) = pool_for(&url, &settings)?;
                settings.server = server;
                (pool, Some(listen))
            }
        };
        Ok(PgStore::new(pool, listen, settings))
    }

    /// Builds the store and runs [`PgStore::migrate`]: a store ready for use, or the error of
    /// the first round trip (an invalid URL or schema gives kind
    /// [`Config`](StoreErrorKind::Config)).
    pub async fn connect(self) -> Result<PgStore, StoreError> {
        let store = self
            .build()
            .map_err(|e| StoreError::new(StoreErrorKind::Config, e))?;
        store.migrate().await?;
        Ok(store)
    }
}

/// A pool of at most `settings.pool_size` connections to `url`, each with the store timeout as
/// its `statement_timeout` (a call sets its own as well); over TLS as the URL's `sslmode` says
/// (see `tls.rs`). With it, how the invalidation subscriber connects alike.
fn pool_for(
    url: &str,
    settings: &Settings,
) -> Result<(Pool, Option<Server>, listen::Source), ConfigError> {
    let tls = tls::split(url)?;
    // the URL is not repeated: it may carry a password
    let mut config = tokio_postgres::Config::from_str(&tls.url).map_err(|e| {
        ConfigError::new(
            ConfigErrorKind::Store,
            format!("invalid PostgreSQL URL: {e}"),
        )
    })?;
    let statement_timeout = format!("-c statement_timeout={}", millis(settings.timeout));
    let options = match config.get_options() {
        Some(given) if !given.is_empty() => format!("{given} {statement_timeout}"),
        _ => statement_timeout,
    };
    config.options(&options);
    if config.get_connect_timeout().is_none() {
        config.connect_timeout(settings.timeout);
    }
    let server = server_of(&config);
    let (manager, listen) = manager(config, &tls)?;
    let pool = Pool::builder(manager)
        .max_size(settings.pool_size)
        .runtime(Runtime::Tokio1)
        .build()
        .map_err(|e| {
            ConfigError::new(
                ConfigErrorKind::Store,
                format!("could not make the connection pool: {e}"),
            )
        })?;
    Ok((pool, server, listen))
}

/// The first TCP host of `config` and its port, where the pool connects first.
fn server_of(config: &tokio_postgres::Config) -> Option<Server> {
    let port = config.get_ports().first().copied().unwrap_or(5432);
    let named = config.get_hosts().iter().find_map(|host| match host {
        tokio_postgres::config::Host::Tcp(name) => Some(name.as_str().into()),
        #[cfg(unix)]
        tokio_postgres::config::Host::Unix(_) => None,
    });
    let address = named.or_else(|| {
        let addr = config.get_hostaddrs().first()?;
        Some(addr.to_string().into_boxed_str())
    })?;
    Some(Server { address, port })
}

/// The pool's manager, and how the invalidation subscriber connects: plain, or over TLS as
/// `tls` asks.
fn manager(
    mut config: tokio_postgres::Config,
    tls: &tls::Split,
) -> Result<(Manager, listen::Source), ConfigError> {
    let recycling = ManagerConfig {
        recycling_method: RecyclingMethod::Fast,
    };
    let plain = |config: tokio_postgres::Config| {
        let listen = listen::Source::Plain(config.clone());
        (
            Manager::from_config(config, tokio_postgres::NoTls, recycling.clone()),
            listen,
        )
    };
    if tls.mode == tls::Mode::Disable {
        return Ok(plain(config));
    }
    #[cfg(feature = "postgres-tls")]
    {
        use tokio_postgres::config::SslMode;
        let mode = if tls.mode == tls::Mode::Prefer {
            SslMode::Prefer
        } else {
            SslMode::Require
        };
        config.ssl_mode(mode);
        let connector = tls::connector(tls.mode, tls.root_cert.as_deref())?;
        let listen = listen::Source::Tls(config.clone(), connector.clone());
        Ok((Manager::from_config(config, connector, recycling), listen))
    }
    #[cfg(not(feature = "postgres-tls"))]
    {
        if tls.mode == tls::Mode::Prefer && tls.root_cert.is_none() {
            // no TLS to offer: plain text, as `prefer` allows
            config.ssl_mode(tokio_postgres::config::SslMode::Disable);
            return Ok(plain(config));
        }
        Err(ConfigError::new(
            ConfigErrorKind::Store,
            "the PostgreSQL URL asks for TLS (sslmode): enable the tollgate feature `postgres-tls`",
        ))
    }
}
