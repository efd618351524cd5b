//! pgoutbox: a transactional-outbox streamer from PostgreSQL to RabbitMQ.
//!
//! Producers call `outbox.emit(...)` inside their own transaction; it writes a logical
//! decoding message (`pg_logical_emit_message(true, 'pgoutbox', envelope)`), so the event
//! commits or rolls back with the business change. `pgoutbox run` holds a pgoutput logical
//! replication slot (`messages 'true'`), decodes the WAL stream, publishes every outbox
//! message to a RabbitMQ topic exchange with publisher confirms, and reports an LSN to
//! Postgres as flushed only after the broker confirmed every message up to it.
//!
//! ```text
//!  producer tx ──pg_logical_emit_message──▶ WAL ──walsender (pgoutput)──▶ replication
//!        ──▶ pgoutput ──▶ envelope ──▶ publisher (own AMQP 0-9-1, confirms) ──▶ RabbitMQ exchange
//!                                           │ ack (not returned)
//!  confirmed_flush_lsn ◀── standby status update ◀── watermark ◀──┘
//! ```
//!
//! **The confirmation invariant**: every message at or below an LSN reported as flushed was
//! confirmed by the broker as routed (acked, not returned). Delivery is therefore
//! at-least-once, in commit order on the happy path, with a stable `message_id` fixed in
//! the WAL at emit time. See the PostgreSQL docs, "Logical Decoding" and "Streaming
//! Replication Protocol", and the RabbitMQ docs, "Publisher Confirms".

pub mod admin;
pub mod check;
pub mod cli;
pub mod cloudevents;
pub mod config;
pub mod config_file;
pub mod connection_url;
pub mod contract;
pub mod envelope;
pub mod error;
pub mod inbox;
#[cfg(test)]
mod item_length;
pub mod lockdown;
pub mod lsn;
pub mod metrics;
pub mod outbox_schema;
pub mod partition;
pub mod pem;
pub mod pgoutput;
pub mod pipeline;
pub mod postgres;
pub mod publisher;
pub mod redaction;
pub mod replication;
pub mod report;
pub mod routing;
pub mod secrets;
pub mod sink;
pub mod stream_publisher;
pub mod stream_state;
pub mod topology;
pub mod validation;
pub mod watermark;

pub use error::Error;
pub use lsn::Lsn;
