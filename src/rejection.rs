//! The one builder of the responses a layer gives instead of the inner service's: problem
//! details (RFC 9457, `application/problem+json`) for HTTP, trailers-only for gRPC.

use std::borrow::Cow;
use std::fmt::Write;
use std::time::Duration;

use http::{HeaderValue, Response, StatusCode, header};

use crate::body::Complete;
use crate::grpc::Wire;
use crate::grpc::{self, Code};
use crate::key::MissingKey;

/// The problem type of a rate-limit denial (draft-ietf-httpapi-ratelimit-headers).
pub(crate) const QUOTA_EXCEEDED: &str =
    "https://iana.org/assignments/http-problem-types#quota-exceeded";

/// A duration in whole seconds, rounded up.
pub(crate) fn ceil_secs(d: Duration) -> u64 {
    d.as_secs() + u64::from(d.subsec_nanos() > 0)
}

/// `Retry-After`: whole seconds, rounded up, at least 1 — a client told 0 would retry at once.
pub(crate) fn retry_after(d: Duration) -> HeaderValue {
    HeaderValue::from(ceil_secs(d).max(1))
}

/// A response the layers answer with themselves: `status` with `message` as problem details, or
/// for a gRPC call a trailers-only response with `code` and `message`.
#[derive(Debug, Clone)]
pub(crate) struct Rejection {
    pub(crate) status: StatusCode,
    pub(crate) code: Code,
    pub(crate) message: Cow<'static, str>,
}

impl Rejection {
    /// The response, for a gRPC call when `grpc`: problem details of type `about:blank`.
    pub(crate) fn into_response(self, wire: Wire) -> Response<Complete> {
        self.into_problem(wire, "about:blank", &[])
    }

    /// The response with problem type `kind`; for a quota problem, the names of the
    /// `violated` policies as the draft's `violated-policies` member.
    pub(crate) fn into_problem(
        self,
        wire: Wire,
        kind: &str,
        violated: &[&str],
    ) -> Response<Complete> {
        if wire == Wire::Grpc {
            return grpc::trailers_only(self.code, &self.message);
        }
        // The type, the title and the violated limits' names ([A-Za-z0-9_.-]) need no escaping;
        // the detail may name what the key is read from, which the application wrote.
        let mut body = format!(
            "{{\"type\":\"{kind}\",\"title\":\"{}\",\"status\":{},\"detail\":\"{}\"",
            self.status.canonical_reason().unwrap_or(""),
            self.status.as_u16(),
            json_escaped(&self.message)
        );
        if !violated.is_empty() {
            body.push_str(",\"violated-policies\":[");
            for (i, name) in violated.iter().enumerate() {
                let _ = write!(body, "{}\"{name}\"", if i > 0 { "," } else { "" });
            }
            body.push(']');
        }
        body.push_str("}\n");
        let mut response = Response::new(Complete::new(body, None));
        *response.status_mut() = self.status;
        response.headers_mut().insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/problem+json"),
        );
        response
    }
}

/// `text` as the inside of a JSON string.
fn json_escaped(text: &str) -> Cow<'_, str> {
    if !text
        .chars()
        .any(|c| c == '"' || c == '\\' || c.is_control())
    {
        return Cow::Borrowed(text);
    }
    let mut out = String::with_capacity(text.len() + 8);
    for c in text.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c if c.is_control() => {
                let _ = write!(out, "\\u{:04x}", u32::from(c));
            }
            c => out.push(c),
        }
    }
    Cow::Owned(out)
}

/// How a layer refuses a request without a key: the HTTP and gRPC vocabulary of
/// [`MissingKey`], kept with the other refusals.
impl MissingKey {
    /// The status and gRPC code a request without a key is refused with; `None` when it is let
    /// through.
    pub(crate) fn refusal(self) -> Option<(http::StatusCode, Code)> {
        match self {
            Self::Reject => Some((StatusCode::BAD_REQUEST, Code::InvalidArgument)),
            Self::RejectWith(status) => {
                let code = match status {
                    StatusCode::UNAUTHORIZED => Code::Unauthenticated,
                    StatusCode::FORBIDDEN => Code::PermissionDenied,
                    _ => Code::InvalidArgument,
                };
                Some((status, code))
            }
            Self::Allow => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn problem_details_for_http_and_trailers_only_for_grpc() {
        let rejection = Rejection {
            status: StatusCode::TOO_MANY_REQUESTS,
            code: Code::ResourceExhausted,
            message: Cow::Borrowed("rate limit exceeded"),
        };
        let http = rejection.clone().into_response(Wire::Http);
        assert_eq!(http.status(), StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(http.headers()["content-type"], "application/problem+json");
        assert_eq!(
            std::str::from_utf8(http.body().data()).unwrap(),
            "{\"type\":\"about:blank\",\"title\":\"Too Many Requests\",\"status\":429,\
             \"detail\":\"rate limit exceeded\"}\n"
        );
        let quota =
            rejection
                .clone()
                .into_problem(Wire::Http, QUOTA_EXCEEDED, &["burst", "hourly"]);
        assert!(
            quota
                .body()
                .data()
                .ends_with(b"\"violated-policies\":[\"burst\",\"hourly\"]}\n")
        );
        let grpc = rejection.into_response(Wire::Grpc);
        assert_eq!(grpc.status(), StatusCode::OK);
        assert_eq!(grpc.headers()["grpc-status"], "8");
        assert!(grpc.body().is_end_stream());
    }

    #[test]
    fn details_are_escaped_as_json() {
        assert_eq!(json_escaped("header x-api-key"), "header x-api-key");
        assert_eq!(
            json_escaped("the function \"tenant\"\n\\"),
            "the function \\\"tenant\\\"\\u000a\\\\"
        );
    }
}
