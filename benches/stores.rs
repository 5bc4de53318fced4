//! Rate decisions on Redis beside PostgreSQL, in one run: `cargo bench --bench stores`.
//!
//! The bench starts its own redis-server and PostgreSQL (initdb on a free port, as the tests
//! do; never the servers on 6379 or 5432), and measures, for each algorithm and store:
//!
//! - **decisions/s** with `BENCH_IN_FLIGHT` checks in flight (default 64) over 1,000 callers,
//!   each with one limit of 100,000 per hour (so every check writes), for `BENCH_SECS` seconds
//!   (default 2);
//! - **µs per decision** one at a time: p50 and p99 of `BENCH_SAMPLES` sequential checks
//!   (default 2,000).
//!
//! Stores and algorithms alternate in `BENCH_ROUNDS` rounds (default 3); the table shows the
//! median of the rounds and PostgreSQL's throughput as a share of Redis's. Both servers run on
//! this machine, beside the bench: what is compared is the cost of a decision in each store,
//! not the network.
#![allow(missing_docs, clippy::unwrap_used, clippy::expect_used)]

#[path = "../tests/common/mod.rs"]
mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use tollgate::key::Key;
use tollgate::rate::{Algorithm, Limit, RateCheck, RatePolicy};
use tollgate::store::{PgStore, RateStore};

const CALLERS: u64 = 1_000;

fn env_or<T: std::str::FromStr>(name: &str, default: T) -> T {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn median(values: &mut [f64]) -> f64 {
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}

fn policy(algorithm: Algorithm, round: usize) -> Arc<RatePolicy> {
    let limits = vec![Limit::new("hourly", 100_000, Duration::from_secs(3600))];
    Arc::new(RatePolicy::new(format!("bench{round}:rl"), algorithm, limits).unwrap())
}

/// Decisions per second with `in_flight` checks in flight for `secs`.
async fn throughput(
    store: &Arc<dyn RateStore>,
    policy: &Arc<RatePolicy>,
    in_flight: usize,
    secs: f64,
) -> f64 {
    let until = Instant::now() + Duration::from_secs_f64(secs);
    let workers: Vec<_> = (0..in_flight)
        .map(|w| {
            let (store, policy) = (Arc::clone(store), Arc::clone(policy));
            tokio::spawn(async move {
                let mut done = 0u64;
                let mut caller = w as u64;
                while Instant::now() < until {
                    caller = (caller + 7) % CALLERS;
                    let key = Key::new("bench", &caller.to_le_bytes());
                    store
                        .check_rate(&policy, RateCheck::new(key, 1))
                        .await
                        .expect("the store answers");
                    done += 1;
                }
                done
            })
        })
        .collect();
    let start = Instant::now();
    let mut total = 0;
    for worker in workers {
        total += worker.await.unwrap();
    }
    total as f64 / start.elapsed().as_secs_f64()
}

/// p50 and p99 in µs of `samples` checks one after another.
async fn latency(
    store: &Arc<dyn RateStore>,
    policy: &Arc<RatePolicy>,
    samples: usize,
) -> (f64, f64) {
    let mut times = Vec::with_capacity(samples);
    for i in 0..samples {
        let key = Key::new("bench", &(i as u64 % CALLERS).to_le_bytes());
        let start = Instant::now();
        store
            .check_rate(policy, RateCheck::new(key, 1))
            .await
            .expect("the store answers");
        times.push(start.elapsed().as_secs_f64() * 1e6);
    }
    times.sort_by(f64::total_cmp);
    (times[samples / 2], times[samples * 99 / 100])
}

#[derive(Default)]
struct Figures {
    rate: Vec<f64>,
    p50: Vec<f64>,
    p99: Vec<f64>,
}

fn main() {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(env_or("BENCH_WORKERS", 2))
        .enable_all()
        .build()
        .unwrap();
    let redis = common::RedisServer::start();
    let postgres = common::postgres::PgServer::start();
    let report = runtime.block_on(async {
        let in_flight = env_or("BENCH_IN_FLIGHT", 64);
        let secs = env_or("BENCH_SECS", 2.0);
        let samples = env_or("BENCH_SAMPLES", 2_000);
        let rounds = env_or("BENCH_ROUNDS", 3);
        let redis_store: Arc<dyn RateStore> = Arc::new(
            tollgate::store::RedisStore::builder(redis.url())
                .timeout(Duration::from_secs(2))
                .build()
                .unwrap(),
        );
        let pg_store: Arc<dyn RateStore> = Arc::new(
            PgStore::builder(postgres.url())
                .timeout(Duration::from_secs(2))
                .pool_size(env_or("BENCH_PG_POOL", 16))
                .connect()
                .await
                .expect("a migrated PgStore"),
        );
        let stores = [("Redis", &redis_store), ("PostgreSQL", &pg_store)];
        let algorithms = [
            (Algorithm::SlidingLog, "sliding log"),
            (Algorithm::SlidingCounter, "sliding counter"),
            (Algorithm::Gcra, "GCRA"),
        ];
        let mut figures: Vec<Vec<Figures>> = algorithms
            .iter()
            .map(|_| stores.iter().map(|_| Figures::default()).collect())
            .collect();
        for round in 0..rounds {
            for (a, (algorithm, name)) in algorithms.iter().enumerate() {
                for (s, (store_name, store)) in stores.iter().enumerate() {
                    let policy = policy(*algorithm, round);
                    // warm-up: every caller's state exists, connections are open
                    throughput(store, &policy, in_flight, 0.3).await;
                    let rate = throughput(store, &policy, in_flight, secs).await;
                    let (p50, p99) = latency(store, &policy, samples).await;
                    eprintln!(
                        "round {round}: {name} on {store_name}: {rate:.0}/s, p50 {p50:.0} µs, p99 {p99:.0} µs"
                    );
                    let f = &mut figures[a][s];
                    f.rate.push(rate);
                    f.p50.push(p50);
                    f.p99.push(p99);
                }
            }
        }
        let mut out = format!(
            "rate decisions, {in_flight} in flight for {secs} s, then {samples} one at a time; \
             median of {rounds} rounds\n\n\
             | algorithm | store | decisions/s | p50 µs (one at a time) | p99 µs | PostgreSQL / Redis |\n\
             | --- | --- | ---: | ---: | ---: | ---: |\n"
        );
        for (a, (_, name)) in algorithms.iter().enumerate() {
            let redis_rate = median(&mut figures[a][0].rate.clone());
            for (s, (store_name, _)) in stores.iter().enumerate() {
                let f = &mut figures[a][s];
                let rate = median(&mut f.rate);
                let ratio = if s == 0 {
                    String::from("1.00x")
                } else {
                    format!("{:.2}x", rate / redis_rate)
                };
                out.push_str(&format!(
                    "| {name} | {store_name} | {rate:.0} | {:.0} | {:.0} | {ratio} |\n",
                    median(&mut f.p50),
                    median(&mut f.p99),
                ));
            }
        }
        out
    });
    println!("{report}");
}
