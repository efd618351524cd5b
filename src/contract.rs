//! The names of the wire contract: the headers pgoutbox adds to every message it publishes.
//!
//! One module that both sides read: the sinks that encode a message (the AMQP mapping in
//! [`crate::publisher::encode`]), the consumer-side helpers ([`crate::inbox`]) and the
//! docs. Pure: names only, no I/O. The envelope's own keys live with its decoder
//! ([`crate::envelope`]); producer headers starting `x-pgoutbox-` are refused there, so
//! these names are always ours.

/// Header with the message's own LSN (`X/Y`); also the key that matches returns.
pub const HEADER_LSN: &str = "x-pgoutbox-lsn";
/// Header with the LSN of the transaction's commit record (`X/Y`, pgoutput Begin's final
/// LSN): increases with commit order.
pub const HEADER_COMMIT_LSN: &str = "x-pgoutbox-commit-lsn";
/// Header with the commit time, microseconds since the Unix epoch.
pub const HEADER_COMMIT_TIME_US: &str = "x-pgoutbox-commit-time-us";
/// Header with the role that emitted the message (the envelope's `emitted_by`, the
/// `session_user` that called `outbox.emit`), under both `--publish-properties` shapes, on
/// messages checked under `setup --lockdown` only: there it can be trusted (short of a
/// superuser); without lockdown any role may write any emitter, so it is left out.
pub const HEADER_EMITTED_BY: &str = "x-pgoutbox-emitted-by";

/// Header with the envelope's `causation_id` (text), when the producer gave one.
pub const HEADER_CAUSATION_ID: &str = "x-pgoutbox-causation-id";
/// Header with the envelope's `aggregate_type` (text), when given.
pub const HEADER_AGGREGATE_TYPE: &str = "x-pgoutbox-aggregate-type";
/// Header with the envelope's `aggregate_id` (text), when given.
pub const HEADER_AGGREGATE_ID: &str = "x-pgoutbox-aggregate-id";
/// Header with the envelope's `aggregate_version` (a long-long integer), when given.
pub const HEADER_AGGREGATE_VERSION: &str = "x-pgoutbox-aggregate-version";
/// Header with the envelope's `tenant` (text), when given.
pub const HEADER_TENANT: &str = "x-pgoutbox-tenant";
/// Header with the envelope's `idempotency_key` (text), when given.
pub const HEADER_IDEMPOTENCY_KEY: &str = "x-pgoutbox-idempotency-key";
/// The W3C Trace Context header (section 3.2), the envelope's `traceparent` unchanged.
pub const HEADER_TRACEPARENT: &str = "traceparent";
/// The W3C Trace Context header (section 3.3), the envelope's `tracestate` unchanged.
pub const HEADER_TRACESTATE: &str = "tracestate";
