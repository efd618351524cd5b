//! Fuzzes the replication stream's parsers with the same bytes read two ways: as one
//! CopyData body (`stream::parse_copy_data`: XLogData and primary keepalive) and as a
//! CopyBoth byte stream (`session::parse_stream_frame`: the framing around it, errors,
//! notices, the end of the stream).
//!
//! Invariants beyond "never panics": an XLogData's data is exactly the body after the
//! 25-byte header and its LSNs are the header's; a keepalive is exactly 18 bytes; a frame
//! parsed off the stream consumed at least its header and payload, and an incomplete one
//! consumed nothing but the notices before it.
#![no_main]

use bytes::{Bytes, BytesMut};
use libfuzzer_sys::fuzz_target;
use pgoutbox::replication::session::parse_stream_frame;
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

    let mut stream = BytesMut::from(data);
    loop {
        let before = stream.len();
        match parse_stream_frame(&mut stream) {
            Ok(Some(msg)) => {
                let consumed = before - stream.len();
                let payload = match msg {
                    ReplicationMessage::XLogData { data, .. } => XLOG_HEADER_LEN + data.len(),
                    ReplicationMessage::PrimaryKeepalive { .. } => KEEPALIVE_LEN,
                };
                // 'd', Int32 length, the body; notices before it may have been consumed too.
                assert!(consumed >= 5 + payload, "consumed {consumed} for {payload}");
            }
            Ok(None) => {
                assert!(stream.len() <= before);
                if let Some(header) = stream.get(..5) {
                    let declared = u32::from_be_bytes([header[1], header[2], header[3], header[4]]);
                    assert!(
                        declared as usize + 1 > stream.len(),
                        "a complete frame was left"
                    );
                }
                break;
            }
            Err(e) => {
                assert!(!e.to_string().is_empty());
                break;
            }
        }
    }
});
