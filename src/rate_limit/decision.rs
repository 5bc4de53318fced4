//! [`RateLimitDecision`]: what the layer decided for a request.

use std::sync::Arc;
use std::time::Duration;

use http::HeaderMap;

use crate::headers::{self, RATELIMIT, RATELIMIT_POLICY};
use crate::key::Key;
use crate::rate::{Limit, LimitState, RatePolicy};
use crate::rate_client::{DecisionSource, Tier, Verdict};

/// The rate-limit decision for one request, in the response extensions (and, for admitted
/// requests, the request extensions).
#[derive(Debug, Clone)]
pub struct RateLimitDecision {
    pub(crate) admitted: bool,
    /// Made in shadow mode: a denial let the request through.
    pub(crate) shadow: bool,
    pub(crate) source: DecisionSource,
    pub(crate) key: Key,
    pub(crate) cost: u64,
    pub(crate) retry_after: Duration,
    /// The tier whose limits decided (their fallback shares for a fallback decision).
    pub(crate) tier: Arc<Tier>,
    /// Per limit of [`policy`](Self::policy); empty when the store did not answer.
    pub(crate) states: Vec<LimitState>,
    /// How long the request waited for room.
    pub(crate) waited: Duration,
}

/// One `tracing` event of `$decision` at `$level` (a constant, as `tracing` wants it), with the
/// decision's `tollgate.*` fields.
macro_rules! decision_event {
    ($decision:expr, $level:expr, $outcome:expr, $message:literal) => {
        tracing::event!(
            target: "tollgate::rate_limit",
            $level,
            tollgate.outcome = $outcome,
            tollgate.source = $decision.source.label(),
            tollgate.limiter = &*$decision.tier.limiter,
            tollgate.tier = $decision.tier(),
            tollgate.key = %$decision.key,
            tollgate.cost = $decision.cost,
            tollgate.limit = $decision.tightest().map(|(name, _)| name),
            tollgate.remaining = $decision.tightest().map(|(_, remaining)| remaining),
            tollgate.retry_after_ms = millis($decision.retry_after),
            tollgate.waited_ms = millis($decision.waited),
            $message
        )
    };
}

impl RateLimitDecision {
    /// The decision the rate client's `verdict` makes, in shadow mode when `shadow`.
    pub(crate) fn new(verdict: Verdict, shadow: bool) -> Self {
        Self {
            admitted: verdict.admitted,
            shadow,
            source: verdict.source,
            key: verdict.check.key(),
            cost: verdict.check.cost(),
            retry_after: verdict.retry_after,
            tier: verdict.tier,
            states: verdict.states,
            waited: verdict.waited,
        }
    }

    /// The rate client's verdict this decision was made of (of a check of its cost alone).
    #[cfg(test)]
    pub(crate) fn verdict(&self) -> Verdict {
        Verdict {
            admitted: self.admitted,
            source: self.source,
            check: crate::rate::RateCheck::new(self.key, self.cost),
            retry_after: self.retry_after,
            tier: Arc::clone(&self.tier),
            states: self.states.clone(),
            waited: self.waited,
        }
    }

    /// Whether the request was let through.
    pub fn admitted(&self) -> bool {
        self.admitted
    }

    /// Whether the layer runs in shadow mode ([`shadow`](super::RateLimitLayerBuilder::shadow)):
    /// the decision was made and counted as usual, but a denial let the request through.
    pub fn shadow(&self) -> bool {
        self.shadow
    }

    /// Who decided.
    pub fn source(&self) -> DecisionSource {
        self.source
    }

    /// The caller's key.
    pub fn key(&self) -> Key {
        self.key
    }

    /// The request's cost.
    pub fn cost(&self) -> u64 {
        self.cost
    }

    /// How long the request waited for room before it was decided: zero unless the layer has a
    /// [`queue`](super::RateLimitLayerBuilder::queue) and the limits first denied it.
    pub fn waited(&self) -> Duration {
        self.waited
    }

    /// For a denied request, the time until it could be admitted.
    pub fn retry_after(&self) -> Duration {
        self.retry_after
    }

    /// [`retry_after`](Self::retry_after) in whole seconds as the `Retry-After` header says
    /// them: rounded up, and at least 1 for a denied request (a client told 0 would retry at
    /// once); 0 for an admitted one. Use it in a custom rejection's body, so that body and
    /// header agree.
    ///
    /// ```
    /// use std::convert::Infallible;
    ///
    /// use http::{Request, Response};
    /// use tollgate::key::Global;
    /// use tollgate::rate_limit::{Limit, RateLimitDecision, RateLimitLayer};
    /// use tollgate::store::MemoryStore;
    /// use tower::{Service, ServiceBuilder, ServiceExt, service_fn};
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() {
    /// let layer = RateLimitLayer::builder(MemoryStore::new())
    ///     .limit(Limit::per_minute("m", 1))
    ///     .key(Global)
    ///     .build()
    ///     .unwrap();
    /// let ok = |_: Request<()>| async { Ok::<_, Infallible>(Response::new(())) };
    /// let mut svc = ServiceBuilder::new().layer(layer).service(service_fn(ok));
    /// let mut call = async || svc.ready().await.unwrap().call(Request::new(())).await.unwrap();
    /// let decision = |res: &Response<_>| res.extensions().get::<RateLimitDecision>().cloned();
    ///
    /// let admitted = call().await;
    /// assert_eq!(decision(&admitted).unwrap().retry_after_secs(), 0);
    /// let denied = call().await;
    /// let secs = decision(&denied).unwrap().retry_after_secs();
    /// assert_eq!(denied.headers()["retry-after"], secs.to_string().as_str());
    /// assert!((59..=60).contains(&secs));
    /// # }
    /// ```
    pub fn retry_after_secs(&self) -> u64 {
        if self.admitted {
            0
        } else {
            headers::ceil_secs(self.retry_after).max(1)
        }
    }

    /// The tier whose limits decided, as [`tier_by`](super::RateLimitLayerBuilder::tier_by)
    /// named it; `None` for the layer's own limits.
    pub fn tier(&self) -> Option<&str> {
        self.tier.name.as_deref()
    }

    /// The limits that decided: the tier's, or their fallback shares for a
    /// [`DecisionSource::LocalFallback`] decision.
    fn policy(&self) -> &RatePolicy {
        match (&self.tier.fallback, self.source) {
            (Some(fallback), DecisionSource::LocalFallback) => fallback.policy(),
            _ => &self.tier.policy,
        }
    }

    /// Each limit's name and state after the decision, in configuration order; empty when the
    /// store did not answer.
    pub fn limits(&self) -> Vec<(&str, LimitState)> {
        self.policy()
            .limits()
            .iter()
            .map(Limit::name)
            .zip(self.states.iter().copied())
            .collect()
    }

    /// Tells the metrics and the traces of this decision: one event, target
    /// `tollgate::rate_limit`, at `DEBUG` (a shadow-mode denial, which lets a request through
    /// that would be denied, at `INFO`). Its fields are computed only when a subscriber takes it.
    pub(crate) fn report(&self) {
        crate::metrics::rate_decision(&self.tier.limiter, self.admitted, self.source.label());
        if self.shadow && !self.admitted {
            decision_event!(
                self,
                tracing::Level::INFO,
                "shadow",
                "shadow mode: a request that would be denied goes through"
            );
        } else {
            let outcome = if self.admitted { "admitted" } else { "denied" };
            decision_event!(self, tracing::Level::DEBUG, outcome, "rate-limit decision");
        }
    }

    /// The limit with the least room left, and that room; none when the store did not answer.
    fn tightest(&self) -> Option<(&str, u64)> {
        self.limits()
            .into_iter()
            .map(|(name, state)| (name, state.remaining))
            .min_by_key(|(_, remaining)| *remaining)
    }

    /// The names of the limits without room for this request's cost.
    pub(crate) fn violated(&self) -> Vec<&str> {
        self.policy()
            .limits()
            .iter()
            .zip(&self.states)
            .filter(|(_, state)| state.remaining < self.cost)
            .map(|(limit, _)| limit.name())
            .collect()
    }

    /// Appends the `RateLimit-Policy` and `RateLimit` fields of this decision to `headers`,
    /// naming the caller's partition key when `partition_key`.
    pub(crate) fn write_headers(&self, partition_key: bool, headers: &mut HeaderMap) {
        if self.states.is_empty() {
            return;
        }
        // the fallback limiter's quotas are its share, and its headers say so
        let policy_header = match (&self.tier.fallback, self.source) {
            (Some(fallback), DecisionSource::LocalFallback) => fallback.policy_header(),
            _ => &self.tier.policy_header,
        };
        // appended, not inserted: a layer stacked outside another (per IP around per key) adds its
        // members to the inner one's (RFC 9651 lists may span several field lines)
        headers.append(RATELIMIT_POLICY, policy_header.clone());
        let partition = partition_key.then_some(self.key);
        if let Some(value) = headers::state(self.policy(), &self.states, partition) {
            headers.append(RATELIMIT, value);
        }
    }
}

/// Every rate-limit decision made for a request when layers are stacked (per IP around per key),
/// in the order they were made — innermost first in the response, outermost first in the
/// request — in the extensions beside the outermost one's
/// [`RateLimitDecision`]: each decision stays readable. A request that one layer decided carries
/// only its [`RateLimitDecision`].
#[derive(Debug, Clone, Default)]
pub struct RateLimitDecisions(Vec<RateLimitDecision>);

impl RateLimitDecisions {
    /// The decisions, in the order they were made.
    pub fn iter(&self) -> impl Iterator<Item = &RateLimitDecision> {
        self.0.iter()
    }

    /// How many layers decided.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// Whether no layer decided.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

/// Puts `decision` into `extensions` as the [`RateLimitDecision`]; when another layer's is there
/// already, both go into the [`RateLimitDecisions`] too. One layer alone copies nothing.
pub(crate) fn record(extensions: &mut http::Extensions, decision: RateLimitDecision) {
    if let Some(all) = extensions.get_mut::<RateLimitDecisions>() {
        all.0.push(decision.clone());
    } else if let Some(earlier) = extensions.get::<RateLimitDecision>() {
        let all = RateLimitDecisions(vec![earlier.clone(), decision.clone()]);
        extensions.insert(all);
    }
    extensions.insert(decision);
}

/// `d` in whole milliseconds.
fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}
