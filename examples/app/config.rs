//! The app's configuration: [`AppConfig`], read from the environment.

use super::*;

/// The app's configuration, read from the environment by [`AppConfig::from_env`]. Its `Debug`
/// shows store URLs with their passwords masked, and neither the admin token nor an API key.
#[derive(Clone, PartialEq, Eq)]
pub struct AppConfig {
    /// `PORT`: served on `127.0.0.1:<port>` (0: any free port).
    pub port: u16,
    /// `REDIS_URL`: the shared store; `None` means an in-memory store for this process only.
    pub redis_url: Option<String>,
    /// `APP_LIMITS`: the limits of `/api/*`, all checked together.
    pub limits: Vec<Limit>,
    /// `APP_ALGORITHM`: how the limits count.
    pub algorithm: Algorithm,
    /// `REDIS_CLUSTER_URLS`: the nodes of a Redis Cluster, the alternative to `REDIS_URL`.
    pub redis_cluster_urls: Vec<String>,
    /// `REDIS_SENTINELS`: the sentinels of a Redis behind Sentinel, the third alternative.
    pub redis_sentinels: Vec<String>,
    /// `REDIS_SENTINEL_MASTER`: the master name the sentinels monitor.
    pub redis_sentinel_master: Option<String>,
    /// `REDIS_PRIMARY_PASSWORD`: the password of the primary the sentinels name, when it asks
    /// for one (the sentinels' own goes in their URLs).
    pub redis_primary_password: Option<String>,
    /// `DATABASE_URL`: a PostgreSQL database (`postgres://…`), the alternative to Redis.
    pub database_url: Option<String>,
    /// `REDIS_WAIT_REPLICAS`: how many replicas must acknowledge every claim, lock and payment
    /// record before it counts (0: none).
    pub wait_replicas: u32,
    /// `APP_STORE_TIMEOUT_MS`: how long a store call may take before it fails (unset: the
    /// store's default, 250 ms).
    pub store_timeout: Option<Duration>,
    /// `APP_TRUSTED_PROXIES`: the proxies whose `X-Forwarded-For` names the client (none: the
    /// peer is the client).
    pub trusted_proxies: Vec<Cidr>,
    /// `APP_ON_STORE_ERROR`: what `/api/*` does while the store is down.
    pub on_store_error: OnStoreError,
    /// `APP_TRANSFER_DELAY_MS`: how long `POST /transfers` waits after its insert, before its
    /// transaction commits.
    pub transfer_delay: Duration,
    /// `APP_PAYMENT_DELAY_MS`: how long `POST /payments` works before it answers.
    pub payment_delay: Duration,
    /// `APP_REPORT_MS`: how long `POST /reports/{name}/rebuild` works under its lock.
    pub report_work: Duration,
    /// `APP_JOB_*`: the jobs of `POST /jobs/{tenant}/run`.
    pub jobs: JobConfig,
    /// `APP_TOKEN_LIMITS`: the token budget of `POST /llm/complete`, per tenant, counted with
    /// `APP_ALGORITHM`.
    pub token_limits: Vec<Limit>,
    /// `APP_ADMIN_TOKEN`: the bearer token of `/admin/*`; unset, those routes are not served.
    pub admin_token: Option<String>,
    /// `APP_API_KEYS` (`key:tenant:plan,…`): the API keys the app accepts and whose caller each
    /// one is; unset, the public demo table [`DEMO_API_KEYS`](super::DEMO_API_KEYS), which the
    /// app warns of at start.
    pub api_keys: ApiKeys,
    /// `APP_BLOCK` (`30s`, say): a caller that goes over a limit of `/api/*` is blocked that
    /// long on every copy; unset, no penalty.
    pub block: Option<Duration>,
    /// `APP_LEASE=on`: the quota of `/api/*`'s limits is leased to each copy in slices
    /// ([`Limit::leased`]); `off` (the default) checks every request in the store.
    pub lease: bool,
}

/// The token budget when `APP_TOKEN_LIMITS` is not set.
pub const DEFAULT_TOKEN_LIMITS: &str = "tokens:1000/60s";

/// The header in which a caller of `POST /llm/complete` says how many tokens it may use: what
/// it reserves (1 when absent; held to at least 1 and at most the smallest quota of the budget).
pub const MAX_TOKENS_HEADER: HeaderName = HeaderName::from_static("x-max-tokens");

/// The header in which `POST /llm/complete` reports the tokens it used: what it is charged.
pub const TOKENS_USED_HEADER: HeaderName = HeaderName::from_static("x-tokens-used");

/// The jobs of `POST /jobs/{tenant}/run`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JobConfig {
    /// `APP_JOB_MS` (default 200): how long a job runs.
    pub duration: Duration,
    /// `APP_JOB_CONCURRENCY` (default 2): at most this many jobs per tenant at once, across
    /// every copy.
    pub concurrency: u32,
    /// `APP_JOB_LEASE_MS` (default 3000): how soon a copy that dies gives its jobs' permits back.
    pub lease: Duration,
    /// `APP_JOB_TIERS` (`pro=10,enterprise=50`): the limits of the plans of `APP_API_KEYS`, in
    /// place of `APP_JOB_CONCURRENCY`, for the tenants on those plans.
    pub tiers: Vec<(String, u32)>,
}

impl Default for JobConfig {
    fn default() -> Self {
        Self {
            duration: Duration::from_millis(200),
            concurrency: 2,
            lease: Duration::from_millis(3000),
            tiers: Vec::new(),
        }
    }
}

/// What `APP_TRUSTED_PROXIES` must look like.
const TRUSTED_PROXIES_FORMAT: &str = "comma-separated CIDRs of the proxies in front of the app, e.g. APP_TRUSTED_PROXIES=10.0.0.0/8,fd00::/8";

/// What `APP_ON_STORE_ERROR` must look like.
const ON_STORE_ERROR_FORMAT: &str =
    "allow (the default), deny, or fallback:N with N the number of copies, e.g. fallback:2";

/// Parses `APP_ON_STORE_ERROR`: `allow`, `deny` or `fallback:N` (N >= 1 copies).
pub fn parse_on_store_error(value: &str) -> Result<OnStoreError, String> {
    match value.trim() {
        "allow" => Ok(OnStoreError::Allow),
        "deny" => Ok(OnStoreError::Deny),
        other => {
            let copies = other
                .strip_prefix("fallback:")
                .ok_or_else(|| format!("unknown policy {other:?}"))?;
            match whole_number(copies).and_then(|n| u32::try_from(n).ok()) {
                Some(copies) if copies >= 1 => Ok(OnStoreError::LocalFallback { copies }),
                _ => Err(format!("{copies:?} is not a number of copies (1 or more)")),
            }
        }
    }
}

/// What `Debug` shows of a secret that is set.
const REDACTED: &str = "<redacted>";

impl std::fmt::Debug for AppConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let url = |url: &Option<String>| url.as_deref().map(redact_url);
        let urls = |urls: &[String]| urls.iter().map(|u| redact_url(u)).collect::<Vec<_>>();
        f.debug_struct("AppConfig")
            .field("port", &self.port)
            .field("redis_url", &url(&self.redis_url))
            .field("limits", &self.limits)
            .field("algorithm", &self.algorithm)
            .field("redis_cluster_urls", &urls(&self.redis_cluster_urls))
            .field("redis_sentinels", &urls(&self.redis_sentinels))
            .field("redis_sentinel_master", &self.redis_sentinel_master)
            .field(
                "redis_primary_password",
                &self.redis_primary_password.as_ref().map(|_| REDACTED),
            )
            .field("database_url", &url(&self.database_url))
            .field("wait_replicas", &self.wait_replicas)
            .field("store_timeout", &self.store_timeout)
            .field("trusted_proxies", &self.trusted_proxies)
            .field("on_store_error", &self.on_store_error)
            .field("transfer_delay", &self.transfer_delay)
            .field("payment_delay", &self.payment_delay)
            .field("report_work", &self.report_work)
            .field("jobs", &self.jobs)
            .field("token_limits", &self.token_limits)
            .field("admin_token", &self.admin_token.as_ref().map(|_| REDACTED))
            .field("api_keys", &self.api_keys)
            .field("block", &self.block)
            .field("lease", &self.lease)
            .finish()
    }
}

impl AppConfig {
    /// Who a request without an API key counts against: its peer's network or, from a trusted
    /// proxy, the client's it names.
    pub fn client_ip(&self) -> ForwardedIp {
        ForwardedIp::new(self.trusted_proxies.iter().copied())
    }

    /// The kind of store configured: `memory`, `redis`, `redis-cluster`, `redis-sentinel` or
    /// `postgres`.
    pub fn store_kind(&self) -> &'static str {
        if self.database_url.is_some() {
            "postgres"
        } else if !self.redis_sentinels.is_empty() {
            "redis-sentinel"
        } else if !self.redis_cluster_urls.is_empty() {
            "redis-cluster"
        } else if self.redis_url.is_some() {
            "redis"
        } else {
            "memory"
        }
    }

    /// The configuration of an empty environment, served on any free port (`PORT=0`): a base
    /// for tests, which change what they need with `..AppConfig::defaults()?`.
    pub fn defaults() -> Result<Self, EnvError> {
        Self::from_lookup(|_| None).map(|config| Self { port: 0, ..config })
    }

    /// Reads `PORT`, `REDIS_URL`, `APP_LIMITS` and `APP_ALGORITHM`. A variable that is unset or
    /// empty takes its default.
    pub fn from_env() -> Result<Self, EnvError> {
        Self::from_lookup(process_var)
    }

    /// Like [`AppConfig::from_env`], with the variables read through `lookup`.
    pub fn from_lookup(lookup: impl Fn(&str) -> Option<String>) -> Result<Self, EnvError> {
        let vars = Vars::new(lookup);
        let port = vars.port(DEFAULT_PORT, PORT_FORMAT)?;
        let algorithm = vars.algorithm()?;
        let limits = vars.limits(algorithm)?;
        let redis_url = vars.redis_url();
        let redis_cluster_urls = vars.list("REDIS_CLUSTER_URLS");
        let redis_sentinels = vars.list("REDIS_SENTINELS");
        let redis_sentinel_master = vars
            .get("REDIS_SENTINEL_MASTER")
            .map(|m| m.trim().to_owned());
        let redis_primary_password = vars
            .get("REDIS_PRIMARY_PASSWORD")
            .filter(|password| !password.is_empty());
        let database_url = vars
            .get("DATABASE_URL")
            .map(|url| url.trim().to_owned())
            .filter(|url| !url.is_empty());
        let stores = [
            ("REDIS_URL", redis_url.is_some()),
            ("REDIS_CLUSTER_URLS", !redis_cluster_urls.is_empty()),
            ("REDIS_SENTINELS", !redis_sentinels.is_empty()),
            ("DATABASE_URL", database_url.is_some()),
        ];
        let mut set = stores.iter().filter(|(_, set)| *set).map(|(var, _)| *var);
        if let (Some(first), Some(second)) = (set.next(), set.next()) {
            return Err(EnvError::new(
                second,
                "(set)",
                format!("{first} is set as well"),
                "one of REDIS_URL, REDIS_CLUSTER_URLS, REDIS_SENTINELS or DATABASE_URL, not several",
            ));
        }
        if !redis_sentinels.is_empty() && redis_sentinel_master.is_none() {
            return Err(EnvError::new(
                "REDIS_SENTINEL_MASTER",
                "",
                "REDIS_SENTINELS is set, but not the master name",
                "the name the sentinels monitor, e.g. REDIS_SENTINEL_MASTER=mymaster",
            ));
        }
        let trusted_proxies = vars
            .list("APP_TRUSTED_PROXIES")
            .iter()
            .map(|cidr| cidr.parse::<Cidr>())
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| {
                let value = vars.get("APP_TRUSTED_PROXIES").unwrap_or_default();
                EnvError::new(
                    "APP_TRUSTED_PROXIES",
                    &value,
                    e.to_string(),
                    TRUSTED_PROXIES_FORMAT,
                )
            })?;
        let on_store_error = match vars.get("APP_ON_STORE_ERROR") {
            Some(value) => parse_on_store_error(&value).map_err(|problem| {
                EnvError::new("APP_ON_STORE_ERROR", &value, problem, ON_STORE_ERROR_FORMAT)
            })?,
            None => OnStoreError::Allow,
        };
        let wait_replicas = match vars.get("REDIS_WAIT_REPLICAS") {
            Some(value) => whole_number(value.trim())
                .and_then(|n| u32::try_from(n).ok())
                .ok_or_else(|| {
                    EnvError::new(
                        "REDIS_WAIT_REPLICAS",
                        &value,
                        "not a whole number of replicas",
                        "a number of replicas, e.g. REDIS_WAIT_REPLICAS=1",
                    )
                })?,
            None => 0,
        };
        let payment_ms = u64::try_from(DEFAULT_PAYMENT_DELAY.as_millis()).unwrap_or(100);
        let ms = "milliseconds, e.g. 200";
        let store_timeout = match vars.get("APP_STORE_TIMEOUT_MS") {
            Some(_) => match vars.number("APP_STORE_TIMEOUT_MS", 0, ms)? {
                0 => {
                    return Err(EnvError::new(
                        "APP_STORE_TIMEOUT_MS",
                        "0",
                        "a store call needs some time",
                        ms,
                    ));
                }
                n => Some(Duration::from_millis(n)),
            },
            None => None,
        };
        let payment_delay = vars.number("APP_PAYMENT_DELAY_MS", payment_ms, ms)?;
        let report_ms = u64::try_from(DEFAULT_REPORT_WORK.as_millis()).unwrap_or(300);
        let report_work = vars.number("APP_REPORT_MS", report_ms, ms)?;
        let transfer_delay = vars.number("APP_TRANSFER_DELAY_MS", 0, ms)?;
        let default = JobConfig::default();
        let default_ms = |d: Duration| u64::try_from(d.as_millis()).unwrap_or(u64::MAX);
        let jobs = JobConfig {
            duration: Duration::from_millis(vars.number(
                "APP_JOB_MS",
                default_ms(default.duration),
                ms,
            )?),
            concurrency: match vars.number(
                "APP_JOB_CONCURRENCY",
                u64::from(default.concurrency),
                "a number of jobs, e.g. 2",
            )? {
                n @ 1..=0xFFFF_FFFF => u32::try_from(n).unwrap_or(u32::MAX),
                _ => {
                    return Err(EnvError::new(
                        "APP_JOB_CONCURRENCY",
                        "0",
                        "at least one job must run",
                        "a number of jobs, e.g. 2",
                    ));
                }
            },
            lease: Duration::from_millis(vars.number(
                "APP_JOB_LEASE_MS",
                default_ms(default.lease),
                ms,
            )?),
            tiers: match vars.get("APP_JOB_TIERS") {
                Some(value) => parse_job_tiers(&value).map_err(|problem| {
                    EnvError::new(
                        "APP_JOB_TIERS",
                        &value,
                        problem,
                        "plans and their job limits, e.g. APP_JOB_TIERS=pro=10,enterprise=50",
                    )
                })?,
                None => Vec::new(),
            },
        };
        Ok(Self {
            port,
            redis_url,
            limits,
            algorithm,
            redis_cluster_urls,
            redis_sentinels,
            redis_sentinel_master,
            redis_primary_password,
            database_url,
            wait_replicas,
            store_timeout,
            trusted_proxies,
            on_store_error,
            payment_delay: Duration::from_millis(payment_delay),
            report_work: Duration::from_millis(report_work),
            transfer_delay: Duration::from_millis(transfer_delay),
            jobs,
            token_limits: vars.limits_of("APP_TOKEN_LIMITS", DEFAULT_TOKEN_LIMITS, algorithm)?,
            admin_token: vars
                .get("APP_ADMIN_TOKEN")
                .filter(|token| !token.is_empty()),
            api_keys: match vars.get("APP_API_KEYS") {
                // the value holds the keys: an error names the entry, never echoes it
                Some(value) => ApiKeys::parse(&value).map_err(|problem| {
                    EnvError::new("APP_API_KEYS", "(not shown)", problem, API_KEYS_FORMAT)
                })?,
                None => ApiKeys::demo(),
            },
            block: match vars.get("APP_BLOCK") {
                Some(value) => Some(tollgate::rate::parse_duration(&value).map_err(|e| {
                    EnvError::new(
                        "APP_BLOCK",
                        &value,
                        e.to_string(),
                        "how long a caller over a limit is blocked, e.g. APP_BLOCK=30s",
                    )
                })?),
                None => None,
            },
            lease: match vars.get("APP_LEASE").as_deref() {
                None | Some("off") => false,
                Some("on") if vars.get("APP_BLOCK").is_some() => {
                    return Err(EnvError::new(
                        "APP_LEASE",
                        "on",
                        "APP_BLOCK is set as well: a leased limit has no penalty".to_owned(),
                        "APP_LEASE=on or APP_BLOCK, not both",
                    ));
                }
                Some("on") => true,
                Some(other) => {
                    return Err(EnvError::new(
                        "APP_LEASE",
                        other,
                        "expected on or off".to_owned(),
                        "APP_LEASE=on leases the quota of /api/* to each copy in slices",
                    ));
                }
            },
        })
    }
}
