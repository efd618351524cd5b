//! `outbox.journal` (sql/journal.sql): the delivery journal's batched write (`run
//! --journal`, see [`crate::pipeline`]'s journal writer) and its lookup (`pgoutbox journal
//! MESSAGE_ID`).

use serde::Serialize;
use tokio_postgres::Client;

use crate::error::Error;
use crate::lsn::Lsn;
use crate::outbox_schema::SchemaName;

/// The journal's table, installed by `setup`.
pub const JOURNAL_SQL: &str = include_str!("../../sql/journal.sql");

/// One confirmed delivery, as the streamer records it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JournalEntry {
    /// The message id (the AMQP `message_id`).
    pub message_id: String,
    /// The topic (the routing key).
    pub topic: String,
    /// The message's own LSN.
    pub lsn: Lsn,
    /// Its transaction's commit record LSN.
    pub commit_lsn: Lsn,
    /// The exchange it was published to.
    pub exchange: String,
    /// Publish attempts of this delivery.
    pub attempts: u32,
    /// When the broker's confirm arrived, µs since the Unix epoch.
    pub confirmed_at_us: i64,
}

/// Inserts `entries` for `slot` in ONE statement (`INSERT ... SELECT FROM unnest(...)`, one
/// array per column, so any number of rows is one round trip and one parse).
///
/// # Errors
/// [`Error::Sql`] when the insert fails (table missing, permission, timeout, connection).
pub async fn write_journal(
    client: &Client,
    schema: &SchemaName,
    slot: &str,
    entries: &[JournalEntry],
) -> Result<u64, Error> {
    let ids: Vec<&str> = entries.iter().map(|e| e.message_id.as_str()).collect();
    let topics: Vec<&str> = entries.iter().map(|e| e.topic.as_str()).collect();
    let lsns: Vec<String> = entries.iter().map(|e| e.lsn.to_string()).collect();
    let commits: Vec<String> = entries.iter().map(|e| e.commit_lsn.to_string()).collect();
    let attempts: Vec<i32> = entries
        .iter()
        .map(|e| i32::try_from(e.attempts).unwrap_or(i32::MAX))
        .collect();
    let confirmed: Vec<i64> = entries.iter().map(|e| e.confirmed_at_us).collect();
    let exchanges: Vec<&str> = entries.iter().map(|e| e.exchange.as_str()).collect();
    client
        .execute(
            &*schema.rewrite("INSERT INTO outbox.journal (message_id, topic, exchange, lsn, commit_lsn, attempts, confirmed_at, slot_name)
             SELECT m, t, x, l::pg_lsn, c::pg_lsn, a, timestamptz 'epoch' + us * interval '1 microsecond', $7::text
             FROM unnest($1::text[], $2::text[], $3::text[], $4::text[], $5::int[], $6::bigint[], $8::text[]) AS u(m, t, l, c, a, us, x)"),
            &[&ids, &topics, &lsns, &commits, &attempts, &confirmed, &slot, &exchanges],
        )
        .await
        .map_err(|e| Error::sql("writing the delivery journal (outbox.journal)", e))
}

/// A journal row, as `pgoutbox journal` prints it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct JournalRow {
    /// The message id.
    pub message_id: String,
    /// The topic.
    pub topic: String,
    /// The exchange it was published to; none for rows written before the column existed.
    pub exchange: Option<String>,
    /// The message's LSN (`X/Y`).
    pub lsn: String,
    /// The commit record's LSN (`X/Y`).
    pub commit_lsn: String,
    /// Publish attempts of this delivery.
    pub attempts: i32,
    /// Confirm time, RFC 3339 in UTC with microseconds.
    pub confirmed_at: String,
    /// The streamer's slot.
    pub slot_name: String,
}

/// Every journal row of `message_id`, oldest confirm first (several after redeliveries).
///
/// # Errors
/// [`Error::Precondition`] when `outbox.journal` does not exist (run `setup`);
/// [`Error::Sql`] otherwise.
pub async fn journal_entries(
    client: &Client,
    schema: &SchemaName,
    message_id: &str,
) -> Result<Vec<JournalRow>, Error> {
    let exists: bool = client
        .query_one(
            &*schema.rewrite("SELECT to_regclass('outbox.journal') IS NOT NULL"),
            &[],
        )
        .await
        .map_err(|e| Error::sql("looking for outbox.journal", e))?
        .get(0);
    if !exists {
        return Err(Error::Precondition(
            "table outbox.journal does not exist in this database: run `pgoutbox setup`, then `pgoutbox run --journal` records confirmed messages".into(),
        ));
    }
    let rows = client
        .query(
            &*schema.rewrite(
                "SELECT message_id, topic, lsn::text, commit_lsn::text, attempts,
                    to_char(confirmed_at AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS.US\"Z\"'),
                    slot_name, exchange
             FROM outbox.journal WHERE message_id = $1
             ORDER BY confirmed_at, lsn",
            ),
            &[&message_id],
        )
        .await
        .map_err(|e| Error::sql("reading outbox.journal", e))?;
    Ok(rows
        .into_iter()
        .map(|r| JournalRow {
            message_id: r.get(0),
            topic: r.get(1),
            lsn: r.get(2),
            commit_lsn: r.get(3),
            attempts: r.get(4),
            confirmed_at: r.get(5),
            slot_name: r.get(6),
            exchange: r.get(7),
        })
        .collect())
}
