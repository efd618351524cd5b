//! `pgoutbox run`: WAL in, publishes out, confirms back, flush LSN out.
//!
//! ```text
//!  walsender ──XLogData/keepalive──▶ ReplicationStream ──pgoutput──▶ Begin/Message/Commit
//!      ▲                                                                  │ admission
//!      │ standby status update (flush = AckWatermark::flushed)            ▼
//!  status ◀── AckWatermark ◀── settling ◀── in-flight table ──▶ dyn Sink (outcomes by Seq)
//!                                 ▲                       └──▶ dead-letter writer
//!                                 └────────── written ◀─────────────┘
//! ```
//!
//! The invariant: the flush LSN reported to Postgres only moves over transactions whose
//! every outbox message the broker confirmed as routed (acked and not returned) or that was
//! durably written to `outbox.dead_letter`, or to a primary keepalive's `walEnd` when
//! nothing at all is pending. It starts at the slot's `confirmed_flush_lsn`, read after
//! `START_REPLICATION` succeeded (so nobody else can move it meanwhile), and never goes
//! lower. [`crate::watermark::AckWatermark`] is its only source.
//!
//! Backpressure: when the window (messages or payload bytes not yet acknowledged, see
//! [`crate::watermark::Backlog`]) is full, the loop stops reading the replication socket but
//! keeps sending standby status updates on a timer well inside `wal_sender_timeout`; the
//! walsender reads replies while its own send blocks.
//!
//! Where things live (one concept per module):
//! - [`driver`]: sessions and reconnects: backoff, the exit status of an interrupted drain;
//! - `session`: connecting one session's sides (every wait ends on a signal) and what one
//!   session teaches the next (resume LSN, the broker's size limit, the node to try first,
//!   repeated decode failures);
//! - `sinks`: the one factory that picks the sink from the settings ([`crate::sink`] is the
//!   seam; the loop sees `&mut dyn Sink` only);
//! - `event_loop`: the one `select!` with its written priorities, and what each frame does;
//! - `transaction`: the open transaction, and each outbox message's index in it;
//! - `admission`: whether a message is published or dead-lettered unpublished (the six
//!   checks, in order), and the lockdown markers;
//! - `refusal`: which message made the broker close the publishing channel (an exchange
//!   it may not write, the one unconfirmed publish, or one at a time until found);
//! - `settling`: the watermark and the in-flight table: **every change of a message's
//!   state** after it was read (routed, nacked, returned, dead-lettered) happens there;
//! - `in_flight`: the in-flight records and their retry schedule;
//! - `status` and `feedback`: when to send a standby status update, of which kind, and what
//!   it may report; stall detection;
//! - `dead_letter`: the dead-letter writer, a task with bounded waits and retries, so a
//!   lock on `outbox.dead_letter` never stops status updates or confirms;
//! - `journal`: the delivery journal writer (`--journal`), a task with a bounded buffer
//!   fed after a message is settled, so it never holds back acknowledgement;
//! - `retention`: the task that deletes expired idempotency keys and journal rows.
//!
//! Sources: PostgreSQL docs, "Streaming Replication Protocol" and "Logical Streaming
//! Replication Protocol"; RabbitMQ "Publisher Confirms".

mod admission;
mod dead_letter;
mod delivered;
pub mod driver;
mod event_loop;
mod feedback;
mod in_flight;
mod journal;
mod refusal;
mod retention;
mod session;
mod settling;
mod sinks;
mod standby;
mod status;
mod transaction;
mod wal_watch;

pub use driver::run;

/// The header names of the wire contract, defined in [`crate::contract`] (the consumer side
/// reads them from there too); kept under these paths for the pipeline's own code.
pub use crate::contract::{
    HEADER_AGGREGATE_ID, HEADER_AGGREGATE_TYPE, HEADER_AGGREGATE_VERSION, HEADER_CAUSATION_ID,
    HEADER_COMMIT_LSN, HEADER_COMMIT_TIME_US, HEADER_EMITTED_BY, HEADER_IDEMPOTENCY_KEY,
    HEADER_LSN, HEADER_TENANT, HEADER_TRACEPARENT, HEADER_TRACESTATE,
};

/// What a run did, returned on a clean shutdown.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RunSummary {
    /// Publishes made, counting every attempt: first publishes, retries after a nack or a
    /// return, and re-sends after a reconnect.
    pub published: u64,
    /// Of those, publishes that were retries of a nacked or returned message in the same
    /// session.
    pub retried: u64,
    /// Messages confirmed as routed.
    pub confirmed: u64,
    /// The last flush LSN reported to Postgres.
    pub flushed: crate::lsn::Lsn,
    /// Messages written to `outbox.dead_letter`.
    pub dead_lettered: u64,
    /// Sessions restarted after a retryable failure.
    pub reconnects: u64,
    /// Messages read again after a reconnect (the session resumed from the recorded flush
    /// LSN) that an earlier session had settled: acknowledged, not sent again.
    pub not_resent: u64,
}
