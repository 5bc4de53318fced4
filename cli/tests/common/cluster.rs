//! A three-master Redis Cluster of the test's own: redis-server processes on free ports
//! (`--save '' --appendonly no`), joined by `redis-cli --cluster create`, killed on drop.

use std::net::TcpListener;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use tempfile::TempDir;

pub(crate) struct RedisCluster {
    ports: Vec<u16>,
    nodes: Vec<Child>,
    _dir: TempDir,
}

/// A port free now with its cluster bus port (port + 10000), and clear of `taken`'s.
fn free_port(taken: &[u16]) -> u16 {
    loop {
        let port = super::free_port();
        let clashes = taken
            .iter()
            .any(|&t| t == port || t.abs_diff(port) == 10_000);
        if !clashes && TcpListener::bind(("127.0.0.1", port + 10_000)).is_ok() {
            return port;
        }
    }
}

fn redis_cli(port: u16, args: &[&str]) -> String {
    Command::new("redis-cli")
        .args(["-h", "127.0.0.1", "-p", &port.to_string()])
        .args(args)
        .stderr(Stdio::null())
        .output()
        .map(|out| String::from_utf8_lossy(&out.stdout).into_owned())
        .unwrap_or_default()
}

fn wait_until(what: &str, mut ok: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while !ok() {
        assert!(Instant::now() < deadline, "{what}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

impl RedisCluster {
    pub(crate) fn start() -> Self {
        let dir = tempfile::tempdir().expect("temp dir for the cluster");
        let mut ports = Vec::new();
        while ports.len() < 3 {
            let port = free_port(&ports);
            ports.push(port);
        }
        let mut nodes = Vec::new();
        for &port in &ports {
            let node_dir = dir.path().join(format!("node-{port}"));
            std::fs::create_dir_all(&node_dir).expect("node dir");
            let node = Command::new("redis-server")
                .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
                .args(["--save", "", "--appendonly", "no"])
                .args(["--cluster-enabled", "yes", "--cluster-node-timeout", "2000"])
                .arg("--cluster-config-file")
                .arg(node_dir.join("nodes.conf"))
                .arg("--dir")
                .arg(&node_dir)
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .unwrap_or_else(|e| {
                    panic!(
                        "could not start redis-server ({e}): install it, e.g. \
                         `sudo apt-get install redis-server`"
                    )
                });
            nodes.push(node);
        }
        let cluster = Self {
            ports,
            nodes,
            _dir: dir,
        };
        for &port in &cluster.ports {
            wait_until(&format!("node {port} never answered PING"), || {
                redis_cli(port, &["ping"]).trim() == "PONG"
            });
        }
        let addrs: Vec<String> = cluster
            .ports
            .iter()
            .map(|p| format!("127.0.0.1:{p}"))
            .collect();
        let status = Command::new("redis-cli")
            .arg("--cluster")
            .arg("create")
            .args(&addrs)
            .args(["--cluster-replicas", "0", "--cluster-yes"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .expect("redis-cli (installed with redis-server) creates the cluster");
        assert!(status.success(), "redis-cli --cluster create failed");
        for &port in &cluster.ports {
            wait_until(
                &format!("node {port} never reported cluster_state:ok"),
                || redis_cli(port, &["cluster", "info"]).contains("cluster_state:ok"),
            );
        }
        cluster
    }

    /// The number of keys on each node.
    pub(crate) fn key_counts(&self) -> Vec<usize> {
        self.ports
            .iter()
            .map(|&port| redis_cli(port, &["dbsize"]).trim().parse().unwrap_or(0))
            .collect()
    }

    pub(crate) fn urls(&self) -> Vec<String> {
        self.ports
            .iter()
            .map(|p| format!("redis://127.0.0.1:{p}/"))
            .collect()
    }
}

impl Drop for RedisCluster {
    fn drop(&mut self) {
        for node in &mut self.nodes {
            let _ = node.kill();
            let _ = node.wait();
        }
    }
}
