//! Routing: which exchange a message is published to, and whether its producer may name it.
//!
//! A producer names an exchange with `outbox.emit(..., exchange => 'billing')` (the
//! envelope's `exchange` field, [`crate::envelope::Envelope::exchange`]); without one the
//! message goes to `--exchange`. The topic stays the routing key either way.
//!
//! The rules, in order:
//! 1. no exchange named, or `--exchange` itself named: `--exchange` (always allowed, also
//!    under `--allowed-exchanges`);
//! 2. a name that is no AMQP exchange name (empty, or over 255 bytes; `outbox.emit` never
//!    writes one): dead-lettered as [`REASON_POISON`];
//! 3. `--allowed-exchanges` given and the name not in it: dead-lettered as
//!    [`REASON_NOT_ALLOWED`], never published;
//! 4. otherwise that exchange, declared like `--exchange` (durable topic; checked only,
//!    under `--no-declare`) on its first use on each connection, by the publisher
//!    ([`crate::publisher::exchanges`]). A refused declaration dead-letters the message as
//!    [`REASON_NOT_FOUND`] (404) or [`REASON_REFUSED`] (any other reply).
//!
//! Without `--allowed-exchanges` any exchange may be named, as Debezium's outbox event
//! router routes by a field of the event; RabbitMQ's own permissions (write on the
//! exchange, configure for the declaration) still apply.
//!
//! Pure: no I/O.

use amq_protocol::types::ShortString;

use crate::contract::dead_letter_reason;
use crate::validation::ValidationError;

/// Dead-letter reason: the named exchange is not in `--allowed-exchanges`.
pub const REASON_NOT_ALLOWED: &str = dead_letter_reason::EXCHANGE_NOT_ALLOWED;
/// Dead-letter reason: the named exchange does not exist (a passive declare under
/// `--no-declare` answered 404 NOT_FOUND).
pub const REASON_NOT_FOUND: &str = dead_letter_reason::EXCHANGE_NOT_FOUND;
/// Dead-letter reason: RabbitMQ refused to declare the named exchange (406
/// PRECONDITION_FAILED: it exists with another type or durability; 403 ACCESS_REFUSED: no
/// configure permission, or a reserved `amq.` name).
pub const REASON_REFUSED: &str = dead_letter_reason::EXCHANGE_REFUSED;
/// Dead-letter reason for a name that is no exchange name (the existing `poison` reason).
pub const REASON_POISON: &str = dead_letter_reason::POISON;

/// The exchange a message is published to.
///
/// The configured one is a variant without data, so the common case allocates nothing per
/// message; the publisher holds its name once.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Exchange {
    /// The publisher's own exchange (`--exchange`, [`crate::publisher::PublisherConfig::exchange`]),
    /// declared when the connection opened.
    Configured,
    /// An exchange the producer named: declared (or, under `--no-declare`, checked) on its
    /// first use on a connection, before the message is published (see
    /// [`crate::publisher::exchanges`]).
    Named(ShortString),
}

/// The exchanges producers may name with `outbox.emit(..., exchange => ...)`
/// (`--allowed-exchanges`). The configured `--exchange` is always allowed, named or not.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum AllowedExchanges {
    /// No `--allowed-exchanges`: producers may name any exchange (routing by a field of the
    /// event, as Debezium's outbox event router does).
    #[default]
    Any,
    /// Only these (and `--exchange`); any other is dead-lettered as
    /// `exchange_not_allowed`. Empty: producers may name only `--exchange`.
    Only(std::collections::BTreeSet<String>),
}

impl AllowedExchanges {
    /// Parses `--allowed-exchanges`: exchange names separated by commas, blanks around each
    /// trimmed, empty pieces dropped (so `""` allows only `--exchange`).
    ///
    /// # Errors
    /// [`ValidationError`] for `--allowed-exchanges` when a name is longer than 255 bytes.
    pub fn parse(text: &str) -> Result<Self, ValidationError> {
        let mut names = std::collections::BTreeSet::new();
        for name in text.split(',').map(str::trim).filter(|n| !n.is_empty()) {
            if name.len() > 255 {
                return Err(ValidationError {
                    setting: "--allowed-exchanges",
                    value: text.to_owned(),
                    rule: format!(
                        "the exchange name starting {:?} is {} bytes long; AMQP exchange names are 1 to 255 bytes (separate names with commas)",
                        name.chars().take(40).collect::<String>(),
                        name.len()
                    ),
                });
            }
            names.insert(name.to_owned());
        }
        Ok(AllowedExchanges::Only(names))
    }

    /// Whether a producer may name `exchange` (the configured `--exchange` is checked by
    /// the caller: it is always allowed).
    pub fn allows(&self, exchange: &str) -> bool {
        match self {
            AllowedExchanges::Any => true,
            AllowedExchanges::Only(names) => names.contains(exchange),
        }
    }
}

impl std::fmt::Display for AllowedExchanges {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            AllowedExchanges::Any => write!(f, "any"),
            AllowedExchanges::Only(names) => {
                let list: Vec<&str> = names.iter().map(String::as_str).collect();
                write!(f, "{}", list.join(","))
            }
        }
    }
}

/// Why a message may not be published to the exchange its producer named.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refusal {
    /// The dead-letter reason.
    pub reason: &'static str,
    /// The dead letter's error text, naming the exchange and the fix.
    pub error: String,
}

/// The routing settings of one `run`.
#[derive(Debug, Clone)]
pub struct Router {
    configured: String,
    allowed: AllowedExchanges,
}

impl Router {
    /// `configured` is `--exchange`, `allowed` is `--allowed-exchanges`.
    pub fn new(configured: String, allowed: AllowedExchanges) -> Self {
        Router {
            configured,
            allowed,
        }
    }

    /// The exchange for a message whose producer named `named` (`None`: none).
    ///
    /// # Errors
    /// A [`Refusal`] under rules 2 and 3 of the module doc.
    pub fn route(&self, named: Option<&str>) -> Result<Exchange, Refusal> {
        let Some(name) = named else {
            return Ok(Exchange::Configured);
        };
        if name == self.configured {
            return Ok(Exchange::Configured);
        }
        let Some(short) = (!name.is_empty())
            .then(|| ShortString::try_new(name.to_owned()).ok())
            .flatten()
        else {
            return Err(Refusal {
                reason: REASON_POISON,
                error: format!(
                    "the message names an exchange of {} bytes (starts {:?}); exchange names are 1 to 255 bytes, and outbox.emit never writes another",
                    name.len(),
                    name.chars().take(40).collect::<String>()
                ),
            });
        };
        if !self.allowed.allows(name) {
            return Err(Refusal {
                reason: REASON_NOT_ALLOWED,
                error: format!(
                    "exchange_not_allowed: the message names exchange {name:?}, which is not in --allowed-exchanges ({}) and is not --exchange ({:?}); add it to --allowed-exchanges (PGOUTBOX_ALLOWED_EXCHANGES) or emit without exchange",
                    self.allowed, self.configured
                ),
            });
        }
        Ok(Exchange::Named(short))
    }
}

/// The dead-letter reason and error text for a producer-named exchange that RabbitMQ
/// refused (the reply of its declaring channel's `channel.close`).
pub fn refused(exchange: &str, reply_code: u16, reply_text: &str, passive: bool) -> Refusal {
    if reply_code == 404 {
        return Refusal {
            reason: REASON_NOT_FOUND,
            error: format!(
                "exchange_not_found: the message names exchange {exchange:?}, which does not exist (RabbitMQ answered {reply_code} {reply_text}); {}",
                if passive {
                    "run has --no-declare: declare it (durable topic) and requeue the dead letter, or drop --no-declare"
                } else {
                    "declare it (durable topic) and requeue the dead letter"
                }
            ),
        };
    }
    Refusal {
        reason: REASON_REFUSED,
        error: format!(
            "exchange_refused: RabbitMQ refused to declare exchange {exchange:?} (durable topic) named by the message: {reply_code} {reply_text}; {}",
            match reply_code {
                403 => "grant the user configure permission on it, or declare it beforehand and grant write (names starting amq. are reserved)",
                406 => "it exists with another type or durability: use another name, or delete and re-declare it as a durable topic exchange",
                _ => "fix the exchange, then requeue the dead letter",
            }
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn only(names: &[&str]) -> AllowedExchanges {
        AllowedExchanges::Only(names.iter().map(|s| s.to_string()).collect())
    }

    #[test]
    fn the_configured_exchange_is_always_allowed_and_allocates_nothing() {
        let r = Router::new("events".into(), only(&[]));
        assert_eq!(r.route(None), Ok(Exchange::Configured));
        assert_eq!(r.route(Some("events")), Ok(Exchange::Configured));
    }

    #[test]
    fn the_allow_list_decides_for_named_exchanges() {
        let r = Router::new("events".into(), only(&["billing", "audit"]));
        assert_eq!(
            r.route(Some("billing")),
            Ok(Exchange::Named("billing".into()))
        );
        let e = r.route(Some("payroll")).unwrap_err();
        assert_eq!(e.reason, REASON_NOT_ALLOWED);
        assert!(
            e.error.contains("\"payroll\"") && e.error.contains("audit,billing"),
            "{}",
            e.error
        );
        let any = Router::new("events".into(), AllowedExchanges::Any);
        assert_eq!(
            any.route(Some("payroll")),
            Ok(Exchange::Named("payroll".into()))
        );
    }

    #[test]
    fn names_that_are_no_exchange_names_are_poison() {
        let r = Router::new("events".into(), AllowedExchanges::Any);
        assert_eq!(r.route(Some("")).unwrap_err().reason, REASON_POISON);
        let long = "x".repeat(256);
        let e = r.route(Some(&long)).unwrap_err();
        assert_eq!(e.reason, REASON_POISON);
        assert!(e.error.contains("256 bytes"), "{}", e.error);
    }

    #[test]
    fn refusals_are_told_apart_by_reply_code() {
        let e = refused("x", 404, "NOT_FOUND - no exchange 'x' in vhost '/'", true);
        assert_eq!(e.reason, REASON_NOT_FOUND);
        assert!(e.error.contains("--no-declare") && e.error.contains("NOT_FOUND - no exchange"));
        let e = refused(
            "x",
            406,
            "PRECONDITION_FAILED - inequivalent arg 'type'",
            false,
        );
        assert_eq!(e.reason, REASON_REFUSED);
        assert!(e.error.contains("inequivalent arg 'type'") && e.error.contains("another type"));
    }

    #[test]
    fn the_allow_list_parses_commas_and_rejects_overlong_names() {
        assert_eq!(
            AllowedExchanges::parse(" a, b ,,").unwrap(),
            only(&["a", "b"])
        );
        assert_eq!(AllowedExchanges::parse("").unwrap(), only(&[]));
        let e = AllowedExchanges::parse(&format!("a,{}", "y".repeat(300))).unwrap_err();
        assert_eq!(e.setting, "--allowed-exchanges");
        assert!(
            e.to_string().contains("PGOUTBOX_ALLOWED_EXCHANGES")
                && e.to_string().contains("300 bytes")
        );
    }
}
