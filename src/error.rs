//! The top-level error, and the one function that decides what is retryable.

use crate::lsn::Lsn;

/// Everything `setup`, `run`, `status` and `teardown` can fail with.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A setting is invalid.
    #[error(transparent)]
    Config(#[from] crate::config::ValidationError),
    /// The replication connection failed.
    #[error(transparent)]
    Replication(#[from] crate::replication::Error),
    /// The RabbitMQ side failed.
    #[error(transparent)]
    Publisher(#[from] crate::publisher::Error),
    /// The sink broke its settling protocol ([`crate::sink::SinkError::Violated`]:
    /// definite) or failed in another way no message settles.
    #[error(transparent)]
    Sink(#[from] crate::sink::SinkError),
    /// An ordinary SQL command failed.
    #[error("postgres: {context}")]
    Sql {
        /// What we were doing.
        context: String,
        /// tokio-postgres' error (carries the SQLSTATE).
        #[source]
        source: tokio_postgres::Error,
    },
    /// An ordinary SQL connection did not complete its handshake (TCP connect, startup and
    /// authentication) within the connect timeout: the host accepted TCP, or nobody
    /// answered, and the server never finished. Retryable (`run` reconnects with backoff).
    #[error("connecting to {target} timed out after {timeout_s} s (connect_timeout): the server did not finish the connection handshake; check that PostgreSQL is running and answering at that host and port, or raise connect_timeout in --database-url (for example ?connect_timeout=30)")]
    PostgresConnectTimeout {
        /// `user@host:port/dbname` (no password).
        target: String,
        /// The timeout applied, in seconds.
        timeout_s: u64,
    },
    /// The server asked for a password and the database URL carries none. Definite.
    #[error("{target} asks for a password and none was given: add it to --database-url (PGOUTBOX_DATABASE_URL) as postgres://user:password@host:port/db, or put it alone in a file named by PGOUTBOX_DATABASE_PASSWORD_FILE")]
    PostgresPasswordMissing {
        /// `user@host:port/dbname` (no password).
        target: String,
        /// tokio-postgres' error.
        #[source]
        source: tokio_postgres::Error,
    },
    /// TLS to PostgreSQL failed on the SQL connection: a certificate that did not verify,
    /// a server without TLS where the mode needs it, an unusable TLS file, channel binding
    /// that `channel_binding=require` could not get. Definite or not as its `definite` says.
    #[error(transparent)]
    PostgresTls(crate::postgres_tls::TlsError),
    /// The server is not set up the way pgoutbox needs; the message names the setting,
    /// the value and the fix.
    #[error("{0}")]
    Precondition(String),
    /// The slot was invalidated (`wal_status = 'lost'`): WAL it needed was removed.
    #[error("replication slot {slot:?} is lost (wal_status = 'lost'): the server removed WAL the slot still needed, so outbox messages after {confirmed_flush_lsn} may be gone. pgoutbox will not recreate it silently: inspect, then run `pgoutbox teardown --force` and `pgoutbox setup` to start over (raise max_slot_wal_keep_size to avoid this)")]
    SlotLost {
        /// The slot.
        slot: String,
        /// Its last confirmed position.
        confirmed_flush_lsn: String,
    },
    /// The slot's history has a gap (recreated slot, another cluster): outbox messages in
    /// the named range may never have been delivered. Definite.
    #[error("{0}. pgoutbox refuses to start over silently: recover those messages if they matter (from the producers, or a backup of the database), then run once with --accept-gap, which records the gap in outbox.stream_state and streams from the slot")]
    SlotGap(crate::stream_state::Gap),
    /// The slot stayed held by another process past the retry budget.
    #[error("replication slot {slot:?} is still held by another process (pid {holder_pid}, application_name {holder_name:?}) after {waited_s} s; stop the other streamer or raise --slot-busy-timeout-s (0 waits forever)")]
    SlotBusy {
        /// The slot.
        slot: String,
        /// `active_pid` of the walsender holding it.
        holder_pid: String,
        /// `application_name` of the holder.
        holder_name: String,
        /// Seconds waited.
        waited_s: u64,
    },
    /// The broker connection or channel failed with publishes outstanding: their outcome is
    /// unknown, so the session restarts from the last settled LSN.
    #[error("lost the RabbitMQ connection or channel: {0}")]
    BrokerLost(String),
    /// The SQL connection that records the flush LSN in `outbox.stream_state` closed (a
    /// PostgreSQL shutdown or restart): the session ends so the server is not kept waiting
    /// for a flush position that can no longer be recorded. Retryable.
    #[error("the SQL connection recording the flush LSN in outbox.stream_state closed (PostgreSQL shutting down or restarting?); ending the session")]
    StreamStateLost,
    /// The WAL stream was not in the order pgoutput promises.
    #[error("unexpected replication stream: {0}")]
    Stream(String),
    /// A frame of the replication stream could not be decoded (retried: a reconnect reads
    /// it again).
    #[error("could not decode the pgoutput message at LSN {lsn}: {reason}")]
    Decode {
        /// The XLogData's WAL start.
        lsn: Lsn,
        /// What was wrong with it.
        reason: String,
    },
    /// The same frame failed to decode in several sessions in a row: a definite error.
    #[error("the pgoutput message at LSN {lsn} failed to decode {attempts} times in a row ({reason}); reconnecting reads the same bytes again, so pgoutbox stops. Nothing at or after {lsn} was acknowledged. Inspect it with pg_logical_slot_peek_binary_changes (with the streamer stopped) and report it; skipping it means advancing the slot past it with pg_replication_slot_advance, which loses whatever it holds")]
    UndecodableWal {
        /// The XLogData's WAL start.
        lsn: Lsn,
        /// Sessions that failed there.
        attempts: u32,
        /// The decode error.
        reason: String,
    },
    /// A connection was lost while shutdown was draining confirms: the messages still
    /// unsettled were not acknowledged (they are sent again on restart), and the exit
    /// status says so.
    #[error("shutdown was interrupted with {unsettled} messages unsettled: acknowledged up to {flushed} only (they will be sent again on restart)")]
    DrainInterrupted {
        /// Messages still unsettled.
        unsettled: u64,
        /// The last acknowledged LSN.
        flushed: Lsn,
        /// The failure that interrupted the drain.
        #[source]
        cause: Box<Error>,
    },
    /// Shutdown could not drain outstanding confirms in time.
    #[error("shutdown timed out with {unconfirmed} messages unconfirmed; acknowledged up to {flushed} only (they will be sent again on restart)")]
    ShutdownTimeout {
        /// Messages still unconfirmed.
        unconfirmed: u64,
        /// The last acknowledged LSN.
        flushed: Lsn,
    },
}

impl Error {
    /// Wraps a tokio-postgres error with what we were doing.
    pub fn sql(context: impl Into<String>, source: tokio_postgres::Error) -> Self {
        Error::Sql {
            context: context.into(),
            source,
        }
    }

    /// Whether retrying the same operation later may succeed. Default: retryable unless
    /// proven definite (bad settings, missing objects, lost slots are definite).
    pub fn is_retryable(&self) -> bool {
        match self {
            Error::Config(_)
            | Error::Precondition(_)
            | Error::SlotLost { .. }
            | Error::SlotBusy { .. }
            | Error::SlotGap(_)
            | Error::UndecodableWal { .. }
            | Error::DrainInterrupted { .. }
            | Error::ShutdownTimeout { .. } => false,
            Error::PostgresPasswordMissing { .. } => false,
            // A certificate that does not verify, a server without TLS, an unusable file:
            // the same attempt fails again (unlike a dropped handshake).
            Error::PostgresTls(e) => !e.definite,
            Error::Replication(crate::replication::Error::Tls(e)) => !e.definite,
            Error::Replication(e) => {
                !matches!(
                    e,
                    crate::replication::Error::PasswordMissing { .. }
                        | crate::replication::Error::UnsupportedAuth { .. }
                        | crate::replication::Error::Settings(_)
                ) && !e.code().is_some_and(is_definite_sqlstate)
            }
            Error::Sql { source, .. } => !source
                .code()
                .is_some_and(|c| is_definite_sqlstate(c.code())),
            // The broker refused the login or the vhost (403, 530): retrying cannot fix it.
            Error::Publisher(
                crate::publisher::Error::Url(_) | crate::publisher::Error::Refused { .. },
            ) => false,
            // A TLS file in the URL is unreadable or holds no usable certificate or key, or
            // the system trust store is empty: the same files fail again. (A failed TLS
            // handshake, a certificate that did not verify included, stays retryable: the
            // broker's certificate or listener may change while we wait.)
            Error::Publisher(crate::publisher::Error::TlsSetup { .. }) => false,
            // The exchange exists with another type or durability (406), or the user may
            // not configure it (403): the same declare fails again.
            Error::Publisher(crate::publisher::Error::Declare { reply_code, .. }) => {
                !matches!(reply_code, 403 | 406)
            }
            // The broker broke the publisher-confirm protocol: stop rather than trust it.
            Error::Publisher(crate::publisher::Error::Protocol(_)) => false,
            Error::Sink(crate::sink::SinkError::Violated(_)) => false,
            _ => true,
        }
    }
}

/// SQLSTATEs that retrying cannot fix: authentication (class 28), a missing database
/// (`3D000`), missing privileges (`42501`).
fn is_definite_sqlstate(code: &str) -> bool {
    code.starts_with("28") || code == "3D000" || code == "42501"
}

/// The error and its causes on one line, joined by `: ` (for a log field; see
/// [`render_report`] for the multi-line form).
pub fn one_line(error: &(dyn std::error::Error + 'static)) -> String {
    render_report(error)
        .trim_start_matches("error: ")
        .replace("\n  caused by: ", ": ")
}

/// The error and its causes, one per line (`error: ...`, then `  caused by: ...`), each
/// cause printed once.
pub fn render_report(error: &(dyn std::error::Error + 'static)) -> String {
    let mut out = format!("error: {error}");
    let mut last = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        let text = cause.to_string();
        // Some libraries repeat their source in their own message: print it once.
        if !last.contains(&text) {
            out.push_str(&format!("\n  caused by: {text}"));
        }
        last = text;
        source = cause.source();
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::publisher::Error as PublisherError;

    #[derive(Debug, thiserror::Error)]
    #[error("session failed")]
    struct Outer(#[source] std::io::Error);

    #[test]
    fn one_line_joins_the_causes_a_report_prints_on_separate_lines() {
        let e = Outer(std::io::Error::other("connection refused"));
        assert_eq!(
            render_report(&e),
            "error: session failed\n  caused by: connection refused"
        );
        assert_eq!(one_line(&e), "session failed: connection refused");
    }

    #[test]
    fn an_unusable_tls_file_is_definite_and_a_failed_handshake_is_retried() {
        let setup = Error::Publisher(PublisherError::TlsSetup {
            what: "cacertfile=/etc/ca.pem".into(),
            reason: "no such file".into(),
            fix: "point it at the CA",
        });
        assert!(!setup.is_retryable());
        let handshake = Error::Publisher(PublisherError::Tls {
            url: "amqps://u:***@h/%2f".into(),
            context: "certificate verification failed".into(),
            fix: "set cacertfile=".into(),
        });
        assert!(handshake.is_retryable());
        assert!(!Error::Publisher(PublisherError::Url("verify=verify_none".into())).is_retryable());
    }
}
