//! Tower middleware for services that run as many copies: rate limits, concurrency limits,
//! idempotency keys and locks kept in a store that every copy sees — Redis or Valkey (standalone,
//! Sentinel or Cluster) or PostgreSQL.
//!
//! # Why
//!
//! A service behind a load balancer runs as several copies. A lock, counter or "already done" set
//! kept in process memory then silently breaks: with three copies a coupon is redeemed three
//! times and a rate limit lets a client through three times as often. tollgate keeps every such
//! piece of state in the shared [store], changes it only with atomic operations (one Lua
//! script, conditional command or PL/pgSQL function call each, timed by the store's clock), and
//! so makes N copies behave as one.
//!
//! - [`rate_limit`]: sliding-window log (exact), sliding-window counter (O(1) memory) and GCRA;
//!   several limits per request in one round trip; IETF `RateLimit` headers; gRPC-native
//!   rejections; an explicit policy for when the store is down; costs reserved up front and
//!   settled once the response tells the actual amount.
//! - [`concurrency`]: at most N requests per key in flight across every copy — permits that are
//!   leases with fencing tokens, given back when the response ends, with an opt-in fair queue.
//! - [`idempotency`]: `Idempotency-Key` deduplication — replay, 409 in flight, 422 on a changed
//!   request — with Stripe / IETF-draft semantics.
//! - [`claim`]: "already done" claims — one `SET NX` that exactly one caller wins.
//! - [`lock`]: locks with random tokens, leases kept alive while work runs, and fencing tokens.
//! - [`key`]: who a request counts against — headers, peer IP, trusted-proxy forwarded IP,
//!   closures — always hashed before it reaches the store.
//!
//! The [guide] explains when to use which.
//!
//! # With axum
//!
//! ```
//! # #[tokio::main(flavor = "current_thread")] async fn main() {
//! use axum::{Router, routing::get};
//! use tollgate::key::{Header, KeyExtractor, PeerIp};
//! use tollgate::rate_limit::{Limit, RateLimitLayer};
//! use tollgate::store::MemoryStore; // RedisStore::open("redis://127.0.0.1/") to share limits
//!
//! let limits = RateLimitLayer::builder(MemoryStore::new())
//!     .limit(Limit::per_second("burst", 5))
//!     .limit(Limit::per_minute("minute", 100))
//!     .key(Header::from_static("x-api-key").or(PeerIp::new()))
//!     .build()
//!     .expect("valid limits");
//! let app: Router = Router::new()
//!     .route("/api/hello", get(|| async { "hello" }))
//!     .layer(limits);
//!
//! use tower::ServiceExt;
//! let request = || http::Request::get("/api/hello").header("x-api-key", "k").body(axum::body::Body::empty()).unwrap();
//! for _ in 0..5 {
//!     assert_eq!(app.clone().oneshot(request()).await.unwrap().status(), 200);
//! }
//! assert_eq!(app.clone().oneshot(request()).await.unwrap().status(), 429);
//! # }
//! ```
//!
//! # With tonic
//!
//! The same layers go into `tonic::transport::Server::builder().layer(..)`: gRPC metadata arrives
//! as HTTP/2 headers, and rejections are trailers-only responses, so a client sees
//! `Code::ResourceExhausted` over the limit and a replayed reply with its trailers.
//!
//! ```no_run
//! # async fn serve() -> Result<(), Box<dyn std::error::Error>> {
//! use tollgate::idempotency::IdempotencyLayer;
//! use tollgate::key::Header;
//! use tollgate::rate_limit::{Limit, RateLimitLayer};
//! use tollgate::store::RedisStore;
//!
//! let store = RedisStore::open("redis://127.0.0.1:6379/")?;
//! let rate_limit = RateLimitLayer::builder(store.clone())
//!     .limit(Limit::per_minute("minute", 100))
//!     .key(Header::from_static("x-api-key")) // the `x-api-key` metadata entry
//!     .build()?;
//! let idempotency = IdempotencyLayer::builder(store)
//!     .scope(Header::from_static("x-api-key"))
//!     .build()?;
//! let routes = tonic::service::Routes::default(); // add your services here
//! tonic::transport::Server::builder()
//!     .layer(rate_limit)
//!     .layer(idempotency)
//!     .add_routes(routes)
//!     .serve("127.0.0.1:50051".parse()?)
//!     .await?;
//! # Ok(()) }
//! ```
//!
//! # With hyper
//!
//! ```no_run
//! # async fn serve() -> Result<(), Box<dyn std::error::Error>> {
//! use std::convert::Infallible;
//! use bytes::Bytes;
//! use http::{Request, Response};
//! use http_body_util::Full;
//! use hyper::body::Incoming;
//! use hyper_util::rt::{TokioExecutor, TokioIo};
//! use hyper_util::server::conn::auto;
//! use hyper_util::service::TowerToHyperService;
//! use tollgate::idempotency::{IdempotencyLayer, RequestBody};
//! use tollgate::key::{Header, KeyExtractor, PeerIp};
//! use tollgate::rate_limit::{Limit, RateLimitLayer};
//! use tollgate::store::RedisStore;
//! use tower::ServiceBuilder;
//!
//! async fn handle(_req: Request<RequestBody<Incoming>>) -> Result<Response<Full<Bytes>>, Infallible> {
//!     Ok(Response::new(Full::new(Bytes::from_static(b"hello"))))
//! }
//!
//! let store = RedisStore::open("redis://127.0.0.1:6379/")?;
//! let rate_limit = RateLimitLayer::builder(store.clone())
//!     .limit(Limit::per_minute("minute", 100))
//!     .key(Header::from_static("x-api-key").or(PeerIp::new()))
//!     .build()?;
//! let idempotency = IdempotencyLayer::builder(store).unscoped().build()?;
//! let listener = tokio::net::TcpListener::bind("127.0.0.1:3001").await?;
//! loop {
//!     let (stream, peer) = listener.accept().await?;
//!     let service = ServiceBuilder::new()
//!         .map_request(move |mut req: Request<Incoming>| {
//!             req.extensions_mut().insert(peer); // for PeerIp
//!             req
//!         })
//!         .layer(rate_limit.clone())
//!         .layer(idempotency.clone())
//!         .service_fn(handle);
//!     tokio::spawn(async move {
//!         let io = TokioIo::new(stream);
//!         let _ = auto::Builder::new(TokioExecutor::new())
//!             .serve_connection(io, TowerToHyperService::new(service))
//!             .await;
//!     });
//! }
//! # }
//! ```
//!
//! # What holds when the store fails
//!
//! A call that gets no answer is neither a success nor a clean failure: the store may have run
//! it, or may still run it, since TCP delivers what a partition held once it heals. So every
//! write carries a deadline, and a store that receives it later does nothing (see
//! [Deadlines](store#deadlines)); an unanswered claim or lock is undone only once its deadline
//! has passed, and only what that very attempt wrote. What a caller sees, and what the store
//! holds afterwards:
//!
//! | failure | claim, lock | idempotency request | rate check |
//! | --- | --- | --- | --- |
//! | late reply: the store ran the call, its answer came after the timeout | an error (`Timeout`); the claim or lock stands until its undo, sent once the deadline passed, frees it | `503`, the handler does not run; the key is released after the deadline | the failure policy decides; the check is charged once |
//! | re-sent command: a retry on a broken connection, a Cluster retry, the same [`RateCheck`](rate::RateCheck) again | the first run's answer; nothing written twice | the first run's answer | admitted again, charged once — on Redis if sent again within twice the store timeout of its previous send (each call keeps a record of what it charged); in process and on PostgreSQL if fewer than 8 other checks charged the caller before its deadline |
//! | dark connection: bytes held and delivered late, even after the connection was replaced and the undo ran | an error; the held write changes nothing; the name is free | `503`; the held claim or completion changes nothing | the failure policy; the held check charges nothing |
//! | store restart without persistence | errors until it is back; then every claim and lock is gone (fencing tokens still increase: they are above the store's clock) | a record lost while its handler runs: `503` (unrecorded), never a `2xx`; a completed record lost: a retry runs again | quotas start full |
//! | store restart with persistence (`appendfsync always`) | what was answered stands | what was recorded replays | as persisted |
//! | failover without `wait_replicas` | a write the replica had not received is lost, as in a restart without persistence | as in a restart without persistence | quotas partly forgotten |
//! | failover with `wait_replicas(n)` | counts only once `n` replicas acknowledged it; until then others see it pending ([`Claim::pending`](claim::Claim::pending)), not taken; unacknowledged: undone, the caller gets an error | a completion counts only once acknowledged: until then a retry gets `409` (in flight); the first caller gets its `2xx` only then | never waits for replicas |
//!
//! On PostgreSQL the same holds with the database's own clock, and a committed write survives a
//! restart; the rate tables are `UNLOGGED` by default (empty after a crash: full quotas).
//!
//! The deadline holds under two assumptions, stated in [Deadlines](store#deadlines): the store's
//! clock never steps back and runs at most 0.1 % slower than the caller's.
//!
//! # Architecture
//!
//! Five layers, each using only the ones before it — a store knows no middleware, and a
//! backend or a feature lands in one of them:
//!
//! 1. **Core vocabulary.** [`ConfigError`] and the [`store::StoreError`] kinds; the caller digest
//!    [`key::Key`]; what a rate limit is and answers ([`rate`]: [`rate::RatePolicy`],
//!    [`rate::RateOutcome`], and the three algorithms in process for `MemoryStore` and the local
//!    fallback); the store-key layout — every key, with its Cluster hash tag, is built in one
//!    private module, which also checks prefixes; and the sharded, bounded map of expiring
//!    entries that `MemoryStore` and the local fallback keep their state in.
//! 2. **[`store`].** The atomic operations, as four capability traits —
//!    [`RateStore`](store::RateStore), [`LockStore`](store::LockStore),
//!    [`IdempotencyStore`](store::IdempotencyStore) and [`PermitStore`](store::PermitStore) — and
//!    [`Store`](store::Store), all four plus a health check. A backend implements what it
//!    serves; [`RedisStore`](store::RedisStore)
//!    (Lua scripts in `src/store/redis/scripts/`), [`PgStore`] (PL/pgSQL in
//!    `src/store/postgres/migrations/`) and [`MemoryStore`](store::MemoryStore) implement all of
//!    them and pass one conformance suite, which ships with the crate (feature `conformance`,
//!    `tollgate::conformance`) for stores written outside it.
//! 3. **[`claim`] and [`lock`].** Claims and locks over a [`LockStore`](store::LockStore), and the
//!    lease keeper and background release that locks and idempotency claims share.
//! 4. **HTTP glue.** The [`key`] extractors (headers, peer IP, trusted-proxy forwarded IP,
//!    closures), the complete body of tollgate's own responses, gRPC trailers-only responses, and
//!    the one builder of rejections (problem details for HTTP, a gRPC status for gRPC calls).
//! 5. **The layers.** [`rate_limit`], [`concurrency`] and [`idempotency`], each a tower-http
//!    style module: the story and re-exports in `mod.rs`; the layer and builder, the service, its response future
//!    and body, its settings, decisions and rejections in files of their own. Each asks only for
//!    the store capability it uses.
//!
//! # Feature flags
//!
#![doc = document_features::document_features!()]
//!
//! No framework is a default dependency: the layers work on `http::Request` / `http::Response`
//! and fit axum, tonic and hyper alike.
//!
//! [`PgStore`]: https://docs.rs/tollgate/latest/tollgate/store/struct.PgStore.html
//! [`RateLimitConfig`]: https://docs.rs/tollgate/latest/tollgate/rate_limit/struct.RateLimitConfig.html
#![cfg_attr(docsrs, feature(doc_cfg))]
// Items of every build link to PostgreSQL's (`OnceTx`, `PgStore`), which exist only with the
// `postgres` feature: those links resolve in the docs built with every feature (docs.rs, and
// `cargo doc --all-features` with warnings denied), and are plain text otherwise.
#![cfg_attr(not(feature = "postgres"), allow(rustdoc::broken_intra_doc_links))]

#[macro_use]
mod macros;

// core vocabulary
#[cfg(test)]
mod captured;
pub mod error;
mod expiring;
#[cfg(test)]
mod fuzz;
pub mod key;
mod keyspace;
pub mod metrics;
mod on_error;
mod pace;
pub mod rate;
mod task;
// HTTP vocabulary the layers share
mod body;
mod grpc;
mod headers;
mod rejection;
// where state lives
pub mod store;
// built on the store
pub mod claim;
#[cfg(feature = "conformance")]
#[cfg_attr(docsrs, doc(cfg(feature = "conformance")))]
pub mod conformance;
mod in_force;
mod keepalive;
pub mod lock;
mod rate_client;
// the layers
pub mod concurrency;
pub mod idempotency;
pub mod outbound;
pub mod rate_limit;
pub mod stack;
// docs
pub mod guide;
#[cfg(feature = "testing")]
pub mod testing;

/// The README's code, compiled and run as doctests so that it cannot rot.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;

pub use error::{BoxError, ConfigError, ConfigErrorKind};
pub use rate_limit::{Limit, RateLimitLayer};
