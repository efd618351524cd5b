//! `run --stream-url URL --stream NAME` (issue 19): every outbox message goes into a RabbitMQ
//! stream over the stream protocol, deduplicated by publishing ids derived from the WAL. The
//! stream is read back with `rstream`, a client we did not write (`support::read_stream`).

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crate::support::{self, lsn, scaled, Outbox, Postgres, RabbitMq, StreamMessage, Streamer};

/// `run` against `ob`, publishing into `stream` on `rmq` (instance id `instance`).
fn run_stream(
    ob: &Outbox<'_>,
    rmq: &RabbitMq,
    stream: &str,
    instance: &str,
    extra: &[&str],
) -> Streamer {
    let mut args = vec!["--instance-id", instance];
    args.extend_from_slice(extra);
    run_stream_at(ob, &[rmq.stream_url()], stream, &args)
}

/// `run` against `ob`, publishing into `stream` at the nodes `urls` (`--stream-url` each).
fn run_stream_at(ob: &Outbox<'_>, urls: &[String], stream: &str, extra: &[&str]) -> Streamer {
    let mut args: Vec<String> = vec![
        "run".into(),
        "--database-url".into(),
        ob.streamer_url(),
        "--stream".into(),
        stream.into(),
        "--slot".into(),
        ob.slot.clone(),
        "--publication".into(),
        ob.publication.clone(),
        "--http-addr".into(),
        "off".into(),
    ];
    for url in urls {
        args.extend(["--stream-url".into(), url.clone()]);
    }
    args.extend(extra.iter().map(|s| s.to_string()));
    Streamer::spawn(&args, &[("RUST_LOG", "info")])
}

/// Every message of `stream`, read from its first offset (stops once none came for `idle`).
async fn read_all(rmq: &RabbitMq, stream: &str, idle: Duration) -> Vec<StreamMessage> {
    let (url, stream) = (rmq.stream_url(), stream.to_owned());
    tokio::task::spawn_blocking(move || support::read_stream_url(&url, &stream, usize::MAX, idle))
        .await
        .expect("reader")
}

/// The commit-order check: commit LSNs never decrease along the stream, and within one
/// commit the message LSNs increase. Returns the number of inversions found.
fn order_inversions(messages: &[StreamMessage]) -> usize {
    let mut inversions = 0;
    let mut last: Option<(u64, u64)> = None;
    for m in messages {
        let commit = lsn(m.app_str("x-pgoutbox-commit-lsn").expect("commit LSN"));
        let at = lsn(m.app_str("x-pgoutbox-lsn").expect("LSN"));
        if let Some((c, l)) = last {
            if commit < c || (commit == c && at <= l) {
                inversions += 1;
            }
        }
        last = Some((commit, at));
    }
    inversions
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn messages_arrive_once_with_the_properties_and_headers_of_the_exchange_path() {
    let pg = Postgres::shared();
    let rmq = RabbitMq::shared();
    let ob = Outbox::new_without_queue(pg, &rmq.url(), "stream_shape").await;
    let stream = support::unique("stream_shape");
    let streamer = run_stream(
        &ob,
        rmq,
        &stream,
        "shape-a",
        &[
            "--stream-max-age",
            "7D",
            "--stream-max-length-bytes",
            "100000000",
        ],
    );
    ob.sql(
        "BEGIN; \
         SELECT outbox.emit('orders.created', '{\"n\": 1, \"s\": \"é\"}', '{\"h\": \"v\", \"k\": 7}', 'm-1', \
                correlation_id => 'corr-1', aggregate_type => 'order', aggregate_id => 'o-1', aggregate_version => 3); \
         SELECT outbox.emit('orders.paid', '{\"n\": 2}', '{}', 'm-2'); \
         COMMIT;",
    );
    ob.emit("orders.shipped", "m-3");
    assert!(
        ob.settled_through_now(scaled(Duration::from_secs(60)))
            .await,
        "the slot never moved past the messages:\n{}",
        streamer.log()
    );
    let got = read_all(rmq, &stream, scaled(Duration::from_secs(5))).await;
    let ids: Vec<_> = got
        .iter()
        .map(|m| m.message_id.clone().unwrap_or_default())
        .collect();
    assert_eq!(ids, ["m-1", "m-2", "m-3"], "{got:#?}\n{}", streamer.log());
    let m = &got[0];
    assert_eq!(m.subject.as_deref(), Some("orders.created"));
    assert_eq!(m.content_type.as_deref(), Some("application/json"));
    assert_eq!(m.correlation_id.as_deref(), Some("corr-1"));
    assert_eq!(
        m.body,
        "{\"n\": 1, \"s\": \"é\"}".as_bytes(),
        "byte-exact payload"
    );
    assert_eq!(m.app_str("h"), Some("v"));
    assert_eq!(m.application_properties["k"], serde_json::json!(7));
    assert_eq!(m.app_str("x-pgoutbox-aggregate-id"), Some("o-1"));
    assert_eq!(m.app_str("x-pgoutbox-aggregate-type"), Some("order"));
    assert_eq!(
        m.application_properties["x-pgoutbox-aggregate-version"],
        serde_json::json!(3)
    );
    let commit_us = m.application_properties["x-pgoutbox-commit-time-us"]
        .as_i64()
        .expect("commit time");
    assert_eq!(m.creation_time, Some(commit_us.div_euclid(1000)));
    // Both messages of the first transaction carry its commit LSN; their own LSNs increase.
    assert_eq!(
        got[0].app_str("x-pgoutbox-commit-lsn"),
        got[1].app_str("x-pgoutbox-commit-lsn")
    );
    assert_eq!(order_inversions(&got), 0);
    assert_eq!(got[2].subject.as_deref(), Some("orders.shipped"));
    // run created the stream with the arguments it was given.
    let queues = rmq.ctl_ok(&["list_queues", "name", "type", "arguments"]);
    let line = queues
        .lines()
        .find(|l| l.starts_with(&stream))
        .unwrap_or_else(|| panic!("no {stream} in {queues}"));
    assert!(
        line.contains("stream") && line.contains("7D") && line.contains("100000000"),
        "{line}"
    );
    let own = support::stream_reader::read_stream_own(
        rmq.stream_port(),
        &stream,
        scaled(Duration::from_secs(5)),
    )
    .await;
    let own_ids: Vec<_> = own
        .iter()
        .map(|m| m.message_id.clone().unwrap_or_default())
        .collect();
    assert_eq!(own_ids, ["m-1", "m-2", "m-3"], "our own reader");
    assert_eq!(own[0].subject.as_deref(), Some("orders.created"));
    assert_eq!(own[0].strings.get("h").map(String::as_str), Some("v"));
    assert_eq!(own[0].body, got[0].body);

    // A restart sends nothing again: the broker's stored id covers every message.
    streamer.stop_ok(scaled(Duration::from_secs(30))).await;
    let again = run_stream(&ob, rmq, &stream, "shape-b", &[]);
    assert!(
        again
            .wait_for_log("stream publisher declared", scaled(Duration::from_secs(60)))
            .await,
        "{}",
        again.log()
    );
    ob.emit("orders.closed", "m-4");
    assert!(
        ob.settled_through_now(scaled(Duration::from_secs(60)))
            .await,
        "{}",
        again.log()
    );
    let got = read_all(rmq, &stream, scaled(Duration::from_secs(5))).await;
    let ids: Vec<_> = got
        .iter()
        .map(|m| m.message_id.clone().unwrap_or_default())
        .collect();
    assert_eq!(ids, ["m-1", "m-2", "m-3", "m-4"], "{}", again.log());
    again.stop_ok(scaled(Duration::from_secs(30))).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crash_after_the_confirm_and_before_the_flush_is_deduplicated() {
    let pg = Postgres::shared();
    let rmq = RabbitMq::shared();
    let ob = Outbox::new_without_queue(pg, &rmq.url(), "stream_failpoint").await;
    let stream = support::unique("stream_failpoint");
    let mut last = 0;
    for i in 0..50 {
        last = ob.emit("t.crash", &format!("f-{i}"));
    }
    let crashing = run_stream(
        &ob,
        rmq,
        &stream,
        "fp-a",
        &["--failpoint", "abort-after-confirms=50"],
    );
    let exit = crashing.wait_exit(scaled(Duration::from_secs(60))).await;
    assert!(
        exit.is_some_and(|s| !s.success()),
        "the failpoint did not abort: {exit:?}\n{}",
        crashing.log()
    );
    assert!(
        ob.not_acknowledged(last),
        "the flush report went out before the abort; the test proves nothing"
    );
    let stored = read_all(rmq, &stream, scaled(Duration::from_secs(5))).await;
    assert_eq!(
        stored.len(),
        50,
        "the broker confirmed all 50 before the abort"
    );

    // The replay: every message is counted as stored at start, none is sent again.
    let again = run_stream(&ob, rmq, &stream, "fp-b", &[]);
    assert!(
        ob.flushed_past(last, scaled(Duration::from_secs(60))).await,
        "{}",
        again.log()
    );
    again.stop_ok(scaled(Duration::from_secs(30))).await;
    let log = again.log();
    assert!(
        log.contains("skipped=50"),
        "no dedup at start in the log:\n{log}"
    );
    let after = read_all(rmq, &stream, scaled(Duration::from_secs(5))).await;
    assert_eq!(
        after.len(),
        50,
        "the stream grew on the replay: {}",
        after.len()
    );
    eprintln!("failpoint: 50 confirmed before the abort, 50 skipped at start, stream length 50");
}

/// The kill schedule's producer: transactions of 1 to 4 messages, recorded in `audit` in the
/// same transaction.
async fn producer(
    url: String,
    p: i32,
    target: usize,
    committed: Arc<AtomicUsize>,
    stop: Arc<AtomicBool>,
) {
    let mut client = Postgres::client_url(&url).await.expect("producer connects");
    let mut seq = 0i32;
    let topic = format!("kills.{p}");
    while !stop.load(Ordering::SeqCst) && committed.load(Ordering::SeqCst) < target {
        seq += 1;
        let n = 1 + (seq % 4);
        let tx = client.transaction().await.expect("begin");
        for j in 0..n {
            let id = format!("p{p}-{seq}-{j}");
            tx.execute(
                "SELECT outbox.emit($5::text, jsonb_build_object('p', $1::int, 's', $2::int, 'j', $3::int), '{}', $4)",
                &[&p, &seq, &j, &id, &topic],
            )
            .await
            .expect("emit");
            tx.execute("INSERT INTO audit (message_id) VALUES ($1)", &[&id])
                .await
                .expect("audit");
        }
        tx.commit().await.expect("commit");
        committed.fetch_add(n as usize, Ordering::SeqCst);
    }
}

/// The instance id of the process holding the slot (`pgoutbox-ID` is its walsender's
/// application name), if any.
fn holder(ob: &Outbox<'_>) -> Option<String> {
    let name = ob.sql(&format!(
        "SELECT a.application_name FROM pg_replication_slots s JOIN pg_stat_activity a ON a.pid = s.active_pid WHERE s.slot_name = '{}'",
        ob.slot
    ));
    name.trim().strip_prefix("pgoutbox-").map(str::to_owned)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kills_takeovers_and_a_broker_restart_leave_every_message_once_in_commit_order() {
    let target = support::scaled_count(20_000);
    let pg = Postgres::shared();
    // Stopped when the test ends (Drop), whatever its outcome.
    let rmq = Arc::new(RabbitMq::start_private());
    let ob = Outbox::new_without_queue(pg, &rmq.url(), "stream_kills").await;
    ob.sql("CREATE TABLE audit (message_id text PRIMARY KEY)");
    let stream = support::unique("stream_kills");
    // Two processes on one slot: one streams, the other stands by and takes over.
    let mut next = 0;
    let spawn = |next: &mut usize| {
        *next += 1;
        let id = format!("k{next}");
        (
            id.clone(),
            run_stream(&ob, &rmq, &stream, &id, &["--standby-poll-ms", "200"]),
        )
    };
    let mut procs: HashMap<String, Streamer> = HashMap::new();
    for _ in 0..2 {
        let (id, s) = spawn(&mut next);
        procs.insert(id, s);
    }
    let committed = Arc::new(AtomicUsize::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let producers: Vec<_> = (0..3)
        .map(|p| {
            tokio::spawn(producer(
                ob.url(),
                p,
                target,
                committed.clone(),
                stop.clone(),
            ))
        })
        .collect();
    let kills = 8;
    let mut restart = None;
    let mut logs = String::new();
    let mut seed = 0x2545_F491_4F6C_DD1Du64;
    for round in 0..kills + 1 {
        // Wait for progress: the kills land at random points of the first 80 % of the
        // production, the broker restart in the last part.
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        let at = target * (round + 1) / (kills + 3) + (seed as usize % (target / 40).max(1));
        let moved = support::wait_until(scaled(Duration::from_secs(120)), || async {
            committed.load(Ordering::SeqCst) >= at
        })
        .await;
        assert!(
            moved,
            "round {round}: producers stalled at {}",
            committed.load(Ordering::SeqCst)
        );
        if round == kills {
            // Last, near the end of the production, in the background: the producers and the kills go on meanwhile.
            eprintln!("stream kills: round {round}: restarting RabbitMQ");
            let node = rmq.clone();
            restart = Some(tokio::task::spawn_blocking(move || {
                node.stop_app();
                std::thread::sleep(Duration::from_millis(500));
                node.start_app();
            }));
            continue;
        }
        let held = support::wait_until(scaled(Duration::from_secs(60)), || {
            let h = holder(&ob);
            async move { h.is_some() }
        })
        .await;
        assert!(held, "round {round}: nobody holds the slot");
        let victim = holder(&ob).expect("holder");
        let Some(p) = procs.remove(&victim) else {
            panic!("round {round}: the holder {victim} is none of ours");
        };
        eprintln!(
            "stream kills: round {round}: SIGKILL the holder {victim} at {} committed",
            committed.load(Ordering::SeqCst)
        );
        p.kill9();
        p.wait_exit(Duration::from_secs(10)).await;
        logs.push_str(&p.log());
        let (id, s) = spawn(&mut next);
        procs.insert(id, s);
    }
    for p in producers {
        p.await.expect("producer");
    }
    if let Some(r) = restart {
        r.await.expect("the broker restart");
    }
    stop.store(true, Ordering::SeqCst);
    let total: usize = ob
        .sql("SELECT count(*) FROM audit")
        .trim()
        .parse()
        .expect("count");
    assert!(
        ob.settled_through_now(scaled(Duration::from_secs(180)))
            .await,
        "the slot never passed the last commit"
    );
    for (_, p) in procs.drain() {
        p.stop_ok(scaled(Duration::from_secs(30))).await;
        logs.push_str(&p.log());
    }
    let got = read_all(&rmq, &stream, scaled(Duration::from_secs(10))).await;
    // Our own reader sees the same entries, in the same order, with the same bytes.
    let own = support::stream_reader::read_stream_own(
        rmq.stream_port(),
        &stream,
        scaled(Duration::from_secs(10)),
    )
    .await;
    assert_eq!(
        own.len(),
        got.len(),
        "our reader and rstream disagree on the length"
    );
    for (o, r) in own.iter().zip(&got) {
        assert_eq!(
            (o.offset, &o.message_id, &o.body),
            (r.offset, &r.message_id, &r.body)
        );
        assert_eq!(
            o.strings.get("x-pgoutbox-commit-lsn").map(String::as_str),
            r.app_str("x-pgoutbox-commit-lsn")
        );
    }
    let mut seen: BTreeMap<String, usize> = BTreeMap::new();
    for m in &got {
        *seen
            .entry(m.message_id.clone().unwrap_or_default())
            .or_default() += 1;
    }
    let audit: HashSet<String> = ob
        .sql("SELECT message_id FROM audit")
        .lines()
        .map(|l| l.trim().to_owned())
        .filter(|l| !l.is_empty())
        .collect();
    let lost: Vec<_> = audit
        .iter()
        .filter(|id| !seen.contains_key(*id))
        .take(10)
        .collect();
    let duplicates: Vec<_> = seen.iter().filter(|(_, n)| **n > 1).take(10).collect();
    let invented = seen.keys().filter(|id| !audit.contains(*id)).count();
    let inversions = order_inversions(&got);
    let skipped: usize = logs
        .lines()
        .filter_map(|l| l.split("skipped=").nth(1))
        .filter_map(|r| r.split_whitespace().next()?.parse::<usize>().ok())
        .sum();
    eprintln!(
        "stream kills: {total} committed, {} in the stream, {kills} kills of the holder (a standby took over each), 1 RabbitMQ restart, {} lost, {} duplicates, {invented} invented, {inversions} order inversions, {skipped} skipped at start",
        got.len(),
        lost.len(),
        duplicates.len()
    );
    assert!(lost.is_empty(), "lost: {lost:?}");
    assert!(
        duplicates.is_empty(),
        "duplicates in the stream: {duplicates:?}"
    );
    assert_eq!(invented, 0);
    assert_eq!(inversions, 0, "order inversions");
    assert_eq!(got.len(), total);
}

/// `pgoutbox ARGS` against `ob`'s database and slot, to completion: (exit code, stderr and
/// stdout together).
fn pgoutbox(ob: &Outbox<'_>, args: &[&str]) -> (Option<i32>, String) {
    let mut full: Vec<String> = args.iter().map(|s| s.to_string()).collect();
    full.extend([
        "--database-url".into(),
        ob.streamer_url(),
        "--slot".into(),
        ob.slot.clone(),
        "--publication".into(),
        ob.publication.clone(),
    ]);
    let out = support::cli::command()
        .args(&full)
        .env("PGOUTBOX_HTTP_ADDR", "off")
        .output()
        .expect("run pgoutbox");
    (
        out.status.code(),
        format!(
            "{}{}",
            String::from_utf8_lossy(&out.stderr),
            String::from_utf8_lossy(&out.stdout)
        ),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_login_vhost_or_port_is_named_with_its_fix_and_no_secret() {
    let pg = Postgres::shared();
    let rmq = RabbitMq::shared();
    let ob = Outbox::new_without_queue(pg, &rmq.url(), "stream_refusals").await;
    let port = rmq.stream_port();
    let secret = "Marker-Secret-81";
    let cases = [
        (
            format!("rabbitmq-stream://guest:{secret}@127.0.0.1:{port}/%2f"),
            "refused the login with authentication failure (0x08); check the user and password in --stream-url",
        ),
        (
            format!("rabbitmq-stream://guest:guest@127.0.0.1:{port}/no_such_vhost"),
            "refused the virtual host with virtual host access failure (0x0c); the vhost \"no_such_vhost\" is missing",
        ),
    ];
    for (url, expect) in &cases {
        // run stops at once (definite), check reports it: both name the fix.
        let (code, out) = pgoutbox(&ob, &["run", "--stream-url", url, "--stream", "s_refused"]);
        assert_eq!(code, Some(1), "run: {out}");
        assert!(out.contains(expect), "run: {out}");
        assert!(!out.contains(secret), "run printed the password: {out}");
        let (code, out) = pgoutbox(
            &ob,
            &["check", "--stream-url", url, "--stream", "s_refused"],
        );
        assert_eq!(code, Some(1), "check: {out}");
        assert!(out.contains(expect), "check: {out}");
        assert!(!out.contains(secret), "check printed the password: {out}");
    }
    // The AMQP port instead of the stream port.
    let amqp_port = format!("rabbitmq-stream://guest:guest@127.0.0.1:{}/%2f", rmq.port());
    let (code, out) = pgoutbox(
        &ob,
        &["check", "--stream-url", &amqp_port, "--stream", "s_refused"],
    );
    assert_eq!(code, Some(1), "{out}");
    assert!(
        out.contains("this is RabbitMQ's AMQP port, not its stream port"),
        "{out}"
    );
    // Both kinds of broker URL: refused before anything connects, naming both flags.
    let (code, out) = pgoutbox(
        &ob,
        &[
            "run",
            "--stream-url",
            &cases[0].0,
            "--stream",
            "s",
            "--amqp-url",
            &rmq.url(),
        ],
    );
    assert_eq!(code, Some(2), "{out}");
    assert!(
        out.contains("--stream-url/--stream replace --amqp-url/--exchange"),
        "{out}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn check_reports_the_stream_and_its_stored_sequence_and_no_declare_waits_for_it() {
    let pg = Postgres::shared();
    let rmq = RabbitMq::shared();
    let ob = Outbox::new_without_queue(pg, &rmq.url(), "stream_check").await;
    let stream = support::unique("stream_check");
    let url = rmq.stream_url();
    let (code, out) = pgoutbox(
        &ob,
        &[
            "check",
            "--stream-url",
            &url,
            "--stream",
            &stream,
            "--no-declare",
        ],
    );
    assert_eq!(code, Some(1), "{out}");
    assert!(
        out.contains(&format!(
            "stream \"{stream}\" does not exist and run has --no-declare"
        )),
        "{out}"
    );

    // --no-declare: run waits for the stream, then streams into it.
    let streamer = run_stream(&ob, rmq, &stream, "check-a", &["--no-declare"]);
    ob.emit("t.check", "c-1");
    assert!(
        streamer
            .wait_for_log(
                "does not exist on RabbitMQ",
                scaled(Duration::from_secs(60))
            )
            .await,
        "{}",
        streamer.log()
    );
    support::declare_stream(&rmq.url(), &stream, &[]).await;
    let last = ob.emit("t.check", "c-2");
    assert!(
        ob.flushed_past(last, scaled(Duration::from_secs(90))).await,
        "{}",
        streamer.log()
    );
    streamer.stop_ok(scaled(Duration::from_secs(30))).await;
    let got = read_all(rmq, &stream, scaled(Duration::from_secs(5))).await;
    assert_eq!(got.len(), 2, "{got:#?}");
    let stored_id = {
        // The last message's publishing id, as the design note defines it.
        let commit = lsn(got[1].app_str("x-pgoutbox-commit-lsn").expect("commit LSN"));
        (commit >> 3) << 16
    };
    let (code, out) = pgoutbox(&ob, &["check", "--stream-url", &url, "--stream", &stream]);
    assert_eq!(code, Some(0), "{out}");
    assert!(
        out.contains(&format!("stored publishing id {stored_id} ")),
        "check does not show the stored id {stored_id}: {out}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deleted_stream_ends_the_session_and_run_goes_on_into_the_new_one() {
    let pg = Postgres::shared();
    let rmq = RabbitMq::shared();
    let ob = Outbox::new_without_queue(pg, &rmq.url(), "stream_deleted").await;
    let stream = support::unique("stream_deleted");
    let streamer = run_stream(&ob, rmq, &stream, "del-a", &[]);
    let first = ob.emit("t.del", "d-1");
    assert!(
        ob.flushed_past(first, scaled(Duration::from_secs(60)))
            .await,
        "{}",
        streamer.log()
    );
    // The broker tells its publishers (MetadataUpdate) and drops them.
    rmq.ctl_ok(&["delete_queue", &stream]);
    assert!(
        streamer
            .wait_for_log(
                "changed (stream not available)",
                scaled(Duration::from_secs(60))
            )
            .await,
        "no MetadataUpdate handled:\n{}",
        streamer.log()
    );
    let last = ob.emit("t.del", "d-2");
    assert!(
        ob.flushed_past(last, scaled(Duration::from_secs(90))).await,
        "{}",
        streamer.log()
    );
    streamer.stop_ok(scaled(Duration::from_secs(30))).await;
    // The new stream (created again) holds what came after the deletion, once.
    let got = read_all(rmq, &stream, scaled(Duration::from_secs(5))).await;
    let ids: Vec<_> = got
        .iter()
        .map(|m| m.message_id.clone().unwrap_or_default())
        .collect();
    assert_eq!(ids, ["d-2"], "{}", streamer.log());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cloudevents_attributes_are_application_properties_in_the_stream() {
    let pg = Postgres::shared();
    let rmq = RabbitMq::shared();
    let ob = Outbox::new_without_queue(pg, &rmq.url(), "stream_ce").await;
    let stream = support::unique("stream_ce");
    let streamer = run_stream(&ob, rmq, &stream, "ce-a", &["--cloudevents"]);
    ob.sql("SELECT outbox.emit('orders.created', '{\"n\": 1}', '{}', 'ce-1', aggregate_id => 'order-42')");
    ob.sql("SELECT outbox.emit_bytes('files.stored', '\\x00ff'::bytea, 'application/x-thing')");
    assert!(
        ob.settled_through_now(scaled(Duration::from_secs(60)))
            .await,
        "{}",
        streamer.log()
    );
    streamer.stop_ok(scaled(Duration::from_secs(30))).await;
    let got = read_all(rmq, &stream, scaled(Duration::from_secs(5))).await;
    assert_eq!(got.len(), 2, "{got:#?}");
    let source = format!("pgoutbox:///{}/{}", ob.db, ob.slot);
    let m = &got[0];
    assert_eq!(m.app_str("cloudEvents_specversion"), Some("1.0"), "{m:#?}");
    assert_eq!(m.app_str("cloudEvents_id"), Some("ce-1"));
    assert_eq!(m.app_str("cloudEvents_type"), Some("orders.created"));
    assert_eq!(m.app_str("cloudEvents_source"), Some(source.as_str()));
    assert_eq!(m.app_str("cloudEvents_subject"), Some("order-42"));
    assert!(m.app_str("cloudEvents_time").is_some());
    // Binary payloads stay byte-exact, with their content type.
    assert_eq!(got[1].body, b"\x00\xff");
    assert_eq!(got[1].content_type.as_deref(), Some("application/x-thing"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streams_over_tls_verify_the_broker_and_refuse_an_unknown_ca() {
    let pg = Postgres::shared();
    let tls = support::TlsRabbit::shared();
    let ob = Outbox::new_without_queue(pg, &tls.rabbit.url(), "stream_tls").await;
    let stream = support::unique("stream_tls");
    // Without the test CA, the system store does not know the broker's certificate.
    let (code, out) = pgoutbox(
        &ob,
        &[
            "check",
            "--stream-url",
            &tls.stream_tls_url(""),
            "--stream",
            &stream,
        ],
    );
    assert_eq!(code, Some(1), "{out}");
    assert!(out.contains("certificate"), "{out}");
    let url = tls.stream_tls_url(&tls.cacertfile());
    let streamer = run_stream_at(&ob, std::slice::from_ref(&url), &stream, &[]);
    let last = ob.emit("t.tls", "tls-1");
    assert!(
        ob.flushed_past(last, scaled(Duration::from_secs(60))).await,
        "{}",
        streamer.log()
    );
    streamer.stop_ok(scaled(Duration::from_secs(30))).await;
    let got = tokio::task::spawn_blocking(move || {
        support::read_stream_url(&url, &stream, 1, scaled(Duration::from_secs(30)))
    })
    .await
    .unwrap();
    assert_eq!(got.len(), 1, "{got:?}");
    assert_eq!(got[0].message_id.as_deref(), Some("tls-1"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_node_that_stops_under_the_publisher_loses_and_duplicates_nothing() {
    let target = support::scaled_count(3_000);
    let pg = Postgres::shared();
    // Stopped when the test ends (Drop), whatever its outcome.
    let cluster = Arc::new(support::cluster::RabbitCluster::start(3));
    let ob = Outbox::new_without_queue(pg, &cluster.nodes[0].url(), "stream_cluster").await;
    ob.sql("CREATE TABLE audit (message_id text PRIMARY KEY)");
    let stream = support::unique("stream_cluster");
    let streamer = run_stream_at(&ob, &cluster.stream_urls(), &stream, &[]);
    let committed = Arc::new(AtomicUsize::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let producers: Vec<_> = (0..2)
        .map(|p| {
            tokio::spawn(producer(
                ob.url(),
                p,
                target,
                committed.clone(),
                stop.clone(),
            ))
        })
        .collect();
    let reach = |n: usize| {
        let committed = committed.clone();
        async move {
            support::wait_until(scaled(Duration::from_secs(120)), || {
                let c = committed.load(Ordering::SeqCst);
                async move { c >= n }
            })
            .await
        }
    };
    assert!(reach(target / 3).await, "producers stalled");
    // The node run is connected to (the first URL) goes away under it.
    eprintln!(
        "stream cluster: stopping node 1 at {}",
        committed.load(Ordering::SeqCst)
    );
    let c = cluster.clone();
    tokio::task::spawn_blocking(move || c.nodes[0].stop_app())
        .await
        .unwrap();
    assert!(reach(2 * target / 3).await, "producers stalled");
    let c = cluster.clone();
    tokio::task::spawn_blocking(move || c.nodes[0].start_app())
        .await
        .unwrap();
    for p in producers {
        p.await.expect("producer");
    }
    stop.store(true, Ordering::SeqCst);
    assert!(
        ob.settled_through_now(scaled(Duration::from_secs(180)))
            .await,
        "the slot never passed the last commit:\n{}",
        streamer.log()
    );
    streamer.stop_ok(scaled(Duration::from_secs(30))).await;
    let log = streamer.log();
    let reconnected = log.matches("connected to the RabbitMQ stream").count();
    let url = cluster.stream_urls()[1].clone();
    let read_from = stream.clone();
    let got = tokio::task::spawn_blocking(move || {
        support::read_stream_url(
            &url,
            &read_from,
            usize::MAX,
            scaled(Duration::from_secs(10)),
        )
    })
    .await
    .unwrap();
    let audit: HashSet<String> = ob
        .sql("SELECT message_id FROM audit")
        .lines()
        .map(|l| l.trim().to_owned())
        .filter(|l| !l.is_empty())
        .collect();
    let mut seen: BTreeMap<String, usize> = BTreeMap::new();
    for m in &got {
        *seen
            .entry(m.message_id.clone().unwrap_or_default())
            .or_default() += 1;
    }
    let lost = audit.iter().filter(|id| !seen.contains_key(*id)).count();
    let duplicates = seen.values().filter(|n| **n > 1).count();
    let inversions = order_inversions(&got);
    eprintln!(
        "stream cluster: {} committed, {} in the stream, {reconnected} connects, {lost} lost, {duplicates} duplicates, {inversions} inversions",
        audit.len(),
        got.len()
    );
    assert!(reconnected >= 2, "run never reconnected:\n{log}");
    assert_eq!((lost, duplicates, inversions), (0, 0, 0), "{log}");
    assert_eq!(got.len(), audit.len());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_ahead_of_the_wal_is_a_gap_and_accept_gap_starts_a_new_producer_name() {
    let pg = Postgres::shared();
    let rmq = RabbitMq::shared();
    let ob = Outbox::new_without_queue(pg, &rmq.url(), "stream_ahead").await;
    let stream = support::unique("stream_ahead");
    support::declare_stream(&rmq.url(), &stream, &[]).await;
    // The stream holds an id of our producer name from a commit far beyond this server's
    // WAL: what a stream written before a restore to an earlier point looks like.
    let producer = format!("pgoutbox-{}", ob.slot);
    let beyond: u64 = (0x7_0000_0000_0000u64 >> 3) << 16;
    let url = rmq.stream_url();
    let (s, p) = (stream.clone(), producer.clone());
    tokio::task::spawn_blocking(move || {
        let m = support::StreamPublish {
            body: b"from another history".to_vec(),
            message_id: Some("old".into()),
            publishing_id: Some(beyond),
            ..Default::default()
        };
        support::publish_stream(&url, &s, Some(&p), &[m])
    })
    .await
    .unwrap();
    let last = ob.emit("t.ahead", "a-1");

    let refused = run_stream(&ob, rmq, &stream, "ahead-a", &[]);
    let exit = refused.wait_exit(scaled(Duration::from_secs(60))).await;
    let log = refused.log();
    assert_eq!(exit.and_then(|s| s.code()), Some(1), "{log}");
    assert!(
        log.contains(&format!(
            "holds messages of producer \"{producer}\" from commits up to 70000/0"
        )) && log.contains("--accept-gap starts a new producer name"),
        "{log}"
    );
    assert!(
        ob.not_acknowledged(last),
        "the refusal acknowledged something"
    );

    let accepted = run_stream(&ob, rmq, &stream, "ahead-b", &["--accept-gap"]);
    assert!(
        ob.flushed_past(last, scaled(Duration::from_secs(60))).await,
        "{}",
        accepted.log()
    );
    accepted.stop_ok(scaled(Duration::from_secs(30))).await;
    let log = accepted.log();
    assert!(log.contains(&format!("producer={producer}-g1")), "{log}");
    let got = read_all(rmq, &stream, scaled(Duration::from_secs(5))).await;
    let ids: Vec<_> = got
        .iter()
        .map(|m| m.message_id.clone().unwrap_or_default())
        .collect();
    assert_eq!(ids, ["old", "a-1"], "{log}");
    let recorded = ob.sql(&format!(
        "SELECT accepted_gaps::text FROM outbox.stream_state WHERE slot_name = '{}'",
        ob.slot
    ));
    assert!(recorded.contains("stream_ahead_of_wal"), "{recorded}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_node_is_left_after_two_heartbeats_and_nothing_is_lost() {
    let pg = Postgres::shared();
    let rmq = RabbitMq::shared();
    let ob = Outbox::new_without_queue(pg, &rmq.url(), "stream_heartbeat").await;
    let stream = support::unique("stream_heartbeat");
    let proxy = support::Proxy::start(rmq.stream_port());
    let url = format!(
        "rabbitmq-stream://guest:guest@127.0.0.1:{}/%2f?heartbeat=2",
        proxy.port()
    );
    let streamer = run_stream_at(&ob, &[url], &stream, &[]);
    let first = ob.emit("t.hb", "h-1");
    assert!(
        ob.flushed_past(first, scaled(Duration::from_secs(60)))
            .await,
        "{}",
        streamer.log()
    );
    // The node goes silent (a black hole): no frame, no heartbeat.
    proxy.stall();
    let second = ob.emit("t.hb", "h-2");
    assert!(
        streamer
            .wait_for_log(
                "no frame and no heartbeat from the RabbitMQ stream node",
                scaled(Duration::from_secs(60))
            )
            .await,
        "{}",
        streamer.log()
    );
    proxy.pass();
    assert!(
        ob.flushed_past(second, scaled(Duration::from_secs(90)))
            .await,
        "{}",
        streamer.log()
    );
    streamer.stop_ok(scaled(Duration::from_secs(30))).await;
    let got = read_all(rmq, &stream, scaled(Duration::from_secs(5))).await;
    let ids: Vec<_> = got
        .iter()
        .map(|m| m.message_id.clone().unwrap_or_default())
        .collect();
    assert_eq!(ids, ["h-1", "h-2"], "{}", streamer.log());
}
