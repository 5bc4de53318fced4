//! Lines of waiting callers ([`RateStore::line_up`](crate::store::RateStore::line_up)) in
//! process: an entry per line, its waiters in arrival order.

use std::time::Duration;

use tokio::time::Instant;

use super::{Entry, MemoryStore, Value, before, done, expiry};
use crate::store::StoreFuture;

/// The waiters of one line, in the order they lined up.
#[derive(Debug, Default)]
pub(super) struct Line {
    waiters: Vec<Waiter>,
}

#[derive(Debug)]
struct Waiter {
    id: u64,
    /// Store time in microseconds when its place lapses.
    until: u64,
}

impl Line {
    /// Keeps `id`'s place (or appends it) until `until`, once the places lapsed at `now` are
    /// gone; how many stand ahead of it.
    fn line_up(&mut self, id: u64, until: u64, now: u64) -> usize {
        self.waiters.retain(|w| w.until > now);
        match self.waiters.iter().position(|w| w.id == id) {
            Some(ahead) => {
                self.waiters[ahead].until = until;
                ahead
            }
            None => {
                self.waiters.push(Waiter { id, until });
                self.waiters.len() - 1
            }
        }
    }

    /// When the entry may go: once every place has lapsed.
    fn last_end(&self) -> u64 {
        self.waiters.iter().map(|w| w.until).max().unwrap_or(0)
    }
}

impl MemoryStore {
    /// See [`RateStore::line_up`](crate::store::RateStore::line_up).
    pub(super) fn line_up_at(
        &self,
        line: &str,
        waiter: u64,
        keep: Duration,
        deadline: Instant,
    ) -> StoreFuture<u32> {
        before(deadline, || {
            let now = self.now_us();
            let until = expiry(now, keep);
            self.inner.entries.run(line, None, now, |held| {
                if !matches!(held.live(line, now), Some(Value::Line(_))) {
                    held.put(line, Value::Line(Line::default()), until)?;
                }
                let stand = |entry: &mut Entry| {
                    let Value::Line(waiting) = &mut entry.value else {
                        return 0;
                    };
                    let ahead = waiting.line_up(waiter, until, now);
                    entry.expires_at = waiting.last_end();
                    ahead
                };
                let ahead = held.update(line, stand).unwrap_or(0);
                Ok(u32::try_from(ahead).unwrap_or(u32::MAX))
            })
        })
    }

    /// See [`RateStore::leave_line`](crate::store::RateStore::leave_line).
    pub(super) fn leave_line_now(&self, line: &str, waiter: u64) -> StoreFuture<()> {
        let now = self.now_us();
        done(self.inner.entries.run(line, None, now, |held| {
            let leave = |entry: &mut Entry| {
                if let Value::Line(waiting) = &mut entry.value {
                    waiting.waiters.retain(|w| w.id != waiter && w.until > now);
                    // nobody left: the entry goes
                    entry.expires_at = waiting.last_end();
                }
            };
            held.update(line, leave);
            Ok(())
        }))
    }
}
