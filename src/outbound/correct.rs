//! Following a provider's remaining count: the shared count of a key brought down to what the
//! provider says is left.

use std::collections::HashSet;
use std::sync::{Arc, Mutex, PoisonError};

use crate::key::Key;
use crate::rate::RateCheck;
use crate::rate_client::{DecisionSource, RateClient};
use crate::rate_limit::RateLimitDecision;

/// The corrections this copy is making, by key: one at a time for a key, so that answers
/// arriving together do not each charge the same difference.
#[derive(Debug, Default)]
pub(crate) struct Corrections {
    making: Mutex<HashSet<Key>>,
}

impl Corrections {
    /// The provider reported `remaining` for the call `decision` admitted: when that is less
    /// than the store's count of the key now, the difference is charged to every limit of the
    /// decision's tier, as an overrun is (in the background: the answer goes back at once).
    ///
    /// The store's count is read after the answer, so calls decided but not yet counted by the
    /// provider make the difference smaller, never larger. Nothing is done for a decision the
    /// store did not make, or when the provider's count is not below the one the decision saw.
    pub(crate) fn follow(
        self: &Arc<Self>,
        client: &Arc<RateClient>,
        decision: &RateLimitDecision,
        remaining: u64,
    ) {
        let seen = decision.states.iter().map(|state| state.remaining).min();
        let below = seen.is_some_and(|seen| remaining < seen);
        if decision.source != DecisionSource::Store || !below {
            return;
        }
        let key = decision.key;
        let Some(making) = self.start(key) else {
            return;
        };
        let client = Arc::clone(client);
        let tier = Arc::clone(&decision.tier);
        tokio::spawn(async move {
            let corrected = async {
                let now = client.peek(&tier, key).await?;
                let ours = now.limits.iter().map(|state| state.remaining).min();
                let Some(over) = ours.and_then(|ours| ours.checked_sub(remaining)) else {
                    return Ok(0);
                };
                if over > 0 {
                    // a settlement of nothing reserved: its whole amount is an overrun, charged
                    // whatever the balance
                    let charge = RateCheck::new(key, 0).settle(over);
                    client.store.settle(&tier.policy, charge).await?;
                }
                Ok::<_, crate::store::StoreError>(over)
            };
            match corrected.await {
                Ok(0) => {}
                Ok(over) => tracing::debug!(
                    target: "tollgate::outbound", %key, over, remaining,
                    "the provider counts less left than the store: the difference is charged"
                ),
                Err(error) => tracing::debug!(
                    target: "tollgate::outbound", %error, %key,
                    "could not follow the provider's remaining count"
                ),
            }
            drop(making);
        });
    }

    /// Marks a correction of `key` as being made, until the mark is dropped; `None` when one
    /// already is.
    fn start(self: &Arc<Self>, key: Key) -> Option<Making> {
        let mut making = self.making.lock().unwrap_or_else(PoisonError::into_inner);
        making.insert(key).then(|| Making {
            corrections: Arc::clone(self),
            key,
        })
    }
}

/// A correction being made: its key is free again when this is dropped (done, or its task
/// gone with the runtime).
struct Making {
    corrections: Arc<Corrections>,
    key: Key,
}

impl Drop for Making {
    fn drop(&mut self) {
        self.corrections
            .making
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(&self.key);
    }
}
