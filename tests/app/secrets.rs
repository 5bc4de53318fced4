//! The example app's configuration and state show no secret: a password in each store variable
//! and the admin token are in neither `AppConfig`'s nor `AppState`'s `Debug`, and a store URL
//! the app refuses is named without its password.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use crate::env;
use crate::router as app;

use std::sync::Arc;

use app::{AppConfig, AppState};
use tollgate::store::MemoryStore;

const PASSWORD: &str = "plantedPw7Hk2xQ";
const ADMIN_TOKEN: &str = "plantedAdminToken55";

#[tokio::test]
async fn the_apps_debug_shows_no_password_and_no_admin_token() {
    let stores = [
        ("REDIS_URL", format!("redis://:{PASSWORD}@127.0.0.1:6379/")),
        (
            "REDIS_CLUSTER_URLS",
            format!("redis://:{PASSWORD}@10.0.0.1:7000/,redis://u:{PASSWORD}@10.0.0.2:7001/"),
        ),
        (
            "REDIS_SENTINELS",
            format!("redis+unix:///run/s.sock?pass={PASSWORD},redis://:{PASSWORD}@10.0.0.3/"),
        ),
        (
            "DATABASE_URL",
            format!("host=db user=app password='{PASSWORD} x' dbname=app"),
        ),
    ];
    for (var, value) in stores {
        let lookup = |name: &str| match name {
            n if n == var => Some(value.clone()),
            "REDIS_SENTINEL_MASTER" => Some("mymaster".to_owned()),
            "APP_ADMIN_TOKEN" => Some(ADMIN_TOKEN.to_owned()),
            _ => None,
        };
        let config = AppConfig::from_lookup(lookup).unwrap();
        let state = AppState::new(Arc::new(MemoryStore::new()), config.clone()).unwrap();
        let shown = format!("{config:?}\n{config:#?}\n{state:?}\n{state:#?}");
        assert!(!shown.contains(PASSWORD), "{var}: {shown}");
        assert!(!shown.contains(ADMIN_TOKEN), "{var}: {shown}");
        assert!(shown.contains("***"), "{var}: {shown}");
    }
}

#[tokio::test]
async fn a_refused_store_url_is_named_without_its_password() {
    let error = env::redis_store(&format!("redis://:{PASSWORD}@:6379/"), 0, None)
        .map(drop)
        .unwrap_err();
    let shown = format!("{error}\n{error:?}");
    assert!(!shown.contains(PASSWORD), "{shown}");
    assert!(shown.contains("redis://:***@:6379/"), "{shown}");
}
