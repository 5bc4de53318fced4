//! The concurrency-limit layer's refusals, and the headers that advertise its limit.

use std::borrow::Cow;
use std::time::Duration;

use http::{HeaderMap, HeaderValue, Response, StatusCode, header};

use super::settings::Settings;
use crate::body::Complete;
use crate::grpc::{Code, Wire};
use crate::headers::{QuotaUnit, RATELIMIT, RATELIMIT_POLICY};
use crate::rejection::{self, Rejection};

/// `429` (gRPC: RESOURCE_EXHAUSTED) with `Retry-After`: the configured hint, or `next_free` — a
/// problem of the quota-exceeded type, as a rate limit's denial is, naming the advertised
/// policy among its `violated-policies`.
pub(super) fn full(
    settings: &Settings,
    limit: u32,
    next_free: Duration,
    wire: Wire,
) -> Response<Complete> {
    let refused = Rejection {
        status: StatusCode::TOO_MANY_REQUESTS,
        code: Code::ResourceExhausted,
        message: Cow::Owned(format!(
            "too many requests in flight for this key: at most {limit}"
        )),
    };
    let violated: Vec<&str> = settings.advertise.as_deref().into_iter().collect();
    let mut response = refused.into_problem(wire, rejection::QUOTA_EXCEEDED, &violated);
    let wait = settings.retry_after.unwrap_or(next_free);
    let headers = response.headers_mut();
    headers.insert(header::RETRY_AFTER, rejection::retry_after(wait));
    advertise(settings, limit, headers, Some(wait));
    response
}

/// With [`advertise`](super::ConcurrencyLimitLayerBuilder::advertise): the limit in
/// `RateLimit-Policy`, and on a refusal (`wait` given) `RateLimit` with nothing left.
pub(super) fn advertise(
    settings: &Settings,
    limit: u32,
    headers: &mut HeaderMap,
    wait: Option<Duration>,
) {
    let Some(name) = settings.advertise.as_deref() else {
        return;
    };
    let unit = QuotaUnit::ConcurrentRequests.token();
    let policy = format!("\"{name}\";q={limit};qu=\"{unit}\"");
    // the name is checked when the layer is built: the values are valid header text
    // appended, not inserted: the members of layers inside (a rate limit's quota) stay, and
    // the fields list them all (RFC 9651 lists may span several field lines)
    if let Ok(policy) = HeaderValue::from_str(&policy) {
        headers.append(RATELIMIT_POLICY, policy);
    }
    if let Some(wait) = wait {
        let state = format!("\"{name}\";r=0;t={}", rejection::ceil_secs(wait));
        if let Ok(state) = HeaderValue::from_str(&state) {
            headers.append(RATELIMIT, state);
        }
    }
}

/// `503` (gRPC: UNAVAILABLE) with `Retry-After: 1`.
pub(super) fn store_unavailable(wire: Wire) -> Response<Complete> {
    let refused = Rejection {
        status: StatusCode::SERVICE_UNAVAILABLE,
        code: Code::Unavailable,
        message: Cow::Borrowed("concurrency-limit store unavailable"),
    };
    let mut response = refused.into_response(wire);
    response.headers_mut().insert(
        header::RETRY_AFTER,
        rejection::retry_after(Duration::from_secs(1)),
    );
    response
}

/// The missing-key `refusal` (by default `400`, gRPC INVALID_ARGUMENT), naming where the key is
/// read from.
pub(super) fn missing_key(
    settings: &Settings,
    (status, code): (StatusCode, Code),
    wire: Wire,
) -> Response<Complete> {
    let refused = Rejection {
        status,
        code,
        message: Cow::Owned(settings.missing_key_message.to_string()),
    };
    refused.into_response(wire)
}
