// axum hello world + from_fn middleware that runs one EVALSHA per request via
// redis-rs 1.x ConnectionManager (multiplexed, pipelines concurrent requests on one
// connection). Limit is huge so everything is allowed; the point is to cost exactly
// one Redis round trip per request.
// LIMITER=log (default) | counter | noop (middleware that does no Redis call)
use axum::{
    extract::{Request, State},
    http::StatusCode,
    middleware::{self, Next},
    response::{IntoResponse, Response},
    routing::get,
    Router,
};
use redis::aio::ConnectionManager;

const LOG_LUA: &str = include_str!("../lua/sw_log.lua");
const COUNTER_LUA: &str = include_str!("../lua/sw_counter.lua");

#[derive(Clone)]
struct Limiter {
    conn: Option<ConnectionManager>,
    script: redis::Script,
}

async fn rate_limit(State(l): State<Limiter>, req: Request, next: Next) -> Response {
    let Some(conn) = &l.conn else {
        return next.run(req).await; // noop variant
    };
    let id = req
        .headers()
        .get("x-api-key")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("anon");
    let key = format!("rl:{id}");
    let mut conn = conn.clone();
    // Script::invoke_async sends EVALSHA and falls back to EVAL on NOSCRIPT.
    let res: redis::RedisResult<(i64, i64)> = l
        .script
        .key(&key)
        .arg(60_000i64) // window ms
        .arg(1_000_000_000i64) // limit: effectively unlimited
        .invoke_async(&mut conn)
        .await;
    match res {
        Ok((1, _remaining)) => next.run(req).await,
        Ok(_) => StatusCode::TOO_MANY_REQUESTS.into_response(),
        Err(e) => (StatusCode::SERVICE_UNAVAILABLE, e.to_string()).into_response(),
    }
}

#[tokio::main]
async fn main() {
    let mode = std::env::var("LIMITER").unwrap_or_else(|_| "log".into());
    let url = std::env::var("REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6390/".into());
    let (conn, src) = match mode.as_str() {
        "noop" => (None, LOG_LUA),
        m => {
            let client = redis::Client::open(url).unwrap();
            let conn = ConnectionManager::new(client).await.unwrap();
            (
                Some(conn),
                if m == "counter" { COUNTER_LUA } else { LOG_LUA },
            )
        }
    };
    let limiter = Limiter {
        conn,
        script: redis::Script::new(src),
    };
    let app = Router::new()
        .route("/", get(|| async { "hello" }))
        .route("/healthz", get(|| async { "ok" }))
        .route("/api/hello", get(|| async { "hello" }))
        .layer(middleware::from_fn_with_state(limiter.clone(), rate_limit))
        .with_state(limiter);
    let port = std::env::var("PORT").unwrap_or_else(|_| "3000".into());
    let listener = tokio::net::TcpListener::bind(format!("127.0.0.1:{port}"))
        .await
        .unwrap();
    axum::serve(listener, app).await.unwrap();
}
