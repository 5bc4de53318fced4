//! [`PermitStore`] in process: the permits of a concurrency limit and their queue.

use std::time::Duration;

use tokio::time::Instant;

use super::{Entry, MemoryStore, NOMINAL_TIMEOUT, Value, before, done, expiry};
use crate::store::{Hold, PermitAttempt, PermitStore, StoreFuture, fence_ttl};
use crate::store::{PermitRequest, PermitUsage};

#[derive(Debug, Default)]
pub(super) struct Permits {
    held: Vec<Permit>,
    /// In arrival order.
    queue: Vec<Waiter>,
}

#[derive(Debug)]
struct Permit {
    token: String,
    /// Store time in microseconds when its lease ends.
    ends: u64,
}

#[derive(Debug)]
struct Waiter {
    token: String,
    /// Store time in microseconds when its place lapses.
    until: u64,
}

impl Permits {
    /// Drops the permits whose lease ended and the places that lapsed at `now`.
    fn expire(&mut self, now: u64) {
        self.held.retain(|p| p.ends > now);
        self.queue.retain(|w| w.until > now);
    }

    /// When the entry may go: once every lease has ended and every place lapsed.
    fn last_end(&self) -> u64 {
        let leases = self.held.iter().map(|p| p.ends);
        leases
            .chain(self.queue.iter().map(|w| w.until))
            .max()
            .unwrap_or(0)
    }

    /// Why `token` cannot take one of `limit` permits now: the first lease's end (`now` when
    /// none is held) and the waiters ahead of it; `None` when it can.
    fn refusal(&self, token: &str, limit: u32, now: u64) -> Option<(u64, usize)> {
        if self.held.iter().any(|p| p.token == token) {
            return None;
        }
        let free = usize::try_from(limit)
            .unwrap_or(usize::MAX)
            .saturating_sub(self.held.len());
        let ahead = self
            .queue
            .iter()
            .position(|w| w.token == token)
            .unwrap_or(self.queue.len());
        let first = self.held.iter().map(|p| p.ends).min().unwrap_or(now);
        (ahead >= free).then_some((first, ahead))
    }

    /// `token` keeps (or takes) its place in the queue until `until`.
    fn wait(&mut self, token: &str, until: u64) {
        match self.queue.iter_mut().find(|w| w.token == token) {
            Some(waiter) => waiter.until = until,
            None => self.queue.push(Waiter {
                token: token.to_owned(),
                until,
            }),
        }
    }

    /// `token` holds a permit until `ends` (leaving the queue).
    fn hold(&mut self, token: &str, ends: u64) {
        self.queue.retain(|w| w.token != token);
        match self.held.iter_mut().find(|p| p.token == token) {
            Some(permit) => permit.ends = ends,
            None => self.held.push(Permit {
                token: token.to_owned(),
                ends,
            }),
        }
    }
}

impl PermitStore for MemoryStore {
    fn timeout(&self) -> Duration {
        NOMINAL_TIMEOUT
    }

    fn permit_acquire(
        &self,
        request: PermitRequest,
        deadline: Instant,
    ) -> StoreFuture<PermitAttempt> {
        before(deadline, || {
            let now = self.now_us();
            let key = request.hold.key.as_str();
            self.inner
                .entries
                .run(key, Some(&request.fence_key), now, |held| {
                    held.make_room(&[key, &request.fence_key])?;
                    if !matches!(held.live(key, now), Some(Value::Permits(_))) {
                        held.put(key, Value::Permits(Permits::default()), now + 1)?;
                    }
                    let (ends, until) = (
                        expiry(now, request.lease),
                        request.wait.map(|wait| expiry(now, wait)),
                    );
                    let take = |entry: &mut Entry| {
                        take_permit(entry, &request.hold.token, request.limit, ends, until, now)
                    };
                    if let Some((first, ahead)) = held.update(key, take).unwrap_or(Some((now, 0))) {
                        let next_free =
                            Duration::from_millis(first.saturating_sub(now).div_ceil(1000));
                        let ahead = u32::try_from(ahead).unwrap_or(u32::MAX);
                        return Ok(PermitAttempt::Full { next_free, ahead });
                    }
                    let fence = match held.live(&request.fence_key, now) {
                        Some(Value::Fence(last)) => now.max(last.saturating_add(1)),
                        _ => now,
                    };
                    let fence_expiry = expiry(now, fence_ttl(request.lease));
                    held.put(&request.fence_key, Value::Fence(fence), fence_expiry)?;
                    Ok(PermitAttempt::Acquired { fence })
                })
        })
    }

    fn permit_extend(&self, hold: Hold, lease: Duration, deadline: Instant) -> StoreFuture<bool> {
        before(deadline, || {
            let now = self.now_us();
            self.inner.entries.run(&hold.key, None, now, |held| {
                let extend = |entry: &mut Entry| {
                    let Value::Permits(permits) = &mut entry.value else {
                        return false;
                    };
                    let mine = permits.held.iter_mut().find(|p| p.token == hold.token);
                    let Some(permit) = mine.filter(|p| p.ends > now) else {
                        return false;
                    };
                    permit.ends = expiry(now, lease);
                    entry.expires_at = permits.last_end();
                    true
                };
                Ok(held.update(&hold.key, extend).unwrap_or(false))
            })
        })
    }

    fn permit_release(&self, hold: Hold) -> StoreFuture<bool> {
        let now = self.now_us();
        done(self.inner.entries.run(&hold.key, None, now, |held| {
            let release = |entry: &mut Entry| {
                let Value::Permits(permits) = &mut entry.value else {
                    return false;
                };
                let released = permits
                    .held
                    .iter()
                    .any(|p| p.token == hold.token && p.ends > now);
                permits.held.retain(|p| p.token != hold.token);
                permits.queue.retain(|w| w.token != hold.token);
                permits.expire(now);
                // with no permit held and nobody waiting, the entry goes
                entry.expires_at = permits.last_end();
                released
            };
            Ok(held.update(&hold.key, release).unwrap_or(false))
        }))
    }

    fn permit_usage(&self, key: &str) -> StoreFuture<PermitUsage> {
        let now = self.now_us();
        done(self.inner.entries.run(key, None, now, |held| {
            let Some(Value::Permits(permits)) = held.live(key, now) else {
                return Ok(PermitUsage::new(Vec::new(), 0));
            };
            let leases_left = permits
                .held
                .iter()
                .filter(|p| p.ends > now)
                .map(|p| Duration::from_millis((p.ends - now) / 1000))
                .collect();
            let waiting = permits.queue.iter().filter(|w| w.until > now).count();
            Ok(PermitUsage::new(
                leases_left,
                u32::try_from(waiting).unwrap_or(u32::MAX),
            ))
        }))
    }

    fn permit_limits(&self) -> Option<&dyn crate::store::LimitsStore> {
        Some(self)
    }

    fn permit_invalidations(&self) -> Option<crate::store::Invalidations> {
        crate::store::RateStore::invalidations(self)
    }
}

/// Takes one of `limit` permits of `entry` for `token` until `lease` (store time), or, when none
/// is free for it, keeps its place in the queue until `wait` (if set); the entry then lives as
/// long as its last lease or place. Why it cannot: see [`Permits::refusal`].
fn take_permit(
    entry: &mut Entry,
    token: &str,
    limit: u32,
    lease: u64,
    wait: Option<u64>,
    now: u64,
) -> Option<(u64, usize)> {
    let Value::Permits(permits) = &mut entry.value else {
        return Some((now, 0));
    };
    permits.expire(now);
    let refused = permits.refusal(token, limit, now);
    match (refused, wait) {
        (None, _) => permits.hold(token, lease),
        (Some(_), Some(until)) => permits.wait(token, until),
        (Some(_), None) => {}
    }
    entry.expires_at = permits.last_end();
    refused
}
