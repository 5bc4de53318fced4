//! `tollgate check` run as a binary against small axum servers on 127.0.0.1: two copies that
//! share their coupon state answer as one service (one `200`), two copies with state of their
//! own do not (two `200`s); the table, the expectations and the exit codes. With `--store`, on a
//! throwaway `redis-server`: the limits in force of two copies of a rate-limited service, the
//! copy built with other defaults marked (exit 1 with `--no-drift`), those of a concurrency
//! limit's two copies under a prefix that holds no rate limit's, then beside a rate limit's,
//! and a prefix under which the store holds nothing refused before any request.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use axum::Router;
use axum::extract::State;
use axum::http::{HeaderMap, Method, StatusCode};
use axum::routing::{any, get, post};
use tokio::net::TcpListener;
use tollgate::concurrency::ConcurrencyLimitLayer;
use tollgate::key::Header;
use tollgate::rate::Limit;
use tollgate::rate_limit::RateLimitLayer;
use tollgate::store::{CopySeen, RedisStore};
use tollgate::testing::RedisServer;

async fn serve(router: Router) -> String {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr: SocketAddr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, router).await.unwrap() });
    format!("http://{addr}")
}

/// A copy of a coupon service: the first redemption of its `redeemed` flag wins.
fn coupon_copy(redeemed: Arc<AtomicBool>) -> Router {
    async fn redeem(State(redeemed): State<Arc<AtomicBool>>) -> StatusCode {
        match redeemed.compare_exchange(false, true, Ordering::SeqCst, Ordering::SeqCst) {
            Ok(_) => StatusCode::OK,
            Err(_) => StatusCode::CONFLICT,
        }
    }
    Router::new()
        .route("/coupons/WELCOME5/redeem", post(redeem))
        .with_state(redeemed)
}

#[derive(Debug)]
struct Run {
    code: i32,
    stdout: String,
    stderr: String,
}

async fn tollgate(args: &[&str]) -> Run {
    tollgate_with(args, &[]).await
}

/// `tollgate ARGS…` with the environment variables `vars` set.
async fn tollgate_with(args: &[&str], vars: &[(&str, &str)]) -> Run {
    let output = tokio::process::Command::new(env!("CARGO_BIN_EXE_tollgate"))
        .args(args)
        .env_remove("TOLLGATE_STORE")
        .envs(vars.iter().copied())
        .output()
        .await
        .unwrap();
    Run {
        code: output.status.code().unwrap(),
        stdout: String::from_utf8(output.stdout).unwrap(),
        stderr: String::from_utf8(output.stderr).unwrap(),
    }
}

/// The table's rows as (label, counts).
fn rows(stdout: &str) -> Vec<(String, Vec<String>)> {
    stdout
        .lines()
        .take_while(|line| !line.is_empty())
        .map(|line| {
            let mut cells = line.split_whitespace().map(str::to_owned);
            let label = cells.next().unwrap();
            (label, cells.collect())
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_copies_on_shared_state_answer_as_one_service() {
    let redeemed = Arc::new(AtomicBool::new(false));
    let a = serve(coupon_copy(Arc::clone(&redeemed))).await;
    let b = serve(coupon_copy(Arc::clone(&redeemed))).await;
    let run = tollgate(&[
        "check",
        "--target",
        &a,
        "--target",
        &b,
        "-X",
        "POST",
        "--requests",
        "50",
        "--expect",
        "200=1",
        "--expect",
        "409=49",
        "/coupons/WELCOME5/redeem",
    ])
    .await;
    assert_eq!(run.code, 0, "{}{}", run.stdout, run.stderr);
    let rows = rows(&run.stdout);
    assert_eq!(rows.len(), 4, "{}", run.stdout);
    assert_eq!(
        rows[0],
        (
            "target".to_owned(),
            vec!["200".into(), "409".into(), "error".into()]
        )
    );
    assert_eq!(rows[1].0, a);
    assert_eq!(rows[2].0, b);
    assert_eq!(
        rows[3],
        (
            "total".to_owned(),
            vec!["1".into(), "49".into(), "0".into()]
        )
    );
    // round robin: 25 requests each, one of the two copies answered the `200`
    for row in &rows[1..3] {
        let counts: Vec<usize> = row.1.iter().map(|c| c.parse().unwrap()).collect();
        assert_eq!(counts[0] + counts[1], 25, "{}", run.stdout);
        assert_eq!(counts[2], 0);
    }
    assert!(
        run.stdout
            .ends_with("\n\n200=1 as expected\n409=49 as expected\n"),
        "{}",
        run.stdout
    );
    assert_eq!(run.stderr, "");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_copies_with_state_of_their_own_both_redeem() {
    let a = serve(coupon_copy(Arc::new(AtomicBool::new(false)))).await;
    let b = serve(coupon_copy(Arc::new(AtomicBool::new(false)))).await;
    let run = tollgate(&[
        "check",
        "--target",
        &a,
        "--target",
        &b,
        "-X",
        "POST",
        "--requests",
        "50",
        "--expect",
        "200=1",
        "--expect",
        "409=49",
        "/coupons/WELCOME5/redeem",
    ])
    .await;
    assert_eq!(run.code, 1, "{}{}", run.stdout, run.stderr);
    let width = a.len().max(b.len());
    let expected = format!(
        "{:<width$}  200  409  error\n\
         {a:<width$}    1   24      0\n\
         {b:<width$}    1   24      0\n\
         {:<width$}    2   48      0\n\
         \n\
         expected 200=1, got 200=2\n\
         expected 409=49, got 409=48\n",
        "target", "total",
    );
    assert_eq!(run.stdout, expected);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_start_together() {
    // each request waits until all ten are in: only requests sent at once all get their 200
    let barrier = Arc::new(tokio::sync::Barrier::new(10));
    let router = Router::new().route(
        "/together",
        any(
            |State(barrier): State<Arc<tokio::sync::Barrier>>| async move {
                match tokio::time::timeout(Duration::from_secs(5), barrier.wait()).await {
                    Ok(_) => StatusCode::OK,
                    Err(_) => StatusCode::GATEWAY_TIMEOUT,
                }
            },
        )
        .with_state(barrier),
    );
    let a = serve(router).await;
    let run = tollgate(&[
        "check",
        "--target",
        &a,
        "--requests",
        "10",
        "--expect",
        "200=10",
        "together",
    ])
    .await;
    assert_eq!(run.code, 0, "{}{}", run.stdout, run.stderr);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn method_headers_and_body_are_sent() {
    let router = Router::new().route(
        "/echo",
        any(
            |method: Method, headers: HeaderMap, body: String| async move {
                if method == Method::PUT && headers["x-key"] == "abc" && body == "hello" {
                    StatusCode::CREATED
                } else {
                    StatusCode::BAD_REQUEST
                }
            },
        ),
    );
    let a = serve(router).await;
    let run = tollgate(&[
        "check",
        "--target",
        &a,
        "-n",
        "4",
        "-X",
        "put",
        "-H",
        "x-key: abc",
        "--data",
        "hello",
        "--expect",
        "201=4",
        "/echo",
    ])
    .await;
    assert_eq!(run.code, 0, "{}{}", run.stdout, run.stderr);
    // --data alone means POST
    let run = tollgate(&[
        "check",
        "--target",
        &a,
        "-n",
        "2",
        "-H",
        "x-key: abc",
        "--data",
        "hello",
        "--expect",
        "400=2",
        "/echo",
    ])
    .await;
    assert_eq!(run.code, 0, "{}{}", run.stdout, run.stderr);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_copy_past_the_timeout_counts_as_errors() {
    let fast = serve(Router::new().route("/x", any(|| async { StatusCode::OK }))).await;
    let slow = serve(Router::new().route(
        "/x",
        any(|| async {
            tokio::time::sleep(Duration::from_secs(5)).await;
            StatusCode::OK
        }),
    ))
    .await;
    let run = tollgate(&[
        "check",
        "--target",
        &fast,
        "--target",
        &slow,
        "-n",
        "4",
        "--timeout",
        "300ms",
        "--expect",
        "200=2",
        "--expect",
        "error=2",
        "/x",
    ])
    .await;
    assert_eq!(run.code, 0, "{}{}", run.stdout, run.stderr);
    let rows = rows(&run.stdout);
    assert_eq!(rows[1].1, ["2", "0"]);
    assert_eq!(rows[2].1, ["0", "2"]);
    assert_eq!(rows[3].1, ["2", "2"]);
    assert_eq!(run.stderr, "error: no answer within 300ms\n");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_answer_at_all_is_an_error() {
    // a port that was free a moment ago: nothing listens there
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    drop(listener);
    let run = tollgate(&[
        "check",
        "--target",
        &format!("http://{addr}"),
        "-n",
        "3",
        "--expect",
        "200=1",
        "/",
    ])
    .await;
    assert_eq!(run.code, 2, "{}{}", run.stdout, run.stderr);
    assert!(
        run.stderr
            .ends_with("error: no request could be sent: no target answered\n"),
        "{}",
        run.stderr
    );
    assert_eq!(rows(&run.stdout)[2].1, ["3"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_arguments_exit_2() {
    for args in [
        &[
            "check",
            "--target",
            "http://127.0.0.1:1",
            "--expect",
            "200",
            "/",
        ][..],
        &[
            "check",
            "--target",
            "http://127.0.0.1:1",
            "--expect",
            "2000=1",
            "/",
        ],
        &["check", "--target", "http://127.0.0.1:1", "-n", "0", "/"],
        &[
            "check",
            "--target",
            "http://127.0.0.1:1",
            "--timeout",
            "soon",
            "/",
        ],
        &[
            "check",
            "--target",
            "http://127.0.0.1:1",
            "-H",
            "no colon",
            "/",
        ],
        &["check", "/coupons/X/redeem"],
        &["check", "--target", "http://127.0.0.1:1"],
    ] {
        let run = tollgate(args).await;
        assert_eq!(run.code, 2, "{args:?}: {}", run.stderr);
        assert_eq!(run.stdout, "", "{args:?}");
    }
    let run = tollgate(&["check", "--target", "https://127.0.0.1:1", "/"]).await;
    assert_eq!(run.code, 2);
    assert!(
        run.stderr.contains("https is not supported"),
        "{}",
        run.stderr
    );
    let run = tollgate(&["check", "--target", "ftp://127.0.0.1:1", "/"]).await;
    assert_eq!(run.code, 2);
    assert!(
        run.stderr.contains("is not an http:// URL"),
        "{}",
        run.stderr
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn help_shows_flags_and_an_example() {
    for args in [&["--help"][..], &["check", "--help"], &["audit", "--help"]] {
        let run = tollgate(args).await;
        assert_eq!(run.code, 0);
        assert!(run.stdout.contains("Example"), "{args:?}: {}", run.stdout);
    }
    let run = tollgate(&["check", "--help"]).await;
    for flag in [
        "--target",
        "--requests",
        "--method",
        "--header",
        "--data",
        "--timeout",
        "--expect",
        "--store <URL>",
        "--store-timeout",
        "--prefix",
        "--no-drift",
    ] {
        assert!(run.stdout.contains(flag), "{flag}");
    }
}

/// A copy of a rate-limited service keeping its limits in the store: `quota` requests per ten
/// minutes per `x-api-key`, under prefix `svc`, on its own connection to the Redis at `url`.
async fn limited_copy(url: &str, quota: u64) -> RateLimitLayer<Header> {
    RateLimitLayer::builder(RedisStore::open(url).unwrap())
        .limit(Limit::new("api", quota, Duration::from_secs(600)))
        .prefix("svc")
        .key(Header::from_static("x-api-key"))
        .build_in_store()
        .await
        .unwrap()
}

/// The copy served over HTTP: `GET /api/hello` behind its rate limit.
async fn serve_limited(layer: RateLimitLayer<Header>) -> String {
    serve(
        Router::new()
            .route("/api/hello", get(|| async { StatusCode::OK }))
            .layer(layer),
    )
    .await
}

async fn copies_seen(layer: &RateLimitLayer<Header>) -> Vec<CopySeen> {
    layer.limits().unwrap().copies().await.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_store_shows_the_copy_built_with_other_defaults() {
    let server = RedisServer::start().unwrap_or_else(|e| panic!("{e}"));
    let url = server.url();
    // the first copy seeds the limits in force with its 10; the second, built with 20, decides
    // with those but registers what it was built with
    let first = limited_copy(&url, 10).await;
    let first_id = copies_seen(&first).await.pop().unwrap().copy;
    let second = limited_copy(&url, 20).await;
    let in_force = first.limits().unwrap().in_force();
    assert_eq!(in_force.version, 1);
    let defaults = in_force.table.defaults_id();
    let mut copies = copies_seen(&first).await;
    assert_eq!(copies.len(), 2, "{copies:?}");
    copies.sort_by(|a, b| a.copy.cmp(&b.copy));
    let built = |id: &str| &copies.iter().find(|c| c.copy == id).unwrap().built;
    let second_id = copies
        .iter()
        .find(|c| c.copy != first_id)
        .unwrap()
        .copy
        .clone();
    assert_eq!(built(&first_id), &defaults);
    assert_ne!(built(&second_id), &defaults);
    let a = serve_limited(first).await;
    let b = serve_limited(second).await;

    // the lines after the table and the expectations: the copies in the order of their ids
    let expected = {
        let mut lines =
            format!("store: {url}\nlimits in force: svc:rl, version 1, defaults {defaults}\n");
        for copy in &copies {
            let mark = if copy.copy == second_id {
                "  other defaults"
            } else {
                ""
            };
            lines.push_str(&format!("  {}  built {}{mark}\n", copy.copy, copy.built));
        }
        lines.push_str("2 copies; 1 built with other defaults than those in force (version 1)\n");
        lines
    };
    let check = |caller: &'static str, extra: &'static [&'static str]| {
        let (a, b, url) = (a.clone(), b.clone(), url.clone());
        async move {
            let header = format!("x-api-key: {caller}");
            let mut args = vec![
                "check",
                "--target",
                &a,
                "--target",
                &b,
                "-H",
                &header,
                "--requests",
                "30",
                "--expect",
                "200=10",
                "--expect",
                "429=20",
                "--store",
                &url,
                "--prefix",
                "svc",
            ];
            args.extend_from_slice(extra);
            args.push("/api/hello");
            tollgate(&args).await
        }
    };
    let table_and_rest = |run: &Run| {
        let (table, rest) = run.stdout.split_once("\n\n").unwrap();
        let rows = rows(table);
        assert_eq!(rows.len(), 4, "{}", run.stdout);
        assert_eq!(rows[0].1, ["200", "429", "error"], "{}", run.stdout);
        assert_eq!((rows[1].0.as_str(), rows[2].0.as_str()), (&*a, &*b));
        // round robin: 15 each, the 10 admitted over both copies as the limits in force say
        for row in &rows[1..3] {
            let counts: Vec<usize> = row.1.iter().map(|c| c.parse().unwrap()).collect();
            assert_eq!(
                (counts[0] + counts[1], counts[2]),
                (15, 0),
                "{}",
                run.stdout
            );
        }
        assert_eq!(rows[3].1, ["10", "20", "0"], "{}", run.stdout);
        rest.to_owned()
    };

    // a warning: the copy is marked, the expectations hold, exit 0
    let run = check("alice", &[]).await;
    assert_eq!(run.code, 0, "{run:?}");
    assert_eq!(
        table_and_rest(&run),
        format!("200=10 as expected\n429=20 as expected\n\n{expected}")
    );
    assert_eq!(run.stderr, "");

    // --no-drift: the same output, and the copy built otherwise fails the check
    let run = check("bob", &["--no-drift"]).await;
    assert_eq!(run.code, 1, "{run:?}");
    assert_eq!(
        table_and_rest(&run),
        format!("200=10 as expected\n429=20 as expected\n\n{expected}")
    );
    assert_eq!(
        run.stderr,
        "--no-drift: 1 of 2 copies built with other defaults than those in force\n"
    );
    println!("{}", run.stdout);
}

/// A copy of a service whose only limit in the store is a concurrency limit: `in_flight`
/// requests at once per `x-api-key`, under prefix `jobs`.
async fn in_flight_copy(url: &str, in_flight: u32) -> ConcurrencyLimitLayer<Header> {
    ConcurrencyLimitLayer::builder(RedisStore::open(url).unwrap())
        .limit(in_flight)
        .prefix("jobs")
        .key(Header::from_static("x-api-key"))
        .build_in_store()
        .await
        .unwrap()
}

/// The lines `check` prints of one namespace: the limits in force, each copy (those not built
/// with `defaults` marked), the summary.
fn block(namespace: &str, defaults: &str, copies: &[CopySeen]) -> String {
    let mut copies = copies.to_vec();
    copies.sort_by(|a, b| a.copy.cmp(&b.copy));
    let mut lines = format!("limits in force: {namespace}, version 1, defaults {defaults}\n");
    let mut other = 0;
    for copy in &copies {
        let mark = if copy.built == defaults {
            ""
        } else {
            other += 1;
            "  other defaults"
        };
        lines.push_str(&format!("  {}  built {}{mark}\n", copy.copy, copy.built));
    }
    lines.push_str(&format!(
        "{} copies; {other} built with other defaults than those in force (version 1)\n",
        copies.len()
    ));
    lines
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_concurrency_limits_table_alone_is_checked_and_beside_a_rate_limits() {
    let server = RedisServer::start().unwrap_or_else(|e| panic!("{e}"));
    let url = server.url();
    // the first copy seeds 2 in flight; the second, built with 4, decides with those
    let first = in_flight_copy(&url, 2).await;
    let second = in_flight_copy(&url, 4).await;
    let limits = first.limits().unwrap();
    assert_eq!((first.limit(), second.limit()), (2, 2));
    let defaults = limits.in_force().table.defaults_id();
    let copies = limits.copies().await.unwrap();
    assert_eq!(copies.len(), 2, "{copies:?}");
    assert_eq!(
        copies.iter().filter(|c| c.built != defaults).count(),
        1,
        "{copies:?}"
    );
    let in_flight = block("jobs:cc", &defaults, &copies);
    let route = || Router::new().route("/jobs", post(|| async { StatusCode::OK }));
    let a = serve(route().layer(first)).await;
    let b = serve(route().layer(second)).await;
    // two requests, one on each copy: both within the 2 in flight
    let check = |extra: &'static [&'static str]| {
        let (a, b, url) = (a.clone(), b.clone(), url.clone());
        async move {
            let mut args = vec![
                "check",
                "--target",
                &a,
                "--target",
                &b,
                "-X",
                "POST",
                "-H",
                "x-api-key: alice",
                "-n",
                "2",
                "--expect",
                "200=2",
                "--store",
                &url,
                "--prefix",
                "jobs",
            ];
            args.extend_from_slice(extra);
            args.push("/jobs");
            tollgate(&args).await
        }
    };
    let width = a.len().max(b.len());
    let table = format!(
        "{:<width$}  200  error\n\
         {a:<width$}    1      0\n\
         {b:<width$}    1      0\n\
         {:<width$}    2      0\n\
         \n\
         200=2 as expected\n\
         \n\
         store: {url}\n",
        "target", "total"
    );

    // no rate limit's table under `jobs`: the concurrency limit's alone, its copy built with 4
    // marked; a warning, exit 0
    let run = check(&[]).await;
    assert_eq!(run.code, 0, "{run:?}");
    assert_eq!(run.stdout, format!("{table}{in_flight}"));
    assert_eq!(run.stderr, "");
    // --no-drift: the same output, and that copy fails the check
    let run = check(&["--no-drift"]).await;
    assert_eq!(run.code, 1, "{run:?}");
    assert_eq!(run.stdout, format!("{table}{in_flight}"));
    assert_eq!(
        run.stderr,
        "--no-drift: 1 of 2 copies built with other defaults than those in force\n"
    );
    println!("{}", run.stdout);

    // a rate limit under the same prefix, its two copies built alike: both blocks, the rate
    // limit's first; the drift counted over both
    let mut rate_limited = Vec::new();
    for _ in 0..2 {
        let layer = RateLimitLayer::builder(RedisStore::open(url.as_str()).unwrap())
            .limit(Limit::new("api", 10, Duration::from_secs(600)))
            .prefix("jobs")
            .key(Header::from_static("x-api-key"))
            .build_in_store()
            .await
            .unwrap();
        rate_limited.push(layer);
    }
    let rate_defaults = rate_limited[0]
        .limits()
        .unwrap()
        .in_force()
        .table
        .defaults_id();
    let rate_block = block(
        "jobs:rl",
        &rate_defaults,
        &copies_seen(&rate_limited[0]).await,
    );
    assert!(
        rate_block
            .ends_with("\n2 copies; 0 built with other defaults than those in force (version 1)\n"),
        "{rate_block}"
    );
    let run = check(&["--no-drift"]).await;
    assert_eq!(run.code, 1, "{run:?}");
    assert_eq!(run.stdout, format!("{table}{rate_block}\n{in_flight}"));
    assert_eq!(
        run.stderr,
        "--no-drift: 1 of 4 copies built with other defaults than those in force\n"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefix_without_limits_exits_2_naming_the_namespace_and_sends_nothing() {
    let server = RedisServer::start().unwrap_or_else(|e| panic!("{e}"));
    let url = server.url();
    // limits in force under `svc`; the prefix asked about is mistyped
    let copy = limited_copy(&url, 10).await;
    let copy_id = copies_seen(&copy).await.pop().unwrap().copy;
    let defaults = copy.limits().unwrap().in_force().table.defaults_id();
    let hits = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let counted = Arc::clone(&hits);
    let target = serve(
        Router::new()
            .route(
                "/api/hello",
                get(move || async move {
                    counted.fetch_add(1, Ordering::SeqCst);
                    StatusCode::OK
                }),
            )
            .layer(copy),
    )
    .await;
    for no_drift in [&[][..], &["--no-drift"]] {
        let mut args = vec![
            "check",
            "--target",
            &target,
            "-H",
            "x-api-key: alice",
            "--expect",
            "200=1",
            "-n",
            "1",
            "--store",
            &url,
            "--prefix",
            "svx",
        ];
        args.extend_from_slice(no_drift);
        args.push("/api/hello");
        let run = tollgate(&args).await;
        assert_eq!(run.code, 2, "{run:?}");
        assert_eq!(run.stdout, "", "{run:?}");
        assert_eq!(
            run.stderr,
            "error: no limits in force under svx:rl nor svx:cc: no copy built with \
             build_in_store has started on this store, or its prefix is another (--prefix)\n"
        );
    }
    assert_eq!(hits.load(Ordering::SeqCst), 0, "a request was sent");
    // the right prefix: the request is sent, the one copy built with the defaults in force
    let run = tollgate(&[
        "check",
        "--target",
        &target,
        "-H",
        "x-api-key: alice",
        "-n",
        "1",
        "--expect",
        "200=1",
        "--store",
        &url,
        "--prefix",
        "svc",
        "--no-drift",
        "/api/hello",
    ])
    .await;
    assert_eq!(run.code, 0, "{run:?}");
    assert_eq!(hits.load(Ordering::SeqCst), 1);
    let width = target.len();
    assert_eq!(
        run.stdout,
        format!(
            "{:<width$}  200  error\n\
             {target:<width$}    1      0\n\
             {:<width$}    1      0\n\
             \n\
             200=1 as expected\n\
             \n\
             store: {url}\n\
             limits in force: svc:rl, version 1, defaults {defaults}\n  \
             {copy_id}  built {defaults}\n\
             1 copy; 0 built with other defaults than those in force (version 1)\n",
            "target", "total"
        )
    );
    assert_eq!(run.stderr, "");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_store_variable_alone_leaves_check_as_it_was() {
    let a = serve(Router::new().route("/x", any(|| async { StatusCode::OK }))).await;
    let args = [
        "check", "--target", &a, "-n", "2", "--expect", "200=2", "/x",
    ];
    let plain = tollgate(&args).await;
    // a store exported for the other commands, that would not even answer
    let with_var = tollgate_with(&args, &[("TOLLGATE_STORE", "redis://127.0.0.1:1/")]).await;
    assert_eq!(plain.code, 0, "{plain:?}");
    assert_eq!(
        (with_var.code, &with_var.stdout, &with_var.stderr),
        (0, &plain.stdout, &plain.stderr)
    );
    let width = a.len();
    assert_eq!(
        plain.stdout,
        format!(
            "{:<width$}  200  error\n{a:<width$}    2      0\n{:<width$}    2      0\n\n200=2 as expected\n",
            "target", "total"
        )
    );
}
