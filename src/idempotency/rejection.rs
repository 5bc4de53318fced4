//! The responses the layer gives instead of the handler's: status, gRPC code, message and, when a
//! retry may soon succeed, `Retry-After`; or what the layer's own rejection closure builds.

use std::borrow::Cow;
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderName, HeaderValue, Response, StatusCode, header};

use super::body::IdempotencyBody;
use super::key_header::KeyProblem;
use super::report::report;
use crate::body::Complete;
use crate::grpc::Code;
use crate::grpc::Wire;
use crate::rejection;

/// A response the layer gives instead of the handler's.
#[derive(Debug, Clone, Copy)]
pub(super) enum Rejection {
    BadKey(KeyProblem),
    /// The request does not name its caller, whose keys it would use: the status and code of
    /// the layer's [`MissingScope`](super::MissingScope).
    MissingScope(StatusCode, Code),
    TooLarge,
    UnreadableBody,
    /// The request body did not arrive whole within the layer's body timeout.
    BodyTimeout,
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

/// Builds the HTTP response to a rejection, in place of the problem details.
pub(crate) type RejectionFn = Arc<dyn Fn(&IdempotencyRejection) -> Response<Bytes> + Send + Sync>;

/// Why the idempotency layer answered a request itself, instead of the handler: what a custom
/// rejection ([`IdempotencyLayerBuilder::rejection`](super::IdempotencyLayerBuilder::rejection))
/// is built from.
#[derive(Clone)]
pub struct IdempotencyRejection {
    rejection: Rejection,
    /// The header the layer reads the key from, which the detail names.
    header: HeaderName,
}

impl IdempotencyRejection {
    /// The status the layer answers with by default: `400`, `408`, `409`, `413`, `422`, `503`, or
    /// `500` when the handler itself failed (nothing was stored; a retry runs it again).
    pub fn status(&self) -> StatusCode {
        self.rejection.parts(&self.header).0
    }

    /// What went wrong, in a sentence for the client (the default body's `detail`), naming the
    /// layer's own key header where it speaks of the key.
    pub fn detail(&self) -> String {
        self.rejection.parts(&self.header).2.into_owned()
    }

    /// A stable, machine-readable name of the reason: `invalid_key`, `missing_scope`,
    /// `body_too_large`, `unreadable_body`, `body_timeout`, `in_flight`, `mismatch`,
    /// `store_unavailable`, `busy`, `handler_failed` or `unrecorded`.
    pub fn code(&self) -> &'static str {
        self.rejection.code()
    }

    /// When the same request may succeed soon, the wait the response's `Retry-After` says (the
    /// layer adds it to a custom response too); `None` when retrying as is cannot help.
    pub fn retry_after(&self) -> Option<Duration> {
        self.rejection.retry_after()
    }
}

impl fmt::Debug for IdempotencyRejection {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IdempotencyRejection")
            .field("status", &self.status())
            .field("code", &self.code())
            .field("detail", &self.detail())
            .finish()
    }
}

impl Rejection {
    /// The reason's stable name (see [`IdempotencyRejection::code`]).
    fn code(&self) -> &'static str {
        match self {
            Self::BadKey(_) => "invalid_key",
            Self::MissingScope(..) => "missing_scope",
            Self::TooLarge => "body_too_large",
            Self::UnreadableBody => "unreadable_body",
            Self::BodyTimeout => "body_timeout",
            Self::InFlight => "in_flight",
            Self::Mismatch => "mismatch",
            Self::StoreUnavailable => "store_unavailable",
            Self::Busy => "busy",
            Self::HandlerFailed => "handler_failed",
            Self::Unrecorded => "unrecorded",
        }
    }

    /// The response: problem details (or what the layer's `custom` rejection closure builds) for
    /// HTTP, trailers-only for a gRPC call.
    pub(super) fn into_response<B>(
        self,
        custom: Option<&RejectionFn>,
        header: &HeaderName,
        wire: Wire,
    ) -> Response<IdempotencyBody<B>> {
        let outcome = match self {
            Self::InFlight => "conflict",
            Self::Mismatch => "mismatch",
            _ => "rejected",
        };
        report(outcome, Some(self.code()));
        let mut response = match custom {
            Some(custom) if wire == Wire::Http => {
                let why = IdempotencyRejection {
                    rejection: self,
                    header: header.clone(),
                };
                custom(&why).map(|body| IdempotencyBody::from(Complete::new(body, None)))
            }
            _ => {
                let (status, code, message) = self.parts(header);
                let rejection = rejection::Rejection {
                    status,
                    code,
                    message,
                };
                rejection.into_response(wire).map(IdempotencyBody::from)
            }
        };
        if self.retry_after().is_some() {
            response
                .headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
        }
        response
    }

    /// A retry soon may succeed: a second for the other request or the store.
    fn retry_after(self) -> Option<Duration> {
        matches!(
            self,
            Self::InFlight | Self::StoreUnavailable | Self::Busy | Self::Unrecorded
        )
        .then_some(Duration::from_secs(1))
    }

    /// The default status, gRPC code and message, which names the key's `header`.
    fn parts(self, header: &HeaderName) -> (StatusCode, Code, Cow<'static, str>) {
        let key = super::key_header::label(header);
        match self {
            Self::BadKey(problem) => (
                StatusCode::BAD_REQUEST,
                Code::InvalidArgument,
                problem.message(key).into(),
            ),
            Self::MissingScope(status, code) => (
                status,
                code,
                format!("this request does not name its caller, whose {key}s it would use").into(),
            ),
            Self::TooLarge => (
                StatusCode::PAYLOAD_TOO_LARGE,
                Code::ResourceExhausted,
                "the request body is larger than this endpoint buffers for idempotency".into(),
            ),
            Self::UnreadableBody => (
                StatusCode::BAD_REQUEST,
                Code::InvalidArgument,
                "the request body could not be read".into(),
            ),
            Self::BodyTimeout => (
                StatusCode::REQUEST_TIMEOUT,
                Code::DeadlineExceeded,
                "the request body did not arrive in time".into(),
            ),
            Self::InFlight => (
                StatusCode::CONFLICT,
                Code::Aborted,
                format!("a request with this {key} is still being processed").into(),
            ),
            Self::Mismatch => (
                StatusCode::UNPROCESSABLE_ENTITY,
                Code::FailedPrecondition,
                format!("this {key} was used with a different request").into(),
            ),
            Self::StoreUnavailable => (
                StatusCode::SERVICE_UNAVAILABLE,
                Code::Unavailable,
                "idempotency store unavailable; the request was not processed".into(),
            ),
            Self::Busy => (
                StatusCode::SERVICE_UNAVAILABLE,
                Code::Unavailable,
                "too many request bodies are being buffered; retry later".into(),
            ),
            Self::Unrecorded => (
                StatusCode::SERVICE_UNAVAILABLE,
                Code::Unavailable,
                format!(
                    "the response could not be recorded; retry with the same {key} to learn the outcome"
                )
                .into(),
            ),
            Self::HandlerFailed => (
                StatusCode::INTERNAL_SERVER_ERROR,
                Code::Internal,
                "the handler failed; nothing was stored and a retry runs it again".into(),
            ),
        }
    }
}
