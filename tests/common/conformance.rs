//! One conformance suite for every store: `conformance_suite!(make)` expands to one test per
//! behaviour, where `make` is an async expression giving `(store, guard)`; the guard (a
//! redis-server, say) lives as long as the test.

use std::sync::Arc;
use std::time::Duration;

use tollgate::claim::Claims;
use tollgate::key::Key;
use tollgate::lock::{LockError, Locks};
use tollgate::rate::{Algorithm, Limit, RateCheck, RateOutcome, RatePolicy};
use tollgate::store::{IdempotencyBegin, LockAttempt, Store, StoreErrorKind};

fn unique(name: &str) -> String {
    format!("{name}-{}", rand::random::<u64>())
}

pub const ALGORITHMS: [Algorithm; 3] = [
    Algorithm::SlidingLog,
    Algorithm::SlidingCounter,
    Algorithm::Gcra,
];

pub fn policy(algorithm: Algorithm, limits: Vec<Limit>) -> Arc<RatePolicy> {
    let ns = format!("t{}:rl", rand::random::<u32>());
    Arc::new(RatePolicy::new(ns, algorithm, limits).expect("valid policy"))
}

pub fn key(name: &str) -> Key {
    Key::new("test", name.as_bytes())
}

async fn check(store: &impl Store, policy: &Arc<RatePolicy>, key: Key, cost: u64) -> RateOutcome {
    run(store, policy, RateCheck::new(key, cost)).await
}

async fn run(store: &impl Store, policy: &Arc<RatePolicy>, check: RateCheck) -> RateOutcome {
    store
        .check_rate(policy, check)
        .await
        .expect("store answers")
}

/// Expands to one `#[tokio::test]` per conformance behaviour, each on a store from `$make`.
#[macro_export]
macro_rules! conformance_suite {
    ($make:expr) => {
        $crate::conformance_suite!(@tests $make;
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
            claim_has_exactly_one_winner,
            claim_expires_only_when_asked,
            claim_release_is_the_winners_alone,
            lock_excludes_and_expiry_frees,
            stale_owner_cannot_extend_or_release,
            fencing_tokens_strictly_increase,
            fencing_tokens_increase_under_contention,
            with_lock_keeps_the_lease_alive,
            idem_lifecycle,
            idem_exactly_one_claim_among_concurrent,
            idem_token_checks_and_takeover,
            idem_retention_and_release,
            rate_checks_run_twice_are_charged_once,
            claims_run_twice_win_twice,
            lock_acquisitions_run_twice_keep_their_fence,
            fencing_tokens_pass_a_stale_counter_and_the_store_clock,
            a_release_frees_the_key_once,
            idempotency_operations_run_twice_answer_alike,
            huge_durations_are_clamped_alike,
            counter_reset_is_the_retry_after_at_a_window_start,
            cost_zero_looks_without_charging,
            reset_forgets_a_callers_limits_and_nothing_else,
            writes_after_their_deadline_change_nothing,
            rate_checks_resent_after_others_are_charged_once,
        );
    };
    (@tests $make:expr; $($name:ident),* $(,)?) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $name() {
                let (store, _guard) = $make;
                $crate::common::conformance::$name(&store).await;
            }
        )*
    };
}

pub async fn admits_exactly_the_quota_then_denies(store: &impl Store) {
    for algorithm in ALGORITHMS {
        let p = policy(algorithm, vec![Limit::per_minute("m", 5)]);
        for i in 0..5 {
            let out = check(store, &p, key("a"), 1).await;
            assert!(out.admitted, "{algorithm}: request {i} should be admitted");
            assert_eq!(out.retry_after, Duration::ZERO);
            assert_eq!(
                out.limits[0].remaining,
                4 - i,
                "{algorithm}: remaining after {i}"
            );
        }
        for _ in 0..3 {
            let out = check(store, &p, key("a"), 1).await;
            assert!(!out.admitted, "{algorithm}: over the quota");
            assert_eq!(out.limits[0].remaining, 0);
            // the counter may have to wait out the rest of this fixed window and part of the
            // next, in which these requests still weigh
            let longest = if algorithm == Algorithm::SlidingCounter {
                120
            } else {
                60
            };
            assert!(
                out.retry_after > Duration::ZERO && out.retry_after <= Duration::from_secs(longest),
                "{algorithm}: retry_after {:?}",
                out.retry_after
            );
        }
    }
}

pub async fn remaining_counts_down_and_resets_are_sane(store: &impl Store) {
    for algorithm in ALGORITHMS {
        let p = policy(
            algorithm,
            vec![Limit::new("w", 10, Duration::from_secs(10))],
        );
        let first = check(store, &p, key("r"), 1).await;
        assert_eq!(first.limits[0].remaining, 9, "{algorithm}");
        let reset = first.limits[0].reset;
        // the counter's unit weighs in the next window too, fading until its end
        let longest = if algorithm == Algorithm::SlidingCounter {
            Duration::from_secs(20)
        } else {
            Duration::from_secs(10)
        };
        assert!(
            reset > Duration::ZERO && reset <= longest,
            "{algorithm}: reset {reset:?}"
        );
        if algorithm == Algorithm::SlidingLog {
            // the only entry leaves the window a full window from now
            assert!(
                reset > Duration::from_millis(9_900),
                "{algorithm}: reset {reset:?}"
            );
        }
        if algorithm == Algorithm::Gcra {
            // one emission interval (1 s) until a unit frees
            assert!(
                reset > Duration::from_millis(900) && reset <= Duration::from_secs(1),
                "gcra reset {reset:?}"
            );
        }
    }
}

pub async fn limits_are_all_or_nothing(store: &impl Store) {
    for algorithm in ALGORITHMS {
        let p = policy(
            algorithm,
            vec![Limit::per_minute("wide", 5), Limit::per_minute("narrow", 2)],
        );
        assert!(check(store, &p, key("k"), 1).await.admitted);
        assert!(check(store, &p, key("k"), 1).await.admitted);
        let denied = check(store, &p, key("k"), 1).await;
        assert!(!denied.admitted, "{algorithm}");
        // denied by "narrow": "wide" was not charged and shows its real remainder
        assert_eq!(denied.limits[0].remaining, 3, "{algorithm}: wide");
        assert_eq!(denied.limits[1].remaining, 0, "{algorithm}: narrow");
        // a second policy over the same names and key sees the same counters
        let again = check(store, &p, key("k"), 1).await;
        assert_eq!(
            again.limits[0].remaining, 3,
            "{algorithm}: denials never charge"
        );
    }
}

pub async fn cost_is_charged_and_oversized_cost_never_fits(store: &impl Store) {
    for algorithm in ALGORITHMS {
        let p = policy(algorithm, vec![Limit::per_minute("m", 5)]);
        let out = check(store, &p, key("c"), 3).await;
        assert!(out.admitted, "{algorithm}");
        assert_eq!(out.limits[0].remaining, 2, "{algorithm}");
        assert!(
            !check(store, &p, key("c"), 3).await.admitted,
            "{algorithm}: 3 > 2 left"
        );
        let out = check(store, &p, key("c"), 2).await;
        assert!(out.admitted, "{algorithm}: 2 fits");
        assert_eq!(out.limits[0].remaining, 0, "{algorithm}");

        let huge = check(store, &p, key("fresh"), 6).await;
        assert!(!huge.admitted, "{algorithm}: cost above the quota");
        assert_eq!(huge.retry_after, Duration::from_secs(60), "{algorithm}");
        assert_eq!(huge.limits[0].remaining, 5, "{algorithm}: nothing charged");
    }
}

pub async fn callers_do_not_share_quota(store: &impl Store) {
    for algorithm in ALGORITHMS {
        let p = policy(algorithm, vec![Limit::per_minute("m", 1)]);
        assert!(check(store, &p, key("x"), 1).await.admitted);
        assert!(!check(store, &p, key("x"), 1).await.admitted);
        assert!(check(store, &p, key("y"), 1).await.admitted, "{algorithm}");
        // another policy namespace is another set of counters
        let other = policy(algorithm, vec![Limit::per_minute("m", 1)]);
        assert!(
            check(store, &other, key("x"), 1).await.admitted,
            "{algorithm}"
        );
    }
}

pub async fn window_slides_and_retry_after_is_honest(store: &impl Store) {
    for algorithm in ALGORITHMS {
        let p = policy(
            algorithm,
            vec![Limit::new("s", 2, Duration::from_millis(400))],
        );
        assert!(check(store, &p, key("w"), 1).await.admitted);
        assert!(check(store, &p, key("w"), 1).await.admitted);
        let denied = check(store, &p, key("w"), 1).await;
        assert!(!denied.admitted, "{algorithm}");
        assert!(
            denied.retry_after > Duration::ZERO && denied.retry_after <= Duration::from_millis(800),
            "{algorithm}: retry_after {:?}",
            denied.retry_after
        );
        tokio::time::sleep(denied.retry_after + Duration::from_millis(30)).await;
        assert!(
            check(store, &p, key("w"), 1).await.admitted,
            "{algorithm}: admitted after retry_after"
        );
    }
}

pub async fn concurrent_callers_get_exactly_the_quota(store: &impl Store) {
    for algorithm in ALGORITHMS {
        let p = policy(algorithm, vec![Limit::per_minute("m", 50)]);
        let checks = (0..300).map(|_| store.check_rate(&p, RateCheck::new(key("hot"), 1)));
        let results = futures_util::future::join_all(checks).await;
        let admitted = results
            .into_iter()
            .filter(|r| r.as_ref().expect("store answers").admitted)
            .count();
        assert_eq!(admitted, 50, "{algorithm}");
    }
}

pub async fn gcra_spaces_requests_after_the_burst(store: &impl Store) {
    let p = policy(
        Algorithm::Gcra,
        vec![Limit::new("g", 4, Duration::from_millis(800))],
    );
    for _ in 0..4 {
        assert!(check(store, &p, key("g"), 1).await.admitted);
    }
    let denied = check(store, &p, key("g"), 1).await;
    assert!(!denied.admitted);
    // one emission interval (200 ms) frees one unit, not the whole burst
    assert!(
        denied.retry_after <= Duration::from_millis(200),
        "{:?}",
        denied.retry_after
    );
    tokio::time::sleep(Duration::from_millis(230)).await;
    assert!(check(store, &p, key("g"), 1).await.admitted);
    assert!(!check(store, &p, key("g"), 1).await.admitted);
}

pub async fn counter_weights_the_previous_window(store: &impl Store) {
    let p = policy(
        Algorithm::SlidingCounter,
        vec![Limit::new("c", 10, Duration::from_millis(1000))],
    );
    // wait for the start of a window, to know where its boundary falls
    let ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("clock")
        .as_millis();
    tokio::time::sleep(Duration::from_millis((1000 - ms % 1000) as u64 + 20)).await;
    for _ in 0..10 {
        assert!(check(store, &p, key("c"), 1).await.admitted);
    }
    // early in the next window the previous ten still weigh nearly fully
    tokio::time::sleep(Duration::from_millis(1000)).await;
    let out = check(store, &p, key("c"), 1).await;
    assert!(!out.admitted, "previous window still weighs ~95%: {out:?}");
}

pub async fn log_is_exact_across_the_window_boundary(store: &impl Store) {
    let p = policy(
        Algorithm::SlidingLog,
        vec![Limit::new("l", 3, Duration::from_millis(600))],
    );
    assert!(check(store, &p, key("l"), 2).await.admitted);
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(check(store, &p, key("l"), 1).await.admitted);
    let denied = check(store, &p, key("l"), 1).await;
    assert!(!denied.admitted);
    // the first two leave ~300 ms from now; the wait names exactly that, not the window
    assert!(
        denied.retry_after <= Duration::from_millis(310),
        "{:?}",
        denied.retry_after
    );
    tokio::time::sleep(denied.retry_after + Duration::from_millis(20)).await;
    let out = check(store, &p, key("l"), 2).await;
    assert!(out.admitted, "two slots freed");
    assert!(!check(store, &p, key("l"), 1).await.admitted, "and no more");
}

pub async fn claim_has_exactly_one_winner(store: &(impl Store + Clone)) {
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

pub async fn claim_expires_only_when_asked(store: &(impl Store + Clone)) {
    let claims = Claims::new(store.clone());
    let (brief, forever) = (unique("brief"), unique("forever"));
    assert!(
        claims
            .claim_once(&brief, Duration::from_millis(200))
            .await
            .unwrap()
            .won()
    );
    assert!(claims.claim_once(&forever, None).await.unwrap().won());
    assert!(
        !claims
            .claim_once(&brief, Duration::from_millis(200))
            .await
            .unwrap()
            .won()
    );
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        claims.claim_once(&brief, None).await.unwrap().won(),
        "expired"
    );
    assert!(
        !claims.claim_once(&forever, None).await.unwrap().won(),
        "kept"
    );
}

pub async fn claim_release_is_the_winners_alone(store: &(impl Store + Clone)) {
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

pub async fn lock_excludes_and_expiry_frees(store: &(impl Store + Clone)) {
    let locks = Locks::new(store.clone());
    let name = unique("lock");
    let guard = locks
        .try_acquire(&name, Duration::from_millis(300))
        .await
        .unwrap();
    match locks.try_acquire(&name, Duration::from_millis(300)).await {
        Err(LockError::Busy { lease_left }) => {
            assert!(
                lease_left > Duration::from_millis(100) && lease_left <= Duration::from_millis(300)
            );
        }
        other => panic!("expected Busy, got {other:?}"),
    }
    tokio::time::sleep(Duration::from_millis(350)).await;
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

pub async fn stale_owner_cannot_extend_or_release(store: &(impl Store + Clone)) {
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

pub async fn fencing_tokens_strictly_increase(store: &(impl Store + Clone)) {
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

pub async fn fencing_tokens_increase_under_contention(store: &(impl Store + Clone)) {
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

pub async fn with_lock_keeps_the_lease_alive(store: &(impl Store + Clone)) {
    let locks = Locks::new(store.clone());
    let name = unique("long-work");
    let lease = Duration::from_millis(300);
    let other = locks.clone();
    let probe_name = name.clone();
    let result = locks
        .with_lock(&name, lease, |lease_handle| async move {
            // work outlives the lease three times over; the lock must stay ours
            for _ in 0..6 {
                tokio::time::sleep(Duration::from_millis(150)).await;
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

fn idem_key() -> String {
    format!("t:idem:{{{}}}", unique("k"))
}

pub async fn idem_lifecycle(store: &(impl Store + Clone)) {
    let key = idem_key();
    let lease = Duration::from_secs(30);
    let begin = |fp: &str, token: &str| {
        store.idempotency_begin(
            key.clone(),
            fp.to_owned(),
            token.to_owned(),
            lease,
            crate::common::soon(),
        )
    };
    assert_eq!(begin("fp", "a").await.unwrap(), IdempotencyBegin::Claimed);
    match begin("fp", "b").await.unwrap() {
        IdempotencyBegin::InFlight { lease_left } => {
            assert!(
                lease_left > Duration::from_secs(29) && lease_left <= lease,
                "{lease_left:?}"
            );
        }
        other => panic!("expected InFlight, got {other:?}"),
    }
    assert_eq!(
        begin("other", "b").await.unwrap(),
        IdempotencyBegin::Mismatch
    );
    let response = bytes::Bytes::from_static(b"\x00binary\xffresponse");
    assert!(
        store
            .idempotency_complete(
                key.clone(),
                "a".into(),
                response.clone(),
                Duration::from_secs(60),
                crate::common::soon()
            )
            .await
            .unwrap()
    );
    assert_eq!(
        begin("fp", "c").await.unwrap(),
        IdempotencyBegin::Completed(response)
    );
    assert_eq!(
        begin("other", "c").await.unwrap(),
        IdempotencyBegin::Mismatch
    );
    // a completed record is no longer anybody's claim
    assert!(
        !store
            .idempotency_release(key.clone(), "a".into())
            .await
            .unwrap()
    );
    assert!(
        !store
            .idempotency_extend(key.clone(), "a".into(), lease, crate::common::soon())
            .await
            .unwrap()
    );
}

pub async fn idem_exactly_one_claim_among_concurrent(store: &(impl Store + Clone)) {
    let key = idem_key();
    let attempts = (0..100).map(|i| {
        store.idempotency_begin(
            key.clone(),
            "fp".into(),
            format!("t{i}"),
            Duration::from_secs(30),
            crate::common::soon(),
        )
    });
    let results = futures_util::future::join_all(attempts).await;
    let claimed = results
        .iter()
        .filter(|r| matches!(r, Ok(IdempotencyBegin::Claimed)))
        .count();
    let in_flight = results
        .iter()
        .filter(|r| matches!(r, Ok(IdempotencyBegin::InFlight { .. })))
        .count();
    assert_eq!((claimed, in_flight), (1, 99));
}

pub async fn idem_token_checks_and_takeover(store: &(impl Store + Clone)) {
    let key = idem_key();
    let begin = |token: &str, lease: Duration| {
        store.idempotency_begin(
            key.clone(),
            "fp".into(),
            token.to_owned(),
            lease,
            crate::common::soon(),
        )
    };
    assert_eq!(
        begin("stale", Duration::from_millis(200)).await.unwrap(),
        IdempotencyBegin::Claimed
    );
    assert!(
        !store
            .idempotency_extend(
                key.clone(),
                "intruder".into(),
                Duration::from_secs(1),
                crate::common::soon()
            )
            .await
            .unwrap()
    );
    assert!(
        !store
            .idempotency_release(key.clone(), "intruder".into())
            .await
            .unwrap()
    );
    tokio::time::sleep(Duration::from_millis(260)).await;
    // the stalled owner's lease ran out: another request takes the key over
    assert_eq!(
        begin("fresh", Duration::from_secs(30)).await.unwrap(),
        IdempotencyBegin::Claimed
    );
    let stale = bytes::Bytes::from_static(b"stale");
    let fresh = bytes::Bytes::from_static(b"fresh");
    assert!(
        !store
            .idempotency_complete(
                key.clone(),
                "stale".into(),
                stale,
                Duration::from_secs(60),
                crate::common::soon()
            )
            .await
            .unwrap(),
        "stale completion refused"
    );
    assert!(
        !store
            .idempotency_extend(
                key.clone(),
                "stale".into(),
                Duration::from_secs(30),
                crate::common::soon()
            )
            .await
            .unwrap()
    );
    assert!(
        store
            .idempotency_complete(
                key.clone(),
                "fresh".into(),
                fresh.clone(),
                Duration::from_secs(60),
                crate::common::soon()
            )
            .await
            .unwrap()
    );
    assert_eq!(
        begin("late", Duration::from_secs(30)).await.unwrap(),
        IdempotencyBegin::Completed(fresh)
    );
}

pub async fn idem_retention_and_release(store: &(impl Store + Clone)) {
    let key = idem_key();
    let begin = |token: &str| {
        store.idempotency_begin(
            key.clone(),
            "fp".into(),
            token.to_owned(),
            Duration::from_secs(30),
            crate::common::soon(),
        )
    };
    assert_eq!(begin("a").await.unwrap(), IdempotencyBegin::Claimed);
    assert!(
        store
            .idempotency_extend(
                key.clone(),
                "a".into(),
                Duration::from_secs(30),
                crate::common::soon()
            )
            .await
            .unwrap()
    );
    assert!(
        store
            .idempotency_release(key.clone(), "a".into())
            .await
            .unwrap()
    );
    // released: the next request runs
    assert_eq!(begin("b").await.unwrap(), IdempotencyBegin::Claimed);
    let done = bytes::Bytes::from_static(b"done");
    assert!(
        store
            .idempotency_complete(
                key.clone(),
                "b".into(),
                done.clone(),
                Duration::from_millis(200),
                crate::common::soon()
            )
            .await
            .unwrap()
    );
    assert_eq!(begin("c").await.unwrap(), IdempotencyBegin::Completed(done));
    tokio::time::sleep(Duration::from_millis(260)).await;
    assert_eq!(
        begin("d").await.unwrap(),
        IdempotencyBegin::Claimed,
        "retention over"
    );
}

// ---------------------------------------------------------------------------------------------
// the same attempt run twice (a command re-sent after a dropped connection, a lost reply): the
// second run answers as the first did and changes nothing more
// ---------------------------------------------------------------------------------------------

/// Keys of one hash slot for the raw lock operations: `(lock, fence)`.
fn raw_lock_keys() -> (String, String) {
    let lock = format!("t:lock:{{{}}}", unique("raw"));
    let fence = format!("{lock}:fence");
    (lock, fence)
}

pub async fn rate_checks_run_twice_are_charged_once(store: &impl Store) {
    for algorithm in ALGORITHMS {
        let p = policy(
            algorithm,
            vec![Limit::per_minute("m", 4), Limit::per_hour("h", 10)],
        );
        for cost in [1, 2] {
            let caller = key(&unique("twice"));
            let attempt = RateCheck::new(caller, cost);
            let first = run(store, &p, attempt).await;
            let second = run(store, &p, attempt).await;
            assert!(first.admitted && second.admitted, "{algorithm} cost {cost}");
            let remaining = |o: &RateOutcome| [o.limits[0].remaining, o.limits[1].remaining];
            assert_eq!(
                remaining(&first),
                [4 - cost, 10 - cost],
                "{algorithm} cost {cost}"
            );
            assert_eq!(
                remaining(&second),
                remaining(&first),
                "{algorithm} cost {cost}: the second run charged again"
            );
            let next = check(store, &p, caller, cost).await;
            assert_eq!(
                remaining(&next),
                [4 - 2 * cost, 10 - 2 * cost],
                "{algorithm} cost {cost}: a new attempt is charged"
            );
        }
        // an attempt admitted with the last of the quota is admitted again, not denied
        let caller = key(&unique("last"));
        let p = policy(algorithm, vec![Limit::per_minute("m", 2)]);
        check(store, &p, caller, 1).await;
        let last = RateCheck::new(caller, 1);
        assert!(run(store, &p, last).await.admitted, "{algorithm}");
        let again = run(store, &p, last).await;
        assert!(
            again.admitted,
            "{algorithm}: the second run of an admitted attempt"
        );
        assert_eq!(again.limits[0].remaining, 0, "{algorithm}");
        assert!(!check(store, &p, caller, 1).await.admitted, "{algorithm}");
    }
}

pub async fn claims_run_twice_win_twice(store: &(impl Store + Clone)) {
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

pub async fn lock_acquisitions_run_twice_keep_their_fence(store: &(impl Store + Clone)) {
    let (lock, fence) = raw_lock_keys();
    let lease = Duration::from_secs(5);
    let acquire = |token: &str, lease| {
        store.lock_acquire(
            lock.clone(),
            fence.clone(),
            token.to_owned(),
            lease,
            crate::common::soon(),
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
            .delete_if_held(lock.clone(), "a".into())
            .await
            .unwrap()
    );
    let LockAttempt::Acquired { fence: next } = acquire("b", lease).await.unwrap() else {
        panic!("a released lock is acquired");
    };
    assert!(next > first, "{next} after {first}");
}

pub async fn fencing_tokens_pass_a_stale_counter_and_the_store_clock(store: &(impl Store + Clone)) {
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
        .claim(fence.clone(), "41".into(), None, crate::common::soon())
        .await
        .unwrap();
    assert!(stale.won);
    let LockAttempt::Acquired { fence: token } = store
        .lock_acquire(
            lock.clone(),
            fence.clone(),
            "a".into(),
            lease,
            crate::common::soon(),
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
            .delete_if_held(lock.clone(), "a".into())
            .await
            .unwrap()
    );
    let LockAttempt::Acquired { fence: next } = store
        .lock_acquire(lock, fence, "b".into(), lease, crate::common::soon())
        .await
        .unwrap()
    else {
        panic!("a released lock is acquired");
    };
    assert!(next > token, "{next} after {token}");
}

pub async fn a_release_frees_the_key_once(store: &(impl Store + Clone)) {
    let (lock, fence) = raw_lock_keys();
    let acquired = store
        .lock_acquire(
            lock.clone(),
            fence,
            "a".into(),
            Duration::from_secs(5),
            crate::common::soon(),
        )
        .await
        .unwrap();
    assert!(matches!(acquired, LockAttempt::Acquired { .. }));
    assert!(
        !store
            .delete_if_held(lock.clone(), "b".into())
            .await
            .unwrap()
    );
    assert!(
        store
            .delete_if_held(lock.clone(), "a".into())
            .await
            .unwrap()
    );
    // another call (not the same call re-sent: `tests/scripts.rs` runs those) finds it gone
    assert!(
        !store
            .delete_if_held(lock.clone(), "a".into())
            .await
            .unwrap()
    );
    assert!(
        !store
            .extend_if_held(
                lock.clone(),
                "a".into(),
                Duration::from_secs(5),
                crate::common::soon()
            )
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

pub async fn idempotency_operations_run_twice_answer_alike(store: &(impl Store + Clone)) {
    let key = idem_key();
    let lease = Duration::from_secs(30);
    let retention = Duration::from_secs(60);
    let begin = |token: &str| {
        store.idempotency_begin(
            key.clone(),
            "fp".into(),
            token.to_owned(),
            lease,
            crate::common::soon(),
        )
    };
    assert_eq!(begin("a").await.unwrap(), IdempotencyBegin::Claimed);
    assert_eq!(
        begin("a").await.unwrap(),
        IdempotencyBegin::Claimed,
        "the second run of a claim claims again, not 409 to its own request"
    );
    assert!(matches!(
        begin("b").await.unwrap(),
        IdempotencyBegin::InFlight { .. }
    ));
    let record = bytes::Bytes::from_static(b"record");
    for run in ["first", "second"] {
        assert!(
            store
                .idempotency_complete(
                    key.clone(),
                    "a".into(),
                    record.clone(),
                    retention,
                    crate::common::soon()
                )
                .await
                .unwrap(),
            "{run} run of the completion"
        );
    }
    assert_eq!(
        begin("b").await.unwrap(),
        IdempotencyBegin::Completed(record.clone())
    );
    // a completed record is neither released nor cut short by its owner's token
    assert!(
        !store
            .idempotency_release(key.clone(), "a".into())
            .await
            .unwrap()
    );
    assert!(
        !store
            .idempotency_extend(
                key.clone(),
                "a".into(),
                Duration::from_millis(50),
                crate::common::soon()
            )
            .await
            .unwrap()
    );
    tokio::time::sleep(Duration::from_millis(120)).await;
    assert_eq!(
        begin("c").await.unwrap(),
        IdempotencyBegin::Completed(record)
    );
    // a release frees the key
    let other = idem_key();
    let claim = store
        .idempotency_begin(
            other.clone(),
            "fp".into(),
            "d".into(),
            lease,
            crate::common::soon(),
        )
        .await
        .unwrap();
    assert_eq!(claim, IdempotencyBegin::Claimed);
    assert!(
        store
            .idempotency_release(other.clone(), "d".into())
            .await
            .unwrap()
    );
    let after = store
        .idempotency_begin(other, "fp".into(), "e".into(), lease, crate::common::soon())
        .await
        .unwrap();
    assert_eq!(after, IdempotencyBegin::Claimed, "the released key is free");
}

pub async fn huge_durations_are_clamped_alike(store: &(impl Store + Clone)) {
    let forever = Duration::MAX;
    let claims = Claims::new(store.clone());
    let name = unique("forever");
    assert!(claims.claim_once(&name, forever).await.unwrap().won());
    assert!(!claims.claim_once(&name, forever).await.unwrap().won());
    let locks = Locks::new(store.clone());
    let guard = locks.try_acquire(unique("forever"), forever).await.unwrap();
    guard.extend().await.unwrap();
    guard.release().await.unwrap();
    let key = idem_key();
    let claimed = store
        .idempotency_begin(
            key.clone(),
            "fp".into(),
            "a".into(),
            forever,
            crate::common::soon(),
        )
        .await
        .unwrap();
    assert_eq!(claimed, IdempotencyBegin::Claimed);
    assert!(
        store
            .idempotency_extend(key.clone(), "a".into(), forever, crate::common::soon())
            .await
            .unwrap()
    );
    let record = bytes::Bytes::from_static(b"kept");
    assert!(
        store
            .idempotency_complete(
                key.clone(),
                "a".into(),
                record.clone(),
                forever,
                crate::common::soon()
            )
            .await
            .unwrap()
    );
    let replay = store
        .idempotency_begin(key, "fp".into(), "b".into(), forever, crate::common::soon())
        .await
        .unwrap();
    assert_eq!(replay, IdempotencyBegin::Completed(record), "written whole");
}

pub async fn counter_reset_is_the_retry_after_at_a_window_start(store: &impl Store) {
    // 10 per 60 s, all 10 spent at once: the quota grows again when the first unit of this
    // window's weight has faded from the next one — the same moment a denial names (at a
    // window's start, t=66 and Retry-After: 66, where t used to say 60)
    let p = policy(
        Algorithm::SlidingCounter,
        vec![Limit::new("m", 10, Duration::from_secs(60))],
    );
    let caller = key(&unique("edge"));
    let spent = check(store, &p, caller, 10).await;
    assert!(spent.admitted);
    let denied = check(store, &p, caller, 1).await;
    assert!(!denied.admitted);
    let (reset, retry) = (denied.limits[0].reset, denied.retry_after);
    let apart = reset.abs_diff(retry);
    assert!(
        apart <= Duration::from_millis(2),
        "t says {reset:?} but Retry-After says {retry:?}"
    );
}

pub async fn cost_zero_looks_without_charging(store: &impl Store) {
    for algorithm in ALGORITHMS {
        let p = policy(algorithm, vec![Limit::per_minute("m", 5)]);
        let caller = key(&unique("peek"));
        let fresh = check(store, &p, caller, 0).await;
        assert!(fresh.admitted, "{algorithm}");
        assert_eq!(fresh.limits[0].remaining, 5, "{algorithm}");
        assert_eq!(
            fresh.limits[0].reset,
            Duration::ZERO,
            "{algorithm}: nothing in use"
        );
        check(store, &p, caller, 1).await;
        let look = check(store, &p, caller, 0).await;
        assert_eq!(look.limits[0].remaining, 4, "{algorithm}");
        assert!(look.limits[0].reset > Duration::ZERO, "{algorithm}");
        let next = check(store, &p, caller, 1).await;
        assert_eq!(
            next.limits[0].remaining, 3,
            "{algorithm}: a look charges nothing"
        );
    }
}

pub async fn reset_forgets_a_callers_limits_and_nothing_else(store: &impl Store) {
    for algorithm in ALGORITHMS {
        let limits = vec![Limit::per_minute("m", 3), Limit::per_hour("h", 5)];
        let p = policy(algorithm, limits.clone());
        // the same namespace and limit names under another algorithm: other keys
        let other_algorithm = ALGORITHMS
            .into_iter()
            .find(|a| *a != algorithm)
            .expect("three algorithms");
        let q = Arc::new(RatePolicy::new(p.namespace(), other_algorithm, limits).unwrap());
        let (a, b) = (key(&unique("reset-a")), key(&unique("reset-b")));
        for _ in 0..3 {
            check(store, &p, a, 1).await;
            check(store, &p, b, 1).await;
            check(store, &q, a, 1).await;
        }
        assert!(!check(store, &p, a, 1).await.admitted, "{algorithm}: spent");
        store.reset_rate(&p, a).await.expect("store answers");
        let after = check(store, &p, a, 0).await;
        assert_eq!(
            [after.limits[0].remaining, after.limits[1].remaining],
            [3, 5],
            "{algorithm}: as never seen"
        );
        assert_eq!(after.limits[0].reset, Duration::ZERO, "{algorithm}");
        assert!(check(store, &p, a, 1).await.admitted, "{algorithm}");
        assert!(
            !check(store, &p, b, 1).await.admitted,
            "{algorithm}: another caller stays"
        );
        assert!(
            !check(store, &q, a, 1).await.admitted,
            "{algorithm}: another policy stays"
        );
        // a caller never seen resets to nothing
        store
            .reset_rate(&p, key(&unique("reset-c")))
            .await
            .expect("store answers");
    }
}

/// A write that reaches the store after its deadline does nothing and fails as a timeout: its
/// caller gave up on it, so it must neither take a key nor touch one held.
pub async fn writes_after_their_deadline_change_nothing(store: &(impl Store + Clone)) {
    let passed = tokio::time::Instant::now();
    let late = |what: &str, error: Option<tollgate::store::StoreError>| {
        let error = error.unwrap_or_else(|| panic!("{what}: a late write answered"));
        assert_eq!(error.kind(), StoreErrorKind::Timeout, "{what}: {error}");
    };
    let claim = format!("t:claim:{{{}}}", unique("late"));
    late(
        "claim",
        store
            .claim(claim.clone(), "a".into(), None, passed)
            .await
            .err(),
    );
    let won = store
        .claim(claim, "b".into(), None, crate::common::soon())
        .await
        .unwrap();
    assert!(won.won, "the claim was left free");

    let (lock, fence) = raw_lock_keys();
    let lease = Duration::from_secs(30);
    let attempt = store.lock_acquire(lock.clone(), fence.clone(), "a".into(), lease, passed);
    late("lock_acquire", attempt.await.err());
    let attempt = store.lock_acquire(
        lock.clone(),
        fence,
        "b".into(),
        lease,
        crate::common::soon(),
    );
    assert!(matches!(
        attempt.await.unwrap(),
        LockAttempt::Acquired { .. }
    ));
    late(
        "extend_if_held",
        store
            .extend_if_held(lock.clone(), "b".into(), lease, passed)
            .await
            .err(),
    );
    assert!(
        store.delete_if_held(lock, "b".into()).await.unwrap(),
        "still b's"
    );

    let record = format!("t:idem:{{{}}}", unique("late"));
    let begin = store.idempotency_begin(record.clone(), "fp".into(), "a".into(), lease, passed);
    late("idempotency_begin", begin.await.err());
    let begin = store.idempotency_begin(
        record.clone(),
        "fp".into(),
        "b".into(),
        lease,
        crate::common::soon(),
    );
    assert_eq!(
        begin.await.unwrap(),
        IdempotencyBegin::Claimed,
        "the record was left free"
    );
    let complete =
        store.idempotency_complete(record.clone(), "b".into(), "r".into(), lease, passed);
    late("idempotency_complete", complete.await.err());
    late(
        "idempotency_extend",
        store
            .idempotency_extend(record.clone(), "b".into(), lease, passed)
            .await
            .err(),
    );
    let begin = store.idempotency_begin(
        record.clone(),
        "fp".into(),
        "c".into(),
        lease,
        crate::common::soon(),
    );
    assert!(
        matches!(begin.await.unwrap(), IdempotencyBegin::InFlight { .. }),
        "the late completion stored nothing"
    );
    assert!(store.idempotency_release(record, "b".into()).await.unwrap());
}

/// A re-sent check is charged once whatever other checks charged the caller in between: `a, b,
/// a` leaves 10 - 2, and a whole series sent again (a re-sent batch) charges nothing more.
pub async fn rate_checks_resent_after_others_are_charged_once(store: &impl Store) {
    for algorithm in ALGORITHMS {
        let p = policy(
            algorithm,
            vec![Limit::per_minute("m", 10), Limit::per_hour("h", 100)],
        );
        let caller = key(&unique("interleaved"));
        let (a, b) = (RateCheck::new(caller, 1), RateCheck::new(caller, 1));
        run(store, &p, a).await;
        run(store, &p, b).await;
        let again = run(store, &p, a).await;
        assert!(again.admitted, "{algorithm}");
        assert_eq!(
            [again.limits[0].remaining, again.limits[1].remaining],
            [8, 98],
            "{algorithm}: a, b, a"
        );
        let series: Vec<RateCheck> = (0..5).map(|_| RateCheck::new(caller, 1)).collect();
        for check in &series {
            run(store, &p, *check).await;
        }
        for check in &series {
            assert!(run(store, &p, *check).await.admitted, "{algorithm}");
        }
        let look = check(store, &p, caller, 0).await;
        assert_eq!(
            [look.limits[0].remaining, look.limits[1].remaining],
            [3, 93],
            "{algorithm}: the series sent again charged again"
        );
    }
}
