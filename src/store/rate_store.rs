//! [`RateStore`]: rate checks and their settlements, the capability a rate-limit layer needs.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use super::{Invalidations, LimitsStore, StoreFuture};
use crate::key::Key;
use crate::rate::{RateCheck, RateOutcome, RatePolicy};

/// Rate checks, their settlements and resets: the capability a rate-limit layer needs.
///
/// Implementations must finish every future within their own timeout (a store that is down must not
/// hang a request) and make each check atomic with respect to every other caller of the same
/// backend, in any process.
pub trait RateStore: fmt::Debug + Send + Sync + 'static {
    /// Checks the cost of `check` against every limit of `policy` for its caller and, only if all
    /// have room, charges all of them — in one atomic step. The keys are
    /// [`RatePolicy::store_keys`]. Safe to run twice: the same attempt again is charged once and
    /// admitted again (see [`RateCheck`]).
    fn check_rate(&self, policy: &Arc<RatePolicy>, check: RateCheck) -> StoreFuture<RateOutcome>;

    /// Settles a reservation: `settlement` is a check made by [`RateCheck::settle`], which
    /// corrects what its reservation charged to what the request actually used — refunding the
    /// difference, or charging the overrun — under the
    /// [attempt ledger](crate::store#the-attempt-ledger)'s rules (a refund comes only out of the
    /// state the reservation charged; a re-sent settlement is applied once). It is a check like
    /// any other, and a backend decides it in [`check_rate`](Self::check_rate), which this
    /// provided method calls: a backend implements nothing more for it.
    fn settle(&self, policy: &Arc<RatePolicy>, settlement: RateCheck) -> StoreFuture<RateOutcome> {
        debug_assert!(
            settlement.settles().is_some(),
            "a settlement is made by RateCheck::settle"
        );
        self.check_rate(policy, settlement)
    }

    /// How long a check may take before it fails with [`StoreErrorKind::Timeout`](super::StoreErrorKind::Timeout): a check is
    /// remembered for its deadline plus twice this (see the
    /// [attempt ledger](crate::store#the-attempt-ledger)).
    fn timeout(&self) -> Duration;

    /// Forgets what caller `key` has spent of every limit of `policy` (deletes its
    /// [`RatePolicy::store_keys`]), as if it had never been seen; other policies' state stays.
    /// A store with [`invalidations`](Self::invalidations) then broadcasts
    /// [`Invalidation::Caller`](super::Invalidation::Caller) for `key` under the policy's namespace.
    fn reset_rate(&self, policy: &Arc<RatePolicy>, key: Key) -> StoreFuture<()>;

    /// A subscription to the store's invalidation broadcast (see
    /// [Invalidations](crate::store#invalidations)), or `None` when the store has none (the default): a
    /// rate-limit layer subscribes once, and drops a caller's cached denial when the caller is
    /// reset or refunded through any copy. A store that offers it broadcasts
    /// [`Invalidation::Caller`](super::Invalidation::Caller) after every [`reset_rate`](Self::reset_rate), and after every
    /// settlement of a reservation that refunded quota and left the caller room on every limit;
    /// and [`Invalidation::Missed`](super::Invalidation::Missed) when some may have been lost. Called inside a Tokio runtime.
    fn invalidations(&self) -> Option<Invalidations> {
        None
    }

    /// Where the store keeps each layer's [limits in force](crate::rate::LimitTable), or `None`
    /// when it keeps none (the default): a layer built with
    /// [`build_in_store`](crate::rate_limit::RateLimitLayerBuilder::build_in_store) needs one.
    /// Every store of this crate keeps them.
    fn limits_store(&self) -> Option<&dyn LimitsStore> {
        None
    }

    /// Puts `waiter` at the end of caller `key`'s line under `policy`, or keeps it where it
    /// stands if it is in it, for `keep` from now; answers how many waiters stand ahead of it.
    ///
    /// A line is the order in which copies' waiting requests ask for room (see
    /// [Lines](crate::store#lines)): a layer with a
    /// [queue](crate::rate_limit::RateLimitLayerBuilder::queue) lines up the first waiter of
    /// each of its lines after a denial, and asks the store for room only when nobody stands
    /// ahead of it. Waiters stand in the order they first lined up (ties by `waiter`); one not
    /// lined up again within its `keep` has left. The line's key is
    /// [`RatePolicy::line_key`]. Received after `deadline`, a line-up changes nothing and fails
    /// with [`Timeout`](super::StoreErrorKind::Timeout). Safe to run twice: a waiter keeps its
    /// place.
    ///
    /// The default keeps no line: every waiter stands first, and the copies' waiters race for
    /// room as requests without a queue do. Every store of this crate keeps lines.
    fn line_up(
        &self,
        policy: &Arc<RatePolicy>,
        key: Key,
        waiter: u64,
        keep: Duration,
        deadline: Instant,
    ) -> StoreFuture<u32> {
        let _ = (policy, key, waiter, keep, deadline);
        Box::pin(std::future::ready(Ok(0)))
    }

    /// Takes `waiter` out of caller `key`'s line under `policy`: those behind it move up. Safe
    /// to run twice, and for a waiter not in the line. The default does nothing.
    fn leave_line(&self, policy: &Arc<RatePolicy>, key: Key, waiter: u64) -> StoreFuture<()> {
        let _ = (policy, key, waiter);
        Box::pin(std::future::ready(Ok(())))
    }
}

impl<T: RateStore + ?Sized> RateStore for Arc<T> {
    fn check_rate(&self, policy: &Arc<RatePolicy>, check: RateCheck) -> StoreFuture<RateOutcome> {
        (**self).check_rate(policy, check)
    }

    fn settle(&self, policy: &Arc<RatePolicy>, settlement: RateCheck) -> StoreFuture<RateOutcome> {
        (**self).settle(policy, settlement)
    }

    fn timeout(&self) -> Duration {
        (**self).timeout()
    }

    fn reset_rate(&self, policy: &Arc<RatePolicy>, key: Key) -> StoreFuture<()> {
        (**self).reset_rate(policy, key)
    }

    fn invalidations(&self) -> Option<Invalidations> {
        (**self).invalidations()
    }

    fn limits_store(&self) -> Option<&dyn LimitsStore> {
        (**self).limits_store()
    }

    fn line_up(
        &self,
        policy: &Arc<RatePolicy>,
        key: Key,
        waiter: u64,
        keep: Duration,
        deadline: Instant,
    ) -> StoreFuture<u32> {
        (**self).line_up(policy, key, waiter, keep, deadline)
    }

    fn leave_line(&self, policy: &Arc<RatePolicy>, key: Key, waiter: u64) -> StoreFuture<()> {
        (**self).leave_line(policy, key, waiter)
    }
}
