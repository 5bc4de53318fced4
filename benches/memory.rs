//! Memory benchmark: `cargo bench --bench memory`.
//!
//! Memory per live caller and time per decision of [`MemoryStore`] rate checks and of the rate
//! layer's local fallback (`OnStoreError::LocalFallback`, on a store that is down), at 10 and at
//! 1,000,000 live callers, single-threaded; plus the store's decisions on two threads at once.
//!
//! - **Memory** is the growth of the process's resident set (`VmRSS`) while the callers are
//!   added, divided by their number. One table of 10 callers is below the resolution of a page,
//!   so the 10-caller rows hold 10,000 tables of 10 callers each and subtract what the 10,000
//!   empty tables took (shown per table in its own column). Every case runs in a child process of
//!   its own (this binary again, with `BENCH_CASE` set): memory freed by one case cannot hide the
//!   growth of the next.
//! - **Time** is wall-clock nanoseconds per decision over all live callers in turn, each admitted
//!   (the quotas are far above what the run spends): "new" while the callers are first added,
//!   "held" once all are. The fallback is measured through the layer (building the request,
//!   extracting and hashing the key, the response), so its row "layer, no limiter" shows the same
//!   path on a down store with `OnStoreError::Allow`: the difference is the fallback's own cost.
//!
//! Environment knobs: `BENCH_CALLERS` (the large count, default 1,000,000) and `BENCH_ROUNDS`
//! (decisions per held caller in the large rows, default 2, at most 900).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::convert::Infallible;
use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures_util::FutureExt;
use http::{HeaderName, HeaderValue, Request, Response};
use tollgate::key::{Header, Key};
use tollgate::rate::{Algorithm, Limit, RateCheck, RateOutcome, RatePolicy};
use tollgate::rate_limit::ResponseBody;
use tollgate::rate_limit::{OnStoreError, RateLimitLayer};
use tollgate::store::{MemoryStore, RateStore, StoreError, StoreErrorKind, StoreFuture};
use tower::{Service, ServiceBuilder};

/// How many small tables the 10-caller rows hold.
const TABLES: usize = 10_000;
const SMALL: usize = 10;
const QUOTA: u64 = 1_000;
/// Decisions per held caller in the 10-caller rows, within the quota; repeated on [`REPEAT`]
/// tables of 10 callers for a total long enough to time.
const HELD_SMALL: usize = 900;
const REPEAT: usize = 50;
const CALLER: HeaderName = HeaderName::from_static("x-caller");

fn large() -> usize {
    env("BENCH_CALLERS", 1_000_000)
}

fn rounds() -> usize {
    env("BENCH_ROUNDS", 2)
}

fn env(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// The resident set in bytes.
fn rss() -> usize {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let line = status.lines().find(|l| l.starts_with("VmRSS:")).unwrap();
    let kb: usize = line.split_whitespace().nth(1).unwrap().parse().unwrap();
    kb * 1024
}

/// One row of the table, as a child prints it.
#[derive(Debug, Default)]
struct Row {
    /// Bytes per live caller.
    bytes: f64,
    /// Bytes per empty table (10-caller rows only).
    table: Option<f64>,
    /// Nanoseconds per decision while the callers are first added.
    new_ns: f64,
    /// Nanoseconds per decision once all are held.
    held_ns: f64,
}

impl Row {
    fn print(&self) {
        let table = self.table.map_or("-".to_owned(), |t| format!("{t:.0}"));
        println!(
            "{:.0}\t{table}\t{:.0}\t{:.0}",
            self.bytes, self.new_ns, self.held_ns
        );
    }

    fn parse(line: &str) -> Vec<String> {
        line.split('\t').map(str::to_owned).collect()
    }
}

fn ns_per(start: Instant, n: usize) -> f64 {
    start.elapsed().as_nanos() as f64 / n as f64
}

// ------------------------------------------------------------------------------------------------
// MemoryStore
// ------------------------------------------------------------------------------------------------

/// The limit of every case: a quota above what a run spends on one caller, and a window so long
/// that a GCRA caller stays live for 43 minutes after one request (window / quota): no caller
/// expires while a case runs.
fn limit() -> Limit {
    Limit::new("month", QUOTA, Duration::from_secs(30 * 86_400))
}

fn policy(algorithm: Algorithm) -> Arc<RatePolicy> {
    Arc::new(RatePolicy::new("bench:rl", algorithm, vec![limit()]).unwrap())
}

fn decide(store: &MemoryStore, policy: &Arc<RatePolicy>, key: Key) {
    let outcome = store
        .check_rate(policy, RateCheck::new(key, 1))
        .now_or_never()
        .unwrap()
        .unwrap();
    assert!(outcome.admitted);
}

fn keys(n: usize) -> Vec<Key> {
    (0..n as u64)
        .map(|i| Key::new("bench", &i.to_be_bytes()))
        .collect()
}

fn store_large(algorithm: Algorithm) -> Row {
    let keys = keys(large());
    let p = policy(algorithm);
    let store = MemoryStore::with_capacity(keys.len());
    let before = rss();
    let start = Instant::now();
    for &key in &keys {
        decide(&store, &p, key);
    }
    let new_ns = ns_per(start, keys.len());
    let bytes = (rss() - before) as f64 / keys.len() as f64;
    assert_eq!(store.len(), keys.len());
    let start = Instant::now();
    for _ in 0..rounds() {
        for &key in &keys {
            decide(&store, &p, key);
        }
    }
    Row {
        bytes,
        table: None,
        new_ns,
        held_ns: ns_per(start, keys.len() * rounds()),
    }
}

fn store_small() -> Row {
    let keys = keys(SMALL);
    let p = policy(Algorithm::Gcra);
    let at_start = rss();
    let stores: Vec<MemoryStore> = (0..TABLES).map(|_| MemoryStore::new()).collect();
    let empty = rss();
    let start = Instant::now();
    for store in &stores {
        for &key in &keys {
            decide(store, &p, key);
        }
    }
    let new_ns = ns_per(start, TABLES * SMALL);
    let bytes = (rss() - empty) as f64 / (TABLES * SMALL) as f64;
    let start = Instant::now();
    for store in &stores[..REPEAT] {
        for _ in 0..HELD_SMALL {
            for &key in &keys {
                decide(store, &p, key);
            }
        }
    }
    let n = REPEAT * HELD_SMALL * SMALL;
    Row {
        bytes,
        table: Some((empty - at_start) as f64 / TABLES as f64),
        new_ns,
        held_ns: ns_per(start, n),
    }
}

/// Held callers decided on two threads at once, each on its own half: nanoseconds of wall
/// clock per decision over both (half the one-thread figure if nothing were shared).
fn store_two_threads() -> Row {
    let keys = Arc::new(keys(large()));
    let p = policy(Algorithm::Gcra);
    let store = MemoryStore::with_capacity(keys.len());
    for &key in keys.iter() {
        decide(&store, &p, key);
    }
    let start = Instant::now();
    let threads: Vec<_> = (0..2)
        .map(|t| {
            let (store, p, keys) = (store.clone(), Arc::clone(&p), Arc::clone(&keys));
            std::thread::spawn(move || {
                for _ in 0..rounds() {
                    for &key in keys.iter().skip(t).step_by(2) {
                        decide(&store, &p, key);
                    }
                }
            })
        })
        .collect();
    for thread in threads {
        thread.join().unwrap();
    }
    Row {
        held_ns: ns_per(start, keys.len() * rounds()),
        ..Row::default()
    }
}

// ------------------------------------------------------------------------------------------------
// The layer's local fallback
// ------------------------------------------------------------------------------------------------

/// A store that is always down: every decision is the failure policy's.
#[derive(Debug)]
struct Down;

impl RateStore for Down {
    fn check_rate(&self, _: &Arc<RatePolicy>, _: RateCheck) -> StoreFuture<RateOutcome> {
        Box::pin(async { Err(StoreError::new(StoreErrorKind::Unavailable, "down")) })
    }

    fn timeout(&self) -> Duration {
        Duration::from_millis(250)
    }

    fn reset_rate(&self, _: &Arc<RatePolicy>, _: tollgate::key::Key) -> StoreFuture<()> {
        Box::pin(async { Err(StoreError::new(StoreErrorKind::Unavailable, "down")) })
    }
}

type Ready = std::future::Ready<Result<Response<()>, Infallible>>;

fn ok(_: Request<()>) -> Ready {
    std::future::ready(Ok(Response::new(())))
}

type Layered =
    tollgate::rate_limit::RateLimit<tower::util::ServiceFn<fn(Request<()>) -> Ready>, Header>;

fn layered(on_store_error: OnStoreError, capacity: usize) -> Layered {
    let layer = RateLimitLayer::builder(Down)
        .limit(limit())
        .algorithm(Algorithm::Gcra)
        .on_store_error(on_store_error)
        .fallback_capacity(capacity)
        .key(Header::new(CALLER))
        .build()
        .unwrap();
    ServiceBuilder::new()
        .layer(layer)
        .service_fn(ok as fn(Request<()>) -> Ready)
}

fn send(svc: &mut Layered, caller: &HeaderValue) {
    let request = Request::get("/")
        .header(CALLER, caller.clone())
        .body(())
        .unwrap();
    futures_util::future::poll_fn(|cx| svc.poll_ready(cx))
        .now_or_never()
        .unwrap()
        .unwrap();
    let response: Response<ResponseBody<()>> = svc.call(request).now_or_never().unwrap().unwrap();
    assert!(response.status().is_success());
}

fn callers(n: usize) -> Vec<HeaderValue> {
    (0..n)
        .map(|i| HeaderValue::from_str(&format!("caller-{i}")).unwrap())
        .collect()
}

fn layer_large(on_store_error: OnStoreError) -> Row {
    let callers = callers(large());
    let mut svc = layered(on_store_error, callers.len());
    let before = rss();
    let start = Instant::now();
    for caller in &callers {
        send(&mut svc, caller);
    }
    let new_ns = ns_per(start, callers.len());
    let bytes = (rss() - before) as f64 / callers.len() as f64;
    let start = Instant::now();
    for _ in 0..rounds() {
        for caller in &callers {
            send(&mut svc, caller);
        }
    }
    Row {
        bytes,
        table: None,
        new_ns,
        held_ns: ns_per(start, callers.len() * rounds()),
    }
}

fn fallback_small() -> Row {
    let callers = callers(SMALL);
    let fallback = OnStoreError::LocalFallback { copies: 1 };
    let at_start = rss();
    let mut services: Vec<Layered> = (0..TABLES).map(|_| layered(fallback, 65_536)).collect();
    let empty = rss();
    let start = Instant::now();
    for svc in &mut services {
        for caller in &callers {
            send(svc, caller);
        }
    }
    let new_ns = ns_per(start, TABLES * SMALL);
    let bytes = (rss() - empty) as f64 / (TABLES * SMALL) as f64;
    let start = Instant::now();
    for svc in &mut services[..REPEAT] {
        for _ in 0..HELD_SMALL {
            for caller in &callers {
                send(svc, caller);
            }
        }
    }
    let n = REPEAT * HELD_SMALL * SMALL;
    Row {
        bytes,
        table: Some((empty - at_start) as f64 / TABLES as f64),
        new_ns,
        held_ns: ns_per(start, n),
    }
}

// ------------------------------------------------------------------------------------------------

/// The cases: name, what the table calls it, live callers.
fn cases() -> Vec<(&'static str, &'static str, String)> {
    let large = large().to_string();
    vec![
        ("store-10", "MemoryStore, GCRA", SMALL.to_string()),
        ("store-large", "MemoryStore, GCRA", large.clone()),
        ("store-log-large", "MemoryStore, sliding log", large.clone()),
        (
            "store-2-threads",
            "MemoryStore, GCRA, 2 threads",
            large.clone(),
        ),
        (
            "fallback-10",
            "layer, local fallback, GCRA",
            SMALL.to_string(),
        ),
        (
            "fallback-large",
            "layer, local fallback, GCRA",
            large.clone(),
        ),
        (
            "no-limiter-large",
            "layer, no limiter (store down, Allow)",
            large,
        ),
    ]
}

fn run(case: &str) -> Row {
    match case {
        "store-10" => store_small(),
        "store-large" => store_large(Algorithm::Gcra),
        "store-log-large" => store_large(Algorithm::SlidingLog),
        "store-2-threads" => store_two_threads(),
        "fallback-10" => fallback_small(),
        "fallback-large" => layer_large(OnStoreError::LocalFallback { copies: 1 }),
        "no-limiter-large" => layer_large(OnStoreError::Allow),
        other => panic!("unknown case {other}"),
    }
}

fn main() {
    if let Ok(case) = std::env::var("BENCH_CASE") {
        run(&case).print();
        return;
    }
    let exe = std::env::current_exe().unwrap();
    println!(
        "| subject | live callers | bytes per caller | bytes per empty table | ns per decision, new caller | ns per decision, held caller |"
    );
    println!("| --- | ---: | ---: | ---: | ---: | ---: |");
    for (case, subject, live) in cases() {
        let out = Command::new(&exe).env("BENCH_CASE", case).output().unwrap();
        assert!(
            out.status.success(),
            "{case}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let text = String::from_utf8(out.stdout).unwrap();
        let cells = Row::parse(text.trim());
        let shown = |i: usize| match (case, i) {
            ("store-2-threads" | "no-limiter-large", 0) | ("store-2-threads", 2) => "-".to_owned(),
            _ => cells[i].clone(),
        };
        println!(
            "| {subject} | {live} | {} | {} | {} | {} |",
            shown(0),
            shown(1),
            shown(2),
            shown(3)
        );
    }
}
