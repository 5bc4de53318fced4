//! Parsing the `Idempotency-Key` header: an sf-string (`"..."`, RFC 9651) or a bare token.

use http::HeaderValue;

/// The longest key accepted, in characters.
pub(crate) const MAX_KEY_LEN: usize = 255;

/// Why a key was refused; the text goes into the 400 response.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum KeyProblem {
    Missing,
    Repeated,
    Empty,
    TooLong,
    NotVisibleAscii,
    BadString,
}

impl KeyProblem {
    /// The sentence for the client, naming the key's header `header` as the layer reads it.
    pub(crate) fn message(self, header: &str) -> String {
        match self {
            Self::Missing => format!("the {header} header is required"),
            Self::Repeated => format!("send one {header} header, not several"),
            Self::Empty => format!("the {header} is empty"),
            Self::TooLong => format!("the {header} is longer than 255 characters"),
            Self::NotVisibleAscii => format!("the {header} must be visible ASCII"),
            Self::BadString => format!("the {header} is a malformed quoted string"),
        }
    }
}

/// How the messages name the key's header `name`: the standard one as the draft spells it,
/// `Idempotency-Key`; another as configured.
pub(crate) fn label(name: &http::HeaderName) -> &str {
    if name == "idempotency-key" {
        "Idempotency-Key"
    } else {
        name.as_str()
    }
}

/// The key named by one header value. `"abc"` and `abc` name the same key `abc`; in the quoted
/// form `\"` and `\\` stand for `"` and `\`.
pub(crate) fn parse(value: &HeaderValue) -> Result<String, KeyProblem> {
    let bytes = value.as_bytes();
    let key = match bytes {
        [b'"', inner @ .., b'"'] => unquote(inner)?,
        [b'"', ..] => return Err(KeyProblem::BadString),
        _ => {
            if !bytes.iter().all(|b| (0x21..=0x7e).contains(b)) {
                return Err(KeyProblem::NotVisibleAscii);
            }
            // visible ASCII is valid UTF-8
            String::from_utf8_lossy(bytes).into_owned()
        }
    };
    if key.is_empty() {
        return Err(KeyProblem::Empty);
    }
    if key.len() > MAX_KEY_LEN {
        return Err(KeyProblem::TooLong);
    }
    Ok(key)
}

fn unquote(inner: &[u8]) -> Result<String, KeyProblem> {
    let mut out = String::with_capacity(inner.len());
    let mut chars = inner.iter();
    while let Some(&b) = chars.next() {
        match b {
            b'\\' => match chars.next() {
                Some(&escaped @ (b'"' | b'\\')) => out.push(char::from(escaped)),
                _ => return Err(KeyProblem::BadString),
            },
            b'"' => return Err(KeyProblem::BadString),
            0x20..=0x7e => out.push(char::from(b)),
            _ => return Err(KeyProblem::NotVisibleAscii),
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(s: &[u8]) -> Result<String, KeyProblem> {
        parse(&HeaderValue::from_bytes(s).unwrap())
    }

    #[test]
    fn bare_and_quoted_forms_name_the_same_key() {
        assert_eq!(p(b"abc-123").unwrap(), "abc-123");
        assert_eq!(p(b"\"abc-123\"").unwrap(), "abc-123");
        assert_eq!(p(b"\"a \\\"b\\\\\"").unwrap(), "a \"b\\");
    }

    #[test]
    fn malformed_keys_are_refused_with_a_reason() {
        assert_eq!(p(b""), Err(KeyProblem::Empty));
        assert_eq!(p(b"\"\""), Err(KeyProblem::Empty));
        assert_eq!(p(b"a b"), Err(KeyProblem::NotVisibleAscii));
        assert_eq!(p(b"caf\xc3\xa9"), Err(KeyProblem::NotVisibleAscii));
        assert_eq!(p(b"\"abc"), Err(KeyProblem::BadString));
        assert_eq!(p(b"\"a\"b\""), Err(KeyProblem::BadString));
        assert_eq!(p(b"\"a\\x\""), Err(KeyProblem::BadString));
        assert_eq!(p(&[b'k'; 256]), Err(KeyProblem::TooLong));
        assert_eq!(p(&[b'k'; 255]).unwrap().len(), 255);
    }

    mod properties {
        use proptest::prelude::*;

        use super::*;
        use crate::fuzz::check;

        /// The bytes a header value may hold: visible ASCII, space, tab and obs-text, with
        /// quotes and backslashes more often than by chance.
        fn value_bytes(max: usize) -> impl Strategy<Value = Vec<u8>> {
            let allowed = |b: u8| match b {
                0x00..=0x03 => b'"',
                0x04..=0x07 => b'\\',
                0x08..=0x1f if b != b'\t' => b + 0x20,
                0x7f => b' ',
                b => b,
            };
            crate::fuzz::bytes(max).prop_map(move |bytes| bytes.into_iter().map(allowed).collect())
        }

        /// A key of `1..=max` characters of visible ASCII or space.
        fn key(max: usize) -> impl Strategy<Value = String> {
            prop::collection::vec(0x20u8..0x7f, 1..=max)
                .prop_map(|bytes| bytes.into_iter().map(char::from).collect())
        }

        fn quoted(key: &str) -> Vec<u8> {
            let mut out = vec![b'"'];
            for b in key.bytes() {
                if b == b'"' || b == b'\\' {
                    out.push(b'\\');
                }
                out.push(b);
            }
            out.push(b'"');
            out
        }

        #[test]
        fn any_value_is_a_key_of_visible_ascii_or_refused() {
            check(1024, value_bytes(300), |bytes| {
                let Ok(value) = HeaderValue::from_bytes(&bytes) else {
                    return Ok(());
                };
                if let Ok(key) = parse(&value) {
                    prop_assert!(!key.is_empty() && key.len() <= MAX_KEY_LEN);
                    prop_assert!(key.bytes().all(|b| (0x20..=0x7e).contains(&b)));
                    // what was read is what the quoted form of the key says
                    let requoted = HeaderValue::from_bytes(&quoted(&key)).unwrap();
                    prop_assert_eq!(parse(&requoted), Ok(key));
                }
                Ok(())
            });
        }

        #[test]
        fn any_key_reads_back_from_its_quoted_and_bare_forms() {
            check(512, key(MAX_KEY_LEN), |key| {
                let value = HeaderValue::from_bytes(&quoted(&key)).unwrap();
                prop_assert_eq!(parse(&value), Ok(key.clone()));
                let bare = !key.starts_with('"') && !key.contains(' ');
                if bare {
                    let value = HeaderValue::from_str(&key).unwrap();
                    prop_assert_eq!(parse(&value), Ok(key));
                }
                Ok(())
            });
        }

        #[test]
        fn a_quoted_key_with_a_spoilt_tail_never_panics() {
            let case = (key(64), value_bytes(8), any::<usize>());
            check(512, case, |(key, tail, at)| {
                let mut bytes = quoted(&key);
                bytes.truncate(at % (bytes.len() + 1));
                bytes.extend_from_slice(&tail);
                if let Ok(value) = HeaderValue::from_bytes(&bytes) {
                    let _ = parse(&value);
                }
                Ok(())
            });
        }
    }
}
