//! The rate-limit layer inside real frameworks, against real `redis-server` processes: one layer
//! value under axum `Router::layer` and `route_layer`, under `tower::ServiceBuilder` (next to
//! tower's own middleware), and in real hyper 1 and axum servers over TCP, where a 429 has to
//! arrive on the wire. Peer and forwarded-address keys are exercised over real connections.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use crate::common;

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use axum::Router;
use axum::body::Body;
use axum::extract::ConnectInfo;
use axum::routing::get;
use bytes::Bytes;
use http::{HeaderMap, HeaderName, HeaderValue, Request, Response, StatusCode};
use http_body_util::{BodyExt, Empty, Full};
use hyper::body::Incoming;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::service::TowerToHyperService;
use tokio::net::TcpListener;
use tower::util::MapRequestLayer;
use tower::{ServiceBuilder, ServiceExt};

use common::RedisServer;
use tollgate::key::{ForwardedIp, Header, KeyExtractor, PeerIp};
use tollgate::rate_limit::{DecisionSource, Limit, RateLimitDecision, RateLimitLayer};

const CLIENT: HeaderName = HeaderName::from_static("x-client");

/// Three per minute, keyed by `x-client`.
fn header_layer(server: &RedisServer) -> RateLimitLayer<Header> {
    RateLimitLayer::builder(server.store())
        .limit(Limit::per_minute("minute", 3))
        .key(Header::new(CLIENT))
        .build()
        .unwrap()
}

fn request(path: &str, client: Option<&str>) -> Request<Body> {
    let mut builder = Request::get(path);
    if let Some(client) = client {
        builder = builder.header(CLIENT, client);
    }
    builder.body(Body::empty()).unwrap()
}

/// Sends `req` to an axum router in process; status, headers and body.
async fn call_router(router: &Router, req: Request<Body>) -> (StatusCode, HeaderMap, Bytes) {
    let res = router.clone().oneshot(req).await.unwrap();
    let (parts, body) = res.into_parts();
    (
        parts.status,
        parts.headers,
        body.collect().await.unwrap().to_bytes(),
    )
}

/// Asserts the shape of a 429 for the three-per-minute limit.
fn assert_denied(status: StatusCode, headers: &HeaderMap) {
    assert_eq!(status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(headers["retry-after"], "60");
    assert_eq!(headers["ratelimit-policy"], r#""minute";q=3;w=60"#);
    assert_eq!(headers["ratelimit"], r#""minute";r=0;t=60"#);
}

#[tokio::test(flavor = "multi_thread")]
async fn one_layer_value_under_router_layer_route_layer_and_service_builder() {
    let server = RedisServer::start();
    let layer = header_layer(&server);

    // axum Router::layer: every route, and the fallback too (a request without a key is 400).
    let router = Router::new()
        .route("/", get(|| async { "hello" }))
        .layer(layer.clone());
    for remaining in [2, 1, 0] {
        let (status, headers, body) = call_router(&router, request("/", Some("via-layer"))).await;
        assert_eq!(status, StatusCode::OK);
        assert_eq!(body, "hello");
        assert_eq!(
            headers["ratelimit"],
            format!(r#""minute";r={remaining};t=60"#).as_str()
        );
    }
    let (status, headers, body) = call_router(&router, request("/", Some("via-layer"))).await;
    assert_denied(status, &headers);
    common::assert_quota_problem(&body, &["minute"]);
    let (status, _, _) = call_router(&router, request("/", None)).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);

    // axum route_layer: only the routes added before it are limited; unmatched paths are 404.
    let router = Router::new()
        .route("/limited", get(|| async { "limited" }))
        .route_layer(layer.clone())
        .route("/free", get(|| async { "free" }));
    for _ in 0..3 {
        let (status, _, _) = call_router(&router, request("/limited", Some("via-route"))).await;
        assert_eq!(status, StatusCode::OK);
    }
    let (status, headers, _) = call_router(&router, request("/limited", Some("via-route"))).await;
    assert_denied(status, &headers);
    for _ in 0..5 {
        let (status, headers, body) =
            call_router(&router, request("/free", Some("via-route"))).await;
        assert_eq!(status, StatusCode::OK);
        assert_eq!(body, "free");
        assert!(headers.get("ratelimit").is_none());
    }
    let (status, _, _) = call_router(&router, request("/nowhere", None)).await;
    assert_eq!(status, StatusCode::NOT_FOUND);

    // tower::ServiceBuilder, with tower's ConcurrencyLimit inside: that service panics when it is
    // called without having been readied, so this also checks that the layer calls the instance
    // that poll_ready readied.
    let calls = Arc::new(AtomicUsize::new(0));
    let counted = Arc::clone(&calls);
    let svc = ServiceBuilder::new()
        .layer(layer)
        .concurrency_limit(2)
        .service_fn(move |_req: Request<Body>| {
            counted.fetch_add(1, Ordering::SeqCst);
            async { Ok::<_, Infallible>(Response::new(Full::new(Bytes::from_static(b"hi")))) }
        });
    let tasks: Vec<_> = (0..10)
        .map(|_| {
            let svc = svc.clone();
            tokio::spawn(async move {
                let res = svc
                    .oneshot(request("/", Some("via-builder")))
                    .await
                    .unwrap();
                let admitted = res
                    .extensions()
                    .get::<RateLimitDecision>()
                    .map(RateLimitDecision::admitted);
                (res.status(), admitted)
            })
        })
        .collect();
    let mut ok = 0;
    for task in tasks {
        let (status, admitted) = task.await.unwrap();
        assert_eq!(admitted, Some(status == StatusCode::OK));
        ok += usize::from(status == StatusCode::OK);
    }
    assert_eq!(ok, 3);
    assert_eq!(calls.load(Ordering::SeqCst), 3);
}

// ---------------------------------------------------------------------------------------------
// Real servers over TCP
// ---------------------------------------------------------------------------------------------

type HttpClient = Client<HttpConnector, Empty<Bytes>>;

fn client() -> HttpClient {
    Client::builder(TokioExecutor::new()).build_http()
}

/// GETs `url` with `headers`; status, headers and body.
async fn fetch(
    client: &HttpClient,
    url: &str,
    headers: &[(&str, &str)],
) -> (StatusCode, HeaderMap, Bytes) {
    let raw: Vec<(&str, &[u8])> = headers.iter().map(|(n, v)| (*n, v.as_bytes())).collect();
    fetch_raw(client, url, &raw).await
}

/// GETs `url` with header values given as bytes (which may be other than UTF-8).
async fn fetch_raw(
    client: &HttpClient,
    url: &str,
    headers: &[(&str, &[u8])],
) -> (StatusCode, HeaderMap, Bytes) {
    let mut builder = Request::get(url);
    for (name, value) in headers {
        builder = builder.header(*name, HeaderValue::from_bytes(value).unwrap());
    }
    let res = client
        .request(builder.body(Empty::new()).unwrap())
        .await
        .unwrap();
    let (parts, body) = res.into_parts();
    (
        parts.status,
        parts.headers,
        body.collect().await.unwrap().to_bytes(),
    )
}

/// A hyper 1 server on 127.0.0.1 with `layer` around a `200 hello` handler; the peer address is
/// put into the request extensions, as hyper users do. Returns its base URL.
async fn hyper_server<K: KeyExtractor>(layer: RateLimitLayer<K>) -> String {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        loop {
            let Ok((stream, peer)) = listener.accept().await else {
                return;
            };
            let svc = ServiceBuilder::new()
                .map_request(move |mut req: Request<Incoming>| {
                    req.extensions_mut().insert(peer);
                    req
                })
                .layer(layer.clone())
                .service_fn(|_req: Request<Incoming>| async {
                    Ok::<_, Infallible>(Response::new(Full::new(Bytes::from_static(b"hello"))))
                });
            tokio::spawn(async move {
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), TowerToHyperService::new(svc))
                    .await;
            });
        }
    });
    format!("http://{addr}")
}

#[tokio::test(flavor = "multi_thread")]
async fn hyper_servers_share_the_limit_and_send_429_over_tcp() {
    let server = RedisServer::start();
    // Two copies of the service, each with its own layer and store, keyed by peer IP.
    let build = || {
        RateLimitLayer::builder(server.store())
            .limit(Limit::per_minute("minute", 3))
            .key(PeerIp::new())
            .build()
            .unwrap()
    };
    let copies = [hyper_server(build()).await, hyper_server(build()).await];
    let client = client();

    let mut statuses = Vec::new();
    for i in 0..6 {
        let (status, headers, body) = fetch(&client, &format!("{}/", copies[i % 2]), &[]).await;
        statuses.push(status);
        if status == StatusCode::OK {
            assert_eq!(body, "hello");
            assert_eq!(headers["ratelimit-policy"], r#""minute";q=3;w=60"#);
        } else {
            assert_denied(status, &headers);
            common::assert_quota_problem(&body, &["minute"]);
        }
    }
    assert_eq!(
        statuses,
        [
            StatusCode::OK,
            StatusCode::OK,
            StatusCode::OK,
            StatusCode::TOO_MANY_REQUESTS,
            StatusCode::TOO_MANY_REQUESTS,
            StatusCode::TOO_MANY_REQUESTS,
        ],
        "127.0.0.1 gets three in all, whichever copy it reaches"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn forwarded_ip_behind_a_trusted_proxy_over_tcp() {
    let server = RedisServer::start();
    // The test client is the proxy: 127.0.0.1 is trusted, its X-Forwarded-For is read.
    let layer = RateLimitLayer::builder(server.store())
        .limit(Limit::per_minute("minute", 1))
        .key(ForwardedIp::trusting(["127.0.0.0/8"]).unwrap())
        .build()
        .unwrap();
    let url = format!("{}/", hyper_server(layer).await);
    let client = client();
    let xff = |chain: &'static str| [("x-forwarded-for", chain)];

    let (status, _, _) = fetch(&client, &url, &xff("203.0.113.7")).await;
    assert_eq!(status, StatusCode::OK);
    // A made-up left-most entry does not give the same client a new bucket.
    for spoofed in ["6.6.6.6, 203.0.113.7", "1.1.1.1, 2.2.2.2, 203.0.113.7"] {
        let (status, headers, _) = fetch(&client, &url, &xff(spoofed)).await;
        assert_eq!(status, StatusCode::TOO_MANY_REQUESTS, "chain {spoofed}");
        assert_eq!(headers["retry-after"], "60");
    }
    // Trusted proxies in the chain are skipped.
    let (status, _, _) = fetch(&client, &url, &xff("203.0.113.7, 127.0.0.5")).await;
    assert_eq!(status, StatusCode::TOO_MANY_REQUESTS);
    // Another client has its own bucket.
    let (status, _, _) = fetch(&client, &url, &xff("198.51.100.9")).await;
    assert_eq!(status, StatusCode::OK);
}

/// A hyper server with a limit of 1 per minute keyed by `ForwardedIp` trusting 127.0.0.0/8 (the
/// test client plays the proxy); `prefix` keeps its buckets apart from other servers'.
async fn forwarded_server(server: &RedisServer, prefix: &str, rfc7239: bool) -> String {
    let mut key = ForwardedIp::trusting(["127.0.0.0/8"]).unwrap();
    if rfc7239 {
        key = key.use_forwarded_header();
    }
    let layer = RateLimitLayer::builder(server.store())
        .prefix(prefix)
        .limit(Limit::per_minute("minute", 1))
        .key(key)
        .build()
        .unwrap();
    format!("{}/", hyper_server(layer).await)
}

/// Junk left of the client's address — an unparseable entry, bytes outside visible ASCII — must
/// not move the client out of its bucket (into the proxy's, which every client behind that proxy
/// shares): proxies keep what the client sent and append to it, so the right-most untrusted
/// address is the client whatever lies to its left.
#[tokio::test(flavor = "multi_thread")]
async fn forwarded_ip_ignores_junk_left_of_the_client() {
    let server = RedisServer::start();
    let client = client();
    let xff = "x-forwarded-for";
    let mut wrong = Vec::new();

    // Each case on fresh buckets: 203.0.113.7 spends its one request, then comes back with junk
    // to the left of its address and must still be denied.
    let junk: [&[u8]; 4] = [
        b"not-an-ip, 203.0.113.7",
        b"unknown, 203.0.113.7",
        b"6.6.6.6:bad, 203.0.113.7",
        b"\x80\xff, 203.0.113.7",
    ];
    for (i, chain) in junk.into_iter().enumerate() {
        let url = forwarded_server(&server, &format!("junk{i}"), false).await;
        let (status, _, _) = fetch_raw(&client, &url, &[(xff, b"203.0.113.7")]).await;
        assert_eq!(status, StatusCode::OK);
        let (status, _, _) = fetch_raw(&client, &url, &[(xff, chain)]).await;
        if status != StatusCode::TOO_MANY_REQUESTS {
            wrong.push(format!(
                "X-Forwarded-For {:?} after 203.0.113.7 spent its quota: got {status}, expected 429",
                String::from_utf8_lossy(chain)
            ));
        }
    }

    // Two different clients, each with junk to the left: each has its own bucket.
    let url = forwarded_server(&server, "two", false).await;
    for chain in [&b"junk, 198.51.100.20"[..], b"junk, 198.51.100.21"] {
        let (status, _, _) = fetch_raw(&client, &url, &[(xff, chain)]).await;
        if status != StatusCode::OK {
            wrong.push(format!(
                "X-Forwarded-For {:?}, a fresh client: got {status}, expected 200",
                String::from_utf8_lossy(chain)
            ));
        }
    }
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
}

/// An element whose `for=` is not an IP address (`unknown` or an obfuscated `_name`, both allowed
/// by RFC 7239) must end the walk from the right, never be skipped: the element to its left was
/// written by the client, and believing it would let the client pick its bucket at will.
#[tokio::test(flavor = "multi_thread")]
async fn forwarded_header_never_skips_an_unknown_hop() {
    let server = RedisServer::start();
    let client = client();

    let mut wrong = Vec::new();
    for hidden in ["unknown", "_proxy-hidden"] {
        let url = forwarded_server(&server, &format!("fwd-{hidden}"), true).await;
        let mut admitted = 0;
        for made_up in ["198.51.100.1", "198.51.100.2", "198.51.100.3"] {
            let chain = format!("for={made_up}, for={hidden}");
            let (status, _, _) = fetch(&client, &url, &[("forwarded", &chain)]).await;
            admitted += usize::from(status == StatusCode::OK);
        }
        // One client, whose address the proxy did not disclose: at most one request per minute,
        // whatever it writes to the left.
        if admitted > 1 {
            wrong.push(format!(
                "for={hidden}: {admitted} of 3 admitted under a limit of 1"
            ));
        }
    }
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
}

/// Serves `router` on 127.0.0.1 with axum, with or without connect info; returns its base URL.
async fn axum_server(router: Router, connect_info: bool) -> String {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        if connect_info {
            axum::serve(
                listener,
                router.into_make_service_with_connect_info::<SocketAddr>(),
            )
            .await
            .unwrap();
        } else {
            axum::serve(listener, router).await.unwrap();
        }
    });
    format!("http://{addr}")
}

/// Copies axum's `ConnectInfo<SocketAddr>` into a plain `SocketAddr` extension, which `PeerIp`
/// reads without the crate's `axum` feature.
fn copy_connect_info(mut req: Request<Body>) -> Request<Body> {
    if let Some(ConnectInfo(addr)) = req.extensions().get::<ConnectInfo<SocketAddr>>().copied() {
        req.extensions_mut().insert(addr);
    }
    req
}

#[tokio::test(flavor = "multi_thread")]
async fn axum_server_with_peer_ip_over_tcp() {
    let server = RedisServer::start();
    let layer = RateLimitLayer::builder(server.store())
        .limit(Limit::per_minute("minute", 3))
        .key(PeerIp::new())
        .build()
        .unwrap();
    let router = Router::new()
        .route(
            "/",
            get(
                |decision: Option<axum::Extension<RateLimitDecision>>| async move {
                    // The handler sees the decision in its request extensions.
                    match decision {
                        Some(axum::Extension(d)) if d.source() == DecisionSource::Store => "hello",
                        _ => "no decision",
                    }
                },
            ),
        )
        .layer(layer)
        .layer(MapRequestLayer::new(copy_connect_info));
    let client = client();

    let url = format!("{}/", axum_server(router.clone(), true).await);
    for _ in 0..3 {
        let (status, _, body) = fetch(&client, &url, &[]).await;
        assert_eq!(status, StatusCode::OK);
        assert_eq!(body, "hello");
    }
    let (status, headers, body) = fetch(&client, &url, &[]).await;
    assert_denied(status, &headers);
    common::assert_quota_problem(&body, &["minute"]);

    // Served without connect info there is no peer address: a clear 400, not a panic or a 500.
    let url = format!("{}/", axum_server(router, false).await);
    let (status, _, body) = fetch(&client, &url, &[]).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert!(!body.is_empty() && body.len() < 200);
}

/// With the crate's `axum` feature, `PeerIp` reads `ConnectInfo<SocketAddr>` by itself.
#[cfg(feature = "axum")]
#[tokio::test(flavor = "multi_thread")]
async fn axum_connect_info_is_read_with_the_axum_feature() {
    let server = RedisServer::start();
    let layer = RateLimitLayer::builder(server.store())
        .limit(Limit::per_minute("minute", 3))
        .key(PeerIp::new())
        .build()
        .unwrap();
    let router = Router::new()
        .route("/", get(|| async { "hello" }))
        .layer(layer);
    let url = format!("{}/", axum_server(router, true).await);
    let client = client();
    for _ in 0..3 {
        let (status, _, body) = fetch(&client, &url, &[]).await;
        assert_eq!(status, StatusCode::OK);
        assert_eq!(body, "hello");
    }
    let (status, headers, _) = fetch(&client, &url, &[]).await;
    assert_denied(status, &headers);
}
