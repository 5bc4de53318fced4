//! A primary behind Redis Sentinel, of real processes: a primary, replicas whose replication
//! links run through a [`Proxy`] the test controls, and three sentinels that monitor the primary
//! at its real port (clients asking them are sent to the primary itself, never through the
//! proxy).
//!
//! [`cut_replication`](SentinelSetup::cut_replication) drops the replication links' connections
//! and refuses new ones: the primary's writes from then on reach no replica, `WAIT` counts 0,
//! and a write is really lost when the primary is killed and a replica promoted.
//!
//! [`start`](SentinelSetup::start) starts two replicas: after a failover one of them is the
//! primary, and the other (re-pointed at it by the sentinels, directly) is the replica that
//! acknowledges `WAIT 1`. With a single replica the promoted primary would have none, and every
//! durable write (`wait_replicas(1)`) would fail from the failover on.
//!
//! Every process (servers and sentinels) runs under a shell that watches the test process, so
//! that none outlives it, and is killed when the setup is dropped.
//!
//! Why the failover timeout is [`FAILOVER_TIMEOUT_MS`] and not a few seconds: a sentinel "fixes"
//! a replica that replicates from another address than the master's (`+fix-slave-config`) once
//! the replica's configuration is older than the failover timeout — with 4000 ms it re-pointed
//! the replica straight at the primary about 4 s after the sentinels found it, and the proxy (so
//! `cut_replication`) was bypassed from then on. The failover timeout bounds neither the
//! detection (`down-after-milliseconds`) nor a failover that goes well.

use std::io::{BufRead, BufReader};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use redis::FromRedisValue;
use tempfile::TempDir;

use super::proxy::Proxy;

/// `sentinel down-after-milliseconds`: how long the primary may not answer before a sentinel
/// thinks it down.
pub const DOWN_AFTER_MS: u64 = 1000;

/// `sentinel failover-timeout` (see the module docs for why it is long).
pub const FAILOVER_TIMEOUT_MS: u64 = 60_000;

/// How long the setup waits for any one thing before it panics.
const SETUP_BOUND: Duration = Duration::from_secs(20);

/// The shell that runs a redis-server and keeps watch: it prints the server's pid, and when the
/// test process (`$WATCH`) is gone, kills the server.
const WATCH_SCRIPT: &str = r#"redis-server "$@" >/dev/null 2>&1 & node=$!; echo "$node"; while kill -0 "$WATCH" 2>/dev/null && kill -0 "$node" 2>/dev/null; do sleep 0.5; done; kill -9 "$node" 2>/dev/null"#;

/// A redis-server process (a server or a sentinel) under a watching shell; killed on drop.
pub(crate) struct Watched {
    port: u16,
    pid: u32,
    shell: Option<Child>,
    log: PathBuf,
}

impl Watched {
    /// Starts `redis-server <args>` (which must make it listen on `port` and log to `log`).
    pub(crate) fn spawn(port: u16, args: &[String], log: &Path) -> Self {
        super::require_redis_server();
        let mut shell = Command::new("sh")
            .args(["-c", WATCH_SCRIPT, "sh"])
            .args(args)
            .env("WATCH", std::process::id().to_string())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("could not start sh to run redis-server: {e}"));
        let mut line = String::new();
        BufReader::new(shell.stdout.take().expect("the shell's stdout"))
            .read_line(&mut line)
            .expect("the shell names the redis-server pid");
        let pid = line
            .trim()
            .parse()
            .unwrap_or_else(|_| panic!("the shell printed {line:?}, not a pid"));
        Self {
            port,
            pid,
            shell: Some(shell),
            log: log.to_owned(),
        }
    }

    pub(crate) fn port(&self) -> u16 {
        self.port
    }

    pub(crate) fn addr(&self) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], self.port))
    }

    /// Whether the process was killed by [`kill`](Self::kill).
    pub(crate) fn is_killed(&self) -> bool {
        self.shell.is_none()
    }

    /// Kills the server (SIGKILL) and waits until its port is closed.
    pub(crate) fn kill(&mut self) {
        if let Some(mut shell) = self.shell.take() {
            // the server is the shell's child: its pid cannot be reused while the shell lives
            let _ = Command::new("kill")
                .args(["-9", &self.pid.to_string()])
                .stderr(Stdio::null())
                .status();
            let _ = shell.kill();
            let _ = shell.wait();
            let deadline = Instant::now() + Duration::from_secs(5);
            while TcpStream::connect(self.addr()).is_ok() && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(10));
            }
        }
    }

    /// The last `lines` lines of its log file.
    pub(crate) fn log_tail(&self, lines: usize) -> String {
        let log = std::fs::read_to_string(&self.log).unwrap_or_default();
        let all: Vec<&str> = log.lines().collect();
        all[all.len().saturating_sub(lines)..].join("\n")
    }
}

impl Drop for Watched {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Runs `cmd` on the server or sentinel at `port` (a connection of its own, bounded by 1 s).
pub async fn query<T: FromRedisValue>(port: u16, cmd: &redis::Cmd) -> Result<T, String> {
    let client =
        redis::Client::open(format!("redis://127.0.0.1:{port}/")).map_err(|e| e.to_string())?;
    let attempt = async {
        let mut conn = client.get_multiplexed_async_connection().await?;
        cmd.query_async::<T>(&mut conn).await
    };
    match tokio::time::timeout(Duration::from_secs(1), attempt).await {
        Ok(Ok(value)) => Ok(value),
        Ok(Err(e)) => Err(e.to_string()),
        Err(_) => Err("no answer within 1 s".to_owned()),
    }
}

/// `INFO <section>` of the server at `port`, as `field:value` lines.
pub async fn info(port: u16, section: &str) -> Result<String, String> {
    query(port, redis::cmd("INFO").arg(section)).await
}

/// Field `name` of `INFO` text.
pub fn info_field<'a>(info: &'a str, name: &str) -> Option<&'a str> {
    info.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(':'))
        .map(str::trim)
}

async fn wait_for_ping(port: u16, what: &str) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        if query::<String>(port, &redis::cmd("PING")).await.is_ok() {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{what} on port {port} did not answer PING within 10 s"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A RESP2 flat map (`[field, value, field, value, ...]`) as pairs.
fn pairs(flat: &[String]) -> Vec<(&str, &str)> {
    flat.chunks(2)
        .filter(|c| c.len() == 2)
        .map(|c| (c[0].as_str(), c[1].as_str()))
        .collect()
}

fn field<'a>(flat: &'a [String], name: &str) -> Option<&'a str> {
    pairs(flat)
        .into_iter()
        .find_map(|(k, v)| (k == name).then_some(v))
}

/// What one sentinel says about the master, for waits and messages.
#[derive(Debug, Clone, Default)]
pub struct SentinelView {
    pub port: u16,
    /// `SENTINEL get-master-addr-by-name`: the port of the primary it names.
    pub primary: Option<u16>,
    /// The ports of the replicas it knows, with their flags (`slave`, `s_down,slave`, ...).
    pub replicas: Vec<(u16, String)>,
    /// `num-other-sentinels`.
    pub other_sentinels: usize,
    /// `flags` of the master (`master`, `s_down,o_down,master`, ...).
    pub master_flags: String,
    /// Why the view is incomplete, if a command failed.
    pub error: Option<String>,
}

/// Whether a sentinel's `flags` of a replica say it is up and reachable (`slave`; Valkey may say
/// `replica`).
fn healthy_replica(flags: &str) -> bool {
    flags.split(',').all(|f| f == "slave" || f == "replica")
}

/// A primary, replicas through a proxy, and three sentinels; everything killed on drop.
pub struct SentinelSetup {
    master_name: String,
    // sentinels first: dropped (killed) before the servers they watch
    sentinels: Vec<Watched>,
    replicas: Vec<Watched>,
    primary: Watched,
    proxy: Proxy,
    killed_at: Option<Instant>,
    dir: TempDir,
}

impl SentinelSetup {
    /// [`start_with`](Self::start_with) two replicas.
    pub async fn start(master_name: &str) -> Self {
        Self::start_with(master_name, 2).await
    }

    /// Starts the primary, the proxy in front of it (on the current tokio runtime), `replicas`
    /// replicas (`--replicaof` the proxy) and three sentinels (quorum 2) monitoring the
    /// primary's own port. Returns once the replicas are in sync and every sentinel names the
    /// primary, knows every replica (not down) and the two other sentinels.
    pub async fn start_with(master_name: &str, replicas: usize) -> Self {
        assert!(replicas >= 1, "a sentinel setup needs a replica to promote");
        super::require_redis_server();
        let dir = tempfile::tempdir().expect("temp dir for the sentinel setup");
        let mut used = Vec::new();
        let mut port = || loop {
            let port = super::free_port();
            if !used.contains(&port) {
                used.push(port);
                break port;
            }
        };

        let primary_port = port();
        let primary = spawn_server(dir.path(), "primary", primary_port, None);
        wait_for_ping(primary_port, "the primary").await;
        let proxy = Proxy::start(primary.addr()).await;
        let proxy_port = proxy.addr().port();

        let mut replica_servers = Vec::new();
        for i in 0..replicas {
            let name = format!("replica-{i}");
            let mut replica_port = port();
            while replica_port == proxy_port {
                replica_port = port();
            }
            replica_servers.push(spawn_server(
                dir.path(),
                &name,
                replica_port,
                Some(proxy_port),
            ));
        }
        for replica in &replica_servers {
            wait_for_ping(replica.port(), "a replica").await;
        }
        let mut sentinel_ports = Vec::new();
        while sentinel_ports.len() < 3 {
            let p = port();
            if p != proxy_port {
                sentinel_ports.push(p);
            }
        }

        let mut setup = Self {
            master_name: master_name.to_owned(),
            sentinels: Vec::new(),
            replicas: replica_servers,
            primary,
            proxy,
            killed_at: None,
            dir,
        };
        // in sync before the sentinels start: each finds the replicas in the primary's first INFO
        // (a sentinel that read it earlier would learn of a replica only 10 s later)
        let synced = setup.wait_replicas_in_sync(SETUP_BOUND).await;
        assert!(
            synced.is_some(),
            "setup: the replicas never got in sync through the proxy within {SETUP_BOUND:?}; \
             replica logs:\n{}",
            setup.replica_logs(20)
        );

        for (i, &sentinel_port) in sentinel_ports.iter().enumerate() {
            let sentinel_dir = setup.dir.path().join(format!("sentinel-{i}"));
            std::fs::create_dir_all(&sentinel_dir).expect("sentinel dir");
            let conf = sentinel_dir.join("sentinel.conf");
            let sentinel_log = sentinel_dir.join("sentinel.log");
            // sentinels rewrite their config file: it lives in their own (writable) dir
            std::fs::write(
                &conf,
                format!(
                    "port {sentinel_port}\n\
                     bind 127.0.0.1\n\
                     dir {dir}\n\
                     logfile {log}\n\
                     sentinel monitor {name} 127.0.0.1 {primary_port} 2\n\
                     sentinel down-after-milliseconds {name} {DOWN_AFTER_MS}\n\
                     sentinel failover-timeout {name} {FAILOVER_TIMEOUT_MS}\n",
                    dir = sentinel_dir.display(),
                    log = sentinel_log.display(),
                    name = master_name,
                ),
            )
            .expect("sentinel config");
            let args = vec![conf.display().to_string(), "--sentinel".into()];
            setup
                .sentinels
                .push(Watched::spawn(sentinel_port, &args, &sentinel_log));
        }
        for sentinel in &setup.sentinels {
            wait_for_ping(sentinel.port(), "a sentinel").await;
        }

        let replica_ports = setup.replica_ports();
        let deadline = Instant::now() + SETUP_BOUND;
        loop {
            let views = setup.sentinel_views().await;
            let ready = views.iter().all(|v| {
                v.primary == Some(primary_port)
                    && v.other_sentinels == 2
                    && v.master_flags == "master"
                    && replica_ports.iter().all(|port| {
                        v.replicas
                            .iter()
                            .any(|(p, f)| p == port && healthy_replica(f))
                    })
            });
            if ready {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "setup: within {SETUP_BOUND:?} the sentinels did not all name the primary \
                 {primary_port}, know the replicas {replica_ports:?} and each other: \
                 {views:#?}\n{}",
                setup.sentinel_logs(10)
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        setup
    }

    /// `redis://127.0.0.1:P/` of each sentinel.
    pub fn sentinel_urls(&self) -> Vec<String> {
        self.sentinels
            .iter()
            .map(|s| format!("redis://127.0.0.1:{}/", s.port()))
            .collect()
    }

    pub fn sentinel_ports(&self) -> Vec<u16> {
        self.sentinels.iter().map(Watched::port).collect()
    }

    pub fn master_name(&self) -> &str {
        &self.master_name
    }

    /// The port of the primary the setup started with.
    pub fn primary_port(&self) -> u16 {
        self.primary.port()
    }

    /// The port of the first replica the setup started with.
    pub fn replica_port(&self) -> u16 {
        self.replicas[0].port()
    }

    /// The ports of the replicas the setup started with (one of them is the primary after a
    /// failover).
    pub fn replica_ports(&self) -> Vec<u16> {
        self.replicas.iter().map(Watched::port).collect()
    }

    /// The port of the proxy on the replication links.
    pub fn proxy_port(&self) -> u16 {
        self.proxy.addr().port()
    }

    /// Kills the primary (SIGKILL), waits until its port is closed, and returns when that was.
    /// [`wait_for_promotion`](Self::wait_for_promotion) counts from here.
    pub fn kill_primary(&mut self) -> Instant {
        self.primary.kill();
        let at = Instant::now();
        self.killed_at = Some(at);
        at
    }

    /// Drops every connection of the replication links and refuses new ones, and returns once
    /// every replica sees its link down: from then on the primary's writes reach no replica.
    /// Panics if a replica does not replicate through the proxy (a sentinel re-pointed it).
    pub async fn cut_replication(&self) {
        for port in self.replica_ports() {
            let replication = info(port, "replication")
                .await
                .unwrap_or_else(|e| panic!("INFO replication of the replica {port}: {e}"));
            assert_eq!(
                info_field(&replication, "master_port"),
                Some(self.proxy_port().to_string().as_str()),
                "the replica {port} does not replicate through the proxy (port {}) any more, so \
                 its link cannot be cut: did a sentinel re-point it (+fix-slave-config)? \
                 {replication}\n{}",
                self.proxy_port(),
                self.sentinel_logs(10)
            );
        }
        self.proxy.cut();
        let deadline = Instant::now() + Duration::from_secs(5);
        for port in self.replica_ports() {
            loop {
                let replication = info(port, "replication").await.unwrap_or_default();
                if info_field(&replication, "master_link_status") == Some("down") {
                    break;
                }
                assert!(
                    Instant::now() < deadline,
                    "the replica {port} still reports its link up 5 s after the cut: \
                     {replication}"
                );
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        }
    }

    /// Lets the replication links through again and waits (bounded by 10 s, else panics) until
    /// every replica has caught up with the primary; returns how long that took.
    pub async fn heal_replication(&self) -> Duration {
        self.proxy.heal();
        self.wait_replicas_in_sync(Duration::from_secs(10))
            .await
            .unwrap_or_else(|| {
                panic!(
                    "the replicas did not catch up within 10 s of healing the link; replica \
                     logs:\n{}",
                    self.replica_logs(20)
                )
            })
    }

    /// Waits until every replica's link is up and it has every byte the primary wrote; how
    /// long that took, or `None` after `timeout`.
    pub async fn wait_replicas_in_sync(&self, timeout: Duration) -> Option<Duration> {
        let started = Instant::now();
        'poll: while started.elapsed() < timeout {
            let primary = info(self.primary_port(), "replication")
                .await
                .unwrap_or_default();
            let Some(primary_offset) = info_field(&primary, "master_repl_offset") else {
                tokio::time::sleep(Duration::from_millis(20)).await;
                continue;
            };
            for port in self.replica_ports() {
                let replica = info(port, "replication").await.unwrap_or_default();
                if info_field(&replica, "master_link_status") != Some("up")
                    || info_field(&replica, "slave_repl_offset") != Some(primary_offset)
                {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                    continue 'poll;
                }
            }
            return Some(started.elapsed());
        }
        None
    }

    /// What each sentinel says now.
    pub async fn sentinel_views(&self) -> Vec<SentinelView> {
        let mut views = Vec::new();
        for sentinel in &self.sentinels {
            views.push(self.view_of(sentinel.port()).await);
        }
        views
    }

    async fn view_of(&self, port: u16) -> SentinelView {
        let name = self.master_name.as_str();
        let mut view = SentinelView {
            port,
            ..SentinelView::default()
        };
        match query::<Option<Vec<String>>>(
            port,
            redis::cmd("SENTINEL")
                .arg("get-master-addr-by-name")
                .arg(name),
        )
        .await
        {
            Ok(addr) => view.primary = addr.and_then(|a| a.get(1)?.parse().ok()),
            Err(e) => view.error = Some(format!("get-master-addr-by-name: {e}")),
        }
        match query::<Vec<String>>(port, redis::cmd("SENTINEL").arg("master").arg(name)).await {
            Ok(master) => {
                view.other_sentinels = field(&master, "num-other-sentinels")
                    .and_then(|n| n.parse().ok())
                    .unwrap_or(0);
                view.master_flags = field(&master, "flags").unwrap_or_default().to_owned();
            }
            Err(e) => view.error = Some(format!("SENTINEL master: {e}")),
        }
        match query::<Vec<Vec<String>>>(port, redis::cmd("SENTINEL").arg("replicas").arg(name))
            .await
        {
            Ok(replicas) => {
                view.replicas = replicas
                    .iter()
                    .filter_map(|r| {
                        let port = field(r, "port")?.parse().ok()?;
                        Some((port, field(r, "flags").unwrap_or_default().to_owned()))
                    })
                    .collect();
            }
            Err(e) => view.error = Some(format!("SENTINEL replicas: {e}")),
        }
        view
    }

    /// The primary's port as the first sentinel that answers names it.
    pub async fn current_primary_port(&self) -> Option<u16> {
        for sentinel in &self.sentinels {
            if let Some(port) = self.named_by(sentinel.port()).await {
                return Some(port);
            }
        }
        None
    }

    /// The primary's port as the sentinel on `port` names it.
    async fn named_by(&self, port: u16) -> Option<u16> {
        let addr = query::<Option<Vec<String>>>(
            port,
            redis::cmd("SENTINEL")
                .arg("get-master-addr-by-name")
                .arg(&self.master_name),
        )
        .await
        .ok()??;
        addr.get(1)?.parse().ok()
    }

    /// Polls the sentinels until one names another primary than the one the setup started
    /// with; how long after [`kill_primary`](Self::kill_primary) (or after this call, if the
    /// primary was not killed) that was, or `None` after `timeout`.
    pub async fn wait_for_promotion(&self, timeout: Duration) -> Option<Duration> {
        self.wait_for_new_primary(timeout)
            .await
            .map(|(_, after)| after)
    }

    /// Like [`wait_for_promotion`](Self::wait_for_promotion), with the port of the new primary
    /// that the first sentinel to switch names.
    pub async fn wait_for_new_primary(&self, timeout: Duration) -> Option<(u16, Duration)> {
        let called = Instant::now();
        let since = self.killed_at.unwrap_or(called);
        while called.elapsed() < timeout {
            for sentinel in &self.sentinels {
                if let Some(port) = self.named_by(sentinel.port()).await
                    && port != self.primary_port()
                {
                    return Some((port, since.elapsed()));
                }
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        None
    }

    /// Polls until every sentinel names `port` the primary; how long after
    /// [`kill_primary`](Self::kill_primary) (or this call) that was, or `None` after `timeout`.
    pub async fn wait_for_all_sentinels_to_name(
        &self,
        port: u16,
        timeout: Duration,
    ) -> Option<Duration> {
        let called = Instant::now();
        let since = self.killed_at.unwrap_or(called);
        while called.elapsed() < timeout {
            let mut all = true;
            for sentinel in &self.sentinels {
                all &= self.named_by(sentinel.port()).await == Some(port);
            }
            if all {
                return Some(since.elapsed());
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        None
    }

    /// How many of the replicas the setup started with hold `key` (read directly, not through
    /// the proxy; a replica that does not answer counts as not holding it).
    pub async fn replicas_having(&self, key: &str) -> usize {
        let mut having = 0;
        for port in self.replica_ports() {
            if query::<bool>(port, redis::cmd("EXISTS").arg(key))
                .await
                .unwrap_or(false)
            {
                having += 1;
            }
        }
        having
    }

    /// Whether the first replica holds `key`.
    pub async fn replica_has(&self, key: &str) -> bool {
        query::<bool>(self.replica_port(), redis::cmd("EXISTS").arg(key))
            .await
            .unwrap_or_else(|e| panic!("EXISTS {key} on the replica: {e}"))
    }

    /// Whether `key` exists on the primary the setup started with (while it lives).
    pub async fn primary_has(&self, key: &str) -> bool {
        query::<bool>(self.primary_port(), redis::cmd("EXISTS").arg(key))
            .await
            .unwrap_or_else(|e| panic!("EXISTS {key} on the primary: {e}"))
    }

    /// The keys matching `pattern` on the server at `port`.
    pub async fn keys_on(&self, port: u16, pattern: &str) -> Vec<String> {
        query::<Vec<String>>(port, redis::cmd("KEYS").arg(pattern))
            .await
            .unwrap_or_else(|e| panic!("KEYS {pattern} on port {port}: {e}"))
    }

    /// The last lines of every sentinel's log, for failure messages.
    pub fn sentinel_logs(&self, lines: usize) -> String {
        self.sentinels
            .iter()
            .map(|s| format!("--- sentinel {} ---\n{}", s.port(), s.log_tail(lines)))
            .collect::<Vec<_>>()
            .join("\n")
    }

    /// The last lines of every replica's log.
    pub fn replica_logs(&self, lines: usize) -> String {
        self.replicas
            .iter()
            .map(|r| format!("--- replica {} ---\n{}", r.port(), r.log_tail(lines)))
            .collect::<Vec<_>>()
            .join("\n")
    }
}

/// Starts a redis-server named `name` on `port` with a dir and log file of its own under `root`,
/// a replica of the server on `replica_of` when given.
fn spawn_server(root: &Path, name: &str, port: u16, replica_of: Option<u16>) -> Watched {
    let data = root.join(name);
    std::fs::create_dir_all(&data).expect("server dir");
    let log = data.join("redis.log");
    let mut args: Vec<String> = vec![
        "--port".into(),
        port.to_string(),
        "--bind".into(),
        "127.0.0.1".into(),
        "--save".into(),
        String::new(),
        "--appendonly".into(),
        "no".into(),
        "--dir".into(),
        data.display().to_string(),
        "--logfile".into(),
        log.display().to_string(),
    ];
    if let Some(primary) = replica_of {
        args.extend([
            "--replicaof".into(),
            "127.0.0.1".into(),
            primary.to_string(),
        ]);
    }
    Watched::spawn(port, &args, &log)
}
