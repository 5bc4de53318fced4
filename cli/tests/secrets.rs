//! No secret in the command's output: a password planted in each connection-string form, given
//! with `--store` or in `TOLLGATE_STORE`, and a caller's API key, are found in neither standard
//! output nor standard error — text and `--json`, of every subcommand that reads a store, on a
//! Redis that asks for the password and on PostgreSQL, through failed connections and
//! command lines clap refuses. The key shows masked (`sk_l…`).

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::{Run, TOLLGATE_TOML, free_port, write_config};
use tollgate::store::PgStore;
use tollgate::testing::PgServer;

/// The password planted in every form.
const PASSWORD: &str = "plantedPw7Hk2xQ";

/// A caller's API key: shown as its first characters only.
const API_KEY: &str = "sk_live_plantedKey91";

/// Runs `tollgate` with `args`, and `TOLLGATE_STORE` set to `store` (unset for `None`).
async fn tollgate(args: &[&str], store: Option<&str>) -> Run {
    let args: Vec<String> = args.iter().map(|a| (*a).to_owned()).collect();
    let store = store.map(str::to_owned);
    tokio::task::spawn_blocking(move || {
        let mut command = Command::new(env!("CARGO_BIN_EXE_tollgate"));
        command.args(&args).env_remove("TOLLGATE_STORE");
        if let Some(store) = store {
            command.env("TOLLGATE_STORE", store);
        }
        let output = command.output().unwrap();
        Run {
            code: output.status.code().unwrap_or(-1),
            stdout: String::from_utf8_lossy(&output.stdout).into_owned(),
            stderr: String::from_utf8_lossy(&output.stderr).into_owned(),
        }
    })
    .await
    .unwrap()
}

/// Fails when the run's stdout or stderr holds the password or the raw API key.
#[track_caller]
fn assert_hidden(what: &str, run: &Run) {
    for (stream, text) in [("stdout", &run.stdout), ("stderr", &run.stderr)] {
        assert!(
            !text.contains(PASSWORD),
            "{what}: the password on {stream}: {run:?}"
        );
        assert!(
            !text.contains(API_KEY),
            "{what}: the API key on {stream}: {run:?}"
        );
    }
}

/// A `redis-server` with `requirepass` set to the planted password, on a free port and a Unix
/// socket; killed on drop.
struct PasswordRedis {
    port: u16,
    dir: tempfile::TempDir,
    child: Child,
}

impl PasswordRedis {
    fn start() -> Self {
        let dir = tempfile::tempdir().unwrap();
        let port = free_port();
        let child = Command::new("redis-server")
            .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
            .args(["--save", "", "--appendonly", "no", "--requirepass", PASSWORD])
            .arg("--unixsocket")
            .arg(dir.path().join("redis.sock"))
            .arg("--dir")
            .arg(dir.path())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| {
                panic!("could not start redis-server ({e}): install it, e.g. apt-get install redis-server")
            });
        let server = Self { port, dir, child };
        // the socket is made once the server listens
        let deadline = Instant::now() + Duration::from_secs(10);
        while !(server.socket().exists()
            && std::net::TcpStream::connect(("127.0.0.1", port)).is_ok())
        {
            assert!(Instant::now() < deadline, "redis-server did not start");
            std::thread::sleep(Duration::from_millis(10));
        }
        server
    }

    fn socket(&self) -> PathBuf {
        self.dir.path().join("redis.sock")
    }
}

impl Drop for PasswordRedis {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Every subcommand that reads the store, text and `--json`, naming the caller by its key.
fn subcommands(config: &str) -> Vec<Vec<String>> {
    let header = format!("x-api-key={API_KEY}");
    let scope = format!("x-api-key={API_KEY}");
    let tenant = format!("x-tenant={API_KEY}");
    let key_fn = format!("tenant={API_KEY}");
    let lists: [&[&str]; 10] = [
        &["inspect", "--config", config, "--header", &header],
        &[
            "inspect", "rate", "--json", "--config", config, "--header", &header,
        ],
        &["inspect", "--json", "--config", config, "--key-fn", &key_fn],
        &["reset", "--config", config, "--header", &header],
        &["inspect", "lock", "nightly"],
        &["inspect", "lock", "nightly", "--json"],
        &["inspect", "permits", "--header", &tenant],
        &["inspect", "permits", "--json", "--header", &tenant],
        &["inspect", "record", "order-17", "--scope-header", &scope],
        &[
            "inspect",
            "record",
            "order-17",
            "--json",
            "--scope-key-fn",
            &key_fn,
        ],
    ];
    lists
        .iter()
        .map(|args| args.iter().map(|a| (*a).to_owned()).collect())
        .collect()
}

/// Runs every subcommand on `forms` — each given with `--store`, then in `TOLLGATE_STORE` —
/// and checks that nothing shows the secrets; the number of runs that read the store (exit 0, or
/// 1 for nothing found under what they named).
async fn run_everywhere(forms: &[Vec<String>], extra: &[&str], config: &str) -> usize {
    let mut succeeded = 0;
    for form in forms {
        for subcommand in subcommands(config) {
            let mut args: Vec<&str> = subcommand.iter().map(String::as_str).collect();
            args.extend(extra);
            args.extend(["--timeout", "2s"]);
            let mut with_flag = args.clone();
            for url in form {
                with_flag.extend(["--store", url]);
            }
            let run = tollgate(&with_flag, None).await;
            assert_hidden(&format!("{with_flag:?}"), &run);
            if run.code == 0 || run.code == 1 {
                succeeded += 1;
                assert!(
                    run.stdout.contains("sk_l…") || !subcommand.iter().any(|a| a.contains(API_KEY)),
                    "the key shows masked: {run:?}"
                );
            }
            let from_env = tollgate(&args, Some(&form.join(","))).await;
            assert_hidden(&format!("{args:?} with TOLLGATE_STORE={form:?}"), &from_env);
            assert_eq!(from_env.code, run.code, "{from_env:?} against {run:?}");
        }
    }
    succeeded
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_password_or_key_on_redis() {
    let server = PasswordRedis::start();
    let (_dir, config) = write_config(TOLLGATE_TOML);
    let config = config.to_str().unwrap();
    let (port, socket) = (server.port, server.socket().display().to_string());
    let live = [
        format!("redis://:{PASSWORD}@127.0.0.1:{port}/"),
        format!("valkey://default:{PASSWORD}@127.0.0.1:{port}/0"),
        format!("redis+unix://{socket}?pass={PASSWORD}"),
        format!("unix://{socket}?db=1&pass={PASSWORD}"),
    ]
    .map(|url| vec![url]);
    let succeeded = run_everywhere(&live, &["--prefix", "svc"], config).await;
    // every subcommand but the rate ones, which take no --prefix: run again without it
    assert!(succeeded >= live.len() * 6, "{succeeded} runs answered");
    let rate_only = run_everywhere(&live, &[], config).await;
    assert!(rate_only >= live.len() * 4, "{rate_only} runs answered");

    let dead = [free_port(), free_port()];
    let failing = [
        vec![format!("redis://:{PASSWORD}@127.0.0.1:{}/", dead[0])],
        vec![format!("redis://app:{PASSWORD}@127.0.0.1:{}/", dead[0])],
        vec![format!("rediss://:{PASSWORD}@127.0.0.1:{port}/")],
        vec![format!("redis+unix:///nonexistent/r.sock?pass={PASSWORD}")],
        vec![format!("redis://:{PASSWORD}@:{}/", dead[0])],
        vec![format!("redis://:{PASSWORD}/with/slash@127.0.0.1:{port}/")],
        // a cluster's nodes: nothing answers, or no cluster
        vec![
            format!("redis://:{PASSWORD}@127.0.0.1:{}/", dead[0]),
            format!("redis://:{PASSWORD}@127.0.0.1:{}/", dead[1]),
        ],
        vec![
            format!("redis://:{PASSWORD}@127.0.0.1:{port}/"),
            format!("valkey://:{PASSWORD}@127.0.0.1:{port}/"),
        ],
    ];
    let succeeded = run_everywhere(&failing, &[], config).await;
    assert_eq!(succeeded, 0, "no failing store answered");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_password_or_key_on_postgres() {
    let server = tokio::task::spawn_blocking(PgServer::start)
        .await
        .unwrap()
        .unwrap_or_else(|e| panic!("{e}"));
    let port = server.port();
    PgStore::builder(server.url())
        .schema("svc_limits")
        .purge_interval(None)
        .connect()
        .await
        .unwrap();
    let (_dir, config) = write_config(TOLLGATE_TOML);
    let config = config.to_str().unwrap();
    // the test server trusts local connections: the password is planted, and not checked
    let live = [
        format!("postgres://postgres:{PASSWORD}@127.0.0.1:{port}/postgres"),
        format!("postgresql://127.0.0.1:{port}/postgres?user=postgres&password={PASSWORD}"),
        format!("host=127.0.0.1 port={port} user=postgres password={PASSWORD} dbname=postgres"),
        format!("host=127.0.0.1 port={port} user=postgres password='{PASSWORD} \\' x'"),
    ]
    .map(|url| vec![url]);
    let extra = ["--pg-schema", "svc_limits"];
    let succeeded = run_everywhere(&live, &extra, config).await;
    assert!(succeeded >= live.len() * 8, "{succeeded} runs answered");

    let dead = free_port();
    let failing = [
        vec![format!("postgres://app:{PASSWORD}@127.0.0.1:{dead}/app")],
        vec![format!("host=127.0.0.1 port={dead} password={PASSWORD}")],
        vec![format!("host=127.0.0.1 port={port} password='{PASSWORD}")],
        vec![format!(
            "postgres://127.0.0.1:{port}/postgres?password={PASSWORD}&sslmode=x"
        )],
        vec![format!(
            "postgres://:{PASSWORD}@127.0.0.1:notaport/postgres"
        )],
        // the service's schema is not there
        vec![format!(
            "postgres://postgres:{PASSWORD}@127.0.0.1:{port}/postgres?user=x"
        )],
    ];
    let succeeded = run_everywhere(&failing, &["--pg-schema", "absent"], config).await;
    assert_eq!(succeeded, 0, "no failing store answered");
}

#[tokio::test]
async fn refused_command_lines_repeat_no_secret() {
    let (_dir, config) = write_config(TOLLGATE_TOML);
    let config = config.to_str().unwrap();
    let url = format!("redis://:{PASSWORD}@127.0.0.1:1/");
    let pg = format!("host=db password={PASSWORD}");
    let header = format!("x-api-key={API_KEY}");
    let bad_value = format!("x-api-key={API_KEY}\u{7f}");
    let inline_store = format!("--store={url}");
    let inline_header = format!("--header={API_KEY}");
    let check_header = format!("authorization: Bearer {API_KEY}\u{7f}");
    let target = format!("http://user:{PASSWORD}@127.0.0.1:1");
    let target_with_query = format!("{target}/?q=1");
    let lines: Vec<Vec<&str>> = vec![
        // a header value that is not one, and a pair without `=`
        vec![
            "inspect", "--store", &url, "--config", config, "--header", &bad_value,
        ],
        vec![
            "inspect", "--store", &url, "--config", config, "--header", API_KEY,
        ],
        vec!["inspect", &inline_store, "--config", config, &inline_header],
        vec![
            "inspect", "--store", &url, "--config", config, "--key-fn", API_KEY,
        ],
        vec![
            "inspect",
            "record",
            "k",
            "--store",
            &url,
            "--scope-header",
            API_KEY,
        ],
        // two callers, an unknown flag, a stray argument, a bad timeout
        vec![
            "inspect", "--store", &url, "--config", config, "--header", &header, "--key-fn",
            &header,
        ],
        vec![
            "inspect", "--store", &url, "--config", config, "--header", &header, "--bogus", &url,
        ],
        vec!["inspect", "lock", "nightly", "--store", &pg, &url],
        vec![
            "inspect",
            "lock",
            "nightly",
            "--store",
            &url,
            "--timeout",
            &url,
        ],
        vec![
            "reset",
            "--store",
            &pg,
            "--config",
            config,
            "--header",
            &header,
            "--cluster",
        ],
        vec![
            "inspect", "lock", "nightly", "--store", &url, "--store", &pg,
        ],
        // no store at all
        vec!["inspect", "lock", "nightly"],
        // check: a credential in a header and in a target's user info
        vec!["check", "--target", &target, "-H", &check_header, "/"],
        vec![
            "check",
            "--target",
            &target,
            "--requests",
            "1",
            "--timeout",
            "1s",
            "/",
        ],
        vec!["check", "--target", &target_with_query, "/"],
    ];
    for line in lines {
        let run = tollgate(&line, None).await;
        assert_hidden(&format!("{line:?}"), &run);
        assert_ne!(run.code, 0, "{line:?}: {run:?}");
        assert!(!run.stderr.is_empty(), "{line:?} says why: {run:?}");
    }
    // the environment's password stays hidden too, and --store wins over it
    let run = tollgate(&["inspect", "lock", "nightly", "--store", &pg], Some(&url)).await;
    assert_hidden("--store beside TOLLGATE_STORE", &run);
    assert!(run.stderr.contains("host=db password=***"), "{run:?}");
    let run = tollgate(&["inspect", "lock", "nightly"], Some(&pg)).await;
    assert_hidden("TOLLGATE_STORE alone", &run);
    assert!(run.stderr.contains("host=db password=***"), "{run:?}");
}
