//! A leased slice spent late in its lease: four copies each take a slice of a sliding-log limit
//! of 80 per 8 s and spend it 400 ms later. A window after the slices were charged, the store
//! still counts them — their units were admitted less than a window ago — so exactly the quota
//! less those slices is admitted then, and never more than the quota within one window. On the
//! memory store, Redis and PostgreSQL.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use http::StatusCode;
use tokio::time::{Instant, sleep_until};

use crate::common::{RedisServer, postgres};
use crate::rate_limit_leases::{self, unique};
use tollgate::key::Header;
use tollgate::rate_limit::{Algorithm, Limit, RateLimitLayer};
use tollgate::store::{MemoryStore, RateStore};

const QUOTA: u64 = 80;
const WINDOW: Duration = Duration::from_secs(8);
/// A leased slice's lease: a tenth of the window.
const LEASE: Duration = Duration::from_millis(800);

fn copy(store: impl RateStore, prefix: &str) -> RateLimitLayer<Header> {
    RateLimitLayer::builder(store)
        .limit(Limit::new("api", QUOTA, WINDOW).leased())
        .algorithm(Algorithm::SlidingLog)
        .prefix(prefix)
        .key(Header::from_static("x-api-key"))
        .build()
        .unwrap()
}

/// One request of `caller` through `copy`: whether it was admitted, and whether from a slice.
async fn one(copy: &RateLimitLayer<Header>, caller: &str) -> (bool, bool) {
    match rate_limit_leases::one(copy, caller).await {
        (StatusCode::OK, from_lease) => (true, from_lease),
        (StatusCode::TOO_MANY_REQUESTS, _) => (false, false),
        (other, _) => panic!("unexpected status {other}"),
    }
}

/// Requests round the copies, one at a time, their slices given back after every round, until a
/// round admits nothing: what was admitted.
async fn spend(copies: &[RateLimitLayer<Header>], caller: &str) -> u64 {
    let mut admitted = 0;
    loop {
        let mut round = 0;
        for copy in copies {
            for _ in 0..12 {
                round += u64::from(one(copy, caller).await.0);
            }
        }
        for copy in copies {
            copy.give_back_leases().await;
        }
        if round == 0 {
            return admitted;
        }
        admitted += round;
    }
}

async fn slices_spent_late_are_counted_a_window_after(copies: [RateLimitLayer<Header>; 4]) {
    let caller = unique("late");
    let t0 = Instant::now();
    // each copy: three requests checked alone, then a slice of 8 fetched with the fourth
    for copy in &copies {
        for i in 0..4 {
            assert_eq!(one(copy, &caller).await, (true, false), "request {i}");
        }
        assert_eq!(
            copy.leases_unspent(),
            7,
            "a slice of 8, one admitted from it"
        );
    }
    // half a lease later, each copy spends the rest of its slice
    sleep_until(t0 + LEASE / 2).await;
    let mut late = 0;
    for copy in &copies {
        for _ in 0..7 {
            assert_eq!(one(copy, &caller).await, (true, true));
            late += 1;
        }
    }
    assert!(
        Instant::now() < t0 + LEASE,
        "the slices were spent within their lease"
    );
    // a window after the slices were charged, less than one after their units were admitted
    sleep_until(t0 + WINDOW + Duration::from_millis(100)).await;
    let then = spend(&copies, &caller).await;
    assert!(
        Instant::now() < t0 + LEASE + WINDOW,
        "spent before the slices' units left the window"
    );
    assert_eq!(
        then,
        QUOTA - 4 * 8,
        "the slices' 32 units still count: {late} admitted late, {then} a window after"
    );
    assert!(late + then <= QUOTA);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_memory_slices_spent_late_are_counted_a_window_after() {
    let store = MemoryStore::new();
    let prefix = unique("late");
    slices_spent_late_are_counted_a_window_after(std::array::from_fn(|_| {
        copy(store.clone(), &prefix)
    }))
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_redis_slices_spent_late_are_counted_a_window_after() {
    let server = RedisServer::start();
    let prefix = unique("late");
    slices_spent_late_are_counted_a_window_after(std::array::from_fn(|_| {
        copy(server.store(), &prefix)
    }))
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_postgres_slices_spent_late_are_counted_a_window_after() {
    let store = postgres::store().await;
    let prefix = unique("late");
    slices_spent_late_are_counted_a_window_after(std::array::from_fn(|_| {
        copy(store.clone(), &prefix)
    }))
    .await;
}
