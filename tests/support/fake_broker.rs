//! A scripted AMQP 0-9-1 broker for exact frame orderings (issue 12, "Tests").
//!
//! RabbitMQ never sends some orderings the publisher must still get right (a return, an ack
//! of a later tag alone, then the returned tag's ack), and a real broker cannot be told to
//! close a socket between a return and its ack. This fake plays the *server* side of one
//! connection, on `amq-protocol` (lapin's codec), over a tokio listener on `127.0.0.1:0`:
//!
//! ```text
//!  client                          fake
//!  "AMQP\0\0\x09\x01"        ──▶
//!                            ◀──   connection.start (mechanisms "PLAIN")
//!  connection.start-ok       ──▶   (Script::RefuseLogin: connection.close 403)
//!                            ◀──   connection.tune (channel_max, frame_max, heartbeat)
//!  connection.tune-ok, open  ──▶   (Script::RefuseVhost: connection.close 530)
//!                            ◀──   connection.open-ok
//!  channel.open              ──▶   channel.open-ok
//!  confirm.select            ──▶   confirm.select-ok        (delivery tags start at 1)
//!  exchange.declare          ──▶   exchange.declare-ok (Script::RefuseDeclare: channel.close 406)
//!  basic.publish + header + body frames ──▶ recorded as a ReceivedPublish
//! ```
//!
//! After that the test scripts what the broker sends, frame by frame ([`FakeBroker::send_ack`],
//! [`FakeBroker::send_return`], ...) or several frames in **one write**
//! ([`FakeBroker::send_frames`] with [`return_frames`], [`ack`], [`nack`]), and asserts on what
//! it received ([`FakeBroker::wait_publishes`], [`FakeBroker::violations`], ...).
//!
//! What the fake checks on every frame it receives (each failure is a *violation*, listed by
//! [`FakeBroker::violations`], which tests assert empty): the frame ends with `0xCE`, it is at
//! most the negotiated `frame_max` bytes in all (section 4.2.3; header and end octet
//! included), content frames follow their `basic.publish` with nothing else on the channel in
//! between (section 4.2.6), a body is never longer than its header's `body_size`, nothing is
//! published before `confirm.select`, and `tune-ok` asks for no more than the fake offered.
//!
//! One [`FakeBroker`] serves the first connection on its address. A [`FakeServer`] serves
//! every connection on one address (one per partition under `run --partitions N`, new ones
//! after a reconnect), each handed out as its own [`FakeBroker`], found by the client's
//! `connection_name`; its connections can ack every publish on arrival (auto-ack, decided
//! per connection name at start-ok, switched with [`FakeBroker::set_auto_ack`]).
//!
//! Sends are `async`: each returns once its bytes were written to the socket (one
//! `write_all`, `TCP_NODELAY` set, so one write is one segment on loopback for these sizes).
//! Waits are bounded by [`WAIT`] (scaled by `PGOUTBOX_TEST_SCALE`) and panic with what was
//! seen when they run out.
//!
//! Source: AMQP 0-9-1 specification, sections 2.2.4 (connection), 4.2.3 (frames), 4.2.6
//! (content), 4.2.7 (heartbeats); RabbitMQ "Publisher Confirms" (tags from 1 after
//! `confirm.select`, `basic.return` before `basic.ack`) and "Blocked Connection
//! Notifications".

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use amq_protocol::frame::{gen_frame, parse_frame, AMQPContentHeader, AMQPFrame, WriteContext};
use amq_protocol::protocol::{basic, channel, confirm, connection, exchange, AMQPClass};
use amq_protocol::types::{AMQPValue, FieldTable, LongString, ShortString};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::OwnedWriteHalf;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, oneshot, Notify};
use tokio::task::JoinHandle;

/// How long the fake's waits may take before they panic (scaled).
pub const WAIT: Duration = Duration::from_secs(5);

/// The header our publisher puts its match key in (`X/Y` text).
pub const LSN_HEADER: &str = "x-pgoutbox-lsn";

/// The channel of the most recent `channel.open` is used for everything the fake sends;
/// this is the one our publisher and lapin's first channel use.
const DEFAULT_CHANNEL: u16 = 1;

/// How the fake answers the handshake.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Script {
    /// Every step succeeds.
    Accept,
    /// `connection.close` 403 `ACCESS_REFUSED` in answer to `start-ok` (what RabbitMQ does
    /// for a wrong password when the client has the `authentication_failure_close`
    /// capability).
    RefuseLogin,
    /// `connection.close` 530 `NOT_ALLOWED` in answer to `connection.open` (unknown vhost).
    RefuseVhost,
    /// `channel.close` 406 `PRECONDITION_FAILED` in answer to `exchange.declare` (the
    /// exchange exists with another type).
    RefuseDeclare,
}

/// What the fake offers in `connection.tune`, and how it answers the handshake.
#[derive(Debug, Clone, Copy)]
pub struct FakeConfig {
    /// `channel-max` offered (RabbitMQ's default is 2047).
    pub channel_max: u16,
    /// `frame-max` offered, bytes (RabbitMQ's default is 131072).
    pub frame_max: u32,
    /// Heartbeat offered, seconds (0: off). When on, the fake sends a heartbeat frame every
    /// half interval (as RabbitMQ does) until [`FakeBroker::stop_heartbeats`].
    pub heartbeat: u16,
    /// The handshake's outcome.
    pub script: Script,
    /// After answering the client's `connection.close` with `close-ok`, keep the socket
    /// open until the client closes it (as RabbitMQ does: the peer that sent `close`
    /// closes the socket, AMQP 0-9-1 4.2.3). Off: the fake closes it at once.
    pub keep_socket_after_close_ok: bool,
}

impl Default for FakeConfig {
    fn default() -> Self {
        FakeConfig {
            channel_max: 2047,
            frame_max: 131_072,
            heartbeat: 0,
            script: Script::Accept,
            keep_socket_after_close_ok: false,
        }
    }
}

/// One `basic.publish` as received: the method, its content header and its body frames
/// joined.
#[derive(Debug, Clone)]
pub struct ReceivedPublish {
    /// The delivery tag the broker assigns: 1 for the first publish after
    /// `confirm.select`, in arrival order.
    pub delivery_tag: u64,
    /// The method (exchange, routing key, mandatory, immediate).
    pub method: basic::Publish,
    /// The content header (body size and properties).
    pub header: AMQPContentHeader,
    /// The body frames' payloads joined.
    pub body: Vec<u8>,
    /// How many body frames carried it.
    pub body_frames: usize,
    /// Our `x-pgoutbox-lsn` header, as text, when present.
    pub lsn: Option<String>,
    /// The `message_id` property, when present.
    pub message_id: Option<String>,
}

/// What a scripted `basic.return` carries in its content header.
#[derive(Debug, Clone)]
pub enum ReturnContent {
    /// The publish's properties, unchanged (what RabbitMQ sends).
    AsPublished,
    /// The publish's properties without our `x-pgoutbox-lsn` header.
    WithoutLsnHeader,
    /// The publish's properties with `x-pgoutbox-lsn` set to this text.
    LsnHeader(String),
}

/// A method the fake received after the handshake that is not part of a publish (for
/// example `channel.close-ok`), with its channel.
pub type ReceivedMethod = (u16, AMQPClass);

#[derive(Debug, Default)]
struct State {
    /// The client's `connection.start-ok`.
    start_ok: Option<connection::StartOk>,
    /// The client's `connection.tune-ok`.
    tune_ok: Option<connection::TuneOk>,
    /// The vhost of `connection.open`.
    vhost: Option<String>,
    /// The client's `exchange.declare`.
    declare: Option<exchange::Declare>,
    /// `confirm.select` was answered: publishes are numbered from here.
    confirming: bool,
    /// The handshake was answered in full (exchange declared, confirms on).
    ready: bool,
    publishes: Vec<ReceivedPublish>,
    /// A publish whose content is still arriving.
    partial: Option<Partial>,
    heartbeats: usize,
    methods: Vec<ReceivedMethod>,
    violations: Vec<String>,
    /// The largest frame received after tune-ok, bytes in all.
    largest_frame: usize,
    /// The socket is closed (by the client, by us, or on an error).
    closed: bool,
    /// Ack every publish as soon as its content is complete ([`FakeBroker::set_auto_ack`]).
    auto_ack: bool,
    /// The highest delivery tag the fake acked through (with `multiple`, or one by one in
    /// auto-ack mode): every tag up to it is acked. Acks sent with [`FakeBroker::send_ack`]
    /// are not counted.
    acked_through: u64,
}

#[derive(Debug)]
struct Partial {
    method: basic::Publish,
    header: Option<AMQPContentHeader>,
    body: Vec<u8>,
    body_frames: usize,
}

#[derive(Debug, Default)]
struct Shared {
    state: Mutex<State>,
    changed: Notify,
    /// The [`FakeServer`]'s notify, for a connection it accepted: its waits see every
    /// connection's changes too.
    server: Option<Arc<Notify>>,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn update<R>(&self, f: impl FnOnce(&mut State) -> R) -> R {
        let r = f(&mut self.lock());
        self.changed.notify_waiters();
        if let Some(server) = &self.server {
            server.notify_waiters();
        }
        r
    }

    fn violation(&self, text: String) {
        self.update(|s| s.violations.push(text));
    }
}

enum Command {
    /// Bytes to write in one write; `closing` when they end with our `connection.close`
    /// (the client's close-ok then ends the connection).
    Write {
        bytes: Vec<u8>,
        closing: bool,
        done: oneshot::Sender<()>,
    },
    StopHeartbeats,
    CloseSocket(oneshot::Sender<()>),
    /// Auto-ack on or off; turning it on acks every publish received so far (one
    /// `multiple` ack) when any is not acked through yet.
    AutoAck(bool, oneshot::Sender<()>),
    /// `basic.ack(tag, multiple)`, recorded in `acked_through`.
    AckThrough(u64, oneshot::Sender<()>),
}

/// A fake broker serving one connection; the server task stops when this is dropped.
#[derive(Debug)]
pub struct FakeBroker {
    addr: SocketAddr,
    config: FakeConfig,
    shared: Arc<Shared>,
    commands: mpsc::UnboundedSender<Command>,
    task: JoinHandle<()>,
}

impl std::fmt::Debug for Command {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Command::Write { bytes, .. } => write!(f, "Write({} bytes)", bytes.len()),
            Command::StopHeartbeats => write!(f, "StopHeartbeats"),
            Command::CloseSocket(_) => write!(f, "CloseSocket"),
            Command::AutoAck(on, _) => write!(f, "AutoAck({on})"),
            Command::AckThrough(tag, _) => write!(f, "AckThrough({tag})"),
        }
    }
}

impl Drop for FakeBroker {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl FakeBroker {
    /// Binds `127.0.0.1:0` and serves the first connection accepted there, on the current
    /// runtime.
    pub async fn start(config: FakeConfig) -> FakeBroker {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind 127.0.0.1:0");
        let addr = listener.local_addr().expect("local_addr");
        let shared = Arc::new(Shared::default());
        let (commands, rx) = mpsc::unbounded_channel();
        let task = tokio::spawn(serve(listener, config, shared.clone(), rx));
        FakeBroker {
            addr,
            config,
            shared,
            commands,
            task,
        }
    }

    /// `amqp://guest:guest@127.0.0.1:PORT/%2f`.
    pub fn url(&self) -> String {
        format!("amqp://guest:guest@{}/%2f", self.addr)
    }

    /// The configuration it was started with.
    pub fn config(&self) -> FakeConfig {
        self.config
    }

    /// The client's `connection.start-ok`, once received.
    pub fn start_ok(&self) -> Option<connection::StartOk> {
        self.shared.lock().start_ok.clone()
    }

    /// The client's `connection.tune-ok`, once received.
    pub fn tune_ok(&self) -> Option<connection::TuneOk> {
        self.shared.lock().tune_ok.clone()
    }

    /// The vhost the client opened, once received.
    pub fn vhost(&self) -> Option<String> {
        self.shared.lock().vhost.clone()
    }

    /// The client's `exchange.declare`, once received.
    pub fn declare(&self) -> Option<exchange::Declare> {
        self.shared.lock().declare.clone()
    }

    /// True once `confirm.select` and `exchange.declare` were answered with their `-ok`.
    pub fn is_ready(&self) -> bool {
        self.shared.lock().ready
    }

    /// The publishes received so far, in arrival order.
    pub fn publishes(&self) -> Vec<ReceivedPublish> {
        self.shared.lock().publishes.clone()
    }

    /// Heartbeat frames received from the client.
    pub fn heartbeats_received(&self) -> usize {
        self.shared.lock().heartbeats
    }

    /// Methods received after the handshake that are not publishes (e.g. close-oks).
    pub fn methods(&self) -> Vec<ReceivedMethod> {
        self.shared.lock().methods.clone()
    }

    /// Every protocol violation seen in what the client sent (empty when it behaved).
    pub fn violations(&self) -> Vec<String> {
        self.shared.lock().violations.clone()
    }

    /// The largest frame received after `tune-ok`, bytes in all (header and end included).
    pub fn largest_frame(&self) -> usize {
        self.shared.lock().largest_frame
    }

    /// True once the socket is closed (by either side).
    pub fn is_closed(&self) -> bool {
        self.shared.lock().closed
    }

    /// Waits until at least `n` publishes arrived (bounded by [`WAIT`]) and returns them all.
    ///
    /// # Panics
    /// On timeout, with how many arrived.
    pub async fn wait_publishes(&self, n: usize) -> Vec<ReceivedPublish> {
        self.wait_for(&format!("{n} publishes"), |s| {
            (s.publishes.len() >= n).then(|| s.publishes.clone())
        })
        .await
    }

    /// Waits until at least `n` heartbeats arrived from the client (bounded by `timeout`).
    /// False on timeout.
    pub async fn wait_heartbeats(&self, n: usize, timeout: Duration) -> bool {
        self.try_wait_for(timeout, |s| (s.heartbeats >= n).then_some(()))
            .await
            .is_some()
    }

    /// Waits until the handshake was answered in full (bounded by [`WAIT`]).
    ///
    /// # Panics
    /// On timeout.
    pub async fn wait_ready(&self) {
        self.wait_for("the handshake", |s| s.ready.then_some(()))
            .await
    }

    /// Waits until a method matching `pred` was received after the handshake (bounded by
    /// [`WAIT`]).
    ///
    /// # Panics
    /// On timeout, with the methods received.
    pub async fn wait_method(&self, what: &str, pred: impl Fn(&AMQPClass) -> bool) {
        self.wait_for(what, |s| {
            s.methods.iter().any(|(_, m)| pred(m)).then_some(())
        })
        .await
    }

    /// Waits until `channel.close-ok` arrived (after [`FakeBroker::send_channel_close`]).
    pub async fn wait_channel_close_ok(&self) {
        self.wait_method("channel.close-ok", |m| {
            matches!(m, AMQPClass::Channel(channel::AMQPMethod::CloseOk(_)))
        })
        .await
    }

    /// Waits until the socket is closed (bounded by [`WAIT`]).
    pub async fn wait_closed(&self) {
        self.wait_for("close of the socket", |s| s.closed.then_some(()))
            .await
    }

    async fn wait_for<R>(&self, what: &str, f: impl Fn(&State) -> Option<R>) -> R {
        let timeout = super::scaled(WAIT);
        match self.try_wait_for(timeout, &f).await {
            Some(r) => r,
            None => {
                let s = self.shared.lock();
                panic!(
                    "fake broker: no {what} within {timeout:?}; publishes {}, methods {:?}, violations {:?}, closed {}",
                    s.publishes.len(),
                    s.methods,
                    s.violations,
                    s.closed
                )
            }
        }
    }

    async fn try_wait_for<R>(
        &self,
        timeout: Duration,
        f: impl Fn(&State) -> Option<R>,
    ) -> Option<R> {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let notified = self.shared.changed.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if let Some(r) = f(&self.shared.lock()) {
                return Some(r);
            }
            if tokio::time::timeout_at(deadline, notified).await.is_err() {
                return f(&self.shared.lock());
            }
        }
    }

    /// Writes `frames` to the client in **one** write, in order; returns once written.
    ///
    /// # Panics
    /// When the connection is closed.
    pub async fn send_frames(&self, frames: &[AMQPFrame]) {
        self.send_raw(encode_frames(frames)).await;
    }

    /// Writes raw bytes in one write; returns once written.
    ///
    /// # Panics
    /// When the connection is closed.
    pub async fn send_raw(&self, bytes: Vec<u8>) {
        self.write(bytes, false).await
    }

    async fn write(&self, bytes: Vec<u8>, closing: bool) {
        let (done, written) = oneshot::channel();
        self.commands
            .send(Command::Write {
                bytes,
                closing,
                done,
            })
            .expect("fake broker: the server task is gone");
        written
            .await
            .expect("fake broker: the connection closed before the write");
    }

    /// `basic.return` of `publish` (method, content header, body frames) in one write.
    pub async fn send_return(
        &self,
        publish: &ReceivedPublish,
        code: u16,
        text: &str,
        content: ReturnContent,
    ) {
        self.send_frames(&return_frames(
            publish,
            code,
            text,
            content,
            self.config.frame_max,
        ))
        .await
    }

    /// `basic.ack(tag, multiple)`.
    pub async fn send_ack(&self, tag: u64, multiple: bool) {
        self.send_frames(&[ack(tag, multiple)]).await
    }

    /// `basic.nack(tag, multiple)` (requeue false).
    pub async fn send_nack(&self, tag: u64, multiple: bool) {
        self.send_frames(&[nack(tag, multiple)]).await
    }

    /// `channel.close(code, text)` on channel 1; the client is expected to answer with
    /// `channel.close-ok` ([`FakeBroker::wait_channel_close_ok`]).
    pub async fn send_channel_close(&self, code: u16, text: &str) {
        self.send_frames(&[channel_close(code, text, 60, 40)]).await
    }

    /// `connection.close(code, text)`; the client is expected to answer with
    /// `connection.close-ok`, after which the fake closes the socket.
    pub async fn send_connection_close(&self, code: u16, text: &str) {
        self.write(encode_frames(&[connection_close(code, text, 0, 0)]), true)
            .await
    }

    /// `connection.blocked(reason)`.
    pub async fn send_blocked(&self, reason: &str) {
        self.send_frames(&[method(
            0,
            AMQPClass::Connection(connection::AMQPMethod::Blocked(connection::Blocked {
                reason: ShortString::from(reason),
            })),
        )])
        .await
    }

    /// `connection.unblocked`.
    pub async fn send_unblocked(&self) {
        self.send_frames(&[method(
            0,
            AMQPClass::Connection(connection::AMQPMethod::Unblocked(connection::Unblocked {})),
        )])
        .await
    }

    /// Stops sending heartbeats (the client should then declare the peer dead).
    pub fn stop_heartbeats(&self) {
        let _ = self.commands.send(Command::StopHeartbeats);
    }

    /// Closes the socket now (FIN, no `connection.close`); returns once closed.
    pub async fn close_socket(&self) {
        let (done, closed) = oneshot::channel();
        if self.commands.send(Command::CloseSocket(done)).is_ok() {
            let _ = closed.await;
        }
    }

    /// The client's `connection_name` property (empty before start-ok or without one).
    pub fn connection_name(&self) -> String {
        self.shared
            .lock()
            .start_ok
            .as_ref()
            .map(connection_name)
            .unwrap_or_default()
    }

    /// Turns auto-ack on or off: while on, every publish is acked (`basic.ack(tag)`) as
    /// soon as its content is complete. Turning it on first acks, in one `multiple` ack,
    /// every publish received so far that is not acked through yet. Returns once done.
    ///
    /// # Panics
    /// When the connection is closed.
    pub async fn set_auto_ack(&self, on: bool) {
        let (done, written) = oneshot::channel();
        self.commands
            .send(Command::AutoAck(on, done))
            .expect("fake broker: the server task is gone");
        written
            .await
            .expect("fake broker: the connection closed before auto-ack was set");
    }

    /// `basic.ack(tag, multiple)`, recorded: [`FakeBroker::acked_through`] is then at
    /// least `tag`. Returns once written.
    ///
    /// # Panics
    /// When the connection is closed.
    pub async fn ack_through(&self, tag: u64) {
        let (done, written) = oneshot::channel();
        self.commands
            .send(Command::AckThrough(tag, done))
            .expect("fake broker: the server task is gone");
        written
            .await
            .expect("fake broker: the connection closed before the ack");
    }

    /// The highest tag the fake acked through ([`FakeBroker::ack_through`], auto-ack): every
    /// publish with a tag up to it was acked. Acks of [`FakeBroker::send_ack`] are not
    /// counted.
    pub fn acked_through(&self) -> u64 {
        self.shared.lock().acked_through
    }
}

/// Whether a [`FakeServer`]'s connection starts in auto-ack mode, by the client's
/// `connection_name` (decided at `start-ok`).
pub type AutoAckPolicy = Arc<dyn Fn(&str) -> bool + Send + Sync>;

#[derive(Default)]
struct ServerShared {
    /// Every connection accepted, in accept order.
    connections: Mutex<Vec<Arc<FakeBroker>>>,
    /// Notified on every accept and on every change of any connection's state.
    changed: Arc<Notify>,
}

/// A fake broker that accepts any number of connections on one address (`run --partitions
/// N` opens one per partition, and again after a reconnect), each served as by
/// [`FakeBroker`] and handed out as one: a test finds a connection by the client's
/// `connection_name` ([`FakeServer::wait_connection`]) and scripts or inspects it alone.
///
/// Connections start acking every publish on arrival or not, as the [`AutoAckPolicy`]
/// given at start says for their name; [`FakeBroker::set_auto_ack`] changes it per
/// connection. The accept loop and every connection stop when this is dropped (and the
/// handles given out are dropped).
pub struct FakeServer {
    addr: SocketAddr,
    shared: Arc<ServerShared>,
    task: JoinHandle<()>,
}

impl std::fmt::Debug for FakeServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FakeServer")
            .field("addr", &self.addr)
            .field("connections", &self.connections().len())
            .finish()
    }
}

impl Drop for FakeServer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl FakeServer {
    /// Binds `127.0.0.1:0` and serves every connection accepted there with `config`, each
    /// in auto-ack mode when `auto_ack(connection_name)` is true.
    pub async fn start(
        config: FakeConfig,
        auto_ack: impl Fn(&str) -> bool + Send + Sync + 'static,
    ) -> FakeServer {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind 127.0.0.1:0");
        let addr = listener.local_addr().expect("local_addr");
        let shared = Arc::new(ServerShared::default());
        let task = tokio::spawn(accept_all(
            listener,
            config,
            Arc::new(auto_ack),
            shared.clone(),
        ));
        FakeServer { addr, shared, task }
    }

    /// `amqp://guest:guest@127.0.0.1:PORT/%2f`.
    pub fn url(&self) -> String {
        format!("amqp://guest:guest@{}/%2f", self.addr)
    }

    /// Every connection accepted so far, in accept order.
    pub fn connections(&self) -> Vec<Arc<FakeBroker>> {
        self.shared
            .connections
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// The connections whose client `connection_name` contains `needle`, in accept order.
    pub fn named(&self, needle: &str) -> Vec<Arc<FakeBroker>> {
        self.connections()
            .into_iter()
            .filter(|c| c.connection_name().contains(needle))
            .collect()
    }

    /// Waits up to `timeout` until the `nth` (from 0, in accept order) connection whose
    /// client `connection_name` contains `needle` completed the handshake
    /// ([`FakeBroker::is_ready`]), and returns it; `None` on timeout.
    pub async fn wait_connection(
        &self,
        needle: &str,
        nth: usize,
        timeout: Duration,
    ) -> Option<Arc<FakeBroker>> {
        self.wait_until(timeout, || {
            self.named(needle)
                .get(nth)
                .filter(|c| c.is_ready())
                .cloned()
        })
        .await
    }

    /// Waits up to `timeout` until `f` (evaluated on every change of any connection)
    /// returns something; the last evaluation's result at the deadline otherwise.
    pub async fn wait_until<R>(&self, timeout: Duration, f: impl Fn() -> Option<R>) -> Option<R> {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let notified = self.shared.changed.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if let Some(r) = f() {
                return Some(r);
            }
            if tokio::time::timeout_at(deadline, notified).await.is_err() {
                return f();
            }
        }
    }
}

/// A method frame.
pub fn method(channel: u16, class: AMQPClass) -> AMQPFrame {
    AMQPFrame::Method(channel, class)
}

/// `basic.ack(tag, multiple)` on channel 1.
pub fn ack(tag: u64, multiple: bool) -> AMQPFrame {
    method(
        DEFAULT_CHANNEL,
        AMQPClass::Basic(basic::AMQPMethod::Ack(basic::Ack {
            delivery_tag: tag,
            multiple,
        })),
    )
}

/// `basic.nack(tag, multiple, requeue false)` on channel 1.
pub fn nack(tag: u64, multiple: bool) -> AMQPFrame {
    method(
        DEFAULT_CHANNEL,
        AMQPClass::Basic(basic::AMQPMethod::Nack(basic::Nack {
            delivery_tag: tag,
            multiple,
            requeue: false,
        })),
    )
}

/// `channel.close` on channel 1, naming the method that caused it.
pub fn channel_close(code: u16, text: &str, class_id: u16, method_id: u16) -> AMQPFrame {
    method(
        DEFAULT_CHANNEL,
        AMQPClass::Channel(channel::AMQPMethod::Close(channel::Close {
            reply_code: code,
            reply_text: ShortString::from(text),
            class_id,
            method_id,
        })),
    )
}

/// `connection.close` on channel 0.
pub fn connection_close(code: u16, text: &str, class_id: u16, method_id: u16) -> AMQPFrame {
    method(
        0,
        AMQPClass::Connection(connection::AMQPMethod::Close(connection::Close {
            reply_code: code,
            reply_text: ShortString::from(text),
            class_id,
            method_id,
        })),
    )
}

/// The frames of a `basic.return` of `publish`: the method (code, text, the publish's
/// exchange and routing key), its content header (the publish's properties, changed as
/// `content` says, same body size) and its body in frames of at most `frame_max` bytes.
pub fn return_frames(
    publish: &ReceivedPublish,
    code: u16,
    text: &str,
    content: ReturnContent,
    frame_max: u32,
) -> Vec<AMQPFrame> {
    let mut properties = publish.header.properties.clone();
    let mut headers: BTreeMap<ShortString, AMQPValue> = properties
        .headers()
        .as_ref()
        .map(|h| h.inner().clone())
        .unwrap_or_default();
    match content {
        ReturnContent::AsPublished => {}
        ReturnContent::WithoutLsnHeader => {
            headers.remove(LSN_HEADER);
            properties = properties.with_headers(FieldTable::from(headers));
        }
        ReturnContent::LsnHeader(text) => {
            headers.insert(
                ShortString::from(LSN_HEADER),
                AMQPValue::LongString(LongString::from(text)),
            );
            properties = properties.with_headers(FieldTable::from(headers));
        }
    }
    let mut frames = vec![
        method(
            DEFAULT_CHANNEL,
            AMQPClass::Basic(basic::AMQPMethod::Return(basic::Return {
                reply_code: code,
                reply_text: ShortString::from(text),
                exchange: publish.method.exchange.clone(),
                routing_key: publish.method.routing_key.clone(),
            })),
        ),
        AMQPFrame::Header(
            DEFAULT_CHANNEL,
            AMQPContentHeader {
                class_id: 60,
                body_size: publish.body.len() as u64,
                properties,
            },
        ),
    ];
    let chunk = (frame_max as usize).saturating_sub(8).max(1);
    frames.extend(
        publish
            .body
            .chunks(chunk)
            .map(|part| AMQPFrame::Body(DEFAULT_CHANNEL, part.to_vec())),
    );
    frames
}

/// `frames` encoded back to back, as they go on the wire.
pub fn encode_frames(frames: &[AMQPFrame]) -> Vec<u8> {
    frames.iter().fold(Vec::new(), encode)
}

fn encode(buf: Vec<u8>, frame: &AMQPFrame) -> Vec<u8> {
    match gen_frame(frame)(WriteContext::from(buf)) {
        Ok(ctx) => ctx.into_inner().0,
        Err(e) => panic!("fake broker: cannot encode {frame}: {e:?}"),
    }
}

/// The text of header `key` (long or short string).
fn header_text(properties: &basic::AMQPProperties, key: &str) -> Option<String> {
    match properties.headers().as_ref()?.inner().get(key)? {
        AMQPValue::LongString(s) => Some(String::from_utf8_lossy(s.as_bytes()).into_owned()),
        AMQPValue::ShortString(s) => Some(s.as_str().to_owned()),
        _ => None,
    }
}

/// The server task: accept one connection, read the protocol header, then handle frames
/// and commands until either side closes.
async fn serve(
    listener: TcpListener,
    config: FakeConfig,
    shared: Arc<Shared>,
    commands: mpsc::UnboundedReceiver<Command>,
) {
    let Ok((socket, _)) = listener.accept().await else {
        return;
    };
    drop(listener);
    serve_connection(socket, config, shared, commands, None).await;
}

/// Serves one accepted connection until either side closes.
async fn serve_connection(
    socket: TcpStream,
    config: FakeConfig,
    shared: Arc<Shared>,
    mut commands: mpsc::UnboundedReceiver<Command>,
    auto_ack_policy: Option<AutoAckPolicy>,
) {
    let mut conn = Conn::new(socket, config, shared.clone(), auto_ack_policy);
    conn.run(&mut commands).await;
    shared.update(|s| s.closed = true);
}

/// A [`FakeServer`]'s accept loop: every connection gets its own [`FakeBroker`] handle.
async fn accept_all(
    listener: TcpListener,
    config: FakeConfig,
    auto_ack_policy: AutoAckPolicy,
    server: Arc<ServerShared>,
) {
    let addr = listener.local_addr().expect("local_addr");
    while let Ok((socket, _)) = listener.accept().await {
        let shared = Arc::new(Shared {
            server: Some(server.changed.clone()),
            ..Shared::default()
        });
        let (commands, rx) = mpsc::unbounded_channel();
        let task = tokio::spawn(serve_connection(
            socket,
            config,
            shared.clone(),
            rx,
            Some(auto_ack_policy.clone()),
        ));
        let broker = Arc::new(FakeBroker {
            addr,
            config,
            shared,
            commands,
            task,
        });
        server
            .connections
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(broker);
        server.changed.notify_waiters();
    }
}

/// The `connection_name` client property of `start_ok` (empty when absent).
fn connection_name(start_ok: &connection::StartOk) -> String {
    match start_ok.client_properties.inner().get("connection_name") {
        Some(AMQPValue::LongString(s)) => String::from_utf8_lossy(s.as_bytes()).into_owned(),
        Some(AMQPValue::ShortString(s)) => s.as_str().to_owned(),
        _ => String::new(),
    }
}

struct Conn {
    reader: Option<tokio::net::tcp::OwnedReadHalf>,
    writer: OwnedWriteHalf,
    config: FakeConfig,
    shared: Arc<Shared>,
    inbuf: Vec<u8>,
    /// The negotiated frame_max once tune-ok arrived (0 before: not checked).
    frame_max: u32,
    heartbeats_on: bool,
    /// Channel of the last channel.open.
    channel: u16,
    /// We sent connection.close and wait for close-ok.
    closing: bool,
    /// Whether to start in auto-ack mode, by the client's connection name (a
    /// [`FakeServer`]'s connections).
    auto_ack_policy: Option<AutoAckPolicy>,
}

/// What handling a frame asks of the loop.
enum Next {
    Continue,
    Close,
}

impl Conn {
    fn new(
        socket: TcpStream,
        config: FakeConfig,
        shared: Arc<Shared>,
        auto_ack_policy: Option<AutoAckPolicy>,
    ) -> Conn {
        let _ = socket.set_nodelay(true);
        let (reader, writer) = socket.into_split();
        Conn {
            reader: Some(reader),
            writer,
            config,
            shared,
            inbuf: Vec::new(),
            frame_max: 0,
            heartbeats_on: false,
            channel: DEFAULT_CHANNEL,
            closing: false,
            auto_ack_policy,
        }
    }

    async fn write(&mut self, frames: &[AMQPFrame]) -> bool {
        self.writer.write_all(&encode_frames(frames)).await.is_ok()
    }

    async fn run(&mut self, commands: &mut mpsc::UnboundedReceiver<Command>) {
        let mut reader = self.reader.take().expect("reader");
        // Section 4.2.2: the client opens with "AMQP" 0 0 9 1.
        let mut header = [0u8; 8];
        let read = tokio::time::timeout(super::scaled(WAIT), reader.read_exact(&mut header)).await;
        if !matches!(read, Ok(Ok(_))) {
            self.shared
                .violation("no protocol header from the client".into());
            return;
        }
        if &header != b"AMQP\x00\x00\x09\x01" {
            self.shared
                .violation(format!("bad protocol header {header:?}"));
            let _ = self.writer.write_all(b"AMQP\x00\x00\x09\x01").await;
            return;
        }
        let start = connection::Start {
            version_major: 0,
            version_minor: 9,
            server_properties: server_properties(),
            mechanisms: LongString::from("PLAIN"),
            locales: LongString::from("en_US"),
        };
        if !self
            .write(&[method(
                0,
                AMQPClass::Connection(connection::AMQPMethod::Start(start)),
            )])
            .await
        {
            return;
        }
        let half = Duration::from_millis(u64::from(self.config.heartbeat) * 500)
            .max(Duration::from_millis(1));
        let mut ticker = tokio::time::interval(half);
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut buf = vec![0u8; 256 * 1024];
        loop {
            tokio::select! {
                read = reader.read(&mut buf) => {
                    let n = match read {
                        Ok(0) | Err(_) => return,
                        Ok(n) => n,
                    };
                    self.inbuf.extend_from_slice(&buf[..n]);
                    if let Next::Close = self.handle_buffered().await {
                        return;
                    }
                }
                command = commands.recv() => match command {
                    None => return,
                    Some(Command::Write { bytes, closing, done }) => {
                        self.closing |= closing;
                        if self.writer.write_all(&bytes).await.is_err() {
                            return;
                        }
                        let _ = done.send(());
                    }
                    Some(Command::StopHeartbeats) => self.heartbeats_on = false,
                    Some(Command::AutoAck(on, done)) => {
                        let through = self.shared.update(|s| {
                            s.auto_ack = on;
                            let last = s.publishes.len() as u64;
                            (on && last > s.acked_through).then(|| {
                                s.acked_through = last;
                                last
                            })
                        });
                        if let Some(tag) = through {
                            if !self.write(&[ack(tag, true)]).await {
                                return;
                            }
                        }
                        let _ = done.send(());
                    }
                    Some(Command::AckThrough(tag, done)) => {
                        self.shared.update(|s| s.acked_through = s.acked_through.max(tag));
                        if !self.write(&[ack(tag, true)]).await {
                            return;
                        }
                        let _ = done.send(());
                    }
                    Some(Command::CloseSocket(done)) => {
                        // FIN after everything written. Keep reading (and discarding) until
                        // the client closes too: closing a socket with unread bytes would
                        // send RST, which may destroy what the client has not read yet.
                        let _ = self.writer.shutdown().await;
                        tokio::spawn(async move {
                            let mut sink = [0u8; 4096];
                            while matches!(reader.read(&mut sink).await, Ok(n) if n > 0) {}
                        });
                        self.shared.update(|s| s.closed = true);
                        let _ = done.send(());
                        return;
                    }
                },
                _ = ticker.tick(), if self.heartbeats_on => {
                    if !self.write(&[AMQPFrame::Heartbeat]).await {
                        return;
                    }
                }
            }
        }
    }

    /// Handles every complete frame in the buffer.
    async fn handle_buffered(&mut self) -> Next {
        loop {
            let Some(head) = self.inbuf.get(..7) else {
                return Next::Continue;
            };
            let size = u32::from_be_bytes([head[3], head[4], head[5], head[6]]) as usize;
            let total = size + 8;
            if self.inbuf.len() < total {
                return Next::Continue;
            }
            let bytes: Vec<u8> = self.inbuf.drain(..total).collect();
            if bytes[total - 1] != 0xCE {
                self.shared.violation(format!(
                    "a frame of {total} bytes ends with {:#04x}, not 0xCE",
                    bytes[total - 1]
                ));
                return Next::Close;
            }
            if self.frame_max > 0 {
                let frame_max = self.frame_max as usize;
                self.shared.update(|s| {
                    s.largest_frame = s.largest_frame.max(total);
                    if total > frame_max {
                        s.violations.push(format!(
                            "a frame of {total} bytes (type {}) exceeds frame_max {frame_max}",
                            bytes[0]
                        ));
                    }
                });
            }
            let frame = match parse_frame(bytes.as_slice()) {
                Ok((_, frame)) => frame,
                Err(e) => {
                    self.shared
                        .violation(format!("undecodable frame {bytes:02x?}: {e:?}"));
                    return Next::Close;
                }
            };
            if let Next::Close = self.handle(frame).await {
                return Next::Close;
            }
        }
    }

    async fn handle(&mut self, frame: AMQPFrame) -> Next {
        use connection::AMQPMethod as C;
        let partial_open = self.shared.lock().partial.is_some();
        match frame {
            AMQPFrame::Heartbeat => {
                self.shared.update(|s| s.heartbeats += 1);
                Next::Continue
            }
            AMQPFrame::Header(ch, header) => {
                let completed = self.content_header(ch, header);
                self.auto_ack(completed).await
            }
            AMQPFrame::Body(ch, part) => {
                let completed = self.content_body(ch, part);
                self.auto_ack(completed).await
            }
            AMQPFrame::Method(ch, AMQPClass::Basic(basic::AMQPMethod::Publish(p))) => {
                let confirming = self.shared.lock().confirming;
                self.shared.update(|s| {
                    if !confirming {
                        s.violations
                            .push("basic.publish before confirm.select".into());
                    }
                    if partial_open {
                        s.violations.push(
                            "basic.publish while the previous publish's content was incomplete"
                                .into(),
                        );
                    }
                    if ch != self.channel {
                        s.violations.push(format!(
                            "basic.publish on channel {ch}, not the open channel {}",
                            self.channel
                        ));
                    }
                    s.partial = Some(Partial {
                        method: p,
                        header: None,
                        body: Vec::new(),
                        body_frames: 0,
                    });
                });
                Next::Continue
            }
            AMQPFrame::Method(ch, class) => {
                if partial_open {
                    self.shared.violation(format!(
                        "method {class:?} on channel {ch} while a publish's content was incomplete"
                    ));
                }
                match class {
                    AMQPClass::Connection(C::StartOk(start_ok)) => {
                        let auto_ack = self
                            .auto_ack_policy
                            .as_ref()
                            .map(|policy| policy(&connection_name(&start_ok)));
                        self.shared.update(|s| {
                            s.start_ok = Some(start_ok);
                            if let Some(on) = auto_ack {
                                s.auto_ack = on;
                            }
                        });
                        if self.config.script == Script::RefuseLogin {
                            self.closing = true;
                            let text = "ACCESS_REFUSED - Login was refused using authentication mechanism PLAIN. For details see the broker logfile.";
                            return self.reply(&[connection_close(403, text, 0, 0)]).await;
                        }
                        let tune = connection::Tune {
                            channel_max: self.config.channel_max,
                            frame_max: self.config.frame_max,
                            heartbeat: self.config.heartbeat,
                        };
                        self.reply(&[method(0, AMQPClass::Connection(C::Tune(tune)))])
                            .await
                    }
                    AMQPClass::Connection(C::TuneOk(tune_ok)) => {
                        let offered = self.config;
                        self.frame_max = if tune_ok.frame_max == 0 {
                            offered.frame_max
                        } else {
                            tune_ok.frame_max
                        };
                        self.heartbeats_on = offered.heartbeat > 0 && tune_ok.heartbeat > 0;
                        self.shared.update(|s| {
                            if offered.frame_max > 0
                                && (tune_ok.frame_max == 0 || tune_ok.frame_max > offered.frame_max)
                            {
                                s.violations.push(format!(
                                    "tune-ok frame_max {} exceeds the offered {}",
                                    tune_ok.frame_max, offered.frame_max
                                ));
                            }
                            if offered.channel_max > 0
                                && (tune_ok.channel_max == 0
                                    || tune_ok.channel_max > offered.channel_max)
                            {
                                s.violations.push(format!(
                                    "tune-ok channel_max {} exceeds the offered {}",
                                    tune_ok.channel_max, offered.channel_max
                                ));
                            }
                            s.tune_ok = Some(tune_ok);
                        });
                        Next::Continue
                    }
                    AMQPClass::Connection(C::Open(open)) => {
                        let vhost = open.virtual_host.as_str().to_owned();
                        self.shared.update(|s| s.vhost = Some(vhost.clone()));
                        if self.config.script == Script::RefuseVhost {
                            self.closing = true;
                            let text = format!("NOT_ALLOWED - vhost {vhost} not found");
                            return self.reply(&[connection_close(530, &text, 10, 40)]).await;
                        }
                        self.reply(&[method(
                            0,
                            AMQPClass::Connection(C::OpenOk(connection::OpenOk {})),
                        )])
                        .await
                    }
                    AMQPClass::Channel(channel::AMQPMethod::Open(_)) => {
                        self.channel = ch;
                        self.reply(&[method(
                            ch,
                            AMQPClass::Channel(channel::AMQPMethod::OpenOk(channel::OpenOk {})),
                        )])
                        .await
                    }
                    AMQPClass::Confirm(confirm::AMQPMethod::Select(select)) => {
                        self.shared.update(|s| {
                            s.confirming = true;
                            s.ready =
                                s.declare.is_some() && self.config.script != Script::RefuseDeclare;
                        });
                        if select.nowait {
                            return Next::Continue;
                        }
                        self.reply(&[method(
                            ch,
                            AMQPClass::Confirm(confirm::AMQPMethod::SelectOk(confirm::SelectOk {})),
                        )])
                        .await
                    }
                    AMQPClass::Exchange(exchange::AMQPMethod::Declare(declare)) => {
                        let nowait = declare.nowait;
                        let name = declare.exchange.as_str().to_owned();
                        let refuse = self.config.script == Script::RefuseDeclare;
                        self.shared.update(|s| {
                            s.declare = Some(declare);
                            s.ready = s.confirming && !refuse;
                        });
                        if refuse {
                            let text = format!("PRECONDITION_FAILED - inequivalent arg 'type' for exchange '{name}' in vhost '/': received 'topic' but current is 'direct'");
                            return self.reply(&[channel_close(406, &text, 40, 10)]).await;
                        }
                        if nowait {
                            return Next::Continue;
                        }
                        self.reply(&[method(
                            ch,
                            AMQPClass::Exchange(exchange::AMQPMethod::DeclareOk(
                                exchange::DeclareOk {},
                            )),
                        )])
                        .await
                    }
                    AMQPClass::Connection(C::Close(close)) => {
                        self.record(ch, AMQPClass::Connection(C::Close(close)));
                        let _ = self
                            .write(&[method(
                                0,
                                AMQPClass::Connection(C::CloseOk(connection::CloseOk {})),
                            )])
                            .await;
                        if self.config.keep_socket_after_close_ok {
                            Next::Continue
                        } else {
                            Next::Close
                        }
                    }
                    AMQPClass::Connection(C::CloseOk(ok)) => {
                        self.record(ch, AMQPClass::Connection(C::CloseOk(ok)));
                        if !self.closing {
                            self.shared
                                .violation("connection.close-ok without a connection.close".into());
                        }
                        Next::Close
                    }
                    other => {
                        self.record(ch, other);
                        Next::Continue
                    }
                }
            }
            other => {
                self.shared.violation(format!("unexpected frame {other}"));
                Next::Continue
            }
        }
    }

    /// Acks `completed` (a publish just received, in auto-ack mode).
    async fn auto_ack(&mut self, completed: Option<u64>) -> Next {
        match completed {
            Some(tag) => self.reply(&[ack(tag, false)]).await,
            None => Next::Continue,
        }
    }

    async fn reply(&mut self, frames: &[AMQPFrame]) -> Next {
        if self.write(frames).await {
            Next::Continue
        } else {
            Next::Close
        }
    }

    fn record(&self, ch: u16, class: AMQPClass) {
        self.shared.update(|s| s.methods.push((ch, class)));
    }

    /// Records a content header; returns the publish's tag when it completed it and it is to
    /// be acked now.
    fn content_header(&self, ch: u16, header: AMQPContentHeader) -> Option<u64> {
        self.shared.update(|s| {
            let Some(partial) = s.partial.as_mut().filter(|p| p.header.is_none()) else {
                s.violations.push(format!(
                    "content header on channel {ch} without a basic.publish before it"
                ));
                return None;
            };
            let size = header.body_size;
            partial.header = Some(header);
            if size == 0 {
                return complete(s);
            }
            None
        })
    }

    /// Records a body frame; as [`Conn::content_header`].
    fn content_body(&self, ch: u16, part: Vec<u8>) -> Option<u64> {
        self.shared.update(|s| {
            let Some(partial) = s.partial.as_mut() else {
                s.violations.push(format!(
                    "content body on channel {ch} without a basic.publish"
                ));
                return None;
            };
            let Some(size) = partial.header.as_ref().map(|h| h.body_size) else {
                s.violations
                    .push("content body before its content header".into());
                return None;
            };
            partial.body.extend_from_slice(&part);
            partial.body_frames += 1;
            let got = partial.body.len() as u64;
            if got > size {
                s.violations.push(format!(
                    "content body of {got} bytes, more than the header's body_size {size}"
                ));
                s.partial = None;
            } else if got == size {
                return complete(s);
            }
            None
        })
    }
}

/// The content of `s.partial` is complete: record it as the next delivery tag. Returns
/// that tag when it is to be acked now (auto-ack mode), recording it as acked through.
fn complete(s: &mut State) -> Option<u64> {
    let p = s.partial.take()?;
    let header = p.header?;
    let lsn = header_text(&header.properties, LSN_HEADER);
    let message_id = header
        .properties
        .message_id()
        .as_ref()
        .map(|m| m.as_str().to_owned());
    let delivery_tag = s.publishes.len() as u64 + 1;
    s.publishes.push(ReceivedPublish {
        delivery_tag,
        method: p.method,
        header,
        body: p.body,
        body_frames: p.body_frames,
        lsn,
        message_id,
    });
    if s.auto_ack {
        s.acked_through = delivery_tag;
        return Some(delivery_tag);
    }
    None
}

/// Server properties like RabbitMQ's: product, version and the capabilities a confirming
/// publisher looks for.
fn server_properties() -> FieldTable {
    let mut capabilities = FieldTable::default();
    for cap in [
        "publisher_confirms",
        "exchange_exchange_bindings",
        "basic.nack",
        "consumer_cancel_notify",
        "connection.blocked",
        "authentication_failure_close",
        "per_consumer_qos",
        "direct_reply_to",
    ] {
        capabilities.insert(ShortString::from(cap), AMQPValue::Boolean(true));
    }
    let mut props = FieldTable::default();
    props.insert(
        ShortString::from("product"),
        AMQPValue::LongString(LongString::from("pgoutbox fake broker")),
    );
    props.insert(
        ShortString::from("version"),
        AMQPValue::LongString(LongString::from("0.0.0")),
    );
    props.insert(
        ShortString::from("capabilities"),
        AMQPValue::FieldTable(capabilities),
    );
    props
}
