//! Operating pgoutbox: setup and run errors, authentication, status, teardown, two
//! instances on one slot, returns and nacks, poison messages, backpressure.

use std::time::Duration;

use lapin::options::{QueueBindOptions, QueueDeclareOptions};
use lapin::types::{AMQPValue, FieldTable};

use crate::support::cli::{pgoutbox, stderr};
use crate::support::{self, lsn, scaled, Outbox, Postgres, RabbitMq};

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
    let url = ob.streamer_url();
    let cases: Vec<(Vec<String>, &str)> = vec![
        (
            vec![
                "--slot".into(),
                "no_such_slot".into(),
                "--publication".into(),
                ob.publication.clone(),
            ],
            "replication slot \"no_such_slot\" does not exist; run `pgoutbox setup --slot no_such_slot` first",
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
        (
            vec!["--read-coalesce-us".into(), "5000000".into()],
            "invalid setting --read-coalesce-us (PGOUTBOX_READ_COALESCE_US) = \"5000000\": must be from 0 to 100000 microseconds (it delays every small read, and with it the replies to the server's keepalives)",
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
    // TLS asked of a server without it: refused, never downgraded to plaintext.
    let tls_db = format!("{url}?sslmode=require");
    let out = pgoutbox(&["run", "--database-url", &tls_db, "--amqp-url", &amqp]);
    assert!(
        !out.status.success() && out.status.code().is_some(),
        "TLS refused with a non-zero exit: {:?}\n{}",
        out.status,
        stderr(&out)
    );
    assert!(
        stderr(&out).contains("sslmode=require asks for TLS and the server does not offer it"),
        "{}",
        stderr(&out)
    );
    // RabbitMQ TLS: a TLS setting on amqp:// is refused (never plaintext where TLS was
    // meant), verification cannot be switched off, and an unreadable CA file is a definite
    // error (run exits rather than retrying), all before the slot is taken.
    let missing_ca = "/nonexistent/pgoutbox-ca.pem";
    for (broker_url, expected) in [
        (
            format!("{amqp}?cacertfile={missing_ca}"),
            "cacertfile= is a TLS setting, and amqp:// does not use TLS; use amqps://".to_owned(),
        ),
        (
            format!("{}?verify=verify_none", amqp.replace("amqp://", "amqps://")),
            "pgoutbox always verifies the broker's certificate".to_owned(),
        ),
        (
            format!(
                "{}?cacertfile={missing_ca}",
                amqp.replace("amqp://", "amqps://")
            ),
            format!("amqps: cannot use cacertfile={missing_ca} from --amqp-url (PGOUTBOX_AMQP_URL): no such file"),
        ),
    ] {
        let out = pgoutbox(&[
            "run",
            "--database-url",
            &url,
            "--amqp-url",
            &broker_url,
            "--slot",
            &ob.slot,
            "--publication",
            &ob.publication,
        ]);
        assert!(
            !out.status.success() && out.status.code().is_some(),
            "{broker_url}: {:?}\n{}",
            out.status,
            stderr(&out)
        );
        assert!(
            stderr(&out).contains(&expected),
            "{expected:?} in:\n{}",
            stderr(&out)
        );
    }
    // Nothing took the slot.
    assert!(!ob.slot_active());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streams_with_scram_md5_cleartext_and_a_unix_socket() {
    let pg = Postgres::shared();
    let ob = Outbox::new(pg, &RabbitMq::shared().url(), "ops_auth").await;
    // setup ran as the superuser: the password roles get what `run` writes (as
    // sql/roles.example.sql grants it), or run refuses up front.
    ob.sql(
        "GRANT USAGE ON SCHEMA outbox TO pw_scram, pw_md5, pw_cleartext; \
         GRANT SELECT, INSERT ON outbox.dead_letter TO pw_scram, pw_md5, pw_cleartext; \
         GRANT USAGE ON SEQUENCE outbox.dead_letter_id_seq TO pw_scram, pw_md5, pw_cleartext; \
         GRANT SELECT, INSERT, UPDATE ON outbox.stream_state TO pw_scram, pw_md5, pw_cleartext;",
    );
    let socket = format!(
        "host={} port={} user={} dbname={}",
        pg.socket_dir().display(),
        pg.port(),
        support::fixture::STREAMER_ROLE,
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
        stderr(&out).contains("does not exist; run `pgoutbox setup --slot"),
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
    let bounded = ob.run(&["--instance-id", "bounded", "--slot-busy-timeout-s", "3"]);
    let status = bounded.wait_exit(scaled(Duration::from_secs(30))).await;
    assert_eq!(status.map(|s| s.success()), Some(false));
    let log = bounded.log();
    assert!(
        log.contains("slot is active in another process; standing by"),
        "{log}"
    );
    assert!(log.contains("pgoutbox-first"), "names the holder: {log}");
    assert!(log.contains("still held by another process"), "{log}");
    // A standby (the default) waits, names the holder, and takes over when it goes away.
    let standby = ob.run(&["--instance-id", "standby"]);
    assert!(
        standby
            .wait_for_log("pgoutbox-first", scaled(Duration::from_secs(20)))
            .await,
        "{}",
        standby.log()
    );
    // The message's own LSN: its commit lies after it, and WAL after the commit (other
    // databases', running_xacts) is acknowledged only within the record's slack.
    let two = ob.emit("t", "two");
    let got = ob.drain(1, scaled(Duration::from_secs(20))).await;
    assert_eq!(got.len(), 1, "only the holder publishes");
    // 'two' acknowledged to Postgres before the kill (the flush LSN waits for its
    // outbox.stream_state record), so the standby must not send it again.
    assert!(
        ob.flushed_past(two, scaled(Duration::from_secs(30))).await,
        "the holder acknowledged 'two': {}",
        first.log()
    );
    first.kill9();
    ob.sql("SELECT outbox.emit('t', '{}', '{}', 'three')");
    let got = ob.drain(1, scaled(Duration::from_secs(60))).await;
    assert_eq!(
        got.iter()
            .map(|m| m.message_id.clone().unwrap())
            .collect::<Vec<_>>(),
        ["three"],
        "the standby took over:\n{}",
        standby.log()
    );
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

/// Rows of outbox.dead_letter as (message_id, reason, attempts).
fn dead_letters(ob: &Outbox<'_>) -> Vec<(String, String, String)> {
    ob.sql("SELECT coalesce(message_id, '-'), reason, attempts FROM outbox.dead_letter ORDER BY id")
        .lines()
        .filter(|l| !l.is_empty())
        .map(|l| {
            let mut f = l.split('|').map(str::to_owned);
            (f.next().unwrap(), f.next().unwrap(), f.next().unwrap())
        })
        .collect()
}

fn row(id: &str, reason: &str, attempts: &str) -> (String, String, String) {
    (id.to_owned(), reason.to_owned(), attempts.to_owned())
}

/// Under a fast backlog the broker coalesces acks (`multiple`), and a `basic.return` names
/// no delivery tag, so every return must still be matched to its own message: each
/// unroutable one dead-lettered, each routable one delivered, none acknowledged as routed
/// while it was returned. (lapin, the earlier publisher, handed a return to whichever
/// confirm of a multiple-ack it resolved first.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn returns_in_a_fast_mixed_backlog_are_each_matched_to_their_message() {
    mixed_returns_case("ops_mixed_returns", &[]).await;
}

/// The same with `--publish-properties minimal`: no header of ours, so returns are
/// matched by `message_id`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn returns_match_by_message_id_with_minimal_properties() {
    mixed_returns_case("ops_mixed_min", &["--publish-properties", "minimal"]).await;
}

async fn mixed_returns_case(name: &str, extra: &[&str]) {
    let pg = Postgres::shared();
    let url = RabbitMq::shared().url();
    let ob = Outbox::new(pg, &url, name).await;
    let exchange = support::unique("ops_mixed_x");
    let queue = support::unique("ops_mixed_q");
    support::declare_bound_queue(&url, &exchange, &queue, "ok.#").await;
    let total = 20_000;
    for chunk in 0..4 {
        ob.sql(&format!(
            "SELECT count(outbox.emit(CASE WHEN g % 7 = 3 THEN 'nobody.' ELSE 'ok.' END || g, '{{}}', '{{}}', 'm-' || g)) FROM generate_series({} , {}) g",
            chunk * total / 4 + 1,
            (chunk + 1) * total / 4
        ));
    }
    let unroutable: std::collections::BTreeSet<String> = (1..=total)
        .filter(|g| g % 7 == 3)
        .map(|g| format!("m-{g}"))
        .collect();
    let mut args = vec!["--exchange", exchange.as_str()];
    args.extend_from_slice(extra);
    let streamer = ob.run(&args);
    assert!(
        ob.settled_through_now(scaled(Duration::from_secs(120)))
            .await,
        "the slot passes the backlog:\n{}",
        streamer.log()
    );
    let routable = total as usize - unroutable.len();
    let got = support::drain_queue(&url, &queue, routable, scaled(Duration::from_secs(30))).await;
    let delivered: std::collections::BTreeSet<String> =
        got.iter().filter_map(|m| m.message_id.clone()).collect();
    let dead: std::collections::BTreeSet<String> = dead_letters(&ob)
        .into_iter()
        .map(|(id, reason, _)| {
            assert_eq!(reason, "returned", "{id}");
            id
        })
        .collect();
    let missing: Vec<String> = (1..=total)
        .map(|g| format!("m-{g}"))
        .filter(|id| !delivered.contains(id) && !dead.contains(id))
        .collect();
    assert!(
        missing.is_empty(),
        "{} acknowledged but neither delivered nor dead-lettered, e.g. {:?}",
        missing.len(),
        &missing[..missing.len().min(10)]
    );
    assert_eq!(
        dead, unroutable,
        "exactly the unroutable ones are dead-lettered"
    );
    assert_eq!(delivered.len(), routable, "every routable one is delivered");
}

/// `--publish-properties minimal`: persistent, message_id, the routing key and the
/// producer's own headers, nothing else; an unroutable message is still returned, matched
/// by its id and dead-lettered, and the stream goes on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn minimal_properties_carry_only_the_id_and_the_producer_headers() {
    let pg = Postgres::shared();
    let url = RabbitMq::shared().url();
    let ob = Outbox::new(pg, &url, "ops_minimal").await;
    let exchange = support::unique("ops_minimal_x");
    let queue = support::unique("ops_minimal_q");
    support::declare_bound_queue(&url, &exchange, &queue, "ok.#").await;
    ob.sql(r#"SELECT outbox.emit('ok.1', '{"a": 1}', '{"tenant": "t1", "n": 7}', 'min-1')"#);
    let returned_lsn = ob.emit("nobody.home", "min-unroutable");
    ob.sql(
        "SELECT outbox.emit_bytes('ok.2', '\\x00ff'::bytea, 'application/x-raw', '{}', 'min-2')",
    );
    let streamer = ob.run(&["--exchange", &exchange, "--publish-properties", "minimal"]);
    let got = support::drain_queue(&url, &queue, 2, scaled(Duration::from_secs(20))).await;
    let ids: Vec<_> = got.iter().map(|m| m.message_id.clone().unwrap()).collect();
    assert_eq!(ids, ["min-1", "min-2"], "{}", streamer.log());
    assert_eq!(got[0].body_str(), r#"{"a": 1}"#);
    assert_eq!(got[1].body, vec![0x00, 0xff]);
    for m in &got {
        assert_eq!(m.delivery_mode, Some(2), "persistent");
        assert_eq!(m.content_type, None, "no content_type");
        assert_eq!(m.timestamp, None, "no timestamp");
        assert!(
            !m.headers.keys().any(|k| k.starts_with("x-pgoutbox-")),
            "none of our headers: {:?}",
            m.headers
        );
    }
    assert_eq!(got[0].header_values.len(), 2, "{:?}", got[0].header_values);
    assert_eq!(
        got[0].header_values.get("tenant"),
        Some(&AMQPValue::LongString("t1".into()))
    );
    assert_eq!(
        got[0].header_values.get("n"),
        Some(&AMQPValue::LongLongInt(7))
    );
    assert!(
        got[1].header_values.is_empty(),
        "{:?}",
        got[1].header_values
    );
    assert!(
        ob.flushed_past(returned_lsn, scaled(Duration::from_secs(10)))
            .await,
        "the slot moves on once the return is durably dead-lettered:\n{}",
        streamer.log()
    );
    assert_eq!(dead_letters(&ob), [row("min-unroutable", "returned", "1")]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unroutable_message_is_dead_lettered_and_the_stream_goes_on() {
    let pg = Postgres::shared();
    let url = RabbitMq::shared().url();
    let ob = Outbox::new(pg, &url, "ops_return").await;
    let exchange = support::unique("ops_return_only_ok");
    let queue = support::unique("ops_return_q");
    support::declare_bound_queue(&url, &exchange, &queue, "ok.#").await;
    ob.sql("SELECT outbox.emit('ok.1', '{}', '{}', 'ok-1')");
    let returned_lsn =
        lsn(&ob.sql("SELECT outbox.emit('nobody.home', '{\"x\": 1}', '{}', 'unroutable')"));
    ob.sql("SELECT outbox.emit('ok.2', '{}', '{}', 'ok-2')");
    let streamer = ob.run(&["--exchange", &exchange]);
    let got = support::drain_queue(&url, &queue, 2, scaled(Duration::from_secs(20))).await;
    let ids: Vec<_> = got.iter().map(|m| m.message_id.clone().unwrap()).collect();
    assert_eq!(ids, ["ok-1", "ok-2"], "{}", streamer.log());
    assert!(
        ob.flushed_past(returned_lsn, scaled(Duration::from_secs(10)))
            .await,
        "the slot moves on once the return is durably dead-lettered"
    );
    assert_eq!(dead_letters(&ob), [row("unroutable", "returned", "1")]);
    let log = streamer.log();
    assert!(log.contains("312 NO_ROUTE"), "{log}");
    // The CLI shows it, and a requeue after binding a queue delivers it with its id.
    let list = pgoutbox(&[
        "dead-letters",
        "list",
        "--json",
        "--database-url",
        &ob.url(),
    ]);
    let rows: serde_json::Value = serde_json::from_slice(&list.stdout).expect("list --json");
    assert_eq!(rows[0]["reason"], "returned");
    assert_eq!(rows[0]["topic"], "nobody.home");
    support::declare_bound_queue(&url, &exchange, &queue, "nobody.#").await;
    let out = pgoutbox(&[
        "dead-letters",
        "requeue",
        "--all",
        "--database-url",
        &ob.url(),
    ]);
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("requeued 1"),
        "{}",
        stderr(&out)
    );
    let got = support::drain_queue(&url, &queue, 1, scaled(Duration::from_secs(20))).await;
    assert_eq!(got.len(), 1);
    assert_eq!(got[0].message_id.as_deref(), Some("unroutable"));
    assert_eq!(got[0].body_str(), "{\"x\": 1}");
    let out = pgoutbox(&[
        "dead-letters",
        "purge",
        "--older-than",
        "0s",
        "--database-url",
        &ob.url(),
    ]);
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("purged 1"),
        "{}",
        stderr(&out)
    );
    assert!(dead_letters(&ob).is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unroutable_message_under_block_policy_holds_the_slot_until_routable() {
    let pg = Postgres::shared();
    let url = RabbitMq::shared().url();
    let ob = Outbox::new(pg, &url, "ops_block_policy").await;
    let exchange = support::unique("ops_block_policy_x");
    let queue = support::unique("ops_block_policy_q");
    support::declare_bound_queue(&url, &exchange, &queue, "ok.#").await;
    let stuck_lsn = ob.emit("later.1", "held");
    ob.sql("SELECT outbox.emit('ok.1', '{}', '{}', 'after-held')");
    let streamer = ob.run(&["--exchange", &exchange, "--on-unroutable", "block"]);
    assert!(
        streamer
            .wait_for_log("attempt=3", scaled(Duration::from_secs(20)))
            .await,
        "it keeps retrying:\n{}",
        streamer.log()
    );
    assert!(streamer
        .log()
        .contains("unroutable message blocks the outbox"));
    assert!(
        ob.not_acknowledged(stuck_lsn),
        "nothing at or after it is acknowledged"
    );
    assert!(dead_letters(&ob).is_empty());
    // An operator binds a queue: the retry goes through and the slot moves on.
    support::declare_bound_queue(&url, &exchange, &queue, "later.#").await;
    assert!(
        ob.flushed_past(stuck_lsn, scaled(Duration::from_secs(30)))
            .await,
        "{}",
        streamer.log()
    );
    let got = support::drain_queue(&url, &queue, 2, scaled(Duration::from_secs(10))).await;
    let mut ids: Vec<_> = got.iter().map(|m| m.message_id.clone().unwrap()).collect();
    ids.sort();
    assert_eq!(
        ids,
        ["after-held", "held"],
        "order inversion after a retry is allowed; loss is not"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nacked_message_is_retried_then_dead_lettered_then_requeued() {
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
    let nacked_lsn = lsn(&ob.sql("SELECT outbox.emit('a', '{\"n\": 2}', '{}', 'rejected')"));
    let streamer = ob.run(&["--exchange", &exchange, "--max-attempts", "3"]);
    assert!(
        ob.flushed_past(nacked_lsn, scaled(Duration::from_secs(30)))
            .await,
        "{}",
        streamer.log()
    );
    assert_eq!(dead_letters(&ob), [row("rejected", "nacked", "3")]);
    assert_eq!(
        streamer.log_count("message nacked by the broker; retrying"),
        2
    );
    // Permanent rejection, then an operator makes room and requeues: it is delivered.
    let first = support::drain_queue(&url, &queue, 1, scaled(Duration::from_secs(10))).await;
    assert_eq!(first[0].message_id.as_deref(), Some("fits"));
    let id = ob
        .sql("SELECT id FROM outbox.dead_letter")
        .trim()
        .to_owned();
    let out = pgoutbox(&[
        "dead-letters",
        "requeue",
        "--id",
        &id,
        "--database-url",
        &ob.url(),
    ]);
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("requeued 1"),
        "{}",
        stderr(&out)
    );
    let got = support::drain_queue(&url, &queue, 1, scaled(Duration::from_secs(20))).await;
    assert_eq!(got.len(), 1, "{}", streamer.log());
    assert_eq!(got[0].message_id.as_deref(), Some("rejected"));
    assert_eq!(got[0].body_str(), "{\"n\": 2}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn poison_and_oversized_messages_are_dead_lettered_raw() {
    let pg = Postgres::shared();
    let ob = Outbox::new(pg, &RabbitMq::shared().url(), "ops_poison").await;
    let streamer = ob.run(&["--max-message-bytes", "1000"]);
    ob.sql("SELECT outbox.emit('t', '{}', '{}', 'before')");
    assert_eq!(ob.drain(1, scaled(Duration::from_secs(20))).await.len(), 1);
    ob.sql("SELECT pg_logical_emit_message(false, 'pgoutbox', 'not from outbox.emit')");
    ob.sql("SELECT pg_logical_emit_message(true, 'pgoutbox', 'not an envelope')");
    ob.sql(
        "SELECT outbox.emit('t', jsonb_build_object('big', repeat('x', 2000)), '{}', 'too-big')",
    );
    let last = ob.emit("t", "after");
    let got = ob.drain(1, scaled(Duration::from_secs(20))).await;
    assert_eq!(
        got.iter()
            .map(|m| m.message_id.clone().unwrap())
            .collect::<Vec<_>>(),
        ["after"]
    );
    assert!(
        support::wait_until(scaled(Duration::from_secs(10)), || async {
            ob.confirmed_flush() >= last
        })
        .await,
        "the stream goes on past poison"
    );
    assert_eq!(
        dead_letters(&ob),
        [
            row("-", "poison", "0"),
            row("-", "poison", "0"),
            row("too-big", "too_large", "0")
        ]
    );
    let raw =
        ob.sql("SELECT convert_from(envelope, 'UTF8') FROM outbox.dead_letter ORDER BY id LIMIT 2");
    assert!(
        raw.contains("not from outbox.emit") && raw.contains("not an envelope"),
        "{raw}"
    );
    streamer.stop_ok(scaled(Duration::from_secs(20))).await;
}

/// Messages of the window tests: 5,000 of about 8 KB each (about 40 MB of WAL).
const WINDOW_TEST_MESSAGES: i64 = 5_000;
const WINDOW_TEST_PAD: usize = 8_000;

/// How far the server has sent the slot's stream (`pg_stat_replication.sent_lsn`).
fn sent_lsn(ob: &Outbox<'_>) -> Option<u64> {
    ob.sql("SELECT sent_lsn - '0/0'::pg_lsn FROM pg_stat_replication WHERE application_name LIKE 'pgoutbox-%'")
        .trim()
        .parse::<f64>()
        .ok()
        .map(|v| v as u64)
}

/// With the broker blocked (memory alarm) and `window_args` bounding the in-flight window,
/// the streamer stops reading the replication stream once the window is full, keeps the
/// connection alive with status updates and acknowledges nothing. SIGTERM then times out
/// (`--shutdown-timeout-s 1`) and the error counts the messages it had published and not
/// settled: the window, exactly. Once the broker is unblocked a new streamer delivers every
/// message, first deliveries in order. Returns (messages in flight at the SIGTERM, bytes of
/// WAL the server had sent past the first message, WAL the messages span, peak RSS in kB).
/// The sent position is a figure only: the replication socket's buffers (the receive buffer
/// autotunes up to `tcp_rmem`'s maximum, 32 MB here) can hold most of the load.
async fn blocked_broker_holds_the_window(window_args: &[&str], name: &str) -> (u64, u64, u64, u64) {
    let pg = Postgres::start_private(&[("wal_sender_timeout", "3s")]);
    let rmq = RabbitMq::start_private();
    let ob = Outbox::new(&pg, &rmq.url(), name).await;
    let mut args = vec!["--shutdown-timeout-s", "1"];
    args.extend_from_slice(window_args);
    let streamer = ob.run(&args);
    assert!(
        support::wait_until(scaled(Duration::from_secs(20)), || async {
            ob.slot_active()
        })
        .await
    );
    rmq.block();
    let first_lsn = ob.emit("b", "b-0");
    let per_txn = WINDOW_TEST_MESSAGES / 5;
    for t in 0..5 {
        ob.sql(&format!(
            "DO $$ BEGIN FOR n IN {}..{} LOOP PERFORM outbox.emit('b', jsonb_build_object('n', n, 'pad', repeat('x', {WINDOW_TEST_PAD})), '{{}}', 'b-' || n); END LOOP; END $$",
            t * per_txn + 1,
            t * per_txn + per_txn
        ));
    }
    let wal_end = lsn(&ob.sql("SELECT pg_current_wal_lsn()"));
    // Four times wal_sender_timeout with the broker blocked and the window full.
    let deadline = std::time::Instant::now() + Duration::from_secs(12);
    let mut sent_max = 0;
    while std::time::Instant::now() < deadline {
        assert!(
            streamer.try_status().is_none(),
            "streamer died:\n{}",
            streamer.log()
        );
        assert!(ob.slot_active(), "the replication connection was dropped");
        sent_max = sent_max.max(sent_lsn(&ob).unwrap_or(0));
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    assert!(
        ob.not_acknowledged(first_lsn),
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
    streamer.sigterm();
    let status = streamer.wait_exit(scaled(Duration::from_secs(30))).await;
    let log = streamer.log();
    assert_eq!(
        status.map(|s| s.success()),
        Some(false),
        "the drain timed out:\n{log}"
    );
    let in_flight: u64 = log
        .split("shutdown timed out with ")
        .nth(1)
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("the timed-out drain counts what was in flight:\n{log}"));
    assert!(
        ob.not_acknowledged(first_lsn),
        "nothing unconfirmed was acknowledged"
    );
    rmq.unblock();
    let again = ob.run(&[]);
    let total = WINDOW_TEST_MESSAGES as usize + 1;
    let got = ob.drain(total, scaled(Duration::from_secs(60))).await;
    let mut seen = std::collections::HashSet::new();
    let firsts: Vec<i64> = got
        .iter()
        .filter_map(|m| m.message_id.clone())
        .filter(|id| seen.insert(id.clone()))
        .map(|id| id[2..].parse().unwrap())
        .collect();
    assert_eq!(firsts.len(), total, "{}", again.log());
    assert!(firsts.windows(2).all(|w| w[0] < w[1]), "in order");
    (
        in_flight,
        sent_max.saturating_sub(first_lsn),
        wal_end - first_lsn,
        rss_kb,
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn blocked_broker_fills_the_window_without_losing_the_connection() {
    // 100 messages of 8 KB: the message bound is the one that binds (the byte bound, 16 MiB
    // by default, would allow 2,000).
    let (in_flight, sent, span, rss_kb) =
        blocked_broker_holds_the_window(&["--max-in-flight", "100"], "ops_block").await;
    eprintln!(
        "blocked broker, --max-in-flight 100: {in_flight} messages in flight at the SIGTERM; the server sent {sent} bytes of the {span} the messages span; peak RSS {rss_kb} kB"
    );
    assert!(
        in_flight <= 100,
        "{in_flight} messages in flight with --max-in-flight 100 (of {WINDOW_TEST_MESSAGES} emitted)"
    );
    assert!(in_flight >= 50, "the window filled: {in_flight} in flight");
    assert!(
        rss_kb < 128 * 1024,
        "memory stays bounded while the broker is blocked"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn blocked_broker_fills_the_byte_window() {
    // 64 KiB of payload: about 8 messages of 8 KB, while the message bound (10,000 by
    // default) would allow all 5,000.
    let (in_flight, sent, span, rss_kb) =
        blocked_broker_holds_the_window(&["--max-in-flight-bytes", "65536"], "ops_block_bytes")
            .await;
    eprintln!(
        "blocked broker, --max-in-flight-bytes 65536: {in_flight} messages in flight at the SIGTERM; the server sent {sent} bytes of the {span} the messages span; peak RSS {rss_kb} kB"
    );
    // The window admits a message while it holds less than the bound, so one message may
    // take it past: the tiny first message (`b-0`), then 65,536 / 8,000 + 1 large ones.
    let bound = 1 + 65_536 / WINDOW_TEST_PAD as u64 + 1;
    assert!(
        in_flight <= bound,
        "{in_flight} messages of about {WINDOW_TEST_PAD} bytes in flight with --max-in-flight-bytes 65536 (at most {bound})"
    );
    assert!(in_flight >= 1, "the window filled: {in_flight} in flight");
}
