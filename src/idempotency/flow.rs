//! The flow of one keyed request: buffer and fingerprint it, claim its key, replay or refuse, or
//! hand it to its execution (`execute`) and await the head of its response.

use std::sync::Arc;
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use http::request::Parts;
use http::{HeaderValue, Request, Response};
use http_body::Body;
use http_body_util::{BodyExt, Either, Full, LengthLimitError, Limited};
use tokio::sync::oneshot;
use tokio::time::Instant;

use super::body::IdempotencyBody;
use super::budget::Share;
use super::execute::{Answer, Claimed, execute};
use super::fingerprint::fingerprint;
use super::handler::{Handler, HttpBody, RequestBody};
use super::rejection::Rejection;
use super::report::report;
use super::settings::{OnConcurrent, Settings};
use crate::body::Complete;
use crate::error::BoxError;
use crate::grpc::Wire;
use crate::keepalive::{self, Owner};
use crate::key::Key;
use crate::store::BeginRequest;
use crate::store::StoredResponse;
use crate::store::{Hold, IdempotencyBegin, RunBegun, RunStart, StoreError};

/// One keyed request: buffer and fingerprint it, then claim, replay or refuse.
pub(super) async fn handle<S, ReqBody, ResBody>(
    settings: Arc<Settings>,
    service: S,
    parts: Parts,
    body: ReqBody,
    (key, caller): (String, Option<Key>),
    wire: Wire,
) -> Answer<ResBody, S::Error>
where
    S: Handler<ReqBody, ResBody>,
    ReqBody: HttpBody,
    ResBody: HttpBody,
{
    let share = settings.buffered.share(caller);
    let reading = buffer_body(body, settings.body_limit, share);
    let (body, buffered) = match tokio::time::timeout(settings.body_timeout, reading).await {
        Ok(Ok(buffered)) => buffered,
        Ok(Err(rejection)) => return Ok(settings.reject(rejection, wire)),
        // the share of the budget went with the read
        Err(_) => return Ok(settings.reject(Rejection::BodyTimeout, wire)),
    };
    let fingerprint = fingerprint(&parts, &settings.fingerprint_headers, &body);
    let claimed = match claim(&settings, &key, &fingerprint, wire).await {
        Ok(claimed) => claimed,
        Err(refused) => return Ok(refused),
    };
    report("executed", None);
    // the handler finds its transaction in the request's extensions
    let mut parts = parts;
    if let Claimed::Transaction(running) = &claimed {
        running.lend(&mut parts.extensions);
    }
    let request = Request::from_parts(parts, Either::Left(Full::new(body)));
    // the body's share of the buffer budget goes with it, until its execution ends
    spawn_execution(settings, service, request, claimed, wire, buffered).await
}

/// The whole request body, if it is readable and within `limit`, and its `share` of the layer's
/// budget of buffered bytes: when its caller's bodies would pass the caller's share, or the
/// bodies of all callers the budget (and no room comes back in time), the request is refused
/// (`503`) rather than held in memory.
async fn buffer_body<B>(
    body: B,
    limit: usize,
    mut share: Share,
) -> Result<(Bytes, Share), Rejection>
where
    B: Body<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    let mut body = std::pin::pin!(Limited::new(body, limit));
    let mut buffered = BytesMut::new();
    while let Some(frame) = body.frame().await {
        let frame = match frame {
            Ok(frame) => frame,
            Err(error) if error.downcast_ref::<LengthLimitError>().is_some() => {
                return Err(Rejection::TooLarge);
            }
            Err(_) => return Err(Rejection::UnreadableBody),
        };
        let Ok(data) = frame.into_data() else {
            continue; // request trailers are not part of the fingerprint
        };
        share.grow(data.len()).await.map_err(|_| Rejection::Busy)?;
        buffered.extend_from_slice(&data);
    }
    Ok((buffered.freeze(), share))
}

/// What one attempt to claim a key found.
enum Found<T> {
    /// The key is this request's.
    Claimed(T),
    /// A request with the key completed: its record.
    Completed(Bytes),
    Mismatch,
    InFlight,
}

/// Claims the key for this request — a lease in the store, or a transaction that holds the
/// key's lock — waiting while another holds it, if so configured; the error is the answer
/// instead: a mismatch, a replay, a conflict or an unavailable store.
async fn claim<B>(
    settings: &Arc<Settings>,
    key: &str,
    fingerprint: &str,
    wire: Wire,
) -> Result<Claimed, Response<IdempotencyBody<B>>> {
    if let Some(store) = &settings.transaction {
        return claim_with(settings, wire, || async {
            let start = RunStart::new(key, fingerprint, settings.retention, settings.lease);
            Ok(match store.begin_run(start).await? {
                RunBegun::Running(running) => Found::Claimed(Claimed::Transaction(running)),
                RunBegun::Recorded(record) => Found::Completed(record),
                RunBegun::Mismatch => Found::Mismatch,
                RunBegun::InFlight => Found::InFlight,
            })
        })
        .await;
    }
    let token = uuid::Uuid::new_v4().to_string();
    claim_with(settings, wire, || async {
        // While a claim attempt is unanswered — it timed out, or the caller went away mid-call —
        // the store may have made it: the guard then releases it once the attempt's deadline has
        // passed (token-checked, so harmlessly if it was not made) instead of leaving the key
        // blocked for a whole lease.
        let deadline = Instant::now() + settings.store.timeout();
        let undo = {
            let (settings, key, token) = (Arc::clone(settings), key.to_owned(), token.clone());
            move || {
                let store = &settings.store;
                store.idempotency_release(Hold::new(key.clone(), token.clone()))
            }
        };
        let hold = Hold::new(key.to_owned(), token.clone());
        let begin = settings.store.idempotency_begin(
            BeginRequest::new(hold, fingerprint.to_owned(), settings.lease),
            deadline,
        );
        let begun = keepalive::attempt_with_undo(Owner::Idempotency, deadline, undo, begin).await?;
        Ok(match begun {
            IdempotencyBegin::Claimed => Found::Claimed(Claimed::Lease {
                key: key.to_owned(),
                token: token.clone(),
            }),
            IdempotencyBegin::Completed(record) => Found::Completed(record),
            IdempotencyBegin::Mismatch => Found::Mismatch,
            IdempotencyBegin::InFlight { .. } => Found::InFlight,
        })
    })
    .await
}

/// Repeats `attempt` while another request holds the key and the layer waits for it.
async fn claim_with<T, B, F>(
    settings: &Settings,
    wire: Wire,
    mut attempt: impl FnMut() -> F,
) -> Result<T, Response<IdempotencyBody<B>>>
where
    F: Future<Output = Result<Found<T>, StoreError>>,
{
    let wait_until = wait_deadline(settings.on_concurrent);
    let mut pause = Duration::from_millis(10);
    loop {
        match attempt().await {
            // the claim is ours: the execution task owns it from here
            Ok(Found::Claimed(claimed)) => return Ok(claimed),
            Ok(Found::Mismatch) => return Err(settings.reject(Rejection::Mismatch, wire)),
            Ok(Found::Completed(record)) => {
                report("replayed", None);
                return Err(replay(settings, &record, wire));
            }
            Ok(Found::InFlight) => match wait_until {
                Some(until) if Instant::now() < until => {
                    tokio::time::sleep(pause.min(until - Instant::now())).await;
                    pause = (pause * 2).min(Duration::from_millis(200));
                }
                _ => return Err(settings.reject(Rejection::InFlight, wire)),
            },
            Err(error) => {
                tracing::warn!(target: "tollgate::idempotency", %error, "idempotency store failed; refusing the request");
                return Err(settings.reject(Rejection::StoreUnavailable, wire));
            }
        }
    }
}

/// Until when a request waits for another one holding its key, if it waits at all.
fn wait_deadline(on_concurrent: OnConcurrent) -> Option<Instant> {
    match on_concurrent {
        // a wait too long to add to the clock is as good as waiting for ever: cap at a day
        OnConcurrent::Wait(wait) => {
            Instant::now().checked_add(wait.min(Duration::from_secs(86_400)))
        }
        OnConcurrent::Reject => None,
    }
}

/// Runs the claimed request in a task of its own and awaits the head of its response.
async fn spawn_execution<S, ReqBody, ResBody>(
    settings: Arc<Settings>,
    service: S,
    request: Request<RequestBody<ReqBody>>,
    claimed: Claimed,
    wire: Wire,
    buffered: Share,
) -> Answer<ResBody, S::Error>
where
    S: Handler<ReqBody, ResBody>,
    ReqBody: HttpBody,
    ResBody: HttpBody,
{
    let (head_tx, head_rx) = oneshot::channel();
    // Spawned: the handler runs to completion and its response is recorded even when the client
    // goes away, so that the client's retry gets the replay instead of a second execution.
    // in the caller's span: a `TraceLayer` span's fields stay on the handler's events
    let task_settings = Arc::clone(&settings);
    let execution = async move {
        execute(task_settings, service, request, claimed, wire, head_tx).await;
        // the body's share of the buffer budget is given back once its execution ends
        drop(buffered);
    };
    tokio::spawn(tracing::Instrument::instrument(
        execution,
        tracing::Span::current(),
    ));
    match head_rx.await {
        Ok(answer) => answer,
        // the task ended without a response: the handler panicked (the key was released)
        Err(_) => Ok(settings.reject(Rejection::HandlerFailed, wire)),
    }
}

/// In the extensions of a response the idempotency layer replayed from its record: the handler
/// did not run for it, and nothing it did was done again. Layers outside read it — a rate limit
/// that settles a request's cost charges a replay nothing of what the first run used (see
/// [`RateLimitLayerBuilder::settle`](crate::rate_limit::RateLimitLayerBuilder::settle)).
///
/// ```
/// # #[tokio::main(flavor = "current_thread")] async fn main() {
/// use std::convert::Infallible;
/// use http::{Request, Response};
/// use http_body_util::Full;
/// use tower::{ServiceBuilder, ServiceExt};
/// use tollgate::idempotency::{IdempotencyLayer, Replayed};
/// use tollgate::store::MemoryStore;
///
/// let service = ServiceBuilder::new()
///     .layer(IdempotencyLayer::builder(MemoryStore::new()).unscoped().build().unwrap())
///     .service_fn(|_: Request<_>| async {
///         Ok::<_, Infallible>(Response::new(Full::new("paid".into())))
///     });
/// let pay = || Request::post("/payments").header("idempotency-key", "order-1").body(Full::new("{}".into())).unwrap();
/// let first = service.clone().oneshot(pay()).await.unwrap();
/// assert!(first.extensions().get::<Replayed>().is_none());
/// let again = service.oneshot(pay()).await.unwrap();
/// assert_eq!(again.extensions().get::<Replayed>(), Some(&Replayed));
/// # }
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Replayed;

/// A completed response, replayed byte for byte plus `Idempotent-Replayed: true` (and
/// [`Replayed`] in its extensions).
fn replay<B>(settings: &Settings, record: &[u8], wire: Wire) -> Response<IdempotencyBody<B>> {
    let Some(stored) = StoredResponse::decode(record) else {
        tracing::error!(target: "tollgate::idempotency", "a stored response could not be decoded");
        return settings.reject(Rejection::StoreUnavailable, wire);
    };
    let body = Complete::new(stored.body, stored.trailers);
    let mut response = Response::new(IdempotencyBody::from(body));
    *response.status_mut() = stored.status;
    *response.headers_mut() = stored.headers;
    response
        .headers_mut()
        .insert("idempotent-replayed", HeaderValue::from_static("true"));
    response.extensions_mut().insert(Replayed);
    response
}
