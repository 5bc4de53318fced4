//! tollgate's hyper example: a plain hyper 1 server — no framework — whose rate limits and
//! idempotency records hold across every copy of it that shares one Redis.
//!
//! ```text
//! cargo run --release --example hyper
//! REDIS_URL=redis://127.0.0.1:6379/ PORT=3002 cargo run --release --example hyper
//! ```
//!
//! | variable     | default                     | meaning                                        |
//! | ------------ | --------------------------- | ---------------------------------------------- |
//! | `PORT`       | `3001`                      | serve on `127.0.0.1:$PORT` (0: any free port)  |
//! | `REDIS_URL`  | unset: in-memory store      | the store all copies share                     |
//! | `APP_LIMITS` | `burst:5/1s,minute:100/60s` | limits per caller: `name:count/<seconds>s,…`   |
//!
//! Then, for example:
//!
//! ```text
//! curl -i -H 'x-api-key: alice' http://127.0.0.1:3001/hello
//! curl -i -H 'Idempotency-Key: order-1' -d '{"item":"book"}' http://127.0.0.1:3001/orders
//! ```
//!
//! An invalid variable exits with status 2 and a message naming it; other startup failures (the
//! port is taken) exit with status 1.

#[path = "../grpc/config.rs"]
pub mod config;
#[path = "../shared/env.rs"]
pub mod env;
pub mod server;

use std::process::ExitCode;

use config::Config;
use env::Failure;
use server::Layers;

/// The port served when `PORT` is not set.
const DEFAULT_PORT: u16 = 3001;

#[tokio::main]
async fn main() -> ExitCode {
    env::exit(run().await)
}

/// Runs the server; on failure, the exit status (2: configuration, 1: other) and a message.
async fn run() -> Result<(), Failure> {
    let config = Config::from_env(DEFAULT_PORT)?;
    let store = config.open_store()?;
    if let Err(error) = store.ping().await {
        eprintln!(
            "warning: the store does not answer yet ({error}): requests are not rate-limited, \
             and requests with an Idempotency-Key get 503, until it does"
        );
    }
    let layers = Layers::new(store, config.limits.clone())
        .map_err(|e| Failure::config(format!("invalid configuration: {e}")))?;

    let (listener, addr) = env::listen(config.port).await?;
    println!(
        "tollgate hyper example listening on http://{addr}; limits {} per x-api-key (else per IP)",
        config.describe_limits()
    );
    server::serve(listener, layers, env::ctrl_c()).await;
    eprintln!("stopped");
    Ok(())
}
