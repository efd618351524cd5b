//! Fuzzes the publisher's read side: bytes from the broker are framed
//! (`publisher::wire::frame_len`), decoded (`wire::decode`, amq-protocol) and applied to the
//! settling state machine (`publisher::confirms::Confirms`) holding 64 unsettled publishes,
//! the way the publisher does it.
//!
//! Invariants beyond "never panics": a frame is never longer than `frame_max`; every publish
//! is settled at most once, and settled plus unsettled always equals what was published; a
//! violation settles nothing.
#![no_main]

use amq_protocol::frame::AMQPFrame;
use amq_protocol::protocol::{basic, AMQPClass};
use libfuzzer_sys::fuzz_target;
use pgoutbox::lsn::Lsn;
use pgoutbox::publisher::confirms::{Confirms, ReturnedKey};
use pgoutbox::publisher::wire::{decode, frame_len};
use pgoutbox::publisher::MatchKey;

const PUBLISHED: u32 = 64;
const FRAME_MAX: u32 = 4096;

fuzz_target!(|data: &[u8]| {
    let mut confirms: Confirms<u32> = Confirms::default();
    for i in 0..PUBLISHED {
        let key = if i % 2 == 0 {
            MatchKey::Lsn(Lsn(u64::from(i) * 16))
        } else {
            MatchKey::MessageId(format!("id-{}", i % 5).into())
        };
        confirms.published(i, key);
    }
    let mut settled = vec![false; PUBLISHED as usize];
    let mut out = Vec::new();
    let mut return_pending: Option<(u16, String)> = None;
    let mut buf = data;
    loop {
        let len = match frame_len(buf, FRAME_MAX) {
            Ok(Some(len)) => len,
            Ok(None) | Err(_) => break,
        };
        assert!(len <= FRAME_MAX as usize && len >= 8);
        let frame = decode(&buf[..len]);
        buf = &buf[len..];
        let before = confirms.unsettled();
        let result = match frame {
            Ok(AMQPFrame::Method(_, AMQPClass::Basic(basic::AMQPMethod::Ack(a)))) => confirms
                .ack(a.delivery_tag, a.multiple, &mut out)
                .map(|_| ()),
            Ok(AMQPFrame::Method(_, AMQPClass::Basic(basic::AMQPMethod::Nack(n)))) => confirms
                .nack(n.delivery_tag, n.multiple, &mut out)
                .map(|_| ()),
            Ok(AMQPFrame::Method(_, AMQPClass::Basic(basic::AMQPMethod::Return(r)))) => {
                return_pending = Some((r.reply_code, r.reply_text.as_str().to_owned()));
                Ok(())
            }
            Ok(AMQPFrame::Header(_, h)) => match return_pending.take() {
                Some((code, text)) => {
                    let lsn = h
                        .properties
                        .headers()
                        .as_ref()
                        .and_then(|t| t.inner().get("x-pgoutbox-lsn").cloned());
                    let lsn = match lsn {
                        Some(amq_protocol::types::AMQPValue::LongString(s)) => {
                            std::str::from_utf8(s.as_bytes())
                                .ok()
                                .and_then(|s| s.parse().ok())
                        }
                        _ => None,
                    };
                    let id = h
                        .properties
                        .message_id()
                        .as_ref()
                        .map(|s| s.as_str().to_owned());
                    let key = ReturnedKey {
                        lsn,
                        message_id: id.as_deref(),
                    };
                    confirms.returned(key, code, &text).map(|_| ())
                }
                None => Ok(()),
            },
            _ => Ok(()),
        };
        if result.is_err() {
            assert_eq!(confirms.unsettled(), before, "a violation settles nothing");
            break;
        }
        for (tag, _) in out.drain(..) {
            assert!(!settled[tag as usize], "publish {tag} settled twice");
            settled[tag as usize] = true;
        }
        let done = settled.iter().filter(|s| **s).count();
        assert_eq!(done + confirms.unsettled(), PUBLISHED as usize);
    }
});
