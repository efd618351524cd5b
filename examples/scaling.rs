//! The scaling curve of `run --partitions N` (issue 31, item 5), run by `deploy/bench.sh`
//! after the main benchmark:
//!
//! ```text
//! cargo run --release --example scaling -- [--quick] [--rate R] [--svg PATH]
//! ```
//!
//! 1. **Real RabbitMQ**: one backlog (100,000 x 256 B in transactions of 100, keyed by 400
//!    aggregates; quick: 10,000) drained by `pgoutbox run --partitions N` for N = 1, 2, 4,
//!    each on its own slot created before the backlog, into a topic exchange bound to a
//!    consistent-hash exchange on `x-pgoutbox-aggregate-id` and 4 classic durable queues (the
//!    same for every N). Reported: msg/s, CPU per message, peak RSS, the broker's CPU per
//!    message, and each rate as a ratio to N = 1. On a 2-core machine the broker, PostgreSQL's
//!    walsender and pgoutbox share the cores, so the ratios say how much a second connection
//!    buys when the machine, not pgoutbox, is the limit.
//! 2. **Simulation**: the same drains against a fake broker ([`SimBroker`], in this file) that
//!    confirms at most R messages a second on each connection (token bucket, 10 ms ticks;
//!    default R = 2,500, quick 1,000), for N = 1, 2, 4, 8, 16, and once with a broker that
//!    confirms every publish as soon as it is read (N = 1): the one-partition ceiling C. The
//!    target is throughput >= 0.9 x min(N x R, C) for N = 1, 2, 4, 8. Throughput is the fake's
//!    own clock: from the first publish it read to the confirm of the last message.
//!
//! It prints Markdown tables, writes `target/bench/scaling-<timestamp>.json` and draws the
//! curve as an SVG (`target/bench/scaling-<timestamp>.svg`, and `--svg PATH`; the book's
//! benchmarks page shows one, `docs/src/internals/scaling.svg`) with plotters' SVG backend.
//! The pgoutbox binary is `target/release/pgoutbox`, or `PGOUTBOX_BENCH_BIN`.

use std::collections::HashMap;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use amq_protocol::frame::{gen_frame, parse_frame, AMQPFrame, WriteContext};
use amq_protocol::protocol::{basic, channel, confirm, connection, exchange, AMQPClass};
use amq_protocol::types::{FieldTable, LongString, ShortString};
use lapin::options::{
    ExchangeBindOptions, ExchangeDeclareOptions, QueueBindOptions, QueueDeclareOptions,
};
use lapin::types::AMQPValue;
use lapin::{Connection, ConnectionProperties, ExchangeKind};
use serde::Serialize;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

type R<T> = Result<T, String>;

/// Aggregates the backlog's messages are keyed by (`aggregate_id = agg-(i mod 400)`).
const AGGREGATES: u64 = 400;
/// Messages per backlog transaction.
const PER_TX: u64 = 100;
/// Payload bytes per message.
const SIZE: usize = 256;
/// Classic queues behind the hash exchange in the real-broker drains.
const REAL_QUEUES: usize = 4;
/// The partitions of the real-broker drains.
const REAL_NS: [u16; 3] = [1, 2, 4];
/// The partitions of the simulation.
const SIM_NS: [u16; 5] = [1, 2, 4, 8, 16];
/// The partitions the target applies to.
const TARGET_NS: [u16; 4] = [1, 2, 4, 8];
/// The fake broker's confirm tick.
const TICK: Duration = Duration::from_millis(10);
const PUBLICATION: &str = "pgoutbox_scaling";

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn pgoutbox_bin() -> PathBuf {
    std::env::var_os("PGOUTBOX_BENCH_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| root().join("target/release/pgoutbox"))
}

#[derive(Debug, Clone)]
struct Args {
    quick: bool,
    rate: u64,
    svg: Option<PathBuf>,
}

fn parse_args() -> R<Args> {
    let mut args = Args {
        quick: false,
        rate: 0,
        svg: None,
    };
    let mut it = std::env::args().skip(1);
    while let Some(a) = it.next() {
        match a.as_str() {
            "--quick" => args.quick = true,
            "--rate" => {
                let v = it.next().ok_or("--rate needs a number of msg/s")?;
                args.rate = v.parse().ok().filter(|r| *r > 0).ok_or(format!(
                    "--rate {v:?}: write a whole number of msg/s above 0"
                ))?;
            }
            "--svg" => args.svg = Some(it.next().ok_or("--svg needs a path")?.into()),
            other => {
                return Err(format!(
                    "unknown argument {other:?}; usage: scaling [--quick] [--rate R] [--svg PATH]"
                ))
            }
        }
    }
    if args.rate == 0 {
        args.rate = if args.quick { 1_000 } else { 2_500 };
    }
    Ok(args)
}

// ---------------------------------------------------------------------------------------
// The stack, Postgres, /proc

/// `deploy/stack.sh start DIR`, with the consistent-hash plugin on from boot; stopped on drop.
struct Stack {
    dir: PathBuf,
    env: HashMap<String, String>,
}

impl Stack {
    fn start(dir: &Path) -> R<Stack> {
        let _ = fs::remove_dir_all(dir);
        let out = Command::new("bash")
            .arg(root().join("deploy/stack.sh"))
            .arg("start")
            .arg(dir)
            .env(
                "PGOUTBOX_STACK_PLUGINS",
                "rabbitmq_consistent_hash_exchange",
            )
            .output()
            .map_err(|e| format!("deploy/stack.sh start: {e}"))?;
        let mut stack = Stack {
            dir: dir.to_path_buf(),
            env: HashMap::new(),
        };
        if !out.status.success() {
            return Err(format!(
                "deploy/stack.sh start {} failed:\n{}",
                dir.display(),
                String::from_utf8_lossy(&out.stderr)
            ));
        }
        let env = fs::read_to_string(dir.join("env")).map_err(|e| format!("stack env: {e}"))?;
        for line in env.lines() {
            if let Some((k, v)) = line.split_once('=') {
                stack.env.insert(k.into(), v.into());
            }
        }
        Ok(stack)
    }

    fn get(&self, k: &str) -> &str {
        self.env.get(k).map(String::as_str).unwrap_or("")
    }

    fn db_url(&self, db: &str) -> R<String> {
        let mut u = url::Url::parse(self.get("PGOUTBOX_DATABASE_URL"))
            .map_err(|e| format!("PGOUTBOX_DATABASE_URL: {e}"))?;
        u.set_path(&format!("/{db}"));
        Ok(u.to_string())
    }

    fn rabbit_pid(&self) -> Option<String> {
        fs::read_to_string(self.dir.join("rabbit/pid"))
            .ok()
            .map(|s| s.trim().to_owned())
    }
}

impl Drop for Stack {
    fn drop(&mut self) {
        eprintln!("scaling: stopping the stack in {}", self.dir.display());
        let st = Command::new("bash")
            .arg(root().join("deploy/stack.sh"))
            .arg("stop")
            .arg(&self.dir)
            .status();
        if matches!(st, Ok(s) if s.success()) {
            let _ = fs::remove_dir_all(&self.dir);
        }
    }
}

fn clk_tck() -> f64 {
    Command::new("getconf")
        .arg("CLK_TCK")
        .output()
        .ok()
        .and_then(|o| String::from_utf8_lossy(&o.stdout).trim().parse().ok())
        .unwrap_or(100.0)
}

/// utime + stime of `pid`, seconds.
fn cpu_secs(pid: &str, tck: f64) -> Option<f64> {
    let s = fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let f: Vec<&str> = s[s.rfind(')')? + 2..].split_whitespace().collect();
    let u: f64 = f.get(11)?.parse().ok()?;
    let k: f64 = f.get(12)?.parse().ok()?;
    Some((u + k) / tck)
}

fn vm_hwm_mb(pid: u32) -> Option<f64> {
    let s = fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let kb: f64 = s
        .lines()
        .find(|l| l.starts_with("VmHWM:"))?
        .split_whitespace()
        .nth(1)?
        .parse()
        .ok()?;
    Some(kb / 1024.0)
}

async fn pg(url: &str) -> R<tokio_postgres::Client> {
    let (c, conn) = tokio_postgres::connect(url, tokio_postgres::NoTls)
        .await
        .map_err(|e| format!("connect {url}: {e}"))?;
    tokio::spawn(async move {
        let _ = conn.await;
    });
    Ok(c)
}

async fn sql(c: &tokio_postgres::Client, q: &str) -> R<()> {
    c.batch_execute(q).await.map_err(|e| {
        let detail = e
            .as_db_error()
            .map(|d| d.message().to_owned())
            .unwrap_or_else(|| e.to_string());
        format!("{q:.120}: {detail}")
    })
}

/// A database with `pgoutbox setup` run, one slot per name in `slots` (made before any
/// message is written, so each drain reads the whole backlog), then `n` messages keyed by
/// [`AGGREGATES`] aggregates, in transactions of [`PER_TX`].
async fn backlog(stack: &Stack, db: &str, slots: &[String], n: u64) -> R<String> {
    let admin = pg(stack.get("PGOUTBOX_DATABASE_URL")).await?;
    sql(
        &admin,
        &format!("DROP DATABASE IF EXISTS {db} WITH (FORCE)"),
    )
    .await?;
    sql(&admin, &format!("CREATE DATABASE {db}")).await?;
    let url = stack.db_url(db)?;
    let out = Command::new(pgoutbox_bin())
        .args([
            "setup",
            "--database-url",
            &url,
            "--slot",
            &slots[0],
            "--publication",
            PUBLICATION,
        ])
        .output()
        .map_err(|e| format!("pgoutbox setup: {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "pgoutbox setup: {}",
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    let c = pg(&url).await?;
    for slot in &slots[1..] {
        sql(
            &c,
            &format!("SELECT pg_create_logical_replication_slot('{slot}', 'pgoutput')"),
        )
        .await?;
    }
    let t0 = Instant::now();
    sql(
        &c,
        &format!(
            "DO $$ DECLARE p jsonb := jsonb_build_object('x', repeat('x', {})); BEGIN \
             FOR i IN 1..{n} LOOP \
               PERFORM outbox.emit('bench.scaling', p, aggregate_id => 'agg-' || (i % {AGGREGATES})); \
               IF i % {PER_TX} = 0 THEN COMMIT; END IF; \
             END LOOP; END $$",
            SIZE - 10
        ),
    )
    .await?;
    eprintln!(
        "scaling: [{db}] {n} messages written in {:.1} s",
        t0.elapsed().as_secs_f64()
    );
    Ok(url)
}

// ---------------------------------------------------------------------------------------
// pgoutbox

struct Run {
    child: Child,
    pid: u32,
    log: PathBuf,
}

impl Run {
    fn start(
        db_url: &str,
        amqp_url: &str,
        slot: &str,
        exchange: &str,
        n: u16,
        log: PathBuf,
    ) -> R<Run> {
        let file = fs::File::create(&log).map_err(|e| format!("{}: {e}", log.display()))?;
        let child = Command::new(pgoutbox_bin())
            .args([
                "run",
                "--database-url",
                db_url,
                "--amqp-url",
                amqp_url,
                "--slot",
                slot,
                "--publication",
                PUBLICATION,
                "--exchange",
                exchange,
                "--partitions",
                &n.to_string(),
            ])
            .env("PGOUTBOX_HTTP_ADDR", "off")
            .stdin(Stdio::null())
            .stdout(file.try_clone().map_err(|e| e.to_string())?)
            .stderr(file)
            .spawn()
            .map_err(|e| format!("start pgoutbox: {e}"))?;
        let pid = child.id();
        Ok(Run { child, pid, log })
    }

    fn alive(&mut self) -> R<()> {
        match self.child.try_wait() {
            Ok(None) => Ok(()),
            other => Err(format!(
                "pgoutbox exited ({other:?}); log {}:\n{}",
                self.log.display(),
                fs::read_to_string(&self.log).unwrap_or_default()
            )),
        }
    }

    async fn stop(mut self) {
        // SIGTERM, so pgoutbox drains and says goodbye; Drop kills it if it does not.
        let _ = Command::new("kill")
            .args(["-TERM", &self.pid.to_string()])
            .status();
        for _ in 0..200 {
            if matches!(self.child.try_wait(), Ok(Some(_))) {
                return;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Run {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

// ---------------------------------------------------------------------------------------
// The simulated broker

/// A fake AMQP 0-9-1 broker for the simulation: every connection on its address gets the
/// handshake pgoutbox's publisher expects (section 2.2.4: start, tune, open; channel.open,
/// confirm.select, exchange.declare), then its `basic.publish`es are counted (the method
/// frame's class 60, method 40; header and body frames skipped by their frame header) and
/// confirmed with `basic.ack multiple` (RabbitMQ "Publisher Confirms"): at most `rate`
/// messages a second per connection (a token bucket filled every [`TICK`]), or all that were
/// read when `rate` is `None`. Heartbeats every 2 s.
#[derive(Debug)]
struct SimBroker {
    addr: std::net::SocketAddr,
    /// Messages confirmed, all connections together.
    confirmed: Arc<AtomicU64>,
    /// The fake's clock: when the first publish was read, and when `target` was confirmed.
    marks: Arc<Mutex<(Option<Instant>, Option<Instant>)>>,
    task: tokio::task::JoinHandle<()>,
}

impl SimBroker {
    async fn start(rate: Option<u64>, target: u64) -> R<SimBroker> {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .map_err(|e| format!("fake broker: {e}"))?;
        let addr = listener.local_addr().map_err(|e| e.to_string())?;
        let confirmed = Arc::new(AtomicU64::new(0));
        let marks = Arc::new(Mutex::new((None, None)));
        let (c, m) = (confirmed.clone(), marks.clone());
        let task = tokio::spawn(async move {
            while let Ok((socket, _)) = listener.accept().await {
                let (c, m) = (c.clone(), m.clone());
                tokio::spawn(async move {
                    let _ = serve(socket, rate, target, c, m).await;
                });
            }
        });
        Ok(SimBroker {
            addr,
            confirmed,
            marks,
            task,
        })
    }

    fn url(&self) -> String {
        format!("amqp://guest:guest@{}/%2f", self.addr)
    }
}

impl Drop for SimBroker {
    fn drop(&mut self) {
        self.task.abort();
    }
}

fn frame_bytes(frame: &AMQPFrame) -> Vec<u8> {
    let buf = Vec::with_capacity(256);
    gen_frame(frame)(WriteContext::from(buf))
        .expect("frame encodes")
        .into_inner()
        .0
}

fn method(channel: u16, m: AMQPClass) -> Vec<u8> {
    frame_bytes(&AMQPFrame::Method(channel, m))
}

/// One connection of [`SimBroker`].
async fn serve(
    socket: tokio::net::TcpStream,
    rate: Option<u64>,
    target: u64,
    confirmed: Arc<AtomicU64>,
    marks: Arc<Mutex<(Option<Instant>, Option<Instant>)>>,
) -> std::io::Result<()> {
    socket.set_nodelay(true)?;
    let (mut rd, mut wr) = socket.into_split();
    let mut buf: Vec<u8> = Vec::with_capacity(1 << 16);
    let mut header = [0u8; 8];
    rd.read_exact(&mut header).await?;
    let mut props = FieldTable::default();
    props.insert(
        "product".into(),
        AMQPValue::LongString("pgoutbox-sim".into()),
    );
    wr.write_all(&method(
        0,
        AMQPClass::Connection(connection::AMQPMethod::Start(connection::Start {
            version_major: 0,
            version_minor: 9,
            server_properties: props,
            mechanisms: LongString::from("PLAIN"),
            locales: LongString::from("en_US"),
        })),
    ))
    .await?;
    // The handshake, one method at a time, until exchange.declare is answered.
    let mut chunk = vec![0u8; 1 << 16];
    loop {
        let frame = loop {
            match parse_frame(buf.as_slice()) {
                Ok((rest, frame)) => {
                    let used = buf.len() - rest.len();
                    buf.drain(..used);
                    break frame;
                }
                Err(e) if e.is_incomplete() => {
                    let n = rd.read(&mut chunk).await?;
                    if n == 0 {
                        return Ok(());
                    }
                    buf.extend_from_slice(&chunk[..n]);
                }
                Err(_) => return Ok(()),
            }
        };
        let reply = match frame {
            AMQPFrame::Method(0, AMQPClass::Connection(connection::AMQPMethod::StartOk(_))) => {
                Some(method(
                    0,
                    AMQPClass::Connection(connection::AMQPMethod::Tune(connection::Tune {
                        channel_max: 2047,
                        frame_max: 131_072,
                        heartbeat: 0,
                    })),
                ))
            }
            AMQPFrame::Method(0, AMQPClass::Connection(connection::AMQPMethod::TuneOk(_))) => None,
            AMQPFrame::Method(0, AMQPClass::Connection(connection::AMQPMethod::Open(_))) => {
                Some(method(
                    0,
                    AMQPClass::Connection(connection::AMQPMethod::OpenOk(connection::OpenOk {})),
                ))
            }
            AMQPFrame::Method(ch, AMQPClass::Channel(channel::AMQPMethod::Open(_))) => {
                Some(method(
                    ch,
                    AMQPClass::Channel(channel::AMQPMethod::OpenOk(channel::OpenOk {})),
                ))
            }
            AMQPFrame::Method(ch, AMQPClass::Confirm(confirm::AMQPMethod::Select(_))) => {
                Some(method(
                    ch,
                    AMQPClass::Confirm(confirm::AMQPMethod::SelectOk(confirm::SelectOk {})),
                ))
            }
            AMQPFrame::Method(ch, AMQPClass::Exchange(exchange::AMQPMethod::Declare(_))) => {
                wr.write_all(&method(
                    ch,
                    AMQPClass::Exchange(exchange::AMQPMethod::DeclareOk(exchange::DeclareOk {})),
                ))
                .await?;
                break;
            }
            AMQPFrame::Heartbeat => None,
            _ => return Ok(()),
        };
        if let Some(bytes) = reply {
            wr.write_all(&bytes).await?;
        }
    }
    // Publishing: count publishes on the reader, confirm on a timer (or at once).
    let received = Arc::new(AtomicU64::new(0));
    let done = Arc::new(tokio::sync::Notify::new());
    let writer = {
        let (received, done, confirmed, marks) = (
            received.clone(),
            done.clone(),
            confirmed.clone(),
            marks.clone(),
        );
        tokio::spawn(async move {
            let mut acked = 0u64;
            let mut credit = 0f64;
            let mut last = Instant::now();
            let mut heartbeat = Instant::now();
            let mut ticker = tokio::time::interval(TICK);
            ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                match rate {
                    Some(_) => {
                        tokio::select! {
                            _ = ticker.tick() => {}
                            _ = done.notified() => return,
                        }
                    }
                    None => tokio::select! {
                        _ = done.notified() => return,
                        _ = tokio::time::sleep(Duration::from_millis(1)) => {}
                    },
                }
                let now = Instant::now();
                let have = received.load(Ordering::Acquire);
                let upto = match rate {
                    Some(r) => {
                        credit = (credit + r as f64 * (now - last).as_secs_f64()).min(r as f64);
                        let n = (have - acked).min(credit as u64);
                        credit -= n as f64;
                        acked + n
                    }
                    None => have,
                };
                last = now;
                let mut out = Vec::new();
                if upto > acked {
                    out.extend(method(
                        1,
                        AMQPClass::Basic(basic::AMQPMethod::Ack(basic::Ack {
                            delivery_tag: upto,
                            multiple: true,
                        })),
                    ));
                    let total = confirmed.fetch_add(upto - acked, Ordering::AcqRel) + upto - acked;
                    acked = upto;
                    if total >= target {
                        let mut m = marks.lock().unwrap_or_else(|e| e.into_inner());
                        m.1.get_or_insert_with(Instant::now);
                    }
                }
                if heartbeat.elapsed() > Duration::from_secs(2) {
                    out.extend(frame_bytes(&AMQPFrame::Heartbeat));
                    heartbeat = Instant::now();
                }
                if !out.is_empty() && wr.write_all(&out).await.is_err() {
                    return;
                }
            }
        })
    };
    // Frame headers: type (1), channel (2), size (4); then the payload and 0xCE.
    let result = loop {
        let mut at = 0;
        let mut closing = false;
        while buf.len() - at >= 7 {
            let size =
                u32::from_be_bytes([buf[at + 3], buf[at + 4], buf[at + 5], buf[at + 6]]) as usize;
            if buf.len() - at < 8 + size {
                break;
            }
            if buf[at] == 1 && size >= 4 {
                let class = u16::from_be_bytes([buf[at + 7], buf[at + 8]]);
                let method_id = u16::from_be_bytes([buf[at + 9], buf[at + 10]]);
                if (class, method_id) == (60, 40) {
                    if received.fetch_add(1, Ordering::AcqRel) == 0 {
                        let mut m = marks.lock().unwrap_or_else(|e| e.into_inner());
                        m.0.get_or_insert_with(Instant::now);
                    }
                } else if (class, method_id) == (10, 50) {
                    // connection.close: the session is over.
                    closing = true;
                }
            }
            at += 8 + size;
        }
        buf.drain(..at);
        if closing {
            break Ok(());
        }
        match rd.read(&mut chunk).await {
            Ok(0) => break Ok(()),
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
            Err(e) => break Err(e),
        }
    };
    done.notify_one();
    let _ = writer.await;
    result
}

// ---------------------------------------------------------------------------------------
// The drains

#[derive(Debug, Clone, Serialize)]
struct Row {
    /// `real` or `sim`.
    kind: &'static str,
    partitions: u16,
    /// The fake's confirm rate per connection (msg/s), `None`: at once (or real RabbitMQ).
    rate_per_connection: Option<u64>,
    messages: u64,
    seconds: f64,
    msgs_per_s: f64,
    cpu_us_per_msg: f64,
    peak_rss_mb: f64,
    rabbit_cpu_us_per_msg: Option<f64>,
}

/// Drains the backlog of `db_url` on `slot` with `--partitions n` into the real broker,
/// until the [`REAL_QUEUES`] queues behind `exchange` hold `m` messages.
#[allow(clippy::too_many_arguments)]
async fn drain_real(
    stack: &Stack,
    amqp: &Connection,
    db_url: &str,
    slot: &str,
    n: u16,
    m: u64,
    tck: f64,
    log_dir: &Path,
) -> R<Row> {
    let ch = amqp.create_channel().await.map_err(|e| e.to_string())?;
    let exchange = format!("scaling_{n}");
    let hash = format!("scaling_{n}_hash");
    let durable = ExchangeDeclareOptions {
        durable: true,
        ..Default::default()
    };
    ch.exchange_declare(
        exchange.as_str().into(),
        ExchangeKind::Topic,
        durable,
        FieldTable::default(),
    )
    .await
    .map_err(|e| format!("declare {exchange}: {e}"))?;
    let mut args = FieldTable::default();
    args.insert(
        ShortString::from("hash-header"),
        AMQPValue::LongString("x-pgoutbox-aggregate-id".into()),
    );
    ch.exchange_declare(
        hash.as_str().into(),
        ExchangeKind::Custom("x-consistent-hash".into()),
        durable,
        args,
    )
    .await
    .map_err(|e| format!("declare {hash}: {e}"))?;
    ch.exchange_bind(
        hash.as_str().into(),
        exchange.as_str().into(),
        "#".into(),
        ExchangeBindOptions::default(),
        FieldTable::default(),
    )
    .await
    .map_err(|e| format!("bind {hash}: {e}"))?;
    let queues: Vec<String> = (0..REAL_QUEUES)
        .map(|i| format!("{exchange}_q{i}"))
        .collect();
    for q in &queues {
        ch.queue_declare(
            q.as_str().into(),
            QueueDeclareOptions {
                durable: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await
        .map_err(|e| format!("declare {q}: {e}"))?;
        ch.queue_bind(
            q.as_str().into(),
            hash.as_str().into(),
            "1".into(),
            QueueBindOptions::default(),
            FieldTable::default(),
        )
        .await
        .map_err(|e| format!("bind {q}: {e}"))?;
    }
    let rpid = stack.rabbit_pid();
    let r0 = rpid.as_deref().and_then(|p| cpu_secs(p, tck));
    let t0 = Instant::now();
    let mut run = Run::start(
        db_url,
        stack.get("PGOUTBOX_AMQP_URL"),
        slot,
        &exchange,
        n,
        log_dir.join(format!("scaling-real-{n}.log")),
    )?;
    let limit = Duration::from_secs(120 + m / 1_000);
    loop {
        let mut depth = 0u64;
        for q in &queues {
            let d = ch
                .queue_declare(
                    q.as_str().into(),
                    QueueDeclareOptions {
                        passive: true,
                        ..Default::default()
                    },
                    FieldTable::default(),
                )
                .await
                .map_err(|e| format!("depth of {q}: {e}"))?;
            depth += u64::from(d.message_count());
        }
        if depth >= m {
            break;
        }
        run.alive()?;
        if t0.elapsed() > limit {
            return Err(format!(
                "real N={n}: {depth} of {m} after {:?}",
                t0.elapsed()
            ));
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let seconds = t0.elapsed().as_secs_f64();
    let pid = run.pid.to_string();
    let cpu = cpu_secs(&pid, tck).unwrap_or(f64::NAN);
    let rss = vm_hwm_mb(run.pid).unwrap_or(f64::NAN);
    let r1 = rpid.as_deref().and_then(|p| cpu_secs(p, tck));
    run.stop().await;
    for q in &queues {
        let _ = ch.queue_delete(q.as_str().into(), Default::default()).await;
    }
    Ok(Row {
        kind: "real",
        partitions: n,
        rate_per_connection: None,
        messages: m,
        seconds,
        msgs_per_s: m as f64 / seconds,
        cpu_us_per_msg: cpu * 1e6 / m as f64,
        peak_rss_mb: rss,
        rabbit_cpu_us_per_msg: r0.zip(r1).map(|(a, b)| (b - a) * 1e6 / m as f64),
    })
}

/// Drains the backlog of `db_url` on `slot` with `--partitions n` into a [`SimBroker`]
/// confirming `rate` msg/s per connection, until it confirmed `m` messages.
#[allow(clippy::too_many_arguments)]
async fn drain_sim(
    db_url: &str,
    slot: &str,
    n: u16,
    rate: Option<u64>,
    m: u64,
    tck: f64,
    log_dir: &Path,
) -> R<Row> {
    let broker = SimBroker::start(rate, m).await?;
    let mut run = Run::start(
        db_url,
        &broker.url(),
        slot,
        "scaling",
        n,
        log_dir.join(format!(
            "scaling-sim-{n}-{}.log",
            rate.map_or("instant".into(), |r| r.to_string())
        )),
    )?;
    let t0 = Instant::now();
    let limit = Duration::from_secs(60 + m / rate.unwrap_or(1_000).max(1) * 2);
    while broker.confirmed.load(Ordering::Acquire) < m {
        run.alive()?;
        if t0.elapsed() > limit {
            return Err(format!(
                "sim N={n}: {} of {m} confirmed after {:?}",
                broker.confirmed.load(Ordering::Acquire),
                t0.elapsed()
            ));
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let (first, last) = *broker.marks.lock().unwrap_or_else(|e| e.into_inner());
    let seconds = match (first, last) {
        (Some(a), Some(b)) => (b - a).as_secs_f64(),
        _ => t0.elapsed().as_secs_f64(),
    };
    let pid = run.pid.to_string();
    let cpu = cpu_secs(&pid, tck).unwrap_or(f64::NAN);
    let rss = vm_hwm_mb(run.pid).unwrap_or(f64::NAN);
    run.stop().await;
    Ok(Row {
        kind: "sim",
        partitions: n,
        rate_per_connection: rate,
        messages: m,
        seconds,
        msgs_per_s: m as f64 / seconds,
        cpu_us_per_msg: cpu * 1e6 / m as f64,
        peak_rss_mb: rss,
        rabbit_cpu_us_per_msg: None,
    })
}

// ---------------------------------------------------------------------------------------
// Report

#[derive(Debug, Clone, Serialize)]
struct Report {
    quick: bool,
    rate: u64,
    ceiling_msgs_per_s: f64,
    real: Vec<Row>,
    sim: Vec<Row>,
    /// (N, target msg/s, measured msg/s, met) for N in [`TARGET_NS`].
    targets: Vec<(u16, f64, f64, bool)>,
    cores: usize,
    load_after: String,
}

fn target_of(n: u16, rate: u64, ceiling: f64) -> f64 {
    0.9 * (f64::from(n) * rate as f64).min(ceiling)
}

fn tables(r: &Report) -> String {
    let mut s = String::new();
    s.push_str("\n### Real RabbitMQ (4 classic queues behind the hash exchange)\n\n");
    s.push_str("| N | msg/s | ratio to N = 1 | pgoutbox CPU us/msg | peak RSS MB | RabbitMQ CPU us/msg |\n|---:|---:|---:|---:|---:|---:|\n");
    let base = r.real.first().map_or(f64::NAN, |b| b.msgs_per_s);
    for row in &r.real {
        s.push_str(&format!(
            "| {} | {:.0} | {:.2} | {:.2} | {:.1} | {} |\n",
            row.partitions,
            row.msgs_per_s,
            row.msgs_per_s / base,
            row.cpu_us_per_msg,
            row.peak_rss_mb,
            row.rabbit_cpu_us_per_msg
                .map_or("-".into(), |v| format!("{v:.2}"))
        ));
    }
    s.push_str(&format!(
        "\n### Simulation (fake broker, R = {} msg/s per connection; C = {:.0} msg/s, one partition, instant confirms)\n\n",
        r.rate, r.ceiling_msgs_per_s
    ));
    s.push_str("| N | N x R | target 0.9 x min(N x R, C) | msg/s | of target | pgoutbox CPU us/msg |\n|---:|---:|---:|---:|---:|---:|\n");
    for row in r.sim.iter().filter(|x| x.rate_per_connection.is_some()) {
        let t = target_of(row.partitions, r.rate, r.ceiling_msgs_per_s);
        s.push_str(&format!(
            "| {} | {} | {:.0} | {:.0} | {:.2}{} | {:.2} |\n",
            row.partitions,
            u64::from(row.partitions) * r.rate,
            t,
            row.msgs_per_s,
            row.msgs_per_s / t,
            if TARGET_NS.contains(&row.partitions) {
                ""
            } else {
                " (no target)"
            },
            row.cpu_us_per_msg
        ));
    }
    let met = r.targets.iter().filter(|t| t.3).count();
    s.push_str(&format!(
        "\nTarget met for {met} of {} (N = 1, 2, 4, 8). {} cores, load after: {}.\n",
        r.targets.len(),
        r.cores,
        r.load_after
    ));
    s
}

/// One line of the curve: its legend, its points, its colour.
type Series<'a> = (&'a str, &'a Vec<(f64, f64)>, plotters::style::RGBColor);

/// The curve: simulated msg/s against N (log 2 axis), the target and min(N x R, C), and the
/// real-broker drains.
fn draw(r: &Report, path: &Path) -> R<()> {
    use plotters::prelude::*;
    let root = SVGBackend::new(path, (720, 440)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| e.to_string())?;
    let sim: Vec<(f64, f64)> = r
        .sim
        .iter()
        .filter(|x| x.rate_per_connection.is_some())
        .map(|x| (f64::from(x.partitions).log2(), x.msgs_per_s))
        .collect();
    let ideal: Vec<(f64, f64)> = SIM_NS
        .iter()
        .map(|n| {
            (
                f64::from(*n).log2(),
                (f64::from(*n) * r.rate as f64).min(r.ceiling_msgs_per_s),
            )
        })
        .collect();
    let target: Vec<(f64, f64)> = TARGET_NS
        .iter()
        .map(|n| {
            (
                f64::from(*n).log2(),
                target_of(*n, r.rate, r.ceiling_msgs_per_s),
            )
        })
        .collect();
    let real: Vec<(f64, f64)> = r
        .real
        .iter()
        .map(|x| (f64::from(x.partitions).log2(), x.msgs_per_s))
        .collect();
    let top = sim
        .iter()
        .chain(&ideal)
        .chain(&real)
        .map(|p| p.1)
        .fold(0.0, f64::max)
        * 1.15;
    let mut chart = ChartBuilder::on(&root)
        .caption(
            format!(
                "run --partitions N: msg/s (fake broker at R = {} msg/s per connection; real RabbitMQ)",
                r.rate
            ),
            ("sans-serif", 16),
        )
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(70)
        .build_cartesian_2d(-0.2f64..4.2f64, 0f64..top)
        .map_err(|e| e.to_string())?;
    chart
        .configure_mesh()
        .x_desc("N (partitions, log 2)")
        .y_desc("msg/s")
        .x_labels(5)
        .x_label_formatter(&|x| format!("{}", 2f64.powf(x.round()) as u32))
        .y_label_formatter(&|y| format!("{y:.0}"))
        .draw()
        .map_err(|e| e.to_string())?;
    let series: [Series<'_>; 4] = [
        ("min(N x R, C)", &ideal, RGBColor(150, 150, 150)),
        ("target 0.9 x min(N x R, C)", &target, RGBColor(220, 120, 0)),
        ("simulation", &sim, RGBColor(0, 90, 200)),
        ("real RabbitMQ, 2 shared cores", &real, RGBColor(0, 150, 60)),
    ];
    for (label, points, color) in series {
        chart
            .draw_series(LineSeries::new(
                points.iter().copied(),
                color.stroke_width(2),
            ))
            .map_err(|e| e.to_string())?
            .label(label)
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 18, y)], color.stroke_width(2))
            });
        chart
            .draw_series(points.iter().map(|p| Circle::new(*p, 4, color.filled())))
            .map_err(|e| e.to_string())?;
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .background_style(WHITE.mix(0.9))
        .border_style(BLACK)
        .draw()
        .map_err(|e| e.to_string())?;
    root.present().map_err(|e| e.to_string())?;
    Ok(())
}

async fn scaling(args: Args) -> R<()> {
    let tck = clk_tck();
    let (m_real, m_sim) = if args.quick {
        (10_000, 5 * args.rate)
    } else {
        (100_000, 16 * args.rate)
    };
    let stamp = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    let out_dir = root().join("target/bench");
    fs::create_dir_all(&out_dir).map_err(|e| e.to_string())?;
    let stack = Stack::start(Path::new(&format!(
        "/tmp/pgoutbox-scaling-{}",
        std::process::id()
    )))?;

    // Real RabbitMQ.
    let real_slots: Vec<String> = REAL_NS
        .iter()
        .map(|n| format!("scaling_real_{n}"))
        .collect();
    let real_url = backlog(&stack, "scaling_real", &real_slots, m_real).await?;
    let amqp = Connection::connect(
        stack.get("PGOUTBOX_AMQP_URL"),
        ConnectionProperties::default(),
    )
    .await
    .map_err(|e| format!("amqp: {e}"))?;
    let mut real = Vec::new();
    for (n, slot) in REAL_NS.iter().zip(&real_slots) {
        let row = drain_real(&stack, &amqp, &real_url, slot, *n, m_real, tck, &out_dir).await?;
        eprintln!(
            "scaling: real N={n}: {:.0} msg/s, {:.2} us/msg",
            row.msgs_per_s, row.cpu_us_per_msg
        );
        real.push(row);
    }
    let _ = tokio::time::timeout(Duration::from_secs(5), amqp.close(200, "done".into())).await;

    // Simulation: the ceiling (instant confirms, N = 1), then R per connection.
    let mut sim_slots = vec!["scaling_sim_ceiling".to_string()];
    sim_slots.extend(SIM_NS.iter().map(|n| format!("scaling_sim_{n}")));
    let sim_url = backlog(&stack, "scaling_sim", &sim_slots, m_sim).await?;
    let ceiling = drain_sim(&sim_url, &sim_slots[0], 1, None, m_sim, tck, &out_dir).await?;
    eprintln!(
        "scaling: sim ceiling (N=1, instant confirms): {:.0} msg/s",
        ceiling.msgs_per_s
    );
    let mut sim = vec![ceiling.clone()];
    for (n, slot) in SIM_NS.iter().zip(&sim_slots[1..]) {
        let row = drain_sim(&sim_url, slot, *n, Some(args.rate), m_sim, tck, &out_dir).await?;
        eprintln!(
            "scaling: sim N={n} R={}: {:.0} msg/s (N x R = {})",
            args.rate,
            row.msgs_per_s,
            u64::from(*n) * args.rate
        );
        sim.push(row);
    }
    let targets = TARGET_NS
        .iter()
        .filter_map(|n| {
            let row = sim
                .iter()
                .find(|x| x.partitions == *n && x.rate_per_connection.is_some())?;
            let t = target_of(*n, args.rate, ceiling.msgs_per_s);
            Some((*n, t, row.msgs_per_s, row.msgs_per_s >= t))
        })
        .collect();
    let report = Report {
        quick: args.quick,
        rate: args.rate,
        ceiling_msgs_per_s: ceiling.msgs_per_s,
        real,
        sim,
        targets,
        cores: std::thread::available_parallelism().map_or(0, |n| n.get()),
        load_after: fs::read_to_string("/proc/loadavg")
            .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
            .unwrap_or_default(),
    };
    println!("{}", tables(&report));
    let json = out_dir.join(format!("scaling-{stamp}.json"));
    fs::write(
        &json,
        serde_json::to_string_pretty(&report).map_err(|e| e.to_string())?,
    )
    .map_err(|e| e.to_string())?;
    let svg = out_dir.join(format!("scaling-{stamp}.svg"));
    draw(&report, &svg)?;
    if let Some(path) = &args.svg {
        draw(&report, path)?;
    }
    eprintln!("scaling: wrote {} and {}", json.display(), svg.display());
    Ok(())
}

fn main() -> std::process::ExitCode {
    let args = match parse_args() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("scaling: {e}");
            return std::process::ExitCode::from(2);
        }
    };
    let runtime = match tokio::runtime::Runtime::new() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("scaling: tokio runtime: {e}");
            return std::process::ExitCode::FAILURE;
        }
    };
    match runtime.block_on(scaling(args)) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("scaling: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}
