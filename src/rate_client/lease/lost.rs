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
//! back what the store charged is owed to the caller either way. At most [`MOST_UNDER_WAY`]
//! run at once per tier.

use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use crate::rate::{RateCheck, RateOutcome, RatePolicy};
use crate::store::{RateStore, StoreError, StoreErrorKind};

/// Settlements sent for a slice before giving up on it (each one is safe to send again).
const SETTLE_TRIES: u32 = 5;

/// Resolutions under way per tier, at most: a store that fails fast, every call of a warm
/// caller a fetch, would otherwise have each lost fetch add a task and its calls. Beyond it, a
/// lost slice is lost as a dead copy's is (charged until it leaves the window).
pub(super) const MOST_UNDER_WAY: usize = 256;

/// The resolutions under way, for a graceful shutdown to wait for.
#[derive(Debug)]
pub(super) struct Resolutions {
    under_way: tokio::sync::watch::Sender<usize>,
}

/// One resolution under way, counted until dropped.
pub(super) struct Resolving(Arc<Resolutions>);

impl Default for Resolutions {
    fn default() -> Self {
        Self {
            under_way: tokio::sync::watch::Sender::new(0),
        }
    }
}

impl Resolutions {
    /// Counts a resolution under way until the guard returned is dropped; `None` when
    /// [`MOST_UNDER_WAY`] are.
    pub(super) fn start(self: &Arc<Self>) -> Option<Resolving> {
        let started = self.under_way.send_if_modified(|n| {
            let room = *n < MOST_UNDER_WAY;
            if room {
                *n += 1;
            }
            room
        });
        started.then(|| Resolving(Arc::clone(self)))
    }

    /// Waits until no resolution is under way: at most as long as one can last, on a store of
    /// `timeout` (re-sends until a timeout and three quarters past the fetch, each call bounded
    /// by two timeouts, then the settlements with their pauses).
    pub(super) async fn ended(&self, timeout: Duration) {
        let mut under_way = self.under_way.subscribe();
        let longest = timeout * (4 + 3 * SETTLE_TRIES);
        let _ = tokio::time::timeout(longest, under_way.wait_for(|n| *n == 0)).await;
    }
}

impl Drop for Resolving {
    fn drop(&mut self) {
        self.0.under_way.send_modify(|n| *n = n.saturating_sub(1));
    }
}

/// Whether a fetch that failed with `error` may have been charged: its answer was lost.
pub(super) fn is_lost(error: &StoreError) -> bool {
    matches!(
        error.kind(),
        StoreErrorKind::Timeout | StoreErrorKind::Unavailable
    )
}

/// `check` sent to `store`, failing as a timeout if no answer comes within twice the store's
/// timeout: a store that breaks its own timeout holds no task of the copy's for longer.
pub(super) async fn bounded(
    store: &dyn RateStore,
    policy: &Arc<RatePolicy>,
    check: RateCheck,
) -> Result<RateOutcome, StoreError> {
    let call = store.check_rate(policy, check);
    tokio::time::timeout(store.timeout() * 2, call)
        .await
        .unwrap_or_else(|_| Err(StoreError::timeout()))
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
        match bounded(store.as_ref(), &policy, slice).await {
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
        match bounded(store, policy, settlement).await {
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

#[cfg(test)]
mod tests {
    use std::sync::Mutex;
    use std::sync::atomic::{AtomicUsize, Ordering};

    use super::*;
    use crate::key::Key;
    use crate::rate::{Algorithm, Limit};
    use crate::store::{MemoryStore, StoreFuture};

    /// A memory store whose next calls lose their answer: `lost` of them run and fail, then
    /// `unsent` fail without running. It records when each call was made.
    #[derive(Debug, Default)]
    struct Lossy {
        inner: MemoryStore,
        lost: AtomicUsize,
        unsent: AtomicUsize,
        calls: Mutex<Vec<(Instant, RateCheck)>>,
    }

    fn take(counter: &AtomicUsize) -> bool {
        counter
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_ok()
    }

    impl RateStore for Lossy {
        fn check_rate(&self, p: &Arc<RatePolicy>, check: RateCheck) -> StoreFuture<RateOutcome> {
            if let Ok(mut calls) = self.calls.lock() {
                calls.push((Instant::now(), check));
            }
            if take(&self.lost) {
                let ran = self.inner.check_rate(p, check);
                return Box::pin(async move {
                    let _ = ran.await;
                    Err(StoreError::timeout())
                });
            }
            if take(&self.unsent) {
                return Box::pin(async { Err(StoreError::timeout()) });
            }
            self.inner.check_rate(p, check)
        }

        fn timeout(&self) -> Duration {
            Duration::from_millis(200)
        }

        fn reset_rate(&self, p: &Arc<RatePolicy>, key: Key) -> StoreFuture<()> {
            self.inner.reset_rate(p, key)
        }
    }

    fn policy() -> Arc<RatePolicy> {
        let limits = vec![Limit::per_day("api", 100).leased()];
        Arc::new(RatePolicy::new("lost", Algorithm::Gcra, limits).unwrap())
    }

    /// What the store says is left of the caller's quota.
    async fn left(store: &Lossy, policy: &Arc<RatePolicy>, key: Key) -> u64 {
        let look = store.inner.check_rate(policy, RateCheck::new(key, 0));
        look.await.unwrap().limits[0].remaining
    }

    /// Fetches a slice of 10 through `store` (its answer lost), resolves it; the calls made.
    async fn lose_a_slice(
        store: &Arc<Lossy>,
        policy: &Arc<RatePolicy>,
    ) -> Vec<(Instant, RateCheck)> {
        let slice = RateCheck::reservation(Key::new("user", b"a"), 10).quiet();
        let made_at = Instant::now();
        assert!(store.check_rate(policy, slice).await.is_err());
        let dyn_store: Arc<dyn RateStore> = Arc::clone(store) as _;
        resolve(dyn_store, Arc::clone(policy), slice, made_at).await;
        store.calls.lock().unwrap().clone()
    }

    #[test]
    fn at_most_so_many_resolutions_run_at_once() {
        let resolutions = Arc::new(Resolutions::default());
        let mut under_way: Vec<_> = (0..MOST_UNDER_WAY)
            .map(|_| resolutions.start().unwrap())
            .collect();
        assert!(resolutions.start().is_none());
        under_way.pop();
        assert!(resolutions.start().is_some());
    }

    #[tokio::test(start_paused = true)]
    async fn a_charged_slice_is_re_sent_once_its_deadline_passed_then_given_back() {
        let (store, policy) = (Arc::new(Lossy::default()), policy());
        store.lost.store(1, Ordering::SeqCst);
        let calls = lose_a_slice(&store, &policy).await;
        let [(sent, slice), (resent, again), (_, settled)] = calls[..] else {
            panic!("{calls:?}");
        };
        assert_eq!(again, slice, "the same attempt");
        assert!(
            resent >= sent + store.timeout(),
            "re-sent before the deadline"
        );
        assert_eq!(settled, slice.settle(0));
        assert_eq!(left(&store, &policy, slice.key()).await, 100);
    }

    #[tokio::test(start_paused = true)]
    async fn a_slice_never_charged_and_denied_when_re_sent_is_not_settled() {
        let (store, policy) = (Arc::new(Lossy::default()), policy());
        let key = Key::new("user", b"a");
        // the quota is spent meanwhile: the re-send is decided anew, and denied
        let spent = store.inner.check_rate(&policy, RateCheck::new(key, 100));
        assert!(spent.await.unwrap().admitted);
        store.unsent.store(1, Ordering::SeqCst);
        let calls = lose_a_slice(&store, &policy).await;
        assert_eq!(
            calls.len(),
            2,
            "the fetch and its re-send, no settlement: {calls:?}"
        );
        assert_eq!(left(&store, &policy, key).await, 0);
    }

    #[tokio::test(start_paused = true)]
    async fn a_slice_no_re_send_resolves_is_settled_once_every_send_is_past_its_deadline() {
        let (store, policy) = (Arc::new(Lossy::default()), policy());
        // the fetch and every re-send lose their answer; each ran
        store.lost.store(100, Ordering::SeqCst);
        let slice = RateCheck::reservation(Key::new("user", b"a"), 10).quiet();
        let made_at = Instant::now();
        assert!(store.check_rate(&policy, slice).await.is_err());
        store.lost.store(1, Ordering::SeqCst);
        store.unsent.store(100, Ordering::SeqCst);
        let dyn_store: Arc<dyn RateStore> = Arc::clone(&store) as _;
        let resolving = tokio::spawn(resolve(dyn_store, Arc::clone(&policy), slice, made_at));
        // the re-sends fail (the last one made 350 ms after the fetch); the store answers again
        // before the settlement is sent (200 ms after that)
        tokio::time::sleep(Duration::from_millis(450)).await;
        store.unsent.store(0, Ordering::SeqCst);
        resolving.await.unwrap();
        let calls = store.calls.lock().unwrap().clone();
        let resends: Vec<_> = calls.iter().filter(|(_, c)| *c == slice).collect();
        let settlements: Vec<_> = calls
            .iter()
            .filter(|(_, c)| *c == slice.settle(0))
            .collect();
        let timeout = store.timeout();
        let last_resend = resends.last().map(|(at, _)| *at).unwrap();
        assert!(resends.len() >= 2, "{calls:?}");
        assert!(
            last_resend + timeout <= made_at + 3 * timeout,
            "re-sent past the record"
        );
        assert!(
            settlements[0].0 >= last_resend + timeout,
            "settled before a send's deadline"
        );
        assert_eq!(left(&store, &policy, slice.key()).await, 100);
    }
}
