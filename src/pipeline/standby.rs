//! Standing by: several `pgoutbox run` processes may point at one slot; the slot itself is
//! the lock (PostgreSQL lets one walsender at a time hold it: SQLSTATE 55006 for the
//! others), so exactly one streams and the others wait here.
//!
//! ```text
//!  START_REPLICATION ──55006 (slot active)──▶ Standby::wait
//!        ▲                                      │ every --standby-poll-ms (jittered down):
//!        │                                      │   SELECT active_pid, application_name
//!        │                                      │   FROM pg_replication_slots ⟕ pg_stat_replication
//!        └───────────── the slot is free ◀──────┘ (ordinary SQL connection; no walsender)
//! ```
//!
//! A standby opens no replication connection while the slot is held: it watches the
//! holder over the SQL connection and tries `START_REPLICATION` within one poll after the
//! holder's walsender ended (after a SIGKILL of the holder, as soon as the server saw its
//! socket close; after the loss of the holder's host, only when `wal_sender_timeout` fires).
//! When several standbys see the slot free at once, one wins and the others are back here
//! on their next 55006. Every role change (active, standby and the holder's
//! `application_name`, none) is logged once at info and shown in `/readyz` and
//! `pgoutbox_role` ([`crate::metrics::ROLE`]).

use std::time::Duration;

use tokio::time::Instant;

use crate::error::Error;
use crate::metrics::{Phase, Role, Telemetry};

/// The process holding a slot, as the catalogs show it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Holder {
    /// The walsender's pid.
    pub pid: i32,
    /// Its `application_name` (`pgoutbox-<instance id>` for a pgoutbox holder).
    pub application_name: Option<String>,
}

impl Holder {
    fn name(&self) -> &str {
        self.application_name.as_deref().unwrap_or("unknown")
    }
}

/// Reads who holds `slot` (`None`: nobody, or the slot does not exist; the
/// `START_REPLICATION` that follows reports the latter).
///
/// # Errors
/// [`Error::Sql`] when the catalogs cannot be read (the connection broke).
pub(super) async fn holder(
    sql: &tokio_postgres::Client,
    slot: &str,
) -> Result<Option<Holder>, Error> {
    let row = sql
        .query_opt(
            "SELECT s.active_pid, r.application_name::text
             FROM pg_replication_slots s
             LEFT JOIN pg_stat_replication r ON r.pid = s.active_pid
             WHERE s.slot_name = $1",
            &[&slot],
        )
        .await
        .map_err(|e| Error::sql("reading the slot's holder from pg_replication_slots", e))?;
    Ok(row.and_then(|row| {
        row.get::<_, Option<i32>>(0).map(|pid| Holder {
            pid,
            application_name: row.get(1),
        })
    }))
}

/// A poll interval jittered down by up to a fifth, so standbys started together do not
/// poll in step, and never longer than `poll`.
fn jittered(poll: Duration) -> Duration {
    poll.mul_f64(1.0 - fastrand::f64() * 0.2)
}

/// Logs a role change once, at info, and records it in the telemetry.
pub(super) fn note_role(telemetry: &Telemetry, slot: &str, role: Role, holder: Option<&str>) {
    if !telemetry.set_role(role, holder) {
        return;
    }
    match role {
        Role::Active => tracing::info!(
            slot,
            role = role.as_str(),
            "role: active (this process streams from the slot)"
        ),
        Role::Standby => tracing::info!(
            slot,
            role = role.as_str(),
            holder = holder.unwrap_or("unknown"),
            "role: standby (another process holds the slot)"
        ),
        Role::None => tracing::info!(
            slot,
            role = role.as_str(),
            "role: none (not holding the slot; reconnecting)"
        ),
    }
}

/// A standby's state across the tries of one session's start.
#[derive(Debug)]
pub(super) struct Standby {
    began: Instant,
    poll: Duration,
    timeout: Option<Duration>,
    announced: bool,
    /// This process's replication `application_name`, tagged onto the SQL session while it
    /// stands by so `status` lists it.
    application_name: String,
    /// Tries in a row that failed with 55006 although the catalogs showed the slot free
    /// (the holder released it and another standby took it in between, or the catalogs
    /// lag the walsender): each waits a little longer, so this never spins.
    free_but_busy: u32,
}

impl Standby {
    /// A fresh wait, bounded by `timeout` (`--slot-busy-timeout-s`; `None`: forever),
    /// polling every `poll` (`--standby-poll-ms`).
    pub fn new(poll: Duration, timeout: Option<Duration>, application_name: &str) -> Standby {
        Standby {
            began: Instant::now(),
            poll,
            timeout,
            announced: false,
            application_name: application_name.to_owned(),
            free_but_busy: 0,
        }
    }

    /// After `START_REPLICATION` succeeded: a standby that tagged its SQL session (see
    /// [`crate::admin::inspection::mark_standby`]) takes the tag off, so `status` no longer
    /// lists the new holder among the standbys. Best effort: a failure is logged at debug.
    pub async fn leave(&mut self, sql: &tokio_postgres::Client) {
        if !self.announced {
            return;
        }
        self.announced = false;
        if let Err(e) = sql.batch_execute("RESET application_name").await {
            tracing::debug!(error = %e, "cannot take the standby tag off the SQL session");
        }
    }

    /// After `START_REPLICATION` failed with 55006: polls the holder every (jittered)
    /// poll until the slot is free, logging the holder on every change and counting each
    /// poll that finds it held as a `slot_busy` reconnect. Returns when the slot looks
    /// free: try `START_REPLICATION` now.
    ///
    /// # Errors
    /// [`Error::SlotBusy`] once `timeout` passed with the slot still held; [`Error::Sql`]
    /// when the catalogs cannot be read.
    ///
    /// # Cancel safety
    /// Cancel safe: it only reads and sleeps (the caller races it against shutdown).
    pub async fn wait(
        &mut self,
        sql: &tokio_postgres::Client,
        slot: &str,
        telemetry: &Telemetry,
    ) -> Result<(), Error> {
        let mut first = true;
        loop {
            let current = holder(sql, slot).await?;
            let Some(current) = current else {
                if first {
                    // Free at once after a 55006: a race with another standby, or the
                    // catalogs lag. Back off a little (50 ms, 100 ms, ... up to a poll).
                    self.free_but_busy += 1;
                    let pause = (Duration::from_millis(50) * self.free_but_busy).min(self.poll);
                    tokio::time::sleep(pause).await;
                    first = false;
                    continue;
                }
                tracing::debug!(slot, "the slot is free; trying START_REPLICATION");
                return Ok(());
            };
            if !first {
                self.free_but_busy = 0;
            }
            first = false;
            telemetry.set_phase(Phase::SlotBusy);
            telemetry.reconnect("slot_busy");
            note_role(telemetry, slot, Role::Standby, Some(current.name()));
            let waited = self.began.elapsed();
            if let Some(limit) = self.timeout {
                if waited >= limit {
                    return Err(Error::SlotBusy {
                        slot: slot.to_owned(),
                        holder_pid: current.pid.to_string(),
                        holder_name: current.name().to_owned(),
                        waited_s: waited.as_secs(),
                    });
                }
            }
            let mut delay = jittered(self.poll);
            if let Some(limit) = self.timeout {
                delay = delay.min(limit.saturating_sub(waited) + Duration::from_millis(50));
            }
            if self.announced {
                tracing::debug!(
                    slot,
                    holder_pid = current.pid,
                    holder = current.name(),
                    poll_ms = delay.as_millis() as u64,
                    "slot is still active in another process; standing by"
                );
            } else {
                tracing::info!(
                    slot,
                    holder_pid = current.pid,
                    holder = current.name(),
                    poll_ms = self.poll.as_millis() as u64,
                    "slot is active in another process; standing by (watching pg_replication_slots, taking over when it is free)"
                );
                self.announced = true;
                if let Err(e) =
                    crate::admin::inspection::mark_standby(sql, slot, &self.application_name).await
                {
                    tracing::debug!(error = %e, "cannot tag the SQL session as a standby");
                }
            }
            tokio::time::sleep(delay).await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn jitter_stays_within_one_poll() {
        let poll = Duration::from_millis(1000);
        for _ in 0..1000 {
            let d = jittered(poll);
            assert!(d <= poll && d >= poll.mul_f64(0.8), "{d:?}");
        }
    }

    #[test]
    fn role_changes_are_reported_once() {
        let t = Telemetry::new(Duration::from_secs(60));
        assert!(t.set_role(Role::Standby, Some("pgoutbox-a")));
        assert!(!t.set_role(Role::Standby, Some("pgoutbox-a")));
        assert_eq!(t.role(), Role::Standby);
        assert!(t.set_role(Role::Active, None));
        assert!(t.set_role(Role::None, None));
    }
}
