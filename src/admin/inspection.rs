//! The slot's state (`status`), the pre-flight checks `run` makes before it takes the slot,
//! and the outbox messages a slot still holds.

use serde::Serialize;
use tokio_postgres::Client;

use crate::error::Error;
use crate::lsn::Lsn;
use crate::outbox_schema::{MessagePrefix, SchemaName};

use super::server::{check_replication_role, check_wal_level, publication_exists};

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

/// What a standby's SQL session is called while it stands by for a slot
/// (`application_name`, so [`standbys`] and a person reading `pg_stat_activity` see it):
/// this prefix, [`slot_tag`] of the slot, `:` and the standby's own `application_name`.
pub const STANDBY_APPLICATION_PREFIX: &str = "pgoutbox-standby:";

/// Eight hex digits naming a slot inside an `application_name` (FNV-1a, 32 bits): a slot
/// name of up to 63 bytes would not leave room for the standby's own name in the server's
/// 63 bytes.
pub fn slot_tag(slot: &str) -> String {
    let hash = slot.bytes().fold(0x811c_9dc5_u32, |h, b| {
        (h ^ u32::from(b)).wrapping_mul(0x0100_0193)
    });
    format!("{hash:08x}")
}

/// The `application_name` of a standby for `slot` whose replication sessions are called
/// `application_name`, cut to the server's 63 bytes (the end of a long instance id is cut).
pub fn standby_application_name(slot: &str, application_name: &str) -> String {
    let mut name = format!(
        "{STANDBY_APPLICATION_PREFIX}{}:{application_name}",
        slot_tag(slot)
    );
    let mut end = name.len().min(63);
    while !name.is_char_boundary(end) {
        end -= 1;
    }
    name.truncate(end);
    name
}

/// The standbys of `slot`: the `application_name` of each `run` process standing by for it
/// in this database (from `pg_stat_activity`), sorted; a name longer than 37 bytes shows
/// cut.
///
/// # Errors
/// [`Error::Sql`].
pub async fn standbys(client: &Client, slot: &str) -> Result<Vec<String>, Error> {
    let prefix = format!("{STANDBY_APPLICATION_PREFIX}{}:", slot_tag(slot));
    let rows = client
        .query(
            "SELECT substr(application_name, length($1) + 1) FROM pg_stat_activity
             WHERE datname = current_database() AND starts_with(application_name, $1)
             ORDER BY 1",
            &[&prefix],
        )
        .await
        .map_err(|e| Error::sql("reading pg_stat_activity", e))?;
    Ok(rows.iter().map(|r| r.get(0)).collect())
}

#[cfg(test)]
#[test]
fn standby_names_fit_and_name_the_slot() {
    assert_eq!(slot_tag("pgoutbox"), slot_tag("pgoutbox"));
    assert_ne!(slot_tag("pgoutbox"), slot_tag("pgoutbox2"));
    let long = "x".repeat(63);
    let name = standby_application_name(&long, &"é".repeat(40));
    assert!(name.len() <= 63, "{name}");
    assert!(name.starts_with(&format!("{STANDBY_APPLICATION_PREFIX}{}:", slot_tag(&long))));
    assert_eq!(
        standby_application_name("s", "pgoutbox-a"),
        format!("{STANDBY_APPLICATION_PREFIX}{}:pgoutbox-a", slot_tag("s"))
    );
}

/// Names this SQL session as a standby for `slot` (see [`standby_application_name`]).
///
/// # Errors
/// [`Error::Sql`].
pub async fn mark_standby(
    client: &Client,
    slot: &str,
    application_name: &str,
) -> Result<(), Error> {
    client
        .execute(
            "SELECT set_config('application_name', $1, false)",
            &[&standby_application_name(slot, application_name)],
        )
        .await
        .map_err(|e| Error::sql("setting application_name", e))?;
    Ok(())
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
    schema: &SchemaName,
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
    check_dead_letter_privileges(client, schema, slot).await?;
    Ok(status)
}

/// The privileges `run` needs on what it writes, `outbox.dead_letter` and
/// `outbox.stream_state`, as the `GRANT`s that give them (also in `sql/roles.example.sql`):
/// `USAGE` on the schema, `INSERT` on the table plus `SELECT` (the insert's
/// `ON CONFLICT (lsn)` check reads it), `USAGE` on its id sequence (`bigserial` calls
/// `nextval`), and `SELECT, INSERT, UPDATE` on the slot's history. `role` is quoted as an
/// identifier; the objects are those of `schema`.
pub fn dead_letter_grants(schema: &SchemaName, role: &str, sequence: &str) -> [String; 4] {
    let role = format!("\"{}\"", role.replace('"', "\"\""));
    [
        format!("GRANT USAGE ON SCHEMA outbox TO {role};"),
        format!("GRANT SELECT, INSERT ON outbox.dead_letter TO {role};"),
        format!("GRANT USAGE ON SEQUENCE {sequence} TO {role};"),
        format!("GRANT SELECT, INSERT, UPDATE ON outbox.stream_state TO {role};"),
    ]
    .map(|g| schema.rewrite(&g).into_owned())
}

/// Fails unless the connected role can write dead letters: `outbox.dead_letter` exists
/// (else run `setup`) and the role has every privilege of [`dead_letter_grants`].
///
/// The catalogs are read directly, so the check itself needs no privilege on `outbox`.
///
/// # Errors
/// [`Error::Precondition`] naming the role, what is missing and the complete `GRANT`s to
/// run; [`Error::Sql`].
pub async fn check_dead_letter_privileges(
    client: &Client,
    schema: &SchemaName,
    slot: &str,
) -> Result<(), Error> {
    let row = client
        .query_one(
            "SELECT current_user::text,
                    c.oid IS NOT NULL,
                    CASE WHEN n.oid IS NOT NULL THEN has_schema_privilege(n.oid, 'USAGE') END,
                    CASE WHEN c.oid IS NOT NULL THEN has_table_privilege(c.oid, 'INSERT') END,
                    CASE WHEN c.oid IS NOT NULL THEN has_table_privilege(c.oid, 'SELECT') END,
                    quote_ident(n.nspname) || '.' || quote_ident(sq.relname),
                    CASE WHEN sq.oid IS NOT NULL THEN has_sequence_privilege(sq.oid, 'USAGE') END,
                    CASE WHEN st.oid IS NOT NULL THEN
                        has_table_privilege(st.oid, 'SELECT') AND has_table_privilege(st.oid, 'INSERT')
                        AND has_table_privilege(st.oid, 'UPDATE') END
             FROM (SELECT 1) AS one
             LEFT JOIN pg_namespace n ON n.nspname = $1
             LEFT JOIN pg_class c ON c.relnamespace = n.oid AND c.relname = 'dead_letter'
             LEFT JOIN pg_attribute a ON a.attrelid = c.oid AND a.attname = 'id'
             LEFT JOIN pg_depend d ON d.refclassid = 'pg_class'::regclass AND d.refobjid = c.oid
                  AND d.refobjsubid = a.attnum AND d.classid = 'pg_class'::regclass
                  AND d.deptype IN ('a', 'i')
             LEFT JOIN pg_class sq ON sq.oid = d.objid AND sq.relkind = 'S'
             LEFT JOIN pg_class st ON st.relnamespace = n.oid AND st.relname = 'stream_state'",
            &[&schema.as_str()],
        )
        .await
        .map_err(|e| Error::sql(schema.rewrite("checking the privileges on outbox.dead_letter"), e))?;
    // Names are never looked up (that would need USAGE on the schema): only oids.
    let role: String = row.get(0);
    let table_exists: bool = row.get(1);
    if !table_exists {
        return Err(Error::Precondition(schema.rewrite(&format!(
            "table outbox.dead_letter does not exist in this database; run `pgoutbox setup --slot {slot}{}` (as the database owner) first",
            schema_flag(schema)
        )).into_owned()));
    }
    let sequence: Option<String> = row.get(5);
    let sequence = sequence.unwrap_or_else(|| schema.qualify("dead_letter_id_seq"));
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
    // No stream_state yet (a database set up by an older version): `run` creates it or
    // says to run setup (crate::stream_state::ensure_table).
    if row.get::<_, Option<bool>>(7) == Some(false) {
        missing.push("SELECT, INSERT, UPDATE on outbox.stream_state".to_owned());
    }
    if missing.is_empty() {
        return Ok(());
    }
    let missing = schema.rewrite(&missing.join(", ")).into_owned();
    Err(Error::Precondition(format!(
        "role {role:?} cannot write dead letters or the slot's history (missing {missing}); as the owner of schema {schema} or a superuser, run: {} (sql/roles.example.sql grants the same)",
        dead_letter_grants(schema, &role, &sequence).join(" ")
    )))
}

/// The privileges `run`'s background tasks need, as the `GRANT`s that give them (also in
/// `sql/roles.example.sql`): `SELECT, DELETE` on `outbox.idempotency` for
/// `--idempotency-retention`, `SELECT, INSERT, DELETE` on `outbox.journal` for `--journal`
/// (`INSERT`) and `--journal-retention` (`SELECT, DELETE`). `role` is quoted as an
/// identifier; the objects are those of `schema`.
pub fn background_grants(schema: &SchemaName, role: &str) -> [String; 2] {
    let role = format!("\"{}\"", role.replace('"', "\"\""));
    [
        format!("GRANT SELECT, DELETE ON outbox.idempotency TO {role};"),
        format!("GRANT SELECT, INSERT, DELETE ON outbox.journal TO {role};"),
    ]
    .map(|g| schema.rewrite(&g).into_owned())
}

/// Checks what `run`'s journal and retention task will write, before streaming starts.
///
/// With `journal` on, `outbox.journal` must exist with its `exchange` column and the role
/// must have `INSERT` on it: otherwise an error, since the audit record asked for would stay
/// empty. A retention that
/// is on (`idempotency_retention`, `journal_retention`) for a table that exists but that the
/// role cannot `SELECT` and `DELETE` is returned as a warning (the keys or rows are kept
/// until it can; streaming never depends on it). A missing table is no warning for
/// retention: there is nothing to trim.
///
/// Returns the warnings, each naming the role, the table, what is missing and the `GRANT`
/// (of [`background_grants`]) or the setting that turns the retention off.
///
/// # Errors
/// [`Error::Precondition`] for the journal (missing table or column: run `setup`; missing
/// `INSERT`: the `GRANT`); [`Error::Sql`].
pub async fn check_background_privileges(
    client: &Client,
    schema: &SchemaName,
    slot: &str,
    journal: bool,
    idempotency_retention: bool,
    journal_retention: bool,
) -> Result<Vec<String>, Error> {
    // Only oids, as in check_dead_letter_privileges: the check needs no privilege itself.
    let row = client
        .query_one(
            "SELECT current_user::text,
                    i.oid IS NOT NULL,
                    CASE WHEN i.oid IS NOT NULL THEN has_table_privilege(i.oid, 'SELECT') AND has_table_privilege(i.oid, 'DELETE') END,
                    j.oid IS NOT NULL,
                    CASE WHEN j.oid IS NOT NULL THEN has_table_privilege(j.oid, 'INSERT') END,
                    CASE WHEN j.oid IS NOT NULL THEN has_table_privilege(j.oid, 'SELECT') AND has_table_privilege(j.oid, 'DELETE') END,
                    EXISTS (SELECT 1 FROM pg_attribute a WHERE a.attrelid = j.oid AND a.attname = 'exchange' AND NOT a.attisdropped)
             FROM (SELECT 1) AS one
             LEFT JOIN pg_namespace n ON n.nspname = $1
             LEFT JOIN pg_class i ON i.relnamespace = n.oid AND i.relname = 'idempotency'
             LEFT JOIN pg_class j ON j.relnamespace = n.oid AND j.relname = 'journal'",
            &[&schema.as_str()],
        )
        .await
        .map_err(|e| {
            Error::sql(
                schema.rewrite("checking the privileges on outbox.journal and outbox.idempotency"),
                e,
            )
        })?;
    let role: String = row.get(0);
    let [idempotency_grant, journal_grant] = background_grants(schema, &role);
    if journal {
        if !row.get::<_, bool>(3) {
            return Err(Error::Precondition(schema.rewrite(&format!(
                "--journal is on but table outbox.journal does not exist in this database; run `pgoutbox setup --slot {slot}{}` (as the database owner) first, or run without --journal",
                schema_flag(schema)
            )).into_owned()));
        }
        if row.get::<_, Option<bool>>(4) != Some(true) {
            return Err(Error::Precondition(format!(
                "--journal is on but role {role:?} cannot insert into {schema}.journal (missing INSERT); as the owner of schema {schema} or a superuser, run: {journal_grant} (sql/roles.example.sql grants the same), or run without --journal"
            )));
        }
        if !row.get::<_, bool>(6) {
            return Err(Error::Precondition(format!(
                "--journal is on but table {schema}.journal has no exchange column (it was created by an older pgoutbox); run `pgoutbox setup --slot {slot}{}` again (as the database owner; idempotent, it adds the column), or run without --journal",
                schema_flag(schema)
            )));
        }
    }
    let mut warnings = Vec::new();
    if idempotency_retention && row.get::<_, bool>(1) && row.get::<_, Option<bool>>(2) != Some(true)
    {
        warnings.push(format!(
            "role {role:?} cannot delete expired idempotency keys from {schema}.idempotency (missing SELECT or DELETE), so they are kept and the table grows; run: {idempotency_grant} (sql/roles.example.sql grants the same), or set --idempotency-retention 0 to stop trying"
        ));
    }
    if journal_retention && row.get::<_, bool>(3) && row.get::<_, Option<bool>>(5) != Some(true) {
        warnings.push(format!(
            "role {role:?} cannot delete expired journal rows from {schema}.journal (missing SELECT or DELETE), so they are kept and the table grows; run: {journal_grant} (sql/roles.example.sql grants the same), or set --journal-retention 0 to stop trying"
        ));
    }
    Ok(warnings)
}

/// Makes every commit so far readable by logical decoding, which reads only WAL flushed to
/// disk: under `synchronous_commit = off` a committed emit may stay unflushed for up to
/// three `wal_writer_delay`s, and `peek` and `status` then said "0 waiting". A transaction
/// that writes WAL (an empty logical message under a prefix `run` ignores) and commits with
/// `synchronous_commit = local` flushes the WAL up to its commit, every earlier commit with
/// it, without waiting for a standby (which may be `run` itself). Best effort: a role that
/// may not emit (under lockdown) or a server in recovery counts what is flushed.
async fn flush_wal(client: &Client) {
    let flushed = client
        .batch_execute(
            "BEGIN; SET LOCAL synchronous_commit = local; \
             SELECT pg_logical_emit_message(true, 'pgoutbox-flush', ''); COMMIT;",
        )
        .await;
    if let Err(e) = flushed {
        let _ = client.batch_execute("ROLLBACK").await;
        tracing::debug!(error = %e, "could not flush the WAL before peeking; counting what is flushed");
    }
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
    prefix: &MessagePrefix,
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
            &format!(
                "SELECT count(*) FROM pg_logical_slot_peek_binary_changes($1, NULL, NULL,
                'proto_version', '1', 'publication_names', $2, 'messages', 'true')
             WHERE {}",
                message_filter(prefix)
            ),
            &[&slot, &publication],
        )
        .await
        .map_err(|e| Error::sql("peeking at the slot for unsent outbox messages", e))?;
    Ok(row.get(0))
}

/// The SQL condition on a pgoutput row `data` that selects the messages with `prefix`, by
/// the fixed pgoutput `M` layout up to the prefix: `'M'`, Int8 flags, Int64 LSN, then the
/// NUL-terminated prefix at byte offset 10 (1-based 11). The prefix goes in as a literal: it
/// holds no quote or backslash ([`MessagePrefix::parse`]).
fn message_filter(prefix: &MessagePrefix) -> String {
    format!(
        "get_byte(data, 0) = 77 \
         AND substring(data from 11 for {}) = convert_to({}, 'UTF8') || '\\x00'::bytea",
        prefix.as_str().len() + 1,
        prefix.literal()
    )
}

/// ` --schema S` for a command line to suggest, or nothing for the default schema.
pub fn schema_flag(schema: &SchemaName) -> String {
    if schema.is_default() {
        String::new()
    } else {
        format!(" --schema {schema}")
    }
}

#[test]
fn the_default_message_filter_is_the_one_of_before() {
    assert_eq!(
        message_filter(&MessagePrefix::default()),
        "get_byte(data, 0) = 77 \
         AND substring(data from 11 for 9) = convert_to('pgoutbox', 'UTF8') || '\\x00'::bytea"
    );
}

/// Longest a `status` or `peek` decode of the slot may take, in milliseconds
/// (`statement_timeout`): decoding starts at the slot's `restart_lsn` whatever the limit, so a
/// slot that retains gigabytes of WAL is read only this long.
pub const PEEK_TIMEOUT_MS: u32 = 10_000;

/// How many decoded changes (pgoutput rows: Begin, Commit, messages, table changes) `status`
/// reads when it counts the outbox messages a slot holds. Postgres checks the limit between
/// WAL records, so a transaction that is being output is finished first.
pub const PENDING_SCAN_CHANGES: i64 = 100_000;

/// The outbox messages waiting in an inactive slot, as counted by [`count_waiting`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WaitingCount {
    /// Outbox messages found.
    pub messages: i64,
    /// Whether the scan stopped at [`PENDING_SCAN_CHANGES`] changes: more may wait.
    pub at_least: bool,
}

/// Counts the outbox messages in the first [`PENDING_SCAN_CHANGES`] changes of the slot,
/// without consuming them and without writing anything (so it sees the WAL flushed so far: an
/// asynchronous commit shows up within `wal_writer_delay` or so). Bounded in time by
/// [`PEEK_TIMEOUT_MS`].
///
/// # Errors
/// [`Error::Sql`]: the slot is active (SQLSTATE 55006), lost, the role lacks `REPLICATION`,
/// or the decode timed out (57014).
pub async fn count_waiting(
    client: &mut Client,
    slot: &str,
    publication: &str,
    prefix: &MessagePrefix,
) -> Result<WaitingCount, Error> {
    flush_wal(client).await;
    let tx = client
        .transaction()
        .await
        .map_err(|e| Error::sql("starting the peek transaction", e))?;
    tx.batch_execute(&format!("SET LOCAL statement_timeout = {PEEK_TIMEOUT_MS}"))
        .await
        .map_err(|e| Error::sql("setting statement_timeout for the peek", e))?;
    let row = tx
        .query_one(
            &format!(
                "SELECT count(*), count(*) FILTER (WHERE {})
                 FROM pg_logical_slot_peek_binary_changes($1, NULL, $2::int,
                    'proto_version', '1', 'publication_names', $3, 'messages', 'true')",
                message_filter(prefix)
            ),
            &[&slot, &(PENDING_SCAN_CHANGES as i32), &publication],
        )
        .await
        .map_err(|e| Error::sql("peeking at the slot for waiting outbox messages", e))?;
    let _ = tx.rollback().await;
    let (changes, messages): (i64, i64) = (row.get(0), row.get(1));
    Ok(WaitingCount {
        messages,
        at_least: changes >= PENDING_SCAN_CHANGES,
    })
}

/// What `status` reads besides [`SlotStatus`]: the WAL the slot retains and the limits on it.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct SlotRetention {
    /// The oldest WAL position the slot still needs, `X/Y`.
    pub restart_lsn: Option<String>,
    /// Bytes of WAL between `restart_lsn` and the current WAL position: what the slot keeps
    /// on disk.
    pub retained_wal_bytes: Option<i64>,
    /// Bytes of WAL that can still be written before the slot is in danger of being
    /// invalidated (`pg_replication_slots.safe_wal_size`); none when unlimited or lost.
    pub safe_wal_size: Option<i64>,
    /// `max_slot_wal_keep_size` as the server shows it (`-1`: unlimited).
    pub max_slot_wal_keep_size: Option<String>,
    /// The same in bytes; none when unlimited.
    pub max_slot_wal_keep_size_bytes: Option<i64>,
}

/// Reads the slot's retained WAL and its limits.
///
/// # Errors
/// [`Error::Precondition`] when the slot does not exist; [`Error::Sql`].
pub async fn slot_retention(client: &Client, slot: &str) -> Result<SlotRetention, Error> {
    let row = client
        .query_opt(
            "SELECT s.restart_lsn::text,
                    pg_wal_lsn_diff(pg_current_wal_lsn(), s.restart_lsn)::bigint,
                    s.safe_wal_size,
                    current_setting('max_slot_wal_keep_size'),
                    (SELECT CASE WHEN setting::bigint < 0 THEN NULL
                                 ELSE setting::bigint * 1024 * 1024 END
                     FROM pg_settings WHERE name = 'max_slot_wal_keep_size')
             FROM pg_replication_slots s WHERE s.slot_name = $1",
            &[&slot],
        )
        .await
        .map_err(|e| Error::sql("reading the slot's retained WAL", e))?
        .ok_or_else(|| Error::Precondition(format!("replication slot {slot:?} does not exist")))?;
    Ok(SlotRetention {
        restart_lsn: row.get(0),
        retained_wal_bytes: row.get(1),
        safe_wal_size: row.get(2),
        max_slot_wal_keep_size: row.get(3),
        max_slot_wal_keep_size_bytes: row.get(4),
    })
}

/// One outbox message waiting in the slot, as `peek` shows it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct WaitingMessage {
    /// The message's LSN, `X/Y`.
    pub lsn: String,
    /// Its transaction's commit LSN (the commit record), `X/Y`; none for a non-transactional
    /// message.
    pub commit_lsn: Option<String>,
    /// Its transaction's end LSN (what the streamer acknowledges), `X/Y`.
    pub commit_end_lsn: Option<String>,
    /// Commit time, µs since the Unix epoch.
    pub commit_time_us: Option<i64>,
    /// Commit time as RFC 3339 UTC text.
    pub commit_time: Option<String>,
    /// Whether it was emitted transactionally (`outbox.emit` always is).
    pub transactional: bool,
    /// The logical message content's size in bytes (the whole envelope).
    pub size_bytes: usize,
    /// The decoded envelope, or why it does not decode (the streamer dead-letters it as
    /// `poison`).
    #[serde(flatten)]
    pub envelope: WaitingEnvelope,
}

/// The envelope part of a [`WaitingMessage`].
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct WaitingEnvelope {
    /// The envelope format version (1 to 3, docs/src/reference/envelope.md).
    pub envelope_version: Option<u8>,
    /// The message id.
    pub message_id: Option<String>,
    /// The topic (routing key).
    pub topic: Option<String>,
    /// The content type.
    pub content_type: Option<String>,
    /// Producer headers.
    pub headers: Option<serde_json::Map<String, serde_json::Value>>,
    /// The exchange the producer named (`emit(..., exchange => ...)`); none: the streamer's
    /// `--exchange`.
    pub exchange: Option<String>,
    /// The event metadata given (envelope version 3: `correlation_id`, `tenant`,
    /// `expiration_ms`, ...), only the keys set; empty when none ([`crate::envelope::Metadata::to_json`]).
    pub metadata: Option<serde_json::Map<String, serde_json::Value>>,
    /// Who emitted it (`session_user`, envelope version 2 and later).
    pub emitted_by: Option<String>,
    /// Payload size in bytes.
    pub payload_bytes: Option<usize>,
    /// The payload, only when asked for: as text when it is UTF-8, else base64 (RFC 4648,
    /// standard alphabet, padded); [`WaitingEnvelope::payload_encoding`] says which.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub payload: Option<String>,
    /// How [`WaitingEnvelope::payload`] is written, with it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub payload_encoding: Option<PayloadEncoding>,
    /// Why the content is no valid envelope.
    pub decode_error: Option<String>,
}

/// What `peek` found.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PeekReport {
    /// The messages, in WAL order, at most the limit asked for.
    pub messages: Vec<WaitingMessage>,
    /// More outbox messages wait beyond the limit.
    pub more: bool,
    /// The scan stopped at its bound of decoded changes: more may wait.
    pub scan_bounded: bool,
}

/// Whether [`peek_waiting`] returns payloads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Payloads {
    /// Sizes only.
    Omit,
    /// Payload text too.
    Include,
}

/// How `peek --payload` writes a payload.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum PayloadEncoding {
    /// The payload is UTF-8: shown as the text it is.
    #[serde(rename = "utf-8")]
    Utf8,
    /// The payload is not UTF-8 (binary, or another charset): shown as base64 so that no
    /// byte is lost or replaced.
    #[serde(rename = "base64")]
    Base64,
}

/// A payload as `peek --payload` shows it: its text when it is UTF-8, else base64.
fn shown_payload(payload: &[u8]) -> (String, PayloadEncoding) {
    use base64::Engine;
    match std::str::from_utf8(payload) {
        Ok(text) => (text.to_owned(), PayloadEncoding::Utf8),
        Err(_) => (
            base64::engine::general_purpose::STANDARD.encode(payload),
            PayloadEncoding::Base64,
        ),
    }
}

/// The first `limit` outbox messages waiting in the slot, without consuming them
/// (`pg_logical_slot_peek_binary_changes`, decoded with [`crate::pgoutput`] and
/// [`crate::envelope`]). Decodes at most `max(1000, 4 × (limit + 1))` changes and for at most
/// [`PEEK_TIMEOUT_MS`]; only the outbox messages and their transactions' Begin and Commit
/// reach the client.
///
/// # Errors
/// [`Error::Precondition`] when the slot does not exist or is held by a streamer (naming the
/// holder: Postgres refuses to peek an active slot) or is lost; [`Error::Sql`].
pub async fn peek_waiting(
    client: &mut Client,
    slot: &str,
    publication: &str,
    prefix: &MessagePrefix,
    limit: i64,
    payloads: Payloads,
) -> Result<PeekReport, Error> {
    let status = slot_status(client, slot).await?;
    if status.active {
        return Err(held_by(&status));
    }
    if status.wal_status.as_deref() == Some("lost") {
        return Err(Error::Precondition(format!(
            "slot {slot:?} is lost (wal_status = 'lost'): the WAL it needed was removed, so nothing can be read from it"
        )));
    }
    let scan = (limit.saturating_add(1).saturating_mul(4)).clamp(1000, i64::from(i32::MAX));
    flush_wal(client).await;
    let tx = client
        .transaction()
        .await
        .map_err(|e| Error::sql("starting the peek transaction", e))?;
    tx.batch_execute(&format!("SET LOCAL statement_timeout = {PEEK_TIMEOUT_MS}"))
        .await
        .map_err(|e| Error::sql("setting statement_timeout for the peek", e))?;
    let rows = tx
        .query(
            &format!(
                "WITH changes AS MATERIALIZED (
                    SELECT c.ord, c.xid, c.data
                    FROM pg_logical_slot_peek_binary_changes($1, NULL, $2::int,
                        'proto_version', '1', 'publication_names', $3, 'messages', 'true')
                        WITH ORDINALITY AS c(lsn, xid, data, ord)),
                 ours AS (SELECT ord, xid FROM changes WHERE {}
                          ORDER BY ord LIMIT $4)
                 SELECT 0::bigint, NULL::bytea, (SELECT count(*) FROM changes)
                 UNION ALL
                 SELECT ord, data, NULL FROM changes
                 WHERE ord IN (SELECT ord FROM ours)
                    OR (get_byte(data, 0) IN (66, 67) AND xid IN (SELECT xid FROM ours))
                 ORDER BY 1",
                message_filter(prefix)
            ),
            &[
                &slot,
                &(scan as i32),
                &publication,
                &(limit.saturating_add(1)),
            ],
        )
        .await;
    let rows = match rows {
        Ok(rows) => rows,
        Err(e) if e.code().map(|c| c.code()) == Some("55006") => {
            // A streamer took the slot between the check above and the peek.
            drop(tx);
            return Err(match slot_status(client, slot).await {
                Ok(now) if now.active => held_by(&now),
                _ => Error::sql("peeking at the slot (it is in use)", e),
            });
        }
        Err(e) => {
            return Err(Error::sql(
                "peeking at the slot for waiting outbox messages",
                e,
            ))
        }
    };
    let scanned: i64 = rows.first().and_then(|r| r.get(2)).unwrap_or(0);
    let mut messages: Vec<WaitingMessage> = Vec::new();
    // The open transaction's commit fields are filled in at its Commit.
    let mut open: Option<usize> = None;
    for row in rows.iter().skip(1) {
        let data: Vec<u8> = row.get(1);
        match crate::pgoutput::decode(bytes::Bytes::from(data)) {
            Ok(crate::pgoutput::LogicalMessage::Begin(_)) => open = Some(messages.len()),
            Ok(crate::pgoutput::LogicalMessage::Commit(c)) => {
                let time_us = crate::pgoutput::pg_time_to_unix_us(c.commit_time_us);
                for m in messages.iter_mut().skip(open.take().unwrap_or(usize::MAX)) {
                    m.commit_lsn = Some(c.commit_lsn.to_string());
                    m.commit_end_lsn = Some(c.end_lsn.to_string());
                    m.commit_time_us = Some(time_us);
                }
            }
            Ok(crate::pgoutput::LogicalMessage::Message(m)) => {
                messages.push(WaitingMessage {
                    lsn: m.lsn.to_string(),
                    commit_lsn: None,
                    commit_end_lsn: None,
                    commit_time_us: None,
                    commit_time: None,
                    transactional: m.transactional,
                    size_bytes: m.content.len(),
                    envelope: describe_envelope(m.content, payloads),
                });
            }
            Ok(crate::pgoutput::LogicalMessage::Other { .. }) => {}
            Err(e) => {
                return Err(Error::Precondition(format!(
                    "slot {slot:?} returned a change pgoutbox cannot decode: {e}"
                )))
            }
        }
    }
    let more = messages.len() as i64 > limit;
    messages.truncate(usize::try_from(limit).unwrap_or(usize::MAX));
    // Commit times as text, by the server's clock rules (one round trip).
    let times: Vec<i64> = messages
        .iter()
        .map(|m| m.commit_time_us.unwrap_or(0))
        .collect();
    let texts = tx
        .query(
            "SELECT to_char(to_timestamp(t / 1e6) AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS.US\"Z\"')
             FROM unnest($1::bigint[]) WITH ORDINALITY AS u(t, ord) ORDER BY ord",
            &[&times],
        )
        .await
        .map_err(|e| Error::sql("formatting commit times", e))?;
    for (m, row) in messages.iter_mut().zip(texts) {
        if m.commit_time_us.is_some() {
            m.commit_time = row.get(0);
        }
    }
    let _ = tx.rollback().await;
    Ok(PeekReport {
        messages,
        more,
        scan_bounded: scanned >= scan,
    })
}

/// The error for a slot a walsender holds, naming the holder.
fn held_by(status: &SlotStatus) -> Error {
    Error::Precondition(format!(
        "slot {:?} is active, held by pid {} ({}): Postgres cannot peek a slot a streamer holds; stop that streamer to look inside, or see `pgoutbox status`",
        status.slot,
        status
            .active_pid
            .map(|p| p.to_string())
            .unwrap_or_else(|| "unknown".into()),
        status
            .holder
            .as_deref()
            .map(|h| format!("application_name {h}"))
            .unwrap_or_else(|| "unknown application".into())
    ))
}

fn describe_envelope(content: bytes::Bytes, payloads: Payloads) -> WaitingEnvelope {
    match crate::envelope::decode(content) {
        Ok(env) => {
            let (payload, payload_encoding) = match payloads {
                Payloads::Include => {
                    let (text, encoding) = shown_payload(&env.payload);
                    (Some(text), Some(encoding))
                }
                Payloads::Omit => (None, None),
            };
            WaitingEnvelope {
                envelope_version: Some(env.version),
                message_id: Some(env.message_id),
                topic: Some(env.topic),
                content_type: Some(env.content_type),
                headers: Some(env.headers),
                exchange: env.exchange,
                metadata: Some(env.meta.to_json()),
                emitted_by: env.emitted_by,
                payload_bytes: Some(env.payload.len()),
                payload,
                payload_encoding,
                decode_error: None,
            }
        }
        Err(e) => WaitingEnvelope {
            envelope_version: None,
            message_id: None,
            topic: None,
            content_type: None,
            headers: None,
            exchange: None,
            metadata: None,
            emitted_by: None,
            payload_bytes: None,
            payload: None,
            payload_encoding: None,
            decode_error: Some(e.to_string()),
        },
    }
}

/// How bad what `status` found is; also its exit code (0, 1, 2).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Severity {
    /// Nothing to do.
    Healthy = 0,
    /// Look soon: it heals, or will hurt later.
    Warning = 1,
    /// Act now: messages are not flowing or are about to be lost.
    Critical = 2,
}

/// One thing `status` found wrong.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Problem {
    /// How bad it is.
    pub severity: Severity,
    /// What it is and what to do, one sentence.
    pub message: String,
}

/// Lag bounds for `status`, in bytes of WAL behind the current position.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LagThresholds {
    /// Above this: warning.
    pub warn_bytes: u64,
    /// Above this: critical.
    pub crit_bytes: u64,
}

/// Everything `status` reports. Fields of [`SlotStatus`] keep their names (and are null
/// when the slot does not exist).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct HealthReport {
    /// The outbox's schema (`--schema`).
    pub schema: String,
    /// The logical-message prefix whose messages are counted as waiting.
    pub prefix: String,
    /// Slot name.
    pub slot: String,
    /// Whether the slot exists.
    pub slot_exists: bool,
    /// Whether a walsender holds it.
    pub active: bool,
    /// The holder's pid.
    pub active_pid: Option<i32>,
    /// The holder's `application_name`.
    pub holder: Option<String>,
    /// The `application_name` of each `run` process standing by for the slot.
    pub standbys: Vec<String>,
    /// Position up to which the consumer acknowledged, `X/Y`.
    pub confirmed_flush_lsn: Option<String>,
    /// Bytes of WAL between `confirmed_flush_lsn` and the current WAL position.
    pub lag_bytes: Option<i64>,
    /// `reserved`, `extended`, `unreserved` or `lost`.
    pub wal_status: Option<String>,
    /// Output plugin.
    pub plugin: Option<String>,
    /// Retained WAL and its limits (null fields when the slot does not exist).
    #[serde(flatten)]
    pub retention: SlotRetention,
    /// The publication name.
    pub publication: String,
    /// Whether it exists.
    pub publication_exists: bool,
    /// Outbox messages waiting in the slot; null when unknown (see
    /// `pending_outbox_messages_unknown`).
    pub pending_outbox_messages: Option<i64>,
    /// The count stopped at [`PENDING_SCAN_CHANGES`] decoded changes: at least this many.
    pub pending_outbox_messages_at_least: bool,
    /// Why the count is unknown (for example: the slot is active).
    pub pending_outbox_messages_unknown: Option<String>,
    /// Dead letters not requeued; null when `outbox.dead_letter` cannot be read.
    pub dead_letters: Option<i64>,
    /// The newest such dead letter's reason (`nacked`, `returned`, `poison`, `too_large`,
    /// `forged`).
    pub newest_dead_letter_reason: Option<String>,
    /// Its last error.
    pub newest_dead_letter_error: Option<String>,
    /// When it was dead-lettered, RFC 3339 UTC.
    pub newest_dead_letter_at: Option<String>,
    /// Whether `setup --lockdown` is in effect in this database (information only: it never
    /// changes `severity`); null when it could not be read.
    pub lockdown: Option<super::lockdown::LockdownState>,
    /// `outbox.stream_state` for this slot: the last flush LSN `run` reported, the system
    /// identifier and timeline, the gaps accepted with `--accept-gap` (null: no record).
    pub stream_state: Option<crate::stream_state::Recorded>,
    /// A gap in the slot's history that `run` would refuse to start over (null: none).
    pub gap: Option<crate::stream_state::GapReport>,
    /// What a failover of the primary needs, as found on the primary (for a failover slot
    /// on PostgreSQL 17+) and on the standby of `--standby-url` ([`super::failover`]).
    pub failover: Vec<FailoverLine>,
    /// The worst of `problems` (healthy when none).
    pub severity: Severity,
    /// What is wrong, worst first.
    pub problems: Vec<Problem>,
}

/// One finding of [`super::failover`] in `status`'s report.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct FailoverLine {
    /// `primary` or `standby`: where it was read.
    pub on: &'static str,
    /// `ok`, `warning` or `problem`.
    pub level: &'static str,
    /// The setting or object looked at.
    pub subject: &'static str,
    /// What was found, and the fix.
    pub text: String,
}

impl HealthReport {
    /// Adds failover findings read `on` the primary or the standby: each one not met is a
    /// warning (a failover would lose or invent events, or `run` stalls; the lag says when
    /// messages stop flowing), and the severity is judged again.
    pub fn add_failover(&mut self, on: &'static str, checks: Vec<super::failover::FailoverCheck>) {
        use super::failover::Level;
        for c in checks {
            let level = match c.level {
                Level::Ok => "ok",
                Level::Warning => "warning",
                Level::Problem => "problem",
            };
            if c.level != Level::Ok {
                self.problems.push(Problem {
                    severity: Severity::Warning,
                    message: format!("failover ({on}): {}: {}", c.subject, c.text),
                });
            }
            self.failover.push(FailoverLine {
                on,
                level,
                subject: c.subject,
                text: c.text,
            });
        }
        self.problems.sort_by_key(|p| std::cmp::Reverse(p.severity));
        self.severity = self
            .problems
            .first()
            .map(|p| p.severity)
            .unwrap_or(Severity::Healthy);
    }
}

/// Reads everything `status` reports and judges it: critical when the slot or the
/// publication is missing, the slot is `lost` or `unreserved` or not a pgoutput slot, or lags
/// more than `crit_bytes`; warning when it lags more than `warn_bytes`, is inactive, is
/// `extended`, or an unrequeued dead letter exists. Counts the waiting outbox messages only
/// while the slot is inactive (Postgres refuses to peek an active slot), bounded by
/// [`PENDING_SCAN_CHANGES`] and [`PEEK_TIMEOUT_MS`].
///
/// # Errors
/// [`Error::Sql`] when the catalogs cannot be read at all; secondary reads that fail (the
/// count, the dead letters) become problems instead.
pub async fn health(
    client: &mut Client,
    schema: &SchemaName,
    prefix: &MessagePrefix,
    slot: &str,
    publication: &str,
    lag: LagThresholds,
) -> Result<HealthReport, Error> {
    let mut problems = Vec::new();
    let mut problem = |severity, message: String| problems.push(Problem { severity, message });
    let status = match slot_status(client, slot).await {
        Ok(s) => Some(s),
        Err(Error::Precondition(m)) => {
            problem(Severity::Critical, m);
            None
        }
        Err(e) => return Err(e),
    };
    let retention = match &status {
        Some(_) => slot_retention(client, slot).await?,
        None => SlotRetention::default(),
    };
    let standbys = standbys(client, slot).await.unwrap_or_default();
    let publication_exists = publication_exists(client, publication).await?;
    if !publication_exists {
        problem(
            Severity::Critical,
            format!("publication {publication:?} does not exist in this database; `run` refuses to start: run `pgoutbox setup --slot {slot} --publication {publication}` or fix --publication"),
        );
    }
    let (mut pending, mut at_least, mut unknown) = (None, false, None);
    if let Some(s) = &status {
        if s.plugin.as_deref() != Some("pgoutput") {
            problem(
                Severity::Critical,
                format!(
                    "slot {slot:?} uses plugin {}, not pgoutput; `run` refuses it",
                    s.plugin.as_deref().unwrap_or("(none: a physical slot)")
                ),
            );
        }
        match s.wal_status.as_deref() {
            Some("lost") => problem(
                Severity::Critical,
                format!("slot {slot:?} is lost (wal_status = 'lost'): the WAL it needed was removed and the messages in it are gone; recreate it with `pgoutbox teardown --force` and `pgoutbox setup`, then reconcile with the producers"),
            ),
            Some("unreserved") => problem(
                Severity::Critical,
                format!("slot {slot:?} is about to be invalidated (wal_status = 'unreserved': it retains more WAL than max_slot_wal_keep_size); start `pgoutbox run` now or raise max_slot_wal_keep_size"),
            ),
            Some("extended") => problem(
                Severity::Warning,
                format!("slot {slot:?} retains more WAL than max_wal_size (wal_status = 'extended')"),
            ),
            _ => {}
        }
        if let Some(bytes) = s.lag_bytes.and_then(|l| u64::try_from(l).ok()) {
            if bytes > lag.crit_bytes {
                problem(
                    Severity::Critical,
                    format!(
                        "slot {slot:?} lags {bytes} bytes of WAL, more than --crit-lag-bytes {}",
                        lag.crit_bytes
                    ),
                );
            } else if bytes > lag.warn_bytes {
                problem(
                    Severity::Warning,
                    format!(
                        "slot {slot:?} lags {bytes} bytes of WAL, more than --warn-lag-bytes {}",
                        lag.warn_bytes
                    ),
                );
            }
        }
        if s.active {
            unknown = Some("unknown while the slot is active (Postgres refuses to peek a slot a streamer holds)".to_owned());
        } else {
            problem(
                Severity::Warning,
                format!("slot {slot:?} is inactive: no streamer holds it, so nothing is delivered; start `pgoutbox run`"),
            );
            if s.wal_status.as_deref() == Some("lost") {
                unknown = Some("unknown: the slot is lost".to_owned());
            } else {
                match count_waiting(client, slot, publication, prefix).await {
                    Ok(c) => {
                        pending = Some(c.messages);
                        at_least = c.at_least;
                    }
                    Err(e) => {
                        unknown = Some(format!(
                            "unknown: {}",
                            crate::report::render_report(&e).replace('\n', "; ")
                        ))
                    }
                }
            }
        }
    }
    let dead = client
        .query_one(
            &*schema.rewrite("SELECT (SELECT count(*) FROM outbox.dead_letter WHERE requeued_at IS NULL), d.reason,
                    d.last_error,
                    to_char(d.dead_lettered_at AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS\"Z\"')
             FROM (SELECT 1) AS one
             LEFT JOIN LATERAL (SELECT reason, last_error, dead_lettered_at FROM outbox.dead_letter
                                WHERE requeued_at IS NULL ORDER BY id DESC LIMIT 1) d ON true"),
            &[],
        )
        .await;
    let (mut dead_letters, mut reason, mut error, mut at) = (None, None, None, None);
    match dead {
        Ok(row) => {
            let n: i64 = row.get(0);
            dead_letters = Some(n);
            reason = row.get(1);
            error = row.get(2);
            at = row.get(3);
            if n > 0 {
                problem(
                    Severity::Warning,
                    format!(
                        "{n} dead letters are not requeued (newest: {}, {}); see `pgoutbox dead-letters list`",
                        reason.as_deref().unwrap_or("-"),
                        error.as_deref().unwrap_or("no error text")
                    ),
                );
            }
        }
        Err(e) if matches!(e.code().map(|c| c.code()), Some("42P01" | "3F000")) => problem(
            Severity::Critical,
            schema.rewrite(&format!("table outbox.dead_letter does not exist in this database; `run` refuses to start: run `pgoutbox setup --slot {slot}{}`", schema_flag(schema))).into_owned(),
        ),
        Err(e) => problem(
            Severity::Warning,
            schema.rewrite(&format!("cannot read outbox.dead_letter: {}", e.as_db_error().map(|d| d.message().to_owned()).unwrap_or_else(|| e.to_string()))).into_owned(),
        ),
    }
    // Information, unless a lockdown no longer holds: each weakening is a warning (as in
    // `check`; `run` streams on and logs each as an error: crate::lockdown has the one
    // meaning of a weakened lockdown).
    let lockdown = super::lockdown::lockdown_state(client).await.ok();
    for weakness in lockdown.iter().flat_map(|l| &l.weakened) {
        problem(Severity::Warning, super::lockdown::weakened_text(weakness));
    }
    let (stream_state, gap) = match crate::stream_state::inspect(
        client,
        schema,
        slot,
        status
            .as_ref()
            .and_then(|s| s.confirmed_flush_lsn.as_deref()),
    )
    .await
    {
        Ok(found) => found,
        Err(e) => {
            problem(
                Severity::Warning,
                format!(
                    "cannot read {}: {}",
                    schema.qualify("stream_state"),
                    crate::report::one_line(&e)
                ),
            );
            (None, None)
        }
    };
    if let Some(g) = &gap {
        problem(
            Severity::Critical,
            format!(
                "{}; `run` refuses to start until you recover them and pass --accept-gap once",
                g.message
            ),
        );
    }
    problems.sort_by_key(|p| std::cmp::Reverse(p.severity));
    let severity = problems
        .first()
        .map(|p| p.severity)
        .unwrap_or(Severity::Healthy);
    let s = status.as_ref();
    let mut report = HealthReport {
        schema: schema.as_str().to_owned(),
        prefix: prefix.as_str().to_owned(),
        slot: slot.to_owned(),
        slot_exists: s.is_some(),
        active: s.is_some_and(|s| s.active),
        active_pid: s.and_then(|s| s.active_pid),
        holder: s.and_then(|s| s.holder.clone()),
        standbys,
        confirmed_flush_lsn: s.and_then(|s| s.confirmed_flush_lsn.clone()),
        lag_bytes: s.and_then(|s| s.lag_bytes),
        wal_status: s.and_then(|s| s.wal_status.clone()),
        plugin: s.and_then(|s| s.plugin.clone()),
        retention,
        publication: publication.to_owned(),
        publication_exists,
        pending_outbox_messages: pending,
        pending_outbox_messages_at_least: at_least,
        pending_outbox_messages_unknown: unknown,
        dead_letters,
        newest_dead_letter_reason: reason,
        newest_dead_letter_error: error,
        newest_dead_letter_at: at,
        lockdown,
        stream_state,
        gap,
        failover: Vec::new(),
        severity,
        problems,
    };
    match super::failover::on_primary(client, slot).await {
        Ok(checks) => report.add_failover("primary", checks),
        Err(e) => report.add_failover(
            "primary",
            vec![super::failover::FailoverCheck {
                level: super::failover::Level::Warning,
                subject: "synchronized_standby_slots",
                text: format!("cannot be read: {}", crate::report::one_line(&e)),
            }],
        ),
    }
    Ok(report)
}
