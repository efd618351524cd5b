//! Everything pgoutbox does over ordinary SQL (tokio-postgres), by concept:
//! - [`provisioning`]: `setup` and `teardown`, and the server checks they make;
//! - [`inspection`]: the slot's state and health (`status`), the messages waiting in it
//!   (`peek`), the pre-flight checks `run` makes before it
//!   takes the slot (including the privileges it needs to write dead letters), and the outbox
//!   messages a slot still holds;
//! - [`dead_letters`]: `outbox.dead_letter`: the streamer's writes, and the `dead-letters`
//!   commands (list, requeue, purge);
//! - [`lockdown`]: `setup --lockdown` / `--unlock` and the lockdown record;
//! - [`journal`]: `outbox.journal`, the delivery journal (`run --journal`, `pgoutbox journal`);
//! - [`retention`]: deleting expired idempotency keys, journal rows and inbox records in
//!   small batches (`run`'s retention task, `pgoutbox maintenance`).
//!
//! This module holds the connection itself: [`connect`] and [`describe_target`].

use tokio_postgres::{Client, NoTls};

use crate::config::DatabaseConfig;
use crate::postgres_tls::{self, SslMode};

use crate::error::Error;

pub mod dead_letters;
pub mod inspection;
pub mod journal;
pub mod lockdown;
pub mod provisioning;
pub mod retention;

pub use dead_letters::{
    list_dead_letters, purge_dead_letters, requeue_dead_letters, write_dead_letter, DeadLetter,
    NewDeadLetter, RequeueRefusal, Selection,
};
pub use inspection::{
    background_grants, check_background_privileges, check_dead_letter_privileges,
    confirmed_flush_lsn, count_waiting, dead_letter_grants, health, peek_waiting,
    pending_outbox_messages, preflight, schema_flag, slot_retention, slot_status, HealthReport,
    LagThresholds, Payloads, PeekReport, Problem, Severity, SlotRetention, SlotStatus,
    WaitingCount, WaitingEnvelope, WaitingMessage,
};
pub use lockdown::{lock, lockdown_state, require_default_schema, unlock, LockdownState};
pub use provisioning::{
    check_replication_role, check_wal_level, create_roles, outboxes, publication_exists,
    resolve_prefix, setup, stored_prefix, teardown, RolesReport, SetupReport, TeardownReport,
    DEFAULT_PRODUCER_ROLE, DEFAULT_STREAMER_ROLE,
};

/// How long an ordinary SQL connection attempt may take when the URL sets no
/// `connect_timeout` (see [`crate::config::DEFAULT_CONNECT_TIMEOUT`]).
pub const CONNECT_TIMEOUT: std::time::Duration = crate::config::DEFAULT_CONNECT_TIMEOUT;

/// The producer helpers, installed by `setup` (idempotent).
pub const OUTBOX_SQL: &str = include_str!("../../sql/outbox.sql");

/// Connects an ordinary SQL session and spawns its connection task.
///
/// TLS follows the connection string's `sslmode` ([`crate::postgres_tls`]) through
/// tokio-postgres-rustls, on the same rustls configuration as the replication connection;
/// SCRAM uses `tls-server-end-point` channel binding over TLS unless `channel_binding=disable`.
/// With `sslmode=allow` a connection the server refuses in plaintext is tried again over TLS.
///
/// The whole handshake (TCP connect, startup, authentication) is bounded by the URL's
/// `connect_timeout` ([`crate::config::connect_timeout`]): tokio-postgres' own
/// `connect_timeout` covers only the TCP connect, so a server that accepts TCP and never
/// answers would otherwise hang here for ever.
///
/// # Errors
/// [`Error::PostgresConnectTimeout`] (retryable) when the handshake does not finish in
/// time; [`Error::PostgresPasswordMissing`] (definite) when the server asks for a password
/// the URL lacks; [`Error::PostgresTls`] when TLS or channel binding fails (definite for a
/// certificate that does not verify, a server without TLS, an unusable file);
/// [`Error::Sql`] when the connection fails otherwise, with a hint.
pub async fn connect(config: &DatabaseConfig) -> Result<Client, Error> {
    match connect_as(config, &config.pg).await {
        Err(Error::Sql { source, .. })
            if config.tls.mode == SslMode::Allow
                && source.as_db_error().is_some()
                && matches!(
                    config.pg.get_hosts().first(),
                    Some(tokio_postgres::config::Host::Tcp(_))
                ) =>
        {
            // libpq's allow: the server refused the plaintext session; try TLS.
            let mut pg = config.pg.clone();
            pg.ssl_mode(tokio_postgres::config::SslMode::Require);
            connect_as(config, &pg).await
        }
        other => other,
    }
}

/// A session for one of `run`'s background writers (dead letters, retention, journal):
/// [`connect`], then `synchronous_commit` (`local`, `off`, ...) and `lock_timeout` and
/// `statement_timeout` (whole milliseconds) for the session, so that a locked table costs
/// one failed statement instead of a task that hangs. `purpose` names the session in the
/// error ("dead-letter", "retention", "journal").
///
/// # Errors
/// As [`connect`]; [`Error::Sql`] ("preparing the `purpose` session") when the `SET`s fail.
pub async fn connect_background(
    config: &DatabaseConfig,
    synchronous_commit: &str,
    lock_timeout: std::time::Duration,
    statement_timeout: std::time::Duration,
    purpose: &str,
) -> Result<Client, Error> {
    let client = connect(config).await?;
    client
        .batch_execute(&format!(
            "SET synchronous_commit = {synchronous_commit}; SET lock_timeout = {}; SET statement_timeout = {}",
            lock_timeout.as_millis(),
            statement_timeout.as_millis()
        ))
        .await
        .map_err(|e| Error::sql(format!("preparing the {purpose} session"), e))?;
    Ok(client)
}

async fn connect_as(config: &DatabaseConfig, pg: &tokio_postgres::Config) -> Result<Client, Error> {
    let timeout = crate::config::connect_timeout(pg);
    let mut pg = pg.clone();
    pg.connect_timeout(timeout);
    let target = describe_target(&pg);
    let tls = &config.tls;
    let handshake = async {
        if pg.get_ssl_mode() == tokio_postgres::config::SslMode::Disable {
            pg.connect(NoTls).await.map(|(client, connection)| {
                tokio::spawn(async move {
                    if let Err(e) = connection.await {
                        tracing::debug!(error = %e, "sql connection ended");
                    }
                });
                client
            })
        } else {
            let rustls = tls.client_config(&target).map_err(Error::PostgresTls)?;
            let connector = tokio_postgres_rustls::MakeRustlsConnect::new((*rustls).clone());
            pg.connect(connector).await.map(|(client, connection)| {
                tokio::spawn(async move {
                    if let Err(e) = connection.await {
                        tracing::debug!(error = %e, "sql connection ended");
                    }
                });
                client
            })
        }
        .map_err(|e| explain(e, config, &target))
    };
    tokio::time::timeout(timeout, handshake)
        .await
        .map_err(|_| Error::PostgresConnectTimeout {
            target: target.clone(),
            timeout_s: timeout.as_secs(),
        })?
}

/// Turns a failed tokio-postgres connect into our error: TLS and channel binding failures
/// explained ([`postgres_tls`]), a missing password, or an SQL error with a hint.
fn explain(e: tokio_postgres::Error, config: &DatabaseConfig, target: &str) -> Error {
    let tls = &config.tls;
    if is_password_missing(&e) {
        return Error::PostgresPasswordMissing {
            target: target.to_owned(),
            source: e,
        };
    }
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(&e);
    while let Some(s) = source {
        if let Some(io) = s.downcast_ref::<std::io::Error>() {
            if postgres_tls::rustls_error(io).is_some() {
                let host = match config.pg.get_hosts().first() {
                    Some(tokio_postgres::config::Host::Tcp(h)) => h.clone(),
                    _ => String::new(),
                };
                return Error::PostgresTls(postgres_tls::handshake_error(io, tls, &host, target));
            }
        }
        source = s.source();
    }
    let chain = crate::error::one_line(&e);
    if chain.contains("server does not support TLS") {
        return Error::PostgresTls(postgres_tls::refused_tls(tls, target));
    }
    if chain.contains("server did not use channel binding") {
        return Error::PostgresTls(postgres_tls::channel_binding_unavailable(
            target,
            &channel_binding_offer(tls, &config.pg),
        ));
    }
    let hint = match e.as_db_error() {
        Some(db) if postgres_tls::hba_hint(db.message(), tls).is_some() => {
            postgres_tls::hba_hint(db.message(), tls).unwrap_or_default()
        }
        _ if e.code().is_some_and(|c| c.code().starts_with("28")) => {
            "check the user and password in --database-url (PGOUTBOX_DATABASE_URL)".into()
        }
        _ if e.code().is_some_and(|c| c.code() == "3D000") => {
            "check the database name in --database-url (PGOUTBOX_DATABASE_URL)".into()
        }
        _ => "check host, port and dbname in --database-url (PGOUTBOX_DATABASE_URL) and that PostgreSQL is running".to_owned(),
    };
    Error::sql(format!("connecting to {target}; {hint}"), e)
}

/// What the server did when `channel_binding=require` failed on the SQL connection
/// (tokio-postgres says only "server did not use channel binding").
fn channel_binding_offer(tls: &postgres_tls::PostgresTls, pg: &tokio_postgres::Config) -> String {
    if pg.get_ssl_mode() == tokio_postgres::config::SslMode::Disable {
        "the connection is not over TLS (a Unix-domain socket or sslmode=allow in plaintext), so there is nothing to bind to".into()
    } else if tls.mode == SslMode::Prefer {
        "the server did not offer SCRAM-SHA-256-PLUS: it answered the SSLRequest with N (ssl = off) and the session is plaintext, or it authenticated without SCRAM".into()
    } else {
        "the server did not offer SCRAM-SHA-256-PLUS over TLS (it authenticated with password, md5 or trust, or the role's password is not stored as SCRAM)".into()
    }
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
