//! The concurrency-limit layer's response body: it holds the request's permit until it ends.

use std::task::Poll;

use bytes::Bytes;
use http_body::Frame;

use super::permit::Held;
use crate::body::{LayerBody, Tap};

tapped_body! {
    /// The response body of the concurrency-limit layer: the inner service's body, holding the
    /// request's permit until it ends (its last frame, an error, or dropped), or a complete body
    /// made by tollgate (a rejection). Its error is the inner body's, unboxed.
    PermitBody { held: Option<Held> }
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

impl Tap for Option<Held> {
    fn frame<E>(&mut self, frame: &Poll<Option<Result<Frame<Bytes>, E>>>) {
        if matches!(frame, Poll::Ready(None | Some(Err(_)))) {
            // the response is done with: the permit goes back now
            self.take();
        }
    }
}
