//! Property tests with hostile input: arbitrary key material, header bytes, forwarding chains,
//! Idempotency-Key spellings, oversized bodies and lock / claim names, driven through the public
//! API on a `MemoryStore` and on a real `redis-server` (one per property).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use crate::common;

use std::collections::HashSet;
use std::convert::Infallible;
use std::net::{IpAddr, SocketAddr};
use std::str::FromStr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use futures_util::{StreamExt, stream};
use http::{HeaderName, HeaderValue, Request, Response, StatusCode};
use http_body::Frame;
use http_body_util::{BodyExt, StreamBody};
use proptest::prelude::*;
use proptest::test_runner::TestCaseError;

use common::check;
use tower::{Service, ServiceBuilder, ServiceExt};

use common::RedisServer;
use tollgate::claim::Claims;
use tollgate::idempotency::{IdempotencyLayer, OnConcurrent};
use tollgate::key::{Cidr, ForwardedIp, Header, Key, KeyExtractor, PeerIp};
use tollgate::lock::{LockError, Locks};
use tollgate::rate_limit::{Algorithm, Limit, OnStoreError, RateLimitLayer};
use tollgate::store::{MemoryStore, RedisStore};

const API_KEY: HeaderName = HeaderName::from_static("x-api-key");
const IDEMPOTENCY_KEY: HeaderName = HeaderName::from_static("idempotency-key");
const XFF: HeaderName = HeaderName::from_static("x-forwarded-for");
const TRUSTED: [&str; 2] = ["10.0.0.0/8", "fd00::/8"];

// ---------------------------------------------------------------------------------------------
// Harness
// ---------------------------------------------------------------------------------------------

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

thread_local! {
    /// The runtime of the Redis properties on this thread: the store's connection lives on it.
    static REDIS_RUNTIME: tokio::runtime::Runtime = runtime();
}

fn on_redis_runtime<F: std::future::Future>(future: F) -> F::Output {
    REDIS_RUNTIME.with(|rt| rt.block_on(future))
}

fn redis_store(server: &RedisServer) -> RedisStore {
    on_redis_runtime(async {
        RedisStore::builder(server.url())
            .timeout(Duration::from_secs(2))
            .build()
            .unwrap()
    })
}

/// The inner service: answers `status` with body `run <n>` and counts its calls.
#[derive(Clone)]
struct Handler {
    runs: Arc<AtomicUsize>,
    status: StatusCode,
}

impl Handler {
    fn new(status: StatusCode) -> Self {
        Self {
            runs: Arc::new(AtomicUsize::new(0)),
            status,
        }
    }

    fn runs(&self) -> usize {
        self.runs.load(Ordering::SeqCst)
    }
}

impl<B> Service<Request<B>> for Handler {
    type Response = Response<String>;
    type Error = Infallible;
    type Future = std::future::Ready<Result<Response<String>, Infallible>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, _request: Request<B>) -> Self::Future {
        let n = self.runs.fetch_add(1, Ordering::SeqCst) + 1;
        let mut response = Response::new(format!("run {n}"));
        *response.status_mut() = self.status;
        std::future::ready(Ok(response))
    }
}

/// A byte that `HeaderValue::from_bytes` accepts, biased towards the characters that matter to
/// Redis keys and hash tags.
fn header_byte() -> impl Strategy<Value = u8> {
    prop_oneof![
        4 => 0x20u8..0x7f,
        2 => 0x80u8..=0xff,
        2 => prop::sample::select(vec![b'{', b'}', b'*', b':', b'\t', b' ', b'"', b'\\', b'[', b']']),
    ]
}

/// `len` bytes that `HeaderValue::from_bytes` accepts, spun out of `seed` (element-wise
/// generation of kilobytes is slow in proptest; this shrinks by length and seed instead).
fn spun_header_bytes(seed: u64, len: usize) -> Vec<u8> {
    const SPECIAL: &[u8] = b"{}*:\t \"\\[]";
    let mut state = seed | 1;
    (0..len)
        .map(|_| {
            // xorshift64
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            let pick = (state >> 32) as u32;
            match pick % 8 {
                0..=3 => 0x20 + (pick >> 8) as u8 % 0x5f,
                4 | 5 => 0x80 | (pick >> 8) as u8,
                _ => SPECIAL[(pick >> 8) as usize % SPECIAL.len()],
            }
        })
        .collect()
}

/// Header value bytes of up to `max` bytes (mostly short).
fn header_bytes(max: usize) -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        6 => prop::collection::vec(header_byte(), 0..64),
        1 => (any::<u64>(), 0..=max).prop_map(|(seed, len)| spun_header_bytes(seed, len)),
    ]
}

fn non_empty_header_bytes(max: usize) -> impl Strategy<Value = Vec<u8>> {
    header_bytes(max).prop_filter("non-empty", |v| !v.is_empty())
}

fn algorithm() -> impl Strategy<Value = Algorithm> {
    prop::sample::select(vec![
        Algorithm::SlidingLog,
        Algorithm::SlidingCounter,
        Algorithm::Gcra,
    ])
}

fn is_base64url(s: &str) -> bool {
    s.bytes()
        .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
}

/// Every key on the server.
fn all_keys(server: &RedisServer) -> Vec<Vec<u8>> {
    redis::cmd("KEYS")
        .arg("*")
        .query(&mut server.conn())
        .unwrap()
}

fn flush(server: &RedisServer) {
    redis::cmd("FLUSHALL")
        .query::<()>(&mut server.conn())
        .unwrap();
}

/// Checks the shape of a store key: one of `prefixes` (each ending in `{`), then 22 base64url
/// characters and `}`, no other brace, under 100 bytes. Returns the hash tag.
fn check_store_key(key: &[u8], prefixes: &[&str]) -> Result<String, TestCaseError> {
    let shown = String::from_utf8_lossy(key);
    prop_assert!(key.len() < 100, "store key of {} bytes: {shown}", key.len());
    let text = std::str::from_utf8(key)?;
    let Some(prefix) = prefixes.iter().find(|p| text.starts_with(*p)) else {
        return Err(TestCaseError::fail(format!(
            "store key {text:?} has none of the prefixes {prefixes:?}"
        )));
    };
    prop_assert_eq!(text.matches('{').count(), 1, "key {}", text);
    prop_assert_eq!(text.matches('}').count(), 1, "key {}", text);
    let rest = &text[prefix.len()..];
    let close = rest.find('}').unwrap();
    let tag = &rest[..close];
    prop_assert_eq!(tag.len(), 22, "hash tag {:?} in {}", tag, text);
    prop_assert!(is_base64url(tag), "hash tag {tag:?} in {text}");
    Ok(tag.to_owned())
}

// ---------------------------------------------------------------------------------------------
// 1. Key derivation
// ---------------------------------------------------------------------------------------------

#[test]
fn key_display_is_22_base64url_chars() {
    check(
        256,
        (any::<String>(), prop::collection::vec(any::<u8>(), 0..2048)),
        |(domain, value)| {
            let key = Key::new(&domain, &value);
            let shown = key.to_string();
            prop_assert_eq!(shown.len(), 22);
            prop_assert!(is_base64url(&shown), "{shown:?}");
            prop_assert_eq!(key, Key::new(&domain, &value), "not deterministic");
            Ok(())
        },
    );
}

#[test]
fn distinct_domain_value_pairs_give_distinct_keys() {
    let pair = || (".{0,12}", prop::collection::vec(any::<u8>(), 0..32));
    check(256, (pair(), pair()), |(a, b)| {
        prop_assume!(a != b);
        prop_assert_ne!(Key::new(&a.0, &a.1), Key::new(&b.0, &b.1));
        Ok(())
    });
}

#[test]
fn shifting_the_domain_value_boundary_never_collides() {
    check(
        256,
        (
            ".{0,24}",
            any::<prop::sample::Index>(),
            any::<prop::sample::Index>(),
        ),
        |(s, i, j)| {
            let cuts: Vec<usize> = s
                .char_indices()
                .map(|(at, _)| at)
                .chain([s.len()])
                .collect();
            let (i, j) = (cuts[i.index(cuts.len())], cuts[j.index(cuts.len())]);
            prop_assume!(i != j);
            let (a, b) = (
                Key::new(&s[..i], &s.as_bytes()[i..]),
                Key::new(&s[..j], &s.as_bytes()[j..]),
            );
            prop_assert_ne!(a, b, "split at {} and {} of {:?}", i, j, s);
            Ok(())
        },
    );
}

#[test]
fn a_value_forging_the_length_prefix_does_not_collide() {
    // Key::new(d, v) hashes be64(len d) || d || v: a value that spells out another domain's
    // length prefix must still give another key.
    check(
        256,
        (
            ".{0,12}",
            ".{0,12}",
            prop::collection::vec(any::<u8>(), 0..32),
        ),
        |(outer, inner, value)| {
            let mut forged = (inner.len() as u64).to_be_bytes().to_vec();
            forged.extend_from_slice(inner.as_bytes());
            forged.extend_from_slice(&value);
            prop_assert_ne!(Key::new(&outer, &forged), Key::new(&inner, &value));
            if !outer.is_empty() {
                let mut concatenated = outer.as_bytes().to_vec();
                concatenated.extend_from_slice(&value);
                prop_assert_ne!(Key::new("", &concatenated), Key::new(&outer, &value));
            }
            Ok(())
        },
    );
}

#[test]
fn header_extractor_keys_are_the_domain_hash_of_the_exact_bytes() {
    check(256, (header_bytes(2048), header_bytes(2048)), |(a, b)| {
        let parts = |v: &[u8]| {
            let value = HeaderValue::from_bytes(v).unwrap();
            Request::get("/")
                .header(API_KEY, value)
                .body(())
                .unwrap()
                .into_parts()
                .0
        };
        let header = Header::new(API_KEY);
        let (ka, kb) = (header.extract(&parts(&a)), header.extract(&parts(&b)));
        prop_assert_eq!(ka.is_none(), a.is_empty());
        prop_assert_eq!(
            ka,
            (!a.is_empty()).then(|| Key::new("header:x-api-key", &a))
        );
        if !a.is_empty() && !b.is_empty() {
            prop_assert_eq!(ka == kb, a == b);
        }
        Ok(())
    });
}

// ---------------------------------------------------------------------------------------------
// 2. Rate-limit layer keyed by arbitrary header bytes
// ---------------------------------------------------------------------------------------------

#[test]
fn rate_limit_over_arbitrary_header_values_on_memory_store() {
    check(
        192,
        (header_bytes(8192), algorithm()),
        |(value, algorithm)| {
            let value = HeaderValue::from_bytes(&value).unwrap();
            runtime().block_on(async {
                let handler = Handler::new(StatusCode::OK);
                let layer = RateLimitLayer::builder(MemoryStore::new())
                    .limit(Limit::per_minute("m", 2))
                    .algorithm(algorithm)
                    .key(Header::new(API_KEY))
                    .build()
                    .unwrap();
                let service = ServiceBuilder::new().layer(layer).service(handler.clone());
                let mut statuses = Vec::new();
                for _ in 0..3 {
                    let request = Request::get("/")
                        .header(API_KEY, value.clone())
                        .body(String::new())
                        .unwrap();
                    statuses.push(service.clone().oneshot(request).await.unwrap().status());
                }
                if value.is_empty() {
                    // an empty header names nobody: the default missing-key answer
                    prop_assert_eq!(statuses, vec![StatusCode::BAD_REQUEST; 3]);
                    prop_assert_eq!(handler.runs(), 0);
                } else {
                    prop_assert_eq!(
                        statuses,
                        vec![
                            StatusCode::OK,
                            StatusCode::OK,
                            StatusCode::TOO_MANY_REQUESTS
                        ]
                    );
                    prop_assert_eq!(handler.runs(), 2);
                }
                Ok(())
            })
        },
    );
}

/// One round of the Redis property: A is admitted then denied (limit 1), B is still admitted,
/// and every key on the server is short, prefixed and carries one 22-character hash tag.
fn rate_limit_round_on_redis(
    server: &RedisServer,
    store: &RedisStore,
    a: &[u8],
    b: &[u8],
    algorithm: Algorithm,
) -> Result<(), TestCaseError> {
    flush(server);
    let handler = Handler::new(StatusCode::OK);
    let layer = RateLimitLayer::builder(store.clone())
        .limit(Limit::per_minute("m", 1))
        .limit(Limit::per_hour("h", 100))
        .algorithm(algorithm)
        .prefix("hostile")
        .key(Header::new(API_KEY))
        .on_store_error(OnStoreError::Deny)
        .build()
        .unwrap();
    let service = ServiceBuilder::new().layer(layer).service(handler.clone());
    let call = |value: &[u8]| {
        let request = Request::get("/")
            .header(API_KEY, HeaderValue::from_bytes(value).unwrap())
            .body(String::new())
            .unwrap();
        service.clone().oneshot(request)
    };
    let statuses = on_redis_runtime(async {
        vec![
            call(a).await.unwrap().status(),
            call(a).await.unwrap().status(),
            call(b).await.unwrap().status(),
        ]
    });
    prop_assert_eq!(
        statuses,
        vec![
            StatusCode::OK,
            StatusCode::TOO_MANY_REQUESTS,
            StatusCode::OK
        ],
        "B shared A's bucket, or the store failed"
    );
    prop_assert_eq!(handler.runs(), 2);
    let keys = all_keys(server);
    prop_assert!(!keys.is_empty());
    let mut tags = HashSet::new();
    for key in &keys {
        tags.insert(check_store_key(key, &["hostile:rl:{"])?);
    }
    prop_assert_eq!(tags.len(), 2, "two callers, keys {:?}", keys);
    let expected: HashSet<String> = [a, b]
        .iter()
        .map(|v| Key::new("header:x-api-key", v).to_string())
        .collect();
    prop_assert_eq!(tags, expected);
    Ok(())
}

#[test]
fn rate_limit_store_keys_stay_short_and_tagged_on_redis() {
    let server = RedisServer::start();
    let store = redis_store(&server);
    check(
        96,
        (
            non_empty_header_bytes(8192),
            non_empty_header_bytes(8192),
            algorithm(),
        ),
        |(a, b, algorithm)| {
            prop_assume!(a != b);
            rate_limit_round_on_redis(&server, &store, &a, &b, algorithm)
        },
    );
}

// ---------------------------------------------------------------------------------------------
// 3. ForwardedIp
// ---------------------------------------------------------------------------------------------

fn trusted_nets() -> Vec<Cidr> {
    TRUSTED.iter().map(|c| c.parse().unwrap()).collect()
}

fn canonical(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(ip, IpAddr::V4),
        v4 => v4,
    }
}

fn is_trusted(ip: IpAddr) -> bool {
    trusted_nets().iter().any(|net| net.contains(ip))
}

fn any_ip() -> impl Strategy<Value = IpAddr> {
    prop_oneof![
        any::<[u8; 4]>().prop_map(IpAddr::from),
        any::<[u8; 3]>().prop_map(|[a, b, c]| IpAddr::from([10, a, b, c])),
        any::<[u8; 16]>().prop_map(IpAddr::from),
        any::<[u8; 15]>().prop_map(|rest| {
            let mut octets = [0xfd; 16];
            octets[1..].copy_from_slice(&rest);
            IpAddr::from(octets)
        }),
        prop::sample::select(vec![
            "::ffff:10.1.2.3",
            "::ffff:8.8.8.8",
            "::1",
            "::",
            "0.0.0.0",
            "255.255.255.255",
            "fe80::1",
        ])
        .prop_map(|s| s.parse().unwrap()),
    ]
}

fn trusted_ip() -> impl Strategy<Value = IpAddr> {
    any_ip().prop_filter("trusted", |ip| is_trusted(*ip))
}

fn untrusted_ip() -> impl Strategy<Value = IpAddr> {
    any_ip().prop_filter("untrusted", |ip| !is_trusted(*ip))
}

/// An address as some proxy or client might write it in `X-Forwarded-For`.
fn render_xff(ip: IpAddr, style: u8) -> String {
    match (ip, style % 5) {
        (IpAddr::V4(v4), 1) => format!("{v4}:{}", 1000 + u16::from(style)),
        (IpAddr::V6(v6), 1) => format!("[{v6}]:443"),
        (IpAddr::V4(v4), 2) => format!("::ffff:{v4}"),
        (IpAddr::V6(v6), 2) => format!("[{v6}]"),
        (_, 3) => format!("  {ip}\t"),
        (IpAddr::V6(v6), 4) => format!("{v6:?}").to_uppercase(),
        _ => ip.to_string(),
    }
}

/// An element of a `Forwarded` header naming `ip`.
fn render_forwarded(ip: IpAddr, style: u8) -> String {
    let node = match (ip, style % 4) {
        (IpAddr::V4(v4), 1) => format!("\"{v4}:8080\""),
        (IpAddr::V6(v6), 1) => format!("\"[{v6}]:443\""),
        (IpAddr::V6(v6), _) => format!("\"[{v6}]\""),
        (IpAddr::V4(v4), _) => v4.to_string(),
    };
    match style % 3 {
        0 => format!("for={node}"),
        1 => format!("for={node};proto=https;by=10.9.9.9"),
        _ => format!("proto=http; FOR = {node}"),
    }
}

fn garbage() -> impl Strategy<Value = String> {
    prop_oneof![
        "[ -~]{0,24}",
        prop::sample::select(vec![
            "unknown",
            "_hidden",
            "for=unknown",
            "for=_obf",
            "for=",
            "[",
            "]",
            "[::1",
            "\"",
            "1.2.3",
            "1.2.3.4.5",
            "::ffff:",
            "for=\"[::1]",
            "300.1.1.1",
            "[fe80::1%1]:80",
        ])
        .prop_map(str::to_owned),
    ]
}

fn xff_value() -> impl Strategy<Value = String> {
    let element = prop_oneof![
        3 => (any_ip(), any::<u8>()).prop_map(|(ip, style)| render_xff(ip, style)),
        1 => garbage(),
    ];
    (prop::collection::vec(element, 0..6), any::<bool>())
        .prop_map(|(elements, tight)| elements.join(if tight { "," } else { ", " }))
}

fn forwarded_value() -> impl Strategy<Value = String> {
    let element = prop_oneof![
        3 => (any_ip(), any::<u8>()).prop_map(|(ip, style)| render_forwarded(ip, style)),
        1 => garbage(),
    ];
    prop::collection::vec(element, 0..6).prop_map(|elements| elements.join(", "))
}

/// Zero to four forwarding headers, structured or random.
fn forwarding_headers() -> impl Strategy<Value = Vec<(HeaderName, Vec<u8>)>> {
    let header = prop_oneof![
        3 => xff_value().prop_map(|v| (XFF, v.into_bytes())),
        3 => forwarded_value().prop_map(|v| (http::header::FORWARDED, v.into_bytes())),
        1 => header_bytes(512).prop_map(|v| (XFF, v)),
        1 => header_bytes(512).prop_map(|v| (http::header::FORWARDED, v)),
    ];
    prop::collection::vec(header, 0..4)
}

#[derive(Debug, Clone)]
enum Peer {
    None,
    Socket(SocketAddr),
    Ip(IpAddr),
}

impl Peer {
    fn ip(&self) -> Option<IpAddr> {
        match self {
            Self::None => None,
            Self::Socket(addr) => Some(canonical(addr.ip())),
            Self::Ip(ip) => Some(canonical(*ip)),
        }
    }
}

fn peer() -> impl Strategy<Value = Peer> {
    prop_oneof![
        1 => Just(Peer::None),
        4 => (trusted_ip(), any::<u16>()).prop_map(|(ip, port)| Peer::Socket(SocketAddr::new(ip, port))),
        2 => (any_ip(), any::<u16>()).prop_map(|(ip, port)| Peer::Socket(SocketAddr::new(ip, port))),
        1 => any_ip().prop_map(Peer::Ip),
        1 => any::<[u8; 3]>().prop_map(|[a, b, c]| Peer::Ip(format!("::ffff:10.{a}.{b}.{c}").parse().unwrap())),
    ]
}

fn forwarded_parts(headers: &[(HeaderName, Vec<u8>)], peer: &Peer) -> http::request::Parts {
    let mut builder = Request::get("/");
    for (name, value) in headers {
        builder = builder.header(name, HeaderValue::from_bytes(value).unwrap());
    }
    let mut request = builder.body(()).unwrap();
    match peer {
        Peer::None => {}
        Peer::Socket(addr) => {
            request.extensions_mut().insert(*addr);
        }
        Peer::Ip(ip) => {
            request.extensions_mut().insert(*ip);
        }
    }
    request.into_parts().0
}

/// Every address written anywhere in `text`, in any of the spellings the parser knows (plain,
/// with a port, bracketed, quoted, IPv4-mapped), canonicalised.
fn addresses_written_in(text: &str) -> HashSet<IpAddr> {
    text.split(|c: char| ",;=\"[]%".contains(c) || c.is_ascii_whitespace())
        .filter_map(|token| {
            IpAddr::from_str(token)
                .ok()
                .or_else(|| SocketAddr::from_str(token).ok().map(|a| a.ip()))
        })
        .map(canonical)
        .collect()
}

/// Which header the trusted proxies write, and so the one the extractor reads.
#[derive(Debug, Clone, Copy)]
enum Mode {
    Xff,
    Forwarded,
}

impl Mode {
    fn extractor(self) -> ForwardedIp {
        let extractor = ForwardedIp::trusting(TRUSTED).unwrap();
        match self {
            Self::Xff => extractor,
            Self::Forwarded => extractor.use_forwarded_header(),
        }
    }

    /// The header this mode reads.
    fn header(self) -> HeaderName {
        match self {
            Self::Xff => XFF,
            Self::Forwarded => http::header::FORWARDED,
        }
    }

    /// The header this mode ignores.
    fn other(self) -> HeaderName {
        match self {
            Self::Xff => http::header::FORWARDED,
            Self::Forwarded => XFF,
        }
    }

    /// One hop naming `ip`, as a proxy writing this header might spell it.
    fn hop(self, ip: IpAddr, style: u8) -> String {
        match self {
            Self::Xff => render_xff(ip, style),
            Self::Forwarded => render_forwarded(ip, style),
        }
    }

    /// A hop that names no address: unknown, obfuscated (RFC 7239 §6) or empty.
    fn unknown_hop(self, pick: u8) -> &'static str {
        let hops: &[&'static str] = match self {
            Self::Xff => &["unknown", "_hidden", "", " ", "not-an-ip", "300.1.1.1"],
            Self::Forwarded => &[
                "for=unknown",
                "for=_hidden",
                "for=\"_x9\";proto=https",
                "proto=https;by=10.0.0.1",
                "",
                "for=\"[::1\"garbage",
            ],
        };
        hops[usize::from(pick) % hops.len()]
    }
}

fn mode() -> impl Strategy<Value = Mode> {
    prop_oneof![Just(Mode::Xff), Just(Mode::Forwarded)]
}

#[test]
fn forwarded_ip_is_the_peer_or_an_address_in_the_header_it_reads() {
    check(
        256,
        (forwarding_headers(), peer(), mode()),
        |(headers, peer, mode)| {
            let extractor = mode.extractor();
            let parts = forwarded_parts(&headers, &peer);
            let client = extractor.client_ip(&parts);
            let Some(peer_ip) = peer.ip() else {
                prop_assert_eq!(client, None);
                prop_assert_eq!(extractor.extract(&parts), None);
                return Ok(());
            };
            let client = client.unwrap();
            if !is_trusted(peer_ip) {
                prop_assert_eq!(
                    client,
                    peer_ip,
                    "an untrusted peer chose its key with headers"
                );
                return Ok(());
            }
            if client != peer_ip {
                let written: HashSet<IpAddr> = headers
                    .iter()
                    .filter(|(name, _)| *name == mode.header())
                    .flat_map(|(_, v)| addresses_written_in(&String::from_utf8_lossy(v)))
                    .collect();
                prop_assert!(
                    written.contains(&client),
                    "{client} is neither the peer {peer_ip} nor written in the {} headers",
                    mode.header()
                );
            }
            let key = extractor.extract(&parts).unwrap();
            let direct = PeerIp::new().extract(&forwarded_parts(&[], &Peer::Ip(client)));
            prop_assert_eq!(Some(key), direct, "the key is not the client address's key");
            Ok(())
        },
    );
}

#[test]
fn cidr_parse_never_panics_and_contains_matches_a_mask_model() {
    let cidr_text = prop_oneof![
        "[ -~]{0,48}",
        (any_ip(), 0u8..=140).prop_map(|(ip, p)| format!("{ip}/{p}")),
        (any_ip(), "[ -~]{0,4}").prop_map(|(ip, p)| format!("{ip}/{p}")),
    ];
    check(256, (cidr_text, any_ip()), |(text, ip)| {
        let Ok(cidr) = Cidr::from_str(&text) else {
            return Ok(());
        };
        let (addr, prefix) = match text.split_once('/') {
            Some((a, p)) => (
                canonical(a.trim().parse().unwrap()),
                p.trim().parse::<u32>().unwrap(),
            ),
            None => {
                let a = canonical(text.trim().parse().unwrap());
                (a, if a.is_ipv4() { 32 } else { 128 })
            }
        };
        let expected = match (addr, canonical(ip)) {
            (IpAddr::V4(net), IpAddr::V4(ip)) => {
                prefix == 0 || (u32::from(net) ^ u32::from(ip)) >> (32 - prefix) == 0
            }
            (IpAddr::V6(net), IpAddr::V6(ip)) => {
                prefix == 0 || (u128::from(net) ^ u128::from(ip)) >> (128 - prefix) == 0
            }
            _ => false,
        };
        prop_assert_eq!(cidr.contains(ip), expected, "{} contains {}?", text, ip);
        Ok(())
    });
}

/// The hops a trusted proxy tier appends for `client`: the client as the outermost proxy saw
/// it, then each inner proxy (all trusted).
fn honest_chain(mode: Mode, client: (IpAddr, u8), proxies: &[(IpAddr, u8)]) -> Vec<String> {
    std::iter::once(client)
        .chain(proxies.iter().copied())
        .map(|(ip, style)| mode.hop(ip, style))
        .collect()
}

#[test]
fn client_written_prefix_cannot_change_the_client_address() {
    // The client sends its own chain (anything); the trusted proxies append the client's real
    // address and their own. The right-most untrusted hop is the real client whatever the
    // client wrote to its left ("the left-most entry is never believed").
    check(
        256,
        (
            mode(),
            garbage(),
            (untrusted_ip(), any::<u8>()),
            prop::collection::vec((trusted_ip(), any::<u8>()), 0..3),
            trusted_ip(),
        ),
        |(mode, client_prefix, client, proxies, peer)| {
            let mut hops = vec![client_prefix];
            hops.extend(honest_chain(mode, client, &proxies));
            let header = hops.join(", ");
            let parts = forwarded_parts(
                &[(mode.header(), header.clone().into_bytes())],
                &Peer::Socket(SocketAddr::new(peer, 443)),
            );
            prop_assert_eq!(
                mode.extractor().client_ip(&parts),
                Some(canonical(client.0)),
                "{}: {:?} from trusted peer {}",
                mode.header(),
                header,
                peer
            );
            Ok(())
        },
    );
}

#[test]
fn the_header_the_proxies_do_not_write_is_ignored() {
    // A proxy that appends to one header passes the other on as the client wrote it (nginx,
    // HAProxy and cloud load balancers write X-Forwarded-For and leave `Forwarded` alone): the
    // other header must not pick the client's key, whichever order the two arrive in.
    check(
        128,
        (
            mode(),
            (any_ip(), any::<u8>()),
            (untrusted_ip(), any::<u8>()),
            trusted_ip(),
            any::<bool>(),
        ),
        |(mode, (spoofed, spoofed_style), client, peer, spoof_first)| {
            let other = match mode {
                Mode::Xff => Mode::Forwarded,
                Mode::Forwarded => Mode::Xff,
            };
            let spoof = (mode.other(), other.hop(spoofed, spoofed_style).into_bytes());
            let honest = (
                mode.header(),
                honest_chain(mode, client, &[]).join(", ").into_bytes(),
            );
            let headers = if spoof_first {
                vec![spoof, honest]
            } else {
                vec![honest, spoof]
            };
            let parts = forwarded_parts(&headers, &Peer::Socket(SocketAddr::new(peer, 443)));
            prop_assert_eq!(
                mode.extractor().client_ip(&parts),
                Some(canonical(client.0)),
                "headers {:?}",
                headers
                    .iter()
                    .map(|(n, v)| format!("{n}: {}", String::from_utf8_lossy(v)))
                    .collect::<Vec<_>>()
            );
            Ok(())
        },
    );
}

#[test]
fn a_hop_that_is_not_an_address_ends_the_walk() {
    // A proxy that does not know or hides the client writes `unknown` / `for=unknown` or an
    // obfuscated name. What lies left of that hop is nobody trusted's word: the request is keyed
    // by the last trusted hop (or the peer), never by an address the client wrote.
    check(
        256,
        (
            mode(),
            (untrusted_ip(), any::<u8>()),
            any::<u8>(),
            prop::collection::vec((trusted_ip(), any::<u8>()), 0..3),
            trusted_ip(),
        ),
        |(mode, spoofed, unknown, proxies, peer)| {
            let mut hops = vec![
                mode.hop(spoofed.0, spoofed.1),
                mode.unknown_hop(unknown).to_owned(),
            ];
            hops.extend(proxies.iter().map(|&(ip, style)| mode.hop(ip, style)));
            let header = hops.join(", ");
            let parts = forwarded_parts(
                &[(mode.header(), header.clone().into_bytes())],
                &Peer::Socket(SocketAddr::new(peer, 443)),
            );
            let expected = canonical(proxies.first().map_or(peer, |&(ip, _)| ip));
            prop_assert_eq!(
                mode.extractor().client_ip(&parts),
                Some(expected),
                "{}: {:?} from trusted peer {}",
                mode.header(),
                header,
                peer
            );
            Ok(())
        },
    );
}

// ---------------------------------------------------------------------------------------------
// 4. Idempotency-Key parsing through the layer
// ---------------------------------------------------------------------------------------------

/// The key a header value names under RFC 9651 sf-string / bare-token rules, or `None` for a
/// value the layer must refuse with 400.
fn model_key(bytes: &[u8]) -> Option<String> {
    let key = if bytes.first() == Some(&b'"') {
        if bytes.len() < 2 || bytes[bytes.len() - 1] != b'"' {
            return None;
        }
        let mut out = String::new();
        let mut inner = bytes[1..bytes.len() - 1].iter();
        while let Some(&c) = inner.next() {
            match c {
                b'\\' => match inner.next() {
                    Some(&e @ (b'"' | b'\\')) => out.push(char::from(e)),
                    _ => return None,
                },
                b'"' => return None,
                0x20..=0x7e => out.push(char::from(c)),
                _ => return None,
            }
        }
        out
    } else {
        if !bytes.iter().all(|c| (0x21..=0x7e).contains(c)) {
            return None;
        }
        String::from_utf8(bytes.to_vec()).unwrap()
    };
    (!key.is_empty() && key.len() <= 255).then_some(key)
}

/// The sf-string spelling of `key`.
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

fn idempotency_key_bytes() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        3 => header_bytes(1024),
        3 => prop::collection::vec(0x21u8..=0x7e, 1..=255),
        1 => prop::collection::vec(0x21u8..=0x7e, 250..=600),
        2 => prop::collection::vec(0x20u8..=0x7e, 0..=300).prop_map(|k| quoted(&String::from_utf8(k).unwrap())),
        1 => prop::collection::vec(prop::sample::select(vec![b'"', b'\\', b'a', b' ', b'\t', 0xc3, 0xa9]), 0..12),
    ]
}

struct Reply {
    status: StatusCode,
    replayed: bool,
    body: Bytes,
}

/// An idempotency stack on a fresh `MemoryStore`, answering 201 from `handler`.
fn idempotency_service(
    handler: &Handler,
    body_limit: usize,
) -> impl Service<
    Request<String>,
    Response = Response<tollgate::idempotency::IdempotencyBody<String>>,
    Error = Infallible,
> + Clone {
    let layer = IdempotencyLayer::builder(MemoryStore::new())
        .unscoped()
        .on_concurrent(OnConcurrent::Wait(Duration::from_secs(5)))
        .body_limit(body_limit)
        .build()
        .unwrap();
    ServiceBuilder::new().layer(layer).service(handler.clone())
}

async fn post<S>(service: &S, key: &[u8], path: &str, body: &str) -> Reply
where
    S: Service<
            Request<String>,
            Response = Response<tollgate::idempotency::IdempotencyBody<String>>,
            Error = Infallible,
        > + Clone,
{
    let request = Request::post(path)
        .header(IDEMPOTENCY_KEY, HeaderValue::from_bytes(key).unwrap())
        .body(body.to_owned())
        .unwrap();
    let response = service.clone().oneshot(request).await.unwrap();
    let status = response.status();
    let replayed = response
        .headers()
        .get("idempotent-replayed")
        .is_some_and(|v| v == "true");
    let body = response.into_body().collect().await.unwrap().to_bytes();
    Reply {
        status,
        replayed,
        body,
    }
}

#[test]
fn idempotency_key_header_is_accepted_exactly_as_specified() {
    check(256, idempotency_key_bytes(), |key| {
        runtime().block_on(async {
            let handler = Handler::new(StatusCode::CREATED);
            let service = idempotency_service(&handler, 1 << 20);
            let first = post(&service, &key, "/pay", "{}").await;
            match model_key(&key) {
                None => {
                    prop_assert_eq!(
                        first.status,
                        StatusCode::BAD_REQUEST,
                        "key {:?}",
                        String::from_utf8_lossy(&key)
                    );
                    prop_assert!(
                        first.body.len() < 200,
                        "400 body of {} bytes",
                        first.body.len()
                    );
                    prop_assert_eq!(handler.runs(), 0, "the handler ran for a refused key");
                }
                Some(name) => {
                    prop_assert_eq!(
                        first.status,
                        StatusCode::CREATED,
                        "key {:?}",
                        String::from_utf8_lossy(&key)
                    );
                    prop_assert!(!first.replayed);
                    prop_assert_eq!(handler.runs(), 1);
                    // the other spelling (quoted, or the same again) names the same key
                    let again = post(&service, &quoted(&name), "/pay", "{}").await;
                    prop_assert_eq!(again.status, StatusCode::CREATED);
                    prop_assert!(
                        again.replayed,
                        "{:?} and its sf-string spelling differ",
                        name
                    );
                    prop_assert_eq!(again.body, first.body);
                    prop_assert_eq!(handler.runs(), 1);
                }
            }
            Ok(())
        })
    });
}

#[test]
fn bare_and_quoted_spellings_name_one_key_and_distinct_keys_stay_apart() {
    let plain = || {
        prop::collection::vec(
            (0x21u8..=0x7e).prop_filter("no quote or backslash", |b| *b != b'"' && *b != b'\\'),
            1..=255,
        )
        .prop_map(|k| String::from_utf8(k).unwrap())
    };
    check(
        128,
        (plain(), plain(), any::<bool>()),
        |(k, other, quoted_first)| {
            prop_assume!(k != other);
            runtime().block_on(async {
                let handler = Handler::new(StatusCode::CREATED);
                let service = idempotency_service(&handler, 1 << 20);
                let (first, second) = if quoted_first {
                    (quoted(&k), k.clone().into_bytes())
                } else {
                    (k.clone().into_bytes(), quoted(&k))
                };
                let a = post(&service, &first, "/pay", "{}").await;
                let b = post(&service, &second, "/pay", "{}").await;
                prop_assert_eq!(a.status, StatusCode::CREATED);
                prop_assert_eq!(b.status, StatusCode::CREATED);
                prop_assert!(!a.replayed && b.replayed);
                prop_assert_eq!(handler.runs(), 1);
                let c = post(&service, other.as_bytes(), "/pay", "{}").await;
                prop_assert_eq!(c.status, StatusCode::CREATED);
                prop_assert!(!c.replayed, "{:?} replayed {:?}'s response", other, k);
                prop_assert_eq!(handler.runs(), 2);
                // over 255 characters is refused in both spellings
                let long = format!("{k}{}", "x".repeat(256 - k.len().min(255)));
                prop_assert!(long.len() > 255);
                for spelling in [long.clone().into_bytes(), quoted(&long)] {
                    let r = post(&service, &spelling, "/pay", "{}").await;
                    prop_assert_eq!(r.status, StatusCode::BAD_REQUEST);
                }
                prop_assert_eq!(handler.runs(), 2);
                Ok(())
            })
        },
    );
}

#[test]
fn one_key_with_another_request_is_refused_not_replayed() {
    // The fingerprint separates method, path and body: shifting bytes between path and body
    // still makes another request (422), never a replay of somebody else's response.
    let path = "/[a-z/]{0,12}";
    let body = "[a-z/{}]{0,12}";
    check(128, ((path, body), (path, body)), |(a, b)| {
        prop_assume!(a != b);
        runtime().block_on(async {
            let handler = Handler::new(StatusCode::CREATED);
            let service = idempotency_service(&handler, 1 << 20);
            let first = post(&service, b"k", &a.0, &a.1).await;
            let second = post(&service, b"k", &b.0, &b.1).await;
            prop_assert_eq!(first.status, StatusCode::CREATED);
            prop_assert_eq!(
                second.status,
                StatusCode::UNPROCESSABLE_ENTITY,
                "{:?} vs {:?}",
                a,
                b
            );
            prop_assert_eq!(handler.runs(), 1);
            Ok(())
        })
    });
}

#[test]
fn idempotency_record_keys_on_redis_are_short_and_tagged() {
    let server = RedisServer::start();
    let store = redis_store(&server);
    check(
        64,
        (
            prop::collection::vec(0x20u8..=0x7e, 1..=255),
            header_bytes(4096),
        ),
        |(key, scope)| {
            flush(&server);
            let key = quoted(&String::from_utf8(key).unwrap());
            let handler = Handler::new(StatusCode::CREATED);
            let layer = IdempotencyLayer::builder(store.clone())
                .prefix("hostile")
                .scope(Header::new(API_KEY))
                .build()
                .unwrap();
            let service = ServiceBuilder::new().layer(layer).service(handler.clone());
            let status = on_redis_runtime(async {
                let request = Request::post("/pay")
                    .header(IDEMPOTENCY_KEY, HeaderValue::from_bytes(&key).unwrap())
                    .header(API_KEY, HeaderValue::from_bytes(&scope).unwrap())
                    .body(String::new())
                    .unwrap();
                let response = service.oneshot(request).await.unwrap();
                let status = response.status();
                response.into_body().collect().await.unwrap();
                status
            });
            let keys = all_keys(&server);
            if scope.is_empty() {
                // an empty scope names no caller: refused, nothing run or written
                prop_assert_eq!(status, StatusCode::BAD_REQUEST);
                prop_assert_eq!(handler.runs(), 0);
                prop_assert!(keys.is_empty(), "keys {:?}", keys);
                return Ok(());
            }
            prop_assert_eq!(status, StatusCode::CREATED);
            prop_assert_eq!(handler.runs(), 1);
            prop_assert_eq!(keys.len(), 1, "keys {:?}", keys);
            check_store_key(&keys[0], &["hostile:idem:{"])?;
            Ok(())
        },
    );
}

// ---------------------------------------------------------------------------------------------
// 5. Oversized input
// ---------------------------------------------------------------------------------------------

/// A request body of `len` bytes in chunks of `chunk` bytes, produced lazily; `pulled` counts
/// the bytes the layer has taken from it.
fn lazy_body(
    len: usize,
    chunk: usize,
    pulled: &Arc<AtomicUsize>,
) -> StreamBody<impl futures_util::Stream<Item = Result<Frame<Bytes>, Infallible>> + Send + 'static>
{
    static ZEROS: [u8; 1 << 16] = [b'z'; 1 << 16];
    let chunk = chunk.clamp(1, ZEROS.len());
    let pulled = Arc::clone(pulled);
    let sizes = (0..len.div_ceil(chunk)).map(move |i| chunk.min(len - i * chunk));
    StreamBody::new(stream::iter(sizes).map(move |size| {
        pulled.fetch_add(size, Ordering::SeqCst);
        Ok(Frame::data(Bytes::from_static(&ZEROS[..size])))
    }))
}

#[test]
fn bodies_over_the_limit_get_413_exactly_and_are_not_buffered() {
    let case = (0usize..4096).prop_flat_map(|limit| {
        (
            Just(limit),
            prop_oneof![
                (limit.saturating_sub(3))..=(limit + 3),
                0..=(2 * limit + 16),
            ],
            1usize..=1024,
            any::<bool>(),
        )
    });
    check(192, case, |(limit, len, chunk, with_length)| {
        runtime().block_on(async {
            let handler = Handler::new(StatusCode::CREATED);
            let layer = IdempotencyLayer::builder(MemoryStore::new())
                .unscoped()
                .body_limit(limit)
                .build()
                .unwrap();
            let service = ServiceBuilder::new().layer(layer).service(handler.clone());
            let pulled = Arc::new(AtomicUsize::new(0));
            let mut request = Request::post("/upload").header(IDEMPOTENCY_KEY, "k");
            if with_length {
                request = request.header(http::header::CONTENT_LENGTH, len);
            }
            let request = request.body(lazy_body(len, chunk, &pulled)).unwrap();
            let response = service.oneshot(request).await.unwrap();
            let expected = if len > limit {
                StatusCode::PAYLOAD_TOO_LARGE
            } else {
                StatusCode::CREATED
            };
            prop_assert_eq!(response.status(), expected, "limit {} body {}", limit, len);
            prop_assert_eq!(handler.runs(), usize::from(len <= limit));
            prop_assert!(
                pulled.load(Ordering::SeqCst) <= limit + chunk,
                "read {} bytes past a limit of {}",
                pulled.load(Ordering::SeqCst),
                limit
            );
            Ok(())
        })
    });
}

#[test]
fn a_64_mib_body_is_refused_after_reading_about_the_limit() {
    const HUGE: usize = 64 << 20;
    let case = (
        0usize..=(2 << 20),
        prop_oneof![Just(None), Just(Some(HUGE)), (0usize..100).prop_map(Some)],
    );
    check(16, case, |(limit, declared)| {
        runtime().block_on(async {
            let handler = Handler::new(StatusCode::CREATED);
            let layer = IdempotencyLayer::builder(MemoryStore::new())
                .unscoped()
                .body_limit(limit)
                .build()
                .unwrap();
            let service = ServiceBuilder::new().layer(layer).service(handler.clone());
            let pulled = Arc::new(AtomicUsize::new(0));
            let mut request = Request::post("/upload").header(IDEMPOTENCY_KEY, "k");
            if let Some(declared) = declared {
                // the truth, or a lie
                request = request.header(http::header::CONTENT_LENGTH, declared);
            }
            let request = request.body(lazy_body(HUGE, 1 << 16, &pulled)).unwrap();
            let response = service.oneshot(request).await.unwrap();
            prop_assert_eq!(response.status(), StatusCode::PAYLOAD_TOO_LARGE);
            prop_assert_eq!(handler.runs(), 0);
            let read = pulled.load(Ordering::SeqCst);
            prop_assert!(
                read <= limit + (1 << 16),
                "read {} bytes for a limit of {}",
                read,
                limit
            );
            Ok(())
        })
    });
}

#[test]
fn a_16_kib_header_value_still_makes_a_short_store_key() {
    let server = RedisServer::start();
    let store = redis_store(&server);
    let huge = || {
        (any::<u64>(), (12usize << 10)..=(16 << 10))
            .prop_map(|(seed, len)| spun_header_bytes(seed, len))
    };
    check(16, (huge(), huge(), algorithm()), |(a, b, algorithm)| {
        prop_assume!(a != b);
        rate_limit_round_on_redis(&server, &store, &a, &b, algorithm)?;
        for key in all_keys(&server) {
            let usage: Option<u64> = redis::cmd("MEMORY")
                .arg("USAGE")
                .arg(&key)
                .query(&mut server.conn())
                .unwrap();
            let usage = usage.unwrap_or(0);
            prop_assert!(usage < 1024, "{} bytes of memory for one key", usage);
        }
        Ok(())
    });
}

// ---------------------------------------------------------------------------------------------
// 6. Claims and locks with arbitrary names
// ---------------------------------------------------------------------------------------------

fn name_bytes() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        4 => prop::collection::vec(any::<u8>(), 0..32),
        2 => prop::collection::vec(prop::sample::select(vec![b'{', b'}', b'*', b':', b'\n', b'\r', 0, 0xff]), 0..16),
        1 => (any::<u64>(), 0usize..=4096).prop_map(|(seed, len)| {
            let mut bytes = spun_header_bytes(seed, len);
            // any bytes at all: controls, NUL, CR LF
            bytes.iter_mut().step_by(7).for_each(|b| *b = b.wrapping_mul(31) % 32);
            bytes
        }),
    ]
}

#[test]
fn claims_and_locks_with_arbitrary_names_on_redis() {
    let server = RedisServer::start();
    let store = redis_store(&server);
    let claims = Claims::new(store.clone()).with_prefix("hostile").unwrap();
    let locks = Locks::new(store).with_prefix("hostile").unwrap();
    check(96, (name_bytes(), name_bytes()), |(a, b)| {
        prop_assume!(a != b);
        flush(&server);
        let lease = Duration::from_secs(30);
        on_redis_runtime(async {
            let first = claims.claim_once_as(&a, "holder-a", None).await.unwrap();
            let again = claims.claim_once_as(&a, "holder-x", None).await.unwrap();
            let other = claims.claim_once_as(&b, "holder-b", None).await.unwrap();
            prop_assert!(first.won());
            prop_assert!(!again.won());
            prop_assert_eq!(again.holder(), "holder-a");
            prop_assert!(other.won(), "two names shared a claim");
            prop_assert_eq!(other.holder(), "holder-b");

            let guard_a = locks.try_acquire(&a, lease).await.unwrap();
            let busy = locks.try_acquire(&a, lease).await;
            prop_assert!(matches!(busy, Err(LockError::Busy { .. })), "{busy:?}");
            let guard_b = locks.try_acquire(&b, lease).await;
            prop_assert!(guard_b.is_ok(), "two names shared a lock: {guard_b:?}");
            let guard_b = guard_b.unwrap();

            let keys = all_keys(&server);
            // two claims, two locks, two fencing counters
            prop_assert_eq!(keys.len(), 6, "keys {:?}", keys);
            let mut tags = HashSet::new();
            for key in &keys {
                tags.insert(check_store_key(
                    key,
                    &["hostile:claim:{", "hostile:lock:{"],
                )?);
            }
            prop_assert_eq!(tags.len(), 4, "keys {:?}", keys);

            guard_a.release().await.unwrap();
            guard_b.release().await.unwrap();
            prop_assert!(claims.release(&first).await.unwrap());
            prop_assert!(claims.release(&other).await.unwrap());
            Ok(())
        })
    });
}
