//! Rate-limit benchmark: `cargo bench --bench rate`.
//!
//! Starts its own `redis-server` on a free port (never the shared one on 6379) and measures, in one
//! run and side by side, these subjects, all on one limit of [`QUOTA`] per [`WINDOW`]:
//!
//! - the baseline: a hand-written redis-rs loop that `EVALSHA`s a minimal sliding-log script
//!   (TIME, ZREMRANGEBYSCORE, ZCARD, ZADD, PEXPIRE) over a `ConnectionManager`;
//! - per [`Algorithm`], the script of the previous release (`benches/previous/*.lua`: one
//!   `EVALSHA` per decision), called like the baseline, with keys as long as tollgate's;
//! - per algorithm, [`RedisStore::check_rate`] with `max_batch(1)`: one check per call of
//!   `rate.lua`;
//! - per algorithm, [`RedisStore::check_rate`] with the default `max_batch`: batched, the checks
//!   waiting for the store at the same moment go out as one call.
//!
//! Sections:
//!
//! 1. Decisions per second with `BENCH_IN_FLIGHT` calls in flight on random keys, plus the
//!    in-process [`MemoryStore`] for reference; with decisions per call (decisions / `EVALSHA` +
//!    `EVAL` calls in `INFO commandstats`) and the CPU time per decision of the bench process and
//!    of redis-server (which, unlike decisions/s, hardly depends on what else the machine runs).
//!    Each measurement is a warm-up and then a fixed duration, repeated in interleaved rounds; the
//!    median is shown.
//! 2. Time inside Redis per allowed decision (`usec` of `cmdstat_evalsha` and `cmdstat_eval` /
//!    decisions), for new callers and for callers that already have state; Redis CPU per decision;
//!    the ratio to the previous release's script of the same algorithm in the same round (the
//!    target of the batched store: at least 25% below it); and the floor of any script call.
//! 3. Redis memory per caller (`used_memory` delta / callers) after 1 request and after 100: the
//!    baseline and the batched store (the one-call subjects keep the same data).
//! 4. Batch sizes and latency: per algorithm, batched vs one check per call vs the previous
//!    script at 1, 4, 16 and 64 calls in flight on random keys: decisions/s, decisions per call,
//!    Redis CPU per decision, and p50 / p99 of each decision's latency as its caller sees it. The
//!    row of 1 in flight is 10,000 sequential decisions: the unloaded latency one decision adds.
//!
//! The tables are markdown, ready to paste into a README. Environment knobs:
//! `BENCH_SECS` (seconds per throughput measurement in section 1, default 1), `BENCH_ROUNDS`
//! (interleaved rounds of sections 1 and 2, default 5), `BENCH_WORKERS` (tokio worker threads,
//! default 2), `BENCH_IN_FLIGHT` (calls in flight in sections 1 and 3, default 64),
//! `BENCH_STATS_IN_FLIGHT` (calls in flight in section 2, default `BENCH_IN_FLIGHT`),
//! `BENCH_BATCH_SECS` (seconds per measurement in section 4, default `BENCH_SECS` / 2),
//! `BENCH_BATCH_ROUNDS` (rounds of section 4, default `BENCH_ROUNDS` but at most 3) and
//! `BENCH_ONLY` (1, 2, 3 or 4: run one section). The defaults take about 4 minutes on 2 cores.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::fmt::Write as _;
use std::future::Future;
use std::net::TcpListener;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use redis::Script;
use redis::aio::{ConnectionManager, MultiplexedConnection};
use tempfile::TempDir;
use tollgate::key::Key;
use tollgate::rate::{Algorithm, Limit, RateCheck, RatePolicy};
use tollgate::store::{MemoryStore, RateStore, RedisStore};

/// The hand-written baseline: the smallest sliding log a service would write by hand. No headers
/// information, one limit, a member per request made unique by a client-side nonce.
const BASELINE_LOG: &str = r"
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local window = tonumber(ARGV[2])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', string.format('%.0f', now - window))
if redis.call('ZCARD', KEYS[1]) < tonumber(ARGV[1]) then
  redis.call('ZADD', KEYS[1], string.format('%.0f', now), ARGV[3])
  redis.call('PEXPIRE', KEYS[1], math.ceil(window / 1000))
  return 1
end
return 0
";

/// The floor of any script: how much one `EVALSHA` costs before it does anything.
const LUA_FLOOR: &str = "return 1";

/// The scripts of the previous release, one per algorithm: KEYS[1] the key; ARGV cost, attempt
/// id, quota, window (µs); reply {admitted, retry_us, remaining, reset_us}.
const PREVIOUS_SLIDING_LOG: &str = include_str!("previous/sliding_log.lua");
const PREVIOUS_SLIDING_COUNTER: &str = include_str!("previous/sliding_counter.lua");
const PREVIOUS_GCRA: &str = include_str!("previous/gcra.lua");

const QUOTA: u64 = 100;
const WINDOW: Duration = Duration::from_secs(60);
const NAMESPACE: &str = "tollgate:rl";
const LIMIT_NAME: &str = "api";

/// Every algorithm, in the order of the tables.
const ALGORITHMS: [Algorithm; 3] = [
    Algorithm::SlidingLog,
    Algorithm::SlidingCounter,
    Algorithm::Gcra,
];

/// Per algorithm: its name in the tables, its tag in tollgate's keys, the previous release's
/// script of it.
const FLAVOURS: [(Algorithm, &str, &str, &str); 3] = [
    (
        Algorithm::SlidingLog,
        "sliding log",
        "log",
        PREVIOUS_SLIDING_LOG,
    ),
    (
        Algorithm::SlidingCounter,
        "sliding counter",
        "ctr",
        PREVIOUS_SLIDING_COUNTER,
    ),
    (Algorithm::Gcra, "GCRA", "gcra", PREVIOUS_GCRA),
];

/// The batched store's target in section 2: µs inside Redis per decision at most this share of
/// the previous release's script.
const TARGET_VS_PREVIOUS: f64 = 0.75;

// ---------------------------------------------------------------------------------------------
// redis-server launcher

/// A redis-server process owned by the bench; killed on drop.
struct RedisServer {
    port: u16,
    child: Child,
    _dir: TempDir,
}

impl RedisServer {
    fn start() -> Self {
        let dir = tempfile::tempdir().expect("temp dir for redis-server");
        let port = {
            let listener = TcpListener::bind("127.0.0.1:0").expect("bind an ephemeral port");
            listener.local_addr().expect("local addr").port()
        };
        let child = Command::new("redis-server")
            .args(["--port", &port.to_string()])
            .args(["--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
            .arg("--dir")
            .arg(dir.path())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect(
                "could not start redis-server: is it installed (apt-get install redis-server)?",
            );
        let mut server = Self {
            port,
            child,
            _dir: dir,
        };
        server.wait_ready();
        server
    }

    fn wait_ready(&mut self) {
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if let Ok(Some(status)) = self.child.try_wait() {
                panic!(
                    "redis-server on port {} exited at start: {status}",
                    self.port
                );
            }
            if let Ok(client) = redis::Client::open(self.url())
                && let Ok(mut conn) = client.get_connection()
                && redis::cmd("PING").query::<String>(&mut conn).is_ok()
            {
                return;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        panic!(
            "redis-server on port {} did not answer within 10 s",
            self.port
        );
    }

    fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/", self.port)
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

// ---------------------------------------------------------------------------------------------
// what is measured

/// One way of deciding for a caller.
enum Target {
    Ours {
        store: RedisStore,
        policy: Arc<RatePolicy>,
    },
    Memory {
        store: MemoryStore,
        policy: Arc<RatePolicy>,
    },
    /// An arbitrary script over a `ConnectionManager`, called like the hand-written baseline
    /// (ARGV quota, window, nonce; reply 1 when admitted).
    Script {
        conn: ConnectionManager,
        script: Script,
    },
    /// A script of the previous release over a `ConnectionManager`, one call per decision.
    Previous {
        conn: ConnectionManager,
        script: Script,
        /// The algorithm's tag in tollgate's keys.
        tag: &'static str,
    },
}

impl Target {
    /// Decides for `caller`; `Ok(true)` when admitted.
    async fn decide(&self, caller: u64) -> Result<bool, String> {
        match self {
            Self::Ours { store, policy } => {
                let key = Key::new("bench", &caller.to_le_bytes());
                let outcome = store
                    .check_rate(policy, RateCheck::new(key, 1))
                    .await
                    .map_err(|e| e.to_string())?;
                Ok(outcome.admitted)
            }
            Self::Memory { store, policy } => {
                let key = Key::new("bench", &caller.to_le_bytes());
                let outcome = store
                    .check_rate(policy, RateCheck::new(key, 1))
                    .await
                    .map_err(|e| e.to_string())?;
                Ok(outcome.admitted)
            }
            Self::Script { conn, script } => {
                // the same key length as ours: tollgate:rl:{<22 chars>}:api:<tag>
                let key = format!("{NAMESPACE}:{{{caller:022x}}}:{LIMIT_NAME}:bl");
                let nonce = format!("{:x}", rand::random::<u64>());
                let mut conn = conn.clone();
                let admitted: i64 = script
                    .key(key)
                    .arg(QUOTA)
                    .arg(window_us())
                    .arg(nonce)
                    .invoke_async(&mut conn)
                    .await
                    .map_err(|e| e.to_string())?;
                Ok(admitted == 1)
            }
            Self::Previous { conn, script, tag } => {
                // as long as ours: tollgate:rl:{<22 chars>}:api:<log|ctr|gcra>
                let key = format!("{NAMESPACE}:{{{caller:022x}}}:{LIMIT_NAME}:{tag}");
                let attempt = format!("{:016x}", rand::random::<u64>());
                let mut conn = conn.clone();
                let reply: Vec<i64> = script
                    .key(key)
                    .arg(1)
                    .arg(attempt)
                    .arg(QUOTA)
                    .arg(window_us())
                    .invoke_async(&mut conn)
                    .await
                    .map_err(|e| e.to_string())?;
                Ok(reply.first() == Some(&1))
            }
        }
    }
}

fn window_us() -> u64 {
    u64::try_from(WINDOW.as_micros()).unwrap()
}

#[derive(Default, Clone, Copy)]
struct Tally {
    done: u64,
    admitted: u64,
    errors: u64,
}

impl Tally {
    fn add(&mut self, result: &Result<bool, String>) {
        self.done += 1;
        match result {
            Ok(true) => self.admitted += 1,
            Ok(false) => {}
            Err(_) => self.errors += 1,
        }
    }

    fn merge(&mut self, other: Self) {
        self.done += other.done;
        self.admitted += other.admitted;
        self.errors += other.errors;
    }
}

/// When a run of random callers ends.
#[derive(Clone, Copy)]
enum Until {
    /// After this long.
    Elapsed(Duration),
    /// After this many decisions in all.
    Decisions(usize),
}

/// What a run of random callers gave.
struct Driven {
    /// Decisions/s.
    rate: f64,
    tally: Tally,
    /// Each decision's latency in ns, when recorded.
    latencies: Vec<u32>,
}

/// `in_flight` tasks deciding for random callers `until` the run ends; each decision's latency
/// (from the call to its answer) when `record` is set.
async fn drive(target: &Arc<Target>, in_flight: usize, until: Until, record: bool) -> Driven {
    let start = Instant::now();
    let next = Arc::new(AtomicUsize::new(0));
    let mut tasks = Vec::with_capacity(in_flight);
    for _ in 0..in_flight {
        let target = Arc::clone(target);
        let next = Arc::clone(&next);
        tasks.push(tokio::spawn(async move {
            let mut tally = Tally::default();
            let mut latencies = Vec::new();
            loop {
                let begin = Instant::now();
                let more = match until {
                    Until::Elapsed(duration) => begin < start + duration,
                    Until::Decisions(n) => next.fetch_add(1, Ordering::Relaxed) < n,
                };
                if !more {
                    break (tally, latencies);
                }
                let result = target.decide(rand::random()).await;
                if record {
                    let ns = begin.elapsed().as_nanos();
                    latencies.push(u32::try_from(ns).unwrap_or(u32::MAX));
                }
                tally.add(&result);
            }
        }));
    }
    let mut total = Tally::default();
    let mut latencies = Vec::new();
    for task in tasks {
        let (tally, mut some) = task.await.expect("bench task");
        total.merge(tally);
        latencies.append(&mut some);
    }
    let elapsed = start.elapsed().as_secs_f64();
    Driven {
        rate: total.done as f64 / elapsed,
        tally: total,
        latencies,
    }
}

/// `in_flight` tasks deciding for random callers until `duration` is over: decisions/s.
async fn rate_for(target: &Arc<Target>, in_flight: usize, duration: Duration) -> (f64, Tally) {
    let driven = drive(target, in_flight, Until::Elapsed(duration), false).await;
    (driven.rate, driven.tally)
}

/// `n` decisions by `in_flight` tasks; decision `i` is for caller `caller(i)`.
async fn run_n(
    target: &Arc<Target>,
    in_flight: usize,
    n: usize,
    caller: fn(usize) -> u64,
) -> Tally {
    let next = Arc::new(AtomicUsize::new(0));
    let mut tasks = Vec::with_capacity(in_flight);
    for _ in 0..in_flight {
        let target = Arc::clone(target);
        let next = Arc::clone(&next);
        tasks.push(tokio::spawn(async move {
            let mut tally = Tally::default();
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= n {
                    break tally;
                }
                tally.add(&target.decide(caller(i)).await);
            }
        }));
    }
    let mut total = Tally::default();
    for task in tasks {
        total.merge(task.await.expect("bench task"));
    }
    total
}

// ---------------------------------------------------------------------------------------------
// Redis inspection

async fn flushall(admin: &mut MultiplexedConnection) {
    redis::cmd("FLUSHALL")
        .query_async::<()>(admin)
        .await
        .expect("FLUSHALL");
}

async fn info_field(admin: &mut MultiplexedConnection, section: &str, name: &str) -> String {
    let info: String = redis::cmd("INFO")
        .arg(section)
        .query_async(admin)
        .await
        .expect("INFO");
    info.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(':').map(str::to_owned))
        .unwrap_or_default()
}

/// `used_memory` without what the connections hold (query and output buffers), which varies
/// with how busy they just were: what the keys take.
async fn used_memory(admin: &mut MultiplexedConnection) -> i64 {
    let info: String = redis::cmd("INFO")
        .arg("memory")
        .query_async(admin)
        .await
        .expect("INFO memory");
    let field = |name: &str| -> i64 {
        info.lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(':')?.parse().ok())
            .unwrap_or(0)
    };
    field("used_memory") - field("mem_clients_normal")
}

/// (calls, usec in all) of `EVALSHA` and `EVAL` since the last `CONFIG RESETSTAT`.
async fn script_stats(admin: &mut MultiplexedConnection) -> (u64, f64) {
    let info: String = redis::cmd("INFO")
        .arg("commandstats")
        .query_async(admin)
        .await
        .expect("INFO commandstats");
    let (mut calls, mut usec) = (0.0, 0.0);
    for line in info.lines() {
        let Some(stats) = line
            .strip_prefix("cmdstat_evalsha:")
            .or_else(|| line.strip_prefix("cmdstat_eval:"))
        else {
            continue;
        };
        let field = |name: &str| -> f64 {
            stats
                .split(',')
                .find_map(|kv| kv.strip_prefix(name)?.strip_prefix('='))
                .and_then(|v| v.parse().ok())
                .unwrap_or(0.0)
        };
        calls += field("calls");
        usec += field("usec");
    }
    (calls as u64, usec)
}

async fn reset_stats(admin: &mut MultiplexedConnection) {
    redis::cmd("CONFIG")
        .arg("RESETSTAT")
        .query_async::<()>(admin)
        .await
        .expect("CONFIG RESETSTAT");
}

/// What a measured run cost: script calls and their time inside Redis, and the CPU time of both
/// processes.
#[derive(Clone, Copy)]
struct Cost {
    /// `EVALSHA` + `EVAL` calls.
    calls: u64,
    /// Their µs inside Redis, in all.
    redis_usec: f64,
    /// CPU seconds of the bench process.
    client_cpu: f64,
    /// CPU seconds of redis-server.
    redis_cpu: f64,
}

impl Cost {
    /// Decisions per script call.
    fn per_call(&self, decisions: u64) -> f64 {
        decisions as f64 / self.calls.max(1) as f64
    }

    /// µs inside Redis per decision.
    fn redis_us(&self, decisions: u64) -> f64 {
        self.redis_usec / decisions.max(1) as f64
    }

    /// µs of redis-server CPU per decision.
    fn redis_cpu_us(&self, decisions: u64) -> f64 {
        self.redis_cpu * 1e6 / decisions.max(1) as f64
    }

    /// µs of bench-process CPU per decision.
    fn client_cpu_us(&self, decisions: u64) -> f64 {
        self.client_cpu * 1e6 / decisions.max(1) as f64
    }
}

/// Runs `run` between `CONFIG RESETSTAT` and a look at what it cost.
async fn measured<T>(admin: &mut MultiplexedConnection, run: impl Future<Output = T>) -> (T, Cost) {
    reset_stats(admin).await;
    let (client0, redis0) = (client_cpu(), redis_cpu(admin).await);
    let out = run.await;
    let (client1, redis1) = (client_cpu(), redis_cpu(admin).await);
    let (calls, redis_usec) = script_stats(admin).await;
    let cost = Cost {
        calls,
        redis_usec,
        client_cpu: client1 - client0,
        redis_cpu: redis1 - redis0,
    };
    (out, cost)
}

/// CPU seconds (user + system) of this process so far, all threads.
fn client_cpu() -> f64 {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    // fields after the command name, which is in parentheses: state is field 3, utime 14, stime 15
    let rest = stat.rsplit_once(')').map_or("", |(_, rest)| rest);
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let ticks = |i: usize| {
        fields
            .get(i)
            .and_then(|v| v.parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    // USER_HZ is 100 on Linux
    (ticks(11) + ticks(12)) / 100.0
}

/// CPU seconds (user + system) of redis-server so far.
async fn redis_cpu(admin: &mut MultiplexedConnection) -> f64 {
    let mut total = 0.0;
    for field in ["used_cpu_user", "used_cpu_sys"] {
        total += info_field(admin, "cpu", field)
            .await
            .parse::<f64>()
            .unwrap_or(0.0);
    }
    total
}

// ---------------------------------------------------------------------------------------------
// helpers

fn env_or<T: std::str::FromStr>(name: &str, default: T) -> T {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn median(values: &[f64]) -> f64 {
    if values.is_empty() {
        return 0.0;
    }
    let mut v = values.to_vec();
    v.sort_by(f64::total_cmp);
    let mid = v.len() / 2;
    if v.len() % 2 == 1 {
        v[mid]
    } else {
        (v[mid - 1] + v[mid]) / 2.0
    }
}

fn minimum(values: &[f64]) -> f64 {
    values.iter().copied().fold(f64::INFINITY, f64::min)
}

/// The `p` quantile (0..=1, nearest rank) of latencies in ns, in µs.
fn percentile_us(sorted_ns: &[u32], p: f64) -> f64 {
    if sorted_ns.is_empty() {
        return 0.0;
    }
    let rank = (p * sorted_ns.len() as f64).ceil() as usize;
    f64::from(sorted_ns[rank.clamp(1, sorted_ns.len()) - 1]) / 1000.0
}

fn kilo(v: f64) -> String {
    format!("{:.1}k", v / 1000.0)
}

fn bytes(v: f64) -> String {
    if v.abs() >= 1024.0 {
        format!("{:.2} KiB", v / 1024.0)
    } else {
        format!("{v:.0} B")
    }
}

fn policy(algorithm: Algorithm) -> Arc<RatePolicy> {
    Arc::new(
        RatePolicy::new(
            NAMESPACE,
            algorithm,
            vec![Limit::new(LIMIT_NAME, QUOTA, WINDOW)],
        )
        .expect("valid policy"),
    )
}

/// The algorithm as the tables name it.
fn algorithm_name(algorithm: Algorithm) -> &'static str {
    flavour(algorithm).1
}

/// The algorithm's tag in tollgate's keys, and the previous release's script of it.
fn previous_script(algorithm: Algorithm) -> (&'static str, &'static str) {
    let (_, _, tag, script) = flavour(algorithm);
    (tag, script)
}

/// The row of `algorithm` in [`FLAVOURS`].
fn flavour(algorithm: Algorithm) -> (Algorithm, &'static str, &'static str, &'static str) {
    FLAVOURS
        .into_iter()
        .find(|f| f.0 == algorithm)
        .expect("an algorithm of the bench")
}

/// What kind of subject: how it reaches Redis.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    /// The hand-written sliding log: one `EVALSHA` per decision.
    Baseline,
    /// The previous release's script of an algorithm: one `EVALSHA` per decision.
    Previous,
    /// tollgate, `max_batch(1)`: one check per call.
    OnePerCall,
    /// tollgate, default `max_batch`: checks waiting at the same moment share a call.
    Batched,
}

impl Kind {
    /// The short name in the tables of section 4.
    fn short(self) -> &'static str {
        match self {
            Self::Baseline => "baseline",
            Self::Previous => "previous release script",
            Self::OnePerCall => "tollgate, one check per call",
            Self::Batched => "tollgate, batched",
        }
    }
}

/// A bench subject.
struct Subject {
    name: String,
    kind: Kind,
    /// `None` for the baseline.
    algorithm: Option<Algorithm>,
    target: Arc<Target>,
}

impl Subject {
    /// Checks the script calls of `decisions`: one per decision, or 1 to `decisions` when checks
    /// share calls.
    fn check_calls(&self, calls: u64, decisions: usize) {
        let decisions = decisions as u64;
        if self.kind == Kind::Batched {
            assert!(
                (1..=decisions).contains(&calls),
                "{}: {calls} script calls for {decisions} decisions",
                self.name
            );
        } else {
            assert_eq!(calls, decisions, "{}: script calls", self.name);
        }
    }
}

/// The index of the previous release's script of `algorithm` among `subjects`.
fn previous_of(subjects: &[Subject], algorithm: Option<Algorithm>) -> Option<usize> {
    let algorithm = algorithm?;
    subjects
        .iter()
        .position(|s| s.kind == Kind::Previous && s.algorithm == Some(algorithm))
}

// ---------------------------------------------------------------------------------------------

fn main() {
    let workers: usize = env_or("BENCH_WORKERS", 2);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(workers)
        .enable_all()
        .build()
        .expect("tokio runtime");
    let report = runtime.block_on(bench(workers));
    println!("{report}");
}

/// Settings of one bench run.
struct Settings {
    workers: usize,
    secs: f64,
    rounds: usize,
    in_flight: usize,
    stats_in_flight: usize,
    batch_secs: f64,
    batch_rounds: usize,
    only: Option<u32>,
}

async fn bench(workers: usize) -> String {
    let in_flight: usize = env_or("BENCH_IN_FLIGHT", 64).max(1);
    let secs: f64 = env_or("BENCH_SECS", 1.0);
    let rounds: usize = env_or("BENCH_ROUNDS", 5).max(1);
    let settings = Settings {
        workers,
        secs,
        rounds,
        in_flight,
        stats_in_flight: env_or("BENCH_STATS_IN_FLIGHT", in_flight).max(1),
        batch_secs: env_or("BENCH_BATCH_SECS", secs / 2.0),
        batch_rounds: env_or("BENCH_BATCH_ROUNDS", rounds.min(3)).max(1),
        only: std::env::var("BENCH_ONLY")
            .ok()
            .and_then(|v| v.parse().ok()),
    };
    let runs = |section: u32| settings.only.is_none_or(|o| o == section);

    let server = RedisServer::start();
    let client = redis::Client::open(server.url()).expect("redis url");
    let mut admin = client
        .get_multiplexed_async_connection()
        .await
        .expect("admin connection");

    let manager = || {
        let client = client.clone();
        async move {
            ConnectionManager::new(client)
                .await
                .expect("connection manager")
        }
    };
    let script_target = |source: &'static str| {
        let conn = manager();
        async move {
            Arc::new(Target::Script {
                conn: conn.await,
                script: Script::new(source),
            })
        }
    };
    let previous = |algorithm: Algorithm| {
        let conn = manager();
        let (tag, source) = previous_script(algorithm);
        async move {
            Arc::new(Target::Previous {
                conn: conn.await,
                script: Script::new(source),
                tag,
            })
        }
    };
    // `max_batch`: `None` for the default
    let ours = |algorithm: Algorithm, max_batch: Option<usize>| {
        let mut builder = RedisStore::builder(server.url());
        if let Some(checks) = max_batch {
            builder = builder.max_batch(checks);
        }
        Arc::new(Target::Ours {
            store: builder.build().expect("redis store"),
            policy: policy(algorithm),
        })
    };

    let mut subjects = vec![Subject {
        name: "baseline: hand-written sliding log (redis-rs EVALSHA)".to_owned(),
        kind: Kind::Baseline,
        algorithm: None,
        target: script_target(BASELINE_LOG).await,
    }];
    for algorithm in ALGORITHMS {
        let name = algorithm_name(algorithm);
        subjects.push(Subject {
            name: format!("previous release script, {name}"),
            kind: Kind::Previous,
            algorithm: Some(algorithm),
            target: previous(algorithm).await,
        });
        subjects.push(Subject {
            name: format!("tollgate RedisStore, {name}, one check per call"),
            kind: Kind::OnePerCall,
            algorithm: Some(algorithm),
            target: ours(algorithm, Some(1)),
        });
        subjects.push(Subject {
            name: format!("tollgate RedisStore, {name}, batched"),
            kind: Kind::Batched,
            algorithm: Some(algorithm),
            target: ours(algorithm, None),
        });
    }

    let version = info_field(&mut admin, "server", "redis_version").await;
    let load_before = load_average();
    let started = Instant::now();
    let mut out = String::new();
    let _ = writeln!(
        out,
        "## tollgate rate-limit benchmark\n\n`cargo bench --bench rate`: {} cores shared by the \
         bench client and redis-server {version} (its own, on a free port); tokio {} workers. \
         Subjects: the hand-written baseline; per algorithm the previous release's script (one \
         `EVALSHA` per decision, over a `ConnectionManager` like the baseline); tollgate's \
         `RedisStore` with `max_batch(1)` (one check per call); and tollgate's `RedisStore` with \
         the default `max_batch` (batched: checks waiting for the store at the same moment go \
         out as one call).",
        std::thread::available_parallelism().map_or(0, std::num::NonZero::get),
        settings.workers,
    );
    let mut section_started = Instant::now();
    let mut took = |section: u32| {
        eprintln!(
            "section {section} took {:.0} s",
            section_started.elapsed().as_secs_f64()
        );
        section_started = Instant::now();
    };
    if runs(1) {
        throughput(&settings, &subjects, &mut admin, &mut out).await;
        took(1);
    }
    if runs(2) {
        let floor = script_target(LUA_FLOOR).await;
        redis_time(&settings, &subjects, &floor, &mut admin, &mut out).await;
        took(2);
    }
    if runs(3) {
        memory(&settings, &subjects, &mut admin, &mut out).await;
        took(3);
    }
    if runs(4) {
        batches(&settings, &subjects, &mut admin, &mut out).await;
        took(4);
    }
    let _ = writeln!(
        out,
        "\nLoad average (1 min) before / after: {load_before} / {}; the run took {:.0} s.",
        load_average(),
        started.elapsed().as_secs_f64()
    );
    flushall(&mut admin).await;
    drop(server);
    out
}

/// The 1-minute load average, to tell a quiet machine from a busy one.
fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|s| s.split_whitespace().next().map(str::to_owned))
        .unwrap_or_else(|| "?".to_owned())
}

/// Section 1: decisions/s, interleaved rounds, medians.
async fn throughput(
    settings: &Settings,
    subjects: &[Subject],
    admin: &mut MultiplexedConnection,
    out: &mut String,
) {
    let measure = Duration::from_secs_f64(settings.secs);
    let warm_up = Duration::from_millis(250);
    let in_flight = settings.in_flight;
    let mut rates: Vec<Vec<f64>> = vec![Vec::new(); subjects.len()];
    let mut tallies = vec![Tally::default(); subjects.len()];
    let mut per_call: Vec<Vec<f64>> = vec![Vec::new(); subjects.len()];
    let mut client_us: Vec<Vec<f64>> = vec![Vec::new(); subjects.len()];
    let mut redis_us: Vec<Vec<f64>> = vec![Vec::new(); subjects.len()];
    for round in 0..settings.rounds {
        // rotate the order so that no subject always runs first or last
        for offset in 0..subjects.len() {
            let i = (round + offset) % subjects.len();
            let subject = &subjects[i];
            flushall(admin).await;
            let _ = rate_for(&subject.target, in_flight, warm_up).await;
            flushall(admin).await;
            let ((rate, tally), cost) =
                measured(admin, rate_for(&subject.target, in_flight, measure)).await;
            per_call[i].push(cost.per_call(tally.done));
            client_us[i].push(cost.client_cpu_us(tally.done));
            redis_us[i].push(cost.redis_cpu_us(tally.done));
            eprintln!(
                "round {}: {:<58} {:>9.0}/s, {:.1} per call, CPU client {:.1} µs, redis {:.1} µs",
                round + 1,
                subject.name,
                rate,
                per_call[i].last().copied().unwrap_or_default(),
                client_us[i].last().copied().unwrap_or_default(),
                redis_us[i].last().copied().unwrap_or_default(),
            );
            rates[i].push(rate);
            tallies[i].merge(tally);
        }
    }
    flushall(admin).await;

    let mut memory_rates = Vec::new();
    for algorithm in ALGORITHMS {
        let target = Arc::new(Target::Memory {
            store: MemoryStore::new(),
            policy: policy(algorithm),
        });
        let _ = rate_for(&target, in_flight, warm_up).await;
        let client0 = client_cpu();
        let (rate, tally) = rate_for(&target, in_flight, measure).await;
        let cpu_us = (client_cpu() - client0) * 1e6 / tally.done.max(1) as f64;
        eprintln!("MemoryStore {algorithm}: {rate:.0}/s, CPU {cpu_us:.2} µs");
        memory_rates.push((algorithm, rate, cpu_us, tally));
    }

    let _ = writeln!(
        out,
        "\n### Decisions per second\n\n{in_flight} calls in flight, a random caller per call (a new \
         `Key` hashed for each); one limit {QUOTA} per {} s; median of {} interleaved runs of {} s \
         each, every run after `FLUSHALL` and a {} s warm-up.\n",
        WINDOW.as_secs(),
        settings.rounds,
        settings.secs,
        warm_up.as_secs_f64(),
    );
    let _ = writeln!(
        out,
        "| store | decisions/s | runs | vs baseline | decisions per call | client CPU / decision \
         | Redis CPU / decision | errors |"
    );
    let _ = writeln!(
        out,
        "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: |"
    );
    let baseline_rate = median(&rates[0]);
    for (i, subject) in subjects.iter().enumerate() {
        let runs: Vec<String> = rates[i].iter().map(|&r| kilo(r)).collect();
        // each round ran every subject back to back: compare within a round, then take the median
        let paired: Vec<f64> = rates[i].iter().zip(&rates[0]).map(|(r, b)| r / b).collect();
        let _ = writeln!(
            out,
            "| {} | {} | {} | {:.2}x | {:.1} | {:.1} µs | {:.1} µs | {} |",
            subject.name,
            kilo(median(&rates[i])),
            runs.join(" / "),
            median(&paired),
            median(&per_call[i]),
            median(&client_us[i]),
            median(&redis_us[i]),
            tallies[i].errors,
        );
    }
    for (algorithm, rate, cpu_us, tally) in memory_rates {
        let _ = writeln!(
            out,
            "| MemoryStore (one process, not shared), {} | {} | | {:.2}x | | {cpu_us:.1} µs | | {} \
             |",
            algorithm_name(algorithm),
            kilo(rate),
            rate / baseline_rate,
            tally.errors,
        );
    }
    let _ = writeln!(
        out,
        "\n\"vs baseline\" is the median of the per-round ratios. Decisions per call: decisions / \
         `EVALSHA` + `EVAL` calls (`INFO commandstats` after `CONFIG RESETSTAT`) over a run. CPU \
         per decision: user + system time of the bench process (`/proc/self/stat`) and of \
         redis-server (`INFO cpu`) over a run, divided by its decisions; unlike decisions/s it \
         hardly depends on what else runs on the machine. tollgate's rows include hashing a new \
         `Key` per call (`Key::new`, SHA-256: {:.2} µs); the baseline and the previous release's \
         scripts format their key string instead.",
        key_new_us()
    );
}

/// µs per `Key::new` of an 8-byte value, as the bench makes one per call.
fn key_new_us() -> f64 {
    const N: u64 = 200_000;
    let start = Instant::now();
    for i in 0..N {
        std::hint::black_box(Key::new("bench", &std::hint::black_box(i).to_le_bytes()));
    }
    start.elapsed().as_secs_f64() * 1e6 / N as f64
}

/// One measured phase of section 2, per decision.
#[derive(Clone, Copy)]
struct Phase {
    /// µs inside Redis.
    us: f64,
    /// µs of redis-server CPU.
    cpu_us: f64,
    /// Decisions per call.
    per_call: f64,
}

impl Phase {
    fn of(cost: &Cost, decisions: u64) -> Self {
        Self {
            us: cost.redis_us(decisions),
            cpu_us: cost.redis_cpu_us(decisions),
            per_call: cost.per_call(decisions),
        }
    }
}

/// The median of one field of `phases`.
fn median_of(phases: &[Phase], field: fn(&Phase) -> f64) -> f64 {
    median(&phases.iter().map(field).collect::<Vec<_>>())
}

/// The median of the per-round ratios of `phases` to `previous` (µs inside Redis).
fn ratio(phases: &[Phase], previous: &[Phase]) -> f64 {
    let ratios: Vec<f64> = phases
        .iter()
        .zip(previous)
        .map(|(p, q)| p.us / q.us)
        .collect();
    median(&ratios)
}

/// Section 2: µs inside Redis per allowed decision.
async fn redis_time(
    settings: &Settings,
    subjects: &[Subject],
    floor: &Arc<Target>,
    admin: &mut MultiplexedConnection,
    out: &mut String,
) {
    const NEW_CALLERS: usize = 20_000;
    const RETURNING: usize = 1_000;
    const RETURNING_CALLS: usize = 20_000; // 20 each on top of 1, all within the quota
    let in_flight = settings.stats_in_flight;

    let mut floor_phases = Vec::new();
    for _ in 0..settings.rounds {
        flushall(admin).await;
        let _ = run_n(floor, in_flight, 100, |i| i as u64).await;
        let (tally, cost) =
            measured(admin, run_n(floor, in_flight, NEW_CALLERS, |i| i as u64)).await;
        assert_eq!(cost.calls, NEW_CALLERS as u64, "Lua floor: EVALSHA calls");
        floor_phases.push(Phase::of(&cost, tally.done));
    }

    let mut fresh: Vec<Vec<Phase>> = vec![Vec::new(); subjects.len()];
    let mut back: Vec<Vec<Phase>> = vec![Vec::new(); subjects.len()];
    for round in 0..settings.rounds {
        for offset in 0..subjects.len() {
            let i = (round + offset) % subjects.len();
            let subject = &subjects[i];
            flushall(admin).await;
            // load the script outside the counted calls
            let _ = run_n(&subject.target, 1, 1, |_| u64::MAX).await;
            let (tally, cost) = measured(
                admin,
                run_n(&subject.target, in_flight, NEW_CALLERS, |i| i as u64),
            )
            .await;
            subject.check_calls(cost.calls, NEW_CALLERS);
            assert_eq!(
                tally.admitted, NEW_CALLERS as u64,
                "{}: all admitted",
                subject.name
            );
            fresh[i].push(Phase::of(&cost, tally.done));

            flushall(admin).await;
            let _ = run_n(&subject.target, in_flight, RETURNING, |i| {
                (1 << 40) + i as u64
            })
            .await;
            let (tally, cost) = measured(
                admin,
                run_n(&subject.target, in_flight, RETURNING_CALLS, |i| {
                    (1 << 40) + (i % RETURNING) as u64
                }),
            )
            .await;
            subject.check_calls(cost.calls, RETURNING_CALLS);
            assert_eq!(
                tally.admitted, RETURNING_CALLS as u64,
                "{}: all admitted",
                subject.name
            );
            back[i].push(Phase::of(&cost, tally.done));
            let (f, b) = (fresh[i][round], back[i][round]);
            eprintln!(
                "round {}: {:<58} {:.2} / {:.2} µs, CPU {:.2} / {:.2} µs, {:.1} / {:.1} per call",
                round + 1,
                subject.name,
                f.us,
                b.us,
                f.cpu_us,
                b.cpu_us,
                f.per_call,
                b.per_call,
            );
        }
    }

    let _ = writeln!(
        out,
        "\n### Time inside Redis per allowed decision\n\n`INFO commandstats`: `usec` of \
         `cmdstat_evalsha` and `cmdstat_eval` / decisions after `CONFIG RESETSTAT`; \
         {NEW_CALLERS} new callers, then {RETURNING_CALLS} decisions of {RETURNING} returning \
         callers (2 to 21 entries in a log); {in_flight} in flight. Median (min) of {} \
         interleaved rounds. Wall time inside Redis: on a busy machine preemption of \
         redis-server inflates it.\n",
        settings.rounds
    );
    let _ = writeln!(
        out,
        "| script | decisions per call (new / returning) | new caller (µs) | returning caller \
         (µs) | Redis CPU / decision (new / returning) | vs previous release (new / returning) | \
         target |"
    );
    let _ = writeln!(out, "| --- | ---: | ---: | ---: | ---: | ---: | --- |");
    for (i, subject) in subjects.iter().enumerate() {
        let (new_us, back_us) = (
            median_of(&fresh[i], |p| p.us),
            median_of(&back[i], |p| p.us),
        );
        let previous = previous_of(subjects, subject.algorithm).filter(|&p| p != i);
        let vs = previous.map(|p| (ratio(&fresh[i], &fresh[p]), ratio(&back[i], &back[p])));
        let target = match (subject.kind, vs) {
            (Kind::Batched, Some((new, returning))) => format!(
                "<= {TARGET_VS_PREVIOUS:.2}x: {}",
                if new.max(returning) <= TARGET_VS_PREVIOUS {
                    "met"
                } else {
                    "**missed**"
                }
            ),
            (Kind::Baseline, _) => "(anchor: 8.1 µs)".to_owned(),
            _ => String::new(),
        };
        let _ = writeln!(
            out,
            "| {} | {:.1} / {:.1} | {new_us:.2} ({:.2}) | {back_us:.2} ({:.2}) | {:.2} / {:.2} µs \
             | {} | {target} |",
            subject.name,
            median_of(&fresh[i], |p| p.per_call),
            median_of(&back[i], |p| p.per_call),
            minimum(&fresh[i].iter().map(|p| p.us).collect::<Vec<_>>()),
            minimum(&back[i].iter().map(|p| p.us).collect::<Vec<_>>()),
            median_of(&fresh[i], |p| p.cpu_us),
            median_of(&back[i], |p| p.cpu_us),
            vs.map_or_else(String::new, |(new, returning)| format!(
                "{new:.2}x / {returning:.2}x"
            )),
        );
    }
    let _ = writeln!(
        out,
        "| Lua floor: `return 1` | 1.0 | {:.2} ({:.2}) | | {:.2} µs | | (anchor: 0.7 µs) |",
        median_of(&floor_phases, |p| p.us),
        minimum(&floor_phases.iter().map(|p| p.us).collect::<Vec<_>>()),
        median_of(&floor_phases, |p| p.cpu_us),
    );
    let _ = writeln!(
        out,
        "\nRedis CPU per decision: user + system time of redis-server (`INFO cpu`) over the \
         decisions: the time inside the scripts plus reading, parsing and answering the calls. \
         \"vs previous release\": µs inside Redis per decision over those of the previous \
         release's script of the same algorithm, in the same round; the median of the rounds. The \
         batched store's target: at least {:.0}% below the previous release, for new and \
         returning callers.",
        (1.0 - TARGET_VS_PREVIOUS) * 100.0
    );
}

/// Section 3: Redis memory per caller.
async fn memory(
    settings: &Settings,
    subjects: &[Subject],
    admin: &mut MultiplexedConnection,
    out: &mut String,
) {
    const CALLERS_ONE: usize = 10_000;
    const CALLERS_FULL: usize = 1_000;
    let in_flight = settings.in_flight;
    let _ = writeln!(
        out,
        "\n### Redis memory per caller\n\n`used_memory` (less `mem_clients_normal`) delta / callers, \
         limit {QUOTA} per {} s; keys `{NAMESPACE}:{{<22 chars>}}:{LIMIT_NAME}:<algorithm>`. The \
         one-call subjects keep the same data as the batched store.\n",
        WINDOW.as_secs()
    );
    let _ = writeln!(
        out,
        "| store | after 1 request ({CALLERS_ONE} callers) | after {QUOTA} requests \
         ({CALLERS_FULL} callers) |"
    );
    let _ = writeln!(out, "| --- | ---: | ---: |");
    for subject in subjects
        .iter()
        .filter(|s| matches!(s.kind, Kind::Baseline | Kind::Batched))
    {
        flushall(admin).await;
        let before = used_memory(admin).await;
        let one = run_n(&subject.target, in_flight, CALLERS_ONE, |i| {
            (2 << 40) + i as u64
        })
        .await;
        let after = used_memory(admin).await;
        let per_one = (after - before) as f64 / CALLERS_ONE as f64;
        assert_eq!(
            one.admitted, CALLERS_ONE as u64,
            "{}: all admitted",
            subject.name
        );

        flushall(admin).await;
        let before = used_memory(admin).await;
        // round by round, so that each log holds entries of many different times
        let full = run_n(
            &subject.target,
            in_flight,
            CALLERS_FULL * QUOTA as usize,
            |i| (3 << 40) + (i % CALLERS_FULL) as u64,
        )
        .await;
        let after = used_memory(admin).await;
        let per_full = (after - before) as f64 / CALLERS_FULL as f64;
        let note = if full.admitted == full.done {
            String::new()
        } else {
            format!(" ({} of {} admitted)", full.admitted, full.done)
        };
        eprintln!("{}: {per_one:.0} B / {per_full:.0} B", subject.name);
        let _ = writeln!(
            out,
            "| {} | {} | {}{note} |",
            subject.name,
            bytes(per_one),
            bytes(per_full)
        );
    }
}

/// One measurement of section 4.
#[derive(Clone, Copy)]
struct Point {
    rate: f64,
    per_call: f64,
    redis_cpu_us: f64,
    p50_us: f64,
    p99_us: f64,
    errors: u64,
}

/// The median of one field of `points`.
fn median_point(points: &[Point], field: fn(&Point) -> f64) -> f64 {
    median(&points.iter().map(field).collect::<Vec<_>>())
}

/// µs, with a decimal below 100.
fn micros(v: f64) -> String {
    if v >= 100.0 {
        format!("{v:.0} µs")
    } else {
        format!("{v:.1} µs")
    }
}

/// Section 4: batch sizes and latency by calls in flight.
async fn batches(
    settings: &Settings,
    subjects: &[Subject],
    admin: &mut MultiplexedConnection,
    out: &mut String,
) {
    const LEVELS: [usize; 4] = [1, 4, 16, 64];
    /// The decisions of the row of 1 in flight, one after the other.
    const SEQUENTIAL: usize = 10_000;
    let measure = Duration::from_secs_f64(settings.batch_secs);
    let warm_up = Duration::from_millis(250);
    // the subjects of each algorithm, in the order of the tables
    let groups: Vec<(Algorithm, Vec<usize>)> = ALGORITHMS
        .iter()
        .map(|&algorithm| {
            let mut group: Vec<usize> = (0..subjects.len())
                .filter(|&i| {
                    subjects[i].kind != Kind::Baseline && subjects[i].algorithm == Some(algorithm)
                })
                .collect();
            group.sort_by_key(|&i| match subjects[i].kind {
                Kind::Batched => 0,
                Kind::OnePerCall => 1,
                _ => 2,
            });
            (algorithm, group)
        })
        .collect();
    // points[level][subject], a point per round
    let mut points: Vec<Vec<Vec<Point>>> = vec![vec![Vec::new(); subjects.len()]; LEVELS.len()];
    for round in 0..settings.batch_rounds {
        for (l, &in_flight) in LEVELS.iter().enumerate() {
            for (_, group) in &groups {
                for offset in 0..group.len() {
                    let i = group[(round + offset) % group.len()];
                    let subject = &subjects[i];
                    flushall(admin).await;
                    let _ = rate_for(&subject.target, in_flight, warm_up).await;
                    flushall(admin).await;
                    let until = if in_flight == 1 {
                        Until::Decisions(SEQUENTIAL)
                    } else {
                        Until::Elapsed(measure)
                    };
                    let (mut driven, cost) =
                        measured(admin, drive(&subject.target, in_flight, until, true)).await;
                    driven.latencies.sort_unstable();
                    let done = driven.tally.done;
                    let point = Point {
                        rate: driven.rate,
                        per_call: cost.per_call(done),
                        redis_cpu_us: cost.redis_cpu_us(done),
                        p50_us: percentile_us(&driven.latencies, 0.50),
                        p99_us: percentile_us(&driven.latencies, 0.99),
                        errors: driven.tally.errors,
                    };
                    eprintln!(
                        "round {}: {in_flight:>2} in flight, {:<58} {:>9.0}/s, {:.1} per call, \
                         redis CPU {:.1} µs, p50 {:.1} µs, p99 {:.1} µs",
                        round + 1,
                        subject.name,
                        point.rate,
                        point.per_call,
                        point.redis_cpu_us,
                        point.p50_us,
                        point.p99_us,
                    );
                    points[l][i].push(point);
                }
            }
        }
    }

    let _ = writeln!(
        out,
        "\n### Batch sizes and latency\n\nA random caller per call, one limit {QUOTA} per {} s; \
         per algorithm tollgate batched (default `max_batch`), tollgate with one check per call \
         (`max_batch(1)`) and the previous release's script (one `EVALSHA` per decision). 1 in \
         flight: {SEQUENTIAL} sequential decisions, the unloaded latency one decision adds; more \
         in flight: runs of {} s. Median of {} interleaved rounds, every run after `FLUSHALL` and \
         a {} s warm-up. Latency: from a decision's call to its answer, as its caller sees it \
         (p50 / p99 of the run's decisions).",
        WINDOW.as_secs(),
        settings.batch_secs,
        settings.batch_rounds,
        warm_up.as_secs_f64(),
    );
    for (algorithm, group) in &groups {
        let _ = writeln!(
            out,
            "\n#### {}\n\n| calls in flight | subject | decisions/s | decisions per call | Redis \
             CPU / decision | p50 latency | p99 latency |\n| ---: | --- | ---: | ---: | ---: | \
             ---: | ---: |",
            algorithm_name(*algorithm)
        );
        for (l, &in_flight) in LEVELS.iter().enumerate() {
            for &i in group {
                let runs = &points[l][i];
                let errors: u64 = runs.iter().map(|p| p.errors).sum();
                let note = if errors > 0 {
                    format!(" ({errors} errors)")
                } else {
                    String::new()
                };
                let _ = writeln!(
                    out,
                    "| {in_flight} | {}{note} | {} | {:.1} | {:.1} µs | {} | {} |",
                    subjects[i].kind.short(),
                    kilo(median_point(runs, |p| p.rate)),
                    median_point(runs, |p| p.per_call),
                    median_point(runs, |p| p.redis_cpu_us),
                    micros(median_point(runs, |p| p.p50_us)),
                    micros(median_point(runs, |p| p.p99_us)),
                );
            }
        }
    }
    let _ = writeln!(
        out,
        "\nDecisions per call: decisions / `EVALSHA` + `EVAL` calls over a run. Redis CPU per \
         decision: user + system time of redis-server (`INFO cpu`) over a run / its decisions."
    );
}
