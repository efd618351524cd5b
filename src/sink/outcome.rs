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

/// How a [`PublishOutcome::Failed`] text begins when the destination closed the publishing
/// channel over a publish (AMQP `channel.close`); the reply code and text follow
/// (`403 ACCESS_REFUSED - ...`). The pipeline reads it to find the message that caused it.
pub const CHANNEL_CLOSED: &str = "the broker closed the channel with ";

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
    /// The channel or connection failed before a confirm arrived: outcome unknown,
    /// treated as not delivered.
    Failed {
        /// What failed (the broker's close reply, a socket error, a missed heartbeat).
        error: String,
    },
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
            PublishOutcome::Failed { error } => write!(f, "failed before a confirm: {error}"),
        }
    }
}
