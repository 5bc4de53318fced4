//! One conformance suite for every store: `conformance_suite!(make)` expands to one test per
//! behaviour, where `make` is an async expression giving `(store, guard)`; the guard (a
//! redis-server, say) lives as long as the test.

use std::sync::Arc;
use std::time::Duration;

use tollgate::key::Key;
use tollgate::rate_limit::{Algorithm, Limit, RateOutcome, RatePolicy};
use tollgate::store::Store;

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
    store
        .check_rate(policy, key, cost)
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
            assert!(
                out.retry_after > Duration::ZERO && out.retry_after <= Duration::from_secs(60),
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
        assert!(
            reset > Duration::ZERO && reset <= Duration::from_secs(10),
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
        let checks = (0..300).map(|_| store.check_rate(&p, key("hot"), 1));
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
