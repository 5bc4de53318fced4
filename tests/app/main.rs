//! The example app (`examples/app`) in-process and as its binary, on real redis-server and
//! PostgreSQL processes: limits, coordination across copies, ambiguous store answers, and the
//! parsers of its configuration.
//!
//! One test binary, a module per theme. Two files on the app keep a binary of their own:
//! `tests/failover.rs`, whose tests measure failover times one at a time, and `tests/flood.rs`,
//! which measures the process's resident memory.

#[path = "../common/mod.rs"]
mod common;

// The app's routes and the examples' shared configuration, declared once at the root, where
// the router finds `crate::env`.
#[path = "../../examples/shared/env.rs"]
pub mod env;
#[path = "../../examples/llm_gateway/gateway.rs"]
pub mod llm_gateway;
#[path = "../../examples/app/router.rs"]
pub mod router;

/// An `APP_API_KEYS` table for tests: each of `tenants` has the API key of its own name, on plan
/// `free`, or on the plan after a `=` (`"acme=pro"`).
#[allow(clippy::unwrap_used)]
pub(crate) fn own_keys(tenants: &[&str]) -> router::ApiKeys {
    router::ApiKeys::parse(&own_keys_var(tenants)).unwrap()
}

/// [`own_keys`] as the value of `APP_API_KEYS`.
pub(crate) fn own_keys_var(tenants: &[&str]) -> String {
    tenants
        .iter()
        .map(|entry| {
            let (tenant, plan) = entry.split_once('=').unwrap_or((entry, "free"));
            format!("{tenant}:{tenant}:{plan}")
        })
        .collect::<Vec<_>>()
        .join(",")
}

mod admin;
mod ambiguity;
mod app;
mod app_coordination;
mod gateway_session;
mod jobs;
mod operations;
mod parsers;
mod secrets;
mod tokens;
mod transfers;
