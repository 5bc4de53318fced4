//! Store calls as tracing spans shaped by OpenTelemetry's database conventions, on real Redis and
//! PostgreSQL servers: the span's name and every attribute, a batch's size, and an error's code.
//!
//! Each test records through a subscriber of its own, set for its thread only (`set_default`):
//! the tests of this binary run in parallel. Its runtime is single-threaded, so the tasks that
//! send batches run on that thread too.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use crate::common;

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::time::Instant;
use tollgate::key::Key;
use tollgate::rate::{Algorithm, Limit, RateCheck, RatePolicy};
use tollgate::store::ClaimRequest;
use tollgate::store::{LockStore, RateStore, Store, StoreErrorKind};
use tracing::field::{Field, Visit};
use tracing::span::{Attributes, Id, Record};
use tracing::subscriber::DefaultGuard;
use tracing_subscriber::layer::{Context, SubscriberExt};
use tracing_subscriber::registry::LookupSpan;
use tracing_subscriber::{Layer, Registry};

use common::RedisServer;

/// A span as recorded: its name, its parent's name, and its fields as text.
#[derive(Debug, Clone)]
struct Recorded {
    name: &'static str,
    parent: Option<&'static str>,
    fields: BTreeMap<String, String>,
}

impl Recorded {
    fn field(&self, name: &str) -> Option<&str> {
        self.fields.get(name).map(String::as_str)
    }

    /// Every field but `tollgate.operation`, as `(name, value)` pairs.
    fn attributes(&self) -> BTreeMap<&str, &str> {
        self.fields
            .iter()
            .map(|(k, v)| (k.as_str(), v.as_str()))
            .filter(|(k, _)| *k != "tollgate.operation")
            .collect()
    }
}

/// Records the spans of target `tollgate::store` into a Vec.
#[derive(Clone, Default)]
struct Recorder(Arc<Mutex<Vec<Recorded>>>);

/// A span's place in the recorder's Vec.
struct Slot(usize);

struct Fields<'a>(&'a mut BTreeMap<String, String>);

impl Visit for Fields<'_> {
    fn record_str(&mut self, field: &Field, value: &str) {
        self.0.insert(field.name().to_owned(), value.to_owned());
    }

    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        self.0.insert(field.name().to_owned(), format!("{value:?}"));
    }
}

impl<S> Layer<S> for Recorder
where
    S: tracing::Subscriber + for<'a> LookupSpan<'a>,
{
    fn on_new_span(&self, attrs: &Attributes<'_>, id: &Id, ctx: Context<'_, S>) {
        let span = ctx.span(id).unwrap();
        if span.metadata().target() != "tollgate::store" {
            return;
        }
        let mut fields = BTreeMap::new();
        attrs.record(&mut Fields(&mut fields));
        let mut spans = self.0.lock().unwrap();
        spans.push(Recorded {
            name: span.name(),
            parent: span.parent().map(|p| p.name()),
            fields,
        });
        span.extensions_mut().insert(Slot(spans.len() - 1));
    }

    fn on_record(&self, id: &Id, values: &Record<'_>, ctx: Context<'_, S>) {
        let span = ctx.span(id).unwrap();
        let extensions = span.extensions();
        let Some(Slot(at)) = extensions.get::<Slot>() else {
            return;
        };
        let mut spans = self.0.lock().unwrap();
        values.record(&mut Fields(&mut spans[*at].fields));
    }
}

impl Recorder {
    /// Records on this thread until the guard drops.
    fn install(&self) -> DefaultGuard {
        tracing::subscriber::set_default(Registry::default().with(self.clone()))
    }

    /// The recorded spans of store operation `operation`.
    fn of(&self, operation: &str) -> Vec<Recorded> {
        let spans = self.0.lock().unwrap();
        spans
            .iter()
            .filter(|s| s.field("tollgate.operation") == Some(operation))
            .cloned()
            .collect()
    }

    /// The one recorded span of `operation`.
    fn one(&self, operation: &str) -> Recorded {
        let mut spans = self.of(operation);
        assert_eq!(spans.len(), 1, "one {operation} span: {spans:#?}");
        spans.remove(0)
    }
}

/// `(name, value)` pairs as a map.
fn attrs<'a>(pairs: &[(&'a str, &'a str)]) -> BTreeMap<&'a str, &'a str> {
    pairs.iter().copied().collect()
}

fn policy() -> Arc<RatePolicy> {
    let namespace = format!("s{}:rl", rand::random::<u64>());
    let limits = vec![Limit::per_hour("hourly", 100)];
    Arc::new(RatePolicy::new(namespace, Algorithm::Gcra, limits).unwrap())
}

fn soon() -> Instant {
    Instant::now() + Duration::from_secs(2)
}

#[tokio::test]
async fn spans_of_redis_calls_carry_the_database_conventions() {
    let server = RedisServer::start();
    let store = server.store();
    let recorder = Recorder::default();
    let _guard = recorder.install();
    let port = server.port().to_string();

    store.ping().await.unwrap();
    let ping = recorder.one("ping");
    assert_eq!(ping.name, "PING");
    let expected = [
        ("otel.name", "PING"),
        ("otel.kind", "client"),
        ("db.system.name", "redis"),
        ("db.operation.name", "PING"),
        ("server.address", "127.0.0.1"),
        ("server.port", port.as_str()),
    ];
    assert_eq!(ping.attributes(), attrs(&expected));

    let claimed = store.claim(
        ClaimRequest::new(format!("s{}", rand::random::<u64>()), "me", None),
        soon(),
    );
    assert!(claimed.await.unwrap().won);
    let claim = recorder.one("claim");
    assert_eq!(claim.name, "EVALSHA");
    let expected = [
        ("otel.name", "EVALSHA claim"),
        ("otel.kind", "client"),
        ("db.system.name", "redis"),
        ("db.operation.name", "EVALSHA"),
        ("db.stored_procedure.name", "claim"),
        ("server.address", "127.0.0.1"),
        ("server.port", port.as_str()),
    ];
    assert_eq!(claim.attributes(), attrs(&expected));
}

#[tokio::test]
async fn a_batch_of_rate_checks_is_one_span_with_its_size() {
    let server = RedisServer::start();
    let store = server.store();
    let policy = policy();
    let recorder = Recorder::default();
    let _guard = recorder.install();

    let parent = tracing::info_span!("request");
    let checks =
        (0..12u8).map(|i| store.check_rate(&policy, RateCheck::new(Key::new("s", &[i]), 1)));
    let outcomes = tracing::Instrument::instrument(futures_util::future::join_all(checks), parent);
    for outcome in outcomes.await {
        assert!(outcome.unwrap().admitted);
    }
    let calls = recorder.of("rate_check");
    assert!(calls.len() < 12, "checks were coalesced: {calls:#?}");
    let sizes: u64 = calls
        .iter()
        .map(|s| {
            s.field("db.operation.batch.size")
                .map_or(1, |n| n.parse().unwrap())
        })
        .sum();
    assert_eq!(sizes, 12, "every check counted once: {calls:#?}");
    assert!(
        calls
            .iter()
            .any(|s| s.field("db.operation.batch.size").is_some())
    );
    for call in &calls {
        assert_eq!(call.name, "FCALL");
        assert_eq!(call.field("otel.name"), Some("FCALL rate"));
        assert_eq!(call.parent, Some("request"), "{call:#?}");
    }
}

#[tokio::test]
async fn a_redis_error_shows_its_code() {
    let server = RedisServer::start();
    let store = server.store();
    store.ping().await.unwrap();
    // a replica of nobody: every write is refused with READONLY
    let _: () = redis::cmd("REPLICAOF")
        .arg("127.0.0.1")
        .arg(common::free_port())
        .query(&mut server.conn())
        .unwrap();
    let recorder = Recorder::default();
    let _guard = recorder.install();

    let error = store
        .reset_rate(&policy(), Key::new("s", b"x"))
        .await
        .unwrap_err();
    let reset = recorder.one("reset_rate");
    assert_eq!(reset.name, "EVALSHA");
    assert_eq!(reset.field("db.response.status_code"), Some("READONLY"));
    assert_eq!(reset.field("error.type"), Some(error.kind().as_str()));
    assert_eq!(reset.field("otel.status_code"), Some("ERROR"));
    assert!(
        reset
            .field("otel.status_description")
            .is_some_and(|d| d.contains("read only replica"))
    );
}

#[tokio::test]
async fn spans_of_postgresql_calls_carry_the_database_conventions() {
    let store = common::postgres::store().await;
    let port = common::postgres::shared().port().to_string();
    let schema = store.schema().to_owned();
    let recorder = Recorder::default();
    let _guard = recorder.install();

    let outcome = store.check_rate(&policy(), RateCheck::new(Key::new("s", b"pg"), 1));
    assert!(outcome.await.unwrap().admitted);
    let check = recorder.one("rate_check");
    assert_eq!(check.name, "SELECT");
    let function = format!("{schema}.decide_rates");
    let name = format!("SELECT {function}");
    let expected = [
        ("otel.name", name.as_str()),
        ("otel.kind", "client"),
        ("db.system.name", "postgresql"),
        ("db.operation.name", "SELECT"),
        ("db.stored_procedure.name", function.as_str()),
        ("server.address", "127.0.0.1"),
        ("server.port", port.as_str()),
    ];
    assert_eq!(check.attributes(), attrs(&expected));

    // the store's functions gone: the server answers SQLSTATE 3F000 (no such schema)
    let client = common::postgres::shared().client().await;
    let drop = format!("DROP SCHEMA \"{schema}\" CASCADE");
    client.batch_execute(&drop).await.unwrap();
    let error = store
        .reset_rate(&policy(), Key::new("s", b"pg"))
        .await
        .unwrap_err();
    assert_eq!(error.kind(), StoreErrorKind::Protocol, "{error}");
    let reset = recorder.one("reset_rate");
    assert_eq!(reset.field("db.response.status_code"), Some("3F000"));
    assert_eq!(reset.field("error.type"), Some("protocol"));
    assert_eq!(reset.field("otel.status_code"), Some("ERROR"));
}
