//! Example consumer: applies account credits to a table exactly once, with `pgoutbox::inbox`.
//!
//! Each message is a JSON object `{"account": "a-1", "amount": 5}` (what a producer emits
//! with `outbox.emit('account.credited', jsonb_build_object('account', ..., 'amount', ...))`).
//! The handler adds the amount to `account_balance` and appends a row to `account_ledger`, in
//! the inbox's transaction: the claim of the message id and both writes commit together, and
//! the delivery is acked after the commit. The ledger has no unique key on purpose: a message
//! applied twice would show up there as two rows.
//!
//! ```text
//! cargo run --example inbox_consumer -- \
//!     --database-url postgres://app@localhost/app --amqp-url amqp://localhost:5672 \
//!     --queue billing [--queue billing-2 ...] [--consumer billing] [--prefetch 32] [--max-deliveries 5] [--work-ms 0]
//! ```
//!
//! On start it installs `sql/inbox.sql` and its two tables if missing (under an advisory lock,
//! so several consumers can start at once). It runs until SIGTERM or ^C, finishing the
//! delivery in hand. `--work-ms` adds a pause inside each transaction, to simulate slow work
//! (the crash tests use it). Set `RUST_LOG=pgoutbox::inbox=debug` to log every delivery.
//!
//! Exit status: 0 after a signal, 1 on a failure (the message says what failed), 2 on a
//! usage error (clap's).

use std::process::ExitCode;
use std::time::Duration;

use clap::Parser;
use lapin::{Connection, ConnectionProperties};
use pgoutbox::inbox::{Handler, HandlerError, Inbox, InboxConfig, InboxMessage, INBOX_SQL};
use tokio_postgres::{NoTls, Transaction};

/// The example's own tables.
const TABLES_SQL: &str = "
CREATE TABLE IF NOT EXISTS account_balance (
    account text PRIMARY KEY,
    balance bigint NOT NULL
);
CREATE TABLE IF NOT EXISTS account_ledger (
    message_id text NOT NULL,
    account    text NOT NULL,
    amount     bigint NOT NULL,
    applied_at timestamptz NOT NULL DEFAULT now()
);";

#[derive(Debug, Parser)]
#[command(about = "Applies account credits from a RabbitMQ queue to PostgreSQL exactly once")]
struct Args {
    /// PostgreSQL URL of the consumer's database (plain TCP or a Unix socket; no TLS here).
    #[arg(long, env = "INBOX_DATABASE_URL")]
    database_url: String,
    /// RabbitMQ URL (amqp:// only).
    #[arg(long, env = "INBOX_AMQP_URL")]
    amqp_url: String,
    /// The queue to consume; it must exist, with a dead-letter exchange. Repeat it (or
    /// separate names with commas) to consume several, e.g. the quorum queues of `pgoutbox
    /// declare-topology`: each has a single active consumer, so a second process started
    /// with the same queues stands by and takes over a queue when the first goes away.
    #[arg(long, env = "INBOX_QUEUE", required = true, value_delimiter = ',')]
    queue: Vec<String>,
    /// The inbox's consumer name.
    #[arg(long, default_value = "inbox-example")]
    consumer: String,
    /// Prefetch, in messages.
    #[arg(long, default_value_t = pgoutbox::inbox::DEFAULT_PREFETCH)]
    prefetch: u16,
    /// Attempts before a failing message is rejected to the dead-letter exchange.
    #[arg(long, default_value_t = pgoutbox::inbox::DEFAULT_MAX_DELIVERIES)]
    max_deliveries: u32,
    /// Simulated work per message, in milliseconds, inside the transaction.
    #[arg(long, default_value_t = 0)]
    work_ms: u64,
}

/// The handler: one credit per message.
#[derive(Debug)]
struct Credit {
    work: Duration,
}

#[derive(Debug, serde::Deserialize)]
struct CreditEvent {
    account: String,
    amount: i64,
}

impl Handler for Credit {
    async fn handle(
        &self,
        tx: &Transaction<'_>,
        message: &InboxMessage,
    ) -> Result<(), HandlerError> {
        let event: CreditEvent = serde_json::from_slice(&message.body)?;
        tx.execute(
            "INSERT INTO account_balance (account, balance) VALUES ($1, $2)
             ON CONFLICT (account) DO UPDATE SET balance = account_balance.balance + excluded.balance",
            &[&event.account, &event.amount],
        )
        .await?;
        tx.execute(
            "INSERT INTO account_ledger (message_id, account, amount) VALUES ($1, $2, $3)",
            &[&message.message_id, &event.account, &event.amount],
        )
        .await?;
        if !self.work.is_zero() {
            tokio::time::sleep(self.work).await;
        }
        Ok(())
    }
}

fn main() -> ExitCode {
    let args = Args::parse();
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_ansi(false)
        .init();
    let runtime = match tokio::runtime::Runtime::new() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("inbox_consumer: cannot start the tokio runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(consume(args)) {
        Ok(stats) => {
            println!(
                "inbox_consumer: stopped; applied {}, duplicates {}, requeued {}, rejected {}",
                stats.applied, stats.duplicates, stats.requeued, stats.rejected
            );
            ExitCode::SUCCESS
        }
        Err(e) => {
            let mut report = format!("inbox_consumer: {e}");
            let mut source = std::error::Error::source(&*e);
            while let Some(cause) = source {
                report.push_str(&format!(": {cause}"));
                source = cause.source();
            }
            eprintln!("{report}");
            ExitCode::FAILURE
        }
    }
}

async fn consume(args: Args) -> Result<pgoutbox::inbox::InboxStats, HandlerError> {
    let (mut client, connection) = tokio_postgres::connect(&args.database_url, NoTls).await?;
    tokio::spawn(async move {
        if let Err(e) = connection.await {
            tracing::error!(error = %e, "postgres connection ended");
        }
    });
    // Install the inbox and our tables once, even with several consumers starting together.
    let tx = client.transaction().await?;
    tx.batch_execute("SELECT pg_advisory_xact_lock(hashtext('pgoutbox inbox_consumer setup'))")
        .await?;
    tx.batch_execute(INBOX_SQL).await?;
    tx.batch_execute(TABLES_SQL).await?;
    tx.commit().await?;

    let amqp = Connection::connect(&args.amqp_url, ConnectionProperties::default()).await?;
    let channel = amqp.create_channel().await?;
    let mut config = InboxConfig::with_queues(args.consumer, args.queue);
    config.prefetch = args.prefetch;
    config.max_deliveries = args.max_deliveries;
    let handler = Credit {
        work: Duration::from_millis(args.work_ms),
    };
    let inbox = Inbox::new(config, client, channel, handler)?;
    let stats = inbox.run(shutdown_signal()).await?;
    let _ = amqp.close(200, "bye".into()).await;
    Ok(stats)
}

/// Completes on SIGTERM or SIGINT.
async fn shutdown_signal() {
    let mut term = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
        Ok(s) => s,
        Err(_) => {
            let _ = tokio::signal::ctrl_c().await;
            return;
        }
    };
    tokio::select! {
        _ = term.recv() => {}
        _ = tokio::signal::ctrl_c() => {}
    }
}
