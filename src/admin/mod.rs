//! Everything pgoutbox does over ordinary SQL (tokio-postgres), by concept:
//! - [`provisioning`]: `setup` and `teardown`, and the server checks they make;
//! - [`inspection`]: the slot's state and health (`status`), the messages waiting in it
//!   (`peek`), the pre-flight checks `run` makes before it
//!   takes the slot (including the privileges it needs to write dead letters), and the outbox
//!   messages a slot still holds;
//! - [`dead_letters`]: `outbox.dead_letter`: the streamer's writes, and the `dead-letters`
//!   commands (list, requeue, purge);
//! - [`lockdown`]: `setup --lockdown` / `--unlock` and the lockdown record.
//!
//! This module holds the connection itself: [`connect`] and [`describe_target`].

use tokio_postgres::{Client, NoTls};

use crate::error::Error;

pub mod dead_letters;
pub mod inspection;
pub mod lockdown;
pub mod provisioning;

pub use dead_letters::{
    list_dead_letters, purge_dead_letters, requeue_dead_letters, write_dead_letter, DeadLetter,
    NewDeadLetter, RequeueRefusal, Selection,
};
pub use inspection::{
    check_dead_letter_privileges, confirmed_flush_lsn, count_waiting, dead_letter_grants, health,
    peek_waiting, pending_outbox_messages, preflight, slot_retention, slot_status, HealthReport,
    LagThresholds, Payloads, PeekReport, Problem, Severity, SlotRetention, SlotStatus,
    WaitingCount, WaitingEnvelope, WaitingMessage,
};
pub use lockdown::{lock, lockdown_state, unlock, LockdownState};
pub use provisioning::{
    check_replication_role, check_wal_level, create_roles, publication_exists, setup, teardown,
    RolesReport, SetupReport, TeardownReport, DEFAULT_PRODUCER_ROLE, DEFAULT_STREAMER_ROLE,
};

/// How long an ordinary SQL connection attempt may take when the URL sets no
/// `connect_timeout` (see [`crate::config::DEFAULT_CONNECT_TIMEOUT`]).
pub const CONNECT_TIMEOUT: std::time::Duration = crate::config::DEFAULT_CONNECT_TIMEOUT;

/// The producer helpers, installed by `setup` (idempotent).
pub const OUTBOX_SQL: &str = include_str!("../../sql/outbox.sql");

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
