//! Who calls: API keys checked against the app's table (`APP_API_KEYS`), and the authenticated
//! [`Caller`] put in the request's extensions, where the layers key limits, idempotency scopes
//! and job tiers by it (`tollgate::key::Extension::<Caller>`). Nothing a client writes beyond
//! the key itself chooses a caller or a plan.

use std::collections::HashMap;
use std::convert::Infallible;
use std::fmt;
use std::sync::Arc;

use axum::Json;
use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::StatusCode;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use serde_json::json;
use sha2::{Digest, Sha256};
use tollgate::ConfigError;
use tollgate::key::{ForwardedIp, MissingKey};
use tollgate::rate_limit::{Limit, OnStoreError, RateLimitLayer};
use tollgate::store::Store;
use tower::{Layer, ServiceExt};

use super::{API_KEY_HEADER, AppConfig, AppState};

/// How many requests with an API key the table does not know a client address may send a
/// minute; beyond, they are answered `429` rather than `401` until the oldest has aged out.
pub const AUTH_FAILURES: u64 = 20;

/// The API keys the app accepts when `APP_API_KEYS` is not set: **for a demo only**, public in
/// this repository (`demo`, of tenant `demo-tenant` on plan `free`, and `demo-pro`, of
/// `demo-pro-tenant` on plan `pro`). The app warns at start when it uses them.
pub const DEMO_API_KEYS: &str = "demo:demo-tenant:free,demo-pro:demo-pro-tenant:pro";

/// What `APP_API_KEYS` must look like.
pub const API_KEYS_FORMAT: &str = "comma-separated key:tenant:plan entries, e.g. \
     APP_API_KEYS=sk_live_4f9a:acme:pro,sk_live_77c1:globex:free";

/// A caller the app authenticated: the tenant its API key belongs to and the tenant's plan. The
/// authentication middleware inserts it in the request's extensions; it carries no credential.
#[derive(Clone, PartialEq, Eq)]
pub struct Caller {
    tenant: Arc<str>,
    plan: Arc<str>,
}

impl Caller {
    /// The tenant `tenant` on plan `plan`.
    pub fn new(tenant: &str, plan: &str) -> Self {
        Self {
            tenant: tenant.into(),
            plan: plan.into(),
        }
    }

    /// The tenant this caller acts for: what its limits, idempotency keys and jobs count against.
    pub fn tenant(&self) -> &str {
        &self.tenant
    }

    /// The tenant's plan: what chooses its tier of `APP_JOB_TIERS`.
    pub fn plan(&self) -> &str {
        &self.plan
    }
}

/// The caller's key bytes, for `tollgate::key::Extension::<Caller>`: its tenant.
impl AsRef<[u8]> for Caller {
    fn as_ref(&self) -> &[u8] {
        self.tenant.as_bytes()
    }
}

impl fmt::Debug for Caller {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Caller")
            .field("tenant", &self.tenant())
            .field("plan", &self.plan())
            .finish()
    }
}

/// The table of API keys (`APP_API_KEYS`): each key's caller. It keeps SHA-256 digests of the
/// keys, never the keys: a look-up's timing depends on the digest of what a client sent, which
/// tells nothing about any valid key, and no `Debug` or dump of memory prints one.
#[derive(Clone, PartialEq, Eq)]
pub struct ApiKeys {
    callers: HashMap<[u8; 32], Caller>,
    demo: bool,
}

impl ApiKeys {
    /// Parses `key:tenant:plan` entries, comma-separated. Errors name an entry by its position,
    /// never by its key.
    pub fn parse(value: &str) -> Result<Self, String> {
        let mut callers = HashMap::new();
        let entries = value.split(',').map(str::trim).filter(|e| !e.is_empty());
        for (at, entry) in entries.enumerate() {
            let position = at + 1;
            let mut fields = entry.split(':').map(str::trim);
            let (Some(key), Some(tenant), Some(plan), None) =
                (fields.next(), fields.next(), fields.next(), fields.next())
            else {
                return Err(format!("entry {position} is not key:tenant:plan"));
            };
            if key.is_empty() || tenant.is_empty() || plan.is_empty() {
                return Err(format!("entry {position} has an empty field"));
            }
            if !key.bytes().all(|b| b.is_ascii_graphic()) {
                return Err(format!("the key of entry {position} is not visible ASCII"));
            }
            if callers
                .insert(digest(key.as_bytes()), Caller::new(tenant, plan))
                .is_some()
            {
                return Err(format!("the key of entry {position} is listed twice"));
            }
        }
        if callers.is_empty() {
            return Err("no entry".to_owned());
        }
        Ok(Self {
            callers,
            demo: false,
        })
    }

    /// The demo table, [`DEMO_API_KEYS`].
    pub fn demo() -> Self {
        match Self::parse(DEMO_API_KEYS) {
            Ok(keys) => Self { demo: true, ..keys },
            // the constant parses (a test holds it to that); an empty table would refuse every key
            Err(_) => Self {
                callers: HashMap::new(),
                demo: true,
            },
        }
    }

    /// Whether this is the public demo table, [`DEMO_API_KEYS`].
    pub fn is_demo(&self) -> bool {
        self.demo
    }

    /// The caller whose API key is `key`, if the table has it.
    pub fn caller(&self, key: &[u8]) -> Option<&Caller> {
        self.callers.get(&digest(key))
    }

    /// The callers of the table, sorted by tenant (with repeats: a tenant may have several keys).
    pub fn callers(&self) -> Vec<&Caller> {
        let mut callers: Vec<&Caller> = self.callers.values().collect();
        callers.sort_by(|a, b| (a.tenant(), a.plan()).cmp(&(b.tenant(), b.plan())));
        callers
    }
}

/// The tenants and plans, never a key.
impl fmt::Debug for ApiKeys {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ApiKeys")
            .field("callers", &self.callers())
            .field("demo", &self.demo)
            .finish()
    }
}

fn digest(bytes: &[u8]) -> [u8; 32] {
    Sha256::digest(bytes).into()
}

/// A short digest of an API key, for logs: `key#` and 8 characters, enough to tell keys apart in
/// an audit, never the key or a prefix of it.
pub fn masked(api_key: &str) -> String {
    let key = tollgate::key::Key::new("app:api-key", api_key.as_bytes()).to_string();
    format!("key#{}", key.get(..8).unwrap_or_default())
}

/// The limit on failed authentications per client address ([`AUTH_FAILURES`] a minute), kept
/// in the shared store: only requests with an unknown key reach it, so a known key costs no
/// store call. While the store is down, unknown keys are still refused, uncounted.
pub(super) fn auth_failures(
    store: &Arc<dyn Store>,
    config: &AppConfig,
) -> Result<RateLimitLayer<ForwardedIp>, ConfigError> {
    RateLimitLayer::builder(Arc::clone(store))
        .prefix("tollgate-app:auth")
        .limit(Limit::per_minute("auth-failures", AUTH_FAILURES))
        .key(config.client_ip())
        // no address to count by (not served over TCP): still refused, uncounted
        .on_missing_key(MissingKey::Allow)
        .on_store_error(OnStoreError::Allow)
        .build()
}

/// The authentication middleware: a request with an `x-api-key` the table knows gets its
/// [`Caller`] in its extensions; one with a key the table does not know is refused with `401`
/// (`429` once its address has sent [`AUTH_FAILURES`] of them in a minute: a guesser learns
/// nothing more); one without the header goes on anonymous (`/api/*` then counts it by its
/// address; the routes that need a caller refuse it).
pub(super) async fn authenticate(
    State(state): State<AppState>,
    mut request: Request,
    next: Next,
) -> Response {
    let Some(presented) = request.headers().get(API_KEY_HEADER) else {
        return next.run(request).await;
    };
    match state.config.api_keys.caller(presented.as_bytes()).cloned() {
        Some(caller) => {
            request.extensions_mut().insert(caller);
            next.run(request).await
        }
        None => refuse_counted(&state, request).await,
    }
}

/// `401` for an unknown API key, through the failure limit of its client address.
async fn refuse_counted(state: &AppState, request: Request) -> Response {
    let unknown_key = tower::service_fn(|_: Request| async {
        Ok::<_, Infallible>(refuse(
            StatusCode::UNAUTHORIZED,
            "unknown API key in x-api-key",
        ))
    });
    match state
        .auth_failures
        .layer(unknown_key)
        .oneshot(request)
        .await
    {
        Ok(response) => response.map(Body::new),
        Err(never) => match never {},
    }
}

/// For the routes that act for a tenant: `401` unless the request was authenticated.
pub(super) async fn require_caller(request: Request, next: Next) -> Response {
    if request.extensions().get::<Caller>().is_none() {
        return refuse(
            StatusCode::UNAUTHORIZED,
            "this route needs an API key in x-api-key",
        );
    }
    next.run(request).await
}

/// For `/jobs/{tenant}/...`: `401` unless authenticated, `403` when the path names a tenant
/// other than the caller's.
pub(super) async fn require_own_tenant(request: Request, next: Next) -> Response {
    let Some(caller) = request.extensions().get::<Caller>() else {
        return refuse(
            StatusCode::UNAUTHORIZED,
            "this route needs an API key in x-api-key",
        );
    };
    let path_tenant = request.uri().path().split('/').nth(2).unwrap_or_default();
    if path_tenant != caller.tenant() {
        return refuse(
            StatusCode::FORBIDDEN,
            "the API key is not one of this tenant's",
        );
    }
    next.run(request).await
}

fn refuse(status: StatusCode, error: &str) -> Response {
    (status, Json(json!({ "error": error }))).into_response()
}
