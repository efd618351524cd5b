//! The connect step: the socket ([`super::socket::connect`]: TCP, and TLS for `amqps://`),
//! the AMQP 0-9-1 handshake, one channel in confirm mode, and the exchange declaration.
//! Kept apart from the streaming session ([`super::Publisher`]) so
//! that trying several brokers in turn (failover) is a loop around this step.
//!
//! Source: AMQP 0-9-1 specification, section 2.2.4 "Connection" (protocol header,
//! `connection.start`/`start-ok`, `tune`/`tune-ok`, `open`/`open-ok`), 4.2.1 (frame sizes),
//! 4.2.7 "Heartbeat Frames"; `channel.open`; RabbitMQ's `confirm.select` extension and its
//! client capabilities (`authentication_failure_close`, `connection.blocked`).

use std::time::Duration;

use amq_protocol::frame::{AMQPFrame, ProtocolVersion};
use amq_protocol::protocol::{channel, confirm, connection, exchange, AMQPClass};
use amq_protocol::types::{AMQPValue, FieldTable, LongString, ShortString};
use amq_protocol::uri::AMQPUri;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use super::socket::{self, Endpoint, Socket};
use super::wire::{self, FRAME_MIN_SIZE};
use super::Error;

/// The one channel we publish on.
pub const CHANNEL: u16 = 1;
/// The `frame_max` we ask for when the URL names none (RabbitMQ's default is the same).
pub const DEFAULT_FRAME_MAX: u32 = 131_072;
/// AMQP heartbeat (seconds) asked for when the URL names none: a dead broker or a
/// black-holed connection is noticed within about twice this.
pub const DEFAULT_HEARTBEAT_S: u16 = 10;

/// What the handshake agreed on (section 2.2.4, `connection.tune`/`tune-ok`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Tuned {
    /// The largest frame either side may send, bytes (frame header and end included).
    pub frame_max: u32,
    /// Heartbeat interval; `None` when both sides disabled heartbeats.
    pub heartbeat: Option<Duration>,
    /// The highest channel number either side may use (0: no limit). We ask for 2: the
    /// publishing channel and the one producer-named exchanges are declared on.
    pub channel_max: u16,
}

/// How [`open`] declares the exchange.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Declare {
    /// Declare it as a durable topic exchange (created when absent): what `run` does.
    DurableTopic,
    /// Only check that it exists (`passive`): a missing exchange is [`Error::Declare`]
    /// with reply code 404, and nothing is created.
    Passive,
}

/// A connection ready to publish: channel 1 open in confirm mode, exchange declared.
#[derive(Debug)]
pub struct Opened {
    /// The socket.
    pub socket: Socket,
    /// Bytes read past the last handshake frame (normally none).
    pub leftover: Vec<u8>,
    /// The negotiated limits.
    pub tuned: Tuned,
}

/// Settles a negotiated value the way RabbitMQ's clients do: 0 means "no limit" on either
/// side, otherwise the smaller wins.
fn negotiate(client: u32, server: u32) -> u32 {
    match (client, server) {
        (0, s) => s,
        (c, 0) => c,
        (c, s) => c.min(s),
    }
}

/// Connects to `endpoint` (TCP, and TLS for `amqps://`), logs in with PLAIN, opens
/// channel [`CHANNEL`], enables publisher confirms and declares `exchange` as `declare`
/// says.
///
/// # Errors
/// [`Error::TlsSetup`] for an unusable TLS file and [`Error::Tls`] for a failed TLS
/// handshake ([`socket::connect`]); [`Error::Refused`] for 403 `ACCESS_REFUSED` and 530
/// `NOT_ALLOWED`; [`Error::Declare`] when the broker refuses the exchange declaration (404
/// for a missing exchange under [`Declare::Passive`]); [`Error::Connect`] for everything
/// else (TCP, a broker that does not speak AMQP 0-9-1, a TLS listener reached with
/// `amqp://`, a close during the handshake).
pub async fn open(
    endpoint: &Endpoint,
    exchange_name: &str,
    declare: Declare,
    connection_name: &str,
) -> Result<Opened, Error> {
    let mut socket = socket::connect(endpoint).await?;
    let mut hs = Handshake {
        socket: &mut socket,
        buf: Vec::with_capacity(4096),
        frame_max: FRAME_MIN_SIZE,
        url: endpoint.redacted_url.as_str(),
        address: endpoint.address(),
        tls: endpoint.tls.is_some(),
    };
    let mut out = Vec::with_capacity(512);
    wire::encode(
        &mut out,
        &AMQPFrame::ProtocolHeader(ProtocolVersion::amqp_0_9_1()),
    )
    .map_err(|e| hs.err(e))?;
    hs.write(&out).await?;
    hs.log_in(&endpoint.uri, connection_name).await?;
    let tuned = hs.tune(&endpoint.uri).await?;
    hs.open_vhost(&endpoint.uri.vhost).await?;
    hs.open_confirm_channel().await?;
    hs.declare_exchange(exchange_name, declare).await?;
    let leftover = std::mem::take(&mut hs.buf);
    Ok(Opened {
        socket,
        leftover,
        tuned,
    })
}

impl Handshake<'_> {
    /// `connection.start` → `start-ok` with PLAIN and the URL's credentials; returns the
    /// server properties of `connection.start`.
    async fn log_in(&mut self, uri: &AMQPUri, connection_name: &str) -> Result<FieldTable, Error> {
        let start = match self.method().await? {
            (0, AMQPClass::Connection(connection::AMQPMethod::Start(start))) => start,
            (_, other) => return Err(self.unexpected("connection.start", &other)),
        };
        let mechanisms = String::from_utf8_lossy(start.mechanisms.as_bytes()).into_owned();
        if !mechanisms.split_whitespace().any(|m| m == "PLAIN") {
            return Err(self.err(format!(
                "the broker offers the SASL mechanisms {mechanisms:?}, not PLAIN; enable PLAIN (RabbitMQ: auth_mechanisms.1 = PLAIN)"
            )));
        }
        let user = &uri.authority.userinfo;
        let mut response = Vec::with_capacity(2 + user.username.len() + 16);
        response.push(0);
        response.extend_from_slice(user.username.as_bytes());
        response.push(0);
        response.extend_from_slice(user.password.as_bytes());
        let start_ok = connection::StartOk {
            client_properties: client_properties(connection_name),
            mechanism: ShortString::from("PLAIN"),
            response: LongString::from(response),
            locale: ShortString::from("en_US"),
        };
        self.send(
            0,
            AMQPClass::Connection(connection::AMQPMethod::StartOk(start_ok)),
        )
        .await?;
        Ok(start.server_properties)
    }

    /// `connection.tune` → `tune-ok`: `frame_max` and the heartbeat as the URL asks (or
    /// our defaults), negotiated with the broker's; two channels.
    async fn tune(&mut self, uri: &AMQPUri) -> Result<Tuned, Error> {
        let tune = match self.method().await? {
            (0, AMQPClass::Connection(connection::AMQPMethod::Tune(tune))) => tune,
            (_, other) => return Err(self.unexpected("connection.tune", &other)),
        };
        let frame_max = negotiate(
            uri.query.frame_max.unwrap_or(DEFAULT_FRAME_MAX),
            tune.frame_max,
        )
        .max(FRAME_MIN_SIZE);
        let heartbeat = negotiate(
            u32::from(uri.query.heartbeat.unwrap_or(DEFAULT_HEARTBEAT_S)),
            u32::from(tune.heartbeat),
        ) as u16;
        // Channel 1 publishes; channel 2 declares exchanges named by producers
        // (super::exchanges), opened only when one is first used.
        let channel_max = negotiate(2, u32::from(tune.channel_max)) as u16;
        self.send(
            0,
            AMQPClass::Connection(connection::AMQPMethod::TuneOk(connection::TuneOk {
                channel_max,
                frame_max,
                heartbeat,
            })),
        )
        .await?;
        self.frame_max = frame_max;
        Ok(Tuned {
            frame_max,
            heartbeat: (heartbeat > 0).then(|| Duration::from_secs(u64::from(heartbeat))),
            channel_max,
        })
    }

    /// `connection.open` of `vhost` → `open-ok`.
    async fn open_vhost(&mut self, vhost: &str) -> Result<(), Error> {
        let virtual_host = ShortString::try_new(vhost.to_owned())
            .map_err(|_| self.err("the vhost is longer than 255 bytes".into()))?;
        self.send(
            0,
            AMQPClass::Connection(connection::AMQPMethod::Open(connection::Open {
                virtual_host,
            })),
        )
        .await?;
        match self.method().await? {
            (0, AMQPClass::Connection(connection::AMQPMethod::OpenOk(_))) => Ok(()),
            (_, other) => Err(self.unexpected("connection.open-ok", &other)),
        }
    }

    /// `channel.open` of [`CHANNEL`], then `confirm.select` on it.
    async fn open_confirm_channel(&mut self) -> Result<(), Error> {
        self.send(
            CHANNEL,
            AMQPClass::Channel(channel::AMQPMethod::Open(channel::Open {})),
        )
        .await?;
        match self.method().await? {
            (CHANNEL, AMQPClass::Channel(channel::AMQPMethod::OpenOk(_))) => {}
            (_, other) => return Err(self.unexpected("channel.open-ok", &other)),
        }
        self.send(
            CHANNEL,
            AMQPClass::Confirm(confirm::AMQPMethod::Select(confirm::Select {
                nowait: false,
            })),
        )
        .await?;
        match self.method().await? {
            (CHANNEL, AMQPClass::Confirm(confirm::AMQPMethod::SelectOk(_))) => Ok(()),
            (_, other) => Err(self.unexpected("confirm.select-ok", &other)),
        }
    }

    /// `exchange.declare` of `exchange_name` (durable topic, or passive), answered by
    /// `declare-ok`, or by a `channel.close` that becomes [`Error::Declare`].
    async fn declare_exchange(
        &mut self,
        exchange_name: &str,
        declare: Declare,
    ) -> Result<(), Error> {
        let exchange = ShortString::try_new(exchange_name.to_owned())
            .map_err(|_| self.err("the exchange name is longer than 255 bytes".into()))?;
        self.send(
            CHANNEL,
            AMQPClass::Exchange(exchange::AMQPMethod::Declare(exchange::Declare {
                exchange,
                kind: ShortString::from("topic"),
                passive: declare == Declare::Passive,
                durable: true,
                auto_delete: false,
                internal: false,
                nowait: false,
                arguments: FieldTable::default(),
            })),
        )
        .await?;
        match self.method().await? {
            (CHANNEL, AMQPClass::Exchange(exchange::AMQPMethod::DeclareOk(_))) => Ok(()),
            (_, AMQPClass::Channel(channel::AMQPMethod::Close(close))) => {
                let ok = AMQPClass::Channel(channel::AMQPMethod::CloseOk(channel::CloseOk {}));
                let _ = self.send(CHANNEL, ok).await;
                Err(Error::Declare {
                    exchange: exchange_name.to_owned(),
                    reply_code: close.reply_code,
                    reply_text: close.reply_text.as_str().to_owned(),
                })
            }
            (_, other) => Err(self.unexpected("exchange.declare-ok", &other)),
        }
    }
}

/// `connection.start-ok` client properties: who we are, and the RabbitMQ capabilities we
/// handle (`connection.blocked`, `authentication_failure_close` so a refused login is a
/// `connection.close` 403 rather than a dropped socket, `publisher_confirms`,
/// `basic.nack`).
fn client_properties(connection_name: &str) -> FieldTable {
    let mut capabilities = FieldTable::default();
    for cap in [
        "publisher_confirms",
        "basic.nack",
        "connection.blocked",
        "authentication_failure_close",
    ] {
        capabilities.insert(ShortString::from(cap), AMQPValue::Boolean(true));
    }
    let mut props = FieldTable::default();
    let text = |s: &str| AMQPValue::LongString(LongString::from(s));
    props.insert("product".into(), text("pgoutbox"));
    props.insert("version".into(), text(env!("CARGO_PKG_VERSION")));
    props.insert("platform".into(), text("Rust"));
    props.insert("connection_name".into(), text(connection_name));
    props.insert("capabilities".into(), AMQPValue::FieldTable(capabilities));
    props
}

impl Opened {
    /// Closes the connection (`connection.close` 200, then waits for `close-ok`, see
    /// [`read_until_close_ok`]). Best effort; the caller bounds how long it may take.
    pub async fn close(mut self) {
        let close = AMQPFrame::Method(
            0,
            AMQPClass::Connection(connection::AMQPMethod::Close(connection::Close {
                reply_code: 200,
                reply_text: ShortString::from("pgoutbox done"),
                class_id: 0,
                method_id: 0,
            })),
        );
        let mut out = Vec::with_capacity(64);
        if wire::encode(&mut out, &close).is_err()
            || self.socket.write_all(&out).await.is_err()
            || self.socket.flush().await.is_err()
        {
            return;
        }
        read_until_close_ok(&mut self.socket, self.leftover, self.tuned.frame_max).await;
    }
}

/// Reads frames from `socket` (after the bytes already read, `buffered`) until the broker's
/// `connection.close-ok` on channel 0, the end of the stream, a read error or bytes that are
/// not a frame; everything else is skipped.
///
/// The peer that sent `connection.close` closes the socket once it has the `close-ok`
/// (AMQP 0-9-1, section 4.2.3 and `connection.close-ok`): RabbitMQ leaves it open for the
/// client, so waiting for its end of stream instead cost every caller its whole bound
/// (`pgoutbox check` 10 s, `run`'s shutdown 2 s). `frame_max` is the negotiated maximum frame
/// size in bytes.
pub(super) async fn read_until_close_ok(socket: &mut Socket, buffered: Vec<u8>, frame_max: u32) {
    let mut buf = buffered;
    let mut filled = buf.len();
    buf.resize(filled.max(4096), 0);
    loop {
        match wire::frame_len(&buf[..filled], frame_max) {
            Ok(Some(len)) => {
                let frame = wire::decode(&buf[..len]);
                buf.copy_within(len..filled, 0);
                filled -= len;
                if matches!(
                    frame,
                    Ok(AMQPFrame::Method(
                        0,
                        AMQPClass::Connection(connection::AMQPMethod::CloseOk(_))
                    ))
                ) {
                    return;
                }
                continue;
            }
            Ok(None) => {}
            Err(_) => return,
        }
        if filled == buf.len() {
            buf.resize(buf.len() * 2, 0);
        }
        match socket.read(&mut buf[filled..]).await {
            Ok(0) | Err(_) => return,
            Ok(n) => filled += n,
        }
    }
}

/// A connection for a few administrative methods, one at a time (`declare-topology`): the
/// handshake of [`open`] without the publishing channel, then [`Session::call`] sends one
/// method and returns the broker's answer on its channel.
///
/// A refused method closes its channel (AMQP 0-9-1 section 1.4.2.5, RabbitMQ's channel-level
/// exceptions): the session answers `channel.close-ok` and opens the channel again for the
/// next call. A connection-level exception (RabbitMQ's 503 `COMMAND_INVALID` for an unknown
/// exchange type, 541 `INTERNAL_ERROR`, 320 `CONNECTION_FORCED`) ends the session: every later
/// call answers the same [`Answer::ConnectionClosed`].
#[derive(Debug)]
pub struct Session {
    socket: Socket,
    buf: Vec<u8>,
    frame_max: u32,
    url: String,
    address: String,
    tls: bool,
    /// The server properties of `connection.start` (`product`, `version`, `cluster_name`).
    server_properties: FieldTable,
    /// Whether [`CHANNEL`] is open.
    channel_open: bool,
    /// The connection-level close that ended the session.
    closed: Option<(u16, String)>,
}

/// The broker's answer to [`Session::call`].
#[derive(Debug, Clone, PartialEq)]
pub enum Answer {
    /// The method's reply (`exchange.declare-ok`, `queue.declare-ok`, `queue.bind-ok`, ...).
    Ok(AMQPClass),
    /// The broker refused the method and closed its channel (`channel.close`): 404
    /// `NOT_FOUND` for a passive declare of a missing object, 406 `PRECONDITION_FAILED` for
    /// an object declared before with other properties, 403 `ACCESS_REFUSED`.
    ChannelClosed {
        /// The reply code.
        reply_code: u16,
        /// The reply text, e.g. `PRECONDITION_FAILED - inequivalent arg 'x-queue-type' ...`.
        reply_text: String,
    },
    /// The broker closed the whole connection (`connection.close`): 503 `COMMAND_INVALID`
    /// for an exchange type no enabled plugin provides, among others.
    ConnectionClosed {
        /// The reply code.
        reply_code: u16,
        /// The reply text.
        reply_text: String,
    },
}

/// Connects to `endpoint` (TCP, and TLS for `amqps://`), logs in with PLAIN and opens the
/// vhost, for [`Session::call`].
///
/// # Errors
/// As [`open`], without [`Error::Declare`].
pub async fn open_session(endpoint: &Endpoint, connection_name: &str) -> Result<Session, Error> {
    let mut socket = socket::connect(endpoint).await?;
    let mut hs = Handshake {
        socket: &mut socket,
        buf: Vec::with_capacity(4096),
        frame_max: FRAME_MIN_SIZE,
        url: endpoint.redacted_url.as_str(),
        address: endpoint.address(),
        tls: endpoint.tls.is_some(),
    };
    let mut out = Vec::with_capacity(64);
    wire::encode(
        &mut out,
        &AMQPFrame::ProtocolHeader(ProtocolVersion::amqp_0_9_1()),
    )
    .map_err(|e| hs.err(e))?;
    hs.write(&out).await?;
    let server_properties = hs.log_in(&endpoint.uri, connection_name).await?;
    let tuned = hs.tune(&endpoint.uri).await?;
    hs.open_vhost(&endpoint.uri.vhost).await?;
    let buf = std::mem::take(&mut hs.buf);
    Ok(Session {
        socket,
        buf,
        frame_max: tuned.frame_max,
        url: endpoint.redacted_url.clone(),
        address: endpoint.address(),
        tls: endpoint.tls.is_some(),
        server_properties,
        channel_open: false,
        closed: None,
    })
}

impl Session {
    /// The server properties the broker sent in `connection.start` (section 2.2.4):
    /// RabbitMQ's are `product`, `version`, `platform`, `cluster_name`, `capabilities`.
    pub fn server_properties(&self) -> &FieldTable {
        &self.server_properties
    }

    /// Sends `method` on [`CHANNEL`] (opening it first when needed) and waits for the
    /// broker's answer on that channel; heartbeats and other channels' frames are skipped.
    /// Methods with `nowait` set must not be sent: their answer never comes.
    ///
    /// # Errors
    /// [`Error::Connect`] when the socket fails or the broker sends something that is not
    /// AMQP; a refusal is an [`Answer`], not an error.
    pub async fn call(&mut self, method: AMQPClass) -> Result<Answer, Error> {
        if let Some((reply_code, reply_text)) = &self.closed {
            return Ok(Answer::ConnectionClosed {
                reply_code: *reply_code,
                reply_text: reply_text.clone(),
            });
        }
        if !self.channel_open {
            let open = AMQPClass::Channel(channel::AMQPMethod::Open(channel::Open {}));
            match self.round_trip(open).await? {
                Answer::Ok(AMQPClass::Channel(channel::AMQPMethod::OpenOk(_))) => {
                    self.channel_open = true;
                }
                Answer::Ok(other) => {
                    return Err(self.handshake().unexpected("channel.open-ok", &other))
                }
                refused => return Ok(refused),
            }
        }
        self.round_trip(method).await
    }

    async fn round_trip(&mut self, method: AMQPClass) -> Result<Answer, Error> {
        let mut hs = Handshake {
            buf: std::mem::take(&mut self.buf),
            socket: &mut self.socket,
            frame_max: self.frame_max,
            url: self.url.as_str(),
            address: self.address.clone(),
            tls: self.tls,
        };
        let result = async {
            hs.send(CHANNEL, method).await?;
            loop {
                match hs.frame().await? {
                    AMQPFrame::Method(
                        0,
                        AMQPClass::Connection(connection::AMQPMethod::Close(c)),
                    ) => {
                        let ok = AMQPClass::Connection(connection::AMQPMethod::CloseOk(
                            connection::CloseOk {},
                        ));
                        let _ = hs.send(0, ok).await;
                        return Ok(Answer::ConnectionClosed {
                            reply_code: c.reply_code,
                            reply_text: c.reply_text.as_str().to_owned(),
                        });
                    }
                    AMQPFrame::Method(
                        CHANNEL,
                        AMQPClass::Channel(channel::AMQPMethod::Close(c)),
                    ) => {
                        let ok =
                            AMQPClass::Channel(channel::AMQPMethod::CloseOk(channel::CloseOk {}));
                        hs.send(CHANNEL, ok).await?;
                        return Ok(Answer::ChannelClosed {
                            reply_code: c.reply_code,
                            reply_text: c.reply_text.as_str().to_owned(),
                        });
                    }
                    AMQPFrame::Method(CHANNEL, reply) => return Ok(Answer::Ok(reply)),
                    _ => continue,
                }
            }
        }
        .await;
        self.buf = std::mem::take(&mut hs.buf);
        match &result {
            Ok(Answer::ChannelClosed { .. }) => self.channel_open = false,
            Ok(Answer::ConnectionClosed {
                reply_code,
                reply_text,
            }) => {
                self.channel_open = false;
                self.closed = Some((*reply_code, reply_text.clone()));
            }
            _ => {}
        }
        result
    }

    /// A [`Handshake`] over this session's socket, for its messages (an empty buffer).
    fn handshake(&mut self) -> Handshake<'_> {
        Handshake {
            buf: Vec::new(),
            socket: &mut self.socket,
            frame_max: self.frame_max,
            url: self.url.as_str(),
            address: self.address.clone(),
            tls: self.tls,
        }
    }

    /// Closes the connection (`connection.close` 200, then `close-ok`, see
    /// [`read_until_close_ok`]), unless the broker already closed it. Best effort; the caller
    /// bounds how long it may take.
    pub async fn close(mut self) {
        if self.closed.is_some() {
            return;
        }
        let close = AMQPFrame::Method(
            0,
            AMQPClass::Connection(connection::AMQPMethod::Close(connection::Close {
                reply_code: 200,
                reply_text: ShortString::from("pgoutbox done"),
                class_id: 0,
                method_id: 0,
            })),
        );
        let mut out = Vec::with_capacity(64);
        if wire::encode(&mut out, &close).is_err()
            || self.socket.write_all(&out).await.is_err()
            || self.socket.flush().await.is_err()
        {
            return;
        }
        read_until_close_ok(&mut self.socket, self.buf, self.frame_max).await;
    }
}

/// The first bytes of a TLS record (content type handshake 22 or alert 21, then major
/// version 3): what a TLS listener answers to the AMQP protocol header.
fn looks_like_tls(buf: &[u8]) -> bool {
    matches!(buf, [0x15 | 0x16, 0x03, ..])
}

/// The handshake's reads and writes: one frame at a time, with a buffer.
struct Handshake<'a> {
    socket: &'a mut Socket,
    buf: Vec<u8>,
    frame_max: u32,
    url: &'a str,
    /// `host:port`, for messages.
    address: String,
    /// Whether the socket is TLS (`amqps://`).
    tls: bool,
}

impl Handshake<'_> {
    fn err(&self, context: String) -> Error {
        Error::Connect {
            url: self.url.to_owned(),
            context,
        }
    }

    fn unexpected(&self, wanted: &str, got: &AMQPClass) -> Error {
        match got {
            AMQPClass::Channel(channel::AMQPMethod::Close(c)) => self.err(format!(
                "the broker closed the channel with {} {} (waiting for {wanted})",
                c.reply_code,
                c.reply_text.as_str()
            )),
            other => self.err(format!("expected {wanted} from the broker, got {other:?}")),
        }
    }

    async fn write(&mut self, bytes: &[u8]) -> Result<(), Error> {
        let written = match self.socket.write_all(bytes).await {
            Ok(()) => self.socket.flush().await,
            Err(e) => Err(e),
        };
        written.map_err(|e| self.err(format!("writing the AMQP handshake failed: {e}")))
    }

    async fn send(&mut self, channel: u16, method: AMQPClass) -> Result<(), Error> {
        let mut out = Vec::with_capacity(256);
        wire::encode(&mut out, &AMQPFrame::Method(channel, method)).map_err(|e| self.err(e))?;
        self.write(&out).await
    }

    /// The next method frame (heartbeats skipped). A `connection.close` becomes
    /// [`Error::Refused`] (403, 530) or [`Error::Connect`] naming the reply.
    async fn method(&mut self) -> Result<(u16, AMQPClass), Error> {
        loop {
            let frame = self.frame().await?;
            match frame {
                AMQPFrame::Heartbeat => continue,
                AMQPFrame::Method(_, AMQPClass::Connection(connection::AMQPMethod::Close(c))) => {
                    // The spec asks for close-ok; best effort, the error is what matters.
                    let ok = AMQPClass::Connection(connection::AMQPMethod::CloseOk(
                        connection::CloseOk {},
                    ));
                    let _ = self.send(0, ok).await;
                    return Err(Error::refused_or_closed(
                        self.url,
                        c.reply_code,
                        c.reply_text.as_str(),
                    ))
                }
                AMQPFrame::Method(channel, method) => return Ok((channel, method)),
                other => {
                    return Err(self.err(format!(
                        "the broker sent {other} during the handshake; is this an AMQP 0-9-1 server (RabbitMQ)?"
                    )))
                }
            }
        }
    }

    async fn frame(&mut self) -> Result<AMQPFrame, Error> {
        loop {
            // A TLS listener answers the protocol header with a TLS record (an alert).
            if !self.tls && looks_like_tls(&self.buf) {
                return Err(self.err(format!(
                    "the server at {} answered in TLS: it is a TLS listener; use amqps:// for it (with cacertfile= if its CA is not in the system trust store), or the plain AMQP port (5672 by default)",
                    self.address
                )));
            }
            // A server answering the protocol header with its own (a version mismatch) is
            // 8 bytes starting "AMQP".
            if self.buf.starts_with(b"AMQP") && self.buf.len() >= 8 {
                return Err(self.err(format!(
                    "the broker does not speak AMQP 0-9-1 (it answered with protocol header {:?})",
                    &self.buf[..8]
                )));
            }
            match wire::frame_len(&self.buf, self.frame_max.max(DEFAULT_FRAME_MAX)) {
                Ok(Some(n)) => {
                    let frame =
                        wire::decode(&self.buf[..n]).map_err(|e| self.err(e.to_string()))?;
                    self.buf.drain(..n);
                    return Ok(frame);
                }
                Ok(None) => {}
                Err(e) => {
                    return Err(self.err(format!(
                        "{e}; is this an AMQP 0-9-1 server (RabbitMQ) at the URL's host and port?"
                    )))
                }
            }
            let mut chunk = [0u8; 4096];
            let n = self
                .socket
                .read(&mut chunk)
                .await
                .map_err(|e| self.err(format!("reading the AMQP handshake failed: {e}")))?;
            if n == 0 {
                return Err(self.err(if self.tls {
                    "the broker closed the connection during the AMQP handshake (a wrong port, or a refused login on a broker without authentication_failure_close)".into()
                } else {
                    format!("the broker closed the connection during the AMQP handshake (a wrong port, a TLS listener: use amqps:// for {}, or a refused login on a broker without authentication_failure_close)", self.address)
                }));
            }
            self.buf.extend_from_slice(&chunk[..n]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn zero_means_no_limit_and_otherwise_the_smaller_wins() {
        assert_eq!(negotiate(0, 60), 60);
        assert_eq!(negotiate(10, 0), 10);
        assert_eq!(negotiate(10, 60), 10);
        assert_eq!(negotiate(131_072, 4096), 4096);
        assert_eq!(negotiate(0, 0), 0);
    }
}
