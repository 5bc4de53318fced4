//! What a response of [`RateLimit`](super::RateLimit) gets: the decision's headers and record,
//! and the decision as its settlement left it.

use http::Response;

use super::body::ResponseBody;
use super::decision::{self, RateLimitDecision};
use super::settings::Settings;
use crate::idempotency::Replayed;
use crate::rate::RateOutcome;

/// The decision as the settlement left it: charged `actual` — or, when the store could not
/// settle, what it reserved (logged).
pub(super) fn settled_decision(
    settled: Result<RateOutcome, crate::store::StoreError>,
    mut decision: Option<RateLimitDecision>,
    actual: u64,
) -> Option<RateLimitDecision> {
    match (settled, decision.as_mut()) {
        (Ok(outcome), Some(decision)) => {
            decision.cost = actual;
            decision.states = outcome.limits;
        }
        (Err(error), _) => tracing::warn!(
            target: "tollgate::rate_limit",
            %error, actual,
            "could not settle a request's actual cost: it stays charged what it reserved"
        ),
        (Ok(_), None) => {}
    }
    decision
}

/// Whether `response` is a replay of the idempotency layer inside, which did not run the handler.
pub(super) fn replayed<B>(response: &Response<B>) -> bool {
    response.extensions().get::<Replayed>().is_some()
}

/// The response to send: the inner service's, with the decision's headers and record.
pub(super) fn finish<B>(
    settings: &Settings,
    response: Response<B>,
    decision: Option<RateLimitDecision>,
) -> Response<ResponseBody<B>> {
    let mut response = response.map(ResponseBody::inner);
    if let Some(decision) = decision {
        if settings.headers {
            decision.write_headers(settings.partition_key, response.headers_mut());
        }
        decision::record(response.extensions_mut(), decision);
    }
    response
}
