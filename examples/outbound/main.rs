//! tollgate's outbound example: one copy of a worker fleet calling a provider that limits its
//! calls — every copy that shares the store shares the provider's quota, and waits for room
//! instead of being refused. A walk through it: `docs/outbound.md`.
//!
//! ```text
//! cargo run --release --example outbound
//! PROVIDER_URL=http://127.0.0.1:9000 REDIS_URL=redis://127.0.0.1:6379/ cargo run --release --example outbound
//! ```
//!
//! | variable          | default                   | meaning                                          |
//! | ----------------- | ------------------------- | ------------------------------------------------ |
//! | `PROVIDER_URL`    | unset: a stand-in provider in this process (100 calls a second) | calls `POST {PROVIDER_URL}/v1/calls` |
//! | `WORKERS`         | `16`                      | tasks calling as fast as their limits let them   |
//! | `SECONDS`         | `10`                      | how long they call                               |
//! | `OUTBOUND_LIMITS` | `calls:95/1s`             | the calls' limits, `name:count/<seconds>s,…` (GCRA) |
//! | `REDIS_URL`       | unset: in-memory store    | the store every copy shares                      |
//! | `DATABASE_URL`    | unset                     | or: a PostgreSQL database                        |
//!
//! It prints one line of what it did and exits 0; an invalid variable exits 2. The calls that
//! wait for room when `SECONDS` ends are still made (a call waits up to 30 s; it fails after
//! 45 s, its wait included, when the provider does not answer).

#[path = "../shared/env.rs"]
pub mod env;
pub mod provider;

use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use bytes::Bytes;
use env::{EnvError, Failure, Vars};
use http::{Request, StatusCode};
use http_body_util::Empty;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use tokio::time::Instant;
use tollgate::outbound::OutboundError;
use tollgate::rate::Algorithm;
use tollgate::rate_limit::RateLimitLayer;
use tollgate::store::Store;
use tower::{ServiceBuilder, ServiceExt};

const MEMORY_STORE_WARNING: &str = "neither REDIS_URL nor DATABASE_URL is set: using an \
     in-memory store, so the quota holds for this one process only.";

/// How long a call may take, its wait for room included.
const CALL_TIMEOUT: Duration = Duration::from_secs(45);

/// What the workers saw.
#[derive(Debug, Default)]
struct Seen {
    ok: AtomicU64,
    provider_refused: AtomicU64,
    limited: AtomicU64,
    failed: AtomicU64,
}

#[tokio::main]
async fn main() -> ExitCode {
    env::exit(run().await)
}

async fn run() -> Result<(), Failure> {
    let vars = Vars::new(env::process_var);
    let workers = vars.number("WORKERS", 16, "a whole number, e.g. WORKERS=16")?;
    let seconds = vars.number("SECONDS", 10, "a whole number, e.g. SECONDS=10")?;
    let limits = vars.limits_of("OUTBOUND_LIMITS", "calls:95/1s", Algorithm::Gcra)?;
    let store = open_store(&vars).await?;
    let (url, stand_in) = match vars.get("PROVIDER_URL") {
        Some(url) => (url.trim().trim_end_matches('/').to_owned(), None),
        None => {
            let (addr, stand_in) = provider::start(100).await?;
            (format!("http://{addr}"), Some(stand_in))
        }
    };
    let calls = format!("{url}/v1/calls");
    let _: http::Uri = calls.parse().map_err(|e| {
        Failure::config(
            EnvError::new(
                "PROVIDER_URL",
                &url,
                format!("{e}"),
                "a URL, e.g. PROVIDER_URL=http://127.0.0.1:9000",
            )
            .to_string(),
        )
    })?;

    let layer = RateLimitLayer::builder(Arc::clone(&store))
        .prefix("outbound-example")
        .limits(limits)
        .algorithm(Algorithm::Gcra)
        .queue(Duration::from_secs(30))
        .build_outbound()
        .map_err(|e| Failure::config(format!("invalid limits: {e}")))?
        .share_pauses(Arc::clone(&store));
    let client = ServiceBuilder::new()
        .layer(layer)
        .service(Client::builder(TokioExecutor::new()).build_http::<Empty<Bytes>>());

    let seen = Arc::new(Seen::default());
    let start = Instant::now();
    let run_for = Duration::from_secs(seconds);
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..workers {
        let (client, seen, calls) = (client.clone(), Arc::clone(&seen), calls.clone());
        tasks.spawn(async move {
            while start.elapsed() < run_for {
                let request = Request::post(calls.as_str()).body(Empty::new());
                let Ok(request) = request else { break };
                // a provider that never answers does not hold the run
                let call = tokio::time::timeout(CALL_TIMEOUT, client.clone().oneshot(request));
                let counter = match call.await {
                    Ok(Ok(response)) if response.status().is_success() => &seen.ok,
                    Ok(Ok(response)) if response.status() == StatusCode::TOO_MANY_REQUESTS => {
                        &seen.provider_refused
                    }
                    Ok(Err(OutboundError::Limited(_))) => &seen.limited,
                    Ok(_) | Err(_) => &seen.failed,
                };
                counter.fetch_add(1, Ordering::Relaxed);
            }
        });
    }
    tasks.join_all().await;
    let took = start.elapsed().as_secs_f64();
    let ok = seen.ok.load(Ordering::Relaxed);
    let mut line = format!(
        "{ok} calls made in {took:.1} s ({:.1}/s) by {workers} workers: the provider refused {}, the limits refused {} (no room within 30 s), {} failed",
        ok as f64 / took,
        seen.provider_refused.load(Ordering::Relaxed),
        seen.limited.load(Ordering::Relaxed),
        seen.failed.load(Ordering::Relaxed),
    );
    if let Some(stand_in) = stand_in {
        line.push_str(&format!(
            "; the stand-in provider (100 a second) took {} and refused {}",
            stand_in.taken(),
            stand_in.refused()
        ));
    }
    println!("{line}");
    Ok(())
}

/// The store `DATABASE_URL` or `REDIS_URL` names, else one in memory.
async fn open_store<L: Fn(&str) -> Option<String>>(
    vars: &Vars<L>,
) -> Result<Arc<dyn Store>, Failure> {
    match (vars.get("DATABASE_URL"), vars.redis_url()) {
        (Some(_), Some(_)) => Err(Failure::config(
            "set one of REDIS_URL and DATABASE_URL, not both",
        )),
        (Some(url), None) => {
            let safe = env::redact_url(&url);
            let store = tollgate::store::PgStore::builder(url.trim())
                .connect()
                .await
                .map_err(|e| {
                    Failure::config(
                        EnvError::new("DATABASE_URL", &safe, e.to_string(), "a PostgreSQL URL, e.g. DATABASE_URL=postgres://app:secret@127.0.0.1:5432/app")
                            .to_string(),
                    )
                })?;
            Ok(Arc::new(store))
        }
        (None, url) => Ok(env::open_store(url.as_deref(), MEMORY_STORE_WARNING)?),
    }
}
