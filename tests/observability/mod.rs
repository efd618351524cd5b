//! Issue 7, "Metrics and health": `/metrics`, `/healthz` and `/readyz` scraped over HTTP
//! from the real binary during a real stream, a blocked broker and a stopped broker.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use crate::support::{self, scaled, scaled_count, Outbox, Postgres, RabbitMq, Streamer};

/// One HTTP GET: (status code, body). `None` when nothing answers.
pub(crate) fn get(port: u16, path: &str) -> Option<(u16, String)> {
    let addr = std::net::SocketAddr::from(([127, 0, 0, 1], port));
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(2)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(10))).ok()?;
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n"
    )
    .ok()?;
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).ok()?;
    let text = String::from_utf8_lossy(&raw).into_owned();
    let status = text.split(' ').nth(1)?.parse().ok()?;
    let body = text
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_owned())
        .unwrap_or_default();
    Some((status, body))
}

/// The value of the sample `series` (a name, with its labels if any) in a scrape.
pub(crate) fn sample(scrape: &str, series: &str) -> Option<f64> {
    scrape.lines().find_map(|l| {
        let rest = l.strip_prefix(series)?;
        let value = rest.strip_prefix(' ')?;
        value.split(' ').next()?.parse().ok()
    })
}

pub(crate) fn scrape(port: u16) -> String {
    match get(port, "/metrics") {
        Some((200, body)) => body,
        other => panic!("scrape failed: {other:?}"),
    }
}

pub(crate) fn metric(port: u16, series: &str) -> f64 {
    let text = scrape(port);
    sample(&text, series).unwrap_or_else(|| panic!("{series} missing:\n{text}"))
}

/// The lines of a scrape that tell the stall story.
fn stall_lines(text: &str) -> String {
    text.lines()
        .filter(|l| {
            [
                "pgoutbox_oldest_unconfirmed_age_seconds ",
                "pgoutbox_unconfirmed_messages ",
                "pgoutbox_stalled ",
                "pgoutbox_broker_blocked ",
                "pgoutbox_replication_lag_bytes ",
                "pgoutbox_messages_confirmed_total ",
                "pgoutbox_since_status_update_seconds ",
            ]
            .iter()
            .any(|p| l.starts_with(p))
        })
        .collect::<Vec<_>>()
        .join("\n")
}

fn readyz(port: u16) -> Option<(u16, String)> {
    get(port, "/readyz")
}

fn assert_healthy(port: u16, streamer: &Streamer) {
    let h = get(port, "/healthz");
    assert!(
        matches!(&h, Some((200, _))),
        "/healthz: {h:?}\n{}",
        streamer.log()
    );
}

async fn wait_ready(port: u16, streamer: &Streamer, timeout: Duration) {
    let ok =
        support::wait_until(timeout, || async { matches!(readyz(port), Some((200, _))) }).await;
    assert!(
        ok,
        "/readyz never 200: {:?}\n{}",
        readyz(port),
        streamer.log()
    );
}

/// Published and confirmed counts equal N, the histogram counted N, lag falls near zero once
/// drained; while the broker is blocked (memory alarm) the oldest-unconfirmed age grows and
/// `/readyz` says `broker_blocked` (or `stalled`), `/healthz` stays 200; after the alarm
/// clears everything returns to 0 and 200.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_follow_a_stream_and_a_blocked_broker() {
    // Its own cluster: on the shared one, other tests' WAL legitimately keeps the reported
    // flush LSN up to stream_state::IDLE_RECORD_SLACK (64 KiB) behind the WAL end of an idle
    // slot, and the lag check below would measure them.
    let pg = Postgres::start_private(&[]);
    let rmq = RabbitMq::start_private();
    let ob = Outbox::new(&pg, &rmq.url(), "obs_stream").await;
    let port = support::free_port();
    let addr = format!("127.0.0.1:{port}");
    let streamer = ob.run(&["--http-addr", &addr, "--stall-after-s", "3"]);
    wait_ready(port, &streamer, scaled(Duration::from_secs(30))).await;
    assert_healthy(port, &streamer);

    let n = scaled_count(2000);
    ob.sql(&format!(
        "SELECT count(outbox.emit('obs', '{{}}', '{{}}', 'obs-' || g)) FROM generate_series(1, {n}) g"
    ));
    let got = ob.drain(n, scaled(Duration::from_secs(30))).await;
    assert_eq!(got.len(), n);
    let settled = support::wait_until(scaled(Duration::from_secs(20)), || async {
        let t = scrape(port);
        sample(&t, "pgoutbox_messages_confirmed_total") == Some(n as f64)
            && sample(&t, "pgoutbox_unconfirmed_messages") == Some(0.0)
    })
    .await;
    let text = scrape(port);
    assert!(settled, "{text}");
    assert_eq!(
        sample(&text, "pgoutbox_messages_published_total"),
        Some(n as f64),
        "{text}"
    );
    assert_eq!(
        sample(&text, "pgoutbox_confirm_latency_seconds_count"),
        Some(n as f64),
        "{text}"
    );
    // Issue 31 item 6: every first publish's residence (the replication read that completed
    // it to the broker write that published it) is counted, and it took some time.
    assert_eq!(
        sample(&text, "pgoutbox_residence_seconds_count"),
        Some(n as f64),
        "{text}"
    );
    assert!(sample(&text, "pgoutbox_residence_seconds_sum").unwrap_or(0.0) > 0.0);
    assert_eq!(
        sample(&text, "pgoutbox_oldest_unconfirmed_age_seconds"),
        Some(0.0)
    );
    // Lag near zero once drained: the idle watermark follows the keepalives.
    let lag_low = support::wait_until(scaled(Duration::from_secs(30)), || async {
        metric(port, "pgoutbox_replication_lag_bytes") < 64.0 * 1024.0
    })
    .await;
    assert!(lag_low, "lag stays high:\n{}", stall_lines(&scrape(port)));
    let flush = metric(port, "pgoutbox_flush_lsn_bytes");
    assert!(flush > 0.0);
    assert!(metric(port, "pgoutbox_sessions_started_total") >= 1.0);

    // The memory alarm: the next publish is held by the broker.
    rmq.block();
    ob.sql("SELECT outbox.emit('obs', '{}', '{}', 'obs-blocked')");
    let not_ready = support::wait_until(scaled(Duration::from_secs(30)), || async {
        matches!(readyz(port), Some((503, body)) if body.contains("\"broker_blocked\"") || body.contains("\"stalled\""))
    })
    .await;
    assert!(
        not_ready,
        "/readyz while blocked: {:?}\n{}",
        readyz(port),
        streamer.log()
    );
    let first_age = metric(port, "pgoutbox_oldest_unconfirmed_age_seconds");
    // Past --stall-after-s the stream is stalled too, and the age keeps growing.
    let stalled = support::wait_until(scaled(Duration::from_secs(30)), || async {
        metric(port, "pgoutbox_stalled") == 1.0
    })
    .await;
    assert!(stalled, "{}", stall_lines(&scrape(port)));
    tokio::time::sleep(Duration::from_secs(2)).await;
    let during = scrape(port);
    let later_age = sample(&during, "pgoutbox_oldest_unconfirmed_age_seconds").unwrap();
    eprintln!(
        "scrape during the stall:\n{}\n/readyz: {:?}",
        stall_lines(&during),
        readyz(port)
    );
    assert!(
        later_age > first_age && later_age >= 3.0,
        "age grows while blocked: {first_age} then {later_age}"
    );
    assert_eq!(sample(&during, "pgoutbox_unconfirmed_messages"), Some(1.0));
    assert_eq!(
        sample(&during, "pgoutbox_broker_blocked"),
        Some(1.0),
        "lapin reported connection.blocked:\n{}",
        streamer.log()
    );
    assert!(
        streamer
            .wait_for_log(
                "RabbitMQ blocked the connection",
                scaled(Duration::from_secs(5))
            )
            .await
    );
    assert!(
        streamer
            .wait_for_log(
                "stalled: no message settled",
                scaled(Duration::from_secs(20))
            )
            .await,
        "the stall is logged"
    );
    assert_healthy(port, &streamer);

    rmq.unblock();
    wait_ready(port, &streamer, scaled(Duration::from_secs(30))).await;
    let back = support::wait_until(scaled(Duration::from_secs(20)), || async {
        let t = scrape(port);
        sample(&t, "pgoutbox_oldest_unconfirmed_age_seconds") == Some(0.0)
            && sample(&t, "pgoutbox_messages_confirmed_total") == Some(n as f64 + 1.0)
            && sample(&t, "pgoutbox_stalled") == Some(0.0)
            && sample(&t, "pgoutbox_broker_blocked") == Some(0.0)
    })
    .await;
    assert!(back, "{}", stall_lines(&scrape(port)));
    assert!(
        streamer
            .wait_for_log(
                "RabbitMQ unblocked the connection",
                scaled(Duration::from_secs(5))
            )
            .await
    );
    assert_healthy(port, &streamer);
    streamer.stop(scaled(Duration::from_secs(30))).await;
}

/// The readiness reason in a `/readyz` answer (`None`: ready, or no answer).
fn not_ready_reason(port: u16) -> Option<String> {
    match readyz(port)? {
        (503, body) => serde_json::from_str::<serde_json::Value>(&body)
            .ok()?
            .get("reason")?
            .as_str()
            .map(str::to_owned),
        _ => None,
    }
}

/// Polls `/readyz` until `attempts` more reconnect attempts were logged, asserting on each
/// answer that it is 503 with `reason` (issue 21 item 14: it said `connecting` between
/// sessions, whatever was down).
async fn assert_not_ready_through_reconnects(
    port: u16,
    streamer: &Streamer,
    reason: &str,
    attempts: usize,
) {
    let from = streamer.log_count("session failed; reconnecting");
    let mut polls = 0;
    let enough = support::wait_until(scaled(Duration::from_secs(60)), || {
        let seen = not_ready_reason(port);
        assert_eq!(
            seen.as_deref(),
            Some(reason),
            "/readyz after {polls} polls through the outage: {:?}\n{}",
            readyz(port),
            streamer.log()
        );
        assert_healthy(port, streamer);
        polls += 1;
        let done = streamer.log_count("session failed; reconnecting") >= from + attempts;
        async move { done }
    })
    .await;
    assert!(enough, "{attempts} reconnect attempts:\n{}", streamer.log());
}

/// `/readyz` turns 503 `broker_disconnected` when RabbitMQ stops (`stop_app`) and says so
/// through every reconnect attempt, then 200 when it is back; `/healthz` stays 200 all along;
/// the reconnect is counted with cause `broker`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readyz_follows_the_broker_going_away_and_back() {
    let pg = Postgres::shared();
    let rmq = RabbitMq::start_private();
    let ob = Outbox::new(pg, &rmq.url(), "obs_stop").await;
    let port = support::free_port();
    let addr = format!("127.0.0.1:{port}");
    let streamer = ob.run(&["--http-addr", &addr]);
    wait_ready(port, &streamer, scaled(Duration::from_secs(30))).await;

    rmq.stop_app();
    let down = support::wait_until(scaled(Duration::from_secs(40)), || async {
        readyz(port).is_some_and(|(code, _)| code == 503)
    })
    .await;
    assert!(down, "/readyz: {:?}\n{}", readyz(port), streamer.log());
    assert_not_ready_through_reconnects(port, &streamer, "broker_disconnected", 3).await;
    // Once the session failed, the process holds no role; through several reconnect
    // attempts it stays live, holding none.
    let no_role = support::wait_until(scaled(Duration::from_secs(30)), || async {
        roles(port) == (0.0, 0.0)
    })
    .await;
    assert!(no_role, "{:?}\n{}", roles(port), streamer.log());
    for _ in 0..10 {
        assert_healthy(port, &streamer);
        assert!(matches!(readyz(port), Some((503, _))));
        assert_eq!(roles(port), (0.0, 0.0), "no role while reconnecting");
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    rmq.start_app();
    wait_ready(port, &streamer, scaled(Duration::from_secs(60))).await;
    assert_healthy(port, &streamer);
    assert_eq!(roles(port), (1.0, 0.0), "active again");
    let text = scrape(port);
    assert!(
        sample(&text, "pgoutbox_reconnects_total{cause=\"broker\"}").unwrap_or(0.0) >= 1.0,
        "{text}"
    );
    assert!(sample(&text, "pgoutbox_sessions_started_total").unwrap_or(0.0) >= 2.0);
    // And it streams again.
    ob.sql("SELECT outbox.emit('obs', '{}', '{}', 'obs-after')");
    assert_eq!(ob.drain(1, scaled(Duration::from_secs(30))).await.len(), 1);
    streamer.stop(scaled(Duration::from_secs(30))).await;
}

/// `/readyz` says `replication_lost` while Postgres is out of reach: its connections cut
/// and refused at a proxy (through every reconnect attempt), then a fast shutdown of the
/// server; 200 again each time it is back (issue 21 item 14). The fast shutdown must turn
/// `/readyz` 503 at once: an idle session used to stay connected (and ready) while the
/// walsender waited for a flush position the closed SQL session could no longer record,
/// until `pg_ctl` gave up on the fast mode.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readyz_says_replication_lost_while_postgres_is_down() {
    let pg = std::sync::Arc::new(Postgres::start_private(&[]));
    let rmq = RabbitMq::shared();
    let pg_proxy = support::Proxy::start(pg.port());
    let ob = Outbox::new(&pg, &rmq.url(), "obs_pg_down").await;
    let port = support::free_port();
    let addr = format!("127.0.0.1:{port}");
    let streamer = ob.run_with_url(
        &ob.streamer_url_via(pg_proxy.port()),
        &["--http-addr", &addr],
    );
    wait_ready(port, &streamer, scaled(Duration::from_secs(30))).await;

    pg_proxy.refuse();
    let down = support::wait_until(scaled(Duration::from_secs(30)), || async {
        readyz(port).is_some_and(|(code, _)| code == 503)
    })
    .await;
    assert!(down, "/readyz: {:?}\n{}", readyz(port), streamer.log());
    assert_not_ready_through_reconnects(port, &streamer, "replication_lost", 2).await;
    pg_proxy.pass();
    wait_ready(port, &streamer, scaled(Duration::from_secs(60))).await;
    ob.sql("SELECT outbox.emit('obs', '{}', '{}', 'obs-pg-1')");
    assert_eq!(ob.drain(1, scaled(Duration::from_secs(30))).await.len(), 1);

    // A fast shutdown of an idle stream. The harness's fast stop waits 10 s (scaled)
    // before it falls back to immediate mode; readiness must turn well before that.
    let stopping = std::sync::Arc::clone(&pg);
    let stopper = std::thread::spawn(move || stopping.stop_fast());
    let began = std::time::Instant::now();
    let lost = support::wait_until(scaled(Duration::from_secs(5)), || async {
        not_ready_reason(port).as_deref() == Some("replication_lost")
    })
    .await;
    assert!(
        lost,
        "/readyz {:?} after Postgres began a fast shutdown {:?} ago\n{}",
        readyz(port),
        began.elapsed(),
        streamer.log()
    );
    stopper.join().expect("pg_ctl stop");
    assert_not_ready_through_reconnects(port, &streamer, "replication_lost", 2).await;
    pg.start();
    wait_ready(port, &streamer, scaled(Duration::from_secs(60))).await;
    ob.sql("SELECT outbox.emit('obs', '{}', '{}', 'obs-pg-2')");
    assert_eq!(ob.drain(1, scaled(Duration::from_secs(30))).await.len(), 1);
    let text = scrape(port);
    assert!(
        sample(&text, "pgoutbox_reconnects_total{cause=\"postgres\"}").unwrap_or(0.0) >= 2.0,
        "{text}"
    );
    streamer.stop(scaled(Duration::from_secs(30))).await;
}

/// The `stalled_s` of each stall warning in a log, in order.
fn stalled_s(log: &str) -> Vec<u64> {
    log.lines()
        .filter(|l| l.contains("stalled: no message settled"))
        .filter_map(|l| {
            l.split("stalled_s=")
                .nth(1)?
                .split(' ')
                .next()?
                .parse()
                .ok()
        })
        .collect()
}

/// A stall that spans a reconnect (the broker blocked, its connections closed, the next
/// session blocked too) is one stall: the next session's warning counts `stalled_s` from the
/// last progress, in the session before, not from the reconnect (issue 21 item 14).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stall_across_a_reconnect_counts_from_the_last_progress() {
    let pg = Postgres::shared();
    let rmq = RabbitMq::start_private();
    let ob = Outbox::new(pg, &rmq.url(), "obs_stall_reconnect").await;
    let port = support::free_port();
    let addr = format!("127.0.0.1:{port}");
    let streamer = ob.run(&["--http-addr", &addr, "--stall-after-s", "2"]);
    wait_ready(port, &streamer, scaled(Duration::from_secs(30))).await;
    rmq.block();
    ob.sql("SELECT outbox.emit('obs', '{}', '{}', 'obs-stuck')");
    assert!(
        streamer
            .wait_for_log(
                "stalled: no message settled",
                scaled(Duration::from_secs(20))
            )
            .await,
        "{}",
        streamer.log()
    );
    // Past 15 s of stall (more than a status interval, 10 s, after any reconnect), end the
    // session: the next one connects (an alarm blocks publishing, not connecting) and is
    // blocked as well.
    const STALLED_BEFORE: f64 = 15.0;
    assert!(
        support::wait_until(scaled(Duration::from_secs(40)), || async {
            metric(port, "pgoutbox_oldest_unconfirmed_age_seconds") >= STALLED_BEFORE
        })
        .await,
        "{}",
        stall_lines(&scrape(port))
    );
    let warnings = stalled_s(&streamer.log()).len();
    rmq.close_all_connections();
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
    let warned_again = support::wait_until(scaled(Duration::from_secs(40)), || async {
        streamer.log_count(": streaming slot=") >= 2 && stalled_s(&streamer.log()).len() > warnings
    })
    .await;
    assert!(
        warned_again,
        "a warning in the next session:\n{}",
        streamer.log()
    );
    let after = *stalled_s(&streamer.log()).last().expect("a warning");
    assert!(
        after as f64 >= STALLED_BEFORE,
        "stalled_s={after} in the next session, though nothing settled for over {STALLED_BEFORE} s:\n{}",
        streamer.log()
    );
    rmq.unblock();
    assert_eq!(ob.drain(1, scaled(Duration::from_secs(30))).await.len(), 1);
    wait_ready(port, &streamer, scaled(Duration::from_secs(30))).await;
    streamer.stop(scaled(Duration::from_secs(30))).await;
}

/// An `--http-addr` that cannot be listened on (a port in use) or that does not parse fails
/// at startup naming the setting.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_addr_in_use_or_unparsable_fails_at_startup() {
    let pg = Postgres::shared();
    let rmq = RabbitMq::shared();
    let ob = Outbox::new(pg, &rmq.url(), "obs_addr").await;
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = taken.local_addr().unwrap().port();
    let streamer = ob.run(&["--http-addr", &format!("127.0.0.1:{port}")]);
    let status = streamer
        .wait_exit(scaled(Duration::from_secs(20)))
        .await
        .expect("exits");
    assert!(!status.success());
    assert!(
        streamer.log().contains("--http-addr (PGOUTBOX_HTTP_ADDR)"),
        "{}",
        streamer.log()
    );
    drop(taken);
    let bad = ob.run(&["--http-addr", "nonsense"]);
    let status = bad
        .wait_exit(scaled(Duration::from_secs(20)))
        .await
        .expect("exits");
    assert!(!status.success());
    assert!(bad.log().contains("--http-addr"), "{}", bad.log());
}

/// A second streamer on a held slot is a standby: live, not ready (`slot_busy`), its tries
/// counted as reconnects with cause `slot_busy`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_standby_is_live_but_not_ready() {
    let pg = Postgres::shared();
    let rmq = RabbitMq::shared();
    let ob = Outbox::new(pg, &rmq.url(), "obs_standby").await;
    let active_port = support::free_port();
    let active = ob.run(&["--http-addr", &format!("127.0.0.1:{active_port}")]);
    wait_ready(active_port, &active, scaled(Duration::from_secs(30))).await;
    let port = support::free_port();
    let standby = ob.run(&["--http-addr", &format!("127.0.0.1:{port}")]);
    let busy = support::wait_until(scaled(Duration::from_secs(30)), || async {
        matches!(readyz(port), Some((503, body)) if body.contains("\"slot_busy\""))
    })
    .await;
    assert!(busy, "/readyz: {:?}\n{}", readyz(port), standby.log());
    assert_healthy(port, &standby);
    let counted = support::wait_until(scaled(Duration::from_secs(20)), || async {
        sample(
            &scrape(port),
            "pgoutbox_reconnects_total{cause=\"slot_busy\"}",
        )
        .unwrap_or(0.0)
            >= 2.0
    })
    .await;
    assert!(counted, "{}", scrape(port));
    assert_eq!(
        sample(&scrape(port), "pgoutbox_sessions_started_total"),
        Some(0.0)
    );
    assert!(matches!(readyz(active_port), Some((200, _))));
    // The role metric: 1 for each process's own role, 0 for the other.
    assert_eq!(roles(active_port), (1.0, 0.0), "active");
    assert_eq!(roles(port), (0.0, 1.0), "standby");
    // The active one stops: the standby takes the slot over, and its role follows.
    active.stop_ok(scaled(Duration::from_secs(30))).await;
    wait_ready(port, &standby, scaled(Duration::from_secs(60))).await;
    assert_eq!(roles(port), (1.0, 0.0), "after the takeover");
    standby.stop_ok(scaled(Duration::from_secs(30))).await;
}

/// `pgoutbox_role` in a scrape: (`role="active"`, `role="standby"`).
fn roles(port: u16) -> (f64, f64) {
    let text = scrape(port);
    let at = |role: &str| {
        sample(&text, &format!("pgoutbox_role{{role=\"{role}\"}}"))
            .unwrap_or_else(|| panic!("pgoutbox_role{{role={role:?}}} missing:\n{text}"))
    };
    (at("active"), at("standby"))
}

/// `pgoutbox_partition_*{partition="i"}` in a scrape: (published, unsettled, connected,
/// blocked) for partitions `0..n`.
fn partition_series(text: &str, n: usize) -> Vec<(f64, f64, f64, f64)> {
    (0..n)
        .map(|i| {
            let at =
                |name: &str| sample(text, &format!("{name}{{partition=\"{i}\"}}")).unwrap_or(-1.0);
            (
                at("pgoutbox_partition_published_total"),
                at("pgoutbox_partition_unsettled_messages"),
                at("pgoutbox_partition_connected"),
                at("pgoutbox_partition_blocked"),
            )
        })
        .collect()
}

/// Issue 18: `--partitions 3` shows one series per partition connection: its publishes (they
/// sum to what was sent, and the keys spread them over every partition), its unsettled
/// publishes, connected and blocked; under the memory alarm the held-back publishes show on
/// the partitions that carry them, and after it they settle to 0.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_partition_has_its_own_series() {
    let pg = Postgres::shared();
    let rmq = RabbitMq::start_private();
    let ob = Outbox::new(pg, &rmq.url(), "obs_parts").await;
    let port = support::free_port();
    let addr = format!("127.0.0.1:{port}");
    let streamer = ob.run(&["--partitions", "3", "--http-addr", &addr]);
    wait_ready(port, &streamer, scaled(Duration::from_secs(30))).await;
    let emit = |from: usize, to: usize| {
        ob.sql(&format!(
            "SELECT count(outbox.emit('p', '{{}}', '{{}}', 'p-' || g, aggregate_id => 'agg-' || (g % 16))) FROM generate_series({from}, {to}) g"
        ))
    };
    emit(1, 240);
    assert_eq!(
        ob.drain(240, scaled(Duration::from_secs(30))).await.len(),
        240
    );
    let mut seen = Vec::new();
    let settled = support::wait_until(scaled(Duration::from_secs(20)), || {
        seen = partition_series(&scrape(port), 3);
        let s = seen.clone();
        async move { s.iter().map(|p| p.0).sum::<f64>() == 240.0 && s.iter().all(|p| p.1 == 0.0) }
    })
    .await;
    assert!(
        settled,
        "published per partition sums to 240, nothing unsettled: {seen:?}\n{}",
        streamer.log()
    );
    for (i, (published, _, connected, blocked)) in seen.iter().enumerate() {
        assert!(*published > 0.0, "16 keys reach partition {i}: {seen:?}");
        assert_eq!(
            (*connected, *blocked),
            (1.0, 0.0),
            "partition {i}: {seen:?}"
        );
    }

    rmq.block();
    emit(241, 300);
    let held = support::wait_until(scaled(Duration::from_secs(30)), || {
        seen = partition_series(&scrape(port), 3);
        let s = seen.clone();
        async move { s.iter().map(|p| p.1).sum::<f64>() > 0.0 && s.iter().any(|p| p.3 == 1.0) }
    })
    .await;
    assert!(
        held,
        "held-back publishes and a blocked partition show: {seen:?}\n{}",
        streamer.log()
    );
    rmq.unblock();
    assert_eq!(
        ob.drain(60, scaled(Duration::from_secs(60))).await.len(),
        60
    );
    let back = support::wait_until(scaled(Duration::from_secs(20)), || {
        seen = partition_series(&scrape(port), 3);
        let s = seen.clone();
        async move {
            s.iter().map(|p| p.0).sum::<f64>() == 300.0
                && s.iter().all(|p| p.1 == 0.0 && p.2 == 1.0 && p.3 == 0.0)
        }
    })
    .await;
    assert!(
        back,
        "after the alarm: 300 published, nothing unsettled, none blocked: {seen:?}"
    );
    streamer.stop_ok(scaled(Duration::from_secs(30))).await;
}

/// The partitions a `/readyz` answer names as disconnected.
fn disconnected(port: u16) -> Option<Vec<u64>> {
    match readyz(port)? {
        (503, body) => serde_json::from_str::<serde_json::Value>(&body)
            .ok()?
            .get("partitions_disconnected")?
            .as_array()?
            .iter()
            .map(serde_json::Value::as_u64)
            .collect(),
        _ => None,
    }
}

/// One streamer of the outage tests: its outbox, process, `--http-addr` port and partitions.
struct Watched<'a> {
    ob: Outbox<'a>,
    streamer: Streamer,
    port: u16,
    partitions: usize,
}

impl<'a> Watched<'a> {
    fn start(ob: Outbox<'a>, url: Option<String>, partitions: usize) -> Watched<'a> {
        let port = support::free_port();
        let addr = format!("127.0.0.1:{port}");
        let n = partitions.to_string();
        let args = ["--http-addr", addr.as_str(), "--partitions", n.as_str()];
        let streamer = match url {
            Some(url) => ob.run_with_url(&url, &args),
            None => ob.run(&args),
        };
        Watched {
            ob,
            streamer,
            port,
            partitions,
        }
    }

    /// Emits `n` messages (keys spread over the partitions); returns the last one's LSN.
    fn emit(&self, tag: &str, n: usize) {
        self.ob.sql(&format!(
            "SELECT count(outbox.emit('o', '{{}}', '{{}}', '{tag}-' || g, aggregate_id => 'agg-' || g)) FROM generate_series(1, {n}) g"
        ));
    }

    /// Waits until every partition's `pgoutbox_partition_connected` reads `want`.
    async fn connected_all(&self, want: f64) -> bool {
        support::wait_until(scaled(Duration::from_secs(30)), || async {
            let text = scrape(self.port);
            (0..self.partitions).all(|i| {
                sample(
                    &text,
                    &format!("pgoutbox_partition_connected{{partition=\"{i}\"}}"),
                ) == Some(want)
            })
        })
        .await
    }
}

/// Issue 31 item 2: through a broker outage the gauges stay true at every scrape, with one
/// connection and with `--partitions 4`. They were written once per turn of a session's
/// loop and froze between sessions: the age stayed 0.0 (or where it was), the lag at its last
/// value while the slot's lag grew, and `pgoutbox_partition_connected` at 1.
///
/// Messages are in flight when the broker goes (the memory alarm holds them unconfirmed);
/// then, with the broker stopped, every scrape shows the age of the oldest of them grown and
/// the lag grown by the WAL written since (read between sessions from Postgres); every
/// partition reads disconnected, and `/readyz` names them all. Nothing is lost afterwards.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gauges_stay_true_through_a_broker_outage() {
    let pg = Postgres::shared();
    let rmq = RabbitMq::start_private();
    let all = [
        Watched::start(Outbox::new(pg, &rmq.url(), "obs_out_one").await, None, 1),
        Watched::start(Outbox::new(pg, &rmq.url(), "obs_out_four").await, None, 4),
    ];
    for w in &all {
        wait_ready(w.port, &w.streamer, scaled(Duration::from_secs(30))).await;
        assert!(w.connected_all(1.0).await, "{}", scrape(w.port));
    }
    rmq.block();
    for w in &all {
        w.emit("held", 8);
    }
    for w in &all {
        let held = support::wait_until(scaled(Duration::from_secs(30)), || async {
            metric(w.port, "pgoutbox_unconfirmed_messages") >= 1.0
        })
        .await;
        assert!(held, "{}", stall_lines(&scrape(w.port)));
    }
    let t_stop = std::time::Instant::now();
    rmq.stop_app();
    let stop_took = t_stop.elapsed();
    for w in &all {
        assert!(
            w.connected_all(0.0).await,
            "partitions disconnected: {}\n{}",
            scrape(w.port),
            w.streamer.log()
        );
        eprintln!(
            "{} partition(s): connected read 0 {:.1?} after stop_app began (stop_app took {stop_took:.1?})",
            w.partitions,
            t_stop.elapsed()
        );
        let named = support::wait_until(scaled(Duration::from_secs(30)), || async {
            disconnected(w.port) == Some((0..w.partitions as u64).collect())
        })
        .await;
        assert!(named, "/readyz names every partition: {:?}", readyz(w.port));
        assert_eq!(
            not_ready_reason(w.port).as_deref(),
            Some("broker_disconnected")
        );
    }
    let mut last: Vec<(f64, f64)> = all
        .iter()
        .map(|w| {
            let t = scrape(w.port);
            (
                sample(&t, "pgoutbox_oldest_unconfirmed_age_seconds").unwrap(),
                sample(&t, "pgoutbox_replication_lag_bytes").unwrap(),
            )
        })
        .collect();
    for round in 0..4 {
        for w in &all {
            w.emit(&format!("during{round}"), 2);
        }
        for (w, (age, lag)) in all.iter().zip(last.iter_mut()) {
            let mut now = (0.0, 0.0);
            let grew = support::wait_until(scaled(Duration::from_secs(20)), || {
                let t = scrape(w.port);
                now = (
                    sample(&t, "pgoutbox_oldest_unconfirmed_age_seconds").unwrap(),
                    sample(&t, "pgoutbox_replication_lag_bytes").unwrap(),
                );
                let grew = now.0 > *age && now.1 > *lag;
                async move { grew }
            })
            .await;
            assert!(
                grew,
                "round {round}, {} partition(s): age {age} -> {}, lag {lag} -> {}\n{}",
                w.partitions,
                now.0,
                now.1,
                stall_lines(&scrape(w.port))
            );
            let text = scrape(w.port);
            // The shipped alert rules' expressions, on this scrape: the age and lag grow
            // (their thresholds are minutes and GiB), and a disconnected partition shows.
            assert!(
                (0..w.partitions).all(|i| sample(
                    &text,
                    &format!("pgoutbox_partition_connected{{partition=\"{i}\"}}")
                ) == Some(0.0)),
                "{text}"
            );
            assert_eq!(sample(&text, "pgoutbox_role{role=\"active\"}"), Some(0.0));
            *age = now.0;
            *lag = now.1;
        }
    }
    eprintln!("through the outage (age s, lag bytes) at the last scrape: {last:?}");
    rmq.start_app();
    rmq.unblock();
    for w in &all {
        wait_ready(w.port, &w.streamer, scaled(Duration::from_secs(60))).await;
        assert!(w.connected_all(1.0).await, "{}", scrape(w.port));
        let got = w.ob.drain(16, scaled(Duration::from_secs(60))).await;
        let ids: std::collections::BTreeSet<_> =
            got.iter().filter_map(|m| m.message_id.clone()).collect();
        assert_eq!(ids.len(), 16, "nothing lost: {ids:?}");
        let back = support::wait_until(scaled(Duration::from_secs(30)), || async {
            metric(w.port, "pgoutbox_oldest_unconfirmed_age_seconds") == 0.0
        })
        .await;
        assert!(back, "{}", stall_lines(&scrape(w.port)));
    }
    for w in all {
        w.streamer.stop_ok(scaled(Duration::from_secs(30))).await;
    }
}

/// Issue 31 item 2, the Postgres side: while the streamer's route to Postgres is cut (a
/// proxy refuses its connections) the session ends, every partition's broker connection is
/// closed and reads disconnected, `/readyz` says `replication_lost` naming them, and the
/// seconds since the last status update grow at every scrape; the lag keeps its last reading
/// (the server cannot be read from here, see `pipeline::wal_watch`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gauges_stay_true_while_postgres_is_unreachable() {
    let pg = Postgres::shared();
    let rmq = RabbitMq::shared();
    let proxy = support::Proxy::start(pg.port());
    let mut all = Vec::new();
    for (name, n) in [("obs_pgout_one", 1), ("obs_pgout_four", 4)] {
        let ob = Outbox::new(pg, &rmq.url(), name).await;
        let url = ob.streamer_url_via(proxy.port());
        all.push(Watched::start(ob, Some(url), n));
    }
    for w in &all {
        wait_ready(w.port, &w.streamer, scaled(Duration::from_secs(30))).await;
        w.emit("before", 4);
        assert_eq!(
            w.ob.drain(4, scaled(Duration::from_secs(30))).await.len(),
            4
        );
    }
    proxy.refuse();
    for w in &all {
        assert!(
            w.connected_all(0.0).await,
            "partitions disconnected: {}\n{}",
            scrape(w.port),
            w.streamer.log()
        );
        let named = support::wait_until(scaled(Duration::from_secs(30)), || async {
            disconnected(w.port) == Some((0..w.partitions as u64).collect())
                && not_ready_reason(w.port).as_deref() == Some("replication_lost")
        })
        .await;
        assert!(named, "/readyz: {:?}", readyz(w.port));
    }
    for w in &all {
        let before = metric(w.port, "pgoutbox_since_status_update_seconds");
        let grew = support::wait_until(scaled(Duration::from_secs(20)), || async {
            metric(w.port, "pgoutbox_since_status_update_seconds") > before + 1.0
        })
        .await;
        assert!(grew, "{}", stall_lines(&scrape(w.port)));
    }
    proxy.pass();
    for w in &all {
        wait_ready(w.port, &w.streamer, scaled(Duration::from_secs(60))).await;
        assert!(w.connected_all(1.0).await, "{}", scrape(w.port));
        w.emit("after", 4);
        assert_eq!(
            w.ob.drain(4, scaled(Duration::from_secs(30))).await.len(),
            4
        );
    }
    for w in all {
        w.streamer.stop_ok(scaled(Duration::from_secs(30))).await;
    }
}

/// Issue 21 item 11: `/healthz` turns 503 (`loop_not_turning`) once nothing beat for
/// [`pgoutbox::metrics::HEALTH_STALE_AFTER`], and 200 again at the next beat.
///
/// In-process, on the real HTTP endpoint (`metrics::http::serve`) with a [`Telemetry`] that
/// nothing beats: the binary cannot be brought there from outside (from the binary, with a
/// test hook: `healthz_answers_503_from_the_binary_when_its_loop_stops_turning`). `run`'s runtime is
/// current-thread, so a busy loop silences the HTTP task too (a probe times out), and every
/// await of the loop is bounded or raced in its `select!` except the write of a standby
/// status update, which a peer that stops reading cannot block with 34-byte updates; the
/// driver beats every second while it connects or backs off. SIGSTOP does not get there
/// either: after SIGCONT the runtime polls the loop (its timers are due) before the HTTP
/// task.
///
/// [`Telemetry`]: pgoutbox::metrics::Telemetry
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn healthz_turns_unhealthy_when_nothing_beats_and_back() {
    use pgoutbox::metrics::{http, Telemetry, HEALTH_STALE_AFTER};
    let telemetry = Telemetry::new(Duration::from_secs(60));
    let port = support::free_port();
    let server = http::serve(
        std::net::SocketAddr::from(([127, 0, 0, 1], port)),
        std::sync::Arc::clone(&telemetry),
    )
    .await
    .expect("listen");
    let healthz = || async move {
        let (code, body) = tokio::task::spawn_blocking(move || get(port, "/healthz"))
            .await
            .expect("join")
            .expect("/healthz answers");
        let json: serde_json::Value = serde_json::from_str(&body).expect("json");
        (code, json)
    };
    telemetry.beat();
    let (code, json) = healthz().await;
    assert_eq!(code, 200, "{json}");
    assert_eq!(json["status"], "ok", "{json}");
    let stale_ms = HEALTH_STALE_AFTER.as_millis() as u64;
    // Every answer agrees with its own age of the last beat: 200 below the bound, 503 at or
    // above it (the age is computed when the request is served, so no timing is assumed).
    let mut unhealthy = None;
    let deadline = std::time::Instant::now() + HEALTH_STALE_AFTER + scaled(Duration::from_secs(30));
    while std::time::Instant::now() < deadline {
        let (code, json) = healthz().await;
        let since = json["since_last_turn_ms"]
            .as_u64()
            .expect("since_last_turn_ms");
        if since < stale_ms {
            assert_eq!((code, &json["status"]), (200, &"ok".into()), "{json}");
        } else {
            assert_eq!(code, 503, "{json}");
            unhealthy = Some(json);
            break;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let json = unhealthy.expect("/healthz never turned 503");
    eprintln!("/healthz with no beat: 503 {json}");
    assert_eq!(json["status"], "unhealthy", "{json}");
    assert_eq!(json["reason"], "loop_not_turning", "{json}");
    telemetry.beat();
    let (code, json) = healthz().await;
    assert_eq!(code, 200, "after a beat: {json}");
    assert_eq!(json["status"], "ok", "{json}");
    assert!(json["reason"].is_null(), "{json}");
    server.abort();
}

/// Issue 32 item 4: `/healthz` answers 503 from the binary, not only in-process. `run` with
/// `--failpoint stall-after-confirms=3` (a test hook: once 3 messages are confirmed, the
/// event loop awaits a future that never completes, as a wedged loop would, while the HTTP
/// task on the same runtime goes on) answers 200 while it streams and 503
/// `loop_not_turning` once no beat came for [`pgoutbox::metrics::HEALTH_STALE_AFTER`] (30 s),
/// with `since_last_turn_ms` at or above it; `/metrics` is still served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn healthz_answers_503_from_the_binary_when_its_loop_stops_turning() {
    use pgoutbox::metrics::HEALTH_STALE_AFTER;
    let ob = Outbox::new(Postgres::shared(), &RabbitMq::shared().url(), "obs_wedged").await;
    let port = support::free_port();
    let addr = format!("127.0.0.1:{port}");
    let streamer = ob.run(&[
        "--http-addr",
        &addr,
        "--failpoint",
        "stall-after-confirms=3",
    ]);
    wait_ready(port, &streamer, scaled(Duration::from_secs(30))).await;
    assert_healthy(port, &streamer);
    for i in 1..=5 {
        ob.emit("t", &format!("wedge-{i}"));
    }
    assert!(
        streamer
            .wait_for_log(
                "failpoint stall-after-confirms",
                scaled(Duration::from_secs(30))
            )
            .await,
        "{}",
        streamer.log()
    );
    let stale_ms = HEALTH_STALE_AFTER.as_millis() as u64;
    let began = std::time::Instant::now();
    let mut answer = None;
    while began.elapsed() < HEALTH_STALE_AFTER + scaled(Duration::from_secs(30)) {
        let (code, body) = tokio::task::spawn_blocking(move || get(port, "/healthz"))
            .await
            .expect("join")
            .unwrap_or_else(|| panic!("/healthz does not answer:\n{}", streamer.log()));
        let json: serde_json::Value = serde_json::from_str(&body).expect("json");
        let since = json["since_last_turn_ms"]
            .as_u64()
            .expect("since_last_turn_ms");
        if since < stale_ms {
            assert_eq!(code, 200, "{json}");
        } else {
            answer = Some((code, json));
            break;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let (code, json) =
        answer.unwrap_or_else(|| panic!("/healthz never went stale:\n{}", streamer.log()));
    eprintln!(
        "/healthz from the binary, {:?} after the stall: {code} {json}",
        began.elapsed()
    );
    assert_eq!(code, 503, "{json}");
    assert_eq!(json["status"], "unhealthy", "{json}");
    assert_eq!(json["reason"], "loop_not_turning", "{json}");
    let metrics = tokio::task::spawn_blocking(move || get(port, "/metrics"))
        .await
        .expect("join");
    assert!(matches!(metrics, Some((200, _))), "/metrics: {metrics:?}");
    streamer.kill9();
}

/// Issue 21 item 11: the settling counters, read from `/metrics`. Through one exchange: two
/// routed messages; one nacked for good (a queue with `x-max-length` 0 and `x-overflow:
/// reject-publish`, `--max-attempts 3`: 3 nacks, 2 retries, then a dead letter `nacked`);
/// one unroutable (no queue bound for its key: 1 return, a dead letter `returned`); one
/// poison (not an envelope: a dead letter `poison`, never published).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn settling_counters_count_nacks_retries_returns_and_dead_letters() {
    use lapin::options::{QueueBindOptions, QueueDeclareOptions};
    use lapin::types::{AMQPValue, FieldTable};
    let pg = Postgres::shared();
    let url = RabbitMq::shared().url();
    let ob = Outbox::new(pg, &url, "obs_counters").await;
    let exchange = support::unique("obs_counters_x");
    let queue = support::unique("obs_counters_q");
    let full = support::unique("obs_counters_full");
    support::declare_bound_queue(&url, &exchange, &queue, "ok.#").await;
    let mut args = FieldTable::default();
    args.insert("x-max-length".into(), AMQPValue::LongLongInt(0));
    args.insert(
        "x-overflow".into(),
        AMQPValue::LongString("reject-publish".into()),
    );
    let conn = support::amqp_connect(&url).await;
    let ch = conn.create_channel().await.expect("channel");
    ch.queue_declare(
        full.as_str().into(),
        QueueDeclareOptions {
            durable: true,
            ..Default::default()
        },
        args,
    )
    .await
    .expect("declare the full queue");
    ch.queue_bind(
        full.as_str().into(),
        exchange.as_str().into(),
        "full.#".into(),
        QueueBindOptions::default(),
        FieldTable::default(),
    )
    .await
    .expect("bind");
    let _ = conn.close(200, "bye".into()).await;
    let port = support::free_port();
    let addr = format!("127.0.0.1:{port}");
    let streamer = ob.run(&[
        "--exchange",
        &exchange,
        "--max-attempts",
        "3",
        "--http-addr",
        &addr,
    ]);
    wait_ready(port, &streamer, scaled(Duration::from_secs(30))).await;
    ob.emit("ok.1", "routed-1");
    ob.emit("full.1", "nacked");
    ob.emit("nobody.listens", "returned");
    ob.sql("SELECT pg_logical_emit_message(true, 'pgoutbox', 'not an envelope')");
    let last = ob.emit("ok.2", "routed-2");
    assert!(
        ob.flushed_past(last, scaled(Duration::from_secs(60))).await,
        "{}",
        streamer.log()
    );
    let dead =
        |reason: &str| format!("pgoutbox_messages_dead_lettered_total{{reason=\"{reason}\"}}");
    let expected: Vec<(String, f64)> = vec![
        ("pgoutbox_messages_published_total".into(), 6.0),
        ("pgoutbox_messages_confirmed_total".into(), 2.0),
        ("pgoutbox_messages_nacked_total".into(), 3.0),
        ("pgoutbox_messages_retried_total".into(), 2.0),
        ("pgoutbox_messages_returned_total".into(), 1.0),
        (dead("nacked"), 1.0),
        (dead("returned"), 1.0),
        (dead("poison"), 1.0),
        (dead("too_large"), 0.0),
        (dead("publish_refused"), 0.0),
        ("pgoutbox_unconfirmed_messages".into(), 0.0),
    ];
    let seen = |text: &str| -> Vec<(String, f64)> {
        expected
            .iter()
            .map(|(series, _)| (series.clone(), sample(text, series).unwrap_or(-1.0)))
            .collect()
    };
    // The counters reach the registry at the loop's next turn: wait for it.
    let settled = support::wait_until(scaled(Duration::from_secs(20)), || async {
        seen(&scrape(port)) == expected
    })
    .await;
    let text = scrape(port);
    assert!(
        settled,
        "expected {expected:?}\n got {:?}\n{}",
        seen(&text),
        streamer.log()
    );
    assert_eq!(
        ob.sql("SELECT string_agg(reason, ',' ORDER BY reason) FROM outbox.dead_letter")
            .trim(),
        "nacked,poison,returned"
    );
    streamer.stop_ok(scaled(Duration::from_secs(30))).await;
}
