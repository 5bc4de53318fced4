//! The gRPC example's server (`examples/grpc/server.rs`) under a real tonic client over TCP,
//! against real `redis-server` processes: rate limits surface as `RESOURCE_EXHAUSTED` with
//! `retry-after` metadata, idempotent calls replay byte for byte, failed calls are not stored;
//! and one layer value serves axum, tonic and hyper side by side.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use crate::common;
use crate::grpc_server as server;

use std::collections::HashSet;
use std::convert::Infallible;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use axum::Router;
use axum::routing::get;
use bytes::Bytes;
use http::{HeaderMap, Request as HttpRequest, Response as HttpResponse, StatusCode};
use http_body_util::{Empty, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::service::TowerToHyperService;
use tokio::net::TcpListener;
use tollgate::concurrency::{ConcurrencyLimitLayer, Permit};
use tollgate::idempotency::{IdempotencyLayer, RequestBody};
use tollgate::key::Header;
use tollgate::rate_limit::{Limit, RateLimitLayer};
use tonic::metadata::{MetadataMap, MetadataValue};
use tonic::transport::Channel;
use tonic::{Code, Request, Response, Status};
use tower::ServiceBuilder;

use common::RedisServer;
use server::helloworld::greeter_client::GreeterClient;
use server::helloworld::greeter_server::{Greeter, GreeterServer};
use server::helloworld::{HelloReply, HelloRequest};
use server::{HelloGreeter, Layers};

/// A greeter that counts its executions, reports the count in `x-execution` metadata, and
/// fails with INTERNAL the first time it greets a name starting with `fail-once`.
#[derive(Debug, Clone, Default)]
struct CountingGreeter {
    runs: Arc<AtomicUsize>,
    failed: Arc<Mutex<HashSet<String>>>,
}

impl CountingGreeter {
    fn runs(&self) -> usize {
        self.runs.load(Ordering::SeqCst)
    }
}

#[tonic::async_trait]
impl Greeter for CountingGreeter {
    async fn say_hello(
        &self,
        request: Request<HelloRequest>,
    ) -> Result<Response<HelloReply>, Status> {
        let run = self.runs.fetch_add(1, Ordering::SeqCst) + 1;
        let name = request.into_inner().name;
        if name.starts_with("fail-once") && self.failed.lock().unwrap().insert(name.clone()) {
            return Err(Status::internal(format!("run {run} failed")));
        }
        let mut response = Response::new(HelloReply {
            message: format!("Hello {name} ({})", uuid::Uuid::new_v4()),
        });
        response
            .metadata_mut()
            .insert("x-execution", MetadataValue::from(run));
        Ok(response)
    }
}

/// Serves `greeter` with the example's layers on a fresh Redis; the client and the Redis.
async fn start<G: Greeter>(
    greeter: G,
    limits: Vec<Limit>,
) -> (GreeterClient<Channel>, RedisServer) {
    let redis = RedisServer::start();
    let layers = Layers::new(Arc::new(redis.store()), limits).unwrap();
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(server::serve(
        listener,
        greeter,
        layers,
        std::future::pending(),
    ));
    let client = GreeterClient::connect(format!("http://{addr}"))
        .await
        .unwrap();
    (client, redis)
}

/// A `SayHello` call with the given metadata entries.
fn hello(name: &str, metadata: &[(&'static str, &str)]) -> Request<HelloRequest> {
    let mut request = Request::new(HelloRequest {
        name: name.to_owned(),
    });
    for (key, value) in metadata {
        request.metadata_mut().insert(*key, value.parse().unwrap());
    }
    request
}

/// The metadata (headers and trailers, which tonic merges for a unary call) as the handler and
/// tonic produced it: without what belongs to one transmission — `date` and `content-length`
/// (set by the HTTP/2 server: a replayed body has a known length, a live one streams), the
/// `ratelimit` headers of the rate-limit layer, which sits outside the idempotency layer and
/// counts every call — and without the replay mark.
fn comparable(metadata: &MetadataMap) -> HeaderMap {
    let mut headers = metadata.clone().into_headers();
    for name in [
        "date",
        "content-length",
        "ratelimit",
        "ratelimit-policy",
        "idempotent-replayed",
    ] {
        headers.remove(name);
    }
    headers
}

/// A retry made the moment the client has its whole answer must find the key settled: a
/// replay after a success, a fresh run after a failure — never ABORTED ("still being
/// processed"), which would mean the layer let the answer (its trailers, or a trailers-only
/// head) out before it had recorded or released the key.
fn settled<T: std::fmt::Debug>(result: Result<Response<T>, Status>) -> Result<Response<T>, Status> {
    if let Err(status) = &result {
        assert_ne!(
            status.code(),
            Code::Aborted,
            "the key was still in flight after the client had its whole answer: the \
             idempotency layer delivered the trailers (or a trailers-only head) before it \
             settled the key: {status:?}"
        );
    }
    result
}

#[tokio::test(flavor = "multi_thread")]
async fn over_the_limit_calls_fail_with_resource_exhausted_and_retry_after() {
    let (client, _redis) = start(HelloGreeter, vec![Limit::per_minute("minute", 3)]).await;
    let mut ok = 0;
    let mut exhausted = Vec::new();
    for i in 0..7 {
        match client
            .clone()
            .say_hello(hello(&format!("call {i}"), &[("x-api-key", "alice")]))
            .await
        {
            Ok(reply) => {
                ok += 1;
                assert!(
                    reply
                        .get_ref()
                        .message
                        .starts_with(&format!("Hello call {i} ("))
                );
                let metadata = reply.metadata();
                assert_eq!(
                    metadata.get("ratelimit-policy").unwrap(),
                    r#""minute";q=3;w=60"#
                );
            }
            Err(status) => exhausted.push(status),
        }
    }
    assert_eq!(ok, 3, "exactly the limit of calls succeed");
    assert_eq!(exhausted.len(), 4);
    for status in &exhausted {
        assert_eq!(status.code(), Code::ResourceExhausted, "{status:?}");
        assert_eq!(status.message(), "rate limit exceeded");
        let metadata = status.metadata();
        assert_eq!(metadata.get("retry-after").unwrap(), "60");
        assert_eq!(metadata.get("ratelimit").unwrap(), r#""minute";r=0;t=60"#);
        assert_eq!(
            metadata.get("ratelimit-policy").unwrap(),
            r#""minute";q=3;w=60"#
        );
    }
    // the limit is per caller: another API key still gets through
    let bob = client
        .clone()
        .say_hello(hello("bob", &[("x-api-key", "bob")]))
        .await
        .unwrap();
    assert!(bob.get_ref().message.starts_with("Hello bob ("));
    // and a caller without an API key is keyed by its IP address
    for _ in 0..3 {
        client.clone().say_hello(hello("anon", &[])).await.unwrap();
    }
    let status = client
        .clone()
        .say_hello(hello("anon", &[]))
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::ResourceExhausted);
}

/// Two calls with one `idempotency-key`, the second as soon as the first has its answer: one
/// execution, and the second gets the first's reply and metadata.
#[tokio::test(flavor = "multi_thread")]
async fn a_call_with_an_idempotency_key_is_replayed_byte_for_byte() {
    let greeter = CountingGreeter::default();
    let (client, _redis) = start(greeter.clone(), vec![Limit::per_minute("minute", 100)]).await;
    let keyed = || {
        hello(
            "ada",
            &[("x-api-key", "alice"), ("idempotency-key", "greet-1")],
        )
    };

    let first = client.clone().say_hello(keyed()).await.unwrap();
    let replay = settled(client.clone().say_hello(keyed()).await).unwrap();
    assert_eq!(greeter.runs(), 1, "the retry did not run the handler");
    assert!(first.get_ref().message.starts_with("Hello ada ("));
    assert_eq!(replay.get_ref().message, first.get_ref().message);
    assert!(first.metadata().get("idempotent-replayed").is_none());
    assert_eq!(
        replay.metadata().get("idempotent-replayed").unwrap(),
        "true"
    );
    // headers and trailers (merged into the metadata by tonic) are the first answer's
    assert_eq!(first.metadata().get("x-execution").unwrap(), "1");
    assert_eq!(comparable(replay.metadata()), comparable(first.metadata()));
    assert_eq!(comparable(first.metadata())["grpc-status"], "0");
    assert_eq!(
        comparable(first.metadata()).len(),
        3,
        "{:?}",
        first.metadata()
    );
    let first_bytes = prost::Message::encode_to_vec(first.get_ref());
    assert_eq!(prost::Message::encode_to_vec(replay.get_ref()), first_bytes);

    // without a key, the call runs again: a new id
    let unkeyed = client
        .clone()
        .say_hello(hello("ada", &[("x-api-key", "alice")]))
        .await
        .unwrap();
    assert_eq!(greeter.runs(), 2);
    assert_ne!(unkeyed.get_ref().message, first.get_ref().message);
    assert_eq!(unkeyed.metadata().get("x-execution").unwrap(), "2");

    // the same key from another caller is another record
    let other = client
        .clone()
        .say_hello(hello(
            "ada",
            &[("x-api-key", "bob"), ("idempotency-key", "greet-1")],
        ))
        .await
        .unwrap();
    assert_eq!(greeter.runs(), 3);
    assert_ne!(other.get_ref().message, first.get_ref().message);

    // the same key with another request is refused, not replayed
    let status = client
        .clone()
        .say_hello(hello(
            "grace",
            &[("x-api-key", "alice"), ("idempotency-key", "greet-1")],
        ))
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::FailedPrecondition, "{status:?}");
    assert_eq!(greeter.runs(), 3);
}

/// A call that fails with INTERNAL (a trailers-only response: HTTP 200, `grpc-status: 13`) is
/// not stored: its immediate retry runs the handler again, and that success is then replayed.
#[tokio::test(flavor = "multi_thread")]
async fn a_failed_call_is_not_stored_and_its_retry_runs_again() {
    let greeter = CountingGreeter::default();
    let (client, _redis) = start(greeter.clone(), vec![Limit::per_minute("minute", 100)]).await;
    let keyed = || {
        hello(
            "fail-once",
            &[("x-api-key", "alice"), ("idempotency-key", "retry-1")],
        )
    };

    let status = client.clone().say_hello(keyed()).await.unwrap_err();
    assert_eq!(status.code(), Code::Internal);
    assert_eq!(status.message(), "run 1 failed");
    assert_eq!(greeter.runs(), 1);

    let retry = settled(client.clone().say_hello(keyed()).await);
    assert_eq!(
        greeter.runs(),
        2,
        "the INTERNAL status was stored and replayed instead of running the retry: {retry:?}"
    );
    let retry = retry.unwrap();
    assert!(retry.get_ref().message.starts_with("Hello fail-once ("));
    assert!(retry.metadata().get("idempotent-replayed").is_none());

    // the success is stored: the next retry is its replay
    let replay = settled(client.clone().say_hello(keyed()).await).unwrap();
    assert_eq!(greeter.runs(), 2);
    assert_eq!(replay.get_ref().message, retry.get_ref().message);
    assert_eq!(
        replay.metadata().get("idempotent-replayed").unwrap(),
        "true"
    );
}

/// One `RateLimitLayer` value and one `IdempotencyLayer` value, cloned into an axum router, a
/// tonic server and a hyper server at once: they type-check in all three, and the three servers
/// share the one limit.
#[tokio::test(flavor = "multi_thread")]
async fn one_layer_value_serves_axum_tonic_and_hyper() {
    let redis = RedisServer::start();
    let rate_limit = RateLimitLayer::builder(redis.store())
        .limit(Limit::per_minute("minute", 3))
        .key(Header::from_static("x-api-key"))
        .build()
        .unwrap();
    let idempotency = IdempotencyLayer::builder(redis.store())
        .unscoped()
        .build()
        .unwrap();

    // axum: the last `.layer()` is the outermost
    let router = Router::new()
        .route("/hello", get(|| async { "hello from axum" }))
        .layer(idempotency.clone())
        .layer(rate_limit.clone());
    let axum_listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let axum_url = format!("http://{}/hello", axum_listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(axum_listener, router).await });

    // tonic: the first `.layer()` is the outermost
    let tonic_server = tonic::transport::Server::builder()
        .layer(rate_limit.clone())
        .layer(idempotency.clone())
        .add_service(GreeterServer::new(HelloGreeter));
    let tonic_listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let tonic_url = format!("http://{}", tonic_listener.local_addr().unwrap());
    tokio::spawn(
        tonic_server
            .serve_with_incoming(tonic::transport::server::TcpIncoming::from(tonic_listener)),
    );

    // hyper: tower's ServiceBuilder, the first `.layer()` is the outermost
    let hyper_listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let hyper_url = format!("http://{}/hello", hyper_listener.local_addr().unwrap());
    let (hyper_rate_limit, hyper_idempotency) = (rate_limit.clone(), idempotency.clone());
    tokio::spawn(async move {
        while let Ok((stream, _)) = hyper_listener.accept().await {
            let service = ServiceBuilder::new()
                .layer(hyper_rate_limit.clone())
                .layer(hyper_idempotency.clone())
                .service_fn(|_: HttpRequest<RequestBody<hyper::body::Incoming>>| async {
                    Ok::<_, Infallible>(HttpResponse::new(Full::new(Bytes::from_static(
                        b"hello from hyper",
                    ))))
                });
            tokio::spawn(
                hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), TowerToHyperService::new(service)),
            );
        }
    });

    let http = Client::builder(TokioExecutor::new()).build_http::<Empty<Bytes>>();
    let get = |url: &str| {
        let request = HttpRequest::get(url)
            .header("x-api-key", "shared")
            .body(Empty::new())
            .unwrap();
        http.request(request)
    };
    let mut grpc = GreeterClient::connect(tonic_url).await.unwrap();
    let key = [("x-api-key", "shared")];

    assert_eq!(get(&axum_url).await.unwrap().status(), StatusCode::OK);
    grpc.say_hello(hello("tonic", &key)).await.unwrap();
    assert_eq!(get(&hyper_url).await.unwrap().status(), StatusCode::OK);
    // the three servers spent the one limit of three
    assert_eq!(
        get(&axum_url).await.unwrap().status(),
        StatusCode::TOO_MANY_REQUESTS
    );
    let status = grpc.say_hello(hello("tonic", &key)).await.unwrap_err();
    assert_eq!(status.code(), Code::ResourceExhausted);
    assert_eq!(
        get(&hyper_url).await.unwrap().status(),
        StatusCode::TOO_MANY_REQUESTS
    );
}

/// A greeter that works half a second and greets with the fencing token of its permit.
#[derive(Debug, Clone, Default)]
struct PermitGreeter;

#[tonic::async_trait]
impl Greeter for PermitGreeter {
    async fn say_hello(
        &self,
        request: Request<HelloRequest>,
    ) -> Result<Response<HelloReply>, Status> {
        let permit = request
            .extensions()
            .get::<Permit>()
            .map(Permit::fencing_token);
        tokio::time::sleep(std::time::Duration::from_millis(500)).await;
        let message = format!("permit {}", permit.unwrap_or(0));
        Ok(Response::new(HelloReply { message }))
    }
}

/// A tonic server with a concurrency limit of 1 per tenant: of two overlapping calls of one
/// tenant one runs, holding a permit, and the other fails with RESOURCE_EXHAUSTED and
/// `retry-after`; another tenant runs meanwhile; once the first ends the tenant runs again.
#[tokio::test(flavor = "multi_thread")]
async fn concurrency_limits_answer_grpc_calls_with_resource_exhausted() {
    let redis = RedisServer::start();
    let jobs = ConcurrencyLimitLayer::builder(redis.store())
        .limit(1)
        .key(Header::from_static("x-tenant"))
        .retry_after(std::time::Duration::from_secs(1))
        .build()
        .unwrap();
    let server = tonic::transport::Server::builder()
        .layer(jobs)
        .add_service(GreeterServer::new(PermitGreeter));
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(server.serve_with_incoming(tonic::transport::server::TcpIncoming::from(listener)));
    let client = GreeterClient::connect(url).await.unwrap();
    let call = |tenant: &'static str| {
        let mut client = client.clone();
        async move {
            client
                .say_hello(hello("job", &[("x-tenant", tenant)]))
                .await
        }
    };
    let (first, second, other) = tokio::join!(
        call("acme"),
        async {
            tokio::time::sleep(std::time::Duration::from_millis(100)).await;
            call("acme").await
        },
        call("globex")
    );
    let token =
        |message: String| -> u64 { message.strip_prefix("permit ").unwrap().parse().unwrap() };
    let first = token(first.unwrap().into_inner().message);
    assert!(first > 0, "the handler holds a permit");
    let refused = second.unwrap_err();
    assert_eq!(refused.code(), Code::ResourceExhausted, "{refused:?}");
    assert_eq!(refused.metadata().get("retry-after").unwrap(), "1");
    assert!(other.is_ok(), "another tenant runs meanwhile");
    // the permit went back with the first call's response
    tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    let again = token(call("acme").await.unwrap().into_inner().message);
    assert!(
        again > first,
        "a higher fencing token: {first} then {again}"
    );
}

/// A "model" that uses the tokens its request's name says (`"100"`) and reports them in its
/// response metadata — or, for `"fail:<n>"`, fails with UNAVAILABLE after using `n`, reported
/// in the status's metadata (a trailers-only response: its metadata is the head).
struct TokenGreeter;

#[tonic::async_trait]
impl Greeter for TokenGreeter {
    async fn say_hello(
        &self,
        request: Request<HelloRequest>,
    ) -> Result<Response<HelloReply>, Status> {
        let name = request.into_inner().name;
        if let Some(used) = name.strip_prefix("fail:") {
            let mut metadata = MetadataMap::new();
            metadata.insert("x-tokens-used", used.parse().unwrap());
            return Err(Status::with_metadata(
                Code::Unavailable,
                "overloaded",
                metadata,
            ));
        }
        let mut response = Response::new(HelloReply {
            message: format!("used {name}"),
        });
        response
            .metadata_mut()
            .insert("x-tokens-used", name.parse().unwrap());
        Ok(response)
    }
}

/// Reserve, then settle, under tonic: calls reserve `x-max-tokens` and are charged the usage
/// their response metadata reports, failed calls included. With a budget of 1000, reserving 300
/// and using 100: exactly 8 admitted, then RESOURCE_EXHAUSTED; the `ratelimit` metadata of each
/// answer shows the settled balance.
#[tokio::test(flavor = "multi_thread")]
async fn grpc_calls_are_charged_the_usage_their_metadata_reports() {
    let redis = RedisServer::start();
    let used = |parts: &http::response::Parts| {
        parts
            .headers
            .get("x-tokens-used")?
            .to_str()
            .ok()?
            .parse()
            .ok()
    };
    let tokens = RateLimitLayer::builder(redis.store())
        .limit(Limit::per_minute("tokens", 1000))
        .key(Header::from_static("x-api-key"))
        .cost(|req| {
            let max = req.headers.get("x-max-tokens");
            max.and_then(|v| v.to_str().ok()?.parse().ok()).unwrap_or(1)
        })
        .settle(used)
        .build()
        .unwrap();
    let server = tonic::transport::Server::builder()
        .layer(tokens)
        .add_service(GreeterServer::new(TokenGreeter));
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(server.serve_with_incoming(tonic::transport::server::TcpIncoming::from(listener)));
    let client = GreeterClient::connect(url).await.unwrap();
    let call = |name: &str, key: &'static str| {
        let mut client = client.clone();
        let request = hello(name, &[("x-api-key", key), ("x-max-tokens", "300")]);
        async move { client.say_hello(request).await }
    };

    let mut admitted = 0;
    let mut remaining = Vec::new();
    loop {
        match call("100", "alice").await {
            Ok(reply) => {
                admitted += 1;
                let header = reply.metadata().get("ratelimit").unwrap().to_str().unwrap();
                remaining.push(header.to_owned());
            }
            Err(status) => {
                assert_eq!(status.code(), Code::ResourceExhausted, "{status:?}");
                break;
            }
        }
        assert!(admitted <= 10, "more admitted than the budget allows");
    }
    assert_eq!(
        admitted, 8,
        "1000 tokens, 300 reserved, 100 used each: {remaining:?}"
    );
    assert_eq!(
        remaining[0], r#""tokens";r=900;t=60"#,
        "settled before the head went out"
    );
    assert_eq!(remaining[7], r#""tokens";r=200;t=60"#);

    // a failed call is charged what its status's metadata reports
    let failed = call("fail:250", "bob").await.unwrap_err();
    assert_eq!(failed.code(), Code::Unavailable);
    assert_eq!(
        failed.metadata().get("ratelimit").unwrap(),
        r#""tokens";r=750;t=60"#,
        "{failed:?}"
    );
    let next = call("100", "bob").await.unwrap();
    assert_eq!(
        next.metadata().get("ratelimit").unwrap(),
        r#""tokens";r=650;t=60"#
    );
}
