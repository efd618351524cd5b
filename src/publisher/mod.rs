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
//! Source: AMQP 0-9-1 specification (sections 2.2.4, 4.2), `basic.publish` (mandatory),
//! `basic.return`, `basic.ack`/`basic.nack` with `multiple`, `connection.blocked`; RabbitMQ
//! "Consumer Acknowledgements and Publisher Confirms" and "Blocked Connection
//! Notifications".

pub mod confirms;
pub mod connection;
pub mod encode;
pub mod exchanges;
pub mod message;
pub mod sink;
pub mod socket;
pub mod tls;
pub mod wire;

use std::future::{poll_fn, Future};
use std::pin::Pin;
use std::str::FromStr;
use std::sync::atomic::Ordering;
use std::task::{Context, Poll};
use std::time::Duration;

use amq_protocol::frame::AMQPFrame;
use amq_protocol::protocol::{basic, channel, connection as conn, AMQPClass, BasicProperties};
use amq_protocol::types::{AMQPValue, ShortString};
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::time::{Instant, Sleep};

use crate::lsn::Lsn;
pub use crate::sink::PublishOutcome;
use confirms::{Confirms, ReturnedKey, Violation};
pub use connection::{CHANNEL, DEFAULT_HEARTBEAT_S};
use exchanges::{Exchanges, Released, DECLARE_CHANNEL};
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

/// An error of the publisher layer.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The AMQP URL is not usable.
    #[error("invalid AMQP URL: {0}")]
    Url(String),
    /// Connecting failed: TCP, the AMQP handshake (a TLS listener reached with `amqp://`
    /// among the causes), or a close the broker sent during it. Retryable.
    #[error("RabbitMQ at {url}: {context}; check host, port, user, password and vhost in --amqp-url (PGOUTBOX_AMQP_URL) and that RabbitMQ is running")]
    Connect {
        /// The redacted URL.
        url: String,
        /// What failed.
        context: String,
    },
    /// The broker refused the login (403 `ACCESS_REFUSED`: wrong user or password) or the
    /// vhost (530 `NOT_ALLOWED`: missing vhost, or no permission on it). Definite: retrying
    /// cannot fix it.
    #[error("RabbitMQ at {url} refused the connection with {reply_code} {reply_text}; {fix}")]
    Refused {
        /// The redacted URL.
        url: String,
        /// The broker's reply code, e.g. 403.
        reply_code: u16,
        /// The broker's reply text, e.g. `ACCESS_REFUSED - Login was refused ...`.
        reply_text: String,
        /// What to change.
        fix: String,
    },
    /// A TLS file named in the URL (`cacertfile=`, `certfile=`, `keyfile=`) cannot be used,
    /// or the system trust store holds no CA certificate. Definite: the same file fails
    /// again.
    #[error("amqps: cannot use {what} from --amqp-url (PGOUTBOX_AMQP_URL): {reason}; {fix}")]
    TlsSetup {
        /// The setting and its value (`cacertfile=/etc/ca.pem`), or "the system trust store".
        what: String,
        /// What is wrong with it.
        reason: String,
        /// What to change.
        fix: &'static str,
    },
    /// The TLS handshake failed: the broker's certificate did not verify (unknown CA, wrong
    /// name, expired), the port is not a TLS listener, or the broker sent an alert.
    /// Retryable: a broker's certificate or listener can change while we wait.
    #[error("RabbitMQ at {url}: {context}; {fix}")]
    Tls {
        /// The redacted URL.
        url: String,
        /// What happened, with rustls' reason.
        context: String,
        /// What to change.
        fix: String,
    },
    /// The AMQP handshake did not finish in time (the host accepted TCP and never answered,
    /// or nobody answered). Retryable.
    #[error("RabbitMQ: connecting to {url} timed out after {timeout_s} s: the AMQP handshake did not finish; check host and port in --amqp-url (PGOUTBOX_AMQP_URL) and that RabbitMQ is running and answering there")]
    ConnectTimeout {
        /// The redacted URL.
        url: String,
        /// The timeout, in seconds.
        timeout_s: u64,
    },
    /// The broker refused `exchange.declare`: 406 PRECONDITION_FAILED when the exchange
    /// exists with another type or durability, 403 ACCESS_REFUSED when the user may not
    /// configure it.
    #[error("could not declare exchange {exchange:?} (durable topic): RabbitMQ answered {reply_code} {reply_text}; {}", declare_fix(*.reply_code))]
    Declare {
        /// The exchange name.
        exchange: String,
        /// The broker's reply code.
        reply_code: u16,
        /// The broker's reply text.
        reply_text: String,
    },
    /// The connection failed and every publish unsettled then was already reported as
    /// [`PublishOutcome::Failed`]. Retryable.
    #[error("the RabbitMQ connection was lost: {0}")]
    Lost(String),
    /// The broker broke the settling rule (a `basic.return` without our key or matching no
    /// unconfirmed publish, an ack of an unknown delivery tag): nothing more was settled on
    /// the connection, including outcomes not yet handed out. Definite.
    #[error("RabbitMQ broke the publisher-confirm protocol: {0}; nothing after it was acknowledged. Report this with the broker's version")]
    Protocol(String),
    /// This message cannot be sent on this connection (its content header exceeds the
    /// negotiated `frame_max`); nothing was written for it.
    #[error("{0}")]
    Unsendable(String),
}

fn declare_fix(reply_code: u16) -> &'static str {
    match reply_code {
        403 => "grant the user configure permission on it (rabbitmqctl set_permissions), or declare it beforehand and grant write",
        404 => "it does not exist and run has --no-declare (PGOUTBOX_NO_DECLARE), which only checks: declare it as a durable topic exchange, or drop --no-declare; run retries meanwhile",
        _ => "if it exists with another type or durability, delete it or pick another --exchange",
    }
}

impl Error {
    /// The error for a `connection.close` received while connecting: 403 and 530 are
    /// [`Error::Refused`] with the fix, anything else [`Error::Connect`].
    pub fn refused_or_closed(url: &str, reply_code: u16, reply_text: &str) -> Error {
        let fix = match reply_code {
            403 => "check the user and password in --amqp-url (PGOUTBOX_AMQP_URL); `rabbitmqctl list_users` shows the users, `rabbitmqctl change_password USER PASSWORD` sets one".to_owned(),
            530 => {
                let vhost = url::Url::parse(url)
                    .ok()
                    .and_then(|u| u.path().strip_prefix('/').map(str::to_owned))
                    .filter(|p| !p.is_empty())
                    .map(|p| percent_decode(&p))
                    .unwrap_or_else(|| "/".into());
                format!(
                    "the vhost {vhost:?} is missing or the user may not use it: create it with `rabbitmqctl add_vhost {vhost}` and grant the user with `rabbitmqctl set_permissions -p {vhost} USER '.*' '.*' '.*'`, or fix the vhost (the URL path, %2f for /) in --amqp-url (PGOUTBOX_AMQP_URL)"
                )
            }
            _ => {
                return Error::Connect {
                    url: url.to_owned(),
                    context: format!(
                        "the broker closed the connection with {reply_code} {reply_text}"
                    ),
                }
            }
        };
        Error::Refused {
            url: url.to_owned(),
            reply_code,
            reply_text: reply_text.to_owned(),
            fix,
        }
    }
}

/// Settings of one publisher connection.
#[derive(Clone)]
pub struct PublisherConfig {
    /// `amqp://user:pass@host:port/vhost[?heartbeat=S&frame_max=BYTES]`, or `amqps://`
    /// with the TLS parameters of [`tls`] (`cacertfile=`, `certfile=`, `keyfile=`,
    /// `server_name_indication=`).
    pub amqp_url: String,
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
            .field("amqp_url", &crate::config::redact_url(&self.amqp_url))
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
        let url = crate::config::redact_url(&config.amqp_url);
        let endpoint =
            Endpoint::parse(&config.amqp_url).map_err(|e| Error::Url(format!("{url}: {e}")))?;
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
        let mut buf = [0u8; 4096];
        loop {
            match tokio::io::AsyncReadExt::read(&mut self.socket, &mut buf).await {
                Ok(0) | Err(_) => return,
                // Whatever arrives now (late acks, close-ok) ends here: anything unsettled
                // stays unacknowledged and is sent again by the next session.
                Ok(_) => {}
            }
        }
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

    /// Writes, reads and handles frames until the socket would block both ways (wakers
    /// registered) or outcomes are ready; keeps the heartbeat timer armed.
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
                    // More to read: come back after the pipeline's other branches.
                    cx.waker().wake_by_ref();
                    break;
                }
                reads += 1;
                match self.poll_read(cx) {
                    Poll::Ready(true) => {}
                    Poll::Ready(false) => {
                        // The broker closed the channel or connection: its close-ok (queued
                        // by handle_frame) goes out, best effort, before we give up.
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
            // Handling frames may have queued replies (close-ok); write them now.
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
                    self.fail("writing to RabbitMQ returned 0 bytes (socket closed)".into());
                    return;
                }
                Poll::Ready(Ok(n)) => {
                    self.written += n;
                    self.unflushed = true;
                    self.last_write = Instant::now();
                }
                Poll::Ready(Err(e)) => {
                    self.fail(format!("writing to RabbitMQ failed: {e}"));
                    return;
                }
                Poll::Pending => return,
            }
        }
        self.out.clear();
        self.written = 0;
        if self.out.capacity() > KEEP_WRITE_CAPACITY {
            self.out = Vec::with_capacity(64 * 1024);
        }
        // TLS: a write may leave records in rustls' buffer when the socket would block;
        // flushing sends them (a no-op on plain TCP). Pending registers the waker.
        if self.unflushed {
            match Pin::new(&mut self.socket).poll_flush(cx) {
                Poll::Ready(Ok(())) => self.unflushed = false,
                Poll::Ready(Err(e)) => self.fail(format!("writing to RabbitMQ failed: {e}")),
                Poll::Pending => {}
            }
        }
    }

    /// One read: `Ready(true)` when bytes were read and handled, `Ready(false)` when the
    /// connection failed, `Pending` when nothing is there (waker registered).
    fn poll_read(&mut self, cx: &mut Context<'_>) -> Poll<bool> {
        if self.in_start == self.in_end {
            self.in_start = 0;
            self.in_end = 0;
        } else if self.in_end == self.inbuf.len() {
            self.inbuf.copy_within(self.in_start..self.in_end, 0);
            self.in_end -= self.in_start;
            self.in_start = 0;
        }
        let mut rb = ReadBuf::new(&mut self.inbuf[self.in_end..]);
        match Pin::new(&mut self.socket).poll_read(cx, &mut rb) {
            Poll::Pending => Poll::Pending,
            Poll::Ready(Err(e)) => {
                self.fail(format!("reading from RabbitMQ failed: {e}"));
                Poll::Ready(false)
            }
            Poll::Ready(Ok(())) => {
                let n = rb.filled().len();
                if n == 0 {
                    let unsettled = self.confirms.unsettled();
                    self.fail(format!(
                        "RabbitMQ closed the socket with {unsettled} publishes unconfirmed"
                    ));
                    return Poll::Ready(false);
                }
                self.in_end += n;
                self.last_read = Instant::now();
                self.handle_frames();
                Poll::Ready(matches!(self.state, State::Open))
            }
        }
    }

    /// The heartbeat timer: sends a heartbeat when nothing was written for half the
    /// interval, fails the connection when nothing was read for twice the interval
    /// (section 4.2.7). True when a heartbeat was queued.
    fn poll_timer(&mut self, cx: &mut Context<'_>) -> bool {
        let Some(interval) = self.heartbeat else {
            return false;
        };
        let now = Instant::now();
        let dead_at = self.last_read + interval * 2;
        if now >= dead_at {
            self.fail(format!(
                "no frame and no heartbeat from RabbitMQ for {} s (heartbeat {} s): the broker or the network is gone",
                (now - self.last_read).as_secs(),
                interval.as_secs()
            ));
            return false;
        }
        let send_at = self.last_write + interval / 2;
        if now >= send_at && self.written == self.out.len() {
            if wire::encode(&mut self.out, &AMQPFrame::Heartbeat).is_ok() {
                self.last_write = now;
            }
            return true;
        }
        let next = if self.written == self.out.len() {
            send_at.min(dead_at)
        } else {
            dead_at
        };
        self.timer.as_mut().reset(next);
        if self.timer.as_mut().poll(cx).is_ready() {
            // Due already (a clock step): look again now.
            cx.waker().wake_by_ref();
        }
        false
    }

    fn handle_frames(&mut self) {
        while matches!(self.state, State::Open) {
            let buf = &self.inbuf[self.in_start..self.in_end];
            let len = match wire::frame_len(buf, self.frame_max) {
                Ok(Some(len)) => len,
                Ok(None) => break,
                Err(e) => {
                    self.fail(e.to_string());
                    break;
                }
            };
            let frame = wire::decode(&buf[..len]);
            self.in_start += len;
            match frame {
                Ok(frame) => self.handle_frame(frame),
                Err(e) => self.fail(e.to_string()),
            }
        }
        // A frame larger than what is left of the buffer: make room for it.
        if self.in_start > 0 && self.in_end == self.inbuf.len() {
            self.inbuf.copy_within(self.in_start..self.in_end, 0);
            self.in_end -= self.in_start;
            self.in_start = 0;
        }
    }

    fn handle_frame(&mut self, frame: AMQPFrame) {
        match frame {
            AMQPFrame::Heartbeat => {}
            // Producer-named exchanges are declared on their own channel (exchanges.rs):
            // its replies, a refusal's channel.close included, concern nothing else.
            AMQPFrame::Method(DECLARE_CHANNEL, method) => {
                let mut released = std::mem::take(&mut self.released);
                let r = self
                    .exchanges
                    .on_method(method, &mut self.out, &mut released);
                self.release(&mut released);
                self.released = released;
                if let Err(e) = r {
                    self.fail(e);
                }
            }
            AMQPFrame::Method(_, AMQPClass::Basic(basic::AMQPMethod::Ack(ack))) => {
                let r = self
                    .confirms
                    .ack(ack.delivery_tag, ack.multiple, &mut self.ready);
                if let Err(v) = r {
                    self.violate(v);
                }
            }
            AMQPFrame::Method(_, AMQPClass::Basic(basic::AMQPMethod::Nack(nack))) => {
                let r = self
                    .confirms
                    .nack(nack.delivery_tag, nack.multiple, &mut self.ready);
                if let Err(v) = r {
                    self.violate(v);
                }
            }
            AMQPFrame::Method(_, AMQPClass::Basic(basic::AMQPMethod::Return(ret))) => {
                self.returning = Some(Returning {
                    reply_code: ret.reply_code,
                    reply_text: ret.reply_text.as_str().to_owned(),
                    body_left: None,
                });
            }
            AMQPFrame::Header(_, header) => {
                let Some(returning) = self.returning.as_mut() else {
                    self.fail(
                        "RabbitMQ sent a content header that belongs to no basic.return".into(),
                    );
                    return;
                };
                let key = returned_key(&header.properties);
                let key = ReturnedKey {
                    lsn: key.0,
                    message_id: key.1.as_deref(),
                };
                let (code, text) = (returning.reply_code, returning.reply_text.clone());
                if header.body_size == 0 {
                    self.returning = None;
                } else {
                    returning.body_left = Some(header.body_size);
                }
                match self.confirms.returned(key, code, &text) {
                    Ok(marked) => {
                        tracing::debug!(reply_code = code, reply_text = %text, marked, "basic.return recorded");
                    }
                    Err(v) => self.violate(v),
                }
            }
            AMQPFrame::Body(_, part) => match self.returning.as_mut() {
                Some(Returning {
                    body_left: Some(left),
                    ..
                }) => {
                    *left = left.saturating_sub(part.len() as u64);
                    if *left == 0 {
                        self.returning = None;
                    }
                }
                _ => {
                    self.fail("RabbitMQ sent a content body that belongs to no basic.return".into())
                }
            },
            AMQPFrame::Method(_, AMQPClass::Channel(channel::AMQPMethod::Close(close))) => {
                let ok = AMQPFrame::Method(
                    CHANNEL,
                    AMQPClass::Channel(channel::AMQPMethod::CloseOk(channel::CloseOk {})),
                );
                let _ = wire::encode(&mut self.out, &ok);
                self.fail(format!(
                    "the broker closed the channel with {} {}",
                    close.reply_code,
                    close.reply_text.as_str()
                ));
            }
            AMQPFrame::Method(_, AMQPClass::Connection(conn::AMQPMethod::Close(close))) => {
                let ok = AMQPFrame::Method(
                    0,
                    AMQPClass::Connection(conn::AMQPMethod::CloseOk(conn::CloseOk {})),
                );
                let _ = wire::encode(&mut self.out, &ok);
                self.fail(format!(
                    "the broker closed the connection with {} {}",
                    close.reply_code,
                    close.reply_text.as_str()
                ));
            }
            AMQPFrame::Method(_, AMQPClass::Connection(conn::AMQPMethod::Blocked(b))) => {
                if !self.blocked {
                    tracing::warn!(reason = %b.reason.as_str(), "RabbitMQ blocked the connection (connection.blocked: memory or disk alarm); publishes wait until it clears, nothing unconfirmed is acknowledged");
                }
                self.blocked = true;
                self.signals.blocked.store(true, Ordering::Relaxed);
            }
            AMQPFrame::Method(_, AMQPClass::Connection(conn::AMQPMethod::Unblocked(_))) => {
                if self.blocked {
                    tracing::info!("RabbitMQ unblocked the connection (connection.unblocked); publishing resumes");
                }
                self.blocked = false;
                self.signals.blocked.store(false, Ordering::Relaxed);
            }
            other => {
                tracing::debug!(frame = %other, "ignoring a frame the publisher does not use");
            }
        }
    }

    /// The connection or channel failed: report every unsettled publish as failed.
    fn fail(&mut self, reason: String) {
        if !matches!(self.state, State::Open) {
            return;
        }
        self.confirms.fail_all(&reason, &mut self.ready);
        self.exchanges.fail_all(&reason, &mut self.ready);
        self.signals.lost.store(true, Ordering::Relaxed);
        self.state = State::Failed(reason);
    }

    /// The broker broke the settling rule: settle nothing more, hand out nothing more.
    fn violate(&mut self, violation: Violation) {
        if !matches!(self.state, State::Open) {
            return;
        }
        tracing::error!(error = %violation, unsettled = self.confirms.unsettled(), "RabbitMQ broke the publisher-confirm protocol; acknowledging nothing more on this connection");
        self.ready.clear();
        self.signals.lost.store(true, Ordering::Relaxed);
        self.state = State::Violated(violation.to_string());
    }
}

/// The keys a returned message carries: our LSN header, parsed, and its message id.
fn returned_key(properties: &BasicProperties) -> (Option<Lsn>, Option<String>) {
    let lsn = properties
        .headers()
        .as_ref()
        .and_then(|h| h.inner().get(MATCH_KEY_HEADER))
        .and_then(|v| match v {
            AMQPValue::LongString(s) => std::str::from_utf8(s.as_bytes()).ok().map(str::to_owned),
            AMQPValue::ShortString(s) => Some(s.as_str().to_owned()),
            _ => None,
        })
        .and_then(|s| Lsn::from_str(&s).ok());
    let message_id = properties
        .message_id()
        .as_ref()
        .map(|s| s.as_str().to_owned());
    (lsn, message_id)
}

/// Percent-decodes a URL path segment (`%2f` → `/`); invalid escapes stay as they are.
fn percent_decode(path: &str) -> String {
    let bytes = path.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let hex = bytes
            .get(i + 1..i + 3)
            .and_then(|h| std::str::from_utf8(h).ok())
            .and_then(|h| u8::from_str_radix(h, 16).ok());
        match (bytes[i], hex) {
            (b'%', Some(b)) => {
                out.push(b);
                i += 3;
            }
            (b, _) => {
                out.push(b);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_refused_vhost_names_the_percent_decoded_vhost() {
        let e = Error::refused_or_closed(
            "amqp://u:***@h:5672/orders%2Feu",
            530,
            "NOT_ALLOWED - vhost orders/eu not found",
        );
        let text = e.to_string();
        assert!(text.contains("\"orders/eu\""), "{text}");
        assert!(text.contains("rabbitmqctl add_vhost orders/eu"), "{text}");
        let e = Error::refused_or_closed("amqp://u:***@h:5672/%2f", 530, "NOT_ALLOWED");
        assert!(e.to_string().contains("\"/\""));
        let e = Error::refused_or_closed("amqp://u:***@h:5672", 530, "NOT_ALLOWED");
        assert!(e.to_string().contains("\"/\""));
        assert!(matches!(
            Error::refused_or_closed("amqp://h", 403, "ACCESS_REFUSED"),
            Error::Refused {
                reply_code: 403,
                ..
            }
        ));
        assert!(matches!(
            Error::refused_or_closed("amqp://h", 320, "CONNECTION_FORCED"),
            Error::Connect { .. }
        ));
        assert_eq!(percent_decode("a+b%"), "a+b%");
    }
}
