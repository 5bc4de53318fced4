//! Layers stacked, in either order, on a `MemoryStore`, a real `redis-server` and a real
//! PostgreSQL: a replay of the idempotency layer is never charged again by a rate limit that
//! settles its cost (on the response head or on the body's size); a concurrency limit and a rate
//! limit both advertise their policies in one response; a cost estimated from the request body
//! is reserved, and a body past the cap, unreadable as the estimate needs or too slow refused.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::convert::Infallible;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use tokio::task::JoinSet;
use tower::util::BoxCloneService;
use tower::{Service, ServiceBuilder, ServiceExt};

use super::metered::acme_left;
use tollgate::concurrency::{ConcurrencyLimitLayer, ConcurrencyLimitLayerBuilder};
use tollgate::idempotency::IdempotencyLayer;
use tollgate::key::Header;
use tollgate::rate_limit::{Limit, RateLimitLayer, RateLimitLayerBuilder};
use tollgate::store::{IdempotencyStore, PermitStore, RateStore};

/// What every test's store is.
trait Store: RateStore + IdempotencyStore + PermitStore + Clone {}
impl<T: RateStore + IdempotencyStore + PermitStore + Clone> Store for T {}

/// A prefix no other test uses.
fn unique(name: &str) -> String {
    format!("{name}{:08x}", rand::random::<u32>())
}

/// What a client sees of an answer.
#[derive(Debug)]
struct Seen {
    status: StatusCode,
    headers: HeaderMap,
}

type Stack = BoxCloneService<Request<Full<Bytes>>, Seen, Infallible>;

/// How many tokens each run of the upstream uses, said in `x-tokens-used` and as the size of
/// its body.
const USED: u64 = 60;
/// What a request reserves before it runs.
const ESTIMATE: u64 = 100;
/// The tenant's budget.
const BUDGET: u64 = 10_000;

/// The upstream: counts its runs, answers `201` with [`USED`] tokens used.
fn upstream<B: Send + 'static>(
    runs: &Arc<AtomicUsize>,
) -> impl Service<Request<B>, Response = Response<Full<Bytes>>, Error = Infallible, Future: Send>
+ Clone
+ Send
+ 'static {
    let runs = Arc::clone(runs);
    tower::service_fn(move |_: Request<B>| {
        runs.fetch_add(1, Ordering::SeqCst);
        async move {
            let body = Full::new(Bytes::from(vec![b'x'; USED as usize]));
            let response = Response::builder()
                .status(StatusCode::CREATED)
                .header("x-tokens-used", USED.to_string());
            Ok::<_, Infallible>(response.body(body).unwrap())
        }
    })
}

/// How the rate limit learns what a request used.
#[derive(Debug, Clone, Copy)]
enum Settled {
    /// From the response head (`settle`).
    Head,
    /// From the size of the body sent (`settle_body_size`).
    BodySize,
    /// From what a meter reads of the body as it streams (`settle_stream`): here its size.
    Stream,
}

/// A meter that reports the bytes of body it saw.
struct BodyBytes(u64);

impl tollgate::rate_limit::Meter for BodyBytes {
    fn data(&mut self, data: &[u8]) {
        self.0 += data.len() as u64;
    }

    fn usage(&self) -> Option<u64> {
        Some(self.0)
    }
}

fn budget(store: impl RateStore, settled: Settled) -> RateLimitLayer<Header> {
    let builder: RateLimitLayerBuilder<Header> = RateLimitLayer::builder(store)
        .limit(Limit::per_hour("tokens", BUDGET))
        .prefix(unique("budget"))
        .key(Header::from_static("x-tenant"))
        .cost(|_| ESTIMATE);
    let builder = match settled {
        Settled::Head => builder.settle(|res| {
            res.headers
                .get("x-tokens-used")?
                .to_str()
                .ok()?
                .parse()
                .ok()
        }),
        Settled::BodySize => builder.settle_body_size(),
        Settled::Stream => builder.settle_stream(|_| BodyBytes(0)),
    };
    builder.build().unwrap()
}

/// The answer with its body read to the end (the body-size settlement is made then).
async fn seen<B>(response: Response<B>) -> Result<Seen, Infallible>
where
    B: http_body::Body,
    B::Error: std::fmt::Debug,
{
    let (parts, body) = response.into_parts();
    body.collect().await.unwrap();
    Ok(Seen {
        status: parts.status,
        headers: parts.headers,
    })
}

/// The idempotency layer of every test: keys scoped by `x-tenant`.
fn idempotency<S: Store>(store: &S) -> IdempotencyLayer<Header> {
    IdempotencyLayer::builder(store.clone())
        .prefix(unique("idem"))
        .scope(Header::from_static("x-tenant"))
        .build()
        .unwrap()
}

/// Two calls in flight per `x-tenant`.
fn in_flight<S: Store>(store: &S) -> ConcurrencyLimitLayerBuilder<Header> {
    ConcurrencyLimitLayer::builder(store.clone())
        .limit(2)
        .prefix(unique("cc"))
        .key(Header::from_static("x-tenant"))
}

/// The rate limit outside the idempotency layer (as a request must be admitted before anything
/// is claimed), or inside it (so that a replay never reaches it).
fn stack<S: Store>(
    store: &S,
    rate_outside: bool,
    rate: RateLimitLayer<Header>,
    runs: &Arc<AtomicUsize>,
) -> Stack {
    let idempotency = idempotency(store);
    if rate_outside {
        let service = ServiceBuilder::new()
            .layer(rate)
            .layer(idempotency)
            .service(upstream(runs))
            .and_then(seen);
        BoxCloneService::new(service)
    } else {
        let service = ServiceBuilder::new()
            .layer(idempotency)
            .layer(rate)
            .service(upstream(runs))
            .and_then(seen);
        BoxCloneService::new(service)
    }
}

fn pay(key: &str) -> Request<Full<Bytes>> {
    Request::post("/llm/complete")
        .header("x-tenant", "acme")
        .header("idempotency-key", key)
        .body(Full::new(Bytes::from_static(b"{\"prompt\":\"hi\"}")))
        .unwrap()
}

/// One request of a key, then 50 replays of it at once, in either layer order and with each
/// settlement: the upstream runs once, every replay is answered as the first run was, and the
/// budget is charged the first run's usage only.
async fn fifty_replays_charge_the_budget_once(store: impl Store) {
    for rate_outside in [true, false] {
        for settled in [Settled::Head, Settled::BodySize, Settled::Stream] {
            let case = format!("rate outside: {rate_outside}, settled on {settled:?}");
            let runs = Arc::new(AtomicUsize::new(0));
            let rate = budget(store.clone(), settled);
            let service = stack(&store, rate_outside, rate.clone(), &runs);
            let first = service.clone().oneshot(pay("order-1")).await.unwrap();
            assert_eq!(first.status, StatusCode::CREATED, "{case}");
            assert!(!first.headers.contains_key("idempotent-replayed"), "{case}");
            assert_eq!(
                acme_left(&rate).await,
                BUDGET - USED,
                "{case}: the first run"
            );
            let mut replays = JoinSet::new();
            for _ in 0..50 {
                let service = service.clone();
                replays.spawn(async move { service.oneshot(pay("order-1")).await.unwrap() });
            }
            while let Some(replay) = replays.join_next().await {
                let replay = replay.unwrap();
                assert_eq!(replay.status, StatusCode::CREATED, "{case}");
                assert_eq!(replay.headers["idempotent-replayed"], "true", "{case}");
            }
            assert_eq!(runs.load(Ordering::SeqCst), 1, "{case}: upstream runs");
            assert_eq!(
                acme_left(&rate).await,
                BUDGET - USED,
                "{case}: after the replays"
            );
        }
    }
}

/// A concurrency limit and a rate limit stacked, in either order: each response carries both
/// policies, the inner layer's first.
async fn stacked_layers_both_advertise_their_policies(store: impl Store) {
    let rate_policy = r#""api";q=10;w=60"#;
    let in_flight_policy = r#""in-flight";q=2;qu="concurrent-requests""#;
    for rate_outside in [true, false] {
        let rate = RateLimitLayer::builder(store.clone())
            .limit(Limit::per_minute("api", 10))
            .prefix(unique("api"))
            .key(Header::from_static("x-tenant"))
            .build()
            .unwrap();
        let concurrency = in_flight(&store).advertise("in-flight").build().unwrap();
        let runs = Arc::new(AtomicUsize::new(0));
        let service: Stack = if rate_outside {
            BoxCloneService::new(
                ServiceBuilder::new()
                    .layer(rate)
                    .layer(concurrency)
                    .service(upstream(&runs))
                    .and_then(seen),
            )
        } else {
            BoxCloneService::new(
                ServiceBuilder::new()
                    .layer(concurrency)
                    .layer(rate)
                    .service(upstream(&runs))
                    .and_then(seen),
            )
        };
        let answer = service.oneshot(pay("unused")).await.unwrap();
        assert_eq!(answer.status, StatusCode::CREATED);
        let policies: Vec<&str> = answer
            .headers
            .get_all("ratelimit-policy")
            .iter()
            .map(|v| v.to_str().unwrap())
            .collect();
        let expected = if rate_outside {
            [in_flight_policy, rate_policy]
        } else {
            [rate_policy, in_flight_policy]
        };
        assert_eq!(policies, expected, "rate outside: {rate_outside}");
    }
}

/// A request body as clients send it: whole (with its length), in chunks (no length), or
/// stalled after its head.
enum Sent {
    Whole(Option<Bytes>),
    Chunks(std::collections::VecDeque<Bytes>),
    Stalled,
}

impl http_body::Body for Sent {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        self: std::pin::Pin<&mut Self>,
        _: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<http_body::Frame<Bytes>, Infallible>>> {
        let this = self.get_mut();
        let next = match this {
            Self::Whole(data) => data.take(),
            Self::Chunks(chunks) => chunks.pop_front(),
            Self::Stalled => return std::task::Poll::Pending,
        };
        std::task::Poll::Ready(next.map(|data| Ok(http_body::Frame::data(data))))
    }

    fn size_hint(&self) -> http_body::SizeHint {
        match self {
            Self::Whole(data) => {
                http_body::SizeHint::with_exact(data.as_ref().map_or(0, |d| d.len() as u64))
            }
            _ => http_body::SizeHint::default(),
        }
    }
}

/// A request's cost read from its JSON body by an estimate layer outside the rate limit: the
/// call reserves its `max_tokens`, the upstream gets the body intact and the budget is charged
/// what it used; a body over the cap (declared or streamed) is answered `413`, one that is not
/// JSON `400`, one that stalls `408` — none reaches the upstream or charges the budget.
async fn a_cost_is_read_from_the_body_or_the_request_refused(store: impl Store) {
    use tollgate::rate_limit::{Estimate, EstimateError, EstimateLayer};

    let seen_bodies = Arc::new(std::sync::Mutex::new(Vec::<Bytes>::new()));
    let runs = Arc::new(AtomicUsize::new(0));
    let rate = RateLimitLayer::builder(store.clone())
        .limit(Limit::per_hour("tokens", BUDGET))
        .prefix(unique("estimate"))
        .key(Header::from_static("x-tenant"))
        .cost(|parts| Estimate::of(parts).unwrap_or(1))
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
    let max_tokens = EstimateLayer::new(1024, |_, body| {
        let json: serde_json::Value =
            serde_json::from_slice(body).map_err(|_| EstimateError::new("the body is not JSON"))?;
        let max = json["max_tokens"].as_u64();
        Ok(max
            .ok_or(EstimateError::new("max_tokens is missing"))?
            .clamp(1, 4096))
    })
    .body_timeout(Duration::from_millis(300));
    let service = {
        let (seen_bodies, runs) = (Arc::clone(&seen_bodies), Arc::clone(&runs));
        ServiceBuilder::new()
            .layer(max_tokens)
            .layer(rate.clone())
            .service_fn(move |request: Request<Full<Bytes>>| {
                runs.fetch_add(1, Ordering::SeqCst);
                let seen_bodies = Arc::clone(&seen_bodies);
                async move {
                    let body = request.into_body().collect().await.unwrap().to_bytes();
                    seen_bodies.lock().unwrap().push(body);
                    let used = Response::builder().header("x-tokens-used", USED.to_string());
                    Ok::<_, Infallible>(used.body(Full::new(Bytes::new())).unwrap())
                }
            })
    };
    let call = |body: Sent, length: Option<usize>| {
        let mut request = Request::post("/v1/chat").header("x-tenant", "acme");
        if let Some(length) = length {
            request = request.header("content-length", length);
        }
        request.body(body).unwrap()
    };
    let answer = |request| {
        let service = service.clone();
        async move {
            let response = service.oneshot(request).await.unwrap();
            let status = response.status();
            let kind = response.headers().get("content-type").cloned();
            let body = response.into_body().collect().await.unwrap().to_bytes();
            (status, kind, String::from_utf8(body.to_vec()).unwrap())
        }
    };

    let json = Bytes::from_static(br#"{"max_tokens": 300, "prompt": "hi"}"#);
    let (status, _, _) = answer(call(Sent::Whole(Some(json.clone())), Some(json.len()))).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(*seen_bodies.lock().unwrap(), [json]);
    assert_eq!(acme_left(&rate).await, BUDGET - USED);

    let big = Bytes::from(vec![b' '; 2048]);
    let problem = Some(http::HeaderValue::from_static("application/problem+json"));
    let declared = answer(call(Sent::Whole(Some(big.clone())), Some(big.len()))).await;
    assert_eq!(
        (declared.0, &declared.1),
        (StatusCode::PAYLOAD_TOO_LARGE, &problem)
    );
    let chunks = big.chunks(256).map(Bytes::copy_from_slice).collect();
    let streamed = answer(call(Sent::Chunks(chunks), None)).await;
    assert_eq!(
        (streamed.0, &streamed.1),
        (StatusCode::PAYLOAD_TOO_LARGE, &problem)
    );
    let not_json = Bytes::from_static(b"max_tokens=300");
    let refused = answer(call(
        Sent::Whole(Some(not_json.clone())),
        Some(not_json.len()),
    ))
    .await;
    assert_eq!((refused.0, &refused.1), (StatusCode::BAD_REQUEST, &problem));
    assert!(
        refused.2.contains(r#""detail":"the body is not JSON""#),
        "{}",
        refused.2
    );
    let stalled = answer(call(Sent::Stalled, Some(100))).await;
    assert_eq!(
        (stalled.0, &stalled.1),
        (StatusCode::REQUEST_TIMEOUT, &problem)
    );

    assert_eq!(runs.load(Ordering::SeqCst), 1, "only the good call ran");
    assert_eq!(
        acme_left(&rate).await,
        BUDGET - USED,
        "refusals charge nothing"
    );
}

on_memory_redis_postgres!(
    fifty_replays_charge_the_budget_once,
    stacked_layers_both_advertise_their_policies,
    a_cost_is_read_from_the_body_or_the_request_refused,
    the_documented_stack_replays_without_permits,
);

/// The stack the docs give for a metered endpoint — the budget outside, then the idempotency
/// layer, then the limit in flight, put in that order by `tollgate::stack::Stack` whatever
/// order they are given in — answers 50 replays of a completed key at once, every one
/// a replay (none refused for want of a permit it never needed), charges the budget once, and
/// still holds executions to the limit in flight.
async fn the_documented_stack_replays_without_permits(store: impl Store) {
    let runs = Arc::new(AtomicUsize::new(0));
    let rate = budget(store.clone(), Settled::Head);
    let idempotency = idempotency(&store);
    let in_flight = in_flight(&store).build().unwrap();
    let gate = Arc::new(tokio::sync::Semaphore::new(0));
    let upstream = {
        let (runs, gate) = (Arc::clone(&runs), Arc::clone(&gate));
        tower::service_fn(move |_: Request<_>| {
            runs.fetch_add(1, Ordering::SeqCst);
            let gate = Arc::clone(&gate);
            async move {
                gate.acquire().await.unwrap().forget();
                let body = Full::new(Bytes::from(vec![b'x'; USED as usize]));
                let response = Response::builder()
                    .status(StatusCode::CREATED)
                    .header("x-tokens-used", USED.to_string());
                Ok::<_, Infallible>(response.body(body).unwrap())
            }
        })
    };
    // given innermost first: the stack puts each layer in its place
    let layers = tollgate::stack::Stack::new()
        .in_flight(in_flight)
        .idempotency(idempotency)
        .budget(rate.clone());
    let service: Stack = BoxCloneService::new(
        ServiceBuilder::new()
            .layer(layers)
            .service(upstream)
            .and_then(seen),
    );
    gate.add_permits(1);
    let first = service.clone().oneshot(pay("order-1")).await.unwrap();
    assert_eq!(first.status, StatusCode::CREATED);
    let mut replays = JoinSet::new();
    for _ in 0..50 {
        let service = service.clone();
        replays.spawn(async move { service.oneshot(pay("order-1")).await.unwrap() });
    }
    while let Some(replay) = replays.join_next().await {
        let replay = replay.unwrap();
        assert_eq!(replay.status, StatusCode::CREATED);
        assert_eq!(replay.headers["idempotent-replayed"], "true");
    }
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    assert_eq!(acme_left(&rate).await, BUDGET - USED);
    // five new orders at once: two run, three are refused for want of a permit
    let mut orders = JoinSet::new();
    for n in 0..5 {
        let service = service.clone();
        orders.spawn(async move { service.oneshot(pay(&format!("order-{}", n + 2))).await });
    }
    let mut refused = 0;
    while refused < 3 {
        let answer = orders.join_next().await.unwrap().unwrap().unwrap();
        assert_eq!(answer.status, StatusCode::TOO_MANY_REQUESTS);
        refused += 1;
    }
    gate.add_permits(2);
    while let Some(answer) = orders.join_next().await {
        assert_eq!(answer.unwrap().unwrap().status, StatusCode::CREATED);
    }
    assert_eq!(runs.load(Ordering::SeqCst), 3);
}
