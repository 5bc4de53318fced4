//! The rate-limit layer's response body.

use std::sync::Arc;
use std::task::Poll;

use bytes::{Buf, Bytes};
use http_body::Frame;

use super::Meter;
use crate::body::{LayerBody, Tap};
use crate::rate::{RateCheck, RatePolicy};
use crate::rate_client::settle::{self, Unsettled};
use crate::store::RateStore;

tapped_body! {
    /// The response body of the rate-limit layer: the inner service's body, or a complete body
    /// made by tollgate (a rejection). Its error is the inner body's, unboxed.
    ResponseBody {
        // with `settle_body_size` or `settle_stream`: reads what the body sends, and settles
        // the reservation on it when dropped
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

    /// Reads what this body sends, to settle its reservation on it.
    pub(crate) fn meter(&mut self, meter: BodyMeter) {
        self.meter = Some(meter);
    }
}

impl Tap for Option<BodyMeter> {
    fn frame<E>(&mut self, frame: &Poll<Option<Result<Frame<Bytes>, E>>>) {
        let (Some(meter), Poll::Ready(Some(Ok(frame)))) = (self.as_mut(), frame) else {
            return;
        };
        match &mut meter.reading {
            Reading::Sent(sent) => {
                let data = frame.data_ref().map_or(0, Buf::remaining);
                *sent = sent.saturating_add(data as u64);
            }
            Reading::Usage(usage) => {
                if let Some(data) = frame.data_ref() {
                    usage.data(data);
                } else if let Some(trailers) = frame.trailers_ref() {
                    usage.trailers(trailers);
                }
            }
        }
    }
}

/// What a [`BodyMeter`] settles a reservation on.
enum Reading {
    /// The bytes of body sent (`settle_body_size`).
    Sent(u64),
    /// The usage the body reports (`settle_stream`); what was reserved when it reports none.
    Usage(Box<dyn Meter>),
}

/// The reservation of a response settled on its body: reads what goes out and, when the body
/// is dropped (sent in full, or cut short), settles the charge in the background.
pub(crate) struct BodyMeter {
    store: Arc<dyn RateStore>,
    policy: Arc<RatePolicy>,
    check: RateCheck,
    reading: Reading,
}

impl BodyMeter {
    /// Settles on the bytes of body sent: 0 until the body sends any.
    pub(crate) fn sent(
        store: &Arc<dyn RateStore>,
        policy: &Arc<RatePolicy>,
        check: RateCheck,
    ) -> Self {
        Self::new(store, policy, check, Reading::Sent(0))
    }

    /// Settles on the usage `meter` reads from the body.
    pub(crate) fn usage(
        store: &Arc<dyn RateStore>,
        policy: &Arc<RatePolicy>,
        check: RateCheck,
        meter: Box<dyn Meter>,
    ) -> Self {
        Self::new(store, policy, check, Reading::Usage(meter))
    }

    fn new(
        store: &Arc<dyn RateStore>,
        policy: &Arc<RatePolicy>,
        check: RateCheck,
        reading: Reading,
    ) -> Self {
        Self {
            store: Arc::clone(store),
            policy: Arc::clone(policy),
            check,
            reading,
        }
    }

    /// The response is a replay: nothing of its body is charged (settled at once).
    pub(crate) fn replayed(self) {
        let mut meter = self;
        meter.reading = Reading::Sent(0);
    }

    /// What the charge is settled to.
    fn actual(&self) -> u64 {
        match &self.reading {
            Reading::Sent(sent) => *sent,
            Reading::Usage(meter) => meter.usage().unwrap_or(self.check.cost()),
        }
    }
}

impl std::fmt::Debug for BodyMeter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BodyMeter")
            .field("reserved", &self.check.cost())
            .field("actual", &self.actual())
            .finish_non_exhaustive()
    }
}

impl Drop for BodyMeter {
    fn drop(&mut self) {
        let actual = self.actual();
        if actual == self.check.cost() {
            return;
        }
        let why = match self.reading {
            Reading::Sent(_) => Unsettled::BodySize,
            Reading::Usage(_) => Unsettled::Streamed,
        };
        let settlement = self.check.settle(actual);
        settle::in_background(&*self.store, &self.policy, settlement, why, ());
    }
}
