//! The bytes of request bodies a layer holds at once: one budget for every clone, a share of it
//! per caller, and a short wait for room, so that a few slow or stalled uploads cannot make
//! every other caller's request wait or fail.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::key::Key;

/// What a request finds when its body needs more room than there is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum NoRoom {
    /// The caller's own bodies already hold its share.
    CallerShare,
    /// The bodies of all callers hold the whole budget, and none gave room back in time.
    Budget,
}

/// The budget: its bytes, each caller's share of them, and how long a request waits for room.
pub(crate) struct BufferBudget {
    total: Arc<Semaphore>,
    /// The bytes held per caller: an entry lives only while it holds some.
    held: Mutex<HashMap<Key, usize>>,
    /// The most one caller's bodies hold at once.
    per_caller: usize,
    /// How long a body waits for room once the whole budget is held.
    wait: Duration,
}

impl std::fmt::Debug for BufferBudget {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BufferBudget")
            .field("available", &self.total.available_permits())
            .field("per_caller", &self.per_caller)
            .field("wait", &self.wait)
            .finish_non_exhaustive()
    }
}

impl BufferBudget {
    /// A budget of `total` bytes, at most `per_caller` of them held by one caller's bodies, a
    /// body waiting at most `wait` for room.
    pub(crate) fn new(total: usize, per_caller: usize, wait: Duration) -> Self {
        Self {
            total: Arc::new(Semaphore::new(total.min(Semaphore::MAX_PERMITS))),
            held: Mutex::default(),
            per_caller,
            wait,
        }
    }

    /// An empty share of the budget for one body of `caller` (`None`: a caller with no name,
    /// bound by the whole budget only).
    pub(super) fn share(self: &Arc<Self>, caller: Option<Key>) -> Share {
        Share {
            budget: Arc::clone(self),
            caller,
            bytes: 0,
            permit: None,
        }
    }

    /// Takes `bytes` more of `caller`'s share, if it has them.
    fn take_of_share(&self, caller: Key, bytes: usize) -> Result<(), NoRoom> {
        let mut held = self.held.lock().unwrap_or_else(PoisonError::into_inner);
        let holds = held.entry(caller).or_insert(0);
        match holds.checked_add(bytes) {
            Some(more) if more <= self.per_caller => {
                *holds = more;
                Ok(())
            }
            _ => {
                if *holds == 0 {
                    held.remove(&caller);
                }
                Err(NoRoom::CallerShare)
            }
        }
    }

    /// Gives `bytes` of `caller`'s share back.
    fn give_back(&self, caller: Key, bytes: usize) {
        let mut held = self.held.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(holds) = held.get_mut(&caller) {
            *holds = holds.saturating_sub(bytes);
            if *holds == 0 {
                held.remove(&caller);
            }
        }
    }
}

/// The room one request body holds: given back, to its caller's share and the budget, when it
/// is dropped — once the request's execution has ended.
pub(super) struct Share {
    budget: Arc<BufferBudget>,
    caller: Option<Key>,
    /// The bytes taken of the caller's share.
    bytes: usize,
    permit: Option<OwnedSemaphorePermit>,
}

impl std::fmt::Debug for Share {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Share")
            .field("bytes", &self.bytes)
            .finish_non_exhaustive()
    }
}

impl Share {
    /// Takes room for `bytes` more: of the caller's share at once (a caller whose own bodies
    /// hold it is refused without waiting), then of the budget, waiting for it at most the
    /// budget's wait.
    pub(super) async fn grow(&mut self, bytes: usize) -> Result<(), NoRoom> {
        let Ok(permits) = u32::try_from(bytes) else {
            return Err(NoRoom::Budget);
        };
        if let Some(caller) = self.caller {
            self.budget.take_of_share(caller, bytes)?;
            self.bytes += bytes;
        }
        let total = Arc::clone(&self.budget.total);
        let more = match total.clone().try_acquire_many_owned(permits) {
            Ok(more) => more,
            Err(_) => {
                match tokio::time::timeout(self.budget.wait, total.acquire_many_owned(permits))
                    .await
                {
                    Ok(Ok(more)) => more,
                    // the caller's share taken above is given back when the share is dropped
                    _ => return Err(NoRoom::Budget),
                }
            }
        };
        match self.permit.as_mut() {
            Some(permit) => permit.merge(more),
            None => self.permit = Some(more),
        }
        Ok(())
    }
}

impl Drop for Share {
    fn drop(&mut self) {
        if let Some(caller) = self.caller
            && self.bytes > 0
        {
            self.budget.give_back(caller, self.bytes);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn caller(name: &str) -> Option<Key> {
        Some(Key::new("test", name.as_bytes()))
    }

    #[tokio::test(start_paused = true)]
    async fn a_caller_holds_at_most_its_share_and_others_keep_theirs() {
        let budget = Arc::new(BufferBudget::new(100, 30, Duration::from_millis(50)));
        let mut mallory = budget.share(caller("mallory"));
        assert_eq!(mallory.grow(20).await, Ok(()));
        let mut again = budget.share(caller("mallory"));
        assert_eq!(again.grow(11).await, Err(NoRoom::CallerShare));
        assert_eq!(again.grow(10).await, Ok(()));
        let mut alice = budget.share(caller("alice"));
        assert_eq!(alice.grow(30).await, Ok(()));
        drop((mallory, again));
        let mut mallory = budget.share(caller("mallory"));
        assert_eq!(mallory.grow(30).await, Ok(()));
        assert!(budget.held.lock().unwrap().len() == 2);
        drop((mallory, alice));
        assert!(budget.held.lock().unwrap().is_empty());
        assert_eq!(budget.total.available_permits(), 100);
    }

    #[tokio::test(start_paused = true)]
    async fn a_full_budget_is_waited_for_briefly() {
        let budget = Arc::new(BufferBudget::new(10, 10, Duration::from_millis(50)));
        let mut first = budget.share(None);
        assert_eq!(first.grow(10).await, Ok(()));
        let mut second = budget.share(caller("bob"));
        assert_eq!(second.grow(1).await, Err(NoRoom::Budget));
        // room given back within the wait is taken
        let waiting = tokio::spawn(async move {
            let mut third = budget.share(caller("bob"));
            third.grow(5).await
        });
        tokio::time::sleep(Duration::from_millis(20)).await;
        drop(first);
        assert_eq!(waiting.await.unwrap(), Ok(()));
        drop(second);
    }
}
