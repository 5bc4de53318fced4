//! [`OutboundError`]: why a call was not made, or failed.

use std::error::Error;
use std::fmt;
use std::time::Duration;

/// Why an [`OutboundLimit`](super::OutboundLimit) call has no response.
#[derive(Debug)]
pub enum OutboundError<E> {
    /// The limits had no room for the call within its patience (or the provider asked to wait
    /// longer than that): it was not made.
    Limited(Limited),
    /// The call has no key the layer could read: it was not made.
    MissingKey,
    /// The store could not decide and the layer's failure policy denies: the call was not made.
    StoreUnavailable,
    /// The client failed.
    Inner(E),
}

/// A call the limits had no room for: when room comes, and how long it waited.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limited {
    pub(crate) retry_after: Duration,
    pub(crate) waited: Duration,
}

impl Limited {
    /// How long from the refusal until the call could be made.
    pub fn retry_after(&self) -> Duration {
        self.retry_after
    }

    /// How long the call waited before it was refused.
    pub fn waited(&self) -> Duration {
        self.waited
    }
}

impl<E: fmt::Display> fmt::Display for OutboundError<E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Limited(limited) => write!(
                f,
                "no room for the call within its patience (waited {:?}; room in {:?})",
                limited.waited, limited.retry_after
            ),
            Self::MissingKey => f.write_str("the call has no key to be limited by"),
            Self::StoreUnavailable => {
                f.write_str("the rate-limit store is unavailable and the policy denies")
            }
            Self::Inner(error) => error.fmt(f),
        }
    }
}

impl<E: Error + 'static> Error for OutboundError<E> {
    fn source(&self) -> Option<&(dyn Error + 'static)> {
        match self {
            Self::Inner(error) => Some(error),
            _ => None,
        }
    }
}
