//! The rate-limit layer's response body.

use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use pin_project_lite::pin_project;

use crate::body::Complete;

pin_project! {
    /// The response body of the rate-limit layer: the inner service's body, or a complete body
    /// made by tollgate (a rejection). Its error is the inner body's, unboxed.
    #[project = ResponseBodyProj]
    #[derive(Debug)]
    pub struct ResponseBody<B> {
        #[pin]
        kind: Kind<B>,
    }
}

pin_project! {
    #[project = KindProj]
    #[derive(Debug)]
    enum Kind<B> {
        Inner { #[pin] body: B },
        Complete { body: Complete },
    }
}

impl<B> ResponseBody<B> {
    /// Wraps the inner service's body.
    pub(crate) fn inner(body: B) -> Self {
        Self {
            kind: Kind::Inner { body },
        }
    }
}

impl<B> From<Complete> for ResponseBody<B> {
    fn from(body: Complete) -> Self {
        Self {
            kind: Kind::Complete { body },
        }
    }
}

impl<B> Default for ResponseBody<B> {
    fn default() -> Self {
        Complete::default().into()
    }
}

impl<B> Body for ResponseBody<B>
where
    B: Body<Data = Bytes>,
{
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        match self.project().kind.project() {
            KindProj::Inner { body } => body.poll_frame(cx),
            KindProj::Complete { body } => Poll::Ready(body.next_frame().map(Ok)),
        }
    }

    fn is_end_stream(&self) -> bool {
        match &self.kind {
            Kind::Inner { body } => body.is_end_stream(),
            Kind::Complete { body } => body.is_end_stream(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.kind {
            Kind::Inner { body } => body.size_hint(),
            Kind::Complete { body } => body.size_hint(),
        }
    }
}
