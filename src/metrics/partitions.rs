//! Per-partition metrics of `run --partitions N` (label `partition`, `0` to `N - 1`; a run
//! without `--partitions` has one partition, `0`): publishes made, messages unsettled and the
//! connection's state, one series each per partition connection.
//!
//! The loop writes publishes and unsettled counts once per turn from the sink's parts
//! (`crate::sink::Sink::parts`, read by the pipeline: this module sees plain numbers only);
//! the driver sets the unsettled counts to 0 once a session's connections are closed.
//! `connected` and `blocked` are read from each connection's own flags when a scrape asks
//! (`super::Probe`), so they are true between sessions too. Partition `0` is registered at 0
//! from the start, so a scrape and the generated reference show the families before the
//! first session.

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

use super::counters::base_name;

/// Counter: publishes made on a partition's connection (every attempt), label `partition`.
pub const PARTITION_PUBLISHED_TOTAL: &str = "pgoutbox_partition_published_total";

/// Gauge: publishes accepted by a partition's connection and not yet settled, label
/// `partition`. The sum over partitions is what the window (`--max-in-flight`) bounds.
pub const PARTITION_UNSETTLED_MESSAGES: &str = "pgoutbox_partition_unsettled_messages";

/// Gauge: 1 while a partition's connection is open (blocked or not), 0 once it was lost
/// (the session then ends and every partition reconnects), label `partition`.
pub const PARTITION_CONNECTED: &str = "pgoutbox_partition_connected";

/// Gauge: 1 while RabbitMQ blocks a partition's connection (memory or disk alarm), label
/// `partition`.
pub const PARTITION_BLOCKED: &str = "pgoutbox_partition_blocked";

type ByPartition = [(&'static str, String); 1];

fn label(i: usize) -> ByPartition {
    [("partition", i.to_string())]
}

/// One partition's figures for a turn (its connection's state is read from the connection's
/// own flags when a scrape asks: [`Partitions::set_connection`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PartTurn {
    /// Publishes made on it since the last turn.
    pub published: u64,
    /// Publishes unsettled on it now.
    pub unsettled: u64,
}

/// The per-partition families; clones share the values.
#[derive(Debug, Default)]
pub struct Partitions {
    published: Family<ByPartition, Counter>,
    unsettled: Family<ByPartition, Gauge>,
    connected: Family<ByPartition, Gauge>,
    blocked: Family<ByPartition, Gauge>,
}

impl Partitions {
    /// Registers the families, partition `0` at 0.
    pub fn register(&self, registry: &mut Registry) {
        let _ = self.published.get_or_create(&label(0));
        let _ = self.unsettled.get_or_create(&label(0));
        let _ = self.connected.get_or_create(&label(0));
        let _ = self.blocked.get_or_create(&label(0));
        registry.register(
            base_name(PARTITION_PUBLISHED_TOTAL, "_total"),
            "Publishes made on a partition's connection (every attempt)",
            self.published.clone(),
        );
        registry.register(
            PARTITION_UNSETTLED_MESSAGES,
            "Publishes accepted by a partition's connection and not yet settled",
            self.unsettled.clone(),
        );
        registry.register(
            PARTITION_CONNECTED,
            "1 while a partition's connection is open, 0 once it was lost",
            self.connected.clone(),
        );
        registry.register(
            PARTITION_BLOCKED,
            "1 while RabbitMQ blocks a partition's connection (memory or disk alarm)",
            self.blocked.clone(),
        );
    }

    /// Partition `i`'s figures of one turn.
    pub fn set(&self, i: usize, turn: PartTurn) {
        let at = label(i);
        if turn.published > 0 {
            self.published.get_or_create(&at).inc_by(turn.published);
        }
        self.unsettled
            .get_or_create(&at)
            .set(i64::try_from(turn.unsettled).unwrap_or(i64::MAX));
    }

    /// Partition `i`'s connection state now (from its flags, when a scrape asks).
    pub fn set_connection(&self, i: usize, connected: bool, blocked: bool) {
        let at = label(i);
        self.connected.get_or_create(&at).set(i64::from(connected));
        self.blocked.get_or_create(&at).set(i64::from(blocked));
    }
}
