//! Our own exhaustive outcome of one publish, whatever the sink.
//!
//! Every sink maps its destination's answers into these (and nothing else moves the flush
//! LSN): the AMQP publisher maps `basic.ack`, `basic.nack`, `basic.return` and a failed
//! channel ([`crate::publisher::confirms`]); a stream-protocol sink maps its publish confirm
//! to [`PublishOutcome::Routed`] and a publish error code to `Nacked` or `Failed`.
//!
//! Source: RabbitMQ "Consumer Acknowledgements and Publisher Confirms": an unroutable
//! `mandatory` message is returned (`basic.return`, 312 NO_ROUTE) **and then acked**, so an
//! ack alone does not mean delivered. Returns are matched to publishes by the key they carry
//! (see [`crate::publisher::MatchKey`]); see [`crate::publisher::confirms`] for the
//! settling rule.

/// Why a sink's connection (or its publishing channel) failed with publishes unsettled on
/// it: the cause the loop matches to learn from a refusal, never a text it parses.
///
/// Source: AMQP 0-9-1 `channel.close` (section 1.5.2.5) and `connection.close` (1.4.2.8)
/// carry a reply code, a reply text and the class and method that caused the close (0 and
/// 0 when none did).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FailureCause {
    /// The destination closed the publishing channel over a publish: 403
    /// ACCESS_REFUSED (an exchange the user may not write, an internal exchange), 406
    /// PRECONDITION_FAILED (a message over `max_message_size`), 404 NOT_FOUND (an
    /// exchange deleted after it was declared).
    ChannelClosed {
        /// AMQP reply code, e.g. 403.
        reply_code: u16,
        /// AMQP reply text, e.g. `ACCESS_REFUSED - write access to exchange 'x' ...`.
        reply_text: String,
        /// The class of the method that caused the close (60: `basic`), 0 when none.
        class_id: u16,
        /// The method that caused the close (40: `basic.publish`), 0 when none.
        method_id: u16,
    },
    /// The destination closed the whole connection (320 CONNECTION_FORCED when a node
    /// shuts down, 541 INTERNAL_ERROR, ...).
    ConnectionClosed {
        /// AMQP reply code, e.g. 320.
        reply_code: u16,
        /// AMQP reply text.
        reply_text: String,
    },
    /// The socket failed or closed, or no frame arrived for two heartbeat intervals: no
    /// reply from the destination says why.
    ConnectionLost(String),
    /// The destination sent what the protocol does not allow there (a frame that cannot
    /// be decoded, a content body that belongs to no `basic.return`).
    ProtocolViolation(String),
}

impl std::fmt::Display for FailureCause {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            FailureCause::ChannelClosed {
                reply_code,
                reply_text,
                class_id,
                method_id,
            } => {
                write!(
                    f,
                    "the broker closed the channel with {reply_code} {reply_text}"
                )?;
                match (class_id, method_id) {
                    (0, 0) => Ok(()),
                    (60, 40) => write!(f, " (on basic.publish)"),
                    (c, m) => write!(f, " (on class {c} method {m})"),
                }
            }
            FailureCause::ConnectionClosed {
                reply_code,
                reply_text,
            } => write!(
                f,
                "the broker closed the connection with {reply_code} {reply_text}"
            ),
            FailureCause::ConnectionLost(what) | FailureCause::ProtocolViolation(what) => {
                f.write_str(what)
            }
        }
    }
}

/// A failed connection of a sink: its cause, and the partition it carried (`None` for a
/// sink with one connection). Shown as `partition I: CAUSE`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SinkFailure {
    /// The partition whose connection failed (`run --partitions N`, N > 1).
    pub partition: Option<u16>,
    /// Why it failed.
    pub cause: FailureCause,
}

impl SinkFailure {
    /// A failure of a sink with one connection.
    pub fn new(cause: FailureCause) -> Self {
        SinkFailure {
            partition: None,
            cause,
        }
    }

    /// The reply code and text when the destination closed the publishing channel.
    pub fn channel_close(&self) -> Option<(u16, &str)> {
        match &self.cause {
            FailureCause::ChannelClosed {
                reply_code,
                reply_text,
                ..
            } => Some((*reply_code, reply_text.as_str())),
            _ => None,
        }
    }
}

impl std::fmt::Display for SinkFailure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if let Some(i) = self.partition {
            write!(f, "partition {i}: ")?;
        }
        self.cause.fmt(f)
    }
}

/// What became of one published message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PublishOutcome {
    /// Acked by the broker and not returned: routed to at least one queue and stored. A
    /// sink that knows the message is already stored (a stream's deduplication at start)
    /// settles it as `Routed` without sending it.
    Routed,
    /// Returned by the broker (`basic.return`), typically 312 NO_ROUTE; not delivered.
    Returned {
        /// AMQP reply code, e.g. 312.
        reply_code: u16,
        /// AMQP reply text, e.g. `NO_ROUTE`.
        reply_text: String,
    },
    /// Negatively acknowledged (`basic.nack`): the broker did not take responsibility.
    Nacked,
    /// Never published: the producer-named exchange could not be declared (or, under
    /// `--no-declare`, does not exist). The broker closed the declaring channel with this
    /// reply (404 NOT_FOUND, 406 PRECONDITION_FAILED for an exchange of another type or
    /// durability, 403 ACCESS_REFUSED); the publishing channel is untouched.
    ExchangeRefused {
        /// The exchange named.
        exchange: String,
        /// AMQP reply code, e.g. 404.
        reply_code: u16,
        /// AMQP reply text, e.g. `NOT_FOUND - no exchange 'x' in vhost '/'`.
        reply_text: String,
    },
    /// Never published: its content header does not fit the connection's `frame_max`
    /// (found when a message held behind an exchange declaration was encoded).
    Unsendable {
        /// Why.
        error: String,
    },
    /// Never stored: the destination refused this message definitely (a stream's
    /// `PublishError` with a code that concerns the message, not the stream). Dead-lettered
    /// as `stream_refused`, never retried.
    Refused {
        /// The destination's code (stream protocol response code, e.g. 0x10).
        code: u16,
        /// The code's meaning, and where.
        text: String,
    },
    /// The channel or connection failed before a confirm arrived: outcome unknown,
    /// treated as not delivered. Carries what failed (the broker's close reply, a socket
    /// error, a missed heartbeat) and where.
    Failed(SinkFailure),
}

impl PublishOutcome {
    /// True only for [`PublishOutcome::Routed`]: the one outcome that may move the LSN.
    pub fn is_routed(&self) -> bool {
        matches!(self, PublishOutcome::Routed)
    }
}

impl std::fmt::Display for PublishOutcome {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            PublishOutcome::Routed => write!(f, "routed"),
            PublishOutcome::Returned {
                reply_code,
                reply_text,
            } => write!(f, "returned by the broker ({reply_code} {reply_text})"),
            PublishOutcome::Nacked => write!(f, "nacked by the broker"),
            PublishOutcome::ExchangeRefused {
                exchange,
                reply_code,
                reply_text,
            } => write!(
                f,
                "not published: exchange {exchange:?} was refused ({reply_code} {reply_text})"
            ),
            PublishOutcome::Unsendable { error } => write!(f, "not published: {error}"),
            PublishOutcome::Refused { code, text } => {
                write!(f, "refused by the broker (code {code:#04x}: {text})")
            }
            PublishOutcome::Failed(failure) => write!(f, "failed before a confirm: {failure}"),
        }
    }
}
