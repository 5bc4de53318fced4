//! The rate-limit layer's response body.

use std::sync::Arc;
use std::task::Poll;

use bytes::{Buf, Bytes};
use http_body::Frame;

use crate::body::{LayerBody, Tap};
use crate::rate::{RateCheck, RatePolicy};
use crate::rate_client::settle::{self, Unsettled};
use crate::store::RateStore;

tapped_body! {
    /// The response body of the rate-limit layer: the inner service's body, or a complete body
    /// made by tollgate (a rejection). Its error is the inner body's, unboxed.
    ResponseBody {
        // with `settle_body_size`: counts the bytes sent, and settles them when dropped
        meter: Option<BodyMeter>
    }
}

impl<B> ResponseBody<B> {
    /// Wraps the inner service's body.
    pub(crate) fn inner(body: B) -> Self {
        Self {
            body: LayerBody::inner(body),
            meter: None,
        }
    }

    /// Counts the bytes of this body that go out, to settle its reservation on them.
    pub(crate) fn meter(&mut self, meter: BodyMeter) {
        self.meter = Some(meter);
    }
}

impl Tap for Option<BodyMeter> {
    fn frame<E>(&mut self, frame: &Poll<Option<Result<Frame<Bytes>, E>>>) {
        if let (Some(meter), Poll::Ready(Some(Ok(frame)))) = (self.as_mut(), frame) {
            let sent = frame.data_ref().map_or(0, Buf::remaining);
            meter.sent = meter.sent.saturating_add(sent as u64);
        }
    }
}

/// The reservation of a response settled on its body's size: counts the bytes that go out and,
/// when the body is dropped (sent in full, or cut short), settles the charge to them in the
/// background.
pub(crate) struct BodyMeter {
    store: Arc<dyn RateStore>,
    policy: Arc<RatePolicy>,
    check: RateCheck,
    sent: u64,
}

impl BodyMeter {
    pub(crate) fn new(
        store: &Arc<dyn RateStore>,
        policy: &Arc<RatePolicy>,
        check: RateCheck,
    ) -> Self {
        Self {
            store: Arc::clone(store),
            policy: Arc::clone(policy),
            check,
            sent: 0,
        }
    }
}

impl BodyMeter {
    /// The response is a replay: nothing of its body is charged (settled when dropped).
    pub(crate) fn replayed(self) {
        let mut meter = self;
        meter.sent = 0;
    }
}

impl std::fmt::Debug for BodyMeter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BodyMeter")
            .field("reserved", &self.check.cost())
            .field("sent", &self.sent)
            .finish_non_exhaustive()
    }
}

impl Drop for BodyMeter {
    fn drop(&mut self) {
        if self.sent == self.check.cost() {
            return;
        }
        let settlement = self.check.settle(self.sent);
        settle::in_background(&*self.store, &self.policy, settlement, Unsettled::BodySize);
    }
}
