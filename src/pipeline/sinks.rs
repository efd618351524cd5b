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

use tracing::Instrument as _;

use crate::config::{ExchangeDeclare, RunConfig};
use crate::error::Error;
use crate::metrics::Telemetry;
use crate::partition::PartitionKey;
use crate::publisher::connection::Declare;
use crate::publisher::encode::Encoder;
use crate::publisher::{AmqpSink, BrokerSignals, PublisherConfig};
use crate::sink::partitioned::PartitionedSink;
use crate::sink::Sink;
use crate::stream_publisher::{StreamConfig, StreamSink};

/// The broker's nodes (`--amqp-url`, in `--amqp-url-order`), where each partition's next
/// connect pass starts, and which nodes lost a connection.
///
/// A pass tries every node once and takes the first that completes the AMQP handshake and
/// the exchange declare. The first pass of partition `i` starts at node `i` (so with M nodes
/// the partitions spread over them). Each partition keeps its own place: after a session,
/// a partition whose connection was lost starts its next pass at the node after its own,
/// and the others start where they were, so a healthy node is kept. A node on which a
/// connection was lost is **down** until a connection to it completes again: every pass
/// tries the down nodes last, whichever partition's loss found them, so a partition that
/// was on a live node is not sent to a dead one (a black-holed node costs a whole
/// [`crate::publisher::CONNECT_TIMEOUT`] per try).
#[derive(Debug, Default)]
pub(super) struct BrokerNodes {
    /// The nodes' URLs, in the order they are tried.
    pub urls: Vec<crate::config::BrokerUrl>,
    /// Per partition, the node its next pass tries first (empty before the first session).
    next: Vec<usize>,
    /// Per node: a connection to it was lost and none completed since.
    down: Vec<bool>,
}

impl BrokerNodes {
    /// `urls` in the order they are tried, none down.
    pub fn new(urls: Vec<crate::config::BrokerUrl>) -> Self {
        let down = vec![false; urls.len()];
        BrokerNodes {
            urls,
            next: Vec::new(),
            down,
        }
    }

    /// The indices of partition `part`'s connect pass, in the order they are tried: from
    /// its starting node round the ring, the nodes that are down moved to the end.
    fn pass(&self, part: usize) -> Vec<usize> {
        let n = self.urls.len().max(1);
        let start = self.next.get(part).copied().unwrap_or(part) % n;
        let mut order: Vec<usize> = (0..self.urls.len()).map(|k| (start + k) % n).collect();
        order.sort_by_key(|&i| self.down.get(i).copied().unwrap_or(false));
        order
    }

    /// Records how a session ended: partition `i` was on node `used[i]`, and `lost[i]`
    /// says whether its connection was lost (not a channel the broker closed over one
    /// message: the node is fine then).
    pub fn session_ended(&mut self, used: &[usize], lost: &[bool]) {
        let n = self.urls.len().max(1);
        for (&node, _) in used.iter().zip(lost).filter(|(_, &l)| l) {
            if let Some(down) = self.down.get_mut(node) {
                *down = true;
            }
        }
        self.next = used
            .iter()
            .zip(lost)
            .map(|(&node, &l)| if l { (node + 1) % n } else { node % n })
            .collect();
    }

    /// A session connected partition `i` to node `used[i]`: those nodes are up.
    pub fn connected(&mut self, used: &[usize]) {
        for &node in used {
            if let Some(down) = self.down.get_mut(node) {
                *down = false;
            }
        }
    }

    /// Whether node `i` is marked down.
    #[cfg(test)]
    fn is_down(&self, i: usize) -> bool {
        self.down[i]
    }
}

/// A connected sink, and the node of each of its connections (into [`BrokerNodes::urls`]).
pub(super) struct ConnectedSink {
    /// The sink the loop publishes to.
    pub sink: Box<dyn Sink>,
    /// The node of each connection, partition 0 first (one for a single connection).
    pub nodes: Vec<usize>,
    /// `run --stream`: the highest publishing id the broker had stored for the producer
    /// name when the sink connected, and that name.
    pub stream_stored: Option<(u64, String)>,
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
        /// Each part's connection settings (`amqp_url`, `connection_name` and `signals` set
        /// per part).
        publisher: PublisherConfig,
        /// Partition `i`'s flags for the metrics and readiness (its own, so one partition's
        /// state never overwrites another's).
        signals: Vec<BrokerSignals>,
        /// The message mapping, the same on every part.
        encoder: Encoder,
        /// N, 2 to [`crate::partition::MAX_PARTITIONS`].
        count: u16,
        /// What keys a message's partition.
        key: PartitionKey,
    },
    /// `--stream-url` with `--stream`: one stream-protocol connection with one named
    /// publisher ([`StreamSink`]).
    Stream {
        /// The connection's settings (`url` set per node, `producer_name` per session).
        config: StreamConfig,
        /// The message mapping (`--publish-properties`, `--cloudevents`).
        encoder: Encoder,
    },
}

impl SinkChoice {
    /// The sink `config` asks for; `telemetry` gets each connection's blocked and lost
    /// flags.
    pub fn from_config(config: &RunConfig, telemetry: &Telemetry) -> Self {
        let partitions = config.broker.partitions;
        telemetry.set_partitions(usize::from(partitions.count));
        let signals_of = |i: usize| {
            let (blocked, lost) = telemetry
                .connection_flags(i)
                .unwrap_or_else(|| (Default::default(), Default::default()));
            BrokerSignals {
                blocked,
                lost,
                residence: Some(telemetry.residence()),
            }
        };
        let publisher = PublisherConfig {
            amqp_url: crate::config::BrokerUrl::default(),
            exchange: config.broker.exchange.clone(),
            declare: match config.broker.exchange_declare {
                ExchangeDeclare::DurableTopic => Declare::DurableTopic,
                ExchangeDeclare::Passive => Declare::Passive,
            },
            connection_name: format!("pgoutbox {}", config.observability.instance_id),
            signals: signals_of(0),
        };
        let encoder = Encoder::new(
            config.publishing.publish_properties,
            config.publishing.cloudevents.clone(),
        );
        if let Some(stream) = &config.broker.stream {
            return SinkChoice::Stream {
                config: StreamConfig {
                    url: String::new(),
                    stream: stream.stream.clone(),
                    producer_name: String::new(),
                    create: match config.broker.exchange_declare {
                        ExchangeDeclare::DurableTopic => {
                            Some(stream.arguments(config.broker.stream_max_length_bytes))
                        }
                        ExchangeDeclare::Passive => None,
                    },
                    connection_name: format!("pgoutbox {}", config.observability.instance_id),
                    signals: signals_of(0),
                    counters: Some(telemetry.stream_counters()),
                },
                encoder,
            };
        }
        if partitions.count > 1 {
            return SinkChoice::Partitioned {
                signals: (0..usize::from(partitions.count)).map(signals_of).collect(),
                publisher,
                encoder,
                count: partitions.count,
                key: partitions.key,
            };
        }
        SinkChoice::Amqp { publisher, encoder }
    }

    /// Connects the sink: one pass over `nodes` per connection ([`connect_amqp`]), each
    /// connection's node reported.
    ///
    /// # Errors
    /// As [`connect_amqp`], for the first partition that did not connect (the ones
    /// connected before it are dropped, which closes their sockets).
    pub async fn connect(
        &self,
        nodes: &BrokerNodes,
        producer_name: &str,
    ) -> Result<ConnectedSink, Error> {
        match self {
            SinkChoice::Amqp { publisher, encoder } => {
                let (sink, node) = connect_amqp(nodes, 0, publisher.clone(), encoder).await?;
                Ok(ConnectedSink {
                    sink: Box::new(sink),
                    nodes: vec![node],
                    stream_stored: None,
                })
            }
            SinkChoice::Stream { config, encoder } => {
                let mut config = config.clone();
                config.producer_name = producer_name.to_owned();
                let (sink, node) = connect_stream(nodes, config, encoder).await?;
                Ok(ConnectedSink {
                    stream_stored: Some((sink.stored(), producer_name.to_owned())),
                    sink: Box::new(sink),
                    nodes: vec![node],
                })
            }
            SinkChoice::Partitioned {
                publisher,
                signals,
                encoder,
                count,
                key,
            } => connect_partitions(nodes, publisher, signals, encoder, *count, *key).await,
        }
    }
}

/// Connects partitions `0..count` in turn, each with its own pass ([`BrokerNodes::pass`]),
/// each named `pgoutbox INSTANCE partition i/count` on the broker (its connection list
/// shows them).
async fn connect_partitions(
    nodes: &BrokerNodes,
    publisher: &PublisherConfig,
    signals: &[BrokerSignals],
    encoder: &Encoder,
    count: u16,
    key: PartitionKey,
) -> Result<ConnectedSink, Error> {
    let mut parts: Vec<Box<dyn Sink>> = Vec::with_capacity(usize::from(count));
    let mut used = Vec::with_capacity(usize::from(count));
    for i in 0..usize::from(count) {
        let mut config = publisher.clone();
        config.connection_name = format!("{} partition {i}/{count}", publisher.connection_name);
        if let Some(own) = signals.get(i) {
            config.signals = own.clone();
        }
        // Partition i's connect lines name it (span `partition`, as its sink's lines do).
        let (sink, node) = connect_amqp(nodes, i, config, encoder)
            .instrument(tracing::info_span!("partition", partition = i))
            .await?;
        tracing::debug!(
            partition = i,
            of = count,
            node = node + 1,
            "partition connected"
        );
        used.push(node);
        parts.push(Box::new(sink));
    }
    Ok(ConnectedSink {
        sink: Box::new(PartitionedSink::new(parts, key)),
        nodes: used,
        stream_stored: None,
    })
}

/// One connect pass of partition `part` over the broker's nodes ([`BrokerNodes::pass`]): the
/// first node that
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
    part: usize,
    publisher_config: PublisherConfig,
    encoder: &Encoder,
) -> Result<(AmqpSink, usize), Error> {
    connect_pass(nodes, part, "RabbitMQ", |i| {
        let mut config = publisher_config.clone();
        config.amqp_url.clone_from(&nodes.urls[i]);
        let encoder = encoder.clone();
        async move { Ok(AmqpSink::connect(&config, encoder).await?) }
    })
    .await
}

/// One connect pass of the stream publisher over the nodes of `--stream-url`, as
/// [`connect_amqp`] makes one over `--amqp-url`'s.
///
/// # Errors
/// As [`connect_amqp`].
async fn connect_stream(
    nodes: &BrokerNodes,
    config: StreamConfig,
    encoder: &Encoder,
) -> Result<(StreamSink, usize), Error> {
    connect_pass(nodes, 0, "the RabbitMQ stream", |i| {
        let mut config = config.clone();
        // The stream publisher takes the text (its StreamConfig's Debug redacts it).
        nodes.urls[i].expose_secret().clone_into(&mut config.url);
        let encoder = encoder.clone();
        async move { Ok(StreamSink::connect(&config, encoder).await?) }
    })
    .await
}

/// The pass itself, for any sink: `connect(i)` tries node `i`; the rules of
/// [`connect_amqp`]. `what` names the destination in the log (`RabbitMQ`, `the RabbitMQ
/// stream`).
async fn connect_pass<S, F, Fut>(
    nodes: &BrokerNodes,
    part: usize,
    what: &str,
    mut connect: F,
) -> Result<(S, usize), Error>
where
    F: FnMut(usize) -> Fut,
    Fut: std::future::Future<Output = Result<S, Error>>,
{
    let total = nodes.urls.len();
    let mut first_retryable: Option<Error> = None;
    let mut first_definite: Option<Error> = None;
    for i in nodes.pass(part) {
        let url = nodes.urls[i].to_string();
        match connect(i).await {
            Ok(sink) => {
                tracing::info!(node = %url, index = i + 1, of = total, "connected to {what}");
                return Ok((sink, i));
            }
            Err(e) => {
                if total > 1 {
                    tracing::warn!(
                        node = %url,
                        index = i + 1,
                        of = total,
                        definite = !e.is_retryable(),
                        error = %crate::error::one_line(&e),
                        "{what} node did not accept the connection; trying the next"
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
        .unwrap_or_else(|| Error::BrokerLost(format!("no {what} node is configured"))))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn nodes(n: usize) -> BrokerNodes {
        BrokerNodes::new((0..n).map(|i| format!("amqp://node{i}").into()).collect())
    }

    #[test]
    fn partitions_start_spread_and_keep_their_own_place() {
        let mut b = nodes(3);
        assert_eq!(b.pass(0), [0, 1, 2]);
        assert_eq!(b.pass(1), [1, 2, 0]);
        assert_eq!(b.pass(4), [1, 2, 0]);
        // A session ended for another reason (Postgres): every partition stays put.
        b.session_ended(&[0, 1, 2, 0], &[false; 4]);
        assert_eq!(b.pass(3), [0, 1, 2]);
        assert_eq!(b.pass(2), [2, 0, 1]);
    }

    /// Issue 31 item 3: the bookkeeping followed partition 0 only, so after node 1 died a
    /// partition that was on node 0 started its next pass at node 1, and one on node 1 was
    /// sent back to it.
    #[test]
    fn a_lost_node_is_tried_last_by_every_partition() {
        let mut b = nodes(3);
        // Six partitions on nodes 0, 1, 2, 0, 1, 2; node 1 dies: partitions 1 and 4 lost.
        let used = [0, 1, 2, 0, 1, 2];
        b.session_ended(&used, &[false, true, false, false, true, false]);
        assert!(b.is_down(1));
        for part in 0..6 {
            let pass = b.pass(part);
            assert_eq!(pass.last(), Some(&1), "partition {part}: {pass:?}");
            assert_ne!(pass[0], 1);
        }
        assert_eq!(b.pass(0)[0], 0, "a partition on a live node stays there");
        assert_eq!(b.pass(1)[0], 2, "a lost partition moves to the next node");
        assert_eq!(b.pass(2)[0], 2);
        // Once a connection to node 1 completes, it is tried in its turn again.
        b.connected(&[1]);
        assert_eq!(b.pass(4), [2, 0, 1]);
        assert_eq!(b.pass(3), [0, 1, 2]);
        // One node: it is still tried, down or not.
        let mut one = nodes(1);
        one.session_ended(&[0], &[true]);
        assert_eq!(one.pass(0), [0]);
    }
}
