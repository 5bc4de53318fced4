//! Rate-limit configuration from files (feature `serde`, on for the tests): limits with their
//! windows, algorithms, failure policies, and errors that say what is wrong.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::convert::Infallible;
use std::time::Duration;

use http::{Request, Response, StatusCode};
use tower::{ServiceBuilder, ServiceExt};

use tollgate::key::Header;
use tollgate::rate::Limit;
use tollgate::rate_limit::{Algorithm, OnStoreError, RateLimitConfig, RateLimitLayer};
use tollgate::store::MemoryStore;

fn limit(json: &str) -> Result<Limit, String> {
    serde_json::from_str(json).map_err(|e| e.to_string())
}

#[test]
fn windows_take_a_unit_or_whole_seconds() {
    for (window, expected) in [
        (r#""250ms""#, Duration::from_millis(250)),
        (r#""1s""#, Duration::from_secs(1)),
        (r#""5m""#, Duration::from_secs(300)),
        (r#""1h""#, Duration::from_secs(3600)),
        (r#""2d""#, Duration::from_secs(172_800)),
        ("30", Duration::from_secs(30)),
    ] {
        let json = format!(r#"{{"name": "l", "quota": 3, "window": {window}}}"#);
        assert_eq!(
            limit(&json).unwrap(),
            Limit::new("l", 3, expected),
            "{window}"
        );
    }
    for window in [
        r#""1w""#,
        r#""ms""#,
        r#""1.5s""#,
        r#""""#,
        r#""99999999999999999999d""#,
    ] {
        let json = format!(r#"{{"name": "l", "quota": 3, "window": {window}}}"#);
        let error = limit(&json).unwrap_err();
        assert!(
            error.contains("invalid window") || error.contains("did not match"),
            "{window}: {error}"
        );
    }
    let error = limit(r#"{"name": "l", "quota": 3, "window": "1s", "burst": 2}"#).unwrap_err();
    assert!(error.contains("unknown field `burst`"), "{error}");
    let error = limit(r#"{"name": "l", "window": "1s"}"#).unwrap_err();
    assert!(error.contains("missing field `quota`"), "{error}");
}

#[test]
fn a_configuration_sets_what_it_names_and_leaves_the_rest() {
    let config: RateLimitConfig = serde_json::from_str(
        r#"{
            "limits": [{"name": "burst", "quota": 2, "window": "1h"}],
            "algorithm": "sliding-counter",
            "prefix": "cfg",
            "on_store_error": {"local_fallback": {"copies": 3}}
        }"#,
    )
    .unwrap();
    assert_eq!(config.algorithm, Some(Algorithm::SlidingCounter));
    assert_eq!(
        config.on_store_error,
        Some(OnStoreError::LocalFallback { copies: 3 })
    );
    let layer = RateLimitLayer::builder(MemoryStore::new())
        .config(config)
        .build()
        .unwrap();
    assert_eq!(layer.policy().algorithm(), Algorithm::SlidingCounter);
    assert_eq!(layer.policy().namespace(), "cfg:rl");
    assert_eq!(
        layer.policy().limits(),
        [Limit::new("burst", 2, Duration::from_secs(3600))]
    );

    for (json, expected) in [
        (r#""allow""#, OnStoreError::Allow),
        (r#""deny""#, OnStoreError::Deny),
    ] {
        let parsed: OnStoreError = serde_json::from_str(json).unwrap();
        assert_eq!(parsed, expected);
    }
    let error = serde_json::from_str::<RateLimitConfig>(r#"{"algorithm": "leaky-bucket"}"#)
        .unwrap_err()
        .to_string();
    assert!(
        error.contains("expected sliding-log, sliding-counter or gcra"),
        "{error}"
    );
    let error = serde_json::from_str::<RateLimitConfig>(r#"{"limit": []}"#)
        .unwrap_err()
        .to_string();
    assert!(error.contains("unknown field `limit`"), "{error}");
}

#[tokio::test]
async fn shadow_from_a_configuration_lets_everything_through() {
    let config: RateLimitConfig = serde_json::from_str(
        r#"{"limits": [{"name": "m", "quota": 1, "window": "1m"}], "shadow": true}"#,
    )
    .unwrap();
    let layer = RateLimitLayer::builder(MemoryStore::new())
        .config(config)
        .key(Header::from_static("x-client"))
        .build()
        .unwrap();
    let svc = ServiceBuilder::new()
        .layer(layer)
        .service(tower::service_fn(|_: Request<String>| async {
            Ok::<_, Infallible>(Response::new(String::from("hello")))
        }));
    for _ in 0..3 {
        let request = Request::get("/")
            .header("x-client", "eve")
            .body(String::new())
            .unwrap();
        assert_eq!(
            svc.clone().oneshot(request).await.unwrap().status(),
            StatusCode::OK
        );
    }
}
