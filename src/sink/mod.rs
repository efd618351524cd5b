//! The sink seam: the one interface between the event loop and a destination.
//!
//! ```text
//!   event loop (pipeline)                         a sink (publisher::AmqpSink today)
//!   ─────────────────────                         ─────────────────────────────────
//!   admission decided: exchange, size, trust
//!   in-flight table: Seq → record      publish(Delivery) ──▶ encode in its own format
//!                                       Ok | Unsendable | Lost      into its write buffer
//!   apply outcomes by Seq, watermark ◀── poll_settled() ◀── all I/O: write, read, heartbeat
//!   window = the global bound              [(Seq, PublishOutcome)]   confirms settled
//!   status deadline, readiness     ◀── health(), is_writable(), unsettled()
//! ```
//!
//! What the loop owns, and keeps owning whatever the sink: the order messages are read in,
//! the in-flight table, retries, dead letters, the window (`--max-in-flight`,
//! `--max-in-flight-bytes`: [`crate::watermark::Backlog`]), and the flush LSN
//! ([`crate::watermark::AckWatermark`], its only source). What a sink does: it accepts a
//! [`Delivery`] ("accepted" = encoded into its buffer, nothing more), and later reports it
//! settled under its [`Seq`] ([`PublishOutcome`]); it says whether it can take more
//! ([`Sink::is_writable`]) and how its connections are ([`Sink::health`]). Accepted is kept
//! apart from settled, as supabase/etl keeps accepted apart from durable.
//!
//! The guarantees the caller gives a sink: every [`Delivery::seq`] is new for a first
//! attempt, first attempts come in WAL order, and a retry (same `seq`, `attempt` + 1) is
//! only made after the previous attempt's outcome came back. What a sink guarantees the
//! caller: exactly one outcome per accepted publish; [`PublishOutcome::Routed`] only once
//! the destination stored the message (for AMQP: an ack without a `basic.return`); on a
//! connection failure, every publish unsettled on it comes back as
//! [`PublishOutcome::Failed`] before [`SinkError::Lost`]. The loop's settling rules are
//! written once, against these outcomes, in `pipeline` (`apply_outcomes`): only `Routed`
//! and a committed dead letter settle a message, and a `Failed` outcome ends the session.
//!
//! Imports: pure modules only (`lsn`, `envelope`, `routing`'s [`Exchange`]). The sinks sit
//! above this module and implement [`Sink`]; `pipeline` picks one from the settings in one
//! factory (`pipeline::sinks`) and the loop sees only `&mut dyn Sink`.
//!
//! # Adding a sink without touching the settling code
//!
//! **Partitions** (N publisher connections, ordered per key): a `sink::partitioned`
//! module holding `parts: Vec<Box<dyn Sink>>`, each part one [`crate::publisher::AmqpSink`]
//! (own connection, channel and confirm window), built by the factory from the same
//! settings with `--partitions N`; `N = 1` is today's single [`crate::publisher::AmqpSink`]
//! itself, so the wire stays byte for byte. It needs nothing from the loop beyond this
//! trait:
//! - [`Sink::publish`] picks the part from the delivery alone, so a restart maps every key
//!   to the same part: a fixed, documented hash (not std's per-process `RandomState`;
//!   e.g. FNV-1a 64) of the envelope's `meta.aggregate_id` bytes when set, else of
//!   [`Delivery::commit_lsn`] (the transaction), modulo N. A retry has the same delivery,
//!   so it goes to the same part.
//! - [`Sink::poll_settled`] polls every part (starting at a rotating index, so one busy
//!   part cannot starve the others' confirms), concatenates what they settled and returns
//!   `Ready` when any part did; `Seq`s are the loop's, unique across parts, so the loop
//!   settles them as it does today. Parts confirm out of order relative to each other: the
//!   watermark settles by message, not by arrival. A part's failure surfaces as its
//!   `Failed` outcomes (ending the session) and then [`SinkError::Lost`].
//! - [`Sink::is_writable`] is the conjunction of the parts'; [`Sink::health`] lists one
//!   [`PartHealth`] per part (readiness and the status deadline read it);
//!   [`Sink::unsettled`] is the sum; [`Sink::close`] closes the parts together.
//! - The global bound on unconfirmed messages stays the loop's window: there is no
//!   per-part window, so N parts never hold more than `--max-in-flight` between them.
//!
//! **Streams** (RabbitMQ's stream protocol, a `stream_publisher` module):
//! - At connect it declares its publisher reference and queries the stored publishing
//!   sequence (`QueryPublisherSequence`): `stored`.
//! - Publishing ids come from ([`Delivery::commit_lsn`], [`Delivery::index_in_txn`]),
//!   strictly increasing in that order and the same on every replay of a message (the
//!   commit record's LSN does not change, and the index counts every message of the
//!   outbox's prefix in its transaction, dead-lettered ones included). An id scheme that
//!   cannot represent a delivery, or an id that does not increase, is a definite error
//!   ([`SinkError::Violated`]), never a wrap or a skip.
//! - [`Sink::publish`] of an id at or below `stored` sends nothing and queues
//!   `(seq, PublishOutcome::Routed)`: the message is already stored (deduplication at
//!   start); `poll_settled` hands it out on its next poll like any confirm.
//! - Its confirms map to `Routed`, its publish errors to `Nacked` (retryable codes) or
//!   `Failed`; it encodes AMQP 1.0 from the same [`Delivery`] fields the AMQP sink reads
//!   (headers named in [`crate::contract`] become application properties).
//!
//! Neither touches `apply_outcomes`, the watermark or the window: they are further
//! implementations of [`Sink`] and one more arm in the factory's match.

mod outcome;
pub mod partitioned;

use std::future::poll_fn;
use std::task::{Context, Poll};

use futures::future::BoxFuture;

use crate::envelope::Envelope;
use crate::lsn::Lsn;
pub use crate::routing::Exchange;
pub use outcome::{FailureCause, PublishOutcome, SinkFailure};

/// Our number for one message in flight within a session (the in-flight table's key, and
/// the tag a sink hands back with its outcome). Handed out in WAL order, never reused in a
/// session; a retry keeps its number.
pub type Seq = u64;

/// One outbox message, decoded, with everything a sink needs to encode it in its own
/// format. The loop has already decided its exchange (routing), its size limits and
/// whether its emitter can be trusted (lockdown); a sink only encodes and sends.
#[derive(Debug)]
pub struct Delivery {
    /// The in-flight key; the outcome comes back under it.
    pub seq: Seq,
    /// The decoded envelope: message id, topic, content type, payload, producer headers,
    /// event metadata, emitter, named exchange.
    pub envelope: Envelope,
    /// Where it goes ([`crate::routing::Router::route`]).
    pub exchange: Exchange,
    /// The message's own LSN (pgoutput Message's LSN): unique among messages in flight.
    pub lsn: Lsn,
    /// Its transaction's commit record LSN (pgoutput Begin's final LSN): increases with
    /// commit order.
    pub commit_lsn: Lsn,
    /// Its transaction's commit time, microseconds since the Unix epoch.
    pub commit_time_us: i64,
    /// 0-based index among its transaction's messages of the outbox's prefix, counting
    /// every one (published or dead-lettered), so it is the same on every replay.
    pub index_in_txn: u32,
    /// Read under `setup --lockdown`: its emitter was required and present, so the
    /// emitter may be sent (the AMQP sink's `x-pgoutbox-emitted-by` header).
    pub emitter_checked: bool,
    /// 1 on the first publish, more on a retry after a nack or a return.
    pub attempt: u32,
    /// When the socket read that completed this message's frame on the replication stream
    /// returned: where pgoutbox's residence time starts ([`crate::metrics::RESIDENCE_SECONDS`]).
    /// `None` for a retry (its time includes the retry's backoff, not pgoutbox's work).
    pub read_at: Option<std::time::Instant>,
}

/// Why a sink refused a publish, or stopped.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SinkError {
    /// This message can never go on this sink (for AMQP: its content header exceeds the
    /// negotiated `frame_max`); nothing was sent or recorded for it. The loop dead-letters
    /// it as `too_large`.
    #[error("{0}")]
    Unsendable(String),
    /// The delivery does not fit the sink's format (for AMQP: a short string over 255
    /// bytes). Not expected: the envelope decoder enforces the same limits. Nothing was
    /// sent; the loop ends the session.
    #[error("{0}")]
    Unencodable(String),
    /// The connection is gone: every publish unsettled on it was already settled as
    /// [`PublishOutcome::Failed`]. Retryable (the session reconnects).
    #[error("{0}")]
    Lost(String),
    /// The destination broke the settling protocol (for AMQP: a return or an ack that
    /// matches no publish): nothing more is settled on it. Definite: `run` stops.
    #[error("{0}")]
    Violated(String),
}

/// The state of one part of a sink (one connection).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PartHealth {
    /// Connected and taking publishes.
    Connected,
    /// Connected, but the destination holds publishes back (RabbitMQ's
    /// `connection.blocked`: a memory or disk alarm). Nothing unconfirmed is acknowledged
    /// meanwhile.
    Blocked,
    /// The connection failed; its unsettled publishes were settled as failed.
    Lost,
}

/// One part's figures, for the per-partition metrics.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PartFigures {
    /// Its connection's state.
    pub health: PartHealth,
    /// Publishes accepted by it and not yet settled.
    pub unsettled: usize,
    /// Publishes accepted by it since it connected (every attempt).
    pub published: u64,
}

/// A sink's health: one [`PartHealth`] per connection (one for the AMQP sink, one per
/// partition for a partitioned sink).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SinkHealth {
    /// The parts, in the sink's own order (partition number).
    pub parts: Vec<PartHealth>,
}

impl SinkHealth {
    /// The health of a sink with one connection.
    pub fn single(part: PartHealth) -> Self {
        SinkHealth { parts: vec![part] }
    }

    /// True when any part lost its connection: the session must end (the outcomes of its
    /// publishes are unknown).
    pub fn is_lost(&self) -> bool {
        self.parts.contains(&PartHealth::Lost)
    }

    /// True when any part is blocked by its destination.
    pub fn is_blocked(&self) -> bool {
        self.parts.contains(&PartHealth::Blocked)
    }
}

/// A destination for outbox messages (see the module doc for what each side guarantees).
///
/// There is no task behind a sink: all its I/O happens while the loop polls
/// [`Sink::poll_settled`], on the loop's own task.
pub trait Sink: Send {
    /// Accepts `delivery`: encodes it into the sink's write buffer (nothing is written
    /// until [`Sink::poll_settled`] runs, so many publishes go out in one write). Its
    /// outcome comes back through `poll_settled` under `delivery.seq`.
    ///
    /// # Errors
    /// [`SinkError::Unsendable`]: this message can never go on this sink (dead-letter it);
    /// [`SinkError::Unencodable`]: it does not fit the sink's format;
    /// [`SinkError::Lost`] / [`SinkError::Violated`]: the connection failed (end the
    /// session). Nothing is recorded for a refused delivery.
    fn publish(&mut self, delivery: Delivery) -> Result<(), SinkError>;

    /// Drives all I/O (writes, reads, heartbeats) and returns settled outcomes, at least
    /// one, in the order the destination settled them (per connection). A sink that
    /// settles something without I/O (a deduplicated publish) returns it on the next poll.
    ///
    /// # Errors
    /// On a connection failure every publish unsettled on it is first returned as
    /// [`PublishOutcome::Failed`]; later polls return [`SinkError::Lost`].
    /// [`SinkError::Violated`] when the destination broke the settling protocol: nothing
    /// more is settled, not even outcomes read before it in the same poll.
    ///
    /// # Cancel safety
    /// A poll function: all state lives in the sink, so [`recv_settled`] is cancel safe.
    fn poll_settled(
        &mut self,
        cx: &mut Context<'_>,
    ) -> Poll<Result<Vec<(Seq, PublishOutcome)>, SinkError>>;

    /// False while the sink cannot take a publish now; the loop then stops reading WAL
    /// (and keeps sending status updates). A sink that returns false wakes the task
    /// polling [`Sink::poll_settled`] once it turns writable again. This is no window:
    /// the loop's window stays the one bound on unconfirmed messages.
    fn is_writable(&self) -> bool;

    /// The state of each connection, for the status deadline (a lost part ends the
    /// session) and readiness.
    fn health(&self) -> SinkHealth;

    /// Publishes accepted and not yet settled.
    fn unsettled(&self) -> usize;

    /// Each connection's figures, in [`Sink::health`]'s order. The default gives one part
    /// (the first of `health()`) with `published` 0: a sink with several connections, or
    /// one that counts its publishes, says more.
    fn parts(&self) -> Vec<PartFigures> {
        vec![PartFigures {
            health: self
                .health()
                .parts
                .first()
                .copied()
                .unwrap_or(PartHealth::Lost),
            unsettled: self.unsettled(),
            published: 0,
        }]
    }

    /// Closes the connections, best effort; the caller bounds how long it may take.
    /// Anything unsettled stays unacknowledged and is sent again by the next session.
    fn close(self: Box<Self>) -> BoxFuture<'static, ()>;
}

/// The next settled outcomes of `sink` ([`Sink::poll_settled`] as a future).
///
/// # Errors
/// As [`Sink::poll_settled`].
///
/// # Cancel safety
/// Cancel safe: dropping the future loses nothing (state lives in the sink).
pub async fn recv_settled(sink: &mut dyn Sink) -> Result<Vec<(Seq, PublishOutcome)>, SinkError> {
    poll_fn(|cx| sink.poll_settled(cx)).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_sink_is_lost_or_blocked_when_any_part_is() {
        let one = SinkHealth::single(PartHealth::Connected);
        assert!(!one.is_lost() && !one.is_blocked());
        let parts = SinkHealth {
            parts: vec![PartHealth::Connected, PartHealth::Blocked],
        };
        assert!(parts.is_blocked() && !parts.is_lost());
        let parts = SinkHealth {
            parts: vec![PartHealth::Lost, PartHealth::Blocked],
        };
        assert!(parts.is_lost());
    }
}
