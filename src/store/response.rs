//! The stored form of a completed response: status, headers, body and trailers, byte for byte.
//!
//! Layout (all integers big-endian): version `1` (u8), status (u16), header count (u32), then per
//! header name length (u32), name, value length (u32), value; body length (u32), body; trailer
//! count (u32), then trailers as headers. Decoding checks every length and count and never panics:
//! a record that is not one this crate wrote (cut short, crafted, more headers than a `HeaderMap`
//! holds) decodes to `None`.

use bytes::{BufMut, Bytes, BytesMut};
use http::{HeaderMap, HeaderName, HeaderValue, StatusCode};

const VERSION: u8 = 1;
/// The headers a decoded map makes room for before it reads them: more than a response has.
const PREALLOCATED_HEADERS: usize = 64;

/// A response as stored and replayed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct StoredResponse {
    pub(crate) status: StatusCode,
    pub(crate) headers: HeaderMap,
    pub(crate) body: Bytes,
    pub(crate) trailers: Option<HeaderMap>,
}

impl StoredResponse {
    pub(crate) fn encode(&self) -> Bytes {
        let mut out = BytesMut::with_capacity(self.body.len() + 64 * (self.headers.len() + 1));
        out.put_u8(VERSION);
        out.put_u16(self.status.as_u16());
        put_headers(&mut out, &self.headers);
        put_field(&mut out, &self.body);
        match &self.trailers {
            Some(trailers) => put_headers(&mut out, trailers),
            None => out.put_u32(u32::MAX),
        }
        out.freeze()
    }

    pub(crate) fn decode(mut bytes: &[u8]) -> Option<Self> {
        let input = &mut bytes;
        if take(input, 1)? != [VERSION] {
            return None;
        }
        let status =
            StatusCode::from_u16(u16::from_be_bytes(take(input, 2)?.try_into().ok()?)).ok()?;
        let headers = take_headers(input)?;
        let body = Bytes::copy_from_slice(take_field(input)?);
        let trailers = if input.get(..4) == Some(&u32::MAX.to_be_bytes()[..]) {
            *input = &input[4..];
            None
        } else {
            Some(take_headers(input)?)
        };
        input.is_empty().then_some(Self {
            status,
            headers,
            body,
            trailers,
        })
    }
}

fn put_field(out: &mut BytesMut, bytes: &[u8]) {
    out.put_u32(u32::try_from(bytes.len()).unwrap_or(u32::MAX));
    out.put_slice(bytes);
}

fn put_headers(out: &mut BytesMut, headers: &HeaderMap) {
    out.put_u32(u32::try_from(headers.len()).unwrap_or(u32::MAX));
    for (name, value) in headers {
        put_field(out, name.as_str().as_bytes());
        put_field(out, value.as_bytes());
    }
}

fn take<'a>(input: &mut &'a [u8], n: usize) -> Option<&'a [u8]> {
    if input.len() < n {
        return None;
    }
    let (head, rest) = input.split_at(n);
    *input = rest;
    Some(head)
}

fn take_u32(input: &mut &[u8]) -> Option<usize> {
    Some(u32::from_be_bytes(take(input, 4)?.try_into().ok()?) as usize)
}

fn take_field<'a>(input: &mut &'a [u8]) -> Option<&'a [u8]> {
    let len = take_u32(input)?;
    take(input, len)
}

fn take_headers(input: &mut &[u8]) -> Option<HeaderMap> {
    let count = take_u32(input)?;
    // every header takes at least 8 bytes: a count beyond that is corrupt, not a reason to allocate
    if count > input.len() / 8 {
        return None;
    }
    // a `HeaderMap` panics when made for, or grown past, 2^15 names (fewer with its load
    // factor), yet holds any number of values under a few names: room for some is made ahead,
    // and a record naming more than a map can hold is refused as it grows
    let mut headers = HeaderMap::try_with_capacity(count.min(PREALLOCATED_HEADERS)).ok()?;
    for _ in 0..count {
        let name = HeaderName::from_bytes(take_field(input)?).ok()?;
        let value = HeaderValue::from_bytes(take_field(input)?).ok()?;
        headers.try_append(name, value).ok()?;
    }
    Some(headers)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_completed_records_state_names_its_status() {
        use crate::store::IdempotencyState;
        use std::time::Duration;
        let completed = |response: Bytes| IdempotencyState::Completed {
            response,
            retention_left: Duration::from_secs(1),
            age: None,
        };
        let encoded = sample(None).encode();
        assert_eq!(
            completed(encoded).response_status(),
            Some(StatusCode::CREATED)
        );
        assert_eq!(completed(Bytes::from_static(b"x")).response_status(), None);
        let running = IdempotencyState::InFlight {
            lease_left: Duration::from_secs(1),
            age: Some(Duration::ZERO),
        };
        assert_eq!(running.response_status(), None);
    }

    fn sample(trailers: Option<HeaderMap>) -> StoredResponse {
        let mut headers = HeaderMap::new();
        headers.insert("content-type", HeaderValue::from_static("application/json"));
        headers.append("set-cookie", HeaderValue::from_static("a=1"));
        headers.append("set-cookie", HeaderValue::from_static("b=2"));
        headers.insert("x-bin", HeaderValue::from_bytes(b"\x80\xff").unwrap());
        StoredResponse {
            status: StatusCode::CREATED,
            headers,
            body: Bytes::from_static(b"\x00{\"id\":1}\xff"),
            trailers,
        }
    }

    #[test]
    fn round_trips_byte_for_byte() {
        let mut trailers = HeaderMap::new();
        trailers.insert("grpc-status", HeaderValue::from_static("0"));
        for response in [
            sample(None),
            sample(Some(trailers)),
            sample(Some(HeaderMap::new())),
        ] {
            assert_eq!(StoredResponse::decode(&response.encode()), Some(response));
        }
    }

    /// A record whose first header list declares `count` headers, followed by `len` zero bytes.
    fn declaring(count: u32, len: usize) -> Vec<u8> {
        let mut record = vec![VERSION, 0, 200];
        record.extend_from_slice(&count.to_be_bytes());
        record.resize(record.len() + len, 0);
        record
    }

    #[test]
    fn a_record_declaring_more_headers_than_a_header_map_holds_is_refused() {
        // 2^15 headers with the 8 bytes each needs: more than a `HeaderMap` can be made for
        let count = 1 << 15;
        assert_eq!(StoredResponse::decode(&declaring(count, 8 << 15)), None);
        assert_eq!(StoredResponse::decode(&declaring(24_577, 8 * 24_577)), None);
    }

    #[test]
    fn a_record_declaring_a_billion_headers_is_refused() {
        assert_eq!(StoredResponse::decode(&declaring(1_000_000_000, 64)), None);
        assert_eq!(StoredResponse::decode(&declaring(u32::MAX - 1, 64)), None);
    }

    #[test]
    fn a_record_with_more_header_names_than_a_header_map_holds_is_refused() {
        // 2^15 distinct names, each a well-formed header: the map cannot grow to hold them all
        let count: u32 = 1 << 15;
        let mut record = vec![VERSION, 0, 200];
        record.extend_from_slice(&count.to_be_bytes());
        for i in 0..count {
            put_field_bytes(&mut record, format!("h{i:05}").as_bytes());
            put_field_bytes(&mut record, b"v");
        }
        record.extend_from_slice(&0u32.to_be_bytes());
        record.extend_from_slice(&u32::MAX.to_be_bytes());
        assert_eq!(StoredResponse::decode(&record), None);
    }

    #[test]
    fn many_values_of_one_header_round_trip() {
        // a map holds any number of values under few names: such a record is one this crate writes
        let mut headers = HeaderMap::new();
        for i in 0..30_000 {
            headers.append("x-many", HeaderValue::from(i));
        }
        let response = StoredResponse {
            status: StatusCode::OK,
            headers,
            body: Bytes::new(),
            trailers: None,
        };
        assert_eq!(StoredResponse::decode(&response.encode()), Some(response));
    }

    fn put_field_bytes(out: &mut Vec<u8>, bytes: &[u8]) {
        out.extend_from_slice(&u32::try_from(bytes.len()).unwrap().to_be_bytes());
        out.extend_from_slice(bytes);
    }

    #[test]
    fn corrupt_input_is_refused_without_panicking() {
        let encoded = sample(None).encode();
        for cut in 0..encoded.len() {
            assert_eq!(
                StoredResponse::decode(&encoded[..cut]),
                None,
                "cut at {cut}"
            );
        }
        let mut extended = encoded.to_vec();
        extended.push(0);
        assert_eq!(StoredResponse::decode(&extended), None);
        assert_eq!(
            StoredResponse::decode(&[1, 0, 200, 255, 255, 255, 255]),
            None
        );
    }

    mod properties {
        use proptest::prelude::*;

        use super::*;
        use crate::fuzz::{bytes, check, spoil, spoiling};

        fn header_map() -> impl Strategy<Value = HeaderMap> {
            let name = prop_oneof![
                Just("set-cookie".to_owned()),
                Just("content-type".to_owned()),
                "[a-z0-9-]{1,12}",
            ];
            let value =
                prop::collection::vec(prop_oneof![Just(b'\t'), 0x20u8..0x7f, 0x80u8..=0xff], 0..24);
            prop::collection::vec((name, value), 0..6).prop_map(|pairs| {
                let mut map = HeaderMap::new();
                for (name, value) in pairs {
                    map.append(
                        HeaderName::from_bytes(name.as_bytes()).unwrap(),
                        HeaderValue::from_bytes(&value).unwrap(),
                    );
                }
                map
            })
        }

        fn response() -> impl Strategy<Value = StoredResponse> {
            (
                100u16..1000,
                header_map(),
                bytes(64),
                prop::option::of(header_map()),
            )
                .prop_map(|(status, headers, body, trailers)| StoredResponse {
                    status: StatusCode::from_u16(status).unwrap(),
                    headers,
                    body: Bytes::from(body),
                    trailers,
                })
        }

        #[test]
        fn any_response_decodes_to_itself() {
            check(256, response(), |response| {
                prop_assert_eq!(StoredResponse::decode(&response.encode()), Some(response));
                Ok(())
            });
        }

        #[test]
        fn any_bytes_decode_or_are_refused_without_panicking() {
            check(1024, bytes(512), |record| {
                // what decodes is a record this crate could have written: it encodes back to itself
                if let Some(decoded) = StoredResponse::decode(&record) {
                    prop_assert_eq!(StoredResponse::decode(&decoded.encode()), Some(decoded));
                }
                Ok(())
            });
        }

        #[test]
        fn a_spoilt_record_never_panics_and_a_cut_one_is_refused() {
            check(512, (response(), spoiling()), |(response, how)| {
                let encoded = response.encode();
                let (choice, at, count, extra) = how;
                let spoilt = spoil(&encoded, choice, at, count, &extra);
                let decoded = StoredResponse::decode(&spoilt);
                let cut = spoilt.len() < encoded.len() && encoded.starts_with(&spoilt);
                let extended = spoilt.len() > encoded.len() && spoilt.starts_with(&encoded);
                if cut || extended {
                    prop_assert_eq!(decoded, None);
                }
                Ok(())
            });
        }

        #[test]
        fn a_stored_state_names_a_status_only_for_a_record_that_decodes() {
            use crate::store::IdempotencyState;
            use std::time::Duration;
            check(512, bytes(128), |record| {
                let status = StoredResponse::decode(&record).map(|r| r.status);
                let state = IdempotencyState::Completed {
                    response: Bytes::from(record),
                    retention_left: Duration::from_secs(1),
                    age: None,
                };
                prop_assert_eq!(state.response_status(), status);
                Ok(())
            });
        }
    }
}
