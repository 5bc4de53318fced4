//! What a piece of in-process state is used for: the kinds of finding, each with a stable id,
//! what breaks when the service runs as N copies, and the fix for that use.

use serde::Serialize;

/// What was found, named by its use. The id ([`Kind::id`]) is stable: scripts and SARIF rules
/// refer to it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(rename_all = "kebab-case")]
pub(crate) enum Kind {
    /// Checked, then inserted around work: a record of what was already done (nonces,
    /// idempotency keys, processed events, one-time tokens), or read to skip work.
    AlreadyDone,
    /// Counted and compared with a limit: a rate limiter, or a library limiter that counts in
    /// process memory.
    InProcessRateLimit,
    /// Locked around a write: one copy at a time does the work.
    InProcessLock,
    /// A semaphore, or a concurrency limit that counts in process memory.
    InProcessConcurrencyLimit,
    /// Written by one request and read by others: sessions, tokens, rooms, pastes.
    InProcessRecord,
    /// A map of the connections subscribed to something: a message sent on one copy reaches
    /// only the subscribers connected to that copy.
    InProcessSubscribers,
    /// Counted and never compared: ids, totals, sequence numbers.
    InProcessCounter,
    /// A library store that keeps its records in process memory: tollgate's `MemoryStore`, an
    /// in-process session store.
    InProcessStore,
    /// A cache whose only use is memoising fetched or computed data: listed with `--all` only.
    InProcessCache,
    /// State whose use the audit does not see (no write found, or no use at all): listed with
    /// `--all` only when no write was found.
    InProcessState,
}

impl Kind {
    /// Every kind, in the order of the SARIF rules.
    pub(crate) const ALL: [Kind; 10] = [
        Kind::AlreadyDone,
        Kind::InProcessRateLimit,
        Kind::InProcessLock,
        Kind::InProcessConcurrencyLimit,
        Kind::InProcessRecord,
        Kind::InProcessSubscribers,
        Kind::InProcessCounter,
        Kind::InProcessStore,
        Kind::InProcessCache,
        Kind::InProcessState,
    ];

    /// The stable kebab-case id.
    pub(crate) fn id(self) -> &'static str {
        match self {
            Kind::AlreadyDone => "already-done",
            Kind::InProcessRateLimit => "in-process-rate-limit",
            Kind::InProcessLock => "in-process-lock",
            Kind::InProcessConcurrencyLimit => "in-process-concurrency-limit",
            Kind::InProcessRecord => "in-process-record",
            Kind::InProcessSubscribers => "in-process-subscribers",
            Kind::InProcessCounter => "in-process-counter",
            Kind::InProcessStore => "in-process-store",
            Kind::InProcessCache => "in-process-cache",
            Kind::InProcessState => "in-process-state",
        }
    }

    /// One line on what the kind is, for SARIF's `shortDescription`.
    pub(crate) fn summary(self) -> &'static str {
        match self {
            Kind::AlreadyDone => "An \"already done\" record in process memory",
            Kind::InProcessRateLimit => "A rate limit counted in process memory",
            Kind::InProcessLock => "A lock in process memory held around a write",
            Kind::InProcessConcurrencyLimit => "A concurrency limit counted in process memory",
            Kind::InProcessRecord => "Records in process memory that other requests read",
            Kind::InProcessSubscribers => "Subscribers of one copy only",
            Kind::InProcessCounter => "A counter in process memory",
            Kind::InProcessStore => "A store that keeps its records in process memory",
            Kind::InProcessCache => "A per-copy cache of fetched or computed data",
            Kind::InProcessState => "State in process memory whose use is not seen",
        }
    }

    /// What breaks with N copies, one sentence.
    pub(crate) fn breaks(self) -> &'static str {
        match self {
            Kind::AlreadyDone => {
                "each copy remembers only what it did itself, so a repeat that reaches another \
                 copy is done again (a nonce or a token accepted N times, a payment or an event \
                 processed N times)"
            }
            Kind::InProcessRateLimit => {
                "each copy counts on its own, so N copies let a caller through N times the limit"
            }
            Kind::InProcessLock => {
                "a lock taken on one copy does not stop the others, so N copies run the guarded \
                 write at the same time"
            }
            Kind::InProcessConcurrencyLimit => {
                "each copy has its own permits, so N copies let N times as many in at once"
            }
            Kind::InProcessRecord => {
                "a record written on one copy is not seen by the others, so a request that \
                 reaches another copy finds nothing or an old value"
            }
            Kind::InProcessSubscribers => {
                "a message sent on one copy reaches only the connections held by that copy; \
                 subscribers connected to the others miss it"
            }
            Kind::InProcessCounter => {
                "N copies keep N separate totals and hand out the same numbers"
            }
            Kind::InProcessStore => {
                "each copy keeps its own records, so a session, a claim or a counter made on one \
                 copy is unknown to the others"
            }
            Kind::InProcessCache => {
                "each copy caches on its own: it serves data up to the cache's lifetime stale, \
                 which is fine for data that may be stale"
            }
            Kind::InProcessState => {
                "each copy has its own; whether that matters depends on a use the audit did not \
                 see"
            }
        }
    }

    /// The fix for this use, one sentence, with the tollgate type where one fits.
    pub(crate) fn fix(self) -> &'static str {
        match self {
            Kind::AlreadyDone => {
                "claim the key before the work with a `tollgate::claim::Claims` claim (one \
                 `SET NX` or `INSERT … ON CONFLICT DO NOTHING` that exactly one copy wins); for \
                 requests with an `Idempotency-Key`, `tollgate::idempotency::IdempotencyLayer` \
                 runs the handler once and replays its response"
            }
            Kind::InProcessRateLimit => {
                "count in the shared store: `tollgate::rate_limit::RateLimitLayer` (Redis / \
                 Valkey or PostgreSQL) enforces one limit across all copies"
            }
            Kind::InProcessLock => {
                "take a `tollgate::lock::Locks` lock (leased, so a crashed copy does not hold it \
                 for ever) and pass its fencing token to the write, which the database accepts \
                 only when the token is not older than the last one it saw"
            }
            Kind::InProcessConcurrencyLimit => {
                "`tollgate::concurrency::ConcurrencyLimitLayer` counts the requests in flight \
                 across all copies in the shared store"
            }
            Kind::InProcessRecord => {
                "keep the records in the database the service already has (a table, or a Redis \
                 hash with a TTL), written with a conditional write (`INSERT … ON CONFLICT`, \
                 `UPDATE … WHERE version = $1`) so that two copies do not overwrite each other"
            }
            Kind::InProcessSubscribers => {
                "publish through the shared store (Redis `PUBLISH`, PostgreSQL `NOTIFY`) and let \
                 every copy deliver to the connections it holds"
            }
            Kind::InProcessCounter => {
                "count with one atomic increment in the shared store (Redis `INCR`, a database \
                 sequence or `UPDATE … SET n = n + 1 RETURNING n`)"
            }
            Kind::InProcessStore => {
                "give every copy one shared store: `tollgate::store::RedisStore` or \
                 `tollgate::store::PgStore` for tollgate, the library's Redis or database \
                 backend for sessions"
            }
            Kind::InProcessCache => {
                "nothing to do if the data may be stale for the cache's lifetime; otherwise \
                 invalidate through the shared store (a version key, `NOTIFY`)"
            }
            Kind::InProcessState => {
                "if requests change it, keep it in the shared store; if it is only read after \
                 start-up, mark it `// tollgate: allow(read-only)`"
            }
        }
    }

    /// Whether the kind is listed only with `--all`.
    pub(crate) fn only_with_all(self) -> bool {
        matches!(self, Kind::InProcessCache | Kind::InProcessState)
    }
}

/// What kind of place holds the state.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub(crate) enum Place {
    /// A `static`, `lazy_static!` or `thread_local!`.
    Static,
    /// The application's shared state.
    State,
    /// An actor's fields (actix `impl Actor`), reached through its `Addr`.
    Actor,
    /// A task that owns it and is fed by a channel.
    Task,
    /// A library type known to keep state in process memory.
    Library,
}

impl Place {
    /// How the finding's sentence names the place.
    pub(crate) fn held(self) -> &'static str {
        match self {
            Place::Static => "held in a static",
            Place::State => "the application's shared state",
            Place::Actor => "an actor's state, reached through its address",
            Place::Task => "owned by a task fed by a channel",
            Place::Library => "kept by a library in process memory",
        }
    }
}

/// What a piece of state is by its type, before its use decides its [`Kind`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Base {
    /// A lock, or a value changed behind one.
    Lock,
    /// A map or set.
    Map,
    /// An atomic integer, or an integer behind a lock.
    Counter,
    /// A cache.
    Cache,
    /// A semaphore.
    Semaphore,
}

/// Whether a name says it records work already done: one of its words (split on `_` and case
/// changes) is `seen`, `processed`, `done`, `used`, `redeemed`, `handled`, `claimed`,
/// `consumed`, `revoked`, or starts with `idempot`, `dedup` or `nonce`.
pub(crate) fn names_done_work(name: &str) -> bool {
    words(name).iter().any(|word| {
        matches!(
            word.as_str(),
            "seen"
                | "processed"
                | "done"
                | "used"
                | "redeemed"
                | "handled"
                | "claimed"
                | "consumed"
                | "revoked"
        ) || word.starts_with("idempot")
            || word.starts_with("dedup")
            || word.starts_with("nonce")
    })
}

/// Whether a name says it limits a rate: a word `ratelimit`, `limiter`, `throttle`, `bucket`
/// (and plurals), or `rate` followed by `limit`.
pub(crate) fn names_rate_limit(name: &str) -> bool {
    let words = words(name);
    words.iter().any(|w| {
        matches!(
            w.trim_end_matches('s'),
            "ratelimit" | "ratelimiter" | "limiter" | "throttle" | "bucket"
        )
    }) || words
        .windows(2)
        .any(|pair| pair[0] == "rate" && pair[1].starts_with("limit"))
}

/// Whether a name says it caches.
pub(crate) fn names_cache(name: &str) -> bool {
    words(name)
        .iter()
        .any(|w| matches!(w.as_str(), "cache" | "cached" | "memo" | "memoized"))
}

/// The lower-case words of a snake_case, SCREAMING_CASE or CamelCase name.
pub(crate) fn words(name: &str) -> Vec<String> {
    let mut words = Vec::new();
    let mut word = String::new();
    let mut previous_lower = false;
    for c in name.chars() {
        if c == '_' || !c.is_alphanumeric() {
            if !word.is_empty() {
                words.push(std::mem::take(&mut word));
            }
            previous_lower = false;
            continue;
        }
        if c.is_uppercase() && previous_lower && !word.is_empty() {
            words.push(std::mem::take(&mut word));
        }
        previous_lower = c.is_lowercase() || c.is_numeric();
        word.extend(c.to_lowercase());
    }
    if !word.is_empty() {
        words.push(word);
    }
    words
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn done_work_names() {
        for name in [
            "seen",
            "SEEN_IDS",
            "processed_events",
            "usedNonces",
            "redeemed",
            "idempotency_keys",
            "DEDUP",
            "nonce_cache",
            "handled_webhooks",
        ] {
            assert!(names_done_work(name), "{name}");
        }
        for name in [
            "users", "unused", "sessions", "paused", "SESSIONS", "cache", "abused",
        ] {
            assert!(!names_done_work(name), "{name}");
        }
    }

    #[test]
    fn rate_limit_names() {
        for name in [
            "RatelimitStorage",
            "rate_limits",
            "LIMITER",
            "buckets",
            "throttle",
            "RateLimitState",
        ] {
            assert!(names_rate_limit(name), "{name}");
        }
        for name in ["rates", "limit", "sessions", "delimiter", "bucketed_rows"] {
            assert!(!names_rate_limit(name), "{name}");
        }
    }

    #[test]
    fn ids_are_kebab_case_and_distinct() {
        let ids: std::collections::BTreeSet<_> = Kind::ALL.iter().map(|k| k.id()).collect();
        assert_eq!(ids.len(), Kind::ALL.len());
        for kind in Kind::ALL {
            let json = serde_json::to_string(&kind).unwrap_or_default();
            assert_eq!(json, format!("\"{}\"", kind.id()));
        }
    }
}
