//! Exact AMQP frame orderings against the publisher, played by the scripted fake broker
//! (`support::fake_broker`), issue 12 "Tests".
//!
//! The first test checks the fake itself against lapin, a client that is not ours: if lapin
//! can connect, enable confirms, declare, publish and see the fake's ack and return, the fake
//! speaks AMQP 0-9-1 well enough for its verdicts on our publisher to count.

use std::time::Duration;

use amq_protocol::frame::AMQPFrame;
use lapin::options::{BasicPublishOptions, ConfirmSelectOptions, ExchangeDeclareOptions};
use lapin::protocol::{connection, AMQPClass};
use lapin::types::{AMQPValue, FieldTable, ShortString};
use lapin::{BasicProperties, Confirmation, Connection, ConnectionProperties, ExchangeKind};
use pgoutbox::lsn::Lsn;
use pgoutbox::publisher::{
    BrokerSignals, Error, MatchKey, OutboundMessage, PublishOutcome, Publisher, PublisherConfig,
};
use pgoutbox::sink::FailureCause;

use crate::support::fake_broker::{
    ack, encode_frames, nack, return_frames, FakeBroker, FakeConfig, ReceivedPublish,
    ReturnContent, Script, LSN_HEADER,
};
use crate::support::scaled;

/// Bound on every wait for the client side.
const WAIT: Duration = Duration::from_secs(5);

fn lsn_headers(lsn: &str) -> FieldTable {
    let mut headers = FieldTable::default();
    headers.insert(
        ShortString::from(LSN_HEADER),
        AMQPValue::LongString(lsn.into()),
    );
    headers
}

/// A mandatory lapin publish to `orders` with our header and a message id; returns lapin's
/// pending confirm.
async fn lapin_publish(
    ch: &lapin::Channel,
    body: &[u8],
    lsn: &str,
    id: &str,
) -> lapin::PublisherConfirm {
    ch.basic_publish(
        "orders".into(),
        "orders.created".into(),
        BasicPublishOptions {
            mandatory: true,
            ..Default::default()
        },
        body,
        BasicProperties::default()
            .with_message_id(id.into())
            .with_headers(lsn_headers(lsn)),
    )
    .await
    .expect("basic.publish")
}

/// The fake against lapin: handshake, confirm.select, exchange.declare, a publish the fake
/// acks (lapin's confirm resolves as a plain ack), a publish the fake returns and then acks
/// (lapin's confirm carries the returned message, headers and body intact), heartbeats
/// both ways at 1 s (lapin stays connected meanwhile), and lapin's
/// connection.close.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_fake_broker_speaks_amqp_to_lapin() {
    let fake = FakeBroker::start(FakeConfig {
        heartbeat: 1,
        ..FakeConfig::default()
    })
    .await;
    let conn = tokio::time::timeout(
        scaled(WAIT),
        Connection::connect(&fake.url(), ConnectionProperties::default()),
    )
    .await
    .expect("lapin connect timed out")
    .expect("lapin connect");
    let ch = conn.create_channel().await.expect("channel.open");
    ch.confirm_select(ConfirmSelectOptions::default())
        .await
        .expect("confirm.select");
    ch.exchange_declare(
        "orders".into(),
        ExchangeKind::Topic,
        ExchangeDeclareOptions {
            durable: true,
            ..Default::default()
        },
        FieldTable::default(),
    )
    .await
    .expect("exchange.declare");
    fake.wait_ready().await;
    let start_ok = fake.start_ok().expect("start-ok");
    assert_eq!(start_ok.mechanism.as_str(), "PLAIN");
    assert_eq!(start_ok.response.as_bytes(), b"\0guest\0guest");
    assert_eq!(fake.vhost().as_deref(), Some("/"));
    let declare = fake.declare().expect("declare");
    assert_eq!(
        (
            declare.exchange.as_str(),
            declare.kind.as_str(),
            declare.durable
        ),
        ("orders", "topic", true)
    );

    let first = lapin_publish(&ch, b"first", "0/10", "m1").await;
    let received = fake.wait_publishes(1).await;
    let p = &received[0];
    assert_eq!(p.delivery_tag, 1);
    assert_eq!(p.method.exchange.as_str(), "orders");
    assert_eq!(p.method.routing_key.as_str(), "orders.created");
    assert!(p.method.mandatory);
    assert_eq!(p.body, b"first");
    assert_eq!(p.body_frames, 1);
    assert_eq!(p.lsn.as_deref(), Some("0/10"));
    assert_eq!(p.message_id.as_deref(), Some("m1"));
    fake.send_ack(1, false).await;
    let confirmation = tokio::time::timeout(scaled(WAIT), first)
        .await
        .expect("lapin confirm of #1 timed out")
        .expect("confirm #1");
    assert_eq!(confirmation, Confirmation::Ack(None));

    let second = lapin_publish(&ch, b"second", "0/20", "m2").await;
    let received = fake.wait_publishes(2).await;
    assert_eq!(received[1].delivery_tag, 2);
    fake.send_return(&received[1], 312, "NO_ROUTE", ReturnContent::AsPublished)
        .await;
    fake.send_ack(2, false).await;
    let confirmation = tokio::time::timeout(scaled(WAIT), second)
        .await
        .expect("lapin confirm of #2 timed out")
        .expect("confirm #2");
    let Confirmation::Ack(Some(returned)) = confirmation else {
        panic!("expected an ack carrying the returned message, got {confirmation:?}");
    };
    assert_eq!(returned.reply_code, 312);
    assert_eq!(returned.reply_text.as_str(), "NO_ROUTE");
    assert_eq!(returned.delivery.data, b"second");
    assert_eq!(
        returned
            .delivery
            .properties
            .message_id()
            .as_ref()
            .map(|m| m.as_str()),
        Some("m2")
    );
    assert_eq!(
        returned
            .delivery
            .properties
            .headers()
            .as_ref()
            .and_then(|h| h.inner().get(LSN_HEADER).cloned()),
        Some(AMQPValue::LongString("0/20".into()))
    );

    assert_eq!(fake.tune_ok().expect("tune-ok").heartbeat, 1);
    assert!(
        fake.wait_heartbeats(4, scaled(Duration::from_secs(4)))
            .await,
        "lapin sent {} heartbeats",
        fake.heartbeats_received()
    );
    assert!(conn.status().connected(), "lapin dropped the connection");

    tokio::time::timeout(scaled(WAIT), conn.close(200, "bye".into()))
        .await
        .expect("lapin close timed out")
        .expect("connection.close");
    fake.wait_closed().await;
    assert!(
        fake.methods()
            .iter()
            .any(|(_, m)| matches!(m, AMQPClass::Connection(connection::AMQPMethod::Close(_)))),
        "{:?}",
        fake.methods()
    );
    assert_eq!(fake.violations(), Vec::<String>::new());
}

// ---------------------------------------------------------------------------------------
// The publisher (src/publisher/) against scripted orderings.
// ---------------------------------------------------------------------------------------

/// Every delivery tag's outcome, in the order the publisher handed them out.
type Outcomes = Vec<(u64, PublishOutcome)>;

/// How long a "nothing happens" check listens.
const QUIET: Duration = Duration::from_millis(200);

/// The test's message `n`: tag `n`, LSN `n × 0x100` in our header and as the match key,
/// `message_id` `m<n>`, body `message <n>`.
fn message(n: u64) -> OutboundMessage<u64> {
    message_with_body(n, format!("message {n}").into_bytes())
}

fn lsn_of(n: u64) -> Lsn {
    Lsn(n * 0x100)
}

fn message_with_body(n: u64, body: Vec<u8>) -> OutboundMessage<u64> {
    let lsn = lsn_of(n);
    let properties = BasicProperties::default()
        .with_message_id(format!("m{n}").into())
        .with_delivery_mode(2)
        .with_headers(lsn_headers(&lsn.to_string()));
    OutboundMessage {
        tag: n,
        exchange: pgoutbox::publisher::Exchange::Configured,
        routing_key: ShortString::from(format!("orders.{n}")),
        body: body.into(),
        properties,
        match_key: MatchKey::Lsn(lsn),
    }
}

fn returned(code: u16, text: &str) -> PublishOutcome {
    PublishOutcome::Returned {
        reply_code: code,
        reply_text: text.to_owned(),
    }
}

fn publisher_config(fake: &FakeBroker) -> PublisherConfig {
    PublisherConfig {
        amqp_url: fake.url().into(),
        exchange: "pgoutbox_wire".into(),
        declare: pgoutbox::publisher::connection::Declare::DurableTopic,
        connection_name: "publisher_wire test".into(),
        signals: BrokerSignals::default(),
    }
}

/// Starts a fake with `config` and connects a publisher to it; checks the handshake.
async fn connect(config: FakeConfig) -> (FakeBroker, Publisher<u64>) {
    let fake = FakeBroker::start(config).await;
    let publisher = tokio::time::timeout(
        scaled(WAIT),
        Publisher::<u64>::connect(&publisher_config(&fake)),
    )
    .await
    .expect("Publisher::connect timed out")
    .expect("Publisher::connect");
    fake.wait_ready().await;
    let start_ok = fake.start_ok().expect("start-ok");
    assert_eq!(start_ok.mechanism.as_str(), "PLAIN");
    assert_eq!(start_ok.response.as_bytes(), b"\0guest\0guest");
    assert_eq!(fake.vhost().as_deref(), Some("/"));
    let declare = fake.declare().expect("exchange.declare");
    assert_eq!(
        (
            declare.exchange.as_str(),
            declare.kind.as_str(),
            declare.durable
        ),
        ("pgoutbox_wire", "topic", true)
    );
    assert!(publisher.is_connected());
    assert_eq!(publisher.unsettled(), 0);
    (fake, publisher)
}

/// Publishes messages `tags` and drives the publisher until the fake received all of them;
/// checks that they arrived in order, numbered from `tags.start()` on, with their keys.
/// Nothing may settle meanwhile (the fake sent nothing).
async fn publish_all(
    fake: &FakeBroker,
    publisher: &mut Publisher<u64>,
    tags: std::ops::RangeInclusive<u64>,
) -> Vec<ReceivedPublish> {
    for n in tags.clone() {
        publisher.publish(message(n)).expect("publish");
    }
    let all = drive(publisher, fake.wait_publishes(*tags.end() as usize)).await;
    for p in &all[*tags.start() as usize - 1..] {
        let n = p.delivery_tag;
        assert_eq!(p.lsn, Some(lsn_of(n).to_string()), "publish #{n}");
        assert_eq!(p.message_id, Some(format!("m{n}")), "publish #{n}");
        assert_eq!(p.body, format!("message {n}").into_bytes(), "publish #{n}");
        assert_eq!(p.method.routing_key.as_str(), format!("orders.{n}"));
        assert_eq!(p.method.exchange.as_str(), "pgoutbox_wire");
        assert!(p.method.mandatory, "publish #{n} is not mandatory");
    }
    all
}

/// Polls `recv_outcomes` until `until` completes; panics if anything settles or fails
/// meanwhile.
async fn drive<F: std::future::Future>(publisher: &mut Publisher<u64>, until: F) -> F::Output {
    tokio::select! {
        biased;
        out = until => out,
        got = publisher.recv_outcomes() => panic!("unexpected while waiting: {got:?}"),
    }
}

/// Polls `recv_outcomes` (bounded) until `cond` holds; returns what settled meanwhile.
async fn drive_until(
    publisher: &mut Publisher<u64>,
    what: &str,
    cond: impl Fn(&Publisher<u64>) -> bool,
) -> Outcomes {
    let deadline = tokio::time::Instant::now() + scaled(WAIT);
    let mut got = Vec::new();
    while !cond(publisher) {
        assert!(
            tokio::time::Instant::now() < deadline,
            "not {what} within {:?}; settled meanwhile {got:?}",
            scaled(WAIT)
        );
        match tokio::time::timeout(Duration::from_millis(20), publisher.recv_outcomes()).await {
            Ok(Ok(outcomes)) => got.extend(outcomes),
            Ok(Err(e)) => panic!("publisher failed while waiting for {what}: {e}"),
            Err(_) => {}
        }
    }
    got
}

/// Exactly `n` outcomes, in the order handed out (bounded).
async fn collect(publisher: &mut Publisher<u64>, n: usize) -> Outcomes {
    let mut got = Vec::new();
    let result = tokio::time::timeout(scaled(WAIT), async {
        while got.len() < n {
            match publisher.recv_outcomes().await {
                Ok(outcomes) => got.extend(outcomes),
                Err(e) => return Err(e),
            }
        }
        Ok(())
    })
    .await;
    match result {
        Ok(Ok(())) => {}
        Ok(Err(e)) => panic!("publisher failed after {got:?}: {e}"),
        Err(_) => panic!("no {n} outcomes within {:?}; got {got:?}", scaled(WAIT)),
    }
    assert_eq!(got.len(), n, "more outcomes than expected: {got:?}");
    got
}

/// Every outcome handed out until `recv_outcomes` fails, and that error (bounded by
/// `timeout`).
async fn collect_until_err(publisher: &mut Publisher<u64>, timeout: Duration) -> (Outcomes, Error) {
    let mut got = Vec::new();
    let result = tokio::time::timeout(timeout, async {
        loop {
            match publisher.recv_outcomes().await {
                Ok(outcomes) => got.extend(outcomes),
                Err(e) => return e,
            }
        }
    })
    .await;
    match result {
        Ok(e) => (got, e),
        Err(_) => panic!("the publisher did not fail within {timeout:?}; got {got:?}"),
    }
}

/// Nothing settles and nothing fails for [`QUIET`] (a bounded negative check).
async fn expect_quiet(publisher: &mut Publisher<u64>, after: &str) {
    if let Ok(got) = tokio::time::timeout(QUIET, publisher.recv_outcomes()).await {
        panic!("after {after}, nothing should settle, got {got:?}");
    }
}

fn assert_no_violations(fake: &FakeBroker) {
    assert_eq!(
        fake.violations(),
        Vec::<String>::new(),
        "the publisher broke AMQP framing"
    );
}

/// `basic.return` then its `basic.ack`, first in two writes (with the publisher reading
/// the return alone in between), then in one write.
#[tokio::test]
async fn a_return_then_its_ack_is_returned() {
    let (fake, mut p) = connect(FakeConfig::default()).await;
    let sent = publish_all(&fake, &mut p, 1..=2).await;
    assert_eq!(p.unsettled(), 2);

    fake.send_return(&sent[0], 312, "NO_ROUTE", ReturnContent::AsPublished)
        .await;
    expect_quiet(&mut p, "a return alone").await;
    fake.send_ack(1, false).await;
    assert_eq!(
        collect(&mut p, 1).await,
        vec![(1, returned(312, "NO_ROUTE"))]
    );

    let mut frames = return_frames(
        &sent[1],
        312,
        "NO_ROUTE",
        ReturnContent::AsPublished,
        fake.config().frame_max,
    );
    frames.push(ack(2, false));
    fake.send_frames(&frames).await;
    assert_eq!(
        collect(&mut p, 1).await,
        vec![(2, returned(312, "NO_ROUTE"))]
    );
    assert_eq!(p.unsettled(), 0);
    expect_quiet(&mut p, "everything settled").await;

    tokio::time::timeout(scaled(WAIT), p.close())
        .await
        .expect("close timed out");
    fake.wait_method("connection.close", |m| {
        matches!(m, AMQPClass::Connection(connection::AMQPMethod::Close(c)) if c.reply_code == 200)
    })
    .await;
    assert_no_violations(&fake);
}

/// The ordering: `return(#1), ack(3), ack(1), ack(2)` gives #1 returned and #2, #3
/// routed, in separate writes (settled one by one) and then all in one write.
#[tokio::test]
async fn return_1_then_ack_3_ack_1_ack_2_keeps_1_returned() {
    let (fake, mut p) = connect(FakeConfig::default()).await;
    let sent = publish_all(&fake, &mut p, 1..=3).await;
    fake.send_return(&sent[0], 312, "NO_ROUTE", ReturnContent::AsPublished)
        .await;
    fake.send_ack(3, false).await;
    assert_eq!(collect(&mut p, 1).await, vec![(3, PublishOutcome::Routed)]);
    fake.send_ack(1, false).await;
    assert_eq!(
        collect(&mut p, 1).await,
        vec![(1, returned(312, "NO_ROUTE"))]
    );
    fake.send_ack(2, false).await;
    assert_eq!(collect(&mut p, 1).await, vec![(2, PublishOutcome::Routed)]);

    let sent = publish_all(&fake, &mut p, 4..=6).await;
    let mut frames = return_frames(
        &sent[3],
        312,
        "NO_ROUTE",
        ReturnContent::AsPublished,
        fake.config().frame_max,
    );
    frames.extend([ack(6, false), ack(4, false), ack(5, false)]);
    fake.send_frames(&frames).await;
    assert_eq!(
        collect(&mut p, 3).await,
        vec![
            (6, PublishOutcome::Routed),
            (4, returned(312, "NO_ROUTE")),
            (5, PublishOutcome::Routed),
        ]
    );
    assert_eq!(p.unsettled(), 0);
    assert_no_violations(&fake);
}

/// One `multiple` ack covering two returned tags and routed ones around them.
#[tokio::test]
async fn a_multiple_ack_covering_returned_tags_settles_each_by_its_key() {
    let (fake, mut p) = connect(FakeConfig::default()).await;
    let sent = publish_all(&fake, &mut p, 1..=5).await;
    let frame_max = fake.config().frame_max;
    let mut frames = return_frames(
        &sent[1],
        312,
        "NO_ROUTE",
        ReturnContent::AsPublished,
        frame_max,
    );
    frames.extend(return_frames(
        &sent[2],
        313,
        "NO_CONSUMERS",
        ReturnContent::AsPublished,
        frame_max,
    ));
    frames.push(ack(4, true));
    fake.send_frames(&frames).await;
    assert_eq!(
        collect(&mut p, 4).await,
        vec![
            (1, PublishOutcome::Routed),
            (2, returned(312, "NO_ROUTE")),
            (3, returned(313, "NO_CONSUMERS")),
            (4, PublishOutcome::Routed),
        ]
    );
    assert_eq!(p.unsettled(), 1);
    // A later multiple ack repeating settled tags settles only #5.
    fake.send_ack(5, true).await;
    assert_eq!(collect(&mut p, 1).await, vec![(5, PublishOutcome::Routed)]);
    assert_eq!(p.unsettled(), 0);
    assert_no_violations(&fake);
}

/// `nack(4, multiple)` after `ack(2)` alone: #1, #3 (returned before) and #4 nacked, #2 and
/// #5 routed.
#[tokio::test]
async fn a_multiple_nack_settles_every_unsettled_tag_up_to_it_as_nacked() {
    let (fake, mut p) = connect(FakeConfig::default()).await;
    let sent = publish_all(&fake, &mut p, 1..=5).await;
    fake.send_ack(2, false).await;
    assert_eq!(collect(&mut p, 1).await, vec![(2, PublishOutcome::Routed)]);
    fake.send_return(&sent[2], 312, "NO_ROUTE", ReturnContent::AsPublished)
        .await;
    fake.send_nack(4, true).await;
    assert_eq!(
        collect(&mut p, 3).await,
        vec![
            (1, PublishOutcome::Nacked),
            (3, PublishOutcome::Nacked),
            (4, PublishOutcome::Nacked),
        ]
    );
    fake.send_ack(5, false).await;
    assert_eq!(collect(&mut p, 1).await, vec![(5, PublishOutcome::Routed)]);
    assert_eq!(p.unsettled(), 0);
    assert_no_violations(&fake);
}

/// After a protocol error nothing settles and nothing can be published.
async fn assert_settles_nothing_more(fake: &FakeBroker, p: &mut Publisher<u64>) {
    let again = tokio::time::timeout(scaled(WAIT), p.recv_outcomes())
        .await
        .expect("recv_outcomes after the protocol error did not return");
    assert!(
        matches!(again, Err(Error::Protocol(_))),
        "after a protocol error recv_outcomes must keep failing, got {again:?}"
    );
    assert!(
        p.publish(message(99)).is_err(),
        "publish after a protocol error must fail"
    );
    assert_no_violations(fake);
}

/// A return without our `x-pgoutbox-lsn` header (its `message_id` still there) cannot be
/// matched: `Err(Error::Protocol)`, and the acks in the same write settle nothing.
#[tokio::test]
async fn a_return_without_our_header_is_a_protocol_error_and_settles_nothing_after_it() {
    let (fake, mut p) = connect(FakeConfig::default()).await;
    let sent = publish_all(&fake, &mut p, 1..=3).await;
    fake.send_ack(1, false).await;
    assert_eq!(collect(&mut p, 1).await, vec![(1, PublishOutcome::Routed)]);
    let mut frames = return_frames(
        &sent[1],
        312,
        "NO_ROUTE",
        ReturnContent::WithoutLsnHeader,
        fake.config().frame_max,
    );
    frames.extend([ack(2, false), ack(3, false)]);
    fake.send_frames(&frames).await;
    let (got, e) = collect_until_err(&mut p, scaled(WAIT)).await;
    assert_eq!(got, Vec::new(), "nothing may settle after the bad return");
    assert!(matches!(e, Error::Protocol(_)), "{e:?}");
    assert_settles_nothing_more(&fake, &mut p).await;
}

/// A return whose key matches no publish (an LSN never published), read alone:
/// `Err(Error::Protocol)` at once, and the acks sent after it settle nothing.
#[tokio::test]
async fn a_return_matching_nothing_is_a_protocol_error_and_settles_nothing_after_it() {
    let (fake, mut p) = connect(FakeConfig::default()).await;
    let sent = publish_all(&fake, &mut p, 1..=3).await;
    fake.send_return(
        &sent[0],
        312,
        "NO_ROUTE",
        ReturnContent::LsnHeader("0/DEAD".into()),
    )
    .await;
    let (got, e) = collect_until_err(&mut p, scaled(WAIT)).await;
    assert_eq!(got, Vec::new());
    assert!(
        matches!(&e, Error::Protocol(text) if text.contains("0/DEAD")),
        "{e:?}"
    );
    fake.send_ack(3, true).await;
    assert_settles_nothing_more(&fake, &mut p).await;
}

/// A return of a publish already acked (the broker broke "return before ack") matches no
/// unsettled publish: `Err(Error::Protocol)`, and the ack of #2 in the same write settles
/// nothing.
#[tokio::test]
async fn a_return_after_its_own_ack_is_a_protocol_error() {
    let (fake, mut p) = connect(FakeConfig::default()).await;
    let sent = publish_all(&fake, &mut p, 1..=2).await;
    fake.send_ack(1, false).await;
    assert_eq!(collect(&mut p, 1).await, vec![(1, PublishOutcome::Routed)]);
    let mut frames = return_frames(
        &sent[0],
        312,
        "NO_ROUTE",
        ReturnContent::AsPublished,
        fake.config().frame_max,
    );
    frames.push(ack(2, false));
    fake.send_frames(&frames).await;
    let (got, e) = collect_until_err(&mut p, scaled(WAIT)).await;
    assert_eq!(got, Vec::new());
    assert!(matches!(e, Error::Protocol(_)), "{e:?}");
    assert_settles_nothing_more(&fake, &mut p).await;
}

/// Messages keyed by `message_id` (`--publish-properties minimal`: no header of ours): a
/// return carrying id `a` marks every unsettled publish with that id (a duplicate is
/// acceptable, a loss is not), and one multiple ack settles them as returned.
#[tokio::test]
async fn returns_of_messages_keyed_by_message_id_mark_every_publish_with_that_id() {
    let (fake, mut p) = connect(FakeConfig::default()).await;
    for (n, id) in [(1, "a"), (2, "b"), (3, "a")] {
        p.publish(OutboundMessage {
            tag: n,
            exchange: pgoutbox::publisher::Exchange::Configured,
            routing_key: ShortString::from(format!("orders.{n}")),
            body: format!("message {n}").into_bytes().into(),
            properties: BasicProperties::default()
                .with_message_id(id.into())
                .with_delivery_mode(2),
            match_key: MatchKey::MessageId(id.into()),
        })
        .expect("publish");
    }
    let sent = drive(&mut p, fake.wait_publishes(3)).await;
    assert!(sent.iter().all(|s| s.lsn.is_none()), "{sent:?}");
    let mut frames = return_frames(
        &sent[0],
        312,
        "NO_ROUTE",
        ReturnContent::AsPublished,
        fake.config().frame_max,
    );
    frames.push(ack(3, true));
    fake.send_frames(&frames).await;
    assert_eq!(
        collect(&mut p, 3).await,
        vec![
            (1, returned(312, "NO_ROUTE")),
            (2, PublishOutcome::Routed),
            (3, returned(312, "NO_ROUTE")),
        ]
    );
    assert_no_violations(&fake);
}

/// An ack of a tag never published, or of one already settled, breaks the protocol:
/// `Err(Error::Protocol)`, nothing settled.
#[tokio::test]
async fn an_ack_of_an_unknown_or_settled_tag_is_a_protocol_error() {
    let (fake, mut p) = connect(FakeConfig::default()).await;
    publish_all(&fake, &mut p, 1..=2).await;
    fake.send_frames(&[ack(3, false), ack(2, true)]).await;
    let (got, e) = collect_until_err(&mut p, scaled(WAIT)).await;
    assert_eq!(got, Vec::new());
    assert!(
        matches!(&e, Error::Protocol(text) if text.contains("delivery tag 3")),
        "{e:?}"
    );
    assert_settles_nothing_more(&fake, &mut p).await;

    let (fake, mut p) = connect(FakeConfig::default()).await;
    publish_all(&fake, &mut p, 1..=2).await;
    fake.send_ack(1, false).await;
    assert_eq!(collect(&mut p, 1).await, vec![(1, PublishOutcome::Routed)]);
    fake.send_frames(&[ack(1, false), ack(2, false)]).await;
    let (got, e) = collect_until_err(&mut p, scaled(WAIT)).await;
    assert_eq!(got, Vec::new());
    assert!(
        matches!(&e, Error::Protocol(text) if text.contains("delivery tag 1")),
        "{e:?}"
    );
    assert_settles_nothing_more(&fake, &mut p).await;
}

/// An ack, a nack or a return on a channel pgoutbox never published on carries delivery
/// tags that are not ours: `Err(Error::Protocol)` naming the channel, and nothing settles
/// (not even the publish whose tag it names on channel 1).
#[tokio::test]
async fn settling_frames_on_another_channel_are_a_protocol_error() {
    let on = |channel: u16, frame: AMQPFrame| match frame {
        AMQPFrame::Method(_, class) => AMQPFrame::Method(channel, class),
        AMQPFrame::Header(_, h) => AMQPFrame::Header(channel, h),
        AMQPFrame::Body(_, b) => AMQPFrame::Body(channel, b),
        other => other,
    };
    for (case, what) in [(0, "basic.ack"), (1, "basic.nack"), (2, "basic.return")] {
        let (fake, mut p) = connect(FakeConfig::default()).await;
        let sent = publish_all(&fake, &mut p, 1..=2).await;
        let frames: Vec<AMQPFrame> = match case {
            0 => vec![on(3, ack(1, false))],
            1 => vec![on(7, nack(2, true))],
            _ => return_frames(
                &sent[0],
                312,
                "NO_ROUTE",
                ReturnContent::AsPublished,
                fake.config().frame_max,
            )
            .into_iter()
            .map(|f| on(9, f))
            .collect(),
        };
        fake.send_frames(&frames).await;
        let (got, e) = collect_until_err(&mut p, scaled(WAIT)).await;
        assert_eq!(got, Vec::new(), "{what}: nothing may settle");
        assert!(
            matches!(&e, Error::Protocol(text) if text.contains(what) && text.contains("channel")),
            "{what}: {e:?}"
        );
        fake.send_ack(2, true).await;
        assert_settles_nothing_more(&fake, &mut p).await;
    }
}

/// `Publisher::close` ends at the broker's `connection.close-ok`, not at its EOF: RabbitMQ
/// keeps the socket open for the client to close, and waiting for the EOF cost every
/// SIGTERM of `run` the whole close bound (issue 21 item 14: 2.0 s between "draining
/// confirms" and "stopped"). The fake here keeps the socket open after close-ok.
#[tokio::test]
async fn close_ends_at_close_ok_while_the_broker_keeps_the_socket_open() {
    let (fake, mut p) = connect(FakeConfig {
        keep_socket_after_close_ok: true,
        ..FakeConfig::default()
    })
    .await;
    publish_all(&fake, &mut p, 1..=1).await;
    fake.send_ack(1, false).await;
    assert_eq!(collect(&mut p, 1).await, vec![(1, PublishOutcome::Routed)]);
    let closed = tokio::time::timeout(scaled(WAIT) * 4, p.close()).await;
    assert!(
        closed.is_ok(),
        "close() still waiting for EOF {:?} after the broker's close-ok",
        scaled(WAIT) * 4
    );
    fake.wait_method("connection.close", |m| {
        matches!(m, AMQPClass::Connection(connection::AMQPMethod::Close(_)))
    })
    .await;
    assert_no_violations(&fake);
}

/// The same for a connection opened by `connection::open` alone (what `pgoutbox check` does
/// to check the exchange): its `close` ends at the broker's `close-ok`. It waited for the end
/// of the stream, and every `check` against RabbitMQ took its whole 10 s bound.
#[tokio::test]
async fn an_opened_connection_closes_at_close_ok_while_the_broker_keeps_the_socket_open() {
    let fake = FakeBroker::start(FakeConfig {
        keep_socket_after_close_ok: true,
        ..FakeConfig::default()
    })
    .await;
    let endpoint = pgoutbox::publisher::socket::Endpoint::parse(&fake.url()).expect("url");
    let opened = tokio::time::timeout(
        scaled(WAIT),
        pgoutbox::publisher::connection::open(
            &endpoint,
            "pgoutbox_wire",
            pgoutbox::publisher::connection::Declare::Passive,
            "pgoutbox check",
        ),
    )
    .await
    .expect("open timed out")
    .expect("open");
    let closed = tokio::time::timeout(scaled(WAIT) * 4, opened.close()).await;
    assert!(
        closed.is_ok(),
        "Opened::close still waiting for EOF {:?} after the broker's close-ok",
        scaled(WAIT) * 4
    );
    fake.wait_method("connection.close", |m| {
        matches!(m, AMQPClass::Connection(connection::AMQPMethod::Close(_)))
    })
    .await;
    assert_no_violations(&fake);
}

/// `channel.close` 406 with four publishes out, #1 acked and #3 returned but not acked:
/// #2, #3 and #4 fail with the broker's text, the publisher answers `channel.close-ok`, and
/// later calls return `Error::Lost`.
#[tokio::test]
async fn a_channel_close_406_mid_window_fails_every_unsettled_tag() {
    let (fake, mut p) = connect(FakeConfig::default()).await;
    let sent = publish_all(&fake, &mut p, 1..=4).await;
    fake.send_ack(1, false).await;
    assert_eq!(collect(&mut p, 1).await, vec![(1, PublishOutcome::Routed)]);
    fake.send_return(&sent[2], 312, "NO_ROUTE", ReturnContent::AsPublished)
        .await;
    let text =
        "PRECONDITION_FAILED - message size 200000 is larger than configured max size 131072";
    fake.send_channel_close(406, text).await;
    let (got, e) = collect_until_err(&mut p, scaled(WAIT)).await;
    let tags: Vec<u64> = got.iter().map(|(t, _)| *t).collect();
    assert_eq!(tags, vec![2, 3, 4], "{got:?}");
    for (tag, outcome) in &got {
        match outcome {
            PublishOutcome::Failed(f) => assert!(
                matches!(
                    &f.cause,
                    FailureCause::ChannelClosed { reply_code: 406, reply_text, .. }
                        if reply_text.contains("PRECONDITION_FAILED")
                ),
                "#{tag}: {f:?}"
            ),
            other => panic!("#{tag} must be Failed, got {other:?}"),
        }
    }
    assert!(matches!(e, Error::Lost(_)), "{e:?}");
    assert!(!p.is_connected());
    assert_eq!(p.unsettled(), 0);
    // The spec (channel.close, section 1.5.2.5) asks for channel.close-ok in reply.
    let close_ok = tokio::time::timeout(scaled(WAIT), async {
        tokio::join!(fake.wait_channel_close_ok(), async {
            let _ = tokio::time::timeout(QUIET, p.recv_outcomes()).await;
        })
    })
    .await;
    assert!(
        close_ok.is_ok(),
        "no channel.close-ok; methods {:?}",
        fake.methods()
    );
    assert_no_violations(&fake);
}

/// `connection.close` 320 from the broker with three publishes out, #1 acked: #2 and #3 fail
/// with the broker's text, the publisher answers `connection.close-ok`, and later calls
/// return `Error::Lost`.
#[tokio::test]
async fn a_connection_close_mid_window_fails_every_unsettled_tag() {
    let (fake, mut p) = connect(FakeConfig::default()).await;
    publish_all(&fake, &mut p, 1..=3).await;
    fake.send_ack(1, false).await;
    assert_eq!(collect(&mut p, 1).await, vec![(1, PublishOutcome::Routed)]);
    let text = "CONNECTION_FORCED - broker forced connection closure with reason 'shutdown'";
    fake.send_connection_close(320, text).await;
    let (got, e) = collect_until_err(&mut p, scaled(WAIT)).await;
    let tags: Vec<u64> = got.iter().map(|(t, _)| *t).collect();
    assert_eq!(tags, vec![2, 3], "{got:?}");
    for (tag, outcome) in &got {
        match outcome {
            PublishOutcome::Failed(f) => assert!(
                matches!(
                    &f.cause,
                    FailureCause::ConnectionClosed { reply_code: 320, reply_text }
                        if reply_text.contains("CONNECTION_FORCED")
                ),
                "#{tag}: {f:?}"
            ),
            other => panic!("#{tag} must be Failed, got {other:?}"),
        }
    }
    assert!(matches!(e, Error::Lost(_)), "{e:?}");
    assert!(!p.is_connected());
    // The spec (connection.close, section 1.4.2.8) asks for connection.close-ok in reply.
    let close_ok = tokio::time::timeout(scaled(WAIT), async {
        tokio::join!(
            fake.wait_method("connection.close-ok", |m| {
                matches!(m, AMQPClass::Connection(connection::AMQPMethod::CloseOk(_)))
            }),
            async {
                let _ = tokio::time::timeout(QUIET, p.recv_outcomes()).await;
            }
        )
    })
    .await;
    assert!(
        close_ok.is_ok(),
        "no connection.close-ok; methods {:?}",
        fake.methods()
    );
    fake.wait_closed().await;
    assert_no_violations(&fake);
}

/// Frames cut across writes at awkward points (inside a return's content header, inside an
/// ack) are reassembled: the publisher settles only once a frame is complete.
#[tokio::test]
async fn frames_split_across_writes_are_reassembled() {
    let (fake, mut p) = connect(FakeConfig::default()).await;
    let sent = publish_all(&fake, &mut p, 1..=2).await;
    let mut frames = return_frames(
        &sent[0],
        312,
        "NO_ROUTE",
        ReturnContent::AsPublished,
        fake.config().frame_max,
    );
    frames.push(ack(1, false));
    let mut bytes = encode_frames(&frames);
    let ack_len = encode_frames(&[ack(1, false)]).len();
    // Cut 1: inside the return's content header; cut 2: 5 bytes into the ack.
    let cut1 = 40;
    let cut2 = bytes.len() - ack_len + 5;
    let tail = bytes.split_off(cut2);
    let middle = bytes.split_off(cut1);
    fake.send_raw(bytes).await;
    expect_quiet(&mut p, "half a return").await;
    fake.send_raw(middle).await;
    expect_quiet(&mut p, "a return and 5 bytes of an ack").await;
    fake.send_raw(tail).await;
    assert_eq!(
        collect(&mut p, 1).await,
        vec![(1, returned(312, "NO_ROUTE"))]
    );
    // One byte at a time.
    for byte in encode_frames(&[ack(2, false)]) {
        fake.send_raw(vec![byte]).await;
    }
    assert_eq!(collect(&mut p, 1).await, vec![(2, PublishOutcome::Routed)]);
    assert_no_violations(&fake);
}

/// `connection.blocked` then `connection.unblocked`: `is_blocked()` (and the blocked
/// signal) follow; nothing settles while blocked; afterwards publishing resumes and acks
/// settle.
#[tokio::test]
async fn blocked_then_unblocked_is_reported_and_publishing_resumes() {
    let fake = FakeBroker::start(FakeConfig::default()).await;
    let config = publisher_config(&fake);
    let signals = config.signals.clone();
    let mut p = tokio::time::timeout(scaled(WAIT), Publisher::<u64>::connect(&config))
        .await
        .expect("connect timed out")
        .expect("connect");
    fake.wait_ready().await;
    publish_all(&fake, &mut p, 1..=1).await;
    assert!(!p.is_blocked());

    fake.send_blocked("low on memory").await;
    let got = drive_until(&mut p, "blocked", |p| p.is_blocked()).await;
    assert_eq!(got, Vec::new());
    assert!(signals.blocked.load(std::sync::atomic::Ordering::Relaxed));
    assert!(p.is_connected());
    p.publish(message(2)).expect("publish while blocked");
    expect_quiet(&mut p, "connection.blocked").await;

    fake.send_unblocked().await;
    let got = drive_until(&mut p, "unblocked", |p| !p.is_blocked()).await;
    assert_eq!(got, Vec::new());
    assert!(!signals.blocked.load(std::sync::atomic::Ordering::Relaxed));
    drive(&mut p, fake.wait_publishes(2)).await;
    fake.send_ack(2, true).await;
    assert_eq!(
        collect(&mut p, 2).await,
        vec![(1, PublishOutcome::Routed), (2, PublishOutcome::Routed)]
    );
    publish_all(&fake, &mut p, 3..=3).await;
    fake.send_ack(3, false).await;
    assert_eq!(collect(&mut p, 1).await, vec![(3, PublishOutcome::Routed)]);
    assert_no_violations(&fake);
}

/// `frame_max` 4096 (the spec's minimum), smaller than one message: every frame the
/// publisher sends is at most 4096 bytes, bodies are split into 4088-byte frames and arrive
/// byte-exact (10,000 bytes, exactly one frame, one byte more, empty); a multi-frame
/// return of the big one is read and settles it as returned.
#[tokio::test]
async fn a_frame_max_smaller_than_one_message_splits_bodies_byte_exact() {
    let (fake, mut p) = connect(FakeConfig {
        frame_max: 4096,
        ..FakeConfig::default()
    })
    .await;
    assert_eq!(p.frame_max(), 4096);
    assert_eq!(fake.tune_ok().expect("tune-ok").frame_max, 4096);
    let pattern = |len: usize| -> Vec<u8> { (0..len).map(|i| (i * 7 % 251) as u8).collect() };
    let bodies = [pattern(10_000), pattern(4088), pattern(4089), Vec::new()];
    for (i, body) in bodies.iter().enumerate() {
        p.publish(message_with_body(i as u64 + 1, body.clone()))
            .expect("publish");
    }
    let sent = drive(&mut p, fake.wait_publishes(4)).await;
    let frames: Vec<usize> = sent.iter().map(|s| s.body_frames).collect();
    assert_eq!(frames, vec![3, 1, 2, 0]);
    for (s, body) in sent.iter().zip(&bodies) {
        assert_eq!(s.header.body_size, body.len() as u64, "#{}", s.delivery_tag);
        assert!(s.body == *body, "#{}: body differs", s.delivery_tag);
        assert_eq!(s.lsn, Some(lsn_of(s.delivery_tag).to_string()));
    }
    assert_eq!(fake.largest_frame(), 4096);
    assert_no_violations(&fake);

    fake.send_return(&sent[0], 312, "NO_ROUTE", ReturnContent::AsPublished)
        .await;
    fake.send_ack(4, true).await;
    assert_eq!(
        collect(&mut p, 4).await,
        vec![
            (1, returned(312, "NO_ROUTE")),
            (2, PublishOutcome::Routed),
            (3, PublishOutcome::Routed),
            (4, PublishOutcome::Routed),
        ]
    );
}

/// The socket closes after `return(#1)` and before its ack (#2 acked before): #1 and #3
/// fail, #1 is never routed; then `Error::Lost`.
#[tokio::test]
async fn the_socket_closed_between_a_return_and_its_ack_fails_the_returned_tag() {
    let (fake, mut p) = connect(FakeConfig::default()).await;
    let sent = publish_all(&fake, &mut p, 1..=3).await;
    fake.send_ack(2, false).await;
    assert_eq!(collect(&mut p, 1).await, vec![(2, PublishOutcome::Routed)]);
    fake.send_return(&sent[0], 312, "NO_ROUTE", ReturnContent::AsPublished)
        .await;
    expect_quiet(&mut p, "a return alone").await;
    fake.close_socket().await;
    let (got, e) = collect_until_err(&mut p, scaled(WAIT)).await;
    let tags: Vec<u64> = got.iter().map(|(t, _)| *t).collect();
    assert_eq!(tags, vec![1, 3], "{got:?}");
    assert!(
        got.iter()
            .all(|(_, o)| matches!(o, PublishOutcome::Failed(_))),
        "{got:?}"
    );
    assert!(matches!(e, Error::Lost(_)), "{e:?}");
    assert!(!p.is_connected());
    assert!(p.publish(message(4)).is_err());
    assert_no_violations(&fake);
}

/// Heartbeat 1 s. While idle the publisher sends heartbeats and stays up as long as the fake
/// sends its own; once the fake stops, the publisher fails within 2–4 s with a heartbeat
/// error, #2 failed.
#[tokio::test]
async fn a_broker_that_stops_heartbeats_is_declared_dead() {
    let (fake, mut p) = connect(FakeConfig {
        heartbeat: 1,
        ..FakeConfig::default()
    })
    .await;
    assert_eq!(p.heartbeat(), Some(Duration::from_secs(1)));
    assert_eq!(fake.tune_ok().expect("tune-ok").heartbeat, 1);

    // Idle, the fake's heartbeats flowing: ours arrive, and the publisher stays up for
    // longer than its dead-peer timeout.
    let idle = drive(&mut p, async {
        let got = fake
            .wait_heartbeats(3, scaled(Duration::from_secs(3)))
            .await;
        tokio::time::sleep(Duration::from_millis(2500)).await;
        got
    })
    .await;
    assert!(
        idle,
        "fewer than 3 heartbeats from the publisher in 3 s idle: {}",
        fake.heartbeats_received()
    );
    assert!(p.is_connected());
    publish_all(&fake, &mut p, 1..=1).await;
    fake.send_ack(1, false).await;
    assert_eq!(collect(&mut p, 1).await, vec![(1, PublishOutcome::Routed)]);

    publish_all(&fake, &mut p, 2..=2).await;
    let before = fake.heartbeats_received();
    fake.stop_heartbeats();
    let stopped = tokio::time::Instant::now();
    let (got, e) = collect_until_err(&mut p, scaled(Duration::from_secs(6))).await;
    let elapsed = stopped.elapsed();
    eprintln!(
        "heartbeats stopped: publisher failed after {elapsed:?}; heartbeats received from it: {} before, {} after",
        before,
        fake.heartbeats_received()
    );
    assert!(
        elapsed >= Duration::from_millis(1500) && elapsed <= scaled(Duration::from_secs(4)),
        "declared dead after {elapsed:?}"
    );
    assert_eq!(got.len(), 1, "{got:?}");
    match &got[0] {
        (2, PublishOutcome::Failed(f)) => assert!(
            matches!(&f.cause, FailureCause::ConnectionLost(t) if t.contains("heartbeat")),
            "{f:?}"
        ),
        other => panic!("#2 must fail, got {other:?}"),
    }
    assert!(
        matches!(&e, Error::Lost(text) if text.contains("heartbeat")),
        "{e:?}"
    );
    assert!(
        fake.heartbeats_received() > before,
        "the publisher stopped sending heartbeats"
    );
    assert_no_violations(&fake);
}

/// `connection.close` 403 in answer to start-ok: `Error::Refused` with 403.
#[tokio::test]
async fn a_refused_login_is_error_refused_403() {
    let fake = FakeBroker::start(FakeConfig {
        script: Script::RefuseLogin,
        ..FakeConfig::default()
    })
    .await;
    let result = tokio::time::timeout(
        scaled(WAIT),
        Publisher::<u64>::connect(&publisher_config(&fake)),
    )
    .await
    .expect("connect timed out");
    match result {
        Err(Error::Refused {
            reply_code: 403,
            reply_text,
            ..
        }) => assert!(reply_text.contains("ACCESS_REFUSED"), "{reply_text}"),
        other => panic!("expected Error::Refused 403, got {other:?}"),
    }
    assert_no_violations(&fake);
}

/// `connection.close` 530 in answer to connection.open: `Error::Refused` with 530.
#[tokio::test]
async fn a_refused_vhost_is_error_refused_530() {
    let fake = FakeBroker::start(FakeConfig {
        script: Script::RefuseVhost,
        ..FakeConfig::default()
    })
    .await;
    let result = tokio::time::timeout(
        scaled(WAIT),
        Publisher::<u64>::connect(&publisher_config(&fake)),
    )
    .await
    .expect("connect timed out");
    assert!(
        matches!(
            result,
            Err(Error::Refused {
                reply_code: 530,
                ..
            })
        ),
        "expected Error::Refused 530, got {result:?}"
    );
    assert_no_violations(&fake);
}

/// `channel.close` 406 in answer to exchange.declare: `Error::Declare` with 406.
#[tokio::test]
async fn a_406_on_exchange_declare_is_error_declare() {
    let fake = FakeBroker::start(FakeConfig {
        script: Script::RefuseDeclare,
        ..FakeConfig::default()
    })
    .await;
    let result = tokio::time::timeout(
        scaled(WAIT),
        Publisher::<u64>::connect(&publisher_config(&fake)),
    )
    .await
    .expect("connect timed out");
    match result {
        Err(Error::Declare {
            exchange,
            reply_code: 406,
            reply_text,
        }) => {
            assert_eq!(exchange, "pgoutbox_wire");
            assert!(reply_text.contains("PRECONDITION_FAILED"), "{reply_text}");
        }
        other => panic!("expected Error::Declare 406, got {other:?}"),
    }
    assert_no_violations(&fake);
}
