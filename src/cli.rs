//! Command-line interface (clap). Every option also reads a `PGOUTBOX_*` environment variable.

use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, Parser, Subcommand};

use crate::secrets::{Secret, Sources, Target};

use crate::config::{
    JournalMode, Retention, RetentionSettings, DEFAULT_RETENTION_BATCH, RETENTION_BATCH_CAP,
};
use crate::config::{
    PublishProperties, RunConfig, UnroutablePolicy, DEAD_LETTER_AGE_CAP, DEAD_LETTER_LIST_CAP,
    DEFAULT_EXCHANGE, DEFAULT_MAX_ATTEMPTS, DEFAULT_MAX_IN_FLIGHT, DEFAULT_MAX_IN_FLIGHT_BYTES,
    DEFAULT_MAX_MESSAGE_BYTES, DEFAULT_POSTGRES_LOSS_DRAIN, DEFAULT_PUBLICATION,
    DEFAULT_READ_COALESCE, DEFAULT_SHUTDOWN_TIMEOUT, DEFAULT_SLOT, DEFAULT_SLOT_BUSY_TIMEOUT,
    DEFAULT_STALL_AFTER, DEFAULT_STANDBY_POLL,
};
use crate::metrics::DEFAULT_HTTP_ADDR;

/// Whether `teardown` may drop a slot that still holds unsent outbox messages.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Force {
    /// Refuse while outbox messages are unsent.
    No,
    /// Drop anyway; the unsent messages are lost.
    Yes,
}

/// pgoutbox: stream transactional outbox messages from PostgreSQL's WAL to RabbitMQ.
#[derive(Debug, Parser)]
#[command(name = "pgoutbox", version, about)]
pub struct Cli {
    /// How log lines on stderr are written: text for a terminal, json for a log shipper
    /// (one JSON object per line, the exit report included).
    #[arg(long, global = true, env = "PGOUTBOX_LOG_FORMAT", value_enum, default_value_t = LogFormat::Text)]
    pub log_format: LogFormat,
    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

/// The format of what pgoutbox writes to stderr (`--log-format`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    /// Human-readable lines (tracing-subscriber's default format).
    Text,
    /// One JSON object per line: `timestamp`, `level`, `target`, `message` and the
    /// event's fields (`slot`, `lsn`, `message_id`, `attempt`, `reason`, ...).
    Json,
}

/// The subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Install sql/outbox.sql, create the publication and the pgoutput slot (idempotent).
    Setup(SetupArgs),
    /// Stream outbox messages to RabbitMQ until SIGINT/SIGTERM.
    Run(RunArgs),
    /// Check what `run` needs (settings, both servers, slot, publication, exchange)
    /// without changing anything; exits 1 if `run` would stop, with the fix.
    Check(RunArgs),
    /// Show the slot's health (lag, retained WAL, waiting messages, dead letters); exit 0
    /// healthy, 1 warning, 2 critical.
    Status(StatusArgs),
    /// List the outbox messages waiting in the slot without consuming them (only while no
    /// streamer holds it).
    Peek(PeekArgs),
    /// Drop the slot and the publication.
    Teardown(TeardownArgs),
    /// Delete expired idempotency keys, journal rows and inbox records once (for cron);
    /// exit 0 when every step ran or was skipped, 1 when one failed, 2 for bad arguments.
    Maintenance(MaintenanceArgs),
    /// Print the delivery journal's entries for a message id (`run --journal`), oldest
    /// first; exit 0 when there is at least one, 1 when none.
    Journal(JournalArgs),
    /// Inspect, requeue or purge messages in outbox.dead_letter.
    #[command(subcommand)]
    DeadLetters(DeadLetterCommand),
}

/// `maintenance` arguments.
#[derive(Debug, Args)]
pub struct MaintenanceArgs {
    /// The database.
    #[command(flatten)]
    pub db: DeadLetterDb,
    /// Delete outbox.idempotency keys older than this: a duration such as 7d, 12h, 30m,
    /// or 0 to keep them all.
    #[arg(long, env = "PGOUTBOX_IDEMPOTENCY_RETENTION", default_value = "7d", value_parser = parse_idempotency_retention)]
    pub idempotency_retention: Retention,
    /// Delete outbox.journal rows confirmed longer ago than this (7d, 12h, 30m; 0 keeps them).
    #[arg(long, env = "PGOUTBOX_JOURNAL_RETENTION", default_value = "7d", value_parser = parse_journal_retention)]
    pub journal_retention: Retention,
    /// Delete outbox.inbox records received longer ago than this, through
    /// outbox.inbox_purge (sql/inbox.sql; skipped when it is not installed); 0 keeps them.
    #[arg(long, env = "PGOUTBOX_INBOX_RETENTION", default_value = "7d", value_parser = parse_inbox_retention)]
    pub inbox_retention: Retention,
    /// Rows deleted per statement (1 to 100000).
    #[arg(long, default_value_t = DEFAULT_RETENTION_BATCH, value_parser = parse_batch_size)]
    pub batch_size: u32,
}

/// `journal` arguments.
#[derive(Debug, Args)]
pub struct JournalArgs {
    /// The message id (as in the AMQP message_id property).
    pub message_id: String,
    /// The database.
    #[command(flatten)]
    pub db: DeadLetterDb,
    /// Print one JSON array instead of lines.
    #[arg(long)]
    pub json: bool,
}

fn retention_arg(setting: &'static str, text: &str) -> Result<Retention, String> {
    Retention::parse(setting, text).map_err(|e| e.rule)
}

fn parse_idempotency_retention(text: &str) -> Result<Retention, String> {
    retention_arg("--idempotency-retention", text)
}

fn parse_journal_retention(text: &str) -> Result<Retention, String> {
    retention_arg("--journal-retention", text)
}

fn parse_inbox_retention(text: &str) -> Result<Retention, String> {
    retention_arg("--inbox-retention", text)
}

fn parse_batch_size(text: &str) -> Result<u32, String> {
    let n: u32 = parse_whole_number(text)?;
    if !(1..=RETENTION_BATCH_CAP).contains(&n) {
        return Err(format!(
            "{n} is out of range: write 1 to {RETENTION_BATCH_CAP} rows"
        ));
    }
    Ok(n)
}

/// Parses `--maintenance-interval` (a humantime duration; its range is checked by
/// `RunConfig::validate`).
pub fn parse_maintenance_interval(text: &str) -> Result<Duration, String> {
    humantime::parse_duration(text.trim())
        .map_err(|e| format!("{e}: write a duration from 1s to 1d, such as 5m"))
}

/// `dead-letters` subcommands.
#[derive(Debug, Subcommand)]
pub enum DeadLetterCommand {
    /// List dead letters (not yet requeued, unless --all), oldest first.
    List(DeadLetterListArgs),
    /// Re-emit dead letters through the normal path, with their original message_id.
    Requeue(DeadLetterSelectArgs),
    /// Delete dead letters.
    Purge(DeadLetterPurgeArgs),
}

/// The database for dead-letter commands.
#[derive(Debug, Args)]
pub struct DeadLetterDb {
    /// The connection string and where it comes from.
    #[command(flatten)]
    pub url: PgUrlArgs,
    /// The outbox's schema (its dead_letter table).
    #[arg(long, env = "PGOUTBOX_SCHEMA", default_value = crate::outbox_schema::DEFAULT_SCHEMA)]
    pub schema: String,
}

impl DeadLetterDb {
    /// The validated `--schema`.
    ///
    /// # Errors
    /// [`crate::config::ValidationError`] naming `--schema`.
    pub fn schema(
        &self,
    ) -> Result<crate::outbox_schema::SchemaName, crate::config::ValidationError> {
        crate::outbox_schema::SchemaName::parse("--schema", &self.schema)
    }
}

/// The PostgreSQL connection string: given, or read from a file, with the password perhaps
/// from a file of its own (see [`crate::secrets`]).
#[derive(Debug, Clone, Args)]
pub struct PgUrlArgs {
    /// PostgreSQL connection URL (postgres://user:password@host:port/db) or keyword/value
    /// string; a host that is a directory means a Unix socket. A password here is visible
    /// in the process list: prefer the variable or a file.
    #[arg(long, env = "PGOUTBOX_DATABASE_URL", hide_env_values = true)]
    pub database_url: Option<Secret>,
    /// A file holding the connection string (a container secret); a trailing newline is
    /// dropped. Instead of --database-url.
    #[arg(long, env = "PGOUTBOX_DATABASE_URL_FILE")]
    pub database_url_file: Option<PathBuf>,
    /// A file holding the password alone, put into the connection string (which must then
    /// have none).
    #[arg(long, env = "PGOUTBOX_DATABASE_PASSWORD_FILE")]
    pub database_password_file: Option<PathBuf>,
}

impl PgUrlArgs {
    /// The connection string, put together from its sources.
    ///
    /// # Errors
    /// [`crate::config::ValidationError`] from [`crate::secrets::resolve`].
    pub fn resolve(&self) -> Result<String, crate::config::ValidationError> {
        crate::secrets::resolve(
            Target::Postgres,
            &Sources {
                url: self.database_url.clone(),
                url_file: self.database_url_file.clone(),
                password_file: self.database_password_file.clone(),
            },
        )
    }

    /// The connection string, parsed (as [`crate::config::parse_database_url`]).
    ///
    /// # Errors
    /// [`crate::config::ValidationError`].
    pub fn config(&self) -> Result<crate::config::DatabaseConfig, crate::config::ValidationError> {
        crate::config::parse_database_url(&self.resolve()?)
    }
}

/// `dead-letters list` arguments.
#[derive(Debug, Args)]
pub struct DeadLetterListArgs {
    /// The database.
    #[command(flatten)]
    pub db: DeadLetterDb,
    /// Include requeued rows.
    #[arg(long)]
    pub all: bool,
    /// At most this many rows (1 to 1000000).
    #[arg(long, default_value_t = 100, value_parser = clap::value_parser!(i64).range(1..=DEAD_LETTER_LIST_CAP))]
    pub limit: i64,
    /// Print JSON (one array).
    #[arg(long)]
    pub json: bool,
}

/// `dead-letters requeue` arguments: `--id` (repeatable) or `--all`.
#[derive(Debug, Args)]
#[command(group(clap::ArgGroup::new("which").required(true).args(["id", "all"])))]
pub struct DeadLetterSelectArgs {
    /// The database.
    #[command(flatten)]
    pub db: DeadLetterDb,
    /// Row id (repeatable). Each must exist and not be requeued yet, or nothing is requeued.
    #[arg(long, value_parser = clap::value_parser!(i64).range(1..))]
    pub id: Vec<i64>,
    /// Every row not yet requeued.
    #[arg(long)]
    pub all: bool,
}

/// `dead-letters purge` arguments: `--id`, `--older-than` or `--all`.
#[derive(Debug, Args)]
#[command(group(clap::ArgGroup::new("which").required(true).args(["id", "older_than", "all"])))]
pub struct DeadLetterPurgeArgs {
    /// The database.
    #[command(flatten)]
    pub db: DeadLetterDb,
    /// Row id (repeatable).
    #[arg(long, value_parser = clap::value_parser!(i64).range(1..))]
    pub id: Vec<i64>,
    /// Rows dead-lettered longer ago than this: a whole number with unit s, m, h or d
    /// (e.g. 7d), at most 36500d.
    #[arg(long, value_parser = parse_age_secs)]
    pub older_than: Option<i64>,
    /// Every row.
    #[arg(long)]
    pub all: bool,
}

/// Parses `30s`, `15m`, `12h`, `7d` into seconds, at most [`DEAD_LETTER_AGE_CAP`].
///
/// Never slices the text at a byte index: the unit is matched as a suffix, so any
/// character (`7é`, `30日`) is an error, not a panic.
///
/// # Errors
/// A message naming the value and the accepted form (clap adds the flag).
pub fn parse_age_secs(text: &str) -> Result<i64, String> {
    let bad = |why: &str| {
        format!(
            "{text:?} {why}: write a whole number with unit s, m, h or d (e.g. 7d), at most {}d",
            DEAD_LETTER_AGE_CAP.as_secs() / 86_400
        )
    };
    let (num, mult) = [("s", 1u64), ("m", 60), ("h", 3600), ("d", 86_400)]
        .into_iter()
        .find_map(|(unit, mult)| text.strip_suffix(unit).map(|num| (num, mult)))
        .ok_or_else(|| bad("has no unit"))?;
    if num.is_empty() || !num.bytes().all(|b| b.is_ascii_digit()) {
        return Err(bad("is not a whole number"));
    }
    num.parse::<u64>()
        .ok()
        .and_then(|n| n.checked_mul(mult))
        .filter(|secs| *secs <= DEAD_LETTER_AGE_CAP.as_secs())
        .and_then(|secs| i64::try_from(secs).ok())
        .ok_or_else(|| bad("is too long"))
}

/// Parses a whole number (ASCII digits only) for a numeric `run` option. The option's
/// range is checked by [`RunConfig::validate`], which names the setting, its environment
/// variable and the bounds.
///
/// # Errors
/// A message naming the value and the accepted form (clap adds the flag).
pub fn parse_whole_number<T: std::str::FromStr>(text: &str) -> Result<T, String> {
    if text.is_empty() || !text.bytes().all(|b| b.is_ascii_digit()) {
        return Err(format!(
            "{text:?} is not a whole number: write digits only (no sign, unit, decimal point or separator); the range is in --help"
        ));
    }
    text.parse()
        .map_err(|_| format!("{text:?} is far too large; the range is in --help"))
}

/// What `run` does with a message the broker returns as unroutable.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum OnUnroutable {
    /// Write it to outbox.dead_letter and go on.
    DeadLetter,
    /// Retry it forever (with backoff), holding everything after it, and log loudly.
    Block,
}

/// What `run` puts into each message (see `--publish-properties`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum PublishPropertiesArg {
    /// message_id, content_type, persistent, timestamp, the producer's headers and ours
    /// (message LSN, commit LSN, commit time).
    Full,
    /// Only persistent, message_id, the routing key and the producer's own headers: cheaper
    /// for the broker, but consumers lose the commit time and LSN headers.
    Minimal,
}

/// `--amqp-url-order`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum AmqpUrlOrderArg {
    /// As given.
    InOrder,
    /// Shuffled once at start.
    Shuffle,
}

/// Connection to Postgres and the slot's name.
#[derive(Debug, Clone, Args)]
pub struct DbArgs {
    /// The connection string and where it comes from.
    #[command(flatten)]
    pub url: PgUrlArgs,
    /// Logical replication slot name.
    #[arg(long, env = "PGOUTBOX_SLOT", default_value = DEFAULT_SLOT)]
    pub slot: String,
    /// The outbox's schema: its producer helpers, dead letters, stream state and prefix
    /// setting live there. Several outboxes can share a database, each with its own schema,
    /// prefix, slot and publication (1 to 63 of a-z, 0-9, _).
    #[arg(long, env = "PGOUTBOX_SCHEMA", default_value = crate::outbox_schema::DEFAULT_SCHEMA)]
    pub schema: String,
}

impl DbArgs {
    /// The validated `--schema`.
    ///
    /// # Errors
    /// [`crate::config::ValidationError`] naming `--schema`.
    pub fn schema(
        &self,
    ) -> Result<crate::outbox_schema::SchemaName, crate::config::ValidationError> {
        crate::outbox_schema::SchemaName::parse("--schema", &self.schema)
    }
}

/// `setup` arguments.
#[derive(Debug, Args)]
pub struct SetupArgs {
    /// Database and slot.
    #[command(flatten)]
    pub db: DbArgs,
    /// Publication name (created empty: logical messages need no tables).
    #[arg(long, env = "PGOUTBOX_PUBLICATION", default_value = DEFAULT_PUBLICATION)]
    pub publication: String,
    /// The logical-message prefix the schema's helpers write, stored in its settings table
    /// for `run` (1 to 255 of A-Za-z0-9._:-). Default: the stored one, else pgoutbox for
    /// schema outbox; another schema must name its own on first setup.
    #[arg(long, env = "PGOUTBOX_PREFIX")]
    pub prefix: Option<String>,
    /// Also lock the database down (sql/lockdown.sql, needs a superuser): revoke EXECUTE on
    /// pg_logical_emit_message from PUBLIC, so outbox.emit/emit_bytes (SECURITY DEFINER,
    /// owned by the NOLOGIN role pgoutbox_emitter) are the only way to write an outbox
    /// message; later messages not written by them are dead-lettered as forged.
    #[arg(long, conflicts_with = "unlock")]
    pub lockdown: bool,
    /// Undo --lockdown (sql/unlock.sql, needs a superuser): GRANT EXECUTE on
    /// pg_logical_emit_message back to PUBLIC, helpers SECURITY INVOKER again.
    #[arg(long)]
    pub unlock: bool,
    /// Create the slot as a failover slot (PostgreSQL 17+): physical standbys with
    /// sync_replication_slots = on keep a synced copy that survives a promotion. Refused,
    /// with the alternative, on older servers.
    #[arg(long, env = "PGOUTBOX_FAILOVER")]
    pub failover: bool,
    /// Also create the least-privilege roles of sql/roles.sql (idempotent; needs a
    /// superuser): the streamer role (LOGIN REPLICATION, and the grants `run` needs in this
    /// database) and the producer role (NOLOGIN: EXECUTE on outbox.emit and
    /// outbox.emit_bytes). No password is set: use ALTER ROLE ... PASSWORD, or certificates.
    #[arg(long)]
    pub create_roles: bool,
    /// Name of the streamer role for --create-roles.
    #[arg(long, env = "PGOUTBOX_STREAMER_ROLE", default_value = crate::admin::DEFAULT_STREAMER_ROLE)]
    pub streamer_role: String,
    /// Name of the producer role for --create-roles.
    #[arg(long, env = "PGOUTBOX_PRODUCER_ROLE", default_value = crate::admin::DEFAULT_PRODUCER_ROLE)]
    pub producer_role: String,
}

/// `run` arguments.
#[derive(Debug, Clone, Args)]
pub struct RunArgs {
    /// TOML file of settings, keys named like these flags with _ for - (database_url,
    /// max_in_flight, ...); a flag or variable overrides the file.
    #[arg(long, env = "PGOUTBOX_CONFIG")]
    pub config: Option<std::path::PathBuf>,
    /// Database and slot.
    #[command(flatten)]
    pub db: DbArgs,
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
    /// Publication name.
    #[arg(long, env = "PGOUTBOX_PUBLICATION", default_value = DEFAULT_PUBLICATION)]
    pub publication: String,
    /// Durable topic exchange to publish to (declared if absent), for messages whose
    /// producer named no exchange.
    #[arg(long, env = "PGOUTBOX_EXCHANGE", default_value = DEFAULT_EXCHANGE)]
    pub exchange: String,
    /// The exchanges producers may name (outbox.emit(..., exchange => 'x')), separated by
    /// commas; --exchange is always allowed. A message naming another is dead-lettered
    /// with reason exchange_not_allowed, never published. Unset: any exchange; empty:
    /// only --exchange.
    #[arg(long, env = "PGOUTBOX_ALLOWED_EXCHANGES")]
    pub allowed_exchanges: Option<String>,
    /// Declare no exchange, only check that it exists (a passive declare): a missing
    /// --exchange stops run; a message naming a missing exchange is dead-lettered with
    /// reason exchange_not_found. For users without configure permission.
    #[arg(long, env = "PGOUTBOX_NO_DECLARE")]
    pub no_declare: bool,
    /// Publish only logical messages with this prefix (default: the one `setup` stored in
    /// the --schema's settings table; pgoutbox for schema outbox set up by an older
    /// version). Messages with other prefixes are acknowledged without publishing.
    #[arg(long, env = "PGOUTBOX_PREFIX")]
    pub prefix: Option<String>,
    /// Window: outbox messages read and not yet acknowledged to Postgres (unconfirmed, or
    /// confirmed behind an earlier unconfirmed one), 1 to 1000000. A transaction is
    /// acknowledged whole, so one larger than the window is still read to its end.
    #[arg(long, env = "PGOUTBOX_MAX_IN_FLIGHT", default_value_t = DEFAULT_MAX_IN_FLIGHT, value_parser = parse_whole_number::<usize>)]
    pub max_in_flight: usize,
    /// Window: bytes (logical message content) read and not yet acknowledged to Postgres,
    /// 1 to 4294967296.
    #[arg(long, env = "PGOUTBOX_MAX_IN_FLIGHT_BYTES", default_value_t = DEFAULT_MAX_IN_FLIGHT_BYTES, value_parser = parse_whole_number::<usize>)]
    pub max_in_flight_bytes: usize,
    /// Seconds to keep retrying a slot held by another process before exiting; 0 waits
    /// forever as a standby (0 to 2592000, 30 days).
    #[arg(long, env = "PGOUTBOX_SLOT_BUSY_TIMEOUT_S", default_value_t = DEFAULT_SLOT_BUSY_TIMEOUT.as_secs(), value_parser = parse_whole_number::<u64>)]
    pub slot_busy_timeout_s: u64,
    /// Milliseconds between two looks of a standby at the slot's holder
    /// (pg_replication_slots): START_REPLICATION is tried within one poll after the slot
    /// is free. Jittered down by up to a fifth so standbys do not poll in step (10 to 60000).
    #[arg(long, env = "PGOUTBOX_STANDBY_POLL_MS", default_value_t = DEFAULT_STANDBY_POLL.as_millis() as u64, value_parser = parse_whole_number::<u64>)]
    pub standby_poll_ms: u64,
    /// Seconds a SIGINT/SIGTERM waits for outstanding confirms (0 to 86400, one day).
    #[arg(long, env = "PGOUTBOX_SHUTDOWN_TIMEOUT_S", default_value_t = DEFAULT_SHUTDOWN_TIMEOUT.as_secs(), value_parser = parse_whole_number::<u64>)]
    pub shutdown_timeout_s: u64,
    /// Milliseconds to keep collecting broker confirms after the Postgres connection broke,
    /// so messages the broker already has are not sent again after the reconnect (0 to
    /// 600000; it ends early once nothing is unconfirmed).
    #[arg(long, env = "PGOUTBOX_POSTGRES_LOSS_DRAIN_MS", default_value_t = DEFAULT_POSTGRES_LOSS_DRAIN.as_millis() as u64, value_parser = parse_whole_number::<u64>)]
    pub postgres_loss_drain_ms: u64,
    /// Instance id shown in application_name and the RabbitMQ connection name
    /// (default: hostname-pid).
    #[arg(long, env = "PGOUTBOX_INSTANCE_ID")]
    pub instance_id: Option<String>,
    /// What to do with a message returned as unroutable (no queue bound for its key).
    #[arg(long, env = "PGOUTBOX_ON_UNROUTABLE", value_enum, default_value_t = OnUnroutable::DeadLetter)]
    pub on_unroutable: OnUnroutable,
    /// What each message carries: `full` (message_id, content_type, timestamp, the
    /// producer's headers and ours: x-pgoutbox-lsn, x-pgoutbox-commit-lsn,
    /// x-pgoutbox-commit-time-us) or `minimal` (persistent, message_id, routing key and the
    /// producer's headers only; consumers can no longer detect order inversions).
    #[arg(long, env = "PGOUTBOX_PUBLISH_PROPERTIES", value_enum, default_value_t = PublishPropertiesArg::Full)]
    pub publish_properties: PublishPropertiesArg,
    /// Publish attempts for a nacked message before it is dead-lettered (1 to 1000).
    #[arg(long, env = "PGOUTBOX_MAX_ATTEMPTS", default_value_t = DEFAULT_MAX_ATTEMPTS, value_parser = parse_whole_number::<u32>)]
    pub max_attempts: u32,
    /// Fault injection for tests (e.g. abort-after-confirms=100); never use in production.
    #[arg(long, env = "PGOUTBOX_FAILPOINT", hide = true)]
    pub failpoint: Option<crate::config::Failpoint>,
    /// Messages larger than this many bytes are dead-lettered as too_large, never published
    /// (1 to 536870912). The size counted is the whole envelope as emitted: the payload plus
    /// its JSON header (id, topic, content type, producer headers) and 5 bytes of framing.
    #[arg(long, env = "PGOUTBOX_MAX_MESSAGE_BYTES", default_value_t = DEFAULT_MAX_MESSAGE_BYTES, value_parser = parse_whole_number::<usize>)]
    pub max_message_bytes: usize,
    /// Microseconds between two small reads of the replication stream while 4 or more
    /// publishes are unconfirmed: one read (and one publish batch) per interval instead of
    /// one per transaction. Adds up to this much latency (plus the timer's 1 ms resolution) for
    /// fewer wake-ups; the default 0 reads every transaction as it arrives (0 to 100000).
    #[arg(long, env = "PGOUTBOX_READ_COALESCE_US", default_value_t = DEFAULT_READ_COALESCE.as_micros() as u64, value_parser = parse_whole_number::<u64>)]
    pub read_coalesce_us: u64,
    /// The broker's max_message_size in bytes, if known: payloads larger than this are
    /// dead-lettered as too_large without publishing. Unset: pgoutbox learns the limit the
    /// first time RabbitMQ refuses a message for its size (406, channel closed).
    /// 1 to 536870912 (RabbitMQ's own ceiling).
    #[arg(long, env = "PGOUTBOX_BROKER_MAX_MESSAGE_BYTES", value_parser = parse_whole_number::<usize>)]
    pub broker_max_message_bytes: Option<usize>,
    /// Where to serve /metrics, /healthz and /readyz: HOST:PORT, or off.
    #[arg(long, env = "PGOUTBOX_HTTP_ADDR", default_value = DEFAULT_HTTP_ADDR, value_parser = parse_http_addr_arg)]
    pub http_addr: HttpAddr,
    /// Seconds without any settle, while messages are unconfirmed, after which the stream
    /// counts as stalled (/readyz 503 "stalled", a warning once a minute); 1 to 3600.
    #[arg(long, env = "PGOUTBOX_STALL_AFTER_S", default_value_t = DEFAULT_STALL_AFTER.as_secs())]
    pub stall_after_s: u64,
    /// Start even though the slot's history has a gap (the slot was dropped and recreated,
    /// or the database is another cluster): the range that may be missing is logged and
    /// recorded in outbox.stream_state. A one-off decision: no variable, no file key.
    #[arg(long)]
    pub accept_gap: bool,
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
    /// Record every confirmed message (message id, topic, LSNs, attempts, confirm time) in
    /// outbox.journal, one batched INSERT per status-update interval. An audit record: it
    /// never holds back acknowledgement, so a crash may lose its last interval, and rows
    /// are dropped (counted in pgoutbox_journal_dropped_total) when its buffer is full or a
    /// write fails.
    #[arg(long, env = "PGOUTBOX_JOURNAL")]
    pub journal: bool,
    /// Delete outbox.journal rows confirmed longer ago than this: a duration such as 7d,
    /// 12h, 30m, or 0 to keep them all.
    #[arg(long, env = "PGOUTBOX_JOURNAL_RETENTION", default_value = "7d", value_parser = parse_journal_retention)]
    pub journal_retention: Retention,
    /// Delete outbox.idempotency keys older than this (7d, 12h, 30m; 0 keeps them): after
    /// it, a retried emit with the same key emits again.
    #[arg(long, env = "PGOUTBOX_IDEMPOTENCY_RETENTION", default_value = "7d", value_parser = parse_idempotency_retention)]
    pub idempotency_retention: Retention,
    /// How often the retention task deletes expired keys and journal rows (first at
    /// start), in batches of 1000 with a pause between: 1s to 1d.
    #[arg(long, env = "PGOUTBOX_MAINTENANCE_INTERVAL", default_value = "5m", value_parser = parse_maintenance_interval)]
    pub maintenance_interval: Duration,
    /// The flags whose value came on the command line (argv, visible in the process list)
    /// and carries a password; filled by [`crate::config_file::parse_cli`], warned about by
    /// `run`.
    #[arg(skip)]
    pub passwords_on_argv: Vec<&'static str>,
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
    /// Builds the typed run settings (validated later by `RunConfig::validate`): the
    /// connection strings are put together from their sources (files read here) and the
    /// AMQP TLS flags become the URL's parameters.
    ///
    /// # Errors
    /// [`crate::config::ValidationError`] naming the flag: a connection string missing or
    /// given twice, an unreadable file, a TLS flag that conflicts with the URL.
    pub fn into_config(self) -> Result<RunConfig, crate::config::ValidationError> {
        let database_url = self.db.url.resolve()?;
        let cloudevents = self.cloudevents_binding(&database_url)?;
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
                crate::secrets::with_amqp_tls_files(&url, &tls_files)
            })
            .collect::<Result<Vec<_>, _>>()?;
        let instance_id = self.instance_id.unwrap_or_else(|| {
            let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
                .map(|h| h.trim().to_owned())
                .unwrap_or_else(|_| "host".into());
            format!("{host}-{}", std::process::id())
        });
        Ok(RunConfig {
            cloudevents,
            database_url,
            amqp_urls,
            amqp_url_order: match self.amqp_url_order {
                AmqpUrlOrderArg::InOrder => crate::config::AmqpUrlOrder::InOrder,
                AmqpUrlOrderArg::Shuffle => crate::config::AmqpUrlOrder::Shuffle,
            },
            schema: self.db.schema()?,
            prefix: self
                .prefix
                .as_deref()
                .map(|p| crate::outbox_schema::MessagePrefix::parse("--prefix", p))
                .transpose()?,
            slot: self.db.slot,
            publication: self.publication,
            exchange: self.exchange,
            allowed_exchanges: match &self.allowed_exchanges {
                None => crate::config::AllowedExchanges::Any,
                Some(text) => crate::config::AllowedExchanges::parse(text)?,
            },
            exchange_declare: if self.no_declare {
                crate::config::ExchangeDeclare::Passive
            } else {
                crate::config::ExchangeDeclare::DurableTopic
            },
            max_in_flight: self.max_in_flight,
            max_in_flight_bytes: self.max_in_flight_bytes,
            slot_busy_timeout: (self.slot_busy_timeout_s > 0)
                .then(|| Duration::from_secs(self.slot_busy_timeout_s)),
            standby_poll: Duration::from_millis(self.standby_poll_ms),
            on_unroutable: match self.on_unroutable {
                OnUnroutable::DeadLetter => UnroutablePolicy::DeadLetter,
                OnUnroutable::Block => UnroutablePolicy::Block,
            },
            publish_properties: match self.publish_properties {
                PublishPropertiesArg::Full => PublishProperties::Full,
                PublishPropertiesArg::Minimal => PublishProperties::Minimal,
            },
            max_attempts: self.max_attempts,
            max_message_bytes: self.max_message_bytes,
            broker_max_message_bytes: self.broker_max_message_bytes,
            failpoint: self.failpoint,
            shutdown_timeout: Duration::from_secs(self.shutdown_timeout_s),
            postgres_loss_drain: Duration::from_millis(self.postgres_loss_drain_ms),
            read_coalesce: Duration::from_micros(self.read_coalesce_us),
            instance_id,
            http_addr: self.http_addr.0,
            stall_after: Duration::from_secs(self.stall_after_s),
            accept_gap: self.accept_gap,
            journal: if self.journal {
                JournalMode::On
            } else {
                JournalMode::Off
            },
            retention: RetentionSettings {
                idempotency: self.idempotency_retention,
                journal: self.journal_retention,
                interval: self.maintenance_interval,
            },
        })
    }

    /// The CloudEvents settings: `None` without `--cloudevents`; the source defaults to
    /// [`crate::cloudevents::default_source`] of the database (libpq's default: the user
    /// name) and the slot. Validated later, with the rest.
    fn cloudevents_binding(
        &self,
        database_url: &str,
    ) -> Result<Option<crate::cloudevents::Binding>, crate::config::ValidationError> {
        if !self.cloudevents {
            let stray = [
                ("--cloudevents-source", self.cloudevents_source.clone()),
                (
                    "--cloudevents-prefix",
                    self.cloudevents_prefix.map(|p| p.to_string()),
                ),
            ];
            return match stray.into_iter().find_map(|(s, v)| Some((s, v?))) {
                Some((setting, value)) => Err(crate::config::ValidationError {
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
                let db = crate::config::parse_database_url(database_url)?;
                let name = db.pg.get_dbname().or(db.pg.get_user()).unwrap_or_default();
                crate::cloudevents::default_source(name, &self.db.slot)
            }
        };
        Ok(Some(crate::cloudevents::Binding {
            source,
            prefix: self.cloudevents_prefix.unwrap_or_default(),
        }))
    }
}

/// Default `--warn-lag-bytes`: 1 GiB of WAL behind the current position.
pub const DEFAULT_WARN_LAG_BYTES: u64 = 1 << 30;

/// Default `--crit-lag-bytes`: 8 GiB, a day of a busy outbox, and well inside the disk of a
/// server that keeps WAL for a stopped streamer.
pub const DEFAULT_CRIT_LAG_BYTES: u64 = 8 << 30;

/// `status` arguments.
#[derive(Debug, Args)]
pub struct StatusArgs {
    /// Database and slot.
    #[command(flatten)]
    pub db: DbArgs,
    /// Publication name (a missing one is critical: `run` refuses to start).
    #[arg(long, env = "PGOUTBOX_PUBLICATION", default_value = DEFAULT_PUBLICATION)]
    pub publication: String,
    /// Lag (bytes of WAL behind the current position) above which status warns (exit 1).
    #[arg(long, env = "PGOUTBOX_WARN_LAG_BYTES", default_value_t = DEFAULT_WARN_LAG_BYTES, value_parser = parse_whole_number::<u64>)]
    pub warn_lag_bytes: u64,
    /// Lag above which status is critical (exit 2); at least --warn-lag-bytes.
    #[arg(long, env = "PGOUTBOX_CRIT_LAG_BYTES", default_value_t = DEFAULT_CRIT_LAG_BYTES, value_parser = parse_whole_number::<u64>)]
    pub crit_lag_bytes: u64,
    /// Print one JSON object instead of text.
    #[arg(long)]
    pub json: bool,
}

/// `peek` arguments.
#[derive(Debug, Args)]
pub struct PeekArgs {
    /// Database and slot.
    #[command(flatten)]
    pub db: DbArgs,
    /// Publication name (pgoutput needs one to decode).
    #[arg(long, env = "PGOUTBOX_PUBLICATION", default_value = DEFAULT_PUBLICATION)]
    pub publication: String,
    /// At most this many messages (1 to 10000).
    #[arg(long, default_value_t = 100, value_parser = clap::value_parser!(i64).range(1..=10_000))]
    pub limit: i64,
    /// Show the payloads too (as UTF-8 text; they may hold personal data).
    #[arg(long)]
    pub payload: bool,
    /// Print JSON (one object with a `messages` array).
    #[arg(long)]
    pub json: bool,
}

/// `teardown` arguments.
#[derive(Debug, Args)]
pub struct TeardownArgs {
    /// Database and slot.
    #[command(flatten)]
    pub db: DbArgs,
    /// Publication name.
    #[arg(long, env = "PGOUTBOX_PUBLICATION", default_value = DEFAULT_PUBLICATION)]
    pub publication: String,
    /// Drop the slot even if it still holds unsent outbox messages (they are lost).
    #[arg(long)]
    pub force: bool,
}

#[cfg(test)]
mod tests {
    use super::*;
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
        assert_eq!(config("postgres://u@h/db", &[]).unwrap().cloudevents, None);
        assert_eq!(
            config("postgres://u@h/db", &["--cloudevents"])
                .unwrap()
                .cloudevents,
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
        .cloudevents
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
        .cloudevents
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
            run(&[]).http_addr.map(|a| a.to_string()).as_deref(),
            Some(DEFAULT_HTTP_ADDR)
        );
        assert_eq!(run(&["--http-addr", "off"]).http_addr, None);
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
        assert_eq!(run(&[]).read_coalesce, Duration::ZERO);
        assert_eq!(
            run(&["--read-coalesce-us", "1000"]).read_coalesce,
            Duration::from_millis(1)
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
    fn ages_parse_without_slicing_inside_a_character() {
        assert_eq!(parse_age_secs("0s"), Ok(0));
        assert_eq!(parse_age_secs("90s"), Ok(90));
        assert_eq!(parse_age_secs("15m"), Ok(900));
        assert_eq!(parse_age_secs("12h"), Ok(43_200));
        assert_eq!(parse_age_secs("7d"), Ok(604_800));
        assert_eq!(parse_age_secs("36500d"), Ok(36_500 * 86_400));
        for bad in [
            "7é",
            "30日",
            "é",
            "日",
            "",
            "d",
            "5",
            "-5d",
            "+5d",
            " 5d",
            "5 d",
            "5D",
            "1.5h",
            "٣d",
            "7dé",
            "36501d",
            "3153600001s",
            "99999999999999999999999d",
        ] {
            let e = parse_age_secs(bad).unwrap_err();
            assert!(
                e.contains(&format!("{bad:?}")) && e.contains("unit s, m, h or d"),
                "{bad:?}: {e}"
            );
        }
    }

    #[test]
    fn whole_numbers_take_digits_only() {
        assert_eq!(parse_whole_number::<u64>("0"), Ok(0));
        assert_eq!(
            parse_whole_number::<u64>("18446744073709551615"),
            Ok(u64::MAX)
        );
        for bad in ["", "-1", "+1", "1e3", "1_000", "1,000", " 1", "1.0", "١"] {
            let e = parse_whole_number::<u64>(bad).unwrap_err();
            assert!(e.contains("not a whole number"), "{bad:?}: {e}");
        }
        let e = parse_whole_number::<u32>("4294967296").unwrap_err();
        assert!(e.contains("far too large"), "{e}");
    }

    #[test]
    fn dead_letter_selections_are_bounded() {
        let parse = |args: &[&str]| {
            let mut full = vec!["pgoutbox", "dead-letters"];
            full.extend_from_slice(args);
            full.extend_from_slice(&["--database-url", "postgres://u@h/db"]);
            Cli::try_parse_from(full)
        };
        assert!(parse(&["list", "--limit", "1000000"]).is_ok());
        for limit in ["0", "-1", "1000001", "x"] {
            let e = parse(&["list", &format!("--limit={limit}")]).unwrap_err();
            assert_eq!(e.exit_code(), 2);
            assert!(e.to_string().contains("--limit"), "{e}");
        }
        for sub in ["requeue", "purge"] {
            assert!(parse(&[sub, "--id", "1"]).is_ok());
            for id in ["0", "-3"] {
                let e = parse(&[sub, &format!("--id={id}")]).unwrap_err();
                assert!(e.to_string().contains("--id"), "{sub} {id}: {e}");
            }
        }
        let e = parse(&["purge", "--older-than", "30日"]).unwrap_err();
        assert!(
            e.to_string()
                .contains("invalid value '30日' for '--older-than <OLDER_THAN>'"),
            "{e}"
        );
    }
}
