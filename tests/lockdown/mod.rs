//! Lockdown (`setup --lockdown` / `--unlock`): producers that cannot forge events.
//!
//! One database per test on the shared Postgres and RabbitMQ; an unprivileged LOGIN role
//! created by the test plays the producer.

use std::time::Duration;

use crate::support::{self, lsn, scaled, Outbox, Postgres, RabbitMq, Received};

const EMITTED_BY: &str = "x-pgoutbox-emitted-by";

/// A version-1 envelope (what an older outbox.emit wrote): the current helper's bytes with
/// the version byte set to 1 (its `emitted_by` is then an unknown key, ignored).
fn v1_envelope(topic: &str, id: &str) -> String {
    format!(
        "set_byte(outbox._envelope('{topic}', convert_to('{{\"id\": \"{id}\"}}', 'UTF8'), 'application/json', '{{}}', '{id}'), 0, 1)"
    )
}

/// A version-2 envelope without `emitted_by` (never written by the helpers).
fn v2_without_emitter(topic: &str, id: &str) -> String {
    format!(
        "(SELECT '\\x02'::bytea || int4send(octet_length(h)) || h || convert_to('{{}}', 'UTF8') FROM (SELECT convert_to('{{\"id\": \"{id}\", \"topic\": \"{topic}\", \"content_type\": \"application/json\", \"headers\": {{}}}}', 'UTF8') AS h) s)"
    )
}

/// A connection as `role` (trust authentication on the shared cluster).
async fn connect_as(pg: &Postgres, role: &str, db: &str) -> tokio_postgres::Client {
    Postgres::client_url(&pg.url_as(role, "", db))
        .await
        .unwrap_or_else(|e| panic!("connect as {role}: {e}"))
}

/// The error text of `sql` as `client`, or `None` when it succeeded.
async fn sql_error(client: &tokio_postgres::Client, sql: &str) -> Option<String> {
    match client.batch_execute(sql).await {
        Ok(()) => None,
        Err(e) => Some(
            e.as_db_error()
                .map(|d| d.message().to_owned())
                .unwrap_or_else(|| e.to_string()),
        ),
    }
}

/// `(message_id, reason)` of every dead letter, in order.
fn dead_letters(ob: &Outbox<'_>) -> Vec<(String, String)> {
    ob.sql("SELECT coalesce(message_id, '-'), reason FROM outbox.dead_letter ORDER BY id")
        .lines()
        .filter(|l| !l.is_empty())
        .map(|l| {
            let (id, reason) = l.split_once('|').unwrap();
            (id.to_owned(), reason.to_owned())
        })
        .collect()
}

fn ids(got: &[Received]) -> Vec<String> {
    got.iter()
        .map(|m| m.message_id.clone().unwrap_or_default())
        .collect()
}

fn stdout(out: &std::process::Output) -> String {
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn setup(ob: &Outbox<'_>, flag: &[&str]) -> String {
    let mut args = vec!["setup", "--publication", &ob.publication];
    args.extend_from_slice(flag);
    let out = ob.cli(&args);
    assert!(
        out.status.success(),
        "setup {flag:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    stdout(&out)
}

fn can_emit(ob: &Outbox<'_>, role: &str) -> String {
    ob.sql(&format!(
        "SELECT string_agg(has_function_privilege('{role}', p.oid, 'EXECUTE')::text, ',' ORDER BY p.oid) FROM pg_proc p WHERE proname = 'pg_logical_emit_message'"
    ))
    .trim()
    .to_owned()
}

fn status_json(ob: &Outbox<'_>) -> (serde_json::Value, Option<i32>) {
    let out = ob.cli(&["status", "--json", "--publication", &ob.publication]);
    let json: serde_json::Value = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("status --json: {e}: {}", stdout(&out)));
    (json, out.status.code())
}

/// Lockdown read at session start (the record) and applied while `run` runs (the marker):
/// an unprivileged role loses direct `pg_logical_emit_message`, emits through the helper
/// with its name in the header; a superuser's direct emits after the lockdown are
/// dead-lettered as forged and never published; messages written before it (one still in
/// an open transaction when the lockdown committed) are delivered; `--unlock` restores the
/// default privilege and lifts the check, again without a restart.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lockdown_stops_direct_emits_and_dead_letters_forged_messages() {
    let pg = Postgres::shared();
    let ob = Outbox::new(pg, &RabbitMq::shared().url(), "lockdown").await;
    let role = support::unique("lk_producer");
    ob.sql(&format!(
        "CREATE ROLE {role} LOGIN; GRANT USAGE ON SCHEMA outbox TO {role}"
    ));
    let producer = connect_as(pg, &role, &ob.db).await;

    // The default on PostgreSQL 15: any role may call it (both overloads).
    assert_eq!(can_emit(&ob, &role), "true,true");
    let (before, code_before) = status_json(&ob);
    assert_eq!(before["lockdown"]["enabled"], false, "{before}");
    assert_eq!(before["lockdown"]["public_can_emit"], true, "{before}");

    // Before the lockdown, with no streamer: a direct old-format emit, pending in the slot,
    // and one in a transaction still open when the lockdown commits.
    producer
        .batch_execute(&format!(
            "SELECT pg_logical_emit_message(true, 'pgoutbox', {})",
            v1_envelope("lk.t", "pre-pending")
        ))
        .await
        .expect("direct emit before the lockdown");
    producer
        .batch_execute(&format!(
            "BEGIN; SELECT pg_logical_emit_message(true, 'pgoutbox', {})",
            v1_envelope("lk.t", "pre-open")
        ))
        .await
        .unwrap();

    let out = setup(&ob, &["--lockdown"]);
    assert!(out.contains("lockdown: on since"), "{out}");
    producer.batch_execute("COMMIT").await.unwrap();
    let lockdown_lsn = ob.sql("SELECT enabled_at_lsn FROM outbox.lockdown");
    // Idempotent, and a plain setup (which replaces the functions) keeps the lockdown.
    setup(&ob, &["--lockdown"]);
    setup(&ob, &[]);
    assert_eq!(
        ob.sql("SELECT enabled_at_lsn FROM outbox.lockdown"),
        lockdown_lsn
    );
    assert_eq!(
        ob.sql("SELECT string_agg(proname || ':' || prosecdef || ':' || proowner::regrole, ',' ORDER BY proname) FROM pg_proc WHERE proname IN ('emit', 'emit_bytes') AND pronamespace = 'outbox'::regnamespace").trim(),
        "emit:true:pgoutbox_emitter,emit_bytes:true:pgoutbox_emitter"
    );
    assert_eq!(can_emit(&ob, &role), "false,false");

    // The unprivileged role: direct calls refused (both overloads), the helpers work.
    for call in [
        "SELECT pg_logical_emit_message(true, 'pgoutbox', 'x'::text)",
        "SELECT pg_logical_emit_message(true, 'pgoutbox', '\\x01'::bytea)",
    ] {
        let err = sql_error(&producer, call).await;
        assert!(
            err.as_deref().is_some_and(
                |e| e.contains("permission denied for function pg_logical_emit_message")
            ),
            "{call}: {err:?}"
        );
    }
    producer
        .batch_execute(
            "SELECT outbox.emit('lk.t', '{\"n\": 1}', '{}', 'helper-1'); \
             SELECT outbox.emit_bytes('lk.t', '\\x00ff'::bytea, 'application/x-raw', '{}', 'helper-bytes')",
        )
        .await
        .expect("emit through the helpers under lockdown");
    // A superuser still can call it directly: an old-format and an emitter-less envelope.
    ob.sql(&format!(
        "SELECT pg_logical_emit_message(true, 'pgoutbox', {})",
        v1_envelope("lk.t", "forged-v1")
    ));
    ob.sql(&format!(
        "SELECT pg_logical_emit_message(true, 'pgoutbox', {})",
        v2_without_emitter("lk.t", "forged-no-emitter")
    ));
    producer
        .batch_execute("SELECT outbox.emit('lk.t', '{}', '{}', 'helper-2')")
        .await
        .unwrap();

    let (after, code_after) = status_json(&ob);
    assert_eq!(after["lockdown"]["enabled"], true, "{after}");
    assert_eq!(after["lockdown"]["public_can_emit"], false, "{after}");
    assert_eq!(
        after["lockdown"]["enabled_at_lsn"].as_str(),
        Some(lockdown_lsn.trim())
    );
    assert_eq!(
        code_before, code_after,
        "information only: {before} / {after}"
    );
    let out = ob.cli(&[
        "check",
        "--publication",
        &ob.publication,
        "--amqp-url",
        &ob.amqp_url,
        "--exchange",
        &ob.exchange,
    ]);
    assert!(
        stdout(&out).contains("lockdown") && stdout(&out).contains("on since"),
        "{}{}",
        stdout(&out),
        String::from_utf8_lossy(&out.stderr)
    );

    // Record path: the streamer starts after the lockdown.
    let streamer = ob.run(&[]);
    let got = ob.drain(5, scaled(Duration::from_secs(20))).await;
    assert_eq!(
        ids(&got),
        [
            "pre-pending",
            "pre-open",
            "helper-1",
            "helper-bytes",
            "helper-2"
        ],
        "{}",
        streamer.log()
    );
    assert_eq!(got[0].headers.get(EMITTED_BY), None, "v1 has no emitter");
    assert_eq!(got[1].headers.get(EMITTED_BY), None);
    for m in &got[2..] {
        assert_eq!(m.headers.get(EMITTED_BY), Some(&role), "{:?}", m.headers);
    }
    assert_eq!(
        dead_letters(&ob),
        [
            ("forged-v1".to_owned(), "forged".to_owned()),
            ("forged-no-emitter".to_owned(), "forged".to_owned())
        ]
    );
    let error = ob.sql("SELECT last_error FROM outbox.dead_letter ORDER BY id LIMIT 1");
    assert!(
        error.contains("forged") && error.contains(lockdown_lsn.trim()),
        "{error}"
    );

    // Marker path: unlock while running; the default privilege is back and direct emits
    // are delivered again.
    let out = setup(&ob, &["--unlock"]);
    assert!(out.contains("lockdown: off"), "{out}");
    setup(&ob, &["--unlock"]);
    assert_eq!(can_emit(&ob, &role), "true,true");
    assert_eq!(ob.sql("SELECT count(*) FROM outbox.lockdown").trim(), "0");
    producer
        .batch_execute(&format!(
            "SELECT pg_logical_emit_message(true, 'pgoutbox', {})",
            v1_envelope("lk.t", "unlocked-direct")
        ))
        .await
        .expect("direct emit after --unlock");
    let got = ob.drain(1, scaled(Duration::from_secs(20))).await;
    assert_eq!(ids(&got), ["unlocked-direct"], "{}", streamer.log());

    // Lockdown applied while `run` runs takes effect at once (its marker in the stream).
    setup(&ob, &["--lockdown"]);
    let forged_at = lsn(&ob.sql(&format!(
        "SELECT pg_logical_emit_message(true, 'pgoutbox', {})",
        v1_envelope("lk.t", "forged-live")
    )));
    producer
        .batch_execute("SELECT outbox.emit('lk.t', '{}', '{}', 'helper-live')")
        .await
        .unwrap();
    let got = ob.drain(1, scaled(Duration::from_secs(20))).await;
    assert_eq!(ids(&got), ["helper-live"], "{}", streamer.log());
    assert_eq!(got[0].headers.get(EMITTED_BY), Some(&role));
    assert!(
        ob.flushed_past(forged_at, scaled(Duration::from_secs(10)))
            .await,
        "the slot moves past the forged message"
    );
    assert_eq!(
        dead_letters(&ob).last(),
        Some(&("forged-live".to_owned(), "forged".to_owned()))
    );
    assert_eq!(support::queue_len(&ob.amqp_url, &ob.queue).await, 0);

    setup(&ob, &["--unlock"]);
    assert_eq!(can_emit(&ob, &role), "true,true");
    streamer.stop_ok(scaled(Duration::from_secs(20))).await;
    drop(producer);
    ob.sql(&format!("DROP OWNED BY {role}; DROP ROLE {role}"));
}

/// `setup --lockdown` needs a superuser, and says so.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lockdown_needs_a_superuser() {
    let pg = Postgres::shared();
    let ob = Outbox::new(pg, &RabbitMq::shared().url(), "lockdown_su").await;
    let role = support::unique("lk_owner");
    ob.sql(&format!(
        "CREATE ROLE {role} LOGIN REPLICATION; GRANT CREATE ON DATABASE {} TO {role}; GRANT ALL ON SCHEMA outbox TO {role}",
        ob.db
    ));
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_pgoutbox"))
        .args([
            "setup",
            "--lockdown",
            "--database-url",
            &pg.url_as(&role, "", &ob.db),
            "--slot",
            &ob.slot,
            "--publication",
            &ob.publication,
        ])
        .env("PGOUTBOX_HTTP_ADDR", "off")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(
        err.contains("only a superuser") && err.contains(&role),
        "{err}"
    );
    assert_eq!(ob.sql("SELECT count(*) FROM outbox.lockdown").trim(), "0");
    ob.sql(&format!("DROP OWNED BY {role}; DROP ROLE {role}"));
}
