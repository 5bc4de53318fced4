//! `tollgate check`: many requests at once over a service's copies, and the statuses they
//! answer compared with what one service would give; with `--store`, the limits in force of
//! the service's rate-limit and concurrency-limit layers and the copies built with other
//! defaults than those.

use std::collections::BTreeMap;
use std::fmt::Write;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use clap::{ArgGroup, Args};
use http::header::{HeaderName, HeaderValue};
use http::{Method, Request, Uri};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use tokio::sync::Barrier;
use tollgate::store::redact_connection_string as redact;
use tollgate::store::{CopySeen, Store, keys};

use crate::limits::{limits_store, nothing_under};
use crate::store::StoreArgs;

pub(crate) const LONG_ABOUT: &str = "\
Send parallel requests over a service's copies and check the statuses they answer.

Sends --requests requests at once (they wait for each other and start together), spread round \
robin over the --target base URLs with PATH appended to each, prints a table of the statuses \
each copy answered, and checks every --expect STATUS=COUNT against the totals. Point --target at \
each copy's own address, not at the load balancer, so that every copy takes its share. A \
service that keeps its state in a shared store answers as one: one `200` for 50 redemptions of \
one coupon, whichever copies they reach; copies with state of their own each answer `200` once.

With --store (or --prefix, the store then named by TOLLGATE_STORE), it also reads the limits in \
force that the service's layers built with `build_in_store` keep under --prefix — a rate \
limit's (<PREFIX>:rl) and a concurrency limit's (<PREFIX>:cc), each the store holds — before \
any request is sent, and after the table prints each (namespace and version) with every copy \
registered in the store under it, marking each copy built with other defaults than those in \
force: such a copy decides with the limits in force, but says otherwise in its own code. That \
is a warning, not a failed expectation, unless --no-drift is given: then any such copy, of \
either limit, makes the check fail (exit 1). A prefix under which the store holds neither is \
an error (exit 2) that names both namespaces looked for, and no request is sent.";

pub(crate) const AFTER_HELP: &str = "\
Example: two copies, one coupon redeemed 50 times at once, exactly one redemption wins:
  tollgate check --target http://127.0.0.1:4001 --target http://127.0.0.1:4002 \\
      -X POST /coupons/WELCOME5/redeem --requests 50 --expect 200=1 --expect 409=49

  target                   200  409  error
  http://127.0.0.1:4001      1   24      0
  http://127.0.0.1:4002      0   25      0
  total                      1   49      0

  200=1 as expected
  409=49 as expected

Example with the store: 10 requests per caller in force, over two copies, one built with 20:
  tollgate check --target http://127.0.0.1:4001 --target http://127.0.0.1:4002 \\
      -H 'x-api-key: alice' --requests 30 --expect 200=10 --expect 429=20 \\
      --store redis://127.0.0.1:6379/ --prefix svc /api/hello

  target                   200  429  error
  http://127.0.0.1:4001      3   12      0
  http://127.0.0.1:4002      7    8      0
  total                     10   20      0

  200=10 as expected
  429=20 as expected

  store: redis://127.0.0.1:6379/
  limits in force: svc:rl, version 1, defaults r0-f1c78a066048
    26799552198b45db87131131b81fcb22  built r0-f1c78a066048
    893c94081393424081692c530aa04429  built r0-8b6bb8f42346  other defaults
  2 copies; 1 built with other defaults than those in force (version 1)

A prefix that holds a concurrency limit's limits too (or only those) shows a block of them \
after the rate limit's, a blank line between: `limits in force: svc:cc, …`, its copies, its \
summary.

Exit codes: 0 every expectation holds (copies built with other defaults only warn, unless \
--no-drift); 1 one does not, or with --no-drift a copy is built with other defaults; 2 bad \
arguments, no request could be sent, or (with the store) a store that does not answer or holds \
no limits under --prefix (neither <PREFIX>:rl nor <PREFIX>:cc). Plain http only: targets are the copies' own addresses.";

/// A status count the totals must show: `STATUS=COUNT`, STATUS a code or `error`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Expectation {
    outcome: Outcome,
    count: usize,
}

/// What one request came to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Outcome {
    /// An HTTP status.
    Status(u16),
    /// No response: refused, reset, timed out.
    Error,
}

impl std::fmt::Display for Outcome {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Outcome::Status(code) => write!(f, "{code}"),
            Outcome::Error => f.write_str("error"),
        }
    }
}

fn parse_expectation(text: &str) -> Result<Expectation, String> {
    let (status, count) = text
        .split_once('=')
        .ok_or_else(|| format!("`{text}` is not STATUS=COUNT, e.g. 200=1"))?;
    let outcome = match status.trim() {
        "error" => Outcome::Error,
        code => match code.parse::<u16>() {
            Ok(code) if (100..=999).contains(&code) => Outcome::Status(code),
            _ => {
                return Err(format!(
                    "`{code}` is not an HTTP status (100-999) nor `error`"
                ));
            }
        },
    };
    let count = count
        .trim()
        .parse::<usize>()
        .map_err(|_| format!("`{count}` is not a count"))?;
    Ok(Expectation { outcome, count })
}

fn parse_header(text: &str) -> Result<(HeaderName, HeaderValue), String> {
    let (name, value) = text
        .split_once(':')
        .ok_or_else(|| format!("`{}` is not `name: value`", crate::secret::mask(text)))?;
    let name = HeaderName::from_bytes(name.trim().as_bytes())
        .map_err(|_| format!("`{}` is not a header name", name.trim()))?;
    let value = HeaderValue::from_str(value.trim())
        // a header value may be a credential: not repeated
        .map_err(|_| format!("the value of `{}` is not a header value", name))?;
    Ok((name, value))
}

fn parse_method(text: &str) -> Result<Method, String> {
    Method::from_bytes(text.to_ascii_uppercase().as_bytes())
        .map_err(|_| format!("`{text}` is not an HTTP method"))
}

/// A duration: `10s`, `500ms`, `2m`, or a number of seconds.
pub(crate) fn parse_duration(text: &str) -> Result<Duration, String> {
    let text = text.trim();
    let (number, scale) = if let Some(ms) = text.strip_suffix("ms") {
        (ms, 0.001)
    } else if let Some(s) = text.strip_suffix('s') {
        (s, 1.0)
    } else if let Some(m) = text.strip_suffix('m') {
        (m, 60.0)
    } else {
        (text, 1.0)
    };
    let value: f64 = number
        .trim()
        .parse()
        .map_err(|_| format!("`{text}` is not a duration, e.g. 10s or 500ms"))?;
    if !value.is_finite() || value <= 0.0 {
        return Err(format!("`{text}` is not a positive duration"));
    }
    Ok(Duration::from_secs_f64(value * scale))
}

/// The heading of the store's arguments in the help.
const STORE_HEADING: &str = "The limits in force (with --store or --prefix)";

/// The arguments of `tollgate check`. The store's are those of the other subcommands
/// ([`StoreArgs`]), but its bound on the store's answers is `--store-timeout` here: `--timeout`
/// is the requests'. Those, and `--no-drift`, need `--store` or `--prefix`.
#[derive(Debug, Args)]
#[command(
    group(ArgGroup::new("store_part").args(["urls", "prefix"]).multiple(true)),
    mut_arg("timeout", |arg| arg.long("store-timeout").requires("store_part")),
    mut_arg("cluster", |arg| arg.requires("store_part")),
    mut_arg("pg_schema", |arg| arg.requires("store_part")),
)]
pub(crate) struct CheckArgs {
    /// A copy's base URL, e.g. http://10.0.0.1:8080 (repeat for each copy).
    #[arg(long = "target", value_name = "URL", required = true)]
    targets: Vec<String>,
    /// How many requests to send at once, spread round robin over the targets.
    #[arg(short = 'n', long, default_value_t = 50, value_parser = clap::value_parser!(u32).range(1..=100_000))]
    requests: u32,
    /// The request method [default: GET, or POST with --data].
    #[arg(short = 'X', long, value_parser = parse_method)]
    method: Option<Method>,
    /// A request header, `name: value` (repeatable).
    #[arg(short = 'H', long = "header", value_name = "NAME: VALUE", value_parser = parse_header)]
    headers: Vec<(HeaderName, HeaderValue)>,
    /// The request body, the same for every request.
    #[arg(short = 'd', long)]
    data: Option<String>,
    /// How long a request may take, e.g. 10s or 500ms; past it, it counts as an `error`.
    #[arg(id = "request_timeout", long = "timeout", value_name = "TIMEOUT", default_value = "10s", value_parser = parse_duration)]
    timeout: Duration,
    /// A count the totals must show exactly: `STATUS=COUNT`, STATUS a code or `error`
    /// (repeatable).
    #[arg(long = "expect", value_name = "STATUS=COUNT", value_parser = parse_expectation)]
    expectations: Vec<Expectation>,
    /// The path appended to every target, e.g. /coupons/WELCOME5/redeem.
    path: String,
    /// The store of the service's rate-limit and concurrency-limit layers: after the table,
    /// their limits in force and the copies built with other defaults.
    #[command(flatten, next_help_heading = STORE_HEADING)]
    store: StoreArgs,
    /// The layers' key prefix (`RateLimitLayerBuilder::prefix`,
    /// `ConcurrencyLimitLayerBuilder::prefix`) [default: tollgate]; alone, the store is the one
    /// TOLLGATE_STORE names.
    #[arg(long, value_name = "PREFIX", help_heading = STORE_HEADING)]
    prefix: Option<String>,
    /// Fail (exit 1) when a copy registered in the store is built with other defaults than the
    /// limits in force, a rate limit's or a concurrency limit's; without it, such a copy is only
    /// marked.
    #[arg(long, requires = "store_part", help_heading = STORE_HEADING)]
    no_drift: bool,
}

impl CheckArgs {
    /// Whether the store part runs: `--store` or `--prefix` given (`TOLLGATE_STORE` alone,
    /// exported for other commands, leaves `check` as it is without the store).
    fn with_store(&self) -> bool {
        self.store.given() || self.prefix.is_some()
    }
}

/// Each target's URL with the path, checked.
fn urls(args: &CheckArgs) -> Result<Vec<Uri>, String> {
    let path = if args.path.starts_with('/') {
        args.path.clone()
    } else {
        format!("/{}", args.path)
    };
    args.targets
        .iter()
        .map(|target| {
            let base: Uri = target
                .parse()
                .map_err(|e| format!("--target `{}` is not a URL: {e}", redact(target)))?;
            match base.scheme_str() {
                Some("http") => {}
                Some("https") => {
                    return Err(format!(
                        "--target `{}`: https is not supported; point each --target at a \
                         copy's own http address",
                        redact(target)
                    ));
                }
                _ => {
                    return Err(format!(
                        "--target `{}` is not an http:// URL",
                        redact(target)
                    ));
                }
            }
            if base.query().is_some() {
                return Err(format!(
                    "--target `{}` has a query: put it in PATH",
                    redact(target)
                ));
            }
            let full = format!("{}{path}", target.trim_end_matches('/'));
            full.parse::<Uri>()
                .map_err(|e| format!("`{}` is not a URL: {e}", redact(&full)))
        })
        .collect()
}

/// What the requests came to: per target, per outcome, a count; and the first errors.
#[derive(Debug, Default)]
struct Tally {
    per_target: Vec<BTreeMap<Outcome, usize>>,
    errors: Vec<String>,
}

impl Tally {
    fn total(&self) -> BTreeMap<Outcome, usize> {
        let mut total = BTreeMap::new();
        for row in &self.per_target {
            for (outcome, count) in row {
                *total.entry(*outcome).or_insert(0) += count;
            }
        }
        total
    }
}

async fn send_all(args: &CheckArgs, urls: &[Uri]) -> Tally {
    let mut connector = HttpConnector::new();
    connector.set_nodelay(true);
    let client: Client<HttpConnector, Full<Bytes>> =
        Client::builder(TokioExecutor::new()).build(connector);
    let method = args.method.clone().unwrap_or(if args.data.is_some() {
        Method::POST
    } else {
        Method::GET
    });
    let body = Bytes::from(args.data.clone().unwrap_or_default());
    let n = args.requests as usize;
    let barrier = Arc::new(Barrier::new(n));
    let mut tasks = Vec::with_capacity(n);
    for i in 0..n {
        let target = i % urls.len();
        let mut request = Request::builder()
            .method(method.clone())
            .uri(urls[target].clone());
        for (name, value) in &args.headers {
            request = request.header(name, value);
        }
        let request = request.body(Full::new(body.clone()));
        let client = client.clone();
        let barrier = Arc::clone(&barrier);
        let timeout = args.timeout;
        tasks.push(tokio::spawn(async move {
            barrier.wait().await;
            let exchange = async {
                let request = request.map_err(|e| e.to_string())?;
                let response = client.request(request).await.map_err(|e| {
                    let mut text = e.to_string();
                    let mut source = std::error::Error::source(&e);
                    while let Some(inner) = source {
                        let _ = write!(text, ": {inner}");
                        source = inner.source();
                    }
                    text
                })?;
                let status = response.status().as_u16();
                // read the answer whole, so that the copy finishes its work on this request
                response
                    .into_body()
                    .collect()
                    .await
                    .map_err(|e| format!("reading the body: {e}"))?;
                Ok::<u16, String>(status)
            };
            match tokio::time::timeout(timeout, exchange).await {
                Ok(result) => result,
                Err(_) => Err(format!("no answer within {timeout:?}")),
            }
            .map(|status| (target, status))
            .map_err(|e| (target, e))
        }));
    }
    let mut tally = Tally {
        per_target: vec![BTreeMap::new(); urls.len()],
        errors: Vec::new(),
    };
    for task in tasks {
        let (target, outcome) = match task.await {
            Ok(Ok((target, status))) => (target, Outcome::Status(status)),
            Ok(Err((target, error))) => {
                if !tally.errors.contains(&error) && tally.errors.len() < 3 {
                    tally.errors.push(error);
                }
                (target, Outcome::Error)
            }
            Err(join) => {
                tally.errors.push(join.to_string());
                continue;
            }
        };
        *tally.per_target[target].entry(outcome).or_insert(0) += 1;
    }
    tally
}

/// The table: a row per target and a total row, a column per status seen and `error`.
fn table(targets: &[String], tally: &Tally) -> String {
    let total = tally.total();
    let mut columns: Vec<Outcome> = total
        .keys()
        .copied()
        .filter(|o| *o != Outcome::Error)
        .collect();
    columns.push(Outcome::Error);
    let first = targets
        .iter()
        .map(String::len)
        .chain(["target".len(), "total".len()])
        .max()
        .unwrap_or(6);
    let width = |outcome: &Outcome| outcome.to_string().len().max(3);
    let mut out = String::new();
    let mut row = |label: &str, counts: &BTreeMap<Outcome, usize>, header: bool| {
        let _ = write!(out, "{label:<first$}");
        for column in &columns {
            let w = width(column);
            if header {
                let _ = write!(out, "  {:>w$}", column.to_string());
            } else {
                let _ = write!(out, "  {:>w$}", counts.get(column).copied().unwrap_or(0));
            }
        }
        out.push('\n');
    };
    row("target", &BTreeMap::new(), true);
    for (target, counts) in targets.iter().zip(&tally.per_target) {
        row(target, counts, false);
    }
    row("total", &total, false);
    out
}

/// The store of the limits in force and the namespaces under the prefix that hold some: the
/// rate limit's (`<prefix>:rl`) and the concurrency limit's (`<prefix>:cc`), in that order.
struct InForce {
    store: Arc<dyn Store>,
    namespaces: Vec<String>,
}

/// `error` of a store call with the store's bound named as `check` names it.
fn store_error(error: &str) -> String {
    // `StoreArgs::bounded` names the other subcommands' flag
    error.replace("(--timeout)", "(--store-timeout)")
}

/// Opens the store and finds the limits in force under the prefix, a rate limit's and a
/// concurrency limit's: an error naming both namespaces when there are none, before any request
/// is sent (a mistyped prefix is not a success).
async fn limits_in_force(args: &CheckArgs) -> Result<InForce, String> {
    let prefix = args.prefix.as_deref().unwrap_or(keys::DEFAULT_PREFIX);
    let rate = keys::rate_namespace(prefix).map_err(|e| format!("--prefix: {e}"))?;
    let concurrency = keys::concurrency_namespace(prefix).map_err(|e| format!("--prefix: {e}"))?;
    let store = args.store.open().await?;
    let limits = limits_store(&*store)?;
    let mut namespaces = Vec::new();
    for namespace in [rate.clone(), concurrency.clone()] {
        let stored = args
            .store
            .bounded(limits.load_limits(&namespace))
            .await
            .map_err(|e| store_error(&e))?;
        if stored.is_some() {
            namespaces.push(namespace);
        }
    }
    if namespaces.is_empty() {
        return Err(nothing_under(&format!("{rate} nor {concurrency}")));
    }
    Ok(InForce { store, namespaces })
}

/// What the store says after the requests: the limits in force of each namespace, each copy
/// registered (marked when built with other defaults than those in force), and a summary.
struct Drift {
    out: String,
    /// How many copies are built with other defaults.
    other: usize,
    copies: usize,
}

/// The store line, then a [`drift_report`] block of each namespace of `in_force`, a blank line
/// between two; the copies built otherwise counted over all of them.
async fn drift(args: &CheckArgs, in_force: &InForce) -> Result<Drift, String> {
    let InForce { store, namespaces } = in_force;
    let limits = limits_store(&**store)?;
    let mut all = Drift {
        out: format!("store: {}\n", args.store.describe()),
        other: 0,
        copies: 0,
    };
    for (i, namespace) in namespaces.iter().enumerate() {
        let stored = args
            .store
            .bounded(limits.load_limits(namespace))
            .await
            .map_err(|e| store_error(&e))?
            // taken away while the requests ran
            .ok_or_else(|| nothing_under(namespace))?;
        let mut copies: Vec<CopySeen> = args
            .store
            .bounded(limits.copies(namespace))
            .await
            .map_err(|e| store_error(&e))?;
        copies.sort_by(|a, b| a.copy.cmp(&b.copy));
        let block = drift_report(
            namespace,
            stored.version,
            &stored.table.defaults_id(),
            &copies,
        );
        if i > 0 {
            all.out.push('\n');
        }
        all.out.push_str(&block.out);
        all.other += block.other;
        all.copies += block.copies;
    }
    Ok(all)
}

/// The lines of one namespace's limits in force and its copies.
fn drift_report(namespace: &str, version: u64, in_force: &str, copies: &[CopySeen]) -> Drift {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "limits in force: {namespace}, version {version}, defaults {in_force}"
    );
    let mut other = 0;
    for copy in copies {
        let mark = if copy.built == in_force {
            ""
        } else {
            other += 1;
            "  other defaults"
        };
        let _ = writeln!(out, "  {}  built {}{mark}", copy.copy, copy.built);
    }
    let noun = if copies.len() == 1 { "copy" } else { "copies" };
    let _ = writeln!(
        out,
        "{} {noun}; {other} built with other defaults than those in force (version {version})",
        copies.len()
    );
    Drift {
        out,
        other,
        copies: copies.len(),
    }
}

async fn check(args: &CheckArgs) -> Result<bool, String> {
    let urls = urls(args)?;
    let in_force = match args.with_store() {
        true => Some(limits_in_force(args).await?),
        false => None,
    };
    let tally = send_all(args, &urls).await;
    // a target's user info may carry a password
    let shown: Vec<String> = args.targets.iter().map(|t| redact(t)).collect();
    print!("{}", table(&shown, &tally));
    for error in &tally.errors {
        eprintln!("error: {error}");
    }
    let total = tally.total();
    let answered: usize = total
        .iter()
        .filter(|(outcome, _)| **outcome != Outcome::Error)
        .map(|(_, count)| count)
        .sum();
    if answered == 0 {
        return Err("no request could be sent: no target answered".to_owned());
    }
    let mut all_hold = true;
    if !args.expectations.is_empty() {
        println!();
    }
    for expectation in &args.expectations {
        let got = total.get(&expectation.outcome).copied().unwrap_or(0);
        let Expectation { outcome, count } = expectation;
        if got == *count {
            println!("{outcome}={count} as expected");
        } else {
            all_hold = false;
            println!("expected {outcome}={count}, got {outcome}={got}");
        }
    }
    if let Some(in_force) = &in_force {
        let drift = drift(args, in_force).await?;
        print!("\n{}", drift.out);
        if args.no_drift && drift.other > 0 {
            all_hold = false;
            eprintln!(
                "--no-drift: {} of {} copies built with other defaults than those in force",
                drift.other, drift.copies
            );
        }
    }
    Ok(all_hold)
}

/// Runs `tollgate check`: 0 when every expectation holds, 1 when one does not (or, with
/// `--no-drift`, a copy is built with other defaults than the limits in force), 2 on bad
/// arguments, when no request could be sent, or when the store does not answer or holds no
/// limits under the prefix (neither a rate limit's nor a concurrency limit's).
pub(crate) fn run(args: &CheckArgs) -> ExitCode {
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(error) => {
            eprintln!("error: could not start the runtime: {error}");
            return ExitCode::from(2);
        }
    };
    match runtime.block_on(check(args)) {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::from(1),
        Err(error) => {
            eprintln!("error: {error}");
            ExitCode::from(2)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn expectations() {
        assert_eq!(
            parse_expectation("200=1"),
            Ok(Expectation {
                outcome: Outcome::Status(200),
                count: 1
            })
        );
        assert_eq!(
            parse_expectation("error=0"),
            Ok(Expectation {
                outcome: Outcome::Error,
                count: 0
            })
        );
        assert!(parse_expectation("200").is_err());
        assert!(parse_expectation("20=1").is_err());
        assert!(parse_expectation("200=x").is_err());
    }

    #[test]
    fn durations() {
        assert_eq!(parse_duration("10s"), Ok(Duration::from_secs(10)));
        assert_eq!(parse_duration("500ms"), Ok(Duration::from_millis(500)));
        assert_eq!(parse_duration("2m"), Ok(Duration::from_secs(120)));
        assert_eq!(parse_duration("3"), Ok(Duration::from_secs(3)));
        assert!(parse_duration("0s").is_err());
        assert!(parse_duration("soon").is_err());
    }

    /// `tollgate check ARGS…` as clap takes it.
    fn parse(args: &[&str]) -> Result<CheckArgs, clap::Error> {
        #[derive(clap::Parser)]
        struct Line {
            #[command(flatten)]
            check: CheckArgs,
        }
        let line = ["tollgate", "--target", "http://127.0.0.1:1"]
            .into_iter()
            .chain(args.iter().copied());
        <Line as clap::Parser>::try_parse_from(line).map(|line| line.check)
    }

    #[test]
    fn the_store_is_optional_and_its_timeout_is_its_own() {
        let plain = parse(&["--timeout", "2s", "/x"]).unwrap();
        assert!(!plain.with_store());
        assert_eq!(plain.timeout, Duration::from_secs(2));
        assert_eq!(plain.store.timeout, Duration::from_secs(3));
        let stored = parse(&[
            "--store",
            "redis://127.0.0.1:6379/",
            "--store-timeout",
            "500ms",
            "--no-drift",
            "/x",
        ])
        .unwrap();
        assert!(stored.with_store() && stored.no_drift);
        assert_eq!(stored.timeout, Duration::from_secs(10));
        assert_eq!(stored.store.timeout, Duration::from_millis(500));
        assert_eq!(stored.prefix, None);
        let prefixed = parse(&["--prefix", "svc", "/x"]).unwrap();
        assert!(prefixed.with_store());
        // what only means something with the store needs --store or --prefix
        for alone in [
            &["--no-drift", "/x"][..],
            &["--store-timeout", "1s", "/x"],
            &["--cluster", "/x"],
            &["--pg-schema", "other", "/x"],
        ] {
            let error = parse(alone).err().unwrap();
            assert_eq!(
                error.kind(),
                clap::error::ErrorKind::MissingRequiredArgument,
                "{alone:?}"
            );
        }
    }

    #[test]
    fn copies_built_otherwise_are_marked_and_counted() {
        let copy = |copy: &str, built: &str| CopySeen {
            copy: copy.to_owned(),
            built: built.to_owned(),
            left: Duration::from_secs(30),
        };
        let drift = drift_report(
            "svc:rl",
            3,
            "r0-aaaaaaaaaaaa",
            &[copy("c1", "r0-aaaaaaaaaaaa"), copy("c2", "r0-bbbbbbbbbbbb")],
        );
        assert_eq!(
            drift.out,
            "limits in force: svc:rl, version 3, defaults r0-aaaaaaaaaaaa\n  \
             c1  built r0-aaaaaaaaaaaa\n  \
             c2  built r0-bbbbbbbbbbbb  other defaults\n\
             2 copies; 1 built with other defaults than those in force (version 3)\n"
        );
        assert_eq!((drift.other, drift.copies), (1, 2));
        let alone = drift_report("svc:cc", 1, "r0-a", &[copy("c1", "r0-a")]);
        assert_eq!(
            alone.out,
            "limits in force: svc:cc, version 1, defaults r0-a\n  \
             c1  built r0-a\n\
             1 copy; 0 built with other defaults than those in force (version 1)\n"
        );
        assert_eq!(alone.other, 0);
        let none = drift_report("svc:rl", 2, "r0-a", &[]);
        assert_eq!(
            none.out,
            "limits in force: svc:rl, version 2, defaults r0-a\n\
             0 copies; 0 built with other defaults than those in force (version 2)\n"
        );
    }

    #[test]
    fn headers() {
        let (name, value) = parse_header("Idempotency-Key:  abc ").unwrap();
        assert_eq!(name, "idempotency-key");
        assert_eq!(value, "abc");
        assert!(parse_header("no colon").is_err());
    }
}
