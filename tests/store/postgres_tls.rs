//! PgStore over TLS from the URL (`sslmode`, `sslrootcert`), against a PostgreSQL server the
//! test starts that takes TLS connections only, with a CA made for the test.
#![allow(clippy::unwrap_used, clippy::expect_used)]
use crate::common;

use std::path::Path;
use std::process::Command;
use std::sync::Arc;
use std::time::Duration;

use common::postgres::PgServer;
use tollgate::key::Key;
use tollgate::rate::{Algorithm, Limit, RateCheck, RatePolicy};
use tollgate::store::{PgStore, RateStore, StoreError, StoreErrorKind};

fn openssl(dir: &Path, args: &[&str]) {
    let status = Command::new("openssl")
        .current_dir(dir)
        .args(args)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .status()
        .expect("could not run openssl: is it installed (apt-get install openssl)?");
    assert!(status.success(), "openssl {args:?} failed");
}

/// A CA named `name` in `dir` (`<name>.crt`, `<name>.key`), and, signed by it when `server`,
/// `server.crt` / `server.key` for 127.0.0.1 and localhost.
fn authority(dir: &Path, name: &str, server: bool) {
    let (crt, key) = (format!("{name}.crt"), format!("{name}.key"));
    let subject = format!("/CN=tollgate test {name}");
    openssl(
        dir,
        &[
            "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", &key, "-out", &crt,
            "-days", "2", "-subj", &subject,
        ],
    );
    if !server {
        return;
    }
    std::fs::write(
        dir.join("server.ext"),
        "subjectAltName=IP:127.0.0.1,DNS:localhost\n",
    )
    .unwrap();
    openssl(
        dir,
        &[
            "req",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            "server.key",
            "-out",
            "server.csr",
            "-subj",
            "/CN=tollgate test server",
        ],
    );
    openssl(
        dir,
        &[
            "x509",
            "-req",
            "-in",
            "server.csr",
            "-CA",
            &crt,
            "-CAkey",
            &key,
            "-CAcreateserial",
            "-out",
            "server.crt",
            "-days",
            "2",
            "-extfile",
            "server.ext",
        ],
    );
}

/// Whether this process runs as root, where the server runs as the `postgres` user.
fn is_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
}

/// The server's certificate and key in `dir`, made readable to the server, the key to its user
/// alone (the server refuses a key others may read).
fn server_files(dir: &Path) -> (String, String) {
    use std::os::unix::fs::PermissionsExt;
    let mode = |path: &Path, mode| {
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).unwrap();
    };
    mode(dir, 0o755);
    let (crt, key) = (dir.join("server.crt"), dir.join("server.key"));
    mode(&crt, 0o644);
    mode(&key, 0o600);
    if is_root() {
        let status = Command::new("chown")
            .arg("postgres")
            .arg(&crt)
            .arg(&key)
            .status();
        assert!(
            status.is_ok_and(|s| s.success()),
            "chown the key to postgres"
        );
    }
    (crt.display().to_string(), key.display().to_string())
}

/// A server that takes TLS connections only, with `server.crt` of the CA `ca` in `dir`.
async fn tls_only_server(dir: &Path) -> PgServer {
    let mut server = PgServer::start();
    let client = server.client().await;
    let hba: String = client.query_one("SHOW hba_file", &[]).await.unwrap().get(0);
    let rules = "hostssl all all 127.0.0.1/32 trust\nlocal all all trust";
    let hba = format!(
        "COPY (SELECT unnest(string_to_array('{rules}', E'\\n'))) TO '{}'",
        hba.replace('\'', "''")
    );
    client.batch_execute(&hba).await.unwrap();
    let (crt, key) = server_files(dir);
    // one statement per call: ALTER SYSTEM refuses a multi-statement batch (a transaction)
    for statement in [
        format!("ALTER SYSTEM SET ssl_cert_file = '{crt}'"),
        format!("ALTER SYSTEM SET ssl_key_file = '{key}'"),
        "ALTER SYSTEM SET ssl = on".to_owned(),
    ] {
        client.batch_execute(&statement).await.unwrap();
    }
    drop(client);
    // the server reads its certificate at start
    server.restart();
    server
}

async fn connect(url: String) -> Result<PgStore, StoreError> {
    PgStore::builder(url)
        .schema(format!("tls{}", rand::random::<u32>()))
        .timeout(Duration::from_secs(2))
        .connect()
        .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tls_only_server_is_reached_as_the_url_says() {
    let dir = tempfile::tempdir().unwrap();
    authority(dir.path(), "ca", true);
    authority(dir.path(), "other", false);
    let server = tls_only_server(dir.path()).await;
    let base = format!("postgres://postgres@127.0.0.1:{}/postgres", server.port());
    let ca = dir.path().join("ca.crt");
    for mode in ["verify-full", "verify-ca", "require"] {
        let url = format!("{base}?sslmode={mode}&sslrootcert={}", ca.display());
        let store = connect(url).await.unwrap_or_else(|e| panic!("{mode}: {e}"));
        let policy = RatePolicy::new("t:rl", Algorithm::Gcra, vec![Limit::per_minute("m", 2)]);
        let check = RateCheck::new(Key::new("t", mode.as_bytes()), 1);
        let outcome = store
            .check_rate(&Arc::new(policy.unwrap()), check)
            .await
            .unwrap();
        assert!(outcome.admitted, "{mode}");
    }
    // plain text is turned away by the server, which says so
    let plain = connect(base.clone()).await.err().unwrap();
    assert_eq!(plain.kind(), StoreErrorKind::Config, "{plain}");
    assert!(plain.to_string().contains("no encryption"), "{plain}");
    // a server whose certificate another CA signed is not trusted
    let other = dir.path().join("other.crt");
    let url = format!("{base}?sslmode=verify-full&sslrootcert={}", other.display());
    let untrusted = connect(url).await.err().unwrap();
    assert!(untrusted.to_string().contains("certificate"), "{untrusted}");
    // verify-full checks the name: the certificate is for 127.0.0.1 and localhost
    let url = format!(
        "postgres://postgres@localhost:{}/postgres?sslmode=verify-full&sslrootcert={}",
        server.port(),
        ca.display()
    );
    connect(url).await.unwrap();
}
