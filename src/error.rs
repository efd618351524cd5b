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
    /// The RabbitMQ stream side failed (`run --stream`).
    #[error(transparent)]
    StreamPublisher(#[from] crate::stream_publisher::Error),
    /// The sink broke its settling protocol ([`crate::sink::SinkError::Violated`]:
    /// definite) or failed in another way no message settles.
    #[error(transparent)]
    Sink(#[from] crate::sink::SinkError),
    /// `declare-topology` could not declare or check the consumers' topology.
    #[error(transparent)]
    Topology(#[from] crate::topology::Error),
    /// An ordinary SQL command failed.
    #[error("postgres: {context}")]
    Sql {
        /// What we were doing.
        context: String,
        /// tokio-postgres' error (carries the SQLSTATE).
        #[source]
        source: tokio_postgres::Error,
    },
    /// An ordinary SQL connection could not be made: a timeout, a missing password, TLS,
    /// or the server refused it ([`crate::postgres::Error`]).
    #[error(transparent)]
    Postgres(#[from] crate::postgres::Error),
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
    /// The replication stream broke pgoutput's transaction order at `lsn` (a Begin while a
    /// transaction is open, a Commit or a transactional message outside one): retried (a
    /// reconnect reads the stream again) until it happens at the same LSN in
    /// three sessions in a row, then
    /// [`Error::StreamOrderRepeated`].
    #[error("the replication stream broke pgoutput's transaction order at LSN {lsn}: {source}")]
    StreamOrder {
        /// The XLogData's WAL start.
        lsn: Lsn,
        /// What the watermark refused.
        #[source]
        source: crate::watermark::WatermarkError,
    },
    /// [`Error::StreamOrder`] at the same LSN in several sessions in a row: definite.
    #[error("the replication stream broke pgoutput's transaction order at LSN {lsn} in {attempts} sessions in a row ({reason}); reconnecting reads the same WAL again, so pgoutbox stops. Nothing at or after {lsn} was acknowledged. Report it with the server's version and the output of pg_logical_slot_peek_binary_changes around that LSN (with the streamer stopped)")]
    StreamOrderRepeated {
        /// The XLogData's WAL start.
        lsn: Lsn,
        /// Sessions that failed there.
        attempts: u32,
        /// What the watermark refused.
        reason: String,
    },
    /// pgoutbox's own settling state contradicted itself (a confirm for a message the
    /// watermark does not hold, an in-flight record gone): a bug. Definite: pgoutbox stops
    /// rather than guess what was delivered; nothing after the last acknowledged LSN was
    /// acknowledged, so a restart sends it again.
    #[error("internal error, please report it: {0}; pgoutbox stops rather than guess what was delivered (nothing after the last acknowledged LSN was acknowledged, a restart sends it again)")]
    Internal(String),
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

impl From<crate::stream_state::Error> for Error {
    fn from(e: crate::stream_state::Error) -> Self {
        match e {
            crate::stream_state::Error::Sql { context, source } => Error::Sql { context, source },
            crate::stream_state::Error::Precondition(text) => Error::Precondition(text),
            crate::stream_state::Error::Gap(gap) => Error::SlotGap(gap),
        }
    }
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
            | Error::StreamOrderRepeated { .. }
            | Error::Internal(_)
            | Error::DrainInterrupted { .. }
            | Error::ShutdownTimeout { .. } => false,
            Error::Postgres(crate::postgres::Error::PasswordMissing { .. }) => false,
            // A certificate that does not verify, a server without TLS, an unusable file:
            // the same attempt fails again (unlike a dropped handshake).
            Error::Postgres(crate::postgres::Error::Tls(e)) => !e.definite,
            Error::Postgres(crate::postgres::Error::ConnectTimeout { .. }) => true,
            Error::Postgres(crate::postgres::Error::Sql { source, .. }) => !source
                .code()
                .is_some_and(|c| is_definite_sqlstate(c.code())),
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
            Error::StreamPublisher(e) => e.is_retryable(),
            // A plugin that is off, a refusal (403): the same declaration fails again.
            Error::Topology(
                crate::topology::Error::PluginOff { .. } | crate::topology::Error::Refused { .. },
            ) => false,
            _ => true,
        }
    }
}

/// SQLSTATEs that retrying cannot fix: authentication (class 28), a missing database
/// (`3D000`), missing privileges (`42501`).
fn is_definite_sqlstate(code: &str) -> bool {
    code.starts_with("28") || code == "3D000" || code == "42501"
}

/// The report helpers, kept where they were for the code above this layer (`main`,
/// `admin`, `pipeline`); they live in [`crate::report`], which every layer may use.
pub use crate::report::{one_line, render_report};

#[cfg(test)]
mod tests {
    use super::*;
    use crate::publisher::Error as PublisherError;

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
