//! Sans-IO codecs for the CopyData payloads of the streaming replication protocol.
//!
//! After `START_REPLICATION` the connection is in CopyBoth mode. Every message the server
//! sends is a CopyData (`'d'`) whose body is either an XLogData (`'w'`) or a Primary
//! keepalive (`'k'`) message; the client answers with Standby status updates (`'r'`),
//! also wrapped in CopyData. Formats follow the PostgreSQL documentation, "Streaming
//! Replication Protocol" (PostgreSQL 15). All integers are big-endian; timestamps are
//! microseconds since 2000-01-01 00:00 UTC (the PostgreSQL epoch, see
//! [`crate::pgoutput::PG_EPOCH_UNIX_US`]).
//!
//! The CopyData framing of server messages is parsed elsewhere (by `postgres-protocol`);
//! [`parse_copy_data`] takes the body. [`StandbyStatusUpdate::encode_copy_data`] writes the
//! whole frontend CopyData frame, because the client side has no other framing helper.
//! Parsing never panics on input and returns zero-copy [`Bytes`] slices.

use std::time::{SystemTime, UNIX_EPOCH};

use bytes::{BufMut, Bytes, BytesMut};

use crate::lsn::Lsn;
use crate::pgoutput::PG_EPOCH_UNIX_US;

/// Length of an XLogData header: tag, Int64 start, Int64 end, Int64 clock (bytes).
const XLOG_DATA_HEADER_LEN: usize = 1 + 8 + 8 + 8;
/// Exact length of a Primary keepalive message: tag, Int64 end, Int64 clock, Byte1 (bytes).
const KEEPALIVE_LEN: usize = 1 + 8 + 8 + 1;

/// One server message carried in a CopyData body on a replication connection.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ReplicationMessage {
    /// XLogData (`'w'`): Int64 start, Int64 current end of WAL on the server, Int64 server
    /// clock, Byte*n* data. For logical replication `data` is one pgoutput message
    /// (see [`crate::pgoutput::decode`]).
    XLogData {
        /// The WAL position (LSN) of the start of `data`.
        wal_start: Lsn,
        /// The current end of WAL on the server (LSN).
        wal_end: Lsn,
        /// The server's clock at transmission, µs since 2000-01-01 00:00 UTC.
        server_time_us: i64,
        /// The payload: a zero-copy slice of the body after the 25-byte header.
        data: Bytes,
    },
    /// Primary keepalive message (`'k'`): Int64 end of WAL, Int64 server clock, Byte1
    /// reply requested.
    PrimaryKeepalive {
        /// The current end of WAL on the server (LSN).
        wal_end: Lsn,
        /// The server's clock at transmission, µs since 2000-01-01 00:00 UTC.
        server_time_us: i64,
        /// Whether the server asks for a Standby status update as soon as possible (to
        /// avoid a timeout disconnect). Any non-zero byte counts as a request; PostgreSQL
        /// sends 0 or 1.
        reply_requested: bool,
    },
}

/// Why a CopyData body is not a valid replication message.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FrameError {
    /// The CopyData body had no bytes at all.
    #[error("empty CopyData body on the replication stream: expected a one-byte message tag")]
    Empty,
    /// The first byte is neither `'w'` (XLogData) nor `'k'` (Primary keepalive).
    #[error(
        "unknown replication message tag 0x{tag:02x} at offset 0: expected 'w' (XLogData) or \
         'k' (Primary keepalive)"
    )]
    UnknownTag {
        /// The byte found.
        tag: u8,
    },
    /// An XLogData body is shorter than its fixed header.
    #[error(
        "truncated XLogData: the header needs {expected} bytes from offset 0, the body has only \
         {actual}"
    )]
    TruncatedXLogData {
        /// The header length, 25 bytes.
        expected: usize,
        /// The body length in bytes.
        actual: usize,
    },
    /// A Primary keepalive body does not have its fixed length.
    #[error("Primary keepalive must be exactly {expected} bytes, got {actual}")]
    KeepaliveLength {
        /// The required length, 18 bytes.
        expected: usize,
        /// The body length in bytes.
        actual: usize,
    },
}

/// Parses the body of one server CopyData message on a replication connection.
///
/// Follows PostgreSQL docs "Streaming Replication Protocol" (XLogData, Primary keepalive
/// message). The returned `data` of an XLogData is a zero-copy slice of `body`.
///
/// # Errors
/// [`FrameError::Empty`] for an empty body, [`FrameError::UnknownTag`] for a tag other than
/// `'w'`/`'k'`, [`FrameError::TruncatedXLogData`] for an XLogData shorter than 25 bytes,
/// [`FrameError::KeepaliveLength`] for a keepalive that is not exactly 18 bytes.
pub fn parse_copy_data(body: Bytes) -> Result<ReplicationMessage, FrameError> {
    let Some(&tag) = body.first() else {
        return Err(FrameError::Empty);
    };
    match tag {
        b'w' => {
            let header = body
                .get(..XLOG_DATA_HEADER_LEN)
                .ok_or(FrameError::TruncatedXLogData {
                    expected: XLOG_DATA_HEADER_LEN,
                    actual: body.len(),
                })?;
            let (wal_start, wal_end, server_time) = (
                be8(header, 1).unwrap_or_default(),
                be8(header, 9).unwrap_or_default(),
                be8(header, 17).unwrap_or_default(),
            );
            Ok(ReplicationMessage::XLogData {
                wal_start: Lsn(u64::from_be_bytes(wal_start)),
                wal_end: Lsn(u64::from_be_bytes(wal_end)),
                server_time_us: i64::from_be_bytes(server_time),
                data: body.slice(XLOG_DATA_HEADER_LEN..),
            })
        }
        b'k' => {
            if body.len() != KEEPALIVE_LEN {
                return Err(FrameError::KeepaliveLength {
                    expected: KEEPALIVE_LEN,
                    actual: body.len(),
                });
            }
            Ok(ReplicationMessage::PrimaryKeepalive {
                wal_end: Lsn(u64::from_be_bytes(be8(&body, 1).unwrap_or_default())),
                server_time_us: i64::from_be_bytes(be8(&body, 9).unwrap_or_default()),
                reply_requested: body.get(17).is_some_and(|&b| b != 0),
            })
        }
        other => Err(FrameError::UnknownTag { tag: other }),
    }
}

/// The 8 bytes at `at`, or `None` when they are not all in `buf`.
fn be8(buf: &[u8], at: usize) -> Option<[u8; 8]> {
    buf.get(at..at.checked_add(8)?)?.try_into().ok()
}

/// Why a Standby status update is sent; decides the reply-requested byte.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum StatusUpdateKind {
    /// A regular progress report, sent on a timer or after confirming new positions.
    Periodic,
    /// The answer to a Primary keepalive that had `reply_requested` set.
    KeepaliveReply,
    /// The last update of a session that stops (a clean shutdown, or a drain that ran out
    /// of time): `flush` is the watermark capped by what `outbox.stream_state` recorded,
    /// after the pipeline waited briefly for the record to catch up
    /// (`crate::pipeline`'s status sender). Nothing waits for the server's answer: CopyDone
    /// and Terminate follow at once, and the walsender handles this update before the
    /// CopyDone behind it on the socket.
    ShutdownFlush,
    /// A periodic update sent while nothing is pending and the flush position is behind the
    /// newest WAL position seen: it asks the server for a primary keepalive, whose `walEnd`
    /// the idle watermark may then take (the walsender would otherwise send none).
    IdleProbe,
}

impl StatusUpdateKind {
    /// Whether the update asks the server to reply immediately (the reply-requested byte).
    ///
    /// True for [`StatusUpdateKind::IdleProbe`], whose point is the keepalive it brings.
    /// True for [`StatusUpdateKind::ShutdownFlush`] as well, although the session does not
    /// wait for that answer (it closes right after; see the variant): the walsender's reply
    /// costs one keepalive. Asking for replies in the other cases would only add traffic.
    #[must_use]
    pub fn request_reply(self) -> bool {
        matches!(
            self,
            StatusUpdateKind::ShutdownFlush | StatusUpdateKind::IdleProbe
        )
    }
}

/// A Standby status update (`'r'`), sent by the client inside a CopyData message.
///
/// For logical replication, `flush` is the position the server may treat as durably
/// handled: it advances the slot's `confirmed_flush_lsn`, after which WAL before it may be
/// recycled and will not be resent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StandbyStatusUpdate {
    /// The last WAL byte + 1 received and written (LSN).
    pub write: Lsn,
    /// The last WAL byte + 1 flushed, i.e. durably handled (LSN).
    pub flush: Lsn,
    /// The last WAL byte + 1 applied (LSN).
    pub apply: Lsn,
    /// The client's clock at transmission, µs since 2000-01-01 00:00 UTC; see
    /// [`now_pg_time_us`].
    pub client_time_us: i64,
    /// Why it is sent; sets the reply-requested byte via [`StatusUpdateKind::request_reply`].
    pub kind: StatusUpdateKind,
}

impl StandbyStatusUpdate {
    /// Total size in bytes of the frame written by [`Self::encode_copy_data`]: `'d'`, Int32
    /// length, and the 34-byte `'r'` message.
    pub const ENCODED_LEN: usize = 1 + 4 + 1 + 8 * 4 + 1;

    /// Appends the whole frontend CopyData frame to `out`: `'d'`, Int32 length (38,
    /// including itself), then `'r'`, Int64 write, Int64 flush, Int64 apply, Int64 client
    /// time (µs since 2000-01-01), Byte1 reply requested (1 or 0).
    ///
    /// Follows PostgreSQL docs "Streaming Replication Protocol" (Standby status update) and
    /// "Message Formats" (CopyData). Writes exactly [`Self::ENCODED_LEN`] bytes.
    pub fn encode_copy_data(&self, out: &mut BytesMut) {
        const BODY_LEN: i32 = 4 + 1 + 8 * 4 + 1;
        out.reserve(Self::ENCODED_LEN);
        out.put_u8(b'd');
        out.put_i32(BODY_LEN);
        out.put_u8(b'r');
        out.put_u64(self.write.0);
        out.put_u64(self.flush.0);
        out.put_u64(self.apply.0);
        out.put_i64(self.client_time_us);
        out.put_u8(u8::from(self.kind.request_reply()));
    }
}

/// The current system time in µs since 2000-01-01 00:00 UTC (the PostgreSQL epoch), as
/// used in the replication protocol's clock fields.
///
/// A clock set before 1970 gives a correspondingly smaller (more negative) value; the
/// result saturates instead of overflowing.
#[must_use]
pub fn now_pg_time_us() -> i64 {
    let unix_us = match SystemTime::now().duration_since(UNIX_EPOCH) {
        Ok(d) => i64::try_from(d.as_micros()).unwrap_or(i64::MAX),
        Err(e) => i64::try_from(e.duration().as_micros()).map_or(i64::MIN, |us| -us),
    };
    unix_us.saturating_sub(PG_EPOCH_UNIX_US)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn xlog_bytes(data: &[u8]) -> Vec<u8> {
        let mut v = vec![b'w'];
        v.extend_from_slice(&0x0000_0002_0000_0010u64.to_be_bytes());
        v.extend_from_slice(&0x0000_0002_0000_0100u64.to_be_bytes());
        v.extend_from_slice(&786_000_000_000_001i64.to_be_bytes());
        v.extend_from_slice(data);
        v
    }

    fn keepalive_bytes(reply: u8) -> Vec<u8> {
        let mut v = vec![b'k'];
        v.extend_from_slice(&0x0000_0002_0000_0100u64.to_be_bytes());
        v.extend_from_slice(&(-5i64).to_be_bytes());
        v.push(reply);
        v
    }

    #[test]
    fn parses_xlog_data_zero_copy() {
        let body = Bytes::from(xlog_bytes(b"B\x00\x01"));
        let m = parse_copy_data(body.clone()).unwrap();
        let ReplicationMessage::XLogData {
            wal_start,
            wal_end,
            server_time_us,
            data,
        } = m
        else {
            panic!("expected XLogData");
        };
        assert_eq!(wal_start, Lsn(0x0000_0002_0000_0010));
        assert_eq!(wal_end, Lsn(0x0000_0002_0000_0100));
        assert_eq!(server_time_us, 786_000_000_000_001);
        assert_eq!(data.as_ref(), b"B\x00\x01");
        assert_eq!(data.as_ptr(), body[25..].as_ptr());
    }

    #[test]
    fn xlog_data_may_be_empty() {
        let m = parse_copy_data(Bytes::from(xlog_bytes(b""))).unwrap();
        assert!(matches!(m, ReplicationMessage::XLogData { data, .. } if data.is_empty()));
    }

    #[test]
    fn parses_keepalive() {
        for (byte, reply) in [(0u8, false), (1, true), (2, true)] {
            assert_eq!(
                parse_copy_data(Bytes::from(keepalive_bytes(byte))).unwrap(),
                ReplicationMessage::PrimaryKeepalive {
                    wal_end: Lsn(0x0000_0002_0000_0100),
                    server_time_us: -5,
                    reply_requested: reply,
                }
            );
        }
    }

    #[test]
    fn every_truncation_is_an_error() {
        for full in [xlog_bytes(b""), keepalive_bytes(1)] {
            for n in 0..full.len() {
                let r = parse_copy_data(Bytes::copy_from_slice(&full[..n]));
                assert!(r.is_err(), "{n}-byte prefix parsed: {r:?}");
            }
        }
        assert_eq!(parse_copy_data(Bytes::new()), Err(FrameError::Empty));
        assert_eq!(
            parse_copy_data(Bytes::from_static(b"w\0\0")),
            Err(FrameError::TruncatedXLogData {
                expected: 25,
                actual: 3
            })
        );
    }

    #[test]
    fn keepalive_with_extra_bytes_is_an_error() {
        let mut v = keepalive_bytes(0);
        v.push(0);
        assert_eq!(
            parse_copy_data(Bytes::from(v)),
            Err(FrameError::KeepaliveLength {
                expected: 18,
                actual: 19
            })
        );
    }

    #[test]
    fn unknown_tag_is_an_error() {
        for tag in [b'r', b'd', b'x', 0, 0xff] {
            let mut v = keepalive_bytes(0);
            v[0] = tag;
            assert_eq!(
                parse_copy_data(Bytes::from(v)),
                Err(FrameError::UnknownTag { tag })
            );
        }
        assert_eq!(
            FrameError::UnknownTag { tag: b'r' }.to_string(),
            "unknown replication message tag 0x72 at offset 0: expected 'w' (XLogData) or 'k' \
             (Primary keepalive)"
        );
    }

    #[test]
    fn encodes_status_update_frame() {
        let u = StandbyStatusUpdate {
            write: Lsn(0x0000_0001_0000_0002),
            flush: Lsn(0x0000_0003_0000_0004),
            apply: Lsn(0x0000_0005_0000_0006),
            client_time_us: 0x0102_0304_0506_0708,
            kind: StatusUpdateKind::Periodic,
        };
        let mut out = BytesMut::from(&b"xx"[..]);
        u.encode_copy_data(&mut out);
        let expected: &[u8] = &[
            b'x', b'x', // pre-existing content is kept
            b'd', 0, 0, 0, 38, b'r', //
            0, 0, 0, 1, 0, 0, 0, 2, //
            0, 0, 0, 3, 0, 0, 0, 4, //
            0, 0, 0, 5, 0, 0, 0, 6, //
            1, 2, 3, 4, 5, 6, 7, 8, //
            0,
        ];
        assert_eq!(out.as_ref(), expected);
        assert_eq!(out.len() - 2, StandbyStatusUpdate::ENCODED_LEN);
        // Length field counts itself and the body but not the 'd'.
        assert_eq!(
            i32::from_be_bytes([out[3], out[4], out[5], out[6]]) as usize,
            out.len() - 2 - 1
        );
    }

    #[test]
    fn reply_requested_only_for_shutdown_flush() {
        assert!(!StatusUpdateKind::Periodic.request_reply());
        assert!(!StatusUpdateKind::KeepaliveReply.request_reply());
        assert!(StatusUpdateKind::ShutdownFlush.request_reply());
        for (kind, byte) in [
            (StatusUpdateKind::Periodic, 0u8),
            (StatusUpdateKind::KeepaliveReply, 0),
            (StatusUpdateKind::ShutdownFlush, 1),
        ] {
            let mut out = BytesMut::new();
            StandbyStatusUpdate {
                write: Lsn::ZERO,
                flush: Lsn::ZERO,
                apply: Lsn::ZERO,
                client_time_us: 0,
                kind,
            }
            .encode_copy_data(&mut out);
            assert_eq!(out.last(), Some(&byte));
        }
    }

    #[test]
    fn now_counts_from_the_postgres_epoch() {
        // 1970-01-01 to 2000-01-01: 30 years of 365 days plus 7 leap days (1972 ... 1996),
        // worked out here rather than taken from the constant under test.
        const PG_EPOCH_UNIX_S: u64 = (30 * 365 + 7) * 86_400;
        assert_eq!(PG_EPOCH_UNIX_S, 946_684_800);
        let unix_us = || {
            let d = SystemTime::now().duration_since(UNIX_EPOCH).unwrap();
            i64::try_from(d.as_micros()).unwrap()
        };
        let offset_us = i64::try_from(PG_EPOCH_UNIX_S * 1_000_000).unwrap();
        let before = unix_us() - offset_us;
        let now = now_pg_time_us();
        let after = unix_us() - offset_us;
        // The system clock may be stepped between the readings: allow a second either way,
        // far less than the 30 years a missing or doubled offset is off by.
        let tolerance_us = 1_000_000;
        assert!(
            before - tolerance_us <= now && now <= after + tolerance_us,
            "now_pg_time_us() = {now}, expected between {before} and {after} \
             (system time minus {PG_EPOCH_UNIX_S} s)"
        );
        // 2020-01-01 is 631_152_000 s after 2000-01-01.
        assert!(now > 631_152_000_000_000, "{now}");
    }
}
