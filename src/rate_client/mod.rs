//! The rate client: what one copy keeps of a rate-limit layer's limits, in front of the store.
//!
//! The [`RateLimitLayer`](crate::rate_limit::RateLimitLayer) is HTTP glue: it finds a request's
//! key, cost and tier, asks the client one thing — [`RateClient::decide`] — and turns the
//! answer into a response. The client answers either at once ([`Decided::Now`]) or once the
//! store has ([`Decided::Pending`]), and every answer ([`Verdict`]) names where it came from
//! ([`DecisionSource`]):
//!
//! | source | what answered | kept where |
//! | --- | --- | --- |
//! | [`Lease`](DecisionSource::Lease) | a slice of the caller's quota this copy leased from the store | `lease/` |
//! | [`DenyCache`](DecisionSource::DenyCache) | a denial of the store, still in force | `deny_cache.rs` |
//! | [`Store`](DecisionSource::Store) | the store (directly, or with a slice fetched for the request) | the store |
//! | [`LocalFallback`](DecisionSource::LocalFallback) | the in-process limiter, while the store fails | `fallback.rs` |
//! | [`StoreUnavailable`](DecisionSource::StoreUnavailable) | the failure policy, while the store fails | `decide.rs` |
//!
//! The store's invalidation broadcast keeps the slices and cached denials fresh
//! (`invalidated.rs`); settlements the client does not wait for go out one way
//! (`settle.rs`). A denied request may wait for room in its caller's line on this copy
//! (`queue.rs`, `wait.rs`). Like tower-sessions' caching store, the client wraps the store's contract
//! ([`RateStore`](crate::store::RateStore)) and the layer never branches on what it keeps.

mod client;
mod decide;
mod deny_cache;
mod fallback;
mod invalidated;
mod lease;
mod queue;
mod recipe;
pub(crate) mod settle;
mod source;
mod tiers;
mod verdict;
mod wait;

pub(crate) use client::{Decided, Pending, RateClient};
#[cfg(test)]
pub(crate) use deny_cache::{DenyCache, MAX_AGE};
pub(crate) use fallback::DEFAULT_CAPACITY as FALLBACK_CAPACITY;
pub(crate) use invalidated::{Invalidated, Listener};
pub(crate) use queue::{ArrivedAt, DEFAULT_MAX_WAITING, Gate, LONGEST_PATIENCE, Queue};
pub(crate) use recipe::TierRecipe;
pub use source::DecisionSource;
pub(crate) use tiers::{LimitsFn, Tier, TierFn, TierOptions};
pub(crate) use verdict::Verdict;
