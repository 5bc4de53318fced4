//! Rate-limit benchmark: `cargo bench --bench rate`.
//!
//! Starts its own `redis-server` on a free port (never the shared one on 6379) and measures, in one
//! run, side by side:
//!
//! 1. decisions/s of [`RedisStore::check_rate`] for each [`Algorithm`] against a hand-written
//!    redis-rs loop that `EVALSHA`s a minimal sliding-log script (TIME, ZREMRANGEBYSCORE, ZCARD,
//!    ZADD, PEXPIRE) over the same connection kind (`ConnectionManager`), both with 64 calls in
//!    flight on random keys; plus the in-process [`MemoryStore`] for reference. Each measurement
//!    is a warm-up and then a fixed duration, repeated in interleaved rounds; the median is shown,
//!    with the CPU time per decision of the bench process and of redis-server (which, unlike
//!    decisions/s, hardly depends on what else the machine runs).
//! 2. time inside Redis per allowed decision (`INFO commandstats`, `cmdstat_evalsha`), for new
//!    callers and for callers that already have state.
//! 3. Redis memory per caller (`used_memory` delta / callers), after 1 request and after 100.
//!
//! The tables are markdown, ready to paste into a README. Environment knobs:
//! `BENCH_SECS` (seconds per throughput measurement, default 2), `BENCH_ROUNDS` (default 5),
//! `BENCH_WORKERS` (tokio worker threads, default 2), `BENCH_IN_FLIGHT` (default 64),
//! `BENCH_STATS_IN_FLIGHT` (calls in flight in section 2, default `BENCH_IN_FLIGHT`) and
//! `BENCH_ONLY` (1, 2 or 3: run one section).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::fmt::Write as _;
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

const QUOTA: u64 = 100;
const WINDOW: Duration = Duration::from_secs(60);
const NAMESPACE: &str = "tollgate:rl";
const LIMIT_NAME: &str = "api";

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
    /// An arbitrary script over a `ConnectionManager`, called like the hand-written baseline.
    Script {
        conn: ConnectionManager,
        script: Script,
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
                    .arg(u64::try_from(WINDOW.as_micros()).unwrap())
                    .arg(nonce)
                    .invoke_async(&mut conn)
                    .await
                    .map_err(|e| e.to_string())?;
                Ok(admitted == 1)
            }
        }
    }
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

/// `in_flight` tasks deciding for random callers until `duration` is over: decisions/s.
async fn rate_for(target: &Arc<Target>, in_flight: usize, duration: Duration) -> (f64, Tally) {
    let start = Instant::now();
    let deadline = start + duration;
    let mut tasks = Vec::with_capacity(in_flight);
    for _ in 0..in_flight {
        let target = Arc::clone(target);
        tasks.push(tokio::spawn(async move {
            let mut tally = Tally::default();
            while Instant::now() < deadline {
                tally.add(&target.decide(rand::random()).await);
            }
            tally
        }));
    }
    let mut total = Tally::default();
    for task in tasks {
        total.merge(task.await.expect("bench task"));
    }
    let elapsed = start.elapsed().as_secs_f64();
    (total.done as f64 / elapsed, total)
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

/// (calls, µs per call) of `EVALSHA` since the last `CONFIG RESETSTAT`.
async fn evalsha_stats(admin: &mut MultiplexedConnection) -> (u64, f64) {
    let line = info_field(admin, "commandstats", "cmdstat_evalsha").await;
    let field = |name: &str| -> f64 {
        line.split(',')
            .find_map(|kv| kv.strip_prefix(name)?.strip_prefix('='))
            .and_then(|v| v.parse().ok())
            .unwrap_or(0.0)
    };
    let calls = field("calls");
    let usec = field("usec");
    (calls as u64, if calls > 0.0 { usec / calls } else { 0.0 })
}

async fn reset_stats(admin: &mut MultiplexedConnection) {
    redis::cmd("CONFIG")
        .arg("RESETSTAT")
        .query_async::<()>(admin)
        .await
        .expect("CONFIG RESETSTAT");
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

/// A bench subject with a name and, when it has one, the target it should meet.
struct Subject {
    name: &'static str,
    target: Arc<Target>,
    /// µs per call inside Redis at most (section 2).
    redis_us_target: Option<f64>,
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
    only: Option<u32>,
}

async fn bench(workers: usize) -> String {
    let in_flight: usize = env_or("BENCH_IN_FLIGHT", 64).max(1);
    let settings = Settings {
        workers,
        secs: env_or("BENCH_SECS", 2.0),
        rounds: env_or("BENCH_ROUNDS", 5).max(1),
        in_flight,
        stats_in_flight: env_or("BENCH_STATS_IN_FLIGHT", in_flight).max(1),
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

    let script_target = |source: &'static str| {
        let client = client.clone();
        async move {
            let conn = ConnectionManager::new(client)
                .await
                .expect("connection manager");
            Arc::new(Target::Script {
                conn,
                script: Script::new(source),
            })
        }
    };
    let ours = |algorithm: Algorithm| {
        Arc::new(Target::Ours {
            store: RedisStore::open(server.url()).expect("redis store"),
            policy: policy(algorithm),
        })
    };

    let subjects = vec![
        Subject {
            name: "baseline: hand-written sliding log (redis-rs EVALSHA)",
            target: script_target(BASELINE_LOG).await,
            redis_us_target: None,
        },
        Subject {
            name: "tollgate RedisStore, sliding log",
            target: ours(Algorithm::SlidingLog),
            redis_us_target: Some(8.0),
        },
        Subject {
            name: "tollgate RedisStore, sliding counter",
            target: ours(Algorithm::SlidingCounter),
            redis_us_target: Some(5.0),
        },
        Subject {
            name: "tollgate RedisStore, GCRA",
            target: ours(Algorithm::Gcra),
            redis_us_target: Some(5.0),
        },
    ];

    let version = info_field(&mut admin, "server", "redis_version").await;
    let load_before = load_average();
    let started = Instant::now();
    let mut out = String::new();
    let _ = writeln!(
        out,
        "## tollgate rate-limit benchmark\n\n`cargo bench --bench rate`: {} cores shared by the \
         bench client and redis-server {version} (its own, on a free port); tokio {} workers.",
        std::thread::available_parallelism().map_or(0, std::num::NonZero::get),
        settings.workers,
    );
    if runs(1) {
        throughput(&settings, &subjects, &mut admin, &mut out).await;
    }
    if runs(2) {
        let floor = script_target(LUA_FLOOR).await;
        redis_time(&settings, &subjects, &floor, &mut admin, &mut out).await;
    }
    if runs(3) {
        memory(&settings, &subjects, &mut admin, &mut out).await;
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
    let warm_up = Duration::from_millis(500);
    let in_flight = settings.in_flight;
    let mut rates: Vec<Vec<f64>> = vec![Vec::new(); subjects.len()];
    let mut tallies = vec![Tally::default(); subjects.len()];
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
            let (client0, redis0) = (client_cpu(), redis_cpu(admin).await);
            let (rate, tally) = rate_for(&subject.target, in_flight, measure).await;
            let (client1, redis1) = (client_cpu(), redis_cpu(admin).await);
            let done = tally.done.max(1) as f64;
            client_us[i].push((client1 - client0) * 1e6 / done);
            redis_us[i].push((redis1 - redis0) * 1e6 / done);
            eprintln!(
                "round {}: {:<55} {:>9.0}/s, CPU client {:.1} µs, redis {:.1} µs",
                round + 1,
                subject.name,
                rate,
                client_us[i].last().copied().unwrap_or_default(),
                redis_us[i].last().copied().unwrap_or_default(),
            );
            rates[i].push(rate);
            tallies[i].merge(tally);
        }
    }
    flushall(admin).await;

    let mut memory_rates = Vec::new();
    for algorithm in [
        Algorithm::SlidingLog,
        Algorithm::SlidingCounter,
        Algorithm::Gcra,
    ] {
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
         each, every run after `FLUSHALL` and a 0.5 s warm-up.\n",
        WINDOW.as_secs(),
        settings.rounds,
        settings.secs,
    );
    let _ = writeln!(
        out,
        "| store | decisions/s | runs | vs baseline | client CPU / decision | Redis CPU / \
         decision | errors |"
    );
    let _ = writeln!(out, "| --- | ---: | --- | ---: | ---: | ---: | ---: |");
    let baseline_rate = median(&rates[0]);
    for (i, subject) in subjects.iter().enumerate() {
        let runs: Vec<String> = rates[i].iter().map(|&r| kilo(r)).collect();
        // each round ran every subject back to back: compare within a round, then take the median
        let paired: Vec<f64> = rates[i].iter().zip(&rates[0]).map(|(r, b)| r / b).collect();
        let _ = writeln!(
            out,
            "| {} | {} | {} | {:.2}x | {:.1} µs | {:.1} µs | {} |",
            subject.name,
            kilo(median(&rates[i])),
            runs.join(" / "),
            median(&paired),
            median(&client_us[i]),
            median(&redis_us[i]),
            tallies[i].errors,
        );
    }
    for (algorithm, rate, cpu_us, tally) in memory_rates {
        let _ = writeln!(
            out,
            "| MemoryStore (one process, not shared), {algorithm} | {} | | {:.2}x | {cpu_us:.1} µs \
             | | {} |",
            kilo(rate),
            rate / baseline_rate,
            tally.errors,
        );
    }
    let _ = writeln!(
        out,
        "\n\"vs baseline\" is the median of the per-round ratios. CPU per decision: user + system \
         time of the bench process (`/proc/self/stat`) and of redis-server (`INFO cpu`) over a \
         run, divided by its decisions; unlike decisions/s it hardly depends on what else runs on \
         the machine. tollgate's rows include hashing a new `Key` per call (`Key::new`, SHA-256: \
         {:.2} µs); the baseline formats its key string instead.",
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

    let mut floor_us = Vec::new();
    for _ in 0..settings.rounds {
        flushall(admin).await;
        let _ = run_n(floor, in_flight, 100, |i| i as u64).await;
        reset_stats(admin).await;
        let _ = run_n(floor, in_flight, NEW_CALLERS, |i| i as u64).await;
        floor_us.push(evalsha_stats(admin).await.1);
    }

    let _ = writeln!(
        out,
        "\n### Time inside Redis per allowed decision\n\n`INFO commandstats`, `cmdstat_evalsha` \
         usec / calls after `CONFIG RESETSTAT`; {NEW_CALLERS} new callers, then {RETURNING_CALLS} \
         decisions of {RETURNING} returning callers (2 to 21 entries in a log); {in_flight} in \
         flight. Median (min) of {} interleaved rounds. Wall time inside Redis: on a busy machine \
         preemption of redis-server inflates it.\n",
        settings.rounds
    );
    let _ = writeln!(
        out,
        "| script | new caller (µs) | returning caller (µs) | target |"
    );
    let _ = writeln!(out, "| --- | ---: | ---: | --- |");
    let mut fresh_us: Vec<Vec<f64>> = vec![Vec::new(); subjects.len()];
    let mut back_us: Vec<Vec<f64>> = vec![Vec::new(); subjects.len()];
    for round in 0..settings.rounds {
        for offset in 0..subjects.len() {
            let i = (round + offset) % subjects.len();
            let subject = &subjects[i];
            flushall(admin).await;
            // load the script outside the counted calls
            let _ = run_n(&subject.target, 1, 1, |_| u64::MAX).await;
            reset_stats(admin).await;
            let fresh = run_n(&subject.target, in_flight, NEW_CALLERS, |i| i as u64).await;
            let (calls, us) = evalsha_stats(admin).await;
            assert_eq!(calls, NEW_CALLERS as u64, "{}: EVALSHA calls", subject.name);
            assert_eq!(
                fresh.admitted, NEW_CALLERS as u64,
                "{}: all admitted",
                subject.name
            );
            fresh_us[i].push(us);

            flushall(admin).await;
            let _ = run_n(&subject.target, in_flight, RETURNING, |i| {
                (1 << 40) + i as u64
            })
            .await;
            reset_stats(admin).await;
            let back = run_n(&subject.target, in_flight, RETURNING_CALLS, |i| {
                (1 << 40) + (i % RETURNING) as u64
            })
            .await;
            let (calls, us) = evalsha_stats(admin).await;
            assert_eq!(
                calls, RETURNING_CALLS as u64,
                "{}: EVALSHA calls",
                subject.name
            );
            assert_eq!(
                back.admitted, RETURNING_CALLS as u64,
                "{}: all admitted",
                subject.name
            );
            back_us[i].push(us);
            eprintln!(
                "round {}: {:<55} {:.2} / {us:.2} µs",
                round + 1,
                subject.name,
                fresh_us[i].last().copied().unwrap_or_default()
            );
        }
    }
    for (i, subject) in subjects.iter().enumerate() {
        let (fresh, back) = (median(&fresh_us[i]), median(&back_us[i]));
        let target = match subject.redis_us_target {
            Some(t) => {
                let worst = fresh.max(back);
                format!(
                    "<= {t} µs: {}",
                    if worst <= t { "met" } else { "**missed**" }
                )
            }
            None => "(anchor: 8.1 µs)".to_owned(),
        };
        let _ = writeln!(
            out,
            "| {} | {fresh:.2} ({:.2}) | {back:.2} ({:.2}) | {target} |",
            subject.name,
            minimum(&fresh_us[i]),
            minimum(&back_us[i]),
        );
    }
    let _ = writeln!(
        out,
        "| Lua floor: `return 1` | {:.2} ({:.2}) | | (anchor: 0.7 µs) |",
        median(&floor_us),
        minimum(&floor_us)
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
         limit {QUOTA} per {} s; keys `{NAMESPACE}:{{<22 chars>}}:{LIMIT_NAME}:<algorithm>`.\n",
        WINDOW.as_secs()
    );
    let _ = writeln!(
        out,
        "| store | after 1 request ({CALLERS_ONE} callers) | after {QUOTA} requests \
         ({CALLERS_FULL} callers) |"
    );
    let _ = writeln!(out, "| --- | ---: | ---: |");
    for subject in subjects {
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
