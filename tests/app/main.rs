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
#[path = "../../examples/app/router.rs"]
pub mod router;

mod ambiguity;
mod app;
mod app_coordination;
mod jobs;
mod operations;
mod parsers;
mod secrets;
mod tokens;
mod transfers;
