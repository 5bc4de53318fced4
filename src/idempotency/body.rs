//! [`IdempotencyBody`]: the response body of the idempotency layer.

use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use pin_project_lite::pin_project;
use tokio::sync::mpsc;

use crate::body::{Complete, LayerBody};
use crate::error::BoxError;

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
        Layer { #[pin] body: LayerBody<B> },
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
            kind: Kind::Layer {
                body: LayerBody::inner(body),
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

impl<B> From<Complete> for IdempotencyBody<B> {
    fn from(body: Complete) -> Self {
        Self {
            kind: Kind::Layer { body: body.into() },
        }
    }
}

impl<B> Default for IdempotencyBody<B> {
    fn default() -> Self {
        Complete::default().into()
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
            KindProj::Layer { body } => body
                .poll_frame(cx)
                .map(|f| f.map(|f| f.map_err(Into::into))),
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
            Kind::Layer { body } => body.is_end_stream(),
            Kind::Channel { .. } => false,
        }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.kind {
            Kind::Layer { body } => body.size_hint(),
            Kind::Channel { remaining, .. } => {
                remaining.map_or_else(SizeHint::default, SizeHint::with_exact)
            }
        }
    }
}
