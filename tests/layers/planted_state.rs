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
use tollgate::store::{IdempotencyStore, LockStore, PermitStore, RedisStore, keys};

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

async fn rate_limited(
    store: &RedisStore,
    conn: &mut redis::Connection,
    case: &Case,
) -> Result<(), TestCaseError> {
    let layer = RateLimitLayer::builder(store.clone())
        .algorithm(case.algorithm)
        .limit(Limit::per_second("burst", 3).block_for(Duration::from_secs(2)))
        .limit(Limit::per_minute("minute", 50))
        .key(Header::from_static(CALLER))
        .build()
        .unwrap();
    let caller = Header::from_static(CALLER).key(b"planted");
    for (key, plant) in layer.policy().reset_keys(&caller).iter().zip(&case.rate) {
        put(conn, key, plant);
    }
    let service = ServiceBuilder::new()
        .layer(layer)
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

async fn concurrency_limited(
    store: &RedisStore,
    conn: &mut redis::Connection,
    case: &Case,
) -> Result<(), TestCaseError> {
    let caller = Header::from_static(CALLER).key(b"planted");
    let permits = keys::permits(keys::DEFAULT_PREFIX, &caller).unwrap();
    let names = [
        permits.clone(),
        format!("{permits}:queue"),
        format!("{permits}:waiting"),
    ];
    for (key, plant) in names.iter().zip(&case.permits) {
        put(conn, key, plant);
    }
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
    prop_assert!(
        [
            StatusCode::OK,
            StatusCode::TOO_MANY_REQUESTS,
            StatusCode::SERVICE_UNAVAILABLE
        ]
        .contains(&response.status()),
        "{}",
        response.status()
    );
    retry_after_is_seconds(&response)?;
    let _ = store.permit_usage(&permits).await;
    Ok(())
}

async fn locked(
    store: &RedisStore,
    conn: &mut redis::Connection,
    case: &Case,
) -> Result<(), TestCaseError> {
    let (lock, fence) = keys::lock(keys::DEFAULT_PREFIX, "planted").unwrap();
    put(conn, &lock, &case.lock[0]);
    put(conn, &fence, &case.lock[1]);
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
    let _ = store.lock_state(&lock, &fence).await;
    Ok(())
}

async fn deduplicated(
    store: &RedisStore,
    conn: &mut redis::Connection,
    case: &Case,
) -> Result<(), TestCaseError> {
    let scope = Header::from_static(CALLER).key(b"planted");
    let record = keys::idempotency_record(keys::DEFAULT_PREFIX, Some(scope), "planted").unwrap();
    put(conn, &record, &case.record[0]);
    put(conn, &format!("{record}:pending"), &case.record[1]);
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
    let answered = replayed
        || [
            StatusCode::OK,
            StatusCode::CONFLICT,
            StatusCode::UNPROCESSABLE_ENTITY,
            StatusCode::SERVICE_UNAVAILABLE,
        ]
        .contains(&status);
    prop_assert!(answered, "{status}");
    let _ = store.idempotency_state(&record).await;
    Ok(())
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
        let mut conn = server.conn();
        runtime.block_on(async {
            rate_limited(&store, &mut conn, &case).await?;
            concurrency_limited(&store, &mut conn, &case).await?;
            locked(&store, &mut conn, &case).await?;
            deduplicated(&store, &mut conn, &case).await
        })
    });
}
