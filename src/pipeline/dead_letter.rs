//! The dead-letter writer: a task that writes rows to `outbox.dead_letter` while the main
//! loop goes on sending standby status updates and collecting confirms.
//!
//! The loop hands it a [`Job`] and keeps the message unsettled in the watermark (so nothing
//! at or after it is acknowledged); the task answers with a [`Written`] once the row is
//! committed, and only then does the loop settle the message.
//!
//! Its session is bounded and never waits on itself:
//! - `lock_timeout` ([`LOCK_TIMEOUT`]) and `statement_timeout` ([`STATEMENT_TIMEOUT`]): a
//!   `LOCK TABLE`, `VACUUM FULL` or repack on `outbox.dead_letter` makes the insert fail
//!   quickly instead of hanging; the task logs a warning naming the wait and tries again
//!   with backoff, for as long as it takes;
//! - `synchronous_commit = local`: the row is durable in the local WAL when the insert
//!   returns, and the commit never waits for a synchronous standby, which could be this
//!   very streamer's walsender (a deadlock: the commit waits for our flush LSN, our flush
//!   LSN waits for the commit).

use std::time::Duration;

use bytes::Bytes;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;

use crate::admin;
use crate::error::Error;
use crate::lsn::Lsn;
use crate::sink::Seq;
use crate::watermark::TxnSeq;

/// How long the insert may wait for a lock on `outbox.dead_letter`.
pub const LOCK_TIMEOUT: Duration = Duration::from_secs(2);
/// How long the insert may run in all.
pub const STATEMENT_TIMEOUT: Duration = Duration::from_secs(10);
/// Bounds of the delay between two tries of a write that timed out.
const RETRY_MIN: Duration = Duration::from_millis(500);
const RETRY_MAX: Duration = Duration::from_secs(10);

/// SQLSTATE `lock_not_available` (`lock_timeout` fired).
const SQLSTATE_LOCK_NOT_AVAILABLE: &str = "55P03";
/// SQLSTATE `query_canceled` (`statement_timeout` fired).
const SQLSTATE_QUERY_CANCELED: &str = "57014";

/// One dead letter to write, with what the loop needs back to settle it.
#[derive(Debug)]
pub(super) struct Job {
    /// The in-flight record, when the message was published (`None`: never published).
    pub seq: Option<Seq>,
    /// Its place in the watermark, and its size there.
    pub txn: TxnSeq,
    pub bytes: u64,
    /// The row.
    pub message_id: Option<String>,
    pub topic: Option<String>,
    pub lsn: Lsn,
    pub commit_lsn: Option<Lsn>,
    pub envelope: Bytes,
    pub reason: &'static str,
    pub attempts: u32,
    pub first_error: Option<String>,
    pub last_error: String,
}

/// A committed dead letter.
#[derive(Debug)]
pub(super) struct Written {
    /// The job, as handed in.
    pub job: Job,
}

/// Handle of the writer task.
#[derive(Debug)]
pub(super) struct DeadLetterWriter {
    jobs: mpsc::UnboundedSender<Job>,
    written: mpsc::UnboundedReceiver<Result<Written, Error>>,
    task: JoinHandle<()>,
    /// Jobs handed in and not yet answered.
    pending: u64,
}

impl DeadLetterWriter {
    /// Opens the writer's own session (see the module doc for its settings) and starts the
    /// task. Rows go to the `dead_letter` table of `schema`.
    ///
    /// # Errors
    /// [`Error::Sql`] when connecting or setting up the session fails.
    pub async fn connect(
        pg: &crate::config::DatabaseConfig,
        schema: &crate::outbox_schema::SchemaName,
    ) -> Result<Self, Error> {
        let client = crate::postgres::connect_background(
            pg,
            "local",
            LOCK_TIMEOUT,
            STATEMENT_TIMEOUT,
            "dead-letter",
        )
        .await?;
        let (jobs, rx) = mpsc::unbounded_channel();
        let (tx, written) = mpsc::unbounded_channel();
        let task = tokio::spawn(write_task(client, schema.clone(), rx, tx));
        Ok(DeadLetterWriter {
            jobs,
            written,
            task,
            pending: 0,
        })
    }

    /// Hands a job to the task.
    ///
    /// # Errors
    /// [`Error::Stream`] when the task is gone (it reported its failure first).
    pub fn write(&mut self, job: Job) -> Result<(), Error> {
        self.jobs
            .send(job)
            .map_err(|_| Error::Stream("the dead-letter writer stopped".into()))?;
        self.pending += 1;
        Ok(())
    }

    /// Jobs handed in and not yet answered.
    pub fn pending(&self) -> u64 {
        self.pending
    }

    /// The next answer: a committed row, or the error that stopped the task.
    ///
    /// # Cancel safety
    /// Cancel safe (`mpsc::UnboundedReceiver::recv`).
    pub async fn next_written(&mut self) -> Result<Written, Error> {
        let answer = self
            .written
            .recv()
            .await
            .unwrap_or_else(|| Err(Error::Stream("the dead-letter writer stopped".into())));
        self.pending = self.pending.saturating_sub(1);
        answer
    }

    /// Stops the task; rows not yet committed are not written (their messages stay
    /// unacknowledged and are read again by the next session).
    pub fn stop(self) {
        self.task.abort();
    }
}

/// Writes jobs in order; retries timeouts forever with backoff, reports other errors.
async fn write_task(
    client: tokio_postgres::Client,
    schema: crate::outbox_schema::SchemaName,
    mut jobs: mpsc::UnboundedReceiver<Job>,
    written: mpsc::UnboundedSender<Result<Written, Error>>,
) {
    while let Some(job) = jobs.recv().await {
        let mut delay = RETRY_MIN;
        let mut tries = 0u32;
        loop {
            tries += 1;
            let row = admin::NewDeadLetter {
                message_id: job.message_id.as_deref(),
                topic: job.topic.as_deref(),
                lsn: job.lsn,
                commit_lsn: job.commit_lsn,
                envelope: &job.envelope,
                reason: job.reason,
                attempts: i32::try_from(job.attempts).unwrap_or(i32::MAX),
                first_error: job.first_error.as_deref(),
                last_error: &job.last_error,
            };
            match admin::write_dead_letter(&client, &schema, &row).await {
                Ok(()) => break,
                Err(e) if is_timeout(&e) => {
                    tracing::warn!(
                        lsn = %job.lsn,
                        attempt = tries,
                        retry_in_ms = delay.as_millis() as u64,
                        error = %crate::report::render_report(&e),
                        "writing a dead letter waited longer than lock_timeout ({} ms) or statement_timeout ({} ms) for a lock on {}.dead_letter (a LOCK TABLE, VACUUM FULL or repack?); retrying. Status updates and confirms go on meanwhile; nothing after this message is acknowledged until it is written",
                        LOCK_TIMEOUT.as_millis(),
                        STATEMENT_TIMEOUT.as_millis(),
                        schema
                    );
                    tokio::time::sleep(delay).await;
                    delay = (delay * 2).min(RETRY_MAX);
                }
                Err(e) => {
                    let _ = written.send(Err(e));
                    return;
                }
            }
        }
        if written.send(Ok(Written { job })).is_err() {
            return;
        }
    }
}

/// Whether the write failed on `lock_timeout` or `statement_timeout` (worth retrying here).
fn is_timeout(error: &Error) -> bool {
    match error {
        Error::Sql { source, .. } => source.code().is_some_and(|c| {
            c.code() == SQLSTATE_LOCK_NOT_AVAILABLE || c.code() == SQLSTATE_QUERY_CANCELED
        }),
        _ => false,
    }
}
