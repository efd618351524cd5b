//! Our own reader of a RabbitMQ stream, beside `rstream` ([`super::read_stream`]): the
//! stream protocol's Subscribe, Credit and Deliver over pgoutbox's own frame codec
//! (`pgoutbox::stream_publisher::frames`), the osiris chunk and AMQP 1.0 decoded here.
//!
//! Source: rabbitmq-server `deps/rabbitmq_stream/docs/PROTOCOL.adoc` ("Deliver": the chunk
//! header) and OASIS AMQP 1.0 part 1 (types) and part 3 (sections).

use std::collections::BTreeMap;
use std::time::Duration;

use bytes::BytesMut;
use pgoutbox::stream_publisher::frames::{self, ServerFrame};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// One message as our reader decoded it.
#[derive(Debug, Clone, PartialEq)]
pub struct OwnMessage {
    /// Its offset in the stream.
    pub offset: u64,
    /// `properties.message-id` (a string).
    pub message_id: Option<String>,
    /// `properties.subject`.
    pub subject: Option<String>,
    /// Application properties whose values are strings.
    pub strings: BTreeMap<String, String>,
    /// The data section.
    pub body: Vec<u8>,
}

/// An AMQP 1.0 value, as far as our reader needs it.
#[derive(Debug, Clone, PartialEq)]
enum Value {
    Null,
    Text(String),
    Bytes(Vec<u8>),
    /// A value the reader skips (numbers, booleans, timestamps, UUIDs).
    Other,
    List(Vec<Value>),
    Map(Vec<(Value, Value)>),
    Described(u64, Box<Value>),
}

struct Cursor<'a>(&'a [u8]);

impl<'a> Cursor<'a> {
    fn take(&mut self, n: usize) -> &'a [u8] {
        let (h, t) = self.0.split_at(n);
        self.0 = t;
        h
    }
    fn u8(&mut self) -> u8 {
        self.take(1)[0]
    }
    fn u32(&mut self) -> u32 {
        u32::from_be_bytes(self.take(4).try_into().unwrap())
    }

    fn value_of(&mut self, code: u8) -> Value {
        let sized = |c: &mut Self, wide: bool| -> &'a [u8] {
            let n = if wide {
                c.u32() as usize
            } else {
                c.u8() as usize
            };
            c.take(n)
        };
        match code {
            0x00 => {
                let d = match self.u8() {
                    0x53 => u64::from(self.u8()),
                    0x80 => u64::from_be_bytes(self.take(8).try_into().unwrap()),
                    other => panic!("descriptor code {other:#x}"),
                };
                Value::Described(d, Box::new(self.value_inner()))
            }
            0x40 => Value::Null,
            0x41..=0x45 => Value::Other,
            0x50..=0x56 => {
                self.take(1);
                Value::Other
            }
            0x60 | 0x61 => {
                self.take(2);
                Value::Other
            }
            0x70..=0x73 => {
                self.take(4);
                Value::Other
            }
            0x80..=0x83 => {
                self.take(8);
                Value::Other
            }
            0x98 => {
                self.take(16);
                Value::Other
            }
            0xa0 | 0xb0 => Value::Bytes(sized(self, code == 0xb0).to_vec()),
            0xa1 | 0xb1 | 0xa3 | 0xb3 => {
                Value::Text(String::from_utf8_lossy(sized(self, code & 0xf0 == 0xb0)).into_owned())
            }
            0xc0 | 0xd0 | 0xc1 | 0xd1 => {
                let wide = code & 0xf0 == 0xd0;
                let (_size, count) = if wide {
                    (self.u32() as usize, self.u32() as usize)
                } else {
                    (self.u8() as usize, self.u8() as usize)
                };
                let items: Vec<Value> = (0..count).map(|_| self.value_inner()).collect();
                if code & 0x0f == 0x01 {
                    let mut it = items.into_iter();
                    let mut pairs = Vec::new();
                    while let (Some(k), Some(v)) = (it.next(), it.next()) {
                        pairs.push((k, v));
                    }
                    Value::Map(pairs)
                } else {
                    Value::List(items)
                }
            }
            other => panic!("AMQP 1.0 type code {other:#x} not read by the test reader"),
        }
    }

    fn value_inner(&mut self) -> Value {
        let code = self.u8();
        self.value_of(code)
    }
}

/// Decodes one AMQP 1.0 message (its sections).
fn decode_message(offset: u64, bytes: &[u8]) -> OwnMessage {
    let mut c = Cursor(bytes);
    let mut m = OwnMessage {
        offset,
        message_id: None,
        subject: None,
        strings: BTreeMap::new(),
        body: Vec::new(),
    };
    while !c.0.is_empty() {
        match c.value_inner() {
            Value::Described(0x73, props) => {
                if let Value::List(fields) = *props {
                    if let Some(Value::Text(id)) = fields.first() {
                        m.message_id = Some(id.clone());
                    }
                    if let Some(Value::Text(s)) = fields.get(3) {
                        m.subject = Some(s.clone());
                    }
                }
            }
            Value::Described(0x74, map) => {
                if let Value::Map(pairs) = *map {
                    for (k, v) in pairs {
                        if let (Value::Text(k), Value::Text(v)) = (k, v) {
                            m.strings.insert(k, v);
                        }
                    }
                }
            }
            Value::Described(0x75, data) => {
                if let Value::Bytes(b) = *data {
                    m.body.extend_from_slice(&b);
                }
            }
            _ => {}
        }
    }
    m
}

/// The messages of one osiris chunk (a `Deliver`'s payload after the subscription id).
fn decode_chunk(chunk: &[u8], out: &mut Vec<OwnMessage>) {
    let mut c = Cursor(chunk);
    let _magic = c.u8();
    let chunk_type = c.u8();
    let entries = u16::from_be_bytes(c.take(2).try_into().unwrap());
    let _records = c.u32();
    c.take(8 + 8); // timestamp, epoch
    let first = u64::from_be_bytes(c.take(8).try_into().unwrap());
    c.take(4); // crc
    let data_len = c.u32() as usize;
    c.take(4 + 4); // trailer length, reserved
    if chunk_type != 0 {
        return;
    }
    let mut data = Cursor(c.take(data_len));
    for i in 0..u64::from(entries) {
        let head = data.u32();
        assert_eq!(
            head & 0x8000_0000,
            0,
            "a sub-entry batch: pgoutbox never writes one"
        );
        let bytes = data.take(head as usize);
        out.push(decode_message(first + i, bytes));
    }
}

/// Reads `stream` at `host:port` (guest/guest, vhost `/`) from its first offset with our own
/// client, until no chunk came for `idle`.
pub async fn read_stream_own(port: u16, stream: &str, idle: Duration) -> Vec<OwnMessage> {
    let mut sock = TcpStream::connect(("127.0.0.1", port))
        .await
        .expect("stream port");
    let mut out = BytesMut::new();
    let mut inbuf: Vec<u8> = Vec::new();
    let mut corr = 0u32;
    let mut next = || {
        corr += 1;
        corr
    };
    // One step at a time, as the protocol's authentication sequence goes.
    frames::peer_properties(&mut out, next(), &[("product", "pgoutbox tests")]).unwrap();
    sock.write_all(&out.split()).await.unwrap();
    let mut messages = Vec::new();
    let mut subscribed = false;
    loop {
        while let Ok(Some(len)) = frames::frame_len(&inbuf, 0) {
            let frame: Vec<u8> = inbuf.drain(..len).collect();
            match frames::decode(&frame).expect("a frame our codec reads") {
                ServerFrame::Tune {
                    frame_max,
                    heartbeat,
                } => {
                    frames::tune(&mut out, frame_max, heartbeat);
                    frames::open(&mut out, next(), "/").unwrap();
                }
                ServerFrame::Response {
                    key: frames::PEER_PROPERTIES,
                    ..
                } => frames::sasl_handshake(&mut out, next()),
                ServerFrame::Response {
                    key: frames::SASL_HANDSHAKE,
                    ..
                } => frames::sasl_plain(&mut out, next(), "guest", "guest").unwrap(),
                ServerFrame::Response {
                    key: frames::OPEN, ..
                } if !subscribed => {
                    frames::subscribe_first(&mut out, next(), 1, stream, 10).unwrap();
                    subscribed = true;
                }
                ServerFrame::Response { key, code, .. } => {
                    assert_eq!(code, frames::code::OK, "response to {key:#x}");
                }
                ServerFrame::Deliver { chunk, .. } => {
                    decode_chunk(&chunk, &mut messages);
                    frames::credit(&mut out, 1, 1);
                }
                _ => {}
            }
        }
        if !out.is_empty() {
            sock.write_all(&out.split()).await.unwrap();
        }
        let mut chunk = vec![0u8; 1 << 16];
        match tokio::time::timeout(idle, sock.read(&mut chunk)).await {
            Err(_) => return messages,
            Ok(Ok(0)) => panic!("the broker closed the stream connection of our reader"),
            Ok(Ok(n)) => inbuf.extend_from_slice(&chunk[..n]),
            Ok(Err(e)) => panic!("reading the stream: {e}"),
        }
    }
}
