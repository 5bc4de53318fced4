//! [`KeyExtractor`] and the extractors that read a request's head: [`Global`], [`Header`],
//! functions ([`from_fn`]), and [`Or`].

use std::str::FromStr;

use http::HeaderName;
use http::request::Parts;

use super::Key;

/// Names the caller a request counts against.
///
/// Returns `None` when the request carries no such identity (a missing header, no peer address);
/// the layer then answers as its missing-key setting says. Any function of the request head is
/// one through [`from_fn`], under a domain of its own.
pub trait KeyExtractor: Send + Sync + 'static {
    /// The key of this request, if it has one.
    fn extract(&self, parts: &Parts) -> Option<Key>;

    /// Where the key comes from, for the client in a rejected request's message: `header
    /// x-api-key`, `the peer address`. It is sent to clients, so it names nothing internal; the
    /// default says only "the request".
    fn describe(&self) -> String {
        String::from("the request")
    }

    /// Uses `self`, or `other` where `self` finds nothing.
    fn or<O: KeyExtractor>(self, other: O) -> Or<Self, O>
    where
        Self: Sized,
    {
        Or {
            first: self,
            second: other,
        }
    }

    /// `self` behind a type that can be named: a layer keyed by a closure
    /// ([`from_fn`]) is a `RateLimitLayer<BoxedKey>`, to keep in application state or a
    /// struct field without naming the closure's type.
    ///
    /// ```
    /// use http::request::Parts;
    /// use tollgate::key::{BoxedKey, KeyExtractor, from_fn};
    /// use tollgate::rate::Limit;
    /// use tollgate::rate_limit::RateLimitLayer;
    /// use tollgate::store::MemoryStore;
    ///
    /// struct AppState {
    ///     per_tenant: RateLimitLayer<BoxedKey>,
    /// }
    ///
    /// let tenant = from_fn("tenant", |p: &Parts| p.headers.get("x-tenant").cloned());
    /// let state = AppState {
    ///     per_tenant: RateLimitLayer::builder(MemoryStore::new())
    ///         .limit(Limit::per_second("api", 10))
    ///         .key(tenant.clone().boxed())
    ///         .build()
    ///         .unwrap(),
    /// };
    /// let head = http::Request::get("/").header("x-tenant", "42").body(()).unwrap().into_parts().0;
    /// assert_eq!(state.per_tenant.key_of(&head), Some(tenant.key(b"42")));
    /// ```
    fn boxed(self) -> BoxedKey
    where
        Self: Sized,
    {
        BoxedKey(std::sync::Arc::new(self))
    }
}

/// Any extractor, behind a type that can be named; made by [`KeyExtractor::boxed`]. Clones share
/// the extractor.
#[derive(Clone)]
pub struct BoxedKey(std::sync::Arc<dyn KeyExtractor>);

impl KeyExtractor for BoxedKey {
    fn extract(&self, parts: &Parts) -> Option<Key> {
        self.0.extract(parts)
    }

    fn describe(&self) -> String {
        self.0.describe()
    }
}

impl std::fmt::Debug for BoxedKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("BoxedKey").field(&self.0.describe()).finish()
    }
}

/// A function of the request head as an extractor, its values hashed within `domain`: two
/// functions with different domains never share a bucket, even when they return the same value
/// for different callers (say, a tenant id and a user id, chained with [`KeyExtractor::or`]).
///
/// ```
/// use tollgate::key::{KeyExtractor, from_fn};
///
/// let tenant = from_fn("tenant", |p: &http::request::Parts| p.headers.get("x-tenant").map(|v| v.as_bytes().to_vec()));
/// let user = from_fn("user", |p: &http::request::Parts| p.headers.get("x-user").map(|v| v.as_bytes().to_vec()));
/// let head = |name, value| http::Request::get("/").header(name, value).body(()).unwrap().into_parts().0;
/// let by_tenant = tenant.or(user);
/// // tenant "42" and user "42" are two callers
/// assert_ne!(by_tenant.extract(&head("x-tenant", "42")), by_tenant.extract(&head("x-user", "42")));
/// ```
pub fn from_fn<F, T>(domain: impl Into<String>, f: F) -> FromFn<F>
where
    F: Fn(&Parts) -> Option<T> + Send + Sync + 'static,
    T: AsRef<[u8]>,
{
    FromFn {
        domain: format!("fn:{}", domain.into()),
        f,
    }
}

/// A function of the request head under a domain of its own; made by [`from_fn`].
#[derive(Clone)]
pub struct FromFn<F> {
    domain: String,
    f: F,
}

impl<F> FromFn<F> {
    /// The key of a request for which the function returns `value`, as
    /// [`extract`](KeyExtractor::extract) finds it: to
    /// [`peek`](crate::rate_limit::RateLimitLayer::peek) at or
    /// [`reset`](crate::rate_limit::RateLimitLayer::reset) a known caller.
    ///
    /// ```
    /// use tollgate::key::{KeyExtractor, from_fn};
    ///
    /// let tenant = from_fn("tenant", |p: &http::request::Parts| p.headers.get("x-tenant").map(|v| v.as_bytes().to_vec()));
    /// let head = http::Request::get("/").header("x-tenant", "42").body(()).unwrap().into_parts().0;
    /// assert_eq!(tenant.extract(&head), Some(tenant.key(b"42")));
    /// ```
    pub fn key(&self, value: &[u8]) -> Key {
        Key::new(&self.domain, value)
    }
}

impl<F> std::fmt::Debug for FromFn<F> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FromFn")
            .field("domain", &self.domain)
            .finish_non_exhaustive()
    }
}

impl<F, T> KeyExtractor for FromFn<F>
where
    F: Fn(&Parts) -> Option<T> + Send + Sync + 'static,
    T: AsRef<[u8]>,
{
    fn extract(&self, parts: &Parts) -> Option<Key> {
        (self.f)(parts).map(|value| Key::new(&self.domain, value.as_ref()))
    }

    /// "the request": the domain is the service's own name for the function, not the client's
    /// business.
    fn describe(&self) -> String {
        String::from("the request")
    }
}

/// One bucket shared by every request.
#[derive(Debug, Clone, Copy, Default)]
pub struct Global;

impl KeyExtractor for Global {
    fn extract(&self, _parts: &Parts) -> Option<Key> {
        Some(Key::new("global", b""))
    }

    fn describe(&self) -> String {
        String::from("one key shared by every request")
    }
}

/// The value of a request header, e.g. `x-api-key`. A header that is absent or empty yields no key.
#[derive(Debug, Clone)]
pub struct Header {
    name: HeaderName,
    domain: String,
}

impl Header {
    /// Keys requests by header `name`.
    pub fn new(name: HeaderName) -> Self {
        let domain = format!("header:{name}");
        Self { name, domain }
    }

    /// Keys requests by the header named by a constant, e.g. `Header::from_static("x-api-key")`.
    ///
    /// # Panics
    ///
    /// As [`HeaderName::from_static`]: when `name` is not a valid lowercase header name — a
    /// mistake in the program text, found the first time it runs. Use [`try_new`](Self::try_new)
    /// for names read at run time.
    pub fn from_static(name: &'static str) -> Self {
        Self::new(HeaderName::from_static(name))
    }

    /// Parses the header name first; `None` when it is not a valid header name.
    pub fn try_new(name: &str) -> Option<Self> {
        HeaderName::from_str(name).ok().map(Self::new)
    }
}

impl Header {
    /// The key of a request whose header holds `value`, as [`extract`](KeyExtractor::extract)
    /// finds it: to [`peek`](crate::rate_limit::RateLimitLayer::peek) at or
    /// [`reset`](crate::rate_limit::RateLimitLayer::reset) a known caller.
    pub fn key(&self, value: &[u8]) -> Key {
        Key::new(&self.domain, value)
    }
}

impl KeyExtractor for Header {
    fn extract(&self, parts: &Parts) -> Option<Key> {
        let value = parts.headers.get(&self.name)?.as_bytes();
        (!value.is_empty()).then(|| Key::new(&self.domain, value))
    }

    fn describe(&self) -> String {
        format!("header {}", self.name)
    }
}

/// Tries one extractor, then another: made by [`KeyExtractor::or`].
#[derive(Debug, Clone)]
pub struct Or<A, B> {
    first: A,
    second: B,
}

impl<A: KeyExtractor, B: KeyExtractor> KeyExtractor for Or<A, B> {
    fn extract(&self, parts: &Parts) -> Option<Key> {
        self.first
            .extract(parts)
            .or_else(|| self.second.extract(parts))
    }

    fn describe(&self) -> String {
        format!("{}, else {}", self.first.describe(), self.second.describe())
    }
}

/// What a layer (a rate limit, a concurrency limit) does with a request whose key cannot be
/// extracted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum MissingKey {
    /// Answer `400 Bad Request` with problem details naming where the key is read from (gRPC:
    /// INVALID_ARGUMENT).
    #[default]
    Reject,
    /// Answer with this status — `401 Unauthorized` where the key is the caller's credential —
    /// and the same problem details (gRPC: UNAUTHENTICATED for `401`, PERMISSION_DENIED for
    /// `403`, else INVALID_ARGUMENT).
    RejectWith(http::StatusCode),
    /// Let the request through unlimited.
    Allow,
}
