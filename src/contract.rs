//! The names of the wire contract between the streamer and its consumers: the AMQP headers
//! pgoutbox adds (`x-pgoutbox-*`, W3C Trace Context), the header keys producers may not
//! use, the property rules every published message keeps, and the JSON keys of the
//! envelope header that `sql/outbox.sql` writes.
//!
//! Both sides read them from here: the streamer when it publishes
//! (the AMQP mapping in [`crate::publisher::encode`]), the decoder when it checks what a producer
//! wrote ([`crate::envelope`]), and the consumer-side helper when it reads a delivery
//! ([`crate::inbox`]). The book's pages `docs/src/reference/envelope.md` and
//! `docs/src/consumers/message.md` describe the same names; a name changes here or nowhere. Plain constants: no I/O, no dependency.

/// Header with the message's own LSN (`X/Y` text); also the key that matches a
/// `basic.return` to its publish (under `--publish-properties full`).
pub const HEADER_LSN: &str = "x-pgoutbox-lsn";
/// Header with the LSN of the transaction's commit record (`X/Y` text, pgoutput Begin's
/// final LSN): increases with commit order.
pub const HEADER_COMMIT_LSN: &str = "x-pgoutbox-commit-lsn";
/// Header with the commit time, microseconds since the Unix epoch (an integer).
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
/// Header with the envelope's `tenant` (text), when given; the inbox helper records it.
pub const HEADER_TENANT: &str = "x-pgoutbox-tenant";
/// Header with the envelope's `idempotency_key` (text), when given.
pub const HEADER_IDEMPOTENCY_KEY: &str = "x-pgoutbox-idempotency-key";
/// The W3C Trace Context header (section 3.2), the envelope's `traceparent` unchanged.
pub const HEADER_TRACEPARENT: &str = "traceparent";
/// The W3C Trace Context header (section 3.3), the envelope's `tracestate` unchanged.
pub const HEADER_TRACESTATE: &str = "tracestate";

/// Header keys starting with this (ASCII case-insensitively) are pgoutbox's own: a
/// producer's header with such a key is refused at emit and at decode.
pub const RESERVED_HEADER_PREFIX: &str = "x-pgoutbox-";
/// Header keys a producer may not use (ASCII case-insensitively): RabbitMQ's
/// sender-selected distribution would route the message by them.
pub const FORBIDDEN_HEADER_KEYS: [&str; 2] = ["CC", "BCC"];

/// The longest topic, message id, content type, header key and text metadata field, in
/// bytes: they become AMQP short strings (routing key, message-id, content-type,
/// correlation-id, field-table key), and the metadata sent as header values is held to the
/// same bound.
pub const MAX_SHORT_STR: usize = 255;
/// The highest AMQP priority a producer may give (`priority` 0 to 9).
pub const MAX_PRIORITY: u8 = 9;
/// The largest per-message TTL (`expiration_ms`) RabbitMQ accepts: 2^32 - 1 ms (about 49.7
/// days); a larger `expiration` property makes the broker close the channel.
pub const MAX_EXPIRATION_MS: u64 = u32::MAX as u64;
/// The AMQP `delivery-mode` of every publish: 2, persistent.
pub const DELIVERY_MODE_PERSISTENT: u8 = 2;

/// The reasons a message is written to `outbox.dead_letter` (its `reason` column, the
/// `reason` label of `pgoutbox_messages_dead_lettered_total`). The one list: the pipeline
/// writes these constants, and the reference (`docs/src/reference/dead-letter-reasons.md`)
/// and the metric's label values are generated from [`dead_letter_reason::ALL`].
pub mod dead_letter_reason {
    /// RabbitMQ nacked every one of `--max-attempts` publishes.
    pub const NACKED: &str = "nacked";
    /// RabbitMQ returned the message as unroutable (312 NO_ROUTE), under
    /// `--on-unroutable dead-letter`.
    pub const RETURNED: &str = "returned";
    /// The message has the outbox's prefix but is no valid envelope, is non-transactional,
    /// or names something that is no exchange name.
    pub const POISON: &str = "poison";
    /// The envelope exceeds `--max-message-bytes`, the payload the broker's
    /// `max_message_size`, or its content header one AMQP frame.
    pub const TOO_LARGE: &str = "too_large";
    /// Under lockdown, a message written after it that does not come from the helpers.
    pub const FORGED: &str = "forged";
    /// The envelope's version is newer than this pgoutbox reads.
    pub const UNSUPPORTED_ENVELOPE: &str = "unsupported_envelope";
    /// The producer named an exchange that is not in `--allowed-exchanges`.
    pub const EXCHANGE_NOT_ALLOWED: &str = "exchange_not_allowed";
    /// The exchange the producer named does not exist (404 to a passive declare under
    /// `--no-declare`).
    pub const EXCHANGE_NOT_FOUND: &str = "exchange_not_found";
    /// RabbitMQ refused to declare the exchange the producer named (406 or 403), or
    /// closed the channel over a publish to it (403: the user may not write it).
    pub const EXCHANGE_REFUSED: &str = "exchange_refused";
    /// RabbitMQ closed the channel over this one publish (to the configured exchange, or for
    /// no exchange it named): found when it was the only unconfirmed publish, or by
    /// publishing one at a time after such a close.
    pub const PUBLISH_REFUSED: &str = "publish_refused";
    /// RabbitMQ answered a publish into a stream with a `PublishError` whose code is
    /// definite for the message (`run --stream`; docs/src/internals/stream-ids.md).
    pub const STREAM_REFUSED: &str = "stream_refused";

    /// Every reason, with one line on what happened, in the order the reference lists them.
    pub const ALL: &[(&str, &str)] = &[
        (NACKED, "RabbitMQ nacked every one of `--max-attempts` publishes (with backoff between them)"),
        (RETURNED, "RabbitMQ returned the message as unroutable (312 NO_ROUTE: no queue bound for its routing key), under `--on-unroutable dead-letter`"),
        (POISON, "the message has the outbox's prefix but is no valid envelope, is non-transactional, or names something that is no exchange name"),
        (TOO_LARGE, "the envelope exceeds `--max-message-bytes`, the payload exceeds the broker's `max_message_size`, or its content header does not fit one AMQP frame"),
        (FORGED, "under `setup --lockdown`, a message written after the lockdown that does not come from `outbox.emit`/`emit_bytes`"),
        (UNSUPPORTED_ENVELOPE, "the envelope's version is newer than this pgoutbox reads (the SQL helpers were upgraded before the binary)"),
        (EXCHANGE_NOT_ALLOWED, "the producer named an exchange that is neither in `--allowed-exchanges` nor `--exchange`"),
        (EXCHANGE_NOT_FOUND, "the exchange the producer named does not exist (404 to the passive declare of `--no-declare`)"),
        (EXCHANGE_REFUSED, "RabbitMQ refused to declare the exchange the producer named (406 PRECONDITION_FAILED or 403 ACCESS_REFUSED), or closed the channel over a publish to it (403 ACCESS_REFUSED: the streamer's user may not write it); later messages to it are dead-lettered without publishing"),
        (PUBLISH_REFUSED, "RabbitMQ closed the channel over this one publish, for a reason that names no exchange of the producer's (found when it was the only unconfirmed publish, or by publishing one at a time after such a close)"),
        (STREAM_REFUSED, "RabbitMQ answered the publish into the stream (`--stream`) with a publish error that is definite for the message (access refused, precondition failed, ...); the code is in the error. A publish error is never retried with its publishing id: the broker would confirm it without storing it"),
    ];
}

/// The JSON keys of the envelope header (`docs/src/reference/envelope.md`), as `outbox._envelope` in
/// `sql/outbox.sql` writes them.
pub mod envelope_key {
    /// The message id (every version).
    pub const ID: &str = "id";
    /// The topic, the routing key (every version).
    pub const TOPIC: &str = "topic";
    /// The content type (every version).
    pub const CONTENT_TYPE: &str = "content_type";
    /// The producer's headers, a JSON object (every version).
    pub const HEADERS: &str = "headers";
    /// The emitting `session_user` (version 2 and later).
    pub const EMITTED_BY: &str = "emitted_by";
    /// Present (`true`, version 2 and later): `emitted_by` was never checked, so it must
    /// not be trusted even under lockdown. Written by `dead-letters requeue` for a message
    /// whose emitter was not checked when it was first streamed; never by the helpers.
    pub const EMITTED_BY_UNCHECKED: &str = "emitted_by_unchecked";
    /// The exchange the producer named (version 3, optional).
    pub const EXCHANGE: &str = "exchange";
    /// Event metadata (version 3, optional): the AMQP `correlation-id`.
    pub const CORRELATION_ID: &str = "correlation_id";
    /// Event metadata: the id of the message that caused this one.
    pub const CAUSATION_ID: &str = "causation_id";
    /// Event metadata: the aggregate's type.
    pub const AGGREGATE_TYPE: &str = "aggregate_type";
    /// Event metadata: the aggregate's id.
    pub const AGGREGATE_ID: &str = "aggregate_id";
    /// Event metadata: the aggregate's version (an integer).
    pub const AGGREGATE_VERSION: &str = "aggregate_version";
    /// Event metadata: the tenant.
    pub const TENANT: &str = "tenant";
    /// Event metadata: the per-message TTL in milliseconds (an integer).
    pub const EXPIRATION_MS: &str = "expiration_ms";
    /// Event metadata: the AMQP priority, 0 to 9.
    pub const PRIORITY: &str = "priority";
    /// Event metadata: W3C Trace Context `traceparent`.
    pub const TRACEPARENT: &str = "traceparent";
    /// Event metadata: W3C Trace Context `tracestate`.
    pub const TRACESTATE: &str = "tracestate";
    /// Event metadata: the producer's idempotency key.
    pub const IDEMPOTENCY_KEY: &str = "idempotency_key";
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn our_headers_carry_the_reserved_prefix_and_trace_context_keeps_its_w3c_names() {
        for name in [
            HEADER_LSN,
            HEADER_COMMIT_LSN,
            HEADER_COMMIT_TIME_US,
            HEADER_EMITTED_BY,
            HEADER_CAUSATION_ID,
            HEADER_AGGREGATE_TYPE,
            HEADER_AGGREGATE_ID,
            HEADER_AGGREGATE_VERSION,
            HEADER_TENANT,
            HEADER_IDEMPOTENCY_KEY,
        ] {
            assert!(name.starts_with(RESERVED_HEADER_PREFIX), "{name}");
            assert!(name.len() <= MAX_SHORT_STR);
        }
        assert_eq!(HEADER_TRACEPARENT, envelope_key::TRACEPARENT);
        assert_eq!(HEADER_TRACESTATE, envelope_key::TRACESTATE);
    }
}
