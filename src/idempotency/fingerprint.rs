//! The request fingerprint: what makes "the same request" under one idempotency key.

use http::HeaderName;
use http::request::Parts;
use sha2::{Digest, Sha256};

use crate::key::encode_base64url;

/// SHA-256 over the method, path and query, the chosen headers (name, the number of values, and
/// every value, in order) and the body, each length-prefixed so that no two requests' fields run
/// together — nor one header's values into the next header; 43 characters of base64url.
pub(crate) fn fingerprint(parts: &Parts, headers: &[HeaderName], body: &[u8]) -> String {
    let mut hasher = Sha256::new();
    let mut field = |bytes: &[u8]| {
        hasher.update((bytes.len() as u64).to_be_bytes());
        hasher.update(bytes);
    };
    field(parts.method.as_str().as_bytes());
    field(
        parts
            .uri
            .path_and_query()
            .map_or("/", |pq| pq.as_str())
            .as_bytes(),
    );
    for name in headers {
        field(name.as_str().as_bytes());
        let values = parts.headers.get_all(name);
        field(&(values.iter().count() as u64).to_be_bytes());
        for value in values {
            field(value.as_bytes());
        }
    }
    field(body);
    encode_base64url(&hasher.finalize())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parts(method: &str, uri: &str, headers: &[(&str, &str)]) -> Parts {
        let mut b = http::Request::builder().method(method).uri(uri);
        for (k, v) in headers {
            b = b.header(*k, *v);
        }
        b.body(()).unwrap().into_parts().0
    }

    #[test]
    fn every_field_counts() {
        let none: &[HeaderName] = &[];
        let base = fingerprint(&parts("POST", "/a?x=1", &[]), none, b"{}");
        assert_eq!(base.len(), 43);
        assert_eq!(
            base,
            fingerprint(&parts("POST", "/a?x=1", &[("x-other", "1")]), none, b"{}")
        );
        assert_ne!(
            base,
            fingerprint(&parts("PATCH", "/a?x=1", &[]), none, b"{}")
        );
        assert_ne!(
            base,
            fingerprint(&parts("POST", "/a?x=2", &[]), none, b"{}")
        );
        assert_ne!(
            base,
            fingerprint(&parts("POST", "/a?x=1", &[]), none, b"{ }")
        );
        // a value of one header cannot pass for the name of the next: the count is encoded
        let two = [
            HeaderName::from_static("content-type"),
            HeaderName::from_static("x-tenant"),
        ];
        assert_ne!(
            fingerprint(
                &parts("POST", "/a", &[("content-type", "x-tenant")]),
                &two,
                b""
            ),
            fingerprint(&parts("POST", "/a", &[("x-tenant", "x-tenant")]), &two, b"")
        );
        let ct = [HeaderName::from_static("content-type")];
        assert_ne!(
            fingerprint(&parts("POST", "/a", &[("content-type", "a/b")]), &ct, b""),
            fingerprint(&parts("POST", "/a", &[("content-type", "a/c")]), &ct, b"")
        );
    }
}
