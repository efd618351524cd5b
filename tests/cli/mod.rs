//! The command line as an operator meets it, against real servers: what bad input does
//! (exit 2 with the flag, the value and the accepted form, never a panic), what the
//! book promises of `setup`, `teardown`, the environment variables, the producer
//! functions' SQLSTATEs and default ids, and the `dead-letters` subcommands.
//!
//! `PGOUTBOX_TEST_BIN` runs these tests against another `pgoutbox` binary (an old build,
//! to see a test fail on the code it was written against).

use std::process::Output;
use std::time::Duration;

use crate::support::cli::{bin, pgoutbox, pgoutbox_env, stderr, stdout};
use crate::support::{self, scaled, Outbox, Postgres, RabbitMq, Streamer};

/// `(exit code, stderr)`, for assertion messages that show what happened.
fn outcome(out: &Output) -> (Option<i32>, String) {
    (out.status.code(), stderr(out))
}

/// Starts `run` on this outbox through [`bin`], with extra arguments, as the streamer role.
fn run(ob: &Outbox<'_>, extra: &[&str]) -> Streamer {
    let mut args = vec![
        "run".to_string(),
        "--database-url".into(),
        ob.streamer_url(),
        "--amqp-url".into(),
        ob.amqp_url.clone(),
        "--slot".into(),
        ob.slot.clone(),
        "--publication".into(),
        ob.publication.clone(),
        "--exchange".into(),
        ob.exchange.clone(),
    ];
    args.extend(extra.iter().map(|s| s.to_string()));
    Streamer::spawn_program(&bin(), &args, &[("RUST_BACKTRACE", "0")])
}

/// Decoding reads only flushed WAL, and the test cluster may commit asynchronously: one
/// synchronous commit that writes WAL flushes everything before it.
fn flush_wal(ob: &Outbox<'_>) {
    ob.sql("BEGIN; SET LOCAL synchronous_commit = on; SELECT pg_logical_emit_message(true, 'not-ours', ''); COMMIT;");
}

#[test]
fn age_with_a_multibyte_unit_is_a_usage_error_not_a_panic() {
    let purge = |age: &str| {
        pgoutbox(&[
            "dead-letters",
            "purge",
            "--older-than",
            age,
            "--database-url",
            "postgres://u@127.0.0.1:1/db",
        ])
    };
    for age in ["7é", "30日", "é", "36501d"] {
        let (code, err) = outcome(&purge(age));
        assert_eq!(code, Some(2), "{age}: {err}");
        assert!(!err.contains("panicked"), "{age}: {err}");
        assert!(
            err.contains(&format!(
                "invalid value '{age}' for '--older-than <OLDER_THAN>'"
            )) && err.contains("write a duration such as 7d, 1w or 36h"),
            "{age}: {err}"
        );
    }
    // The syntax of the retention flags: past the arguments, to the (refused) connection.
    for age in ["1w", "36h", "90d", "1h 30m"] {
        let (code, err) = outcome(&purge(age));
        assert_eq!(code, Some(1), "{age}: {err}");
        assert!(!err.contains("--older-than"), "{age}: {err}");
    }
}

/// Connection-string mistakes name the setting, the value and the fix, never the password:
/// a password file for a URL that has one (the file is the value, the URL is named
/// redacted), an unknown parameter, a port that is not a number.
#[test]
fn connection_string_errors_name_the_parameter_the_value_and_the_fix() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("pw");
    std::fs::write(&file, "Fr0m-the-file\n").unwrap();
    let file = file.display().to_string();
    let cases: [(&[&str], &[&str]); 4] = [
        (
            &[
                "--database-url",
                "postgres://u:Old-pw@127.0.0.1:1/db",
                "--database-password-file",
                &file,
            ],
            &[
                &format!("--database-password-file (PGOUTBOX_DATABASE_PASSWORD_FILE) = {file:?}"),
                "--database-url postgres://u:***@127.0.0.1:1/db already has a password",
                "remove it from --database-url, or drop --database-password-file",
            ],
        ),
        (
            &[
                "--database-url",
                "postgres://u:Old-pw@127.0.0.1:1/db?foo=bar",
            ],
            &["unknown parameter foo=***", "remove it or fix its name"],
        ),
        (
            &["--database-url", "postgres://u:Old-pw@127.0.0.1:abc/db"],
            &["port=\"abc\" is not a valid port: write a port number from 1 to 65535"],
        ),
        (
            &[
                "--database-url",
                "host=127.0.0.1 user=u password=Old-pw port=abc",
            ],
            &["port=\"abc\" is not a valid port"],
        ),
    ];
    for (args, wants) in cases {
        let mut argv = vec!["status", "--slot", "s"];
        argv.extend_from_slice(args);
        let (code, err) = outcome(&pgoutbox(&argv));
        assert_eq!(code, Some(2), "{args:?}: {err}");
        for want in wants {
            assert!(err.contains(want), "{args:?}: no {want:?} in {err}");
        }
        assert!(
            !err.contains("Old-pw") && !err.contains("Fr0m-the-file"),
            "{args:?}: {err}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn huge_shutdown_timeout_is_refused_before_run_starts() {
    let pg = Postgres::shared();
    let ob = Outbox::new(pg, &RabbitMq::shared().url(), "cli_huge_timeout").await;
    let streamer = run(&ob, &["--shutdown-timeout-s", "18446744073709551615"]);
    let mut status = streamer.wait_exit(scaled(Duration::from_secs(20))).await;
    if status.is_none() {
        // The old code started streaming; show what a SIGTERM then did.
        support::wait_until(scaled(Duration::from_secs(20)), || async {
            ob.slot_active()
        })
        .await;
        streamer.sigterm();
        status = streamer.wait_exit(scaled(Duration::from_secs(20))).await;
    }
    let log = streamer.log();
    assert_eq!(status.and_then(|s| s.code()), Some(2), "{log}");
    assert!(
        log.contains("invalid setting --shutdown-timeout-s (PGOUTBOX_SHUTDOWN_TIMEOUT_S) = \"18446744073709551615\": must be from 0 to 86400 seconds"),
        "{log}"
    );
    assert!(!ob.slot_active(), "nothing took the slot");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn usage_errors_exit_2_and_other_errors_exit_1() {
    let pg = Postgres::shared();
    let ob = Outbox::new(pg, &RabbitMq::shared().url(), "cli_exit").await;
    let url = ob.url();
    let amqp = ob.amqp_url.clone();
    let run = |extra: &[&str]| {
        let mut args = vec!["run", "--database-url", &url, "--amqp-url", &amqp];
        args.extend_from_slice(extra);
        pgoutbox(&args)
    };
    // (what, output, a piece of stderr)
    let usage: Vec<(&str, Output, &str)> = vec![
        ("no subcommand", pgoutbox(&[]), "Usage:"),
        (
            "unknown flag",
            run(&["--bogus"]),
            "unexpected argument '--bogus'",
        ),
        (
            "missing required flag",
            pgoutbox(&["run", "--database-url", &url]),
            "--amqp-url <AMQP_URL>",
        ),
        (
            "not a number",
            run(&["--max-in-flight", "1e3"]),
            "\"1e3\" is not a whole number",
        ),
        (
            "out of range",
            run(&["--max-in-flight", "0"]),
            "invalid setting --max-in-flight (PGOUTBOX_MAX_IN_FLIGHT) = \"0\": must be from 1 to 1000000",
        ),
        (
            "malformed broker URL",
            pgoutbox(&[
                "run",
                "--database-url",
                &url,
                "--amqp-url",
                "amqp://guest:s3cret@127.0.0.1:99999999/%2f",
            ]),
            "invalid setting --amqp-url (PGOUTBOX_AMQP_URL) = \"amqp://guest:***@127.0.0.1:99999999/%2f\": not an AMQP URL (invalid port number)",
        ),
        (
            "bad slot name",
            run(&["--slot", "Bad-Name"]),
            "invalid setting --slot (PGOUTBOX_SLOT) = \"Bad-Name\"",
        ),
        (
            "bad sslmode",
            pgoutbox(&["status", "--database-url", &format!("{url}?sslmode=verify_full")]),
            "sslmode=verify_full is not an sslmode; use disable, allow, prefer (the default), require, verify-ca or verify-full",
        ),
        (
            "bad value in the environment",
            pgoutbox_env(
                &["run"],
                &[
                    ("PGOUTBOX_DATABASE_URL", &url),
                    ("PGOUTBOX_AMQP_URL", &amqp),
                    ("PGOUTBOX_MAX_ATTEMPTS", "5000"),
                ],
            ),
            "invalid setting --max-attempts (PGOUTBOX_MAX_ATTEMPTS) = \"5000\": must be from 1 to 1000",
        ),
        (
            "bad dead-letter id",
            pgoutbox(&["dead-letters", "requeue", "--id=0", "--database-url", &url]),
            "'--id <ID>'",
        ),
    ];
    for (what, out, expected) in usage {
        let (code, err) = outcome(&out);
        assert_eq!(code, Some(2), "{what}: {err}");
        assert!(
            err.contains(expected),
            "{what}: expected {expected:?} in {err}"
        );
    }
    // Errors of the servers' state are not usage errors: exit 1.
    let out = pgoutbox(&["peek", "--database-url", &url, "--slot", "no_such_slot"]);
    let (code, err) = outcome(&out);
    assert_eq!(code, Some(1), "{err}");
    assert!(
        err.contains("does not exist; run `pgoutbox setup --slot no_such_slot`"),
        "{err}"
    );
    // `status` exits by health instead: a missing slot is critical, 2 (docs/src/reference/exit-codes.md).
    let out = pgoutbox(&["status", "--database-url", &url, "--slot", "no_such_slot"]);
    let (code, err) = outcome(&out);
    assert_eq!(code, Some(2), "{err}");
    assert!(
        err.contains("critical: replication slot \"no_such_slot\" does not exist; run `pgoutbox setup --slot no_such_slot`"),
        "{err}"
    );
    // --help and --version succeed.
    assert_eq!(pgoutbox(&["--help"]).status.code(), Some(0));
    assert_eq!(pgoutbox(&["run", "--help"]).status.code(), Some(0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn options_are_read_from_environment_variables() {
    let pg = Postgres::shared();
    let ob = Outbox::new(pg, &RabbitMq::shared().url(), "cli_env").await;
    let env = [
        ("PGOUTBOX_DATABASE_URL", ob.url()),
        ("PGOUTBOX_SLOT", ob.slot.clone()),
        ("PGOUTBOX_PUBLICATION", ob.publication.clone()),
    ];
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
    let out = pgoutbox_env(&["status", "--json"], &env);
    // No streamer holds the slot yet: a warning (exit 1), with the report on stdout.
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    let status: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
    assert_eq!(status["slot"], ob.slot.as_str());
    // A flag wins over its variable.
    let out = pgoutbox_env(&["status", "--slot", "no_such_slot"], &env);
    assert!(stderr(&out).contains("\"no_such_slot\" does not exist"));

    // `run` configured by nothing but variables.
    let vars = [
        ("PGOUTBOX_DATABASE_URL", ob.streamer_url()),
        ("PGOUTBOX_AMQP_URL", ob.amqp_url.clone()),
        ("PGOUTBOX_SLOT", ob.slot.clone()),
        ("PGOUTBOX_PUBLICATION", ob.publication.clone()),
        ("PGOUTBOX_EXCHANGE", ob.exchange.clone()),
        ("PGOUTBOX_INSTANCE_ID", "from_env".into()),
        ("PGOUTBOX_MAX_IN_FLIGHT", "7".into()),
        ("PGOUTBOX_ON_UNROUTABLE", "block".into()),
        ("RUST_LOG", "info".into()),
    ];
    let streamer = Streamer::spawn_program(&bin(), &["run"], &vars);
    ob.sql("SELECT outbox.emit('env.t', '{}', '{}', 'via-env')");
    let got = ob.drain(1, scaled(Duration::from_secs(20))).await;
    assert_eq!(
        got.iter()
            .map(|m| m.message_id.clone().unwrap_or_default())
            .collect::<Vec<_>>(),
        ["via-env"],
        "{}",
        streamer.log()
    );
    let out = ob.cli(&["status", "--json"]);
    let status: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
    assert_eq!(status["holder"], "pgoutbox-from_env", "{status}");
    let log = streamer.log();
    assert!(log.contains("max_in_flight=7"), "{log}");
    streamer.stop_ok(scaled(Duration::from_secs(20))).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_bad_emit_input_raises_22023() {
    let pg = Postgres::shared();
    let ob = Outbox::new(pg, &RabbitMq::shared().url(), "cli_emit_22023").await;
    let client = pg.client(&ob.db).await;
    let long = "x".repeat(256);
    let long_key = format!("{{\"{long}\": 1}}");
    // (what, call); each must fail with 22023 inside the producer's transaction.
    let emit = |topic: &str, headers: &str, id: &str| {
        format!("SELECT outbox.emit({topic}, '{{}}'::jsonb, {headers}, {id})")
    };
    let emit_bytes = |topic: &str, ct: &str, headers: &str, id: &str| {
        format!("SELECT outbox.emit_bytes({topic}, '\\x00'::bytea, {ct}, {headers}, {id})")
    };
    let ok = ("'t'", "'{}'::jsonb", "NULL");
    let mut cases: Vec<(String, String)> = Vec::new();
    let lit = |s: &str| format!("'{s}'");
    for (what, topic, headers, id) in [
        (
            "NULL topic",
            "NULL".to_string(),
            ok.1.to_string(),
            ok.2.to_string(),
        ),
        ("empty topic", "''".into(), ok.1.into(), ok.2.into()),
        ("topic over 255 bytes", lit(&long), ok.1.into(), ok.2.into()),
        ("empty message_id", ok.0.into(), ok.1.into(), "''".into()),
        (
            "message_id over 255 bytes",
            ok.0.into(),
            ok.1.into(),
            lit(&long),
        ),
        (
            "NULL headers",
            ok.0.into(),
            "NULL::jsonb".into(),
            ok.2.into(),
        ),
        (
            "array headers",
            ok.0.into(),
            "'[]'::jsonb".into(),
            ok.2.into(),
        ),
        (
            "number headers",
            ok.0.into(),
            "'1'::jsonb".into(),
            ok.2.into(),
        ),
        (
            "header key over 255 bytes",
            ok.0.into(),
            format!("'{long_key}'::jsonb"),
            ok.2.into(),
        ),
        (
            "x-pgoutbox- key",
            ok.0.into(),
            "'{\"x-pgoutbox-lsn\": \"0/1\"}'::jsonb".into(),
            ok.2.into(),
        ),
        (
            "X-PGOUTBOX- key",
            ok.0.into(),
            "'{\"X-PgOutbox-Mine\": 1}'::jsonb".into(),
            ok.2.into(),
        ),
        (
            "CC key",
            ok.0.into(),
            "'{\"CC\": \"q\"}'::jsonb".into(),
            ok.2.into(),
        ),
        (
            "bcc key",
            ok.0.into(),
            "'{\"bcc\": \"q\"}'::jsonb".into(),
            ok.2.into(),
        ),
    ] {
        cases.push((format!("emit: {what}"), emit(&topic, &headers, &id)));
        cases.push((
            format!("emit_bytes: {what}"),
            emit_bytes(&topic, "'application/octet-stream'", &headers, &id),
        ));
    }
    cases.push((
        "emit: NULL payload".into(),
        "SELECT outbox.emit('t', NULL::jsonb)".into(),
    ));
    cases.push((
        "emit_bytes: NULL payload".into(),
        "SELECT outbox.emit_bytes('t', NULL::bytea)".into(),
    ));
    for (what, ct) in [
        ("NULL content_type", "NULL".to_string()),
        ("empty content_type", "''".into()),
        ("content_type over 255 bytes", lit(&long)),
    ] {
        cases.push((
            format!("emit_bytes: {what}"),
            emit_bytes(ok.0, &ct, ok.1, ok.2),
        ));
    }
    assert_eq!(cases.len(), 31);
    for (what, call) in &cases {
        client.batch_execute("BEGIN").await.unwrap();
        let e = client
            .batch_execute(call)
            .await
            .expect_err(&format!("{what} was accepted: {call}"));
        let db = e.as_db_error().expect("a server error");
        assert_eq!(db.code().code(), "22023", "{what}: {db}");
        assert!(db.message().starts_with("outbox: "), "{what}: {db}");
        assert!(db.hint().is_some(), "{what} has a hint");
        // The producer's transaction is aborted, as any SQL error aborts it.
        let e = client.batch_execute("SELECT 1").await.unwrap_err();
        assert_eq!(e.code().map(|c| c.code()), Some("25P02"), "{what}");
        client.batch_execute("ROLLBACK").await.unwrap();
    }
    // The limits are exact: 255 bytes are accepted everywhere.
    let max = "y".repeat(255);
    client
        .batch_execute(&format!(
            "BEGIN; SELECT outbox.emit_bytes('{max}', ''::bytea, '{max}', '{{\"{max}\": 1}}', '{max}'); ROLLBACK"
        ))
        .await
        .expect("255 bytes are accepted");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn default_message_id_is_a_uuid_fixed_at_emit_time() {
    let pg = Postgres::shared();
    let ob = Outbox::new(pg, &RabbitMq::shared().url(), "cli_uuid").await;
    ob.sql("SELECT outbox.emit('u', '{}'); SELECT outbox.emit_bytes('u', '\\x01'::bytea)");
    // Fixed in the WAL: two peeks of the slot decode the same ids. One line per message: the
    // escape encoding leaves a 0x0A byte (in an LSN, say) as a newline, so it is spelt \012.
    let peek = || {
        ob.sql(&format!(
            "SELECT replace(encode(data, 'escape'), chr(10), '\\012') FROM pg_logical_slot_peek_binary_changes('{}', NULL, NULL,
                'proto_version', '1', 'publication_names', '{}', 'messages', 'true')
             WHERE get_byte(data, 0) = 77
               AND substring(data from 11 for 9) = convert_to('pgoutbox', 'UTF8') || '\\x00'::bytea",
            ob.slot, ob.publication
        ))
    };
    flush_wal(&ob);
    let first = peek();
    assert_eq!(first.lines().count(), 2, "{first}");
    assert_eq!(first, peek());
    let streamer = run(&ob, &[]);
    let got = ob.drain(2, scaled(Duration::from_secs(20))).await;
    assert_eq!(got.len(), 2, "{}", streamer.log());
    let ids: Vec<uuid::Uuid> = got
        .iter()
        .map(|m| {
            let id = m.message_id.clone().expect("a message_id");
            assert!(first.contains(&id), "{id} is the id in the WAL");
            uuid::Uuid::parse_str(&id).unwrap_or_else(|e| panic!("{id:?}: {e}"))
        })
        .collect();
    assert!(ids.iter().all(|u| u.get_version_num() == 4), "{ids:?}");
    assert_ne!(ids[0], ids[1]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn setup_twice_keeps_the_same_objects() {
    let pg = Postgres::shared();
    let ob = Outbox::new(pg, &RabbitMq::shared().url(), "cli_setup_twice").await;
    ob.sql(
        "INSERT INTO outbox.dead_letter (lsn, envelope, reason, attempts) VALUES ('0/1', '\\x00', 'poison', 0)",
    );
    ob.sql("SELECT outbox.emit('kept', '{}', '{}', 'emitted-between')");
    let snapshot = || {
        ob.sql(
            "SELECT 'fn', p.oid::regprocedure::text, p.oid::bigint FROM pg_proc p WHERE p.pronamespace = 'outbox'::regnamespace
             UNION ALL SELECT 'rel', c.relname::text, c.oid::bigint FROM pg_class c WHERE c.relnamespace = 'outbox'::regnamespace
             UNION ALL SELECT 'pub', pubname::text, oid::bigint FROM pg_publication
             UNION ALL SELECT 'slot', slot_name || ' ' || plugin || ' ' || confirmed_flush_lsn, catalog_xmin::text::bigint FROM pg_replication_slots WHERE database = current_database()
             UNION ALL SELECT 'rows', count(*)::text, 0 FROM outbox.dead_letter
             ORDER BY 1, 2",
        )
    };
    let before = snapshot();
    assert!(
        before.contains(
            "outbox.emit(text,jsonb,jsonb,text,text,text,text,text,text,bigint,text,bigint,integer,text,text,text,text)"
        ),
        "{before}"
    );
    let out = ob.cli(&["setup", "--publication", &ob.publication]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    assert!(
        stdout(&out).contains(&format!(
            "slot {} (existed), publication {} (existed)",
            ob.slot, ob.publication
        )),
        "{}",
        stdout(&out)
    );
    assert_eq!(
        snapshot(),
        before,
        "setup twice: the same objects, oids and rows"
    );
    // The message emitted between the two is still delivered.
    let streamer = run(&ob, &[]);
    let got = ob.drain(1, scaled(Duration::from_secs(20))).await;
    assert_eq!(got.len(), 1, "{}", streamer.log());
    assert_eq!(got[0].message_id.as_deref(), Some("emitted-between"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn teardown_refuses_while_the_slot_is_active() {
    let pg = Postgres::shared();
    let ob = Outbox::new(pg, &RabbitMq::shared().url(), "cli_teardown_active").await;
    let streamer = run(&ob, &["--instance-id", "holder"]);
    assert!(
        support::wait_until(scaled(Duration::from_secs(20)), || async {
            ob.slot_active()
        })
        .await,
        "{}",
        streamer.log()
    );
    for force in [false, true] {
        let mut args = vec!["teardown", "--publication", &ob.publication];
        if force {
            args.push("--force");
        }
        let out = ob.cli(&args);
        let (code, err) = outcome(&out);
        assert_eq!(code, Some(1), "force={force}: {err}");
        assert!(
            err.contains(&format!("slot \"{}\" is active (pid ", ob.slot))
                && err.contains("pgoutbox-holder); stop the streamer first"),
            "force={force}: {err}"
        );
    }
    assert_eq!(
        ob.sql(&format!(
            "SELECT count(*) FROM pg_replication_slots WHERE slot_name = '{}'",
            ob.slot
        ))
        .trim(),
        "1",
        "the slot is still there"
    );
    assert_eq!(
        ob.sql(&format!(
            "SELECT count(*) FROM pg_publication WHERE pubname = '{}'",
            ob.publication
        ))
        .trim(),
        "1",
        "the publication is still there"
    );
    assert!(streamer.try_status().is_none(), "the streamer is untouched");
}

/// Inserts a dead letter holding a valid envelope for `id`; returns its row id.
fn insert_dead_letter(ob: &Outbox<'_>, id: &str, lsn: &str, age: &str) -> String {
    ob.sql(&format!(
        "INSERT INTO outbox.dead_letter (message_id, topic, lsn, envelope, reason, attempts, last_error, dead_lettered_at)
         VALUES ('{id}', 'dl.t', '{lsn}', outbox._envelope('dl.t', convert_to('{{\"id\": \"{id}\"}}', 'UTF8'), 'application/json', '{{}}', '{id}'),
                 'returned', 1, 'no route', now() - interval '{age}')
         RETURNING id"
    ))
    .trim()
    .to_owned()
}

/// `(id, message_id, requeued)` of `dead-letters list --json` with `args`.
fn list(ob: &Outbox<'_>, args: &[&str]) -> Vec<(i64, String, bool)> {
    let mut full = vec!["dead-letters", "list", "--json"];
    full.extend_from_slice(args);
    let url = ob.url();
    full.extend_from_slice(&["--database-url", &url]);
    let out = pgoutbox(&full);
    assert!(out.status.success(), "{}", stderr(&out));
    let rows: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
    rows.as_array()
        .unwrap()
        .iter()
        .map(|r| {
            (
                r["id"].as_i64().unwrap(),
                r["message_id"].as_str().unwrap_or("-").to_owned(),
                !r["requeued_at"].is_null(),
            )
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dead_letter_commands_list_requeue_and_purge_what_they_say() {
    let pg = Postgres::shared();
    let ob = Outbox::new(pg, &RabbitMq::shared().url(), "cli_dead_letters").await;
    let url = ob.url();
    let dl = |args: &[&str]| {
        let mut full = vec!["dead-letters"];
        full.extend_from_slice(args);
        full.extend_from_slice(&["--database-url", &url]);
        pgoutbox(&full)
    };
    let a = insert_dead_letter(&ob, "a", "0/10", "10 days");
    let b = insert_dead_letter(&ob, "b", "0/20", "9 days");
    let c = insert_dead_letter(&ob, "c", "0/30", "1 minute");
    let (ai, bi, ci): (i64, i64, i64) =
        (a.parse().unwrap(), b.parse().unwrap(), c.parse().unwrap());

    // list: oldest first, --limit.
    let names = |rows: Vec<(i64, String, bool)>| rows.into_iter().map(|r| r.1).collect::<Vec<_>>();
    assert_eq!(names(list(&ob, &[])), ["a", "b", "c"]);
    assert_eq!(names(list(&ob, &["--limit", "2"])), ["a", "b"]);

    // requeue --id of a missing row: nothing is requeued, the id is named, exit 1.
    let out = dl(&["requeue", "--id", &a, "--id", "99999"]);
    let (code, err) = outcome(&out);
    assert_eq!(code, Some(1), "{}{err}", stdout(&out));
    assert!(
        err.contains("requeued nothing: id 99999 does not exist"),
        "{err}"
    );
    assert!(
        list(&ob, &["--all"]).iter().all(|r| !r.2),
        "nothing was requeued"
    );

    // requeue --id sets requeued_at; list hides the row unless --all.
    let before_lsn = ob.sql("SELECT pg_current_wal_lsn()");
    let out = dl(&["requeue", "--id", &a]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(
        stdout(&out).contains(&format!("requeued 1 dead letters (ids {a})")),
        "{}",
        stdout(&out)
    );
    assert_eq!(names(list(&ob, &[])), ["b", "c"]);
    assert_eq!(
        list(&ob, &["--all"]),
        [
            (ai, "a".into(), true),
            (bi, "b".into(), false),
            (ci, "c".into(), false)
        ]
    );
    let requeued_at = ob.sql(&format!(
        "SELECT requeued_at > now() - interval '1 minute' AND requeued_at <= now() FROM outbox.dead_letter WHERE id = {a}"
    ));
    assert_eq!(requeued_at.trim(), "t");
    // The requeue emitted the original envelope once, after `before_lsn`.
    flush_wal(&ob);
    let emitted = ob.sql(&format!(
        "SELECT count(*) FROM pg_logical_slot_peek_binary_changes('{}', NULL, NULL,
            'proto_version', '1', 'publication_names', '{}', 'messages', 'true')
         WHERE get_byte(data, 0) = 77 AND position(convert_to('\"id\": \"a\"', 'UTF8') in data) > 0
           AND lsn > '{}'::pg_lsn",
        ob.slot,
        ob.publication,
        before_lsn.trim()
    ));
    assert_eq!(emitted.trim(), "1");

    // requeue of a row requeued already: refused, named, exit 1.
    let out = dl(&["requeue", "--id", &a]);
    let (code, err) = outcome(&out);
    assert_eq!(code, Some(1), "{}{err}", stdout(&out));
    assert!(
        err.contains(&format!("id {a} was requeued already at ")),
        "{err}"
    );

    // A poison row (an envelope that does not decode) is refused, by --id and by --all.
    let poison = ob
        .sql("INSERT INTO outbox.dead_letter (lsn, envelope, reason, attempts, last_error) VALUES ('0/40', convert_to('not an envelope', 'UTF8'), 'poison', 0, 'x') RETURNING id")
        .trim()
        .to_owned();
    for sel in [vec!["--id", poison.as_str()], vec!["--all"]] {
        let mut args = vec!["requeue"];
        args.extend_from_slice(&sel);
        let out = dl(&args);
        let (code, err) = outcome(&out);
        assert_eq!(code, Some(1), "{sel:?}: {}{err}", stdout(&out));
        assert!(
            err.contains(&format!(
                "id {poison} holds an envelope pgoutbox cannot decode"
            )) && err.contains("would only dead-letter it again as poison"),
            "{sel:?}: {err}"
        );
    }
    assert_eq!(
        names(list(&ob, &[])),
        ["b", "c", "-"],
        "--all requeued nothing"
    );

    // purge --id deletes exactly that row.
    let out = dl(&["purge", "--id", &poison]);
    assert!(
        stdout(&out).contains("purged 1 dead letters"),
        "{}",
        stderr(&out)
    );
    // requeue --all now takes the rest, not the one requeued already.
    let out = dl(&["requeue", "--all"]);
    assert!(
        stdout(&out).contains(&format!("requeued 2 dead letters (ids {b}, {c})")),
        "{}{}",
        stdout(&out),
        stderr(&out)
    );
    // purge --older-than keeps the fresh row; purge --all removes everything.
    let out = dl(&["purge", "--older-than", "1d"]);
    assert!(
        stdout(&out).contains("purged 2 dead letters"),
        "{}",
        stderr(&out)
    );
    assert_eq!(names(list(&ob, &["--all"])), ["c"]);
    insert_dead_letter(&ob, "d", "0/50", "0 s");
    let out = dl(&["purge", "--all"]);
    assert!(
        stdout(&out).contains("purged 2 dead letters"),
        "{}",
        stderr(&out)
    );
    assert!(list(&ob, &["--all"]).is_empty());
}

/// Issue 21, item 14 and issue 32, item 2: every command that prints to stdout ends
/// quietly when its reader has gone (`pgoutbox completions zsh | head -1` panicked with
/// exit 101 in clap_complete's write): no panic, its own exit status, no "Broken pipe" on
/// stderr. The pipe is closed before the command writes its first line. Each leaf command
/// of the clap tree is here (the test fails when a new one is not), with a real invocation
/// against the shared servers, and each one's `--help`; `run` prints nothing on stdout
/// (its log is on stderr), so its `--help` is its case.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn printing_commands_end_quietly_on_a_closed_pipe() {
    use clap::CommandFactory as _;
    let pg = Postgres::shared();
    let rmq = RabbitMq::shared();
    let ob = Outbox::new_without_queue(pg, &rmq.url(), "cli_epipe").await;
    let url = ob.url();
    let amqp = rmq.url();
    let out_dir = tempfile::tempdir().expect("tempdir");
    let out = out_dir.path().to_str().expect("utf-8 path").to_owned();
    let db = |path: &[&str], extra: &[&str]| -> Vec<String> {
        path.iter()
            .chain(["--database-url", &url].iter())
            .chain(extra)
            .map(|s| s.to_string())
            .collect()
    };
    let target = [
        "--slot",
        &ob.slot,
        "--publication",
        &ob.publication,
        "--amqp-url",
        &amqp,
        "--exchange",
        &ob.exchange,
    ];
    // Path in the clap tree -> the invocations of it (teardown last: it drops the slot).
    let mut cases: Vec<(&str, Vec<String>)> = vec![
        (
            "setup",
            db(
                &["setup"],
                &["--slot", &ob.slot, "--publication", &ob.publication],
            ),
        ),
        ("check", db(&["check"], &target)),
        ("status", db(&["status"], &["--slot", &ob.slot])),
        ("status", db(&["status"], &["--slot", &ob.slot, "--json"])),
        (
            "peek",
            db(
                &["peek"],
                &["--slot", &ob.slot, "--publication", &ob.publication],
            ),
        ),
        ("maintenance", db(&["maintenance"], &[])),
        (
            "peek",
            db(
                &["peek"],
                &[
                    "--slot",
                    &ob.slot,
                    "--publication",
                    &ob.publication,
                    "--json",
                ],
            ),
        ),
        ("journal", db(&["journal", "x"], &[])),
        ("journal", db(&["journal", "x", "--json"], &[])),
        ("dead-letters list", db(&["dead-letters", "list"], &[])),
        (
            "dead-letters list",
            db(&["dead-letters", "list", "--json"], &[]),
        ),
        (
            "dead-letters requeue",
            db(&["dead-letters", "requeue", "--all"], &[]),
        ),
        (
            "dead-letters purge",
            db(&["dead-letters", "purge", "--all"], &[]),
        ),
        (
            "docs reference",
            vec![
                "docs".into(),
                "reference".into(),
                "--out".into(),
                out.clone(),
            ],
        ),
        (
            "docs man",
            vec!["docs".into(), "man".into(), "--out".into(), out.clone()],
        ),
    ];
    for shell in ["bash", "zsh", "fish", "elvish", "powershell"] {
        cases.push(("completions", vec!["completions".into(), shell.into()]));
    }
    let hash = crate::support::unique("cli_epipe_hash");
    let queues = crate::support::unique("cli_epipe_q");
    cases.push((
        "declare-topology",
        [
            "declare-topology",
            "--amqp-url",
            &amqp,
            "--exchange",
            &ob.exchange,
            "--hash-exchange",
            &hash,
            "--queue-prefix",
            &queues,
            "--queues",
            "2",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect(),
    ));
    cases.push((
        "teardown",
        db(
            &["teardown"],
            &[
                "--slot",
                &ob.slot,
                "--publication",
                &ob.publication,
                "--force",
            ],
        ),
    ));
    // Every leaf command, and its --help (and the root's --help, --version and `help`).
    let mut root = pgoutbox::cli::Cli::command();
    root.build();
    let mut leaves = Vec::new();
    let mut stack = vec![(Vec::<String>::new(), &root)];
    while let Some((path, cmd)) = stack.pop() {
        let subs: Vec<_> = cmd
            .get_subcommands()
            .filter(|c| c.get_name() != "help")
            .collect();
        if subs.is_empty() && !path.is_empty() {
            leaves.push(path.join(" "));
        }
        for sub in subs {
            let mut p = path.clone();
            p.push(sub.get_name().to_owned());
            stack.push((p, sub));
        }
    }
    leaves.sort();
    let missing: Vec<&String> = leaves
        .iter()
        .filter(|leaf| *leaf != "run" && !cases.iter().any(|(path, _)| path == *leaf))
        .collect();
    assert!(
        missing.is_empty(),
        "commands this test does not run: {missing:?}"
    );
    for leaf in &leaves {
        let mut args: Vec<String> = leaf.split(' ').map(str::to_owned).collect();
        args.push("--help".into());
        cases.push(("help", args));
    }
    for args in [&["--help"][..], &["--version"], &["help"], &["help", "run"]] {
        cases.push(("help", args.iter().map(|s| s.to_string()).collect()));
    }
    let mut failures = Vec::new();
    for (_, args) in &cases {
        let mut child = crate::support::cli::command()
            .args(args)
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .expect("spawn pgoutbox");
        // The reader goes away at once.
        drop(child.stdout.take());
        let out = child.wait_with_output().expect("wait");
        let err = String::from_utf8_lossy(&out.stderr).into_owned();
        if out.status.code() == Some(101) || err.contains("panicked") || err.contains("Broken pipe")
        {
            failures.push(format!("{args:?}: exit {:?}\n{err}", out.status.code()));
        }
        println!("{args:?}: exit {:?}", out.status.code());
    }
    assert!(
        failures.is_empty(),
        "{} of {} ended loudly:\n{}",
        failures.len(),
        cases.len(),
        failures.join("\n")
    );
}
