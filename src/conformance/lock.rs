//! The rules of [`LockStore`]: claims, locks with fencing tokens, attempts run twice, deadlines.

use std::time::Duration;

use super::{soon, unique};
use crate::claim::Claims;
use crate::lock::{LockError, Locks};
use crate::store::{ClaimRequest, LockRequest};
use crate::store::{Hold, LockAttempt, LockState, LockStore, StoreErrorKind};

/// Keys of one hash slot for the raw lock operations: `(lock, fence)`.
fn raw_lock_keys() -> (String, String) {
    let lock = format!("t:lock:{{{}}}", unique("raw"));
    let fence = format!("{lock}:fence");
    (lock, fence)
}

/// Claim has exactly one winner.
pub async fn claim_has_exactly_one_winner(store: &(impl LockStore + Clone)) {
    let claims = Claims::new(store.clone());
    for _ in 0..5 {
        let coupon = unique("coupon");
        let attempts = (0..100).map(|i| {
            let claims = claims.clone();
            let coupon = coupon.clone();
            async move {
                claims
                    .claim_once_as(&coupon, &format!("order-{i}"), None)
                    .await
            }
        });
        let results: Vec<_> = futures_util::future::join_all(attempts)
            .await
            .into_iter()
            .map(|r| r.expect("store answers"))
            .collect();
        let winners: Vec<_> = results.iter().filter(|c| c.won()).collect();
        assert_eq!(winners.len(), 1);
        let holder = winners[0].holder().to_owned();
        assert!(holder.starts_with("order-"));
        assert!(
            results.iter().all(|c| c.holder() == holder),
            "losers learn the winner"
        );
    }
}

/// Claim expires only when asked.
pub async fn claim_expires_only_when_asked(store: &(impl LockStore + Clone)) {
    let claims = Claims::new(store.clone());
    let (brief, forever) = (unique("brief"), unique("forever"));
    assert!(
        claims
            .claim_once(&brief, Duration::from_secs(1))
            .await
            .unwrap()
            .won()
    );
    assert!(claims.claim_once(&forever, None).await.unwrap().won());
    assert!(
        !claims
            .claim_once(&brief, Duration::from_secs(1))
            .await
            .unwrap()
            .won()
    );
    tokio::time::sleep(Duration::from_millis(1100)).await;
    assert!(
        claims.claim_once(&brief, None).await.unwrap().won(),
        "expired"
    );
    assert!(
        !claims.claim_once(&forever, None).await.unwrap().won(),
        "kept"
    );
}

/// Work claimed `once_per` a period runs once per period: of 50 parallel attempts exactly one
/// wins, none until the period ends, and exactly one of the next 50 after it.
pub async fn once_per_period_runs_exactly_once_per_period(store: &(impl LockStore + Clone)) {
    let period = Duration::from_millis(400);
    let job = unique("every-400ms");
    let wins = || async {
        let attempts = (0..50).map(|_| {
            let claims = Claims::new(store.clone());
            let job = job.clone();
            async move { claims.once_per(&job, period).await }
        });
        let results = futures_util::future::join_all(attempts).await;
        let results: Vec<_> = results
            .into_iter()
            .map(|r| r.expect("store answers"))
            .collect();
        results.iter().filter(|claim| claim.won()).count()
    };
    assert_eq!(wins().await, 1, "the first period");
    tokio::time::sleep(period / 4).await;
    assert_eq!(wins().await, 0, "within the period");
    tokio::time::sleep(period).await;
    assert_eq!(wins().await, 1, "the next period");
}

/// Claim release is the winners alone.
pub async fn claim_release_is_the_winners_alone(store: &(impl LockStore + Clone)) {
    let claims = Claims::new(store.clone());
    let name = unique("job");
    let won = claims.claim_once(&name, None).await.unwrap();
    let lost = claims.claim_once(&name, None).await.unwrap();
    assert!(won.won() && !lost.won());
    assert!(
        !claims.release(&lost).await.unwrap(),
        "a loser cannot release"
    );
    assert!(!claims.claim_once(&name, None).await.unwrap().won());
    assert!(claims.release(&won).await.unwrap());
    assert!(!claims.release(&won).await.unwrap(), "released once");
    assert!(
        claims.claim_once(&name, None).await.unwrap().won(),
        "free again"
    );
}

/// Lock excludes and expiry frees.
pub async fn lock_excludes_and_expiry_frees(store: &(impl LockStore + Clone)) {
    let locks = Locks::new(store.clone());
    let name = unique("lock");
    let guard = locks
        .try_acquire(&name, Duration::from_secs(1))
        .await
        .unwrap();
    match locks.try_acquire(&name, Duration::from_secs(1)).await {
        Err(LockError::Busy { lease_left }) => {
            assert!(
                lease_left > Duration::from_millis(300) && lease_left <= Duration::from_secs(1),
                "{lease_left:?}"
            );
        }
        other => panic!("expected Busy, got {other:?}"),
    }
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let next = locks
        .try_acquire(&name, Duration::from_secs(5))
        .await
        .expect("expired lease frees");
    assert!(next.fencing_token() > guard.fencing_token());
    next.release().await.unwrap();
    let again = locks
        .try_acquire(&name, Duration::from_secs(5))
        .await
        .expect("released");
    again.release().await.unwrap();
    std::mem::forget(guard);
}

/// Stale owner cannot extend or release.
pub async fn stale_owner_cannot_extend_or_release(store: &(impl LockStore + Clone)) {
    // two separately built lock handles, as two copies of a service would have
    let (a, b) = (Locks::new(store.clone()), Locks::new(store.clone()));
    let name = unique("race");
    let stale = a
        .try_acquire(&name, Duration::from_millis(200))
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(260)).await;
    let current = b
        .try_acquire(&name, Duration::from_secs(10))
        .await
        .expect("A's lease expired");
    assert!(matches!(stale.extend().await, Err(LockError::Lost)));
    assert!(matches!(stale.release().await, Err(LockError::Lost)));
    // B still holds it
    assert!(matches!(
        a.try_acquire(&name, Duration::from_secs(1)).await,
        Err(LockError::Busy { .. })
    ));
    current.extend().await.expect("the owner extends");
    current.release().await.expect("the owner releases");
}

/// Fencing tokens strictly increase.
pub async fn fencing_tokens_strictly_increase(store: &(impl LockStore + Clone)) {
    let (a, b) = (Locks::new(store.clone()), Locks::new(store.clone()));
    let name = unique("fence");
    let mut last = 0;
    for i in 0..20 {
        let locks = if i % 2 == 0 { &a } else { &b };
        let guard = locks
            .try_acquire(&name, Duration::from_secs(5))
            .await
            .unwrap();
        assert!(
            guard.fencing_token() > last,
            "token {} after {last}",
            guard.fencing_token()
        );
        last = guard.fencing_token();
        guard.release().await.unwrap();
    }
    // another lock name has its own sequence, still valid
    let other = a
        .try_acquire(unique("fence"), Duration::from_secs(5))
        .await
        .unwrap();
    assert!(other.fencing_token() > 0);
    other.release().await.unwrap();
}

/// Fencing tokens increase under contention.
pub async fn fencing_tokens_increase_under_contention(store: &(impl LockStore + Clone)) {
    let name = unique("contended");
    let held = std::sync::Arc::new(tokio::sync::Mutex::new(Vec::new()));
    let workers = (0..8).map(|_| {
        let locks = Locks::new(store.clone());
        let name = name.clone();
        let held = held.clone();
        tokio::spawn(async move {
            for _ in 0..5 {
                let guard = locks
                    .acquire(&name, Duration::from_secs(5), Duration::from_secs(20))
                    .await
                    .expect("acquired within the wait");
                // recorded while holding the lock: the order of the list is the order of holding
                held.lock().await.push(guard.fencing_token());
                tokio::time::sleep(Duration::from_millis(2)).await;
                guard.release().await.expect("still ours");
            }
        })
    });
    for worker in futures_util::future::join_all(workers).await {
        worker.unwrap();
    }
    let tokens = held.lock().await.clone();
    assert_eq!(tokens.len(), 40);
    assert!(tokens.windows(2).all(|w| w[0] < w[1]), "{tokens:?}");
}

/// With lock keeps the lease alive.
pub async fn with_lock_keeps_the_lease_alive(store: &(impl LockStore + Clone)) {
    let locks = Locks::new(store.clone());
    let name = unique("long-work");
    let lease = Duration::from_secs(1);
    let other = locks.clone();
    let probe_name = name.clone();
    let result = locks
        .with_lock(&name, lease, |lease_handle| async move {
            // work outlives the lease three times over; the lock must stay ours
            for _ in 0..6 {
                tokio::time::sleep(Duration::from_millis(500)).await;
                assert!(matches!(
                    other.try_acquire(&probe_name, Duration::from_secs(1)).await,
                    Err(LockError::Busy { .. })
                ));
            }
            assert!(!lease_handle.is_lost());
            lease_handle.fencing_token()
        })
        .await
        .expect("lease held throughout");
    assert!(result > 0);
    // released afterwards
    let after = locks
        .try_acquire(&name, lease)
        .await
        .expect("released after work");
    assert!(after.fencing_token() > result);
    after.release().await.unwrap();
    // busy while held elsewhere
    let holder = locks
        .try_acquire(&name, Duration::from_secs(5))
        .await
        .unwrap();
    let busy = locks.with_lock(&name, lease, |_| async {}).await;
    assert!(matches!(busy, Err(LockError::Busy { .. })));
    holder.release().await.unwrap();
}

/// Claims run twice win twice.
pub async fn claims_run_twice_win_twice(store: &(impl LockStore + Clone)) {
    let claims = Claims::new(store.clone());
    let name = unique("coupon");
    let first = claims.claim_once_as(&name, "order-17", None).await.unwrap();
    let second = claims.claim_once_as(&name, "order-17", None).await.unwrap();
    assert!(first.won() && second.won(), "the same holder wins again");
    assert_eq!(second.holder(), "order-17");
    let other = claims.claim_once_as(&name, "order-18", None).await.unwrap();
    assert!(!other.won());
    assert_eq!(other.holder(), "order-17");
}

/// Lock acquisitions run twice keep their fence.
pub async fn lock_acquisitions_run_twice_keep_their_fence(store: &(impl LockStore + Clone)) {
    let (lock, fence) = raw_lock_keys();
    let lease = Duration::from_secs(5);
    let acquire = |token: &str, lease| {
        store.lock_acquire(
            LockRequest::new(
                Hold::new(lock.clone(), token.to_owned()),
                fence.clone(),
                lease,
            ),
            soon(),
        )
    };
    let LockAttempt::Acquired { fence: first } = acquire("a", lease).await.unwrap() else {
        panic!("a free lock is acquired");
    };
    // the second run of the same attempt: acquired, the same token, a fresh (here longer) lease
    let again = acquire("a", Duration::from_secs(60)).await.unwrap();
    assert_eq!(again, LockAttempt::Acquired { fence: first });
    match acquire("b", lease).await.unwrap() {
        LockAttempt::Held { lease_left } => {
            assert!(
                lease_left > Duration::from_secs(50),
                "lease reset: {lease_left:?}"
            );
        }
        other => panic!("another owner is refused: {other:?}"),
    }
    assert!(
        store
            .delete_if_held(Hold::new(lock.clone(), "a"))
            .await
            .unwrap()
    );
    let LockAttempt::Acquired { fence: next } = acquire("b", lease).await.unwrap() else {
        panic!("a released lock is acquired");
    };
    assert!(next > first, "{next} after {first}");
}

/// Fencing tokens pass a stale counter and the store clock.
pub async fn fencing_tokens_pass_a_stale_counter_and_the_store_clock(
    store: &(impl LockStore + Clone),
) {
    let now_us = || {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_micros() as u64
    };
    let (lock, fence) = raw_lock_keys();
    let lease = Duration::from_secs(5);
    let before = now_us();
    // a counter restored stale from an old snapshot: far below the tokens already handed out
    let stale = store
        .claim(ClaimRequest::new(fence.clone(), "41", None), soon())
        .await
        .unwrap();
    assert!(stale.won);
    let LockAttempt::Acquired { fence: token } = store
        .lock_acquire(
            LockRequest::new(Hold::new(lock.clone(), "a"), fence.clone(), lease),
            soon(),
        )
        .await
        .unwrap()
    else {
        panic!("a free lock is acquired");
    };
    // the store and this test share one machine's clock
    assert!(
        token >= before - 1_000_000,
        "token {token} is below the store time {before} µs: a stale counter repeats tokens"
    );
    assert!(
        store
            .delete_if_held(Hold::new(lock.clone(), "a"))
            .await
            .unwrap()
    );
    let LockAttempt::Acquired { fence: next } = store
        .lock_acquire(LockRequest::new(Hold::new(lock, "b"), fence, lease), soon())
        .await
        .unwrap()
    else {
        panic!("a released lock is acquired");
    };
    assert!(next > token, "{next} after {token}");
}

/// A release frees the key once.
pub async fn a_release_frees_the_key_once(store: &(impl LockStore + Clone)) {
    let (lock, fence) = raw_lock_keys();
    let acquired = store
        .lock_acquire(
            LockRequest::new(Hold::new(lock.clone(), "a"), fence, Duration::from_secs(5)),
            soon(),
        )
        .await
        .unwrap();
    assert!(matches!(acquired, LockAttempt::Acquired { .. }));
    assert!(
        !store
            .delete_if_held(Hold::new(lock.clone(), "b"))
            .await
            .unwrap()
    );
    assert!(
        store
            .delete_if_held(Hold::new(lock.clone(), "a"))
            .await
            .unwrap()
    );
    // another call (not the same call re-sent: `tests/store/scripts.rs` runs those) finds it gone
    assert!(
        !store
            .delete_if_held(Hold::new(lock.clone(), "a"))
            .await
            .unwrap()
    );
    assert!(
        !store
            .extend_if_held(Hold::new(lock.clone(), "a"), Duration::from_secs(5), soon())
            .await
            .unwrap(),
        "a released lock is not extended"
    );
    let claims = Claims::new(store.clone());
    let name = unique("released");
    let won = claims.claim_once(&name, None).await.unwrap();
    assert!(claims.release(&won).await.unwrap());
    assert!(claims.claim_once(&name, None).await.unwrap().won());
}

/// Durations past what a store keeps (`Duration::MAX`) are clamped, never an error.
pub async fn huge_durations_are_clamped_alike(store: &(impl LockStore + Clone)) {
    let forever = Duration::MAX;
    let claims = Claims::new(store.clone());
    let name = unique("forever");
    assert!(claims.claim_once(&name, forever).await.unwrap().won());
    assert!(!claims.claim_once(&name, forever).await.unwrap().won());
    let locks = Locks::new(store.clone());
    let guard = locks.try_acquire(unique("forever"), forever).await.unwrap();
    guard.extend().await.unwrap();
    guard.release().await.unwrap();
}

/// A write that reaches the store after its deadline does nothing and fails as a timeout: its
/// caller gave up on it, so it must neither take a key nor touch one held.
pub async fn writes_after_their_deadline_change_nothing(store: &(impl LockStore + Clone)) {
    let passed = tokio::time::Instant::now();
    let late = |what: &str, error: Option<crate::store::StoreError>| {
        let error = error.unwrap_or_else(|| panic!("{what}: a late write answered"));
        assert_eq!(error.kind(), StoreErrorKind::Timeout, "{what}: {error}");
    };
    let claim = format!("t:claim:{{{}}}", unique("late"));
    late(
        "claim",
        store
            .claim(ClaimRequest::new(claim.clone(), "a", None), passed)
            .await
            .err(),
    );
    let won = store
        .claim(ClaimRequest::new(claim, "b", None), soon())
        .await
        .unwrap();
    assert!(won.won, "the claim was left free");

    let (lock, fence) = raw_lock_keys();
    let lease = Duration::from_secs(30);
    let attempt = store.lock_acquire(
        LockRequest::new(Hold::new(lock.clone(), "a"), fence.clone(), lease),
        passed,
    );
    late("lock_acquire", attempt.await.err());
    let attempt = store.lock_acquire(
        LockRequest::new(Hold::new(lock.clone(), "b"), fence, lease),
        soon(),
    );
    assert!(matches!(
        attempt.await.unwrap(),
        LockAttempt::Acquired { .. }
    ));
    late(
        "extend_if_held",
        store
            .extend_if_held(Hold::new(lock.clone(), "b"), lease, passed)
            .await
            .err(),
    );
    assert!(
        store.delete_if_held(Hold::new(lock, "b")).await.unwrap(),
        "still b's"
    );
}

/// `lock_state` of `(lock, fence)`.
async fn state_of(store: &impl LockStore, (lock, fence): &(String, String)) -> LockState {
    store.lock_state(lock, fence).await.expect("store answers")
}

/// Whether `left` is within the last second of `lease`: a lease read just after it was set.
fn fresh(left: Duration, lease: Duration) -> bool {
    left <= lease && left > lease - Duration::from_secs(1)
}

/// A lock's state reads its holder's token, the lease it has left and its fencing token, and
/// changes nothing; once released or expired it reads free, its last fencing token kept.
pub async fn lock_state_reads_the_holder_and_changes_nothing(store: &(impl LockStore + Clone)) {
    let keys = raw_lock_keys();
    let free = state_of(store, &keys).await;
    assert_eq!(free, LockState::new(None, Duration::ZERO, None));
    let lease = Duration::from_secs(30);
    let acquire = |token: &str, lease: Duration| {
        let hold = Hold::new(keys.0.clone(), token.to_owned());
        store.lock_acquire(LockRequest::new(hold, keys.1.clone(), lease), soon())
    };
    let LockAttempt::Acquired { fence } = acquire("a", lease).await.unwrap() else {
        panic!("a free lock is acquired");
    };
    for _ in 0..2 {
        let held = state_of(store, &keys).await;
        assert_eq!(held.holder.as_deref(), Some("a"));
        assert_eq!(held.fence, Some(fence));
        assert!(fresh(held.lease_left, lease), "{:?}", held.lease_left);
    }
    match acquire("b", lease).await.unwrap() {
        LockAttempt::Held { lease_left } => assert!(fresh(lease_left, lease), "{lease_left:?}"),
        other => panic!("reading the lock freed it: {other:?}"),
    }
    assert!(
        store
            .delete_if_held(Hold::new(keys.0.clone(), "a"))
            .await
            .unwrap()
    );
    assert_eq!(
        state_of(store, &keys).await,
        LockState::new(None, Duration::ZERO, Some(fence)),
        "released: free, its counter kept"
    );
    let LockAttempt::Acquired { fence: next } =
        acquire("c", Duration::from_millis(300)).await.unwrap()
    else {
        panic!("a released lock is acquired");
    };
    assert!(next > fence);
    assert_eq!(state_of(store, &keys).await.holder.as_deref(), Some("c"));
    tokio::time::sleep(Duration::from_millis(600)).await;
    assert_eq!(
        state_of(store, &keys).await,
        LockState::new(None, Duration::ZERO, Some(next)),
        "expired: free"
    );
}
