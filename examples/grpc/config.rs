//! Configuration from the environment, shared by the `grpc` and `hyper` examples (the latter
//! includes this file with `#[path = "../grpc/config.rs"]`). The variables are read with the
//! examples' shared `crate::env` (`examples/shared/env.rs`), which an including crate declares at
//! its root: `#[path = "../shared/env.rs"] pub mod env;`.
//!
//! | variable     | default                     | meaning                                        |
//! | ------------ | --------------------------- | ---------------------------------------------- |
//! | `PORT`       | per example                 | serve on `127.0.0.1:$PORT` (0: any free port)  |
//! | `REDIS_URL`  | unset: in-memory store      | the store all copies share                     |
//! | `APP_LIMITS` | `burst:5/1s,minute:100/60s` | the limits: `name:count/<seconds>s,…`          |
//!
//! A variable that is unset or empty takes its default; an invalid one is an [`EnvError`] naming
//! it (the examples then exit with status 2).

use std::sync::Arc;

use tollgate::rate_limit::{Algorithm, Limit};
use tollgate::store::Store;

use crate::env::{self, EnvError, Vars, process_var};

/// What `PORT` must look like.
pub const PORT_FORMAT: &str = "a TCP port number from 0 to 65535, e.g. PORT=50051";

/// What the examples warn of when `REDIS_URL` is not set.
const MEMORY_STORE_WARNING: &str = "REDIS_URL is not set: using an in-memory store, so rate \
     limits and idempotency records hold for this one process only (copies of the server do not \
     share them). Set e.g. REDIS_URL=redis://127.0.0.1:6379/ to share them.";

/// An example server's configuration. Its `Debug` shows the store URL without its password.
#[derive(Clone, PartialEq, Eq)]
pub struct Config {
    /// `PORT`: served on `127.0.0.1:<port>` (0: any free port).
    pub port: u16,
    /// `REDIS_URL`: the shared store; `None` means an in-memory store for this process only.
    pub redis_url: Option<String>,
    /// `APP_LIMITS`: the rate limits, all checked together.
    pub limits: Vec<Limit>,
}

impl std::fmt::Debug for Config {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Config")
            .field("port", &self.port)
            .field("redis_url", &self.redis_url.as_deref().map(env::redact_url))
            .field("limits", &self.limits)
            .finish()
    }
}

impl Config {
    /// Reads `PORT` (default `default_port`), `REDIS_URL` and `APP_LIMITS` from the environment.
    pub fn from_env(default_port: u16) -> Result<Self, EnvError> {
        Self::from_lookup(default_port, process_var)
    }

    /// Like [`Config::from_env`], with the variables read through `lookup`.
    pub fn from_lookup(
        default_port: u16,
        lookup: impl Fn(&str) -> Option<String>,
    ) -> Result<Self, EnvError> {
        let vars = Vars::new(lookup);
        Ok(Self {
            port: vars.port(default_port, PORT_FORMAT)?,
            limits: vars.limits(Algorithm::default())?,
            redis_url: vars.redis_url(),
        })
    }

    /// The limits as `name:count/<seconds>s,…`, for the startup message.
    pub fn describe_limits(&self) -> String {
        env::describe_limits(&self.limits)
    }

    /// The store named by `REDIS_URL`, or — with a warning on stderr — a memory store whose
    /// limits and idempotency records hold for this one process only.
    pub fn open_store(&self) -> Result<Arc<dyn Store>, EnvError> {
        env::open_store(self.redis_url.as_deref(), MEMORY_STORE_WARNING)
    }
}
