//! Meter benchmark: `cargo bench --bench meter`.
//!
//! What reading the usage of a streamed response costs (`settle_stream`), side by side in one
//! run, on a `MemoryStore`:
//!
//! - **per frame**: the time to send a streamed response of [`FRAMES`] server-sent events
//!   (OpenAI-style chunks of about 60 bytes, the usage last) through the rate-limit layer, per
//!   frame: the body alone; through the layer settling on the response head (`settle`, which
//!   reads nothing of the body); through the layer settling on the stream with
//!   `SseUsage::openai()` and with `TrailerUsage`. The difference is the meter's cost per frame.
//! - **memory**: a response of 100 MB (`BENCH_MB`) of events streamed through the layer with
//!   `SseUsage::openai()`, its frames dropped as they arrive: the growth of the process's
//!   resident set (`VmRSS`) over the stream, which no buffering means stays flat — and once
//!   more for a body of 100 MB that holds no event at all (no blank line), which the meter stops
//!   reading past 256 KiB.
//!
//! Environment knobs: `BENCH_MB` (the size of the large responses, default 100).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::convert::Infallible;
use std::hint::black_box;

use bytes::Bytes;
use criterion::{BenchmarkId, Criterion, Throughput};
use http::{HeaderMap, Request, Response};
use http_body::Frame;
use http_body_util::{BodyExt, StreamBody};
use tollgate::key::Header;
use tollgate::rate_limit::{Algorithm, Limit, RateLimitLayer, SseUsage, TrailerUsage};
use tollgate::store::MemoryStore;
use tower::{Layer, ServiceExt, service_fn};

/// The events of one response in the per-frame rows.
const FRAMES: usize = 1_000;

/// One content chunk, as an OpenAI-style stream sends it.
const CHUNK: &[u8] = b"data: {\"choices\":[{\"delta\":{\"content\":\"word \"}}]}\n\n";
const USAGE: &[u8] =
    b"data: {\"choices\":[],\"usage\":{\"total_tokens\":1000}}\n\ndata: [DONE]\n\n";

#[derive(Debug, Clone, Copy)]
enum Subject {
    BodyAlone,
    SettleHead,
    SseUsage,
    TrailerUsage,
}

impl Subject {
    fn name(self) -> &'static str {
        match self {
            Self::BodyAlone => "body alone",
            Self::SettleHead => "layer, settle on the head",
            Self::SseUsage => "layer, settle_stream(SseUsage::openai())",
            Self::TrailerUsage => "layer, settle_stream(TrailerUsage)",
        }
    }
}

/// `n` content chunks, the usage, and a trailer.
fn frames(
    n: usize,
    chunk: &'static [u8],
) -> impl Iterator<Item = Result<Frame<Bytes>, Infallible>> {
    let mut trailers = HeaderMap::new();
    trailers.insert("x-tokens-used", "1000".parse().unwrap());
    std::iter::repeat_n(chunk, n)
        .chain([USAGE])
        .map(|data| Ok(Frame::data(Bytes::from_static(data))))
        .chain([Ok(Frame::trailers(trailers))])
}

fn layer(subject: Subject) -> RateLimitLayer<Header> {
    let builder = RateLimitLayer::builder(MemoryStore::new())
        .limit(Limit::per_second("tokens", 1_000_000_000))
        .algorithm(Algorithm::Gcra)
        .key(Header::from_static("x-tenant"))
        .cost(|_| 2_000);
    match subject {
        Subject::SettleHead | Subject::BodyAlone => builder.settle(|_| None),
        Subject::SseUsage => builder.settle_stream(|_| SseUsage::openai()),
        Subject::TrailerUsage => {
            builder.settle_stream(|_| TrailerUsage::from_static("x-tokens-used"))
        }
    }
    .build()
    .unwrap()
}

/// Sends one response of `n` chunks through `subject`, and drains it.
async fn send(subject: Subject, layer: &RateLimitLayer<Header>, n: usize, chunk: &'static [u8]) {
    let upstream = service_fn(move |_: Request<()>| async move {
        let body = StreamBody::new(futures_util::stream::iter(frames(n, chunk)));
        Ok::<_, Infallible>(Response::new(body))
    });
    let request = || {
        Request::post("/v1/chat")
            .header("x-tenant", "acme")
            .body(())
            .unwrap()
    };
    match subject {
        Subject::BodyAlone => {
            let response = upstream.oneshot(request()).await.unwrap();
            drain(response.into_body()).await;
        }
        _ => {
            let response = layer.layer(upstream).oneshot(request()).await.unwrap();
            drain(response.into_body()).await;
        }
    }
}

async fn drain<B: http_body::Body<Data = Bytes>>(body: B)
where
    B::Error: std::fmt::Debug,
{
    let mut body = std::pin::pin!(body);
    while let Some(frame) = body.frame().await {
        black_box(frame.unwrap());
    }
}

/// The process's resident set, in KiB.
fn rss_kib() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|line| line.strip_prefix("VmRSS:"))
        .and_then(|value| value.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0)
}

fn main() {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let mut criterion = Criterion::default().configure_from_args();
    let mut group = criterion.benchmark_group("streamed response, per frame");
    group.throughput(Throughput::Elements(FRAMES as u64 + 2));
    for subject in [
        Subject::BodyAlone,
        Subject::SettleHead,
        Subject::SseUsage,
        Subject::TrailerUsage,
    ] {
        let layer = layer(subject);
        group.bench_function(BenchmarkId::from_parameter(subject.name()), |b| {
            b.to_async(&runtime)
                .iter(|| send(subject, &layer, FRAMES, CHUNK));
        });
    }
    group.finish();
    criterion.final_summary();

    let mb: usize = std::env::var("BENCH_MB")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(100);
    let events = mb * 1024 * 1024 / CHUNK.len();
    let layer = layer(Subject::SseUsage);
    println!("\n| response | size | resident set before | after | growth |");
    println!("| --- | ---: | ---: | ---: | ---: |");
    for (what, chunk) in [
        ("events, usage last", CHUNK),
        ("no event at all", &[b'x'; 60] as &'static [u8]),
    ] {
        let before = rss_kib();
        runtime.block_on(send(Subject::SseUsage, &layer, events, chunk));
        let after = rss_kib();
        println!(
            "| {what} | {} MB | {} KiB | {} KiB | {} KiB |",
            events * chunk.len() / (1024 * 1024),
            before,
            after,
            after.saturating_sub(before)
        );
    }
}
