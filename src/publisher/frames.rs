//! The publisher's frame side: splitting what was read into frames, and what each frame
//! from the broker does (confirms, returns, closes, blocking, the declaring channel).
//!
//! Source: AMQP 0-9-1 `basic.ack`/`basic.nack` (with `multiple`), `basic.return` and its
//! content header and body, `channel.close`, `connection.close`; RabbitMQ's
//! `connection.blocked`/`unblocked`.

use std::str::FromStr;
use std::sync::atomic::Ordering;

use amq_protocol::frame::AMQPFrame;
use amq_protocol::protocol::basic;
use amq_protocol::protocol::{channel, connection as conn, AMQPClass, BasicProperties};
use amq_protocol::types::AMQPValue;

use super::confirms::{ReturnedKey, Violation};
use super::exchanges::DECLARE_CHANNEL;
use super::{wire, Publisher, Returning, State, CHANNEL, MATCH_KEY_HEADER};
use crate::lsn::Lsn;
use crate::sink::FailureCause;

impl<T> Publisher<T> {
    /// Handles every complete frame in the read buffer (until the connection fails).
    pub(super) fn handle_frames(&mut self) {
        while matches!(self.state, State::Open) {
            let buf = &self.inbuf[self.in_start..self.in_end];
            let len = match wire::frame_len(buf, self.frame_max) {
                Ok(Some(len)) => len,
                Ok(None) => break,
                Err(e) => {
                    self.fail(FailureCause::ProtocolViolation(e.to_string()));
                    break;
                }
            };
            let frame = wire::decode(&buf[..len]);
            self.in_start += len;
            match frame {
                Ok(frame) => self.handle_frame(frame),
                Err(e) => self.fail(FailureCause::ProtocolViolation(e.to_string())),
            }
        }
        // A frame larger than what is left of the buffer: make room for it.
        if self.in_start > 0 && self.in_end == self.inbuf.len() {
            self.inbuf.copy_within(self.in_start..self.in_end, 0);
            self.in_end -= self.in_start;
            self.in_start = 0;
        }
    }

    fn handle_frame(&mut self, frame: AMQPFrame) {
        match frame {
            AMQPFrame::Heartbeat => {}
            // Producer-named exchanges are declared on their own channel (exchanges.rs):
            // its replies, a refusal's channel.close included, concern nothing else.
            AMQPFrame::Method(DECLARE_CHANNEL, method) => self.on_declare_channel(method),
            AMQPFrame::Method(channel, AMQPClass::Basic(method)) => self.on_basic(channel, method),
            AMQPFrame::Header(CHANNEL, header) => {
                self.on_content_header(header.body_size, &header.properties)
            }
            AMQPFrame::Body(CHANNEL, part) => self.on_content_body(part.len() as u64),
            AMQPFrame::Header(channel, _) => {
                self.violate(wrong_channel("a content header", channel))
            }
            AMQPFrame::Body(channel, _) => self.violate(wrong_channel("a content body", channel)),
            AMQPFrame::Method(_, AMQPClass::Channel(channel::AMQPMethod::Close(close))) => {
                let ok = AMQPFrame::Method(
                    CHANNEL,
                    AMQPClass::Channel(channel::AMQPMethod::CloseOk(channel::CloseOk {})),
                );
                let _ = wire::encode(&mut self.out, &ok);
                self.fail(FailureCause::ChannelClosed {
                    reply_code: close.reply_code,
                    reply_text: close.reply_text.as_str().to_owned(),
                    class_id: close.class_id,
                    method_id: close.method_id,
                });
            }
            AMQPFrame::Method(_, AMQPClass::Connection(conn::AMQPMethod::Close(close))) => {
                let ok = AMQPFrame::Method(
                    0,
                    AMQPClass::Connection(conn::AMQPMethod::CloseOk(conn::CloseOk {})),
                );
                let _ = wire::encode(&mut self.out, &ok);
                self.fail(FailureCause::ConnectionClosed {
                    reply_code: close.reply_code,
                    reply_text: close.reply_text.as_str().to_owned(),
                });
            }
            AMQPFrame::Method(_, AMQPClass::Connection(conn::AMQPMethod::Blocked(b))) => {
                self.on_blocked(Some(b.reason.as_str()));
            }
            AMQPFrame::Method(_, AMQPClass::Connection(conn::AMQPMethod::Unblocked(_))) => {
                self.on_blocked(None);
            }
            other => {
                tracing::debug!(frame = %other, "ignoring a frame the publisher does not use");
            }
        }
    }

    /// A method on the declaring channel: the exchanges' state machine answers it, and
    /// releases the messages it held.
    fn on_declare_channel(&mut self, method: AMQPClass) {
        let mut released = std::mem::take(&mut self.released);
        let r = self
            .exchanges
            .on_method(method, &mut self.out, &mut released);
        self.release(&mut released);
        self.released = released;
        if let Err(e) = r {
            self.fail(FailureCause::ProtocolViolation(e));
        }
    }

    /// `basic.ack`, `basic.nack` (settled by [`super::confirms`]) and `basic.return` (its
    /// header and body follow).
    fn on_basic(&mut self, channel: u16, method: basic::AMQPMethod) {
        if channel != CHANNEL {
            let what = match method {
                basic::AMQPMethod::Ack(_) => "basic.ack",
                basic::AMQPMethod::Nack(_) => "basic.nack",
                basic::AMQPMethod::Return(_) => "basic.return",
                _ => "a basic method",
            };
            self.violate(wrong_channel(what, channel));
            return;
        }
        let settled = match method {
            basic::AMQPMethod::Ack(ack) => {
                self.confirms
                    .ack(ack.delivery_tag, ack.multiple, &mut self.ready)
            }
            basic::AMQPMethod::Nack(nack) => {
                self.confirms
                    .nack(nack.delivery_tag, nack.multiple, &mut self.ready)
            }
            basic::AMQPMethod::Return(ret) => {
                self.returning = Some(Returning {
                    reply_code: ret.reply_code,
                    reply_text: ret.reply_text.as_str().to_owned(),
                    body_left: None,
                });
                Ok(())
            }
            other => {
                let frame = AMQPFrame::Method(channel, AMQPClass::Basic(other));
                tracing::debug!(frame = %frame, "ignoring a frame the publisher does not use");
                Ok(())
            }
        };
        if let Err(v) = settled {
            self.violate(v);
        }
    }

    /// The content header of a `basic.return`: the returned message's keys mark the
    /// unsettled publish it returns.
    fn on_content_header(&mut self, body_size: u64, properties: &BasicProperties) {
        let Some(returning) = self.returning.as_mut() else {
            self.fail(FailureCause::ProtocolViolation(
                "RabbitMQ sent a content header that belongs to no basic.return".into(),
            ));
            return;
        };
        let key = returned_key(properties);
        let key = ReturnedKey {
            lsn: key.0,
            message_id: key.1.as_deref(),
        };
        let (code, text) = (returning.reply_code, returning.reply_text.clone());
        if body_size == 0 {
            self.returning = None;
        } else {
            returning.body_left = Some(body_size);
        }
        match self.confirms.returned(key, code, &text) {
            Ok(marked) => {
                tracing::debug!(reply_code = code, reply_text = %text, marked, "basic.return recorded");
            }
            Err(v) => self.violate(v),
        }
    }

    /// A content body frame of `len` bytes: skipped, it belongs to a `basic.return`.
    fn on_content_body(&mut self, len: u64) {
        match self.returning.as_mut() {
            Some(Returning {
                body_left: Some(left),
                ..
            }) => {
                *left = left.saturating_sub(len);
                if *left == 0 {
                    self.returning = None;
                }
            }
            _ => self.fail(FailureCause::ProtocolViolation(
                "RabbitMQ sent a content body that belongs to no basic.return".into(),
            )),
        }
    }

    /// `connection.blocked` (with its reason) or `connection.unblocked` (`None`); each start
    /// and end is logged once.
    fn on_blocked(&mut self, reason: Option<&str>) {
        match reason {
            Some(reason) => {
                if !self.blocked {
                    tracing::warn!(reason = %reason, "RabbitMQ blocked the connection (connection.blocked: memory or disk alarm); publishes wait until it clears, nothing unconfirmed is acknowledged");
                }
            }
            None => {
                if self.blocked {
                    tracing::info!("RabbitMQ unblocked the connection (connection.unblocked); publishing resumes");
                }
            }
        }
        self.blocked = reason.is_some();
        self.signals.blocked.store(self.blocked, Ordering::Relaxed);
    }

    /// The connection or channel failed: report every unsettled publish as failed. A
    /// close's reply (queued close-ok first) or the socket's error is the cause.
    pub(super) fn fail(&mut self, cause: FailureCause) {
        if !matches!(self.state, State::Open) {
            return;
        }
        self.confirms.fail_all(&cause, &mut self.ready);
        self.exchanges.fail_all(&cause, &mut self.ready);
        self.signals.lost.store(true, Ordering::Relaxed);
        self.state = State::Failed(cause.to_string());
    }

    /// The broker broke the settling rule: settle nothing more, hand out nothing more.
    fn violate(&mut self, violation: Violation) {
        if !matches!(self.state, State::Open) {
            return;
        }
        tracing::error!(error = %violation, unsettled = self.confirms.unsettled(), "RabbitMQ broke the publisher-confirm protocol; acknowledging nothing more on this connection");
        self.ready.clear();
        self.signals.lost.store(true, Ordering::Relaxed);
        self.state = State::Violated(violation.to_string());
    }
}

/// A frame of the settling protocol on a channel other than the publishing one.
fn wrong_channel(what: &'static str, channel: u16) -> Violation {
    Violation::WrongChannel {
        what,
        channel,
        expected: CHANNEL,
    }
}

/// The keys a returned message carries: our LSN header, parsed, and its message id.
fn returned_key(properties: &BasicProperties) -> (Option<Lsn>, Option<String>) {
    let lsn = properties
        .headers()
        .as_ref()
        .and_then(|h| h.inner().get(MATCH_KEY_HEADER))
        .and_then(|v| match v {
            AMQPValue::LongString(s) => std::str::from_utf8(s.as_bytes()).ok().map(str::to_owned),
            AMQPValue::ShortString(s) => Some(s.as_str().to_owned()),
            _ => None,
        })
        .and_then(|s| Lsn::from_str(&s).ok());
    let message_id = properties
        .message_id()
        .as_ref()
        .map(|s| s.as_str().to_owned());
    (lsn, message_id)
}
