//! The limits in force kept in the store (`build_in_store`), on every backend: copies built
//! with different limits admit exactly the quota in force; a higher revision replaces the
//! defaults on every copy, a roll-back does not; an override or a tier's replacement made
//! through one copy governs the other within its refresh; a lowered leased quota admits no
//! more than the new quota once the old window has passed; a refused change changes nothing.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::convert::Infallible;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use http::{Request, Response, StatusCode};
use tokio::sync::Semaphore;
use tokio::task::JoinSet;
use tower::{Layer, ServiceExt, service_fn};

use super::rate_limit_leases::{fire, key_of, one, unique};
use crate::common::cluster::RedisCluster;
use crate::common::{RedisServer, postgres};
use tollgate::ConfigErrorKind;
use tollgate::concurrency::{ConcurrencyLimitLayer, ConcurrencyLimitLayerBuilder};
use tollgate::key::Header;
use tollgate::rate_limit::{
    Changed, Limit, LimitsError, RateLimitLayer, RateLimitLayerBuilder, StoreLimits,
};
use tollgate::store::{MemoryStore, PermitStore, RateStore};

/// How often the copies of these tests read the limits in force again.
const REFRESH: Duration = Duration::from_millis(200);
/// The most a read of the limits takes on these servers, twice over: a change is in force on
/// every copy within [`REFRESH`] plus this.
const ROUND_TRIPS: Duration = Duration::from_millis(400);

/// A copy of `quota` requests per ten minutes (one window for the test) per `x-api-key`.
fn copy(store: impl RateStore, prefix: &str, quota: u64) -> RateLimitLayerBuilder<Header> {
    RateLimitLayer::builder(store)
        .limit(Limit::new("api", quota, Duration::from_secs(600)))
        .prefix(prefix)
        .key(Header::from_static("x-api-key"))
        .limits_refresh(REFRESH)
}

/// `n` requests of `caller` through each of `a` and `b` at once: how many were admitted.
async fn admitted(a: &RateLimitLayer<Header>, b: &RateLimitLayer<Header>, caller: &str) -> u64 {
    let (a, b) = tokio::join!(fire(a, caller, 100), fire(b, caller, 100));
    a.admitted + b.admitted
}

fn limits(copy: &RateLimitLayer<Header>) -> StoreLimits {
    copy.limits().expect("built in the store")
}

/// Two copies built with different limits: the first seeds the store, the second decides with
/// the store's; 200 requests of one caller spread over both admit exactly its quota.
async fn copies_built_otherwise_admit_the_quota_in_force(make: impl Fn() -> S) {
    let prefix = unique("lim");
    let a = copy(make(), &prefix, 10).build_in_store().await.unwrap();
    let b = copy(make(), &prefix, 20).build_in_store().await.unwrap();
    assert_eq!(b.policy().limits()[0].quota(), 10);
    assert_eq!(limits(&b).in_force().version, 1);
    assert_eq!(admitted(&a, &b, "alice").await, 10);
    // both registered; the one built with other limits is told apart
    let in_force = limits(&a).in_force().table.defaults_id();
    let copies = limits(&a).copies().await.unwrap();
    assert_eq!(copies.len(), 2, "{copies:?}");
    let drifting = copies.iter().filter(|c| c.built != in_force).count();
    assert_eq!(drifting, 1, "{copies:?}");
}

/// A copy of a higher revision replaces the defaults: every copy decides with them within its
/// refresh, and 200 requests admit exactly the new quota; a copy of the lower revision started
/// afterwards (a roll-back) decides with them too.
async fn a_higher_revision_replaces_the_defaults(make: impl Fn() -> S) {
    let prefix = unique("lim");
    let old = copy(make(), &prefix, 10).build_in_store().await.unwrap();
    let new = copy(make(), &prefix, 20)
        .limits_revision(1)
        .build_in_store()
        .await
        .unwrap();
    assert_eq!(limits(&new).in_force().version, 2);
    tokio::time::sleep(REFRESH + ROUND_TRIPS).await;
    assert_eq!(limits(&old).in_force().version, 2);
    assert_eq!(old.policy().limits()[0].quota(), 20);
    assert_eq!(admitted(&old, &new, "alice").await, 20);
    let rolled_back = copy(make(), &prefix, 10).build_in_store().await.unwrap();
    assert_eq!(rolled_back.policy().limits()[0].quota(), 20);
    assert_eq!(limits(&rolled_back).in_force().version, 2);
}

/// An override set through one copy is in force there at once and on the other within its
/// refresh; what the caller spent stays spent when it is taken away.
async fn an_override_governs_every_copy(make: impl Fn() -> S) {
    let prefix = unique("lim");
    let a = copy(make(), &prefix, 10).build_in_store().await.unwrap();
    let b = copy(make(), &prefix, 10).build_in_store().await.unwrap();
    let acme = key_of(&a, "acme");
    let plan = vec![Limit::new("api", 3, Duration::from_secs(600))];
    let changed = limits(&a)
        .set_caller(acme, plan, "acme pays less")
        .await
        .unwrap();
    assert_eq!(changed, Changed::Saved(2));
    assert_eq!(fire(&a, "acme", 10).await.admitted, 3);
    tokio::time::sleep(REFRESH + ROUND_TRIPS).await;
    assert_eq!(fire(&b, "acme", 10).await.admitted, 0);
    // other callers keep the tier's limits
    assert_eq!(fire(&b, "bob", 20).await.admitted, 10);
    // taken back through b: at once there, within the refresh on a; 3 of 10 spent
    let changed = limits(&b).unset_caller(acme, "back").await.unwrap();
    assert_eq!(changed, Changed::Saved(3));
    assert_eq!(fire(&b, "acme", 5).await.admitted, 5);
    tokio::time::sleep(REFRESH + ROUND_TRIPS).await;
    assert_eq!(fire(&a, "acme", 5).await.admitted, 2);
    let history = limits(&a).history().await.unwrap();
    let notes: Vec<&str> = history.iter().map(|c| c.note.as_str()).collect();
    assert_eq!(notes, ["back", "acme pays less", "defaults of revision 0"]);
}

/// A change saved through one copy reaches the other by the store's broadcast (Redis Pub/Sub,
/// PostgreSQL `NOTIFY`, in process), long before its refresh.
async fn a_change_reaches_every_copy_by_the_broadcast(make: impl Fn() -> S) {
    let prefix = unique("lim");
    let slow = Duration::from_secs(60);
    let a = copy(make(), &prefix, 10)
        .limits_refresh(slow)
        .build_in_store()
        .await
        .unwrap();
    let b = copy(make(), &prefix, 10)
        .limits_refresh(slow)
        .build_in_store()
        .await
        .unwrap();
    // the subscription of b is made when it starts: give it a moment to listen
    tokio::time::sleep(Duration::from_millis(300)).await;
    let acme = key_of(&a, "acme");
    let plan = vec![Limit::new("api", 3, Duration::from_secs(600))];
    limits(&a).set_caller(acme, plan, "").await.unwrap();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(3);
    while limits(&b).in_force().version < 2 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "b did not hear of the change"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(fire(&b, "acme", 10).await.admitted, 3);
}

/// A leased quota lowered through one copy: every copy gives back its slices, and once the
/// old window has passed the two copies admit no more than the new quota, exactly it once
/// their slices are given back.
async fn a_lowered_leased_quota_holds_from_the_next_window(make: impl Fn() -> S) {
    const WINDOW: Duration = Duration::from_secs(2);
    let prefix = unique("lim");
    let leased = |store, quota| {
        RateLimitLayer::builder(store)
            .limit(Limit::new("api", quota, WINDOW).leased())
            .prefix(&prefix)
            .key(Header::from_static("x-api-key"))
            .limits_refresh(REFRESH)
    };
    let a = leased(make(), 100).build_in_store().await.unwrap();
    let b = leased(make(), 100).build_in_store().await.unwrap();
    assert_eq!(fire(&a, "alice", 30).await.admitted, 30);
    let lower = vec![Limit::new("api", 10, WINDOW).leased()];
    limits(&a).set_tier(None, lower, "lowered").await.unwrap();
    tokio::time::sleep(REFRESH + ROUND_TRIPS + WINDOW).await;
    assert_eq!(b.policy().limits()[0].quota(), 10);
    let first = admitted(&a, &b, "alice").await;
    assert!(first <= 10, "{first} admitted of a quota of 10");
    a.give_back_leases().await;
    b.give_back_leases().await;
    let rest = admitted(&a, &b, "alice").await;
    assert_eq!(first + rest, 10);
}

/// Changes the layer cannot build, or that name nothing, are refused with the reason; the
/// limits in force, their version and history stay.
async fn a_refused_change_changes_nothing(make: impl Fn() -> S) {
    let prefix = unique("lim");
    let copy = copy(make(), &prefix, 10)
        .tier("pro", [Limit::new("api", 50, Duration::from_secs(600))])
        .tier_by(|parts| parts.headers.get("x-plan")?.to_str().ok())
        .build_in_store()
        .await
        .unwrap();
    let limits = limits(&copy);
    let acme = key_of(&copy, "acme");
    let minute = |quota| vec![Limit::per_minute("api", quota)];
    let refused = |result: Result<Changed, LimitsError>| match result {
        Err(LimitsError::Invalid(e)) => {
            assert_eq!(e.kind(), ConfigErrorKind::Limit);
            e.to_string()
        }
        other => panic!("expected a refusal, got {other:?}"),
    };
    let zero = refused(limits.set_caller(acme, minute(0), "").await);
    assert!(zero.contains("quota"), "{zero}");
    let twice = vec![Limit::per_minute("api", 1), Limit::per_hour("api", 2)];
    let twice = refused(limits.set_caller(acme, twice, "").await);
    assert!(twice.contains("used twice"), "{twice}");
    let gold = refused(limits.set_tier(Some("gold"), minute(5), "").await);
    assert!(gold.contains("unknown tier \"gold\""), "{gold}");
    let unset = refused(limits.unset_caller(acme, "").await);
    assert!(unset.contains("has no limits of its own"), "{unset}");
    let unset = refused(limits.unset_tier(Some("pro"), "").await);
    assert!(unset.contains("tier \"pro\" is not replaced"), "{unset}");
    assert_eq!(limits.refresh().await.unwrap(), 1);
    assert_eq!(limits.history().await.unwrap().len(), 1);
    // and a change made twice is saved once
    let pro = minute(7);
    assert_eq!(
        limits.set_tier(Some("pro"), pro.clone(), "").await.unwrap(),
        Changed::Saved(2)
    );
    assert_eq!(
        limits.set_tier(Some("pro"), pro, "").await.unwrap(),
        Changed::Unchanged(2)
    );
    assert_eq!(copy.tier_policy("pro").limits()[0].quota(), 7);
    assert_eq!(one(&copy, "bob").await.0, StatusCode::OK);
}

/// A concurrency limit of `limit` requests in flight per `x-api-key`.
fn cc_copy(store: S, prefix: &str, limit: u32) -> ConcurrencyLimitLayerBuilder<Header> {
    ConcurrencyLimitLayer::builder(store)
        .limit(limit)
        .prefix(prefix)
        .key(Header::from_static("x-api-key"))
        .limits_refresh(REFRESH)
}

/// Requests held in flight until [`release`](Self::release)d.
struct Flight {
    entered: Arc<AtomicUsize>,
    refused: Arc<AtomicUsize>,
    gate: Arc<Semaphore>,
    tasks: JoinSet<StatusCode>,
    sent: usize,
}

impl Flight {
    /// `n` requests of `caller` through each copy at once, each held by its handler until
    /// released; returns once every one was admitted (and is held) or refused.
    async fn hold(copies: &[&ConcurrencyLimitLayer<Header>], caller: &str, n: usize) -> Self {
        let entered = Arc::new(AtomicUsize::new(0));
        let refused = Arc::new(AtomicUsize::new(0));
        let gate = Arc::new(Semaphore::new(0));
        let handler = {
            let (entered, gate) = (Arc::clone(&entered), Arc::clone(&gate));
            service_fn(move |_: Request<String>| {
                let (entered, gate) = (Arc::clone(&entered), Arc::clone(&gate));
                async move {
                    entered.fetch_add(1, Ordering::SeqCst);
                    let _open = gate.acquire().await;
                    Ok::<_, Infallible>(Response::new(String::new()))
                }
            })
        };
        let mut tasks = JoinSet::new();
        for _ in 0..n {
            for copy in copies {
                let service = copy.layer(handler.clone());
                let request = Request::builder()
                    .header("x-api-key", caller)
                    .body(String::new())
                    .unwrap();
                let refused = Arc::clone(&refused);
                tasks.spawn(async move {
                    let status = service.oneshot(request).await.unwrap().status();
                    if status != StatusCode::OK {
                        refused.fetch_add(1, Ordering::SeqCst);
                    }
                    status
                });
            }
        }
        let flight = Self {
            entered,
            refused,
            gate,
            tasks,
            sent: n * copies.len(),
        };
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        while flight.held() + flight.refused() < flight.sent {
            assert!(
                tokio::time::Instant::now() < deadline,
                "requests neither held nor refused"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        flight
    }

    fn held(&self) -> usize {
        self.entered.load(Ordering::SeqCst)
    }

    fn refused(&self) -> usize {
        self.refused.load(Ordering::SeqCst)
    }

    /// Lets the held requests finish, and waits until the store holds none of `caller`'s
    /// permits: how many were answered 200.
    async fn release(mut self, store: &S, prefix: &str, caller: &str) -> usize {
        self.gate.add_permits(self.sent);
        let mut ok = 0;
        while let Some(status) = self.tasks.join_next().await {
            let status = status.unwrap();
            assert!(
                status == StatusCode::OK || status == StatusCode::TOO_MANY_REQUESTS,
                "{status}"
            );
            ok += usize::from(status == StatusCode::OK);
        }
        let key = Header::from_static("x-api-key").key(caller.as_bytes());
        let permits = tollgate::store::keys::permits(prefix, &key).unwrap();
        let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
        while store.permit_usage(&permits).await.unwrap().in_use() > 0 {
            assert!(
                tokio::time::Instant::now() < deadline,
                "permits not given back"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        ok
    }
}

/// A concurrency limit in the store: two copies built with other limits hold exactly the limit
/// in force in flight; a caller's own limit set through one copy governs the other within its
/// refresh; lowered while requests are in flight, it takes none back and admits none until
/// fewer than the new limit are.
async fn a_concurrency_limit_in_force_governs_every_copy(make: impl Fn() -> S) {
    let prefix = unique("lim");
    let store = make();
    let a = cc_copy(make(), &prefix, 2).build_in_store().await.unwrap();
    let b = cc_copy(make(), &prefix, 5).build_in_store().await.unwrap();
    assert_eq!((a.limit(), b.limit()), (2, 2));
    let flight = Flight::hold(&[&a, &b], "alice", 10).await;
    assert_eq!((flight.held(), flight.refused()), (2, 18));
    assert_eq!(flight.release(&store, &prefix, "alice").await, 2);

    let alice = Header::from_static("x-api-key").key(b"alice");
    let cc_limits = a.limits().unwrap();
    let changed = cc_limits.set_caller(alice, 4, "alice runs batches").await;
    assert_eq!(changed.unwrap(), Changed::Saved(2));
    tokio::time::sleep(REFRESH + ROUND_TRIPS).await;
    assert_eq!(b.caller_limit(alice), 4);
    let flight = Flight::hold(&[&a, &b], "alice", 10).await;
    assert_eq!((flight.held(), flight.refused()), (4, 16));
    // bob keeps the layer's limit
    let bob = Flight::hold(&[&b], "bob", 5).await;
    assert_eq!((bob.held(), bob.refused()), (2, 3));
    assert_eq!(bob.release(&store, &prefix, "bob").await, 2);

    // lowered through b while alice holds 4 in flight: none is taken back, none more admitted
    let lowered = b.limits().unwrap().set_caller(alice, 1, "").await;
    assert_eq!(lowered.unwrap(), Changed::Saved(3));
    tokio::time::sleep(REFRESH + ROUND_TRIPS).await;
    assert_eq!(a.caller_limit(alice), 1);
    let more = Flight::hold(&[&a, &b], "alice", 5).await;
    assert_eq!((more.held(), more.refused()), (0, 10));
    assert_eq!(flight.release(&store, &prefix, "alice").await, 4);
    assert_eq!(more.release(&store, &prefix, "alice").await, 0);
    let after = Flight::hold(&[&a, &b], "alice", 5).await;
    assert_eq!((after.held(), after.refused()), (1, 9));
    assert_eq!(after.release(&store, &prefix, "alice").await, 1);
    let notes: Vec<String> = cc_limits
        .history()
        .await
        .unwrap()
        .into_iter()
        .map(|c| c.note)
        .collect();
    assert_eq!(notes, ["", "alice runs batches", "defaults of revision 0"]);
    // a limit of zero, or a tier the layer does not have, is refused
    assert!(matches!(
        cc_limits.set_caller(alice, 0, "").await,
        Err(LimitsError::Invalid(_))
    ));
    assert!(matches!(
        cc_limits.set_tier(Some("gold"), 3, "").await,
        Err(LimitsError::Invalid(_))
    ));
    assert_eq!(cc_limits.refresh().await.unwrap(), 3);
}

/// A concurrency limit's change saved through one copy reaches the other by the store's
/// broadcast, long before its refresh.
async fn a_concurrency_change_reaches_every_copy_by_the_broadcast(make: impl Fn() -> S) {
    let prefix = unique("lim");
    let slow = Duration::from_secs(60);
    let a = cc_copy(make(), &prefix, 2)
        .limits_refresh(slow)
        .build_in_store()
        .await
        .unwrap();
    let b = cc_copy(make(), &prefix, 2)
        .limits_refresh(slow)
        .build_in_store()
        .await
        .unwrap();
    // the subscription of b is made when it starts: give it a moment to listen
    tokio::time::sleep(Duration::from_millis(300)).await;
    let alice = Header::from_static("x-api-key").key(b"alice");
    let changed = a.limits().unwrap().set_caller(alice, 7, "").await.unwrap();
    assert_eq!(changed, Changed::Saved(2));
    let deadline = tokio::time::Instant::now() + Duration::from_secs(3);
    while b.caller_limit(alice) != 7 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "b did not hear of the change"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(b.limits().unwrap().in_force().version, 2);
}

/// What the tests' stores are: both a rate store and a permit store.
trait Store: RateStore + PermitStore {}
impl<T: RateStore + PermitStore> Store for T {}

/// The store every copy of a test is built on, each copy with a handle of its own.
type S = Arc<dyn Store>;

/// One test per backend of each rule above.
macro_rules! on_every_backend {
    ($($rule:ident),* $(,)?) => {
        mod in_memory {
            use super::*;
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $rule() {
                    let store = MemoryStore::new();
                    super::$rule(|| Arc::new(store.clone()) as S).await;
                }
            )*
        }
        mod on_redis {
            use super::*;
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $rule() {
                    let server = RedisServer::start();
                    super::$rule(|| Arc::new(server.store()) as S).await;
                }
            )*
        }
        mod on_cluster {
            use super::*;
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $rule() {
                    let store = RedisCluster::shared().store().await;
                    super::$rule(|| Arc::new(store.clone()) as S).await;
                }
            )*
        }
        mod on_postgres {
            use super::*;
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $rule() {
                    let store = postgres::store().await;
                    super::$rule(|| Arc::new(store.clone()) as S).await;
                }
            )*
        }
    };
}

on_every_backend!(
    copies_built_otherwise_admit_the_quota_in_force,
    a_higher_revision_replaces_the_defaults,
    an_override_governs_every_copy,
    a_change_reaches_every_copy_by_the_broadcast,
    a_lowered_leased_quota_holds_from_the_next_window,
    a_refused_change_changes_nothing,
    a_concurrency_limit_in_force_governs_every_copy,
    a_concurrency_change_reaches_every_copy_by_the_broadcast,
);

/// A copy that cannot read the store at its start is built all the same, and decides with its
/// own limits (its checks go to the same store, so its failure policy decides them meanwhile);
/// a change through it fails with the store's error and changes nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_copy_that_cannot_read_the_store_decides_with_its_own_limits() {
    // nothing listens on port 1: every call is refused at once
    let store = tollgate::store::RedisStore::builder("redis://127.0.0.1:1/")
        .timeout(Duration::from_millis(300))
        .build()
        .unwrap();
    let copy = copy(store, &unique("lim"), 7)
        .build_in_store()
        .await
        .unwrap();
    assert_eq!(copy.policy().limits()[0].quota(), 7);
    assert_eq!(limits(&copy).in_force().version, 0);
    let acme = key_of(&copy, "acme");
    let changed = limits(&copy)
        .set_caller(acme, vec![Limit::per_minute("api", 1)], "")
        .await;
    assert!(matches!(changed, Err(LimitsError::Store(_))), "{changed:?}");
    assert_eq!(limits(&copy).in_force().version, 0);
    assert_eq!(copy.policy().limits()[0].quota(), 7);
}

/// A copy of an earlier version, which does not name a tier that a later one added and an
/// operator replaced, still takes every other change of the table.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tier_another_version_added_leaves_the_rest_in_force() {
    let store = MemoryStore::new();
    let prefix = unique("lim");
    let tiered = |store: MemoryStore, tiers: &[&str]| {
        let mut builder = copy(store, &prefix, 10);
        for tier in tiers {
            builder = builder.tier(*tier, [Limit::new("api", 50, Duration::from_secs(600))]);
        }
        builder.tier_by(|parts| parts.headers.get("x-plan")?.to_str().ok())
    };
    let old = tiered(store.clone(), &["pro"])
        .build_in_store()
        .await
        .unwrap();
    let new = tiered(store.clone(), &["pro", "gold"])
        .limits_revision(1)
        .build_in_store()
        .await
        .unwrap();
    let gold = vec![Limit::new("api", 500, Duration::from_secs(600))];
    limits(&new).set_tier(Some("gold"), gold, "").await.unwrap();
    let own = vec![Limit::new("api", 3, Duration::from_secs(600))];
    limits(&new).set_tier(None, own, "").await.unwrap();
    assert_eq!(limits(&old).refresh().await.unwrap(), 4);
    assert_eq!(old.policy().limits()[0].quota(), 3);
    // and its own changes are saved beside the tier it does not know
    let pro = vec![Limit::new("api", 70, Duration::from_secs(600))];
    assert_eq!(
        limits(&old).set_tier(Some("pro"), pro, "").await.unwrap(),
        Changed::Saved(5)
    );
    let table = limits(&new).in_force().table;
    assert_eq!(table.for_tier(Some("gold")).unwrap()[0].quota(), 500);
}

/// Behind Sentinel (the primary the sentinels name): copies built otherwise admit the quota in
/// force, and a change reaches the other copy by the broadcast.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn behind_sentinel_the_quota_in_force_and_its_changes_hold() {
    let setup = crate::common::sentinel::SentinelSetup::start_with("tollgate-limits", 1).await;
    let store =
        tollgate::store::RedisStore::sentinel_builder(setup.sentinel_urls(), setup.master_name())
            .timeout(Duration::from_secs(2))
            .connect()
            .await
            .unwrap();
    copies_built_otherwise_admit_the_quota_in_force(|| Arc::new(store.clone()) as S).await;
    a_change_reaches_every_copy_by_the_broadcast(|| Arc::new(store.clone()) as S).await;
}

/// A store that loses the limits in force (restarted empty) gets back those the copies held,
/// saved anew as version 1; a change saved after governs every copy, though each held a higher
/// version before.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_that_lost_the_limits_gets_them_back_and_later_changes_hold() {
    let mut server = RedisServer::start();
    let prefix = unique("lim");
    let a = copy(server.store(), &prefix, 10)
        .build_in_store()
        .await
        .unwrap();
    let b = copy(server.store(), &prefix, 10)
        .build_in_store()
        .await
        .unwrap();
    let acme = key_of(&a, "acme");
    let plan = |quota| vec![Limit::new("api", quota, Duration::from_secs(600))];
    limits(&a).set_caller(acme, plan(3), "").await.unwrap();
    limits(&a).set_caller(acme, plan(4), "").await.unwrap();
    tokio::time::sleep(REFRESH + ROUND_TRIPS).await;
    assert_eq!(limits(&b).in_force().version, 3);

    server.restart();
    let namespace = tollgate::store::keys::rate_namespace(&prefix).unwrap();
    let probe = server.store();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    let restored = loop {
        let read = probe.limits_store().unwrap().load_limits(&namespace).await;
        if let Ok(Some(stored)) = read {
            break stored;
        }
        assert!(tokio::time::Instant::now() < deadline, "not restored");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(restored.version, 1);
    assert_eq!(restored.table.for_caller(acme).unwrap()[0].quota(), 4);
    let history = probe.limits_store().unwrap().limits_history(&namespace);
    let history = history.await.unwrap();
    assert_eq!(history.len(), 1);
    assert_eq!(history[0].note, "restored by a copy that held version 3");
    tokio::time::sleep(REFRESH + ROUND_TRIPS).await;
    assert_eq!(limits(&a).in_force().version, 1);
    assert_eq!(limits(&b).in_force().version, 1);

    let changed = limits(&a).set_caller(acme, plan(6), "").await.unwrap();
    assert_eq!(changed, Changed::Saved(2));
    tokio::time::sleep(REFRESH + ROUND_TRIPS).await;
    assert_eq!(limits(&b).in_force().version, 2);
    assert_eq!(fire(&b, "acme", 10).await.admitted, 6);
}
