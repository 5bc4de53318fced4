//! `tollgate inspect` and `tollgate reset`: a caller's rate-limit quota in the store a service's
//! copies share, read without spending any, and forgotten.
//!
//! Both build the service's `RateLimitLayer` from its own limits file (`RateLimitConfig`), and
//! name the caller as the service's key extractor does: the store holds a digest of the
//! extractor's domain and the value (`tollgate::key::Key`), never the value itself.

use std::collections::BTreeMap;
use std::fmt::Write;
use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use clap::{ArgGroup, Args};
use http::header::{HeaderName, HeaderValue};
use serde::Deserialize;
use serde_json::json;
use tollgate::key::{Extension, Header, Key, KeyExtractor, PeerIp, from_fn};
use tollgate::rate::{Limit, RateOutcome, RatePolicy};
use tollgate::rate_limit::{RateLimitConfig, RateLimitLayer};
use tollgate::store::{RateStore, keys};

use crate::secret::{mask, masked_header, masked_pair, masked_value};
use crate::store::StoreArgs;

pub(crate) const INSPECT_LONG_ABOUT: &str = "\
Show a caller's remaining rate-limit quota, spending none.

Builds the service's rate-limit layer from its limits file (--config, the file tollgate's \
RateLimitConfig reads) or, for a service built with `build_in_store`, from the limits in force \
that the store keeps under --prefix (no file needed; a caller's own limits included), names the caller as the service's key extractor does (--header, \
--peer-ip, --key-fn or --extension), and asks the store for each limit of the layer (or of --tier) with a \
check of cost 0: its quota, window, what is left, and the time until it grows again. A caller \
under a penalty (a limit's `block_for`) is shown as blocked, with the time the block has left.";

pub(crate) const INSPECT_AFTER_HELP: &str = "\
Example: the caller with API key `alice` of a service keyed by `x-api-key`, its limits under \
[rate_limit] in tollgate.toml:
  tollgate inspect --store redis://10.0.0.5:6379/ --config tollgate.toml --header x-api-key=alice

  store   redis://10.0.0.5:6379/
  caller  header x-api-key=a…
  limits  config-example:rl (sliding-counter)

  limit  quota  window  remaining  resets in
  burst      5      1s          2  263ms
  daily   1000      1d        997  19h17m

  not blocked

Stores: redis:// or rediss:// (standalone), --store repeated or --cluster (Redis Cluster \
nodes), postgres:// (--pg-schema if the service's store is not in schema `tollgate`).
Exit codes: 0 the quota was read; 1 the caller has spent nothing (a caller that never came, or \
named otherwise: check the caller and the limits file's prefix and tiers); 2 an error (bad \
arguments, config file or URL, a store that does not answer).";

pub(crate) const RESET_LONG_ABOUT: &str = "\
Forget what a caller has spent of a service's rate limits.

Deletes the caller's counters (and penalty blocks) of every limit of the layer and of each of \
its tiers, or of --tier only, in the store every copy of the service shares: the caller starts \
afresh at once on every copy. The store broadcasts the reset, so copies that cached a denial of \
the caller drop it.";

pub(crate) const RESET_AFTER_HELP: &str = "\
Example: give the caller with API key `alice` its full quota back:
  tollgate reset --store redis://10.0.0.5:6379/ --config tollgate.toml --header x-api-key=alice

  reset header x-api-key=a… on redis://10.0.0.5:6379/
    config-example:rl        burst, daily
    config-example:rl:paid   burst, daily

Exit codes: 0 the caller was reset; 1 there was nothing to reset (the caller had spent nothing \
under the limits file's prefix and tiers: named otherwise, or never came); 2 an error (bad \
arguments, config file or URL, a store that does not answer).";

/// The service's limits and the caller: what both subcommands read.
#[derive(Debug, Args)]
pub(crate) struct Target {
    #[command(flatten)]
    store: StoreArgs,
    /// The service's limits file (TOML): the fields of tollgate's RateLimitConfig, at the top or
    /// under a table (see --section). Without it, the limits in force are read from the store
    /// under --prefix: those of a service built with `build_in_store`.
    #[arg(long, value_name = "FILE")]
    config: Option<PathBuf>,
    /// Without --config: the service's key prefix (`RateLimitLayerBuilder::prefix`), under
    /// which the store keeps its limits in force [default: tollgate].
    #[arg(long, value_name = "PREFIX", conflicts_with_all = ["config", "section"])]
    prefix: Option<String>,
    /// The table of --config that holds the limits, e.g. `rate_limit` or `http.limits`
    /// [default: the whole file, or its `rate_limit` table when the file has no `limits`].
    #[arg(long, value_name = "TABLE")]
    section: Option<String>,
    #[command(flatten)]
    caller: Caller,
    /// With --peer-ip: the service's `PeerIp::ipv4_prefix`, the bits that name a caller.
    #[arg(long, value_name = "BITS", requires = "peer_ip", value_parser = clap::value_parser!(u8).range(0..=32))]
    ipv4_prefix: Option<u8>,
    /// With --peer-ip: the service's `PeerIp::ipv6_prefix`, the bits that name a caller.
    #[arg(long, value_name = "BITS", requires = "peer_ip", value_parser = clap::value_parser!(u8).range(0..=128))]
    ipv6_prefix: Option<u8>,
    /// The tier of the limits (a table under `tiers` in the file) [default: the layer's own
    /// limits; reset: the layer's own and every tier's].
    #[arg(long, value_name = "NAME")]
    tier: Option<String>,
}

/// Who the caller is, as the service's key extractor names it: exactly one (`--extension-name`
/// goes with `--extension`, and is no caller of its own). Its `Debug` masks the caller's value,
/// as every output of the command does.
#[derive(Args)]
#[group(skip)]
#[command(group(
    ArgGroup::new("caller")
        .required(true)
        .args(["header", "peer_ip", "key_fn", "extension"])
))]
pub(crate) struct Caller {
    /// The caller's header, for a service keyed by `key::Header`: e.g. x-api-key=alice.
    #[arg(long, value_name = "NAME=VALUE", value_parser = parse_header)]
    pub(crate) header: Option<(HeaderName, HeaderValue)>,
    /// The caller's address, for a service keyed by `key::PeerIp` (or `ForwardedIp`): an IP,
    /// or IP:port.
    #[arg(long, value_name = "ADDR", value_parser = parse_ip)]
    pub(crate) peer_ip: Option<IpAddr>,
    /// The caller's value under a service's own extractor `key::from_fn(DOMAIN, …)`: e.g.
    /// tenant=42.
    #[arg(long, value_name = "DOMAIN=VALUE", value_parser = parse_pair)]
    pub(crate) key_fn: Option<(String, String)>,
    /// The caller's value of a request extension, for a service keyed by
    /// `key::Extension::new()` (the caller its authentication inserts): the bytes the
    /// extension's `AsRef<[u8]>` gives, e.g. the tenant id acme.
    #[arg(long, value_name = "VALUE", value_parser = parse_extension)]
    pub(crate) extension: Option<String>,
    /// With --extension: NAME of a service keyed by `key::Extension::named(NAME)`.
    #[arg(
        long,
        value_name = "NAME",
        requires = "extension",
        conflicts_with_all = ["header", "peer_ip", "key_fn"]
    )]
    pub(crate) extension_name: Option<String>,
}

impl std::fmt::Debug for Caller {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Caller")
            .field("header", &masked_header(self.header.as_ref()))
            .field("peer_ip", &self.peer_ip)
            .field("key_fn", &masked_pair(self.key_fn.as_ref()))
            .field("extension", &masked_value(self.extension.as_deref()))
            .field("extension_name", &self.extension_name)
            .finish()
    }
}

/// The arguments of `tollgate inspect`.
#[derive(Debug, Args)]
pub(crate) struct InspectArgs {
    #[command(flatten)]
    target: Target,
    /// Print a JSON object instead of a table.
    #[arg(long)]
    json: bool,
}

/// The arguments of `tollgate reset`.
#[derive(Debug, Args)]
pub(crate) struct ResetArgs {
    #[command(flatten)]
    target: Target,
}

pub(crate) fn parse_pair(text: &str) -> Result<(String, String), String> {
    let (name, value) = text
        .split_once('=')
        .ok_or_else(|| format!("`{}` is not NAME=VALUE", mask(text)))?;
    Ok((name.trim().to_owned(), value.to_owned()))
}

pub(crate) fn parse_header(text: &str) -> Result<(HeaderName, HeaderValue), String> {
    let (name, value) = parse_pair(text)?;
    let name = HeaderName::from_bytes(name.as_bytes())
        .map_err(|_| format!("`{name}` is not a header name"))?;
    if value.is_empty() {
        return Err("an empty header value names no caller (the service finds no key)".to_owned());
    }
    // the value is a caller's key: not repeated
    let value = HeaderValue::from_str(&value)
        .map_err(|_| format!("the value of `{name}` is not a header value (visible ASCII only)"))?;
    Ok((name, value))
}

/// A caller's value of a request extension: not empty (a request whose extension has no bytes
/// has no key).
pub(crate) fn parse_extension(text: &str) -> Result<String, String> {
    if text.is_empty() {
        return Err(
            "an empty extension value names no caller (the service finds no key)".to_owned(),
        );
    }
    Ok(text.to_owned())
}

pub(crate) fn parse_ip(text: &str) -> Result<IpAddr, String> {
    let text = text.trim();
    text.parse::<IpAddr>()
        .or_else(|_| text.parse::<SocketAddr>().map(|addr| addr.ip()))
        .map_err(|_| format!("`{text}` is not an IP address (or IP:port)"))
}

/// The caller named: its store key, and how to say who it is (its key masked).
pub(crate) struct Who {
    pub(crate) key: Key,
    pub(crate) label: String,
}

/// A caller named on the command line: by a header, an address, a `from_fn` value or a request
/// extension's value.
#[derive(Clone, Copy, Default)]
pub(crate) struct Named<'a> {
    pub(crate) header: Option<&'a (HeaderName, HeaderValue)>,
    pub(crate) peer_ip: Option<IpAddr>,
    pub(crate) key_fn: Option<&'a (String, String)>,
    /// The value of a request extension, for a service keyed by `key::Extension`.
    pub(crate) extension: Option<&'a str>,
    /// With `extension`: the name of `key::Extension::named` (none: `key::Extension::new()`).
    pub(crate) extension_name: Option<&'a str>,
    pub(crate) ipv4_prefix: Option<u8>,
    pub(crate) ipv6_prefix: Option<u8>,
}

impl std::fmt::Debug for Named<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Named")
            .field("header", &masked_header(self.header))
            .field("peer_ip", &self.peer_ip)
            .field("key_fn", &masked_pair(self.key_fn))
            .field("extension", &masked_value(self.extension))
            .field("extension_name", &self.extension_name)
            .field("ipv4_prefix", &self.ipv4_prefix)
            .field("ipv6_prefix", &self.ipv6_prefix)
            .finish()
    }
}

/// The key of a request whose extension's bytes are `value`, under `key::Extension::new()`
/// (`name` none) or `key::Extension::named(name)`: what the extractor's own `key` gives.
pub(crate) fn extension_key(name: Option<&str>, value: &str) -> Key {
    // `String` stands for the service's type: only the bytes its `AsRef<[u8]>` gives are
    // hashed, within the domain `ext:` or `ext:<name>`
    let extractor = match name {
        None => Extension::<String>::new(),
        Some(name) => Extension::<String>::named(name),
    };
    extractor.key(&value.to_owned())
}

impl Named<'_> {
    /// The key, found in a request head as the service's extractor finds it; `None` when no
    /// caller is named.
    pub(crate) fn who(&self) -> Result<Option<Who>, String> {
        let mut request = http::Request::get("/");
        if let Some((name, value)) = self.header {
            request = request.header(name, value);
            let parts = head(request)?;
            let key = Header::new(name.clone()).extract(&parts);
            let label = format!(
                "header {name}={}",
                mask(&String::from_utf8_lossy(value.as_bytes()))
            );
            return key.map(|key| Some(Who { key, label })).ok_or_else(no_key);
        }
        if let Some(ip) = self.peer_ip {
            // as hyper / axum put it into the extensions
            let mut parts = head(request)?;
            parts.extensions.insert(SocketAddr::new(ip, 0));
            let mut extractor = PeerIp::new();
            if let Some(bits) = self.ipv4_prefix {
                extractor = extractor.ipv4_prefix(bits);
            }
            if let Some(bits) = self.ipv6_prefix {
                extractor = extractor.ipv6_prefix(bits);
            }
            let key = extractor.extract(&parts);
            let label = format!("peer IP {ip}");
            return key.map(|key| Some(Who { key, label })).ok_or_else(no_key);
        }
        if let Some((domain, value)) = self.key_fn {
            let extractor = from_fn(domain.clone(), |_: &http::request::Parts| None::<Vec<u8>>);
            let key = extractor.key(value.as_bytes());
            let label = format!("key-fn {domain}={}", mask(value));
            return Ok(Some(Who { key, label }));
        }
        if let Some(value) = self.extension {
            if value.is_empty() {
                return Err(no_key());
            }
            let key = extension_key(self.extension_name, value);
            let label = match self.extension_name {
                None => format!("extension {}", mask(value)),
                Some(name) => format!("extension {name}={}", mask(value)),
            };
            return Ok(Some(Who { key, label }));
        }
        Ok(None)
    }
}

impl Target {
    /// The caller's key, found in a request head as the service's extractor finds it.
    fn who(&self) -> Result<Who, String> {
        let named = Named {
            header: self.caller.header.as_ref(),
            peer_ip: self.caller.peer_ip,
            key_fn: self.caller.key_fn.as_ref(),
            extension: self.caller.extension.as_deref(),
            extension_name: self.caller.extension_name.as_deref(),
            ipv4_prefix: self.ipv4_prefix,
            ipv6_prefix: self.ipv6_prefix,
        };
        named.who()?.ok_or_else(|| {
            "name the caller: --header, --peer-ip, --key-fn or --extension".to_owned()
        })
    }
}

fn head(request: http::request::Builder) -> Result<http::request::Parts, String> {
    request
        .body(())
        .map(|request| request.into_parts().0)
        .map_err(|e| e.to_string())
}

fn no_key() -> String {
    "the service's extractor finds no key in such a request".to_owned()
}

/// The limits file: the whole of it, or a table of it.
fn load_config(path: &Path, section: Option<&str>) -> Result<RateLimitConfig, String> {
    let name = path.display();
    let text = std::fs::read_to_string(path).map_err(|e| format!("{name}: {e}"))?;
    let table: toml::Table = toml::from_str(&text).map_err(|e| format!("{name}: {e}"))?;
    if let Some(section) = section {
        let whole = toml::Value::Table(table);
        let mut value = &whole;
        for part in section.split('.') {
            value = value
                .get(part)
                .filter(|value| value.is_table())
                .ok_or_else(|| format!("{name}: there is no table [{section}]"))?;
        }
        return value
            .clone()
            .try_into()
            .map_err(|e| format!("{name}: [{section}]: {e}"));
    }
    let at_top = table.contains_key("limits") || table.contains_key("tiers");
    if !at_top && table.get("rate_limit").is_some_and(toml::Value::is_table) {
        /// A file with its limits under `[rate_limit]`, beside other settings.
        #[derive(Deserialize)]
        struct Wrapped {
            rate_limit: RateLimitConfig,
        }
        let wrapped: Wrapped = toml::from_str(&text).map_err(|e| format!("{name}: {e}"))?;
        return Ok(wrapped.rate_limit);
    }
    toml::from_str(&text).map_err(|e| {
        format!(
            "{name}: {e}\n(the limits go at the top of the file or under [rate_limit]; \
             --section names another table)"
        )
    })
}

/// What both subcommands set up: the layer as the service builds it, and the caller.
struct Setup {
    store: Arc<dyn RateStore>,
    layer: RateLimitLayer,
    /// The layer's named tiers.
    tiers: Vec<String>,
    who: Who,
}

impl Target {
    async fn setup(&self) -> Result<Setup, String> {
        let Some(path) = self.config.as_deref() else {
            return self.setup_from_store().await;
        };
        let config = load_config(path, self.section.as_deref())?;
        let tiers: Vec<String> = config.tiers.keys().cloned().collect();
        self.known_tier(&tiers, &path.display().to_string())?;
        let who = self.who()?;
        let store: Arc<dyn RateStore> = self.store.open().await?;
        let mut builder = RateLimitLayer::builder(Arc::clone(&store))
            .config(config)
            // this process admits nothing: no deny cache, no subscription to the broadcast
            .deny_cache(false);
        if !tiers.is_empty() {
            builder = builder.tier_by(|_| None);
        }
        let layer = builder
            .build()
            .map_err(|e| format!("{}: {e}", path.display()))?;
        Ok(Setup {
            store,
            layer,
            tiers,
            who,
        })
    }

    /// The layer as the limits in force under --prefix make it (a service built with
    /// `build_in_store`): its tiers, its algorithm, and the caller's own limits if it has some.
    async fn setup_from_store(&self) -> Result<Setup, String> {
        let prefix = self.prefix.as_deref().unwrap_or(keys::DEFAULT_PREFIX);
        let namespace = keys::rate_namespace(prefix).map_err(|e| e.to_string())?;
        let who = self.who()?;
        let store = self.store.open().await?;
        let limits = store.limits_store().ok_or_else(|| {
            "this store keeps no limits: name the limits file, --config".to_owned()
        })?;
        let Some(stored) = self.store.bounded(limits.load_limits(&namespace)).await? else {
            return Err(format!(
                "no limits in force under {namespace}: name the service's limits file \
                 (--config), or its prefix (--prefix) if it keeps its limits in the store"
            ));
        };
        let table = stored.table;
        let tiers: Vec<String> = table.tiers().flatten().map(str::to_owned).collect();
        self.known_tier(&tiers, &format!("the limits in force under {namespace}"))?;
        let own = match table.for_caller(who.key) {
            Some(own) => own,
            None => table.for_tier(None).unwrap_or_default(),
        };
        let store: Arc<dyn RateStore> = store;
        let mut builder = RateLimitLayer::builder(Arc::clone(&store))
            .limits(own.iter().cloned())
            .algorithm(table.algorithm().unwrap_or_default())
            .prefix(prefix)
            .deny_cache(false);
        for tier in &tiers {
            let limits = table.for_tier(Some(tier)).unwrap_or_default();
            builder = builder.tier(tier.clone(), limits.iter().cloned());
        }
        if !tiers.is_empty() {
            builder = builder.tier_by(|_| None);
        }
        let layer = builder
            .build()
            .map_err(|e| format!("the limits in force under {namespace}: {e}"))?;
        Ok(Setup {
            store,
            layer,
            tiers,
            who,
        })
    }

    /// `--tier`, if given, among `tiers` (those of `source`).
    fn known_tier(&self, tiers: &[String], source: &str) -> Result<(), String> {
        let Some(tier) = &self.tier else {
            return Ok(());
        };
        if tiers.contains(tier) {
            return Ok(());
        }
        let known = match tiers.is_empty() {
            true => "it has no tiers".to_owned(),
            false => format!("its tiers: {}", tiers.join(", ")),
        };
        Err(format!("{source}: no tier {tier:?} ({known})"))
    }

    /// `call` bounded by the store's timeout (and a second more), its error naming the store.
    async fn bounded<T>(
        &self,
        call: impl Future<Output = Result<T, tollgate::store::StoreError>>,
    ) -> Result<T, String> {
        self.store.bounded(call).await
    }
}

/// One limit's state, as both outputs show it.
struct Row<'a> {
    limit: &'a Limit,
    remaining: u64,
    reset: Duration,
    blocked: bool,
}

fn rows<'a>(policy: &'a RatePolicy, outcome: &RateOutcome) -> Vec<Row<'a>> {
    policy
        .limits()
        .iter()
        .zip(&outcome.limits)
        .map(|(limit, state)| Row {
            limit,
            remaining: state.remaining,
            reset: state.reset,
            // a check of cost 0 is denied only under a block; the blocked limit answers 0 left
            blocked: !outcome.admitted && limit.penalty().is_some() && state.remaining == 0,
        })
        .collect()
}

/// Whether a peek found anything spent: a limit short of its quota, or one that grows back
/// later, or a block. A caller that never came, or whose spending all expired, shows neither.
fn spent(policy: &RatePolicy, outcome: &RateOutcome) -> bool {
    !outcome.admitted
        || policy
            .limits()
            .iter()
            .zip(&outcome.limits)
            .any(|(limit, state)| state.remaining < limit.quota() || !state.reset.is_zero())
}

/// Why nothing was found of `who` under `namespaces` (`lead`: "nothing spent", "nothing to
/// reset"), and what to check.
fn nothing_of(lead: &str, who: &Who, namespaces: &[impl AsRef<str>]) -> String {
    format!(
        "{lead}: the store holds no state of {} under {}; a caller that never came, or one \
         named otherwise (check the caller, the prefix and the tiers)",
        who.label,
        namespaces
            .iter()
            .map(AsRef::as_ref)
            .collect::<Vec<_>>()
            .join(", ")
    )
}

async fn inspect(args: &InspectArgs) -> Result<Shown, String> {
    let target = &args.target;
    let setup = target.setup().await?;
    let key = setup.who.key;
    let (policy, outcome) = match &target.tier {
        Some(tier) => (
            setup.layer.tier_policy(tier),
            target.bounded(setup.layer.peek_tier(tier, key)).await?,
        ),
        None => (
            setup.layer.policy(),
            target.bounded(setup.layer.peek(key)).await?,
        ),
    };
    let policy = &*policy;
    let rows = rows(policy, &outcome);
    let mut why = None;
    if !spent(policy, &outcome) {
        let mut text = nothing_of("nothing spent", &setup.who, &[policy.namespace()]);
        // a caller of a tier, inspected without --tier: name the tiers it has spent under
        if target.tier.is_none() {
            let mut in_tiers = Vec::new();
            for tier in &setup.tiers {
                let outcome = target.bounded(setup.layer.peek_tier(tier, key)).await?;
                if spent(&setup.layer.tier_policy(tier), &outcome) {
                    in_tiers.push(format!("--tier {tier}"));
                }
            }
            if !in_tiers.is_empty() {
                let _ = write!(text, "; it has spent under {}", in_tiers.join(", "));
            }
        }
        why = Some(text);
    }
    let shown = |out: String| match why {
        None => Shown::Found(out),
        Some(why) => Shown::Nothing { out, why },
    };
    if args.json {
        return Ok(shown(inspect_json(
            target, &setup.who, policy, &outcome, &rows,
        )));
    }
    let mut out = String::new();
    let _ = writeln!(out, "store   {}", target.store.describe());
    let _ = writeln!(out, "caller  {}", setup.who.label);
    let _ = writeln!(
        out,
        "limits  {} ({})",
        policy.namespace(),
        policy.algorithm()
    );
    if let Some(tier) = &target.tier {
        let _ = writeln!(out, "tier    {tier}");
    }
    out.push('\n');
    let mut table = vec![[
        "limit".to_owned(),
        "quota".to_owned(),
        "window".to_owned(),
        "remaining".to_owned(),
        "resets in".to_owned(),
    ]];
    for row in &rows {
        let remaining = match row.blocked {
            true => "0 (blocked)".to_owned(),
            false => row.remaining.to_string(),
        };
        table.push([
            row.limit.name().to_owned(),
            row.limit.quota().to_string(),
            window(row.limit.window()),
            remaining,
            human(row.reset),
        ]);
    }
    let widths: Vec<usize> = (0..5)
        .map(|i| {
            table
                .iter()
                .map(|r| r[i].chars().count())
                .max()
                .unwrap_or(0)
        })
        .collect();
    for row in &table {
        let mut line = format!("{:<w$}", row[0], w = widths[0]);
        for i in 1..4 {
            let _ = write!(line, "  {:>w$}", row[i], w = widths[i]);
        }
        let _ = write!(line, "  {}", row[4]);
        let _ = writeln!(out, "{}", line.trim_end());
    }
    out.push('\n');
    if outcome.admitted {
        out.push_str("not blocked\n");
    } else {
        let by: Vec<&str> = rows
            .iter()
            .filter(|row| row.blocked)
            .map(|row| row.limit.name())
            .collect();
        let _ = write!(out, "blocked for {}", human(outcome.retry_after));
        if !by.is_empty() {
            let _ = write!(out, " (penalty of {})", by.join(", "));
        }
        out.push('\n');
    }
    Ok(shown(out))
}

fn inspect_json(
    target: &Target,
    who: &Who,
    policy: &RatePolicy,
    outcome: &RateOutcome,
    rows: &[Row<'_>],
) -> String {
    let limits: Vec<serde_json::Value> = rows
        .iter()
        .map(|row| {
            json!({
                "name": row.limit.name(),
                "quota": row.limit.quota(),
                "window": window(row.limit.window()),
                "window_ms": millis(row.limit.window()),
                "remaining": row.remaining,
                "reset_ms": millis(row.reset),
                "block_for_ms": row.limit.penalty().map(millis),
                "blocked": row.blocked,
            })
        })
        .collect();
    let value = json!({
        "store": target.store.describe(),
        "caller": who.label,
        "key": who.key.to_string(),
        "namespace": policy.namespace(),
        "algorithm": policy.algorithm().to_string(),
        "tier": target.tier,
        "spent": spent(policy, outcome),
        "blocked": !outcome.admitted,
        "retry_after_ms": millis(outcome.retry_after),
        "limits": limits,
    });
    let mut out = serde_json::to_string_pretty(&value).unwrap_or_default();
    out.push('\n');
    out
}

async fn reset(args: &ResetArgs) -> Result<Shown, String> {
    let target = &args.target;
    let setup = target.setup().await?;
    let key = setup.who.key;
    // whether the caller had spent anything: peeked first, for a reset that finds nothing to
    // say so (a mistyped caller or prefix); the reset runs either way
    let mut anything = false;
    let mut namespaces = Vec::new();
    let tiers: Vec<&String> = match &target.tier {
        Some(tier) => vec![tier],
        None => setup.tiers.iter().collect(),
    };
    if target.tier.is_none() {
        let outcome = target.bounded(setup.layer.peek(key)).await?;
        let policy = setup.layer.policy();
        anything |= spent(&policy, &outcome);
        namespaces.push(policy.namespace().to_owned());
    }
    for tier in tiers {
        let outcome = target.bounded(setup.layer.peek_tier(tier, key)).await?;
        let policy = setup.layer.tier_policy(tier);
        anything |= spent(&policy, &outcome);
        namespaces.push(policy.namespace().to_owned());
    }
    // (namespace, limits) of each policy reset
    let mut done: BTreeMap<String, Vec<String>> = BTreeMap::new();
    let mut record = |policy: &RatePolicy| {
        let names = policy
            .limits()
            .iter()
            .map(|l| l.name().to_owned())
            .collect();
        done.insert(policy.namespace().to_owned(), names);
    };
    match &target.tier {
        Some(tier) => {
            let policy = setup.layer.tier_policy(tier);
            target.bounded(setup.store.reset_rate(&policy, key)).await?;
            record(&policy);
        }
        None => {
            target.bounded(setup.layer.reset(key)).await?;
            record(&setup.layer.policy());
            for tier in &setup.tiers {
                record(&setup.layer.tier_policy(tier));
            }
        }
    }
    let mut out = format!("reset {} on {}\n", setup.who.label, target.store.describe());
    let width = done.keys().map(String::len).max().unwrap_or(0);
    for (namespace, limits) in &done {
        let _ = writeln!(out, "  {namespace:<width$}   {}", limits.join(", "));
    }
    match anything {
        true => Ok(Shown::Found(out)),
        false => Ok(Shown::Nothing {
            out,
            why: nothing_of("nothing to reset", &setup.who, &namespaces),
        }),
    }
}

/// A window as a configuration file writes it: `1s`, `5m`, `1h`, `1d`, `250ms`.
pub(crate) fn window(d: Duration) -> String {
    let ms = d.as_millis();
    for (unit, size) in [
        ("d", 86_400_000),
        ("h", 3_600_000),
        ("m", 60_000),
        ("s", 1_000),
    ] {
        if ms >= size && ms.is_multiple_of(size) {
            return format!("{}{unit}", ms / size);
        }
    }
    format!("{ms}ms")
}

/// A time left, to a tenth of a second under a minute: `0s`, `850ms`, `12.3s`, `4m05s`, `23h59m`.
pub(crate) fn human(d: Duration) -> String {
    let ms = d.as_millis();
    let secs = d.as_secs();
    match ms {
        0 => "0s".to_owned(),
        1..1_000 => format!("{ms}ms"),
        1_000..60_000 => {
            let tenths = ms.div_ceil(100);
            match tenths % 10 {
                0 => format!("{}s", tenths / 10),
                t => format!("{}.{t}s", tenths / 10),
            }
        }
        60_000..3_600_000 => format!("{}m{:02}s", secs / 60, secs % 60),
        _ => format!("{}h{:02}m", secs / 3600, secs / 60 % 60),
    }
}

pub(crate) fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

/// What a subcommand that reads the store shows, on stdout either way.
#[derive(Debug)]
pub(crate) enum Shown {
    /// What was asked about is in the store: exit 0.
    Found(String),
    /// The store holds nothing under what was named — a caller that never spent, or one named
    /// otherwise; a lock never taken; another prefix: `why` goes to stderr, exit 1.
    Nothing {
        /// What the subcommand prints, as when it finds something.
        out: String,
        /// What was looked for, and what to check.
        why: String,
    },
}

impl From<String> for Shown {
    fn from(out: String) -> Self {
        Shown::Found(out)
    }
}

pub(crate) fn runtime_and<T: Into<Shown>, F: Future<Output = Result<T, String>>>(
    run: impl FnOnce() -> F,
) -> ExitCode {
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(error) => {
            eprintln!("error: could not start the runtime: {error}");
            return ExitCode::from(2);
        }
    };
    match runtime.block_on(run()).map(Into::into) {
        Ok(Shown::Found(out)) => {
            print!("{out}");
            ExitCode::SUCCESS
        }
        Ok(Shown::Nothing { out, why }) => {
            print!("{out}");
            eprintln!("{why}");
            ExitCode::from(1)
        }
        Err(error) => {
            eprintln!("error: {error}");
            ExitCode::from(2)
        }
    }
}

pub(crate) fn run_inspect(args: &InspectArgs) -> ExitCode {
    runtime_and(|| inspect(args))
}

pub(crate) fn run_reset(args: &ResetArgs) -> ExitCode {
    runtime_and(|| reset(args))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations() {
        assert_eq!(window(Duration::from_secs(60)), "1m");
        assert_eq!(window(Duration::from_secs(86_400)), "1d");
        assert_eq!(window(Duration::from_millis(1500)), "1500ms");
        assert_eq!(human(Duration::ZERO), "0s");
        assert_eq!(human(Duration::from_millis(850)), "850ms");
        assert_eq!(human(Duration::from_millis(12_301)), "12.4s");
        assert_eq!(human(Duration::from_secs(245)), "4m05s");
        assert_eq!(human(Duration::from_secs(86_399)), "23h59m");
    }

    #[test]
    fn a_callers_debug_masks_its_value() {
        let caller = Caller {
            header: Some(parse_header("x-api-key=sk_live_51Hx9secret").unwrap()),
            peer_ip: None,
            key_fn: Some(parse_pair("tenant=acme-corp-secret").unwrap()),
            extension: Some("globex-secret".to_owned()),
            extension_name: Some("org".to_owned()),
        };
        let shown = format!("{caller:?}");
        assert!(!shown.contains("secret"), "{shown}");
        assert!(shown.contains("x-api-key=sk_l…"), "{shown}");
        assert!(shown.contains("tenant=acme…"), "{shown}");
        assert!(shown.contains("extension: Some(\"glob…\")"), "{shown}");
        assert!(shown.contains("extension_name: Some(\"org\")"), "{shown}");
        let named = Named {
            extension: caller.extension.as_deref(),
            ..Named::default()
        };
        let shown = format!("{named:?}");
        assert!(!shown.contains("secret"), "{shown}");
    }

    /// What the authentication layer of a service inserts: the caller's tenant.
    #[derive(Clone)]
    struct Tenant {
        id: String,
    }

    impl AsRef<[u8]> for Tenant {
        fn as_ref(&self) -> &[u8] {
            self.id.as_bytes()
        }
    }

    #[test]
    fn an_extension_names_the_key_the_services_extractor_finds() {
        let acme = Tenant { id: "acme".into() };
        let by_tenant = Extension::<Tenant>::new();
        assert_eq!(extension_key(None, "acme"), by_tenant.key(&acme));
        let named = Extension::<Tenant>::named("tenant");
        assert_eq!(extension_key(Some("tenant"), "acme"), named.key(&acme));
        // a request the service sees finds that key
        let mut request = http::Request::get("/").body(()).unwrap();
        request.extensions_mut().insert(acme.clone());
        let parts = request.into_parts().0;
        assert_eq!(by_tenant.extract(&parts), Some(extension_key(None, "acme")));
        // another name, another domain, another value: another caller
        assert_ne!(extension_key(None, "acme"), named.key(&acme));
        assert_ne!(extension_key(Some("org"), "acme"), named.key(&acme));
        assert_ne!(extension_key(None, "acmf"), by_tenant.key(&acme));
        // nor the same bytes under `from_fn` or a header
        let from_fn = from_fn("ext", |_: &http::request::Parts| None::<Vec<u8>>);
        assert_ne!(from_fn.key(b"acme"), by_tenant.key(&acme));

        let who = Named {
            extension: Some("acme"),
            ..Named::default()
        }
        .who()
        .unwrap()
        .unwrap();
        assert_eq!(who.key, by_tenant.key(&acme));
        assert_eq!(who.label, "extension a…");
        let who = Named {
            extension: Some("acme"),
            extension_name: Some("tenant"),
            ..Named::default()
        }
        .who()
        .unwrap()
        .unwrap();
        assert_eq!(who.key, named.key(&acme));
        assert_eq!(who.label, "extension tenant=a…");
        assert!(parse_extension("").is_err());
    }

    /// `Target` as clap takes `ARGS…`.
    fn target(args: &[&str]) -> Result<Target, clap::Error> {
        #[derive(clap::Parser)]
        struct Line {
            #[command(flatten)]
            target: Target,
        }
        let line = ["tollgate", "--store", "redis://127.0.0.1:1/"]
            .into_iter()
            .chain(args.iter().copied());
        <Line as clap::Parser>::try_parse_from(line).map(|line| line.target)
    }

    #[test]
    fn exactly_one_caller_an_extension_with_its_name() {
        let named = target(&["--extension", "acme", "--extension-name", "tenant"]).unwrap();
        assert_eq!(named.caller.extension.as_deref(), Some("acme"));
        assert_eq!(named.caller.extension_name.as_deref(), Some("tenant"));
        assert_eq!(
            named.who().unwrap().key,
            extension_key(Some("tenant"), "acme")
        );
        assert!(target(&["--extension", "acme"]).is_ok());
        for (args, kind) in [
            (&[][..], clap::error::ErrorKind::MissingRequiredArgument),
            (
                &["--extension-name", "tenant"],
                clap::error::ErrorKind::MissingRequiredArgument,
            ),
            (
                &["--extension-name", "tenant", "--header", "x-api-key=alice"],
                clap::error::ErrorKind::ArgumentConflict,
            ),
            (
                &["--extension", "acme", "--header", "x-api-key=alice"],
                clap::error::ErrorKind::ArgumentConflict,
            ),
            (
                &["--extension", "acme", "--key-fn", "tenant=acme"],
                clap::error::ErrorKind::ArgumentConflict,
            ),
            (
                &["--extension", ""],
                clap::error::ErrorKind::ValueValidation,
            ),
        ] {
            let Err(error) = target(args) else {
                panic!("{args:?} parsed")
            };
            assert_eq!(error.kind(), kind, "{args:?}: {error}");
        }
    }

    #[test]
    fn callers() {
        assert!(parse_header("x-api-key=alice").is_ok());
        assert!(parse_header("x-api-key=").is_err());
        assert!(parse_header("x api=1").is_err());
        assert_eq!(parse_ip("10.0.0.1:443"), Ok("10.0.0.1".parse().unwrap()));
        assert_eq!(parse_ip("::1"), Ok("::1".parse().unwrap()));
    }
}
