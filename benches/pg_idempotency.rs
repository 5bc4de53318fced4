//! PostgreSQL idempotency benchmark: `cargo bench --bench pg_idempotency`.
//!
//! Starts its own PostgreSQL (initdb on a free port, as the tests do) and measures, in one run,
//! side by side, a handler that inserts one row into `bench_transfers`:
//!
//! - **plain handler**, no layer: the INSERT on a pooled connection (autocommit), the baseline;
//! - **layer**: `IdempotencyLayer::builder(store).unscoped()` around the same handler;
//! - **in transaction**: `IdempotencyLayer::in_transaction(store).unscoped()` around a handler
//!   that inserts the row through the `OnceTx` of its request's extensions.
//!
//! For each, first executions (a fresh key per request) and replays (a key already done),
//! sequentially (one request at a time, so the figures are latency): mean, p50 and p99 µs per
//! request, at loopback (`BENCH_N` requests, default 1,000) and with the store behind a proxy
//! that delays every reply by 1 ms (`BENCH_N_FAR`, default 150), and **transactions per
//! request** as the server counts them (`pg_stat_database.xact_commit + xact_rollback`, every
//! backend's stats flushed before each reading). The round trips per request are read from the
//! delay: the time the 1 ms adds over loopback, over what it adds to one `SELECT 1`.
//!
//! Every INSERT is one round trip (`execute_typed`: parse, bind and execute in one message), on
//! every path alike.
#![allow(clippy::unwrap_used, clippy::expect_used)]

#[path = "../tests/common/mod.rs"]
mod common;

use std::convert::Infallible;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use common::postgres::PgServer;
use common::proxy::Proxy;
use http::{Request, Response};
use http_body_util::{BodyExt, Full};
use tokio_postgres::types::Type;
use tollgate::idempotency::IdempotencyLayer;
use tollgate::store::{OnceTx, PgStore};
use tower::{ServiceBuilder, ServiceExt};

/// Requests per figure at loopback unless `BENCH_N` says otherwise.
const N: usize = 1_000;
/// Requests per figure at 1 ms unless `BENCH_N_FAR` says otherwise.
const N_FAR: usize = 150;
/// Added to every reply of the distant store.
const DISTANCE: Duration = Duration::from_millis(1);

const TABLE: &str =
    "CREATE TABLE IF NOT EXISTS bench_transfers (id text PRIMARY KEY, amount bigint)";
const INSERT: &str = "INSERT INTO bench_transfers (id, amount) VALUES ($1, $2)";

/// Ids of the inserted rows, unique over the run.
static NEXT_ID: AtomicU64 = AtomicU64::new(0);

fn env_or<T: std::str::FromStr>(name: &str, default: T) -> T {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn transfer(key: Option<&str>) -> Request<Full<Bytes>> {
    let mut req = Request::post("/transfers");
    if let Some(key) = key {
        req = req.header("idempotency-key", key);
    }
    req.body(Full::new(Bytes::from_static(br#"{"amount":100}"#)))
        .unwrap()
}

/// The handler's work: one row, in one round trip.
async fn insert(client: &tokio_postgres::Client) {
    let id = format!("tr-{}", NEXT_ID.fetch_add(1, Ordering::Relaxed));
    client
        .execute_typed(INSERT, &[(&id, Type::TEXT), (&100i64, Type::INT8)])
        .await
        .unwrap();
}

fn created() -> Response<Full<Bytes>> {
    Response::new(Full::new(Bytes::from_static(br#"{"amount":100}"#)))
}

/// The INSERT on a connection of its own from the store's pool, autocommit.
async fn pooled_handler(store: PgStore) -> Result<Response<Full<Bytes>>, Infallible> {
    let client = store.pool().get().await.unwrap();
    insert(&client).await;
    Ok(created())
}

/// The INSERT through the request's transaction.
async fn tx_handler<B>(req: Request<B>) -> Result<Response<Full<Bytes>>, Infallible> {
    let tx = req
        .extensions()
        .get::<OnceTx>()
        .expect("the layer's transaction")
        .clone();
    insert(&tx).await;
    Ok(created())
}

/// µs per request of `n` sequential requests made by `make(i)`, in order.
async fn per_request<S, B>(
    svc: &S,
    n: usize,
    make: impl Fn(usize) -> Request<Full<Bytes>>,
) -> Vec<f64>
where
    S: tower::Service<Request<Full<Bytes>>, Response = Response<B>, Error = Infallible> + Clone,
    B: http_body::Body,
    B::Error: std::fmt::Debug,
{
    let mut times = Vec::with_capacity(n);
    for i in 0..n {
        let start = Instant::now();
        let res = svc.clone().oneshot(make(i)).await.unwrap();
        let status = res.status();
        res.into_body().collect().await.unwrap();
        times.push(start.elapsed().as_secs_f64() * 1e6);
        assert!(status.is_success(), "request {i}: {status}");
    }
    times
}

#[derive(Clone, Copy)]
struct Timing {
    mean: f64,
    p50: f64,
    p99: f64,
}

fn timing(mut times: Vec<f64>) -> Timing {
    let mean = times.iter().sum::<f64>() / times.len() as f64;
    times.sort_by(f64::total_cmp);
    Timing {
        mean,
        p50: times[times.len() / 2],
        p99: times[times.len() * 99 / 100],
    }
}

/// Has every connection of `store`'s pool flush its statistics (one transaction each, counted);
/// returns how many it took.
async fn flush_pool(store: &PgStore) -> u64 {
    let size = store.pool().status().size;
    let clients = futures_util::future::try_join_all((0..size).map(|_| store.pool().get()))
        .await
        .unwrap();
    for client in &clients {
        client
            .batch_execute("SELECT pg_stat_force_next_flush()")
            .await
            .unwrap();
    }
    size as u64
}

/// Transactions the server counted in this database, this reading's own excepted: it flushes
/// the reader's earlier ones.
async fn xacts(reader: &tokio_postgres::Client) -> u64 {
    let messages = reader
        .simple_query(
            "SELECT pg_stat_force_next_flush(); \
             SELECT xact_commit + xact_rollback FROM pg_stat_database \
             WHERE datname = current_database()",
        )
        .await
        .unwrap();
    messages
        .iter()
        .filter_map(|m| match m {
            tokio_postgres::SimpleQueryMessage::Row(row) => row.get(0)?.parse().ok(),
            _ => None,
        })
        .last()
        .expect("a count")
}

/// A figure of one path and request kind at one distance.
struct Figure {
    time: Timing,
    /// Transactions per request, when counted.
    xacts: Option<f64>,
}

/// `n` sequential requests of `svc`, timed; with `reader`, the transactions they took on the
/// server per request.
async fn measure<S, B>(
    svc: &S,
    store: &PgStore,
    reader: Option<&tokio_postgres::Client>,
    n: usize,
    make: impl Fn(usize) -> Request<Full<Bytes>>,
) -> Figure
where
    S: tower::Service<Request<Full<Bytes>>, Response = Response<B>, Error = Infallible> + Clone,
    B: http_body::Body,
    B::Error: std::fmt::Debug,
{
    let before = match reader {
        Some(reader) => {
            flush_pool(store).await;
            Some(xacts(reader).await)
        }
        None => None,
    };
    let time = timing(per_request(svc, n, make).await);
    let xacts = match (reader, before) {
        (Some(reader), Some(before)) => {
            let flushes = flush_pool(store).await;
            // the reader's `before` reading, and one flush per pooled connection
            let taken = xacts(reader).await - before - 1 - flushes;
            Some(taken as f64 / n as f64)
        }
        _ => None,
    };
    Figure { time, xacts }
}

/// The five figures on `store`: the plain handler, then first executions and replays under
/// the layer and in a transaction.
async fn figures(
    store: &PgStore,
    reader: Option<&tokio_postgres::Client>,
    tag: &str,
    n: usize,
    warm: usize,
) -> [Figure; 5] {
    let plain = {
        let store = store.clone();
        ServiceBuilder::new()
            .service_fn(move |_: Request<Full<Bytes>>| pooled_handler(store.clone()))
    };
    let layered = {
        let handler_store = store.clone();
        ServiceBuilder::new()
            .layer(
                IdempotencyLayer::builder(store.clone())
                    .unscoped()
                    .build()
                    .unwrap(),
            )
            .service_fn(move |_: Request<_>| pooled_handler(handler_store.clone()))
    };
    let in_tx = ServiceBuilder::new()
        .layer(
            IdempotencyLayer::in_transaction(store.clone())
                .unscoped()
                .build()
                .unwrap(),
        )
        .service_fn(tx_handler);

    // warm up connections and prepared statements; the replayed keys are done
    let key = |path: &str, i: usize| format!("{tag}-{path}-{i}");
    per_request(&plain, warm, |_| transfer(None)).await;
    per_request(&layered, warm, |i| transfer(Some(&key("warm-layer", i)))).await;
    per_request(&in_tx, warm, |i| transfer(Some(&key("warm-tx", i)))).await;
    let (layer_done, tx_done) = (key("replayed-layer", 0), key("replayed-tx", 0));
    per_request(&layered, 1, |_| transfer(Some(&layer_done))).await;
    per_request(&in_tx, 1, |_| transfer(Some(&tx_done))).await;

    [
        measure(&plain, store, reader, n, |_| transfer(None)).await,
        measure(&layered, store, reader, n, |i| {
            transfer(Some(&key("first-layer", i)))
        })
        .await,
        measure(&layered, store, reader, n, |_| transfer(Some(&layer_done))).await,
        measure(&in_tx, store, reader, n, |i| {
            transfer(Some(&key("first-tx", i)))
        })
        .await,
        measure(&in_tx, store, reader, n, |_| transfer(Some(&tx_done))).await,
    ]
}

/// Mean µs of `n` `SELECT 1` on a connection to `url`.
async fn select_one(url: &str, n: usize) -> f64 {
    let (client, connection) = tokio_postgres::connect(url, tokio_postgres::NoTls)
        .await
        .unwrap();
    let connection = tokio::spawn(connection);
    client.simple_query("SELECT 1").await.unwrap();
    let start = Instant::now();
    for _ in 0..n {
        client.simple_query("SELECT 1").await.unwrap();
    }
    let mean = start.elapsed().as_secs_f64() * 1e6 / n as f64;
    drop(client);
    let _ = connection.await;
    mean
}

async fn store(url: String) -> PgStore {
    PgStore::builder(url)
        .timeout(Duration::from_secs(2))
        .purge_interval(None)
        .connect()
        .await
        .unwrap()
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let n = env_or("BENCH_N", N);
    let n_far = env_or("BENCH_N_FAR", N_FAR);
    let server = PgServer::start();
    let reader = server.client().await;
    reader.batch_execute(TABLE).await.unwrap();
    let near = store(server.url()).await;
    let proxy = Proxy::start(server.addr()).await;
    proxy.delay_replies(DISTANCE);
    let far_url = format!("postgres://postgres@{}/postgres", proxy.addr());
    let far = store(far_url.clone()).await;

    // what one round trip costs through the delaying proxy
    let trip = select_one(&far_url, 100).await - select_one(&server.url(), 1_000).await;

    let at_loopback = figures(&near, Some(&reader), "near", n, 200).await;
    let at_distance = figures(&far, None, "far", n_far, 20).await;

    let rows = [
        ("plain handler, no layer", "INSERT"),
        ("layer (`builder`)", "first execution"),
        ("layer (`builder`)", "replay"),
        ("layer (`in_transaction`)", "first execution"),
        ("layer (`in_transaction`)", "replay"),
    ];
    println!(
        "\n## Idempotency on PostgreSQL (PgStore, sequential requests; {n} each at loopback, \
         {n_far} each at 1 ms)\n"
    );
    println!(
        "| path | request | transactions per request | loopback µs mean / p50 / p99 \
         | +1 ms per reply: µs mean / p50 / p99 | round trips |"
    );
    println!("| --- | --- | ---: | ---: | ---: | ---: |");
    for (i, (path, request)) in rows.iter().enumerate() {
        let (near, far) = (&at_loopback[i], &at_distance[i]);
        let xacts = near.xacts.map_or(String::from("—"), |x| format!("{x:.2}"));
        let trips = (far.time.mean - near.time.mean) / trip;
        println!(
            "| {path} | {request} | {xacts} | {:.0} / {:.0} / {:.0} | {:.0} / {:.0} / {:.0} \
             | {trips:.2} |",
            near.time.mean, near.time.p50, near.time.p99, far.time.mean, far.time.p50, far.time.p99,
        );
    }
    println!(
        "\nRound trips: the mean time the 1 ms per reply adds, over what it adds to one \
         `SELECT 1` ({trip:.0} µs). Transactions: `pg_stat_database`, at loopback."
    );
}
