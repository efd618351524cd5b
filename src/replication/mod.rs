//! The streaming replication protocol: the CopyBoth sub-protocol a logical replication
//! connection speaks after `START_REPLICATION` (PostgreSQL docs, "Streaming Replication
//! Protocol").
//!
//! [`stream`] holds the sans-IO codecs for the CopyData payloads (XLogData, Primary
//! keepalive, Standby status update).
pub mod connect;
pub mod error;
pub mod session;
mod socket;
pub mod stream;

pub use error::{Error, ServerError};
