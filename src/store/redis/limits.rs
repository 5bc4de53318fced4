//! [`LimitsStore`] on Redis: a table is a hash (`v`, `doc`) beside a list of its changes, saved
//! by one compare-and-set script.

use std::sync::Arc;
use std::time::Duration;

use redis::Value;
use tokio::time::Instant;

use super::script_call::ScriptCall;
use super::{Effect, RedisStore, invalidation, redis_call, store_error};
use crate::keyspace;
use crate::rate::{LimitTable, StoredTable, TableChange};
use crate::store::limits_store::{HISTORY_KEPT, kept_note, read_change};
use crate::store::span::Command;
use crate::store::{CopySeen, LimitsStore, Saved, StoreError, StoreFuture, millis};

impl LimitsStore for RedisStore {
    fn load_limits(&self, namespace: &str) -> StoreFuture<Option<StoredTable>> {
        let (table, history) = keyspace::limit_table(namespace);
        let call = ScriptCall::default().key(table).key(history).arg("table");
        let span = redis_call(
            "limits_load",
            Command::Evalsha,
            self.scripts.limits_load.name,
        );
        self.call(span, move |mut conn, scripts| async move {
            let reply: (Option<u64>, Option<String>) = call
                .invoke(&scripts.limits_load, &mut conn)
                .await
                .map_err(store_error)?;
            match reply {
                (Some(version), Some(text)) => {
                    let table = LimitTable::decode(&text).map_err(StoreError::protocol)?;
                    Ok(Some(StoredTable { version, table }))
                }
                _ => Ok(None),
            }
        })
    }

    fn save_limits(
        &self,
        namespace: &str,
        expected: u64,
        table: &LimitTable,
        note: &str,
    ) -> StoreFuture<Saved> {
        let (key, history) = keyspace::limit_table(namespace);
        let call = ScriptCall::default()
            .key(key)
            .key(history)
            .arg(expected)
            .arg(table.encode())
            .arg(kept_note(note))
            .arg(HISTORY_KEPT as u64);
        let (conn, namespace) = (self.link.get(), Arc::<str>::from(namespace));
        let saving = self.write(
            "limits_save",
            |s| &s.limits_save,
            call,
            Instant::now() + self.timeout,
            // a save is undone by nothing: a table that replicas did not acknowledge is saved
            // again by the next change, which reads what the primary holds
            Effect {
                counts: |(saved, _): &(i64, u64)| *saved == 1,
                made: |_| false,
            },
            |(saved, version)| {
                Ok(if saved == 1 {
                    Saved::Saved(version)
                } else {
                    Saved::Conflict(version)
                })
            },
            None,
            None,
        );
        // every copy hears of it at once, and reads the table again
        Box::pin(async move {
            let saved = saving.await?;
            if let Saved::Saved(_) = saved {
                invalidation::publish_limits_or_log(conn, namespace).await;
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
        let call = ScriptCall::default()
            .key(keyspace::limit_copies(namespace))
            .arg("register")
            .arg(copy)
            .arg(built)
            .arg(millis(ttl).max(1));
        let span = redis_call(
            "limits_register",
            Command::Evalsha,
            self.scripts.limits_copies.name,
        );
        self.call(span, move |mut conn, scripts| async move {
            let _: i64 = call
                .invoke(&scripts.limits_copies, &mut conn)
                .await
                .map_err(store_error)?;
            Ok(())
        })
    }

    fn copies(&self, namespace: &str) -> StoreFuture<Vec<CopySeen>> {
        let call = ScriptCall::default()
            .key(keyspace::limit_copies(namespace))
            .arg("list");
        let span = redis_call(
            "limits_copies",
            Command::Evalsha,
            self.scripts.limits_copies.name,
        );
        self.call(span, move |mut conn, scripts| async move {
            let reply: Vec<(String, u64, String)> = call
                .invoke(&scripts.limits_copies, &mut conn)
                .await
                .map_err(store_error)?;
            let mut seen: Vec<CopySeen> = reply
                .into_iter()
                .map(|(copy, left_ms, built)| CopySeen {
                    copy,
                    built,
                    left: Duration::from_millis(left_ms),
                })
                .collect();
            seen.sort_by(|a, b| a.copy.cmp(&b.copy));
            Ok(seen)
        })
    }

    fn limits_history(&self, namespace: &str) -> StoreFuture<Vec<TableChange>> {
        let (table, history) = keyspace::limit_table(namespace);
        let call = ScriptCall::default().key(table).key(history).arg("history");
        let span = redis_call(
            "limits_history",
            Command::Evalsha,
            self.scripts.limits_load.name,
        );
        self.call(span, move |mut conn, scripts| async move {
            let reply: Vec<Value> = call
                .invoke(&scripts.limits_load, &mut conn)
                .await
                .map_err(store_error)?;
            reply
                .into_iter()
                .map(|change| match change {
                    Value::BulkString(bytes) => {
                        let text = String::from_utf8(bytes).map_err(StoreError::protocol)?;
                        read_change(&text)
                    }
                    other => Err(StoreError::protocol(format!(
                        "limits_history answered {other:?}"
                    ))),
                })
                .collect()
        })
    }
}
