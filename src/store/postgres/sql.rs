//! The statements of one schema: each operation is one call of a function that `schema.sql`
//! installs.

use crate::error::{ConfigError, ConfigErrorKind};

/// The schema unless configured otherwise.
pub(super) const DEFAULT_SCHEMA: &str = "tollgate";

/// The migration: tables, indexes and functions (see the file's header).
const SCHEMA_SQL: &str = include_str!("schema.sql");

/// The version `schema.sql` brings a schema to, recorded in its `migrations` table.
pub(super) const SCHEMA_VERSION: i32 = 9;

/// Checks a schema name: 1 to 63 lowercase ASCII letters, digits and `_`, not starting with a
/// digit — a name PostgreSQL takes as it is, quoted or not.
pub(super) fn check_schema(schema: &str) -> Result<(), ConfigError> {
    let valid = !schema.is_empty()
        && schema.len() <= 63
        && !schema.starts_with(|c: char| c.is_ascii_digit())
        && schema
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_');
    if valid {
        Ok(())
    } else {
        Err(ConfigError::new(
            ConfigErrorKind::Store,
            format!(
                "invalid PostgreSQL schema {schema:?}: use 1 to 63 lowercase ASCII letters, digits or '_', not starting with a digit"
            ),
        ))
    }
}

/// The migration for `schema` (checked), its rate tables `UNLOGGED` or not.
pub(super) fn migration(schema: &str, unlogged: bool) -> String {
    SCHEMA_SQL
        .replace("__SCHEMA__", &quoted(schema))
        .replace("__RATE_TABLES__", if unlogged { "UNLOGGED" } else { "" })
}

/// `"schema"`: a checked name needs no escaping.
pub(super) fn quoted(schema: &str) -> String {
    format!("\"{schema}\"")
}

/// Every statement the store sends, for one schema. A write's last parameter is its deadline on
/// the database clock (see `call.rs`).
#[derive(Debug)]
pub(super) struct Sql {
    pub(super) decide_rates: String,
    pub(super) reset_rate: String,
    /// A notification on `$1` with payload `$2`, in a transaction of its own.
    pub(super) notify: String,
    pub(super) claim: String,
    pub(super) lock_acquire: String,
    pub(super) extend_hold: String,
    pub(super) release_hold: String,
    pub(super) once_lookup: String,
    pub(super) once_record: String,
    pub(super) permit_acquire: String,
    pub(super) permit_extend: String,
    pub(super) permit_release: String,
    pub(super) idem_begin: String,
    pub(super) idem_complete: String,
    pub(super) idem_release: String,
    pub(super) idem_extend: String,
    /// Reads only: a lock (`$1`) and its fencing counter (`$2`).
    pub(super) lock_state: String,
    /// Reads only: the permits of `$1` in use, and its waiters.
    pub(super) permit_usage: String,
    /// Reads only: idempotency record `$1`.
    pub(super) idem_state: String,
    pub(super) purge_expired: String,
    pub(super) ping: String,
    pub(super) now: String,
}

impl Sql {
    pub(super) fn new(schema: &str) -> Self {
        let s = quoted(schema);
        Self {
            decide_rates: format!(
                "SELECT {s}.decide_rates($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15)"
            ),
            // the notification ($2, $3) goes out when the reset commits
            reset_rate: format!("SELECT {s}.reset_rate($1, $2, $3, $4)"),
            notify: "SELECT 1 FROM pg_notify($1, $2)".to_owned(),
            claim: format!("SELECT * FROM {s}.claim($1, $2, $3, $4)"),
            lock_acquire: format!("SELECT * FROM {s}.lock_acquire($1, $2, $3, $4, $5, $6)"),
            extend_hold: format!("SELECT {s}.extend_hold($1, $2, $3, $4)"),
            release_hold: format!("SELECT {s}.release_hold($1, $2, $3, $4)"),
            once_lookup: format!(
                "SELECT fingerprint, output FROM {s}.once_records \
                 WHERE key = $1 AND expires_at > {s}.now_us()"
            ),
            once_record: format!(
                "INSERT INTO {s}.once_records (key, fingerprint, output, expires_at) \
                 VALUES ($1, $2, $3, {s}.now_us() + $4::bigint * 1000) \
                 ON CONFLICT (key) DO UPDATE SET fingerprint = EXCLUDED.fingerprint, \
                 output = EXCLUDED.output, expires_at = EXCLUDED.expires_at"
            ),
            permit_acquire: format!(
                "SELECT * FROM {s}.permit_acquire($1, $2, $3, $4, $5, $6, $7, $8)"
            ),
            permit_extend: format!("SELECT {s}.permit_extend($1, $2, $3, $4)"),
            permit_release: format!("SELECT {s}.permit_release($1, $2, $3, $4)"),
            idem_begin: format!("SELECT * FROM {s}.idem_begin($1, $2, $3, $4, $5)"),
            idem_complete: format!("SELECT {s}.idem_complete($1, $2, $3, $4, $5)"),
            idem_release: format!("SELECT {s}.idem_release($1, $2, $3, $4)"),
            idem_extend: format!("SELECT {s}.idem_extend($1, $2, $3, $4)"),
            lock_state: format!(
                "SELECT h.holder, CASE WHEN h.expires_at IS NULL THEN -1 \
                 ELSE (h.expires_at - n.now) / 1000 END, f.last \
                 FROM (SELECT {s}.now_us() AS now) n \
                 LEFT JOIN {s}.holds h ON h.key = $1 \
                 AND (h.expires_at IS NULL OR h.expires_at > n.now) \
                 LEFT JOIN {s}.fences f ON f.key = $2 AND f.expires_at > n.now"
            ),
            permit_usage: format!(
                "SELECT coalesce((SELECT array_agg((p.expires_at - n.now) / 1000 \
                 ORDER BY p.expires_at) FROM {s}.permits p \
                 WHERE p.key = $1 AND p.expires_at > n.now), '{{}}'::bigint[]), \
                 (SELECT count(*) FROM {s}.permit_queue q \
                 WHERE q.key = $1 AND q.expires_at > n.now) \
                 FROM (SELECT {s}.now_us() AS now) n"
            ),
            idem_state: format!(
                "SELECT i.done, i.response, (i.expires_at - n.now) / 1000, \
                 (n.now - (to_jsonb(i) ->> 'created_at')::bigint) / 1000 \
                 FROM (SELECT {s}.now_us() AS now) n \
                 LEFT JOIN {s}.idempotency i ON i.key = $1 AND i.expires_at > n.now"
            ),
            purge_expired: format!("SELECT * FROM {s}.purge_expired($1)"),
            ping: "SELECT 1".to_owned(),
            now: format!("SELECT {s}.now_us()"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn schema_names_are_plain_identifiers() {
        for good in ["tollgate", "t_1", "_x", &"a".repeat(63)] {
            assert!(check_schema(good).is_ok(), "{good}");
        }
        for bad in ["", "1t", "Tollgate", "a-b", "a\"b", "a;b", &"a".repeat(64)] {
            assert!(check_schema(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn the_migration_names_the_schema_everywhere() {
        let sql = migration("app_limits", true);
        assert!(!sql.contains("__SCHEMA__") && !sql.contains("__RATE_TABLES__"));
        assert!(sql.contains("CREATE UNLOGGED TABLE IF NOT EXISTS \"app_limits\".rate_limits"));
        assert!(sql.contains("CREATE TABLE IF NOT EXISTS \"app_limits\".holds"));
        let logged = migration("app_limits", false);
        assert!(!logged.contains("UNLOGGED TABLE"));
    }
}
