//! The acknowledgement watermark: the single source of the flush LSN reported to Postgres.
//!
//! Transactions are kept in WAL (commit) order. Each carries the number of its outbox
//! messages that are *sent* but not yet *confirmed as routed* by the broker. The watermark is
//! the commit end LSN of the newest transaction such that it and every earlier transaction
//! are closed (Commit seen) and fully confirmed. It only moves forward.
//!
//! Besides commits, exactly one other thing moves it: a primary keepalive's `walEnd`, and
//! only when nothing at all is pending (no open transaction, no unconfirmed message, no
//! blocked entry). The caller must feed the keepalive after every XLogData that arrived
//! before it, which holds when frames are handled in arrival order (see `pipeline`).
//!
//! A failed message (nack, return, channel error) or a poison message blocks its entry
//! for good: nothing at or after it is acknowledged until a restart replays it.

use std::collections::VecDeque;

use crate::lsn::Lsn;

/// Identifies one transaction tracked by the watermark (a sequence number, not an xid).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct TxnSeq(u64);

#[derive(Debug)]
struct Entry {
    /// Commit end LSN, `None` while the transaction is open.
    end: Option<Lsn>,
    /// Messages sent and not yet confirmed as routed.
    unconfirmed: u64,
    /// Failed or poison: never completes.
    blocked: bool,
}

/// An error in how the watermark was fed: a protocol-order bug, never an input condition.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WatermarkError {
    /// `begin` while a transaction is open (Begin without Commit in the stream).
    #[error("a transaction began while another was still open")]
    NestedBegin,
    /// `add_message` or `commit` with no open transaction.
    #[error("a transactional message or commit arrived outside a transaction")]
    NoOpenTransaction,
    /// A confirm for a transaction that is not tracked or has no unconfirmed message.
    #[error("a confirm arrived for a message that is not in flight")]
    UnknownConfirm,
}

/// Tracks in-flight transactions and computes the LSN that may be reported as flushed.
#[derive(Debug)]
pub struct AckWatermark {
    flushed: Lsn,
    /// Sequence number of `entries[0]`.
    front_seq: u64,
    entries: VecDeque<Entry>,
    open: bool,
    unconfirmed_total: u64,
}

impl AckWatermark {
    /// Starts at `start`, the slot's `confirmed_flush_lsn` read at startup: the watermark
    /// never reports anything lower (PostgreSQL 15 would store a lower value).
    pub fn new(start: Lsn) -> Self {
        AckWatermark {
            flushed: start,
            front_seq: 0,
            entries: VecDeque::new(),
            open: false,
            unconfirmed_total: 0,
        }
    }

    /// The LSN that may be reported as flushed.
    pub fn flushed(&self) -> Lsn {
        self.flushed
    }

    /// Messages sent and not yet confirmed.
    pub fn unconfirmed(&self) -> u64 {
        self.unconfirmed_total
    }

    /// True when no transaction is open and nothing is unconfirmed or blocked.
    pub fn is_idle(&self) -> bool {
        !self.open && self.entries.is_empty()
    }

    /// True while a Begin has been seen without its Commit.
    pub fn in_transaction(&self) -> bool {
        self.open
    }

    /// A Begin: opens a transaction.
    ///
    /// # Errors
    /// [`WatermarkError::NestedBegin`] when one is already open.
    pub fn begin(&mut self) -> Result<TxnSeq, WatermarkError> {
        if self.open {
            return Err(WatermarkError::NestedBegin);
        }
        self.open = true;
        self.entries.push_back(Entry {
            end: None,
            unconfirmed: 0,
            blocked: false,
        });
        Ok(self.current_seq())
    }

    fn current_seq(&self) -> TxnSeq {
        TxnSeq(self.front_seq + self.entries.len() as u64 - 1)
    }

    /// One more message of the open transaction is sent; returns its transaction.
    ///
    /// # Errors
    /// [`WatermarkError::NoOpenTransaction`].
    pub fn add_message(&mut self) -> Result<TxnSeq, WatermarkError> {
        if !self.open {
            return Err(WatermarkError::NoOpenTransaction);
        }
        let seq = self.current_seq();
        if let Some(e) = self.entries.back_mut() {
            e.unconfirmed += 1;
        }
        self.unconfirmed_total += 1;
        Ok(seq)
    }

    /// A Commit with its end LSN: closes the open transaction.
    ///
    /// # Errors
    /// [`WatermarkError::NoOpenTransaction`].
    pub fn commit(&mut self, end_lsn: Lsn) -> Result<(), WatermarkError> {
        if !self.open {
            return Err(WatermarkError::NoOpenTransaction);
        }
        self.open = false;
        if let Some(e) = self.entries.back_mut() {
            e.end = Some(end_lsn);
        }
        self.advance();
        Ok(())
    }

    /// A poison entry (for example a non-transactional outbox message): nothing after
    /// this point is acknowledged until a restart.
    pub fn block_here(&mut self) {
        if self.open {
            if let Some(e) = self.entries.back_mut() {
                e.blocked = true;
            }
        } else {
            self.entries.push_back(Entry {
                end: None,
                unconfirmed: 0,
                blocked: true,
            });
        }
    }

    fn entry_mut(&mut self, txn: TxnSeq) -> Option<&mut Entry> {
        let idx = txn.0.checked_sub(self.front_seq)?;
        self.entries.get_mut(usize::try_from(idx).ok()?)
    }

    /// The broker confirmed one message of `txn` as routed.
    ///
    /// # Errors
    /// [`WatermarkError::UnknownConfirm`] when `txn` has no unconfirmed message.
    pub fn confirm(&mut self, txn: TxnSeq) -> Result<(), WatermarkError> {
        let e = self.entry_mut(txn).ok_or(WatermarkError::UnknownConfirm)?;
        if e.unconfirmed == 0 {
            return Err(WatermarkError::UnknownConfirm);
        }
        e.unconfirmed -= 1;
        self.unconfirmed_total -= 1;
        self.advance();
        Ok(())
    }

    /// One message of `txn` was not delivered (nack, return, channel error): the
    /// transaction and everything after it stay unacknowledged.
    ///
    /// # Errors
    /// [`WatermarkError::UnknownConfirm`] when `txn` has no unconfirmed message.
    pub fn fail(&mut self, txn: TxnSeq) -> Result<(), WatermarkError> {
        let e = self.entry_mut(txn).ok_or(WatermarkError::UnknownConfirm)?;
        if e.unconfirmed == 0 {
            return Err(WatermarkError::UnknownConfirm);
        }
        e.unconfirmed -= 1;
        e.blocked = true;
        self.unconfirmed_total -= 1;
        Ok(())
    }

    /// A primary keepalive's `walEnd`: moves the watermark there only when idle.
    /// Returns whether it moved.
    pub fn keepalive(&mut self, wal_end: Lsn) -> bool {
        if self.is_idle() && wal_end > self.flushed {
            self.flushed = wal_end;
            true
        } else {
            false
        }
    }

    fn advance(&mut self) {
        while let Some(front) = self.entries.front() {
            match front.end {
                Some(end) if front.unconfirmed == 0 && !front.blocked => {
                    self.flushed = self.flushed.max(end);
                    self.entries.pop_front();
                    self.front_seq += 1;
                }
                _ => break,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn advances_only_over_the_confirmed_prefix() {
        let mut wm = AckWatermark::new(Lsn(100));
        let t1 = wm.begin().unwrap();
        wm.add_message().unwrap();
        wm.add_message().unwrap();
        wm.commit(Lsn(200)).unwrap();
        let t2 = wm.begin().unwrap();
        wm.add_message().unwrap();
        wm.commit(Lsn(300)).unwrap();
        assert_eq!(wm.flushed(), Lsn(100));
        // Out of order: the later transaction is confirmed first.
        wm.confirm(t2).unwrap();
        assert_eq!(wm.flushed(), Lsn(100));
        wm.confirm(t1).unwrap();
        assert_eq!(wm.flushed(), Lsn(100), "t1 still has one unconfirmed");
        wm.confirm(t1).unwrap();
        assert_eq!(wm.flushed(), Lsn(300));
        assert!(wm.is_idle());
    }

    #[test]
    fn open_transaction_is_never_acknowledged() {
        let mut wm = AckWatermark::new(Lsn(10));
        let t = wm.begin().unwrap();
        wm.add_message().unwrap();
        wm.confirm(t).unwrap();
        assert_eq!(wm.flushed(), Lsn(10), "no commit yet");
        assert!(
            !wm.keepalive(Lsn(50)),
            "keepalive inside a transaction must not move it"
        );
        wm.commit(Lsn(40)).unwrap();
        assert_eq!(wm.flushed(), Lsn(40));
    }

    #[test]
    fn nack_blocks_everything_after() {
        let mut wm = AckWatermark::new(Lsn(0));
        let t1 = wm.begin().unwrap();
        wm.add_message().unwrap();
        wm.commit(Lsn(10)).unwrap();
        let t2 = wm.begin().unwrap();
        wm.add_message().unwrap();
        wm.commit(Lsn(20)).unwrap();
        wm.fail(t1).unwrap();
        wm.confirm(t2).unwrap();
        assert_eq!(wm.flushed(), Lsn(0));
        assert!(!wm.keepalive(Lsn(99)));
        assert_eq!(wm.flushed(), Lsn(0));
    }

    #[test]
    fn keepalive_moves_only_when_idle_and_never_backwards() {
        let mut wm = AckWatermark::new(Lsn(100));
        assert!(!wm.keepalive(Lsn(50)));
        assert_eq!(wm.flushed(), Lsn(100));
        assert!(wm.keepalive(Lsn(150)));
        let t = wm.begin().unwrap();
        wm.add_message().unwrap();
        wm.commit(Lsn(160)).unwrap();
        assert!(!wm.keepalive(Lsn(170)), "a message is unconfirmed");
        wm.confirm(t).unwrap();
        assert_eq!(wm.flushed(), Lsn(160));
        assert!(wm.keepalive(Lsn(170)));
        assert_eq!(wm.flushed(), Lsn(170));
    }

    #[test]
    fn transaction_without_outbox_messages_acknowledges_at_commit() {
        let mut wm = AckWatermark::new(Lsn(0));
        wm.begin().unwrap();
        wm.commit(Lsn(42)).unwrap();
        assert_eq!(wm.flushed(), Lsn(42));
    }

    #[test]
    fn poison_blocks_keepalive_and_later_commits() {
        let mut wm = AckWatermark::new(Lsn(0));
        wm.block_here();
        wm.begin().unwrap();
        wm.commit(Lsn(42)).unwrap();
        assert!(!wm.keepalive(Lsn(50)));
        assert_eq!(wm.flushed(), Lsn(0));
    }

    #[test]
    fn misuse_is_reported() {
        let mut wm = AckWatermark::new(Lsn(0));
        assert_eq!(wm.add_message(), Err(WatermarkError::NoOpenTransaction));
        assert_eq!(wm.commit(Lsn(1)), Err(WatermarkError::NoOpenTransaction));
        let t = wm.begin().unwrap();
        assert_eq!(wm.begin(), Err(WatermarkError::NestedBegin));
        assert_eq!(wm.confirm(t), Err(WatermarkError::UnknownConfirm));
    }

    #[test]
    fn confirms_find_their_transaction_after_the_front_moved_on() {
        // Two transactions are acknowledged and dropped from the front first, so sequence
        // numbers and positions in the list no longer coincide.
        let mut wm = AckWatermark::new(Lsn(0));
        for end in [10, 20] {
            let t = wm.begin().unwrap();
            wm.add_message().unwrap();
            wm.commit(Lsn(end)).unwrap();
            wm.confirm(t).unwrap();
        }
        assert_eq!(wm.flushed(), Lsn(20));
        let t3 = wm.begin().unwrap();
        wm.add_message().unwrap();
        wm.commit(Lsn(30)).unwrap();
        let t4 = wm.begin().unwrap();
        wm.add_message().unwrap();
        wm.commit(Lsn(40)).unwrap();
        let t5 = wm.begin().unwrap();
        wm.add_message().unwrap();
        wm.commit(Lsn(50)).unwrap();
        wm.confirm(t3).unwrap();
        assert_eq!(wm.flushed(), Lsn(30), "the confirm of t3 settles t3");
        wm.fail(t5).unwrap();
        wm.confirm(t4).unwrap();
        assert_eq!(wm.flushed(), Lsn(40), "t4 is settled, the failure was t5's");
        assert_eq!(wm.unconfirmed(), 0);
        // A confirm for a transaction already acknowledged is a bookkeeping bug, not a
        // confirm of whatever now sits at its old position.
        let t6 = wm.begin().unwrap();
        wm.add_message().unwrap();
        wm.commit(Lsn(60)).unwrap();
        assert_eq!(wm.confirm(t3), Err(WatermarkError::UnknownConfirm));
        assert_eq!(wm.fail(t4), Err(WatermarkError::UnknownConfirm));
        assert_eq!(wm.unconfirmed(), 1, "t6's message is still in flight");
        wm.confirm(t6).unwrap();
        assert_eq!(wm.flushed(), Lsn(40), "t5 failed: nothing past it");
    }

    #[test]
    fn a_settled_prefix_is_acknowledged_while_later_entries_are_pending() {
        let mut wm = AckWatermark::new(Lsn(0));
        let t1 = wm.begin().unwrap();
        wm.add_message().unwrap();
        wm.commit(Lsn(10)).unwrap();
        let t2 = wm.begin().unwrap();
        wm.add_message().unwrap();
        wm.commit(Lsn(20)).unwrap();
        let t3 = wm.begin().unwrap();
        wm.add_message().unwrap();
        wm.commit(Lsn(30)).unwrap();
        wm.confirm(t1).unwrap();
        assert_eq!(
            wm.flushed(),
            Lsn(10),
            "t1 is settled though t2 and t3 are not"
        );
        // An open transaction and a failed one behind the front hold nothing before them.
        let t4 = wm.begin().unwrap();
        wm.add_message().unwrap();
        wm.fail(t3).unwrap();
        wm.confirm(t2).unwrap();
        assert_eq!(
            wm.flushed(),
            Lsn(20),
            "t2 is settled; t3 failed, t4 is open"
        );
        wm.commit(Lsn(40)).unwrap();
        wm.confirm(t4).unwrap();
        assert_eq!(wm.flushed(), Lsn(20), "nothing past the failed t3");
    }

    #[test]
    fn block_inside_an_open_transaction_blocks_that_transaction() {
        let mut wm = AckWatermark::new(Lsn(0));
        let t1 = wm.begin().unwrap();
        wm.add_message().unwrap();
        wm.commit(Lsn(10)).unwrap();
        // A poison message inside t2, among ordinary ones.
        let t2 = wm.begin().unwrap();
        wm.add_message().unwrap();
        wm.block_here();
        assert!(
            wm.in_transaction(),
            "blocking does not close the transaction"
        );
        wm.add_message().unwrap();
        wm.commit(Lsn(20)).unwrap();
        assert!(!wm.in_transaction());
        wm.confirm(t2).unwrap();
        wm.confirm(t2).unwrap();
        assert_eq!(wm.flushed(), Lsn(0), "t1 is not confirmed yet");
        wm.confirm(t1).unwrap();
        assert_eq!(
            wm.flushed(),
            Lsn(10),
            "t1 before the poison is acknowledged"
        );
        // Everything after t2 stays unacknowledged, keepalives included.
        let t3 = wm.begin().unwrap();
        wm.add_message().unwrap();
        wm.commit(Lsn(30)).unwrap();
        wm.confirm(t3).unwrap();
        assert_eq!(wm.unconfirmed(), 0);
        assert!(!wm.is_idle());
        assert!(!wm.keepalive(Lsn(99)));
        assert_eq!(wm.flushed(), Lsn(10));
    }

    #[test]
    fn block_inside_a_transaction_without_messages_blocks_it() {
        let mut wm = AckWatermark::new(Lsn(5));
        wm.begin().unwrap();
        wm.block_here();
        wm.commit(Lsn(20)).unwrap();
        assert_eq!(
            wm.flushed(),
            Lsn(5),
            "a blocked transaction is never acknowledged"
        );
        assert!(!wm.is_idle());
        wm.begin().unwrap();
        wm.commit(Lsn(30)).unwrap();
        assert!(!wm.keepalive(Lsn(40)));
        assert_eq!(wm.flushed(), Lsn(5));
    }

    #[test]
    fn a_commit_below_the_start_never_lowers_the_flush() {
        // The slot's confirmed_flush_lsn may lie inside a replayed transaction's range:
        // PostgreSQL 15 stores whatever the client reports, so never report less.
        let mut wm = AckWatermark::new(Lsn(100));
        let t = wm.begin().unwrap();
        wm.add_message().unwrap();
        wm.commit(Lsn(50)).unwrap();
        wm.confirm(t).unwrap();
        assert_eq!(wm.flushed(), Lsn(100));
        assert!(wm.is_idle());
    }

    #[test]
    fn unconfirmed_count_tracks_confirms_and_failures() {
        let mut wm = AckWatermark::new(Lsn(0));
        let t = wm.begin().unwrap();
        for _ in 0..3 {
            wm.add_message().unwrap();
        }
        assert_eq!(wm.unconfirmed(), 3);
        wm.confirm(t).unwrap();
        wm.fail(t).unwrap();
        assert_eq!(wm.unconfirmed(), 1);
    }
}

#[cfg(test)]
mod model;
