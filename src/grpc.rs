//! gRPC-native rejections: trailers-only responses that gRPC clients map to a status code.
//!
//! A gRPC call is recognised by its `content-type: application/grpc*`. Instead of an HTTP error
//! status it gets HTTP 200 with `grpc-status` and `grpc-message` in the headers and an empty body
//! — a "trailers-only" response — so that tonic and other clients see, for example,
//! `Code::ResourceExhausted` rather than `Unavailable` or `Unknown`.

use http::{HeaderMap, HeaderValue, Response, StatusCode, header};

use crate::body::Complete;

/// The gRPC status codes tollgate answers with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Code {
    /// 3: the request is malformed (a bad idempotency key, no rate-limit key).
    InvalidArgument = 3,
    /// 4: the request did not arrive in time (a request body past its deadline).
    DeadlineExceeded = 4,
    /// 8: over a rate limit.
    ResourceExhausted = 8,
    /// 9: the request cannot be served in the current state.
    FailedPrecondition = 9,
    /// 10: a concurrent request holds the same idempotency key.
    Aborted = 10,
    /// 7: a missing key answered `403`.
    PermissionDenied = 7,
    /// 13: the handler failed without a response.
    Internal = 13,
    /// 14: the store is unavailable.
    Unavailable = 14,
    /// 16: no credential where the key is one (a missing key answered `401`).
    Unauthenticated = 16,
}

/// What a request speaks, and so how a layer answers it: an HTTP response with problem details,
/// or a gRPC status in a trailers-only response.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Wire {
    /// Plain HTTP.
    Http,
    /// A gRPC call (`content-type: application/grpc…`).
    Grpc,
}

impl Wire {
    /// What the request with `headers` speaks.
    pub(crate) fn of(headers: &HeaderMap) -> Self {
        let grpc = headers
            .get(header::CONTENT_TYPE)
            .is_some_and(|v| v.as_bytes().starts_with(b"application/grpc"));
        if grpc { Self::Grpc } else { Self::Http }
    }
}

/// A trailers-only response carrying `code` and `message` (percent-encoded as gRPC requires),
/// with an empty body.
pub(crate) fn trailers_only(code: Code, message: &str) -> Response<Complete> {
    let mut response = Response::new(Complete::default());
    *response.status_mut() = StatusCode::OK;
    let headers = response.headers_mut();
    headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/grpc"),
    );
    headers.insert("grpc-status", HeaderValue::from(code as u16));
    if let Ok(value) = HeaderValue::from_str(&percent_encode(message)) {
        headers.insert("grpc-message", value);
    }
    response
}

/// Percent-encodes everything outside printable ASCII and `%` itself, per the gRPC spec.
fn percent_encode(message: &str) -> String {
    let mut out = String::with_capacity(message.len());
    for b in message.bytes() {
        if (0x20..=0x7e).contains(&b) && b != b'%' {
            out.push(char::from(b));
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn encodes_message_and_sets_status() {
        let res = trailers_only(Code::ResourceExhausted, "100% über");
        assert_eq!(res.status(), StatusCode::OK);
        assert_eq!(res.headers()["grpc-status"], "8");
        assert_eq!(res.headers()["content-type"], "application/grpc");
        assert_eq!(res.headers()["grpc-message"], "100%25 %C3%BCber");
    }

    #[test]
    fn detects_grpc_content_types() {
        let mut h = HeaderMap::new();
        assert_eq!(Wire::of(&h), Wire::Http);
        h.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/grpc+proto"),
        );
        assert_eq!(Wire::of(&h), Wire::Grpc);
        h.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        assert_eq!(Wire::of(&h), Wire::Http);
    }
}
