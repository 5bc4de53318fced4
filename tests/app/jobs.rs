//! The example app's jobs (`POST /jobs/{tenant}/run`) across copies on one Redis, one Redis
//! Cluster and one PostgreSQL database: at most `APP_JOB_CONCURRENCY` per tenant at once, and a
//! copy killed mid-job gives its permits back within the lease.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use crate::app::serve;
use crate::common;
use crate::router as app;

use std::sync::Arc;
use std::time::{Duration, Instant};

use app::{AppConfig, AppState, JobConfig};
use axum::Router;
use axum::body::Body;
use bytes::Bytes;
use common::RedisServer;
use common::cluster::RedisCluster;
use common::postgres;
use http::{Request, StatusCode};
use http_body_util::BodyExt;
use serde_json::Value;
use tollgate::store::Store;
use tower::ServiceExt;

const JOB: Duration = Duration::from_millis(1500);

fn config(tenants: &[&str]) -> AppConfig {
    AppConfig {
        api_keys: crate::own_keys(tenants),
        limits: app::parse_limits("burst:1000/1s").unwrap(),
        jobs: JobConfig {
            duration: JOB,
            concurrency: 2,
            lease: Duration::from_millis(3000),
            tiers: Vec::new(),
        },
        ..AppConfig::defaults().unwrap()
    }
}

fn copies_of(stores: Vec<Arc<dyn Store>>, tenants: &[&str]) -> Vec<Router> {
    stores
        .into_iter()
        .map(|store| app::router(AppState::new(store, config(tenants)).unwrap()))
        .collect()
}

/// A job of `tenant`, with its API key (its name).
fn job(tenant: &str) -> Request<Body> {
    Request::post(format!("/jobs/{tenant}/run"))
        .header("x-api-key", tenant)
        .body(Body::empty())
        .unwrap()
}

/// Runs one job of `tenant` on `app`: its status, `Retry-After` and JSON body.
async fn run(app: Router, tenant: String) -> (StatusCode, Option<String>, Value) {
    let response = app.oneshot(job(&tenant)).await.unwrap();
    let (parts, body) = response.into_parts();
    let bytes = body.collect().await.unwrap().to_bytes();
    let retry_after = parts
        .headers
        .get("retry-after")
        .map(|v| v.to_str().unwrap().to_owned());
    let json = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
    (parts.status, retry_after, json)
}

/// Runs `n` jobs of `tenant` at once, spread over `apps`.
async fn run_parallel(
    apps: &[Router],
    tenant: &str,
    n: usize,
) -> Vec<(StatusCode, Option<String>, Value)> {
    let runs = (0..n).map(|i| run(apps[i % apps.len()].clone(), tenant.to_owned()));
    futures_util::future::join_all(runs).await
}

/// The permits of the `200`s, after checking that exactly `admitted` of `answers` ran and every
/// other one was refused with `429` problem details and `Retry-After`.
fn exactly(
    answers: &[(StatusCode, Option<String>, Value)],
    tenant: &str,
    admitted: usize,
) -> Vec<u64> {
    let mut permits = Vec::new();
    for (status, retry_after, body) in answers {
        match *status {
            StatusCode::OK => {
                assert_eq!(body["tenant"], tenant);
                permits.push(body["permit"].as_u64().expect("an integer permit"));
            }
            StatusCode::TOO_MANY_REQUESTS => {
                // the job's duration, 1.5 s, in whole seconds rounded up
                assert_eq!(retry_after.as_deref(), Some("2"));
                assert_eq!(body["status"], 429);
            }
            other => panic!("unexpected {other}: {body}"),
        }
    }
    assert_eq!(permits.len(), admitted, "{answers:?}");
    assert_eq!(answers.len() - permits.len(), answers.len() - admitted);
    permits
}

/// 20 parallel jobs of one tenant over two copies: exactly 2 run, 18 are refused; another
/// tenant at the same time is not affected; two more run once those ended, with higher permits.
async fn twenty_jobs_two_run(stores: Vec<Arc<dyn Store>>) {
    let tenant = format!("acme-{}", uuid::Uuid::new_v4().simple());
    let other = format!("globex-{}", uuid::Uuid::new_v4().simple());
    let apps = copies_of(stores, &[&tenant, &other]);
    let (acme, globex) = tokio::join!(
        run_parallel(&apps, &tenant, 20),
        run_parallel(&apps, &other, 2)
    );
    let first = exactly(&acme, &tenant, 2);
    exactly(&globex, &other, 2);
    assert_ne!(first[0], first[1]);
    // the permits go back in the background as the responses end: one store call each, given
    // a second (a permit that was not given back would still be held: its lease is 3 s)
    tokio::time::sleep(Duration::from_secs(1)).await;
    let again = run_parallel(&apps, &tenant, 3).await;
    let second = exactly(&again, &tenant, 2);
    let last_first = first.iter().max().unwrap();
    assert!(
        second.iter().all(|p| p > last_first),
        "{first:?} then {second:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_copies_twenty_parallel_jobs_exactly_two_run() {
    let server = RedisServer::start();
    let stores = (0..2)
        .map(|_| Arc::new(server.store()) as Arc<dyn Store>)
        .collect();
    twenty_jobs_two_run(stores).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_a_cluster_two_copies_twenty_parallel_jobs_exactly_two_run() {
    let cluster = RedisCluster::shared();
    let mut stores: Vec<Arc<dyn Store>> = Vec::new();
    for _ in 0..2 {
        stores.push(Arc::new(cluster.store().await));
    }
    twenty_jobs_two_run(stores).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_postgres_two_copies_twenty_parallel_jobs_exactly_two_run() {
    let server = tokio::task::spawn_blocking(postgres::shared).await.unwrap();
    let schema = postgres::unique_schema();
    let mut stores: Vec<Arc<dyn Store>> = Vec::new();
    for _ in 0..2 {
        let store = server
            .builder()
            .schema(schema.clone())
            .connect()
            .await
            .unwrap();
        stores.push(Arc::new(store));
    }
    twenty_jobs_two_run(stores).await;
}

/// A job is run only for a caller of its own tenant: `401` without a key or with one the table
/// does not know, `403` with another tenant's; none of them takes a permit.
#[tokio::test]
async fn a_job_needs_an_api_key_of_its_tenant() {
    let store: Arc<dyn Store> = Arc::new(tollgate::store::MemoryStore::new());
    let app = copies_of(vec![store], &["acme", "globex"]).remove(0);
    let send = |request: Request<Body>| app.clone().oneshot(request);
    let anonymous = Request::post("/jobs/acme/run").body(Body::empty()).unwrap();
    assert_eq!(
        send(anonymous).await.unwrap().status(),
        StatusCode::UNAUTHORIZED
    );
    let unknown = Request::post("/jobs/acme/run")
        .header("x-api-key", "guess")
        .body(Body::empty())
        .unwrap();
    assert_eq!(
        send(unknown).await.unwrap().status(),
        StatusCode::UNAUTHORIZED
    );
    let other = Request::post("/jobs/acme/run")
        .header("x-api-key", "globex")
        .body(Body::empty())
        .unwrap();
    assert_eq!(send(other).await.unwrap().status(), StatusCode::FORBIDDEN);
    // both of acme's permits are still free
    let (first, second) = tokio::join!(
        run(app.clone(), "acme".into()),
        run(app.clone(), "acme".into())
    );
    assert_eq!((first.0, second.0), (StatusCode::OK, StatusCode::OK));
}

/// `POST <url>/jobs/<tenant>/run`; `None` while it has not answered after `wait` (a job that
/// runs), else its status.
async fn job_status(url: &str, tenant: &str, wait: Duration) -> Option<StatusCode> {
    let client = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .build_http::<http_body_util::Empty<Bytes>>();
    let request = Request::post(format!("{url}/jobs/{tenant}/run"))
        .header("x-api-key", tenant)
        .body(http_body_util::Empty::new())
        .unwrap();
    match tokio::time::timeout(wait, client.request(request)).await {
        Ok(response) => Some(response.unwrap().status()),
        Err(_) => None,
    }
}

/// `GET <url><path>`: its status and body.
async fn get(url: &str, path: &str) -> (StatusCode, String) {
    let client = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .build_http::<http_body_util::Empty<Bytes>>();
    let request = Request::get(format!("{url}{path}"))
        .body(http_body_util::Empty::new())
        .unwrap();
    let response = client.request(request).await.unwrap();
    let status = response.status();
    let body = response.into_body().collect().await.unwrap().to_bytes();
    (status, String::from_utf8_lossy(&body).into_owned())
}

/// Returns once the copy at `url` has admitted `jobs` jobs with permits from the store, as its
/// metrics count them, for at most 10 s. Admissions without a permit (the store failed) fail
/// the test: they would prove nothing.
async fn admitted_by_the_store(url: &str, jobs: u64) {
    let limiter = "tollgate_concurrency_decisions_total{limiter=\"tollgate-app:cc\"";
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let (_, metrics) = get(url, "/metrics").await;
        let count = |labels: &str| {
            let series = format!("{limiter},{labels}}} ");
            metrics
                .lines()
                .find_map(|line| line.strip_prefix(&series))
                .map_or(0, |n| n.parse::<u64>().unwrap())
        };
        assert_eq!(
            count("outcome=\"admitted\",source=\"store_unavailable\""),
            0,
            "setup: a job was admitted without the store: {metrics}"
        );
        if count("outcome=\"admitted\",source=\"store\"") == jobs {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "setup: {jobs} jobs were not admitted within 10 s: {metrics}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Returns once the copy at `url` answers `/healthz` with `200` (its store answers), for at
/// most 10 s.
async fn healthy(url: &str) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while get(url, "/healthz").await.0 != StatusCode::OK {
        assert!(
            Instant::now() < deadline,
            "setup: {url} not healthy in 10 s"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Two copies of the binary on the store `vars` name; copy A runs two long jobs and is killed
/// with SIGKILL: copy B refuses the tenant until A's permits' leases end, then runs two jobs.
async fn a_killed_copy_gives_its_permits_back(store: &[(&str, &str)]) {
    let lease = Duration::from_millis(1000);
    let tenant = format!("initech-{}", uuid::Uuid::new_v4().simple());
    let keys = crate::own_keys_var(&[&tenant]);
    let mut vars = store.to_vec();
    vars.extend([
        ("APP_API_KEYS", keys.as_str()),
        ("APP_JOB_MS", "20000"),
        ("APP_JOB_CONCURRENCY", "2"),
        ("APP_JOB_LEASE_MS", "1000"),
        ("APP_STORE_TIMEOUT_MS", "500"),
    ]);
    let (mut a, url_a) = serve(&vars);
    let (_b, url_b) = serve(&vars);
    healthy(&url_a).await;
    healthy(&url_b).await;
    // a job that runs never answers within this (it runs 20 s); a refusal always does
    let quick = Duration::from_secs(1);
    // two jobs run on A for the whole test
    let held: Vec<_> = (0..2)
        .map(|_| {
            let (url, tenant) = (url_a.clone(), tenant.clone());
            tokio::spawn(async move { job_status(&url, &tenant, Duration::from_secs(60)).await })
        })
        .collect();
    admitted_by_the_store(&url_a, 2).await;
    assert_eq!(
        job_status(&url_b, &tenant, quick).await,
        Some(StatusCode::TOO_MANY_REQUESTS),
        "A holds both permits"
    );
    a.0.kill().unwrap();
    let killed = Instant::now();
    let _ = a.0.wait();
    // B refuses until the leases end, then runs two jobs at once
    loop {
        let sent = killed.elapsed();
        let (one, two) = tokio::join!(
            job_status(&url_b, &tenant, quick),
            job_status(&url_b, &tenant, quick)
        );
        if one.is_none() && two.is_none() {
            break;
        }
        assert!(
            sent < lease + Duration::from_millis(1500),
            "A's permits still held {sent:?} after the kill"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    drop(held);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_copy_killed_mid_job_gives_its_permits_back_within_the_lease() {
    let server = RedisServer::start();
    a_killed_copy_gives_its_permits_back(&[("REDIS_URL", &server.url())]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_a_cluster_a_copy_killed_mid_job_gives_its_permits_back_within_the_lease() {
    let urls = RedisCluster::shared().urls().join(",");
    a_killed_copy_gives_its_permits_back(&[("REDIS_CLUSTER_URLS", &urls)]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_postgres_a_copy_killed_mid_job_gives_its_permits_back_within_the_lease() {
    let server = tokio::task::spawn_blocking(postgres::shared).await.unwrap();
    a_killed_copy_gives_its_permits_back(&[("DATABASE_URL", &server.url())]).await;
}
