//! The outbound limit as a `reqwest-middleware` middleware (feature `reqwest`).

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;

use tokio::time::Instant;

use super::error::{Limited, OutboundError};
use super::layer::OutboundLimitLayer;
use super::service::refusal;
use crate::key::KeyExtractor;

/// What a middleware's error carries: why the call was not made.
fn failed(error: OutboundError<Infallible>) -> reqwest_middleware::Error {
    reqwest_middleware::Error::middleware(error)
}

/// A call's head as the key extractor and the cost closure read it.
fn head_of(request: &reqwest::Request) -> Result<http::request::Parts, reqwest_middleware::Error> {
    let (mut head, ()) = http::Request::builder()
        .method(request.method().clone())
        .uri(request.url().as_str())
        .version(request.version())
        .body(())
        .map_err(reqwest_middleware::Error::middleware)?
        .into_parts();
    head.headers = request.headers().clone();
    Ok(head)
}

/// An answer's head, as a settlement reads it.
fn head_of_answer(response: &reqwest::Response) -> http::response::Parts {
    let (mut head, ()) = http::Response::new(()).into_parts();
    head.status = response.status();
    head.version = response.version();
    head.headers = response.headers().clone();
    head
}

/// Limits a `reqwest_middleware::ClientWithMiddleware`'s calls as the layer limits a tower
/// client's: each waits for room (failing past its patience with
/// [`OutboundError::Limited`], inside `reqwest_middleware::Error::Middleware`), a provider's
/// `429` / `503` pauses its key, and a layer with [`settle`](crate::rate_limit::RateLimitLayerBuilder::settle) settles on the
/// answer's head (a meter of the body, `settle_stream`, is for tower clients).
///
/// ```
/// # #[tokio::main(flavor = "current_thread")] async fn main() {
/// use std::time::Duration;
///
/// use tollgate::outbound::OutboundError;
/// use tollgate::rate_limit::{Limit, RateLimitLayer};
/// use tollgate::store::MemoryStore;
///
/// let provider = RateLimitLayer::builder(MemoryStore::new())
///     .limit(Limit::per_hour("calls", 1))
///     .queue(Duration::from_millis(100))
///     .build_outbound()
///     .unwrap();
/// let client = reqwest_middleware::ClientBuilder::new(reqwest::Client::new()).with(provider).build();
/// # let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
/// # let addr = listener.local_addr().unwrap();
/// # tokio::spawn(async move { axum::serve(listener, axum::Router::new().route("/v1/calls", axum::routing::post(|| async { "ok" }))).await });
/// let url = format!("http://{addr}/v1/calls");
/// assert_eq!(client.post(&url).send().await.unwrap().status(), 200);
/// // the hour's one call is spent: the next has no room within its patience
/// let error = client.post(&url).send().await.unwrap_err();
/// let reqwest_middleware::Error::Middleware(error) = error else { panic!("{error}") };
/// assert!(matches!(
///     error.downcast_ref::<OutboundError<std::convert::Infallible>>(),
///     Some(OutboundError::Limited(_))
/// ));
/// # }
/// ```
impl<K: KeyExtractor> reqwest_middleware::Middleware for OutboundLimitLayer<K> {
    fn handle<'a, 'b, 'c, 'd>(
        &'a self,
        request: reqwest::Request,
        extensions: &'b mut http::Extensions,
        next: reqwest_middleware::Next<'c>,
    ) -> Pin<Box<dyn Future<Output = reqwest_middleware::Result<reqwest::Response>> + Send + 'd>>
    where
        Self: 'd,
        'a: 'd,
        'b: 'd,
        'c: 'd,
    {
        Box::pin(async move {
            let arrived = Instant::now();
            let head = head_of(&request)?;
            let key = self.rate.extractor().extract(&head);
            let book = &self.shared.book;
            if let Some(key) = key
                && let Some(until) = book.paused_until(key).await
            {
                let wait = until.saturating_duration_since(Instant::now());
                if wait > self.shared.patience {
                    let limited = Limited {
                        retry_after: wait,
                        waited: std::time::Duration::ZERO,
                    };
                    return Err(failed(OutboundError::Limited(limited)));
                }
                tokio::time::sleep_until(until).await;
            }
            let direct = self
                .rate
                .decide_direct(&head, arrived)
                .await
                .map_err(|(refused, decision)| failed(refusal(refused, decision.as_ref())))?;
            let response = next.run(request, extensions).await?;
            if let Some(key) = key {
                let decision = direct.decision.as_ref();
                let (status, headers) = (response.status(), response.headers());
                self.shared.heard(key, decision, status, headers).await;
            }
            self.rate
                .settle_direct(direct, &head_of_answer(&response))
                .await;
            Ok(response)
        })
    }
}
