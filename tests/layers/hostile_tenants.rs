//! Tenants that do not play fair, on a `MemoryStore`, a real `redis-server` (and a Redis
//! Cluster) and a real PostgreSQL: a cost estimate of 0 is checked and pays what it used; a keyed request that does
//! not name its caller is refused and learns nothing of another caller's record; stalled uploads
//! of a few tenants leave every other tenant served.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tower::{ServiceBuilder, ServiceExt};

use super::rate_limit_invalidations::redis_store;
use crate::common::{RedisServer, postgres};
use tollgate::idempotency::{IdempotencyBody, IdempotencyLayer, MissingScope, RequestBody};
use tollgate::key::Header;
use tollgate::rate_limit::{Algorithm, Limit, RateLimitLayer};
use tollgate::store::{IdempotencyStore, MemoryStore, RateStore};

/// A prefix no other test uses.
fn unique_prefix(name: &str) -> String {
    format!("{name}{:08x}", rand::random::<u32>())
}

// ---------------------------------------------------------------------------------------------
// A cost of 0 is not free
// ---------------------------------------------------------------------------------------------

/// Four calls each declaring an estimate of 0 tokens and each using 500, against a budget of
/// 1,000: the first two are admitted and charged their 500, the budget is then spent, and the
/// last two are refused without reaching the handler — under every algorithm.
async fn a_zero_estimate_pays_its_usage_and_is_refused_when_spent(store: impl RateStore + Clone) {
    for algorithm in [
        Algorithm::SlidingLog,
        Algorithm::SlidingCounter,
        Algorithm::Gcra,
    ] {
        let layer = RateLimitLayer::builder(store.clone())
            .limit(Limit::per_hour("tokens", 1000))
            .algorithm(algorithm)
            .prefix(unique_prefix("zero"))
            .key(Header::from_static("x-api-key"))
            // the client's word, taken as it is
            .cost(|req| {
                let declared = req
                    .headers
                    .get("x-max-tokens")
                    .and_then(|v| v.to_str().ok());
                declared.and_then(|v| v.parse().ok()).unwrap_or(100)
            })
            .settle(|res| {
                res.headers
                    .get("x-tokens-used")?
                    .to_str()
                    .ok()?
                    .parse()
                    .ok()
            })
            .build()
            .unwrap();
        let runs = Arc::new(AtomicUsize::new(0));
        let counted = Arc::clone(&runs);
        let llm =
            ServiceBuilder::new()
                .layer(layer.clone())
                .service_fn(move |_: Request<String>| {
                    counted.fetch_add(1, Ordering::SeqCst);
                    async {
                        let used = Response::builder().header("x-tokens-used", "500");
                        Ok::<_, Infallible>(used.body(String::new()).unwrap())
                    }
                });
        let mut statuses = Vec::new();
        for _ in 0..4 {
            let call = Request::post("/llm/complete")
                .header("x-api-key", "mallory")
                .header("x-max-tokens", "0")
                .body(String::new())
                .unwrap();
            statuses.push(llm.clone().oneshot(call).await.unwrap().status());
        }
        assert_eq!(
            statuses,
            [
                StatusCode::OK,
                StatusCode::OK,
                StatusCode::TOO_MANY_REQUESTS,
                StatusCode::TOO_MANY_REQUESTS
            ],
            "{algorithm}"
        );
        assert_eq!(runs.load(Ordering::SeqCst), 2, "{algorithm}: handler runs");
        let mallory = Header::from_static("x-api-key").key(b"mallory");
        let left = layer.peek(mallory).await.unwrap();
        assert_eq!(
            left.limits[0].remaining, 0,
            "{algorithm}: the budget is spent"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_zero_estimate_pays_its_usage_and_is_refused_when_spent_on_memory() {
    a_zero_estimate_pays_its_usage_and_is_refused_when_spent(MemoryStore::new()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_zero_estimate_pays_its_usage_and_is_refused_when_spent_on_redis() {
    let server = RedisServer::start();
    a_zero_estimate_pays_its_usage_and_is_refused_when_spent(redis_store(&server)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_zero_estimate_pays_its_usage_and_is_refused_when_spent_on_redis_cluster() {
    let cluster = crate::common::cluster::RedisCluster::shared();
    a_zero_estimate_pays_its_usage_and_is_refused_when_spent(cluster.store().await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_zero_estimate_pays_its_usage_and_is_refused_when_spent_on_postgres() {
    a_zero_estimate_pays_its_usage_and_is_refused_when_spent(postgres::store().await).await;
}

// ---------------------------------------------------------------------------------------------
// Scopes fail closed
// ---------------------------------------------------------------------------------------------

/// What a client sees of an answer.
#[derive(Debug)]
struct Seen {
    status: StatusCode,
    replayed: bool,
    body: Bytes,
}

type Payments = tower::util::BoxCloneService<Request<Full<Bytes>>, Seen, Infallible>;

/// A payments endpoint behind an idempotency layer scoped by `x-api-key`; `runs` counts the
/// payments made.
fn payments(
    store: impl IdempotencyStore,
    missing: Option<MissingScope>,
    runs: &Arc<AtomicUsize>,
) -> Payments {
    let builder = IdempotencyLayer::builder(store)
        .prefix(unique_prefix("scope"))
        .scope(Header::from_static("x-api-key"));
    let builder = match missing {
        Some(missing) => builder.missing_scope(missing),
        None => builder,
    };
    let runs = Arc::clone(runs);
    let service = ServiceBuilder::new()
        .layer(builder.build().unwrap())
        .service_fn(move |req: Request<RequestBody<Full<Bytes>>>| {
            let run = runs.fetch_add(1, Ordering::SeqCst) + 1;
            async move {
                let paid = req.into_body().collect().await.unwrap().to_bytes();
                let receipt = format!("payment {run} of {}", String::from_utf8_lossy(&paid));
                let response = Response::builder().status(StatusCode::CREATED);
                Ok::<_, Infallible>(response.body(Full::new(Bytes::from(receipt))).unwrap())
            }
        })
        .and_then(|res: Response<IdempotencyBody<Full<Bytes>>>| async move {
            let status = res.status();
            let replayed = res.headers().contains_key("idempotent-replayed");
            let body = res.into_body().collect().await.unwrap().to_bytes();
            Ok(Seen {
                status,
                replayed,
                body,
            })
        });
    tower::util::BoxCloneService::new(service)
}

fn pay(api_key: Option<&str>, idempotency_key: &str, body: &'static str) -> Request<Full<Bytes>> {
    let mut request = Request::post("/payments").header("idempotency-key", idempotency_key);
    if let Some(api_key) = api_key {
        request = request.header("x-api-key", api_key);
    }
    request
        .body(Full::new(Bytes::from_static(body.as_bytes())))
        .unwrap()
}

/// Alice pays with key `order-1`; requests without an API key and with the same key — the same
/// request, or another one — are refused alike (`400`, no replay, no receipt, nothing run): they
/// learn neither Alice's payment nor that the key was used. With `MissingScope::Shared` chosen,
/// such requests share a namespace of their own, apart from Alice's.
async fn a_request_without_its_scope_is_refused_and_learns_nothing(
    store: impl IdempotencyStore + Clone,
) {
    let runs = Arc::new(AtomicUsize::new(0));
    let service = payments(store.clone(), None, &runs);
    let alice = service
        .clone()
        .oneshot(pay(Some("alice"), "order-1", "100 EUR"))
        .await
        .unwrap();
    assert_eq!(alice.status, StatusCode::CREATED);
    assert_eq!(alice.body, "payment 1 of 100 EUR");
    for body in ["100 EUR", "999 EUR"] {
        let stranger = service
            .clone()
            .oneshot(pay(None, "order-1", body))
            .await
            .unwrap();
        assert_eq!(stranger.status, StatusCode::BAD_REQUEST, "{body}");
        assert!(!stranger.replayed, "{body}");
        let text = String::from_utf8_lossy(&stranger.body).into_owned();
        assert!(!text.contains("payment"), "{body}: {text}");
        assert!(text.contains("does not name its caller"), "{body}: {text}");
    }
    let unused = service
        .clone()
        .oneshot(pay(None, "never-used", "1 EUR"))
        .await
        .unwrap();
    assert_eq!(
        unused.status,
        StatusCode::BAD_REQUEST,
        "a fresh key gets the same answer"
    );
    assert_eq!(
        runs.load(Ordering::SeqCst),
        1,
        "nothing ran for a request without its scope"
    );
    // Alice's own retry still replays her payment
    let retry = service
        .clone()
        .oneshot(pay(Some("alice"), "order-1", "100 EUR"))
        .await
        .unwrap();
    assert!(retry.replayed);
    assert_eq!(retry.body, alice.body);

    // the shared namespace, chosen on purpose, holds only requests without a scope
    let runs = Arc::new(AtomicUsize::new(0));
    let shared = payments(store, Some(MissingScope::Shared), &runs);
    let alice = shared
        .clone()
        .oneshot(pay(Some("alice"), "order-1", "100 EUR"))
        .await
        .unwrap();
    let first = shared
        .clone()
        .oneshot(pay(None, "order-1", "100 EUR"))
        .await
        .unwrap();
    assert_eq!(
        (alice.status, first.status),
        (StatusCode::CREATED, StatusCode::CREATED)
    );
    assert!(
        !first.replayed,
        "a request without a scope is not replayed Alice's payment"
    );
    assert_eq!(first.body, "payment 2 of 100 EUR");
    let second = shared
        .clone()
        .oneshot(pay(None, "order-1", "100 EUR"))
        .await
        .unwrap();
    assert!(second.replayed);
    assert_eq!(second.body, first.body);
    assert_eq!(runs.load(Ordering::SeqCst), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_without_its_scope_is_refused_and_learns_nothing_on_memory() {
    a_request_without_its_scope_is_refused_and_learns_nothing(MemoryStore::new()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_without_its_scope_is_refused_and_learns_nothing_on_redis() {
    let server = RedisServer::start();
    a_request_without_its_scope_is_refused_and_learns_nothing(redis_store(&server)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_without_its_scope_is_refused_and_learns_nothing_on_redis_cluster() {
    let cluster = crate::common::cluster::RedisCluster::shared();
    a_request_without_its_scope_is_refused_and_learns_nothing(cluster.store().await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_without_its_scope_is_refused_and_learns_nothing_on_postgres() {
    a_request_without_its_scope_is_refused_and_learns_nothing(postgres::store().await).await;
}

// ---------------------------------------------------------------------------------------------
// No slow client stalls the rest
// ---------------------------------------------------------------------------------------------

/// The stalled uploads: this many connections, each declaring a body of 1 MiB and sending its
/// part of 64 MiB (the layer's whole default budget), then going silent.
const STALLED: usize = 68;

/// The tenants the stalled uploads come from.
const ATTACKERS: usize = 4;

/// How long the layer waits for a body to arrive whole, in this test.
const BODY_TIMEOUT: Duration = Duration::from_secs(8);

/// What one stalled upload saw: the status of its answer (`None`: the connection closed
/// without one), and when.
type Ended = Arc<Mutex<Vec<(Option<u16>, Instant)>>>;

/// An axum server of idempotent payments on `store`, scoped by `x-api-key`, with the default
/// budget of buffered bodies: its address, and the count of payments made.
async fn serve(store: impl IdempotencyStore) -> (SocketAddr, Arc<AtomicUsize>) {
    let runs = Arc::new(AtomicUsize::new(0));
    let counted = Arc::clone(&runs);
    let layer = IdempotencyLayer::builder(store)
        .prefix(unique_prefix("stall"))
        .scope(Header::from_static("x-api-key"))
        .body_timeout(BODY_TIMEOUT)
        .build()
        .unwrap();
    let app = axum::Router::new()
        .route(
            "/payments",
            axum::routing::post(move || {
                counted.fetch_add(1, Ordering::SeqCst);
                async { (StatusCode::CREATED, "paid") }
            }),
        )
        .layer(layer);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });
    (addr, runs)
}

/// The status of the HTTP/1.1 answer on `stream`, read within `wait`; `None` when the
/// connection closes (or says nothing) first.
async fn status_of(stream: &mut TcpStream, wait: Duration) -> Option<u16> {
    let mut head = Vec::new();
    let mut buf = [0u8; 1024];
    let read = async {
        while !head.windows(4).any(|w| w == b"\r\n\r\n") {
            match stream.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => head.extend_from_slice(&buf[..n]),
            }
        }
    };
    let _ = tokio::time::timeout(wait, read).await;
    let line = String::from_utf8_lossy(&head);
    line.strip_prefix("HTTP/1.1 ")?.get(..3)?.parse().ok()
}

/// One stalled upload by `tenant`: it declares 1 MiB and sends `bytes` of it, says it has sent
/// (or been cut off), then waits for its answer, which it adds to `ended`.
async fn stall(
    addr: SocketAddr,
    tenant: String,
    n: usize,
    bytes: usize,
    sent: Arc<AtomicUsize>,
    ended: Ended,
) {
    let mut stream = TcpStream::connect(addr).await.unwrap();
    let head = format!(
        "POST /payments HTTP/1.1\r\nhost: tollgate\r\nx-api-key: {tenant}\r\n\
         idempotency-key: stall-{n}\r\ncontent-length: {}\r\n\r\n",
        1 << 20
    );
    let chunk = vec![b'x'; 64 << 10];
    let write = async {
        stream.write_all(head.as_bytes()).await?;
        let mut left = bytes;
        while left > 0 {
            let part = left.min(chunk.len());
            stream.write_all(&chunk[..part]).await?;
            left -= part;
        }
        stream.flush().await
    };
    // a refused upload may find its connection closed while it writes
    let _ = tokio::time::timeout(Duration::from_secs(10), write).await;
    sent.fetch_add(1, Ordering::SeqCst);
    let status = status_of(&mut stream, BODY_TIMEOUT * 2).await;
    ended.lock().unwrap().push((status, Instant::now()));
}

/// A small idempotent payment by `tenant` on a connection of its own: the status of its answer.
async fn pay_over_tcp(addr: SocketAddr, tenant: &str) -> Option<u16> {
    let mut stream = TcpStream::connect(addr).await.ok()?;
    let request = format!(
        "POST /payments HTTP/1.1\r\nhost: tollgate\r\nx-api-key: {tenant}\r\n\
         idempotency-key: {tenant}-order\r\ncontent-length: 7\r\nconnection: close\r\n\r\n100 EUR"
    );
    stream.write_all(request.as_bytes()).await.ok()?;
    status_of(&mut stream, Duration::from_secs(5)).await
}

/// 68 uploads from 4 tenants declare 1 MiB each, send 64 MiB in all (the whole default budget),
/// and go silent; meanwhile 10 other tenants each make an idempotent payment: all 10 are served
/// within 2 s. Each stalling tenant holds at most its share (an eighth of the budget: 8 of its
/// uploads); its other uploads are refused with `503` at once, and the ones held get `408` once
/// the body timeout passes.
async fn stalled_uploads_leave_every_other_tenant_served(store: impl IdempotencyStore) {
    let (addr, runs) = serve(store).await;
    let (sent, ended): (Arc<AtomicUsize>, Ended) = Default::default();
    let per_upload = (64 << 20) / STALLED;
    let started = Instant::now();
    for n in 0..STALLED {
        let tenant = format!("mallory-{}", n % ATTACKERS);
        tokio::spawn(stall(
            addr,
            tenant,
            n,
            per_upload,
            Arc::clone(&sent),
            Arc::clone(&ended),
        ));
    }
    crate::common::wait_for("every stalled upload sent its part", || {
        sent.load(Ordering::SeqCst) == STALLED
    })
    .await;
    // the refusals of the uploads past their tenants' shares are on their way
    tokio::time::sleep(Duration::from_millis(200)).await;

    let payments = (0..10).map(|n| {
        let tenant = format!("tenant-{n}");
        tokio::spawn(async move {
            tokio::time::timeout(Duration::from_secs(2), pay_over_tcp(addr, &tenant)).await
        })
    });
    let served: Vec<_> = futures_util::future::join_all(payments).await;
    for (n, answer) in served.into_iter().enumerate() {
        assert_eq!(answer.unwrap(), Ok(Some(201)), "tenant-{n} within 2 s");
    }
    assert_eq!(runs.load(Ordering::SeqCst), 10, "only the 10 payments ran");
    assert!(
        started.elapsed() < BODY_TIMEOUT,
        "the test ran past the body timeout ({:?}): the stalled uploads let go on their own",
        started.elapsed()
    );

    let refused = {
        let ended = ended.lock().unwrap();
        // while the 10 were served, the stalled uploads that ended were all refused
        assert!(
            ended
                .iter()
                .all(|(status, _)| matches!(status, Some(503) | None)),
            "{ended:?}"
        );
        ended.len()
    };
    let held = STALLED - refused;
    assert!(
        (1..=ATTACKERS * 8).contains(&held),
        "{held} uploads held: each tenant holds at most 8 of about 0.94 MiB in its share of 8 MiB"
    );
    crate::common::wait_for("every stalled upload ended", || {
        ended.lock().unwrap().len() == STALLED
    })
    .await;
    let ended = ended.lock().unwrap();
    let timed_out = ended
        .iter()
        .filter(|(status, _)| *status == Some(408))
        .count();
    assert_eq!(
        timed_out, held,
        "the uploads held got 408 at the body timeout: {ended:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stalled_uploads_leave_every_other_tenant_served_on_memory() {
    stalled_uploads_leave_every_other_tenant_served(MemoryStore::new()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stalled_uploads_leave_every_other_tenant_served_on_redis() {
    let server = RedisServer::start();
    stalled_uploads_leave_every_other_tenant_served(redis_store(&server)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stalled_uploads_leave_every_other_tenant_served_on_postgres() {
    stalled_uploads_leave_every_other_tenant_served(postgres::store().await).await;
}
