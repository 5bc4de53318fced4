//! The [`Idempotency`] service and the flow of one keyed request.

use std::fmt;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use futures_util::FutureExt;
use http::request::Parts;
use http::{HeaderValue, Request, Response, StatusCode, header};
use http_body::Body;
use http_body_util::{BodyExt, Either, Full, LengthLimitError, Limited};
use tokio::sync::{mpsc, oneshot};
use tokio::time::Instant;
use tower_service::Service;

use super::body::{BoxError, IdempotencyBody};
use super::fingerprint::fingerprint;
use super::future::ResponseFuture;
use super::key_header::{self, KeyProblem};
use super::layer::{OnConcurrent, Settings};
use super::record::StoredResponse;
use crate::grpc::{self, Code};
use crate::key::{Global, Key, KeyExtractor};
use crate::store::IdemBegin;
use crate::task::AbortOnDrop;

/// The request body the inner service receives: the buffered body of a keyed request, or the
/// original body of a request the layer passes through.
pub type RequestBody<B> = Either<Full<Bytes>, B>;

/// Runs each keyed request once across all copies of a service and replays its response to
/// retries; made by [`IdempotencyLayer`](super::IdempotencyLayer).
pub struct Idempotency<S, K = Global> {
    inner: S,
    settings: Arc<Settings>,
    scope: Arc<K>,
}

impl<S, K> Idempotency<S, K> {
    pub(crate) fn new(inner: S, settings: Arc<Settings>, scope: Arc<K>) -> Self {
        Self {
            inner,
            settings,
            scope,
        }
    }

    inner_service_accessors!();
}

impl<S: Clone, K> Clone for Idempotency<S, K> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
            settings: Arc::clone(&self.settings),
            scope: Arc::clone(&self.scope),
        }
    }
}

impl<S: fmt::Debug, K: fmt::Debug> fmt::Debug for Idempotency<S, K> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Idempotency")
            .field("inner", &self.inner)
            .field("settings", &self.settings)
            .field("scope", &self.scope)
            .finish()
    }
}

impl<S, K, ReqBody, ResBody> Service<Request<ReqBody>> for Idempotency<S, K>
where
    S: Service<Request<RequestBody<ReqBody>>, Response = Response<ResBody>>
        + Clone
        + Send
        + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    K: KeyExtractor,
    ReqBody: Body<Data = Bytes> + Send + 'static,
    ReqBody::Error: Into<BoxError>,
    ResBody: Body<Data = Bytes> + Send + 'static,
    ResBody::Error: Into<BoxError>,
{
    type Response = Response<IdempotencyBody<ResBody>>;
    type Error = S::Error;
    type Future = ResponseFuture<S::Future, ResBody, S::Error>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request<ReqBody>) -> Self::Future {
        let settings = &self.settings;
        if !settings.methods.contains(request.method()) {
            return ResponseFuture::passthrough(self.inner.call(request.map(Either::Right)));
        }
        let grpc = grpc::is_grpc(request.headers());
        let mut values = request.headers().get_all(&settings.header).iter();
        let parsed = match (values.next(), values.next()) {
            (None, _) if !settings.required => {
                return ResponseFuture::passthrough(self.inner.call(request.map(Either::Right)));
            }
            (None, _) => Err(KeyProblem::Missing),
            (Some(_), Some(_)) => Err(KeyProblem::Repeated),
            (Some(value), None) => key_header::parse(value),
        };
        let idempotency_key = match parsed {
            Ok(key) => key,
            Err(problem) => {
                return ResponseFuture::ready(Rejection::BadKey(problem).into_response(grpc));
            }
        };
        if declared_length(&request).is_some_and(|len| len > settings.body_limit as u64) {
            return ResponseFuture::ready(Rejection::TooLarge.into_response(grpc));
        }
        let (parts, body) = request.into_parts();
        let record_key = record_key(settings, self.scope.extract(&parts), &idempotency_key);
        // The clone goes on serving; the instance that `poll_ready` readied handles this request.
        let clone = self.inner.clone();
        let ready = std::mem::replace(&mut self.inner, clone);
        ResponseFuture::flow(Box::pin(handle(
            Arc::clone(settings),
            ready,
            parts,
            body,
            record_key,
            grpc,
        )))
    }
}

fn declared_length<B>(request: &Request<B>) -> Option<u64> {
    request
        .headers()
        .get(header::CONTENT_LENGTH)?
        .to_str()
        .ok()?
        .parse()
        .ok()
}

/// `<prefix>:idem:{<digest of scope and key>}`: the raw key never reaches the store.
fn record_key(settings: &Settings, scope: Option<Key>, idempotency_key: &str) -> String {
    let mut material = Vec::with_capacity(17 + idempotency_key.len());
    match scope {
        Some(scope) => {
            material.push(1);
            material.extend_from_slice(scope.as_bytes());
        }
        None => material.push(0),
    }
    material.extend_from_slice(idempotency_key.as_bytes());
    format!(
        "{}:idem:{{{}}}",
        settings.prefix,
        Key::new("idem", &material)
    )
}

type Answer<B, E> = Result<Response<IdempotencyBody<B>>, E>;

/// One keyed request: buffer and fingerprint it, then claim, replay or refuse.
async fn handle<S, ReqBody, ResBody>(
    settings: Arc<Settings>,
    service: S,
    parts: Parts,
    body: ReqBody,
    key: String,
    grpc: bool,
) -> Answer<ResBody, S::Error>
where
    S: Service<Request<RequestBody<ReqBody>>, Response = Response<ResBody>> + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    ReqBody: Body<Data = Bytes> + Send + 'static,
    ReqBody::Error: Into<BoxError>,
    ResBody: Body<Data = Bytes> + Send + 'static,
    ResBody::Error: Into<BoxError>,
{
    let body = match Limited::new(body, settings.body_limit).collect().await {
        Ok(collected) => collected.to_bytes(),
        Err(error) if error.downcast_ref::<LengthLimitError>().is_some() => {
            return Ok(Rejection::TooLarge.into_response(grpc));
        }
        Err(_) => return Ok(Rejection::UnreadableBody.into_response(grpc)),
    };
    let fingerprint = fingerprint(&parts, &settings.fingerprint_headers, &body);
    let token = uuid::Uuid::new_v4().to_string();
    let wait_until = match settings.on_concurrent {
        // a wait too long to add to the clock is as good as waiting for ever: cap at a day
        OnConcurrent::Wait(wait) => {
            Instant::now().checked_add(wait.min(Duration::from_secs(86_400)))
        }
        OnConcurrent::Reject => None,
    };
    let mut pause = Duration::from_millis(10);
    // While a claim attempt is unanswered — it timed out, or the caller went away mid-call — the
    // store may still have made it: the guard then releases it (token-checked, so harmlessly if
    // it was not made) instead of leaving the key blocked for a whole lease.
    let mut unanswered = ClaimGuard::new(&settings, &key, &token);
    loop {
        let begin = settings
            .store
            .idem_begin(
                key.clone(),
                fingerprint.clone(),
                token.clone(),
                settings.lease,
            )
            .await;
        match begin {
            Ok(IdemBegin::Claimed) => break,
            Ok(IdemBegin::Mismatch) => {
                unanswered.disarm();
                return Ok(Rejection::Mismatch.into_response(grpc));
            }
            Ok(IdemBegin::Completed(record)) => {
                unanswered.disarm();
                return Ok(replay(&record, grpc));
            }
            Ok(IdemBegin::InFlight { .. }) => match wait_until {
                Some(until) if Instant::now() < until => {
                    tokio::time::sleep(pause.min(until - Instant::now())).await;
                    pause = (pause * 2).min(Duration::from_millis(200));
                }
                _ => {
                    unanswered.disarm();
                    return Ok(Rejection::InFlight.into_response(grpc));
                }
            },
            Err(error) => {
                tracing::warn!(target: "tollgate::idempotency", %error, "idempotency store failed; refusing the request");
                return Ok(Rejection::StoreUnavailable.into_response(grpc));
            }
        }
    }
    // the claim is ours: the execution task owns it from here
    unanswered.disarm();
    let request = Request::from_parts(parts, Either::Left(Full::new(body)));
    let (head_tx, head_rx) = oneshot::channel();
    // Spawned: the handler runs to completion and its response is recorded even when the client
    // goes away, so that the client's retry gets the replay instead of a second execution.
    tokio::spawn(execute(settings, service, request, key, token, head_tx));
    match head_rx.await {
        Ok(answer) => answer,
        // the task ended without a response: the handler panicked (the key was released)
        Err(_) => Ok(Rejection::HandlerFailed.into_response(grpc)),
    }
}

/// Releases a claim whose attempt went unanswered, in the background, unless disarmed.
struct ClaimGuard {
    pending: Option<(Arc<Settings>, String, String)>,
}

impl ClaimGuard {
    fn new(settings: &Arc<Settings>, key: &str, token: &str) -> Self {
        Self {
            pending: Some((Arc::clone(settings), key.to_owned(), token.to_owned())),
        }
    }

    fn disarm(&mut self) {
        self.pending = None;
    }
}

impl Drop for ClaimGuard {
    fn drop(&mut self) {
        let Some((settings, key, token)) = self.pending.take() else {
            return;
        };
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(async move {
                release(&settings, key, token, "a claim attempt went unanswered").await;
            });
        }
    }
}

/// A completed response, replayed byte for byte plus `Idempotent-Replayed: true`.
fn replay<B>(record: &[u8], grpc: bool) -> Response<IdempotencyBody<B>> {
    let Some(stored) = StoredResponse::decode(record) else {
        tracing::error!(target: "tollgate::idempotency", "a stored response could not be decoded");
        return Rejection::StoreUnavailable.into_response(grpc);
    };
    let mut response = Response::new(IdempotencyBody::full(stored.body, stored.trailers));
    *response.status_mut() = stored.status;
    *response.headers_mut() = stored.headers;
    response
        .headers_mut()
        .insert("idempotent-replayed", HeaderValue::from_static("true"));
    response
}

/// Runs the handler, streams its response to the caller while capturing it, then stores it (or
/// releases the key).
async fn execute<S, ReqBody, ResBody>(
    settings: Arc<Settings>,
    mut service: S,
    request: Request<RequestBody<ReqBody>>,
    key: String,
    token: String,
    head: oneshot::Sender<Answer<ResBody, S::Error>>,
) where
    S: Service<Request<RequestBody<ReqBody>>, Response = Response<ResBody>> + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    ResBody: Body<Data = Bytes> + Send + 'static,
    ResBody::Error: Into<BoxError>,
{
    let keeper = AbortOnDrop(tokio::spawn(keep_lease(
        Arc::clone(&settings),
        key.clone(),
        token.clone(),
    )));
    let called = std::panic::catch_unwind(AssertUnwindSafe(|| service.call(request)));
    let outcome = match called {
        Ok(future) => AssertUnwindSafe(future).catch_unwind().await,
        Err(panic) => Err(panic),
    };
    let response = match outcome {
        Ok(Ok(response)) => response,
        Ok(Err(error)) => {
            release(&settings, key, token, "the handler returned an error").await;
            let _ = head.send(Err(error));
            return;
        }
        Err(_) => {
            release(&settings, key, token, "the handler panicked").await;
            return; // dropping `head` tells the caller
        }
    };
    let (parts, body) = response.into_parts();
    let mut record = (settings.store_when)(parts.status).then(|| StoredResponse {
        status: parts.status,
        headers: parts.headers.clone(),
        body: Bytes::new(),
        trailers: None,
    });
    let (frames_tx, frames_rx) = mpsc::channel(8);
    let hint = body.size_hint().exact();
    let response = Response::from_parts(parts, IdempotencyBody::channel(frames_rx, hint));
    // A response whose head is all of it (an empty body: a gRPC trailers-only status, a bodiless
    // 5xx) is settled before the head goes out, like the last frame of any other response.
    let mut unsent_head = None;
    if body.is_end_stream() || hint == Some(0) {
        unsent_head = Some((head, response));
    } else {
        let _ = head.send(Ok(response));
    }

    let mut captured = BytesMut::new();
    let mut delivered = 0u64;
    // With a known length the caller's end of body is its last byte, not the end of the stream:
    // that last frame is held back until the key is settled (below).
    let mut held = Vec::new();
    let mut body = std::pin::pin!(body);
    let failure: Option<BoxError> = loop {
        // converted within the statement: the body's own error type need not be Send; a panic
        // while producing the body counts as a failed response
        let next: Result<Option<Result<_, BoxError>>, _> = AssertUnwindSafe(body.frame())
            .catch_unwind()
            .await
            .map(|frame| frame.map(|f| f.map_err(Into::into)));
        let frame = match next {
            Ok(Some(Ok(frame))) => frame,
            Ok(None) => break None,
            Ok(Some(Err(error))) => break Some(error),
            Err(_) => break Some("the response body panicked".into()),
        };
        if let Some(stored) = record.as_mut() {
            if let Some(data) = frame.data_ref() {
                if captured.len() + data.len() > settings.response_limit {
                    record = None;
                } else {
                    captured.extend_from_slice(data);
                }
            } else if let Some(trailers) = frame.trailers_ref() {
                stored
                    .trailers
                    .get_or_insert_with(Default::default)
                    .extend(trailers.clone());
            }
        }
        delivered += frame.data_ref().map_or(0, |d| d.len() as u64);
        // Trailers are the end of a response too (a gRPC client is done when they arrive).
        if frame.is_trailers() || (hint.is_some_and(|len| delivered >= len) && frame.is_data()) {
            held.push(frame);
            continue;
        }
        // a caller that went away does not stop the recording
        let _ = frames_tx.send(Ok(frame)).await;
    };
    drop(keeper);
    // Record (or release) first, and only then let the caller see the end of the body or its
    // error: a client that has its whole answer and retries finds the key settled — a replay
    // after success, a fresh run after a failure — never still in flight.
    match record {
        Some(mut stored) if failure.is_none() && grpc_succeeded(&settings, &stored) => {
            stored.body = captured.freeze();
            complete(&settings, key, token, stored.encode()).await;
        }
        _ => release(&settings, key, token, "the response is not stored").await,
    }
    if let Some((head, response)) = unsent_head {
        let _ = head.send(Ok(response));
    }
    for frame in held {
        let _ = frames_tx.send(Ok(frame)).await;
    }
    if let Some(error) = failure {
        let _ = frames_tx.send(Err(error)).await;
    }
}

/// For a gRPC response, whether its `grpc-status` (trailers, or headers of a trailers-only
/// response) is one that [`store_grpc_when`](super::IdempotencyLayerBuilder::store_grpc_when)
/// keeps; other responses pass.
fn grpc_succeeded(settings: &Settings, stored: &StoredResponse) -> bool {
    let status = stored
        .trailers
        .as_ref()
        .and_then(|t| t.get("grpc-status"))
        .or_else(|| stored.headers.get("grpc-status"));
    match status {
        None => true,
        Some(value) => {
            let code = value
                .to_str()
                .ok()
                .and_then(|v| v.trim().parse::<i32>().ok())
                .unwrap_or(2); // unparseable: UNKNOWN
            (settings.store_grpc_when)(code)
        }
    }
}

async fn complete(settings: &Settings, key: String, token: String, record: Bytes) {
    match settings
        .store
        .idem_complete(key.clone(), token.clone(), record, settings.retention)
        .await
    {
        Ok(true) => {}
        Ok(false) => tracing::warn!(
            target: "tollgate::idempotency",
            "the lease of this request ran out and another request took the key over; its response was not stored"
        ),
        Err(error) => {
            tracing::warn!(target: "tollgate::idempotency", %error, "could not store a response");
            release(settings, key, token, "storing the response failed").await;
        }
    }
}

async fn release(settings: &Settings, key: String, token: String, why: &str) {
    if let Err(error) = settings.store.idem_release(key, token).await {
        tracing::warn!(
            target: "tollgate::idempotency",
            %error, why,
            "could not release an idempotency key; it frees itself when its lease ends"
        );
    }
}

/// Extends the claim every third of the lease while the handler runs; after a failed extension
/// it tries again soon, as the lease runs out a whole lease after the last confirmation.
async fn keep_lease(settings: Arc<Settings>, key: String, token: String) {
    let period = settings.lease / 3;
    let mut pause = period;
    loop {
        tokio::time::sleep(pause).await;
        match settings
            .store
            .idem_extend(key.clone(), token.clone(), settings.lease)
            .await
        {
            Ok(true) => pause = period,
            Ok(false) => {
                tracing::warn!(target: "tollgate::idempotency", "lost the claim on an idempotency key while its handler ran");
                return;
            }
            Err(error) => {
                tracing::warn!(target: "tollgate::idempotency", %error, "could not extend an idempotency lease");
                pause =
                    (settings.lease / 10).clamp(Duration::from_millis(1), Duration::from_secs(1));
            }
        }
    }
}

/// A response the layer gives instead of the handler's.
#[derive(Debug, Clone, Copy)]
enum Rejection {
    BadKey(KeyProblem),
    TooLarge,
    UnreadableBody,
    InFlight,
    Mismatch,
    StoreUnavailable,
    HandlerFailed,
}

impl Rejection {
    fn into_response<B>(self, grpc: bool) -> Response<IdempotencyBody<B>> {
        let (status, code, message) = match self {
            Self::BadKey(problem) => (
                StatusCode::BAD_REQUEST,
                Code::InvalidArgument,
                problem.message(),
            ),
            Self::TooLarge => (
                StatusCode::PAYLOAD_TOO_LARGE,
                Code::ResourceExhausted,
                "the request body is larger than this endpoint buffers for idempotency",
            ),
            Self::UnreadableBody => (
                StatusCode::BAD_REQUEST,
                Code::InvalidArgument,
                "the request body could not be read",
            ),
            Self::InFlight => (
                StatusCode::CONFLICT,
                Code::Aborted,
                "a request with this Idempotency-Key is still being processed",
            ),
            Self::Mismatch => (
                StatusCode::UNPROCESSABLE_ENTITY,
                Code::FailedPrecondition,
                "this Idempotency-Key was used with a different request",
            ),
            Self::StoreUnavailable => (
                StatusCode::SERVICE_UNAVAILABLE,
                Code::Unavailable,
                "idempotency store unavailable; the request was not processed",
            ),
            Self::HandlerFailed => (
                StatusCode::INTERNAL_SERVER_ERROR,
                Code::Internal,
                "the handler failed; nothing was stored and a retry runs it again",
            ),
        };
        let mut response = if grpc {
            grpc::trailers_only(code, message)
        } else {
            let mut response = Response::new(IdempotencyBody::full(
                Bytes::from(format!("{message}\n")),
                None,
            ));
            *response.status_mut() = status;
            response.headers_mut().insert(
                header::CONTENT_TYPE,
                HeaderValue::from_static("text/plain; charset=utf-8"),
            );
            response
        };
        if matches!(self, Self::InFlight | Self::StoreUnavailable) {
            response
                .headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
        }
        response
    }
}
