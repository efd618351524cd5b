//! Sans-IO decoder for `pgoutput` logical replication messages (protocol version 1).
//!
//! Each `XLogData` payload of a logical replication stream started with
//! `START_REPLICATION SLOT ... LOGICAL ... (proto_version '1', publication_names '...',
//! messages 'true')` carries exactly one pgoutput message. This module decodes the three
//! kinds pgoutbox needs — Begin, Commit and logical decoding Message — and classifies every
//! other kind (Relation, Insert, Update, Delete, Truncate, Type, Origin, and tags unknown to
//! this version) as [`LogicalMessage::Other`] without parsing it.
//!
//! Formats follow the PostgreSQL documentation, "Logical Streaming Replication Protocol /
//! Logical Replication Message Formats" (PostgreSQL 15). All integers are big-endian
//! (network order). Streaming of in-progress transactions (protocol version 2+) is not
//! requested by pgoutbox, so the optional `xid` fields of the streamed variants never occur.
//!
//! The decoder never panics on input: every read goes through a bounds-checked cursor, and
//! every length read from the wire is validated before it is used. Payloads (`prefix`,
//! `content`) are zero-copy [`Bytes`] slices of the input.

use bytes::Bytes;

use crate::lsn::Lsn;

/// The PostgreSQL epoch (2000-01-01 00:00:00 UTC) in microseconds since the Unix epoch
/// (1970-01-01 00:00:00 UTC).
///
/// PostgreSQL timestamps on the replication protocol are microseconds since the PostgreSQL
/// epoch; add this constant to get microseconds since the Unix epoch.
pub const PG_EPOCH_UNIX_US: i64 = 946_684_800_000_000;

/// Converts a PostgreSQL protocol timestamp (µs since 2000-01-01 00:00 UTC) to µs since the
/// Unix epoch (1970-01-01 00:00 UTC).
///
/// Saturates at `i64::MAX` / `i64::MIN` instead of overflowing (PostgreSQL's `infinity`
/// timestamps are `i64::MAX` / `i64::MIN`).
#[must_use]
pub fn pg_time_to_unix_us(t: i64) -> i64 {
    t.saturating_add(PG_EPOCH_UNIX_US)
}

/// One decoded pgoutput message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LogicalMessage {
    /// `'B'`: the start of a transaction.
    Begin(Begin),
    /// `'C'`: the end of a transaction.
    Commit(Commit),
    /// `'M'`: a logical decoding message written by `pg_logical_emit_message`.
    Message(Message),
    /// Any other message, not parsed: Relation `'R'`, Insert `'I'`, Update `'U'`,
    /// Delete `'D'`, Truncate `'T'`, Type `'Y'`, Origin `'O'`, and any tag this decoder
    /// does not know (for example one introduced by a later protocol version). The caller
    /// should skip it; its content is not validated.
    Other {
        /// The message's first byte (its type tag), e.g. `b'I'`.
        tag: u8,
    },
}

/// A Begin message (`'B'`): Int64 final LSN, Int64 commit timestamp, Int32 xid.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Begin {
    /// The final LSN of the transaction (the LSN of its commit record).
    pub final_lsn: Lsn,
    /// Commit timestamp, µs since 2000-01-01 00:00 UTC (PostgreSQL epoch); see
    /// [`pg_time_to_unix_us`].
    pub commit_time_us: i64,
    /// The transaction id.
    pub xid: u32,
}

/// A Commit message (`'C'`): Int8 flags, Int64 commit LSN, Int64 end LSN, Int64 commit
/// timestamp.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Commit {
    /// Flags; currently always 0 (unused by PostgreSQL 15).
    pub flags: u8,
    /// The LSN of the commit record.
    pub commit_lsn: Lsn,
    /// The end LSN of the transaction: the position to confirm as flushed once everything
    /// in the transaction has been handled.
    pub end_lsn: Lsn,
    /// Commit timestamp, µs since 2000-01-01 00:00 UTC (PostgreSQL epoch).
    pub commit_time_us: i64,
}

/// A logical decoding Message (`'M'`): Int8 flags, Int64 LSN, String prefix, Int32 content
/// length, Byte*n* content.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Message {
    /// Whether the message was emitted transactionally (flags bit value 1): it is then
    /// delivered between the Begin and Commit of its transaction, and only if that
    /// transaction committed.
    pub transactional: bool,
    /// The LSN of the logical decoding message.
    pub lsn: Lsn,
    /// The prefix passed to `pg_logical_emit_message`, without its terminating NUL.
    pub prefix: Bytes,
    /// The content bytes (zero-copy slice of the input).
    pub content: Bytes,
}

impl Message {
    /// Whether the message's prefix is exactly `p` (byte comparison, no NUL).
    #[must_use]
    pub fn has_prefix(&self, p: &[u8]) -> bool {
        self.prefix.as_ref() == p
    }
}

/// Why a pgoutput message could not be decoded. Offsets are byte offsets into the message,
/// counting the tag byte as offset 0.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    /// The message had no bytes at all, not even a tag.
    #[error("empty pgoutput message: expected at least a one-byte type tag")]
    Empty,
    /// A field extends beyond the end of the message.
    #[error(
        "truncated pgoutput {message} message: {field} needs {needed} bytes at offset {offset}, \
         only {available} left"
    )]
    Truncated {
        /// The message kind, e.g. `"Begin"`.
        message: &'static str,
        /// The field being read.
        field: &'static str,
        /// Where the field starts.
        offset: usize,
        /// How many bytes the field needs.
        needed: usize,
        /// How many bytes remain from `offset`.
        available: usize,
    },
    /// A NUL-terminated string has no NUL before the end of the message.
    #[error(
        "pgoutput {message} message: {field} starting at offset {offset} has no terminating NUL"
    )]
    UnterminatedString {
        /// The message kind.
        message: &'static str,
        /// The string field.
        field: &'static str,
        /// Where the string starts.
        offset: usize,
    },
    /// An Int32 length field is negative.
    #[error("pgoutput {message} message: {field} at offset {offset} is negative ({length})")]
    NegativeLength {
        /// The message kind.
        message: &'static str,
        /// The length field.
        field: &'static str,
        /// Where the length field starts.
        offset: usize,
        /// The value read.
        length: i32,
    },
    /// Bytes remain after the last field of a fixed-layout message.
    #[error(
        "pgoutput {message} message has {trailing} unexpected trailing bytes at offset {offset}"
    )]
    TrailingBytes {
        /// The message kind.
        message: &'static str,
        /// Where the unexpected bytes start (the expected message length).
        offset: usize,
        /// How many bytes follow.
        trailing: usize,
    },
}

/// Decodes one pgoutput message (the `data` of one `XLogData`).
///
/// Follows PostgreSQL docs "Logical Streaming Replication Protocol / Logical Replication
/// Message Formats", protocol version 1. Begin, Commit and Message are decoded strictly;
/// every other tag, known or not, yields [`LogicalMessage::Other`] without further checks.
///
/// # Errors
/// [`DecodeError::Empty`] for empty input; [`DecodeError::Truncated`],
/// [`DecodeError::UnterminatedString`] or [`DecodeError::NegativeLength`] when a Begin,
/// Commit or Message is malformed; [`DecodeError::TrailingBytes`] when one of those has
/// bytes after its last field.
pub fn decode(data: Bytes) -> Result<LogicalMessage, DecodeError> {
    let Some(&tag) = data.first() else {
        return Err(DecodeError::Empty);
    };
    match tag {
        b'B' => {
            let mut c = Cursor::new(data, "Begin");
            let final_lsn = Lsn(c.u64("final LSN")?);
            let commit_time_us = c.i64("commit timestamp")?;
            let xid = c.u32("xid")?;
            c.finish()?;
            Ok(LogicalMessage::Begin(Begin {
                final_lsn,
                commit_time_us,
                xid,
            }))
        }
        b'C' => {
            let mut c = Cursor::new(data, "Commit");
            let flags = c.u8("flags")?;
            let commit_lsn = Lsn(c.u64("commit LSN")?);
            let end_lsn = Lsn(c.u64("end LSN")?);
            let commit_time_us = c.i64("commit timestamp")?;
            c.finish()?;
            Ok(LogicalMessage::Commit(Commit {
                flags,
                commit_lsn,
                end_lsn,
                commit_time_us,
            }))
        }
        b'M' => {
            let mut c = Cursor::new(data, "Message");
            let flags = c.u8("flags")?;
            let lsn = Lsn(c.u64("LSN")?);
            let prefix = c.cstring("prefix")?;
            let content = c.length_prefixed("content length")?;
            c.finish()?;
            Ok(LogicalMessage::Message(Message {
                transactional: flags & 1 != 0,
                lsn,
                prefix,
                content,
            }))
        }
        other => Ok(LogicalMessage::Other { tag: other }),
    }
}

/// A bounds-checked big-endian reader over one message; starts after the tag byte.
struct Cursor {
    data: Bytes,
    pos: usize,
    message: &'static str,
}

impl Cursor {
    fn new(data: Bytes, message: &'static str) -> Self {
        Cursor {
            data,
            pos: 1,
            message,
        }
    }

    fn truncated(&self, field: &'static str, needed: usize) -> DecodeError {
        DecodeError::Truncated {
            message: self.message,
            field,
            offset: self.pos,
            needed,
            available: self.data.len().saturating_sub(self.pos),
        }
    }

    /// Returns the next `n` bytes as a zero-copy slice and advances.
    fn take(&mut self, n: usize, field: &'static str) -> Result<Bytes, DecodeError> {
        let end = self
            .pos
            .checked_add(n)
            .filter(|&end| end <= self.data.len())
            .ok_or_else(|| self.truncated(field, n))?;
        let out = self.data.slice(self.pos..end);
        self.pos = end;
        Ok(out)
    }

    fn array<const N: usize>(&mut self, field: &'static str) -> Result<[u8; N], DecodeError> {
        let end = self.pos.saturating_add(N);
        let arr = self
            .data
            .get(self.pos..end)
            .and_then(|s| <[u8; N]>::try_from(s).ok())
            .ok_or_else(|| self.truncated(field, N))?;
        self.pos = end;
        Ok(arr)
    }

    fn u8(&mut self, field: &'static str) -> Result<u8, DecodeError> {
        Ok(u8::from_be_bytes(self.array(field)?))
    }

    fn u32(&mut self, field: &'static str) -> Result<u32, DecodeError> {
        Ok(u32::from_be_bytes(self.array(field)?))
    }

    fn i32(&mut self, field: &'static str) -> Result<i32, DecodeError> {
        Ok(i32::from_be_bytes(self.array(field)?))
    }

    fn u64(&mut self, field: &'static str) -> Result<u64, DecodeError> {
        Ok(u64::from_be_bytes(self.array(field)?))
    }

    fn i64(&mut self, field: &'static str) -> Result<i64, DecodeError> {
        Ok(i64::from_be_bytes(self.array(field)?))
    }

    /// A NUL-terminated string; returns it without the NUL and advances past the NUL.
    fn cstring(&mut self, field: &'static str) -> Result<Bytes, DecodeError> {
        let start = self.pos;
        let nul = self
            .data
            .get(start..)
            .and_then(|rest| rest.iter().position(|&b| b == 0))
            .ok_or(DecodeError::UnterminatedString {
                message: self.message,
                field,
                offset: start,
            })?;
        let s = self.take(nul, field)?;
        self.pos = self.pos.saturating_add(1); // the NUL, known to be in bounds
        Ok(s)
    }

    /// An Int32 length followed by that many bytes; the length is validated first.
    fn length_prefixed(&mut self, field: &'static str) -> Result<Bytes, DecodeError> {
        let offset = self.pos;
        let length = self.i32(field)?;
        let n = usize::try_from(length).map_err(|_| DecodeError::NegativeLength {
            message: self.message,
            field,
            offset,
            length,
        })?;
        self.take(n, "content")
    }

    fn finish(&self) -> Result<(), DecodeError> {
        let trailing = self.data.len().saturating_sub(self.pos);
        if trailing == 0 {
            Ok(())
        } else {
            Err(DecodeError::TrailingBytes {
                message: self.message,
                offset: self.pos,
                trailing,
            })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn begin_bytes() -> Vec<u8> {
        let mut v = vec![b'B'];
        v.extend_from_slice(&0x0000_0001_6B37_4D48u64.to_be_bytes());
        v.extend_from_slice(&786_000_000_123_456i64.to_be_bytes());
        v.extend_from_slice(&7_654_321u32.to_be_bytes());
        v
    }

    fn commit_bytes() -> Vec<u8> {
        let mut v = vec![b'C', 0];
        v.extend_from_slice(&0x0000_0001_6B37_4D48u64.to_be_bytes());
        v.extend_from_slice(&0x0000_0001_6B37_4D78u64.to_be_bytes());
        v.extend_from_slice(&786_000_000_123_456i64.to_be_bytes());
        v
    }

    fn message_bytes(flags: u8, prefix: &[u8], content: &[u8]) -> Vec<u8> {
        let mut v = vec![b'M', flags];
        v.extend_from_slice(&0x0000_0001_6B37_4D00u64.to_be_bytes());
        v.extend_from_slice(prefix);
        v.push(0);
        v.extend_from_slice(&i32::try_from(content.len()).unwrap().to_be_bytes());
        v.extend_from_slice(content);
        v
    }

    #[test]
    fn decodes_begin() {
        let m = decode(Bytes::from(begin_bytes())).unwrap();
        assert_eq!(
            m,
            LogicalMessage::Begin(Begin {
                final_lsn: Lsn(0x0000_0001_6B37_4D48),
                commit_time_us: 786_000_000_123_456,
                xid: 7_654_321,
            })
        );
    }

    #[test]
    fn decodes_commit() {
        let m = decode(Bytes::from(commit_bytes())).unwrap();
        assert_eq!(
            m,
            LogicalMessage::Commit(Commit {
                flags: 0,
                commit_lsn: Lsn(0x0000_0001_6B37_4D48),
                end_lsn: Lsn(0x0000_0001_6B37_4D78),
                commit_time_us: 786_000_000_123_456,
            })
        );
    }

    #[test]
    fn decodes_message_zero_copy() {
        let content = b"\x01\x00\x00\x00\x02{}\x00caf\xc3\xa9";
        let data = Bytes::from(message_bytes(1, b"pgoutbox", content));
        let LogicalMessage::Message(m) = decode(data.clone()).unwrap() else {
            panic!("expected a Message");
        };
        assert!(m.transactional);
        assert_eq!(m.lsn, Lsn(0x0000_0001_6B37_4D00));
        assert_eq!(m.prefix, Bytes::from_static(b"pgoutbox"));
        assert!(m.has_prefix(b"pgoutbox"));
        assert!(!m.has_prefix(b"pgoutbox\0"));
        assert!(!m.has_prefix(b"pgout"));
        assert_eq!(m.content.as_ref(), content);
        // Zero-copy: the content points into the input buffer.
        let base = data.as_ptr() as usize;
        let p = m.content.as_ptr() as usize;
        assert!(p >= base && p + m.content.len() <= base + data.len());
    }

    #[test]
    fn decodes_non_transactional_empty_message() {
        let data = Bytes::from(message_bytes(0, b"", b""));
        let LogicalMessage::Message(m) = decode(data).unwrap() else {
            panic!("expected a Message");
        };
        assert!(!m.transactional);
        assert!(m.prefix.is_empty());
        assert!(m.content.is_empty());
        assert!(m.has_prefix(b""));
    }

    #[test]
    fn other_tags_are_skipped() {
        for tag in [
            b'R', b'I', b'U', b'D', b'T', b'Y', b'O', b'S', b'Z', 0, 0xff,
        ] {
            // Even with a garbage or empty body.
            assert_eq!(
                decode(Bytes::from(vec![tag])).unwrap(),
                LogicalMessage::Other { tag }
            );
            assert_eq!(
                decode(Bytes::from(vec![tag, 1, 2, 3])).unwrap(),
                LogicalMessage::Other { tag }
            );
        }
    }

    #[test]
    fn empty_is_an_error() {
        assert_eq!(decode(Bytes::new()), Err(DecodeError::Empty));
    }

    #[test]
    fn every_truncation_is_an_error() {
        for full in [
            begin_bytes(),
            commit_bytes(),
            message_bytes(1, b"pgoutbox", b"hello\0world"),
            message_bytes(0, b"", b""),
        ] {
            assert!(decode(Bytes::from(full.clone())).is_ok());
            for n in 0..full.len() {
                let r = decode(Bytes::copy_from_slice(&full[..n]));
                assert!(
                    r.is_err(),
                    "prefix of {n}/{} bytes decoded: {r:?}",
                    full.len()
                );
            }
        }
    }

    #[test]
    fn trailing_bytes_are_an_error() {
        for mut full in [
            begin_bytes(),
            commit_bytes(),
            message_bytes(1, b"pgoutbox", b"x"),
        ] {
            let len = full.len();
            full.push(0);
            assert_eq!(
                decode(Bytes::from(full)).unwrap_err(),
                DecodeError::TrailingBytes {
                    message: match len {
                        21 => "Begin",
                        26 => "Commit",
                        _ => "Message",
                    },
                    offset: len,
                    trailing: 1,
                }
            );
        }
    }

    #[test]
    fn truncated_error_names_field_and_offset() {
        let full = begin_bytes();
        let err = decode(Bytes::copy_from_slice(&full[..12])).unwrap_err();
        assert_eq!(
            err,
            DecodeError::Truncated {
                message: "Begin",
                field: "commit timestamp",
                offset: 9,
                needed: 8,
                available: 3,
            }
        );
        assert_eq!(
            err.to_string(),
            "truncated pgoutput Begin message: commit timestamp needs 8 bytes at offset 9, only 3 left"
        );
    }

    #[test]
    fn negative_content_length() {
        let mut v = message_bytes(1, b"pgoutbox", b"");
        let at = v.len() - 4;
        v[at..].copy_from_slice(&(-1i32).to_be_bytes());
        assert_eq!(
            decode(Bytes::from(v)).unwrap_err(),
            DecodeError::NegativeLength {
                message: "Message",
                field: "content length",
                offset: at,
                length: -1,
            }
        );
        let mut v = message_bytes(1, b"p", b"");
        let at = v.len() - 4;
        v[at..].copy_from_slice(&i32::MIN.to_be_bytes());
        assert!(matches!(
            decode(Bytes::from(v)),
            Err(DecodeError::NegativeLength {
                length: i32::MIN,
                ..
            })
        ));
    }

    #[test]
    fn huge_content_length() {
        let mut v = message_bytes(1, b"pgoutbox", b"abc");
        let at = v.len() - 3 - 4;
        v[at..at + 4].copy_from_slice(&i32::MAX.to_be_bytes());
        assert_eq!(
            decode(Bytes::from(v)).unwrap_err(),
            DecodeError::Truncated {
                message: "Message",
                field: "content",
                offset: at + 4,
                needed: i32::MAX as usize,
                available: 3,
            }
        );
        // One byte too long.
        let mut v = message_bytes(1, b"pgoutbox", b"abc");
        v[at..at + 4].copy_from_slice(&4i32.to_be_bytes());
        assert!(matches!(
            decode(Bytes::from(v)),
            Err(DecodeError::Truncated {
                field: "content",
                needed: 4,
                available: 3,
                ..
            })
        ));
    }

    #[test]
    fn unterminated_prefix() {
        let mut v = vec![b'M', 1];
        v.extend_from_slice(&1u64.to_be_bytes());
        v.extend_from_slice(b"pgoutbox");
        assert_eq!(
            decode(Bytes::from(v)).unwrap_err(),
            DecodeError::UnterminatedString {
                message: "Message",
                field: "prefix",
                offset: 10,
            }
        );
    }

    #[test]
    fn flags_bit_one_means_transactional() {
        for (flags, tx) in [(0u8, false), (1, true), (2, false), (3, true)] {
            let LogicalMessage::Message(m) =
                decode(Bytes::from(message_bytes(flags, b"p", b"c"))).unwrap()
            else {
                panic!("expected a Message");
            };
            assert_eq!(m.transactional, tx, "flags {flags}");
        }
    }

    #[test]
    fn time_conversion() {
        assert_eq!(pg_time_to_unix_us(0), 946_684_800_000_000);
        assert_eq!(pg_time_to_unix_us(-PG_EPOCH_UNIX_US), 0);
        assert_eq!(pg_time_to_unix_us(i64::MAX), i64::MAX);
        assert_eq!(pg_time_to_unix_us(i64::MIN), i64::MIN + PG_EPOCH_UNIX_US);
    }

    #[test]
    fn arbitrary_bytes_never_panic() {
        // A cheap deterministic fuzz: mutate valid messages byte by byte.
        let seeds = [
            begin_bytes(),
            commit_bytes(),
            message_bytes(1, b"pgoutbox", b"payload"),
        ];
        for seed in seeds {
            for i in 0..seed.len() {
                for b in [0u8, 1, 0x7f, 0x80, 0xff] {
                    let mut v = seed.clone();
                    v[i] = b;
                    let _ = decode(Bytes::from(v));
                }
            }
        }
    }
}
