//! Provisioning and inspection over ordinary SQL (tokio-postgres): `setup`, `status`,
//! `teardown`, and the pre-flight checks `run` makes before it takes the slot.

use serde::Serialize;
use tokio_postgres::{Client, NoTls};

use crate::error::Error;
use crate::lsn::Lsn;

/// How long an ordinary SQL connection attempt may take when the URL sets no
/// `connect_timeout` (see [`crate::config::DEFAULT_CONNECT_TIMEOUT`]).
pub const CONNECT_TIMEOUT: std::time::Duration = crate::config::DEFAULT_CONNECT_TIMEOUT;

/// The producer helpers, installed by `setup` (idempotent).
pub const OUTBOX_SQL: &str = include_str!("../sql/outbox.sql");

/// Connects an ordinary SQL session and spawns its connection task.
///
/// The whole handshake (TCP connect, startup, authentication) is bounded by the URL's
/// `connect_timeout` ([`crate::config::connect_timeout`]): tokio-postgres' own
/// `connect_timeout` covers only the TCP connect, so a server that accepts TCP and never
/// answers would otherwise hang here for ever.
///
/// # Errors
/// [`Error::PostgresConnectTimeout`] (retryable) when the handshake does not finish in
/// time; [`Error::PostgresPasswordMissing`] (definite) when the server asks for a password
/// the URL lacks; [`Error::Sql`] when the connection fails otherwise, with a hint.
pub async fn connect(config: &tokio_postgres::Config) -> Result<Client, Error> {
    let timeout = crate::config::connect_timeout(config);
    let mut config = config.clone();
    config.connect_timeout(timeout);
    let config = &config;
    let target = describe_target(config);
    let connected = tokio::time::timeout(timeout, config.connect(NoTls))
        .await
        .map_err(|_| Error::PostgresConnectTimeout {
            target: target.clone(),
            timeout_s: timeout.as_secs(),
        })?;
    let (client, connection) = connected.map_err(|e| {
        if is_password_missing(&e) {
            return Error::PostgresPasswordMissing {
                target: target.clone(),
                source: e,
            };
        }
        let hint = if e.code().is_some_and(|c| c.code().starts_with("28")) {
            "check the user and password in --database-url (PGOUTBOX_DATABASE_URL)"
        } else if e.code().is_some_and(|c| c.code() == "3D000") {
            "check the database name in --database-url (PGOUTBOX_DATABASE_URL)"
        } else {
            "check host, port and dbname in --database-url (PGOUTBOX_DATABASE_URL) and that PostgreSQL is running"
        };
        Error::sql(format!("connecting to {target}; {hint}"), e)
    })?;
    tokio::spawn(async move {
        if let Err(e) = connection.await {
            tracing::debug!(error = %e, "sql connection ended");
        }
    });
    Ok(client)
}

/// tokio-postgres reports a password the server asked for and the config lacks as a
/// configuration error whose cause reads "password missing" (its `Display` alone says only
/// "invalid configuration").
fn is_password_missing(e: &tokio_postgres::Error) -> bool {
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(s) = source {
        if s.to_string().contains("password missing") {
            return true;
        }
        source = s.source();
    }
    false
}

/// `PostgreSQL user@host:port/dbname` of a connection config, for error messages (no
/// password).
pub fn describe_target(config: &tokio_postgres::Config) -> String {
    crate::config::describe_postgres_target(config)
}

/// Whether a publication of this name exists in the connected database.
///
/// # Errors
/// [`Error::Sql`].
pub async fn publication_exists(client: &Client, publication: &str) -> Result<bool, Error> {
    Ok(client
        .query_opt(
            "SELECT 1 FROM pg_publication WHERE pubname = $1",
            &[&publication],
        )
        .await
        .map_err(|e| Error::sql("looking up the publication", e))?
        .is_some())
}

/// Fails unless `wal_level = logical`.
///
/// # Errors
/// [`Error::Precondition`] naming the setting, its value and the fix.
pub async fn check_wal_level(client: &Client) -> Result<(), Error> {
    let row = client
        .query_one("SELECT current_setting('wal_level')", &[])
        .await
        .map_err(|e| Error::sql("reading wal_level", e))?;
    let level: String = row.get(0);
    if level != "logical" {
        return Err(Error::Precondition(format!(
            "wal_level is '{level}'; set wal_level = logical in postgresql.conf (or ALTER SYSTEM SET wal_level = logical) and restart PostgreSQL"
        )));
    }
    Ok(())
}

/// Fails unless the current role may use replication.
///
/// # Errors
/// [`Error::Precondition`] with the `ALTER ROLE` to run.
pub async fn check_replication_role(client: &Client) -> Result<(), Error> {
    let row = client
        .query_one(
            "SELECT current_user::text, rolreplication OR rolsuper FROM pg_roles WHERE rolname = current_user",
            &[],
        )
        .await
        .map_err(|e| Error::sql("reading the role's attributes", e))?;
    let (user, ok): (String, bool) = (row.get(0), row.get(1));
    if !ok {
        return Err(Error::Precondition(format!(
            "role {user:?} lacks the REPLICATION attribute; run ALTER ROLE \"{user}\" REPLICATION as a superuser"
        )));
    }
    Ok(())
}

/// What `setup` did.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct SetupReport {
    /// The publication was created now (false: it existed).
    pub publication_created: bool,
    /// The slot was created now (false: it existed).
    pub slot_created: bool,
    /// The slot's `confirmed_flush_lsn` after setup.
    pub confirmed_flush_lsn: String,
}

/// Installs `sql/outbox.sql`, creates the publication (no tables) and the pgoutput slot
/// when missing. Idempotent.
///
/// # Errors
/// [`Error::Precondition`] for `wal_level`, missing `REPLICATION`, no free slot, or an
/// existing slot with another plugin or database; [`Error::Sql`] otherwise.
pub async fn setup(client: &Client, slot: &str, publication: &str) -> Result<SetupReport, Error> {
    check_wal_level(client).await?;
    check_replication_role(client).await?;
    client
        .batch_execute(OUTBOX_SQL)
        .await
        .map_err(|e| Error::sql("installing sql/outbox.sql", e))?;
    let publication_created = !publication_exists(client, publication).await?;
    if publication_created {
        client
            .batch_execute(&format!("CREATE PUBLICATION \"{publication}\""))
            .await
            .map_err(|e| Error::sql(format!("creating publication {publication:?}"), e))?;
    }
    let existing = client
        .query_opt(
            "SELECT plugin::text, database::text, current_database()::text FROM pg_replication_slots WHERE slot_name = $1",
            &[&slot],
        )
        .await
        .map_err(|e| Error::sql("looking up the slot", e))?;
    let slot_created = match existing {
        Some(row) => {
            let (plugin, db, current): (Option<String>, Option<String>, String) =
                (row.get(0), row.get(1), row.get(2));
            if plugin.as_deref() != Some("pgoutput") || db.as_deref() != Some(current.as_str()) {
                return Err(Error::Precondition(format!(
                    "slot {slot:?} exists with plugin {} in database {}; pgoutbox needs a pgoutput slot in database {current:?}: pick another --slot or drop that slot (SELECT pg_drop_replication_slot('{slot}'))",
                    plugin.as_deref().unwrap_or("(none: a physical slot)"),
                    db.as_deref().map(|d| format!("{d:?}")).unwrap_or_else(|| "(none)".into()),
                )));
            }
            false
        }
        None => {
            if let Err(e) = client
                .query_one(
                    "SELECT lsn::text FROM pg_create_logical_replication_slot($1, 'pgoutput')",
                    &[&slot],
                )
                .await
            {
                if e.code().map(|c| c.code()) == Some("53400") {
                    let max: String = client
                        .query_one("SELECT current_setting('max_replication_slots')", &[])
                        .await
                        .map(|r| r.get(0))
                        .unwrap_or_else(|_| "?".into());
                    return Err(Error::Precondition(format!(
                        "no free replication slot: max_replication_slots = {max} are all in use; raise max_replication_slots and restart PostgreSQL, or drop an unused slot (SELECT pg_drop_replication_slot(name))"
                    )));
                }
                return Err(Error::sql(format!("creating slot {slot:?}"), e));
            }
            true
        }
    };
    let status = slot_status(client, slot).await?;
    Ok(SetupReport {
        publication_created,
        slot_created,
        confirmed_flush_lsn: status.confirmed_flush_lsn.unwrap_or_default(),
    })
}

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

/// What `teardown` did.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct TeardownReport {
    /// The slot existed and was dropped.
    pub slot_dropped: bool,
    /// The publication existed and was dropped.
    pub publication_dropped: bool,
}

/// Drops the slot and the publication. Refuses while the slot holds unsent outbox
/// messages unless `force`; refuses while the slot is active.
///
/// # Errors
/// [`Error::Precondition`] with the reason and the fix; [`Error::Sql`].
pub async fn teardown(
    client: &Client,
    slot: &str,
    publication: &str,
    force: crate::cli::Force,
) -> Result<TeardownReport, Error> {
    let slot_exists = match slot_status(client, slot).await {
        Ok(status) => {
            if status.active {
                return Err(Error::Precondition(format!(
                    "slot {slot:?} is active (pid {}, {}); stop the streamer first",
                    status
                        .active_pid
                        .map(|p| p.to_string())
                        .unwrap_or_else(|| "unknown".into()),
                    status.holder.as_deref().unwrap_or("unknown application")
                )));
            }
            if force == crate::cli::Force::No && status.wal_status.as_deref() != Some("lost") {
                let pending = pending_outbox_messages(client, slot, publication).await?;
                if pending > 0 {
                    return Err(Error::Precondition(format!(
                        "slot {slot:?} still holds {pending} unsent outbox messages; run `pgoutbox run` until they are delivered, or pass --force to drop them"
                    )));
                }
            }
            true
        }
        Err(Error::Precondition(_)) => false,
        Err(e) => return Err(e),
    };
    if slot_exists {
        client
            .execute("SELECT pg_drop_replication_slot($1)", &[&slot])
            .await
            .map_err(|e| Error::sql(format!("dropping slot {slot:?}"), e))?;
    }
    let publication_dropped = publication_exists(client, publication).await?;
    if publication_dropped {
        client
            .batch_execute(&format!("DROP PUBLICATION IF EXISTS \"{publication}\""))
            .await
            .map_err(|e| Error::sql(format!("dropping publication {publication:?}"), e))?;
    }
    Ok(TeardownReport {
        slot_dropped: slot_exists,
        publication_dropped,
    })
}

/// One row of `outbox.dead_letter`, as `dead-letters list` shows it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct DeadLetter {
    /// Row id (for `requeue --id` and `purge --id`).
    pub id: i64,
    /// The message id, if the envelope could be decoded.
    pub message_id: Option<String>,
    /// The topic (routing key), if decoded.
    pub topic: Option<String>,
    /// The message's LSN, `X/Y`.
    pub lsn: String,
    /// `nacked`, `returned`, `poison` or `too_large`.
    pub reason: String,
    /// Publish attempts made.
    pub attempts: i32,
    /// The first error.
    pub first_error: Option<String>,
    /// The last error.
    pub last_error: Option<String>,
    /// When it was dead-lettered (RFC 3339 text).
    pub dead_lettered_at: String,
    /// When it was requeued, if it was.
    pub requeued_at: Option<String>,
}

/// A dead letter about to be written by the streamer.
#[derive(Debug, Clone)]
pub struct NewDeadLetter<'a> {
    /// The message id, if decoded.
    pub message_id: Option<&'a str>,
    /// The topic, if decoded.
    pub topic: Option<&'a str>,
    /// The message's LSN.
    pub lsn: Lsn,
    /// Its transaction's commit LSN, if it was in one.
    pub commit_lsn: Option<Lsn>,
    /// The logical message content exactly as emitted.
    pub envelope: &'a [u8],
    /// `nacked`, `returned`, `poison` or `too_large`.
    pub reason: &'a str,
    /// Publish attempts made (0 when never published).
    pub attempts: i32,
    /// The first error.
    pub first_error: Option<&'a str>,
    /// The last error.
    pub last_error: &'a str,
}

/// Connects a session for dead letters: `synchronous_commit = on`, so a dead letter is
/// durable when the insert returns, before its LSN is acknowledged.
///
/// # Errors
/// [`Error::Sql`].
pub async fn connect_dead_letter_writer(config: &tokio_postgres::Config) -> Result<Client, Error> {
    let client = connect(config).await?;
    client
        .batch_execute("SET synchronous_commit = on")
        .await
        .map_err(|e| Error::sql("preparing the dead-letter session", e))?;
    Ok(client)
}

/// Writes one dead letter and returns once it is committed. A second write for the same
/// LSN (a replay after a crash) is a no-op.
///
/// # Errors
/// [`Error::Sql`] (for example when `outbox.dead_letter` is missing: run `pgoutbox setup`).
pub async fn write_dead_letter(client: &Client, dl: &NewDeadLetter<'_>) -> Result<(), Error> {
    let lsn = dl.lsn.to_string();
    let commit_lsn = dl.commit_lsn.map(|l| l.to_string());
    client
        .execute(
            "INSERT INTO outbox.dead_letter
                (message_id, topic, lsn, commit_lsn, envelope, reason, attempts, first_error, last_error)
             VALUES ($1, $2, $3::text::pg_lsn, $4::text::pg_lsn, $5, $6, $7, $8, $9)
             ON CONFLICT (lsn) DO NOTHING",
            &[
                &dl.message_id,
                &dl.topic,
                &lsn,
                &commit_lsn,
                &dl.envelope,
                &dl.reason,
                &dl.attempts,
                &dl.first_error,
                &dl.last_error,
            ],
        )
        .await
        .map_err(|e| Error::sql(format!("writing a dead letter to outbox.dead_letter{}", dead_letter_hint(&e)), e))?;
    Ok(())
}

/// A hint for a failed statement on `outbox.dead_letter`: run `setup` when the table or
/// schema is missing (`42P01`, `3F000`), grant when a privilege is (`42501`).
fn dead_letter_hint(e: &tokio_postgres::Error) -> &'static str {
    match e.code().map(|c| c.code()) {
        Some("42P01" | "3F000") => {
            "; it does not exist in this database: run `pgoutbox setup --slot NAME` (as the database owner) first"
        }
        Some("42501") => {
            "; the role lacks a privilege: grant what sql/roles.example.sql grants to the streamer"
        }
        _ => "",
    }
}

/// Which dead letters a command applies to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Selection {
    /// These row ids.
    Ids(Vec<i64>),
    /// Rows dead-lettered more than this many seconds ago.
    OlderThanSecs(i64),
    /// Every row.
    All,
}

impl Selection {
    fn clause(&self) -> (&'static str, Vec<i64>) {
        match self {
            Selection::Ids(ids) => ("id = ANY($1)", ids.clone()),
            Selection::OlderThanSecs(s) => (
                "dead_lettered_at < now() - make_interval(secs => ($1::bigint[])[1])",
                vec![*s],
            ),
            Selection::All => ("$1::bigint[] IS NOT NULL", Vec::new()),
        }
    }
}

/// Lists dead letters, oldest first; requeued ones only with `include_requeued`.
///
/// # Errors
/// [`Error::Sql`].
pub async fn list_dead_letters(
    client: &Client,
    include_requeued: bool,
    limit: i64,
) -> Result<Vec<DeadLetter>, Error> {
    let rows = client
        .query(
            "SELECT id, message_id, topic, lsn::text, reason, attempts, first_error, last_error,
                    to_char(dead_lettered_at AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS\"Z\"'),
                    to_char(requeued_at AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS\"Z\"')
             FROM outbox.dead_letter
             WHERE $1 OR requeued_at IS NULL
             ORDER BY id LIMIT $2",
            &[&include_requeued, &limit],
        )
        .await
        .map_err(|e| {
            Error::sql(
                format!("listing outbox.dead_letter{}", dead_letter_hint(&e)),
                e,
            )
        })?;
    Ok(rows
        .iter()
        .map(|r| DeadLetter {
            id: r.get(0),
            message_id: r.get(1),
            topic: r.get(2),
            lsn: r.get(3),
            reason: r.get(4),
            attempts: r.get(5),
            first_error: r.get(6),
            last_error: r.get(7),
            dead_lettered_at: r.get(8),
            requeued_at: r.get(9),
        })
        .collect())
}

/// Why `requeue` refused one selected row.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RequeueRefusal {
    /// No row has this id.
    NotFound,
    /// The row was requeued already (at this time, RFC 3339 text): requeueing it again
    /// would deliver it twice.
    AlreadyRequeued(String),
    /// Its envelope does not decode (the decoder's reason): re-emitting it would only make
    /// the streamer dead-letter it again as `poison`.
    Undecodable(String),
}

/// Re-emits the selected dead letters through
/// `pg_logical_emit_message(true, 'pgoutbox', envelope)` in one transaction, in id order,
/// and marks them `requeued_at`. Returns the ids requeued.
///
/// All or nothing: when any selected row cannot be requeued (an `--id` that does not
/// exist, a row requeued already, an envelope this pgoutbox cannot decode), nothing is
/// requeued and the error names every such row with its reason. A selection other than
/// ids (`--all`) selects only the rows not requeued yet.
///
/// # Errors
/// [`Error::Precondition`] listing the refused rows and the fix; [`Error::Sql`].
pub async fn requeue_dead_letters(
    client: &mut Client,
    selection: &Selection,
) -> Result<Vec<i64>, Error> {
    let (clause, arg) = selection.clause();
    let unrequeued = if !matches!(selection, Selection::Ids(_)) {
        " AND requeued_at IS NULL"
    } else {
        ""
    };
    let tx = client
        .transaction()
        .await
        .map_err(|e| Error::sql("starting the requeue transaction", e))?;
    let rows = tx
        .query(
            &format!(
                "SELECT id,
                        to_char(requeued_at AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS\"Z\"')
                 FROM outbox.dead_letter WHERE {clause}{unrequeued} ORDER BY id FOR UPDATE"
            ),
            &[&arg],
        )
        .await
        .map_err(|e| {
            Error::sql(
                format!(
                    "reading the dead letters to requeue from outbox.dead_letter{}",
                    dead_letter_hint(&e)
                ),
                e,
            )
        })?;
    let mut refused: Vec<(i64, RequeueRefusal)> = Vec::new();
    if let Selection::Ids(ids) = selection {
        let found: std::collections::BTreeSet<i64> = rows.iter().map(|r| r.get(0)).collect();
        let missing: std::collections::BTreeSet<i64> = ids
            .iter()
            .copied()
            .filter(|id| !found.contains(id))
            .collect();
        refused.extend(missing.into_iter().map(|id| (id, RequeueRefusal::NotFound)));
    }
    let mut picked: Vec<i64> = Vec::with_capacity(rows.len());
    for row in &rows {
        let (id, requeued_at): (i64, Option<String>) = (row.get(0), row.get(1));
        if let Some(at) = requeued_at {
            refused.push((id, RequeueRefusal::AlreadyRequeued(at)));
            continue;
        }
        // One envelope in memory at a time: too_large rows are large by definition.
        let envelope: Vec<u8> = tx
            .query_one(
                "SELECT envelope FROM outbox.dead_letter WHERE id = $1",
                &[&id],
            )
            .await
            .map_err(|e| Error::sql(format!("reading dead letter {id}"), e))?
            .get(0);
        match crate::envelope::decode(bytes::Bytes::from(envelope)) {
            Ok(_) => picked.push(id),
            Err(e) => refused.push((id, RequeueRefusal::Undecodable(e.to_string()))),
        }
    }
    if !refused.is_empty() {
        refused.sort_by_key(|(id, _)| *id);
        return Err(Error::Precondition(describe_refusals(&refused)));
    }
    for id in &picked {
        tx.execute(
            "SELECT pg_logical_emit_message(true, 'pgoutbox', envelope) FROM outbox.dead_letter WHERE id = $1",
            &[id],
        )
        .await
        .map_err(|e| Error::sql(format!("re-emitting dead letter {id}"), e))?;
    }
    let ids = picked;
    tx.execute(
        "UPDATE outbox.dead_letter SET requeued_at = now() WHERE id = ANY($1)",
        &[&ids],
    )
    .await
    .map_err(|e| Error::sql("marking dead letters requeued", e))?;
    tx.commit()
        .await
        .map_err(|e| Error::sql("committing the requeue", e))?;
    Ok(ids)
}

/// The operator's message for refused requeues: one clause per row, then the fix.
fn describe_refusals(refused: &[(i64, RequeueRefusal)]) -> String {
    let rows: Vec<String> = refused
        .iter()
        .map(|(id, why)| match why {
            RequeueRefusal::NotFound => format!("id {id} does not exist"),
            RequeueRefusal::AlreadyRequeued(at) => {
                format!("id {id} was requeued already at {at} (requeueing it again would deliver it twice)")
            }
            RequeueRefusal::Undecodable(reason) => format!(
                "id {id} holds an envelope pgoutbox cannot decode ({reason}), so requeueing it would only dead-letter it again as poison; inspect it with SQL, then purge it"
            ),
        })
        .collect();
    format!(
        "requeued nothing: {}; fix the selection (`pgoutbox dead-letters list --all` shows every row) and run it again",
        rows.join("; ")
    )
}

/// Deletes the selected dead letters. Returns how many were deleted.
///
/// # Errors
/// [`Error::Sql`].
pub async fn purge_dead_letters(client: &Client, selection: &Selection) -> Result<u64, Error> {
    let (clause, arg) = selection.clause();
    client
        .execute(
            &format!("DELETE FROM outbox.dead_letter WHERE {clause}"),
            &[&arg],
        )
        .await
        .map_err(|e| {
            Error::sql(
                format!(
                    "purging dead letters from outbox.dead_letter{}",
                    dead_letter_hint(&e)
                ),
                e,
            )
        })
}
