//! RabbitMQ publishing with publisher confirms (lapin), and nothing of Postgres.
//!
//! Two tasks per connection:
//! - the **publish task** takes queued [`OutboundMessage`]s in batches and first-polls their
//!   `basic_publish` futures in queue order (lapin assigns the delivery tag and pushes the
//!   frames on a future's first poll, so first-poll order is wire order), many at once so
//!   the cross-thread hand-off to lapin's I/O thread is amortised;
//! - the **confirm task** awaits the resulting `PublisherConfirm`s in delivery-tag order and
//!   hands batches of `(tag, PublishOutcome)` to the pipeline.
//!
//! Returns (`basic.return`) are matched by a per-publish key (see [`OutboundMessage::match_key`]),
//! because lapin attaches a return to whichever confirm its ack loop resolves first. Before
//! classifying a batch the confirm task takes lapin's acknowledgement lock once (the first poll
//! of `wait_for_confirms` does exactly that), so every confirm resolved by the same
//! `basic.ack` frame, including the one carrying the return, is already visible.
//! Source: AMQP 0-9-1 `basic.publish` (mandatory), `basic.return`, `basic.ack`/`basic.nack`
//! with `multiple`; RabbitMQ "Publisher Confirms".

pub mod message;
pub mod outcome;

use std::collections::{HashSet, VecDeque};
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use futures::FutureExt;
use lapin::options::{BasicPublishOptions, ConfirmSelectOptions, ExchangeDeclareOptions};
use lapin::types::{AMQPValue, FieldTable, ShortString};
use lapin::{Channel, Connection, ConnectionProperties, ExchangeKind};
use lapin::{Confirmation, PublisherConfirm};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;

pub use message::OutboundMessage;
pub use outcome::PublishOutcome;

/// The header that carries each publish's match key (the message LSN, `X/Y`).
pub const MATCH_KEY_HEADER: &str = "x-pgoutbox-lsn";

/// How many queued messages the publish task first-polls together.
const PUBLISH_BATCH: usize = 128;

/// An error of the publisher layer.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The AMQP URL is not usable.
    #[error("invalid AMQP URL: {0}")]
    Url(String),
    /// Connecting or opening the channel failed.
    #[error("RabbitMQ: {context}")]
    Connect {
        /// What we were doing, with the redacted URL and the fix.
        context: String,
        /// lapin's error.
        #[source]
        source: lapin::Error,
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
        /// lapin's error.
        #[source]
        source: Box<lapin::Error>,
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
    /// Declaring the exchange failed (for example 406 PRECONDITION_FAILED when it exists
    /// with another type or durability).
    #[error("could not declare exchange {exchange:?} (durable topic); if it exists with another type or durability, delete it or pick another --exchange")]
    Declare {
        /// The exchange name.
        exchange: String,
        /// lapin's error.
        #[source]
        source: lapin::Error,
    },
    /// The publisher tasks are gone (connection closed).
    #[error("the publisher stopped: the RabbitMQ connection or channel is closed")]
    Closed,
}

/// Settings of one publisher connection.
#[derive(Clone)]
pub struct PublisherConfig {
    /// `amqp://user:pass@host:port/vhost` (no TLS yet).
    pub amqp_url: String,
    /// The durable topic exchange to publish to (declared if absent).
    pub exchange: String,
    /// Shown in RabbitMQ's connection list.
    pub connection_name: String,
    /// Flags the connection's event watcher keeps up to date.
    pub signals: BrokerSignals,
}

/// What the connection's event watcher reports, as flags other tasks read.
///
/// `blocked` is true while RabbitMQ blocks the connection (`connection.blocked`, sent when a
/// memory or disk alarm is raised and the connection publishes; each start and end is
/// logged); `lost` turns true when the connection or the channel fails (the pipeline
/// notices the same at its next status tick and reconnects). lapin stops sending frames
/// while blocked, so publishes wait and confirms stop; nothing here changes that. lapin
/// hands each connection event to one listener only, so this is the connection's single
/// event watcher.
#[derive(Debug, Clone, Default)]
pub struct BrokerSignals {
    /// True while the broker blocks the connection.
    pub blocked: std::sync::Arc<std::sync::atomic::AtomicBool>,
    /// True once the connection or the channel failed.
    pub lost: std::sync::Arc<std::sync::atomic::AtomicBool>,
}

impl std::fmt::Debug for PublisherConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PublisherConfig")
            .field("amqp_url", &crate::config::redact_url(&self.amqp_url))
            .field("exchange", &self.exchange)
            .field("connection_name", &self.connection_name)
            .finish()
    }
}

/// A connected publisher: queue messages with [`Publisher::publish`], read outcomes with
/// [`Publisher::recv_outcomes`]. `T` is the caller's tag, handed back with each outcome.
pub struct Publisher<T> {
    connection: Connection,
    tx: Option<mpsc::UnboundedSender<OutboundMessage<T>>>,
    outcomes: mpsc::UnboundedReceiver<Vec<(T, PublishOutcome)>>,
    tasks: Vec<JoinHandle<()>>,
}

impl<T> std::fmt::Debug for Publisher<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Publisher").finish_non_exhaustive()
    }
}

impl<T: Send + 'static> Publisher<T> {
    /// Connects, opens one channel in confirm mode and declares the exchange (durable topic),
    /// all within [`CONNECT_TIMEOUT`].
    ///
    /// # Errors
    /// [`Error::Url`] for `amqps://` (TLS not supported yet); [`Error::Refused`] when the
    /// broker refuses the login or the vhost; [`Error::ConnectTimeout`]; [`Error::Connect`];
    /// [`Error::Declare`].
    pub async fn connect(config: &PublisherConfig) -> Result<Self, Error> {
        tokio::time::timeout(CONNECT_TIMEOUT, Self::connect_unbounded(config))
            .await
            .map_err(|_| Error::ConnectTimeout {
                url: crate::config::redact_url(&config.amqp_url),
                timeout_s: CONNECT_TIMEOUT.as_secs(),
            })?
    }

    async fn connect_unbounded(config: &PublisherConfig) -> Result<Self, Error> {
        if config.amqp_url.starts_with("amqps://") {
            return Err(Error::Url(
                "amqps:// asks for TLS, which is not supported yet; use amqp:// on a trusted network or a local TLS tunnel".into(),
            ));
        }
        let props = ConnectionProperties::default()
            .with_connection_name(config.connection_name.clone().into());
        let connection = Connection::connect(&with_heartbeat(&config.amqp_url), props)
            .await
            .map_err(|source| connect_error(&config.amqp_url, source))?;
        // The broker's reason for closing the channel (reply code and text) reaches us as a
        // connection event; publishes made after the close only see "invalid channel state".
        let close_reason = CloseReason::default();
        let mut events = connection.events_listener();
        let recorder = close_reason.clone();
        let signals = config.signals.clone();
        let events_task = tokio::spawn(async move {
            use futures::StreamExt;
            use std::sync::atomic::Ordering;
            while let Some(event) = events.next().await {
                match event {
                    lapin::Event::Error(e) => {
                        signals.lost.store(true, Ordering::Relaxed);
                        if broker_reply(&e).is_some() {
                            recorder.record(describe_lapin_error(&e));
                        }
                    }
                    lapin::Event::ConnectionBlocked(reason) => {
                        signals.blocked.store(true, Ordering::Relaxed);
                        tracing::warn!(reason = %reason, "RabbitMQ blocked the connection (connection.blocked: memory or disk alarm); publishes wait until it clears, nothing unconfirmed is acknowledged");
                    }
                    lapin::Event::ConnectionUnblocked => {
                        signals.blocked.store(false, Ordering::Relaxed);
                        tracing::info!("RabbitMQ unblocked the connection (connection.unblocked); publishing resumes");
                    }
                    _ => {}
                }
            }
        });
        let channel = connection
            .create_channel()
            .await
            .map_err(|source| Error::Connect {
                context: "could not open a channel".into(),
                source,
            })?;
        channel
            .confirm_select(ConfirmSelectOptions::default())
            .await
            .map_err(|source| Error::Connect {
                context: "could not enable publisher confirms".into(),
                source,
            })?;
        channel
            .exchange_declare(
                ShortString::from(config.exchange.as_str()),
                ExchangeKind::Topic,
                ExchangeDeclareOptions {
                    durable: true,
                    ..ExchangeDeclareOptions::default()
                },
                FieldTable::default(),
            )
            .await
            .map_err(|source| Error::Declare {
                exchange: config.exchange.clone(),
                source,
            })?;

        let (tx, rx) = mpsc::unbounded_channel();
        let (confirm_tx, confirm_rx) = mpsc::unbounded_channel();
        let (outcome_tx, outcomes) = mpsc::unbounded_channel();
        let exchange = ShortString::from(config.exchange.as_str());
        let publish = tokio::spawn(publish_task(channel.clone(), exchange, rx, confirm_tx));
        let confirm = tokio::spawn(confirm_task(channel, confirm_rx, outcome_tx, close_reason));
        Ok(Publisher {
            connection,
            tx: Some(tx),
            outcomes,
            tasks: vec![publish, confirm, events_task],
        })
    }

    /// Queues one message; it is published in queue order.
    ///
    /// # Errors
    /// [`Error::Closed`] when the publish task is gone.
    pub fn publish(&self, message: OutboundMessage<T>) -> Result<(), Error> {
        self.tx
            .as_ref()
            .ok_or(Error::Closed)?
            .send(message)
            .map_err(|_| Error::Closed)
    }

    /// The next batch of outcomes, in publish order; `None` once everything queued before
    /// [`Publisher::finish`] has an outcome, or the tasks are gone.
    ///
    /// # Cancel safety
    /// Cancel safe (`mpsc::UnboundedReceiver::recv`).
    pub async fn recv_outcomes(&mut self) -> Option<Vec<(T, PublishOutcome)>> {
        self.outcomes.recv().await
    }

    /// Stops accepting messages; outcomes of those already queued keep arriving.
    pub fn finish(&mut self) {
        self.tx = None;
    }

    /// True while the AMQP connection is up.
    pub fn is_connected(&self) -> bool {
        self.connection.status().connected()
    }

    /// Closes the connection (best effort) and stops the tasks.
    pub async fn close(self) {
        let _ = self.connection.close(200, "pgoutbox shutdown".into()).await;
        for task in self.tasks {
            task.abort();
        }
    }
}

/// How long connecting, opening the channel and declaring the exchange may take: a host
/// that accepts TCP and never answers is reported after this, as a retryable timeout.
pub const CONNECT_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

/// The reply code and text of an AMQP error the broker sent (`channel.close` or
/// `connection.close`), e.g. `(404, "NOT_FOUND - no exchange 'x' in vhost '/'")`.
pub fn broker_reply(e: &lapin::Error) -> Option<(u16, String)> {
    match e.kind() {
        lapin::ErrorKind::ProtocolError(amqp) => {
            Some((amqp.get_id(), amqp.get_message().as_str().to_owned()))
        }
        _ => None,
    }
}

/// lapin's error for the operator: an AMQP error the broker sent is shown as the broker's
/// reply code and text (which names the cause, e.g. `404 NOT_FOUND - no exchange ...`).
fn describe_lapin_error(e: &lapin::Error) -> String {
    match (e.kind(), broker_reply(e)) {
        (lapin::ErrorKind::ProtocolError(amqp), Some((code, text))) => {
            let scope = match amqp.kind() {
                lapin::protocol::AMQPErrorKind::Hard(_) => "connection",
                lapin::protocol::AMQPErrorKind::Soft(_) => "channel",
            };
            format!("the broker closed the {scope} with {code} {text}")
        }
        _ => e.to_string(),
    }
}

/// Maps a failed `Connection::connect` to our error: a refused login or vhost is definite
/// and says what to change; anything else is a retryable connect failure.
fn connect_error(amqp_url: &str, source: lapin::Error) -> Error {
    let url = crate::config::redact_url(amqp_url);
    match broker_reply(&source) {
        Some((403, reply_text)) => Error::Refused {
            url,
            reply_code: 403,
            reply_text,
            fix: "check the user and password in --amqp-url (PGOUTBOX_AMQP_URL); `rabbitmqctl list_users` shows the users, `rabbitmqctl change_password USER PASSWORD` sets one".into(),
            source: Box::new(source),
        },
        Some((530, reply_text)) => {
            let vhost = vhost_of(amqp_url);
            Error::Refused {
                url,
                reply_code: 530,
                reply_text,
                fix: format!(
                    "the vhost {vhost:?} is missing or the user may not use it: create it with `rabbitmqctl add_vhost {vhost}` and grant the user with `rabbitmqctl set_permissions -p {vhost} USER '.*' '.*' '.*'`, or fix the vhost (the URL path, %2f for /) in --amqp-url (PGOUTBOX_AMQP_URL)"
                ),
                source: Box::new(source),
            }
        }
        _ => Error::Connect {
            context: format!(
                "could not connect to {url}; check host, port, user, password and vhost in --amqp-url (PGOUTBOX_AMQP_URL) and that RabbitMQ is running"
            ),
            source,
        },
    }
}

/// The vhost an AMQP URL names (its percent-decoded path; `/` when empty).
fn vhost_of(amqp_url: &str) -> String {
    let path = url::Url::parse(amqp_url)
        .map(|u| u.path().trim_start_matches('/').to_owned())
        .unwrap_or_default();
    if path.is_empty() {
        return "/".into();
    }
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

/// The last AMQP error the broker closed the channel or connection with, as text.
#[derive(Clone, Default)]
struct CloseReason(std::sync::Arc<std::sync::Mutex<Option<String>>>);

impl CloseReason {
    fn record(&self, text: String) {
        let mut guard = self.0.lock().unwrap_or_else(|e| e.into_inner());
        guard.get_or_insert(text);
    }

    /// `error`, with the broker's close reason when lapin only says the channel is closed.
    fn explain(&self, error: String) -> String {
        if !error.contains("invalid channel state") && !error.contains("invalid connection state") {
            return error;
        }
        match self.0.lock().unwrap_or_else(|e| e.into_inner()).as_deref() {
            Some(reason) => reason.to_owned(),
            None => error,
        }
    }
}

/// AMQP heartbeat (seconds) asked for when the URL names none: a dead broker or a black-holed
/// connection is noticed within about twice this.
pub const DEFAULT_HEARTBEAT_S: u16 = 10;

/// Adds `heartbeat=DEFAULT_HEARTBEAT_S` to an AMQP URL that sets none.
fn with_heartbeat(url: &str) -> String {
    if url.contains("heartbeat=") {
        url.to_owned()
    } else if url.contains('?') {
        format!("{url}&heartbeat={DEFAULT_HEARTBEAT_S}")
    } else {
        format!("{url}?heartbeat={DEFAULT_HEARTBEAT_S}")
    }
}

/// Polls a batch of futures, first-polling them in index order, until all are ready.
struct InOrder<F: Future + Unpin> {
    futures: Vec<Option<F>>,
    outputs: Vec<Option<F::Output>>,
}

impl<F: Future + Unpin> Future for InOrder<F>
where
    F::Output: Unpin,
{
    type Output = Vec<F::Output>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = &mut *self;
        let mut pending = false;
        for (slot, out) in this.futures.iter_mut().zip(this.outputs.iter_mut()) {
            if let Some(fut) = slot {
                match Pin::new(fut).poll(cx) {
                    Poll::Ready(v) => {
                        *out = Some(v);
                        *slot = None;
                    }
                    Poll::Pending => pending = true,
                }
            }
        }
        if pending {
            Poll::Pending
        } else {
            Poll::Ready(this.outputs.iter_mut().filter_map(Option::take).collect())
        }
    }
}

struct Pending<T> {
    tag: T,
    match_key: String,
    confirm: Option<PublisherConfirm>,
    failure: Option<String>,
    /// The confirm's result once seen (or the publish failure).
    result: Option<Result<Confirmation, String>>,
    /// Whether a return carried by `result` has been recorded.
    return_recorded: bool,
}

impl<T> Pending<T> {
    /// Polls the confirm once, without waiting; true when the result is known.
    fn poll_ready(&mut self) -> bool {
        if self.result.is_some() {
            return true;
        }
        self.result = match &mut self.confirm {
            Some(c) => c
                .now_or_never()
                .map(|r| r.map_err(|e| describe_lapin_error(&e))),
            None => Some(Err(self
                .failure
                .clone()
                .unwrap_or_else(|| "no confirm".into()))),
        };
        self.result.is_some()
    }
}

async fn publish_task<T: Send + 'static>(
    channel: Channel,
    exchange: ShortString,
    mut rx: mpsc::UnboundedReceiver<OutboundMessage<T>>,
    confirm_tx: mpsc::UnboundedSender<Pending<T>>,
) {
    let mut batch = Vec::with_capacity(PUBLISH_BATCH);
    let options = BasicPublishOptions {
        mandatory: true,
        ..BasicPublishOptions::default()
    };
    while rx.recv_many(&mut batch, PUBLISH_BATCH).await > 0 {
        let mut keys = Vec::with_capacity(batch.len());
        let mut futures = Vec::with_capacity(batch.len());
        for m in batch.drain(..) {
            let OutboundMessage {
                tag,
                routing_key,
                body,
                properties,
                match_key,
            } = m;
            keys.push((tag, match_key));
            let channel = channel.clone();
            let exchange = exchange.clone();
            futures.push(Some(Box::pin(async move {
                channel
                    .basic_publish(exchange, routing_key, options, &body, properties)
                    .await
            })));
        }
        let outputs: Vec<Option<_>> = futures.iter().map(|_| None).collect();
        let results = InOrder { futures, outputs }.await;
        for ((tag, match_key), result) in keys.into_iter().zip(results) {
            let pending = match result {
                Ok(confirm) => Pending {
                    tag,
                    match_key,
                    confirm: Some(confirm),
                    failure: None,
                    result: None,
                    return_recorded: false,
                },
                Err(e) => Pending {
                    tag,
                    match_key,
                    confirm: None,
                    failure: Some(describe_lapin_error(&e)),
                    result: None,
                    return_recorded: false,
                },
            };
            if confirm_tx.send(pending).is_err() {
                return;
            }
        }
    }
}

fn returned_key(ret: &lapin::message::BasicReturnMessage) -> Option<String> {
    let headers = ret.delivery.properties.headers().as_ref()?;
    match headers.inner().get(MATCH_KEY_HEADER)? {
        AMQPValue::LongString(s) => Some(String::from_utf8_lossy(s.as_bytes()).into_owned()),
        AMQPValue::ShortString(s) => Some(s.as_str().to_owned()),
        _ => None,
    }
}

async fn confirm_task<T: Send + 'static>(
    channel: Channel,
    mut rx: mpsc::UnboundedReceiver<Pending<T>>,
    outcome_tx: mpsc::UnboundedSender<Vec<(T, PublishOutcome)>>,
    close_reason: CloseReason,
) {
    let mut queue: VecDeque<Pending<T>> = VecDeque::new();
    // Match keys of returned messages whose own confirm has not been classified yet.
    let mut returned: HashSet<String> = HashSet::new();
    let mut reasons: std::collections::HashMap<String, (u16, String)> = Default::default();
    let mut input_open = true;
    loop {
        if queue.is_empty() {
            if !input_open {
                return;
            }
            match rx.recv().await {
                Some(p) => queue.push_back(p),
                None => return,
            }
        }
        // Wait for the front confirm, taking new pendings meanwhile.
        let front_ready = match queue.front_mut() {
            None => false,
            Some(front) => match front.confirm.as_mut() {
                Some(confirm) if front.result.is_none() => {
                    let mut incoming = None;
                    let ready = tokio::select! {
                        biased;
                        r = confirm => {
                            front.result = Some(r.map_err(|e| describe_lapin_error(&e)));
                            true
                        }
                        p = rx.recv(), if input_open => {
                            match p {
                                Some(p) => incoming = Some(p),
                                None => input_open = false,
                            }
                            false
                        }
                    };
                    if let Some(p) = incoming {
                        queue.push_back(p);
                    }
                    ready
                }
                _ => front.poll_ready(),
            },
        };
        if !front_ready {
            continue;
        }
        // The ready prefix as seen *before* the barrier: only these are classified now.
        let mut ready = 1;
        while ready < queue.len() && queue[ready].poll_ready() {
            ready += 1;
        }
        // Barrier: the first poll of wait_for_confirms takes lapin's acknowledgement lock, so
        // every ack loop that resolved one of those `ready` confirms has finished resolving
        // its whole range, including the confirm that carries the range's return, which lapin
        // hands to whichever confirm of the range it resolves first (hash order), possibly
        // one past `ready`. Look further, to the first unresolved confirm, for such carriers.
        let _ = channel.wait_for_confirms().now_or_never();
        let mut seen = ready;
        while seen < queue.len() && queue[seen].poll_ready() {
            seen += 1;
        }
        for p in queue.iter_mut().take(seen) {
            if p.return_recorded {
                continue;
            }
            p.return_recorded = true;
            if let Some(Ok(Confirmation::Ack(Some(ret)) | Confirmation::Nack(Some(ret)))) =
                &p.result
            {
                if let Some(key) = returned_key(ret) {
                    reasons.insert(
                        key.clone(),
                        (ret.reply_code, ret.reply_text.as_str().to_owned()),
                    );
                    returned.insert(key);
                }
            }
        }
        // Confirms resolved after the barrier (seen but not ready) may belong to a range
        // still being resolved; they are classified in a later round, after its barrier.
        let results: Vec<(Pending<T>, Result<Confirmation, String>)> = queue
            .drain(..ready)
            .map(|mut p| {
                let r = p.result.take().unwrap_or_else(|| Err("no confirm".into()));
                (p, r)
            })
            .collect();
        let batch: Vec<(T, PublishOutcome)> = results
            .into_iter()
            .map(|(p, r)| {
                let outcome = match r {
                    Err(error) => PublishOutcome::Failed {
                        error: close_reason.explain(error),
                    },
                    Ok(Confirmation::Nack(_)) => PublishOutcome::Nacked,
                    Ok(Confirmation::NotRequested) => PublishOutcome::Failed {
                        error: "publisher confirms were not enabled".into(),
                    },
                    Ok(Confirmation::Ack(_)) => {
                        if returned.remove(&p.match_key) {
                            let (reply_code, reply_text) = reasons
                                .remove(&p.match_key)
                                .unwrap_or((312, "NO_ROUTE".into()));
                            PublishOutcome::Returned {
                                reply_code,
                                reply_text,
                            }
                        } else {
                            PublishOutcome::Routed
                        }
                    }
                };
                (p.tag, outcome)
            })
            .collect();
        if outcome_tx.send(batch).is_err() {
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vhost_is_the_percent_decoded_path() {
        assert_eq!(vhost_of("amqp://u:p@h:5672/%2f"), "/");
        assert_eq!(vhost_of("amqp://u:p@h:5672/"), "/");
        assert_eq!(vhost_of("amqp://u:p@h:5672"), "/");
        assert_eq!(vhost_of("amqp://u:p@h/orders%2Feu"), "orders/eu");
        assert_eq!(vhost_of("amqp://u:p@h/a+b%"), "a+b%");
    }

    #[test]
    fn broker_errors_show_the_reply_code_and_text() {
        let amqp = lapin::protocol::AMQPError::from_id(
            404,
            "NOT_FOUND - no exchange 'x' in vhost '/'".into(),
        )
        .expect("known code");
        let e = lapin::Error::from(lapin::ErrorKind::ProtocolError(amqp));
        assert_eq!(
            describe_lapin_error(&e),
            "the broker closed the channel with 404 NOT_FOUND - no exchange 'x' in vhost '/'"
        );
        let reason = CloseReason::default();
        reason.record(describe_lapin_error(&e));
        let closed = lapin::Error::from(lapin::ErrorKind::InvalidChannelState(
            lapin::ChannelState::Closed,
            "basic.publish",
        ));
        assert_eq!(
            reason.explain(closed.to_string()),
            describe_lapin_error(&e),
            "a publish after the close names the broker's reason"
        );
        assert_eq!(reason.explain("IO error: reset".into()), "IO error: reset");
    }
}
