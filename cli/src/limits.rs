//! `tollgate limits`: the limits in force of a rate-limit or concurrency-limit layer built with
//! `build_in_store`, read from and changed in the store every copy reads them from — no limits
//! file needed.

use std::fmt::Write;
use std::net::IpAddr;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use clap::{ArgGroup, Args, Subcommand};
use http::header::{HeaderName, HeaderValue};
use tollgate::key::Key;
use tollgate::rate::{IN_FLIGHT, Limit, LimitTable, StoredTable, parse_duration};
use tollgate::rate_limit::{Changed, LimitsError};
use tollgate::store::{CopySeen, LimitsStore, Store, keys};

use crate::rate::{Named, Shown, parse_extension, parse_header, parse_ip, parse_pair, runtime_and};
use crate::secret::{masked_header, masked_pair, masked_value};
use crate::store::StoreArgs;

pub(crate) const LONG_ABOUT: &str = "\
Show and change the limits in force of a service's rate-limit and concurrency-limit layers, kept \
in the store.

A layer built with `build_in_store` keeps its limits in the store beside its counters: each \
tier's (the defaults its code was built with, or a replacement set here) and each caller's \
own (a tenant's plan). Every copy reads them at its start and again every refresh (a second \
unless the service says otherwise), so a change made here is in force on every copy within \
that. No limits file is needed: the store holds the tiers and the algorithm.

A rate limit's are under <PREFIX>:rl, changed with --limit; a concurrency limit's (requests in \
flight) under <PREFIX>:cc, changed with --in-flight, and named with --concurrency to unset them \
or read their history. `show` prints both.";

pub(crate) const AFTER_HELP: &str = "\
Examples:
  tollgate limits show --store redis://10.0.0.5:6379/ --prefix app
  tollgate limits set --store redis://10.0.0.5:6379/ --prefix app \\
      --header x-api-key=acme --limit minute:5000/60s --note 'acme on the big plan'
  tollgate limits set --store redis://10.0.0.5:6379/ --prefix app --tier pro --limit minute:2000/60s
  tollgate limits unset --store redis://10.0.0.5:6379/ --prefix app --header x-api-key=acme
  tollgate limits history --store redis://10.0.0.5:6379/ --prefix app
  tollgate limits set --store redis://10.0.0.5:6379/ --prefix app \\
      --header x-api-key=acme --in-flight 20 --note 'acme runs batch jobs'
  tollgate limits unset --store redis://10.0.0.5:6379/ --prefix app --concurrency \\
      --header x-api-key=acme
  tollgate limits set --store redis://10.0.0.5:6379/ --prefix app --extension acme --in-flight 5

A limit is NAME:COUNT/WINDOW (a window as 500ms, 1s, 5m, 1h, 1d), then /calls if it counts \
calls whatever their cost, :leased and :block=DURATION if it has them, e.g. \
minute:100/60s:block=30s or requests:100/1s/calls. A limit of requests in \
flight is a whole number from 1.
Exit codes: 0 done; 1 nothing under what was named (no limits under the prefix, no override \
of the caller, no replacement of the tier); 2 an error (bad arguments or limits, which change \
nothing; a store that does not answer).";

/// `tollgate limits` and its subcommands.
#[derive(Debug, Args)]
pub(crate) struct LimitsCommand {
    #[command(subcommand)]
    action: Action,
}

#[derive(Debug, Subcommand)]
enum Action {
    /// The limits in force, a rate limit's and a concurrency limit's: each tier's, and the
    /// callers' own (or one caller's).
    Show(ShowArgs),
    /// Give a caller limits of its own, or replace a tier's limits (the layer's own without
    /// --tier or a caller): a rate limit's with --limit, a concurrency limit's with --in-flight.
    Set(SetArgs),
    /// Take a caller back to its tier's limits, or a tier back to its defaults (a concurrency
    /// limit's with --concurrency).
    Unset(UnsetArgs),
    /// The changes of the limits in force, the newest first (a concurrency limit's with
    /// --concurrency).
    History(HistoryArgs),
}

/// Where the limits are: the store and the layer's prefix.
#[derive(Debug, Args)]
struct Place {
    #[command(flatten)]
    store: StoreArgs,
    /// The layer's key prefix (`RateLimitLayerBuilder::prefix`,
    /// `ConcurrencyLimitLayerBuilder::prefix`).
    #[arg(long, value_name = "PREFIX", default_value = keys::DEFAULT_PREFIX)]
    prefix: String,
}

/// What a change or a look is about: a tier, a caller, or the layer's own limits — one at most
/// (`--extension-name` goes with `--extension`).
#[derive(Args)]
#[group(skip)]
#[command(group(
    ArgGroup::new("subject").args(["tier", "header", "peer_ip", "key_fn", "extension"])
))]
struct Subject {
    /// A named tier of the layer.
    #[arg(long, value_name = "NAME")]
    tier: Option<String>,
    /// A caller named by its header, for a service keyed by `key::Header`: e.g. x-api-key=acme.
    #[arg(long, value_name = "NAME=VALUE", value_parser = parse_header)]
    header: Option<(HeaderName, HeaderValue)>,
    /// A caller named by its address, for a service keyed by `key::PeerIp`.
    #[arg(long, value_name = "ADDR", value_parser = parse_ip)]
    peer_ip: Option<IpAddr>,
    /// A caller named by its value under a service's own extractor `key::from_fn(DOMAIN, …)`.
    #[arg(long, value_name = "DOMAIN=VALUE", value_parser = parse_pair)]
    key_fn: Option<(String, String)>,
    /// A caller named by its value of a request extension, for a service keyed by
    /// `key::Extension::new()` (the caller its authentication inserts): e.g. acme.
    #[arg(long, value_name = "VALUE", value_parser = parse_extension)]
    extension: Option<String>,
    /// With --extension: NAME of a service keyed by `key::Extension::named(NAME)`.
    #[arg(
        long,
        value_name = "NAME",
        requires = "extension",
        conflicts_with_all = ["tier", "header", "peer_ip", "key_fn"]
    )]
    extension_name: Option<String>,
}

impl std::fmt::Debug for Subject {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Subject")
            .field("tier", &self.tier)
            .field("header", &masked_header(self.header.as_ref()))
            .field("peer_ip", &self.peer_ip)
            .field("key_fn", &masked_pair(self.key_fn.as_ref()))
            .field("extension", &masked_value(self.extension.as_deref()))
            .field("extension_name", &self.extension_name)
            .finish()
    }
}

/// What a subject names.
enum Of {
    Own,
    Tier(String),
    Caller { key: Key, label: String },
}

impl Subject {
    fn named(&self) -> Result<Of, String> {
        if let Some(tier) = &self.tier {
            return Ok(Of::Tier(tier.clone()));
        }
        let named = Named {
            header: self.header.as_ref(),
            peer_ip: self.peer_ip,
            key_fn: self.key_fn.as_ref(),
            extension: self.extension.as_deref(),
            extension_name: self.extension_name.as_deref(),
            ..Named::default()
        };
        Ok(match named.who()? {
            Some(who) => Of::Caller {
                key: who.key,
                label: who.label,
            },
            None => Of::Own,
        })
    }
}

#[derive(Debug, Args)]
struct ShowArgs {
    #[command(flatten)]
    place: Place,
    #[command(flatten)]
    subject: Subject,
}

#[derive(Debug, Args)]
#[command(group(ArgGroup::new("new").required(true).args(["limits", "in_flight"])))]
struct SetArgs {
    #[command(flatten)]
    place: Place,
    #[command(flatten)]
    subject: Subject,
    /// A rate limit's limit, NAME:COUNT/WINDOW[/calls][:leased][:block=DURATION]; repeat it for
    /// several, checked together.
    #[arg(long = "limit", value_name = "LIMIT", value_parser = parse_limit)]
    limits: Vec<Limit>,
    /// A concurrency limit's limit of requests in flight (1 or more), set under <PREFIX>:cc.
    #[arg(long, value_name = "N")]
    in_flight: Option<u32>,
    /// The concurrency limit's limits (<PREFIX>:cc): what --in-flight changes anyway.
    #[arg(long, conflicts_with = "limits")]
    concurrency: bool,
    /// What the change is for, kept in the history.
    #[arg(long, value_name = "TEXT", default_value = "")]
    note: String,
}

#[derive(Debug, Args)]
struct UnsetArgs {
    #[command(flatten)]
    place: Place,
    #[command(flatten)]
    subject: Subject,
    /// The concurrency limit's limits (<PREFIX>:cc), not the rate limit's (<PREFIX>:rl).
    #[arg(long)]
    concurrency: bool,
    /// What the change is for, kept in the history.
    #[arg(long, value_name = "TEXT", default_value = "")]
    note: String,
}

#[derive(Debug, Args)]
struct HistoryArgs {
    #[command(flatten)]
    place: Place,
    /// The concurrency limit's limits (<PREFIX>:cc), not the rate limit's (<PREFIX>:rl).
    #[arg(long)]
    concurrency: bool,
}

/// Whose limits: a rate limit's, or a concurrency limit's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    /// Under `<prefix>:rl`.
    Rate,
    /// Under `<prefix>:cc`: one limit of requests in flight each.
    Concurrency,
}

impl Kind {
    fn of(concurrency: bool) -> Self {
        if concurrency {
            Kind::Concurrency
        } else {
            Kind::Rate
        }
    }

    /// The namespace of the limits under `prefix`.
    fn namespace(self, prefix: &str) -> Result<String, String> {
        match self {
            Kind::Rate => keys::rate_namespace(prefix),
            Kind::Concurrency => keys::concurrency_namespace(prefix),
        }
        .map_err(|e| e.to_string())
    }
}

/// `NAME:COUNT/WINDOW[/calls][:leased][:block=DURATION]`: `/calls`, a limit that counts calls
/// (`Limit::counting_calls`).
pub(crate) fn parse_limit(text: &str) -> Result<Limit, String> {
    let bad = |why: &str| format!("`{text}`: {why} (write NAME:COUNT/WINDOW, e.g. minute:100/60s)");
    let mut parts = text.split(':');
    let name = parts
        .next()
        .filter(|n| !n.is_empty())
        .ok_or_else(|| bad("no name"))?;
    let rate = parts.next().ok_or_else(|| bad("no COUNT/WINDOW"))?;
    let (count, window) = rate.split_once('/').ok_or_else(|| bad("no /WINDOW"))?;
    let count: u64 = count
        .parse()
        .map_err(|_| bad("the count is not a whole number"))?;
    let (window, calls) = match window.strip_suffix("/calls") {
        Some(window) => (window, true),
        None => (window, false),
    };
    let window = parse_duration(window).map_err(|e| bad(&e.to_string()))?;
    let mut limit = Limit::new(name, count, window);
    if calls {
        limit = limit.counting_calls();
    }
    for flag in parts {
        limit = match flag.split_once('=') {
            None if flag == "leased" => limit.leased(),
            Some(("block", d)) => {
                limit.block_for(parse_duration(d).map_err(|e| bad(&e.to_string()))?)
            }
            _ => {
                return Err(bad(&format!(
                    "unknown `{flag}`: use leased or block=DURATION"
                )));
            }
        };
    }
    Ok(limit)
}

impl LimitsCommand {
    pub(crate) fn run(&self) -> std::process::ExitCode {
        match &self.action {
            Action::Show(args) => runtime_and(|| show(args)),
            Action::Set(args) => runtime_and(|| set(args)),
            Action::Unset(args) => runtime_and(|| unset(args)),
            Action::History(args) => runtime_and(|| history(args)),
        }
    }
}

/// The store, the namespace of `kind`'s limits under the prefix, and what the store holds there.
async fn read(
    place: &Place,
    kind: Kind,
) -> Result<(Arc<dyn Store>, String, Option<StoredTable>), String> {
    let namespace = kind.namespace(&place.prefix)?;
    let store = place.store.open().await?;
    let stored = place
        .store
        .bounded(limits_store(&*store)?.load_limits(&namespace))
        .await?;
    Ok((store, namespace, stored))
}

pub(crate) fn limits_store(store: &dyn Store) -> Result<&dyn LimitsStore, String> {
    store
        .limits_store()
        .ok_or_else(|| "this store keeps no limits".to_owned())
}

pub(crate) fn nothing_under(namespace: &str) -> String {
    format!(
        "no limits in force under {namespace}: no copy built with build_in_store has started \
         on this store, or its prefix is another (--prefix)"
    )
}

/// Both tables of the prefix, what `show` prints: the rate limit's, then the concurrency
/// limit's, each that the store holds.
async fn show(args: &ShowArgs) -> Result<Shown, String> {
    let place = &args.place;
    let rate = Kind::Rate.namespace(&place.prefix)?;
    let concurrency = Kind::Concurrency.namespace(&place.prefix)?;
    let store = place.store.open().await?;
    let limits = limits_store(&*store)?;
    let mut tables = Vec::new();
    for namespace in [&rate, &concurrency] {
        if let Some(stored) = place.store.bounded(limits.load_limits(namespace)).await? {
            tables.push((namespace, stored));
        }
    }
    if tables.is_empty() {
        return Ok(Shown::Nothing {
            out: String::new(),
            why: nothing_under(&format!("{rate} nor {concurrency}")),
        });
    }
    let of = args.subject.named()?;
    if let Of::Tier(tier) = &of
        && !tables
            .iter()
            .any(|(_, stored)| stored.table.for_tier(Some(tier)).is_some())
    {
        let under: Vec<String> = tables
            .iter()
            .map(|(namespace, stored)| {
                format!(
                    "under {namespace} (its tiers: {})",
                    tier_list(&stored.table)
                )
            })
            .collect();
        return Err(format!("no tier {tier:?} {}", under.join(" nor ")));
    }
    let mut out = format!("store    {}\n", place.store.describe());
    for (i, (namespace, stored)) in tables.iter().enumerate() {
        if i > 0 {
            out.push('\n');
        }
        section(&mut out, namespace, stored, &of);
        if matches!(of, Of::Own) {
            let copies = place.store.bounded(limits.copies(namespace)).await?;
            copies_seen(&mut out, &stored.table, &copies);
        }
    }
    Ok(Shown::Found(out))
}

/// One table as `show` prints it, its copies aside: its tiers and callers, or those of `of`.
fn section(out: &mut String, namespace: &str, stored: &StoredTable, of: &Of) {
    let table = &stored.table;
    let kind = if table.is_in_flight() {
        "concurrency limit".to_owned()
    } else {
        table.algorithm().map_or("?".to_owned(), |a| a.to_string())
    };
    let _ = writeln!(
        out,
        "limits   {namespace} ({kind}), version {}, defaults of revision {}\n",
        stored.version,
        table.revision()
    );
    match of {
        Of::Caller { key, label } => {
            let _ = writeln!(out, "caller   {label}");
            match table.for_caller(*key) {
                Some(limits) => rows(out, "own", limits),
                None => {
                    let _ = writeln!(out, "  its tier's limits: it has none of its own");
                }
            }
        }
        Of::Tier(tier) => match table.for_tier(Some(tier)) {
            Some(limits) => rows(out, tier, limits),
            None => {
                let _ = writeln!(
                    out,
                    "  no tier {tier:?} here (its tiers: {})",
                    tier_list(table)
                );
            }
        },
        Of::Own => {
            for tier in table.tiers() {
                let name = tier.unwrap_or("(own)");
                let replaced = table.replacements().any(|(t, _)| t == tier);
                let kind = if replaced { " (replaced)" } else { "" };
                rows(
                    out,
                    &format!("{name}{kind}"),
                    table.for_tier(tier).unwrap_or_default(),
                );
            }
            let overrides = table.overrides();
            let _ = writeln!(
                out,
                "\ncallers with limits of their own: {}",
                overrides.len()
            );
            for (key, limits) in overrides {
                rows(out, &format!("caller {key}"), limits);
            }
        }
    }
}

/// The copies of a table's layer the store has seen lately, and which were built otherwise.
fn copies_seen(out: &mut String, table: &LimitTable, copies: &[CopySeen]) {
    let in_force = table.defaults_id();
    let other = copies.iter().filter(|c| c.built != in_force).count();
    let _ = writeln!(
        out,
        "\ncopies seen lately: {} ({other} built with other defaults, which do not apply)",
        copies.len()
    );
    for copy in copies {
        let mark = if copy.built == in_force {
            ""
        } else {
            "  other defaults"
        };
        let _ = writeln!(out, "  {}  built {}{mark}", copy.copy, copy.built);
    }
}

/// The named tiers of a table, or `none`.
fn tier_list(table: &LimitTable) -> String {
    let tiers: Vec<&str> = table.tiers().flatten().collect();
    if tiers.is_empty() {
        "none".to_owned()
    } else {
        tiers.join(", ")
    }
}

/// A table's limits of one tier or caller, one line each: a concurrency limit's as
/// `in-flight N`.
fn rows(out: &mut String, owner: &str, limits: &[Limit]) {
    if let Some(n) = LimitTable::in_flight_of(limits) {
        let _ = writeln!(out, "{owner:<28} {IN_FLIGHT} {n}");
        return;
    }
    for limit in limits {
        let mut extra = String::new();
        if limit.is_leased() {
            extra.push_str("  leased");
        }
        if limit.counts_calls() {
            extra.push_str("  calls");
        }
        if let Some(block) = limit.penalty() {
            let _ = write!(extra, "  block {}", crate::rate::window(block));
        }
        let _ = writeln!(
            out,
            "{owner:<28} {:<12} {:>10}/{}{extra}",
            limit.name(),
            limit.quota(),
            crate::rate::window(limit.window())
        );
    }
}

/// Runs one change on `kind`'s limits under `place`, once `precheck` has found it sound against
/// the table read (its `Err`: why nothing was sent): what it printed, or why nothing was
/// changed.
async fn change(
    place: &Place,
    kind: Kind,
    note: &str,
    precheck: impl FnOnce(&LimitTable) -> Result<(), Refusal>,
    edit: impl Fn(&mut LimitTable),
) -> Result<Shown, String> {
    let (store, namespace, stored) = read(place, kind).await?;
    let Some(stored) = stored else {
        return Ok(Shown::Nothing {
            out: String::new(),
            why: nothing_under(&namespace),
        });
    };
    match precheck(&stored.table) {
        Ok(()) => {}
        Err(Refusal::Nothing(why)) => {
            return Ok(Shown::Nothing {
                out: String::new(),
                why,
            });
        }
        Err(Refusal::Invalid(why)) => return Err(format!("refused, nothing changed: {why}")),
    }
    let limits = limits_store(&*store)?;
    let edit = |table: &mut LimitTable| {
        edit(table);
        Ok(())
    };
    let changed = place
        .store
        .bounded(async {
            let edited = match kind {
                Kind::Rate => {
                    tollgate::rate_limit::change_limits(limits, &place.prefix, note, edit).await
                }
                Kind::Concurrency => {
                    tollgate::concurrency::change_limits(limits, &place.prefix, note, edit).await
                }
            };
            match edited {
                Err(LimitsError::Store(e)) => Err(e),
                other => Ok(other),
            }
        })
        .await?;
    match changed {
        Ok(Changed::Saved(version)) => Ok(Shown::Found(format!(
            "saved as version {version} of {namespace}: in force on every copy within its refresh\n"
        ))),
        Ok(Changed::Unchanged(version)) => Ok(Shown::Found(format!(
            "unchanged: version {version} of {namespace} says so already\n"
        ))),
        Err(LimitsError::Invalid(e)) => Err(format!("refused, nothing changed: {e}")),
        Err(e) => Err(e.to_string()),
    }
}

/// Why a change is not sent.
enum Refusal {
    /// Nothing is there to change (exit 1).
    Nothing(String),
    /// The change is wrong (exit 2).
    Invalid(String),
}

/// A tier the table does not know.
fn known_tier(table: &LimitTable, tier: &str) -> Result<(), Refusal> {
    if table.tiers().flatten().any(|t| t == tier) {
        return Ok(());
    }
    Err(Refusal::Invalid(format!(
        "unknown tier {tier:?} (the layer's tiers: {})",
        tier_list(table)
    )))
}

async fn set(args: &SetArgs) -> Result<Shown, String> {
    let of = args.subject.named()?;
    let (kind, limits) = match args.in_flight {
        Some(n) => (Kind::Concurrency, LimitTable::in_flight_limits(n)),
        None => (Kind::Rate, args.limits.clone()),
    };
    let precheck = |table: &LimitTable| match &of {
        Of::Tier(tier) => known_tier(table, tier),
        _ => Ok(()),
    };
    change(&args.place, kind, &args.note, precheck, |table| {
        let limits = limits.clone();
        match &of {
            Of::Own => table.set_tier(None, limits),
            Of::Tier(tier) => table.set_tier(Some(tier), limits),
            Of::Caller { key, .. } => table.set_caller(*key, limits),
        }
    })
    .await
}

async fn unset(args: &UnsetArgs) -> Result<Shown, String> {
    let of = args.subject.named()?;
    let precheck = |table: &LimitTable| {
        let nothing = |why: String| Err(Refusal::Nothing(format!("nothing to unset: {why}")));
        match &of {
            Of::Own if table.replacements().all(|(t, _)| t.is_some()) => {
                nothing("the layer's own limits are their defaults".to_owned())
            }
            Of::Tier(tier) => {
                known_tier(table, tier)?;
                if table.replacements().any(|(t, _)| t == Some(tier.as_str())) {
                    Ok(())
                } else {
                    nothing(format!("tier {tier:?} has its defaults"))
                }
            }
            Of::Caller { key, label } if table.for_caller(*key).is_none() => {
                nothing(format!("{label} has no limits of its own"))
            }
            _ => Ok(()),
        }
    };
    let kind = Kind::of(args.concurrency);
    change(&args.place, kind, &args.note, precheck, |table| {
        match &of {
            Of::Own => table.unset_tier(None),
            Of::Tier(tier) => table.unset_tier(Some(tier)),
            Of::Caller { key, .. } => table.unset_caller(*key),
        };
    })
    .await
}

async fn history(args: &HistoryArgs) -> Result<Shown, String> {
    let (store, namespace, stored) = read(&args.place, Kind::of(args.concurrency)).await?;
    if stored.is_none() {
        return Ok(Shown::Nothing {
            out: String::new(),
            why: nothing_under(&namespace),
        });
    }
    let changes = args
        .place
        .store
        .bounded(limits_store(&*store)?.limits_history(&namespace))
        .await?;
    let mut out = String::new();
    for change in changes {
        let _ = writeln!(
            out,
            "{:>5}  {}  {}",
            change.version,
            utc(change.at),
            change.note
        );
    }
    Ok(Shown::Found(out))
}

/// `YYYY-MM-DD HH:MM:SS UTC`.
fn utc(at: SystemTime) -> String {
    let secs = at
        .duration_since(UNIX_EPOCH)
        .unwrap_or(Duration::ZERO)
        .as_secs();
    let (days, rest) = ((secs / 86_400) as i64, secs % 86_400);
    // days since 1970-01-01 to a civil date (H. Hinnant's algorithm)
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02} {:02}:{:02}:{:02} UTC",
        rest / 3600,
        rest % 3600 / 60,
        rest % 60
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn limits_parse_as_written_or_say_how() {
        let limit = parse_limit("minute:100/60s").unwrap();
        assert_eq!(limit, Limit::per_minute("minute", 100));
        let limit = parse_limit("burst:5/1s:leased:block=30s").unwrap();
        assert_eq!(
            limit,
            Limit::per_second("burst", 5)
                .leased()
                .block_for(Duration::from_secs(30))
        );
        let limit = parse_limit("requests:100/1s/calls:block=30s").unwrap();
        assert_eq!(
            limit,
            Limit::per_second("requests", 100)
                .counting_calls()
                .block_for(Duration::from_secs(30))
        );
        assert!(!parse_limit("tokens:10000/1s").unwrap().counts_calls());
        for bad in [
            "",
            "minute",
            "m:1/1s/cells",
            "minute:100",
            "minute:x/1s",
            "minute:1/1y",
            "m:1/1s:fast",
        ] {
            let error = parse_limit(bad).unwrap_err();
            assert!(error.contains("NAME:COUNT/WINDOW"), "{bad}: {error}");
        }
    }

    #[test]
    fn limits_in_flight_show_as_such() {
        let mut table = LimitTable::in_flight(0, [(None, 4), (Some("pro".to_owned()), 16)]);
        table.set_tier(Some("pro"), LimitTable::in_flight_limits(32));
        let stored = StoredTable { version: 2, table };
        let mut out = String::new();
        section(&mut out, "app:cc", &stored, &Of::Own);
        assert_eq!(
            out,
            "limits   app:cc (concurrency limit), version 2, defaults of revision 0\n\n\
             (own)                        in-flight 4\n\
             pro (replaced)               in-flight 32\n\n\
             callers with limits of their own: 0\n"
        );
        // a rate limit's rows are as they were
        let mut out = String::new();
        rows(&mut out, "(own)", &[Limit::per_minute("minute", 5)]);
        assert_eq!(
            out,
            "(own)                        minute                5/1m\n"
        );
        let mut out = String::new();
        section(&mut out, "app:cc", &stored, &Of::Tier("gold".to_owned()));
        assert!(
            out.ends_with("  no tier \"gold\" here (its tiers: pro)\n"),
            "{out}"
        );
    }

    #[test]
    fn a_caller_is_named_by_an_extension_as_by_the_others() {
        use clap::error::ErrorKind::{ArgumentConflict, MissingRequiredArgument};
        #[derive(clap::Parser)]
        struct Line {
            #[command(flatten)]
            args: SetArgs,
        }
        let parse = |args: &[&str]| {
            let line = [
                "tollgate",
                "--store",
                "redis://127.0.0.1:1/",
                "--in-flight",
                "5",
            ]
            .into_iter()
            .chain(args.iter().copied());
            <Line as clap::Parser>::try_parse_from(line).map(|line| line.args)
        };
        let set = parse(&["--extension", "acme-secret", "--extension-name", "org"]).unwrap();
        assert!(!format!("{set:?}").contains("secret"), "{set:?}");
        let Ok(Of::Caller { key, label }) = set.subject.named() else {
            panic!("no caller")
        };
        assert_eq!(key, crate::rate::extension_key(Some("org"), "acme-secret"));
        assert_eq!(label, "extension org=acm…");
        for (args, kind) in [
            (
                &["--extension", "acme", "--tier", "pro"][..],
                ArgumentConflict,
            ),
            (
                &["--extension-name", "org", "--tier", "pro"],
                ArgumentConflict,
            ),
            (&["--extension-name", "org"], MissingRequiredArgument),
        ] {
            let Err(error) = parse(args) else {
                panic!("{args:?} parsed")
            };
            assert_eq!(error.kind(), kind, "{args:?}: {error}");
        }
    }

    #[test]
    fn times_are_written_in_utc() {
        assert_eq!(utc(UNIX_EPOCH), "1970-01-01 00:00:00 UTC");
        let at = UNIX_EPOCH + Duration::from_secs(1_796_515_200 + 3_723);
        assert_eq!(utc(at), "2026-12-06 01:02:03 UTC");
        let leap = UNIX_EPOCH + Duration::from_secs(951_782_400);
        assert_eq!(utc(leap), "2000-02-29 00:00:00 UTC");
    }
}
