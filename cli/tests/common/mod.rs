//! What the `inspect` / `reset` tests share: a limits file, the service's layer built from it
//! as the service builds it, requests spent through it, and the binary run.

#![allow(dead_code, clippy::unwrap_used, clippy::expect_used)]

pub(crate) mod cluster;
pub(crate) mod state;

use std::convert::Infallible;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;

use http::{Request, Response, StatusCode};
use serde::Deserialize;
use tollgate::key::{Header, KeyExtractor, PeerIp};
use tollgate::rate_limit::{RateLimitConfig, RateLimitLayer};
use tollgate::store::RateStore;
use tower::{Layer, ServiceExt};

/// A port of `127.0.0.1` that is free now, drawn between 10,000 and 22,000: below the kernel's
/// ephemeral range (32768 and up on Linux), where no outgoing connection takes it before the
/// server does and a machine busy with short connections still has room, with room above it
/// for a Cluster node's bus port (port + 10,000).
pub(crate) fn free_port() -> u16 {
    use std::hash::{BuildHasher, Hasher};
    loop {
        let random = std::collections::hash_map::RandomState::new()
            .build_hasher()
            .finish();
        let port = 10_000 + (random % 12_000) as u16;
        if std::net::TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return port;
        }
    }
}

/// A caller's key as the command shows it: at most 4 characters and a third of it, then `…`.
pub(crate) fn masked(key: &str) -> String {
    let shown = (key.chars().count() / 3).min(4);
    format!("{}…", key.chars().take(shown).collect::<String>())
}

/// The service's file: other settings beside its limits under `[rate_limit]`, as the `config`
/// example writes it.
pub(crate) const TOLLGATE_TOML: &str = r#"
port = 3000

[rate_limit]
prefix = "svc"
limits = [
    { name = "minute", quota = 5, window = "1m" },
    { name = "hour", quota = 100, window = "1h" },
]

[rate_limit.tiers]
paid = [{ name = "minute", quota = 50, window = "1m" }]

[idempotency]
required = true
"#;

/// A file with a penalty: the second request in a minute blocks the caller for an hour.
pub(crate) const PENALTY_TOML: &str = r#"
limits = [{ name = "strict", quota = 1, window = "1m", block_for = "1h" }]
"#;

/// `text` written as `tollgate.toml` in a new folder (kept while the `TempDir` lives).
pub(crate) fn write_config(text: &str) -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("tollgate.toml");
    std::fs::write(&path, text).unwrap();
    (dir, path)
}

/// The limits of the file at `path`, as the service reads them.
pub(crate) fn read_config(path: &Path) -> RateLimitConfig {
    #[derive(Deserialize)]
    struct Wrapped {
        rate_limit: RateLimitConfig,
    }
    let text = std::fs::read_to_string(path).unwrap();
    toml::from_str::<Wrapped>(&text)
        .map(|w| w.rate_limit)
        .or_else(|_| toml::from_str::<RateLimitConfig>(&text))
        .unwrap()
}

/// The service's layer: keyed by `x-api-key`, its tier from `x-plan`.
pub(crate) fn by_api_key(store: Arc<dyn RateStore>, path: &Path) -> RateLimitLayer<Header> {
    let config = read_config(path);
    let tiers = !config.tiers.is_empty();
    let mut builder = RateLimitLayer::builder(store).config(config);
    if tiers {
        builder = builder.tier_by(|parts| parts.headers.get("x-plan")?.to_str().ok());
    }
    builder
        .key(Header::from_static("x-api-key"))
        .build()
        .unwrap()
}

/// The service's layer keyed by the peer address.
pub(crate) fn by_peer_ip(store: Arc<dyn RateStore>, path: &Path) -> RateLimitLayer<PeerIp> {
    RateLimitLayer::builder(store)
        .config(read_config(path))
        .key(PeerIp::new())
        .build()
        .unwrap()
}

/// One request through `layer` with `headers` (and a peer address), as the service answers it.
pub(crate) async fn call<K: KeyExtractor>(
    layer: &RateLimitLayer<K>,
    headers: &[(&str, &str)],
    peer: Option<SocketAddr>,
) -> StatusCode {
    let service = layer.layer(tower::service_fn(|_: Request<String>| async {
        Ok::<_, Infallible>(Response::new(String::new()))
    }));
    let mut request = Request::get("/api/hello");
    for (name, value) in headers {
        request = request.header(*name, *value);
    }
    let mut request = request.body(String::new()).unwrap();
    if let Some(peer) = peer {
        request.extensions_mut().insert(peer);
    }
    service.oneshot(request).await.unwrap().status()
}

/// What the binary did.
#[derive(Debug)]
pub(crate) struct Run {
    pub(crate) code: i32,
    pub(crate) stdout: String,
    pub(crate) stderr: String,
}

impl Run {
    /// The output of a run that found what it was asked about (exit 0), as JSON.
    pub(crate) fn json(&self) -> serde_json::Value {
        assert_eq!(self.code, 0, "{self:?}");
        serde_json::from_str(&self.stdout).unwrap_or_else(|e| panic!("{e}: {self:?}"))
    }

    /// The output of a run that found nothing in the store under what it was asked about
    /// (exit 1, saying so on stderr), as JSON.
    pub(crate) fn json_of_nothing(&self) -> serde_json::Value {
        assert_eq!(self.code, 1, "{self:?}");
        assert!(self.stderr.starts_with("nothing "), "{self:?}");
        serde_json::from_str(&self.stdout).unwrap_or_else(|e| panic!("{e}: {self:?}"))
    }
}

/// Runs `tollgate` with `args` (off the test's runtime thread).
pub(crate) async fn tollgate(args: &[&str]) -> Run {
    let args: Vec<String> = args.iter().map(|a| (*a).to_owned()).collect();
    tokio::task::spawn_blocking(move || {
        let output = Command::new(env!("CARGO_BIN_EXE_tollgate"))
            .args(&args)
            .output()
            .unwrap();
        Run {
            code: output.status.code().unwrap_or(-1),
            stdout: String::from_utf8_lossy(&output.stdout).into_owned(),
            stderr: String::from_utf8_lossy(&output.stderr).into_owned(),
        }
    })
    .await
    .unwrap()
}

/// Each limit's `(name, quota, remaining)` of an `inspect --json` answer.
pub(crate) fn remaining(json: &serde_json::Value) -> Vec<(String, u64, u64)> {
    json["limits"]
        .as_array()
        .unwrap()
        .iter()
        .map(|limit| {
            (
                limit["name"].as_str().unwrap().to_owned(),
                limit["quota"].as_u64().unwrap(),
                limit["remaining"].as_u64().unwrap(),
            )
        })
        .collect()
}

/// `(name, quota, remaining)` rows, for the expectations.
pub(crate) fn rows(rows: &[(&str, u64, u64)]) -> Vec<(String, u64, u64)> {
    rows.iter()
        .map(|(name, quota, left)| ((*name).to_owned(), *quota, *left))
        .collect()
}
