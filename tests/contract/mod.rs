//! The event contract (issue 9, core part): envelope version 3, the named arguments of
//! `outbox.emit` and their AMQP mapping, idempotent emit, W3C trace context, and the dead
//! letter of an unknown envelope version.
//!
//! One database per test on the shared Postgres and RabbitMQ. What arrives is read with
//! lapin's `basic_get`, keeping every AMQP property (the shared `Received` keeps only some).

use std::time::{Duration, Instant};

use lapin::options::{BasicAckOptions, BasicGetOptions};
use lapin::types::AMQPValue;
use lapin::BasicProperties;

use crate::support::{amqp_connect, scaled, Outbox, Postgres, RabbitMq};

const TRACEPARENT: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
const TRACESTATE: &str = "rojo=00f067aa0ba902b7,congo=t61rcWkgMzE";

/// One message as taken from the queue, with all its properties.
struct Got {
    properties: BasicProperties,
    routing_key: String,
    body: Vec<u8>,
}

impl Got {
    fn id(&self) -> String {
        self.properties
            .message_id()
            .as_ref()
            .map(|s| s.as_str().to_owned())
            .unwrap_or_default()
    }

    fn header(&self, key: &str) -> Option<AMQPValue> {
        self.properties
            .headers()
            .as_ref()
            .and_then(|h| h.inner().get(key).cloned())
    }

    fn text(&self, key: &str) -> Option<String> {
        match self.header(key)? {
            AMQPValue::LongString(s) => Some(String::from_utf8_lossy(s.as_bytes()).into_owned()),
            AMQPValue::ShortString(s) => Some(s.as_str().to_owned()),
            other => panic!("header {key} is not text: {other:?}"),
        }
    }
}

/// Takes messages from `queue` until `expected` arrived and nothing more came for a grace
/// period, or until `timeout` passed without a new one.
async fn take(amqp_url: &str, queue: &str, expected: usize, timeout: Duration) -> Vec<Got> {
    let conn = amqp_connect(amqp_url).await;
    let ch = conn.create_channel().await.expect("channel");
    let grace = scaled(Duration::from_millis(500));
    let mut got = Vec::new();
    let mut last = Instant::now();
    loop {
        match ch
            .basic_get(queue.into(), BasicGetOptions::default())
            .await
            .expect("basic_get")
        {
            Some(m) => {
                let d = m.delivery;
                d.ack(BasicAckOptions::default()).await.expect("ack");
                got.push(Got {
                    properties: d.properties.clone(),
                    routing_key: d.routing_key.as_str().to_owned(),
                    body: d.data,
                });
                last = Instant::now();
            }
            None => {
                if (got.len() >= expected && last.elapsed() >= grace) || last.elapsed() >= timeout {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
    let _ = conn.close(200, "bye".into()).await;
    got
}

/// SQLSTATE, message and hint of a failed statement.
async fn sql_error(client: &tokio_postgres::Client, sql: &str) -> (String, String, String) {
    let e = client
        .batch_execute(sql)
        .await
        .expect_err(&format!("{sql} succeeded"));
    let db = e.as_db_error().unwrap_or_else(|| panic!("{sql}: {e}"));
    (
        db.code().code().to_owned(),
        db.message().to_owned(),
        db.hint().unwrap_or_default().to_owned(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_metadata_field_reaches_the_amqp_message() {
    let pg = Postgres::shared();
    let ob = Outbox::new(pg, &RabbitMq::shared().url(), "ct_meta").await;
    ob.sql(&format!(
        "SELECT outbox.emit('orders.created', '{{\"order\": 42}}', '{{\"k\": \"v\"}}', 'full-1',
            exchange => '{exchange}', correlation_id => 'corr-1', causation_id => 'cause-0',
            aggregate_type => 'order', aggregate_id => '42', aggregate_version => 7,
            tenant => 'acme', expiration => 600000, priority => 5,
            traceparent => '{TRACEPARENT}', tracestate => '{TRACESTATE}',
            idempotency_key => 'create-42')",
        exchange = ob.exchange
    ));
    // (An expiration of 0 would drop it at once: no consumer is waiting on the queue.)
    ob.sql(
        "SELECT outbox.emit_bytes('orders.bin', '\\x00ff'::bytea, 'application/x-raw',
            message_id => 'bytes-1', priority => 0, expiration => 3600000, aggregate_version => 0)",
    );
    // The calls of envelope version 2 keep working.
    ob.sql("SELECT outbox.emit('orders.plain', '{}')");
    ob.sql("SELECT outbox.emit('orders.old', '{}', '{\"h\": 1}', 'old-1')");
    let version = ob.sql("SELECT get_byte(outbox._envelope('t', '', 'c', '{}', 'i'), 0)");
    assert_eq!(version.trim(), "3", "the helpers write envelope version 3");

    let _streamer = ob.run(&[]);
    let got = take(&ob.amqp_url, &ob.queue, 4, scaled(Duration::from_secs(20))).await;
    assert_eq!(
        got.len(),
        4,
        "{:?}",
        got.iter().map(Got::id).collect::<Vec<_>>()
    );

    let full = &got[0];
    let p = &full.properties;
    assert_eq!(full.id(), "full-1");
    assert_eq!(full.routing_key, "orders.created");
    assert_eq!(full.body, b"{\"order\": 42}");
    assert_eq!(
        p.correlation_id().as_ref().map(|s| s.as_str()),
        Some("corr-1")
    );
    assert_eq!(p.expiration().as_ref().map(|s| s.as_str()), Some("600000"));
    assert_eq!(*p.priority(), Some(5));
    assert_eq!(
        p.kind().as_ref().map(|s| s.as_str()),
        Some("orders.created")
    );
    assert_eq!(
        full.text("x-pgoutbox-causation-id").as_deref(),
        Some("cause-0")
    );
    assert_eq!(
        full.text("x-pgoutbox-aggregate-type").as_deref(),
        Some("order")
    );
    assert_eq!(full.text("x-pgoutbox-aggregate-id").as_deref(), Some("42"));
    assert_eq!(
        full.header("x-pgoutbox-aggregate-version"),
        Some(AMQPValue::LongLongInt(7))
    );
    assert_eq!(full.text("x-pgoutbox-tenant").as_deref(), Some("acme"));
    assert_eq!(
        full.text("x-pgoutbox-idempotency-key").as_deref(),
        Some("create-42")
    );
    assert_eq!(full.text("traceparent").as_deref(), Some(TRACEPARENT));
    assert_eq!(full.text("tracestate").as_deref(), Some(TRACESTATE));
    assert_eq!(full.text("k").as_deref(), Some("v"));
    assert!(full.header("x-pgoutbox-lsn").is_some());

    let bytes = &got[1];
    assert_eq!(bytes.id(), "bytes-1");
    assert_eq!(bytes.body, b"\x00\xff");
    assert_eq!(*bytes.properties.priority(), Some(0));
    assert_eq!(
        bytes.properties.expiration().as_ref().map(|s| s.as_str()),
        Some("3600000")
    );
    assert_eq!(
        bytes.header("x-pgoutbox-aggregate-version"),
        Some(AMQPValue::LongLongInt(0))
    );
    assert!(bytes.properties.correlation_id().is_none());

    // Without metadata: none of it, only type = topic.
    for plain in &got[2..] {
        let p = &plain.properties;
        assert!(
            p.correlation_id().is_none() && p.expiration().is_none() && p.priority().is_none(),
            "{p:?}"
        );
        assert_eq!(
            p.kind().as_ref().map(|s| s.as_str()),
            Some(plain.routing_key.as_str())
        );
        for key in [
            "x-pgoutbox-causation-id",
            "x-pgoutbox-aggregate-type",
            "x-pgoutbox-aggregate-id",
            "x-pgoutbox-aggregate-version",
            "x-pgoutbox-tenant",
            "x-pgoutbox-idempotency-key",
            "traceparent",
            "tracestate",
        ] {
            assert!(plain.header(key).is_none(), "{key} on {}", plain.id());
        }
    }
    assert_eq!(got[3].id(), "old-1");
    assert_eq!(got[3].header("h"), Some(AMQPValue::LongLongInt(1)));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_metadata_is_refused_at_emit_naming_the_argument() {
    let pg = Postgres::shared();
    let ob = Outbox::new_without_queue(pg, &RabbitMq::shared().url(), "ct_bad").await;
    let client = pg.client(&ob.db).await;
    let long = "x".repeat(256);
    let cases: Vec<(String, &str)> = vec![
        ("exchange => ''".into(), "argument exchange"),
        (
            format!("correlation_id => '{long}'"),
            "argument correlation_id",
        ),
        ("causation_id => ''".into(), "argument causation_id"),
        (
            format!("aggregate_type => '{long}'"),
            "argument aggregate_type",
        ),
        ("aggregate_id => ''".into(), "argument aggregate_id"),
        (
            "aggregate_version => -1".into(),
            "argument aggregate_version",
        ),
        ("tenant => ''".into(), "argument tenant"),
        ("expiration => -1".into(), "argument expiration"),
        ("expiration => 4294967296".into(), "argument expiration"),
        ("priority => 10".into(), "argument priority"),
        ("priority => -1".into(), "argument priority"),
        (
            "traceparent => '00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7'".into(),
            "argument traceparent",
        ),
        (
            format!("traceparent => '{TRACEPARENT}', tracestate => 'Rojo=1'"),
            "argument tracestate",
        ),
        ("tracestate => 'rojo=1'".into(), "argument tracestate"),
        (
            format!("idempotency_key => '{long}'"),
            "argument idempotency_key",
        ),
        (
            "idempotency_key => 'k', on_duplicate => 'ignore'".into(),
            "argument on_duplicate",
        ),
    ];
    for (args, named) in &cases {
        for call in [
            format!("SELECT outbox.emit('t', '{{}}', {args})"),
            format!("SELECT outbox.emit_bytes('t', '\\x00'::bytea, {args})"),
        ] {
            let (code, message, hint) = sql_error(&client, &call).await;
            assert_eq!(code, "22023", "{call}: {message}");
            assert!(message.contains(named), "{call}: {message}");
            assert!(!hint.is_empty(), "{call}: no hint");
        }
    }
    // Nothing was recorded for the refused key.
    assert_eq!(
        ob.sql("SELECT count(*) FROM outbox.idempotency").trim(),
        "0"
    );
    // At the limits: accepted.
    let max = "k".repeat(255);
    ob.sql(&format!(
        "BEGIN; SELECT outbox.emit('t', '{{}}', correlation_id => '{max}', tenant => '{max}',
             idempotency_key => '{max}', expiration => 4294967295, priority => 9,
             aggregate_version => 9223372036854775807); ROLLBACK"
    ));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idempotent_emit_gives_one_event_per_key_and_tenant() {
    let pg = Postgres::shared();
    let ob = Outbox::new(pg, &RabbitMq::shared().url(), "ct_idem").await;
    let a = pg.client(&ob.db).await;
    let b = pg.client(&ob.db).await;
    let watcher = pg.client(&ob.db).await;
    let b_pid: i32 = b
        .query_one("SELECT pg_backend_pid()", &[])
        .await
        .unwrap()
        .get(0);

    // Two transactions with the same key at once: the second waits on the first.
    a.batch_execute(
        "BEGIN; SELECT outbox.emit('idem.t', '{\"by\": \"a\"}', message_id => 'from-a',
             idempotency_key => 'order-42')",
    )
    .await
    .unwrap();
    let second = tokio::spawn(async move {
        let r = b
            .batch_execute(
                "BEGIN; SELECT outbox.emit('idem.t', '{\"by\": \"b\"}', message_id => 'from-b',
                     idempotency_key => 'order-42')",
            )
            .await;
        let _ = b.batch_execute("ROLLBACK").await;
        r
    });
    let deadline = Instant::now() + scaled(Duration::from_secs(10));
    loop {
        let waiting: Option<String> = watcher
            .query_one(
                "SELECT wait_event_type FROM pg_stat_activity WHERE pid = $1",
                &[&b_pid],
            )
            .await
            .unwrap()
            .get(0);
        if waiting.as_deref() == Some("Lock") {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the second emit never waited on the first"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(!second.is_finished(), "the second emit did not wait");
    a.batch_execute("COMMIT").await.unwrap();
    let err = second
        .await
        .unwrap()
        .expect_err("the second emit of the key succeeded");
    let db = err.as_db_error().expect("a database error");
    assert_eq!(db.code().code(), "23505", "{}", db.message());
    assert!(
        db.message().contains("'order-42'") && db.message().contains("no tenant"),
        "{}",
        db.message()
    );

    // skip: NULL, nothing emitted, nothing recorded.
    let skipped = ob.sql(
        "SELECT coalesce(outbox.emit('idem.t', '{}', message_id => 'skipped',
             idempotency_key => 'order-42', on_duplicate => 'skip')::text, 'NULL')",
    );
    assert_eq!(skipped.trim(), "NULL");
    // raise, sequentially: the caller's transaction rolls back.
    let (code, message, _) = sql_error(
        &watcher,
        "SELECT outbox.emit('idem.t', '{}', message_id => 'raised', idempotency_key => 'order-42')",
    )
    .await;
    assert_eq!(code, "23505", "{message}");
    // The same key under two tenants: both emit.
    for tenant in ["acme", "globex"] {
        ob.sql(&format!(
            "SELECT outbox.emit('idem.t', '{{}}', message_id => 'tenant-{tenant}',
                 tenant => '{tenant}', idempotency_key => 'order-42')"
        ));
    }
    let (code, message, _) = sql_error(
        &watcher,
        "SELECT outbox.emit('idem.t', '{}', tenant => 'acme', idempotency_key => 'order-42')",
    )
    .await;
    assert_eq!(code, "23505", "{message}");
    assert!(message.contains("'acme'"), "{message}");
    assert_eq!(
        ob.sql("SELECT tenant || ':' || idempotency_key || ':' || message_id FROM outbox.idempotency ORDER BY tenant"),
        ":order-42:from-a\nacme:order-42:tenant-acme\nglobex:order-42:tenant-globex\n"
    );

    let _streamer = ob.run(&[]);
    let got = take(&ob.amqp_url, &ob.queue, 3, scaled(Duration::from_secs(20))).await;
    let ids: Vec<String> = got.iter().map(Got::id).collect();
    assert_eq!(ids, ["from-a", "tenant-acme", "tenant-globex"]);
    assert_eq!(got[0].body, b"{\"by\": \"a\"}");
    assert_eq!(
        got[0].text("x-pgoutbox-idempotency-key").as_deref(),
        Some("order-42")
    );
    assert_eq!(got[1].text("x-pgoutbox-tenant").as_deref(), Some("acme"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn trace_context_arrives_unchanged_and_an_invalid_one_is_refused() {
    let pg = Postgres::shared();
    let ob = Outbox::new(pg, &RabbitMq::shared().url(), "ct_trace").await;
    let client = pg.client(&ob.db).await;
    let other = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-00";

    // SET LOCAL in the producer's transaction.
    client
        .batch_execute(&format!(
            "BEGIN;
             SET LOCAL outbox.traceparent = '{TRACEPARENT}';
             SET LOCAL outbox.tracestate = '{TRACESTATE}';
             SELECT outbox.emit('trace.t', '{{}}', message_id => 'from-setting');
             COMMIT"
        ))
        .await
        .unwrap();
    // The setting ended with its transaction: the next emit of the session has none.
    client
        .batch_execute("SELECT outbox.emit('trace.t', '{}', message_id => 'after-setting')")
        .await
        .unwrap();
    // As an argument; it wins over a setting, and brings no tracestate of the setting.
    client
        .batch_execute(&format!(
            "BEGIN;
             SET LOCAL outbox.traceparent = '{TRACEPARENT}';
             SET LOCAL outbox.tracestate = '{TRACESTATE}';
             SELECT outbox.emit('trace.t', '{{}}', message_id => 'from-argument',
                 traceparent => '{other}');
             COMMIT"
        ))
        .await
        .unwrap();
    // Invalid: refused at emit, naming where it came from; the transaction rolls back.
    for (setting, named) in [
        (
            "SET LOCAL outbox.traceparent = '00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01'",
            "setting outbox.traceparent",
        ),
        (
            "SET LOCAL outbox.traceparent = 'ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01'",
            "setting outbox.traceparent",
        ),
        (
            "SET LOCAL outbox.traceparent = '00-00000000000000000000000000000000-00f067aa0ba902b7-01'",
            "setting outbox.traceparent",
        ),
        (
            "SET LOCAL outbox.tracestate = 'rojo=1'",
            "setting outbox.tracestate",
        ),
    ] {
        let (code, message, hint) = sql_error(
            &client,
            &format!("BEGIN; {setting}; SELECT outbox.emit('trace.t', '{{}}', message_id => 'refused')"),
        )
        .await;
        client.batch_execute("ROLLBACK").await.unwrap();
        assert_eq!(code, "22023", "{message}");
        assert!(message.contains(named), "{message}");
        assert!(hint.contains("trace-context") || hint.contains("Trace Context"), "{hint}");
    }
    let (code, message, _) = sql_error(
        &client,
        "SELECT outbox.emit('trace.t', '{}', message_id => 'refused', traceparent => '00-abc')",
    )
    .await;
    assert_eq!(code, "22023");
    assert!(message.contains("argument traceparent"), "{message}");

    let _streamer = ob.run(&[]);
    let got = take(&ob.amqp_url, &ob.queue, 3, scaled(Duration::from_secs(20))).await;
    let ids: Vec<String> = got.iter().map(Got::id).collect();
    assert_eq!(ids, ["from-setting", "after-setting", "from-argument"]);
    assert_eq!(got[0].text("traceparent").as_deref(), Some(TRACEPARENT));
    assert_eq!(got[0].text("tracestate").as_deref(), Some(TRACESTATE));
    assert_eq!(got[1].header("traceparent"), None);
    assert_eq!(got[1].header("tracestate"), None);
    assert_eq!(got[2].text("traceparent").as_deref(), Some(other));
    assert_eq!(got[2].header("tracestate"), None);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unknown_envelope_version_is_dead_lettered_and_the_next_message_arrives() {
    let pg = Postgres::shared();
    let ob = Outbox::new(pg, &RabbitMq::shared().url(), "ct_v4").await;
    // What a newer outbox.emit might write: version byte 4, by hand.
    let v4_lsn = ob.sql(
        "SELECT pg_logical_emit_message(true, 'pgoutbox',
             set_byte(outbox._envelope('v.t', convert_to('{}', 'UTF8'), 'application/json', '{}', 'from-v4'), 0, 4))",
    );
    let next_lsn = ob.sql("SELECT outbox.emit('v.t', '{}', message_id => 'after-v4')");
    let flushed_before = ob.confirmed_flush();

    let _streamer = ob.run(&[]);
    let got = take(&ob.amqp_url, &ob.queue, 1, scaled(Duration::from_secs(20))).await;
    let ids: Vec<String> = got.iter().map(Got::id).collect();
    assert_eq!(
        ids,
        ["after-v4"],
        "the version-4 message is never published"
    );

    let row = ob.sql(
        "SELECT lsn, reason, coalesce(message_id, '-'), get_byte(envelope, 0), last_error FROM outbox.dead_letter",
    );
    let fields: Vec<&str> = row.trim().split('|').collect();
    assert_eq!(fields.len(), 5, "one dead letter: {row}");
    assert_eq!(fields[0], v4_lsn.trim());
    assert_eq!(fields[1], "unsupported_envelope");
    assert_eq!(fields[3], "4");
    assert!(
        fields[4].contains("unsupported envelope version 4"),
        "{}",
        fields[4]
    );
    // The slot moves past both (the dead letter was durable first: it is in the table).
    let next = crate::support::lsn(&next_lsn);
    let deadline = Instant::now() + scaled(Duration::from_secs(15));
    while ob.confirmed_flush() < next {
        assert!(
            Instant::now() < deadline,
            "the slot did not move past the dead-lettered message"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(ob.confirmed_flush() > flushed_before);
}
