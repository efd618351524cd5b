//! The acknowledgement watermark: the single source of the flush LSN reported to Postgres.
//!
//! Transactions are kept in WAL (commit) order. Each carries the number of its outbox
//! messages that are *sent* but not yet *settled* (confirmed as routed by the broker, or
//! durably dead-lettered). The watermark is the commit end LSN of the newest transaction
//! such that it and every earlier transaction are closed (Commit seen) and fully settled.
//! It only moves forward.
//!
//! Besides commits, exactly one other thing moves it: a primary keepalive's `walEnd`, and
//! only when nothing at all is pending (no open transaction, no unsettled message, no
//! blocked entry). The caller must feed the keepalive after every XLogData that arrived
//! before it, which holds when frames are handled in arrival order (see `pipeline`).
//!
//! A failed message ([`AckWatermark::fail`]) or a poison point ([`AckWatermark::block_here`])
//! blocks its entry for good: nothing at or after it is acknowledged until a restart
//! replays it.
//!
//! # Memory and the window
//! While the front is stuck (one slow or unroutable message), later transactions keep
//! being read and settled behind it. Neighbouring entries that are closed and fully settled
//! are merged into one span, so the entry list holds at most about two entries per
//! unsettled or blocked transaction, however many transactions (with or without outbox
//! messages) pass behind a stuck front. [`AckWatermark::backlog`] counts what is not yet
//! acknowledged, in messages and payload bytes, for the pipeline's window: every unsettled
//! message, plus the settled messages of closed transactions still behind the flush LSN.
//! Settled messages of the *open* transaction are not counted: a transaction is only ever
//! acknowledged whole, so one larger than the window must still be read to its Commit.

use std::collections::VecDeque;

use crate::lsn::Lsn;

/// Identifies one transaction (or one standalone hold) tracked by the watermark: a sequence
/// number in stream order, not an xid.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct TxnSeq(u64);

/// What is not yet acknowledged, for the pipeline's window (see the module doc).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Backlog {
    /// Outbox messages: unsettled ones, plus settled ones of closed transactions behind the
    /// flush LSN.
    pub messages: u64,
    /// Their payload bytes (the logical message content).
    pub bytes: u64,
}

#[derive(Debug)]
struct Entry {
    /// First and last transaction sequence numbers this entry covers (equal unless merged).
    first_seq: u64,
    last_seq: u64,
    /// Commit end LSN of the last covered transaction; `None` while open, and for a
    /// standalone hold (which moves nothing when it is passed).
    end: Option<Lsn>,
    /// Commit seen (or a standalone hold, closed from the start).
    closed: bool,
    /// Messages sent and not yet settled.
    unsettled: u64,
    /// Payload bytes of the unsettled messages.
    unsettled_bytes: u64,
    /// Messages already settled, and their bytes.
    settled: u64,
    settled_bytes: u64,
    /// Failed or poison: never completes.
    blocked: bool,
}

impl Entry {
    fn new(seq: u64) -> Self {
        Entry {
            first_seq: seq,
            last_seq: seq,
            end: None,
            closed: false,
            unsettled: 0,
            unsettled_bytes: 0,
            settled: 0,
            settled_bytes: 0,
            blocked: false,
        }
    }

    /// Closed, nothing unsettled, not blocked: passing it only moves the flush LSN.
    fn is_settled(&self) -> bool {
        self.closed && self.unsettled == 0 && !self.blocked
    }
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
    /// A confirm for a transaction that is not tracked or has no unsettled message.
    #[error("a confirm arrived for a message that is not in flight")]
    UnknownConfirm,
}

/// Tracks in-flight transactions and computes the LSN that may be reported as flushed.
#[derive(Debug)]
pub struct AckWatermark {
    flushed: Lsn,
    /// The sequence number the next `begin` or `hold` gets.
    next_seq: u64,
    /// In stream order; `first_seq`/`last_seq` increase along the list.
    entries: VecDeque<Entry>,
    open: bool,
    unsettled_total: u64,
    unsettled_bytes: u64,
    /// Settled messages (and bytes) of closed entries still in `entries`.
    held_total: u64,
    held_bytes: u64,
}

impl AckWatermark {
    /// Starts at `start`, the slot's `confirmed_flush_lsn` read at startup: the watermark
    /// never reports anything lower (PostgreSQL 15 would store a lower value).
    pub fn new(start: Lsn) -> Self {
        AckWatermark {
            flushed: start,
            next_seq: 0,
            entries: VecDeque::new(),
            open: false,
            unsettled_total: 0,
            unsettled_bytes: 0,
            held_total: 0,
            held_bytes: 0,
        }
    }

    /// The LSN that may be reported as flushed.
    pub fn flushed(&self) -> Lsn {
        self.flushed
    }

    /// Messages sent and not yet settled (confirmed as routed or dead-lettered).
    pub fn unconfirmed(&self) -> u64 {
        self.unsettled_total
    }

    /// What is not yet acknowledged, for the window (see the module doc).
    pub fn backlog(&self) -> Backlog {
        Backlog {
            messages: self.unsettled_total + self.held_total,
            bytes: self.unsettled_bytes + self.held_bytes,
        }
    }

    /// Entries kept (transactions, merged spans, holds): bounded by about twice the number
    /// of unsettled or blocked transactions, plus one.
    pub fn entry_count(&self) -> usize {
        self.entries.len()
    }

    /// True when no transaction is open and nothing is unsettled or blocked.
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
        let seq = self.take_seq();
        self.entries.push_back(Entry::new(seq));
        Ok(TxnSeq(seq))
    }

    fn take_seq(&mut self) -> u64 {
        let seq = self.next_seq;
        self.next_seq += 1;
        seq
    }

    /// One more message of the open transaction is sent (or handed to the dead-letter
    /// writer), with `bytes` of payload; returns its transaction.
    ///
    /// # Errors
    /// [`WatermarkError::NoOpenTransaction`].
    pub fn add_message(&mut self, bytes: u64) -> Result<TxnSeq, WatermarkError> {
        if !self.open {
            return Err(WatermarkError::NoOpenTransaction);
        }
        let e = self
            .entries
            .back_mut()
            .ok_or(WatermarkError::NoOpenTransaction)?;
        e.unsettled += 1;
        e.unsettled_bytes += bytes;
        self.unsettled_total += 1;
        self.unsettled_bytes += bytes;
        Ok(TxnSeq(e.last_seq))
    }

    /// A standalone pending item outside any transaction (a non-transactional outbox message
    /// being dead-lettered): nothing after this point is acknowledged until it is settled
    /// with [`AckWatermark::confirm`]; passing it moves the flush LSN nowhere by itself.
    /// Inside an open transaction it is simply one more message of that transaction.
    pub fn hold(&mut self, bytes: u64) -> TxnSeq {
        if let Ok(txn) = self.add_message(bytes) {
            return txn;
        }
        let seq = self.take_seq();
        let mut e = Entry::new(seq);
        e.closed = true;
        e.unsettled = 1;
        e.unsettled_bytes = bytes;
        self.entries.push_back(e);
        self.unsettled_total += 1;
        self.unsettled_bytes += bytes;
        TxnSeq(seq)
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
        let last = self.entries.len().saturating_sub(1);
        if let Some(e) = self.entries.get_mut(last) {
            e.end = Some(end_lsn);
            e.closed = true;
            self.held_total += e.settled;
            self.held_bytes += e.settled_bytes;
        }
        self.merge_around(last);
        self.advance();
        Ok(())
    }

    /// A poison point (for example an undecodable frame that was skipped): nothing after
    /// this point is acknowledged until a restart. Inside an open transaction it blocks that
    /// transaction.
    pub fn block_here(&mut self) {
        if self.open {
            if let Some(e) = self.entries.back_mut() {
                e.blocked = true;
            }
        } else {
            let seq = self.take_seq();
            let mut e = Entry::new(seq);
            e.closed = true;
            e.blocked = true;
            self.entries.push_back(e);
        }
    }

    fn index_of(&self, txn: TxnSeq) -> Option<usize> {
        let idx = self.entries.partition_point(|e| e.last_seq < txn.0);
        let e = self.entries.get(idx)?;
        (e.first_seq <= txn.0).then_some(idx)
    }

    /// Takes one unsettled message of `bytes` off the entry of `txn`; returns its index.
    fn take_unsettled(&mut self, txn: TxnSeq, bytes: u64) -> Result<usize, WatermarkError> {
        let idx = self.index_of(txn).ok_or(WatermarkError::UnknownConfirm)?;
        let e = &mut self.entries[idx];
        if e.unsettled == 0 {
            return Err(WatermarkError::UnknownConfirm);
        }
        let bytes = bytes.min(e.unsettled_bytes);
        e.unsettled -= 1;
        e.unsettled_bytes -= bytes;
        self.unsettled_total -= 1;
        self.unsettled_bytes -= bytes;
        Ok(idx)
    }

    /// One message of `txn`, of `bytes` payload bytes (as given to `add_message`/`hold`),
    /// is settled: confirmed as routed by the broker, or durably dead-lettered.
    ///
    /// # Errors
    /// [`WatermarkError::UnknownConfirm`] when `txn` has no unsettled message.
    pub fn confirm(&mut self, txn: TxnSeq, bytes: u64) -> Result<(), WatermarkError> {
        let idx = self.take_unsettled(txn, bytes)?;
        let e = &mut self.entries[idx];
        e.settled += 1;
        e.settled_bytes += bytes;
        if e.closed {
            self.held_total += 1;
            self.held_bytes += bytes;
        }
        self.merge_around(idx);
        self.advance();
        Ok(())
    }

    /// One message of `txn` was not delivered and will not be retried in this session:
    /// the transaction and everything after it stay unacknowledged.
    ///
    /// # Errors
    /// [`WatermarkError::UnknownConfirm`] when `txn` has no unsettled message.
    pub fn fail(&mut self, txn: TxnSeq, bytes: u64) -> Result<(), WatermarkError> {
        let idx = self.take_unsettled(txn, bytes)?;
        let e = &mut self.entries[idx];
        e.blocked = true;
        // Still unacknowledged: it counts in the backlog as settled-but-held.
        e.settled += 1;
        e.settled_bytes += bytes;
        if e.closed {
            self.held_total += 1;
            self.held_bytes += bytes;
        }
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

    /// Merges the entry at `idx` with settled neighbours when it is settled itself.
    fn merge_around(&mut self, idx: usize) {
        if !self.entries.get(idx).is_some_and(Entry::is_settled) {
            return;
        }
        if self.entries.get(idx + 1).is_some_and(Entry::is_settled) {
            if let Some(next) = self.entries.remove(idx + 1) {
                Self::absorb(&mut self.entries[idx], next);
            }
        }
        if idx > 0 && self.entries[idx - 1].is_settled() {
            if let Some(this) = self.entries.remove(idx) {
                Self::absorb(&mut self.entries[idx - 1], this);
            }
        }
    }

    /// Extends settled `into` by the settled entry right after it.
    fn absorb(into: &mut Entry, next: Entry) {
        into.last_seq = next.last_seq;
        into.end = next.end.or(into.end);
        into.settled += next.settled;
        into.settled_bytes += next.settled_bytes;
    }

    fn advance(&mut self) {
        while let Some(front) = self.entries.front() {
            if !front.is_settled() {
                break;
            }
            if let Some(end) = front.end {
                self.flushed = self.flushed.max(end);
            }
            self.held_total -= front.settled;
            self.held_bytes -= front.settled_bytes;
            self.entries.pop_front();
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
        wm.add_message(0).unwrap();
        wm.add_message(0).unwrap();
        wm.commit(Lsn(200)).unwrap();
        let t2 = wm.begin().unwrap();
        wm.add_message(0).unwrap();
        wm.commit(Lsn(300)).unwrap();
        assert_eq!(wm.flushed(), Lsn(100));
        // Out of order: the later transaction is confirmed first.
        wm.confirm(t2, 0).unwrap();
        assert_eq!(wm.flushed(), Lsn(100));
        wm.confirm(t1, 0).unwrap();
        assert_eq!(wm.flushed(), Lsn(100), "t1 still has one unconfirmed");
        wm.confirm(t1, 0).unwrap();
        assert_eq!(wm.flushed(), Lsn(300));
        assert!(wm.is_idle());
    }

    #[test]
    fn open_transaction_is_never_acknowledged() {
        let mut wm = AckWatermark::new(Lsn(10));
        let t = wm.begin().unwrap();
        wm.add_message(0).unwrap();
        wm.confirm(t, 0).unwrap();
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
        wm.add_message(0).unwrap();
        wm.commit(Lsn(10)).unwrap();
        let t2 = wm.begin().unwrap();
        wm.add_message(0).unwrap();
        wm.commit(Lsn(20)).unwrap();
        wm.fail(t1, 0).unwrap();
        wm.confirm(t2, 0).unwrap();
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
        wm.add_message(0).unwrap();
        wm.commit(Lsn(160)).unwrap();
        assert!(!wm.keepalive(Lsn(170)), "a message is unconfirmed");
        wm.confirm(t, 0).unwrap();
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
        assert_eq!(wm.add_message(0), Err(WatermarkError::NoOpenTransaction));
        assert_eq!(wm.commit(Lsn(1)), Err(WatermarkError::NoOpenTransaction));
        let t = wm.begin().unwrap();
        assert_eq!(wm.begin(), Err(WatermarkError::NestedBegin));
        assert_eq!(wm.confirm(t, 0), Err(WatermarkError::UnknownConfirm));
    }

    #[test]
    fn confirms_find_their_transaction_after_the_front_moved_on() {
        // Two transactions are acknowledged and dropped from the front first, so sequence
        // numbers and positions in the list no longer coincide.
        let mut wm = AckWatermark::new(Lsn(0));
        for end in [10, 20] {
            let t = wm.begin().unwrap();
            wm.add_message(0).unwrap();
            wm.commit(Lsn(end)).unwrap();
            wm.confirm(t, 0).unwrap();
        }
        assert_eq!(wm.flushed(), Lsn(20));
        let t3 = wm.begin().unwrap();
        wm.add_message(0).unwrap();
        wm.commit(Lsn(30)).unwrap();
        let t4 = wm.begin().unwrap();
        wm.add_message(0).unwrap();
        wm.commit(Lsn(40)).unwrap();
        let t5 = wm.begin().unwrap();
        wm.add_message(0).unwrap();
        wm.commit(Lsn(50)).unwrap();
        wm.confirm(t3, 0).unwrap();
        assert_eq!(wm.flushed(), Lsn(30), "the confirm of t3 settles t3");
        wm.fail(t5, 0).unwrap();
        wm.confirm(t4, 0).unwrap();
        assert_eq!(wm.flushed(), Lsn(40), "t4 is settled, the failure was t5's");
        assert_eq!(wm.unconfirmed(), 0);
        // A confirm for a transaction already acknowledged is a bookkeeping bug, not a
        // confirm of whatever now sits at its old position.
        let t6 = wm.begin().unwrap();
        wm.add_message(0).unwrap();
        wm.commit(Lsn(60)).unwrap();
        assert_eq!(wm.confirm(t3, 0), Err(WatermarkError::UnknownConfirm));
        assert_eq!(wm.fail(t4, 0), Err(WatermarkError::UnknownConfirm));
        assert_eq!(wm.unconfirmed(), 1, "t6's message is still in flight");
        wm.confirm(t6, 0).unwrap();
        assert_eq!(wm.flushed(), Lsn(40), "t5 failed: nothing past it");
    }

    #[test]
    fn a_settled_prefix_is_acknowledged_while_later_entries_are_pending() {
        let mut wm = AckWatermark::new(Lsn(0));
        let t1 = wm.begin().unwrap();
        wm.add_message(0).unwrap();
        wm.commit(Lsn(10)).unwrap();
        let t2 = wm.begin().unwrap();
        wm.add_message(0).unwrap();
        wm.commit(Lsn(20)).unwrap();
        let t3 = wm.begin().unwrap();
        wm.add_message(0).unwrap();
        wm.commit(Lsn(30)).unwrap();
        wm.confirm(t1, 0).unwrap();
        assert_eq!(
            wm.flushed(),
            Lsn(10),
            "t1 is settled though t2 and t3 are not"
        );
        // An open transaction and a failed one behind the front hold nothing before them.
        let t4 = wm.begin().unwrap();
        wm.add_message(0).unwrap();
        wm.fail(t3, 0).unwrap();
        wm.confirm(t2, 0).unwrap();
        assert_eq!(
            wm.flushed(),
            Lsn(20),
            "t2 is settled; t3 failed, t4 is open"
        );
        wm.commit(Lsn(40)).unwrap();
        wm.confirm(t4, 0).unwrap();
        assert_eq!(wm.flushed(), Lsn(20), "nothing past the failed t3");
    }

    #[test]
    fn block_inside_an_open_transaction_blocks_that_transaction() {
        let mut wm = AckWatermark::new(Lsn(0));
        let t1 = wm.begin().unwrap();
        wm.add_message(0).unwrap();
        wm.commit(Lsn(10)).unwrap();
        // A poison message inside t2, among ordinary ones.
        let t2 = wm.begin().unwrap();
        wm.add_message(0).unwrap();
        wm.block_here();
        assert!(
            wm.in_transaction(),
            "blocking does not close the transaction"
        );
        wm.add_message(0).unwrap();
        wm.commit(Lsn(20)).unwrap();
        assert!(!wm.in_transaction());
        wm.confirm(t2, 0).unwrap();
        wm.confirm(t2, 0).unwrap();
        assert_eq!(wm.flushed(), Lsn(0), "t1 is not confirmed yet");
        wm.confirm(t1, 0).unwrap();
        assert_eq!(
            wm.flushed(),
            Lsn(10),
            "t1 before the poison is acknowledged"
        );
        // Everything after t2 stays unacknowledged, keepalives included.
        let t3 = wm.begin().unwrap();
        wm.add_message(0).unwrap();
        wm.commit(Lsn(30)).unwrap();
        wm.confirm(t3, 0).unwrap();
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
        wm.add_message(0).unwrap();
        wm.commit(Lsn(50)).unwrap();
        wm.confirm(t, 0).unwrap();
        assert_eq!(wm.flushed(), Lsn(100));
        assert!(wm.is_idle());
    }

    #[test]
    fn unconfirmed_count_tracks_confirms_and_failures() {
        let mut wm = AckWatermark::new(Lsn(0));
        let t = wm.begin().unwrap();
        for _ in 0..3 {
            wm.add_message(0).unwrap();
        }
        assert_eq!(wm.unconfirmed(), 3);
        wm.confirm(t, 0).unwrap();
        wm.fail(t, 0).unwrap();
        assert_eq!(wm.unconfirmed(), 1);
    }

    #[test]
    fn memory_stays_bounded_behind_a_stuck_front() {
        // One unconfirmed message, then a million transactions: some without outbox
        // messages, some whose messages are confirmed at once.
        let mut wm = AckWatermark::new(Lsn(0));
        let stuck = wm.begin().unwrap();
        wm.add_message(100).unwrap();
        wm.commit(Lsn(10)).unwrap();
        let mut max_entries = 0;
        for i in 0..1_000_000u64 {
            let t = wm.begin().unwrap();
            if i % 10 == 0 {
                wm.add_message(7).unwrap();
                wm.confirm(t, 7).unwrap();
            }
            wm.commit(Lsn(20 + i)).unwrap();
            max_entries = max_entries.max(wm.entry_count());
        }
        assert!(max_entries <= 3, "entries grew to {max_entries}");
        assert_eq!(wm.flushed(), Lsn(0));
        // Settled messages behind the stuck front still count as unacknowledged.
        assert_eq!(
            wm.backlog(),
            Backlog {
                messages: 1 + 100_000,
                bytes: 100 + 700_000
            }
        );
        wm.confirm(stuck, 100).unwrap();
        assert_eq!(wm.flushed(), Lsn(20 + 999_999));
        assert_eq!(wm.backlog(), Backlog::default());
        assert!(wm.is_idle());
    }

    #[test]
    fn out_of_order_confirms_behind_the_front_merge_and_keep_their_place() {
        let mut wm = AckWatermark::new(Lsn(0));
        let mut txns = Vec::new();
        for i in 0..5u64 {
            let t = wm.begin().unwrap();
            wm.add_message(1).unwrap();
            wm.commit(Lsn(10 * (i + 1))).unwrap();
            txns.push(t);
        }
        // Confirm 3, 1, 2 (merging 1..=3), then 4, then 0.
        for i in [3, 1, 2, 4] {
            wm.confirm(txns[i], 1).unwrap();
            assert_eq!(wm.flushed(), Lsn(0));
        }
        assert_eq!(wm.entry_count(), 2, "the front and one merged span");
        assert_eq!(wm.confirm(txns[2], 1), Err(WatermarkError::UnknownConfirm));
        wm.confirm(txns[0], 1).unwrap();
        assert_eq!(wm.flushed(), Lsn(50));
    }

    #[test]
    fn the_open_transaction_does_not_count_its_settled_messages() {
        // A transaction larger than any window must still be read to its Commit.
        let mut wm = AckWatermark::new(Lsn(0));
        let t = wm.begin().unwrap();
        for _ in 0..1000 {
            wm.add_message(10).unwrap();
            wm.confirm(t, 10).unwrap();
        }
        assert_eq!(wm.backlog(), Backlog::default());
        wm.add_message(10).unwrap();
        assert_eq!(
            wm.backlog(),
            Backlog {
                messages: 1,
                bytes: 10
            }
        );
        wm.commit(Lsn(5)).unwrap();
        assert_eq!(
            wm.backlog(),
            Backlog {
                messages: 1001,
                bytes: 10_010
            }
        );
        wm.confirm(t, 10).unwrap();
        assert_eq!(wm.flushed(), Lsn(5));
        assert_eq!(wm.backlog(), Backlog::default());
    }

    #[test]
    fn a_standalone_hold_blocks_until_settled_and_moves_nothing() {
        let mut wm = AckWatermark::new(Lsn(100));
        let h = wm.hold(3);
        let t = wm.begin().unwrap();
        wm.commit(Lsn(200)).unwrap();
        assert_eq!(wm.flushed(), Lsn(100));
        assert!(!wm.keepalive(Lsn(300)));
        wm.confirm(h, 3).unwrap();
        assert_eq!(wm.flushed(), Lsn(200));
        assert!(wm.keepalive(Lsn(300)));
        // Inside a transaction a hold is a message of it.
        let t2 = wm.begin().unwrap();
        assert_eq!(wm.hold(1), t2);
        assert_ne!(t, t2);
    }
}

#[cfg(test)]
mod model;
