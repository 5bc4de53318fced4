//! [`PgServer`]: a throwaway PostgreSQL server on a free port, in a temp dir of its own.

use std::io::Write;
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::time::Duration;

use super::redis::free_port;
use super::{StartError, wait_ready};

/// How long a new server has to accept connections.
const READY_WITHIN: Duration = Duration::from_secs(30);

/// A PostgreSQL server of a test's own: `initdb` in a fresh temp dir (trust authentication,
/// user `postgres`, no fsync), then `postgres` on a free port of `127.0.0.1`. Stopped and its
/// dir removed when dropped — or, should the test process end without dropping it (a server
/// kept in a `static`), by a watchdog process when this one exits. Never a shared server.
///
/// The binaries are the ones `pg_config --bindir` names. Run as root, the server runs as the
/// `postgres` user (`runuser`), as PostgreSQL refuses root. `initdb` takes a second or two:
/// share one server across a test binary's tests, each in a schema of its own
/// ([`PgStoreBuilder::schema`](crate::store::PgStoreBuilder)).
///
/// ```no_run
/// # fn main() -> Result<(), tollgate::testing::StartError> {
/// let server = tollgate::testing::PgServer::start()?;
/// let url = server.url(); // postgres://postgres@127.0.0.1:<port>/postgres
/// # Ok(()) }
/// ```
pub struct PgServer {
    port: u16,
    /// Holds the data dir (`data/`, also the socket dir).
    dir: PathBuf,
    child: Child,
    /// Its stdin closes when this process ends: the watchdog then stops the server and
    /// removes `dir`.
    watchdog: Option<(Child, ChildStdin)>,
}

impl PgServer {
    /// Creates the server's data dir, starts it and waits until it accepts connections (up to
    /// 30 s).
    pub fn start() -> Result<Self, StartError> {
        let bindir = bindir()?;
        let dir = std::env::temp_dir().join(format!(
            "tollgate-pg-{}-{:08x}",
            std::process::id(),
            (crate::lock::rand_unit() * f64::from(u32::MAX)) as u32
        ));
        let data = dir.join("data");
        std::fs::create_dir_all(&data).map_err(StartError::Io)?;
        let watchdog = watchdog(&dir)?;
        if is_root() {
            // the server runs as postgres: it must reach and own its dir
            run(Command::new("chmod").arg("755").arg(&dir))?;
            run(Command::new("chown").args(["-R", "postgres:"]).arg(&data))?;
        }
        let data_arg = data.to_string_lossy().into_owned();
        let initdb = [
            "-D",
            &data_arg,
            "-A",
            "trust",
            "-U",
            "postgres",
            "--no-sync",
        ];
        run(&mut as_server(&bindir.join("initdb"), &initdb))?;
        let port = free_port();
        let port_arg = port.to_string();
        let child = as_server(
            &bindir.join("postgres"),
            &["-D", &data_arg, "-p", &port_arg, "-k", &data_arg],
        )
        .args(["-c", "listen_addresses=127.0.0.1", "-c", "fsync=off"])
        .args(["-c", "max_connections=300"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .map_err(StartError::Io)?;
        let mut server = Self {
            port,
            dir,
            child,
            watchdog: Some(watchdog),
        };
        let (addr, pid_file) = (server.addr(), server.dir.join("data/postmaster.pid"));
        // the server accepts TCP before it takes queries: its pid file says "ready"
        let ready = || {
            TcpStream::connect(addr).is_ok()
                && std::fs::read_to_string(&pid_file).is_ok_and(|text| text.contains("ready"))
        };
        let every = Duration::from_millis(50);
        wait_ready(&mut server.child, READY_WITHIN, every, ready)?;
        Ok(server)
    }

    /// A URL of the server's `postgres` database, for
    /// [`PgStore::builder`](crate::store::PgStore) or a `DATABASE_URL`.
    pub fn url(&self) -> String {
        format!("postgres://postgres@127.0.0.1:{}/postgres", self.port)
    }

    /// The server's port.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// The server's address.
    pub fn addr(&self) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], self.port))
    }
}

debug_fields!(PgServer { port, dir });

impl Drop for PgServer {
    fn drop(&mut self) {
        // the watchdog stops the server (fast shutdown) and removes the dir once its stdin
        // closes; failures here leave nothing to do
        if let Some((mut watchdog, mut stdin)) = self.watchdog.take() {
            let _ = stdin.write_all(b"\n");
            drop(stdin);
            let _ = watchdog.wait();
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The server's binaries: `pg_config --bindir`, holding `initdb` and `postgres`.
fn bindir() -> Result<PathBuf, StartError> {
    let missing = || StartError::NotInstalled {
        hint: PG_INSTALL_HINT,
    };
    let output = Command::new("pg_config")
        .arg("--bindir")
        .output()
        .map_err(|_| missing())?;
    let dir = PathBuf::from(String::from_utf8_lossy(&output.stdout).trim());
    let complete =
        output.status.success() && dir.join("initdb").exists() && dir.join("postgres").exists();
    complete.then_some(dir).ok_or_else(missing)
}

/// How to install the server when it is missing.
const PG_INSTALL_HINT: &str = "PostgreSQL was not found (no `pg_config` on PATH, or no initdb / \
     postgres in its --bindir): install it, e.g. `sudo apt-get install postgresql` \
     (Debian/Ubuntu) or `brew install postgresql` (macOS)";

/// Whether this process runs as root, where initdb and postgres refuse to run.
fn is_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
}

/// `program` with `args`, as the `postgres` user when this process is root.
fn as_server(program: &Path, args: &[&str]) -> Command {
    let mut command = if is_root() {
        let mut command = Command::new("runuser");
        command.args(["-u", "postgres", "--"]).arg(program);
        command
    } else {
        Command::new(program)
    };
    command.args(args);
    command
}

/// Runs `command` to its end; an error says what it wrote to stderr.
fn run(command: &mut Command) -> Result<(), StartError> {
    let output = command
        .stdout(Stdio::null())
        .output()
        .map_err(StartError::Io)?;
    if output.status.success() {
        return Ok(());
    }
    let stderr = String::from_utf8_lossy(&output.stderr);
    Err(StartError::Exited(format!(
        "{}: {}",
        output.status,
        stderr.trim()
    )))
}

/// A shell that waits for its stdin to close, then stops the server in `dir` and removes the
/// dir.
fn watchdog(dir: &Path) -> Result<(Child, ChildStdin), StartError> {
    let script = r#"read _ignored; pid=$(head -n 1 "$1/data/postmaster.pid" 2>/dev/null); if [ -n "$pid" ]; then kill -QUIT "$pid" 2>/dev/null; for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done; fi; rm -rf "$1""#;
    let mut child = Command::new("sh")
        .args(["-c", script, "watchdog"])
        .arg(dir)
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .map_err(StartError::Io)?;
    match child.stdin.take() {
        Some(stdin) => Ok((child, stdin)),
        None => Err(StartError::NotReady),
    }
}
