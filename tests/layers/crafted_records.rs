//! Stored records an attacker with write access to the store (or a corrupt store) crafted: the
//! idempotency layer answers a replay of one it cannot decode with `503` and runs nothing again;
//! it never panics. The records are planted in a real `redis-server` and PostgreSQL, over one a
//! first request completed.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use crate::common;

use std::convert::Infallible;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use bytes::Bytes;
use http::{HeaderValue, Request, Response, StatusCode};
use http_body_util::BodyExt;
use proptest::prelude::*;
use tower::{Service, ServiceBuilder, ServiceExt};

use common::RedisServer;
use common::check;
use tollgate::idempotency::{IdempotencyBody, IdempotencyLayer, RequestBody};
use tollgate::key::Header;
use tollgate::store::{IdempotencyState, IdempotencyStore, MemoryStore, keys};

const TENANT: &str = "x-tenant";

/// The store key of `idempotency_key`'s record under tenant `t1`, as the layer writes it.
fn record_key(idempotency_key: &str) -> String {
    let scope = Header::from_static(TENANT).key(b"t1");
    keys::idempotency_record(keys::DEFAULT_PREFIX, Some(scope), idempotency_key).unwrap()
}

/// An idempotency layer scoped by tenant on `store`, over a handler that counts its runs and
/// answers `201` with the response `respond` makes.
fn service<S: IdempotencyStore>(
    store: S,
    runs: &Arc<AtomicUsize>,
    respond: fn() -> Response<String>,
) -> impl Service<Request<String>, Response = Response<IdempotencyBody<String>>, Error = Infallible>
+ Clone {
    let layer = IdempotencyLayer::builder(store)
        .scope(Header::from_static(TENANT))
        .response_limit(1 << 24)
        .build()
        .unwrap();
    let runs = Arc::clone(runs);
    ServiceBuilder::new()
        .layer(layer)
        .service(tower::service_fn(move |_: Request<RequestBody<String>>| {
            runs.fetch_add(1, Ordering::SeqCst);
            std::future::ready(Ok::<_, Infallible>(respond()))
        }))
}

fn created() -> Response<String> {
    let mut response = Response::new("created".to_owned());
    *response.status_mut() = StatusCode::CREATED;
    response
}

/// Posts with `idempotency_key` as tenant `t1`: the status, whether it is a replay, the body.
async fn post<S>(service: &S, idempotency_key: &str) -> (StatusCode, bool, Bytes)
where
    S: Service<Request<String>, Response = Response<IdempotencyBody<String>>, Error = Infallible>
        + Clone,
{
    let request = Request::post("/payments")
        .header(TENANT, "t1")
        .header(
            "idempotency-key",
            HeaderValue::from_str(idempotency_key).unwrap(),
        )
        .body("{}".to_owned())
        .unwrap();
    let response = service.clone().oneshot(request).await.unwrap();
    let status = response.status();
    let replayed = response.headers().contains_key("idempotent-replayed");
    let body = response.into_body().collect().await.unwrap().to_bytes();
    (status, replayed, body)
}

/// A record of version 1, status 200, whose header list declares `count` headers, then `len`
/// zero bytes.
fn declaring(count: u32, len: usize) -> Vec<u8> {
    let mut record = vec![1, 0, 200];
    record.extend_from_slice(&count.to_be_bytes());
    record.resize(record.len() + len, 0);
    record
}

/// A record of version 1, status 200, with `count` well-formed headers of distinct names.
fn distinct_names(count: u32) -> Vec<u8> {
    let mut record = vec![1, 0, 200];
    record.extend_from_slice(&count.to_be_bytes());
    for i in 0..count {
        for field in [format!("h{i:05}").into_bytes(), b"v".to_vec()] {
            record.extend_from_slice(&u32::try_from(field.len()).unwrap().to_be_bytes());
            record.extend_from_slice(&field);
        }
    }
    record.extend_from_slice(&0u32.to_be_bytes());
    record.extend_from_slice(&u32::MAX.to_be_bytes());
    record
}

/// The records that made the decoder panic, and others it must refuse.
fn crafted() -> Vec<(&'static str, Vec<u8>)> {
    vec![
        ("2^15 headers declared", declaring(1 << 15, 8 << 15)),
        ("2^15 distinct header names", distinct_names(1 << 15)),
        ("a billion headers declared", declaring(1_000_000_000, 64)),
        ("empty", Vec::new()),
        ("another version", vec![2, 0, 200, 0, 0, 0, 0]),
        ("cut short", vec![1, 0, 200, 0, 0]),
        (
            "status 1000",
            declaring(0, 4)[..3].iter().copied().chain([0; 8]).collect(),
        ),
    ]
}

/// Completes a first request with key `key`, plants `record` with `plant`, and checks that a
/// retry is answered `503` without running the handler, and the stored state names no status.
async fn refused_after_planting<S, F, Fut>(store: S, key: &str, record: Vec<u8>, plant: F)
where
    S: IdempotencyStore + Clone,
    F: FnOnce(String, Vec<u8>) -> Fut,
    Fut: std::future::Future<Output = ()>,
{
    let runs = Arc::new(AtomicUsize::new(0));
    let service = service(store.clone(), &runs, created);
    assert_eq!(post(&service, key).await.0, StatusCode::CREATED);
    plant(record_key(key), record).await;
    let (status, replayed, _) = post(&service, key).await;
    assert_eq!(
        (status, replayed),
        (StatusCode::SERVICE_UNAVAILABLE, false),
        "{key}"
    );
    assert_eq!(runs.load(Ordering::SeqCst), 1, "{key}: ran again");
    let state = store.idempotency_state(&record_key(key)).await.unwrap();
    assert!(
        matches!(state, IdempotencyState::Completed { .. }),
        "{key}: {state:?}"
    );
    assert_eq!(state.response_status(), None, "{key}");
}

#[tokio::test]
async fn a_crafted_record_in_redis_is_refused_with_503_not_a_panic() {
    let server = RedisServer::start();
    let store = server.store();
    for (i, (name, record)) in crafted().into_iter().enumerate() {
        let key = format!("crafted-{i}");
        refused_after_planting(store.clone(), &key, record, |store_key, record| {
            let mut conn = server.conn();
            let () = redis::cmd("HSET")
                .arg(store_key)
                .arg("r")
                .arg(record)
                .query(&mut conn)
                .expect(name);
            std::future::ready(())
        })
        .await;
    }
}

#[tokio::test]
async fn a_crafted_record_in_postgres_is_refused_with_503_not_a_panic() {
    let store = common::postgres::store().await;
    let client = common::postgres::shared().client().await;
    let table = format!("{}.idempotency", store.schema());
    for (i, (name, record)) in crafted().into_iter().enumerate() {
        let key = format!("crafted-{i}");
        refused_after_planting(store.clone(), &key, record, |store_key, record| {
            let (client, table) = (&client, &table);
            async move {
                let update = format!("UPDATE {table} SET response = $1 WHERE key = $2");
                let updated = client.execute(&update, &[&record, &store_key]).await;
                assert_eq!(updated.expect(name), 1, "{name}");
            }
        })
        .await;
    }
}

/// A response with 30,000 values of one header: as many as a `HeaderMap` holds.
fn many_values() -> Response<String> {
    let mut response = created();
    for i in 0..30_000 {
        response
            .headers_mut()
            .append("x-many", HeaderValue::from(i));
    }
    response
}

#[tokio::test]
async fn a_response_with_30000_values_of_one_header_replays_them_all() {
    let runs = Arc::new(AtomicUsize::new(0));
    let service = service(MemoryStore::new(), &runs, many_values);
    let request = |key: &str| {
        Request::post("/payments")
            .header(TENANT, "t1")
            .header("idempotency-key", key)
            .body("{}".to_owned())
            .unwrap()
    };
    let first = service.clone().oneshot(request("many")).await.unwrap();
    assert_eq!(first.headers().get_all("x-many").iter().count(), 30_000);
    let replay = service.clone().oneshot(request("many")).await.unwrap();
    assert_eq!(replay.status(), StatusCode::CREATED);
    assert!(replay.headers().contains_key("idempotent-replayed"));
    let values: Vec<_> = replay.headers().get_all("x-many").iter().cloned().collect();
    assert_eq!(values.len(), 30_000);
    assert_eq!(values[29_999], HeaderValue::from(29_999));
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

/// Any bytes planted as a record on Redis: a replay answers the status the record names, or
/// `503` when it names none; nothing runs again.
#[test]
fn any_bytes_planted_in_redis_replay_as_their_status_or_503() {
    let server = RedisServer::start();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let store = runtime.block_on(async { server.store() });
    let runs = Arc::new(AtomicUsize::new(0));
    let service = runtime.block_on(async { service(store.clone(), &runs, created) });
    let n = AtomicUsize::new(0);
    let record = prop_oneof![
        prop::collection::vec(any::<u8>(), 0..64),
        (100u16..1000, prop::collection::vec(any::<u8>(), 0..24)).prop_map(|(status, tail)| {
            let mut record = vec![1];
            record.extend_from_slice(&status.to_be_bytes());
            record.extend_from_slice(&tail);
            record
        }),
        (100u16..1000, any::<bool>()).prop_map(|(status, trailers)| {
            // a well-formed record: no headers, an empty body, trailers or none
            let mut record = vec![1];
            record.extend_from_slice(&status.to_be_bytes());
            record.extend_from_slice(&[0; 8]);
            let end = if trailers { 0 } else { u32::MAX };
            record.extend_from_slice(&end.to_be_bytes());
            record
        }),
    ];
    check(64, record, |record| {
        let key = format!("planted-{}", n.fetch_add(1, Ordering::SeqCst));
        runtime.block_on(async {
            let before = runs.load(Ordering::SeqCst);
            assert_eq!(post(&service, &key).await.0, StatusCode::CREATED);
            let mut conn = server.conn();
            let () = redis::cmd("HSET")
                .arg(record_key(&key))
                .arg("r")
                .arg(&record)
                .query(&mut conn)
                .unwrap();
            let state = store.idempotency_state(&record_key(&key)).await.unwrap();
            let expected = state
                .response_status()
                .unwrap_or(StatusCode::SERVICE_UNAVAILABLE);
            let (status, replayed, _) = post(&service, &key).await;
            prop_assert_eq!(status, expected);
            prop_assert_eq!(replayed, state.response_status().is_some());
            prop_assert_eq!(runs.load(Ordering::SeqCst), before + 1);
            Ok(())
        })
    });
}
