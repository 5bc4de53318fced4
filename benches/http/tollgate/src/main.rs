// tollgate's RateLimitLayer on its RedisStore (REDIS_URL), keyed by the x-api-key header (one
// shared bucket, `Global`, when absent, like the peers' "anon"). Everything else at the crate's
// defaults: RateLimit / RateLimit-Policy headers on every response, the deny cache, allow when
// Redis is down.
// ALGO=concurrency: a ConcurrencyLimitLayer instead (at most QUOTA, default 1e6, requests per
// x-api-key in flight: never refused here), to price a permit taken and given back per request.
// LEASE=1: the limit is leased (`Limit::leased`): each caller that sends several requests within
// a lease is decided from slices of its quota taken in one store check each.
// SETTLE=1: each request reserves 2 and is settled to 1 after its response (reserve, then
// settle), to price the settlement.
// ALGO=log (default, sliding log) | counter (sliding counter) | gcra. One limit of QUOTA per
// WINDOW_S seconds (default 60 s) that never denies here; the baseline's 1e9 per 60 s where the
// algorithm accepts it (counter), else the largest round quota it accepts for 60 s: the log keeps
// a member per request, so at most MAX_LOG_QUOTA (1e5); GCRA needs quota x window (us) < 2^52,
// so 5e7. (GCRA with 5e7 / 60 s lets a key expire ~1 ms after each request, like trl_redis with
// GCRA_EMISSION_MS=1; QUOTA=65535 WINDOW_S=65535 keeps keys alive as trl_redis's default does.)
use std::time::Duration;

use axum::{Router, routing::get};
use tollgate::concurrency::ConcurrencyLimitLayer;
use tollgate::key::{Global, Header, KeyExtractor};
use tollgate::rate_limit::{Algorithm, Limit, MAX_LOG_QUOTA, RateLimitLayer};
use tollgate::store::RedisStore;

fn env_u64(name: &str) -> Option<u64> {
    std::env::var(name).ok().map(|v| v.parse().expect(name))
}

/// The store at `url`; `MAX_BATCH` caps the checks one call carries (default: the store's).
fn store(url: String) -> RedisStore {
    let builder = RedisStore::builder(url);
    let builder = match env_u64("MAX_BATCH") {
        Some(n) => builder.max_batch(usize::try_from(n).expect("MAX_BATCH fits a usize")),
        None => builder,
    };
    builder.build().unwrap()
}

#[tokio::main]
async fn main() {
    let url = std::env::var("REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6390/".into());
    let routes = Router::new()
        .route("/", get(|| async { "hello" }))
        .route("/healthz", get(|| async { "ok" }))
        .route("/api/hello", get(|| async { "hello" }));
    if std::env::var("ALGO").as_deref() == Ok("concurrency") {
        let limit = env_u64("QUOTA").unwrap_or(1_000_000);
        let layer = ConcurrencyLimitLayer::builder(store(url))
            .limit(u32::try_from(limit).expect("QUOTA fits a u32"))
            .key(Header::from_static("x-api-key").or(Global))
            .build()
            .unwrap();
        return serve(routes.layer(layer)).await;
    }
    let (algorithm, quota) = match std::env::var("ALGO").as_deref().unwrap_or("log") {
        "log" => (Algorithm::SlidingLog, MAX_LOG_QUOTA),
        "counter" => (Algorithm::SlidingCounter, 1_000_000_000),
        "gcra" => (Algorithm::Gcra, 50_000_000),
        other => panic!("ALGO={other}: expected log, counter or gcra"),
    };
    let quota = env_u64("QUOTA").unwrap_or(quota);
    let window = Duration::from_secs(env_u64("WINDOW_S").unwrap_or(60));
    let limit = Limit::new("api", quota, window);
    let limit = if std::env::var("LEASE").as_deref() == Ok("1") {
        limit.leased()
    } else {
        limit
    };
    let layer = RateLimitLayer::builder(store(url))
        .limit(limit)
        .algorithm(algorithm)
        .key(Header::from_static("x-api-key").or(Global))
        .headers_on_success(std::env::var("HEADERS").map_or(true, |v| v != "0"));
    let layer = if std::env::var("SETTLE").as_deref() == Ok("1") {
        layer.cost(|_| 2).settle(|_| Some(1))
    } else {
        layer
    };
    let layer = layer.build().unwrap();
    // `.layer` on the whole router, as the baseline: every route is limited.
    serve(routes.layer(layer)).await;
}

async fn serve(app: Router) {
    let port = std::env::var("PORT").unwrap_or_else(|_| "3000".into());
    let listener = tokio::net::TcpListener::bind(format!("127.0.0.1:{port}"))
        .await
        .unwrap();
    axum::serve(listener, app).await.unwrap();
}
