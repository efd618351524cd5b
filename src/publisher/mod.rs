//! RabbitMQ publishing with publisher confirms, on our own AMQP 0-9-1 connection, and
//! nothing of Postgres.
//!
//! ```text
//!  publish() ──encode──▶ write buffer ──one write──▶ socket ──▶ RabbitMQ
//!                                                                 │
//!  recv_outcomes() ◀── Confirms (settle in wire order) ◀── frames ◀┘
//!                      basic.return / basic.ack / basic.nack
//! ```
//!
//! There is no task and no thread here: [`Publisher::publish`] encodes a message into the
//! write buffer, and all I/O (writing that buffer, reading and handling frames, heartbeats)
//! happens while the pipeline polls [`Publisher::recv_outcomes`], on the pipeline's own
//! thread. Frames are laid out with `amq-protocol`, lapin's codec ([`wire`]); the handshake
//! is [`connection`]; settling is the plain state machine [`confirms::Confirms`]: delivery
//! tags are counted by us from 1 after `confirm.select`, a `basic.return` marks the publish
//! carrying its key, and the `basic.ack` that later covers it settles it as returned.
//!
//! Each message names its exchange ([`Exchange`]): the configured one, declared at
//! connect, or one its producer named, declared (or checked, under `--no-declare`) on its
//! first use on this connection, on channel 2, by [`exchanges`]; messages wait there, in
//! order, until their exchange is known, and a refused exchange settles its message as
//! [`PublishOutcome::ExchangeRefused`] without touching the publishing channel.
//!
//! To the pipeline this is one [`crate::sink::Sink`]: [`AmqpSink`] encodes each delivery
//! with [`encode::Encoder`] (`--publish-properties`, `--cloudevents`) and hands it to a
//! [`Publisher`]. The rest of the layout: [`error`] (what can fail, and the fix), the
//! connection's frames (`frames.rs`: confirms, returns, closes, blocking) and its socket
//! (`io.rs`: writes, reads, heartbeats).
//!
//! Source: AMQP 0-9-1 specification (sections 2.2.4, 4.2), `basic.publish` (mandatory),
//! `basic.return`, `basic.ack`/`basic.nack` with `multiple`, `connection.blocked`; RabbitMQ
//! "Consumer Acknowledgements and Publisher Confirms" and "Blocked Connection
//! Notifications".

pub mod confirms;
pub mod connection;
pub mod encode;
pub mod error;
pub mod exchanges;
mod frames;
mod io;
pub mod message;
pub mod sink;
pub mod socket;
pub mod tls;
pub mod wire;

use std::future::poll_fn;
use std::pin::Pin;
use std::sync::atomic::Ordering;
use std::task::{Context, Poll};
use std::time::Duration;

use amq_protocol::frame::AMQPFrame;
use amq_protocol::protocol::{connection as conn, AMQPClass};
use amq_protocol::types::ShortString;
use tokio::io::AsyncWriteExt;
use tokio::time::{Instant, Sleep};

pub use crate::sink::PublishOutcome;
use confirms::Confirms;
pub use connection::{CHANNEL, DEFAULT_HEARTBEAT_S};
use exchanges::{Exchanges, Released};
pub use message::{Exchange, MatchKey, OutboundMessage};
pub use sink::AmqpSink;
use socket::{Endpoint, Socket};

/// The header that carries each publish's match key (the message LSN, `X/Y`).
pub const MATCH_KEY_HEADER: &str = crate::contract::HEADER_LSN;

/// How long connecting, logging in, opening the channel and declaring the exchange may
/// take: a host that accepts TCP and never answers is reported after this, as a retryable
/// timeout.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// Reads handled per poll before other branches of the pipeline's loop get a turn.
const READS_PER_POLL: usize = 32;
/// The read buffer's size when frames are small (acks are 21 bytes each).
const READ_BUFFER: usize = 64 * 1024;
/// A write buffer that grew past this (a window of large messages) is released once empty.
const KEEP_WRITE_CAPACITY: usize = 4 * 1024 * 1024;

pub use error::Error;

/// Settings of one publisher connection.
#[derive(Clone)]
pub struct PublisherConfig {
    /// `amqp://user:pass@host:port/vhost[?heartbeat=S&frame_max=BYTES]`, or `amqps://`
    /// with the TLS parameters of [`tls`] (`cacertfile=`, `certfile=`, `keyfile=`,
    /// `server_name_indication=`).
    pub amqp_url: crate::config::BrokerUrl,
    /// The durable topic exchange to publish to (declared if absent) when a message names
    /// none ([`Exchange::Configured`]).
    pub exchange: String,
    /// How exchanges are declared: this one at connect, producer-named ones on first use
    /// (durable topic, or passive under `--no-declare`).
    pub declare: connection::Declare,
    /// Shown in RabbitMQ's connection list.
    pub connection_name: String,
    /// Flags other tasks read (metrics, readiness).
    pub signals: BrokerSignals,
}

impl std::fmt::Debug for PublisherConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PublisherConfig")
            .field("amqp_url", &self.amqp_url)
            .field("exchange", &self.exchange)
            .field("declare", &self.declare)
            .field("connection_name", &self.connection_name)
            .finish()
    }
}

/// What the connection reports, as flags other tasks read.
///
/// `blocked` is true while RabbitMQ blocks the connection (`connection.blocked`, sent when a
/// memory or disk alarm is raised; each start and end is logged once); `lost` turns true
/// when the connection or the channel fails.
#[derive(Debug, Clone, Default)]
pub struct BrokerSignals {
    /// True while the broker blocks the connection.
    pub blocked: std::sync::Arc<std::sync::atomic::AtomicBool>,
    /// True once the connection or the channel failed.
    pub lost: std::sync::Arc<std::sync::atomic::AtomicBool>,
    /// Where [`AmqpSink`] records each first publish's residence time (read to written);
    /// `None`: not recorded.
    pub residence: Option<crate::metrics::Residence>,
}

#[derive(Debug)]
enum State {
    Open,
    /// The connection or channel failed (reason); unsettled publishes were reported Failed.
    Failed(String),
    /// The broker broke the settling rule (reason).
    Violated(String),
}

/// A `basic.return` whose content header or body is still to come.
#[derive(Debug)]
struct Returning {
    reply_code: u16,
    reply_text: String,
    /// Body bytes still to skip once the header was seen.
    body_left: Option<u64>,
}

/// A connected publisher: queue messages with [`Publisher::publish`], drive the connection
/// and read outcomes with [`Publisher::recv_outcomes`]. `T` is the caller's tag, handed
/// back with each outcome.
pub struct Publisher<T> {
    socket: Socket,
    url: String,
    exchange: String,
    frame_max: u32,
    heartbeat: Option<Duration>,
    /// Encoded frames; `out[written..]` is not yet written.
    out: Vec<u8>,
    written: usize,
    /// Bytes written and dropped from `out` before its current start: `out_base + i` is
    /// byte `i` of `out` counted from the connection's first byte.
    out_base: u64,
    /// Bytes were written since the last completed flush: a TLS socket may still hold
    /// them as records in rustls' buffer.
    unflushed: bool,
    /// Read buffer; `inbuf[in_start..in_end]` holds bytes not yet framed.
    inbuf: Vec<u8>,
    in_start: usize,
    in_end: usize,
    confirms: Confirms<T>,
    /// Producer-named exchanges known on this connection, and messages held for one.
    exchanges: Exchanges<T>,
    /// Scratch list of messages released by `exchanges` (kept to reuse its allocation).
    released: Vec<Released<T>>,
    returning: Option<Returning>,
    /// Outcomes settled and not yet handed out.
    ready: Vec<(T, PublishOutcome)>,
    state: State,
    blocked: bool,
    signals: BrokerSignals,
    last_read: Instant,
    last_write: Instant,
    timer: Pin<Box<Sleep>>,
}

impl<T> std::fmt::Debug for Publisher<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Publisher")
            .field("url", &self.url)
            .field("exchange", &self.exchange)
            .field("frame_max", &self.frame_max)
            .field("heartbeat", &self.heartbeat)
            .field("state", &self.state)
            .field("unsettled", &self.confirms.unsettled())
            .finish_non_exhaustive()
    }
}

impl<T> Publisher<T> {
    /// Connects (TCP, and TLS for `amqps://`), logs in (PLAIN), opens channel 1 in confirm
    /// mode and declares the exchange (durable topic), all within [`CONNECT_TIMEOUT`].
    ///
    /// # Errors
    /// [`Error::Url`] for an unusable URL; [`Error::TlsSetup`] for an unusable TLS file;
    /// [`Error::Tls`] when the TLS handshake fails; [`Error::Refused`] when the broker
    /// refuses the login or the vhost; [`Error::ConnectTimeout`]; [`Error::Connect`];
    /// [`Error::Declare`].
    pub async fn connect(config: &PublisherConfig) -> Result<Self, Error> {
        let url = config.amqp_url.to_string();
        let endpoint = Endpoint::parse(config.amqp_url.expose_secret())
            .map_err(|e| Error::Url(format!("{url}: {e}")))?;
        let opened = tokio::time::timeout(
            CONNECT_TIMEOUT,
            connection::open(
                &endpoint,
                &config.exchange,
                config.declare,
                &config.connection_name,
            ),
        )
        .await
        .map_err(|_| Error::ConnectTimeout {
            url: url.clone(),
            timeout_s: CONNECT_TIMEOUT.as_secs(),
        })??;
        let now = Instant::now();
        let frame_max = opened.tuned.frame_max;
        let mut inbuf = vec![0; READ_BUFFER.max(frame_max as usize + 1)];
        let leftover = opened.leftover.len();
        if leftover > inbuf.len() {
            inbuf.resize(leftover, 0);
        }
        inbuf[..leftover].copy_from_slice(&opened.leftover);
        config.signals.lost.store(false, Ordering::Relaxed);
        config.signals.blocked.store(false, Ordering::Relaxed);
        Ok(Publisher {
            socket: opened.socket,
            url,
            exchange: config.exchange.clone(),
            frame_max,
            heartbeat: opened.tuned.heartbeat,
            out: Vec::with_capacity(64 * 1024),
            written: 0,
            out_base: 0,
            unflushed: false,
            inbuf,
            in_start: 0,
            in_end: leftover,
            confirms: Confirms::default(),
            exchanges: Exchanges::new(&config.exchange, config.declare, opened.tuned.channel_max),
            released: Vec::new(),
            returning: None,
            ready: Vec::new(),
            state: State::Open,
            blocked: false,
            signals: config.signals.clone(),
            last_read: now,
            last_write: now,
            timer: Box::pin(tokio::time::sleep_until(now)),
        })
    }

    /// Encodes `message` as `basic.publish` (mandatory) to its exchange, with its content
    /// header and body frames, split at the negotiated `frame_max`, into the write buffer,
    /// and records it under the next delivery tag. Nothing is written until
    /// [`Publisher::recv_outcomes`] is polled, so many publishes go out in one write.
    ///
    /// A message naming an exchange not yet declared on this connection (or queued behind
    /// one that is) waits until the declaration is answered ([`exchanges`]); it is then
    /// published, or settled as [`PublishOutcome::ExchangeRefused`] (or
    /// [`PublishOutcome::Unsendable`]) through [`Publisher::recv_outcomes`].
    ///
    /// # Errors
    /// [`Error::Lost`] or [`Error::Protocol`] once the connection failed (nothing is
    /// recorded); [`Error::Unsendable`] when the message's content header exceeds
    /// `frame_max` (nothing is recorded or written).
    pub fn publish(&mut self, message: OutboundMessage<T>) -> Result<(), Error> {
        match &self.state {
            State::Open => {}
            State::Failed(reason) => return Err(Error::Lost(reason.clone())),
            State::Violated(reason) => return Err(Error::Protocol(reason.clone())),
        }
        if self.written == self.out.len() && self.written > 0 {
            self.out_base += self.written as u64;
            self.out.clear();
            self.written = 0;
        }
        let mut released = std::mem::take(&mut self.released);
        let now = self.exchanges.admit(message, &mut self.out, &mut released);
        self.release(&mut released);
        self.released = released;
        match now {
            Some(message) => self
                .encode(message)
                .map_err(|(_, error)| Error::Unsendable(error)),
            None => Ok(()),
        }
    }

    /// Encodes `message` as `basic.publish` (mandatory) into the write buffer and records
    /// it under the next delivery tag; gives it back with the reason when it cannot be
    /// sent on this connection (nothing written or recorded).
    fn encode(&mut self, message: OutboundMessage<T>) -> Result<(), (T, String)> {
        let exchange = match &message.exchange {
            Exchange::Configured => self.exchange.as_str(),
            Exchange::Named(name) => name.as_str(),
        };
        let publish = wire::Publish {
            channel: CHANNEL,
            exchange,
            routing_key: message.routing_key.as_str(),
            mandatory: true,
            properties: &message.properties,
            body: &message.body,
        };
        if let Err(error) = wire::encode_publish(&mut self.out, &publish, self.frame_max) {
            return Err((message.tag, error));
        }
        self.confirms.published(message.tag, message.match_key);
        Ok(())
    }

    /// Publishes the held messages whose exchange is now known, and settles the refused
    /// ones, in order (`released` is left empty).
    fn release(&mut self, released: &mut Vec<Released<T>>) {
        for r in released.drain(..) {
            match r {
                Released::Publish(message) => {
                    if let Err((tag, error)) = self.encode(message) {
                        self.ready.push((tag, PublishOutcome::Unsendable { error }));
                    }
                }
                Released::Refused(tag, outcome) => self.ready.push((tag, outcome)),
            }
        }
    }

    /// Writes what is buffered, reads and handles the broker's frames, and keeps heartbeats
    /// going; returns the outcomes settled so far (at least one), in the order the broker
    /// settled them.
    ///
    /// # Errors
    /// When the connection or channel fails, the publishes unsettled then are first
    /// returned as [`PublishOutcome::Failed`]; later calls return [`Error::Lost`].
    /// [`Error::Protocol`] when the broker broke the settling rule: nothing is settled from
    /// that point, not even outcomes read before it in the same batch.
    ///
    /// # Cancel safety
    /// Cancel safe: all state lives in the publisher, and a write that completed is
    /// accounted before the next poll.
    pub async fn recv_outcomes(&mut self) -> Result<Vec<(T, PublishOutcome)>, Error> {
        poll_fn(|cx| self.poll_outcomes(cx)).await
    }

    /// Bytes encoded on this connection so far (counted from its first publish).
    pub fn encoded_bytes(&self) -> u64 {
        self.out_base + self.out.len() as u64
    }

    /// Bytes of [`Publisher::encoded_bytes`] written to the socket so far.
    pub fn written_bytes(&self) -> u64 {
        self.out_base + self.written as u64
    }

    /// True while the connection is up and has not failed.
    pub fn is_connected(&self) -> bool {
        matches!(self.state, State::Open)
    }

    /// True while RabbitMQ blocks the connection (`connection.blocked` without its
    /// `connection.unblocked`).
    pub fn is_blocked(&self) -> bool {
        self.blocked
    }

    /// Publishes not yet acked or nacked, and messages held until their exchange is
    /// declared.
    pub fn unsettled(&self) -> usize {
        self.confirms.unsettled() + self.exchanges.held()
    }

    /// The negotiated `frame_max`, bytes.
    pub fn frame_max(&self) -> u32 {
        self.frame_max
    }

    /// The negotiated heartbeat interval (`None`: disabled).
    pub fn heartbeat(&self) -> Option<Duration> {
        self.heartbeat
    }

    /// Closes the connection (`connection.close` 200, then waits for `close-ok` or EOF).
    /// Best effort; the caller bounds how long it may take.
    pub async fn close(mut self) {
        if !matches!(self.state, State::Open) {
            return;
        }
        let close = AMQPFrame::Method(
            0,
            AMQPClass::Connection(conn::AMQPMethod::Close(conn::Close {
                reply_code: 200,
                reply_text: ShortString::from("pgoutbox shutdown"),
                class_id: 0,
                method_id: 0,
            })),
        );
        if wire::encode(&mut self.out, &close).is_err() {
            return;
        }
        let pending = self.out.split_off(self.written);
        if self.socket.write_all(&pending).await.is_err() {
            return;
        }
        let _ = self.socket.flush().await;
        // Whatever arrives now (late acks, returns) is skipped: anything unsettled stays
        // unacknowledged and is sent again by the next session. The close ends at the
        // broker's `connection.close-ok`, not at its end of stream (issue 21 item 14).
        connection::read_until_close_ok(&mut self.socket, Vec::new(), self.frame_max).await;
    }

    /// [`Publisher::recv_outcomes`] as a poll function (what [`AmqpSink`] drives).
    ///
    /// # Errors
    /// As [`Publisher::recv_outcomes`].
    pub fn poll_outcomes(
        &mut self,
        cx: &mut Context<'_>,
    ) -> Poll<Result<Vec<(T, PublishOutcome)>, Error>> {
        if matches!(self.state, State::Open) {
            self.poll_io(cx);
        }
        if !self.ready.is_empty() {
            return Poll::Ready(Ok(std::mem::take(&mut self.ready)));
        }
        match &self.state {
            State::Open => Poll::Pending,
            State::Failed(reason) => Poll::Ready(Err(Error::Lost(reason.clone()))),
            State::Violated(reason) => Poll::Ready(Err(Error::Protocol(reason.clone()))),
        }
    }
}
