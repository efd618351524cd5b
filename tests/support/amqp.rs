//! AMQP helpers (lapin) for asserting on what the streamer published.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use lapin::options::{
    BasicAckOptions, BasicGetOptions, BasicPublishOptions, ConfirmSelectOptions,
    ExchangeDeclareOptions, QueueBindOptions, QueueDeclareOptions, QueuePurgeOptions,
};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, Connection, ConnectionProperties, ExchangeKind};

/// One message taken from a queue.
#[derive(Debug, Clone, PartialEq)]
pub struct Received {
    /// Payload.
    pub body: Vec<u8>,
    /// `message_id` property.
    pub message_id: Option<String>,
    /// Routing key it was published with.
    pub routing_key: String,
    /// Exchange it was published to.
    pub exchange: String,
    /// `content_type` property.
    pub content_type: Option<String>,
    /// Headers, values rendered to strings (strings as-is, numbers/bools via
    /// Display, byte arrays lossily as UTF-8, nested values as Debug). An integer and a
    /// string header render alike here: assert types on [`Received::header_values`].
    pub headers: BTreeMap<String, String>,
    /// Headers as received, with their AMQP field types.
    pub header_values: BTreeMap<String, AMQPValue>,
    /// `timestamp` property (seconds).
    pub timestamp: Option<u64>,
    /// `delivery_mode` property (2 = persistent).
    pub delivery_mode: Option<u8>,
    /// Whether the broker marked it redelivered.
    pub redelivered: bool,
}

impl Received {
    /// Body as UTF-8 (lossy).
    pub fn body_str(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }

    /// The AMQP field type of header `key`, if present.
    pub fn header_kind(&self, key: &str) -> Option<HeaderKind> {
        self.header_values.get(key).map(HeaderKind::of)
    }

    /// Body parsed as JSON (panics if not JSON).
    pub fn body_json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body).expect("body is not JSON")
    }
}

/// The type of an AMQP header value, as far as the tests care.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HeaderKind {
    /// A long or short string.
    Text,
    /// Any integer field type, with its width in bits.
    Int(u8),
    /// A 32- or 64-bit float, with its width in bits.
    Float(u8),
    /// A boolean.
    Bool,
    /// Void (no value).
    Void,
    /// Anything else (tables, arrays, timestamps, byte arrays, decimals).
    Other,
}

impl HeaderKind {
    /// The kind of `v`.
    pub fn of(v: &AMQPValue) -> HeaderKind {
        match v {
            AMQPValue::ShortString(_) | AMQPValue::LongString(_) => HeaderKind::Text,
            AMQPValue::ShortShortInt(_) | AMQPValue::ShortShortUInt(_) => HeaderKind::Int(8),
            AMQPValue::ShortInt(_) | AMQPValue::ShortUInt(_) => HeaderKind::Int(16),
            AMQPValue::LongInt(_) | AMQPValue::LongUInt(_) => HeaderKind::Int(32),
            AMQPValue::LongLongInt(_) => HeaderKind::Int(64),
            AMQPValue::Float(_) => HeaderKind::Float(32),
            AMQPValue::Double(_) => HeaderKind::Float(64),
            AMQPValue::Boolean(_) => HeaderKind::Bool,
            AMQPValue::Void => HeaderKind::Void,
            _ => HeaderKind::Other,
        }
    }
}

/// Connect to the broker (retrying for up to 10 s × scale, e.g. right after
/// `start_app`).
pub async fn amqp_connect(amqp_url: &str) -> Connection {
    let deadline = Instant::now() + super::scaled(Duration::from_secs(10));
    loop {
        match Connection::connect(amqp_url, ConnectionProperties::default()).await {
            Ok(c) => return c,
            Err(e) if Instant::now() < deadline => {
                let _ = e;
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(e) => panic!("AMQP connect {amqp_url}: {e:?}"),
        }
    }
}

async fn close(conn: Connection) {
    let _ = conn.close(200, "bye".into()).await;
}

/// Declare a durable topic `exchange`, a durable classic `queue`, and bind
/// them with `binding_key` (`#` = everything). Idempotent.
pub async fn declare_bound_queue(amqp_url: &str, exchange: &str, queue: &str, binding_key: &str) {
    let conn = amqp_connect(amqp_url).await;
    let ch = conn.create_channel().await.expect("channel");
    ch.exchange_declare(
        exchange.into(),
        ExchangeKind::Topic,
        ExchangeDeclareOptions {
            durable: true,
            ..Default::default()
        },
        FieldTable::default(),
    )
    .await
    .expect("exchange_declare");
    let mut args = FieldTable::default();
    args.insert(
        "x-queue-type".into(),
        AMQPValue::LongString("classic".into()),
    );
    ch.queue_declare(
        queue.into(),
        QueueDeclareOptions {
            durable: true,
            ..Default::default()
        },
        args,
    )
    .await
    .expect("queue_declare");
    ch.queue_bind(
        queue.into(),
        exchange.into(),
        binding_key.into(),
        QueueBindOptions::default(),
        FieldTable::default(),
    )
    .await
    .expect("queue_bind");
    close(conn).await;
}

/// Publish one message (with publisher confirm) — for harness tests or to
/// pre-fill queues. Panics if not confirmed (acked).
pub async fn publish(
    amqp_url: &str,
    exchange: &str,
    routing_key: &str,
    body: &[u8],
    props: BasicProperties,
) {
    let conn = amqp_connect(amqp_url).await;
    let ch = conn.create_channel().await.expect("channel");
    ch.confirm_select(ConfirmSelectOptions::default())
        .await
        .expect("confirm_select");
    let confirm = ch
        .basic_publish(
            exchange.into(),
            routing_key.into(),
            BasicPublishOptions::default(),
            body,
            props,
        )
        .await
        .expect("basic_publish")
        .await
        .expect("publisher confirm");
    assert!(confirm.is_ack(), "publish not acked: {confirm:?}");
    close(conn).await;
}

/// Number of ready messages in `queue` (passive declare).
pub async fn queue_len(amqp_url: &str, queue: &str) -> u32 {
    let conn = amqp_connect(amqp_url).await;
    let ch = conn.create_channel().await.expect("channel");
    let q = ch
        .queue_declare(
            queue.into(),
            QueueDeclareOptions {
                passive: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await
        .expect("passive queue_declare");
    close(conn).await;
    q.message_count()
}

/// Purge `queue`; returns how many messages were dropped.
pub async fn purge_queue(amqp_url: &str, queue: &str) -> u32 {
    let conn = amqp_connect(amqp_url).await;
    let ch = conn.create_channel().await.expect("channel");
    let n = ch
        .queue_purge(queue.into(), QueuePurgeOptions::default())
        .await
        .expect("queue_purge");
    close(conn).await;
    n
}

/// Consume (basic.get loop, acking each message) until `expected` distinct
/// messages (by `message_id`; a message without one counts on its own) arrived
/// — then keep polling for a short grace period (300 ms × scale) to catch
/// unexpected extras — or until `idle_timeout` passes without any new message.
/// Duplicates never count towards `expected`: a run with redeliveries must not
/// stop before the last distinct message arrived. Returns everything received,
/// duplicates included, in queue order.
pub async fn drain_queue(
    amqp_url: &str,
    queue: &str,
    expected: usize,
    idle_timeout: Duration,
) -> Vec<Received> {
    let grace = super::scaled(Duration::from_millis(300));
    let conn = amqp_connect(amqp_url).await;
    let ch = conn.create_channel().await.expect("channel");
    let mut got: Vec<Received> = Vec::new();
    let mut distinct = std::collections::HashSet::new();
    let mut anonymous = 0usize;
    let mut last_new = Instant::now();
    loop {
        let msg = ch
            .basic_get(queue.into(), BasicGetOptions::default())
            .await
            .expect("basic_get");
        match msg {
            Some(m) => {
                let d = m.delivery;
                d.ack(BasicAckOptions::default()).await.expect("ack");
                let m = to_received(
                    d.exchange.as_str(),
                    d.routing_key.as_str(),
                    d.redelivered,
                    &d.properties,
                    d.data,
                );
                match &m.message_id {
                    Some(id) => {
                        distinct.insert(id.clone());
                    }
                    None => anonymous += 1,
                }
                got.push(m);
                last_new = Instant::now();
            }
            None => {
                let idle = last_new.elapsed();
                if distinct.len() + anonymous >= expected && idle >= grace {
                    break;
                }
                if idle >= idle_timeout {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
    close(conn).await;
    got
}

/// Converts a delivery's parts into a [`Received`].
pub fn to_received(
    exchange: &str,
    routing_key: &str,
    redelivered: bool,
    p: &BasicProperties,
    body: Vec<u8>,
) -> Received {
    let header_values: BTreeMap<String, AMQPValue> = p
        .headers()
        .as_ref()
        .map(|t| {
            t.inner()
                .iter()
                .map(|(k, v)| (k.as_str().to_owned(), v.clone()))
                .collect()
        })
        .unwrap_or_default();
    let headers = header_values
        .iter()
        .map(|(k, v)| (k.clone(), render(v)))
        .collect();
    Received {
        body,
        message_id: p.message_id().as_ref().map(|s| s.as_str().to_owned()),
        routing_key: routing_key.to_owned(),
        exchange: exchange.to_owned(),
        content_type: p.content_type().as_ref().map(|s| s.as_str().to_owned()),
        headers,
        header_values,
        timestamp: *p.timestamp(),
        delivery_mode: *p.delivery_mode(),
        redelivered,
    }
}

/// Render an AMQP header value as a string.
pub fn render(v: &AMQPValue) -> String {
    match v {
        AMQPValue::Boolean(b) => b.to_string(),
        AMQPValue::ShortShortInt(n) => n.to_string(),
        AMQPValue::ShortShortUInt(n) => n.to_string(),
        AMQPValue::ShortInt(n) => n.to_string(),
        AMQPValue::ShortUInt(n) => n.to_string(),
        AMQPValue::LongInt(n) => n.to_string(),
        AMQPValue::LongUInt(n) => n.to_string(),
        AMQPValue::LongLongInt(n) => n.to_string(),
        AMQPValue::Float(n) => n.to_string(),
        AMQPValue::Double(n) => n.to_string(),
        AMQPValue::ShortString(s) => s.as_str().to_owned(),
        AMQPValue::LongString(s) => String::from_utf8_lossy(s.as_bytes()).into_owned(),
        AMQPValue::Timestamp(t) => t.to_string(),
        AMQPValue::ByteArray(b) => String::from_utf8_lossy(b.as_slice()).into_owned(),
        AMQPValue::Void => String::new(),
        other => format!("{other:?}"),
    }
}
