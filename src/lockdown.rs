//! Lockdown: which outbox messages must have come through the helpers (`setup --lockdown`).
//!
//! `pgoutbox setup --lockdown` (`sql/lockdown.sql`) revokes `EXECUTE` on every overload of
//! `pg_logical_emit_message` from `PUBLIC`, makes `outbox.emit` / `outbox.emit_bytes`
//! `SECURITY DEFINER` functions of the `NOLOGIN` role `pgoutbox_emitter` (which also owns
//! the schema and what the helpers run), and, once every transaction older than that has
//! ended, writes a **lockdown marker**: a transactional logical message with prefix
//! [`MARKER_PREFIX`] and content [`MARKER_ON`], whose LSN it records in `outbox.lockdown`
//! (`enabled_at_lsn`). `setup --unlock` (`sql/unlock.sql`) writes [`MARKER_OFF`] and deletes
//! the record.
//!
//! Under lockdown, an outbox message at an LSN after the marker that is not a version-2 (or
//! later) envelope with an emitter ([`crate::envelope::Envelope::emitted_by`]) did not come
//! through the current helpers and is dead-lettered as `forged` (never published); an
//! unknown newer version is `unsupported_envelope` instead (never published either). Messages written
//! before the marker are delivered as usual, whenever their transaction commits.
//!
//! # How the streamer learns the state, and why no message slips through
//!
//! [`Lockdown`] is fed from two places: the record, read once at the start of each session
//! ([`Lockdown::from_record`]), and the markers, in stream order ([`Lockdown::on_marker`]).
//! No timer and no re-read are involved, so a lockdown applied while `run` runs takes
//! effect with no delay: exactly at the commit of the marker's transaction (the lockdown's
//! second step, `crate::admin::lockdown`) in the stream.
//!
//! - The walsender decodes transactions in commit order. A message decoded before the
//!   marker (its transaction committed first) by a session that read no lockdown at its
//!   start is not checked, whatever its LSN: it is delivered with its emitter not sent as
//!   checked, never as trusted (every transaction still running when the marker was
//!   written began after the `REVOKE`, so it emitted through the helpers). A message in a
//!   transaction that commits after the marker's is decoded after the marker, so the
//!   streamer has seen it before it classifies that message, whatever it read at session
//!   start, and the message is checked when its LSN is after the marker's.
//! - A session that starts after the marker's transaction was acknowledged does not see
//!   the marker again; but then that transaction had committed before, so the record it
//!   reads at session start holds the marker's LSN. Until the second step ran, the record's
//!   `enabled_at_lsn` is NULL (a pending lockdown): nothing is checked yet.
//! - The check compares the **message's own LSN** with the marker's, not its commit LSN: a
//!   message written before the lockdown in a transaction that commits after it is
//!   "pending from before the lockdown" and is delivered.
//! - The marker is the trust boundary because `setup --lockdown` writes it only after the
//!   `REVOKE` committed **and** every transaction that was open then has ended
//!   (`crate::admin::lockdown`): PostgreSQL checks `EXECUTE` when a query starts, so a
//!   transaction older than the `REVOKE` (a cursor declared before it) can still write a
//!   direct message after the lockdown transaction's commit, and neither that
//!   transaction's marker nor its commit LSN would bound it. Any message after the marker
//!   comes from a transaction that began after the `REVOKE` was visible: through the
//!   helpers, or from a superuser. Messages before it, racing calls included, are
//!   delivered as written before the lockdown (their emitter not sent as checked).
//! - A marker cannot weaken the check: an "on" marker only ever moves the lockdown LSN
//!   earlier (stricter); an "off" marker counts only when it is after the lockdown LSN, so
//!   an "off" written by an ordinary role *before* the lockdown (in a transaction that
//!   commits after it) is ignored; after the lockdown, ordinary roles cannot write one at
//!   all. A superuser can, as a superuser can write anything, including a well-formed
//!   version-2 envelope with any emitter: lockdown does not protect against superusers.
//!
//! Pure: no I/O.

use crate::lsn::Lsn;

/// The prefix of the lockdown marker messages written by `sql/lockdown.sql` and
/// `sql/unlock.sql`. Not [`crate::envelope::PREFIX`]: markers are no outbox messages.
pub const MARKER_PREFIX: &str = "pgoutbox.lockdown";
/// The content of the marker `sql/lockdown.sql` writes.
pub const MARKER_ON: &[u8] = b"on";
/// The content of the marker `sql/unlock.sql` writes.
pub const MARKER_OFF: &[u8] = b"off";

/// Whether lockdown is in effect for the stream, and from which LSN.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Lockdown {
    /// The lockdown marker's LSN; `None`: no lockdown.
    since: Option<Lsn>,
}

/// What a marker did to a [`Lockdown`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MarkerEffect {
    /// Lockdown is now in effect from this LSN.
    Locked(Lsn),
    /// Lockdown is no longer in effect.
    Unlocked,
    /// Nothing changed (a repeated "on", an "off" not after the lockdown, an unknown
    /// content, or a marker outside a transaction).
    Ignored,
}

impl Lockdown {
    /// The state the `outbox.lockdown` record describes: `Some(enabled_at_lsn)` while a
    /// lockdown is recorded, `None` when there is no record (or no table: an install older
    /// than lockdown).
    #[must_use]
    pub fn from_record(enabled_at_lsn: Option<Lsn>) -> Self {
        Lockdown {
            since: enabled_at_lsn,
        }
    }

    /// The LSN from which messages are checked, when lockdown is in effect.
    #[must_use]
    pub fn since(&self) -> Option<Lsn> {
        self.since
    }

    /// Whether an outbox message at `lsn` must have come through the current helpers:
    /// lockdown is in effect and `lsn` is after the marker.
    #[must_use]
    pub fn covers(&self, lsn: Lsn) -> bool {
        self.since.is_some_and(|since| lsn > since)
    }

    /// Applies a message with prefix [`MARKER_PREFIX`] at `lsn` (`transactional`: it came
    /// inside a transaction, as the SQL writes it; others are ignored). See the module doc
    /// for why a marker can only make the check stricter or end a real lockdown.
    pub fn on_marker(&mut self, lsn: Lsn, content: &[u8], transactional: bool) -> MarkerEffect {
        if !transactional {
            return MarkerEffect::Ignored;
        }
        if content == MARKER_ON {
            let since = self.since.map_or(lsn, |s| s.min(lsn));
            if self.since == Some(since) {
                return MarkerEffect::Ignored;
            }
            self.since = Some(since);
            MarkerEffect::Locked(since)
        } else if content == MARKER_OFF {
            match self.since {
                Some(since) if lsn > since => {
                    self.since = None;
                    MarkerEffect::Unlocked
                }
                _ => MarkerEffect::Ignored,
            }
        } else {
            MarkerEffect::Ignored
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn covers_only_after_the_marker() {
        let l = Lockdown::from_record(Some(Lsn(100)));
        assert!(!l.covers(Lsn(99)));
        assert!(!l.covers(Lsn(100)));
        assert!(l.covers(Lsn(101)));
        assert!(!Lockdown::default().covers(Lsn(u64::MAX)));
    }

    #[test]
    fn markers_in_stream_order() {
        let mut l = Lockdown::default();
        assert_eq!(l.on_marker(Lsn(10), b"off", true), MarkerEffect::Ignored);
        assert_eq!(l.on_marker(Lsn(20), b"on", false), MarkerEffect::Ignored);
        assert_eq!(
            l.on_marker(Lsn(20), b"on", true),
            MarkerEffect::Locked(Lsn(20))
        );
        // A repeated or later "on" does not move the lockdown later (less strict).
        assert_eq!(l.on_marker(Lsn(20), b"on", true), MarkerEffect::Ignored);
        assert_eq!(l.on_marker(Lsn(30), b"on", true), MarkerEffect::Ignored);
        assert_eq!(l.since(), Some(Lsn(20)));
        // An "off" written before the lockdown (committed after it) is ignored.
        assert_eq!(l.on_marker(Lsn(15), b"off", true), MarkerEffect::Ignored);
        assert_eq!(l.on_marker(Lsn(20), b"off", true), MarkerEffect::Ignored);
        assert_eq!(l.on_marker(Lsn(40), b"what", true), MarkerEffect::Ignored);
        assert!(l.covers(Lsn(41)));
        assert_eq!(l.on_marker(Lsn(50), b"off", true), MarkerEffect::Unlocked);
        assert!(!l.covers(Lsn(51)));
        // Re-locked later.
        assert_eq!(
            l.on_marker(Lsn(60), b"on", true),
            MarkerEffect::Locked(Lsn(60))
        );
        assert!(!l.covers(Lsn(55)));
        assert!(l.covers(Lsn(61)));
    }

    #[test]
    fn a_replayed_earlier_marker_makes_it_stricter() {
        // The record says 200; the stream replays the marker of an earlier lockdown.
        let mut l = Lockdown::from_record(Some(Lsn(200)));
        assert_eq!(
            l.on_marker(Lsn(100), b"on", true),
            MarkerEffect::Locked(Lsn(100))
        );
        assert!(l.covers(Lsn(150)));
    }
}
