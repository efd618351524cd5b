//! The delivery journal writer (`run --journal`): one `outbox.journal` row per message the
//! broker confirmed as routed, written in batches by a task with its own SQL session.
//!
//! ```text
//!  Core::apply_outcomes ──Routed──▶ JournalHandle::record ──try_send──▶ bounded buffer
//!                                        (never waits)                       │
//!                       every status-update interval (or when the buffer is  ▼
//!                       a quarter full): ONE INSERT ... SELECT FROM unnest(...) ──▶ outbox.journal
//! ```
//!
//! The journal is an audit record, not part of delivery: the loop hands an entry over with
//! `try_send` after the message was settled, and never waits for the journal. So it never
//! holds back acknowledgement, and what it has not written yet is lost when the process
//! dies (at most about one interval). When the buffer ([`BUFFER_ROWS`]) is full or a write
//! fails, the rows are dropped, logged (at most once per [`WARN_EVERY`]) and counted in
//! `pgoutbox_journal_rows_dropped_total`; the write is never retried, so a locked or
//! missing table costs nothing but the rows. A clean shutdown writes what is buffered,
//! bounded by [`CLOSE_TIMEOUT`].
//!
//! The session sets `synchronous_commit = off` (a lost last interval is already allowed,
//! and the commit can never wait for a synchronous standby, which could be this very
//! streamer's walsender), `lock_timeout` and `statement_timeout`.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{mpsc, watch, Notify};
use tokio::task::JoinHandle;
use tokio::time::Instant;

use super::in_flight::InFlight;
use crate::admin::journal::{write_journal, JournalEntry};
use crate::config::{DatabaseConfig, JournalMode};
use crate::envelope;
use crate::metrics::Telemetry;

/// Rows the buffer holds between two writes; more confirms than this in one interval are
/// dropped. 65,536 rows is over 6 s at the broker's ceiling on our machines (~20k msg/s
/// persistent, 10 s at the most common rates), and about 10 MB at most.
pub const BUFFER_ROWS: usize = 65_536;
/// A write starts early once this many rows wait (a quarter of the buffer), so a burst
/// does not fill the buffer before the interval ends.
pub const EARLY_WRITE_ROWS: usize = BUFFER_ROWS / 4;
/// How long the final write of a clean shutdown may take.
pub const CLOSE_TIMEOUT: Duration = Duration::from_secs(5);
/// Lock and statement timeouts of the journal's session.
const LOCK_TIMEOUT: Duration = Duration::from_secs(2);
const STATEMENT_TIMEOUT: Duration = Duration::from_secs(10);
/// At most one warning about dropped rows per this long.
const WARN_EVERY: Duration = Duration::from_secs(60);

/// The loop's end: records confirmed deliveries (a no-op when the journal is off).
/// Cheap to clone.
#[derive(Debug, Clone)]
pub(super) struct JournalHandle {
    inner: Option<Arc<Shared>>,
}

#[derive(Debug)]
struct Shared {
    entries: mpsc::Sender<JournalEntry>,
    /// Wakes the task for an early write.
    early: Notify,
    /// The current session's status-update interval.
    interval: watch::Sender<Duration>,
    telemetry: Arc<Telemetry>,
    /// `--exchange`: where a message that names no exchange goes.
    default_exchange: String,
    /// Last warning about a full buffer.
    warned_at: std::sync::Mutex<Option<Instant>>,
}

/// The driver's end: the task, closed (with a final write) when `run` ends.
#[derive(Debug)]
pub(super) struct JournalWriter {
    handle: JournalHandle,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    task: Option<JoinHandle<()>>,
}

impl JournalWriter {
    /// Starts the writer task when `mode` is on (it connects on its first write, and again
    /// after a failure); `interval` is the first write interval, until a session sets its
    /// own ([`JournalHandle::set_interval`]).
    pub fn start(
        mode: JournalMode,
        pg: &DatabaseConfig,
        schema: &crate::outbox_schema::SchemaName,
        slot: &str,
        default_exchange: &str,
        interval: Duration,
        telemetry: &Arc<Telemetry>,
    ) -> JournalWriter {
        if mode == JournalMode::Off {
            return JournalWriter {
                handle: JournalHandle { inner: None },
                stop: None,
                task: None,
            };
        }
        let (tx, rx) = mpsc::channel(BUFFER_ROWS);
        let (interval_tx, interval_rx) = watch::channel(interval);
        let shared = Arc::new(Shared {
            entries: tx,
            early: Notify::new(),
            interval: interval_tx,
            telemetry: Arc::clone(telemetry),
            default_exchange: default_exchange.to_owned(),
            warned_at: std::sync::Mutex::new(None),
        });
        let (stop, stopped) = tokio::sync::oneshot::channel();
        let task = tokio::spawn(write_task(
            pg.clone(),
            schema.clone(),
            slot.to_owned(),
            rx,
            Arc::clone(&shared),
            interval_rx,
            stopped,
        ));
        tracing::info!(
            buffer_rows = BUFFER_ROWS,
            "delivery journal on (--journal): confirmed messages are recorded in outbox.journal once per status-update interval"
        );
        JournalWriter {
            handle: JournalHandle {
                inner: Some(shared),
            },
            stop: Some(stop),
            task: Some(task),
        }
    }

    /// The loop's handle.
    pub fn handle(&self) -> JournalHandle {
        self.handle.clone()
    }

    /// Writes what is buffered (bounded by [`CLOSE_TIMEOUT`]) and stops the task.
    pub async fn close(mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(mut task) = self.task.take() {
            if tokio::time::timeout(CLOSE_TIMEOUT, &mut task)
                .await
                .is_err()
            {
                task.abort();
                tracing::warn!(
                    timeout_s = CLOSE_TIMEOUT.as_secs(),
                    "the journal's final write did not finish in time; its rows are lost (the messages were delivered)"
                );
            }
        }
    }
}

impl JournalHandle {
    /// Sets the write interval (each session's status-update interval).
    pub fn set_interval(&self, interval: Duration) {
        if let Some(s) = &self.inner {
            s.interval.send_replace(interval);
        }
    }

    /// Records `m`, confirmed as routed at `confirmed_at_us` (µs since the Unix epoch).
    /// Never waits: a full buffer drops the row (counted, and logged once a minute).
    pub fn record(&self, m: &InFlight, confirmed_at_us: i64) {
        let Some(s) = &self.inner else {
            return;
        };
        // The envelope was decoded when it was published; the journal decodes it again
        // rather than keep its id and topic for every message in flight (the cost is
        // measured in the benchmark, and paid only with --journal).
        let (message_id, topic, exchange) = match envelope::decode(m.content.clone()) {
            Ok(env) => (
                env.message_id,
                env.topic,
                env.exchange.unwrap_or_else(|| s.default_exchange.clone()),
            ),
            Err(_) => return,
        };
        let entry = JournalEntry {
            message_id,
            topic,
            exchange,
            lsn: m.lsn,
            commit_lsn: m.commit_lsn,
            attempts: m.attempts,
            confirmed_at_us,
        };
        match s.entries.try_send(entry) {
            Ok(()) => {
                if s.entries.capacity() == BUFFER_ROWS - EARLY_WRITE_ROWS {
                    s.early.notify_one();
                }
            }
            Err(mpsc::error::TrySendError::Full(entry)) => {
                s.telemetry.journal_dropped("buffer_full", 1);
                let now = Instant::now();
                let mut warned = s.warned_at.lock().unwrap_or_else(|e| e.into_inner());
                if warned.is_none_or(|at| now.duration_since(at) >= WARN_EVERY) {
                    *warned = Some(now);
                    tracing::warn!(
                        message_id = %entry.message_id,
                        buffer_rows = BUFFER_ROWS,
                        "delivery journal buffer full: rows are dropped (counted in pgoutbox_journal_rows_dropped_total); the messages themselves were delivered"
                    );
                }
            }
            Err(mpsc::error::TrySendError::Closed(_)) => {
                s.telemetry.journal_dropped("write_failed", 1);
            }
        }
    }
}

/// Opens the journal's session.
async fn connect(pg: &DatabaseConfig) -> Result<tokio_postgres::Client, crate::error::Error> {
    Ok(
        crate::postgres::connect_background(pg, "off", LOCK_TIMEOUT, STATEMENT_TIMEOUT, "journal")
            .await?,
    )
}

/// Every interval (or earlier when [`EARLY_WRITE_ROWS`] wait), takes what is buffered and
/// writes it in one statement; on `stop`, writes what is left and returns.
async fn write_task(
    pg: DatabaseConfig,
    schema: crate::outbox_schema::SchemaName,
    slot: String,
    mut rx: mpsc::Receiver<JournalEntry>,
    shared: Arc<Shared>,
    interval: watch::Receiver<Duration>,
    mut stop: tokio::sync::oneshot::Receiver<()>,
) {
    let mut client: Option<tokio_postgres::Client> = None;
    let mut batch = Vec::new();
    let mut warned_at: Option<Instant> = None;
    loop {
        let wait = *interval.borrow();
        let stopping = tokio::select! {
            biased;
            _ = &mut stop => true,
            _ = shared.early.notified() => false,
            _ = tokio::time::sleep(wait) => false,
        };
        while let Ok(entry) = rx.try_recv() {
            batch.push(entry);
        }
        if !batch.is_empty() {
            write_batch(
                &pg,
                &schema,
                &slot,
                &mut client,
                &mut batch,
                &shared.telemetry,
                &mut warned_at,
            )
            .await;
        }
        if stopping {
            return;
        }
    }
}

async fn write_batch(
    pg: &DatabaseConfig,
    schema: &crate::outbox_schema::SchemaName,
    slot: &str,
    client: &mut Option<tokio_postgres::Client>,
    batch: &mut Vec<JournalEntry>,
    telemetry: &Telemetry,
    warned_at: &mut Option<Instant>,
) {
    let rows = batch.len() as u64;
    let result = async {
        if client.as_ref().is_none_or(|c| c.is_closed()) {
            *client = Some(connect(pg).await?);
        }
        let c = client.as_ref().expect("connected above");
        write_journal(c, schema, slot, batch).await
    }
    .await;
    batch.clear();
    match result {
        Ok(_) => {
            telemetry.journal_written(rows);
            tracing::debug!(rows, "journal rows written");
        }
        Err(error) => {
            *client = None;
            telemetry.journal_dropped("write_failed", rows);
            let now = Instant::now();
            if warned_at.is_none_or(|at| now.duration_since(at) >= WARN_EVERY) {
                *warned_at = Some(now);
                tracing::warn!(
                    rows,
                    error = %crate::report::one_line(&error),
                    "delivery journal write failed: its rows are dropped (counted in pgoutbox_journal_rows_dropped_total; the messages themselves were delivered); is outbox.journal installed (pgoutbox setup) and may this role INSERT into it?"
                );
            }
        }
    }
}
