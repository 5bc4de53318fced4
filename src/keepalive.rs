//! Keep-alive of what a copy holds in the store — a lock, a claim, an idempotency record, a
//! concurrency permit: each hold's lease (its time to live) is renewed while its work runs, and
//! the hold is given back in the background when its owner goes away. (The rate limit's leased
//! quota slices are another thing: `rate_client/lease/`.)

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use crate::error::ConfigError;
use crate::keyspace;
use crate::store::{LockStore, StoreError, StoreFuture};

/// Whose lease it is: the log target and wording of its warnings.
/// Where [`Claims`](crate::claim::Claims) and [`Locks`](crate::lock::Locks) keep their keys:
/// a shared store, under a key prefix.
#[derive(Clone, Debug)]
pub(crate) struct LockSpace {
    pub(crate) store: Arc<dyn LockStore>,
    pub(crate) prefix: Arc<str>,
}

impl LockSpace {
    /// `store`, under the default prefix.
    pub(crate) fn new(store: impl LockStore) -> Self {
        Self {
            store: Arc::new(store),
            prefix: Arc::from(keyspace::DEFAULT_PREFIX),
        }
    }

    /// The same store under `prefix` (visible ASCII without braces).
    pub(crate) fn with_prefix(self, prefix: impl Into<String>) -> Result<Self, ConfigError> {
        let prefix = keyspace::shared_prefix(prefix)?;
        Ok(Self { prefix, ..self })
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Owner {
    /// A lock of [`Locks`](crate::lock::Locks).
    Lock,
    /// A claim of [`Claims`](crate::claim::Claims).
    Claim,
    /// The claim on an idempotency key while its handler runs.
    Idempotency,
    /// A permit of a concurrency limit while its request runs.
    Permit,
}

impl Owner {
    fn extension_failed(self, error: &StoreError) {
        match self {
            Self::Lock | Self::Claim => {
                tracing::warn!(target: "tollgate::lock", %error, "could not extend a lock lease");
            }
            Self::Idempotency => tracing::warn!(
                target: "tollgate::idempotency",
                %error, "could not extend an idempotency lease"
            ),
            Self::Permit => tracing::warn!(
                target: "tollgate::concurrency",
                %error, "could not extend a permit's lease"
            ),
        }
    }

    fn lost(self) {
        match self {
            Self::Lock | Self::Claim => {
                tracing::debug!(target: "tollgate::lock", "a lock lease was lost");
            }
            Self::Idempotency => tracing::warn!(
                target: "tollgate::idempotency",
                "the store lost this request's claim on its idempotency key while the handler ran"
            ),
            Self::Permit => tracing::warn!(
                target: "tollgate::concurrency",
                "the store lost this request's permit while it ran: the limit may be exceeded"
            ),
        }
    }

    /// Logs a release that failed; the lease's expiry frees the key in any case.
    pub(crate) fn release_failed(self, error: &StoreError, why: &str) {
        match self {
            Self::Lock => tracing::warn!(
                target: "tollgate::lock",
                %error, why, "could not release a lock; the lease will expire"
            ),
            Self::Claim => tracing::warn!(
                target: "tollgate::claim",
                %error, why, "could not undo an unanswered claim attempt"
            ),
            Self::Idempotency => tracing::warn!(
                target: "tollgate::idempotency",
                %error, why,
                "could not release an idempotency key; it frees itself when its lease ends"
            ),
            Self::Permit => tracing::warn!(
                target: "tollgate::concurrency",
                %error, why,
                "could not give a permit back; it frees itself when its lease ends"
            ),
        }
    }
}

/// Extends a lease every third of it with `extend` (which answers whether the lease is still
/// ours); after a failed extension it tries again soon, since the lease runs out a whole lease
/// after the last confirmation. Returns once the lease is lost: the store said it is no longer
/// ours, or no extension was confirmed for a whole lease. Abort it to stop keeping the lease.
pub(crate) async fn keep_alive<F>(owner: Owner, lease: Duration, mut extend: F)
where
    F: FnMut() -> StoreFuture<bool>,
{
    let mut confirmed = Instant::now();
    let period = (lease / 3).max(Duration::from_millis(1));
    let mut pause = period;
    loop {
        tokio::time::sleep(pause).await;
        let attempt = Instant::now();
        match extend().await {
            Ok(true) => {
                confirmed = attempt;
                pause = period;
            }
            Ok(false) => break,
            Err(error) => {
                owner.extension_failed(&error);
                if attempt.duration_since(confirmed) >= lease {
                    break;
                }
                pause = (lease / 10).clamp(Duration::from_millis(1), Duration::from_secs(1));
            }
        }
    }
    owner.lost();
}

/// How long a background release keeps trying to reach the store.
const RELEASE_PATIENCE: Duration = Duration::from_secs(30);

/// Gives a lease back in the background: spawns `release` (a token-checked delete, harmless when
/// the lease is no longer ours, or was never taken) on the current tokio runtime once `after`
/// has passed, and runs it again with back-off until the store answers, for up to half a minute
/// — so that an attempt whose answer was lost does not hold its key for a whole lease. Outside a
/// runtime nothing is sent and the lease's expiry frees the key.
pub(crate) fn release_in_background<F>(
    owner: Owner,
    why: &'static str,
    after: Instant,
    mut release: F,
) where
    F: FnMut() -> StoreFuture<bool> + Send + 'static,
{
    let Ok(runtime) = tokio::runtime::Handle::try_current() else {
        return;
    };
    runtime.spawn(async move {
        if after > Instant::now() {
            tokio::time::sleep_until(after).await;
        }
        let deadline = Instant::now() + RELEASE_PATIENCE;
        let mut pause = Duration::from_millis(50);
        loop {
            match release().await {
                Ok(_) => return,
                Err(error) if Instant::now() + pause >= deadline => {
                    owner.release_failed(&error, why);
                    return;
                }
                Err(_) => {
                    tokio::time::sleep(pause).await;
                    pause = (pause * 2).min(Duration::from_secs(2));
                }
            }
        }
    });
}

/// Awaits a release and logs its failure.
pub(crate) async fn log_release(owner: Owner, why: &'static str, release: StoreFuture<bool>) {
    if let Err(error) = release.await {
        owner.release_failed(&error, why);
    }
}

/// Sends `attempt` (a write that carries `deadline`), with `undo` armed: should it go unanswered
/// — an error, or the caller dropping this future mid-call — the store may have made it, and
/// `undo` (token-checked) runs in the background once the deadline has passed (see
/// [`UndoUnanswered`]).
pub(crate) async fn attempt_with_undo<T, F>(
    owner: Owner,
    deadline: Instant,
    undo: F,
    attempt: impl Future<Output = Result<T, StoreError>>,
) -> Result<T, StoreError>
where
    F: FnMut() -> StoreFuture<bool> + Send + 'static,
{
    let why = match owner {
        Owner::Lock => "a lock attempt went unanswered",
        Owner::Claim | Owner::Idempotency => "a claim attempt went unanswered",
        Owner::Permit => "a permit attempt went unanswered",
    };
    let mut unanswered = UndoUnanswered::new(owner, why, deadline, undo);
    let answer = attempt.await;
    if answer.is_ok() {
        unanswered.disarm();
    }
    answer
}

/// Undoes an attempt in the background unless [disarmed](Self::disarm): an attempt that got no
/// answer — an error, a timeout, a caller that went away mid-call — may have been made by the
/// store, and its token-checked undo is harmless if it was not. The undo is sent once the
/// attempt's deadline has passed: from then on the store refuses the attempt should it still
/// arrive (see [Deadlines](crate::store#deadlines)), so an undo that ran cannot be overtaken by
/// the write it undid.
pub(crate) struct UndoUnanswered<F>
where
    F: FnMut() -> StoreFuture<bool> + Send + 'static,
{
    undo: Option<F>,
    owner: Owner,
    why: &'static str,
    deadline: Instant,
}

impl<F> UndoUnanswered<F>
where
    F: FnMut() -> StoreFuture<bool> + Send + 'static,
{
    /// Arms `undo`, to be run should the attempt, sent with `deadline`, go unanswered.
    pub(crate) fn new(owner: Owner, why: &'static str, deadline: Instant, undo: F) -> Self {
        Self {
            undo: Some(undo),
            owner,
            why,
            deadline,
        }
    }

    /// The attempt was answered: nothing to undo.
    pub(crate) fn disarm(&mut self) {
        self.undo = None;
    }
}

impl<F> Drop for UndoUnanswered<F>
where
    F: FnMut() -> StoreFuture<bool> + Send + 'static,
{
    fn drop(&mut self) {
        if let Some(undo) = self.undo.take() {
            release_in_background(self.owner, self.why, self.deadline, undo);
        }
    }
}
