//! Routing (issue 9): producers name an exchange per message (`outbox.emit(...,
//! exchange => 'x')`), `--allowed-exchanges` restricts them, producer-named exchanges are
//! declared durable topic on first use, and `--no-declare` only checks them.
//!
//! One database per test on the shared Postgres and RabbitMQ; exchange and queue names are
//! unique per test.

use std::time::Duration;

use crate::support::{
    declare_bound_queue, drain_queue, lsn, scaled, unique, wait_until, Outbox, Postgres, RabbitMq,
    Received, Streamer,
};

/// Bound on waiting for a message or a dead letter.
const WAIT: Duration = Duration::from_secs(20);

fn ids(got: &[Received]) -> Vec<String> {
    got.iter()
        .map(|m| m.message_id.clone().unwrap_or_default())
        .collect()
}

/// `SELECT outbox.emit(...)` of message `id` with topic `topic`, to `exchange` (`None`:
/// the streamer's `--exchange`).
fn emit(topic: &str, id: &str, exchange: Option<&str>) -> String {
    let exchange = exchange
        .map(|x| format!(", exchange => '{x}'"))
        .unwrap_or_default();
    format!(
        "SELECT outbox.emit('{topic}', '{{\"id\": \"{id}\"}}', message_id => '{id}'{exchange});"
    )
}

/// `(message_id, reason, last_error)` of every dead letter, in order.
fn dead_letters(ob: &Outbox<'_>) -> Vec<(String, String, String)> {
    ob.sql("SELECT coalesce(message_id, '-'), reason, replace(coalesce(last_error, ''), E'\\n', ' ') FROM outbox.dead_letter ORDER BY id")
        .lines()
        .filter(|l| !l.is_empty())
        .map(|l| {
            let mut parts = l.splitn(3, '|');
            let mut next = || parts.next().unwrap_or_default().to_owned();
            (next(), next(), next())
        })
        .collect()
}

async fn wait_dead_letters(ob: &Outbox<'_>, n: usize) -> Vec<(String, String, String)> {
    wait_until(scaled(WAIT), || async { dead_letters(ob).len() >= n }).await;
    dead_letters(ob)
}

/// Waits until the slot's confirmed position passed `lsn_text` (an `X/Y` from emit).
async fn wait_flushed_past(ob: &Outbox<'_>, lsn_text: &str) -> bool {
    let target = lsn(lsn_text);
    wait_until(scaled(WAIT), || async { ob.confirmed_flush() > target }).await
}

/// `name type durable` lines of `rabbitmqctl list_exchanges` for `name`.
fn exchange_row(name: &str) -> Option<String> {
    let out = RabbitMq::shared().ctl_ok(&["list_exchanges", "-q", "name", "type", "durable"]);
    out.lines()
        .find(|l| l.split_whitespace().next() == Some(name))
        .map(|l| l.split_whitespace().collect::<Vec<_>>().join(" "))
}

async fn started(s: &Streamer) {
    assert!(
        s.wait_for_log("streaming", scaled(WAIT)).await,
        "run did not start: {}",
        s.log()
    );
}

/// Messages of one transaction and of later ones, interleaved over two producer-named
/// exchanges and the default one, each arrive on the queue bound to their own exchange,
/// in emit order, with their exchange on the delivery; the slot moves past them all.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn messages_arrive_on_the_exchange_their_producer_named_in_order() {
    let url = RabbitMq::shared().url();
    let ob = Outbox::new(Postgres::shared(), &url, "routing_two").await;
    let (xa, qa) = (unique("routing_two_xa"), unique("routing_two_qa"));
    let (xb, qb) = (unique("routing_two_xb"), unique("routing_two_qb"));
    declare_bound_queue(&url, &xa, &qa, "#").await;
    declare_bound_queue(&url, &xb, &qb, "#").await;
    let s = ob.run(&[]);
    started(&s).await;

    let mut sql = String::from("BEGIN;");
    for n in 1..=3 {
        sql += &emit("orders.a", &format!("a{n}"), Some(&xa));
        sql += &emit("orders.b", &format!("b{n}"), Some(&xb));
        sql += &emit("orders.d", &format!("d{n}"), None);
    }
    sql += "COMMIT;";
    ob.sql(&sql);
    for n in 4..=5 {
        ob.sql(&emit("orders.b", &format!("b{n}"), Some(&xb)));
        ob.sql(&emit("orders.a", &format!("a{n}"), Some(&xa)));
    }
    let last = ob.sql(&emit("orders.d", "d4", None)).trim().to_owned();

    let a = drain_queue(&url, &qa, 5, scaled(WAIT)).await;
    let b = drain_queue(&url, &qb, 5, scaled(WAIT)).await;
    let d = ob.drain(4, scaled(WAIT)).await;
    assert_eq!(ids(&a), ["a1", "a2", "a3", "a4", "a5"], "{}", s.log());
    assert_eq!(ids(&b), ["b1", "b2", "b3", "b4", "b5"]);
    assert_eq!(ids(&d), ["d1", "d2", "d3", "d4"]);
    assert!(a
        .iter()
        .all(|m| m.exchange == xa && m.routing_key == "orders.a"));
    assert!(b
        .iter()
        .all(|m| m.exchange == xb && m.routing_key == "orders.b"));
    assert!(d.iter().all(|m| m.exchange == ob.exchange));
    assert!(wait_flushed_past(&ob, &last).await, "slot did not advance");
    assert!(dead_letters(&ob).is_empty(), "{:?}", dead_letters(&ob));
}

/// `--allowed-exchanges`: a message naming an exchange not in the list is dead-lettered
/// with reason exchange_not_allowed (its dead letter names the exchange) and never
/// published (the exchange is not even declared); the messages after it, to an allowed
/// exchange and to `--exchange` (allowed without being listed), arrive; the slot moves past
/// all of them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_allow_list_dead_letters_a_disallowed_exchange_and_the_next_message_arrives() {
    let url = RabbitMq::shared().url();
    let ob = Outbox::new(Postgres::shared(), &url, "routing_allow").await;
    let (xa, qa) = (unique("routing_allow_xa"), unique("routing_allow_qa"));
    let forbidden = unique("routing_allow_forbidden");
    declare_bound_queue(&url, &xa, &qa, "#").await;
    let s = ob.run(&["--allowed-exchanges", &format!("other, {xa}")]);
    started(&s).await;

    ob.sql(&emit("t", "m1", Some(&xa)));
    ob.sql(&emit("t", "m2", Some(&forbidden)));
    ob.sql(&emit("t", "m3", Some(&xa)));
    // --exchange named explicitly is allowed too.
    ob.sql(&emit("t", "m4", Some(&ob.exchange)));
    let last = ob.sql(&emit("t", "m5", None)).trim().to_owned();

    let a = drain_queue(&url, &qa, 2, scaled(WAIT)).await;
    let d = ob.drain(2, scaled(WAIT)).await;
    assert_eq!(ids(&a), ["m1", "m3"], "{}", s.log());
    assert_eq!(ids(&d), ["m4", "m5"]);
    let dl = wait_dead_letters(&ob, 1).await;
    assert_eq!(dl.len(), 1, "{dl:?}");
    assert_eq!(
        (dl[0].0.as_str(), dl[0].1.as_str()),
        ("m2", "exchange_not_allowed")
    );
    assert!(
        dl[0].2.contains(&format!("{forbidden:?}")) && dl[0].2.contains("--allowed-exchanges"),
        "{dl:?}"
    );
    assert_eq!(
        exchange_row(&forbidden),
        None,
        "a disallowed exchange is never declared"
    );
    assert!(wait_flushed_past(&ob, &last).await, "slot did not advance");
}

/// A producer-named exchange that does not exist is declared on first use as a durable
/// topic exchange (its first message, with no queue bound yet, is published there and
/// returned); once a queue is bound, the next message to it arrives. An exchange that
/// exists with another type is refused (406): its message is dead-lettered as
/// exchange_refused with the broker's reply text, and publishing goes on over the same
/// connection (no reconnect).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_producer_named_exchange_is_declared_durable_topic_and_a_406_is_dead_lettered() {
    let url = RabbitMq::shared().url();
    let ob = Outbox::new(Postgres::shared(), &url, "routing_declare").await;
    let (xc, qc) = (unique("routing_declare_xc"), unique("routing_declare_qc"));
    let fanout = unique("routing_declare_fanout");
    {
        let conn = crate::support::amqp_connect(&url).await;
        let ch = conn.create_channel().await.expect("channel");
        ch.exchange_declare(
            fanout.as_str().into(),
            lapin::ExchangeKind::Fanout,
            lapin::options::ExchangeDeclareOptions {
                durable: true,
                ..Default::default()
            },
            lapin::types::FieldTable::default(),
        )
        .await
        .expect("declare fanout");
        let _ = conn.close(200, "bye".into()).await;
    }
    assert_eq!(exchange_row(&xc), None);
    let s = ob.run(&[]);
    started(&s).await;

    ob.sql(&emit("t", "c1", Some(&xc)));
    let dl = wait_dead_letters(&ob, 1).await;
    assert_eq!(
        dl.iter()
            .map(|d| (d.0.as_str(), d.1.as_str()))
            .collect::<Vec<_>>(),
        [("c1", "returned")],
        "{}",
        s.log()
    );
    assert!(dl[0].2.contains(&format!("{xc:?}")), "{dl:?}");
    assert_eq!(exchange_row(&xc), Some(format!("{xc} topic true")));

    declare_bound_queue(&url, &xc, &qc, "#").await;
    ob.sql(&emit("t", "c2", Some(&xc)));
    ob.sql(&emit("t", "f1", Some(&fanout)));
    let last = ob.sql(&emit("t", "d1", None)).trim().to_owned();
    let c = drain_queue(&url, &qc, 1, scaled(WAIT)).await;
    assert_eq!(ids(&c), ["c2"]);
    assert_eq!(ids(&ob.drain(1, scaled(WAIT)).await), ["d1"]);
    let dl = wait_dead_letters(&ob, 2).await;
    assert_eq!(
        (dl[1].0.as_str(), dl[1].1.as_str()),
        ("f1", "exchange_refused"),
        "{dl:?}"
    );
    assert!(
        dl[1].2.contains("406")
            && dl[1].2.contains("PRECONDITION_FAILED")
            && dl[1].2.contains(&fanout),
        "{dl:?}"
    );
    assert_eq!(exchange_row(&fanout), Some(format!("{fanout} fanout true")));
    assert!(wait_flushed_past(&ob, &last).await, "slot did not advance");
    assert_eq!(s.log_count("connected to RabbitMQ"), 1, "{}", s.log());
}

/// `--no-declare`: a message naming an exchange that does not exist is dead-lettered as
/// exchange_not_found (the broker's 404 in its error), never creating the exchange; the
/// messages after it, to an existing producer-named exchange and to `--exchange`, arrive
/// over the same connection, and the slot moves past them. A missing `--exchange` itself
/// stops nothing silently: run says it does not exist and how to fix it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_declare_dead_letters_a_message_naming_a_missing_exchange() {
    let url = RabbitMq::shared().url();
    let ob = Outbox::new(Postgres::shared(), &url, "routing_nodecl").await;
    let (xa, qa) = (unique("routing_nodecl_xa"), unique("routing_nodecl_qa"));
    let missing = unique("routing_nodecl_missing");
    declare_bound_queue(&url, &xa, &qa, "#").await;
    let s = ob.run(&["--no-declare"]);
    started(&s).await;

    ob.sql(&emit("t", "n1", Some(&missing)));
    ob.sql(&emit("t", "n2", Some(&xa)));
    let last = ob.sql(&emit("t", "n3", None)).trim().to_owned();
    assert_eq!(
        ids(&drain_queue(&url, &qa, 1, scaled(WAIT)).await),
        ["n2"],
        "{}",
        s.log()
    );
    assert_eq!(ids(&ob.drain(1, scaled(WAIT)).await), ["n3"]);
    let dl = wait_dead_letters(&ob, 1).await;
    assert_eq!(dl.len(), 1, "{dl:?}");
    assert_eq!(
        (dl[0].0.as_str(), dl[0].1.as_str()),
        ("n1", "exchange_not_found")
    );
    assert!(
        dl[0].2.contains("404") && dl[0].2.contains(&missing) && dl[0].2.contains("--no-declare"),
        "{dl:?}"
    );
    assert_eq!(exchange_row(&missing), None, "--no-declare creates nothing");
    assert!(wait_flushed_past(&ob, &last).await, "slot did not advance");
    assert_eq!(s.log_count("connected to RabbitMQ"), 1, "{}", s.log());
    s.sigterm();
    assert!(s
        .wait_exit(scaled(WAIT))
        .await
        .is_some_and(|st| st.success()));

    // --exchange itself missing under --no-declare: named in the error, with the fix.
    let gone = unique("routing_nodecl_gone");
    let s = ob.run(&["--no-declare", "--exchange", &gone]);
    let said = s
        .wait_for_log("does not exist and run has --no-declare", scaled(WAIT))
        .await;
    s.sigterm();
    let _ = s.wait_exit(scaled(WAIT)).await;
    assert!(said, "{}", s.log());
    assert!(s.log().contains(&gone));
    assert_eq!(exchange_row(&gone), None);
}

/// A bad `exchange` argument raises SQLSTATE 22023 inside the producer's transaction,
/// naming the argument; NULL means `--exchange` and writes no `exchange` key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bad_exchange_argument_raises_22023_naming_it() {
    let pg = Postgres::shared();
    let ob = Outbox::new(pg, &RabbitMq::shared().url(), "routing_sql").await;
    let client = Postgres::client_url(&ob.url()).await.expect("connect");
    // The hint says what to pass instead: NULL for the empty name, the byte limit for the
    // long one (the names are AMQP short strings).
    for (bad, fix) in [
        ("''".to_owned(), "NULL"),
        (format!("'{}'", "x".repeat(256)), "255 bytes"),
    ] {
        let e = client
            .batch_execute(&format!(
                "SELECT outbox.emit('t', '{{}}', exchange => {bad})"
            ))
            .await
            .expect_err("a bad exchange must raise");
        let db = e.as_db_error().expect("a database error");
        assert_eq!(db.code().code(), "22023", "{db:?}");
        assert!(db.message().contains("argument exchange"), "{db:?}");
        assert!(db.hint().is_some_and(|h| h.contains(fix)), "{db:?}");
    }
    let header = |exchange: &str| {
        ob.sql(&format!(
            "SELECT convert_from(substring(e FROM 6 FOR get_byte(e, 4) + 256 * get_byte(e, 3)), 'UTF8')::jsonb ->> 'exchange' FROM (SELECT outbox._envelope('t', ''::bytea, 'a/b', '{{}}', 'i', {exchange}) AS e) s"
        ))
        .trim()
        .to_owned()
    };
    assert_eq!(header("'billing'"), "billing");
    assert_eq!(header("NULL"), "");
}

/// `check` reports the routing settings: the allow-list and, under `--no-declare`, that a
/// missing `--exchange` is a problem (run would not stream).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn check_reports_the_allow_list_and_a_missing_exchange_under_no_declare() {
    let url = RabbitMq::shared().url();
    let ob = Outbox::new(Postgres::shared(), &url, "routing_check").await;
    let gone = unique("routing_check_gone");
    let out = ob.cli(&[
        "check",
        "--amqp-url",
        &url,
        "--publication",
        &ob.publication,
        "--exchange",
        &gone,
        "--allowed-exchanges",
        "billing,audit",
        "--no-declare",
    ]);
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        text.contains("producers may name only audit,billing (--allowed-exchanges)"),
        "{text}"
    );
    assert!(text.contains("only checked (--no-declare)"), "{text}");
    assert!(
        text.contains(&format!("{gone:?} does not exist, and with --no-declare")),
        "{text}"
    );
    assert_ne!(out.status.code(), Some(0), "a problem fails check: {text}");
}

/// Issue 32, item 4: a producer-named exchange that is `internal` (clients may not publish
/// to it) closes the channel with 403 ACCESS_REFUSED on a publish (`--no-declare`; with
/// declares on, the declare is refused first with a 406): end to end, that
/// message is dead-lettered with the broker's code and text, the messages before and after
/// it (to `--exchange`) arrive, and the slot moves past them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_publish_to_an_internal_exchange_is_dead_lettered_with_the_403() {
    let url = RabbitMq::shared().url();
    let ob = Outbox::new(Postgres::shared(), &url, "routing_internal").await;
    let internal = unique("routing_internal_x");
    {
        let conn = crate::support::amqp_connect(&url).await;
        let ch = conn.create_channel().await.expect("channel");
        ch.exchange_declare(
            internal.as_str().into(),
            lapin::ExchangeKind::Topic,
            lapin::options::ExchangeDeclareOptions {
                durable: true,
                internal: true,
                ..Default::default()
            },
            lapin::types::FieldTable::default(),
        )
        .await
        .expect("declare internal");
        let _ = conn.close(200, "bye".into()).await;
    }
    // --no-declare: the message goes straight to the exchange (a declare would be refused
    // first, with a 406 for the `internal` argument).
    let s = ob.run(&["--no-declare"]);
    started(&s).await;
    ob.sql(&emit("t", "i0", None));
    ob.sql(&emit("t", "i1", Some(&internal)));
    let last = ob.sql(&emit("t", "i2", None)).trim().to_owned();
    // The channel's close ends the session: i0, unconfirmed then, may arrive twice (a
    // reconnect may duplicate, never lose).
    assert!(wait_flushed_past(&ob, &last).await, "slot did not advance");
    // Past i2's commit, so everything routed is in the queue: read it all.
    let mut got = ids(&ob.drain(10, scaled(Duration::from_secs(2))).await);
    got.dedup();
    assert_eq!(got, ["i0", "i2"], "{}", s.log());
    let dl = wait_dead_letters(&ob, 1).await;
    assert_eq!(dl[0].0, "i1", "{dl:?}");
    assert!(
        dl[0].2.contains("403") && dl[0].2.contains("ACCESS_REFUSED"),
        "the broker's code and text: {dl:?}\n{}",
        s.log()
    );
    println!("dead letter: {dl:?}");
}

/// Issue 32 item 4, the isolation path end to end: RabbitMQ's topic permissions refuse one
/// routing key on the configured exchange (`set_topic_permissions guest X '^ok\.'`), so a
/// publish with another key closes the channel with 403 ACCESS_REFUSED "write access to
/// topic 'bad.3' in exchange 'X' ..." while the publishes around it are unsettled. The next
/// session publishes one message at a time until it is past them, finds the culprit alone
/// in flight at the next close, and dead-letters it as `publish_refused` with the broker's
/// text; the other messages arrive and the slot moves past them all. (A real 406 on a
/// publish takes the size path, `too_large`, whenever pgoutbox's own checks let a message
/// through; this close is the per-message refusal RabbitMQ 3.10 has.) A private node, so the
/// permission touches no other test.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_routing_key_refused_by_topic_permissions_is_isolated_and_dead_lettered() {
    let rmq = RabbitMq::start_private();
    let url = rmq.url();
    let ob = Outbox::new(Postgres::shared(), &url, "routing_topic_perm").await;
    rmq.ctl_ok(&[
        "set_topic_permissions",
        "-p",
        "/",
        "guest",
        &ob.exchange,
        "^ok\\.",
        ".*",
    ]);
    // A backlog in one burst, so several publishes are unsettled when the close comes.
    let mut sql = String::from("BEGIN;");
    for (topic, id) in [
        ("ok.1", "k1"),
        ("ok.2", "k2"),
        ("bad.3", "k3"),
        ("ok.4", "k4"),
        ("ok.5", "k5"),
    ] {
        sql.push_str(&emit(topic, id, None));
    }
    sql.push_str("COMMIT;");
    ob.sql(&sql);
    let last = ob.sql(&emit("ok.6", "k6", None)).trim().to_owned();
    let s = ob.run(&[]);
    started(&s).await;
    let dl = wait_dead_letters(&ob, 1).await;
    assert_eq!(
        dl.iter()
            .map(|d| (d.0.as_str(), d.1.as_str()))
            .collect::<Vec<_>>(),
        [("k3", "publish_refused")],
        "{dl:?}\n{}",
        s.log()
    );
    assert!(
        dl[0].2.contains("403") && dl[0].2.contains("topic 'bad.3'"),
        "the broker's code and text: {dl:?}"
    );
    assert!(
        wait_flushed_past(&ob, &last).await,
        "slot did not advance:\n{}",
        s.log()
    );
    let mut got = ids(&ob.drain(20, scaled(Duration::from_secs(2))).await);
    got.sort();
    got.dedup();
    assert_eq!(got, ["k1", "k2", "k4", "k5", "k6"], "{}", s.log());
    let log = s.log();
    let isolated = log
        .lines()
        .find(|l| l.contains("publishing them one at a time to find it"))
        .unwrap_or_else(|| panic!("no isolation: several were unconfirmed at the close:\n{log}"));
    assert!(
        log.contains("closed the channel over the one unconfirmed message"),
        "the culprit alone in flight at the next close:\n{log}"
    );
    println!("isolation: {isolated}\ndead letter: {dl:?}");
    s.stop_ok(scaled(Duration::from_secs(30))).await;
}
