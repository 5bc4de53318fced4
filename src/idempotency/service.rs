//! The [`Idempotency`] service: which requests it covers, their store keys, and the hand-off of
//! a keyed request to its flow.

use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::{Request, Response, header};
use http_body::Body;
use http_body_util::Either;
use tower_service::Service;

use super::body::IdempotencyBody;
use super::flow::handle;
use super::future::ResponseFuture;
use super::handler::RequestBody;
use super::key_header::{self, KeyProblem};
use super::rejection::Rejection;
use super::settings::Settings;
use crate::error::BoxError;
use crate::grpc::Wire;
use crate::key::KeyExtractor;
use crate::keyspace;

layer_service! {
    /// Runs each keyed request once across all copies of a service and replays its response to
    /// retries; made by [`IdempotencyLayer`](super::IdempotencyLayer).
    Idempotency { scope }
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
        let wire = Wire::of(request.headers());
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
                return ResponseFuture::ready(settings.reject(Rejection::BadKey(problem), wire));
            }
        };
        if declared_length(&request).is_some_and(|len| len > settings.body_limit as u64) {
            return ResponseFuture::ready(settings.reject(Rejection::TooLarge, wire));
        }
        let (parts, body) = request.into_parts();
        let scope = self.scope.extract(&parts);
        if scope.is_none() {
            // fail closed: the keys of an unnamed caller are nobody's to replay
            if let Some((status, code)) = settings.missing_scope.refusal() {
                let rejection = Rejection::MissingScope(status, code);
                return ResponseFuture::ready(settings.reject(rejection, wire));
            }
        }
        let record_key = keyspace::idempotency_record(&settings.prefix, scope, &idempotency_key);
        // the body's room in the buffer budget is its caller's
        let caller = scope.filter(|_| settings.share_by_scope);
        // A clone that is readied only once the body is buffered and the key claimed, in the
        // execution: a concurrency permit (or buffer slot) of the inner service is not held while
        // a slow client uploads. The instance `poll_ready` readied stays ready for the next call.
        let service = self.inner.clone();
        ResponseFuture::flow(Box::pin(handle(
            Arc::clone(settings),
            service,
            parts,
            body,
            (record_key, caller),
            wire,
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
