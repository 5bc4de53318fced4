//! The responses the rate-limit layer gives instead of calling the inner service.

use std::borrow::Cow;

use http::{Response, StatusCode, header};

use super::body::ResponseBody;
use super::decision::{self, RateLimitDecision};
use super::settings::Settings;
use crate::body::Complete;
use crate::grpc::Code;
use crate::grpc::Wire;
use crate::headers;
use crate::rate_client::DecisionSource;
use crate::rejection;

/// A response the layer gives instead of calling the inner service.
#[derive(Debug)]
pub(crate) enum Rejection {
    Denied(RateLimitDecision),
    MissingKey,
}

/// Marks a response the layer gave instead of calling the inner service (in its extensions):
/// an outbound limit turns it into an error of the call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Refused {
    /// The request had no key.
    MissingKey,
    /// The limits had no room (or the store was down, under a policy that denies).
    Denied,
}

const DENIED: rejection::Rejection = rejection::Rejection {
    status: StatusCode::TOO_MANY_REQUESTS,
    code: Code::ResourceExhausted,
    message: Cow::Borrowed("rate limit exceeded"),
};

const STORE_UNAVAILABLE: rejection::Rejection = rejection::Rejection {
    status: StatusCode::SERVICE_UNAVAILABLE,
    code: Code::Unavailable,
    message: Cow::Borrowed("rate-limit store unavailable"),
};

impl Rejection {
    pub(crate) fn into_response<B>(
        self,
        settings: &Settings,
        wire: Wire,
    ) -> Response<ResponseBody<B>> {
        let decision = match self {
            Self::MissingKey => {
                let (status, code) = settings
                    .missing_key
                    .refusal()
                    .unwrap_or((StatusCode::BAD_REQUEST, Code::InvalidArgument));
                let missing = rejection::Rejection {
                    status,
                    code,
                    message: Cow::Owned(settings.missing_key_message.to_string()),
                };
                let mut response = missing.into_response(wire).map(ResponseBody::from);
                response.extensions_mut().insert(Refused::MissingKey);
                return response;
            }
            Self::Denied(decision) => decision,
        };
        let rejection = if decision.source == DecisionSource::StoreUnavailable {
            STORE_UNAVAILABLE
        } else {
            DENIED
        };
        let mut response = match &settings.rejection {
            Some(custom)
                if wire == Wire::Http && rejection.status == StatusCode::TOO_MANY_REQUESTS =>
            {
                custom(&decision).map(|body| ResponseBody::from(Complete::new(body, None)))
            }
            _ if rejection.status == StatusCode::TOO_MANY_REQUESTS => {
                let violated = decision.violated();
                rejection
                    .into_problem(wire, rejection::QUOTA_EXCEEDED, &violated)
                    .map(ResponseBody::from)
            }
            _ => rejection.into_response(wire).map(ResponseBody::from),
        };
        let headers = response.headers_mut();
        headers.insert(
            header::RETRY_AFTER,
            headers::retry_after(decision.retry_after),
        );
        decision.write_headers(settings.partition_key, headers);
        if wire == Wire::Grpc
            && let Some(metadata) = &settings.grpc_metadata
        {
            metadata(&decision, headers);
        }
        decision::record(response.extensions_mut(), decision);
        response.extensions_mut().insert(Refused::Denied);
        response
    }
}
