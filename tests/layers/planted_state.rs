//! State planted in Redis by someone else — a crafted or corrupt value of any type under the keys
//! of a caller's limits, a lock, permits and an idempotency record: every layer still answers,
//! and the store's reads and writes end in a value or an error. Nothing panics.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use crate::common;

use std::convert::Infallible;
use std::time::Duration;

use http::{Request, Response, StatusCode};
use proptest::prelude::*;
use proptest::test_runner::TestCaseError;
use tower::{ServiceBuilder, ServiceExt};

use common::RedisServer;
use common::check;
use tollgate::concurrency::ConcurrencyLimitLayer;
use tollgate::idempotency::IdempotencyLayer;
use tollgate::key::Header;
use tollgate::lock::{LockError, Locks};
use tollgate::rate_limit::{Algorithm, Limit, RateLimitLayer};
use tollgate::store::{IdempotencyStore, LockStore, MemoryStore, PermitStore, RateStore, keys};

const CALLER: &str = "x-api-key";

/// A value a planted key holds.
#[derive(Debug, Clone)]
enum Plant {
    Nothing,
    Text(Vec<u8>),
    Hash(Vec<(Vec<u8>, Vec<u8>)>),
    Zset(Vec<(f64, Vec<u8>)>),
    List(Vec<Vec<u8>>),
}

/// Text as a hostile writer leaves it where a number, a token or a record is read.
fn text() -> impl Strategy<Value = Vec<u8>> {
    let numbers = [
        "-1",
        "0",
        "-9223372036854775808",
        "9223372036854775807",
        "18446744073709551616",
        "1e308",
        "-1e308",
        "nan",
        "inf",
        "-inf",
        "0x10",
        "1.5",
        "",
        "p:1:2",
        "p:",
        ":::",
        "done",
        "run",
    ];
    prop_oneof![
        prop::sample::select(numbers.to_vec()).prop_map(|t| t.as_bytes().to_vec()),
        any::<i64>().prop_map(|n| n.to_string().into_bytes()),
        prop::collection::vec(any::<u8>(), 0..24),
    ]
}

fn field() -> impl Strategy<Value = Vec<u8>> {
    let names = ["s", "t", "r", "f", "c", "a", "n", "tat", "w", "p", "done"];
    prop_oneof![
        3 => prop::sample::select(names.to_vec()).prop_map(|t| t.as_bytes().to_vec()),
        1 => prop::collection::vec(any::<u8>(), 0..8),
    ]
}

fn score() -> impl Strategy<Value = f64> {
    prop_oneof![
        Just(0.0),
        Just(-1.0),
        Just(1e308),
        Just(-1e308),
        Just(9.3e18),
        -1e16f64..1e16,
    ]
}

fn plant() -> impl Strategy<Value = Plant> {
    prop_oneof![
        2 => Just(Plant::Nothing),
        3 => text().prop_map(Plant::Text),
        2 => prop::collection::vec((field(), text()), 1..5).prop_map(Plant::Hash),
        2 => prop::collection::vec((score(), text()), 1..5).prop_map(Plant::Zset),
        1 => prop::collection::vec(text(), 1..4).prop_map(Plant::List),
    ]
}

/// Writes `plant` under `key`, replacing what it held.
fn put(conn: &mut redis::Connection, key: &str, plant: &Plant) {
    let () = redis::cmd("DEL").arg(key).query(conn).unwrap_or(());
    let _: i64 = match plant {
        Plant::Nothing => 0,
        Plant::Text(text) => {
            let () = redis::cmd("SET").arg(key).arg(text).query(conn).unwrap();
            1
        }
        Plant::Hash(pairs) => {
            let mut cmd = redis::cmd("HSET");
            cmd.arg(key);
            for (field, value) in pairs {
                cmd.arg(field).arg(value);
            }
            cmd.query(conn).unwrap()
        }
        Plant::Zset(members) => {
            let mut cmd = redis::cmd("ZADD");
            cmd.arg(key);
            for (score, member) in members {
                cmd.arg(*score).arg(member);
            }
            cmd.query(conn).unwrap()
        }
        Plant::List(items) => redis::cmd("RPUSH").arg(key).arg(items).query(conn).unwrap(),
    };
}

fn algorithm() -> impl Strategy<Value = Algorithm> {
    prop::sample::select(vec![
        Algorithm::SlidingLog,
        Algorithm::SlidingCounter,
        Algorithm::Gcra,
    ])
}

/// The plants of one case: the caller's limits (and its block), a lock and its fence, permits
/// and their queue, an idempotency record and its pending marker.
#[derive(Debug, Clone)]
struct Case {
    algorithm: Algorithm,
    rate: Vec<Plant>,
    lock: [Plant; 2],
    permits: [Plant; 3],
    record: [Plant; 2],
}

fn case() -> impl Strategy<Value = Case> {
    (
        algorithm(),
        prop::collection::vec(plant(), 3),
        [plant(), plant()],
        [plant(), plant(), plant()],
        [plant(), plant()],
    )
        .prop_map(|(algorithm, rate, lock, permits, record)| Case {
            algorithm,
            rate,
            lock,
            permits,
            record,
        })
}

fn ok() -> Response<String> {
    Response::new("ok".to_owned())
}

fn get(path: &str) -> Request<String> {
    Request::post(path)
        .header(CALLER, "planted")
        .header("idempotency-key", "planted")
        .body(String::new())
        .unwrap()
}

/// A retry-after header, where there is one, is a whole number of seconds.
fn retry_after_is_seconds(response: &Response<impl Sized>) -> Result<(), TestCaseError> {
    if let Some(value) = response.headers().get("retry-after") {
        let text = value.to_str().unwrap();
        prop_assert!(text.parse::<u64>().is_ok(), "retry-after: {text}");
    }
    Ok(())
}

/// The keys of the state the layers below keep for caller `planted`: its limits under
/// `algorithm` (and the burst limit's block), its permits, lock `planted` and its fence, and its
/// idempotency record `planted`.
struct Keys {
    rate: Vec<String>,
    permits: String,
    lock: (String, String),
    record: String,
}

fn rate_layer<S: RateStore>(store: S, algorithm: Algorithm) -> RateLimitLayer<Header> {
    RateLimitLayer::builder(store)
        .algorithm(algorithm)
        .limit(Limit::per_second("burst", 3).block_for(Duration::from_secs(2)))
        .limit(Limit::per_minute("minute", 50))
        .key(Header::from_static(CALLER))
        .build()
        .unwrap()
}

impl Keys {
    fn of(algorithm: Algorithm) -> Self {
        let caller = Header::from_static(CALLER).key(b"planted");
        let policy = rate_layer(MemoryStore::new(), algorithm).policy();
        Self {
            rate: policy.reset_keys(&caller),
            permits: keys::permits(keys::DEFAULT_PREFIX, &caller).unwrap(),
            lock: keys::lock(keys::DEFAULT_PREFIX, "planted").unwrap(),
            record: keys::idempotency_record(keys::DEFAULT_PREFIX, Some(caller), "planted")
                .unwrap(),
        }
    }
}

/// Every layer and store read over the state planted for caller `planted`: each answers.
async fn answered<S>(store: &S, algorithm: Algorithm) -> Result<(), TestCaseError>
where
    S: RateStore + PermitStore + LockStore + IdempotencyStore + Clone,
{
    let keys = Keys::of(algorithm);
    rate_limited(store, algorithm).await?;
    concurrency_limited(store).await?;
    locked(store).await?;
    deduplicated(store).await?;
    // the reads of what was planted end in a value or an error
    let _ = store.permit_usage(&keys.permits).await;
    let _ = store.lock_state(&keys.lock.0, &keys.lock.1).await;
    let _ = store.idempotency_state(&keys.record).await;
    Ok(())
}

async fn rate_limited<S: RateStore + Clone>(
    store: &S,
    algorithm: Algorithm,
) -> Result<(), TestCaseError> {
    let service = ServiceBuilder::new()
        .layer(rate_layer(store.clone(), algorithm))
        .service(tower::service_fn(|_: Request<String>| async {
            Ok::<_, Infallible>(ok())
        }));
    let response = service.oneshot(get("/limited")).await.unwrap();
    // a store error lets the request through (the default policy)
    prop_assert!(
        [StatusCode::OK, StatusCode::TOO_MANY_REQUESTS].contains(&response.status()),
        "{}",
        response.status()
    );
    retry_after_is_seconds(&response)
}

async fn concurrency_limited<S: PermitStore + Clone>(store: &S) -> Result<(), TestCaseError> {
    let layer = ConcurrencyLimitLayer::builder(store.clone())
        .limit(1)
        .key(Header::from_static(CALLER))
        .build()
        .unwrap();
    let service = ServiceBuilder::new()
        .layer(layer)
        .service(tower::service_fn(|_: Request<String>| async {
            Ok::<_, Infallible>(ok())
        }));
    let response = service.oneshot(get("/jobs")).await.unwrap();
    let answers = [
        StatusCode::OK,
        StatusCode::TOO_MANY_REQUESTS,
        StatusCode::SERVICE_UNAVAILABLE,
    ];
    prop_assert!(
        answers.contains(&response.status()),
        "{}",
        response.status()
    );
    retry_after_is_seconds(&response)
}

async fn locked<S: LockStore + Clone>(store: &S) -> Result<(), TestCaseError> {
    match Locks::new(store.clone())
        .try_acquire("planted", Duration::from_secs(1))
        .await
    {
        Ok(guard) => {
            let _ = guard.release().await;
        }
        Err(LockError::Busy { .. } | LockError::Store(_)) => {}
        Err(other) => prop_assert!(false, "acquiring answered {other:?}"),
    }
    Ok(())
}

async fn deduplicated<S: IdempotencyStore + Clone>(store: &S) -> Result<(), TestCaseError> {
    let layer = IdempotencyLayer::builder(store.clone())
        .scope(Header::from_static(CALLER))
        .build()
        .unwrap();
    let service = ServiceBuilder::new()
        .layer(layer)
        .service(tower::service_fn(
            |_: Request<tollgate::idempotency::RequestBody<String>>| async {
                Ok::<_, Infallible>(ok())
            },
        ));
    let response = service.oneshot(get("/payments")).await.unwrap();
    let replayed = response.headers().contains_key("idempotent-replayed");
    let status = response.status();
    // ran (200), refused (409, 422, 503), or a replay of what the record decodes to
    let refusals = [
        StatusCode::OK,
        StatusCode::CONFLICT,
        StatusCode::UNPROCESSABLE_ENTITY,
        StatusCode::SERVICE_UNAVAILABLE,
    ];
    prop_assert!(replayed || refusals.contains(&status), "{status}");
    Ok(())
}

/// Plants `case` in Redis, each key replaced.
fn plant_in_redis(conn: &mut redis::Connection, case: &Case) {
    let keys = Keys::of(case.algorithm);
    for (key, plant) in keys.rate.iter().zip(&case.rate) {
        put(conn, key, plant);
    }
    let permits = &keys.permits;
    let queue = [format!("{permits}:queue"), format!("{permits}:waiting")];
    for (key, plant) in [permits].into_iter().chain(&queue).zip(&case.permits) {
        put(conn, key, plant);
    }
    put(conn, &keys.lock.0, &case.lock[0]);
    put(conn, &keys.lock.1, &case.lock[1]);
    put(conn, &keys.record, &case.record[0]);
    put(conn, &format!("{}:pending", keys.record), &case.record[1]);
}

#[test]
fn every_layer_answers_over_state_planted_in_redis() {
    let server = RedisServer::start();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let store = runtime.block_on(async { server.store() });
    check(64, case(), |case| {
        plant_in_redis(&mut server.conn(), &case);
        runtime.block_on(answered(&store, case.algorithm))
    });
}

/// A bigint as a hostile writer leaves it in a row: the edges, around now (µs of the database's
/// clock), and anything.
fn bigint() -> impl Strategy<Value = i64> {
    let now = i64::try_from(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_micros(),
    )
    .unwrap();
    prop_oneof![
        Just(i64::MIN),
        Just(i64::MAX),
        Just(-1),
        Just(0),
        Just(1),
        (-120_000_000i64..120_000_000).prop_map(move |d| now + d),
        any::<i64>(),
    ]
}

fn token() -> impl Strategy<Value = String> {
    prop::collection::vec(0x20u8..0x7f, 0..12)
        .prop_map(|bytes| bytes.into_iter().map(char::from).collect())
}

/// The rows of one case on PostgreSQL.
#[derive(Debug, Clone)]
struct Rows {
    algorithm: Algorithm,
    /// Per key of the caller's limits: `a`, `b`, `c`, `expires_at`, `purge_at`.
    rate: Vec<Option<[i64; 5]>>,
    /// The sliding log of the first limit: attempt, score, cost.
    log: Vec<(i64, i64, i64)>,
    hold: Option<(String, Option<i64>)>,
    fence: Option<(i64, i64)>,
    permits: Vec<(String, i64)>,
    queue: Vec<(String, i64, i64)>,
    record: Option<Record>,
}

/// An idempotency row: done, fingerprint, token, response, expires_at, created_at.
type Record = (bool, String, String, Option<Vec<u8>>, i64, Option<i64>);

fn rows() -> impl Strategy<Value = Rows> {
    let rate = prop::collection::vec(
        prop::option::of([bigint(), bigint(), bigint(), bigint(), bigint()]),
        3,
    );
    let log = prop::collection::vec((bigint(), bigint(), bigint()), 0..4);
    let hold = prop::option::of((token(), prop::option::of(bigint())));
    let fence = prop::option::of((bigint(), bigint()));
    let permits = prop::collection::vec((token(), bigint()), 0..3);
    let queue = prop::collection::vec((token(), bigint(), bigint()), 0..3);
    let record = prop::option::of((
        any::<bool>(),
        token(),
        token(),
        prop::option::of(prop::collection::vec(any::<u8>(), 0..24)),
        bigint(),
        prop::option::of(bigint()),
    ));
    (
        algorithm(),
        rate,
        log,
        (hold, fence, permits, queue),
        record,
    )
        .prop_map(
            |(algorithm, rate, log, (hold, fence, permits, queue), record)| Rows {
                algorithm,
                rate,
                log,
                hold,
                fence,
                permits,
                queue,
                record,
            },
        )
}

/// Plants `rows` in `schema`, each key's rows replaced.
async fn plant_in_postgres(client: &tokio_postgres::Client, schema: &str, rows: &Rows) {
    let keys = Keys::of(rows.algorithm);
    let run = |sql: String| async move { sql };
    for table in [
        "rate_limits",
        "holds",
        "fences",
        "permits",
        "permit_queue",
        "idempotency",
    ] {
        let sql = run(format!("DELETE FROM {schema}.{table}")).await;
        client.execute(&sql, &[]).await.unwrap();
    }
    for (key, row) in keys.rate.iter().zip(&rows.rate) {
        let Some([a, b, c, expires_at, purge_at]) = row else {
            continue;
        };
        let sql = format!(
            "INSERT INTO {schema}.rate_limits (key, a, b, c, expires_at, purge_at) \
             VALUES ($1, $2, $3, $4, $5, $6)"
        );
        client
            .execute(&sql, &[key, a, b, c, expires_at, purge_at])
            .await
            .unwrap();
    }
    if rows.rate[0].is_some() {
        for (attempt, score, cost) in &rows.log {
            let sql = format!(
                "INSERT INTO {schema}.rate_log (key, attempt, score, cost) VALUES ($1, $2, $3, $4) \
                 ON CONFLICT DO NOTHING"
            );
            client
                .execute(&sql, &[&keys.rate[0], attempt, score, cost])
                .await
                .unwrap();
        }
    }
    if let Some((holder, expires_at)) = &rows.hold {
        let sql =
            format!("INSERT INTO {schema}.holds (key, holder, expires_at) VALUES ($1, $2, $3)");
        client
            .execute(&sql, &[&keys.lock.0, holder, expires_at])
            .await
            .unwrap();
    }
    if let Some((last, expires_at)) = &rows.fence {
        let sql =
            format!("INSERT INTO {schema}.fences (key, last, expires_at) VALUES ($1, $2, $3)");
        client
            .execute(&sql, &[&keys.lock.1, last, expires_at])
            .await
            .unwrap();
    }
    for (token, expires_at) in &rows.permits {
        let sql = format!(
            "INSERT INTO {schema}.permits (key, token, expires_at) VALUES ($1, $2, $3) \
             ON CONFLICT DO NOTHING"
        );
        client
            .execute(&sql, &[&keys.permits, token, expires_at])
            .await
            .unwrap();
    }
    for (token, arrived, expires_at) in &rows.queue {
        let sql = format!(
            "INSERT INTO {schema}.permit_queue (key, token, arrived, expires_at) \
             VALUES ($1, $2, $3, $4) ON CONFLICT DO NOTHING"
        );
        client
            .execute(&sql, &[&keys.permits, token, arrived, expires_at])
            .await
            .unwrap();
    }
    if let Some((done, fingerprint, token, response, expires_at, created_at)) = &rows.record {
        let sql = format!(
            "INSERT INTO {schema}.idempotency \
             (key, done, fingerprint, token, response, expires_at, created_at) \
             VALUES ($1, $2, $3, $4, $5, $6, $7)"
        );
        let params: [&(dyn tokio_postgres::types::ToSql + Sync); 7] = [
            &keys.record,
            done,
            fingerprint,
            token,
            response,
            expires_at,
            created_at,
        ];
        client.execute(&sql, &params).await.unwrap();
    }
}

#[test]
fn every_layer_answers_over_rows_planted_in_postgres() {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let (store, client) = runtime.block_on(async {
        let store = common::postgres::store().await;
        (store, common::postgres::shared().client().await)
    });
    let schema = store.schema().to_owned();
    check(64, rows(), |rows| {
        runtime.block_on(async {
            plant_in_postgres(&client, &schema, &rows).await;
            answered(&store, rows.algorithm).await
        })
    });
}
