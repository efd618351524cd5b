//! What this process saw settled above the flush LSN recorded in `outbox.stream_state`, so
//! that a session resuming from the record does not publish those messages again.
//!
//! A session resumes from `min(watermark, recorded flush LSN)` (issue 21, item 8): the
//! watermark can be ahead of the record by the record's slack, and by the confirms
//! collected after PostgreSQL went away, which could not be recorded. Resuming from the
//! watermark would skip whatever a database restored while `run` goes on wrote into that
//! range; resuming from the record re-reads it. Each message of the range is then either
//! one this process already settled (routed, or dead-lettered) — the same WAL position
//! *and* the same content — and is acknowledged without being sent again, or anything
//! else (another history: a restore, new transactions) and is published.
//!
//! The content is compared by a keyed 64-bit SipHash (the std `RandomState`, one key per
//! process), so a producer cannot craft a message that matches another's.
//!
//! Pure state, no I/O: the settling code notes each settled message, the loop prunes what
//! the record passed, and the next session asks [`Delivered::already_settled`].

use std::collections::hash_map::RandomState;
use std::collections::BTreeMap;
use std::hash::BuildHasher;

use crate::lsn::Lsn;

/// The most messages remembered; beyond it the lowest LSNs are forgotten (they would be
/// sent again: a duplicate, never a loss). The record normally follows the watermark
/// within [`crate::stream_state::RECORD_INTERVAL`], so the map holds that much traffic
/// plus what was in flight when a session ended.
pub const MAX_REMEMBERED: usize = 200_000;

/// Settled messages above the recorded flush LSN: WAL position → keyed hash of the
/// content.
#[derive(Debug, Default)]
pub struct Delivered {
    key: RandomState,
    above_record: BTreeMap<Lsn, u64>,
}

impl Delivered {
    /// The message at `lsn` with `content` was settled (confirmed as routed, or
    /// dead-lettered) in this process.
    pub fn note(&mut self, lsn: Lsn, content: &[u8]) {
        let hash = self.key.hash_one(content);
        self.above_record.insert(lsn, hash);
        while self.above_record.len() > MAX_REMEMBERED {
            self.above_record.pop_first();
        }
    }

    /// The record reached `recorded`: what lies at or below it is never read again by
    /// this process (a session resumes from the record or later).
    pub fn prune(&mut self, recorded: Lsn) {
        if self
            .above_record
            .first_key_value()
            .is_some_and(|(lsn, _)| *lsn <= recorded)
        {
            self.above_record = self.above_record.split_off(&Lsn(recorded.0 + 1));
        }
    }

    /// Whether the message at `lsn` with `content` is one this process already settled.
    pub fn already_settled(&self, lsn: Lsn, content: &[u8]) -> bool {
        self.above_record
            .get(&lsn)
            .is_some_and(|hash| *hash == self.key.hash_one(content))
    }

    /// How many messages are remembered.
    pub fn len(&self) -> usize {
        self.above_record.len()
    }

    /// Whether none is remembered.
    pub fn is_empty(&self) -> bool {
        self.above_record.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_same_position_and_content_only() {
        let mut d = Delivered::default();
        d.note(Lsn(0x100), b"order 1");
        d.note(Lsn(0x200), b"order 2");
        assert!(d.already_settled(Lsn(0x100), b"order 1"));
        // Another history: other content at the same position, or the same content at
        // another position, is published.
        assert!(!d.already_settled(Lsn(0x100), b"order 9"));
        assert!(!d.already_settled(Lsn(0x180), b"order 1"));
        d.prune(Lsn(0x100));
        assert!(!d.already_settled(Lsn(0x100), b"order 1"));
        assert!(d.already_settled(Lsn(0x200), b"order 2"));
        assert_eq!(d.len(), 1);
        d.prune(Lsn(0x1000));
        assert!(d.is_empty());
    }

    #[test]
    fn beyond_the_bound_the_lowest_are_forgotten() {
        let mut d = Delivered::default();
        for i in 0..(MAX_REMEMBERED as u64 + 10) {
            d.note(Lsn(i), b"x");
        }
        assert_eq!(d.len(), MAX_REMEMBERED);
        assert!(!d.already_settled(Lsn(9), b"x"));
        assert!(d.already_settled(Lsn(10), b"x"));
    }
}
