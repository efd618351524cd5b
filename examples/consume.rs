//! Demo consumer: declares a durable queue bound to the pgoutbox exchange with `#`, then
//! prints each message (id, routing key, LSN headers, body) and acks it.
//!
//! `cargo run --example consume -- AMQP_URL [EXCHANGE] [QUEUE] [COUNT] [TIMEOUT_S]`
//! exits after COUNT messages or TIMEOUT_S seconds without one (defaults: pgoutbox,
//! pgoutbox-demo, unlimited, 10).

use std::time::Duration;

use futures::StreamExt;
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, ExchangeDeclareOptions, QueueBindOptions,
    QueueDeclareOptions,
};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{Connection, ConnectionProperties, ExchangeKind};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let url = args
        .get(1)
        .cloned()
        .or_else(|| std::env::var("PGOUTBOX_AMQP_URL").ok())
        .ok_or("usage: consume AMQP_URL [EXCHANGE] [QUEUE] [COUNT] [TIMEOUT_S]")?;
    let exchange = args.get(2).cloned().unwrap_or_else(|| "pgoutbox".into());
    let queue = args
        .get(3)
        .cloned()
        .unwrap_or_else(|| "pgoutbox-demo".into());
    let count: usize = args
        .get(4)
        .and_then(|c| c.parse().ok())
        .unwrap_or(usize::MAX);
    let timeout = Duration::from_secs(args.get(5).and_then(|t| t.parse().ok()).unwrap_or(10));
    tokio::runtime::Runtime::new()?.block_on(async move {
        let conn = Connection::connect(&url, ConnectionProperties::default()).await?;
        let ch = conn.create_channel().await?;
        ch.exchange_declare(
            exchange.as_str().into(),
            ExchangeKind::Topic,
            ExchangeDeclareOptions {
                durable: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await?;
        ch.queue_declare(
            queue.as_str().into(),
            QueueDeclareOptions::durable(),
            FieldTable::default(),
        )
        .await?;
        ch.queue_bind(
            queue.as_str().into(),
            exchange.as_str().into(),
            "#".into(),
            QueueBindOptions::default(),
            FieldTable::default(),
        )
        .await?;
        println!("consuming from queue {queue} bound to exchange {exchange} with '#'");
        let mut consumer = ch
            .basic_consume(
                queue.as_str().into(),
                "demo".into(),
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await?;
        let mut seen = 0;
        while seen < count {
            let Ok(Some(delivery)) = tokio::time::timeout(timeout, consumer.next()).await else {
                break;
            };
            let delivery = delivery?;
            let header = |k: &str| {
                delivery
                    .properties
                    .headers()
                    .as_ref()
                    .and_then(|h| h.inner().get(k).cloned())
                    .map(|v| match v {
                        AMQPValue::LongString(s) => {
                            String::from_utf8_lossy(s.as_bytes()).into_owned()
                        }
                        other => format!("{other:?}"),
                    })
                    .unwrap_or_default()
            };
            println!(
                "{} id={} lsn={} commit_lsn={} body={}",
                delivery.routing_key,
                delivery
                    .properties
                    .message_id()
                    .as_ref()
                    .map(|m| m.as_str())
                    .unwrap_or("-"),
                header("x-pgoutbox-lsn"),
                header("x-pgoutbox-commit-lsn"),
                String::from_utf8_lossy(&delivery.data)
            );
            delivery.ack(BasicAckOptions::default()).await?;
            seen += 1;
        }
        println!("received {seen} messages");
        Ok(())
    })
}
