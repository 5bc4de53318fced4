//! Reserve, then settle on the bytes sent (`settle_body_size`), on Redis and PostgreSQL: a
//! response streamed in full is charged its size, one cut short what went out, one whose client
//! left before its head nothing (in memory too), and two copies see one balance.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use crate::common;

use std::convert::Infallible;
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body::Frame;
use http_body_util::{BodyExt, StreamBody};
use tower::ServiceExt;

use tollgate::key::Header;
use tollgate::rate_limit::{Algorithm, Limit, QuotaUnit, RateLimitLayer};
use tollgate::store::RateStore;

type Chunks =
    StreamBody<futures_util::stream::Iter<std::vec::IntoIter<Result<Frame<Bytes>, Infallible>>>>;

/// A byte budget of 1,000 per caller, each response reserving 400.
fn layer(store: impl RateStore) -> RateLimitLayer<Header> {
    RateLimitLayer::builder(store)
        .limit(Limit::per_hour("egress", 1_000))
        .algorithm(Algorithm::SlidingCounter)
        .key(Header::from_static("x-api-key"))
        .cost(|_| 400)
        .settle_body_size()
        .quota_unit(QuotaUnit::ContentBytes)
        .build()
        .unwrap()
}

/// Answers with three chunks of 100 bytes.
async fn three_chunks(_: Request<String>) -> Result<Response<Chunks>, Infallible> {
    let chunks: Vec<_> = (0..3)
        .map(|_| Ok(Frame::data(Bytes::from(vec![b'x'; 100]))))
        .collect();
    Ok(Response::new(StreamBody::new(futures_util::stream::iter(
        chunks,
    ))))
}

fn download(caller: &str) -> Request<String> {
    Request::get("/export")
        .header("x-api-key", caller)
        .body(String::new())
        .unwrap()
}

/// What `caller` has left, once the background settlements have landed: polled until it is
/// `expected`, or failed naming what it was.
async fn left_becomes(layer: &RateLimitLayer<Header>, caller: &str, expected: u64) {
    let head = download(caller).into_parts().0;
    let key = layer.key_of(&head).unwrap();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    loop {
        let left = layer.peek(key).await.unwrap().limits[0].remaining;
        if left == expected {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "{caller} has {left} left, expected {expected}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

async fn bytes_sent_are_charged(copies: [RateLimitLayer<Header>; 2]) {
    let caller = format!("alice-{:x}", rand::random::<u64>());
    let [a, b] = copies;
    // in full on copy A: 300 of the 400 reserved
    let response = tower::Layer::layer(&a, tower::service_fn(three_chunks))
        .oneshot(download(&caller))
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    // sent before the body: the balance with the reservation charged
    let balance = response.headers()["ratelimit"].to_str().unwrap();
    assert!(balance.starts_with(r#""egress";r=600;t="#), "{balance}");
    let body = response.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(body.len(), 300);
    left_becomes(&b, &caller, 700).await;
    // cut short on copy B after one chunk: 100
    let response = tower::Layer::layer(&b, tower::service_fn(three_chunks))
        .oneshot(download(&caller))
        .await
        .unwrap();
    let mut body = response.into_body();
    let first = body.frame().await.unwrap().unwrap();
    assert_eq!(first.data_ref().map(Bytes::len), Some(100));
    drop(body);
    left_becomes(&a, &caller, 600).await;
    // 600 left: a third reservation of 400 fits, a fourth does not until the third settles
    let third = tower::Layer::layer(&a, tower::service_fn(three_chunks))
        .oneshot(download(&caller))
        .await
        .unwrap();
    assert_eq!(third.status(), StatusCode::OK);
    let refused = tower::Layer::layer(&b, tower::service_fn(three_chunks))
        .oneshot(download(&caller))
        .await
        .unwrap();
    assert_eq!(refused.status(), StatusCode::TOO_MANY_REQUESTS);
    drop(third.into_body().collect().await.unwrap());
    left_becomes(&b, &caller, 300).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_redis_two_copies_are_charged_the_bytes_sent() {
    let server = common::RedisServer::start();
    bytes_sent_are_charged([layer(server.store()), layer(server.store())]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_postgres_two_copies_are_charged_the_bytes_sent() {
    let store = common::postgres::store().await;
    bytes_sent_are_charged([layer(store.clone()), layer(store)]).await;
}

/// A client that leaves before the response head (its connection closed: the server drops the
/// request's future while the handler works) was sent nothing: its reservation is settled to
/// 0 — the whole 400 given back — and, with the handler answering later, nothing is charged
/// then either.
async fn a_client_gone_before_the_head_is_charged_nothing(layer: RateLimitLayer<Header>) {
    let caller = format!("gone-{:x}", rand::random::<u64>());
    let (entered, release) = (
        std::sync::Arc::new(tokio::sync::Notify::new()),
        std::sync::Arc::new(tokio::sync::Notify::new()),
    );
    let handler = {
        let (entered, release) = (entered.clone(), release.clone());
        tower::service_fn(move |request: Request<String>| {
            let (entered, release) = (entered.clone(), release.clone());
            async move {
                entered.notify_one();
                release.notified().await;
                three_chunks(request).await
            }
        })
    };
    let service = tower::Layer::layer(&layer, handler);
    let call = tokio::spawn(service.oneshot(download(&caller)));
    entered.notified().await;
    left_becomes(&layer, &caller, 600).await; // 400 reserved while the handler works
    call.abort();
    assert!(call.await.unwrap_err().is_cancelled());
    release.notify_one();
    left_becomes(&layer, &caller, 1_000).await;
    tokio::time::sleep(Duration::from_millis(100)).await;
    left_becomes(&layer, &caller, 1_000).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_memory_a_client_gone_before_the_head_is_charged_nothing() {
    a_client_gone_before_the_head_is_charged_nothing(layer(tollgate::store::MemoryStore::new()))
        .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_redis_a_client_gone_before_the_head_is_charged_nothing() {
    let server = common::RedisServer::start();
    a_client_gone_before_the_head_is_charged_nothing(layer(server.store())).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_postgres_a_client_gone_before_the_head_is_charged_nothing() {
    let store = common::postgres::store().await;
    a_client_gone_before_the_head_is_charged_nothing(layer(store)).await;
}

#[test]
fn settling_on_the_body_needs_a_reservation() {
    let error = RateLimitLayer::builder(tollgate::store::MemoryStore::new())
        .limit(Limit::per_hour("egress", 1_000))
        .settle_body_size()
        .build()
        .unwrap_err();
    assert!(error.to_string().contains(".cost("), "{error}");
}
