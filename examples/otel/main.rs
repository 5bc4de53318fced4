//! tollgate's spans through OpenTelemetry: a small axum service with a rate limit, whose
//! requests, store calls and decisions are exported by `tracing-opentelemetry` to
//! OpenTelemetry's stdout exporter.
//!
//! ```text
//! cargo run --example otel                                   # memory store: decisions only
//! REDIS_URL=redis://127.0.0.1:6379/ cargo run --example otel # plus an EVALSHA span per check
//! curl -i -H 'x-api-key: alice' http://127.0.0.1:3003/
//! ```
//!
//! Each request is a span (`request`); under it, on Redis, the store call's client span
//! (`EVALSHA rate`, with `db.system.name`, `server.address`, ...) and the rate-limit decision as
//! an event (`tollgate.outcome`, `tollgate.remaining`, ...). Spans are printed when they end.
//! `PORT=0` serves on any free port, and `REQUESTS=n` sends n requests itself and exits.

use std::sync::Arc;

use axum::Router;
use axum::routing::get;
use opentelemetry::trace::TracerProvider as _;
use opentelemetry_sdk::trace::SdkTracerProvider;
use tollgate::key::Header;
use tollgate::rate_limit::{Limit, RateLimitLayer};
use tollgate::store::{MemoryStore, RateStore, RedisStore};
use tower_http_like::request_span;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::{EnvFilter, Registry};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    // a batch exporter would suit production; the simple one prints each span as it ends
    let provider = SdkTracerProvider::builder()
        .with_simple_exporter(opentelemetry_stdout::SpanExporter::default())
        .build();
    let otel = tracing_opentelemetry::layer().with_tracer(provider.tracer("otel-example"));
    // the store spans and the decisions are at DEBUG
    let filter = EnvFilter::new("info,tollgate=debug");
    tracing::subscriber::set_global_default(Registry::default().with(filter).with(otel))?;

    let store: Arc<dyn RateStore> = match std::env::var("REDIS_URL") {
        Ok(url) if !url.is_empty() => Arc::new(RedisStore::open(url)?),
        // tollgate: allow(the example without REDIS_URL: one process)
        _ => Arc::new(MemoryStore::new()),
    };
    let limit = RateLimitLayer::builder(store)
        .limit(Limit::per_minute("minute", 3))
        .key(Header::from_static("x-api-key"))
        .build()?;
    let app = Router::new()
        .route("/", get(|| async { "hello\n" }))
        .layer(limit)
        .layer(axum::middleware::from_fn(request_span));

    let port: u16 = std::env::var("PORT")
        .ok()
        .and_then(|p| p.parse().ok())
        .unwrap_or(3003);
    let listener = tokio::net::TcpListener::bind(("127.0.0.1", port)).await?;
    let addr = listener.local_addr()?;
    eprintln!("listening on http://{addr}");
    let server = tokio::spawn(async move { axum::serve(listener, app).await });
    match std::env::var("REQUESTS")
        .ok()
        .and_then(|n| n.parse::<u32>().ok())
    {
        Some(n) => send(addr, n).await?,
        None => server.await??,
    }
    provider.shutdown()?;
    Ok(())
}

/// Sends `n` requests as alice, one at a time, over plain HTTP/1.
async fn send(addr: std::net::SocketAddr, n: u32) -> Result<(), Box<dyn std::error::Error>> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    for _ in 0..n {
        let mut stream = tokio::net::TcpStream::connect(addr).await?;
        let request = "GET / HTTP/1.1\r\nhost: x\r\nx-api-key: alice\r\nconnection: close\r\n\r\n";
        stream.write_all(request.as_bytes()).await?;
        let mut response = String::new();
        stream.read_to_string(&mut response).await?;
        eprintln!("{}", response.lines().next().unwrap_or_default());
    }
    Ok(())
}

/// What tower-http's `TraceLayer` would do, kept to the one span this example needs.
mod tower_http_like {
    use axum::extract::Request;
    use axum::middleware::Next;
    use axum::response::Response;
    use tracing::Instrument;

    /// Runs the rest of the service in a `request` span: a server span in OpenTelemetry.
    pub(crate) async fn request_span(request: Request, next: Next) -> Response {
        let span = tracing::info_span!(
            "request",
            otel.kind = "server",
            http.request.method = %request.method(),
            url.path = request.uri().path(),
        );
        next.run(request).instrument(span).await
    }
}
