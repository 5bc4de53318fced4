//! The store a service's limits live in, opened from `--store` URLs: a standalone Redis or
//! Valkey, a Redis Cluster, or PostgreSQL.

use std::sync::Arc;
use std::time::Duration;

use clap::Args;
use tollgate::store::{PgStore, RedisStore, Store, StoreError, StoreErrorKind};

/// Where the store is and how long it may take.
#[derive(Debug, Args)]
pub(crate) struct StoreArgs {
    /// The store's URL: redis://host:6379/0 (rediss:// for TLS, valkey:// too), or
    /// postgres://user:password@host:5432/db. Repeat it to name several nodes of a Redis Cluster.
    #[arg(long = "store", value_name = "URL", required = true)]
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

/// Which kind of store the URLs name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Redis,
    Cluster,
    Postgres,
}

impl StoreArgs {
    fn kind(&self) -> Result<Kind, String> {
        let postgres = |url: &String| {
            let url = url.to_ascii_lowercase();
            url.starts_with("postgres://") || url.starts_with("postgresql://")
        };
        let pg = self.urls.iter().filter(|url| postgres(url)).count();
        match (pg, self.urls.len()) {
            (0, 1) if !self.cluster => Ok(Kind::Redis),
            (0, _) => Ok(Kind::Cluster),
            (1, 1) if !self.cluster => Ok(Kind::Postgres),
            (_, 1) => Err("--cluster is for Redis Cluster nodes, not a PostgreSQL URL".to_owned()),
            _ => Err("give one PostgreSQL URL, or the Redis URLs of a cluster's nodes".to_owned()),
        }
    }

    /// What the URLs name, without passwords: for messages and output.
    pub(crate) fn describe(&self) -> String {
        let urls: Vec<String> = self.urls.iter().map(|url| redact(url)).collect();
        match self.kind() {
            Ok(Kind::Cluster) => format!("Redis Cluster {}", urls.join(", ")),
            _ => urls.join(", "),
        }
    }

    /// `message` with what to try when it says the PostgreSQL schema is missing.
    pub(crate) fn explain(&self, message: String) -> String {
        let missing = format!("schema \"{}\" does not exist", self.pg_schema);
        match self.kind() {
            Ok(Kind::Postgres) if message.contains(&missing) => format!(
                "{message}\n(the service's store is in another schema? name it with --pg-schema; \
                 this command never creates one)"
            ),
            _ => message,
        }
    }

    /// Opens the store: lazily for a standalone Redis and PostgreSQL (the first call finds out
    /// whether it answers), at once for a cluster (it reads the slot map).
    pub(crate) async fn open(&self) -> Result<Arc<dyn Store>, String> {
        let timeout = self.timeout;
        let store: Arc<dyn Store> = match self.kind()? {
            Kind::Redis => {
                let store = RedisStore::builder(self.urls[0].clone())
                    .timeout(timeout)
                    .build()
                    .map_err(|e| format!("--store {}: {e}", redact(&self.urls[0])))?;
                Arc::new(store)
            }
            Kind::Cluster => {
                let connect = RedisStore::cluster_builder(self.urls.iter().cloned())
                    .timeout(timeout)
                    .connect();
                // connecting may take several timeouts: the whole of it gets a bound of its own
                let store = tokio::time::timeout(timeout * 2, connect)
                    .await
                    .map_err(|_| format!("{} did not answer within {timeout:?}", self.describe()))?
                    .map_err(|e| format!("{}: {e}", self.describe()))?;
                Arc::new(store)
            }
            Kind::Postgres => {
                // built, not connected: `connect` would migrate the service's schema
                let store = PgStore::builder(self.urls[0].clone())
                    .timeout(timeout)
                    .schema(self.pg_schema.clone())
                    .purge_interval(None)
                    .pool_size(1)
                    .build()
                    .map_err(|e| format!("--store {}: {e}", redact(&self.urls[0])))?;
                Arc::new(store)
            }
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

/// `url` without the password of its user info: `redis://:secret@host/` as `redis://:***@host/`.
pub(crate) fn redact(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return url.to_owned();
    };
    let authority_end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    let (authority, tail) = rest.split_at(authority_end);
    let Some((user_info, host)) = authority.rsplit_once('@') else {
        return url.to_owned();
    };
    match user_info.split_once(':') {
        Some((user, _)) => format!("{scheme}://{user}:***@{host}{tail}"),
        None => url.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn passwords_are_not_repeated() {
        assert_eq!(redact("redis://:s3cret@h:6379/0"), "redis://:***@h:6379/0");
        assert_eq!(
            redact("postgres://app:pw@db/app?sslmode=require"),
            "postgres://app:***@db/app?sslmode=require"
        );
        assert_eq!(redact("redis://h:6379/"), "redis://h:6379/");
        assert_eq!(redact("postgres://app@db/app"), "postgres://app@db/app");
    }
}
