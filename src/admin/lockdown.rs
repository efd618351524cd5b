//! `setup --lockdown` / `setup --unlock`, and reading the lockdown record (`run`, `status`,
//! `check`). What lockdown means for the stream: [`crate::lockdown`].

use serde::Serialize;
use tokio_postgres::Client;

use crate::error::Error;
use crate::lsn::Lsn;

/// `sql/lockdown.sql`: revoke `pg_logical_emit_message` from `PUBLIC`, helpers
/// `SECURITY DEFINER` of `pgoutbox_emitter`, marker and record. Idempotent.
pub const LOCKDOWN_SQL: &str = include_str!("../../sql/lockdown.sql");
/// `sql/unlock.sql`: undoes [`LOCKDOWN_SQL`]. Idempotent.
pub const UNLOCK_SQL: &str = include_str!("../../sql/unlock.sql");

/// The lockdown state of a database, as `status --json` prints it (field `lockdown`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct LockdownState {
    /// Whether `outbox.lockdown` holds a record (lockdown in effect).
    pub enabled: bool,
    /// The lockdown marker's LSN (`X/Y`): pgoutbox messages after it must come through the
    /// helpers. `None` without lockdown.
    pub enabled_at_lsn: Option<String>,
    /// When it was applied (RFC 3339 UTC).
    pub enabled_at: Option<String>,
    /// The session user that applied it.
    pub enabled_by: Option<String>,
    /// Whether `PUBLIC` may execute some overload of `pg_logical_emit_message` (true by
    /// default; false after `setup --lockdown`). `None` when it could not be read.
    pub public_can_emit: Option<bool>,
}

impl LockdownState {
    /// The recorded lockdown LSN, parsed.
    #[must_use]
    pub fn since(&self) -> Option<Lsn> {
        self.enabled_at_lsn.as_deref().and_then(|s| s.parse().ok())
    }

    /// One line for `status` and `check`.
    #[must_use]
    pub fn describe(&self) -> String {
        let public = match self.public_can_emit {
            Some(true) => "PUBLIC may call pg_logical_emit_message",
            Some(false) => "pg_logical_emit_message is revoked from PUBLIC",
            None => "privileges of pg_logical_emit_message unknown",
        };
        if self.enabled {
            format!(
                "on since {} ({} by {}); {public}; outbox messages after that LSN not written by outbox.emit/emit_bytes are dead-lettered as forged (superusers can still write any message)",
                self.enabled_at_lsn.as_deref().unwrap_or("-"),
                self.enabled_at.as_deref().unwrap_or("-"),
                self.enabled_by.as_deref().unwrap_or("-"),
            )
        } else {
            format!("off; {public} (pgoutbox setup --lockdown restricts it to the helpers)")
        }
    }
}

/// Reads the lockdown record and the privileges of `pg_logical_emit_message`. A database
/// without `outbox.lockdown` (schema not installed, or installed by an older pgoutbox) has
/// no lockdown.
///
/// # Errors
/// [`Error::Sql`] when the table exists and cannot be read.
pub async fn lockdown_state(client: &Client) -> Result<LockdownState, Error> {
    let row = client
        .query_one(
            "SELECT to_regclass('outbox.lockdown') IS NOT NULL,
                    bool_or(has_function_privilege('public', p.oid, 'EXECUTE'))
               FROM pg_catalog.pg_proc p
              WHERE p.proname = 'pg_logical_emit_message'
                AND p.pronamespace = 'pg_catalog'::regnamespace",
            &[],
        )
        .await
        .map_err(|e| Error::sql("reading the privileges of pg_logical_emit_message", e))?;
    let (has_table, public_can_emit): (bool, Option<bool>) = (row.get(0), row.get(1));
    let mut state = LockdownState {
        public_can_emit,
        ..LockdownState::default()
    };
    if !has_table {
        return Ok(state);
    }
    let record = client
        .query_opt(
            "SELECT enabled_at_lsn::text,
                    to_char(enabled_at AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS\"Z\"'),
                    enabled_by
               FROM outbox.lockdown",
            &[],
        )
        .await
        .map_err(|e| Error::sql("reading outbox.lockdown", e))?;
    if let Some(r) = record {
        state.enabled = true;
        state.enabled_at_lsn = Some(r.get(0));
        state.enabled_at = Some(r.get(1));
        state.enabled_by = Some(r.get(2));
    }
    Ok(state)
}

/// Fails unless the session is a superuser: only a superuser (or the bootstrap superuser
/// that owns it) may change the privileges of `pg_catalog.pg_logical_emit_message`. `flag`
/// (`--lockdown` or `--unlock`) names what needs it.
///
/// # Errors
/// [`Error::Precondition`] naming the role and the fix; [`Error::Sql`].
pub async fn require_superuser(client: &Client, flag: &str) -> Result<(), Error> {
    let row = client
        .query_one(
            "SELECT current_user::text, rolsuper FROM pg_roles WHERE rolname = current_user",
            &[],
        )
        .await
        .map_err(|e| Error::sql("reading the role's attributes", e))?;
    let (user, superuser): (String, bool) = (row.get(0), row.get(1));
    if !superuser {
        return Err(Error::Precondition(format!(
            "setup {flag} changes the privileges of pg_catalog.pg_logical_emit_message, which only a superuser may do, and role {user:?} is none; run `pgoutbox setup {flag}` with a superuser's --database-url (the streamer itself need not be one)"
        )));
    }
    Ok(())
}

/// Fails unless `schema` is the default outbox's: lockdown revokes
/// `pg_logical_emit_message` from `PUBLIC` in the whole database, so the (SECURITY INVOKER)
/// helpers of every other outbox would stop working for ordinary roles, and its record
/// (`outbox.lockdown`) and markers are the default outbox's. `flag` names what was asked.
///
/// # Errors
/// [`Error::Precondition`] naming the flag, the schema and what to do instead.
pub fn require_default_schema(
    schema: &crate::outbox_schema::SchemaName,
    flag: &str,
) -> Result<(), Error> {
    if schema.is_default() {
        return Ok(());
    }
    Err(Error::Precondition(format!(
        "setup {flag} is supported for the default outbox (schema {}) only, not with --schema {schema}: lockdown revokes pg_logical_emit_message in the whole database, which would leave the producers of schema {schema} without a way to emit; run setup {flag} without --schema (or with --schema {}), and only in a database whose producers all use that outbox",
        crate::outbox_schema::DEFAULT_SCHEMA,
        crate::outbox_schema::DEFAULT_SCHEMA
    )))
}

/// Runs `sql` in one transaction.
async fn in_transaction(client: &Client, sql: &str, what: &str) -> Result<(), Error> {
    client
        .batch_execute(&format!("BEGIN;\n{sql}\nCOMMIT;"))
        .await
        .map_err(|e| Error::sql(what.to_owned(), e))?;
    Ok(())
}

/// Applies `sql/lockdown.sql` (after `setup` installed `sql/outbox.sql`) and returns the
/// state after it. Idempotent: a second run keeps the first record and its LSN.
///
/// # Errors
/// [`Error::Precondition`] when the session is no superuser; [`Error::Sql`].
pub async fn lock(client: &Client) -> Result<LockdownState, Error> {
    require_superuser(client, "--lockdown").await?;
    in_transaction(client, LOCKDOWN_SQL, "applying sql/lockdown.sql").await?;
    lockdown_state(client).await
}

/// Applies `sql/unlock.sql` and returns the state after it. Idempotent.
///
/// # Errors
/// [`Error::Precondition`] when the session is no superuser; [`Error::Sql`].
pub async fn unlock(client: &Client) -> Result<LockdownState, Error> {
    require_superuser(client, "--unlock").await?;
    in_transaction(client, UNLOCK_SQL, "applying sql/unlock.sql").await?;
    lockdown_state(client).await
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::outbox_schema::SchemaName;

    #[test]
    fn lockdown_is_only_for_the_default_schema() {
        let billing = SchemaName::parse("--schema", "billing").unwrap();
        let e = require_default_schema(&billing, "--lockdown")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("--lockdown") && e.contains("billing") && e.contains("schema outbox"),
            "{e}"
        );
        assert!(require_default_schema(&SchemaName::default(), "--lockdown").is_ok());
    }
}
