//! [`LimitsStore`]: the limits in force, kept beside the counters they judge.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use super::StoreFuture;
use crate::rate::{LimitTable, StoredTable, TableChange};

/// How many changes of a table its history keeps: the newest, older ones dropped as new ones
/// come.
pub const HISTORY_KEPT: usize = 100;

/// The longest note a change keeps, in bytes (a longer one is cut at a character boundary);
/// line breaks are kept as spaces.
pub const NOTE_MAX: usize = 500;

/// Each rate-limit layer's [`LimitTable`], versioned, with its history: what makes the limits
/// shared state, read by every copy. Tables are named by the layer's namespace
/// ([`RatePolicy::namespace`](crate::rate::RatePolicy::namespace)).
///
/// Every save is conditional on the version the writer read, as a compare-and-set: of two
/// writers that read one version, exactly one saves. A save is a write with a deadline, as every
/// write of the store's: received after it, it changes nothing.
pub trait LimitsStore: fmt::Debug + Send + Sync + 'static {
    /// The table of `namespace` and its version; `None` when none was ever saved.
    fn load_limits(&self, namespace: &str) -> StoreFuture<Option<StoredTable>>;

    /// Saves `table` as the table of `namespace` — version `expected + 1` — only if the version
    /// in the store is `expected` (0: no table yet), and records the change with `note` (see
    /// [`NOTE_MAX`]) and the store's time in its history (see [`HISTORY_KEPT`]).
    fn save_limits(
        &self,
        namespace: &str,
        expected: u64,
        table: &LimitTable,
        note: &str,
    ) -> StoreFuture<Saved>;

    /// The changes of `namespace`'s table, the newest first.
    fn limits_history(&self, namespace: &str) -> StoreFuture<Vec<TableChange>>;

    /// Records that copy `copy` of the layer of `namespace` is alive, built with `built` (what
    /// [`LimitTable::defaults_id`] says of its defaults), until `ttl` from now by the store's
    /// clock; copies not seen since their time are dropped.
    fn register_copy(
        &self,
        namespace: &str,
        copy: &str,
        built: &str,
        ttl: Duration,
    ) -> StoreFuture<()>;

    /// The copies of the layer of `namespace` seen within their time, by id.
    fn copies(&self, namespace: &str) -> StoreFuture<Vec<CopySeen>>;
}

/// A copy of a layer as it registered itself (see [`LimitsStore::register_copy`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CopySeen {
    /// The copy's id: random, one per layer and process.
    pub copy: String,
    /// What it was built with: [`LimitTable::defaults_id`] of its defaults.
    pub built: String,
    /// How long it counts as alive unless it registers again.
    pub left: Duration,
}

/// What a [`save_limits`](LimitsStore::save_limits) did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Saved {
    /// The table is saved as this version.
    Saved(u64),
    /// Nothing: the store held this version, not the one expected.
    Conflict(u64),
}

impl<T: LimitsStore + ?Sized> LimitsStore for Arc<T> {
    fn load_limits(&self, namespace: &str) -> StoreFuture<Option<StoredTable>> {
        (**self).load_limits(namespace)
    }

    fn save_limits(
        &self,
        namespace: &str,
        expected: u64,
        table: &LimitTable,
        note: &str,
    ) -> StoreFuture<Saved> {
        (**self).save_limits(namespace, expected, table, note)
    }

    fn limits_history(&self, namespace: &str) -> StoreFuture<Vec<TableChange>> {
        (**self).limits_history(namespace)
    }

    fn register_copy(
        &self,
        namespace: &str,
        copy: &str,
        built: &str,
        ttl: Duration,
    ) -> StoreFuture<()> {
        (**self).register_copy(namespace, copy, built, ttl)
    }

    fn copies(&self, namespace: &str) -> StoreFuture<Vec<CopySeen>> {
        (**self).copies(namespace)
    }
}

/// `note` as a change keeps it: one line, at most [`NOTE_MAX`] bytes.
pub(crate) fn kept_note(note: &str) -> String {
    let mut kept: String = note
        .chars()
        .map(|c| if c.is_control() { ' ' } else { c })
        .collect();
    if kept.len() > NOTE_MAX {
        let mut end = NOTE_MAX;
        while !kept.is_char_boundary(end) {
            end -= 1;
        }
        kept.truncate(end);
    }
    kept
}

/// A change as a history keeps it: the table's text, then `version`, `at` (ms since the epoch,
/// store time) and `note` lines, which [`LimitTable::decode`] skips.
#[cfg(test)]
pub(crate) fn change_record(table_text: &str, version: u64, at_ms: u64, note: &str) -> String {
    format!("{table_text}version {version}\nat {at_ms}\nnote {note}\n")
}

/// Reads a change that [`change_record`] (or a store's script, alike) wrote.
#[cfg_attr(not(feature = "redis"), allow(dead_code))]
pub(crate) fn read_change(record: &str) -> Result<TableChange, super::StoreError> {
    let bad = |what: &str| {
        super::StoreError::new(
            super::StoreErrorKind::Protocol,
            format!("stored change of limits: {what}"),
        )
    };
    let table = LimitTable::decode(record).map_err(|e| bad(&e.to_string()))?;
    let field = |name: &str| {
        record
            .lines()
            .rev()
            .find_map(|line| line.strip_prefix(name)?.strip_prefix(' '))
    };
    let number = |name: &str| field(name).and_then(|v| v.parse::<u64>().ok());
    let version = number("version").ok_or_else(|| bad("no version"))?;
    let at_ms = number("at").ok_or_else(|| bad("no time"))?;
    Ok(TableChange {
        version,
        at: std::time::UNIX_EPOCH + std::time::Duration::from_millis(at_ms),
        note: field("note").unwrap_or_default().to_owned(),
        table,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rate::Limit;

    #[test]
    fn a_note_is_kept_on_one_line_and_cut_at_a_character() {
        assert_eq!(kept_note("raised\nfor acme\t"), "raised for acme ");
        let long = "é".repeat(NOTE_MAX);
        let kept = kept_note(&long);
        assert_eq!(kept.len(), NOTE_MAX);
        assert!(kept.chars().all(|c| c == 'é'));
    }

    #[test]
    fn a_change_reads_back() {
        let table = LimitTable::with_defaults(2, [(None, vec![Limit::per_second("s", 3)])]);
        let record = change_record(&table.encode(), 7, 1_700_000_000_123, "note with words");
        let change = read_change(&record).unwrap();
        assert_eq!(change.version, 7);
        assert_eq!(change.note, "note with words");
        assert_eq!(change.table, table);
        let ms = change
            .at
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_millis();
        assert_eq!(ms, 1_700_000_000_123);
    }
}
