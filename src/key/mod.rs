//! Who a request counts against: key extractors and the hashed [`Key`].
//!
//! A [`KeyExtractor`] looks at a request's head and names the caller: one bucket for everybody
//! ([`Global`]), a header such as an API key ([`Header`]), the peer address ([`PeerIp`]), or the
//! client address reported by trusted proxies ([`ForwardedIp`]). Any function
//! `Fn(&http::request::Parts) -> Option<impl AsRef<[u8]>>` is one too, under a domain of its own
//! ([`from_fn`]), and [`KeyExtractor::or`] chains two.
//!
//! What an extractor returns is never stored as it came: [`Key`] is a 128-bit SHA-256 digest of the
//! extractor's domain and the value. So `{`, `}`, `*`, newlines or 4 KB header values cannot escape
//! the namespace, select another hash slot or bloat Redis, and API keys are not readable in the store.
//! The domain (for example `header:x-api-key` or `ip`) keeps a header whose value happens to be
//! somebody's IP address from sharing that address's bucket.
//!
//! ```
//! use tollgate::key::{Header, KeyExtractor, PeerIp};
//!
//! let by_api_key_else_ip = Header::from_static("x-api-key").or(PeerIp::new());
//! let (parts, ()) = http::Request::get("/").header("x-api-key", "k-1").body(()).unwrap().into_parts();
//! let key = by_api_key_else_ip.extract(&parts).unwrap();
//! assert_eq!(key, Header::from_static("x-api-key").extract(&parts).unwrap());
//! assert_ne!(key, tollgate::key::Key::new("header:x-api-key", b"k-2"));
//! ```

mod digest;
mod extract;
mod ip;
#[cfg(test)]
mod tests;

pub use digest::Key;
pub(crate) use digest::{BASE64, encode_base64url, write_base64};
pub use extract::{BoxedKey, FromFn, Global, Header, KeyExtractor, MissingKey, Or, from_fn};
pub use ip::{Cidr, CidrError, ForwardedIp, PeerIp, peer_ip};
