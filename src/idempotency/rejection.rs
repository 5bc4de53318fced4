//! The responses the layer gives instead of the handler's: status, gRPC code, message and, when a
//! retry may soon succeed, `Retry-After`.

use http::{HeaderValue, Response, StatusCode, header};

use super::body::IdempotencyBody;
use super::key_header::KeyProblem;
use crate::grpc::Code;
use crate::rejection;

/// A response the layer gives instead of the handler's.
#[derive(Debug, Clone, Copy)]
pub(super) enum Rejection {
    BadKey(KeyProblem),
    TooLarge,
    UnreadableBody,
    InFlight,
    Mismatch,
    StoreUnavailable,
    /// The bodies buffered across all requests reached the layer's budget.
    Busy,
    HandlerFailed,
    /// The handler answered, but its response could not be recorded (the store did not confirm
    /// it within the lease): the caller must not take it for a success.
    Unrecorded,
}

impl Rejection {
    pub(super) fn into_response<B>(self, grpc: bool) -> Response<IdempotencyBody<B>> {
        crate::metrics::idempotency(match self {
            Self::InFlight => "conflict",
            Self::Mismatch => "mismatch",
            _ => "rejected",
        });
        let (status, code, message) = match self {
            Self::BadKey(problem) => (
                StatusCode::BAD_REQUEST,
                Code::InvalidArgument,
                problem.message(),
            ),
            Self::TooLarge => (
                StatusCode::PAYLOAD_TOO_LARGE,
                Code::ResourceExhausted,
                "the request body is larger than this endpoint buffers for idempotency",
            ),
            Self::UnreadableBody => (
                StatusCode::BAD_REQUEST,
                Code::InvalidArgument,
                "the request body could not be read",
            ),
            Self::InFlight => (
                StatusCode::CONFLICT,
                Code::Aborted,
                "a request with this Idempotency-Key is still being processed",
            ),
            Self::Mismatch => (
                StatusCode::UNPROCESSABLE_ENTITY,
                Code::FailedPrecondition,
                "this Idempotency-Key was used with a different request",
            ),
            Self::StoreUnavailable => (
                StatusCode::SERVICE_UNAVAILABLE,
                Code::Unavailable,
                "idempotency store unavailable; the request was not processed",
            ),
            Self::Busy => (
                StatusCode::SERVICE_UNAVAILABLE,
                Code::Unavailable,
                "too many request bodies are being buffered; retry later",
            ),
            Self::Unrecorded => (
                StatusCode::SERVICE_UNAVAILABLE,
                Code::Unavailable,
                "the response could not be recorded; retry with the same Idempotency-Key to learn the outcome",
            ),
            Self::HandlerFailed => (
                StatusCode::INTERNAL_SERVER_ERROR,
                Code::Internal,
                "the handler failed; nothing was stored and a retry runs it again",
            ),
        };
        let rejection = rejection::Rejection {
            status,
            code,
            message,
        };
        let mut response = rejection.into_response(grpc).map(IdempotencyBody::from);
        if matches!(
            self,
            Self::InFlight | Self::StoreUnavailable | Self::Busy | Self::Unrecorded
        ) {
            response
                .headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
        }
        response
    }
}
