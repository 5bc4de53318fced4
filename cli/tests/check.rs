//! `tollgate check` run as a binary against small axum servers on 127.0.0.1: two copies that
//! share their coupon state answer as one service (one `200`), two copies with state of their
//! own do not (two `200`s); the table, the expectations and the exit codes.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use axum::Router;
use axum::extract::State;
use axum::http::{HeaderMap, Method, StatusCode};
use axum::routing::{any, post};
use tokio::net::TcpListener;

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

struct Run {
    code: i32,
    stdout: String,
    stderr: String,
}

async fn tollgate(args: &[&str]) -> Run {
    let output = tokio::process::Command::new(env!("CARGO_BIN_EXE_tollgate"))
        .args(args)
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
    ] {
        assert!(run.stdout.contains(flag), "{flag}");
    }
}
