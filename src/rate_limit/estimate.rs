//! [`EstimateLayer`]: a request's cost estimated from its body, read whole up to a cap and
//! handed on intact, for a rate limit's [`cost`](super::RateLimitLayerBuilder::cost) to read.

use std::borrow::Cow;
use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use http::request::Parts;
use http::{Request, Response, StatusCode};
use http_body::Body;
use http_body_util::{BodyExt, Full, LengthLimitError, Limited};
use tower_layer::Layer;
use tower_service::Service;

use crate::body::{LayerBody, Tap};
use crate::error::BoxError;
use crate::grpc::{Code, Wire};
use crate::rejection::Rejection;

/// How long a request body may take to arrive whole unless configured otherwise.
pub const DEFAULT_BODY_TIMEOUT: Duration = Duration::from_secs(30);

/// What [`EstimateLayer`] read a request to cost, in its extensions: for a rate limit inside it,
/// `.cost(|parts| Estimate::of(parts).unwrap_or(1))`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Estimate(u64);

impl Estimate {
    /// The estimate.
    pub fn get(self) -> u64 {
        self.0
    }

    /// The estimate of the request with head `parts`, if an [`EstimateLayer`] made one.
    pub fn of(parts: &Parts) -> Option<u64> {
        parts.extensions.get::<Self>().map(|e| e.0)
    }
}

/// Why a body could not be estimated, said to the client in a `400` (its detail): name what is
/// wrong with the request, never what the service holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EstimateError(Cow<'static, str>);

impl EstimateError {
    /// A refusal that says `why`.
    pub fn new(why: impl Into<Cow<'static, str>>) -> Self {
        Self(why.into())
    }
}

impl fmt::Display for EstimateError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for EstimateError {}

/// Reads a request's body whole — at most `max_bytes` of it, within a deadline — estimates the
/// request's cost from it, and hands the body on intact with the [`Estimate`] in the request's
/// extensions: for a rate limit inside that reserves what a request says it may use (an LLM
/// call's `max_tokens`), then [settles](super::RateLimitLayerBuilder::settle) what it used.
///
/// A body past `max_bytes` (by its `Content-Length`, or as it arrives) is answered `413`, one
/// not whole within the [`body_timeout`](Self::body_timeout) `408`, one that fails to arrive or
/// that `estimate` refuses `400` — problem details (gRPC: `RESOURCE_EXHAUSTED`,
/// `DEADLINE_EXCEEDED`, `INVALID_ARGUMENT`), the inner service not called. The estimate is the
/// client's word: bound it (`clamp`), and settle on what the request really used.
///
/// ```
/// # #[tokio::main(flavor = "current_thread")] async fn main() {
/// use std::convert::Infallible;
/// use http::{Request, Response, StatusCode};
/// use http_body_util::Full;
/// use tower::{ServiceBuilder, ServiceExt};
/// use tollgate::key::Header;
/// use tollgate::rate_limit::{Estimate, EstimateError, EstimateLayer, Limit, RateLimitLayer};
/// use tollgate::store::MemoryStore;
///
/// // the most tokens the call may use: its JSON's max_tokens, at most 4,096
/// let max_tokens = EstimateLayer::new(64 * 1024, |_, body| {
///     let json: serde_json::Value = serde_json::from_slice(body)
///         .map_err(|_| EstimateError::new("the body is not JSON"))?;
///     let max = json["max_tokens"].as_u64().ok_or(EstimateError::new("max_tokens is missing"))?;
///     Ok(max.clamp(1, 4096))
/// });
/// let tokens = RateLimitLayer::builder(MemoryStore::new())
///     .limit(Limit::per_minute("tokens", 10_000))
///     .key(Header::from_static("x-api-key"))
///     .cost(|parts| Estimate::of(parts).unwrap_or(1))
///     .build()
///     .unwrap();
/// let llm = ServiceBuilder::new()
///     .layer(max_tokens)
///     .layer(tokens)
///     .service_fn(|_: Request<Full<bytes::Bytes>>| async {
///         Ok::<_, Infallible>(Response::new(String::new()))
///     });
/// let call = |body: &'static str| {
///     Request::post("/v1/chat").header("x-api-key", "alice").body(Full::from(body)).unwrap()
/// };
/// let ok = llm.clone().oneshot(call(r#"{"max_tokens": 300}"#)).await.unwrap();
/// assert_eq!(ok.headers()["ratelimit"], r#""tokens";r=9700;t=60"#);
/// let bad = llm.oneshot(call("max_tokens=300")).await.unwrap();
/// assert_eq!(bad.status(), StatusCode::BAD_REQUEST);
/// # }
/// ```
pub struct EstimateLayer<F> {
    max_bytes: usize,
    body_timeout: Duration,
    estimate: Arc<F>,
}

impl<F> EstimateLayer<F>
where
    F: Fn(&Parts, &[u8]) -> Result<u64, EstimateError> + Send + Sync + 'static,
{
    /// Reads bodies of at most `max_bytes`, estimated by `estimate` from the request's head and
    /// whole body.
    pub fn new(max_bytes: usize, estimate: F) -> Self {
        Self {
            max_bytes,
            body_timeout: DEFAULT_BODY_TIMEOUT,
            estimate: Arc::new(estimate),
        }
    }
}

impl<F> EstimateLayer<F> {
    /// How long a body may take to arrive whole (default [`DEFAULT_BODY_TIMEOUT`]); past it,
    /// `408`: a client that sends slowly holds nothing longer.
    pub fn body_timeout(mut self, timeout: Duration) -> Self {
        self.body_timeout = timeout;
        self
    }
}

impl<F> Clone for EstimateLayer<F> {
    fn clone(&self) -> Self {
        Self {
            max_bytes: self.max_bytes,
            body_timeout: self.body_timeout,
            estimate: Arc::clone(&self.estimate),
        }
    }
}

impl<F> fmt::Debug for EstimateLayer<F> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("EstimateLayer")
            .field("max_bytes", &self.max_bytes)
            .field("body_timeout", &self.body_timeout)
            .finish_non_exhaustive()
    }
}

impl<S, F> Layer<S> for EstimateLayer<F> {
    type Service = EstimateService<S, F>;

    fn layer(&self, inner: S) -> Self::Service {
        EstimateService {
            inner,
            layer: self.clone(),
        }
    }
}

/// Estimates a request's cost from its body; made by [`EstimateLayer`].
pub struct EstimateService<S, F> {
    inner: S,
    layer: EstimateLayer<F>,
}

impl<S: Clone, F> Clone for EstimateService<S, F> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
            layer: self.layer.clone(),
        }
    }
}

impl<S: fmt::Debug, F> fmt::Debug for EstimateService<S, F> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("EstimateService")
            .field("inner", &self.inner)
            .field("layer", &self.layer)
            .finish()
    }
}

tapped_body! {
    /// The response body of an [`EstimateService`]: the inner service's, or a complete body made
    /// by tollgate (a refusal). Its error is the inner body's, unboxed.
    EstimateBody { untapped: Untapped }
}

/// An [`EstimateBody`] watches nothing of what goes out.
#[derive(Debug, Default)]
pub(crate) struct Untapped;

impl Tap for Untapped {
    fn frame<E>(&mut self, _: &Poll<Option<Result<http_body::Frame<Bytes>, E>>>) {}
}

impl<B> EstimateBody<B> {
    fn inner(body: B) -> Self {
        Self {
            body: LayerBody::inner(body),
            untapped: Untapped,
        }
    }
}

/// The future of an [`EstimateService`]: the body read, then the inner service's answer.
pub type EstimateFuture<T, E> = Pin<Box<dyn Future<Output = Result<T, E>> + Send>>;

impl<S, F, ReqBody, ResBody> Service<Request<ReqBody>> for EstimateService<S, F>
where
    S: Service<Request<Full<Bytes>>, Response = Response<ResBody>> + Clone + Send + 'static,
    S::Future: Send,
    S::Error: Send,
    F: Fn(&Parts, &[u8]) -> Result<u64, EstimateError> + Send + Sync + 'static,
    ReqBody: Body<Data = Bytes> + Send + 'static,
    ReqBody::Error: Into<BoxError>,
    ResBody: Send + 'static,
{
    type Response = Response<EstimateBody<ResBody>>;
    type Error = S::Error;
    type Future = EstimateFuture<Self::Response, S::Error>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request<ReqBody>) -> Self::Future {
        // the clone goes on serving; the instance that `poll_ready` readied handles this request
        let clone = self.inner.clone();
        let mut ready = std::mem::replace(&mut self.inner, clone);
        let layer = self.layer.clone();
        Box::pin(async move {
            let (mut parts, body) = request.into_parts();
            let wire = Wire::of(&parts.headers);
            let read = read_whole(&parts, body, layer.max_bytes, layer.body_timeout).await;
            let estimated = read.and_then(|body| {
                let estimate = (layer.estimate)(&parts, &body).map_err(Refusal::Estimate)?;
                Ok((estimate, body))
            });
            let (estimate, body) = match estimated {
                Ok(estimated) => estimated,
                Err(refusal) => return Ok(refusal.into_response(wire).map(EstimateBody::from)),
            };
            parts.extensions.insert(Estimate(estimate));
            let response = ready
                .call(Request::from_parts(parts, Full::new(body)))
                .await?;
            Ok(response.map(EstimateBody::inner))
        })
    }
}

/// Why a request is refused before its estimate.
enum Refusal {
    TooLarge,
    Timeout,
    Unreadable,
    Estimate(EstimateError),
}

impl Refusal {
    fn into_response(self, wire: Wire) -> Response<crate::body::Complete> {
        let (status, code, message) = match self {
            Self::TooLarge => (
                StatusCode::PAYLOAD_TOO_LARGE,
                Code::ResourceExhausted,
                Cow::Borrowed(
                    "the request body is larger than this endpoint reads to estimate its cost",
                ),
            ),
            Self::Timeout => (
                StatusCode::REQUEST_TIMEOUT,
                Code::DeadlineExceeded,
                Cow::Borrowed("the request body did not arrive in time"),
            ),
            Self::Unreadable => (
                StatusCode::BAD_REQUEST,
                Code::InvalidArgument,
                Cow::Borrowed("the request body could not be read"),
            ),
            Self::Estimate(error) => (StatusCode::BAD_REQUEST, Code::InvalidArgument, error.0),
        };
        Rejection {
            status,
            code,
            message,
        }
        .into_response(wire)
    }
}

/// The whole body, if it is at most `max` bytes (by its `Content-Length`, then as it arrives)
/// and arrives within `timeout`.
async fn read_whole<B>(
    parts: &Parts,
    body: B,
    max: usize,
    timeout: Duration,
) -> Result<Bytes, Refusal>
where
    B: Body<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    let declared = parts
        .headers
        .get(http::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok()?.parse::<u64>().ok());
    if declared.is_some_and(|length| length > max as u64) {
        return Err(Refusal::TooLarge);
    }
    let read = async {
        let mut body = std::pin::pin!(Limited::new(body, max));
        let mut whole = BytesMut::new();
        while let Some(frame) = body.frame().await {
            let frame = frame.map_err(|error| {
                if error.downcast_ref::<LengthLimitError>().is_some() {
                    Refusal::TooLarge
                } else {
                    Refusal::Unreadable
                }
            })?;
            if let Ok(data) = frame.into_data() {
                whole.extend_from_slice(&data);
            }
        }
        Ok(whole.freeze())
    };
    tokio::time::timeout(timeout, read)
        .await
        .unwrap_or(Err(Refusal::Timeout))
}
