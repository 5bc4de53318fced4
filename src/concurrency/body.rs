//! The concurrency-limit layer's response body: it holds the request's permit until it ends.

use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use pin_project_lite::pin_project;

use super::permit::Held;
use crate::body::{Complete, LayerBody};

pin_project! {
    /// The response body of the concurrency-limit layer: the inner service's body, holding the
    /// request's permit until it ends (its last frame, an error, or dropped), or a complete body
    /// made by tollgate (a rejection). Its error is the inner body's, unboxed.
    #[derive(Debug)]
    pub struct PermitBody<B> {
        #[pin]
        body: LayerBody<B>,
        held: Option<Held>,
    }
}

impl<B> PermitBody<B> {
    /// The inner service's body, holding `held` until it ends.
    pub(crate) fn inner(body: B, held: Option<Held>) -> Self {
        Self {
            body: LayerBody::inner(body),
            held,
        }
    }
}

impl<B> From<Complete> for PermitBody<B> {
    fn from(body: Complete) -> Self {
        Self {
            body: body.into(),
            held: None,
        }
    }
}

impl<B> Default for PermitBody<B> {
    fn default() -> Self {
        Complete::default().into()
    }
}

impl<B> Body for PermitBody<B>
where
    B: Body<Data = Bytes>,
{
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        let this = self.project();
        let frame = this.body.poll_frame(cx);
        if matches!(frame, Poll::Ready(None | Some(Err(_)))) {
            // the response is done with: the permit goes back now
            this.held.take();
        }
        frame
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}
