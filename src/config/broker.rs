//! Where and how `run` publishes: the broker's nodes and the order they are tried in, the
//! exchange, which exchanges producers may name, and whether exchanges are declared.
//!
//! The URLs are kept as text: the publisher ([`crate::publisher`]) parses them when it
//! connects. So that a malformed URL is a usage error at start and not a connect failure
//! retried for ever, [`BrokerSettings::validate`] runs the publisher's own parser, handed in
//! by the edge that builds the settings (the settings do not import a transport).

use crate::connection_url::BrokerUrl;
use crate::validation::ValidationError;

pub use crate::partition::PartitionKey;
pub use crate::routing::AllowedExchanges;

/// Default exchange (durable topic).
pub const DEFAULT_EXCHANGE: &str = "pgoutbox";

/// The broker URL parser the edge hands to [`BrokerSettings::validate`]: `Err` carries why
/// the URL cannot be used (the publisher's `Endpoint::parse`).
pub type UrlCheck<'a> = &'a dyn Fn(&str) -> Result<(), String>;

/// Where `run` publishes (`--amqp-url`, `--amqp-url-order`, `--exchange`,
/// `--allowed-exchanges`, `--no-declare`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BrokerSettings {
    /// `amqp://` or `amqps://` URLs of the broker's nodes (TLS parameters in each query),
    /// at least one, as given (see [`split_amqp_urls`]); [`BrokerSettings::amqp_url_order`]
    /// says in which order they are tried.
    pub amqp_urls: Vec<BrokerUrl>,
    /// The order the nodes of `amqp_urls` are tried in (`--amqp-url-order`).
    pub amqp_url_order: AmqpUrlOrder,
    /// Durable topic exchange messages are published to when their producer named none.
    pub exchange: String,
    /// Which other exchanges producers may name (`--allowed-exchanges`).
    pub allowed_exchanges: AllowedExchanges,
    /// Declare exchanges, or only check them (`--no-declare`).
    pub exchange_declare: ExchangeDeclare,
    /// How many connections publish, and what keys a message's (`--partitions`,
    /// `--partition-key`).
    pub partitions: Partitions,
    /// `--stream`: publish into this RabbitMQ stream over the stream protocol instead of
    /// the exchange; `amqp_urls` then holds the `--stream-url` nodes.
    pub stream: Option<StreamSettings>,
    /// `--stream-max-length-bytes`: the stream's size limit when `run` creates it.
    pub stream_max_length_bytes: Option<u64>,
}

/// `run --stream-url URL --stream NAME`: every outbox message goes to the stream NAME over
/// RabbitMQ's stream protocol, deduplicated by publishing ids derived from the WAL
/// (docs/src/internals/stream-ids.md).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StreamSettings {
    /// The stream (`--stream`).
    pub stream: String,
    /// The producer name (`--stream-producer-name`); `None`: derived from the slot.
    pub producer_name: Option<String>,
    /// `--stream-max-age` when `run` creates the stream (`7D`, `12h`, ...: RabbitMQ's
    /// `x-max-age` units Y, M, D, h, m, s).
    pub max_age: Option<String>,
}

impl StreamSettings {
    /// The stream's creation arguments (stream protocol `Create`), with
    /// `--stream-max-length-bytes` (`max_length_bytes`, checked by
    /// [`super::numeric::STREAM_MAX_LENGTH_BYTES`]).
    pub fn arguments(&self, max_length_bytes: Option<u64>) -> Vec<(&'static str, String)> {
        let mut args = Vec::new();
        if let Some(age) = &self.max_age {
            args.push(("max-age", age.clone()));
        }
        if let Some(bytes) = max_length_bytes {
            args.push(("max-length-bytes", bytes.to_string()));
        }
        args
    }

    /// Checks the names and the creation arguments.
    ///
    /// # Errors
    /// [`ValidationError`] naming the setting, the value and the rule.
    pub fn validate(&self) -> Result<(), ValidationError> {
        if self.stream.is_empty() || self.stream.len() > 255 {
            return Err(ValidationError {
                setting: "--stream",
                value: self.stream.clone(),
                rule: "use 1 to 255 bytes (a RabbitMQ queue name)".into(),
            });
        }
        if let Some(name) = &self.producer_name {
            if name.is_empty() || name.len() > 256 {
                return Err(ValidationError {
                    setting: "--stream-producer-name",
                    value: name.clone(),
                    rule: "use 1 to 256 bytes (the stream protocol's publisher reference)".into(),
                });
            }
        }
        if let Some(age) = &self.max_age {
            let (digits, unit) = age.split_at(age.len().saturating_sub(1));
            let ok = !digits.is_empty()
                && digits.bytes().all(|b| b.is_ascii_digit())
                && digits.len() <= 9
                && matches!(unit, "Y" | "M" | "D" | "h" | "m" | "s");
            if !ok {
                return Err(ValidationError {
                    setting: "--stream-max-age",
                    value: age.clone(),
                    rule: "a whole number and one unit of Y, M, D, h, m, s (RabbitMQ's x-max-age), e.g. 7D or 12h".into(),
                });
            }
        }
        Ok(())
    }
}

/// `run --partitions N --partition-key K`: N AMQP connections, each message to the
/// partition of its key ([`crate::partition`] has the rule).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Partitions {
    /// 1 to [`crate::partition::MAX_PARTITIONS`] (checked by
    /// [`super::RunSettings::validate`], from [`super::numeric::PARTITIONS`]); 1 is one
    /// connection, as without partitions.
    pub count: u16,
    /// The envelope field that keys a message.
    pub key: PartitionKey,
}

impl Default for Partitions {
    fn default() -> Self {
        Partitions {
            count: 1,
            key: PartitionKey::AggregateId,
        }
    }
}

impl BrokerSettings {
    /// Checks the URLs (with `url_check`, the publisher's parser) and the exchange name.
    ///
    /// # Errors
    /// [`ValidationError`] for `--amqp-url` ([`validate_amqp_urls`]) or `--exchange` (1 to
    /// 255 bytes).
    pub fn validate(&self, url_check: UrlCheck<'_>) -> Result<(), ValidationError> {
        if let Some(stream) = &self.stream {
            stream.validate()?;
            return validate_urls(&self.amqp_urls, url_check, &STREAM_URLS);
        }
        validate_amqp_urls(&self.amqp_urls, url_check)?;
        if self.exchange.is_empty() || self.exchange.len() > 255 {
            return Err(ValidationError {
                setting: "--exchange",
                value: self.exchange.clone(),
                rule: "use 1 to 255 bytes (the default exchange \"\" cannot be declared)".into(),
            });
        }
        Ok(())
    }
}

/// How `run` makes sure an exchange exists before publishing to it: `--exchange` at
/// connect, and each exchange a producer names on its first use on a connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ExchangeDeclare {
    /// `exchange.declare` durable topic: created when absent (the default).
    #[default]
    DurableTopic,
    /// `--no-declare`: a passive `exchange.declare`, which only checks that it exists.
    /// A missing `--exchange` stops `run`; a missing producer-named exchange dead-letters
    /// the message as `exchange_not_found`.
    Passive,
}

/// The order in which the nodes named by `--amqp-url` are tried (`--amqp-url-order`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum AmqpUrlOrder {
    /// As given: the first pass starts at the first URL.
    #[default]
    InOrder,
    /// Shuffled once when `run` starts, so several streamers spread over the nodes; the
    /// shuffled order is then kept like an order given.
    Shuffle,
}

/// Splits `--amqp-url` values into one URL per node: each value may itself be a
/// comma-separated list (`PGOUTBOX_AMQP_URL=amqp://a,amqp://b`). A comma splits only where
/// `amqp://` or `amqps://` follows it, so a comma inside a URL (a password, a query) is
/// kept. Blanks around each URL are trimmed and empty pieces dropped.
pub fn split_amqp_urls<S: AsRef<str>>(values: &[S]) -> Vec<String> {
    let mut out = Vec::new();
    for value in values {
        let value = value.as_ref();
        let mut current = String::new();
        for (i, piece) in value.split(',').enumerate() {
            let trimmed = piece.trim_start();
            let starts_node = trimmed.starts_with("amqp://") || trimmed.starts_with("amqps://");
            if i > 0 && !starts_node {
                current.push(',');
                current.push_str(piece);
                continue;
            }
            push_url(&mut out, &current);
            current = piece.to_owned();
        }
        push_url(&mut out, &current);
    }
    out
}

/// Pushes one URL of [`split_amqp_urls`], without surrounding blanks or trailing commas
/// (`amqp://a,` ends a list), unless nothing is left.
fn push_url(out: &mut Vec<String>, piece: &str) {
    let url = piece.trim().trim_end_matches(',').trim_end();
    if !url.is_empty() {
        out.push(url.to_owned());
    }
}

/// Splits `--stream-url` values into one URL per node, as [`split_amqp_urls`] does (a
/// comma splits only where `rabbitmq-stream://` or `rabbitmq-stream+tls://` follows it).
pub fn split_stream_urls<S: AsRef<str>>(values: &[S]) -> Vec<String> {
    let mut out = Vec::new();
    for v in values {
        let v = v.as_ref();
        let mut start = 0;
        let mut i = 0;
        while let Some(at) = v[i..].find(',') {
            let comma = i + at;
            let after = v[comma + 1..].trim_start();
            if after.starts_with("rabbitmq-stream://")
                || after.starts_with("rabbitmq-stream+tls://")
            {
                push_url(&mut out, &v[start..comma]);
                start = comma + 1;
            }
            i = comma + 1;
        }
        push_url(&mut out, &v[start..]);
    }
    out
}

/// The nodes in the order `run` tries them: `urls` as given for
/// [`AmqpUrlOrder::InOrder`], shuffled with `seed` for [`AmqpUrlOrder::Shuffle`] (the
/// caller passes a random seed; a fixed one makes the order reproducible in tests).
pub fn order_amqp_urls(urls: &[BrokerUrl], order: AmqpUrlOrder, seed: u64) -> Vec<BrokerUrl> {
    let mut urls = urls.to_vec();
    if order == AmqpUrlOrder::Shuffle {
        fastrand::Rng::with_seed(seed).shuffle(&mut urls);
    }
    urls
}

/// Validates every `--amqp-url` (at least one, each `amqp://` or `amqps://` and parsed as
/// the publisher will parse it (`url_check`), TLS parameters included, so a malformed URL is a usage
/// error at start, not a connect failure retried for ever; the TLS files are read when
/// connecting).
///
/// # Errors
/// [`ValidationError`] for `--amqp-url` naming the (redacted) URL at fault, and which of
/// several it is.
pub fn validate_amqp_urls(
    urls: &[BrokerUrl],
    url_check: UrlCheck<'_>,
) -> Result<(), ValidationError> {
    validate_urls(urls, url_check, &AMQP_URLS)
}

/// One kind of broker URL, for [`validate_urls`].
struct UrlKind {
    setting: &'static str,
    schemes: [&'static str; 2],
    example: &'static str,
}

const AMQP_URLS: UrlKind = UrlKind {
    setting: "--amqp-url",
    schemes: ["amqp://", "amqps://"],
    example: "amqp://user:password@host:port/vhost",
};

const STREAM_URLS: UrlKind = UrlKind {
    setting: "--stream-url",
    schemes: ["rabbitmq-stream://", "rabbitmq-stream+tls://"],
    example: "rabbitmq-stream://user:password@host:5552/vhost",
};

fn validate_urls(
    urls: &[BrokerUrl],
    url_check: UrlCheck<'_>,
    kind: &UrlKind,
) -> Result<(), ValidationError> {
    if urls.is_empty() {
        return Err(ValidationError {
            setting: kind.setting,
            value: String::new(),
            rule: format!(
                "give at least one {} (repeat {}, or separate URLs with commas, for the nodes of a cluster)",
                kind.example, kind.setting
            ),
        });
    }
    for (i, url) in urls.iter().enumerate() {
        // Every error names the URL by its redacted form (BrokerUrl's Display) only.
        let shown = url.to_string();
        let text = url.expose_secret();
        let which = if urls.len() > 1 {
            format!(" (URL {} of {})", i + 1, urls.len())
        } else {
            String::new()
        };
        if !kind.schemes.iter().any(|s| text.starts_with(s)) {
            return Err(ValidationError {
                setting: kind.setting,
                value: format!("{shown}{which}"),
                rule: format!("expected {}", kind.example),
            });
        }
        if crate::redaction::at_after_authority(text) {
            return Err(ValidationError {
                setting: kind.setting,
                value: format!("{shown}{which}"),
                rule: "an '@' after the host (in the vhost or the query): a second URL glued on by a typo? Each URL of a list starts with amqp:// or amqps://; write a literal '@' in a vhost as %40".into(),
            });
        }
        if let Err(rule) = url_check(text) {
            return Err(ValidationError {
                setting: kind.setting,
                rule: crate::redaction::only_shown(
                    rule,
                    text,
                    &shown,
                    "not an AMQP URL (the parser's words would show a part of it that may be a password); expected amqp://user:password@host:port/vhost, with '@', ':', '/' and '?' in a password percent-encoded",
                ),
                value: format!("{shown}{which}"),
            });
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn amqp_url_lists_split_on_commas_before_a_scheme_only() {
        let one = |v: &str| split_amqp_urls(&[v]);
        assert_eq!(one("amqp://a"), ["amqp://a"]);
        assert_eq!(
            one("amqp://a:1/%2f,amqps://b:2/%2f, amqp://c:3/%2f"),
            ["amqp://a:1/%2f", "amqps://b:2/%2f", "amqp://c:3/%2f"]
        );
        // A comma inside a password or a query stays in its URL.
        assert_eq!(
            one("amqp://u:p,w@a/%2f?heartbeat=5,amqp://u:x@b/%2f"),
            ["amqp://u:p,w@a/%2f?heartbeat=5", "amqp://u:x@b/%2f"]
        );
        // Repeated flags and lists mix; empty pieces are dropped.
        assert_eq!(
            split_amqp_urls(&["amqp://a,", " ", "amqp://b,amqp://c"]),
            ["amqp://a", "amqp://b", "amqp://c"]
        );
        assert!(split_amqp_urls::<&str>(&[]).is_empty());
        // Something that is not a URL is kept as one piece, so validation names it.
        assert_eq!(one("rabbit1,rabbit2"), ["rabbit1,rabbit2"]);
    }

    #[test]
    fn amqp_url_order_keeps_or_shuffles_every_node() {
        let urls: Vec<BrokerUrl> = (1..=5)
            .map(|i| BrokerUrl::new(format!("amqp://n{i}")))
            .collect();
        assert_eq!(order_amqp_urls(&urls, AmqpUrlOrder::InOrder, 7), urls);
        let shuffled = order_amqp_urls(&urls, AmqpUrlOrder::Shuffle, 7);
        assert_eq!(shuffled, order_amqp_urls(&urls, AmqpUrlOrder::Shuffle, 7));
        let mut sorted: Vec<String> = shuffled.iter().map(ToString::to_string).collect();
        sorted.sort();
        let given: Vec<String> = urls.iter().map(ToString::to_string).collect();
        assert_eq!(sorted, given, "a shuffle keeps every node once");
        // Over a few seeds every node comes first at least once.
        let firsts: std::collections::HashSet<String> = (0..64)
            .map(|seed| order_amqp_urls(&urls, AmqpUrlOrder::Shuffle, seed)[0].to_string())
            .collect();
        assert_eq!(firsts.len(), urls.len());
    }

    #[test]
    fn every_amqp_url_is_checked_and_named_without_its_password() {
        let check = |url: &str| {
            if url.contains("99999999") {
                Err("invalid port number".to_owned())
            } else {
                Ok(())
            }
        };
        let e = validate_amqp_urls(&[], &check).unwrap_err();
        assert_eq!(e.setting, "--amqp-url");
        assert!(e.to_string().contains("at least one"), "{e}");
        let urls = [
            BrokerUrl::new("amqp://g:g@a/%2f"),
            BrokerUrl::new("amqp://g:secret@b:99999999/%2f"),
        ];
        let e = validate_amqp_urls(&urls, &check).unwrap_err().to_string();
        assert!(
            e.contains("URL 2 of 2") && e.contains("invalid port number") && !e.contains("secret"),
            "{e}"
        );
        let urls = [
            BrokerUrl::new("amqp://g:g@a/%2f"),
            BrokerUrl::new("http://b"),
        ];
        let e = validate_amqp_urls(&urls, &check).unwrap_err().to_string();
        assert!(
            e.contains("URL 2 of 2") && e.contains("expected amqp://"),
            "{e}"
        );
        let urls = [
            BrokerUrl::new("amqp://g:g@a/%2f"),
            BrokerUrl::new("amqps://g:g@b/%2f"),
        ];
        assert!(validate_amqp_urls(&urls, &check).is_ok());
    }
}
