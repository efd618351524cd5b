//! The pgoutbox envelope: the versioned byte format of an outbox message.
//!
//! `outbox.emit` / `outbox.emit_bytes` (see `sql/outbox.sql`) write one envelope as the
//! content of a transactional logical decoding message with prefix [`PREFIX`]. Versions 1,
//! 2 and 3 (see `docs/src/reference/envelope.md`) share one layout:
//!
//! | bytes        | content                                                              |
//! |--------------|----------------------------------------------------------------------|
//! | 0            | version: [`VERSION_1`], [`VERSION_2`] or [`VERSION_3`] (`0x01`..`0x03`) |
//! | 1..5         | N, header length in bytes, u32 big-endian                            |
//! | 5..5+N       | header: UTF-8 JSON object `{"id", "topic", "content_type", "headers"}`, in version 2 and later also `"emitted_by"`, in version 3 also the optional metadata keys |
//! | 5+N..        | payload, raw bytes                                                   |
//!
//! Version 2 adds `emitted_by`: the `session_user` that called the helper (not
//! `current_user`, which inside the `SECURITY DEFINER` helpers of `setup --lockdown` is
//! their owner). Version 3 (written by the current `sql/outbox.sql`) adds optional keys,
//! each present only when the producer set it: `exchange` and the event [`Metadata`]
//! (`correlation_id`, `causation_id`, `aggregate_type`, `aggregate_id`,
//! `aggregate_version`, `tenant`, `expiration_ms`, `priority`, `traceparent`, `tracestate`,
//! `idempotency_key`). Older versions are still read; keys a version does not define are
//! ignored, as any unknown key is (an `emitted_by` in a version-1 header, a `tenant` in a
//! version-2 one). A version byte from 4 to [`MAX_FUTURE_VERSION`] is
//! [`EnvelopeError::UnsupportedVersion`]: the streamer dead-letters such a message with
//! reason `unsupported_envelope` and never publishes it.
//!
//! [`decode`] enforces the same rules the SQL enforces at emit time (see
//! [`Envelope::validate`]), so a message that slipped past them (an older or hand-written
//! producer) is rejected with a clear error instead of being published. Decoding never
//! panics on input; the payload is a zero-copy [`Bytes`] slice of the input.
//!
//! Trace context follows W3C Trace Context (<https://www.w3.org/TR/trace-context/>):
//! `traceparent` section 3.2 (version-format, and for version `00` exactly
//! `00-<32 hex trace-id>-<16 hex parent-id>-<2 hex flags>`), `tracestate` section 3.3
//! (checked loosely: at most 512 characters and 32 list-members, each `key=value` with the
//! key and value character sets of section 3.3.1).

use std::fmt::Display;

use bytes::Bytes;
use serde_json::{Map, Value};

/// The logical decoding message prefix pgoutbox envelopes are emitted with.
pub const PREFIX: &str = "pgoutbox";

/// The version byte of envelope format version 1 (no emitter).
pub const VERSION_1: u8 = 1;

/// The version byte of envelope format version 2: version 1 plus the header field
/// `emitted_by` (the emitting `session_user`).
pub const VERSION_2: u8 = 2;

/// The version byte of envelope format version 3: version 2 plus the optional header keys
/// `exchange` and those of [`Metadata`]. What `outbox.emit` writes today.
pub const VERSION_3: u8 = 3;

/// The newest envelope version this pgoutbox reads (and the one the SQL helpers write).
pub const CURRENT_VERSION: u8 = VERSION_3;

/// The longest short-string field in bytes ([`crate::contract::MAX_SHORT_STR`]).
pub use crate::contract::MAX_SHORT_STR;

/// The highest first byte read as a (future) envelope version. Versions grow by one per
/// format change, so anything above this, in particular any printable ASCII character
/// (0x20 and up), is not a version but content that is no envelope.
pub const MAX_FUTURE_VERSION: u8 = 0x1f;

/// The highest priority and the largest TTL a producer may give
/// ([`crate::contract`]'s property rules).
pub use crate::contract::{MAX_EXPIRATION_MS, MAX_PRIORITY};

/// The longest `tracestate` W3C Trace Context section 3.3.1.1 asks vendors to propagate.
pub const MAX_TRACESTATE_LEN: usize = 512;

/// The most list-members a `tracestate` may hold (W3C Trace Context section 3.3.1.1).
const MAX_TRACESTATE_MEMBERS: usize = 32;

/// ` ('c')` for a printable ASCII byte, else nothing.
fn printable(b: u8) -> String {
    if b.is_ascii_graphic() {
        format!(" ('{}')", b as char)
    } else {
        String::new()
    }
}

/// Length in bytes of the fixed part before the header: version byte and u32 header length.
const FIXED_LEN: usize = 1 + 4;

use crate::contract::envelope_key as key;
use crate::contract::{FORBIDDEN_HEADER_KEYS, RESERVED_HEADER_PREFIX};

/// One decoded outbox message.
#[derive(Debug, Clone, PartialEq)]
pub struct Envelope {
    /// The format version it was decoded from ([`VERSION_1`] to [`VERSION_3`]), and the one
    /// [`encode`] writes.
    pub version: u8,
    /// The message id (header field `id`): 1 to 255 bytes; becomes the AMQP `message-id`.
    pub message_id: String,
    /// The topic (header field `topic`): 1 to 255 bytes; used as the AMQP routing key.
    pub topic: String,
    /// The content type (header field `content_type`): at most 255 bytes; `emit` writes
    /// `application/json`.
    pub content_type: String,
    /// Application headers (header field `headers`), each key at most 255 bytes, none
    /// starting with `x-pgoutbox-` and none equal to `CC`/`BCC` (ASCII case-insensitive).
    pub headers: Map<String, Value>,
    /// The payload bytes, exactly as the producer gave them (for `emit`: the UTF-8 text of
    /// the jsonb value).
    pub payload: Bytes,
    /// Who emitted it (version-2 header field `emitted_by`): the `session_user` of the
    /// session that called `outbox.emit`/`outbox.emit_bytes`, 1 to 255 bytes. `None` for a
    /// version-1 envelope, or a later one without the field (which the helpers never
    /// write; under `setup --lockdown` such a message is dead-lettered as `forged`).
    pub emitted_by: Option<String>,
    /// Whether the header says that `emitted_by` was never checked (version-2 header key
    /// `emitted_by_unchecked`, written by `dead-letters requeue` for a message streamed
    /// before a lockdown): the streamer then never sends it as checked. Any value of the
    /// key counts (fail closed); the helpers never write it.
    pub emitted_by_unchecked: bool,
    /// The exchange the producer named (version-3 header field `exchange`), 1 to 255 bytes;
    /// `None`: the streamer's `--exchange`. Carried and validated here; routing by it is
    /// the publisher's business.
    pub exchange: Option<String>,
    /// The event metadata (version-3 header fields); all `None` before version 3.
    pub meta: Metadata,
}

/// Event metadata a producer may give `outbox.emit` (envelope version 3): each field is
/// `None` when not given, and its JSON key is absent from the header then.
///
/// Every text field is 1 to 255 bytes. How each reaches the AMQP message is described at
/// `InFlight::to_outbound` (in `src/pipeline/in_flight.rs`) and in the book's
/// `docs/src/producers/metadata.md`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Metadata {
    /// `correlation_id`: the AMQP `correlation-id` property.
    pub correlation_id: Option<String>,
    /// `causation_id`: the id of the message that caused this one.
    pub causation_id: Option<String>,
    /// `aggregate_type`: the kind of entity the event is about (`order`).
    pub aggregate_type: Option<String>,
    /// `aggregate_id`: the entity's id.
    pub aggregate_id: Option<String>,
    /// `aggregate_version`: the entity's version after the event, 0 or more (a JSON
    /// integer).
    pub aggregate_version: Option<i64>,
    /// `tenant`: the tenant the event belongs to; also scopes `idempotency_key`.
    pub tenant: Option<String>,
    /// `expiration_ms`: per-message TTL in milliseconds, 0 to [`MAX_EXPIRATION_MS`]; the
    /// AMQP `expiration` property.
    pub expiration_ms: Option<u64>,
    /// `priority`: 0 to [`MAX_PRIORITY`]; the AMQP `priority` property.
    pub priority: Option<u8>,
    /// `traceparent`: W3C Trace Context section 3.2, published unchanged.
    pub traceparent: Option<String>,
    /// `tracestate`: W3C Trace Context section 3.3, at most 512 bytes, published unchanged.
    pub tracestate: Option<String>,
    /// `idempotency_key`: the producer's dedup key (recorded in `outbox.idempotency` at
    /// emit time, per tenant).
    pub idempotency_key: Option<String>,
}

impl Metadata {
    /// Whether no field is set.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        *self == Metadata::default()
    }

    /// The fields that are set, as a JSON object under the envelope's own keys
    /// (`correlation_id`, ..., `expiration_ms`, `priority`, ...; integers as JSON numbers;
    /// serde_json's map keeps its keys sorted). Empty when none is set. For display
    /// (`pgoutbox peek`).
    #[must_use]
    pub fn to_json(&self) -> Map<String, Value> {
        let mut m = Map::new();
        let text = [
            ("correlation_id", &self.correlation_id),
            ("causation_id", &self.causation_id),
            ("aggregate_type", &self.aggregate_type),
            ("aggregate_id", &self.aggregate_id),
        ];
        for (k, v) in text {
            if let Some(v) = v {
                m.insert(k.into(), Value::from(v.as_str()));
            }
        }
        if let Some(v) = self.aggregate_version {
            m.insert("aggregate_version".into(), Value::from(v));
        }
        if let Some(v) = &self.tenant {
            m.insert("tenant".into(), Value::from(v.as_str()));
        }
        if let Some(v) = self.expiration_ms {
            m.insert("expiration_ms".into(), Value::from(v));
        }
        if let Some(v) = self.priority {
            m.insert("priority".into(), Value::from(v));
        }
        let text = [
            ("traceparent", &self.traceparent),
            ("tracestate", &self.tracestate),
            ("idempotency_key", &self.idempotency_key),
        ];
        for (k, v) in text {
            if let Some(v) = v {
                m.insert(k.into(), Value::from(v.as_str()));
            }
        }
        m
    }

    /// Checks the rules `outbox.emit` enforces on the metadata arguments.
    ///
    /// # Errors
    /// [`EnvelopeError::EmptyField`] or [`EnvelopeError::FieldTooLong`] for a text field;
    /// [`EnvelopeError::OutOfRange`] for `aggregate_version` below 0, `expiration_ms` above
    /// [`MAX_EXPIRATION_MS`] or `priority` above [`MAX_PRIORITY`];
    /// [`EnvelopeError::InvalidTraceparent`] or [`EnvelopeError::InvalidTracestate`] (also
    /// for a tracestate without a traceparent).
    pub fn validate(&self) -> Result<(), EnvelopeError> {
        for (field, value) in [
            ("correlation_id", &self.correlation_id),
            ("causation_id", &self.causation_id),
            ("aggregate_type", &self.aggregate_type),
            ("aggregate_id", &self.aggregate_id),
            ("tenant", &self.tenant),
            ("idempotency_key", &self.idempotency_key),
        ] {
            if let Some(v) = value {
                short_str(field, v, false)?;
            }
        }
        if let Some(v) = self.aggregate_version {
            if v < 0 {
                return Err(out_of_range("aggregate_version", v, "expected 0 or more"));
            }
        }
        if let Some(v) = self.expiration_ms {
            if v > MAX_EXPIRATION_MS {
                return Err(out_of_range(
                    "expiration_ms",
                    v,
                    "expected 0 to 4294967295 (RabbitMQ's largest per-message TTL)",
                ));
            }
        }
        if let Some(v) = self.priority {
            if v > MAX_PRIORITY {
                return Err(out_of_range("priority", v, "expected 0 to 9"));
            }
        }
        if let Some(tp) = &self.traceparent {
            check_traceparent(tp).map_err(|reason| EnvelopeError::InvalidTraceparent {
                start: tp.chars().take(60).collect(),
                reason,
            })?;
        }
        if let Some(ts) = &self.tracestate {
            if self.traceparent.is_none() {
                return Err(EnvelopeError::InvalidTracestate {
                    reason: "given without a traceparent".into(),
                });
            }
            check_tracestate(ts).map_err(|reason| EnvelopeError::InvalidTracestate { reason })?;
        }
        Ok(())
    }
}

fn out_of_range(field: &'static str, value: impl Display, rule: &'static str) -> EnvelopeError {
    EnvelopeError::OutOfRange {
        field,
        value: value.to_string(),
        rule,
    }
}

/// Whether every byte of `b` is a lowercase hex digit (W3C Trace Context `HEXDIGLC`).
fn lower_hex(b: &[u8]) -> bool {
    b.iter().all(|c| matches!(c, b'0'..=b'9' | b'a'..=b'f'))
}

/// Checks a `traceparent` value by W3C Trace Context section 3.2: `version "-" trace-id
/// "-" parent-id "-" trace-flags`, all lowercase hex; version `ff` is invalid; trace-id
/// (32 hex) and parent-id (16 hex) are not all zeros; version `00` is exactly 55
/// characters; a higher version is parsed as `00` and may only go on after a `-`
/// (section 3.2.4, "Versioning of traceparent"). At most 255 bytes here.
fn check_traceparent(tp: &str) -> Result<(), String> {
    let b = tp.as_bytes();
    if b.len() > MAX_SHORT_STR {
        return Err(format!("{} bytes long, the limit is 255", b.len()));
    }
    if b.len() < 55 {
        return Err(format!(
            "{} characters long, a traceparent has at least 55 (00-<32 hex trace-id>-<16 hex parent-id>-<2 hex flags>)",
            b.len()
        ));
    }
    let (version, trace_id, parent_id, flags) = (&b[0..2], &b[3..35], &b[36..52], &b[53..55]);
    if !lower_hex(version) {
        return Err("the version is not 2 lowercase hex digits".into());
    }
    if version == b"ff" {
        return Err("version ff is invalid".into());
    }
    if b[2] != b'-' || b[35] != b'-' || b[52] != b'-' {
        return Err("expected '-' after the version, the trace-id and the parent-id".into());
    }
    if !lower_hex(trace_id) || !lower_hex(parent_id) || !lower_hex(flags) {
        return Err("trace-id, parent-id and trace-flags must be lowercase hex".into());
    }
    if trace_id.iter().all(|&c| c == b'0') {
        return Err("the trace-id is all zeros".into());
    }
    if parent_id.iter().all(|&c| c == b'0') {
        return Err("the parent-id is all zeros".into());
    }
    if version == b"00" && b.len() != 55 {
        return Err("version 00 is exactly 55 characters long".into());
    }
    if b.len() > 55 && b[55] != b'-' {
        return Err("after the trace-flags a higher version may only go on with '-'".into());
    }
    Ok(())
}

/// Checks a `tracestate` value loosely by W3C Trace Context section 3.3: at most 512
/// characters; list-members separated by `,` with optional spaces and tabs around them
/// (empty members allowed), at most 32 of them; each `key=value` where the key is 1 to 256
/// of `a-z 0-9 _ - * / @` starting with `a-z` or `0-9`, with at most one `@` (section
/// 3.3.1.3.1), and the value 1 to 256 printable ASCII characters other than `,` and `=`,
/// not ending in a space (section 3.3.1.3.2).
fn check_tracestate(ts: &str) -> Result<(), String> {
    if ts.len() > MAX_TRACESTATE_LEN {
        return Err(format!("{} bytes long, the limit is 512", ts.len()));
    }
    let mut members = 0usize;
    for (i, member) in ts.split(',').enumerate() {
        let member = member.trim_matches(|c| c == ' ' || c == '\t');
        if member.is_empty() {
            continue;
        }
        members += 1;
        let bad = |what: &str| format!("list-member {} ({member:?}): {what}", i + 1);
        let Some((key, value)) = member.split_once('=') else {
            return Err(bad("expected key=value"));
        };
        let kb = key.as_bytes();
        let key_ok = !kb.is_empty()
            && kb.len() <= 256
            && matches!(kb[0], b'a'..=b'z' | b'0'..=b'9')
            && kb
                .iter()
                .all(|c| matches!(c, b'a'..=b'z' | b'0'..=b'9' | b'_' | b'-' | b'*' | b'/' | b'@'))
            && kb.iter().filter(|&&c| c == b'@').count() <= 1;
        if !key_ok {
            return Err(bad(
                "the key must be 1 to 256 of a-z 0-9 _ - * / (and one @), starting with a-z or 0-9",
            ));
        }
        let vb = value.as_bytes();
        let value_ok = !vb.is_empty()
            && vb.len() <= 256
            && vb
                .iter()
                .all(|&c| (0x20..=0x7e).contains(&c) && c != b',' && c != b'=')
            && vb.last() != Some(&b' ');
        if !value_ok {
            return Err(bad(
                "the value must be 1 to 256 printable ASCII characters other than , and =, not ending in a space",
            ));
        }
    }
    if members > MAX_TRACESTATE_MEMBERS {
        return Err(format!("{members} list-members, the limit is 32"));
    }
    Ok(())
}

/// Why envelope bytes could not be decoded, or an [`Envelope`] breaks the rules.
#[derive(Debug, thiserror::Error)]
pub enum EnvelopeError {
    /// The content had no bytes at all.
    #[error("empty envelope: expected at least a version byte at offset 0")]
    Empty,
    /// The version byte is newer than this pgoutbox understands (4 to
    /// [`MAX_FUTURE_VERSION`]): the envelope was written by a newer `sql/outbox.sql`. The
    /// streamer dead-letters it with reason `unsupported_envelope`.
    #[error(
        "unsupported envelope version {version} at offset 0: this pgoutbox understands versions 1 \
         to 3 only; the envelope was written by a newer outbox.emit, so a newer pgoutbox may be \
         needed"
    )]
    UnsupportedVersion {
        /// The version byte found.
        version: u8,
    },
    /// The first byte is no envelope version at all (0, or above [`MAX_FUTURE_VERSION`], such
    /// as the first character of hand-written text): the message was not written by
    /// `outbox.emit`/`outbox.emit_bytes`.
    #[error(
        "not a pgoutbox envelope: the content starts with byte {first_byte:#04x}{}, where an \
         envelope starts with its version (1 to 3); emit outbox messages with outbox.emit or \
         outbox.emit_bytes (or the emit functions of the outbox's own --schema), not \
         pg_logical_emit_message directly",
        printable(*first_byte)
    )]
    NotAnEnvelope {
        /// The first byte of the content.
        first_byte: u8,
    },
    /// Fewer than 4 bytes follow the version byte.
    #[error(
        "truncated envelope: the header length needs 4 bytes at offset 1, only {available} left"
    )]
    TruncatedHeaderLength {
        /// Bytes after the version byte.
        available: usize,
    },
    /// The header length points past the end of the content.
    #[error(
        "truncated envelope: the header length says {declared} bytes at offset 5, only \
         {available} left"
    )]
    TruncatedHeader {
        /// The declared header length in bytes.
        declared: u32,
        /// Bytes after the header length.
        available: usize,
    },
    /// The header is not valid UTF-8 JSON.
    #[error("envelope header at offset 5 is not valid JSON: {0}")]
    HeaderNotJson(#[source] serde_json::Error),
    /// The header is JSON but not an object.
    #[error("envelope header at offset 5 is a JSON {found}, expected an object")]
    HeaderNotObject {
        /// The JSON type found, e.g. `"array"`.
        found: &'static str,
    },
    /// A required header field is absent.
    #[error("envelope header has no {field:?} field")]
    MissingField {
        /// The JSON key.
        field: &'static str,
    },
    /// A header field that must be a string is not.
    #[error("envelope header field {field:?} is a JSON {found}, expected a string")]
    FieldNotString {
        /// The JSON key.
        field: &'static str,
        /// The JSON type found.
        found: &'static str,
    },
    /// A version-3 header field that must be an integer (`aggregate_version`,
    /// `expiration_ms`, `priority`) is not one, or does not fit 64 bits.
    #[error("envelope header field {field:?} is a JSON {found}, expected an integer")]
    FieldNotInteger {
        /// The JSON key.
        field: &'static str,
        /// What was found: a JSON type, or `"number that is no 64-bit integer"`.
        found: &'static str,
    },
    /// An integer metadata field is outside its range.
    #[error("envelope {field} is {value}: {rule}")]
    OutOfRange {
        /// The JSON key.
        field: &'static str,
        /// The value found, as text.
        value: String,
        /// The range allowed.
        rule: &'static str,
    },
    /// `traceparent` is not a W3C Trace Context traceparent (section 3.2).
    #[error("envelope traceparent {start:?} is invalid (W3C Trace Context section 3.2): {reason}")]
    InvalidTraceparent {
        /// The first (up to 60) characters of the value.
        start: String,
        /// What is wrong.
        reason: String,
    },
    /// `tracestate` is not a W3C Trace Context tracestate (section 3.3).
    #[error("envelope tracestate is invalid (W3C Trace Context section 3.3): {reason}")]
    InvalidTracestate {
        /// What is wrong.
        reason: String,
    },
    /// The header field `headers` is not an object.
    #[error("envelope header field \"headers\" is a JSON {found}, expected an object")]
    HeadersNotObject {
        /// The JSON type found.
        found: &'static str,
    },
    /// A field that must not be empty is.
    #[error("envelope {field} is empty")]
    EmptyField {
        /// Which field: `"topic"`, `"id"`, `"emitted_by"`, `"exchange"` or a text metadata
        /// field.
        field: &'static str,
    },
    /// A short-string field is longer than 255 bytes.
    #[error("envelope {field} is {len} bytes long, the limit is 255 bytes")]
    FieldTooLong {
        /// Which field.
        field: &'static str,
        /// Its length in bytes.
        len: usize,
    },
    /// A key of `headers` is longer than 255 bytes.
    #[error("envelope header key starting {start:?} is {len} bytes long, the limit is 255 bytes")]
    HeaderKeyTooLong {
        /// The first (up to 40) characters of the key.
        start: String,
        /// Its length in bytes.
        len: usize,
    },
    /// A key of `headers` starts with `x-pgoutbox-` (any ASCII case).
    #[error(
        "envelope header key {key:?} is reserved: keys starting x-pgoutbox- are added by pgoutbox"
    )]
    ReservedHeaderKey {
        /// The key.
        key: String,
    },
    /// A key of `headers` is `CC` or `BCC` (any ASCII case).
    #[error(
        "envelope header key {key:?} is not allowed: CC/BCC trigger RabbitMQ sender-selected \
         distribution"
    )]
    ForbiddenHeaderKey {
        /// The key.
        key: String,
    },
}

/// Decodes the content of a logical decoding message with prefix [`PREFIX`].
///
/// Accepts envelope versions 1, 2 and 3 (layout in the module docs and
/// `docs/src/reference/envelope.md`). Header keys a version does not define are ignored, and JSON key
/// order does not matter. A version-2 or -3 header without `emitted_by` decodes with
/// [`Envelope::emitted_by`] `None`; one whose `emitted_by` is not a string of 1 to 255
/// bytes is an error. In version 3 the optional keys, when present, must have their type
/// (text, or a JSON integer for `aggregate_version`, `expiration_ms`, `priority`; `null` is
/// an error, the helpers leave a key out instead) and pass [`Metadata::validate`]. The
/// payload is a zero-copy slice of `content`.
///
/// # Errors
/// [`EnvelopeError::Empty`], [`EnvelopeError::UnsupportedVersion`],
/// [`EnvelopeError::NotAnEnvelope`],
/// [`EnvelopeError::TruncatedHeaderLength`] or [`EnvelopeError::TruncatedHeader`] for bad
/// framing; [`EnvelopeError::HeaderNotJson`], [`EnvelopeError::HeaderNotObject`],
/// [`EnvelopeError::MissingField`], [`EnvelopeError::FieldNotString`],
/// [`EnvelopeError::FieldNotInteger`] or [`EnvelopeError::HeadersNotObject`] for a bad
/// header; and any error of [`Envelope::validate`].
pub fn decode(content: Bytes) -> Result<Envelope, EnvelopeError> {
    let Some(&version) = content.first() else {
        return Err(EnvelopeError::Empty);
    };
    if !(VERSION_1..=CURRENT_VERSION).contains(&version) {
        return Err(
            if (CURRENT_VERSION + 1..=MAX_FUTURE_VERSION).contains(&version) {
                EnvelopeError::UnsupportedVersion { version }
            } else {
                EnvelopeError::NotAnEnvelope {
                    first_byte: version,
                }
            },
        );
    }
    let len_bytes: [u8; 4] = content
        .get(1..FIXED_LEN)
        .and_then(|s| s.try_into().ok())
        .ok_or(EnvelopeError::TruncatedHeaderLength {
            available: content.len().saturating_sub(1),
        })?;
    let declared = u32::from_be_bytes(len_bytes);
    let available = content.len().saturating_sub(FIXED_LEN);
    let header_end = usize::try_from(declared)
        .ok()
        .and_then(|n| n.checked_add(FIXED_LEN))
        .filter(|&end| end <= content.len())
        .ok_or(EnvelopeError::TruncatedHeader {
            declared,
            available,
        })?;
    let header_bytes =
        content
            .get(FIXED_LEN..header_end)
            .ok_or(EnvelopeError::TruncatedHeader {
                declared,
                available,
            })?;

    let header: Value =
        serde_json::from_slice(header_bytes).map_err(EnvelopeError::HeaderNotJson)?;
    let Value::Object(mut header) = header else {
        return Err(EnvelopeError::HeaderNotObject {
            found: json_type(&header),
        });
    };
    let message_id = take_string(&mut header, key::ID)?;
    let topic = take_string(&mut header, key::TOPIC)?;
    let content_type = take_string(&mut header, key::CONTENT_TYPE)?;
    let headers = match header.remove(key::HEADERS) {
        None => return Err(EnvelopeError::MissingField { field: "headers" }),
        Some(Value::Object(m)) => m,
        Some(other) => {
            return Err(EnvelopeError::HeadersNotObject {
                found: json_type(&other),
            })
        }
    };

    let (emitted_by, emitted_by_unchecked) = if version >= VERSION_2 {
        (
            take_opt_string(&mut header, key::EMITTED_BY)?,
            header.remove(key::EMITTED_BY_UNCHECKED).is_some(),
        )
    } else {
        (None, false)
    };
    let (exchange, meta) = if version >= VERSION_3 {
        let h = &mut header;
        let exchange = take_opt_string(h, key::EXCHANGE)?;
        let meta = Metadata {
            correlation_id: take_opt_string(h, key::CORRELATION_ID)?,
            causation_id: take_opt_string(h, key::CAUSATION_ID)?,
            aggregate_type: take_opt_string(h, key::AGGREGATE_TYPE)?,
            aggregate_id: take_opt_string(h, key::AGGREGATE_ID)?,
            aggregate_version: take_opt_i64(h, key::AGGREGATE_VERSION)?,
            tenant: take_opt_string(h, key::TENANT)?,
            expiration_ms: take_opt_i64(h, key::EXPIRATION_MS)?
                .map(|v| {
                    u64::try_from(v).map_err(|_| {
                        out_of_range(
                            "expiration_ms",
                            v,
                            "expected 0 to 4294967295 (RabbitMQ's largest per-message TTL)",
                        )
                    })
                })
                .transpose()?,
            priority: take_opt_i64(h, key::PRIORITY)?
                .map(|v| {
                    u8::try_from(v)
                        .ok()
                        .filter(|p| *p <= MAX_PRIORITY)
                        .ok_or_else(|| out_of_range("priority", v, "expected 0 to 9"))
                })
                .transpose()?,
            traceparent: take_opt_string(h, key::TRACEPARENT)?,
            tracestate: take_opt_string(h, key::TRACESTATE)?,
            idempotency_key: take_opt_string(h, key::IDEMPOTENCY_KEY)?,
        };
        (exchange, meta)
    } else {
        (None, Metadata::default())
    };
    let env = Envelope {
        version,
        message_id,
        topic,
        content_type,
        headers,
        payload: content.slice(header_end..),
        emitted_by,
        emitted_by_unchecked,
        exchange,
        meta,
    };
    env.validate()?;
    Ok(env)
}

/// Encodes `env` as envelope version [`Envelope::version`], with the fields that version
/// carries: `emitted_by` (when set) from version 2 on, `exchange` and the [`Metadata`]
/// fields (each when set) from version 3 on; fields a version does not carry are left out.
/// Version 3 is exactly the bytes `outbox._envelope` in `sql/outbox.sql` produces for the
/// same fields, except that the JSON header may use a different key order and whitespace
/// (decoders must not care).
///
/// Does not validate; call [`Envelope::validate`] first if `env` is not known to be valid.
///
/// # Panics
/// If the JSON header is longer than `u32::MAX` bytes (4 GiB), which the u32 length field
/// cannot express.
#[must_use]
pub fn encode(env: &Envelope) -> Vec<u8> {
    let mut header = Map::new();
    header.insert(key::ID.into(), Value::String(env.message_id.clone()));
    header.insert(key::TOPIC.into(), Value::String(env.topic.clone()));
    header.insert(
        key::CONTENT_TYPE.into(),
        Value::String(env.content_type.clone()),
    );
    header.insert(key::HEADERS.into(), Value::Object(env.headers.clone()));
    let mut text = |key: &str, value: &Option<String>| {
        if let Some(v) = value {
            header.insert(key.into(), Value::String(v.clone()));
        }
    };
    if env.version >= VERSION_2 {
        text(key::EMITTED_BY, &env.emitted_by);
    }
    if env.version >= VERSION_3 {
        let m = &env.meta;
        text(key::EXCHANGE, &env.exchange);
        text(key::CORRELATION_ID, &m.correlation_id);
        text(key::CAUSATION_ID, &m.causation_id);
        text(key::AGGREGATE_TYPE, &m.aggregate_type);
        text(key::AGGREGATE_ID, &m.aggregate_id);
        text(key::TENANT, &m.tenant);
        text(key::TRACEPARENT, &m.traceparent);
        text(key::TRACESTATE, &m.tracestate);
        text(key::IDEMPOTENCY_KEY, &m.idempotency_key);
        if let Some(v) = m.aggregate_version {
            header.insert(key::AGGREGATE_VERSION.into(), v.into());
        }
        if let Some(v) = m.expiration_ms {
            header.insert(key::EXPIRATION_MS.into(), v.into());
        }
        if let Some(v) = m.priority {
            header.insert(key::PRIORITY.into(), v.into());
        }
    }
    if env.version >= VERSION_2 && env.emitted_by_unchecked {
        header.insert(key::EMITTED_BY_UNCHECKED.into(), Value::Bool(true));
    }
    let header = Value::Object(header).to_string();
    let header_len = u32::try_from(header.len())
        .expect("envelope JSON header longer than 4 GiB cannot be encoded");
    let mut out = Vec::with_capacity(FIXED_LEN + header.len() + env.payload.len());
    out.push(env.version);
    out.extend_from_slice(&header_len.to_be_bytes());
    out.extend_from_slice(header.as_bytes());
    out.extend_from_slice(&env.payload);
    out
}

impl Envelope {
    /// Checks the rules `outbox.emit` enforces: `topic` and `message_id` 1 to 255 bytes,
    /// `content_type` at most 255 bytes, every header key at most 255 bytes, not starting
    /// with `x-pgoutbox-` and not `CC`/`BCC` (both ASCII case-insensitive); an emitter and
    /// an exchange, when present, 1 to 255 bytes; and [`Metadata::validate`].
    ///
    /// # Errors
    /// [`EnvelopeError::EmptyField`], [`EnvelopeError::FieldTooLong`],
    /// [`EnvelopeError::HeaderKeyTooLong`], [`EnvelopeError::ReservedHeaderKey`] or
    /// [`EnvelopeError::ForbiddenHeaderKey`] for the first rule broken (field `emitted_by`
    /// or `exchange` for those), then any error of [`Metadata::validate`].
    pub fn validate(&self) -> Result<(), EnvelopeError> {
        short_str("topic", &self.topic, false)?;
        short_str("id", &self.message_id, false)?;
        short_str("content_type", &self.content_type, true)?;
        if let Some(who) = &self.emitted_by {
            short_str("emitted_by", who, false)?;
        }
        if let Some(exchange) = &self.exchange {
            short_str("exchange", exchange, false)?;
        }
        for key in self.headers.keys() {
            if key.len() > MAX_SHORT_STR {
                return Err(EnvelopeError::HeaderKeyTooLong {
                    start: key.chars().take(40).collect(),
                    len: key.len(),
                });
            }
            let reserved = key
                .as_bytes()
                .get(..RESERVED_HEADER_PREFIX.len())
                .is_some_and(|p| p.eq_ignore_ascii_case(RESERVED_HEADER_PREFIX.as_bytes()));
            if reserved {
                return Err(EnvelopeError::ReservedHeaderKey { key: key.clone() });
            }
            if FORBIDDEN_HEADER_KEYS
                .iter()
                .any(|forbidden| key.eq_ignore_ascii_case(forbidden))
            {
                return Err(EnvelopeError::ForbiddenHeaderKey { key: key.clone() });
            }
        }
        self.meta.validate()
    }
}

/// Checks a short-string field: at most 255 bytes, and non-empty unless `may_be_empty`.
fn short_str(field: &'static str, value: &str, may_be_empty: bool) -> Result<(), EnvelopeError> {
    if value.is_empty() && !may_be_empty {
        return Err(EnvelopeError::EmptyField { field });
    }
    if value.len() > MAX_SHORT_STR {
        return Err(EnvelopeError::FieldTooLong {
            field,
            len: value.len(),
        });
    }
    Ok(())
}

/// Removes `field` from the header object and returns it as a string.
fn take_string(
    header: &mut Map<String, Value>,
    field: &'static str,
) -> Result<String, EnvelopeError> {
    match header.remove(field) {
        None => Err(EnvelopeError::MissingField { field }),
        Some(Value::String(s)) => Ok(s),
        Some(other) => Err(EnvelopeError::FieldNotString {
            field,
            found: json_type(&other),
        }),
    }
}

/// Removes the optional `field` from the header object: `None` when absent, else its
/// string value.
fn take_opt_string(
    header: &mut Map<String, Value>,
    field: &'static str,
) -> Result<Option<String>, EnvelopeError> {
    match header.remove(field) {
        None => Ok(None),
        Some(Value::String(s)) => Ok(Some(s)),
        Some(other) => Err(EnvelopeError::FieldNotString {
            field,
            found: json_type(&other),
        }),
    }
}

/// Removes the optional `field` from the header object: `None` when absent, else its value
/// as a 64-bit integer.
fn take_opt_i64(
    header: &mut Map<String, Value>,
    field: &'static str,
) -> Result<Option<i64>, EnvelopeError> {
    match header.remove(field) {
        None => Ok(None),
        Some(Value::Number(n)) => match n.as_i64() {
            Some(v) => Ok(Some(v)),
            None => Err(EnvelopeError::FieldNotInteger {
                field,
                found: "number that is no 64-bit integer",
            }),
        },
        Some(other) => Err(EnvelopeError::FieldNotInteger {
            field,
            found: json_type(&other),
        }),
    }
}

/// The JSON type name of `v`, as PostgreSQL's `jsonb_typeof` spells it.
fn json_type(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "boolean",
        Value::Number(_) => "number",
        Value::String(_) => "string",
        Value::Array(_) => "array",
        Value::Object(_) => "object",
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn unhex(s: &str) -> Bytes {
        assert!(s.len() % 2 == 0);
        (0..s.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
            .collect::<Vec<u8>>()
            .into()
    }

    /// `select encode(outbox._envelope('orders.created',
    ///   convert_to('{"a": 1}'::jsonb::text, 'UTF8'), 'application/json',
    ///   '{"tenant":"acme","n":5}', 'msg-1'), 'hex')` on PostgreSQL 15.
    const FIXTURE_JSON: &str = "01000000757b226964223a20226d73672d31222c2022746f706963223a2022\
        6f72646572732e63726561746564222c202268656164657273223a207b226e223a20352c202274656e616e\
        74223a202261636d65227d2c2022636f6e74656e745f74797065223a20226170706c69636174696f6e2f6a\
        736f6e227d7b2261223a20317d";

    /// `select encode(outbox._envelope('t', '\x00ff00c3a9'::bytea,
    ///   'application/octet-stream', '{}', 'id-2'), 'hex')`: a payload with NUL bytes,
    /// an invalid-UTF-8 byte and a UTF-8 "é".
    const FIXTURE_BYTES: &str = "01000000577b226964223a202269642d32222c2022746f706963223a202274\
        222c202268656164657273223a207b7d2c2022636f6e74656e745f74797065223a20226170706c69636174\
        696f6e2f6f637465742d73747265616d227d00ff00c3a9";

    /// `select encode(outbox._envelope(U&'caf\00e9.\00fcber',
    ///   convert_to(U&'{"name": "Jos\00e9 \+01F389", "z": null}'::jsonb::text, 'UTF8'),
    ///   'application/json', U&'{"\043a\043b\044e\0447": "\0437\043d\0430\0447"}',
    ///   U&'\00fc-3'), 'hex')`: non-ASCII UTF-8 everywhere.
    const FIXTURE_UTF8: &str = "010000006f7b226964223a2022c3bc2d33222c2022746f706963223a202263\
        6166c3a92ec3bc626572222c202268656164657273223a207b22d0bad0bbd18ed187223a2022d0b7d0bdd0\
        b0d187227d2c2022636f6e74656e745f74797065223a20226170706c69636174696f6e2f6a736f6e227d7b\
        227a223a206e756c6c2c20226e616d65223a20224a6f73c3a920f09f8e89227d";

    fn sample() -> Envelope {
        let mut headers = Map::new();
        headers.insert("tenant".into(), json!("acme"));
        headers.insert("n".into(), json!(5));
        Envelope {
            version: VERSION_1,
            message_id: "msg-1".into(),
            topic: "orders.created".into(),
            content_type: "application/json".into(),
            headers,
            payload: Bytes::from_static(b"{\"a\": 1}"),
            emitted_by: None,
            emitted_by_unchecked: false,
            exchange: None,
            meta: Metadata::default(),
        }
    }

    /// Version 2, as the current `sql/outbox.sql` writes it:
    /// `SET ROLE plain; select encode(outbox._envelope('orders.created',
    ///   convert_to('{"a": 1}'::jsonb::text, 'UTF8'), 'application/json',
    ///   '{"tenant":"acme","n":5}', 'msg-1'), 'hex')` logged in as `postgres` on
    /// PostgreSQL 15: `emitted_by` is the session user, not the role set.
    const FIXTURE_V2_JSON: &str = "020000008f7b226964223a20226d73672d31222c2022746f706963223a\
        20226f72646572732e63726561746564222c202268656164657273223a207b226e223a20352c20227465\
        6e616e74223a202261636d65227d2c2022656d69747465645f6279223a2022706f737467726573222c20\
        22636f6e74656e745f74797065223a20226170706c69636174696f6e2f6a736f6e227d7b2261223a2031\
        7d";

    /// Version 2: `select encode(outbox._envelope('t', '\x00ff00c3a9'::bytea,
    ///   'application/octet-stream', '{}', 'id-2'), 'hex')` logged in as role `plain`.
    const FIXTURE_V2_BYTES: &str = "020000006e7b226964223a202269642d32222c2022746f706963223a\
        202274222c202268656164657273223a207b7d2c2022656d69747465645f6279223a2022706c61696e22\
        2c2022636f6e74656e745f74797065223a20226170706c69636174696f6e2f6f637465742d7374726561\
        6d227d00ff00c3a9";

    #[test]
    fn decodes_sql_v2_fixtures_with_the_emitter() {
        let content = unhex(FIXTURE_V2_JSON);
        assert_eq!(content.first(), Some(&VERSION_2));
        let env = decode(content.clone()).unwrap();
        assert_eq!(
            env,
            Envelope {
                version: VERSION_2,
                emitted_by: Some("postgres".into()),
                emitted_by_unchecked: false,
                ..sample()
            }
        );
        assert_eq!(env.payload.as_ptr(), content[content.len() - 8..].as_ptr());
        let env = decode(unhex(FIXTURE_V2_BYTES)).unwrap();
        assert_eq!(env.emitted_by.as_deref(), Some("plain"));
        assert_eq!(env.message_id, "id-2");
        assert_eq!(env.content_type, "application/octet-stream");
        assert_eq!(env.payload.as_ref(), b"\x00\xff\x00\xc3\xa9");
        // Version 1 of the same message: no emitter.
        assert_eq!(decode(unhex(FIXTURE_BYTES)).unwrap().emitted_by, None);
    }

    /// Version 3, as the current `sql/outbox.sql` writes it, logged in as `postgres` on
    /// PostgreSQL 15: `select encode(outbox._envelope('orders.created',
    ///   convert_to('{"a": 1}', 'UTF8'), 'application/json', '{"tenant":"acme","n":5}',
    ///   'msg-1', exchange => 'orders', correlation_id => 'corr-1',
    ///   causation_id => 'cause-0', aggregate_type => 'order', aggregate_id => '42',
    ///   aggregate_version => 7, tenant => 'acme', expiration => 60000, priority => 5,
    ///   traceparent => '00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01',
    ///   tracestate => 'rojo=00f067aa0ba902b7,congo=t61rcWkgMzE',
    ///   idempotency_key => 'create-42'), 'hex')`: every metadata key.
    const FIXTURE_V3_FULL: &str = "03000002017b226964223a20226d73672d31222c2022746f706963223a\
        20226f72646572732e63726561746564222c202274656e616e74223a202261636d65222c202268656164\
        657273223a207b226e223a20352c202274656e616e74223a202261636d65227d2c202265786368616e67\
        65223a20226f7264657273222c20227072696f72697479223a20352c2022656d69747465645f6279223a\
        2022706f737467726573222c202274726163657374617465223a2022726f6a6f3d303066303637616130\
        626139303262372c636f6e676f3d7436317263576b674d7a45222c20227472616365706172656e74223a\
        202230302d3462663932663335373762333464613661336365393239643065306534373336\
        2d303066303637616130626139303262372d3031222c20226167677265676174655f6964223a20223432\
        222c2022636175736174696f6e5f6964223a202263617573652d30222c2022636f6e74656e745f747970\
        65223a20226170706c69636174696f6e2f6a736f6e222c202265787069726174696f6e5f6d73223a2036\
        303030302c20226167677265676174655f74797065223a20226f72646572222c2022636f7272656c6174\
        696f6e5f6964223a2022636f72722d31222c20226964656d706f74656e63795f6b6579223a2022637265\
        6174652d3432222c20226167677265676174655f76657273696f6e223a20377d7b2261223a20317d";

    /// Version 3 without metadata: `select encode(outbox._envelope('t',
    ///   '\x00ff00c3a9'::bytea, 'application/octet-stream', '{}', 'id-2'), 'hex')` as
    /// `postgres`.
    const FIXTURE_V3_BYTES: &str = "03000000717b226964223a202269642d32222c2022746f706963223a\
        202274222c202268656164657273223a207b7d2c2022656d69747465645f6279223a2022706f73746772\
        6573222c2022636f6e74656e745f74797065223a20226170706c69636174696f6e2f6f637465742d7374\
        7265616d227d00ff00c3a9";

    /// An unknown newer version: the full version-3 fixture with version byte 4.
    fn fixture_v4() -> Bytes {
        let mut v = unhex(FIXTURE_V3_FULL).to_vec();
        v[0] = 4;
        v.into()
    }

    fn full_meta() -> Metadata {
        Metadata {
            correlation_id: Some("corr-1".into()),
            causation_id: Some("cause-0".into()),
            aggregate_type: Some("order".into()),
            aggregate_id: Some("42".into()),
            aggregate_version: Some(7),
            tenant: Some("acme".into()),
            expiration_ms: Some(60_000),
            priority: Some(5),
            traceparent: Some("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01".into()),
            tracestate: Some("rojo=00f067aa0ba902b7,congo=t61rcWkgMzE".into()),
            idempotency_key: Some("create-42".into()),
        }
    }

    #[test]
    fn metadata_as_json_has_only_the_fields_set_under_the_envelope_keys() {
        assert!(Metadata::default().to_json().is_empty());
        let json = Value::Object(full_meta().to_json());
        assert_eq!(
            json,
            serde_json::json!({
                "correlation_id": "corr-1",
                "causation_id": "cause-0",
                "aggregate_type": "order",
                "aggregate_id": "42",
                "aggregate_version": 7,
                "tenant": "acme",
                "expiration_ms": 60000,
                "priority": 5,
                "traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
                "tracestate": "rojo=00f067aa0ba902b7,congo=t61rcWkgMzE",
                "idempotency_key": "create-42"
            })
        );
        let only = Metadata {
            priority: Some(0),
            ..Metadata::default()
        };
        assert_eq!(
            Value::Object(only.to_json()),
            serde_json::json!({"priority": 0})
        );
    }

    fn v3_sample() -> Envelope {
        Envelope {
            version: VERSION_3,
            emitted_by: Some("postgres".into()),
            emitted_by_unchecked: false,
            exchange: Some("orders".into()),
            meta: full_meta(),
            ..sample()
        }
    }

    #[test]
    fn decodes_sql_v3_fixtures_with_every_metadata_key() {
        let content = unhex(FIXTURE_V3_FULL);
        assert_eq!(content.first(), Some(&VERSION_3));
        let env = decode(content.clone()).unwrap();
        assert_eq!(env, v3_sample());
        assert_eq!(env.payload.as_ptr(), content[content.len() - 8..].as_ptr());
        let env = decode(unhex(FIXTURE_V3_BYTES)).unwrap();
        assert_eq!(env.version, VERSION_3);
        assert_eq!(env.emitted_by.as_deref(), Some("postgres"));
        assert_eq!(env.exchange, None);
        assert!(env.meta.is_empty());
        assert_eq!(env.payload.as_ref(), b"\x00\xff\x00\xc3\xa9");
        // encode writes the same header value (key order aside) and round-trips.
        let ours = encode(&v3_sample());
        let header = |b: &[u8]| -> Value {
            let n = u32::from_be_bytes(b[1..5].try_into().unwrap()) as usize;
            serde_json::from_slice(&b[5..5 + n]).unwrap()
        };
        assert_eq!(ours[0], VERSION_3);
        assert_eq!(header(&ours), header(&content));
        assert_eq!(decode(Bytes::from(ours)).unwrap(), v3_sample());
    }

    #[test]
    fn one_fixture_per_version_and_an_unknown_newer_one() {
        for (fixture, version) in [
            (FIXTURE_BYTES, VERSION_1),
            (FIXTURE_V2_BYTES, VERSION_2),
            (FIXTURE_V3_BYTES, VERSION_3),
        ] {
            let env = decode(unhex(fixture)).unwrap();
            assert_eq!(env.version, version);
            assert_eq!(env.message_id, "id-2");
            assert_eq!(env.payload.as_ref(), b"\x00\xff\x00\xc3\xa9");
        }
        let err = decode(fixture_v4()).unwrap_err();
        assert!(
            matches!(err, EnvelopeError::UnsupportedVersion { version: 4 }),
            "{err:?}"
        );
        assert!(err.to_string().contains("newer pgoutbox"), "{err}");
        for version in 4..=MAX_FUTURE_VERSION {
            let mut v = unhex(FIXTURE_V3_BYTES).to_vec();
            v[0] = version;
            assert!(matches!(
                decode(Bytes::from(v)),
                Err(EnvelopeError::UnsupportedVersion { version: found }) if found == version
            ));
        }
        // Version-3 keys under version byte 2 or 1 are unknown keys there: ignored.
        let mut v2 = unhex(FIXTURE_V3_FULL).to_vec();
        v2[0] = VERSION_2;
        let env = decode(Bytes::from(v2.clone())).unwrap();
        assert_eq!(
            (env.version, env.exchange, env.meta),
            (2, None, Metadata::default())
        );
        assert_eq!(env.emitted_by.as_deref(), Some("postgres"));
        v2[0] = VERSION_1;
        let env = decode(Bytes::from(v2)).unwrap();
        assert_eq!((env.version, env.emitted_by), (1, None));
    }

    #[test]
    fn v3_fixture_truncations_and_mutations() {
        let full = unhex(FIXTURE_V3_FULL);
        let header_end = 5 + u32::from_be_bytes(full[1..5].try_into().unwrap()) as usize;
        for n in 0..header_end {
            assert!(decode(full.slice(..n)).is_err(), "{n}-byte prefix decoded");
        }
        for i in 0..full.len() {
            for b in [0u8, 1, 3, 4, b'"', b'{', b'-', b'9', 0xff] {
                let mut v = full.to_vec();
                v[i] = b;
                let _ = decode(Bytes::from(v));
            }
        }
    }

    fn v3_header(extra: &str) -> Result<Envelope, EnvelopeError> {
        let header =
            format!(r#"{{"id":"i","topic":"t","content_type":"c","headers":{{}}{extra}}}"#);
        let mut v = with_header(&header, b"p").to_vec();
        v[0] = VERSION_3;
        decode(Bytes::from(v))
    }

    #[test]
    fn v3_key_types() {
        for key in [
            "exchange",
            "correlation_id",
            "causation_id",
            "aggregate_type",
            "aggregate_id",
            "tenant",
            "traceparent",
            "tracestate",
            "idempotency_key",
        ] {
            for bad in ["null", "1", "[]"] {
                let err = v3_header(&format!(r#","{key}":{bad}"#)).unwrap_err();
                assert!(
                    matches!(err, EnvelopeError::FieldNotString { field, .. } if field == key),
                    "{key}={bad}: {err:?}"
                );
            }
        }
        for key in ["aggregate_version", "expiration_ms", "priority"] {
            for bad in ["null", "\"1\"", "1.5", "18446744073709551616"] {
                let err = v3_header(&format!(r#","{key}":{bad}"#)).unwrap_err();
                assert!(
                    matches!(err, EnvelopeError::FieldNotInteger { field, .. } if field == key),
                    "{key}={bad}: {err:?}"
                );
            }
        }
        let env = v3_header(r#","aggregate_version":0,"expiration_ms":0,"priority":0"#).unwrap();
        assert_eq!(env.meta.aggregate_version, Some(0));
        assert_eq!(env.meta.expiration_ms, Some(0));
        assert_eq!(env.meta.priority, Some(0));
        let env = v3_header(r#","expiration_ms":4294967295,"priority":9"#).unwrap();
        assert_eq!(env.meta.expiration_ms, Some(MAX_EXPIRATION_MS));
        for (extra, field) in [
            (r#","aggregate_version":-1"#, "aggregate_version"),
            (r#","expiration_ms":-1"#, "expiration_ms"),
            (r#","expiration_ms":4294967296"#, "expiration_ms"),
            (r#","priority":10"#, "priority"),
            (r#","priority":-1"#, "priority"),
            (r#","priority":256"#, "priority"),
        ] {
            let err = v3_header(extra).unwrap_err();
            assert!(
                matches!(err, EnvelopeError::OutOfRange { field: f, .. } if f == field),
                "{extra}: {err:?}"
            );
        }
    }

    #[test]
    fn v3_metadata_rules_match_the_sql() {
        let meta_error = |f: &dyn Fn(&mut Envelope)| {
            let mut env = v3_sample();
            f(&mut env);
            let direct = env.validate().unwrap_err().to_string();
            let decoded = decode(Bytes::from(encode(&env))).unwrap_err();
            assert_eq!(direct, decoded.to_string());
            decoded
        };
        type Setter = fn(&mut Envelope, Option<String>);
        let texts: [(&str, Setter); 7] = [
            ("exchange", |e, v| e.exchange = v),
            ("correlation_id", |e, v| e.meta.correlation_id = v),
            ("causation_id", |e, v| e.meta.causation_id = v),
            ("aggregate_type", |e, v| e.meta.aggregate_type = v),
            ("aggregate_id", |e, v| e.meta.aggregate_id = v),
            ("tenant", |e, v| e.meta.tenant = v),
            ("idempotency_key", |e, v| e.meta.idempotency_key = v),
        ];
        for (field, set) in texts {
            assert!(matches!(
                meta_error(&|e| set(e, Some(String::new()))),
                EnvelopeError::EmptyField { field: f } if f == field
            ));
            assert!(matches!(
                meta_error(&|e| set(e, Some("é".repeat(128)))),
                EnvelopeError::FieldTooLong { field: f, len: 256 } if f == field
            ));
            let mut env = v3_sample();
            set(&mut env, Some("k".repeat(255)));
            assert_eq!(decode(Bytes::from(encode(&env))).unwrap(), env);
        }
        assert!(matches!(
            meta_error(&|e| e.meta.priority = Some(10)),
            EnvelopeError::OutOfRange {
                field: "priority",
                ..
            }
        ));
        assert!(matches!(
            meta_error(&|e| e.meta.expiration_ms = Some(MAX_EXPIRATION_MS + 1)),
            EnvelopeError::OutOfRange {
                field: "expiration_ms",
                ..
            }
        ));
        assert!(matches!(
            meta_error(&|e| e.meta.aggregate_version = Some(-1)),
            EnvelopeError::OutOfRange {
                field: "aggregate_version",
                ..
            }
        ));
        assert!(matches!(
            meta_error(&|e| e.meta.traceparent = Some("00-zz".into())),
            EnvelopeError::InvalidTraceparent { .. }
        ));
        assert!(matches!(
            meta_error(&|e| e.meta.tracestate = Some("A=b".into())),
            EnvelopeError::InvalidTracestate { .. }
        ));
        assert!(matches!(
            meta_error(&|e| e.meta.traceparent = None),
            EnvelopeError::InvalidTracestate { .. }
        ));
    }

    #[test]
    fn traceparent_by_w3c_section_3_2() {
        let ok = [
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00",
            // A higher version: parsed as 00, more fields after a dash.
            "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "cc-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-what-the-future-holds",
        ];
        for tp in ok {
            assert_eq!(check_traceparent(tp), Ok(()), "{tp}");
        }
        let bad = [
            "",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-0",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01x",
            "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            "0x-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00_4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e473g-00f067aa0ba902b7-01",
            "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01x",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-0é",
        ];
        for tp in bad {
            assert!(check_traceparent(tp).is_err(), "{tp}");
        }
        let long = format!(
            "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-{}",
            "a".repeat(200)
        );
        assert!(check_traceparent(&long).is_err());
    }

    #[test]
    fn tracestate_by_w3c_section_3_3_loosely() {
        let ok = [
            "rojo=00f067aa0ba902b7",
            "rojo=00f067aa0ba902b7,congo=t61rcWkgMzE",
            " rojo=1 ,\tcongo=2 , ,",
            "tenant1@vendor=x",
            "a_b-c*d/e=v v",
            "",
        ];
        for ts in ok {
            assert_eq!(check_tracestate(ts), Ok(()), "{ts:?}");
        }
        let bad = [
            "Rojo=1", "rojo", "rojo=", "rojo=a,b", "_x=1", "a@b@c=1", "a=b=c", "a=é", "a=\u{7f}",
        ];
        for ts in bad {
            assert!(check_tracestate(ts).is_err(), "{ts:?}");
        }
        let members = (0..33).map(|i| format!("k{i}=v")).collect::<Vec<_>>();
        assert!(check_tracestate(&members[..32].join(",")).is_ok());
        assert!(check_tracestate(&members.join(",")).is_err());
        assert!(check_tracestate(&format!("a={}", "b".repeat(511))).is_err());
    }

    #[test]
    fn v2_fixture_truncations_and_mutations() {
        let full = unhex(FIXTURE_V2_BYTES);
        let header_end = 5 + u32::from_be_bytes(full[1..5].try_into().unwrap()) as usize;
        for n in 0..header_end {
            assert!(decode(full.slice(..n)).is_err(), "{n}-byte prefix decoded");
        }
        for i in 0..full.len() {
            for b in [0u8, 1, 2, b'"', b'{', 0xff] {
                let mut v = full.to_vec();
                v[i] = b;
                let _ = decode(Bytes::from(v));
            }
        }
        // The same bytes under version byte 1: the emitter is an unknown key, ignored.
        let mut v1 = full.to_vec();
        v1[0] = VERSION_1;
        let env = decode(Bytes::from(v1)).unwrap();
        assert_eq!(env.emitted_by, None);
        assert_eq!(env.message_id, "id-2");
    }

    #[test]
    fn v2_emitter_rules() {
        let v2 = |header: &str| {
            let mut v = with_header(header, b"p").to_vec();
            v[0] = VERSION_2;
            decode(Bytes::from(v))
        };
        // Without the field: decodes, no emitter (under lockdown: forged).
        assert_eq!(v2(OK).unwrap().emitted_by, None);
        let with = |who: &str| {
            format!(
                r#"{{"id":"i","topic":"t","content_type":"c","headers":{{}},"emitted_by":{who}}}"#
            )
        };
        assert_eq!(
            v2(&with("\"app\"")).unwrap().emitted_by.as_deref(),
            Some("app")
        );
        assert!(matches!(
            v2(&with("null")),
            Err(EnvelopeError::FieldNotString {
                field: "emitted_by",
                found: "null"
            })
        ));
        assert!(matches!(
            v2(&with("\"\"")),
            Err(EnvelopeError::EmptyField {
                field: "emitted_by"
            })
        ));
        assert!(matches!(
            v2(&with(&format!("\"{}\"", "r".repeat(256)))),
            Err(EnvelopeError::FieldTooLong {
                field: "emitted_by",
                len: 256
            })
        ));
        // encode writes the envelope's version, with the emitter from version 2 on, and
        // round-trips.
        let env = Envelope {
            version: VERSION_2,
            emitted_by: Some("app_writer".into()),
            emitted_by_unchecked: false,
            ..sample()
        };
        let bytes = encode(&env);
        assert_eq!(bytes[0], VERSION_2);
        assert_eq!(decode(Bytes::from(bytes)).unwrap(), env);
        assert_eq!(encode(&sample())[0], VERSION_1);
        let v1 = Envelope {
            version: VERSION_1,
            ..env
        };
        assert_eq!(decode(Bytes::from(encode(&v1))).unwrap().emitted_by, None);
    }

    #[test]
    fn decodes_sql_json_fixture() {
        let content = unhex(FIXTURE_JSON);
        let env = decode(content.clone()).unwrap();
        assert_eq!(env, sample());
        // Zero-copy payload.
        assert_eq!(env.payload.as_ptr(), content[content.len() - 8..].as_ptr());
    }

    #[test]
    fn decodes_sql_bytes_fixture_with_nuls() {
        let env = decode(unhex(FIXTURE_BYTES)).unwrap();
        assert_eq!(env.message_id, "id-2");
        assert_eq!(env.topic, "t");
        assert_eq!(env.content_type, "application/octet-stream");
        assert!(env.headers.is_empty());
        assert_eq!(env.payload.as_ref(), b"\x00\xff\x00\xc3\xa9");
    }

    #[test]
    fn decodes_sql_utf8_fixture() {
        let env = decode(unhex(FIXTURE_UTF8)).unwrap();
        assert_eq!(env.message_id, "ü-3");
        assert_eq!(env.topic, "café.über");
        assert_eq!(env.headers.get("ключ"), Some(&json!("знач")));
        assert_eq!(
            env.payload.as_ref(),
            "{\"z\": null, \"name\": \"José 🎉\"}".as_bytes()
        );
    }

    #[test]
    fn encode_matches_sql_up_to_key_order() {
        let ours = encode(&sample());
        let theirs = unhex(FIXTURE_JSON);
        // Same framing, same payload, same header value.
        assert_eq!(ours.first(), Some(&VERSION_1));
        let header = |b: &[u8]| -> Value {
            let n = u32::from_be_bytes(b[1..5].try_into().unwrap()) as usize;
            serde_json::from_slice(&b[5..5 + n]).unwrap()
        };
        assert_eq!(header(&ours), header(&theirs));
        assert!(ours.ends_with(b"{\"a\": 1}"));
        assert_eq!(decode(Bytes::from(ours)).unwrap(), sample());
    }

    #[test]
    fn round_trips_odd_payloads() {
        for payload in [&b""[..], b"\0", b"\0\0\x01\xff", "ü🎉".as_bytes()] {
            let env = Envelope {
                payload: Bytes::copy_from_slice(payload),
                ..sample()
            };
            assert_eq!(decode(Bytes::from(encode(&env))).unwrap(), env);
        }
    }

    #[test]
    fn every_truncation_is_an_error() {
        for fixture in [FIXTURE_JSON, FIXTURE_BYTES, FIXTURE_UTF8] {
            let full = unhex(fixture);
            let header_end = 5 + u32::from_be_bytes(full[1..5].try_into().unwrap()) as usize;
            for n in 0..header_end {
                let r = decode(full.slice(..n));
                assert!(r.is_err(), "{n}-byte prefix decoded: {r:?}");
            }
            // Cutting into the payload still decodes, with a shorter payload.
            for n in header_end..=full.len() {
                assert_eq!(
                    decode(full.slice(..n)).unwrap().payload,
                    full.slice(header_end..n)
                );
            }
        }
    }

    #[test]
    fn hand_written_text_is_not_blamed_on_an_old_pgoutbox() {
        let err = decode(Bytes::from_static(b"hello")).unwrap_err();
        assert_eq!(
            err.to_string(),
            "not a pgoutbox envelope: the content starts with byte 0x68 ('h'), where an envelope \
             starts with its version (1 to 3); emit outbox messages with outbox.emit or \
             outbox.emit_bytes (or the emit functions of the outbox's own --schema), not \
             pg_logical_emit_message directly"
        );
        for content in [&b"{\"a\": 1}"[..], b"\x00\x00", b" x", b"\xff"] {
            let err = decode(Bytes::copy_from_slice(content)).unwrap_err();
            assert!(!err.to_string().contains("newer"), "{content:?}: {err}");
            assert!(
                err.to_string().contains("outbox.emit"),
                "{content:?}: {err}"
            );
        }
        let err = decode(Bytes::from_static(b"\x1f\0\0\0\0")).unwrap_err();
        assert!(err.to_string().contains("newer pgoutbox"), "{err}");
    }

    #[test]
    fn framing_errors() {
        assert!(matches!(decode(Bytes::new()), Err(EnvelopeError::Empty)));
        let err = decode(Bytes::from_static(b"\x04\0\0\0\0")).unwrap_err();
        assert!(matches!(
            err,
            EnvelopeError::UnsupportedVersion { version: 4 }
        ));
        assert!(err.to_string().contains("newer pgoutbox"), "{err}");
        assert!(matches!(
            decode(Bytes::from_static(b"\x00")),
            Err(EnvelopeError::NotAnEnvelope { first_byte: 0 })
        ));
        assert!(matches!(
            decode(Bytes::from_static(b"\x01\0\0")),
            Err(EnvelopeError::TruncatedHeaderLength { available: 2 })
        ));
        assert!(matches!(
            decode(Bytes::from_static(b"\x01\xff\xff\xff\xff{}")),
            Err(EnvelopeError::TruncatedHeader {
                declared: u32::MAX,
                available: 2
            })
        ));
        assert!(matches!(
            decode(Bytes::from_static(b"\x01\0\0\0\x03{}")),
            Err(EnvelopeError::TruncatedHeader {
                declared: 3,
                available: 2
            })
        ));
        // Zero-length header: not JSON.
        assert!(matches!(
            decode(Bytes::from_static(b"\x01\0\0\0\0")),
            Err(EnvelopeError::HeaderNotJson(_))
        ));
    }

    fn with_header(header: &str, payload: &[u8]) -> Bytes {
        let mut v = vec![VERSION_1];
        v.extend_from_slice(&u32::try_from(header.len()).unwrap().to_be_bytes());
        v.extend_from_slice(header.as_bytes());
        v.extend_from_slice(payload);
        v.into()
    }

    fn header_error(header: &str) -> EnvelopeError {
        decode(with_header(header, b"p")).unwrap_err()
    }

    const OK: &str = r#"{"id":"i","topic":"t","content_type":"c","headers":{}}"#;

    #[test]
    fn header_shape_errors() {
        assert!(decode(with_header(OK, b"p")).is_ok());
        assert!(matches!(header_error("{"), EnvelopeError::HeaderNotJson(_)));
        assert!(matches!(
            header_error("{\"id\":\"\u{0}\"}x"),
            EnvelopeError::HeaderNotJson(_)
        ));
        assert!(matches!(
            decode({
                let mut v = with_header(OK, b"").to_vec();
                v[10] = 0xff; // invalid UTF-8 inside the header
                v.into()
            }),
            Err(EnvelopeError::HeaderNotJson(_))
        ));
        assert!(matches!(
            header_error("[1]"),
            EnvelopeError::HeaderNotObject { found: "array" }
        ));
        assert!(matches!(
            header_error("null"),
            EnvelopeError::HeaderNotObject { found: "null" }
        ));
        assert!(matches!(
            header_error(r#"{"topic":"t","content_type":"c","headers":{}}"#),
            EnvelopeError::MissingField { field: "id" }
        ));
        assert!(matches!(
            header_error(r#"{"id":"i","content_type":"c","headers":{}}"#),
            EnvelopeError::MissingField { field: "topic" }
        ));
        assert!(matches!(
            header_error(r#"{"id":"i","topic":"t","headers":{}}"#),
            EnvelopeError::MissingField {
                field: "content_type"
            }
        ));
        assert!(matches!(
            header_error(r#"{"id":"i","topic":"t","content_type":"c"}"#),
            EnvelopeError::MissingField { field: "headers" }
        ));
        assert!(matches!(
            header_error(r#"{"id":7,"topic":"t","content_type":"c","headers":{}}"#),
            EnvelopeError::FieldNotString {
                field: "id",
                found: "number"
            }
        ));
        assert!(matches!(
            header_error(r#"{"id":"i","topic":null,"content_type":"c","headers":{}}"#),
            EnvelopeError::FieldNotString {
                field: "topic",
                found: "null"
            }
        ));
        assert!(matches!(
            header_error(r#"{"id":"i","topic":"t","content_type":["c"],"headers":{}}"#),
            EnvelopeError::FieldNotString {
                field: "content_type",
                found: "array"
            }
        ));
        assert!(matches!(
            header_error(r#"{"id":"i","topic":"t","content_type":"c","headers":[]}"#),
            EnvelopeError::HeadersNotObject { found: "array" }
        ));
        // Unknown header fields are ignored; key order does not matter.
        let env = decode(with_header(
            r#"{"headers":{"k":[1,{"a":null}]},"extra":1,"content_type":"c","topic":"t","id":"i"}"#,
            b"",
        ))
        .unwrap();
        assert_eq!(env.headers.get("k"), Some(&json!([1, {"a": null}])));
        // Deep nesting is an error, not a stack overflow.
        let deep = format!(
            r#"{{"id":"i","topic":"t","content_type":"c","headers":{{"k":{}{}}}}}"#,
            "[".repeat(100_000),
            "]".repeat(100_000)
        );
        assert!(matches!(
            header_error(&deep),
            EnvelopeError::HeaderNotJson(_)
        ));
    }

    fn rule_error(f: impl FnOnce(&mut Envelope)) -> EnvelopeError {
        let mut env = sample();
        f(&mut env);
        // The same error from validate() and from decoding the encoded bytes.
        let direct = env.validate().unwrap_err().to_string();
        let decoded = decode(Bytes::from(encode(&env))).unwrap_err();
        assert_eq!(direct, decoded.to_string());
        decoded
    }

    #[test]
    fn field_rules() {
        assert!(matches!(
            rule_error(|e| e.topic.clear()),
            EnvelopeError::EmptyField { field: "topic" }
        ));
        assert!(matches!(
            rule_error(|e| e.message_id.clear()),
            EnvelopeError::EmptyField { field: "id" }
        ));
        assert!(matches!(
            rule_error(|e| e.topic = "t".repeat(256)),
            EnvelopeError::FieldTooLong {
                field: "topic",
                len: 256
            }
        ));
        // Bytes, not characters: 128 two-byte characters are 256 bytes.
        assert!(matches!(
            rule_error(|e| e.topic = "é".repeat(128)),
            EnvelopeError::FieldTooLong {
                field: "topic",
                len: 256
            }
        ));
        assert!(matches!(
            rule_error(|e| e.message_id = "i".repeat(256)),
            EnvelopeError::FieldTooLong { field: "id", .. }
        ));
        assert!(matches!(
            rule_error(|e| e.content_type = "c".repeat(256)),
            EnvelopeError::FieldTooLong {
                field: "content_type",
                ..
            }
        ));
        // At the limit: fine.
        let mut env = sample();
        env.topic = "t".repeat(255);
        env.message_id = "i".repeat(255);
        env.content_type = "c".repeat(255);
        env.headers.insert("k".repeat(255), json!(1));
        assert_eq!(decode(Bytes::from(encode(&env))).unwrap(), env);
    }

    #[test]
    fn header_key_rules() {
        let key_error = |k: &str| {
            let k = k.to_owned();
            rule_error(move |e| {
                e.headers.insert(k, json!("v"));
            })
        };
        let long = key_error(&"k".repeat(256));
        assert!(matches!(
            long,
            EnvelopeError::HeaderKeyTooLong { len: 256, .. }
        ));
        assert!(long.to_string().contains(&"k".repeat(40)));
        for k in ["x-pgoutbox-attempt", "X-PGOUTBOX-", "X-PgOutbox-Id"] {
            assert!(
                matches!(key_error(k), EnvelopeError::ReservedHeaderKey { ref key } if key == k),
                "{k}"
            );
        }
        for k in ["cc", "CC", "Cc", "bcc", "BCC", "bCc"] {
            assert!(
                matches!(key_error(k), EnvelopeError::ForbiddenHeaderKey { ref key } if key == k),
                "{k}"
            );
        }
        // Near misses are allowed, as in the SQL.
        let mut env = sample();
        for k in [
            "ccc",
            "x-pgoutbox",
            "x-pgoutbo-x",
            "c",
            "cc ",
            "x-other",
            "ü",
        ] {
            env.headers.insert(k.into(), json!(null));
        }
        assert!(env.validate().is_ok());
        assert_eq!(decode(Bytes::from(encode(&env))).unwrap(), env);
    }

    #[test]
    fn mutated_fixtures_never_panic() {
        let full = unhex(FIXTURE_UTF8).to_vec();
        for i in 0..full.len() {
            for b in [0u8, 1, b'"', b'{', 0x7f, 0xc3, 0xff] {
                let mut v = full.clone();
                v[i] = b;
                let _ = decode(Bytes::from(v));
            }
        }
    }
}
