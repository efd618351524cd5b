//! The AMQP 0-9-1 mapping of a [`Delivery`]: routing key, body, properties and headers,
//! in the shape `--publish-properties` chose, with the CloudEvents binding of
//! `--cloudevents` on top. Configured once per connection; pure (no I/O).
//!
//! With [`PublishProperties::Full`]: message id, content type, persistent, timestamp in
//! seconds, `type` = the topic, and headers (the producer's, then ours: message LSN, commit
//! LSN as `X/Y` text, commit time in µs); returns are matched by the message LSN. With
//! [`PublishProperties::Minimal`]: persistent, message id and the producer's headers only
//! (none when it set none); returns are matched by the message id. In both, the emitter
//! header when the message was checked under lockdown ([`Delivery::emitter_checked`]):
//! only then can it be trusted. With `cloudevents` (`run --cloudevents`), also the
//! CloudEvent's attributes and content type ([`crate::cloudevents::BinaryMode::apply`]),
//! on top of either shape.
//!
//! Event metadata (envelope version 3), in both shapes, each only when the producer gave
//! it (it asked for it, and `expiration` and `priority` change what the broker does:
//! leaving them out would change behaviour, not just weight): the properties
//! `correlation-id`, `expiration` (decimal milliseconds) and `priority`; the headers
//! `x-pgoutbox-causation-id`, `x-pgoutbox-aggregate-type`, `x-pgoutbox-aggregate-id`,
//! `x-pgoutbox-aggregate-version` (long-long integer), `x-pgoutbox-tenant`,
//! `x-pgoutbox-idempotency-key` (text), and the W3C Trace Context headers `traceparent` /
//! `tracestate` unchanged (they replace producer headers of the same name). `type` = topic
//! is pgoutbox's own addition, so it is left out of the minimal shape, as the content type
//! and timestamp are.

use amq_protocol::protocol::BasicProperties;
use amq_protocol::types::{FieldTable, ShortString};

use super::message::{headers_from_json, insert_i64, insert_text, DELIVERY_MODE_PERSISTENT};
use super::{MatchKey, OutboundMessage};
use crate::cloudevents::Binding;
use crate::config::PublishProperties;
use crate::contract::{
    HEADER_AGGREGATE_ID, HEADER_AGGREGATE_TYPE, HEADER_AGGREGATE_VERSION, HEADER_CAUSATION_ID,
    HEADER_COMMIT_LSN, HEADER_COMMIT_TIME_US, HEADER_EMITTED_BY, HEADER_IDEMPOTENCY_KEY,
    HEADER_LSN, HEADER_TENANT, HEADER_TRACEPARENT, HEADER_TRACESTATE,
};
use crate::envelope::Metadata;
use crate::sink::{Delivery, Seq};

/// How deliveries become AMQP messages on one run (`--publish-properties`,
/// `--cloudevents`).
#[derive(Debug, Clone)]
pub struct Encoder {
    shape: PublishProperties,
    cloudevents: Option<Binding>,
}

impl Encoder {
    /// An encoder for the `shape` of `--publish-properties` and, with `--cloudevents`, its
    /// binding.
    pub fn new(shape: PublishProperties, cloudevents: Option<Binding>) -> Self {
        Encoder { shape, cloudevents }
    }

    /// The AMQP message for `delivery` (see the module doc): routing key = topic, body =
    /// payload, tagged with its [`Seq`].
    ///
    /// # Errors
    /// A text naming what does not fit AMQP (a topic, message id or content type over 255
    /// bytes).
    pub fn encode(&self, mut delivery: Delivery) -> Result<OutboundMessage<Seq>, String> {
        let cloudevents = self
            .cloudevents
            .as_ref()
            .map(|ce| ce.binary_mode(&delivery.envelope, delivery.commit_time_us));
        // Moved out rather than copied: this runs once per message.
        let routing_key = short(std::mem::take(&mut delivery.envelope.topic))?;
        let message_id = short(std::mem::take(&mut delivery.envelope.message_id))?;
        let (properties, match_key) = match self.shape {
            PublishProperties::Full => full(&mut delivery, message_id, routing_key.clone())?,
            PublishProperties::Minimal => minimal(&mut delivery, message_id)?,
        };
        let properties = match cloudevents {
            Some(event) => event.apply(properties),
            None => properties,
        };
        Ok(OutboundMessage {
            tag: delivery.seq,
            exchange: delivery.exchange,
            routing_key,
            body: delivery.envelope.payload,
            properties,
            match_key,
        })
    }
}

fn short(text: String) -> Result<ShortString, String> {
    ShortString::try_new(text).map_err(|e| e.to_string())
}

/// The emitter, when the message was checked under lockdown (only then is it trusted).
fn trusted_emitter(d: &mut Delivery) -> Option<String> {
    d.envelope.emitted_by.take().filter(|_| d.emitter_checked)
}

/// `--publish-properties full`: every property and our headers; returns match by LSN.
fn full(
    d: &mut Delivery,
    message_id: ShortString,
    routing_key: ShortString,
) -> Result<(BasicProperties, MatchKey), String> {
    let content_type = short(std::mem::take(&mut d.envelope.content_type))?;
    let mut headers = headers_from_json(&d.envelope.headers);
    insert_metadata_headers(&mut headers, &d.envelope.meta);
    insert_text(&mut headers, HEADER_LSN, d.lsn.to_string());
    insert_text(&mut headers, HEADER_COMMIT_LSN, d.commit_lsn.to_string());
    insert_i64(&mut headers, HEADER_COMMIT_TIME_US, d.commit_time_us);
    if let Some(who) = trusted_emitter(d) {
        insert_text(&mut headers, HEADER_EMITTED_BY, who);
    }
    let properties = BasicProperties::default()
        .with_message_id(message_id)
        .with_content_type(content_type)
        .with_delivery_mode(DELIVERY_MODE_PERSISTENT)
        .with_timestamp(u64::try_from(d.commit_time_us / 1_000_000).unwrap_or(0))
        .with_type(routing_key)
        .with_headers(headers);
    Ok((
        with_metadata_properties(properties, &d.envelope.meta)?,
        MatchKey::Lsn(d.lsn),
    ))
}

/// `--publish-properties minimal`: persistent, message id, the producer's headers and
/// metadata only; returns match by message id.
fn minimal(
    d: &mut Delivery,
    message_id: ShortString,
) -> Result<(BasicProperties, MatchKey), String> {
    let mut properties = BasicProperties::default()
        .with_delivery_mode(DELIVERY_MODE_PERSISTENT)
        .with_message_id(message_id.clone());
    let emitter = trusted_emitter(d);
    let mut headers = headers_from_json(&d.envelope.headers);
    insert_metadata_headers(&mut headers, &d.envelope.meta);
    if let Some(who) = emitter {
        insert_text(&mut headers, HEADER_EMITTED_BY, who);
    }
    if !headers.inner().is_empty() {
        properties = properties.with_headers(headers);
    }
    Ok((
        with_metadata_properties(properties, &d.envelope.meta)?,
        MatchKey::MessageId(message_id),
    ))
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
        properties = properties.with_correlation_id(short(id.clone())?);
    }
    if let Some(ms) = meta.expiration_ms {
        properties = properties.with_expiration(short(ms.to_string())?);
    }
    if let Some(p) = meta.priority {
        properties = properties.with_priority(p);
    }
    Ok(properties)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::envelope::{self, Envelope};
    use crate::lsn::Lsn;
    use crate::sink::Exchange;
    use amq_protocol::types::AMQPValue;
    use bytes::Bytes;

    fn delivery(env: Envelope) -> Delivery {
        Delivery {
            seq: 0,
            envelope: env,
            exchange: Exchange::Configured,
            lsn: Lsn(1),
            commit_lsn: Lsn(1),
            commit_time_us: 1,
            index_in_txn: 0,
            emitter_checked: false,
            attempt: 1,
            read_at: None,
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
            emitted_by_unchecked: false,
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
            let out = Encoder::new(shape, None)
                .encode(delivery(v3_envelope(full_meta())))
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
            // Not checked under lockdown: the emitter is not sent.
            assert_eq!(header(p, "x-pgoutbox-emitted-by"), None);
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
        let out = Encoder::new(PublishProperties::Minimal, None)
            .encode(delivery(env.clone()))
            .unwrap();
        let p = &out.properties;
        assert!(p.headers().is_none(), "{:?}", p.headers());
        assert!(p.correlation_id().is_none() && p.expiration().is_none() && p.priority().is_none());
        let out = Encoder::new(PublishProperties::Full, None)
            .encode(delivery(env))
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
    fn the_emitter_is_sent_only_when_checked_under_lockdown() {
        for shape in [PublishProperties::Full, PublishProperties::Minimal] {
            let mut d = delivery(v3_envelope(Metadata::default()));
            d.emitter_checked = true;
            let out = Encoder::new(shape, None).encode(d).unwrap();
            assert_eq!(
                header(&out.properties, "x-pgoutbox-emitted-by"),
                text("app")
            );
        }
    }
}
