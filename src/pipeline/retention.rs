//! `run`'s retention task: deletes expired idempotency keys (`--idempotency-retention`)
//! and journal rows (`--journal-retention`) every `--maintenance-interval`, the first pass
//! once the first session's pre-flight checks passed (so that a missing slot or privilege
//! is the first thing `run` says, not a retention warning caused by the same fault).
//!
//! It has its own SQL session and shares nothing with the stream: it never blocks reading,
//! publishing or acknowledgement. Each statement deletes at most [`BATCH_ROWS`] rows with
//! [`BATCH_PAUSE`] between two ([`crate::admin::retention::purge`]); the session has
//! `lock_timeout` and `statement_timeout`, so a locked table costs one failed pass. An
//! error is logged and the pass is tried again at the next interval (on a new session);
//! it is never fatal.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::admin::retention::{purge, Purgeable, Purged};
use crate::config::{DatabaseConfig, RetentionSettings, DEFAULT_RETENTION_BATCH};
use crate::metrics::Telemetry;

/// Rows per delete statement.
pub const BATCH_ROWS: u32 = DEFAULT_RETENTION_BATCH;
/// Pause between two delete statements of a pass.
pub const BATCH_PAUSE: Duration = Duration::from_millis(100);
const LOCK_TIMEOUT: Duration = Duration::from_secs(2);
const STATEMENT_TIMEOUT: Duration = Duration::from_secs(30);

/// The running task; aborted on drop (a delete in flight is rolled back by the server, and
/// the next pass does it again).
#[derive(Debug)]
pub(super) struct RetentionTask(Option<JoinHandle<()>>);

impl Drop for RetentionTask {
    fn drop(&mut self) {
        if let Some(task) = self.0.take() {
            task.abort();
        }
    }
}

impl RetentionTask {
    /// Starts the task, unless both retentions are off. Its first pass waits until
    /// `preflight_passed` turns true (a session's pre-flight checks passed); it never runs
    /// when the sender is dropped first.
    pub fn start(
        settings: RetentionSettings,
        pg: &DatabaseConfig,
        schema: &crate::outbox_schema::SchemaName,
        telemetry: &Arc<Telemetry>,
        mut preflight_passed: watch::Receiver<bool>,
    ) -> RetentionTask {
        if settings.idempotency.age().is_none() && settings.journal.age().is_none() {
            tracing::info!("retention off (--idempotency-retention 0 and --journal-retention 0): nothing is deleted");
            return RetentionTask(None);
        }
        let pg = pg.clone();
        let schema = schema.clone();
        let telemetry = Arc::clone(telemetry);
        RetentionTask(Some(tokio::spawn(async move {
            if preflight_passed.wait_for(|passed| *passed).await.is_err() {
                return;
            }
            tracing::info!(
                idempotency_retention = %settings.idempotency,
                journal_retention = %settings.journal,
                every = %humantime::format_duration(settings.interval),
                "retention task started"
            );
            retention_task(settings, pg, schema, telemetry).await;
        })))
    }
}

async fn connect(pg: &DatabaseConfig) -> Result<tokio_postgres::Client, crate::error::Error> {
    Ok(crate::postgres::connect_background(
        pg,
        "local",
        LOCK_TIMEOUT,
        STATEMENT_TIMEOUT,
        "retention",
    )
    .await?)
}

async fn retention_task(
    settings: RetentionSettings,
    pg: DatabaseConfig,
    schema: crate::outbox_schema::SchemaName,
    telemetry: Arc<Telemetry>,
) {
    let mut client: Option<tokio_postgres::Client> = None;
    // A table reported missing once is not reported again until it appears.
    let mut missing_noted = [false; 2];
    loop {
        for (i, (table, retention)) in [
            (Purgeable::IdempotencyKeys, settings.idempotency),
            (Purgeable::Journal, settings.journal),
        ]
        .into_iter()
        .enumerate()
        {
            if retention.age().is_none() {
                continue;
            }
            let result = async {
                if client.as_ref().is_none_or(|c| c.is_closed()) {
                    client = Some(connect(&pg).await?);
                }
                let c = client.as_ref().expect("connected above");
                purge(c, &schema, table, retention, BATCH_ROWS, BATCH_PAUSE).await
            }
            .await;
            match result {
                Ok(Purged::Deleted { rows, batches }) => {
                    missing_noted[i] = false;
                    telemetry.retention_deleted(table.label(), rows);
                    if rows > 0 {
                        tracing::info!(table = table.label(), rows, batches, retention = %retention, "deleted expired {}", table.describe_in(&schema));
                    }
                }
                Ok(Purged::Missing) => {
                    if !std::mem::replace(&mut missing_noted[i], true) {
                        tracing::info!(
                            table = table.label(),
                            "retention skips {}: {}",
                            table.describe_in(&schema),
                            table.missing_note()
                        );
                    }
                }
                Ok(Purged::Off) => {}
                Err(error) => {
                    client = None;
                    tracing::warn!(
                        table = table.label(),
                        error = %crate::report::one_line(&error),
                        retry_in_s = settings.interval.as_secs(),
                        "retention pass failed; it is tried again at the next interval (streaming is not affected)"
                    );
                }
            }
        }
        tokio::time::sleep(settings.interval).await;
    }
}
