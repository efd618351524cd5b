//! `run`'s options (shared by `check`), grouped by concern as the settings are
//! ([`crate::config`]): PostgreSQL, RabbitMQ, the pipeline's bounds, observability,
//! publishing. Each group is a clap `Args` struct flattened into [`RunArgs`], with its own
//! heading in `--help`.
//!
//! These declarations are the one source of every `run` setting's flag, environment
//! variable, default and doc, except the numeric and duration settings: their doc, range,
//! default and parser come from the one table of [`crate::config::numeric`] (which
//! [`RunSettings::validate`] reads too), so a range is written once. The config file's
//! keys are the long flags with `_` for `-` (except [`NOT_FILE_KEYS`]), read through the
//! same value parsers ([`crate::config_file`]), and the reference is generated from them
//! ([`super::reference`]). [`RunArgs::into_config`] turns the parsed options into the
//! validated [`RunConfig`].

use std::path::PathBuf;
use std::time::Duration;

use clap::Args;

use super::{parse_idempotency_retention, parse_journal_retention, DbArgs};
use crate::config::numeric::{
    BROKER_MAX_MESSAGE_BYTES, IDEMPOTENCY_RETENTION, JOURNAL_RETENTION, MAINTENANCE_INTERVAL,
    MAX_ATTEMPTS, MAX_IN_FLIGHT, MAX_IN_FLIGHT_BYTES, MAX_MESSAGE_BYTES, PARTITIONS,
    POSTGRES_LOSS_DRAIN_MS, READ_COALESCE_US, RECONNECT_BACKOFF_MAX_MS, SHUTDOWN_TIMEOUT_S,
    SLOT_BUSY_TIMEOUT_S, STALL_AFTER_S, STANDBY_POLL_MS, STREAM_MAX_LENGTH_BYTES,
};
use crate::config::{
    AllowedExchanges, AmqpUrlOrder, BrokerSettings, BrokerUrl, ExchangeDeclare, JournalMode,
    ObservabilitySettings, PartitionKey, Partitions, PipelineBounds, PostgresSettings,
    PublishProperties, PublishingSettings, Retention, RetentionSettings, RunConfig, RunSettings,
    UnroutablePolicy, ValidationError, DEFAULT_EXCHANGE, DEFAULT_PUBLICATION,
};
use crate::metrics::DEFAULT_HTTP_ADDR;
use crate::secrets::{Secret, Sources, Target};

/// The long flags of `run` (and `check`) that a config file may not set: the file itself,
/// the one-off decisions (`--accept-gap`) and test hooks (`--failpoint`) that must be given
/// each time, and `check`'s `--standby-url` (not a setting of `run`). Every other option of
/// [`RunArgs`] is a file key.
pub const NOT_FILE_KEYS: &[&str] = &["config", "accept-gap", "failpoint", "standby-url"];

/// `run` arguments (and `check`'s: the same settings, inspected instead of used).
#[derive(Debug, Clone, Args)]
pub struct RunArgs {
    /// TOML file of settings, keys named like these flags with _ for - (database_url,
    /// max_in_flight, ...); a flag or variable overrides the file.
    #[arg(long, env = "PGOUTBOX_CONFIG")]
    pub config: Option<std::path::PathBuf>,
    /// PostgreSQL: the database, slot, publication, schema, standby timings, retention.
    #[command(flatten)]
    pub postgres: PostgresArgs,
    /// RabbitMQ: the nodes, TLS files, exchange.
    #[command(flatten)]
    pub broker: BrokerArgs,
    /// The window, message size, attempts, read coalescing, drain times.
    #[command(flatten)]
    pub bounds: BoundsArgs,
    /// Instance id, the HTTP endpoint, the stall clock, the journal.
    #[command(flatten)]
    pub observability: ObservabilityArgs,
    /// Message properties, CloudEvents, the unroutable policy.
    #[command(flatten)]
    pub publishing: PublishingArgs,
    /// Fault injection for tests (e.g. abort-after-confirms=100); never use in production.
    #[arg(long, env = "PGOUTBOX_FAILPOINT", hide = true)]
    pub failpoint: Option<crate::config::Failpoint>,
    /// The flags whose value came on the command line (argv, visible in the process list)
    /// and carries a password; filled by [`crate::config_file::parse_cli`], warned about by
    /// `run`.
    #[arg(skip)]
    pub passwords_on_argv: Vec<&'static str>,
}

/// `run`'s PostgreSQL options.
#[derive(Debug, Clone, Args)]
#[command(next_help_heading = "PostgreSQL")]
pub struct PostgresArgs {
    /// Database and slot.
    #[command(flatten)]
    pub db: DbArgs,
    /// Publication name.
    #[arg(long, env = "PGOUTBOX_PUBLICATION", default_value = DEFAULT_PUBLICATION)]
    pub publication: String,
    /// Publish only logical messages with this prefix (default: the one `setup` stored in
    /// the --schema's settings table; pgoutbox for schema outbox set up by an older
    /// version). Messages with other prefixes are acknowledged without publishing.
    #[arg(long, env = "PGOUTBOX_PREFIX")]
    pub prefix: Option<String>,
    /// `--slot-busy-timeout-s`: doc, range and default in [`crate::config::numeric::SLOT_BUSY_TIMEOUT_S`].
    #[arg(long, env = "PGOUTBOX_SLOT_BUSY_TIMEOUT_S", help = SLOT_BUSY_TIMEOUT_S.help(), default_value = SLOT_BUSY_TIMEOUT_S.default_text(), value_parser = SLOT_BUSY_TIMEOUT_S.whole_number::<u64>())]
    pub slot_busy_timeout_s: u64,
    /// `--standby-poll-ms`: doc, range and default in [`crate::config::numeric::STANDBY_POLL_MS`].
    #[arg(long, env = "PGOUTBOX_STANDBY_POLL_MS", help = STANDBY_POLL_MS.help(), default_value = STANDBY_POLL_MS.default_text(), value_parser = STANDBY_POLL_MS.whole_number::<u64>())]
    pub standby_poll_ms: u64,
    /// Start even though the slot's history has a gap (the slot was dropped and recreated,
    /// or the database is another cluster): the range that may be missing is logged and
    /// recorded in outbox.stream_state. A one-off decision: no variable, no file key.
    #[arg(long)]
    pub accept_gap: bool,
    /// `--journal-retention`: doc, range and default in [`crate::config::numeric::JOURNAL_RETENTION`].
    #[arg(long, env = "PGOUTBOX_JOURNAL_RETENTION", help = JOURNAL_RETENTION.help(), default_value = JOURNAL_RETENTION.default_text(), value_parser = parse_journal_retention)]
    pub journal_retention: Retention,
    /// `--idempotency-retention`: doc, range and default in [`crate::config::numeric::IDEMPOTENCY_RETENTION`].
    #[arg(long, env = "PGOUTBOX_IDEMPOTENCY_RETENTION", help = IDEMPOTENCY_RETENTION.help(), default_value = IDEMPOTENCY_RETENTION.default_text(), value_parser = parse_idempotency_retention)]
    pub idempotency_retention: Retention,
    /// `--maintenance-interval`: doc, range and default in [`crate::config::numeric::MAINTENANCE_INTERVAL`].
    #[arg(long, env = "PGOUTBOX_MAINTENANCE_INTERVAL", help = MAINTENANCE_INTERVAL.help(), default_value = MAINTENANCE_INTERVAL.default_text(), value_parser = MAINTENANCE_INTERVAL.duration())]
    pub maintenance_interval: Duration,
}

/// `run`'s RabbitMQ options.
#[derive(Debug, Clone, Args)]
#[command(next_help_heading = "RabbitMQ")]
pub struct BrokerArgs {
    /// RabbitMQ URL: amqp://user:password@host:port/vhost, or amqps:// for TLS (verified
    /// against the system's CAs, or ?cacertfile=/path/ca.pem; client certificate with
    /// certfile= and keyfile=; server_name_indication= to verify another name). For a
    /// cluster, repeat it (or separate URLs with commas) once per node: `run` connects to
    /// the first node that answers and fails over to the next when the connection is lost.
    /// A password here is visible in the process list: prefer the variable or a file.
    #[arg(long, env = "PGOUTBOX_AMQP_URL", hide_env_values = true, action = clap::ArgAction::Append)]
    pub amqp_url: Vec<Secret>,
    /// The order the --amqp-url nodes are tried in: `in-order` (as given) or `shuffle`
    /// (shuffled once at start, so several streamers spread over the nodes).
    #[arg(long, env = "PGOUTBOX_AMQP_URL_ORDER", value_enum, default_value_t = AmqpUrlOrderArg::InOrder)]
    pub amqp_url_order: AmqpUrlOrderArg,
    /// A file holding the RabbitMQ URL (a container secret; several nodes' URLs separated
    /// by commas); a trailing newline is dropped. Instead of --amqp-url.
    #[arg(long, env = "PGOUTBOX_AMQP_URL_FILE")]
    pub amqp_url_file: Option<PathBuf>,
    /// A file holding the RabbitMQ password alone, put into every --amqp-url (which must
    /// then have a user and no password).
    #[arg(long, env = "PGOUTBOX_AMQP_PASSWORD_FILE")]
    pub amqp_password_file: Option<PathBuf>,
    /// PEM file of the CA certificates that may sign the broker's certificate (amqps://;
    /// default: the system's trust store). The same as cacertfile= in the URL.
    #[arg(long, env = "PGOUTBOX_AMQP_CA_FILE")]
    pub amqp_ca_file: Option<PathBuf>,
    /// PEM file of a client certificate chain for amqps:// (with --amqp-key-file). The same
    /// as certfile= in the URL.
    #[arg(long, env = "PGOUTBOX_AMQP_CERT_FILE")]
    pub amqp_cert_file: Option<PathBuf>,
    /// PEM file of the client certificate's private key (with --amqp-cert-file). The same
    /// as keyfile= in the URL.
    #[arg(long, env = "PGOUTBOX_AMQP_KEY_FILE")]
    pub amqp_key_file: Option<PathBuf>,
    /// Durable topic exchange to publish to (declared if absent), for messages whose
    /// producer named no exchange.
    #[arg(long, env = "PGOUTBOX_EXCHANGE", default_value = DEFAULT_EXCHANGE)]
    pub exchange: String,
    /// The exchanges producers may name (outbox.emit(..., exchange => 'x')), separated by
    /// commas or given by repeating the flag; --exchange is always allowed. A message
    /// naming another is dead-lettered with reason exchange_not_allowed, never published.
    /// Unset: any exchange; empty: only --exchange.
    #[arg(long, env = "PGOUTBOX_ALLOWED_EXCHANGES", action = clap::ArgAction::Append)]
    pub allowed_exchanges: Vec<String>,
    /// Declare no exchange, only check that it exists (a passive declare): a missing
    /// --exchange stops run; a message naming a missing exchange is dead-lettered with
    /// reason exchange_not_found. For users without configure permission.
    #[arg(long, env = "PGOUTBOX_NO_DECLARE")]
    pub no_declare: bool,
    /// `--partitions`: doc, range and default in [`crate::config::numeric::PARTITIONS`].
    #[arg(long, env = "PGOUTBOX_PARTITIONS", help = PARTITIONS.help(), default_value = PARTITIONS.default_text(), value_parser = PARTITIONS.whole_number::<u16>())]
    pub partitions: u16,
    /// What keys a message's partition under --partitions: `aggregate_id` (the default),
    /// `tenant` or `topic`; a message without that field is keyed by its transaction.
    /// The partition is FNV-1a 64 of the key's UTF-8 bytes modulo --partitions.
    #[arg(long, env = "PGOUTBOX_PARTITION_KEY", value_enum, default_value_t = PartitionKeyArg::AggregateId)]
    pub partition_key: PartitionKeyArg,
    /// RabbitMQ stream-protocol URL: rabbitmq-stream://user:password@host:5552/vhost, or
    /// rabbitmq-stream+tls:// (port 5551; the TLS parameters of --amqp-url). With --stream,
    /// every outbox message goes into that stream instead of an exchange, deduplicated by
    /// the broker (effectively once: docs/src/internals/stream-ids.md). Repeat it for a
    /// cluster's nodes. Instead of --amqp-url.
    #[arg(long, env = "PGOUTBOX_STREAM_URL", hide_env_values = true, action = clap::ArgAction::Append)]
    pub stream_url: Vec<Secret>,
    /// The stream to publish into (with --stream-url); created when missing unless
    /// --no-declare.
    #[arg(long, env = "PGOUTBOX_STREAM")]
    pub stream: Option<String>,
    /// The producer name the broker deduplicates by (default: pgoutbox-SLOT, with -gN
    /// after the N-th accepted gap). Change it only while nothing is in flight.
    #[arg(long, env = "PGOUTBOX_STREAM_PRODUCER_NAME")]
    pub stream_producer_name: Option<String>,
    /// The stream's maximum age when run creates it (RabbitMQ's x-max-age: 7D, 12h, ...).
    #[arg(long, env = "PGOUTBOX_STREAM_MAX_AGE")]
    pub stream_max_age: Option<String>,
    /// `--stream-max-length-bytes`: doc, range and default in [`crate::config::numeric::STREAM_MAX_LENGTH_BYTES`].
    #[arg(long, env = "PGOUTBOX_STREAM_MAX_LENGTH_BYTES", help = STREAM_MAX_LENGTH_BYTES.help(), value_parser = STREAM_MAX_LENGTH_BYTES.whole_number::<u64>())]
    pub stream_max_length_bytes: Option<u64>,
}

/// `run`'s bounds: the window, the largest message, attempts, read coalescing, drain times.
#[derive(Debug, Clone, Args)]
#[command(next_help_heading = "Pipeline bounds")]
pub struct BoundsArgs {
    /// `--max-in-flight`: doc, range and default in [`crate::config::numeric::MAX_IN_FLIGHT`].
    #[arg(long, env = "PGOUTBOX_MAX_IN_FLIGHT", help = MAX_IN_FLIGHT.help(), default_value = MAX_IN_FLIGHT.default_text(), value_parser = MAX_IN_FLIGHT.whole_number::<usize>())]
    pub max_in_flight: usize,
    /// `--max-in-flight-bytes`: doc, range and default in [`crate::config::numeric::MAX_IN_FLIGHT_BYTES`].
    #[arg(long, env = "PGOUTBOX_MAX_IN_FLIGHT_BYTES", help = MAX_IN_FLIGHT_BYTES.help(), default_value = MAX_IN_FLIGHT_BYTES.default_text(), value_parser = MAX_IN_FLIGHT_BYTES.whole_number::<usize>())]
    pub max_in_flight_bytes: usize,
    /// `--max-message-bytes`: doc, range and default in [`crate::config::numeric::MAX_MESSAGE_BYTES`].
    #[arg(long, env = "PGOUTBOX_MAX_MESSAGE_BYTES", help = MAX_MESSAGE_BYTES.help(), default_value = MAX_MESSAGE_BYTES.default_text(), value_parser = MAX_MESSAGE_BYTES.whole_number::<usize>())]
    pub max_message_bytes: usize,
    /// `--broker-max-message-bytes`: doc, range and default in [`crate::config::numeric::BROKER_MAX_MESSAGE_BYTES`].
    #[arg(long, env = "PGOUTBOX_BROKER_MAX_MESSAGE_BYTES", help = BROKER_MAX_MESSAGE_BYTES.help(), value_parser = BROKER_MAX_MESSAGE_BYTES.whole_number::<usize>())]
    pub broker_max_message_bytes: Option<usize>,
    /// `--max-attempts`: doc, range and default in [`crate::config::numeric::MAX_ATTEMPTS`].
    #[arg(long, env = "PGOUTBOX_MAX_ATTEMPTS", help = MAX_ATTEMPTS.help(), default_value = MAX_ATTEMPTS.default_text(), value_parser = MAX_ATTEMPTS.whole_number::<u32>())]
    pub max_attempts: u32,
    /// `--read-coalesce-us`: doc, range and default in [`crate::config::numeric::READ_COALESCE_US`].
    #[arg(long, env = "PGOUTBOX_READ_COALESCE_US", help = READ_COALESCE_US.help(), default_value = READ_COALESCE_US.default_text(), value_parser = READ_COALESCE_US.whole_number::<u64>())]
    pub read_coalesce_us: u64,
    /// `--shutdown-timeout-s`: doc, range and default in [`crate::config::numeric::SHUTDOWN_TIMEOUT_S`].
    #[arg(long, env = "PGOUTBOX_SHUTDOWN_TIMEOUT_S", help = SHUTDOWN_TIMEOUT_S.help(), default_value = SHUTDOWN_TIMEOUT_S.default_text(), value_parser = SHUTDOWN_TIMEOUT_S.whole_number::<u64>())]
    pub shutdown_timeout_s: u64,
    /// `--postgres-loss-drain-ms`: doc, range and default in [`crate::config::numeric::POSTGRES_LOSS_DRAIN_MS`].
    #[arg(long, env = "PGOUTBOX_POSTGRES_LOSS_DRAIN_MS", help = POSTGRES_LOSS_DRAIN_MS.help(), default_value = POSTGRES_LOSS_DRAIN_MS.default_text(), value_parser = POSTGRES_LOSS_DRAIN_MS.whole_number::<u64>())]
    pub postgres_loss_drain_ms: u64,
    /// `--reconnect-backoff-max-ms`: doc, range and default in [`crate::config::numeric::RECONNECT_BACKOFF_MAX_MS`].
    #[arg(long, env = "PGOUTBOX_RECONNECT_BACKOFF_MAX_MS", help = RECONNECT_BACKOFF_MAX_MS.help(), default_value = RECONNECT_BACKOFF_MAX_MS.default_text(), value_parser = RECONNECT_BACKOFF_MAX_MS.whole_number::<u64>())]
    pub reconnect_backoff_max_ms: u64,
}

/// `run`'s observability options.
#[derive(Debug, Clone, Args)]
#[command(next_help_heading = "Observability")]
pub struct ObservabilityArgs {
    /// Instance id shown in application_name and the RabbitMQ connection name
    /// (default: hostname-pid).
    #[arg(long, env = "PGOUTBOX_INSTANCE_ID")]
    pub instance_id: Option<String>,
    /// Where to serve /metrics, /healthz and /readyz: HOST:PORT, or off.
    #[arg(long, env = "PGOUTBOX_HTTP_ADDR", default_value = DEFAULT_HTTP_ADDR, value_parser = parse_http_addr_arg)]
    pub http_addr: HttpAddr,
    /// `--stall-after-s`: doc, range and default in [`crate::config::numeric::STALL_AFTER_S`].
    #[arg(long, env = "PGOUTBOX_STALL_AFTER_S", help = STALL_AFTER_S.help(), default_value = STALL_AFTER_S.default_text(), value_parser = STALL_AFTER_S.whole_number::<u64>())]
    pub stall_after_s: u64,
    /// Record every confirmed message (message id, topic, LSNs, attempts, confirm time) in
    /// outbox.journal, one batched INSERT per status-update interval. An audit record: it
    /// never holds back acknowledgement, so a crash may lose its last interval, and rows
    /// are dropped (counted in pgoutbox_journal_rows_dropped_total) when its buffer is full or a
    /// write fails.
    #[arg(long, env = "PGOUTBOX_JOURNAL")]
    pub journal: bool,
}

/// `run`'s publishing options: what each message carries, and what becomes of a returned one.
#[derive(Debug, Clone, Args)]
#[command(next_help_heading = "Publishing")]
pub struct PublishingArgs {
    /// What each message carries: `full` (message_id, content_type, timestamp, the
    /// producer's headers and ours: x-pgoutbox-lsn, x-pgoutbox-commit-lsn,
    /// x-pgoutbox-commit-time-us) or `minimal` (persistent, message_id, routing key and the
    /// producer's headers only; consumers can no longer detect order inversions).
    #[arg(long, env = "PGOUTBOX_PUBLISH_PROPERTIES", value_enum, default_value_t = PublishPropertiesArg::Full)]
    pub publish_properties: PublishPropertiesArg,
    /// Publish every message as a CloudEvent, in the binary content mode of the CloudEvents
    /// AMQP binding: the attributes specversion (1.0), id (message_id), source, type
    /// (topic), time (commit time, RFC 3339) and subject (the aggregate id, when given) as
    /// headers named with --cloudevents-prefix; datacontenttype as the content-type
    /// property; the body is the payload. Our x-pgoutbox-* headers stay.
    #[arg(long, env = "PGOUTBOX_CLOUDEVENTS")]
    pub cloudevents: bool,
    /// The CloudEvents source of every event (with --cloudevents): a URI-reference of at most
    /// 255 bytes. Default: pgoutbox:///DATABASE/SLOT (no host, so that it stays the same
    /// across failovers and the addresses of a multi-host URL).
    #[arg(long, env = "PGOUTBOX_CLOUDEVENTS_SOURCE")]
    pub cloudevents_source: Option<String>,
    /// The CloudEvents header prefix (with --cloudevents): cloudEvents_ (default: the
    /// current binding text, usable by JMS clients) or cloudEvents: (the released 1.0.2
    /// text). No other value.
    #[arg(long, env = "PGOUTBOX_CLOUDEVENTS_PREFIX", value_parser = parse_cloudevents_prefix)]
    pub cloudevents_prefix: Option<crate::cloudevents::Prefix>,
    /// What to do with a message returned as unroutable (no queue bound for its key).
    #[arg(long, env = "PGOUTBOX_ON_UNROUTABLE", value_enum, default_value_t = OnUnroutable::DeadLetter)]
    pub on_unroutable: OnUnroutable,
}

/// What `run` does with a message the broker returns as unroutable.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum OnUnroutable {
    /// Write it to outbox.dead_letter and go on.
    DeadLetter,
    /// Retry it forever (with backoff), holding everything after it, and log loudly.
    Block,
}

/// What `run` puts into each message (see `--publish-properties`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum PublishPropertiesArg {
    /// message_id, content_type, persistent, timestamp, the producer's headers and ours
    /// (message LSN, commit LSN, commit time).
    Full,
    /// Only persistent, message_id, the routing key and the producer's own headers: cheaper
    /// for the broker, but consumers lose the commit time and LSN headers.
    Minimal,
}

/// `--partition-key`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum PartitionKeyArg {
    /// The envelope's aggregate_id.
    #[value(name = "aggregate_id")]
    AggregateId,
    /// The envelope's tenant.
    Tenant,
    /// The message's topic.
    Topic,
}

/// `--amqp-url-order`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum AmqpUrlOrderArg {
    /// As given.
    InOrder,
    /// Shuffled once at start.
    Shuffle,
}

/// A parsed `--http-addr` (`None`: off).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HttpAddr(pub Option<std::net::SocketAddr>);

fn parse_cloudevents_prefix(text: &str) -> Result<crate::cloudevents::Prefix, String> {
    text.parse()
        .map_err(|e: crate::cloudevents::PrefixError| e.to_string())
}

fn parse_http_addr_arg(text: &str) -> Result<HttpAddr, String> {
    crate::config::parse_http_addr(text)
        .map(HttpAddr)
        .map_err(|e| e.to_string())
}

impl RunArgs {
    /// Builds and validates the run settings, once, at the edge: the connection strings
    /// are put together from their sources (files read here), the database URL is parsed,
    /// the AMQP TLS flags become each URL's parameters, and every setting is checked
    /// ([`RunSettings::validate`], with the publisher's URL parser for the broker URLs).
    ///
    /// # Errors
    /// [`ValidationError`] naming the flag: a connection string missing or given twice, an
    /// unreadable file, a TLS flag that conflicts with the URL, a value out of range.
    pub fn into_config(self) -> Result<RunConfig, ValidationError> {
        let RunArgs {
            postgres,
            broker,
            bounds,
            observability,
            publishing,
            failpoint,
            ..
        } = self;
        let database_url = postgres.db.url.resolve()?;
        let database = crate::config::parse_database_url(&database_url)?;
        let settings = RunSettings {
            publishing: publishing.into_settings(&database, &postgres.db.slot)?,
            broker: broker.into_settings()?,
            postgres: postgres.into_settings(database)?,
            bounds: bounds.into_settings(),
            observability: observability.into_settings(),
            failpoint,
        };
        settings.validate(&|url| {
            if url.starts_with("rabbitmq-stream") {
                return crate::stream_publisher::endpoint(url)
                    .map(drop)
                    .map_err(|e| e.to_string());
            }
            crate::publisher::socket::Endpoint::parse(url)
                .map(drop)
                .map_err(|e| e.to_string())
        })
    }
}

impl PostgresArgs {
    fn into_settings(
        self,
        database: crate::config::DatabaseConfig,
    ) -> Result<PostgresSettings, ValidationError> {
        Ok(PostgresSettings {
            schema: self.db.schema()?,
            prefix: self
                .prefix
                .as_deref()
                .map(|p| crate::outbox_schema::MessagePrefix::parse("--prefix", p))
                .transpose()?,
            database,
            slot: self.db.slot,
            publication: self.publication,
            slot_busy_timeout: (self.slot_busy_timeout_s > 0)
                .then(|| Duration::from_secs(self.slot_busy_timeout_s)),
            standby_poll: Duration::from_millis(self.standby_poll_ms),
            accept_gap: self.accept_gap,
            retention: RetentionSettings {
                idempotency: self.idempotency_retention,
                journal: self.journal_retention,
                interval: self.maintenance_interval,
            },
        })
    }
}

impl BrokerArgs {
    fn into_settings(self) -> Result<BrokerSettings, ValidationError> {
        if !self.stream_url.is_empty() || self.stream.is_some() {
            return self.into_stream_settings();
        }
        // One URL, a comma-separated list, or the flag repeated (one per node), or a file
        // holding any of these; the password file and the TLS files apply to every node.
        let raw: Vec<String> = if self.amqp_url.is_empty() || self.amqp_url_file.is_some() {
            // Reads the file, or names the missing or twice-given setting.
            vec![crate::secrets::resolve(
                Target::Amqp,
                &Sources {
                    url: self.amqp_url.first().cloned(),
                    url_file: self.amqp_url_file.clone(),
                    password_file: None,
                },
            )?]
        } else {
            self.amqp_url.iter().map(|u| u.0.clone()).collect()
        };
        let tls_files = crate::secrets::AmqpTlsFiles {
            ca_file: self.amqp_ca_file.clone(),
            cert_file: self.amqp_cert_file.clone(),
            key_file: self.amqp_key_file.clone(),
        };
        let amqp_urls = crate::config::split_amqp_urls(&raw)
            .into_iter()
            .map(|url| {
                let url = crate::secrets::resolve(
                    Target::Amqp,
                    &Sources {
                        url: Some(Secret(url)),
                        url_file: None,
                        password_file: self.amqp_password_file.clone(),
                    },
                )?;
                crate::secrets::with_amqp_tls_files(&url, &tls_files).map(BrokerUrl::new)
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(BrokerSettings {
            amqp_urls,
            amqp_url_order: match self.amqp_url_order {
                AmqpUrlOrderArg::InOrder => AmqpUrlOrder::InOrder,
                AmqpUrlOrderArg::Shuffle => AmqpUrlOrder::Shuffle,
            },
            exchange: self.exchange,
            // Repeated flags and comma-separated lists mix; no flag: any exchange.
            allowed_exchanges: if self.allowed_exchanges.is_empty() {
                AllowedExchanges::Any
            } else {
                AllowedExchanges::parse(&self.allowed_exchanges.join(","))?
            },
            exchange_declare: if self.no_declare {
                ExchangeDeclare::Passive
            } else {
                ExchangeDeclare::DurableTopic
            },
            partitions: Partitions {
                count: self.partitions,
                key: match self.partition_key {
                    PartitionKeyArg::AggregateId => PartitionKey::AggregateId,
                    PartitionKeyArg::Tenant => PartitionKey::Tenant,
                    PartitionKeyArg::Topic => PartitionKey::Topic,
                },
            },
            stream: None,
            // Used only with --stream; kept so that its range is checked either way.
            stream_max_length_bytes: self.stream_max_length_bytes,
        })
    }
}

impl BrokerArgs {
    /// `--stream-url` with `--stream`: the stream replaces the exchange for this run.
    fn into_stream_settings(self) -> Result<BrokerSettings, ValidationError> {
        let conflict = |setting: &'static str, given: &str| {
            ValidationError {
            setting,
            value: given.to_owned(),
            rule: "--stream-url/--stream replace --amqp-url/--exchange for a run: give one or the other".into(),
        }
        };
        if !self.amqp_url.is_empty() || self.amqp_url_file.is_some() {
            return Err(conflict("--amqp-url", "(given with --stream-url)"));
        }
        if self.stream_url.is_empty() {
            return Err(ValidationError {
                setting: "--stream-url",
                value: String::new(),
                rule: "--stream needs --stream-url rabbitmq-stream://user:password@host:5552/vhost"
                    .into(),
            });
        }
        let Some(stream) = self.stream else {
            return Err(ValidationError {
                setting: "--stream",
                value: String::new(),
                rule: "--stream-url needs --stream NAME, the stream to publish into".into(),
            });
        };
        if self.partitions > 1 {
            return Err(ValidationError {
                setting: "--partitions",
                value: self.partitions.to_string(),
                rule: "a stream is written by one producer (one connection, one publishing-id sequence): leave --partitions at 1 with --stream".into(),
            });
        }
        let raw: Vec<String> = self.stream_url.iter().map(|u| u.0.clone()).collect();
        Ok(BrokerSettings {
            amqp_urls: crate::config::split_stream_urls(&raw)
                .into_iter()
                .map(BrokerUrl::new)
                .collect(),
            amqp_url_order: match self.amqp_url_order {
                AmqpUrlOrderArg::InOrder => AmqpUrlOrder::InOrder,
                AmqpUrlOrderArg::Shuffle => AmqpUrlOrder::Shuffle,
            },
            exchange: self.exchange,
            allowed_exchanges: AllowedExchanges::Any,
            exchange_declare: if self.no_declare {
                ExchangeDeclare::Passive
            } else {
                ExchangeDeclare::DurableTopic
            },
            partitions: Partitions::default(),
            stream: Some(crate::config::StreamSettings {
                stream,
                producer_name: self.stream_producer_name,
                max_age: self.stream_max_age,
            }),
            stream_max_length_bytes: self.stream_max_length_bytes,
        })
    }
}

impl BoundsArgs {
    fn into_settings(self) -> PipelineBounds {
        PipelineBounds {
            max_in_flight: self.max_in_flight,
            max_in_flight_bytes: self.max_in_flight_bytes,
            max_message_bytes: self.max_message_bytes,
            broker_max_message_bytes: self.broker_max_message_bytes,
            max_attempts: self.max_attempts,
            read_coalesce: Duration::from_micros(self.read_coalesce_us),
            shutdown_timeout: Duration::from_secs(self.shutdown_timeout_s),
            postgres_loss_drain: Duration::from_millis(self.postgres_loss_drain_ms),
            reconnect_backoff_max: Duration::from_millis(self.reconnect_backoff_max_ms),
        }
    }
}

impl ObservabilityArgs {
    fn into_settings(self) -> ObservabilitySettings {
        ObservabilitySettings {
            instance_id: self.instance_id.unwrap_or_else(|| {
                let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
                    .map(|h| h.trim().to_owned())
                    .unwrap_or_else(|_| "host".into());
                format!("{host}-{}", std::process::id())
            }),
            http_addr: self.http_addr.0,
            stall_after: Duration::from_secs(self.stall_after_s),
            journal: if self.journal {
                JournalMode::On
            } else {
                JournalMode::Off
            },
        }
    }
}

impl PublishingArgs {
    fn into_settings(
        self,
        database: &crate::config::DatabaseConfig,
        slot: &str,
    ) -> Result<PublishingSettings, ValidationError> {
        Ok(PublishingSettings {
            cloudevents: self.cloudevents_binding(database, slot)?,
            publish_properties: match self.publish_properties {
                PublishPropertiesArg::Full => PublishProperties::Full,
                PublishPropertiesArg::Minimal => PublishProperties::Minimal,
            },
            on_unroutable: match self.on_unroutable {
                OnUnroutable::DeadLetter => UnroutablePolicy::DeadLetter,
                OnUnroutable::Block => UnroutablePolicy::Block,
            },
        })
    }

    /// The CloudEvents settings: `None` without `--cloudevents`; the source defaults to
    /// [`crate::cloudevents::default_source`] of the database (libpq's default: the user
    /// name) and the slot. Validated with the rest.
    fn cloudevents_binding(
        &self,
        database: &crate::config::DatabaseConfig,
        slot: &str,
    ) -> Result<Option<crate::cloudevents::Binding>, ValidationError> {
        if !self.cloudevents {
            let stray = [
                ("--cloudevents-source", self.cloudevents_source.clone()),
                (
                    "--cloudevents-prefix",
                    self.cloudevents_prefix.map(|p| p.to_string()),
                ),
            ];
            return match stray.into_iter().find_map(|(s, v)| Some((s, v?))) {
                Some((setting, value)) => Err(ValidationError {
                    setting,
                    value,
                    rule: "is used only with --cloudevents: add --cloudevents \
                           (PGOUTBOX_CLOUDEVENTS=true, or cloudevents = true in the config file) \
                           or remove this setting"
                        .into(),
                }),
                None => Ok(None),
            };
        }
        let source = match &self.cloudevents_source {
            Some(source) => source.clone(),
            None => {
                let name = database
                    .pg
                    .get_dbname()
                    .or(database.pg.get_user())
                    .unwrap_or_default();
                crate::cloudevents::default_source(name, slot)
            }
        };
        Ok(Some(crate::cloudevents::Binding {
            source,
            prefix: self.cloudevents_prefix.unwrap_or_default(),
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cli::{Cli, Command};
    use clap::Parser;

    #[test]
    fn cloudevents_settings() {
        let config = |url: &str, extra: &[&str]| {
            let mut args = vec![
                "pgoutbox",
                "run",
                "--database-url",
                url,
                "--amqp-url",
                "amqp://h",
                "--slot",
                "s_1",
            ];
            args.extend(extra);
            match Cli::try_parse_from(args).unwrap().command {
                Command::Run(args) => args.into_config(),
                _ => unreachable!(),
            }
        };
        use crate::cloudevents::{Binding, Prefix};
        assert_eq!(
            config("postgres://u@h/db", &[])
                .unwrap()
                .publishing
                .cloudevents,
            None
        );
        assert_eq!(
            config("postgres://u@h/db", &["--cloudevents"])
                .unwrap()
                .publishing
                .cloudevents
                .clone(),
            Some(Binding {
                source: "pgoutbox:///db/s_1".into(),
                prefix: Prefix::Underscore
            })
        );
        // No database name: libpq's default, the user name.
        let b = config(
            "host=h user=app",
            &["--cloudevents", "--cloudevents-prefix", "cloudEvents:"],
        )
        .unwrap()
        .publishing
        .cloudevents
        .clone()
        .unwrap();
        assert_eq!(
            (b.source.as_str(), b.prefix),
            ("pgoutbox:///app/s_1", Prefix::Colon)
        );
        let b = config(
            "postgres://u@h/db",
            &["--cloudevents", "--cloudevents-source", "/orders"],
        )
        .unwrap()
        .publishing
        .cloudevents
        .clone()
        .unwrap();
        assert_eq!(b.source, "/orders");
        let e = config("postgres://u@h/db", &["--cloudevents-source", "/orders"]).unwrap_err();
        assert_eq!(
            (e.setting, e.value.as_str()),
            ("--cloudevents-source", "/orders")
        );
        assert!(e.rule.contains("only with --cloudevents"), "{e}");
        assert!(
            Cli::try_parse_from(["pgoutbox", "run", "--cloudevents-prefix", "cloudEvents"])
                .unwrap_err()
                .to_string()
                .contains("is not a CloudEvents AMQP property prefix")
        );
    }

    /// The `RunConfig` of `pgoutbox run` with a database and broker URL and `extra`.
    fn run(extra: &[&str]) -> RunConfig {
        let mut args = vec![
            "pgoutbox",
            "run",
            "--database-url",
            "postgres://u@h/db",
            "--amqp-url",
            "amqp://h",
        ];
        args.extend(extra);
        match Cli::try_parse_from(args).unwrap().command {
            Command::Run(args) => args.into_config().unwrap(),
            _ => unreachable!(),
        }
    }

    #[test]
    fn metrics_are_served_on_loopback_by_default_and_can_be_turned_off() {
        assert_eq!(
            run(&[])
                .observability
                .http_addr
                .map(|a| a.to_string())
                .as_deref(),
            Some(DEFAULT_HTTP_ADDR)
        );
        assert_eq!(run(&["--http-addr", "off"]).observability.http_addr, None);
        assert!(Cli::try_parse_from([
            "pgoutbox",
            "run",
            "--database-url",
            "x",
            "--amqp-url",
            "y",
            "--http-addr",
            "nonsense"
        ])
        .is_err());
    }

    #[test]
    fn reads_are_not_delayed_unless_a_coalescing_delay_is_asked_for() {
        assert_eq!(run(&[]).bounds.read_coalesce, Duration::ZERO);
        assert_eq!(
            run(&["--read-coalesce-us", "1000"]).bounds.read_coalesce,
            Duration::from_millis(1)
        );
    }

    #[test]
    fn every_numeric_or_duration_option_of_run_is_in_the_one_table() {
        // Walks clap's `run`: an option whose value is a number, a duration or a retention
        // must take its doc, range, default and parser from config::numeric, so a new one
        // cannot be left out of validation, the bounds test and the reference.
        use crate::cli::reference::{value_form, ValueForm};
        use crate::config::numeric::{by_flag, Unit, NUMERIC_SETTINGS};
        use clap::CommandFactory;
        use std::any::TypeId;
        let mut cli = Cli::command();
        cli.build();
        let mut seen = Vec::new();
        for cmd in ["run", "check"] {
            let cmd = cli.find_subcommand(cmd).unwrap();
            for arg in cmd.get_arguments() {
                let Some(long) = arg.get_long() else { continue };
                let flag = format!("--{long}");
                let parsed = arg.get_value_parser().type_id();
                let numeric = value_form(arg) == ValueForm::Number
                    || parsed == TypeId::of::<Duration>()
                    || parsed == TypeId::of::<Retention>();
                let Some(setting) = by_flag(&flag) else {
                    assert!(!numeric, "{flag} is numeric: add it to config::numeric");
                    continue;
                };
                assert!(numeric, "{flag} is in config::numeric but takes no number");
                assert_eq!(
                    arg.get_help().map(|h| h.to_string()),
                    Some(setting.help()),
                    "{flag}: its help is the table's doc and range"
                );
                assert_eq!(arg.get_long_help(), None, "{flag}");
                let default: Vec<_> = arg
                    .get_default_values()
                    .iter()
                    .map(|v| v.to_string_lossy().into_owned())
                    .collect();
                let want: Vec<String> = setting
                    .default
                    .map(|d| setting.unit.render(d.into()))
                    .into_iter()
                    .collect();
                assert_eq!(default, want, "{flag}: default");
                assert_eq!(
                    matches!(setting.unit, Unit::Duration),
                    value_form(arg) == ValueForm::Text,
                    "{flag}: a humantime duration is text, the others whole numbers"
                );
                seen.push(flag);
            }
        }
        assert_eq!(seen.len(), 2 * NUMERIC_SETTINGS.len(), "{seen:?}");
    }

    #[test]
    fn each_numeric_option_reaches_its_field_and_is_held_to_its_range() {
        // Both ends through the command line land in the field the table names; one past
        // the end is refused, naming the flag (by validate, or by the retention's parser).
        use crate::config::numeric::NUMERIC_SETTINGS;
        let parse = |flag: &str, value: &str| {
            let arg = format!("{flag}={value}");
            let args = [
                "pgoutbox",
                "run",
                "--database-url",
                "postgres://u@h/db",
                "--amqp-url",
                "amqp://h",
                arg.as_str(),
            ];
            match Cli::try_parse_from(args) {
                Ok(cli) => match cli.command {
                    Command::Run(args) => args.into_config().map_err(|e| e.to_string()),
                    _ => unreachable!(),
                },
                Err(e) => Err(e.to_string()),
            }
        };
        for s in NUMERIC_SETTINGS {
            for ok in [s.min, s.max] {
                let config = parse(s.flag, &s.unit.render(ok.into()))
                    .unwrap_or_else(|e| panic!("{} = {ok}: {e}", s.flag));
                let mut settings = config.into_settings();
                assert_eq!(
                    (s.field)(&mut settings).read(s.unit),
                    Some(ok.into()),
                    "{}",
                    s.flag
                );
            }
            let e = parse(s.flag, &s.unit.render(u128::from(s.max) + 1)).unwrap_err();
            assert!(e.contains(s.flag), "{}: {e}", s.flag);
        }
        let e = parse("--partitions", "65").unwrap_err();
        assert!(
            e.starts_with(
                "invalid setting --partitions (PGOUTBOX_PARTITIONS) = \"65\": must be from 1 to 64 partitions"
            ),
            "{e}"
        );
    }

    #[test]
    fn validation_errors_name_the_flag_and_its_environment_variable() {
        // The rule env_of relies on holds for every option of every subcommand.
        use clap::CommandFactory;
        let cli = Cli::command();
        let mut checked = 0;
        let mut stack: Vec<&clap::Command> = vec![&cli];
        while let Some(cmd) = stack.pop() {
            stack.extend(cmd.get_subcommands());
            for arg in cmd.get_arguments() {
                if let Some(long) = arg.get_long() {
                    // Every flag: env_of names its variable, or None when it has none.
                    assert_eq!(
                        crate::config::env_of(&format!("--{long}")).as_deref(),
                        arg.get_env().and_then(|e| e.to_str()),
                        "--{long} in {}",
                        cmd.get_name()
                    );
                    checked += 1;
                }
            }
        }
        assert!(checked >= 30, "checked {checked} options");
        let e = crate::config::ValidationError {
            setting: "--read-coalesce-us",
            value: "200000".into(),
            rule: "must be at most 100000".into(),
        };
        assert_eq!(
            e.to_string(),
            "invalid setting --read-coalesce-us (PGOUTBOX_READ_COALESCE_US) = \"200000\": must be at most 100000"
        );
    }
    #[test]
    fn debug_of_the_config_types_redacts() {
        let db = "postgres://u:hunter2pg@h/db";
        let amqp = "amqps://g:hunter2mq@h/%2f?cacertfile=/ca.pem";
        let cli =
            Cli::try_parse_from(["pgoutbox", "run", "--database-url", db, "--amqp-url", amqp])
                .unwrap();
        let run = match &cli.command {
            Command::Run(args) => args.clone(),
            _ => unreachable!(),
        };
        let config = run.clone().into_config().unwrap();
        let publisher = crate::publisher::PublisherConfig {
            amqp_url: config.broker.amqp_urls[0].clone(),
            exchange: "x".into(),
            declare: crate::publisher::connection::Declare::DurableTopic,
            connection_name: "pgoutbox test".into(),
            signals: Default::default(),
        };
        let endpoint = crate::publisher::socket::Endpoint::parse(amqp).unwrap();
        let pg = crate::config::parse_database_url(&db.into()).unwrap();
        for (what, text) in [
            ("Cli", format!("{cli:?}")),
            ("RunArgs", format!("{run:?}")),
            ("RunConfig", format!("{config:?}")),
            ("PublisherConfig", format!("{publisher:?}")),
            ("Endpoint", format!("{endpoint:?}")),
            ("tokio_postgres::Config", format!("{pg:?}")),
            ("Secret", format!("{:?}", Secret(db.into()))),
        ] {
            assert!(!text.contains("hunter2"), "{what}: {text}");
            // Still useful: the user and host are shown.
            assert!(text.contains('u') && text.contains('h'), "{what}: {text}");
        }
    }

    #[test]
    fn the_tls_flags_reach_the_publisher_through_the_url() {
        let args = [
            "pgoutbox",
            "run",
            "--database-url",
            "postgres://u@h/db",
            "--amqp-url",
            "amqps://g:g@h/%2f",
            "--amqp-ca-file",
            "/etc/ca.pem",
            "--amqp-cert-file",
            "/c.pem",
            "--amqp-key-file",
            "/k.pem",
        ];
        let config = match Cli::try_parse_from(args).unwrap().command {
            Command::Run(args) => args.into_config().unwrap(),
            _ => unreachable!(),
        };
        let ep =
            crate::publisher::socket::Endpoint::parse(config.broker.amqp_urls[0].expose_secret())
                .unwrap();
        let tls = ep.tls.unwrap();
        assert_eq!(
            tls.anchors,
            crate::publisher::tls::TrustAnchors::CaFile("/etc/ca.pem".into())
        );
        let id = tls.identity.unwrap();
        assert_eq!(id.certfile, PathBuf::from("/c.pem"));
        assert_eq!(id.keyfile, PathBuf::from("/k.pem"));
    }

    #[test]
    fn malformed_broker_urls_are_refused_by_the_publishers_parser_without_their_password() {
        for (url, why) in [
            ("amqp://g:secret@h:99999999/%2f", "invalid port number"),
            ("amqp://g:secret@h/%2f?heartbeat=é", "invalid digit"),
            ("amqp://g:secret@h/%2f?channel_max=70000", "too large"),
            ("amqp://g:secret@[::1/%2f", "invalid IPv6"),
        ] {
            let args = [
                "pgoutbox",
                "run",
                "--database-url",
                "postgres://u@h/db",
                "--amqp-url",
                url,
            ];
            let e = match Cli::try_parse_from(args).unwrap().command {
                Command::Run(args) => args.into_config().unwrap_err(),
                _ => unreachable!(),
            };
            assert_eq!(e.setting, "--amqp-url", "{url}");
            let text = e.to_string();
            assert!(
                text.contains(why)
                    && text.contains("expected amqp://user:password@host:port/vhost"),
                "{url}: {text}"
            );
            assert!(!text.contains("secret"), "{text}");
        }
    }
}
