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

    // The lockdown waits for that transaction (older than its REVOKE) before it writes
    // its marker.
    let lockdown = spawn_setup(&ob, "--lockdown");
    assert!(
        support::wait_until(scaled(Duration::from_secs(30)), || async {
            can_emit(&ob, &role) == "false,false"
        })
        .await,
        "the REVOKE commits"
    );
    producer.batch_execute("COMMIT").await.unwrap();
    let out = finish(lockdown).await;
    assert!(out.contains("lockdown: on since"), "{out}");
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

/// The signature of `outbox._envelope` (as `sql/outbox.sql` declares it).
const ENVELOPE_SIG: &str = "text, bytea, text, jsonb, text, text, text, text, text, text, bigint, text, bigint, integer, text, text, text";

/// A version-3 envelope naming `who` as its emitter, built by hand (what a direct
/// `pg_logical_emit_message` can write): a self-written, unchecked `emitted_by`.
fn forged_v3(topic: &str, id: &str, who: &str, payload: &str) -> String {
    format!(
        "(SELECT '\\x03'::bytea || int4send(octet_length(h)) || h || convert_to('{payload}', 'UTF8') FROM (SELECT convert_to('{{\"id\": \"{id}\", \"topic\": \"{topic}\", \"content_type\": \"application/json\", \"headers\": {{}}, \"emitted_by\": \"{who}\"}}', 'UTF8') AS h) s)"
    )
}

/// `status --json`'s `lockdown.weakened` list, as text.
fn weakened(ob: &Outbox<'_>) -> Vec<String> {
    let (json, _) = status_json(ob);
    json["lockdown"]["weakened"]
        .as_array()
        .unwrap_or_else(|| panic!("status --json has no lockdown.weakened: {json}"))
        .iter()
        .map(|w| w.as_str().unwrap_or_default().to_owned())
        .collect()
}

/// `check`'s output (stdout and stderr) and exit code.
fn check(ob: &Outbox<'_>) -> (String, Option<i32>) {
    let out = ob.cli(&[
        "check",
        "--publication",
        &ob.publication,
        "--amqp-url",
        &ob.amqp_url,
        "--exchange",
        &ob.exchange,
    ]);
    (
        format!("{}{}", stdout(&out), String::from_utf8_lossy(&out.stderr)),
        out.status.code(),
    )
}

/// Issue 21, item 1: a LOGIN role that owns schema `outbox` (the application's or a
/// migration tool's role, a common layout) drops `outbox._envelope` and creates its own,
/// which the SECURITY DEFINER `outbox.emit` then runs with the emitter's rights: a message
/// published with a forged `x-pgoutbox-emitted-by`. Under lockdown the schema and every
/// object the helpers run belong to the NOLOGIN `pgoutbox_emitter`, so the replacement
/// (and a trigger on `outbox.idempotency`) is refused; when a superuser later hands the
/// schema back to a login role and the helper is replaced, `status` and `check` report the
/// lockdown as weakened, and `setup --lockdown` restores it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_schema_owner_cannot_forge_an_emitter_under_lockdown() {
    let pg = Postgres::shared();
    let ob = Outbox::new(pg, &RabbitMq::shared().url(), "lockdown_owner").await;
    let owner = support::unique("lk_schema_owner");
    // The application's migration role owns the schema and pgoutbox's objects in it.
    ob.sql(&format!(
        "CREATE ROLE {owner} LOGIN; ALTER SCHEMA outbox OWNER TO {owner}; \
         ALTER FUNCTION outbox._envelope({ENVELOPE_SIG}) OWNER TO {owner}; \
         ALTER TABLE outbox.idempotency OWNER TO {owner}"
    ));
    ob.sql("CREATE FUNCTION public.lk_tr() RETURNS trigger LANGUAGE plpgsql AS $f$BEGIN RETURN NEW; END$f$");
    setup(&ob, &["--lockdown"]);

    let app = connect_as(pg, &owner, &ob.db).await;
    let replace = format!(
        "DROP FUNCTION outbox._envelope({ENVELOPE_SIG}); \
         CREATE FUNCTION outbox._envelope(topic text, payload bytea, content_type text, headers jsonb, message_id text, \
             exchange text DEFAULT NULL, correlation_id text DEFAULT NULL, causation_id text DEFAULT NULL, \
             aggregate_type text DEFAULT NULL, aggregate_id text DEFAULT NULL, aggregate_version bigint DEFAULT NULL, \
             tenant text DEFAULT NULL, expiration bigint DEFAULT NULL, priority integer DEFAULT NULL, \
             traceparent text DEFAULT NULL, tracestate text DEFAULT NULL, idempotency_key text DEFAULT NULL) \
         RETURNS bytea LANGUAGE sql AS $f$ \
             SELECT '\\x03'::bytea || int4send(octet_length(h)) || h || payload FROM \
             (SELECT convert_to(jsonb_build_object('id', message_id, 'topic', topic, 'content_type', content_type, \
                 'headers', headers, 'emitted_by', 'the_ceo')::text, 'UTF8') AS h) s $f$"
    );
    let refused = sql_error(&app, &replace).await;
    let trigger = sql_error(
        &app,
        "CREATE TRIGGER lk_tr BEFORE INSERT ON outbox.idempotency FOR EACH ROW EXECUTE FUNCTION public.lk_tr()",
    )
    .await;
    app.batch_execute("SELECT outbox.emit('lk.t', '{}', '{}', 'owner-emit')")
        .await
        .expect("the schema's former owner still emits through the helper");

    let streamer = ob.run(&[]);
    let got = ob.drain(1, scaled(Duration::from_secs(20))).await;
    assert_eq!(ids(&got), ["owner-emit"], "{}", streamer.log());
    assert_eq!(
        got[0].headers.get(EMITTED_BY),
        Some(&owner),
        "published with a forged emitter: {:?}",
        got[0].headers
    );
    assert!(
        refused
            .as_deref()
            .is_some_and(|e| e.contains("must be owner")),
        "the schema's former owner replaced outbox._envelope: {refused:?}"
    );
    assert!(
        trigger
            .as_deref()
            .is_some_and(|e| e.contains("permission denied for table idempotency")),
        "a trigger on outbox.idempotency: {trigger:?}"
    );
    assert_eq!(weakened(&ob), Vec::<String>::new());
    let (text, code) = check(&ob);
    assert!(
        text.contains("lockdown") && !text.contains("WEAKENED"),
        "{text}"
    );
    assert_eq!(code, Some(0), "{text}");

    // A superuser weakens it: the schema back to the login role, which replaces the helper.
    ob.sql(&format!("ALTER SCHEMA outbox OWNER TO {owner}"));
    assert!(
        sql_error(&app, &replace).await.is_none(),
        "the schema owner may drop and create in it"
    );
    let weak = weakened(&ob);
    assert!(
        weak.iter().any(|w| w.contains("schema outbox")
            && w.contains(&owner)
            && w.contains("ALTER SCHEMA outbox OWNER TO pgoutbox_emitter")),
        "{weak:?}"
    );
    assert!(
        weak.iter().any(|w| w.contains("fingerprint")),
        "the replaced helper: {weak:?}"
    );
    // One meaning (issue 32, item 8): run streams on, check and status warn.
    let (text, code) = check(&ob);
    assert!(
        text.contains("WARNING lockdown:") && text.contains("WEAKENED") && text.contains(&owner),
        "{text}"
    );
    assert_eq!(code, Some(0), "{text}");
    let out = ob.cli(&["status", "--publication", &ob.publication]);
    assert!(stdout(&out).contains("WEAKENED"), "{}", stdout(&out));
    let problems = String::from_utf8_lossy(&out.stderr);
    assert!(
        problems.contains("warning: lockdown weakened:"),
        "a warning of status: {problems}"
    );
    assert_eq!(out.status.code(), Some(1), "{problems}");

    // setup --lockdown puts the helpers and the owners back.
    setup(&ob, &["--lockdown"]);
    assert_eq!(weakened(&ob), Vec::<String>::new());
    app.batch_execute("SELECT outbox.emit('lk.t', '{}', '{}', 'owner-emit-2')")
        .await
        .unwrap();
    let got = ob.drain(1, scaled(Duration::from_secs(20))).await;
    assert_eq!(ids(&got), ["owner-emit-2"], "{}", streamer.log());
    assert_eq!(got[0].headers.get(EMITTED_BY), Some(&owner));

    streamer.sigterm();
    streamer.wait_exit(scaled(Duration::from_secs(20))).await;
    drop(app);
    setup(&ob, &["--unlock"]);
    // --unlock gave the schema back to its owner before the lockdown.
    assert_eq!(
        ob.sql("SELECT nspowner::regrole FROM pg_namespace WHERE nspname = 'outbox'")
            .trim(),
        owner
    );
    ob.sql(&format!(
        "REASSIGN OWNED BY {owner} TO CURRENT_USER; DROP OWNED BY {owner}; DROP ROLE {owner}"
    ));
}

/// `pgoutbox setup --publication ... flag` started in the background (it may wait).
fn spawn_setup(ob: &Outbox<'_>, flag: &str) -> std::process::Child {
    std::process::Command::new(env!("CARGO_BIN_EXE_pgoutbox"))
        .args([
            "setup",
            "--publication",
            &ob.publication,
            flag,
            "--database-url",
            &ob.url(),
            "--slot",
            &ob.slot,
        ])
        .env("NO_COLOR", "1")
        .env("PGOUTBOX_HTTP_ADDR", "off")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("spawn pgoutbox setup")
}

/// Waits for a background `setup` to end, and returns its output (it must succeed).
async fn finish(child: std::process::Child) -> String {
    let out = tokio::task::spawn_blocking(move || child.wait_with_output())
        .await
        .unwrap()
        .unwrap();
    assert!(
        out.status.success(),
        "setup: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    format!("{}{}", stdout(&out), String::from_utf8_lossy(&out.stderr))
}

/// Issue 21, item 2: direct `pg_logical_emit_message` calls that race the lockdown, each
/// with a self-written `emitted_by`, are never trusted:
/// - one made while the lockdown transaction is held open (a superuser session holds the
///   row of schema `outbox` in `pg_namespace`, which the lockdown alters), so the REVOKE
///   is not visible yet;
/// - one from a cursor declared before the lockdown (PostgreSQL checks EXECUTE when the
///   query starts) and fetched after the lockdown committed: its LSN is after the lockdown
///   transaction's commit, so no LSN of that transaction can be the trust boundary.
/// `setup --lockdown` waits for every transaction older than its REVOKE to end before it
/// writes the marker, and both are published as written before the lockdown: without the
/// `x-pgoutbox-emitted-by` header.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn direct_emits_racing_the_lockdown_are_not_trusted() {
    let pg = Postgres::shared();
    let ob = Outbox::new(pg, &RabbitMq::shared().url(), "lockdown_race").await;
    let role = support::unique("lk_racer");
    ob.sql(&format!(
        "CREATE ROLE {role} LOGIN; GRANT USAGE ON SCHEMA outbox TO {role}"
    ));
    let racer = connect_as(pg, &role, &ob.db).await;
    let cursor = connect_as(pg, &role, &ob.db).await;
    let holder = Postgres::client_url(&ob.url()).await.unwrap();
    let streamer = ob.run(&[]);
    assert!(
        support::wait_until(scaled(Duration::from_secs(20)), || async {
            ob.slot_active()
        })
        .await,
        "{}",
        streamer.log()
    );

    cursor
        .batch_execute(&format!(
            "BEGIN; DECLARE c CURSOR FOR SELECT pg_logical_emit_message(true, 'pgoutbox', {})",
            forged_v3("lk.t", "race-cursor", "the_ceo", "{}")
        ))
        .await
        .unwrap();
    // Holds the row of schema outbox in pg_namespace, which only the lockdown's own SQL
    // updates (after its REVOKE); rolled back, so the lockdown then goes on.
    holder
        .batch_execute("BEGIN; GRANT USAGE ON SCHEMA outbox TO pgoutbox_producer")
        .await
        .unwrap();
    let lockdown = spawn_setup(&ob, "--lockdown");
    let db = ob.db.clone();
    assert!(
        support::wait_until(scaled(Duration::from_secs(30)), || async {
            ob.sql(&format!(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = '{db}' AND wait_event_type = 'Lock'"
            ))
            .trim()
                == "1"
        })
        .await,
        "the lockdown waits for the held row"
    );
    racer
        .batch_execute(&format!(
            "SELECT pg_logical_emit_message(true, 'pgoutbox', {})",
            forged_v3("lk.t", "race-open", "the_ceo", "{}")
        ))
        .await
        .expect("the REVOKE is not visible while the lockdown is open");
    holder.batch_execute("ROLLBACK").await.unwrap();
    assert!(
        support::wait_until(scaled(Duration::from_secs(30)), || async {
            can_emit(&ob, &role) == "false,false"
        })
        .await,
        "the REVOKE commits"
    );
    cursor
        .batch_execute("FETCH ALL FROM c; COMMIT")
        .await
        .expect("the cursor checked EXECUTE before the REVOKE");
    let out = finish(lockdown).await;
    assert!(out.contains("lockdown: on since"), "{out}");
    racer
        .batch_execute("SELECT outbox.emit('lk.t', '{}', '{}', 'helper-after')")
        .await
        .unwrap();

    let got = ob.drain(3, scaled(Duration::from_secs(20))).await;
    assert_eq!(
        ids(&got),
        ["race-open", "race-cursor", "helper-after"],
        "{}",
        streamer.log()
    );
    assert_eq!(
        got[0].headers.get(EMITTED_BY),
        None,
        "trusted: {:?}",
        got[0].headers
    );
    assert_eq!(
        got[1].headers.get(EMITTED_BY),
        None,
        "trusted: {:?}",
        got[1].headers
    );
    assert_eq!(got[2].headers.get(EMITTED_BY), Some(&role));
    assert_eq!(dead_letters(&ob), Vec::<(String, String)>::new());

    streamer.sigterm();
    streamer.wait_exit(scaled(Duration::from_secs(20))).await;
    drop((racer, cursor, holder));
    setup(&ob, &["--unlock"]);
    ob.sql(&format!("DROP OWNED BY {role}; DROP ROLE {role}"));
}

/// Issue 21, item 3: `dead-letters requeue` keeps each dead letter's trust verdict. A
/// message written directly before the lockdown (a self-written `emitted_by`, never
/// checked) and one written through the helper under it (checked) are both dead-lettered
/// as too large, then requeued under lockdown: the first is published without
/// `x-pgoutbox-emitted-by` (before the fix, the re-emit after the lockdown made its forged
/// emitter trusted), the second still with its emitter.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requeue_keeps_the_trust_verdict_of_a_dead_letter() {
    let pg = Postgres::shared();
    let ob = Outbox::new(pg, &RabbitMq::shared().url(), "lockdown_requeue").await;
    let role = support::unique("lk_requeuer");
    ob.sql(&format!(
        "CREATE ROLE {role} LOGIN; GRANT USAGE ON SCHEMA outbox TO {role}"
    ));
    let producer = connect_as(pg, &role, &ob.db).await;
    let big = "x".repeat(600);
    let small = ob.run(&["--max-message-bytes", "400"]);
    producer
        .batch_execute(&format!(
            "SELECT pg_logical_emit_message(true, 'pgoutbox', {})",
            forged_v3("lk.t", "dl-before", "the_ceo", &format!("\"{big}\""))
        ))
        .await
        .unwrap();
    let count = |n: usize| {
        let ob = &ob;
        async move {
            support::wait_until(scaled(Duration::from_secs(30)), || async {
                dead_letters(ob).len() == n
            })
            .await
        }
    };
    assert!(count(1).await, "{}", small.log());
    setup(&ob, &["--lockdown"]);
    producer
        .batch_execute(&format!(
            "SELECT outbox.emit('lk.t', to_jsonb('{big}'::text), '{{}}', 'dl-after')"
        ))
        .await
        .unwrap();
    assert!(count(2).await, "{}", small.log());
    assert_eq!(
        dead_letters(&ob),
        [
            ("dl-before".to_owned(), "too_large".to_owned()),
            ("dl-after".to_owned(), "too_large".to_owned())
        ]
    );
    small.sigterm();
    small.wait_exit(scaled(Duration::from_secs(20))).await;

    let streamer = ob.run(&[]);
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_pgoutbox"))
        .args([
            "dead-letters",
            "requeue",
            "--all",
            "--database-url",
            &ob.url(),
        ])
        .env("PGOUTBOX_HTTP_ADDR", "off")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let got = ob.drain(2, scaled(Duration::from_secs(20))).await;
    assert_eq!(ids(&got), ["dl-before", "dl-after"], "{}", streamer.log());
    assert_eq!(
        got[0].headers.get(EMITTED_BY),
        None,
        "a requeue made a forged emitter trusted: {:?}",
        got[0].headers
    );
    assert_eq!(got[1].headers.get(EMITTED_BY), Some(&role));
    assert_eq!(dead_letters(&ob).len(), 2, "nothing dead-lettered again");

    streamer.sigterm();
    streamer.wait_exit(scaled(Duration::from_secs(20))).await;
    drop(producer);
    setup(&ob, &["--unlock"]);
    ob.sql(&format!("DROP OWNED BY {role}; DROP ROLE {role}"));
}

/// `setup --lockdown` as the superuser, without asserting its outcome: its stdout and
/// stderr, and its exit code.
fn try_setup(ob: &Outbox<'_>) -> (String, Option<i32>) {
    let out = ob.cli(&["setup", "--publication", &ob.publication, "--lockdown"]);
    (
        format!("{}{}", stdout(&out), String::from_utf8_lossy(&out.stderr)),
        out.status.code(),
    )
}

/// Issue 32, item 3: lockdown against grants, not only owners. The common
/// `GRANT ALL ON ALL TABLES IN SCHEMA outbox TO app` gives TRIGGER on `outbox.idempotency`
/// (a trigger there runs inside the SECURITY DEFINER helper as `pgoutbox_emitter` and may
/// write any envelope) and writes on `outbox.lockdown` (the record the streamer trusts);
/// on PostgreSQL 15 and older a CREATEROLE login may grant itself `pgoutbox_emitter`.
/// `setup --lockdown` refuses what it cannot take back (CREATEROLE, a login owner of an
/// outbox table), naming the fix, and revokes the grants; when a superuser gives them
/// again, `check` and `status` report each (issue 32, item 8: one meaning for a weakened
/// lockdown: a warning in both, `run` streams on). A private PostgreSQL: the roles it
/// creates (CREATEROLE, a member of pgoutbox_emitter) are cluster-wide and would weaken
/// every other test's lockdown.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grants_that_weaken_a_lockdown_are_revoked_refused_and_reported() {
    let pg = Postgres::start_private(&[]);
    let ob = Outbox::new(&pg, &RabbitMq::shared().url(), "lockdown_grants").await;
    let app = support::unique("lk_app");
    let boss = support::unique("lk_boss");
    ob.sql(&format!(
        "CREATE ROLE {app} LOGIN; GRANT USAGE ON SCHEMA outbox TO {app}; \
         GRANT ALL ON ALL TABLES IN SCHEMA outbox TO {app}; \
         GRANT EXECUTE ON ALL FUNCTIONS IN SCHEMA outbox TO {app}; \
         CREATE ROLE {boss} LOGIN CREATEROLE"
    ));
    ob.sql("CREATE FUNCTION public.lk_forge() RETURNS trigger LANGUAGE plpgsql AS $f$BEGIN RETURN NEW; END$f$");
    let mut failures: Vec<String> = Vec::new();
    let mut expect = |ok: bool, what: &str, text: &str| {
        if !ok {
            failures.push(format!("{what}:\n{text}"));
        }
    };

    // CREATEROLE (PostgreSQL 15): refused, nothing changed.
    let (text, code) = try_setup(&ob);
    println!("with a CREATEROLE login:\n{text}");
    expect(
        code != Some(0)
            && text.contains(&boss)
            && text.contains(&format!("ALTER ROLE {boss} NOCREATEROLE")),
        "setup --lockdown refuses a CREATEROLE login, naming the fix",
        &text,
    );
    ob.sql(&format!("ALTER ROLE {boss} NOCREATEROLE"));

    // The grants are revoked, and say so.
    let (text, code) = try_setup(&ob);
    println!("with GRANT ALL to {app}:\n{text}");
    expect(code == Some(0), "setup --lockdown succeeds", &text);
    expect(
        text.contains(&format!("REVOKE TRIGGER ON outbox.idempotency FROM {app}"))
            && text.contains(&format!("REVOKE DELETE ON outbox.lockdown FROM {app}")),
        "setup --lockdown names the grants it revoked",
        &text,
    );
    let client = connect_as(&pg, &app, &ob.db).await;
    let trigger = sql_error(
        &client,
        "CREATE TRIGGER lk_forge BEFORE INSERT ON outbox.idempotency FOR EACH ROW EXECUTE FUNCTION public.lk_forge()",
    )
    .await;
    expect(
        trigger
            .as_deref()
            .is_some_and(|e| e.contains("permission denied")),
        "a role given GRANT ALL cannot put a trigger on outbox.idempotency",
        &format!("{trigger:?}"),
    );
    let delete = sql_error(&client, "DELETE FROM outbox.lockdown").await;
    expect(
        delete
            .as_deref()
            .is_some_and(|e| e.contains("permission denied")),
        "a role given GRANT ALL cannot delete the lockdown record",
        &format!("{delete:?}"),
    );
    let state = weakened(&ob);
    expect(
        state.is_empty(),
        "the lockdown holds",
        &format!("{state:?}"),
    );

    // A superuser weakens it again, four ways: check and status report each.
    ob.sql(&format!(
        "GRANT TRIGGER ON outbox.idempotency TO {app}; ALTER ROLE {boss} CREATEROLE; \
         ALTER TABLE outbox.dead_letter OWNER TO {app}; GRANT pgoutbox_emitter TO {boss}"
    ));
    let state = weakened(&ob);
    let all = state.join("\n");
    for (what, needle) in [
        (
            "TRIGGER",
            format!("REVOKE TRIGGER ON outbox.idempotency FROM {app}"),
        ),
        ("CREATEROLE", format!("ALTER ROLE {boss} NOCREATEROLE")),
        (
            "ownership",
            format!("table outbox.dead_letter is owned by the login role {app}"),
        ),
        (
            "membership",
            format!("the login role {boss} is a member of pgoutbox_emitter"),
        ),
    ] {
        expect(
            all.contains(&needle),
            &format!("status --json names the {what}"),
            &all,
        );
    }
    let (json, status_code) = status_json(&ob);
    let lockdown_problems: Vec<&serde_json::Value> = json["problems"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|p| {
            p["message"]
                .as_str()
                .is_some_and(|m| m.starts_with("lockdown weakened:"))
        })
        .collect();
    expect(
        status_code != Some(0)
            && lockdown_problems.len() >= 4
            && lockdown_problems.iter().all(|p| p["severity"] == "warning"),
        "status: each weakening is a warning problem",
        &format!("exit {status_code:?}: {}", json["problems"]),
    );
    let (text, code) = check(&ob);
    expect(
        code == Some(0)
            && text.contains("WARNING lockdown:")
            && text.contains("run goes on streaming")
            && text.contains(&format!("REVOKE TRIGGER ON outbox.idempotency FROM {app}"))
            && text.contains(&format!("ALTER ROLE {boss} NOCREATEROLE")),
        "check: the same warning (exit 0: run streams on), naming each weakening",
        &text,
    );
    // What it cannot take back, setup --lockdown refuses, naming each.
    let (text, code) = try_setup(&ob);
    expect(
        code != Some(0)
            && text.contains("nothing changed")
            && text.contains(&format!("ALTER ROLE {boss} NOCREATEROLE"))
            && text.contains("outbox.dead_letter")
            && text.contains(&format!("REVOKE pgoutbox_emitter FROM {boss}")),
        "setup --lockdown refuses the ownership, the CREATEROLE and the membership",
        &text,
    );
    ob.sql(&format!(
        "ALTER ROLE {boss} NOCREATEROLE; ALTER TABLE outbox.dead_letter OWNER TO CURRENT_USER; \
         REVOKE pgoutbox_emitter FROM {boss}"
    ));
    let (text, code) = try_setup(&ob);
    expect(code == Some(0), "setup --lockdown after the fixes", &text);
    let state = weakened(&ob);
    expect(
        state.is_empty(),
        "the lockdown holds again",
        &format!("{state:?}"),
    );
    drop(client);
    assert!(
        failures.is_empty(),
        "{} failed:\n{}",
        failures.len(),
        failures.join("\n\n")
    );
}
