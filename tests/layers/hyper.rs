//! The hyper example's server (`examples/hyper/server.rs`) under a real hyper client over TCP,
//! against a real `redis-server`: `429` with `Retry-After` and `RateLimit` headers, idempotent
//! replays with `Idempotent-Replayed: true`; and the examples' environment parsing.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use crate::common;
use crate::{grpc_config as config, hyper_server as server};

use std::sync::Arc;

use bytes::Bytes;
use http::{HeaderMap, Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use tokio::net::TcpListener;
use tollgate::rate_limit::Limit;

use common::RedisServer;
use config::Config;
use server::Layers;

type HttpClient = Client<HttpConnector, Full<Bytes>>;

/// Serves the example on a fresh Redis with `limits`; its base URL, a client and the Redis.
async fn start(limits: Vec<Limit>) -> (String, HttpClient, RedisServer) {
    let redis = RedisServer::start();
    let layers = Layers::new(Arc::new(redis.store()), limits).unwrap();
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(server::serve(listener, layers, std::future::pending()));
    let client = Client::builder(TokioExecutor::new()).build_http();
    (url, client, redis)
}

/// Sends `request`; status, headers and body.
async fn send(
    client: &HttpClient,
    request: Request<Full<Bytes>>,
) -> (StatusCode, HeaderMap, Bytes) {
    let response = client.request(request).await.unwrap();
    let (parts, body) = response.into_parts();
    (
        parts.status,
        parts.headers,
        body.collect().await.unwrap().to_bytes(),
    )
}

fn hello(url: &str, api_key: Option<&str>) -> Request<Full<Bytes>> {
    let mut builder = Request::get(format!("{url}/hello"));
    if let Some(key) = api_key {
        builder = builder.header("x-api-key", key);
    }
    builder.body(Full::default()).unwrap()
}

fn order(url: &str, idempotency_key: Option<&str>, body: &'static str) -> Request<Full<Bytes>> {
    let mut builder = Request::post(format!("{url}/orders"))
        .header("x-api-key", "alice")
        .header("content-type", "application/json");
    if let Some(key) = idempotency_key {
        builder = builder.header("idempotency-key", key);
    }
    builder
        .body(Full::new(Bytes::from_static(body.as_bytes())))
        .unwrap()
}

#[tokio::test(flavor = "multi_thread")]
async fn over_the_limit_requests_get_429_with_retry_after_and_ratelimit_headers() {
    let (url, client, _redis) = start(vec![
        Limit::per_second("burst", 10),
        Limit::per_minute("minute", 3),
    ])
    .await;
    for remaining in [2, 1, 0] {
        let (status, headers, body) = send(&client, hello(&url, Some("alice"))).await;
        assert_eq!(status, StatusCode::OK);
        assert_eq!(body, "hello from hyper\n");
        assert_eq!(
            headers["ratelimit-policy"],
            r#""burst";q=10;w=1, "minute";q=3;w=60"#
        );
        let ratelimit = headers["ratelimit"].to_str().unwrap();
        assert!(
            ratelimit.ends_with(&format!(r#""minute";r={remaining};t=60"#)),
            "{ratelimit}"
        );
    }
    let (status, headers, body) = send(&client, hello(&url, Some("alice"))).await;
    assert_eq!(status, StatusCode::TOO_MANY_REQUESTS);
    common::assert_quota_problem(&body, &["minute"]);
    assert_eq!(headers["retry-after"], "60");
    assert_eq!(
        headers["ratelimit-policy"],
        r#""burst";q=10;w=1, "minute";q=3;w=60"#
    );
    let ratelimit = headers["ratelimit"].to_str().unwrap();
    assert!(ratelimit.ends_with(r#""minute";r=0;t=60"#), "{ratelimit}");

    // per caller: another API key is not limited by alice's requests
    let (status, _, _) = send(&client, hello(&url, Some("bob"))).await;
    assert_eq!(status, StatusCode::OK);
    // without an API key, the caller is its IP address
    for _ in 0..3 {
        assert_eq!(send(&client, hello(&url, None)).await.0, StatusCode::OK);
    }
    assert_eq!(
        send(&client, hello(&url, None)).await.0,
        StatusCode::TOO_MANY_REQUESTS
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_request_with_an_idempotency_key_is_replayed() {
    let (url, client, _redis) = start(vec![Limit::per_minute("minute", 100)]).await;
    let (status, headers, first) =
        send(&client, order(&url, Some("order-1"), r#"{"item":"book"}"#)).await;
    assert_eq!(status, StatusCode::CREATED);
    assert!(headers.get("idempotent-replayed").is_none());
    assert_eq!(headers["content-type"], "application/json");
    let created: serde_json::Value = serde_json::from_slice(&first).unwrap();
    assert_eq!(created["request"], r#"{"item":"book"}"#);

    let (status, headers, replay) =
        send(&client, order(&url, Some("order-1"), r#"{"item":"book"}"#)).await;
    assert_eq!(status, StatusCode::CREATED);
    assert_eq!(headers["idempotent-replayed"], "true");
    assert_eq!(headers["content-type"], "application/json");
    assert_eq!(
        replay, first,
        "the replay is the first response, byte for byte"
    );

    // without a key the handler runs again: a new order
    let (status, _, again) = send(&client, order(&url, None, r#"{"item":"book"}"#)).await;
    assert_eq!(status, StatusCode::CREATED);
    let again: serde_json::Value = serde_json::from_slice(&again).unwrap();
    assert_ne!(again["order"], created["order"]);

    // the same key with another body is refused
    let (status, _, _) = send(&client, order(&url, Some("order-1"), r#"{"item":"pen"}"#)).await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY);

    // GET is not covered: it passes through untouched
    let (status, headers, _) = send(
        &client,
        Request::get(format!("{url}/hello"))
            .header("idempotency-key", "order-1")
            .body(Full::default())
            .unwrap(),
    )
    .await;
    assert_eq!(status, StatusCode::OK);
    assert!(headers.get("idempotent-replayed").is_none());
}

#[test]
fn the_examples_read_their_environment_and_name_bad_variables() {
    let env = |vars: &'static [(&'static str, &'static str)]| {
        move |name: &str| {
            vars.iter()
                .find(|(n, _)| *n == name)
                .map(|(_, v)| (*v).to_owned())
        }
    };
    let defaults = Config::from_lookup(3001, env(&[])).unwrap();
    assert_eq!(defaults.port, 3001);
    assert_eq!(defaults.redis_url, None);
    assert_eq!(defaults.describe_limits(), "burst:5/1s,minute:100/60s");

    let set = Config::from_lookup(
        3001,
        env(&[
            ("PORT", "0"),
            ("REDIS_URL", " redis://127.0.0.1:6390/ "),
            ("APP_LIMITS", "a:1/2s, b:30/3600s"),
        ]),
    )
    .unwrap();
    assert_eq!(set.port, 0);
    assert_eq!(set.redis_url.as_deref(), Some("redis://127.0.0.1:6390/"));
    assert_eq!(set.describe_limits(), "a:1/2s,b:30/3600s");

    for (vars, var) in [
        (&[("PORT", "70000")][..], "PORT"),
        (&[("PORT", "http")][..], "PORT"),
        (&[("APP_LIMITS", "burst:5/1")][..], "APP_LIMITS"),
        (&[("APP_LIMITS", "burst:0/1s")][..], "APP_LIMITS"),
        (&[("APP_LIMITS", "a:1/1s,a:2/2s")][..], "APP_LIMITS"),
        (&[("APP_LIMITS", "a:1/1s,")][..], "APP_LIMITS"),
    ] {
        let error = Config::from_lookup(3001, env(vars)).unwrap_err();
        assert_eq!(error.var, var);
        assert!(
            error.to_string().starts_with(&format!("invalid {var}=")),
            "{error}"
        );
    }
    let error = Config::from_lookup(3001, env(&[("REDIS_URL", "http://u:secret@host/")]))
        .unwrap()
        .open_store()
        .unwrap_err();
    assert_eq!(error.var, "REDIS_URL");
    assert!(!error.to_string().contains("secret"), "{error}");
}
