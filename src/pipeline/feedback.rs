//! When to send a standby status update, and of which kind; and stall detection.
//!
//! Updates go out on a periodic timer (a third of `wal_sender_timeout`, see `driver`), and
//! sooner ([`STATUS_COALESCE`] after the last one) when the flush LSN moved. They carry
//! `write` = the newest WAL position seen (commit ends and keepalive `walEnd`s) and `flush` =
//! `apply` = [`AckWatermark::flushed`].
//!
//! The idle probe: the walsender sends a primary keepalive on its own only while our
//! reported `write` is behind what it sent, or when no reply came for half of
//! `wal_sender_timeout` — and our periodic updates are those replies. So after a message
//! that was unconfirmed during a burst of unrelated WAL is finally confirmed, no keepalive
//! would ever come to move the watermark over that WAL, and the slot would hold it until new
//! WAL arrived. When the watermark is idle and behind the newest position seen, the update
//! therefore asks for a reply ([`StatusUpdateKind::IdleProbe`]); the server answers at once
//! with a keepalive, whose `walEnd` the idle watermark may take.

use std::time::Duration;

use tokio::time::Instant;

use crate::config::STATUS_COALESCE;
use crate::lsn::Lsn;
use crate::replication::stream::{now_pg_time_us, StandbyStatusUpdate, StatusUpdateKind};
use crate::watermark::AckWatermark;

/// At most one idle probe per this interval.
const PROBE_INTERVAL: Duration = Duration::from_secs(1);
/// Unsettled messages with no progress for this long are warned about, this often.
pub const STALL_WARNING: Duration = Duration::from_secs(30);

/// The status-update timer.
#[derive(Debug)]
pub(super) struct Feedback {
    interval: Duration,
    last_sent_flush: Lsn,
    last_status_at: Instant,
    next_periodic: Instant,
    last_probe_at: Option<Instant>,
}

impl Feedback {
    /// A timer sending periodic updates every `interval`; the first one is due at once.
    pub fn new(interval: Duration) -> Self {
        let now = Instant::now();
        Feedback {
            interval,
            last_sent_flush: Lsn::ZERO,
            last_status_at: now,
            next_periodic: now,
            last_probe_at: None,
        }
    }

    /// The flush LSN of the last update sent.
    pub fn last_sent_flush(&self) -> Lsn {
        self.last_sent_flush
    }

    /// When the next update is due: soon after the flush LSN moved, else periodically.
    pub fn deadline(&self, wm: &AckWatermark) -> Instant {
        if wm.flushed() > self.last_sent_flush {
            self.next_periodic
                .min(self.last_status_at + STATUS_COALESCE)
        } else {
            self.next_periodic
        }
    }

    /// Builds the update to send now. A `Periodic` update becomes an
    /// [`StatusUpdateKind::IdleProbe`] when the watermark is idle and behind `received`
    /// (at most once per [`PROBE_INTERVAL`]).
    pub fn update(
        &mut self,
        wm: &AckWatermark,
        received: Lsn,
        kind: StatusUpdateKind,
    ) -> StandbyStatusUpdate {
        let flush = wm.flushed();
        let now = Instant::now();
        let kind = match kind {
            StatusUpdateKind::Periodic
                if wm.is_idle()
                    && flush < received
                    && self
                        .last_probe_at
                        .is_none_or(|at| now.duration_since(at) >= PROBE_INTERVAL) =>
            {
                self.last_probe_at = Some(now);
                StatusUpdateKind::IdleProbe
            }
            other => other,
        };
        StandbyStatusUpdate {
            write: received.max(flush),
            flush,
            apply: flush,
            client_time_us: now_pg_time_us(),
            kind,
        }
    }

    /// Records that `update` was sent.
    pub fn sent(&mut self, update: &StandbyStatusUpdate) {
        debug_assert!(
            update.flush >= self.last_sent_flush,
            "flush LSN moved backwards"
        );
        if update.flush != self.last_sent_flush {
            tracing::debug!(flush_lsn = %update.flush, kind = ?update.kind, "standby status update");
        }
        self.last_sent_flush = update.flush;
        self.last_status_at = Instant::now();
        self.next_periodic = self.last_status_at + self.interval;
    }

    /// Makes the next update due soon (the watermark may have turned idle).
    pub fn expedite(&mut self) {
        self.next_periodic = self
            .next_periodic
            .min(self.last_status_at + STATUS_COALESCE);
    }
}

/// Detects a stall: unsettled messages and no settle for a while.
#[derive(Debug)]
pub(super) struct StallWatch {
    last_progress: Instant,
    last_warning: Instant,
}

impl StallWatch {
    /// A watch that starts now.
    pub fn new() -> Self {
        let now = Instant::now();
        StallWatch {
            last_progress: now,
            last_warning: now,
        }
    }

    /// A message was settled.
    pub fn progress(&mut self) {
        self.last_progress = Instant::now();
    }

    /// Called on every status tick: `Some(stalled for)` when a warning is due (at most every
    /// [`STALL_WARNING`]) because `unsettled` messages saw no settle for that long.
    pub fn check(&mut self, unsettled: u64) -> Option<Duration> {
        let now = Instant::now();
        if unsettled == 0 {
            self.last_progress = now;
            return None;
        }
        let stalled = now.duration_since(self.last_progress);
        if stalled >= STALL_WARNING && now.duration_since(self.last_warning) >= STALL_WARNING {
            self.last_warning = now;
            return Some(stalled);
        }
        None
    }
}
