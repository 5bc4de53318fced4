//! The rules of [`RateStore`]: the three algorithms, several limits, costs, attempts run twice.

use std::sync::Arc;
use std::time::Duration;

use super::unique;
use crate::key::Key;
use crate::rate::{Algorithm, Limit, RateCheck, RateOutcome, RatePolicy};
use crate::store::{Invalidation, Invalidations, RateStore};

/// The three algorithms, each rule run under every one.
const ALGORITHMS: [Algorithm; 3] = [
    Algorithm::SlidingLog,
    Algorithm::SlidingCounter,
    Algorithm::Gcra,
];

/// A policy of `limits` in a namespace of its own.
fn policy(algorithm: Algorithm, limits: Vec<Limit>) -> Arc<RatePolicy> {
    let ns = format!("t{}:rl", uuid::Uuid::new_v4().as_u64_pair().0 >> 32);
    Arc::new(RatePolicy::new(ns, algorithm, limits).expect("valid policy"))
}

fn key(name: &str) -> Key {
    Key::new("test", name.as_bytes())
}

async fn check(
    store: &impl RateStore,
    policy: &Arc<RatePolicy>,
    key: Key,
    cost: u64,
) -> RateOutcome {
    run(store, policy, RateCheck::new(key, cost)).await
}

async fn run(store: &impl RateStore, policy: &Arc<RatePolicy>, check: RateCheck) -> RateOutcome {
    store
        .check_rate(policy, check)
        .await
        .expect("store answers")
}

/// Admits exactly the quota then denies.
pub async fn admits_exactly_the_quota_then_denies(store: &impl RateStore) {
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

/// Remaining counts down and resets are sane.
pub async fn remaining_counts_down_and_resets_are_sane(store: &impl RateStore) {
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

/// Limits are all or nothing.
pub async fn limits_are_all_or_nothing(store: &impl RateStore) {
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

/// Cost is charged and oversized cost never fits.
pub async fn cost_is_charged_and_oversized_cost_never_fits(store: &impl RateStore) {
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

/// Callers do not share quota.
pub async fn callers_do_not_share_quota(store: &impl RateStore) {
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

/// Window slides and retry after is honest.
pub async fn window_slides_and_retry_after_is_honest(store: &impl RateStore) {
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

/// Concurrent callers get exactly the quota.
pub async fn concurrent_callers_get_exactly_the_quota(store: &impl RateStore) {
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

/// Gcra spaces requests after the burst.
pub async fn gcra_spaces_requests_after_the_burst(store: &impl RateStore) {
    let p = policy(
        Algorithm::Gcra,
        vec![Limit::new("g", 4, Duration::from_secs(4))],
    );
    for _ in 0..4 {
        assert!(check(store, &p, key("g"), 1).await.admitted);
    }
    let denied = check(store, &p, key("g"), 1).await;
    assert!(!denied.admitted);
    // one emission interval (1 s) frees one unit, not the whole burst
    assert!(
        denied.retry_after > Duration::ZERO && denied.retry_after <= Duration::from_secs(1),
        "{:?}",
        denied.retry_after
    );
    tokio::time::sleep(denied.retry_after + Duration::from_millis(50)).await;
    assert!(check(store, &p, key("g"), 1).await.admitted);
    assert!(!check(store, &p, key("g"), 1).await.admitted);
}

/// Counter weights the previous window.
pub async fn counter_weights_the_previous_window(store: &impl RateStore) {
    let p = policy(
        Algorithm::SlidingCounter,
        vec![Limit::new("c", 10, Duration::from_millis(1000))],
    );
    // A probe that is sent late in its window proves nothing: the scenario runs again, on a
    // fresh key, until one is sent early (a loaded machine may delay any step).
    for attempt in 0..5 {
        let name = format!("c{attempt}");
        // wait for the start of a window, to know where its boundary falls
        let ms = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .expect("clock")
            .as_millis();
        let next_window = Duration::from_millis((1000 - ms % 1000) as u64);
        let boundary = tokio::time::Instant::now() + next_window + Duration::from_secs(1);
        tokio::time::sleep(next_window + Duration::from_millis(20)).await;
        for _ in 0..10 {
            assert!(check(store, &p, key(&name), 1).await.admitted);
        }
        tokio::time::sleep_until(boundary + Duration::from_millis(20)).await;
        let sent = tokio::time::Instant::now();
        let out = check(store, &p, key(&name), 1).await;
        if sent > boundary + Duration::from_millis(60) {
            continue;
        }
        // early in the next window the previous ten still weigh over 94%
        assert!(!out.admitted, "previous window still weighs ~95%: {out:?}");
        return;
    }
    panic!("no probe was sent within 60 ms of a window's start in 5 tries");
}

/// Log is exact across the window boundary.
pub async fn log_is_exact_across_the_window_boundary(store: &impl RateStore) {
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

/// Rate checks run twice are charged once.
pub async fn rate_checks_run_twice_are_charged_once(store: &impl RateStore) {
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

/// Counter reset is the retry after at a window start.
pub async fn counter_reset_is_the_retry_after_at_a_window_start(store: &impl RateStore) {
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

/// Cost zero looks without charging.
pub async fn cost_zero_looks_without_charging(store: &impl RateStore) {
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

/// Reset forgets a callers limits and nothing else.
pub async fn reset_forgets_a_callers_limits_and_nothing_else(store: &impl RateStore) {
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

/// A re-sent check is charged once whatever other checks charged the caller in between: `a, b,
/// a` leaves 10 - 2, and a whole series sent again (a re-sent batch) charges nothing more.
pub async fn rate_checks_resent_after_others_are_charged_once(store: &impl RateStore) {
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

/// A limit whose quota does not visibly refill while a test runs.
fn daily(name: &str, quota: u64) -> Limit {
    Limit::new(name, quota, Duration::from_secs(86_400))
}

/// Reserves `reserved` (a [reservation](RateCheck::reservation)), which must be admitted, then
/// settles it for `actual`: the settlement's outcome.
async fn reserve_then_settle(
    store: &impl RateStore,
    policy: &Arc<RatePolicy>,
    key: Key,
    reserved: u64,
    actual: u64,
) -> RateOutcome {
    let check = RateCheck::reservation(key, reserved);
    assert!(run(store, policy, check).await.admitted, "the reservation");
    let settled = run(store, policy, check.settle(actual)).await;
    assert!(settled.admitted, "a settlement is always admitted");
    settled
}

/// A settlement refunds or charges the difference between what its check reserved and the
/// actual cost, under every algorithm and on every limit.
pub async fn settlements_refund_or_charge_the_difference(store: &impl RateStore) {
    for algorithm in ALGORITHMS {
        let p = policy(algorithm, vec![daily("day", 1000), daily("team", 5000)]);
        let out = reserve_then_settle(store, &p, key("a"), 300, 100).await;
        assert_eq!(out.limits[0].remaining, 900, "{algorithm}: refunded");
        assert_eq!(out.limits[1].remaining, 4900, "{algorithm}: refunded");
        let out = reserve_then_settle(store, &p, key("a"), 300, 500).await;
        assert_eq!(
            out.limits[0].remaining, 400,
            "{algorithm}: charged the rest"
        );
        let out = reserve_then_settle(store, &p, key("a"), 1, 1).await;
        assert_eq!(out.limits[0].remaining, 399, "{algorithm}: as reserved");
        let out = reserve_then_settle(store, &p, key("a"), 10, 0).await;
        assert_eq!(out.limits[0].remaining, 399, "{algorithm}: all refunded");
        let look = check(store, &p, key("a"), 0).await;
        assert_eq!(look.limits[0].remaining, 399, "{algorithm}: as settled");
        assert_eq!(look.limits[1].remaining, 4399, "{algorithm}: as settled");
    }
}

/// An overrun takes the balance past the quota: the caller is denied, even the smallest cost.
pub async fn an_overrun_denies_until_the_debt_is_gone(store: &impl RateStore) {
    for algorithm in ALGORITHMS {
        let p = policy(algorithm, vec![daily("day", 1000)]);
        for _ in 0..3 {
            reserve_then_settle(store, &p, key("a"), 1, 300).await;
        }
        // 900 used: one more reservation of 1 fits, and its 300 overrun
        let out = reserve_then_settle(store, &p, key("a"), 1, 300).await;
        assert_eq!(out.limits[0].remaining, 0, "{algorithm}: 1200 of 1000");
        let denied = check(store, &p, key("a"), 1).await;
        assert!(!denied.admitted, "{algorithm}: in debt");
        assert!(denied.retry_after > Duration::ZERO, "{algorithm}");
        // a refund of the debt makes room again
        let out = reserve_then_settle(store, &p, key("b"), 100, 100).await;
        assert_eq!(out.limits[0].remaining, 900, "{algorithm}: another caller");
    }
}

/// The same settlement run twice (re-sent, or made again) is applied once.
pub async fn settlements_run_twice_apply_once(store: &impl RateStore) {
    for algorithm in ALGORITHMS {
        let p = policy(algorithm, vec![daily("day", 1000)]);
        for (reserved, actual, left) in [(300, 100, 900), (300, 500, 400)] {
            let check = RateCheck::reservation(key("a"), reserved);
            assert!(run(store, &p, check).await.admitted);
            let settlement = check.settle(actual);
            let first = run(store, &p, settlement).await;
            let again = run(store, &p, settlement).await;
            assert_eq!(first.limits[0].remaining, left, "{algorithm}");
            assert_eq!(again.limits[0].remaining, left, "{algorithm}: applied once");
            let made_again = run(store, &p, check.settle(actual)).await;
            assert_eq!(
                made_again.limits[0].remaining, left,
                "{algorithm}: applied once"
            );
        }
    }
}

/// A limit of 10 per second under `algorithm`, in a policy of its own.
fn per_second(algorithm: Algorithm) -> Arc<RatePolicy> {
    policy(algorithm, vec![Limit::per_second("s", 10)])
}

/// A refund made after the reservation's charge left the window returns nothing: the quota
/// that others spent since stays spent (10 per second: A reserves 10; 2.15 s later B spends
/// 10; A settles for 0; C's 10 are denied).
pub async fn a_late_refund_returns_nothing_others_spent(store: &impl RateStore) {
    let runs = ALGORITHMS.map(|algorithm| async move {
        let p = per_second(algorithm);
        let caller = key(&unique("late-refund"));
        let a = RateCheck::reservation(caller, 10);
        assert!(run(store, &p, a).await.admitted, "{algorithm}: A");
        tokio::time::sleep(Duration::from_millis(2_150)).await;
        assert!(
            check(store, &p, caller, 10).await.admitted,
            "{algorithm}: B"
        );
        let settled = run(store, &p, a.settle(0)).await;
        assert_eq!(
            settled.limits[0].remaining, 0,
            "{algorithm}: nothing refunded"
        );
        let c = check(store, &p, caller, 10).await;
        assert!(!c.admitted, "{algorithm}: 20 units in one window");
    });
    futures_util::future::join_all(runs).await;
}

/// A reset ends what a reservation charged: its settlement afterwards refunds nothing of what
/// others spent since (a limit of 10: A reserves 8; a reset; B spends 5; A settles for 0 — 5
/// are left, not 10), with one limit and with two.
pub async fn a_refund_after_a_reset_returns_nothing_others_spent(store: &impl RateStore) {
    for algorithm in ALGORITHMS {
        for limits in [
            vec![daily("day", 10)],
            vec![daily("day", 10), daily("team", 100)],
        ] {
            let n = limits.len();
            let p = policy(algorithm, limits);
            let caller = key(&unique("reset-refund"));
            let a = RateCheck::reservation(caller, 8);
            assert!(run(store, &p, a).await.admitted, "{algorithm}/{n}: A");
            store
                .reset_rate(&p, caller)
                .await
                .unwrap_or_else(|e| panic!("{algorithm}/{n}: reset failed: {e}"));
            let b = check(store, &p, caller, 5).await;
            assert!(b.admitted, "{algorithm}/{n}: B");
            let settled = run(store, &p, a.settle(0)).await;
            let look = check(store, &p, caller, 0).await;
            for out in [&settled, &look] {
                assert_eq!(
                    out.limits[0].remaining, 5,
                    "{algorithm}/{n}: B's 5 stay charged"
                );
                if n == 2 {
                    assert_eq!(
                        out.limits[1].remaining, 95,
                        "{algorithm}: B's 5 stay charged"
                    );
                }
            }
            let c = check(store, &p, caller, 6).await;
            assert!(!c.admitted, "{algorithm}/{n}: 11 of 10");
        }
    }
}

/// A sliding counter refunds from the window its reservation was charged to: made in the next
/// window, the refund comes out of the previous one (whose weight has faded by half), never out
/// of the current window's charges by others.
pub async fn a_counter_refund_comes_out_of_its_own_window(store: &impl RateStore) {
    let window = Duration::from_millis(1_000);
    let p = policy(Algorithm::SlidingCounter, vec![Limit::new("s", 10, window)]);
    let caller = key(&unique("counter-refund"));
    // start just after a window begins, so that the reservation and B fall in two windows
    let into = Duration::from_micros(epoch_us() % 1_000_000);
    tokio::time::sleep(window - into + Duration::from_millis(100)).await;
    let a = RateCheck::reservation(caller, 6);
    assert!(run(store, &p, a).await.admitted);
    // the next window, half way: 6 * 0.5 of A still counts, B spends 4 of what is left
    tokio::time::sleep(Duration::from_millis(1_400)).await;
    let b = check(store, &p, caller, 4).await;
    assert!(b.admitted, "B");
    let settled = run(store, &p, a.settle(0)).await;
    let look = check(store, &p, caller, 0).await;
    assert_eq!(
        (settled.limits[0].remaining, look.limits[0].remaining),
        (6, 6),
        "A's 6 came out of the previous window; B's 4 stay charged"
    );
}

/// Microseconds since the Unix epoch on this machine's clock.
fn epoch_us() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_micros()).unwrap_or(0))
}

/// A check retried past its deadline (its reply lost, the caller's timeout passed), after
/// another check charged the caller, is charged once: the store remembers it for its deadline
/// plus twice the timeout.
pub async fn a_check_retried_past_its_deadline_is_charged_once(store: &impl RateStore) {
    let past = store.timeout().mul_f64(1.2);
    let runs = ALGORITHMS.map(|algorithm| async move {
        let p = policy(algorithm, vec![Limit::per_hour("h", 10)]);
        let caller = key(&unique("retried"));
        let a = RateCheck::new(caller, 1);
        run(store, &p, a).await;
        tokio::time::sleep(past).await;
        check(store, &p, caller, 1).await;
        let again = run(store, &p, a).await;
        assert!(again.admitted, "{algorithm}");
        assert_eq!(
            again.limits[0].remaining, 8,
            "{algorithm}: a, b, a charged 2"
        );
    });
    futures_util::future::join_all(runs).await;
}

/// A settlement re-sent after another settlement, and past the store's timeout, is applied
/// once.
pub async fn a_settlement_resent_after_another_is_applied_once(store: &impl RateStore) {
    let past = store.timeout().mul_f64(1.2);
    let runs = ALGORITHMS.map(|algorithm| async move {
        let p = policy(algorithm, vec![daily("day", 100)]);
        let caller = key(&unique("resettled"));
        let (a, b) = (
            RateCheck::reservation(caller, 10),
            RateCheck::reservation(caller, 10),
        );
        run(store, &p, a).await;
        run(store, &p, b).await;
        run(store, &p, a.settle(4)).await;
        tokio::time::sleep(past).await;
        run(store, &p, b.settle(14)).await;
        let again = run(store, &p, a.settle(4)).await;
        assert_eq!(again.limits[0].remaining, 82, "{algorithm}: 4 + 14 charged");
    });
    futures_util::future::join_all(runs).await;
}

/// Every attempt is remembered, not the last few: a check re-sent after twenty others of its
/// caller is charged once.
pub async fn attempts_are_remembered_however_many_follow(store: &impl RateStore) {
    for algorithm in ALGORITHMS {
        let p = policy(algorithm, vec![Limit::per_hour("h", 50)]);
        let caller = key(&unique("many"));
        let a = RateCheck::new(caller, 1);
        run(store, &p, a).await;
        for _ in 0..20 {
            check(store, &p, caller, 1).await;
        }
        let again = run(store, &p, a).await;
        assert_eq!(again.limits[0].remaining, 29, "{algorithm}: 21 charged");
    }
}

/// A reservation refunded by its settlement and then sent again (a re-sent call, a retry)
/// changes nothing.
pub async fn a_refunded_reservation_sent_again_is_not_charged(store: &impl RateStore) {
    for algorithm in ALGORITHMS {
        let p = policy(algorithm, vec![daily("day", 10)]);
        let caller = key(&unique("refunded"));
        let a = RateCheck::reservation(caller, 3);
        run(store, &p, a).await;
        run(store, &p, a.settle(0)).await;
        let again = run(store, &p, a).await;
        assert!(again.admitted, "{algorithm}");
        assert_eq!(again.limits[0].remaining, 10, "{algorithm}: charged again");
    }
}

/// Costs no limit could admit — a settlement of a reservation of 2^50, a cost of 2^63 — are
/// answered like any other, and fail nothing sent with them: fifty checks in flight around
/// them are decided exactly.
pub async fn huge_costs_fail_nothing_around_them(store: &impl RateStore) {
    for algorithm in ALGORITHMS {
        let p = policy(algorithm, vec![Limit::per_hour("h", 100)]);
        let caller = key(&unique("huge"));
        let huge = RateCheck::reservation(caller, 1 << 50);
        let checks = (0..50).map(|_| store.check_rate(&p, RateCheck::new(caller, 1)));
        let huge_ones = [
            store.check_rate(&p, huge),
            store.check_rate(&p, huge.settle(0)),
            store.check_rate(&p, RateCheck::new(caller, 1 << 63)),
        ];
        let (checks, huge_ones) = futures_util::future::join(
            futures_util::future::join_all(checks),
            futures_util::future::join_all(huge_ones),
        )
        .await;
        for out in checks {
            assert!(
                out.expect("a check beside huge costs").admitted,
                "{algorithm}"
            );
        }
        let huge_ones: Vec<RateOutcome> = huge_ones
            .into_iter()
            .map(|out| out.expect("a huge cost is answered"))
            .collect();
        let admitted: Vec<bool> = huge_ones.iter().map(|o| o.admitted).collect();
        assert_eq!(admitted, [false, true, false], "{algorithm}");
        let look = check(store, &p, caller, 0).await;
        assert_eq!(
            look.limits[0].remaining, 50,
            "{algorithm}: the fifty charged"
        );
        // an overrun of u64::MAX takes the balance past the quota by at most one more
        let overrun = RateCheck::reservation(caller, 2).settle(u64::MAX);
        assert!(run(store, &p, overrun).await.admitted, "{algorithm}");
        assert!(!check(store, &p, caller, 1).await.admitted, "{algorithm}");
    }
}

/// The store time (µs) `out` was decided at.
fn at(out: &RateOutcome) -> u64 {
    out.decided_at_us.expect("a store decides at its own time")
}

/// Whether `out`, decided while the caller's block on limit `limit` ends at `till` (µs, store
/// time), is what a block answers: denied with the block's time left as the wait (the limits'
/// own waits being shorter here), the limit at 0 remaining and the same reset. Decided at or
/// after `till`, it is not blocked: `false`.
fn blocked_until(out: &RateOutcome, limit: usize, till: u64, what: &str) -> bool {
    let now = at(out);
    if now >= till {
        return false;
    }
    let left = Duration::from_micros(till - now);
    assert!(
        !out.admitted,
        "{what}: blocked until {till}, decided at {now}"
    );
    assert_eq!(out.retry_after, left, "{what}: the wait is the block's end");
    assert_eq!(out.limits[limit].remaining, 0, "{what}");
    assert_eq!(out.limits[limit].reset, left, "{what}");
    true
}

/// Sleeps until the store's clock, as `out` read it, is `until` (µs) or later, plus a margin.
async fn sleep_past(out: &RateOutcome, until: u64) {
    let wait = until.saturating_sub(at(out)) + 30_000;
    tokio::time::sleep(Duration::from_micros(wait)).await;
}

/// Spends 2 of a quota of 2 per 300 ms, then is denied: the denial that blocks. Its answer.
async fn block(store: &impl RateStore, p: &Arc<RatePolicy>, caller: Key) -> RateOutcome {
    for i in 0..2 {
        let out = check(store, p, caller, 1).await;
        assert!(out.admitted, "{}: request {i}", p.algorithm());
    }
    check(store, p, caller, 1).await
}

/// A check denied by a limit with `block_for` blocks the caller for exactly that long from its
/// decision: denied until then (after the limit's own window has passed) with the block's end
/// as the wait and the limit at 0 remaining, then admitted from the limit's own state.
pub async fn a_denial_blocks_the_caller_for_block_for(store: &impl RateStore) {
    for algorithm in ALGORITHMS {
        let burst = Limit::new("s", 2, Duration::from_millis(300));
        let p = policy(algorithm, vec![burst.block_for(Duration::from_millis(900))]);
        let caller = key(&unique("blocked"));
        let denied = block(store, &p, caller).await;
        let till = at(&denied) + 900_000;
        assert!(blocked_until(
            &denied,
            0,
            till,
            &format!("{algorithm}: the denial")
        ));
        // the limit has room again after its window; the block still denies
        sleep_past(&denied, at(&denied) + 500_000).await;
        let out = check(store, &p, caller, 1).await;
        let blocked = blocked_until(&out, 0, till, &format!("{algorithm}: blocked"));
        assert!(blocked, "{algorithm}: the store was slow to answer");
        sleep_past(&out, till).await;
        let after = check(store, &p, caller, 1).await;
        assert!(after.admitted, "{algorithm}: the block has ended");
        assert_eq!(
            after.limits[0].remaining, 1,
            "{algorithm}: from its own state"
        );
    }
}

/// A blocked caller is charged nothing (nor is the block extended): after the block, a limit
/// without a penalty has what it had when the block began.
pub async fn a_block_charges_nothing(store: &impl RateStore) {
    for algorithm in ALGORITHMS {
        let burst = Limit::new("s", 2, Duration::from_millis(300));
        let limits = vec![
            burst.block_for(Duration::from_millis(600)),
            Limit::per_minute("m", 10),
        ];
        let p = policy(algorithm, limits);
        let caller = key(&unique("uncharged"));
        let denied = block(store, &p, caller).await;
        let till = at(&denied) + 600_000;
        assert_eq!(denied.limits[1].remaining, 8, "{algorithm}");
        for cost in [1, 1, 3, 0] {
            let out = check(store, &p, caller, cost).await;
            if blocked_until(&out, 0, till, &format!("{algorithm}: cost {cost}")) {
                assert_eq!(out.limits[1].remaining, 8, "{algorithm}: nothing charged");
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        sleep_past(&denied, till).await;
        let after = check(store, &p, caller, 1).await;
        assert!(after.admitted, "{algorithm}");
        assert_eq!(
            after.limits[1].remaining, 7,
            "{algorithm}: charged once more"
        );
    }
}

/// A block on one limit of a policy denies the whole check, even when that limit has room
/// again; the other limits answer what they hold.
pub async fn a_block_on_one_limit_blocks_the_whole_check(store: &impl RateStore) {
    for algorithm in ALGORITHMS {
        let limits = vec![
            Limit::per_hour("h", 100),
            Limit::new("s", 2, Duration::from_millis(300)).block_for(Duration::from_millis(800)),
        ];
        let p = policy(algorithm, limits);
        let caller = key(&unique("whole"));
        let denied = block(store, &p, caller).await;
        let till = at(&denied) + 800_000;
        assert!(blocked_until(&denied, 1, till, &format!("{algorithm}")));
        sleep_past(&denied, at(&denied) + 400_000).await;
        let out = check(store, &p, caller, 1).await;
        if blocked_until(&out, 1, till, &format!("{algorithm}: blocked")) {
            assert_eq!(out.limits[0].remaining, 98, "{algorithm}: the hourly limit");
        }
        sleep_past(&out, till).await;
        assert!(check(store, &p, caller, 1).await.admitted, "{algorithm}");
    }
}

/// A reset of the caller ends its block at once; other callers were never blocked.
pub async fn a_reset_ends_a_block_and_others_are_not_blocked(store: &impl RateStore) {
    for algorithm in ALGORITHMS {
        let burst = Limit::new("s", 2, Duration::from_millis(300));
        let p = policy(algorithm, vec![burst.block_for(Duration::from_secs(60))]);
        let (a, b) = (key(&unique("reset-block")), key(&unique("bystander")));
        let denied = block(store, &p, a).await;
        assert_eq!(denied.retry_after, Duration::from_secs(60), "{algorithm}");
        let other = check(store, &p, b, 1).await;
        assert!(other.admitted, "{algorithm}: another caller");
        assert_eq!(other.limits[0].remaining, 1, "{algorithm}");
        assert!(
            !check(store, &p, a, 0).await.admitted,
            "{algorithm}: a look too"
        );
        store.reset_rate(&p, a).await.expect("store answers");
        let after = check(store, &p, a, 1).await;
        assert!(after.admitted, "{algorithm}: the reset ended the block");
        assert_eq!(after.limits[0].remaining, 1, "{algorithm}");
    }
}

/// A reset through a copy whose configuration gives the limit no penalty (a rolling deploy that
/// drops `block_for`, an operator's tool built without it) still ends the block that another
/// copy's penalty set: a reset forgets every block of the policy's limits, not only those its
/// own configuration names.
pub async fn a_reset_without_the_penalty_still_ends_the_block(store: &impl RateStore) {
    for algorithm in ALGORITHMS {
        let burst = Limit::new("s", 2, Duration::from_millis(300));
        let blocking = policy(
            algorithm,
            vec![burst.clone().block_for(Duration::from_secs(60))],
        );
        let plain = RatePolicy::new(blocking.namespace().to_owned(), algorithm, vec![burst]);
        let plain = Arc::new(plain.expect("valid policy"));
        let caller = key(&unique("reset-unnamed-block"));
        let denied = block(store, &blocking, caller).await;
        assert_eq!(denied.retry_after, Duration::from_secs(60), "{algorithm}");
        store
            .reset_rate(&plain, caller)
            .await
            .expect("store answers");
        let after = check(store, &blocking, caller, 1).await;
        assert!(after.admitted, "{algorithm}: the reset ended the block");
        assert_eq!(after.limits[0].remaining, 1, "{algorithm}");
    }
}

/// Only a denial by a limit with `block_for` blocks: one by a limit without waits as before;
/// a limit with a penalty that denies later blocks then.
pub async fn only_a_limit_with_block_for_blocks(store: &impl RateStore) {
    for algorithm in ALGORITHMS {
        let limits = vec![
            Limit::new("s", 2, Duration::from_millis(300)),
            Limit::new("h", 3, Duration::from_secs(5)).block_for(Duration::from_secs(8)),
        ];
        let p = policy(algorithm, limits);
        let caller = key(&unique("unblocked"));
        let denied = block(store, &p, caller).await;
        assert!(!denied.admitted, "{algorithm}");
        assert!(
            denied.retry_after <= Duration::from_millis(600),
            "{algorithm}: no block, {:?}",
            denied.retry_after
        );
        assert_eq!(denied.limits[1].remaining, 1, "{algorithm}");
        tokio::time::sleep(denied.retry_after + Duration::from_millis(30)).await;
        assert!(check(store, &p, caller, 1).await.admitted, "{algorithm}");
        // the limit with a penalty, spent, denies: it blocks
        let out = check(store, &p, caller, 1).await;
        assert!(blocked_until(
            &out,
            1,
            at(&out) + 8_000_000,
            &format!("{algorithm}")
        ));
    }
}

/// Re-sent checks are answered as recorded: one admitted before the block is admitted again
/// during it, charging nothing; the denial that blocked, sent again, is denied again and does
/// not extend the block.
pub async fn resent_checks_during_a_block_are_answered_as_recorded(store: &impl RateStore) {
    for algorithm in ALGORITHMS {
        let burst = Limit::new("s", 2, Duration::from_millis(300));
        let p = policy(algorithm, vec![burst.block_for(Duration::from_millis(800))]);
        let caller = key(&unique("resent-block"));
        let first = RateCheck::new(caller, 1);
        assert!(run(store, &p, first).await.admitted, "{algorithm}");
        assert!(check(store, &p, caller, 1).await.admitted, "{algorithm}");
        let third = RateCheck::new(caller, 1);
        let denied = run(store, &p, third).await;
        let till = at(&denied) + 800_000;
        assert!(blocked_until(&denied, 0, till, &format!("{algorithm}")));
        let again = run(store, &p, first).await;
        assert!(again.admitted, "{algorithm}: charged before the block");
        tokio::time::sleep(Duration::from_millis(100)).await;
        let out = run(store, &p, third).await;
        blocked_until(&out, 0, till, &format!("{algorithm}: the denial re-sent"));
        sleep_past(&denied, till).await;
        assert!(
            run(store, &p, third).await.admitted,
            "{algorithm}: not extended"
        );
    }
}

/// Whether `expected` arrives on `subscription` within `within`, past whatever else arrives
/// (other tests' callers, [`Invalidation::Missed`]).
async fn told(subscription: &mut Invalidations, expected: &Invalidation, within: Duration) -> bool {
    let waited = tokio::time::timeout(within, async {
        while let Some(invalidation) = subscription.next().await {
            if invalidation == *expected {
                return true;
            }
        }
        false
    });
    waited.await.unwrap_or(false)
}

/// A store that offers [invalidations](RateStore::invalidations) tells its subscribers of a
/// reset, and of a settlement that refunded a reservation and left the caller room: the
/// caller's key under the policy's namespace; not of a [quiet](RateCheck::quiet) settlement's
/// refund. A store without invalidations passes.
pub async fn resets_and_refunds_are_told_to_subscribers(store: &impl RateStore) {
    let Some(mut subscription) = store.invalidations() else {
        return;
    };
    let p = policy(Algorithm::SlidingLog, vec![Limit::per_hour("h", 10)]);
    let a = key(&unique("told"));
    let expected = Invalidation::Caller {
        namespace: p.namespace().into(),
        key: a,
    };
    // a networked subscriber connects in the background: what is published before is lost
    let mut reset_heard = false;
    for _ in 0..20 {
        store.reset_rate(&p, a).await.expect("store answers");
        if told(&mut subscription, &expected, Duration::from_millis(500)).await {
            reset_heard = true;
            break;
        }
    }
    assert!(reset_heard, "a reset was never told");
    let refunded = reserve_then_settle(store, &p, a, 5, 1).await;
    assert_eq!(refunded.limits[0].remaining, 9, "refunded");
    assert!(
        told(&mut subscription, &expected, Duration::from_secs(2)).await,
        "a refund was not told"
    );
    // a quiet settlement's refund is not told: the next word is of another caller's reset
    let quiet = RateCheck::reservation(a, 3).quiet();
    assert!(
        run(store, &p, quiet).await.admitted,
        "the quiet reservation"
    );
    assert_eq!(run(store, &p, quiet.settle(0)).await.limits[0].remaining, 9);
    let b = key(&unique("told"));
    store.reset_rate(&p, b).await.expect("store answers");
    // the next word of this policy's namespace (the store's other users speak on the channel too)
    let ours = |i: &Invalidation| matches!(i, Invalidation::Caller { namespace, .. } if **namespace == *p.namespace());
    let next = tokio::time::timeout(Duration::from_secs(2), async {
        while let Some(invalidation) = subscription.next().await {
            if ours(&invalidation) {
                return Some(invalidation);
            }
        }
        None
    })
    .await;
    let reset_b = Invalidation::Caller {
        namespace: p.namespace().into(),
        key: b,
    };
    assert_eq!(
        next.ok().flatten(),
        Some(reset_b),
        "a quiet refund was told, or a reset was not"
    );
}

/// A held charge (a leased slice, whose units a copy admits up to its hold after the charge) is
/// counted on a sliding log until a window after its hold ends: its entries are dated then.
pub async fn a_held_log_charge_counts_until_a_window_after_its_hold(store: &impl RateStore) {
    let p = policy(
        Algorithm::SlidingLog,
        vec![Limit::new("l", 4, Duration::from_millis(600))],
    );
    let hold = Duration::from_millis(300);
    let held = run(store, &p, RateCheck::reservation(key("l"), 3).held(hold)).await;
    assert!(held.admitted);
    assert_eq!(held.limits[0].remaining, 1);
    // the oldest entry is dated at the hold's end: it leaves a window after that
    let reset = held.limits[0].reset;
    assert!(reset > Duration::from_millis(890) && reset <= hold + Duration::from_millis(600));
    // a plain charge now is dated now: the log stays in order of its dates
    let plain = check(store, &p, key("l"), 1).await;
    assert!(plain.admitted);
    assert_eq!(plain.limits[0].remaining, 0);
    assert!(
        plain.limits[0].reset <= Duration::from_millis(600),
        "{plain:?}"
    );
    tokio::time::sleep(Duration::from_millis(650)).await;
    // a window after the charge: the plain unit left, the held ones still count
    let one = check(store, &p, key("l"), 1).await;
    assert!(one.admitted, "{one:?}");
    let denied = check(store, &p, key("l"), 1).await;
    assert!(
        !denied.admitted,
        "the held units count until their hold's end plus a window"
    );
    assert!(
        denied.retry_after <= Duration::from_millis(260),
        "{denied:?}"
    );
    tokio::time::sleep(denied.retry_after + Duration::from_millis(30)).await;
    let freed = check(store, &p, key("l"), 3).await;
    assert!(freed.admitted, "{freed:?}");
}

/// A held charge on GCRA starts from its hold's end at the earliest: it fits only if its units
/// would also fit admitted all at once then, and the caller's next charge waits on it.
pub async fn a_held_gcra_charge_is_charged_from_its_holds_end(store: &impl RateStore) {
    let p = policy(
        Algorithm::Gcra,
        vec![Limit::new("g", 10, Duration::from_millis(1000))],
    );
    let hold = Duration::from_millis(100);
    // ten units from 100 ms on reach 1.1 s past now: more than a window
    let all = run(store, &p, RateCheck::reservation(key("g"), 10).held(hold)).await;
    assert!(!all.admitted, "{all:?}");
    assert!(all.retry_after > Duration::from_millis(90), "{all:?}");
    let nine = run(store, &p, RateCheck::reservation(key("g"), 9).held(hold)).await;
    assert!(nine.admitted, "{nine:?}");
    assert_eq!(nine.limits[0].remaining, 0, "a whole window is spoken for");
    let next = check(store, &p, key("g"), 1).await;
    assert!(!next.admitted, "{next:?}");
    // a look charges nothing, whatever its hold
    let look = run(store, &p, RateCheck::new(key("g"), 0).held(hold)).await;
    assert_eq!(look.limits[0].remaining, 0);
}

/// A sliding counter charges a held check as any: the copy spends it within the window.
pub async fn a_held_counter_charge_is_charged_as_any(store: &impl RateStore) {
    let p = policy(
        Algorithm::SlidingCounter,
        vec![Limit::new("c", 10, Duration::from_secs(60))],
    );
    let hold = Duration::from_secs(6);
    let slice = RateCheck::reservation(key("c"), 10).held(hold);
    let held = run(store, &p, slice).await;
    assert!(held.admitted, "{held:?}");
    assert_eq!(held.limits[0].remaining, 0);
    assert!(!check(store, &p, key("c"), 1).await.admitted);
    let settled = run(store, &p, slice.settle(4)).await;
    assert_eq!(
        settled.limits[0].remaining, 6,
        "what the slice left goes back"
    );
}

/// A policy of a limit of `calls` a day that [counts calls](Limit::counting_calls) and one of
/// `tokens` a day that counts the cost, under `algorithm`.
fn calls_and_tokens(algorithm: Algorithm, calls: u64, tokens: u64) -> Arc<RatePolicy> {
    policy(
        algorithm,
        vec![
            daily("calls", calls).counting_calls(),
            daily("tokens", tokens),
        ],
    )
}

/// The remaining of each limit of `out`, in order.
fn remaining(out: &RateOutcome) -> Vec<u64> {
    out.limits.iter().map(|l| l.remaining).collect()
}

/// A limit that counts calls is charged 1 by every check of a cost above 0, whatever the cost
/// (even one above its quota); the other limits the cost.
pub async fn a_calls_limit_is_charged_one_whatever_the_cost(store: &impl RateStore) {
    for algorithm in ALGORITHMS {
        let p = calls_and_tokens(algorithm, 3, 1000);
        let caller = key(&unique("calls"));
        for (cost, left) in [(300, [2, 700]), (1, [1, 699]), (99, [0, 600])] {
            let out = check(store, &p, caller, cost).await;
            assert!(out.admitted, "{algorithm}: cost {cost}");
            assert_eq!(remaining(&out), left, "{algorithm}: after cost {cost}");
        }
        // a calls limit alone takes a cost above its quota as one call
        let alone = policy(algorithm, vec![daily("calls", 2).counting_calls()]);
        let out = check(store, &alone, key(&unique("alone")), 50).await;
        assert!(out.admitted, "{algorithm}: one call");
        assert_eq!(remaining(&out), [1], "{algorithm}");
    }
}

/// A check that the cost-counting limit denies charges neither limit.
pub async fn a_cost_denial_charges_no_calls(store: &impl RateStore) {
    for algorithm in ALGORITHMS {
        let p = calls_and_tokens(algorithm, 10, 100);
        let caller = key(&unique("tokens-denied"));
        assert!(check(store, &p, caller, 80).await.admitted);
        let denied = check(store, &p, caller, 30).await;
        assert!(!denied.admitted, "{algorithm}: 30 tokens > 20 left");
        assert_eq!(remaining(&denied), [9, 20], "{algorithm}: nothing charged");
        let look = check(store, &p, caller, 0).await;
        assert_eq!(remaining(&look), [9, 20], "{algorithm}: nothing charged");
        let out = check(store, &p, caller, 20).await;
        assert!(out.admitted, "{algorithm}: 20 fits");
        assert_eq!(remaining(&out), [8, 0], "{algorithm}");
    }
}

/// A check that the calls limit denies charges neither limit.
pub async fn a_calls_denial_charges_no_cost(store: &impl RateStore) {
    for algorithm in ALGORITHMS {
        let p = calls_and_tokens(algorithm, 2, 1000);
        let caller = key(&unique("calls-denied"));
        for _ in 0..2 {
            assert!(check(store, &p, caller, 10).await.admitted);
        }
        let denied = check(store, &p, caller, 10).await;
        assert!(!denied.admitted, "{algorithm}: a third call");
        assert!(denied.retry_after > Duration::ZERO, "{algorithm}");
        assert_eq!(remaining(&denied), [0, 980], "{algorithm}: nothing charged");
        let look = check(store, &p, caller, 0).await;
        assert_eq!(remaining(&look), [0, 980], "{algorithm}: nothing charged");
    }
}

/// A denial waits for the latest of the limits that deny it, whichever counts calls (GCRA,
/// where the waits are exact: 1 call per 10 s beside 100 tokens per 100 s).
pub async fn a_mixed_denial_waits_for_the_latest_limit(store: &impl RateStore) {
    let p = policy(
        Algorithm::Gcra,
        vec![
            Limit::new("calls", 1, Duration::from_secs(10)).counting_calls(),
            Limit::new("tokens", 100, Duration::from_secs(100)),
        ],
    );
    let caller = key(&unique("latest"));
    assert!(check(store, &p, caller, 100).await.admitted);
    // one more token waits 1 s, one more call 10 s: the call is the latest
    let small = check(store, &p, caller, 1).await;
    assert!(!small.admitted);
    let calls_wait = small.retry_after;
    assert!(
        calls_wait > Duration::from_millis(9_000) && calls_wait <= Duration::from_secs(10),
        "the calls limit's wait: {calls_wait:?}"
    );
    // 50 more tokens wait 50 s: the tokens are the latest
    let big = check(store, &p, caller, 50).await;
    assert!(!big.admitted);
    assert!(
        big.retry_after > Duration::from_secs(49) && big.retry_after <= Duration::from_secs(50),
        "the tokens limit's wait: {:?}",
        big.retry_after
    );
}

/// A settlement, refund or overrun, and sent again, leaves a limit that counts calls as it
/// was; the other limits are settled as ever.
pub async fn a_settlement_leaves_a_calls_limit_as_it_was(store: &impl RateStore) {
    for algorithm in ALGORITHMS {
        let p = calls_and_tokens(algorithm, 10, 1000);
        let caller = key(&unique("calls-settled"));
        let reservation = RateCheck::reservation(caller, 300);
        let out = run(store, &p, reservation).await;
        assert_eq!(remaining(&out), [9, 700], "{algorithm}: reserved");
        let refund = run(store, &p, reservation.settle(100)).await;
        assert_eq!(remaining(&refund), [9, 900], "{algorithm}: refunded");
        let again = run(store, &p, reservation.settle(100)).await;
        assert_eq!(remaining(&again), [9, 900], "{algorithm}: applied once");
        let out = reserve_then_settle(store, &p, caller, 100, 500).await;
        assert_eq!(remaining(&out), [8, 400], "{algorithm}: overrun");
        let out = reserve_then_settle(store, &p, caller, 5, 0).await;
        assert_eq!(remaining(&out), [7, 400], "{algorithm}: all refunded");
        let plain = RateCheck::new(caller, 50);
        assert_eq!(remaining(&run(store, &p, plain).await), [6, 350]);
        let overrun = run(store, &p, plain.settle(80)).await;
        assert_eq!(
            remaining(&overrun),
            [6, 320],
            "{algorithm}: a check's overrun"
        );
        let look = check(store, &p, caller, 0).await;
        assert_eq!(remaining(&look), [6, 320], "{algorithm}: as settled");
    }
}

/// A look (cost 0) charges a limit that counts calls nothing.
pub async fn a_look_charges_a_calls_limit_nothing(store: &impl RateStore) {
    for algorithm in ALGORITHMS {
        let p = calls_and_tokens(algorithm, 3, 1000);
        let caller = key(&unique("calls-look"));
        for _ in 0..3 {
            let look = check(store, &p, caller, 0).await;
            assert!(look.admitted, "{algorithm}: a look");
            assert_eq!(
                remaining(&look),
                [3, 1000],
                "{algorithm}: a look charges nothing"
            );
        }
        let out = check(store, &p, caller, 5).await;
        assert_eq!(remaining(&out), [2, 995], "{algorithm}");
    }
}
