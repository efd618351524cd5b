//! Publishing into a RabbitMQ stream over the stream protocol, with the broker's
//! deduplication: our own client of the frames a publisher needs, as one more
//! [`crate::sink::Sink`].
//!
//! ```text
//!  publish(Delivery) ─ id(commit LSN, index) ─┬─ id ≤ stored: Routed, nothing sent
//!                                             └─ AMQP 1.0 message into the open Publish frame
//!  poll_settled() ── one write per batch ──▶ socket ──▶ RabbitMQ stream
//!                 ◀── PublishConfirm / PublishError / MetadataUpdate / Close / Heartbeat
//! ```
//!
//! As in [`crate::publisher`], there is no task and no thread: [`StreamSink::publish`]
//! encodes into the write buffer (all publishes between two polls go out in one `Publish`
//! frame and one write), and all I/O happens while the pipeline polls
//! [`crate::sink::Sink::poll_settled`]. The handshake is [`connect`]: PeerProperties,
//! SaslHandshake, SaslAuthenticate (PLAIN), Tune, Open, then Create (or, under
//! `--no-declare`, Metadata) of the stream, DeclarePublisher with the producer name, and
//! QueryPublisherSequence: the highest publishing id the broker stored for that name.
//!
//! The publishing ids, why they make the stream effectively-once, and their limits:
//! [`ids`] and `docs/src/internals/stream-ids.md`. The frames: [`frames`] (sans-IO, fuzzed
//! by `fuzz/fuzz_targets/stream_frames.rs`); the messages: [`amqp10`].
//!
//! Source: rabbitmq-server `deps/rabbitmq_stream/docs/PROTOCOL.adoc`; RabbitMQ "Streams"
//! (deduplication); AMQP 1.0 part 3 (message format).

pub mod amqp10;
pub mod frames;
pub mod ids;

use std::collections::BTreeMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::Ordering;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::BytesMut;
use futures::future::BoxFuture;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::time::{Instant, Sleep};

use crate::publisher::encode::Encoder;
use crate::publisher::socket::{self, Endpoint, Socket};
use crate::publisher::BrokerSignals;
use crate::sink::{
    Delivery, FailureCause, PartFigures, PartHealth, PublishOutcome, Seq, Sink, SinkError,
    SinkFailure, SinkHealth,
};
use frames::{code, PublishFrame, ResponseBody, ServerFrame};

/// The stream protocol's port without TLS (`rabbitmq-stream://`).
pub const DEFAULT_PORT: u16 = 5552;
/// The stream protocol's port with TLS (`rabbitmq-stream+tls://`).
pub const DEFAULT_TLS_PORT: u16 = 5551;
/// How long the handshake, the stream's creation and the publisher's declaration may take.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// Our publisher id on the connection (one publisher per connection).
const PUBLISHER_ID: u8 = 0;
/// Reads handled per poll before the pipeline's other branches get a turn.
const READS_PER_POLL: usize = 32;
/// The longest producer name the protocol allows (a publisher reference).
pub const MAX_PRODUCER_NAME: usize = 256;

/// What can fail on the stream side; each names what to change.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// `--stream-url` is not usable.
    #[error("invalid --stream-url (PGOUTBOX_STREAM_URL): {0}")]
    Url(String),
    /// TCP or TLS to the node failed (the AMQP side's words for it). Retryable.
    #[error("RabbitMQ stream at {url}: {source}")]
    Transport {
        /// The redacted URL.
        url: String,
        /// What failed.
        #[source]
        source: crate::publisher::Error,
    },
    /// The broker answered a handshake step with a code that retrying cannot change
    /// (authentication, the virtual host, access). Definite.
    #[error("RabbitMQ stream at {url} refused {step} with {code_name} ({code:#04x}); {fix}")]
    Refused {
        /// The redacted URL.
        url: String,
        /// What we asked for.
        step: &'static str,
        /// The response code.
        code: u16,
        /// Its name.
        code_name: &'static str,
        /// What to change.
        fix: String,
    },
    /// The stream does not exist and `--no-declare` forbids creating it. Retryable: it may
    /// be created while we wait.
    #[error("stream {stream:?} does not exist on RabbitMQ at {url} and run has --no-declare, which only checks: create it (rabbitmqadmin declare queue name={stream} queue_type=stream durable=true) or drop --no-declare; run retries meanwhile")]
    StreamMissing {
        /// The redacted URL.
        url: String,
        /// The stream.
        stream: String,
    },
    /// A handshake step failed in a way retrying may fix (stream not available, a socket
    /// closed, an unexpected answer).
    #[error("RabbitMQ stream at {url}: {context}")]
    Connect {
        /// The redacted URL.
        url: String,
        /// What failed.
        context: String,
    },
    /// The handshake did not finish in time. Retryable.
    #[error("RabbitMQ stream: connecting to {url} timed out after {timeout_s} s; check host and port in --stream-url (PGOUTBOX_STREAM_URL), that the rabbitmq_stream plugin is enabled and that its listener is there (default port 5552)")]
    Timeout {
        /// The redacted URL.
        url: String,
        /// Seconds.
        timeout_s: u64,
    },
}

impl Error {
    /// False for what retrying cannot fix: an unusable URL, a refused login, vhost or
    /// access.
    pub fn is_retryable(&self) -> bool {
        match self {
            Error::Url(_) | Error::Refused { .. } => false,
            Error::Transport { source, .. } => {
                !matches!(source, crate::publisher::Error::TlsSetup { .. })
            }
            _ => true,
        }
    }
}

/// Settings of one stream publisher connection.
#[derive(Clone)]
pub struct StreamConfig {
    /// `rabbitmq-stream://user:pass@host:port/vhost` or `rabbitmq-stream+tls://` with the
    /// TLS parameters of the AMQP side (`cacertfile=`, `certfile=`, `keyfile=`,
    /// `server_name_indication=`).
    pub url: String,
    /// The stream to publish to.
    pub stream: String,
    /// The producer name (publisher reference): deduplication is per name.
    pub producer_name: String,
    /// `Some(arguments)`: create the stream if missing, with these (`max-age`,
    /// `max-length-bytes`); `None` (`--no-declare`): only check that it exists.
    pub create: Option<Vec<(&'static str, String)>>,
    /// Shown in the broker's connection list.
    pub connection_name: String,
    /// Flags other tasks read (metrics, readiness).
    pub signals: BrokerSignals,
    /// Where skips at start and publish errors are counted (`None`: not counted).
    pub counters: Option<crate::metrics::counters::StreamCounters>,
}

impl std::fmt::Debug for StreamConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StreamConfig")
            .field("url", &crate::redaction::redact_url(&self.url))
            .field("stream", &self.stream)
            .field("producer_name", &self.producer_name)
            .field("create", &self.create)
            .finish_non_exhaustive()
    }
}

/// Parses a `rabbitmq-stream://` or `rabbitmq-stream+tls://` URL into the AMQP side's
/// [`Endpoint`] (the same credentials, host, vhost and TLS parameters; the default ports
/// are the stream protocol's, 5552 and 5551).
///
/// # Errors
/// [`Error::Url`], naming what is wrong without the URL's secrets.
pub fn endpoint(url: &str) -> Result<Endpoint, Error> {
    let (amqp_scheme, rest, default_port) = if let Some(rest) =
        url.strip_prefix("rabbitmq-stream+tls:")
    {
        ("amqps:", rest, DEFAULT_TLS_PORT)
    } else if let Some(rest) = url.strip_prefix("rabbitmq-stream:") {
        ("amqp:", rest, DEFAULT_PORT)
    } else {
        return Err(Error::Url(format!(
            "{} is not a stream URL; expected rabbitmq-stream://user:password@host:5552/vhost (or rabbitmq-stream+tls://)",
            crate::redaction::redact_url(url)
        )));
    };
    let amqp = format!("{amqp_scheme}{rest}");
    let explicit_port = url::Url::parse(&amqp)
        .map_err(|e| Error::Url(format!("{e}: {}", crate::redaction::redact_url(url))))?
        .port()
        .is_some();
    let mut endpoint = Endpoint::parse(&amqp)
        .map_err(|e| Error::Url(e.to_string().replace("amqp://", "rabbitmq-stream://")))?;
    if !explicit_port {
        endpoint.port = default_port;
    }
    endpoint.redacted_url = crate::redaction::redact_url(url);
    Ok(endpoint)
}

/// The label of `code` in `pgoutbox_stream_publish_errors_total`
/// ([`crate::metrics::STREAM_ERROR_CODES`]).
fn metric_code(c: u16) -> &'static str {
    match c {
        code::STREAM_DOES_NOT_EXIST => "stream_does_not_exist",
        code::STREAM_NOT_AVAILABLE => "stream_not_available",
        code::ACCESS_REFUSED => "access_refused",
        code::PRECONDITION_FAILED => "precondition_failed",
        code::PUBLISHER_DOES_NOT_EXIST => "publisher_does_not_exist",
        0x0f => "internal_error",
        _ => "other",
    }
}

/// The handshake's socket side: whole frames out, whole frames in.
struct Handshake {
    socket: Socket,
    inbuf: Vec<u8>,
    out: BytesMut,
    url: String,
    frame_max: u32,
    correlation: u32,
}

impl Handshake {
    fn lost(&self, what: impl std::fmt::Display) -> Error {
        Error::Connect {
            url: self.url.clone(),
            context: what.to_string(),
        }
    }

    async fn send(&mut self) -> Result<(), Error> {
        let out = self.out.split();
        self.socket
            .write_all(&out)
            .await
            .map_err(|e| self.lost(format_args!("writing failed: {e}")))?;
        self.socket
            .flush()
            .await
            .map_err(|e| self.lost(format_args!("writing failed: {e}")))
    }

    async fn recv(&mut self) -> Result<ServerFrame, Error> {
        loop {
            if self.inbuf.starts_with(b"AMQP") {
                return Err(self.lost(
                    "the server answered with an AMQP 0-9-1 protocol header: this is RabbitMQ's AMQP port, not its stream port (5552 by default, 5551 with TLS, the rabbitmq_stream plugin)",
                ));
            }
            match frames::frame_len(&self.inbuf, self.frame_max) {
                Ok(Some(len)) => {
                    let frame = frames::decode(&self.inbuf[..len]);
                    self.inbuf.drain(..len);
                    return frame.map_err(|e| self.lost(e));
                }
                Ok(None) => {}
                Err(e) => return Err(self.lost(e)),
            }
            let mut chunk = [0u8; 4096];
            let n = self
                .socket
                .read(&mut chunk)
                .await
                .map_err(|e| self.lost(format_args!("reading failed: {e}")))?;
            if n == 0 {
                return Err(self.lost(
                    "the broker closed the socket during the handshake (is this the stream port, 5552, with the rabbitmq_stream plugin enabled? an AMQP 0-9-1 port closes it this way)",
                ));
            }
            self.inbuf.extend_from_slice(&chunk[..n]);
        }
    }

    /// Sends the request written into `out` and waits for its response (heartbeats and
    /// other commands before it are skipped; a `Close` ends the handshake).
    async fn call(&mut self, key: u16) -> Result<(u16, ResponseBody), Error> {
        self.send().await?;
        loop {
            match self.recv().await? {
                ServerFrame::Response {
                    key: k,
                    correlation,
                    code,
                    body,
                } if k == key && correlation == self.correlation => return Ok((code, body)),
                ServerFrame::Close { code, reason, .. } => {
                    return Err(self.lost(format_args!(
                        "the broker closed the connection with {} ({code:#04x}): {reason}",
                        code::name(code)
                    )))
                }
                _ => {}
            }
        }
    }

    fn next(&mut self) -> u32 {
        self.correlation += 1;
        self.correlation
    }

    fn refused(&self, step: &'static str, code: u16, fix: String) -> Error {
        Error::Refused {
            url: self.url.clone(),
            step,
            code,
            code_name: code::name(code),
            fix,
        }
    }
}

/// The handshake's result, for [`StreamSink`].
struct Opened {
    hs: Handshake,
    heartbeat: Option<Duration>,
    stored: u64,
}

/// What to change when the broker refused a step with `code` (`vhost` for the commands).
fn fix_for(code: u16, vhost: &str) -> String {
    match code {
        code::AUTHENTICATION_FAILURE => "check the user and password in --stream-url (PGOUTBOX_STREAM_URL); `rabbitmqctl list_users` shows the users".into(),
        code::AUTHENTICATION_FAILURE_LOOPBACK => "this user may only connect from localhost (guest): create another user for remote connections".into(),
        code::VIRTUAL_HOST_ACCESS_FAILURE => format!("the vhost {vhost:?} is missing or the user may not use it: `rabbitmqctl add_vhost {vhost}` and `rabbitmqctl set_permissions -p {vhost} USER '.*' '.*' '.*'`, or fix the vhost (the URL path, %2f for /)"),
        code::ACCESS_REFUSED => format!("the user may not configure or write the stream: grant it with `rabbitmqctl set_permissions -p {vhost} USER ...` (configure to create it, write to publish)"),
        _ => "see the code in the stream protocol's table of response codes".into(),
    }
}

/// An open, authenticated connection with its vhost opened.
struct Session {
    hs: Handshake,
    heartbeat_s: u32,
    vhost: String,
}

/// Connects to `url` and runs PeerProperties, SaslHandshake, SaslAuthenticate (PLAIN),
/// Tune and Open.
async fn open_session(url: &str, connection_name: &str) -> Result<Session, Error> {
    let endpoint = endpoint(url)?;
    let url = endpoint.redacted_url.clone();
    let socket = socket::connect(&endpoint)
        .await
        .map_err(|source| Error::Transport {
            url: url.clone(),
            source,
        })?;
    let mut hs = Handshake {
        socket,
        inbuf: Vec::with_capacity(4096),
        out: BytesMut::with_capacity(4096),
        url,
        frame_max: 1 << 20,
        correlation: 0,
    };
    let vhost = endpoint.uri.vhost.clone();
    let c = hs.next();
    frames::peer_properties(
        &mut hs.out,
        c,
        &[
            ("product", "pgoutbox"),
            ("version", env!("CARGO_PKG_VERSION")),
            ("connection_name", connection_name),
        ],
    )
    .map_err(|e| Error::Url(e.to_string()))?;
    let (c0, _) = hs.call(frames::PEER_PROPERTIES).await?;
    if c0 != code::OK {
        return Err(hs.lost(format_args!("peer properties answered {}", code::name(c0))));
    }
    login(&mut hs, &endpoint, &vhost).await?;
    let heartbeat_s = tune(&mut hs, &endpoint).await?;
    let c = hs.next();
    frames::open(&mut hs.out, c, &vhost).map_err(|e| Error::Url(e.to_string()))?;
    let (c0, _) = hs.call(frames::OPEN).await?;
    if c0 != code::OK {
        return Err(hs.refused("the virtual host", c0, fix_for(c0, &vhost)));
    }
    Ok(Session {
        hs,
        heartbeat_s,
        vhost,
    })
}

/// SaslHandshake and SaslAuthenticate with PLAIN.
async fn login(hs: &mut Handshake, endpoint: &Endpoint, vhost: &str) -> Result<(), Error> {
    let c = hs.next();
    frames::sasl_handshake(&mut hs.out, c);
    let (c0, body) = hs.call(frames::SASL_HANDSHAKE).await?;
    let offers_plain =
        matches!(&body, ResponseBody::Mechanisms(m) if m.iter().any(|m| m == "PLAIN"));
    if c0 != code::OK || !offers_plain {
        return Err(hs.refused(
            "SASL PLAIN",
            code::SASL_MECHANISM_NOT_SUPPORTED,
            "enable the PLAIN mechanism (auth_mechanisms.1 = PLAIN in rabbitmq.conf)".into(),
        ));
    }
    let user = &endpoint.uri.authority.userinfo.username;
    let password = &endpoint.uri.authority.userinfo.password;
    let c = hs.next();
    frames::sasl_plain(&mut hs.out, c, user, password).map_err(|e| Error::Url(e.to_string()))?;
    let (c0, _) = hs.call(frames::SASL_AUTHENTICATE).await?;
    if c0 != code::OK {
        return Err(hs.refused("the login", c0, fix_for(c0, vhost)));
    }
    Ok(())
}

/// The broker's Tune and ours: its frame_max, and its heartbeat (seconds) unless the URL's
/// `heartbeat=` is lower.
async fn tune(hs: &mut Handshake, endpoint: &Endpoint) -> Result<u32, Error> {
    let (frame_max, heartbeat_s) = loop {
        match hs.recv().await? {
            ServerFrame::Tune {
                frame_max,
                heartbeat,
            } => break (frame_max, heartbeat),
            ServerFrame::Close { code, reason, .. } => {
                return Err(hs.lost(format_args!(
                    "the broker closed the connection with {} ({code:#04x}): {reason}",
                    code::name(code)
                )))
            }
            _ => {}
        }
    };
    let heartbeat_s = match endpoint.uri.query.heartbeat {
        Some(h) if u32::from(h) < heartbeat_s || heartbeat_s == 0 => u32::from(h),
        _ => heartbeat_s,
    };
    frames::tune(&mut hs.out, frame_max, heartbeat_s);
    if frame_max != 0 {
        hs.frame_max = frame_max;
    }
    Ok(heartbeat_s)
}

/// Whether `stream` exists (Metadata).
async fn stream_exists(hs: &mut Handshake, stream: &str) -> Result<bool, Error> {
    let c = hs.next();
    frames::metadata(&mut hs.out, c, &[stream]).map_err(|e| Error::Url(e.to_string()))?;
    let (c0, _) = hs.call(frames::METADATA).await?;
    Ok(c0 != code::STREAM_DOES_NOT_EXIST)
}

/// Creates `stream` with `arguments` unless it exists.
async fn create_stream(
    hs: &mut Handshake,
    stream: &str,
    arguments: &[(&'static str, String)],
    vhost: &str,
) -> Result<(), Error> {
    let c = hs.next();
    frames::create(&mut hs.out, c, stream, arguments).map_err(|e| Error::Url(e.to_string()))?;
    let (c0, _) = hs.call(frames::CREATE).await?;
    match c0 {
        code::OK => {
            tracing::info!(stream, "created the stream");
            Ok(())
        }
        code::STREAM_ALREADY_EXISTS => Ok(()),
        code::ACCESS_REFUSED => Err(hs.refused("creating the stream", c0, fix_for(c0, vhost))),
        // Created meanwhile by someone else, with other arguments: use it.
        code::PRECONDITION_FAILED if stream_exists(hs, stream).await? => Ok(()),
        code::PRECONDITION_FAILED => Err(hs.refused(
            "creating the stream",
            c0,
            format!("a queue named {stream:?} that is no stream exists, or an argument of --stream-max-age/--stream-max-length-bytes was refused: pick another --stream or fix the argument"),
        )),
        other => Err(hs.lost(format_args!(
            "creating stream {stream:?} answered {} ({other:#04x})",
            code::name(other)
        ))),
    }
}

/// The highest publishing id the broker stored for `producer` on `stream` (0: none).
async fn stored_sequence(hs: &mut Handshake, producer: &str, stream: &str) -> Result<u64, Error> {
    let c = hs.next();
    frames::query_publisher_sequence(&mut hs.out, c, producer, stream)
        .map_err(|e| Error::Url(e.to_string()))?;
    match hs.call(frames::QUERY_PUBLISHER_SEQUENCE).await? {
        (code::OK, ResponseBody::Sequence(s)) => Ok(s),
        (other, _) => Err(hs.lost(format_args!(
            "querying the publisher sequence of {producer:?} answered {} ({other:#04x})",
            code::name(other)
        ))),
    }
}

/// Connects, authenticates, opens the vhost, creates or checks the stream, declares the
/// publisher and reads its stored sequence.
async fn handshake(config: &StreamConfig) -> Result<Opened, Error> {
    let Session {
        mut hs,
        heartbeat_s,
        vhost,
    } = open_session(&config.url, &config.connection_name).await?;
    let stream = config.stream.as_str();
    // Created only when missing: a stream that exists is used as it is, whatever its
    // arguments (a Create with other arguments than the stream's is refused as
    // inequivalent, so `run` restarted with other --stream-max-* would otherwise stop).
    if !stream_exists(&mut hs, stream).await? {
        match &config.create {
            Some(arguments) => create_stream(&mut hs, stream, arguments, &vhost).await?,
            None => {
                return Err(Error::StreamMissing {
                    url: hs.url.clone(),
                    stream: stream.to_owned(),
                })
            }
        }
    }
    let c = hs.next();
    frames::declare_publisher(&mut hs.out, c, PUBLISHER_ID, &config.producer_name, stream)
        .map_err(|e| Error::Url(e.to_string()))?;
    let (c0, _) = hs.call(frames::DECLARE_PUBLISHER).await?;
    match c0 {
        code::OK => {}
        code::STREAM_DOES_NOT_EXIST => {
            return Err(Error::StreamMissing {
                url: hs.url.clone(),
                stream: stream.to_owned(),
            })
        }
        code::ACCESS_REFUSED => return Err(hs.refused("the publisher", c0, fix_for(c0, &vhost))),
        other => {
            return Err(hs.lost(format_args!(
                "declaring the publisher on stream {stream:?} answered {} ({other:#04x})",
                code::name(other)
            )))
        }
    }
    let stored = stored_sequence(&mut hs, &config.producer_name, stream).await?;
    Ok(Opened {
        hs,
        heartbeat: (heartbeat_s > 0).then(|| Duration::from_secs(u64::from(heartbeat_s))),
        stored,
    })
}

/// What `check` reads of a stream: whether it exists and, if so, the highest publishing id
/// the broker stored for the producer name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Inspection {
    /// The stream exists.
    pub exists: bool,
    /// The producer name's stored publishing id (0: none); `None` when the stream is missing.
    pub stored: Option<u64>,
}

/// Connects to `url` as `pgoutbox check` and reads `stream`'s existence and `producer`'s
/// stored sequence, declaring nothing, within [`CONNECT_TIMEOUT`].
///
/// # Errors
/// [`Error`], as connecting for `run` would fail.
pub async fn inspect(url: &str, stream: &str, producer: &str) -> Result<Inspection, Error> {
    let work = async {
        let Session { mut hs, .. } = open_session(url, "pgoutbox check").await?;
        if !stream_exists(&mut hs, stream).await? {
            return Ok(Inspection {
                exists: false,
                stored: None,
            });
        }
        let stored = stored_sequence(&mut hs, producer, stream).await?;
        let c = hs.next();
        let _ = frames::close(&mut hs.out, c, code::OK, "pgoutbox check done");
        let _ = hs.send().await;
        Ok(Inspection {
            exists: true,
            stored: Some(stored),
        })
    };
    tokio::time::timeout(CONNECT_TIMEOUT, work)
        .await
        .map_err(|_| Error::Timeout {
            url: crate::redaction::redact_url(url),
            timeout_s: CONNECT_TIMEOUT.as_secs(),
        })?
}

#[derive(Debug)]
enum State {
    Open,
    Failed(String),
}

/// One stream-protocol connection with one named publisher, as a [`Sink`].
pub struct StreamSink {
    socket: Socket,
    url: String,
    stream: String,
    producer_name: String,
    frame_max: u32,
    heartbeat: Option<Duration>,
    encoder: Encoder,
    /// Encoded frames; `out[written..]` is not yet written.
    out: BytesMut,
    written: usize,
    unflushed: bool,
    /// The `Publish` frame being filled in `out`, if any.
    batch: Option<PublishFrame>,
    inbuf: Vec<u8>,
    in_start: usize,
    in_end: usize,
    /// Publishing id → the loop's number, for every publish sent and not settled.
    unconfirmed: BTreeMap<u64, Seq>,
    /// Outcomes settled and not yet handed out.
    ready: Vec<(Seq, PublishOutcome)>,
    /// The highest id the broker had stored for the producer name when we connected.
    stored: u64,
    /// The highest id accepted so far (sent or skipped).
    last_id: u64,
    /// Messages skipped at start (id at or below `stored`), not yet logged.
    skipped: u64,
    /// Publishes sent since connecting.
    published: u64,
    /// The warning that the ids' WAL limit is near was logged (once per connection).
    warned_limit: bool,
    state: State,
    signals: BrokerSignals,
    counters: Option<crate::metrics::counters::StreamCounters>,
    last_read: Instant,
    last_write: Instant,
    timer: Pin<Box<Sleep>>,
}

impl std::fmt::Debug for StreamSink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StreamSink")
            .field("url", &self.url)
            .field("stream", &self.stream)
            .field("producer_name", &self.producer_name)
            .field("stored", &self.stored)
            .field("state", &self.state)
            .field("unconfirmed", &self.unconfirmed.len())
            .finish_non_exhaustive()
    }
}

impl StreamSink {
    /// Connects ([`handshake`]) within [`CONNECT_TIMEOUT`]; deliveries are mapped with
    /// `encoder` (the AMQP path's properties and headers, see [`amqp10`]).
    ///
    /// # Errors
    /// [`Error`], each naming its fix.
    pub async fn connect(config: &StreamConfig, encoder: Encoder) -> Result<Self, Error> {
        let opened = tokio::time::timeout(CONNECT_TIMEOUT, handshake(config))
            .await
            .map_err(|_| Error::Timeout {
                url: crate::redaction::redact_url(&config.url),
                timeout_s: CONNECT_TIMEOUT.as_secs(),
            })??;
        let Opened {
            hs,
            heartbeat,
            stored,
        } = opened;
        let mut inbuf = vec![0u8; 64 * 1024];
        let leftover = hs.inbuf.len().min(inbuf.len());
        inbuf[..leftover].copy_from_slice(&hs.inbuf[..leftover]);
        config.signals.lost.store(false, Ordering::Relaxed);
        config.signals.blocked.store(false, Ordering::Relaxed);
        let now = Instant::now();
        tracing::info!(
            stream = %config.stream,
            producer = %config.producer_name,
            stored_publishing_id = stored,
            stored_up_to_commit_lsn = %ids::commit_lsn_of(stored),
            "stream publisher declared"
        );
        Ok(StreamSink {
            socket: hs.socket,
            url: hs.url,
            stream: config.stream.clone(),
            producer_name: config.producer_name.clone(),
            frame_max: hs.frame_max,
            heartbeat,
            encoder,
            out: BytesMut::with_capacity(64 * 1024),
            written: 0,
            unflushed: false,
            batch: None,
            inbuf,
            in_start: 0,
            in_end: leftover,
            unconfirmed: BTreeMap::new(),
            ready: Vec::new(),
            stored,
            last_id: 0,
            skipped: 0,
            published: 0,
            warned_limit: false,
            state: State::Open,
            signals: config.signals.clone(),
            counters: config.counters.clone(),
            last_read: now,
            last_write: now,
            timer: Box::pin(tokio::time::sleep_until(now)),
        })
    }

    /// The highest publishing id the broker had stored for our producer name when we
    /// connected (0: none).
    pub fn stored(&self) -> u64 {
        self.stored
    }

    /// Logs, once, how many messages were counted as confirmed without being sent.
    fn log_skipped(&mut self) {
        if self.skipped > 0 {
            tracing::info!(
                skipped = self.skipped,
                stored_publishing_id = self.stored,
                stored_up_to_commit_lsn = %ids::commit_lsn_of(self.stored),
                producer = %self.producer_name,
                "messages already in the stream were counted as confirmed and not sent again (deduplication at start)"
            );
            self.skipped = 0;
        }
    }

    fn fail(&mut self, cause: FailureCause) {
        if !matches!(self.state, State::Open) {
            return;
        }
        let failure = SinkFailure::new(cause);
        let unconfirmed = std::mem::take(&mut self.unconfirmed);
        for (_, seq) in unconfirmed {
            self.ready
                .push((seq, PublishOutcome::Failed(failure.clone())));
        }
        self.state = State::Failed(failure.to_string());
        self.signals.lost.store(true, Ordering::Relaxed);
    }

    /// Closes the open `Publish` frame, if any: everything published since the last poll
    /// goes out as one frame.
    fn finish_batch(&mut self) {
        if let Some(batch) = self.batch.take() {
            batch.finish(&mut self.out);
        }
    }

    fn handle_frames(&mut self) {
        while matches!(self.state, State::Open) {
            let buf = &self.inbuf[self.in_start..self.in_end];
            let len = match frames::frame_len(buf, self.frame_max) {
                Ok(Some(len)) => len,
                Ok(None) => return,
                Err(e) => {
                    self.fail(FailureCause::ProtocolViolation(format!(
                        "RabbitMQ stream sent {e}"
                    )));
                    return;
                }
            };
            let frame = frames::decode(&buf[..len]);
            self.in_start += len;
            match frame {
                Ok(frame) => self.handle(frame),
                Err(e) => self.fail(FailureCause::ProtocolViolation(format!(
                    "RabbitMQ stream sent {e}"
                ))),
            }
        }
    }

    fn handle(&mut self, frame: ServerFrame) {
        match frame {
            ServerFrame::PublishConfirm { publisher, ids } if publisher == PUBLISHER_ID => {
                for id in ids {
                    // An id we do not know (confirmed twice) settles nothing: it can only
                    // be one we settled already.
                    if let Some(seq) = self.unconfirmed.remove(&id) {
                        self.ready.push((seq, PublishOutcome::Routed));
                    }
                }
            }
            ServerFrame::PublishError { publisher, errors } if publisher == PUBLISHER_ID => {
                for (id, c) in errors {
                    if let Some(counters) = &self.counters {
                        counters.publish_error(metric_code(c));
                    }
                    match c {
                        // The stream or our publisher is gone: nothing after this id is
                        // stored on this publisher; the session restarts and the replay
                        // sends it again (docs/src/internals/stream-ids.md).
                        code::STREAM_DOES_NOT_EXIST
                        | code::STREAM_NOT_AVAILABLE
                        | code::PUBLISHER_DOES_NOT_EXIST => {
                            self.fail(FailureCause::ConnectionClosed {
                                reply_code: c,
                                reply_text: format!(
                                    "publish error on stream {:?}: {} (publishing id {id})",
                                    self.stream,
                                    code::name(c)
                                ),
                            });
                            return;
                        }
                        _ => {
                            if let Some(seq) = self.unconfirmed.remove(&id) {
                                self.ready.push((
                                    seq,
                                    PublishOutcome::Refused {
                                        code: c,
                                        text: format!(
                                            "{} on stream {:?}",
                                            code::name(c),
                                            self.stream
                                        ),
                                    },
                                ));
                            }
                        }
                    }
                }
            }
            ServerFrame::MetadataUpdate { code: c, stream } if stream == self.stream => {
                self.fail(FailureCause::ConnectionClosed {
                    reply_code: c,
                    reply_text: format!(
                        "stream {stream:?} changed ({}): its leader moved or it was deleted; reconnecting",
                        code::name(c)
                    ),
                });
            }
            ServerFrame::Close {
                correlation,
                code: c,
                reason,
            } => {
                frames::close_ok(&mut self.out, correlation);
                self.fail(FailureCause::ConnectionClosed {
                    reply_code: c,
                    reply_text: format!("{} ({reason})", code::name(c)),
                });
            }
            _ => {}
        }
    }

    fn poll_io(&mut self, cx: &mut Context<'_>) {
        loop {
            let queued_before = self.out.len() - self.written;
            self.poll_write(cx);
            if !matches!(self.state, State::Open) {
                return;
            }
            let mut reads = 0;
            loop {
                if reads == READS_PER_POLL {
                    cx.waker().wake_by_ref();
                    break;
                }
                reads += 1;
                match self.poll_read(cx) {
                    Poll::Ready(true) => {}
                    Poll::Ready(false) => {
                        self.poll_write(cx);
                        return;
                    }
                    Poll::Pending => break,
                }
            }
            if !matches!(self.state, State::Open) {
                return;
            }
            if self.poll_timer(cx) {
                continue;
            }
            if self.out.len() - self.written > queued_before && self.written < self.out.len() {
                continue;
            }
            return;
        }
    }

    fn poll_write(&mut self, cx: &mut Context<'_>) {
        while self.written < self.out.len() {
            match Pin::new(&mut self.socket).poll_write(cx, &self.out[self.written..]) {
                Poll::Ready(Ok(0)) => {
                    self.fail(FailureCause::ConnectionLost(
                        "writing to the RabbitMQ stream returned 0 bytes (socket closed)".into(),
                    ));
                    return;
                }
                Poll::Ready(Ok(n)) => {
                    self.written += n;
                    self.unflushed = true;
                    self.last_write = Instant::now();
                }
                Poll::Ready(Err(e)) => {
                    self.fail(FailureCause::ConnectionLost(format!(
                        "writing to the RabbitMQ stream failed: {e}"
                    )));
                    return;
                }
                Poll::Pending => return,
            }
        }
        if self.batch.is_none() {
            self.out.clear();
            self.written = 0;
        }
        if self.unflushed {
            match Pin::new(&mut self.socket).poll_flush(cx) {
                Poll::Ready(Ok(())) => self.unflushed = false,
                Poll::Ready(Err(e)) => self.fail(FailureCause::ConnectionLost(format!(
                    "writing to the RabbitMQ stream failed: {e}"
                ))),
                Poll::Pending => {}
            }
        }
    }

    fn poll_read(&mut self, cx: &mut Context<'_>) -> Poll<bool> {
        if self.in_start == self.in_end {
            self.in_start = 0;
            self.in_end = 0;
        } else if self.in_end == self.inbuf.len() {
            self.inbuf.copy_within(self.in_start..self.in_end, 0);
            self.in_end -= self.in_start;
            self.in_start = 0;
            if self.in_end == self.inbuf.len() {
                // One frame larger than the buffer (up to frame_max): grow it.
                let grown = (self.inbuf.len() * 2).min(self.frame_max.max(1 << 16) as usize + 4);
                if grown <= self.inbuf.len() {
                    self.fail(FailureCause::ProtocolViolation(
                        "RabbitMQ stream sent a frame larger than the negotiated maximum".into(),
                    ));
                    return Poll::Ready(false);
                }
                self.inbuf.resize(grown, 0);
            }
        }
        let mut rb = ReadBuf::new(&mut self.inbuf[self.in_end..]);
        match Pin::new(&mut self.socket).poll_read(cx, &mut rb) {
            Poll::Pending => Poll::Pending,
            Poll::Ready(Err(e)) => {
                self.fail(FailureCause::ConnectionLost(format!(
                    "reading from the RabbitMQ stream failed: {e}"
                )));
                Poll::Ready(false)
            }
            Poll::Ready(Ok(())) => {
                let n = rb.filled().len();
                if n == 0 {
                    let unconfirmed = self.unconfirmed.len();
                    self.fail(FailureCause::ConnectionLost(format!(
                        "RabbitMQ closed the stream connection with {unconfirmed} publishes unconfirmed"
                    )));
                    return Poll::Ready(false);
                }
                self.in_end += n;
                self.last_read = Instant::now();
                self.handle_frames();
                Poll::Ready(matches!(self.state, State::Open))
            }
        }
    }

    /// Sends a heartbeat when nothing was written for half the interval; fails the
    /// connection when nothing was read for twice the interval. True when one was queued.
    fn poll_timer(&mut self, cx: &mut Context<'_>) -> bool {
        let Some(interval) = self.heartbeat else {
            return false;
        };
        let now = Instant::now();
        let dead_at = self.last_read + interval * 2;
        if now >= dead_at {
            self.fail(FailureCause::ConnectionLost(format!(
                "no frame and no heartbeat from the RabbitMQ stream node for {} s (heartbeat {} s): the broker or the network is gone",
                (now - self.last_read).as_secs(),
                interval.as_secs()
            )));
            return false;
        }
        let send_at = self.last_write + interval / 2;
        if now >= send_at && self.written == self.out.len() && self.batch.is_none() {
            frames::heartbeat(&mut self.out);
            self.last_write = now;
            return true;
        }
        let next = if self.written == self.out.len() {
            send_at.min(dead_at)
        } else {
            dead_at
        };
        self.timer.as_mut().reset(next);
        if self.timer.as_mut().poll(cx).is_ready() {
            cx.waker().wake_by_ref();
        }
        false
    }

    /// Encodes one message (`write`) with publishing id `id` into the open `Publish` frame,
    /// or a new one when it would not fit: every frame stays within `frame_max`.
    fn push(&mut self, id: u64, write: &dyn Fn(&mut BytesMut)) -> Result<(), SinkError> {
        let max = if self.frame_max == 0 {
            usize::MAX
        } else {
            self.frame_max as usize
        };
        if let Some(batch) = &mut self.batch {
            if batch.try_push(&mut self.out, id, max, write) {
                return Ok(());
            }
            self.finish_batch();
        }
        let mut batch = PublishFrame::start(&mut self.out, PUBLISHER_ID);
        if batch.try_push(&mut self.out, id, max, write) {
            self.batch = Some(batch);
            return Ok(());
        }
        batch.abandon(&mut self.out);
        Err(SinkError::Unsendable(format!(
            "the message does not fit one stream frame ({max} bytes at most: the broker's frame_max)"
        )))
    }
}

impl Sink for StreamSink {
    fn publish(&mut self, delivery: Delivery) -> Result<(), SinkError> {
        if !matches!(self.state, State::Open) {
            return Err(SinkError::Lost(format!(
                "the stream connection to {} is closed",
                self.url
            )));
        }
        let id = ids::publishing_id(delivery.commit_lsn, delivery.index_in_txn)
            .map_err(|e| SinkError::Violated(e.to_string()))?;
        if delivery.commit_lsn.0 >= ids::LSN_WARNING && !self.warned_limit {
            self.warned_limit = true;
            tracing::warn!(
                commit_lsn = %delivery.commit_lsn,
                limit = %crate::lsn::Lsn(ids::LSN_LIMIT),
                "the WAL is past half of what stream publishing ids can represent: at the limit run stops; plan a new --stream-producer-name at a moment when nothing is in flight (docs/src/internals/stream-ids.md)"
            );
        }
        if id <= self.last_id {
            return Err(SinkError::Violated(format!(
                "publishing id {id} (commit LSN {}, index {}) does not increase past {}: pgoutbox never sends an id at or below one it sent, the broker would drop it; please report this",
                delivery.commit_lsn, delivery.index_in_txn, self.last_id
            )));
        }
        if id <= self.stored {
            // Already stored under our producer name: settled without sending.
            self.last_id = id;
            self.skipped += 1;
            if let Some(c) = &self.counters {
                c.skipped(1);
            }
            self.ready.push((delivery.seq, PublishOutcome::Routed));
            return Ok(());
        }
        self.log_skipped();
        let seq = delivery.seq;
        let creation_time_ms = delivery.commit_time_us.div_euclid(1000);
        let message = self
            .encoder
            .encode(delivery)
            .map_err(SinkError::Unencodable)?;
        let write = |b: &mut BytesMut| {
            amqp10::encode(
                b,
                &amqp10::Message {
                    properties: &message.properties,
                    subject: message.routing_key.as_str(),
                    creation_time_ms,
                    body: &message.body,
                },
            )
        };
        self.push(id, &write)?;
        self.last_id = id;
        self.unconfirmed.insert(id, seq);
        self.published += 1;
        Ok(())
    }

    fn poll_settled(
        &mut self,
        cx: &mut Context<'_>,
    ) -> Poll<Result<Vec<(Seq, PublishOutcome)>, SinkError>> {
        if matches!(self.state, State::Open) {
            self.finish_batch();
            self.poll_io(cx);
        }
        if !self.ready.is_empty() {
            return Poll::Ready(Ok(std::mem::take(&mut self.ready)));
        }
        match &self.state {
            State::Open => Poll::Pending,
            State::Failed(reason) => Poll::Ready(Err(SinkError::Lost(reason.clone()))),
        }
    }

    fn is_writable(&self) -> bool {
        matches!(self.state, State::Open)
    }

    fn health(&self) -> SinkHealth {
        SinkHealth::single(if matches!(self.state, State::Open) {
            PartHealth::Connected
        } else {
            PartHealth::Lost
        })
    }

    fn unsettled(&self) -> usize {
        self.unconfirmed.len()
            + self
                .ready
                .iter()
                .filter(|(_, o)| !matches!(o, PublishOutcome::Failed(_)))
                .count()
    }

    fn parts(&self) -> Vec<PartFigures> {
        vec![PartFigures {
            health: self.health().parts[0],
            unsettled: self.unsettled(),
            published: self.published,
        }]
    }

    fn close(mut self: Box<Self>) -> BoxFuture<'static, ()> {
        Box::pin(async move {
            self.log_skipped();
            if matches!(self.state, State::Open) {
                self.finish_batch();
                let _ = frames::close(&mut self.out, u32::MAX, code::OK, "pgoutbox closing");
                let pending = self.out.split_off(self.written);
                let _ = self.socket.write_all(&pending).await;
                let _ = self.socket.flush().await;
            }
            let _ = self.socket.shutdown().await;
        })
    }
}

#[cfg(test)]
mod tests {
    //! Wire orderings against a scripted broker on a local socket (the real broker's
    //! behaviour is tested end to end in `tests/streams`): publish errors, a confirm of an id
    //! we never sent, deduplication at start.

    use super::*;
    use crate::envelope::{Envelope, Metadata};
    use crate::lsn::Lsn;
    use crate::sink::{recv_settled, Exchange};
    use bytes::{BufMut, Bytes};
    use tokio::net::TcpListener;

    fn frame(key: u16, body: &[u8]) -> Vec<u8> {
        let mut v = Vec::new();
        v.extend_from_slice(&((4 + body.len()) as u32).to_be_bytes());
        v.extend_from_slice(&key.to_be_bytes());
        v.extend_from_slice(&1u16.to_be_bytes());
        v.extend_from_slice(body);
        v
    }

    fn ok(key: u16, correlation: u32, rest: &[u8]) -> Vec<u8> {
        let mut b = correlation.to_be_bytes().to_vec();
        b.extend_from_slice(&code::OK.to_be_bytes());
        b.extend_from_slice(rest);
        frame(key | frames::RESPONSE, &b)
    }

    /// A broker that answers the handshake with `stored` as the producer's sequence, then
    /// answers each published id with `answer(id)`: `None` a confirm, `Some(code)` a publish
    /// error; and sends `extra` (raw frames) after the first publish.
    async fn scripted(stored: u64, answer: fn(u64) -> Option<u16>, extra: Vec<u8>) -> String {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        tokio::spawn(async move {
            let (mut sock, _) = listener.accept().await.unwrap();
            let mut buf = Vec::new();
            let mut extra = Some(extra);
            loop {
                let mut chunk = [0u8; 65536];
                let n = sock.read(&mut chunk).await.unwrap_or(0);
                if n == 0 {
                    return;
                }
                buf.extend_from_slice(&chunk[..n]);
                while let Ok(Some(len)) = frames::frame_len(&buf, 0) {
                    let f: Vec<u8> = buf.drain(..len).collect();
                    let key = u16::from_be_bytes([f[4], f[5]]);
                    let corr = || u32::from_be_bytes([f[8], f[9], f[10], f[11]]);
                    let reply = match key {
                        frames::PEER_PROPERTIES | frames::OPEN => {
                            ok(key, corr(), &0i32.to_be_bytes())
                        }
                        frames::SASL_HANDSHAKE => {
                            let mut r = 1i32.to_be_bytes().to_vec();
                            r.extend_from_slice(&5i16.to_be_bytes());
                            r.extend_from_slice(b"PLAIN");
                            ok(key, corr(), &r)
                        }
                        frames::SASL_AUTHENTICATE => {
                            let mut r = ok(key, corr(), &(-1i32).to_be_bytes());
                            let mut tune = 1_048_576u32.to_be_bytes().to_vec();
                            tune.extend_from_slice(&60u32.to_be_bytes());
                            r.extend_from_slice(&frame(frames::TUNE, &tune));
                            r
                        }
                        frames::CREATE | frames::DECLARE_PUBLISHER => ok(key, corr(), &[]),
                        frames::METADATA => {
                            // No response code: brokers, then streams (ours exists).
                            let mut b = corr().to_be_bytes().to_vec();
                            b.extend_from_slice(&1i32.to_be_bytes());
                            b.extend_from_slice(&0u16.to_be_bytes());
                            b.extend_from_slice(&1i16.to_be_bytes());
                            b.push(b'h');
                            b.extend_from_slice(&5552u32.to_be_bytes());
                            b.extend_from_slice(&1i32.to_be_bytes());
                            b.extend_from_slice(&1i16.to_be_bytes());
                            b.push(b's');
                            b.extend_from_slice(&code::OK.to_be_bytes());
                            b.extend_from_slice(&0u16.to_be_bytes());
                            b.extend_from_slice(&0i32.to_be_bytes());
                            frame(key | frames::RESPONSE, &b)
                        }
                        frames::QUERY_PUBLISHER_SEQUENCE => ok(key, corr(), &stored.to_be_bytes()),
                        frames::PUBLISH => {
                            let count = u32::from_be_bytes([f[9], f[10], f[11], f[12]]);
                            let mut at = 13;
                            let (mut confirms, mut errors) = (Vec::new(), Vec::new());
                            for _ in 0..count {
                                let mut id = [0u8; 8];
                                id.copy_from_slice(&f[at..at + 8]);
                                let id = u64::from_be_bytes(id);
                                let len = u32::from_be_bytes([
                                    f[at + 8],
                                    f[at + 9],
                                    f[at + 10],
                                    f[at + 11],
                                ]);
                                at += 12 + len as usize;
                                match answer(id) {
                                    None => confirms.push(id),
                                    Some(c) => errors.push((id, c)),
                                }
                            }
                            let mut r = Vec::new();
                            if !errors.is_empty() {
                                let mut b = vec![PUBLISHER_ID];
                                b.extend_from_slice(&(errors.len() as u32).to_be_bytes());
                                for (id, c) in &errors {
                                    b.extend_from_slice(&id.to_be_bytes());
                                    b.extend_from_slice(&c.to_be_bytes());
                                }
                                r.extend_from_slice(&frame(frames::PUBLISH_ERROR, &b));
                            }
                            let mut b = vec![PUBLISHER_ID];
                            b.extend_from_slice(&(confirms.len() as u32).to_be_bytes());
                            for id in &confirms {
                                b.extend_from_slice(&id.to_be_bytes());
                            }
                            r.extend_from_slice(&frame(frames::PUBLISH_CONFIRM, &b));
                            r.extend_from_slice(&extra.take().unwrap_or_default());
                            r
                        }
                        _ => Vec::new(),
                    };
                    if sock.write_all(&reply).await.is_err() {
                        return;
                    }
                }
            }
        });
        format!("rabbitmq-stream://u:p@127.0.0.1:{port}/%2f")
    }

    fn delivery(seq: Seq, commit: u64, index: u32) -> Delivery {
        Delivery {
            seq,
            envelope: Envelope {
                version: crate::envelope::VERSION_3,
                message_id: format!("m-{seq}"),
                topic: "t".into(),
                content_type: "application/json".into(),
                headers: serde_json::Map::new(),
                payload: Bytes::from_static(b"{}"),
                emitted_by: None,
                emitted_by_unchecked: false,
                exchange: None,
                meta: Metadata::default(),
            },
            exchange: Exchange::Configured,
            lsn: Lsn(commit - 8),
            commit_lsn: Lsn(commit),
            commit_time_us: 1,
            index_in_txn: index,
            emitter_checked: false,
            attempt: 1,
            read_at: None,
        }
    }

    async fn sink(url: String) -> StreamSink {
        let config = StreamConfig {
            url,
            stream: "s".into(),
            producer_name: "p".into(),
            create: Some(Vec::new()),
            connection_name: "test".into(),
            signals: BrokerSignals::default(),
            counters: None,
        };
        StreamSink::connect(
            &config,
            Encoder::new(crate::config::PublishProperties::Full, None),
        )
        .await
        .expect("connects to the scripted broker")
    }

    /// Every outcome, by seq, until `n` came.
    async fn outcomes(s: &mut StreamSink, n: usize) -> BTreeMap<Seq, PublishOutcome> {
        let mut all = BTreeMap::new();
        while all.len() < n {
            let got = tokio::time::timeout(Duration::from_secs(10), recv_settled(s))
                .await
                .expect("outcomes in time")
                .expect("no sink error");
            all.extend(got);
        }
        all
    }

    #[tokio::test]
    async fn a_definite_publish_error_refuses_that_message_only() {
        let url = scripted(
            0,
            |i| (i == ids::publishing_id(Lsn(160), 1).unwrap()).then_some(code::ACCESS_REFUSED),
            Vec::new(),
        )
        .await;
        let mut s = sink(url).await;
        for (seq, i) in [(1, 0), (2, 1), (3, 2)] {
            s.publish(delivery(seq, 160, i)).unwrap();
        }
        let all = outcomes(&mut s, 3).await;
        assert_eq!(all[&1], PublishOutcome::Routed);
        assert!(
            matches!(&all[&2], PublishOutcome::Refused { code: 0x10, text } if text.contains("access refused")),
            "{:?}",
            all[&2]
        );
        assert_eq!(all[&3], PublishOutcome::Routed);
        assert!(matches!(s.health().parts[0], PartHealth::Connected));
    }

    #[tokio::test]
    async fn a_publish_error_that_means_the_stream_is_gone_ends_the_session_unsettled() {
        let url = scripted(
            0,
            |i| {
                (i == ids::publishing_id(Lsn(160), 1).unwrap())
                    .then_some(code::PUBLISHER_DOES_NOT_EXIST)
            },
            Vec::new(),
        )
        .await;
        let mut s = sink(url).await;
        for (seq, i) in [(1, 0), (2, 1), (3, 2)] {
            s.publish(delivery(seq, 160, i)).unwrap();
        }
        // The error comes before the confirms in the scripted reply: every publish still
        // unconfirmed then fails (it is sent again by the next session), none is refused.
        let all = outcomes(&mut s, 3).await;
        for seq in 1..=3 {
            assert!(
                matches!(&all[&seq], PublishOutcome::Failed(f) if f.to_string().contains("publisher does not exist")),
                "{seq}: {:?}",
                all[&seq]
            );
        }
        assert!(matches!(s.health().parts[0], PartHealth::Lost));
        assert!(matches!(
            recv_settled(&mut s).await,
            Err(SinkError::Lost(_))
        ));
    }

    #[tokio::test]
    async fn ids_at_or_below_the_stored_sequence_settle_without_being_sent() {
        let stored = ids::publishing_id(Lsn(160), 1).unwrap();
        // The broker would refuse anything at or below `stored`: none of it may be sent.
        let url = scripted(
            stored,
            |i| (i <= ids::publishing_id(Lsn(160), 1).unwrap()).then_some(0x0f),
            Vec::new(),
        )
        .await;
        let mut s = sink(url).await;
        for (seq, i) in [(1, 0), (2, 1), (3, 2)] {
            s.publish(delivery(seq, 160, i)).unwrap();
        }
        s.publish(delivery(4, 168, 0)).unwrap();
        let all = outcomes(&mut s, 4).await;
        assert!(
            all.values().all(|o| *o == PublishOutcome::Routed),
            "{all:?}"
        );
        assert_eq!(s.published, 2, "only the two above the stored id were sent");
        // An id that does not increase is refused before anything is sent.
        assert!(matches!(
            s.publish(delivery(5, 168, 0)),
            Err(SinkError::Violated(_))
        ));
    }

    #[tokio::test]
    async fn a_confirm_of_an_id_never_sent_settles_nothing() {
        let mut stray = vec![PUBLISHER_ID];
        stray.put_u32(1);
        stray.put_u64(7);
        let url = scripted(0, |_| None, frame(frames::PUBLISH_CONFIRM, &stray)).await;
        let mut s = sink(url).await;
        s.publish(delivery(1, 160, 0)).unwrap();
        let all = outcomes(&mut s, 1).await;
        assert_eq!(all[&1], PublishOutcome::Routed);
        s.publish(delivery(2, 168, 0)).unwrap();
        let all = outcomes(&mut s, 1).await;
        assert_eq!(all.keys().copied().collect::<Vec<_>>(), [2]);
        assert!(matches!(s.health().parts[0], PartHealth::Connected));
    }
}
