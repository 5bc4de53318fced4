//! The rules of [`RateStore::line_up`] and [`RateStore::leave_line`]: the order in which copies'
//! waiting requests ask for room.

use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use super::{soon, unique};
use crate::key::Key;
use crate::rate::{Algorithm, Limit, RatePolicy};
use crate::store::{RateStore, StoreErrorKind};

/// Long enough that no place lapses within a test.
const KEEP: Duration = Duration::from_secs(30);

/// A policy in a namespace of its own.
fn policy() -> Arc<RatePolicy> {
    let ns = format!("t{}:rl", uuid::Uuid::new_v4().as_u64_pair().0 >> 32);
    let limits = vec![Limit::per_second("s", 10)];
    Arc::new(RatePolicy::new(ns, Algorithm::Gcra, limits).expect("valid policy"))
}

fn caller() -> Key {
    Key::new("test", unique("line").as_bytes())
}

/// How many stand ahead of `waiter` once it lines up for `keep`.
async fn ahead(
    store: &impl RateStore,
    p: &Arc<RatePolicy>,
    key: Key,
    waiter: u64,
    keep: Duration,
) -> u32 {
    store
        .line_up(p, key, waiter, keep, soon())
        .await
        .expect("store answers")
}

async fn leave(store: &impl RateStore, p: &Arc<RatePolicy>, key: Key, waiter: u64) {
    store
        .leave_line(p, key, waiter)
        .await
        .expect("store answers");
}

/// Waiters stand in the order they first lined up, and keep their places when they line up
/// again.
pub async fn waiters_stand_in_the_order_they_lined_up(store: &impl RateStore) {
    let (p, key) = (policy(), caller());
    // ids out of order: the order is the lining up's, not the ids'
    for (nth, waiter) in [30, 10, 20].into_iter().enumerate() {
        assert_eq!(ahead(store, &p, key, waiter, KEEP).await, nth as u32);
    }
    for (nth, waiter) in [20, 30, 10].into_iter().enumerate() {
        let expected = [2, 0, 1][nth];
        assert_eq!(
            ahead(store, &p, key, waiter, KEEP).await,
            expected,
            "waiter {waiter} lined up again"
        );
    }
}

/// A waiter that leaves lets those behind it move up; leaving twice, or a waiter that never
/// lined up, changes nothing; one that lines up again after leaving stands last.
pub async fn a_waiter_that_leaves_lets_those_behind_move_up(store: &impl RateStore) {
    let (p, key) = (policy(), caller());
    for waiter in 1..=3 {
        ahead(store, &p, key, waiter, KEEP).await;
    }
    leave(store, &p, key, 1).await;
    leave(store, &p, key, 1).await;
    leave(store, &p, key, 99).await;
    assert_eq!(ahead(store, &p, key, 2, KEEP).await, 0);
    assert_eq!(ahead(store, &p, key, 3, KEEP).await, 1);
    assert_eq!(ahead(store, &p, key, 1, KEEP).await, 2, "back, at the end");
    for waiter in 1..=3 {
        leave(store, &p, key, waiter).await;
    }
    assert_eq!(ahead(store, &p, key, 4, KEEP).await, 0, "an empty line");
}

/// A waiter not lined up again within its keep has left: those behind move up, and lining up
/// again puts it last.
pub async fn a_place_lapses_unless_kept(store: &impl RateStore) {
    let (p, key) = (policy(), caller());
    assert_eq!(
        ahead(store, &p, key, 1, Duration::from_millis(300)).await,
        0
    );
    assert_eq!(ahead(store, &p, key, 2, KEEP).await, 1);
    tokio::time::sleep(Duration::from_millis(600)).await;
    assert_eq!(ahead(store, &p, key, 2, KEEP).await, 0, "1's place lapsed");
    assert_eq!(
        ahead(store, &p, key, 1, KEEP).await,
        1,
        "1 back, at the end"
    );
}

/// Each caller of each policy has a line of its own.
pub async fn lines_are_per_caller_and_policy(store: &impl RateStore) {
    let (p, q) = (policy(), policy());
    let (a, b) = (caller(), caller());
    assert_eq!(ahead(store, &p, a, 1, KEEP).await, 0);
    assert_eq!(ahead(store, &p, b, 2, KEEP).await, 0, "another caller");
    assert_eq!(ahead(store, &q, a, 3, KEEP).await, 0, "another policy");
    assert_eq!(ahead(store, &p, a, 4, KEEP).await, 1);
}

/// A line-up received after its deadline changes nothing and fails as a timeout.
pub async fn a_line_up_after_its_deadline_changes_nothing(store: &impl RateStore) {
    let (p, key) = (policy(), caller());
    let late = store
        .line_up(&p, key, 1, KEEP, Instant::now() - Duration::from_millis(1))
        .await;
    assert_eq!(late.unwrap_err().kind(), StoreErrorKind::Timeout);
    assert_eq!(ahead(store, &p, key, 2, KEEP).await, 0, "1 never lined up");
}
