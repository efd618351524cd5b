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
//! - [`publishing`]: the message properties, CloudEvents, the unroutable policy.
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
    order_amqp_urls, split_amqp_urls, validate_amqp_urls, AllowedExchanges, AmqpUrlOrder,
    BrokerSettings, ExchangeDeclare, PartitionKey, Partitions, UrlCheck, DEFAULT_EXCHANGE,
};
pub use database::{
    parse_database_url, split_tls_parameters, ChannelBindingMode, DatabaseConfig, PostgresTls,
    RootCert, SslMode, TLS_PARAMETERS,
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

/// A deliberate crash for fault tests: the process aborts (like a SIGKILL) at a point that
/// is hard to hit from outside.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Failpoint {
    /// Abort as soon as this many messages were confirmed by the broker, before any standby
    /// status update could report them.
    AbortAfterConfirms(u64),
}

impl std::str::FromStr for Failpoint {
    type Err = String;

    /// Parses `abort-after-confirms=N`.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.split_once('=') {
            Some(("abort-after-confirms", n)) => n
                .parse()
                .map(Failpoint::AbortAfterConfirms)
                .map_err(|_| format!("invalid count in failpoint {s:?}")),
            _ => Err(format!(
                "unknown failpoint {s:?}; known: abort-after-confirms=N"
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
    /// The first [`ValidationError`] found: Postgres names and timings, the broker URLs and
    /// exchange, the bounds, the stall clock, the CloudEvents source, in that order.
    pub fn validate(self, broker_url: UrlCheck<'_>) -> Result<RunConfig, ValidationError> {
        self.postgres.validate()?;
        self.broker.validate(broker_url)?;
        self.bounds.validate()?;
        self.observability.validate()?;
        self.publishing.validate()?;
        Ok(RunConfig(self))
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
                database: parse_database_url("postgres://u@h/db").unwrap(),
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
    fn every_numeric_and_duration_setting_has_bounds() {
        type Set = fn(&mut RunSettings, u64);
        // (setting, how to set it, lowest accepted, highest accepted)
        let cases: [(&str, Set, u64, u64); 11] = [
            (
                "--max-in-flight",
                |c, v| c.bounds.max_in_flight = v as usize,
                1,
                1_000_000,
            ),
            (
                "--max-in-flight-bytes",
                |c, v| c.bounds.max_in_flight_bytes = v as usize,
                1,
                1 << 32,
            ),
            (
                "--max-message-bytes",
                |c, v| c.bounds.max_message_bytes = v as usize,
                1,
                512 << 20,
            ),
            (
                "--broker-max-message-bytes",
                |c, v| c.bounds.broker_max_message_bytes = Some(v as usize),
                1,
                512 << 20,
            ),
            (
                "--max-attempts",
                |c, v| c.bounds.max_attempts = v as u32,
                1,
                1_000,
            ),
            (
                "--slot-busy-timeout-s",
                |c, v| c.postgres.slot_busy_timeout = Some(Duration::from_secs(v)),
                0,
                30 * 86_400,
            ),
            (
                "--standby-poll-ms",
                |c, v| c.postgres.standby_poll = Duration::from_millis(v),
                10,
                60_000,
            ),
            (
                "--shutdown-timeout-s",
                |c, v| c.bounds.shutdown_timeout = Duration::from_secs(v),
                0,
                86_400,
            ),
            (
                "--postgres-loss-drain-ms",
                |c, v| c.bounds.postgres_loss_drain = Duration::from_millis(v),
                0,
                600_000,
            ),
            (
                "--reconnect-backoff-max-ms",
                |c, v| c.bounds.reconnect_backoff_max = Duration::from_millis(v),
                500,
                600_000,
            ),
            (
                "--read-coalesce-us",
                |c, v| c.bounds.read_coalesce = Duration::from_micros(v),
                0,
                100_000,
            ),
        ];
        for (setting, set, low, high) in cases {
            for ok in [low, high] {
                let mut c = base();
                set(&mut c, ok);
                assert_eq!(check(c), Ok(()), "{setting} = {ok}");
            }
            let mut bad = vec![high + 1];
            if low > 0 {
                bad.push(low - 1);
            }
            // The inputs that used to panic or wrap: u64::MAX seconds overflows `Instant`.
            if setting != "--max-attempts" {
                bad.push(u64::MAX);
            }
            for value in bad {
                let mut c = base();
                set(&mut c, value);
                let e = check(c).unwrap_err();
                assert_eq!(e.setting, setting, "{value}");
                assert_eq!(e.value, value.to_string());
                let env = env_of(setting).unwrap();
                assert!(
                    e.to_string().starts_with(&format!(
                        "invalid setting {setting} ({env}) = \"{value}\": must be"
                    )) && e.to_string().contains(&high.to_string()),
                    "{e}"
                );
            }
        }
        // 0 seconds of slot-busy timeout means "wait forever", not an out-of-range value.
        let mut c = base();
        c.postgres.slot_busy_timeout = None;
        assert_eq!(check(c), Ok(()));
    }
}
