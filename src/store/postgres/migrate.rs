//! `PgStore::migrate`: the schema brought up to date in one transaction, under an advisory
//! lock, so that copies starting together wait for each other instead of racing on the
//! catalog.

use std::time::Duration;

use deadpool_postgres::{Pool, Transaction};
use sha2::{Digest, Sha256};

use super::call::{pg_error, pool_error};
use super::sql::{SCHEMA_VERSION, migration, quoted};
use crate::store::{StoreError, millis};

/// Creates or updates `schema` (checked) within `timeout`.
pub(super) async fn migrate(
    pool: &Pool,
    schema: &str,
    unlogged: bool,
    timeout: Duration,
) -> Result<(), StoreError> {
    let run = async {
        let mut client = pool.get().await.map_err(pool_error)?;
        let tx = client.transaction().await.map_err(pg_error)?;
        apply(&tx, schema, unlogged, timeout)
            .await
            .map_err(pg_error)?;
        tx.commit().await.map_err(pg_error)
    };
    match tokio::time::timeout(timeout, run).await {
        Ok(result) => result,
        Err(_) => Err(StoreError::timeout()),
    }
}

async fn apply(
    tx: &Transaction<'_>,
    schema: &str,
    unlogged: bool,
    timeout: Duration,
) -> Result<(), tokio_postgres::Error> {
    let s = quoted(schema);
    // a store's connections may carry the short statement timeout of its calls
    tx.batch_execute(&format!(
        "SET LOCAL statement_timeout = {}; SET LOCAL client_min_messages = warning",
        millis(timeout)
    ))
    .await?;
    tx.execute("SELECT pg_advisory_xact_lock($1)", &[&lock_key(schema)])
        .await?;
    tx.batch_execute(&format!(
        "CREATE SCHEMA IF NOT EXISTS {s};
         CREATE TABLE IF NOT EXISTS {s}.migrations (
           version integer PRIMARY KEY,
           applied_at timestamptz NOT NULL DEFAULT now()
         )"
    ))
    .await?;
    // every statement is idempotent: the whole file runs each time, so that the functions are
    // always this crate's
    tx.batch_execute(&migration(schema, unlogged)).await?;
    set_rate_persistence(tx, schema, unlogged).await?;
    tx.execute(
        &format!("INSERT INTO {s}.migrations (version) VALUES ($1) ON CONFLICT DO NOTHING"),
        &[&SCHEMA_VERSION],
    )
    .await?;
    Ok(())
}

/// Makes the rate tables `UNLOGGED` or logged as asked, when they were created otherwise. A
/// logged table may not reference an unlogged one: the log follows its parent table when it
/// becomes logged, and goes first when they become unlogged.
async fn set_rate_persistence(
    tx: &Transaction<'_>,
    schema: &str,
    unlogged: bool,
) -> Result<(), tokio_postgres::Error> {
    let row = tx
        .query_one(
            "SELECT c.relpersistence FROM pg_class c
             JOIN pg_namespace n ON n.oid = c.relnamespace
             WHERE n.nspname = $1 AND c.relname = 'rate_limits'",
            &[&schema],
        )
        .await?;
    let persistence: i8 = row.try_get(0)?;
    let is_unlogged = persistence == b'u' as i8;
    if is_unlogged == unlogged {
        return Ok(());
    }
    let s = quoted(schema);
    let sql = if unlogged {
        format!("ALTER TABLE {s}.rate_log SET UNLOGGED; ALTER TABLE {s}.rate_limits SET UNLOGGED")
    } else {
        format!("ALTER TABLE {s}.rate_limits SET LOGGED; ALTER TABLE {s}.rate_log SET LOGGED")
    };
    tx.batch_execute(&sql).await
}

/// The advisory lock that serialises migrations of `schema`.
fn lock_key(schema: &str) -> i64 {
    let digest = Sha256::new()
        .chain_update(b"tollgate migrate\0")
        .chain_update(schema.as_bytes())
        .finalize();
    let mut head = [0u8; 8];
    head.copy_from_slice(&digest[..8]);
    i64::from_be_bytes(head)
}
