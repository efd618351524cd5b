//! Command-line interface (clap). Every option also reads a `PGOUTBOX_*` environment variable.

use std::time::Duration;

use clap::{Args, Parser, Subcommand};

use crate::config::{
    RunConfig, UnroutablePolicy, DEFAULT_EXCHANGE, DEFAULT_MAX_ATTEMPTS, DEFAULT_MAX_IN_FLIGHT,
    DEFAULT_MAX_IN_FLIGHT_BYTES, DEFAULT_MAX_MESSAGE_BYTES, DEFAULT_PUBLICATION,
    DEFAULT_READ_COALESCE, DEFAULT_SHUTDOWN_TIMEOUT, DEFAULT_SLOT, DEFAULT_SLOT_BUSY_TIMEOUT,
    DEFAULT_STALL_AFTER,
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
    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

/// The subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Install sql/outbox.sql, create the publication and the pgoutput slot (idempotent).
    Setup(SetupArgs),
    /// Stream outbox messages to RabbitMQ until SIGINT/SIGTERM.
    Run(RunArgs),
    /// Show the slot: active, confirmed_flush_lsn, lag in bytes.
    Status(StatusArgs),
    /// Drop the slot and the publication.
    Teardown(TeardownArgs),
    /// Inspect, requeue or purge messages in outbox.dead_letter.
    #[command(subcommand)]
    DeadLetters(DeadLetterCommand),
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
    /// PostgreSQL connection URL.
    #[arg(long, env = "PGOUTBOX_DATABASE_URL", hide_env_values = true)]
    pub database_url: String,
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
    /// At most this many rows.
    #[arg(long, default_value_t = 100)]
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
    /// Row id (repeatable).
    #[arg(long)]
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
    #[arg(long)]
    pub id: Vec<i64>,
    /// Rows dead-lettered longer ago than this: a number with unit s, m, h or d (e.g. 7d).
    #[arg(long, value_parser = parse_age_secs)]
    pub older_than: Option<i64>,
    /// Every row.
    #[arg(long)]
    pub all: bool,
}

/// Parses `30s`, `15m`, `12h`, `7d` into seconds.
///
/// # Errors
/// A message naming the value and the accepted form.
pub fn parse_age_secs(text: &str) -> Result<i64, String> {
    let bad = || format!("invalid age {text:?}: write a number with unit s, m, h or d, e.g. 7d");
    let (num, unit) = text.split_at(text.len().saturating_sub(1));
    let n: i64 = num.parse().map_err(|_| bad())?;
    let mult = match unit {
        "s" => 1,
        "m" => 60,
        "h" => 3600,
        "d" => 86_400,
        _ => return Err(bad()),
    };
    n.checked_mul(mult).filter(|v| *v >= 0).ok_or_else(bad)
}

/// What `run` does with a message the broker returns as unroutable.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum OnUnroutable {
    /// Write it to outbox.dead_letter and go on.
    DeadLetter,
    /// Retry it forever (with backoff), holding everything after it, and log loudly.
    Block,
}

/// Connection to Postgres and the slot's name.
#[derive(Debug, Args)]
pub struct DbArgs {
    /// PostgreSQL connection URL (postgres://user:password@host:port/db); a host that is
    /// a directory means a Unix socket.
    #[arg(long, env = "PGOUTBOX_DATABASE_URL", hide_env_values = true)]
    pub database_url: String,
    /// Logical replication slot name.
    #[arg(long, env = "PGOUTBOX_SLOT", default_value = DEFAULT_SLOT)]
    pub slot: String,
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
}

/// `run` arguments.
#[derive(Debug, Args)]
pub struct RunArgs {
    /// Database and slot.
    #[command(flatten)]
    pub db: DbArgs,
    /// RabbitMQ URL (amqp://user:password@host:port/vhost).
    #[arg(long, env = "PGOUTBOX_AMQP_URL", hide_env_values = true)]
    pub amqp_url: String,
    /// Publication name.
    #[arg(long, env = "PGOUTBOX_PUBLICATION", default_value = DEFAULT_PUBLICATION)]
    pub publication: String,
    /// Durable topic exchange to publish to (declared if absent).
    #[arg(long, env = "PGOUTBOX_EXCHANGE", default_value = DEFAULT_EXCHANGE)]
    pub exchange: String,
    /// Window: outbox messages read and not yet acknowledged to Postgres (unconfirmed, or
    /// confirmed behind an earlier unconfirmed one). A transaction is acknowledged whole, so
    /// one larger than the window is still read to its end.
    #[arg(long, env = "PGOUTBOX_MAX_IN_FLIGHT", default_value_t = DEFAULT_MAX_IN_FLIGHT)]
    pub max_in_flight: usize,
    /// Window: bytes (logical message content) read and not yet acknowledged to Postgres.
    #[arg(long, env = "PGOUTBOX_MAX_IN_FLIGHT_BYTES", default_value_t = DEFAULT_MAX_IN_FLIGHT_BYTES)]
    pub max_in_flight_bytes: usize,
    /// Seconds to keep retrying a slot held by another process before exiting; 0 waits
    /// forever as a standby.
    #[arg(long, env = "PGOUTBOX_SLOT_BUSY_TIMEOUT_S", default_value_t = DEFAULT_SLOT_BUSY_TIMEOUT.as_secs())]
    pub slot_busy_timeout_s: u64,
    /// Seconds a SIGINT/SIGTERM waits for outstanding confirms.
    #[arg(long, env = "PGOUTBOX_SHUTDOWN_TIMEOUT_S", default_value_t = DEFAULT_SHUTDOWN_TIMEOUT.as_secs())]
    pub shutdown_timeout_s: u64,
    /// Instance id shown in application_name and the RabbitMQ connection name
    /// (default: hostname-pid).
    #[arg(long, env = "PGOUTBOX_INSTANCE_ID")]
    pub instance_id: Option<String>,
    /// What to do with a message returned as unroutable (no queue bound for its key).
    #[arg(long, env = "PGOUTBOX_ON_UNROUTABLE", value_enum, default_value_t = OnUnroutable::DeadLetter)]
    pub on_unroutable: OnUnroutable,
    /// Publish attempts for a nacked message before it is dead-lettered.
    #[arg(long, env = "PGOUTBOX_MAX_ATTEMPTS", default_value_t = DEFAULT_MAX_ATTEMPTS)]
    pub max_attempts: u32,
    /// Fault injection for tests (e.g. abort-after-confirms=100); never use in production.
    #[arg(long, env = "PGOUTBOX_FAILPOINT", hide = true)]
    pub failpoint: Option<crate::config::Failpoint>,
    /// Payloads larger than this many bytes are dead-lettered as too_large, never published.
    #[arg(long, env = "PGOUTBOX_MAX_MESSAGE_BYTES", default_value_t = DEFAULT_MAX_MESSAGE_BYTES)]
    pub max_message_bytes: usize,
    /// Microseconds between two small reads of the replication stream: under a steady
    /// trickle of transactions, one read (and one publish batch) per interval instead of
    /// one per transaction. Adds at most this much latency; 0 reads every transaction at once.
    #[arg(long, env = "PGOUTBOX_READ_COALESCE_US", default_value_t = DEFAULT_READ_COALESCE.as_micros() as u64)]
    pub read_coalesce_us: u64,
    /// The broker's max_message_size in bytes, if known: payloads larger than this are
    /// dead-lettered as too_large without publishing. Unset: pgoutbox learns the limit the
    /// first time RabbitMQ refuses a message for its size (406, channel closed).
    #[arg(long, env = "PGOUTBOX_BROKER_MAX_MESSAGE_BYTES")]
    pub broker_max_message_bytes: Option<usize>,
    /// Where to serve /metrics, /healthz and /readyz: HOST:PORT, or off.
    #[arg(long, env = "PGOUTBOX_HTTP_ADDR", default_value = DEFAULT_HTTP_ADDR, value_parser = parse_http_addr_arg)]
    pub http_addr: HttpAddr,
    /// Seconds without any settle, while messages are unconfirmed, after which the stream
    /// counts as stalled (/readyz 503 "stalled", a warning once a minute); 1 to 3600.
    #[arg(long, env = "PGOUTBOX_STALL_AFTER_S", default_value_t = DEFAULT_STALL_AFTER.as_secs())]
    pub stall_after_s: u64,
}

/// A parsed `--http-addr` (`None`: off).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HttpAddr(pub Option<std::net::SocketAddr>);

fn parse_http_addr_arg(text: &str) -> Result<HttpAddr, String> {
    crate::config::parse_http_addr(text)
        .map(HttpAddr)
        .map_err(|e| e.to_string())
}

impl RunArgs {
    /// Builds the typed run settings (validated later by `RunConfig::validate`).
    pub fn into_config(self) -> RunConfig {
        let instance_id = self.instance_id.unwrap_or_else(|| {
            let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
                .map(|h| h.trim().to_owned())
                .unwrap_or_else(|_| "host".into());
            format!("{host}-{}", std::process::id())
        });
        RunConfig {
            database_url: self.db.database_url,
            amqp_url: self.amqp_url,
            slot: self.db.slot,
            publication: self.publication,
            exchange: self.exchange,
            max_in_flight: self.max_in_flight,
            max_in_flight_bytes: self.max_in_flight_bytes,
            slot_busy_timeout: (self.slot_busy_timeout_s > 0)
                .then(|| Duration::from_secs(self.slot_busy_timeout_s)),
            on_unroutable: match self.on_unroutable {
                OnUnroutable::DeadLetter => UnroutablePolicy::DeadLetter,
                OnUnroutable::Block => UnroutablePolicy::Block,
            },
            max_attempts: self.max_attempts,
            max_message_bytes: self.max_message_bytes,
            broker_max_message_bytes: self.broker_max_message_bytes,
            failpoint: self.failpoint,
            shutdown_timeout: Duration::from_secs(self.shutdown_timeout_s),
            read_coalesce: Duration::from_micros(self.read_coalesce_us),
            instance_id,
            http_addr: self.http_addr.0,
            stall_after: Duration::from_secs(self.stall_after_s),
        }
    }
}

/// `status` arguments.
#[derive(Debug, Args)]
pub struct StatusArgs {
    /// Database and slot.
    #[command(flatten)]
    pub db: DbArgs,
    /// Print one JSON object instead of text.
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
