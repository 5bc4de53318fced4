//! Leased quota (`Limit::leased`) on every backend: four copies of a service, 4,000 requests of
//! one caller each, against a leased limit of 1,000 — never more admitted than the quota, less
//! by at most the slices the copies hold unspent, and exactly the quota once they are given
//! back; a copy that dies holding a slice loses that slice and no more.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::convert::Infallible;
use std::time::Duration;

use futures_util::StreamExt;
use http::{Request, Response, StatusCode};
use tower::ServiceExt;

use crate::common::cluster::RedisCluster;
use crate::common::{RedisServer, postgres};
use tollgate::key::{Header, Key};
use tollgate::rate_limit::{
    Algorithm, DecisionSource, Limit, RateLimitDecision, RateLimitLayer, RateLimitLayerBuilder,
};
use tollgate::store::{MemoryStore, RateStore};

pub(super) const QUOTA: u64 = 1_000;
const PER_COPY: usize = 4_000;

/// A copy of the service: a leased limit of 1,000 a day per `x-api-key` (one window for the
/// whole test), under `prefix`.
pub(super) fn copy(
    store: impl RateStore,
    algorithm: Algorithm,
    prefix: &str,
) -> RateLimitLayer<Header> {
    copy_builder(store, algorithm, prefix).build().unwrap()
}

/// The builder of [`copy`], for a copy with a setting of its own.
pub(super) fn copy_builder(
    store: impl RateStore,
    algorithm: Algorithm,
    prefix: &str,
) -> RateLimitLayerBuilder<Header> {
    RateLimitLayer::builder(store)
        .limit(Limit::per_day("api", QUOTA).leased())
        .algorithm(algorithm)
        .prefix(prefix)
        .key(Header::from_static("x-api-key"))
}

pub(super) fn unique(what: &str) -> String {
    format!("{what}-{:x}", rand::random::<u64>())
}

/// What came of `n` requests of `caller` through `copy`, 32 at a time.
#[derive(Debug, Default)]
pub(super) struct Tally {
    pub(super) admitted: u64,
    pub(super) from_lease: u64,
    pub(super) denied: u64,
}

/// The responses to `n` requests of `caller` through `service`, 32 at a time.
pub(super) async fn send<S, B>(service: &S, caller: &str, n: usize) -> Vec<Response<B>>
where
    S: tower::Service<Request<()>, Response = Response<B>> + Clone,
    S::Error: std::fmt::Debug,
{
    let replies: Vec<_> = futures_util::stream::iter(0..n)
        .map(|_| {
            let request = Request::get("/")
                .header("x-api-key", caller)
                .body(())
                .unwrap();
            service.clone().oneshot(request)
        })
        .buffer_unordered(32)
        .collect()
        .await;
    replies.into_iter().map(Result::unwrap).collect()
}

/// `n` requests of `caller` through `copy`, 32 at a time: what came of them.
pub(super) async fn fire(copy: &RateLimitLayer<Header>, caller: &str, n: usize) -> Tally {
    let service = tower::Layer::layer(
        copy,
        tower::service_fn(|_: Request<()>| async { Ok::<_, Infallible>(Response::new(())) }),
    );
    let mut tally = Tally::default();
    for reply in send(&service, caller, n).await {
        match reply.status() {
            StatusCode::OK => {
                tally.admitted += 1;
                let decision = reply.extensions().get::<RateLimitDecision>().unwrap();
                if decision.source() == DecisionSource::Lease {
                    tally.from_lease += 1;
                }
            }
            StatusCode::TOO_MANY_REQUESTS => tally.denied += 1,
            other => panic!("unexpected status {other}"),
        }
    }
    tally
}

/// One request of `caller` through `copy`: its status, and whether it was admitted from a slice.
pub(super) async fn one(copy: &RateLimitLayer<Header>, caller: &str) -> (StatusCode, bool) {
    let service = tower::Layer::layer(
        copy,
        tower::service_fn(|_: Request<()>| async { Ok::<_, Infallible>(Response::new(())) }),
    );
    let request = Request::get("/")
        .header("x-api-key", caller)
        .body(())
        .unwrap();
    let reply = service.oneshot(request).await.unwrap();
    let from_lease = reply
        .extensions()
        .get::<RateLimitDecision>()
        .is_some_and(|d| d.source() == DecisionSource::Lease);
    (reply.status(), from_lease)
}

pub(super) fn key_of(copy: &RateLimitLayer<Header>, caller: &str) -> Key {
    let head = Request::get("/")
        .header("x-api-key", caller)
        .body(())
        .unwrap();
    copy.key_of(&head.into_parts().0).unwrap()
}

/// The promise of `leases_unspent`, at this moment: what the store counts of `caller` beyond the
/// `admitted` (read through `reader`) is at most what `copy` says it holds (read first, so that
/// whatever lands between the two reads only lowers the store's count); what it holds.
pub(super) async fn shortfall_is_held(
    copy: &RateLimitLayer<Header>,
    reader: &RateLimitLayer<Header>,
    caller: &str,
    admitted: u64,
) -> u64 {
    let held = copy.leases_unspent();
    let left = reader.peek(key_of(reader, caller)).await.unwrap().limits[0].remaining;
    let shortfall = QUOTA - admitted - left;
    assert!(
        shortfall <= held,
        "{caller}: the store counts {shortfall} beyond the {admitted} admitted, the copy holds {held}"
    );
    held
}

/// Waits until `copy` holds `expected` unspent (a lost slice is held while it is resolved), or
/// fails naming what it holds.
pub(super) async fn unspent_becomes(copy: &RateLimitLayer<Header>, expected: u64) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while copy.leases_unspent() != expected {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the copy holds {} unspent, expected {expected}",
            copy.leases_unspent()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Waits until the store says `caller` has `expected` left (the settlements that give slices
/// back are sent in the background), or fails naming what it has.
pub(super) async fn left_becomes(copy: &RateLimitLayer<Header>, caller: &str, expected: u64) {
    let key = key_of(copy, caller);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let left = copy.peek(key).await.unwrap().limits[0].remaining;
        if left == expected {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "{caller} has {left} left in the store, expected {expected}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Four copies, 4,000 requests each at once: at most the quota admitted, at least the quota less
/// the slices held unspent, most of it without a round trip; the store holds exactly what was
/// admitted plus what the slices hold; given back, the quota is spent to the last unit.
async fn four_copies_admit_at_most_the_quota(copies: [RateLimitLayer<Header>; 4]) {
    let caller = unique("hot");
    let tallies =
        futures_util::future::join_all(copies.iter().map(|c| fire(c, &caller, PER_COPY))).await;
    let admitted: u64 = tallies.iter().map(|t| t.admitted).sum();
    let from_lease: u64 = tallies.iter().map(|t| t.from_lease).sum();
    assert!(
        admitted <= QUOTA,
        "{admitted} admitted of {QUOTA}: {tallies:?}"
    );
    assert!(
        from_lease * 2 >= admitted,
        "only {from_lease} of {admitted} admitted from slices: {tallies:?}"
    );
    // the store counts every admission and every unspent unit of a slice, nothing more: the
    // quota is admitted but for what the slices hold — once every slice fetched in the
    // background has landed, and every fetch whose answer was lost under load has been resolved
    // and given back (a unit on its way back is counted by the store until it lands, and held
    // by no copy)
    accounted(&copies, &caller, admitted).await;
    for copy in &copies {
        copy.give_back_leases().await;
        assert_eq!(copy.leases_unspent(), 0);
    }
    left_becomes(&copies[1], &caller, QUOTA - admitted).await;
    // what was given back is admitted, to the last unit, and then no more
    let rest = spend_the_rest(&copies.each_ref(), &caller).await;
    assert_eq!(
        admitted + rest,
        QUOTA,
        "{admitted} admitted at first, {rest} then"
    );
}

/// Waits until the store's count of `caller` is exactly `admitted` plus what `copies` hold
/// unspent of their slices, at most 10 s.
async fn accounted(copies: &[RateLimitLayer<Header>], caller: &str, admitted: u64) {
    let key = key_of(&copies[0], caller);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let unspent: u64 = copies.iter().map(RateLimitLayer::leases_unspent).sum();
        let left = copies[0].peek(key).await.unwrap().limits[0].remaining;
        if admitted + unspent + left == QUOTA {
            // left in the store, yet denied: only units that were on their way back during the
            // burst, at most a slice (an eighth of the quota)
            assert!(
                left <= QUOTA / 8,
                "{admitted} admitted, {unspent} unspent in slices, {left} left in the store"
            );
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "{admitted} admitted, {unspent} unspent in slices, {left} left in the store, of {QUOTA}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Spends what is left of `caller`'s quota through `copies`, their slices given back before and
/// after every round (so that none is held at the end, a fetch under way included), until a
/// round admits nothing once nothing is on its way back to the store and no copy can still
/// serve a denial it cached: what was admitted.
async fn spend_the_rest(copies: &[&RateLimitLayer<Header>], caller: &str) -> u64 {
    let mut admitted = 0;
    let mut settled = false;
    for _ in 0..100 {
        let mut round = 0;
        for copy in copies {
            copy.give_back_leases().await;
            round += fire(copy, caller, 50).await.admitted;
        }
        for copy in copies {
            copy.give_back_leases().await;
        }
        admitted += round;
        if round > 0 {
            settled = false;
        } else if settled {
            return admitted;
        } else {
            // a unit given back may still be on its way (a refund whose answer came late is
            // resolved in the background), and a refund of a quiet slice reaches no other
            // copy: a copy serves a denial it cached for up to a second
            for copy in copies {
                holds_nothing(copy).await;
            }
            tokio::time::sleep(Duration::from_millis(1_100)).await;
            settled = true;
        }
    }
    panic!("{caller}: still admitted after 100 rounds ({admitted} in all)");
}

/// A copy that dies holding a slice (nothing given back) takes that slice with it, no more:
/// the other copy admits the quota less what the dead one admitted and held.
async fn a_dead_copy_loses_its_slice(alive: RateLimitLayer<Header>, dead: RateLimitLayer<Header>) {
    let caller = unique("dies");
    let before = fire(&dead, &caller, 40).await;
    // a slice fetched in the background lands: what the copy holds stays the same for 300 ms
    let mut held = dead.leases_unspent();
    let (mut still, deadline) = (0, tokio::time::Instant::now() + Duration::from_secs(5));
    while still < 3 && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(100)).await;
        let now = dead.leases_unspent();
        still = if now == held { still + 1 } else { 0 };
        held = now;
    }
    assert_eq!(before.admitted, 40);
    assert!(before.from_lease > 0 && held > 0, "{before:?}, {held} held");
    assert!(held <= QUOTA / 8, "{held} held in one slice");
    // killed: no settlement is ever sent
    std::mem::forget(dead);
    let after = fire(&alive, &caller, QUOTA as usize).await;
    let rest = spend_the_rest(&[&alive], &caller).await;
    assert_eq!(after.admitted + rest, QUOTA - 40 - held);
}

fn memory_copies(algorithm: Algorithm) -> [RateLimitLayer<Header>; 4] {
    let store = MemoryStore::new();
    let prefix = unique("lease");
    std::array::from_fn(|_| copy(store.clone(), algorithm, &prefix))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_memory_four_copies_admit_at_most_the_quota() {
    for algorithm in [
        Algorithm::Gcra,
        Algorithm::SlidingCounter,
        Algorithm::SlidingLog,
    ] {
        four_copies_admit_at_most_the_quota(memory_copies(algorithm)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_redis_four_copies_admit_at_most_the_quota() {
    let server = RedisServer::start();
    for algorithm in [
        Algorithm::Gcra,
        Algorithm::SlidingCounter,
        Algorithm::SlidingLog,
    ] {
        let prefix = unique("lease");
        let copies = std::array::from_fn(|_| copy(server.store(), algorithm, &prefix));
        four_copies_admit_at_most_the_quota(copies).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_cluster_four_copies_admit_at_most_the_quota() {
    let cluster = RedisCluster::shared();
    let prefix = unique("lease");
    let mut copies = Vec::new();
    for _ in 0..4 {
        copies.push(copy(cluster.store().await, Algorithm::Gcra, &prefix));
    }
    four_copies_admit_at_most_the_quota(copies.try_into().unwrap()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_postgres_four_copies_admit_at_most_the_quota() {
    let store = postgres::store().await;
    for algorithm in [
        Algorithm::Gcra,
        Algorithm::SlidingCounter,
        Algorithm::SlidingLog,
    ] {
        let prefix = unique("lease");
        let copies = std::array::from_fn(|_| copy(store.clone(), algorithm, &prefix));
        four_copies_admit_at_most_the_quota(copies).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_redis_a_copy_killed_holding_a_slice_loses_only_that_slice() {
    let server = RedisServer::start();
    let prefix = unique("lease");
    a_dead_copy_loses_its_slice(
        copy(server.store(), Algorithm::Gcra, &prefix),
        copy(server.store(), Algorithm::Gcra, &prefix),
    )
    .await;
}

/// Redis restarts empty while copy A holds a slice: the store starts the caller's quota over
/// (the other copy gets all of it), and A's slice given back afterwards refunds nothing — the
/// store charged it before the restart and has forgotten it. What the copies may admit past the
/// quota is what their slices held at the restart.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_redis_a_store_restarted_empty_takes_at_most_the_slices_held() {
    let mut server = RedisServer::start();
    // one client for both copies: B's traffic has it reconnected before A gives back
    let store = server.store();
    for algorithm in [Algorithm::SlidingCounter, Algorithm::Gcra] {
        let prefix = unique("restart");
        let (a, b) = (
            copy(store.clone(), algorithm, &prefix),
            copy(store.clone(), algorithm, &prefix),
        );
        let caller = unique("restart");
        assert_eq!(fire(&a, &caller, 40).await.admitted, 40, "{algorithm}");
        // a slice fetched in the background lands
        tokio::time::sleep(Duration::from_millis(300)).await;
        let held = a.leases_unspent();
        assert!(held > 0 && held <= QUOTA / 8, "{algorithm}: {held} held");
        tokio::task::block_in_place(|| server.restart());
        // reconnected (a request failing meanwhile would be let through: the failure policy)
        let key = key_of(&b, &caller);
        while b.peek(key).await.is_err() {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        // the store starts over: the other copy gets the whole quota
        assert_eq!(spend_the_rest(&[&b], &caller).await, QUOTA, "{algorithm}");
        a.give_back_leases().await;
        assert_eq!(a.leases_unspent(), 0);
        left_becomes(&b, &caller, 0).await;
        assert_eq!(
            spend_the_rest(&[&a, &b], &caller).await,
            0,
            "{algorithm}: a slice charged before the restart was refunded after it"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_postgres_a_copy_killed_holding_a_slice_loses_only_that_slice() {
    let store = postgres::store().await;
    let prefix = unique("lease");
    a_dead_copy_loses_its_slice(
        copy(store.clone(), Algorithm::SlidingCounter, &prefix),
        copy(store, Algorithm::SlidingCounter, &prefix),
    )
    .await;
}

/// A caller is decided by the store until it sent a few requests within a lease; then from its
/// slice, whose unspent part the `RateLimit` header counts as left.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_caller_is_checked_per_request_then_leased() {
    let layer = copy(MemoryStore::new(), Algorithm::Gcra, "lease");
    let service = tower::Layer::layer(
        &layer,
        tower::service_fn(|_: Request<()>| async { Ok::<_, Infallible>(Response::new(())) }),
    );
    let mut sources = Vec::new();
    let mut remaining = Vec::new();
    for _ in 0..6 {
        let request = Request::get("/")
            .header("x-api-key", "alice")
            .body(())
            .unwrap();
        let reply = service.clone().oneshot(request).await.unwrap();
        sources.push(
            reply
                .extensions()
                .get::<RateLimitDecision>()
                .unwrap()
                .source(),
        );
        let header = reply.headers()["ratelimit"].to_str().unwrap().to_owned();
        remaining.push(header);
    }
    use DecisionSource::{Lease, Store};
    // the fourth request fetches a slice of 8 with itself in it; the next two are spent from it
    assert_eq!(sources, [Store, Store, Store, Store, Lease, Lease]);
    let left: Vec<&str> = remaining
        .iter()
        .map(|h| h.split(";r=").nth(1).unwrap().split(';').next().unwrap())
        .collect();
    assert_eq!(left, ["999", "998", "997", "996", "995", "994"]);
}

#[test]
fn leases_are_refused_where_they_cannot_keep_their_promise() {
    let build = |limits: Vec<Limit>| {
        let mut builder = RateLimitLayer::builder(MemoryStore::new());
        for limit in limits {
            builder = builder.limit(limit);
        }
        builder.build().map(|_| ()).unwrap_err().to_string()
    };
    let mixed = build(vec![
        Limit::per_second("burst", 10).leased(),
        Limit::per_minute("steady", 100),
    ]);
    assert!(
        mixed.contains("lease every limit of a tier or none"),
        "{mixed}"
    );
    let blocking = build(vec![
        Limit::per_second("burst", 10)
            .leased()
            .block_for(Duration::from_secs(30)),
    ]);
    assert!(
        blocking.contains("a leased limit has no penalty"),
        "{blocking}"
    );
    let settled = RateLimitLayer::builder(MemoryStore::new())
        .limit(Limit::per_minute("tokens", 10_000).leased())
        .cost(|_| 100)
        .settle(|_| Some(10))
        .build()
        .map(|_| ())
        .unwrap_err()
        .to_string();
    assert!(
        settled.contains("leased limits are not settled"),
        "{settled}"
    );
}

/// A reset through the copy that holds a slice drops the slice with the caller's charges: the
/// caller has its whole quota again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reset_drops_the_slices_of_the_copy_that_made_it() {
    let layer = copy(MemoryStore::new(), Algorithm::SlidingLog, "lease");
    let caller = "bob";
    for _ in 0..10 {
        assert_eq!(fire(&layer, caller, 1).await.admitted, 1);
    }
    assert!(layer.leases_unspent() > 0);
    layer.reset(key_of(&layer, caller)).await.unwrap();
    // the slices are dropped; one fetched ahead and on its way counts as held until it lands,
    // and is dropped too
    unspent_becomes(&layer, 0).await;
    // the reset's broadcast reaches this copy's own listener too: let it land before new slices
    tokio::time::sleep(Duration::from_millis(300)).await;
    left_becomes(&layer, caller, QUOTA).await;
    let after = fire(&layer, caller, QUOTA as usize + 20).await;
    let rest = spend_the_rest(&[&layer], caller).await;
    assert_eq!(after.admitted + rest, QUOTA);
}

/// Waits until `copy` holds no slice (a slice given back has landed, or its listener heard of a
/// reset), or fails after 5 s.
async fn holds_nothing(copy: &RateLimitLayer<Header>) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    while copy.leases_unspent() > 0 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the copy still holds {} after 5 s",
            copy.leases_unspent()
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// A reset through one copy reaches the others' slices: they drop them, and the caller has its
/// whole quota, no more; a slice given back (a quiet refund) drops nobody's.
async fn a_reset_reaches_every_copys_slices(a: RateLimitLayer<Header>, b: RateLimitLayer<Header>) {
    let caller = unique("reset");
    for copy in [&a, &b] {
        for _ in 0..10 {
            assert_eq!(fire(copy, &caller, 1).await.admitted, 1);
        }
    }
    // slices fetched in the background land
    tokio::time::sleep(Duration::from_millis(300)).await;
    let held = b.leases_unspent();
    assert!(a.leases_unspent() > 0 && held > 0);
    // a slice given back is no reset: the other copy keeps its own
    a.give_back_leases().await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(b.leases_unspent(), held, "a quiet refund dropped a slice");
    for _ in 0..10 {
        assert_eq!(fire(&a, &caller, 1).await.admitted, 1);
    }
    assert!(a.leases_unspent() > 0);
    a.reset(key_of(&a, &caller)).await.unwrap();
    holds_nothing(&b).await;
    assert_eq!(a.leases_unspent(), 0);
    // and a's own listener hears it too before new slices are taken
    tokio::time::sleep(Duration::from_millis(300)).await;
    left_becomes(&b, &caller, QUOTA).await;
    let mut admitted = 0;
    for copy in [&a, &b] {
        admitted += fire(copy, &caller, QUOTA as usize).await.admitted;
    }
    admitted += spend_the_rest(&[&a, &b], &caller).await;
    assert_eq!(admitted, QUOTA);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_memory_a_reset_reaches_every_copys_slices() {
    let store = MemoryStore::new();
    let prefix = unique("lease");
    a_reset_reaches_every_copys_slices(
        copy(store.clone(), Algorithm::Gcra, &prefix),
        copy(store, Algorithm::Gcra, &prefix),
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_redis_a_reset_reaches_every_copys_slices() {
    let server = RedisServer::start();
    let prefix = unique("lease");
    a_reset_reaches_every_copys_slices(
        copy(server.store(), Algorithm::SlidingLog, &prefix),
        copy(server.store(), Algorithm::SlidingLog, &prefix),
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_postgres_a_reset_reaches_every_copys_slices() {
    let store = postgres::store().await;
    let prefix = unique("lease");
    a_reset_reaches_every_copys_slices(
        copy(store.clone(), Algorithm::SlidingCounter, &prefix),
        copy(store, Algorithm::SlidingCounter, &prefix),
    )
    .await;
}

/// A slice whose command is held by a partition and delivered after its deadline charges
/// nothing: the request it carried is refused as the failure policy says (`Deny`: `503`), the
/// late reservation changes nothing in the store, no phantom slice is held, and the caller's
/// requests go on — none waits on the lost fetch.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slice_held_by_a_partition_and_delivered_late_charges_nothing() {
    use crate::common::proxy::Proxy;
    use tollgate::rate_limit::OnStoreError;
    use tollgate::store::RedisStore;

    let server = RedisServer::start();
    let proxy = Proxy::start(server.addr()).await;
    let prefix = unique("lease");
    let late = RateLimitLayer::builder(
        RedisStore::builder(proxy.url())
            .timeout(Duration::from_millis(200))
            .build()
            .unwrap(),
    )
    .limit(Limit::per_day("api", QUOTA).leased())
    .algorithm(Algorithm::Gcra)
    .prefix(prefix.as_str())
    .key(Header::from_static("x-api-key"))
    .on_store_error(OnStoreError::Deny)
    .build()
    .unwrap();
    let direct = copy(server.store(), Algorithm::Gcra, &prefix);
    let caller = unique("held");
    // three requests checked one by one: the fourth takes a slice
    for _ in 0..3 {
        assert_eq!(fire(&late, &caller, 1).await.admitted, 1);
    }
    proxy.silence();
    let service = tower::Layer::layer(
        &late,
        tower::service_fn(|_: Request<()>| async { Ok::<_, Infallible>(Response::new(())) }),
    );
    let request = Request::get("/")
        .header("x-api-key", &caller)
        .body(())
        .unwrap();
    let refused = service.oneshot(request).await.unwrap();
    assert_eq!(refused.status(), StatusCode::SERVICE_UNAVAILABLE);
    // the slice may be charged once the partition lets it through: held while it is resolved
    assert!(shortfall_is_held(&late, &direct, &caller, 3).await > 0);
    tokio::time::sleep(Duration::from_millis(300)).await;
    proxy.unsilence();
    // the held reservation arrives past its deadline: the store has charged the three only
    tokio::time::sleep(Duration::from_millis(300)).await;
    left_becomes(&direct, &caller, QUOTA - 3).await;
    // resolved: the late answer installed no slice
    unspent_becomes(&late, 0).await;
    // the caller goes on: leased again, and charged exactly what was admitted
    let after = fire(&late, &caller, 20).await;
    assert_eq!(after.admitted, 20, "{after:?}");
    late.give_back_leases().await;
    left_becomes(&direct, &caller, QUOTA - 23).await;
}
