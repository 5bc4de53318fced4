//! A PostgreSQL server of the test's own, on a free port in a temp dir (never the machine's
//! server on 5432): initdb, then postgres, as the `postgres` user when the tests run as root.

use std::io::Write;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::time::{Duration, Instant};

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

/// initdb and postgres refuse to run as root: they run as the `postgres` user then.
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

fn free_port() -> u16 {
    let listener = TcpListener::bind("127.0.0.1:0").expect("a free port");
    listener.local_addr().expect("its address").port()
}

/// A PostgreSQL server owned by a test; stopped on drop and its dir removed. A watchdog
/// process does the same when the test binary exits without dropping it.
pub(crate) struct PgServer {
    port: u16,
    /// Holds the data dir (`data/`, also the socket dir).
    dir: PathBuf,
    child: Option<Child>,
    /// Its stdin closes when this process ends: the watchdog then stops the server and
    /// removes `dir`.
    watchdog: Option<(Child, ChildStdin)>,
}

impl PgServer {
    /// initdb in a fresh temp dir, then the server on a free port; waits until it accepts
    /// connections.
    pub(crate) fn start() -> Self {
        let bindir = bindir();
        let dir = tempfile::Builder::new()
            .prefix("tollgate-cli-pg-")
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
            assert!(status.is_ok_and(|s| s.success()), "chown the data dir");
        }
        let data = data.to_str().expect("utf-8 path").to_owned();
        let initdb = server_command(
            &bindir.join("initdb"),
            &["-D", &data, "-A", "trust", "-U", "postgres", "--no-sync"],
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
            child: None,
            watchdog: None,
        };
        server.watchdog = Some(server.spawn_watchdog());
        let port = server.port.to_string();
        let child = server_command(
            &bindir.join("postgres"),
            &[
                "-D",
                &data,
                "-p",
                &port,
                "-k",
                &data,
                "-c",
                "listen_addresses=127.0.0.1",
                "-c",
                "fsync=off",
            ],
        )
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn();
        match child {
            Ok(child) => server.child = Some(child),
            Err(e) => panic!("could not start postgres: {e}"),
        }
        server.wait_ready(&bindir);
        server
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

    fn wait_ready(&mut self, bindir: &Path) {
        let deadline = Instant::now() + Duration::from_secs(30);
        while Instant::now() < deadline {
            if let Some(Ok(Some(status))) = self.child.as_mut().map(Child::try_wait) {
                panic!("postgres on port {} exited at start: {status}", self.port);
            }
            let pg_isready = bindir.join("pg_isready");
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

    pub(crate) fn addr(&self) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], self.port))
    }

    /// A URL of the server's `postgres` database.
    pub(crate) fn url(&self) -> String {
        format!("postgres://postgres@127.0.0.1:{}/postgres", self.port)
    }
}

impl Drop for PgServer {
    fn drop(&mut self) {
        // fast shutdown, then the watchdog removes the dir once its stdin closes
        if let Some(mut child) = self.child.take() {
            let pid = std::fs::read_to_string(self.dir.join("data/postmaster.pid"))
                .ok()
                .and_then(|text| text.lines().next().map(str::to_owned));
            if let Some(pid) = pid {
                let _ = Command::new("kill").args(["-INT", &pid]).status();
            }
            let deadline = Instant::now() + Duration::from_secs(20);
            while Instant::now() < deadline && matches!(child.try_wait(), Ok(None)) {
                std::thread::sleep(Duration::from_millis(20));
            }
            let _ = child.kill();
            let _ = child.wait();
        }
        if let Some((mut watchdog, mut stdin)) = self.watchdog.take() {
            let _ = stdin.write_all(b"\n");
            drop(stdin);
            let _ = watchdog.wait();
        }
    }
}
