//! The [`OutboundLimit`] service and its [`ResponseFuture`].

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use http::{Request, Response};
use tokio::time::Instant;
use tower_service::Service;

use super::correct::Corrections;
use super::error::{Limited, OutboundError};
use super::pause::PauseBook;
use crate::key::{Key, KeyExtractor};
use crate::rate_client::{ArrivedAt, DecisionSource, RateClient};
use crate::rate_limit::{RateLimit, RateLimitDecision, Refused, ResponseBody};

/// What every clone of a layer and of its services shares.
#[derive(Debug)]
pub(crate) struct Shared {
    /// How long a call may wait for room, and for a pause to end.
    pub(crate) patience: Duration,
    /// The provider's pauses.
    pub(crate) book: Arc<PauseBook>,
    /// The rate limit's client: where the provider's counts correct the shared count.
    pub(crate) client: Arc<RateClient>,
    /// The corrections being made on this copy.
    pub(crate) corrections: Arc<Corrections>,
}

impl Shared {
    /// The provider answered a call of `key` (admitted by `decision`, when the store decided)
    /// with `status` and `headers`: its pauses, and its remaining count followed.
    pub(crate) async fn heard(
        &self,
        key: Key,
        decision: Option<&RateLimitDecision>,
        status: http::StatusCode,
        headers: &http::HeaderMap,
    ) {
        let remaining = self.book.heard(key, status, headers).await;
        if let (Some(remaining), Some(decision)) = (remaining, decision) {
            let across = self.book.shared.get().cloned();
            self.corrections
                .follow(&self.client, across, decision, remaining);
        }
    }
}

/// Makes a client's calls only while the limits have room, waiting for it; made by
/// [`OutboundLimitLayer`](super::OutboundLimitLayer).
pub struct OutboundLimit<S, K> {
    rate: RateLimit<S, K>,
    key: Arc<K>,
    shared: Arc<Shared>,
}

impl<S, K> OutboundLimit<S, K> {
    pub(crate) fn new(rate: RateLimit<S, K>, key: Arc<K>, shared: Arc<Shared>) -> Self {
        Self { rate, key, shared }
    }

    /// The client.
    pub fn get_ref(&self) -> &S {
        self.rate.get_ref()
    }
}

impl<S: Clone, K> Clone for OutboundLimit<S, K> {
    fn clone(&self) -> Self {
        Self {
            rate: self.rate.clone(),
            key: Arc::clone(&self.key),
            shared: Arc::clone(&self.shared),
        }
    }
}

impl<S: fmt::Debug, K: fmt::Debug> fmt::Debug for OutboundLimit<S, K> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("OutboundLimit")
            .field("rate", &self.rate)
            .field("shared", &self.shared)
            .finish()
    }
}

/// What an [`OutboundLimit`] call ends in.
type Answer<B, E> = Result<Response<ResponseBody<B>>, OutboundError<E>>;

/// The response future of [`OutboundLimit`]: the wait for room, then the call.
pub struct ResponseFuture<B, E> {
    inner: Pin<Box<dyn Future<Output = Answer<B, E>> + Send>>,
}

impl<B, E> Future for ResponseFuture<B, E> {
    type Output = Result<Response<ResponseBody<B>>, OutboundError<E>>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        self.inner.as_mut().poll(cx)
    }
}

impl<B, E> fmt::Debug for ResponseFuture<B, E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ResponseFuture").finish_non_exhaustive()
    }
}

impl<S, K, ReqBody, ResBody> Service<Request<ReqBody>> for OutboundLimit<S, K>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>> + Clone + Send + 'static,
    S::Future: Send,
    S::Error: Send,
    K: KeyExtractor,
    ReqBody: Send + 'static,
    ResBody: Send + 'static,
{
    type Response = Response<ResponseBody<ResBody>>;
    type Error = OutboundError<S::Error>;
    type Future = ResponseFuture<ResBody, S::Error>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.rate.poll_ready(cx).map_err(OutboundError::Inner)
    }

    fn call(&mut self, request: Request<ReqBody>) -> Self::Future {
        // the clone goes on serving; the instance `poll_ready` readied makes this call
        let clone = self.rate.clone();
        let mut ready = std::mem::replace(&mut self.rate, clone);
        let (mut parts, body) = request.into_parts();
        let key = self.key.extract(&parts);
        // the call's patience counts from now, the provider's pause included
        parts.extensions.insert(ArrivedAt(Instant::now()));
        let request = Request::from_parts(parts, body);
        let shared = Arc::clone(&self.shared);
        let inner = Box::pin(async move {
            let paused = match key {
                Some(key) => shared.book.paused_until(key).await,
                None => None,
            };
            if let Some(until) = paused {
                let wait = until.saturating_duration_since(Instant::now());
                if wait > shared.patience {
                    let limited = Limited {
                        retry_after: wait,
                        waited: Duration::ZERO,
                    };
                    return Err(OutboundError::Limited(limited));
                }
                tokio::time::sleep_until(until).await;
            }
            let response = ready.call(request).await.map_err(OutboundError::Inner)?;
            if let Some(refused) = response.extensions().get::<Refused>() {
                return Err(refusal(*refused, response.extensions().get()));
            }
            if let Some(key) = key {
                let decision = response.extensions().get::<RateLimitDecision>();
                shared
                    .heard(key, decision, response.status(), response.headers())
                    .await;
            }
            Ok(response)
        });
        ResponseFuture { inner }
    }
}

/// The error of a call the rate limit refused, as its `decision` says.
pub(super) fn refusal<E>(
    refused: Refused,
    decision: Option<&RateLimitDecision>,
) -> OutboundError<E> {
    match (refused, decision) {
        (Refused::MissingKey, _) => OutboundError::MissingKey,
        // a denial always carries its decision
        (Refused::Denied, None) => OutboundError::StoreUnavailable,
        (Refused::Denied, Some(d)) if d.source() == DecisionSource::StoreUnavailable => {
            OutboundError::StoreUnavailable
        }
        (Refused::Denied, Some(d)) => OutboundError::Limited(Limited {
            retry_after: d.retry_after(),
            waited: d.waited(),
        }),
    }
}
