//! A leased limit stacked with a plain one, in both orders, on two copies of a service sharing
//! a store: the stack admits exactly what its tighter limit allows, and the leased limit, its
//! slices given back, is charged exactly for the requests it admitted — whichever layer is
//! outside.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::convert::Infallible;

use http::{Request, Response, StatusCode};
use tower::Layer;

use super::rate_limit_leases::{key_of, left_becomes, send, unique};
use crate::common::RedisServer;
use tollgate::key::Header;
use tollgate::rate_limit::{Algorithm, Limit, RateLimitLayer};
use tollgate::store::{MemoryStore, RateStore};

/// The leased limit's quota: ample beside the plain one's, and its slices (at most an eighth
/// of it per copy) never bring it below that.
const LEASED: u64 = 300;
/// The plain limit's quota: the stack's tighter limit.
const PLAIN: u64 = 100;
const PER_COPY: usize = 250;

/// Which of the two layers is the outer one.
#[derive(Debug, Clone, Copy)]
enum Outside {
    Leased,
    Plain,
}

/// One copy's two layers, keyed alike by `x-api-key`, each under a prefix of its own.
fn layers(store: &(impl RateStore + Clone), prefix: &str) -> [RateLimitLayer<Header>; 2] {
    let layer = |limit: Limit, name: &str| {
        RateLimitLayer::builder(store.clone())
            .limit(limit)
            .algorithm(Algorithm::SlidingCounter)
            .prefix(format!("{prefix}-{name}"))
            .key(Header::from_static("x-api-key"))
            .build()
            .unwrap()
    };
    [
        layer(Limit::per_day("leased", LEASED).leased(), "leased"),
        layer(Limit::per_day("plain", PLAIN), "plain"),
    ]
}

/// `n` requests of `caller` through the stack of `leased` and `plain`, `outside` first, 32 at
/// a time: how many were admitted, and how many of the denials came from the outer layer
/// (the inner one never saw them).
async fn fire(
    [leased, plain]: &[RateLimitLayer<Header>; 2],
    outside: Outside,
    caller: &str,
    n: usize,
) -> (u64, u64) {
    let handler =
        tower::service_fn(|_: Request<()>| async { Ok::<_, Infallible>(Response::new(())) });
    let (outer, inner) = match outside {
        Outside::Leased => (leased, plain),
        Outside::Plain => (plain, leased),
    };
    let service = outer.layer(inner.layer(handler));
    let inner_limit = match outside {
        Outside::Leased => "\"plain\"",
        Outside::Plain => "\"leased\"",
    };
    let (mut admitted, mut by_outer) = (0, 0);
    for reply in send(&service, caller, n).await {
        match reply.status() {
            StatusCode::OK => admitted += 1,
            StatusCode::TOO_MANY_REQUESTS => {
                // a denial of the inner layer carries its policy (and the outer one's after
                // it); one of the outer layer, only the outer one's
                let policy = reply.headers()["ratelimit-policy"].to_str().unwrap();
                if !policy.contains(inner_limit) {
                    by_outer += 1;
                }
            }
            other => panic!("unexpected status {other}"),
        }
    }
    (admitted, by_outer)
}

async fn stacked_in_both_orders(store: impl RateStore + Clone) {
    for outside in [Outside::Leased, Outside::Plain] {
        let prefix = unique("stacked");
        let copies = [layers(&store, &prefix), layers(&store, &prefix)];
        let caller = unique("caller");
        let fired = futures_util::future::join_all(
            copies.iter().map(|c| fire(c, outside, &caller, PER_COPY)),
        )
        .await;
        let admitted: u64 = fired.iter().map(|f| f.0).sum();
        let by_outer: u64 = fired.iter().map(|f| f.1).sum();
        assert_eq!(admitted, PLAIN, "{outside:?} outside: {fired:?}");
        for [leased, _] in &copies {
            leased.give_back_leases().await;
        }
        // what reached the leased limit and was admitted by it
        let through_leased = match outside {
            // the leased layer denied `by_outer`; the plain one the rest of the denials
            Outside::Leased => (2 * PER_COPY) as u64 - by_outer,
            // only what the plain layer admitted reached the leased one, which admitted all
            Outside::Plain => {
                assert_eq!(by_outer, (2 * PER_COPY) as u64 - PLAIN, "{fired:?}");
                PLAIN
            }
        };
        assert!(
            through_leased <= LEASED,
            "{outside:?}: {through_leased} through"
        );
        // the settlements that give the slices back land in the background
        left_becomes(&copies[1][0], &caller, LEASED - through_leased).await;
        let plain = &copies[0][1];
        let key = key_of(plain, &caller);
        assert_eq!(plain.peek(key).await.unwrap().limits[0].remaining, 0);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_memory_a_leased_limit_stacks_in_both_orders() {
    stacked_in_both_orders(MemoryStore::new()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_redis_a_leased_limit_stacks_in_both_orders() {
    let server = RedisServer::start();
    stacked_in_both_orders(server.store()).await;
}
