//! Exchanges named by producers: declared (or checked) on first use per connection, on a
//! channel of their own, before any message for them is published.
//!
//! ```text
//!  publish(m) ── exchange known? ──yes──▶ encoded now (channel 1)
//!                   │ no (or messages already held)
//!                   ▼
//!               held, in order ──▶ channel 2: channel.open, exchange.declare
//!                   ▲                 │ declare-ok: known; held messages go out in order
//!                   │                 │ channel.close 404/406/403: the message naming it
//!                   └─────────────────┘   is refused (never published); close-ok; next
//! ```
//!
//! Why a second channel: a refused `exchange.declare` closes the channel it was sent on
//! (AMQP 0-9-1 section 1.4.2.5, RabbitMQ's channel-level exceptions). On the publishing
//! channel that would fail every unconfirmed publish, and after the reconnect the same
//! declare would fail again: a loop. On channel [`DECLARE_CHANNEL`] only the declare is
//! lost, the message naming the exchange is settled as
//! [`PublishOutcome::ExchangeRefused`] (the pipeline dead-letters it), and publishing goes
//! on. Exchanges are vhost-wide, so once `declare-ok` arrived on channel 2, a publish on
//! channel 1 finds the exchange.
//!
//! Order: while one message waits for its exchange, every later message waits behind it
//! (in the order given), so delivery tags stay in the caller's order. A declaration costs
//! one round trip per exchange per connection (two for the first, with `channel.open`);
//! the set of known exchanges belongs to the connection and starts afresh after a
//! reconnect or a failover to another node. A refusal is not remembered: the next message
//! naming that exchange declares it again (it may have been created meanwhile).
//!
//! Sans-IO: frames out go into the caller's write buffer, frames in come from the
//! caller's reader; nothing here touches the socket.

use std::collections::{HashSet, VecDeque};

use amq_protocol::frame::AMQPFrame;
use amq_protocol::protocol::{channel, exchange, AMQPClass};
use amq_protocol::types::{FieldTable, ShortString};

use super::connection::Declare;
use super::message::{Exchange, OutboundMessage};
use super::wire;
use crate::sink::{FailureCause, PublishOutcome, SinkFailure};

/// The channel exchange declarations are sent on (publishing uses
/// [`super::CHANNEL`]).
pub const DECLARE_CHANNEL: u16 = 2;

/// The state of [`DECLARE_CHANNEL`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ChannelState {
    /// Not open (never opened, or closed by the broker after a refused declare).
    Closed,
    /// `channel.open` sent, `open-ok` awaited.
    Opening,
    /// Open; a declare may be sent.
    Open,
}

/// What became of a held message once its turn came.
// Transient: it lives only between `admit`/`on_method` and the publisher's `release`, in a
// reused Vec, so boxing the large variant would cost an allocation for nothing.
#[allow(clippy::large_enum_variant)]
#[derive(Debug)]
pub enum Released<T> {
    /// Its exchange is known now: encode and publish it.
    Publish(OutboundMessage<T>),
    /// Its exchange was refused: settle it with this outcome, never publish it.
    Refused(T, PublishOutcome),
}

/// Exchanges known on this connection, and messages held until theirs is.
#[derive(Debug)]
pub struct Exchanges<T> {
    declare: Declare,
    /// Declared (or checked) on this connection; the configured exchange from the start.
    known: HashSet<String>,
    channel: ChannelState,
    /// The exchange whose `exchange.declare` was sent and not yet answered.
    declaring: Option<ShortString>,
    /// Messages waiting, in the order given.
    held: VecDeque<OutboundMessage<T>>,
    /// The negotiated `channel_max` (0: no limit).
    channel_max: u16,
}

impl<T> Exchanges<T> {
    /// `configured` (declared when the connection opened) is known from the start;
    /// `declare` says how the others are declared; `channel_max` is the negotiated limit
    /// (0: none).
    pub fn new(configured: &str, declare: Declare, channel_max: u16) -> Self {
        Exchanges {
            declare,
            known: HashSet::from([configured.to_owned()]),
            channel: ChannelState::Closed,
            declaring: None,
            held: VecDeque::new(),
            channel_max,
        }
    }

    /// Messages held, waiting for an exchange declaration.
    pub fn held(&self) -> usize {
        self.held.len()
    }

    /// Takes `message`: `Some` when it may be published now (its exchange is known and
    /// nothing is held before it), else it is held (and a declaration started, frames
    /// appended to `out`) or, when this connection cannot declare at all, refused into
    /// `released`.
    pub fn admit(
        &mut self,
        message: OutboundMessage<T>,
        out: &mut Vec<u8>,
        released: &mut Vec<Released<T>>,
    ) -> Option<OutboundMessage<T>> {
        if self.held.is_empty() && self.is_known(&message.exchange) {
            return Some(message);
        }
        self.held.push_back(message);
        self.advance(out, released);
        None
    }

    /// Handles a method the broker sent on [`DECLARE_CHANNEL`]; replies go into `out`,
    /// messages whose turn came into `released` (in order).
    ///
    /// # Errors
    /// A text naming the method when it does not fit the channel's state (the broker broke
    /// the protocol; the caller fails the connection).
    pub fn on_method(
        &mut self,
        method: AMQPClass,
        out: &mut Vec<u8>,
        released: &mut Vec<Released<T>>,
    ) -> Result<(), String> {
        match method {
            AMQPClass::Channel(channel::AMQPMethod::OpenOk(_))
                if self.channel == ChannelState::Opening =>
            {
                self.channel = ChannelState::Open;
            }
            AMQPClass::Exchange(exchange::AMQPMethod::DeclareOk(_))
                if self.declaring.is_some() && self.channel == ChannelState::Open =>
            {
                if let Some(name) = self.declaring.take() {
                    tracing::debug!(exchange = %name.as_str(), passive = self.declare == Declare::Passive, "exchange declared for producer-named messages");
                    self.known.insert(name.as_str().to_owned());
                }
            }
            AMQPClass::Channel(channel::AMQPMethod::Close(close))
                if self.channel != ChannelState::Closed =>
            {
                let ok = AMQPFrame::Method(
                    DECLARE_CHANNEL,
                    AMQPClass::Channel(channel::AMQPMethod::CloseOk(channel::CloseOk {})),
                );
                wire::encode(out, &ok)?;
                self.channel = ChannelState::Closed;
                let reply_text = close.reply_text.as_str().to_owned();
                // The declare (or the open before it) was refused: so is the message at
                // the front, the one that named the exchange.
                let declaring = self.declaring.take();
                if let Some(front) = self.held.pop_front() {
                    let exchange = match (&declaring, &front.exchange) {
                        (Some(name), _) | (None, Exchange::Named(name)) => {
                            name.as_str().to_owned()
                        }
                        (None, Exchange::Configured) => String::new(),
                    };
                    tracing::warn!(exchange = %exchange, reply_code = close.reply_code, reply_text = %reply_text, "RabbitMQ refused a producer-named exchange; its message is not published");
                    released.push(Released::Refused(
                        front.tag,
                        PublishOutcome::ExchangeRefused {
                            exchange,
                            reply_code: close.reply_code,
                            reply_text,
                        },
                    ));
                }
            }
            other => {
                return Err(format!(
                    "RabbitMQ sent {other:?} on the exchange-declaring channel {DECLARE_CHANNEL}, which does not fit its state ({:?}, declaring {:?})",
                    self.channel,
                    self.declaring.as_ref().map(ShortString::as_str)
                ))
            }
        }
        self.advance(out, released);
        Ok(())
    }

    /// The connection failed: every held message is settled as failed (outcome unknown
    /// for none of them, but treated like the unconfirmed ones: published again by the
    /// next session).
    pub fn fail_all(&mut self, cause: &FailureCause, ready: &mut Vec<(T, PublishOutcome)>) {
        for m in self.held.drain(..) {
            ready.push((
                m.tag,
                PublishOutcome::Failed(SinkFailure::new(cause.clone())),
            ));
        }
    }

    fn is_known(&self, exchange: &Exchange) -> bool {
        match exchange {
            Exchange::Configured => true,
            Exchange::Named(name) => self.known.contains(name.as_str()),
        }
    }

    /// Releases held messages whose exchange is known, from the front, and starts the
    /// declaration the next one needs.
    fn advance(&mut self, out: &mut Vec<u8>, released: &mut Vec<Released<T>>) {
        while let Some(front) = self.held.front() {
            if self.is_known(&front.exchange) {
                if let Some(m) = self.held.pop_front() {
                    released.push(Released::Publish(m));
                }
                continue;
            }
            if self.declaring.is_some() {
                return;
            }
            let Exchange::Named(name) = &front.exchange else {
                return;
            };
            if self.channel_max == 1 {
                let exchange = name.as_str().to_owned();
                if let Some(m) = self.held.pop_front() {
                    released.push(Released::Refused(
                        m.tag,
                        PublishOutcome::ExchangeRefused {
                            exchange,
                            reply_code: 504,
                            reply_text: "the broker allows one channel per connection (channel_max 1); pgoutbox declares producer-named exchanges on a second channel: raise channel_max".into(),
                        },
                    ));
                }
                continue;
            }
            match self.channel {
                ChannelState::Closed => {
                    let open = AMQPFrame::Method(
                        DECLARE_CHANNEL,
                        AMQPClass::Channel(channel::AMQPMethod::Open(channel::Open {})),
                    );
                    // Encoding a method into a Vec does not fail.
                    let _ = wire::encode(out, &open);
                    self.channel = ChannelState::Opening;
                    return;
                }
                ChannelState::Opening => return,
                ChannelState::Open => {
                    let name = name.clone();
                    let declare = AMQPFrame::Method(
                        DECLARE_CHANNEL,
                        AMQPClass::Exchange(exchange::AMQPMethod::Declare(exchange::Declare {
                            exchange: name.clone(),
                            kind: ShortString::from("topic"),
                            passive: self.declare == Declare::Passive,
                            durable: true,
                            auto_delete: false,
                            internal: false,
                            nowait: false,
                            arguments: FieldTable::default(),
                        })),
                    );
                    let _ = wire::encode(out, &declare);
                    self.declaring = Some(name);
                    return;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use amq_protocol::protocol::BasicProperties;
    use bytes::Bytes;

    use crate::publisher::MatchKey;

    fn message(tag: u32, exchange: Option<&str>) -> OutboundMessage<u32> {
        OutboundMessage {
            tag,
            exchange: match exchange {
                None => Exchange::Configured,
                Some(n) => Exchange::Named(ShortString::from(n)),
            },
            routing_key: ShortString::from("t"),
            body: Bytes::new(),
            properties: BasicProperties::default(),
            match_key: MatchKey::MessageId(ShortString::from(format!("m{tag}"))),
        }
    }

    /// The methods encoded in `out` (cleared), with their channel.
    fn frames(out: &mut Vec<u8>) -> Vec<(u16, AMQPClass)> {
        let mut got = Vec::new();
        let mut at = 0;
        while let Some(n) = wire::frame_len(&out[at..], 131_072).unwrap() {
            match wire::decode(&out[at..at + n]).unwrap() {
                AMQPFrame::Method(ch, m) => got.push((ch, m)),
                other => panic!("unexpected frame {other:?}"),
            }
            at += n;
        }
        assert_eq!(at, out.len(), "a partial frame");
        out.clear();
        got
    }

    fn tags(released: &mut Vec<Released<u32>>) -> Vec<String> {
        released
            .drain(..)
            .map(|r| match r {
                Released::Publish(m) => format!("publish {}", m.tag),
                Released::Refused(tag, o) => format!("refused {tag}: {o}"),
            })
            .collect()
    }

    fn open_ok() -> AMQPClass {
        AMQPClass::Channel(channel::AMQPMethod::OpenOk(channel::OpenOk {}))
    }

    fn declare_ok() -> AMQPClass {
        AMQPClass::Exchange(exchange::AMQPMethod::DeclareOk(exchange::DeclareOk {}))
    }

    fn close(code: u16, text: &str) -> AMQPClass {
        AMQPClass::Channel(channel::AMQPMethod::Close(channel::Close {
            reply_code: code,
            reply_text: ShortString::from(text),
            class_id: 40,
            method_id: 10,
        }))
    }

    #[test]
    fn known_exchanges_pass_straight_through() {
        let mut x = Exchanges::new("events", Declare::DurableTopic, 2047);
        let (mut out, mut rel) = (Vec::new(), Vec::new());
        assert!(x.admit(message(1, None), &mut out, &mut rel).is_some());
        assert!(x
            .admit(message(2, Some("events")), &mut out, &mut rel)
            .is_some());
        assert!(out.is_empty() && rel.is_empty());
    }

    #[test]
    fn a_new_exchange_is_declared_on_channel_2_durable_topic_and_holds_later_messages() {
        let mut x = Exchanges::new("events", Declare::DurableTopic, 2047);
        let (mut out, mut rel) = (Vec::new(), Vec::new());
        assert!(x
            .admit(message(1, Some("billing")), &mut out, &mut rel)
            .is_none());
        // Held behind it, though its exchange is known: order is kept.
        assert!(x.admit(message(2, None), &mut out, &mut rel).is_none());
        assert_eq!(x.held(), 2);
        let sent = frames(&mut out);
        assert!(
            matches!(
                sent.as_slice(),
                [(2, AMQPClass::Channel(channel::AMQPMethod::Open(_)))]
            ),
            "{sent:?}"
        );
        x.on_method(open_ok(), &mut out, &mut rel).unwrap();
        let sent = frames(&mut out);
        match sent.as_slice() {
            [(2, AMQPClass::Exchange(exchange::AMQPMethod::Declare(d)))] => {
                assert_eq!(d.exchange.as_str(), "billing");
                assert_eq!(d.kind.as_str(), "topic");
                assert!(d.durable && !d.passive && !d.auto_delete && !d.internal && !d.nowait);
            }
            other => panic!("{other:?}"),
        }
        assert!(rel.is_empty());
        x.on_method(declare_ok(), &mut out, &mut rel).unwrap();
        assert_eq!(tags(&mut rel), ["publish 1", "publish 2"]);
        assert!(out.is_empty());
        // Known now: no declaration the second time, on an open channel.
        assert!(x
            .admit(message(3, Some("billing")), &mut out, &mut rel)
            .is_some());
        // Another new one: the channel is open, so just the declare.
        assert!(x
            .admit(message(4, Some("audit")), &mut out, &mut rel)
            .is_none());
        assert!(matches!(
            frames(&mut out).as_slice(),
            [(2, AMQPClass::Exchange(exchange::AMQPMethod::Declare(_)))]
        ));
    }

    #[test]
    fn a_refused_declare_refuses_only_its_message_and_the_channel_is_reopened_for_the_next() {
        let mut x = Exchanges::new("events", Declare::Passive, 0);
        let (mut out, mut rel) = (Vec::new(), Vec::new());
        x.admit(message(1, Some("missing")), &mut out, &mut rel);
        x.admit(message(2, None), &mut out, &mut rel);
        x.admit(message(3, Some("other")), &mut out, &mut rel);
        x.admit(message(4, None), &mut out, &mut rel);
        frames(&mut out);
        x.on_method(open_ok(), &mut out, &mut rel).unwrap();
        match frames(&mut out).as_slice() {
            [(2, AMQPClass::Exchange(exchange::AMQPMethod::Declare(d)))] => {
                assert!(d.passive, "--no-declare checks only");
                assert_eq!(d.exchange.as_str(), "missing");
            }
            other => panic!("{other:?}"),
        }
        let text = "NOT_FOUND - no exchange 'missing' in vhost '/'";
        x.on_method(close(404, text), &mut out, &mut rel).unwrap();
        assert_eq!(
            tags(&mut rel),
            [
                format!("refused 1: not published: exchange \"missing\" was refused (404 {text})"),
                "publish 2".to_owned()
            ]
        );
        // close-ok for the broker's close, then channel.open again for "other".
        let sent = frames(&mut out);
        assert!(
            matches!(
                sent.as_slice(),
                [
                    (2, AMQPClass::Channel(channel::AMQPMethod::CloseOk(_))),
                    (2, AMQPClass::Channel(channel::AMQPMethod::Open(_)))
                ]
            ),
            "{sent:?}"
        );
        x.on_method(open_ok(), &mut out, &mut rel).unwrap();
        frames(&mut out);
        x.on_method(declare_ok(), &mut out, &mut rel).unwrap();
        assert_eq!(tags(&mut rel), ["publish 3", "publish 4"]);
        assert_eq!(x.held(), 0);
        // A refusal is not remembered: "missing" is declared again next time.
        assert!(x
            .admit(message(5, Some("missing")), &mut out, &mut rel)
            .is_none());
        assert!(matches!(
            frames(&mut out).as_slice(),
            [(2, AMQPClass::Exchange(exchange::AMQPMethod::Declare(_)))]
        ));
    }

    #[test]
    fn unexpected_methods_on_channel_2_are_errors_and_a_failure_fails_held_messages() {
        let mut x = Exchanges::new("events", Declare::DurableTopic, 0);
        let (mut out, mut rel) = (Vec::new(), Vec::new());
        assert!(x.on_method(declare_ok(), &mut out, &mut rel).is_err());
        x.admit(message(1, Some("b")), &mut out, &mut rel);
        x.admit(message(2, None), &mut out, &mut rel);
        assert!(
            x.on_method(declare_ok(), &mut out, &mut rel).is_err(),
            "before open-ok"
        );
        let mut ready = Vec::new();
        x.fail_all(
            &FailureCause::ConnectionLost("socket closed".into()),
            &mut ready,
        );
        assert_eq!(ready.iter().map(|(t, _)| *t).collect::<Vec<_>>(), [1, 2]);
        assert!(ready
            .iter()
            .all(|(_, o)| matches!(o, PublishOutcome::Failed(_))));
        assert_eq!(x.held(), 0);
    }

    #[test]
    fn one_channel_per_connection_refuses_named_exchanges_without_declaring() {
        let mut x = Exchanges::new("events", Declare::DurableTopic, 1);
        let (mut out, mut rel) = (Vec::new(), Vec::new());
        assert!(x.admit(message(1, Some("b")), &mut out, &mut rel).is_none());
        let got = tags(&mut rel);
        assert!(
            got[0].starts_with("refused 1") && got[0].contains("channel_max"),
            "{got:?}"
        );
        assert!(out.is_empty());
        assert!(x.admit(message(2, None), &mut out, &mut rel).is_some());
    }
}
