//! Fuzzes the stream publisher's read side: bytes from the broker are framed
//! (`stream_publisher::frames::frame_len`) and decoded (`frames::decode`), the way
//! `StreamSink` reads them.
//!
//! Invariants beyond "never panics": a frame is never longer than `frame_max` nor shorter than
//! its size prefix, key and version; a decoded confirm or error list fits in its frame (8 or
//! 10 bytes per id), so a hostile count allocates nothing it cannot fill; decoding the same
//! frame twice gives the same answer.
#![no_main]

use libfuzzer_sys::fuzz_target;
use pgoutbox::stream_publisher::frames::{decode, frame_len, ServerFrame};

const FRAME_MAX: u32 = 4096;

fuzz_target!(|data: &[u8]| {
    let mut buf = data;
    loop {
        let len = match frame_len(buf, FRAME_MAX) {
            Ok(Some(len)) => len,
            Ok(None) | Err(_) => break,
        };
        assert!(len <= FRAME_MAX as usize + 4 && len >= 8 && len <= buf.len());
        let frame = &buf[..len];
        let decoded = decode(frame);
        match &decoded {
            Ok(ServerFrame::PublishConfirm { ids, .. }) => assert!(ids.len() * 8 <= len),
            Ok(ServerFrame::PublishError { errors, .. }) => assert!(errors.len() * 10 <= len),
            _ => {}
        }
        assert_eq!(decoded, decode(frame));
        buf = &buf[len..];
    }
});
