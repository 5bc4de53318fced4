//! The harness of the properties that feed hostile input to every decoder of stored data and
//! every parser of header text: a bounded number of cases from a fixed seed, so that `cargo test`
//! stays within seconds and a failure reproduces on every run. An input found to panic becomes a
//! named test beside the decoder it broke.

use proptest::prelude::*;
use proptest::test_runner::{Config, RngAlgorithm, TestCaseError, TestRng, TestRunner};

/// Runs `test` on `cases` values of `strategy`, from the same seed each time; a panic inside
/// `test` fails the case like an error does, and is shrunk to a smallest input.
pub(crate) fn check<S: Strategy>(
    cases: u32,
    strategy: S,
    test: impl Fn(S::Value) -> Result<(), TestCaseError>,
) {
    let config = Config {
        cases,
        failure_persistence: None,
        ..Config::default()
    };
    let rng = TestRng::deterministic_rng(RngAlgorithm::ChaCha);
    let mut runner = TestRunner::new_with_rng(config, rng);
    if let Err(error) = runner.run(&strategy, test) {
        panic!("{error}");
    }
}

/// Any bytes, up to `max` of them.
pub(crate) fn bytes(max: usize) -> impl Strategy<Value = Vec<u8>> {
    prop::collection::vec(any::<u8>(), 0..=max)
}

/// A length or count as a hostile writer picks it: the edges of the integer types, the sizes at
/// which collections refuse to grow, and small numbers.
pub(crate) fn hostile_u32() -> impl Strategy<Value = u32> {
    prop_oneof![
        Just(0),
        Just(1),
        Just(u32::MAX),
        Just(u32::MAX - 1),
        Just(1 << 31),
        Just(1 << 15),
        Just((1 << 15) + 1),
        Just(24_577),
        Just(1_000_000_000),
        0u32..64,
        any::<u32>(),
    ]
}

/// An integer as a hostile store answers it: the edges, small numbers either side of zero, and
/// anything.
pub(crate) fn hostile_i64() -> impl Strategy<Value = i64> {
    prop_oneof![
        Just(i64::MIN),
        Just(i64::MIN + 1),
        Just(i64::MAX),
        Just(-2),
        Just(-1),
        Just(0),
        Just(1),
        Just(2),
        Just(3),
        -4i64..64,
        any::<i64>(),
    ]
}

/// `encoded` spoilt the way a corrupt or crafted record is: cut short, a byte changed, a
/// 4-byte length or count overwritten with `count`, or bytes added at the end. `choice` picks
/// the way and `at` the place.
pub(crate) fn spoil(encoded: &[u8], choice: u8, at: usize, count: u32, extra: &[u8]) -> Vec<u8> {
    let mut out = encoded.to_vec();
    let at = at % (out.len() + 1);
    match choice % 4 {
        0 => out.truncate(at),
        1 => {
            if let Some(byte) = out.get_mut(at) {
                *byte ^= extra.first().copied().unwrap_or(0xff) | 1;
            }
        }
        2 => {
            let end = (at + 4).min(out.len());
            let start = end.saturating_sub(4);
            let written = count.to_be_bytes();
            out.splice(start..end, written.iter().copied());
        }
        _ => out.extend_from_slice(extra),
    }
    out
}

/// What [`spoil`] needs besides the encoding: the way, the place, a count and some bytes.
pub(crate) fn spoiling() -> impl Strategy<Value = (u8, usize, u32, Vec<u8>)> {
    (any::<u8>(), any::<usize>(), hostile_u32(), bytes(16))
}

/// A reply as a hostile or broken Redis could send it: any type, nested, with hostile integers
/// and bytes, and the server errors a script or command fails with.
#[cfg(feature = "redis")]
pub(crate) fn redis_reply() -> impl Strategy<Value = redis::Value> {
    use redis::Value;
    let text = || bytes(16).prop_map(|b| String::from_utf8_lossy(&b).into_owned());
    let leaf = prop_oneof![
        1 => Just(Value::Nil),
        1 => Just(Value::Okay),
        4 => hostile_i64().prop_map(Value::Int),
        1 => hostile_i64().prop_map(|n| Value::BulkString(n.to_string().into_bytes())),
        2 => bytes(24).prop_map(Value::BulkString),
        1 => text().prop_map(Value::SimpleString),
        1 => any::<f64>().prop_map(Value::Double),
        1 => any::<bool>().prop_map(Value::Boolean),
        1 => text().prop_filter_map("a server error", |text| {
            let line = text.replace(['\r', '\n'], " ");
            redis::parse_redis_value(format!("-ERR {line}\r\n").as_bytes()).ok()
        }),
    ];
    leaf.prop_recursive(2, 16, 6, |inner| {
        prop_oneof![
            3 => prop::collection::vec(inner.clone(), 0..6).prop_map(Value::Array),
            1 => prop::collection::vec(inner.clone(), 0..3).prop_map(Value::Set),
            1 => prop::collection::vec((inner.clone(), inner), 0..3).prop_map(Value::Map),
        ]
    })
}

/// Several replies, as a script's array answer holds them.
#[cfg(feature = "redis")]
pub(crate) fn redis_replies(max: usize) -> impl Strategy<Value = Vec<redis::Value>> {
    prop::collection::vec(redis_reply(), 0..=max)
}

mod stored_key;
