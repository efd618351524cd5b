//! The transaction the stream is in: what pgoutput's Begin said about it, and where each of
//! its outbox messages stands in it.
//!
//! pgoutput (without streaming of in-progress transactions, which we never ask for) sends
//! a committed transaction whole: Begin, its changes and transactional messages, Commit. A
//! session starts at a commit boundary (the slot's `confirmed_flush_lsn`, or a later commit
//! this process knows to be settled), so a replay sends every transaction it sends from its
//! Begin, and a message's index among its transaction's outbox messages is the same on
//! every replay: the stream sink derives its publishing ids from (commit LSN, index).
//!
//! Pure: no I/O.

use crate::lsn::Lsn;

/// Where one outbox message stands in its transaction.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct TxnPlace {
    /// The transaction's commit record LSN (pgoutput Begin's final LSN).
    pub commit_lsn: Lsn,
    /// Its commit time, µs since the Unix epoch.
    pub commit_time_us: i64,
    /// 0-based index among the transaction's messages of the outbox's prefix.
    pub index_in_txn: u32,
}

/// The open transaction, between a Begin and its Commit.
#[derive(Debug, Default)]
pub(super) struct OpenTxn {
    /// (commit record LSN, commit time µs since the Unix epoch, messages placed so far).
    open: Option<(Lsn, i64, u32)>,
}

impl OpenTxn {
    /// A Begin: a transaction committed at `commit_lsn`, `commit_time_us` (µs since the Unix
    /// epoch), opens.
    pub fn begin(&mut self, commit_lsn: Lsn, commit_time_us: i64) {
        self.open = Some((commit_lsn, commit_time_us, 0));
    }

    /// Its Commit.
    pub fn commit(&mut self) {
        self.open = None;
    }

    /// Places a message of the outbox's prefix: `None` when it is not part of a
    /// transaction (non-transactional, or outside Begin/Commit); otherwise its place, and
    /// the next one gets the next index. Every message is placed, whatever then becomes of
    /// it (published or dead-lettered), so indices do not depend on admission. The index
    /// saturates at `u32::MAX` (a transaction of four billion messages): a repeated index
    /// is what a sink that derives ids from it refuses, loudly.
    pub fn place(&mut self, transactional: bool) -> Option<TxnPlace> {
        let (commit_lsn, commit_time_us, next) = self.open.as_mut().filter(|_| transactional)?;
        let index_in_txn = *next;
        *next = next.saturating_add(1);
        Some(TxnPlace {
            commit_lsn: *commit_lsn,
            commit_time_us: *commit_time_us,
            index_in_txn,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_transactional_message_gets_the_next_index_and_a_begin_starts_over() {
        let mut t = OpenTxn::default();
        assert_eq!(t.place(true), None, "outside a transaction");
        t.begin(Lsn(0x100), 7);
        let first = t.place(true).unwrap();
        assert_eq!(
            first,
            TxnPlace {
                commit_lsn: Lsn(0x100),
                commit_time_us: 7,
                index_in_txn: 0
            }
        );
        assert_eq!(
            t.place(false),
            None,
            "a non-transactional message is not placed"
        );
        assert_eq!(t.place(true).unwrap().index_in_txn, 1);
        assert_eq!(t.place(true).unwrap().index_in_txn, 2);
        t.commit();
        assert_eq!(t.place(true), None);
        t.begin(Lsn(0x200), 8);
        assert_eq!(t.place(true).unwrap().index_in_txn, 0);
    }

    #[test]
    fn a_replay_of_a_transaction_gives_each_message_the_same_index() {
        let places = |t: &mut OpenTxn| {
            t.begin(Lsn(0x300), 1);
            let p: Vec<u32> = (0..5)
                .filter_map(|_| t.place(true))
                .map(|p| p.index_in_txn)
                .collect();
            t.commit();
            p
        };
        let first = places(&mut OpenTxn::default());
        let mut again = OpenTxn::default();
        again.begin(Lsn(0x200), 0);
        again.place(true);
        again.commit();
        assert_eq!(places(&mut again), first);
    }
}
