//! What a new operator trips on: handshakes that never end, a least-privilege streamer,
//! broker authentication failures, and error texts that must name the cause and the fix.

use std::net::TcpListener;
use std::time::{Duration, Instant};

use crate::support::cli::{pgoutbox, stderr};
use crate::support::{self, scaled, Outbox, Postgres, RabbitMq, Streamer};

/// A TCP listener that completes the TCP handshake (the kernel does, from its backlog) and
/// never sends a byte: what a hung server or a black-holing middlebox looks like.
fn silent_listener() -> (TcpListener, u16) {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let port = listener.local_addr().expect("addr").port();
    (listener, port)
}

/// `status` against a server that accepts TCP and never answers fails within about the
/// URL's `connect_timeout`, naming the host, the port, the timeout and the setting.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_gives_up_on_a_silent_server_after_connect_timeout() {
    let (_listener, port) = silent_listener();
    let url = format!("postgres://postgres@127.0.0.1:{port}/app?connect_timeout=2");
    let began = Instant::now();
    let status = Streamer::spawn(
        &["status", "--database-url", &url, "--slot", "s"],
        &[("RUST_LOG", "info")],
    );
    let exit = status.wait_exit(Duration::from_secs(30)).await;
    let took = began.elapsed();
    let log = status.log();
    assert!(
        exit.is_some(),
        "status still running after {took:.1?} against a silent server: {log}"
    );
    assert!(!exit.unwrap().success(), "{log}");
    assert!(took < Duration::from_secs(10), "took {took:.1?}: {log}");
    assert!(log.contains(&format!("127.0.0.1:{port}")), "{log}");
    assert!(log.contains("2 s"), "{log}");
    assert!(log.contains("connect_timeout"), "{log}");
}

/// `run` against a silent server logs the same timeout and keeps retrying (a connection
/// failure is retryable).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn run_retries_a_silent_server_naming_the_timeout() {
    let (_listener, port) = silent_listener();
    let url = format!("postgres://postgres@127.0.0.1:{port}/app?connect_timeout=1");
    let run = Streamer::spawn(
        &[
            "run",
            "--database-url",
            &url,
            "--amqp-url",
            "amqp://guest:guest@127.0.0.1:1/%2f",
        ],
        &[("RUST_LOG", "info")],
    );
    let pattern = format!("127.0.0.1:{port}");
    let retried = support::wait_until(scaled(Duration::from_secs(40)), || async {
        run.log()
            .lines()
            .filter(|l| l.contains("session failed; reconnecting") && l.contains(&pattern))
            .count()
            >= 2
    })
    .await;
    let log = run.log();
    assert!(retried, "no two timed-out attempts logged: {log}");
    assert!(log.contains("connect_timeout"), "{log}");
    assert!(log.contains("1 s"), "{log}");
    assert!(run.try_status().is_none(), "run gave up: {log}");
}

/// The replication handshake (our own startup and authentication code) honours
/// `connect_timeout` from startup to ReadyForQuery.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replication_handshake_honours_connect_timeout() {
    let (_listener, port) = silent_listener();
    let url = format!("postgres://postgres@127.0.0.1:{port}/app?connect_timeout=1");
    let config = pgoutbox::config::parse_database_url(&url.into()).expect("url");
    let began = Instant::now();
    let result = tokio::time::timeout(
        Duration::from_secs(30),
        pgoutbox::replication::connect::ReplicationConnection::connect(&config, "t"),
    )
    .await;
    let took = began.elapsed();
    let result = result.unwrap_or_else(|_| panic!("no answer after {took:.1?}"));
    let error = result.expect_err("a silent server cannot authenticate");
    let text = pgoutbox::error::render_report(&error);
    assert!(took < Duration::from_secs(5), "took {took:.1?}: {text}");
    assert!(text.contains(&format!("127.0.0.1:{port}")), "{text}");
    assert!(
        text.contains("1 s") && text.contains("connect_timeout"),
        "{text}"
    );
    assert!(error.is_connection_loss(), "retryable: {error:?}");
}

/// Lines of `sql/roles.example.sql` that grant on outbox objects to the streamer role,
/// with the role renamed; with `background` false only those on the schema, the dead
/// letters and the stream state (not those of the journal and the retention task).
fn example_streamer_grants(role: &str, background: bool) -> String {
    include_str!("../../sql/roles.example.sql")
        .lines()
        .filter(|l| l.starts_with("GRANT") && l.contains(" outbox") && l.ends_with("TO pgoutbox;"))
        .filter(|l| {
            background || !(l.contains("outbox.idempotency") || l.contains("outbox.journal"))
        })
        .map(|l| l.replace("TO pgoutbox;", &format!("TO \"{role}\";")))
        .collect::<Vec<_>>()
        .join("\n")
}

/// A plain `LOGIN REPLICATION` role: `run` refuses up front with the complete GRANTs; with
/// those it streams and writes a dead letter, but warns that retention cannot delete and
/// refuses `--journal`, each with its GRANT; with all of the roles example's grants there
/// is no warning.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn least_privilege_streamer_is_told_the_grants_then_dead_letters() {
    let pg = Postgres::shared();
    let url = RabbitMq::shared().url();
    let ob = Outbox::new(pg, &url, "err_lp").await;
    let role = support::unique("lp_streamer");
    ob.sql(&format!("CREATE ROLE \"{role}\" LOGIN REPLICATION"));
    // Nobody is bound to this exchange: every message is returned and dead-lettered.
    let exchange = support::unique("err_lp_nobody");
    ob.sql("SELECT outbox.emit('nobody.home', '{\"x\": 1}', '{}', 'lp-1')");
    let role_url = pg.url_as(&role, "", &ob.db);

    let run = ob.run_with_url(&role_url, &["--exchange", &exchange]);
    let exit = run.wait_exit(scaled(Duration::from_secs(30))).await;
    let log = run.log();
    assert!(exit.is_some(), "run kept going without privileges: {log}");
    assert!(!exit.unwrap().success(), "{log}");
    for grant in [
        format!("GRANT USAGE ON SCHEMA outbox TO \"{role}\";"),
        format!("GRANT SELECT, INSERT ON outbox.dead_letter TO \"{role}\";"),
        format!("GRANT USAGE ON SEQUENCE outbox.dead_letter_id_seq TO \"{role}\";"),
        format!("GRANT SELECT, INSERT, UPDATE ON outbox.stream_state TO \"{role}\";"),
    ] {
        assert!(log.contains(&grant), "missing {grant:?} in: {log}");
    }
    assert!(
        !log.contains("session failed; reconnecting"),
        "a missing privilege is not retried: {log}"
    );
    // The retention task waits for the pre-flight checks: its warnings (and its start)
    // never come before, or instead of, the error that says what to fix.
    assert!(
        !log.contains("retention pass failed") && !log.contains("retention task started"),
        "retention ran before the pre-flight checks passed: {log}"
    );

    let grants = example_streamer_grants(&role, false);
    assert_eq!(grants.lines().count(), 4, "{grants}");
    ob.sql(&grants);
    let run = ob.run_with_url(&role_url, &["--exchange", &exchange]);
    let written = support::wait_until(scaled(Duration::from_secs(30)), || async {
        ob.sql("SELECT count(*) FROM outbox.dead_letter WHERE message_id = 'lp-1'")
            .trim()
            == "1"
    })
    .await;
    assert!(written, "no dead letter written: {}", run.log());
    assert!(run.try_status().is_none(), "{}", run.log());
    // Once the pre-flight checks passed, the retention task starts (and fails, warning).
    assert!(
        run.wait_for_log("retention pass failed", scaled(Duration::from_secs(30)))
            .await,
        "{}",
        run.log()
    );
    // Retention (on by default) cannot delete: said once at start, with the GRANT.
    let log = run.log();
    let idempotency_grant = format!("GRANT SELECT, DELETE ON outbox.idempotency TO \"{role}\";");
    let journal_grant = format!("GRANT SELECT, INSERT, DELETE ON outbox.journal TO \"{role}\";");
    assert!(
        log.contains("cannot delete expired idempotency keys from outbox.idempotency")
            && log.contains(&idempotency_grant)
            && log.contains("cannot delete expired journal rows from outbox.journal")
            && log.contains(&journal_grant),
        "{log}"
    );
    run.stop(scaled(Duration::from_secs(20))).await;
    // --journal without INSERT on outbox.journal: refused up front, with the GRANT.
    let run = ob.run_with_url(&role_url, &["--exchange", &exchange, "--journal"]);
    let exit = run.wait_exit(scaled(Duration::from_secs(30))).await;
    let log = run.log();
    assert!(exit.is_some_and(|e| !e.success()), "{log}");
    assert!(
        log.contains("--journal is on but role") && log.contains(&journal_grant),
        "{log}"
    );
    // With every grant of the example: --journal runs, and no warning.
    let all = example_streamer_grants(&role, true);
    assert_eq!(all.lines().count(), 6, "{all}");
    ob.sql(&all);
    let run = ob.run_with_url(&role_url, &["--exchange", &exchange, "--journal"]);
    assert!(
        run.wait_for_log("streaming", scaled(Duration::from_secs(30)))
            .await,
        "{}",
        run.log()
    );
    let log = run.log();
    assert!(!log.contains("cannot delete expired"), "{log}");
    assert!(!log.contains("retention pass failed"), "{log}");
}

/// Wrong broker credentials (403 ACCESS_REFUSED) and a missing vhost (530 NOT_ALLOWED) are
/// definite: `run` exits non-zero with the fix instead of retrying for ever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn broker_authentication_failures_make_run_exit() {
    let pg = Postgres::shared();
    let rabbit = RabbitMq::shared();
    let ob = Outbox::new(pg, &rabbit.url(), "err_amqp_auth").await;
    let port = rabbit.port();
    for (amqp_url, code, fix) in [
        (
            format!("amqp://guest:wrong@127.0.0.1:{port}/%2f"),
            "403 ACCESS_REFUSED",
            "check the user and password",
        ),
        (
            format!("amqp://guest:guest@127.0.0.1:{port}/no_such_vhost"),
            "530 NOT_ALLOWED",
            "rabbitmqctl add_vhost",
        ),
    ] {
        let run = Streamer::spawn(
            &[
                "run",
                "--database-url",
                &ob.streamer_url(),
                "--amqp-url",
                &amqp_url,
                "--slot",
                &ob.slot,
                "--publication",
                &ob.publication,
                "--exchange",
                &ob.exchange,
            ],
            &[("RUST_LOG", "info")],
        );
        let exit = run.wait_exit(scaled(Duration::from_secs(30))).await;
        let log = run.log();
        assert!(exit.is_some(), "run retries {code} for ever: {log}");
        assert!(!exit.unwrap().success(), "{log}");
        assert!(log.contains(code), "{code}: {log}");
        assert!(log.contains(fix), "{fix}: {log}");
        assert!(!log.contains("guest:wrong"), "password logged: {log}");
    }
}

/// A role whose password is required but absent from the URL is told to add the password,
/// not to check host and port.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn missing_password_is_named_as_such() {
    let pg = Postgres::shared();
    let db = pg.create_database("err_nopw").await;
    let out = pgoutbox(&[
        "status",
        "--database-url",
        &pg.url_as("pw_scram", "", &db),
        "--slot",
        "s",
    ]);
    let text = stderr(&out);
    assert!(!out.status.success(), "{text}");
    assert!(text.contains("add it to --database-url"), "{text}");
    assert!(!text.contains("check host, port"), "{text}");
}

/// `run` as a role without REPLICATION gets the `ALTER ROLE` to run, as `setup` does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn run_without_replication_attribute_names_the_fix() {
    let pg = Postgres::shared();
    let ob = Outbox::new(pg, &RabbitMq::shared().url(), "err_norepl").await;
    let run = ob.run_with_url(&pg.url_as("norepl", "", &ob.db), &[]);
    let exit = run.wait_exit(scaled(Duration::from_secs(30))).await;
    let log = run.log();
    assert!(exit.is_some_and(|s| !s.success()), "{log}");
    assert!(
        log.contains("ALTER ROLE \"norepl\" REPLICATION"),
        "no fix in: {log}"
    );
}

/// A slot made with another plugin is described without Rust `Some("...")` formatting.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wrong_plugin_message_has_no_debug_formatting() {
    let pg = Postgres::shared();
    let db = pg.create_database("err_plugin").await;
    let slot = support::unique("err_td_slot");
    pg.psql(
        &db,
        &format!("SELECT pg_create_logical_replication_slot('{slot}', 'test_decoding')"),
    );
    let out = pgoutbox(&["setup", "--database-url", &pg.url(&db), "--slot", &slot]);
    let text = stderr(&out);
    assert!(!out.status.success(), "{text}");
    assert!(text.contains("plugin test_decoding"), "{text}");
    assert!(!text.contains("Some("), "{text}");
    let out = pgoutbox(&[
        "run",
        "--database-url",
        &pg.url(&db),
        "--slot",
        &slot,
        "--amqp-url",
        "amqp://guest:guest@127.0.0.1:1/%2f",
    ]);
    let text = stderr(&out);
    assert!(!out.status.success(), "{text}");
    assert!(text.contains("plugin test_decoding"), "{text}");
    assert!(!text.contains("Some("), "{text}");
    pg.psql(&db, &format!("SELECT pg_drop_replication_slot('{slot}')"));
}

/// A missing slot's hint carries the `--slot NAME` to pass to setup; a database without
/// `setup` is told to run it when `dead-letters list` finds no table.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn missing_slot_and_missing_table_hint_at_setup_with_names() {
    let pg = Postgres::shared();
    let db = pg.create_database("err_nosetup").await;
    let out = pgoutbox(&[
        "status",
        "--database-url",
        &pg.url(&db),
        "--slot",
        "no_such_slot",
    ]);
    let text = stderr(&out);
    assert!(!out.status.success(), "{text}");
    assert!(
        text.contains("pgoutbox setup --slot no_such_slot"),
        "{text}"
    );
    let out = pgoutbox(&["dead-letters", "list", "--database-url", &pg.url(&db)]);
    let text = stderr(&out);
    assert!(!out.status.success(), "{text}");
    assert!(text.contains("run `pgoutbox setup"), "{text}");
}

/// A broker connection that never completes is not reported as "lost", and names the
/// timeout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn broker_connect_timeout_is_not_called_a_lost_connection() {
    let pg = Postgres::shared();
    let ob = Outbox::new(pg, &RabbitMq::shared().url(), "err_amqp_silent").await;
    let (_listener, port) = silent_listener();
    let run = Streamer::spawn(
        &[
            "run",
            "--database-url",
            &ob.streamer_url(),
            "--amqp-url",
            &format!("amqp://guest:guest@127.0.0.1:{port}/%2f"),
            "--slot",
            &ob.slot,
            "--publication",
            &ob.publication,
            "--exchange",
            &ob.exchange,
        ],
        &[("RUST_LOG", "info")],
    );
    let logged = run
        .wait_for_log(
            "session failed; reconnecting",
            scaled(Duration::from_secs(40)),
        )
        .await;
    let log = run.log();
    assert!(logged, "{log}");
    assert!(!log.contains("lost the RabbitMQ"), "{log}");
    assert!(log.contains(&format!("127.0.0.1:{port}")), "{log}");
    assert!(log.contains("timed out after"), "{log}");
}

/// When the broker closes the channel, its reply code and text are shown, not lapin's
/// "invalid channel state".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn broker_channel_close_shows_the_reply_code_and_text() {
    let pg = Postgres::shared();
    let url = RabbitMq::shared().url();
    let ob = Outbox::new(pg, &url, "err_chclose").await;
    let run = ob.run(&[]);
    assert!(
        run.wait_for_log("streaming", scaled(Duration::from_secs(30)))
            .await,
        "{}",
        run.log()
    );
    // Delete the exchange under the streamer: its next publish makes the broker close the
    // channel with 404 NOT_FOUND.
    let conn = support::amqp_connect(&url).await;
    let channel = conn.create_channel().await.expect("channel");
    channel
        .exchange_delete(
            ob.exchange.as_str().into(),
            lapin::options::ExchangeDeleteOptions::default(),
        )
        .await
        .expect("delete exchange");
    ob.sql("SELECT outbox.emit('a.b', '{}', '{}', 'close-1')");
    let logged = run
        .wait_for_log(
            "session failed; reconnecting",
            scaled(Duration::from_secs(30)),
        )
        .await;
    let log = run.log();
    assert!(logged, "{log}");
    let line = log
        .lines()
        .find(|l| l.contains("session failed; reconnecting"))
        .unwrap_or_default();
    assert!(line.contains("404"), "{line}");
    assert!(line.contains("NOT_FOUND"), "{line}");
    assert!(!line.contains("invalid channel state"), "{line}");
    let _ = conn.close(200, "bye".into()).await;
}

/// When the broker refuses a message for its size it closes the channel with 406; the
/// session's failure shows that reply, not lapin's "invalid channel state".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn broker_size_refusal_shows_the_reply_code_and_text() {
    let pg = Postgres::shared();
    let rabbit = RabbitMq::start_private();
    // Read by each new channel (RabbitMQ 3.10), so set before pgoutbox connects.
    rabbit.ctl_ok(&[
        "eval",
        "application:set_env(rabbit, max_message_size, 1048576).",
    ]);
    let ob = Outbox::new(pg, &rabbit.url(), "err_toolarge").await;
    let run = ob.run(&[]);
    assert!(
        run.wait_for_log("streaming", scaled(Duration::from_secs(30)))
            .await,
        "{}",
        run.log()
    );
    ob.sql("SELECT outbox.emit('a.b', jsonb_build_object('x', repeat('y', 2 * 1024 * 1024)), '{}', 'big-1')");
    let logged = run
        .wait_for_log(
            "session failed; reconnecting",
            scaled(Duration::from_secs(30)),
        )
        .await;
    let log = run.log();
    assert!(logged, "{log}");
    let line = log
        .lines()
        .find(|l| l.contains("session failed; reconnecting"))
        .unwrap_or_default();
    assert!(line.contains("406 PRECONDITION_FAILED"), "{line}");
    assert!(line.contains("larger than configured max size"), "{line}");
    assert!(!line.contains("invalid channel state"), "{line}");
}
