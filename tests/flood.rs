//! A flood of new callers during an outage, against the example app with `fallback:2`: the
//! local fallback fills to its cap (65,536 callers) and the app's memory stays flat after. One
//! test in a binary of its own, so that its resident memory is its own.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

#[path = "../examples/app/router.rs"]
pub mod app;
#[path = "../examples/shared/env.rs"]
pub mod env;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::extract::ConnectInfo;
use http::{Request, StatusCode};
use tollgate::rate_limit::OnStoreError;
use tollgate::store::{RedisStore, Store};
use tower::ServiceExt;

/// This process's resident memory, in KiB (Linux).
fn rss_kib() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flood_of_new_callers_in_an_outage_keeps_memory_flat_at_the_fallback_cap() {
    // a store nobody answers: a port with no server
    let port = common::free_port();
    let store = RedisStore::builder(format!("redis://127.0.0.1:{port}/"))
        .timeout(Duration::from_millis(50))
        .build()
        .unwrap();
    let store: Arc<dyn Store> = Arc::new(store);
    let vars = [
        ("APP_LIMITS", "minute:100/60s"),
        ("APP_ON_STORE_ERROR", "fallback:2"),
    ];
    let config = app::AppConfig::from_lookup(|name: &str| {
        vars.iter()
            .find(|(n, _)| *n == name)
            .map(|(_, v)| (*v).to_owned())
    })
    .unwrap();
    assert_eq!(
        config.on_store_error,
        OnStoreError::LocalFallback { copies: 2 }
    );
    let router = app::router(app::AppState::new(store, config).unwrap());
    let flood = |from: u32, to: u32| {
        let router = router.clone();
        async move {
            let mut statuses = [0usize; 2]; // admitted, denied
            for batch in (from..to).collect::<Vec<_>>().chunks(2_000) {
                let calls = batch.iter().map(|i| {
                    // anonymous callers, each from an address of its own
                    let [_, a, b, c] = i.to_be_bytes();
                    let peer = SocketAddr::from(([10, a, b, c], 1));
                    let mut req = Request::get("/api/hello").body(Body::empty()).unwrap();
                    req.extensions_mut().insert(ConnectInfo(peer));
                    router.clone().oneshot(req)
                });
                for response in futures_util::future::join_all(calls).await {
                    match response.unwrap().status() {
                        StatusCode::OK => statuses[0] += 1,
                        StatusCode::TOO_MANY_REQUESTS => statuses[1] += 1,
                        other => panic!("a flooding caller got {other}"),
                    }
                }
            }
            statuses
        }
    };
    let before = rss_kib();
    let filling = flood(0, 70_000).await;
    let full = rss_kib();
    let beyond = flood(70_000, 140_000).await;
    let after = rss_kib();
    println!(
        "resident memory: {before} KiB before, {full} KiB after 70,000 new callers \
         ({filling:?} admitted/denied), {after} KiB after 70,000 more ({beyond:?})"
    );
    // the fallback holds 65,536 callers: the first flood fills it, the second finds it full
    assert_eq!(
        filling,
        [65_536, 70_000 - 65_536],
        "admitted exactly the cap"
    );
    assert_eq!(beyond, [0, 70_000], "a full fallback denies new callers");
    assert!(
        after.saturating_sub(full) < 16 * 1024,
        "memory grew by {} KiB once the cap was reached",
        after.saturating_sub(full)
    );
}
