//! The command line (clap): the subcommands and their options. Every setting is a flag that
//! also reads a `PGOUTBOX_*` environment variable; `run` and `check` also read a
//! `--config` file ([`crate::config_file`]), whose keys are derived from these flags.
//!
//! The edge of the program: nothing in the library imports this module. `run`'s options,
//! grouped by concern, and the building of its validated settings are [`run`]; the
//! generated reference of every setting (flag, variable, file key, default, doc) is
//! [`reference`]; the book's Reference pages, the man pages and the completions written
//! from this tree are [`docs`]; each command's examples are [`examples`], and the exit
//! statuses [`exit_code`].

use std::path::PathBuf;

use clap::{Args, Parser, Subcommand};

use crate::config::{
    Retention, DEAD_LETTER_AGE_CAP, DEAD_LETTER_LIST_CAP, DEFAULT_PUBLICATION,
    DEFAULT_RETENTION_BATCH, DEFAULT_SLOT, RETENTION_BATCH_CAP,
};
use crate::secrets::{Secret, Sources, Target};

pub mod docs;
pub mod examples;
pub mod exit_code;
pub mod reference;
pub mod run;

pub use run::{RunArgs, NOT_FILE_KEYS};

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
    #[command(after_long_help = examples::SETUP)]
    Setup(SetupArgs),
    /// Stream outbox messages to RabbitMQ until SIGINT/SIGTERM.
    #[command(after_long_help = examples::RUN)]
    Run(RunArgs),
    /// Check what `run` needs (settings, both servers, slot, publication, exchange)
    /// without changing anything; exits 1 if `run` would stop, with the fix.
    #[command(after_long_help = examples::CHECK)]
    Check(CheckArgs),
    /// Declare the topology for consumers that scale out: Q quorum queues with single
    /// active consumer behind a consistent-hash exchange that hashes
    /// x-pgoutbox-aggregate-id, bound from the outbox exchange (idempotent; checks what
    /// exists and exits 1 naming what differs).
    #[command(after_long_help = examples::DECLARE_TOPOLOGY)]
    DeclareTopology(DeclareTopologyArgs),
    /// Show the slot's health (lag, retained WAL, waiting messages, dead letters); exit 0
    /// healthy, 1 warning, 2 critical.
    #[command(after_long_help = examples::STATUS)]
    Status(StatusArgs),
    /// List the outbox messages waiting in the slot without consuming them (only while no
    /// streamer holds it).
    #[command(after_long_help = examples::PEEK)]
    Peek(PeekArgs),
    /// Drop the slot and the publication.
    #[command(after_long_help = examples::TEARDOWN)]
    Teardown(TeardownArgs),
    /// Delete expired idempotency keys, journal rows and inbox records once (for cron);
    /// exit 0 when every step ran or was skipped, 1 when one failed, 2 for bad arguments.
    #[command(after_long_help = examples::MAINTENANCE)]
    Maintenance(MaintenanceArgs),
    /// Print the delivery journal's entries for a message id (`run --journal`), oldest
    /// first; exit 0 when there is at least one, 1 when none.
    #[command(after_long_help = examples::JOURNAL)]
    Journal(JournalArgs),
    /// Inspect, requeue or purge messages in outbox.dead_letter.
    #[command(subcommand)]
    DeadLetters(DeadLetterCommand),
    /// Print a shell completion script to stdout (bash, zsh, fish, elvish, powershell).
    #[command(after_long_help = examples::COMPLETIONS)]
    Completions(CompletionsArgs),
    /// Write the documentation generated from this binary: the book's reference pages or
    /// the man pages.
    #[command(subcommand)]
    Docs(DocsCommand),
}

/// `completions` arguments.
#[derive(Debug, Args)]
pub struct CompletionsArgs {
    /// The shell to complete for.
    #[arg(value_enum)]
    pub shell: clap_complete::Shell,
}

/// `docs` subcommands.
#[derive(Debug, Subcommand)]
pub enum DocsCommand {
    /// Write the book's generated reference pages (cli.md, environment.md, config-file.md,
    /// metrics.md, exit-codes.md, dead-letter-reasons.md) into a directory.
    #[command(after_long_help = examples::DOCS_REFERENCE)]
    Reference(DocsOutArgs),
    /// Write one man page per command (pgoutbox.1, pgoutbox-run.1, ...) into a directory.
    #[command(after_long_help = examples::DOCS_MAN)]
    Man(DocsOutArgs),
}

/// Where `docs reference` and `docs man` write.
#[derive(Debug, Args)]
pub struct DocsOutArgs {
    /// The directory to write into (created if missing; files of the same name are
    /// replaced).
    #[arg(long)]
    pub out: PathBuf,
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

pub(crate) fn parse_idempotency_retention(text: &str) -> Result<Retention, String> {
    retention_arg("--idempotency-retention", text)
}

pub(crate) fn parse_journal_retention(text: &str) -> Result<Retention, String> {
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

/// `dead-letters` subcommands.
#[derive(Debug, Subcommand)]
pub enum DeadLetterCommand {
    /// List dead letters (not yet requeued, unless --all), oldest first.
    #[command(after_long_help = examples::DEAD_LETTERS_LIST)]
    List(DeadLetterListArgs),
    /// Re-emit dead letters through the normal path, with their original message_id.
    #[command(after_long_help = examples::DEAD_LETTERS_REQUEUE)]
    Requeue(DeadLetterSelectArgs),
    /// Delete dead letters.
    #[command(after_long_help = examples::DEAD_LETTERS_PURGE)]
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
    pub fn resolve(&self) -> Result<crate::config::PgUrl, crate::config::ValidationError> {
        crate::secrets::resolve(
            Target::Postgres,
            &Sources {
                url: self.database_url.clone(),
                url_file: self.database_url_file.clone(),
                password_file: self.database_password_file.clone(),
            },
        )
        .map(crate::config::PgUrl::new)
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
    /// Rows dead-lettered longer ago than this: a duration such as 7d, 1w, 36h or 1h 30m
    /// (as for the retention flags), at most 36500d.
    #[arg(long, value_parser = parse_age_secs)]
    pub older_than: Option<i64>,
    /// Every row.
    #[arg(long)]
    pub all: bool,
}

/// Parses a `dead-letters purge --older-than` age into whole seconds, at most
/// [`DEAD_LETTER_AGE_CAP`]: humantime's syntax (`30s`, `36h`, `7d`, `1w`, `1h 30m`), the
/// same as the retention flags ([`Retention::parse`]).
///
/// # Errors
/// A message naming the value's fault and the fix (clap adds the flag and the value).
pub fn parse_age_secs(text: &str) -> Result<i64, String> {
    let fix = format!(
        "write a duration such as 7d, 1w or 36h (humantime's syntax, as for --idempotency-retention), at most {}d",
        DEAD_LETTER_AGE_CAP.as_secs() / 86_400
    );
    let age = humantime::parse_duration(text.trim()).map_err(|e| format!("{e}; {fix}"))?;
    if age.subsec_nanos() != 0 {
        return Err(format!("not whole seconds; {fix}"));
    }
    if age > DEAD_LETTER_AGE_CAP {
        return Err(format!("too long; {fix}"));
    }
    i64::try_from(age.as_secs()).map_err(|_| format!("too long; {fix}"))
}

/// Parses a whole number (ASCII digits only) for a numeric option outside `run`'s settings
/// (`run`'s own go through [`crate::config::numeric`], whose parsers name the range too).
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
    /// Make the slot a failover slot (PostgreSQL 17+): physical standbys with
    /// sync_replication_slots = on keep a synced copy that survives a promotion. Default: on
    /// where the server supports it (17+; an existing ordinary slot is altered while no
    /// streamer holds it), an ordinary slot on older servers. --failover (=true) requires it
    /// and is refused, with the alternative, on older servers; --failover=false keeps an
    /// ordinary slot.
    #[arg(
        long,
        env = "PGOUTBOX_FAILOVER",
        num_args = 0..=1,
        require_equals = true,
        default_missing_value = "true",
        value_parser = clap::builder::BoolishValueParser::new()
    )]
    pub failover: Option<bool>,
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

/// Default `--warn-lag-bytes`: 1 GiB of WAL behind the current position.
pub const DEFAULT_WARN_LAG_BYTES: u64 = 1 << 30;

/// Default `--crit-lag-bytes`: 8 GiB, a day of a busy outbox, and well inside the disk of a
/// server that keeps WAL for a stopped streamer.
pub const DEFAULT_CRIT_LAG_BYTES: u64 = 8 << 30;

/// `check` arguments: `run`'s, and a standby to inspect for failover.
#[derive(Debug, Args)]
pub struct CheckArgs {
    /// The settings `run` would use.
    #[command(flatten)]
    pub run: RunArgs,
    /// A physical standby to inspect.
    #[command(flatten)]
    pub standby: StandbyUrlArgs,
}

/// `--standby-url` of `check` and `status`.
#[derive(Debug, Args)]
#[command(next_help_heading = "Failover")]
pub struct StandbyUrlArgs {
    /// A physical standby of the primary that may be promoted (PostgreSQL 17+): checks
    /// what slot synchronization needs there (sync_replication_slots, hot_standby_feedback,
    /// primary_slot_name, a dbname in primary_conninfo) and that the slot is synchronized,
    /// persistent and not invalidated; each missing one with the line that fixes it.
    #[arg(long, env = "PGOUTBOX_STANDBY_URL", hide_env_values = true)]
    pub standby_url: Option<Secret>,
}

impl StandbyUrlArgs {
    /// The standby's connection settings, when given.
    ///
    /// # Errors
    /// [`crate::config::ValidationError`] when the URL does not parse.
    pub fn config(
        &self,
    ) -> Result<Option<crate::config::DatabaseConfig>, crate::config::ValidationError> {
        self.standby_url
            .as_ref()
            .map(|url| {
                crate::config::parse_database_url(&crate::config::PgUrl::new(url.0.as_str()))
                    .map_err(|mut e| {
                        e.setting = "--standby-url";
                        e
                    })
            })
            .transpose()
    }
}

/// `declare-topology` arguments.
#[derive(Debug, Args)]
pub struct DeclareTopologyArgs {
    /// RabbitMQ URL: amqp://user:password@host:port/vhost, or amqps:// (TLS settings in the
    /// URL's query, as for run). The user needs configure permission on the objects. Of a
    /// comma-separated list (a cluster), the first node is used: exchanges and queues are
    /// the cluster's. A password here is visible in the process list: prefer the variable
    /// or a file.
    #[arg(long, env = "PGOUTBOX_AMQP_URL", hide_env_values = true)]
    pub amqp_url: Option<Secret>,
    /// A file holding the RabbitMQ URL (a container secret); a trailing newline is dropped.
    /// Instead of --amqp-url.
    #[arg(long, env = "PGOUTBOX_AMQP_URL_FILE")]
    pub amqp_url_file: Option<PathBuf>,
    /// A file holding the RabbitMQ password alone, put into the URL (which must then have
    /// a user and no password).
    #[arg(long, env = "PGOUTBOX_AMQP_PASSWORD_FILE")]
    pub amqp_password_file: Option<PathBuf>,
    /// The outbox exchange `run` publishes to (declared as a durable topic exchange if
    /// absent, as run does).
    #[arg(long, env = "PGOUTBOX_EXCHANGE", default_value = crate::config::DEFAULT_EXCHANGE)]
    pub exchange: String,
    /// The consistent-hash exchange (type x-consistent-hash, plugin
    /// rabbitmq_consistent_hash_exchange). Default: EXCHANGE.hash.
    #[arg(long, env = "PGOUTBOX_HASH_EXCHANGE")]
    pub hash_exchange: Option<String>,
    /// The queues' name prefix: queue i is PREFIX.i. Default: EXCHANGE.q.
    #[arg(long, env = "PGOUTBOX_QUEUE_PREFIX")]
    pub queue_prefix: Option<String>,
    /// How many queues, Q (1 to 1024): one active consumer each. Changing it moves keys
    /// between queues: drain them first.
    #[arg(long, env = "PGOUTBOX_QUEUES", default_value_t = crate::topology::DEFAULT_QUEUES, value_parser = parse_whole_number::<u16>)]
    pub queues: u16,
    /// Change nothing: report what is missing or differs, exit 1 if anything is.
    #[arg(long)]
    pub check: bool,
}

impl DeclareTopologyArgs {
    /// The broker URL, put together from its sources (the first node of a list).
    ///
    /// # Errors
    /// [`crate::config::ValidationError`] from [`crate::secrets::resolve`].
    pub fn url(&self) -> Result<crate::config::BrokerUrl, crate::config::ValidationError> {
        let url = crate::secrets::resolve(
            Target::Amqp,
            &Sources {
                url: self.amqp_url.clone(),
                url_file: self.amqp_url_file.clone(),
                password_file: None,
            },
        )?;
        let first = crate::config::split_amqp_urls(&[url])
            .into_iter()
            .next()
            .unwrap_or_default();
        crate::secrets::resolve(
            Target::Amqp,
            &Sources {
                url: Some(Secret(first)),
                url_file: None,
                password_file: self.amqp_password_file.clone(),
            },
        )
        .map(crate::config::BrokerUrl::new)
    }

    /// The validated topology.
    ///
    /// # Errors
    /// [`crate::config::ValidationError`] naming the setting.
    pub fn topology(&self) -> Result<crate::topology::Topology, crate::config::ValidationError> {
        crate::topology::Topology::new(
            &self.exchange,
            self.hash_exchange.as_deref(),
            self.queue_prefix.as_deref(),
            self.queues,
        )
    }
}

/// `status` arguments.
#[derive(Debug, Args)]
pub struct StatusArgs {
    /// Database and slot.
    #[command(flatten)]
    pub db: DbArgs,
    /// A standby to inspect for failover.
    #[command(flatten)]
    pub standby: StandbyUrlArgs,
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
    /// Show the payloads too (they may hold personal data): a UTF-8 payload as its text,
    /// any other as base64, marked `payload (base64, not UTF-8):` (in --json,
    /// `payload_encoding` is `utf-8` or `base64`).
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
    fn ages_take_humantime_durations_as_the_retention_flags_do() {
        for (text, secs) in [
            ("1w", 604_800),
            ("36h", 129_600),
            ("90d", 90 * 86_400),
            ("0s", 0),
            ("0", 0),
            ("90s", 90),
            ("15m", 900),
            ("12h", 43_200),
            ("7d", 604_800),
            ("1h 30m", 5_400),
            ("1.5h", 5_400),
            ("36500d", 36_500 * 86_400),
        ] {
            assert_eq!(parse_age_secs(text), Ok(secs), "{text:?}");
            assert_eq!(
                Retention::parse("--idempotency-retention", text)
                    .map(|r| r.age().map_or(0, |a| a.as_secs())),
                Ok(secs as u64),
                "{text:?} differs from the retention flags"
            );
        }
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
            "٣d",
            "7dé",
            "36501d",
            "3153600001s",
            "99999999999999999999999d",
            "1500ms",
        ] {
            let e = parse_age_secs(bad).unwrap_err();
            assert!(
                e.contains("write a duration such as 7d, 1w or 36h")
                    && e.contains("at most 36500d"),
                "{bad:?}: {e}"
            );
        }
        assert!(parse_age_secs("1500ms")
            .unwrap_err()
            .contains("whole seconds"));
        assert!(parse_age_secs("36501d").unwrap_err().contains("too long"));
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
    fn every_numeric_run_option_takes_digits_only() {
        let numeric: Vec<String> = reference::run_settings()
            .into_iter()
            .filter(|s| s.value == reference::ValueForm::Number)
            .map(|s| s.flag)
            .collect();
        assert!(
            numeric.iter().any(|f| f == "--stall-after-s"),
            "{numeric:?}"
        );
        for flag in &numeric {
            let e = Cli::try_parse_from(["pgoutbox", "run", flag, "+5"]).unwrap_err();
            assert!(
                e.to_string().contains("not a whole number"),
                "{flag} +5 must be refused by the digits-only parser: {e}"
            );
        }
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
