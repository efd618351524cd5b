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
/// A stall is warned about at most this often.
pub const STALL_WARNING: Duration = Duration::from_secs(60);

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

    /// When the next update is due: soon after the position that may be reported
    /// (`reportable`: the watermark, capped by what `outbox.stream_state` holds) moved past
    /// the last one sent, else periodically. A watermark ahead of its record waits for the
    /// record ([`crate::stream_state::FlushGate::recorded_changed`] wakes the loop), not for
    /// a timer: an update sent before the record lands would repeat the old position.
    pub fn deadline(&self, reportable: Lsn) -> Instant {
        if reportable > self.last_sent_flush {
            self.next_periodic
                .min(self.last_status_at + STATUS_COALESCE)
        } else {
            self.next_periodic
        }
    }

    /// Builds the update to send now, reporting `min(watermark, recorded)`: never a flush
    /// position beyond what `outbox.stream_state` holds (see [`crate::stream_state`]). A
    /// `Periodic` update becomes an [`StatusUpdateKind::IdleProbe`] when the watermark is
    /// idle and behind `received` (at most once per [`PROBE_INTERVAL`]).
    pub fn update(
        &mut self,
        wm: &AckWatermark,
        received: Lsn,
        recorded: Lsn,
        kind: StatusUpdateKind,
    ) -> StandbyStatusUpdate {
        let flush = wm.flushed().min(recorded).max(self.last_sent_flush);
        let now = Instant::now();
        let kind = match kind {
            StatusUpdateKind::Periodic
                if wm.is_idle()
                    && wm.flushed() < received
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

/// Detects a stall: unconfirmed messages and no settle for `--stall-after-s`.
///
/// The stall clock restarts on every turn that settled a message, and on every turn with
/// nothing unconfirmed before it (so a message arriving after a long idle period is not a
/// stall at once). A settle only sets a flag; the clock is read once per loop turn. A stall
/// that outlives its session (the broker connection failed with messages unconfirmed) goes
/// on in the next one: that session's watch starts from the clock of the one before
/// ([`StallWatch::stalled_since`]), so the warning's `stalled_s` is the time since the last
/// progress, not since the reconnect.
#[derive(Debug)]
pub(super) struct StallWatch {
    stall_after: Duration,
    last_progress: Instant,
    last_warning: Option<Instant>,
    settled: bool,
    had_unconfirmed: bool,
    /// Where the session before left its stall clock (its messages unsettled), taken by
    /// this session's first unconfirmed turn unless a settle comes first.
    carried: Option<Instant>,
}

impl StallWatch {
    /// A watch that starts now; `carried` is the previous session's
    /// [`StallWatch::stalled_since`].
    pub fn new(stall_after: Duration, carried: Option<Instant>) -> Self {
        StallWatch {
            stall_after,
            last_progress: Instant::now(),
            last_warning: None,
            settled: false,
            had_unconfirmed: false,
            carried,
        }
    }

    /// A message was settled.
    pub fn progress(&mut self) {
        self.settled = true;
    }

    /// Once per loop turn, with the unconfirmed count: `Some(since)` when the stall clock
    /// restarted (for the metrics): `now`, or the previous session's clock on the first
    /// unconfirmed turn of a session that inherited a stall.
    pub fn turn(&mut self, unconfirmed: u64, now: Instant) -> Option<Instant> {
        let settled = std::mem::take(&mut self.settled);
        let restart = settled || unconfirmed == 0 || !self.had_unconfirmed;
        self.had_unconfirmed = unconfirmed > 0;
        if !restart {
            return None;
        }
        if settled {
            self.carried = None;
        }
        let since = if unconfirmed > 0 {
            self.carried.take().unwrap_or(now).min(now)
        } else {
            now
        };
        self.last_progress = since;
        self.last_warning = None;
        Some(since)
    }

    /// When the next warning falls due with `unconfirmed` messages unsettled: once
    /// `--stall-after-s` passed since the last progress, then every [`STALL_WARNING`]
    /// (`None` with nothing unconfirmed). The loop wakes then, whatever else it waits for.
    pub fn due(&self, unconfirmed: u64) -> Option<Instant> {
        if unconfirmed == 0 {
            return None;
        }
        Some(match self.last_warning {
            None => self.last_progress + self.stall_after,
            Some(at) => at + STALL_WARNING,
        })
    }

    /// `Some(stalled for)` when a warning is due at `now`: stalled, and no warning in the
    /// last [`STALL_WARNING`]. `stalled for` is the time since the last progress.
    pub fn check(&mut self, unconfirmed: u64, now: Instant) -> Option<Duration> {
        let stalled = now.saturating_duration_since(self.last_progress);
        if unconfirmed == 0 || stalled < self.stall_after {
            return None;
        }
        if self
            .last_warning
            .is_some_and(|at| now.saturating_duration_since(at) < STALL_WARNING)
        {
            return None;
        }
        self.last_warning = Some(now);
        Some(stalled)
    }

    /// Where the stall clock stands at the end of a session, for the next one: when the
    /// last progress was, while messages are unconfirmed and none settled since the last
    /// turn (`None` otherwise).
    pub fn stalled_since(&self) -> Option<Instant> {
        if self.settled {
            None
        } else if self.had_unconfirmed {
            Some(self.last_progress)
        } else {
            self.carried
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Regression: the update after a confirm waited for a timer, not for the record, so
    /// it could repeat the old position and the new one went out up to 200 ms later (a
    /// drill that froze the streamer right after the consumer got a message saw it again).
    #[test]
    fn an_update_is_due_soon_only_once_the_reportable_position_moved() {
        let mut f = Feedback::new(Duration::from_secs(10));
        f.sent(&StandbyStatusUpdate {
            write: Lsn(100),
            flush: Lsn(100),
            apply: Lsn(100),
            client_time_us: 0,
            kind: StatusUpdateKind::Periodic,
        });
        // The watermark moved to 150 but the record still says 100: nothing new to report.
        assert_eq!(
            f.deadline(Lsn(100)),
            f.last_status_at + Duration::from_secs(10)
        );
        // The record caught up: due within the coalescing interval.
        assert_eq!(f.deadline(Lsn(150)), f.last_status_at + STATUS_COALESCE);
    }

    #[test]
    fn a_stall_is_warned_about_once_a_minute_and_ends_with_a_settle() {
        let t0 = Instant::now();
        let at = |s: u64| t0 + Duration::from_secs(s);
        let mut w = StallWatch::new(Duration::from_secs(5), None);
        assert!(w.turn(0, at(0)).is_some());
        // A message arrives after a long idle time: the clock starts with it.
        assert!(w.turn(1, at(100)).is_some());
        assert_eq!(w.check(1, at(100)), None);
        assert!(w.turn(1, at(104)).is_none());
        assert_eq!(w.check(1, at(104)), None);
        assert_eq!(w.check(1, at(106)), Some(Duration::from_secs(6)));
        assert_eq!(w.check(1, at(136)), None, "once a minute");
        assert_eq!(w.check(1, at(166)), Some(Duration::from_secs(66)));
        w.progress();
        assert!(w.turn(1, at(167)).is_some());
        assert_eq!(w.check(1, at(170)), None);
        assert_eq!(w.check(0, at(500)), None, "nothing unconfirmed is no stall");
    }

    /// Regression (issue 21 item 14): the warning waited for a status tick (up to 10 s), so
    /// `--stall-after-s 1` warned 10 s into a stall; it is due when the setting passes.
    #[test]
    fn the_warning_falls_due_when_stall_after_passes() {
        let t0 = Instant::now();
        let at = |ms: u64| t0 + Duration::from_millis(ms);
        let mut w = StallWatch::new(Duration::from_secs(1), None);
        assert!(w.turn(0, at(0)).is_some());
        assert_eq!(w.due(0), None, "nothing unconfirmed, nothing due");
        assert_eq!(w.turn(3, at(200)), Some(at(200)));
        assert_eq!(w.due(3), Some(at(1200)));
        assert_eq!(w.check(3, at(1200)), Some(Duration::from_secs(1)));
        assert_eq!(
            w.due(3),
            Some(at(1200) + STALL_WARNING),
            "then once a minute"
        );
    }

    /// Regression (issue 21 item 14): a stall that spans a reconnect (the broker failed
    /// with messages unconfirmed, the next session is stuck too) restarted its clock with
    /// each session, so `stalled_s` counted from the reconnect. It counts from the last
    /// progress, in the session before.
    #[test]
    fn stalled_s_counts_from_the_last_progress_across_a_reconnect() {
        let t0 = Instant::now();
        let at = |s: u64| t0 + Duration::from_secs(s);
        let mut first = StallWatch::new(Duration::from_secs(5), None);
        assert!(first.turn(0, at(0)).is_some());
        assert_eq!(first.turn(2, at(1)), Some(at(1)));
        assert!(first.turn(2, at(3)).is_none());
        assert_eq!(first.stalled_since(), Some(at(1)));

        // The next session re-reads the two messages; the broker still does not confirm.
        let mut next = StallWatch::new(Duration::from_secs(5), first.stalled_since());
        assert_eq!(next.turn(0, at(9)), Some(at(9)), "nothing read yet");
        assert_eq!(next.turn(2, at(10)), Some(at(1)), "the stall goes on");
        assert_eq!(next.due(2), Some(at(6)));
        assert_eq!(next.check(2, at(10)), Some(Duration::from_secs(9)));
        // A settle is progress: the clock starts again, and nothing is carried any more.
        next.progress();
        assert_eq!(next.turn(1, at(11)), Some(at(11)));
        assert_eq!(next.check(1, at(12)), None);
        assert_eq!(next.stalled_since(), Some(at(11)));

        // A session that ended with everything settled leaves no stall behind.
        let mut idle = StallWatch::new(Duration::from_secs(5), None);
        idle.turn(0, at(20));
        assert_eq!(idle.stalled_since(), None);
    }
}
