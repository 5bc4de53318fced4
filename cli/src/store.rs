//! The store a service's limits live in, opened from `--store` URLs (or the environment
//! variable `TOLLGATE_STORE`): a standalone Redis or Valkey, a Redis Cluster, or PostgreSQL.

use std::sync::Arc;
use std::time::Duration;

use clap::Args;
use tollgate::store::{
    PgStore, RedisStore, Store, StoreError, StoreErrorKind, redact_connection_string as redact,
};

/// The environment variable that names the store when `--store` is not given: one URL (or a
/// PostgreSQL `key=value` string), or the URLs of Redis Cluster nodes separated by commas or
/// spaces. `--store` wins over it.
pub(crate) const STORE_VAR: &str = "TOLLGATE_STORE";

/// Where the store is and how long it may take. Its `Debug` shows the URLs redacted.
#[derive(Args)]
pub(crate) struct StoreArgs {
    /// The store's URL: redis://host:6379/0 (rediss:// for TLS, valkey:// too), or
    /// postgres://user:password@host:5432/db (or a key=value string, host=db user=app …).
    /// Repeat it to name several nodes of a Redis Cluster. Without it, the environment
    /// variable TOLLGATE_STORE (which keeps a password off the command line).
    #[arg(long = "store", value_name = "URL")]
    urls: Vec<String>,
    /// The Redis URLs are nodes of a Redis Cluster (implied when --store is given more than once).
    #[arg(long)]
    cluster: bool,
    /// The PostgreSQL schema of the service's store (`PgStoreBuilder::schema`).
    #[arg(long, value_name = "NAME", default_value = "tollgate")]
    pg_schema: String,
    /// How long the store may take to answer, e.g. 3s or 500ms; past it, an error (exit 2).
    #[arg(long, value_name = "DURATION", default_value = "3s", value_parser = crate::check::parse_duration)]
    pub(crate) timeout: Duration,
}

impl std::fmt::Debug for StoreArgs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let urls: Vec<String> = self.urls.iter().map(|url| redact(url)).collect();
        f.debug_struct("StoreArgs")
            .field("urls", &urls)
            .field("cluster", &self.cluster)
            .field("pg_schema", &self.pg_schema)
            .field("timeout", &self.timeout)
            .finish()
    }
}

/// Which kind of store the URLs name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Redis,
    Cluster,
    Postgres,
}

/// Whether `url` names a PostgreSQL database: a `postgres://` or `postgresql://` URL, or a
/// `key=value` connection string.
fn postgres(url: &str) -> bool {
    let lower = url.trim_start().to_ascii_lowercase();
    lower.starts_with("postgres://")
        || lower.starts_with("postgresql://")
        || (!lower.contains("://") && lower.contains('='))
}

/// The store URLs in `value`, the environment variable's: Redis URLs separated by commas or
/// white space (a cluster's nodes), else the whole of it as one URL or connection string.
fn urls_in(value: &str) -> Vec<String> {
    let redis = |url: &str| {
        let lower = url.to_ascii_lowercase();
        [
            "redis://",
            "rediss://",
            "valkey://",
            "valkeys://",
            "redis+unix://",
            "unix://",
        ]
        .iter()
        .any(|scheme| lower.starts_with(scheme))
    };
    let pieces: Vec<&str> = value
        .split(|c: char| c == ',' || c.is_whitespace())
        .filter(|piece| !piece.is_empty())
        .collect();
    if !pieces.is_empty() && pieces.iter().all(|piece| redis(piece)) {
        return pieces.into_iter().map(str::to_owned).collect();
    }
    match value.trim() {
        "" => Vec::new(),
        whole => vec![whole.to_owned()],
    }
}

impl StoreArgs {
    /// Whether `--store` was given (`TOLLGATE_STORE` does not count): for a command whose
    /// store is optional.
    pub(crate) fn given(&self) -> bool {
        !self.urls.is_empty()
    }

    /// The store's URLs: `--store`'s, else those of `TOLLGATE_STORE`.
    fn urls(&self) -> Result<Vec<String>, String> {
        if !self.urls.is_empty() {
            return Ok(self.urls.clone());
        }
        let from_env = std::env::var(STORE_VAR).map(|value| urls_in(&value));
        match from_env {
            Ok(urls) if !urls.is_empty() => Ok(urls),
            Ok(_) => Err(format!(
                "{STORE_VAR} is empty: name the store with --store URL or {STORE_VAR}"
            )),
            Err(std::env::VarError::NotUnicode(_)) => {
                Err(format!("{STORE_VAR} is not valid UTF-8"))
            }
            Err(std::env::VarError::NotPresent) => Err(format!(
                "name the store: --store URL, or the environment variable {STORE_VAR}"
            )),
        }
    }

    /// Where the URLs came from, for errors: `--store` or `TOLLGATE_STORE`.
    fn origin(&self) -> &'static str {
        match self.urls.is_empty() {
            true => STORE_VAR,
            false => "--store",
        }
    }

    fn kind(&self, urls: &[String]) -> Result<Kind, String> {
        let pg = urls.iter().filter(|url| postgres(url)).count();
        match (pg, urls.len()) {
            (0, 1) if !self.cluster => Ok(Kind::Redis),
            (0, _) => Ok(Kind::Cluster),
            (1, 1) if !self.cluster => Ok(Kind::Postgres),
            (_, 1) => Err("--cluster is for Redis Cluster nodes, not a PostgreSQL URL".to_owned()),
            _ => Err("give one PostgreSQL URL, or the Redis URLs of a cluster's nodes".to_owned()),
        }
    }

    /// What the URLs name, without passwords: for messages and output.
    pub(crate) fn describe(&self) -> String {
        let urls = self.urls().unwrap_or_default();
        let shown: Vec<String> = urls.iter().map(|url| redact(url)).collect();
        match self.kind(&urls) {
            Ok(Kind::Cluster) => format!("Redis Cluster {}", shown.join(", ")),
            _ => shown.join(", "),
        }
    }

    /// `message` with what to try when it says the PostgreSQL schema is missing.
    pub(crate) fn explain(&self, message: String) -> String {
        let missing = format!("schema \"{}\" does not exist", self.pg_schema);
        let kind = self.urls().and_then(|urls| self.kind(&urls));
        match kind {
            Ok(Kind::Postgres) if message.contains(&missing) => format!(
                "{message}\n(the service's store is in another schema? name it with --pg-schema; \
                 this command never creates one)"
            ),
            // a store function this version calls is not there: the schema is an older one's
            Ok(Kind::Postgres)
                if message.contains("function") && message.contains("does not exist") =>
            {
                format!(
                    "{message}\n(the store's schema is older than this tollgate's: this command \
                     never migrates it. Use the tollgate of the service's version, or start a copy \
                     of the service built with this one, which migrates it)"
                )
            }
            _ => message,
        }
    }

    /// Opens the store: lazily for a standalone Redis and PostgreSQL (the first call finds out
    /// whether it answers), at once for a cluster (it reads the slot map).
    pub(crate) async fn open(&self) -> Result<Arc<dyn Store>, String> {
        let timeout = self.timeout;
        let urls = self.urls()?;
        let store: Arc<dyn Store> = match (self.kind(&urls)?, urls.as_slice()) {
            (Kind::Redis, [url]) => {
                let store = RedisStore::builder(url.clone())
                    .timeout(timeout)
                    .build()
                    .map_err(|e| format!("{} {}: {e}", self.origin(), redact(url)))?;
                Arc::new(store)
            }
            (Kind::Cluster, _) => {
                let connect = RedisStore::cluster_builder(urls.iter().cloned())
                    .timeout(timeout)
                    .connect();
                // connecting may take several timeouts: the whole of it gets a bound of its own
                let store = tokio::time::timeout(timeout * 2, connect)
                    .await
                    .map_err(|_| format!("{} did not answer within {timeout:?}", self.describe()))?
                    .map_err(|e| format!("{}: {e}", self.describe()))?;
                Arc::new(store)
            }
            (Kind::Postgres, [url]) => {
                // built, not connected: `connect` would migrate the service's schema
                let store = PgStore::builder(url.clone())
                    .timeout(timeout)
                    .schema(self.pg_schema.clone())
                    .purge_interval(None)
                    .pool_size(1)
                    .build()
                    .map_err(|e| format!("{} {}: {e}", self.origin(), redact(url)))?;
                Arc::new(store)
            }
            _ => return Err("give one PostgreSQL URL, or the Redis URLs of a cluster".to_owned()),
        };
        Ok(store)
    }
}

impl StoreArgs {
    /// `call` bounded by the store's timeout (and a second more), its error naming the store.
    pub(crate) async fn bounded<T>(
        &self,
        call: impl Future<Output = Result<T, StoreError>>,
    ) -> Result<T, String> {
        let within = self.timeout + Duration::from_secs(1);
        let store = self.describe();
        match tokio::time::timeout(within, call).await {
            Ok(Ok(value)) => Ok(value),
            Ok(Err(e)) if e.kind() == StoreErrorKind::Timeout => Err(format!(
                "{store} did not answer within {:?} (--timeout)",
                self.timeout
            )),
            Ok(Err(e)) => Err(self.explain(format!("{store}: {e}"))),
            Err(_) => Err(format!("{store} did not answer within {within:?}")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The store arguments of a command line `tollgate ARGS…`.
    fn parse(args: &[&str]) -> StoreArgs {
        #[derive(clap::Parser)]
        struct Line {
            #[command(flatten)]
            store: StoreArgs,
        }
        let line = std::iter::once("tollgate").chain(args.iter().copied());
        <Line as clap::Parser>::try_parse_from(line).unwrap().store
    }

    #[test]
    fn the_variable_names_one_store_or_a_cluster() {
        assert_eq!(urls_in(" redis://:pw@h:6379/ "), ["redis://:pw@h:6379/"]);
        assert_eq!(
            urls_in("redis://h1:7000, redis://h2:7001"),
            ["redis://h1:7000", "redis://h2:7001"]
        );
        assert_eq!(
            urls_in("host=db password='a b' dbname=app"),
            ["host=db password='a b' dbname=app"]
        );
        assert_eq!(
            urls_in("postgresql://app:pw@h1,h2/app"),
            ["postgresql://app:pw@h1,h2/app"]
        );
        assert!(urls_in("  ").is_empty());
    }

    #[test]
    fn debug_shows_no_password() {
        let store = parse(&[
            "--store",
            "redis://:s3cret@h:6379/",
            "--store",
            "host=db password='s3 cret'",
        ]);
        let shown = format!("{store:?} {store:#?}");
        assert!(!shown.contains("s3"), "{shown}");
        assert!(shown.contains("redis://:***@h:6379/"), "{shown}");
    }

    #[test]
    fn a_schema_older_than_the_tool_is_named() {
        let store = parse(&["--store", "postgres://app@db/app"]);
        let missing =
            "db error: ERROR: function tollgate.reset_rate(text[], bigint) does not exist";
        let explained = store.explain(missing.to_owned());
        assert!(explained.starts_with(missing), "{explained}");
        assert!(
            explained.contains("older than this tollgate's"),
            "{explained}"
        );
        let other = "db error: ERROR: permission denied".to_owned();
        assert_eq!(store.explain(other.clone()), other);
    }

    #[test]
    fn key_value_strings_name_postgres() {
        assert!(postgres("host=db password=pw"));
        assert!(postgres("POSTGRES://db/app"));
        assert!(!postgres("redis://h/?x=1"));
        assert!(!postgres("redis+unix:///s.sock?pass=x"));
    }
}
