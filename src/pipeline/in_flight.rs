//! The in-flight table: every outbox message read from the stream and not yet settled,
//! with its retry schedule.
//!
//! A record is created when a message is first published (or handed to the dead-letter
//! writer) and removed when it is settled: confirmed as routed, or durably dead-lettered.
//! Between the two it may be published again (after a nack, or a return under
//! `--on-unroutable block`) when its retry falls due. The watermark counts the same
//! messages by transaction; this table keeps what is needed to publish them again or to
//! write them as dead letters.

use std::cmp::Reverse;
use std::collections::{BTreeMap, BinaryHeap};

use amq_protocol::protocol::BasicProperties;
use amq_protocol::types::{FieldTable, ShortString};
use bytes::Bytes;
use tokio::time::Instant;

use super::{
    HEADER_AGGREGATE_ID, HEADER_AGGREGATE_TYPE, HEADER_AGGREGATE_VERSION, HEADER_CAUSATION_ID,
    HEADER_COMMIT_LSN, HEADER_COMMIT_TIME_US, HEADER_EMITTED_BY, HEADER_IDEMPOTENCY_KEY,
    HEADER_LSN, HEADER_TENANT, HEADER_TRACEPARENT, HEADER_TRACESTATE,
};
use crate::config::PublishProperties;
use crate::envelope::{self, Envelope, Metadata};
use crate::lsn::Lsn;
use crate::publisher::message::{
    headers_from_json, insert_i64, insert_text, DELIVERY_MODE_PERSISTENT,
};
use crate::publisher::{Exchange, MatchKey, OutboundMessage};
use crate::watermark::TxnSeq;

/// Identifies one in-flight message within a session (also the publisher's tag).
pub(super) type Seq = u64;

/// A message read from the stream and not yet settled.
#[derive(Debug)]
pub(super) struct InFlight {
    /// Its transaction in the watermark.
    pub txn: TxnSeq,
    /// The message's own LSN.
    pub lsn: Lsn,
    /// Its transaction's commit record LSN (pgoutput Begin's final LSN).
    pub commit_lsn: Lsn,
    /// Commit time, µs since the Unix epoch.
    pub commit_time_us: i64,
    /// The logical message content (the envelope), kept to rebuild a retry.
    pub content: Bytes,
    /// Publish attempts so far.
    pub attempts: u32,
    /// The first failure, kept for the dead letter.
    pub first_error: Option<String>,
    /// Read under `setup --lockdown`: its emitter was required (and present), so the
    /// emitter header can be trusted.
    pub emitter_checked: bool,
}

impl InFlight {
    /// Its size for the window and the watermark: the content length in bytes.
    pub fn bytes(&self) -> u64 {
        self.content.len() as u64
    }

    /// The AMQP message for this record, to `exchange` (decided by
    /// [`crate::routing::Router`]): routing key = topic, body = payload.
    ///
    /// With [`PublishProperties::Full`]: message id, content type, persistent, timestamp in
    /// seconds, `type` = the topic, and headers (the producer's, then ours: message LSN,
    /// commit LSN as `X/Y` text, commit time in µs); returns are matched by the message
    /// LSN. With [`PublishProperties::Minimal`]: persistent, message id and the producer's
    /// headers only (none when it set none); returns are matched by the message id. In
    /// both, the emitter header when the message was checked under lockdown
    /// ([`InFlight::emitter_checked`]): only then can it be trusted.
    /// With `cloudevents` (`run --cloudevents`), also the CloudEvent's attributes and
    /// content type ([`crate::cloudevents::BinaryMode::apply`]), on top of either shape.
    ///
    /// Event metadata (envelope version 3), in both shapes, each only when the producer
    /// gave it (it asked for it, and `expiration` and `priority` change what the broker
    /// does: leaving them out would change behaviour, not just weight): the properties
    /// `correlation-id`, `expiration` (decimal milliseconds) and `priority`; the headers
    /// `x-pgoutbox-causation-id`, `x-pgoutbox-aggregate-type`, `x-pgoutbox-aggregate-id`,
    /// `x-pgoutbox-aggregate-version` (long-long integer), `x-pgoutbox-tenant`,
    /// `x-pgoutbox-idempotency-key` (text), and the W3C Trace Context headers
    /// `traceparent` / `tracestate` unchanged (they replace producer headers of the same
    /// name). `type` = topic is pgoutbox's own addition, so it is left out of the minimal
    /// shape, as the content type and timestamp are.
    ///
    /// # Errors
    /// A text naming what does not fit AMQP (a topic, message id or content type over 255
    /// bytes).
    pub fn to_outbound(
        &self,
        seq: Seq,
        env: Envelope,
        exchange: Exchange,
        shape: PublishProperties,
        cloudevents: Option<&crate::cloudevents::Binding>,
    ) -> Result<OutboundMessage<Seq>, String> {
        let cloudevents = cloudevents.map(|ce| ce.binary_mode(&env, self.commit_time_us));
        let routing_key = ShortString::try_new(env.topic).map_err(|e| e.to_string())?;
        let message_id = ShortString::try_new(env.message_id).map_err(|e| e.to_string())?;
        let (properties, match_key) = match shape {
            PublishProperties::Full => {
                let content_type =
                    ShortString::try_new(env.content_type).map_err(|e| e.to_string())?;
                let mut headers = headers_from_json(&env.headers);
                insert_metadata_headers(&mut headers, &env.meta);
                insert_text(&mut headers, HEADER_LSN, self.lsn.to_string());
                insert_text(&mut headers, HEADER_COMMIT_LSN, self.commit_lsn.to_string());
                insert_i64(&mut headers, HEADER_COMMIT_TIME_US, self.commit_time_us);
                if let Some(who) = env.emitted_by.filter(|_| self.emitter_checked) {
                    insert_text(&mut headers, HEADER_EMITTED_BY, who);
                }
                let properties = BasicProperties::default()
                    .with_message_id(message_id)
                    .with_content_type(content_type)
                    .with_delivery_mode(DELIVERY_MODE_PERSISTENT)
                    .with_timestamp(u64::try_from(self.commit_time_us / 1_000_000).unwrap_or(0))
                    .with_type(routing_key.clone())
                    .with_headers(headers);
                (
                    with_metadata_properties(properties, &env.meta)?,
                    MatchKey::Lsn(self.lsn),
                )
            }
            PublishProperties::Minimal => {
                let mut properties = BasicProperties::default()
                    .with_delivery_mode(DELIVERY_MODE_PERSISTENT)
                    .with_message_id(message_id.clone());
                let emitter = env.emitted_by.filter(|_| self.emitter_checked);
                let mut headers = headers_from_json(&env.headers);
                insert_metadata_headers(&mut headers, &env.meta);
                if let Some(who) = emitter {
                    insert_text(&mut headers, HEADER_EMITTED_BY, who);
                }
                if !headers.inner().is_empty() {
                    properties = properties.with_headers(headers);
                }
                (
                    with_metadata_properties(properties, &env.meta)?,
                    MatchKey::MessageId(message_id),
                )
            }
        };
        let properties = match cloudevents {
            Some(event) => event.apply(properties),
            None => properties,
        };
        Ok(OutboundMessage {
            tag: seq,
            exchange,
            routing_key,
            body: env.payload,
            properties,
            match_key,
        })
    }

    /// The envelope, decoded again from the kept content (for a retry).
    ///
    /// # Errors
    /// The envelope's decode error (it decoded once, so this means memory corruption).
    pub fn envelope(&self) -> Result<Envelope, envelope::EnvelopeError> {
        envelope::decode(self.content.clone())
    }
}

/// Adds the metadata headers of `meta` that are set: `x-pgoutbox-causation-id`,
/// `-aggregate-type`, `-aggregate-id`, `-aggregate-version` (long-long integer), `-tenant`,
/// `-idempotency-key`, and the W3C `traceparent` / `tracestate` unchanged.
fn insert_metadata_headers(headers: &mut FieldTable, meta: &Metadata) {
    for (key, value) in [
        (HEADER_CAUSATION_ID, &meta.causation_id),
        (HEADER_AGGREGATE_TYPE, &meta.aggregate_type),
        (HEADER_AGGREGATE_ID, &meta.aggregate_id),
        (HEADER_TENANT, &meta.tenant),
        (HEADER_IDEMPOTENCY_KEY, &meta.idempotency_key),
        (HEADER_TRACEPARENT, &meta.traceparent),
        (HEADER_TRACESTATE, &meta.tracestate),
    ] {
        if let Some(v) = value {
            insert_text(headers, key, v.clone());
        }
    }
    if let Some(v) = meta.aggregate_version {
        insert_i64(headers, HEADER_AGGREGATE_VERSION, v);
    }
}

/// Sets the AMQP properties of `meta` that are set: `correlation-id`, `expiration`
/// (decimal milliseconds, as RabbitMQ's per-message TTL reads it) and `priority`.
///
/// # Errors
/// A correlation id over 255 bytes (the decoder refuses those before).
fn with_metadata_properties(
    mut properties: BasicProperties,
    meta: &Metadata,
) -> Result<BasicProperties, String> {
    if let Some(id) = &meta.correlation_id {
        properties = properties
            .with_correlation_id(ShortString::try_new(id.clone()).map_err(|e| e.to_string())?);
    }
    if let Some(ms) = meta.expiration_ms {
        properties = properties
            .with_expiration(ShortString::try_new(ms.to_string()).map_err(|e| e.to_string())?);
    }
    if let Some(p) = meta.priority {
        properties = properties.with_priority(p);
    }
    Ok(properties)
}

/// In-flight records by [`Seq`], and the retry schedule.
///
/// Sequence numbers are handed out in WAL order and never reused. The records sit in an
/// ordered map, so the oldest unsettled record is the first entry, and memory follows the
/// records still in flight only: a stuck message at the front of a transaction larger than
/// the window leaves no trail of settled slots behind it.
#[derive(Debug, Default)]
pub(super) struct InFlightTable {
    records: BTreeMap<Seq, InFlight>,
    next_seq: Seq,
    /// Messages waiting to be published again: (due, seq), earliest first.
    retries: BinaryHeap<Reverse<(Instant, Seq)>>,
}

impl InFlightTable {
    /// Adds a record; returns its sequence number.
    pub fn insert(&mut self, record: InFlight) -> Seq {
        let seq = self.next_seq;
        self.next_seq += 1;
        self.records.insert(seq, record);
        seq
    }

    /// The record of `seq`, if still in flight.
    pub fn get_mut(&mut self, seq: Seq) -> Option<&mut InFlight> {
        self.records.get_mut(&seq)
    }

    fn contains(&self, seq: Seq) -> bool {
        self.records.contains_key(&seq)
    }

    /// Removes the record of `seq` (it was settled, or handed to the dead-letter writer).
    pub fn remove(&mut self, seq: Seq) -> Option<InFlight> {
        self.records.remove(&seq)
    }

    /// The oldest record still in flight.
    pub fn oldest(&self) -> Option<&InFlight> {
        self.records.first_key_value().map(|(_, r)| r)
    }

    /// Schedules `seq` to be published again at `due`.
    pub fn retry_at(&mut self, seq: Seq, due: Instant) {
        self.retries.push(Reverse((due, seq)));
    }

    /// When the next retry falls due.
    pub fn next_retry(&self) -> Option<Instant> {
        self.retries.peek().map(|Reverse((due, _))| *due)
    }

    /// Takes the retries due at `now`, earliest first (records settled meanwhile are
    /// skipped).
    pub fn take_due(&mut self, now: Instant) -> Vec<Seq> {
        let mut due = Vec::new();
        while let Some(Reverse((at, seq))) = self.retries.peek().copied() {
            if at > now {
                break;
            }
            self.retries.pop();
            if self.contains(seq) {
                due.push(seq);
            }
        }
        due
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use amq_protocol::types::AMQPValue;

    fn record(lsn: u64) -> InFlight {
        InFlight {
            txn: crate::watermark::AckWatermark::new(Lsn::ZERO).hold(0),
            lsn: Lsn(lsn),
            commit_lsn: Lsn(lsn),
            commit_time_us: lsn as i64,
            content: Bytes::new(),
            attempts: 0,
            first_error: None,
            emitter_checked: false,
        }
    }

    fn v3_envelope(meta: Metadata) -> Envelope {
        Envelope {
            version: envelope::VERSION_3,
            message_id: "m-1".into(),
            topic: "orders.created".into(),
            content_type: "application/json".into(),
            headers: serde_json::json!({"traceparent": "producer's", "k": "v"})
                .as_object()
                .cloned()
                .unwrap(),
            payload: Bytes::from_static(b"{}"),
            emitted_by: Some("app".into()),
            exchange: Some("orders".into()),
            meta,
        }
    }

    fn full_meta() -> Metadata {
        Metadata {
            correlation_id: Some("corr".into()),
            causation_id: Some("cause".into()),
            aggregate_type: Some("order".into()),
            aggregate_id: Some("42".into()),
            aggregate_version: Some(7),
            tenant: Some("acme".into()),
            expiration_ms: Some(60_000),
            priority: Some(5),
            traceparent: Some("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01".into()),
            tracestate: Some("rojo=1".into()),
            idempotency_key: Some("key-1".into()),
        }
    }

    fn header(p: &BasicProperties, key: &str) -> Option<AMQPValue> {
        p.headers()
            .as_ref()
            .and_then(|h| h.inner().get(key).cloned())
    }

    fn text(v: &str) -> Option<AMQPValue> {
        Some(AMQPValue::LongString(v.into()))
    }

    #[test]
    fn metadata_maps_to_amqp_properties_and_headers_in_both_shapes() {
        for shape in [PublishProperties::Full, PublishProperties::Minimal] {
            let out = record(1)
                .to_outbound(
                    0,
                    v3_envelope(full_meta()),
                    Exchange::Configured,
                    shape,
                    None,
                )
                .unwrap();
            let p = &out.properties;
            assert_eq!(
                p.correlation_id().as_ref().map(|s| s.as_str()),
                Some("corr")
            );
            assert_eq!(p.expiration().as_ref().map(|s| s.as_str()), Some("60000"));
            assert_eq!(*p.priority(), Some(5));
            assert_eq!(header(p, "x-pgoutbox-causation-id"), text("cause"));
            assert_eq!(header(p, "x-pgoutbox-aggregate-type"), text("order"));
            assert_eq!(header(p, "x-pgoutbox-aggregate-id"), text("42"));
            assert_eq!(
                header(p, "x-pgoutbox-aggregate-version"),
                Some(AMQPValue::LongLongInt(7))
            );
            assert_eq!(header(p, "x-pgoutbox-tenant"), text("acme"));
            assert_eq!(header(p, "x-pgoutbox-idempotency-key"), text("key-1"));
            // The validated trace context replaces a producer header of the same name.
            assert_eq!(
                header(p, "traceparent"),
                text("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01")
            );
            assert_eq!(header(p, "tracestate"), text("rojo=1"));
            assert_eq!(header(p, "k"), text("v"));
            // type = topic in the full shape only.
            let kind = p.kind().as_ref().map(|s| s.as_str().to_owned());
            match shape {
                PublishProperties::Full => assert_eq!(kind.as_deref(), Some("orders.created")),
                PublishProperties::Minimal => assert_eq!(kind, None),
            }
        }
    }

    #[test]
    fn absent_metadata_adds_nothing() {
        let mut env = v3_envelope(Metadata::default());
        env.headers.clear();
        let out = record(1)
            .to_outbound(
                0,
                env.clone(),
                Exchange::Configured,
                PublishProperties::Minimal,
                None,
            )
            .unwrap();
        let p = &out.properties;
        assert!(p.headers().is_none(), "{:?}", p.headers());
        assert!(p.correlation_id().is_none() && p.expiration().is_none() && p.priority().is_none());
        let out = record(1)
            .to_outbound(0, env, Exchange::Configured, PublishProperties::Full, None)
            .unwrap();
        let keys: Vec<String> = out
            .properties
            .headers()
            .as_ref()
            .unwrap()
            .inner()
            .keys()
            .map(|k| k.as_str().to_owned())
            .collect();
        assert_eq!(
            keys,
            [
                "x-pgoutbox-commit-lsn",
                "x-pgoutbox-commit-time-us",
                "x-pgoutbox-lsn"
            ]
        );
        assert!(out.properties.correlation_id().is_none());
    }

    #[test]
    fn the_oldest_is_the_first_unsettled_and_seqs_are_never_reused() {
        let mut t = InFlightTable::default();
        let a = t.insert(record(1));
        let b = t.insert(record(2));
        let c = t.insert(record(3));
        assert_eq!((a, b, c), (0, 1, 2));
        assert!(t.remove(b).is_some());
        assert_eq!(t.oldest().map(|r| r.lsn), Some(Lsn(1)));
        assert!(t.remove(a).is_some());
        assert_eq!(t.oldest().map(|r| r.lsn), Some(Lsn(3)));
        assert!(t.remove(b).is_none(), "settled twice");
        assert!(t.get_mut(a).is_none());
        assert!(t.remove(c).is_some());
        assert!(t.oldest().is_none());
        assert_eq!(t.insert(record(4)), 3);
        assert!(t.get_mut(3).is_some());
        assert!(t.get_mut(99).is_none());
    }
}
