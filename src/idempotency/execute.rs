//! The spawned execution of a claimed request: run the handler, then either record its response
//! and only then hand it to the caller, or stream it and release the key.

use std::panic::AssertUnwindSafe;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use futures_util::FutureExt;
use http::{HeaderMap, Request, Response, response};
use http_body::{Body, Frame};
use http_body_util::BodyExt;
use tokio::sync::{mpsc, oneshot};
use tokio::time::Instant;
use tower_service::Service;

use super::body::IdempotencyBody;
use super::handler::{Handler, HttpBody, RequestBody};
use super::rejection::Rejection;
use super::settings::Settings;
use crate::error::BoxError;
use crate::grpc::Wire;
use crate::keepalive::{self, Owner};
use crate::store::CompleteRequest;
use crate::store::Hold;
use crate::store::Run;
use crate::store::StoredResponse;
use crate::task::AbortOnDrop;

/// What the caller of a keyed request gets: a response, or the handler's error.
pub(super) type Answer<B, E> = Result<Response<IdempotencyBody<B>>, E>;

/// The frames of the caller's body.
type Frames = mpsc::Sender<Result<Frame<Bytes>, BoxError>>;

/// Runs the handler; a response to be stored is recorded before any of it reaches the caller,
/// any other streams to the caller and releases the key.
pub(super) async fn execute<S, ReqBody, ResBody>(
    settings: Arc<Settings>,
    mut service: S,
    request: Request<RequestBody<ReqBody>>,
    claimed: Claimed,
    wire: Wire,
    answer: oneshot::Sender<Answer<ResBody, S::Error>>,
) where
    S: Handler<ReqBody, ResBody>,
    ResBody: HttpBody,
{
    let claim = Claim::new(Arc::clone(&settings), claimed);
    if let Err(error) = std::future::poll_fn(|cx| service.poll_ready(cx)).await {
        claim.release("the service was not ready").await;
        let _ = answer.send(Err(error));
        return;
    }
    let response = match call_handler(&mut service, request).await {
        Ok(Ok(response)) => response,
        Ok(Err(error)) => {
            claim.release("the handler returned an error").await;
            let _ = answer.send(Err(error));
            return;
        }
        Err(_) => {
            claim.release("the handler panicked").await;
            return; // dropping `answer` tells the caller
        }
    };
    let (parts, body) = response.into_parts();
    deliver(&settings, claim, parts, body, answer, wire).await;
}

/// Records the response and then answers the caller, or streams it and releases the key — by
/// its status.
async fn deliver<B, E>(
    settings: &Settings,
    claim: Claim,
    parts: response::Parts,
    body: B,
    answer: oneshot::Sender<Answer<B, E>>,
    wire: Wire,
) where
    B: HttpBody,
{
    let Ok(record) = record_of(settings, &parts) else {
        claim.release("store_when panicked").await;
        let _ = answer.send(Ok(settings.reject(Rejection::HandlerFailed, wire)));
        return;
    };
    let exact_len = body.size_hint().exact();
    let all_head = body.is_end_stream() || exact_len == Some(0);
    let (frames_tx, frames_rx) = mpsc::channel(8);
    let response = Response::from_parts(parts, IdempotencyBody::channel(frames_rx, exact_len));
    let head = Head { answer, response };
    let body = std::pin::pin!(body);
    match record {
        Some(record) => record_then_answer(claim, record, body, head, &frames_tx, wire).await,
        None => {
            // a response that is all head is settled before the head goes out, like the last
            // frame of any other
            let head = if all_head {
                Some(head)
            } else {
                head.send();
                None
            };
            let end = Unsettled { claim, exact_len };
            stream(body, head, &frames_tx, Some(end)).await;
        }
    }
}

/// The record to make of a response with head `parts`, if its status is one to store; `Err` when
/// `store_when` panicked.
fn record_of(
    settings: &Settings,
    parts: &response::Parts,
) -> std::thread::Result<Option<StoredResponse>> {
    let store_when = AssertUnwindSafe(|| (settings.store_when)(parts.status));
    let stored = std::panic::catch_unwind(store_when)?;
    Ok(stored.then(|| StoredResponse {
        status: parts.status,
        headers: stored_headers(&parts.headers, &settings.unstored_headers),
        body: Bytes::new(),
        trailers: None,
    }))
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

/// How a request holds its key while it runs.
pub(super) enum Claimed {
    /// A claim in the store with a lease, checked by its token.
    Lease { key: String, token: String },
    /// An open transaction that holds the key's advisory lock, and in which the handler runs.
    Transaction(Box<dyn Run>),
}

/// The claim on the key until it is settled — by storing the response or by releasing the key —
/// with the task that keeps its lease alive meanwhile.
struct Claim {
    settings: Arc<Settings>,
    claimed: Claimed,
    _keeper: Option<AbortOnDrop>,
}

impl Claim {
    fn new(settings: Arc<Settings>, claimed: Claimed) -> Self {
        let keeper = match &claimed {
            Claimed::Lease { key, token } => Some(AbortOnDrop(tokio::spawn(keep_lease(
                Arc::clone(&settings),
                key.clone(),
                token.clone(),
            )))),
            Claimed::Transaction(_) => None,
        };
        Self {
            settings,
            claimed,
            _keeper: keeper,
        }
    }

    /// Stores the encoded response (see [`complete`]); whether the store confirmed it.
    async fn complete(self, record: Bytes) -> bool {
        match self.claimed {
            Claimed::Lease { key, token } => complete(&self.settings, key, token, record).await,
            Claimed::Transaction(running) => match running.commit(record).await {
                Ok(()) => true,
                Err(error) => {
                    tracing::warn!(target: "tollgate::idempotency", ?error, "the handler's transaction did not commit; the caller is told so");
                    false
                }
            },
        }
    }

    /// Gives the key back, so that a retry runs the handler again (in a transaction: rolls the
    /// handler's writes back).
    async fn release(self, why: &'static str) {
        match self.claimed {
            Claimed::Lease { key, token } => release(&self.settings, key, token, why).await,
            Claimed::Transaction(running) => {
                tracing::debug!(target: "tollgate::idempotency", why, "rolling the handler's transaction back");
                running.roll_back().await;
            }
        }
    }

    /// Whether giving the key back undoes what the handler did, so that its response must not
    /// reach the caller as a success.
    fn release_undoes(&self) -> bool {
        !matches!(self.claimed, Claimed::Lease { .. })
    }
}

/// The head of the caller's response, held until the caller may have it; its body is what is
/// sent down the [`Frames`] channel.
struct Head<B, E> {
    answer: oneshot::Sender<Answer<B, E>>,
    response: Response<IdempotencyBody<B>>,
}

impl<B, E> Head<B, E> {
    fn send(self) {
        let _ = self.answer.send(Ok(self.response));
    }

    /// Answers `Unrecorded` instead: the caller never sees the handler's head.
    fn refuse(self, settings: &Settings, wire: Wire) {
        let refusal = settings.reject(Rejection::Unrecorded, wire);
        let _ = self.answer.send(Ok(refusal));
    }
}

/// How the capture of a response for its record ended.
enum Captured {
    /// The body ended: the record holds all of it.
    Whole,
    Failed(BoxError),
    /// This data frame would have taken the record over the cap; it is not in the record.
    TooLarge(Bytes),
}

/// Captures the whole response into `record` and sends the caller nothing meanwhile; once the
/// body ends, stores the record and only then hands the response to the caller — or
/// `Unrecorded` in its place when the store did not confirm it, so that no caller takes an
/// unrecorded response for a success. A response that fails, or turns out not to be stored
/// (over the cap, a gRPC failure), releases the key first and then goes to the caller as it came.
async fn record_then_answer<B, RB, E>(
    claim: Claim,
    mut record: StoredResponse,
    mut body: Pin<&mut B>,
    head: Head<RB, E>,
    frames: &Frames,
    wire: Wire,
) where
    B: Body<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    let settings = Arc::clone(&claim.settings);
    let mut data = BytesMut::new();
    match capture(
        body.as_mut(),
        &mut record,
        &mut data,
        settings.response_limit,
    )
    .await
    {
        Captured::Whole => {}
        // in a transaction, a response that is not recorded is rolled back: it must not go out
        _ if claim.release_undoes() => {
            claim.release("the response could not be recorded").await;
            head.refuse(&settings, wire);
            return;
        }
        Captured::Failed(error) => {
            claim.release("the response body failed").await;
            head.send();
            send_captured(frames, data.freeze(), record.trailers).await;
            let _ = frames.send(Err(error)).await;
            return;
        }
        Captured::TooLarge(next) => {
            claim.release("the response is too large to store").await;
            head.send();
            send_captured(frames, data.freeze(), record.trailers).await;
            let _ = frames.send(Ok(Frame::data(next))).await;
            stream::<B, RB, E>(body, None, frames, None).await;
            return;
        }
    }
    record.body = data.freeze();
    if !grpc_succeeded(&settings, &record) {
        claim.release("the response is not stored").await;
    } else if !claim.complete(record.encode()).await {
        head.refuse(&settings, wire);
        return;
    }
    head.send();
    send_captured(frames, record.body, record.trailers).await;
}

/// Reads the body to its end into `record` — its data into `data`, up to `limit` bytes — unless
/// it fails or would pass the limit first.
async fn capture<B>(
    mut body: Pin<&mut B>,
    record: &mut StoredResponse,
    data: &mut BytesMut,
    limit: usize,
) -> Captured
where
    B: Body<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    loop {
        let frame = match next_frame(body.as_mut()).await {
            Ok(Some(frame)) => frame,
            Ok(None) => return Captured::Whole,
            Err(error) => return Captured::Failed(error),
        };
        match frame.into_data() {
            Ok(chunk) if data.len() + chunk.len() > limit => return Captured::TooLarge(chunk),
            Ok(chunk) => data.extend_from_slice(&chunk),
            Err(frame) => {
                if let Ok(trailers) = frame.into_trailers() {
                    record
                        .trailers
                        .get_or_insert_with(HeaderMap::new)
                        .extend(trailers);
                }
            }
        }
    }
}

/// Sends the caller a captured body: its data as one frame, then its trailers.
async fn send_captured(frames: &Frames, data: Bytes, trailers: Option<HeaderMap>) {
    if !data.is_empty() {
        let _ = frames.send(Ok(Frame::data(data))).await;
    }
    if let Some(trailers) = trailers {
        let _ = frames.send(Ok(Frame::trailers(trailers))).await;
    }
}

/// The claim of a response that streams while its key is still claimed, and the length its body
/// declared, if any.
struct Unsettled {
    claim: Claim,
    exact_len: Option<u64>,
}

/// Streams the rest of the body to the caller as it comes (a caller that went away does not stop
/// it), sending the head first if it is still held. With `unsettled`, the key is released once
/// the body ends, and the caller's end of body waits for that: a client that has its whole answer
/// and retries finds the key released — it runs again, never gets `409`. That end is the frame
/// that completes the declared length, or trailers (a gRPC client is done when they arrive), so
/// frames from there on are held until the release, and the head too if it is all there is.
async fn stream<B, RB, E>(
    mut body: Pin<&mut B>,
    mut head: Option<Head<RB, E>>,
    frames: &Frames,
    unsettled: Option<Unsettled>,
) where
    B: Body<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    let mut left = unsettled.as_ref().and_then(|u| u.exact_len);
    let mut held = Vec::new();
    let failure = loop {
        let frame = match next_frame(body.as_mut()).await {
            Ok(Some(frame)) => frame,
            Ok(None) => break None,
            Err(error) => break Some(error),
        };
        if let (Some(left), Some(data)) = (left.as_mut(), frame.data_ref()) {
            *left = left.saturating_sub(data.len() as u64);
        }
        let ends = frame.is_trailers() || (frame.is_data() && left == Some(0));
        if unsettled.is_some() && (ends || !held.is_empty()) {
            held.push(frame);
        } else {
            if let Some(head) = head.take() {
                head.send();
            }
            let _ = frames.send(Ok(frame)).await;
        }
    };
    if let Some(Unsettled { claim, .. }) = unsettled {
        let why = match failure {
            Some(_) => "the response body failed",
            None => "the response is not stored",
        };
        claim.release(why).await;
    }
    if let Some(head) = head {
        head.send();
    }
    for frame in held {
        let _ = frames.send(Ok(frame)).await;
    }
    if let Some(error) = failure {
        let _ = frames.send(Err(error)).await;
    }
}

/// The body's next frame; a panic while producing it counts as a failed body.
async fn next_frame<B>(mut body: Pin<&mut B>) -> Result<Option<Frame<Bytes>>, BoxError>
where
    B: Body<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    match AssertUnwindSafe(body.frame()).catch_unwind().await {
        Ok(Some(Ok(frame))) => Ok(Some(frame)),
        Ok(None) => Ok(None),
        Ok(Some(Err(error))) => Err(error.into()),
        Err(_) => Err("the response body panicked".into()),
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
            CompleteRequest::new(
                Hold::new(key.clone(), token.clone()),
                record.clone(),
                settings.retention,
            ),
            Instant::now() + settings.store.timeout(),
        );
        match attempt.await {
            Ok(true) => return true,
            Ok(false) => {
                tracing::warn!(
                    target: "tollgate::idempotency",
                    "the store lost this request's claim (its lease ran out, or the store lost the record); its response was not stored and the caller is told so"
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
async fn release(settings: &Settings, key: String, token: String, why: &'static str) {
    let release = settings.store.idempotency_release(Hold::new(key, token));
    keepalive::log_release(Owner::Idempotency, why, release).await;
}

/// Keeps the claim alive while the handler runs (see [`keepalive::keep_alive`]).
async fn keep_lease(settings: Arc<Settings>, key: String, token: String) {
    keepalive::keep_alive(Owner::Idempotency, settings.lease, || {
        settings.store.idempotency_extend(
            Hold::new(key.clone(), token.clone()),
            settings.lease,
            Instant::now() + settings.store.timeout(),
        )
    })
    .await;
}
