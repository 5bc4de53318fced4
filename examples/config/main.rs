//! A service configured from a TOML file, as a starting point to copy: rate limits with tiers
//! and shadow mode, a custom JSON rejection, an idempotent `POST`, Prometheus metrics, and the
//! store named by a URL (Redis or PostgreSQL) or none (in memory).
//!
//! ```text
//! cargo run --example config                                   # examples/config/tollgate.toml
//! STORE_URL=redis://127.0.0.1:6379/ cargo run --example config
//! STORE_URL=postgres://app@127.0.0.1:5432/app cargo run --example config
//! CONFIG=my.toml PORT=8080 cargo run --example config
//! ```
//!
//! | route | what it does |
//! | --- | --- |
//! | `GET /api/hello` | rate-limited per `x-api-key` (else one shared bucket), tier from `x-plan` (`paid`) — demo headers, unchecked: see `docs/security.md` |
//! | `POST /orders` | idempotent: a required `Idempotency-Key` runs once, retries replay it |
//! | `GET /metrics` | the crate's series in Prometheus text |
//!
//! A file or URL that is wrong stops the service with a message that says what is wrong
//! (exit status 2).

pub mod service;

use std::process::ExitCode;

use service::Config;

#[tokio::main]
async fn main() -> ExitCode {
    tracing_subscriber::fmt().with_target(false).init();
    match run().await {
        Ok(()) => ExitCode::SUCCESS,
        Err(message) => {
            eprintln!("error: {message}");
            ExitCode::from(2)
        }
    }
}

async fn run() -> Result<(), String> {
    let path = std::env::var("CONFIG").unwrap_or_else(|_| {
        concat!(env!("CARGO_MANIFEST_DIR"), "/examples/config/tollgate.toml").to_owned()
    });
    let text = std::fs::read_to_string(&path).map_err(|e| format!("{path}: {e}"))?;
    let config: Config = toml::from_str(&text).map_err(|e| format!("{path}: {e}"))?;
    let store = service::open(std::env::var("STORE_URL").ok().or(config.store.clone())).await?;
    let recorder = metrics_exporter_prometheus::PrometheusBuilder::new()
        .install_recorder()
        .map_err(|e| e.to_string())?;
    let app = service::router(&config, store, recorder).map_err(|e| format!("{path}: {e}"))?;
    let port = match std::env::var("PORT") {
        Ok(port) => port
            .parse()
            .map_err(|_| format!("PORT={port}: not a port"))?,
        Err(_) => config.port,
    };
    let listener = tokio::net::TcpListener::bind(("127.0.0.1", port))
        .await
        .map_err(|e| format!("127.0.0.1:{port}: {e}"))?;
    let addr = listener.local_addr().map_err(|e| e.to_string())?;
    tracing::info!("listening on http://{addr}");
    axum::serve(listener, app).await.map_err(|e| e.to_string())
}
