//! `tollgate inspect`: what a service keeps in its shared store, read without changing it — a
//! caller's rate-limit quota (`rate`, the default), a lock (`lock`), a concurrency limit's
//! permits (`permits`) and an idempotency record (`record`).
//!
//! Each names the store key as the service does (`tollgate::store::keys`): from the service's
//! key prefix and the same inputs, digested, never the raw value.

use std::fmt::Write;
use std::net::IpAddr;
use std::process::ExitCode;

use clap::{ArgGroup, Args, Subcommand};
use http::header::{HeaderName, HeaderValue};
use serde_json::json;
use tollgate::key::{Global, KeyExtractor};
use tollgate::store::{IdempotencyState, LockState, PermitUsage, keys};

use crate::rate::{
    self, Named, Shown, Who, human, millis, parse_extension, parse_header, parse_ip, parse_pair,
    runtime_and,
};
use crate::secret::{masked_header, masked_pair, masked_value};
use crate::store::StoreArgs;

pub(crate) const LONG_ABOUT: &str = "\
Show what a service keeps in its shared store, changing nothing.

`tollgate inspect rate …` (or `tollgate inspect …` with --config, as before) shows a caller's \
remaining rate-limit quota; `lock` who holds a lock, its fencing token and the lease it has left; \
`permits` a concurrency limit's permits in use and its waiters; `record` an idempotency record: \
absent, in flight, or completed with its response's status, and its age. Each reads only: it never spends \
quota, takes a permit or migrates a PostgreSQL schema.";

pub(crate) const AFTER_HELP: &str = "\
Examples:
  tollgate inspect --store redis://10.0.0.5:6379/ --config tollgate.toml --header x-api-key=alice
  tollgate inspect lock nightly-report --store redis://10.0.0.5:6379/
  tollgate inspect permits --store redis://10.0.0.5:6379/ --header x-tenant=42
  tollgate inspect permits --store redis://10.0.0.5:6379/ --extension acme
  tollgate inspect record order-17 --scope-header x-api-key=alice --store postgres://app@db/app

Exit codes: 0 the store was read; 1 it holds nothing under what was named (a caller that spent \
nothing, a lock never taken, no permit in use, no record: check the names and --prefix); 2 an \
error (bad arguments or URL, a store that does not answer).";

const LOCK_AFTER_HELP: &str = "\
Example: the lock `nightly-report` of a service whose Locks use the prefix `svc`:
  tollgate inspect lock nightly-report --store redis://10.0.0.5:6379/ --prefix svc

  store          redis://10.0.0.5:6379/
  lock           nightly-report
  key            svc:lock:{Xp3kq2c1Vb0m9ZtYw4uRsA}

  state          held
  holder         6f1c2a9e-3b7d-4f0e-9a51-2c8d7e4b1f03
  fencing token  1764761234567890
  lease left     28.4s

A free lock shows `state free` and the last fencing token drawn for its name, if any.
Exit codes: 0 the lock was read; 1 it was never taken (free, no fencing token ever drawn: check \
the name and --prefix); 2 an error.";

const PERMITS_AFTER_HELP: &str = "\
Example: the permits of tenant 42 under a ConcurrencyLimitLayer keyed by `x-tenant`:
  tollgate inspect permits --store redis://10.0.0.5:6379/ --header x-tenant=42

  store    redis://10.0.0.5:6379/
  caller   header x-tenant=…
  key      tollgate:cc:{Qm8z3Lr0aT5yVn2kXw7bGc}

  in use   2
  waiting  1
  leases   12.5s, 29.9s

Exit codes: 0 the permits were read; 1 none is held or awaited (check the caller and --prefix); \
2 an error.";

const RECORD_AFTER_HELP: &str = "\
Example: the record of `Idempotency-Key: order-17` sent by the client with API key alice, \
under an IdempotencyLayer scoped by `x-api-key`:
  tollgate inspect record order-17 --scope-header x-api-key=alice --store redis://10.0.0.5:6379/

  store       redis://10.0.0.5:6379/
  record      order-17
  scope       header x-api-key=a…
  key         tollgate:idem:{a7Jd0Qe5Rk2mWx9cLp3bTs}

  state       completed
  age         4m12s
  status      201 Created
  kept for    23h55m

The age is the time since the record's request began. A record still running shows `state \
in flight`, its age and its lease left; one not in the store, `state absent`.
Exit codes: 0 the record was read; 1 it is absent (check the key, its scope and --prefix); 2 an \
error.";

/// The arguments of `tollgate inspect`: a subcommand, or the rate inspect's own arguments.
#[derive(Debug, Args)]
#[command(args_conflicts_with_subcommands = true, subcommand_negates_reqs = true)]
pub(crate) struct InspectCommand {
    #[command(subcommand)]
    what: Option<Box<What>>,
    #[command(flatten)]
    rate: rate::InspectArgs,
}

/// What to inspect.
#[derive(Debug, Subcommand)]
enum What {
    /// A caller's remaining rate-limit quota, spending none (what `tollgate inspect --config …`
    /// shows).
    #[command(long_about = rate::INSPECT_LONG_ABOUT, after_help = rate::INSPECT_AFTER_HELP)]
    Rate(rate::InspectArgs),
    /// Who holds a lock: its holder, fencing token and lease left.
    #[command(after_help = LOCK_AFTER_HELP)]
    Lock(LockArgs),
    /// A concurrency limit's permits in use, their leases, and its waiters.
    #[command(after_help = PERMITS_AFTER_HELP)]
    Permits(PermitArgs),
    /// An idempotency record: absent, in flight, or completed with its response's status.
    #[command(after_help = RECORD_AFTER_HELP)]
    Record(RecordArgs),
}

/// What every subcommand but `rate` takes beside its own: the store, the prefix, the output.
#[derive(Debug, Args)]
struct Common {
    #[command(flatten)]
    store: StoreArgs,
    /// The service's key prefix: the layer's `prefix`, or `Locks::with_prefix`.
    #[arg(long, value_name = "PREFIX", default_value = keys::DEFAULT_PREFIX)]
    prefix: String,
    /// Print a JSON object instead of text.
    #[arg(long)]
    json: bool,
}

/// The arguments of `tollgate inspect lock`.
#[derive(Debug, Args)]
struct LockArgs {
    /// The lock's name, as the service passes it to `Locks::acquire` / `try_acquire`.
    #[arg(value_name = "NAME")]
    name: String,
    #[command(flatten)]
    common: Common,
}

/// The arguments of `tollgate inspect permits`.
#[derive(Debug, Args)]
struct PermitArgs {
    #[command(flatten)]
    key: PermitKey,
    /// With --peer-ip: the service's `PeerIp::ipv4_prefix`, the bits that name a caller.
    #[arg(long, value_name = "BITS", requires = "peer_ip", value_parser = clap::value_parser!(u8).range(0..=32))]
    ipv4_prefix: Option<u8>,
    /// With --peer-ip: the service's `PeerIp::ipv6_prefix`, the bits that name a caller.
    #[arg(long, value_name = "BITS", requires = "peer_ip", value_parser = clap::value_parser!(u8).range(0..=128))]
    ipv6_prefix: Option<u8>,
    #[command(flatten)]
    common: Common,
}

/// The concurrency limit's key, as the layer's extractor names it: exactly one
/// (`--extension-name` goes with `--extension`). Its `Debug` masks the value.
#[derive(Args)]
#[group(skip)]
#[command(group(
    ArgGroup::new("permit_key")
        .required(true)
        .args(["header", "peer_ip", "key_fn", "extension", "global"])
))]
struct PermitKey {
    /// The key's header, for a layer keyed by `key::Header`: e.g. x-tenant=42.
    #[arg(long, value_name = "NAME=VALUE", value_parser = parse_header)]
    header: Option<(HeaderName, HeaderValue)>,
    /// The caller's address, for a layer keyed by `key::PeerIp` (or `ForwardedIp`).
    #[arg(long, value_name = "ADDR", value_parser = parse_ip)]
    peer_ip: Option<IpAddr>,
    /// The value under the service's own extractor `key::from_fn(DOMAIN, …)`: e.g. tenant=42.
    #[arg(long, value_name = "DOMAIN=VALUE", value_parser = parse_pair)]
    key_fn: Option<(String, String)>,
    /// The caller's value of a request extension, for a layer keyed by `key::Extension::new()`:
    /// e.g. acme.
    #[arg(long, value_name = "VALUE", value_parser = parse_extension)]
    extension: Option<String>,
    /// With --extension: NAME of a layer keyed by `key::Extension::named(NAME)`.
    #[arg(
        long,
        value_name = "NAME",
        requires = "extension",
        conflicts_with_all = ["header", "peer_ip", "key_fn", "global"]
    )]
    extension_name: Option<String>,
    /// The one key of a layer without an extractor (`key::Global`, the default).
    #[arg(long)]
    global: bool,
}

impl std::fmt::Debug for PermitKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PermitKey")
            .field("header", &masked_header(self.header.as_ref()))
            .field("peer_ip", &self.peer_ip)
            .field("key_fn", &masked_pair(self.key_fn.as_ref()))
            .field("extension", &masked_value(self.extension.as_deref()))
            .field("extension_name", &self.extension_name)
            .field("global", &self.global)
            .finish()
    }
}

/// The arguments of `tollgate inspect record`.
#[derive(Debug, Args)]
struct RecordArgs {
    /// The idempotency key as the client sends it in the header (the quoted form `"k"` names
    /// the key k).
    #[arg(value_name = "IDEMPOTENCY-KEY")]
    idempotency_key: String,
    #[command(flatten)]
    scope: Scope,
    #[command(flatten)]
    common: Common,
}

/// The record's scope, as the layer's `scope` extractor names it: none (an `unscoped` layer, or
/// a request whose scope was not found) or one (`--scope-extension-name` goes with
/// `--scope-extension`). Its `Debug` masks the value.
#[derive(Args)]
#[group(skip)]
#[command(group(
    ArgGroup::new("scope")
        .args(["scope_header", "scope_peer_ip", "scope_key_fn", "scope_extension"])
))]
struct Scope {
    /// The scope's header, for a layer scoped by `key::Header`: e.g. x-api-key=alice.
    #[arg(long, value_name = "NAME=VALUE", value_parser = parse_header)]
    scope_header: Option<(HeaderName, HeaderValue)>,
    /// The client's address, for a layer scoped by `key::PeerIp`.
    #[arg(long, value_name = "ADDR", value_parser = parse_ip)]
    scope_peer_ip: Option<IpAddr>,
    /// The scope under the service's own extractor `key::from_fn(DOMAIN, …)`.
    #[arg(long, value_name = "DOMAIN=VALUE", value_parser = parse_pair)]
    scope_key_fn: Option<(String, String)>,
    /// The client's value of a request extension, for a layer scoped by
    /// `key::Extension::new()` (the caller its authentication inserts).
    #[arg(long, value_name = "VALUE", value_parser = parse_extension)]
    scope_extension: Option<String>,
    /// With --scope-extension: NAME of a layer scoped by `key::Extension::named(NAME)`.
    #[arg(
        long,
        value_name = "NAME",
        requires = "scope_extension",
        conflicts_with_all = ["scope_header", "scope_peer_ip", "scope_key_fn"]
    )]
    scope_extension_name: Option<String>,
}

impl std::fmt::Debug for Scope {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Scope")
            .field("scope_header", &masked_header(self.scope_header.as_ref()))
            .field("scope_peer_ip", &self.scope_peer_ip)
            .field("scope_key_fn", &masked_pair(self.scope_key_fn.as_ref()))
            .field(
                "scope_extension",
                &masked_value(self.scope_extension.as_deref()),
            )
            .field("scope_extension_name", &self.scope_extension_name)
            .finish()
    }
}

/// Runs `tollgate inspect`.
pub(crate) fn run(command: &InspectCommand) -> ExitCode {
    match command.what.as_deref() {
        Some(What::Rate(args)) => rate::run_inspect(args),
        None => rate::run_inspect(&command.rate),
        Some(What::Lock(args)) => runtime_and(|| lock(args)),
        Some(What::Permits(args)) => runtime_and(|| permits(args)),
        Some(What::Record(args)) => runtime_and(|| record(args)),
    }
}

/// `rows` as `label  value` lines, the labels padded to one width (at least `width`, so that
/// every state of a thing lines up alike); an empty label an empty line.
fn block(width: usize, rows: &[(&str, String)]) -> String {
    let longest = rows.iter().map(|(label, _)| label.len()).max().unwrap_or(0);
    let width = width.max(longest);
    let mut out = String::new();
    for (label, value) in rows {
        if label.is_empty() {
            out.push('\n');
        } else {
            let _ = writeln!(out, "{label:<width$}  {value}");
        }
    }
    out
}

fn pretty(value: &serde_json::Value) -> String {
    let mut out = serde_json::to_string_pretty(value).unwrap_or_default();
    out.push('\n');
    out
}

async fn lock(args: &LockArgs) -> Result<Shown, String> {
    let common = &args.common;
    let (key, fence_key) =
        keys::lock(&common.prefix, &args.name).map_err(|e| format!("--prefix: {e}"))?;
    let store = common.store.open().await?;
    let state = common
        .store
        .bounded(store.lock_state(&key, &fence_key))
        .await?;
    let out = show_lock(args, &key, &state);
    Ok(match state.holder.is_none() && state.fence.is_none() {
        false => Shown::Found(out),
        true => Shown::Nothing {
            out,
            why: format!(
                "no lock {:?} under prefix {:?}: never taken (check the name and --prefix)",
                args.name, common.prefix
            ),
        },
    })
}

fn show_lock(args: &LockArgs, key: &str, state: &LockState) -> String {
    let store = args.common.store.describe();
    if args.common.json {
        return pretty(&json!({
            "store": store,
            "lock": args.name,
            "key": key,
            "held": state.holder.is_some(),
            "holder": state.holder,
            "fencing_token": state.fence,
            "lease_left_ms": millis(state.lease_left),
        }));
    }
    let mut rows = vec![
        ("store", store),
        ("lock", args.name.clone()),
        ("key", key.to_owned()),
        ("", String::new()),
    ];
    let fence = state.fence.map(|fence| fence.to_string());
    match &state.holder {
        Some(holder) => {
            rows.push(("state", "held".to_owned()));
            rows.push(("holder", holder.clone()));
            rows.push(("fencing token", fence.unwrap_or_else(|| "-".to_owned())));
            rows.push(("lease left", human(state.lease_left)));
        }
        None => {
            rows.push(("state", "free".to_owned()));
            let last =
                fence.map_or_else(|| "none drawn".to_owned(), |f| format!("{f} (last drawn)"));
            rows.push(("fencing token", last));
        }
    }
    block(0, &rows)
}

async fn permits(args: &PermitArgs) -> Result<Shown, String> {
    let named = Named {
        header: args.key.header.as_ref(),
        peer_ip: args.key.peer_ip,
        key_fn: args.key.key_fn.as_ref(),
        extension: args.key.extension.as_deref(),
        extension_name: args.key.extension_name.as_deref(),
        ipv4_prefix: args.ipv4_prefix,
        ipv6_prefix: args.ipv6_prefix,
    };
    let who = match named.who()? {
        Some(who) => who,
        None if args.key.global => {
            let parts = http::Request::get("/")
                .body(())
                .map_err(|e| e.to_string())?
                .into_parts()
                .0;
            let key = Global
                .extract(&parts)
                .ok_or_else(|| "the global extractor found no key".to_owned())?;
            Who {
                key,
                label: "global (one key for every request)".to_owned(),
            }
        }
        None => {
            return Err(
                "name the key: --header, --peer-ip, --key-fn, --extension or --global".to_owned(),
            );
        }
    };
    let common = &args.common;
    let key = keys::permits(&common.prefix, &who.key).map_err(|e| format!("--prefix: {e}"))?;
    let store = common.store.open().await?;
    let usage = common.store.bounded(store.permit_usage(&key)).await?;
    let out = show_permits(common, &who, &key, &usage);
    Ok(match usage.in_use() == 0 && usage.waiting == 0 {
        false => Shown::Found(out),
        true => Shown::Nothing {
            out,
            why: format!(
                "nothing under {key}: no permit of {} held or awaited under prefix {:?} (check \
                 the caller and --prefix)",
                who.label, common.prefix
            ),
        },
    })
}

fn show_permits(common: &Common, who: &Who, key: &str, usage: &PermitUsage) -> String {
    let store = common.store.describe();
    if common.json {
        let leases: Vec<u64> = usage.leases_left.iter().map(|d| millis(*d)).collect();
        return pretty(&json!({
            "store": store,
            "caller": who.label,
            "key": key,
            "in_use": usage.in_use(),
            "waiting": usage.waiting,
            "leases_left_ms": leases,
        }));
    }
    let leases: Vec<String> = usage.leases_left.iter().map(|d| human(*d)).collect();
    let leases = match leases.is_empty() {
        true => "-".to_owned(),
        false => leases.join(", "),
    };
    block(
        0,
        &[
            ("store", store),
            ("caller", who.label.clone()),
            ("key", key.to_owned()),
            ("", String::new()),
            ("in use", usage.in_use().to_string()),
            ("waiting", usage.waiting.to_string()),
            ("leases", leases),
        ],
    )
}

async fn record(args: &RecordArgs) -> Result<Shown, String> {
    let named = Named {
        header: args.scope.scope_header.as_ref(),
        peer_ip: args.scope.scope_peer_ip,
        key_fn: args.scope.scope_key_fn.as_ref(),
        extension: args.scope.scope_extension.as_deref(),
        extension_name: args.scope.scope_extension_name.as_deref(),
        ..Named::default()
    };
    let scope = named.who()?;
    let idempotency_key = unquoted(&args.idempotency_key)?;
    let common = &args.common;
    let key = keys::idempotency_record(
        &common.prefix,
        scope.as_ref().map(|who| who.key),
        &idempotency_key,
    )
    .map_err(|e| format!("--prefix: {e}"))?;
    let store = common.store.open().await?;
    let state = common.store.bounded(store.idempotency_state(&key)).await?;
    let out = show_record(args, scope.as_ref(), &key, &state);
    Ok(match state {
        IdempotencyState::InFlight { .. } | IdempotencyState::Completed { .. } => Shown::Found(out),
        _ => Shown::Nothing {
            out,
            why: format!(
                "no record of key {:?} under prefix {:?} and that scope: never made, or expired \
                 (check the key, its scope and --prefix)",
                args.idempotency_key, common.prefix
            ),
        },
    })
}

/// The key a header value names: `"k"` (with `\"` and `\\` escapes) or k as it is.
fn unquoted(text: &str) -> Result<String, String> {
    let Some(inner) = text.strip_prefix('"').and_then(|t| t.strip_suffix('"')) else {
        return Ok(text.to_owned());
    };
    let mut out = String::with_capacity(inner.len());
    let mut chars = inner.chars();
    while let Some(c) = chars.next() {
        match c {
            '\\' => match chars.next() {
                Some(escaped @ ('"' | '\\')) => out.push(escaped),
                _ => return Err(format!("`{text}` is not a well-formed quoted key")),
            },
            c => out.push(c),
        }
    }
    Ok(out)
}

fn show_record(
    args: &RecordArgs,
    scope: Option<&Who>,
    key: &str,
    state: &IdempotencyState,
) -> String {
    let store = args.common.store.describe();
    let status = state.response_status();
    let (name, lease_left, retention_left, age) = match state {
        IdempotencyState::InFlight { lease_left, age } => {
            ("in flight", Some(*lease_left), None, *age)
        }
        IdempotencyState::Completed {
            retention_left,
            age,
            ..
        } => ("completed", None, Some(*retention_left), *age),
        _ => ("absent", None, None, None),
    };
    if args.common.json {
        return pretty(&json!({
            "store": store,
            "idempotency_key": args.idempotency_key,
            "scope": scope.map(|who| who.label.clone()),
            "key": key,
            "state": name.replace(' ', "_"),
            "status": status.map(|s| s.as_u16()),
            "lease_left_ms": lease_left.map(millis),
            "retention_left_ms": retention_left.map(millis),
            "age_ms": age.map(millis),
        }));
    }
    let mut rows = vec![
        ("store", store),
        ("record", args.idempotency_key.clone()),
        (
            "scope",
            scope.map_or_else(|| "none (unscoped)".to_owned(), |who| who.label.clone()),
        ),
        ("key", key.to_owned()),
        ("", String::new()),
        ("state", name.to_owned()),
    ];
    if let Some(age) = age {
        rows.push(("age", human(age)));
    }
    if let Some(left) = lease_left {
        rows.push(("lease left", human(left)));
    }
    if let Some(left) = retention_left {
        let status = status.map_or_else(
            || "unknown (not a response the idempotency layer stored)".to_owned(),
            |s| s.to_string(),
        );
        rows.push(("status", status));
        rows.push(("kept for", human(left)));
    }
    block("lease left".len(), &rows)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quoted_keys_name_what_the_layer_reads() {
        assert_eq!(unquoted("order-17"), Ok("order-17".to_owned()));
        assert_eq!(unquoted("\"order-17\""), Ok("order-17".to_owned()));
        assert_eq!(unquoted(r#""a\"b\\c""#), Ok(r#"a"b\c"#.to_owned()));
        assert!(unquoted(r#""a\b""#).is_err());
    }

    /// `Args` as clap takes `ARGS…` (a store beside them).
    fn parse<A: Args>(args: &[&str]) -> Result<A, clap::Error> {
        #[derive(clap::Parser)]
        struct Line<A: Args> {
            #[command(flatten)]
            args: A,
        }
        let line = ["tollgate", "--store", "redis://127.0.0.1:1/"]
            .into_iter()
            .chain(args.iter().copied());
        <Line<A> as clap::Parser>::try_parse_from(line).map(|line| line.args)
    }

    #[test]
    fn permits_and_records_name_an_extension_as_the_others() {
        use clap::error::ErrorKind::{ArgumentConflict, MissingRequiredArgument};
        let permits: PermitArgs =
            parse(&["--extension", "acme-secret", "--extension-name", "org"]).unwrap();
        assert_eq!(permits.key.extension.as_deref(), Some("acme-secret"));
        assert_eq!(permits.key.extension_name.as_deref(), Some("org"));
        let shown = format!("{permits:?}");
        assert!(!shown.contains("secret"), "{shown}");
        for (args, kind) in [
            (&["--extension", "acme", "--global"][..], ArgumentConflict),
            (&["--extension-name", "org", "--global"], ArgumentConflict),
            (&["--extension-name", "org"], MissingRequiredArgument),
        ] {
            let Err(error) = parse::<PermitArgs>(args) else {
                panic!("{args:?} parsed")
            };
            assert_eq!(error.kind(), kind, "{args:?}: {error}");
        }
        let record: RecordArgs = parse(&["k1", "--scope-extension", "acme-secret"]).unwrap();
        assert_eq!(record.scope.scope_extension.as_deref(), Some("acme-secret"));
        assert!(!format!("{record:?}").contains("secret"));
        assert!(parse::<RecordArgs>(&["k1"]).is_ok(), "unscoped");
        for (args, kind) in [
            (
                &["k1", "--scope-extension", "a", "--scope-header", "x-a=b"][..],
                ArgumentConflict,
            ),
            (
                &[
                    "k1",
                    "--scope-extension-name",
                    "org",
                    "--scope-key-fn",
                    "t=a",
                ],
                ArgumentConflict,
            ),
            (
                &["k1", "--scope-extension-name", "org"],
                MissingRequiredArgument,
            ),
            (
                &["k1", "--extension", "acme"],
                clap::error::ErrorKind::UnknownArgument,
            ),
        ] {
            let Err(error) = parse::<RecordArgs>(args) else {
                panic!("{args:?} parsed")
            };
            assert_eq!(error.kind(), kind, "{args:?}: {error}");
        }
    }

    #[test]
    fn blocks_align_their_labels() {
        let rows = [
            ("a", "1".to_owned()),
            ("", String::new()),
            ("long", "2".to_owned()),
        ];
        assert_eq!(block(0, &rows), "a     1\n\nlong  2\n");
        assert_eq!(block(5, &rows), "a      1\n\nlong   2\n");
    }
}
