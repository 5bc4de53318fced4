//! A three-master Redis Cluster of real redis-server processes, started once per test binary and
//! shared by its tests (each test uses keys of its own). The processes watch the test process
//! and exit with it.

use std::net::TcpStream;
use std::process::{Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use tempfile::TempDir;
use tollgate::store::RedisStore;

pub struct RedisCluster {
    ports: Vec<u16>,
    _dir: TempDir,
    /// The nodes (port, pid) killed on drop: only those of
    /// [`start_with_replicas`](Self::start_with_replicas); the other clusters' nodes go with the
    /// test process.
    owned: Vec<(u16, u32)>,
    /// The nodes [`kill_node`](Self::kill_node) killed, with the slots each served then.
    killed: Vec<(u16, Vec<(u16, u16)>)>,
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
            if !clashes(&ports, port) {
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
        Self {
            ports,
            _dir: dir,
            owned: Vec::new(),
            killed: Vec::new(),
        }
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

/// One line of `CLUSTER NODES`: a node as some node sees it.
#[derive(Debug, Clone)]
pub struct ClusterNode {
    pub id: String,
    pub port: u16,
    /// `myself`, `master`, `slave`, `fail?`, `fail`, ...
    pub flags: Vec<String>,
    /// The id of its master, for a replica.
    pub master_id: Option<String>,
    /// The slot ranges it serves (inclusive).
    pub slots: Vec<(u16, u16)>,
    /// `connected` or `disconnected`.
    pub link: String,
}

impl ClusterNode {
    pub fn is_master(&self) -> bool {
        self.flags.iter().any(|f| f == "master")
    }

    pub fn is_replica(&self) -> bool {
        self.flags.iter().any(|f| f == "slave" || f == "replica")
    }

    /// Flagged `fail` or `fail?` (or without address).
    pub fn is_failing(&self) -> bool {
        self.flags
            .iter()
            .any(|f| f == "fail" || f == "fail?" || f == "noaddr")
    }

    pub fn serves(&self, slot: u16) -> bool {
        self.slots.iter().any(|&(a, b)| a <= slot && slot <= b)
    }
}

/// Parses `CLUSTER NODES` output.
pub fn parse_cluster_nodes(text: &str) -> Vec<ClusterNode> {
    text.lines()
        .filter_map(|line| {
            let fields: Vec<&str> = line.split_whitespace().collect();
            if fields.len() < 8 {
                return None;
            }
            // 127.0.0.1:7000@17000[,hostname]
            let port = fields[1]
                .split('@')
                .next()?
                .rsplit(':')
                .next()?
                .parse()
                .ok()?;
            let slots = fields[8..]
                .iter()
                .filter(|s| !s.starts_with('['))
                .filter_map(|s| match s.split_once('-') {
                    Some((a, b)) => Some((a.parse().ok()?, b.parse().ok()?)),
                    None => {
                        let slot = s.parse().ok()?;
                        Some((slot, slot))
                    }
                })
                .collect();
            Some(ClusterNode {
                id: fields[0].to_owned(),
                port,
                flags: fields[2].split(',').map(str::to_owned).collect(),
                master_id: (fields[3] != "-").then(|| fields[3].to_owned()),
                slots,
                link: fields[7].to_owned(),
            })
        })
        .collect()
}

/// The hash slot of `key` (CRC16/XMODEM of the key or its hash tag, mod 16384), as Redis
/// Cluster computes it.
pub fn key_slot(key: &str) -> u16 {
    let bytes = key.as_bytes();
    let hashed = bytes
        .iter()
        .position(|&b| b == b'{')
        .and_then(|open| {
            let rest = &bytes[open + 1..];
            let len = rest.iter().position(|&b| b == b'}')?;
            (len > 0).then(|| &rest[..len])
        })
        .unwrap_or(bytes);
    let mut crc: u16 = 0;
    for &byte in hashed {
        crc ^= u16::from(byte) << 8;
        for _ in 0..8 {
            crc = if crc & 0x8000 != 0 {
                (crc << 1) ^ 0x1021
            } else {
                crc << 1
            };
        }
    }
    crc % 16_384
}

/// A synchronous connection to the node on `port`, every call bounded by 1 s.
fn node_conn(port: u16) -> redis::RedisResult<redis::Connection> {
    let conn = redis::Client::open(format!("redis://127.0.0.1:{port}/"))?
        .get_connection_with_timeout(Duration::from_secs(1))?;
    conn.set_read_timeout(Some(Duration::from_secs(1)))?;
    conn.set_write_timeout(Some(Duration::from_secs(1)))?;
    Ok(conn)
}

fn node_query<T: redis::FromRedisValue>(port: u16, cmd: &redis::Cmd) -> Result<T, String> {
    node_conn(port)
        .and_then(|mut conn| cmd.query(&mut conn))
        .map_err(|e| e.to_string())
}

impl RedisCluster {
    /// A cluster of its own (not shared): three masters with one replica each, six nodes made
    /// by `redis-cli --cluster create ... --cluster-replicas 1`. Returns once every node reports
    /// `cluster_state:ok`, sees three masters serving all 16384 slots and a replica of each, and
    /// each master has its replica online. Blocking (run it with `spawn_blocking`). The nodes are
    /// killed on drop, and watch the test process as the other clusters' do. [`ports`](Self::ports)
    /// and [`urls`](Self::urls) name all six nodes.
    ///
    /// Once a master is killed and its replica took over, that shard has no replica left.
    pub fn start_with_replicas() -> Self {
        Self::start_with_replicas_per_master(1)
    }

    /// Like [`start_with_replicas`](Self::start_with_replicas), with `replicas` replicas per
    /// master (`3 * (replicas + 1)` nodes): with two, a shard whose master was killed still has
    /// a replica after the takeover (the other replica follows the promoted one).
    pub fn start_with_replicas_per_master(replicas: usize) -> Self {
        assert!(
            replicas >= 1,
            "a cluster with replicas needs at least one per master"
        );
        super::require_redis_server();
        let dir = tempfile::tempdir().expect("temp dir for the cluster");
        let mut ports = Vec::new();
        while ports.len() < 3 * (replicas + 1) {
            let port = super::free_port();
            if !clashes(&ports, port) {
                ports.push(port);
            }
        }
        for &port in &ports {
            spawn_node(port, None, &dir);
        }
        for &port in &ports {
            wait_for_ping(port);
        }
        let owned = ports
            .iter()
            .map(|&port| {
                let info: String = node_query(port, redis::cmd("INFO").arg("server"))
                    .unwrap_or_else(|e| panic!("INFO server of node {port}: {e}"));
                let pid = info
                    .lines()
                    .find_map(|l| l.strip_prefix("process_id:"))
                    .and_then(|p| p.trim().parse().ok())
                    .unwrap_or_else(|| panic!("node {port} names no process_id"));
                (port, pid)
            })
            .collect();
        // from here on a panic kills the nodes (drop)
        let cluster = Self {
            ports,
            _dir: dir,
            owned,
            killed: Vec::new(),
        };
        let per_master = replicas.to_string();
        let nodes: Vec<String> = cluster
            .ports
            .iter()
            .map(|p| format!("127.0.0.1:{p}"))
            .collect();
        let created = Command::new("redis-cli")
            .arg("--cluster")
            .arg("create")
            .args(&nodes)
            .args(["--cluster-replicas", &per_master, "--cluster-yes"])
            .stdin(Stdio::null())
            .output()
            .expect("redis-cli (installed with redis-server) creates the cluster");
        assert!(
            created.status.success(),
            "redis-cli --cluster create --cluster-replicas {replicas} failed: {}{}",
            String::from_utf8_lossy(&created.stdout),
            String::from_utf8_lossy(&created.stderr)
        );
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let problem = cluster.replicated_problem(replicas);
            let Some(problem) = problem else { break };
            assert!(
                Instant::now() < deadline,
                "the cluster with replicas was not ready within 30 s: {problem}"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
        cluster.wait_for_acknowledging_replicas(replicas, deadline);
        cluster
    }

    /// Waits until every master's replicas acknowledge a write: "online" in a master's INFO
    /// comes before a replica has loaded what it was sent and acknowledges anything, and a
    /// durable write before then would be refused.
    fn wait_for_acknowledging_replicas(&self, per_master: usize, deadline: Instant) {
        for master in self.masters() {
            let key = (0..)
                .map(|i| format!("probe-{i}"))
                .find(|k| self.master_of_slot(key_slot(k)) == Some(master))
                .expect("some key lives on every master");
            let mut conn = redis::Client::open(format!("redis://127.0.0.1:{master}/"))
                .and_then(|c| c.get_connection())
                .expect("a connection to the master");
            loop {
                let _: () = redis::cmd("SET").arg(&key).arg(1).query(&mut conn).unwrap();
                let acked: usize = redis::cmd("WAIT")
                    .arg(per_master)
                    .arg(100)
                    .query(&mut conn)
                    .unwrap();
                if acked == per_master {
                    break;
                }
                assert!(
                    Instant::now() < deadline,
                    "the replicas of master {master} did not acknowledge a write in time"
                );
            }
        }
    }

    /// What keeps a cluster with `per_master` replicas per master from being ready, or `None`
    /// once it is.
    fn replicated_problem(&self, per_master: usize) -> Option<String> {
        for &port in &self.ports {
            let info: String = match node_query(port, redis::cmd("CLUSTER").arg("INFO")) {
                Ok(info) => info,
                Err(e) => return Some(format!("node {port}: CLUSTER INFO: {e}")),
            };
            if !info.contains("cluster_state:ok") {
                return Some(format!("node {port} does not report cluster_state:ok"));
            }
            let text: String = match node_query(port, redis::cmd("CLUSTER").arg("NODES")) {
                Ok(text) => text,
                Err(e) => return Some(format!("node {port}: CLUSTER NODES: {e}")),
            };
            let nodes = parse_cluster_nodes(&text);
            let masters: Vec<&ClusterNode> = nodes
                .iter()
                .filter(|n| n.is_master() && !n.is_failing() && !n.slots.is_empty())
                .collect();
            let served: u32 = masters
                .iter()
                .flat_map(|m| m.slots.iter())
                .map(|&(a, b)| u32::from(b - a) + 1)
                .sum();
            if masters.len() != 3 || served != 16_384 {
                return Some(format!(
                    "node {port} sees {} masters serving {served} slots:\n{text}",
                    masters.len()
                ));
            }
            for master in &masters {
                let replicas = nodes
                    .iter()
                    .filter(|n| {
                        n.is_replica()
                            && !n.is_failing()
                            && n.link == "connected"
                            && n.master_id.as_deref() == Some(master.id.as_str())
                    })
                    .count();
                if replicas != per_master {
                    return Some(format!(
                        "node {port} sees {replicas} connected replicas of master {}:\n{text}",
                        master.port
                    ));
                }
            }
            let replication: String = match node_query(port, redis::cmd("INFO").arg("replication"))
            {
                Ok(info) => info,
                Err(e) => return Some(format!("node {port}: INFO replication: {e}")),
            };
            let me = nodes.iter().find(|n| n.flags.iter().any(|f| f == "myself"));
            let ready = match me {
                Some(me) if me.is_master() => {
                    replication.contains(&format!("connected_slaves:{per_master}"))
                        && replication.matches("state=online").count() == per_master
                }
                Some(_) => replication.contains("master_link_status:up"),
                None => false,
            };
            if !ready {
                return Some(format!(
                    "node {port}: replication not online yet:\n{replication}"
                ));
            }
        }
        None
    }

    /// The cluster as the first live node that answers sees it.
    pub fn cluster_nodes(&self) -> Vec<ClusterNode> {
        for &port in &self.ports {
            if self.is_killed(port) {
                continue;
            }
            if let Ok(text) = node_query::<String>(port, redis::cmd("CLUSTER").arg("NODES")) {
                return parse_cluster_nodes(&text);
            }
        }
        Vec::new()
    }

    /// The ports of the masters that serve slots and are not failing, as a live node sees them.
    pub fn masters(&self) -> Vec<u16> {
        let mut masters: Vec<u16> = self
            .cluster_nodes()
            .iter()
            .filter(|n| n.is_master() && !n.is_failing() && !n.slots.is_empty())
            .map(|n| n.port)
            .collect();
        masters.sort_unstable();
        masters
    }

    /// The master that serves `slot`, as a live node sees it.
    pub fn master_of_slot(&self, slot: u16) -> Option<u16> {
        self.cluster_nodes()
            .iter()
            .find(|n| n.is_master() && n.serves(slot))
            .map(|n| n.port)
    }

    /// The replica of the master on `master`, as a live node sees it.
    pub fn replica_of(&self, master: u16) -> Option<u16> {
        let nodes = self.cluster_nodes();
        let id = nodes.iter().find(|n| n.port == master)?.id.clone();
        nodes
            .iter()
            .find(|n| n.is_replica() && n.master_id.as_deref() == Some(id.as_str()))
            .map(|n| n.port)
    }

    pub fn is_killed(&self, port: u16) -> bool {
        self.killed.iter().any(|(p, _)| *p == port)
    }

    /// Kills the node on `port` (SIGKILL; only nodes of
    /// [`start_with_replicas`](Self::start_with_replicas)) and waits until its port is closed;
    /// returns when that was. [`wait_for_takeover`](Self::wait_for_takeover) then waits for the
    /// slots it served.
    pub fn kill_node(&mut self, port: u16) -> Instant {
        let &(_, pid) = self
            .owned
            .iter()
            .find(|(p, _)| *p == port)
            .unwrap_or_else(|| panic!("node {port} is not a node this cluster may kill"));
        let slots = self
            .cluster_nodes()
            .into_iter()
            .find(|n| n.port == port)
            .map(|n| n.slots)
            .unwrap_or_default();
        let _ = Command::new("kill")
            .args(["-9", &pid.to_string()])
            .stderr(Stdio::null())
            .status();
        let deadline = Instant::now() + Duration::from_secs(5);
        while TcpStream::connect(("127.0.0.1", port)).is_ok() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(10));
        }
        self.killed.push((port, slots));
        Instant::now()
    }

    /// Kills the master that serves `key`'s slot; returns its port.
    pub fn kill_master_of(&mut self, key: &str) -> u16 {
        let port = self
            .master_of_slot(key_slot(key))
            .unwrap_or_else(|| panic!("no master serves the slot of {key}"));
        self.kill_node(port);
        port
    }

    /// Polls until every live node reports `cluster_state:ok` and sees every slot the killed
    /// node `killed` served served by another master that is not failing; that master's port
    /// and how long this call waited, or `None` after `timeout`. Blocking.
    pub fn wait_for_takeover(&self, killed: u16, timeout: Duration) -> Option<(u16, Duration)> {
        let slots = self
            .killed
            .iter()
            .find(|(p, _)| *p == killed)
            .map(|(_, slots)| slots.clone())
            .unwrap_or_else(|| panic!("node {killed} was not killed by kill_node"));
        let first = slots.first()?.0;
        let started = Instant::now();
        while started.elapsed() < timeout {
            let mut taken_by = None;
            let all = self
                .ports
                .iter()
                .filter(|p| !self.is_killed(**p))
                .all(|&port| {
                    let ok = node_query::<String>(port, redis::cmd("CLUSTER").arg("INFO"))
                        .is_ok_and(|info| info.contains("cluster_state:ok"));
                    let nodes = node_query::<String>(port, redis::cmd("CLUSTER").arg("NODES"))
                        .map(|text| parse_cluster_nodes(&text))
                        .unwrap_or_default();
                    let owner = nodes.iter().find(|n| {
                        n.port != killed
                            && n.is_master()
                            && !n.is_failing()
                            && slots.iter().all(|&(a, b)| n.serves(a) && n.serves(b))
                            && n.serves(first)
                    });
                    if let Some(owner) = owner {
                        taken_by = Some(owner.port);
                    }
                    ok && owner.is_some()
                });
            if all && let Some(port) = taken_by {
                return Some((port, started.elapsed()));
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        None
    }
}

impl Drop for RedisCluster {
    fn drop(&mut self) {
        for &(port, pid) in &self.owned {
            if !self.is_killed(port) {
                let _ = Command::new("kill")
                    .args(["-9", &pid.to_string()])
                    .stderr(Stdio::null())
                    .status();
            }
        }
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

/// Whether `port`, or its bus port, is among `taken` or their bus ports.
fn clashes(taken: &[u16], port: u16) -> bool {
    taken
        .iter()
        .any(|&t| t == port || t.abs_diff(port) == 10_000)
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
