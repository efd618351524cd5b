//! The in-flight table: every outbox message read from the stream and not yet settled,
//! with its retry schedule.
//!
//! A record is created when a message is first published (or handed to the dead-letter
//! writer) and removed when it is settled: confirmed as routed, or durably dead-lettered.
//! Between the two it may be published again (after a nack, or a return under
//! `--on-unroutable block`) when its retry falls due. The watermark counts the same
//! messages by transaction; this table keeps what is needed to publish them again or to
//! write them as dead letters.

use std::cmp::Reverse;
use std::collections::{BTreeMap, BinaryHeap};

use bytes::Bytes;
use tokio::time::Instant;

use crate::envelope::{self, Envelope};
use crate::lsn::Lsn;
use crate::sink::{Delivery, Exchange, Seq};
use crate::watermark::TxnSeq;

/// A message read from the stream and not yet settled.
#[derive(Debug)]
pub(super) struct InFlight {
    /// Its transaction in the watermark.
    pub txn: TxnSeq,
    /// The message's own LSN.
    pub lsn: Lsn,
    /// Its transaction's commit record LSN (pgoutput Begin's final LSN).
    pub commit_lsn: Lsn,
    /// Commit time, µs since the Unix epoch.
    pub commit_time_us: i64,
    /// Its index among its transaction's outbox messages ([`super::transaction`]).
    pub index_in_txn: u32,
    /// The logical message content (the envelope), kept to rebuild a retry.
    pub content: Bytes,
    /// Publish attempts so far.
    pub attempts: u32,
    /// The first failure, kept for the dead letter.
    pub first_error: Option<String>,
    /// Read under `setup --lockdown`: its emitter was required (and present), so the
    /// emitter header can be trusted.
    pub emitter_checked: bool,
}

impl InFlight {
    /// Its size for the window and the watermark: the content length in bytes.
    pub fn bytes(&self) -> u64 {
        self.content.len() as u64
    }

    /// What the sink is handed for this record's current attempt ([`InFlight::attempts`],
    /// counted before the publish): `env` is its envelope, `exchange` its routing decision.
    /// `read_at`: when the read that completed the message's frame returned (first
    /// attempts only).
    pub fn delivery(
        &self,
        seq: Seq,
        env: Envelope,
        exchange: Exchange,
        read_at: Option<std::time::Instant>,
    ) -> Delivery {
        Delivery {
            seq,
            envelope: env,
            exchange,
            lsn: self.lsn,
            commit_lsn: self.commit_lsn,
            commit_time_us: self.commit_time_us,
            index_in_txn: self.index_in_txn,
            emitter_checked: self.emitter_checked,
            attempt: self.attempts,
            read_at,
        }
    }

    /// The envelope, decoded again from the kept content (for a retry).
    ///
    /// # Errors
    /// The envelope's decode error (it decoded once, so this means memory corruption).
    pub fn envelope(&self) -> Result<Envelope, envelope::EnvelopeError> {
        envelope::decode(self.content.clone())
    }
}

/// In-flight records by [`Seq`], and the retry schedule.
///
/// Sequence numbers are handed out in WAL order and never reused. The records sit in an
/// ordered map, so the oldest unsettled record is the first entry, and memory follows the
/// records still in flight only: a stuck message at the front of a transaction larger than
/// the window leaves no trail of settled slots behind it.
#[derive(Debug, Default)]
pub(super) struct InFlightTable {
    records: BTreeMap<Seq, InFlight>,
    next_seq: Seq,
    /// Messages waiting to be published again: (due, seq), earliest first.
    retries: BinaryHeap<Reverse<(Instant, Seq)>>,
}

impl InFlightTable {
    /// Adds a record; returns its sequence number.
    pub fn insert(&mut self, record: InFlight) -> Seq {
        let seq = self.next_seq;
        self.next_seq += 1;
        self.records.insert(seq, record);
        seq
    }

    /// The record of `seq`, if still in flight.
    pub fn get_mut(&mut self, seq: Seq) -> Option<&mut InFlight> {
        self.records.get_mut(&seq)
    }

    fn contains(&self, seq: Seq) -> bool {
        self.records.contains_key(&seq)
    }

    /// Removes the record of `seq` (it was settled, or handed to the dead-letter writer).
    pub fn remove(&mut self, seq: Seq) -> Option<InFlight> {
        self.records.remove(&seq)
    }

    /// The oldest record still in flight.
    pub fn oldest(&self) -> Option<&InFlight> {
        self.records.first_key_value().map(|(_, r)| r)
    }

    /// Schedules `seq` to be published again at `due`.
    pub fn retry_at(&mut self, seq: Seq, due: Instant) {
        self.retries.push(Reverse((due, seq)));
    }

    /// When the next retry falls due.
    pub fn next_retry(&self) -> Option<Instant> {
        self.retries.peek().map(|Reverse((due, _))| *due)
    }

    /// Takes the retries due at `now`, earliest first (records settled meanwhile are
    /// skipped).
    pub fn take_due(&mut self, now: Instant) -> Vec<Seq> {
        let mut due = Vec::new();
        while let Some(Reverse((at, seq))) = self.retries.peek().copied() {
            if at > now {
                break;
            }
            self.retries.pop();
            if self.contains(seq) {
                due.push(seq);
            }
        }
        due
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(lsn: u64) -> InFlight {
        InFlight {
            txn: crate::watermark::AckWatermark::new(Lsn::ZERO).hold(0),
            lsn: Lsn(lsn),
            commit_lsn: Lsn(lsn),
            commit_time_us: lsn as i64,
            index_in_txn: 0,
            content: Bytes::new(),
            attempts: 0,
            first_error: None,
            emitter_checked: false,
        }
    }

    #[test]
    fn the_oldest_is_the_first_unsettled_and_seqs_are_never_reused() {
        let mut t = InFlightTable::default();
        let a = t.insert(record(1));
        let b = t.insert(record(2));
        let c = t.insert(record(3));
        assert_eq!((a, b, c), (0, 1, 2));
        assert!(t.remove(b).is_some());
        assert_eq!(t.oldest().map(|r| r.lsn), Some(Lsn(1)));
        assert!(t.remove(a).is_some());
        assert_eq!(t.oldest().map(|r| r.lsn), Some(Lsn(3)));
        assert!(t.remove(b).is_none(), "settled twice");
        assert!(t.get_mut(a).is_none());
        assert!(t.remove(c).is_some());
        assert!(t.oldest().is_none());
        assert_eq!(t.insert(record(4)), 3);
        assert!(t.get_mut(3).is_some());
        assert!(t.get_mut(99).is_none());
    }
}
