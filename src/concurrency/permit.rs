//! A permit while its request runs: kept alive in the store, given back when dropped.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use tokio::time::Instant;

use crate::keepalive::{self, Owner};
use crate::key::Key;
use crate::store::{Hold, PermitStore};
use crate::task::AbortOnDrop;

/// The permit an admitted request holds, in its request extensions: read its fencing token to
/// fence what the request writes.
///
/// Present when the store granted the permit; absent when the request was let through without
/// one (the store unreachable under [`OnStoreError::Allow`](super::OnStoreError::Allow) or the
/// local fallback, or no key under [`MissingKey::Allow`](super::MissingKey::Allow)).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Permit {
    fence: u64,
}

impl Permit {
    /// The fencing token of this permit: strictly greater than that of every earlier permit of
    /// the same key, in every copy. Pass it to the resource the request writes, and have it
    /// refuse a token below the highest it has seen.
    pub fn fencing_token(&self) -> u64 {
        self.fence
    }
}

/// What an admitted request holds until its response is done with; dropping it gives the
/// permit back.
#[derive(Debug)]
pub(crate) enum Held {
    /// A permit in the store, kept alive in the background.
    Store { _permit: StorePermit },
    /// A permit of the local fallback.
    Local { _permit: LocalPermit },
}

/// A permit taken in the store: its lease is extended while held, and given back on drop.
pub(crate) struct StorePermit {
    store: Arc<dyn PermitStore>,
    hold: Hold,
    _keep_alive: AbortOnDrop,
}

impl std::fmt::Debug for StorePermit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StorePermit")
            .field("key", &self.hold.key)
            .finish_non_exhaustive()
    }
}

impl StorePermit {
    /// Holds `hold`'s permit, taken for `lease` with fencing token `fence`: extends it every
    /// third of the lease from now until dropped.
    pub(crate) fn new(
        store: Arc<dyn PermitStore>,
        hold: Hold,
        lease: Duration,
        fence: u64,
    ) -> (Self, Permit) {
        let keep_alive = {
            let (store, hold) = (Arc::clone(&store), hold.clone());
            AbortOnDrop(tokio::spawn(keepalive::keep_alive(
                Owner::Permit,
                lease,
                move || {
                    let deadline = Instant::now() + store.timeout();
                    store.permit_extend(hold.clone(), lease, deadline)
                },
            )))
        };
        let permit = Self {
            store,
            hold,
            _keep_alive: keep_alive,
        };
        (permit, Permit { fence })
    }
}

impl Drop for StorePermit {
    fn drop(&mut self) {
        let (store, hold) = (Arc::clone(&self.store), self.hold.clone());
        keepalive::release_in_background(
            Owner::Permit,
            "a request ended",
            Instant::now(),
            move || store.permit_release(hold.clone()),
        );
    }
}

/// The permits of one copy, per key: the local fallback's count of requests in flight.
#[derive(Debug)]
pub(crate) struct LocalPermits {
    /// The copies the limit is shared among.
    copies: u32,
    held: Mutex<HashMap<Key, u32>>,
}

impl LocalPermits {
    /// Permits of this copy, one of `copies` (at least 1) that share each key's limit.
    pub(crate) fn new(copies: u32) -> Self {
        Self {
            copies: copies.max(1),
            held: Mutex::new(HashMap::new()),
        }
    }

    /// A permit of `key`, unless this copy's share of `limit` (at least 1) is held.
    pub(crate) fn acquire(self: &Arc<Self>, key: Key, limit: u32) -> Option<LocalPermit> {
        let share = limit.div_ceil(self.copies).max(1);
        let mut held = self.held.lock().unwrap_or_else(PoisonError::into_inner);
        let count = held.entry(key).or_insert(0);
        if *count >= share {
            return None;
        }
        *count += 1;
        Some(LocalPermit {
            owner: Arc::clone(self),
            key,
        })
    }

    /// How many permits `key` holds.
    #[cfg(test)]
    pub(crate) fn held(&self, key: Key) -> u32 {
        let held = self.held.lock().unwrap_or_else(PoisonError::into_inner);
        held.get(&key).copied().unwrap_or(0)
    }
}

/// A permit of the local fallback, given back on drop.
#[derive(Debug)]
pub(crate) struct LocalPermit {
    owner: Arc<LocalPermits>,
    key: Key,
}

impl Drop for LocalPermit {
    fn drop(&mut self) {
        let mut held = self
            .owner
            .held
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if let Some(count) = held.get_mut(&self.key) {
            *count -= 1;
            if *count == 0 {
                held.remove(&self.key);
            }
        }
    }
}
