//! A settlement sent in the background: the one way the rate client sends a settlement it does
//! not wait for (a response body's size, what a leased slice left unspent).

use std::sync::Arc;

use crate::rate::{RateCheck, RatePolicy};
use crate::store::RateStore;

/// What stays charged when a background settlement fails, and how loudly that is logged.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Unsettled {
    /// A request's reservation, settled on its response's body size: logged at warn.
    BodySize,
    /// A request's reservation, settled on the usage its response's body reported: logged at
    /// warn.
    Streamed,
    /// What a leased slice left unspent (the copy gives slices back often, and a slice stays
    /// charged no longer than its window): logged at debug.
    Slice,
}

impl Unsettled {
    fn log(self, error: &dyn std::fmt::Display, settled_to: u64) {
        match self {
            Self::BodySize => tracing::warn!(
                target: "tollgate::rate_limit",
                %error, sent = settled_to,
                "could not settle a response's body size: it stays charged what it reserved"
            ),
            Self::Streamed => tracing::warn!(
                target: "tollgate::rate_limit",
                %error, usage = settled_to,
                "could not settle the usage a response's body reported: it stays charged what it reserved"
            ),
            Self::Slice => tracing::debug!(
                target: "tollgate::rate_limit",
                %error, "could not give back what a leased slice left unspent"
            ),
        }
    }
}

/// Sends `settlement` (a check made by [`RateCheck::settle`]) of `policy` to `store` in the
/// background, and logs its failure as `unsettled` says; `until_settled` is kept until the
/// store has answered. Outside a Tokio runtime nothing can be sent: the reservation stays
/// charged until its window passes (logged the same way).
pub(crate) fn in_background(
    store: &dyn RateStore,
    policy: &Arc<RatePolicy>,
    settlement: RateCheck,
    unsettled: Unsettled,
    until_settled: impl Send + 'static,
) {
    let settled_to = settlement.cost();
    let Ok(runtime) = tokio::runtime::Handle::try_current() else {
        unsettled.log(&"no Tokio runtime to send it on", settled_to);
        return;
    };
    let pending = store.settle(policy, settlement);
    runtime.spawn(async move {
        if let Err(error) = pending.await {
            unsettled.log(&error, settled_to);
        }
        drop(until_settled);
    });
}
