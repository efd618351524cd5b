//! Gaps in the slot's history (issue 10): a recreated slot is refused naming the range that
//! may be missing, `--accept-gap` starts anyway and `status` shows it; a slot behind the
//! record only means duplicates; and a data directory restored under a running streamer
//! loses nothing.

use std::collections::HashSet;
use std::time::Duration;

use crate::support::{lsn, scaled, Outbox, Postgres, RabbitMq, Streamer};

async fn wait_streaming(streamer: &Streamer) {
    assert!(
        streamer
            .wait_for_log(": streaming slot=", scaled(Duration::from_secs(30)))
            .await,
        "{}",
        streamer.log()
    );
}

/// The recorded flush LSN of the outbox's slot, as text (`X/Y`), or "" without a row.
fn recorded(ob: &Outbox<'_>) -> String {
    ob.sql(&format!(
        "SELECT flush_lsn FROM outbox.stream_state WHERE slot_name = '{}'",
        ob.slot
    ))
    .trim()
    .to_owned()
}

/// Emits `n` messages, one transaction each, with ids `{prefix}-1` .. `{prefix}-n`.
fn emit(ob: &Outbox<'_>, prefix: &str, n: usize) {
    let sql: String = (1..=n)
        .map(|i| {
            format!("SELECT outbox.emit('gap.t', '{{\"i\": {i}}}', '{{}}', '{prefix}-{i}');\n")
        })
        .collect();
    ob.sql(&sql);
}

fn ids_of(got: &[crate::support::Received]) -> HashSet<String> {
    got.iter().filter_map(|m| m.message_id.clone()).collect()
}

fn expected(prefix: &str, n: usize) -> HashSet<String> {
    (1..=n).map(|i| format!("{prefix}-{i}")).collect()
}

/// Streams `n` messages with a fresh streamer, waits until the slot and the record cover
/// them, and stops it cleanly.
async fn stream_and_stop(ob: &Outbox<'_>, prefix: &str, n: usize) {
    let streamer = ob.run(&[]);
    wait_streaming(&streamer).await;
    emit(ob, prefix, n);
    let got = ob.drain(n, scaled(Duration::from_secs(30))).await;
    assert_eq!(ids_of(&got), expected(prefix, n), "{}", streamer.log());
    assert!(
        ob.settled_through_now(scaled(Duration::from_secs(30)))
            .await,
        "the slot advanced past the messages:\n{}",
        streamer.log()
    );
    streamer.stop_ok(scaled(Duration::from_secs(30))).await;
    let rec = recorded(ob);
    assert!(
        lsn(&rec) >= ob.confirmed_flush(),
        "the record ({rec}) is never behind what the server was told ({})",
        ob.confirmed_flush()
    );
}

/// Issue 10: the slot dropped and recreated while the streamer is stopped, with events
/// emitted in between: `run` refuses, naming the range; with `--accept-gap` it streams and
/// `status` shows the recorded gap.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_recreated_slot_is_refused_naming_the_range_until_the_gap_is_accepted() {
    let pg = Postgres::shared();
    let rmq = RabbitMq::shared();
    let ob = Outbox::new(pg, &rmq.url(), "gap_recreated").await;
    stream_and_stop(&ob, "before", 5).await;
    let from = recorded(&ob);
    ob.sql(&format!("SELECT pg_drop_replication_slot('{}')", ob.slot));
    emit(&ob, "lost", 3);
    let out = ob.cli(&["setup", "--publication", &ob.publication]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let to = ob
        .sql(&format!(
            "SELECT confirmed_flush_lsn FROM pg_replication_slots WHERE slot_name = '{}'",
            ob.slot
        ))
        .trim()
        .to_owned();
    assert!(lsn(&to) > lsn(&from), "{to} > {from}");
    // `setup` itself says the slot it created has a recorded history, and the range.
    let said = String::from_utf8_lossy(&out.stderr);
    assert!(
        said.contains(&format!("slot {} was created now, but", ob.slot))
            && said.contains(&format!(
                "outbox messages committed between {from} and {to} may never have been delivered"
            ))
            && said.contains("--accept-gap"),
        "setup recreating a slot with a recorded history says so:\n{said}"
    );
    emit(&ob, "after", 4);

    let refused = ob.run(&[]);
    let status = refused.wait_exit(scaled(Duration::from_secs(30))).await;
    let log = refused.log();
    assert_eq!(status.map(|s| s.success()), Some(false), "{log}");
    assert!(
        log.contains(&format!(
            "outbox messages committed between {from} and {to} may never have been delivered"
        )),
        "the refusal names the range {from}..{to}:\n{log}"
    );
    assert!(log.contains("--accept-gap"), "and the fix:\n{log}");
    assert_eq!(recorded(&ob), from, "a refusal records nothing");
    // `status` sees the same gap before `run` is tried again.
    let st = ob.cli(&["status", "--publication", &ob.publication, "--json"]);
    let report: serde_json::Value = serde_json::from_slice(&st.stdout).expect("status json");
    assert_eq!(report["gap"]["from_lsn"], from.as_str(), "{report}");
    assert_eq!(report["gap"]["to_lsn"], to.as_str(), "{report}");
    assert_eq!(report["severity"], "critical", "{report}");

    let accepted = ob.run(&["--accept-gap"]);
    let got = ob.drain(4, scaled(Duration::from_secs(30))).await;
    assert_eq!(ids_of(&got), expected("after", 4), "{}", accepted.log());
    assert!(
        accepted.log().contains("starting despite a gap"),
        "{}",
        accepted.log()
    );
    accepted.sigterm();
    accepted.wait_exit(scaled(Duration::from_secs(30))).await;

    let st = ob.cli(&["status", "--publication", &ob.publication, "--json"]);
    let report: serde_json::Value = serde_json::from_slice(&st.stdout).expect("status json");
    let gaps = &report["stream_state"]["accepted_gaps"];
    assert_eq!(gaps.as_array().map(Vec::len), Some(1), "{report}");
    assert_eq!(gaps[0]["from_lsn"], from.as_str(), "{report}");
    assert_eq!(gaps[0]["to_lsn"], to.as_str(), "{report}");
    assert_eq!(gaps[0]["reason"], "slot_recreated", "{report}");
    assert!(
        report["gap"].is_null(),
        "accepted, no longer pending: {report}"
    );
    let text = ob.cli(&["status", "--publication", &ob.publication]);
    let text = String::from_utf8_lossy(&text.stdout);
    assert!(
        text.contains(&format!(
            "accepted gap:           {from} to {to} (slot_recreated"
        )),
        "{text}"
    );
}

/// Issue 10: a slot behind the recorded position only means duplicates: warn and stream,
/// nothing lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slot_behind_the_record_warns_and_streams_everything() {
    let pg = Postgres::shared();
    let rmq = RabbitMq::shared();
    let ob = Outbox::new(pg, &rmq.url(), "gap_behind").await;
    stream_and_stop(&ob, "first", 3).await;
    // As if the server had lost the slot's last confirmed position (a crash, a restored slot).
    ob.sql(&format!(
        "UPDATE outbox.stream_state SET flush_lsn = flush_lsn + 1048576 WHERE slot_name = '{}'",
        ob.slot
    ));
    emit(&ob, "second", 5);
    let streamer = ob.run(&[]);
    let got = ob.drain(5, scaled(Duration::from_secs(30))).await;
    assert_eq!(ids_of(&got), expected("second", 5), "{}", streamer.log());
    assert!(
        streamer
            .log()
            .contains("the slot begins before the flush LSN pgoutbox last reported"),
        "{}",
        streamer.log()
    );
    assert!(!streamer.log().contains("ERROR"), "{}", streamer.log());
}

/// Copies (or restores) a stopped cluster's data directory with `cp -a`.
fn copy_dir(from: &std::path::Path, to: &std::path::Path) {
    let _ = std::fs::remove_dir_all(to);
    let out = std::process::Command::new("cp")
        .arg("-a")
        .arg(from)
        .arg(to)
        .output()
        .expect("cp");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Issue 10: a running streamer; stop Postgres and copy its data directory; start it,
/// stream 1,000 messages; stop it immediately, restore the copy, start it; the streamer
/// reconnects; 1,000 new messages all arrive. The restored server has the same system
/// identifier and timeline, its WAL ends below the position the streamer settled, and its
/// outbox.stream_state is older than what the streamer recorded: the in-process resume
/// position must be dropped, or the new commits below it are skipped.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_data_directory_restored_under_a_running_streamer_loses_nothing() {
    let pg = Postgres::start_private(&[("wal_sender_timeout", "10s")]);
    let rmq = RabbitMq::shared();
    let ob = Outbox::new(&pg, &rmq.url(), "gap_restore").await;
    let streamer = ob.run(&[]);
    wait_streaming(&streamer).await;
    emit(&ob, "warm", 10);
    let got = ob.drain(10, scaled(Duration::from_secs(30))).await;
    assert_eq!(ids_of(&got), expected("warm", 10), "{}", streamer.log());
    // Settled before the stop: a message the queue holds may still wait for its confirm on a
    // loaded machine, and the next session then sends it again (at least once), which the
    // exact count of the first 1,000 below would read as a failure.
    assert!(
        ob.settled_through_now(scaled(Duration::from_secs(30)))
            .await,
        "the warm-up was never settled:\n{}",
        streamer.log()
    );

    pg.stop_fast();
    let copy = pg.root_dir().join("data-copy");
    copy_dir(&pg.data_dir(), &copy);
    pg.start();
    emit(&ob, "first", 1000);
    let got = ob.drain(1000, scaled(Duration::from_secs(60))).await;
    assert_eq!(ids_of(&got), expected("first", 1000), "{}", streamer.log());
    assert!(
        ob.settled_through_now(scaled(Duration::from_secs(30)))
            .await,
        "the streamer settled the first 1,000 (its resume position is past them):\n{}",
        streamer.log()
    );

    pg.stop_immediate();
    copy_dir(&copy, &pg.data_dir());
    pg.start();
    emit(&ob, "second", 1000);
    let got = ob.drain(1000, scaled(Duration::from_secs(90))).await;
    let ids = ids_of(&got);
    let want = expected("second", 1000);
    let missing: Vec<_> = want.difference(&ids).take(10).collect();
    assert!(
        missing.is_empty(),
        "{} of 1,000 new messages missing (e.g. {missing:?}):\n{}",
        want.difference(&ids).count(),
        streamer.log()
    );
    assert!(
        streamer
            .log()
            .contains("the server's history is not the one this process streamed from"),
        "{}",
        streamer.log()
    );
    assert!(streamer.try_status().is_none(), "still running");
    streamer.sigterm();
    streamer.wait_exit(scaled(Duration::from_secs(30))).await;
}

/// Emits `n` messages with ids `{prefix}-1` .. `{prefix}-n`, each in its own transaction
/// (a DO block committing after each: one psql command with several statements is one
/// transaction).
fn emit_each_committed(ob: &Outbox<'_>, prefix: &str, n: usize) {
    ob.sql(&format!(
        "DO $$ BEGIN FOR i IN 1..{n} LOOP \
           PERFORM outbox.emit('gap.t', jsonb_build_object('i', i), '{{}}', '{prefix}-' || i); \
           COMMIT; \
         END LOOP; END $$"
    ));
}

/// The pids of a running cluster: the postmaster (first line of `postmaster.pid`) and its
/// children.
fn cluster_pids(pg: &Postgres) -> (String, Vec<String>) {
    let pidfile = std::fs::read_to_string(pg.data_dir().join("postmaster.pid")).expect("pid");
    let postmaster = pidfile
        .lines()
        .next()
        .expect("postmaster pid")
        .trim()
        .to_owned();
    let out = std::process::Command::new("pgrep")
        .args(["-P", &postmaster])
        .output()
        .expect("pgrep");
    let children = String::from_utf8_lossy(&out.stdout)
        .split_whitespace()
        .map(str::to_owned)
        .collect();
    (postmaster, children)
}

fn signal_all(signal: &str, pids: &[String]) {
    let out = std::process::Command::new("kill")
        .arg(format!("-{signal}"))
        .args(pids)
        .output()
        .expect("kill");
    assert!(out.status.success(), "kill -{signal} {pids:?}");
}

/// A storage snapshot of a running cluster: every process stopped (SIGSTOP, the postmaster
/// first so that it forks no more), the data directory copied, every process continued.
/// The copy is what a crash at that instant would leave: what a volume snapshot restores.
fn snapshot_running(pg: &Postgres, to: &std::path::Path) {
    let (postmaster, _) = cluster_pids(pg);
    signal_all("STOP", std::slice::from_ref(&postmaster));
    let (_, children) = cluster_pids(pg);
    if !children.is_empty() {
        signal_all("STOP", &children);
    }
    copy_dir(&pg.data_dir(), to);
    if !children.is_empty() {
        signal_all("CONT", &children);
    }
    signal_all("CONT", &[postmaster]);
    // The copy's lock file names a postmaster that will be gone when it is restored.
    let _ = std::fs::remove_file(to.join("postmaster.pid"));
}

/// Issue 21 item 8: the watermark ahead of the recorded flush LSN when a session ends
/// (here: the record held back by a row lock; in production the record's slack, or the
/// confirms collected after PostgreSQL went away), and the database restored to a snapshot
/// holding that same record: same system identifier, same timeline, the record equal to
/// what this process recorded, and new commits written over the range above it before the
/// streamer reconnects. A resume from the watermark skips those commits; a resume from the
/// record, acknowledging only what this process settled there (same position, same
/// content), delivers every one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_snapshot_restored_while_the_record_lags_the_watermark_loses_nothing() {
    let pg = Postgres::start_private(&[("wal_sender_timeout", "10s")]);
    let rmq = RabbitMq::shared();
    let ob = Outbox::new(&pg, &rmq.url(), "gap_lagging_record").await;
    let proxy = crate::support::Proxy::start(pg.port());
    let http = crate::support::free_port();
    let streamer = ob.run_with_url(
        &ob.streamer_url_via(proxy.port()),
        &["--http-addr", &format!("127.0.0.1:{http}")],
    );
    wait_streaming(&streamer).await;
    emit(&ob, "warm", 5);
    let got = ob.drain(5, scaled(Duration::from_secs(30))).await;
    assert_eq!(ids_of(&got), expected("warm", 5), "{}", streamer.log());
    assert!(
        ob.settled_through_now(scaled(Duration::from_secs(30)))
            .await,
        "{}",
        streamer.log()
    );

    // Hold the record where it is: the recorder's UPDATE waits for this row lock (taken
    // after any write in progress committed).
    let holder = pg.client(&ob.db).await;
    holder
        .batch_execute("BEGIN; SELECT 1 FROM outbox.stream_state FOR UPDATE")
        .await
        .expect("lock the record");
    let held = recorded(&ob);
    let copy = pg.root_dir().join("data-snapshot");
    snapshot_running(&pg, &copy);

    emit_each_committed(&ob, "first", 200);
    let got = ob.drain(200, scaled(Duration::from_secs(60))).await;
    assert_eq!(ids_of(&got), expected("first", 200), "{}", streamer.log());
    // Every one published and settled (the watermark passed them: nothing unacknowledged),
    // while the record, and so the flush LSN sent to the server, is held back.
    let settled_unrecorded =
        crate::support::wait_until(scaled(Duration::from_secs(30)), || async {
            let text = crate::observability::scrape(http);
            let sample = |s| crate::observability::sample(&text, s).unwrap_or(-1.0);
            sample("pgoutbox_messages_published_total") >= 205.0
                && sample("pgoutbox_unacknowledged_messages") == 0.0
        })
        .await;
    assert!(
        settled_unrecorded,
        "{}\n{}",
        crate::observability::scrape(http),
        streamer.log()
    );
    assert_eq!(recorded(&ob), held, "the record was held back");

    // The session ends (the server unreachable), the server is replaced by the snapshot.
    proxy.refuse();
    proxy.cut();
    assert!(
        streamer
            .wait_for_log(
                "session failed; reconnecting",
                scaled(Duration::from_secs(30))
            )
            .await,
        "{}",
        streamer.log()
    );
    drop(holder);
    pg.stop_immediate();
    copy_dir(&copy, &pg.data_dir());
    pg.start();
    assert_eq!(recorded(&ob), held, "the snapshot holds the same record");
    // New commits over the range the first 200 took, and WAL past where they ended, before
    // the streamer can reconnect.
    emit_each_committed(&ob, "second", 200);
    ob.sql("SELECT pg_logical_emit_message(true, 'filler', repeat('x', 400000))");
    proxy.pass();
    let got = ob.drain(200, scaled(Duration::from_secs(90))).await;
    let ids = ids_of(&got);
    let want = expected("second", 200);
    let missing: Vec<_> = want.difference(&ids).take(10).collect();
    assert!(
        missing.is_empty(),
        "{} of 200 commits made on the restored snapshot missing (e.g. {missing:?}):\n{}",
        want.difference(&ids).count(),
        streamer.log()
    );
    assert!(streamer.try_status().is_none(), "still running");
    streamer.sigterm();
    streamer.wait_exit(scaled(Duration::from_secs(30))).await;
}
