//! The stream protocol's frames that a publisher uses: encoding the client's, decoding the
//! broker's. Sans-IO: bytes in, typed values out, and the reverse; no socket, no clock.
//!
//! ```text
//!   frame    = size:u32 (bytes after it) key:u16 version:u16 rest
//!   request  = key (high bit 0) version correlation:u32 fields
//!   response = key | 0x8000      version correlation:u32 code:u16 fields
//!   command  = key version fields                   (Publish, PublishConfirm, Heartbeat, ...)
//!   string   = len:i16 bytes (-1: null)      bytes = len:i32 bytes (-1: null)
//!   array    = count:i32 items
//! ```
//!
//! All integers big endian. Source: rabbitmq-server `deps/rabbitmq_stream/docs/PROTOCOL.adoc`
//! ("Frame Structure", "Commands"), every frame here checked against RabbitMQ 3.10.8.

use bytes::{BufMut, BytesMut};

/// `DeclarePublisher` (client request).
pub const DECLARE_PUBLISHER: u16 = 0x0001;
/// `Publish` (client command, no response).
pub const PUBLISH: u16 = 0x0002;
/// `PublishConfirm` (server command).
pub const PUBLISH_CONFIRM: u16 = 0x0003;
/// `PublishError` (server command).
pub const PUBLISH_ERROR: u16 = 0x0004;
/// `QueryPublisherSequence` (client request).
pub const QUERY_PUBLISHER_SEQUENCE: u16 = 0x0005;
/// `DeletePublisher` (client request).
pub const DELETE_PUBLISHER: u16 = 0x0006;
/// `Subscribe` (client request; our test reader's).
pub const SUBSCRIBE: u16 = 0x0007;
/// `Deliver` (server command; our test reader's).
pub const DELIVER: u16 = 0x0008;
/// `Credit` (client command; our test reader's).
pub const CREDIT: u16 = 0x0009;
/// `Create` a stream (client request).
pub const CREATE: u16 = 0x000d;
/// `Metadata` of streams (client request).
pub const METADATA: u16 = 0x000f;
/// `MetadataUpdate` (server command: a stream's topology changed).
pub const METADATA_UPDATE: u16 = 0x0010;
/// `PeerProperties` (client request).
pub const PEER_PROPERTIES: u16 = 0x0011;
/// `SaslHandshake` (client request).
pub const SASL_HANDSHAKE: u16 = 0x0012;
/// `SaslAuthenticate` (client request).
pub const SASL_AUTHENTICATE: u16 = 0x0013;
/// `Tune` (server request; the client answers with its own `Tune`).
pub const TUNE: u16 = 0x0014;
/// `Open` a virtual host (client request).
pub const OPEN: u16 = 0x0015;
/// `Close` (either side; a request answered by a response).
pub const CLOSE: u16 = 0x0016;
/// `Heartbeat` (either side, no response).
pub const HEARTBEAT: u16 = 0x0017;
/// The high bit that marks a response.
pub const RESPONSE: u16 = 0x8000;
/// The protocol version of every command we send (RabbitMQ 3.9 and 3.10 speak version 1).
pub const VERSION: u16 = 1;

/// Response and error codes ("Response Codes" in PROTOCOL.adoc).
pub mod code {
    /// OK.
    pub const OK: u16 = 0x01;
    /// The stream does not exist.
    pub const STREAM_DOES_NOT_EXIST: u16 = 0x02;
    /// The stream already exists (`Create`).
    pub const STREAM_ALREADY_EXISTS: u16 = 0x05;
    /// The stream is not available (no leader, being moved).
    pub const STREAM_NOT_AVAILABLE: u16 = 0x06;
    /// The SASL mechanism is not supported.
    pub const SASL_MECHANISM_NOT_SUPPORTED: u16 = 0x07;
    /// Authentication failed (user or password).
    pub const AUTHENTICATION_FAILURE: u16 = 0x08;
    /// The user may only connect from localhost (`guest`).
    pub const AUTHENTICATION_FAILURE_LOOPBACK: u16 = 0x0b;
    /// The user may not open the virtual host (or it does not exist).
    pub const VIRTUAL_HOST_ACCESS_FAILURE: u16 = 0x0c;
    /// A frame exceeded the negotiated maximum.
    pub const FRAME_TOO_LARGE: u16 = 0x0e;
    /// Access refused (the user may not write the stream, or create it).
    pub const ACCESS_REFUSED: u16 = 0x10;
    /// Precondition failed (a publisher reference already in use, an argument refused).
    pub const PRECONDITION_FAILED: u16 = 0x11;
    /// The publisher does not exist (any more).
    pub const PUBLISHER_DOES_NOT_EXIST: u16 = 0x12;

    /// The code's name in PROTOCOL.adoc's table, for messages.
    pub fn name(code: u16) -> &'static str {
        match code {
            0x01 => "ok",
            0x02 => "stream does not exist",
            0x03 => "subscription id already exists",
            0x04 => "subscription id does not exist",
            0x05 => "stream already exists",
            0x06 => "stream not available",
            0x07 => "SASL mechanism not supported",
            0x08 => "authentication failure",
            0x09 => "SASL error",
            0x0a => "SASL challenge",
            0x0b => "SASL authentication failure loopback",
            0x0c => "virtual host access failure",
            0x0d => "unknown frame",
            0x0e => "frame too large",
            0x0f => "internal error",
            0x10 => "access refused",
            0x11 => "precondition failed",
            0x12 => "publisher does not exist",
            _ => "unknown code",
        }
    }
}

/// Why bytes from the broker are not a frame we can read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    /// The size prefix is above the negotiated maximum (or below the smallest frame).
    #[error("a stream frame of {size} bytes (the maximum is {max})")]
    Size {
        /// The frame's size field.
        size: u64,
        /// The maximum allowed.
        max: u64,
    },
    /// The frame ends before its fields do, or has bytes left over.
    #[error("a malformed stream frame (key {key:#06x}): {what}")]
    Malformed {
        /// The frame's key.
        key: u16,
        /// What was wrong.
        what: &'static str,
    },
}

/// The length of the first frame in `buf`, its 4-byte size prefix included, or `None` when
/// `buf` does not hold it whole yet.
///
/// # Errors
/// [`DecodeError::Size`] when the size field is below 4 (no key and version) or above
/// `max` (0: no limit).
pub fn frame_len(buf: &[u8], max: u32) -> Result<Option<usize>, DecodeError> {
    let Some(head) = buf.get(..4) else {
        return Ok(None);
    };
    let size = u32::from_be_bytes([head[0], head[1], head[2], head[3]]);
    if size < 4 || (max != 0 && size > max) {
        return Err(DecodeError::Size {
            size: u64::from(size),
            max: u64::from(max),
        });
    }
    let len = 4 + size as usize;
    Ok((buf.len() >= len).then_some(len))
}

/// A frame from the broker, decoded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ServerFrame {
    /// The answer to one of our requests.
    Response {
        /// The request's key (without the response bit).
        key: u16,
        /// The request's correlation id.
        correlation: u32,
        /// Its response code ([`code`]).
        code: u16,
        /// The fields after the code, by request.
        body: ResponseBody,
    },
    /// Publishing ids of publisher `publisher` that the broker stored (or had stored
    /// already: a deduplicated id is confirmed too).
    PublishConfirm {
        /// Our publisher id.
        publisher: u8,
        /// The ids confirmed, in the broker's order.
        ids: Vec<u64>,
    },
    /// Publishing ids the broker did not store, each with its code.
    PublishError {
        /// Our publisher id.
        publisher: u8,
        /// (publishing id, code).
        errors: Vec<(u64, u16)>,
    },
    /// A stream's topology changed: its leader moved (or it is gone). The broker drops
    /// this connection's publishers on it.
    MetadataUpdate {
        /// Why ([`code::STREAM_NOT_AVAILABLE`] in 3.10).
        code: u16,
        /// The stream.
        stream: String,
    },
    /// The broker's proposal of `frame_max` (bytes, 0: none) and heartbeat (seconds).
    Tune {
        /// Largest frame, bytes.
        frame_max: u32,
        /// Heartbeat interval, seconds.
        heartbeat: u32,
    },
    /// The broker closes the connection.
    Close {
        /// To answer with a `Close` response.
        correlation: u32,
        /// Why ([`code`]).
        code: u16,
        /// In words.
        reason: String,
    },
    /// A heartbeat.
    Heartbeat,
    /// A chunk of messages for a subscription (our test reader's).
    Deliver {
        /// The subscription.
        subscription: u8,
        /// The osiris chunk, as sent.
        chunk: Vec<u8>,
    },
    /// A frame a publisher does not use (credit errors, ...); ignored.
    Other {
        /// Its key.
        key: u16,
    },
}

/// The fields of a response after its code.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ResponseBody {
    /// No further fields (or not read).
    Empty,
    /// `PeerProperties` and `Open`: key-value pairs.
    Properties(Vec<(String, String)>),
    /// `SaslHandshake`: the mechanisms offered.
    Mechanisms(Vec<String>),
    /// `QueryPublisherSequence`: the highest publishing id stored for the reference (0:
    /// none).
    Sequence(u64),
    /// `Metadata`.
    Metadata {
        /// (reference, host, port).
        brokers: Vec<(u16, String, u32)>,
        /// The streams asked about.
        streams: Vec<StreamMetadata>,
    },
}

/// One stream in a `Metadata` response.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StreamMetadata {
    /// Its name.
    pub name: String,
    /// [`code::OK`], or why not ([`code::STREAM_DOES_NOT_EXIST`]).
    pub code: u16,
    /// The leader's broker reference.
    pub leader: u16,
    /// The replicas' broker references.
    pub replicas: Vec<u16>,
}

/// A reader over one frame's bytes.
struct Reader<'a> {
    buf: &'a [u8],
    key: u16,
}

impl<'a> Reader<'a> {
    fn fail<T>(&self, what: &'static str) -> Result<T, DecodeError> {
        Err(DecodeError::Malformed {
            key: self.key,
            what,
        })
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8], DecodeError> {
        if self.buf.len() < n {
            return self.fail("the frame ends inside a field");
        }
        let (head, rest) = self.buf.split_at(n);
        self.buf = rest;
        Ok(head)
    }

    fn u8(&mut self) -> Result<u8, DecodeError> {
        Ok(self.take(1)?[0])
    }

    fn u16(&mut self) -> Result<u16, DecodeError> {
        let b = self.take(2)?;
        Ok(u16::from_be_bytes([b[0], b[1]]))
    }

    fn u32(&mut self) -> Result<u32, DecodeError> {
        let b = self.take(4)?;
        Ok(u32::from_be_bytes([b[0], b[1], b[2], b[3]]))
    }

    fn u64(&mut self) -> Result<u64, DecodeError> {
        let b = self.take(8)?;
        let mut a = [0u8; 8];
        a.copy_from_slice(b);
        Ok(u64::from_be_bytes(a))
    }

    /// A string (i16 length, -1 null: read as empty). Invalid UTF-8 is replaced: these are
    /// names and reasons for messages.
    fn string(&mut self) -> Result<String, DecodeError> {
        let len = self.u16()? as i16;
        if len < 0 {
            return Ok(String::new());
        }
        let b = self.take(len as usize)?;
        Ok(String::from_utf8_lossy(b).into_owned())
    }

    /// An array's count, bounded by what the remaining bytes can hold at `min` bytes per
    /// item (so a hostile count allocates nothing).
    fn count(&mut self, min: usize) -> Result<usize, DecodeError> {
        let n = self.u32()? as i32;
        if n < 0 {
            return self.fail("a negative array length");
        }
        let n = n as usize;
        if n.saturating_mul(min) > self.buf.len() {
            return self.fail("an array longer than the frame");
        }
        Ok(n)
    }

    fn pairs(&mut self) -> Result<Vec<(String, String)>, DecodeError> {
        let n = self.count(4)?;
        let mut out = Vec::with_capacity(n);
        for _ in 0..n {
            out.push((self.string()?, self.string()?));
        }
        Ok(out)
    }

    fn end(&self) -> Result<(), DecodeError> {
        if self.buf.is_empty() {
            Ok(())
        } else {
            self.fail("bytes left over after the last field")
        }
    }
}

/// Decodes one whole frame (as [`frame_len`] delimited it, size prefix included).
///
/// # Errors
/// [`DecodeError::Malformed`] when its fields do not fit its key.
pub fn decode(frame: &[u8]) -> Result<ServerFrame, DecodeError> {
    let mut r = Reader {
        buf: frame.get(4..).unwrap_or_default(),
        key: 0,
    };
    let key = r.u16()?;
    r.key = key;
    let _version = r.u16()?;
    let frame = match key {
        PUBLISH_CONFIRM => {
            let publisher = r.u8()?;
            let n = r.count(8)?;
            let mut ids = Vec::with_capacity(n);
            for _ in 0..n {
                ids.push(r.u64()?);
            }
            ServerFrame::PublishConfirm { publisher, ids }
        }
        PUBLISH_ERROR => {
            let publisher = r.u8()?;
            let n = r.count(10)?;
            let mut errors = Vec::with_capacity(n);
            for _ in 0..n {
                errors.push((r.u64()?, r.u16()?));
            }
            ServerFrame::PublishError { publisher, errors }
        }
        METADATA_UPDATE => ServerFrame::MetadataUpdate {
            code: r.u16()?,
            stream: r.string()?,
        },
        TUNE => ServerFrame::Tune {
            frame_max: r.u32()?,
            heartbeat: r.u32()?,
        },
        CLOSE => ServerFrame::Close {
            correlation: r.u32()?,
            code: r.u16()?,
            reason: r.string()?,
        },
        HEARTBEAT => ServerFrame::Heartbeat,
        DELIVER => {
            let subscription = r.u8()?;
            let chunk = r.buf.to_vec();
            r.buf = &[];
            ServerFrame::Deliver {
                subscription,
                chunk,
            }
        }
        // CreditResponse carries no correlation id (code, subscription): nothing of ours.
        k if k == CREDIT | RESPONSE => {
            r.buf = &[];
            ServerFrame::Other { key: k }
        }
        k if k & RESPONSE != 0 => {
            let key = k & !RESPONSE;
            let correlation = r.u32()?;
            let code = r.u16()?;
            let body = match key {
                PEER_PROPERTIES | OPEN if code == code::OK => ResponseBody::Properties(r.pairs()?),
                SASL_HANDSHAKE if code == code::OK => {
                    let n = r.count(2)?;
                    let mut m = Vec::with_capacity(n);
                    for _ in 0..n {
                        m.push(r.string()?);
                    }
                    ResponseBody::Mechanisms(m)
                }
                QUERY_PUBLISHER_SEQUENCE => ResponseBody::Sequence(r.u64()?),
                METADATA => return decode_metadata(r, correlation, code),
                _ => {
                    // SaslAuthenticate's opaque data, a refused PeerProperties' empty
                    // list, ...: nothing a publisher reads.
                    r.buf = &[];
                    ResponseBody::Empty
                }
            };
            r.end()?;
            return Ok(ServerFrame::Response {
                key,
                correlation,
                code,
                body,
            });
        }
        k => {
            r.buf = &[];
            ServerFrame::Other { key: k }
        }
    };
    r.end()?;
    Ok(frame)
}

/// The `Metadata` response: its code field is the first broker count's high half in the
/// protocol document's layout, so the response has no code of its own: it is read here as
/// brokers then streams, and `code` is taken from the first stream.
fn decode_metadata(
    mut r: Reader<'_>,
    correlation: u32,
    first_two: u16,
) -> Result<ServerFrame, DecodeError> {
    // MetadataResponse => Key Version CorrelationId [Broker] [StreamMetadata]: no response
    // code; the u16 already read is the broker array count's high half.
    let low = r.u16()?;
    let n = ((u32::from(first_two) << 16) | u32::from(low)) as i32;
    if n < 0 || (n as usize).saturating_mul(8) > r.buf.len() {
        return r.fail("an array longer than the frame");
    }
    let mut brokers = Vec::with_capacity(n as usize);
    for _ in 0..n {
        brokers.push((r.u16()?, r.string()?, r.u32()?));
    }
    let n = r.count(8)?;
    let mut streams = Vec::with_capacity(n);
    for _ in 0..n {
        let name = r.string()?;
        let code = r.u16()?;
        let leader = r.u16()?;
        let m = r.count(2)?;
        let mut replicas = Vec::with_capacity(m);
        for _ in 0..m {
            replicas.push(r.u16()?);
        }
        streams.push(StreamMetadata {
            name,
            code,
            leader,
            replicas,
        });
    }
    r.end()?;
    let code = streams.first().map_or(code::OK, |s| s.code);
    Ok(ServerFrame::Response {
        key: METADATA,
        correlation,
        code,
        body: ResponseBody::Metadata { brokers, streams },
    })
}

/// Why a frame we were asked to encode cannot be.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EncodeError {
    /// A string over the protocol's i16 length (32,767 bytes).
    #[error("a stream-protocol string of {0} bytes (at most 32,767)")]
    StringTooLong(usize),
}

/// Writes frames into a buffer. Each method appends one whole frame.
#[derive(Debug, Default)]
pub struct Encoder;

fn put_string(buf: &mut BytesMut, s: &str) -> Result<(), EncodeError> {
    let len = i16::try_from(s.len()).map_err(|_| EncodeError::StringTooLong(s.len()))?;
    buf.put_i16(len);
    buf.put_slice(s.as_bytes());
    Ok(())
}

/// Starts a frame: a size placeholder, key and version. Returns where the size goes.
fn start(buf: &mut BytesMut, key: u16) -> usize {
    let at = buf.len();
    buf.put_u32(0);
    buf.put_u16(key);
    buf.put_u16(VERSION);
    at
}

/// Writes the size of the frame started at `at`.
fn finish(buf: &mut BytesMut, at: usize) {
    let size = (buf.len() - at - 4) as u32;
    buf[at..at + 4].copy_from_slice(&size.to_be_bytes());
}

/// Appends a request frame: key, version, correlation, then what `fields` writes. On an
/// error nothing is appended.
fn request(
    buf: &mut BytesMut,
    key: u16,
    correlation: u32,
    fields: impl FnOnce(&mut BytesMut) -> Result<(), EncodeError>,
) -> Result<(), EncodeError> {
    let at = start(buf, key);
    buf.put_u32(correlation);
    if let Err(e) = fields(buf) {
        buf.truncate(at);
        return Err(e);
    }
    finish(buf, at);
    Ok(())
}

/// `PeerProperties`: our name, version, the connection's name.
///
/// # Errors
/// A string over 32,767 bytes.
pub fn peer_properties(
    buf: &mut BytesMut,
    correlation: u32,
    properties: &[(&str, &str)],
) -> Result<(), EncodeError> {
    request(buf, PEER_PROPERTIES, correlation, |b| {
        b.put_i32(properties.len() as i32);
        for (k, v) in properties {
            put_string(b, k)?;
            put_string(b, v)?;
        }
        Ok(())
    })
}

/// `SaslHandshake`: asks for the mechanisms.
pub fn sasl_handshake(buf: &mut BytesMut, correlation: u32) {
    let _ = request(buf, SASL_HANDSHAKE, correlation, |_| Ok(()));
}

/// `SaslAuthenticate` with PLAIN (RFC 4616): `\0user\0password`.
///
/// # Errors
/// A string over 32,767 bytes.
pub fn sasl_plain(
    buf: &mut BytesMut,
    correlation: u32,
    user: &str,
    password: &str,
) -> Result<(), EncodeError> {
    request(buf, SASL_AUTHENTICATE, correlation, |b| {
        put_string(b, "PLAIN")?;
        b.put_i32((2 + user.len() + password.len()) as i32);
        b.put_u8(0);
        b.put_slice(user.as_bytes());
        b.put_u8(0);
        b.put_slice(password.as_bytes());
        Ok(())
    })
}

/// Our `Tune`, answering the broker's: the frame size (bytes) and heartbeat (seconds) we
/// agree on.
pub fn tune(buf: &mut BytesMut, frame_max: u32, heartbeat: u32) {
    let at = start(buf, TUNE);
    buf.put_u32(frame_max);
    buf.put_u32(heartbeat);
    finish(buf, at);
}

/// `Open` the virtual host.
///
/// # Errors
/// A string over 32,767 bytes.
pub fn open(buf: &mut BytesMut, correlation: u32, vhost: &str) -> Result<(), EncodeError> {
    request(buf, OPEN, correlation, |b| put_string(b, vhost))
}

/// `Create` a stream with `arguments` (`max-age`, `max-length-bytes`, ...).
///
/// # Errors
/// A string over 32,767 bytes.
pub fn create(
    buf: &mut BytesMut,
    correlation: u32,
    stream: &str,
    arguments: &[(&str, String)],
) -> Result<(), EncodeError> {
    request(buf, CREATE, correlation, |b| {
        put_string(b, stream)?;
        b.put_i32(arguments.len() as i32);
        for (k, v) in arguments {
            put_string(b, k)?;
            put_string(b, v)?;
        }
        Ok(())
    })
}

/// `Metadata` of `streams`.
///
/// # Errors
/// A string over 32,767 bytes.
pub fn metadata(buf: &mut BytesMut, correlation: u32, streams: &[&str]) -> Result<(), EncodeError> {
    request(buf, METADATA, correlation, |b| {
        b.put_i32(streams.len() as i32);
        for s in streams {
            put_string(b, s)?;
        }
        Ok(())
    })
}

/// `DeclarePublisher` `publisher` with `reference` (its producer name: deduplication is per
/// reference) on `stream`.
///
/// # Errors
/// A string over 32,767 bytes.
pub fn declare_publisher(
    buf: &mut BytesMut,
    correlation: u32,
    publisher: u8,
    reference: &str,
    stream: &str,
) -> Result<(), EncodeError> {
    request(buf, DECLARE_PUBLISHER, correlation, |b| {
        b.put_u8(publisher);
        put_string(b, reference)?;
        put_string(b, stream)
    })
}

/// `QueryPublisherSequence` of `reference` on `stream`.
///
/// # Errors
/// A string over 32,767 bytes.
pub fn query_publisher_sequence(
    buf: &mut BytesMut,
    correlation: u32,
    reference: &str,
    stream: &str,
) -> Result<(), EncodeError> {
    request(buf, QUERY_PUBLISHER_SEQUENCE, correlation, |b| {
        put_string(b, reference)?;
        put_string(b, stream)
    })
}

/// `Close` with `code` and `reason`.
///
/// # Errors
/// A string over 32,767 bytes.
pub fn close(
    buf: &mut BytesMut,
    correlation: u32,
    code: u16,
    reason: &str,
) -> Result<(), EncodeError> {
    request(buf, CLOSE, correlation, |b| {
        b.put_u16(code);
        put_string(b, reason)
    })
}

/// The response to the broker's `Close`.
pub fn close_ok(buf: &mut BytesMut, correlation: u32) {
    let at = start(buf, CLOSE | RESPONSE);
    buf.put_u32(correlation);
    buf.put_u16(code::OK);
    finish(buf, at);
}

/// A `Heartbeat`.
pub fn heartbeat(buf: &mut BytesMut) {
    let at = start(buf, HEARTBEAT);
    finish(buf, at);
}

/// `Subscribe` (our test reader's): from the first offset, with `credit` chunks.
///
/// # Errors
/// A string over 32,767 bytes.
pub fn subscribe_first(
    buf: &mut BytesMut,
    correlation: u32,
    subscription: u8,
    stream: &str,
    credit: u16,
) -> Result<(), EncodeError> {
    request(buf, SUBSCRIBE, correlation, |b| {
        b.put_u8(subscription);
        put_string(b, stream)?;
        b.put_u16(1); // OffsetType first
        b.put_u16(credit);
        b.put_i32(0); // no properties
        Ok(())
    })
}

/// `Credit` (our test reader's).
pub fn credit(buf: &mut BytesMut, subscription: u8, credit: u16) {
    let at = start(buf, CREDIT);
    buf.put_u8(subscription);
    buf.put_u16(credit);
    finish(buf, at);
}

/// A `Publish` frame being filled: [`PublishFrame::push`] appends messages, and
/// [`PublishFrame::finish`] writes the size and count. One frame carries many messages, so
/// a batch of publishes costs one header.
#[derive(Debug)]
pub struct PublishFrame {
    at: usize,
    count: u32,
}

impl PublishFrame {
    /// The overhead of a frame before its first message (size, key, version, publisher,
    /// count), bytes.
    pub const HEADER: usize = 4 + 2 + 2 + 1 + 4;
    /// The overhead of each message (publishing id, length), bytes.
    pub const PER_MESSAGE: usize = 8 + 4;

    /// Starts a `Publish` frame of `publisher` in `buf`.
    pub fn start(buf: &mut BytesMut, publisher: u8) -> PublishFrame {
        let at = start(buf, PUBLISH);
        buf.put_u8(publisher);
        buf.put_u32(0);
        PublishFrame { at, count: 0 }
    }

    /// Appends one message: its publishing id, and `write` writes its bytes (the AMQP 1.0
    /// message) after a length placeholder that is then filled in.
    pub fn push(&mut self, buf: &mut BytesMut, id: u64, write: impl FnOnce(&mut BytesMut)) {
        buf.put_u64(id);
        let len_at = buf.len();
        buf.put_u32(0);
        write(buf);
        let len = (buf.len() - len_at - 4) as u32;
        buf[len_at..len_at + 4].copy_from_slice(&len.to_be_bytes());
        self.count += 1;
    }

    /// Appends one message as [`PublishFrame::push`] does, unless the frame would then be
    /// longer than `max` bytes: then nothing is appended and the answer is false.
    pub fn try_push(
        &mut self,
        buf: &mut BytesMut,
        id: u64,
        max: usize,
        write: impl FnOnce(&mut BytesMut),
    ) -> bool {
        let before = buf.len();
        self.push(buf, id, write);
        if self.len(buf) <= max {
            return true;
        }
        buf.truncate(before);
        self.count -= 1;
        false
    }

    /// Removes the frame (started, with no message) from `buf`.
    pub fn abandon(self, buf: &mut BytesMut) {
        buf.truncate(self.at);
    }

    /// Messages in it so far.
    pub fn count(&self) -> u32 {
        self.count
    }

    /// Bytes of the frame so far, its size prefix included.
    pub fn len(&self, buf: &BytesMut) -> usize {
        buf.len() - self.at
    }

    /// Writes the frame's size and message count.
    pub fn finish(self, buf: &mut BytesMut) {
        let count_at = self.at + 4 + 2 + 2 + 1;
        buf[count_at..count_at + 4].copy_from_slice(&self.count.to_be_bytes());
        finish(buf, self.at);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn server(key: u16, body: &[u8]) -> Vec<u8> {
        let mut v = Vec::new();
        v.extend_from_slice(&((4 + body.len()) as u32).to_be_bytes());
        v.extend_from_slice(&key.to_be_bytes());
        v.extend_from_slice(&VERSION.to_be_bytes());
        v.extend_from_slice(body);
        v
    }

    #[test]
    fn a_publish_frame_holds_its_messages_and_their_count() {
        let mut buf = BytesMut::new();
        let mut f = PublishFrame::start(&mut buf, 7);
        f.push(&mut buf, 0x0102, |b| b.put_slice(b"abc"));
        f.push(&mut buf, 0x0103, |b| b.put_slice(b""));
        assert_eq!(
            f.len(&buf),
            PublishFrame::HEADER + 2 * PublishFrame::PER_MESSAGE + 3
        );
        f.finish(&mut buf);
        let expect: Vec<u8> = [
            &(4 + 1 + 4 + 12 + 3 + 12u32).to_be_bytes()[..],
            &[0, 2, 0, 1, 7],
            &2u32.to_be_bytes(),
            &0x0102u64.to_be_bytes(),
            &3u32.to_be_bytes(),
            b"abc",
            &0x0103u64.to_be_bytes(),
            &0u32.to_be_bytes(),
        ]
        .concat();
        assert_eq!(&buf[..], &expect[..]);
        assert_eq!(frame_len(&buf, 0), Ok(Some(buf.len())));
    }

    #[test]
    fn confirms_errors_and_responses_decode() {
        let mut body = vec![3u8];
        body.extend_from_slice(&2u32.to_be_bytes());
        body.extend_from_slice(&5u64.to_be_bytes());
        body.extend_from_slice(&9u64.to_be_bytes());
        let f = server(PUBLISH_CONFIRM, &body);
        assert_eq!(frame_len(&f, 1024), Ok(Some(f.len())));
        assert_eq!(
            decode(&f),
            Ok(ServerFrame::PublishConfirm {
                publisher: 3,
                ids: vec![5, 9]
            })
        );
        let mut body = vec![0u8];
        body.extend_from_slice(&1u32.to_be_bytes());
        body.extend_from_slice(&5u64.to_be_bytes());
        body.extend_from_slice(&0x12u16.to_be_bytes());
        assert_eq!(
            decode(&server(PUBLISH_ERROR, &body)),
            Ok(ServerFrame::PublishError {
                publisher: 0,
                errors: vec![(5, code::PUBLISHER_DOES_NOT_EXIST)]
            })
        );
        let mut body = 8u32.to_be_bytes().to_vec();
        body.extend_from_slice(&1u16.to_be_bytes());
        body.extend_from_slice(&42u64.to_be_bytes());
        assert_eq!(
            decode(&server(QUERY_PUBLISHER_SEQUENCE | RESPONSE, &body)),
            Ok(ServerFrame::Response {
                key: QUERY_PUBLISHER_SEQUENCE,
                correlation: 8,
                code: code::OK,
                body: ResponseBody::Sequence(42)
            })
        );
    }

    #[test]
    fn metadata_decodes_brokers_and_streams() {
        let mut body = 6u32.to_be_bytes().to_vec();
        body.extend_from_slice(&1u32.to_be_bytes());
        body.extend_from_slice(&0u16.to_be_bytes());
        body.extend_from_slice(&9u16.to_be_bytes());
        body.extend_from_slice(b"127.0.0.1");
        body.extend_from_slice(&5552u32.to_be_bytes());
        body.extend_from_slice(&1u32.to_be_bytes());
        body.extend_from_slice(&1u16.to_be_bytes());
        body.extend_from_slice(b"s");
        body.extend_from_slice(&code::OK.to_be_bytes());
        body.extend_from_slice(&0u16.to_be_bytes());
        body.extend_from_slice(&0u32.to_be_bytes());
        let f = server(METADATA | RESPONSE, &body);
        let ServerFrame::Response {
            code,
            body: ResponseBody::Metadata { brokers, streams },
            ..
        } = decode(&f).unwrap()
        else {
            panic!("not metadata");
        };
        assert_eq!(code, code::OK);
        assert_eq!(brokers, vec![(0, "127.0.0.1".to_owned(), 5552)]);
        assert_eq!(streams[0].name, "s");
    }

    #[test]
    fn hostile_lengths_are_refused_without_allocating() {
        let mut body = vec![0u8];
        body.extend_from_slice(&u32::MAX.to_be_bytes());
        assert!(decode(&server(PUBLISH_CONFIRM, &body)).is_err());
        assert!(frame_len(&[0, 0, 0, 1, 0], 0).is_err());
        assert!(frame_len(&[0, 1, 0, 0], 1024).is_err());
        assert_eq!(frame_len(&[0, 0, 0, 8, 0], 1024), Ok(None));
        let mut body = vec![0u8];
        body.extend_from_slice(&1u32.to_be_bytes());
        body.extend_from_slice(&5u64.to_be_bytes());
        body.push(0); // one byte too many
        assert!(decode(&server(PUBLISH_CONFIRM, &body)).is_err());
    }

    #[test]
    fn a_string_over_the_protocol_limit_appends_nothing() {
        let mut buf = BytesMut::new();
        let long = "x".repeat(40_000);
        assert!(open(&mut buf, 1, &long).is_err());
        assert!(buf.is_empty());
    }
}
