//! A throwaway RabbitMQ cluster of the Debian `rabbitmq-server` package: N private nodes
//! (own node names, AMQP and distribution ports, data directories) that share one epmd
//! port and one Erlang cookie, joined with `rabbitmqctl join_cluster` after
//! `stop_app` / `reset`.
//!
//! Kept small for a 2-core machine: one scheduler per VM (`+S 1:1`), no busy-waiting
//! schedulers (`+sbwt none`), the plugins every test node has (`DEFAULT_PLUGINS`: each node
//! has a stream listener of its own, [`RabbitCluster::stream_urls`]), a 32 MiB Ra WAL (the quorum queues' log, held in
//! memory until it is flushed to segments). Boot is bounded: every node must open its
//! port within 60 s (scaled), and every join finish within 60 s.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use lapin::options::{ExchangeDeclareOptions, QueueBindOptions, QueueDeclareOptions};
use lapin::types::{AMQPValue, FieldTable};
use lapin::ExchangeKind;

use super::rabbit::{NodeOptions, RabbitMq};
use super::{amqp_connect, cleanup_now, free_port, make_server_dir, scaled, spawn_watchdog};

/// Erlang VM flags of every cluster node (besides busy-waiting off, which every test node has).
const ERL_ARGS: &str = "+S 1:1";
/// `rabbitmq.conf` lines of every cluster node.
const CONF: &str = "raft.wal_max_size_bytes = 33554432\n\
                    cluster_partition_handling = pause_minority\n\
                    collect_statistics_interval = 60000";

/// N clustered nodes, stopped (with their shared directory) on Drop.
#[derive(Debug)]
pub struct RabbitCluster {
    /// The nodes; `nodes[0]` is the one the others joined.
    pub nodes: Vec<RabbitMq>,
    /// Holds the shared `HOME` (the Erlang cookie) and the epmd cleanup script.
    dir: PathBuf,
    /// How long the boot (start and join) took.
    pub boot_time: Duration,
}

impl RabbitCluster {
    /// Starts `n` nodes in parallel and joins nodes 2..n to node 1.
    pub fn start(n: usize) -> RabbitCluster {
        let t0 = Instant::now();
        let dir = make_server_dir("pgoutbox-rmqc-");
        let home = dir.join("home");
        std::fs::create_dir_all(&home).expect("mkdir home");
        set_mode(&home, 0o700);
        let cookie = home.join(".erlang.cookie");
        std::fs::write(&cookie, format!("PGOUTBOXCLUSTER{}", std::process::id())).expect("cookie");
        set_mode(&cookie, 0o400);
        let epmd_port = free_port();
        std::fs::write(
            dir.join("cleanup.sh"),
            format!(
                "for e in epmd /usr/lib/erlang/bin/epmd; do\n  if command -v \"$e\" >/dev/null 2>&1; then \"$e\" -port {epmd_port} -kill >/dev/null 2>&1; break; fi\ndone\ntrue\n"
            ),
        )
        .expect("cleanup.sh");
        spawn_watchdog(&dir);
        let options = NodeOptions {
            extra_conf: CONF.into(),
            epmd_port: Some(epmd_port),
            home: Some(home),
            extra_erl_args: ERL_ARGS.into(),
            name: Some("pgoutbox-cluster".into()),
            plugins: None,
        };
        let nodes: Vec<RabbitMq> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..n)
                .map(|_| s.spawn(|| RabbitMq::start_node(true, &options, &[])))
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().expect("node start"))
                .collect()
        });
        let booted = t0.elapsed();
        let first = nodes[0].nodename().to_owned();
        for node in &nodes[1..] {
            node.ctl_ok(&["stop_app"]);
            node.ctl_ok(&["reset"]);
            node.ctl_ok(&["join_cluster", &first]);
            node.start_app();
        }
        nodes[0].ctl_ok(&[
            "await_online_nodes",
            &n.to_string(),
            "--timeout",
            &scaled(Duration::from_secs(60)).as_secs().to_string(),
        ]);
        let status = nodes[0].ctl_ok(&["cluster_status", "--formatter", "json"]);
        let status: serde_json::Value = serde_json::from_str(&status).expect("cluster_status json");
        let running = status["running_nodes"].as_array().map_or(0, |a| a.len());
        assert_eq!(running, n, "cluster_status: {status}");
        let boot_time = t0.elapsed();
        eprintln!(
            "[harness] rabbitmq cluster of {n} nodes: booted in {booted:.1?}, joined in {:.1?}, {} MiB RSS",
            boot_time - booted,
            nodes.iter().map(|n| n.memory_kib().0).sum::<u64>() / 1024
        );
        RabbitCluster {
            nodes,
            dir,
            boot_time,
        }
    }

    /// Every node's `amqp://` URL, in node order.
    pub fn urls(&self) -> Vec<String> {
        self.nodes.iter().map(RabbitMq::url).collect()
    }

    /// Every node's `rabbitmq-stream://` URL, in node order.
    pub fn stream_urls(&self) -> Vec<String> {
        self.nodes.iter().map(RabbitMq::stream_url).collect()
    }

    /// Total `(VmRSS, VmHWM)` of the running nodes' Erlang VMs, in KiB.
    pub fn memory_kib(&self) -> (u64, u64) {
        self.nodes
            .iter()
            .map(RabbitMq::memory_kib)
            .fold((0, 0), |(r, h), (nr, nh)| (r + nr, h + nh))
    }

    /// The index of the node whose AMQP port a client connection named `name` (its
    /// `connection_name` client property) is connected to, asked of a running node
    /// (`rabbitmqctl list_connections` lists the whole cluster's).
    pub fn node_of_connection(&self, name: &str) -> Option<usize> {
        // Ask the nodes in turn: a killed node has no VM, a stopped app cannot answer.
        let text = self
            .nodes
            .iter()
            .filter(|n| n.beam_pid().is_some())
            .find_map(|asker| {
                let out = asker.ctl(&[
                    "-q",
                    "list_connections",
                    "client_properties",
                    "port",
                    "--no-table-headers",
                ]);
                out.status
                    .success()
                    .then(|| String::from_utf8_lossy(&out.stdout).into_owned())
            })?;
        // One line per connection: its client properties (connection_name among them),
        // a tab, the server's AMQP port.
        let port: u16 = text.lines().find_map(|l| {
            let (props, p) = l.rsplit_once('\t')?;
            props.contains(name).then(|| p.trim().parse().ok())?
        })?;
        self.nodes.iter().position(|n| n.port() == port)
    }

    /// Whether stopping node `i` would leave a quorum queue without a majority
    /// (`rabbitmq-queues check_if_node_is_quorum_critical` on it fails).
    pub fn is_quorum_critical(&self, i: usize) -> bool {
        !self.nodes[i]
            .queues_cmd(&["check_if_node_is_quorum_critical"])
            .status
            .success()
    }
}

impl Drop for RabbitCluster {
    fn drop(&mut self) {
        self.nodes.clear();
        cleanup_now(&self.dir);
    }
}

/// Declares a durable topic `exchange` and a quorum queue (`x-queue-type: quorum`, one
/// member per node) bound to it with `#`, through `amqp_url`.
pub async fn declare_bound_quorum_queue(amqp_url: &str, exchange: &str, queue: &str) {
    let conn = amqp_connect(amqp_url).await;
    let ch = conn.create_channel().await.expect("channel");
    ch.exchange_declare(
        exchange.into(),
        ExchangeKind::Topic,
        ExchangeDeclareOptions {
            durable: true,
            ..Default::default()
        },
        FieldTable::default(),
    )
    .await
    .expect("exchange_declare");
    let mut args = FieldTable::default();
    args.insert(
        "x-queue-type".into(),
        AMQPValue::LongString("quorum".into()),
    );
    ch.queue_declare(
        queue.into(),
        QueueDeclareOptions {
            durable: true,
            ..Default::default()
        },
        args,
    )
    .await
    .expect("queue_declare quorum");
    ch.queue_bind(
        queue.into(),
        exchange.into(),
        "#".into(),
        QueueBindOptions::default(),
        FieldTable::default(),
    )
    .await
    .expect("queue_bind");
    let _ = conn.close(200, "bye".into()).await;
}

fn set_mode(path: &std::path::Path, mode: u32) {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).expect("chmod");
}

/// Consumes `queue` (basic.consume, prefetch 1,000, acked in batches) until `expected`
/// distinct message ids arrived and 500 ms (scaled) passed without more, or `idle` passed
/// without any message. Returns everything received, duplicates included, in order.
pub async fn consume_queue(
    amqp_url: &str,
    queue: &str,
    expected: usize,
    idle: Duration,
) -> Vec<super::Received> {
    use futures::StreamExt;
    use lapin::options::{BasicAckOptions, BasicConsumeOptions, BasicQosOptions};
    let grace = scaled(Duration::from_millis(500));
    let conn = amqp_connect(amqp_url).await;
    let ch = conn.create_channel().await.expect("channel");
    ch.basic_qos(1000, BasicQosOptions::default())
        .await
        .expect("basic_qos");
    let mut consumer = ch
        .basic_consume(
            queue.into(),
            "pgoutbox-test-drain".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .expect("basic_consume");
    let mut got = Vec::new();
    let mut distinct = std::collections::HashSet::new();
    let mut unacked = 0;
    loop {
        let wait = if distinct.len() >= expected {
            grace
        } else {
            idle
        };
        let next = match tokio::time::timeout(wait, consumer.next()).await {
            Ok(Some(Ok(d))) => d,
            Ok(Some(Err(e))) => panic!("consume {queue}: {e}"),
            Ok(None) => break,
            Err(_) => break,
        };
        if let Some(id) = next.properties.message_id() {
            distinct.insert(id.to_string());
        }
        unacked += 1;
        // Batched acks; once everything expected is here, each one, so the grace period
        // can still deliver extras past the prefetch window.
        if unacked >= 100 || distinct.len() >= expected {
            next.acker
                .ack(BasicAckOptions { multiple: true })
                .await
                .expect("ack");
            unacked = 0;
        }
        got.push(super::amqp::to_received(
            next.exchange.as_str(),
            next.routing_key.as_str(),
            next.redelivered,
            &next.properties,
            next.data,
        ));
    }
    let _ = conn.close(200, "bye".into()).await;
    got
}
