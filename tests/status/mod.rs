//! `status` as a probe (exit 0 healthy, 1 warning, 2 critical, with the report's fields) and
//! `peek` (the outbox messages waiting in a slot, without consuming them), against real
//! servers: a healthy slot, a lagging one, an unrequeued dead letter, a really invalidated
//! slot, a missing publication or slot.
//!
//! `PGOUTBOX_TEST_BIN` runs the commands through another binary (an old build).

use std::process::Output;
use std::time::Duration;

use crate::support::cli::bin;
use crate::support::{self, scaled, Outbox, Postgres, RabbitMq, Streamer};

/// Runs `pgoutbox ARGS --database-url … --slot …` through [`bin`].
fn cmd(ob: &Outbox<'_>, args: &[&str]) -> Output {
    let url = ob.url();
    let mut full: Vec<&str> = args.to_vec();
    full.extend_from_slice(&["--database-url", &url, "--slot", &ob.slot]);
    let mut c = std::process::Command::new(bin());
    for (k, _) in std::env::vars() {
        if k.starts_with("PGOUTBOX_") && !k.starts_with("PGOUTBOX_TEST_") {
            c.env_remove(k);
        }
    }
    c.args(&full)
        .env("NO_COLOR", "1")
        .env("RUST_BACKTRACE", "0")
        .output()
        .expect("run pgoutbox")
}

/// `status --json --publication P ARGS`: (exit code, the object, stderr).
fn status(ob: &Outbox<'_>, args: &[&str]) -> (Option<i32>, serde_json::Value, String) {
    let mut full = vec!["status", "--json", "--publication", &ob.publication];
    full.extend_from_slice(args);
    let out = cmd(ob, &full);
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    let json = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "status printed no JSON ({e}), exit {:?}: {}{err}",
            out.status.code(),
            String::from_utf8_lossy(&out.stdout)
        )
    });
    (out.status.code(), json, err)
}

/// `peek --json --publication P ARGS`: (exit code, the object or null, stderr).
fn peek(ob: &Outbox<'_>, args: &[&str]) -> (Option<i32>, serde_json::Value, String) {
    let mut full = vec!["peek", "--json", "--publication", &ob.publication];
    full.extend_from_slice(args);
    let out = cmd(ob, &full);
    let json = serde_json::from_slice(&out.stdout).unwrap_or(serde_json::Value::Null);
    (
        out.status.code(),
        json,
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// Decoding reads only flushed WAL and the test cluster commits asynchronously: one
/// synchronous commit that writes WAL flushes everything before it.
fn flush_wal(ob: &Outbox<'_>) {
    ob.sql("BEGIN; SET LOCAL synchronous_commit = on; SELECT pg_logical_emit_message(true, 'not-ours', ''); COMMIT;");
}

fn problems(json: &serde_json::Value) -> String {
    json["problems"].to_string()
}

async fn wait_active(ob: &Outbox<'_>, streamer: &Streamer) {
    assert!(
        support::wait_until(scaled(Duration::from_secs(30)), || async {
            ob.slot_active()
        })
        .await,
        "the streamer took the slot:\n{}",
        streamer.log()
    );
}

/// Healthy (0) while a streamer holds the slot; inactive is a warning (1) with the waiting
/// messages counted; an unrequeued dead letter is a warning naming its reason and error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_exit_codes_for_healthy_inactive_and_dead_lettered_slots() {
    let pg = Postgres::shared();
    let ob = Outbox::new(pg, &RabbitMq::shared().url(), "status_codes").await;
    // Inactive, two messages waiting.
    ob.sql("SELECT outbox.emit('st.a', '{}', '{}', 'w1'); SELECT outbox.emit('st.a', '{}', '{}', 'w2')");
    flush_wal(&ob);
    let (code, json, err) = status(&ob, &[]);
    assert_eq!(code, Some(1), "inactive is a warning: {json} {err}");
    assert_eq!(json["severity"], "warning", "{json}");
    assert_eq!(json["pending_outbox_messages"], 2, "{json}");
    assert!(problems(&json).contains("is inactive"), "{json}");
    assert!(err.contains("warning: slot"), "{err}");
    for key in [
        "slot",
        "active",
        "active_pid",
        "holder",
        "confirmed_flush_lsn",
        "lag_bytes",
        "wal_status",
        "plugin",
        "restart_lsn",
        "retained_wal_bytes",
        "safe_wal_size",
        "max_slot_wal_keep_size",
        "dead_letters",
        "newest_dead_letter_reason",
        "newest_dead_letter_error",
    ] {
        assert!(json.get(key).is_some(), "{key} in {json}");
    }
    assert!(json["retained_wal_bytes"].as_i64().unwrap() > 0, "{json}");
    assert_eq!(json["max_slot_wal_keep_size"], "-1", "{json}");

    // Active, drained: healthy.
    let streamer = ob.run(&["--instance-id", "status-healthy"]);
    assert_eq!(ob.drain(2, scaled(Duration::from_secs(20))).await.len(), 2);
    wait_active(&ob, &streamer).await;
    let (code, json, err) = status(&ob, &[]);
    assert_eq!(code, Some(0), "healthy: {json} {err}");
    assert_eq!(json["severity"], "healthy");
    assert_eq!(json["holder"], "pgoutbox-status-healthy", "{json}");
    assert!(json["pending_outbox_messages"].is_null(), "{json}");
    assert!(
        json["pending_outbox_messages_unknown"]
            .as_str()
            .unwrap_or("")
            .contains("unknown while the slot is active"),
        "{json}"
    );
    // The text form says the same.
    let out = cmd(&ob, &["status", "--publication", &ob.publication]);
    let text = String::from_utf8_lossy(&out.stdout);
    eprintln!("status (text) of a healthy slot:\n{text}");
    assert_eq!(out.status.code(), Some(0), "{text}");
    assert!(text.contains("severity:               healthy"), "{text}");
    assert!(
        text.contains("waiting messages:       unknown while the slot is active"),
        "{text}"
    );
    assert!(
        text.contains("(pid ") && text.contains("pgoutbox-status-healthy"),
        "{text}"
    );
    streamer.sigterm();
    streamer.wait_exit(scaled(Duration::from_secs(20))).await;

    // A real dead letter: an exchange with no queue bound returns the message.
    let unbound = support::unique("status_unbound_x");
    let streamer = ob.run(&["--exchange", &unbound, "--instance-id", "status-dl"]);
    ob.sql("SELECT outbox.emit('st.nowhere', '{}', '{}', 'dl1')");
    assert!(
        support::wait_until(scaled(Duration::from_secs(30)), || async {
            ob.sql("SELECT count(*) FROM outbox.dead_letter").trim() == "1"
        })
        .await,
        "dead-lettered:\n{}",
        streamer.log()
    );
    wait_active(&ob, &streamer).await;
    let (code, json, err) = status(&ob, &[]);
    assert_eq!(
        code,
        Some(1),
        "an unrequeued dead letter warns: {json} {err}"
    );
    assert_eq!(json["dead_letters"], 1, "{json}");
    assert_eq!(json["newest_dead_letter_reason"], "returned", "{json}");
    assert!(
        json["newest_dead_letter_error"]
            .as_str()
            .unwrap_or("")
            .contains("NO_ROUTE")
            || json["newest_dead_letter_error"]
                .as_str()
                .unwrap_or("")
                .contains("unroutable"),
        "{json}"
    );
    assert!(
        problems(&json).contains("1 dead letters are not requeued"),
        "{json}"
    );
    // Purged, the slot is healthy again.
    ob.sql("DELETE FROM outbox.dead_letter");
    let (code, json, _) = status(&ob, &[]);
    assert_eq!(code, Some(0), "{json}");
    streamer.sigterm();
    streamer.wait_exit(scaled(Duration::from_secs(20))).await;
}

/// Lag over --warn-lag-bytes warns (1), over --crit-lag-bytes is critical (2), while a
/// streamer holds the slot and one unroutable message blocks it (`--on-unroutable block`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_exit_codes_for_a_lagging_slot() {
    let pg = Postgres::shared();
    let ob = Outbox::new(pg, &RabbitMq::shared().url(), "status_lag").await;
    let unbound = support::unique("status_lag_x");
    let streamer = ob.run(&["--exchange", &unbound, "--on-unroutable", "block"]);
    wait_active(&ob, &streamer).await;
    ob.sql("SELECT outbox.emit('st.blocked', '{}', '{}', 'blocker')");
    assert!(
        streamer
            .wait_for_log(
                "unroutable message blocks the outbox",
                scaled(Duration::from_secs(30))
            )
            .await,
        "{}",
        streamer.log()
    );
    ob.sql("CREATE TABLE junk (x text); INSERT INTO junk SELECT repeat('x', 1000) FROM generate_series(1, 2000)");
    // The test cluster commits asynchronously: wait until the WAL writer has written it out.
    let mut lag = 0;
    assert!(
        support::wait_until(scaled(Duration::from_secs(10)), || {
            lag = ob.lag_bytes();
            let now = lag;
            async move { now > 1_000_000 }
        })
        .await,
        "lag {lag}"
    );
    let (code, json, err) = status(&ob, &[]);
    assert_eq!(code, Some(0), "under the default bounds: {json} {err}");
    let (code, json, err) = status(&ob, &["--warn-lag-bytes", "500000"]);
    assert_eq!(code, Some(1), "{json} {err}");
    assert!(
        problems(&json).contains("more than --warn-lag-bytes 500000"),
        "{json}"
    );
    let (code, json, err) = status(
        &ob,
        &["--warn-lag-bytes", "500000", "--crit-lag-bytes", "900000"],
    );
    assert_eq!(code, Some(2), "{json} {err}");
    assert_eq!(json["severity"], "critical");
    assert!(
        problems(&json).contains("more than --crit-lag-bytes 900000"),
        "{json}"
    );
    assert!(err.contains("critical: slot"), "{err}");
    // Bounds the wrong way round are a usage error naming both.
    let out = cmd(
        &ob,
        &["status", "--warn-lag-bytes", "10", "--crit-lag-bytes", "5"],
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(
        err.contains("invalid setting --crit-lag-bytes (PGOUTBOX_CRIT_LAG_BYTES) = \"5\": must be at least --warn-lag-bytes (10)"),
        "{err}"
    );
    streamer.kill9();
}

/// A slot really invalidated (small `max_slot_wal_keep_size`, streamer stopped, WAL
/// written past it) is critical with `wal_status` `lost`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_is_critical_for_a_really_lost_slot() {
    let pg = Postgres::start_private(&[
        ("max_slot_wal_keep_size", "64MB"),
        ("max_wal_size", "96MB"),
        ("min_wal_size", "32MB"),
    ]);
    let ob = Outbox::new(&pg, &RabbitMq::shared().url(), "status_lost").await;
    let streamer = ob.run(&[]);
    ob.sql("SELECT outbox.emit('st.lost', '{}', '{}', 'before')");
    assert_eq!(ob.drain(1, scaled(Duration::from_secs(20))).await.len(), 1);
    streamer.sigterm();
    streamer.wait_exit(scaled(Duration::from_secs(20))).await;
    let (code, json, err) = status(&ob, &[]);
    assert_eq!(code, Some(1), "stopped, not yet lost: {json} {err}");
    assert_eq!(json["max_slot_wal_keep_size"], "64MB", "{json}");
    assert_eq!(json["max_slot_wal_keep_size_bytes"], 64 << 20, "{json}");
    assert!(json["safe_wal_size"].as_i64().is_some(), "{json}");
    ob.sql("CREATE TABLE junk (x text)");
    for _ in 0..6 {
        ob.sql("INSERT INTO junk SELECT repeat(md5(random()::text), 32) FROM generate_series(1, 50000)");
        ob.sql("CHECKPOINT");
    }
    let (code, json, err) = status(&ob, &[]);
    assert_eq!(json["wal_status"], "lost", "{json}");
    assert_eq!(code, Some(2), "{json} {err}");
    assert!(
        problems(&json).contains("is lost (wal_status = 'lost')"),
        "{json}"
    );
    assert!(json["safe_wal_size"].is_null(), "{json}");
    let (code, _, err) = peek(&ob, &[]);
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains("is lost"), "{err}");
}

/// A missing publication or slot is critical (2), and still a report.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_is_critical_for_a_missing_publication_or_slot() {
    let pg = Postgres::shared();
    let ob = Outbox::new(pg, &RabbitMq::shared().url(), "status_missing").await;
    ob.sql(&format!("DROP PUBLICATION \"{}\"", ob.publication));
    let (code, json, err) = status(&ob, &[]);
    assert_eq!(code, Some(2), "{json} {err}");
    assert_eq!(json["publication_exists"], false, "{json}");
    assert!(
        problems(&json).contains("does not exist in this database"),
        "{json}"
    );
    ob.sql(&format!("SELECT pg_drop_replication_slot('{}')", ob.slot));
    let (code, json, err) = status(&ob, &[]);
    assert_eq!(code, Some(2), "{json} {err}");
    assert_eq!(json["slot_exists"], false, "{json}");
    assert!(err.contains("critical: replication slot"), "{err}");
    // A server it cannot reach is critical too.
    let out = std::process::Command::new(bin())
        .args([
            "status",
            "--database-url",
            "postgres://postgres@127.0.0.1:1/db?connect_timeout=2",
        ])
        .output()
        .expect("run");
    assert_eq!(
        out.status.code(),
        Some(2),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// `peek` lists the waiting messages (ids, LSNs, commit LSN and time, headers, sizes),
/// payloads only with --payload, at most --limit, consumes nothing (the streamer delivers
/// all of them afterwards, with the LSNs peek showed), and names the holder while a streamer
/// holds the slot.
/// The `application_name`s of this outbox database's client sessions (not the walsender,
/// not the test's psql), sorted, comma-separated.
fn client_application_names(ob: &Outbox<'_>) -> String {
    ob.sql(&format!(
        "SELECT coalesce(string_agg(application_name, ',' ORDER BY application_name), '') FROM pg_stat_activity
         WHERE datname = '{}' AND backend_type = 'client backend' AND application_name <> 'psql'",
        ob.db
    ))
    .trim()
    .to_owned()
}

/// `run`'s ordinary SQL sessions (the pipeline's, the dead-letter writer's, the retention
/// task's) are named in `pg_stat_activity` with the instance id, as its walsender is:
/// `pgoutbox-ID`, `pgoutbox-ID dead-letter`, `pgoutbox-ID retention`; an
/// `application_name` in the URL names them all instead.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn run_names_its_sql_sessions_unless_the_url_does() {
    let pg = Postgres::shared();
    let ob = Outbox::new(pg, &RabbitMq::shared().url(), "status_appname").await;
    let want = "pgoutbox-appname,pgoutbox-appname dead-letter,pgoutbox-appname retention";
    let streamer = ob.run(&["--instance-id", "appname"]);
    wait_active(&ob, &streamer).await;
    let named = support::wait_until(scaled(Duration::from_secs(30)), || async {
        client_application_names(&ob) == want
    })
    .await;
    assert!(
        named,
        "sessions: {:?}, want {want:?}\n{}",
        client_application_names(&ob),
        streamer.log()
    );
    streamer.stop(scaled(Duration::from_secs(20))).await;
    let url = format!("{}?application_name=mine", ob.streamer_url());
    let streamer = ob.run_with_url(&url, &[]);
    wait_active(&ob, &streamer).await;
    let named = support::wait_until(scaled(Duration::from_secs(30)), || async {
        client_application_names(&ob) == "mine,mine,mine"
    })
    .await;
    assert!(
        named,
        "sessions: {:?}, want the URL's name on all three\n{}",
        client_application_names(&ob),
        streamer.log()
    );
    streamer.stop(scaled(Duration::from_secs(20))).await;
}

/// `peek --payload` shows a UTF-8 payload as text and any other as base64, saying which
/// (`payload_encoding`; in text, `payload (base64, not UTF-8):`), so bytes are never
/// mangled into U+FFFD.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn peek_shows_a_binary_payload_as_base64() {
    let pg = Postgres::shared();
    let ob = Outbox::new(pg, &RabbitMq::shared().url(), "status_peek_bin").await;
    ob.sql("SELECT outbox.emit_bytes('pk.bin', '\\x00ff80fe'::bytea, 'application/octet-stream', '{}', 'bin-1')");
    ob.sql("SELECT outbox.emit_bytes('pk.txt', convert_to('grüße', 'UTF8'), 'text/plain', '{}', 'txt-1')");
    flush_wal(&ob);
    let (code, json, err) = peek(&ob, &["--payload"]);
    assert_eq!(code, Some(0), "{err}");
    let msgs = json["messages"].as_array().expect("messages");
    assert_eq!(msgs.len(), 2, "{json}");
    assert_eq!(msgs[0]["payload"], "AP+A/g==", "{json}");
    assert_eq!(msgs[0]["payload_encoding"], "base64", "{json}");
    assert_eq!(msgs[0]["payload_bytes"], 4, "{json}");
    assert_eq!(msgs[1]["payload"], "grüße", "{json}");
    assert_eq!(msgs[1]["payload_encoding"], "utf-8", "{json}");
    let out = cmd(
        &ob,
        &["peek", "--payload", "--publication", &ob.publication],
    );
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("  payload (base64, not UTF-8): AP+A/g==\n")
            && text.contains("  payload: grüße\n"),
        "{text}"
    );
    // Without --payload, neither.
    let (_, json, _) = peek(&ob, &[]);
    for m in json["messages"].as_array().expect("messages") {
        assert!(
            m.get("payload").is_none() && m.get("payload_encoding").is_none(),
            "{m}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn peek_lists_waiting_messages_without_consuming_them() {
    let pg = Postgres::shared();
    let ob = Outbox::new(pg, &RabbitMq::shared().url(), "status_peek").await;
    let (code, json, err) = peek(&ob, &[]);
    assert_eq!(code, Some(0), "{err}");
    assert_eq!(json["messages"], serde_json::json!([]), "{json}");
    ob.sql("BEGIN; SELECT outbox.emit('pk.one', '{\"n\": 1}', '{\"h\": \"x\"}', 'p1'); SELECT outbox.emit('pk.two', '{\"n\": 2}', '{}', 'p2'); COMMIT;");
    ob.sql("SELECT pg_logical_emit_message(true, 'not-ours', 'skip me')");
    // p3 names the outbox's own exchange explicitly, so it still reaches the queue below.
    ob.sql(&format!("SELECT outbox.emit('pk.three', '{{\"n\": 3}}', '{{}}', 'p3', exchange => '{}', tenant => 'acme', aggregate_id => 'order-7', aggregate_version => 3, priority => 5, expiration => 60000)", ob.exchange));
    flush_wal(&ob);
    let (code, json, err) = peek(&ob, &[]);
    assert_eq!(code, Some(0), "{err}");
    let msgs = json["messages"].as_array().expect("messages").clone();
    let ids: Vec<&str> = msgs
        .iter()
        .map(|m| m["message_id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, ["p1", "p2", "p3"], "{json}");
    assert_eq!(msgs[0]["topic"], "pk.one");
    assert_eq!(msgs[0]["headers"], serde_json::json!({"h": "x"}));
    assert_eq!(
        msgs[0]["commit_lsn"], msgs[1]["commit_lsn"],
        "one transaction"
    );
    assert_ne!(msgs[1]["commit_lsn"], msgs[2]["commit_lsn"]);
    assert!(
        msgs[0]["commit_time"].as_str().unwrap().ends_with('Z'),
        "{json}"
    );
    assert!(msgs[0]["size_bytes"].as_u64().unwrap() > 8, "{json}");
    assert_eq!(msgs[0]["payload_bytes"], 8, "{json}");
    // The v3 fields: only what the producer gave, under the envelope's own keys.
    assert_eq!(msgs[0]["envelope_version"], 3, "{json}");
    assert_eq!(msgs[0]["exchange"], serde_json::Value::Null, "{json}");
    assert_eq!(msgs[0]["metadata"], serde_json::json!({}), "{json}");
    assert_eq!(msgs[2]["exchange"], ob.exchange.as_str(), "{json}");
    assert_eq!(
        msgs[2]["metadata"],
        serde_json::json!({"aggregate_id": "order-7", "aggregate_version": 3, "tenant": "acme", "expiration_ms": 60000, "priority": 5}),
        "{json}"
    );
    for m in &msgs {
        assert!(
            m.get("payload").is_none(),
            "no payload without --payload: {m}"
        );
    }
    let lsns: Vec<u64> = msgs
        .iter()
        .map(|m| support::lsn(m["lsn"].as_str().unwrap()))
        .collect();
    assert!(lsns.windows(2).all(|w| w[0] < w[1]), "{lsns:?}");
    // --payload, --limit.
    let (_, json, _) = peek(&ob, &["--payload", "--limit", "2"]);
    let limited = json["messages"].as_array().expect("messages");
    assert_eq!(limited.len(), 2, "{json}");
    assert_eq!(json["more"], true, "{json}");
    assert_eq!(limited[1]["payload"], "{\"n\": 2}", "{json}");
    // Text form names the same.
    let out = cmd(
        &ob,
        &["peek", "--publication", &ob.publication, "--limit", "1"],
    );
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("topic=pk.one") && text.contains("id=p1"),
        "{text}"
    );
    assert!(text.contains("more waiting beyond --limit 1"), "{text}");
    assert!(
        !text.contains("exchange=") && !text.contains("metadata="),
        "{text}"
    );
    let out = cmd(&ob, &["peek", "--publication", &ob.publication]);
    let text = String::from_utf8_lossy(&out.stdout);
    let third = text.lines().find(|l| l.contains("id=p3")).unwrap_or("");
    assert!(
        third.contains(&format!("  exchange={}  metadata={{\"aggregate_id\":\"order-7\",\"aggregate_version\":3,\"expiration_ms\":60000,\"priority\":5,\"tenant\":\"acme\"}}", ob.exchange)),
        "{text}"
    );
    // Nothing was consumed: the streamer delivers all three, with the LSNs peek showed.
    let streamer = ob.run(&["--instance-id", "peek-holder"]);
    let got = ob.drain(3, scaled(Duration::from_secs(20))).await;
    let got_ids: Vec<String> = got
        .iter()
        .map(|m| m.message_id.clone().unwrap_or_default())
        .collect();
    assert_eq!(got_ids, ["p1", "p2", "p3"]);
    let got_lsns: Vec<u64> = got
        .iter()
        .map(|m| support::lsn(&m.headers["x-pgoutbox-lsn"]))
        .collect();
    assert_eq!(got_lsns, lsns);
    // While it holds the slot, peek says so and names it.
    wait_active(&ob, &streamer).await;
    let (code, _, err) = peek(&ob, &[]);
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains("is active, held by pid"), "{err}");
    assert!(
        err.contains("application_name pgoutbox-peek-holder"),
        "{err}"
    );
    streamer.sigterm();
    streamer.wait_exit(scaled(Duration::from_secs(20))).await;
}

/// Issue 21 item 14: decoding reads only flushed WAL, and under `synchronous_commit = off`
/// a committed emit may not be flushed yet (here the WAL writer waits 10 s between
/// flushes): `status` and `peek` flush the WAL first instead of saying "0 waiting".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_and_peek_count_a_commit_not_yet_flushed() {
    let pg = Postgres::start_private(&[("wal_writer_delay", "10000ms")]);
    let ob = Outbox::new(&pg, &RabbitMq::shared().url(), "status_async").await;
    // Whatever the set-up wrote is flushed; the emit below is not.
    flush_wal(&ob);
    ob.sql("SET synchronous_commit = off; SELECT outbox.emit('st.a', '{}', '{}', 'async-1')");
    let (_, json, err) = status(&ob, &[]);
    assert_eq!(json["pending_outbox_messages"], 1, "{json} {err}");
    ob.sql("SET synchronous_commit = off; SELECT outbox.emit('st.a', '{}', '{}', 'async-2')");
    let (code, json, err) = peek(&ob, &[]);
    assert_eq!(code, Some(0), "{err}");
    let ids: Vec<&str> = json["messages"]
        .as_array()
        .map(|m| m.iter().filter_map(|m| m["message_id"].as_str()).collect())
        .unwrap_or_default();
    assert_eq!(ids, ["async-1", "async-2"], "{json}");
}
