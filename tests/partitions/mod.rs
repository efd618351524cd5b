//! Issue 18, "Ordered parallelism": `run --partitions N` publishes over N AMQP connections,
//! every message to the partition of its key; each key's messages keep their commit order,
//! nothing is lost when one partition's connection is cut mid-stream, and the standard
//! topology (a consistent-hash exchange hashing `x-pgoutbox-aggregate-id`, one queue per
//! consumer) keeps each key on one queue, in order. The cluster spread (partition i starts
//! at node i) is shown in `cluster::`.

mod fake_broker;

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use lapin::options::{
    ExchangeBindOptions, ExchangeDeclareOptions, QueueBindOptions, QueueDeclareOptions,
};
use lapin::types::{AMQPValue, FieldTable};
use lapin::ExchangeKind;

use crate::support::cli::{pgoutbox, stderr};
use crate::support::{
    self, amqp_connect, drain_queue, scaled, Outbox, Postgres, RabbitMq, Received,
};

/// Emits `txns` transactions of `per_txn` messages each, message `k` (counting from 0 over
/// all) with id `{tag}-{k}` and aggregate `agg-{k % keys}`, except every seventh, which
/// has no aggregate id (keyed by its transaction). The very last message goes in a
/// transaction of its own, so the script's result is its LSN. Returns the ids in commit
/// order and that LSN.
fn emit_keyed(
    ob: &Outbox<'_>,
    tag: &str,
    txns: usize,
    per_txn: usize,
    keys: usize,
) -> (Vec<String>, u64) {
    let total = txns * per_txn;
    let mut ids = Vec::new();
    let mut sql = String::new();
    for k in 0..total {
        if k % per_txn == 0 {
            sql.push_str("BEGIN;\n");
        }
        if k + 1 == total {
            sql.push_str("COMMIT;\n");
        }
        let id = format!("{tag}-{k}");
        let aggregate = if k % 7 == 6 {
            String::new()
        } else {
            format!(", aggregate_id => 'agg-{}'", k % keys)
        };
        sql.push_str(&format!(
            "SELECT outbox.emit('p.{}', '{{\"k\": {k}}}', '{{}}', '{id}'{aggregate});\n",
            k % keys
        ));
        ids.push(id);
        if k % per_txn == per_txn - 1 && k + 1 != total {
            sql.push_str("COMMIT;\n");
        }
    }
    let last = support::lsn(ob.sql(&sql).lines().last().expect("an LSN"));
    (ids, last)
}

/// `X/Y`, as Postgres writes an LSN.
fn lsn_text(lsn: u64) -> String {
    format!("{:X}/{:X}", lsn >> 32, lsn & 0xffff_ffff)
}

/// The key a received message was emitted with: its aggregate, or `txn` when it had none.
fn key_of(m: &Received) -> String {
    m.headers
        .get("x-pgoutbox-aggregate-id")
        .cloned()
        .unwrap_or_else(|| "txn".into())
}

/// For every key, the ids of its first deliveries in the order they arrived, and in the
/// order they were emitted: the two must be equal (per-key commit order).
fn assert_per_key_order(got: &[Received], emitted: &[String], keys: usize) {
    let mut seen = BTreeSet::new();
    let mut arrived: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for m in got {
        let id = m.message_id.clone().expect("message id");
        if seen.insert(id.clone()) && key_of(m) != "txn" {
            arrived.entry(key_of(m)).or_default().push(id);
        }
    }
    let mut want: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for (k, id) in emitted.iter().enumerate() {
        if k % 7 != 6 {
            want.entry(format!("agg-{}", k % keys))
                .or_default()
                .push(id.clone());
        }
    }
    assert_eq!(arrived, want, "per-key order of first deliveries");
}

/// The client-provided names of the broker's connections whose name contains `needle`.
fn connection_names(rmq: &RabbitMq, needle: &str) -> Vec<String> {
    rmq.ctl_ok(&[
        "-q",
        "list_connections",
        "client_properties",
        "--no-table-headers",
    ])
    .lines()
    .filter_map(|l| {
        let at = l.find(needle)?;
        let rest = &l[at..];
        Some(rest[..rest.find('"').unwrap_or(rest.len())].to_owned())
    })
    .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_key_keeps_its_commit_order_over_four_connections() {
    let pg = Postgres::shared();
    let rmq = RabbitMq::shared();
    let ob = Outbox::new(pg, &rmq.url(), "part_order").await;
    let instance = support::unique("part-order");
    let streamer = ob.run(&["--partitions", "4", "--instance-id", &instance]);
    let (ids, last) = emit_keyed(&ob, "o", 40, 10, 12);
    let got = ob.drain(ids.len(), scaled(Duration::from_secs(60))).await;
    let distinct: BTreeSet<_> = got.iter().filter_map(|m| m.message_id.clone()).collect();
    assert_eq!(
        distinct,
        ids.iter().cloned().collect(),
        "{}",
        streamer.log()
    );
    assert_eq!(got.len(), ids.len(), "no fault, so no copy");
    assert_per_key_order(&got, &ids, 12);
    assert!(
        ob.flushed_past(last, scaled(Duration::from_secs(30))).await,
        "the slot passes the last message:\n{}",
        streamer.log()
    );
    // Each partition's lines name it: its connect line is in span `partition`.
    let log = streamer.log();
    for i in 0..4 {
        assert!(
            log.lines()
                .any(|l| l.contains(&format!("partition{{partition={i}}}"))
                    && l.contains("connected to RabbitMQ")),
            "partition {i}'s connect line names it:\n{log}"
        );
    }
    // Four connections, one per partition, named after it.
    let mut names = connection_names(rmq, &format!("pgoutbox {instance} partition"));
    names.sort();
    assert_eq!(
        names,
        (0..4)
            .map(|i| format!("pgoutbox {instance} partition {i}/4"))
            .collect::<Vec<_>>()
    );
    streamer.stop_ok(scaled(Duration::from_secs(30))).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_partition_losing_its_connection_loses_nothing_and_reorders_no_key() {
    let pg = Postgres::shared();
    let rmq = RabbitMq::start_private();
    let ob = Outbox::new(pg, &rmq.url(), "part_cut").await;
    let instance = support::unique("part-cut");
    let streamer = ob.run(&["--partitions", "3", "--instance-id", &instance]);
    assert!(
        support::wait_until(scaled(Duration::from_secs(30)), || async {
            connection_names(&rmq, &instance).len() == 3
        })
        .await,
        "three partitions connect:\n{}",
        streamer.log()
    );
    // Hold confirms back (the memory alarm), so partition 1 has publishes in flight when
    // its connection is closed.
    rmq.block();
    let (ids, last) = emit_keyed(&ob, "c", 30, 10, 9);
    let sent_all = format!(
        "SELECT count(*) FROM pg_stat_replication r JOIN pg_replication_slots s \
         ON s.active_pid = r.pid WHERE s.slot_name = '{}' AND r.sent_lsn >= '{}'",
        ob.slot,
        lsn_text(last)
    );
    assert!(
        support::wait_until(scaled(Duration::from_secs(30)), || async {
            ob.sql(&sent_all).trim() != "0"
        })
        .await,
        "the walsender sent the backlog"
    );
    let line = rmq
        .ctl_ok(&[
            "-q",
            "list_connections",
            "pid",
            "client_properties",
            "--no-table-headers",
        ])
        .lines()
        .find(|l| l.contains(&format!("pgoutbox {instance} partition 1/3")))
        .map(str::to_owned)
        .expect("partition 1's connection");
    let pid = line.split('\t').next().expect("pid").trim().to_owned();
    rmq.ctl_ok(&["close_connection", &pid, "closed by the partitions test"]);
    assert!(
        streamer
            .wait_for_log("partition 1: ", scaled(Duration::from_secs(30)))
            .await,
        "the loss is reported with its partition:\n{}",
        streamer.log()
    );
    rmq.unblock();
    let got = ob.drain(ids.len(), scaled(Duration::from_secs(90))).await;
    let distinct: BTreeSet<_> = got.iter().filter_map(|m| m.message_id.clone()).collect();
    assert_eq!(
        distinct,
        ids.iter().cloned().collect(),
        "nothing lost:\n{}",
        streamer.log()
    );
    assert_per_key_order(&got, &ids, 9);
    assert!(
        ob.flushed_past(last, scaled(Duration::from_secs(30))).await,
        "{}",
        streamer.log()
    );
}

/// The standard partitioned topology: the outbox exchange (topic, durable), bound with `#` to a
/// consistent-hash exchange `hash` hashing `x-pgoutbox-aggregate-id`, bound to each of
/// `queues` (durable) with weight 1.
async fn declare_hash_topology(url: &str, exchange: &str, hash: &str, queues: &[String]) {
    let conn = amqp_connect(url).await;
    let ch = conn.create_channel().await.expect("channel");
    let durable = ExchangeDeclareOptions {
        durable: true,
        ..Default::default()
    };
    ch.exchange_declare(
        exchange.into(),
        ExchangeKind::Topic,
        durable,
        FieldTable::default(),
    )
    .await
    .expect("outbox exchange");
    let mut args = FieldTable::default();
    args.insert(
        "hash-header".into(),
        AMQPValue::LongString("x-pgoutbox-aggregate-id".into()),
    );
    ch.exchange_declare(
        hash.into(),
        ExchangeKind::Custom("x-consistent-hash".into()),
        durable,
        args,
    )
    .await
    .expect("x-consistent-hash exchange (plugin rabbitmq_consistent_hash_exchange)");
    ch.exchange_bind(
        hash.into(),
        exchange.into(),
        "#".into(),
        ExchangeBindOptions::default(),
        FieldTable::default(),
    )
    .await
    .expect("bind");
    for q in queues {
        ch.queue_declare(
            q.as_str().into(),
            QueueDeclareOptions {
                durable: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await
        .expect("queue");
        // The binding key of a consistent-hash exchange is the queue's weight.
        ch.queue_bind(
            q.as_str().into(),
            hash.into(),
            "1".into(),
            QueueBindOptions::default(),
            FieldTable::default(),
        )
        .await
        .expect("queue bind");
    }
    let _ = conn.close(200, "declared".into()).await;
}

/// The standard topology: the outbox exchange bound to a consistent-hash exchange that
/// hashes `x-pgoutbox-aggregate-id`, bound to four queues (one consumer each). Every key
/// lands on one queue, in commit order, in both `--publish-properties` shapes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_consistent_hash_topology_keeps_each_key_on_one_queue_in_order() {
    let pg = Postgres::shared();
    let rmq = RabbitMq::shared();
    for shape in ["full", "minimal"] {
        let ob = Outbox::new_without_queue(pg, &rmq.url(), &format!("part_hash_{shape}")).await;
        let hash = support::unique("part_hash_x");
        let queues: Vec<String> = (0..4).map(|i| format!("{}_{i}", ob.queue)).collect();
        declare_hash_topology(&rmq.url(), &ob.exchange, &hash, &queues).await;
        let streamer = ob.run(&["--partitions", "4", "--publish-properties", shape]);
        // Every message keyed here: the keyless ones would all hash alike (no header).
        let mut ids = Vec::new();
        let mut sql = String::new();
        for k in 0..240 {
            let id = format!("h-{shape}-{k}");
            sql.push_str(&format!(
                "SELECT outbox.emit('h', '{{}}', '{{}}', '{id}', aggregate_id => 'agg-{}');\n",
                k % 16
            ));
            ids.push(id);
        }
        // The script's result is the last message's LSN; once the slot passed it, every
        // message was confirmed as routed, so each queue holds all it will get.
        let last = support::lsn(ob.sql(&sql).lines().last().expect("an LSN"));
        assert!(
            ob.flushed_past(last, scaled(Duration::from_secs(60))).await,
            "{shape}: {}",
            streamer.log()
        );
        let mut where_is: BTreeMap<String, BTreeSet<usize>> = BTreeMap::new();
        let mut arrived: BTreeMap<String, Vec<String>> = BTreeMap::new();
        let mut total = 0;
        let mut used = 0;
        for (i, q) in queues.iter().enumerate() {
            // Each queue is drained until it stays idle: the others hold the rest.
            let got = drain_queue(&rmq.url(), q, ids.len(), Duration::from_secs(1)).await;
            used += usize::from(!got.is_empty());
            total += got.len();
            for m in got {
                let key = m
                    .headers
                    .get("x-pgoutbox-aggregate-id")
                    .cloned()
                    .unwrap_or_else(|| panic!("{shape}: no aggregate header: {m:?}"));
                where_is.entry(key.clone()).or_default().insert(i);
                arrived
                    .entry(key)
                    .or_default()
                    .push(m.message_id.clone().unwrap());
            }
        }
        assert_eq!(
            total,
            ids.len(),
            "{shape}: every message on exactly one queue\n{}",
            streamer.log()
        );
        assert!(
            used >= 2,
            "{shape}: 16 keys over 4 queues use more than one"
        );
        for (key, on) in &where_is {
            assert_eq!(on.len(), 1, "{shape}: {key} on queues {on:?}");
        }
        for (key, got) in &arrived {
            let k: usize = key.trim_start_matches("agg-").parse().unwrap();
            let want: Vec<String> = (0..240)
                .filter(|n| n % 16 == k)
                .map(|n| format!("h-{shape}-{n}"))
                .collect();
            assert_eq!(got, &want, "{shape}: {key} in commit order");
        }
        streamer.stop_ok(scaled(Duration::from_secs(30))).await;
    }
}

#[test]
fn partitions_out_of_range_are_refused_naming_the_setting() {
    for bad in ["0", "65", "-1", "four"] {
        let out = pgoutbox(&[
            "run",
            "--database-url",
            "postgres://u@127.0.0.1:1/db",
            "--amqp-url",
            "amqp://g:g@127.0.0.1:1/%2f",
            &format!("--partitions={bad}"),
        ]);
        let err = stderr(&out);
        assert_eq!(out.status.code(), Some(2), "--partitions {bad}: {err}");
        assert!(err.contains("--partitions"), "--partitions {bad}: {err}");
    }
}

/// One producer of [`twenty_thousand_events_keep_each_aggregates_order_through_a_kill_and_a_broker_restart`]:
/// `txns` transactions, each taking the row lock of one aggregate (`agg.v`, so versions
/// follow commit order per aggregate) and emitting its next two versions, ids
/// `e-{aggregate}-{version}`.
async fn versioned_producer(url: String, p: u64, txns: usize, aggregates: u64) {
    let mut client = support::Postgres::client_url(&url).await.expect("producer");
    let mut rng = p.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    for _ in 0..txns {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        let a = (rng % aggregates) as i32;
        let tx = client.transaction().await.expect("begin");
        let v: i32 = tx
            .query_one("UPDATE agg SET v = v + 2 WHERE id = $1 RETURNING v", &[&a])
            .await
            .expect("version")
            .get(0);
        for version in [v - 1, v] {
            tx.execute(
                "SELECT outbox.emit('agg.' || $1::int, jsonb_build_object('a', $1::int, 'v', $2::int), '{}', \
                 'e-' || $1::int || '-' || $2::int, aggregate_id => 'agg-' || $1::int)",
                &[&a, &version],
            )
            .await
            .expect("emit");
        }
        tx.commit().await.expect("commit");
    }
}

/// Everything in the six queues now (each drained until it stays idle), with the queue's
/// index, appended to `got` in queue order.
async fn take_all(url: &str, queues: &[String], got: &mut Vec<(usize, Received)>) {
    for (i, q) in queues.iter().enumerate() {
        for m in drain_queue(url, q, 0, Duration::from_millis(300)).await {
            got.push((i, m));
        }
    }
}

/// Issue 18's test on real RabbitMQ: 4 partitions, 6 hash queues, 20,000 events over 400
/// aggregates from 4 concurrent producers whose aggregate versions follow commit order, a
/// SIGKILL landed while confirmed deliveries lay past the slot, and a broker restart: nothing
/// lost, none invented, each aggregate on one queue, first arrivals in version order (0
/// inversions), duplicates counted (and present: the kill re-sends).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn twenty_thousand_events_keep_each_aggregates_order_through_a_kill_and_a_broker_restart() {
    const AGGREGATES: u64 = 400;
    const PRODUCERS: u64 = 4;
    const TXNS: usize = 2_500; // two events each: 20,000 in all
    let pg = Postgres::shared();
    let rmq = RabbitMq::start_private();
    let url = rmq.url();
    let ob = Outbox::new_without_queue(pg, &url, "part_big").await;
    let hash = support::unique("part_big_hash");
    let queues: Vec<String> = (0..6).map(|i| format!("{}_{i}", ob.queue)).collect();
    declare_hash_topology(&url, &ob.exchange, &hash, &queues).await;
    ob.sql(&format!(
        "CREATE TABLE agg (id int PRIMARY KEY, v int NOT NULL DEFAULT 0); \
         INSERT INTO agg (id) SELECT generate_series(0, {})",
        AGGREGATES - 1
    ));
    let args = ["--partitions", "4", "--max-in-flight", "2000"];
    let mut streamer = ob.run(&args);
    let producers: Vec<_> = (0..PRODUCERS)
        .map(|p| tokio::spawn(versioned_producer(ob.url(), p + 1, TXNS, AGGREGATES)))
        .collect();
    let total = (PRODUCERS as usize) * TXNS * 2;
    let mut got: Vec<(usize, Received)> = Vec::new();

    // The kill, once about a third has arrived: freeze the streamer, read the slot, take the
    // queues; when something taken lies past the slot (confirmed by the broker, not yet
    // acknowledged to Postgres), kill it, else let it run and try again.
    assert!(
        support::wait_until(scaled(Duration::from_secs(120)), || async {
            let mut n = 0;
            for q in &queues {
                n += support::queue_len(&url, q).await;
            }
            n as usize >= total / 3
        })
        .await,
        "a third arrives:\n{}",
        streamer.log()
    );
    let mut past = 0;
    for _ in 0..40 {
        streamer.signal("STOP");
        let at = ob.confirmed_flush();
        let from = got.len();
        take_all(&url, &queues, &mut got).await;
        past = got[from..]
            .iter()
            .filter(|(_, m)| support::lsn(&m.headers["x-pgoutbox-lsn"]) >= at)
            .count();
        if past > 0 {
            break;
        }
        streamer.signal("CONT");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(
        past > 0,
        "the kill landed with confirmed deliveries past the slot"
    );
    streamer.kill9();
    streamer.wait_exit(Duration::from_secs(10)).await;
    let killed_at = got.len();
    streamer = ob.run(&args);

    // The broker restart, once two thirds were emitted: every partition reconnects.
    assert!(
        support::wait_until(scaled(Duration::from_secs(120)), || async {
            ob.sql("SELECT sum(v) FROM agg")
                .trim()
                .parse::<usize>()
                .unwrap_or(0)
                >= 2 * total / 3
        })
        .await,
        "the producers get two thirds in:\n{}",
        streamer.log()
    );
    let before = streamer.log_count("session failed; reconnecting");
    rmq.stop_app();
    rmq.start_app();
    assert!(
        support::wait_until(scaled(Duration::from_secs(60)), || async {
            streamer.log_count("session failed; reconnecting") > before
        })
        .await,
        "the broker restart ended the session:\n{}",
        streamer.log()
    );
    for p in producers {
        p.await.expect("producer");
    }
    assert!(
        ob.settled_through_now(scaled(Duration::from_secs(180)))
            .await,
        "the slot passes every event:\n{}",
        streamer.log()
    );
    take_all(&url, &queues, &mut got).await;
    streamer.stop_ok(scaled(Duration::from_secs(30))).await;

    // The audit.
    let want: BTreeSet<String> = ob
        .sql("SELECT string_agg('e-' || id || '-' || g, ',') FROM agg, generate_series(1, v) g")
        .trim()
        .split(',')
        .filter(|s| !s.is_empty())
        .map(str::to_owned)
        .collect();
    assert_eq!(want.len(), total, "the producers committed every event");
    let distinct: BTreeSet<String> = got
        .iter()
        .filter_map(|(_, m)| m.message_id.clone())
        .collect();
    let lost: Vec<_> = want.difference(&distinct).take(10).collect();
    let invented: Vec<_> = distinct.difference(&want).take(10).collect();
    assert!(lost.is_empty(), "lost, e.g. {lost:?}");
    assert!(invented.is_empty(), "invented, e.g. {invented:?}");
    let duplicates = got.len() - distinct.len();
    let mut queue_of: BTreeMap<String, BTreeSet<usize>> = BTreeMap::new();
    let mut last_version: BTreeMap<String, i64> = BTreeMap::new();
    let mut seen = BTreeSet::new();
    let mut inversions = 0;
    // Queue order: each queue's messages in the order taken (before the kill, then after).
    for q in 0..queues.len() {
        for (_, m) in got.iter().filter(|(i, _)| *i == q) {
            let key = key_of(m);
            queue_of.entry(key.clone()).or_default().insert(q);
            let id = m.message_id.clone().expect("id");
            if seen.insert(id) {
                let v = m.body_json()["v"].as_i64().expect("v");
                let prev = last_version.insert(key, v);
                if prev.is_some_and(|p| p >= v) {
                    inversions += 1;
                }
            }
        }
    }
    let spread: Vec<_> = queue_of
        .iter()
        .filter(|(_, on)| on.len() != 1)
        .take(5)
        .collect();
    assert!(
        spread.is_empty(),
        "aggregates on more than one queue: {spread:?}"
    );
    assert_eq!(
        queue_of.len() as u64,
        AGGREGATES,
        "every aggregate was written"
    );
    let used = queue_of.values().flatten().collect::<BTreeSet<_>>().len();
    eprintln!(
        "partitions: {total} events over {AGGREGATES} aggregates, {} deliveries ({duplicates} duplicates, {} taken before the kill with {past} past the slot), {used} of 6 queues used, first-arrival inversions {inversions}",
        got.len(),
        killed_at
    );
    assert_eq!(
        inversions, 0,
        "first arrivals per aggregate in version order"
    );
    assert!(
        duplicates > 0,
        "the kill re-sent what the slot had not passed"
    );
    assert!(used >= 4, "400 aggregates spread over the queues: {used}");
}
