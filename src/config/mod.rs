//! The settings of `pgoutbox run` (and `check`, which reads the same): plain data, grouped
//! by concern, valid by construction.
//!
//! ```text
//!  argv, PGOUTBOX_* variables, --config file ──cli (the edge)──▶ RunSettings
//!      ──RunSettings::validate (every field, once)──▶ RunConfig ──▶ pipeline::run, check
//! ```
//!
//! - [`postgres`]: the connection string (parsed: [`database`]), slot, publication, schema,
//!   prefix, standby timings, `--accept-gap`, retention ([`retention`]);
//! - [`broker`]: the broker's nodes, their order, the exchange and the exchanges producers
//!   may name;
//! - [`bounds`]: the window, the largest message, attempts, read coalescing, drain times;
//! - [`observability`]: instance id, the HTTP endpoint, the stall clock, the journal;
//! - [`publishing`]: the message properties, CloudEvents, the unroutable policy;
//! - [`numeric`]: every numeric and duration setting's flag, unit, range, default and doc,
//!   in one table that the CLI's parsers, the config file, [`RunSettings::validate`] and the
//!   generated reference all read.
//!
//! A [`RunConfig`] exists only through [`RunSettings::validate`], so code that is handed one
//! (the pipeline, `check`) takes it as given and never validates again. The settings import
//! no transport: the broker URL's parser is the publisher's, handed in by the edge (see
//! [`broker::UrlCheck`]); the TLS parameters of the connection string are plain data here
//! that the Postgres transports read. Defaults are named consts whose docs say why.
//! Library code never reads argv or the environment: the CLI does, at the edge.

pub mod bounds;
pub mod broker;
pub mod database;
pub mod numeric;
pub mod observability;
pub mod postgres;
pub mod publishing;
pub mod retention;

pub use bounds::{
    PipelineBounds, DEFAULT_MAX_ATTEMPTS, DEFAULT_MAX_IN_FLIGHT, DEFAULT_MAX_IN_FLIGHT_BYTES,
    DEFAULT_MAX_MESSAGE_BYTES, DEFAULT_POSTGRES_LOSS_DRAIN, DEFAULT_READ_COALESCE,
    DEFAULT_RECONNECT_BACKOFF_MAX, DEFAULT_SHUTDOWN_TIMEOUT, MAX_ATTEMPTS_CAP,
    MAX_IN_FLIGHT_BYTES_CAP, MAX_IN_FLIGHT_CAP, MAX_MESSAGE_BYTES_CAP, MAX_READ_COALESCE,
    MAX_STATUS_INTERVAL, POSTGRES_LOSS_DRAIN_CAP, RECONNECT_BACKOFF_MAX_CAP,
    RECONNECT_BACKOFF_MAX_MIN, SHUTDOWN_TIMEOUT_CAP, STATUS_COALESCE,
};
pub use broker::{
    order_amqp_urls, split_amqp_urls, split_stream_urls, validate_amqp_urls, AllowedExchanges,
    AmqpUrlOrder, BrokerSettings, ExchangeDeclare, PartitionKey, Partitions, StreamSettings,
    UrlCheck, DEFAULT_EXCHANGE,
};
pub use database::{
    authority_has_two_ats, parse_database_url, split_tls_parameters, ChannelBindingMode,
    DatabaseConfig, PostgresTls, RootCert, SslMode, TLS_PARAMETERS,
};
pub use observability::{
    parse_http_addr, JournalMode, ObservabilitySettings, DEFAULT_STALL_AFTER, MAX_STALL_AFTER,
};
pub use postgres::{
    PostgresSettings, DEFAULT_PUBLICATION, DEFAULT_SLOT, DEFAULT_SLOT_BUSY_TIMEOUT,
    DEFAULT_STANDBY_POLL, MESSAGE_PREFIX, MIN_STANDBY_POLL, SLOT_BUSY_TIMEOUT_CAP,
    STANDBY_POLL_CAP,
};
pub use publishing::{PublishProperties, PublishingSettings, UnroutablePolicy};
pub use retention::{
    Retention, RetentionSettings, DEAD_LETTER_AGE_CAP, DEAD_LETTER_LIST_CAP,
    DEFAULT_MAINTENANCE_INTERVAL, DEFAULT_RETENTION, DEFAULT_RETENTION_BATCH,
    MAINTENANCE_INTERVAL_MAX, MAINTENANCE_INTERVAL_MIN, RETENTION_BATCH_CAP, RETENTION_CAP,
};

/// The validation error and the flag-to-variable rule live in the lowest layer (the
/// outbox's names and the routing rules check with them too); here for the settings' users.
pub use crate::validation::{env_of, validate_identifier, ValidationError, FLAGS_WITHOUT_ENV};

/// [`crate::redaction::redact_url`], kept under this path for the settings' users.
pub use crate::redaction::redact_url;

/// The connection strings, one type per kind, shown only redacted.
pub use crate::connection_url::{BrokerUrl, PgUrl};

/// A deliberate crash for fault tests: the process aborts (like a SIGKILL) at a point that
/// is hard to hit from outside.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Failpoint {
    /// Abort as soon as this many messages were confirmed by the broker, before any standby
    /// status update could report them.
    AbortAfterConfirms(u64),
    /// Once this many messages were confirmed, the event loop stops turning (it awaits a
    /// future that never completes) while the rest of the process, the HTTP endpoint
    /// included, goes on: a wedged loop, which `/healthz` must report.
    StallAfterConfirms(u64),
}

impl std::str::FromStr for Failpoint {
    type Err = String;

    /// Parses `abort-after-confirms=N` or `stall-after-confirms=N`.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.split_once('=') {
            Some(("abort-after-confirms", n)) => n
                .parse()
                .map(Failpoint::AbortAfterConfirms)
                .map_err(|_| format!("invalid count in failpoint {s:?}")),
            Some(("stall-after-confirms", n)) => n
                .parse()
                .map(Failpoint::StallAfterConfirms)
                .map_err(|_| format!("invalid count in failpoint {s:?}")),
            _ => Err(format!(
                "unknown failpoint {s:?}; known: abort-after-confirms=N, stall-after-confirms=N"
            )),
        }
    }
}

/// Every setting of `pgoutbox run`, by concern, not yet checked. The edge (the CLI) fills
/// it from flags, variables and the config file; [`RunSettings::validate`] turns it into a
/// [`RunConfig`].
#[derive(Debug, Clone)]
pub struct RunSettings {
    /// PostgreSQL: connection, slot, publication, schema, prefix, standby, retention.
    pub postgres: PostgresSettings,
    /// RabbitMQ: nodes, exchange, allowed exchanges, declaring.
    pub broker: BrokerSettings,
    /// The window, message size, attempts, read coalescing, drain times.
    pub bounds: PipelineBounds,
    /// Instance id, the HTTP endpoint, the stall clock, the journal.
    pub observability: ObservabilitySettings,
    /// Message properties, CloudEvents, the unroutable policy.
    pub publishing: PublishingSettings,
    /// A crash injected for fault tests (`None` in production).
    pub failpoint: Option<Failpoint>,
}

impl RunSettings {
    /// Checks every field and returns the settings as a [`RunConfig`]. `broker_url` is the
    /// publisher's parser of an `amqp://` URL (the edge passes it; see
    /// [`broker::UrlCheck`]).
    ///
    /// # Errors
    /// The first [`ValidationError`] found: every numeric and duration setting against its
    /// range ([`numeric::NUMERIC_SETTINGS`], in `--help` order), then the Postgres names,
    /// the broker URLs and exchange, the CloudEvents source.
    pub fn validate(self, broker_url: UrlCheck<'_>) -> Result<RunConfig, ValidationError> {
        let mut settings = self;
        for setting in numeric::NUMERIC_SETTINGS {
            setting.check(&mut settings)?;
        }
        settings.postgres.validate()?;
        settings.broker.validate(broker_url)?;
        settings.publishing.validate()?;
        Ok(RunConfig(settings))
    }
}

/// The settings of `pgoutbox run`, checked: made only by [`RunSettings::validate`], read
/// through `Deref` (`config.postgres.slot`, `config.bounds.max_in_flight`), never changed.
#[derive(Debug, Clone)]
pub struct RunConfig(RunSettings);

impl std::ops::Deref for RunConfig {
    type Target = RunSettings;

    fn deref(&self) -> &RunSettings {
        &self.0
    }
}

impl RunConfig {
    /// The settings, to change one and validate them again (tests, and a caller deriving
    /// one run's settings from another's).
    pub fn into_settings(self) -> RunSettings {
        self.0
    }

    /// The producer name of `run --stream`: `--stream-producer-name`, else `pgoutbox-SLOT`,
    /// with `-gN` appended after the N-th gap accepted with `--accept-gap` (so ids of a new
    /// history are never compared with the old one's; docs/src/internals/stream-ids.md).
    pub fn stream_producer_name(&self, accepted_gaps: usize) -> String {
        let base = self
            .broker
            .stream
            .as_ref()
            .and_then(|s| s.producer_name.clone())
            .unwrap_or_else(|| format!("pgoutbox-{}", self.postgres.slot));
        if accepted_gaps == 0 {
            base
        } else {
            format!("{base}-g{accepted_gaps}")
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    /// The broker URL check of the tests: every URL parses.
    fn any_url(_: &str) -> Result<(), String> {
        Ok(())
    }

    /// Settings with the defaults the CLI gives; valid.
    fn base() -> RunSettings {
        let settings = RunSettings {
            postgres: PostgresSettings {
                database: parse_database_url(&"postgres://u@h/db".into()).unwrap(),
                slot: DEFAULT_SLOT.into(),
                publication: DEFAULT_PUBLICATION.into(),
                schema: crate::outbox_schema::SchemaName::default(),
                prefix: None,
                slot_busy_timeout: None,
                standby_poll: DEFAULT_STANDBY_POLL,
                accept_gap: false,
                retention: RetentionSettings::default(),
            },
            broker: BrokerSettings {
                amqp_urls: vec!["amqp://g:g@h/%2f".into()],
                amqp_url_order: AmqpUrlOrder::InOrder,
                exchange: DEFAULT_EXCHANGE.into(),
                allowed_exchanges: AllowedExchanges::Any,
                exchange_declare: ExchangeDeclare::DurableTopic,
                partitions: Partitions::default(),
                stream: None,
                stream_max_length_bytes: None,
            },
            bounds: PipelineBounds::default(),
            observability: ObservabilitySettings {
                instance_id: "test".into(),
                http_addr: None,
                stall_after: DEFAULT_STALL_AFTER,
                journal: JournalMode::Off,
            },
            publishing: PublishingSettings {
                publish_properties: PublishProperties::Full,
                cloudevents: None,
                on_unroutable: UnroutablePolicy::DeadLetter,
            },
            failpoint: None,
        };
        settings.clone().validate(&any_url).unwrap();
        settings
    }

    fn check(s: RunSettings) -> Result<(), ValidationError> {
        s.validate(&any_url).map(drop)
    }

    #[test]
    fn cloudevents_source_is_validated() {
        let with = |source: &str| {
            let mut s = base();
            s.publishing.cloudevents = Some(crate::cloudevents::Binding {
                source: source.into(),
                prefix: crate::cloudevents::Prefix::Colon,
            });
            s
        };
        assert_eq!(check(with("pgoutbox:///db/pgoutbox")), Ok(()));
        let e = check(with("my source")).unwrap_err();
        assert_eq!(e.setting, "--cloudevents-source");
        let text = e.to_string();
        assert!(
            text.starts_with(
                "invalid setting --cloudevents-source (PGOUTBOX_CLOUDEVENTS_SOURCE) = \"my source\": not a URI-reference"
            ) && text.contains("pgoutbox:///DATABASE/SLOT"),
            "{text}"
        );
    }

    #[test]
    fn stall_after_and_the_maintenance_interval_are_validated() {
        for bad in [0, 3601] {
            let mut s = base();
            s.observability.stall_after = Duration::from_secs(bad);
            let e = check(s).unwrap_err();
            assert_eq!(e.setting, "--stall-after-s", "{e}");
        }
        let mut s = base();
        s.postgres.retention.interval = Duration::from_millis(500);
        assert_eq!(check(s).unwrap_err().setting, "--maintenance-interval");
    }

    #[test]
    fn broker_urls_are_checked_with_the_parser_handed_in() {
        let mut s = base();
        s.broker.amqp_urls = vec!["amqp://g:secret@h/%2f".into()];
        let e = s
            .validate(&|_| Err("invalid port number".into()))
            .unwrap_err();
        assert_eq!(e.setting, "--amqp-url");
        assert!(
            e.to_string().contains("invalid port number") && !e.to_string().contains("secret"),
            "{e}"
        );
        let mut s = base();
        s.broker.exchange = String::new();
        assert_eq!(check(s).unwrap_err().setting, "--exchange");
    }

    #[test]
    fn settings_built_in_code_with_65_partitions_are_refused_before_any_sink() {
        // The partitioned sink panics above 64 partitions; RunSettings built in code (not
        // through the CLI's parser) must be refused by validate, naming the setting.
        for bad in [0, crate::partition::MAX_PARTITIONS + 1, u16::MAX] {
            let mut s = base();
            s.broker.partitions.count = bad;
            let e = check(s).unwrap_err();
            assert_eq!(
                (e.setting, e.value.as_str()),
                ("--partitions", bad.to_string().as_str())
            );
            assert!(e.to_string().contains("must be from 1 to 64"), "{e}");
        }
        let mut s = base();
        s.broker.partitions.count = crate::partition::MAX_PARTITIONS;
        assert_eq!(check(s), Ok(()));
    }

    #[test]
    fn every_numeric_and_duration_setting_has_bounds() {
        // Enumerates the one table (not a list kept here): a setting added to it is
        // covered, and tests/cli's walk of `run` keeps every numeric option in it.
        assert!(numeric::NUMERIC_SETTINGS.len() >= 16);
        for s in numeric::NUMERIC_SETTINGS {
            let (setting, low, high) = (s.flag, s.min, s.max);
            // The defaults the CLI gives are the table's.
            assert_eq!(
                (s.field)(&mut base()).read(s.unit),
                s.default.map(u128::from),
                "{setting}: default"
            );
            for ok in [low, high] {
                let mut c = base();
                (s.field)(&mut c).write(ok, s.unit);
                assert_eq!((s.field)(&mut c).read(s.unit), Some(ok.into()), "{setting}");
                assert_eq!(check(c), Ok(()), "{setting} = {ok}");
            }
            let mut bad = vec![high + 1];
            if low > 0 {
                bad.push(low - 1);
            }
            // The inputs that used to panic or wrap: u64::MAX seconds overflows `Instant`,
            // 65 partitions panics in the partitioned sink.
            bad.push(u64::MAX);
            for value in bad {
                let mut c = base();
                (s.field)(&mut c).write(value, s.unit);
                // A narrower field saturates (u16::MAX partitions): its value is what is
                // named.
                let held = (s.field)(&mut c).read(s.unit).unwrap();
                let saturated = [u16::MAX.into(), u32::MAX.into()];
                assert!(
                    held == value.into() || (value == u64::MAX && saturated.contains(&held)),
                    "{setting}: {value} held as {held}"
                );
                let shown = s.unit.render(held);
                let e = check(c).unwrap_err();
                assert_eq!(e.setting, setting, "{value}");
                assert_eq!(e.value, shown);
                let env = env_of(setting).unwrap();
                assert!(
                    e.to_string().starts_with(&format!(
                        "invalid setting {setting} ({env}) = \"{shown}\": must be"
                    )) && e.to_string().contains(&s.unit.render(high.into())),
                    "{e}"
                );
            }
        }
        // 0 seconds of slot-busy timeout means "wait forever", not an out-of-range value.
        let mut c = base();
        c.postgres.slot_busy_timeout = None;
        assert_eq!(check(c), Ok(()));
        // Unset, the broker's limit is learned, not checked.
        let mut c = base();
        c.bounds.broker_max_message_bytes = None;
        assert_eq!(check(c), Ok(()));
    }
}
