//! The settling side: the watermark, the in-flight table, and every change of a message's
//! state after it was read.
//!
//! A message read from the stream is either recorded ([`Settling::record`]: in the
//! watermark and the in-flight table, then published) or held for a dead letter without
//! being published ([`Settling::dead_letter_unpublished`]). From there, the sink's outcomes
//! ([`Settling::apply`]) and the dead-letter writer's answers
//! ([`Settling::dead_letter_written`]) settle it:
//!
//! | outcome            | what happens                                                   |
//! |--------------------|----------------------------------------------------------------|
//! | `Routed`           | settled: the watermark counts it, the journal records it       |
//! | `Nacked`           | retried with backoff, dead-lettered (`nacked`) after `--max-attempts` |
//! | `Returned`         | `--on-unroutable`: dead-lettered (`returned`), or retried forever |
//! | `ExchangeRefused`  | dead-lettered (`exchange_not_found` / `exchange_refused`)       |
//! | `Unsendable`       | dead-lettered (`too_large`)                                    |
//! | `Failed`           | handed back to the loop: the session ends                     |
//!
//! Only `Routed` and a committed dead letter settle a message; [`Settling::settle`] is the
//! only caller of [`AckWatermark::confirm`], and the watermark is the only source of the
//! flush LSN.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use tokio::time::Instant;

use super::dead_letter::{DeadLetterWriter, Job, Written};
use super::delivered::Delivered;
use super::feedback::StallWatch;
use super::in_flight::{InFlight, InFlightTable};
use super::journal::JournalHandle;
use super::transaction::TxnPlace;
use super::RunSummary;
use crate::config::{Failpoint, UnroutablePolicy};
use crate::contract::dead_letter_reason;
use crate::envelope;
use crate::error::Error;
use crate::lsn::Lsn;
use crate::metrics::{LatencyBatch, Telemetry};
use crate::outbox_schema::SchemaName;
use crate::routing;
use crate::sink::{PublishOutcome, Seq, SinkFailure};
use crate::watermark::{AckWatermark, TxnSeq};

/// Retry delay bounds for a nacked message (doubling from the minimum).
const NACK_RETRY_MIN: Duration = Duration::from_millis(100);
const NACK_RETRY_MAX: Duration = Duration::from_secs(5);
/// Retry delay bound for a returned message under `--on-unroutable block`.
const BLOCK_RETRY_MAX: Duration = Duration::from_secs(30);

/// What the settling rules read from the run's settings.
#[derive(Debug, Clone)]
pub(super) struct SettlingRules {
    /// `--max-attempts`: publishes of a nacked message before it is dead-lettered.
    pub max_attempts: u32,
    /// `--on-unroutable`.
    pub on_unroutable: UnroutablePolicy,
    /// `--exchange`, for the error text of a returned message that named none.
    pub exchange: String,
    /// `--no-declare`: a refused exchange was only checked, not declared.
    pub passive_declare: bool,
    /// `--failpoint` (tests only).
    pub failpoint: Option<Failpoint>,
    /// The outbox's schema, for the dead-letter log line.
    pub schema: SchemaName,
}

/// What [`Settling::apply`] leaves to the loop.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Applied {
    /// Applied (settled, scheduled for a retry, or handed to the dead-letter writer), or
    /// the outcome of a message no longer in flight, ignored.
    Done,
    /// The sink's connection failed: the session ends.
    Failed(SinkFailure),
}

/// The watermark, the in-flight table, and what settles their messages.
#[derive(Debug)]
pub(super) struct Settling {
    wm: AckWatermark,
    in_flight: InFlightTable,
    dead_letters: DeadLetterWriter,
    /// The delivery journal (`--journal`; a no-op when off).
    journal: JournalHandle,
    stall: StallWatch,
    /// Confirm latencies of this turn, added to the histogram at its end.
    latency: LatencyBatch,
    rules: SettlingRules,
    telemetry: Arc<Telemetry>,
    /// What this process settled above the recorded flush LSN ([`super::delivered`]).
    delivered: Delivered,
}

impl Settling {
    /// Starts at `start` (the watermark's first flush LSN), stall warnings after
    /// `stall_after`, the stall clock carried from the session before when it ended
    /// stalled (`stalled_since`, [`StallWatch::stalled_since`]).
    pub fn new(
        start: Lsn,
        dead_letters: DeadLetterWriter,
        journal: JournalHandle,
        stall_after: Duration,
        stalled_since: Option<Instant>,
        rules: SettlingRules,
        telemetry: Arc<Telemetry>,
    ) -> Self {
        Settling {
            wm: AckWatermark::new(start),
            in_flight: InFlightTable::default(),
            dead_letters,
            journal,
            stall: StallWatch::new(stall_after, stalled_since),
            latency: LatencyBatch::default(),
            rules,
            telemetry,
            delivered: Delivered::default(),
        }
    }

    /// What earlier sessions of this process settled above the record: consulted by
    /// [`Settling::already_settled`], and handed on by [`Settling::take_delivered`].
    pub fn set_delivered(&mut self, delivered: Delivered) {
        self.delivered = delivered;
    }

    /// What this process settled above the record, for the next session.
    pub fn take_delivered(&mut self) -> Delivered {
        std::mem::take(&mut self.delivered)
    }

    /// Whether the message at `lsn` with `content` was settled by an earlier session of
    /// this process (a session resumes from the record, which may lie below it): it is
    /// acknowledged without being published again.
    pub fn already_settled(&self, lsn: Lsn, content: &[u8]) -> bool {
        self.delivered.already_settled(lsn, content)
    }

    /// The record reached `recorded`: forgets the settled messages at or below it.
    pub fn recorded(&mut self, recorded: Lsn) {
        self.delivered.prune(recorded);
    }

    /// The watermark (read only: every change goes through this module).
    pub fn wm(&self) -> &AckWatermark {
        &self.wm
    }

    /// A transaction opens in the stream (its Begin's XLogData at `at`).
    ///
    /// # Errors
    /// [`Error::StreamOrder`] when one is open already.
    pub fn begin(&mut self, at: Lsn) -> Result<(), Error> {
        self.wm
            .begin()
            .map(|_| ())
            .map_err(|source| Error::StreamOrder { lsn: at, source })
    }

    /// The open transaction commits at `end_lsn` (its Commit's XLogData at `at`).
    ///
    /// # Errors
    /// [`Error::StreamOrder`] when none is open.
    pub fn commit(&mut self, at: Lsn, end_lsn: Lsn) -> Result<(), Error> {
        self.wm
            .commit(end_lsn)
            .map_err(|source| Error::StreamOrder { lsn: at, source })
    }

    /// A primary keepalive at `wal_end`, every XLogData before it handled: an idle
    /// watermark moves there. True when it moved.
    pub fn keepalive(&mut self, wal_end: Lsn) -> bool {
        self.wm.keepalive(wal_end)
    }

    /// Records the message at `lsn` (`content`: its envelope), placed in the open
    /// transaction at `place`, to be published; returns its sequence number.
    ///
    /// # Errors
    /// [`Error::StreamOrder`] outside a transaction.
    pub fn record(
        &mut self,
        lsn: Lsn,
        place: TxnPlace,
        content: Bytes,
        emitter_checked: bool,
    ) -> Result<Seq, Error> {
        let txn = self
            .wm
            .add_message(content.len() as u64)
            .map_err(|source| Error::StreamOrder { lsn, source })?;
        Ok(self.in_flight.insert(InFlight {
            txn,
            lsn,
            commit_lsn: place.commit_lsn,
            commit_time_us: place.commit_time_us,
            index_in_txn: place.index_in_txn,
            content,
            attempts: 0,
            first_error: None,
            emitter_checked,
        }))
    }

    /// The record of `seq`, while in flight.
    pub fn record_mut(&mut self, seq: Seq) -> Option<&mut InFlight> {
        self.in_flight.get_mut(seq)
    }

    /// The oldest record in flight.
    pub fn oldest(&self) -> Option<&InFlight> {
        self.in_flight.oldest()
    }

    /// When the next retry falls due.
    pub fn next_retry(&self) -> Option<Instant> {
        self.in_flight.next_retry()
    }

    /// The retries due at `now`, earliest first.
    pub fn take_due(&mut self, now: Instant) -> Vec<Seq> {
        self.in_flight.take_due(now)
    }

    /// Dead letters handed to the writer and not yet answered.
    pub fn dead_letters_pending(&self) -> u64 {
        self.dead_letters.pending()
    }

    /// The writer's next answer.
    ///
    /// # Errors
    /// The error that stopped the writer.
    ///
    /// # Cancel safety
    /// Cancel safe ([`DeadLetterWriter::next_written`]).
    pub async fn next_written(&mut self) -> Result<Written, Error> {
        self.dead_letters.next_written().await
    }

    /// Once per loop turn, with the unconfirmed count: `Some(now)` when the stall clock
    /// restarted ([`StallWatch::turn`]).
    pub fn stall_turn(&mut self, now: Instant) -> Option<Instant> {
        self.stall.turn(self.wm.unconfirmed(), now)
    }

    /// `Some(stalled for)` when a stall warning is due at `now`.
    pub fn stall_check(&mut self, now: Instant) -> Option<Duration> {
        self.stall.check(self.wm.unconfirmed(), now)
    }

    /// When the next stall warning falls due ([`StallWatch::due`]).
    pub fn stall_due(&self) -> Option<Instant> {
        self.stall.due(self.wm.unconfirmed())
    }

    /// The stall clock at the end of the session, for the next ([`StallWatch::stalled_since`]).
    pub fn stalled_since(&self) -> Option<Instant> {
        self.stall.stalled_since()
    }

    /// This turn's confirm latencies, for the metrics.
    pub fn latency(&mut self) -> &mut LatencyBatch {
        &mut self.latency
    }

    /// The dead-letter writer, at the end of the session.
    pub fn into_dead_letters(self) -> DeadLetterWriter {
        self.dead_letters
    }

    /// Applies the sink's `outcome` for `seq` (the table in the module doc); `now_us` is
    /// when the batch arrived (µs since the Unix epoch).
    ///
    /// # Errors
    /// [`Error::Stream`] when the watermark or the writer refuses (a bug, or the writer
    /// stopped).
    pub fn apply(
        &mut self,
        seq: Seq,
        outcome: PublishOutcome,
        now_us: i64,
        summary: &mut RunSummary,
    ) -> Result<Applied, Error> {
        if self.in_flight.get_mut(seq).is_none() {
            return Ok(Applied::Done);
        }
        match outcome {
            PublishOutcome::Routed => self.routed(seq, now_us, summary)?,
            // The channel or connection failed: the outcome of every in-flight publish is
            // unknown. The loop records what is settled and reconnects.
            PublishOutcome::Failed(failure) => return Ok(Applied::Failed(failure)),
            PublishOutcome::ExchangeRefused {
                exchange,
                reply_code,
                reply_text,
            } => self.exchange_refused(seq, &exchange, reply_code, &reply_text)?,
            PublishOutcome::Unsendable { error } => {
                self.dead_letter_in_flight(seq, dead_letter_reason::TOO_LARGE, error)?
            }
            PublishOutcome::Nacked => self.nacked(seq)?,
            PublishOutcome::Refused { code, text } => self.dead_letter_in_flight(
                seq,
                crate::contract::dead_letter_reason::STREAM_REFUSED,
                format!("the stream refused the publish with code {code:#04x} ({text})"),
            )?,
            PublishOutcome::Returned {
                reply_code,
                reply_text,
            } => self.returned(seq, reply_code, &reply_text)?,
        }
        Ok(Applied::Done)
    }

    /// Confirmed as routed: settled, journaled, timed.
    fn routed(&mut self, seq: Seq, now_us: i64, summary: &mut RunSummary) -> Result<(), Error> {
        let m = self.take(seq)?;
        self.settle(m.txn, m.bytes())?;
        self.delivered.note(m.lsn, &m.content);
        // After the settle: the journal never holds back acknowledgement.
        self.journal.record(&m, now_us);
        summary.confirmed += 1;
        self.latency.observe_us(now_us - m.commit_time_us);
        if let Some(Failpoint::AbortAfterConfirms(n)) = self.rules.failpoint {
            if summary.confirmed >= n {
                // Written to stderr directly, not logged: the log's writer thread gets no
                // chance to write out its queue before an abort.
                use std::io::Write as _;
                let _ = writeln!(
                    std::io::stderr(),
                    "failpoint abort-after-confirms: aborting lsn={} confirmed={n}",
                    m.lsn
                );
                std::process::abort();
            }
        }
        Ok(())
    }

    /// The producer-named exchange was refused: dead-lettered.
    fn exchange_refused(
        &mut self,
        seq: Seq,
        exchange: &str,
        reply_code: u16,
        reply_text: &str,
    ) -> Result<(), Error> {
        let refusal =
            routing::refused(exchange, reply_code, reply_text, self.rules.passive_declare);
        if let Some(m) = self.in_flight.get_mut(seq) {
            m.first_error.get_or_insert_with(|| refusal.error.clone());
        }
        self.dead_letter_in_flight(seq, refusal.reason, refusal.error)
    }

    /// Nacked: retried with doubling delays, dead-lettered after `--max-attempts`.
    fn nacked(&mut self, seq: Seq) -> Result<(), Error> {
        self.telemetry.nacked();
        let Some(m) = self.in_flight.get_mut(seq) else {
            return Ok(());
        };
        let error = format!("nacked by the broker (attempt {})", m.attempts);
        m.first_error.get_or_insert_with(|| error.clone());
        if m.attempts >= self.rules.max_attempts {
            return self.dead_letter_in_flight(seq, dead_letter_reason::NACKED, error);
        }
        let delay = (NACK_RETRY_MIN * 2u32.saturating_pow(m.attempts.saturating_sub(1)))
            .min(NACK_RETRY_MAX);
        let message_id = envelope::decode(m.content.clone())
            .map(|e| e.message_id)
            .unwrap_or_default();
        tracing::warn!(lsn = %m.lsn, message_id = %message_id, attempt = m.attempts, retry_in_ms = delay.as_millis() as u64, "message nacked by the broker; retrying");
        self.in_flight.retry_at(seq, Instant::now() + delay);
        Ok(())
    }

    /// Returned (unroutable): `--on-unroutable dead-letter` or `block`.
    fn returned(&mut self, seq: Seq, reply_code: u16, reply_text: &str) -> Result<(), Error> {
        self.telemetry.returned();
        let Some(m) = self.in_flight.get_mut(seq) else {
            return Ok(());
        };
        let (topic, message_id, exchange) = envelope::decode(m.content.clone())
            .map(|e| (e.topic, e.message_id, e.exchange))
            .unwrap_or_default();
        let exchange = exchange.unwrap_or_else(|| self.rules.exchange.clone());
        let error = format!("returned by the broker ({reply_code} {reply_text}): no queue is bound to exchange {exchange:?} for routing key {topic:?}");
        m.first_error.get_or_insert_with(|| error.clone());
        match self.rules.on_unroutable {
            UnroutablePolicy::DeadLetter => {
                self.dead_letter_in_flight(seq, dead_letter_reason::RETURNED, error)
            }
            UnroutablePolicy::Block => {
                let delay =
                    (NACK_RETRY_MIN * 2u32.saturating_pow(m.attempts.min(16))).min(BLOCK_RETRY_MAX);
                tracing::error!(
                    lsn = %m.lsn,
                    message_id = %message_id,
                    attempt = m.attempts,
                    retry_in_ms = delay.as_millis() as u64,
                    error = %error,
                    "unroutable message blocks the outbox (--on-unroutable block): bind a queue for its routing key or switch to --on-unroutable dead-letter; nothing after it is acknowledged"
                );
                self.in_flight.retry_at(seq, Instant::now() + delay);
                Ok(())
            }
        }
    }

    /// Removes the record of `seq` (settled, or handed to the dead-letter writer).
    fn take(&mut self, seq: Seq) -> Result<InFlight, Error> {
        self.in_flight.remove(seq).ok_or_else(|| {
            Error::Internal(format!("the in-flight record of message {seq:?} is gone"))
        })
    }

    /// A message is settled (routed or dead-lettered): the watermark counts it.
    fn settle(&mut self, txn: TxnSeq, bytes: u64) -> Result<(), Error> {
        self.stall.progress();
        self.wm
            .confirm(txn, bytes)
            .map_err(|e| Error::Internal(format!("settling a message of transaction {txn:?}: {e}")))
    }

    /// Hands the in-flight message `seq` to the dead-letter writer; it stays unsettled in
    /// the watermark until written (a retry already scheduled for it finds nothing).
    ///
    /// # Errors
    /// [`Error::Stream`] when the record is gone or the writer stopped.
    pub fn dead_letter_in_flight(
        &mut self,
        seq: Seq,
        reason: &'static str,
        error: String,
    ) -> Result<(), Error> {
        let m = self.take(seq)?;
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

    /// Hands a message that is never published (poison, too large, forged, ...) to the
    /// dead-letter writer; it holds the watermark until written.
    ///
    /// # Errors
    /// [`Error::Stream`] when the writer stopped.
    pub fn dead_letter_unpublished(
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

    /// A dead letter is committed: settle its message.
    ///
    /// # Errors
    /// [`Error::Stream`] when the watermark refuses (a bug).
    pub fn dead_letter_written(
        &mut self,
        written: Written,
        summary: &mut RunSummary,
    ) -> Result<(), Error> {
        let job = written.job;
        let schema = &self.rules.schema;
        tracing::error!(
            lsn = %job.lsn,
            message_id = job.message_id.as_deref().unwrap_or("-"),
            reason = job.reason,
            attempts = job.attempts,
            error = %job.last_error,
            published = job.seq.is_some(),
            schema = %schema,
            "message dead-lettered to {}.dead_letter (inspect with `pgoutbox dead-letters list{}`)",
            schema,
            crate::admin::schema_flag(schema)
        );
        summary.dead_lettered += 1;
        self.telemetry.dead_lettered(job.reason);
        self.settle(job.txn, job.bytes)?;
        self.delivered.note(job.lsn, &job.envelope);
        Ok(())
    }
}
