//! The AMQP 1.0 message that a stream stores for each outbox message: what stream consumers
//! (the Java, Go, .NET, Python `rstream` and Node clients) decode.
//!
//! ```text
//!   properties (0x73)              message-id, subject = topic, correlation-id,
//!                                  content-type, creation-time = commit time (ms)
//!   application-properties (0x74)  the AMQP path's headers, same keys and values
//!   data (0x75)                    the payload, byte-exact
//! ```
//!
//! The sections are built from the same [`OutboundMessage`] the AMQP 0-9-1 path publishes
//! ([`crate::publisher::encode::Encoder`]: `--publish-properties`, `--cloudevents`), so a
//! consumer finds the same keys on both. AMQP 0-9-1's `type` property (the topic) has no
//! AMQP 1.0 property: the topic is the `subject`. `expiration` and `priority` belong to
//! AMQP 1.0's header section, which a stream ignores: they are left out.
//!
//! Source: OASIS AMQP 1.0, part 1 "Types" (1.6 encodings: null 0x40, boolean 0x41/0x42,
//! long 0x81, double 0x82, timestamp 0x83, vbin8/32 0xa0/0xb0, str8/32 0xa1/0xb1, sym8/32
//! 0xa3/0xb3, list32 0xd0, map32 0xd1; 1.2 described types) and part 3 "Messaging" (3.2
//! sections and their descriptors).

use amq_protocol::protocol::BasicProperties;
use amq_protocol::types::{AMQPValue, FieldTable};
use bytes::{BufMut, BytesMut};

/// The `properties` section's descriptor (AMQP 1.0, 3.2.4).
pub const PROPERTIES: u8 = 0x73;
/// The `application-properties` section's descriptor (3.2.5).
pub const APPLICATION_PROPERTIES: u8 = 0x74;
/// The `data` section's descriptor (3.2.6).
pub const DATA: u8 = 0x75;

/// What goes into one stream message.
#[derive(Debug)]
pub struct Message<'a> {
    /// The AMQP path's properties and headers.
    pub properties: &'a BasicProperties,
    /// The topic.
    pub subject: &'a str,
    /// The commit time, milliseconds since the Unix epoch.
    pub creation_time_ms: i64,
    /// The payload.
    pub body: &'a [u8],
}

/// Appends `m` as an AMQP 1.0 message (three sections) to `buf`.
pub fn encode(buf: &mut BytesMut, m: &Message<'_>) {
    described(buf, PROPERTIES);
    list(buf, |b| {
        let p = m.properties;
        let mut n = 0;
        // message-id, user-id, to, subject, reply-to, correlation-id, content-type,
        // content-encoding, absolute-expiry-time, creation-time
        put_opt_str(b, p.message_id().as_ref().map(|s| s.as_str()));
        b.put_u8(0x40);
        b.put_u8(0x40);
        put_str(b, m.subject);
        b.put_u8(0x40);
        put_opt_str(b, p.correlation_id().as_ref().map(|s| s.as_str()));
        match p.content_type() {
            Some(t) => put_symbol(b, t.as_str()),
            None => b.put_u8(0x40),
        }
        match p.content_encoding() {
            Some(t) => put_symbol(b, t.as_str()),
            None => b.put_u8(0x40),
        }
        b.put_u8(0x40);
        b.put_u8(0x83);
        b.put_i64(m.creation_time_ms);
        n += 10;
        n
    });
    if let Some(headers) = m.properties.headers() {
        if !headers.inner().is_empty() {
            application_properties(buf, headers);
        }
    }
    described(buf, DATA);
    put_binary(buf, m.body);
}

fn described(buf: &mut BytesMut, descriptor: u8) {
    buf.put_u8(0x00);
    buf.put_u8(0x53); // smallulong
    buf.put_u8(descriptor);
}

/// A list32 whose items `items` writes, returning their count.
fn list(buf: &mut BytesMut, items: impl FnOnce(&mut BytesMut) -> u32) {
    buf.put_u8(0xd0);
    let at = buf.len();
    buf.put_u32(0);
    buf.put_u32(0);
    let count = items(buf);
    let size = (buf.len() - at - 4) as u32;
    buf[at..at + 4].copy_from_slice(&size.to_be_bytes());
    buf[at + 4..at + 8].copy_from_slice(&count.to_be_bytes());
}

/// The application-properties map: string keys, simple values (AMQP 1.0 3.2.5 allows no
/// maps or lists there; a nested table becomes its text, as the AMQP path already gives
/// JSON objects and arrays as text).
fn application_properties(buf: &mut BytesMut, headers: &FieldTable) {
    described(buf, APPLICATION_PROPERTIES);
    buf.put_u8(0xd1);
    let at = buf.len();
    buf.put_u32(0);
    buf.put_u32(0);
    let mut count = 0u32;
    for (key, value) in headers.inner() {
        put_str(buf, key.as_str());
        put_value(buf, value);
        count += 2;
    }
    let size = (buf.len() - at - 4) as u32;
    buf[at..at + 4].copy_from_slice(&size.to_be_bytes());
    buf[at + 4..at + 8].copy_from_slice(&count.to_be_bytes());
}

fn put_value(buf: &mut BytesMut, value: &AMQPValue) {
    match value {
        AMQPValue::Boolean(true) => buf.put_u8(0x41),
        AMQPValue::Boolean(false) => buf.put_u8(0x42),
        AMQPValue::ShortShortInt(i) => long(buf, i64::from(*i)),
        AMQPValue::ShortShortUInt(i) => long(buf, i64::from(*i)),
        AMQPValue::ShortInt(i) => long(buf, i64::from(*i)),
        AMQPValue::ShortUInt(i) => long(buf, i64::from(*i)),
        AMQPValue::LongInt(i) => long(buf, i64::from(*i)),
        AMQPValue::LongUInt(i) => long(buf, i64::from(*i)),
        AMQPValue::LongLongInt(i) => long(buf, *i),
        AMQPValue::Timestamp(t) => {
            buf.put_u8(0x83);
            buf.put_i64(i64::try_from(*t).unwrap_or(i64::MAX).saturating_mul(1000));
        }
        AMQPValue::Float(f) => {
            buf.put_u8(0x82);
            buf.put_f64(f64::from(*f));
        }
        AMQPValue::Double(f) => {
            buf.put_u8(0x82);
            buf.put_f64(*f);
        }
        AMQPValue::ShortString(s) => put_str(buf, s.as_str()),
        AMQPValue::LongString(s) => put_str_bytes(buf, s.as_bytes()),
        AMQPValue::ByteArray(b) => put_binary(buf, b.as_slice()),
        AMQPValue::Void => buf.put_u8(0x40),
        other => put_str(buf, &format!("{other:?}")),
    }
}

fn long(buf: &mut BytesMut, i: i64) {
    buf.put_u8(0x81);
    buf.put_i64(i);
}

fn put_opt_str(buf: &mut BytesMut, s: Option<&str>) {
    match s {
        Some(s) => put_str(buf, s),
        None => buf.put_u8(0x40),
    }
}

fn put_str(buf: &mut BytesMut, s: &str) {
    put_str_bytes(buf, s.as_bytes());
}

/// A string: str8-utf8 up to 255 bytes, str32-utf8 above. Bytes that are not UTF-8 (a long
/// string from a producer header is JSON text, so always UTF-8) are sent as they are.
fn put_str_bytes(buf: &mut BytesMut, s: &[u8]) {
    sized(buf, 0xa1, 0xb1, s);
}

fn put_symbol(buf: &mut BytesMut, s: &str) {
    sized(buf, 0xa3, 0xb3, s.as_bytes());
}

fn put_binary(buf: &mut BytesMut, b: &[u8]) {
    sized(buf, 0xa0, 0xb0, b);
}

fn sized(buf: &mut BytesMut, short: u8, long: u8, b: &[u8]) {
    if let Ok(n) = u8::try_from(b.len()) {
        buf.put_u8(short);
        buf.put_u8(n);
    } else {
        buf.put_u8(long);
        buf.put_u32(b.len() as u32);
    }
    buf.put_slice(b);
}

#[cfg(test)]
mod tests {
    use super::*;
    use amq_protocol::types::ShortString;

    #[test]
    fn a_message_is_properties_application_properties_and_data() {
        let mut headers = FieldTable::default();
        headers.insert(ShortString::from("k"), AMQPValue::LongLongInt(7));
        let p = BasicProperties::default()
            .with_message_id(ShortString::from("m1"))
            .with_content_type(ShortString::from("text/plain"))
            .with_headers(headers);
        let mut buf = BytesMut::new();
        encode(
            &mut buf,
            &Message {
                properties: &p,
                subject: "t",
                creation_time_ms: 1_000,
                body: b"hi",
            },
        );
        let mut expect = vec![0x00, 0x53, 0x73, 0xd0];
        let items: Vec<u8> = [
            &[0xa1, 2, b'm', b'1', 0x40, 0x40, 0xa1, 1, b't', 0x40, 0x40][..],
            &[0xa3, 10],
            b"text/plain",
            &[0x40, 0x40, 0x83],
            &1_000i64.to_be_bytes(),
        ]
        .concat();
        expect.extend_from_slice(&((items.len() + 4) as u32).to_be_bytes());
        expect.extend_from_slice(&10u32.to_be_bytes());
        expect.extend_from_slice(&items);
        expect.extend_from_slice(&[0x00, 0x53, 0x74, 0xd1]);
        let map: Vec<u8> = [&[0xa1, 1, b'k', 0x81][..], &7i64.to_be_bytes()].concat();
        expect.extend_from_slice(&((map.len() + 4) as u32).to_be_bytes());
        expect.extend_from_slice(&2u32.to_be_bytes());
        expect.extend_from_slice(&map);
        expect.extend_from_slice(&[0x00, 0x53, 0x75, 0xa0, 2, b'h', b'i']);
        assert_eq!(&buf[..], &expect[..]);
    }

    #[test]
    fn a_long_body_is_a_vbin32() {
        let p = BasicProperties::default();
        let body = vec![7u8; 300];
        let mut buf = BytesMut::new();
        encode(
            &mut buf,
            &Message {
                properties: &p,
                subject: "t",
                creation_time_ms: 0,
                body: &body,
            },
        );
        let tail = &buf[buf.len() - 300 - 8..];
        assert_eq!(&tail[..8], &[0x00, 0x53, 0x75, 0xb0, 0, 0, 1, 44]);
    }
}
