//! Response bodies: the rate-limit layer's [`ResponseBody`], and the complete body that every
//! layer's own responses (rejections, replays) are made of.

use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::HeaderMap;
use http_body::{Body, Frame, SizeHint};
use pin_project_lite::pin_project;

/// A complete body made by tollgate: its data (if any), then its trailers (if any).
#[derive(Debug, Default)]
pub(crate) struct Complete {
    data: Option<Bytes>,
    trailers: Option<HeaderMap>,
}

impl Complete {
    /// `data` followed by `trailers`.
    pub(crate) fn new(data: impl Into<Bytes>, trailers: Option<HeaderMap>) -> Self {
        let data = data.into();
        Self {
            data: (!data.is_empty()).then_some(data),
            trailers,
        }
    }

    /// The next frame; `None` once both data and trailers went out.
    pub(crate) fn next_frame(&mut self) -> Option<Frame<Bytes>> {
        match self.data.take() {
            Some(data) => Some(Frame::data(data)),
            None => self.trailers.take().map(Frame::trailers),
        }
    }

    pub(crate) fn is_end_stream(&self) -> bool {
        self.data.is_none() && self.trailers.is_none()
    }

    /// The data, empty when there is none.
    #[cfg(test)]
    pub(crate) fn data(&self) -> &[u8] {
        self.data.as_deref().unwrap_or_default()
    }

    pub(crate) fn size_hint(&self) -> SizeHint {
        SizeHint::with_exact(self.data.as_ref().map_or(0, |d| d.len() as u64))
    }
}

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
