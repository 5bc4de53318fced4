//! Header text a client writes and a layer parses, beyond the Idempotency-Key and forwarding
//! headers of `hostile_input.rs`: `Content-Length` of any bytes on an idempotent request.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use crate::common;

use std::convert::Infallible;

use http::{HeaderValue, Request, Response, StatusCode, header};
use proptest::prelude::*;
use tower::{ServiceBuilder, ServiceExt};

use common::check;
use tollgate::idempotency::{IdempotencyLayer, RequestBody};
use tollgate::key::Header;
use tollgate::store::MemoryStore;

const LIMIT: usize = 16;

/// A `Content-Length` as a client may send it: numbers of any size and sign, lists, spaces,
/// exponents, and any bytes a header value holds.
fn declared() -> impl Strategy<Value = Vec<u8>> {
    let texts = [
        "-1",
        "+5",
        " 5",
        "5 ",
        "5,5",
        "1e3",
        "0x10",
        "",
        "16",
        "17",
        "18446744073709551615",
        "18446744073709551616",
        "99999999999999999999999999",
    ];
    prop_oneof![
        prop::sample::select(texts.to_vec()).prop_map(|t| t.as_bytes().to_vec()),
        any::<u64>().prop_map(|n| n.to_string().into_bytes()),
        (0u64..40).prop_map(|n| n.to_string().into_bytes()),
        prop::collection::vec(prop_oneof![0x20u8..0x7f, 0x80u8..=0xff], 0..24),
    ]
}

#[test]
fn any_content_length_is_read_as_a_number_or_ignored() {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let service = runtime.block_on(async {
        let layer = IdempotencyLayer::builder(MemoryStore::new())
            .scope(Header::from_static("x-tenant"))
            .body_limit(LIMIT)
            .build()
            .unwrap();
        ServiceBuilder::new()
            .layer(layer)
            .service(tower::service_fn(|_: Request<RequestBody<String>>| async {
                Ok::<_, Infallible>(Response::new(String::new()))
            }))
    });
    let case = (declared(), 0usize..32, any::<u64>());
    check(512, case, |(declared, len, id)| {
        let value = HeaderValue::from_bytes(&declared).unwrap();
        let request = Request::post("/upload")
            .header("x-tenant", "t1")
            .header("idempotency-key", format!("k{id}"))
            .header(header::CONTENT_LENGTH, value)
            .body("x".repeat(len))
            .unwrap();
        let response = runtime.block_on(service.clone().oneshot(request)).unwrap();
        let number = std::str::from_utf8(&declared)
            .ok()
            .and_then(|text| text.parse::<u64>().ok());
        let too_large = len > LIMIT || number.is_some_and(|n| n > LIMIT as u64);
        let expected = if too_large {
            StatusCode::PAYLOAD_TOO_LARGE
        } else {
            StatusCode::OK
        };
        prop_assert_eq!(
            response.status(),
            expected,
            "{:?}",
            String::from_utf8_lossy(&declared)
        );
        Ok(())
    });
}
