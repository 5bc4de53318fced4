//! [`LimitsStore`] in memory: each table, its version and its history behind one lock.

use std::collections::{HashMap, VecDeque};
use std::sync::{Mutex, PoisonError};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use super::{MemoryStore, ready};
use crate::rate::{LimitTable, StoredTable, TableChange};
use crate::store::limits_store::{HISTORY_KEPT, kept_note};
use crate::store::{CopySeen, Invalidation, LimitsStore, Saved, StoreFuture};

/// The tables of a [`MemoryStore`], by namespace, and the copies registered under each: by id,
/// what they were built with and until when (store time, µs).
#[derive(Debug, Default)]
pub(super) struct Tables(Mutex<HashMap<String, Kept>>, Mutex<HashMap<String, Copies>>);

/// The copies registered under one namespace: by id, what each was built with and until when.
type Copies = HashMap<String, (String, u64)>;

#[derive(Debug)]
struct Kept {
    version: u64,
    table: LimitTable,
    history: VecDeque<TableChange>,
}

impl LimitsStore for MemoryStore {
    fn load_limits(&self, namespace: &str) -> StoreFuture<Option<StoredTable>> {
        let tables = self
            .inner
            .tables
            .0
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        ready(tables.get(namespace).map(|kept| StoredTable {
            version: kept.version,
            table: kept.table.clone(),
        }))
    }

    fn save_limits(
        &self,
        namespace: &str,
        expected: u64,
        table: &LimitTable,
        note: &str,
    ) -> StoreFuture<Saved> {
        let mut tables = self
            .inner
            .tables
            .0
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let held = tables.get(namespace).map_or(0, |kept| kept.version);
        if held != expected {
            return ready(Saved::Conflict(held));
        }
        let kept = tables.entry(namespace.to_owned()).or_insert_with(|| Kept {
            version: 0,
            table: LimitTable::default(),
            history: VecDeque::new(),
        });
        kept.version += 1;
        kept.table = table.clone();
        kept.history.push_front(TableChange {
            version: kept.version,
            at: now_ms(),
            note: kept_note(note),
            table: table.clone(),
        });
        kept.history.truncate(HISTORY_KEPT);
        let version = kept.version;
        drop(tables);
        self.inner.invalidations.send(Invalidation::Limits {
            namespace: namespace.into(),
        });
        ready(Saved::Saved(version))
    }

    fn register_copy(
        &self,
        namespace: &str,
        copy: &str,
        built: &str,
        ttl: Duration,
    ) -> StoreFuture<()> {
        let now = self.now_us();
        let mut copies = self
            .inner
            .tables
            .1
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let of = copies.entry(namespace.to_owned()).or_default();
        of.retain(|_, (_, until)| *until > now);
        let until = now.saturating_add(u64::try_from(ttl.as_micros()).unwrap_or(u64::MAX));
        of.insert(copy.to_owned(), (built.to_owned(), until));
        ready(())
    }

    fn copies(&self, namespace: &str) -> StoreFuture<Vec<CopySeen>> {
        let now = self.now_us();
        let copies = self
            .inner
            .tables
            .1
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let mut seen: Vec<CopySeen> = copies
            .get(namespace)
            .into_iter()
            .flatten()
            .filter(|(_, (_, until))| *until > now)
            .map(|(copy, (built, until))| CopySeen {
                copy: copy.clone(),
                built: built.clone(),
                left: Duration::from_micros(until - now),
            })
            .collect();
        seen.sort_by(|a, b| a.copy.cmp(&b.copy));
        ready(seen)
    }

    fn limits_history(&self, namespace: &str) -> StoreFuture<Vec<TableChange>> {
        let tables = self
            .inner
            .tables
            .0
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        ready(
            tables
                .get(namespace)
                .map(|kept| kept.history.iter().cloned().collect())
                .unwrap_or_default(),
        )
    }
}

/// Now, to the millisecond, as Redis's and PostgreSQL's histories keep it.
fn now_ms() -> SystemTime {
    let since = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default();
    UNIX_EPOCH + Duration::from_millis(u64::try_from(since.as_millis()).unwrap_or(u64::MAX))
}
