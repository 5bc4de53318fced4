//! The bodies every layer answers with: [`Complete`], which tollgate's own responses
//! (rejections, replays) are made of, and [`LayerBody`], that or the inner service's body.

use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::HeaderMap;
use http_body::{Frame, SizeHint};
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

/// A body of its own where no inner body is around it (an axum rejection).
#[cfg(all(feature = "postgres", feature = "axum"))]
impl http_body::Body for Complete {
    type Data = Bytes;
    type Error = std::convert::Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        _: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        Poll::Ready(self.next_frame().map(Ok))
    }

    fn is_end_stream(&self) -> bool {
        Complete::is_end_stream(self)
    }

    fn size_hint(&self) -> SizeHint {
        Complete::size_hint(self)
    }
}

/// What a layer's body does with each frame of its inner body as it goes out (or its end, or an
/// error), e.g. count the bytes sent or give a permit back.
pub(crate) trait Tap {
    /// Sees `frame`, just polled.
    fn frame<E>(&mut self, frame: &Poll<Option<Result<Frame<Bytes>, E>>>);
}

pin_project! {
    /// What every layer answers with: the inner service's body, passed through, or a complete
    /// body made by tollgate (a rejection, a replay). Its error is the inner body's, unboxed.
    #[project = LayerBodyProj]
    #[derive(Debug)]
    pub(crate) enum LayerBody<B> {
        Inner { #[pin] body: B },
        Complete { body: Complete },
    }
}

impl<B> LayerBody<B> {
    /// The inner service's body.
    pub(crate) fn inner(body: B) -> Self {
        Self::Inner { body }
    }
}

impl<B> From<Complete> for LayerBody<B> {
    fn from(body: Complete) -> Self {
        Self::Complete { body }
    }
}

impl<B: http_body::Body<Data = Bytes>> http_body::Body for LayerBody<B> {
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, B::Error>>> {
        match self.project() {
            LayerBodyProj::Inner { body } => body.poll_frame(cx),
            LayerBodyProj::Complete { body } => Poll::Ready(body.next_frame().map(Ok)),
        }
    }

    fn is_end_stream(&self) -> bool {
        match self {
            Self::Inner { body } => body.is_end_stream(),
            Self::Complete { body } => body.is_end_stream(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match self {
            Self::Inner { body } => body.size_hint(),
            Self::Complete { body } => body.size_hint(),
        }
    }
}
