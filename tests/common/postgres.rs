//! PostgreSQL servers started by the tests themselves, on free ports, in temp dirs: never the
//! machine's own server on 5432.
//!
//! initdb costs about two seconds, so a test binary shares one server ([`shared`]), each test
//! in a schema of its own ([`store`]); outage tests start their own ([`PgServer::start`]) to
//! stop and restart it.

use std::io::Write;
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use tollgate::store::PgStore;

use super::free_port;

const INSTALL_HINT: &str = "PostgreSQL was not found (no `pg_config` on PATH, or no initdb/postgres \
in its --bindir). The PostgreSQL tests start their own server; install it first, e.g. \
`sudo apt-get install postgresql` (Debian/Ubuntu) or `brew install postgresql` (macOS).";

/// The server's binaries: `pg_config --bindir`.
fn bindir() -> PathBuf {
    let output = match Command::new("pg_config").arg("--bindir").output() {
        Ok(output) if output.status.success() => output,
        Ok(_) => panic!("{INSTALL_HINT}"),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => panic!("{INSTALL_HINT}"),
        Err(e) => panic!("could not run pg_config: {e}"),
    };
    let dir = PathBuf::from(String::from_utf8_lossy(&output.stdout).trim());
    if !dir.join("initdb").exists() || !dir.join("postgres").exists() {
        panic!("{INSTALL_HINT}");
    }
    dir
}

/// Whether this process runs as root, where initdb and postgres refuse to run: they run as
/// the `postgres` user then.
fn is_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
        .unwrap_or(false)
}

/// `program` with `args`, as the `postgres` user when we are root.
fn server_command(program: &Path, args: &[&str]) -> Command {
    if is_root() {
        let mut cmd = Command::new("runuser");
        cmd.args(["-u", "postgres", "--"]).arg(program).args(args);
        cmd
    } else {
        let mut cmd = Command::new(program);
        cmd.args(args);
        cmd
    }
}

/// A PostgreSQL server owned by a test; stopped on drop, and its dir removed. A watchdog
/// process does the same when the test binary exits without dropping it (the shared server
/// is a static).
pub struct PgServer {
    port: u16,
    /// Holds the data dir (`data/`, also the socket dir).
    dir: PathBuf,
    bindir: PathBuf,
    child: Option<Child>,
    /// Its stdin closes when this process ends: the watchdog then stops the server and
    /// removes `dir`.
    watchdog: Option<(Child, ChildStdin)>,
}

impl PgServer {
    /// initdb in a fresh temp dir, then the server on a free port; waits until it accepts
    /// connections.
    pub fn start() -> Self {
        let bindir = bindir();
        let dir = tempfile::Builder::new()
            .prefix("tollgate-pg-")
            .tempdir()
            .expect("temp dir for postgres")
            .keep();
        let data = dir.join("data");
        std::fs::create_dir(&data).expect("data dir");
        if is_root() {
            // the server runs as postgres: it must reach and own its dir
            let status = Command::new("chmod").arg("755").arg(&dir).status();
            assert!(status.is_ok_and(|s| s.success()), "chmod the temp dir");
            let status = Command::new("chown")
                .args(["-R", "postgres:"])
                .arg(&data)
                .status();
            assert!(
                status.is_ok_and(|s| s.success()),
                "chown the data dir to postgres"
            );
        }
        let initdb = server_command(
            &bindir.join("initdb"),
            &[
                "-D",
                data.to_str().expect("utf-8 path"),
                "-A",
                "trust",
                "-U",
                "postgres",
                "--no-sync",
            ],
        )
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .output();
        match initdb {
            Ok(out) if out.status.success() => {}
            Ok(out) => panic!("initdb failed: {}", String::from_utf8_lossy(&out.stderr)),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => panic!("{INSTALL_HINT}"),
            Err(e) => panic!("could not run initdb: {e}"),
        }
        let mut server = Self {
            port: free_port(),
            dir,
            bindir,
            child: None,
            watchdog: None,
        };
        server.watchdog = Some(server.spawn_watchdog());
        server.spawn();
        server
    }

    fn data(&self) -> PathBuf {
        self.dir.join("data")
    }

    /// A shell that waits for its stdin to close, then stops the server and removes the dir.
    fn spawn_watchdog(&self) -> (Child, ChildStdin) {
        let script = r#"read _ignored; pid=$(head -n 1 "$1/data/postmaster.pid" 2>/dev/null); if [ -n "$pid" ]; then kill -QUIT "$pid" 2>/dev/null; for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done; fi; rm -rf "$1""#;
        let mut child = Command::new("sh")
            .args(["-c", script, "watchdog"])
            .arg(&self.dir)
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn the postgres watchdog");
        let stdin = child.stdin.take().expect("watchdog stdin");
        (child, stdin)
    }

    fn spawn(&mut self) {
        let data = self.data();
        let data = data.to_str().expect("utf-8 path");
        let port = self.port.to_string();
        let child = server_command(
            &self.bindir.join("postgres"),
            &[
                "-D",
                data,
                "-p",
                &port,
                "-k",
                data,
                "-c",
                "listen_addresses=127.0.0.1",
                "-c",
                "fsync=off",
                "-c",
                "max_connections=300",
            ],
        )
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn();
        let child = match child {
            Ok(child) => child,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => panic!("{INSTALL_HINT}"),
            Err(e) => panic!("could not start postgres: {e}"),
        };
        self.child = Some(child);
        self.wait_ready();
    }

    fn wait_ready(&mut self) {
        let deadline = Instant::now() + Duration::from_secs(30);
        while Instant::now() < deadline {
            if let Some(Ok(Some(status))) = self.child.as_mut().map(Child::try_wait) {
                panic!("postgres on port {} exited at start: {status}", self.port);
            }
            let pg_isready = self.bindir.join("pg_isready");
            let ready = if pg_isready.exists() {
                Command::new(pg_isready)
                    .args(["-h", "127.0.0.1", "-p", &self.port.to_string(), "-q"])
                    .status()
                    .is_ok_and(|s| s.success())
            } else {
                TcpStream::connect(self.addr()).is_ok()
            };
            if ready {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        panic!("postgres on port {} was not ready within 30 s", self.port);
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    pub fn addr(&self) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], self.port))
    }

    /// A URL of the server's `postgres` database.
    pub fn url(&self) -> String {
        format!("postgres://postgres@127.0.0.1:{}/postgres", self.port)
    }

    /// A builder on this server in a fresh schema, with the tests' timeout, no background
    /// purge and a small pool.
    pub fn builder(&self) -> tollgate::store::PgStoreBuilder {
        PgStore::builder(self.url())
            .schema(unique_schema())
            .timeout(Duration::from_secs(2))
            .pool_size(8)
            .purge_interval(None)
    }

    /// A plain connection for inspecting the server; its connection task runs on the current
    /// runtime.
    pub async fn client(&self) -> tokio_postgres::Client {
        let (client, connection) = tokio_postgres::connect(&self.url(), tokio_postgres::NoTls)
            .await
            .expect("connect to the test postgres");
        tokio::spawn(async move {
            let _ = connection.await;
        });
        client
    }

    /// The postmaster's pid, from its pid file.
    fn pid(&self) -> Option<String> {
        let text = std::fs::read_to_string(self.data().join("postmaster.pid")).ok()?;
        text.lines().next().map(str::to_owned)
    }

    /// Stops the server (fast shutdown: clean, unlogged tables kept) and waits until its port
    /// is closed and its process gone.
    pub fn stop(&mut self) {
        if let Some(pid) = self.pid() {
            let _ = Command::new("kill").args(["-INT", &pid]).status();
        }
        if let Some(mut child) = self.child.take() {
            let deadline = Instant::now() + Duration::from_secs(20);
            while Instant::now() < deadline && matches!(child.try_wait(), Ok(None)) {
                std::thread::sleep(Duration::from_millis(20));
            }
            let _ = child.kill();
            let _ = child.wait();
        }
        let deadline = Instant::now() + Duration::from_secs(5);
        while TcpStream::connect(self.addr()).is_ok() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// Starts the server again on the same port and data dir.
    pub fn restart(&mut self) {
        self.stop();
        self.spawn();
    }
}

impl Drop for PgServer {
    fn drop(&mut self) {
        self.stop();
        // the watchdog removes the dir once its stdin closes
        if let Some((mut watchdog, mut stdin)) = self.watchdog.take() {
            let _ = stdin.write_all(b"\n");
            drop(stdin);
            let _ = watchdog.wait();
        }
    }
}

/// The server this test binary shares, started on first use.
pub fn shared() -> &'static PgServer {
    static SERVER: OnceLock<PgServer> = OnceLock::new();
    SERVER.get_or_init(PgServer::start)
}

/// A schema name no other test uses.
pub fn unique_schema() -> String {
    format!("t{:016x}", rand::random::<u64>())
}

/// A migrated store on the shared server, in a schema of its own.
pub async fn store() -> PgStore {
    let server = tokio::task::spawn_blocking(shared)
        .await
        .expect("start the shared postgres");
    server.builder().connect().await.expect("migrated store")
}

/// Makes every commit of rows inserted into `table` (in `schema`) take a second on the shared
/// server: a deferred constraint trigger sleeps in it — time to break a connection during
/// `COMMIT`.
pub async fn slow_commits(schema: &str, table: &str) {
    let server = tokio::task::spawn_blocking(shared)
        .await
        .expect("start the shared postgres");
    server
        .client()
        .await
        .batch_execute(&format!(
            "CREATE FUNCTION {schema}.slow_commit() RETURNS trigger LANGUAGE plpgsql AS \
             $$ BEGIN PERFORM pg_sleep(1); RETURN NULL; END $$; \
             CREATE CONSTRAINT TRIGGER slow_commit AFTER INSERT ON {table} \
             DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION {schema}.slow_commit()"
        ))
        .await
        .expect("create the slow-commit trigger");
}
