//! The rules of [`PermitStore`]: at most `limit` holders per key, leases, fencing tokens,
//! attempts run twice, deadlines.

use std::time::Duration;

use super::{soon, unique};
use crate::store::PermitRequest;
use crate::store::{Hold, PermitAttempt, PermitStore, PermitUsage, StoreErrorKind};

/// A fresh key of one hash slot and its fence key: `(permits, fence)`.
fn raw_keys() -> (String, String) {
    let permits = format!("t:cc:{{{}}}", unique("permits"));
    let fence = format!("{permits}:fence");
    (permits, fence)
}

/// Tries to take one of `limit` permits of `key` for `token`.
async fn acquire(
    store: &impl PermitStore,
    (key, fence): &(String, String),
    token: &str,
    limit: u32,
    lease: Duration,
) -> PermitAttempt {
    store
        .permit_acquire(
            PermitRequest::new(Hold::new(key, token), fence.clone(), limit, lease, None),
            soon(),
        )
        .await
        .expect("store answers")
}

fn fence_of(attempt: PermitAttempt) -> u64 {
    match attempt {
        PermitAttempt::Acquired { fence } => fence,
        PermitAttempt::Full { .. } => panic!("expected a permit, got {attempt:?}"),
    }
}

/// Of many concurrent acquisitions, exactly `limit` get a permit; the rest learn when the first
/// lease ends.
pub async fn exactly_limit_permits_among_concurrent(store: &(impl PermitStore + Clone)) {
    let lease = Duration::from_secs(30);
    for limit in [1, 3] {
        let keys = raw_keys();
        let attempts = (0..50).map(|i| {
            let (store, keys) = (store.clone(), keys.clone());
            async move { acquire(&store, &keys, &format!("t{i}"), limit, lease).await }
        });
        let results = futures_util::future::join_all(attempts).await;
        let taken = results
            .iter()
            .filter(|a| matches!(a, PermitAttempt::Acquired { .. }))
            .count();
        assert_eq!(taken, usize::try_from(limit).unwrap(), "limit {limit}");
        for attempt in results {
            if let PermitAttempt::Full { next_free, .. } = attempt {
                assert!(
                    next_free > Duration::from_secs(29) && next_free <= lease,
                    "{next_free:?}"
                );
            }
        }
    }
}

/// Keys do not share permits.
pub async fn keys_do_not_share_permits(store: &(impl PermitStore + Clone)) {
    let lease = Duration::from_secs(30);
    let (a, b) = (raw_keys(), raw_keys());
    fence_of(acquire(store, &a, "x", 1, lease).await);
    fence_of(acquire(store, &b, "y", 1, lease).await);
    let full = acquire(store, &a, "z", 1, lease).await;
    assert!(matches!(full, PermitAttempt::Full { .. }), "{full:?}");
}

/// A release gives exactly its own permit back, once; another token's release, or a second
/// release call, gives nothing back.
pub async fn a_release_gives_back_one_permit_once(store: &(impl PermitStore + Clone)) {
    let lease = Duration::from_secs(30);
    let keys = raw_keys();
    fence_of(acquire(store, &keys, "a", 2, lease).await);
    fence_of(acquire(store, &keys, "b", 2, lease).await);
    let release = |token: &str| store.permit_release(Hold::new(&keys.0, token));
    assert!(!release("stranger").await.unwrap(), "not a holder");
    assert!(release("a").await.unwrap());
    assert!(!release("a").await.unwrap(), "released already");
    fence_of(acquire(store, &keys, "c", 2, lease).await);
    let full = acquire(store, &keys, "d", 2, lease).await;
    assert!(matches!(full, PermitAttempt::Full { .. }), "{full:?}");
}

/// A lease that ends gives its permit back; an extension keeps it, while it has not ended.
pub async fn leases_end_unless_extended(store: &(impl PermitStore + Clone)) {
    let lease = Duration::from_secs(2);
    let keys = raw_keys();
    fence_of(acquire(store, &keys, "kept", 2, lease).await);
    fence_of(acquire(store, &keys, "dropped", 2, lease).await);
    tokio::time::sleep(Duration::from_millis(1200)).await;
    let extend = |token: &str| store.permit_extend(Hold::new(&keys.0, token), lease, soon());
    assert!(extend("kept").await.unwrap());
    assert!(!extend("stranger").await.unwrap());
    tokio::time::sleep(Duration::from_millis(1200)).await;
    // 2400 ms in: "dropped" has ended, "kept" runs until 3200 ms or later
    assert!(
        !extend("dropped").await.unwrap(),
        "an ended lease is not extended"
    );
    fence_of(acquire(store, &keys, "next", 2, lease).await);
    let full = acquire(store, &keys, "more", 2, lease).await;
    assert!(matches!(full, PermitAttempt::Full { .. }), "{full:?}");
    let released = store.permit_release(Hold::new(&keys.0, "dropped"));
    assert!(!released.await.unwrap(), "an ended lease is not released");
}

/// Fencing tokens strictly increase per key, across releases and holders.
pub async fn fencing_tokens_strictly_increase(store: &(impl PermitStore + Clone)) {
    let lease = Duration::from_secs(30);
    let keys = raw_keys();
    let mut last = 0;
    for i in 0..20 {
        let token = format!("t{i}");
        let fence = fence_of(acquire(store, &keys, &token, 2, lease).await);
        assert!(fence > last, "{fence} after {last}");
        last = fence;
        if i % 2 == 1 {
            let release = store.permit_release(Hold::new(&keys.0, &token));
            assert!(release.await.unwrap());
            let earlier = store.permit_release(Hold::new(&keys.0, format!("t{}", i - 1)));
            assert!(earlier.await.unwrap());
        }
    }
}

/// The same acquisition run twice (a re-sent command) takes one permit: the holder keeps it,
/// with a fresh lease and a higher fencing token.
pub async fn acquisitions_run_twice_take_one_permit(store: &(impl PermitStore + Clone)) {
    let lease = Duration::from_secs(30);
    let keys = raw_keys();
    let first = fence_of(acquire(store, &keys, "a", 2, lease).await);
    let again = fence_of(acquire(store, &keys, "a", 2, lease).await);
    assert!(again > first);
    fence_of(acquire(store, &keys, "b", 2, lease).await);
    let full = acquire(store, &keys, "c", 2, lease).await;
    assert!(matches!(full, PermitAttempt::Full { .. }), "{full:?}");
    // the holder's own retry is no newcomer, even when every permit is held
    fence_of(acquire(store, &keys, "a", 2, lease).await);
}

/// A limit of 0 admits nobody, with nothing to wait for.
pub async fn a_limit_of_zero_is_always_full(store: &(impl PermitStore + Clone)) {
    let attempt = acquire(store, &raw_keys(), "a", 0, Duration::from_secs(1)).await;
    assert_eq!(
        attempt,
        PermitAttempt::Full {
            next_free: Duration::ZERO,
            ahead: 0
        }
    );
}

/// A lease of `Duration::MAX` is clamped, not refused, and is held.
pub async fn huge_durations_are_clamped_alike(store: &(impl PermitStore + Clone)) {
    let keys = raw_keys();
    fence_of(acquire(store, &keys, "a", 1, Duration::MAX).await);
    let full = acquire(store, &keys, "b", 1, Duration::MAX).await;
    assert!(matches!(full, PermitAttempt::Full { .. }), "{full:?}");
    let extended = store.permit_extend(Hold::new(&keys.0, "a"), Duration::MAX, soon());
    assert!(extended.await.unwrap());
    assert!(store.permit_release(Hold::new(&keys.0, "a")).await.unwrap());
}

/// An acquisition or extension that reaches the store after its deadline does nothing and
/// fails as a timeout.
pub async fn writes_after_their_deadline_change_nothing(store: &(impl PermitStore + Clone)) {
    let passed = tokio::time::Instant::now();
    let lease = Duration::from_millis(500);
    let keys = raw_keys();
    let late = store.permit_acquire(
        PermitRequest::new(Hold::new(&keys.0, "a"), keys.1.clone(), 1, lease, None),
        passed,
    );
    let error = late.await.expect_err("a late acquisition answered");
    assert_eq!(error.kind(), StoreErrorKind::Timeout, "{error}");
    fence_of(acquire(store, &keys, "b", 1, lease).await);
    let late = store.permit_extend(Hold::new(&keys.0, "b"), Duration::from_secs(60), passed);
    let error = late.await.expect_err("a late extension answered");
    assert_eq!(error.kind(), StoreErrorKind::Timeout, "{error}");
    tokio::time::sleep(Duration::from_millis(600)).await;
    // the late extension did not keep "b"
    fence_of(acquire(store, &keys, "c", 1, lease).await);
}

/// Tries to take one of `limit` permits of `key` for `token`, keeping its place in the queue for
/// `wait` should it have to wait.
async fn queue(
    store: &impl PermitStore,
    (key, fence): &(String, String),
    token: &str,
    limit: u32,
    wait: Duration,
) -> PermitAttempt {
    let lease = Duration::from_secs(30);
    let hold = Hold::new(key, token);
    store
        .permit_acquire(
            PermitRequest::new(hold, fence.clone(), limit, lease, Some(wait)),
            soon(),
        )
        .await
        .expect("store answers")
}

fn ahead_of(attempt: PermitAttempt) -> u32 {
    match attempt {
        PermitAttempt::Full { ahead, .. } => ahead,
        PermitAttempt::Acquired { .. } => panic!("expected to wait, got {attempt:?}"),
    }
}

/// Waiters get the permits that free up in the order they arrived; a holder that does not
/// queue waits behind all of them; giving up (a release) leaves the queue.
pub async fn permits_go_to_waiters_in_arrival_order(store: &(impl PermitStore + Clone)) {
    let (keys, wait) = (raw_keys(), Duration::from_secs(30));
    fence_of(queue(store, &keys, "a", 1, wait).await);
    assert_eq!(ahead_of(queue(store, &keys, "b", 1, wait).await), 0);
    assert_eq!(ahead_of(queue(store, &keys, "c", 1, wait).await), 1);
    assert_eq!(ahead_of(queue(store, &keys, "d", 1, wait).await), 2);
    let release = |token: &str| store.permit_release(Hold::new(&keys.0, token));
    assert!(release("a").await.unwrap());
    // free, but b came first
    assert_eq!(ahead_of(queue(store, &keys, "c", 1, wait).await), 1);
    let unqueued = acquire(store, &keys, "e", 1, wait).await;
    assert!(
        matches!(unqueued, PermitAttempt::Full { ahead: 3, .. }),
        "{unqueued:?}"
    );
    fence_of(queue(store, &keys, "b", 1, wait).await);
    // c gives up: d is next
    assert!(!release("c").await.unwrap(), "a waiter holds no permit");
    assert!(release("b").await.unwrap());
    fence_of(queue(store, &keys, "d", 1, wait).await);
}

/// A waiter that stops trying loses its place once it lapses.
pub async fn a_lapsed_place_leaves_the_queue(store: &(impl PermitStore + Clone)) {
    let keys = raw_keys();
    let (long, brief) = (Duration::from_secs(30), Duration::from_millis(300));
    fence_of(queue(store, &keys, "a", 1, long).await);
    assert_eq!(ahead_of(queue(store, &keys, "b", 1, brief).await), 0);
    assert_eq!(ahead_of(queue(store, &keys, "c", 1, long).await), 1);
    tokio::time::sleep(Duration::from_millis(600)).await;
    assert_eq!(
        ahead_of(queue(store, &keys, "c", 1, long).await),
        0,
        "b's place lapsed"
    );
    assert!(store.permit_release(Hold::new(&keys.0, "a")).await.unwrap());
    fence_of(queue(store, &keys, "c", 1, long).await);
}

/// `permit_usage` of `key`.
async fn usage_of(store: &impl PermitStore, (key, _): &(String, String)) -> PermitUsage {
    store.permit_usage(key).await.expect("store answers")
}

/// Whether `left` is within the last second of `lease`: a lease read just after it was set.
fn fresh(left: Duration, lease: Duration) -> bool {
    left <= lease && left > lease - Duration::from_secs(1)
}

/// A key's usage reads each permit in use with the lease it has left, shortest first, and the
/// waiters that keep a place, and changes nothing; released permits, ended leases and places
/// given up or lapsed are not counted.
pub async fn permit_usage_reads_permits_and_waiters(store: &(impl PermitStore + Clone)) {
    let keys = raw_keys();
    assert_eq!(
        usage_of(store, &keys).await,
        PermitUsage::new(Vec::new(), 0)
    );
    let (long, short) = (Duration::from_secs(30), Duration::from_secs(10));
    fence_of(acquire(store, &keys, "a", 2, long).await);
    fence_of(acquire(store, &keys, "b", 2, short).await);
    let wait = Duration::from_secs(30);
    assert_eq!(ahead_of(queue(store, &keys, "c", 2, wait).await), 0);
    assert_eq!(
        ahead_of(queue(store, &keys, "d", 2, Duration::from_millis(300)).await),
        1
    );
    // one that does not queue is not a waiter
    assert!(matches!(
        acquire(store, &keys, "e", 2, long).await,
        PermitAttempt::Full { .. }
    ));
    for _ in 0..2 {
        let usage = usage_of(store, &keys).await;
        assert_eq!((usage.in_use(), usage.waiting), (2, 2), "{usage:?}");
        assert!(fresh(usage.leases_left[0], short), "{usage:?}");
        assert!(fresh(usage.leases_left[1], long), "{usage:?}");
    }
    tokio::time::sleep(Duration::from_millis(600)).await;
    assert_eq!(usage_of(store, &keys).await.waiting, 1, "d's place lapsed");
    assert!(store.permit_release(Hold::new(&keys.0, "b")).await.unwrap());
    let usage = usage_of(store, &keys).await;
    assert_eq!((usage.in_use(), usage.waiting), (1, 1), "{usage:?}");
    assert!(fresh(usage.leases_left[0], long), "{usage:?}");
    assert!(!store.permit_release(Hold::new(&keys.0, "c")).await.unwrap());
    assert_eq!(
        usage_of(store, &keys).await.waiting,
        0,
        "c gave its place up"
    );
    fence_of(acquire(store, &keys, "f", 2, Duration::from_millis(300)).await);
    assert_eq!(usage_of(store, &keys).await.in_use(), 2);
    tokio::time::sleep(Duration::from_millis(600)).await;
    let usage = usage_of(store, &keys).await;
    assert_eq!(usage.in_use(), 1, "f's lease ended: {usage:?}");
    assert!(store.permit_release(Hold::new(&keys.0, "a")).await.unwrap());
    assert_eq!(
        usage_of(store, &keys).await,
        PermitUsage::new(Vec::new(), 0)
    );
}
