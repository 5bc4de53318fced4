//! The gRPC example's server: a `helloworld.Greeter` behind tollgate's rate-limit and
//! idempotency layers, on tonic 0.14.
//!
//! Kept apart from `main.rs` so that tests can serve it — with their own `Greeter` if they
//! like — on a listener of their choosing: the `layers` test binary declares it at its root,
//! `#[path = "../../examples/grpc/server.rs"] pub mod grpc_server;` (`pub`, so that
//! `unreachable_pub` and `dead_code` stay quiet).
//!
//! - Rate limit: per caller, the caller being the `x-api-key` metadata entry (gRPC metadata
//!   arrives as an HTTP/2 header), else the peer IP address — demo only: nothing checks the key,
//!   so a client rotating it gets fresh quota; a service keys by what its authentication
//!   established (`key::Extension`, `docs/security.md`). Over the limit, a call fails with
//!   `RESOURCE_EXHAUSTED` and `retry-after` / `ratelimit` entries in the status metadata.
//! - Idempotency: every method; a call carrying `idempotency-key` metadata runs once across all
//!   copies of the server on one Redis, and its retries get the stored reply (same message, same
//!   metadata and trailers, plus `idempotent-replayed: true`). Calls without the key run as
//!   usual. A call that fails with a server-side status is not stored.

use std::future::Future;
use std::sync::Arc;

use http::request::Parts;
use tokio::net::TcpListener;
use tollgate::ConfigError;
use tollgate::idempotency::IdempotencyLayer;
use tollgate::key::{BoxedKey, Header, KeyExtractor, from_fn};
use tollgate::rate_limit::{Limit, RateLimitLayer};
use tollgate::store::Store;
use tonic::transport::Server;
use tonic::transport::server::{TcpConnectInfo, TcpIncoming};
use tonic::{Request, Response, Status};

use helloworld::greeter_server::{Greeter, GreeterServer};
use helloworld::{HelloReply, HelloRequest};

/// The code generated from `proto/helloworld.proto` (committed;
/// `tests/layers/grpc_codegen.rs` checks that it is up to date and says how to refresh it).
#[rustfmt::skip]
pub mod helloworld {
    #![allow(missing_docs, unreachable_pub, missing_debug_implementations, clippy::all)]
    include!("helloworld.rs");
}

/// The metadata entry that names a caller.
pub const API_KEY: &str = "x-api-key";

/// The metadata entry that carries an idempotency key.
pub const IDEMPOTENCY_KEY: &str = "idempotency-key";

/// The store-key prefix of this server's rate limits and idempotency records.
const PREFIX: &str = "tollgate-grpc";

/// The peer IP address of a call, from tonic's connection info.
pub fn peer_ip(parts: &Parts) -> Option<String> {
    let info = parts.extensions.get::<TcpConnectInfo>()?;
    info.remote_addr().map(|addr| addr.ip().to_string())
}

/// Who a call counts against: its `x-api-key` metadata, else its peer IP address.
pub type CallerKey = BoxedKey;

/// The caller key extractor: `x-api-key`, else the peer IP address.
pub fn caller_key() -> CallerKey {
    Header::from_static(API_KEY)
        .or(from_fn("peer-ip", peer_ip))
        .boxed()
}

/// The two layers every call passes, outermost first.
#[derive(Debug, Clone)]
pub struct Layers {
    /// Rate limits per caller.
    pub rate_limit: RateLimitLayer<CallerKey>,
    /// `idempotency-key` deduplication, scoped by the caller's `x-api-key`.
    pub idempotency: IdempotencyLayer<Header>,
}

impl Layers {
    /// Both layers on `store`, with `limits` checked together; fails on invalid limits.
    pub fn new(store: Arc<dyn Store>, limits: Vec<Limit>) -> Result<Self, ConfigError> {
        let rate_limit = RateLimitLayer::builder(Arc::clone(&store))
            .prefix(PREFIX)
            .limits(limits)
            .key(caller_key())
            .build()?;
        let idempotency = IdempotencyLayer::builder(store)
            .prefix(PREFIX)
            // two callers choosing the same key never see each other's replies
            .scope(Header::from_static(API_KEY))
            .build()?;
        Ok(Self {
            rate_limit,
            idempotency,
        })
    }
}

/// The example's greeter: `Hello <name> (<id>)`, with a fresh random id each time it runs, so
/// that a replayed reply is told apart from a second execution.
#[derive(Debug, Clone, Copy, Default)]
pub struct HelloGreeter;

#[tonic::async_trait]
impl Greeter for HelloGreeter {
    async fn say_hello(
        &self,
        request: Request<HelloRequest>,
    ) -> Result<Response<HelloReply>, Status> {
        let name = request.into_inner().name;
        let message = format!("Hello {name} ({})", uuid::Uuid::new_v4());
        Ok(Response::new(HelloReply { message }))
    }
}

/// Serves `greeter` on `listener` behind `layers` until `shutdown` resolves, then lets the
/// calls in flight finish.
pub async fn serve<G: Greeter>(
    listener: TcpListener,
    greeter: G,
    layers: Layers,
    shutdown: impl Future<Output = ()>,
) -> Result<(), tonic::transport::Error> {
    Server::builder()
        // the first layer added is the outermost: floods are refused before any other work
        .layer(layers.rate_limit)
        .layer(layers.idempotency)
        .add_service(GreeterServer::new(greeter))
        .serve_with_incoming_shutdown(TcpIncoming::from(listener), shutdown)
        .await
}
