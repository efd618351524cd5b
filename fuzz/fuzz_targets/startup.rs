//! Fuzzes the start-up and authentication handling of the replication connection: the
//! framing of server messages before COPY BOTH (`parse_backend_message`) and the client's
//! state machine (`Startup::step`), fed one message at a time as `connect` feeds them.
//!
//! Input: byte 0 chooses whether the URL has a password (bit 0); the rest is what the server
//! sends. Invariants beyond "never panics": parsing consumes at least one byte per message
//! and never more than it has; a step that asks to send appended at least one well-framed
//! frontend message, and the others appended nothing.
//!
//! The SCRAM exchange cannot get past the server-first nonce check here: the client nonce
//! is random, so the fuzzer cannot echo it.
#![no_main]

use bytes::BytesMut;
use libfuzzer_sys::fuzz_target;
use pgoutbox::replication::connect::{parse_backend_message, BackendFrame, Startup, StartupStep};

/// Checks that `out` is a sequence of complete frontend messages: tag, Int32 length that
/// counts itself and the body.
fn assert_framed(out: &[u8]) {
    let mut rest = out;
    while !rest.is_empty() {
        assert!(rest.len() >= 5, "a frontend message has a 5-byte header");
        let len = u32::from_be_bytes([rest[1], rest[2], rest[3], rest[4]]) as usize;
        assert!(
            len >= 4 && len < rest.len(),
            "frontend length {len} fits the buffer"
        );
        rest = &rest[len + 1..];
    }
}

fuzz_target!(|data: &[u8]| {
    let Some((&flags, server)) = data.split_first() else {
        return;
    };
    let password: Option<&[u8]> = (flags & 1 != 0).then_some(b"secret".as_slice());
    let mut startup = Startup::new("fuzz", password);
    let mut buf = BytesMut::from(server);
    let mut out = BytesMut::new();
    loop {
        let before = buf.len();
        let frame = match parse_backend_message(&mut buf, "fuzzing") {
            Ok(Some(frame)) => frame,
            Ok(None) => {
                assert_eq!(buf.len(), before, "an incomplete message is not consumed");
                return;
            }
            Err(e) => {
                assert!(!e.to_string().is_empty());
                return;
            }
        };
        assert!(buf.len() < before, "a parsed message consumed bytes");
        let BackendFrame::Message(msg) = frame else {
            // connect() treats CopyBothResponse during start-up as a protocol violation.
            return;
        };
        out.clear();
        match startup.step(msg, &mut out) {
            Ok(StartupStep::Wait) => assert!(out.is_empty()),
            Ok(StartupStep::Send { context }) => {
                assert!(!out.is_empty() && !context.is_empty());
                assert_framed(&out);
            }
            Ok(StartupStep::Ready) => {
                assert!(out.is_empty());
                return;
            }
            Err(e) => {
                assert!(!e.to_string().is_empty());
                return;
            }
        }
    }
});
