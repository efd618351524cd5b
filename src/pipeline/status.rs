//! The status side: standby status updates out, and the flush LSN they may report.
//!
//! When an update is due and of which kind is [`super::feedback`]'s (a pure timer); what it
//! may report is the watermark capped by what `outbox.stream_state` holds
//! ([`FlushGate`], see [`crate::stream_state`]): never a flush position beyond the record,
//! so a restart can tell a recreated slot from its own history. This module puts the two
//! together and writes the update to the replication stream.

use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use super::feedback::Feedback;
use crate::error::Error;
use crate::lsn::Lsn;
use crate::metrics::Telemetry;
use crate::replication::session::ReplicationStream;
use crate::replication::stream::StatusUpdateKind;
use crate::stream_state::FlushGate;
use crate::watermark::AckWatermark;

/// How long the final standby status update of a shutdown waits for the flush LSN to be
/// recorded in `outbox.stream_state` (it reports what is recorded by then).
const RECORD_SETTLE_TIMEOUT: Duration = Duration::from_secs(2);

/// The status-update timer and the record gate of one session.
#[derive(Debug)]
pub(super) struct Status {
    feedback: Feedback,
    /// What `outbox.stream_state` holds: status updates report no flush LSN beyond it.
    gate: FlushGate,
    telemetry: Arc<Telemetry>,
}

impl Status {
    /// Periodic updates every `interval` (the first one due at once), capped by `gate`.
    pub fn new(interval: Duration, gate: FlushGate, telemetry: Arc<Telemetry>) -> Self {
        Status {
            feedback: Feedback::new(interval),
            gate,
            telemetry,
        }
    }

    /// When the next update is due, for the watermark `wm` ([`Feedback::deadline`] of what
    /// may be reported now).
    pub fn deadline(&self, wm: &AckWatermark) -> Instant {
        self.feedback
            .deadline(wm.flushed().min(self.gate.allowed()))
    }

    /// Resolves when the recorder committed a new flush LSN (the deadline is then computed
    /// again).
    ///
    /// # Cancel safety
    /// Cancel safe ([`FlushGate::recorded_changed`]).
    pub async fn recorded_changed(&mut self) {
        self.gate.recorded_changed().await;
    }

    /// Whether the recorder ended (its SQL session closed): nothing more can be recorded.
    pub fn recorder_gone(&self) -> bool {
        self.gate.recorder_gone()
    }

    /// Once per loop turn: asks the recorder to record where the watermark is now.
    pub fn want(&mut self, flushed: Lsn) {
        self.gate.want(flushed);
    }

    /// A commit seen in the stream, at `end_lsn`.
    pub fn note_commit(&mut self, end_lsn: Lsn) {
        self.gate.note_commit(end_lsn);
    }

    /// What `outbox.stream_state` holds now (the recorder committed it).
    pub fn recorded(&self) -> Lsn {
        self.gate.allowed()
    }

    /// The flush LSN of the last update sent.
    pub fn last_sent_flush(&self) -> Lsn {
        self.feedback.last_sent_flush()
    }

    /// The watermark turned idle behind the newest WAL seen: the next update is due soon
    /// (an idle probe asks for a keepalive).
    pub fn expedite(&mut self) {
        self.feedback.expedite();
    }

    /// Sends an update of `kind` on `stream`: `write` = `received`, `flush` = the watermark
    /// capped by the record. A [`StatusUpdateKind::ShutdownFlush`] first waits up to
    /// [`RECORD_SETTLE_TIMEOUT`] for the watermark to be recorded.
    ///
    /// # Errors
    /// The stream's write error; [`Error::StreamStateLost`] when the recorder is gone with
    /// the watermark ahead of the record (what is recorded is reported first).
    pub async fn send(
        &mut self,
        stream: &mut ReplicationStream,
        wm: &AckWatermark,
        received: Lsn,
        kind: StatusUpdateKind,
    ) -> Result<(), Error> {
        let recorded = if kind == StatusUpdateKind::ShutdownFlush {
            self.gate.settle(wm.flushed(), RECORD_SETTLE_TIMEOUT).await
        } else {
            self.gate.allowed()
        };
        if self.gate.recorder_gone() && wm.flushed() > recorded {
            // Report what is recorded, then end the session (the reconnect records anew).
            let update = self.feedback.update(wm, received, recorded, kind);
            let _ = stream.send_status(&update).await;
            self.feedback.sent(&update);
            return Err(Error::StreamStateLost);
        }
        let update = self.feedback.update(wm, received, recorded, kind);
        stream.send_status(&update).await?;
        self.feedback.sent(&update);
        self.telemetry.status_sent();
        Ok(())
    }
}
