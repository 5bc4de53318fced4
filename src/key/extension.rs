//! [`Extension`]: the caller an authentication layer put in the request's extensions.

use std::fmt;
use std::marker::PhantomData;

use http::request::Parts;

use super::{Key, KeyExtractor};

/// Keys a request by a value of type `T` in its extensions — the caller an authentication layer
/// verified and inserted (`request.extensions_mut().insert(caller)`) — rather than by anything
/// the client wrote itself.
///
/// `T`'s bytes ([`AsRef<[u8]>`]) name the caller: an account or tenant id, say; they are hashed
/// within this extractor's domain (`ext:` and the name given to [`named`](Self::named)), so they
/// never meet a header's or an IP address's equal bytes in one bucket. A request without a `T`,
/// or whose `T` has no bytes, has no key: the layer answers as its
/// [`MissingKey`](super::MissingKey) setting says (a `401` with
/// `MissingKey::RejectWith(StatusCode::UNAUTHORIZED)`), or a chained extractor
/// ([`KeyExtractor::or`]) takes over — the peer address for anonymous traffic, for instance.
///
/// Clients are told only that the key is "the authenticated caller".
///
/// ```
/// use tollgate::key::{self, KeyExtractor, PeerIp};
///
/// /// What the authentication layer inserts once it has checked a credential.
/// #[derive(Clone)]
/// struct Caller { tenant: String }
///
/// impl AsRef<[u8]> for Caller {
///     fn as_ref(&self) -> &[u8] { self.tenant.as_bytes() }
/// }
///
/// let by_caller = key::Extension::<Caller>::new();
/// let mut request = http::Request::get("/").body(()).unwrap();
/// request.extensions_mut().insert(Caller { tenant: "acme".into() });
/// let (parts, ()) = request.into_parts();
/// assert_eq!(by_caller.extract(&parts), Some(by_caller.key(&Caller { tenant: "acme".into() })));
/// assert_eq!(by_caller.describe(), "the authenticated caller");
///
/// // a request no authentication layer vouched for has no caller: here its peer address counts
/// let anonymous = http::Request::get("/").body(()).unwrap().into_parts().0;
/// assert_eq!(by_caller.extract(&anonymous), None);
/// assert_eq!(by_caller.or(PeerIp::new()).extract(&anonymous), None, "no peer address either");
/// ```
pub struct Extension<T> {
    domain: String,
    // `fn() -> T`: the extractor holds no `T`, so it is `Send`, `Sync` and `Clone` whatever `T` is
    caller: PhantomData<fn() -> T>,
}

impl<T> Extension<T>
where
    T: AsRef<[u8]> + Send + Sync + 'static,
{
    /// Keys requests by their `T` extension, under the domain `ext:`.
    pub fn new() -> Self {
        Self::named("")
    }

    /// Keys requests by their `T` extension, under the domain `ext:<name>`: two extension
    /// extractors chained with [`KeyExtractor::or`] (a user, else the user's organisation) need
    /// names of their own, so that equal ids of different kinds stay different callers.
    pub fn named(name: &str) -> Self {
        Self {
            domain: format!("ext:{name}"),
            caller: PhantomData,
        }
    }

    /// The key of a request whose extension is `caller`, as [`extract`](KeyExtractor::extract)
    /// finds it: to [`peek`](crate::rate_limit::RateLimitLayer::peek) at or
    /// [`reset`](crate::rate_limit::RateLimitLayer::reset) a known caller.
    pub fn key(&self, caller: &T) -> Key {
        Key::new(&self.domain, caller.as_ref())
    }
}

impl<T> KeyExtractor for Extension<T>
where
    T: AsRef<[u8]> + Send + Sync + 'static,
{
    fn extract(&self, parts: &Parts) -> Option<Key> {
        let caller = parts.extensions.get::<T>()?.as_ref();
        (!caller.is_empty()).then(|| Key::new(&self.domain, caller))
    }

    /// "the authenticated caller": the type and the domain are the service's own business.
    fn describe(&self) -> String {
        String::from("the authenticated caller")
    }
}

impl<T> Default for Extension<T>
where
    T: AsRef<[u8]> + Send + Sync + 'static,
{
    fn default() -> Self {
        Self::new()
    }
}

impl<T> Clone for Extension<T> {
    fn clone(&self) -> Self {
        Self {
            domain: self.domain.clone(),
            caller: PhantomData,
        }
    }
}

impl<T> fmt::Debug for Extension<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Extension")
            .field("domain", &self.domain)
            .finish()
    }
}
