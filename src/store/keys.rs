//! The store keys the layers and [`Locks`](crate::lock::Locks) name, for tools that read what
//! a service keeps: with the service's prefix and the same inputs, each function answers the key
//! the service writes, so that [`LockStore::lock_state`](super::LockStore::lock_state),
//! [`PermitStore::permit_usage`](super::PermitStore::permit_usage) and
//! [`IdempotencyStore::idempotency_state`](super::IdempotencyStore::idempotency_state) read it.
//!
//! A key holds a digest of what the user supplied (a lock name, a caller, an idempotency key),
//! wrapped in a Redis Cluster hash tag, never the value itself:
//!
//! ```
//! use tollgate::key::Key;
//! use tollgate::store::keys;
//!
//! let (lock, fence) = keys::lock(keys::DEFAULT_PREFIX, "nightly-report").unwrap();
//! assert!(lock.starts_with("tollgate:lock:{") && lock.ends_with('}'));
//! assert_eq!(fence, format!("{lock}:fence"));
//! let tenant = Key::new("header:x-tenant", b"42");
//! assert_eq!(keys::permits("app", &tenant).unwrap(), format!("app:cc:{{{tenant}}}"));
//! assert!(keys::lock("{bad}", "x").is_err());
//! ```

use crate::error::ConfigError;
use crate::key::Key;
use crate::keyspace;

/// The prefix of every key unless the service configures another (`prefix`,
/// [`Locks::with_prefix`](crate::lock::Locks::with_prefix)): `tollgate`.
pub const DEFAULT_PREFIX: &str = keyspace::DEFAULT_PREFIX;

/// The key of lock `name` and of its fencing counter, as [`Locks`](crate::lock::Locks) with
/// `prefix` names them: `<prefix>:lock:{<digest>}` and the same plus `:fence`. An error for a
/// prefix a service could not have used (see
/// [`Locks::with_prefix`](crate::lock::Locks::with_prefix)).
pub fn lock(prefix: &str, name: impl AsRef<[u8]>) -> Result<(String, String), ConfigError> {
    keyspace::check_prefix(prefix)?;
    Ok(keyspace::lock(prefix, name.as_ref()))
}

/// The namespace of a [`RateLimitLayer`](crate::rate_limit::RateLimitLayer) with `prefix`, which
/// its policies and its [limits in force](crate::rate::LimitTable) are kept under:
/// `<prefix>:rl` (a tier's policy adds `:<tier>`). An error for a prefix the layer refuses.
pub fn rate_namespace(prefix: &str) -> Result<String, ConfigError> {
    keyspace::check_prefix(prefix)?;
    Ok(keyspace::rate_namespace(prefix))
}

/// The namespace of a [`ConcurrencyLimitLayer`](crate::concurrency::ConcurrencyLimitLayer) with
/// `prefix`, which its permits and its [limits in force](crate::rate::LimitTable::in_flight) are
/// kept under: `<prefix>:cc`. An error for a prefix the layer refuses.
pub fn concurrency_namespace(prefix: &str) -> Result<String, ConfigError> {
    keyspace::check_prefix(prefix)?;
    Ok(keyspace::concurrency_namespace(prefix))
}

/// The key of the permits of `key` (as the concurrency limit's extractor finds it) under a
/// [`ConcurrencyLimitLayer`](crate::concurrency::ConcurrencyLimitLayer) with `prefix`:
/// `<prefix>:cc:{<key>}`. An error for a prefix the layer refuses.
pub fn permits(prefix: &str, key: &Key) -> Result<String, ConfigError> {
    keyspace::check_prefix(prefix)?;
    Ok(keyspace::permits(prefix, key).0)
}

/// The key of the record of `idempotency_key` (the header's value) within `scope` (what the
/// layer's scope extractor finds; `None`: the unscoped namespace) under an
/// [`IdempotencyLayer`](crate::idempotency::IdempotencyLayer) with `prefix`:
/// `<prefix>:idem:{<digest of scope and key>}`. An error for a prefix the layer refuses.
pub fn idempotency_record(
    prefix: &str,
    scope: Option<Key>,
    idempotency_key: &str,
) -> Result<String, ConfigError> {
    keyspace::check_prefix(prefix)?;
    Ok(keyspace::idempotency_record(prefix, scope, idempotency_key))
}
