//! The delivery journal (`run --journal`, `pgoutbox journal`), retention (`run`'s task,
//! `--idempotency-retention`, `--journal-retention`) and `pgoutbox maintenance`.
//!
//! One database per test on the shared Postgres and RabbitMQ; `run` connects as the
//! least-privilege streamer role, so the grants of sql/roles.sql are exercised too.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use crate::support::cli::pgoutbox;
use crate::support::{self, scaled, Outbox, Postgres, RabbitMq, Received};

const IDLE: Duration = Duration::from_secs(15);

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// Emits `per_txn` messages in each of `txns` transactions, ids `{prefix}-{t}-{i}`, topic
/// `journal.t{t}`; the last commit is synchronous so decoding sees everything.
fn emit(ob: &Outbox<'_>, prefix: &str, txns: usize, per_txn: usize) -> Vec<String> {
    let mut ids = Vec::new();
    let mut sql = String::new();
    for t in 0..txns {
        sql.push_str("BEGIN;");
        for i in 0..per_txn {
            let id = format!("{prefix}-{t}-{i}");
            sql.push_str(&format!(
                "SELECT outbox.emit('journal.t{t}', '{{\"i\": {i}}}', '{{}}', '{id}');"
            ));
            ids.push(id);
        }
        if t + 1 == txns {
            sql.push_str("SET LOCAL synchronous_commit = on;");
        }
        sql.push_str("COMMIT;");
    }
    ob.sql(&sql);
    ids
}

/// Stops `run` with SIGTERM and asserts it exited 0.
async fn stop(streamer: &support::Streamer) {
    streamer.sigterm();
    let status = streamer.wait_exit(scaled(Duration::from_secs(30))).await;
    assert_eq!(
        status.and_then(|s| s.code()),
        Some(0),
        "run exit: {}",
        streamer.log()
    );
}

fn count(ob: &Outbox<'_>, sql: &str) -> i64 {
    ob.sql(sql)
        .trim()
        .parse()
        .unwrap_or_else(|e| panic!("{sql}: {e}"))
}

/// Waits until `run` holds the slot and streams.
async fn wait_streaming(streamer: &support::Streamer) {
    assert!(
        streamer
            .wait_for_log("streaming", scaled(Duration::from_secs(30)))
            .await,
        "run did not start: {}",
        streamer.log()
    );
}

/// `run --journal`: exactly one row per confirmed message with its id, topic, both LSNs
/// (as the consumer saw them in the headers), attempts, confirm time and slot, written in
/// a handful of statements (not one per message); `pgoutbox journal ID` prints a message's
/// rows (exit 0), several after a redelivery, and exits 1 for an id it never saw.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn journal_holds_one_row_per_confirmed_message_and_prints_them() {
    let pg = Postgres::shared();
    let ob = Outbox::new(pg, &RabbitMq::shared().url(), "journal_rows").await;
    let before = count(
        &ob,
        "SELECT floor(extract(epoch FROM now()) * 1000000)::bigint",
    );
    let streamer = ob.run(&["--journal"]);
    wait_streaming(&streamer).await;
    let ids = emit(&ob, "jr", 5, 10);
    let got = ob.drain(ids.len(), scaled(IDLE)).await;
    assert_eq!(got.len(), ids.len(), "{}", streamer.log());
    // Acknowledged (the slot moved past every message) whatever the journal did.
    let last = got
        .iter()
        .map(|m| support::lsn(&m.headers["x-pgoutbox-commit-lsn"]))
        .max()
        .unwrap();
    assert!(
        ob.flushed_past(last, scaled(Duration::from_secs(20))).await,
        "the slot moved past every message"
    );
    stop(&streamer).await;
    let after = count(
        &ob,
        "SELECT floor(extract(epoch FROM now()) * 1000000)::bigint",
    );

    assert_eq!(count(&ob, "SELECT count(*) FROM outbox.journal"), 50);
    let rows: BTreeMap<String, Vec<String>> = ob
        .sql("SELECT message_id, topic, lsn::text, commit_lsn::text, attempts, floor(extract(epoch FROM confirmed_at) * 1000000)::bigint, slot_name, exchange FROM outbox.journal")
        .lines()
        .filter(|l| !l.is_empty())
        .map(|l| {
            let f: Vec<String> = l.split('|').map(str::to_owned).collect();
            (f[0].clone(), f)
        })
        .collect();
    assert_eq!(rows.len(), 50, "one row per message id");
    let by_id: BTreeMap<String, &Received> = got
        .iter()
        .map(|m| (m.message_id.clone().unwrap_or_default(), m))
        .collect();
    for id in &ids {
        let row = rows
            .get(id)
            .unwrap_or_else(|| panic!("no journal row for {id}"));
        let m = by_id[id];
        assert_eq!(row[1], m.routing_key, "topic of {id}");
        assert_eq!(row[2], m.headers["x-pgoutbox-lsn"], "lsn of {id}");
        assert_eq!(
            row[3], m.headers["x-pgoutbox-commit-lsn"],
            "commit lsn of {id}"
        );
        assert_eq!(row[4], "1", "attempts of {id}");
        let confirmed: i64 = row[5].parse().unwrap();
        let commit: i64 = m.headers["x-pgoutbox-commit-time-us"].parse().unwrap();
        assert!(
            before <= confirmed && confirmed <= after && commit <= confirmed + 1_000_000,
            "confirm time of {id}: {before} <= {confirmed} <= {after}, commit {commit}"
        );
        assert_eq!(row[6], ob.slot, "slot of {id}");
        assert_eq!(row[7], m.exchange, "exchange of {id}");
        assert_eq!(row[7], ob.exchange, "exchange of {id}");
    }
    // Batched: a few statements for 50 messages (the interval and the final write).
    let writes = streamer.log_count("journal rows written");
    assert!(
        (1..=3).contains(&writes),
        "{writes} writes: {}",
        streamer.log()
    );

    // `pgoutbox journal ID`.
    let url = ob.url();
    let out = pgoutbox(&["journal", "jr-2-3", "--database-url", &url]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let printed = text(&out.stdout);
    let lines: Vec<&str> = printed.lines().collect();
    assert_eq!(lines.len(), 1, "{printed}");
    let m = by_id["jr-2-3"];
    for part in [
        "id=jr-2-3".to_owned(),
        "topic=journal.t2".to_owned(),
        format!("lsn={}", m.headers["x-pgoutbox-lsn"]),
        format!("commit_lsn={}", m.headers["x-pgoutbox-commit-lsn"]),
        "attempts=1".to_owned(),
        format!("exchange={}", ob.exchange),
        format!("slot={}", ob.slot),
    ] {
        assert!(lines[0].contains(&part), "{part} in {printed}");
    }
    assert!(lines[0].ends_with(&format!("slot={}", ob.slot)));
    assert!(lines[0].contains('T') && lines[0].split_whitespace().next().unwrap().ends_with('Z'));
    // A redelivery (here: a row as a second confirmed delivery would write it): both, in
    // confirm order.
    ob.sql("INSERT INTO outbox.journal SELECT message_id, topic, lsn, commit_lsn, 3, confirmed_at + interval '1 minute', slot_name FROM outbox.journal WHERE message_id = 'jr-2-3'");
    let out = pgoutbox(&["journal", "jr-2-3", "--database-url", &url, "--json"]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let entries = json.as_array().unwrap();
    assert_eq!(entries.len(), 2, "{json}");
    assert_eq!(entries[0]["attempts"], 1);
    assert_eq!(entries[1]["attempts"], 3);
    assert_eq!(entries[1]["topic"], "journal.t2");
    assert_eq!(entries[0]["exchange"], ob.exchange.as_str());
    // The copied row, like one written before the column existed, has none.
    assert_eq!(entries[1]["exchange"], serde_json::Value::Null);
    // An id never confirmed: exit 1, said on stderr.
    let out = pgoutbox(&["journal", "never-sent", "--database-url", &url]);
    assert_eq!(out.status.code(), Some(1));
    assert!(text(&out.stdout).is_empty());
    assert!(
        text(&out.stderr).contains("no journal entries for message id \"never-sent\""),
        "{}",
        text(&out.stderr)
    );
    // A bad connection string is an error (exit 1), not "none".
    let out = pgoutbox(&[
        "journal",
        "x",
        "--database-url",
        "postgres://u@127.0.0.1:1/db",
    ]);
    assert_eq!(out.status.code(), Some(1));
}

/// A journal that cannot be written (the streamer lost its INSERT privilege) costs only
/// its rows: every message is delivered and acknowledged, the failure is logged and
/// counted, and `run` exits 0.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_journal_never_holds_back_delivery() {
    let pg = Postgres::shared();
    let ob = Outbox::new(pg, &RabbitMq::shared().url(), "journal_fail").await;
    let streamer = ob.run(&["--journal"]);
    wait_streaming(&streamer).await;
    // Revoked while it runs (at start, `run --journal` would refuse: errors::
    // least_privilege_streamer_is_told_the_grants_then_dead_letters).
    ob.sql(&format!(
        "REVOKE INSERT ON outbox.journal FROM {}",
        support::fixture::STREAMER_ROLE
    ));
    let ids = emit(&ob, "jf", 2, 10);
    let got = ob.drain(ids.len(), scaled(IDLE)).await;
    assert_eq!(got.len(), ids.len(), "{}", streamer.log());
    let end = count(&ob, "SELECT pg_current_wal_lsn() - '0/0'::pg_lsn") as u64;
    let last = got
        .iter()
        .map(|m| support::lsn(&m.headers["x-pgoutbox-commit-lsn"]))
        .max()
        .unwrap();
    assert!(last < end);
    assert!(
        ob.flushed_past(last, scaled(Duration::from_secs(20))).await,
        "the slot moved past every message"
    );
    stop(&streamer).await;
    assert_eq!(count(&ob, "SELECT count(*) FROM outbox.journal"), 0);
    let log = streamer.log();
    assert!(log.contains("delivery journal write failed"), "{log}");
}

/// Backdated rows: `idempotency_keys` keys (8 days old), `journal_rows` journal rows (8
/// days old), and 3 of each from now.
fn backdate(ob: &Outbox<'_>, idempotency_keys: usize, journal_rows: usize) {
    ob.sql(&format!(
        "INSERT INTO outbox.idempotency (tenant, idempotency_key, message_id, created_at)
           SELECT CASE WHEN g % 2 = 0 THEN '' ELSE 'acme' END, 'old-' || g, 'm-' || g, now() - interval '8 days'
           FROM generate_series(1, {idempotency_keys}) g;
         INSERT INTO outbox.idempotency (tenant, idempotency_key, message_id)
           SELECT '', 'new-' || g, 'n-' || g FROM generate_series(1, 3) g;
         INSERT INTO outbox.journal (message_id, topic, lsn, commit_lsn, attempts, confirmed_at, slot_name)
           SELECT 'old-' || g, 't', '0/10', '0/20', 1, now() - interval '8 days' - g * interval '1 second', 's'
           FROM generate_series(1, {journal_rows}) g;
         INSERT INTO outbox.journal (message_id, topic, lsn, commit_lsn, attempts, confirmed_at, slot_name)
           SELECT 'new-' || g, 't', '0/10', '0/20', 1, now() - interval '1 hour', 's'
           FROM generate_series(1, 3) g;"
    ));
}

/// `pgoutbox maintenance`: deletes the idempotency keys and journal rows older than their
/// retention in statements of at most --batch-size rows and keeps the newer ones; reports
/// each table (the inbox skipped while sql/inbox.sql is not installed); 0 turns a table's
/// retention off; bad values exit 2 naming the flag; a failed step exits 1.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn maintenance_deletes_expired_keys_and_journal_rows_in_batches() {
    let pg = Postgres::shared();
    let ob = Outbox::new_without_queue(pg, &RabbitMq::shared().url(), "journal_maint").await;
    backdate(&ob, 2500, 1200);
    let url = ob.url();
    let out = pgoutbox(&[
        "maintenance",
        "--database-url",
        &url,
        "--batch-size",
        "1000",
    ]);
    let printed = text(&out.stdout);
    assert_eq!(out.status.code(), Some(0), "{printed}{}", text(&out.stderr));
    assert!(
        printed.contains("idempotency keys (outbox.idempotency): deleted 2500 older than 7days (3 statements of at most 1000 rows)"),
        "{printed}"
    );
    assert!(
        printed.contains("journal rows (outbox.journal): deleted 1200 older than 7days (2 statements of at most 1000 rows)"),
        "{printed}"
    );
    // sql/inbox.sql comes with the consumer-side work; without it the step is skipped.
    assert!(
        printed.contains("inbox records (outbox.inbox): skipped, outbox.inbox_purge(interval, integer) does not exist")
            || printed.contains("inbox records (outbox.inbox): deleted"),
        "{printed}"
    );
    assert_eq!(count(&ob, "SELECT count(*) FROM outbox.idempotency"), 3);
    assert_eq!(
        count(
            &ob,
            "SELECT count(*) FROM outbox.idempotency WHERE idempotency_key LIKE 'new-%'"
        ),
        3
    );
    assert_eq!(count(&ob, "SELECT count(*) FROM outbox.journal"), 3);

    // A shorter retention reaches the newer journal rows (1 hour old); 0 keeps the keys.
    let out = pgoutbox(&[
        "maintenance",
        "--database-url",
        &url,
        "--journal-retention",
        "30m",
        "--idempotency-retention",
        "0",
    ]);
    let printed = text(&out.stdout);
    assert_eq!(out.status.code(), Some(0), "{printed}");
    assert!(
        printed.contains("journal rows (outbox.journal): deleted 3 older than 30m (1 statement of at most 1000 rows)")
            && printed.contains("idempotency keys (outbox.idempotency): retention off (0), nothing deleted"),
        "{printed}"
    );
    assert_eq!(count(&ob, "SELECT count(*) FROM outbox.journal"), 0);
    assert_eq!(count(&ob, "SELECT count(*) FROM outbox.idempotency"), 3);

    // Bad values: usage errors naming the flag and the fix.
    for (flag, value) in [
        ("--journal-retention", "7"),
        ("--idempotency-retention", "a week"),
        ("--inbox-retention", "36501d"),
    ] {
        let out = pgoutbox(&["maintenance", "--database-url", &url, flag, value]);
        let err = text(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{flag} {value}: {err}");
        assert!(
            err.contains(&format!("invalid value '{value}' for '{flag}"))
                && err.contains("write a duration such as 7d, 12h or 30m"),
            "{flag} {value}: {err}"
        );
    }
    let out = pgoutbox(&["maintenance", "--database-url", &url, "--batch-size", "0"]);
    assert_eq!(out.status.code(), Some(2));

    // A role that may not delete: the steps fail (exit 1), each named.
    let role = support::unique("maint_ro");
    ob.sql(&format!(
        "CREATE ROLE {role} LOGIN; GRANT USAGE ON SCHEMA outbox TO {role}; GRANT SELECT ON outbox.idempotency, outbox.journal TO {role}"
    ));
    ob.sql(
        "INSERT INTO outbox.idempotency (idempotency_key, message_id, created_at) VALUES ('ro-old', 'm', now() - interval '8 days');
         INSERT INTO outbox.journal VALUES ('ro-old', 't', '0/10', '0/20', 1, now() - interval '8 days', 's')",
    );
    let out = pgoutbox(&[
        "maintenance",
        "--database-url",
        &pg.url_as(&role, "", &ob.db),
    ]);
    let printed = text(&out.stdout);
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{printed}{err}");
    assert!(
        printed.contains("idempotency keys (outbox.idempotency): failed")
            && printed.contains("journal rows (outbox.journal): failed")
            && err.contains("deleting expired idempotency keys")
            && err.contains("permission denied"),
        "{printed}{err}"
    );
}

/// `run`'s retention task: while streaming, expired idempotency keys and journal rows are
/// deleted (in batches of 1000) within one --maintenance-interval, newer ones are kept, and
/// the stream goes on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn run_deletes_expired_keys_while_streaming() {
    let pg = Postgres::shared();
    let ob = Outbox::new(pg, &RabbitMq::shared().url(), "journal_retain").await;
    let streamer = ob.run(&["--maintenance-interval", "1s", "--journal-retention", "2h"]);
    wait_streaming(&streamer).await;
    let first = emit(&ob, "rt-a", 1, 5);
    assert_eq!(ob.drain(first.len(), scaled(IDLE)).await.len(), 5);

    // Expired rows appear while it streams.
    backdate(&ob, 1500, 10);
    let started = Instant::now();
    assert!(
        support::wait_until(scaled(Duration::from_secs(20)), || async {
            count(&ob, "SELECT count(*) FROM outbox.idempotency") == 3
                && count(&ob, "SELECT count(*) FROM outbox.journal") == 3
        })
        .await,
        "expired rows not deleted: {}",
        streamer.log()
    );
    let took = started.elapsed();
    assert_eq!(
        count(
            &ob,
            "SELECT count(*) FROM outbox.idempotency WHERE idempotency_key LIKE 'old-%'"
        ),
        0
    );
    assert_eq!(
        count(
            &ob,
            "SELECT count(*) FROM outbox.journal WHERE message_id LIKE 'new-%'"
        ),
        3
    );
    let second = emit(&ob, "rt-b", 2, 5);
    assert_eq!(ob.drain(second.len(), scaled(IDLE)).await.len(), 10);
    stop(&streamer).await;
    let log = streamer.log();
    assert!(
        log.contains("deleted expired idempotency keys (outbox.idempotency)")
            && log.contains("rows=1500 batches=2"),
        "{log}"
    );
    assert!(
        log.contains("deleted expired journal rows (outbox.journal)"),
        "{log}"
    );
    assert!(!log.contains("retention pass failed"), "{log}");
    eprintln!("retention deleted 1500 keys and 10 journal rows within {took:?}");
}

/// Retention settings: a bad `--idempotency-retention` or `--maintenance-interval` stops
/// `run` before it starts (exit 2, naming the setting and its variable); the config file
/// key works like the flag.
#[test]
fn bad_retention_settings_are_refused_before_run_starts() {
    let out = pgoutbox(&[
        "run",
        "--database-url",
        "postgres://u@127.0.0.1:1/db",
        "--amqp-url",
        "amqp://127.0.0.1:1",
        "--idempotency-retention",
        "forever",
    ]);
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("'--idempotency-retention"), "{err}");
    let out = pgoutbox(&[
        "run",
        "--database-url",
        "postgres://u@127.0.0.1:1/db",
        "--amqp-url",
        "amqp://127.0.0.1:1",
        "--maintenance-interval",
        "2d",
    ]);
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(
        err.contains("invalid setting --maintenance-interval (PGOUTBOX_MAINTENANCE_INTERVAL) = \"2d\": must be from 1s to 1d")
            && err.contains("docs/src/operators/retention.md"),
        "{err}"
    );
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("p.toml");
    std::fs::write(
        &file,
        "database_url = \"postgres://u@127.0.0.1:1/db\"\namqp_url = \"amqp://127.0.0.1:1\"\njournal = true\njournal_retention = \"soon\"\n",
    )
    .unwrap();
    let out = pgoutbox(&["check", "--config", file.to_str().unwrap()]);
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(
        err.contains("journal_retention") && err.contains("7d, 12h or 30m"),
        "{err}"
    );
}

/// A journal table from before the `exchange` column: `run --journal` refuses with the fix;
/// `setup` again adds the column; then each row names the exchange its message went to,
/// the producer's own or `--exchange`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_journal_records_each_messages_exchange_after_setup_upgrades_the_table() {
    let pg = Postgres::shared();
    let ob = Outbox::new(pg, &RabbitMq::shared().url(), "journal_x").await;
    ob.sql("ALTER TABLE outbox.journal DROP COLUMN exchange");
    let streamer = ob.run(&["--journal"]);
    let exit = streamer.wait_exit(scaled(Duration::from_secs(30))).await;
    let log = streamer.log();
    assert!(exit.is_some_and(|e| !e.success()), "{log}");
    assert!(
        log.contains("has no exchange column") && log.contains("pgoutbox setup --slot"),
        "{log}"
    );

    let url = ob.url();
    let out = pgoutbox(&[
        "setup",
        "--database-url",
        &url,
        "--slot",
        &ob.slot,
        "--publication",
        &ob.publication,
    ]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let other = support::unique("journal_x_other");
    let other_q = support::unique("journal_x_other_q");
    support::declare_bound_queue(&ob.amqp_url, &other, &other_q, "#").await;
    let streamer = ob.run(&["--journal"]);
    wait_streaming(&streamer).await;
    ob.sql(&format!(
        "SELECT outbox.emit('jx.a', '{{}}', message_id => 'jx-default');
         SELECT outbox.emit('jx.b', '{{}}', message_id => 'jx-other', exchange => '{other}')"
    ));
    assert_eq!(ob.drain(1, scaled(IDLE)).await.len(), 1);
    let got = support::drain_queue(&ob.amqp_url, &other_q, 1, scaled(IDLE)).await;
    assert_eq!(got.len(), 1, "{}", streamer.log());
    stop(&streamer).await;
    assert_eq!(
        ob.sql("SELECT string_agg(message_id || '>' || exchange, ' ' ORDER BY message_id) FROM outbox.journal")
            .trim(),
        format!("jx-default>{} jx-other>{other}", ob.exchange)
    );
}
