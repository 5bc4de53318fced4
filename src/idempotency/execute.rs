//! The spawned execution of a claimed request: run the handler, stream its response to the
//! caller while capturing it, then store it (or release the key) before the caller sees its end.

use std::panic::AssertUnwindSafe;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use futures_util::FutureExt;
use http::{Request, Response, response};
use http_body::{Body, Frame};
use http_body_util::BodyExt;
use tokio::sync::{mpsc, oneshot};
use tokio::time::Instant;
use tower_service::Service;

use super::body::IdempotencyBody;
use super::layer::Settings;
use super::record::StoredResponse;
use super::rejection::Rejection;
use super::service::{Handler, HttpBody, RequestBody};
use crate::BoxError;
use crate::lease::{self, Owner};
use crate::task::AbortOnDrop;

/// What the caller of a keyed request gets: a response, or the handler's error.
pub(super) type Answer<B, E> = Result<Response<IdempotencyBody<B>>, E>;

/// The head of a response that is all head, kept until the key is settled.
type UnsentHead<B, E> = Option<(oneshot::Sender<Answer<B, E>>, Response<IdempotencyBody<B>>)>;

/// The frames of the caller's body.
type Frames = mpsc::Sender<Result<Frame<Bytes>, BoxError>>;

/// Runs the handler, streams its response to the caller while capturing it, then stores it (or
/// releases the key).
pub(super) async fn execute<S, ReqBody, ResBody>(
    settings: Arc<Settings>,
    mut service: S,
    request: Request<RequestBody<ReqBody>>,
    key: String,
    token: String,
    grpc: bool,
    head: oneshot::Sender<Answer<ResBody, S::Error>>,
) where
    S: Handler<ReqBody, ResBody>,
    ResBody: HttpBody,
{
    let keeper = AbortOnDrop(tokio::spawn(keep_lease(
        Arc::clone(&settings),
        key.clone(),
        token.clone(),
    )));
    if let Err(error) = std::future::poll_fn(|cx| service.poll_ready(cx)).await {
        release(&settings, key, token, "the service was not ready").await;
        let _ = head.send(Err(error));
        return;
    }
    let response = match call_handler(&mut service, request).await {
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
    let Some(mut capture) = Capture::new(&settings, &parts, &body) else {
        release(&settings, key, token, "store_when panicked").await;
        let _ = head.send(Ok(Rejection::HandlerFailed.into_response(&settings, grpc)));
        return;
    };
    let (frames_tx, frames_rx) = mpsc::channel(8);
    let response = Response::from_parts(parts, IdempotencyBody::channel(frames_rx, capture.hint));
    // A response whose head is all of it (an empty body: a gRPC trailers-only status, a bodiless
    // 5xx) is settled before the head goes out, like the last frame of any other response.
    let mut unsent_head = None;
    if body.is_end_stream() || capture.hint == Some(0) {
        unsent_head = Some((head, response));
    } else {
        let _ = head.send(Ok(response));
    }
    let mut body = std::pin::pin!(body);
    let failure = forward(body.as_mut(), &mut capture, &frames_tx).await;
    let confirmed = record(
        &settings,
        key,
        token,
        &mut capture,
        failure.is_some(),
        keeper,
    )
    .await;
    settle(
        &settings,
        capture,
        failure,
        unsent_head,
        &frames_tx,
        confirmed,
        grpc,
    )
    .await;
}

/// Calls the handler and awaits its response; a panic in either is caught and returned.
async fn call_handler<S, Req>(
    service: &mut S,
    request: Req,
) -> std::thread::Result<Result<S::Response, S::Error>>
where
    S: Service<Req>,
{
    let called = std::panic::catch_unwind(AssertUnwindSafe(|| service.call(request)));
    match called {
        Ok(future) => AssertUnwindSafe(future).catch_unwind().await,
        Err(panic) => Err(panic),
    }
}

/// The response as recorded while it streams to the caller, and the frames held back from the
/// caller until the key is settled.
struct Capture {
    // `None` when the response is not to be stored: its status, or its size over the cap
    record: Option<StoredResponse>,
    captured: BytesMut,
    response_limit: usize,
    // the body's exact length, if it declares one
    hint: Option<u64>,
    delivered: u64,
    // With a known length the caller's end of body is its last byte, not the end of the stream:
    // that last frame is held back until the key is settled (by `settle`).
    held: Vec<Frame<Bytes>>,
}

impl Capture {
    /// A capture of the response with head `parts`; `None` when `store_when` panicked.
    fn new<B: Body>(settings: &Settings, parts: &response::Parts, body: &B) -> Option<Self> {
        let store_when = AssertUnwindSafe(|| (settings.store_when)(parts.status));
        let stored = std::panic::catch_unwind(store_when).ok()?;
        Some(Self {
            record: stored.then(|| StoredResponse {
                status: parts.status,
                headers: stored_headers(&parts.headers, &settings.unstored_headers),
                body: Bytes::new(),
                trailers: None,
            }),
            captured: BytesMut::new(),
            response_limit: settings.response_limit,
            hint: body.size_hint().exact(),
            delivered: 0,
            held: Vec::new(),
        })
    }

    /// Records `frame`, and gives it back if the caller may have it now rather than once the key
    /// is settled.
    fn take(&mut self, frame: Frame<Bytes>) -> Option<Frame<Bytes>> {
        if let Some(stored) = self.record.as_mut() {
            if let Some(data) = frame.data_ref() {
                if self.captured.len() + data.len() > self.response_limit {
                    self.record = None;
                } else {
                    self.captured.extend_from_slice(data);
                }
            } else if let Some(trailers) = frame.trailers_ref() {
                stored
                    .trailers
                    .get_or_insert_with(Default::default)
                    .extend(trailers.clone());
            }
        }
        self.delivered += frame.data_ref().map_or(0, |d| d.len() as u64);
        // Trailers are the end of a response too (a gRPC client is done when they arrive).
        if frame.is_trailers()
            || (self.hint.is_some_and(|len| self.delivered >= len) && frame.is_data())
        {
            self.held.push(frame);
            return None;
        }
        Some(frame)
    }
}

/// Forwards the body's frames to the caller as they come, capturing them, until it ends; returns
/// its error if it failed.
async fn forward<B>(
    mut body: Pin<&mut B>,
    capture: &mut Capture,
    frames: &Frames,
) -> Option<BoxError>
where
    B: Body<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    loop {
        // converted within the statement: the body's own error type need not be Send; a panic
        // while producing the body counts as a failed response
        let next: Result<Option<Result<_, BoxError>>, _> = AssertUnwindSafe(body.frame())
            .catch_unwind()
            .await
            .map(|frame| frame.map(|f| f.map_err(Into::into)));
        let frame = match next {
            Ok(Some(Ok(frame))) => frame,
            Ok(None) => return None,
            Ok(Some(Err(error))) => return Some(error),
            Err(_) => return Some("the response body panicked".into()),
        };
        if let Some(frame) = capture.take(frame) {
            // a caller that went away does not stop the recording
            let _ = frames.send(Ok(frame)).await;
        }
    }
}

/// Stores the response, or releases the key when it is not to be stored; whether the caller may
/// take the response for what it is — `false` only when the store did not confirm a record.
/// The lease is kept alive (by `keeper`) until the record is confirmed or given up.
async fn record(
    settings: &Settings,
    key: String,
    token: String,
    capture: &mut Capture,
    failed: bool,
    keeper: AbortOnDrop,
) -> bool {
    match capture.record.take() {
        Some(mut stored) if !failed && grpc_succeeded(settings, &stored) => {
            stored.body = std::mem::take(&mut capture.captured).freeze();
            let confirmed = complete(settings, key, token, stored.encode()).await;
            drop(keeper);
            confirmed
        }
        _ => {
            drop(keeper);
            release(settings, key, token, "the response is not stored").await;
            true
        }
    }
}

/// Gives the caller what was held back — once the key is settled. Record first, and only then
/// let the caller see the end of the body or its error: a client that has its whole answer and
/// retries finds the key settled — a replay after success, a fresh run after a failure — never
/// still in flight. A response whose record was not confirmed is never completed: an unsent head
/// becomes `503`, a started body ends with an error.
async fn settle<B, E>(
    settings: &Settings,
    capture: Capture,
    failure: Option<BoxError>,
    unsent_head: UnsentHead<B, E>,
    frames: &Frames,
    confirmed: bool,
    grpc: bool,
) {
    if !confirmed {
        match unsent_head {
            Some((head, _)) => {
                let _ = head.send(Ok(Rejection::Unrecorded.into_response(settings, grpc)));
            }
            None => {
                let error: BoxError = UNRECORDED.into();
                let _ = frames.send(Err(error)).await;
            }
        }
        return;
    }
    if let Some((head, response)) = unsent_head {
        let _ = head.send(Ok(response));
    }
    for frame in capture.held {
        let _ = frames.send(Ok(frame)).await;
    }
    if let Some(error) = failure {
        let _ = frames.send(Err(error)).await;
    }
}

/// The error a started body ends with when its record was not confirmed.
const UNRECORDED: &str =
    "the response could not be recorded; retry with the same Idempotency-Key to learn the outcome";

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
            // a panicking predicate keeps the response out of the store, like a failure
            std::panic::catch_unwind(AssertUnwindSafe(|| (settings.store_grpc_when)(code)))
                .unwrap_or(false)
        }
    }
}

/// The headers of a response as stored for replay: all but `unstored` (`Set-Cookie` and the
/// configured sensitive ones), which would hand one caller's session to another.
fn stored_headers(headers: &http::HeaderMap, unstored: &[http::HeaderName]) -> http::HeaderMap {
    let mut kept = headers.clone();
    for name in unstored {
        kept.remove(name);
    }
    kept
}

/// Stores the encoded response, retrying (token-checked, so harmlessly) for up to a lease while
/// the store fails; whether the store confirmed it. An unconfirmed record leaves the key claimed:
/// a retry gets `409` until the lease ends — then it runs again, or replays the record if it was
/// stored after all.
async fn complete(settings: &Settings, key: String, token: String, record: Bytes) -> bool {
    let deadline = Instant::now() + settings.lease;
    let mut pause = Duration::from_millis(20);
    loop {
        let attempt = settings.store.idempotency_complete(
            key.clone(),
            token.clone(),
            record.clone(),
            settings.retention,
            Instant::now() + settings.store.timeout(),
        );
        match attempt.await {
            Ok(true) => return true,
            Ok(false) => {
                tracing::warn!(
                    target: "tollgate::idempotency",
                    "the lease of this request ran out and another request took the key over; its response was not stored"
                );
                return false;
            }
            Err(error) if Instant::now() + pause >= deadline => {
                tracing::warn!(
                    target: "tollgate::idempotency",
                    %error, "could not store a response within the lease; the caller is told so"
                );
                return false;
            }
            Err(error) => {
                tracing::debug!(target: "tollgate::idempotency", %error, "storing a response failed; retrying");
                tokio::time::sleep(pause).await;
                pause = (pause * 2).min(Duration::from_secs(1));
            }
        }
    }
}

/// Gives the key back (token-checked) so that a retry runs the handler again.
pub(super) async fn release(settings: &Settings, key: String, token: String, why: &'static str) {
    let release = settings.store.idempotency_release(key, token);
    lease::log_release(Owner::Idempotency, why, release).await;
}

/// Keeps the claim alive while the handler runs (see [`lease::keep_alive`]).
async fn keep_lease(settings: Arc<Settings>, key: String, token: String) {
    lease::keep_alive(Owner::Idempotency, settings.lease, || {
        settings.store.idempotency_extend(
            key.clone(),
            token.clone(),
            settings.lease,
            Instant::now() + settings.store.timeout(),
        )
    })
    .await;
}
