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
    let findings: Vec<Value> = serde_json::from_str(&run.stdout).unwrap();
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

/// Every pattern the audit reports, one finding each; the allowed, test-only and tollgate
/// items in the same files are not reported.
const POSITIVES: &[(&str, u64, &str)] = &[
    // actix `app_data(visits.clone())`, `visits` bound to `web::Data::new(Visits { .. })`
    ("src/actix.rs", 7, "state-counter"),
    ("src/actix.rs", 8, "state-map"),
    // a tonic service: `#[tonic::async_trait] impl Greeter for MyGreeter`; `BillingServer::new`
    ("src/grpc.rs", 10, "seen-set"),
    ("src/grpc.rs", 19, "state-counter"),
    // tower's and governor's limiters; tollgate's `RateLimitLayer::builder` is not one
    ("src/limits.rs", 11, "in-process-rate-limit"),
    ("src/limits.rs", 12, "in-process-concurrency-limit"),
    ("src/limits.rs", 14, "in-process-rate-limit"),
    ("src/limits.rs", 15, "in-process-concurrency-limit"),
    ("src/limits.rs", 16, "in-process-rate-limit"),
    ("src/limits.rs", 17, "in-process-rate-limit"),
    // tollgate's own in-process store, but not where allowed
    ("src/limits.rs", 23, "in-process-store"),
    ("src/limits.rs", 24, "in-process-store"),
    // a `Clone` handle to shared locks; an enum's variant in a `*Context`; allowed fields not
    ("src/registry.rs", 10, "state-map"),
    ("src/registry.rs", 19, "seen-set"),
    // the owner's name says "already done"; an alias of `Arc<RwLock<..>>` in a `Clone` struct
    ("src/registry.rs", 32, "seen-set"),
    ("src/registry.rs", 40, "state-map"),
    // axum: the fields of `State<AppState>` (not its config nor pool), a struct inside it, an
    // alias handed as `State<Db>`, an `Extension<Arc<Mutex<..>>>` once for its two handlers
    ("src/state.rs", 17, "state-map"),
    ("src/state.rs", 18, "state-counter"),
    ("src/state.rs", 19, "state-semaphore"),
    ("src/state.rs", 20, "seen-set"),
    ("src/state.rs", 27, "state-cache"),
    ("src/state.rs", 31, "state-map"),
    ("src/state.rs", 40, "state-mutex"),
    // statics: LazyLock, a bare Mutex, an atomic, once_cell, OnceLock, moka, a semaphore,
    // `static mut`, a lock named as a cache, lazy_static!, thread_local!, inside cfg_if!, and
    // an allow comment without a reason (which silences nothing)
    ("src/statics.rs", 11, "static-map"),
    ("src/statics.rs", 14, "static-mutex"),
    ("src/statics.rs", 16, "static-counter"),
    ("src/statics.rs", 18, "static-map"),
    ("src/statics.rs", 20, "static-mutex"),
    ("src/statics.rs", 22, "static-cache"),
    ("src/statics.rs", 24, "static-semaphore"),
    ("src/statics.rs", 26, "static-counter"),
    ("src/statics.rs", 28, "static-cache"),
    ("src/statics.rs", 31, "seen-set"),
    ("src/statics.rs", 33, "static-counter"),
    ("src/statics.rs", 37, "static-map"),
    ("src/statics.rs", 42, "static-mutex"),
    ("src/statics.rs", 47, "static-counter"),
];

#[test]
fn positives_are_exactly_the_expected_findings() {
    let (code, findings) = audit_json(&fixture("positives"), &[]);
    assert_eq!(code, 1);
    assert_eq!(findings.len(), POSITIVES.len());
    assert_eq!(triples(&findings), set(POSITIVES));
    for finding in &findings {
        let object = finding.as_object().unwrap();
        let keys: BTreeSet<&str> = object.keys().map(String::as_str).collect();
        assert_eq!(
            keys,
            BTreeSet::from(["file", "line", "kind", "message", "fix"])
        );
        assert!(!finding["message"].as_str().unwrap().is_empty());
        assert!(finding["fix"].as_str().unwrap().contains("tollgate::"));
    }
}

#[test]
fn messages_name_the_item_and_fixes_name_tollgate_types() {
    let (_, findings) = audit_json(&fixture("positives"), &[]);
    let at = |file: &str, line: u64| {
        findings
            .iter()
            .find(|f| f["file"] == file && f["line"] == line)
            .unwrap()
    };
    let sessions = at("src/statics.rs", 11);
    assert_eq!(
        sessions["message"],
        "a process-wide `LazyLock<Mutex<HashMap<..>>>` in `static SESSIONS`: each copy has its \
         own, so a record written on one copy is not seen by the others"
    );
    assert!(
        sessions["fix"]
            .as_str()
            .unwrap()
            .contains("`tollgate::claim::Claims`")
    );
    let redeemed = at("src/state.rs", 20);
    assert_eq!(
        redeemed["message"],
        "`Arc<DashSet<String>>` in field `redeemed` of `AppState`, the application's shared \
         state: each copy remembers only what it handled itself, so a repeat that reaches another \
         copy is done again"
    );
    assert!(
        redeemed["fix"]
            .as_str()
            .unwrap()
            .contains("`tollgate::idempotency::IdempotencyLayer`")
    );
    assert!(
        at("src/limits.rs", 11)["fix"]
            .as_str()
            .unwrap()
            .contains("`tollgate::rate_limit::RateLimitLayer`")
    );
    assert!(
        at("src/limits.rs", 12)["fix"]
            .as_str()
            .unwrap()
            .contains("`tollgate::concurrency::ConcurrencyLimitLayer`")
    );
    assert!(
        at("src/statics.rs", 14)["fix"]
            .as_str()
            .unwrap()
            .contains("`tollgate::lock::Locks`")
    );
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
    let (code, findings) = audit_json(&fixture("negatives"), &["--include-tests"]);
    assert_eq!(code, 1);
    assert_eq!(
        triples(&findings),
        set(&[("tests/helpers.rs", 4, "static-mutex")])
    );
}

#[test]
fn excluded_paths_are_skipped() {
    let (code, findings) = audit_json(
        &fixture("positives"),
        &["--exclude", "src/statics.rs", "--exclude", "src/limits.rs"],
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
    assert_eq!(
        triples(&findings),
        set(&[
            ("grpc.rs", 10, "seen-set"),
            ("grpc.rs", 19, "state-counter")
        ])
    );
}

#[test]
fn a_file_that_does_not_parse_is_a_warning_and_skipped() {
    let path = fixture("broken");
    let run = tollgate(&["audit", path.to_str().unwrap()]);
    assert_eq!(run.code, 1);
    assert_eq!(
        run.stdout,
        "src/good.rs\n  line 3: a process-wide `AtomicUsize` in `static HITS`: each copy counts \
         on its own, so N copies keep N separate totals (and hand out the same numbers) \
         [static-counter]\n    fix: count in the shared store with one atomic increment (Redis \
         `INCR`, a database sequence); to limit a caller's requests use \
         `tollgate::rate_limit::RateLimitLayer`\n\n1 finding in 1 file (1 file read)\n"
    );
    assert_eq!(run.stderr.lines().count(), 1, "{}", run.stderr);
    assert!(run.stderr.starts_with("warning: "), "{}", run.stderr);
    assert!(run.stderr.contains("bad.rs:1:"), "{}", run.stderr);
    assert!(
        run.stderr.contains("does not parse, skipped"),
        "{}",
        run.stderr
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
    let run = tollgate(&["audit", path.to_str().unwrap(), "--format", "sarif"]);
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
            "static-mutex",
            "static-map",
            "static-counter",
            "static-cache",
            "static-semaphore",
            "state-mutex",
            "state-map",
            "state-counter",
            "state-cache",
            "state-semaphore",
            "seen-set",
            "in-process-rate-limit",
            "in-process-concurrency-limit",
            "in-process-store",
        ]
    );
    for rule in rules {
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
        assert_eq!(result["level"], "warning");
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

#[test]
fn sarif_without_findings_has_no_results() {
    let path = fixture("negatives");
    let run = tollgate(&["audit", path.to_str().unwrap(), "--format", "sarif"]);
    assert_eq!(run.code, 0);
    let log: Value = serde_json::from_str(&run.stdout).unwrap();
    assert_eq!(log["runs"][0]["results"], Value::Array(Vec::new()));
}
