//! Fuzzes the CopyData body parser of the replication stream
//! (`pgoutbox::replication::stream::parse_copy_data`): XLogData and primary keepalive.
//!
//! Invariants beyond "never panics": an XLogData's data is exactly the input after the
//! 25-byte header and its LSNs are the header's; a keepalive is exactly 18 bytes.
#![no_main]

use bytes::Bytes;
use libfuzzer_sys::fuzz_target;
use pgoutbox::replication::stream::{parse_copy_data, ReplicationMessage};

/// XLogData header: tag, Int64 start, Int64 end, Int64 clock.
const XLOG_HEADER_LEN: usize = 25;
/// Primary keepalive: tag, Int64 end, Int64 clock, Byte1 reply requested.
const KEEPALIVE_LEN: usize = 18;

fn be_u64(data: &[u8], at: usize) -> u64 {
    let mut b = [0u8; 8];
    b.copy_from_slice(&data[at..at + 8]);
    u64::from_be_bytes(b)
}

fuzz_target!(|data: &[u8]| {
    match parse_copy_data(Bytes::copy_from_slice(data)) {
        Ok(ReplicationMessage::XLogData {
            wal_start,
            wal_end,
            data: payload,
            ..
        }) => {
            assert!(data.len() >= XLOG_HEADER_LEN);
            assert_eq!(data[0], b'w');
            assert_eq!(payload.as_ref(), &data[XLOG_HEADER_LEN..]);
            assert_eq!(wal_start.0, be_u64(data, 1));
            assert_eq!(wal_end.0, be_u64(data, 9));
        }
        Ok(ReplicationMessage::PrimaryKeepalive {
            wal_end,
            reply_requested,
            ..
        }) => {
            assert_eq!(data.len(), KEEPALIVE_LEN);
            assert_eq!(data[0], b'k');
            assert_eq!(wal_end.0, be_u64(data, 1));
            assert_eq!(reply_requested, data[17] != 0);
        }
        Err(e) => assert!(!e.to_string().is_empty()),
    }
});
