//! The [`ConcurrencyLimit`] service.

use std::borrow::Cow;
use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use http::{HeaderMap, HeaderValue, Request, Response, StatusCode, header};
use tokio::time::Instant;
use tower_service::Service;

use super::body::PermitBody;
use super::permit::{Held, Permit, StorePermit};
use super::report::{Outcome, report};
use super::settings::Settings;
use crate::body::Complete;
use crate::grpc::{Code, Wire};
use crate::key::{Global, Key, KeyExtractor};
use crate::keyspace;
use crate::lease::{self, Owner, UndoUnanswered};
use crate::policy::OnStoreError;
use crate::rate_limit::QuotaUnit;
use crate::rate_limit::headers::{RATELIMIT, RATELIMIT_POLICY};
use crate::rejection::{self, Rejection};
use crate::store::{Hold, PermitAttempt, StoreError};

/// Admits a request only while its key has a permit free; made by
/// [`ConcurrencyLimitLayer`](super::ConcurrencyLimitLayer).
///
/// The permit is taken in the response future (one round trip to the store) and held until the
/// response body ends: `poll_ready` only asks the inner service, so the service never waits for a
/// permit (it refuses instead).
pub struct ConcurrencyLimit<S, K = Global> {
    inner: S,
    settings: Arc<Settings>,
    extractor: Arc<K>,
}

impl<S, K> ConcurrencyLimit<S, K> {
    pub(crate) fn new(inner: S, settings: Arc<Settings>, extractor: Arc<K>) -> Self {
        Self {
            inner,
            settings,
            extractor,
        }
    }

    inner_service_accessors!();
}

impl<S: Clone, K> Clone for ConcurrencyLimit<S, K> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
            settings: Arc::clone(&self.settings),
            extractor: Arc::clone(&self.extractor),
        }
    }
}

impl<S: fmt::Debug, K: fmt::Debug> fmt::Debug for ConcurrencyLimit<S, K> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ConcurrencyLimit")
            .field("inner", &self.inner)
            .field("settings", &self.settings)
            .field("key", &self.extractor)
            .finish()
    }
}

/// The response future of [`ConcurrencyLimit`].
pub type ResponseFuture<B, E> =
    Pin<Box<dyn Future<Output = Result<Response<PermitBody<B>>, E>> + Send + 'static>>;

impl<S, K, ReqBody, ResBody> Service<Request<ReqBody>> for ConcurrencyLimit<S, K>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>> + Clone + Send + 'static,
    S::Future: Send + 'static,
    K: KeyExtractor,
    ReqBody: Send + 'static,
    ResBody: Send + 'static,
{
    type Response = Response<PermitBody<ResBody>>;
    type Error = S::Error;
    type Future = ResponseFuture<ResBody, S::Error>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request<ReqBody>) -> Self::Future {
        let settings = Arc::clone(&self.settings);
        let (parts, body) = request.into_parts();
        let wire = Wire::of(&parts.headers);
        let key = self.extractor.extract(&parts);
        let limit = settings.limit_for(&parts);
        let mut request = Request::from_parts(parts, body);
        // The clone goes on serving; the instance that `poll_ready` readied handles this request.
        let clone = self.inner.clone();
        let inner = std::mem::replace(&mut self.inner, clone);
        Box::pin(async move {
            let admission = match key {
                Some(key) => admit(&settings, key, limit, wire).await,
                None => match settings.missing_key.refusal() {
                    Some(refusal) => Admission::Refused(missing_key(&settings, refusal, wire)),
                    None => Admission::Unlimited,
                },
            };
            let held = match admission {
                Admission::Refused(response) => return Ok(response.map(PermitBody::from)),
                Admission::Unlimited => None,
                Admission::Admitted(held, permit) => {
                    if let Some(permit) = permit {
                        request.extensions_mut().insert(permit);
                    }
                    Some(held)
                }
            };
            // a failing or cancelled handler drops `held`: the permit goes back
            let mut response = run(inner, request).await?;
            advertise(&settings, limit, response.headers_mut(), None);
            Ok(response.map(|body| PermitBody::inner(body, held)))
        })
    }
}

async fn run<S, R>(mut inner: S, request: R) -> Result<S::Response, S::Error>
where
    S: Service<R>,
{
    inner.call(request).await
}

/// What became of a request's claim to a permit.
enum Admission {
    /// It holds a permit (the store's, with its [`Permit`], or the local fallback's).
    Admitted(Held, Option<Permit>),
    /// It goes on without a permit: no key, or the store unreachable.
    Unlimited,
    /// It is refused with this response.
    Refused(Response<Complete>),
}

/// Takes one of `key`'s `limit` permits — waiting for one in the key's queue, if so configured —
/// or says why not.
async fn admit(settings: &Settings, key: Key, limit: u32, wire: Wire) -> Admission {
    let (permits, fence_key) = keyspace::permits(&settings.prefix, &key);
    let hold = Hold::new(permits, uuid::Uuid::new_v4().to_string());
    let give_up_at = settings.queue.map(|patience| Instant::now() + patience);
    // a waiter that goes away (cancelled, or giving up) leaves the queue at once
    let mut leave = None;
    let mut pause = FIRST_PAUSE;
    loop {
        match acquire(settings, &hold, &fence_key, limit).await {
            Ok(PermitAttempt::Acquired { fence }) => {
                if let Some(mut leave) = leave.take() {
                    UndoUnanswered::disarm(&mut leave);
                }
                report(&settings.limiter, key, limit, Outcome::Acquired, "store");
                let store = Arc::clone(&settings.store);
                let (held, permit) = StorePermit::new(store, hold, settings.lease, fence);
                return Admission::Admitted(Held::Store { _permit: held }, Some(permit));
            }
            Ok(PermitAttempt::Full { next_free, .. }) => {
                let now = Instant::now();
                match give_up_at {
                    Some(at) if now + pause < at => {
                        if leave.is_none() {
                            report(&settings.limiter, key, limit, Outcome::Queued, "store");
                        }
                        leave.get_or_insert_with(|| leave_queue(settings, &hold));
                        tokio::time::sleep(jittered(pause)).await;
                        pause = (pause * 2).min(LAST_PAUSE);
                    }
                    _ => {
                        report(&settings.limiter, key, limit, Outcome::Refused, "store");
                        return Admission::Refused(full(settings, limit, next_free, wire));
                    }
                }
            }
            Err(error) => return unavailable(settings, key, limit, &error, wire),
        }
    }
}

/// The first pause of a waiter between attempts; it doubles up to [`LAST_PAUSE`].
const FIRST_PAUSE: Duration = Duration::from_millis(5);
/// The longest pause of a waiter between attempts.
const LAST_PAUSE: Duration = Duration::from_millis(100);

/// One attempt at a permit for `hold`: should it go unanswered, it may have taken one, which is
/// given back in the background, token-checked, once its deadline has passed (the store
/// refuses it from then on).
async fn acquire(
    settings: &Settings,
    hold: &Hold,
    fence_key: &str,
    limit: u32,
) -> Result<PermitAttempt, StoreError> {
    let store = &settings.store;
    let deadline = Instant::now() + store.timeout();
    let undo = {
        let (store, hold) = (Arc::clone(store), hold.clone());
        move || store.permit_release(hold.clone())
    };
    // a waiter's place outlives the pauses between its attempts and a slow answer
    let place = settings.queue.map(|_| LAST_PAUSE * 4 + store.timeout() * 2);
    let lease = settings.lease;
    let fence_key = fence_key.to_owned();
    let attempt = store.permit_acquire(hold.clone(), fence_key, limit, lease, place, deadline);
    lease::attempt_with_undo(Owner::Permit, deadline, undo, attempt).await
}

/// Gives up `hold`'s place in the queue when dropped (unless disarmed).
fn leave_queue(
    settings: &Settings,
    hold: &Hold,
) -> UndoUnanswered<impl FnMut() -> crate::store::StoreFuture<bool> + Send + 'static> {
    let (store, hold) = (Arc::clone(&settings.store), hold.clone());
    let release = move || store.permit_release(hold.clone());
    UndoUnanswered::new(
        Owner::Permit,
        "a waiter left the queue",
        Instant::now(),
        release,
    )
}

/// `pause`, less a random part of up to half of it: waiters of many copies do not try in step.
fn jittered(pause: Duration) -> Duration {
    pause.mul_f64(1.0 - crate::lock::rand_unit() / 2.0)
}

/// What the failure policy makes of a request whose permit the store could not decide.
fn unavailable(
    settings: &Settings,
    key: Key,
    limit: u32,
    error: &StoreError,
    wire: Wire,
) -> Admission {
    if settings.store_warning.ready() {
        tracing::warn!(
            target: "tollgate::concurrency",
            %error, policy = ?settings.on_store_error,
            "the concurrency-limit store failed"
        );
    }
    let limiter = &settings.limiter;
    match settings.on_store_error {
        OnStoreError::Allow => {
            report(limiter, key, limit, Outcome::Acquired, "store_unavailable");
            Admission::Unlimited
        }
        OnStoreError::Deny => {
            report(limiter, key, limit, Outcome::Refused, "store_unavailable");
            Admission::Refused(store_unavailable(wire))
        }
        OnStoreError::LocalFallback { .. } => {
            match settings
                .local
                .as_ref()
                .and_then(|local| local.acquire(key, limit))
            {
                Some(permit) => {
                    report(limiter, key, limit, Outcome::Acquired, "local_fallback");
                    Admission::Admitted(Held::Local { _permit: permit }, None)
                }
                None => {
                    report(limiter, key, limit, Outcome::Refused, "local_fallback");
                    Admission::Refused(full(settings, limit, Duration::from_secs(1), wire))
                }
            }
        }
    }
}

/// `429` (gRPC: RESOURCE_EXHAUSTED) with `Retry-After`: the configured hint, or `next_free`.
fn full(settings: &Settings, limit: u32, next_free: Duration, wire: Wire) -> Response<Complete> {
    let refused = Rejection {
        status: StatusCode::TOO_MANY_REQUESTS,
        code: Code::ResourceExhausted,
        message: Cow::Owned(format!(
            "too many requests in flight for this key: at most {limit}"
        )),
    };
    let mut response = refused.into_response(wire);
    let wait = settings.retry_after.unwrap_or(next_free);
    let headers = response.headers_mut();
    headers.insert(header::RETRY_AFTER, rejection::retry_after(wait));
    advertise(settings, limit, headers, Some(wait));
    response
}

/// With [`advertise`](super::ConcurrencyLimitLayerBuilder::advertise): the limit in
/// `RateLimit-Policy`, and on a refusal (`wait` given) `RateLimit` with nothing left.
fn advertise(settings: &Settings, limit: u32, headers: &mut HeaderMap, wait: Option<Duration>) {
    let Some(name) = settings.advertise.as_deref() else {
        return;
    };
    let unit = QuotaUnit::ConcurrentRequests.token();
    let policy = format!("\"{name}\";q={limit};qu=\"{unit}\"");
    // the name is checked when the layer is built: the values are valid header text
    if let Ok(policy) = HeaderValue::from_str(&policy) {
        headers.insert(RATELIMIT_POLICY, policy);
    }
    if let Some(wait) = wait {
        let state = format!("\"{name}\";r=0;t={}", rejection::ceil_secs(wait));
        if let Ok(state) = HeaderValue::from_str(&state) {
            headers.insert(RATELIMIT, state);
        }
    }
}

/// `503` (gRPC: UNAVAILABLE) with `Retry-After: 1`.
fn store_unavailable(wire: Wire) -> Response<Complete> {
    let refused = Rejection {
        status: StatusCode::SERVICE_UNAVAILABLE,
        code: Code::Unavailable,
        message: Cow::Borrowed("concurrency-limit store unavailable"),
    };
    let mut response = refused.into_response(wire);
    response.headers_mut().insert(
        header::RETRY_AFTER,
        rejection::retry_after(Duration::from_secs(1)),
    );
    response
}

/// The missing-key `refusal` (by default `400`, gRPC INVALID_ARGUMENT), naming where the key is
/// read from.
fn missing_key(
    settings: &Settings,
    (status, code): (StatusCode, Code),
    wire: Wire,
) -> Response<Complete> {
    let refused = Rejection {
        status,
        code,
        message: Cow::Owned(settings.missing_key_message.to_string()),
    };
    refused.into_response(wire)
}
