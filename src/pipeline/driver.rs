//! Sessions and reconnects: stream until shutdown or the first failure, and decide what
//! comes next.
//!
//! Every wait here (connecting to Postgres or the sink, a handshake, the slot held by
//! another process, the backoff between sessions) ends promptly on SIGINT/SIGTERM; nothing
//! is in flight during those waits, so such an exit is clean (exit status 0) and its last
//! log line starts `stopped`, like the one after a drained session. How a session
//! connects, and what it hands to the next, is `session`'s; which sink it
//! publishes to is `sinks`'s.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;
use tokio::time::Instant;

use super::admission::BrokerLimit;
use super::event_loop::Core;
use super::journal::{JournalHandle, JournalWriter};
use super::retention::RetentionTask;
use super::session::{self, Connected, SessionMemory, CLOSE_TIMEOUT};
use super::sinks::{BrokerNodes, SinkChoice};
use super::standby::note_role;
use super::wal_watch::WalWatch;
use super::RunSummary;
use crate::config::{DatabaseConfig, RunConfig};
use crate::error::Error;
use crate::metrics::{Phase, Role, Telemetry, DRIVER_BEAT};
use crate::sink::{FailureCause, PartHealth, Sink, SinkFailure};
use crate::stream_state::SeenHistory;

pub use super::session::DECODE_FAILURE_LIMIT;

/// Healthy-session length after which the reconnect backoff starts again from its minimum.
const HEALTHY_SESSION: Duration = Duration::from_secs(60);
/// How long a session must have streamed (both sides connected, the slot held) for the
/// backoff to start again from its minimum after it fails: the next outage is a new one
/// (a Postgres restart after a broker outage waits [`RECONNECT_MIN`], not what the broker
/// outage had grown to), while a session that fails as soon as it streams keeps backing off.
const STREAMED_SESSION: Duration = Duration::from_secs(5);
/// Bounds of the delay between two sessions; jitter stays inside the cap.
pub const RECONNECT_MIN: Duration = Duration::from_millis(500);
/// See [`RECONNECT_MIN`]: the longest wait between two sessions unless
/// `--reconnect-backoff-max-ms` says otherwise.
pub const RECONNECT_MAX: Duration = crate::config::DEFAULT_RECONNECT_BACKOFF_MAX;

/// Capped exponential backoff with jitter (backon), the cap applied after the jitter.
fn backoff(min: Duration, max: Duration) -> impl Iterator<Item = Duration> {
    use backon::BackoffBuilder;
    backon::ExponentialBuilder::default()
        .with_min_delay(min)
        .with_max_delay(max)
        .with_jitter()
        .without_max_times()
        .build()
        .map(move |d| d.min(max))
}

/// Runs `fut` while beating the heartbeat every [`DRIVER_BEAT`]: the driver is turning
/// while it connects, backs off or waits for the slot (each of those waits is bounded or
/// ends on a signal).
///
/// # Cancel safety
/// As cancel safe as `fut`.
async fn beating<F: Future>(telemetry: &Telemetry, fut: F) -> F::Output {
    let mut ticks = tokio::time::interval(DRIVER_BEAT);
    tokio::pin!(fut);
    loop {
        tokio::select! {
            biased;
            out = &mut fut => return out,
            _ = ticks.tick() => telemetry.beat(),
        }
    }
}

/// The reconnect cause of a retryable session failure, for `pgoutbox_reconnects_total`.
fn reconnect_cause(error: &Error) -> &'static str {
    match error {
        Error::BrokerLost(_) | Error::Publisher(_) | Error::Sink(_) => "broker",
        _ => "postgres",
    }
}

/// The phase `/readyz` shows after a session failed with `error` ([`reconnect_cause`]'s
/// side): `broker_disconnected` or `replication_lost`, until a session streams again.
fn outage_phase(error: &Error) -> Phase {
    match reconnect_cause(error) {
        "broker" => Phase::BrokerDisconnected,
        _ => Phase::ReplicationLost,
    }
}

/// Aborts the HTTP task when `run` returns.
struct ServerGuard(Option<tokio::task::JoinHandle<()>>);

impl Drop for ServerGuard {
    fn drop(&mut self) {
        if let Some(task) = self.0.take() {
            task.abort();
        }
    }
}

/// Resolves once shutdown was requested (or the sender is gone).
///
/// # Cancel safety
/// Cancel safe (`watch::Receiver::wait_for`).
async fn shutdown_requested(shutdown: &mut watch::Receiver<bool>) {
    let _ = shutdown.wait_for(|stop| *stop).await;
}

/// Serves `/metrics`, `/healthz` and `/readyz` on `--http-addr` while the guard lives.
async fn serve_http(config: &RunConfig, telemetry: &Arc<Telemetry>) -> Result<ServerGuard, Error> {
    let Some(addr) = config.observability.http_addr else {
        return Ok(ServerGuard(None));
    };
    let task = crate::metrics::http::serve(addr, Arc::clone(telemetry))
        .await
        .map_err(|e| crate::config::ValidationError {
            setting: "--http-addr",
            value: addr.to_string(),
            rule: format!(
                "cannot listen there ({e}); pick a free port, or write off to disable the HTTP server"
            ),
        })?;
    Ok(ServerGuard(Some(task)))
}

/// What the first session starts with: `--broker-max-message-bytes`, and the broker's nodes
/// in `--amqp-url-order` (logged when there are several).
fn first_memory(config: &RunConfig) -> SessionMemory {
    let broker_limit = config
        .bounds
        .broker_max_message_bytes
        .map(|max_bytes| BrokerLimit {
            max_bytes,
            source: format!("--broker-max-message-bytes {max_bytes}"),
        });
    let nodes = BrokerNodes::new(crate::config::order_amqp_urls(
        &config.broker.amqp_urls,
        config.broker.amqp_url_order,
        fastrand::u64(..),
    ));
    if nodes.urls.len() > 1 {
        tracing::info!(
            nodes = %nodes
                .urls
                .iter()
                .map(ToString::to_string)
                .collect::<Vec<_>>()
                .join(", "),
            order = ?config.broker.amqp_url_order,
            "RabbitMQ nodes, in the order they are tried"
        );
    }
    SessionMemory::new(broker_limit, nodes)
}

/// Streams until `shutdown` turns true (then drains) or a definite error, reconnecting with
/// capped exponential backoff and jitter ([`RECONNECT_MIN`] to `--reconnect-backoff-max-ms`, [`RECONNECT_MAX`] by default) after every
/// retryable failure (broker or Postgres connection lost, channel closed, server restart).
/// The backoff starts again from [`RECONNECT_MIN`] after a session that streamed for
/// [`STREAMED_SESSION`] (or lasted [`HEALTHY_SESSION`]), so one outage's backoff does not
/// carry over to the next.
///
/// Each session starts from the slot (and from the last LSN this process knows to be
/// settled, when that is further), so a reconnect re-sends at most what was not confirmed.
///
/// With `config.observability.http_addr` set, `/metrics`, `/healthz` and `/readyz` are served there (see
/// [`crate::metrics`]) for as long as this runs.
///
/// # Errors
/// Definite errors only: configuration and precondition errors (including an
/// `--http-addr` that cannot be listened on), a lost slot,
/// [`Error::SlotBusy`] when `slot_busy_timeout` is set, [`Error::ShutdownTimeout`],
/// [`Error::DrainInterrupted`] when a connection was lost while shutdown was draining
/// confirms, [`Error::UndecodableWal`]. On every path nothing past the last settled
/// transaction has been acknowledged.
pub async fn run(
    config: RunConfig,
    mut shutdown: watch::Receiver<bool>,
) -> Result<RunSummary, Error> {
    let mut pg = config.postgres.database.clone();
    // The SQL sessions carry the instance id, as the replication session does.
    pg.session_name = Some(crate::postgres::application_name(
        &config.observability.instance_id,
    ));
    let telemetry = Telemetry::new(config.observability.stall_after);
    let _server = serve_http(&config, &telemetry).await?;
    let _wal_watch = WalWatch::start(&pg, &telemetry);
    let mut memory = first_memory(&config);
    // Both background tasks have their own SQL session and never hold back the stream.
    // Retention starts once a session's pre-flight checks passed (see session::connect).
    let (preflight_passed, preflight_rx) = watch::channel(false);
    let _retention = RetentionTask::start(
        config.postgres.retention,
        &pg,
        &config.postgres.schema,
        &telemetry,
        preflight_rx,
    );
    let journal = JournalWriter::start(
        config.observability.journal,
        &pg,
        &config.postgres.schema,
        &config.postgres.slot,
        &config.broker.exchange,
        crate::config::MAX_STATUS_INTERVAL,
        &telemetry,
    );
    let sessions = Sessions {
        sinks: SinkChoice::from_config(&config, &telemetry),
        config: &config,
        pg: &pg,
        telemetry: &telemetry,
        journal: journal.handle(),
        preflight_passed,
    };
    let result = sessions.reconnecting(&mut memory, &mut shutdown).await;
    // The journal's last rows (the messages are settled whatever happens to them).
    journal.close().await;
    result
}

/// What every session of one run shares.
struct Sessions<'a> {
    config: &'a RunConfig,
    pg: &'a DatabaseConfig,
    /// The sink every session connects ([`SinkChoice::from_config`]).
    sinks: SinkChoice,
    telemetry: &'a Arc<Telemetry>,
    journal: JournalHandle,
    /// Turned true by the first session whose pre-flight checks pass; the retention task
    /// waits for it.
    preflight_passed: watch::Sender<bool>,
}

/// The end of a run whose last session failed (retryably) during shutdown: an interrupted
/// drain when messages were still unsettled, else a clean exit.
fn interrupted_shutdown(
    memory: &SessionMemory,
    error: Error,
    summary: RunSummary,
) -> Result<RunSummary, Error> {
    if memory.unsettled_at_end > 0 {
        return Err(Error::DrainInterrupted {
            unsettled: memory.unsettled_at_end,
            flushed: summary.flushed,
            cause: Box::new(error),
        });
    }
    tracing::warn!(error = %error, "session failed during shutdown with nothing in flight");
    Ok(summary)
}

impl Sessions<'_> {
    /// Sessions one after another, with the backoff of [`run`] between them.
    async fn reconnecting(
        &self,
        memory: &mut SessionMemory,
        shutdown: &mut watch::Receiver<bool>,
    ) -> Result<RunSummary, Error> {
        let mut summary = RunSummary::default();
        let cap = self.config.bounds.reconnect_backoff_max;
        let mut delays = backoff(RECONNECT_MIN, cap);
        loop {
            let began = Instant::now();
            memory.streaming_since = None;
            let result = self.session(shutdown.clone(), memory, &mut summary).await;
            // Whatever ended it, its broker connections are closed (or never all opened).
            self.telemetry.connections_closed();
            if result.is_err() {
                note_role(self.telemetry, &self.config.postgres.slot, Role::None, None);
            }
            let error = match result {
                Ok(()) => return Ok(summary),
                Err(e) => memory.note_decode_failure(e),
            };
            // Not ready, saying which side failed, through the backoff and the next connect
            // (whose own failure names its side again).
            self.telemetry.set_phase(outage_phase(&error));
            if !error.is_retryable() {
                return Err(error);
            }
            if *shutdown.borrow() {
                return interrupted_shutdown(memory, error, summary);
            }
            let streamed = memory
                .streaming_since
                .is_some_and(|since| since.elapsed() >= STREAMED_SESSION);
            if streamed || began.elapsed() > HEALTHY_SESSION {
                delays = backoff(RECONNECT_MIN, cap);
            }
            let delay = delays.next().unwrap_or(cap);
            summary.reconnects += 1;
            self.telemetry.reconnect(reconnect_cause(&error));
            tracing::warn!(
                error = %crate::error::one_line(&error),
                retry_in_ms = delay.as_millis() as u64,
                resume_lsn = %memory.resume.unwrap_or_default(),
                "session failed; reconnecting"
            );
            tokio::select! {
                biased;
                _ = shutdown_requested(shutdown) => {
                    tracing::info!(
                        reconnects = summary.reconnects,
                        flushed_lsn = %summary.flushed,
                        "stopped: shutdown requested during the reconnect backoff; nothing was in flight"
                    );
                    return Ok(summary);
                }
                _ = beating(self.telemetry, tokio::time::sleep(delay)) => {}
            }
        }
    }

    /// One session: connect (racing shutdown), stream, and return on shutdown (`Ok`) or
    /// the first failure. `memory` carries what the next session needs.
    async fn session(
        &self,
        mut shutdown: watch::Receiver<bool>,
        memory: &mut SessionMemory,
        summary: &mut RunSummary,
    ) -> Result<(), Error> {
        memory.unsettled_at_end = 0;
        let connecting = session::connect(
            self.config,
            self.pg,
            &self.sinks,
            memory,
            self.telemetry,
            &self.preflight_passed,
        );
        let connected = tokio::select! {
            biased;
            _ = shutdown_requested(&mut shutdown) => {
                tracing::info!(
                    reconnects = summary.reconnects,
                    flushed_lsn = %summary.flushed,
                    "stopped: shutdown requested while connecting; nothing was in flight"
                );
                return Ok(());
            }
            c = beating(self.telemetry, connecting) => c?,
        };
        self.telemetry.session_started();
        memory.nodes.connected(&connected.nodes);
        memory.streaming_since = Some(Instant::now());
        note_role(
            self.telemetry,
            &self.config.postgres.slot,
            Role::Active,
            None,
        );
        self.journal.set_interval(connected.interval);
        let (mut core, mut sink, ended) = self.core(connected, memory, summary);
        let result = core.run_loop(&mut *sink, shutdown).await;
        if let Err(e) = &result {
            // Not ready from the moment the loop ends, not once the connections are closed.
            self.telemetry.set_phase(outage_phase(e));
        }
        memory
            .nodes
            .session_ended(&ended.nodes, &lost_connections(&*sink, core.sink_failure()));
        let highest_timeline = memory
            .seen
            .as_ref()
            .filter(|seen| seen.system_id == ended.identity.system_id)
            .map_or(ended.identity.timeline, |seen| {
                seen.highest_timeline.max(ended.identity.timeline)
            });
        memory.seen = Some(SeenHistory {
            system_id: ended.identity.system_id,
            timeline: ended.identity.timeline,
            highest_timeline,
            recorded: ended.recorded.get(),
        });
        memory.resume_after(core.flushed(), core.take_delivered());
        memory.unsettled_at_end = core.unsettled();
        memory.stalled_since = core.stalled_since();
        if let Some(limit) = core.broker_limit() {
            memory.broker_limit = Some(limit);
        }
        memory.refusals = core.refusals();
        self.close(core, sink, summary).await;
        if result.is_ok() {
            log_stopped(summary);
        }
        result
    }

    /// The loop's state for a connected session, its sink, and what the session's end
    /// records.
    fn core(
        &self,
        c: Connected,
        memory: &mut SessionMemory,
        summary: &mut RunSummary,
    ) -> (Core, Box<dyn Sink>, Ended) {
        let mut core = Core::new(
            self.config.clone(),
            c.stream,
            c.dead_letters,
            c.start,
            c.interval,
            c.gate,
            memory.broker_limit.clone(),
            memory.refusals.clone(),
            memory.stalled_since,
            std::mem::take(summary),
            Arc::clone(self.telemetry),
            c.lockdown,
            c.prefix,
            self.journal.clone(),
        );
        core.set_delivered(std::mem::take(&mut memory.delivered));
        let ended = Ended {
            nodes: c.nodes,
            identity: c.identity,
            recorded: c.recorded,
        };
        (core, c.sink, ended)
    }

    /// Closes the session's connections (bounded: peers may be gone or black-holed) and
    /// hands the summary back.
    async fn close(&self, core: Core, sink: Box<dyn Sink>, summary: &mut RunSummary) {
        let (stream, dead_letters, finished) = core.into_parts();
        *summary = finished;
        let _ = tokio::time::timeout(CLOSE_TIMEOUT, sink.close()).await;
        let _ = tokio::time::timeout(CLOSE_TIMEOUT, stream.close()).await;
        dead_letters.stop();
        self.telemetry.connections_closed();
    }
}

/// What a session's end records in [`SessionMemory`] besides the loop's figures.
struct Ended {
    /// The broker node of each of the sink's connections, partition 0 first.
    nodes: Vec<usize>,
    /// The server's identity.
    identity: crate::replication::connect::SystemIdentity,
    /// What the session recorded in `outbox.stream_state`, read once it ended.
    recorded: crate::stream_state::RecordedHandle,
}

/// Per connection of `sink` (partition 0 first), whether it was lost at the session's end:
/// its health is lost, and not because the broker closed its channel over one message
/// (`failure`, the sink failure that ended the session: the node is fine then).
fn lost_connections(sink: &dyn Sink, failure: Option<&SinkFailure>) -> Vec<bool> {
    let closed_channel = failure.and_then(|f| match f.cause {
        FailureCause::ChannelClosed { .. } => Some(f.partition.map_or(0, usize::from)),
        _ => None,
    });
    sink.health()
        .parts
        .iter()
        .enumerate()
        .map(|(i, h)| *h == PartHealth::Lost && closed_channel != Some(i))
        .collect()
}

/// The clean stop's summary line.
fn log_stopped(summary: &RunSummary) {
    tracing::info!(
        published = summary.published,
        retried = summary.retried,
        confirmed = summary.confirmed,
        dead_lettered = summary.dead_lettered,
        reconnects = summary.reconnects,
        not_resent = summary.not_resent,
        flushed_lsn = %summary.flushed,
        "stopped; every message was settled (published counts every attempt, including retries and re-sends after reconnects)"
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_outage_names_the_side_that_failed() {
        assert_eq!(
            outage_phase(&Error::BrokerLost("gone".into())),
            Phase::BrokerDisconnected
        );
        assert_eq!(
            outage_phase(&Error::StreamStateLost),
            Phase::ReplicationLost
        );
        assert_eq!(
            outage_phase(&Error::Stream("eof".into())),
            Phase::ReplicationLost
        );
    }

    #[test]
    fn backoff_never_exceeds_its_cap() {
        let max = backoff(RECONNECT_MIN, RECONNECT_MAX)
            .take(200)
            .max()
            .unwrap_or_default();
        assert!(max <= RECONNECT_MAX, "{max:?}");
        assert!(max >= RECONNECT_MAX / 2, "the cap is reached: {max:?}");
        let first = backoff(RECONNECT_MIN, RECONNECT_MAX)
            .next()
            .unwrap_or_default();
        assert!(
            first >= RECONNECT_MIN && first <= RECONNECT_MIN * 2,
            "{first:?}"
        );
    }
}
