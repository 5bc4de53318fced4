//! The [`ConcurrencyLimit`] service.

use std::sync::Arc;
use std::task::{Context, Poll};

use http::{Request, Response};
use tower_service::Service;

use super::body::PermitBody;
use super::future::ResponseFuture;
use super::rejection::missing_key;
use super::settings::Settings;
use crate::grpc::Wire;
use crate::key::KeyExtractor;

layer_service! {
    /// Admits a request only while its key has a permit free; made by
    /// [`ConcurrencyLimitLayer`](super::ConcurrencyLimitLayer).
    ///
    /// The permit is taken in the response future (one round trip to the store) and held until the
    /// response body ends: `poll_ready` only asks the inner service, so the service never waits for a
    /// permit (it refuses instead).
    ConcurrencyLimit { key }
}

impl<S, K, ReqBody, ResBody> Service<Request<ReqBody>> for ConcurrencyLimit<S, K>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>> + Clone,
    K: KeyExtractor,
{
    type Response = Response<PermitBody<ResBody>>;
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
        let limit = settings.limit_for(&parts, key.as_ref());
        let request = Request::from_parts(parts, body);
        let Some(key) = key else {
            return match settings.missing_key.refusal() {
                Some(refusal) => {
                    let refused = missing_key(&settings, refusal, wire);
                    ResponseFuture::refused(refused, settings, limit)
                }
                None => ResponseFuture::unlimited(self.inner.call(request), settings, limit),
            };
        };
        // The clone goes on serving; the instance that `poll_ready` readied handles this request.
        let clone = self.inner.clone();
        let ready = std::mem::replace(&mut self.inner, clone);
        ResponseFuture::admit(ready, request, settings, key, limit, wire)
    }
}
