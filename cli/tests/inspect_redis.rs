//! `tollgate inspect` and `tollgate reset` run as a binary against a throwaway `redis-server`
//! (`tollgate::testing::RedisServer`): quota spent through the service's own layer, built from
//! the same limits file, shows exactly; a reset gives it back to one caller only.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::net::SocketAddr;
use std::sync::Arc;

use common::*;
use http::StatusCode;
use tollgate::store::{RateStore, RedisStore};
use tollgate::testing::RedisServer;

fn server() -> RedisServer {
    RedisServer::start().unwrap_or_else(|e| panic!("{e}"))
}

fn store(server: &RedisServer) -> Arc<dyn RateStore> {
    Arc::new(RedisStore::open(server.url()).unwrap())
}

#[tokio::test]
async fn inspect_shows_what_is_left_and_reset_gives_one_caller_its_quota_back() {
    let server = server();
    let (_dir, config) = write_config(TOLLGATE_TOML);
    let layer = by_api_key(store(&server), &config);
    for _ in 0..3 {
        assert_eq!(
            call(&layer, &[("x-api-key", "alice")], None).await,
            StatusCode::OK
        );
    }
    assert_eq!(
        call(&layer, &[("x-api-key", "bob")], None).await,
        StatusCode::OK
    );

    let url = server.url();
    let config = config.to_str().unwrap();
    let inspect = |who: &'static str| {
        let header = format!("x-api-key={who}");
        let url = url.clone();
        async move {
            let args = ["inspect", "--store", &url, "--config", config];
            let mut args = args.to_vec();
            args.extend(["--header", &header, "--json"]);
            tollgate(&args).await
        }
    };
    let alice = inspect("alice").await.json();
    assert_eq!(
        remaining(&alice),
        rows(&[("minute", 5, 2), ("hour", 100, 97)])
    );
    assert_eq!(alice["namespace"], "svc:rl");
    assert_eq!(alice["blocked"], false);
    assert_eq!(alice["limits"][0]["window_ms"], 60_000);
    assert_eq!(alice["limits"][1]["window"], "1h");
    let reset_ms = alice["limits"][0]["reset_ms"].as_u64().unwrap();
    assert!(reset_ms > 0 && reset_ms <= 60_000, "{alice}");
    // peeking spends nothing
    assert_eq!(remaining(&inspect("alice").await.json()), remaining(&alice));
    assert_eq!(
        remaining(&inspect("bob").await.json()),
        rows(&[("minute", 5, 4), ("hour", 100, 99)])
    );

    let reset = tollgate(&[
        "reset",
        "--store",
        &url,
        "--config",
        config,
        "--header",
        "x-api-key=alice",
    ])
    .await;
    assert_eq!(reset.code, 0, "{reset:?}");
    assert_eq!(
        reset.stdout,
        format!(
            "reset header x-api-key=a… on {url}\n  svc:rl        minute, hour\n  svc:rl:paid   minute\n"
        )
    );
    // nothing left of alice: exit 1, saying so
    assert_eq!(
        remaining(&inspect("alice").await.json_of_nothing()),
        rows(&[("minute", 5, 5), ("hour", 100, 100)])
    );
    // the other caller is untouched
    assert_eq!(
        remaining(&inspect("bob").await.json()),
        rows(&[("minute", 5, 4), ("hour", 100, 99)])
    );
    // and the service sees the reset
    assert_eq!(
        call(&layer, &[("x-api-key", "alice")], None).await,
        StatusCode::OK
    );
    assert_eq!(
        remaining(&inspect("alice").await.json()),
        rows(&[("minute", 5, 4), ("hour", 100, 99)])
    );
}

#[tokio::test]
async fn a_tier_is_inspected_and_reset_on_its_own() {
    let server = server();
    let (_dir, config) = write_config(TOLLGATE_TOML);
    let layer = by_api_key(store(&server), &config);
    let paid = [("x-api-key", "carol"), ("x-plan", "paid")];
    for _ in 0..7 {
        assert_eq!(call(&layer, &paid, None).await, StatusCode::OK);
    }
    assert_eq!(
        call(&layer, &[("x-api-key", "carol")], None).await,
        StatusCode::OK
    );

    let (url, config) = (server.url(), config.to_str().unwrap());
    let base = [
        "--store",
        &url,
        "--config",
        config,
        "--header",
        "x-api-key=carol",
    ];
    let inspect = |tier: Option<&'static str>| {
        let mut args = vec!["inspect"];
        args.extend(base);
        args.push("--json");
        if let Some(tier) = tier {
            args.extend(["--tier", tier]);
        }
        async move { tollgate(&args).await }
    };
    let in_paid = inspect(Some("paid")).await.json();
    assert_eq!(remaining(&in_paid), rows(&[("minute", 50, 43)]));
    assert_eq!(in_paid["namespace"], "svc:rl:paid");
    assert_eq!(in_paid["tier"], "paid");
    assert_eq!(
        remaining(&inspect(None).await.json()),
        rows(&[("minute", 5, 4), ("hour", 100, 99)])
    );

    let mut args = vec!["reset"];
    args.extend(base);
    args.extend(["--tier", "paid"]);
    let reset = tollgate(&args).await;
    assert_eq!(reset.code, 0, "{reset:?}");
    assert_eq!(
        reset.stdout,
        format!("reset header x-api-key=c… on {url}\n  svc:rl:paid   minute\n")
    );
    assert_eq!(
        remaining(&inspect(Some("paid")).await.json_of_nothing()),
        rows(&[("minute", 50, 50)])
    );
    assert_eq!(
        remaining(&inspect(None).await.json()),
        rows(&[("minute", 5, 4), ("hour", 100, 99)])
    );

    // a caller who spent only in a tier, inspected without --tier: exit 1, naming the tier
    for _ in 0..2 {
        let dave = [("x-api-key", "dave"), ("x-plan", "paid")];
        assert_eq!(call(&layer, &dave, None).await, StatusCode::OK);
    }
    let untiered = tollgate(&[
        "inspect",
        "--store",
        &url,
        "--config",
        config,
        "--header",
        "x-api-key=dave",
    ])
    .await;
    assert_eq!(untiered.code, 1, "{untiered:?}");
    assert_eq!(
        untiered.stderr,
        "nothing spent: the store holds no state of header x-api-key=d… under svc:rl; a caller \
         that never came, or one named otherwise (check the caller, the prefix and the tiers); \
         it has spent under --tier paid\n"
    );

    let mut args = vec!["inspect"];
    args.extend(base);
    args.extend(["--tier", "gold"]);
    let unknown = tollgate(&args).await;
    assert_eq!(unknown.code, 2, "{unknown:?}");
    assert_eq!(
        unknown.stderr,
        format!("error: {config}: no tier \"gold\" (its tiers: paid)\n")
    );
}

#[tokio::test]
async fn a_blocked_caller_shows_blocked_until_reset() {
    let server = server();
    let (_dir, config) = write_config(PENALTY_TOML);
    let layer = by_peer_ip(store(&server), &config);
    let peer: SocketAddr = "203.0.113.7:50000".parse().unwrap();
    assert_eq!(call(&layer, &[], Some(peer)).await, StatusCode::OK);
    assert_eq!(
        call(&layer, &[], Some(peer)).await,
        StatusCode::TOO_MANY_REQUESTS
    );

    let (url, config) = (server.url(), config.to_str().unwrap());
    let args = [
        "--store",
        &url,
        "--config",
        config,
        "--peer-ip",
        "203.0.113.7",
    ];
    let inspect = || {
        let mut all = vec!["inspect", "--json"];
        all.extend(args);
        async move { tollgate(&all).await }
    };
    let blocked = inspect().await.json();
    assert_eq!(blocked["blocked"], true);
    assert_eq!(blocked["caller"], "peer IP 203.0.113.7");
    assert_eq!(blocked["limits"][0]["blocked"], true);
    assert_eq!(blocked["limits"][0]["remaining"], 0);
    assert_eq!(blocked["limits"][0]["block_for_ms"], 3_600_000);
    let retry = blocked["retry_after_ms"].as_u64().unwrap();
    assert!(retry > 3_500_000 && retry <= 3_600_000, "{blocked}");

    let mut text = vec!["inspect"];
    text.extend(args);
    let table = tollgate(&text).await;
    assert_eq!(table.code, 0, "{table:?}");
    assert!(
        table.stdout.contains("strict      1      1m  0 (blocked)"),
        "{}",
        table.stdout
    );
    assert!(
        table.stdout.contains("\nblocked for 59m")
            && table.stdout.ends_with("(penalty of strict)\n"),
        "{}",
        table.stdout
    );

    let mut reset = vec!["reset"];
    reset.extend(args);
    assert_eq!(tollgate(&reset).await.code, 0);
    let free = inspect().await.json_of_nothing();
    assert_eq!(free["blocked"], false);
    assert_eq!(remaining(&free), rows(&[("strict", 1, 1)]));
    // another address was never touched; the same address on another port is the same caller
    let mut other = vec!["inspect", "--json"];
    other.extend([
        "--store",
        &url,
        "--config",
        config,
        "--peer-ip",
        "198.51.100.1",
    ]);
    assert_eq!(
        remaining(&tollgate(&other).await.json_of_nothing()),
        rows(&[("strict", 1, 1)])
    );
    assert_eq!(call(&layer, &[], Some(peer)).await, StatusCode::OK);
    let mut same = vec!["inspect", "--json"];
    same.extend([
        "--store",
        &url,
        "--config",
        config,
        "--peer-ip",
        "203.0.113.7:1",
    ]);
    assert_eq!(
        remaining(&tollgate(&same).await.json()),
        rows(&[("strict", 1, 0)])
    );
}

#[tokio::test]
async fn errors_exit_2_and_say_what_is_wrong() {
    let (_dir, config) = write_config(TOLLGATE_TOML);
    let config = config.to_str().unwrap();
    let run = |store: &'static str, config: String| async move {
        let args = ["inspect", "--store", store, "--config", &config];
        let mut args = args.to_vec();
        args.extend(["--header", "x-api-key=a"]);
        tollgate(&args).await
    };
    // a port nothing listens on
    let closed: &'static str =
        Box::leak(format!("redis://:pw@127.0.0.1:{}/", free_port()).into_boxed_str());
    let down = run(closed, config.to_owned()).await;
    assert_eq!(down.code, 2, "{down:?}");
    assert!(
        down.stderr.starts_with("error: redis://:***@127.0.0.1:"),
        "{down:?}"
    );
    assert!(down.stderr.contains("unavailable"), "{down:?}");
    assert!(!down.stderr.contains("pw"), "{down:?}");

    // a port that takes connections and never answers
    let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let silent_url = format!("redis://{}/", silent.local_addr().unwrap());
    let started = std::time::Instant::now();
    let args = ["inspect", "--store", &silent_url, "--config", config];
    let mut args = args.to_vec();
    args.extend(["--header", "x-api-key=a", "--timeout", "500ms"]);
    let hangs = tollgate(&args).await;
    assert_eq!(hangs.code, 2, "{hangs:?}");
    assert_eq!(
        hangs.stderr,
        format!("error: {silent_url} did not answer within 500ms (--timeout)\n")
    );
    assert!(started.elapsed() < std::time::Duration::from_secs(3));
    drop(silent);

    let bad_url = run("http://127.0.0.1/", config.to_owned()).await;
    assert_eq!(bad_url.code, 2, "{bad_url:?}");
    assert!(
        bad_url.stderr.contains("the scheme http:// is not Redis's"),
        "{bad_url:?}"
    );

    let (_bad, bad_config) = write_config(
        "[rate_limit]\nlimits = [{ name = \"m\", quota = 5, window = \"5 minutes\" }]\n",
    );
    let bad_config = bad_config.to_str().unwrap().to_owned();
    let bad = run("redis://127.0.0.1:1/", bad_config.clone()).await;
    assert_eq!(bad.code, 2, "{bad:?}");
    assert!(
        bad.stderr.starts_with(&format!("error: {bad_config}: ")),
        "{bad:?}"
    );
    assert!(bad.stderr.contains("line 2"), "{bad:?}");
    assert!(
        bad.stderr.contains("invalid window \"5 minutes\""),
        "{bad:?}"
    );

    let missing = run("redis://127.0.0.1:1/", "/no/such/tollgate.toml".to_owned()).await;
    assert_eq!(missing.code, 2, "{missing:?}");
    assert!(
        missing
            .stderr
            .starts_with("error: /no/such/tollgate.toml: "),
        "{missing:?}"
    );

    let no_caller = tollgate(&[
        "inspect",
        "--store",
        "redis://127.0.0.1:1/",
        "--config",
        config,
    ])
    .await;
    assert_eq!(no_caller.code, 2, "{no_caller:?}");
    assert!(no_caller.stderr.contains("--header"), "{no_caller:?}");
}

#[tokio::test]
async fn a_table_named_by_section() {
    let server = server();
    let (_dir, config) = write_config(
        "[http.limits]\nprefix = \"nested\"\nlimits = [{ name = \"second\", quota = 3, window = \"1s\" }]\n",
    );
    let (url, path) = (server.url(), config.to_str().unwrap());
    let args = ["inspect", "--json", "--store", &url, "--config", path];
    let mut with = args.to_vec();
    with.extend(["--section", "http.limits", "--key-fn", "tenant=42"]);
    let json = tollgate(&with).await.json_of_nothing();
    assert_eq!(remaining(&json), rows(&[("second", 3, 3)]));
    assert_eq!(json["namespace"], "nested:rl");
    assert_eq!(
        json["key"],
        tollgate::key::Key::new("fn:tenant", b"42").to_string()
    );
    let mut without = args.to_vec();
    without.extend(["--key-fn", "tenant=42"]);
    let run = tollgate(&without).await;
    assert_eq!(run.code, 2, "{run:?}");
    assert!(run.stderr.contains("unknown field `http`"), "{run:?}");
    assert!(run.stderr.contains("--section"), "{run:?}");
}

#[tokio::test]
async fn inspect_shows_a_lock_permits_and_records() {
    let server = server();
    let store: Arc<dyn tollgate::store::Store> = Arc::new(RedisStore::open(server.url()).unwrap());
    let url = server.url();
    let args = vec!["--store".to_owned(), url.clone()];
    common::state::locks_permits_and_records(store, &args, &url).await;
}

#[tokio::test]
async fn inspecting_a_lock_permits_or_record_fails_plainly() {
    let bad_prefix = tollgate(&[
        "inspect",
        "lock",
        "x",
        "--store",
        "redis://127.0.0.1:1/",
        "--prefix",
        "{a}",
    ])
    .await;
    assert_eq!(bad_prefix.code, 2, "{bad_prefix:?}");
    assert_eq!(
        bad_prefix.stderr,
        "error: --prefix: invalid key prefix \"{a}\": use visible ASCII without braces\n"
    );
    let no_key = tollgate(&["inspect", "permits", "--store", "redis://127.0.0.1:1/"]).await;
    assert_eq!(no_key.code, 2, "{no_key:?}");
    assert!(no_key.stderr.contains("--global"), "{no_key:?}");
    let down = tollgate(&[
        "inspect",
        "record",
        "order-1",
        "--store",
        "redis://127.0.0.1:1/",
        "--timeout",
        "300ms",
    ])
    .await;
    assert_eq!(down.code, 2, "{down:?}");
    assert!(
        down.stderr.starts_with("error: redis://127.0.0.1:1/"),
        "{down:?}"
    );
    let help = tollgate(&["inspect", "--help"]).await;
    assert_eq!(help.code, 0, "{help:?}");
    for line in [
        "  rate     ",
        "  lock     ",
        "  permits  ",
        "  record   ",
        "tollgate inspect lock nightly-report",
    ] {
        assert!(help.stdout.contains(line), "{line}: {}", help.stdout);
    }
}
