//! Exact AMQP frame orderings against the publisher, played by the scripted fake broker
//! (`support::fake_broker`), issue 12 "Tests".
//!
//! The first test checks the fake itself against lapin, a client that is not ours: if lapin
//! can connect, enable confirms, declare, publish and see the fake's ack and return, the fake
//! speaks AMQP 0-9-1 well enough for its verdicts on our publisher to count.

use std::time::Duration;

use lapin::options::{BasicPublishOptions, ConfirmSelectOptions, ExchangeDeclareOptions};

use lapin::types::{AMQPValue, FieldTable, ShortString};
use lapin::{BasicProperties, Confirmation, Connection, ConnectionProperties, ExchangeKind};

use crate::support::fake_broker::{FakeBroker, FakeConfig, ReturnContent, LSN_HEADER};
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

/// The fake against lapin: handshake, confirm.select, exchange.declare, a publish the fake
/// acks (lapin's confirm resolves as a plain ack), and a publish the fake returns and then
/// acks (lapin's confirm carries the returned message, headers and body intact).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_fake_broker_speaks_amqp_to_lapin() {
    let fake = FakeBroker::start(FakeConfig::default()).await;
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

    let publish = |body: &'static [u8], lsn: &'static str, id: &'static str| {
        let ch = ch.clone();
        async move {
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
    };

    let first = publish(b"first", "0/10", "m1").await;
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

    let second = publish(b"second", "0/20", "m2").await;
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

    tokio::time::timeout(scaled(WAIT), conn.close(200, "bye".into()))
        .await
        .expect("lapin close timed out")
        .expect("connection.close");
    fake.wait_closed().await;
    assert!(
        fake.methods().iter().any(|(_, m)| matches!(
            m,
            lapin::protocol::AMQPClass::Connection(lapin::protocol::connection::AMQPMethod::Close(
                _
            ))
        )),
        "{:?}",
        fake.methods()
    );
    assert_eq!(fake.violations(), Vec::<String>::new());
}
