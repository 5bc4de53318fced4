//! `rediss://` against a TLS-only redis-server whose certificate is signed by a CA made here
//! (feature `tls-rustls`, on for the tests): a given CA is trusted, mutual TLS presents the
//! client's certificate, and neither a missing CA nor plain `redis://` gets through.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use crate::common;

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tempfile::TempDir;
use tollgate::claim::Claims;
use tollgate::key::Key;
use tollgate::rate::{Algorithm, Limit, RateCheck, RatePolicy};
use tollgate::store::{RateStore, RedisStore, Store};

/// Runs `openssl` with `args` in `dir`.
fn openssl(dir: &Path, args: &[&str]) {
    let status = Command::new("openssl")
        .args(args)
        .current_dir(dir)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .expect("could not run openssl: is it installed (apt-get install openssl)?");
    assert!(status.success(), "openssl {args:?} failed");
}

/// A CA, a server certificate for 127.0.0.1 and a client certificate, all signed by the CA.
fn certificates(dir: &Path) {
    openssl(
        dir,
        &[
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            "ca.key",
            "-out",
            "ca.crt",
            "-days",
            "2",
            "-subj",
            "/CN=tollgate test CA",
        ],
    );
    // extensions make X.509 v3 certificates, the only version rustls takes
    std::fs::write(
        dir.join("server.ext"),
        "subjectAltName=IP:127.0.0.1,DNS:localhost\n",
    )
    .unwrap();
    std::fs::write(dir.join("client.ext"), "extendedKeyUsage=clientAuth\n").unwrap();
    for name in ["server", "client"] {
        let (key, csr, crt, ext) = (
            format!("{name}.key"),
            format!("{name}.csr"),
            format!("{name}.crt"),
            format!("{name}.ext"),
        );
        openssl(
            dir,
            &[
                "req",
                "-newkey",
                "rsa:2048",
                "-nodes",
                "-keyout",
                &key,
                "-out",
                &csr,
                "-subj",
                &format!("/CN=tollgate test {name}"),
            ],
        );
        openssl(
            dir,
            &[
                "x509",
                "-req",
                "-in",
                &csr,
                "-CA",
                "ca.crt",
                "-CAkey",
                "ca.key",
                "-CAcreateserial",
                "-out",
                &crt,
                "-days",
                "2",
                "-extfile",
                &ext,
            ],
        );
    }
}

/// A redis-server that speaks TLS only, on a free port; killed on drop.
struct TlsServer {
    child: Child,
    port: u16,
    dir: TempDir,
}

impl TlsServer {
    fn start(auth_clients: bool) -> Self {
        common::require_redis_server();
        let dir = tempfile::tempdir().unwrap();
        certificates(dir.path());
        let port = common::free_port();
        let child = Command::new("redis-server")
            .args(["--port", "0", "--tls-port", &port.to_string()])
            .args(["--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
            .args([
                "--tls-cert-file",
                "server.crt",
                "--tls-key-file",
                "server.key",
            ])
            .args(["--tls-ca-cert-file", "ca.crt"])
            .args([
                "--tls-auth-clients",
                if auth_clients { "yes" } else { "no" },
            ])
            .current_dir(dir.path())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect(
                "could not start redis-server: is it installed (apt-get install redis-server)?",
            );
        let server = Self { child, port, dir };
        server.wait_listening();
        server
    }

    fn wait_listening(&self) {
        wait_listening(self.port, "redis-server");
    }

    fn read(&self, name: &str) -> Vec<u8> {
        std::fs::read(self.dir.path().join(name)).unwrap()
    }

    fn url(&self, scheme: &str) -> String {
        format!("{scheme}://127.0.0.1:{}/", self.port)
    }

    /// A store trusting the test CA, and presenting the client certificate if `client`.
    fn store(&self, client: bool) -> RedisStore {
        let mut builder = RedisStore::builder(self.url("rediss"))
            .timeout(Duration::from_secs(2))
            .tls_ca_cert(self.read("ca.crt"));
        if client {
            builder = builder.tls_client_cert(self.read("client.crt"), self.read("client.key"));
        }
        builder.build().unwrap()
    }
}

/// A redis-server in sentinel mode that speaks TLS only, monitoring `server` as `master`, in
/// the server's dir (its certificates); killed on drop.
struct TlsSentinel {
    child: Child,
    port: u16,
}

impl TlsSentinel {
    fn start(server: &TlsServer, master: &str) -> Self {
        let port = common::free_port();
        let config = format!(
            "port 0\ntls-port {port}\nbind 127.0.0.1\n\
             tls-cert-file server.crt\ntls-key-file server.key\ntls-ca-cert-file ca.crt\n\
             tls-auth-clients no\ntls-replication yes\n\
             sentinel monitor {master} 127.0.0.1 {} 1\n",
            server.port
        );
        let file = server.dir.path().join(format!("sentinel-{port}.conf"));
        std::fs::write(&file, config).unwrap();
        let child = Command::new("redis-server")
            .arg(&file)
            .arg("--sentinel")
            .current_dir(server.dir.path())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect(
                "could not start redis-server: is it installed (apt-get install redis-server)?",
            );
        wait_listening(port, "the sentinel");
        Self { child, port }
    }
}

impl Drop for TlsSentinel {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for TlsServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Waits until `what` listens on `port` (for TLS: no plain PING).
fn wait_listening(port: u16, what: &str) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(Instant::now() < deadline, "{what} did not listen for TLS");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Answers once the store can reach the server (the first TLS handshakes may race its start).
async fn reachable(store: &RedisStore) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while let Err(error) = store.ping().await {
        assert!(Instant::now() < deadline, "no answer over TLS: {error}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_given_ca_is_trusted_and_two_copies_redeem_exactly_once() {
    let server = TlsServer::start(false);
    let copies = [server.store(false), server.store(false)];
    reachable(&copies[0]).await;
    let won = common::redemptions_won(&copies, "coupon-tls", 50).await;
    assert_eq!(won, 1, "exactly one redemption");

    let policy = Arc::new(
        RatePolicy::new(
            "tls:rl",
            Algorithm::SlidingLog,
            vec![Limit::per_hour("h", 7)],
        )
        .unwrap(),
    );
    let mut admitted = 0;
    for i in 0..20 {
        let check = RateCheck::new(Key::new("t", b"over-tls"), 1);
        admitted += u32::from(
            copies[i % 2]
                .check_rate(&policy, check)
                .await
                .unwrap()
                .admitted,
        );
    }
    assert_eq!(admitted, 7, "exactly the quota");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn neither_an_unknown_ca_nor_plain_text_gets_through() {
    let server = TlsServer::start(false);
    reachable(&server.store(false)).await;
    // the platform's roots do not know the test CA
    let untrusting = RedisStore::builder(server.url("rediss"))
        .timeout(Duration::from_millis(500))
        .build()
        .unwrap();
    let start = Instant::now();
    assert!(
        untrusting.ping().await.is_err(),
        "an unknown CA was trusted"
    );
    assert!(
        start.elapsed() < Duration::from_secs(3),
        "a failed handshake hung"
    );
    let plain = RedisStore::builder(server.url("redis"))
        .timeout(Duration::from_millis(500))
        .build()
        .unwrap();
    assert!(plain.ping().await.is_err(), "plain text reached a TLS port");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mutual_tls_presents_the_client_certificate() {
    let server = TlsServer::start(true);
    let with_certificate = server.store(true);
    reachable(&with_certificate).await;
    assert!(
        Claims::new(with_certificate)
            .claim_once("mtls", None)
            .await
            .unwrap()
            .won()
    );
    let without = RedisStore::builder(server.url("rediss"))
        .timeout(Duration::from_millis(500))
        .tls_ca_cert(server.read("ca.crt"))
        .build()
        .unwrap();
    assert!(
        without.ping().await.is_err(),
        "no client certificate, yet through"
    );
}

/// Behind a TLS-only sentinel: the sentinel is asked over TLS with the given CA, and the primary
/// it names is reached over TLS too; two copies redeem a coupon exactly once. Without the CA the
/// sentinel is never reached.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sentinels_and_their_primary_are_reached_over_tls() {
    let server = TlsServer::start(false);
    reachable(&server.store(false)).await;
    let sentinel = TlsSentinel::start(&server, "tls-primary");
    let url = format!("rediss://127.0.0.1:{}/", sentinel.port);
    let connect = || {
        RedisStore::sentinel_builder([url.clone()], "tls-primary")
            .timeout(Duration::from_secs(2))
            .tls_ca_cert(server.read("ca.crt"))
            .connect()
    };
    let deadline = Instant::now() + Duration::from_secs(10);
    let first = loop {
        match connect().await {
            Ok(store) => break store,
            Err(error) => {
                assert!(Instant::now() < deadline, "no sentinel over TLS: {error}");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    };
    let copies = [first, connect().await.unwrap()];
    reachable(&copies[0]).await;
    let won = common::redemptions_won(&copies, "coupon-sentinel-tls", 50).await;
    assert_eq!(won, 1, "exactly one redemption");

    let untrusting = RedisStore::sentinel_builder([url], "tls-primary")
        .timeout(Duration::from_millis(500))
        .connect()
        .await;
    assert!(
        untrusting.is_err(),
        "a sentinel with an unknown CA was trusted"
    );
}
