//! `tollgate audit` run as a binary on the fixtures in `tests/fixtures/audit`: the exact
//! findings of each, the exit codes, and the JSON and SARIF shapes.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::Value;

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/audit")
        .join(name)
}

struct Run {
    code: i32,
    stdout: String,
    stderr: String,
}

fn tollgate(args: &[&str]) -> Run {
    let output = Command::new(env!("CARGO_BIN_EXE_tollgate"))
        .args(args)
        .output()
        .unwrap();
    Run {
        code: output.status.code().unwrap(),
        stdout: String::from_utf8(output.stdout).unwrap(),
        stderr: String::from_utf8(output.stderr).unwrap(),
    }
}

fn audit_json(path: &Path, extra: &[&str]) -> (i32, Vec<Value>) {
    let mut args = vec!["audit", path.to_str().unwrap(), "--format", "json"];
    args.extend_from_slice(extra);
    let run = tollgate(&args);
    let out: Value = serde_json::from_str(&run.stdout).unwrap();
    let findings = out["findings"].as_array().unwrap().clone();
    (run.code, findings)
}

fn triples(findings: &[Value]) -> BTreeSet<(String, u64, String)> {
    findings
        .iter()
        .map(|f| {
            (
                f["file"].as_str().unwrap().to_owned(),
                f["line"].as_u64().unwrap(),
                f["kind"].as_str().unwrap().to_owned(),
            )
        })
        .collect()
}

fn set(expected: &[(&str, u64, &str)]) -> BTreeSet<(String, u64, String)> {
    expected
        .iter()
        .map(|(file, line, kind)| ((*file).to_owned(), *line, (*kind).to_owned()))
        .collect()
}

/// Every place state is recognised by its type, listed with `--all`: the fixture's items are
/// declared and barely used, so most are `in-process-state` (no use seen); limiters, stores,
/// semaphores, names of work done and caches keep their kind.
const POSITIVES: &[(&str, u64, &str)] = &[
    ("src/actix.rs", 7, "in-process-state"),
    ("src/actix.rs", 8, "in-process-state"),
    ("src/grpc.rs", 10, "already-done"),
    ("src/grpc.rs", 19, "in-process-state"),
    ("src/limits.rs", 11, "in-process-rate-limit"),
    ("src/limits.rs", 12, "in-process-concurrency-limit"),
    ("src/limits.rs", 14, "in-process-rate-limit"),
    ("src/limits.rs", 15, "in-process-concurrency-limit"),
    ("src/limits.rs", 16, "in-process-rate-limit"),
    ("src/limits.rs", 17, "in-process-rate-limit"),
    ("src/limits.rs", 23, "in-process-store"),
    ("src/limits.rs", 24, "in-process-store"),
    ("src/registry.rs", 10, "in-process-state"),
    ("src/registry.rs", 19, "already-done"),
    ("src/registry.rs", 32, "already-done"),
    ("src/registry.rs", 40, "in-process-state"),
    ("src/state.rs", 17, "in-process-state"),
    ("src/state.rs", 18, "in-process-state"),
    ("src/state.rs", 19, "in-process-concurrency-limit"),
    ("src/state.rs", 20, "already-done"),
    ("src/state.rs", 27, "in-process-cache"),
    ("src/state.rs", 31, "in-process-state"),
    ("src/state.rs", 40, "in-process-state"),
    ("src/statics.rs", 11, "in-process-state"),
    ("src/statics.rs", 14, "in-process-state"),
    ("src/statics.rs", 16, "in-process-counter"),
    ("src/statics.rs", 18, "in-process-state"),
    ("src/statics.rs", 20, "in-process-state"),
    ("src/statics.rs", 22, "in-process-cache"),
    ("src/statics.rs", 24, "in-process-concurrency-limit"),
    ("src/statics.rs", 26, "in-process-state"),
    ("src/statics.rs", 28, "in-process-cache"),
    ("src/statics.rs", 31, "already-done"),
    ("src/statics.rs", 33, "in-process-state"),
    ("src/statics.rs", 37, "in-process-state"),
    ("src/statics.rs", 42, "in-process-state"),
    ("src/statics.rs", 47, "in-process-state"),
];

/// Without `--all`: what is judged by its use or its library, not memoising caches nor state
/// whose use is not seen.
fn reported(all: &[(&'static str, u64, &'static str)]) -> Vec<(&'static str, u64, &'static str)> {
    all.iter()
        .copied()
        .filter(|(_, _, kind)| *kind != "in-process-state" && *kind != "in-process-cache")
        .collect()
}

#[test]
fn positives_are_exactly_the_expected_findings() {
    let (code, findings) = audit_json(&fixture("positives"), &["--all"]);
    assert_eq!(code, 1);
    assert_eq!(findings.len(), POSITIVES.len());
    assert_eq!(triples(&findings), set(POSITIVES));
    for finding in &findings {
        let object = finding.as_object().unwrap();
        let keys: BTreeSet<&str> = object.keys().map(String::as_str).collect();
        assert_eq!(
            keys,
            BTreeSet::from([
                "file", "line", "kind", "place", "used_as", "message", "evidence", "breaks", "fix"
            ])
        );
        assert!(!finding["message"].as_str().unwrap().is_empty());
        assert!(!finding["breaks"].as_str().unwrap().is_empty());
    }
    let (code, findings) = audit_json(&fixture("positives"), &[]);
    assert_eq!(code, 1);
    assert_eq!(triples(&findings), set(&reported(POSITIVES)));
}

/// The shapes judged by use, one file each.
const USES: &[(&str, u64, &str)] = &[
    // an actor's counters: per site, compared with a limit; a total
    ("src/actor.rs", 7, "in-process-rate-limit"),
    ("src/actor.rs", 8, "in-process-counter"),
    // a `DashMap` handed by reference to a helper that counts and compares
    ("src/handed.rs", 8, "in-process-rate-limit"),
    // a `DashMap` counted and compared
    ("src/limiter.rs", 9, "in-process-rate-limit"),
    // a static `Mutex<()>` and a map of per-key mutexes, their guards held around the work
    ("src/lock.rs", 7, "in-process-lock"),
    ("src/lock.rs", 16, "in-process-lock"),
    // a set checked, then inserted around the work, named `recent`
    ("src/nonce.rs", 8, "already-done"),
    // a cache invalidated where the data changes
    ("src/own.rs", 16, "in-process-record"),
    // connections registered by user and sent to; a broadcast channel connections subscribe
    // to (not the mpsc queue beside it)
    ("src/subscribers.rs", 9, "in-process-subscribers"),
    ("src/subscribers.rs", 30, "in-process-subscribers"),
    // a map owned by a spawned task fed by a channel
    ("src/task.rs", 14, "in-process-record"),
];

fn finding_at<'f>(findings: &'f [Value], file: &str, line: u64) -> &'f Value {
    findings
        .iter()
        .find(|f| f["file"] == file && f["line"] == line)
        .unwrap()
}

#[test]
fn state_is_judged_by_its_use() {
    let (code, findings) = audit_json(&fixture("uses"), &[]);
    assert_eq!(code, 1);
    assert_eq!(triples(&findings), set(USES));

    // the nonce set: "already done" by its use, with the lines that check and insert
    let nonce = finding_at(&findings, "src/nonce.rs", 8);
    assert_eq!(nonce["used_as"], "checked, then inserted around the work");
    assert_eq!(nonce["place"], "state");
    assert_eq!(
        nonce["evidence"],
        serde_json::json!([
            { "file": "src/nonce.rs", "line": 12, "what": "checked" },
            { "file": "src/nonce.rs", "line": 16, "what": "written" },
        ])
    );
    assert!(
        nonce["fix"]
            .as_str()
            .unwrap()
            .contains("`tollgate::claim::Claims`")
    );

    // the `DashMap` limiter gets the rate-limit advice
    let limiter = finding_at(&findings, "src/limiter.rs", 9);
    assert_eq!(limiter["used_as"], "counted and compared with a limit");
    assert_eq!(
        limiter["evidence"],
        serde_json::json!([
            { "file": "src/limiter.rs", "line": 16, "what": "counted" },
            { "file": "src/limiter.rs", "line": 17, "what": "compared" },
        ])
    );
    assert!(
        limiter["fix"]
            .as_str()
            .unwrap()
            .contains("`tollgate::rate_limit::RateLimitLayer`")
    );
    assert_eq!(
        limiter["breaks"],
        "each copy counts on its own, so N copies let a caller through N times the limit"
    );

    // followed into the function it is handed to
    assert_eq!(
        finding_at(&findings, "src/handed.rs", 8)["evidence"],
        serde_json::json!([
            { "file": "src/handed.rs", "line": 17, "what": "counted" },
            { "file": "src/handed.rs", "line": 18, "what": "compared" },
        ])
    );

    // the actor's counters, reached through its address
    assert_eq!(finding_at(&findings, "src/actor.rs", 7)["place"], "actor");
    assert_eq!(finding_at(&findings, "src/actor.rs", 8)["place"], "actor");
    // the task's own map
    let task = finding_at(&findings, "src/task.rs", 14);
    assert_eq!(task["place"], "task");
    assert_eq!(
        task["used_as"],
        "filled from the messages the task receives"
    );
    // the lock's advice: a lease with a fencing token
    let lock = finding_at(&findings, "src/lock.rs", 7);
    assert_eq!(lock["used_as"], "locked around the work");
    assert_eq!(
        lock["evidence"],
        serde_json::json!([{ "file": "src/lock.rs", "line": 10, "what": "locked, the guard held" }])
    );
    assert!(
        lock["fix"]
            .as_str()
            .unwrap()
            .contains("`tollgate::lock::Locks`")
    );
    assert!(lock["fix"].as_str().unwrap().contains("fencing token"));
    assert_eq!(
        task["evidence"],
        serde_json::json!([{ "file": "src/task.rs", "line": 16, "what": "written" }])
    );
}

#[test]
fn memoising_caches_and_per_connection_state_are_not_findings() {
    let (_, findings) = audit_json(&fixture("uses"), &["--all"]);
    let mut expected = USES.to_vec();
    // memoising caches, a round-robin index, counts handed on as increments: `--all` only
    expected.push(("src/memo.rs", 9, "in-process-cache"));
    expected.push(("src/memo.rs", 10, "in-process-cache"));
    expected.push(("src/own.rs", 7, "in-process-state"));
    expected.push(("src/own.rs", 15, "in-process-state"));
    assert_eq!(triples(&findings), set(&expected));
    let profiles = finding_at(&findings, "src/memo.rs", 10);
    assert_eq!(profiles["used_as"], "memoises fetched or computed data");
    assert_eq!(
        finding_at(&findings, "src/own.rs", 7)["used_as"],
        "an index taken round a list"
    );
    assert_eq!(
        finding_at(&findings, "src/own.rs", 15)["used_as"],
        "counted, then drained and handed on as increments"
    );
    let tokens = finding_at(&findings, "src/own.rs", 16);
    assert_eq!(
        tokens["used_as"],
        "cached, and invalidated when the data changes"
    );
    assert_eq!(
        tokens["evidence"],
        serde_json::json!([
            { "file": "src/own.rs", "line": 31, "what": "computed on a miss" },
            { "file": "src/own.rs", "line": 36, "what": "removed from" },
        ])
    );
    let hub = finding_at(&findings, "src/subscribers.rs", 9);
    assert!(hub["fix"].as_str().unwrap().contains("`PUBLISH`"));
    let chat = finding_at(&findings, "src/subscribers.rs", 30);
    assert_eq!(chat["used_as"], "subscribed to by connections and sent to");
    assert_eq!(
        chat["evidence"],
        serde_json::json!([{ "file": "src/subscribers.rs", "line": 35, "what": "subscribed to" }])
    );
    // `ConnState`, built per connection in a function given the socket, `State`, built by its
    // own constructor in a function given a TCP stream, and `RequestLog`, built per request in
    // a function given the request, are never listed
    assert!(findings.iter().all(|f| f["file"] != "src/connection.rs"));
}

#[test]
fn a_known_type_is_reported_with_its_kind() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::create_dir(dir.path().join("src")).unwrap();
    std::fs::write(
        dir.path().join("src/lib.rs"),
        "use std::sync::Arc;\n\
         #[derive(Clone)]\n\
         pub struct AppState {\n\
         \x20   limiter: Arc<quota::Bucket>,\n\
         \x20   sessions: Arc<sess::Sessions>,\n\
         }\n\
         pub fn app() { let _ = tower_sessions::MemoryStore::default(); }\n",
    )
    .unwrap();
    std::fs::write(
        dir.path().join("tollgate-audit.toml"),
        "[known-types]\n\"sess::Sessions\" = \"store\"\n",
    )
    .unwrap();
    let (code, findings) = audit_json(dir.path(), &["--known-type", "quota::Bucket=rate-limit"]);
    assert_eq!(code, 1);
    assert_eq!(
        triples(&findings),
        set(&[
            ("src/lib.rs", 4, "in-process-rate-limit"),
            ("src/lib.rs", 5, "in-process-store"),
            ("src/lib.rs", 7, "in-process-store"),
        ])
    );
    assert_eq!(finding_at(&findings, "src/lib.rs", 4)["place"], "library");
    let run = tollgate(&[
        "audit",
        dir.path().to_str().unwrap(),
        "--known-type",
        "quota::Bucket=fast",
    ]);
    assert_eq!(run.code, 2);
    assert!(run.stderr.contains("unknown kind `fast`"), "{}", run.stderr);
}

#[test]
fn negatives_report_nothing() {
    let run = tollgate(&["audit", fixture("negatives").to_str().unwrap()]);
    assert_eq!(run.code, 0, "{}", run.stdout);
    assert_eq!(
        run.stdout,
        "no state kept in process memory found (1 file read)\n"
    );
    assert_eq!(run.stderr, "");
    let (code, findings) = audit_json(&fixture("negatives"), &[]);
    assert_eq!(code, 0);
    assert!(findings.is_empty());
}

#[test]
fn tests_folders_are_read_only_when_asked() {
    let (code, findings) = audit_json(&fixture("negatives"), &["--include-tests", "--all"]);
    assert_eq!(code, 1);
    assert_eq!(
        triples(&findings),
        set(&[("tests/helpers.rs", 4, "in-process-state")])
    );
    let (code, findings) = audit_json(&fixture("negatives"), &["--all"]);
    assert_eq!(code, 0);
    assert!(findings.is_empty());
}

#[test]
fn excluded_paths_are_skipped() {
    let (code, findings) = audit_json(
        &fixture("positives"),
        &[
            "--all",
            "--exclude",
            "src/statics.rs",
            "--exclude",
            "src/limits.rs",
        ],
    );
    assert_eq!(code, 1);
    let expected: Vec<_> = POSITIVES
        .iter()
        .copied()
        .filter(|(file, _, _)| *file != "src/statics.rs" && *file != "src/limits.rs")
        .collect();
    assert_eq!(triples(&findings), set(&expected));
}

#[test]
fn one_file_is_audited_alone() {
    let file = fixture("positives").join("src/grpc.rs");
    let (code, findings) = audit_json(&file, &[]);
    assert_eq!(code, 1);
    assert_eq!(triples(&findings), set(&[("grpc.rs", 10, "already-done")]));
}

#[test]
fn a_file_that_does_not_parse_is_a_warning_and_skipped() {
    let path = fixture("broken");
    let run = tollgate(&["audit", path.to_str().unwrap()]);
    assert_eq!(run.code, 1);
    assert_eq!(
        run.stdout,
        "src/good.rs\n  line 3: a process-wide `AtomicUsize` in `static HITS`, held in a static: \
         counted [in-process-counter]\n    seen: counted line 6\n    breaks: N copies keep N \
         separate totals and hand out the same numbers\n    fix: count with one atomic \
         increment in the shared store (Redis `INCR`, a database sequence or `UPDATE … SET n = \
         n + 1 RETURNING n`)\n\nskipped src/bad.rs: does not parse at 1:20: cannot parse \
         string into token stream\n\n1 finding in 1 file (1 file read, 1 file skipped)\n"
    );
    assert_eq!(
        run.stderr,
        "warning: src/bad.rs: skipped: does not parse at 1:20: cannot parse string into token \
         stream\n"
    );
    let (code, findings) = audit_json(&path, &[]);
    assert_eq!(code, 1);
    assert_eq!(
        triples(&findings),
        set(&[("src/good.rs", 3, "in-process-counter")])
    );
    let run = tollgate(&["audit", path.to_str().unwrap(), "--format", "json"]);
    let out: Value = serde_json::from_str(&run.stdout).unwrap();
    assert_eq!(
        out["skipped"],
        serde_json::json!([{
            "file": "src/bad.rs",
            "reason": "does not parse at 1:20: cannot parse string into token stream"
        }])
    );
    assert_eq!(out["files_read"], 1);
    let run = tollgate(&["audit", path.to_str().unwrap(), "--format", "sarif"]);
    let log: Value = serde_json::from_str(&run.stdout).unwrap();
    let notes = &log["runs"][0]["invocations"][0]["toolExecutionNotifications"];
    assert_eq!(notes.as_array().unwrap().len(), 1);
    assert_eq!(
        notes[0]["locations"][0]["physicalLocation"]["artifactLocation"]["uri"],
        "src/bad.rs"
    );
}

#[test]
fn an_unreadable_path_is_an_error() {
    let run = tollgate(&["audit", "/nonexistent/tollgate-audit-path"]);
    assert_eq!(run.code, 2);
    assert_eq!(run.stdout, "");
    assert!(
        run.stderr
            .starts_with("error: /nonexistent/tollgate-audit-path: "),
        "{}",
        run.stderr
    );
}

#[test]
fn a_bad_format_is_an_error() {
    let run = tollgate(&["audit", "--format", "xml", "."]);
    assert_eq!(run.code, 2);
}

#[test]
fn sarif_has_the_shape_code_scanning_reads() {
    let path = fixture("positives");
    let run = tollgate(&[
        "audit",
        path.to_str().unwrap(),
        "--format",
        "sarif",
        "--all",
    ]);
    assert_eq!(run.code, 1);
    let log: Value = serde_json::from_str(&run.stdout).unwrap();
    assert_eq!(log["version"], "2.1.0");
    assert_eq!(
        log["$schema"],
        "https://json.schemastore.org/sarif-2.1.0.json"
    );
    let runs = log["runs"].as_array().unwrap();
    assert_eq!(runs.len(), 1);
    let driver = &runs[0]["tool"]["driver"];
    assert_eq!(driver["name"], "tollgate");
    assert!(
        driver["informationUri"]
            .as_str()
            .unwrap()
            .starts_with("https://")
    );
    let rules = driver["rules"].as_array().unwrap();
    let rule_ids: Vec<&str> = rules.iter().map(|r| r["id"].as_str().unwrap()).collect();
    assert_eq!(
        rule_ids,
        [
            "already-done",
            "in-process-rate-limit",
            "in-process-lock",
            "in-process-concurrency-limit",
            "in-process-record",
            "in-process-subscribers",
            "in-process-counter",
            "in-process-store",
            "in-process-cache",
            "in-process-state",
        ]
    );
    // the fix for each use is the rule's help
    let help = rules[1]["help"]["text"].as_str().unwrap();
    assert!(
        help.starts_with("With N copies: each copy counts on its own"),
        "{help}"
    );
    assert!(
        help.contains("`tollgate::rate_limit::RateLimitLayer`"),
        "{help}"
    );
    for rule in rules {
        assert!(!rule["help"]["markdown"].as_str().unwrap().is_empty());
        assert!(
            !rule["shortDescription"]["text"]
                .as_str()
                .unwrap()
                .is_empty()
        );
    }
    let results = runs[0]["results"].as_array().unwrap();
    assert_eq!(results.len(), POSITIVES.len());
    let mut seen = BTreeSet::new();
    for result in results {
        let note = matches!(rule_of(result), "in-process-state" | "in-process-cache");
        assert_eq!(result["level"], if note { "note" } else { "warning" });
        let rule = result["ruleId"].as_str().unwrap();
        let index = result["ruleIndex"].as_u64().unwrap() as usize;
        assert_eq!(rule_ids[index], rule);
        assert!(!result["message"]["text"].as_str().unwrap().is_empty());
        let locations = result["locations"].as_array().unwrap();
        assert_eq!(locations.len(), 1);
        let physical = &locations[0]["physicalLocation"];
        seen.insert((
            physical["artifactLocation"]["uri"]
                .as_str()
                .unwrap()
                .to_owned(),
            physical["region"]["startLine"].as_u64().unwrap(),
            rule.to_owned(),
        ));
    }
    assert_eq!(seen, set(POSITIVES));
}

fn rule_of(result: &Value) -> &str {
    result["ruleId"].as_str().unwrap()
}

#[test]
fn sarif_without_findings_has_no_results() {
    let path = fixture("negatives");
    let run = tollgate(&["audit", path.to_str().unwrap(), "--format", "sarif"]);
    assert_eq!(run.code, 0);
    let log: Value = serde_json::from_str(&run.stdout).unwrap();
    assert_eq!(log["runs"][0]["results"], Value::Array(Vec::new()));
}

#[test]
fn a_file_nested_too_deeply_is_skipped_not_a_crash() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::create_dir(dir.path().join("src")).unwrap();
    let deep = format!(
        "pub fn f() -> u32 {{ {}1{} }}\n",
        "(".repeat(3_000),
        ")".repeat(3_000)
    );
    std::fs::write(dir.path().join("src/deep.rs"), deep).unwrap();
    // deep but within the bound, and long chains: read
    let chains = format!(
        "pub fn g() -> u32 {{ {}1{} }}\npub fn h() -> u32 {{ 1{} }}\n",
        "(".repeat(500),
        ")".repeat(500),
        " + 1".repeat(20_000)
    );
    std::fs::write(dir.path().join("src/long.rs"), chains).unwrap();
    let run = tollgate(&["audit", dir.path().to_str().unwrap(), "--format", "json"]);
    assert_eq!(run.code, 0, "{}", run.stderr);
    let out: Value = serde_json::from_str(&run.stdout).unwrap();
    assert_eq!(out["files_read"], 1);
    assert_eq!(
        out["skipped"],
        serde_json::json!([{
            "file": "src/deep.rs",
            "reason": "nested 3001 levels deep, more than the 1000 the audit reads"
        }])
    );
}
