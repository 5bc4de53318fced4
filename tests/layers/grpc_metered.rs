//! A token budget on a gRPC server-streaming method, through tonic on both sides over TCP, on a
//! `MemoryStore`, a real `redis-server` and a real PostgreSQL: the usage a tonic handler sends
//! in its trailers (the status of a stream that ends well, with metadata) settles the budget,
//! across two copies; a client that cancels the call before the trailers is charged what it
//! reserved. And a tonic channel behind an outbound limit (`build_outbound`): its calls wait for
//! room, and fail past their patience.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::convert::Infallible;
use std::net::SocketAddr;
use std::pin::Pin;
use std::task::{Context, Poll};

use futures_util::{Stream, StreamExt};
use tokio::net::TcpListener;
use tonic::codegen::BoxFuture;
use tonic::metadata::MetadataMap;
use tonic::server::{NamedService, ServerStreamingService};
use tonic::transport::{Channel, Server};
use tonic::{Code, Status};

use super::metered::acme_left;
use tollgate::key::Header;
use tollgate::rate_limit::{Limit, RateLimitLayer, TrailerUsage};
use tollgate::store::RateStore;

/// What each call reserves.
const ESTIMATE: u64 = 500;
/// The tenant's budget.
const BUDGET: u64 = 100_000;
/// The chunks of each answer, and the tokens each uses.
const CHUNKS: u64 = 4;
const PER_CHUNK: u64 = 30;

/// A prompt.
#[derive(Clone, PartialEq, prost::Message)]
struct Prompt {
    #[prost(string, tag = "1")]
    text: String,
}

/// A chunk of the answer.
#[derive(Clone, PartialEq, prost::Message)]
struct Chunk {
    #[prost(string, tag = "1")]
    text: String,
}

const METHOD: &str = "/metered.Model/Complete";

/// The model: answers [`CHUNKS`] chunks, then ends the stream well with its usage in the
/// trailers (`x-tokens-used`), as tonic lets a handler do: a status of code OK with metadata.
#[derive(Clone)]
struct Model;

type Chunks = Pin<Box<dyn Stream<Item = Result<Chunk, Status>> + Send>>;

impl ServerStreamingService<Prompt> for Model {
    type Response = Chunk;
    type ResponseStream = Chunks;
    type Future = BoxFuture<tonic::Response<Chunks>, Status>;

    fn call(&mut self, _: tonic::Request<Prompt>) -> Self::Future {
        let chunks = (0..CHUNKS).map(|n| {
            Ok(Chunk {
                text: format!("word {n}"),
            })
        });
        let mut trailers = MetadataMap::new();
        let used = (CHUNKS * PER_CHUNK).to_string();
        trailers.insert("x-tokens-used", used.parse().unwrap());
        let end = Err(Status::with_metadata(Code::Ok, "", trailers));
        let stream = futures_util::stream::iter(chunks.chain([end]))
            // a word at a time, as a model answers
            .then(|chunk| async {
                tokio::time::sleep(std::time::Duration::from_millis(20)).await;
                chunk
            });
        Box::pin(async move { Ok(tonic::Response::new(Box::pin(stream) as Chunks)) })
    }
}

/// The service tonic's router serves: the one method, by tonic's own server code.
#[derive(Clone)]
struct ModelServer;

impl NamedService for ModelServer {
    const NAME: &'static str = "metered.Model";
}

impl tower::Service<http::Request<tonic::body::Body>> for ModelServer {
    type Response = http::Response<tonic::body::Body>;
    type Error = Infallible;
    type Future = BoxFuture<Self::Response, Infallible>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: http::Request<tonic::body::Body>) -> Self::Future {
        Box::pin(async move {
            let mut grpc = tonic::server::Grpc::new(tonic_prost::ProstCodec::default());
            Ok(grpc.server_streaming(Model, request).await)
        })
    }
}

fn budget(store: impl RateStore, prefix: &str) -> RateLimitLayer<Header> {
    RateLimitLayer::builder(store)
        .prefix(prefix)
        .limit(Limit::per_hour("tokens", BUDGET))
        .key(Header::from_static("x-tenant"))
        .cost(|_| ESTIMATE)
        .settle_stream(|_| TrailerUsage::from_static("x-tokens-used"))
        .build()
        .unwrap()
}

/// A copy: tonic's server with the budget, on a port of its own.
async fn serve(layer: RateLimitLayer<Header>) -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(
        Server::builder()
            .layer(layer)
            .add_service(ModelServer)
            .serve_with_incoming(tonic::transport::server::TcpIncoming::from(listener)),
    );
    addr
}

/// Calls the method on `addr` for tenant `acme`: reads `read` chunks (all, when `None`) and the
/// trailers, or cancels the call after `read` chunks.
async fn complete(addr: SocketAddr, read: Option<usize>) -> Option<MetadataMap> {
    let channel = Channel::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut client = tonic::client::Grpc::new(channel);
    client.ready().await.unwrap();
    let mut request = tonic::Request::new(Prompt {
        text: "hello".into(),
    });
    request
        .metadata_mut()
        .insert("x-tenant", "acme".parse().unwrap());
    let path = http::uri::PathAndQuery::from_static(METHOD);
    let codec = tonic_prost::ProstCodec::<Prompt, Chunk>::default();
    let response = client.server_streaming(request, path, codec).await.unwrap();
    let mut stream = response.into_inner();
    match read {
        Some(n) => {
            for _ in 0..n {
                stream.message().await.unwrap().unwrap();
            }
            // dropped: tonic resets the stream, and the server drops the body
            None
        }
        None => {
            let mut chunks = 0;
            while stream.message().await.unwrap().is_some() {
                chunks += 1;
            }
            assert_eq!(chunks, CHUNKS);
            stream.trailers().await.unwrap()
        }
    }
}

/// Two copies, each tonic's server with its own budget layer on one store: a call through each
/// is charged the usage its trailers report, not the estimate; a call cancelled after one chunk
/// is charged what it reserved (it never reported its usage).
async fn trailers_settle_the_budget_across_copies(store: impl RateStore + Clone) {
    let prefix = format!("grpc{:08x}", rand::random::<u32>());
    let (a, b) = (budget(store.clone(), &prefix), budget(store, &prefix));
    let (addr_a, addr_b) = (serve(a.clone()).await, serve(b.clone()).await);
    let used = CHUNKS * PER_CHUNK;

    let trailers = complete(addr_a, None).await.unwrap();
    assert_eq!(trailers.get("x-tokens-used").unwrap(), &used.to_string());
    assert_eq!(acme_left(&a).await, BUDGET - used);
    complete(addr_b, None).await.unwrap();
    assert_eq!(acme_left(&b).await, BUDGET - 2 * used);
    assert_eq!(
        acme_left(&a).await,
        BUDGET - 2 * used,
        "one budget for both"
    );

    assert!(complete(addr_b, Some(1)).await.is_none());
    assert_eq!(acme_left(&a).await, BUDGET - 2 * used - ESTIMATE);
}

on_memory_redis_postgres!(trailers_settle_the_budget_across_copies);

/// A tonic channel behind an outbound limit: one call a half second, waited for, through tonic's
/// own client; past its patience a call fails with the limit's error, which tonic carries.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tonic_channel_waits_for_room() {
    use std::time::Duration;

    use tokio::time::Instant;

    let store = tollgate::store::MemoryStore::new();
    let addr = serve(budget(store.clone(), "model")).await;
    let outbound = RateLimitLayer::builder(store)
        .prefix("calls")
        .limit(Limit::new("calls", 1, Duration::from_millis(500)))
        .queue(Duration::from_millis(1_200))
        .build_outbound()
        .unwrap();
    let channel = Channel::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let paced = tower::ServiceBuilder::new()
        .layer(outbound)
        .service(channel);
    type Paced = tollgate::outbound::OutboundLimit<Channel, tollgate::key::Global>;
    let call = |mut client: tonic::client::Grpc<Paced>| async move {
        client.ready().await.map_err(|e| e.to_string())?;
        let mut request = tonic::Request::new(Prompt { text: "hi".into() });
        request
            .metadata_mut()
            .insert("x-tenant", "acme".parse().unwrap());
        let path = http::uri::PathAndQuery::from_static(METHOD);
        let codec = tonic_prost::ProstCodec::<Prompt, Chunk>::default();
        let response = client.server_streaming(request, path, codec).await;
        response.map(|_| ()).map_err(|status| status.to_string())
    };
    let client = tonic::client::Grpc::new(paced);
    let started = Instant::now();
    call(client.clone()).await.unwrap();
    call(client.clone()).await.unwrap();
    assert!(
        started.elapsed() >= Duration::from_millis(450),
        "the second waited"
    );
    // three at once: the third's room comes past its patience
    let (a, b, c) = tokio::join!(
        call(client.clone()),
        call(client.clone()),
        call(client.clone())
    );
    assert!(a.is_ok() && b.is_ok(), "{a:?} {b:?}");
    let refused = c.unwrap_err();
    assert!(refused.contains("no room for the call"), "{refused}");
}
