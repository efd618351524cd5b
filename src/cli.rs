//! Command-line interface (clap). Every option also reads a `PGOUTBOX_*` environment variable.

use std::time::Duration;

use clap::{Args, Parser, Subcommand};

use crate::config::{
    RunConfig, DEFAULT_EXCHANGE, DEFAULT_MAX_IN_FLIGHT, DEFAULT_MAX_IN_FLIGHT_BYTES,
    DEFAULT_PUBLICATION, DEFAULT_SHUTDOWN_TIMEOUT, DEFAULT_SLOT, DEFAULT_SLOT_BUSY_TIMEOUT,
};

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
}

/// Connection to Postgres and the slot's name.
#[derive(Debug, Args)]
pub struct DbArgs {
    /// PostgreSQL connection URL (postgres://user:password@host:port/db); a host that is
    /// a directory means a Unix socket.
    #[arg(long, env = "PGOUTBOX_DATABASE_URL")]
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
    #[arg(long, env = "PGOUTBOX_AMQP_URL")]
    pub amqp_url: String,
    /// Publication name.
    #[arg(long, env = "PGOUTBOX_PUBLICATION", default_value = DEFAULT_PUBLICATION)]
    pub publication: String,
    /// Durable topic exchange to publish to (declared if absent).
    #[arg(long, env = "PGOUTBOX_EXCHANGE", default_value = DEFAULT_EXCHANGE)]
    pub exchange: String,
    /// In-flight window: messages published and not yet confirmed.
    #[arg(long, env = "PGOUTBOX_MAX_IN_FLIGHT", default_value_t = DEFAULT_MAX_IN_FLIGHT)]
    pub max_in_flight: usize,
    /// In-flight window: payload bytes published and not yet confirmed.
    #[arg(long, env = "PGOUTBOX_MAX_IN_FLIGHT_BYTES", default_value_t = DEFAULT_MAX_IN_FLIGHT_BYTES)]
    pub max_in_flight_bytes: usize,
    /// Seconds to keep retrying a slot held by another process.
    #[arg(long, env = "PGOUTBOX_SLOT_BUSY_TIMEOUT_S", default_value_t = DEFAULT_SLOT_BUSY_TIMEOUT.as_secs())]
    pub slot_busy_timeout_s: u64,
    /// Seconds a SIGINT/SIGTERM waits for outstanding confirms.
    #[arg(long, env = "PGOUTBOX_SHUTDOWN_TIMEOUT_S", default_value_t = DEFAULT_SHUTDOWN_TIMEOUT.as_secs())]
    pub shutdown_timeout_s: u64,
    /// Instance id shown in application_name and the RabbitMQ connection name
    /// (default: hostname-pid).
    #[arg(long, env = "PGOUTBOX_INSTANCE_ID")]
    pub instance_id: Option<String>,
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
            slot_busy_timeout: Duration::from_secs(self.slot_busy_timeout_s),
            shutdown_timeout: Duration::from_secs(self.shutdown_timeout_s),
            instance_id,
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
