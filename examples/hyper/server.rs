//! The hyper example's server: plain hyper 1 (no framework), tollgate's layers applied with
//! `tower::ServiceBuilder` and handed to hyper through `TowerToHyperService`.
//!
//! Kept apart from `main.rs` so that tests can serve it on a listener of their choosing: the
//! `layers` test binary declares it at its root,
//! `#[path = "../../examples/hyper/server.rs"] pub mod hyper_server;`.
//!
//! | route          | what it does                                                             |
//! | -------------- | ------------------------------------------------------------------------ |
//! | `GET /hello`   | `200 hello from hyper`                                                   |
//! | `POST /orders` | `201 {"order":"<new id>","request":"<body>"}`; send an `Idempotency-Key` |
//! | anything else  | `404`                                                                    |
//!
//! Every route is rate-limited per caller — the `x-api-key` header, else the peer IP address —
//! with `429`, `Retry-After` and the IETF `RateLimit` / `RateLimit-Policy` headers over the
//! limit. A `POST` or `PATCH` with an `Idempotency-Key` runs once across every copy of the server
//! on one Redis; its retries get the stored response plus `Idempotent-Replayed: true`. The
//! `x-api-key` header is demo only: nothing checks it, so a client rotating it gets fresh quota;
//! a service keys by what its authentication established (`key::Extension`, `docs/security.md`).

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;

use bytes::Bytes;
use http::{Method, Request, Response, StatusCode, header};
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use tokio::net::TcpListener;
use tollgate::ConfigError;
use tollgate::idempotency::{IdempotencyLayer, RequestBody};
use tollgate::key::{Header, KeyExtractor, Or, PeerIp};
use tollgate::rate_limit::{Limit, RateLimitLayer};
use tollgate::store::Store;
use tower::ServiceBuilder;

/// The header that names a caller.
pub const API_KEY: &str = "x-api-key";

/// The store-key prefix of this server's rate limits and idempotency records.
const PREFIX: &str = "tollgate-hyper";

/// The largest request body the handler reads.
const BODY_LIMIT: usize = 64 * 1024;

/// Who a request counts against: its `x-api-key`, else its peer IP address.
pub type CallerKey = Or<Header, PeerIp>;

/// The two layers every request passes, outermost first.
#[derive(Debug, Clone)]
pub struct Layers {
    /// Rate limits per caller.
    pub rate_limit: RateLimitLayer<CallerKey>,
    /// `Idempotency-Key` deduplication of POST and PATCH, scoped by the caller's `x-api-key`.
    pub idempotency: IdempotencyLayer<Header>,
}

impl Layers {
    /// Both layers on `store`, with `limits` checked together; fails on invalid limits.
    pub fn new(store: Arc<dyn Store>, limits: Vec<Limit>) -> Result<Self, ConfigError> {
        let rate_limit = RateLimitLayer::builder(Arc::clone(&store))
            .prefix(PREFIX)
            .limits(limits)
            .key(Header::from_static(API_KEY).or(PeerIp::new()))
            .build()?;
        let idempotency = IdempotencyLayer::builder(store)
            .prefix(PREFIX)
            .scope(Header::from_static(API_KEY))
            .build()?;
        Ok(Self {
            rate_limit,
            idempotency,
        })
    }
}

/// The application: a plain async function from request to response. Its body type is the
/// idempotency layer's: the buffered body of a keyed request, or hyper's own.
pub async fn handle(
    request: Request<RequestBody<Incoming>>,
) -> Result<Response<Full<Bytes>>, Infallible> {
    let response = match (request.method(), request.uri().path()) {
        (&Method::GET, "/hello") => text(StatusCode::OK, "hello from hyper\n"),
        (&Method::POST, "/orders") => {
            let body = match Limited::new(request.into_body(), BODY_LIMIT)
                .collect()
                .await
            {
                Ok(body) => body.to_bytes(),
                Err(_) => {
                    return Ok(text(
                        StatusCode::BAD_REQUEST,
                        "the request body could not be read (at most 64 KiB)\n",
                    ));
                }
            };
            let order = serde_json::json!({
                "order": uuid::Uuid::new_v4().to_string(),
                "request": String::from_utf8_lossy(&body),
            });
            let mut response = Response::new(Full::new(Bytes::from(order.to_string())));
            *response.status_mut() = StatusCode::CREATED;
            response.headers_mut().insert(
                header::CONTENT_TYPE,
                http::HeaderValue::from_static("application/json"),
            );
            response
        }
        _ => text(StatusCode::NOT_FOUND, "not found\n"),
    };
    Ok(response)
}

fn text(status: StatusCode, body: &'static str) -> Response<Full<Bytes>> {
    let mut response = Response::new(Full::new(Bytes::from_static(body.as_bytes())));
    *response.status_mut() = status;
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        http::HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    response
}

/// Serves HTTP/1.1 and HTTP/2 on `listener` behind `layers` until `shutdown` resolves, then
/// lets the connections in flight finish their requests.
pub async fn serve(listener: TcpListener, layers: Layers, shutdown: impl Future<Output = ()>) {
    let builder = auto::Builder::new(TokioExecutor::new());
    let graceful = GracefulShutdown::new();
    let mut shutdown = std::pin::pin!(shutdown);
    loop {
        let (stream, peer) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(accepted) => accepted,
                Err(error) => {
                    // e.g. out of file descriptors: keep serving the connections we have
                    eprintln!("warning: accept failed: {error}");
                    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                    continue;
                }
            },
            () = &mut shutdown => break,
        };
        let service = ServiceBuilder::new()
            // the peer address, for the `PeerIp` key of callers without an API key
            .map_request(move |mut request: Request<Incoming>| {
                request.extensions_mut().insert::<SocketAddr>(peer);
                request
            })
            // the first layer is the outermost: floods are refused before any other work
            .layer(layers.rate_limit.clone())
            .layer(layers.idempotency.clone())
            .service_fn(handle);
        let connection = builder
            .serve_connection(TokioIo::new(stream), TowerToHyperService::new(service))
            .into_owned();
        let connection = graceful.watch(connection);
        tokio::spawn(async move {
            // a client that goes away mid-request is no error of the server's
            let _ = connection.await;
        });
    }
    drop(listener);
    graceful.shutdown().await;
}
