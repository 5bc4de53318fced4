//! Who a request counts against: key extractors and the hashed [`Key`].
//!
//! A [`KeyExtractor`] looks at a request's head and names the caller: the caller an
//! authentication layer verified and put in the request's extensions ([`Extension`]), one bucket
//! for everybody ([`Global`]), a header ([`Header`]), the peer address ([`PeerIp`]), or the
//! client address reported by trusted proxies ([`ForwardedIp`]). Any function
//! `Fn(&http::request::Parts) -> Option<impl AsRef<[u8]>>` is one too, under a domain of its own
//! ([`from_fn`]), and [`KeyExtractor::or`] chains two.
//!
//! # Whom to trust
//!
//! A limit is only as strong as its key. A header is whatever the client wrote: keyed by an
//! unchecked `x-api-key`, a client that sends a fresh value with every request is a fresh caller
//! every time. Key by [`Extension`] — the caller your authentication layer checked — and choose
//! a tier from the same place (a plan read from your table, never from a header), and keep
//! [`Header`] and the peer address for anonymous traffic, where the address is all there is
//! ([`ForwardedIp`] behind proxies you trust):
//!
//! ```
//! use tollgate::key::{self, KeyExtractor, PeerIp};
//! use tollgate::rate_limit::{Limit, RateLimitLayer};
//! use tollgate::store::MemoryStore;
//!
//! /// Inserted by the authentication layer once the credential checked out.
//! #[derive(Clone)]
//! struct Caller { tenant: String, plan: &'static str }
//!
//! impl AsRef<[u8]> for Caller {
//!     fn as_ref(&self) -> &[u8] { self.tenant.as_bytes() }
//! }
//!
//! let layer = RateLimitLayer::builder(MemoryStore::new())
//!     .limit(Limit::per_minute("minute", 10)) // anonymous callers
//!     .tier("pro", [Limit::per_minute("minute", 1_000)])
//!     .tier_by(|parts| Some(parts.extensions.get::<Caller>()?.plan))
//!     .key(key::Extension::<Caller>::new().or(PeerIp::new()))
//!     .build()
//!     .unwrap();
//! let mut request = http::Request::get("/").header("x-plan", "enterprise").body(()).unwrap();
//! request.extensions_mut().insert(Caller { tenant: "acme".into(), plan: "pro" });
//! let (parts, ()) = request.into_parts();
//! # tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(async {
//! let state = layer.peek_request(&parts).await.unwrap().unwrap();
//! assert_eq!(state.limits[0].remaining, 1_000, "the plan the caller has, not the one it names");
//! # });
//! ```
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
mod extension;
mod extract;
mod ip;
#[cfg(test)]
mod tests;

pub use digest::Key;
pub(crate) use digest::{BASE64, encode_base64url, write_base64};
pub use extension::Extension;
pub use extract::{BoxedKey, FromFn, Global, Header, KeyExtractor, MissingKey, Or, from_fn};
pub use ip::{Cidr, CidrError, ForwardedIp, PeerIp, peer_ip};
