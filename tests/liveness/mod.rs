//! Issue 21, items 4 to 6: one bad message never stops the outbox. A publish RabbitMQ
//! refuses by closing the channel is dead-lettered and the rest flows; a return for a
//! publish already marked returned is expected; a standby's broker connection survives a
//! long wait.

use std::collections::BTreeSet;
use std::time::Duration;

use crate::support::{self, lsn, scaled, unique, Outbox, Postgres, RabbitMq};

/// `base` with another user and password.
fn url_as(base: &str, user: &str, password: &str) -> String {
    let mut u = url::Url::parse(base).expect("amqp url");
    u.set_username(user).expect("user");
    u.set_password(Some(password)).expect("password");
    u.to_string()
}

/// Item 4: the streamer's RabbitMQ user may not write to an exchange a producer named, so
/// RabbitMQ closes the publishing channel (403 ACCESS_REFUSED) over that one message. It
/// is dead-lettered with a reason, the 10 messages after it are delivered, and the slot
/// advances past them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_publish_the_broker_refuses_is_dead_lettered_and_the_rest_flow() {
    refused_publish_is_dead_lettered("live_refused", &[]).await;
}

/// Issue 31 item 1: the same with `--partitions 4`. A partition's failure once carried its
/// text prefixed with `partition i: `, and the loop recognised a channel close only by the
/// text's start: the 403 was never learned, and the session reconnected and replayed it
/// forever. The loop now matches the failure's typed cause.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_publish_the_broker_refuses_on_a_partition_is_dead_lettered_and_the_rest_flow() {
    refused_publish_is_dead_lettered("live_refused_p4", &["--partitions", "4"]).await;
}

/// The body of the two tests above: `run` with `extra`, on an outbox named `name`.
async fn refused_publish_is_dead_lettered(name: &str, extra: &[&str]) {
    let pg = Postgres::shared();
    let rmq = RabbitMq::shared();
    let ob = Outbox::new(pg, &rmq.url(), name).await;
    let forbidden = unique("live_forbidden_x");
    let user = unique("live_writer");
    rmq.ctl_ok(&["add_user", &user, "live-writer-pw"]);
    // Configure anything (it declares both exchanges), write only the configured exchange.
    let write = format!("^{}$", ob.exchange);
    rmq.ctl_ok(&["set_permissions", "-p", "/", &user, ".*", &write, ".*"]);
    let streamer = ob.run_with_amqp_url(&url_as(&rmq.url(), &user, "live-writer-pw"), extra);
    assert!(
        support::wait_until(scaled(Duration::from_secs(30)), || async {
            ob.slot_active()
        })
        .await,
        "{}",
        streamer.log()
    );
    let bad = ob.sql(&format!(
        "SELECT outbox.emit('t.bad', '{{}}', message_id => 'bad', exchange => '{forbidden}')"
    ));
    let t0 = std::time::Instant::now();
    let mut last = String::new();
    for i in 0..10 {
        last = ob.sql(&format!(
            "SELECT outbox.emit('t.good', '{{\"n\": {i}}}', message_id => 'good-{i}')"
        ));
    }
    let got = ob.drain(10, scaled(Duration::from_secs(60))).await;
    eprintln!(
        "{extra:?}: the refused message dead-lettered and 10 later ones delivered after {:.1?}",
        t0.elapsed()
    );
    let ids: BTreeSet<String> = got.iter().filter_map(|m| m.message_id.clone()).collect();
    let want: BTreeSet<String> = (0..10).map(|i| format!("good-{i}")).collect();
    assert_eq!(ids, want, "{}", streamer.log());
    let row = ob.sql(&format!(
        "SELECT reason || '|' || last_error FROM outbox.dead_letter WHERE lsn = '{}'",
        bad.trim()
    ));
    assert!(
        row.starts_with("exchange_refused|"),
        "{row}\n{}",
        streamer.log()
    );
    assert!(row.contains("ACCESS_REFUSED"), "the broker's text: {row}");
    assert!(row.contains(&forbidden), "names the exchange: {row}");
    let end = lsn(&last);
    assert!(
        support::wait_until(scaled(Duration::from_secs(60)), || {
            let flushed = ob.confirmed_flush();
            async move { flushed > end }
        })
        .await,
        "the slot did not pass the last message {}\n{}",
        last.trim(),
        streamer.log()
    );
    // Learned: the next message to that exchange is dead-lettered without a reconnect.
    let reconnects = streamer.log_count("session failed; reconnecting");
    let second = ob.sql(&format!(
        "SELECT outbox.emit('t.bad', '{{}}', message_id => 'bad-2', exchange => '{forbidden}')"
    ));
    assert!(
        support::wait_until(scaled(Duration::from_secs(30)), || {
            let n = ob.sql(&format!(
                "SELECT count(*) FROM outbox.dead_letter WHERE lsn = '{}' AND reason = 'exchange_refused'",
                second.trim()
            ));
            async move { n.trim() == "1" }
        })
        .await,
        "{}",
        streamer.log()
    );
    assert_eq!(
        streamer.log_count("session failed; reconnecting"),
        reconnects,
        "{}",
        streamer.log()
    );
    streamer.sigterm();
    assert!(streamer
        .wait_exit(scaled(Duration::from_secs(30)))
        .await
        .is_some());
}

/// Item 5: under `--publish-properties minimal` returns are matched by `message_id`, so
/// the first of two returns of publishes sharing an id marks both; the second one's return
/// is expected, not a broker fault. Both are dead-lettered as `returned` and `run` goes on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_returns_sharing_a_message_id_are_both_dead_lettered() {
    let pg = Postgres::shared();
    let rmq = RabbitMq::shared();
    // No queue is bound: every message is returned (312 NO_ROUTE).
    let ob = Outbox::new_without_queue(pg, &rmq.url(), "live_dup_ret").await;
    let streamer = ob.run(&["--publish-properties", "minimal"]);
    assert!(
        support::wait_until(scaled(Duration::from_secs(30)), || async {
            ob.slot_active()
        })
        .await,
        "{}",
        streamer.log()
    );
    // One transaction: both are read, and published, before either return comes back.
    ob.sql("SELECT outbox.emit('t.dup', '{}', message_id => 'same') FROM generate_series(1, 2)");
    let after = ob.sql("SELECT outbox.emit('t.dup', '{}', message_id => 'after')");
    let count = |id: &str| {
        ob.sql(&format!(
            "SELECT count(*) FROM outbox.dead_letter WHERE message_id = '{id}' AND reason = 'returned'"
        ))
        .trim()
        .to_owned()
    };
    assert!(
        support::wait_until(scaled(Duration::from_secs(30)), || {
            let done = count("same") == "2" && count("after") == "1";
            async move { done }
        })
        .await,
        "same: {}, after: {}, exit: {:?}\n{}",
        count("same"),
        count("after"),
        streamer.try_status(),
        streamer.log()
    );
    assert!(
        streamer.try_status().is_none(),
        "run exited\n{}",
        streamer.log()
    );
    let end = lsn(&after);
    assert!(
        support::wait_until(scaled(Duration::from_secs(60)), || {
            let flushed = ob.confirmed_flush();
            async move { flushed > end }
        })
        .await,
        "{}",
        streamer.log()
    );
    streamer.sigterm();
    assert!(streamer
        .wait_exit(scaled(Duration::from_secs(30)))
        .await
        .is_some());
}

/// Item 6: a standby's broker connection is opened before it waits for the slot. Waiting
/// longer than two heartbeats (1 s here) must not cost it that connection: once the active
/// process stops, the standby's first session streams without a broker reconnect.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_standby_keeps_its_broker_connection_through_a_long_wait() {
    let pg = Postgres::shared();
    let rmq = RabbitMq::shared();
    let ob = Outbox::new(pg, &rmq.url(), "live_standby_hb").await;
    let active = ob.run(&["--standby-poll-ms", "200"]);
    assert!(
        support::wait_until(scaled(Duration::from_secs(30)), || async {
            ob.slot_active()
        })
        .await,
        "{}",
        active.log()
    );
    let standby = ob.run_with_amqp_url(
        &format!("{}?heartbeat=1", rmq.url()),
        &["--standby-poll-ms", "200"],
    );
    assert!(
        standby
            .wait_for_log("standing by", scaled(Duration::from_secs(30)))
            .await,
        "{}",
        standby.log()
    );
    // The premise: a wait of several heartbeat intervals (RabbitMQ closes a connection
    // that stays silent for two).
    tokio::time::sleep(Duration::from_secs(6)).await;
    active.sigterm();
    assert!(active
        .wait_exit(scaled(Duration::from_secs(30)))
        .await
        .is_some());
    assert!(
        standby
            .wait_for_log(": streaming ", scaled(Duration::from_secs(30)))
            .await,
        "{}",
        standby.log()
    );
    ob.sql("SELECT outbox.emit('t.sb', '{}', message_id => 'after-takeover')");
    let got = ob.drain(1, scaled(Duration::from_secs(30))).await;
    assert!(
        got.iter()
            .any(|m| m.message_id.as_deref() == Some("after-takeover")),
        "{}",
        standby.log()
    );
    assert_eq!(
        standby.log_count("session failed; reconnecting"),
        0,
        "the first session after the takeover failed\n{}",
        standby.log()
    );
    standby.sigterm();
    assert!(standby
        .wait_exit(scaled(Duration::from_secs(30)))
        .await
        .is_some());
}

/// The last `retry_in_ms=N` of a streamer's log.
fn last_retry_ms(log: &str) -> Option<u64> {
    log.lines()
        .rev()
        .filter(|l| l.contains("session failed; reconnecting"))
        .filter_map(|l| l.split("retry_in_ms=").nth(1))
        .filter_map(|v| v.split_whitespace().next())
        .find_map(|v| v.parse().ok())
}

/// Issue 21, item 14: the reconnect backoff does not carry over from one outage to the
/// next. A broker outage grows it (failed connects); a session that then streamed for a
/// while and fails starts again from the minimum (0.5 s to 1 s with jitter).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_backoff_starts_over_after_a_session_that_streamed() {
    let pg = Postgres::shared();
    let rmq = RabbitMq::start_private();
    let ob = Outbox::new(pg, &rmq.url(), "live_backoff").await;
    let streamer = ob.run(&[]);
    assert!(
        streamer
            .wait_for_log(": streaming ", scaled(Duration::from_secs(30)))
            .await,
        "{}",
        streamer.log()
    );
    // Outage 1: the broker is down for several failed connects.
    rmq.stop_app();
    assert!(
        support::wait_until(scaled(Duration::from_secs(60)), || {
            let grown = last_retry_ms(&streamer.log()).is_some_and(|ms| ms >= 4000);
            async move { grown }
        })
        .await,
        "the backoff grows while the broker is down\n{}",
        streamer.log()
    );
    rmq.start_app();
    ob.sql("SELECT outbox.emit('t.back', '{}', message_id => 'back')");
    let got = ob.drain(1, scaled(Duration::from_secs(60))).await;
    assert_eq!(got.len(), 1, "{}", streamer.log());
    let failures = streamer.log_count("session failed; reconnecting");
    // The premise: the new session streams for longer than the 5 s that count as streamed.
    tokio::time::sleep(Duration::from_secs(7)).await;
    assert_eq!(
        streamer.log_count("session failed; reconnecting"),
        failures,
        "the session after the outage kept streaming\n{}",
        streamer.log()
    );
    // Outage 2.
    rmq.close_all_connections();
    assert!(
        support::wait_until(scaled(Duration::from_secs(30)), || {
            let n = streamer.log_count("session failed; reconnecting");
            async move { n > failures }
        })
        .await,
        "{}",
        streamer.log()
    );
    let retry = last_retry_ms(&streamer.log()).expect("a retry");
    assert!(
        retry <= 1000,
        "the backoff carried over from the first outage: retry_in_ms={retry}\n{}",
        streamer.log()
    );
    streamer.sigterm();
    assert!(streamer
        .wait_exit(scaled(Duration::from_secs(30)))
        .await
        .is_some());
}
