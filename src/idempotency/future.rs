//! The [`ResponseFuture`] of [`Idempotency`](super::Idempotency).

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use http::Response;
use pin_project_lite::pin_project;

use super::body::IdempotencyBody;

type Flow<B, E> = Pin<Box<dyn Future<Output = Result<Response<IdempotencyBody<B>>, E>> + Send>>;

pin_project! {
    /// The response future of [`Idempotency`](super::Idempotency).
    pub struct ResponseFuture<F, B, E> {
        #[pin]
        kind: Kind<F, B, E>,
    }
}

pin_project! {
    #[project = KindProj]
    enum Kind<F, B, E> {
        // a request the layer does not cover
        Passthrough { #[pin] future: F },
        // a keyed request: buffering, store round trips, the spawned execution
        Flow { flow: Flow<B, E> },
        Ready { response: Option<Response<IdempotencyBody<B>>> },
    }
}

impl<F, B, E> ResponseFuture<F, B, E> {
    pub(super) fn passthrough(future: F) -> Self {
        Self {
            kind: Kind::Passthrough { future },
        }
    }

    pub(super) fn flow(flow: Flow<B, E>) -> Self {
        Self {
            kind: Kind::Flow { flow },
        }
    }

    pub(super) fn ready(response: Response<IdempotencyBody<B>>) -> Self {
        Self {
            kind: Kind::Ready {
                response: Some(response),
            },
        }
    }
}

impl<F, B, E> Future for ResponseFuture<F, B, E>
where
    F: Future<Output = Result<Response<B>, E>>,
{
    type Output = Result<Response<IdempotencyBody<B>>, E>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match self.project().kind.project() {
            KindProj::Passthrough { future } => {
                let response = ready!(future.poll(cx))?;
                Poll::Ready(Ok(response.map(IdempotencyBody::inner)))
            }
            KindProj::Flow { flow } => flow.as_mut().poll(cx),
            KindProj::Ready { response } => match response.take() {
                Some(response) => Poll::Ready(Ok(response)),
                None => panic!("ResponseFuture polled after completion"),
            },
        }
    }
}

impl<F, B, E> fmt::Debug for ResponseFuture<F, B, E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let kind = match &self.kind {
            Kind::Passthrough { .. } => "passthrough",
            Kind::Flow { .. } => "keyed",
            Kind::Ready { .. } => "ready",
        };
        f.debug_struct("ResponseFuture")
            .field("kind", &kind)
            .finish()
    }
}
