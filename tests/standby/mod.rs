//! Standby replicas: several `run` processes on one slot, exactly one streams; SIGKILL of
//! the active one hands the slot to a standby within about one `--standby-poll-ms`, and
//! nothing is lost or invented.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::support::{self, lsn, scaled, scaled_count, Outbox, Postgres, RabbitMq, Streamer};

/// Emits one message per transaction, `<prefix>-<n>`, about every `pause`, until stopped;
/// returns the ids committed.
fn producer(
    url: String,
    prefix: &'static str,
    pause: Duration,
    stop: Arc<AtomicBool>,
) -> tokio::task::JoinHandle<Vec<String>> {
    tokio::spawn(async move {
        let client = Postgres::client_url(&url).await.expect("producer connects");
        let mut committed = Vec::new();
        let mut n = 0i64;
        while !stop.load(Ordering::SeqCst) {
            n += 1;
            let id = format!("{prefix}-{n}");
            client
                .execute(
                    "SELECT outbox.emit('standby', jsonb_build_object('n', $1::bigint), '{}', $2)",
                    &[&n, &id],
                )
                .await
                .expect("emit (Postgres stays up in this test)");
            committed.push(id);
            tokio::time::sleep(pause).await;
        }
        committed
    })
}

/// One sample of the walsenders of this test's streamers.
#[derive(Debug, Clone)]
struct Sample {
    /// (pid, application_name, state) of each walsender whose state is not `startup`
    /// (a standby's try that got 55006 stays in `startup` until it disconnects).
    streaming: Vec<(i32, String, String)>,
}

/// Samples `pg_stat_replication` every 10 ms until `stop`, keeping every sample with more
/// than one streaming walsender and counting all samples.
fn sampler(
    pg: &'static Postgres,
    db: String,
    prefix: String,
    stop: Arc<AtomicBool>,
    taken: Arc<AtomicUsize>,
    overlaps: Arc<Mutex<Vec<Sample>>>,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let client = pg.client(&db).await;
        while !stop.load(Ordering::SeqCst) {
            let rows = client
                .query(
                    "SELECT pid, application_name::text, state FROM pg_stat_replication
                     WHERE application_name LIKE $1 AND state <> 'startup'",
                    &[&format!("{prefix}%")],
                )
                .await
                .expect("sample pg_stat_replication");
            let sample = Sample {
                streaming: rows
                    .iter()
                    .map(|r| (r.get(0), r.get(1), r.get(2)))
                    .collect(),
            };
            taken.fetch_add(1, Ordering::SeqCst);
            if sample.streaming.len() > 1 {
                overlaps.lock().unwrap().push(sample);
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
}

/// The `application_name` of the walsender holding `slot`, if any.
async fn holder(client: &tokio_postgres::Client, slot: &str) -> Option<String> {
    client
        .query_opt(
            "SELECT r.application_name::text FROM pg_replication_slots s
             JOIN pg_stat_replication r ON r.pid = s.active_pid
             WHERE s.slot_name = $1 AND r.state <> 'startup'",
            &[&slot],
        )
        .await
        .expect("read the holder")
        .map(|r| r.get(0))
}

/// Polls (every 10 ms, up to `timeout`) until a walsender other than `not` streams from
/// `slot`; returns its `application_name`.
async fn wait_for_holder(
    client: &tokio_postgres::Client,
    slot: &str,
    not: Option<&str>,
    timeout: Duration,
) -> Option<String> {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(h) = holder(client, slot).await {
            if Some(h.as_str()) != not {
                return Some(h);
            }
        }
        if Instant::now() >= deadline {
            return None;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Every `start_lsn=X/Y` of a session start (`streaming` line) in a streamer's log.
fn session_starts(log: &str) -> Vec<u64> {
    log.lines()
        .filter(|l| l.contains(": streaming "))
        .filter_map(|l| l.split("start_lsn=").nth(1))
        .filter_map(|rest| rest.split_whitespace().next())
        .map(lsn)
        .collect()
}

fn median(sorted: &[Duration]) -> Duration {
    sorted[sorted.len() / 2]
}

/// Three `run` processes on one slot while a producer writes; the active one is SIGKILLed
/// at least five times (a replacement is started each time, so three are always present).
/// At every sample at most one walsender streams; a standby takes over each time; the
/// queue's audit shows nothing lost, nothing invented, and every duplicate is a message a
/// later session started at or below (a redelivery of what the slot had not been told).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_replicas_survive_repeated_sigkill_of_the_active_one() {
    let pg = Postgres::shared();
    let rmq = RabbitMq::shared();
    let ob = Outbox::new(pg, &rmq.url(), "standby_three").await;
    let prefix = support::unique("sb");
    let app_prefix = format!("pgoutbox-{prefix}");
    let start_slot = ob.confirmed_flush();
    let mut next_id = 0usize;
    let mut spawn = |streamers: &mut HashMap<String, Streamer>| {
        next_id += 1;
        let id = format!("{prefix}-{next_id}");
        let s = ob.run(&["--instance-id", &id, "--standby-poll-ms", "1000"]);
        streamers.insert(format!("pgoutbox-{id}"), s);
    };
    let mut streamers: HashMap<String, Streamer> = HashMap::new();
    for _ in 0..3 {
        spawn(&mut streamers);
    }

    let stop_sampler = Arc::new(AtomicBool::new(false));
    let taken = Arc::new(AtomicUsize::new(0));
    let overlaps = Arc::new(Mutex::new(Vec::new()));
    let sampling = sampler(
        pg,
        ob.db.clone(),
        app_prefix.clone(),
        stop_sampler.clone(),
        taken.clone(),
        overlaps.clone(),
    );
    let stop = Arc::new(AtomicBool::new(false));
    let produced = producer(ob.url(), "sb", Duration::from_millis(4), stop.clone());

    let client = pg.client(&ob.db).await;
    let rounds = scaled_count(5).max(5);
    let mut takeovers = Vec::new();
    let mut dead: Vec<Streamer> = Vec::new();
    let mut current =
        wait_for_holder(&client, &ob.slot, None, scaled(Duration::from_secs(30))).await;
    assert!(current.is_some(), "one of three takes the slot");
    for round in 1..=rounds {
        let active = current.clone().expect("a holder");
        // Kill with messages in flight: the holder has published for a while.
        let at = support::queue_len(&ob.amqp_url, &ob.queue).await;
        assert!(
            support::wait_until(scaled(Duration::from_secs(20)), || async {
                support::queue_len(&ob.amqp_url, &ob.queue).await >= at + 100
            })
            .await,
            "round {round}: {active} publishes\n{}",
            streamers[&active].log()
        );
        let victim = streamers.remove(&active).expect("the holder is ours");
        let killed_at = Instant::now();
        victim.kill9();
        dead.push(victim);
        // A replacement, so three are present again.
        spawn(&mut streamers);
        let new_holder = wait_for_holder(
            &client,
            &ob.slot,
            Some(&active),
            scaled(Duration::from_secs(20)),
        )
        .await;
        let took = killed_at.elapsed();
        let took_over = new_holder.is_some();
        let logs: String = streamers.values().map(|s| s.log()).collect();
        assert!(
            took_over,
            "round {round}: no standby took over from {active}\n{logs}"
        );
        let next = new_holder.unwrap();
        assert!(
            streamers.contains_key(&next),
            "round {round}: the new holder {next} is one of ours"
        );
        takeovers.push(took);
        current = Some(next);
    }
    // Let the last holder publish, then stop producing and drain everything.
    tokio::time::sleep(Duration::from_millis(300)).await;
    stop.store(true, Ordering::SeqCst);
    let committed = produced.await.unwrap();
    let got = ob
        .drain(committed.len(), scaled(Duration::from_secs(10)))
        .await;
    stop_sampler.store(true, Ordering::SeqCst);
    sampling.await.unwrap();

    // At most one walsender streamed at every sampled moment.
    let overlaps = overlaps.lock().unwrap().clone();
    assert!(
        overlaps.is_empty(),
        "two walsenders streamed at once: {overlaps:?}"
    );
    let samples = taken.load(Ordering::SeqCst);
    assert!(samples > 100, "the sampler ran ({samples} samples)");

    // The audit: nothing lost, nothing invented, duplicates only redeliveries.
    let committed_set: HashSet<&String> = committed.iter().collect();
    let mut copies: HashMap<String, (usize, u64)> = HashMap::new();
    for m in &got {
        let id = m.message_id.clone().expect("message_id");
        let l = lsn(&m.headers["x-pgoutbox-lsn"]);
        let e = copies.entry(id).or_insert((0, l));
        e.0 += 1;
    }
    let lost: Vec<&&String> = committed_set
        .iter()
        .filter(|id| !copies.contains_key(id.as_str()))
        .collect();
    let invented: Vec<&String> = copies
        .keys()
        .filter(|id| !committed_set.contains(id))
        .collect();
    let all_logs: String = dead
        .iter()
        .chain(streamers.values())
        .map(|s| s.log())
        .collect();
    assert!(
        lost.is_empty(),
        "lost {} of {}: {:?}",
        lost.len(),
        committed.len(),
        &lost[..lost.len().min(10)]
    );
    assert!(invented.is_empty(), "invented: {invented:?}");
    // Each copy beyond the first needs a later session that started at or below the
    // message (it was not yet acknowledged to Postgres when its publisher died).
    let mut starts: Vec<u64> = dead
        .iter()
        .chain(streamers.values())
        .flat_map(|s| session_starts(&s.log()))
        .collect();
    starts.sort_unstable();
    assert!(
        starts.len() > rounds,
        "one session start per holder: {starts:?}"
    );
    let takeover_starts = &starts[1..];
    let mut duplicates = 0;
    for (id, (n, l)) in &copies {
        if *n > 1 {
            duplicates += n - 1;
            let sessions_at_or_below = takeover_starts.iter().filter(|s| **s <= *l).count();
            assert!(
                n - 1 <= sessions_at_or_below,
                "{id} (LSN {l:X}) arrived {n} times, but only {sessions_at_or_below} sessions started at or below it: a message acknowledged to Postgres was sent again"
            );
        }
    }
    assert!(
        duplicates > 0,
        "SIGKILL with messages in flight causes redelivery"
    );
    let end_slot = ob.confirmed_flush();
    assert!(end_slot > start_slot, "the slot advanced");
    let metrics_holder = current.clone().unwrap();
    assert!(
        streamers[&metrics_holder].log().contains("role: active"),
        "the holder logs its role"
    );
    let standbys_logged = streamers
        .iter()
        .filter(|(name, _)| **name != metrics_holder)
        .all(|(_, s)| s.log().contains("role: standby"));
    assert!(standbys_logged, "{all_logs}");

    // `status` names the holder and lists the two standbys (the last replacement may still
    // be connecting: wait for it, bounded).
    let mut expected: Vec<String> = streamers
        .keys()
        .filter(|n| **n != metrics_holder)
        .cloned()
        .collect();
    expected.sort();
    let mut report = serde_json::Value::Null;
    let listed_both = support::wait_until(scaled(Duration::from_secs(10)), || {
        let out = ob.cli(&["status", "--json", "--publication", &ob.publication]);
        report = serde_json::from_slice(&out.stdout).expect("status --json prints JSON");
        let mut listed: Vec<String> = report["standbys"]
            .as_array()
            .expect("standbys")
            .iter()
            .map(|v| v.as_str().unwrap_or_default().to_owned())
            .collect();
        listed.sort();
        let ok = listed == expected && report["holder"] == metrics_holder.as_str();
        async move { ok }
    })
    .await;
    assert!(
        listed_both,
        "status: {report}, expected standbys {expected:?}"
    );

    let mut sorted = takeovers.clone();
    sorted.sort();
    eprintln!(
        "standby: {rounds} SIGKILLs, takeover min {:?} median {:?} max {:?} (kill to the new walsender streaming); {} committed, {} delivered, {duplicates} duplicates, {samples} samples of pg_stat_replication",
        sorted[0],
        median(&sorted),
        sorted[sorted.len() - 1],
        committed.len(),
        got.len()
    );
    // Within about one poll (1 s) plus the session's own start (connect, pre-flight
    // checks are done already: only START_REPLICATION), with room for a loaded machine.
    assert!(
        median(&sorted) < scaled(Duration::from_secs(3)),
        "takeover median {:?}",
        median(&sorted)
    );
}

/// `setup` makes the slot a failover slot where the server has them (PostgreSQL 17+, the
/// default), alters an existing ordinary slot while no streamer holds it, and leaves a held one
/// as it is with a warning (`--failover` then refuses); on 14 to 16 it makes an ordinary slot
/// and `--failover` says plainly that the server cannot. Run on each version by
/// `PGOUTBOX_TEST_PG` (deploy/test-compat.sh).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn setup_makes_a_failover_slot_where_the_server_has_them() {
    let pg = Postgres::shared();
    let ob = Outbox::new(pg, &RabbitMq::shared().url(), "standby_failover").await;
    let version: i32 = ob
        .sql("SELECT current_setting('server_version_num')")
        .trim()
        .parse()
        .expect("server_version_num");
    let failover_flag = || {
        ob.sql(&format!(
            "SELECT failover FROM pg_replication_slots WHERE slot_name = '{}'",
            ob.slot
        ))
        .trim()
        .to_owned()
    };
    if version < 170_000 {
        // The default setup (Outbox::new) made an ordinary slot; --failover is refused.
        let out = ob.cli(&["setup", "--publication", &ob.publication, "--failover"]);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{stderr}");
        assert!(
            stderr.contains("cannot create failover slots")
                && stderr.contains("PostgreSQL 17 or newer")
                && stderr.contains("Patroni"),
            "{stderr}"
        );
        return;
    }
    // Created by the default setup of Outbox::new.
    assert_eq!(failover_flag(), "t", "setup's new slot on {version}");

    // An ordinary slot (made by hand, or by an older pgoutbox) is altered by setup.
    ob.sql(&format!(
        "SELECT pg_drop_replication_slot('{s}'); \
         SELECT pg_create_logical_replication_slot('{s}', 'pgoutput')",
        s = ob.slot
    ));
    assert_eq!(failover_flag(), "f");
    let out = ob.cli(&["setup", "--publication", &ob.publication]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("is now a failover slot"), "{stdout}");
    assert_eq!(failover_flag(), "t", "setup altered the existing slot");

    // --failover=false leaves an existing failover slot as it is, and makes a new slot an
    // ordinary one.
    ob.sql(&format!(
        "SELECT pg_drop_replication_slot('{s}')",
        s = ob.slot
    ));
    let out = ob.cli(&[
        "setup",
        "--publication",
        &ob.publication,
        "--failover=false",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(failover_flag(), "f", "--failover=false");

    // A slot a streamer holds cannot be altered: the default says so and goes on, --failover
    // refuses.
    let run = ob.run(&[]);
    ob.assert_streams_as_streamer(scaled(Duration::from_secs(60)), "run holds the slot")
        .await;
    let out = ob.cli(&["setup", "--publication", &ob.publication]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(
        stderr.contains("is not a failover slot") && stderr.contains("stop the streamer"),
        "{stderr}"
    );
    let out = ob.cli(&["setup", "--publication", &ob.publication, "--failover"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(stderr.contains("ALTER_REPLICATION_SLOT"), "{stderr}");
    assert_eq!(failover_flag(), "f");
    run.stop_ok(scaled(Duration::from_secs(30))).await;
    // Once it is free, setup makes it one.
    let out = ob.cli(&["setup", "--publication", &ob.publication, "--failover"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(failover_flag(), "t", "setup --failover on the freed slot");
}

/// `host=a,b` with `target_session_attrs=read-write` (the multi-host URL that follows a
/// failover): the first host is a read-only server with the same database and role, the
/// second the primary. Both connections, the SQL one and our replication client, must skip
/// the first and stream from the second; the skip is logged.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_multi_host_url_skips_a_read_only_server_on_both_connections() {
    let pg = Postgres::shared();
    let rabbit = RabbitMq::shared();
    let ob = Outbox::new(pg, &rabbit.url(), "multihost").await;
    // A server that answers, authenticates the streamer role and has the database, but
    // is read-only, as a hot standby is.
    let ro = Postgres::start_private(&[]);
    ro.psql("postgres", &format!("CREATE DATABASE {}", ob.db));
    ro.psql(
        "postgres",
        "CREATE ROLE pgoutbox_streamer LOGIN REPLICATION",
    );
    ro.psql(
        "postgres",
        "ALTER SYSTEM SET default_transaction_read_only = on",
    );
    ro.psql("postgres", "SELECT pg_reload_conf()");
    assert!(
        support::wait_until(scaled(Duration::from_secs(10)), || async {
            ro.psql(&ob.db, "SHOW transaction_read_only").trim() == "on"
        })
        .await,
        "the private server became read-only"
    );
    let url = format!(
        "postgres://pgoutbox_streamer@127.0.0.1:{},127.0.0.1:{}/{}?target_session_attrs=read-write",
        ro.port(),
        pg.port(),
        ob.db
    );
    let streamer = ob.run_with_url(&url, &[]);
    assert!(
        streamer
            .wait_for_log(": streaming slot=", scaled(Duration::from_secs(30)))
            .await,
        "{}",
        streamer.log()
    );
    let n = 20;
    for i in 0..n {
        ob.sql(&format!(
            "SELECT outbox.emit('multihost', '{{\"i\": {i}}}', '{{}}', 'mh-{i}')"
        ));
    }
    let got = ob.drain(n, scaled(Duration::from_secs(30))).await;
    let ids: HashSet<String> = got.iter().filter_map(|m| m.message_id.clone()).collect();
    let want: HashSet<String> = (0..n).map(|i| format!("mh-{i}")).collect();
    assert_eq!(ids, want, "{}", streamer.log());
    // The replication connection skipped the read-only host, naming it and why.
    let log = streamer.log();
    assert!(
        log.contains("PostgreSQL host skipped")
            && log.contains(&format!("127.0.0.1:{}", ro.port()))
            && log.contains("transaction_read_only = on"),
        "{log}"
    );
    // The walsender is on the primary; the read-only server has none.
    let walsenders = ob.sql(&format!(
        "SELECT count(*) FROM pg_replication_slots WHERE slot_name = '{}' AND active",
        ob.slot
    ));
    assert_eq!(walsenders.trim(), "1", "{log}");
    assert_eq!(
        ro.psql("postgres", "SELECT count(*) FROM pg_stat_replication")
            .trim(),
        "0"
    );
    streamer.stop(scaled(Duration::from_secs(30))).await;
}

/// Issue 32, item 4: the fix of c32fb94, deterministically. A standby that takes over the
/// slot takes the standby tag off its SQL session, so `status` names it as the holder and
/// lists no standby (before the fix it listed the new holder among its own standbys: found
/// once, by chance, in the three-replica test). Two streamers, the holder killed once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_standby_that_takes_over_is_no_longer_listed_as_a_standby() {
    let pg = Postgres::shared();
    let ob = Outbox::new(pg, &RabbitMq::shared().url(), "standby_leave").await;
    let prefix = support::unique("sl");
    let (a, b) = (format!("{prefix}-a"), format!("{prefix}-b"));
    let first = ob.run(&["--instance-id", &a, "--standby-poll-ms", "200"]);
    let client = pg.client(&ob.db).await;
    let holder_a = wait_for_holder(&client, &ob.slot, None, scaled(Duration::from_secs(30))).await;
    assert_eq!(
        holder_a.as_deref(),
        Some(format!("pgoutbox-{a}").as_str()),
        "{}",
        first.log()
    );
    let second = ob.run(&["--instance-id", &b, "--standby-poll-ms", "200"]);
    let status = || {
        let out = ob.cli(&["status", "--json", "--publication", &ob.publication]);
        serde_json::from_slice::<serde_json::Value>(&out.stdout).expect("status --json")
    };
    let b_name = format!("pgoutbox-{b}");
    let listed = support::wait_until(scaled(Duration::from_secs(30)), || {
        let ok = status()["standbys"]
            .as_array()
            .is_some_and(|s| s.iter().any(|v| v == b_name.as_str()));
        async move { ok }
    })
    .await;
    assert!(
        listed,
        "b is listed as a standby: {}\n{}",
        status(),
        second.log()
    );
    first.kill9();
    let holder_b = wait_for_holder(
        &client,
        &ob.slot,
        holder_a.as_deref(),
        scaled(Duration::from_secs(60)),
    )
    .await;
    assert_eq!(
        holder_b.as_deref(),
        Some(b_name.as_str()),
        "{}",
        second.log()
    );
    let mut report = serde_json::Value::Null;
    let settled = support::wait_until(scaled(Duration::from_secs(20)), || {
        report = status();
        let ok = report["holder"] == b_name.as_str()
            && report["standbys"].as_array().is_some_and(|s| s.is_empty());
        async move { ok }
    })
    .await;
    assert!(
        settled,
        "the new holder is no standby of its own: {report}\n{}",
        second.log()
    );
    second.stop_ok(scaled(Duration::from_secs(30))).await;
}
