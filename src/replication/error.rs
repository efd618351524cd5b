//! Errors of the replication connection: I/O, authentication, server errors and protocol violations.

use std::fmt;
use std::io;

use crate::replication::stream::FrameError;

/// An `ErrorResponse` sent by the server, with the fields an operator needs.
///
/// Source: PostgreSQL docs, "Error and Notice Message Fields".
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServerError {
    /// Severity, e.g. `ERROR` or `FATAL` (field `V`, else `S`).
    pub severity: String,
    /// The SQLSTATE code, e.g. `55006` (object in use) (field `C`).
    pub code: String,
    /// The primary message (field `M`).
    pub message: String,
    /// The optional detail (field `D`).
    pub detail: Option<String>,
    /// The optional hint (field `H`).
    pub hint: Option<String>,
}

impl ServerError {
    /// Builds a `ServerError` from the fields of an `ErrorResponse` body.
    pub(crate) fn from_body(body: &postgres_protocol::message::backend::ErrorResponseBody) -> Self {
        use fallible_iterator::FallibleIterator;
        let mut err = ServerError {
            severity: String::new(),
            code: String::new(),
            message: String::new(),
            detail: None,
            hint: None,
        };
        let mut fields = body.fields();
        while let Ok(Some(field)) = fields.next() {
            let value = String::from_utf8_lossy(field.value_bytes()).into_owned();
            match field.type_() {
                b'V' => err.severity = value,
                b'S' if err.severity.is_empty() => err.severity = value,
                b'C' => err.code = value,
                b'M' => err.message = value,
                b'D' => err.detail = Some(value),
                b'H' => err.hint = Some(value),
                _ => {}
            }
        }
        err
    }
}

impl fmt::Display for ServerError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} {}: {}", self.severity, self.code, self.message)?;
        if let Some(detail) = &self.detail {
            write!(f, " (detail: {detail})")?;
        }
        if let Some(hint) = &self.hint {
            write!(f, " (hint: {hint})")?;
        }
        Ok(())
    }
}

/// SQLSTATE `55006`: the slot is active for another process.
pub const SQLSTATE_OBJECT_IN_USE: &str = "55006";
/// SQLSTATE `42704`: undefined object (slot or publication missing).
pub const SQLSTATE_UNDEFINED_OBJECT: &str = "42704";
/// SQLSTATE `42501`: insufficient privilege (role lacks `REPLICATION`).
pub const SQLSTATE_INSUFFICIENT_PRIVILEGE: &str = "42501";
/// SQLSTATE `28P01`/`28000`: authentication failed.
pub const SQLSTATE_INVALID_PASSWORD: &str = "28P01";

/// An error of the replication connection.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The socket failed while doing `context`.
    #[error("replication connection i/o failed while {context}")]
    Io {
        /// What we were doing.
        context: &'static str,
        /// The socket error.
        #[source]
        source: io::Error,
    },
    /// The server closed the connection (EOF) without an `ErrorResponse`; this is what a
    /// `wal_sender_timeout` or a server shutdown looks like from the client.
    #[error("the server closed the replication connection while {context} (no error was sent; a wal_sender_timeout or a server restart looks like this)")]
    Closed {
        /// What we were doing.
        context: &'static str,
    },
    /// The server ended COPY BOTH with `CommandComplete` (or `ReadyForQuery`) instead of
    /// `CopyDone`: a walsender does this when the server shuts down (fast or smart) and the
    /// client has confirmed everything sent (PostgreSQL `WalSndDone`). Reconnecting is right.
    #[error("the server ended the replication stream while {context} (it is shutting down or restarting)")]
    StreamEnded {
        /// What we were doing.
        context: &'static str,
    },
    /// The connection handshake (TCP connect, startup, authentication, up to the first
    /// ReadyForQuery) did not finish within the connect timeout. Reconnecting may succeed.
    #[error("connecting to {target} for replication timed out after {timeout_s} s (connect_timeout): the server did not finish the connection handshake; check that PostgreSQL is running and answering at that host and port, or raise connect_timeout in --database-url (for example ?connect_timeout=30)")]
    ConnectTimeout {
        /// `PostgreSQL user@host:port/dbname` (no password).
        target: String,
        /// The timeout applied, in seconds.
        timeout_s: u64,
    },
    /// The server answered with an `ErrorResponse`.
    #[error("the server refused {context}: {error}")]
    Server {
        /// What we were doing.
        context: &'static str,
        /// The server's error fields.
        error: Box<ServerError>,
    },
    /// The server asked for an authentication method we do not implement.
    #[error("the server asked for authentication method {method}, which pgoutbox does not support (supported: trust, password, md5, scram-sha-256)")]
    UnsupportedAuth {
        /// The method, e.g. `GSS`.
        method: String,
    },
    /// The server asked for a password and the URL carries none.
    #[error("the server asked for a password for user {user:?} but the database URL has none; add it to the URL (postgres://user:password@host/db), or put it alone in a file named by PGOUTBOX_DATABASE_PASSWORD_FILE")]
    PasswordMissing {
        /// The role name.
        user: String,
    },
    /// SCRAM-SHA-256 exchange failed locally (bad server message or signature).
    #[error("scram-sha-256 authentication failed")]
    Scram(#[source] io::Error),
    /// TLS failed or was refused, or `channel_binding=require` could not be met
    /// ([`crate::postgres::tls`]); definite or not as its `definite` says.
    #[error(transparent)]
    Tls(crate::postgres::TlsError),
    /// A host of the database URL does not match `target_session_attrs` (a standby when
    /// `read-write` was asked for). Retryable: after a failover a standby is promoted.
    #[error("{0}")]
    SessionAttrs(String),
    /// The connection settings are incomplete (no host, no user).
    #[error("invalid replication connection settings: {0}")]
    Settings(String),
    /// A frame was malformed or unexpected.
    #[error("replication protocol violation while {context}: {detail}")]
    Protocol {
        /// What we were doing.
        context: &'static str,
        /// What was wrong.
        detail: String,
    },
    /// A CopyData payload could not be parsed.
    #[error("malformed replication message")]
    Frame(#[from] FrameError),
}

impl Error {
    /// The server's SQLSTATE when this is a server error.
    pub fn code(&self) -> Option<&str> {
        match self {
            Error::Server { error, .. } => Some(error.code.as_str()),
            _ => None,
        }
    }

    /// The server error, when this is one.
    pub fn server_error(&self) -> Option<&ServerError> {
        match self {
            Error::Server { error, .. } => Some(error),
            _ => None,
        }
    }

    /// True when the connection broke (I/O error or EOF): reconnecting may succeed.
    pub fn is_connection_loss(&self) -> bool {
        matches!(
            self,
            Error::Io { .. }
                | Error::Closed { .. }
                | Error::StreamEnded { .. }
                | Error::ConnectTimeout { .. }
        )
    }
}
