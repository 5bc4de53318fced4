//! Following a provider's remaining count: the shared count of a key brought down to what the
//! provider says is left.

use std::collections::HashSet;
use std::sync::{Arc, Mutex, PoisonError};

use tokio::time::Instant;

use crate::key::Key;
use crate::keyspace;
use crate::rate::{Limit, RateCheck};
use crate::rate_client::{DecisionSource, RateClient};
use crate::rate_limit::RateLimitDecision;
use crate::store::{ClaimRequest, Hold, LockStore, StoreError};

/// Where the copies take turns to correct a key: the store the pauses are shared in, and the
/// namespace of their keys.
pub(crate) type Across = (Arc<dyn LockStore>, Arc<str>);

/// The corrections this copy is making, by key: one at a time for a key, so that answers
/// arriving together do not each charge the same difference; and, across copies that share
/// their pauses, one at a time for a key in the store too.
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
    /// With `across`, a copy corrects only while it holds the key's turn in that store (a
    /// claim for twice the store's timeout, given back when done): a copy that finds it taken
    /// leaves the correction to the holder, whose reading of the count comes after any
    /// correction made before.
    pub(crate) fn follow(
        self: &Arc<Self>,
        client: &Arc<RateClient>,
        across: Option<Across>,
        decision: &RateLimitDecision,
        remaining: u64,
    ) {
        let seen = decision.states.iter().map(|state| state.remaining).min();
        let below = seen.is_some_and(|seen| remaining < seen);
        // a limit that counts calls counts another unit than the others, and no settlement
        // changes it: a tier with one is not corrected (a spent count still pauses it)
        let one_unit = !decision
            .tier
            .policy
            .limits()
            .iter()
            .any(Limit::counts_calls);
        if decision.source != DecisionSource::Store || !below || !one_unit {
            return;
        }
        let key = decision.key;
        let Some(making) = self.start(key) else {
            return;
        };
        let client = Arc::clone(client);
        let tier = Arc::clone(&decision.tier);
        tokio::spawn(async move {
            let turn = match &across {
                Some((store, namespace)) => Turn::take(store, namespace, key).await,
                None => Ok(None),
            };
            let corrected = match turn {
                Ok(Some(turn)) if !turn.won => Ok(0),
                Ok(turn) => {
                    let corrected = correct(&client, &tier, key, remaining).await;
                    if let Some(turn) = turn {
                        turn.give_back().await;
                    }
                    corrected
                }
                Err(error) => Err(error),
            };
            match corrected {
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

/// Charges caller `key` under `tier` what the store counts left above the provider's
/// `remaining`; what it charged.
async fn correct(
    client: &RateClient,
    tier: &crate::rate_client::Tier,
    key: Key,
    remaining: u64,
) -> Result<u64, StoreError> {
    let now = client.peek(tier, key).await?;
    let ours = now.limits.iter().map(|state| state.remaining).min();
    let over = ours.map_or(0, |ours| ours.saturating_sub(remaining));
    if over > 0 {
        // a settlement of nothing reserved: its whole amount is an overrun, charged whatever
        // the balance
        let charge = RateCheck::new(key, 0).settle(over);
        client.store.settle(&tier.policy, charge).await?;
    }
    Ok(over)
}

/// A copy's turn to correct a key, claimed in the store the copies share their pauses in.
struct Turn {
    store: Arc<dyn LockStore>,
    hold: Hold,
    won: bool,
}

impl Turn {
    /// Claims the turn of caller `key` under `namespace`: `won` when no other copy holds it.
    async fn take(
        store: &Arc<dyn LockStore>,
        namespace: &str,
        key: Key,
    ) -> Result<Option<Self>, StoreError> {
        let (pause, _) = keyspace::provider_pause(namespace, &key);
        let hold = Hold::new(
            format!("{pause}:correcting"),
            uuid::Uuid::new_v4().to_string(),
        );
        let ttl = store.timeout().saturating_mul(2);
        let request = ClaimRequest::new(hold.key.clone(), hold.token.clone(), Some(ttl));
        let deadline = Instant::now() + store.timeout();
        let outcome = store.claim(request, deadline).await?;
        Ok(Some(Self {
            store: Arc::clone(store),
            hold,
            won: outcome.won,
        }))
    }

    /// Gives the turn back (it would lapse with its claim otherwise).
    async fn give_back(self) {
        if self.won
            && let Err(error) = self.store.delete_if_held(self.hold).await
        {
            tracing::debug!(
                target: "tollgate::outbound", %error,
                "could not give back a correction's turn: it lapses with its claim"
            );
        }
    }
}
