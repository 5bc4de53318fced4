//! Unit tests of the key extractors.

use std::net::{IpAddr, SocketAddr};
use std::str::FromStr;

use http::HeaderName;
use http::request::Parts;

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
fn the_encoded_form_reads_back_and_nothing_else_does() {
    for value in [&b""[..], b"alice", b"{}*\n", &[0xff; 64]] {
        let key = Key::new("x", value);
        assert_eq!(Key::from_encoded(&key.to_string()), Some(key));
    }
    let text = Key::new("x", b"alice").to_string();
    assert_eq!(Key::from_encoded(&text[..21]), None);
    assert_eq!(Key::from_encoded(&format!("{text}A")), None);
    assert_eq!(Key::from_encoded(&text.replacen(&text[..1], "+", 1)), None);
    // the last character carries 2 bits of the digest and 4 zero bits
    assert_eq!(Key::from_encoded("AAAAAAAAAAAAAAAAAAAAAB"), None);
    assert_eq!(
        Key::from_encoded("AAAAAAAAAAAAAAAAAAAAAA").map(|k| *k.as_bytes()),
        Some([0; 16])
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
    let by_path = from_fn("path", |p: &Parts| Some(p.uri.path().to_owned()));
    let by_method = from_fn("method", |p: &Parts| Some(p.uri.path().to_owned()));
    let parts = parts_with(&[], None);
    assert_eq!(by_path.extract(&parts), Some(Key::new("fn:path", b"/")));
    // two functions returning the same value are two domains
    assert_ne!(by_path.extract(&parts), by_method.extract(&parts));
}

#[test]
fn ipv6_callers_count_by_network_and_ipv4_by_address() {
    let peer = |ip: &str| parts_with(&[], Some(ip));
    let by64 = PeerIp::new();
    assert_eq!(
        by64.extract(&peer("[2001:db8:1:2::1]:1")),
        by64.extract(&peer("[2001:db8:1:2:abcd::9]:1"))
    );
    assert_ne!(
        by64.extract(&peer("[2001:db8:1:2::1]:1")),
        by64.extract(&peer("[2001:db8:1:3::1]:1"))
    );
    let by128 = PeerIp::new().ipv6_prefix(128);
    assert_ne!(
        by128.extract(&peer("[2001:db8:1:2::1]:1")),
        by128.extract(&peer("[2001:db8:1:2::2]:1"))
    );
    // a /64 key is not the /128 key of the network's first address
    assert_ne!(
        by64.extract(&peer("[2001:db8:1:2::]:1")),
        by128.extract(&peer("[2001:db8:1:2::]:1"))
    );
    assert_ne!(
        by64.extract(&peer("1.2.3.4:1")),
        by64.extract(&peer("1.2.3.5:1"))
    );
    assert_eq!(
        PeerIp::new().ipv4_prefix(24).extract(&peer("1.2.3.4:1")),
        PeerIp::new().ipv4_prefix(24).extract(&peer("1.2.3.200:1"))
    );
    // IPv4-mapped IPv6 stays IPv4
    assert_eq!(
        by64.extract(&peer("[::ffff:1.2.3.4]:1")),
        by64.extract(&peer("1.2.3.4:1"))
    );
    assert_ne!(
        by64.extract(&peer("[::ffff:1.2.3.4]:1")),
        by64.extract(&peer("[::ffff:1.2.3.5]:1"))
    );
}

#[test]
fn forwarded_chains_are_walked_for_at_most_max_hops() {
    let x = ForwardedIp::trusting(["10.0.0.0/8"]).unwrap().max_hops(3);
    let from_proxy = |xff: &str| parts_with(&[("x-forwarded-for", xff)], Some("10.0.0.1:1"));
    assert_eq!(
        x.client_ip(&from_proxy("1.1.1.1, 10.0.0.4, 10.0.0.3")),
        Some(ip("1.1.1.1"))
    );
    // a fourth hop is not read: the walk ends at the third, trusted, hop
    assert_eq!(
        x.client_ip(&from_proxy("1.1.1.1, 10.0.0.5, 10.0.0.4, 10.0.0.3")),
        Some(ip("10.0.0.5"))
    );
    // the default walks 20 hops of a padded chain, not 10,000
    let padded = format!("9.9.9.9{}", ", 10.0.0.7".repeat(10_000));
    let default = ForwardedIp::trusting(["10.0.0.0/8"]).unwrap();
    assert_eq!(
        default.client_ip(&from_proxy(&padded)),
        Some(ip("10.0.0.7"))
    );
}

/// What an authentication layer inserts in these tests.
#[derive(Clone)]
struct Tenant(&'static str);

impl AsRef<[u8]> for Tenant {
    fn as_ref(&self) -> &[u8] {
        self.0.as_bytes()
    }
}

fn parts_of(tenant: Option<Tenant>, headers: &[(&str, &str)]) -> Parts {
    let mut parts = parts_with(headers, Some("192.0.2.1:1"));
    if let Some(tenant) = tenant {
        parts.extensions.insert(tenant);
    }
    parts
}

#[test]
fn the_extension_keys_by_the_authenticated_caller_only() {
    let by_tenant = Extension::<Tenant>::new();
    let acme = parts_of(Some(Tenant("acme")), &[]);
    assert_eq!(by_tenant.extract(&acme), Some(Key::new("ext:", b"acme")));
    assert_eq!(
        by_tenant.extract(&acme),
        Some(by_tenant.key(&Tenant("acme")))
    );
    assert_ne!(
        by_tenant.extract(&acme),
        by_tenant.extract(&parts_of(Some(Tenant("globex")), &[]))
    );
    // what the client writes changes nothing
    let with_header = parts_of(Some(Tenant("acme")), &[("x-api-key", "other")]);
    assert_eq!(by_tenant.extract(&with_header), by_tenant.extract(&acme));
    // no caller, or a caller with no bytes: no key
    assert_eq!(
        by_tenant.extract(&parts_of(None, &[("x-api-key", "a")])),
        None
    );
    assert_eq!(by_tenant.extract(&parts_of(Some(Tenant("")), &[])), None);
    assert_eq!(by_tenant.describe(), "the authenticated caller");
}

#[test]
fn extension_domains_keep_equal_ids_of_other_kinds_apart() {
    let tenant = parts_of(Some(Tenant("10.0.0.1")), &[("x-api-key", "10.0.0.1")]);
    let by_tenant = Extension::<Tenant>::new();
    let named = Extension::<Tenant>::named("org");
    assert_ne!(by_tenant.extract(&tenant), named.extract(&tenant));
    assert_eq!(
        named.extract(&tenant),
        Some(Key::new("ext:org", b"10.0.0.1"))
    );
    let header = Header::from_static("x-api-key");
    assert_ne!(by_tenant.extract(&tenant), header.extract(&tenant));
    assert_ne!(
        by_tenant.extract(&tenant),
        Some(Key::new("ip", b"10.0.0.1"))
    );
    // chained, the anonymous request falls to its peer address
    let either = by_tenant.clone().or(PeerIp::new());
    let anonymous = parts_of(None, &[]);
    assert_eq!(
        either.extract(&anonymous),
        PeerIp::new().extract(&anonymous)
    );
    assert_eq!(either.extract(&tenant), by_tenant.extract(&tenant));
    assert_eq!(
        format!("{:?}", Extension::<Tenant>::named("org")),
        r#"Extension { domain: "ext:org" }"#
    );
}
