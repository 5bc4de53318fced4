//! The stored form of a completed response: status, headers, body and trailers, byte for byte.
//!
//! Layout (all integers big-endian): version `1` (u8), status (u16), header count (u32), then per
//! header name length (u32), name, value length (u32), value; body length (u32), body; trailer
//! count (u32), then trailers as headers. Decoding checks every length and never panics.

use bytes::{BufMut, Bytes, BytesMut};
use http::{HeaderMap, HeaderName, HeaderValue, StatusCode};

const VERSION: u8 = 1;

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
    let mut headers = HeaderMap::with_capacity(count);
    for _ in 0..count {
        let name = HeaderName::from_bytes(take_field(input)?).ok()?;
        let value = HeaderValue::from_bytes(take_field(input)?).ok()?;
        headers.append(name, value);
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
}
