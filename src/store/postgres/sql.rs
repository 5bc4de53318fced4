//! The statements of one schema: each operation is one call of a function that the migrations
//! (`migrations/`) install.

use crate::error::{ConfigError, ConfigErrorKind};

/// The schema unless configured otherwise.
pub(super) const DEFAULT_SCHEMA: &str = "tollgate";

/// The migrations, in order, each with the version it brings a schema to and whether it runs
/// at every migration: the base (every version up to 9 in one idempotent file, run first at
/// every migration), then one file per later version, each run once — except one that
/// replaces functions of the base (idempotent too), which runs after the base every time, so
/// that the base never puts back what it replaced.
const MIGRATIONS: &[(i32, &str, bool)] = &[
    (9, include_str!("migrations/0009_base.sql"), true),
    (10, include_str!("migrations/0010_limits.sql"), false),
    (11, include_str!("migrations/0011_calls.sql"), true),
    (12, include_str!("migrations/0012_lines.sql"), false),
];

/// The version of the base, the first migration.
pub(super) const MIGRATIONS_BASE: i32 = 9;

/// The version the migrations bring a schema to, recorded in its `migrations` table.
pub(super) const SCHEMA_VERSION: i32 = 12;

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

/// The migrations a schema at version `recorded` (`None`: none recorded) runs, for `schema`
/// (checked) with its rate tables `UNLOGGED` or not: the base, then each later file it has not
/// recorded, in order, each with its version.
pub(super) fn migrations(
    schema: &str,
    unlogged: bool,
    recorded: Option<i32>,
) -> impl Iterator<Item = (i32, String)> {
    let s = quoted(schema);
    MIGRATIONS
        .iter()
        .filter(move |(version, _, always)| *always || recorded.is_none_or(|r| *version > r))
        .map(move |(version, sql, _)| {
            let sql = sql
                .replace("__SCHEMA__", &s)
                .replace("__RATE_TABLES__", if unlogged { "UNLOGGED" } else { "" });
            (*version, sql)
        })
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
    /// A waiter (`$2`) lines up in line `$1`, its place kept `$3` ms.
    pub(super) line_up: String,
    /// A waiter (`$2`) leaves line `$1`.
    pub(super) leave_line: String,
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
    /// A table of limits (`$1`): its version and text, both `NULL` when there is none.
    pub(super) limits_load: String,
    pub(super) limits_save: String,
    /// The changes of a table of limits (`$1`), the newest first: four arrays in one row.
    pub(super) limits_history: String,
    pub(super) limits_register: String,
    /// The copies of a layer (`$1`) alive: three arrays (id, ms left, built) in one row.
    pub(super) limits_copies: String,
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
            line_up: format!("SELECT {s}.line_up($1, $2, $3, $4)"),
            leave_line: format!("SELECT {s}.leave_line($1, $2)"),
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
            limits_load: format!(
                "SELECT t.version, t.doc FROM (SELECT 1) o \
                 LEFT JOIN {s}.limit_tables t ON t.namespace = $1"
            ),
            limits_save: format!("SELECT {s}.limits_save($1, $2, $3, $4, $5, $6)"),
            limits_register: format!("SELECT {s}.limits_register($1, $2, $3, $4)"),
            limits_copies: format!(
                "SELECT coalesce(array_agg(c.copy ORDER BY c.copy), '{{}}'), \
                 coalesce(array_agg((c.until_us - n.now) / 1000 ORDER BY c.copy), '{{}}'), \
                 coalesce(array_agg(c.built ORDER BY c.copy), '{{}}') \
                 FROM (SELECT {s}.now_us() AS now) n \
                 LEFT JOIN {s}.limit_copies c ON c.namespace = $1 AND c.until_us > n.now"
            ),
            limits_history: format!(
                "SELECT coalesce(array_agg(version ORDER BY version DESC), '{{}}'), \
                 coalesce(array_agg(at_ms ORDER BY version DESC), '{{}}'), \
                 coalesce(array_agg(note ORDER BY version DESC), '{{}}'), \
                 coalesce(array_agg(doc ORDER BY version DESC), '{{}}') \
                 FROM {s}.limit_changes WHERE namespace = $1"
            ),
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
    fn the_migrations_name_the_schema_everywhere() {
        let all = |unlogged, recorded| -> Vec<(i32, String)> {
            migrations("app_limits", unlogged, recorded).collect()
        };
        let fresh = all(true, None);
        let versions: Vec<i32> = fresh.iter().map(|(v, _)| *v).collect();
        assert_eq!(versions, [9, 10, 11, 12]);
        assert_eq!(*versions.last().unwrap_or(&0), SCHEMA_VERSION);
        let sql: String = fresh.into_iter().map(|(_, sql)| sql).collect();
        assert!(!sql.contains("__SCHEMA__") && !sql.contains("__RATE_TABLES__"));
        assert!(sql.contains("CREATE UNLOGGED TABLE IF NOT EXISTS \"app_limits\".rate_limits"));
        assert!(sql.contains("CREATE TABLE IF NOT EXISTS \"app_limits\".holds"));
        assert!(sql.contains("CREATE TABLE IF NOT EXISTS \"app_limits\".limit_tables"));
        let logged: String = all(false, None).into_iter().map(|(_, sql)| sql).collect();
        assert!(!logged.contains("UNLOGGED TABLE"));
        // the base runs every time, and so does a file that replaces its functions; a later
        // file once
        let versions = |recorded| {
            all(false, recorded)
                .iter()
                .map(|(v, _)| *v)
                .collect::<Vec<_>>()
        };
        assert_eq!(versions(Some(3)), [9, 10, 11, 12]);
        assert_eq!(versions(Some(9)), [9, 10, 11, 12]);
        assert_eq!(versions(Some(10)), [9, 11, 12]);
        assert_eq!(versions(Some(11)), [9, 11, 12]);
        assert_eq!(versions(Some(12)), [9, 11]);
    }
}
