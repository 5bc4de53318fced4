//! tollgate's LLM gateway example: an OpenAI-style streaming endpoint metered per tenant across
//! every copy of the gateway that shares one store — a token budget reserved from the call's
//! `max_tokens` and settled on the usage its stream reports last, idempotent retries that are
//! never charged twice, a limit of calls in flight. The model is a stand-in in the same process.
//! A walk through it: `docs/metering.md`.
//!
//! ```text
//! cargo run --release --example llm_gateway
//! REDIS_URL=redis://127.0.0.1:6379/ PORT=3010 cargo run --release --example llm_gateway
//! ```
//!
//! | variable    | default                | meaning                                        |
//! | ----------- | ---------------------- | ---------------------------------------------- |
//! | `PORT`      | `3000`                 | serve on `127.0.0.1:$PORT` (0: any free port)  |
//! | `REDIS_URL` | unset: in-memory store | the store all copies share                     |
//!
//! The API keys are the public demo keys `demo` (tenant `acme`, plan `free`: 2,000 tokens a
//! minute, 2 calls in flight) and `demo-pro` (tenant `globex`, plan `pro`: 20,000 and 8).

#[path = "../shared/env.rs"]
pub mod env;
pub mod gateway;

use std::process::ExitCode;

use env::{Failure, Vars};

/// What the gateway warns of when no store variable is set.
const MEMORY_STORE_WARNING: &str = "REDIS_URL is not set: using an in-memory store, so the \
     budgets hold for this one process only. Set REDIS_URL=redis://127.0.0.1:6379/ to share \
     them between copies.";

#[tokio::main]
async fn main() -> ExitCode {
    env::exit(run().await)
}

async fn run() -> Result<(), Failure> {
    let vars = Vars::new(env::process_var);
    let port = vars.port(3000, "a port number, e.g. PORT=3000")?;
    let store = env::open_store(vars.redis_url().as_deref(), MEMORY_STORE_WARNING)?;
    let app = gateway::gateway(&store, &gateway::Options::default())
        .map_err(|e| Failure::config(format!("invalid configuration: {e}")))?;
    let (listener, addr) = env::listen(port).await?;
    println!("tollgate LLM gateway listening on http://{addr} (API keys: demo, demo-pro)");
    axum::serve(listener, app)
        .with_graceful_shutdown(env::ctrl_c())
        .await
        .map_err(|e| Failure::runtime(format!("server failed: {e}")))
}
