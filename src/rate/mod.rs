//! The rate vocabulary that both stores and the rate-limit layer speak: what is limited
//! ([`Limit`], [`Algorithm`], the validated [`RatePolicy`]) and what a check answers
//! ([`RateOutcome`], one [`LimitState`] per limit).
//!
//! A store decides a [`RatePolicy`] for a [`RateCheck`] — a caller's [`Key`](crate::key::Key), a
//! cost and an attempt id — in one atomic step on its own clock; the layer turns the
//! [`RateOutcome`] into a response. The three
//! algorithms also exist here in process, for `MemoryStore` and for a layer's local fallback,
//! with exactly the semantics of the Redis scripts.
//!
//! ```
//! use std::time::Duration;
//! use tollgate::rate::{Algorithm, Limit, RatePolicy};
//!
//! let policy = RatePolicy::new("app:rl", Algorithm::Gcra, vec![Limit::per_second("burst", 10)]).unwrap();
//! assert_eq!(policy.limits()[0].window(), Duration::from_secs(1));
//! // a policy is validated when it is built: zero quotas, say, never reach a store
//! assert!(RatePolicy::new("app:rl", Algorithm::Gcra, vec![Limit::per_second("burst", 0)]).is_err());
//! ```

mod algorithms;
mod check;
mod local;
mod outcome;
mod policy;
mod table;

pub(crate) use algorithms::counter_window_left;
#[cfg(feature = "redis")]
pub(crate) use algorithms::{counter_answer, gcra_state};
#[cfg(feature = "redis")]
pub(crate) use check::hex;
pub use check::{RateCheck, Settlement};
pub(crate) use local::{Clock, LocalRates};
pub use outcome::{LimitState, RateOutcome};
pub use policy::{Algorithm, Limit, MAX_LOG_QUOTA, RatePolicy, parse_duration};
pub use table::{IN_FLIGHT, LimitTable, StoredTable, TableChange, TableError};
