//! [`LockStore`] in process: claims and fenced locks.

use std::time::Duration;

use tokio::time::Instant;

use super::{MemoryStore, NOMINAL_TIMEOUT, OnMatch, Value, before, done, expiry};
use crate::store::MAX_EXPIRY;
use crate::store::{ClaimOutcome, Hold, LockAttempt, LockState, LockStore, StoreFuture, fence_ttl};
use crate::store::{ClaimRequest, LockRequest};

impl Value {
    /// Whether this is a claim or lock held by `token`.
    fn held_by(&self, token: &str) -> bool {
        matches!(self, Self::Str(t) if t == token)
    }
}

impl LockStore for MemoryStore {
    fn timeout(&self) -> Duration {
        NOMINAL_TIMEOUT
    }

    fn claim(&self, request: ClaimRequest, deadline: Instant) -> StoreFuture<ClaimOutcome> {
        before(deadline, || {
            let now = self.now_us();
            self.inner.entries.run(&request.key, None, now, |held| {
                Ok(match held.live(&request.key, now) {
                    Some(Value::Str(current)) => ClaimOutcome {
                        won: *current == request.holder,
                        holder: current.clone(),
                        pending: false,
                    },
                    Some(_) => ClaimOutcome {
                        won: false,
                        holder: String::new(),
                        pending: false,
                    },
                    None => {
                        let expires_at = request.ttl.map_or(u64::MAX, |ttl| expiry(now, ttl));
                        held.put(&request.key, Value::Str(request.holder.clone()), expires_at)?;
                        ClaimOutcome {
                            won: true,
                            holder: request.holder.clone(),
                            pending: false,
                        }
                    }
                })
            })
        })
    }

    fn lock_acquire(&self, request: LockRequest, deadline: Instant) -> StoreFuture<LockAttempt> {
        let Hold { key, token } = request.hold;
        before(deadline, || {
            let now = self.now_us();
            self.inner
                .entries
                .run(&key, Some(&request.fence_key), now, |held| {
                    let drawn = match held.live(&request.fence_key, now) {
                        Some(Value::Fence(last)) => Some(*last),
                        _ => None,
                    };
                    Ok(match held.live(&key, now) {
                        // the same attempt again: acquired already, with the fence it drew
                        Some(v) if v.held_by(&token) && drawn.is_some() => {
                            let fence = drawn.unwrap_or(now);
                            held.set_expiry(&key, expiry(now, request.lease));
                            LockAttempt::Acquired { fence }
                        }
                        Some(v) if !v.held_by(&token) => LockAttempt::Held {
                            lease_left: held.left(&key, now),
                        },
                        _ => {
                            // both keys or neither
                            held.make_room(&[&key, &request.fence_key])?;
                            held.put(&key, Value::Str(token.clone()), expiry(now, request.lease))?;
                            // above both the last token and the store time: a stale counter cannot
                            // repeat one
                            let fence = drawn.map_or(now, |last| now.max(last.saturating_add(1)));
                            let fence_expiry = expiry(now, fence_ttl(request.lease));
                            held.put(&request.fence_key, Value::Fence(fence), fence_expiry)?;
                            LockAttempt::Acquired { fence }
                        }
                    })
                })
        })
    }

    fn extend_if_held(&self, hold: Hold, lease: Duration, deadline: Instant) -> StoreFuture<bool> {
        let Hold { key, token } = hold;
        let expire = OnMatch::Expire(lease);
        self.token_checked(&key, |v| v.held_by(&token), expire, Some(deadline))
    }

    fn delete_if_held(&self, hold: Hold) -> StoreFuture<bool> {
        let Hold { key, token } = hold;
        self.token_checked(&key, |v| v.held_by(&token), OnMatch::Release, None)
    }

    fn lock_state(&self, key: &str, fence_key: &str) -> StoreFuture<LockState> {
        let now = self.now_us();
        done(self.inner.entries.run(key, Some(fence_key), now, |held| {
            let fence = match held.live(fence_key, now) {
                Some(Value::Fence(last)) => Some(*last),
                _ => None,
            };
            Ok(match held.live(key, now) {
                Some(Value::Str(token)) => {
                    let lease_left = held.left(key, now).min(MAX_EXPIRY);
                    LockState::new(Some(token.clone()), lease_left, fence)
                }
                _ => LockState::new(None, Duration::ZERO, fence),
            })
        }))
    }
}
