//! One type per kind of connection string, so that a password cannot reach output by
//! formatting one: [`PgUrl`] (a libpq URL or key=value string, `--database-url`) and
//! [`BrokerUrl`] (a RabbitMQ node's URL: `--amqp-url`, or `--stream-url` under `--stream`). Each holds the text as given, privately; its `Display` and
//! its `Debug` are the redacted form ([`crate::redaction::redact_url`]: the password, every
//! query or key=value value whose key is not one that never holds a secret, `sslpassword=`
//! and unknown keys included, masked), and nothing else formats it. The text itself is
//! reached only through `expose_secret`, which the parsers and connectors call and nothing
//! that builds a message should (issue 32, item 1).
//!
//! An error about a URL therefore names it as `{url}` (its redacted form), and a parser's
//! own words about it go through [`crate::redaction::only_shown`] first, which drops them
//! when they quote a piece of the text that the redacted form hides.

use crate::redaction::redact_url;

macro_rules! connection_url {
    ($(#[$doc:meta])* $name:ident) => {
        $(#[$doc])*
        #[derive(Clone, PartialEq, Eq, Default)]
        pub struct $name(String);

        impl $name {
            /// The connection string as given.
            pub fn new(text: impl Into<String>) -> Self {
                $name(text.into())
            }

            /// The text as given, password and all: for a parser or a connector, never for
            /// a message (format the value itself, which shows the redacted form).
            pub fn expose_secret(&self) -> &str {
                &self.0
            }
        }

        impl From<String> for $name {
            fn from(text: String) -> Self {
                $name(text)
            }
        }

        impl From<&str> for $name {
            fn from(text: &str) -> Self {
                $name(text.to_owned())
            }
        }

        /// The redacted form: no password or secret parameter, whatever the text.
        impl std::fmt::Display for $name {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str(&redact_url(&self.0))
            }
        }

        /// `Name("<the redacted form>")`.
        impl std::fmt::Debug for $name {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.debug_tuple(stringify!($name))
                    .field(&redact_url(&self.0))
                    .finish()
            }
        }
    };
}

connection_url!(
    /// A PostgreSQL connection string: a `postgres://`/`postgresql://` URL (a list of hosts
    /// included) or a libpq key=value string. Parsed by
    /// [`crate::config::parse_database_url`].
    PgUrl
);

connection_url!(
    /// One RabbitMQ node's URL: `amqp://` or `amqps://` (`--amqp-url`; its TLS parameters
    /// in the query), parsed by the publisher
    /// ([`crate::publisher::socket::Endpoint::parse`]), or `rabbitmq-stream://` or
    /// `rabbitmq-stream+tls://` (`--stream-url`), parsed by the stream publisher.
    BrokerUrl
);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn display_and_debug_never_show_a_secret() {
        for (pg, amqp) in [
            (
                "postgres://u:PW@h/db?sslpassword=PW",
                "amqp://u:PW@h/%2f?x=PW",
            ),
            ("postgresql://u:ab@PW@host/db", "amqp://u:ab@PW@host/%2f"),
            (
                "postgres//u:PW@h1,postgresql://u:x@h2/db",
                "amqp//u:PW@h/%2f",
            ),
            ("host=h password=PW sslpassword=PW", "u:PW@h"),
        ] {
            let pg = PgUrl::new(pg);
            let amqp = BrokerUrl::new(amqp);
            for shown in [
                pg.to_string(),
                format!("{pg:?}"),
                format!("{pg:#?}"),
                amqp.to_string(),
                format!("{amqp:?}"),
                format!("{:?}", vec![amqp.clone()]),
            ] {
                assert!(!shown.contains("PW"), "{shown}");
            }
            assert!(pg.expose_secret().contains("PW"));
        }
        assert_eq!(
            format!("{:?}", PgUrl::new("postgres://u:PW@h/db")),
            "PgUrl(\"postgres://u:***@h/db\")"
        );
        assert_eq!(BrokerUrl::new("amqp://h/%2f").to_string(), "amqp://h/%2f");
    }
}
