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
}
