//! What the book promises about stopping and losing peers: the bounded SIGTERM drain and
//! its non-zero exit, SIGINT handled like SIGTERM, the confirm collection after Postgres goes
//! away, and logs that never carry payloads or passwords.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use crate::support::{self, lsn, scaled, Outbox, Postgres, Proxy, RabbitMq, Streamer};

/// Waits until the streamer's trace log shows `n` more commits than `commits_before`: it has
/// read (and published) those transactions, so their messages are in flight.
async fn wait_in_flight(streamer: &Streamer, commits_before: usize, n: usize) {
    assert!(
        support::wait_until(scaled(Duration::from_secs(20)), || async {
            streamer.log_count(": commit end_lsn=") >= commits_before + n
        })
        .await,
        "the streamer read {n} commits:\n{}",
        streamer.log()
    );
}

/// docs/src/operators/deploy.md: `run` waits at most `--shutdown-timeout-s` for outstanding confirms
/// and exits non-zero when the drain timed out, having acknowledged nothing unconfirmed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_drain_that_times_out_exits_non_zero_after_the_timeout() {
    let pg = Postgres::shared();
    let rmq = RabbitMq::start_private();
    let ob = Outbox::new(pg, &rmq.url(), "life_drain_timeout").await;
    let streamer = ob.run(&["--shutdown-timeout-s", "3"]);
    assert!(
        streamer
            .wait_for_log(": streaming slot=", scaled(Duration::from_secs(20)))
            .await,
        "{}",
        streamer.log()
    );
    rmq.block();
    let commits = streamer.log_count(": commit end_lsn=");
    let held = ob.emit("d", "held");
    wait_in_flight(&streamer, commits, 1).await;
    let t = Instant::now();
    streamer.sigterm();
    let status = streamer.wait_exit(scaled(Duration::from_secs(30))).await;
    let took = t.elapsed();
    let log = streamer.log();
    eprintln!("drain timeout: exit {status:?} after {took:.1?}");
    assert_eq!(
        status.map(|s| s.success()),
        Some(false),
        "a drain that timed out exits non-zero:\n{log}"
    );
    assert!(
        took >= Duration::from_millis(2_500),
        "it waited about --shutdown-timeout-s 3 before giving up, not {took:?}:\n{log}"
    );
    assert!(
        took < Duration::from_secs(3) + scaled(Duration::from_secs(10)),
        "it gave up after about --shutdown-timeout-s 3, not {took:?}:\n{log}"
    );
    assert!(
        log.contains("shutdown timed out with 1 messages unconfirmed"),
        "{log}"
    );
    assert!(
        ob.not_acknowledged(held),
        "the unconfirmed message was not acknowledged"
    );
    // It is sent again by the next run.
    rmq.unblock();
    let again = ob.run(&[]);
    let got = ob.drain(1, scaled(Duration::from_secs(30))).await;
    let ids: Vec<_> = got.iter().filter_map(|m| m.message_id.clone()).collect();
    assert!(
        ids.contains(&"held".to_string()),
        "{ids:?}\n{}",
        again.log()
    );
}

/// docs/src/reference/cli.md: `run` streams until SIGINT/SIGTERM; with nothing in flight SIGINT is a
/// clean shutdown (final status update, exit 0).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigint_with_nothing_in_flight_exits_zero() {
    let pg = Postgres::shared();
    let ob = Outbox::new(pg, &RabbitMq::shared().url(), "life_sigint").await;
    let streamer = ob.run(&[]);
    let last = ob.emit("i", "before-sigint");
    assert_eq!(ob.drain(1, scaled(Duration::from_secs(20))).await.len(), 1);
    assert!(
        ob.flushed_past(last, scaled(Duration::from_secs(10))).await,
        "nothing is in flight before the signal"
    );
    let t = Instant::now();
    streamer.sigint();
    let status = streamer.wait_exit(scaled(Duration::from_secs(10))).await;
    let log = streamer.log();
    eprintln!("sigint: exit {status:?} after {:.1?}", t.elapsed());
    assert_eq!(
        status.and_then(|s| s.code()),
        Some(0),
        "SIGINT is a clean shutdown:\n{log}"
    );
    assert!(log.contains("shutdown requested"), "{log}");
    assert!(log.contains("stopped"), "{log}");
}

/// docs/src/consumers/guarantee.md: "Unconfirmed messages are sent again; confirmed
/// ones are not (when Postgres went away, outstanding confirms are collected for up to 5 s
/// first)". Messages published to a blocked broker are in flight when the replication
/// connection is cut; the broker is unblocked within the 5 s: their confirms are collected
/// and the next session starts after them, so none is published twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn confirms_collected_after_postgres_went_away_are_not_sent_again() {
    let pg = Postgres::shared();
    let rmq = RabbitMq::start_private();
    let pg_proxy = Proxy::start(pg.port());
    let ob = Outbox::new(pg, &rmq.url(), "life_pg_loss").await;
    let via_proxy = ob.streamer_url_via(pg_proxy.port());
    // A generous collection window: the drain ends as soon as nothing is unconfirmed, and
    // on a loaded machine unblocking the broker alone can take longer than the default 5 s.
    let streamer = ob.run_with_url(&via_proxy, &["--postgres-loss-drain-ms", "60000"]);
    assert!(
        streamer
            .wait_for_log(": streaming slot=", scaled(Duration::from_secs(20)))
            .await,
        "{}",
        streamer.log()
    );
    rmq.block();
    let commits = streamer.log_count(": commit end_lsn=");
    let n = 20;
    for i in 1..=n {
        ob.sql(&format!(
            "SELECT outbox.emit('l', '{{}}', '{{}}', 'held-{i}')"
        ));
    }
    wait_in_flight(&streamer, commits, n).await;
    pg_proxy.cut();
    assert!(
        streamer
            .wait_for_log(
                "collecting outstanding confirms before reconnecting",
                scaled(Duration::from_secs(10))
            )
            .await,
        "{}",
        streamer.log()
    );
    let t = Instant::now();
    rmq.unblock();
    eprintln!(
        "pg loss: broker unblocked {:.1?} after the loss was logged",
        t.elapsed()
    );
    assert!(
        support::wait_until(scaled(Duration::from_secs(60)), || async {
            streamer.log_count(": streaming slot=") >= 2
        })
        .await,
        "a new session starts:\n{}",
        streamer.log()
    );
    ob.assert_streams_as_streamer(scaled(Duration::from_secs(30)), "after the loss")
        .await;
    let last = ob.emit("l", "after");
    assert!(
        ob.flushed_past(last, scaled(Duration::from_secs(30))).await,
        "{}",
        streamer.log()
    );
    let got = ob.drain(n + 1, scaled(Duration::from_secs(10))).await;
    let mut copies: HashMap<String, usize> = HashMap::new();
    for m in &got {
        *copies.entry(m.message_id.clone().unwrap()).or_default() += 1;
    }
    eprintln!(
        "pg loss: {} delivered for {} distinct",
        got.len(),
        copies.len()
    );
    assert_eq!(copies.len(), n + 1, "all delivered: {copies:?}");
    let twice: Vec<_> = copies.iter().filter(|(_, c)| **c > 1).collect();
    assert!(
        twice.is_empty(),
        "confirmed after the loss yet sent again: {twice:?}\n{}",
        streamer.log()
    );
}

/// docs/src/operators/secrets.md: payloads and passwords are never logged, at the most verbose
/// level of every crate (`RUST_LOG=trace`), over a cleartext-password Postgres role and a
/// PLAIN RabbitMQ user, on the publish path and the dead-letter path.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn payloads_and_passwords_never_reach_the_log() {
    let log = log_of_a_run_with_secrets(&[]).await;
    assert!(
        log.contains("TRACE pgoutbox::pipeline"),
        "trace logging was on:\n{log}"
    );
}

/// docs/src/operators/configuration.md, "Logging" (issue 32, item 6): stderr that takes
/// nothing (a pipe nobody reads, a stalled log collector) never stops the stream. `run` logs
/// at trace (two lines per transaction) into a pipe the test leaves unread while 8,000
/// transactions are streamed: more lines than the log's queue holds (10,000) plus what a
/// 64 KiB pipe holds. Every message is delivered and confirmed while the pipe is full; the
/// lines beyond the bound are dropped and counted (`pgoutbox_log_lines_dropped_total`);
/// then the pipe is read: it holds the lines that were kept, in order, and at the end the
/// shutdown's lines and the count of what was dropped. With the lossless queue (13dcbb8)
/// logging waited once 10,000 lines were queued, and the stream stopped with it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stderr_nobody_reads_never_stops_the_stream_and_drops_are_counted() {
    const N: usize = 8_000;
    let pg = Postgres::shared();
    let ob = Outbox::new(pg, &RabbitMq::shared().url(), "life_stderr_unread").await;
    let port = support::free_port();
    let addr = format!("127.0.0.1:{port}");
    let (streamer, mut stderr) = ob.run_with_stderr_pipe(&["--http-addr", &addr]);
    ob.sql(&format!(
        "DO $$ BEGIN FOR i IN 1..{N} LOOP PERFORM outbox.emit('u', jsonb_build_object('n', i), '{{}}', 'u-' || i); COMMIT; END LOOP; END $$"
    ));
    let got = ob.drain(N, scaled(Duration::from_secs(90))).await;
    let ids: std::collections::HashSet<_> =
        got.iter().filter_map(|m| m.message_id.clone()).collect();
    let delivered = ids.len();
    // Still unread: the dropped lines are counted where an operator looks.
    let dropped = if delivered == N {
        crate::observability::metric(port, "pgoutbox_log_lines_dropped_total")
    } else {
        0.0
    };
    let reader = std::thread::spawn(move || {
        let mut text = String::new();
        std::io::Read::read_to_string(&mut stderr, &mut text).map(|_| text)
    });
    if delivered == N {
        // Read now: once a transaction's lines are logged without a drop, the queue has
        // room, and the shutdown's lines will not be dropped.
        let drained = support::wait_until(scaled(Duration::from_secs(30)), || async {
            let before = crate::observability::metric(port, "pgoutbox_log_lines_dropped_total");
            ob.sql("SELECT outbox.emit('u', '{}', '{}', 'u-after')");
            tokio::time::sleep(Duration::from_millis(200)).await;
            crate::observability::metric(port, "pgoutbox_log_lines_dropped_total") == before
        })
        .await;
        assert!(drained, "the log's queue drains once stderr is read");
    }
    streamer.sigterm();
    let status = streamer.wait_exit(scaled(Duration::from_secs(30))).await;
    let log = reader.join().expect("reader").expect("read stderr");
    assert_eq!(
        delivered,
        N,
        "every message was delivered while stderr was not read ({delivered} of {N}); the log's tail:\n{}",
        &log[log.len().saturating_sub(2_000)..]
    );
    assert_eq!(status.and_then(|s| s.code()), Some(0), "{log}");
    let commits = log.matches(": commit end_lsn=").count();
    eprintln!(
        "stderr unread: {delivered} messages delivered, {} bytes of log kept, {commits} commit lines, {dropped} lines dropped",
        log.len()
    );
    assert!(
        dropped > 0.0,
        "the lines beyond the bound were dropped and counted"
    );
    assert!(
        commits < N,
        "{commits} commit lines for {N} transactions: nothing was dropped"
    );
    let (requested, stopped) = (log.find("shutdown requested"), log.rfind("stopped"));
    assert!(
        requested.is_some() && stopped > requested,
        "the last lines are the shutdown's, in order:\n{}",
        &log[log.len().saturating_sub(2_000)..]
    );
    assert!(
        log.contains("log lines were dropped"),
        "the exit names the count:\n{}",
        &log[log.len().saturating_sub(2_000)..]
    );
}

/// docs/src/operators/configuration.md, `--log-format json`: every line the process writes to stderr is
/// one JSON object with `level`, `target` and `message`, on the same run as above (trace
/// level, passwords in both URLs, a published and two dead-lettered payloads), and no line
/// carries a payload or a password. The exit report of a refused login is one object too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn json_logs_are_one_object_per_line_without_secrets() {
    let log = log_of_a_run_with_secrets(&["--log-format", "json"]).await;
    let objects = json_lines(&log);
    assert!(
        objects.iter().any(|o| o["level"] == "TRACE"
            && o["target"]
                .as_str()
                .is_some_and(|t| t.starts_with("pgoutbox::pipeline"))),
        "trace logging was on:\n{log}"
    );
    // Structured fields stay fields, at the top level next to the message.
    assert!(
        objects.iter().any(|o| o["slot"].is_string()),
        "no line carries a slot field:\n{log}"
    );
    assert!(
        objects.iter().any(|o| o["lsn"].is_string()),
        "no line carries an lsn field:\n{log}"
    );
    eprintln!("json logs: {} objects", objects.len());
}

/// Parses every line of `log` as one JSON object with a `level`, a `target` and a
/// `message` string, naming the first line that is not.
fn json_lines(log: &str) -> Vec<serde_json::Value> {
    assert!(!log.trim().is_empty(), "the log is empty");
    log.lines()
        .enumerate()
        .map(|(i, line)| {
            let value: serde_json::Value = serde_json::from_str(line).unwrap_or_else(|e| {
                panic!("line {} is not JSON ({e}): {line}\nlog:\n{log}", i + 1)
            });
            for key in ["level", "target", "message"] {
                assert!(
                    value[key].is_string(),
                    "line {} has no {key} string: {line}",
                    i + 1
                );
            }
            value
        })
        .collect()
}

/// The exit report of `run --log-format json` is one JSON object too: a RabbitMQ login
/// refused (a definite error, exit 1) with the cause chain, without the password; a usage
/// error (exit 2), found by pgoutbox and found by clap.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn json_exit_reports_are_one_object() {
    let pg = Postgres::shared();
    let rmq = RabbitMq::shared();
    let ob = Outbox::new(pg, &rmq.url(), "life_json_exit").await;
    let password = format!("WrongSecret{}q8R", std::process::id());
    let bad_amqp = format!("amqp://guest:{password}@127.0.0.1:{}/%2f", rmq.port());
    let cases: [(&str, Vec<String>, i32); 3] = [
        ("refused login", vec!["--amqp-url".into(), bad_amqp], 1),
        (
            "out of range",
            vec!["--max-in-flight".into(), "0".into()],
            2,
        ),
        ("unknown flag", vec!["--no-such-flag".into()], 2),
    ];
    for (what, extra, code) in cases {
        let mut args: Vec<String> = vec![
            "run".into(),
            "--log-format".into(),
            "json".into(),
            "--database-url".into(),
            ob.streamer_url(),
            "--slot".into(),
            ob.slot.clone(),
            "--publication".into(),
            ob.publication.clone(),
            "--exchange".into(),
            ob.exchange.clone(),
        ];
        if !extra.contains(&"--amqp-url".to_string()) {
            args.extend(["--amqp-url".into(), rmq.url()]);
        }
        args.extend(extra);
        let streamer = Streamer::spawn(&args, &[("RUST_LOG", "info")]);
        let status = streamer.wait_exit(scaled(Duration::from_secs(30))).await;
        let log = streamer.log();
        assert_eq!(status.and_then(|s| s.code()), Some(code), "{what}:\n{log}");
        let objects = json_lines(&log);
        let last = objects.last().expect("a line");
        assert_eq!(last["level"], "ERROR", "{what}: {log}");
        assert!(
            !log.contains(&password),
            "{what}: the password is in the log:\n{log}"
        );
        eprintln!(
            "json exit report, {what}: {}",
            log.lines().last().unwrap_or("")
        );
    }
}

/// Runs the stream of the secrets tests (`extra` added to `run`'s arguments) and returns
/// its log, having asserted that no payload and no password appears in it.
async fn log_of_a_run_with_secrets(extra: &[&str]) -> String {
    let pg = Postgres::start_private(&[]);
    let rmq = RabbitMq::shared();
    let ob = Outbox::new(&pg, &rmq.url(), "life_secrets").await;
    let tag = std::process::id();
    let pg_password = format!("PgSecret{tag}x7Q");
    let amqp_password = format!("AmqpSecret{tag}k3Z");
    let amqp_user = support::unique("secret_user");
    let marker = format!("PayloadMarker{tag}w9E");
    // pw_cleartext authenticates with a cleartext password (the password travels on the
    // wire; the streamer role has none); in this private cluster it becomes a member of the
    // streamer role, so `run` has that role's grants (dead letters included) and no more.
    pg.psql(
        "postgres",
        &format!(
            "ALTER ROLE pw_cleartext PASSWORD '{pg_password}'; \
             GRANT {} TO pw_cleartext",
            support::fixture::STREAMER_ROLE
        ),
    );
    rmq.ctl_ok(&["add_user", &amqp_user, &amqp_password]);
    rmq.ctl_ok(&["set_permissions", "-p", "/", &amqp_user, ".*", ".*", ".*"]);
    let amqp_url = format!(
        "amqp://{amqp_user}:{amqp_password}@127.0.0.1:{}/%2f",
        rmq.port()
    );
    let db_url = pg.url_as("pw_cleartext", &pg_password, &ob.db);
    let args: Vec<String> = vec![
        "run".into(),
        "--database-url".into(),
        db_url,
        "--amqp-url".into(),
        amqp_url,
        "--slot".into(),
        ob.slot.clone(),
        "--publication".into(),
        ob.publication.clone(),
        "--exchange".into(),
        ob.exchange.clone(),
        "--max-message-bytes".into(),
        "2000".into(),
    ];
    let args: Vec<String> = args
        .into_iter()
        .chain(extra.iter().map(|s| s.to_string()))
        .collect();
    let streamer = Streamer::spawn(&args, &[("RUST_LOG", "trace")]);
    // Published, dead-lettered as too large, dead-lettered as poison (not an envelope).
    ob.sql(&format!(
        "SELECT outbox.emit('s', jsonb_build_object('m', '{marker}'), jsonb_build_object('h', '{marker}'), 'published')"
    ));
    ob.sql(&format!(
        "SELECT outbox.emit('s', jsonb_build_object('m', '{marker}', 'pad', repeat('y', 3000)), '{{}}', 'too-big')"
    ));
    let last = lsn(&ob.sql(&format!(
        "SELECT pg_logical_emit_message(true, 'pgoutbox', 'not an envelope {marker}')"
    )));
    let got = ob.drain(1, scaled(Duration::from_secs(30))).await;
    assert_eq!(got.len(), 1, "{}", streamer.log());
    assert!(got[0].body_str().contains(&marker));
    assert!(
        ob.flushed_past(last, scaled(Duration::from_secs(20))).await,
        "{}",
        streamer.log()
    );
    assert_eq!(
        ob.sql("SELECT count(*) FROM outbox.dead_letter").trim(),
        "2",
        "{}",
        streamer.log()
    );
    streamer.stop_ok(scaled(Duration::from_secs(20))).await;
    let log = streamer.log();
    rmq.ctl_ok(&["delete_user", &amqp_user]);
    let as_bytes = |s: &str| {
        s.bytes()
            .map(|b| b.to_string())
            .collect::<Vec<_>>()
            .join(", ")
    };
    let as_hex = |s: &str| s.bytes().map(|b| format!("{b:02x}")).collect::<String>();
    for (what, secret) in [
        ("the Postgres password", &pg_password),
        ("the RabbitMQ password", &amqp_password),
        ("a payload", &marker),
    ] {
        for (form, needle) in [
            ("text", secret.clone()),
            ("a byte list", as_bytes(secret)),
            ("hex", as_hex(secret)),
        ] {
            let hits: Vec<&str> = log.lines().filter(|l| l.contains(&needle)).collect();
            assert!(
                hits.is_empty(),
                "{what} appears in the log as {form} ({} lines), e.g.:\n{}",
                hits.len(),
                hits.iter()
                    .take(3)
                    .map(|l| &l[..l.len().min(400)])
                    .collect::<Vec<_>>()
                    .join("\n")
            );
        }
    }
    eprintln!(
        "secrets: {} log lines at RUST_LOG=trace, no password or payload",
        log.lines().count()
    );
    log
}
