//! `tollgate limits` run as a binary against two copies of a service that keep their limits in
//! the store (`build_in_store`), on a throwaway `redis-server` and PostgreSQL: no limits file;
//! a change made by the tool governs both copies within their refresh; what names nothing
//! exits 1, and a refused change exits 2 and changes nothing.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::*;
use http::StatusCode;
use tollgate::key::Header;
use tollgate::rate::Limit;
use tollgate::rate_limit::RateLimitLayer;
use tollgate::store::{PgStore, RateStore, RedisStore};
use tollgate::testing::{PgServer, RedisServer};

const REFRESH: Duration = Duration::from_millis(100);

/// A copy of the service: 5 a minute per `x-api-key`, a tier `pro` of 50, under prefix `svc`.
async fn copy(store: Arc<dyn RateStore>, quota: u64) -> RateLimitLayer<Header> {
    RateLimitLayer::builder(store)
        .limit(Limit::per_minute("minute", quota))
        .tier("pro", [Limit::per_minute("minute", 50)])
        .tier_by(|parts| parts.headers.get("x-plan")?.to_str().ok())
        .prefix("svc")
        .key(Header::from_static("x-api-key"))
        .limits_refresh(REFRESH)
        .build_in_store()
        .await
        .unwrap()
}

/// `n` requests of `caller` through each copy: how many were admitted.
async fn admitted(copies: &[RateLimitLayer<Header>; 2], caller: &str, n: usize) -> usize {
    let mut admitted = 0;
    for _ in 0..n {
        for copy in copies {
            if call(copy, &[("x-api-key", caller)], None).await == StatusCode::OK {
                admitted += 1;
            }
        }
    }
    admitted
}

/// The whole round of the tool against `store_args` (the service's store), its copies `copies`.
async fn the_tool_reads_and_changes_the_limits(
    store_args: &[&str],
    copies: [RateLimitLayer<Header>; 2],
) {
    // `tollgate <command> <store args> <rest>`
    let tool = |command: &[&str], rest: &[&str]| {
        let mut args = command.to_vec();
        args.extend_from_slice(store_args);
        args.extend_from_slice(rest);
        let args: Vec<String> = args.into_iter().map(str::to_owned).collect();
        async move {
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            tollgate(&args).await
        }
    };
    let run = |extra: &[&str]| tool(&["limits", extra[0]], &extra[1..]);
    // the copy built with 9 decides with the 5 the first one seeded
    let shown = run(&["show", "--prefix", "svc"]).await;
    assert_eq!(shown.code, 0, "{shown:?}");
    assert!(
        shown
            .stdout
            .contains("limits   svc:rl (sliding-log), version 1"),
        "{shown:?}"
    );
    assert!(
        shown.stdout.contains("minute                5/1m"),
        "{shown:?}"
    );
    assert!(
        shown.stdout.contains("callers with limits of their own: 0"),
        "{shown:?}"
    );
    assert!(
        shown
            .stdout
            .contains("copies seen lately: 2 (1 built with other defaults"),
        "{shown:?}"
    );

    let set = run(&[
        "set",
        "--prefix",
        "svc",
        "--header",
        "x-api-key=acme",
        "--limit",
        "minute:2/60s",
        "--note",
        "acme trial",
    ])
    .await;
    assert_eq!(set.code, 0, "{set:?}");
    assert!(
        set.stdout.starts_with("saved as version 2 of svc:rl"),
        "{set:?}"
    );
    assert!(
        !format!("{set:?}").contains("acme"),
        "the caller's value shows: {set:?}"
    );
    tokio::time::sleep(REFRESH * 5).await;
    assert_eq!(admitted(&copies, "acme", 3).await, 2);
    assert_eq!(admitted(&copies, "bob", 3).await, 5);

    let tier = run(&[
        "set",
        "--prefix",
        "svc",
        "--tier",
        "pro",
        "--limit",
        "minute:70/60s",
    ])
    .await;
    assert_eq!(tier.code, 0, "{tier:?}");
    tokio::time::sleep(REFRESH * 5).await;
    for copy in &copies {
        assert_eq!(copy.tier_policy("pro").limits()[0].quota(), 70);
    }
    let caller = run(&["show", "--prefix", "svc", "--header", "x-api-key=acme"]).await;
    assert!(
        caller.stdout.contains("minute                2/1m"),
        "{caller:?}"
    );

    // what names nothing: exit 1, saying what was looked for
    let nobody = run(&["unset", "--prefix", "svc", "--header", "x-api-key=nobody"]).await;
    assert_eq!(nobody.code, 1, "{nobody:?}");
    assert!(
        nobody.stderr.contains("has no limits of its own"),
        "{nobody:?}"
    );
    let other = run(&["show", "--prefix", "svx"]).await;
    assert_eq!(other.code, 1, "{other:?}");
    assert!(
        other.stderr.contains("no limits in force under svx:rl"),
        "{other:?}"
    );
    // refused: exit 2, nothing changed
    let gold = run(&[
        "set",
        "--prefix",
        "svc",
        "--tier",
        "gold",
        "--limit",
        "minute:1/60s",
    ])
    .await;
    assert_eq!(gold.code, 2, "{gold:?}");
    assert!(
        gold.stderr
            .contains("unknown tier \"gold\" (the layer's tiers: pro)"),
        "{gold:?}"
    );
    let zero = run(&["set", "--prefix", "svc", "--limit", "minute:0/60s"]).await;
    assert_eq!(zero.code, 2, "{zero:?}");
    assert!(zero.stderr.contains("refused, nothing changed"), "{zero:?}");

    let unset = run(&[
        "unset",
        "--prefix",
        "svc",
        "--header",
        "x-api-key=acme",
        "--note",
        "trial over",
    ])
    .await;
    assert_eq!(unset.code, 0, "{unset:?}");
    tokio::time::sleep(REFRESH * 5).await;
    // back to the tier's 5 a minute, 2 spent
    assert_eq!(admitted(&copies, "acme", 3).await, 3);

    // inspect and reset read the limits in force: no limits file
    let inspect = |who: &str| {
        tool(
            &["inspect"],
            &["--prefix", "svc", "--header", who, "--json"],
        )
    };
    let bob = inspect("x-api-key=bob").await.json();
    assert_eq!(remaining(&bob), rows(&[("minute", 5, 0)]));
    let reset = tool(
        &["reset"],
        &["--prefix", "svc", "--header", "x-api-key=bob"],
    )
    .await;
    assert_eq!(reset.code, 0, "{reset:?}");
    assert_eq!(
        remaining(&inspect("x-api-key=bob").await.json_of_nothing()),
        rows(&[("minute", 5, 5)])
    );
    let pro = tool(
        &["inspect"],
        &[
            "--prefix",
            "svc",
            "--tier",
            "pro",
            "--header",
            "x-api-key=bob",
        ],
    )
    .await;
    assert_eq!(pro.code, 1, "{pro:?}");
    assert!(pro.stdout.contains("70"), "{pro:?}");
    let gold = tool(
        &["inspect"],
        &[
            "--prefix",
            "svc",
            "--tier",
            "gold",
            "--header",
            "x-api-key=bob",
        ],
    )
    .await;
    assert_eq!(gold.code, 2, "{gold:?}");
    assert!(
        gold.stderr.contains("no tier \"gold\" (its tiers: pro)"),
        "{gold:?}"
    );
    let svx = tool(
        &["reset"],
        &["--prefix", "svx", "--header", "x-api-key=bob"],
    )
    .await;
    assert_eq!(svx.code, 2, "{svx:?}");
    assert!(
        svx.stderr.contains("no limits in force under svx:rl"),
        "{svx:?}"
    );

    let history = run(&["history", "--prefix", "svc"]).await;
    assert_eq!(history.code, 0, "{history:?}");
    let notes: Vec<&str> = history
        .stdout
        .lines()
        .map(|line| {
            line.split_once(" UTC  ")
                .map_or("", |(_, note)| note.trim_end())
        })
        .collect();
    assert_eq!(
        notes,
        ["trial over", "", "acme trial", "defaults of revision 0"],
        "{history:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn limits_on_redis() {
    let server = RedisServer::start().unwrap_or_else(|e| panic!("{e}"));
    let store = || -> Arc<dyn RateStore> { Arc::new(RedisStore::open(server.url()).unwrap()) };
    let copies = [copy(store(), 5).await, copy(store(), 9).await];
    let url = server.url();
    the_tool_reads_and_changes_the_limits(&["--store", &url], copies).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn limits_on_postgres() {
    let server = tokio::task::spawn_blocking(PgServer::start)
        .await
        .unwrap()
        .unwrap_or_else(|e| panic!("{e}"));
    let url = server.url();
    let store = || async {
        let store = PgStore::builder(url.clone())
            .schema("svc_limits")
            .timeout(Duration::from_secs(2))
            .purge_interval(None)
            .connect()
            .await
            .unwrap();
        Arc::new(store) as Arc<dyn RateStore>
    };
    let copies = [copy(store().await, 5).await, copy(store().await, 9).await];
    the_tool_reads_and_changes_the_limits(&["--store", &url, "--pg-schema", "svc_limits"], copies)
        .await;
}
