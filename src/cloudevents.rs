//! CloudEvents over AMQP: `run --cloudevents` publishes every outbox message as a
//! CloudEvent in the **binary content mode** of the CloudEvents AMQP protocol binding.
//!
//! The binding ("AMQP Protocol Binding for CloudEvents", cloudevents/spec,
//! `cloudevents/bindings/amqp-protocol-binding.md`; released 1.0.2 and the current text)
//! says, and this module follows:
//! - §1.3 and §3.1: in binary mode the event data is the message body as is, the
//!   `datacontenttype` attribute is the AMQP `content-type` property (§3.1.1), and every
//!   other attribute is one application property (§3.1.3);
//! - §3.1.3.1: the property name is the attribute name behind a prefix. The released 1.0.2
//!   text knows `cloudEvents:` only; the current text allows `cloudEvents_` or
//!   `cloudEvents:`, prefers `_` (JMS 2.0 selectors cannot name a property with `:`), and
//!   requires that one message use one separator for all its attributes. [`Prefix`] is
//!   one of those two, nothing else;
//! - §3.1.3.2: values are the AMQP type of the attribute's CloudEvents type or its canonical
//!   string. Every attribute here is a string (String, URI-reference) except `time`
//!   (Timestamp), which is sent as its canonical string, RFC 3339: an AMQP 0-9-1 timestamp
//!   has whole seconds only, the commit time has microseconds.
//!
//! The attributes of one outbox message (CloudEvents 1.0 core, `cloudevents/spec.md`):
//!
//! | attribute         | value                                                          |
//! |-------------------|----------------------------------------------------------------|
//! | `id`              | the envelope's message id                                      |
//! | `source`          | [`Binding::source`]: `--cloudevents-source`, else [`default_source`] |
//! | `specversion`     | `1.0`                                                          |
//! | `type`            | the topic                                                      |
//! | `time`            | the commit time, RFC 3339 in UTC with microseconds             |
//! | `subject`         | the aggregate id, only when the producer gave one              |
//! | `datacontenttype` | the AMQP `content-type` property (the envelope's content type) |
//!
//! pgoutbox publishes with AMQP 0-9-1, where these are message headers. RabbitMQ shows
//! 0-9-1 headers whose names do not start with `x-` to AMQP 1.0 consumers as
//! application properties, and a long-string value shorter than 256 bytes of UTF-8 as an
//! AMQP string (RabbitMQ docs, "Inter-Protocol Property Conversions", AMQP 0.9.1 ->
//! AMQP 1.0; RabbitMQ 3.13 and later): hence the 255-byte bound on the source.
//!
//! Pure: no I/O. [`Binding::binary_mode`] maps one envelope and its commit time;
//! [`BinaryMode::apply`] puts the result into the AMQP properties built for the message.

use std::collections::BTreeMap;
use std::fmt;
use std::str::FromStr;

use amq_protocol::protocol::BasicProperties;
use amq_protocol::types::{AMQPValue, LongString, ShortString};

use crate::envelope::Envelope;

/// The value of the `specversion` attribute: CloudEvents 1.0.
pub const SPEC_VERSION: &str = "1.0";

/// The longest `source`, in bytes: RabbitMQ hands longer header strings to AMQP 1.0
/// consumers as binary rather than as the string the binding requires (see the module
/// docs).
pub const MAX_SOURCE_BYTES: usize = 255;

/// The scheme of [`default_source`].
pub const DEFAULT_SOURCE_SCHEME: &str = "pgoutbox";

/// The application-property name prefix (binding §3.1.3.1): one of the two the binding
/// allows, used for every attribute of every message.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Prefix {
    /// `cloudEvents_`: allowed by the current binding text and preferred there (JMS 2.0
    /// clients and selectors can use it). The default.
    #[default]
    Underscore,
    /// `cloudEvents:`: the only prefix of the released 1.0.2 text.
    Colon,
}

impl Prefix {
    /// The prefix as written in property names.
    #[must_use]
    pub fn as_str(self) -> &'static str {
        match self {
            Prefix::Underscore => "cloudEvents_",
            Prefix::Colon => "cloudEvents:",
        }
    }

    /// The other allowed prefix.
    fn other(self) -> Prefix {
        match self {
            Prefix::Underscore => Prefix::Colon,
            Prefix::Colon => Prefix::Underscore,
        }
    }
}

impl fmt::Display for Prefix {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A `--cloudevents-prefix` that is neither `cloudEvents_` nor `cloudEvents:`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "{given:?} is not a CloudEvents AMQP property prefix: use cloudEvents_ (the default, \
     preferred by the current AMQP binding text, JMS-safe) or cloudEvents: (the released 1.0.2 \
     text); the binding (section 3.1.3.1) allows no other, and the case matters"
)]
pub struct PrefixError {
    /// The value given.
    pub given: String,
}

impl FromStr for Prefix {
    type Err = PrefixError;

    /// Exactly `cloudEvents_` or `cloudEvents:` (case-sensitive, as property names are).
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "cloudEvents_" => Ok(Prefix::Underscore),
            "cloudEvents:" => Ok(Prefix::Colon),
            _ => Err(PrefixError { given: s.into() }),
        }
    }
}

impl TryFrom<String> for Prefix {
    type Error = PrefixError;

    fn try_from(s: String) -> Result<Self, Self::Error> {
        s.parse()
    }
}

/// The CloudEvents settings of `run --cloudevents`: the `source` of every event and the
/// property prefix.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Binding {
    /// The `source` attribute (a URI-reference, RFC 3986 §4.1), the same for every event of
    /// this streamer: `--cloudevents-source`, or [`default_source`].
    pub source: String,
    /// The application-property prefix.
    pub prefix: Prefix,
}

impl Binding {
    /// Checks [`Binding::source`]: a non-empty URI-reference (RFC 3986 §4.1; the CloudEvents
    /// type of `source`) of at most [`MAX_SOURCE_BYTES`] bytes.
    ///
    /// # Errors
    /// The rule broken and how to fix it, as text (the caller names the setting).
    pub fn validate(&self) -> Result<(), String> {
        let rule = "the CloudEvents source must be a non-empty URI-reference (RFC 3986), at \
                    most 255 bytes, such as pgoutbox:///orders/pgoutbox, \
                    https://example.com/orders or /orders/outbox; percent-encode spaces and \
                    other characters a URI cannot hold";
        if self.source.is_empty() {
            return Err(format!("empty; {rule}"));
        }
        if self.source.len() > MAX_SOURCE_BYTES {
            return Err(format!(
                "{} bytes long; {rule} (RabbitMQ shows longer header strings to AMQP 1.0 \
                 consumers as binary, not as a string)",
                self.source.len()
            ));
        }
        iri_string::types::UriReferenceStr::new(&self.source)
            .map(|_| ())
            .map_err(|_| format!("not a URI-reference; {rule}"))
    }

    /// The CloudEvent of one outbox message in binary content mode (see the module docs for
    /// each attribute): `env` is the decoded envelope, `commit_time_us` its transaction's
    /// commit time in microseconds since the Unix epoch (the `x-pgoutbox-commit-time-us`
    /// header).
    ///
    /// `time` is left out for a commit time outside the years 0000 to 9999, which RFC 3339
    /// cannot write (the attribute is optional); `subject` when there is no aggregate id
    /// (or an empty one: CloudEvents requires a non-empty subject), and the content type
    /// when it is empty.
    #[must_use]
    pub fn binary_mode(&self, env: &Envelope, commit_time_us: i64) -> BinaryMode {
        let mut attributes = vec![
            ("specversion", SPEC_VERSION.to_owned()),
            ("id", env.message_id.clone()),
            ("source", self.source.clone()),
            ("type", env.topic.clone()),
        ];
        if let Some(time) = rfc3339_micros(commit_time_us) {
            attributes.push(("time", time));
        }
        if let Some(subject) = env.meta.aggregate_id.as_ref().filter(|s| !s.is_empty()) {
            attributes.push(("subject", subject.clone()));
        }
        let application_properties = attributes
            .into_iter()
            .filter_map(|(name, value)| {
                // Names are at most 12 + 11 bytes; a value is a long string.
                let name = ShortString::try_new(format!("{}{name}", self.prefix)).ok()?;
                Some((name, AMQPValue::LongString(LongString::from(value))))
            })
            .collect();
        BinaryMode {
            prefix: self.prefix,
            datacontenttype: (!env.content_type.is_empty())
                .then(|| ShortString::try_new(env.content_type.clone()).ok())
                .flatten(),
            application_properties,
        }
    }
}

/// The URI-reference used as `source` when `--cloudevents-source` is not given:
/// `pgoutbox:///DATABASE/SLOT`, the database name percent-encoded as a path segment.
///
/// An absolute URI (which CloudEvents recommends) in an application-specific scheme (which
/// it allows), with an empty authority: no host, on purpose. Consumers may take events
/// with the same `source` and `id` for duplicates (CloudEvents 1.0, `id`), and a message
/// delivered again after a failover to another server, or through another address of a
/// multi-host `--database-url`, must keep its `source` for that to work. The database and
/// the slot name the stream of events; set `--cloudevents-source` when several clusters
/// with the same database and slot names publish to one place and producers choose their
/// own message ids.
#[must_use]
pub fn default_source(database: &str, slot: &str) -> String {
    use percent_encoding::{utf8_percent_encode, NON_ALPHANUMERIC};
    // RFC 3986 unreserved characters stay; everything else is percent-encoded.
    const SEGMENT: &percent_encoding::AsciiSet = &NON_ALPHANUMERIC
        .remove(b'-')
        .remove(b'.')
        .remove(b'_')
        .remove(b'~');
    format!(
        "{DEFAULT_SOURCE_SCHEME}:///{}/{}",
        utf8_percent_encode(database, SEGMENT),
        utf8_percent_encode(slot, SEGMENT)
    )
}

/// The CloudEvents part of one AMQP message, from [`Binding::binary_mode`].
#[derive(Debug, Clone, PartialEq)]
pub struct BinaryMode {
    prefix: Prefix,
    /// The `datacontenttype` attribute, for the AMQP `content-type` property (binding
    /// §3.1.1); `None` for an empty content type.
    pub datacontenttype: Option<ShortString>,
    /// Every other attribute: (prefixed property name, long-string value), in the order
    /// `specversion`, `id`, `source`, `type`, `time`, `subject` (binding §3.1.3).
    pub application_properties: Vec<(ShortString, AMQPValue)>,
}

impl BinaryMode {
    /// Puts the event into `properties` (built for the same message): the content type, and
    /// the attributes among the headers, which RabbitMQ shows to AMQP 1.0 consumers as
    /// application properties.
    ///
    /// The producer's own headers are kept. One of them spelled with the other prefix
    /// (`cloudEvents:x` under `cloudEvents_`) is an extension attribute written with the
    /// other separator: it is renamed to this prefix, so that the message uses one separator
    /// throughout (binding §3.1.3.1), unless the producer also gave it with this prefix
    /// (that one is kept). A producer header named like one of the attributes above is
    /// replaced by the attribute.
    #[must_use]
    pub fn apply(self, properties: BasicProperties) -> BasicProperties {
        let mut headers: BTreeMap<ShortString, AMQPValue> = properties
            .headers()
            .as_ref()
            .map(|t| t.inner().clone())
            .unwrap_or_default();
        let other = self.prefix.other().as_str();
        let misspelled: Vec<ShortString> = headers
            .keys()
            .filter(|k| k.as_str().starts_with(other))
            .cloned()
            .collect();
        for key in misspelled {
            if let Some(value) = headers.remove(&key) {
                let renamed = format!("{}{}", self.prefix, &key.as_str()[other.len()..]);
                // Same length as the key (both prefixes are 12 bytes), so it fits.
                if let Ok(renamed) = ShortString::try_new(renamed) {
                    headers.entry(renamed).or_insert(value);
                }
            }
        }
        headers.extend(self.application_properties);
        let properties = properties.with_headers(headers.into());
        match self.datacontenttype {
            Some(content_type) => properties.with_content_type(content_type),
            None => properties,
        }
    }
}

/// The text of the `time` attribute: RFC 3339's `date-time` in UTC with six fraction
/// digits, e.g. `2026-12-01T20:11:35.000042Z`.
const RFC3339_MICROS: &[time::format_description::BorrowedFormatItem<'static>] = time::macros::format_description!(
    "[year]-[month]-[day]T[hour]:[minute]:[second].[subsecond digits:6]Z"
);

/// `us` (microseconds since the Unix epoch, UTC) as RFC 3339 text with six fraction digits
/// and `Z`, e.g. `2026-12-01T20:11:35.123456Z`, before 1970 too (`-1` is
/// `1969-12-31T23:59:59.999999Z`); `None` outside the years 0000 to 9999, which RFC 3339
/// cannot write. The calendar is the `time` crate's.
#[must_use]
pub fn rfc3339_micros(us: i64) -> Option<String> {
    let t = time::OffsetDateTime::from_unix_timestamp_nanos(i128::from(us) * 1000).ok()?;
    if !(0..=9999).contains(&t.year()) {
        return None;
    }
    t.format(RFC3339_MICROS).ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use amq_protocol::types::FieldTable;
    use bytes::Bytes;
    use proptest::prelude::*;
    use serde_json::Map;

    fn envelope(aggregate_id: Option<&str>) -> Envelope {
        Envelope {
            message_id: "3f1c-id".into(),
            topic: "orders.created".into(),
            content_type: "application/json".into(),
            headers: Map::new(),
            payload: Bytes::from_static(b"{}"),
            emitted_by: None,
            emitted_by_unchecked: false,
            version: crate::envelope::VERSION_3,
            exchange: None,
            meta: crate::envelope::Metadata {
                aggregate_id: aggregate_id.map(Into::into),
                ..Default::default()
            },
        }
    }

    fn binding(prefix: Prefix) -> Binding {
        Binding {
            source: "pgoutbox:///orders/pgoutbox".into(),
            prefix,
        }
    }

    fn text(v: &AMQPValue) -> String {
        match v {
            AMQPValue::LongString(s) => String::from_utf8(s.as_bytes().to_vec()).unwrap(),
            other => panic!("not a long string: {other:?}"),
        }
    }

    /// 2026-12-01T20:11:35.000042Z.
    const COMMIT_US: i64 = 1_796_155_895_000_042;

    #[test]
    fn every_attribute_field_by_field() {
        for (prefix, p) in [
            (Prefix::Underscore, "cloudEvents_"),
            (Prefix::Colon, "cloudEvents:"),
        ] {
            let ce = binding(prefix).binary_mode(&envelope(Some("order-42")), COMMIT_US);
            let got: Vec<(String, String)> = ce
                .application_properties
                .iter()
                .map(|(k, v)| (k.as_str().to_owned(), text(v)))
                .collect();
            let want = [
                ("specversion", "1.0"),
                ("id", "3f1c-id"),
                ("source", "pgoutbox:///orders/pgoutbox"),
                ("type", "orders.created"),
                ("time", "2026-12-01T20:11:35.000042Z"),
                ("subject", "order-42"),
            ]
            .map(|(k, v)| (format!("{p}{k}"), v.to_owned()));
            assert_eq!(got, want);
            // datacontenttype is the content-type property, not an application property.
            assert_eq!(
                ce.datacontenttype.as_ref().map(ShortString::as_str),
                Some("application/json")
            );
            assert!(!got.iter().any(|(k, _)| k.ends_with("datacontenttype")));
        }
    }

    #[test]
    fn subject_only_with_an_aggregate_id() {
        for env in [envelope(None), envelope(Some(""))] {
            let ce = binding(Prefix::Underscore).binary_mode(&env, COMMIT_US);
            assert_eq!(ce.application_properties.len(), 5);
            assert!(!ce
                .application_properties
                .iter()
                .any(|(k, _)| k.as_str() == "cloudEvents_subject"));
        }
    }

    #[test]
    fn no_time_outside_rfc3339_years_and_no_content_type_when_empty() {
        let mut env = envelope(None);
        env.content_type.clear();
        let ce = binding(Prefix::Underscore).binary_mode(&env, i64::MAX);
        assert!(!ce
            .application_properties
            .iter()
            .any(|(k, _)| k.as_str().ends_with("time")));
        assert_eq!(ce.datacontenttype, None);
    }

    #[test]
    fn apply_keeps_ours_and_the_producers_with_one_separator() {
        let mut headers = FieldTable::default();
        headers.insert("x-pgoutbox-lsn".into(), AMQPValue::LongString("0/1".into()));
        headers.insert("tenant".into(), AMQPValue::LongString("acme".into()));
        // An extension attribute with the other separator: renamed.
        headers.insert(
            "cloudEvents:partitionkey".into(),
            AMQPValue::LongString("p1".into()),
        );
        // Given with both separators: the one with ours wins.
        headers.insert(
            "cloudEvents:traceparent".into(),
            AMQPValue::LongString("colon".into()),
        );
        headers.insert(
            "cloudEvents_traceparent".into(),
            AMQPValue::LongString("under".into()),
        );
        // A producer header named like one of our attributes: ours replaces it.
        headers.insert(
            "cloudEvents:id".into(),
            AMQPValue::LongString("forged".into()),
        );
        let props = BasicProperties::default()
            .with_content_type("text/plain".into())
            .with_headers(headers);
        let out = binding(Prefix::Underscore)
            .binary_mode(&envelope(None), COMMIT_US)
            .apply(props);
        let h = out.headers().clone().unwrap();
        let h = h.inner();
        let get = |k: &str| h.get(k).map(text);
        assert_eq!(get("x-pgoutbox-lsn").as_deref(), Some("0/1"));
        assert_eq!(get("tenant").as_deref(), Some("acme"));
        assert_eq!(get("cloudEvents_partitionkey").as_deref(), Some("p1"));
        assert_eq!(get("cloudEvents_traceparent").as_deref(), Some("under"));
        assert_eq!(get("cloudEvents_id").as_deref(), Some("3f1c-id"));
        assert_eq!(get("cloudEvents_specversion").as_deref(), Some("1.0"));
        assert!(
            !h.keys().any(|k| k.as_str().starts_with("cloudEvents:")),
            "{h:?}"
        );
        assert_eq!(
            out.content_type().as_ref().map(ShortString::as_str),
            Some("application/json")
        );
        // Without headers before: the attributes alone.
        let out = binding(Prefix::Colon)
            .binary_mode(&envelope(None), COMMIT_US)
            .apply(BasicProperties::default());
        let h = out.headers().clone().unwrap();
        assert_eq!(h.inner().len(), 5);
        assert!(h
            .inner()
            .keys()
            .all(|k| k.as_str().starts_with("cloudEvents:")));
    }

    #[test]
    fn prefix_is_one_of_two_exactly() {
        assert_eq!("cloudEvents_".parse::<Prefix>(), Ok(Prefix::Underscore));
        assert_eq!("cloudEvents:".parse::<Prefix>(), Ok(Prefix::Colon));
        assert_eq!(Prefix::default(), Prefix::Underscore);
        for bad in [
            "",
            "cloudevents_",
            "CloudEvents_",
            "cloudEvents",
            "cloudEvents-",
            "ce_",
            "cloudEvents_ ",
        ] {
            let e = bad.parse::<Prefix>().unwrap_err().to_string();
            assert!(
                e.contains(&format!("{bad:?}"))
                    && e.contains("cloudEvents_")
                    && e.contains("cloudEvents:"),
                "{e}"
            );
        }
        assert_eq!(Prefix::Colon.to_string(), "cloudEvents:");
    }

    #[test]
    fn source_rules() {
        let check = |s: &str| {
            Binding {
                source: s.into(),
                prefix: Prefix::Underscore,
            }
            .validate()
        };
        for ok in [
            "pgoutbox:///orders/pgoutbox",
            "https://github.com/cloudevents",
            "urn:uuid:6e8bc430-9c3a-11d9-9669-0800200c9a66",
            "/sensors/tn-1234567/alerts",
            "1-555-123-4567",
            "mailto:cncf-wg-serverless@lists.cncf.io",
        ] {
            assert_eq!(check(ok), Ok(()), "{ok}");
        }
        assert!(check("").unwrap_err().starts_with("empty"));
        for bad in [
            "has space",
            "http://x/<y>",
            "caf\u{e9}",
            "a%zz",
            "http://[::1",
        ] {
            let e = check(bad).unwrap_err();
            assert!(
                e.contains("not a URI-reference") && e.contains("RFC 3986"),
                "{bad}: {e}"
            );
        }
        let e = check(&format!("/{}", "a".repeat(255))).unwrap_err();
        assert!(e.starts_with("256 bytes long"), "{e}");
        assert_eq!(check(&format!("/{}", "a".repeat(254))), Ok(()));
    }

    #[test]
    fn default_source_is_a_valid_absolute_uri() {
        assert_eq!(
            default_source("orders", "pgoutbox"),
            "pgoutbox:///orders/pgoutbox"
        );
        let odd = default_source("my db/ü?#%", "slot_1");
        assert_eq!(odd, "pgoutbox:///my%20db%2F%C3%BC%3F%23%25/slot_1");
        for s in [odd, default_source("orders", "pgoutbox")] {
            assert!(iri_string::types::UriStr::new(&s).is_ok(), "{s}");
        }
    }

    #[test]
    fn rfc3339_known_instants() {
        let cases = [
            (0, "1970-01-01T00:00:00.000000Z"),
            (-1, "1969-12-31T23:59:59.999999Z"),
            (951_782_400_000_000, "2000-02-29T00:00:00.000000Z"),
            (951_868_799_999_999, "2000-02-29T23:59:59.999999Z"),
            (4_107_542_400_000_000, "2100-03-01T00:00:00.000000Z"),
            (COMMIT_US, "2026-12-01T20:11:35.000042Z"),
            (253_402_300_799_999_999, "9999-12-31T23:59:59.999999Z"),
            (-62_167_219_200_000_000, "0000-01-01T00:00:00.000000Z"),
        ];
        for (us, want) in cases {
            assert_eq!(rfc3339_micros(us).as_deref(), Some(want), "{us}");
        }
        assert_eq!(rfc3339_micros(253_402_300_800_000_000), None);
        assert_eq!(rfc3339_micros(-62_167_219_200_000_001), None);
        assert_eq!(rfc3339_micros(i64::MIN), None);
        assert_eq!(rfc3339_micros(i64::MAX), None);
    }

    /// `text` read back by the `time` crate's RFC 3339 parser, in microseconds.
    fn parsed_back(text: &str) -> i64 {
        let t = time::OffsetDateTime::parse(text, &time::format_description::well_known::Rfc3339)
            .unwrap_or_else(|e| panic!("{text:?} is not RFC 3339: {e}"));
        i64::try_from(t.unix_timestamp_nanos() / 1000).unwrap()
    }

    /// The shape of every `time` value: 27 bytes, `T`, six fraction digits, `Z`.
    fn well_formed(text: &str) -> bool {
        let b = text.as_bytes();
        b.len() == 27
            && b[10] == b'T'
            && b[19] == b'.'
            && b[26] == b'Z'
            && b[20..26].iter().all(u8::is_ascii_digit)
    }

    #[test]
    fn rfc3339_round_trips_across_the_calendar() {
        // Every 7th day from 0000-01-01 to 9999-12-31, a microsecond before and at midnight
        // (before 1970 too): every month length, leap rule and era boundary comes by.
        let first = -62_167_219_200i64 / 86_400;
        let last = 253_402_300_799i64 / 86_400;
        for day in (first..=last).step_by(7) {
            for us in [day * 86_400_000_000, day * 86_400_000_000 - 1] {
                if us >= -62_167_219_200_000_000 {
                    let text = rfc3339_micros(us).unwrap();
                    assert!(well_formed(&text), "{us}: {text}");
                    assert_eq!(parsed_back(&text), us, "{text}");
                }
            }
        }
    }

    proptest! {
        /// Valid RFC 3339 that reads back as the same microsecond, years 0000 to 9999
        /// (`PROPTEST_CASES` cases).
        #[test]
        fn rfc3339_reads_back_as_the_same_instant(us in -62_167_219_200_000_000i64..=253_402_300_799_999_999) {
            let text = rfc3339_micros(us).unwrap();
            prop_assert!(well_formed(&text), "{}", text);
            prop_assert_eq!(parsed_back(&text), us);
        }
    }
}
