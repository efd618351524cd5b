//! Publishes the broker refused by closing the publishing channel, and how the message that
//! caused such a close is found, so it is dead-lettered and the rest is delivered.
//!
//! RabbitMQ answers some publishes with a `channel.close` instead of a confirm: 403
//! `ACCESS_REFUSED` for an exchange the user may not write, or an internal exchange (named
//! by a producer under `--no-declare`), a 406 over a property, and whatever a later version
//! adds. The publishing channel carries only our `basic.publish`es once it is open, and
//! RabbitMQ handles a channel's methods in order, so the publish that caused the close is
//! one of those unsettled when it arrived. Reconnecting and publishing the same messages
//! again only meets the same close, so each close teaches the next session one of:
//!
//! 1. **an exchange**: the close names an exchange the producer named (`... write access
//!    to exchange 'x' in vhost '/' refused ...`, `... cannot publish to internal exchange
//!    'x' ...`). Every later message to it is dead-lettered as `exchange_refused`
//!    ([`crate::routing::REASON_REFUSED`]) without being published;
//! 2. **a culprit**: one publish was unsettled, so it caused the close: that message (by
//!    LSN) is dead-lettered as [`REASON_PUBLISH_REFUSED`] when it is read again;
//! 3. **isolation**: several were unsettled. The next session keeps one message in flight
//!    at a time until its watermark passes the last of them, so a close there has one
//!    culprit (case 2).
//!
//! A close that refuses a routing key by topic permissions (`403 ACCESS_REFUSED - access to
//! topic 'KEY' in exchange 'X' ...`) names an exchange but is about the message: it is a
//! culprit or an isolation (cases 2 and 3), even on the configured `--exchange`, so one
//! message with a forbidden key no longer stops the whole outbox.
//!
//! The configured `--exchange` is never learned (it would dead-letter the whole outbox): a
//! close that names it, a 404 (an exchange deleted after it was declared: the next session
//! declares it again), or a close of the connection rather than the channel teaches
//! nothing, and the session keeps failing with the broker's text, which names the
//! permission to grant. What was learned lasts for the process, like the broker's size
//! limit (`admission`); a dead letter is requeued once the cause is fixed.
//!
//! Pure: no I/O.

use std::collections::BTreeMap;

use crate::lsn::Lsn;
use crate::sink::SinkFailure;

/// Dead-letter reason: RabbitMQ closed the publishing channel over this message (found as
/// the only publish unsettled at the close), naming no exchange.
pub const REASON_PUBLISH_REFUSED: &str = crate::contract::dead_letter_reason::PUBLISH_REFUSED;

/// What one close taught ([`Refusals::learn`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Lesson {
    /// The producer-named exchange refused publishes.
    Exchange(String),
    /// The message at this LSN caused the close.
    Culprit(Lsn),
    /// One of the messages up to this LSN did: publish one at a time until past it.
    Isolate(Lsn),
}

/// What the publishing channel's closes taught this process.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(super) struct Refusals {
    /// Producer-named exchanges RabbitMQ refused publishes to, with its close text.
    exchanges: BTreeMap<String, String>,
    /// Messages (by LSN) that closed the channel, with the close text.
    culprits: BTreeMap<Lsn, String>,
    /// While the watermark is at or below this, one message is in flight at a time.
    isolate_until: Option<Lsn>,
}

/// The exchange a close text names: `... exchange 'NAME' in vhost ...`, unless the close
/// refuses a routing key rather than the exchange (RabbitMQ's topic permissions: `access to
/// topic 'KEY' in exchange 'NAME' in vhost ... refused`): that one is about the message, and
/// is found like a close that names nothing.
fn named_exchange(text: &str) -> Option<&str> {
    if text.contains("access to topic '") {
        return None;
    }
    const OPEN: &str = "exchange '";
    let at = text.find(OPEN)? + OPEN.len();
    let len = text[at..].find("' in vhost")?;
    Some(&text[at..at + len])
}

impl Refusals {
    /// Learns from the sink's failure, with the LSNs of the publishes it left unsettled
    /// (`unsettled`: on the failed connection only, whichever partition it carried) and the
    /// configured exchange (`configured`, never learned). `None`: the failure teaches
    /// nothing (not a close of the publishing channel, one that names the configured
    /// exchange, or no publish was unsettled).
    pub fn learn(
        &mut self,
        failure: &SinkFailure,
        configured: &str,
        unsettled: &[Lsn],
    ) -> Option<Lesson> {
        let (code, text) = failure.channel_close()?;
        // 404: the exchange is gone (deleted after it was declared); the next session
        // declares it again.
        if code == 404 {
            return None;
        }
        let text = format!("{code} {text}");
        if let Some(exchange) = named_exchange(&text) {
            if exchange == configured {
                return None;
            }
        }
        if let Some(exchange) = named_exchange(&text).filter(|_| code == 403) {
            let exchange = exchange.to_owned();
            self.exchanges.insert(exchange.clone(), text);
            return Some(Lesson::Exchange(exchange));
        }
        match unsettled {
            [] => None,
            [one] => {
                self.culprits.insert(*one, text);
                Some(Lesson::Culprit(*one))
            }
            many => {
                let last = many.iter().copied().max().unwrap_or_default();
                let until = self.isolate_until.map_or(last, |u| u.max(last));
                self.isolate_until = Some(until);
                Some(Lesson::Isolate(until))
            }
        }
    }

    /// The close text, when publishes to the producer-named `exchange` were refused.
    pub fn refused_exchange(&self, exchange: &str) -> Option<&str> {
        self.exchanges.get(exchange).map(String::as_str)
    }

    /// The close text, when the message at `lsn` caused a close.
    pub fn culprit(&self, lsn: Lsn) -> Option<&str> {
        self.culprits.get(&lsn).map(String::as_str)
    }

    /// Whether a watermark at `flushed` still isolates (one message in flight at a time).
    pub fn isolating(&self, flushed: Lsn) -> bool {
        self.isolate_until.is_some_and(|until| flushed <= until)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::sink::FailureCause;

    /// A close of the publishing channel, `text` being `CODE REPLY_TEXT`.
    fn closed(text: &str) -> SinkFailure {
        let (code, reply) = text.split_once(' ').unwrap();
        SinkFailure::new(FailureCause::ChannelClosed {
            reply_code: code.parse().unwrap(),
            reply_text: reply.into(),
            class_id: 60,
            method_id: 40,
        })
    }

    #[test]
    fn a_close_naming_a_producer_exchange_teaches_the_exchange() {
        let mut r = Refusals::default();
        let write = closed("403 ACCESS_REFUSED - write access to exchange 'billing' in vhost '/' refused for user 'u'");
        assert_eq!(
            r.learn(&write, "events", &[Lsn(1), Lsn(2)]),
            Some(Lesson::Exchange("billing".into()))
        );
        assert!(r.refused_exchange("billing").unwrap().starts_with("403 "));
        let internal =
            closed("403 ACCESS_REFUSED - cannot publish to internal exchange 'int' in vhost '/'");
        assert_eq!(
            r.learn(&internal, "events", &[]),
            Some(Lesson::Exchange("int".into()))
        );
        assert!(!r.isolating(Lsn(0)), "no isolation for a named exchange");
    }

    /// Issue 32 item 4: a topic permission refuses one routing key, on the configured
    /// exchange or another: the message is found (isolation, then the culprit), never the
    /// exchange learned or the close ignored.
    #[test]
    fn a_topic_permission_close_is_about_the_message() {
        let text = "403 ACCESS_REFUSED - access to topic 'bad.3' in exchange 'events' in vhost '/' refused for user 'u'";
        let mut r = Refusals::default();
        assert_eq!(
            r.learn(&closed(text), "events", &[Lsn(1), Lsn(2), Lsn(3)]),
            Some(Lesson::Isolate(Lsn(3)))
        );
        assert!(r.isolating(Lsn(2)));
        assert_eq!(
            r.learn(&closed(text), "events", &[Lsn(2)]),
            Some(Lesson::Culprit(Lsn(2)))
        );
        let other = text.replace("'events'", "'billing'");
        assert_eq!(
            r.learn(&closed(&other), "events", &[Lsn(5)]),
            Some(Lesson::Culprit(Lsn(5)))
        );
        assert!(r.refused_exchange("billing").is_none());
    }

    /// Issue 31 item 1: a partition's close once reached the loop as text prefixed with
    /// `partition i: `, which no longer started with the channel-close marker, so nothing
    /// was learned and the session replayed the refused message forever.
    #[test]
    fn a_close_on_any_partition_teaches_the_same() {
        let mut r = Refusals::default();
        let mut write = closed("403 ACCESS_REFUSED - write access to exchange 'billing' in vhost '/' refused for user 'u'");
        write.partition = Some(2);
        assert_eq!(
            r.learn(&write, "events", &[Lsn(1), Lsn(2)]),
            Some(Lesson::Exchange("billing".into()))
        );
        let mut one = closed("406 PRECONDITION_FAILED - something new");
        one.partition = Some(3);
        assert_eq!(
            r.learn(&one, "events", &[Lsn(8)]),
            Some(Lesson::Culprit(Lsn(8)))
        );
        assert!(one
            .to_string()
            .starts_with("partition 3: the broker closed the channel with 406"));
    }

    #[test]
    fn the_configured_exchange_and_other_failures_teach_nothing() {
        let mut r = Refusals::default();
        let own = closed("403 ACCESS_REFUSED - write access to exchange 'events' in vhost '/' refused for user 'u'");
        assert_eq!(r.learn(&own, "events", &[Lsn(1)]), None);
        let conn = SinkFailure::new(FailureCause::ConnectionClosed {
            reply_code: 320,
            reply_text: "CONNECTION_FORCED - shutdown".into(),
        });
        assert_eq!(r.learn(&conn, "events", &[Lsn(1)]), None);
        let lost = SinkFailure::new(FailureCause::ConnectionLost("missed heartbeats".into()));
        assert_eq!(r.learn(&lost, "events", &[Lsn(1)]), None);
        let gone = closed("404 NOT_FOUND - no exchange 'billing' in vhost '/'");
        assert_eq!(r.learn(&gone, "events", &[Lsn(1)]), None);
        assert_eq!(r, Refusals::default());
    }

    #[test]
    fn one_unsettled_publish_is_the_culprit_and_several_isolate() {
        let mut r = Refusals::default();
        let close = closed("406 PRECONDITION_FAILED - something new");
        assert_eq!(
            r.learn(&close, "events", &[Lsn(5), Lsn(9), Lsn(7)]),
            Some(Lesson::Isolate(Lsn(9)))
        );
        assert!(r.isolating(Lsn(9)) && !r.isolating(Lsn(10)));
        assert_eq!(
            r.learn(&close, "events", &[Lsn(7)]),
            Some(Lesson::Culprit(Lsn(7)))
        );
        assert_eq!(
            r.culprit(Lsn(7)),
            Some("406 PRECONDITION_FAILED - something new")
        );
        assert_eq!(r.culprit(Lsn(5)), None);
        assert!(r.isolating(Lsn(8)), "isolation goes on past the culprit");
    }
}
