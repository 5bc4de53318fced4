//! Costs settled on the usage a streamed response reports (`settle_stream`), on a
//! `MemoryStore`, a real `redis-server` and a real PostgreSQL, across two copies: the usage in
//! the last server-sent event, or in a trailer, is what the budget is charged; a client that
//! leaves midway, a body that fails, a stream that reports nothing are charged as the builder's
//! table says.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::convert::Infallible;

use bytes::Bytes;
use http::{HeaderMap, Request, Response, StatusCode};
use http_body::Frame;
use http_body_util::{BodyExt, StreamBody};
use tower::{Layer, ServiceExt, service_fn};

use super::metered::acme_left;
use tollgate::key::Header;
use tollgate::rate_limit::{Limit, Meter, RateLimitLayer, SseUsage, TrailerUsage};
use tollgate::store::RateStore;

/// What every request reserves.
const ESTIMATE: u64 = 500;
/// The tenant's budget.
const BUDGET: u64 = 100_000;

/// How the upstream ends its stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Ending {
    /// An OpenAI-style last chunk with `usage.total_tokens`, then `[DONE]`.
    UsageEvent(u64),
    /// A trailer `x-tokens-used`.
    Trailer(u64),
    /// No usage at all.
    Nothing,
    /// A failure of the body after its first events.
    Failure,
}

type Frames = Vec<Result<Frame<Bytes>, std::io::Error>>;

/// Ten content events, then the ending.
fn frames(ending: Ending) -> Frames {
    let mut frames: Frames = (0..10)
        .map(|i| {
            let event =
                format!("data: {{\"choices\":[{{\"delta\":{{\"content\":\"word {i} \"}}}}]}}\n\n");
            Ok(Frame::data(Bytes::from(event)))
        })
        .collect();
    match ending {
        Ending::UsageEvent(used) => {
            let last = format!(
                "data: {{\"choices\":[],\"usage\":{{\"total_tokens\":{used}}}}}\n\ndata: [DONE]\n\n"
            );
            frames.push(Ok(Frame::data(Bytes::from(last))));
        }
        Ending::Trailer(used) => {
            let mut trailers = HeaderMap::new();
            trailers.insert("x-tokens-used", used.to_string().parse().unwrap());
            frames.push(Ok(Frame::trailers(trailers)));
        }
        Ending::Nothing => {}
        Ending::Failure => frames.insert(5, Err(std::io::Error::other("upstream reset"))),
    }
    frames
}

/// A copy of the gateway: a token budget per `x-tenant`, settled on what `meter` reads.
fn copy<M: Meter>(
    store: impl RateStore,
    prefix: &str,
    meter: impl Fn() -> M + Send + Sync + 'static,
) -> RateLimitLayer<Header> {
    RateLimitLayer::builder(store)
        .limit(Limit::per_hour("tokens", BUDGET))
        .prefix(prefix)
        .key(Header::from_static("x-tenant"))
        .cost(|_| ESTIMATE)
        .settle_stream(move |_| meter())
        .build()
        .unwrap()
}

/// Streams one response ending as `ending` through `layer`, and reads `frames_read` of its
/// frames (all of them with `None`) before the client goes.
async fn stream(layer: &RateLimitLayer<Header>, ending: Ending, frames_read: Option<usize>) {
    let upstream = service_fn(move |_: Request<()>| async move {
        let body = StreamBody::new(futures_util::stream::iter(frames(ending)));
        let response = Response::builder().header("content-type", "text/event-stream");
        Ok::<_, Infallible>(response.body(body).unwrap())
    });
    let request = Request::post("/v1/chat/completions")
        .header("x-tenant", "acme")
        .body(())
        .unwrap();
    let response = layer.layer(upstream).oneshot(request).await.unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    let mut body = response.into_body();
    let mut read = 0;
    while frames_read.is_none_or(|n| read < n) {
        match body.frame().await {
            Some(Ok(_)) => read += 1,
            Some(Err(_)) | None => break,
        }
    }
}

/// Ten streams through each of two copies, their usage in the last event: the budget is
/// charged exactly the usage reported, none of the reservations.
async fn usage_in_the_last_event_is_charged_across_copies<S: RateStore + Clone>(store: S) {
    let prefix = format!("sse{:08x}", rand::random::<u32>());
    let a = copy(store.clone(), &prefix, SseUsage::openai);
    let b = copy(store, &prefix, SseUsage::openai);
    for i in 0..20u64 {
        let copy = if i % 2 == 0 { &a } else { &b };
        stream(copy, Ending::UsageEvent(100 + i), None).await;
    }
    let used: u64 = (0..20).map(|i| 100 + i).sum();
    assert_eq!(acme_left(&a).await, BUDGET - used);
    assert_eq!(acme_left(&b).await, BUDGET - used);
}

/// The same with the usage in a trailer.
async fn usage_in_a_trailer_is_charged_across_copies<S: RateStore + Clone>(store: S) {
    let prefix = format!("trl{:08x}", rand::random::<u32>());
    let used_trailer = || TrailerUsage::from_static("x-tokens-used");
    let a = copy(store.clone(), &prefix, used_trailer);
    let b = copy(store, &prefix, used_trailer);
    for i in 0..20u64 {
        let copy = if i % 2 == 0 { &a } else { &b };
        stream(copy, Ending::Trailer(7 * i), None).await;
    }
    let used: u64 = (0..20).map(|i| 7 * i).sum();
    assert_eq!(acme_left(&b).await, BUDGET - used);
}

/// As the builder's table says: a client that leaves after half the stream (before the usage)
/// is charged what it reserved; one that leaves after the usage event, the usage; a stream
/// that reports nothing, what it reserved; a body that fails midway, what it reserved.
async fn streams_cut_short_or_silent_are_charged_as_stated<S: RateStore + Clone>(store: S) {
    let cases = [
        (
            "left after half the stream",
            Ending::UsageEvent(300),
            Some(5),
            ESTIMATE,
        ),
        (
            "left after the usage event",
            Ending::UsageEvent(300),
            Some(11),
            300,
        ),
        ("no usage reported", Ending::Nothing, None, ESTIMATE),
        ("a body that fails midway", Ending::Failure, None, ESTIMATE),
    ];
    for (case, ending, frames_read, charged) in cases {
        let prefix = format!("cut{:08x}", rand::random::<u32>());
        let layer = copy(store.clone(), &prefix, SseUsage::openai);
        stream(&layer, ending, frames_read).await;
        assert_eq!(acme_left(&layer).await, BUDGET - charged, "{case}");
    }
}

on_memory_redis_postgres!(
    usage_in_the_last_event_is_charged_across_copies,
    usage_in_a_trailer_is_charged_across_copies,
    streams_cut_short_or_silent_are_charged_as_stated,
);
