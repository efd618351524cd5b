//! Publishing ids derived from the WAL: `id(C, i) = (C / 8) * 2^16 + i` for a message with
//! commit record LSN `C` and index `i` in its transaction. The scheme, why it strictly
//! increases along the stream and gives a replayed message its id again, and its limits:
//! `docs/src/internals/stream-ids.md`.

use crate::lsn::Lsn;

/// Bits of the index within a transaction.
pub const INDEX_BITS: u32 = 16;
/// Messages of the outbox's prefix one transaction may hold (`i < 2^16`).
pub const MAX_MESSAGES_PER_TRANSACTION: u64 = 1 << INDEX_BITS;
/// The first commit LSN the scheme cannot represent: 2^51 bytes (2 PiB, `80000/0`).
pub const LSN_LIMIT: u64 = 1 << (64 - INDEX_BITS + 3);
/// From here on every session start warns that the limit is near: 2^50 bytes (1 PiB).
pub const LSN_WARNING: u64 = LSN_LIMIT / 2;

/// Why a message has no publishing id. Each stops `run`: nothing wraps, nothing is
/// skipped.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum IdError {
    /// The transaction holds more messages than the index can count.
    #[error("transaction {commit_lsn} holds more than {MAX_MESSAGES_PER_TRANSACTION} outbox messages (message index {index}): a stream publishing id cannot count them (docs/src/internals/stream-ids.md). Split such transactions, or publish this outbox to an exchange (--amqp-url) instead")]
    TooManyMessages {
        /// The transaction's commit LSN.
        commit_lsn: Lsn,
        /// The message's index.
        index: u32,
    },
    /// The commit LSN is past what the scheme can represent.
    #[error("commit LSN {commit_lsn} is at or past 80000/0 (2 PiB of WAL), where stream publishing ids end (docs/src/internals/stream-ids.md): start a new producer name with --stream-producer-name while nothing is in flight")]
    LsnTooHigh {
        /// The transaction's commit LSN.
        commit_lsn: Lsn,
    },
    /// The commit LSN is not a multiple of 8, which the scheme relies on.
    #[error("commit LSN {commit_lsn} is not a multiple of 8: stream publishing ids rely on WAL records starting at 8-byte boundaries (docs/src/internals/stream-ids.md); please report this")]
    Unaligned {
        /// The transaction's commit LSN.
        commit_lsn: Lsn,
    },
}

/// The publishing id of the message with index `index` in the transaction whose commit
/// record is at `commit_lsn`.
///
/// # Errors
/// [`IdError`] when the scheme cannot represent it.
pub fn publishing_id(commit_lsn: Lsn, index: u32) -> Result<u64, IdError> {
    let c = commit_lsn.0;
    if c % 8 != 0 {
        return Err(IdError::Unaligned { commit_lsn });
    }
    if c >= LSN_LIMIT {
        return Err(IdError::LsnTooHigh { commit_lsn });
    }
    if u64::from(index) >= MAX_MESSAGES_PER_TRANSACTION {
        return Err(IdError::TooManyMessages { commit_lsn, index });
    }
    Ok(((c >> 3) << INDEX_BITS) | u64::from(index))
}

/// The commit LSN an id was made from (its index dropped): where the WAL must reach for the
/// id to be this server's.
pub fn commit_lsn_of(id: u64) -> Lsn {
    Lsn((id >> INDEX_BITS) << 3)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn the_limits_are_refused_not_wrapped() {
        assert_eq!(publishing_id(Lsn(8), 0), Ok(1 << 16));
        assert_eq!(publishing_id(Lsn(8), 65_535), Ok((1 << 16) + 65_535));
        assert!(matches!(
            publishing_id(Lsn(8), 65_536),
            Err(IdError::TooManyMessages { .. })
        ));
        assert!(matches!(
            publishing_id(Lsn(12), 0),
            Err(IdError::Unaligned { .. })
        ));
        assert!(matches!(
            publishing_id(Lsn(LSN_LIMIT), 0),
            Err(IdError::LsnTooHigh { .. })
        ));
        assert_eq!(publishing_id(Lsn(LSN_LIMIT - 8), 65_535), Ok(u64::MAX));
        assert_eq!(Lsn(LSN_LIMIT).to_string(), "80000/0");
    }

    proptest! {
        /// Lexicographic order of (commit LSN, index) is the order of the ids, and the
        /// commit LSN comes back from the id.
        #[test]
        fn ids_increase_with_commit_order_then_index(
            a in 1u64..(LSN_LIMIT / 8), i in 0u32..65_536,
            b in 1u64..(LSN_LIMIT / 8), j in 0u32..65_536,
        ) {
            let x = publishing_id(Lsn(a * 8), i).unwrap();
            let y = publishing_id(Lsn(b * 8), j).unwrap();
            prop_assert_eq!((a, i).cmp(&(b, j)), x.cmp(&y));
            prop_assert_eq!(commit_lsn_of(x), Lsn(a * 8));
            prop_assert!(x > 0);
        }
    }
}
