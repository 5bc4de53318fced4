//! `PgStore::migrate`: the schema's version read first, locking none of the store's tables, and
//! only when it is behind, the schema brought up to date in one transaction under an advisory
//! lock, so that copies starting together wait for each other instead of racing on the catalog.
//!
//! Every copy migrates at its start, so in a rolling deploy migrations run under load: one that
//! finds the schema current does no DDL at all (`CREATE INDEX IF NOT EXISTS` alone would hold a
//! SHARE lock on its table to the commit, stalling every write to it). One that runs DDL locks
//! the tables in the order every function locks them (see `migrations/0009_base.sql`): none deadlocks.

use std::time::Duration;

use deadpool_postgres::{GenericClient, Pool, Transaction};
use sha2::{Digest, Sha256};

use super::call::{pg_error, pool_error};
use super::sql::{MIGRATIONS_BASE, SCHEMA_VERSION, migrations, quoted};
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
        if is_current(&client, schema, unlogged)
            .await
            .map_err(pg_error)?
        {
            return Ok(());
        }
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

/// Whether `schema` is at this crate's version or a later one, its rate tables as `unlogged`
/// asks and no function of version 1 in it: read from its `migrations` table and the catalog,
/// with no lock on the store's tables. A schema that a later version of the crate migrated is
/// left as it is. (A copy of version 1 migrates on every start, whatever the version row says:
/// one started after the upgrade puts its functions back — releases without the key's lock
/// among them — and the next migration of this version runs its DDL again.)
async fn is_current(
    client: &impl GenericClient,
    schema: &str,
    unlogged: bool,
) -> Result<bool, tokio_postgres::Error> {
    let s = quoted(schema);
    // no error when there is no such table: an error would abort the migration's transaction
    let exists = client
        .query_one(
            "SELECT to_regclass($1) IS NOT NULL",
            &[&format!("{s}.migrations")],
        )
        .await?;
    if !exists.try_get::<_, bool>(0)? {
        return Ok(false);
    }
    let version = format!("SELECT max(version) FROM {s}.migrations");
    let version: Option<i32> = client.query_one(&version, &[]).await?.try_get(0)?;
    if version.is_none_or(|v| v < SCHEMA_VERSION) {
        return Ok(false);
    }
    Ok(
        rate_tables_unlogged(client, schema).await? == Some(unlogged)
            && !version_1_functions(client, schema).await?,
    )
}

/// Whether a function of version 1 is in `schema`: its `claim` without a deadline, which every
/// migration of version 1 installs.
async fn version_1_functions(
    client: &impl GenericClient,
    schema: &str,
) -> Result<bool, tokio_postgres::Error> {
    let row = client
        .query_one(
            "SELECT EXISTS (
               SELECT 1 FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace
               WHERE n.nspname = $1 AND p.proname = 'claim' AND p.pronargs = 3
             )",
            &[&schema],
        )
        .await?;
    row.try_get(0)
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
    // another copy may have migrated while this one waited for the lock
    if is_current(tx, schema, unlogged).await? {
        return Ok(());
    }
    tx.batch_execute(&format!(
        "CREATE SCHEMA IF NOT EXISTS {s};
         CREATE TABLE IF NOT EXISTS {s}.migrations (
           version integer PRIMARY KEY,
           applied_at timestamptz NOT NULL DEFAULT now()
         )"
    ))
    .await?;
    let recorded = format!("SELECT max(version) FROM {s}.migrations");
    let recorded: Option<i32> = tx.query_one(&recorded, &[]).await?.try_get(0)?;
    let record = format!("INSERT INTO {s}.migrations (version) VALUES ($1) ON CONFLICT DO NOTHING");
    // the base runs whatever version the schema had (every statement of it is idempotent),
    // then each later file the schema has not recorded, in order
    for (version, sql) in migrations(schema, unlogged, recorded) {
        tx.batch_execute(&sql).await?;
        if version == MIGRATIONS_BASE {
            set_rate_persistence(tx, schema, unlogged).await?;
        }
        tx.execute(&record, &[&version]).await?;
    }
    Ok(())
}

/// Whether `rate_limits` in `schema` is `UNLOGGED`; `None` when there is no such table. Read
/// from the catalog: no lock on the table.
async fn rate_tables_unlogged(
    client: &impl GenericClient,
    schema: &str,
) -> Result<Option<bool>, tokio_postgres::Error> {
    unlogged(client, schema, "rate_limits").await
}

/// Whether `table` in `schema` is `UNLOGGED`; `None` when there is no such table.
async fn unlogged(
    client: &impl GenericClient,
    schema: &str,
    table: &str,
) -> Result<Option<bool>, tokio_postgres::Error> {
    let row = client
        .query_opt(
            "SELECT c.relpersistence FROM pg_class c
             JOIN pg_namespace n ON n.oid = c.relnamespace
             WHERE n.nspname = $1 AND c.relname = $2",
            &[&schema, &table],
        )
        .await?;
    let Some(row) = row else { return Ok(None) };
    let persistence: i8 = row.try_get(0)?;
    Ok(Some(persistence == b'u' as i8))
}

/// Makes the rate tables `UNLOGGED` or logged as asked, each that was created otherwise. A
/// logged table may not reference an unlogged one: the log follows its parent table when it
/// becomes logged, and goes first when they become unlogged; the attempt ledger references
/// none. (The migration holds the tables' locks already.)
async fn set_rate_persistence(
    tx: &Transaction<'_>,
    schema: &str,
    make_unlogged: bool,
) -> Result<(), tokio_postgres::Error> {
    let order: [&str; 3] = if make_unlogged {
        ["rate_log", "rate_limits", "rate_attempts"]
    } else {
        ["rate_limits", "rate_log", "rate_attempts"]
    };
    let s = quoted(schema);
    let set = if make_unlogged { "UNLOGGED" } else { "LOGGED" };
    for table in order {
        if unlogged(tx, schema, table).await? == Some(!make_unlogged) {
            tx.batch_execute(&format!("ALTER TABLE {s}.{table} SET {set}"))
                .await?;
        }
    }
    Ok(())
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
