//! Operating pgoutbox: setup and run errors, authentication, status, teardown, two
//! instances on one slot, returns and nacks, poison messages, backpressure.

use std::time::Duration;

use lapin::options::{QueueBindOptions, QueueDeclareOptions};
use lapin::types::{AMQPValue, FieldTable};

use crate::support::{self, lsn, scaled, Outbox, Postgres, RabbitMq};

fn stderr(out: &std::process::Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

fn pgoutbox(args: &[&str]) -> std::process::Output {
    std::process::Command::new(env!("CARGO_BIN_EXE_pgoutbox"))
        .args(args)
        .env("NO_COLOR", "1")
        .output()
        .expect("run pgoutbox")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn setup_names_the_setting_the_value_and_the_fix() {
    // wal_level = replica.
    let replica = Postgres::start_private(&[("wal_level", "replica")]);
    let out = pgoutbox(&["setup", "--database-url", &replica.url("postgres")]);
    assert!(!out.status.success());
    assert!(
        stderr(&out).contains("wal_level is 'replica'; set wal_level = logical"),
        "{}",
        stderr(&out)
    );
    let out = pgoutbox(&[
        "run",
        "--database-url",
        &replica.url("postgres"),
        "--amqp-url",
        "amqp://guest:guest@127.0.0.1:1/%2f",
    ]);
    assert!(!out.status.success());
    assert!(
        stderr(&out).contains("wal_level is 'replica'"),
        "{}",
        stderr(&out)
    );
    drop(replica);

    // No free replication slot.
    let full = Postgres::start_private(&[("max_replication_slots", "1")]);
    full.psql(
        "postgres",
        "SELECT pg_create_logical_replication_slot('taken', 'pgoutput')",
    );
    let out = pgoutbox(&["setup", "--database-url", &full.url("postgres")]);
    assert!(!out.status.success());
    assert!(
        stderr(&out).contains("max_replication_slots = 1 are all in use"),
        "{}",
        stderr(&out)
    );
    drop(full);

    // A role without REPLICATION.
    let pg = Postgres::shared();
    let db = pg.create_database("ops_norepl").await;
    let out = pgoutbox(&["setup", "--database-url", &pg.url_as("norepl", "", &db)]);
    assert!(!out.status.success());
    assert!(
        stderr(&out).contains("role \"norepl\" lacks the REPLICATION attribute; run ALTER ROLE"),
        "{}",
        stderr(&out)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn run_refuses_bad_settings_before_touching_anything() {
    let pg = Postgres::shared();
    let ob = Outbox::new(pg, &RabbitMq::shared().url(), "ops_badrun").await;
    let amqp = ob.amqp_url.clone();
    let url = ob.url();
    let cases: Vec<(Vec<String>, &str)> = vec![
        (
            vec![
                "--slot".into(),
                "no_such_slot".into(),
                "--publication".into(),
                ob.publication.clone(),
            ],
            "replication slot \"no_such_slot\" does not exist; run `pgoutbox setup` first",
        ),
        (
            vec![
                "--slot".into(),
                ob.slot.clone(),
                "--publication".into(),
                "typo_pub".into(),
            ],
            "publication \"typo_pub\" does not exist",
        ),
        (
            vec!["--slot".into(), "Bad-Name".into()],
            "invalid setting --slot",
        ),
    ];
    for (extra, expected) in cases {
        let mut args = vec![
            "run".to_string(),
            "--database-url".into(),
            url.clone(),
            "--amqp-url".into(),
            amqp.clone(),
        ];
        args.extend(extra);
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let out = pgoutbox(&args);
        assert!(!out.status.success());
        assert!(
            stderr(&out).contains(expected),
            "expected {expected:?} in:\n{}",
            stderr(&out)
        );
    }
    // TLS is refused, never downgraded to plaintext.
    let tls_db = format!("{url}?sslmode=require");
    let out = pgoutbox(&["run", "--database-url", &tls_db, "--amqp-url", &amqp]);
    assert!(
        stderr(&out).contains("TLS, which is not supported yet"),
        "{}",
        stderr(&out)
    );
    let tls_amqp = amqp.replace("amqp://", "amqps://");
    let out = pgoutbox(&["run", "--database-url", &url, "--amqp-url", &tls_amqp]);
    assert!(
        stderr(&out).contains("TLS, which is not supported yet"),
        "{}",
        stderr(&out)
    );
    // Nothing took the slot.
    assert!(!ob.slot_active());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streams_with_scram_md5_cleartext_and_a_unix_socket() {
    let pg = Postgres::shared();
    let ob = Outbox::new(pg, &RabbitMq::shared().url(), "ops_auth").await;
    let socket = format!(
        "host={} port={} user=postgres dbname={}",
        pg.socket_dir().display(),
        pg.port(),
        ob.db
    );
    let variants = [
        ("scram", pg.url_as("pw_scram", "pw_scram", &ob.db)),
        ("md5", pg.url_as("pw_md5", "pw_md5", &ob.db)),
        (
            "cleartext",
            pg.url_as("pw_cleartext", "pw_cleartext", &ob.db),
        ),
        ("unix", socket),
    ];
    for (name, url) in variants {
        let streamer = ob.run_with_url(&url, &[]);
        ob.sql(&format!(
            "SELECT outbox.emit('auth', '{{}}', '{{}}', 'via-{name}')"
        ));
        let got = ob.drain(1, scaled(Duration::from_secs(20))).await;
        assert_eq!(
            got.iter()
                .map(|m| m.message_id.clone().unwrap())
                .collect::<Vec<_>>(),
            [format!("via-{name}")],
            "{name}:\n{}",
            streamer.log()
        );
        streamer.sigterm();
        assert_eq!(
            streamer
                .wait_exit(scaled(Duration::from_secs(20)))
                .await
                .map(|s| s.success()),
            Some(true),
            "{name}:\n{}",
            streamer.log()
        );
    }
    // A wrong password is a clear, non-retryable error.
    let streamer = ob.run_with_url(&pg.url_as("pw_scram", "wrong", &ob.db), &[]);
    let status = streamer.wait_exit(scaled(Duration::from_secs(20))).await;
    assert_eq!(status.map(|s| s.success()), Some(false));
    assert!(
        streamer.log().contains("password authentication failed"),
        "{}",
        streamer.log()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn teardown_refuses_while_outbox_messages_are_unsent() {
    let pg = Postgres::shared();
    let ob = Outbox::new(pg, &RabbitMq::shared().url(), "ops_teardown").await;
    ob.sql("SELECT outbox.emit('t', '{}', '{}', 'unsent')");
    let out = ob.cli(&["teardown", "--publication", &ob.publication]);
    assert!(
        !out.status.success(),
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        stderr(&out)
    );
    assert!(
        stderr(&out).contains("still holds 1 unsent outbox messages"),
        "{}",
        stderr(&out)
    );
    // Delivering it makes teardown possible without --force.
    let streamer = ob.run(&[]);
    assert_eq!(ob.drain(1, scaled(Duration::from_secs(20))).await.len(), 1);
    streamer.sigterm();
    streamer.wait_exit(scaled(Duration::from_secs(20))).await;
    assert!(
        support::wait_until(scaled(Duration::from_secs(10)), || async {
            !ob.slot_active()
        })
        .await
    );
    let out = ob.cli(&["teardown", "--publication", &ob.publication]);
    assert!(out.status.success(), "{}", stderr(&out));
    let out = ob.cli(&["status", "--json"]);
    assert!(!out.status.success());
    assert!(
        stderr(&out).contains("does not exist; run `pgoutbox setup`"),
        "{}",
        stderr(&out)
    );

    // --force drops a slot with unsent messages.
    let ob2 = Outbox::new(pg, &RabbitMq::shared().url(), "ops_teardown_force").await;
    ob2.sql("SELECT outbox.emit('t', '{}', '{}', 'lost-on-purpose')");
    let out = ob2.cli(&["teardown", "--publication", &ob2.publication, "--force"]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(
        ob2.sql(&format!(
            "SELECT count(*) FROM pg_replication_slots WHERE slot_name = '{}'",
            ob2.slot
        ))
        .trim(),
        "0"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn second_instance_waits_names_the_holder_and_never_publishes() {
    let pg = Postgres::shared();
    let ob = Outbox::new(pg, &RabbitMq::shared().url(), "ops_two").await;
    let first = ob.run(&["--instance-id", "first"]);
    ob.sql("SELECT outbox.emit('t', '{}', '{}', 'one')");
    assert_eq!(ob.drain(1, scaled(Duration::from_secs(20))).await.len(), 1);
    let second = ob.run(&["--instance-id", "second", "--slot-busy-timeout-s", "3"]);
    let status = second.wait_exit(scaled(Duration::from_secs(30))).await;
    assert_eq!(status.map(|s| s.success()), Some(false));
    let log = second.log();
    assert!(
        log.contains("slot is active in another process; waiting"),
        "{log}"
    );
    assert!(log.contains("pgoutbox-first"), "names the holder: {log}");
    assert!(log.contains("still held by another process"), "{log}");
    ob.sql("SELECT outbox.emit('t', '{}', '{}', 'two')");
    let got = ob.drain(1, scaled(Duration::from_secs(20))).await;
    assert_eq!(got.len(), 1, "only the holder publishes");
    assert_eq!(
        pg.psql(
            &ob.db,
            &format!(
                "SELECT count(*) FROM pg_replication_slots WHERE slot_name LIKE '{}%'",
                ob.slot
            )
        )
        .trim(),
        "1",
        "no second slot"
    );
    drop(first);
}

/// Declares a queue bound to `exchange` with `binding`, with extra queue arguments.
async fn declare_queue_with_args(
    url: &str,
    exchange: &str,
    queue: &str,
    binding: &str,
    args: FieldTable,
) {
    support::declare_bound_queue(url, exchange, &format!("{queue}_probe"), "probe.never").await;
    let conn = support::amqp_connect(url).await;
    let ch = conn.create_channel().await.unwrap();
    ch.queue_declare(
        queue.into(),
        QueueDeclareOptions {
            durable: true,
            ..Default::default()
        },
        args,
    )
    .await
    .unwrap();
    ch.queue_bind(
        queue.into(),
        exchange.into(),
        binding.into(),
        QueueBindOptions::default(),
        FieldTable::default(),
    )
    .await
    .unwrap();
    let _ = conn.close(200, "bye".into()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unroutable_message_stops_without_acknowledging_past_it() {
    let pg = Postgres::shared();
    let url = RabbitMq::shared().url();
    let ob = Outbox::new(pg, &url, "ops_return").await;
    let exchange = support::unique("ops_return_only_ok");
    let queue = support::unique("ops_return_q");
    support::declare_bound_queue(&url, &exchange, &queue, "ok.#").await;
    ob.sql("SELECT outbox.emit('ok.1', '{}', '{}', 'ok-1')");
    let returned_lsn = lsn(&ob.sql("SELECT outbox.emit('nobody.home', '{}', '{}', 'unroutable')"));
    ob.sql("SELECT outbox.emit('ok.2', '{}', '{}', 'ok-2')");
    let streamer = ob.run(&["--exchange", &exchange]);
    let status = streamer.wait_exit(scaled(Duration::from_secs(30))).await;
    assert_eq!(
        status.map(|s| s.success()),
        Some(false),
        "{}",
        streamer.log()
    );
    let log = streamer.log();
    assert!(
        log.contains("returned by the broker (312 NO_ROUTE)"),
        "{log}"
    );
    assert!(
        ob.confirmed_flush() < returned_lsn,
        "slot stays before the returned message"
    );
    let got = support::drain_queue(&url, &queue, 1, scaled(Duration::from_secs(5))).await;
    assert_eq!(
        got.first().and_then(|m| m.message_id.clone()).as_deref(),
        Some("ok-1")
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nacked_message_stops_without_acknowledging_past_it() {
    let pg = Postgres::shared();
    let url = RabbitMq::shared().url();
    let ob = Outbox::new(pg, &url, "ops_nack").await;
    let exchange = support::unique("ops_nack_x");
    let queue = support::unique("ops_nack_q");
    let mut args = FieldTable::default();
    args.insert("x-max-length".into(), AMQPValue::LongLongInt(1));
    args.insert(
        "x-overflow".into(),
        AMQPValue::LongString("reject-publish".into()),
    );
    declare_queue_with_args(&url, &exchange, &queue, "#", args).await;
    ob.sql("SELECT outbox.emit('a', '{}', '{}', 'fits')");
    let nacked_lsn = lsn(&ob.sql("SELECT outbox.emit('a', '{}', '{}', 'rejected')"));
    let streamer = ob.run(&["--exchange", &exchange]);
    let status = streamer.wait_exit(scaled(Duration::from_secs(30))).await;
    assert_eq!(
        status.map(|s| s.success()),
        Some(false),
        "{}",
        streamer.log()
    );
    assert!(
        streamer.log().contains("nacked by the broker"),
        "{}",
        streamer.log()
    );
    assert!(
        ob.confirmed_flush() < nacked_lsn,
        "slot stays before the nacked message"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn poison_messages_are_skipped_and_nothing_past_them_is_acknowledged() {
    let pg = Postgres::shared();
    let ob = Outbox::new(pg, &RabbitMq::shared().url(), "ops_poison").await;
    let streamer = ob.run(&[]);
    ob.sql("SELECT outbox.emit('t', '{}', '{}', 'before')");
    assert_eq!(ob.drain(1, scaled(Duration::from_secs(20))).await.len(), 1);
    let poison =
        lsn(&ob.sql("SELECT pg_logical_emit_message(false, 'pgoutbox', 'not from outbox.emit')"));
    ob.sql("SELECT pg_logical_emit_message(true, 'pgoutbox', 'not an envelope')");
    ob.sql("SELECT outbox.emit('t', '{}', '{}', 'after')");
    let got = ob.drain(1, scaled(Duration::from_secs(20))).await;
    assert_eq!(
        got.iter()
            .map(|m| m.message_id.clone().unwrap())
            .collect::<Vec<_>>(),
        ["after"]
    );
    streamer.sigterm();
    assert_eq!(
        streamer
            .wait_exit(scaled(Duration::from_secs(20)))
            .await
            .map(|s| s.success()),
        Some(true)
    );
    let log = streamer.log();
    assert!(
        log.contains("non-transactional logical message with prefix pgoutbox"),
        "{log}"
    );
    assert!(log.contains("undecodable outbox message (poison)"), "{log}");
    assert!(
        ob.confirmed_flush() < poison,
        "nothing past the poison message is acknowledged"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn blocked_broker_fills_the_window_without_losing_the_connection() {
    let pg = Postgres::start_private(&[("wal_sender_timeout", "3s")]);
    let rmq = RabbitMq::start_private();
    let ob = Outbox::new(&pg, &rmq.url(), "ops_block").await;
    let streamer = ob.run(&["--max-in-flight", "200"]);
    assert!(
        support::wait_until(scaled(Duration::from_secs(20)), || async {
            ob.slot_active()
        })
        .await
    );
    rmq.block();
    let first_lsn = lsn(&ob.sql("SELECT outbox.emit('b', '{}', '{}', 'b-0')"));
    for t in 0..5 {
        ob.sql(&format!(
            "DO $$ BEGIN FOR n IN {}..{} LOOP PERFORM outbox.emit('b', jsonb_build_object('n', n), '{{}}', 'b-' || n); END LOOP; END $$",
            t * 1000 + 1,
            t * 1000 + 1000
        ));
    }
    // Four times wal_sender_timeout with the broker blocked and the window full.
    let deadline = std::time::Instant::now() + Duration::from_secs(12);
    while std::time::Instant::now() < deadline {
        assert!(
            streamer.try_status().is_none(),
            "streamer died:\n{}",
            streamer.log()
        );
        assert!(ob.slot_active(), "the replication connection was dropped");
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    assert!(
        ob.confirmed_flush() < first_lsn,
        "nothing unconfirmed was acknowledged"
    );
    assert!(!pg
        .log_contents()
        .contains("terminating walsender process due to replication timeout"));
    let rss_kb = std::fs::read_to_string(format!("/proc/{}/status", streamer.pid()))
        .unwrap()
        .lines()
        .find_map(|l| {
            l.strip_prefix("VmHWM:")
                .map(|v| v.trim().trim_end_matches(" kB").parse::<u64>().unwrap())
        })
        .unwrap();
    rmq.unblock();
    let got = ob.drain(5_001, scaled(Duration::from_secs(60))).await;
    assert_eq!(got.len(), 5_001, "{}", streamer.log());
    let ns: Vec<i64> = got
        .iter()
        .map(|m| m.message_id.clone().unwrap()[2..].parse().unwrap())
        .collect();
    assert!(ns.windows(2).all(|w| w[0] < w[1]), "in order");
    eprintln!("blocked broker: peak RSS {rss_kb} kB with a 200-message window");
}
