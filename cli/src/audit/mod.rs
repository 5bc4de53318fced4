//! `tollgate audit`: state kept in process memory that several copies of a service would not
//! share, found in the syntax trees of the Rust files under a path.

mod decide;
mod kind;
mod model;
mod report;
mod scan;
mod usage;

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use clap::{Args, ValueEnum};
use serde::Serialize;

use kind::{Kind, Place};
use model::{Model, SourceFile};
use scan::KnownType;

/// Where the findings' documentation is: the command's page.
pub(crate) const DOCS_URI: &str = "https://crates.io/crates/tollgate-cli";

pub(crate) const LONG_ABOUT: &str = "\
Report state kept in process memory that several copies of a service would not share, judged \
by how the code uses it.

Reads every `.rs` file under PATH (skipping `target/`, hidden folders, and `tests/`, `benches/` \
and `*test_utils/` unless --include-tests) with a Rust parser. Candidates are the locks, maps, \
sets, caches, counters and semaphores in statics, in the application's state (axum \
`State`/`Extension`, actix `web::Data`, Rocket `State`, tonic services, structs named \
`*State`/`*Context`), in actix actors and in tasks fed by a channel, and library types known \
to keep state in process memory (governor, tower's limits, in-process session stores, \
tollgate's `MemoryStore`; add your own with --known-type). Each candidate's reads and writes \
are followed through the crate and it is reported by its use: checked then inserted around \
work (already-done), counted and compared (rate limit), locked around a write (lock), written \
and read by other requests (record), counted (counter). A cache whose only use is memoising \
fetched or computed data is not reported (--all lists it), nor is state built per request, \
per connection or per thread. Each finding names the lines that show its use, what breaks \
with N copies and the fix. A comment `// tollgate: allow(<reason>)` above an item or a \
field, or at the end of its line, silences it.";

pub(crate) const AFTER_HELP: &str = "\
Examples:
  tollgate audit                       # the current directory
  tollgate audit services/billing --format json
  tollgate audit --format sarif . > tollgate.sarif   # for GitHub code scanning
  tollgate audit --all                 # memoising caches and unseen uses too
  tollgate audit --known-type quota::Bucket=rate-limit

Exit codes: 0 nothing found; 1 findings; 2 an error (an unreadable path, a bad --known-type or \
tollgate-audit.toml). A file that does not parse is listed as skipped with its reason (and named \
on stderr); it is not an error.";

/// The JSON document: the findings, the files skipped, the number of files read.
#[derive(Debug, Serialize)]
pub(crate) struct JsonOutcome<'a> {
    /// The findings.
    pub(crate) findings: &'a [Finding],
    /// The files not read, with the reason.
    pub(crate) skipped: &'a [Skipped],
    /// The number of files read.
    pub(crate) files_read: usize,
}

/// The output formats.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub(crate) enum Format {
    /// Findings grouped by file, each with its fix, and a summary line.
    Text,
    /// `{findings: [{file, line, kind, place, used_as, message, evidence, breaks, fix}],
    /// skipped: [{file, reason}], files_read}`.
    Json,
    /// SARIF 2.1.0, for code scanning (GitHub and others).
    Sarif,
}

/// The arguments of `tollgate audit`.
#[derive(Debug, Args)]
pub(crate) struct AuditArgs {
    /// The folder (or one `.rs` file) to read.
    #[arg(default_value = ".")]
    path: PathBuf,
    /// How to print the findings.
    #[arg(long, value_enum, default_value_t = Format::Text)]
    format: Format,
    /// Also read folders named `tests` and `benches` (test code is skipped by default).
    #[arg(long)]
    include_tests: bool,
    /// Skip a folder or file, relative to PATH (repeatable), e.g. `--exclude vendor`.
    #[arg(long, value_name = "PATH")]
    exclude: Vec<PathBuf>,
    /// Also list memoising caches and state whose use is not seen (kinds `in-process-cache`
    /// and `in-process-state`).
    #[arg(long)]
    all: bool,
    /// A library type that keeps state in process memory, as `[crate::]Type=KIND` (repeatable);
    /// KIND is `rate-limit`, `concurrency-limit`, `store`, `already-done`, `lock`, `record`,
    /// `counter`, or `map` to judge it by its use. Also read from `[known-types]` in
    /// `tollgate-audit.toml` at PATH.
    #[arg(long, value_name = "TYPE=KIND")]
    known_type: Vec<String>,
}

/// A file that was not read, with the reason.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub(crate) struct Skipped {
    /// The file, relative to the audited path.
    pub(crate) file: String,
    /// Why: the parser's message with its line and column, or the read error.
    pub(crate) reason: String,
}

/// Parses a known type's `[crate::]Type` and kind.
fn known_type(spec: &str, kind: &str) -> Result<KnownType, String> {
    let kind = match kind.trim() {
        "rate-limit" => Some(Kind::InProcessRateLimit),
        "concurrency-limit" => Some(Kind::InProcessConcurrencyLimit),
        "store" => Some(Kind::InProcessStore),
        "already-done" => Some(Kind::AlreadyDone),
        "lock" => Some(Kind::InProcessLock),
        "record" => Some(Kind::InProcessRecord),
        "counter" => Some(Kind::InProcessCounter),
        "map" => None,
        other => {
            return Err(format!(
                "known type {spec}: unknown kind `{other}` (rate-limit, concurrency-limit, \
                 store, already-done, lock, record, counter, map)"
            ));
        }
    };
    let spec = spec.trim();
    let (krate, name) = match spec.rsplit_once("::") {
        Some((krate, name)) => (
            Some(krate.split("::").next().unwrap_or(krate).to_owned()),
            name,
        ),
        None => (None, spec),
    };
    if name.is_empty() || !name.chars().all(|c| c.is_alphanumeric() || c == '_') {
        return Err(format!("known type `{spec}`: not a type name"));
    }
    Ok(KnownType {
        krate,
        name: name.to_owned(),
        kind,
    })
}

/// The known types: the built-in table, `[known-types]` of `tollgate-audit.toml` at the
/// audited folder, and `--known-type`.
fn known_types(root: &Path, args: &AuditArgs) -> Result<Vec<KnownType>, String> {
    let mut known: Vec<KnownType> = scan::KNOWN_TYPES
        .iter()
        .map(|(krate, name, kind)| KnownType {
            krate: Some((*krate).to_owned()),
            name: (*name).to_owned(),
            kind: Some(*kind),
        })
        .collect();
    let config = root.join("tollgate-audit.toml");
    if config.is_file() {
        let text =
            std::fs::read_to_string(&config).map_err(|e| format!("{}: {e}", config.display()))?;
        let table: toml::Table =
            toml::from_str(&text).map_err(|e| format!("{}: {e}", config.display()))?;
        if let Some(types) = table.get("known-types") {
            let Some(types) = types.as_table() else {
                return Err(format!(
                    "{}: [known-types] is not a table",
                    config.display()
                ));
            };
            for (spec, kind) in types {
                let Some(kind) = kind.as_str() else {
                    return Err(format!(
                        "{}: known type {spec}: the kind is not a string",
                        config.display()
                    ));
                };
                known.push(
                    known_type(spec, kind).map_err(|e| format!("{}: {e}", config.display()))?,
                );
            }
        }
    }
    for spec in &args.known_type {
        let Some((ty, kind)) = spec.split_once('=') else {
            return Err(format!("--known-type {spec}: expected TYPE=KIND"));
        };
        known.push(known_type(ty, kind)?);
    }
    Ok(known)
}

/// One finding.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub(crate) struct Finding {
    /// The file, relative to the audited path, with `/` separators.
    pub(crate) file: String,
    /// The 1-based line.
    pub(crate) line: usize,
    /// What it is used for: a stable kebab-case id.
    pub(crate) kind: Kind,
    /// Where the state lives: `static`, `state`, `actor`, `task`, `library`.
    pub(crate) place: Place,
    /// What the code does with it, in words: "checked, then inserted around the work".
    pub(crate) used_as: String,
    /// What it is, where, and its use.
    pub(crate) message: String,
    /// The lines that show the use.
    pub(crate) evidence: Vec<decide::Evidence>,
    /// What breaks with N copies, one sentence.
    pub(crate) breaks: String,
    /// The fix for that use.
    pub(crate) fix: String,
}

/// The `.rs` files under `root` the audit reads, sorted.
fn rust_files(
    root: &Path,
    args: &AuditArgs,
    skipped: &mut Vec<Skipped>,
) -> Result<Vec<PathBuf>, String> {
    let metadata = std::fs::metadata(root).map_err(|e| format!("{}: {e}", root.display()))?;
    if metadata.is_file() {
        return Ok(vec![root.to_path_buf()]);
    }
    let excluded: Vec<PathBuf> = args.exclude.iter().map(|e| root.join(e)).collect();
    let walker = walkdir::WalkDir::new(root)
        .sort_by_file_name()
        .into_iter()
        .filter_entry(|entry| {
            if entry.depth() == 0 {
                return true;
            }
            if excluded.iter().any(|e| entry.path() == e) {
                return false;
            }
            if !entry.file_type().is_dir() {
                return true;
            }
            let name = entry.file_name().to_string_lossy();
            !(name.starts_with('.')
                || name == "target"
                || (!args.include_tests
                    && (name == "tests"
                        || name == "benches"
                        || name.ends_with("test_utils")
                        || name.ends_with("test-utils"))))
        });
    let mut files = Vec::new();
    for entry in walker {
        match entry {
            Ok(entry) => {
                if entry.file_type().is_file()
                    && entry.path().extension().is_some_and(|ext| ext == "rs")
                {
                    files.push(entry.into_path());
                }
            }
            Err(error) if error.depth() == 0 => {
                return Err(format!("{}: {error}", root.display()));
            }
            Err(error) => skipped.push(Skipped {
                file: error
                    .path()
                    .map_or_else(String::new, |path| relative(root, path)),
                reason: format!("not read: {error}"),
            }),
        }
    }
    Ok(files)
}

/// The path of `file` relative to `root`, with `/`.
fn relative(root: &Path, file: &Path) -> String {
    let rel = if file == root {
        file.file_name().map(Path::new).unwrap_or(file)
    } else {
        file.strip_prefix(root).unwrap_or(file)
    };
    rel.components()
        .map(|c| c.as_os_str().to_string_lossy().into_owned())
        .collect::<Vec<_>>()
        .join("/")
}

/// The files that `#[cfg(test)] mod name;` declarations in `file` load: `name.rs` or
/// `name/mod.rs` beside a `mod.rs`, `lib.rs` or `main.rs`, or in the folder named after any
/// other file; a `#[path]` attribute relative to the file's folder.
fn test_module_files(path: &Path, syntax: &syn::File) -> Vec<PathBuf> {
    let dir = path.parent().unwrap_or(Path::new(""));
    let stem = path
        .file_stem()
        .and_then(|s| s.to_str())
        .unwrap_or_default();
    let base = if matches!(stem, "mod" | "lib" | "main") {
        dir.to_path_buf()
    } else {
        dir.join(stem)
    };
    let mut out = Vec::new();
    for item in &syntax.items {
        let syn::Item::Mod(module) = item else {
            continue;
        };
        if module.content.is_some() || !scan::is_test_only(&module.attrs) {
            continue;
        }
        let explicit = module.attrs.iter().find_map(|attr| match &attr.meta {
            syn::Meta::NameValue(nv) if nv.path.is_ident("path") => match &nv.value {
                syn::Expr::Lit(syn::ExprLit {
                    lit: syn::Lit::Str(s),
                    ..
                }) => Some(s.value()),
                _ => None,
            },
            _ => None,
        });
        match explicit {
            Some(explicit) => out.push(dir.join(explicit)),
            None => {
                let name = module.ident.to_string();
                out.push(base.join(format!("{name}.rs")));
                out.push(base.join(&name).join("mod.rs"));
            }
        }
    }
    out
}

/// What the audit found under `args.path`.
#[derive(Debug)]
pub(crate) struct Outcome {
    /// The findings.
    pub(crate) findings: Vec<Finding>,
    /// The number of files read.
    pub(crate) read: usize,
    /// The files that were not read.
    pub(crate) skipped: Vec<Skipped>,
}

/// The stack of the audit's thread: room for [`MAX_NESTING`] levels in the parser and the walks.
const AUDIT_STACK: usize = 1 << 30;

/// The deepest nesting of brackets a file may have to be parsed; a deeper file is skipped.
const MAX_NESTING: usize = 1_000;

/// The deepest nesting of `(`, `[` and `{` in Rust source, outside comments, strings and
/// character literals (a raw string's delimiters are read as a string's: close enough for a
/// bound).
fn nesting(source: &str) -> usize {
    let bytes = source.as_bytes();
    let (mut depth, mut deepest, mut at) = (0usize, 0usize, 0usize);
    while at < bytes.len() {
        match bytes[at] {
            b'/' if bytes.get(at + 1) == Some(&b'/') => {
                while at < bytes.len() && bytes[at] != b'\n' {
                    at += 1;
                }
            }
            b'/' if bytes.get(at + 1) == Some(&b'*') => {
                at += 2;
                while at + 1 < bytes.len() && !(bytes[at] == b'*' && bytes[at + 1] == b'/') {
                    at += 1;
                }
                at += 1;
            }
            b'"' => {
                at += 1;
                while at < bytes.len() && bytes[at] != b'"' {
                    if bytes[at] == b'\\' {
                        at += 1;
                    }
                    at += 1;
                }
            }
            // a character literal (`'('`, `'\''`), not a lifetime
            b'\'' if bytes.get(at + 2) == Some(&b'\'') => at += 2,
            b'\'' if bytes.get(at + 1) == Some(&b'\\') && bytes.get(at + 3) == Some(&b'\'') => {
                at += 3;
            }
            b'(' | b'[' | b'{' => {
                depth += 1;
                deepest = deepest.max(depth);
            }
            b')' | b']' | b'}' => depth = depth.saturating_sub(1),
            _ => {}
        }
        at += 1;
    }
    deepest
}

/// The findings under `args.path`, the files read and skipped.
fn audit(args: &AuditArgs) -> Result<Outcome, String> {
    let root = args.path.as_path();
    let known = known_types(
        if root.is_dir() {
            root
        } else {
            Path::new("/nonexistent")
        },
        args,
    )?;
    let mut parsed = Vec::new();
    let mut skipped = Vec::new();
    for path in rust_files(root, args, &mut skipped)? {
        let source = match std::fs::read_to_string(&path) {
            Ok(source) => source,
            Err(error) => {
                skipped.push(Skipped {
                    file: relative(root, &path),
                    reason: format!("not read: {error}"),
                });
                continue;
            }
        };
        let deepest = nesting(&source);
        if deepest > MAX_NESTING {
            skipped.push(Skipped {
                file: relative(root, &path),
                reason: format!(
                    "nested {deepest} levels deep, more than the {MAX_NESTING} the audit reads"
                ),
            });
            continue;
        }
        match syn::parse_file(&source) {
            Ok(syntax) => parsed.push((path, source, syntax)),
            Err(error) => {
                let at = error.span().start();
                skipped.push(Skipped {
                    file: relative(root, &path),
                    reason: format!("does not parse at {}:{}: {error}", at.line, at.column + 1),
                });
            }
        }
    }
    // a file loaded only by a `#[cfg(test)] mod tests;` is test code
    let test_files: Vec<PathBuf> = parsed
        .iter()
        .flat_map(|(path, _, syntax)| test_module_files(path, syntax))
        .collect();
    let mut model = Model::default();
    let mut collected = scan::Collected::default();
    let mut files = Vec::new();
    for (path, source, syntax) in parsed {
        if test_files.contains(&path) {
            continue;
        }
        let index = model.files.len();
        model.files.push(SourceFile {
            rel: relative(root, &path),
            lines: source.lines().map(str::to_owned).collect(),
            uses: model::Uses::default(),
            item_names: Vec::new(),
        });
        scan::collect(&syntax, index, &mut model, &mut collected, &known);
        files.push((index, syntax));
    }
    let read = model.files.len();
    let options = decide::Options { all: args.all };
    let findings = decide::findings(&model, collected, &files, &known, &options);
    Ok(Outcome {
        findings,
        read,
        skipped,
    })
}

/// Runs `tollgate audit`: 0 without findings, 1 with, 2 on an error.
pub(crate) fn run(args: &AuditArgs) -> ExitCode {
    // the parser and the walks recurse once per level of nesting: a thread with room for the
    // deepest a file may be (see `MAX_NESTING`)
    let audited = std::thread::scope(|scope| {
        std::thread::Builder::new()
            .name("audit".to_owned())
            .stack_size(AUDIT_STACK)
            .spawn_scoped(scope, || audit(args))
            .map_err(|e| format!("cannot start the audit: {e}"))
            .and_then(|handle| {
                handle
                    .join()
                    .map_err(|_| "the audit stopped unexpectedly".to_owned())?
            })
    });
    let outcome = match audited {
        Ok(result) => result,
        Err(error) => {
            eprintln!("error: {error}");
            return ExitCode::from(2);
        }
    };
    for skipped in &outcome.skipped {
        eprintln!("warning: {}: skipped: {}", skipped.file, skipped.reason);
    }
    let printed = match args.format {
        Format::Text => {
            print!("{}", report::text(&outcome));
            Ok(())
        }
        Format::Json => report::json(&outcome).map(|json| println!("{json}")),
        Format::Sarif => report::sarif(&outcome).map(|sarif| println!("{sarif}")),
    };
    let findings = outcome.findings;
    if let Err(error) = printed {
        eprintln!("error: {error}");
        return ExitCode::from(2);
    }
    if findings.is_empty() {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    }
}
