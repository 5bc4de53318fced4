//! [`RedisServer`]: a throwaway `redis-server` on a free port.

use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use super::{StartError, wait_ready};

/// How to install the server when it is missing.
const INSTALL_HINT: &str = "redis-server was not found on PATH: install it, e.g. \
     `sudo apt-get install redis-server` (Debian/Ubuntu) or `brew install redis` (macOS); \
     Valkey's `valkey-server` works too, under the name redis-server";

/// How long a new server has to answer `PING`.
const READY_WITHIN: Duration = Duration::from_secs(10);

/// A `redis-server` process of a test's own, on a free port of `127.0.0.1`, keeping nothing on
/// disk; killed when dropped. Never a shared server: a test may flush or stop it at will.
///
/// ```no_run
/// # fn main() -> Result<(), tollgate::testing::StartError> {
/// let server = tollgate::testing::RedisServer::start()?;
/// let url = server.url(); // redis://127.0.0.1:<port>/
/// # Ok(()) }
/// ```
pub struct RedisServer {
    port: u16,
    child: Child,
}

impl RedisServer {
    /// Starts `redis-server` on a free port and waits until it answers `PING` (up to 10 s).
    pub fn start() -> Result<Self, StartError> {
        let port = free_port();
        let child = Command::new("redis-server")
            .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
            .args(["--save", "", "--appendonly", "no"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|e| match e.kind() {
                io::ErrorKind::NotFound => StartError::NotInstalled { hint: INSTALL_HINT },
                _ => StartError::Io(e),
            })?;
        let mut server = Self { port, child };
        let addr = server.addr();
        let every = Duration::from_millis(10);
        wait_ready(&mut server.child, READY_WITHIN, every, || pong(addr))?;
        Ok(server)
    }

    /// The server's port.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// The server's address.
    pub fn addr(&self) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], self.port))
    }

    /// The server's URL, for [`RedisStore::open`](crate::store::RedisStore) or a `REDIS_URL`.
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/", self.port)
    }
}

debug_fields!(RedisServer { port });

impl Drop for RedisServer {
    fn drop(&mut self) {
        // nothing to do with a failure here: the process is gone or going
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Whether a server at `addr` answers `PING` with `PONG`.
fn pong(addr: SocketAddr) -> bool {
    let Ok(mut stream) = TcpStream::connect_timeout(&addr, Duration::from_millis(200)) else {
        return false;
    };
    let _ = stream.set_read_timeout(Some(Duration::from_millis(500)));
    let mut reply = [0u8; 7];
    stream.write_all(b"PING\r\n").is_ok()
        && stream.read_exact(&mut reply).is_ok()
        && &reply == b"+PONG\r\n"
}

/// A port of `127.0.0.1` that is free now, drawn below the kernel's ephemeral range (32768 and
/// up on Linux), where no outgoing connection takes it before the server does.
pub(super) fn free_port() -> u16 {
    loop {
        let candidate = 10_000 + (crate::lock::rand_unit() * 12_000.0) as u16;
        if TcpListener::bind(("127.0.0.1", candidate)).is_ok() {
            return candidate;
        }
    }
}
