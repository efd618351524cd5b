//! Fuzzes the pgoutput decoder (`pgoutbox::pgoutput::decode`) with one XLogData payload.
//!
//! Invariants beyond "never panics": a decoded Message's prefix and content are slices of
//! the input (their lengths fit in it, with the fixed fields around them), the prefix has no
//! NUL, and Begin/Commit only decode from exactly their fixed lengths.
#![no_main]

use bytes::Bytes;
use libfuzzer_sys::fuzz_target;
use pgoutbox::pgoutput::{decode, LogicalMessage};

/// Begin: tag, Int64 final LSN, Int64 timestamp, Int32 xid.
const BEGIN_LEN: usize = 1 + 8 + 8 + 4;
/// Commit: tag, Int8 flags, Int64 commit LSN, Int64 end LSN, Int64 timestamp.
const COMMIT_LEN: usize = 1 + 1 + 8 + 8 + 8;
/// Message without its strings: tag, Int8 flags, Int64 LSN, prefix NUL, Int32 length.
const MESSAGE_FIXED_LEN: usize = 1 + 1 + 8 + 1 + 4;

fuzz_target!(|data: &[u8]| {
    let input = Bytes::copy_from_slice(data);
    match decode(input.clone()) {
        Ok(LogicalMessage::Begin(_)) => assert_eq!(data.len(), BEGIN_LEN),
        Ok(LogicalMessage::Commit(_)) => assert_eq!(data.len(), COMMIT_LEN),
        Ok(LogicalMessage::Message(m)) => {
            assert_eq!(
                m.prefix.len() + m.content.len() + MESSAGE_FIXED_LEN,
                data.len(),
                "a Message's strings and fixed fields are the whole input"
            );
            assert!(!m.prefix.contains(&0), "the prefix stops at the first NUL");
            assert_eq!(m.transactional, data[1] & 1 != 0);
            assert!(
                data.ends_with(&m.content),
                "content is the tail of the input"
            );
        }
        Ok(LogicalMessage::Other { tag }) => {
            assert!(!matches!(tag, b'B' | b'C' | b'M'));
            assert_eq!(Some(&tag), data.first());
        }
        Err(e) => {
            // Every error renders without panicking and says what it is about.
            assert!(!e.to_string().is_empty());
        }
    }
});
