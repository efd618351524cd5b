//! Fuzzes the envelope decoder (`pgoutbox::envelope::decode`) and the mapping of a decoded
//! envelope to what is published (routing key, message-id, content-type, header table).
//!
//! Invariants beyond "never panics": a decoded envelope passes `validate`, its payload is
//! the tail of the input, every short string fits an AMQP short string, every header key
//! survives the mapping to a field table, and `encode` then `decode` gives it back
//! (metadata of version 3 included).
#![no_main]

use bytes::Bytes;
use libfuzzer_sys::fuzz_target;
use pgoutbox::envelope::{decode, encode, MAX_SHORT_STR};
use pgoutbox::publisher::message::headers_from_json;

fuzz_target!(|data: &[u8]| {
    let env = match decode(Bytes::copy_from_slice(data)) {
        Ok(env) => env,
        Err(e) => {
            assert!(!e.to_string().is_empty());
            return;
        }
    };
    env.validate().expect("a decoded envelope is valid");
    assert!(env.payload.len() + 5 <= data.len());
    assert!(
        data.ends_with(&env.payload),
        "the payload is the tail of the input"
    );
    for s in [&env.topic, &env.message_id, &env.content_type] {
        assert!(s.len() <= MAX_SHORT_STR);
    }
    assert!(!env.topic.is_empty() && !env.message_id.is_empty());
    let table = headers_from_json(&env.headers);
    assert_eq!(
        table.inner().len(),
        env.headers.len(),
        "no producer header is dropped on the way to AMQP"
    );

    let again = decode(Bytes::from(encode(&env))).expect("a re-encoded envelope decodes");
    assert_eq!(again.message_id, env.message_id);
    assert_eq!(again.topic, env.topic);
    assert_eq!(again.content_type, env.content_type);
    assert_eq!(again.payload, env.payload);
    assert!(again.headers.keys().eq(env.headers.keys()));
    assert_eq!(again.version, env.version);
    assert_eq!(again.emitted_by, env.emitted_by);
    assert_eq!(again.exchange, env.exchange);
    assert_eq!(again.meta, env.meta, "version-3 metadata survives encode");
});
