//! Durable claims: `cargo bench --bench durable`.
//!
//! Starts its own redis-server with two replicas, each reaching it through a TCP proxy that adds
//! `BENCH_REPLICA_MS` (default 1) milliseconds each way — a replica in the next rack — and two
//! copies of a service, each with its own `RedisStore` that asks for `wait_replicas(1)`. Then,
//! `BENCH_ROUNDS` times (default 3), `BENCH_CLAIMS` (default 200) claims of fresh names start at
//! once, alternating between the copies, and the bench reports how long the last one took to be
//! acknowledged, the median and p99 claim, and how many failed (a 5 s store timeout: none should).
#![allow(missing_docs, clippy::unwrap_used, clippy::expect_used)]

#[path = "../tests/common/mod.rs"]
mod common;

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::RedisServer;
use common::proxy::Proxy;
use tollgate::claim::Claims;
use tollgate::store::RedisStore;

fn env_or<T: std::str::FromStr>(name: &str, default: T) -> T {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// A replica of the primary at `port`, killed on drop (its directory removed with it).
struct Replica {
    child: Child,
    _dir: tempfile::TempDir,
}

impl Replica {
    fn of(port: u16) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let child = Command::new("redis-server")
            .args([
                "--port",
                &common::free_port().to_string(),
                "--bind",
                "127.0.0.1",
            ])
            .args(["--save", "", "--appendonly", "no"])
            .args(["--replicaof", "127.0.0.1", &port.to_string()])
            .arg("--dir")
            .arg(dir.path())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("redis-server on PATH (sudo apt-get install redis-server)");
        Self { child, _dir: dir }
    }
}

impl Drop for Replica {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let replica_ms = env_or("BENCH_REPLICA_MS", 1u64);
    let claims_per_round = env_or("BENCH_CLAIMS", 200usize);
    let rounds = env_or("BENCH_ROUNDS", 3usize);
    let primary = RedisServer::start();
    let mut proxies = Vec::new();
    let mut replicas = Vec::new();
    for _ in 0..2 {
        let proxy = Proxy::start(primary.addr()).await;
        proxy.delay(Duration::from_millis(replica_ms));
        replicas.push(Replica::of(proxy.addr().port()));
        proxies.push(proxy);
    }
    let deadline = Instant::now() + Duration::from_secs(20);
    while primary
        .info_field("replication", "connected_slaves")
        .as_deref()
        != Some("2")
    {
        assert!(Instant::now() < deadline, "the replicas did not connect");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let copy = || {
        let store = RedisStore::builder(primary.url())
            .timeout(Duration::from_secs(5))
            .wait_replicas(1)
            .build()
            .unwrap();
        Claims::new(store)
    };
    let copies = [copy(), copy()];
    // warm: connections open, scripts loaded, the replicas in sync
    for copy in &copies {
        while copy
            .claim_once(format!("warm-{}", rand::random::<u64>()), None)
            .await
            .is_err()
        {}
    }
    let waits = || {
        primary
            .info_field("commandstats", "cmdstat_wait")
            .and_then(|v| {
                v.split(['=', ','])
                    .nth(1)
                    .and_then(|n| n.parse::<u64>().ok())
            })
            .unwrap_or(0)
    };
    println!("| round | claims | all acknowledged in | p50 claim | p99 claim | `WAIT`s | failed |");
    println!("| ---: | ---: | ---: | ---: | ---: | ---: | ---: |");
    for round in 1..=rounds {
        let waited = waits();
        let started = Instant::now();
        let tasks: Vec<_> = (0..claims_per_round)
            .map(|i| {
                let claims = copies[i % 2].clone();
                tokio::spawn(async move {
                    let begun = Instant::now();
                    let won = claims
                        .claim_once(format!("coupon-{}", rand::random::<u64>()), None)
                        .await
                        .is_ok_and(|c| c.won());
                    (begun.elapsed(), won)
                })
            })
            .collect();
        let mut took = Vec::with_capacity(tasks.len());
        let mut failed = 0;
        for task in tasks {
            let (elapsed, won) = task.await.unwrap();
            took.push(elapsed);
            failed += usize::from(!won);
        }
        let all = started.elapsed();
        took.sort();
        println!(
            "| {round} | {claims_per_round} | {:.1} ms | {:.1} ms | {:.1} ms | {} | {failed} |",
            all.as_secs_f64() * 1e3,
            percentile(&took, 0.5).as_secs_f64() * 1e3,
            percentile(&took, 0.99).as_secs_f64() * 1e3,
            waits() - waited,
        );
    }
    drop(replicas);
}
