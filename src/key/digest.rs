//! [`Key`]: the digest a caller is stored by.

use std::fmt;

use sha2::{Digest, Sha256};

/// A caller's identity as stored: a 128-bit digest of an extractor domain and a value.
///
/// Two keys are equal exactly when their domain and value are equal (up to SHA-256 collisions).
/// Its [`Display`](fmt::Display) form is 22 characters of unpadded base64url, safe inside a Redis
/// key and a hash tag.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Key([u8; 16]);

impl Key {
    /// Hashes `value` within `domain`. The domain separates extractors: `Key::new("ip", b"1.2.3.4")`
    /// and `Key::new("header:x", b"1.2.3.4")` differ.
    pub fn new(domain: &str, value: &[u8]) -> Self {
        let mut hasher = Sha256::new();
        // Length-prefixing the domain makes (domain, value) pairs unambiguous.
        hasher.update((domain.len() as u64).to_be_bytes());
        hasher.update(domain.as_bytes());
        hasher.update(value);
        let digest = hasher.finalize();
        let mut out = [0u8; 16];
        out.copy_from_slice(&digest[..16]);
        Self(out)
    }

    /// The digest bytes.
    pub fn as_bytes(&self) -> &[u8; 16] {
        &self.0
    }

    /// Appends the 22-character base64url form to `out`.
    pub(crate) fn write_encoded(&self, out: &mut String) {
        write_base64url(&self.0, out);
    }

    /// The key whose [`write_encoded`](Self::write_encoded) form is `text`; `None` for any
    /// other text (wrong length, another alphabet, stray bits).
    pub(crate) fn from_encoded(text: &str) -> Option<Self> {
        let text = text.as_bytes();
        if text.len() != 22 {
            return None;
        }
        let (mut out, mut filled) = ([0u8; 16], 0);
        let (mut bits, mut held) = (0u32, 0u32);
        for &c in text {
            let value = BASE64URL.iter().position(|&a| a == c)?;
            bits = (bits << 6) | value as u32;
            held += 6;
            if held >= 8 {
                held -= 8;
                *out.get_mut(filled)? = (bits >> held) as u8;
                filled += 1;
                bits &= (1 << held) - 1;
            }
        }
        // 22 characters carry 132 bits: the last 4 are zero in the canonical form
        (filled == 16 && bits == 0).then_some(Self(out))
    }
}

/// Unpadded base64url of `bytes`.
pub(crate) fn encode_base64url(bytes: &[u8]) -> String {
    let mut out = String::with_capacity(bytes.len().div_ceil(3) * 4);
    write_base64url(bytes, &mut out);
    out
}

fn write_base64url(bytes: &[u8], out: &mut String) {
    write_base64(bytes, BASE64URL, out);
}

/// The base64url alphabet (RFC 4648 §5).
const BASE64URL: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_";
/// The standard base64 alphabet (RFC 4648 §4), as Structured Field Byte Sequences use it.
pub(crate) const BASE64: &[u8; 64] =
    b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

/// Unpadded base64 of `bytes` in `alphabet`, appended to `out`.
pub(crate) fn write_base64(bytes: &[u8], alphabet: &[u8; 64], out: &mut String) {
    for chunk in bytes.chunks(3) {
        let at = |i: usize| u32::from(chunk.get(i).copied().unwrap_or(0));
        let n = (at(0) << 16) | (at(1) << 8) | at(2);
        for i in 0..=chunk.len() {
            out.push(char::from(alphabet[((n >> (18 - 6 * i)) & 0x3f) as usize]));
        }
    }
}

impl fmt::Display for Key {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut s = String::with_capacity(22);
        self.write_encoded(&mut s);
        f.write_str(&s)
    }
}

impl fmt::Debug for Key {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Key({self})")
    }
}
