//! [`RedisStoreBuilder`] and [`RedisClusterBuilder`].

use std::time::Duration;

use redis::RedisError;
use redis::aio::{ConnectionManager, ConnectionManagerConfig};

use super::connection::{Connection, Link, Opener};
use super::{RedisStore, store_error};
use crate::error::{ConfigError, ConfigErrorKind};
use crate::store::{StoreError, StoreErrorKind};

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

/// The default bound on every store call.
const DEFAULT_TIMEOUT: Duration = Duration::from_millis(250);

impl RedisStoreBuilder {
    pub(super) fn new(url: String) -> Self {
        Self {
            url,
            timeout: DEFAULT_TIMEOUT,
        }
    }

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
        let manager = ConnectionManager::new_lazy_with_config(client.clone(), config.clone())
            .map_err(invalid)?;
        let opener = Opener::Single { client, config };
        let link = Link::new(Connection::Single(manager), opener);
        Ok(RedisStore::new(link, self.timeout))
    }
}

impl RedisClusterBuilder {
    pub(super) fn new(nodes: Vec<String>) -> Self {
        Self {
            nodes,
            timeout: DEFAULT_TIMEOUT,
        }
    }

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
        let opener = Opener::Cluster {
            client,
            timeout: self.timeout,
        };
        let link = Link::new(Connection::Cluster(conn), opener);
        Ok(RedisStore::new(link, self.timeout))
    }
}
