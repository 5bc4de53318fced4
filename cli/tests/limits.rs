//! `tollgate limits` run as a binary against two copies of a service that keep their limits in
//! the store (`build_in_store`), on a throwaway `redis-server` and PostgreSQL: no limits file;
//! a change made by the tool governs both copies within their refresh; what names nothing
//! exits 1, and a refused change exits 2 and changes nothing. Then the same for a concurrency
//! limit's limits of requests in flight (`--in-flight`, `--concurrency`), shown beside a rate
//! limit's of the same prefix; and of a layer keyed by the caller its authentication inserts
//! (`key::Extension`), named with `--extension`.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::*;
use http::StatusCode;
use tollgate::concurrency::ConcurrencyLimitLayer;
use tollgate::key::{self, Header};
use tollgate::rate::Limit;
use tollgate::rate_limit::RateLimitLayer;
use tollgate::store::{CopySeen, PermitStore, PgStore, RateStore, RedisStore, keys};
use tollgate::testing::{PgServer, RedisServer};

const REFRESH: Duration = Duration::from_millis(100);

/// A copy of the service: 5 a minute per `x-api-key`, a tier `pro` of 50, under prefix `svc`.
async fn copy(store: Arc<dyn RateStore>, quota: u64) -> RateLimitLayer<Header> {
    RateLimitLayer::builder(store)
        .limit(Limit::per_minute("minute", quota))
        .tier("pro", [Limit::per_minute("minute", 50)])
        .tier_by(|parts| parts.headers.get("x-plan")?.to_str().ok())
        .prefix("svc")
        .key(Header::from_static("x-api-key"))
        .limits_refresh(REFRESH)
        .build_in_store()
        .await
        .unwrap()
}

/// `n` requests of `caller` through each copy: how many were admitted.
async fn admitted(copies: &[RateLimitLayer<Header>; 2], caller: &str, n: usize) -> usize {
    let mut admitted = 0;
    for _ in 0..n {
        for copy in copies {
            if call(copy, &[("x-api-key", caller)], None).await == StatusCode::OK {
                admitted += 1;
            }
        }
    }
    admitted
}

/// The whole round of the tool against `store_args` (the service's store), its copies `copies`.
async fn the_tool_reads_and_changes_the_limits(
    store_args: &[&str],
    copies: [RateLimitLayer<Header>; 2],
) {
    // `tollgate <command> <store args> <rest>`
    let tool = |command: &[&str], rest: &[&str]| {
        let mut args = command.to_vec();
        args.extend_from_slice(store_args);
        args.extend_from_slice(rest);
        let args: Vec<String> = args.into_iter().map(str::to_owned).collect();
        async move {
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            tollgate(&args).await
        }
    };
    let run = |extra: &[&str]| tool(&["limits", extra[0]], &extra[1..]);
    // the copy built with 9 decides with the 5 the first one seeded
    let shown = run(&["show", "--prefix", "svc"]).await;
    assert_eq!(shown.code, 0, "{shown:?}");
    assert!(
        shown
            .stdout
            .contains("limits   svc:rl (sliding-log), version 1"),
        "{shown:?}"
    );
    assert!(
        shown.stdout.contains("minute                5/1m"),
        "{shown:?}"
    );
    assert!(
        shown.stdout.contains("callers with limits of their own: 0"),
        "{shown:?}"
    );
    assert!(
        shown
            .stdout
            .contains("copies seen lately: 2 (1 built with other defaults"),
        "{shown:?}"
    );

    let set = run(&[
        "set",
        "--prefix",
        "svc",
        "--header",
        "x-api-key=acme",
        "--limit",
        "minute:2/60s",
        "--note",
        "acme trial",
    ])
    .await;
    assert_eq!(set.code, 0, "{set:?}");
    assert!(
        set.stdout.starts_with("saved as version 2 of svc:rl"),
        "{set:?}"
    );
    assert!(
        !format!("{set:?}").contains("acme"),
        "the caller's value shows: {set:?}"
    );
    tokio::time::sleep(REFRESH * 5).await;
    assert_eq!(admitted(&copies, "acme", 3).await, 2);
    assert_eq!(admitted(&copies, "bob", 3).await, 5);

    let tier = run(&[
        "set",
        "--prefix",
        "svc",
        "--tier",
        "pro",
        "--limit",
        "minute:70/60s",
    ])
    .await;
    assert_eq!(tier.code, 0, "{tier:?}");
    tokio::time::sleep(REFRESH * 5).await;
    for copy in &copies {
        assert_eq!(copy.tier_policy("pro").limits()[0].quota(), 70);
    }
    let caller = run(&["show", "--prefix", "svc", "--header", "x-api-key=acme"]).await;
    assert!(
        caller.stdout.contains("minute                2/1m"),
        "{caller:?}"
    );

    // what names nothing: exit 1, saying what was looked for
    let nobody = run(&["unset", "--prefix", "svc", "--header", "x-api-key=nobody"]).await;
    assert_eq!(nobody.code, 1, "{nobody:?}");
    assert!(
        nobody.stderr.contains("has no limits of its own"),
        "{nobody:?}"
    );
    let other = run(&["show", "--prefix", "svx"]).await;
    assert_eq!(other.code, 1, "{other:?}");
    assert!(
        other.stderr.contains("no limits in force under svx:rl"),
        "{other:?}"
    );
    // refused: exit 2, nothing changed
    let gold = run(&[
        "set",
        "--prefix",
        "svc",
        "--tier",
        "gold",
        "--limit",
        "minute:1/60s",
    ])
    .await;
    assert_eq!(gold.code, 2, "{gold:?}");
    assert!(
        gold.stderr
            .contains("unknown tier \"gold\" (the layer's tiers: pro)"),
        "{gold:?}"
    );
    let zero = run(&["set", "--prefix", "svc", "--limit", "minute:0/60s"]).await;
    assert_eq!(zero.code, 2, "{zero:?}");
    assert!(zero.stderr.contains("refused, nothing changed"), "{zero:?}");

    let unset = run(&[
        "unset",
        "--prefix",
        "svc",
        "--header",
        "x-api-key=acme",
        "--note",
        "trial over",
    ])
    .await;
    assert_eq!(unset.code, 0, "{unset:?}");
    tokio::time::sleep(REFRESH * 5).await;
    // back to the tier's 5 a minute, 2 spent
    assert_eq!(admitted(&copies, "acme", 3).await, 3);

    // inspect and reset read the limits in force: no limits file
    let inspect = |who: &str| {
        tool(
            &["inspect"],
            &["--prefix", "svc", "--header", who, "--json"],
        )
    };
    let bob = inspect("x-api-key=bob").await.json();
    assert_eq!(remaining(&bob), rows(&[("minute", 5, 0)]));
    let reset = tool(
        &["reset"],
        &["--prefix", "svc", "--header", "x-api-key=bob"],
    )
    .await;
    assert_eq!(reset.code, 0, "{reset:?}");
    assert_eq!(
        remaining(&inspect("x-api-key=bob").await.json_of_nothing()),
        rows(&[("minute", 5, 5)])
    );
    let pro = tool(
        &["inspect"],
        &[
            "--prefix",
            "svc",
            "--tier",
            "pro",
            "--header",
            "x-api-key=bob",
        ],
    )
    .await;
    assert_eq!(pro.code, 1, "{pro:?}");
    assert!(pro.stdout.contains("70"), "{pro:?}");
    let gold = tool(
        &["inspect"],
        &[
            "--prefix",
            "svc",
            "--tier",
            "gold",
            "--header",
            "x-api-key=bob",
        ],
    )
    .await;
    assert_eq!(gold.code, 2, "{gold:?}");
    assert!(
        gold.stderr.contains("no tier \"gold\" (its tiers: pro)"),
        "{gold:?}"
    );
    let svx = tool(
        &["reset"],
        &["--prefix", "svx", "--header", "x-api-key=bob"],
    )
    .await;
    assert_eq!(svx.code, 2, "{svx:?}");
    assert!(
        svx.stderr.contains("no limits in force under svx:rl"),
        "{svx:?}"
    );

    let history = run(&["history", "--prefix", "svc"]).await;
    assert_eq!(history.code, 0, "{history:?}");
    let notes: Vec<&str> = history
        .stdout
        .lines()
        .map(|line| {
            line.split_once(" UTC  ")
                .map_or("", |(_, note)| note.trim_end())
        })
        .collect();
    assert_eq!(
        notes,
        ["trial over", "", "acme trial", "defaults of revision 0"],
        "{history:?}"
    );
}

/// A service under prefix `jobs`: a rate limit of 5 a minute, and a concurrency limit of 2
/// requests in flight per `x-api-key`, 8 for tier `pro`.
async fn jobs(
    rate: Arc<dyn RateStore>,
    permits: impl PermitStore,
) -> (RateLimitLayer<Header>, ConcurrencyLimitLayer<Header>) {
    let rate = RateLimitLayer::builder(rate)
        .limit(Limit::per_minute("minute", 5))
        .prefix("jobs")
        .key(Header::from_static("x-api-key"))
        .limits_refresh(REFRESH)
        .build_in_store()
        .await
        .unwrap();
    let in_flight = ConcurrencyLimitLayer::builder(permits)
        .limit(2)
        .tier("pro", 8)
        .tier_by(|parts| parts.headers.get("x-plan")?.to_str().ok())
        .prefix("jobs")
        .key(Header::from_static("x-api-key"))
        .limits_refresh(REFRESH)
        .build_in_store()
        .await
        .unwrap();
    (rate, in_flight)
}

/// `copies seen lately` as `show` prints it, of copies all built with the defaults in force.
fn seen(copies: &[CopySeen]) -> String {
    let mut out = format!(
        "\ncopies seen lately: {} (0 built with other defaults, which do not apply)\n",
        copies.len()
    );
    for copy in copies {
        out.push_str(&format!("  {}  built {}\n", copy.copy, copy.built));
    }
    out
}

/// The round of the tool on the limits of requests in flight of `layer` (prefix `jobs`, beside
/// the rate limit `rate`), against `store_args` (the service's store, its URL second); the
/// store holds a rate limit's limits under `svc` and none of a concurrency limit there.
async fn the_tool_changes_the_limits_in_flight(
    store_args: &[&str],
    rate: RateLimitLayer<Header>,
    layer: ConcurrencyLimitLayer<Header>,
) {
    let run = |command: &[&str]| {
        let mut args = vec!["limits", command[0]];
        args.extend_from_slice(store_args);
        args.extend_from_slice(&command[1..]);
        let args: Vec<String> = args.into_iter().map(str::to_owned).collect();
        async move {
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            tollgate(&args).await
        }
    };
    let url = store_args[1];
    let limits = layer.limits().unwrap();
    let alice = Header::from_static("x-api-key").key(b"alice");
    let rate_section = format!(
        "limits   jobs:rl (sliding-log), version 1, defaults of revision 0\n\n\
         (own)                        minute                5/1m\n\n\
         callers with limits of their own: 0\n{}",
        seen(&rate.limits().unwrap().copies().await.unwrap())
    );
    let in_flight_seen = seen(&limits.copies().await.unwrap());
    assert_eq!(layer.limits().unwrap().copies().await.unwrap().len(), 1);

    // both tables of the prefix, each in its section
    let shown = run(&["show", "--prefix", "jobs"]).await;
    assert_eq!(shown.code, 0, "{shown:?}");
    assert_eq!(
        shown.stdout,
        format!(
            "store    {url}\n{rate_section}\n\
             limits   jobs:cc (concurrency limit), version 1, defaults of revision 0\n\n\
             (own)                        in-flight 2\n\
             pro                          in-flight 8\n\n\
             callers with limits of their own: 0\n{in_flight_seen}"
        ),
        "{shown:?}"
    );
    assert_eq!(shown.stderr, "");

    // a caller's own limit, and a tier's
    let set = run(&[
        "set",
        "--prefix",
        "jobs",
        "--in-flight",
        "5",
        "--header",
        "x-api-key=alice",
        "--note",
        "alice runs batch jobs",
    ])
    .await;
    assert_eq!(set.code, 0, "{set:?}");
    assert_eq!(
        set.stdout,
        "saved as version 2 of jobs:cc: in force on every copy within its refresh\n"
    );
    assert_eq!(set.stderr, "");
    assert_eq!(limits.refresh().await.unwrap(), 2);
    assert_eq!(layer.caller_limit(alice), 5);
    assert_eq!(layer.limit(), 2);
    let pro = run(&[
        "set",
        "--prefix",
        "jobs",
        "--tier",
        "pro",
        "--in-flight",
        "10",
    ])
    .await;
    assert_eq!(pro.code, 0, "{pro:?}");
    assert_eq!(
        pro.stdout,
        "saved as version 3 of jobs:cc: in force on every copy within its refresh\n"
    );
    // the same again changes nothing
    let again = run(&[
        "set",
        "--prefix",
        "jobs",
        "--tier",
        "pro",
        "--in-flight",
        "10",
    ])
    .await;
    assert_eq!(again.code, 0, "{again:?}");
    assert_eq!(
        again.stdout,
        "unchanged: version 3 of jobs:cc says so already\n"
    );
    assert_eq!(limits.refresh().await.unwrap(), 3);
    assert_eq!(layer.tier_limit("pro"), 10);

    let shown = run(&["show", "--prefix", "jobs"]).await;
    assert_eq!(shown.code, 0, "{shown:?}");
    assert_eq!(
        shown.stdout,
        format!(
            "store    {url}\n{rate_section}\n\
             limits   jobs:cc (concurrency limit), version 3, defaults of revision 0\n\n\
             (own)                        in-flight 2\n\
             pro (replaced)               in-flight 10\n\n\
             callers with limits of their own: 1\n\
             {:<28} in-flight 5\n{in_flight_seen}",
            format!("caller {alice}")
        ),
        "{shown:?}"
    );
    let masked_alice = masked("alice");
    let caller = run(&["show", "--prefix", "jobs", "--header", "x-api-key=alice"]).await;
    assert_eq!(caller.code, 0, "{caller:?}");
    assert_eq!(
        caller.stdout,
        format!(
            "store    {url}\n\
             limits   jobs:rl (sliding-log), version 1, defaults of revision 0\n\n\
             caller   header x-api-key={masked_alice}\n\
             \x20 its tier's limits: it has none of its own\n\n\
             limits   jobs:cc (concurrency limit), version 3, defaults of revision 0\n\n\
             caller   header x-api-key={masked_alice}\n\
             own                          in-flight 5\n"
        ),
        "{caller:?}"
    );
    let tier = run(&["show", "--prefix", "jobs", "--tier", "pro"]).await;
    assert_eq!(tier.code, 0, "{tier:?}");
    assert_eq!(
        tier.stdout,
        format!(
            "store    {url}\n\
             limits   jobs:rl (sliding-log), version 1, defaults of revision 0\n\n\
             \x20 no tier \"pro\" here (its tiers: none)\n\n\
             limits   jobs:cc (concurrency limit), version 3, defaults of revision 0\n\n\
             pro                          in-flight 10\n"
        ),
        "{tier:?}"
    );
    let gold = run(&["show", "--prefix", "jobs", "--tier", "gold"]).await;
    assert_eq!(gold.code, 2, "{gold:?}");
    assert_eq!(gold.stdout, "");
    assert_eq!(
        gold.stderr,
        "error: no tier \"gold\" under jobs:rl (its tiers: none) nor under jobs:cc (its tiers: \
         pro)\n"
    );

    // refused: exit 2, nothing changed
    let zero = run(&[
        "set",
        "--prefix",
        "jobs",
        "--in-flight",
        "0",
        "--header",
        "x-api-key=alice",
    ])
    .await;
    assert_eq!(zero.code, 2, "{zero:?}");
    assert_eq!(zero.stdout, "");
    assert_eq!(
        zero.stderr,
        format!(
            "error: refused, nothing changed: caller {alice}: a concurrency limit needs one \
             limit \"in-flight\" of 1 to 4294967295 requests in flight\n"
        )
    );
    let gold = run(&[
        "set",
        "--prefix",
        "jobs",
        "--tier",
        "gold",
        "--in-flight",
        "3",
    ])
    .await;
    assert_eq!(gold.code, 2, "{gold:?}");
    assert_eq!(
        gold.stderr,
        "error: refused, nothing changed: unknown tier \"gold\" (the layer's tiers: pro)\n"
    );
    for both in [
        &[
            "set",
            "--prefix",
            "jobs",
            "--in-flight",
            "3",
            "--limit",
            "minute:1/60s",
        ][..],
        &[
            "set",
            "--prefix",
            "jobs",
            "--concurrency",
            "--limit",
            "minute:1/60s",
        ],
        &["set", "--prefix", "jobs", "--in-flight", "-1"],
    ] {
        let refused = run(both).await;
        assert_eq!(refused.code, 2, "{refused:?}");
        assert_eq!(refused.stdout, "", "{refused:?}");
    }
    assert_eq!(limits.refresh().await.unwrap(), 3);
    assert_eq!(limits.in_force().version, 3);
    assert_eq!(layer.caller_limit(alice), 5);

    // back to the layer's limit
    let unset = run(&[
        "unset",
        "--prefix",
        "jobs",
        "--concurrency",
        "--header",
        "x-api-key=alice",
        "--note",
        "batch done",
    ])
    .await;
    assert_eq!(unset.code, 0, "{unset:?}");
    assert_eq!(
        unset.stdout,
        "saved as version 4 of jobs:cc: in force on every copy within its refresh\n"
    );
    assert_eq!(limits.refresh().await.unwrap(), 4);
    assert_eq!(layer.caller_limit(alice), 2);

    // what names nothing: exit 1, saying what was looked for
    let nobody = run(&[
        "unset",
        "--prefix",
        "jobs",
        "--concurrency",
        "--header",
        "x-api-key=alice",
    ])
    .await;
    assert_eq!(nobody.code, 1, "{nobody:?}");
    assert_eq!(nobody.stdout, "");
    assert_eq!(
        nobody.stderr,
        format!("nothing to unset: header x-api-key={masked_alice} has no limits of its own\n")
    );
    let no_table = |namespace: &str| {
        format!(
            "no limits in force under {namespace}: no copy built with build_in_store has \
             started on this store, or its prefix is another (--prefix)\n"
        )
    };
    for svc in [
        &["set", "--prefix", "svc", "--in-flight", "3"][..],
        &["unset", "--prefix", "svc", "--concurrency", "--tier", "pro"],
        &["history", "--prefix", "svc", "--concurrency"],
    ] {
        let svc = run(svc).await;
        assert_eq!(svc.code, 1, "{svc:?}");
        assert_eq!(svc.stdout, "");
        assert_eq!(svc.stderr, no_table("svc:cc"));
    }
    let none = run(&["show", "--prefix", "none"]).await;
    assert_eq!(none.code, 1, "{none:?}");
    assert_eq!(none.stdout, "");
    assert_eq!(none.stderr, no_table("none:rl nor none:cc"));

    let history = run(&["history", "--prefix", "jobs", "--concurrency"]).await;
    assert_eq!(history.code, 0, "{history:?}");
    let lines: Vec<(&str, &str)> = history
        .stdout
        .lines()
        .map(|line| {
            let (version, rest) = line.split_at(5);
            let (_, note) = rest.split_once(" UTC  ").unwrap();
            (version, note)
        })
        .collect();
    assert_eq!(
        lines,
        [
            ("    4", "batch done"),
            ("    3", ""),
            ("    2", "alice runs batch jobs"),
            ("    1", "defaults of revision 0"),
        ],
        "{history:?}"
    );
    // the rate limit's history is its own
    let rate_history = run(&["history", "--prefix", "jobs"]).await;
    assert_eq!(rate_history.code, 0, "{rate_history:?}");
    assert_eq!(rate_history.stdout.lines().count(), 1, "{rate_history:?}");
}

/// What the service's authentication inserts in a request: the caller's tenant.
#[derive(Clone)]
struct Tenant(String);

impl AsRef<[u8]> for Tenant {
    fn as_ref(&self) -> &[u8] {
        self.0.as_bytes()
    }
}

/// A concurrency limit of 2 in flight per tenant, keyed by the `Tenant` its authentication
/// inserts, under prefix `tenants`.
async fn by_tenant(permits: impl PermitStore) -> ConcurrencyLimitLayer<key::Extension<Tenant>> {
    ConcurrencyLimitLayer::builder(permits)
        .limit(2)
        .prefix("tenants")
        .key(key::Extension::<Tenant>::new())
        .build_in_store()
        .await
        .unwrap()
}

/// A tenant's own limit, set naming it by its extension's value (`--extension`): the layer
/// finds it under the key its extractor gives; shown, and its permits inspected, by that name.
async fn the_tool_names_a_tenant_by_its_extension(
    store_args: &[&str],
    layer: ConcurrencyLimitLayer<key::Extension<Tenant>>,
) {
    let tool = |command: &[&str]| {
        let mut args = command[..2].to_vec();
        args.extend_from_slice(store_args);
        args.extend_from_slice(&command[2..]);
        let args: Vec<String> = args.into_iter().map(str::to_owned).collect();
        async move {
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            tollgate(&args).await
        }
    };
    let url = store_args[1];
    let acme = key::Extension::<Tenant>::new().key(&Tenant("acme".to_owned()));
    let globex = key::Extension::<Tenant>::new().key(&Tenant("globex".to_owned()));
    let set = tool(&[
        "limits",
        "set",
        "--prefix",
        "tenants",
        "--extension",
        "acme",
        "--in-flight",
        "5",
    ])
    .await;
    assert_eq!(set.code, 0, "{set:?}");
    assert_eq!(
        set.stdout,
        "saved as version 2 of tenants:cc: in force on every copy within its refresh\n"
    );
    assert_eq!(set.stderr, "");
    assert_eq!(layer.limits().unwrap().refresh().await.unwrap(), 2);
    assert_eq!(layer.caller_limit(acme), 5);
    assert_eq!(layer.caller_limit(globex), 2);

    let masked_acme = masked("acme");
    let shown = tool(&[
        "limits",
        "show",
        "--prefix",
        "tenants",
        "--extension",
        "acme",
    ])
    .await;
    assert_eq!(shown.code, 0, "{shown:?}");
    assert_eq!(
        shown.stdout,
        format!(
            "store    {url}\n\
             limits   tenants:cc (concurrency limit), version 2, defaults of revision 0\n\n\
             caller   extension {masked_acme}\n\
             own                          in-flight 5\n"
        )
    );
    println!("{}", shown.stdout);
    // `Extension::named("org")` is another domain: another caller
    let named = tool(&[
        "limits",
        "show",
        "--prefix",
        "tenants",
        "--extension",
        "acme",
        "--extension-name",
        "org",
    ])
    .await;
    assert_eq!(named.code, 0, "{named:?}");
    assert!(
        named.stdout.ends_with(&format!(
            "caller   extension org={masked_acme}\n  its tier's limits: it has none of its own\n"
        )),
        "{named:?}"
    );
    // its permits: none in use, under the key the layer takes them by
    let permits = tool(&[
        "inspect",
        "permits",
        "--prefix",
        "tenants",
        "--extension",
        "acme",
    ])
    .await;
    let permit_key = keys::permits("tenants", &acme).unwrap();
    assert_eq!(permits.code, 1, "{permits:?}");
    assert_eq!(
        permits.stdout,
        format!(
            "store    {url}\n\
             caller   extension {masked_acme}\n\
             key      {permit_key}\n\n\
             in use   0\n\
             waiting  0\n\
             leases   -\n"
        )
    );
    assert_eq!(
        permits.stderr,
        format!(
            "nothing under {permit_key}: no permit of extension {masked_acme} held or awaited \
             under prefix \"tenants\" (check the caller and --prefix)\n"
        )
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn limits_on_redis() {
    let server = RedisServer::start().unwrap_or_else(|e| panic!("{e}"));
    let store = || -> Arc<dyn RateStore> { Arc::new(RedisStore::open(server.url()).unwrap()) };
    let copies = [copy(store(), 5).await, copy(store(), 9).await];
    let url = server.url();
    the_tool_reads_and_changes_the_limits(&["--store", &url], copies).await;
    let redis = RedisStore::open(server.url()).unwrap();
    let (rate, in_flight) = jobs(store(), redis).await;
    the_tool_changes_the_limits_in_flight(&["--store", &url], rate, in_flight).await;
    let tenants = by_tenant(RedisStore::open(server.url()).unwrap()).await;
    the_tool_names_a_tenant_by_its_extension(&["--store", &url], tenants).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn limits_on_postgres() {
    let server = tokio::task::spawn_blocking(PgServer::start)
        .await
        .unwrap()
        .unwrap_or_else(|e| panic!("{e}"));
    let url = server.url();
    let store = || async {
        let store = PgStore::builder(url.clone())
            .schema("svc_limits")
            .timeout(Duration::from_secs(2))
            .purge_interval(None)
            .connect()
            .await
            .unwrap();
        Arc::new(store) as Arc<dyn RateStore>
    };
    let copies = [copy(store().await, 5).await, copy(store().await, 9).await];
    let store_args = ["--store", &url, "--pg-schema", "svc_limits"];
    the_tool_reads_and_changes_the_limits(&store_args, copies).await;
    let pg = PgStore::builder(url.clone())
        .schema("svc_limits")
        .timeout(Duration::from_secs(2))
        .purge_interval(None)
        .connect()
        .await
        .unwrap();
    let (rate, in_flight) = jobs(store().await, pg).await;
    the_tool_changes_the_limits_in_flight(&store_args, rate, in_flight).await;
    let pg = PgStore::builder(url.clone())
        .schema("svc_limits")
        .timeout(Duration::from_secs(2))
        .purge_interval(None)
        .connect()
        .await
        .unwrap();
    the_tool_names_a_tenant_by_its_extension(&store_args, by_tenant(pg).await).await;
}
