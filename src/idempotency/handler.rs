//! What the layer needs of the inner service and of the bodies it reads and forwards.

use bytes::Bytes;
use http::{Request, Response};
use http_body::Body;
use http_body_util::{Either, Full};
use tower_service::Service;

use crate::error::BoxError;

/// The request body the inner service receives: the buffered body of a keyed request, or the
/// original body of a request the layer passes through.
pub type RequestBody<B> = Either<Full<Bytes>, B>;

/// An inner service whose keyed requests run in a task of their own: what the request flow and
/// the execution need of it. Implemented for every service with these bounds.
pub(super) trait Handler<ReqBody, ResBody>:
    Service<
        Request<RequestBody<ReqBody>>,
        Response = Response<ResBody>,
        Future: Send + 'static,
        Error: Send + 'static,
    > + Send
    + 'static
{
}

impl<S, ReqBody, ResBody> Handler<ReqBody, ResBody> for S
where
    S: Service<Request<RequestBody<ReqBody>>, Response = Response<ResBody>> + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
{
}

/// A request or response body the layer reads or forwards: bytes, with an error it can box.
pub(super) trait HttpBody:
    Body<Data = Bytes, Error: Into<BoxError>> + Send + 'static
{
}

impl<B> HttpBody for B
where
    B: Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
}
