//! The examples' startup steps: opening the store, listening, exit statuses.

use super::*;

/// The store named by `redis_url` (`REDIS_URL`) or, when it is unset, a memory store that holds
/// for this one process only, with `memory_warning` on stderr after `warning: `.
pub fn open_store(
    redis_url: Option<&str>,
    memory_warning: &str,
) -> Result<Arc<dyn Store>, EnvError> {
    let Some(url) = redis_url else {
        eprintln!("warning: {memory_warning}");
        // tollgate: allow(one copy only, when REDIS_URL is unset; it warns so)
        return Ok(Arc::new(MemoryStore::new()));
    };
    redis_store(url, 0, None)
}

/// A store on the standalone Redis at `url`, whose claims, locks and records `wait_replicas`
/// replicas must acknowledge, and whose calls may take `timeout` (`None`: the store's default).
#[cfg(feature = "redis")]
pub fn redis_store(
    url: &str,
    wait_replicas: u32,
    timeout: Option<Duration>,
) -> Result<Arc<dyn Store>, EnvError> {
    let mut builder = tollgate::store::RedisStore::builder(url).wait_replicas(wait_replicas);
    if let Some(timeout) = timeout {
        builder = builder.timeout(timeout);
    }
    // `REDIS_CA_CERT`: the path of a PEM CA certificate to trust for a `rediss://` URL
    #[cfg(any(feature = "tls-rustls", feature = "tls-native-tls"))]
    let builder = match std::env::var_os("REDIS_CA_CERT").filter(|path| !path.is_empty()) {
        Some(path) => match std::fs::read(&path) {
            Ok(pem) => builder.tls_ca_cert(pem),
            Err(e) => {
                return Err(EnvError::new(
                    "REDIS_CA_CERT",
                    &path.to_string_lossy(),
                    format!("cannot be read: {e}"),
                    "the path of a CA certificate in PEM",
                ));
            }
        },
        None => builder,
    };
    match builder.build() {
        Ok(store) => Ok(Arc::new(store)),
        Err(e) => Err(EnvError::new(
            "REDIS_URL",
            &redact_url(url),
            e.to_string(),
            REDIS_URL_FORMAT,
        )),
    }
}

#[cfg(not(feature = "redis"))]
pub fn redis_store(
    url: &str,
    _wait_replicas: u32,
    _timeout: Option<Duration>,
) -> Result<Arc<dyn Store>, EnvError> {
    Err(EnvError::new(
        "REDIS_URL",
        &redact_url(url),
        "tollgate was built without its `redis` feature",
        "REDIS_URL unset, or a build with the `redis` feature",
    ))
}

/// Why an example stopped: its exit status and a message for stderr.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Failure {
    /// The exit status: [`EXIT_CONFIG`] or [`EXIT_FAILURE`].
    pub code: u8,
    /// What went wrong, printed after `error: `.
    pub message: String,
}

impl Failure {
    /// An invalid configuration or command line: exit status [`EXIT_CONFIG`].
    pub fn config(message: impl Into<String>) -> Self {
        Self {
            code: EXIT_CONFIG,
            message: message.into(),
        }
    }

    /// Any other failure (the port is taken, the server failed): exit status [`EXIT_FAILURE`].
    pub fn runtime(message: impl Into<String>) -> Self {
        Self {
            code: EXIT_FAILURE,
            message: message.into(),
        }
    }
}

impl From<EnvError> for Failure {
    fn from(error: EnvError) -> Self {
        Self::config(error.to_string())
    }
}

/// The exit status of `result`; a failure's message goes to stderr first.
pub fn exit(result: Result<(), Failure>) -> ExitCode {
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(failure) => {
            eprintln!("error: {}", failure.message);
            ExitCode::from(failure.code)
        }
    }
}

/// A listener on `127.0.0.1:port` (0: any free port) and the address it got.
pub async fn listen(port: u16) -> Result<(TcpListener, SocketAddr), Failure> {
    let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, port))
        .await
        .map_err(|e| Failure::runtime(format!("cannot listen on 127.0.0.1:{port}: {e}")))?;
    let addr = listener
        .local_addr()
        .map_err(|e| Failure::runtime(format!("cannot read the listening address: {e}")))?;
    Ok((listener, addr))
}

/// Resolves on Ctrl-C (or when Ctrl-C cannot be listened for, never).
pub async fn ctrl_c() {
    if tokio::signal::ctrl_c().await.is_err() {
        std::future::pending::<()>().await;
    }
}
