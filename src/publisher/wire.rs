//! AMQP 0-9-1 framing for the publisher: splitting the read buffer into frames, and
//! encoding `basic.publish` with its content header and body frames.
//!
//! Source: AMQP 0-9-1 specification, section 4.2.3 "General Frame Format" (type octet,
//! channel short, payload size long, payload, frame-end octet `0xCE`), 4.2.5.2 "Content
//! Header" and 4.2.6 "Content Body" (a body is split into frames of at most `frame_max`
//! bytes in all, 8 of which are the frame's own header and end). Methods and content
//! headers are encoded and decoded with `amq-protocol`, lapin's own codec; only the
//! `basic.publish` method frame, the one written per message, is laid out here.

use amq_protocol::frame::{gen_frame, parse_frame, AMQPFrame, WriteContext};
use amq_protocol::protocol::basic::gen_properties;
use amq_protocol::protocol::BasicProperties;

/// Frame type octets (section 4.2.3).
pub const FRAME_METHOD: u8 = 1;
/// Content header frame.
pub const FRAME_HEADER: u8 = 2;
/// Content body frame.
pub const FRAME_BODY: u8 = 3;
/// Heartbeat frame.
pub const FRAME_HEARTBEAT: u8 = 8;
/// The octet that ends every frame.
pub const FRAME_END: u8 = 0xCE;
/// Bytes of a frame that are not payload: type (1), channel (2), size (4), end (1).
pub const FRAME_OVERHEAD: usize = 8;
/// The smallest `frame_max` a peer may set (section 4.2.1: `frame-min-size`).
pub const FRAME_MIN_SIZE: u32 = 4096;
/// The class id of `basic`, and the method id of `basic.publish`.
const BASIC_CLASS: u16 = 60;
const BASIC_PUBLISH: u16 = 40;

/// A framing error: the peer is not speaking AMQP 0-9-1 as negotiated.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FrameError {
    /// A frame whose declared payload exceeds the negotiated `frame_max`.
    #[error("RabbitMQ sent a frame of {size} bytes, more than the negotiated frame_max of {frame_max} bytes")]
    TooLarge {
        /// The declared payload size, bytes.
        size: u64,
        /// The negotiated maximum, bytes.
        frame_max: u32,
    },
    /// A frame not ended by `0xCE`.
    #[error("RabbitMQ sent a frame that does not end with 0xCE (got {0:#04x}): the stream is out of step")]
    BadEnd(u8),
    /// A frame amq-protocol cannot decode.
    #[error("RabbitMQ sent a frame that cannot be decoded: {0}")]
    Undecodable(String),
}

/// The length of the first complete frame in `buf`, or `None` when more bytes are needed.
///
/// # Errors
/// [`FrameError::TooLarge`] when the declared size exceeds `frame_max` (checked before
/// anything is buffered for it), [`FrameError::BadEnd`].
pub fn frame_len(buf: &[u8], frame_max: u32) -> Result<Option<usize>, FrameError> {
    let Some(header) = buf.get(..7) else {
        return Ok(None);
    };
    let size = u32::from_be_bytes([header[3], header[4], header[5], header[6]]);
    if u64::from(size) + FRAME_OVERHEAD as u64 > u64::from(frame_max.max(FRAME_MIN_SIZE)) {
        return Err(FrameError::TooLarge {
            size: u64::from(size),
            frame_max,
        });
    }
    let total = size as usize + FRAME_OVERHEAD;
    match buf.get(total - 1) {
        None => Ok(None),
        Some(&FRAME_END) => Ok(Some(total)),
        Some(&other) => Err(FrameError::BadEnd(other)),
    }
}

/// Decodes one complete frame (as delimited by [`frame_len`]).
///
/// # Errors
/// [`FrameError::Undecodable`].
pub fn decode(frame: &[u8]) -> Result<AMQPFrame, FrameError> {
    match parse_frame(frame) {
        Ok((_, frame)) => Ok(frame),
        Err(e) => Err(FrameError::Undecodable(format!("{e:?}"))),
    }
}

/// Appends one frame (a method, a heartbeat) encoded by amq-protocol to `out`.
///
/// # Errors
/// amq-protocol's generation error, rendered (never expected for a `Vec`).
pub fn encode(out: &mut Vec<u8>, frame: &AMQPFrame) -> Result<(), String> {
    let buf = std::mem::take(out);
    match gen_frame(frame)(WriteContext::from(buf)) {
        Ok(ctx) => {
            *out = ctx.into_inner().0;
            Ok(())
        }
        Err(e) => Err(format!("could not encode {frame}: {e:?}")),
    }
}

/// One `basic.publish` to encode (AMQP 0-9-1 section 1.8.3.7): `exchange` and
/// `routing_key` are at most 255 bytes (short strings).
#[derive(Debug, Clone, Copy)]
pub struct Publish<'a> {
    /// The channel to publish on.
    pub channel: u16,
    /// The exchange name.
    pub exchange: &'a str,
    /// The routing key.
    pub routing_key: &'a str,
    /// Return the message (`basic.return`) when no queue is bound for it.
    pub mandatory: bool,
    /// The content header's properties.
    pub properties: &'a BasicProperties,
    /// The body, sent byte-exact.
    pub body: &'a [u8],
}

/// Appends `publish`'s method frame, its content header and its body split into frames of
/// at most `frame_max` bytes, to `out`.
///
/// # Errors
/// A text when the content header alone exceeds `frame_max` (the message cannot be sent
/// on this connection), or when a name exceeds 255 bytes; `out` is left as it was.
pub fn encode_publish(
    out: &mut Vec<u8>,
    publish: &Publish<'_>,
    frame_max: u32,
) -> Result<(), String> {
    let start = out.len();
    let result = encode_publish_unchecked(out, publish, frame_max);
    if result.is_err() {
        out.truncate(start);
    }
    result
}

fn encode_publish_unchecked(
    out: &mut Vec<u8>,
    publish: &Publish<'_>,
    frame_max: u32,
) -> Result<(), String> {
    let Publish {
        channel,
        exchange,
        routing_key,
        mandatory,
        properties,
        body,
    } = *publish;
    let (Ok(exchange_len), Ok(key_len)) = (
        u8::try_from(exchange.len()),
        u8::try_from(routing_key.len()),
    ) else {
        return Err("the exchange or routing key is longer than 255 bytes".into());
    };
    // basic.publish: class, method, reserved-1 (short), exchange, routing-key (short
    // strings), bits (mandatory = bit 0, immediate = bit 1).
    let payload = 2 + 2 + 2 + 1 + exchange.len() + 1 + routing_key.len() + 1;
    out.push(FRAME_METHOD);
    out.extend_from_slice(&channel.to_be_bytes());
    out.extend_from_slice(&(payload as u32).to_be_bytes());
    out.extend_from_slice(&BASIC_CLASS.to_be_bytes());
    out.extend_from_slice(&BASIC_PUBLISH.to_be_bytes());
    out.extend_from_slice(&0u16.to_be_bytes());
    out.push(exchange_len);
    out.extend_from_slice(exchange.as_bytes());
    out.push(key_len);
    out.extend_from_slice(routing_key.as_bytes());
    out.push(u8::from(mandatory));
    out.push(FRAME_END);

    // Content header: class, weight (0), body size (long long), properties.
    let header_start = out.len();
    out.push(FRAME_HEADER);
    out.extend_from_slice(&channel.to_be_bytes());
    out.extend_from_slice(&0u32.to_be_bytes());
    out.extend_from_slice(&BASIC_CLASS.to_be_bytes());
    out.extend_from_slice(&0u16.to_be_bytes());
    out.extend_from_slice(&(body.len() as u64).to_be_bytes());
    let buf = std::mem::take(out);
    *out = match gen_properties(properties)(WriteContext::from(buf)) {
        Ok(ctx) => ctx.into_inner().0,
        Err(e) => return Err(format!("could not encode the message properties: {e:?}")),
    };
    let header_payload = out.len() - header_start - 7;
    if header_payload + FRAME_OVERHEAD > frame_max as usize {
        return Err(format!(
            "the message's properties and headers take {header_payload} bytes, more than the broker's frame_max of {frame_max} bytes allows in one content header frame"
        ));
    }
    out[header_start + 3..header_start + 7].copy_from_slice(&(header_payload as u32).to_be_bytes());
    out.push(FRAME_END);

    // Body frames, each at most frame_max bytes in all.
    let chunk = (frame_max as usize).saturating_sub(FRAME_OVERHEAD).max(1);
    for part in body.chunks(chunk) {
        out.push(FRAME_BODY);
        out.extend_from_slice(&channel.to_be_bytes());
        out.extend_from_slice(&(part.len() as u32).to_be_bytes());
        out.extend_from_slice(part);
        out.push(FRAME_END);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use amq_protocol::frame::AMQPFrame;
    use amq_protocol::protocol::{basic, AMQPClass};
    use amq_protocol::types::{AMQPValue, FieldTable, LongString};

    fn frames(mut buf: &[u8]) -> Vec<AMQPFrame> {
        let mut out = Vec::new();
        while let Some(n) = frame_len(buf, 1 << 20).expect("framing") {
            out.push(decode(&buf[..n]).expect("decodes"));
            buf = &buf[n..];
        }
        assert!(buf.is_empty(), "no trailing bytes");
        out
    }

    #[test]
    fn publish_round_trips_through_amq_protocol_and_splits_the_body_at_frame_max() {
        let mut headers = FieldTable::default();
        headers.insert(
            "x-pgoutbox-lsn".into(),
            AMQPValue::LongString(LongString::from("0/16B3748")),
        );
        let props = BasicProperties::default()
            .with_message_id("id-1".into())
            .with_delivery_mode(2)
            .with_headers(headers);
        let body: Vec<u8> = (0..10_000u32).map(|i| i as u8).collect();
        let mut out = Vec::new();
        let publish = Publish {
            channel: 1,
            exchange: "outbox",
            routing_key: "orders.created",
            mandatory: true,
            properties: &props,
            body: &body,
        };
        encode_publish(&mut out, &publish, 4096).expect("encodes");
        let frames = frames(&out);
        assert_eq!(
            frames.len(),
            2 + 3,
            "method, header, 3 body frames of <= 4088 bytes"
        );
        match &frames[0] {
            AMQPFrame::Method(1, AMQPClass::Basic(basic::AMQPMethod::Publish(p))) => {
                assert_eq!(p.exchange.as_str(), "outbox");
                assert_eq!(p.routing_key.as_str(), "orders.created");
                assert!(p.mandatory);
                assert!(!p.immediate);
            }
            other => panic!("not basic.publish: {other:?}"),
        }
        match &frames[1] {
            AMQPFrame::Header(1, h) => {
                assert_eq!(h.class_id, 60);
                assert_eq!(h.body_size, 10_000);
                assert_eq!(h.properties, props);
            }
            other => panic!("not a content header: {other:?}"),
        }
        let mut joined = Vec::new();
        for f in &frames[2..] {
            match f {
                AMQPFrame::Body(1, part) => {
                    assert!(part.len() + FRAME_OVERHEAD <= 4096);
                    joined.extend_from_slice(part);
                }
                other => panic!("not a body frame: {other:?}"),
            }
        }
        assert_eq!(joined, body);
    }

    #[test]
    fn an_empty_body_sends_no_body_frame() {
        let mut out = Vec::new();
        let props = BasicProperties::default();
        let publish = Publish {
            channel: 1,
            exchange: "",
            routing_key: "k",
            mandatory: false,
            properties: &props,
            body: b"",
        };
        encode_publish(&mut out, &publish, 4096).unwrap();
        assert_eq!(frames(&out).len(), 2);
    }

    #[test]
    fn a_header_over_frame_max_is_refused_and_leaves_the_buffer_unchanged() {
        let mut headers = FieldTable::default();
        headers.insert(
            "big".into(),
            AMQPValue::LongString(LongString::from("x".repeat(5000))),
        );
        let props = BasicProperties::default().with_headers(headers);
        let mut out = vec![1, 2, 3];
        let publish = Publish {
            channel: 1,
            exchange: "x",
            routing_key: "k",
            mandatory: true,
            properties: &props,
            body: b"b",
        };
        let e = encode_publish(&mut out, &publish, 4096).unwrap_err();
        assert!(e.contains("frame_max of 4096"), "{e}");
        assert_eq!(out, vec![1, 2, 3]);
    }

    #[test]
    fn framing_waits_for_whole_frames_and_refuses_oversized_or_unterminated_ones() {
        let mut hb = Vec::new();
        encode(&mut hb, &AMQPFrame::Heartbeat).unwrap();
        assert_eq!(hb, [FRAME_HEARTBEAT, 0, 0, 0, 0, 0, 0, FRAME_END]);
        assert_eq!(frame_len(&hb[..5], 4096), Ok(None));
        assert_eq!(frame_len(&hb[..7], 4096), Ok(None));
        assert_eq!(frame_len(&hb, 4096), Ok(Some(8)));
        let mut bad = hb.clone();
        bad[7] = 0;
        assert_eq!(frame_len(&bad, 4096), Err(FrameError::BadEnd(0)));
        let huge = [FRAME_BODY, 0, 1, 0xFF, 0xFF, 0xFF, 0xFF];
        assert!(matches!(
            frame_len(&huge, 131_072),
            Err(FrameError::TooLarge { .. })
        ));
    }
}
