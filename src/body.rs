//! The complete body that every layer's own responses (rejections, replays) are made of.

use bytes::Bytes;
use http::HeaderMap;
use http_body::{Frame, SizeHint};

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
        mut self: std::pin::Pin<&mut Self>,
        _: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        std::task::Poll::Ready(self.next_frame().map(Ok))
    }

    fn is_end_stream(&self) -> bool {
        Complete::is_end_stream(self)
    }

    fn size_hint(&self) -> SizeHint {
        Complete::size_hint(self)
    }
}
