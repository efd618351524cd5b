//! The slot's state (`status`), the pre-flight checks `run` makes before it takes the slot,
//! and the outbox messages a slot still holds.

use serde::Serialize;
use tokio_postgres::Client;

use crate::error::Error;
use crate::lsn::Lsn;

use super::provisioning::{check_replication_role, check_wal_level, publication_exists};

/// One slot as `status` shows it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct SlotStatus {
    /// Slot name.
    pub slot: String,
    /// Whether a walsender holds it.
    pub active: bool,
    /// The holder's pid.
    pub active_pid: Option<i32>,
    /// The holder's `application_name` (carries the instance id of a pgoutbox holder).
    pub holder: Option<String>,
    /// Position up to which the consumer acknowledged, `X/Y`.
    pub confirmed_flush_lsn: Option<String>,
    /// Bytes of WAL between `confirmed_flush_lsn` and the current WAL position.
    pub lag_bytes: Option<i64>,
    /// `reserved`, `extended`, `unreserved` or `lost`.
    pub wal_status: Option<String>,
    /// Output plugin.
    pub plugin: Option<String>,
}

/// Reads one slot's status.
///
/// # Errors
/// [`Error::Precondition`] when the slot does not exist; [`Error::Sql`].
pub async fn slot_status(client: &Client, slot: &str) -> Result<SlotStatus, Error> {
    let row = client
        .query_opt(
            "SELECT s.slot_name::text, s.active, s.active_pid, r.application_name::text,
                    s.confirmed_flush_lsn::text,
                    pg_wal_lsn_diff(pg_current_wal_lsn(), s.confirmed_flush_lsn)::bigint,
                    s.wal_status, s.plugin::text
             FROM pg_replication_slots s
             LEFT JOIN pg_stat_replication r ON r.pid = s.active_pid
             WHERE s.slot_name = $1",
            &[&slot],
        )
        .await
        .map_err(|e| Error::sql("reading pg_replication_slots", e))?
        .ok_or_else(|| {
            Error::Precondition(format!(
                "replication slot {slot:?} does not exist; run `pgoutbox setup --slot {slot}` first (messages emitted before the slot exists are never delivered)"
            ))
        })?;
    Ok(SlotStatus {
        slot: row.get(0),
        active: row.get(1),
        active_pid: row.get(2),
        holder: row.get(3),
        confirmed_flush_lsn: row.get(4),
        lag_bytes: row.get(5),
        wal_status: row.get(6),
        plugin: row.get(7),
    })
}

/// The slot's `confirmed_flush_lsn`.
///
/// # Errors
/// As [`slot_status`]; [`Error::Precondition`] when it is NULL or not an LSN.
pub async fn confirmed_flush_lsn(client: &Client, slot: &str) -> Result<Lsn, Error> {
    let status = slot_status(client, slot).await?;
    status
        .confirmed_flush_lsn
        .as_deref()
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| {
            Error::Precondition(format!(
                "slot {slot:?} has no confirmed_flush_lsn; is it a logical slot?"
            ))
        })
}

/// Checks that `run` can work: `wal_level`, the role's `REPLICATION` attribute, slot
/// exists with pgoutput and is not lost, publication exists (a misspelled publication is
/// otherwise only rejected when the first table change is decoded), and the role may write
/// dead letters ([`check_dead_letter_privileges`]), so that a least-privilege streamer fails
/// here, up front, instead of at its first dead letter while it holds the stream.
///
/// # Errors
/// [`Error::Precondition`] (definite, with the fix: `ALTER ROLE`, `setup`, the `GRANT`s),
/// [`Error::SlotLost`], [`Error::Sql`].
pub async fn preflight(
    client: &Client,
    slot: &str,
    publication: &str,
) -> Result<SlotStatus, Error> {
    check_wal_level(client).await?;
    check_replication_role(client).await?;
    let status = slot_status(client, slot).await?;
    if status.plugin.as_deref() != Some("pgoutput") {
        return Err(Error::Precondition(format!(
            "slot {slot:?} uses plugin {}; pgoutbox needs pgoutput: pick another --slot, or drop it (SELECT pg_drop_replication_slot('{slot}')) and recreate it with `pgoutbox setup --slot {slot}`",
            status.plugin.as_deref().unwrap_or("(none: a physical slot)")
        )));
    }
    if status.wal_status.as_deref() == Some("lost") {
        return Err(Error::SlotLost {
            slot: slot.to_owned(),
            confirmed_flush_lsn: status.confirmed_flush_lsn.clone().unwrap_or_default(),
        });
    }
    let exists = publication_exists(client, publication).await?;
    if !exists {
        return Err(Error::Precondition(format!(
            "publication {publication:?} does not exist in this database; run `pgoutbox setup --slot {slot} --publication {publication}` or fix --publication"
        )));
    }
    check_dead_letter_privileges(client, slot).await?;
    Ok(status)
}

/// The privileges `run` needs on what it writes, `outbox.dead_letter`, as the `GRANT`s that
/// give them (also in `sql/roles.example.sql`): `USAGE` on the schema, `INSERT` on the table
/// plus `SELECT` (the insert's `ON CONFLICT (lsn)` check reads it), and `USAGE` on its id
/// sequence (`bigserial` calls `nextval`). `role` is quoted as an identifier.
pub fn dead_letter_grants(role: &str, sequence: &str) -> [String; 3] {
    let role = format!("\"{}\"", role.replace('"', "\"\""));
    [
        format!("GRANT USAGE ON SCHEMA outbox TO {role};"),
        format!("GRANT SELECT, INSERT ON outbox.dead_letter TO {role};"),
        format!("GRANT USAGE ON SEQUENCE {sequence} TO {role};"),
    ]
}

/// Fails unless the connected role can write dead letters: `outbox.dead_letter` exists
/// (else run `setup`) and the role has every privilege of [`dead_letter_grants`].
///
/// The catalogs are read directly, so the check itself needs no privilege on `outbox`.
///
/// # Errors
/// [`Error::Precondition`] naming the role, what is missing and the complete `GRANT`s to
/// run; [`Error::Sql`].
pub async fn check_dead_letter_privileges(client: &Client, slot: &str) -> Result<(), Error> {
    let row = client
        .query_one(
            "SELECT current_user::text,
                    c.oid IS NOT NULL,
                    CASE WHEN n.oid IS NOT NULL THEN has_schema_privilege(n.oid, 'USAGE') END,
                    CASE WHEN c.oid IS NOT NULL THEN has_table_privilege(c.oid, 'INSERT') END,
                    CASE WHEN c.oid IS NOT NULL THEN has_table_privilege(c.oid, 'SELECT') END,
                    quote_ident(n.nspname) || '.' || quote_ident(sq.relname),
                    CASE WHEN sq.oid IS NOT NULL THEN has_sequence_privilege(sq.oid, 'USAGE') END
             FROM (SELECT 1) AS one
             LEFT JOIN pg_namespace n ON n.nspname = 'outbox'
             LEFT JOIN pg_class c ON c.relnamespace = n.oid AND c.relname = 'dead_letter'
             LEFT JOIN pg_attribute a ON a.attrelid = c.oid AND a.attname = 'id'
             LEFT JOIN pg_depend d ON d.refclassid = 'pg_class'::regclass AND d.refobjid = c.oid
                  AND d.refobjsubid = a.attnum AND d.classid = 'pg_class'::regclass
                  AND d.deptype IN ('a', 'i')
             LEFT JOIN pg_class sq ON sq.oid = d.objid AND sq.relkind = 'S'",
            &[],
        )
        .await
        .map_err(|e| Error::sql("checking the privileges on outbox.dead_letter", e))?;
    // Names are never looked up (that would need USAGE on the schema): only oids.
    let role: String = row.get(0);
    let table_exists: bool = row.get(1);
    if !table_exists {
        return Err(Error::Precondition(format!(
            "table outbox.dead_letter does not exist in this database; run `pgoutbox setup --slot {slot}` (as the database owner) first"
        )));
    }
    let sequence: Option<String> = row.get(5);
    let sequence = sequence.unwrap_or_else(|| "outbox.dead_letter_id_seq".into());
    // No sequence found (the table was changed by hand): nothing to check for it.
    let seq_usage = row.get::<_, Option<bool>>(6) != Some(false);
    let mut missing = Vec::new();
    if row.get::<_, Option<bool>>(2) != Some(true) {
        missing.push("USAGE on schema outbox".to_owned());
    }
    if row.get::<_, Option<bool>>(3) != Some(true) {
        missing.push("INSERT on outbox.dead_letter".to_owned());
    }
    if row.get::<_, Option<bool>>(4) != Some(true) {
        missing.push("SELECT on outbox.dead_letter".to_owned());
    }
    if !seq_usage {
        missing.push(format!("USAGE on sequence {sequence}"));
    }
    if missing.is_empty() {
        return Ok(());
    }
    Err(Error::Precondition(format!(
        "role {role:?} cannot write dead letters (missing {}); as the owner of schema outbox or a superuser, run: {} (sql/roles.example.sql grants the same)",
        missing.join(", "),
        dead_letter_grants(&role, &sequence).join(" ")
    )))
}

/// Counts outbox messages the slot still holds, without consuming them
/// (`pg_logical_slot_peek_binary_changes`, pgoutput `M` frames with our prefix).
///
/// # Errors
/// [`Error::Sql`] (for example when the slot is active).
pub async fn pending_outbox_messages(
    client: &Client,
    slot: &str,
    publication: &str,
) -> Result<i64, Error> {
    // Decoding only reads flushed WAL: with synchronous_commit = off a just-committed emit
    // may not be flushed yet. A synchronous commit of a transaction that wrote WAL flushes
    // everything before it (an empty message under another prefix, which `run` ignores).
    client
        .batch_execute(
            "BEGIN; SET LOCAL synchronous_commit = on; \
             SELECT pg_logical_emit_message(true, 'pgoutbox-teardown', ''); COMMIT;",
        )
        .await
        .map_err(|e| Error::sql("flushing WAL before peeking at the slot", e))?;
    // A pgoutput Message: 'M', Int8 flags, Int64 LSN, then the NUL-terminated prefix at
    // byte offset 10 (1-based 11).
    let row = client
        .query_one(
            "SELECT count(*) FROM pg_logical_slot_peek_binary_changes($1, NULL, NULL,
                'proto_version', '1', 'publication_names', $2, 'messages', 'true')
             WHERE get_byte(data, 0) = 77
               AND substring(data from 11 for 9) = convert_to('pgoutbox', 'UTF8') || '\\x00'::bytea",
            &[&slot, &publication],
        )
        .await
        .map_err(|e| Error::sql("peeking at the slot for unsent outbox messages", e))?;
    Ok(row.get(0))
}
