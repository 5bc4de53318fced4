//! The layers: rate limits and idempotency in tower, axum, hyper and tonic (the `grpc` and
//! `hyper` examples' servers), their configuration (the `config` example's service from its
//! TOML file), ambiguous store answers below them, hostile input, and the committed gRPC code.
//!
//! One test binary, a module per theme.

#[path = "../common/mod.rs"]
mod common;

// The examples' modules the tests serve, declared once at the root, where `grpc_config` finds
// `crate::env`.
#[path = "../../examples/config/service.rs"]
pub mod config_service;
#[path = "../../examples/shared/env.rs"]
pub mod env;
#[path = "../../examples/grpc/config.rs"]
pub mod grpc_config;
#[path = "../../examples/grpc/server.rs"]
pub mod grpc_server;
#[path = "../../examples/hyper/server.rs"]
pub mod hyper_server;

#[macro_use]
mod metered;

mod ambiguity_layers;
mod body_settlement;
mod composition;
mod config;
mod config_example;
mod copies_property;
mod crafted_records;
mod grpc;
mod grpc_codegen;
mod grpc_metered;
mod header_text;
mod hostile_input;
mod hostile_tenants;
mod hyper;
mod idempotency;
mod in_transaction;
mod let_out;
mod limits_in_store;
mod outbound;
mod outbound_fairness;
mod outbound_tokens;
mod planted_state;
mod rate_limit_frameworks;
mod rate_limit_invalidations;
mod rate_limit_layer;
mod rate_limit_lease_fetches;
mod rate_limit_lease_late;
mod rate_limit_lease_stacked;
mod rate_limit_leases;
mod rate_limit_queue;
mod streamed_usage;
