//! The pgoutbox envelope: the versioned byte format of an outbox message.
//!
//! `outbox.emit` / `outbox.emit_bytes` (see `sql/outbox.sql`) write one envelope as the
//! content of a transactional logical decoding message with prefix [`PREFIX`]. Versions 1
//! and 2 (see `docs/envelope.md`) share one layout:
//!
//! | bytes        | content                                                              |
//! |--------------|----------------------------------------------------------------------|
//! | 0            | version, [`VERSION_1`] (`0x01`) or [`VERSION_2`] (`0x02`)            |
//! | 1..5         | N, header length in bytes, u32 big-endian                            |
//! | 5..5+N       | header: UTF-8 JSON object `{"id", "topic", "content_type", "headers"}`, and in version 2 also `"emitted_by"` |
//! | 5+N..        | payload, raw bytes                                                   |
//!
//! Version 2 (written by the current `sql/outbox.sql`) adds `emitted_by`: the
//! `session_user` that called the helper (not `current_user`, which inside the
//! `SECURITY DEFINER` helpers of `setup --lockdown` is their owner). Version 1 is still
//! read; its messages have no emitter ([`Envelope::emitted_by`] is `None`, and an
//! `emitted_by` key in a version-1 header is ignored, as any unknown key is).
//!
//! [`decode`] enforces the same rules the SQL enforces at emit time (see
//! [`Envelope::validate`]), so a message that slipped past them (an older or hand-written
//! producer) is rejected with a clear error instead of being published. Decoding never
//! panics on input; the payload is a zero-copy [`Bytes`] slice of the input.

use bytes::Bytes;
use serde_json::{Map, Value};

/// The logical decoding message prefix pgoutbox envelopes are emitted with.
pub const PREFIX: &str = "pgoutbox";

/// The version byte of envelope format version 1 (no emitter).
pub const VERSION_1: u8 = 1;

/// The version byte of envelope format version 2: version 1 plus the header field
/// `emitted_by` (the emitting `session_user`). What `outbox.emit` writes today.
pub const VERSION_2: u8 = 2;

/// The newest envelope version this pgoutbox reads (and the one the SQL helpers write).
pub const CURRENT_VERSION: u8 = VERSION_2;

/// The maximum length in bytes of the topic, message id, content type and each header key:
/// they become AMQP short strings (routing key, message-id, content-type, field-table key).
pub const MAX_SHORT_STR: usize = 255;

/// The highest first byte read as a (future) envelope version. Versions grow by one per
/// format change, so anything above this, in particular any printable ASCII character
/// (0x20 and up), is not a version but content that is no envelope.
pub const MAX_FUTURE_VERSION: u8 = 0x1f;

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

/// Header keys starting with this (ASCII case-insensitively) are reserved for pgoutbox.
const RESERVED_HEADER_PREFIX: &str = "x-pgoutbox-";

/// One decoded outbox message.
#[derive(Debug, Clone, PartialEq)]
pub struct Envelope {
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
    /// version-1 envelope, or a version-2 one without the field (which the helpers never
    /// write; under `setup --lockdown` such a message is dead-lettered as `forged`).
    pub emitted_by: Option<String>,
    /// The exchange the producer named (header field `exchange`, written by
    /// `outbox.emit(..., exchange => ...)` only when given). `None`: the streamer's
    /// `--exchange`. Its name rules (1 to 255 bytes, `--allowed-exchanges`) are checked by
    /// the streamer's routing ([`crate::routing`]), not here.
    pub exchange: Option<String>,
}

/// Why envelope bytes could not be decoded, or an [`Envelope`] breaks the rules.
#[derive(Debug, thiserror::Error)]
pub enum EnvelopeError {
    /// The content had no bytes at all.
    #[error("empty envelope: expected at least a version byte at offset 0")]
    Empty,
    /// The version byte is newer than this pgoutbox understands (3 to
    /// [`MAX_FUTURE_VERSION`]): the envelope was written by a newer `sql/outbox.sql`.
    #[error(
        "unsupported envelope version {version} at offset 0: this pgoutbox understands versions 1 \
         and 2 only; the envelope was written by a newer outbox.emit, so a newer pgoutbox may be \
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
         envelope starts with its version (1 or 2); emit outbox messages with outbox.emit or \
         outbox.emit_bytes, not pg_logical_emit_message with prefix 'pgoutbox' directly",
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
    /// The header field `headers` is not an object.
    #[error("envelope header field \"headers\" is a JSON {found}, expected an object")]
    HeadersNotObject {
        /// The JSON type found.
        found: &'static str,
    },
    /// `topic` or `id` is empty.
    #[error("envelope {field} is empty")]
    EmptyField {
        /// Which field: `"topic"`, `"id"` or `"content_type"`.
        field: &'static str,
    },
    /// `topic`, `id` or `content_type` is longer than 255 bytes.
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
/// Accepts envelope versions 1 and 2 (layout in the module docs and `docs/envelope.md`).
/// Header keys other than `id`, `topic`, `content_type`, `headers` and (version 2 only)
/// `emitted_by` are ignored, and JSON key order does not matter. A version-2 header without
/// `emitted_by` decodes with [`Envelope::emitted_by`] `None`; one whose `emitted_by` is not a
/// string of 1 to 255 bytes is an error. The payload is a zero-copy slice of `content`.
///
/// # Errors
/// [`EnvelopeError::Empty`], [`EnvelopeError::UnsupportedVersion`],
/// [`EnvelopeError::NotAnEnvelope`],
/// [`EnvelopeError::TruncatedHeaderLength`] or [`EnvelopeError::TruncatedHeader`] for bad
/// framing; [`EnvelopeError::HeaderNotJson`], [`EnvelopeError::HeaderNotObject`],
/// [`EnvelopeError::MissingField`], [`EnvelopeError::FieldNotString`] or
/// [`EnvelopeError::HeadersNotObject`] for a bad header; and any error of
/// [`Envelope::validate`].
pub fn decode(content: Bytes) -> Result<Envelope, EnvelopeError> {
    let Some(&version) = content.first() else {
        return Err(EnvelopeError::Empty);
    };
    if version != VERSION_1 && version != VERSION_2 {
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
    let message_id = take_string(&mut header, "id")?;
    let topic = take_string(&mut header, "topic")?;
    let content_type = take_string(&mut header, "content_type")?;
    let headers = match header.remove("headers") {
        None => return Err(EnvelopeError::MissingField { field: "headers" }),
        Some(Value::Object(m)) => m,
        Some(other) => {
            return Err(EnvelopeError::HeadersNotObject {
                found: json_type(&other),
            })
        }
    };

    let emitted_by = if version == VERSION_2 {
        match header.remove("emitted_by") {
            None => None,
            Some(Value::String(s)) => Some(s),
            Some(other) => {
                return Err(EnvelopeError::FieldNotString {
                    field: "emitted_by",
                    found: json_type(&other),
                })
            }
        }
    } else {
        None
    };
    let exchange = match header.remove("exchange") {
        None => None,
        Some(Value::String(s)) => Some(s),
        Some(other) => {
            return Err(EnvelopeError::FieldNotString {
                field: "exchange",
                found: json_type(&other),
            })
        }
    };
    let env = Envelope {
        message_id,
        topic,
        content_type,
        headers,
        payload: content.slice(header_end..),
        emitted_by,
        exchange,
    };
    env.validate()?;
    Ok(env)
}

/// Encodes `env`: as version 2 when it has an emitter ([`Envelope::emitted_by`]), else as
/// version 1. Version 2 is exactly the bytes `outbox._envelope` in `sql/outbox.sql` produces
/// for the same fields, except that the JSON header may use a different key order and
/// whitespace (decoders must not care).
///
/// Does not validate; call [`Envelope::validate`] first if `env` is not known to be valid.
///
/// # Panics
/// If the JSON header is longer than `u32::MAX` bytes (4 GiB), which the u32 length field
/// cannot express.
#[must_use]
pub fn encode(env: &Envelope) -> Vec<u8> {
    let mut header = serde_json::json!({
        "id": env.message_id,
        "topic": env.topic,
        "content_type": env.content_type,
        "headers": env.headers,
    });
    let version = match &env.emitted_by {
        Some(who) => {
            header["emitted_by"] = Value::String(who.clone());
            VERSION_2
        }
        None => VERSION_1,
    };
    if let Some(exchange) = &env.exchange {
        header["exchange"] = Value::String(exchange.clone());
    }
    let header = header.to_string();
    let header_len = u32::try_from(header.len())
        .expect("envelope JSON header longer than 4 GiB cannot be encoded");
    let mut out = Vec::with_capacity(FIXED_LEN + header.len() + env.payload.len());
    out.push(version);
    out.extend_from_slice(&header_len.to_be_bytes());
    out.extend_from_slice(header.as_bytes());
    out.extend_from_slice(&env.payload);
    out
}

impl Envelope {
    /// Checks the rules `outbox.emit` enforces: `topic` and `message_id` 1 to 255 bytes,
    /// `content_type` at most 255 bytes, every header key at most 255 bytes, not starting
    /// with `x-pgoutbox-` and not `CC`/`BCC` (both ASCII case-insensitive).
    ///
    /// # Errors
    /// [`EnvelopeError::EmptyField`], [`EnvelopeError::FieldTooLong`],
    /// [`EnvelopeError::HeaderKeyTooLong`], [`EnvelopeError::ReservedHeaderKey`] or
    /// [`EnvelopeError::ForbiddenHeaderKey`] for the first rule broken. An emitter, when
    /// present, must be 1 to 255 bytes ([`EnvelopeError::EmptyField`] or
    /// [`EnvelopeError::FieldTooLong`] with field `emitted_by`).
    pub fn validate(&self) -> Result<(), EnvelopeError> {
        short_str("topic", &self.topic, false)?;
        short_str("id", &self.message_id, false)?;
        short_str("content_type", &self.content_type, true)?;
        if let Some(who) = &self.emitted_by {
            short_str("emitted_by", who, false)?;
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
            if key.eq_ignore_ascii_case("cc") || key.eq_ignore_ascii_case("bcc") {
                return Err(EnvelopeError::ForbiddenHeaderKey { key: key.clone() });
            }
        }
        Ok(())
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
            message_id: "msg-1".into(),
            topic: "orders.created".into(),
            content_type: "application/json".into(),
            headers,
            payload: Bytes::from_static(b"{\"a\": 1}"),
            emitted_by: None,
            exchange: None,
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
                emitted_by: Some("postgres".into()),
                exchange: None,
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
        // encode writes version 2 exactly when there is an emitter, and round-trips.
        let env = Envelope {
            emitted_by: Some("app_writer".into()),
            ..sample()
        };
        let bytes = encode(&env);
        assert_eq!(bytes[0], VERSION_2);
        assert_eq!(decode(Bytes::from(bytes)).unwrap(), env);
        assert_eq!(encode(&sample())[0], VERSION_1);
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
    fn a_named_exchange_round_trips_and_must_be_a_string() {
        let env = Envelope {
            emitted_by: Some("app".into()),
            exchange: Some("billing".into()),
            ..sample()
        };
        assert_eq!(decode(Bytes::from(encode(&env))).unwrap(), env);
        let header = br#"{"id":"i","topic":"t","content_type":"c","headers":{},"exchange":7}"#;
        let mut bytes = vec![VERSION_2];
        bytes.extend_from_slice(&(header.len() as u32).to_be_bytes());
        bytes.extend_from_slice(header);
        assert!(matches!(
            decode(Bytes::from(bytes)),
            Err(EnvelopeError::FieldNotString {
                field: "exchange",
                ..
            })
        ));
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
             starts with its version (1 or 2); emit outbox messages with outbox.emit or \
             outbox.emit_bytes, not pg_logical_emit_message with prefix 'pgoutbox' directly"
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
        let err = decode(Bytes::from_static(b"\x03\0\0\0\0")).unwrap_err();
        assert!(matches!(
            err,
            EnvelopeError::UnsupportedVersion { version: 3 }
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
