//! [`LimitsStore`] on PostgreSQL: a row of `limit_tables` per table, saved by `limits_save`
//! (compare-and-set on its version), its changes in `limit_changes`.

use std::sync::Arc;
use std::time::{Duration, UNIX_EPOCH};

use tokio::time::Instant;
use tokio_postgres::Row;

use super::call::Param;
use super::{PgStore, invalidation};
use crate::rate::{LimitTable, StoredTable, TableChange};
use crate::store::limits_store::{HISTORY_KEPT, kept_note};
use crate::store::{CopySeen, LimitsStore, Saved, StoreError, StoreFuture, millis};

impl LimitsStore for PgStore {
    fn load_limits(&self, namespace: &str) -> StoreFuture<Option<StoredTable>> {
        let params: Vec<Param> = vec![Box::new(namespace.to_owned())];
        self.call(
            "limits_load",
            |s| &s.limits_load,
            params,
            None,
            decode_table,
        )
    }

    fn save_limits(
        &self,
        namespace: &str,
        expected: u64,
        table: &LimitTable,
        note: &str,
    ) -> StoreFuture<Saved> {
        let params: Vec<Param> = vec![
            Box::new(namespace.to_owned()),
            Box::new(i64::try_from(expected).unwrap_or(i64::MAX)),
            Box::new(table.encode()),
            Box::new(kept_note(note)),
            Box::new(HISTORY_KEPT as i32),
        ];
        let deadline = Instant::now() + self.inner.settings.timeout;
        let saving = self.call(
            "limits_save",
            |s| &s.limits_save,
            params,
            Some(deadline),
            decode_saved,
        );
        let shared = Arc::clone(&self.inner.shared);
        let channel = invalidation::channel(&self.inner.settings.schema);
        let payload = invalidation::limits_payload(namespace);
        // every copy hears of it at once, and reads the table again
        Box::pin(async move {
            let saved = saving.await?;
            if let Saved::Saved(_) = saved {
                let params: Vec<Param> = vec![Box::new(channel), Box::new(payload)];
                let notified = shared
                    .calls
                    .row("invalidate", 1, &shared.sql.notify, &params, None)
                    .await;
                if let Err(error) = notified {
                    tracing::debug!(
                        target: "tollgate::store", %error,
                        "could not notify a change of limits; the copies read them within their refresh"
                    );
                }
            }
            Ok(saved)
        })
    }

    fn register_copy(
        &self,
        namespace: &str,
        copy: &str,
        built: &str,
        ttl: Duration,
    ) -> StoreFuture<()> {
        let params: Vec<Param> = vec![
            Box::new(namespace.to_owned()),
            Box::new(copy.to_owned()),
            Box::new(built.to_owned()),
            Box::new(i64::try_from(millis(ttl).max(1)).unwrap_or(i64::MAX)),
        ];
        let done: fn(&Row) -> Result<(), StoreError> = |_| Ok(());
        self.call(
            "limits_register",
            |s| &s.limits_register,
            params,
            None,
            done,
        )
    }

    fn copies(&self, namespace: &str) -> StoreFuture<Vec<CopySeen>> {
        let params: Vec<Param> = vec![Box::new(namespace.to_owned())];
        self.call(
            "limits_copies",
            |s| &s.limits_copies,
            params,
            None,
            decode_copies,
        )
    }

    fn limits_history(&self, namespace: &str) -> StoreFuture<Vec<TableChange>> {
        let params: Vec<Param> = vec![Box::new(namespace.to_owned())];
        self.call(
            "limits_history",
            |s| &s.limits_history,
            params,
            None,
            decode_history,
        )
    }
}

fn decode_table(row: &Row) -> Result<Option<StoredTable>, StoreError> {
    let version: Option<i64> = row.try_get(0).map_err(StoreError::protocol)?;
    let doc: Option<String> = row.try_get(1).map_err(StoreError::protocol)?;
    let (Some(version), Some(doc)) = (version, doc) else {
        return Ok(None);
    };
    Ok(Some(StoredTable {
        version: unsigned(version)?,
        table: LimitTable::decode(&doc).map_err(StoreError::protocol)?,
    }))
}

/// `{1, version}` saved, `{0, version}` held another, `{-1, 0}` too late.
fn decode_saved(row: &Row) -> Result<Saved, StoreError> {
    let reply: Vec<i64> = row.try_get(0).map_err(StoreError::protocol)?;
    match reply[..] {
        [1, version] => Ok(Saved::Saved(unsigned(version)?)),
        [0, version] => Ok(Saved::Conflict(unsigned(version)?)),
        [-1, _] => Err(StoreError::expired()),
        _ => Err(StoreError::protocol(format!(
            "limits_save answered {reply:?}"
        ))),
    }
}

fn decode_history(row: &Row) -> Result<Vec<TableChange>, StoreError> {
    let versions: Vec<i64> = row.try_get(0).map_err(StoreError::protocol)?;
    let at_ms: Vec<i64> = row.try_get(1).map_err(StoreError::protocol)?;
    let notes: Vec<String> = row.try_get(2).map_err(StoreError::protocol)?;
    let docs: Vec<String> = row.try_get(3).map_err(StoreError::protocol)?;
    versions
        .into_iter()
        .zip(at_ms)
        .zip(notes.into_iter().zip(docs))
        .map(|((version, at_ms), (note, doc))| {
            Ok(TableChange {
                version: unsigned(version)?,
                at: UNIX_EPOCH + Duration::from_millis(unsigned(at_ms)?),
                note,
                table: LimitTable::decode(&doc).map_err(StoreError::protocol)?,
            })
        })
        .collect()
}

/// The copies alive: three arrays, `NULL`s where there are none (the outer join's one row).
fn decode_copies(row: &Row) -> Result<Vec<CopySeen>, StoreError> {
    let copies: Vec<Option<String>> = row.try_get(0).map_err(StoreError::protocol)?;
    let left: Vec<Option<i64>> = row.try_get(1).map_err(StoreError::protocol)?;
    let built: Vec<Option<String>> = row.try_get(2).map_err(StoreError::protocol)?;
    let mut seen = Vec::new();
    for ((copy, left), built) in copies.into_iter().zip(left).zip(built) {
        if let (Some(copy), Some(left), Some(built)) = (copy, left, built) {
            let left = Duration::from_millis(unsigned(left.max(0))?);
            seen.push(CopySeen { copy, built, left });
        }
    }
    Ok(seen)
}

fn unsigned(value: i64) -> Result<u64, StoreError> {
    u64::try_from(value).map_err(|_| StoreError::protocol(format!("a negative number: {value}")))
}
