//! [`IdempotencyBody`]: the response body of the idempotency layer.

use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::HeaderMap;
use http_body::{Body, Frame, SizeHint};
use pin_project_lite::pin_project;
use tokio::sync::mpsc;

/// A boxed error, as body errors are passed on.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

pin_project! {
    /// The inner service's body (passed through), a complete body (a rejection or a replay), or
    /// the body of a first execution, streamed from the task that runs the handler and records
    /// the response.
    #[derive(Debug)]
    pub struct IdempotencyBody<B> {
        #[pin]
        kind: Kind<B>,
    }
}

pin_project! {
    #[project = KindProj]
    #[derive(Debug)]
    enum Kind<B> {
        Inner { #[pin] body: B },
        Full { data: Option<Bytes>, trailers: Option<HeaderMap> },
        Channel {
            frames: mpsc::Receiver<Result<Frame<Bytes>, BoxError>>,
            // the handler body's exact length, when it had one, less what was delivered
            remaining: Option<u64>,
        },
    }
}

impl<B> IdempotencyBody<B> {
    pub(crate) fn inner(body: B) -> Self {
        Self {
            kind: Kind::Inner { body },
        }
    }

    pub(crate) fn full(data: Bytes, trailers: Option<HeaderMap>) -> Self {
        Self {
            kind: Kind::Full {
                data: (!data.is_empty()).then_some(data),
                trailers,
            },
        }
    }

    pub(crate) fn channel(
        frames: mpsc::Receiver<Result<Frame<Bytes>, BoxError>>,
        exact_len: Option<u64>,
    ) -> Self {
        Self {
            kind: Kind::Channel {
                frames,
                remaining: exact_len,
            },
        }
    }
}

impl<B> Default for IdempotencyBody<B> {
    fn default() -> Self {
        Self::full(Bytes::new(), None)
    }
}

impl<B> Body for IdempotencyBody<B>
where
    B: Body<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        match self.project().kind.project() {
            KindProj::Inner { body } => body
                .poll_frame(cx)
                .map(|f| f.map(|f| f.map_err(Into::into))),
            KindProj::Full { data, trailers } => {
                if let Some(data) = data.take() {
                    return Poll::Ready(Some(Ok(Frame::data(data))));
                }
                Poll::Ready(trailers.take().map(|t| Ok(Frame::trailers(t))))
            }
            KindProj::Channel { frames, remaining } => {
                let frame = std::task::ready!(frames.poll_recv(cx));
                if let (Some(Ok(frame)), Some(left)) = (&frame, remaining.as_mut()) {
                    let len = frame.data_ref().map_or(0, |d| d.len() as u64);
                    *left = left.saturating_sub(len);
                }
                Poll::Ready(frame)
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        match &self.kind {
            Kind::Inner { body } => body.is_end_stream(),
            Kind::Full { data, trailers } => data.is_none() && trailers.is_none(),
            Kind::Channel { .. } => false,
        }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.kind {
            Kind::Inner { body } => body.size_hint(),
            Kind::Full { data, .. } => {
                SizeHint::with_exact(data.as_ref().map_or(0, |d| d.len() as u64))
            }
            Kind::Channel { remaining, .. } => {
                remaining.map_or_else(SizeHint::default, SizeHint::with_exact)
            }
        }
    }
}
