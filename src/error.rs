//! The top-level error, and the one function that decides what is retryable.

use crate::lsn::Lsn;
use crate::publisher::PublishOutcome;

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
    /// An ordinary SQL command failed.
    #[error("postgres: {context}")]
    Sql {
        /// What we were doing.
        context: String,
        /// tokio-postgres' error (carries the SQLSTATE).
        #[source]
        source: tokio_postgres::Error,
    },
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
    /// The slot stayed held by another process past the retry budget.
    #[error("replication slot {slot:?} is still held by another process (pid {holder_pid}, application_name {holder_name:?}) after {waited_s} s; stop the other streamer or raise --slot-busy-timeout")]
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
    /// A message was not delivered (nack, return, channel failure); nothing at or after
    /// its LSN was acknowledged.
    #[error("outbox message at LSN {lsn} was not delivered: {outcome}; nothing at or after this LSN was acknowledged (confirmed_flush_lsn stays at or below {flushed})")]
    Delivery {
        /// The logical message's LSN.
        lsn: Lsn,
        /// What the broker did.
        outcome: PublishOutcome,
        /// The watermark at the time.
        flushed: Lsn,
    },
    /// The WAL stream was not in the order pgoutput promises.
    #[error("unexpected replication stream: {0}")]
    Stream(String),
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
            Error::Config(_) | Error::Precondition(_) | Error::SlotLost { .. } => false,
            Error::Replication(e) => !matches!(
                e,
                crate::replication::Error::TlsUnsupported { .. }
                    | crate::replication::Error::PasswordMissing { .. }
                    | crate::replication::Error::UnsupportedAuth { .. }
                    | crate::replication::Error::Settings(_)
            ),
            Error::Publisher(crate::publisher::Error::Url(_)) => false,
            _ => true,
        }
    }
}

/// Renders an error with its chain of causes, one per line, for the operator.
pub fn render_report(error: &(dyn std::error::Error + 'static)) -> String {
    let mut out = format!("error: {error}");
    let mut source = error.source();
    while let Some(cause) = source {
        out.push_str(&format!("\n  caused by: {cause}"));
        source = cause.source();
    }
    out
}
