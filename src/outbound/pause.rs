//! [`Pause`]: what a provider's `429` or `503` makes a copy do — wait before its next call of
//! that key — and the pauses in force on this copy.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock, PoisonError};
use std::time::{Duration, SystemTime};

use http::{HeaderMap, StatusCode, header};
use tokio::time::Instant;

use super::counts::ProviderCounts;
use crate::key::Key;
use crate::keyspace;
use crate::store::{ClaimRequest, Hold, LockStore};

/// How an [`OutboundLimitLayer`](super::OutboundLimitLayer) reads a provider that says it is
/// overloaded: a `429 Too Many Requests` or `503 Service Unavailable` pauses the calls of that
/// key on this copy, for as long as its `Retry-After` says.
///
/// What the provider sends may be wrong, and is never trusted further than this:
///
/// | `Retry-After` | pause |
/// | --- | --- |
/// | seconds (`120`) or an HTTP date in the future | that long, at most [`longest`](Self::longest) (default 5 minutes) |
/// | missing, unparsable, negative, a date in the past | [`without_retry_after`](Self::without_retry_after) (default 1 s) |
/// | longer than `longest` (however many digits) | `longest` |
/// | `0` | none |
///
/// Other statuses pause nothing by their status (an answer whose own count says the quota is
/// spent does, until its reset, with the same caps: see
/// [`ProviderCounts`](super::ProviderCounts)). A call that finds its key paused waits for the
/// pause to end when it ends within the call's patience, and fails with
/// [`OutboundError::Limited`](super::OutboundError::Limited) at once otherwise.
///
/// ```
/// use std::time::Duration;
/// use http::{HeaderMap, StatusCode};
/// use tollgate::outbound::Pause;
///
/// let pause = Pause::default().longest(Duration::from_secs(60));
/// let mut headers = HeaderMap::new();
/// headers.insert("retry-after", "7".parse().unwrap());
/// assert_eq!(pause.of(StatusCode::TOO_MANY_REQUESTS, &headers), Some(Duration::from_secs(7)));
/// headers.insert("retry-after", "86400".parse().unwrap());
/// assert_eq!(pause.of(StatusCode::SERVICE_UNAVAILABLE, &headers), Some(Duration::from_secs(60)));
/// headers.insert("retry-after", "-3".parse().unwrap());
/// assert_eq!(pause.of(StatusCode::TOO_MANY_REQUESTS, &headers), Some(Duration::from_secs(1)));
/// assert_eq!(pause.of(StatusCode::OK, &headers), None);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Pause {
    longest: Duration,
    without_retry_after: Duration,
}

impl Default for Pause {
    fn default() -> Self {
        Self {
            longest: Duration::from_secs(300),
            without_retry_after: Duration::from_secs(1),
        }
    }
}

impl Pause {
    /// The longest pause a provider's answer may cause (default 5 minutes): a longer
    /// `Retry-After` is taken as this.
    pub fn longest(self, longest: Duration) -> Self {
        Self { longest, ..self }
    }

    /// The pause after a `429` or `503` without a usable `Retry-After` (default 1 s; zero
    /// pauses nothing).
    pub fn without_retry_after(self, pause: Duration) -> Self {
        Self {
            without_retry_after: pause,
            ..self
        }
    }

    /// The pause an answer of `status` with `headers` causes, if any.
    pub fn of(&self, status: StatusCode, headers: &HeaderMap) -> Option<Duration> {
        if status != StatusCode::TOO_MANY_REQUESTS && status != StatusCode::SERVICE_UNAVAILABLE {
            return None;
        }
        let said = headers
            .get(header::RETRY_AFTER)
            .and_then(|value| value.to_str().ok())
            .and_then(retry_after);
        let pause = said.unwrap_or(self.without_retry_after).min(self.longest);
        (!pause.is_zero()).then_some(pause)
    }
}

/// A `Retry-After` value as a wait from now: delay-seconds (more than any clock holds: the
/// longest), or an HTTP date in the future.
fn retry_after(value: &str) -> Option<Duration> {
    let value = value.trim();
    if !value.is_empty() && value.bytes().all(|b| b.is_ascii_digit()) {
        return Some(
            value
                .parse::<u64>()
                .map_or(Duration::MAX, Duration::from_secs),
        );
    }
    let at = httpdate::parse_http_date(value).ok()?;
    at.duration_since(SystemTime::now()).ok()
}

/// The pauses in force on this copy, by key.
#[derive(Debug, Default)]
pub(crate) struct Pauses {
    until: Mutex<HashMap<Key, Instant>>,
}

impl Pauses {
    /// Until when calls of `key` wait, if they do.
    pub(crate) fn until(&self, key: Key) -> Option<Instant> {
        let mut until = self.until.lock().unwrap_or_else(PoisonError::into_inner);
        let now = Instant::now();
        // ended pauses go as they are met, and all of them once the map grows
        if until.len() > 1_024 {
            until.retain(|_, end| *end > now);
        }
        match until.get(&key) {
            Some(end) if *end > now => Some(*end),
            Some(_) => {
                until.remove(&key);
                None
            }
            None => None,
        }
    }

    /// Pauses the calls of `key` for `pause` from now (a later pause in force is kept).
    pub(crate) fn pause(&self, key: Key, pause: Duration) {
        let now = Instant::now();
        // a pause as long as `Pause::longest(Duration::MAX)` allows ends a year from now
        let end = now
            .checked_add(pause)
            .unwrap_or_else(|| now + Duration::from_secs(365 * 24 * 60 * 60));
        let mut until = self.until.lock().unwrap_or_else(PoisonError::into_inner);
        let kept = until.entry(key).or_insert(end);
        *kept = (*kept).max(end);
    }
}

/// The provider's pauses of a layer: how its answers are read, the pauses in force on this
/// copy, and — when shared — where every copy finds them.
#[derive(Debug, Default)]
pub(crate) struct PauseBook {
    pub(crate) pause: Mutex<Pause>,
    /// How the provider's own counts are read.
    pub(crate) counts: Mutex<ProviderCounts>,
    local: Pauses,
    /// The store the pauses are shared in, and the namespace of their keys.
    pub(crate) shared: OnceLock<(Arc<dyn LockStore>, Arc<str>)>,
}

impl PauseBook {
    /// Until when calls of `key` wait: a pause of this copy's, or one another copy put in the
    /// store (then held here too, so that the calls after it do not ask the store again).
    pub(crate) async fn paused_until(&self, key: Key) -> Option<Instant> {
        if let Some(until) = self.local.until(key) {
            return Some(until);
        }
        let (store, namespace) = self.shared.get()?;
        let (pause, fence) = keyspace::provider_pause(namespace, &key);
        match store.lock_state(&pause, &fence).await {
            Ok(state) if state.holder.is_some() && !state.lease_left.is_zero() => {
                self.local.pause(key, state.lease_left);
                self.local.until(key)
            }
            Ok(_) => None,
            Err(error) => {
                tracing::debug!(
                    target: "tollgate::outbound", %error, %key,
                    "could not read the provider's pause: the call goes on to its limits"
                );
                None
            }
        }
    }

    /// The provider answered a call of `key` with `status` and `headers`: a pause, if they
    /// ask for one — a `429` or `503`, or a remaining count of 0 — on this copy and, shared,
    /// in the store for every copy (a pause in force there is kept, not lengthened). The
    /// provider's remaining count, when it reports one above 0.
    pub(crate) async fn heard(
        &self,
        key: Key,
        status: StatusCode,
        headers: &HeaderMap,
    ) -> Option<u64> {
        let pause = *self.pause.lock().unwrap_or_else(PoisonError::into_inner);
        let count = self
            .counts
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .read(headers);
        // a count spent pauses until its reset, as a `Retry-After` does
        let spent = count
            .filter(|count| count.remaining == 0)
            .map(|count| {
                count
                    .reset
                    .unwrap_or(pause.without_retry_after)
                    .min(pause.longest)
            })
            .filter(|spent| !spent.is_zero());
        let remaining = count.map(|count| count.remaining).filter(|left| *left > 0);
        let Some(pause) = pause.of(status, headers).max(spent) else {
            return remaining;
        };
        self.local.pause(key, pause);
        let Some((store, namespace)) = self.shared.get() else {
            return remaining;
        };
        // written in the background: the answer goes back to the caller at once
        let store = Arc::clone(store);
        let (pause_key, fence) = keyspace::provider_pause(namespace, &key);
        tokio::spawn(async move {
            let deadline = Instant::now() + store.timeout();
            let request = ClaimRequest::new(pause_key.clone(), PAUSED_BY, Some(pause));
            let shared = match store.claim(request, deadline).await {
                Ok(outcome) if outcome.won => Ok(()),
                // one in force: lengthened, when this one ends later
                Ok(_) => lengthen(&*store, pause_key, &fence, pause).await,
                Err(error) => Err(error),
            };
            if let Err(error) = shared {
                tracing::warn!(
                    target: "tollgate::outbound", %error, %key,
                    "could not share the provider's pause: other copies learn of it from their own answers"
                );
            }
        });
        remaining
    }
}

/// The holder of every pause in the store.
const PAUSED_BY: &str = "provider";

/// Lengthens the pause in force at `pause_key` to `pause` from now, if it ends sooner.
async fn lengthen(
    store: &dyn LockStore,
    pause_key: String,
    fence: &str,
    pause: Duration,
) -> Result<(), crate::store::StoreError> {
    let state = store.lock_state(&pause_key, fence).await?;
    if state.holder.as_deref() == Some(PAUSED_BY) && state.lease_left < pause {
        let deadline = Instant::now() + store.timeout();
        store
            .extend_if_held(Hold::new(pause_key, PAUSED_BY), pause, deadline)
            .await?;
    }
    Ok(())
}
