//! The main loop: one `select!` with written priorities, and frame handling.
//!
//! Every change of a message's state happens in this file, in four places: a message is
//! read and published ([`Core::handle_logical`]), its broker outcome is applied
//! ([`Core::apply_outcomes`]: routed, nacked, returned, failed), its dead letter is
//! committed ([`Core::on_dead_letter_written`]), and a due retry is published again
//! ([`Core::publish_due_retries`]). Each settle goes through [`Core::settle`], the only
//! caller of [`AckWatermark::confirm`].

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use tokio::sync::watch;
use tokio::time::Instant;

use super::dead_letter::{DeadLetterWriter, Job, Written};
use super::driver::BrokerLimit;
use super::feedback::{Feedback, StallWatch};
use super::in_flight::{InFlight, InFlightTable, Seq};
use super::journal::JournalHandle;
use super::RunSummary;
use crate::config::{Failpoint, RunConfig, UnroutablePolicy};
use crate::envelope;
use crate::error::Error;
use crate::lockdown::{self, Lockdown, MarkerEffect};
use crate::lsn::Lsn;
use crate::metrics::{unix_now_us, LatencyBatch, Phase, Telemetry, Turn};
use crate::pgoutput::{self, LogicalMessage};
use crate::publisher::{PublishOutcome, Publisher};
use crate::replication::session::ReplicationStream;
use crate::replication::stream::{ReplicationMessage, StatusUpdateKind};
use crate::routing::{self, Router};
use crate::stream_state::FlushGate;
use crate::watermark::AckWatermark;

/// Frames handled per loop turn before confirms and timers get another look.
const FRAME_BATCH: usize = 2048;
/// With `--read-coalesce-us` above 0 (off by default), a read of fewer bytes than this,
/// while at least [`COALESCE_MIN_UNCONFIRMED`] publishes are unconfirmed, delays the next one
/// by `RunConfig::read_coalesce`.
const COALESCE_BELOW_BYTES: usize = 64 * 1024;
/// Unconfirmed publishes from which small reads are coalesced. What is unconfirmed is about
/// the rate times the broker's confirm latency (~1 ms): at low rates fewer than this are in
/// flight and every message is read and published at once (latency first); at higher rates
/// one read per interval covers many transactions (CPU first).
const COALESCE_MIN_UNCONFIRMED: usize = 4;
/// Retry delay bounds for a nacked message (doubling from the minimum).
const NACK_RETRY_MIN: Duration = Duration::from_millis(100);
const NACK_RETRY_MAX: Duration = Duration::from_secs(5);
/// Retry delay bound for a returned message under `--on-unroutable block`.
const BLOCK_RETRY_MAX: Duration = Duration::from_secs(30);
/// How long the final standby status update of a shutdown waits for the flush LSN to be
/// recorded in `outbox.stream_state` (it reports what is recorded by then).
const RECORD_SETTLE_TIMEOUT: Duration = Duration::from_secs(2);

/// Why the loop is draining.
enum Drain {
    /// SIGINT/SIGTERM: drain, send the final status update, return `Ok`.
    Shutdown(Instant),
    /// The Postgres connection broke: collect confirms for a while, then return the error.
    PostgresLost(Instant, Error),
}

/// One session's streaming state.
pub(super) struct Core {
    stream: ReplicationStream,
    dead_letters: DeadLetterWriter,
    config: RunConfig,
    wm: AckWatermark,
    /// Highest WAL position seen (commit ends and keepalive ends): the "write" position.
    received: Lsn,
    feedback: Feedback,
    /// What `outbox.stream_state` holds: status updates report no flush LSN beyond it.
    gate: FlushGate,
    stall: StallWatch,
    /// The next read of a trickling stream waits until then (see `RunConfig::read_coalesce`).
    next_read_at: Instant,
    /// Begin of the open transaction: (commit record LSN, commit time µs since Unix epoch).
    current_txn: Option<(Lsn, i64)>,
    in_flight: InFlightTable,
    /// The broker's message size limit, when known.
    broker_limit: Option<BrokerLimit>,
    summary: RunSummary,
    /// The server's end of WAL as last reported (keepalive and XLogData `walEnd`).
    server_wal_end: Lsn,
    /// Metrics and probe state, written once per turn.
    telemetry: Arc<Telemetry>,
    /// Confirm latencies of this turn, added to the histogram at its end.
    latency: LatencyBatch,
    /// Whether `setup --lockdown` is in effect, from the record read at session start and
    /// the markers seen since (see [`crate::lockdown`] for why that is exact).
    lockdown: Lockdown,
    /// Which exchange each message goes to (`--exchange`, `--allowed-exchanges`).
    router: Router,
    /// The logical-message prefix published (the outbox's, [`crate::outbox_schema`]);
    /// messages with other prefixes are acknowledged without publishing.
    prefix: crate::outbox_schema::MessagePrefix,
    /// The delivery journal (`--journal`; a no-op when off).
    journal: JournalHandle,
}

impl Core {
    // One argument per thing a session hands over; a struct for them would only be unpacked
    // here.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        config: RunConfig,
        stream: ReplicationStream,
        dead_letters: DeadLetterWriter,
        start: Lsn,
        interval: Duration,
        gate: FlushGate,
        broker_limit: Option<BrokerLimit>,
        summary: RunSummary,
        telemetry: Arc<Telemetry>,
        lockdown: Lockdown,
        prefix: crate::outbox_schema::MessagePrefix,
        journal: JournalHandle,
    ) -> Self {
        let stall = StallWatch::new(config.observability.stall_after);
        let router = Router::new(
            config.broker.exchange.clone(),
            config.broker.allowed_exchanges.clone(),
        );
        Core {
            router,
            stream,
            dead_letters,
            config,
            wm: AckWatermark::new(start),
            received: start,
            feedback: Feedback::new(interval),
            gate,
            stall,
            next_read_at: Instant::now(),
            current_txn: None,
            in_flight: InFlightTable::default(),
            broker_limit,
            summary,
            server_wal_end: start,
            telemetry,
            latency: LatencyBatch::default(),
            lockdown,
            prefix,
            journal,
        }
    }

    /// Reports this turn to the metrics (counters, gauges, latencies, the stall clock and
    /// the heartbeat): a few relaxed atomic stores, once per turn, never per message.
    fn report_turn(&mut self) {
        // Once per turn: ask the recorder to record where the watermark is now.
        self.gate.want(self.wm.flushed());
        let now = Instant::now();
        let unconfirmed = self.wm.unconfirmed();
        if let Some(at) = self.stall.turn(unconfirmed, now) {
            self.telemetry.progress_at(at.into_std());
        }
        let backlog = self.wm.backlog();
        let turn = Turn {
            published: self.summary.published,
            retried: self.summary.retried,
            confirmed: self.summary.confirmed,
            unacknowledged_messages: backlog.messages,
            unacknowledged_bytes: backlog.bytes,
            unconfirmed,
            flush_lsn: self.feedback.last_sent_flush().0,
            received_lsn: self.received.0,
            server_wal_end: self.server_wal_end.0,
            oldest_commit_time_us: self.in_flight.oldest().map(|m| m.commit_time_us),
        };
        self.telemetry.turn(&turn, &mut self.latency);
    }

    /// The LSN known to be settled.
    pub fn flushed(&self) -> Lsn {
        self.wm.flushed()
    }

    /// Messages not settled.
    pub fn unsettled(&self) -> u64 {
        self.wm.unconfirmed()
    }

    /// The broker's size limit, when known (perhaps learned in this session).
    pub fn broker_limit(&self) -> Option<BrokerLimit> {
        self.broker_limit.clone()
    }

    /// The stream, the writer and the summary (with the last flush LSN reported).
    pub fn into_parts(self) -> (ReplicationStream, DeadLetterWriter, RunSummary) {
        let mut summary = self.summary;
        summary.flushed = self.feedback.last_sent_flush();
        (self.stream, self.dead_letters, summary)
    }

    /// Room in the window: what is not yet acknowledged stays under `--max-in-flight`
    /// messages and `--max-in-flight-bytes` payload bytes.
    fn has_room(&self) -> bool {
        let backlog = self.wm.backlog();
        backlog.messages < self.config.bounds.max_in_flight as u64
            && backlog.bytes < self.config.bounds.max_in_flight_bytes as u64
    }

    /// The main loop: one `select!` with written priorities.
    ///
    /// Priorities (highest first):
    /// 1. shutdown signal (stop reading, start the bounded drain);
    /// 2. the drain deadline;
    /// 3. the status update deadline, which also checks the broker connection (never starved
    ///    by confirms or WAL);
    /// 4. the broker connection: buffered publishes written, confirm outcomes read (a batch
    ///    per turn);
    /// 5. committed dead letters;
    /// 6. retries that are due;
    /// 7. new WAL from the socket, only while the window has room;
    /// 8. frames already buffered (when a turn's frame batch ran out).
    pub async fn run_loop(
        &mut self,
        publisher: &mut Publisher<Seq>,
        mut shutdown: watch::Receiver<bool>,
    ) -> Result<(), Error> {
        let mut drain: Option<Drain> = None;
        if *shutdown.borrow() {
            drain = Some(Drain::Shutdown(
                Instant::now() + self.config.bounds.shutdown_timeout,
            ));
            self.telemetry.set_phase(Phase::Draining);
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
            let status_deadline = self
                .feedback
                .deadline(self.wm.flushed().min(self.gate.allowed()));
            let drain_deadline = match &drain {
                Some(Drain::Shutdown(t)) | Some(Drain::PostgresLost(t, _)) => Some(*t),
                None => None,
            };
            let streaming = drain.is_none();
            let pg_alive = !matches!(drain, Some(Drain::PostgresLost(..)));
            let room = self.has_room();
            let next_retry = self.in_flight.next_retry();
            let writing = self.dead_letters.pending() > 0;
            self.report_turn();
            tokio::select! {
                biased;
                // PRIORITY 1: shutdown. Cancel safety: watch::Receiver::changed is cancel safe.
                changed = shutdown.changed(), if streaming => {
                    if changed.is_err() || *shutdown.borrow() {
                        tracing::info!(unconfirmed = self.wm.unconfirmed(), "shutdown requested; draining confirms");
                        drain = Some(Drain::Shutdown(Instant::now() + self.config.bounds.shutdown_timeout));
                        self.telemetry.set_phase(Phase::Draining);
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
                    self.warn_if_stalled(room);
                }
                // PRIORITY 3b: the recorder committed a new flush LSN: wake, so the status
                // deadline above is computed again (an update then goes out promptly).
                // Cancel safety: FlushGate::recorded_changed is cancel safe.
                _ = self.gate.recorded_changed(), if pg_alive => {}
                // PRIORITY 4: the broker connection: writes what publish() encoded, reads
                // confirms and returns. Cancel safety: Publisher::recv_outcomes is cancel safe.
                batch = publisher.recv_outcomes() => {
                    match batch {
                        Ok(batch) => self.apply_outcomes(batch, publisher).await?,
                        Err(e) => {
                            let _ = self.send_status(StatusUpdateKind::Periodic).await;
                            return Err(match e {
                                crate::publisher::Error::Lost(reason) => Error::BrokerLost(reason),
                                e => e.into(),
                            });
                        }
                    }
                }
                // PRIORITY 5: committed dead letters. Cancel safety: mpsc recv is cancel safe.
                written = self.dead_letters.next_written(), if writing => {
                    self.on_dead_letter_written(written?)?;
                }
                // PRIORITY 6: retries due. Cancel safety: sleep_until.
                _ = tokio::time::sleep_until(next_retry.unwrap_or_else(Instant::now)), if next_retry.is_some() => {
                    self.publish_due_retries(publisher)?;
                }
                // PRIORITY 7: new WAL, guarded by the window. Cancel safety: read_buf.
                read = self.stream.fill_not_before(self.next_read_at), if streaming && room && !buffered => {
                    match read {
                        Ok(n) => {
                            buffered = true;
                            // Opt-in (`--read-coalesce-us`, default 0): a small read while
                            // several publishes are unconfirmed means a steady stream, so the
                            // next read is taken a little later, in one piece. With few in
                            // flight (a low rate) the next message is read and published at
                            // once. Large reads (a backlog, big messages) are never delayed: a
                            // delay per read would cap the stream at about one socket buffer
                            // per interval.
                            if !self.config.bounds.read_coalesce.is_zero()
                                && n < COALESCE_BELOW_BYTES
                                && self.wm.unconfirmed() >= COALESCE_MIN_UNCONFIRMED as u64
                            {
                                self.next_read_at = Instant::now() + self.config.bounds.read_coalesce;
                            }
                        }
                        Err(e) => drain = self.on_error(e.into())?,
                    }
                }
                // PRIORITY 8: frames left in the buffer from a full batch.
                _ = std::future::ready(()), if streaming && room && buffered => {}
            }
        }
    }

    /// A replication-side failure: keep collecting confirms for a while (when any are
    /// outstanding) so a reconnect does not re-send what the broker already has.
    fn on_error(&mut self, e: Error) -> Result<Option<Drain>, Error> {
        match e {
            Error::Replication(_) | Error::StreamStateLost if self.wm.unconfirmed() > 0 => {
                tracing::warn!(error = %e, unconfirmed = self.wm.unconfirmed(), "replication connection lost; collecting outstanding confirms before reconnecting");
                self.telemetry.set_phase(Phase::ReplicationLost);
                Ok(Some(Drain::PostgresLost(
                    Instant::now() + self.config.bounds.postgres_loss_drain,
                    e,
                )))
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
        publisher: &mut Publisher<Seq>,
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
        seq: Seq,
        env: Option<envelope::Envelope>,
        publisher: &mut Publisher<Seq>,
    ) -> Result<(), Error> {
        let Some(m) = self.in_flight.get_mut(seq) else {
            return Ok(());
        };
        m.attempts += 1;
        let env = match env {
            Some(env) => env,
            None => m.envelope().map_err(|e| Error::Stream(e.to_string()))?,
        };
        // Checked before the first publish too (handle_logical): a refusal here means the
        // record changed, which it does not; dead-letter rather than stop.
        let exchange = match self.router.route(env.exchange.as_deref()) {
            Ok(exchange) => exchange,
            Err(refusal) => return self.dead_letter_in_flight(seq, refusal.reason, refusal.error),
        };
        let message = m
            .to_outbound(
                seq,
                env,
                exchange,
                self.config.publishing.publish_properties,
                self.config.publishing.cloudevents.as_ref(),
            )
            .map_err(Error::Stream)?;
        match publisher.publish(message) {
            Ok(()) => {
                self.summary.published += 1;
                Ok(())
            }
            // Its content header does not fit one frame of this broker: it never will.
            Err(crate::publisher::Error::Unsendable(error)) => {
                self.dead_letter_in_flight(seq, "too_large", error)
            }
            Err(crate::publisher::Error::Lost(reason)) => Err(Error::BrokerLost(reason)),
            Err(e) => Err(e.into()),
        }
    }

    fn publish_due_retries(&mut self, publisher: &mut Publisher<Seq>) -> Result<(), Error> {
        for seq in self.in_flight.take_due(Instant::now()) {
            self.summary.retried += 1;
            self.publish(seq, None, publisher)?;
        }
        Ok(())
    }

    async fn apply_outcomes(
        &mut self,
        batch: Vec<(Seq, PublishOutcome)>,
        publisher: &mut Publisher<Seq>,
    ) -> Result<(), Error> {
        let now_us = unix_now_us();
        for (seq, outcome) in batch {
            let Some(m) = self.in_flight.get_mut(seq) else {
                continue;
            };
            match outcome {
                PublishOutcome::Routed => {
                    let m = self
                        .in_flight
                        .remove(seq)
                        .ok_or_else(|| Error::Stream("lost in-flight record".into()))?;
                    self.settle(&m)?;
                    // After the settle: the journal never holds back acknowledgement.
                    self.journal.record(&m, now_us);
                    self.summary.confirmed += 1;
                    self.latency.observe_us(now_us - m.commit_time_us);
                    if let Some(Failpoint::AbortAfterConfirms(n)) = self.config.failpoint {
                        if self.summary.confirmed >= n {
                            tracing::error!(lsn = %m.lsn, confirmed = n, "failpoint abort-after-confirms: aborting");
                            std::process::abort();
                        }
                    }
                }
                PublishOutcome::Failed { error } => {
                    // The channel or connection failed: the outcome of every in-flight
                    // publish is unknown. Record what is settled and reconnect. When the
                    // broker closed the channel over a message's size, remember its limit:
                    // the next session dead-letters what exceeds it instead of looping.
                    if let Some(limit) = broker_limit_from_close(&error) {
                        tracing::warn!(max_message_bytes = limit.max_bytes, error = %error, "RabbitMQ refused a message for its size and closed the channel; messages over its max_message_size will be dead-lettered as too_large");
                        self.broker_limit = Some(limit);
                    }
                    let _ = self.send_status(StatusUpdateKind::Periodic).await;
                    return Err(Error::BrokerLost(error));
                }
                PublishOutcome::ExchangeRefused {
                    exchange,
                    reply_code,
                    reply_text,
                } => {
                    let passive = self.config.broker.exchange_declare
                        == crate::config::ExchangeDeclare::Passive;
                    let refusal = routing::refused(&exchange, reply_code, &reply_text, passive);
                    m.first_error.get_or_insert_with(|| refusal.error.clone());
                    self.dead_letter_in_flight(seq, refusal.reason, refusal.error)?;
                }
                PublishOutcome::Unsendable { error } => {
                    self.dead_letter_in_flight(seq, "too_large", error)?;
                }
                PublishOutcome::Nacked => {
                    self.telemetry.nacked();
                    let error = format!("nacked by the broker (attempt {})", m.attempts);
                    m.first_error.get_or_insert_with(|| error.clone());
                    if m.attempts >= self.config.bounds.max_attempts {
                        self.dead_letter_in_flight(seq, "nacked", error)?;
                    } else {
                        let delay = (NACK_RETRY_MIN
                            * 2u32.saturating_pow(m.attempts.saturating_sub(1)))
                        .min(NACK_RETRY_MAX);
                        let message_id = envelope::decode(m.content.clone())
                            .map(|e| e.message_id)
                            .unwrap_or_default();
                        tracing::warn!(lsn = %m.lsn, message_id = %message_id, attempt = m.attempts, retry_in_ms = delay.as_millis() as u64, "message nacked by the broker; retrying");
                        self.in_flight.retry_at(seq, Instant::now() + delay);
                    }
                }
                PublishOutcome::Returned {
                    reply_code,
                    reply_text,
                } => {
                    self.telemetry.returned();
                    let (topic, message_id, exchange) = envelope::decode(m.content.clone())
                        .map(|e| (e.topic, e.message_id, e.exchange))
                        .unwrap_or_default();
                    let exchange = exchange.unwrap_or_else(|| self.config.broker.exchange.clone());
                    let error = format!("returned by the broker ({reply_code} {reply_text}): no queue is bound to exchange {exchange:?} for routing key {topic:?}");
                    m.first_error.get_or_insert_with(|| error.clone());
                    match self.config.publishing.on_unroutable {
                        UnroutablePolicy::DeadLetter => {
                            self.dead_letter_in_flight(seq, "returned", error)?;
                        }
                        UnroutablePolicy::Block => {
                            let delay = (NACK_RETRY_MIN * 2u32.saturating_pow(m.attempts.min(16)))
                                .min(BLOCK_RETRY_MAX);
                            tracing::error!(
                                lsn = %m.lsn,
                                message_id = %message_id,
                                attempt = m.attempts,
                                retry_in_ms = delay.as_millis() as u64,
                                error = %error,
                                "unroutable message blocks the outbox (--on-unroutable block): bind a queue for its routing key or switch to --on-unroutable dead-letter; nothing after it is acknowledged"
                            );
                            self.in_flight.retry_at(seq, Instant::now() + delay);
                        }
                    }
                }
            }
        }
        // Retries scheduled with no delay go out now.
        self.publish_due_retries(publisher)
    }

    /// Logs a warning, at most once a minute (`STALL_WARNING`), while messages stay
    /// unconfirmed with no settle for `--stall-after-s` (a blocked or silent broker, a locked
    /// dead-letter table, an unroutable message under `--on-unroutable block`).
    fn warn_if_stalled(&mut self, room: bool) {
        let unconfirmed = self.wm.unconfirmed();
        if let Some(stalled) = self.stall.check(unconfirmed, Instant::now()) {
            let backlog = self.wm.backlog();
            let oldest = self.in_flight.oldest();
            let oldest_lsn = oldest
                .map(|m| m.lsn.to_string())
                .unwrap_or_else(|| "-".into());
            let oldest_age_s = oldest
                .map(|m| (unix_now_us() - m.commit_time_us).max(0) / 1_000_000)
                .unwrap_or(0);
            tracing::warn!(
                stalled_s = stalled.as_secs(),
                unconfirmed,
                unacknowledged = backlog.messages,
                oldest_lsn = %oldest_lsn,
                oldest_age_s,
                broker_blocked = self.telemetry.is_broker_blocked(),
                window_full = !room,
                flushed_lsn = %self.wm.flushed(),
                received_lsn = %self.received,
                "stalled: no message settled for --stall-after-s; the broker may be blocked (memory or disk alarm) or unreachable, or a message is blocked; nothing unsettled is acknowledged"
            );
        }
    }

    /// A message is settled (routed or dead-lettered): the watermark counts it.
    fn settle(&mut self, m: &InFlight) -> Result<(), Error> {
        self.settle_txn(m.txn, m.bytes())
    }

    fn settle_txn(&mut self, txn: crate::watermark::TxnSeq, bytes: u64) -> Result<(), Error> {
        self.stall.progress();
        self.wm
            .confirm(txn, bytes)
            .map_err(|e| Error::Stream(e.to_string()))?;
        if self.wm.is_idle() && self.wm.flushed() < self.received {
            // Turned idle behind the newest WAL seen: ask for a keepalive soon (idle probe).
            self.feedback.expedite();
        }
        Ok(())
    }

    /// Hands the in-flight message `seq` to the dead-letter writer; it stays unsettled (and
    /// in the table, for a retry that is already scheduled to find nothing) until written.
    fn dead_letter_in_flight(
        &mut self,
        seq: Seq,
        reason: &'static str,
        error: String,
    ) -> Result<(), Error> {
        let m = self
            .in_flight
            .remove(seq)
            .ok_or_else(|| Error::Stream("lost in-flight record".into()))?;
        let env = envelope::decode(m.content.clone()).ok();
        let bytes = m.bytes();
        self.dead_letters.write(Job {
            seq: Some(seq),
            txn: m.txn,
            bytes,
            message_id: env.as_ref().map(|e| e.message_id.clone()),
            topic: env.as_ref().map(|e| e.topic.clone()),
            lsn: m.lsn,
            commit_lsn: Some(m.commit_lsn),
            envelope: m.content,
            reason,
            attempts: m.attempts,
            first_error: m.first_error,
            last_error: error,
        })
    }

    /// Hands a message that is never published (poison, too large) to the dead-letter
    /// writer; it holds the watermark until written.
    fn dead_letter_unpublished(
        &mut self,
        lsn: Lsn,
        commit_lsn: Option<Lsn>,
        content: Bytes,
        reason: &'static str,
        error: String,
    ) -> Result<(), Error> {
        let env = envelope::decode(content.clone()).ok();
        let bytes = content.len() as u64;
        let txn = self.wm.hold(bytes);
        self.dead_letters.write(Job {
            seq: None,
            txn,
            bytes,
            message_id: env.as_ref().map(|e| e.message_id.clone()),
            topic: env.as_ref().map(|e| e.topic.clone()),
            lsn,
            commit_lsn,
            envelope: content,
            reason,
            attempts: 0,
            first_error: Some(error.clone()),
            last_error: error,
        })
    }

    /// The dead letter's error for a `forged` message at `lsn` that is `what`.
    fn forged_error(&self, lsn: Lsn, what: &str) -> String {
        format!(
            "forged: the outbox message at {lsn} is {what}, written after the lockdown at {} (setup --lockdown); outbox.emit/emit_bytes never write that, so it was written with pg_logical_emit_message directly (by a superuser, or by a call that raced the lockdown)",
            self.lockdown.since().unwrap_or_default()
        )
    }

    /// A dead letter is committed: settle its message.
    fn on_dead_letter_written(&mut self, written: Written) -> Result<(), Error> {
        let job = written.job;
        tracing::error!(
            lsn = %job.lsn,
            message_id = job.message_id.as_deref().unwrap_or("-"),
            reason = job.reason,
            attempts = job.attempts,
            error = %job.last_error,
            published = job.seq.is_some(),
            schema = %self.config.postgres.schema,
            "message dead-lettered to {}.dead_letter (inspect with `pgoutbox dead-letters list{}`)",
            self.config.postgres.schema,
            crate::admin::schema_flag(&self.config.postgres.schema)
        );
        self.summary.dead_lettered += 1;
        self.telemetry.dead_lettered(job.reason);
        self.settle_txn(job.txn, job.bytes)
    }

    async fn send_status(&mut self, kind: StatusUpdateKind) -> Result<(), Error> {
        let recorded = if kind == StatusUpdateKind::ShutdownFlush {
            self.gate
                .settle(self.wm.flushed(), RECORD_SETTLE_TIMEOUT)
                .await
        } else {
            self.gate.allowed()
        };
        if self.gate.recorder_gone() && self.wm.flushed() > recorded {
            // Report what is recorded, then end the session (the reconnect records anew).
            let update = self
                .feedback
                .update(&self.wm, self.received, recorded, kind);
            let _ = self.stream.send_status(&update).await;
            self.feedback.sent(&update);
            return Err(Error::StreamStateLost);
        }
        let update = self
            .feedback
            .update(&self.wm, self.received, recorded, kind);
        self.stream.send_status(&update).await?;
        self.feedback.sent(&update);
        self.telemetry.status_sent();
        Ok(())
    }

    async fn handle(
        &mut self,
        msg: ReplicationMessage,
        publisher: &mut Publisher<Seq>,
    ) -> Result<(), Error> {
        match msg {
            ReplicationMessage::PrimaryKeepalive {
                wal_end,
                reply_requested,
                ..
            } => {
                self.received = self.received.max(wal_end);
                self.server_wal_end = self.server_wal_end.max(wal_end);
                // Every XLogData before this keepalive has been handled (frames are handled
                // in arrival order), so an idle watermark may move to walEnd.
                let moved = self.wm.keepalive(wal_end);
                tracing::trace!(wal_end = %wal_end, moved, reply_requested, "primary keepalive");
                if reply_requested {
                    self.send_status(StatusUpdateKind::KeepaliveReply).await?;
                }
            }
            ReplicationMessage::XLogData {
                wal_start,
                wal_end,
                data,
                ..
            } => {
                self.server_wal_end = self.server_wal_end.max(wal_end);
                self.handle_logical(wal_start, data, publisher)?
            }
        }
        Ok(())
    }

    fn handle_logical(
        &mut self,
        wal_start: Lsn,
        data: Bytes,
        publisher: &mut Publisher<Seq>,
    ) -> Result<(), Error> {
        let decoded = pgoutput::decode(data).map_err(|e| Error::Decode {
            lsn: wal_start,
            reason: e.to_string(),
        })?;
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
                self.gate.note_commit(c.end_lsn);
                self.received = self.received.max(c.end_lsn);
                self.current_txn = None;
            }
            // Lockdown is the default outbox's only: another schema's streamer acknowledges
            // the markers like any other prefix (MessagePrefix is never the marker's).
            LogicalMessage::Message(m)
                if self.config.postgres.schema.is_default()
                    && m.has_prefix(lockdown::MARKER_PREFIX.as_bytes()) =>
            {
                match self.lockdown.on_marker(m.lsn, &m.content, m.transactional) {
                    MarkerEffect::Locked(since) => tracing::warn!(
                        marker_lsn = %m.lsn,
                        lockdown_lsn = %since,
                        "lockdown in effect (setup --lockdown): outbox messages after the lockdown LSN that were not written by outbox.emit/emit_bytes are dead-lettered as forged"
                    ),
                    MarkerEffect::Unlocked => tracing::warn!(
                        marker_lsn = %m.lsn,
                        "lockdown lifted (setup --unlock): outbox messages are no longer checked for their emitter"
                    ),
                    MarkerEffect::Ignored => {
                        tracing::debug!(marker_lsn = %m.lsn, transactional = m.transactional, "lockdown marker changes nothing")
                    }
                }
            }
            LogicalMessage::Message(m) if m.has_prefix(self.prefix.as_str().as_bytes()) => {
                let locked = self.lockdown.covers(m.lsn);
                let Some((commit_lsn, commit_time_us)) =
                    self.current_txn.filter(|_| m.transactional)
                else {
                    let (reason, error) = if locked {
                        (
                            "forged",
                            self.forged_error(m.lsn, "a non-transactional message"),
                        )
                    } else {
                        ("poison", format!("non-transactional logical message with prefix {} (emit never writes one)", self.prefix))
                    };
                    return self.dead_letter_unpublished(m.lsn, None, m.content, reason, error);
                };
                // Under lockdown, only a version-2 (or later) envelope with an emitter came
                // through the helpers; anything else is forged, decodable or not. An
                // unknown newer version is unsupported_envelope either way (below): it may
                // come from newer helpers, and it is never published.
                let mut checked = None;
                if locked {
                    match envelope::decode(m.content.clone()) {
                        Ok(env) if env.emitted_by.is_some() => checked = Some(env),
                        Err(envelope::EnvelopeError::UnsupportedVersion { .. }) => {}
                        other => {
                            let what = match other {
                                Ok(_) => "an envelope without an emitter (version 1, or version 2 or 3 without emitted_by)".to_owned(),
                                Err(e) => format!("no valid envelope ({e})"),
                            };
                            let error = self.forged_error(m.lsn, &what);
                            return self.dead_letter_unpublished(
                                m.lsn,
                                Some(commit_lsn),
                                m.content,
                                "forged",
                                error,
                            );
                        }
                    }
                }
                if m.content.len() > self.config.bounds.max_message_bytes {
                    let error = format!(
                        "message of {} bytes (envelope) exceeds --max-message-bytes {}",
                        m.content.len(),
                        self.config.bounds.max_message_bytes
                    );
                    return self.dead_letter_unpublished(
                        m.lsn,
                        Some(commit_lsn),
                        m.content,
                        "too_large",
                        error,
                    );
                }
                let decoded = match checked {
                    Some(env) => Ok(env),
                    None => envelope::decode(m.content.clone()),
                };
                let env = match decoded {
                    Ok(env) => env,
                    // Written by a newer outbox.emit: never published, dead-lettered (and
                    // requeued once a pgoutbox that reads it runs).
                    Err(e @ envelope::EnvelopeError::UnsupportedVersion { .. }) => {
                        return self.dead_letter_unpublished(
                            m.lsn,
                            Some(commit_lsn),
                            m.content,
                            "unsupported_envelope",
                            e.to_string(),
                        );
                    }
                    Err(reason) => {
                        let error = format!("undecodable outbox message (poison): {reason}");
                        return self.dead_letter_unpublished(
                            m.lsn,
                            Some(commit_lsn),
                            m.content,
                            "poison",
                            error,
                        );
                    }
                };
                if let Err(refusal) = self.router.route(env.exchange.as_deref()) {
                    return self.dead_letter_unpublished(
                        m.lsn,
                        Some(commit_lsn),
                        m.content,
                        refusal.reason,
                        refusal.error,
                    );
                }
                if let Some(limit) = &self.broker_limit {
                    if env.payload.len() > limit.max_bytes {
                        let error = format!(
                            "payload of {} bytes is larger than the broker's max_message_size {} ({})",
                            env.payload.len(),
                            limit.max_bytes,
                            limit.source
                        );
                        return self.dead_letter_unpublished(
                            m.lsn,
                            Some(commit_lsn),
                            m.content,
                            "too_large",
                            error,
                        );
                    }
                }
                let bytes = m.content.len() as u64;
                let txn = self
                    .wm
                    .add_message(bytes)
                    .map_err(|e| Error::Stream(e.to_string()))?;
                let seq = self.in_flight.insert(InFlight {
                    txn,
                    lsn: m.lsn,
                    commit_lsn,
                    commit_time_us,
                    content: m.content,
                    attempts: 0,
                    first_error: None,
                    emitter_checked: locked,
                });
                self.publish(seq, Some(env), publisher)?;
            }
            LogicalMessage::Message(_) | LogicalMessage::Other { .. } => {}
        }
        Ok(())
    }
}

/// The broker's size limit, when `error` is RabbitMQ's channel close for an oversized
/// message: 406 PRECONDITION_FAILED, "message size N is larger than configured max size M".
fn broker_limit_from_close(error: &str) -> Option<BrokerLimit> {
    const MARK: &str = "larger than configured max size ";
    let at = error.find(MARK)? + MARK.len();
    let digits: String = error[at..]
        .chars()
        .take_while(char::is_ascii_digit)
        .collect();
    let max_bytes = digits.parse().ok()?;
    Some(BrokerLimit {
        max_bytes,
        source: format!("learned from RabbitMQ's channel close: {}", error.trim()),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn learns_the_broker_limit_from_its_close_text() {
        let text = "protocol error: AMQP soft error: PRECONDITION-FAILED: PRECONDITION_FAILED - message size 2097152 is larger than configured max size 1048576";
        let limit = broker_limit_from_close(text).unwrap();
        assert_eq!(limit.max_bytes, 1_048_576);
        assert!(limit.source.contains("message size 2097152"));
        assert_eq!(broker_limit_from_close("connection reset by peer"), None);
        assert_eq!(
            broker_limit_from_close("larger than configured max size é"),
            None
        );
    }
}
