//! The stores: the conformance suite on every backend (memory, Redis, Redis Cluster, PostgreSQL
//! and a store written outside the crate), then each backend beyond it — scripts run twice,
//! durable writes, late delivery, batches, bounded memory, given connections, TLS (Redis and
//! PostgreSQL), PostgreSQL specifics, errors that name their cause, outages, and no password in any output.
//!
//! One test binary, a module per theme; the harness's shared servers (the Redis Cluster, the
//! PostgreSQL server) are started once for all of them, each test on keys or a schema of its own.

#[path = "../common/mod.rs"]
mod common;

mod batches;
mod bounded;
mod conformance_cluster;
mod conformance_memory;
mod conformance_postgres;
mod conformance_redis;
mod durable;
mod errors;
mod functions;
mod given_connections;
mod late_delivery;
mod late_resend;
mod ledger;
mod ledger_redis;
mod outages;
mod outside_store;
mod postgres;
mod postgres_once;
mod postgres_tls;
mod scripts;
mod secrets;
mod sentinel_auth;
mod spans;
mod tls;
