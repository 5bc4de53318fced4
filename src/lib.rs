//! Tower middleware for services that run as many copies: rate limits, idempotency keys and locks
//! kept in a store that every copy sees.
#![cfg_attr(docsrs, feature(doc_cfg))]

pub mod body;
pub mod claim;
pub mod error;
pub mod grpc;
pub mod key;
pub mod lock;
pub mod rate_limit;
pub mod store;

pub use error::ConfigError;
pub use rate_limit::{Limit, RateLimitLayer};
