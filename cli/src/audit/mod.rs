//! `tollgate audit`: state kept in process memory that several copies of a service would not
//! share, found in the syntax trees of the Rust files under a path.

mod decide;
mod kind;
mod model;
mod report;
mod scan;

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use clap::{Args, ValueEnum};
use serde::Serialize;

use kind::Kind;
use model::{Model, SourceFile};

/// Where the findings' documentation is: the command's page.
pub(crate) const DOCS_URI: &str = "https://crates.io/crates/tollgate-cli";

pub(crate) const LONG_ABOUT: &str = "\
Report state kept in process memory that several copies of a service would not share.

Reads every `.rs` file under PATH (skipping `target/`, hidden folders, and `tests/` and \
`benches/` unless --include-tests) with a Rust parser and reports what must hold across \
requests but lives in one process: locks, maps and sets changed at run time, counters, caches \
and semaphores in statics (`static`, `lazy_static!`, `thread_local!`, `LazyLock`, `OnceLock`) \
or in the application's state (axum `State`/`Extension`, actix `web::Data`, Rocket `State`, \
tonic services, structs named `*State`/`*Context`), and in-process rate and concurrency \
limiters (tower's, governor's), and tollgate's own in-process `MemoryStore`. Read-only values (configuration, a `Regex`, a client pool, \
metrics) and test code are not reported. A comment `// tollgate: allow(<reason>)` above an item \
or a field, or at the end of its line, silences it.";

pub(crate) const AFTER_HELP: &str = "\
Examples:
  tollgate audit                       # the current directory
  tollgate audit services/billing --format json
  tollgate audit --format sarif . > tollgate.sarif   # for GitHub code scanning

Exit codes: 0 nothing found; 1 findings; 2 an error (an unreadable path). A file that does not \
parse is named on stderr and skipped.";

/// The output formats.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub(crate) enum Format {
    /// Findings grouped by file, each with its fix, and a summary line.
    Text,
    /// A JSON array of `{file, line, kind, message, fix}`.
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
}

/// One finding.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub(crate) struct Finding {
    /// The file, relative to the audited path, with `/` separators.
    pub(crate) file: String,
    /// The 1-based line.
    pub(crate) line: usize,
    /// What it is: a stable kebab-case id.
    pub(crate) kind: Kind,
    /// What it is and why N copies break it.
    pub(crate) message: String,
    /// The tollgate replacement.
    pub(crate) fix: String,
}

/// The `.rs` files under `root` the audit reads, sorted.
fn rust_files(root: &Path, args: &AuditArgs) -> Result<Vec<PathBuf>, String> {
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
                || (!args.include_tests && (name == "tests" || name == "benches")))
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
            Err(error) => eprintln!("warning: skipped: {error}"),
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

/// The findings under `args.path` and the number of files read.
fn audit(args: &AuditArgs) -> Result<(Vec<Finding>, usize), String> {
    let root = args.path.as_path();
    let mut parsed = Vec::new();
    for path in rust_files(root, args)? {
        let source = match std::fs::read_to_string(&path) {
            Ok(source) => source,
            Err(error) => {
                eprintln!("warning: {}: not read: {error}", path.display());
                continue;
            }
        };
        match syn::parse_file(&source) {
            Ok(syntax) => parsed.push((path, source, syntax)),
            Err(error) => {
                let at = error.span().start();
                eprintln!(
                    "warning: {}:{}:{}: does not parse, skipped: {error}",
                    path.display(),
                    at.line,
                    at.column + 1
                );
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
    for (path, source, syntax) in parsed {
        if test_files.contains(&path) {
            continue;
        }
        let index = model.files.len();
        model.files.push(SourceFile {
            rel: relative(root, &path),
            lines: source.lines().map(str::to_owned).collect(),
            uses: model::Uses::default(),
        });
        scan::collect(&syntax, index, &mut model, &mut collected);
    }
    let read = model.files.len();
    Ok((decide::findings(&model, collected), read))
}

/// Runs `tollgate audit`: 0 without findings, 1 with, 2 on an error.
pub(crate) fn run(args: &AuditArgs) -> ExitCode {
    let (findings, read) = match audit(args) {
        Ok(result) => result,
        Err(error) => {
            eprintln!("error: {error}");
            return ExitCode::from(2);
        }
    };
    let printed = match args.format {
        Format::Text => {
            print!("{}", report::text(&findings, read));
            Ok(())
        }
        Format::Json => report::json(&findings).map(|json| println!("{json}")),
        Format::Sarif => report::sarif(&findings).map(|sarif| println!("{sarif}")),
    };
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
