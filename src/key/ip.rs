//! Callers by address: [`PeerIp`], and [`ForwardedIp`] behind trusted proxies.

use std::fmt;
use std::net::{IpAddr, SocketAddr};
use std::str::FromStr;

use http::HeaderName;
use http::request::Parts;

use super::{Key, KeyExtractor};

/// How addresses are grouped into callers: one key per network of these prefix lengths.
///
/// A client usually holds a whole IPv6 /64 and can send every request from another address in
/// it; keyed per address it would get a fresh bucket each time. So IPv6 addresses count by their
/// /64 and IPv4 addresses by themselves (/32) unless configured otherwise; an IPv4-mapped IPv6
/// address counts as the IPv4 address it carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Networks {
    v4: u8,
    v6: u8,
}

/// `ipv6_prefix` and `ipv4_prefix` of an extractor that counts its `$who` by networks
/// (`self.networks`).
macro_rules! network_setters {
    ($who:literal) => {
        #[doc = concat!("Counts IPv6 ", $who, " by networks of `bits` leading bits (default 64; at most 128).")]
        pub fn ipv6_prefix(mut self, bits: u8) -> Self {
            self.networks = self.networks.ipv6(bits);
            self
        }

        #[doc = concat!("Counts IPv4 ", $who, " by networks of `bits` leading bits (default 32; at most 32).")]
        pub fn ipv4_prefix(mut self, bits: u8) -> Self {
            self.networks = self.networks.ipv4(bits);
            self
        }
    };
}

impl Default for Networks {
    fn default() -> Self {
        Self { v4: 32, v6: 64 }
    }
}

impl Networks {
    /// IPv6 by networks of `bits` leading bits, at most 128.
    fn ipv6(self, bits: u8) -> Self {
        Self {
            v6: bits.min(128),
            ..self
        }
    }

    /// IPv4 by networks of `bits` leading bits, at most 32.
    fn ipv4(self, bits: u8) -> Self {
        Self {
            v4: bits.min(32),
            ..self
        }
    }

    /// The key of `ip`'s network: its address masked to the prefix, and the prefix, hashed.
    fn key(self, ip: IpAddr) -> Key {
        let mut material = [0u8; 18];
        let len = match canonical(ip) {
            IpAddr::V4(v4) => {
                let masked = mask(u128::from(u32::from(v4)), self.v4, 32) as u32;
                material[..2].copy_from_slice(&[4, self.v4]);
                material[2..6].copy_from_slice(&masked.to_be_bytes());
                6
            }
            IpAddr::V6(v6) => {
                let masked = mask(u128::from(v6), self.v6, 128);
                material[..2].copy_from_slice(&[6, self.v6]);
                material[2..].copy_from_slice(&masked.to_be_bytes());
                18
            }
        };
        Key::new("ip", &material[..len])
    }
}

/// `bits` with all but the `prefix` leading ones of `width` cleared.
fn mask(bits: u128, prefix: u8, width: u8) -> u128 {
    match prefix.min(width) {
        0 => 0,
        p => bits >> (width - p) << (width - p),
    }
}

/// The address of the connection's peer, by network (IPv6 /64 and IPv4 /32 by default: see
/// [`ipv6_prefix`](Self::ipv6_prefix)).
///
/// Read from the request extensions: a [`SocketAddr`] or [`IpAddr`] that the server inserted (hyper
/// users do this in their `service_fn`), or, with the `axum` feature, axum's
/// `ConnectInfo<SocketAddr>` (serve with `into_make_service_with_connect_info::<SocketAddr>()`).
/// Behind a proxy this is the proxy's address: use [`ForwardedIp`] there.
///
/// ```
/// use std::net::SocketAddr;
/// use tollgate::key::{KeyExtractor, PeerIp};
///
/// let from = |addr: &str| {
///     let mut req = http::Request::get("/").body(()).unwrap();
///     req.extensions_mut().insert(addr.parse::<SocketAddr>().unwrap());
///     PeerIp::new().extract(&req.into_parts().0)
/// };
/// // one /64, one caller, whatever address of it a request comes from
/// assert_eq!(from("[2001:db8:0:1::1]:443"), from("[2001:db8:0:1:ffff::2]:443"));
/// assert_ne!(from("[2001:db8:0:1::1]:443"), from("[2001:db8:0:2::1]:443"));
/// ```
#[derive(Debug, Clone, Copy, Default)]
pub struct PeerIp {
    networks: Networks,
}

impl PeerIp {
    /// The peer-address extractor: IPv6 by /64, IPv4 by /32.
    pub fn new() -> Self {
        Self::default()
    }

    network_setters!("peers");
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

impl KeyExtractor for PeerIp {
    fn extract(&self, parts: &Parts) -> Option<Key> {
        peer_ip(parts).map(|ip| self.networks.key(ip))
    }

    fn describe(&self) -> String {
        String::from("the peer address")
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
/// clients are ignored. With no peer address known, the request has no key. At most
/// [`max_hops`](Self::max_hops) hops (default 20) are walked: a longer chain of trusted hops
/// ends at the last one walked. The client is keyed by network, as [`PeerIp`] keys peers.
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
    networks: Networks,
    max_hops: usize,
}

impl ForwardedIp {
    /// Trusts the proxies in `cidrs` and reads `X-Forwarded-For`; fails on the first CIDR that
    /// does not parse.
    pub fn trusting<I, S>(cidrs: I) -> Result<Self, CidrError>
    where
        I: IntoIterator<Item = S>,
        S: AsRef<str>,
    {
        let trusted: Vec<Cidr> = cidrs
            .into_iter()
            .map(|c| c.as_ref().parse())
            .collect::<Result<_, _>>()?;
        Ok(Self::new(trusted))
    }

    /// Trusts the proxies in the networks `trusted` (none: every peer is the client itself) and
    /// reads `X-Forwarded-For`.
    pub fn new(trusted: impl IntoIterator<Item = Cidr>) -> Self {
        Self {
            trusted: trusted.into_iter().collect(),
            rfc7239: false,
            networks: Networks::default(),
            max_hops: 20,
        }
    }

    /// Reads the RFC 7239 `Forwarded` header instead of `X-Forwarded-For`.
    pub fn use_forwarded_header(mut self) -> Self {
        self.rfc7239 = true;
        self
    }

    /// Walks at most `hops` hops of the chain from the right (default 20): a chain that an
    /// attacker pads with thousands of entries costs no more than that.
    pub fn max_hops(mut self, hops: usize) -> Self {
        self.max_hops = hops;
        self
    }

    network_setters!("clients");

    fn is_trusted(&self, ip: IpAddr) -> bool {
        self.trusted.iter().any(|net| net.contains(ip))
    }

    /// The hops of the chain from the right, at most [`max_hops`](Self::max_hops) of them;
    /// `None` for a hop that is not an address.
    fn hops_from_the_right<'a>(
        &self,
        parts: &'a Parts,
    ) -> impl Iterator<Item = Option<IpAddr>> + 'a {
        let (name, hop): (_, fn(&str) -> Option<IpAddr>) = if self.rfc7239 {
            (http::header::FORWARDED, forwarded_for)
        } else {
            (HeaderName::from_static("x-forwarded-for"), |s: &str| {
                parse_ip(s.trim())
            })
        };
        // a header repeated is one list, in order: the last value holds the right-most hops
        let values: Vec<_> = parts.headers.get_all(name).iter().collect();
        values
            .into_iter()
            .rev()
            .flat_map(|value| value.as_bytes().rsplit(|&b| b == b','))
            // a hop that is not text is a hop that is not an address
            .map(move |part| std::str::from_utf8(part).ok().and_then(hop))
            .take(self.max_hops)
    }

    /// The client address of the request, as this extractor determines it.
    pub fn client_ip(&self, parts: &Parts) -> Option<IpAddr> {
        let peer = peer_ip(parts)?;
        if !self.is_trusted(peer) {
            return Some(peer);
        }
        let mut client = peer;
        for hop in self.hops_from_the_right(parts) {
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
        self.client_ip(parts).map(|ip| self.networks.key(ip))
    }

    fn describe(&self) -> String {
        String::from("the client address forwarded by a trusted proxy")
    }
}
