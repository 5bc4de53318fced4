//! Test harness: real `redis-server` processes on free ports, started, killed and restarted by the
//! tests themselves. Never the shared server on 6379.
#![allow(dead_code, unreachable_pub, clippy::unwrap_used, clippy::expect_used)]

pub mod cluster;
pub mod postgres;
pub mod proxy;
pub mod sentinel;

use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use tempfile::TempDir;
use tollgate::store::RedisStore;

const INSTALL_HINT: &str = "redis-server was not found on PATH. The integration tests start their own \
redis-server processes; install it first, e.g. `sudo apt-get install redis-server` (Debian/Ubuntu) \
or `brew install redis` (macOS).";

/// Panics with the install hint when `redis-server` is not on PATH: for harnesses that start it
/// through a shell, where a missing binary would only show as a server that never answers.
pub fn require_redis_server() {
    let version = Command::new("redis-server")
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status();
    match version {
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => panic!("{INSTALL_HINT}"),
        Err(e) => panic!("could not run redis-server: {e}"),
    }
}

/// A redis-server process owned by a test; killed on drop.
pub struct RedisServer {
    port: u16,
    dir: TempDir,
    child: Option<Child>,
    /// Whether the server keeps an append-only file ([`start_with_aof`](Self::start_with_aof)).
    aof: bool,
}

impl RedisServer {
    /// Starts a fresh server on a free port and waits until it answers PING. It keeps nothing on
    /// disk: a [`restart`](Self::restart) brings it back empty.
    pub fn start() -> Self {
        Self::start_as(false)
    }

    /// Like [`start`](Self::start), with an append-only file in the server's own temp dir
    /// (`--appendonly yes --appendfsync always`: every write is on disk before it is answered),
    /// so that [`kill`](Self::kill) (SIGKILL) and [`restart`](Self::restart), which keep the dir,
    /// the port and this option, bring back every write that was answered.
    pub fn start_with_aof() -> Self {
        Self::start_as(true)
    }

    fn start_as(aof: bool) -> Self {
        let dir = tempfile::tempdir().expect("temp dir for redis-server");
        let port = free_port();
        let mut server = Self {
            port,
            dir,
            child: None,
            aof,
        };
        server.spawn();
        server
    }

    fn spawn(&mut self) {
        let persistence: &[&str] = if self.aof {
            &["--appendonly", "yes", "--appendfsync", "always"]
        } else {
            &["--appendonly", "no"]
        };
        let child = Command::new("redis-server")
            .args(["--port", &self.port.to_string()])
            .args(["--bind", "127.0.0.1", "--save", ""])
            .args(persistence)
            .arg("--dir")
            .arg(self.dir.path())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn();
        let child = match child {
            Ok(child) => child,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => panic!("{INSTALL_HINT}"),
            Err(e) => panic!("could not start redis-server: {e}"),
        };
        self.child = Some(child);
        self.wait_ready();
    }

    fn wait_ready(&mut self) {
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if let Some(Ok(Some(status))) = self.child.as_mut().map(Child::try_wait) {
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

    pub fn port(&self) -> u16 {
        self.port
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/", self.port)
    }

    pub fn addr(&self) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], self.port))
    }

    /// A store on this server with a short timeout, as the tests want failures fast.
    pub fn store(&self) -> RedisStore {
        RedisStore::builder(self.url())
            .timeout(Duration::from_millis(500))
            .build()
            .expect("redis store")
    }

    /// A plain synchronous connection for inspecting the server.
    pub fn conn(&self) -> redis::Connection {
        redis::Client::open(self.url())
            .and_then(|c| c.get_connection())
            .expect("connection to test redis-server")
    }

    /// Kills the server (SIGKILL) and waits until its port is closed.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
        let deadline = Instant::now() + Duration::from_secs(5);
        while TcpStream::connect(self.addr()).is_ok() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// Starts the server again on the same port and dir: empty after [`start`](Self::start), with
    /// its data back (read from the append-only file) after [`start_with_aof`](Self::start_with_aof).
    pub fn restart(&mut self) {
        self.kill();
        self.spawn();
    }

    /// Freezes the server (SIGSTOP): connections stay open, nothing answers.
    pub fn pause(&self) {
        self.signal("-STOP");
    }

    /// Thaws a paused server (SIGCONT).
    pub fn resume(&self) {
        self.signal("-CONT");
    }

    fn signal(&self, sig: &str) {
        if let Some(child) = &self.child {
            let _ = Command::new("kill")
                .args([sig, &child.id().to_string()])
                .status();
        }
    }

    pub fn dir(&self) -> PathBuf {
        self.dir.path().to_owned()
    }

    /// `INFO` field `name` of section `section`, e.g. ("memory", "used_memory").
    pub fn info_field(&self, section: &str, name: &str) -> Option<String> {
        let info: String = redis::cmd("INFO")
            .arg(section)
            .query(&mut self.conn())
            .ok()?;
        info.lines()
            .find_map(|l| l.strip_prefix(&format!("{name}:")).map(str::to_owned))
    }

    /// Calls of `command` (as `INFO commandstats` names it: `set`, `function|load`; those of
    /// scripts and functions too) the server has served since its statistics were last reset.
    #[allow(dead_code)]
    pub fn calls(&self, command: &str) -> u64 {
        self.info_field("commandstats", &format!("cmdstat_{command}"))
            .map_or(0, |stats| {
                stats
                    .split(',')
                    .find_map(|kv| kv.strip_prefix("calls="))
                    .expect("calls= in commandstats")
                    .parse()
                    .unwrap()
            })
    }

    /// The calls of Lua the server has served since its statistics were last reset: of
    /// functions (`FCALL`, how rate checks go) and of scripts (`EVALSHA`, `EVAL`).
    #[allow(dead_code)]
    pub fn lua_calls(&self) -> u64 {
        ["fcall", "evalsha", "eval"]
            .iter()
            .map(|command| self.calls(command))
            .sum()
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        if let Some(child) = &self.child {
            // a paused server ignores SIGKILL until continued on some kernels; be sure
            let _ = Command::new("kill")
                .args(["-CONT", &child.id().to_string()])
                .status();
        }
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// A port that is free now, as is the port 10,000 above it (a Cluster node's bus port). Both
/// are drawn below the kernel's ephemeral range (32768 and up on Linux), where no outgoing
/// connection takes a port between this check and the server's start.
pub fn free_port() -> u16 {
    loop {
        let candidate: u16 = rand::random_range(10_000..22_000);
        if TcpListener::bind(("127.0.0.1", candidate)).is_ok()
            && TcpListener::bind(("127.0.0.1", candidate + 10_000)).is_ok()
        {
            return candidate;
        }
    }
}

/// `n` parallel claims of coupon `code`, spread over `copies`: how many won (one, when the
/// store is shared).
pub async fn redemptions_won(copies: &[RedisStore], code: &str, n: usize) -> u32 {
    let redemptions: Vec<_> = (0..n)
        .map(|i| {
            let claims = tollgate::claim::Claims::new(copies[i % copies.len()].clone());
            let code = code.to_owned();
            tokio::spawn(async move { claims.claim_once(&code, None).await.unwrap().won() })
        })
        .collect();
    let mut won = 0;
    for redemption in redemptions {
        won += u32::from(redemption.await.unwrap());
    }
    won
}

/// Runs the property `test` on `cases` values of `strategy`; no regression files are written.
pub fn check<S: proptest::strategy::Strategy>(
    cases: u32,
    strategy: S,
    test: impl Fn(S::Value) -> Result<(), proptest::test_runner::TestCaseError>,
) {
    let mut runner = proptest::test_runner::TestRunner::new(proptest::test_runner::Config {
        cases,
        failure_persistence: None,
        ..proptest::test_runner::Config::default()
    });
    if let Err(error) = runner.run(&strategy, test) {
        panic!("{error}");
    }
}

/// Asserts that `body` is the problem details (RFC 9457) of a rate-limit denial: the draft's
/// `quota-exceeded` type, status 429, and the names of the violated limits.
#[allow(dead_code)]
pub fn assert_quota_problem(body: impl AsRef<[u8]>, violated: &[&str]) {
    let problem: serde_json::Value = serde_json::from_slice(body.as_ref()).expect("a JSON problem");
    assert_eq!(
        problem["type"],
        "https://iana.org/assignments/http-problem-types#quota-exceeded"
    );
    assert_eq!(problem["title"], "Too Many Requests");
    assert_eq!(problem["status"], 429);
    assert_eq!(problem["detail"], "rate limit exceeded");
    assert_eq!(problem["violated-policies"], serde_json::json!(violated));
}

/// A deadline that a store call made now meets: a second from now.
pub fn soon() -> tokio::time::Instant {
    tokio::time::Instant::now() + Duration::from_secs(1)
}

/// Everything the Redis node at `addr` runs from now on, as `MONITOR` reports it (one line per
/// command, commands that scripts call included), gathered in the background.
pub async fn monitor(addr: SocketAddr) -> std::sync::Arc<std::sync::Mutex<String>> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut conn = tokio::net::TcpStream::connect(addr).await.unwrap();
    conn.write_all(b"MONITOR\r\n").await.unwrap();
    let seen = std::sync::Arc::new(std::sync::Mutex::new(String::new()));
    let sink = seen.clone();
    tokio::spawn(async move {
        let mut buf = vec![0u8; 16 * 1024];
        while let Ok(n @ 1..) = conn.read(&mut buf).await {
            sink.lock()
                .unwrap()
                .push_str(&String::from_utf8_lossy(&buf[..n]));
        }
    });
    // the `+OK`: from here on, every command is seen
    let deadline = Instant::now() + Duration::from_secs(2);
    while !seen.lock().unwrap().starts_with("+OK") {
        assert!(Instant::now() < deadline, "MONITOR did not start");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    seen
}

/// Polls `ready` every 2 ms until it holds — something the test waits for, such as a handler
/// entered or a write arrived — and fails the test, naming `what`, if it does not within 10 s.
pub async fn wait_for(what: &str, mut ready: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !ready() {
        assert!(Instant::now() < deadline, "setup: {what}, not within 10 s");
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}
