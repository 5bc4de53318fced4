//! [`OnceTx`] as an axum extractor (feature `axum`).

use std::borrow::Cow;
use std::convert::Infallible;
use std::fmt;

use axum::extract::{FromRequestParts, OptionalFromRequestParts};
use axum::response::{IntoResponse, Response};
use http::StatusCode;
use http::request::Parts;

use crate::grpc::{Code, Wire};
use crate::rejection::Rejection;
use crate::store::OnceTx;

/// Takes the request's transaction in an axum handler behind
/// [`IdempotencyLayer::in_transaction`](crate::idempotency::IdempotencyLayer::in_transaction):
/// `async fn handler(tx: OnceTx)`. Where a request may come without a key (the layer built with
/// `required(false)`), take `Option<OnceTx>`: `None` for those.
///
/// A request that no transaction runs for is refused with [`NoTransaction`].
impl<S: Send + Sync> FromRequestParts<S> for OnceTx {
    type Rejection = NoTransaction;

    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, NoTransaction> {
        parts
            .extensions
            .get::<OnceTx>()
            .cloned()
            .ok_or(NoTransaction(()))
    }
}

impl<S: Send + Sync> OptionalFromRequestParts<S> for OnceTx {
    type Rejection = Infallible;

    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Option<Self>, Infallible> {
        Ok(parts.extensions.get::<OnceTx>().cloned())
    }
}

/// The rejection of the [`OnceTx`] extractor: no transaction runs for the request — the route
/// is not behind `IdempotencyLayer::in_transaction`, or the layer lets requests without a key
/// through (`required(false)`) and this one had none. A configuration of the server, not the
/// caller's mistake: `500` with problem details that say so.
pub struct NoTransaction(());

impl fmt::Debug for NoTransaction {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("NoTransaction")
    }
}

impl fmt::Display for NoTransaction {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(DETAIL)
    }
}

impl std::error::Error for NoTransaction {}

/// What the rejection says.
const DETAIL: &str = "no transaction runs for this request: the route is not behind \
     IdempotencyLayer::in_transaction, or the request had no idempotency key (take Option<OnceTx> \
     where the key is optional)";

impl IntoResponse for NoTransaction {
    fn into_response(self) -> Response {
        let rejection = Rejection {
            status: StatusCode::INTERNAL_SERVER_ERROR,
            code: Code::Internal,
            message: Cow::Borrowed(DETAIL),
        };
        rejection
            .into_response(Wire::Http)
            .map(axum::body::Body::new)
    }
}
