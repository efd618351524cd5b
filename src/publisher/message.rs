//! One message ready for `basic.publish`, and the mapping of JSON producer headers to an
//! AMQP field table.

use amq_protocol::protocol::BasicProperties;
use amq_protocol::types::{AMQPValue, FieldTable, LongString, ShortString};
use bytes::Bytes;

use crate::lsn::Lsn;

/// AMQP 0-9-1 delivery mode 2: persistent (the broker writes the message to disk).
pub const DELIVERY_MODE_PERSISTENT: u8 = 2;

pub use crate::routing::Exchange;

/// A message to publish.
#[derive(Debug)]
pub struct OutboundMessage<T> {
    /// The caller's tag, handed back with the outcome.
    pub tag: T,
    /// The exchange to publish to.
    pub exchange: Exchange,
    /// The routing key (at most 255 bytes, already validated).
    pub routing_key: ShortString,
    /// The body, byte-exact.
    pub body: Bytes,
    /// Properties (message_id, content_type, delivery mode, timestamp, headers).
    pub properties: BasicProperties,
    /// What a `basic.return` of this message will carry to identify it.
    pub match_key: MatchKey,
}

/// How a `basic.return` is matched to the publish it returns (AMQP 0-9-1 gives it no
/// delivery tag).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MatchKey {
    /// The message LSN, also carried as `X/Y` text in the [`super::MATCH_KEY_HEADER`]
    /// header: unique among unconfirmed publishes.
    Lsn(Lsn),
    /// The `message_id` property, for messages sent without our headers
    /// (`--publish-properties minimal`): producers may reuse an id, so a return marks every
    /// unconfirmed publish with that id.
    MessageId(ShortString),
}

/// Converts a producer's JSON header object into an AMQP field table.
///
/// Strings become long strings, booleans booleans, integers that fit `i64` long-long
/// integers, other numbers doubles, `null` void, and arrays or objects their JSON text as a
/// long string. Keys are at most 255 bytes (validated at emit time and when the envelope is
/// decoded); a longer key is skipped rather than panicking.
pub fn headers_from_json(headers: &serde_json::Map<String, serde_json::Value>) -> FieldTable {
    let mut table = FieldTable::default();
    for (key, value) in headers {
        let Ok(key) = ShortString::try_new(key.clone()) else {
            continue;
        };
        table.insert(key, json_to_amqp(value));
    }
    table
}

fn json_to_amqp(value: &serde_json::Value) -> AMQPValue {
    use serde_json::Value;
    match value {
        Value::Null => AMQPValue::Void,
        Value::Bool(b) => AMQPValue::Boolean(*b),
        Value::Number(n) => match n.as_i64() {
            Some(i) => AMQPValue::LongLongInt(i),
            None => AMQPValue::Double(n.as_f64().unwrap_or(f64::NAN)),
        },
        Value::String(s) => AMQPValue::LongString(LongString::from(s.as_str())),
        Value::Array(_) | Value::Object(_) => {
            AMQPValue::LongString(LongString::from(value.to_string()))
        }
    }
}

/// Adds a text header.
pub fn insert_text(table: &mut FieldTable, key: &'static str, value: String) {
    table.insert(ShortString::from(key), AMQPValue::LongString(value.into()));
}

/// Adds an integer header.
pub fn insert_i64(table: &mut FieldTable, key: &'static str, value: i64) {
    table.insert(ShortString::from(key), AMQPValue::LongLongInt(value));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn json_headers_map_to_amqp_types() {
        let json: serde_json::Value = serde_json::json!({
            "s": "text", "i": 42, "f": 1.5, "b": true, "n": null, "o": {"a": 1}, "a": [1, 2]
        });
        let table = headers_from_json(json.as_object().unwrap());
        let inner = table.inner();
        assert_eq!(inner.get("s"), Some(&AMQPValue::LongString("text".into())));
        assert_eq!(inner.get("i"), Some(&AMQPValue::LongLongInt(42)));
        assert_eq!(inner.get("f"), Some(&AMQPValue::Double(1.5)));
        assert_eq!(inner.get("b"), Some(&AMQPValue::Boolean(true)));
        assert_eq!(inner.get("n"), Some(&AMQPValue::Void));
        assert_eq!(
            inner.get("o"),
            Some(&AMQPValue::LongString("{\"a\":1}".into()))
        );
        assert_eq!(inner.get("a"), Some(&AMQPValue::LongString("[1,2]".into())));
    }

    #[test]
    fn overlong_key_is_skipped_not_panicking() {
        let mut map = serde_json::Map::new();
        map.insert("k".repeat(300), serde_json::Value::Bool(true));
        assert!(headers_from_json(&map).inner().is_empty());
    }
}
