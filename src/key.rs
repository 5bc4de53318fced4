//! Who a request counts against: key extractors and the hashed [`Key`].
//!
//! A [`KeyExtractor`] looks at a request's head and names the caller: one bucket for everybody
//! ([`Global`]), a header such as an API key ([`Header`]), the peer address ([`PeerIp`]), or the
//! client address reported by trusted proxies ([`ForwardedIp`]). Any closure
//! `Fn(&http::request::Parts) -> Option<impl AsRef<[u8]>>` is an extractor too, and
//! [`KeyExtractor::or`] chains two.
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

use std::fmt;
use std::net::{IpAddr, SocketAddr};
use std::str::FromStr;

use http::HeaderName;
use http::request::Parts;
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
}

/// Unpadded base64url of `bytes`.
pub(crate) fn encode_base64url(bytes: &[u8]) -> String {
    let mut out = String::with_capacity(bytes.len().div_ceil(3) * 4);
    write_base64url(bytes, &mut out);
    out
}

fn write_base64url(bytes: &[u8], out: &mut String) {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_";
    for chunk in bytes.chunks(3) {
        let at = |i: usize| u32::from(chunk.get(i).copied().unwrap_or(0));
        let n = (at(0) << 16) | (at(1) << 8) | at(2);
        for i in 0..=chunk.len() {
            out.push(char::from(ALPHABET[((n >> (18 - 6 * i)) & 0x3f) as usize]));
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

/// Names the caller a request counts against.
///
/// Returns `None` when the request carries no such identity (a missing header, no peer address);
/// the layer then answers as its missing-key setting says. Implemented for every
/// `Fn(&Parts) -> Option<T>` with `T: AsRef<[u8]>` (the closure's domain is `"fn"`).
pub trait KeyExtractor: Send + Sync + 'static {
    /// The key of this request, if it has one.
    fn extract(&self, parts: &Parts) -> Option<Key>;

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
}

impl<F, T> KeyExtractor for F
where
    F: Fn(&Parts) -> Option<T> + Send + Sync + 'static,
    T: AsRef<[u8]>,
{
    fn extract(&self, parts: &Parts) -> Option<Key> {
        self(parts).map(|value| Key::new("fn", value.as_ref()))
    }
}

/// One bucket shared by every request.
#[derive(Debug, Clone, Copy, Default)]
pub struct Global;

impl KeyExtractor for Global {
    fn extract(&self, _parts: &Parts) -> Option<Key> {
        Some(Key::new("global", b""))
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

impl KeyExtractor for Header {
    fn extract(&self, parts: &Parts) -> Option<Key> {
        let value = parts.headers.get(&self.name)?.as_bytes();
        (!value.is_empty()).then(|| Key::new(&self.domain, value))
    }
}

/// The address of the connection's peer.
///
/// Read from the request extensions: a [`SocketAddr`] or [`IpAddr`] that the server inserted (hyper
/// users do this in their `service_fn`), or, with the `axum` feature, axum's
/// `ConnectInfo<SocketAddr>` (serve with `into_make_service_with_connect_info::<SocketAddr>()`).
/// Behind a proxy this is the proxy's address: use [`ForwardedIp`] there.
#[derive(Debug, Clone, Copy, Default)]
pub struct PeerIp {
    _priv: (),
}

impl PeerIp {
    /// The peer-address extractor.
    pub fn new() -> Self {
        Self::default()
    }
}

/// The peer address of a request, as [`PeerIp`] finds it.
pub fn peer_ip(parts: &Parts) -> Option<IpAddr> {
    #[cfg(feature = "axum")]
    if let Some(info) = parts
        .extensions
        .get::<axum::extract::ConnectInfo<SocketAddr>>()
    {
        return Some(canonical(info.0.ip()));
    }
    if let Some(addr) = parts.extensions.get::<SocketAddr>() {
        return Some(canonical(addr.ip()));
    }
    parts.extensions.get::<IpAddr>().map(|ip| canonical(*ip))
}

/// IPv4-mapped IPv6 addresses count as the IPv4 address they carry.
fn canonical(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(ip, IpAddr::V4),
        v4 => v4,
    }
}

fn ip_key(ip: IpAddr) -> Key {
    match ip {
        IpAddr::V4(v4) => Key::new("ip", &v4.octets()),
        IpAddr::V6(v6) => Key::new("ip", &v6.octets()),
    }
}

impl KeyExtractor for PeerIp {
    fn extract(&self, parts: &Parts) -> Option<Key> {
        peer_ip(parts).map(ip_key)
    }
}

/// A network in CIDR notation, e.g. `10.0.0.0/8` or `::1/128`; a bare address is a /32 or /128.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Cidr {
    addr: IpAddr,
    prefix: u8,
}

/// A CIDR that does not parse.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CidrError(String);

impl fmt::Display for CidrError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "invalid CIDR {:?}", self.0)
    }
}

impl std::error::Error for CidrError {}

impl FromStr for Cidr {
    type Err = CidrError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let err = || CidrError(s.to_owned());
        let (addr, prefix) = match s.split_once('/') {
            Some((addr, prefix)) => (addr, Some(prefix)),
            None => (s, None),
        };
        let addr = canonical(IpAddr::from_str(addr.trim()).map_err(|_| err())?);
        let max = if addr.is_ipv4() { 32 } else { 128 };
        let prefix = match prefix {
            Some(p) => p.trim().parse::<u8>().map_err(|_| err())?,
            None => max,
        };
        if prefix > max {
            return Err(err());
        }
        Ok(Self { addr, prefix })
    }
}

impl Cidr {
    /// Whether `ip` lies in this network.
    pub fn contains(&self, ip: IpAddr) -> bool {
        fn masked(bits: u128, prefix: u8, width: u8) -> u128 {
            if prefix == 0 {
                0
            } else {
                bits >> (width - prefix)
            }
        }
        match (self.addr, canonical(ip)) {
            (IpAddr::V4(net), IpAddr::V4(ip)) => {
                masked(u32::from(net).into(), self.prefix, 32)
                    == masked(u32::from(ip).into(), self.prefix, 32)
            }
            (IpAddr::V6(net), IpAddr::V6(ip)) => {
                masked(u128::from(net), self.prefix, 128)
                    == masked(u128::from(ip), self.prefix, 128)
            }
            _ => false,
        }
    }
}

/// The client address as reported by trusted proxies.
///
/// When the peer is one of the trusted proxies, the `X-Forwarded-For` chain (or, with
/// [`use_forwarded_header`](Self::use_forwarded_header), the RFC 7239 `Forwarded` chain's `for=`
/// values) is read from the right, skipping trusted proxies, and the first untrusted address is
/// the client. The left-most entry is never believed just for being first: a client can write
/// anything there. A hop that is not an address (`unknown`, an obfuscated name, junk) ends the
/// walk: nobody trusted vouches for what lies left of it, so the request is keyed by the last
/// trusted hop. A peer outside the trusted set is itself the client, so headers sent directly by
/// clients are ignored. With no peer address known, the request has no key.
///
/// Read only the header your proxies write: a proxy that appends to `X-Forwarded-For` passes a
/// client's own `Forwarded` header on untouched, and the other way round.
///
/// ```
/// use std::net::SocketAddr;
/// use tollgate::key::{ForwardedIp, KeyExtractor, PeerIp};
///
/// let xff = ForwardedIp::trusting(["10.0.0.0/8"]).unwrap();
/// let mut req = http::Request::get("/")
///     .header("x-forwarded-for", "6.6.6.6, 203.0.113.7, 10.0.0.2")
///     .body(())
///     .unwrap();
/// req.extensions_mut().insert("10.0.0.1:4000".parse::<SocketAddr>().unwrap());
/// let (parts, ()) = req.into_parts();
///
/// let mut direct = http::Request::get("/").body(()).unwrap();
/// direct.extensions_mut().insert("203.0.113.7:5000".parse::<SocketAddr>().unwrap());
/// let (direct, ()) = direct.into_parts();
/// // the right-most untrusted hop, 203.0.113.7, is the client; 6.6.6.6 was made up by it
/// assert_eq!(xff.extract(&parts), PeerIp::new().extract(&direct));
/// ```
#[derive(Debug, Clone)]
pub struct ForwardedIp {
    trusted: Vec<Cidr>,
    rfc7239: bool,
}

impl ForwardedIp {
    /// Trusts the proxies in `cidrs` and reads `X-Forwarded-For`; fails on the first CIDR that
    /// does not parse.
    pub fn trusting<I, S>(cidrs: I) -> Result<Self, CidrError>
    where
        I: IntoIterator<Item = S>,
        S: AsRef<str>,
    {
        let trusted = cidrs
            .into_iter()
            .map(|c| c.as_ref().parse())
            .collect::<Result<_, _>>()?;
        Ok(Self {
            trusted,
            rfc7239: false,
        })
    }

    /// Reads the RFC 7239 `Forwarded` header instead of `X-Forwarded-For`.
    pub fn use_forwarded_header(mut self) -> Self {
        self.rfc7239 = true;
        self
    }

    fn is_trusted(&self, ip: IpAddr) -> bool {
        self.trusted.iter().any(|net| net.contains(ip))
    }

    /// The hops of the chain, left to right; `None` for a hop that is not an address.
    fn chain(&self, parts: &Parts) -> Vec<Option<IpAddr>> {
        let (name, hop): (_, fn(&str) -> Option<IpAddr>) = if self.rfc7239 {
            (http::header::FORWARDED, forwarded_for)
        } else {
            (HeaderName::from_static("x-forwarded-for"), |s: &str| {
                parse_ip(s.trim())
            })
        };
        parts
            .headers
            .get_all(name)
            .iter()
            .flat_map(|value| value.as_bytes().split(|&b| b == b','))
            // a hop that is not text is a hop that is not an address
            .map(|part| std::str::from_utf8(part).ok().and_then(hop))
            .collect()
    }

    /// The client address of the request, as this extractor determines it.
    pub fn client_ip(&self, parts: &Parts) -> Option<IpAddr> {
        let peer = peer_ip(parts)?;
        if !self.is_trusted(peer) {
            return Some(peer);
        }
        let mut client = peer;
        for hop in self.chain(parts).into_iter().rev() {
            let Some(hop) = hop else { break };
            client = hop;
            if !self.is_trusted(hop) {
                break;
            }
        }
        Some(client)
    }
}

/// The address in one `Forwarded` element's `for=` parameter; `None` when it has none or it is
/// `unknown` or an obfuscated name.
fn forwarded_for(element: &str) -> Option<IpAddr> {
    element.split(';').find_map(|pair| {
        let (name, value) = pair.trim().split_once('=')?;
        name.trim()
            .eq_ignore_ascii_case("for")
            .then(|| parse_ip(value.trim().trim_matches('"')))?
    })
}

/// An IP address, optionally with a port, IPv6 optionally bracketed.
fn parse_ip(s: &str) -> Option<IpAddr> {
    if let Ok(ip) = IpAddr::from_str(s) {
        return Some(canonical(ip));
    }
    if let Ok(addr) = SocketAddr::from_str(s) {
        return Some(canonical(addr.ip()));
    }
    let inner = s.strip_prefix('[')?.split(']').next()?;
    IpAddr::from_str(inner).ok().map(canonical)
}

impl KeyExtractor for ForwardedIp {
    fn extract(&self, parts: &Parts) -> Option<Key> {
        self.client_ip(parts).map(ip_key)
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
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parts_with(headers: &[(&str, &str)], peer: Option<&str>) -> Parts {
        let mut builder = http::Request::get("/");
        for (k, v) in headers {
            builder = builder.header(*k, *v);
        }
        let mut req = builder.body(()).unwrap();
        if let Some(peer) = peer {
            req.extensions_mut()
                .insert(SocketAddr::from_str(peer).unwrap());
        }
        req.into_parts().0
    }

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    #[test]
    fn encoding_is_22_url_safe_chars() {
        let key = Key::new("x", b"{}*\n");
        let s = key.to_string();
        assert_eq!(s.len(), 22);
        assert!(
            s.bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
        );
    }

    #[test]
    fn domains_separate_equal_values() {
        assert_ne!(Key::new("ip", b"1"), Key::new("header:x", b"1"));
        assert_ne!(Key::new("ab", b"c"), Key::new("a", b"bc"));
    }

    #[test]
    fn header_extractor_ignores_absent_and_empty() {
        let h = Header::new(HeaderName::from_static("x-api-key"));
        assert!(h.extract(&parts_with(&[], None)).is_none());
        assert!(h.extract(&parts_with(&[("x-api-key", "")], None)).is_none());
        assert_eq!(
            h.extract(&parts_with(&[("x-api-key", "a")], None)),
            Some(Key::new("header:x-api-key", b"a"))
        );
    }

    #[test]
    fn cidr_contains() {
        let net: Cidr = "10.0.0.0/8".parse().unwrap();
        assert!(net.contains(ip("10.255.0.1")));
        assert!(net.contains(ip("::ffff:10.1.2.3")));
        assert!(!net.contains(ip("11.0.0.1")));
        let all: Cidr = "0.0.0.0/0".parse().unwrap();
        assert!(all.contains(ip("8.8.8.8")));
        let v6: Cidr = "fd00::/8".parse().unwrap();
        assert!(v6.contains(ip("fd12::1")));
        assert!(!v6.contains(ip("fe80::1")));
        assert!("10.0.0.0/33".parse::<Cidr>().is_err());
        assert!("nonsense".parse::<Cidr>().is_err());
    }

    #[test]
    fn forwarded_ip_takes_rightmost_untrusted() {
        let x = ForwardedIp::trusting(["10.0.0.0/8"]).unwrap();
        let from_proxy = |xff: &str| parts_with(&[("x-forwarded-for", xff)], Some("10.0.0.1:1"));
        assert_eq!(
            x.client_ip(&from_proxy("1.1.1.1, 2.2.2.2")),
            Some(ip("2.2.2.2"))
        );
        assert_eq!(
            x.client_ip(&from_proxy("1.1.1.1, 2.2.2.2, 10.0.0.9")),
            Some(ip("2.2.2.2"))
        );
        // every hop trusted: the left-most is as far as the chain goes
        assert_eq!(
            x.client_ip(&from_proxy("10.0.0.3, 10.0.0.9")),
            Some(ip("10.0.0.3"))
        );
        // garbage in the chain: only the proxy itself is known
        assert_eq!(
            x.client_ip(&from_proxy("1.1.1.1, junk")),
            Some(ip("10.0.0.1"))
        );
        // a client that is not a trusted proxy cannot choose its key with the header
        let direct = parts_with(&[("x-forwarded-for", "9.9.9.9")], Some("5.5.5.5:1"));
        assert_eq!(x.client_ip(&direct), Some(ip("5.5.5.5")));
        assert_eq!(x.client_ip(&parts_with(&[], None)), None);
    }

    #[test]
    fn forwarded_header_is_read_when_chosen() {
        let x = ForwardedIp::trusting(["10.0.0.0/8"])
            .unwrap()
            .use_forwarded_header();
        let parts = parts_with(
            &[
                (
                    "forwarded",
                    "for=1.1.1.1;proto=https, for=\"[2001:db8::1]:443\"",
                ),
                ("x-forwarded-for", "3.3.3.3"),
            ],
            Some("10.0.0.1:1"),
        );
        assert_eq!(x.client_ip(&parts), Some(ip("2001:db8::1")));
        // an unknown hop added by the trusted proxy is never skipped over
        let hidden = parts_with(
            &[("forwarded", "for=6.6.6.6, for=unknown")],
            Some("10.0.0.1:1"),
        );
        assert_eq!(x.client_ip(&hidden), Some(ip("10.0.0.1")));
        // the other header is not read
        let xff_only = ForwardedIp::trusting(["10.0.0.0/8"]).unwrap();
        assert_eq!(xff_only.client_ip(&parts), Some(ip("3.3.3.3")));
    }

    #[test]
    fn closures_are_extractors() {
        let by_path = |p: &Parts| Some(p.uri.path().to_owned());
        assert_eq!(
            by_path.extract(&parts_with(&[], None)),
            Some(Key::new("fn", b"/"))
        );
    }
}
