//! The one builder of the responses a layer gives instead of the inner service's: plain text
//! for HTTP, trailers-only for gRPC.

use http::{HeaderValue, Response, StatusCode, header};

use crate::body::Complete;
use crate::grpc::{self, Code};

/// A response the layers answer with themselves: `status` with `message` as plain text, or for a
/// gRPC call a trailers-only response with `code` and `message`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Rejection {
    pub(crate) status: StatusCode,
    pub(crate) code: Code,
    pub(crate) message: &'static str,
}

impl Rejection {
    /// The response, for a gRPC call when `grpc`.
    pub(crate) fn into_response(self, grpc: bool) -> Response<Complete> {
        if grpc {
            return grpc::trailers_only(self.code, self.message);
        }
        let mut response = Response::new(Complete::new(format!("{}\n", self.message), None));
        *response.status_mut() = self.status;
        response.headers_mut().insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("text/plain; charset=utf-8"),
        );
        response
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plain_text_for_http_and_trailers_only_for_grpc() {
        let rejection = Rejection {
            status: StatusCode::TOO_MANY_REQUESTS,
            code: Code::ResourceExhausted,
            message: "rate limit exceeded",
        };
        let http = rejection.into_response(false);
        assert_eq!(http.status(), StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(http.headers()["content-type"], "text/plain; charset=utf-8");
        let grpc = rejection.into_response(true);
        assert_eq!(grpc.status(), StatusCode::OK);
        assert_eq!(grpc.headers()["grpc-status"], "8");
        assert!(grpc.body().is_end_stream());
    }
}
