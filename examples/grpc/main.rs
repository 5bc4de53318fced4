//! tollgate's gRPC example: a tonic 0.14 `helloworld.Greeter` whose rate limits and idempotency
//! records hold across every copy of it that shares one Redis.
//!
//! ```text
//! cargo run --release --example grpc
//! REDIS_URL=redis://127.0.0.1:6379/ PORT=50052 cargo run --release --example grpc
//! ```
//!
//! and, from another terminal, a client (no grpcurl needed; `--url` defaults to the `PORT`
//! above, or 50051):
//!
//! ```text
//! cargo run --release --example grpc -- call --count 7 --api-key alice
//! cargo run --release --example grpc -- call --count 2 --idempotency-key order-1
//! ```
//!
//! | variable     | default                     | meaning                                        |
//! | ------------ | --------------------------- | ---------------------------------------------- |
//! | `PORT`       | `50051`                     | serve on `127.0.0.1:$PORT` (0: any free port)  |
//! | `REDIS_URL`  | unset: in-memory store      | the store all copies share                     |
//! | `APP_LIMITS` | `burst:5/1s,minute:100/60s` | limits per caller: `name:count/<seconds>s,…`   |
//!
//! A caller is its `x-api-key` metadata, else its IP address. A call with `idempotency-key`
//! metadata runs once; its retries get the stored reply. `SayHello` answers
//! `Hello <name> (<id>)` with a new id each time it runs, so replays are easy to spot.
//!
//! An invalid variable exits with status 2 and a message naming it; other startup failures (the
//! port is taken) exit with status 1. The generated code in `helloworld.rs` comes from
//! `proto/helloworld.proto` (see `tests/layers/grpc_codegen.rs`); no protoc or build script is
//! needed.

pub mod client;
pub mod config;
#[path = "../shared/env.rs"]
pub mod env;
pub mod server;

use std::process::ExitCode;

use config::Config;
use env::Failure;
use server::{HelloGreeter, Layers};

/// The port served when `PORT` is not set.
const DEFAULT_PORT: u16 = 50051;

#[tokio::main]
async fn main() -> ExitCode {
    let mut args = std::env::args().skip(1);
    let result = match args.next().as_deref() {
        None => run().await,
        Some("call") => call(args).await,
        Some(other) => Err(Failure::config(format!(
            "unknown command {other:?}\n{}",
            client::USAGE
        ))),
    };
    env::exit(result)
}

/// Runs the client: `call [--url URL] [--name NAME] [--count N] [--api-key KEY]
/// [--idempotency-key KEY]`.
async fn call(args: impl Iterator<Item = String>) -> Result<(), Failure> {
    let port = match std::env::var("PORT") {
        Ok(port) if !port.trim().is_empty() => port.trim().to_owned(),
        _ => DEFAULT_PORT.to_string(),
    };
    let args = client::CallArgs::parse(args, format!("http://127.0.0.1:{port}"))
        .map_err(|e| Failure::config(format!("{e}\n{}", client::USAGE)))?;
    client::call(args).await.map_err(Failure::runtime)
}

/// Runs the server; on failure, the exit status (2: configuration, 1: other) and a message.
async fn run() -> Result<(), Failure> {
    let config = Config::from_env(DEFAULT_PORT)?;
    let store = config.open_store()?;
    if let Err(error) = store.ping().await {
        eprintln!(
            "warning: the store does not answer yet ({error}): calls are not rate-limited, and \
             calls with an idempotency-key fail with UNAVAILABLE, until it does"
        );
    }
    let layers = Layers::new(store, config.limits.clone())
        .map_err(|e| Failure::config(format!("invalid configuration: {e}")))?;

    let (listener, addr) = env::listen(config.port).await?;
    println!(
        "tollgate gRPC example (helloworld.Greeter) listening on http://{addr}; limits {} per \
         x-api-key (else per IP)",
        config.describe_limits()
    );
    server::serve(listener, HelloGreeter, layers, env::ctrl_c())
        .await
        .map_err(|e| Failure::runtime(format!("server failed: {e}")))?;
    eprintln!("stopped");
    Ok(())
}
