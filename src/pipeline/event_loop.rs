//! The main loop: one `select!` with written priorities, and what each frame of the stream
//! does.
//!
//! [`Core`] owns one session's parts, each a module named for one concept, and calls into
//! them:
//! - the stream side: the replication stream, the WAL positions seen, the open
//!   transaction ([`super::transaction`]);
//! - [`super::admission`]: whether a message is published or dead-lettered unpublished;
//! - [`super::settling`]: the watermark and the in-flight table, and **every change of a
//!   message's state** after it was read (routed, nacked, returned, dead-lettered);
//! - [`super::status`]: standby status updates and the record gate;
//! - the sink ([`crate::sink::Sink`], passed to [`Core::run_loop`]): publishes out,
//!   outcomes back; the loop knows no other side of it.
//!
//! A message's path: a frame is decoded ([`Core::handle_logical`]), a lockdown marker or a
//! transaction bound is applied, an outbox message is admitted, then recorded and published
//! ([`Core::publish`]); the sink's outcomes are applied by sequence number
//! ([`Core::apply_outcomes`]), and a due retry is published again
//! ([`Core::publish_due_retries`]).

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use tokio::sync::watch;
use tokio::time::Instant;

use super::admission::{Admission, Admitted, BrokerLimit};
use super::dead_letter::DeadLetterWriter;
use super::journal::JournalHandle;
use super::refusal::{Lesson, Refusals};
use super::settling::{Applied, Settling, SettlingRules};
use super::status::Status;
use super::transaction::{OpenTxn, TxnPlace};
use super::RunSummary;
use crate::config::{ExchangeDeclare, RunConfig};
use crate::contract::dead_letter_reason;
use crate::envelope::Envelope;
use crate::error::Error;
use crate::lockdown::Lockdown;
use crate::lsn::Lsn;
use crate::metrics::{unix_now_us, Phase, Telemetry, Turn};
use crate::pgoutput::{self, Begin, Commit, LogicalMessage, Message};
use crate::replication::session::ReplicationStream;
use crate::replication::stream::{ReplicationMessage, StatusUpdateKind};
use crate::routing::{Exchange, Router};
use crate::sink::{recv_settled, PublishOutcome, Seq, Sink, SinkError, SinkFailure};
use crate::stream_state::FlushGate;

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

/// Why the loop is draining.
enum Drain {
    /// SIGINT/SIGTERM: drain, send the final status update, return `Ok`.
    Shutdown(Instant),
    /// The Postgres connection broke: collect confirms for a while, then return the error.
    PostgresLost(Instant, Error),
}

/// What enables this turn's branches, computed once before the `select!`.
struct Guards {
    status_deadline: Instant,
    drain_deadline: Option<Instant>,
    /// Not draining: WAL is read and shutdown is watched.
    streaming: bool,
    /// The replication connection is usable (status updates go out).
    pg_alive: bool,
    /// The record is watched: its progress wakes the loop, its end ends the session (not
    /// while a shutdown drains: the final update reports what is recorded).
    watch_record: bool,
    /// The window has room and the sink takes publishes.
    room: bool,
    next_retry: Option<Instant>,
    /// When the next stall warning falls due.
    stall_due: Option<Instant>,
    /// Dead letters are being written.
    writing: bool,
}

/// One session's streaming state (see the module doc for its parts).
pub(super) struct Core {
    /// The replication stream: frames in, status updates out.
    stream: ReplicationStream,
    config: RunConfig,
    settling: Settling,
    status: Status,
    admission: Admission,
    /// The transaction between the last Begin and its Commit.
    txn: OpenTxn,
    /// Highest WAL position seen (commit ends and keepalive ends): the "write" position.
    received: Lsn,
    /// The server's end of WAL as last reported (keepalive and XLogData `walEnd`).
    server_wal_end: Lsn,
    /// The next read of a trickling stream waits until then (see `RunConfig::read_coalesce`).
    next_read_at: Instant,
    summary: RunSummary,
    /// Metrics and probe state, written once per turn.
    telemetry: Arc<Telemetry>,
    /// Publishes per sink part already counted in the per-partition metrics (this
    /// session's sink counts from 0).
    part_published: Vec<u64>,
    /// The sink's failure that ended the session, when one did.
    sink_failure: Option<SinkFailure>,
    /// When the last read of the replication stream returned (the frames being handled
    /// were completed by it): the start of each first publish's residence time.
    read_at: std::time::Instant,
}

/// The loop's error for a sink that failed or refused in a way no message settles.
fn sink_failure(e: SinkError) -> Error {
    match e {
        SinkError::Lost(reason) => Error::BrokerLost(reason),
        SinkError::Unencodable(text) => Error::Stream(text),
        e => Error::Sink(e),
    }
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
        refusals: Refusals,
        stalled_since: Option<Instant>,
        summary: RunSummary,
        telemetry: Arc<Telemetry>,
        lockdown: Lockdown,
        prefix: crate::outbox_schema::MessagePrefix,
        journal: JournalHandle,
    ) -> Self {
        let rules = SettlingRules {
            max_attempts: config.bounds.max_attempts,
            on_unroutable: config.publishing.on_unroutable,
            exchange: config.broker.exchange.clone(),
            passive_declare: config.broker.exchange_declare == ExchangeDeclare::Passive,
            failpoint: config.failpoint,
            schema: config.postgres.schema.clone(),
        };
        let router = Router::new(
            config.broker.exchange.clone(),
            config.broker.allowed_exchanges.clone(),
        );
        let admission = Admission::new(
            lockdown,
            config.postgres.schema.is_default(),
            prefix,
            config.bounds.max_message_bytes,
            router,
            broker_limit,
            refusals,
        );
        let settling = Settling::new(
            start,
            dead_letters,
            journal,
            config.observability.stall_after,
            stalled_since,
            rules,
            Arc::clone(&telemetry),
        );
        Core {
            stream,
            settling,
            status: Status::new(interval, gate, Arc::clone(&telemetry)),
            admission,
            config,
            txn: OpenTxn::default(),
            received: start,
            server_wal_end: start,
            next_read_at: Instant::now(),
            summary,
            telemetry,
            part_published: Vec::new(),
            sink_failure: None,
            read_at: std::time::Instant::now(),
        }
    }

    /// Reports this turn to the metrics (counters, gauges, latencies, the stall clock and
    /// the heartbeat): a few relaxed atomic stores, once per turn, never per message.
    fn report_turn(&mut self, sink: &dyn Sink) {
        // Once per turn: ask the recorder to record where the watermark is now, and forget
        // the settled messages the record passed.
        self.status.want(self.settling.wm().flushed());
        self.settling.recorded(self.status.recorded());
        if let Some(at) = self.settling.stall_turn(Instant::now()) {
            self.telemetry.progress_at(at.into_std());
        }
        let wm = self.settling.wm();
        let backlog = wm.backlog();
        let turn = Turn {
            published: self.summary.published,
            retried: self.summary.retried,
            confirmed: self.summary.confirmed,
            unacknowledged_messages: backlog.messages,
            unacknowledged_bytes: backlog.bytes,
            unconfirmed: wm.unconfirmed(),
            flush_lsn: self.status.last_sent_flush().0,
            received_lsn: self.received.0,
            server_wal_end: self.server_wal_end.0,
            oldest_commit_time_us: self.settling.oldest().map(|m| m.commit_time_us),
        };
        self.telemetry.turn(&turn, self.settling.latency());
        self.report_parts(sink);
    }

    /// The per-partition metrics from the sink's parts (one part without `--partitions`).
    fn report_parts(&mut self, sink: &dyn Sink) {
        let parts = sink.parts();
        self.part_published.resize(parts.len(), 0);
        for (i, (part, seen)) in parts.iter().zip(self.part_published.iter_mut()).enumerate() {
            let published = part.published.saturating_sub(*seen);
            *seen = part.published;
            self.telemetry.partition(
                i,
                crate::metrics::PartTurn {
                    published,
                    unsettled: part.unsettled as u64,
                },
            );
        }
    }

    /// The LSN known to be settled.
    pub fn flushed(&self) -> Lsn {
        self.settling.wm().flushed()
    }

    /// Messages not settled.
    pub fn unsettled(&self) -> u64 {
        self.settling.wm().unconfirmed()
    }

    /// The stall clock at the session's end: when the last progress was, while messages
    /// are unsettled (the next session's stall goes on from there).
    pub fn stalled_since(&self) -> Option<Instant> {
        self.settling.stalled_since()
    }

    /// The broker's size limit, when known (perhaps learned in this session).
    pub fn broker_limit(&self) -> Option<BrokerLimit> {
        self.admission.broker_limit().cloned()
    }

    /// The sink's failure that ended the session (`None`: it ended otherwise, or the sink
    /// reported its loss with nothing unsettled).
    pub fn sink_failure(&self) -> Option<&SinkFailure> {
        self.sink_failure.as_ref()
    }

    /// What closes of the publishing channel taught (perhaps in this session).
    pub fn refusals(&self) -> Refusals {
        self.admission.refusals().clone()
    }

    /// Hands over what an earlier session settled above the record (see
    /// [`super::delivered`]).
    pub fn set_delivered(&mut self, delivered: super::delivered::Delivered) {
        self.settling.set_delivered(delivered);
    }

    /// What this session and the earlier ones settled above the record, for the next.
    pub fn take_delivered(&mut self) -> super::delivered::Delivered {
        self.settling.take_delivered()
    }

    /// The stream, the writer and the summary (with the last flush LSN reported).
    pub fn into_parts(self) -> (ReplicationStream, DeadLetterWriter, RunSummary) {
        let mut summary = self.summary;
        summary.flushed = self.status.last_sent_flush();
        (self.stream, self.settling.into_dead_letters(), summary)
    }

    /// Room in the window: what is not yet acknowledged stays under `--max-in-flight`
    /// messages and `--max-in-flight-bytes` payload bytes; while a channel close is being
    /// isolated ([`super::refusal`]), one message is in flight at a time.
    fn has_room(&self) -> bool {
        let wm = self.settling.wm();
        if wm.unconfirmed() > 0 && self.admission.refusals().isolating(wm.flushed()) {
            return false;
        }
        let backlog = wm.backlog();
        backlog.messages < self.config.bounds.max_in_flight as u64
            && backlog.bytes < self.config.bounds.max_in_flight_bytes as u64
    }

    /// The main loop: one `select!` with written priorities.
    ///
    /// Priorities (highest first):
    /// 1. shutdown signal (stop reading, start the bounded drain);
    /// 2. the drain deadline;
    /// 3. the status update deadline, which also checks the sink's health (never starved
    ///    by confirms or WAL); the record's progress or end; a stall warning that falls due;
    /// 4. the sink: buffered publishes written, settled outcomes read (a batch per turn);
    /// 5. committed dead letters;
    /// 6. retries that are due;
    /// 7. new WAL from the socket, only while the window has room and the sink is
    ///    writable;
    /// 8. frames already buffered (when a turn's frame batch ran out).
    ///
    /// # Errors
    /// The session's end: a lost connection (retryable), a definite error, or
    /// [`Error::ShutdownTimeout`]. `Ok` after a drained shutdown.
    pub async fn run_loop(
        &mut self,
        sink: &mut dyn Sink,
        mut shutdown: watch::Receiver<bool>,
    ) -> Result<(), Error> {
        let mut drain = None;
        if *shutdown.borrow() {
            drain = Some(self.start_shutdown_drain());
        }
        let mut buffered = true;
        self.send_status(StatusUpdateKind::Periodic).await?;
        loop {
            self.stall_if_asked().await;
            if drain.is_none() {
                if let Err(e) = self.handle_buffered(sink, &mut buffered).await {
                    drain = self.on_error(e)?;
                }
            }
            if drain.is_some() && self.settling.wm().unconfirmed() == 0 {
                if let Some(d) = drain.take() {
                    return self.finish(d).await;
                }
            }
            let g = self.guards(drain.as_ref(), &*sink);
            self.report_turn(&*sink);
            tokio::select! {
                biased;
                // PRIORITY 1: shutdown. Cancel safety: watch::Receiver::changed is cancel safe.
                changed = shutdown.changed(), if g.streaming => {
                    if changed.is_err() || *shutdown.borrow() {
                        tracing::info!(unconfirmed = self.settling.wm().unconfirmed(), "shutdown requested; draining confirms");
                        drain = Some(self.start_shutdown_drain());
                    }
                }
                // PRIORITY 2: drain deadline. Cancel safety: sleep_until is cancel safe.
                _ = tokio::time::sleep_until(g.drain_deadline.unwrap_or_else(Instant::now)), if g.drain_deadline.is_some() => {
                    return self.on_drain_deadline(drain.take()).await;
                }
                // PRIORITY 3: standby status update deadline. Cancel safety: sleep_until.
                _ = tokio::time::sleep_until(g.status_deadline), if g.pg_alive => {
                    self.on_status_deadline(&*sink, &mut drain).await?;
                }
                // PRIORITY 3b: the recorder committed a new flush LSN: wake, so the status
                // deadline above is computed again (an update then goes out promptly). Or
                // the recorder's SQL session closed (PostgreSQL shutting down): the session
                // ends now, as a lost replication connection does, not at the next update.
                // Cancel safety: Status::recorded_changed is cancel safe.
                _ = self.status.recorded_changed(), if g.watch_record => {
                    if self.status.recorder_gone() {
                        drain = self.on_error(Error::StreamStateLost)?;
                    }
                }
                // PRIORITY 3c: a stall warning falls due (`--stall-after-s` after the last
                // progress, then once a minute), not only at the next status update.
                // Cancel safety: sleep_until.
                _ = tokio::time::sleep_until(g.stall_due.unwrap_or_else(Instant::now)), if g.stall_due.is_some() => {
                    self.warn_if_stalled(self.has_room());
                }
                // PRIORITY 4: the sink: writes what publish() encoded, reads confirms and
                // returns. Cancel safety: sink::recv_settled is cancel safe.
                batch = recv_settled(&mut *sink) => self.on_settled(batch, sink).await?,
                // PRIORITY 5: committed dead letters. Cancel safety: mpsc recv is cancel safe.
                written = self.settling.next_written(), if g.writing => {
                    self.settling.dead_letter_written(written?, &mut self.summary)?;
                    self.expedite_if_idle();
                }
                // PRIORITY 6: retries due. Cancel safety: sleep_until.
                _ = tokio::time::sleep_until(g.next_retry.unwrap_or_else(Instant::now)), if g.next_retry.is_some() => {
                    self.publish_due_retries(sink)?;
                }
                // PRIORITY 7: new WAL, guarded by the window. Cancel safety: read_buf.
                read = self.stream.fill_not_before(self.next_read_at), if g.streaming && g.room && !buffered => {
                    self.on_read(read, &mut buffered, &mut drain)?;
                }
                // PRIORITY 8: frames left in the buffer from a full batch.
                _ = std::future::ready(()), if g.streaming && g.room && buffered => {}
            }
        }
    }

    /// New WAL was read (`n` bytes, now buffered), or reading failed (the session drains
    /// or ends as [`Core::on_error`] decides).
    fn on_read(
        &mut self,
        read: Result<usize, crate::replication::Error>,
        buffered: &mut bool,
        drain: &mut Option<Drain>,
    ) -> Result<(), Error> {
        match read {
            Ok(n) => {
                // Every frame handled until the next read was completed by this one (the
                // next read waits until the buffer holds no complete frame).
                self.read_at = std::time::Instant::now();
                *buffered = true;
                self.coalesce_after(n);
            }
            Err(e) => *drain = self.on_error(e.into())?,
        }
        Ok(())
    }

    /// What enables this turn's branches.
    fn guards(&self, drain: Option<&Drain>, sink: &dyn Sink) -> Guards {
        Guards {
            status_deadline: self.status.deadline(self.settling.wm()),
            drain_deadline: match drain {
                Some(Drain::Shutdown(t)) | Some(Drain::PostgresLost(t, _)) => Some(*t),
                None => None,
            },
            streaming: drain.is_none(),
            pg_alive: !matches!(drain, Some(Drain::PostgresLost(..))),
            watch_record: !matches!(drain, Some(Drain::PostgresLost(..)))
                && (drain.is_none() || !self.status.recorder_gone()),
            room: self.has_room() && sink.is_writable(),
            next_retry: self.settling.next_retry(),
            stall_due: self.settling.stall_due(),
            writing: self.settling.dead_letters_pending() > 0,
        }
    }

    /// Shutdown was requested: stop reading, drain for `--shutdown-timeout-s`.
    fn start_shutdown_drain(&self) -> Drain {
        self.telemetry.set_phase(Phase::Draining);
        Drain::Shutdown(Instant::now() + self.config.bounds.shutdown_timeout)
    }

    /// Opt-in (`--read-coalesce-us`, default 0): a small read (`n` bytes) while several
    /// publishes are unconfirmed means a steady stream, so the next read is taken a little
    /// later, in one piece. With few in flight (a low rate) the next message is read and
    /// published at once. Large reads (a backlog, big messages) are never delayed: a delay
    /// per read would cap the stream at about one socket buffer per interval.
    fn coalesce_after(&mut self, n: usize) {
        if !self.config.bounds.read_coalesce.is_zero()
            && n < COALESCE_BELOW_BYTES
            && self.settling.wm().unconfirmed() >= COALESCE_MIN_UNCONFIRMED as u64
        {
            self.next_read_at = Instant::now() + self.config.bounds.read_coalesce;
        }
    }

    /// The drain ran out of time: a lost Postgres connection's error, or the shutdown's
    /// final status update and [`Error::ShutdownTimeout`].
    async fn on_drain_deadline(&mut self, drain: Option<Drain>) -> Result<(), Error> {
        match drain {
            Some(Drain::PostgresLost(_, e)) => Err(e),
            _ => {
                self.send_status(StatusUpdateKind::ShutdownFlush).await?;
                let wm = self.settling.wm();
                Err(Error::ShutdownTimeout {
                    unconfirmed: wm.unconfirmed(),
                    flushed: wm.flushed(),
                })
            }
        }
    }

    /// The status deadline: a lost sink ends the session; otherwise a periodic update goes
    /// out (a failure to send may start a drain), and a stall is warned about.
    async fn on_status_deadline(
        &mut self,
        sink: &dyn Sink,
        drain: &mut Option<Drain>,
    ) -> Result<(), Error> {
        if sink.health().is_lost() {
            let _ = self.send_status(StatusUpdateKind::Periodic).await;
            return Err(Error::BrokerLost(
                "the sink's connection is closed (found at the status deadline)".into(),
            ));
        }
        if let Err(e) = self.send_status(StatusUpdateKind::Periodic).await {
            *drain = self.on_error(e)?;
        }
        self.warn_if_stalled(self.has_room());
        Ok(())
    }

    /// A batch from the sink, or its failure (the session ends, after a status update that
    /// reports what is settled).
    async fn on_settled(
        &mut self,
        batch: Result<Vec<(Seq, PublishOutcome)>, SinkError>,
        sink: &mut dyn Sink,
    ) -> Result<(), Error> {
        match batch {
            Ok(batch) => self.apply_outcomes(batch, sink).await,
            Err(e) => {
                let _ = self.send_status(StatusUpdateKind::Periodic).await;
                Err(sink_failure(e))
            }
        }
    }

    /// A replication-side failure: keep collecting confirms for a while (when any are
    /// outstanding) so a reconnect does not re-send what the broker already has.
    fn on_error(&mut self, e: Error) -> Result<Option<Drain>, Error> {
        let unconfirmed = self.settling.wm().unconfirmed();
        match e {
            Error::Replication(_) | Error::StreamStateLost if unconfirmed > 0 => {
                tracing::warn!(error = %e, unconfirmed, "replication connection lost; collecting outstanding confirms before reconnecting");
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
        sink: &mut dyn Sink,
        buffered: &mut bool,
    ) -> Result<(), Error> {
        let mut handled = 0;
        while handled < FRAME_BATCH && self.has_room() && sink.is_writable() {
            match self.stream.next_buffered()? {
                Some(msg) => {
                    self.handle(msg, sink).await?;
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

    /// Publishes (again) the in-flight message `seq`; `first` is its envelope and routing
    /// decision on the first attempt (admission made them), else the envelope is decoded
    /// again from the kept content and routed again.
    fn publish(
        &mut self,
        seq: Seq,
        first: Option<(Envelope, Exchange)>,
        sink: &mut dyn Sink,
    ) -> Result<(), Error> {
        let Some(m) = self.settling.record_mut(seq) else {
            return Ok(());
        };
        m.attempts += 1;
        let read_at = first.is_some().then_some(self.read_at);
        let (env, exchange) = match first {
            Some(first) => first,
            None => {
                let env = m.envelope().map_err(|e| Error::Stream(e.to_string()))?;
                // Admitted before the first publish: a refusal here means the record
                // changed, which it does not; dead-letter rather than stop.
                match self.admission.route(&env) {
                    Ok(exchange) => (env, exchange),
                    Err(refusal) => {
                        return self.settling.dead_letter_in_flight(
                            seq,
                            refusal.reason,
                            refusal.error,
                        )
                    }
                }
            }
        };
        match sink.publish(m.delivery(seq, env, exchange, read_at)) {
            Ok(()) => {
                self.summary.published += 1;
                Ok(())
            }
            // It does not fit this sink (for AMQP: its content header exceeds one frame of
            // this broker): it never will.
            Err(SinkError::Unsendable(error)) => {
                self.settling
                    .dead_letter_in_flight(seq, dead_letter_reason::TOO_LARGE, error)
            }
            Err(e) => Err(sink_failure(e)),
        }
    }

    fn publish_due_retries(&mut self, sink: &mut dyn Sink) -> Result<(), Error> {
        for seq in self.settling.take_due(Instant::now()) {
            self.summary.retried += 1;
            self.publish(seq, None, sink)?;
        }
        Ok(())
    }

    /// Applies a batch of the sink's outcomes, in order ([`Settling::apply`]); a failed
    /// connection ends the session.
    async fn apply_outcomes(
        &mut self,
        batch: Vec<(Seq, PublishOutcome)>,
        sink: &mut dyn Sink,
    ) -> Result<(), Error> {
        let now_us = unix_now_us();
        // The messages a failed connection left unsettled (their LSNs), to find the one
        // that made the broker close the channel.
        let unsettled: Vec<Lsn> = batch
            .iter()
            .filter(|(_, o)| matches!(o, PublishOutcome::Failed(_)))
            .filter_map(|(seq, _)| self.settling.record_mut(*seq).map(|m| m.lsn))
            .collect();
        for (seq, outcome) in batch {
            match self
                .settling
                .apply(seq, outcome, now_us, &mut self.summary)?
            {
                Applied::Done => self.expedite_if_idle(),
                Applied::Failed(error) => return self.on_sink_failed(error, &unsettled).await,
            }
        }
        // Retries scheduled with no delay go out now.
        self.publish_due_retries(sink)
    }

    /// The sink's connection failed: record what is settled and reconnect. When the broker
    /// closed the channel over a message's size, remember its limit: the next session
    /// dead-letters what exceeds it instead of looping; over anything else, learn which
    /// message caused it from the publishes left `unsettled` ([`super::refusal`]).
    async fn on_sink_failed(
        &mut self,
        failure: SinkFailure,
        unsettled: &[Lsn],
    ) -> Result<(), Error> {
        if let Some(limit) = BrokerLimit::from_close(&failure) {
            tracing::warn!(max_message_bytes = limit.max_bytes, error = %failure, "RabbitMQ refused a message for its size and closed the channel; messages over its max_message_size will be dead-lettered as too_large");
            self.admission.learn_broker_limit(limit);
        } else {
            self.learn_refusal(&failure, unsettled);
        }
        let _ = self.send_status(StatusUpdateKind::Periodic).await;
        let error = Error::BrokerLost(failure.to_string());
        self.sink_failure = Some(failure);
        Err(error)
    }

    /// `--failpoint stall-after-confirms=N` (tests only): once N messages were confirmed, the
    /// loop stops turning for good, so it beats no more while the HTTP endpoint goes on
    /// answering (`/healthz` turns 503 after [`crate::metrics::HEALTH_STALE_AFTER`]).
    async fn stall_if_asked(&self) {
        if let Some(crate::config::Failpoint::StallAfterConfirms(n)) = self.config.failpoint {
            if self.summary.confirmed >= n {
                tracing::warn!(
                    confirmed = self.summary.confirmed,
                    "failpoint stall-after-confirms: the event loop stops turning"
                );
                std::future::pending::<()>().await;
            }
        }
    }

    /// A close of the publishing channel over something other than size: what it teaches
    /// the next session, logged.
    fn learn_refusal(&mut self, error: &SinkFailure, unsettled: &[Lsn]) {
        let configured = self.config.broker.exchange.clone();
        match self
            .admission
            .refusals_mut()
            .learn(error, &configured, unsettled)
        {
            Some(Lesson::Exchange(exchange)) => {
                tracing::warn!(exchange = %exchange, error = %error, "RabbitMQ refused a publish to a producer-named exchange and closed the channel; messages to it will be dead-lettered as exchange_refused")
            }
            Some(Lesson::Culprit(lsn)) => {
                tracing::warn!(lsn = %lsn, error = %error, "RabbitMQ closed the channel over the one unconfirmed message; it will be dead-lettered as publish_refused")
            }
            Some(Lesson::Isolate(until)) => {
                tracing::warn!(until_lsn = %until, unconfirmed = unsettled.len(), error = %error, "RabbitMQ closed the channel over one of the unconfirmed messages; publishing them one at a time to find it")
            }
            None => {}
        }
    }

    /// After a settle: a watermark turned idle behind the newest WAL seen asks for a
    /// keepalive soon (the idle probe, [`super::feedback`]).
    fn expedite_if_idle(&mut self) {
        let wm = self.settling.wm();
        if wm.is_idle() && wm.flushed() < self.received {
            self.status.expedite();
        }
    }

    /// Logs a warning, at most once a minute (`STALL_WARNING`), while messages stay
    /// unconfirmed with no settle for `--stall-after-s` (a blocked or silent broker, a locked
    /// dead-letter table, an unroutable message under `--on-unroutable block`).
    fn warn_if_stalled(&mut self, room: bool) {
        let Some(stalled) = self.settling.stall_check(Instant::now()) else {
            return;
        };
        let wm = self.settling.wm();
        let oldest = self.settling.oldest();
        let oldest_lsn = oldest
            .map(|m| m.lsn.to_string())
            .unwrap_or_else(|| "-".into());
        let oldest_age_s = oldest
            .map(|m| (unix_now_us() - m.commit_time_us).max(0) / 1_000_000)
            .unwrap_or(0);
        tracing::warn!(
            stalled_s = stalled.as_secs(),
            unconfirmed = wm.unconfirmed(),
            unacknowledged = wm.backlog().messages,
            oldest_lsn = %oldest_lsn,
            oldest_age_s,
            broker_blocked = self.telemetry.is_broker_blocked(),
            window_full = !room,
            flushed_lsn = %wm.flushed(),
            received_lsn = %self.received,
            "stalled: no message settled for --stall-after-s; the broker may be blocked (memory or disk alarm) or unreachable, or a message is blocked; nothing unsettled is acknowledged"
        );
    }

    async fn send_status(&mut self, kind: StatusUpdateKind) -> Result<(), Error> {
        self.status
            .send(&mut self.stream, self.settling.wm(), self.received, kind)
            .await
    }

    async fn handle(&mut self, msg: ReplicationMessage, sink: &mut dyn Sink) -> Result<(), Error> {
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
                let moved = self.settling.keepalive(wal_end);
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
                self.handle_logical(wal_start, data, sink)?
            }
        }
        Ok(())
    }

    /// One XLogData's pgoutput message, by step: decode, then a lockdown marker, a
    /// transaction bound, or an outbox message ([`Core::on_outbox_message`]); anything else
    /// (other prefixes, table changes) is acknowledged without publishing.
    fn handle_logical(
        &mut self,
        wal_start: Lsn,
        data: Bytes,
        sink: &mut dyn Sink,
    ) -> Result<(), Error> {
        let decoded = pgoutput::decode(data).map_err(|e| Error::Decode {
            lsn: wal_start,
            reason: e.to_string(),
        })?;
        match decoded {
            LogicalMessage::Begin(b) => self.on_begin(wal_start, &b),
            LogicalMessage::Commit(c) => self.on_commit(wal_start, &c),
            LogicalMessage::Message(m) if self.admission.is_marker(&m) => {
                self.admission.on_marker(&m);
                Ok(())
            }
            LogicalMessage::Message(m) if self.admission.is_outbox_message(&m) => {
                self.on_outbox_message(m, sink)
            }
            LogicalMessage::Message(_) | LogicalMessage::Other { .. } => Ok(()),
        }
    }

    /// A transaction opens: the watermark and the open transaction learn it.
    fn on_begin(&mut self, at: Lsn, b: &Begin) -> Result<(), Error> {
        tracing::trace!(final_lsn = %b.final_lsn, "begin");
        self.settling.begin(at)?;
        self.txn
            .begin(b.final_lsn, pgoutput::pg_time_to_unix_us(b.commit_time_us));
        Ok(())
    }

    /// The open transaction commits: its end is the newest WAL position seen.
    fn on_commit(&mut self, at: Lsn, c: &Commit) -> Result<(), Error> {
        tracing::trace!(end_lsn = %c.end_lsn, "commit");
        self.settling.commit(at, c.end_lsn)?;
        self.status.note_commit(c.end_lsn);
        self.received = self.received.max(c.end_lsn);
        self.txn.commit();
        Ok(())
    }

    /// An outbox message: placed in its transaction (every one, so indices are stable),
    /// admitted ([`Admission::admit`]), then recorded and published, or dead-lettered
    /// without publishing.
    fn on_outbox_message(&mut self, m: Message, sink: &mut dyn Sink) -> Result<(), Error> {
        let place = self.txn.place(m.transactional);
        // Read again because the session resumed from the record, below what an earlier
        // session of this process settled: the same position and content, so the same
        // message, acknowledged without being sent again ([`super::delivered`]).
        if place.is_some() && self.settling.already_settled(m.lsn, &m.content) {
            tracing::debug!(lsn = %m.lsn, "settled before the reconnect; not sent again");
            self.summary.not_resent += 1;
            return Ok(());
        }
        match (
            self.admission.admit(m.lsn, &m.content, place.as_ref()),
            place,
        ) {
            (Ok(admitted), Some(place)) => self.record_and_publish(m, place, admitted, sink),
            (Ok(_), None) => Err(Error::Stream(
                "admitted an outbox message outside a transaction".into(),
            )),
            (Err(rejected), place) => self.settling.dead_letter_unpublished(
                m.lsn,
                place.map(|p| p.commit_lsn),
                m.content,
                rejected.reason,
                rejected.error,
            ),
        }
    }

    /// Records an admitted message in the watermark and the in-flight table, and publishes
    /// it.
    fn record_and_publish(
        &mut self,
        m: Message,
        place: TxnPlace,
        admitted: Admitted,
        sink: &mut dyn Sink,
    ) -> Result<(), Error> {
        let Admitted {
            envelope,
            exchange,
            emitter_checked,
        } = admitted;
        let seq = self
            .settling
            .record(m.lsn, place, m.content, emitter_checked)?;
        self.publish(seq, Some((envelope, exchange)), sink)
    }
}
