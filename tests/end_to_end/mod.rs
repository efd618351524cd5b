//! The main job end to end: producers emit inside transactions, `pgoutbox run` publishes,
//! the queue receives; the slot only moves over confirmed messages.

use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

use lapin::types::AMQPValue;

use crate::support::amqp::HeaderKind;
use crate::support::{self, lsn, scaled, Outbox, Postgres, RabbitMq};

/// Emits `txns` transactions of `per_txn` messages with ids `m-<seq>`; every 10th message
/// is binary (`emit_bytes`, NUL bytes inside). Records each message's expected body.
fn emit_numbered(ob: &Outbox<'_>, first_seq: i64, txns: i64, per_txn: i64) {
    for t in 0..txns {
        let from = first_seq + t * per_txn;
        let to = from + per_txn - 1;
        ob.sql(&format!(
            "BEGIN;
             DO $$ BEGIN FOR n IN {from}..{to} LOOP
               IF n % 10 = 0 THEN
                 PERFORM outbox.emit_bytes('bin.' || n, '\\x00'::bytea || int4send(n::int) || '\\x00ff00'::bytea,
                                          'application/x-test', jsonb_build_object('seq', n), 'm-' || n);
               ELSE
                 PERFORM outbox.emit('num.' || n, jsonb_build_object('seq', n, 'txt', 'é ü \"q\"'),
                                     jsonb_build_object('seq', n), 'm-' || n);
               END IF;
             END LOOP; END $$;
             COMMIT;"
        ));
    }
}

/// The exact body `emit_numbered` wrote for `seq`.
fn expected_body(seq: i64) -> Vec<u8> {
    if seq % 10 == 0 {
        let mut b = vec![0u8];
        b.extend_from_slice(&(seq as i32).to_be_bytes());
        b.extend_from_slice(&[0x00, 0xff, 0x00]);
        b
    } else {
        // jsonb's text form: keys ordered by length then bytes, ", " and ": " separators.
        format!("{{\"seq\": {seq}, \"txt\": \"é ü \\\"q\\\"\"}}").into_bytes()
    }
}

fn seq_of(id: &str) -> i64 {
    id.strip_prefix("m-")
        .and_then(|s| s.parse().ok())
        .expect("m-<seq> id")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ten_thousand_messages_arrive_once_in_commit_order_byte_exact() {
    let pg = Postgres::shared();
    let ob = Outbox::new(pg, &RabbitMq::shared().url(), "e2e_10k").await;
    let before = ob.confirmed_flush();
    emit_numbered(&ob, 1, 100, 100);
    let streamer = ob.run(&[]);
    let got = ob.drain(10_000, scaled(Duration::from_secs(60))).await;
    assert_eq!(got.len(), 10_000, "each message exactly once");
    let mut lsns = std::collections::HashSet::new();
    let mut prev: Option<(u64, u64)> = None;
    for (i, m) in got.iter().enumerate() {
        // Header types: ours are X/Y text and an integer; the producer's `seq` (a JSON
        // integer) stays an integer.
        assert_eq!(m.header_kind("x-pgoutbox-lsn"), Some(HeaderKind::Text));
        assert_eq!(
            m.header_kind("x-pgoutbox-commit-lsn"),
            Some(HeaderKind::Text)
        );
        assert_eq!(
            m.header_kind("x-pgoutbox-commit-time-us"),
            Some(HeaderKind::Int(64))
        );
        assert_eq!(
            m.header_values.get("seq"),
            Some(&AMQPValue::LongLongInt(i as i64 + 1)),
            "the producer's integer header arrives as an integer"
        );
        let id = m.message_id.as_deref().expect("message_id");
        let seq = seq_of(id);
        assert_eq!(seq, i as i64 + 1, "commit order");
        assert_eq!(m.body, expected_body(seq), "payload of {id} byte-exact");
        assert_eq!(m.delivery_mode, Some(2), "persistent");
        assert_eq!(m.exchange, ob.exchange);
        assert_eq!(
            m.headers.get("seq").map(String::as_str),
            Some(seq.to_string().as_str())
        );
        if seq % 10 == 0 {
            assert_eq!(m.routing_key, format!("bin.{seq}"));
            assert_eq!(m.content_type.as_deref(), Some("application/x-test"));
        } else {
            assert_eq!(m.routing_key, format!("num.{seq}"));
            assert_eq!(m.content_type.as_deref(), Some("application/json"));
        }
        let msg_lsn = lsn(&m.headers["x-pgoutbox-lsn"]);
        let commit_lsn = lsn(&m.headers["x-pgoutbox-commit-lsn"]);
        assert!(
            msg_lsn <= commit_lsn,
            "message LSN (end of its record) is at or before its commit"
        );
        assert!(lsns.insert(msg_lsn), "x-pgoutbox-lsn {msg_lsn:X} is unique");
        // 100 messages per transaction: the commit LSN is shared inside one and increases
        // from one transaction to the next; the message LSN increases with emit order.
        if let Some((prev_lsn, prev_commit)) = prev {
            assert!(msg_lsn > prev_lsn, "message LSNs increase in emit order");
            if (seq - 1) % 100 == 0 {
                assert!(
                    commit_lsn > prev_commit,
                    "m-{seq} opens a later transaction: commit LSN {commit_lsn:X} after {prev_commit:X}"
                );
            } else {
                assert_eq!(
                    commit_lsn, prev_commit,
                    "m-{seq} shares its transaction's commit LSN"
                );
            }
        }
        prev = Some((msg_lsn, commit_lsn));
        let ts = m.timestamp.expect("timestamp (s)");
        let us: u64 = m.headers["x-pgoutbox-commit-time-us"].parse().unwrap();
        assert_eq!(
            ts,
            us / 1_000_000,
            "timestamp is the commit time in seconds"
        );
    }
    // The slot moved past everything once confirmed.
    let last_commit = lsn(&got.last().unwrap().headers["x-pgoutbox-commit-lsn"]);
    assert!(
        ob.flushed_past(last_commit, scaled(Duration::from_secs(15)))
            .await,
        "confirmed_flush_lsn moved past the last commit (started at {before:X})"
    );
    streamer.sigterm();
    let status = streamer.wait_exit(scaled(Duration::from_secs(30))).await;
    assert_eq!(
        status.map(|s| s.success()),
        Some(true),
        "SIGTERM exits 0:\n{}",
        streamer.log()
    );
}

/// Producer headers keep their JSON types on the wire (docs/src/reference/envelope.md,
/// docs/src/consumers/message.md): strings, integers, doubles, booleans, void, nested values as JSON text.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn producer_headers_keep_their_types() {
    let pg = Postgres::shared();
    let ob = Outbox::new(pg, &RabbitMq::shared().url(), "e2e_header_types").await;
    let streamer = ob.run(&[]);
    ob.sql(
        r#"SELECT outbox.emit('h', '{}', '{"s": "42", "i": 42, "neg": -7, "f": 1.5, "b": true, "n": null, "o": {"a": 1}, "arr": [1, "x"]}', 'typed')"#,
    );
    let got = ob.drain(1, scaled(Duration::from_secs(20))).await;
    assert_eq!(got.len(), 1, "{}", streamer.log());
    let h = &got[0].header_values;
    assert_eq!(
        h.get("s"),
        Some(&AMQPValue::LongString("42".into())),
        "{h:?}"
    );
    assert_eq!(h.get("i"), Some(&AMQPValue::LongLongInt(42)), "{h:?}");
    assert_eq!(h.get("neg"), Some(&AMQPValue::LongLongInt(-7)), "{h:?}");
    assert_eq!(h.get("f"), Some(&AMQPValue::Double(1.5)), "{h:?}");
    assert_eq!(h.get("b"), Some(&AMQPValue::Boolean(true)), "{h:?}");
    assert_eq!(h.get("n"), Some(&AMQPValue::Void), "{h:?}");
    assert_eq!(got[0].header_kind("o"), Some(HeaderKind::Text), "{h:?}");
    let o: serde_json::Value = serde_json::from_str(&got[0].headers["o"]).unwrap();
    assert_eq!(o, serde_json::json!({"a": 1}));
    assert_eq!(got[0].header_kind("arr"), Some(HeaderKind::Text), "{h:?}");
    let arr: serde_json::Value = serde_json::from_str(&got[0].headers["arr"]).unwrap();
    assert_eq!(arr, serde_json::json!([1, "x"]));
    // Ours, beside them.
    assert_eq!(got[0].header_kind("x-pgoutbox-lsn"), Some(HeaderKind::Text));
    assert_eq!(
        got[0].header_kind("x-pgoutbox-commit-lsn"),
        Some(HeaderKind::Text)
    );
    assert_eq!(
        got[0].header_kind("x-pgoutbox-commit-time-us"),
        Some(HeaderKind::Int(64))
    );
    assert_eq!(h.len(), 8 + 3, "nothing else added: {h:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rolled_back_transactions_and_savepoints_emit_nothing() {
    let pg = Postgres::shared();
    let ob = Outbox::new(pg, &RabbitMq::shared().url(), "e2e_rollback").await;
    // Read coalescing on (1 ms): every other test runs with the default (off).
    let streamer = ob.run(&["--read-coalesce-us", "1000"]);
    ob.sql(
        "BEGIN;
         SELECT outbox.emit('t', '{\"n\": 1}', '{}', 'a1');
         SAVEPOINT s1;
         SELECT outbox.emit('t', '{\"n\": 2}', '{}', 'a2-rolled-back');
         ROLLBACK TO SAVEPOINT s1;
         SELECT outbox.emit('t', '{\"n\": 3}', '{}', 'a3');
         COMMIT;",
    );
    ob.sql("BEGIN; SELECT outbox.emit('t', '{\"n\": 4}', '{}', 'b1-rolled-back'); ROLLBACK;");
    ob.sql("SELECT outbox.emit('t', '{\"n\": 5}', '{}', 'c1');");
    let got = ob.drain(3, scaled(Duration::from_secs(30))).await;
    let ids: Vec<_> = got.iter().map(|m| m.message_id.clone().unwrap()).collect();
    assert_eq!(ids, ["a1", "a3", "c1"]);
    drop(streamer);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_mid_stream_redelivers_with_the_same_ids() {
    let pg = Postgres::shared();
    let ob = Outbox::new(pg, &RabbitMq::shared().url(), "e2e_kill").await;
    let start = ob.confirmed_flush();
    let total = 30_000i64;
    emit_numbered(&ob, 1, 30, 1_000);
    let first = ob.run(&["--max-in-flight", "2000"]);
    // Kill while messages are in flight: some arrived, far from all.
    let reached = support::wait_until(scaled(Duration::from_secs(60)), || async {
        support::queue_len(&ob.amqp_url, &ob.queue).await >= 4_000
    })
    .await;
    assert!(reached, "first run published:\n{}", first.log());
    first.kill9();
    first.wait_exit(Duration::from_secs(10)).await;
    let at_crash = ob.confirmed_flush();
    let in_queue_at_crash = support::queue_len(&ob.amqp_url, &ob.queue).await as i64;
    assert!(in_queue_at_crash < total, "the kill came mid-stream");

    let second = ob.run(&[]);
    let got = ob
        .drain(total as usize, scaled(Duration::from_secs(60)))
        .await;
    let mut by_id: HashMap<String, Vec<&support::Received>> = HashMap::new();
    for m in &got {
        by_id
            .entry(m.message_id.clone().unwrap())
            .or_default()
            .push(m);
    }
    for seq in 1..=total {
        let copies = by_id
            .get(&format!("m-{seq}"))
            .unwrap_or_else(|| panic!("m-{seq} missing"));
        for c in copies {
            assert_eq!(c.body, expected_body(seq), "duplicate of m-{seq} identical");
            assert_eq!(
                c.headers["x-pgoutbox-lsn"],
                copies[0].headers["x-pgoutbox-lsn"]
            );
        }
    }
    assert_eq!(by_id.len(), total as usize, "no message invented");
    let duplicates = got.len() as i64 - total;
    assert!(
        duplicates > 0,
        "a kill with messages in flight must cause redelivery"
    );
    // First deliveries stay in commit order.
    let mut seen = std::collections::HashSet::new();
    let firsts: Vec<i64> = got
        .iter()
        .filter_map(|m| {
            let id = m.message_id.clone().unwrap();
            seen.insert(id.clone()).then(|| seq_of(&id))
        })
        .collect();
    assert!(
        firsts.windows(2).all(|w| w[0] < w[1]),
        "first deliveries in order"
    );
    eprintln!(
        "kill test: {in_queue_at_crash} in queue at the kill, {duplicates} duplicates, slot {start:X} -> {at_crash:X} at the kill"
    );
    assert!(at_crash > start, "the slot advanced before the kill");
    drop(second);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slot_never_passes_a_message_the_broker_did_not_confirm() {
    let pg = Postgres::shared();
    let rmq = RabbitMq::start_private();
    let ob = Outbox::new(pg, &rmq.url(), "e2e_brokerstop").await;
    let start = ob.confirmed_flush();
    let streamer = ob.run(&["--max-in-flight", "500"]);
    // A producer that keeps emitting (one message per transaction) until the broker is gone.
    let pg_url = ob.url();
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let stop_producer = stop.clone();
    let emitted = std::sync::Arc::new(std::sync::atomic::AtomicI64::new(0));
    let emitted_producer = emitted.clone();
    let producer = tokio::spawn(async move {
        let client = Postgres::client_url(&pg_url)
            .await
            .expect("producer connects");
        let mut lsns = BTreeMap::new();
        let mut seq = 0i64;
        while !stop_producer.load(std::sync::atomic::Ordering::SeqCst) && seq < 200_000 {
            seq += 1;
            let row = client
                .query_one(
                    "SELECT (outbox.emit('p', jsonb_build_object('seq', $1::bigint), '{}', 'p-' || $1::bigint) - '0/0'::pg_lsn)::text",
                    &[&seq],
                )
                .await
                .expect("emit");
            let l: String = row.get(0);
            lsns.insert(seq, l.parse::<f64>().unwrap() as u64);
            emitted_producer.store(seq, std::sync::atomic::Ordering::SeqCst);
        }
        lsns
    });
    assert!(
        support::wait_until(scaled(Duration::from_secs(60)), || async {
            support::queue_len(&ob.amqp_url, &ob.queue).await >= 1_000
        })
        .await,
        "messages flow before the broker stops:\n{}",
        streamer.log()
    );
    rmq.stop_app();
    // The streamer notices, keeps the slot where the broker's confirms left it, and retries.
    assert!(
        streamer
            .wait_for_log(
                "session failed; reconnecting",
                scaled(Duration::from_secs(30))
            )
            .await,
        "{}",
        streamer.log()
    );
    assert!(
        streamer.try_status().is_none(),
        "it does not exit on a broker outage"
    );
    // Keep producing a little while the broker is down, then stop.
    let at_exit = emitted.load(std::sync::atomic::Ordering::SeqCst);
    assert!(
        support::wait_until(scaled(Duration::from_secs(30)), || async {
            emitted.load(std::sync::atomic::Ordering::SeqCst) >= at_exit + 200
        })
        .await,
        "the producer kept committing"
    );
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    let lsns = producer.await.unwrap();
    let total = lsns.len();
    // Freeze what it acknowledged: kill it before the broker comes back.
    streamer.kill9();
    streamer.wait_exit(Duration::from_secs(10)).await;
    let flushed = ob.confirmed_flush();
    assert!(
        flushed > start,
        "the slot advanced before the broker stopped"
    );
    rmq.start_app();
    let got = ob.drain(1, scaled(Duration::from_secs(10))).await;
    let arrived: std::collections::HashSet<String> =
        got.iter().filter_map(|m| m.message_id.clone()).collect();
    // Every message at or below the acknowledged LSN is in the (durable) queue.
    let covered: Vec<i64> = lsns
        .iter()
        .filter(|(_, l)| **l < flushed)
        .map(|(s, _)| *s)
        .collect();
    assert!(!covered.is_empty());
    for seq in &covered {
        assert!(
            arrived.contains(&format!("p-{seq}")),
            "p-{seq} is below confirmed_flush_lsn but did not arrive"
        );
    }
    assert!(covered.len() < total, "the broker stopped mid-stream");
    // A restart delivers the rest.
    let again = ob.run(&[]);
    let rest = ob
        .drain(total - arrived.len(), scaled(Duration::from_secs(60)))
        .await;
    let mut all = arrived;
    all.extend(rest.iter().filter_map(|m| m.message_id.clone()));
    for seq in 1..=total as i64 {
        assert!(all.contains(&format!("p-{seq}")), "p-{seq} never arrived");
    }
    drop(again);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_outbox_in_a_busy_database_does_not_hold_wal() {
    let pg = Postgres::shared();
    let ob = Outbox::new(pg, &RabbitMq::shared().url(), "e2e_idle").await;
    let streamer = ob.run(&[]);
    ob.sql("SELECT outbox.emit('one', '{}', '{}', 'only-one')");
    assert_eq!(ob.drain(1, scaled(Duration::from_secs(30))).await.len(), 1);
    // 64 MB of WAL (80 MB written) in a table nobody publishes, no outbox traffic.
    ob.sql("CREATE TABLE junk (x text)");
    // The insert position: with synchronous_commit = off the write position trails it.
    let wal_before = ob.sql("SELECT pg_current_wal_insert_lsn() - '0/0'::pg_lsn");
    for _ in 0..5 {
        ob.sql("INSERT INTO junk SELECT repeat(md5(random()::text), 32) FROM generate_series(1, 16000)");
    }
    let wal_after = ob.sql("SELECT pg_current_wal_insert_lsn() - '0/0'::pg_lsn");
    let written =
        wal_after.trim().parse::<f64>().unwrap() - wal_before.trim().parse::<f64>().unwrap();
    assert!(
        written >= 64.0 * 1024.0 * 1024.0,
        "wrote {written} bytes of WAL"
    );
    let mut last = 0;
    let ok = support::wait_until(scaled(Duration::from_secs(10)), || {
        last = ob.lag_bytes();
        let lag = last;
        async move { lag < 16 * 1024 * 1024 }
    })
    .await;
    let status = ob.cli(&["status", "--json"]);
    let json: serde_json::Value = serde_json::from_slice(&status.stdout).expect("status --json");
    assert!(
        ok,
        "lag stayed at {last} bytes; status: {json}\n{}",
        streamer.log()
    );
    assert!(
        json["lag_bytes"].as_i64().unwrap() < 16 * 1024 * 1024,
        "{json}"
    );
    assert_eq!(json["active"], true);
    assert_eq!(json["slot"], ob.slot.as_str());
}
