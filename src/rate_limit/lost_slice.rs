//! A slice whose answer was lost — the call timed out, or its connection broke — may have been
//! charged (the store ran it, the reply never came) or not. Nobody holds it, so it is resolved
//! through the [attempt ledger](crate::store#the-attempt-ledger), then given back:
//!
//! - Once the fetch's deadline has passed (its timeout from when it was made) it has run or
//!   never will. The same attempt re-sent then, while the store still remembers a charge of it
//!   (its deadline plus twice the timeout), is answered as the first send was, charged nothing:
//!   admitted, the slice was charged once and is given back; denied, nothing was charged.
//! - When no re-send is answered in time, the settlement is sent anyway, once every send's
//!   deadline has passed: it refunds what the store still counts of the slice, and nothing when
//!   nothing was charged.
//!
//! The task ends within a few store timeouts, whether or not its layer is still there: giving
//! back what the store charged is owed to the caller either way.

use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use crate::rate::{RateCheck, RatePolicy};
use crate::store::{RateStore, StoreError, StoreErrorKind};

/// Settlements sent for a slice before giving up on it (each one is safe to send again).
const SETTLE_TRIES: u32 = 5;

/// Whether a fetch that failed with `error` may have been charged: its answer was lost.
pub(super) fn is_lost(error: &StoreError) -> bool {
    matches!(
        error.kind(),
        StoreErrorKind::Timeout | StoreErrorKind::Unavailable
    )
}

/// Resolves `slice`, a reservation made at `made_at` whose answer was lost, and gives back
/// whatever of it the store charged.
pub(super) async fn resolve(
    store: Arc<dyn RateStore>,
    policy: Arc<RatePolicy>,
    slice: RateCheck,
    made_at: Instant,
) {
    let timeout = store.timeout();
    let pause = (timeout / 4).max(Duration::from_millis(10));
    let deadline = made_at + timeout;
    // a re-send's own deadline must fall within the first send's record (its deadline plus
    // twice the timeout), with a quarter of a timeout to spare for the clocks
    let last_resend = deadline + timeout - timeout / 4;
    let mut sent_until = deadline;
    let mut next = deadline + pause;
    let mut charged = false;
    while !charged && next <= last_resend {
        tokio::time::sleep_until(next).await;
        sent_until = Instant::now() + timeout;
        match store.check_rate(&policy, slice).await {
            Ok(outcome) if !outcome.admitted => return,
            Ok(_) => charged = true,
            Err(_) => next = Instant::now() + pause,
        }
    }
    if !charged {
        // not known: every send has run or never will once its deadline has passed, and then
        // the settlement refunds what the store counts of the slice, nothing when it was not
        tokio::time::sleep_until(sent_until).await;
    }
    give_back(store.as_ref(), &policy, slice.settle(0), pause).await;
}

/// Sends `settlement` until the store answers it, at most [`SETTLE_TRIES`] times.
async fn give_back(
    store: &dyn RateStore,
    policy: &Arc<RatePolicy>,
    settlement: RateCheck,
    pause: Duration,
) {
    for _ in 0..SETTLE_TRIES {
        match store.check_rate(policy, settlement).await {
            Ok(_) => return,
            Err(error) => {
                tracing::debug!(
                    target: "tollgate::rate_limit",
                    %error, "could not give back a slice whose answer was lost"
                );
                tokio::time::sleep(pause).await;
            }
        }
    }
    tracing::warn!(
        target: "tollgate::rate_limit",
        "gave up giving back a slice whose answer was lost: it stays charged until its window passes"
    );
}
