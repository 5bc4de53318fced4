//! The example app's transfers (`POST /transfers`) over two copies of its binary on one
//! PostgreSQL database: each `Idempotency-Key` inserts exactly one row, in the transaction that
//! records its response; a copy killed before its commit leaves nothing, and the key runs once
//! on another copy.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use crate::app::serve;
use crate::common::postgres::{self, PgServer};

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{Request, StatusCode};
use http_body_util::{BodyExt, Full};
use serde_json::{Value, json};

/// One answer of the app: status, whether it was a replay, and its JSON body.
#[derive(Debug, Clone)]
struct Answer {
    status: StatusCode,
    replayed: bool,
    json: Value,
}

impl Answer {
    fn id(&self) -> Option<&str> {
        self.json["id"].as_str()
    }
}

/// A database of its own on the shared server (the app's table and schema are fixed names),
/// and its URL.
async fn fresh_database() -> String {
    let server: &PgServer = tokio::task::spawn_blocking(postgres::shared).await.unwrap();
    let name = format!("app_{}", postgres::unique_schema());
    let client = server.client().await;
    client
        .batch_execute(&format!("CREATE DATABASE {name}"))
        .await
        .unwrap();
    format!("postgres://postgres@127.0.0.1:{}/{name}", server.port())
}

/// Sends `body` as a transfer with `key` to the copy at `url`; `None` when no answer comes
/// within `wait` (or the connection broke).
async fn transfer(url: &str, key: &str, body: &Value, wait: Duration) -> Option<Answer> {
    let client = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .build_http::<Full<Bytes>>();
    let request = Request::post(format!("{url}/transfers"))
        .header("content-type", "application/json")
        .header("x-api-key", "alice")
        .header("idempotency-key", key)
        .body(Full::new(Bytes::from(body.to_string())))
        .unwrap();
    let response = tokio::time::timeout(wait, client.request(request))
        .await
        .ok()?
        .ok()?;
    let status = response.status();
    let replayed = response.headers().get("idempotent-replayed").is_some();
    let bytes = response.into_body().collect().await.ok()?.to_bytes();
    Some(Answer {
        status,
        replayed,
        json: serde_json::from_slice(&bytes).unwrap_or(Value::Null),
    })
}

/// `GET /transfers/count` on the copy at `url`.
async fn count(url: &str) -> i64 {
    let client = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .build_http::<Full<Bytes>>();
    let request = Request::get(format!("{url}/transfers/count"))
        .body(Full::default())
        .unwrap();
    let response = client.request(request).await.unwrap();
    assert_eq!(response.status(), StatusCode::OK, "GET /transfers/count");
    let bytes = response.into_body().collect().await.unwrap().to_bytes();
    let json: Value = serde_json::from_slice(&bytes).unwrap();
    json["count"].as_i64().unwrap()
}

fn body(amount: i64) -> Value {
    json!({ "from": "acct-alice", "to": "acct-bob", "amount": amount })
}

fn tally(answers: &[Answer]) -> BTreeMap<u16, usize> {
    let mut tally = BTreeMap::new();
    for answer in answers {
        *tally.entry(answer.status.as_u16()).or_default() += 1;
    }
    tally
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fifty_parallel_transfers_with_one_key_over_two_copies_insert_one_row() {
    let database = fresh_database().await;
    let vars = [
        ("DATABASE_URL", database.as_str()),
        ("APP_TRANSFER_DELAY_MS", "300"),
    ];
    let (_a, url_a) = serve(&vars);
    let (_b, url_b) = serve(&vars);
    let key = "transfer-fifty";
    let hundred = body(100);
    let sends = (0..50).map(|i| {
        let url = if i % 2 == 0 { &url_a } else { &url_b };
        transfer(url, key, &hundred, Duration::from_secs(30))
    });
    let answers: Vec<Answer> = futures_util::future::join_all(sends)
        .await
        .into_iter()
        .map(|a| a.expect("every transfer is answered"))
        .collect();
    let created: Vec<&Answer> = answers.iter().filter(|a| a.status.is_success()).collect();
    let first: Vec<&Answer> = created.iter().copied().filter(|a| !a.replayed).collect();
    assert_eq!(
        first.len(),
        1,
        "exactly one first execution: {:?}",
        tally(&answers)
    );
    // the others were in flight (409) or came after the commit (a replay)
    for answer in &answers {
        assert!(
            answer.status == StatusCode::CREATED || answer.status == StatusCode::CONFLICT,
            "only 201 and 409: {answer:?}"
        );
    }
    let id = first[0]
        .id()
        .expect("the first answer has an id")
        .to_owned();
    for answer in &created {
        assert_eq!(answer.status, StatusCode::CREATED);
        assert_eq!(answer.id(), Some(id.as_str()), "every 2xx has one id");
    }
    assert_eq!(count(&url_a).await, 1, "exactly one row");
    // every later retry, on either copy, replays the one id
    for url in [&url_a, &url_b] {
        let replay = transfer(url, key, &body(100), Duration::from_secs(10))
            .await
            .unwrap();
        assert_eq!(replay.status, StatusCode::CREATED);
        assert!(replay.replayed, "a retry is a replay: {replay:?}");
        assert_eq!(replay.id(), Some(id.as_str()));
    }
    assert_eq!(count(&url_b).await, 1, "still one row");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_copy_killed_before_its_commit_leaves_nothing_and_the_key_runs_once_elsewhere() {
    let database = fresh_database().await;
    let slow = [
        ("DATABASE_URL", database.as_str()),
        ("APP_TRANSFER_DELAY_MS", "5000"),
    ];
    let (mut a, url_a) = serve(&slow);
    let (_b, url_b) = serve(&[("DATABASE_URL", database.as_str())]);
    let key = "transfer-killed";
    // A inserts the row and waits before its commit; meanwhile B refuses the key
    let on_a = {
        let url = url_a.clone();
        tokio::spawn(async move { transfer(&url, key, &body(7), Duration::from_secs(30)).await })
    };
    tokio::time::sleep(Duration::from_millis(1000)).await;
    let busy = transfer(&url_b, key, &body(7), Duration::from_secs(10))
        .await
        .unwrap();
    assert_eq!(
        busy.status,
        StatusCode::CONFLICT,
        "in flight on A: {busy:?}"
    );
    assert_eq!(count(&url_b).await, 0, "A's row is not committed");

    a.0.kill().unwrap();
    let killed = Instant::now();
    let _ = a.0.wait();
    assert!(
        on_a.await.unwrap().is_none(),
        "the killed copy answered nothing"
    );
    assert_eq!(
        count(&url_b).await,
        0,
        "nothing of the killed copy's run stands"
    );

    // the key is free once the server has seen the connection go (well within the lease)
    let done = loop {
        let answer = transfer(&url_b, key, &body(7), Duration::from_secs(10))
            .await
            .unwrap();
        match answer.status {
            StatusCode::CREATED => break answer,
            StatusCode::CONFLICT if killed.elapsed() < Duration::from_secs(30) => {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            _ => panic!("the retry after the kill: {answer:?}"),
        }
    };
    assert!(!done.replayed, "the retry executes: {done:?}");
    let id = done.id().unwrap().to_owned();
    assert_eq!(count(&url_b).await, 1, "the retry inserted one row");
    for _ in 0..3 {
        let replay = transfer(&url_b, key, &body(7), Duration::from_secs(10))
            .await
            .unwrap();
        assert!(
            replay.status == StatusCode::CREATED && replay.replayed,
            "later retries replay: {replay:?}"
        );
        assert_eq!(replay.id(), Some(id.as_str()));
    }
    assert_eq!(count(&url_b).await, 1, "replays insert nothing");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn twenty_keys_insert_twenty_rows_and_each_replays_its_own_id() {
    let database = fresh_database().await;
    let vars = [("DATABASE_URL", database.as_str())];
    let (_a, url_a) = serve(&vars);
    let (_b, url_b) = serve(&vars);
    let urls = [url_a.as_str(), url_b.as_str()];
    let mut ids = Vec::new();
    for i in 0..20 {
        let key = format!("transfer-{i}");
        let answer = transfer(urls[i % 2], &key, &body(i as i64), Duration::from_secs(10))
            .await
            .unwrap();
        assert_eq!(answer.status, StatusCode::CREATED, "{key}: {answer:?}");
        assert!(!answer.replayed);
        ids.push(answer.id().unwrap().to_owned());
    }
    assert_eq!(count(&url_a).await, 20, "one row per key");
    let distinct: std::collections::BTreeSet<_> = ids.iter().collect();
    assert_eq!(distinct.len(), 20, "twenty distinct ids");
    for (i, id) in ids.iter().enumerate() {
        let key = format!("transfer-{i}");
        let replay = transfer(
            urls[(i + 1) % 2],
            &key,
            &body(i as i64),
            Duration::from_secs(10),
        )
        .await
        .unwrap();
        assert!(replay.replayed, "{key}: {replay:?}");
        assert_eq!(replay.status, StatusCode::CREATED);
        assert_eq!(replay.id(), Some(id.as_str()), "{key} replays its own id");
    }
    // a changed body under a used key is refused; a missing key too
    let changed = transfer(&url_a, "transfer-0", &body(999), Duration::from_secs(10))
        .await
        .unwrap();
    assert_eq!(
        changed.status,
        StatusCode::UNPROCESSABLE_ENTITY,
        "{changed:?}"
    );
    assert_eq!(
        count(&url_b).await,
        20,
        "replays and refusals insert nothing"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_key_or_a_database_transfers_are_refused_clearly() {
    let database = fresh_database().await;
    let (_a, url_a) = serve(&[("DATABASE_URL", database.as_str())]);
    let client = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .build_http::<Full<Bytes>>();
    let request = Request::post(format!("{url_a}/transfers"))
        .header("content-type", "application/json")
        .header("x-api-key", "alice")
        .body(Full::new(Bytes::from(body(1).to_string())))
        .unwrap();
    let response = client.request(request).await.unwrap();
    assert_eq!(
        response.status(),
        StatusCode::BAD_REQUEST,
        "no Idempotency-Key"
    );
    assert_eq!(count(&url_a).await, 0);

    let (_m, url_m) = serve(&[]);
    let answer = transfer(&url_m, "k", &body(1), Duration::from_secs(10))
        .await
        .unwrap();
    assert_eq!(answer.status, StatusCode::SERVICE_UNAVAILABLE, "{answer:?}");
    assert!(
        answer.json["error"]
            .as_str()
            .is_some_and(|e| e.contains("DATABASE_URL")),
        "{answer:?}"
    );
}
