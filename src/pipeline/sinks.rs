//! Which sink a run publishes to, and connecting it: the one place in the pipeline that
//! names an implementation of [`Sink`]. The event loop sees `&mut dyn Sink` only.
//!
//! The choices, decided once in [`SinkChoice::from_config`] and connected in
//! [`SinkChoice::connect`], and nowhere else (see [`crate::sink`] for how each plugs in):
//! - [`SinkChoice::Amqp`] (`--partitions 1`, the default): one AMQP 0-9-1 connection with
//!   publisher confirms ([`AmqpSink`]) to the first of `--amqp-url`'s nodes that accepts
//!   it ([`BrokerNodes`]): the wire is the same as before partitions existed;
//! - [`SinkChoice::Partitioned`] (`--partitions N`, N > 1): N [`AmqpSink`]s, partition `i`
//!   starting its connect pass at node `next + i` (so with M nodes the partitions spread
//!   over them), behind [`PartitionedSink`];
//! - `Stream` (`--stream-url`, `--stream`), to come: the stream-protocol publisher.

use crate::config::{ExchangeDeclare, RunConfig};
use crate::error::Error;
use crate::metrics::Telemetry;
use crate::partition::PartitionKey;
use crate::publisher::connection::Declare;
use crate::publisher::encode::Encoder;
use crate::publisher::{AmqpSink, BrokerSignals, PublisherConfig};
use crate::sink::partitioned::PartitionedSink;
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
    /// The indices of one connect pass, in the order they are tried, starting `offset`
    /// nodes after `next` (partition `i` of N uses offset `i`).
    fn pass(&self, offset: usize) -> impl Iterator<Item = usize> + '_ {
        let n = self.urls.len().max(1);
        (0..self.urls.len()).map(move |k| (self.next + offset + k) % n)
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
    /// `--partitions N` (N > 1): N such connections, each message to the one of its key.
    Partitioned {
        /// Each part's connection settings (`amqp_url` and `connection_name` set per part).
        publisher: PublisherConfig,
        /// The message mapping, the same on every part.
        encoder: Encoder,
        /// N, 2 to [`crate::partition::MAX_PARTITIONS`].
        count: u16,
        /// What keys a message's partition.
        key: PartitionKey,
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
        // The next sink is chosen here too: `--stream-url` gives `Stream`.
        let partitions = config.broker.partitions;
        if partitions.count > 1 {
            return SinkChoice::Partitioned {
                publisher,
                encoder,
                count: partitions.count,
                key: partitions.key,
            };
        }
        SinkChoice::Amqp { publisher, encoder }
    }

    /// Connects the sink: one pass over `nodes` per connection ([`connect_amqp`]). For
    /// `Partitioned`, the node reported is partition 0's.
    ///
    /// # Errors
    /// As [`connect_amqp`], for the first partition that did not connect (the ones
    /// connected before it are dropped, which closes their sockets).
    pub async fn connect(&self, nodes: &BrokerNodes) -> Result<ConnectedSink, Error> {
        // One arm per sink; `Stream` will connect the stream publisher and query its
        // stored sequence.
        match self {
            SinkChoice::Amqp { publisher, encoder } => {
                let (sink, node) = connect_amqp(nodes, 0, publisher.clone(), encoder).await?;
                Ok(ConnectedSink {
                    sink: Box::new(sink),
                    node,
                })
            }
            SinkChoice::Partitioned {
                publisher,
                encoder,
                count,
                key,
            } => connect_partitions(nodes, publisher, encoder, *count, *key).await,
        }
    }
}

/// Connects partitions `0..count` in turn, partition `i` starting its pass `i` nodes on,
/// each named `pgoutbox INSTANCE partition i/count` on the broker (its connection list
/// shows them).
async fn connect_partitions(
    nodes: &BrokerNodes,
    publisher: &PublisherConfig,
    encoder: &Encoder,
    count: u16,
    key: PartitionKey,
) -> Result<ConnectedSink, Error> {
    let mut parts: Vec<Box<dyn Sink>> = Vec::with_capacity(usize::from(count));
    let mut first_node = 0;
    for i in 0..usize::from(count) {
        let mut config = publisher.clone();
        config.connection_name = format!("{} partition {i}/{count}", publisher.connection_name);
        let (sink, node) = connect_amqp(nodes, i, config, encoder).await?;
        tracing::debug!(
            partition = i,
            of = count,
            node = node + 1,
            "partition connected"
        );
        if i == 0 {
            first_node = node;
        }
        parts.push(Box::new(sink));
    }
    Ok(ConnectedSink {
        sink: Box::new(PartitionedSink::new(parts, key)),
        node: first_node,
    })
}

/// One connect pass over the broker's nodes ([`BrokerNodes::pass`], starting `offset` nodes
/// on): the first node that
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
    offset: usize,
    mut publisher_config: PublisherConfig,
    encoder: &Encoder,
) -> Result<(AmqpSink, usize), Error> {
    let total = nodes.urls.len();
    let mut first_retryable: Option<Error> = None;
    let mut first_definite: Option<Error> = None;
    for i in nodes.pass(offset) {
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
