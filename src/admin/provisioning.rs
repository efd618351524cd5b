//! `setup` and `teardown` (the server checks they make are [`super::server`]'s).

use serde::Serialize;
use tokio_postgres::Client;

use crate::config::DatabaseConfig;
use crate::error::Error;
use crate::outbox_schema::{install_sql, MessagePrefix, SchemaName, SETTINGS_SQL};
use crate::replication::connect::ReplicationConnection;

use super::inspection::{pending_outbox_messages, schema_flag, slot_status};
use super::server::{check_replication_role, check_wal_level, publication_exists};
use super::OUTBOX_SQL;

/// The prefix recorded in `schema`'s settings table (`sql/settings.sql`); `None` when the
/// table (or its row) does not exist.
///
/// # Errors
/// [`Error::Sql`] when it exists and cannot be read; [`Error::Precondition`] when it holds
/// a prefix pgoutbox would refuse (edited by hand).
pub async fn stored_prefix(
    client: &Client,
    schema: &SchemaName,
) -> Result<Option<MessagePrefix>, Error> {
    let exists: bool = client
        .query_one(
            &*schema.rewrite("SELECT to_regclass('outbox.settings') IS NOT NULL"),
            &[],
        )
        .await
        .map_err(|e| Error::sql(format!("looking up {}", schema.qualify("settings")), e))?
        .get(0);
    if !exists {
        return Ok(None);
    }
    let row = client
        .query_opt(
            &*schema.rewrite("SELECT message_prefix FROM outbox.settings"),
            &[],
        )
        .await
        .map_err(|e| Error::sql(format!("reading {}", schema.qualify("settings")), e))?;
    let Some(row) = row else {
        return Ok(None);
    };
    let text: String = row.get(0);
    MessagePrefix::parse("--prefix", &text)
        .map(Some)
        .map_err(|e| {
            Error::Precondition(format!(
                "{} holds message_prefix {text:?}, which pgoutbox refuses ({}); run `pgoutbox setup{} --prefix NAME` with the prefix the helpers write",
                schema.qualify("settings"),
                e.rule,
                schema_flag(schema)
            ))
        })
}

/// The prefix of the outbox in `schema`: `given` (`--prefix`) when set, else the one
/// `setup` stored ([`stored_prefix`]), else [`MessagePrefix::default`] for the default
/// schema (a database set up before prefixes were stored).
///
/// # Errors
/// [`Error::Precondition`] for another schema with nothing stored (not set up: run
/// `setup --schema S --prefix P`); what [`stored_prefix`] returns.
pub async fn resolve_prefix(
    client: &Client,
    schema: &SchemaName,
    given: Option<&MessagePrefix>,
) -> Result<MessagePrefix, Error> {
    let stored = stored_prefix(client, schema).await?;
    if let Some(p) = given {
        if stored.as_ref().is_some_and(|s| s != p) {
            tracing::warn!(
                schema = %schema,
                prefix = %p,
                stored_prefix = %stored.as_ref().map(ToString::to_string).unwrap_or_default(),
                "--prefix overrides the prefix setup stored for this schema: messages its helpers write are not published by this process"
            );
        }
        return Ok(p.clone());
    }
    match stored {
        Some(p) => Ok(p),
        None if schema.is_default() => Ok(MessagePrefix::default()),
        None => Err(Error::Precondition(format!(
            "schema {schema} holds no pgoutbox outbox ({} is missing): run `pgoutbox setup --schema {schema} --prefix NAME` first, or fix --schema",
            schema.qualify("settings")
        ))),
    }
}

/// Whether `setup` installed the outbox in `schema`: its producer helper `emit` and its
/// `dead_letter` table both exist (`check` reported an outbox before `setup` as ok).
///
/// # Errors
/// [`Error::Sql`] when the catalogs cannot be read.
pub async fn outbox_installed(client: &Client, schema: &SchemaName) -> Result<bool, Error> {
    Ok(client
        .query_one(
            &*schema.rewrite(
                "SELECT to_regclass('outbox.dead_letter') IS NOT NULL
                    AND EXISTS (SELECT 1 FROM pg_catalog.pg_proc
                                 WHERE pronamespace = to_regnamespace('outbox')
                                   AND proname = 'emit')",
            ),
            &[],
        )
        .await
        .map_err(|e| Error::sql(format!("looking up the outbox in schema {schema}"), e))?
        .get(0))
}

/// Every outbox of this database and its prefix: the schemas holding a `dead_letter` table
/// and a `settings` table with a `message_prefix`, and schema `outbox` with `dead_letter`
/// but no `settings` (set up by an older pgoutbox: prefix `pgoutbox`). Schemas this role
/// cannot read are skipped.
///
/// # Errors
/// [`Error::Sql`] when the catalogs cannot be read.
pub async fn outboxes(client: &Client) -> Result<Vec<(String, String)>, Error> {
    let rows = client
        .query(
            "SELECT n.nspname::text, quote_ident(n.nspname),
                    EXISTS (SELECT 1 FROM pg_class s JOIN pg_attribute a ON a.attrelid = s.oid
                            WHERE s.relnamespace = n.oid AND s.relname = 'settings'
                              AND a.attname = 'message_prefix' AND NOT a.attisdropped)
               FROM pg_namespace n
               JOIN pg_class d ON d.relnamespace = n.oid AND d.relname = 'dead_letter' AND d.relkind = 'r'
              ORDER BY 1",
            &[],
        )
        .await
        .map_err(|e| Error::sql("listing the outboxes of this database", e))?;
    let mut found = Vec::new();
    for row in rows {
        let (name, quoted, has_settings): (String, String, bool) =
            (row.get(0), row.get(1), row.get(2));
        if !has_settings {
            if name == crate::outbox_schema::DEFAULT_SCHEMA {
                found.push((name, crate::outbox_schema::DEFAULT_PREFIX.to_owned()));
            }
            continue;
        }
        if let Ok(Some(r)) = client
            .query_opt(
                &format!("SELECT message_prefix FROM {quoted}.settings"),
                &[],
            )
            .await
        {
            found.push((name, r.get(0)));
        }
    }
    Ok(found)
}

/// The prefix `setup` installs for `schema`: `given`, or the stored one, or the default
/// for the default schema; refused when it differs from the stored one (the streamer
/// would skip messages already written with the old one) or when another outbox of the
/// database uses it (each streamer would publish the other's messages).
async fn setup_prefix(
    client: &Client,
    schema: &SchemaName,
    given: Option<&MessagePrefix>,
) -> Result<MessagePrefix, Error> {
    let stored = stored_prefix(client, schema).await?;
    let prefix = match (given, stored) {
        (Some(p), Some(s)) if *p != s => {
            return Err(Error::Precondition(format!(
                "--prefix {p}: the outbox in schema {schema} writes prefix {s} (recorded in {}); changing it would make `run` skip the messages already written with {s}: run setup with --prefix {s} (or without --prefix), or set up a new schema for the new prefix",
                schema.qualify("settings")
            )))
        }
        (Some(p), _) => p.clone(),
        (None, Some(s)) => s,
        (None, None) if schema.is_default() => MessagePrefix::default(),
        (None, None) => {
            return Err(Error::Precondition(format!(
                "--schema {schema} needs --prefix on its first setup: the default prefix {} belongs to the outbox in schema {}; pick a prefix of its own, e.g. --prefix {schema}",
                crate::outbox_schema::DEFAULT_PREFIX,
                crate::outbox_schema::DEFAULT_SCHEMA
            )))
        }
    };
    for (other, used) in outboxes(client).await? {
        if other != schema.as_str() && used == prefix.as_str() {
            return Err(Error::Precondition(format!(
                "--prefix {prefix}: the outbox in schema {other} already writes prefix {used}; two outboxes with one prefix would each publish the other's messages: pick another --prefix for schema {schema}"
            )));
        }
    }
    Ok(prefix)
}

/// Whether `teardown` may drop a slot that still holds unsent outbox messages
/// (`teardown --force`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Force {
    /// Refuse while outbox messages are unsent.
    No,
    /// Drop anyway; the unsent messages are lost.
    Yes,
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
    /// The prefix the schema's helpers write (stored in its settings table).
    pub prefix: MessagePrefix,
    /// The slot's `failover` flag after setup; `None` on a server older than PostgreSQL 17,
    /// which has no failover slots.
    pub failover: Option<bool>,
    /// The slot existed as an ordinary slot and setup made it a failover slot
    /// (`ALTER_REPLICATION_SLOT ... (FAILOVER true)`).
    pub failover_altered: bool,
    /// Why the slot is not a failover slot although the server could have one, with the fix
    /// (with [`SlotFailover::Auto`]: an existing slot held by a streamer cannot be altered).
    pub failover_note: Option<String>,
}

/// Whether `setup` creates a failover slot (`setup --failover[=true|false]`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SlotFailover {
    /// An ordinary slot: it lives on this server only (`--failover=false`). An existing
    /// failover slot is left as it is.
    Off,
    /// A failover slot (PostgreSQL 17+, `failover = true`): physical standbys with
    /// `sync_replication_slots = on` keep a synced copy, usable after a promotion
    /// (`--failover`). Refused on older servers, and for an existing slot that a streamer
    /// holds (it cannot be altered then).
    On,
    /// The default: [`SlotFailover::On`] where the server has failover slots (17+), an
    /// ordinary slot elsewhere; an existing slot that a streamer holds is left as it is, with
    /// a note.
    Auto,
}

/// The first PostgreSQL version (`server_version_num`) with failover slots.
pub const FAILOVER_SLOTS_SINCE: i32 = 170_000;

/// Installs `sql/outbox.sql`, `sql/stream_state.sql` and `sql/settings.sql` in `schema`
/// (transformed by [`install_sql`]: the helpers write `prefix`), records the prefix in the
/// schema's settings table, installs `sql/inbox.sql` (the consumer-side inbox,
/// [`crate::inbox`]; with the default schema only: the inbox is not per outbox), creates
/// the publication (no tables) and the pgoutput slot when missing, a failover slot on
/// PostgreSQL 17+ unless `failover` is [`SlotFailover::Off`] (an existing ordinary slot is
/// altered to one through a replication connection to `config`, while no streamer holds it).
/// Idempotent.
///
/// The prefix: `prefix` (`--prefix`), else the one stored before, else `pgoutbox` for
/// the default schema; another schema must name one on its first setup.
///
/// # Errors
/// [`Error::Precondition`] for `wal_level`, missing `REPLICATION`, no free slot, an
/// existing slot with another plugin or database, or [`SlotFailover::On`] on a server older
/// than 17 or with an existing ordinary slot that cannot be altered (a streamer holds it), a
/// prefix that differs from
/// the stored one or that another outbox of the database uses, no prefix for a new
/// non-default schema; [`Error::Sql`] otherwise.
#[allow(clippy::too_many_arguments)]
pub async fn setup(
    client: &Client,
    config: &DatabaseConfig,
    schema: &SchemaName,
    prefix: Option<&MessagePrefix>,
    slot: &str,
    publication: &str,
    failover: SlotFailover,
) -> Result<SetupReport, Error> {
    check_wal_level(client).await?;
    check_replication_role(client).await?;
    let version: i32 = client
        .query_one("SELECT current_setting('server_version_num')::int", &[])
        .await
        .map_err(|e| Error::sql("reading server_version_num", e))?
        .get(0);
    let has_failover_slots = version >= FAILOVER_SLOTS_SINCE;
    // Whether the slot should be a failover slot, on this server.
    let want_failover = match failover {
        SlotFailover::Off => false,
        SlotFailover::Auto => has_failover_slots,
        SlotFailover::On => true,
    };
    if failover == SlotFailover::On && !has_failover_slots {
        return Err(Error::Precondition(format!(
            "--failover: this server is PostgreSQL {}.{} and cannot create failover slots (they need PostgreSQL 17 or newer); run setup without --failover and keep the slot across a failover another way, e.g. as a Patroni permanent slot (see docs/src/operators/postgres-failover.md)",
            version / 10_000,
            version % 10_000 / 100
        )));
    }
    let prefix = setup_prefix(client, schema, prefix).await?;
    client
        .batch_execute(&install_sql(OUTBOX_SQL, schema, &prefix))
        .await
        .map_err(|e| Error::sql(format!("installing sql/outbox.sql in schema {schema}"), e))?;
    client
        .batch_execute(&install_sql(
            crate::stream_state::STREAM_STATE_SQL,
            schema,
            &prefix,
        ))
        .await
        .map_err(|e| {
            Error::sql(
                format!("installing sql/stream_state.sql in schema {schema}"),
                e,
            )
        })?;
    client
        .batch_execute(&install_sql(SETTINGS_SQL, schema, &prefix))
        .await
        .map_err(|e| Error::sql(format!("installing sql/settings.sql in schema {schema}"), e))?;
    client
        .execute(
            &*schema.rewrite(
                "INSERT INTO outbox.settings AS s (message_prefix) VALUES ($1)
                 ON CONFLICT (singleton) DO UPDATE SET message_prefix = EXCLUDED.message_prefix,
                     updated_at = now()
                 WHERE s.message_prefix <> EXCLUDED.message_prefix",
            ),
            &[&prefix.as_str()],
        )
        .await
        .map_err(|e| {
            Error::sql(
                format!("recording the prefix in {}", schema.qualify("settings")),
                e,
            )
        })?;
    if schema.is_default() {
        // Under lockdown: the helpers just installed are pgoutbox's own definitions.
        super::lockdown::record_fingerprint(client).await?;
        client
            .batch_execute(crate::inbox::INBOX_SQL)
            .await
            .map_err(|e| Error::sql("installing sql/inbox.sql", e))?;
    }
    client
        .batch_execute(&install_sql(super::journal::JOURNAL_SQL, schema, &prefix))
        .await
        .map_err(|e| Error::sql(format!("installing sql/journal.sql in schema {schema}"), e))?;
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
    let mut failover_altered = false;
    let mut failover_note = None;
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
            if want_failover && slot_failover(client, slot).await? == Some(false) {
                match alter_slot_failover(client, config, slot).await {
                    Ok(()) => failover_altered = true,
                    Err(reason) if failover == SlotFailover::On => {
                        return Err(Error::Precondition(format!(
                            "--failover: slot {slot:?} exists and is not a failover slot, and setup could not make it one ({reason}); stop the streamer that holds it and run setup again, or run ALTER_REPLICATION_SLOT {slot} (FAILOVER true) on a replication connection (psql \"dbname=... replication=database\") while no streamer holds it"
                        )));
                    }
                    Err(reason) => {
                        failover_note = Some(format!(
                            "slot {slot:?} is not a failover slot and setup could not make it one ({reason}), so it will not survive a failover of the primary; stop the streamer that holds it and run setup again (or setup --failover=false to keep an ordinary slot without this note)"
                        ));
                    }
                }
            }
            false
        }
        None => {
            let create = if want_failover {
                // (slot_name, plugin, temporary, twophase, failover): PostgreSQL 17+.
                "SELECT lsn::text FROM pg_create_logical_replication_slot($1, 'pgoutput', false, false, true)"
            } else {
                "SELECT lsn::text FROM pg_create_logical_replication_slot($1, 'pgoutput')"
            };
            if let Err(e) = client.query_one(create, &[&slot]).await {
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
    let failover = if has_failover_slots {
        slot_failover(client, slot).await?
    } else {
        None
    };
    Ok(SetupReport {
        publication_created,
        slot_created,
        confirmed_flush_lsn: status.confirmed_flush_lsn.unwrap_or_default(),
        prefix,
        failover,
        failover_altered,
        failover_note,
    })
}

/// The slot's `failover` flag (`pg_replication_slots.failover`, PostgreSQL 17+); `None` when
/// the slot is missing. Call only on a server that has the column.
async fn slot_failover(client: &Client, slot: &str) -> Result<Option<bool>, Error> {
    Ok(client
        .query_opt(
            "SELECT failover FROM pg_replication_slots WHERE slot_name = $1",
            &[&slot],
        )
        .await
        .map_err(|e| Error::sql("reading the slot's failover flag", e))?
        .map(|r| r.get(0)))
}

/// Makes an existing slot a failover slot: `ALTER_REPLICATION_SLOT slot (FAILOVER true)` on a
/// replication connection (PostgreSQL 17 has no SQL function for it). The server would wait
/// for a slot that a streamer holds until it is released, so a held slot is not tried, and a
/// command that still waits after [`ALTER_SLOT_WAIT`] (a streamer took the slot in between) is
/// cancelled. The reason it could not be done is returned as one line.
async fn alter_slot_failover(
    client: &Client,
    config: &DatabaseConfig,
    slot: &str,
) -> Result<(), String> {
    let holder = client
        .query_opt(
            "SELECT s.active_pid, coalesce(a.application_name, '') FROM pg_replication_slots s
             LEFT JOIN pg_stat_activity a ON a.pid = s.active_pid
             WHERE s.slot_name = $1 AND s.active",
            &[&slot],
        )
        .await
        .map_err(|e| crate::report::one_line(&e))?;
    if let Some(row) = holder {
        let (pid, name): (Option<i32>, String) = (row.get(0), row.get(1));
        return Err(format!(
            "a streamer holds it: pid {}, application_name {name:?}",
            pid.map(|p| p.to_string())
                .unwrap_or_else(|| "unknown".into())
        ));
    }
    // Unique, so that a command left waiting can be found and cancelled.
    let application_name = format!("pgoutbox-setup-{}", std::process::id());
    let alter = async {
        let mut conn = ReplicationConnection::connect(config, &application_name)
            .await
            .map_err(|e| crate::report::one_line(&e))?;
        conn.simple_query(
            &format!("ALTER_REPLICATION_SLOT \"{slot}\" (FAILOVER true)"),
            "altering the slot to a failover slot",
        )
        .await
        .map_err(|e| crate::report::one_line(&e))?;
        Ok(())
    };
    match tokio::time::timeout(ALTER_SLOT_WAIT, alter).await {
        Ok(result) => result,
        Err(_) => {
            let _ = client
                .execute(
                    "SELECT pg_cancel_backend(pid) FROM pg_stat_activity
                     WHERE application_name = $1 AND backend_type = 'walsender'",
                    &[&application_name],
                )
                .await;
            Err(format!(
                "a streamer took it while setup waited {} s to alter it",
                ALTER_SLOT_WAIT.as_secs()
            ))
        }
    }
}

/// How long `setup` waits for `ALTER_REPLICATION_SLOT` (it waits while the slot is held).
const ALTER_SLOT_WAIT: std::time::Duration = std::time::Duration::from_secs(20);

/// What `teardown` did.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct TeardownReport {
    /// The slot existed and was dropped.
    pub slot_dropped: bool,
    /// The publication existed and was dropped.
    pub publication_dropped: bool,
}

/// Drops the slot and the publication, and the slot's row in `schema`'s `stream_state`.
/// Refuses while the slot holds unsent messages of the outbox in `schema` (its prefix)
/// unless `force`; refuses while the slot is active. The schema itself is kept.
///
/// # Errors
/// [`Error::Precondition`] with the reason and the fix; [`Error::Sql`].
pub async fn teardown(
    client: &Client,
    schema: &SchemaName,
    slot: &str,
    publication: &str,
    force: Force,
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
            if force == Force::No && status.wal_status.as_deref() != Some("lost") {
                let prefix = resolve_prefix(client, schema, None).await?;
                let pending = pending_outbox_messages(client, slot, publication, &prefix).await?;
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
        // The slot's history ends here on purpose: a new slot starts a new record.
        crate::stream_state::forget(client, schema, slot).await?;
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

/// `sql/roles.sql`: the least-privilege streamer and producer roles (`setup --create-roles`).
pub const ROLES_SQL: &str = include_str!("../../sql/roles.sql");

/// Default `--streamer-role`.
pub const DEFAULT_STREAMER_ROLE: &str = "pgoutbox_streamer";
/// Default `--producer-role`.
pub const DEFAULT_PRODUCER_ROLE: &str = "pgoutbox_producer";

/// What `setup --create-roles` did.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct RolesReport {
    /// The roles created now (the others existed and were kept as they are).
    pub created: Vec<String>,
}

/// Creates the streamer role (`LOGIN REPLICATION`) and the producer role (`NOLOGIN`) when
/// missing and grants them, in the connected database, what `run` and `outbox.emit` need:
/// `sql/roles.sql`, its function defined in `pg_temp` and called with these names.
/// Idempotent; run after [`setup`] (the grants name the objects of `schema`).
///
/// # Errors
/// [`Error::Config`] for a name that is not 1 to 63 of `a-z`, `0-9`, `_`;
/// [`Error::Precondition`] when the connected role may not create roles with REPLICATION
/// (a superuser is needed); [`Error::Sql`] otherwise.
pub async fn create_roles(
    client: &Client,
    schema: &SchemaName,
    streamer: &str,
    producer: &str,
) -> Result<RolesReport, Error> {
    crate::config::validate_identifier("--streamer-role", streamer)?;
    crate::config::validate_identifier("--producer-role", producer)?;
    let (definition, _call) = ROLES_SQL
        .split_once("-- pgoutbox-call")
        .expect("sql/roles.sql has its call marker");
    let fail = |e: tokio_postgres::Error| {
        if e.code().map(|c| c.code()) == Some("42501") {
            Error::Precondition(format!(
                "--create-roles needs a superuser (creating a role with REPLICATION does): run `pgoutbox setup --create-roles` as one, or have one run sql/roles.sql ({})",
                e.as_db_error().map(|d| d.message()).unwrap_or("permission denied")
            ))
        } else {
            Error::sql("creating the roles of sql/roles.sql", e)
        }
    };
    client
        .batch_execute(&schema.rewrite(definition))
        .await
        .map_err(fail)?;
    let row = client
        .query_one(
            "SELECT pg_temp.pgoutbox_create_roles($1::text::name, $2::text::name)",
            &[&streamer, &producer],
        )
        .await
        .map_err(fail)?;
    let created: String = row.get(0);
    Ok(RolesReport {
        created: created
            .split(',')
            .filter(|s| !s.is_empty())
            .map(str::to_owned)
            .collect(),
    })
}
