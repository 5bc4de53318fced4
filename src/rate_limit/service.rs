//! The [`RateLimit`] service.

use std::sync::Arc;
use std::task::{Context, Poll};

use http::{Request, Response};
use tower_service::Service;

use super::body::ResponseBody;
use super::future::ResponseFuture;
use super::rejection::Rejection;
use super::settings::Settings;
use crate::grpc::Wire;
use crate::key::KeyExtractor;
use crate::rate_client::{ArrivedAt, Decided};

layer_service! {
    /// Admits a request only while every limit has room for the caller; made by
    /// [`RateLimitLayer`](super::RateLimitLayer).
    ///
    /// The layer's rate client decides: at once, from what this copy keeps (a leased slice, a
    /// cached denial), or in one round trip to the store made in the response future.
    /// `poll_ready` only asks the inner service, so the service never waits for capacity (it
    /// rejects instead — or, with a [queue](super::RateLimitLayerBuilder::queue), the request
    /// waits for room in its future, and a clone of the inner service is readied for it only
    /// once it is admitted) and is cheap to clone.
    RateLimit { key }
}

impl<S, K, ReqBody, ResBody> Service<Request<ReqBody>> for RateLimit<S, K>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>> + Clone,
    K: KeyExtractor,
{
    type Response = Response<ResponseBody<ResBody>>;
    type Error = S::Error;
    type Future = ResponseFuture<S, ReqBody>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request<ReqBody>) -> Self::Future {
        let settings = Arc::clone(&self.settings);
        let (parts, body) = request.into_parts();
        let wire = Wire::of(&parts.headers);
        let key = self.key.extract(&parts);
        let cost = settings.cost_of(&parts);
        let tier = settings.client.tiers().for_request(&parts, key);
        // an outbound limit counts a call's patience from before a provider's pause
        let arrived = parts.extensions.get::<ArrivedAt>().map(|at| at.0);
        let request = Request::from_parts(parts, body);

        let Some(key) = key else {
            return self.without_key(request, settings, wire);
        };
        if cost == 0 {
            return ResponseFuture::unchecked(self.inner.call(request), settings);
        }
        let decided = settings
            .client
            .decide(&tier, settings.check(key, cost), arrived);
        self.decided(decided, request, settings, wire)
    }
}

impl<S, K> RateLimit<S, K> {
    /// The future of a request the rate client decided: at once, or once the store answers.
    fn decided<ReqBody>(
        &mut self,
        decided: Decided,
        request: Request<ReqBody>,
        settings: Arc<Settings>,
        wire: Wire,
    ) -> ResponseFuture<S, ReqBody>
    where
        S: Service<Request<ReqBody>> + Clone,
    {
        match decided {
            Decided::Now(verdict) => {
                ResponseFuture::decided(verdict, &mut self.inner, request, settings, wire)
            }
            Decided::Pending(pending) if settings.client.queue.is_some() => {
                // The request may wait long for room: the instance `poll_ready` readied (which
                // may hold a slot of a buffer or a pool) stays here, for the next request, and
                // a clone is readied for this one once it is admitted.
                let clone = (self.inner.clone(), false);
                ResponseFuture::check(pending, clone, request, settings, wire)
            }
            Decided::Pending(pending) => {
                // The clone goes on serving; the instance `poll_ready` readied handles this one.
                let clone = self.inner.clone();
                let ready = std::mem::replace(&mut self.inner, clone);
                ResponseFuture::check(pending, (ready, true), request, settings, wire)
            }
        }
    }

    /// A request without a key: refused as the layer's [`MissingKey`](crate::key::MissingKey)
    /// says (let through in shadow mode), or let through unlimited.
    fn without_key<ReqBody>(
        &mut self,
        request: Request<ReqBody>,
        settings: Arc<Settings>,
        wire: Wire,
    ) -> ResponseFuture<S, ReqBody>
    where
        S: Service<Request<ReqBody>>,
    {
        match settings.missing_key.refusal() {
            Some(_) if !settings.shadow => {
                ResponseFuture::reject(Rejection::MissingKey, settings, wire)
            }
            _ => ResponseFuture::unchecked(self.inner.call(request), settings),
        }
    }
}
