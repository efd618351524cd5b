//! Making PostgreSQL sessions: the one place where pgoutbox opens an ordinary SQL
//! connection (for `run`'s pipeline and its background writers, the admin commands and
//! `check`), with TLS as the connection string asks ([`tls`], also the replication
//! connection's), the handshake bounded by `connect_timeout`, the session settings of the
//! background writers, pgoutbox's `application_name`, and failures explained for the
//! operator (a TLS error, a missing password, a `pg_hba.conf` line that wants TLS).
//!
//! Below the pipeline and admin: it reads the parsed settings ([`crate::config::DatabaseConfig`])
//! and knows nothing of what the sessions are used for. Its own [`Error`] converts into the
//! top-level one, which decides what is retried.

use tokio_postgres::{Client, NoTls};

use crate::config::{DatabaseConfig, PostgresTls, SslMode};

pub mod tls;

pub use tls::TlsError;

/// A connection that could not be made or prepared.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The handshake (TCP connect, startup and authentication) did not complete within the
    /// connect timeout: the host accepted TCP, or nobody answered, and the server never
    /// finished. Retryable (`run` reconnects with backoff).
    #[error("connecting to {target} timed out after {timeout_s} s (connect_timeout): the server did not finish the connection handshake; check that PostgreSQL is running and answering at that host and port, or raise connect_timeout in --database-url (for example ?connect_timeout=30)")]
    ConnectTimeout {
        /// `user@host:port/dbname` (no password).
        target: String,
        /// The timeout applied, in seconds.
        timeout_s: u64,
    },
    /// The server asked for a password and the database URL carries none. Definite.
    #[error("{target} asks for a password and none was given: add it to --database-url (PGOUTBOX_DATABASE_URL) as postgres://user:password@host:port/db, or put it alone in a file named by PGOUTBOX_DATABASE_PASSWORD_FILE")]
    PasswordMissing {
        /// `user@host:port/dbname` (no password).
        target: String,
        /// tokio-postgres' error.
        #[source]
        source: tokio_postgres::Error,
    },
    /// TLS failed: a certificate that did not verify, a server without TLS where the mode
    /// needs it, an unusable TLS file, channel binding that `channel_binding=require` could
    /// not get. Definite or not as its `definite` says.
    #[error(transparent)]
    Tls(TlsError),
    /// The connection failed otherwise, or the session's settings could not be set.
    #[error("postgres: {context}")]
    Sql {
        /// What we were doing, with a hint.
        context: String,
        /// tokio-postgres' error (carries the SQLSTATE).
        #[source]
        source: tokio_postgres::Error,
    },
}

/// How long a Postgres connection handshake (TCP connect, startup, authentication, up to
/// the first ReadyForQuery) may take when the URL sets no `connect_timeout`: long enough for
/// a loaded server or a slow SCRAM exchange, short enough that a host that accepts TCP and
/// never answers is reported promptly instead of hanging `status` or `run`.
pub const DEFAULT_CONNECT_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

/// The handshake timeout for a Postgres connection: libpq's `connect_timeout` from the URL
/// (seconds), else [`DEFAULT_CONNECT_TIMEOUT`]. tokio-postgres' parser drops
/// `connect_timeout=0` (libpq: wait for ever), so 0 also means the default: pgoutbox never
/// waits for ever on a handshake.
pub fn connect_timeout(config: &tokio_postgres::Config) -> std::time::Duration {
    config
        .get_connect_timeout()
        .copied()
        .filter(|t| !t.is_zero())
        .unwrap_or(DEFAULT_CONNECT_TIMEOUT)
}

/// `PostgreSQL user@host:port/dbname` of a connection config, for error messages (no
/// password). The first host and port are shown.
pub fn describe_target(config: &tokio_postgres::Config) -> String {
    let host = match config.get_hosts().first() {
        Some(tokio_postgres::config::Host::Tcp(h)) => h.clone(),
        Some(tokio_postgres::config::Host::Unix(p)) => p.display().to_string(),
        None => "localhost".into(),
    };
    format!(
        "PostgreSQL {}@{}:{}/{}",
        config.get_user().unwrap_or("?"),
        host,
        config.get_ports().first().copied().unwrap_or(5432),
        config.get_dbname().unwrap_or("?")
    )
}

/// The `application_name` of `run`'s sessions with this `--instance-id`: `pgoutbox-ID`, so
/// that `pg_stat_activity`, `pg_stat_replication` and `status` tell the streamers apart.
pub fn application_name(instance_id: &str) -> String {
    format!("pgoutbox-{instance_id}")
}

/// The `application_name` of pgoutbox's ordinary SQL sessions when neither the connection
/// string nor [`DatabaseConfig::session_name`] sets one (the admin commands, `check`).
pub const SQL_APPLICATION_NAME: &str = "pgoutbox";

/// Connects an ordinary SQL session and spawns its connection task.
///
/// The session's `application_name` is the connection string's; else
/// [`DatabaseConfig::session_name`] (`run`: `pgoutbox-ID`, the name of its replication
/// session too, see [`application_name`]); else [`SQL_APPLICATION_NAME`]. A background
/// writer's ([`connect_background`]) adds its purpose: `pgoutbox-ID dead-letter`.
///
/// TLS follows the connection string's `sslmode` ([`tls`]) through
/// tokio-postgres-rustls, on the same rustls configuration as the replication connection;
/// SCRAM uses `tls-server-end-point` channel binding over TLS unless `channel_binding=disable`.
/// With `sslmode=allow` a connection the server refuses in plaintext is tried again over TLS.
///
/// The whole handshake (TCP connect, startup, authentication) is bounded by the URL's
/// `connect_timeout` ([`connect_timeout`]): tokio-postgres' own
/// `connect_timeout` covers only the TCP connect, so a server that accepts TCP and never
/// answers would otherwise hang here for ever.
///
/// # Errors
/// [`Error::ConnectTimeout`] (retryable) when the handshake does not finish in
/// time; [`Error::PasswordMissing`] (definite) when the server asks for a password
/// the URL lacks; [`Error::Tls`] when TLS or channel binding fails (definite for a
/// certificate that does not verify, a server without TLS, an unusable file);
/// [`Error::Sql`] when the connection fails otherwise, with a hint.
pub async fn connect(config: &DatabaseConfig) -> Result<Client, Error> {
    connect_named(config, None).await
}

/// [`connect`], naming the session (see there) with `purpose` after the name.
async fn connect_named(config: &DatabaseConfig, purpose: Option<&str>) -> Result<Client, Error> {
    let named;
    let config = if config.pg.get_application_name().is_some() {
        config
    } else {
        let base = config
            .session_name
            .as_deref()
            .unwrap_or(SQL_APPLICATION_NAME);
        let mut c = config.clone();
        c.pg.application_name(&match purpose {
            Some(p) => format!("{base} {p}"),
            None => base.to_owned(),
        });
        named = c;
        &named
    };
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
/// error ("dead-letter", "retention", "journal") and in its `application_name` (see
/// [`connect`]).
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
    let client = connect_named(config, Some(purpose)).await?;
    client
        .batch_execute(&format!(
            "SET synchronous_commit = {synchronous_commit}; SET lock_timeout = {}; SET statement_timeout = {}",
            lock_timeout.as_millis(),
            statement_timeout.as_millis()
        ))
        .await
        .map_err(|e| Error::Sql {
            context: format!("preparing the {purpose} session"),
            source: e,
        })?;
    Ok(client)
}

async fn connect_as(config: &DatabaseConfig, pg: &tokio_postgres::Config) -> Result<Client, Error> {
    let timeout = connect_timeout(pg);
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
            let rustls = tls.load_client_config(&target).await.map_err(Error::Tls)?;
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
        .map_err(|_| Error::ConnectTimeout {
            target: target.clone(),
            timeout_s: timeout.as_secs(),
        })?
}

/// Turns a failed tokio-postgres connect into our error: TLS and channel binding failures
/// explained ([`tls`]), a missing password, or an SQL error with a hint.
fn explain(e: tokio_postgres::Error, config: &DatabaseConfig, target: &str) -> Error {
    let tls = &config.tls;
    if is_password_missing(&e) {
        return Error::PasswordMissing {
            target: target.to_owned(),
            source: e,
        };
    }
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(&e);
    while let Some(s) = source {
        if let Some(io) = s.downcast_ref::<std::io::Error>() {
            if tls::rustls_error(io).is_some() {
                let host = match config.pg.get_hosts().first() {
                    Some(tokio_postgres::config::Host::Tcp(h)) => h.clone(),
                    _ => String::new(),
                };
                return Error::Tls(tls::handshake_error(io, tls, &host, target));
            }
        }
        source = s.source();
    }
    let chain = crate::report::one_line(&e);
    if chain.contains("server does not support TLS") {
        return Error::Tls(tls::refused_tls(tls, target));
    }
    if chain.contains("server did not use channel binding") {
        return Error::Tls(tls::channel_binding_unavailable(
            target,
            &channel_binding_offer(tls, &config.pg),
        ));
    }
    let hint = match e.as_db_error() {
        Some(db) if tls::hba_hint(db.message(), tls).is_some() => {
            tls::hba_hint(db.message(), tls).unwrap_or_default()
        }
        _ if e.code().is_some_and(|c| c.code().starts_with("28")) => {
            "check the user and password in --database-url (PGOUTBOX_DATABASE_URL)".into()
        }
        _ if e.code().is_some_and(|c| c.code() == "3D000") => {
            "check the database name in --database-url (PGOUTBOX_DATABASE_URL)".into()
        }
        _ => "check host, port and dbname in --database-url (PGOUTBOX_DATABASE_URL) and that PostgreSQL is running".to_owned(),
    };
    Error::Sql {
        context: format!("connecting to {target}; {hint}"),
        source: e,
    }
}

/// What the server did when `channel_binding=require` failed on the SQL connection
/// (tokio-postgres says only "server did not use channel binding").
fn channel_binding_offer(tls: &PostgresTls, pg: &tokio_postgres::Config) -> String {
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::parse_database_url;

    #[test]
    fn connect_timeout_is_the_urls_or_ten_seconds() {
        let timeout = |url: &str| connect_timeout(&parse_database_url(&url.into()).unwrap());
        assert_eq!(
            timeout("postgres://u@h/db?connect_timeout=3"),
            std::time::Duration::from_secs(3)
        );
        assert_eq!(
            timeout("host=h user=u connect_timeout=45"),
            std::time::Duration::from_secs(45)
        );
        assert_eq!(timeout("postgres://u@h/db"), DEFAULT_CONNECT_TIMEOUT);
        assert_eq!(
            timeout("postgres://u@h/db?connect_timeout=0"),
            DEFAULT_CONNECT_TIMEOUT
        );
        assert_eq!(
            describe_target(&parse_database_url(&"postgres://u:secret@h:6543/db".into()).unwrap()),
            "PostgreSQL u@h:6543/db"
        );
    }
}
