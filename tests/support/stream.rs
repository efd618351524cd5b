//! RabbitMQ streams through a client pgoutbox did not write: the Python `rstream` client
//! (PyPI, pinned and installed into `target/python` by `deploy/test-python.sh`), run as
//! `tests/support/read_stream.py` and `tests/support/publish_stream.py`.
//!
//! The nodes of [`RabbitMq`] have the stream plugin and a stream listener of their own
//! ([`RabbitMq::stream_url`]). The functions here block (a child process): from an async
//! test, call them through `tokio::task::spawn_blocking`.

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use base64::Engine as _;
use lapin::options::QueueDeclareOptions;
use lapin::types::{AMQPValue, FieldTable};
use serde_json::Value;

use super::rabbit::RabbitMq;

/// One message of a stream as `rstream` decoded it (`read_stream.py`).
///
/// rstream decodes an AMQP string, symbol and binary alike as bytes; the script prints such a
/// value as a JSON string when it is UTF-8, else as `{"binary": BASE64}`; a UUID as
/// `{"uuid": "..."}`; timestamps as milliseconds since the epoch.
#[derive(Debug, Clone, PartialEq)]
pub struct StreamMessage {
    /// The message's offset in the stream.
    pub offset: u64,
    /// The timestamp of the chunk that holds it (ms since the epoch), the broker's.
    pub chunk_timestamp: i64,
    /// `properties.message-id`: a string as it is; any other type as its JSON text (a ulong
    /// id as its digits, a UUID as `{"uuid":"..."}`).
    pub message_id: Option<String>,
    /// `properties.subject`.
    pub subject: Option<String>,
    /// `properties.content-type`.
    pub content_type: Option<String>,
    /// `properties.creation-time`, ms since the epoch.
    pub creation_time: Option<i64>,
    /// `properties.correlation-id` (as [`StreamMessage::message_id`]).
    pub correlation_id: Option<String>,
    /// The whole properties section (every field, `null` when absent), or `null` when the
    /// message has none.
    pub properties: Value,
    /// The application properties (empty when the message has none).
    pub application_properties: BTreeMap<String, Value>,
    /// The data section's bytes, exact (empty when the message has no data section, see
    /// [`StreamMessage::has_body`]).
    pub body: Vec<u8>,
    /// Whether the message has a data section.
    pub has_body: bool,
    /// The message as stored in the stream (the AMQP 1.0 encoding), exact.
    pub raw: Vec<u8>,
    /// The line `read_stream.py` printed.
    pub json: Value,
}

impl StreamMessage {
    /// An application property that is a string.
    pub fn app_str(&self, key: &str) -> Option<&str> {
        self.application_properties.get(key).and_then(Value::as_str)
    }

    fn from_line(line: &str) -> StreamMessage {
        let json: Value = serde_json::from_str(line)
            .unwrap_or_else(|e| panic!("read_stream.py printed no JSON ({e}): {line}"));
        let prop = |name: &str| -> Option<String> {
            match &json["properties"][name] {
                Value::Null => None,
                Value::String(s) => Some(s.clone()),
                other => Some(other.to_string()),
            }
        };
        let b64 = |v: &Value| -> Vec<u8> {
            v.as_str()
                .map(|s| {
                    base64::engine::general_purpose::STANDARD
                        .decode(s)
                        .expect("base64 from read_stream.py")
                })
                .unwrap_or_default()
        };
        StreamMessage {
            offset: json["offset"].as_u64().expect("offset"),
            chunk_timestamp: json["chunk_timestamp"].as_i64().unwrap_or(0),
            message_id: prop("message_id"),
            subject: prop("subject"),
            content_type: prop("content_type"),
            creation_time: json["properties"]["creation_time"].as_i64(),
            correlation_id: prop("correlation_id"),
            properties: json["properties"].clone(),
            application_properties: json["application_properties"]
                .as_object()
                .map(|m| m.iter().map(|(k, v)| (k.clone(), v.clone())).collect())
                .unwrap_or_default(),
            body: b64(&json["body"]),
            has_body: !json["body"].is_null(),
            raw: b64(&json["raw"]),
            json,
        }
    }
}

/// A message for [`publish_stream`] (rstream encodes it as an AMQP 1.0 message: properties,
/// application properties with string keys, the body as one data section, none when empty).
#[derive(Debug, Clone, Default)]
pub struct StreamPublish {
    pub body: Vec<u8>,
    pub message_id: Option<String>,
    pub subject: Option<String>,
    pub content_type: Option<String>,
    /// ms since the epoch.
    pub creation_time: Option<i64>,
    pub correlation_id: Option<String>,
    /// Values: strings, integers, floats, booleans, null.
    pub application_properties: Vec<(String, Value)>,
    /// Sent as it is with a producer name; rstream numbers the messages when `None`.
    pub publishing_id: Option<u64>,
}

/// Reads `stream` on `rabbit` from its first offset with rstream, until `expect` messages came
/// or none came for `timeout` (counted from the subscription, then from the last message).
/// Returns every message delivered until then, in order, even past `expect` (a duplicate
/// shows). Pass a scaled, generous `timeout` (`support::scaled`): CI is a loaded 2-core
/// machine. Panics when the script fails (no such stream, no connection), with its stderr.
pub fn read_stream(
    rabbit: &RabbitMq,
    stream: &str,
    expect: usize,
    timeout: Duration,
) -> Vec<StreamMessage> {
    read_stream_url(&rabbit.stream_url(), stream, expect, timeout)
}

/// [`read_stream`] at a `rabbitmq-stream://USER:PASS@HOST:PORT/VHOST` URL (another node of a
/// cluster, say).
pub fn read_stream_url(
    url: &str,
    stream: &str,
    expect: usize,
    timeout: Duration,
) -> Vec<StreamMessage> {
    let stdout = run_script(
        "read_stream.py",
        &[
            url,
            stream,
            &expect.to_string(),
            &format!("{:.3}", timeout.as_secs_f64()),
        ],
        "",
        // Python's start, the connection and the subscription on a loaded machine, and the
        // close, past the idle time itself.
        timeout + super::scaled(Duration::from_secs(120)),
    );
    stdout.lines().map(StreamMessage::from_line).collect()
}

/// Publishes `messages` to the existing `stream` at `url` with rstream, each confirmed in turn,
/// under the producer name `producer` when given (the broker's deduplication: an id at or
/// below the stored one is confirmed and dropped). Returns the publishing ids, in order.
pub fn publish_stream(
    url: &str,
    stream: &str,
    producer: Option<&str>,
    messages: &[StreamPublish],
) -> Vec<u64> {
    let mut input = String::new();
    for m in messages {
        let mut line = serde_json::json!({
            "body": base64::engine::general_purpose::STANDARD.encode(&m.body),
            "application_properties": m
                .application_properties
                .iter()
                .cloned()
                .collect::<serde_json::Map<String, Value>>(),
        });
        let o = line.as_object_mut().unwrap();
        for (k, v) in [
            ("message_id", &m.message_id),
            ("subject", &m.subject),
            ("content_type", &m.content_type),
            ("correlation_id", &m.correlation_id),
        ] {
            if let Some(v) = v {
                o.insert(k.into(), v.clone().into());
            }
        }
        if let Some(t) = m.creation_time {
            o.insert("creation_time".into(), t.into());
        }
        if let Some(id) = m.publishing_id {
            o.insert("publishing_id".into(), id.into());
        }
        input.push_str(&line.to_string());
        input.push('\n');
    }
    let mut args = vec![url, stream];
    if let Some(p) = producer {
        args.push(p);
    }
    let timeout = super::scaled(Duration::from_secs(120 + 2 * messages.len() as u64));
    let stdout = run_script("publish_stream.py", &args, &input, timeout);
    stdout
        .lines()
        .map(|l| {
            serde_json::from_str::<Value>(l).expect("publish_stream.py JSON")["publishing_id"]
                .as_u64()
                .expect("publishing_id")
        })
        .collect()
}

/// Declares the stream `name` over AMQP 0-9-1 (a durable queue with `x-queue-type=stream`),
/// optionally with `x-max-age` (`"1D"`, ...) or other arguments in `args`.
pub async fn declare_stream(amqp_url: &str, name: &str, args: &[(&str, AMQPValue)]) {
    let conn = super::amqp_connect(amqp_url).await;
    let ch = conn.create_channel().await.expect("channel");
    let mut table = FieldTable::default();
    table.insert(
        "x-queue-type".into(),
        AMQPValue::LongString("stream".into()),
    );
    for (k, v) in args {
        table.insert((*k).into(), v.clone());
    }
    ch.queue_declare(
        name.into(),
        QueueDeclareOptions {
            durable: true,
            ..QueueDeclareOptions::default()
        },
        table,
    )
    .await
    .unwrap_or_else(|e| panic!("declare stream {name}: {e:?}"));
    let _ = conn.close(200, "bye".into()).await;
}

/// The Python of `deploy/test-python.sh` (run once per test process: it installs rstream when
/// the environment is missing or its pins changed, else only prints the path).
pub fn python() -> PathBuf {
    static PYTHON: OnceLock<PathBuf> = OnceLock::new();
    PYTHON
        .get_or_init(|| {
            let script = concat!(env!("CARGO_MANIFEST_DIR"), "/deploy/test-python.sh");
            let out = Command::new("bash")
                .arg(script)
                .current_dir(env!("CARGO_MANIFEST_DIR"))
                .stdin(Stdio::null())
                .stderr(Stdio::inherit())
                .output()
                .expect("run deploy/test-python.sh");
            assert!(
                out.status.success(),
                "deploy/test-python.sh failed ({}): its output above",
                out.status
            );
            PathBuf::from(String::from_utf8_lossy(&out.stdout).trim())
        })
        .clone()
}

/// Runs `tests/support/SCRIPT ARGS` with [`python`], `input` on its standard input; returns
/// its standard output. Panics (with its stderr) when it fails or outlives `timeout`.
fn run_script(script: &str, args: &[&str], input: &str, timeout: Duration) -> String {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/support")
        .join(script);
    let mut child = Command::new(python())
        .arg(&path)
        .args(args)
        .env("PYTHONUNBUFFERED", "1")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("spawn {script}: {e}"));
    let mut stdin = child.stdin.take().unwrap();
    let input = input.to_owned();
    let writer = std::thread::spawn(move || {
        let _ = stdin.write_all(input.as_bytes());
    });
    let mut out = child.stdout.take().unwrap();
    let mut err = child.stderr.take().unwrap();
    let reader = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = out.read_to_string(&mut s);
        s
    });
    let err_reader = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = err.read_to_string(&mut s);
        s
    });
    let deadline = Instant::now() + timeout;
    let status = loop {
        if let Some(st) = child.try_wait().expect("wait for the script") {
            break Some(st);
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let _ = writer.join();
    let stdout = reader.join().unwrap_or_default();
    let stderr = err_reader.join().unwrap_or_default();
    match status {
        Some(st) if st.success() => stdout,
        Some(st) => panic!("{script} {args:?} failed ({st}):\n{stderr}\nstdout:\n{stdout}"),
        None => panic!("{script} {args:?} still running after {timeout:?}, killed:\n{stderr}\nstdout:\n{stdout}"),
    }
}
