//! Locks for work that cannot be one conditional write: a key with a lease and a random token,
//! plus a fencing token.
//!
//! - [`Locks::try_acquire`] sets the lock key to a fresh random token (UUID v4) with a lease, if
//!   it is free; [`Locks::acquire`] retries with jitter for a bounded time.
//! - [`LockGuard::extend`] and [`LockGuard::release`] act only while the key still holds our
//!   token (compare-and-pexpire / compare-and-delete in one script): a copy whose lease ran out can
//!   never extend or release the lock of the copy that took over, and learns that it lost it.
//! - Every acquisition returns a **fencing token** that strictly increases per lock name. Pass it
//!   to the protected resource and have it refuse writes with a smaller token than it has seen:
//!   that closes the gap a lease cannot (a process paused past its lease still believes it holds
//!   the lock).
//! - [`Locks::with_lock`] runs work under a lock, extends the lease while the work runs, releases
//!   it afterwards, and reports a lease lost on the way as [`LockError::Lost`].
//! - An acquisition whose answer was lost (an error, a timeout, a caller gone mid-call) may
//!   still have taken the lock: it is given back in the background, token-checked, once the store
//!   answers, so that a failed attempt does not hold the lock for its lease.
//!
//! # Fencing, not the lock, protects the resource
//!
//! A lease-based lock can be held by two owners at once in their own minds: one paused (a GC, a
//! swapped-out VM, a slow network) past its lease goes on writing after another took over. No
//! lock can prevent that; the resource can, by refusing a write whose fencing token is below the
//! highest it has seen. tollgate's tokens never repeat: each is above both the lock name's last
//! token and the store's clock in microseconds, so a counter that expired, or came back stale
//! from a restored snapshot or a promoted replica, still hands out tokens above every earlier
//! one. What this needs: a store clock that does not go back (NTP slews rather than steps on a
//! well-run host; a replica promoted onto a host whose clock is behind breaks it).
//!
//! Prefer a [claim](crate::claim) whenever the decision is one write ("has this been done?").
//!
//! ```
//! # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), tollgate::lock::LockError> {
//! use std::time::Duration;
//! use tollgate::lock::{LockError, Locks};
//! use tollgate::store::MemoryStore;
//!
//! let locks = Locks::new(MemoryStore::new());
//! let guard = locks.try_acquire("report:daily", Duration::from_secs(10)).await?;
//! // a second owner is refused while the first holds the lock
//! assert!(matches!(locks.try_acquire("report:daily", Duration::from_secs(10)).await, Err(LockError::Busy { .. })));
//! let first_token = guard.fencing_token();
//! guard.release().await?;
//!
//! let rebuilt = locks
//!     .with_lock("report:daily", Duration::from_secs(10), |lease| async move { lease.fencing_token() })
//!     .await?;
//! assert!(rebuilt > first_token);
//! # Ok(()) }
//! ```

use std::fmt;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;
use tokio::time::Instant;

use crate::error::ConfigError;
use crate::keepalive::{self, LockSpace, Owner};
use crate::keyspace;
use crate::store::LockRequest;
use crate::store::{Hold, LockAttempt, LockStore, StoreError};
use crate::task::AbortOnDrop;

/// Takes locks in a shared [`LockStore`]. Cheap to clone.
#[derive(Clone, Debug)]
pub struct Locks {
    space: LockSpace,
}

/// Why a lock operation failed.
#[derive(Debug)]
#[non_exhaustive]
pub enum LockError {
    /// Another owner holds the lock.
    Busy {
        /// About how long the other owner's lease still runs.
        lease_left: Duration,
    },
    /// Our lease ran out (or the store lost the key) and the lock is no longer ours: another
    /// owner may have run in between.
    Lost,
    /// The store failed or timed out.
    Store(StoreError),
}

impl fmt::Display for LockError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Busy { lease_left } => {
                write!(f, "lock is held by another owner for {lease_left:?}")
            }
            Self::Lost => f.write_str("lock lease was lost"),
            Self::Store(e) => write!(f, "lock store failed: {e}"),
        }
    }
}

impl std::error::Error for LockError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Self::Store(e) => Some(e),
            _ => None,
        }
    }
}

impl From<StoreError> for LockError {
    fn from(e: StoreError) -> Self {
        Self::Store(e)
    }
}

impl Locks {
    /// Locks in `store`, under keys `tollgate:lock:{<digest of name>}`.
    pub fn new(store: impl LockStore) -> Self {
        Self {
            space: LockSpace::new(store),
        }
    }

    /// The same locks under another key prefix (visible ASCII without braces).
    pub fn with_prefix(mut self, prefix: impl Into<String>) -> Result<Self, ConfigError> {
        self.space = self.space.with_prefix(prefix)?;
        Ok(self)
    }

    /// Takes the lock `name` for `lease` if it is free, without waiting.
    pub async fn try_acquire(
        &self,
        name: impl AsRef<[u8]>,
        lease: Duration,
    ) -> Result<LockGuard, LockError> {
        let (key, fence_key) = keyspace::lock(&self.space.prefix, name.as_ref());
        let token = uuid::Uuid::new_v4().to_string();
        let deadline = Instant::now() + self.space.store.timeout();
        // An attempt without an answer (an error, a timeout, a caller gone mid-call) may have
        // taken the lock: it is given back in the background, token-checked, once its deadline
        // has passed.
        let undo = {
            let (store, key, token) = (Arc::clone(&self.space.store), key.clone(), token.clone());
            move || store.delete_if_held(Hold::new(key.clone(), token.clone()))
        };
        let acquire = self.space.store.lock_acquire(
            LockRequest::new(Hold::new(key.clone(), token.clone()), fence_key, lease),
            deadline,
        );
        let attempt = keepalive::attempt_with_undo(Owner::Lock, deadline, undo, acquire)
            .await
            .inspect_err(|_| crate::metrics::lock("error"))?;
        crate::metrics::lock(match attempt {
            LockAttempt::Acquired { .. } => "acquired",
            LockAttempt::Held { .. } => "busy",
        });
        match attempt {
            LockAttempt::Acquired { fence } => Ok(LockGuard {
                store: Arc::clone(&self.space.store),
                key,
                token,
                fence,
                lease,
                released: false,
            }),
            LockAttempt::Held { lease_left } => Err(LockError::Busy { lease_left }),
        }
    }

    /// Takes the lock `name` for `lease`, retrying with jittered back-off for up to `wait`;
    /// [`LockError::Busy`] when it is still held then.
    pub async fn acquire(
        &self,
        name: impl AsRef<[u8]>,
        lease: Duration,
        wait: Duration,
    ) -> Result<LockGuard, LockError> {
        let name = name.as_ref();
        let deadline = Instant::now() + wait.min(Duration::from_secs(86_400));
        let mut backoff = Duration::from_millis(5);
        loop {
            match self.try_acquire(name, lease).await {
                Err(LockError::Busy { lease_left }) => {
                    let now = Instant::now();
                    if now >= deadline {
                        return Err(LockError::Busy { lease_left });
                    }
                    // Full jitter keeps waiting copies from retrying in step.
                    let jittered = backoff.mul_f64(rand_unit());
                    let pause = jittered.min(lease_left).min(deadline - now);
                    tokio::time::sleep(pause.max(Duration::from_millis(1))).await;
                    backoff = (backoff * 2).min(Duration::from_millis(250));
                }
                other => return other,
            }
        }
    }

    /// Runs `work` under the lock `name` (taken without waiting: [`LockError::Busy`] if held),
    /// extending the lease every third of it while `work` runs, then releases the lock.
    ///
    /// `work` gets a [`Lease`] with the fencing token and a way to learn that the lease was
    /// lost. If it was lost at any point — an extension found another owner's token, or the store
    /// did not confirm an extension for a whole lease — the result is [`LockError::Lost`] and the
    /// output of `work` is dropped: another owner may have run at the same time, so the caller
    /// must not treat the work as done under the lock.
    pub async fn with_lock<F, Fut, T>(
        &self,
        name: impl AsRef<[u8]>,
        lease: Duration,
        work: F,
    ) -> Result<T, LockError>
    where
        F: FnOnce(Lease) -> Fut,
        Fut: Future<Output = T>,
    {
        let guard = self.try_acquire(name, lease).await?;
        let (lost_tx, lost_rx) = watch::channel(false);
        // stopped with this future, however it ends: a cancelled or panicking caller must not
        // leave a task behind that keeps the lock alive
        let keepalive = AbortOnDrop(tokio::spawn(keep_alive(
            Arc::clone(&guard.store),
            guard.key.clone(),
            guard.token.clone(),
            lease,
            lost_tx,
        )));
        let output = work(Lease {
            fence: guard.fence,
            lost: lost_rx.clone(),
        })
        .await;
        drop(keepalive);
        let lost_during_work = *lost_rx.borrow();
        let released = guard.release().await;
        match (lost_during_work, released) {
            (true, _) | (false, Err(LockError::Lost)) => Err(LockError::Lost),
            (false, Err(e)) => Err(e),
            (false, Ok(())) => Ok(output),
        }
    }
}

/// Keeps the lock's lease alive until aborted; flags `lost` when the lock is gone or could not be
/// confirmed for a whole lease.
async fn keep_alive(
    store: Arc<dyn LockStore>,
    key: String,
    token: String,
    lease: Duration,
    lost: watch::Sender<bool>,
) {
    keepalive::keep_alive(Owner::Lock, lease, || {
        let deadline = Instant::now() + store.timeout();
        store.extend_if_held(Hold::new(key.clone(), token.clone()), lease, deadline)
    })
    .await;
    let _ = lost.send(true);
}

/// A uniformly random number in [0, 1).
pub(crate) fn rand_unit() -> f64 {
    (uuid::Uuid::new_v4().as_u64_pair().0 >> 11) as f64 / (1u64 << 53) as f64
}

/// What [`Locks::with_lock`] hands to its work: the fencing token and the lease's health.
#[derive(Debug, Clone)]
pub struct Lease {
    fence: u64,
    lost: watch::Receiver<bool>,
}

impl Lease {
    /// The fencing token of this acquisition.
    pub fn fencing_token(&self) -> u64 {
        self.fence
    }

    /// Whether the lease has been lost.
    pub fn is_lost(&self) -> bool {
        *self.lost.borrow()
    }

    /// Resolves once the lease is lost (never, while it holds): `select!` on it to stop work
    /// that must not go on without the lock.
    pub async fn lost(&mut self) {
        let _ = self.lost.wait_for(|lost| *lost).await;
        if !*self.lost.borrow() {
            std::future::pending::<()>().await;
        }
    }
}

/// A held lock. Release it with [`release`](Self::release); dropping it releases in the
/// background instead (best effort: it needs a running tokio runtime, and a failure is only
/// logged — the lease's expiry frees the lock in any case).
pub struct LockGuard {
    store: Arc<dyn LockStore>,
    key: String,
    token: String,
    fence: u64,
    lease: Duration,
    released: bool,
}

debug_fields!(LockGuard { key, fence, lease });

impl LockGuard {
    /// The fencing token of this acquisition: strictly greater than that of every earlier
    /// acquisition of the same lock name.
    pub fn fencing_token(&self) -> u64 {
        self.fence
    }

    /// Resets the lease to its full length from now; [`LockError::Lost`] when the lock is no
    /// longer ours.
    pub async fn extend(&self) -> Result<(), LockError> {
        self.reset_lease(self.lease).await
    }

    /// Resets the lease to `lease` from now — shorter or longer than the one it was taken with,
    /// replacing whatever was left of it; [`LockError::Lost`] when the lock is no longer ours.
    pub async fn reset_lease(&self, lease: Duration) -> Result<(), LockError> {
        let deadline = Instant::now() + self.store.timeout();
        let held = self
            .store
            .extend_if_held(
                Hold::new(self.key.clone(), self.token.clone()),
                lease,
                deadline,
            )
            .await?;
        if held { Ok(()) } else { Err(LockError::Lost) }
    }

    /// Releases the lock; [`LockError::Lost`] when it was no longer ours (the lease ran out,
    /// perhaps another owner holds it now — which this release leaves untouched).
    ///
    /// Safe to cancel: until the store has answered, the guard still owns the lock, and a
    /// release cancelled (or failed) midway is finished in the background, as a dropped guard's
    /// is.
    pub async fn release(mut self) -> Result<(), LockError> {
        let answer = self
            .store
            .delete_if_held(Hold::new(self.key.clone(), self.token.clone()))
            .await;
        // only an answer settles it; on an error the drop below releases in the background
        self.released = answer.is_ok();
        if answer? {
            Ok(())
        } else {
            Err(LockError::Lost)
        }
    }
}

impl Drop for LockGuard {
    fn drop(&mut self) {
        if self.released {
            return;
        }
        let (key, token) = (
            std::mem::take(&mut self.key),
            std::mem::take(&mut self.token),
        );
        let store = Arc::clone(&self.store);
        let why = "the guard was dropped";
        keepalive::release_in_background(Owner::Lock, why, Instant::now(), move || {
            store.delete_if_held(Hold::new(key.clone(), token.clone()))
        });
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicBool, Ordering};

    use super::*;
    use crate::store::{ClaimOutcome, ClaimRequest, MemoryStore, StoreFuture};

    /// A memory store whose first release never answers (a call stuck in a dead connection).
    #[derive(Debug, Clone, Default)]
    struct FirstReleaseHangs {
        inner: MemoryStore,
        hung: Arc<AtomicBool>,
    }

    impl LockStore for FirstReleaseHangs {
        fn timeout(&self) -> Duration {
            self.inner.timeout()
        }
        fn claim(&self, request: ClaimRequest, d: Instant) -> StoreFuture<ClaimOutcome> {
            let ClaimRequest {
                key: k,
                holder: h,
                ttl: t,
                ..
            } = request;
            self.inner.claim(ClaimRequest::new(k, h, t), d)
        }
        fn lock_acquire(&self, request: LockRequest, d: Instant) -> StoreFuture<LockAttempt> {
            let LockRequest {
                hold: h,
                fence_key: f,
                lease: l,
                ..
            } = request;
            self.inner.lock_acquire(LockRequest::new(h, f, l), d)
        }
        fn extend_if_held(&self, h: Hold, l: Duration, d: Instant) -> StoreFuture<bool> {
            self.inner.extend_if_held(h, l, d)
        }
        fn delete_if_held(&self, h: Hold) -> StoreFuture<bool> {
            if self.hung.swap(true, Ordering::SeqCst) {
                self.inner.delete_if_held(h)
            } else {
                Box::pin(std::future::pending())
            }
        }
    }

    #[tokio::test]
    async fn a_cancelled_release_still_frees_the_lock() {
        let store = FirstReleaseHangs::default();
        let locks = Locks::new(store.clone());
        let guard = locks
            .try_acquire("job", Duration::from_secs(60))
            .await
            .unwrap();
        let cancelled = tokio::time::timeout(Duration::from_millis(20), guard.release()).await;
        assert!(cancelled.is_err(), "the release was cut short");
        // the background release runs on this runtime
        let mut freed = false;
        for _ in 0..50 {
            if locks
                .try_acquire("job", Duration::from_secs(60))
                .await
                .is_ok()
            {
                freed = true;
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert!(
            freed,
            "a cancelled release left the lock held for its lease"
        );
    }
}
