//! Smoke tests proving the test harness itself works.

use std::time::Duration;

use lapin::BasicProperties;

use crate::support::{self, Postgres, RabbitMq};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn harness_shared_postgres_and_rabbitmq() {
    let pg = Postgres::shared();
    let client = pg.client("postgres").await;
    let row = client.query_one("SHOW wal_level", &[]).await.unwrap();
    assert_eq!(row.get::<_, String>(0), "logical");

    let db = pg.create_database("smoke").await;
    assert!(db.starts_with("smoke_"), "{db}");

    // Password roles over TCP: right password works, wrong one fails.
    for role in ["pw_scram", "pw_md5", "pw_cleartext"] {
        let c = Postgres::client_url(&pg.url_as(role, role, &db))
            .await
            .unwrap_or_else(|e| panic!("{role}: {e:?}"));
        let who: String = c
            .query_one("SELECT current_user::text", &[])
            .await
            .unwrap()
            .get(0);
        assert_eq!(who, role);
        assert!(Postgres::client_url(&pg.url_as(role, "wrong", &db))
            .await
            .is_err());
    }
    let stored: String = client
        .query_one(
            "SELECT rolpassword FROM pg_authid WHERE rolname = 'pw_md5'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert!(stored.starts_with("md5"), "{stored}");

    let rmq = RabbitMq::shared();
    let url = rmq.url();
    let exchange = support::unique("smoke_x");
    let queue = support::unique("smoke_q");
    support::declare_bound_queue(&url, &exchange, &queue, "orders.#").await;
    let props = BasicProperties::default()
        .with_message_id("m-1".into())
        .with_content_type("application/json".into())
        .with_delivery_mode(2)
        .with_timestamp(1_700_000_000);
    support::publish(&url, &exchange, "orders.created", br#"{"a":1}"#, props).await;
    support::publish(
        &url,
        &exchange,
        "other.created",
        b"unrouted",
        BasicProperties::default(),
    )
    .await;
    let got = support::drain_queue(&url, &queue, 1, support::scaled(Duration::from_secs(5))).await;
    assert_eq!(got.len(), 1, "{got:?}");
    assert_eq!(got[0].body_json()["a"], 1);
    assert_eq!(got[0].message_id.as_deref(), Some("m-1"));
    assert_eq!(got[0].routing_key, "orders.created");
    assert_eq!(got[0].content_type.as_deref(), Some("application/json"));
    assert_eq!(got[0].delivery_mode, Some(2));
    assert_eq!(got[0].timestamp, Some(1_700_000_000));
    assert_eq!(support::queue_len(&url, &queue).await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn harness_private_servers() {
    // Start private servers while the shared ones (maybe) start concurrently.
    let (pg, rmq) = tokio::task::spawn_blocking(|| {
        let pg = std::thread::spawn(|| {
            Postgres::start_private(&[("max_replication_slots", "4"), ("wal_sender_timeout", "5s")])
        });
        let rmq = RabbitMq::start_private();
        (pg.join().unwrap(), rmq)
    })
    .await
    .unwrap();
    assert_ne!(pg.port(), Postgres::shared().port());
    assert_ne!(rmq.port(), RabbitMq::shared().port());

    let c = pg.client("postgres").await;
    let v: String = c
        .query_one("SHOW max_replication_slots", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(v, "4");
    // Slot creation works (logical decoding enabled).
    let slot = support::unique("smoke_slot");
    c.execute(
        "SELECT pg_create_logical_replication_slot($1, 'pgoutput')",
        &[&slot],
    )
    .await
    .unwrap();

    // Restart keeps data dir and port.
    drop(c);
    pg.stop_fast();
    assert!(!pg.is_running());
    pg.start();
    let c = pg.client("postgres").await;
    let n: i64 = c
        .query_one(
            "SELECT count(*) FROM pg_replication_slots WHERE slot_name = $1",
            &[&slot],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(n, 1);
    assert!(pg.log_contents().contains("database system is ready"));

    // rabbitmqctl against the private node; block/unblock; stop/start app.
    let url = rmq.url();
    let q = support::unique("smoke_priv_q");
    let x = support::unique("smoke_priv_x");
    support::declare_bound_queue(&url, &x, &q, "#").await;
    assert!(rmq.ctl_ok(&["-q", "list_queues", "name"]).contains(&q));
    rmq.block();
    rmq.unblock();
    rmq.stop_app();
    assert!(!support::port_open(rmq.port()));
    rmq.start_app();
    support::publish(&url, &x, "k", b"after restart", BasicProperties::default()).await;
    let got = support::drain_queue(&url, &q, 1, Duration::from_secs(5)).await;
    assert_eq!(got.len(), 1);
    assert_eq!(got[0].body_str(), "after restart");
}

#[tokio::test]
async fn harness_helpers() {
    let a = support::unique("Foo-Bar");
    let b = support::unique("Foo-Bar");
    assert_ne!(a, b);
    assert!(a.starts_with("foo_bar_"));
    assert!(a
        .chars()
        .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_'));
    assert!(support::scale() > 0.0);

    let s = support::Streamer::spawn_program(
        "sh",
        &[
            "-c",
            "echo hello-from-child; echo \"rust_log=$RUST_LOG\"; exec sleep 30",
        ],
        &[("X", "1")],
    );
    assert!(
        s.wait_for_log("hello-from-child", Duration::from_secs(5))
            .await
    );
    assert!(s.log().contains("rust_log=info"));
    assert!(s.wait_exit(Duration::from_millis(100)).await.is_none());
    s.sigterm();
    let st = s.wait_exit(Duration::from_secs(5)).await.expect("exited");
    assert!(!st.success());
    assert!(support::wait_until(Duration::from_secs(1), || async { true }).await);
    assert!(!support::wait_until(Duration::from_millis(200), || async { false }).await);
}

/// The chaos audit once stopped draining early: redeliveries counted towards the expected
/// total, so with duplicates in the queue and the streamer still in reconnect backoff the
/// drain returned before the last distinct messages arrived, and the audit reported them
/// lost. Duplicates must not count: here two copies of `a` arrive at once and `b` only after
/// a pause longer than the drain's grace period.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drain_counts_distinct_message_ids_not_redeliveries() {
    let rmq = RabbitMq::shared();
    let url = rmq.url();
    let exchange = support::unique("smoke_dup_x");
    let queue = support::unique("smoke_dup_q");
    support::declare_bound_queue(&url, &exchange, &queue, "#").await;
    let with_id = |id: &str| BasicProperties::default().with_message_id(id.into());
    support::publish(&url, &exchange, "k", b"a", with_id("a")).await;
    support::publish(&url, &exchange, "k", b"a", with_id("a")).await;
    let late = {
        let (url, exchange) = (url.clone(), exchange.clone());
        tokio::spawn(async move {
            tokio::time::sleep(support::scaled(Duration::from_secs(2))).await;
            support::publish(&url, &exchange, "k", b"b", with_id("b")).await;
        })
    };
    let got = support::drain_queue(&url, &queue, 2, support::scaled(Duration::from_secs(20))).await;
    late.await.unwrap();
    let ids: Vec<_> = got.iter().filter_map(|m| m.message_id.as_deref()).collect();
    assert_eq!(ids, ["a", "a", "b"], "{got:?}");
}

/// The stream plugin on the harness' nodes, and rstream (a client we did not write) on both
/// ends: a stream declared over AMQP 0-9-1, three AMQP 1.0 messages published with rstream
/// under a producer name, read back from the first offset with every property, application
/// property and byte of the body; the same publishing ids again are confirmed and dropped by
/// the broker's deduplication (the stream still holds three).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn harness_stream_plugin_and_rstream() {
    use serde_json::json;
    use support::StreamPublish;

    let rmq = RabbitMq::shared();
    let port = rmq.stream_port();
    assert_ne!(port, rmq.port());
    assert!(support::port_open(port), "stream port {port} closed");
    assert_eq!(
        rmq.stream_url(),
        format!("rabbitmq-stream://guest:guest@127.0.0.1:{port}/%2f")
    );
    let stream = support::unique("smoke_stream");
    support::declare_stream(&rmq.url(), &stream, &[]).await;

    let binary: Vec<u8> = (0..=255u8).rev().collect();
    let bodies: [&[u8]; 3] = [br#"{"id": 1}"#, &binary, b"\0three\r\n"];
    let messages: Vec<StreamPublish> = bodies
        .iter()
        .enumerate()
        .map(|(i, body)| StreamPublish {
            body: body.to_vec(),
            message_id: Some(format!("m-{i}")),
            subject: Some("orders.created".into()),
            content_type: Some("application/json".into()),
            creation_time: Some(1_700_000_000_000 + i as i64),
            correlation_id: Some(format!("c-{i}")),
            application_properties: vec![
                (
                    "x-pgoutbox-lsn".into(),
                    json!(format!("0/{:X}", 0x1000 + i)),
                ),
                ("x-index".into(), json!(i)),
                ("x-flag".into(), json!(i % 2 == 0)),
            ],
            publishing_id: Some(10 + i as u64),
        })
        .collect();
    let url = rmq.stream_url();
    let producer = support::unique("smoke_producer");
    let (got, again) = tokio::task::spawn_blocking({
        let (stream, messages) = (stream.clone(), messages.clone());
        move || {
            let ids = support::publish_stream(&url, &stream, Some(&producer), &messages);
            assert_eq!(ids, [10, 11, 12]);
            let got =
                support::read_stream(rmq, &stream, 3, support::scaled(Duration::from_secs(60)));
            // The same ids under the same name: confirmed, and dropped.
            let ids = support::publish_stream(&url, &stream, Some(&producer), &messages);
            assert_eq!(ids, [10, 11, 12]);
            let again =
                support::read_stream(rmq, &stream, 4, support::scaled(Duration::from_secs(5)));
            (got, again)
        }
    })
    .await
    .unwrap();

    assert_eq!(got.len(), 3, "{got:#?}");
    for (i, m) in got.iter().enumerate() {
        assert_eq!(m.offset, i as u64);
        assert_eq!(m.message_id.as_deref(), Some(format!("m-{i}").as_str()));
        assert_eq!(m.subject.as_deref(), Some("orders.created"));
        assert_eq!(m.content_type.as_deref(), Some("application/json"));
        assert_eq!(m.creation_time, Some(1_700_000_000_000 + i as i64));
        assert_eq!(m.correlation_id.as_deref(), Some(format!("c-{i}").as_str()));
        assert_eq!(
            m.app_str("x-pgoutbox-lsn"),
            Some(format!("0/{:X}", 0x1000 + i).as_str())
        );
        assert_eq!(m.application_properties["x-index"], json!(i));
        assert_eq!(m.application_properties["x-flag"], json!(i % 2 == 0));
        assert_eq!(m.application_properties.len(), 3, "{m:?}");
        assert!(m.has_body);
        assert_eq!(m.body, bodies[i], "message {i}");
        // As stored: rstream writes the properties section first (descriptor 0x73, as a
        // small ulong).
        assert_eq!(m.raw[..3], [0x00, 0x53, 0x73], "{m:?}");
    }
    assert_eq!(again, got, "deduplicated: the stream still holds the three");
}

/// The shared TLS node's stream listener: rstream publishes and reads over
/// `rabbitmq-stream+tls://`, verifying the broker's certificate against the test CA (Metadata
/// answers name the TLS port on a TLS connection).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn harness_stream_over_tls() {
    let tls = support::TlsRabbit::shared();
    let stream = support::unique("smoke_tls_stream");
    support::declare_stream(&tls.rabbit.url(), &stream, &[]).await;
    let url = tls.stream_tls_url(&tls.cacertfile());
    assert!(
        url.starts_with("rabbitmq-stream+tls://guest:guest@127.0.0.1:"),
        "{url}"
    );
    let got = tokio::task::spawn_blocking(move || {
        let message = support::StreamPublish {
            body: b"over tls".to_vec(),
            message_id: Some("tls-1".into()),
            ..Default::default()
        };
        support::publish_stream(&url, &stream, None, &[message]);
        support::read_stream_url(&url, &stream, 1, support::scaled(Duration::from_secs(60)))
    })
    .await
    .unwrap();
    assert_eq!(got.len(), 1, "{got:?}");
    assert_eq!(got[0].message_id.as_deref(), Some("tls-1"));
    assert_eq!(got[0].body, b"over tls");
}
