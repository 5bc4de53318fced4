//! `IdempotencyLayer::in_transaction` on a real PostgreSQL: the handler writes through the
//! transaction it finds in its extensions, and its rows stand exactly when its response is
//! recorded — under tower, axum and tonic; a failed, panicking or unrecordable handler leaves
//! nothing, and its key runs again.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use crate::common::proxy::Proxy;
use crate::common::{self, postgres};
use crate::grpc_server::helloworld::greeter_client::GreeterClient;
use crate::grpc_server::helloworld::greeter_server::{Greeter, GreeterServer};
use crate::grpc_server::helloworld::{HelloReply, HelloRequest};

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::routing::post;
use bytes::Bytes;
use http::{Request, StatusCode};
use http_body_util::BodyExt;
use tokio::net::TcpListener;
use tollgate::idempotency::{IdempotencyLayer, OnConcurrent};
use tollgate::store::{OnceTx, PgStore};
use tonic::{Code, Status};
use tower::ServiceExt;

/// A migrated store in a schema of its own, and the name of a fresh table of rows in it.
async fn store_and_table() -> (PgStore, String) {
    let store = postgres::store().await;
    let table = format!("{}.rows", store.schema());
    let client = store.pool().get().await.unwrap();
    client
        .batch_execute(&format!("CREATE TABLE {table} (note text NOT NULL)"))
        .await
        .unwrap();
    (store, table)
}

async fn rows(store: &PgStore, table: &str) -> i64 {
    let client = store.pool().get().await.unwrap();
    let row = client
        .query_one(&format!("SELECT count(*) FROM {table}"), &[])
        .await
        .unwrap();
    row.get(0)
}

/// An axum app behind `layer` whose `POST /{outcome}` inserts a row through the transaction,
/// waits `wait`, then answers as `outcome` says: `client` 400, `fail` 500, `panic` panics, `big`
/// a 4 KiB body, anything else 201 with the outcome as its body.
fn app_with(layer: IdempotencyLayer, table: &str, wait: Duration) -> Router {
    app_counting(layer, table, wait).0
}

/// [`app_with`], and how many rows its handler has inserted (committed or not).
fn app_counting(
    layer: IdempotencyLayer,
    table: &str,
    wait: Duration,
) -> (Router, Arc<AtomicUsize>) {
    let insert = format!("INSERT INTO {table} (note) VALUES ($1)");
    let inserted = Arc::new(AtomicUsize::new(0));
    let counted = Arc::clone(&inserted);
    let app = Router::new()
        .route(
            "/{outcome}",
            post(
                move |axum::extract::Path(outcome): axum::extract::Path<String>,
                      tx: OnceTx| async move {
                    let statement = tx.prepare_cached(&insert).await.unwrap();
                    tx.execute(&statement, &[&outcome]).await.unwrap();
                    counted.fetch_add(1, Ordering::SeqCst);
                    tokio::time::sleep(wait).await;
                    match outcome.as_str() {
                        "client" => (StatusCode::BAD_REQUEST, "refused".to_owned()),
                        "fail" => (StatusCode::INTERNAL_SERVER_ERROR, "failed".to_owned()),
                        "big" => (StatusCode::CREATED, "x".repeat(4096)),
                        "panic" => panic!("the handler panicked"),
                        _ => (StatusCode::CREATED, outcome),
                    }
                },
            ),
        )
        .layer(layer);
    (app, inserted)
}

/// Returns once the handler has inserted `rows` rows.
async fn inserted(inserted: &AtomicUsize, rows: usize) {
    common::wait_for(&format!("{rows} rows inserted"), || {
        inserted.load(Ordering::SeqCst) >= rows
    })
    .await;
}

/// The app with a storage cap of 1 KiB.
fn app(store: &PgStore, table: &str) -> Router {
    let layer = IdempotencyLayer::in_transaction(store.clone())
        .unscoped()
        .response_limit(1024)
        .build()
        .unwrap();
    app_with(layer, table, Duration::ZERO)
}

async fn send(app: &Router, outcome: &str, key: &str) -> (StatusCode, bool, Bytes) {
    let request = Request::post(format!("/{outcome}"))
        .header("idempotency-key", key)
        .body(Body::empty())
        .unwrap();
    let response = app.clone().oneshot(request).await.unwrap();
    let replayed = response.headers().contains_key("idempotent-replayed");
    let status = response.status();
    let body = response.into_body().collect().await.unwrap().to_bytes();
    (status, replayed, body)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rows_stand_exactly_when_the_response_is_recorded() {
    let (store, table) = store_and_table().await;
    let app = app(&store, &table);

    let (status, replayed, body) = send(&app, "ok", "k-ok").await;
    assert_eq!(
        (status, replayed, &body[..]),
        (StatusCode::CREATED, false, &b"ok"[..])
    );
    let (status, replayed, body) = send(&app, "ok", "k-ok").await;
    assert_eq!(
        (status, replayed, &body[..]),
        (StatusCode::CREATED, true, &b"ok"[..])
    );
    assert_eq!(
        rows(&store, &table).await,
        1,
        "one row for the key, replayed once"
    );

    // a 4xx is a final answer: recorded with its row, and replayed
    let (status, replayed, _) = send(&app, "client", "k-client").await;
    assert_eq!((status, replayed), (StatusCode::BAD_REQUEST, false));
    let (status, replayed, _) = send(&app, "client", "k-client").await;
    assert_eq!((status, replayed), (StatusCode::BAD_REQUEST, true));
    assert_eq!(rows(&store, &table).await, 2);

    // a 5xx is not recorded: its row is rolled back, and a retry runs again
    for _ in 0..2 {
        let (status, replayed, _) = send(&app, "fail", "k-fail").await;
        assert_eq!(
            (status, replayed),
            (StatusCode::INTERNAL_SERVER_ERROR, false)
        );
    }
    assert_eq!(rows(&store, &table).await, 2, "a 5xx leaves no row");

    // a panic: 500 from the layer, nothing stands, and the key runs again
    for _ in 0..2 {
        let (status, replayed, _) = send(&app, "panic", "k-panic").await;
        assert_eq!(
            (status, replayed),
            (StatusCode::INTERNAL_SERVER_ERROR, false)
        );
    }
    assert_eq!(rows(&store, &table).await, 2, "a panic leaves no row");

    // a response over the storage cap cannot be recorded: 503 instead of it, rolled back
    let (status, replayed, body) = send(&app, "big", "k-big").await;
    assert_eq!(
        (status, replayed),
        (StatusCode::SERVICE_UNAVAILABLE, false),
        "{body:?}"
    );
    assert_eq!(
        rows(&store, &table).await,
        2,
        "an unrecordable response leaves no row"
    );

    // a request without a key is refused: the key is required, so every handler has its
    // transaction
    let keyless = Request::post("/ok").body(Body::empty()).unwrap();
    let response = app.clone().oneshot(keyless).await.unwrap();
    assert_eq!(response.status(), StatusCode::BAD_REQUEST);
    assert_eq!(rows(&store, &table).await, 2);

    // another request under a used key is refused
    let (status, _, _) = send(&app, "client", "k-ok").await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(rows(&store, &table).await, 2);
    // the pool's connections came back out of their transactions: a fresh key still runs
    for i in 0..20 {
        let (status, _, _) = send(&app, "ok", &format!("k-more-{i}")).await;
        assert_eq!(status, StatusCode::CREATED);
    }
    assert_eq!(rows(&store, &table).await, 22);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_whose_key_is_in_flight_gets_409_and_no_row() {
    let (store, table) = store_and_table().await;
    let layer = IdempotencyLayer::in_transaction(store.clone())
        .unscoped()
        .build()
        .unwrap();
    let (app, rows_inserted) = app_counting(layer, &table, Duration::from_secs(2));
    let (first, second) = tokio::join!(send(&app, "slow", "k-slow"), async {
        inserted(&rows_inserted, 1).await;
        send(&app, "slow", "k-slow").await
    });
    assert_eq!(first.0, StatusCode::CREATED);
    assert_eq!(second.0, StatusCode::CONFLICT, "the key is in flight");
    assert_eq!(rows(&store, &table).await, 1);
}

/// A greeter that inserts a row through the transaction of its call and counts its runs.
#[derive(Clone)]
struct LedgerGreeter {
    insert: Arc<str>,
    runs: Arc<AtomicUsize>,
}

#[tonic::async_trait]
impl Greeter for LedgerGreeter {
    async fn say_hello(
        &self,
        request: tonic::Request<HelloRequest>,
    ) -> Result<tonic::Response<HelloReply>, Status> {
        let run = self.runs.fetch_add(1, Ordering::SeqCst) + 1;
        let tx = request
            .extensions()
            .get::<OnceTx>()
            .cloned()
            .ok_or_else(|| Status::internal("no transaction"))?;
        let name = request.into_inner().name;
        tx.execute(&*self.insert, &[&name])
            .await
            .map_err(|e| Status::unavailable(e.to_string()))?;
        if name == "unavailable" {
            return Err(Status::unavailable("try again"));
        }
        Ok(tonic::Response::new(HelloReply {
            message: format!("Hello {name}, run {run}"),
        }))
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tonic_handlers_write_through_the_transaction_of_their_call() {
    let (store, table) = store_and_table().await;
    let greeter = LedgerGreeter {
        insert: format!("INSERT INTO {table} (note) VALUES ($1)").into(),
        runs: Arc::default(),
    };
    let layer = IdempotencyLayer::in_transaction(store.clone())
        .unscoped()
        .build()
        .unwrap();
    let server = tonic::transport::Server::builder()
        .layer(layer)
        .add_service(GreeterServer::new(greeter.clone()));
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(server.serve_with_incoming(tonic::transport::server::TcpIncoming::from(listener)));
    let client = GreeterClient::connect(url).await.unwrap();
    let call = |name: &str, key: &str| {
        let mut client = client.clone();
        let mut request = tonic::Request::new(HelloRequest {
            name: name.to_owned(),
        });
        request
            .metadata_mut()
            .insert("idempotency-key", key.parse().unwrap());
        async move { client.say_hello(request).await }
    };

    let first = call("ada", "g-1").await.unwrap();
    let replay = call("ada", "g-1").await.unwrap();
    assert_eq!(first.get_ref().message, "Hello ada, run 1");
    assert_eq!(replay.get_ref().message, "Hello ada, run 1");
    assert_eq!(
        replay.metadata().get("idempotent-replayed").unwrap(),
        "true"
    );
    assert_eq!(greeter.runs.load(Ordering::SeqCst), 1);
    assert_eq!(rows(&store, &table).await, 1);

    // a retryable status is not recorded: its row is rolled back and the retry runs again
    for run in [2, 3] {
        let status = call("unavailable", "g-2").await.unwrap_err();
        assert_eq!(status.code(), Code::Unavailable);
        assert_eq!(greeter.runs.load(Ordering::SeqCst), run);
    }
    assert_eq!(rows(&store, &table).await, 1, "UNAVAILABLE leaves no row");

    // another request under a used key: FAILED_PRECONDITION, nothing runs
    let status = call("grace", "g-1").await.unwrap_err();
    assert_eq!(status.code(), Code::FailedPrecondition);
    assert_eq!(greeter.runs.load(Ordering::SeqCst), 3);
    assert_eq!(rows(&store, &table).await, 1);
}

/// The app with `lease`, its handler waiting `wait` before it answers.
fn slow_app(store: &PgStore, table: &str, lease: Duration, wait: Duration) -> Router {
    let layer = IdempotencyLayer::in_transaction(store.clone())
        .unscoped()
        .lease(lease)
        .build()
        .unwrap();
    app_with(layer, table, wait)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn records_outlive_the_lease_and_an_idle_transaction_ends_at_it() {
    let (store, table) = store_and_table().await;
    let lease = Duration::from_millis(300);

    // the record is kept for the retention (a day), not the lease (a lease of its own: a quick
    // run must not meet the idle limit however slow the machine)
    let quick = slow_app(&store, &table, Duration::from_secs(2), Duration::ZERO);
    assert_eq!(send(&quick, "kept", "k-kept").await.0, StatusCode::CREATED);
    tokio::time::sleep(Duration::from_secs(3)).await;
    let (status, replayed, body) = send(&quick, "kept", "k-kept").await;
    assert_eq!(
        (status, replayed, &body[..]),
        (StatusCode::CREATED, true, &b"kept"[..])
    );
    assert_eq!(rows(&store, &table).await, 1);

    // a handler idle in its transaction for longer than the lease: the server ends the
    // transaction, the response is not recorded (503), and nothing stands
    let idle = slow_app(&store, &table, lease, lease * 4);
    let (status, replayed, _) = send(&idle, "idle", "k-idle").await;
    assert_eq!((status, replayed), (StatusCode::SERVICE_UNAVAILABLE, false));
    assert_eq!(
        rows(&store, &table).await,
        1,
        "the idle transaction left no row"
    );
    // the key is free: a quick retry runs, once
    let (status, replayed, _) = send(&quick, "idle", "k-idle").await;
    assert_eq!((status, replayed), (StatusCode::CREATED, false));
    assert_eq!(rows(&store, &table).await, 2);
}

/// The layer on a store that reaches the server through `proxy`, in the schema of `direct`.
fn layer_through(proxy: &Proxy, direct: &PgStore) -> IdempotencyLayer {
    let store = PgStore::builder(format!("postgres://postgres@{}/postgres", proxy.addr()))
        .schema(direct.schema().to_owned())
        .timeout(Duration::from_secs(2))
        .pool_size(2)
        .purge_interval(None)
        .build()
        .unwrap();
    IdempotencyLayer::in_transaction(store)
        .unscoped()
        .build()
        .unwrap()
}

/// An app whose handler inserts a row, calls `fault` with `proxy` on its first run only — as
/// the layer is about to send the record and `COMMIT` — and answers `201 made`.
fn app_with_fault(
    layer: IdempotencyLayer,
    table: &str,
    proxy: &Arc<Proxy>,
    fault: impl Fn(&Arc<Proxy>) + Clone + Send + Sync + 'static,
) -> Router {
    let insert = format!("INSERT INTO {table} (note) VALUES ('made')");
    let proxy = Arc::clone(proxy);
    let first = Arc::new(std::sync::atomic::AtomicBool::new(true));
    Router::new()
        .route(
            "/{outcome}",
            post(move |tx: OnceTx| async move {
                tx.execute(&insert, &[]).await.unwrap();
                if first.swap(false, Ordering::SeqCst) {
                    fault(&proxy);
                }
                (StatusCode::CREATED, "made")
            }),
        )
        .layer(layer)
}

/// Runs `then` on `proxy` after `after`, in the background.
fn later(proxy: &Arc<Proxy>, after: Duration, then: impl FnOnce(&Proxy) + Send + 'static) {
    let proxy = Arc::clone(proxy);
    tokio::spawn(async move {
        tokio::time::sleep(after).await;
        then(&proxy);
    });
}

/// The connection breaks while the server carries out the handler's `COMMIT` (a deferred
/// trigger makes it take a second): the layer finds it committed and answers the response,
/// which retries then replay — one row.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_commit_whose_answer_is_lost_is_found_committed_and_answered() {
    let (direct, table) = store_and_table().await;
    let schema = direct.schema().to_owned();
    let server = tokio::task::spawn_blocking(postgres::shared).await.unwrap();
    postgres::slow_commits(&schema, &table).await;
    let proxy = Arc::new(Proxy::start(server.addr()).await);
    // the connection breaks while the server carries out the COMMIT, and heals
    let app = app_with_fault(layer_through(&proxy, &direct), &table, &proxy, |proxy| {
        later(proxy, Duration::from_millis(400), Proxy::cut);
        later(proxy, Duration::from_millis(500), Proxy::heal);
    });
    let (status, replayed, body) = send(&app, "cut", "k-lost-answer").await;
    assert_eq!(
        (status, replayed, &body[..]),
        (StatusCode::CREATED, false, &b"made"[..]),
        "a commit carried out is answered"
    );
    assert_eq!(rows(&direct, &table).await, 1);
    let (status, replayed, body) = send(&app, "cut", "k-lost-answer").await;
    assert_eq!(
        (status, replayed, &body[..]),
        (StatusCode::CREATED, true, &b"made"[..])
    );
    assert_eq!(rows(&direct, &table).await, 1, "the retry replayed");
}

/// `COMMIT` goes into a partition and the connection breaks: nothing stands, the caller gets
/// `503`, and a retry runs once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_commit_that_never_arrived_is_answered_503_and_the_retry_runs_once() {
    let (direct, table) = store_and_table().await;
    let server = tokio::task::spawn_blocking(postgres::shared).await.unwrap();
    let proxy = Arc::new(Proxy::start(server.addr()).await);
    // what follows (the record and COMMIT) goes into the dark, then breaks; the held bytes go
    // with the connection, and only then may anything flow
    let app = app_with_fault(layer_through(&proxy, &direct), &table, &proxy, |proxy| {
        proxy.silence();
        later(proxy, Duration::from_millis(300), Proxy::cut);
        later(proxy, Duration::from_millis(400), |proxy| {
            proxy.unsilence();
            proxy.heal();
        });
    });
    let (status, replayed, _) = send(&app, "dark", "k-dark").await;
    assert_eq!((status, replayed), (StatusCode::SERVICE_UNAVAILABLE, false));
    assert_eq!(rows(&direct, &table).await, 0, "nothing of the run stands");
    tokio::time::sleep(Duration::from_millis(300)).await;
    let (status, replayed, _) = send(&app, "dark", "k-dark").await;
    assert_eq!(
        (status, replayed),
        (StatusCode::CREATED, false),
        "the retry runs"
    );
    assert_eq!(rows(&direct, &table).await, 1);
}

/// With `OnConcurrent::Wait`, a request whose key is running waits for its commit and replays
/// it: one row, two identical answers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiting_request_replays_the_commit_it_waited_for() {
    let (store, table) = store_and_table().await;
    let layer = IdempotencyLayer::in_transaction(store.clone())
        .unscoped()
        .on_concurrent(OnConcurrent::Wait(Duration::from_secs(5)))
        .build()
        .unwrap();
    let (app, rows_inserted) = app_counting(layer, &table, Duration::from_millis(400));
    let (first, second) = tokio::join!(send(&app, "waited", "k-wait"), async {
        inserted(&rows_inserted, 1).await;
        send(&app, "waited", "k-wait").await
    });
    assert_eq!(
        first,
        (StatusCode::CREATED, false, Bytes::from_static(b"waited"))
    );
    assert_eq!(
        second,
        (StatusCode::CREATED, true, Bytes::from_static(b"waited"))
    );
    assert_eq!(rows(&store, &table).await, 1);
}

/// The record and `COMMIT` are held by a partition past the store timeout, then delivered: the
/// layer does not answer before the run's transaction is over on the server — the late commit
/// counts, and the caller gets the response it recorded (one row; retries replay it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_commit_held_by_a_partition_and_delivered_late_is_answered_as_it_ended() {
    let (direct, table) = store_and_table().await;
    let server = tokio::task::spawn_blocking(postgres::shared).await.unwrap();
    let proxy = Arc::new(Proxy::start(server.addr()).await);
    // the record and COMMIT wait in the partition for 3 s (the store timeout is 2 s), then
    // arrive; nothing is cut
    let app = app_with_fault(layer_through(&proxy, &direct), &table, &proxy, |proxy| {
        proxy.silence();
        later(proxy, Duration::from_secs(3), Proxy::unsilence);
    });
    let started = std::time::Instant::now();
    let (status, replayed, body) = send(&app, "late", "k-late").await;
    assert_eq!(
        (status, replayed, &body[..]),
        (StatusCode::CREATED, false, &b"made"[..]),
        "the late commit is found committed"
    );
    assert!(
        started.elapsed() >= Duration::from_secs(3),
        "answered before the held commit arrived: {:?}",
        started.elapsed()
    );
    assert_eq!(rows(&direct, &table).await, 1);
    let (status, replayed, _) = send(&app, "late", "k-late").await;
    assert_eq!((status, replayed), (StatusCode::CREATED, true));
    assert_eq!(rows(&direct, &table).await, 1, "the retry replayed");
}

/// PostgreSQL restarts while a handler runs: its transaction is gone, so the caller gets `503`
/// and nothing stands; a request committed before the restart still replays after it, and the
/// interrupted key runs once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_database_restart_mid_request_leaves_nothing_and_records_survive() {
    let server = Arc::new(std::sync::Mutex::new(
        tokio::task::spawn_blocking(postgres::PgServer::start)
            .await
            .unwrap(),
    ));
    let url = server.lock().unwrap().url();
    let store = PgStore::builder(url)
        .timeout(Duration::from_secs(2))
        .pool_size(4)
        .purge_interval(None)
        .connect()
        .await
        .unwrap();
    let table = format!("{}.rows", store.schema());
    let client = store.pool().get().await.unwrap();
    client
        .batch_execute(&format!("CREATE TABLE {table} (note text NOT NULL)"))
        .await
        .unwrap();
    drop(client);
    let layer = IdempotencyLayer::in_transaction(store.clone())
        .unscoped()
        .build()
        .unwrap();
    let (app, rows_inserted) = app_counting(layer, &table, Duration::from_millis(1500));
    assert_eq!(
        send(&app, "before", "k-before").await.0,
        StatusCode::CREATED
    );

    let restarting = Arc::clone(&server);
    let restart = tokio::spawn(async move {
        // the run's row is inserted, not committed
        inserted(&rows_inserted, 2).await;
        tokio::task::spawn_blocking(move || restarting.lock().unwrap().restart())
            .await
            .unwrap();
    });
    let (status, replayed, _) = send(&app, "during", "k-during").await;
    restart.await.unwrap();
    assert_eq!((status, replayed), (StatusCode::SERVICE_UNAVAILABLE, false));
    assert_eq!(
        rows(&store, &table).await,
        1,
        "only the row committed before"
    );

    let (status, replayed, body) = send(&app, "before", "k-before").await;
    assert_eq!(
        (status, replayed, &body[..]),
        (StatusCode::CREATED, true, &b"before"[..])
    );
    let (status, replayed, _) = send(&app, "during", "k-during").await;
    assert_eq!(
        (status, replayed),
        (StatusCode::CREATED, false),
        "the key runs once"
    );
    assert_eq!(rows(&store, &table).await, 2);
}

/// The `OnceTx` extractor (feature `axum`): a request no transaction runs for is refused with
/// a `500` that names the cause; `Option<OnceTx>` is `None` for a request without a key where
/// the key is optional, and the transaction where there is one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_extractor_takes_the_transaction_or_says_why_there_is_none() {
    let (store, table) = store_and_table().await;
    let bare = Router::new().route("/bare", post(|_tx: OnceTx| async { "ran" }));
    let response = bare
        .oneshot(Request::post("/bare").body(Body::empty()).unwrap())
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(
        response.headers()["content-type"],
        "application/problem+json"
    );
    let body = response.into_body().collect().await.unwrap().to_bytes();
    let problem: serde_json::Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(problem["status"], 500);
    assert!(
        problem["detail"]
            .as_str()
            .unwrap()
            .contains("IdempotencyLayer::in_transaction"),
        "{problem}"
    );

    let layer = IdempotencyLayer::in_transaction(store.clone())
        .unscoped()
        .required(false)
        .build()
        .unwrap();
    let insert = format!("INSERT INTO {table} (note) VALUES ('optional')");
    let optional = Router::new()
        .route(
            "/{outcome}",
            post(move |tx: Option<OnceTx>| async move {
                match tx {
                    Some(tx) => {
                        tx.execute(&insert, &[]).await.unwrap();
                        (StatusCode::CREATED, "in a transaction")
                    }
                    None => (StatusCode::OK, "without one"),
                }
            }),
        )
        .layer(layer);
    let keyless = optional
        .clone()
        .oneshot(Request::post("/x").body(Body::empty()).unwrap())
        .await
        .unwrap();
    assert_eq!(keyless.status(), StatusCode::OK);
    let body = keyless.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(&body[..], b"without one");
    assert_eq!(rows(&store, &table).await, 0);
    assert_eq!(
        send(&optional, "x", "k-optional").await,
        (
            StatusCode::CREATED,
            false,
            Bytes::from_static(b"in a transaction")
        )
    );
    assert_eq!(
        send(&optional, "x", "k-optional").await,
        (
            StatusCode::CREATED,
            true,
            Bytes::from_static(b"in a transaction")
        )
    );
    assert_eq!(rows(&store, &table).await, 1);
}
