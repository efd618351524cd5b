//! Which sink a run publishes to, and connecting it: the one place in the pipeline that
//! names an implementation of [`Sink`]. The event loop sees `&mut dyn Sink` only.
//!
//! Today there is one choice, [`SinkChoice::Amqp`]: one AMQP 0-9-1 connection with
//! publisher confirms ([`AmqpSink`]) to the first of `--amqp-url`'s nodes that accepts it
//! ([`BrokerNodes`]). The sinks to come are further variants of [`SinkChoice`], chosen in
//! [`SinkChoice::from_config`] and connected in [`SinkChoice::connect`], and nowhere else
//! (see [`crate::sink`] for how each plugs in):
//! - `Partitioned { n }` (`--partitions N`, N > 1): N [`AmqpSink`]s over one connect pass,
//!   behind `sink::partitioned`; `--partitions 1` stays [`SinkChoice::Amqp`], byte for
//!   byte;
//! - `Stream` (`--stream-url`, `--stream`): the stream-protocol publisher.

use crate::config::{ExchangeDeclare, RunConfig};
use crate::error::Error;
use crate::metrics::Telemetry;
use crate::publisher::connection::Declare;
use crate::publisher::encode::Encoder;
use crate::publisher::{AmqpSink, BrokerSignals, PublisherConfig};
use crate::sink::Sink;

/// The broker's nodes (`--amqp-url`, in `--amqp-url-order`) and where the next connect
/// pass starts.
///
/// A pass tries every node once, starting at `next`, and takes the first that completes
/// the AMQP handshake and the exchange declare. After the connection to node `i` was lost
/// the next pass starts at `i + 1` (wrapping), so a node that went down is tried last; after
/// a session that ended for another reason (Postgres, say) it starts at `i` again, so a
/// healthy node is kept. The first pass starts at the first node.
#[derive(Debug, Default)]
pub(super) struct BrokerNodes {
    /// The nodes' URLs, in the order they are tried.
    pub urls: Vec<String>,
    /// Index into `urls` of the node the next pass tries first.
    pub next: usize,
}

impl BrokerNodes {
    /// The indices of one connect pass, in the order they are tried.
    fn pass(&self) -> impl Iterator<Item = usize> + '_ {
        let n = self.urls.len();
        (0..n).map(move |k| (self.next + k) % n)
    }

    /// Records how a session on node `used` ended: after a broker failure the next pass
    /// starts at the following node.
    pub fn session_ended(&mut self, used: usize, broker_lost: bool) {
        let n = self.urls.len().max(1);
        self.next = if broker_lost {
            (used + 1) % n
        } else {
            used % n
        };
    }
}

/// A connected sink, and the node it is connected to (into [`BrokerNodes::urls`]).
pub(super) struct ConnectedSink {
    /// The sink the loop publishes to.
    pub sink: Box<dyn Sink>,
    /// The node of its connection.
    pub node: usize,
}

/// The sink a run publishes to, decided once from its settings.
#[derive(Debug, Clone)]
pub(super) enum SinkChoice {
    /// One AMQP 0-9-1 connection with publisher confirms, to one of the broker's nodes.
    Amqp {
        /// The connection's settings (`amqp_url` is set per node).
        publisher: PublisherConfig,
        /// The message mapping (`--publish-properties`, `--cloudevents`).
        encoder: Encoder,
    },
}

impl SinkChoice {
    /// The sink `config` asks for; `telemetry` gets the connection's blocked and lost
    /// flags.
    pub fn from_config(config: &RunConfig, telemetry: &Telemetry) -> Self {
        let publisher = PublisherConfig {
            amqp_url: String::new(),
            exchange: config.broker.exchange.clone(),
            declare: match config.broker.exchange_declare {
                ExchangeDeclare::DurableTopic => Declare::DurableTopic,
                ExchangeDeclare::Passive => Declare::Passive,
            },
            connection_name: format!("pgoutbox {}", config.observability.instance_id),
            signals: BrokerSignals {
                blocked: telemetry.broker_blocked_flag(),
                lost: telemetry.broker_lost_flag(),
            },
        };
        let encoder = Encoder::new(
            config.publishing.publish_properties,
            config.publishing.cloudevents.clone(),
        );
        // The next sinks are chosen here, from their settings: `--partitions N` (N > 1)
        // gives `Partitioned` (N of these AMQP settings), `--stream-url` gives `Stream`.
        SinkChoice::Amqp { publisher, encoder }
    }

    /// Connects the sink: one pass over `nodes` ([`connect_amqp`]).
    ///
    /// # Errors
    /// As [`connect_amqp`].
    pub async fn connect(&self, nodes: &BrokerNodes) -> Result<ConnectedSink, Error> {
        // One arm per sink: `Partitioned` connects N `connect_amqp` parts and puts them
        // behind `sink::partitioned`; `Stream` connects the stream publisher and queries
        // its stored sequence.
        match self {
            SinkChoice::Amqp { publisher, encoder } => {
                let (sink, node) = connect_amqp(nodes, publisher.clone(), encoder).await?;
                Ok(ConnectedSink {
                    sink: Box::new(sink),
                    node,
                })
            }
        }
    }
}

/// One connect pass over the broker's nodes ([`BrokerNodes::pass`]): the first node that
/// completes the handshake and the exchange declare wins, and is logged (URL without its
/// password). Each node gets [`crate::publisher::CONNECT_TIMEOUT`].
///
/// A definite refusal from one node (403 login refused, 530 vhost, a 403/406 declare, an
/// unusable TLS file) does not end the pass: users, permissions and exchanges are
/// cluster-wide in RabbitMQ, so it usually means the same on every node, but a URL that
/// points at a node outside the cluster, or one not yet synced, must not stop a healthy
/// one from being used. Each failure is logged with its node.
///
/// # Errors
/// When no node connected: the first definite error if every node answered with one (so
/// one URL behaves as before: a refused login stops `run`), otherwise the first retryable
/// error (a node down or unreachable), and the pass is tried again after the backoff.
async fn connect_amqp(
    nodes: &BrokerNodes,
    mut publisher_config: PublisherConfig,
    encoder: &Encoder,
) -> Result<(AmqpSink, usize), Error> {
    let total = nodes.urls.len();
    let mut first_retryable: Option<Error> = None;
    let mut first_definite: Option<Error> = None;
    for i in nodes.pass() {
        publisher_config.amqp_url.clone_from(&nodes.urls[i]);
        let url = crate::config::redact_url(&nodes.urls[i]);
        match AmqpSink::connect(&publisher_config, encoder.clone()).await {
            Ok(sink) => {
                tracing::info!(
                    node = %url,
                    index = i + 1,
                    of = total,
                    "connected to RabbitMQ"
                );
                return Ok((sink, i));
            }
            Err(e) => {
                let e = Error::from(e);
                if total > 1 {
                    tracing::warn!(
                        node = %url,
                        index = i + 1,
                        of = total,
                        definite = !e.is_retryable(),
                        error = %crate::error::one_line(&e),
                        "RabbitMQ node did not accept the connection; trying the next"
                    );
                }
                let slot = if e.is_retryable() {
                    &mut first_retryable
                } else {
                    &mut first_definite
                };
                if slot.is_none() {
                    *slot = Some(e);
                }
            }
        }
    }
    Err(first_retryable
        .or(first_definite)
        .unwrap_or_else(|| Error::BrokerLost("no RabbitMQ node is configured".into())))
}
