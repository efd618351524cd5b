//! What each way of encoding pgoutbox's own message properties costs the broker: publishes
//! the same backlog in several shapes, alternating, through pgoutbox's own publisher
//! (persistent, mandatory, confirms, window 10,000) to a durable queue, and prints msg/s and
//! RabbitMQ CPU µs per message for each.
//!
//! ```sh
//! cargo run --release --example header_cost -- AMQP_URL RABBITMQ_BEAM_PID [N] [ROUNDS]
//! ```
//!
//! Shapes: `full-text` (today: message_id, content_type, timestamp, `x-pgoutbox-lsn` and
//! `x-pgoutbox-commit-lsn` as `X/Y` text, `x-pgoutbox-commit-time-us` as i64), `full-int`
//! (the two LSN headers as i64), `one-header` (one `x-pgoutbox` text header `lsn;commit;us`),
//! and `minimal` (delivery_mode and message_id only). A measurement tool, not part of the
//! product; it declares and deletes its own exchange and queue.

use std::time::Instant;

use amq_protocol::protocol::BasicProperties;
use amq_protocol::types::{AMQPValue, FieldTable, LongString, ShortString};
use lapin::options::{QueueBindOptions, QueueDeclareOptions, QueueDeleteOptions};
use lapin::{Connection, ConnectionProperties};
use pgoutbox::lsn::Lsn;
use pgoutbox::publisher::{MatchKey, OutboundMessage, PublishOutcome, Publisher, PublisherConfig};

const WINDOW: u64 = 10_000;
const SHAPES: [&str; 4] = ["full-text", "full-int", "one-header", "minimal"];

fn cpu_secs(pid: &str) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    let fields: Vec<&str> = stat
        .rsplit_once(')')
        .map(|(_, r)| r.split_whitespace().collect())
        .unwrap_or_default();
    let ticks: f64 = fields
        .get(11..13)
        .map(|f| f.iter().filter_map(|v| v.parse::<f64>().ok()).sum())
        .unwrap_or(0.0);
    ticks / 100.0
}

fn props(shape: &str, i: u64) -> (BasicProperties, MatchKey) {
    let lsn = 0x1000_0000 + i * 400;
    let id: ShortString = format!("id-{i}").into();
    let now_us = 1_764_600_000_000_000i64 + i as i64;
    let base = BasicProperties::default()
        .with_delivery_mode(2)
        .with_message_id(id.clone());
    let full = |h: FieldTable| {
        base.clone()
            .with_content_type("application/json".into())
            .with_timestamp((now_us / 1_000_000) as u64)
            .with_headers(h)
    };
    let mut h = FieldTable::default();
    match shape {
        "full-text" => {
            h.insert(
                "x-pgoutbox-lsn".into(),
                AMQPValue::LongString(LongString::from(Lsn(lsn).to_string())),
            );
            h.insert(
                "x-pgoutbox-commit-lsn".into(),
                AMQPValue::LongString(LongString::from(Lsn(lsn + 64).to_string())),
            );
            h.insert(
                "x-pgoutbox-commit-time-us".into(),
                AMQPValue::LongLongInt(now_us),
            );
            (full(h), MatchKey::Lsn(Lsn(lsn)))
        }
        "full-int" => {
            h.insert("x-pgoutbox-lsn".into(), AMQPValue::LongLongInt(lsn as i64));
            h.insert(
                "x-pgoutbox-commit-lsn".into(),
                AMQPValue::LongLongInt(lsn as i64 + 64),
            );
            h.insert(
                "x-pgoutbox-commit-time-us".into(),
                AMQPValue::LongLongInt(now_us),
            );
            (full(h), MatchKey::MessageId(id))
        }
        "one-header" => {
            let v = format!("{};{};{now_us}", Lsn(lsn), Lsn(lsn + 64));
            h.insert(
                "x-pgoutbox".into(),
                AMQPValue::LongString(LongString::from(v)),
            );
            (full(h), MatchKey::MessageId(id))
        }
        _ => (base, MatchKey::MessageId(id)),
    }
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), String> {
    let args: Vec<String> = std::env::args().collect();
    let (Some(url), Some(beam)) = (args.get(1), args.get(2)) else {
        return Err("usage: header_cost AMQP_URL RABBITMQ_BEAM_PID [N] [ROUNDS]".into());
    };
    let n: u64 = args.get(3).and_then(|s| s.parse().ok()).unwrap_or(100_000);
    let rounds: u32 = args.get(4).and_then(|s| s.parse().ok()).unwrap_or(2);
    let exchange = format!("header_cost_{}", std::process::id());
    let queue = format!("{exchange}_q");
    let conn = Connection::connect(url, ConnectionProperties::default())
        .await
        .map_err(|e| format!("lapin connect: {e}"))?;
    let ch = conn.create_channel().await.map_err(|e| e.to_string())?;
    println!("| round | shape | msg/s | RabbitMQ CPU µs/msg |\n|---|---|---|---|");
    for round in 0..rounds {
        for shape in SHAPES {
            let config = PublisherConfig {
                amqp_url: url.clone().into(),
                exchange: exchange.clone(),
                declare: pgoutbox::publisher::connection::Declare::DurableTopic,
                connection_name: "header_cost".into(),
                signals: Default::default(),
            };
            let mut p: Publisher<u64> = Publisher::connect(&config)
                .await
                .map_err(|e| e.to_string())?;
            ch.queue_declare(
                queue.as_str().into(),
                QueueDeclareOptions {
                    durable: true,
                    ..Default::default()
                },
                FieldTable::default(),
            )
            .await
            .map_err(|e| e.to_string())?;
            ch.queue_bind(
                queue.as_str().into(),
                exchange.as_str().into(),
                "#".into(),
                QueueBindOptions::default(),
                FieldTable::default(),
            )
            .await
            .map_err(|e| e.to_string())?;
            let body = bytes::Bytes::from(vec![b'x'; 256]);
            let rk: ShortString = "bench.shape".into();
            let r0 = cpu_secs(beam);
            let t0 = Instant::now();
            let (mut sent, mut settled) = (0u64, 0u64);
            while settled < n {
                while sent < n && sent - settled < WINDOW {
                    let (properties, match_key) = props(shape, sent);
                    p.publish(OutboundMessage {
                        tag: sent,
                        exchange: pgoutbox::publisher::Exchange::Configured,
                        routing_key: rk.clone(),
                        body: body.clone(),
                        properties,
                        match_key,
                    })
                    .map_err(|e| e.to_string())?;
                    sent += 1;
                }
                for (i, o) in p.recv_outcomes().await.map_err(|e| e.to_string())? {
                    if o != PublishOutcome::Routed {
                        return Err(format!("{shape}: message {i}: {o}"));
                    }
                    settled += 1;
                }
            }
            let elapsed = t0.elapsed().as_secs_f64();
            let rabbit = cpu_secs(beam) - r0;
            p.close().await;
            ch.queue_delete(queue.as_str().into(), QueueDeleteOptions::default())
                .await
                .map_err(|e| e.to_string())?;
            println!(
                "| {round} | {shape} | {:.0} | {:.1} |",
                n as f64 / elapsed,
                rabbit * 1e6 / n as f64
            );
        }
    }
    let _ = ch
        .exchange_delete(exchange.as_str().into(), Default::default())
        .await;
    Ok(())
}
