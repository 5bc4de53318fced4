//! The store-key layout: every key tollgate reads or writes is built here, and nowhere else.
//! (A *store key* says where state lives; a caller's [`Key`], from `key/`, says who a request
//! counts against, and appears in a store key only as its digest.)
//!
//! A key is `<prefix>:<kind>:{<digest>}` plus, for rate limits, `:<limit>:<algorithm>`. The
//! digest (a [`Key`], 22 characters of base64url) stands for whatever the user supplied — a
//! caller, a claim or lock name, an idempotency key — so user input never reaches the store raw.
//! It is wrapped in braces, the Redis Cluster hash tag: all keys one operation touches (a caller's
//! limits, a lock and its fencing counter) land in one slot, and prefixes may not contain braces
//! ([`check_prefix`]) so that nothing else can select the slot.
//!
//! | kind | key |
//! | --- | --- |
//! | rate limit | `<prefix>:rl:{<caller>}:<limit>:<log\|ctr\|gcra>` |
//! | a limit's block (its `block_for` penalty) | the limit's key plus `:block` |
//! | rate call record, reservation place (Redis) | `<prefix>:rl:{<caller>}:charged:<call>`, `<prefix>:rl:{<caller>}:place:<attempt>` |
//! | claim | `<prefix>:claim:{<digest of name>}` |
//! | lock, fencing counter | `<prefix>:lock:{<digest of name>}`, the same plus `:fence` |
//! | idempotency record | `<prefix>:idem:{<digest of scope and key>}` |
//! | permits of a concurrency limit, fencing counter | `<prefix>:cc:{<caller>}`, the same plus `:fence` |
//! | their queue of waiters, the waiters' places | the permits' key plus `:queue`, `:waiting` |
//! | release marker of a claim, lock, record or permits | its key plus `:released` |
//! | a provider's pause of an outbound limit's caller, its (unused) fencing counter | `<prefix>:rl:{<caller>}:pause`, the same plus `:fence` |
//! | a rate-limit layer's limits in force, their history, its copies | `<prefix>:rl:{limits}`, the same plus `:history`, `:copies` |

use std::sync::Arc;

use crate::error::{ConfigError, ConfigErrorKind};
use crate::key::Key;

/// The prefix of every key unless configured otherwise.
pub(crate) const DEFAULT_PREFIX: &str = "tollgate";

/// A checked key prefix (see [`check_prefix`]), ready to share.
pub(crate) fn shared_prefix(prefix: impl Into<String>) -> Result<Arc<str>, ConfigError> {
    let prefix = prefix.into();
    check_prefix(&prefix)?;
    Ok(Arc::from(prefix))
}

/// Whether `name` may name a limit, a tier or an advertised policy: one or more ASCII letters,
/// digits, `-`, `_` and `.` — a store-key segment and a `RateLimit` header token, unescaped.
pub(crate) fn is_name(name: &str) -> bool {
    !name.is_empty()
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
}

/// Checks a store key prefix: visible ASCII without braces, so that it can neither select a
/// Redis Cluster hash slot nor split a key's hash tag.
pub(crate) fn check_prefix(prefix: &str) -> Result<(), ConfigError> {
    if !prefix.is_empty()
        && prefix
            .bytes()
            .all(|b| b.is_ascii_graphic() && b != b'{' && b != b'}')
    {
        Ok(())
    } else {
        Err(ConfigError::new(
            ConfigErrorKind::Prefix,
            format!("invalid key prefix {prefix:?}: use visible ASCII without braces"),
        ))
    }
}

/// `<head>:{<key>}`, with room for `extra` more bytes.
fn tagged(head: &str, key: &Key, extra: usize) -> String {
    let mut out = String::with_capacity(head.len() + 25 + extra);
    out.push_str(head);
    out.push_str(":{");
    key.write_encoded(&mut out);
    out.push('}');
    out
}

/// The namespace of a rate-limit layer's keys: `<prefix>:rl`.
pub(crate) fn rate_namespace(prefix: &str) -> String {
    format!("{prefix}:rl")
}

/// The namespace of a concurrency limit's keys and limits in force: `<prefix>:cc`.
pub(crate) fn concurrency_namespace(prefix: &str) -> String {
    format!("{prefix}:cc")
}

/// The keys of the limits in force of rate namespace `namespace` and of their history:
/// `<namespace>:{limits}` and the same plus `:history`, in one slot.
#[cfg_attr(not(feature = "redis"), allow(dead_code))]
pub(crate) fn limit_table(namespace: &str) -> (String, String) {
    let table = format!("{namespace}:{{limits}}");
    let history = format!("{table}:history");
    (table, history)
}

/// The key of the copies registered under rate namespace `namespace`: `<namespace>:{limits}:copies`.
#[cfg_attr(not(feature = "redis"), allow(dead_code))]
pub(crate) fn limit_copies(namespace: &str) -> String {
    format!("{namespace}:{{limits}}:copies")
}

/// Writes the key of limit `limit` under `algorithm` (its tag) in `namespace` for caller `key`
/// into `out`, in place of what it held (one buffer serves every key of a call):
/// `<namespace>:{<key>}:<limit>:<algorithm>`.
pub(crate) fn write_rate(
    out: &mut String,
    namespace: &str,
    key: &Key,
    limit: &str,
    algorithm: &str,
) {
    out.clear();
    out.push_str(namespace);
    out.push_str(":{");
    key.write_encoded(out);
    out.push_str("}:");
    out.push_str(limit);
    out.push(':');
    out.push_str(algorithm);
}

/// Writes the key of the block of limit `limit` under `algorithm` in `namespace` for caller
/// `key` into `out`, in place of what it held: the limit's key plus `:block`, in its slot.
/// PostgreSQL's `check_rate` names its block rows so too (see `migrations/0009_base.sql`).
pub(crate) fn write_rate_block(
    out: &mut String,
    namespace: &str,
    key: &Key,
    limit: &str,
    algorithm: &str,
) {
    write_rate(out, namespace, key, limit, algorithm);
    out.push_str(":block");
}

#[cfg(feature = "redis")]
/// Writes the record of the rate call `call` whose first check is caller `key`'s in `namespace`
/// into `out`: `<namespace>:{<digest>}:charged:<call, 16 hex digits>`, in the slot of that
/// caller's keys (a Cluster call holds one caller's checks).
pub(crate) fn write_rate_record(out: &mut String, namespace: &str, key: &Key, call: u64) {
    use std::fmt::Write as _;
    out.clear();
    out.push_str(namespace);
    out.push_str(":{");
    key.write_encoded(out);
    let _ = write!(out, "}}:charged:{call:016x}");
}

#[cfg(feature = "redis")]
/// Writes the place of reservation `attempt` by caller `key` in `namespace` into `out`: where its
/// charge went, kept for its settlement, `<namespace>:{<digest>}:place:<attempt, 16 hex digits>`,
/// in the slot of that caller's keys.
pub(crate) fn write_rate_place(out: &mut String, namespace: &str, key: &Key, attempt: u64) {
    use std::fmt::Write as _;
    out.clear();
    out.push_str(namespace);
    out.push_str(":{");
    key.write_encoded(out);
    let _ = write!(out, "}}:place:{attempt:016x}");
}

/// The key of a provider's pause of caller `key` under an outbound limit of `namespace`, and the
/// fencing counter its reads name (never written), in the caller's slot:
/// `<namespace>:{<key>}:pause`, the same plus `:fence`.
pub(crate) fn provider_pause(namespace: &str, key: &Key) -> (String, String) {
    let mut pause = String::with_capacity(namespace.len() + 32);
    pause.push_str(namespace);
    pause.push_str(":{");
    key.write_encoded(&mut pause);
    pause.push_str("}:pause");
    let fence = format!("{pause}:fence");
    (pause, fence)
}

/// The key of claim `name`: `<prefix>:claim:{<digest>}`.
pub(crate) fn claim(prefix: &str, name: &[u8]) -> String {
    tagged(&format!("{prefix}:claim"), &Key::new("claim", name), 0)
}

/// The key of lock `name` and of its fencing counter, in the same slot.
pub(crate) fn lock(prefix: &str, name: &[u8]) -> (String, String) {
    let key = tagged(&format!("{prefix}:lock"), &Key::new("lock", name), 6);
    let fence = format!("{key}:fence");
    (key, fence)
}

/// The permits of caller `key` under a concurrency limit, and their fencing counter, in the same
/// slot: `<prefix>:cc:{<key>}` and `<prefix>:cc:{<key>}:fence`.
pub(crate) fn permits(prefix: &str, key: &Key) -> (String, String) {
    let permits = tagged(&concurrency_namespace(prefix), key, 6);
    let fence = format!("{permits}:fence");
    (permits, fence)
}

#[cfg(feature = "redis")]
/// The release marker of a lock, claim or idempotency record `key`: `<key>:released`, in the
/// same slot. It names the release call that deleted the key, so that the same call re-sent
/// still answers "released".
pub(crate) fn release_marker(key: &str) -> String {
    format!("{key}:released")
}

#[cfg(feature = "redis")]
/// The queue of waiters for the permits `key`, and their places: `<key>:queue` and
/// `<key>:waiting`, in the same slot.
pub(crate) fn permit_queue(key: &str) -> (String, String) {
    (format!("{key}:queue"), format!("{key}:waiting"))
}

#[cfg(feature = "redis")]
/// The pending marker of `key` (same hash tag): a durable write that replicas have not
/// acknowledged yet.
pub(crate) fn pending_marker(key: &str) -> String {
    format!("{key}:pending")
}

/// The key of the idempotency record for `idempotency_key` within `scope` (`None`: the unscoped
/// namespace): `<prefix>:idem:{<digest>}`. Scope and key are hashed together, unambiguously.
pub(crate) fn idempotency_record(
    prefix: &str,
    scope: Option<Key>,
    idempotency_key: &str,
) -> String {
    let mut material = Vec::with_capacity(17 + idempotency_key.len());
    match scope {
        Some(scope) => {
            material.push(1);
            material.extend_from_slice(scope.as_bytes());
        }
        None => material.push(0),
    }
    material.extend_from_slice(idempotency_key.as_bytes());
    tagged(&format!("{prefix}:idem"), &Key::new("idem", &material), 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_kind_of_key_has_one_hash_tag_after_its_prefix() {
        let caller = Key::new("test", b"alice");
        let mut rate = String::from("left over");
        write_rate(&mut rate, &rate_namespace("app"), &caller, "s", "gcra");
        assert_eq!(rate, format!("app:rl:{{{caller}}}:s:gcra"));
        write_rate_block(&mut rate, &rate_namespace("app"), &caller, "s", "gcra");
        assert_eq!(rate, format!("app:rl:{{{caller}}}:s:gcra:block"));
        #[cfg(feature = "redis")]
        {
            let mut place = String::from("left over");
            write_rate_place(&mut place, &rate_namespace("app"), &caller, 0xa1);
            assert_eq!(place, format!("app:rl:{{{caller}}}:place:00000000000000a1"));
        }
        let (lock, fence) = lock("app", b"report");
        assert_eq!(fence, format!("{lock}:fence"));
        assert_eq!(release_marker(&lock), format!("{lock}:released"));
        let (permits, permit_fence) = permits("app", &caller);
        assert_eq!(permits, format!("app:cc:{{{caller}}}"));
        assert_eq!(permit_fence, format!("{permits}:fence"));
        for key in [
            claim("app", b"c"),
            lock,
            permits,
            idempotency_record("app", None, "k"),
        ] {
            assert_eq!(key.matches('{').count(), 1, "{key}");
            assert!(key.starts_with("app:") && key.ends_with('}'), "{key}");
        }
        assert_ne!(
            idempotency_record("app", None, "k"),
            idempotency_record("app", Some(caller), "k")
        );
    }

    #[test]
    fn prefixes_that_could_split_a_hash_tag_are_refused() {
        for bad in ["", "{}", "a}", "a{", "a b", "é"] {
            assert_eq!(
                check_prefix(bad).unwrap_err().kind(),
                ConfigErrorKind::Prefix
            );
        }
        assert!(check_prefix("app:v2").is_ok());
    }
}
