//! Retention: deleting expired rows of pgoutbox's own tables in small batches.
//!
//! Three tables grow without bound unless trimmed: `outbox.idempotency` (one key per
//! idempotent emit), `outbox.journal` (`run --journal`) and, on the consumer side,
//! `outbox.inbox` (sql/inbox.sql, trimmed through its own `outbox.inbox_purge`). `run`'s
//! retention task and `pgoutbox maintenance` both call [`purge`].
//!
//! Each statement deletes at most `batch` rows (found through the table's time index, then
//! deleted by `ctid`), and the caller's `pause` passes between two statements: no long
//! transaction, no long lock, no burst of WAL, and autovacuum keeps up. A pass ends with
//! the first batch that deleted fewer rows than `batch`.

use std::time::Duration;

use tokio_postgres::Client;

use crate::config::Retention;
use crate::error::Error;
use crate::outbox_schema::SchemaName;

/// A table that retention trims.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Purgeable {
    /// `outbox.idempotency`, by `created_at`.
    IdempotencyKeys,
    /// `outbox.journal`, by `confirmed_at`.
    Journal,
    /// `outbox.inbox`, through `outbox.inbox_purge(interval, integer)` (sql/inbox.sql).
    Inbox,
}

impl Purgeable {
    /// What it is, for logs and `maintenance`'s output.
    pub fn describe(self) -> &'static str {
        match self {
            Purgeable::IdempotencyKeys => "idempotency keys (outbox.idempotency)",
            Purgeable::Journal => "journal rows (outbox.journal)",
            Purgeable::Inbox => "inbox records (outbox.inbox)",
        }
    }

    /// [`Purgeable::describe`] naming the tables of the outbox in `schema` (`--schema`).
    pub fn describe_in(self, schema: &SchemaName) -> String {
        self.in_schema(schema, self.describe()).into_owned()
    }

    /// A short label (metrics, log fields).
    pub fn label(self) -> &'static str {
        match self {
            Purgeable::IdempotencyKeys => "idempotency",
            Purgeable::Journal => "journal",
            Purgeable::Inbox => "inbox",
        }
    }

    /// Whether its table or function is installed: the `to_regclass` or
    /// `to_regprocedure` probe.
    fn probe(self) -> &'static str {
        match self {
            Purgeable::IdempotencyKeys => "SELECT to_regclass('outbox.idempotency') IS NOT NULL",
            Purgeable::Journal => "SELECT to_regclass('outbox.journal') IS NOT NULL",
            Purgeable::Inbox => {
                "SELECT to_regprocedure('outbox.inbox_purge(interval, integer)') IS NOT NULL"
            }
        }
    }

    /// One batch: `$1` the retention in milliseconds (bigint), `$2` the batch size (int);
    /// returns the rows deleted (bigint).
    fn batch_sql(self) -> &'static str {
        match self {
            Purgeable::IdempotencyKeys => {
                "WITH gone AS (DELETE FROM outbox.idempotency WHERE ctid = ANY (ARRAY(
                     SELECT ctid FROM outbox.idempotency
                     WHERE created_at < now() - $1::bigint * interval '1 millisecond'
                     LIMIT $2::int)) RETURNING 1)
                 SELECT count(*) FROM gone"
            }
            Purgeable::Journal => {
                "WITH gone AS (DELETE FROM outbox.journal WHERE ctid = ANY (ARRAY(
                     SELECT ctid FROM outbox.journal
                     WHERE confirmed_at < now() - $1::bigint * interval '1 millisecond'
                     LIMIT $2::int)) RETURNING 1)
                 SELECT count(*) FROM gone"
            }
            Purgeable::Inbox => {
                "SELECT coalesce(outbox.inbox_purge($1::bigint * interval '1 millisecond', $2::int), 0)::bigint"
            }
        }
    }

    /// `sql` for the outbox in `schema` (`--schema`): the idempotency keys and the journal
    /// live in each outbox's schema; the inbox is consumer-side, always in `outbox`.
    fn in_schema<'a>(self, schema: &SchemaName, sql: &'a str) -> std::borrow::Cow<'a, str> {
        match self {
            Purgeable::Inbox => std::borrow::Cow::Borrowed(sql),
            Purgeable::IdempotencyKeys | Purgeable::Journal => schema.rewrite(sql),
        }
    }

    /// What to do when it is not installed.
    pub fn missing_note(self) -> &'static str {
        match self {
            Purgeable::IdempotencyKeys | Purgeable::Journal => {
                "its table does not exist; run `pgoutbox setup` to create it"
            }
            Purgeable::Inbox => {
                "outbox.inbox_purge(interval, integer) does not exist (sql/inbox.sql is not installed in this database)"
            }
        }
    }
}

/// The outcome of one [`purge`] pass.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Purged {
    /// The retention is off (`0`): nothing was looked at.
    Off,
    /// The table (or the inbox's purge function) is not installed: skipped.
    Missing,
    /// Rows deleted, over this many statements.
    Deleted {
        /// Rows deleted in all.
        rows: u64,
        /// Statements run (the last deleted fewer than the batch size).
        batches: u32,
    },
}

/// Deletes the rows of `table` older than `retention`, at most `batch` per statement with
/// `pause` between two statements, until a statement deletes fewer than `batch`.
///
/// Each statement commits on its own (autocommit), so a pass interrupted (by an error, or
/// by dropping the future) keeps what it deleted.
///
/// # Errors
/// [`Error::Sql`] naming the table when the probe or a delete fails (permission, lock or
/// statement timeout, lost connection).
pub async fn purge(
    client: &Client,
    schema: &SchemaName,
    table: Purgeable,
    retention: Retention,
    batch: u32,
    pause: Duration,
) -> Result<Purged, Error> {
    let Some(age) = retention.age() else {
        return Ok(Purged::Off);
    };
    let context = || format!("deleting expired {}", table.describe_in(schema));
    let installed: bool = client
        .query_one(&*table.in_schema(schema, table.probe()), &[])
        .await
        .map_err(|e| Error::sql(context(), e))?
        .get(0);
    if !installed {
        return Ok(Purged::Missing);
    }
    let age_ms = i64::try_from(age.as_millis()).unwrap_or(i64::MAX);
    let batch_size = i32::try_from(batch.max(1)).unwrap_or(i32::MAX);
    let statement = client
        .prepare(&table.in_schema(schema, table.batch_sql()))
        .await
        .map_err(|e| Error::sql(context(), e))?;
    let mut rows = 0u64;
    let mut batches = 0u32;
    loop {
        let deleted: i64 = client
            .query_one(&statement, &[&age_ms, &batch_size])
            .await
            .map_err(|e| Error::sql(context(), e))?
            .get(0);
        batches += 1;
        let deleted = u64::try_from(deleted).unwrap_or(0);
        rows += deleted;
        if deleted < u64::from(batch.max(1)) {
            return Ok(Purged::Deleted { rows, batches });
        }
        tokio::time::sleep(pause).await;
    }
}
