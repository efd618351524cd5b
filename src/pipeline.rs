//! The main loop of `pgoutbox run`: WAL in, publishes out, confirms back, flush LSN out.
//!
//! ```text
//!  walsender ──XLogData/keepalive──▶ ReplicationStream ──pgoutput──▶ Begin/Message/Commit
//!      ▲                                                                  │ envelope
//!      │ standby status update (flush = AckWatermark::flushed)            ▼
//!  AckWatermark ◀──(ticket, outcome)── confirm task ◀── publish task ◀── OutboundMessage
//! ```
//!
//! The invariant: the flush LSN reported to Postgres only moves over transactions whose
//! every outbox message the broker confirmed as routed (acked and not returned), or to a
//! primary keepalive's `walEnd` when nothing at all is pending. It starts at the slot's
//! `confirmed_flush_lsn`, read after `START_REPLICATION` succeeded (so nobody else can move
//! it meanwhile), and never goes lower.
//!
//! Backpressure: when the window (messages or payload bytes in flight) is full, the loop
//! stops reading the replication socket but keeps sending standby status updates on a timer
//! well inside `wal_sender_timeout`; the walsender reads replies while its own send blocks.
//! Sources: PostgreSQL docs, "Streaming Replication Protocol" and "Logical Streaming
//! Replication Protocol".

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};
use std::time::Duration;

use bytes::Bytes;
use lapin::types::ShortString;
use lapin::BasicProperties;
use tokio::sync::watch;
use tokio::time::Instant;

use crate::admin;
use crate::config::{
    parse_database_url, Failpoint, RunConfig, UnroutablePolicy, MAX_STATUS_INTERVAL,
    MESSAGE_PREFIX, STATUS_COALESCE,
};
use crate::envelope;
use crate::error::Error;
use crate::lsn::Lsn;
use crate::pgoutput::{self, LogicalMessage};
use crate::publisher::message::{
    headers_from_json, insert_i64, insert_text, DELIVERY_MODE_PERSISTENT,
};
use crate::publisher::{OutboundMessage, PublishOutcome, Publisher, PublisherConfig};
use crate::replication::connect::ReplicationConnection;
use crate::replication::session::ReplicationStream;
use crate::replication::stream::{
    now_pg_time_us, ReplicationMessage, StandbyStatusUpdate, StatusUpdateKind,
};
use crate::watermark::{AckWatermark, TxnSeq};

/// Header with the message's own LSN (`X/Y`); also the key that matches returns.
pub const HEADER_LSN: &str = crate::publisher::MATCH_KEY_HEADER;
/// Header with the LSN of the transaction's commit record (`X/Y`, pgoutput Begin's final
/// LSN): increases with commit order.
pub const HEADER_COMMIT_LSN: &str = "x-pgoutbox-commit-lsn";
/// Header with the commit time, microseconds since the Unix epoch.
pub const HEADER_COMMIT_TIME_US: &str = "x-pgoutbox-commit-time-us";

/// Frames handled per loop turn before confirms and timers get another look.
const FRAME_BATCH: usize = 2048;

/// A read of fewer bytes than this delays the next one by `RunConfig::read_coalesce`.
const COALESCE_BELOW_BYTES: usize = 64 * 1024;

/// What a run did, returned on a clean shutdown.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RunSummary {
    /// Messages published.
    pub published: u64,
    /// Messages confirmed as routed.
    pub confirmed: u64,
    /// The last flush LSN reported to Postgres.
    pub flushed: Lsn,
    /// Messages written to `outbox.dead_letter`.
    pub dead_lettered: u64,
    /// Sessions restarted after a retryable failure.
    pub reconnects: u64,
}

/// Parses a PostgreSQL duration setting as `SHOW` prints it (`60s`, `1min`, `500ms`, `0`).
fn parse_pg_duration(text: &str) -> Option<Duration> {
    let text = text.trim();
    let split = text
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(text.len());
    let (num, unit) = text.split_at(split);
    let n: u64 = num.parse().ok()?;
    let ms = match unit.trim() {
        "" | "ms" => n,
        "s" => n * 1000,
        "min" => n * 60_000,
        "h" => n * 3_600_000,
        "d" => n * 86_400_000,
        _ => return None,
    };
    Some(Duration::from_millis(ms))
}

/// The periodic status interval for a server `wal_sender_timeout` (`None`: unknown or 0 =
/// disabled): a third of the timeout, at most [`MAX_STATUS_INTERVAL`], at least 100 ms.
fn status_interval(wal_sender_timeout: Option<Duration>) -> Duration {
    match wal_sender_timeout {
        Some(t) if !t.is_zero() => (t / 3).clamp(Duration::from_millis(100), MAX_STATUS_INTERVAL),
        _ => MAX_STATUS_INTERVAL,
    }
}

/// Unconfirmed messages with no progress for this long are warned about, this often.
const STALL_WARNING: Duration = Duration::from_secs(30);
/// How long closing the broker connection and the replication stream may take.
const CLOSE_TIMEOUT: Duration = Duration::from_secs(2);
/// How long connecting to the broker may take (a black-holed host never answers).
const CONNECT_TIMEOUT: Duration = Duration::from_secs(15);
/// Healthy-session length after which the reconnect backoff starts again from its minimum.
const HEALTHY_SESSION: Duration = Duration::from_secs(60);
/// How long a session whose Postgres connection broke keeps collecting broker confirms, so
/// messages already confirmed are not sent again after the reconnect.
const PG_LOSS_DRAIN: Duration = Duration::from_secs(5);
/// Retry delay bounds for a nacked message (doubling from the minimum).
const NACK_RETRY_MIN: Duration = Duration::from_millis(100);
const NACK_RETRY_MAX: Duration = Duration::from_secs(5);
/// Retry delay bound for a returned message under `--on-unroutable block`.
const BLOCK_RETRY_MAX: Duration = Duration::from_secs(30);

fn reconnect_backoff() -> impl Iterator<Item = Duration> {
    use backon::BackoffBuilder;
    backon::ExponentialBuilder::default()
        .with_min_delay(Duration::from_millis(500))
        .with_max_delay(Duration::from_secs(30))
        .with_jitter()
        .without_max_times()
        .build()
}

/// Streams until `shutdown` turns true (then drains) or a definite error, reconnecting with
/// capped exponential backoff and jitter after every retryable failure (broker or Postgres
/// connection lost, channel closed, server restart).
///
/// Each session starts from the slot (and from the last LSN this process knows to be
/// settled, when that is further), so a reconnect re-sends at most what was not confirmed.
///
/// # Errors
/// Definite errors only: configuration and precondition errors, a lost slot,
/// [`Error::SlotBusy`] when `slot_busy_timeout` is set, [`Error::ShutdownTimeout`]. On every
/// path nothing past the last settled transaction has been acknowledged.
pub async fn run(
    config: RunConfig,
    mut shutdown: watch::Receiver<bool>,
) -> Result<RunSummary, Error> {
    config.validate()?;
    let pg = parse_database_url(&config.database_url)?;
    let mut resume: Option<Lsn> = None;
    let mut summary = RunSummary::default();
    let mut backoff = reconnect_backoff();
    loop {
        let began = Instant::now();
        let result = run_session(&config, &pg, shutdown.clone(), &mut resume, &mut summary).await;
        match result {
            Ok(()) => return Ok(summary),
            Err(e) if !e.is_retryable() => return Err(e),
            Err(e) => {
                if *shutdown.borrow() {
                    tracing::warn!(error = %e, "session failed during shutdown");
                    return Ok(summary);
                }
                if began.elapsed() > HEALTHY_SESSION {
                    backoff = reconnect_backoff();
                }
                let delay = backoff.next().unwrap_or(Duration::from_secs(30));
                summary.reconnects += 1;
                tracing::warn!(
                    error = %crate::error::render_report(&e),
                    retry_in_ms = delay.as_millis() as u64,
                    resume_lsn = %resume.unwrap_or_default(),
                    "session failed; reconnecting"
                );
                tokio::select! {
                    _ = tokio::time::sleep(delay) => {}
                    _ = shutdown.changed() => return Ok(summary),
                }
            }
        }
    }
}

/// One session: connect Postgres (SQL and replication) and the broker, stream, and return
/// on shutdown (`Ok`) or the first failure. `resume` carries the settled LSN across sessions.
async fn run_session(
    config: &RunConfig,
    pg: &tokio_postgres::Config,
    shutdown: watch::Receiver<bool>,
    resume: &mut Option<Lsn>,
    summary: &mut RunSummary,
) -> Result<(), Error> {
    let sql = admin::connect_dead_letter_writer(pg).await?;
    admin::preflight(&sql, &config.slot, &config.publication).await?;
    let publisher_config = PublisherConfig {
        amqp_url: config.amqp_url.clone(),
        exchange: config.exchange.clone(),
        connection_name: format!("pgoutbox {}", config.instance_id),
    };
    let mut publisher = tokio::time::timeout(
        CONNECT_TIMEOUT,
        Publisher::<u64>::connect(&publisher_config),
    )
    .await
    .map_err(|_| {
        Error::BrokerLost(format!(
            "connecting to {} timed out after {} s",
            crate::config::redact_url(&config.amqp_url),
            CONNECT_TIMEOUT.as_secs()
        ))
    })??;
    let application_name = format!("pgoutbox-{}", config.instance_id);
    let hint = resume.unwrap_or(Lsn::ZERO);
    let (stream, interval) = start_stream(config, pg, &sql, &application_name, hint).await?;
    // We hold the slot now: nobody else can move confirmed_flush_lsn under us.
    let slot_lsn = admin::confirmed_flush_lsn(&sql, &config.slot).await?;
    let start = slot_lsn.max(hint);
    tracing::info!(
        slot = %config.slot,
        publication = %config.publication,
        exchange = %config.exchange,
        start_lsn = %start,
        slot_confirmed_flush_lsn = %slot_lsn,
        status_interval_ms = interval.as_millis() as u64,
        max_in_flight = config.max_in_flight,
        max_in_flight_bytes = config.max_in_flight_bytes,
        "streaming"
    );
    let mut core = Core {
        stream,
        sql,
        config: config.clone(),
        wm: AckWatermark::new(start),
        received: start,
        last_sent_flush: Lsn::ZERO,
        last_status_at: Instant::now(),
        next_periodic: Instant::now(),
        next_read_at: Instant::now(),
        interval,
        bytes_in_flight: 0,
        current_txn: None,
        inflight: HashMap::new(),
        next_seq: 0,
        retries: BinaryHeap::new(),
        summary: std::mem::take(summary),
        last_progress: Instant::now(),
        last_stall_warning: Instant::now(),
    };
    let result = core.run_loop(&mut publisher, shutdown).await;
    *resume = Some(core.wm.flushed());
    core.summary.flushed = core.last_sent_flush;
    *summary = std::mem::take(&mut core.summary);
    // Closing talks to peers that may be gone or black-holed: never wait long for it.
    let _ = tokio::time::timeout(CLOSE_TIMEOUT, publisher.close()).await;
    let _ = tokio::time::timeout(CLOSE_TIMEOUT, core.stream.close()).await;
    if result.is_ok() {
        tracing::info!(
            published = summary.published,
            confirmed = summary.confirmed,
            dead_lettered = summary.dead_lettered,
            reconnects = summary.reconnects,
            flushed_lsn = %summary.flushed,
            "stopped"
        );
    }
    result
}

/// Opens the replication connection and starts streaming at `start` (the server starts at
/// the slot's confirmed_flush_lsn when that is further). While another process holds the
/// slot it waits with backoff, logging the holder, for `slot_busy_timeout` (forever when
/// `None`: a standby).
async fn start_stream(
    config: &RunConfig,
    pg: &tokio_postgres::Config,
    sql: &tokio_postgres::Client,
    application_name: &str,
    start: Lsn,
) -> Result<(ReplicationStream, Duration), Error> {
    use backon::BackoffBuilder;
    let began = Instant::now();
    let mut delays = backon::ExponentialBuilder::default()
        .with_min_delay(Duration::from_millis(250))
        .with_max_delay(Duration::from_secs(10))
        .with_jitter()
        .without_max_times()
        .build();
    let options = [
        ("proto_version", "1"),
        ("publication_names", config.publication.as_str()),
        ("messages", "true"),
    ];
    loop {
        let mut conn = ReplicationConnection::connect(pg, application_name).await?;
        let identity = conn.identify_system().await?;
        let timeout = conn
            .show("wal_sender_timeout")
            .await?
            .as_deref()
            .and_then(parse_pg_duration);
        tracing::debug!(system_id = %identity.system_id, timeline = identity.timeline, xlogpos = %identity.xlogpos, "identified system");
        match conn
            .start_logical_replication(&config.slot, start, &options)
            .await
        {
            Ok(stream) => return Ok((stream, status_interval(timeout))),
            Err(e) if e.code() == Some(crate::replication::error::SQLSTATE_OBJECT_IN_USE) => {
                let status = admin::slot_status(sql, &config.slot).await.ok();
                let holder_pid = status
                    .as_ref()
                    .and_then(|s| s.active_pid)
                    .map(|p| p.to_string())
                    .unwrap_or_else(|| "unknown".into());
                let holder_name = status
                    .and_then(|s| s.holder)
                    .unwrap_or_else(|| "unknown".into());
                let waited = began.elapsed();
                if let Some(limit) = config.slot_busy_timeout {
                    if waited >= limit {
                        return Err(Error::SlotBusy {
                            slot: config.slot.clone(),
                            holder_pid,
                            holder_name,
                            waited_s: waited.as_secs(),
                        });
                    }
                }
                let mut delay = delays.next().unwrap_or(Duration::from_secs(10));
                if let Some(limit) = config.slot_busy_timeout {
                    delay = delay.min(limit.saturating_sub(waited) + Duration::from_millis(50));
                }
                tracing::warn!(
                    slot = %config.slot,
                    holder_pid = %holder_pid,
                    holder = %holder_name,
                    retry_in_ms = delay.as_millis() as u64,
                    "slot is active in another process; waiting"
                );
                tokio::time::sleep(delay).await;
            }
            // PostgreSQL 15: "can no longer get changes from replication slot" once
            // max_slot_wal_keep_size invalidated it.
            Err(e) if e.code() == Some("55000") => {
                return Err(Error::SlotLost {
                    slot: config.slot.clone(),
                    confirmed_flush_lsn: admin::slot_status(sql, &config.slot)
                        .await
                        .ok()
                        .and_then(|s| s.confirmed_flush_lsn)
                        .unwrap_or_else(|| e.to_string()),
                })
            }
            Err(e) => return Err(e.into()),
        }
    }
}

/// A message sent to the broker and not yet settled (confirmed as routed or dead-lettered).
#[derive(Debug)]
struct InFlight {
    txn: TxnSeq,
    lsn: Lsn,
    commit_lsn: Lsn,
    commit_time_us: i64,
    /// The logical message content (the envelope), kept to rebuild a retry.
    content: Bytes,
    bytes: usize,
    attempts: u32,
    first_error: Option<String>,
}

/// Why the loop is draining.
enum Drain {
    /// SIGINT/SIGTERM: drain, send the final status update, return `Ok`.
    Shutdown(Instant),
    /// The Postgres connection broke: collect confirms for a while, then return the error.
    PostgresLost(Instant, Error),
}

struct Core {
    stream: ReplicationStream,
    /// Ordinary SQL session with `synchronous_commit = on`, for dead letters.
    sql: tokio_postgres::Client,
    config: RunConfig,
    wm: AckWatermark,
    /// Highest WAL position seen (commit ends and keepalive ends): the "write" position.
    received: Lsn,
    last_sent_flush: Lsn,
    last_status_at: Instant,
    next_periodic: Instant,
    /// The next read of a trickling stream waits until then (see `RunConfig::read_coalesce`).
    next_read_at: Instant,
    interval: Duration,
    bytes_in_flight: usize,
    /// Begin of the open transaction: (commit record LSN, commit time µs since Unix epoch).
    current_txn: Option<(Lsn, i64)>,
    inflight: HashMap<u64, InFlight>,
    next_seq: u64,
    /// Messages waiting to be published again: (due, seq), earliest first.
    retries: BinaryHeap<Reverse<(Instant, u64)>>,
    summary: RunSummary,
    /// Last time a message was settled, or nothing was outstanding: the start of a stall.
    last_progress: Instant,
    /// Last time a stall warning was logged.
    last_stall_warning: Instant,
}

impl Core {
    fn has_room(&self) -> bool {
        self.wm.unconfirmed() < self.config.max_in_flight as u64
            && self.bytes_in_flight < self.config.max_in_flight_bytes
    }

    /// The main loop: one `select!` with written priorities.
    ///
    /// Priorities (highest first):
    /// 1. shutdown signal (stop reading, start the bounded drain);
    /// 2. the drain deadline;
    /// 3. the status update deadline, which also checks the broker connection (never starved
    ///    by confirms or WAL);
    /// 4. broker confirm outcomes (a batch per turn);
    /// 5. retries that are due;
    /// 6. new WAL from the socket, only while the window has room;
    /// 7. frames already buffered (when a turn's frame batch ran out).
    async fn run_loop(
        &mut self,
        publisher: &mut Publisher<u64>,
        mut shutdown: watch::Receiver<bool>,
    ) -> Result<(), Error> {
        let mut drain: Option<Drain> = None;
        if *shutdown.borrow() {
            drain = Some(Drain::Shutdown(
                Instant::now() + self.config.shutdown_timeout,
            ));
        }
        let mut buffered = true;
        self.send_status(StatusUpdateKind::Periodic).await?;
        loop {
            if drain.is_none() {
                if let Err(e) = self.handle_buffered(publisher, &mut buffered).await {
                    drain = self.on_error(e)?;
                }
            }
            if drain.is_some() && self.wm.unconfirmed() == 0 {
                if let Some(d) = drain.take() {
                    return self.finish(d).await;
                }
            }
            let status_deadline = if self.wm.flushed() > self.last_sent_flush {
                self.next_periodic
                    .min(self.last_status_at + STATUS_COALESCE)
            } else {
                self.next_periodic
            };
            let drain_deadline = match &drain {
                Some(Drain::Shutdown(t)) | Some(Drain::PostgresLost(t, _)) => Some(*t),
                None => None,
            };
            let streaming = drain.is_none();
            let pg_alive = !matches!(drain, Some(Drain::PostgresLost(..)));
            let room = self.has_room();
            let next_retry = self.retries.peek().map(|Reverse((due, _))| *due);
            tokio::select! {
                biased;
                // PRIORITY 1: shutdown. Cancel safety: watch::Receiver::changed is cancel safe.
                changed = shutdown.changed(), if streaming => {
                    if changed.is_err() || *shutdown.borrow() {
                        tracing::info!(unconfirmed = self.wm.unconfirmed(), "shutdown requested; draining confirms");
                        drain = Some(Drain::Shutdown(Instant::now() + self.config.shutdown_timeout));
                    }
                }
                // PRIORITY 2: drain deadline. Cancel safety: sleep_until is cancel safe.
                _ = tokio::time::sleep_until(drain_deadline.unwrap_or_else(Instant::now)), if drain_deadline.is_some() => {
                    return match drain.take() {
                        Some(Drain::PostgresLost(_, e)) => Err(e),
                        _ => {
                            self.send_status(StatusUpdateKind::ShutdownFlush).await?;
                            Err(Error::ShutdownTimeout { unconfirmed: self.wm.unconfirmed(), flushed: self.wm.flushed() })
                        }
                    };
                }
                // PRIORITY 3: standby status update deadline. Cancel safety: sleep_until.
                _ = tokio::time::sleep_until(status_deadline), if pg_alive => {
                    if !publisher.is_connected() {
                        let _ = self.send_status(StatusUpdateKind::Periodic).await;
                        return Err(Error::BrokerLost("the RabbitMQ connection is closed".into()));
                    }
                    if let Err(e) = self.send_status(StatusUpdateKind::Periodic).await {
                        drain = self.on_error(e)?;
                    }
                    self.warn_if_stalled();
                }
                // PRIORITY 4: broker confirms. Cancel safety: mpsc recv is cancel safe.
                batch = publisher.recv_outcomes() => {
                    let batch = batch.ok_or(crate::publisher::Error::Closed)?;
                    self.apply_outcomes(batch, publisher).await?;
                }
                // PRIORITY 5: retries due. Cancel safety: sleep_until.
                _ = tokio::time::sleep_until(next_retry.unwrap_or_else(Instant::now)), if next_retry.is_some() => {
                    self.publish_due_retries(publisher)?;
                }
                // PRIORITY 6: new WAL, guarded by the window. Cancel safety: read_buf.
                read = self.stream.fill_not_before(self.next_read_at), if streaming && room && !buffered => {
                    match read {
                        Ok(n) => {
                            buffered = true;
                            // A small read means the stream is trickling: take the next
                            // one a little later, in one piece. Large reads (a backlog, big
                            // messages) are never delayed: a delay per read would cap the
                            // stream at about one socket buffer per interval.
                            if n < COALESCE_BELOW_BYTES {
                                self.next_read_at = Instant::now() + self.config.read_coalesce;
                            }
                        }
                        Err(e) => drain = self.on_error(e.into())?,
                    }
                }
                // PRIORITY 7: frames left in the buffer from a full batch.
                _ = std::future::ready(()), if streaming && room && buffered => {}
            }
        }
    }

    /// A replication-side failure: keep collecting confirms for a while (when any are
    /// outstanding) so a reconnect does not re-send what the broker already has.
    fn on_error(&mut self, e: Error) -> Result<Option<Drain>, Error> {
        match e {
            Error::Replication(_) if self.wm.unconfirmed() > 0 => {
                tracing::warn!(error = %e, unconfirmed = self.wm.unconfirmed(), "replication connection lost; collecting outstanding confirms before reconnecting");
                Ok(Some(Drain::PostgresLost(Instant::now() + PG_LOSS_DRAIN, e)))
            }
            e => Err(e),
        }
    }

    async fn finish(&mut self, drain: Drain) -> Result<(), Error> {
        match drain {
            Drain::Shutdown(_) => self.send_status(StatusUpdateKind::ShutdownFlush).await,
            Drain::PostgresLost(_, e) => Err(e),
        }
    }

    async fn handle_buffered(
        &mut self,
        publisher: &mut Publisher<u64>,
        buffered: &mut bool,
    ) -> Result<(), Error> {
        let mut handled = 0;
        while handled < FRAME_BATCH && self.has_room() {
            match self.stream.next_buffered()? {
                Some(msg) => {
                    self.handle(msg, publisher).await?;
                    handled += 1;
                }
                None => {
                    *buffered = false;
                    break;
                }
            }
        }
        Ok(())
    }

    /// Publishes (again) the in-flight message `seq`; `env` is its decoded envelope when the
    /// caller has it (first attempt), else it is decoded again from the kept content.
    fn publish(
        &mut self,
        seq: u64,
        env: Option<envelope::Envelope>,
        publisher: &mut Publisher<u64>,
    ) -> Result<(), Error> {
        let Some(m) = self.inflight.get_mut(&seq) else {
            return Ok(());
        };
        m.attempts += 1;
        let env = match env {
            Some(env) => env,
            None => {
                envelope::decode(m.content.clone()).map_err(|e| Error::Stream(e.to_string()))?
            }
        };
        let (routing_key, body, properties) =
            build_message(m.lsn, m.commit_lsn, m.commit_time_us, env).map_err(Error::Stream)?;
        publisher.publish(OutboundMessage {
            tag: seq,
            routing_key,
            body,
            properties,
            match_key: m.lsn.to_string(),
        })?;
        self.summary.published += 1;
        Ok(())
    }

    fn publish_due_retries(&mut self, publisher: &mut Publisher<u64>) -> Result<(), Error> {
        let now = Instant::now();
        while let Some(Reverse((due, seq))) = self.retries.peek().copied() {
            if due > now {
                break;
            }
            self.retries.pop();
            self.publish(seq, None, publisher)?;
        }
        Ok(())
    }

    async fn apply_outcomes(
        &mut self,
        batch: Vec<(u64, PublishOutcome)>,
        publisher: &mut Publisher<u64>,
    ) -> Result<(), Error> {
        for (seq, outcome) in batch {
            let Some(m) = self.inflight.get_mut(&seq) else {
                continue;
            };
            match outcome {
                PublishOutcome::Routed => {
                    let m = self
                        .inflight
                        .remove(&seq)
                        .ok_or_else(|| Error::Stream("lost in-flight record".into()))?;
                    self.settle(&m)?;
                    self.summary.confirmed += 1;
                    if let Some(Failpoint::AbortAfterConfirms(n)) = self.config.failpoint {
                        if self.summary.confirmed >= n {
                            tracing::error!(lsn = %m.lsn, confirmed = n, "failpoint abort-after-confirms: aborting");
                            std::process::abort();
                        }
                    }
                }
                PublishOutcome::Failed { error } => {
                    // The channel or connection failed: the outcome of every in-flight
                    // publish is unknown. Record what is settled and reconnect.
                    let _ = self.send_status(StatusUpdateKind::Periodic).await;
                    return Err(Error::BrokerLost(error));
                }
                PublishOutcome::Nacked => {
                    let error = format!("nacked by the broker (attempt {})", m.attempts);
                    m.first_error.get_or_insert_with(|| error.clone());
                    if m.attempts >= self.config.max_attempts {
                        self.dead_letter_inflight(seq, "nacked", &error).await?;
                    } else {
                        let delay = (NACK_RETRY_MIN
                            * 2u32.saturating_pow(m.attempts.saturating_sub(1)))
                        .min(NACK_RETRY_MAX);
                        tracing::warn!(lsn = %m.lsn, attempt = m.attempts, retry_in_ms = delay.as_millis() as u64, "message nacked by the broker; retrying");
                        self.retries.push(Reverse((Instant::now() + delay, seq)));
                    }
                }
                PublishOutcome::Returned {
                    reply_code,
                    reply_text,
                } => {
                    let topic = envelope::decode(m.content.clone())
                        .map(|e| e.topic)
                        .unwrap_or_default();
                    let error = format!("returned by the broker ({reply_code} {reply_text}): no queue is bound to exchange {:?} for routing key {topic:?}", self.config.exchange);
                    m.first_error.get_or_insert_with(|| error.clone());
                    match self.config.on_unroutable {
                        UnroutablePolicy::DeadLetter => {
                            self.dead_letter_inflight(seq, "returned", &error).await?;
                        }
                        UnroutablePolicy::Block => {
                            let delay = (NACK_RETRY_MIN * 2u32.saturating_pow(m.attempts.min(16)))
                                .min(BLOCK_RETRY_MAX);
                            tracing::error!(
                                lsn = %m.lsn,
                                attempt = m.attempts,
                                retry_in_ms = delay.as_millis() as u64,
                                error = %error,
                                "unroutable message blocks the outbox (--on-unroutable block): bind a queue for its routing key or switch to --on-unroutable dead-letter; nothing after it is acknowledged"
                            );
                            self.retries.push(Reverse((Instant::now() + delay, seq)));
                        }
                    }
                }
            }
        }
        // Retries scheduled with no delay go out now.
        self.publish_due_retries(publisher)
    }

    /// Logs a warning, at most every [`STALL_WARNING`], while messages stay unconfirmed
    /// with no progress for longer than that (a blocked or silent broker).
    fn warn_if_stalled(&mut self) {
        let now = Instant::now();
        if self.wm.unconfirmed() == 0 {
            self.last_progress = now;
            return;
        }
        let stalled = now.duration_since(self.last_progress);
        if stalled >= STALL_WARNING && now.duration_since(self.last_stall_warning) >= STALL_WARNING
        {
            self.last_stall_warning = now;
            tracing::warn!(
                stalled_s = stalled.as_secs(),
                unconfirmed = self.wm.unconfirmed(),
                window_full = !self.has_room(),
                flushed_lsn = %self.wm.flushed(),
                received_lsn = %self.received,
                "no broker confirm for a while: the broker may be blocked (memory or disk alarm) or unreachable; nothing unconfirmed is acknowledged"
            );
        }
    }

    /// A message is settled (routed or dead-lettered): release its window share and let the
    /// watermark count it.
    fn settle(&mut self, m: &InFlight) -> Result<(), Error> {
        self.last_progress = Instant::now();
        self.bytes_in_flight = self.bytes_in_flight.saturating_sub(m.bytes);
        self.wm
            .confirm(m.txn)
            .map_err(|e| Error::Stream(e.to_string()))
    }

    async fn dead_letter_inflight(
        &mut self,
        seq: u64,
        reason: &str,
        error: &str,
    ) -> Result<(), Error> {
        let m = self
            .inflight
            .remove(&seq)
            .ok_or_else(|| Error::Stream("lost in-flight record".into()))?;
        let env = envelope::decode(m.content.clone()).ok();
        admin::write_dead_letter(
            &self.sql,
            &admin::NewDeadLetter {
                message_id: env.as_ref().map(|e| e.message_id.as_str()),
                topic: env.as_ref().map(|e| e.topic.as_str()),
                lsn: m.lsn,
                commit_lsn: Some(m.commit_lsn),
                envelope: &m.content,
                reason,
                attempts: i32::try_from(m.attempts).unwrap_or(i32::MAX),
                first_error: m.first_error.as_deref(),
                last_error: error,
            },
        )
        .await?;
        tracing::error!(
            lsn = %m.lsn,
            message_id = env.as_ref().map(|e| e.message_id.as_str()).unwrap_or("-"),
            reason,
            attempts = m.attempts,
            error,
            "message dead-lettered to outbox.dead_letter (inspect with `pgoutbox dead-letters list`)"
        );
        self.summary.dead_lettered += 1;
        self.settle(&m)
    }

    /// Dead-letters a message that is never published (poison, too large). It has no
    /// watermark entry: it is durable before the loop handles the next frame.
    async fn dead_letter_unpublished(
        &mut self,
        lsn: Lsn,
        commit_lsn: Option<Lsn>,
        content: &Bytes,
        reason: &str,
        error: &str,
    ) -> Result<(), Error> {
        let env = envelope::decode(content.clone()).ok();
        admin::write_dead_letter(
            &self.sql,
            &admin::NewDeadLetter {
                message_id: env.as_ref().map(|e| e.message_id.as_str()),
                topic: env.as_ref().map(|e| e.topic.as_str()),
                lsn,
                commit_lsn,
                envelope: content,
                reason,
                attempts: 0,
                first_error: Some(error),
                last_error: error,
            },
        )
        .await?;
        tracing::error!(
            lsn = %lsn,
            reason,
            error,
            "message dead-lettered to outbox.dead_letter without publishing (inspect with `pgoutbox dead-letters list`)"
        );
        self.summary.dead_lettered += 1;
        Ok(())
    }

    async fn send_status(&mut self, kind: StatusUpdateKind) -> Result<(), Error> {
        let flush = self.wm.flushed();
        debug_assert!(flush >= self.last_sent_flush, "flush LSN moved backwards");
        let update = StandbyStatusUpdate {
            write: self.received.max(flush),
            flush,
            apply: flush,
            client_time_us: now_pg_time_us(),
            kind,
        };
        self.stream.send_status(&update).await?;
        if flush != self.last_sent_flush {
            tracing::debug!(flush_lsn = %flush, "standby status update");
        }
        self.last_sent_flush = flush;
        self.last_status_at = Instant::now();
        self.next_periodic = self.last_status_at + self.interval;
        Ok(())
    }

    async fn handle(
        &mut self,
        msg: ReplicationMessage,
        publisher: &mut Publisher<u64>,
    ) -> Result<(), Error> {
        match msg {
            ReplicationMessage::PrimaryKeepalive {
                wal_end,
                reply_requested,
                ..
            } => {
                self.received = self.received.max(wal_end);
                // Every XLogData before this keepalive has been handled (frames are handled
                // in arrival order), so an idle watermark may move to walEnd.
                let moved = self.wm.keepalive(wal_end);
                tracing::trace!(wal_end = %wal_end, moved, reply_requested, "primary keepalive");
                if reply_requested {
                    self.send_status(StatusUpdateKind::KeepaliveReply).await?;
                }
            }
            ReplicationMessage::XLogData { data, .. } => {
                self.handle_logical(data, publisher).await?
            }
        }
        Ok(())
    }

    async fn handle_logical(
        &mut self,
        data: Bytes,
        publisher: &mut Publisher<u64>,
    ) -> Result<(), Error> {
        let decoded = pgoutput::decode(data).map_err(|e| Error::Stream(e.to_string()))?;
        match decoded {
            LogicalMessage::Begin(b) => {
                tracing::trace!(final_lsn = %b.final_lsn, "begin");
                self.wm.begin().map_err(|e| Error::Stream(e.to_string()))?;
                self.current_txn =
                    Some((b.final_lsn, pgoutput::pg_time_to_unix_us(b.commit_time_us)));
            }
            LogicalMessage::Commit(c) => {
                tracing::trace!(end_lsn = %c.end_lsn, "commit");
                self.wm
                    .commit(c.end_lsn)
                    .map_err(|e| Error::Stream(e.to_string()))?;
                self.received = self.received.max(c.end_lsn);
                self.current_txn = None;
            }
            LogicalMessage::Message(m) if m.has_prefix(MESSAGE_PREFIX.as_bytes()) => {
                let Some((commit_lsn, commit_time_us)) =
                    self.current_txn.filter(|_| m.transactional)
                else {
                    return self
                        .dead_letter_unpublished(m.lsn, None, &m.content, "poison", "non-transactional logical message with prefix pgoutbox (outbox.emit never writes one)")
                        .await;
                };
                if m.content.len() > self.config.max_message_bytes {
                    let error = format!(
                        "message of {} bytes exceeds --max-message-bytes {}",
                        m.content.len(),
                        self.config.max_message_bytes
                    );
                    return self
                        .dead_letter_unpublished(
                            m.lsn,
                            Some(commit_lsn),
                            &m.content,
                            "too_large",
                            &error,
                        )
                        .await;
                }
                let env = match envelope::decode(m.content.clone()) {
                    Ok(env) => env,
                    Err(reason) => {
                        let error = format!("undecodable outbox message (poison): {reason}");
                        return self
                            .dead_letter_unpublished(
                                m.lsn,
                                Some(commit_lsn),
                                &m.content,
                                "poison",
                                &error,
                            )
                            .await;
                    }
                };
                let txn = self
                    .wm
                    .add_message()
                    .map_err(|e| Error::Stream(e.to_string()))?;
                let bytes = m.content.len();
                self.bytes_in_flight += bytes;
                let seq = self.next_seq;
                self.next_seq += 1;
                self.inflight.insert(
                    seq,
                    InFlight {
                        txn,
                        lsn: m.lsn,
                        commit_lsn,
                        commit_time_us,
                        content: m.content,
                        bytes,
                        attempts: 0,
                        first_error: None,
                    },
                );
                self.publish(seq, Some(env), publisher)?;
            }
            LogicalMessage::Message(_) | LogicalMessage::Other { .. } => {}
        }
        Ok(())
    }
}

/// Maps one envelope to routing key, body and AMQP properties.
fn build_message(
    lsn: Lsn,
    commit_lsn: Lsn,
    commit_time_us: i64,
    env: envelope::Envelope,
) -> Result<(ShortString, Bytes, BasicProperties), String> {
    let routing_key = ShortString::try_new(env.topic).map_err(|e| e.to_string())?;
    let message_id = ShortString::try_new(env.message_id).map_err(|e| e.to_string())?;
    let content_type = ShortString::try_new(env.content_type).map_err(|e| e.to_string())?;
    let mut headers = headers_from_json(&env.headers);
    insert_text(&mut headers, HEADER_LSN, lsn.to_string());
    insert_text(&mut headers, HEADER_COMMIT_LSN, commit_lsn.to_string());
    insert_i64(&mut headers, HEADER_COMMIT_TIME_US, commit_time_us);
    let properties = BasicProperties::default()
        .with_message_id(message_id)
        .with_content_type(content_type)
        .with_delivery_mode(DELIVERY_MODE_PERSISTENT)
        .with_timestamp(u64::try_from(commit_time_us / 1_000_000).unwrap_or(0))
        .with_headers(headers);
    Ok((routing_key, env.payload, properties))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_pg_durations() {
        assert_eq!(parse_pg_duration("1min"), Some(Duration::from_secs(60)));
        assert_eq!(parse_pg_duration("10s"), Some(Duration::from_secs(10)));
        assert_eq!(parse_pg_duration("500ms"), Some(Duration::from_millis(500)));
        assert_eq!(parse_pg_duration("0"), Some(Duration::ZERO));
        assert_eq!(parse_pg_duration("abc"), None);
    }

    #[test]
    fn status_interval_stays_well_inside_the_timeout() {
        assert_eq!(
            status_interval(Some(Duration::from_secs(60))),
            Duration::from_secs(10)
        );
        assert_eq!(
            status_interval(Some(Duration::from_secs(5))).as_millis(),
            1666
        );
        assert_eq!(status_interval(Some(Duration::ZERO)), MAX_STATUS_INTERVAL);
        assert_eq!(status_interval(None), MAX_STATUS_INTERVAL);
    }
}
