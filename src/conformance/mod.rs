//! The conformance suite every store passes (feature `conformance`): the behaviour the layers
//! rely on, one test per rule, for each capability of [`crate::store`].
//!
//! # Writing a store
//!
//! A backend implements the capabilities it serves — [`RateStore`](crate::store::RateStore),
//! [`LockStore`](crate::store::LockStore), [`IdempotencyStore`](crate::store::IdempotencyStore),
//! [`PermitStore`](crate::store::PermitStore) —
//! and each of its operations must be one atomic step on the shared server, decided on the
//! server's clock, and safe to run twice. The rules, as the suite checks them:
//!
//! - **Rate checks** decide as the three [`Algorithm`](crate::rate::Algorithm)s do, all of a
//!   check's limits or none (a limit that [counts calls](crate::rate::Limit::counting_calls)
//!   charged 1 by a check of any cost, never settled); the same [`RateCheck`](crate::rate::RateCheck) run again (its
//!   attempt id) is admitted without a second charge, whatever was charged in between; a cost
//!   of 0 only looks. A [settlement](crate::rate::RateCheck::settle) corrects an admitted
//!   check's charge to its actual cost, once, past the quota by at most one more, refunding
//!   only what the limit still counts of a reservation — the
//!   [attempt ledger](crate::store#the-attempt-ledger), whose answers the reference model
//!   ([`model`]) defines and [`property`] holds a store against.
//! - **Claims and locks**: one winner per key; a lock's holder alone extends or deletes it (its
//!   token); fencing tokens strictly increase per key, past a stale counter, across releases.
//! - **Idempotency records**: one claim among concurrent begins; a completion or extension by
//!   a stale token is refused; a completed record is replayed for the fingerprint it was made
//!   with and is a mismatch for any other.
//! - **Permits**: at most `limit` unexpired holders per key among concurrent acquisitions; a
//!   holder alone extends or gives back its permit; fencing tokens strictly increase per key;
//!   the same acquisition run twice takes one permit; waiters get the permits that free up in
//!   arrival order, and a place lapses unless renewed.
//! - **Lines** (optional, [`RateStore::line_up`](crate::store::RateStore::line_up)): waiters
//!   stand in the order they first lined up and keep their places when they line up again;
//!   one that leaves, or does not line up again within its keep, lets those behind move up.
//! - **Limits in force** (optional, [`LimitsStore`](crate::store::LimitsStore)): a table reads
//!   back as saved; a save names the version it read, so exactly one of concurrent writers
//!   wins; the history keeps the newest changes; copies register for a time of their own.
//! - **Reads** for operators' tools: a lock's state, a key's permits in use and waiters, an
//!   idempotency record's state, each read on the store's clock and changing nothing.
//! - **Invalidations** (optional): a store that offers
//!   [`invalidations`](crate::store::RateStore::invalidations) tells every subscription of a
//!   reset, and of a settlement that refunded a reservation and left the caller room (see the
//!   store docs' "Invalidations").
//! - **Deadlines**: a write received after its `deadline` changes nothing and fails as
//!   [`StoreErrorKind::Timeout`](crate::store::StoreErrorKind::Timeout) (see the store docs'
//!   "Deadlines").
//! - **Durations** are clamped to [`MAX_EXPIRY`](crate::store::MAX_EXPIRY), never an error; a
//!   fence key lives at least [`FENCE_TTL`](crate::store::FENCE_TTL) past its last lease, and a
//!   release marker [`RELEASE_MARKER_TTL`](crate::store::RELEASE_MARKER_TTL).
//!
//! # Running it
//!
//! One macro per capability, each expanding to a module of `#[test]`s, given an expression
//! (it may `.await`) that makes a `(store, guard)` pair for each test: the guard (a server
//! process, say, or `()`) lives as long as the test. [`store_suite!`](crate::store_suite) runs
//! all four. A store that delegates to [`MemoryStore`](crate::store::MemoryStore) passes it:
//!
//! ```ignore
//! // tests/my_store.rs, with tollgate's `conformance` feature on
//! tollgate::store_suite!((MyStore::new(), ()));
//! // or one capability only
//! tollgate::rate_store_suite!((MyStore::new(), ()));
//! ```
//!
//! The crate's own backends run it the same way; `tests/store/outside_store.rs` is such a
//! store, as an outside crate writes it. Each test runs on a tokio runtime of two workers, with
//! time and I/O, and keeps its keys apart from other tests' (random names), so that the tests of
//! a binary may share one server.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::future::Future;
use std::time::Duration;

use tokio::time::Instant;

pub mod idempotency;
pub mod limits;
pub mod line;
pub mod lock;
pub mod model;
pub mod permit;
pub mod property;
pub mod rate;

/// Runs one test of the suite on its own runtime: two worker threads, time and I/O enabled.
/// Used by the suite's macros.
#[doc(hidden)]
pub fn block_on<F: Future>(test: F) -> F::Output {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("a tokio runtime for the conformance test")
        .block_on(test)
}

/// A name no other test uses: `name-<random>`.
fn unique(name: &str) -> String {
    format!("{name}-{}", uuid::Uuid::new_v4().simple())
}

/// A deadline a healthy store meets: a second from now.
fn soon() -> Instant {
    Instant::now() + Duration::from_secs(1)
}

/// Expands to the module `rate_store` of one `#[test]` per rule of
/// [`RateStore`](crate::store::RateStore), each on a store from `$make`, an expression (it may
/// `.await`) that gives `(store, guard)`.
#[macro_export]
macro_rules! rate_store_suite {
    ($make:expr) => {
        $crate::__conformance_tests!(rate_store, rate, $make;
            admits_exactly_the_quota_then_denies,
            remaining_counts_down_and_resets_are_sane,
            limits_are_all_or_nothing,
            cost_is_charged_and_oversized_cost_never_fits,
            callers_do_not_share_quota,
            window_slides_and_retry_after_is_honest,
            concurrent_callers_get_exactly_the_quota,
            gcra_spaces_requests_after_the_burst,
            counter_weights_the_previous_window,
            log_is_exact_across_the_window_boundary,
            rate_checks_run_twice_are_charged_once,
            counter_reset_is_the_retry_after_at_a_window_start,
            cost_zero_looks_without_charging,
            reset_forgets_a_callers_limits_and_nothing_else,
            rate_checks_resent_after_others_are_charged_once,
            settlements_refund_or_charge_the_difference,
            an_overrun_denies_until_the_debt_is_gone,
            settlements_run_twice_apply_once,
            a_late_refund_returns_nothing_others_spent,
            a_refund_after_a_reset_returns_nothing_others_spent,
            a_counter_refund_comes_out_of_its_own_window,
            a_check_retried_past_its_deadline_is_charged_once,
            a_settlement_resent_after_another_is_applied_once,
            attempts_are_remembered_however_many_follow,
            a_refunded_reservation_sent_again_is_not_charged,
            huge_costs_fail_nothing_around_them,
            a_denial_blocks_the_caller_for_block_for,
            a_block_charges_nothing,
            a_block_on_one_limit_blocks_the_whole_check,
            a_reset_ends_a_block_and_others_are_not_blocked,
            a_reset_without_the_penalty_still_ends_the_block,
            only_a_limit_with_block_for_blocks,
            resent_checks_during_a_block_are_answered_as_recorded,
            resets_and_refunds_are_told_to_subscribers,
            a_held_log_charge_counts_until_a_window_after_its_hold,
            a_held_gcra_charge_is_charged_from_its_holds_end,
            a_held_counter_charge_is_charged_as_any,
            a_calls_limit_is_charged_one_whatever_the_cost,
            a_cost_denial_charges_no_calls,
            a_calls_denial_charges_no_cost,
            a_mixed_denial_waits_for_the_latest_limit,
            a_settlement_leaves_a_calls_limit_as_it_was,
            a_look_charges_a_calls_limit_nothing,
        );
    };
}

/// Expands to the module `rate_lines` of one `#[test]` per rule of
/// [`RateStore::line_up`](crate::store::RateStore::line_up) and
/// [`leave_line`](crate::store::RateStore::leave_line), each on a store from `$make`, an
/// expression (it may `.await`) that gives `(store, guard)`. Not part of
/// [`store_suite!`](crate::store_suite): a store may keep no lines (its waiters then race).
#[macro_export]
macro_rules! rate_lines_suite {
    ($make:expr) => {
        $crate::__conformance_tests!(rate_lines, line, $make;
            waiters_stand_in_the_order_they_lined_up,
            a_waiter_that_leaves_lets_those_behind_move_up,
            a_place_lapses_unless_kept,
            lines_are_per_caller_and_policy,
            a_line_up_after_its_deadline_changes_nothing,
        );
    };
}

/// Expands to the module `lock_store` of one `#[test]` per rule of
/// [`LockStore`](crate::store::LockStore) (claims, locks, fencing tokens), each on a store from
/// `$make`, an expression (it may `.await`) that gives `(store, guard)`; the store is `Clone`.
#[macro_export]
macro_rules! lock_store_suite {
    ($make:expr) => {
        $crate::__conformance_tests!(lock_store, lock, $make;
            claim_has_exactly_one_winner,
            claim_expires_only_when_asked,
            claim_release_is_the_winners_alone,
            once_per_period_runs_exactly_once_per_period,
            lock_excludes_and_expiry_frees,
            stale_owner_cannot_extend_or_release,
            fencing_tokens_strictly_increase,
            fencing_tokens_increase_under_contention,
            with_lock_keeps_the_lease_alive,
            claims_run_twice_win_twice,
            lock_acquisitions_run_twice_keep_their_fence,
            fencing_tokens_pass_a_stale_counter_and_the_store_clock,
            a_release_frees_the_key_once,
            huge_durations_are_clamped_alike,
            writes_after_their_deadline_change_nothing,
            lock_state_reads_the_holder_and_changes_nothing,
        );
    };
}

/// Expands to the module `idempotency_store` of one `#[test]` per rule of
/// [`IdempotencyStore`](crate::store::IdempotencyStore), each on a store from `$make`, an
/// expression (it may `.await`) that gives `(store, guard)`; the store is `Clone`.
#[macro_export]
macro_rules! idempotency_store_suite {
    ($make:expr) => {
        $crate::__conformance_tests!(idempotency_store, idempotency, $make;
            lifecycle,
            exactly_one_claim_among_concurrent,
            token_checks_and_takeover,
            retention_and_release,
            operations_run_twice_answer_alike,
            huge_durations_are_clamped_alike,
            writes_after_their_deadline_change_nothing,
            idempotency_state_reads_the_record_and_changes_nothing,
        );
    };
}

/// Expands to the module `permit_store` of one `#[test]` per rule of
/// [`PermitStore`](crate::store::PermitStore), each on a store from `$make`, an expression (it
/// may `.await`) that gives `(store, guard)`; the store is `Clone`.
#[macro_export]
macro_rules! permit_store_suite {
    ($make:expr) => {
        $crate::__conformance_tests!(permit_store, permit, $make;
            exactly_limit_permits_among_concurrent,
            keys_do_not_share_permits,
            a_release_gives_back_one_permit_once,
            leases_end_unless_extended,
            fencing_tokens_strictly_increase,
            acquisitions_run_twice_take_one_permit,
            a_limit_of_zero_is_always_full,
            huge_durations_are_clamped_alike,
            writes_after_their_deadline_change_nothing,
            permits_go_to_waiters_in_arrival_order,
            a_lapsed_place_leaves_the_queue,
            permit_usage_reads_permits_and_waiters,
        );
    };
}

/// Expands to the module `limits_store` of one `#[test]` per rule of
/// [`LimitsStore`](crate::store::LimitsStore), each on a store from `$make`, an expression (it
/// may `.await`) that gives `(store, guard)`; the store is `Clone`. Not part of
/// [`store_suite!`](crate::store_suite): a store may keep no limits.
#[macro_export]
macro_rules! limits_store_suite {
    ($make:expr) => {
        $crate::__conformance_tests!(limits_store, limits, $make;
            a_table_reads_back_as_saved,
            a_save_needs_the_version_it_read,
            exactly_one_of_concurrent_saves_wins,
            history_keeps_the_newest_changes,
            namespaces_are_apart,
            copies_register_and_lapse,
        );
    };
}

/// The whole suite: [`rate_store_suite!`](crate::rate_store_suite),
/// [`lock_store_suite!`](crate::lock_store_suite),
/// [`idempotency_store_suite!`](crate::idempotency_store_suite) and
/// [`permit_store_suite!`](crate::permit_store_suite) on stores from `$make`.
#[macro_export]
macro_rules! store_suite {
    ($make:expr) => {
        $crate::rate_store_suite!($make);
        $crate::lock_store_suite!($make);
        $crate::idempotency_store_suite!($make);
        $crate::permit_store_suite!($make);
    };
}

/// The tests of one capability, in a module of their own.
#[doc(hidden)]
#[macro_export]
macro_rules! __conformance_tests {
    ($module:ident, $rules:ident, $make:expr; $($name:ident),* $(,)?) => {
        mod $module {
            #[allow(unused_imports)]
            use super::*;
            $(
                #[test]
                fn $name() {
                    $crate::conformance::block_on(async {
                        let (store, _guard) = $make;
                        $crate::conformance::$rules::$name(&store).await;
                    });
                }
            )*
        }
    };
}
