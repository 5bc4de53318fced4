//! The [`ConcurrencyLimit`] service.

use std::borrow::Cow;
use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use http::{Request, Response, StatusCode, header};
use tokio::time::Instant;
use tower_service::Service;

use super::body::PermitBody;
use super::layer::Settings;
use super::permit::{Held, Permit, StorePermit};
use super::{MissingKey, OnStoreError};
use crate::body::Complete;
use crate::grpc::{Code, Wire};
use crate::key::{Global, Key, KeyExtractor};
use crate::keys;
use crate::lease::{self, Owner};
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
        let mut request = Request::from_parts(parts, body);
        // The clone goes on serving; the instance that `poll_ready` readied handles this request.
        let clone = self.inner.clone();
        let inner = std::mem::replace(&mut self.inner, clone);
        Box::pin(async move {
            let admission = match key {
                Some(key) => admit(&settings, key, wire).await,
                None if settings.missing_key == MissingKey::Allow => Admission::Unlimited,
                None => Admission::Refused(missing_key(&settings, wire)),
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
            let response = run(inner, request).await?;
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

/// Takes one of `key`'s permits, or says why not.
async fn admit(settings: &Settings, key: Key, wire: Wire) -> Admission {
    let (permits, fence_key) = keys::permits(&settings.prefix, &key);
    let hold = Hold::new(permits, uuid::Uuid::new_v4().to_string());
    let store = &settings.store;
    let deadline = Instant::now() + store.timeout();
    // An attempt without an answer may have taken a permit: it is given back in the background,
    // token-checked, once its deadline has passed (the store refuses it from then on).
    let undo = {
        let (store, hold) = (Arc::clone(store), hold.clone());
        move || store.permit_release(hold.clone())
    };
    let (limit, lease) = (settings.limit, settings.lease);
    let acquire = store.permit_acquire(hold.clone(), fence_key, limit, lease, deadline);
    match lease::attempt_with_undo(Owner::Permit, deadline, undo, acquire).await {
        Ok(PermitAttempt::Acquired { fence }) => {
            crate::metrics::concurrency_decision(&settings.limiter, true, "store");
            let (held, permit) = StorePermit::new(Arc::clone(store), hold, lease, fence);
            Admission::Admitted(Held::Store { _permit: held }, Some(permit))
        }
        Ok(PermitAttempt::Full { next_free }) => {
            crate::metrics::concurrency_decision(&settings.limiter, false, "store");
            Admission::Refused(full(settings, next_free, wire))
        }
        Err(error) => unavailable(settings, key, &error, wire),
    }
}

/// What the failure policy makes of a request whose permit the store could not decide.
fn unavailable(settings: &Settings, key: Key, error: &StoreError, wire: Wire) -> Admission {
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
            crate::metrics::concurrency_decision(limiter, true, "store_unavailable");
            Admission::Unlimited
        }
        OnStoreError::Deny => {
            crate::metrics::concurrency_decision(limiter, false, "store_unavailable");
            Admission::Refused(store_unavailable(wire))
        }
        OnStoreError::LocalFallback { .. } => {
            match settings.local.as_ref().and_then(|local| local.acquire(key)) {
                Some(permit) => {
                    crate::metrics::concurrency_decision(limiter, true, "local_fallback");
                    Admission::Admitted(Held::Local { _permit: permit }, None)
                }
                None => {
                    crate::metrics::concurrency_decision(limiter, false, "local_fallback");
                    Admission::Refused(full(settings, Duration::from_secs(1), wire))
                }
            }
        }
    }
}

/// `429` (gRPC: RESOURCE_EXHAUSTED) with `Retry-After`: the configured hint, or `next_free`.
fn full(settings: &Settings, next_free: Duration, wire: Wire) -> Response<Complete> {
    let refused = Rejection {
        status: StatusCode::TOO_MANY_REQUESTS,
        code: Code::ResourceExhausted,
        message: Cow::Owned(format!(
            "too many requests in flight for this key: at most {}",
            settings.limit
        )),
    };
    let mut response = refused.into_response(wire);
    let wait = settings.retry_after.unwrap_or(next_free);
    response
        .headers_mut()
        .insert(header::RETRY_AFTER, rejection::retry_after(wait));
    response
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

/// `400` (gRPC: INVALID_ARGUMENT) naming where the key is read from.
fn missing_key(settings: &Settings, wire: Wire) -> Response<Complete> {
    let refused = Rejection {
        status: StatusCode::BAD_REQUEST,
        code: Code::InvalidArgument,
        message: Cow::Owned(settings.missing_key_message.to_string()),
    };
    refused.into_response(wire)
}
