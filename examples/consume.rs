//! Demo consumer: declares a durable queue bound to the pgoutbox exchange with `#`, then
//! prints each message (id, routing key, LSN headers, body) and acks it. With
//! `--properties` it also prints every AMQP property that is set and every header with its
//! AMQP type, which is what a consumer receives (docs/src/consumers/message.md).
//!
//! `cargo run --example consume -- [--properties] AMQP_URL [EXCHANGE] [QUEUE] [COUNT] [TIMEOUT_S]`
//! exits after COUNT messages or TIMEOUT_S seconds without one (defaults: pgoutbox,
//! pgoutbox-demo, unlimited, 10).
//!
//! `--queues Q1,Q2,...` consumes those queues instead, declaring nothing: the quorum queues
//! of `pgoutbox declare-topology` (behind the consistent-hash exchange, each with a single
//! active consumer). Start this twice with the same queues and the second stands by: RabbitMQ
//! delivers each queue to one consumer at a time and hands it to the other when the first
//! goes away. Each line then starts with the queue and names the aggregate
//! (`x-pgoutbox-aggregate-id`); EXCHANGE and QUEUE are not given (COUNT and TIMEOUT_S
//! follow AMQP_URL).
//!
//! Exit status: 0 when COUNT messages arrived (or, with no COUNT, when TIMEOUT_S passed
//! without a message); 1 when the broker could not be reached or the connection was lost,
//! or when TIMEOUT_S passed before COUNT messages; 2 on a usage error.

use std::process::ExitCode;
use std::time::Duration;

use futures::StreamExt;
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicQosOptions, ExchangeDeclareOptions,
    QueueBindOptions, QueueDeclareOptions,
};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{Connection, ConnectionProperties, ExchangeKind};

const USAGE: &str = "usage: consume [--properties] AMQP_URL [EXCHANGE] [QUEUE] [COUNT] [TIMEOUT_S]\n       consume [--properties] --queues Q1,Q2,... AMQP_URL [COUNT] [TIMEOUT_S]";

/// The prefetch of each queue's consumer under `--queues`: what a killed consumer returns to
/// its queue at most (RabbitMQ delivers it to the consumer that takes over first).
const PREFETCH: u16 = 32;

/// Whether each message's properties and headers are printed too (`--properties`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Detail {
    /// One line per message: routing key, id, LSN headers, body.
    Summary,
    /// The line, then every property that is set and every header, one per line.
    Properties,
}

fn main() -> ExitCode {
    let mut args: Vec<String> = std::env::args().collect();
    let detail = match args.iter().position(|a| a == "--properties") {
        Some(i) => {
            args.remove(i);
            Detail::Properties
        }
        None => Detail::Summary,
    };
    let queues: Option<Vec<String>> = match args.iter().position(|a| a == "--queues") {
        Some(i) if i + 1 < args.len() => {
            let list = args.remove(i + 1);
            args.remove(i);
            Some(list.split(',').map(str::to_owned).collect())
        }
        Some(_) => {
            eprintln!("consume: --queues needs a comma-separated list of queues; {USAGE}");
            return ExitCode::from(2);
        }
        None => None,
    };
    if let Some(flag) = args.iter().skip(1).find(|a| a.starts_with("--")) {
        eprintln!("consume: unknown flag {flag}; {USAGE}");
        return ExitCode::from(2);
    }
    let Some(url) = args
        .get(1)
        .cloned()
        .or_else(|| std::env::var("PGOUTBOX_AMQP_URL").ok())
    else {
        eprintln!("{USAGE}");
        return ExitCode::from(2);
    };
    // Under --queues there is no EXCHANGE and QUEUE: COUNT and TIMEOUT_S follow the URL.
    if queues.is_some() {
        args.splice(2..2, [String::new(), String::new()]);
    }
    let exchange = args.get(2).cloned().unwrap_or_else(|| "pgoutbox".into());
    let queue = args
        .get(3)
        .cloned()
        .unwrap_or_else(|| "pgoutbox-demo".into());
    let number = |i: usize, name: &str| -> Result<Option<u64>, String> {
        args.get(i)
            .map(|v| {
                v.parse()
                    .map_err(|_| format!("{name} {v:?} is not a whole number; {USAGE}"))
            })
            .transpose()
    };
    let (count, timeout_s) = match (number(4, "COUNT"), number(5, "TIMEOUT_S")) {
        (Ok(c), Ok(t)) => (c, t.unwrap_or(10)),
        (Err(e), _) | (_, Err(e)) => {
            eprintln!("consume: {e}");
            return ExitCode::from(2);
        }
    };
    let timeout = Duration::from_secs(timeout_s);
    let runtime = match tokio::runtime::Runtime::new() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("consume: cannot start the tokio runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let mut seen = 0u64;
    let result = match &queues {
        Some(queues) => runtime.block_on(consume_queues(
            &url,
            queues,
            count.unwrap_or(u64::MAX),
            timeout,
            detail,
            &mut seen,
        )),
        None => runtime.block_on(consume(
            &url,
            &exchange,
            &queue,
            count.unwrap_or(u64::MAX),
            timeout,
            detail,
            &mut seen,
        )),
    };
    match result {
        Ok(()) if count.is_some_and(|c| seen < c) => {
            eprintln!(
                "consume: received {seen} of {} messages: none arrived for {timeout_s} s",
                count.unwrap_or_default()
            );
            ExitCode::FAILURE
        }
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("consume: {e} (after {seen} messages)");
            ExitCode::FAILURE
        }
    }
}

/// Declares, binds and consumes, printing each message; counts them in `seen`.
///
/// # Errors
/// A sentence naming what failed: the connection, the declarations, or the stream.
async fn consume(
    url: &str,
    exchange: &str,
    queue: &str,
    count: u64,
    timeout: Duration,
    detail: Detail,
    seen: &mut u64,
) -> Result<(), String> {
    let conn = Connection::connect(url, ConnectionProperties::default())
        .await
        .map_err(|e| format!("cannot connect to RabbitMQ at {}: {e}", redact(url)))?;
    let declare = |e: lapin::Error| format!("declaring queue {queue} on exchange {exchange}: {e}");
    let ch = conn.create_channel().await.map_err(declare)?;
    ch.exchange_declare(
        exchange.into(),
        ExchangeKind::Topic,
        ExchangeDeclareOptions {
            durable: true,
            ..Default::default()
        },
        FieldTable::default(),
    )
    .await
    .map_err(declare)?;
    ch.queue_declare(
        queue.into(),
        QueueDeclareOptions::durable(),
        FieldTable::default(),
    )
    .await
    .map_err(declare)?;
    ch.queue_bind(
        queue.into(),
        exchange.into(),
        "#".into(),
        QueueBindOptions::default(),
        FieldTable::default(),
    )
    .await
    .map_err(declare)?;
    println!("consuming from queue {queue} bound to exchange {exchange} with '#'");
    let mut consumer = ch
        .basic_consume(
            queue.into(),
            "demo".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .map_err(declare)?;
    while *seen < count {
        let Ok(Some(delivery)) = tokio::time::timeout(timeout, consumer.next()).await else {
            break;
        };
        let delivery = delivery.map_err(|e| format!("lost the RabbitMQ connection: {e}"))?;
        print_and_ack(None, &delivery, detail).await?;
        *seen += 1;
    }
    println!("received {seen} messages");
    Ok(())
}

/// Consumes the existing `queues` on one channel (one consumer each, prefetch
/// [`PREFETCH`]), printing each message with its queue; counts them in `seen`.
///
/// # Errors
/// A sentence naming what failed: the connection, a queue, or the stream.
async fn consume_queues(
    url: &str,
    queues: &[String],
    count: u64,
    timeout: Duration,
    detail: Detail,
    seen: &mut u64,
) -> Result<(), String> {
    let conn = Connection::connect(url, ConnectionProperties::default())
        .await
        .map_err(|e| format!("cannot connect to RabbitMQ at {}: {e}", redact(url)))?;
    let ch = conn
        .create_channel()
        .await
        .map_err(|e| format!("opening a channel: {e}"))?;
    ch.basic_qos(PREFETCH, BasicQosOptions::default())
        .await
        .map_err(|e| format!("setting the prefetch: {e}"))?;
    let mut consumers = Vec::with_capacity(queues.len());
    for (i, queue) in queues.iter().enumerate() {
        let consumer = ch
            .basic_consume(
                queue.as_str().into(),
                format!("demo-{i}").into(),
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await
            .map_err(|e| {
                format!(
                    "consuming queue {queue} (declare it with `pgoutbox declare-topology`): {e}"
                )
            })?;
        consumers.push(consumer.map(move |d| (i, d)));
    }
    println!(
        "consuming from queues {} (each delivers to one consumer at a time)",
        queues.join(",")
    );
    let mut deliveries = futures::stream::select_all(consumers);
    while *seen < count {
        let Ok(Some((i, delivery))) = tokio::time::timeout(timeout, deliveries.next()).await else {
            break;
        };
        let delivery = delivery.map_err(|e| format!("lost the RabbitMQ connection: {e}"))?;
        print_and_ack(Some(&queues[i]), &delivery, detail).await?;
        *seen += 1;
    }
    println!("received {seen} messages");
    Ok(())
}

/// Prints one line for `delivery` (with its queue, when several are consumed), its
/// properties under `--properties`, then acks it.
///
/// # Errors
/// A sentence when the ack cannot be sent.
async fn print_and_ack(
    queue: Option<&str>,
    delivery: &lapin::message::Delivery,
    detail: Detail,
) -> Result<(), String> {
    let header = |k: &str| {
        delivery
            .properties
            .headers()
            .as_ref()
            .and_then(|h| h.inner().get(k).cloned())
            .map(|v| match v {
                AMQPValue::LongString(s) => String::from_utf8_lossy(s.as_bytes()).into_owned(),
                other => format!("{other:?}"),
            })
            .unwrap_or_default()
    };
    let id = delivery
        .properties
        .message_id()
        .as_ref()
        .map(|m| m.as_str())
        .unwrap_or("-");
    match queue {
        None => println!(
            "{} id={id} lsn={} commit_lsn={} body={}",
            delivery.routing_key,
            header("x-pgoutbox-lsn"),
            header("x-pgoutbox-commit-lsn"),
            String::from_utf8_lossy(&delivery.data)
        ),
        Some(queue) => println!(
            "{queue} {} id={id} aggregate={} lsn={} commit_lsn={} body={}",
            delivery.routing_key,
            header("x-pgoutbox-aggregate-id"),
            header("x-pgoutbox-lsn"),
            header("x-pgoutbox-commit-lsn"),
            String::from_utf8_lossy(&delivery.data)
        ),
    }
    if detail == Detail::Properties {
        print_properties(&delivery.properties);
    }
    delivery
        .ack(BasicAckOptions::default())
        .await
        .map(|_| ())
        .map_err(|e| format!("lost the RabbitMQ connection while acking: {e}"))
}

/// Prints every property of `p` that is set, then every header with its AMQP type, one per
/// line, indented under the message's summary line.
fn print_properties(p: &lapin::BasicProperties) {
    let text = |v: &Option<lapin::types::ShortString>| v.as_ref().map(|s| s.as_str().to_owned());
    let number = |v: Option<String>| v;
    let fields = [
        ("message_id", text(p.message_id())),
        ("content_type", text(p.content_type())),
        ("content_encoding", text(p.content_encoding())),
        (
            "delivery_mode",
            number(p.delivery_mode().map(|d| d.to_string())),
        ),
        ("priority", number(p.priority().map(|d| d.to_string()))),
        ("correlation_id", text(p.correlation_id())),
        ("reply_to", text(p.reply_to())),
        ("expiration", text(p.expiration())),
        (
            "timestamp",
            number(
                p.timestamp()
                    .map(|t| format!("{t} (seconds since the Unix epoch)")),
            ),
        ),
        ("type", text(p.kind())),
        ("user_id", text(p.user_id())),
        ("app_id", text(p.app_id())),
    ];
    for (name, value) in fields {
        if let Some(value) = value {
            println!("  property {name}: {value}");
        }
    }
    let Some(headers) = p.headers().as_ref() else {
        println!("  (no headers)");
        return;
    };
    let mut headers: Vec<_> = headers.inner().iter().collect();
    headers.sort_by(|a, b| a.0.as_str().cmp(b.0.as_str()));
    for (key, value) in headers {
        println!("  header {}: {}", key.as_str(), describe(value));
    }
}

/// A header value with its AMQP field type, e.g. `"0/1A2B3C8" (long string)`.
fn describe(value: &AMQPValue) -> String {
    match value {
        AMQPValue::LongString(s) => {
            format!("{:?} (long string)", String::from_utf8_lossy(s.as_bytes()))
        }
        AMQPValue::ShortString(s) => format!("{:?} (short string)", s.as_str()),
        AMQPValue::Boolean(b) => format!("{b} (boolean)"),
        AMQPValue::LongLongInt(n) => format!("{n} (long-long integer)"),
        AMQPValue::LongInt(n) => format!("{n} (long integer)"),
        AMQPValue::Double(d) => format!("{d} (double)"),
        AMQPValue::Void => "(void)".to_owned(),
        other => format!("{other:?}"),
    }
}

/// The URL without its password, for messages.
fn redact(url: &str) -> String {
    match url.split_once('@') {
        Some((creds, host)) => match creds.rsplit_once(':') {
            Some((user, _)) if !user.ends_with('/') => format!("{user}:***@{host}"),
            _ => url.to_owned(),
        },
        None => url.to_owned(),
    }
}
