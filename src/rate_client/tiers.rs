//! Per-request policies: the tiers a layer chooses among, each built once at start-up.
//!
//! A layer has its own limits (the default tier) and, optionally, named tiers with limits of
//! their own (a free tier 100/h, a paid tier 10,000/h) and a closure that names a request's tier
//! from its head. Each tier is a policy of its own, with its own store keys, `RateLimit-Policy`,
//! local fallback and metrics label; a request is still checked against one policy in one
//! atomic store call.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};

use http::HeaderValue;
use http::request::Parts;

use super::fallback::Fallback;
use super::lease::Leases;
use crate::error::{ConfigError, ConfigErrorKind};
use crate::headers::{self, QuotaUnit};
use crate::key::Key;
use crate::on_error::OnStoreError;
use crate::pace::OncePerSecond;
use crate::rate::{Algorithm, Limit, RatePolicy};
use crate::store::RateStore;

/// Names a request's tier from its head; `None` for the default tier.
pub(crate) type TierFn = Arc<dyn Fn(&Parts) -> Option<&str> + Send + Sync>;

/// Gives a request limits of its own from the application's data; `None` for its tier's.
pub(crate) type LimitsFn = Arc<dyn Fn(&Parts) -> Option<Vec<Limit>> + Send + Sync>;

/// The most distinct sets of per-request limits a layer keeps built; past it they are built
/// anew (a plan table has a handful).
const DYNAMIC_CAPACITY: usize = 1024;

/// One policy a layer can check a request against, with what belongs to it.
pub(crate) struct Tier {
    /// `None` for the layer's own limits.
    pub(crate) name: Option<Box<str>>,
    pub(crate) policy: Arc<RatePolicy>,
    /// The tier's `RateLimit-Policy`.
    pub(crate) policy_header: HeaderValue,
    /// The in-process limiter behind [`OnStoreError::LocalFallback`], with this tier's shares.
    pub(crate) fallback: Option<Fallback>,
    /// The `limiter` label of the metrics: the policy's namespace.
    pub(crate) limiter: Arc<str>,
    /// The callers' slices of a leased tier on this copy.
    pub(crate) leases: Option<Arc<Leases>>,
}

debug_fields!(Tier { name, policy });

/// What every tier of a layer is built with.
#[derive(Clone)]
pub(crate) struct TierOptions {
    pub(crate) namespace: String,
    pub(crate) algorithm: Algorithm,
    pub(crate) unit: Option<QuotaUnit>,
    pub(crate) on_store_error: OnStoreError,
    pub(crate) fallback_capacity: usize,
    pub(crate) fallback_admits_when_full: bool,
    /// Where leased tiers take their slices.
    pub(crate) store: Arc<dyn RateStore>,
    /// Whether the layer settles actual costs, which leased tiers do not support.
    pub(crate) settles: bool,
}

impl Tier {
    /// The tier `name` (`None`: the layer's own) of `limits`; a named tier's keys live under
    /// `<namespace>:<name>`.
    pub(crate) fn new(
        name: Option<String>,
        limits: Vec<Limit>,
        options: &TierOptions,
    ) -> Result<Self, ConfigError> {
        let namespace = match &name {
            None => options.namespace.clone(),
            Some(name) => {
                check_name(name).map_err(|e| e.within(&format!("tier {name:?}")))?;
                format!("{}:{name}", options.namespace)
            }
        };
        let policy =
            RatePolicy::new(namespace, options.algorithm, limits).map_err(|e| match &name {
                Some(name) => e.within(&format!("tier {name:?}")),
                None => e,
            })?;
        let fallback = match options.on_store_error {
            OnStoreError::LocalFallback { copies: 0 } => {
                return Err(ConfigError::new(
                    ConfigErrorKind::FailurePolicy,
                    "the local fallback needs copies >= 1",
                ));
            }
            OnStoreError::LocalFallback { copies } => Some(Fallback::new(
                &policy,
                copies,
                options.fallback_capacity,
                options.fallback_admits_when_full,
                options.unit,
            )?),
            _ => None,
        };
        if policy.is_leased() && options.settles {
            return Err(ConfigError::new(
                ConfigErrorKind::Limit,
                "leased limits are not settled: leave .leased() out, or .settle(..) and \
                 .settle_body_size()",
            ));
        }
        let policy = Arc::new(policy);
        let leases = policy
            .is_leased()
            .then(|| Arc::new(Leases::new(Arc::clone(&options.store), Arc::clone(&policy))));
        Ok(Self {
            name: name.map(String::into_boxed_str),
            policy_header: headers::policy(&policy, options.unit)?,
            limiter: Arc::from(policy.namespace()),
            policy,
            fallback,
            leases,
        })
    }
}

/// Tier names are store-key segments: ASCII letters, digits, `-`, `_` and `.`, as limit names.
fn check_name(name: &str) -> Result<(), ConfigError> {
    if crate::keyspace::is_name(name) {
        Ok(())
    } else {
        Err(ConfigError::new(
            ConfigErrorKind::Limit,
            format!("invalid tier name {name:?}: use ASCII letters, digits, '-', '_' and '.'"),
        ))
    }
}

/// A layer's tiers: its own, and the named ones a closure chooses among.
pub(crate) struct Tiers {
    default: Arc<Tier>,
    named: Box<[Arc<Tier>]>,
    select: Option<TierFn>,
    /// Unknown tier names are logged at warn at most once a second.
    unknown_warning: OncePerSecond,
    /// Limits of a request's own, from the application's data.
    dynamic: Option<Dynamic>,
    /// Callers' overrides from the limits in force, each a tier under the layer's own names.
    callers: HashMap<Key, Arc<Tier>>,
}

/// Per-request limits: the closure that gives them, and the tiers built of them so far, by
/// their limits.
struct Dynamic {
    limits_by: LimitsFn,
    options: TierOptions,
    built: Mutex<HashMap<Vec<Limit>, Arc<Tier>>>,
    /// Invalid limits are logged at warn at most once a second.
    invalid_warning: OncePerSecond,
}

impl Dynamic {
    /// The tier of `limits`, under the layer's own namespace: a caller keeps what it spent of a
    /// limit when its plan changes that limit's quota. `None` when they are invalid (logged).
    fn tier(&self, limits: Vec<Limit>) -> Option<Arc<Tier>> {
        let mut built = self.built.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(tier) = built.get(&limits) {
            return Some(Arc::clone(tier));
        }
        match Tier::new(None, limits.clone(), &self.options) {
            Ok(tier) => {
                if built.len() >= DYNAMIC_CAPACITY {
                    built.clear();
                }
                let tier = Arc::new(tier);
                built.insert(limits, Arc::clone(&tier));
                Some(tier)
            }
            Err(error) => {
                if self.invalid_warning.ready() {
                    tracing::warn!(
                        target: "tollgate::rate_limit",
                        %error,
                        "invalid per-request limits: the request's tier applies (logged at most once a second)"
                    );
                }
                None
            }
        }
    }
}

debug_fields!(Tiers { default, named });

impl Tiers {
    /// `default` and the distinct `named` tiers, chosen by `select`.
    pub(crate) fn new(
        default: Tier,
        named: Vec<Tier>,
        select: Option<TierFn>,
    ) -> Result<Self, ConfigError> {
        for (i, tier) in named.iter().enumerate() {
            if named[..i].iter().any(|t| t.name == tier.name) {
                let name = tier.name.as_deref().unwrap_or_default();
                return Err(ConfigError::new(
                    ConfigErrorKind::Limit,
                    format!("tier name {name:?} is used twice"),
                ));
            }
        }
        if !named.is_empty() && select.is_none() {
            return Err(ConfigError::new(
                ConfigErrorKind::Limit,
                "named tiers need a tier_by closure that chooses among them",
            ));
        }
        Ok(Self {
            default: Arc::new(default),
            named: named.into_iter().map(Arc::new).collect(),
            select,
            unknown_warning: OncePerSecond::new(),
            dynamic: None,
            callers: HashMap::new(),
        })
    }

    /// Gives each caller of `callers` its tier, before any other.
    pub(crate) fn with_callers(mut self, callers: HashMap<Key, Arc<Tier>>) -> Self {
        self.callers = callers;
        self
    }

    /// Gives requests limits of their own where `limits_by` finds some, built as `options`
    /// says.
    pub(crate) fn with_limits_by(mut self, limits_by: LimitsFn, options: TierOptions) -> Self {
        self.dynamic = Some(Dynamic {
            limits_by,
            options,
            built: Mutex::default(),
            invalid_warning: OncePerSecond::new(),
        });
        self
    }

    /// The layer's own tier.
    pub(crate) fn default_tier(&self) -> &Arc<Tier> {
        &self.default
    }

    /// Every tier, the layer's own first, then the named ones, those built of per-request
    /// limits so far and those of callers' overrides.
    pub(crate) fn all(&self) -> Vec<Arc<Tier>> {
        let mut all: Vec<_> = std::iter::once(&self.default)
            .chain(self.named.iter())
            .cloned()
            .collect();
        if let Some(dynamic) = &self.dynamic {
            let built = dynamic.built.lock().unwrap_or_else(PoisonError::into_inner);
            all.extend(built.values().cloned());
        }
        for tier in self.callers.values() {
            if !all.iter().any(|known| Arc::ptr_eq(known, tier)) {
                all.push(Arc::clone(tier));
            }
        }
        all
    }

    /// Caller `key`'s tier when nothing else is known of its requests: its override in the
    /// limits in force, else the layer's own.
    pub(crate) fn for_caller(&self, key: Key) -> Arc<Tier> {
        Arc::clone(self.callers.get(&key).unwrap_or(&self.default))
    }

    /// The tier called `name`, or the layer's own when there is none of that name.
    pub(crate) fn named(&self, name: &str) -> &Arc<Tier> {
        self.find(name).unwrap_or(&self.default)
    }

    fn find(&self, name: &str) -> Option<&Arc<Tier>> {
        self.named
            .iter()
            .find(|tier| tier.name.as_deref() == Some(name))
    }

    /// The tier of the request with head `parts` and caller `key`: the caller's override in
    /// the limits in force, if it has one; else its own limits, where the layer's `limits_by`
    /// gives some; else the tier its closure names.
    pub(crate) fn for_request(&self, parts: &Parts, key: Option<Key>) -> Arc<Tier> {
        // most layers have no overrides: no key is hashed for them
        if !self.callers.is_empty()
            && let Some(tier) = key.and_then(|key| self.callers.get(&key))
        {
            return Arc::clone(tier);
        }
        let own = self.dynamic.as_ref().and_then(|dynamic| {
            let limits = (dynamic.limits_by)(parts)?;
            dynamic.tier(limits)
        });
        own.unwrap_or_else(|| Arc::clone(self.named_for(parts)))
    }

    /// The tier the request's closure names, or the layer's own when it names none or one that
    /// does not exist (logged at warn, at most once a second).
    fn named_for(&self, parts: &Parts) -> &Arc<Tier> {
        let Some(select) = &self.select else {
            return &self.default;
        };
        let Some(name) = select(parts) else {
            return &self.default;
        };
        if let Some(tier) = self.find(name) {
            return tier;
        }
        if self.unknown_warning.ready() {
            tracing::warn!(
                target: "tollgate::rate_limit",
                tier = name,
                "unknown rate-limit tier: the layer's own limits apply (logged at most once a second)"
            );
        }
        &self.default
    }
}
