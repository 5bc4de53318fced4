//! "Already done" claims: one conditional write that exactly one caller wins.
//!
//! A claim is the preferred tool whenever the question is "has this been done (or started)
//! already?" — a coupon redeemed, a webhook processed, a welcome mail sent. It is a single
//! `SET NX` in the shared store: exactly one caller across all copies of the service wins, and
//! every other caller learns, in the same atomic step, that it lost and who holds the claim.
//! There is no lock to forget to release and nothing to keep alive.
//!
//! ```
//! # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), tollgate::store::StoreError> {
//! use std::time::Duration;
//! use tollgate::claim::Claims;
//! use tollgate::store::MemoryStore;
//!
//! let claims = Claims::new(MemoryStore::new());
//! let first = claims.claim_once_as("coupon:SAVE10", "order-17", None).await?;
//! let second = claims.claim_once_as("coupon:SAVE10", "order-18", None).await?;
//! assert!(first.won());
//! assert!(!second.won());
//! assert_eq!(second.holder(), "order-17");
//! // a claim with a lifetime frees itself; None keeps it until released
//! let temporary = claims.claim_once("welcome-mail:alice", Duration::from_secs(3600)).await?;
//! assert!(temporary.won());
//! # Ok(()) }
//! ```

use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use crate::error::ConfigError;
use crate::keepalive::{self, LockSpace, Owner};
use crate::keyspace;
use crate::store::ClaimRequest;
use crate::store::{Hold, LockStore, StoreError};

/// Makes claims in a shared [`LockStore`]. Cheap to clone.
#[derive(Clone, Debug)]
pub struct Claims {
    space: LockSpace,
}

/// The result of a claim attempt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Claim {
    won: bool,
    holder: String,
    key: String,
    pending: bool,
}

impl Claim {
    /// Whether this caller won the claim.
    pub fn won(&self) -> bool {
        self.won
    }

    /// The holder stored by the winner: ours when [`won`](Self::won).
    pub fn holder(&self) -> &str {
        &self.holder
    }

    /// Whether the claim that won is still pending: made with durable writes
    /// (`wait_replicas`) and not yet acknowledged by the replicas, so it may yet be undone.
    /// The name is in progress, not taken: ask again in a moment. Never `true` when
    /// [`won`](Self::won).
    pub fn pending(&self) -> bool {
        self.pending
    }
}

impl Claims {
    /// Claims in `store`, under keys `tollgate:claim:{<digest of name>}`.
    pub fn new(store: impl LockStore) -> Self {
        Self {
            space: LockSpace::new(store),
        }
    }

    /// The same claims under another key prefix (visible ASCII without braces).
    pub fn with_prefix(mut self, prefix: impl Into<String>) -> Result<Self, ConfigError> {
        self.space = self.space.with_prefix(prefix)?;
        Ok(self)
    }

    /// Claims `name` with a fresh random holder id; `ttl` of `None` keeps the claim until it is
    /// [released](Self::release).
    ///
    /// On an error nothing is held for long: the store may have made the claim although its
    /// answer was lost (a timeout, a dropped connection), so the attempt is undone in the
    /// background, token-checked, once its deadline has passed (the store's timeout: a claim
    /// that reaches the store later does nothing) and the store answers again. The name can
    /// then be claimed anew — by this caller's retry or by another. (To learn instead whether a
    /// lost attempt won, claim with a holder id of your own: see
    /// [`claim_once_as`](Self::claim_once_as).)
    pub async fn claim_once(
        &self,
        name: impl AsRef<[u8]>,
        ttl: impl Into<Option<Duration>>,
    ) -> Result<Claim, StoreError> {
        let holder = uuid::Uuid::new_v4().to_string();
        let key = keyspace::claim(&self.space.prefix, name.as_ref());
        let deadline = Instant::now() + self.space.store.timeout();
        let undo = {
            let (store, key, holder) = (Arc::clone(&self.space.store), key.clone(), holder.clone());
            move || store.delete_if_held(Hold::new(key.clone(), holder.clone()))
        };
        let attempt = self.claim_key(key, holder, ttl.into(), deadline);
        keepalive::attempt_with_undo(Owner::Claim, deadline, undo, attempt).await
    }

    /// Claims `name` for `holder` (an order id, say), so that losers can tell who won.
    ///
    /// The same holder claiming again wins again: so after an error — the store may have made
    /// the claim although its answer was lost — retry with the same holder to learn the
    /// outcome. Nothing is undone in the background here (it could undo that retry's win): a
    /// claim made by a lost attempt stays with `holder` until its `ttl` or a
    /// [release](Self::release). A lost attempt that reaches the store after its deadline (the
    /// store's timeout) does nothing, so a retry tells the outcome for good.
    pub async fn claim_once_as(
        &self,
        name: impl AsRef<[u8]>,
        holder: &str,
        ttl: impl Into<Option<Duration>>,
    ) -> Result<Claim, StoreError> {
        let key = keyspace::claim(&self.space.prefix, name.as_ref());
        let deadline = Instant::now() + self.space.store.timeout();
        self.claim_key(key, holder.to_owned(), ttl.into(), deadline)
            .await
    }

    async fn claim_key(
        &self,
        key: String,
        holder: String,
        ttl: Option<Duration>,
        deadline: Instant,
    ) -> Result<Claim, StoreError> {
        let outcome = self
            .space
            .store
            .claim(ClaimRequest::new(key.clone(), holder, ttl), deadline)
            .await?;
        Ok(Claim {
            won: outcome.won,
            holder: outcome.holder,
            key,
            pending: outcome.pending && !outcome.won,
        })
    }

    /// Runs work at most once per `period` across every copy: the claim of `name` with
    /// `period` as its lifetime. The first caller wins and runs the work; every caller until the
    /// claim ends — `period` later, on the store's clock — loses. So each copy can tick as
    /// often as it likes (every copy ticking each `period`, say) and the work runs at most once
    /// per `period`, by whichever copy asks first after it ends.
    ///
    /// The claim bounds how often the work starts, not how long it runs: work that can outlast
    /// `period` and must not overlap itself also takes a [lock](crate::lock::Locks). An
    /// unanswered attempt is undone as [`claim_once`](Self::claim_once)'s is, so the work may
    /// run again sooner than `period` after an attempt whose answer was lost — never twice on
    /// one won claim.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), tollgate::store::StoreError> {
    /// use std::time::Duration;
    /// use tollgate::claim::Claims;
    /// use tollgate::store::MemoryStore;
    ///
    /// let store = MemoryStore::new();
    /// // two copies of the service, on one store
    /// let (a, b) = (Claims::new(store.clone()), Claims::new(store));
    /// let minute = Duration::from_secs(60);
    /// assert!(a.once_per("digest-mail", minute).await?.won());
    /// assert!(!b.once_per("digest-mail", minute).await?.won());
    /// assert!(!a.once_per("digest-mail", minute).await?.won());
    /// # Ok(()) }
    /// ```
    pub async fn once_per(
        &self,
        name: impl AsRef<[u8]>,
        period: Duration,
    ) -> Result<Claim, StoreError> {
        // a claim of no lifetime would be forever: the shortest the stores keep is a millisecond
        self.claim_once(name, period.max(Duration::from_millis(1)))
            .await
    }

    /// Gives back a claim that we won (say, the work it guarded failed), so that it can be won
    /// again. Only the winner's own claim is deleted: `false` when `claim` was lost, or the claim
    /// expired or was released already.
    pub async fn release(&self, claim: &Claim) -> Result<bool, StoreError> {
        if !claim.won {
            return Ok(false);
        }
        self.space
            .store
            .delete_if_held(Hold::new(claim.key.clone(), claim.holder.clone()))
            .await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::MemoryStore;

    #[test]
    fn prefixes_that_could_split_a_hash_tag_are_refused() {
        assert!(Claims::new(MemoryStore::new()).with_prefix("{}").is_err());
        assert!(Claims::new(MemoryStore::new()).with_prefix("").is_err());
        assert!(
            Claims::new(MemoryStore::new())
                .with_prefix("app:v2")
                .is_ok()
        );
        assert!(
            crate::lock::Locks::new(MemoryStore::new())
                .with_prefix("a}")
                .is_err()
        );
    }
}
