//! Advisory locks for work inside one transaction: `pg_advisory_xact_lock` keyed by a 64-bit
//! digest of a lock name.

use sha2::{Digest, Sha256};
use tokio_postgres::Transaction;

use super::PgStore;

impl PgStore {
    /// The advisory-lock key of lock `name`: the first 8 bytes of a SHA-256 digest of the name
    /// (in a domain of its own), so that any name, of any length, maps to one `bigint`.
    /// Distinct names collide with a probability of about 2^-64 per pair; advisory locks are
    /// per database, so two schemas using one name share its lock.
    ///
    /// ```
    /// use tollgate::store::PgStore;
    ///
    /// assert_eq!(PgStore::advisory_key("nightly-report"), PgStore::advisory_key("nightly-report"));
    /// assert_ne!(PgStore::advisory_key("nightly-report"), PgStore::advisory_key("weekly-report"));
    /// ```
    pub fn advisory_key(name: impl AsRef<[u8]>) -> i64 {
        let digest = Sha256::new()
            .chain_update(b"tollgate advisory lock\0")
            .chain_update(name.as_ref())
            .finalize();
        let mut head = [0u8; 8];
        head.copy_from_slice(&digest[..8]);
        i64::from_be_bytes(head)
    }

    /// Takes advisory lock `name` for the rest of transaction `tx`, waiting while another
    /// transaction holds it (`pg_advisory_xact_lock`). Released by the commit or rollback,
    /// never before; there is no lease and no fencing token (see
    /// [row lock or advisory lock](PgStore#row-lock-or-advisory-lock)). The wait is bounded
    /// only by the session's `lock_timeout` / `statement_timeout`.
    ///
    /// ```no_run
    /// # async fn run(pool: deadpool_postgres::Pool) -> Result<(), Box<dyn std::error::Error>> {
    /// use tollgate::store::PgStore;
    ///
    /// let mut client = pool.get().await?;
    /// let tx = client.transaction().await?;
    /// PgStore::advisory_xact_lock(&tx, "invoice:2024-117").await?;
    /// // ... read, decide and write: no other transaction holding this lock runs meanwhile
    /// tx.commit().await?; // releases the lock
    /// # Ok(()) }
    /// ```
    pub async fn advisory_xact_lock(
        tx: &Transaction<'_>,
        name: impl AsRef<[u8]>,
    ) -> Result<(), tokio_postgres::Error> {
        tx.execute(
            "SELECT pg_advisory_xact_lock($1)",
            &[&Self::advisory_key(name)],
        )
        .await
        .map(drop)
    }

    /// Takes advisory lock `name` for the rest of transaction `tx` if it is free
    /// (`pg_try_advisory_xact_lock`): `true` when taken, `false` at once when another
    /// transaction holds it. Released as [`advisory_xact_lock`](Self::advisory_xact_lock).
    pub async fn try_advisory_xact_lock(
        tx: &Transaction<'_>,
        name: impl AsRef<[u8]>,
    ) -> Result<bool, tokio_postgres::Error> {
        let row = tx
            .query_one(
                "SELECT pg_try_advisory_xact_lock($1)",
                &[&Self::advisory_key(name)],
            )
            .await?;
        row.try_get(0)
    }
}
