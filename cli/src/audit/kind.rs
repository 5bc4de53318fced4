//! The kinds of finding: a stable id each, what it means, and the tollgate replacement.

use serde::Serialize;

/// What was found. The id ([`Kind::id`]) is stable: scripts and SARIF rules refer to it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(rename_all = "kebab-case")]
pub(crate) enum Kind {
    /// A process-wide lock, or a value behind one, in a `static`.
    StaticMutex,
    /// A process-wide map or set in a `static`.
    StaticMap,
    /// A process-wide atomic integer (or an integer behind a lock) in a `static`.
    StaticCounter,
    /// A process-wide cache in a `static`.
    StaticCache,
    /// A process-wide semaphore in a `static`.
    StaticSemaphore,
    /// A lock, or a value behind one, in the application's shared state.
    StateMutex,
    /// A map or set in the application's shared state, changed through a lock or a concurrent
    /// map.
    StateMap,
    /// An atomic integer (or an integer behind a lock) in the application's shared state.
    StateCounter,
    /// A cache in the application's shared state.
    StateCache,
    /// A semaphore in the application's shared state.
    StateSemaphore,
    /// A map, set or cache whose name says it records what was already done.
    SeenSet,
    /// A rate limiter that counts in process memory.
    InProcessRateLimit,
    /// A concurrency limit that counts in process memory.
    InProcessConcurrencyLimit,
    /// tollgate's own in-process store, `MemoryStore`: one copy's counters, claims and records.
    InProcessStore,
}

impl Kind {
    /// Every kind, in the order of the SARIF rules.
    pub(crate) const ALL: [Kind; 14] = [
        Kind::StaticMutex,
        Kind::StaticMap,
        Kind::StaticCounter,
        Kind::StaticCache,
        Kind::StaticSemaphore,
        Kind::StateMutex,
        Kind::StateMap,
        Kind::StateCounter,
        Kind::StateCache,
        Kind::StateSemaphore,
        Kind::SeenSet,
        Kind::InProcessRateLimit,
        Kind::InProcessConcurrencyLimit,
        Kind::InProcessStore,
    ];

    /// The stable kebab-case id.
    pub(crate) fn id(self) -> &'static str {
        match self {
            Kind::StaticMutex => "static-mutex",
            Kind::StaticMap => "static-map",
            Kind::StaticCounter => "static-counter",
            Kind::StaticCache => "static-cache",
            Kind::StaticSemaphore => "static-semaphore",
            Kind::StateMutex => "state-mutex",
            Kind::StateMap => "state-map",
            Kind::StateCounter => "state-counter",
            Kind::StateCache => "state-cache",
            Kind::StateSemaphore => "state-semaphore",
            Kind::SeenSet => "seen-set",
            Kind::InProcessRateLimit => "in-process-rate-limit",
            Kind::InProcessConcurrencyLimit => "in-process-concurrency-limit",
            Kind::InProcessStore => "in-process-store",
        }
    }

    /// One line on what the kind is, for SARIF's `shortDescription`.
    pub(crate) fn summary(self) -> &'static str {
        match self {
            Kind::StaticMutex => "A lock or a value behind a lock in a static: one per copy",
            Kind::StaticMap => "A map or set in a static, changed at run time: one per copy",
            Kind::StaticCounter => "A counter in a static: each copy counts on its own",
            Kind::StaticCache => "A cache in a static: one per copy",
            Kind::StaticSemaphore => "A semaphore in a static: each copy has its own permits",
            Kind::StateMutex => "A lock or a value behind a lock in shared state: one per copy",
            Kind::StateMap => "A map or set in shared state, changed at run time: one per copy",
            Kind::StateCounter => "A counter in shared state: each copy counts on its own",
            Kind::StateCache => "A cache in shared state: one per copy",
            Kind::StateSemaphore => "A semaphore in shared state: each copy has its own permits",
            Kind::SeenSet => {
                "An \"already done\" set in process memory: a repeat on another copy is done again"
            }
            Kind::InProcessRateLimit => {
                "A rate limiter in process memory: N copies let a caller through N times as often"
            }
            Kind::InProcessConcurrencyLimit => {
                "A concurrency limit in process memory: N copies let N times as many in"
            }
            Kind::InProcessStore => {
                "tollgate's MemoryStore: each copy keeps its own counters, claims and records"
            }
        }
    }

    /// The tollgate replacement, one sentence.
    pub(crate) fn fix(self) -> &'static str {
        match self {
            Kind::StaticMutex | Kind::StateMutex => {
                "keep the state in the shared store; to let one copy at a time do the work take a \
                 `tollgate::lock::Locks` lock (leased, with a fencing token), and to do a thing \
                 once use a `tollgate::claim::Claims` claim"
            }
            Kind::StaticMap | Kind::StateMap => {
                "keep the records in the shared store (Redis / Valkey or PostgreSQL), changed by \
                 atomic operations; an \"already done\" record is a `tollgate::claim::Claims` \
                 claim, a per-key lock a `tollgate::lock::Locks` lock"
            }
            Kind::StaticCounter | Kind::StateCounter => {
                "count in the shared store with one atomic increment (Redis `INCR`, a database \
                 sequence); to limit a caller's requests use `tollgate::rate_limit::RateLimitLayer`"
            }
            Kind::StaticCache | Kind::StateCache => {
                "keep a per-copy cache only for data that may be stale; what was done belongs in \
                 a `tollgate::claim::Claims` claim, a response to replay in \
                 `tollgate::idempotency::IdempotencyLayer`"
            }
            Kind::StaticSemaphore | Kind::StateSemaphore | Kind::InProcessConcurrencyLimit => {
                "`tollgate::concurrency::ConcurrencyLimitLayer` counts the requests in flight \
                 across all copies in the shared store"
            }
            Kind::SeenSet => {
                "a `tollgate::claim::Claims` claim (one `SET NX` that exactly one copy wins); for \
                 requests with an `Idempotency-Key`, `tollgate::idempotency::IdempotencyLayer`"
            }
            Kind::InProcessRateLimit => {
                "`tollgate::rate_limit::RateLimitLayer` keeps each caller's count in the shared \
                 store, so that all copies enforce one limit"
            }
            Kind::InProcessStore => {
                "give every copy one shared store: `tollgate::store::RedisStore` (Redis or \
                 Valkey) or `tollgate::store::PgStore` (PostgreSQL); `MemoryStore` is for a \
                 single copy, tests and docs"
            }
        }
    }
}

/// What kind of place holds the state.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Place {
    /// A `static`, `lazy_static!` or `thread_local!`.
    Static,
    /// The application's shared state.
    State,
}

/// What a piece of state is, before the place and the name decide its [`Kind`].
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

impl Base {
    /// A lock whose name says it caches (`CSS_CACHE`, `token_cache`) is a cache.
    pub(crate) fn named(self, name: &str) -> Base {
        if self == Base::Lock && words(name).iter().any(|w| w == "cache" || w == "cached") {
            Base::Cache
        } else {
            self
        }
    }

    /// The kind for this base in `place`, held under `name` (a field or a static; for a field,
    /// the struct's name and the field's joined by `_`).
    pub(crate) fn kind(self, place: Place, name: &str) -> Kind {
        if matches!(self, Base::Map | Base::Cache) && names_done_work(name) {
            return Kind::SeenSet;
        }
        match (place, self) {
            (Place::Static, Base::Lock) => Kind::StaticMutex,
            (Place::Static, Base::Map) => Kind::StaticMap,
            (Place::Static, Base::Counter) => Kind::StaticCounter,
            (Place::Static, Base::Cache) => Kind::StaticCache,
            (Place::Static, Base::Semaphore) => Kind::StaticSemaphore,
            (Place::State, Base::Lock) => Kind::StateMutex,
            (Place::State, Base::Map) => Kind::StateMap,
            (Place::State, Base::Counter) => Kind::StateCounter,
            (Place::State, Base::Cache) => Kind::StateCache,
            (Place::State, Base::Semaphore) => Kind::StateSemaphore,
        }
    }

    /// Why N copies break it, the end of a finding's sentence.
    pub(crate) fn why(self, kind: Kind) -> &'static str {
        if kind == Kind::SeenSet {
            return "each copy remembers only what it handled itself, so a repeat that reaches \
                    another copy is done again";
        }
        match self {
            Base::Lock => {
                "each copy has its own, so a lock taken or a value written on one copy is not \
                 seen by the others"
            }
            Base::Map => {
                "each copy has its own, so a record written on one copy is not seen by the others"
            }
            Base::Counter => {
                "each copy counts on its own, so N copies keep N separate totals (and hand out \
                 the same numbers)"
            }
            Base::Cache => {
                "each copy caches on its own, which is fine for data that may be stale but not \
                 for what was done or who may pass"
            }
            Base::Semaphore => "each copy has its own permits, so N copies let N times as many in",
        }
    }
}

/// Whether a field or static name says it records work already done: one of its words (split
/// on `_` and case changes) is `seen`, `processed`, `done`, `used`, `redeemed`, `handled`,
/// `claimed`, `consumed`, or starts with `idempot`, `dedup` or `nonce`.
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
        ) || word.starts_with("idempot")
            || word.starts_with("dedup")
            || word.starts_with("nonce")
    })
}

/// The lower-case words of a snake_case, SCREAMING_CASE or CamelCase name.
fn words(name: &str) -> Vec<String> {
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
    fn ids_are_kebab_case_and_distinct() {
        let ids: std::collections::BTreeSet<_> = Kind::ALL.iter().map(|k| k.id()).collect();
        assert_eq!(ids.len(), Kind::ALL.len());
        for kind in Kind::ALL {
            let json = serde_json::to_string(&kind).unwrap();
            assert_eq!(json, format!("\"{}\"", kind.id()));
        }
    }
}
