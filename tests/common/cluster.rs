//! A three-master Redis Cluster of real redis-server processes, started once per test binary and
//! shared by its tests (each test uses keys of its own). The processes watch the test process
//! and exit with it.

use std::process::{Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use tempfile::TempDir;
use tollgate::store::RedisStore;

pub struct RedisCluster {
    ports: Vec<u16>,
    _dir: TempDir,
}

static CLUSTER: OnceLock<RedisCluster> = OnceLock::new();

impl RedisCluster {
    /// The cluster of this test binary, started on first use.
    pub fn shared() -> &'static RedisCluster {
        CLUSTER.get_or_init(Self::start)
    }

    fn start() -> Self {
        Self::start_announcing(&Self::free_ports(), None)
    }

    /// Three distinct free ports for the nodes of a cluster.
    pub fn free_ports() -> Vec<u16> {
        let mut ports = Vec::new();
        while ports.len() < 3 {
            let port = super::free_port();
            if !ports.contains(&port) {
                ports.push(port);
            }
        }
        ports
    }

    /// A cluster of its own on `ports` whose nodes tell clients to reach them at `announce`
    /// (one port each, e.g. of a proxy in front of the node) instead of their own port; the
    /// cluster bus stays direct.
    pub fn start_announcing(ports: &[u16], announce: Option<&[u16]>) -> Self {
        let dir = tempfile::tempdir().expect("temp dir for the cluster");
        let ports = ports.to_vec();
        for (i, &port) in ports.iter().enumerate() {
            spawn_node(port, announce.map(|a| a[i]), &dir);
        }
        for &port in &ports {
            wait_for_ping(port);
        }
        let nodes: Vec<String> = ports.iter().map(|p| format!("127.0.0.1:{p}")).collect();
        let status = Command::new("redis-cli")
            .arg("--cluster")
            .arg("create")
            .args(&nodes)
            .args(["--cluster-replicas", "0", "--cluster-yes"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .expect("redis-cli (installed with redis-server) creates the cluster");
        assert!(status.success(), "redis-cli --cluster create failed");
        let deadline = Instant::now() + Duration::from_secs(30);
        for &port in &ports {
            loop {
                let info: String = redis::Client::open(format!("redis://127.0.0.1:{port}/"))
                    .and_then(|c| c.get_connection())
                    .and_then(|mut c| redis::cmd("CLUSTER").arg("INFO").query(&mut c))
                    .unwrap_or_default();
                if info.contains("cluster_state:ok") {
                    break;
                }
                assert!(
                    Instant::now() < deadline,
                    "cluster node {port} never reported cluster_state:ok"
                );
                std::thread::sleep(Duration::from_millis(50));
            }
        }
        Self { ports, _dir: dir }
    }

    pub fn urls(&self) -> Vec<String> {
        self.ports
            .iter()
            .map(|p| format!("redis://127.0.0.1:{p}/"))
            .collect()
    }

    pub fn ports(&self) -> &[u16] {
        &self.ports
    }

    /// A fresh cluster store (a connection belongs to the runtime that made it).
    pub async fn store(&self) -> RedisStore {
        RedisStore::cluster_builder(self.urls())
            .timeout(Duration::from_millis(1000))
            .connect()
            .await
            .expect("cluster store")
    }

    /// The number of keys matching `pattern` on each master.
    pub fn key_counts(&self, pattern: &str) -> Vec<usize> {
        self.ports
            .iter()
            .map(|p| {
                redis::Client::open(format!("redis://127.0.0.1:{p}/"))
                    .and_then(|c| c.get_connection())
                    .and_then(|mut c| redis::cmd("KEYS").arg(pattern).query::<Vec<String>>(&mut c))
                    .expect("KEYS")
                    .len()
            })
            .collect()
    }
}

fn spawn_node(port: u16, announce: Option<u16>, dir: &TempDir) {
    let conf = dir.path().join(format!("nodes-{port}.conf"));
    let node_dir = dir.path().join(format!("node-{port}"));
    std::fs::create_dir_all(&node_dir).expect("node dir");
    // The shell keeps watch: when the test process is gone, the node goes too.
    let script = r#"redis-server "$@" & node=$!; while kill -0 "$WATCH" 2>/dev/null && kill -0 "$node" 2>/dev/null; do sleep 0.5; done; kill -9 "$node" 2>/dev/null"#;
    let mut command = Command::new("sh");
    command
        .args(["-c", script, "sh"])
        .args(["--port", &port.to_string(), "--bind", "127.0.0.1"]);
    if let Some(announce) = announce {
        command
            .args(["--cluster-announce-port", &announce.to_string()])
            .args(["--cluster-announce-bus-port", &(port + 10_000).to_string()]);
    }
    let spawned = command
        .args(["--save", "", "--appendonly", "no"])
        .args(["--cluster-enabled", "yes", "--cluster-node-timeout", "2000"])
        .arg("--cluster-config-file")
        .arg(&conf)
        .arg("--dir")
        .arg(&node_dir)
        .env("WATCH", std::process::id().to_string())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn();
    if let Err(e) = spawned {
        panic!("could not start a cluster node: {e}");
    }
}

fn wait_for_ping(port: u16) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let pong = redis::Client::open(format!("redis://127.0.0.1:{port}/"))
            .and_then(|c| c.get_connection())
            .and_then(|mut c| redis::cmd("PING").query::<String>(&mut c));
        if pong.is_ok() {
            return;
        }
        if Instant::now() > deadline {
            panic!(
                "cluster node on port {port} did not answer: is redis-server installed? \
                 (`sudo apt-get install redis-server`)"
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}
