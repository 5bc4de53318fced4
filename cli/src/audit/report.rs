//! The findings printed: text for a reader, JSON for a script, SARIF for code scanning.

use std::fmt::Write;

use serde_json::{Value, json};

use super::Finding;
use super::kind::Kind;

/// Findings grouped by file, each with its fix, and a summary line.
pub(crate) fn text(findings: &[Finding], files_read: usize) -> String {
    let mut out = String::new();
    let mut current: Option<&str> = None;
    let mut files = 0;
    for finding in findings {
        if current != Some(finding.file.as_str()) {
            if current.is_some() {
                out.push('\n');
            }
            current = Some(&finding.file);
            files += 1;
            let _ = writeln!(out, "{}", finding.file);
        }
        let _ = writeln!(
            out,
            "  line {}: {} [{}]",
            finding.line,
            finding.message,
            finding.kind.id()
        );
        let _ = writeln!(out, "    fix: {}", finding.fix);
    }
    let read = plural(files_read, "file");
    if findings.is_empty() {
        let _ = writeln!(out, "no state kept in process memory found ({read} read)");
    } else {
        let _ = writeln!(
            out,
            "\n{} in {} ({read} read)",
            plural(findings.len(), "finding"),
            plural(files, "file")
        );
    }
    out
}

fn plural(n: usize, word: &str) -> String {
    if n == 1 {
        format!("1 {word}")
    } else {
        format!("{n} {word}s")
    }
}

/// A JSON array of `{file, line, kind, message, fix}`.
pub(crate) fn json(findings: &[Finding]) -> Result<String, serde_json::Error> {
    serde_json::to_string_pretty(findings)
}

/// A SARIF 2.1.0 log with one run: the rules are the kinds, a result per finding.
pub(crate) fn sarif(findings: &[Finding]) -> Result<String, serde_json::Error> {
    let rules: Vec<Value> = Kind::ALL
        .iter()
        .map(|kind| {
            json!({
                "id": kind.id(),
                "name": kind.id(),
                "shortDescription": { "text": kind.summary() },
                "help": { "text": kind.fix() },
                "defaultConfiguration": { "level": "warning" },
            })
        })
        .collect();
    let results: Vec<Value> = findings
        .iter()
        .map(|finding| {
            let index = Kind::ALL.iter().position(|k| *k == finding.kind);
            json!({
                "ruleId": finding.kind.id(),
                "ruleIndex": index,
                "level": "warning",
                "message": { "text": format!("{} Fix: {}.", capitalized(&finding.message), finding.fix) },
                "locations": [{
                    "physicalLocation": {
                        "artifactLocation": { "uri": finding.file },
                        "region": { "startLine": finding.line },
                    }
                }],
            })
        })
        .collect();
    let log = json!({
        "$schema": "https://json.schemastore.org/sarif-2.1.0.json",
        "version": "2.1.0",
        "runs": [{
            "tool": {
                "driver": {
                    "name": "tollgate",
                    "version": env!("CARGO_PKG_VERSION"),
                    "informationUri": super::DOCS_URI,
                    "rules": rules,
                }
            },
            "results": results,
        }],
    });
    serde_json::to_string_pretty(&log)
}

fn capitalized(text: &str) -> String {
    let mut chars = text.chars();
    match chars.next() {
        Some(first) => first.to_uppercase().chain(chars).collect(),
        None => String::new(),
    }
}
