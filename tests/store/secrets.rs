//! No secret in any output: a password planted in each connection-string form the stores accept
//! — Redis, Valkey and TLS URLs, Unix sockets with `?pass=`, PostgreSQL URLs with user info or
//! `?password=`, PostgreSQL `key=value` strings plain and quoted, lists of Sentinel and Cluster
//! nodes — is found in no `Debug` of a builder, a store or a layer built on it (`{:?}` and
//! `{:#?}`), no log line, no span field and no error (`Display`, `Debug`, `{:#?}`, its sources),
//! while connects fail and while calls succeed on real servers that ask for that password.
//!
//! Each test records through a subscriber of its own, set for its thread only (`set_default`),
//! on a single-threaded runtime: the store's tasks run on that thread too.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use crate::common;

use std::convert::Infallible;
use std::error::Error;
use std::fmt::{Debug, Write as _};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use http::{Request, Response, StatusCode};
use tollgate::claim::Claims;
use tollgate::concurrency::ConcurrencyLimitLayer;
use tollgate::idempotency::IdempotencyLayer;
use tollgate::key::Header;
use tollgate::lock::Locks;
use tollgate::rate::Limit;
use tollgate::rate_limit::RateLimitLayer;
use tollgate::store::{PgStore, RedisStore, Store, redact_connection_string};
use tower::{Layer as _, ServiceExt};
use tracing::field::{Field, Visit};
use tracing::span::{Attributes, Id, Record};
use tracing::subscriber::DefaultGuard;
use tracing::{Event, Subscriber};
use tracing_subscriber::fmt::format::FmtSpan;
use tracing_subscriber::layer::{Context, SubscriberExt};
use tracing_subscriber::{Layer, Registry};

use common::postgres::PgServer;

/// The password planted in every form.
const PASSWORD: &str = "plantedPw7Hk2xQ";

/// A caller's API key, which no log line or span may carry either (the store holds a digest).
const API_KEY: &str = "sk_live_plantedKey91";

// ---------------------------------------------------------------------------------------------
// What the code wrote
// ---------------------------------------------------------------------------------------------

/// Everything written through `tracing` while it is set: every event as the fmt layer prints
/// it (with its spans' fields, and a line as each span opens and closes), and every field of
/// every span and event as recorded, `Debug`-formatted.
#[derive(Clone, Default)]
struct Captured(Arc<Mutex<String>>);

impl Captured {
    /// Records this thread's `tracing` output until the guard is dropped.
    fn start() -> (Self, DefaultGuard) {
        let captured = Self::default();
        let writer = {
            let captured = captured.clone();
            move || captured.clone()
        };
        let fmt = tracing_subscriber::fmt::layer()
            .with_writer(writer)
            .with_ansi(false)
            .with_span_events(FmtSpan::FULL)
            .with_filter(tracing::level_filters::LevelFilter::TRACE);
        let subscriber = Registry::default().with(fmt).with(captured.clone());
        let guard = tracing::subscriber::set_default(subscriber);
        (captured, guard)
    }

    fn push(&self, text: &str) {
        self.0.lock().unwrap().push_str(text);
    }

    fn text(&self) -> String {
        self.0.lock().unwrap().clone()
    }
}

impl std::io::Write for Captured {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.push(&String::from_utf8_lossy(buf));
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Visit for &Captured {
    fn record_debug(&mut self, field: &Field, value: &dyn Debug) {
        self.push(&format!("{}={value:?}\n", field.name()));
    }
}

impl<S: Subscriber> Layer<S> for Captured {
    fn on_new_span(&self, attrs: &Attributes<'_>, _: &Id, _: Context<'_, S>) {
        attrs.record(&mut &*self);
    }

    fn on_record(&self, _: &Id, values: &Record<'_>, _: Context<'_, S>) {
        values.record(&mut &*self);
    }

    fn on_event(&self, event: &Event<'_>, _: Context<'_, S>) {
        event.record(&mut &*self);
    }
}

/// `value` under `{:?}` and `{:#?}`.
fn debug_of(value: &impl Debug) -> String {
    format!("{value:?}\n{value:#?}\n")
}

/// `error` under `Display`, `{:?}` and `{:#?}`, and each of its sources under `Display`.
fn error_text(error: &(dyn Error + 'static)) -> String {
    let mut text = format!("{error}\n{error:?}\n{error:#?}\n");
    let mut source = error.source();
    while let Some(cause) = source {
        let _ = writeln!(text, "{cause}\n{cause:?}");
        source = cause.source();
    }
    text
}

/// Fails when `text`, what `what` printed, holds the password.
#[track_caller]
fn assert_hidden(what: &str, text: &str) {
    assert!(
        !text.contains(PASSWORD),
        "{what} shows the password:\n{text}"
    );
}

// ---------------------------------------------------------------------------------------------
// A Redis that asks for the password
// ---------------------------------------------------------------------------------------------

/// A `redis-server` with `requirepass` set to the planted password, on a free port and a Unix
/// socket; killed on drop.
struct PasswordRedis {
    port: u16,
    dir: tempfile::TempDir,
    child: Child,
}

impl PasswordRedis {
    fn start() -> Self {
        common::require_redis_server();
        let dir = tempfile::tempdir().unwrap();
        let port = common::free_port();
        let socket = dir.path().join("redis.sock");
        let child = Command::new("redis-server")
            .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
            .args([
                "--save",
                "",
                "--appendonly",
                "no",
                "--requirepass",
                PASSWORD,
            ])
            .arg("--unixsocket")
            .arg(&socket)
            .arg("--dir")
            .arg(dir.path())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start redis-server");
        let server = Self { port, dir, child };
        server.wait_ready();
        server
    }

    fn wait_ready(&self) {
        let url = format!("redis://:{PASSWORD}@127.0.0.1:{}/", self.port);
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if let Ok(client) = redis::Client::open(url.as_str())
                && let Ok(mut conn) = client.get_connection()
                && redis::cmd("PING").query::<String>(&mut conn).is_ok()
                && self.socket().exists()
            {
                return;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        panic!("redis-server with a password did not answer within 10 s");
    }

    fn socket(&self) -> PathBuf {
        self.dir.path().join("redis.sock")
    }

    /// Every form that reaches this server with the password.
    fn forms(&self) -> Vec<String> {
        let (port, socket) = (self.port, self.socket().display().to_string());
        vec![
            format!("redis://:{PASSWORD}@127.0.0.1:{port}/"),
            format!("redis://default:{PASSWORD}@127.0.0.1:{port}/0"),
            format!("valkey://default:{PASSWORD}@127.0.0.1:{port}"),
            format!("REDIS://:{PASSWORD}@127.0.0.1:{port}/1"),
            format!("redis+unix://{socket}?pass={PASSWORD}"),
            format!("unix://{socket}?db=2&pass={PASSWORD}"),
            format!("redis+unix://{socket}?user=default&pass={PASSWORD}"),
        ]
    }
}

impl Drop for PasswordRedis {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Forms whose connect fails: nothing listens on the port, or TLS to a server without it.
fn failing_redis_forms(live_port: u16) -> Vec<String> {
    let dead = common::free_port();
    vec![
        format!("redis://:{PASSWORD}@127.0.0.1:{dead}/"),
        format!("redis://app:{PASSWORD}@127.0.0.1:{dead}/3"),
        format!("valkey://:{PASSWORD}@127.0.0.1:{dead}"),
        format!("rediss://:{PASSWORD}@127.0.0.1:{live_port}/"),
        format!("valkeys://app:{PASSWORD}@127.0.0.1:{live_port}/#insecure"),
        format!("redis+unix:///nonexistent/tollgate.sock?pass={PASSWORD}"),
        format!("unix:///nonexistent/tollgate.sock?pass={PASSWORD}"),
    ]
}

/// Forms that do not parse, each with the password in it.
fn malformed_redis_forms() -> Vec<String> {
    vec![
        format!("redis://:{PASSWORD}@:6379"),
        format!("redis://:{PASSWORD}@localhost:notaport/"),
        format!("redis://:{PASSWORD}@localhost:99999/"),
        format!("redis://:{PASSWORD}@localhost/db"),
        format!("http://:{PASSWORD}@localhost/"),
        format!(":{PASSWORD}@localhost:6379"),
        format!("password={PASSWORD}://localhost"),
        format!("redis://:{PASSWORD}/with/slash@localhost"),
        format!("redis://:{PASSWORD}#hash@localhost"),
    ]
}

// ---------------------------------------------------------------------------------------------
// The layers a service builds on a store
// ---------------------------------------------------------------------------------------------

/// Every layer and helper built on `store`, under `Debug`; and the status of one request through
/// a rate limit keyed by the planted API key (`200` also while the store fails: the layer lets
/// requests through then).
async fn layers_on(store: Arc<dyn Store>) -> (String, StatusCode) {
    let rate = RateLimitLayer::builder(Arc::clone(&store))
        .prefix("secrets")
        .limit(Limit::per_second("burst", 5))
        .key(Header::from_static("x-api-key"))
        .build()
        .unwrap();
    let idempotency = IdempotencyLayer::builder(Arc::clone(&store))
        .prefix("secrets")
        .scope(Header::from_static("x-api-key"))
        .build()
        .unwrap();
    let concurrency = ConcurrencyLimitLayer::builder(Arc::clone(&store))
        .prefix("secrets")
        .limit(2)
        .build()
        .unwrap();
    let locks = Locks::new(Arc::clone(&store));
    let claims = Claims::new(Arc::clone(&store));
    let shown = [
        debug_of(&rate),
        debug_of(&idempotency),
        debug_of(&concurrency),
        debug_of(&locks),
        debug_of(&claims),
        debug_of(&store),
    ]
    .concat();
    let service = rate.layer(tower::service_fn(|_: Request<String>| async {
        Ok::<_, Infallible>(Response::new(String::new()))
    }));
    let request = Request::get("/api")
        .header("x-api-key", API_KEY)
        .body(String::new())
        .unwrap();
    let status = service.oneshot(request).await.unwrap().status();
    (shown, status)
}

// ---------------------------------------------------------------------------------------------
// Redis
// ---------------------------------------------------------------------------------------------

#[tokio::test]
async fn no_redis_form_shows_its_password() {
    let server = PasswordRedis::start();
    let (captured, guard) = Captured::start();
    for url in server.forms() {
        let builder = RedisStore::builder(url.clone()).timeout(Duration::from_secs(2));
        assert_hidden(&format!("the builder of {url}"), &debug_of(&builder));
        let store = builder.build().unwrap_or_else(|e| panic!("{url}: {e}"));
        // a normal call, with the password
        store
            .ping()
            .await
            .unwrap_or_else(|e| panic!("{url} answers: {e}"));
        let (shown, status) = layers_on(Arc::new(store)).await;
        assert_eq!(status, StatusCode::OK, "{url}");
        assert_hidden(&format!("the store and layers of {url}"), &shown);
    }
    for url in failing_redis_forms(server.port) {
        let builder = RedisStore::builder(url.clone()).timeout(Duration::from_millis(300));
        assert_hidden(&format!("the builder of {url}"), &debug_of(&builder));
        let store = builder.build().unwrap_or_else(|e| panic!("{url}: {e}"));
        let error = store.ping().await.expect_err(&url);
        assert_hidden(&format!("the error of {url}"), &error_text(&error));
        let (shown, _) = layers_on(Arc::new(store)).await;
        assert_hidden(&format!("the store and layers of {url}"), &shown);
    }
    for url in malformed_redis_forms() {
        let builder = RedisStore::builder(url.clone());
        assert_hidden(&format!("the builder of {url}"), &debug_of(&builder));
        let error = builder.build().expect_err(&url);
        assert_hidden(&format!("the error of {url}"), &error_text(&error));
        if let Err(error) = RedisStore::open(url.clone()) {
            assert_hidden(&format!("RedisStore::open({url})"), &error_text(&error));
        }
    }
    drop(guard);
    assert_hidden("the logs and spans", &captured.text());
    assert!(
        !captured.text().contains(API_KEY),
        "the logs and spans show the API key"
    );
    assert!(
        captured.text().contains("tollgate"),
        "the store's spans were recorded"
    );
}

#[tokio::test]
async fn no_sentinel_or_cluster_list_shows_its_passwords() {
    let server = PasswordRedis::start();
    let (captured, guard) = Captured::start();
    let dead = [common::free_port(), common::free_port()];
    let lists = [
        // nothing answers
        vec![
            format!("redis://:{PASSWORD}@127.0.0.1:{}/", dead[0]),
            format!("redis://app:{PASSWORD}@127.0.0.1:{}/", dead[1]),
        ],
        // a Redis that is neither a sentinel nor a cluster node, with the right password
        vec![
            format!("redis://:{PASSWORD}@127.0.0.1:{}/", server.port),
            format!("valkey://default:{PASSWORD}@127.0.0.1:{}/", server.port),
        ],
        // one that does not parse
        vec![format!("redis://:{PASSWORD}@:{}/", dead[0])],
    ];
    for urls in lists {
        let sentinel = RedisStore::sentinel_builder(urls.clone(), "mymaster")
            .timeout(Duration::from_millis(300));
        assert_hidden("a sentinel builder", &debug_of(&sentinel));
        let error = sentinel.connect().await.expect_err("no primary");
        assert_hidden("a sentinel error", &error_text(&error));

        let cluster = RedisStore::cluster_builder(urls.clone()).timeout(Duration::from_millis(300));
        assert_hidden("a cluster builder", &debug_of(&cluster));
        let connect = tokio::time::timeout(Duration::from_secs(10), cluster.connect());
        let error = connect.await.expect("bounded").expect_err("no cluster");
        assert_hidden("a cluster error", &error_text(&error));
    }
    drop(guard);
    assert_hidden("the logs and spans", &captured.text());
}

// ---------------------------------------------------------------------------------------------
// PostgreSQL
// ---------------------------------------------------------------------------------------------

/// A server where role `pwuser` must give the planted password over TCP, and role `pwother`
/// another one.
async fn postgres_with_a_password() -> PgServer {
    let server = PgServer::start();
    let client = server.client().await;
    let roles = format!(
        "CREATE ROLE pwuser LOGIN PASSWORD '{PASSWORD}'; \
         CREATE ROLE pwother LOGIN PASSWORD 'another'; \
         GRANT CREATE ON DATABASE postgres TO pwuser"
    );
    client.batch_execute(&roles).await.unwrap();
    let hba: String = client.query_one("SHOW hba_file", &[]).await.unwrap().get(0);
    let rules = "host all pwuser,pwother 127.0.0.1/32 scram-sha-256\n\
                 local all all trust\n\
                 host all all 127.0.0.1/32 trust\n\
                 host all all ::1/128 trust";
    let write = format!(
        "COPY (SELECT unnest(string_to_array('{rules}', E'\\n'))) TO '{}'",
        hba.replace('\'', "''")
    );
    client.batch_execute(&write).await.unwrap();
    client
        .batch_execute("SELECT pg_reload_conf()")
        .await
        .unwrap();
    server
}

/// Every form that reaches `port` as `pwuser` with the password.
fn postgres_forms(port: u16) -> Vec<String> {
    vec![
        format!("postgres://pwuser:{PASSWORD}@127.0.0.1:{port}/postgres"),
        format!("postgresql://pwuser:{PASSWORD}@127.0.0.1:{port}/postgres?sslmode=disable"),
        format!("postgres://127.0.0.1:{port}/postgres?user=pwuser&password={PASSWORD}"),
        format!("host=127.0.0.1 port={port} user=pwuser password={PASSWORD} dbname=postgres"),
        format!("host=127.0.0.1 port={port} user=pwuser password = '{PASSWORD}' dbname=postgres"),
    ]
}

/// Forms whose connect fails with the password in them: a role whose password it is not,
/// nothing listening, and strings that do not parse.
fn failing_postgres_forms(port: u16) -> Vec<String> {
    let dead = common::free_port();
    vec![
        format!("postgres://pwother:{PASSWORD}@127.0.0.1:{port}/postgres"),
        format!("host=127.0.0.1 port={port} user=pwother password='{PASSWORD} \\' x'"),
        format!("postgres://pwuser:{PASSWORD}@127.0.0.1:{dead}/postgres"),
        format!("host=127.0.0.1 port={dead} user=pwuser password={PASSWORD}"),
        format!("postgres://pwuser:{PASSWORD}@127.0.0.1:notaport/postgres"),
        format!("postgres://127.0.0.1:{port}/postgres?password={PASSWORD}&sslmode=bogus"),
        format!("postgres://127.0.0.1:{port}/postgres?pass={PASSWORD}"),
        format!("host=127.0.0.1 port={port} password='{PASSWORD}"),
        format!("host=127.0.0.1 port=x password={PASSWORD}"),
        format!("host=127.0.0.1 {PASSWORD}"),
    ]
}

#[tokio::test]
async fn no_postgres_form_shows_its_password() {
    let server = postgres_with_a_password().await;
    let port = server.port();
    let (captured, guard) = Captured::start();
    for url in postgres_forms(port) {
        let builder = PgStore::builder(url.clone())
            .schema(common::postgres::unique_schema())
            .timeout(Duration::from_secs(5))
            .purge_interval(None)
            .pool_size(2);
        assert_hidden(&format!("the builder of {url}"), &debug_of(&builder));
        // normal calls, with the password: the migration and a request
        let store = builder
            .connect()
            .await
            .unwrap_or_else(|e| panic!("{url} connects: {e}"));
        store.ping().await.unwrap();
        let (shown, status) = layers_on(Arc::new(store)).await;
        assert_eq!(status, StatusCode::OK, "{url}");
        assert_hidden(&format!("the store and layers of {url}"), &shown);
    }
    for url in failing_postgres_forms(port) {
        let builder = PgStore::builder(url.clone())
            .timeout(Duration::from_secs(2))
            .purge_interval(None);
        assert_hidden(&format!("the builder of {url}"), &debug_of(&builder));
        let error = builder.connect().await.expect_err(&url);
        assert_hidden(&format!("the error of {url}"), &error_text(&error));
        if let Ok(store) = PgStore::builder(url.clone()).build() {
            let (shown, _) = layers_on(Arc::new(store)).await;
            assert_hidden(&format!("the store and layers of {url}"), &shown);
        }
    }
    drop(guard);
    assert_hidden("the logs and spans", &captured.text());
    assert!(
        !captured.text().contains(API_KEY),
        "the logs and spans show the API key"
    );
}

// ---------------------------------------------------------------------------------------------
// The redaction itself
// ---------------------------------------------------------------------------------------------

#[test]
fn every_planted_form_redacts_to_a_string_without_it() {
    let live = PasswordRedis::start();
    let mut forms = live.forms();
    forms.extend(failing_redis_forms(live.port));
    forms.extend(malformed_redis_forms());
    forms.extend(postgres_forms(5432));
    forms.extend(failing_postgres_forms(5432));
    forms.push(format!(
        "redis://:{PASSWORD}@10.0.0.1:26379/,redis://u:{PASSWORD}@10.0.0.2:26379/ \
         rediss://:{PASSWORD}@10.0.0.3:26379/"
    ));
    for form in forms {
        let shown = redact_connection_string(&form);
        assert_hidden(&form, &shown);
        assert!(shown.contains("***"), "{form} -> {shown}");
    }
}
