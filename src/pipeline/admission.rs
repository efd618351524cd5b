//! Admission: whether an outbox message read from the stream is published, or
//! dead-lettered without ever being published, and why.
//!
//! The checks, in order (the first that fails decides the dead letter's reason):
//! 1. **transactional**: a message of the outbox's prefix outside a transaction is not
//!    something `outbox.emit` writes: `forged` under lockdown, else `poison`;
//! 2. **emitter** (under `setup --lockdown` only): only a version-2 (or later) envelope
//!    with an emitter came through the helpers; anything else is `forged`, decodable or
//!    not (an unknown newer version is left to check 4: it may come from newer helpers);
//! 3. **size**: the envelope over `--max-message-bytes` is `too_large`;
//! 4. **envelope**: an unknown newer version is `unsupported_envelope` (requeued once a
//!    pgoutbox that reads it runs); anything undecodable is `poison`;
//! 5. **routing**: the exchange the producer named ([`Router`]): see
//!    [`crate::routing`] for its reasons;
//! 6. **broker limit**: a payload over the broker's `max_message_size` (configured, or
//!    learned from a channel close) is `too_large`;
//! 7. **broker refusals** (learned from closes of the publishing channel, see
//!    [`super::refusal`]): a message to a producer-named exchange RabbitMQ refused
//!    publishes to is `exchange_refused`; the message that closed the channel on its own
//!    is `publish_refused`.
//!
//! A message that passes is published with the routing decision and whether its emitter
//! was checked. Also here: the lockdown markers ([`crate::lockdown`]), which change what
//! check 2 applies to, and the broker's size limit ([`BrokerLimit`]).
//!
//! Pure: no I/O.

use bytes::Bytes;

use super::refusal::{Refusals, REASON_PUBLISH_REFUSED};
use super::transaction::TxnPlace;
use crate::contract::dead_letter_reason;
use crate::envelope::{self, Envelope, EnvelopeError};
use crate::lockdown::{self, Lockdown, MarkerEffect};
use crate::lsn::Lsn;
use crate::outbox_schema::MessagePrefix;
use crate::pgoutput::Message;
use crate::routing::{Exchange, Refusal, Router, REASON_REFUSED};
use crate::sink::SinkFailure;

/// The broker's message body size limit.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct BrokerLimit {
    /// Largest body RabbitMQ accepts, in bytes.
    pub max_bytes: usize,
    /// Where the figure comes from, for the dead letter's error text.
    pub source: String,
}

impl BrokerLimit {
    /// The broker's size limit, when `failure` is RabbitMQ's close of the publishing
    /// channel for an oversized message: 406 PRECONDITION_FAILED, "message size N is larger
    /// than configured max size M" (on whichever partition).
    pub fn from_close(failure: &SinkFailure) -> Option<BrokerLimit> {
        const MARK: &str = "larger than configured max size ";
        let (406, text) = failure.channel_close()? else {
            return None;
        };
        let at = text.find(MARK)? + MARK.len();
        let digits: String = text[at..]
            .chars()
            .take_while(char::is_ascii_digit)
            .collect();
        let max_bytes = digits.parse().ok()?;
        Some(BrokerLimit {
            max_bytes,
            source: format!("learned from RabbitMQ's channel close: {failure}"),
        })
    }
}

/// A message that may be published.
#[derive(Debug)]
pub(super) struct Admitted {
    /// Its decoded envelope.
    pub envelope: Envelope,
    /// Where it goes.
    pub exchange: Exchange,
    /// Read under lockdown: its emitter was required (and present), and the envelope does
    /// not say it was never checked (`emitted_by_unchecked`, from `dead-letters requeue`).
    pub emitter_checked: bool,
}

/// A message that is dead-lettered without being published.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Rejection {
    /// The dead-letter reason (`poison`, `forged`, `too_large`, ...).
    pub reason: &'static str,
    /// The dead letter's error text.
    pub error: String,
}

impl From<Refusal> for Rejection {
    fn from(r: Refusal) -> Self {
        Rejection {
            reason: r.reason,
            error: r.error,
        }
    }
}

/// The admission rules of one session.
#[derive(Debug)]
pub(super) struct Admission {
    /// Whether `setup --lockdown` is in effect, from the record read at session start and
    /// the markers seen since (see [`crate::lockdown`] for why that is exact).
    lockdown: Lockdown,
    /// Lockdown is the default outbox's only: another schema's streamer acknowledges the
    /// markers like any other prefix and checks no emitter.
    reads_markers: bool,
    /// The logical-message prefix published; messages with other prefixes are
    /// acknowledged without publishing.
    prefix: MessagePrefix,
    /// `--max-message-bytes`: the largest envelope published.
    max_message_bytes: usize,
    /// Which exchange each message goes to (`--exchange`, `--allowed-exchanges`).
    router: Router,
    /// The broker's size limit, when known (perhaps learned in this session).
    broker_limit: Option<BrokerLimit>,
    /// What closes of the publishing channel taught (check 7).
    refusals: Refusals,
}

impl Admission {
    /// The rules for a session of the outbox of `prefix`; `reads_markers` for the default
    /// outbox (the only one lockdown applies to).
    pub fn new(
        lockdown: Lockdown,
        reads_markers: bool,
        prefix: MessagePrefix,
        max_message_bytes: usize,
        router: Router,
        broker_limit: Option<BrokerLimit>,
        refusals: Refusals,
    ) -> Self {
        Admission {
            lockdown,
            reads_markers,
            prefix,
            max_message_bytes,
            router,
            broker_limit,
            refusals,
        }
    }

    /// Whether `m` is a lockdown marker this session reads.
    pub fn is_marker(&self, m: &Message) -> bool {
        self.reads_markers && m.has_prefix(lockdown::MARKER_PREFIX.as_bytes())
    }

    /// Whether `m` is an outbox message of this session (its prefix).
    pub fn is_outbox_message(&self, m: &Message) -> bool {
        m.has_prefix(self.prefix.as_str().as_bytes())
    }

    /// A lockdown marker: lockdown starts, ends, or nothing changes (each logged).
    pub fn on_marker(&mut self, m: &Message) {
        match self.lockdown.on_marker(m.lsn, &m.content, m.transactional) {
            MarkerEffect::Locked(since) => tracing::warn!(
                marker_lsn = %m.lsn,
                lockdown_lsn = %since,
                "lockdown in effect (setup --lockdown): outbox messages after the lockdown LSN that were not written by outbox.emit/emit_bytes are dead-lettered as forged"
            ),
            MarkerEffect::Unlocked => tracing::warn!(
                marker_lsn = %m.lsn,
                "lockdown lifted (setup --unlock): outbox messages are no longer checked for their emitter"
            ),
            MarkerEffect::Ignored => {
                tracing::debug!(marker_lsn = %m.lsn, transactional = m.transactional, "lockdown marker changes nothing")
            }
        }
    }

    /// The broker's size limit, when known.
    pub fn broker_limit(&self) -> Option<&BrokerLimit> {
        self.broker_limit.as_ref()
    }

    /// Learns the broker's size limit (from a channel close).
    pub fn learn_broker_limit(&mut self, limit: BrokerLimit) {
        self.broker_limit = Some(limit);
    }

    /// What closes of the publishing channel taught, to learn more.
    pub fn refusals_mut(&mut self) -> &mut Refusals {
        &mut self.refusals
    }

    /// What closes of the publishing channel taught.
    pub fn refusals(&self) -> &Refusals {
        &self.refusals
    }

    /// The exchange for `env` ([`Router::route`]).
    ///
    /// # Errors
    /// The router's [`Refusal`].
    pub fn route(&self, env: &Envelope) -> Result<Exchange, Refusal> {
        self.router.route(env.exchange.as_deref())
    }

    /// The checks of the module doc, in order, for the outbox message at `lsn` with
    /// `content` (the envelope), placed in its transaction at `place` (`None`: not in
    /// one).
    ///
    /// # Errors
    /// The first check that fails, as the dead letter's reason and error.
    pub fn admit(
        &self,
        lsn: Lsn,
        content: &Bytes,
        place: Option<&TxnPlace>,
    ) -> Result<Admitted, Rejection> {
        let locked = self.lockdown.covers(lsn);
        if place.is_none() {
            return Err(self.not_transactional(lsn, locked));
        }
        let checked = if locked {
            self.check_emitter(lsn, content)?
        } else {
            None
        };
        self.check_size(content)?;
        let envelope = match checked {
            Some(env) => env,
            None => decode(content)?,
        };
        let exchange = self.route(&envelope)?;
        self.check_broker_limit(&envelope)?;
        self.check_refusals(lsn, &exchange)?;
        // A requeued message whose emitter was not checked when first streamed keeps that
        // verdict (`dead-letters requeue` marks it): never sent as checked.
        let emitter_checked = locked && !envelope.emitted_by_unchecked;
        Ok(Admitted {
            envelope,
            exchange,
            emitter_checked,
        })
    }

    /// Check 1 failed: the message is in no transaction.
    fn not_transactional(&self, lsn: Lsn, locked: bool) -> Rejection {
        if locked {
            Rejection {
                reason: dead_letter_reason::FORGED,
                error: self.forged_error(lsn, "a non-transactional message"),
            }
        } else {
            Rejection {
                reason: dead_letter_reason::POISON,
                error: format!(
                    "non-transactional logical message with prefix {} (emit never writes one)",
                    self.prefix
                ),
            }
        }
    }

    /// Check 2, under lockdown: the envelope, when it decoded with an emitter (`None`
    /// for an unknown newer version, left to check 4).
    fn check_emitter(&self, lsn: Lsn, content: &Bytes) -> Result<Option<Envelope>, Rejection> {
        let what = match envelope::decode(content.clone()) {
            Ok(env) if env.emitted_by.is_some() => return Ok(Some(env)),
            Err(EnvelopeError::UnsupportedVersion { .. }) => return Ok(None),
            Ok(_) => {
                "an envelope without an emitter (version 1, or version 2 or 3 without emitted_by)"
                    .to_owned()
            }
            Err(e) => format!("no valid envelope ({e})"),
        };
        Err(Rejection {
            reason: dead_letter_reason::FORGED,
            error: self.forged_error(lsn, &what),
        })
    }

    /// Check 3: the envelope within `--max-message-bytes`.
    fn check_size(&self, content: &Bytes) -> Result<(), Rejection> {
        if content.len() <= self.max_message_bytes {
            return Ok(());
        }
        Err(Rejection {
            reason: dead_letter_reason::TOO_LARGE,
            error: format!(
                "message of {} bytes (envelope) exceeds --max-message-bytes {}",
                content.len(),
                self.max_message_bytes
            ),
        })
    }

    /// Check 6: the payload within the broker's `max_message_size`, when known.
    fn check_broker_limit(&self, env: &Envelope) -> Result<(), Rejection> {
        match &self.broker_limit {
            Some(limit) if env.payload.len() > limit.max_bytes => Err(Rejection {
                reason: dead_letter_reason::TOO_LARGE,
                error: format!(
                    "payload of {} bytes is larger than the broker's max_message_size {} ({})",
                    env.payload.len(),
                    limit.max_bytes,
                    limit.source
                ),
            }),
            _ => Ok(()),
        }
    }

    /// Check 7: neither a refused exchange nor the message that closed the channel.
    fn check_refusals(&self, lsn: Lsn, exchange: &Exchange) -> Result<(), Rejection> {
        if let Exchange::Named(name) = exchange {
            if let Some(close) = self.refusals.refused_exchange(name.as_str()) {
                return Err(Rejection {
                    reason: REASON_REFUSED,
                    error: format!(
                        "exchange_refused: RabbitMQ refused to publish to exchange {:?} named by the message and closed the channel: {close}; grant the user write permission on it (an internal exchange takes no publishes: name another), then requeue the dead letter",
                        name.as_str()
                    ),
                });
            }
        }
        match self.refusals.culprit(lsn) {
            Some(close) => Err(Rejection {
                reason: REASON_PUBLISH_REFUSED,
                error: format!(
                    "publish_refused: RabbitMQ closed the publishing channel over this message (it was the only one unconfirmed): {close}; fix what the broker names, then requeue the dead letter"
                ),
            }),
            None => Ok(()),
        }
    }

    /// The dead letter's error for a `forged` message at `lsn` that is `what`.
    fn forged_error(&self, lsn: Lsn, what: &str) -> String {
        format!(
            "forged: the outbox message at {lsn} is {what}, written after the lockdown at {} (setup --lockdown); outbox.emit/emit_bytes never write that, so it was written with pg_logical_emit_message directly, after the lockdown: by a superuser, or by a role the lockdown no longer holds against (a grant, an ownership or a membership given since: `pgoutbox check` names it)",
            self.lockdown.since().unwrap_or_default()
        )
    }
}

/// Check 4: the envelope decodes, in a version this pgoutbox reads.
fn decode(content: &Bytes) -> Result<Envelope, Rejection> {
    match envelope::decode(content.clone()) {
        Ok(env) => Ok(env),
        // Written by a newer outbox.emit: never published, dead-lettered (and requeued
        // once a pgoutbox that reads it runs).
        Err(e @ EnvelopeError::UnsupportedVersion { .. }) => Err(Rejection {
            reason: dead_letter_reason::UNSUPPORTED_ENVELOPE,
            error: e.to_string(),
        }),
        Err(reason) => Err(Rejection {
            reason: dead_letter_reason::POISON,
            error: format!("undecodable outbox message (poison): {reason}"),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::AllowedExchanges;

    fn admission(lockdown_at: Option<u64>, max_message_bytes: usize) -> Admission {
        Admission::new(
            Lockdown::from_record(lockdown_at.map(Lsn)),
            true,
            MessagePrefix::default(),
            max_message_bytes,
            Router::new("orders".into(), AllowedExchanges::Any),
            None,
            Refusals::default(),
        )
    }

    const PLACE: TxnPlace = TxnPlace {
        commit_lsn: Lsn(0x900),
        commit_time_us: 0,
        index_in_txn: 0,
    };

    fn reason(r: Result<Admitted, Rejection>) -> &'static str {
        match r {
            Ok(_) => "published",
            Err(r) => r.reason,
        }
    }

    #[test]
    fn learns_the_broker_limit_from_its_close_text() {
        use crate::sink::FailureCause;
        let closed = |code: u16, text: &str, partition: Option<u16>| SinkFailure {
            partition,
            cause: FailureCause::ChannelClosed {
                reply_code: code,
                reply_text: text.into(),
                class_id: 60,
                method_id: 40,
            },
        };
        let text =
            "PRECONDITION_FAILED - message size 2097152 is larger than configured max size 1048576";
        let limit = BrokerLimit::from_close(&closed(406, text, None)).unwrap();
        assert_eq!(limit.max_bytes, 1_048_576);
        assert!(limit.source.contains("message size 2097152"));
        // A partition's close teaches the same limit (the source names the partition).
        let limit = BrokerLimit::from_close(&closed(406, text, Some(3))).unwrap();
        assert_eq!(limit.max_bytes, 1_048_576);
        assert!(limit.source.contains("partition 3: "), "{}", limit.source);
        let lost = SinkFailure::new(FailureCause::ConnectionLost(text.into()));
        assert_eq!(BrokerLimit::from_close(&lost), None, "not a channel close");
        assert_eq!(BrokerLimit::from_close(&closed(403, text, None)), None);
        assert_eq!(
            BrokerLimit::from_close(&closed(406, "larger than configured max size é", None)),
            None
        );
    }

    #[test]
    fn the_checks_come_in_their_written_order() {
        let junk = Bytes::from_static(b"not an envelope at all");
        // 1 before everything: outside a transaction, even an oversized undecodable one.
        let a = admission(None, 4);
        assert_eq!(reason(a.admit(Lsn(0x10), &junk, None)), "poison");
        let locked = admission(Some(0), 4);
        assert_eq!(reason(locked.admit(Lsn(0x10), &junk, None)), "forged");
        // 2 before 3: under lockdown, forged before too large.
        assert_eq!(
            reason(locked.admit(Lsn(0x10), &junk, Some(&PLACE))),
            "forged"
        );
        // 3 before 4: too large before undecodable.
        assert_eq!(reason(a.admit(Lsn(0x10), &junk, Some(&PLACE))), "too_large");
        // 4 with room: undecodable is poison.
        let roomy = admission(None, 1 << 20);
        let rejected = roomy.admit(Lsn(0x10), &junk, Some(&PLACE)).unwrap_err();
        assert_eq!(rejected.reason, "poison");
        assert!(rejected
            .error
            .starts_with("undecodable outbox message (poison)"));
        // A lockdown recorded after the message does not cover it.
        let later = admission(Some(0x20), 4);
        assert_eq!(reason(later.admit(Lsn(0x10), &junk, None)), "poison");
    }
}
