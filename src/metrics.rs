//! Metrics through the [`metrics`](https://docs.rs/metrics) facade, with the `metrics` feature:
//! the application installs the recorder (say, `metrics-exporter-prometheus`); without one, or
//! without the feature, nothing is recorded and nothing is paid.
//!
//! | series | kind | labels | what |
//! | --- | --- | --- | --- |
//! | [`RATE_LIMIT_DECISIONS`] | counter | `limiter`, `outcome`, `source` | rate-limit decisions; `limiter` is the layer's key namespace (`<prefix>:rl`), `outcome` `admitted` or `denied` (in shadow mode a denial is counted as one, though the request goes on), `source` `store`, `deny_cache`, `local_fallback` or `store_unavailable` |
//! | [`RATE_LIMIT_WAIT`] | histogram (seconds) | `limiter`, `outcome` | how long a request that waited for room ([`queue`](crate::rate_limit::RateLimitLayerBuilder::queue)) waited, from its arrival to its decision; `outcome` `admitted` or `denied` (its room came too late, its patience ended before its turn, or a provider's pause outlasted it) |
//! | [`STORE_CALL_DURATION`] | histogram (seconds) | `operation` | each call of a [`RedisStore`](crate::store::RedisStore) to Redis or a `PgStore` to PostgreSQL, answered or not; a batch of rate checks is one `rate_check` call |
//! | [`STORE_ERRORS`] | counter | `operation`, `kind` | failed store calls; `kind` `timeout`, `unavailable`, `protocol` or `config` |
//! | [`IDEMPOTENCY_REQUESTS`] | counter | `outcome` | keyed requests: `executed` (claimed, the handler ran), `replayed`, `conflict` (another request holds the key), `mismatch` (the key was used with another request), `rejected` (any other refusal: bad key, too large, store down, ...) |
//! | [`LOCK_ACQUISITIONS`] | counter | `outcome` | lock attempts: `acquired`, `busy` or `error` |
//! | [`LIMITS_IN_FORCE`] | gauge | `limiter`, `drift` | the version of the [limits in force](crate::rate::LimitTable) a layer built with [`build_in_store`](crate::rate_limit::RateLimitLayerBuilder::build_in_store) decides with; `drift` `true` when the limits the copy was built with differ from the defaults in force |
//! | [`CONCURRENCY_DECISIONS`] | counter | `limiter`, `outcome`, `source` | concurrency-limit decisions; `limiter` is the layer's key namespace (`<prefix>:cc`), `outcome` `admitted` or `denied`, `source` `store`, `local_fallback` or `store_unavailable` |
//!
//! Store operations: `rate_check`, `reset_rate`, `claim`, `lock_acquire`, `lock_extend`,
//! `lock_release`, `idempotency_begin`, `idempotency_complete`, `idempotency_release`,
//! `idempotency_extend`, `permit_acquire`, `permit_extend`, `permit_release`, `ping`; on PostgreSQL also `purge_expired` (one per batch),
//! `invalidate` (the notification of a refund, see [Invalidations](crate::store#invalidations)),
//! and `once_begin` / `once_commit` for the runs of `PgStore::once` and `IdempotencyLayer::in_transaction`.

#[cfg(any(feature = "redis", feature = "postgres"))]
use std::time::Duration;

/// Counter: rate-limit decisions.
pub const RATE_LIMIT_DECISIONS: &str = "tollgate_rate_limit_decisions_total";
/// Histogram: seconds per store call.
pub const STORE_CALL_DURATION: &str = "tollgate_store_call_duration_seconds";
/// Counter: failed store calls.
pub const STORE_ERRORS: &str = "tollgate_store_errors_total";
/// Counter: keyed requests of the idempotency layer.
pub const IDEMPOTENCY_REQUESTS: &str = "tollgate_idempotency_requests_total";
/// Counter: lock acquisition attempts.
pub const LOCK_ACQUISITIONS: &str = "tollgate_lock_acquisitions_total";

/// Gauge: the version of the limits in force a layer decides with.
pub const LIMITS_IN_FORCE: &str = "tollgate_limits_in_force_version";

/// Layer `limiter` decides with version `version` of its limits in force; `drift` when the
/// copy was built with other defaults.
#[cfg_attr(not(feature = "metrics"), allow(unused_variables))]
pub(crate) fn limits_in_force(limiter: &std::sync::Arc<str>, version: u64, drift: bool) {
    #[cfg(feature = "metrics")]
    metrics::gauge!(
        LIMITS_IN_FORCE,
        "limiter" => metrics::SharedString::from(std::sync::Arc::clone(limiter)),
        "drift" => if drift { "true" } else { "false" },
    )
    .set(version as f64);
}

/// Counter: concurrency-limit decisions.
pub const CONCURRENCY_DECISIONS: &str = "tollgate_concurrency_decisions_total";

/// Histogram: seconds a request of a rate-limit layer with a queue waited for room.
pub const RATE_LIMIT_WAIT: &str = "tollgate_rate_limit_wait_seconds";

/// A request of `limiter` waited `waited` for room, then was admitted or refused.
#[cfg_attr(not(feature = "metrics"), allow(unused_variables))]
pub(crate) fn rate_wait(
    limiter: &std::sync::Arc<str>,
    admitted: bool,
    waited: std::time::Duration,
) {
    #[cfg(feature = "metrics")]
    metrics::histogram!(
        RATE_LIMIT_WAIT,
        "limiter" => metrics::SharedString::from(std::sync::Arc::clone(limiter)),
        "outcome" => if admitted { "admitted" } else { "denied" },
    )
    .record(waited.as_secs_f64());
}

/// A rate-limit decision of `limiter`.
#[cfg_attr(not(feature = "metrics"), allow(unused_variables))]
pub(crate) fn rate_decision(limiter: &std::sync::Arc<str>, admitted: bool, source: &'static str) {
    #[cfg(feature = "metrics")]
    metrics::counter!(
        RATE_LIMIT_DECISIONS,
        "limiter" => metrics::SharedString::from(std::sync::Arc::clone(limiter)),
        "outcome" => if admitted { "admitted" } else { "denied" },
        "source" => source,
    )
    .increment(1);
}

/// A store call of `operation` that took `elapsed` and failed with an error of kind `error`
/// (`timeout`, `unavailable`, …), if it failed.
#[cfg(any(feature = "redis", feature = "postgres"))]
#[cfg_attr(not(feature = "metrics"), allow(unused_variables))]
pub(crate) fn store_call(operation: &'static str, elapsed: Duration, error: Option<&'static str>) {
    #[cfg(feature = "metrics")]
    {
        metrics::histogram!(STORE_CALL_DURATION, "operation" => operation)
            .record(elapsed.as_secs_f64());
        if let Some(kind) = error {
            metrics::counter!(STORE_ERRORS, "operation" => operation, "kind" => kind).increment(1);
        }
    }
}

/// A keyed request of the idempotency layer, and how it ended.
#[cfg_attr(not(feature = "metrics"), allow(unused_variables))]
pub(crate) fn idempotency(outcome: &'static str) {
    #[cfg(feature = "metrics")]
    metrics::counter!(IDEMPOTENCY_REQUESTS, "outcome" => outcome).increment(1);
}

/// A lock attempt, and how it ended.
#[cfg_attr(not(feature = "metrics"), allow(unused_variables))]
pub(crate) fn lock(outcome: &'static str) {
    #[cfg(feature = "metrics")]
    metrics::counter!(LOCK_ACQUISITIONS, "outcome" => outcome).increment(1);
}

/// A concurrency-limit decision of `limiter`.
#[cfg_attr(not(feature = "metrics"), allow(unused_variables))]
pub(crate) fn concurrency_decision(
    limiter: &std::sync::Arc<str>,
    admitted: bool,
    source: &'static str,
) {
    #[cfg(feature = "metrics")]
    metrics::counter!(
        CONCURRENCY_DECISIONS,
        "limiter" => metrics::SharedString::from(std::sync::Arc::clone(limiter)),
        "outcome" => if admitted { "admitted" } else { "denied" },
        "source" => source,
    )
    .increment(1);
}
