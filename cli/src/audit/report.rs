//! The findings printed: text for a reader, JSON for a script, SARIF for code scanning.

use std::fmt::Write;

use serde_json::{Value, json};

use super::Outcome;
use super::kind::Kind;

/// Findings grouped by file, each with its evidence, what breaks and its fix; the skipped
/// files; a summary line.
pub(crate) fn text(outcome: &Outcome) -> String {
    let findings = &outcome.findings;
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
        if !finding.evidence.is_empty() {
            let shown: Vec<String> = finding
                .evidence
                .iter()
                .map(|e| {
                    if e.file == finding.file {
                        format!("{} line {}", e.what, e.line)
                    } else {
                        format!("{} {}:{}", e.what, e.file, e.line)
                    }
                })
                .collect();
            let _ = writeln!(out, "    seen: {}", shown.join("; "));
        }
        let _ = writeln!(out, "    breaks: {}", finding.breaks);
        let _ = writeln!(out, "    fix: {}", finding.fix);
    }
    let read = plural(outcome.read, "file");
    if !outcome.skipped.is_empty() {
        if !findings.is_empty() {
            out.push('\n');
        }
        for skipped in &outcome.skipped {
            let _ = writeln!(out, "skipped {}: {}", skipped.file, skipped.reason);
        }
    }
    let skipped = if outcome.skipped.is_empty() {
        String::new()
    } else {
        format!(", {} skipped", plural(outcome.skipped.len(), "file"))
    };
    if findings.is_empty() {
        let _ = writeln!(
            out,
            "no state kept in process memory found ({read} read{skipped})"
        );
    } else {
        let _ = writeln!(
            out,
            "\n{} in {} ({read} read{skipped})",
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

/// `{"findings": [..], "skipped": [{file, reason}], "files_read": n}`.
pub(crate) fn json(outcome: &Outcome) -> Result<String, serde_json::Error> {
    serde_json::to_string_pretty(&super::JsonOutcome {
        findings: &outcome.findings,
        skipped: &outcome.skipped,
        files_read: outcome.read,
    })
}

/// A SARIF 2.1.0 log with one run: the rules are the kinds (their `help` the fix for that
/// use), a result per finding with its evidence as related locations, and a notification
/// per skipped file.
pub(crate) fn sarif(outcome: &Outcome) -> Result<String, serde_json::Error> {
    let rules: Vec<Value> = Kind::ALL
        .iter()
        .map(|kind| {
            json!({
                "id": kind.id(),
                "name": kind.id(),
                "shortDescription": { "text": kind.summary() },
                "fullDescription": { "text": capitalized(kind.breaks()) + "." },
                "help": {
                    "text": format!("With N copies: {}. Fix: {}.", kind.breaks(), kind.fix()),
                    "markdown": format!("**With N copies:** {}.\n\n**Fix:** {}.", kind.breaks(), kind.fix()),
                },
                "defaultConfiguration": {
                    "level": if kind.only_with_all() { "note" } else { "warning" }
                },
            })
        })
        .collect();
    let results: Vec<Value> = outcome
        .findings
        .iter()
        .map(|finding| {
            let index = Kind::ALL.iter().position(|k| *k == finding.kind);
            let related: Vec<Value> = finding
                .evidence
                .iter()
                .enumerate()
                .map(|(id, e)| {
                    json!({
                        "id": id,
                        "message": { "text": e.what },
                        "physicalLocation": {
                            "artifactLocation": { "uri": e.file },
                            "region": { "startLine": e.line },
                        }
                    })
                })
                .collect();
            json!({
                "ruleId": finding.kind.id(),
                "ruleIndex": index,
                "level": if finding.kind.only_with_all() { "note" } else { "warning" },
                "message": { "text": format!("{}. With N copies: {}. Fix: {}.", capitalized(&finding.message), finding.breaks, finding.fix) },
                "locations": [{
                    "physicalLocation": {
                        "artifactLocation": { "uri": finding.file },
                        "region": { "startLine": finding.line },
                    }
                }],
                "relatedLocations": related,
                "properties": { "usedAs": finding.used_as, "place": finding.place },
            })
        })
        .collect();
    let notifications: Vec<Value> = outcome
        .skipped
        .iter()
        .map(|skipped| {
            json!({
                "level": "warning",
                "message": { "text": format!("skipped: {}", skipped.reason) },
                "locations": [{
                    "physicalLocation": { "artifactLocation": { "uri": skipped.file } }
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
            "invocations": [{
                "executionSuccessful": true,
                "toolExecutionNotifications": notifications,
            }],
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
