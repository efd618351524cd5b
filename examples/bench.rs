//! The pgoutbox benchmark: throughput, ceilings, peers and latency on a throwaway local stack.
//!
//! ```text
//! cargo run --release --example bench -- [--quick] [--runs N] [--scenarios 1,2,3,4] [--s4-rate R1,R2,...]
//! bash deploy/bench.sh [same arguments]        # installs packages, builds, runs this
//! ```
//!
//! It starts its own PostgreSQL + RabbitMQ with `deploy/stack.sh start` (stopped again on exit,
//! error or ctrl-c), builds `target/release/pgoutbox`, and measures:
//!
//! 1. backlog drain, 300,000 x 256 B in transactions of 1,000 (quick: 20,000);
//! 2. backlog drain, 100,000 x 256 B, one message per transaction (quick: 10,000);
//! 3. a size sweep, 64 B / 1 KiB / 16 KiB / 256 KiB, about the same bytes per size;
//! 5. streams (issue 19): one backlog, 200,000 x 256 B in transactions of 1,000 (quick:
//!    5,000), drained by `pgoutbox run --stream-url ... --stream NAME` into a stream and by
//!    the AMQP path into a queue (full shape, each on its own slot), and in the same run the
//!    **bare stream publisher's ceiling**: a minimal stream-protocol client (no Postgres, our
//!    `stream_publisher::frames` codec) publishing as many pre-built AMQP 1.0 messages of the
//!    same shape and size into a fresh stream, confirms pipelined (windows 10,000 and 1,000,
//!    right after the stream drain; the best counts). Reported: msg/s, pgoutbox's CPU per message and peak RSS, and the
//!    ratios stream ÷ bare ceiling (target 0.9) and stream ÷ AMQP queue (target 1.5). The
//!    stack's RabbitMQ then runs with the `rabbitmq_stream` plugin;
//! 4. steady-state latency with 4 paced producers (synchronous commit) at several rates:
//!    1,000 msg/s (the low-rate row), 2,000, 4,000 and half the scenario-2 drain rate (quick:
//!    1,000 only). Latency is the consumer's receive time minus the time the producer's commit
//!    returned, matched by message id (pgoutbox) or message LSN (the Node relay); for pgoutbox
//!    also from our `x-pgoutbox-commit-time-us` header (full shape) and from its own
//!    `/metrics` histogram `pgoutbox_confirm_latency_seconds` (commit to broker confirm, scraped
//!    before and after, differenced, quantiles interpolated within buckets).
//!
//! Scenarios 1 and 2 write one backlog and drain it once per relay, each on its own slot
//! (created with the others before the backlog) and its own exchange and queue:
//! pgoutbox with `--publish-properties full` and `minimal` (passed as the environment variable
//! `PGOUTBOX_PUBLISH_PROPERTIES`, harmless to a binary without the option: the row then says
//! which shape really arrived), in scenario 1 also pgoutbox with `--http-addr off` next to the
//! metrics-on drain (CPU per message on vs off), in both pgoutbox full with `--journal`
//! next to the one without (the delivery journal's CPU per message and throughput, as
//! ratios of the same run), and the **Node relay** of
//! `../shared/peers/node` when `node` and `npm` are installed (copied to `target/peer-node`,
//! `npm ci` there when its lock file changed; skipped with a note otherwise). The order of the
//! drains is reversed on every other run.
//!
//! For every backlog it also measures, in the same run and on the same machine, the **decode
//! ceiling** (`pg_recvlogical` on a twin slot created together with pgoutbox's, before the
//! backlog) and the **broker ceiling** for each message shape drained (a bare pipelined lapin
//! publisher with confirms at windows 10,000 and 1,000; the best counts): the **full** shape is
//! what pgoutbox sends by default (persistent, mandatory, message_id, content_type, timestamp,
//! headers `x-pgoutbox-lsn` and `x-pgoutbox-commit-lsn` as `X/Y` text and
//! `x-pgoutbox-commit-time-us` as i64), the **minimal** shape only delivery_mode 2,
//! message_id, mandatory and the routing key (what the Node relay sends, too).
//! ratio = msg/s / min(decode ceiling, broker ceiling of the shape the row sent).
//! Every scenario, the steady-state rates of scenario 4 included, is repeated `--runs` times
//! (default 3, quick 1) and reported as median [min-max]. A Markdown table goes to stdout, raw figures to
//! `target/bench/results-<timestamp>.json`, relay logs to `target/bench/`.

use std::collections::HashMap;
use std::fmt::Write as _;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use futures::StreamExt;
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicGetOptions, BasicPublishOptions, BasicQosOptions,
    ConfirmSelectOptions, ExchangeDeclareOptions, ExchangeDeleteOptions, QueueBindOptions,
    QueueDeclareOptions, QueueDeleteOptions,
};
use lapin::types::{AMQPValue, FieldTable, ShortString};
use lapin::{
    BasicProperties, Channel, Confirmation, Connection, ConnectionProperties, ExchangeKind,
    PublisherConfirm,
};
use pgoutbox::stream_publisher::{amqp10, frames};
use serde::Serialize;
use serde_json::json;
use tokio::sync::{mpsc, OwnedSemaphorePermit, Semaphore};

type R<T> = Result<T, String>;

/// pgoutbox's default `--max-in-flight` (the window it runs with here).
const PGOUTBOX_WINDOW: usize = 10_000;
/// Windows tried for the broker ceiling with the bare lapin publisher; the best one counts.
const BROKER_WINDOWS: [usize; 2] = [10_000, 1_000];
/// The window of the bare publisher on pgoutbox's own connection (its best on these
/// machines, and pgoutbox's default).
const OWN_PUBLISHER_WINDOW: usize = 10_000;
/// The broker ceiling publishes at most this many messages (its rate is flat well before;
/// FACTS.md's per-shape figures were measured on 100,000).
const BROKER_CAP: u64 = 100_000;
/// Publish futures first-polled together by the bare publisher.
const PIPELINE: usize = 128;
/// Parallel producer connections that write a backlog.
const EMIT_CONNECTIONS: u64 = 2;
/// Producer connections for the steady-state scenario.
const LATENCY_PRODUCERS: usize = 4;
/// `synchronous_commit` of the steady-state producers (see [`latency_case`]).
const PRODUCER_SYNC_COMMIT: &str = "on";
/// Steady-state rates always tried (msg/s), below half the scenario-2 drain rate, which is
/// the last row; 250 is the low-rate row (every message meets an idle pipeline).
const LATENCY_RATES: [f64; 4] = [250.0, 1_000.0, 2_000.0, 4_000.0];
/// The rate of `--quick`'s one steady-state row (msg/s).
const QUICK_LATENCY_RATE: f64 = 1_000.0;
/// The first part of each steady-state run that its latency quantiles leave out (a new
/// relay process, its connections and the broker's new queue settle in); the CPU figures
/// cover the whole run.
const LATENCY_WARMUP: Duration = Duration::from_secs(1);
/// Where the Node relay peer is copied and installed, under the repository.
const NODE_PEER_DIR: &str = "target/peer-node";
/// The logical-message prefix of `sql/outbox.sql` (the Node relay filters on it).
const MESSAGE_PREFIX: &str = "pgoutbox";
const SLOT: &str = "pgoutbox_bench";
const TWIN: &str = "pgoutbox_bench_twin";
const PUBLICATION: &str = "pgoutbox_bench";

/// Pids of children to SIGTERM if the bench dies (pgoutbox, pg_recvlogical).
static CHILDREN: Mutex<Vec<u32>> = Mutex::new(Vec::new());

fn register(pid: u32) {
    CHILDREN.lock().map(|mut c| c.push(pid)).ok();
}

fn unregister(pid: u32) {
    CHILDREN.lock().map(|mut c| c.retain(|p| *p != pid)).ok();
}

fn kill_registered() {
    let pids: Vec<u32> = CHILDREN.lock().map(|c| c.clone()).unwrap_or_default();
    for pid in pids {
        let _ = Command::new("kill")
            .args(["-TERM", &pid.to_string()])
            .status();
    }
}

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// The pgoutbox binary measured: `target/release/pgoutbox`, or `PGOUTBOX_BENCH_BIN` (CI's
/// smoke runs the dev build it already has, to check the benchmark end to end without a
/// second, optimised compile; its figures are then not the release build's).
fn pgoutbox_bin() -> PathBuf {
    std::env::var_os("PGOUTBOX_BENCH_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| root().join("target/release/pgoutbox"))
}

fn secs(d: Duration) -> f64 {
    d.as_secs_f64()
}

fn now_us() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_micros() as i64)
        .unwrap_or(0)
}

// ---------------------------------------------------------------------------------------
// Arguments and sizes

#[derive(Debug, Clone)]
struct Args {
    quick: bool,
    runs: u32,
    scenarios: Vec<u32>,
    /// Scenario 4's producer rates (msg/s) instead of 250 / 1,000 / 2,000 / 4,000 / half the
    /// scenario-2 median.
    s4_rates: Option<Vec<f64>>,
    /// Scenario 4's pgoutbox message shapes (`--s4-shapes`; default full only).
    s4_shapes: Vec<Shape>,
}

fn parse_args() -> R<Args> {
    let mut quick = false;
    let mut runs = None;
    let mut scenarios = vec![1, 2, 3, 4, 5];
    let mut s4_rates = None;
    let mut s4_shapes = vec![Shape::Full];
    let mut it = std::env::args().skip(1);
    while let Some(a) = it.next() {
        match a.as_str() {
            "--quick" => quick = true,
            "--runs" => {
                let v = it.next().ok_or("--runs needs a number")?;
                runs = Some(v.parse::<u32>().map_err(|e| format!("--runs {v}: {e}"))?);
            }
            "--scenarios" => {
                let v = it.next().ok_or("--scenarios needs a list like 1,2,3,4,5")?;
                scenarios = v
                    .split(',')
                    .map(|s| {
                        s.trim()
                            .parse::<u32>()
                            .ok()
                            .filter(|n| (1..=5).contains(n))
                            .ok_or(format!("--scenarios: bad scenario {s:?} (1..5)"))
                    })
                    .collect::<R<Vec<_>>>()?;
            }
            "--s4-rate" => {
                let v = it
                    .next()
                    .ok_or("--s4-rate needs messages per second, e.g. 4000 or 1000,3000")?;
                s4_rates = Some(
                    v.split(',')
                        .map(|r| {
                            r.trim()
                                .parse::<f64>()
                                .ok()
                                .filter(|r| *r > 0.0)
                                .ok_or(format!(
                                    "--s4-rate {v}: expected positive numbers separated by commas"
                                ))
                        })
                        .collect::<R<Vec<f64>>>()?,
                );
            }
            "--s4-shapes" => {
                let v = it
                    .next()
                    .ok_or("--s4-shapes needs full, minimal or full,minimal")?;
                s4_shapes = v
                    .split(',')
                    .map(|s| match s.trim() {
                        "full" => Ok(Shape::Full),
                        "minimal" => Ok(Shape::Minimal),
                        other => Err(format!("--s4-shapes: bad shape {other:?} (full, minimal)")),
                    })
                    .collect::<R<Vec<_>>>()?;
            }
            "-h" | "--help" => {
                println!(
                    "usage: bench [--quick] [--runs N] [--scenarios 1,2,3,4,5] [--s4-rate MSGS_PER_S[,...]] [--s4-shapes full,minimal]\n\
                     full: ~18 min on 2 cores; --quick: ~3 min (1 run, small counts, one steady rate)"
                );
                std::process::exit(0);
            }
            other => return Err(format!("unknown argument {other:?} (try --help)")),
        }
    }
    let runs = runs.unwrap_or(if quick { 1 } else { 3 }).max(1);
    Ok(Args {
        quick,
        runs,
        scenarios,
        s4_rates,
        s4_shapes,
    })
}

struct Sizes {
    s1_n: u64,
    s2_n: u64,
    s3_bytes: u64,
    s3_min_count: u64,
    s4_secs: u64,
    s5_n: u64,
}

fn sizes(quick: bool) -> Sizes {
    if quick {
        Sizes {
            s1_n: 20_000,
            s2_n: 10_000,
            s3_bytes: 2 << 20,
            s3_min_count: 32,
            s4_secs: 5,
            s5_n: 5_000,
        }
    } else {
        Sizes {
            s1_n: 300_000,
            s2_n: 100_000,
            s3_bytes: 32 << 20,
            s3_min_count: 512,
            s4_secs: 15,
            s5_n: 200_000,
        }
    }
}

// ---------------------------------------------------------------------------------------
// The stack

struct Stack {
    dir: PathBuf,
    env: HashMap<String, String>,
    stopped: bool,
}

impl Stack {
    /// Starts the stack in `dir`, its RabbitMQ with `plugins` (comma-separated, may be empty).
    fn start(dir: &Path, plugins: &str) -> R<Stack> {
        let _ = fs::remove_dir_all(dir);
        let out = Command::new("bash")
            .arg(root().join("deploy/stack.sh"))
            .arg("start")
            .arg(dir)
            .env("PGOUTBOX_STACK_PLUGINS", plugins)
            .output()
            .map_err(|e| format!("start stack: running deploy/stack.sh: {e}"))?;
        // From here on, stop it whatever happens.
        let mut stack = Stack {
            dir: dir.to_path_buf(),
            env: HashMap::new(),
            stopped: false,
        };
        if !out.status.success() {
            return Err(format!(
                "start stack: `bash deploy/stack.sh start {}` failed ({}):\n{}",
                dir.display(),
                out.status,
                String::from_utf8_lossy(&out.stderr)
            ));
        }
        let env = fs::read_to_string(dir.join("env"))
            .map_err(|e| format!("start stack: reading {}/env: {e}", dir.display()))?;
        for line in env.lines() {
            if let Some((k, v)) = line.split_once('=') {
                stack.env.insert(k.to_string(), v.to_string());
            }
        }
        for k in [
            "PGOUTBOX_DATABASE_URL",
            "PGOUTBOX_AMQP_URL",
            "PG_PORT",
            "PG_BIN_DIR",
        ] {
            if !stack.env.contains_key(k) {
                return Err(format!("start stack: {}/env has no {k}", dir.display()));
            }
        }
        Ok(stack)
    }

    fn get(&self, k: &str) -> &str {
        self.env.get(k).map(String::as_str).unwrap_or("")
    }

    fn db_url(&self, db: &str) -> R<String> {
        let mut u = url::Url::parse(self.get("PGOUTBOX_DATABASE_URL"))
            .map_err(|e| format!("parse PGOUTBOX_DATABASE_URL: {e}"))?;
        u.set_path(&format!("/{db}"));
        Ok(u.to_string())
    }

    /// CPU seconds of the stack's Postgres cluster: the postmaster and every process it
    /// forked (backends, walsenders, background workers) that is alive now.
    fn postgres_cpu_secs(&self, tck: f64) -> Option<f64> {
        let pm = fs::read_to_string(self.dir.join("pg/data/postmaster.pid")).ok()?;
        let pm = pm.lines().next()?.trim().to_owned();
        // The postmaster's own CPU plus that of its children it has already reaped
        // (cutime + cstime), plus the live children below.
        let mut total = cpu_secs(&pm, tck)? + reaped_children_cpu_secs(&pm, tck)?;
        for entry in fs::read_dir("/proc").ok()?.flatten() {
            let name = entry.file_name();
            let Some(pid) = name
                .to_str()
                .filter(|n| n.bytes().all(|b| b.is_ascii_digit()))
            else {
                continue;
            };
            // Field 4 (index 1): the parent's pid.
            if stat_fields(pid).is_some_and(|f| f.get(1) == Some(&pm)) {
                total += cpu_secs(pid, tck).unwrap_or(0.0);
            }
        }
        Some(total)
    }

    fn rabbit_pid(&self) -> Option<u32> {
        fs::read_to_string(self.dir.join("rabbit/pid"))
            .ok()
            .and_then(|s| s.trim().parse().ok())
    }

    fn stop(&mut self) {
        if self.stopped {
            return;
        }
        self.stopped = true;
        kill_registered();
        eprintln!("bench: stopping the stack in {}", self.dir.display());
        let st = Command::new("bash")
            .arg(root().join("deploy/stack.sh"))
            .arg("stop")
            .arg(&self.dir)
            .status();
        if matches!(st, Ok(s) if s.success()) {
            let _ = fs::remove_dir_all(&self.dir);
        } else {
            eprintln!(
                "bench: WARNING: `bash deploy/stack.sh stop {}` failed: {st:?}",
                self.dir.display()
            );
        }
    }
}

impl Drop for Stack {
    fn drop(&mut self) {
        self.stop();
    }
}

// ---------------------------------------------------------------------------------------
// /proc

fn clk_tck() -> f64 {
    Command::new("getconf")
        .arg("CLK_TCK")
        .output()
        .ok()
        .and_then(|o| String::from_utf8_lossy(&o.stdout).trim().parse().ok())
        .unwrap_or(100.0)
}

/// Fields of /proc/PID/stat after `pid (comm) `: index 0 is field 3 (state).
fn stat_fields(pid: &str) -> Option<Vec<String>> {
    let s = fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    Some(
        s[s.rfind(')')? + 2..]
            .split_whitespace()
            .map(str::to_owned)
            .collect(),
    )
}

/// The sum of two /proc/PID/stat clock-tick fields (by index into [`stat_fields`]), in seconds.
fn stat_secs(pid: &str, tck: f64, a: usize, b: usize) -> Option<f64> {
    let f = stat_fields(pid)?;
    let x: f64 = f.get(a)?.parse().ok()?;
    let y: f64 = f.get(b)?.parse().ok()?;
    Some((x + y) / tck)
}

/// utime + stime of a process (fields 14, 15), in seconds.
fn cpu_secs(pid: &str, tck: f64) -> Option<f64> {
    stat_secs(pid, tck, 11, 12)
}

/// cutime + cstime of a process (fields 16, 17): CPU of its children that have exited and
/// been waited for, in seconds.
fn reaped_children_cpu_secs(pid: &str, tck: f64) -> Option<f64> {
    stat_secs(pid, tck, 13, 14)
}

fn vm_hwm_mb(pid: u32) -> Option<f64> {
    let s = fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let line = s.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kb: f64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb / 1024.0)
}

fn sh(cmd: &str, args: &[&str]) -> String {
    Command::new(cmd)
        .args(args)
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_default()
}

fn loadavg() -> String {
    fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_default()
}

// ---------------------------------------------------------------------------------------
// Postgres

async fn pg(url: &str, what: &str) -> R<tokio_postgres::Client> {
    let (client, conn) = tokio_postgres::connect(url, tokio_postgres::NoTls)
        .await
        .map_err(|e| format!("{what}: connect to Postgres ({url}): {}", pg_err(&e)))?;
    tokio::spawn(async move {
        if let Err(e) = conn.await {
            eprintln!("bench: postgres connection error: {e}");
        }
    });
    Ok(client)
}

/// The server's message, not just tokio-postgres's "db error".
fn pg_err(e: &tokio_postgres::Error) -> String {
    match e.as_db_error() {
        Some(db) => format!(
            "{}: {} (SQLSTATE {}){}",
            db.severity(),
            db.message(),
            db.code().code(),
            db.detail()
                .map(|d| format!(", detail: {d}"))
                .unwrap_or_default()
        ),
        None => e.to_string(),
    }
}

async fn sql(c: &tokio_postgres::Client, what: &str, q: &str) -> R<()> {
    c.batch_execute(q).await.map_err(|e| {
        format!(
            "{what}: SQL failed: {}\n  statement: {}",
            pg_err(&e),
            truncate(q, 300)
        )
    })
}

async fn sql_text(c: &tokio_postgres::Client, what: &str, q: &str) -> R<String> {
    let row = c
        .query_one(q, &[])
        .await
        .map_err(|e| format!("{what}: SQL failed: {}\n  statement: {q}", pg_err(&e)))?;
    row.try_get::<_, String>(0)
        .map_err(|e| format!("{what}: reading result of {q}: {e}"))
}

fn truncate(s: &str, n: usize) -> String {
    if s.len() <= n {
        s.to_string()
    } else {
        format!("{}...", &s[..n])
    }
}

fn run_cmd(what: &str, cmd: &Path, args: &[&str]) -> R<String> {
    let out = Command::new(cmd)
        .args(args)
        .output()
        .map_err(|e| format!("{what}: running {}: {e}", cmd.display()))?;
    if !out.status.success() {
        return Err(format!(
            "{what}: `{} {}` failed ({}):\n{}{}",
            cmd.display(),
            args.join(" "),
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// Writes `n` messages of `size` bytes with `per_tx` messages per transaction, on
/// [`EMIT_CONNECTIONS`] connections in parallel.
async fn emit_backlog(db_url: &str, n: u64, size: usize, per_tx: u64, topic: &str) -> R<f64> {
    let t0 = Instant::now();
    let conns = EMIT_CONNECTIONS.min(n).max(1);
    let mut tasks = Vec::new();
    for k in 0..conns {
        let count = n / conns + u64::from(k < n % conns);
        let url = db_url.to_string();
        let q = format!(
            "DO $$ DECLARE p bytea := convert_to(repeat('x', {size}), 'UTF8'); BEGIN \
             FOR i IN 1..{count} LOOP \
               PERFORM outbox.emit_bytes('{topic}', p); \
               IF i % {per_tx} = 0 THEN COMMIT; END IF; \
             END LOOP; END $$"
        );
        tasks.push(tokio::spawn(async move {
            let c = pg(&url, "emit backlog").await?;
            sql(&c, "emit backlog", &q).await
        }));
    }
    for t in tasks {
        t.await.map_err(|e| format!("emit backlog: task: {e}"))??;
    }
    Ok(secs(t0.elapsed()))
}

// ---------------------------------------------------------------------------------------
// RabbitMQ

async fn amqp(url: &str, what: &str) -> R<Connection> {
    Connection::connect(url, ConnectionProperties::default())
        .await
        .map_err(|e| format!("{what}: connect to RabbitMQ: {e}"))
}

async fn declare_bound_queue(ch: &Channel, exchange: &str, queue: &str) -> R<()> {
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
    .map_err(|e| format!("declare exchange {exchange}: {e}"))?;
    let mut args = FieldTable::default();
    args.insert(
        "x-queue-type".into(),
        AMQPValue::LongString("classic".into()),
    );
    ch.queue_declare(queue.into(), QueueDeclareOptions::durable(), args)
        .await
        .map_err(|e| format!("declare queue {queue}: {e}"))?;
    ch.queue_bind(
        queue.into(),
        exchange.into(),
        "#".into(),
        QueueBindOptions::default(),
        FieldTable::default(),
    )
    .await
    .map_err(|e| format!("bind queue {queue} to {exchange}: {e}"))?;
    Ok(())
}

async fn delete_queue(ch: &Channel, exchange: &str, queue: &str) -> R<()> {
    ch.queue_delete(queue.into(), QueueDeleteOptions::default())
        .await
        .map_err(|e| format!("delete queue {queue}: {e}"))?;
    ch.exchange_delete(exchange.into(), ExchangeDeleteOptions::default())
        .await
        .map_err(|e| format!("delete exchange {exchange}: {e}"))?;
    Ok(())
}

async fn queue_depth(ch: &Channel, queue: &str) -> R<u64> {
    let q = ch
        .queue_declare(
            queue.into(),
            QueueDeclareOptions {
                passive: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await
        .map_err(|e| format!("poll depth of queue {queue} (passive declare): {e}"))?;
    Ok(u64::from(q.message_count()))
}

/// What a message carries besides its body and routing key (`--publish-properties`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
enum Shape {
    /// pgoutbox's default: persistent, mandatory, message_id, content_type, timestamp and
    /// the headers `x-pgoutbox-lsn`, `x-pgoutbox-commit-lsn` (`X/Y` text) and
    /// `x-pgoutbox-commit-time-us` (i64).
    Full,
    /// delivery_mode 2, message_id, mandatory and the routing key only.
    Minimal,
}

impl Shape {
    fn name(self) -> &'static str {
        match self {
            Shape::Full => "full",
            Shape::Minimal => "minimal",
        }
    }
}

/// The properties of the bare publisher's message number `i` in `shape`.
fn props(i: u64, shape: Shape) -> BasicProperties {
    if shape == Shape::Minimal {
        return BasicProperties::default()
            .with_delivery_mode(2)
            .with_message_id(uuid::Uuid::new_v4().to_string().into());
    }
    // The same shape as what pgoutbox publishes: id, type, persistent, timestamp, 3 headers.
    let mut h = FieldTable::default();
    h.insert(
        "x-pgoutbox-lsn".into(),
        AMQPValue::LongString(format!("0/{:X}", 0x1000_0000 + i * 400).into()),
    );
    h.insert(
        "x-pgoutbox-commit-lsn".into(),
        AMQPValue::LongString(format!("0/{:X}", 0x1000_0000 + i * 400 + 64).into()),
    );
    h.insert(
        "x-pgoutbox-commit-time-us".into(),
        AMQPValue::LongLongInt(now_us()),
    );
    BasicProperties::default()
        .with_message_id(uuid::Uuid::new_v4().to_string().into())
        .with_content_type("application/octet-stream".into())
        .with_delivery_mode(2)
        .with_timestamp((now_us() / 1_000_000) as u64)
        .with_headers(h)
}

#[derive(Debug, Clone, Serialize)]
struct BrokerRun {
    /// The bare publisher: `lapin`, or `pgoutbox` (pgoutbox::publisher::Publisher).
    publisher: &'static str,
    shape: Shape,
    window: usize,
    n: u64,
    elapsed_s: f64,
    msgs_per_s: f64,
    client_cpu_us_per_msg: Option<f64>,
    rabbit_cpu_us_per_msg: Option<f64>,
}

/// A bare lapin publisher: persistent, mandatory, confirms on, `window` unconfirmed at most,
/// [`PIPELINE`] publish futures polled together, confirms awaited on another task; messages
/// of `shape`.
async fn broker_ceiling(
    stack: &Stack,
    tag: &str,
    n: u64,
    size: usize,
    window: usize,
    shape: Shape,
    tck: f64,
) -> R<BrokerRun> {
    let what = format!("broker ceiling {tag} {} W={window}", shape.name());
    let conn = amqp(stack.get("PGOUTBOX_AMQP_URL"), &what).await?;
    let ch = conn
        .create_channel()
        .await
        .map_err(|e| format!("{what}: channel: {e}"))?;
    let exchange = format!("bench-ceil-{tag}-{}-w{window}", shape.name());
    let queue = exchange.clone();
    declare_bound_queue(&ch, &exchange, &queue)
        .await
        .map_err(|e| format!("{what}: {e}"))?;
    ch.confirm_select(ConfirmSelectOptions::default())
        .await
        .map_err(|e| format!("{what}: confirm_select: {e}"))?;
    let payload = vec![b'x'; size];
    let sem = Arc::new(Semaphore::new(window));
    let (tx, mut rx) = mpsc::unbounded_channel::<(PublisherConfirm, OwnedSemaphorePermit)>();
    let confirmer = tokio::spawn(async move {
        let mut acked = 0u64;
        while let Some((c, permit)) = rx.recv().await {
            match c.await {
                Ok(Confirmation::Ack(None)) => acked += 1,
                Ok(other) => return Err(format!("unexpected confirmation {other:?}")),
                Err(e) => return Err(format!("confirm failed: {e}")),
            }
            drop(permit);
        }
        Ok(acked)
    });
    let rpid = stack.rabbit_pid().map(|p| p.to_string());
    let r0 = rpid.as_deref().and_then(|p| cpu_secs(p, tck));
    let c0 = cpu_secs("self", tck);
    let t0 = Instant::now();
    let ex: ShortString = exchange.as_str().into();
    let rk: ShortString = "bench.ceiling".into();
    let mut i = 0u64;
    while i < n {
        let batch = (n - i).min(PIPELINE as u64);
        let mut permits = Vec::with_capacity(batch as usize);
        for _ in 0..batch {
            permits.push(
                sem.clone()
                    .acquire_owned()
                    .await
                    .map_err(|e| format!("{what}: semaphore: {e}"))?,
            );
        }
        let futs: Vec<_> = (0..batch)
            .map(|k| {
                ch.basic_publish(
                    ex.clone(),
                    rk.clone(),
                    BasicPublishOptions {
                        mandatory: true,
                        ..Default::default()
                    },
                    &payload,
                    props(i + k, shape),
                )
            })
            .collect();
        for (res, permit) in futures::future::join_all(futs)
            .await
            .into_iter()
            .zip(permits)
        {
            let confirm = res.map_err(|e| format!("{what}: basic_publish: {e}"))?;
            tx.send((confirm, permit))
                .map_err(|_| format!("{what}: the confirm task ended early"))?;
        }
        i += batch;
    }
    drop(tx);
    let acked = confirmer
        .await
        .map_err(|e| format!("{what}: confirm task: {e}"))?
        .map_err(|e| format!("{what}: {e}"))?;
    let elapsed = secs(t0.elapsed());
    let c1 = cpu_secs("self", tck);
    let r1 = rpid.as_deref().and_then(|p| cpu_secs(p, tck));
    if acked != n {
        return Err(format!("{what}: {acked} of {n} confirmed"));
    }
    let depth = queue_depth(&ch, &queue).await?;
    if depth != n {
        return Err(format!("{what}: queue holds {depth}, expected {n}"));
    }
    delete_queue(&ch, &exchange, &queue)
        .await
        .map_err(|e| format!("{what}: {e}"))?;
    let _ =
        tokio::time::timeout(Duration::from_secs(5), conn.close(200, "bench done".into())).await;
    let per = |a: Option<f64>, b: Option<f64>| Some((b? - a?) * 1e6 / n as f64);
    Ok(BrokerRun {
        publisher: "lapin",
        shape,
        window,
        n,
        elapsed_s: elapsed,
        msgs_per_s: n as f64 / elapsed,
        client_cpu_us_per_msg: per(c0, c1),
        rabbit_cpu_us_per_msg: per(r0, r1),
    })
}

/// A bare publisher on pgoutbox's own AMQP connection (`pgoutbox::publisher::Publisher`):
/// the same messages as [`broker_ceiling`], at most `window` unsettled, refilled after every
/// batch of outcomes.
async fn broker_ceiling_own(
    stack: &Stack,
    tag: &str,
    n: u64,
    size: usize,
    window: usize,
    shape: Shape,
    tck: f64,
) -> R<BrokerRun> {
    use pgoutbox::publisher::{
        MatchKey, OutboundMessage, PublishOutcome, Publisher, PublisherConfig,
    };
    let what = format!(
        "broker ceiling (own publisher) {tag} {} W={window}",
        shape.name()
    );
    let admin = amqp(stack.get("PGOUTBOX_AMQP_URL"), &what).await?;
    let ch = admin
        .create_channel()
        .await
        .map_err(|e| format!("{what}: channel: {e}"))?;
    let exchange = format!("bench-ceil-own-{tag}-{}-w{window}", shape.name());
    let queue = exchange.clone();
    declare_bound_queue(&ch, &exchange, &queue)
        .await
        .map_err(|e| format!("{what}: {e}"))?;
    let config = PublisherConfig {
        amqp_url: stack.get("PGOUTBOX_AMQP_URL").into(),
        exchange: exchange.clone(),
        declare: pgoutbox::publisher::connection::Declare::DurableTopic,
        connection_name: format!("bench ceiling {tag}"),
        signals: Default::default(),
    };
    let mut publisher: Publisher<u64> = Publisher::connect(&config)
        .await
        .map_err(|e| format!("{what}: connect: {e}"))?;
    let payload = bytes::Bytes::from(vec![b'x'; size]);
    let rk: ShortString = "bench.ceiling".into();
    let rpid = stack.rabbit_pid().map(|p| p.to_string());
    let r0 = rpid.as_deref().and_then(|p| cpu_secs(p, tck));
    let c0 = cpu_secs("self", tck);
    let t0 = Instant::now();
    let (mut sent, mut settled) = (0u64, 0u64);
    while settled < n {
        while sent < n && sent - settled < window as u64 {
            let properties = props(sent, shape);
            let match_key = match shape {
                // The same LSN props() put into x-pgoutbox-lsn.
                Shape::Full => MatchKey::Lsn(pgoutbox::lsn::Lsn(0x1000_0000 + sent * 400)),
                Shape::Minimal => MatchKey::MessageId(
                    properties
                        .message_id()
                        .clone()
                        .ok_or(format!("{what}: no message_id"))?,
                ),
            };
            publisher
                .publish(OutboundMessage {
                    tag: sent,
                    exchange: pgoutbox::publisher::Exchange::Configured,
                    routing_key: rk.clone(),
                    body: payload.clone(),
                    properties,
                    match_key,
                })
                .map_err(|e| format!("{what}: publish: {e}"))?;
            sent += 1;
        }
        let outcomes = publisher
            .recv_outcomes()
            .await
            .map_err(|e| format!("{what}: {e}"))?;
        for (i, outcome) in &outcomes {
            if *outcome != PublishOutcome::Routed {
                return Err(format!("{what}: message {i}: {outcome}"));
            }
        }
        settled += outcomes.len() as u64;
    }
    let elapsed = secs(t0.elapsed());
    let c1 = cpu_secs("self", tck);
    let r1 = rpid.as_deref().and_then(|p| cpu_secs(p, tck));
    publisher.close().await;
    let depth = queue_depth(&ch, &queue).await?;
    if depth != n {
        return Err(format!("{what}: queue holds {depth}, expected {n}"));
    }
    delete_queue(&ch, &exchange, &queue)
        .await
        .map_err(|e| format!("{what}: {e}"))?;
    let _ = tokio::time::timeout(
        Duration::from_secs(5),
        admin.close(200, "bench done".into()),
    )
    .await;
    let per = |a: Option<f64>, b: Option<f64>| Some((b? - a?) * 1e6 / n as f64);
    Ok(BrokerRun {
        publisher: "pgoutbox",
        shape,
        window,
        n,
        elapsed_s: elapsed,
        msgs_per_s: n as f64 / elapsed,
        client_cpu_us_per_msg: per(c0, c1),
        rabbit_cpu_us_per_msg: per(r0, r1),
    })
}

// ---------------------------------------------------------------------------------------
// The relays (pgoutbox, the Node relay) and pg_recvlogical as children

/// Whether pgoutbox serves `/metrics` (`--http-addr`) during a run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Metrics {
    /// On an ephemeral loopback port (so runs never collide on the default address).
    On,
    /// `PGOUTBOX_HTTP_ADDR=off`.
    Off,
}

/// What a drain or latency row ran.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Relay {
    /// `target/release/pgoutbox run` with this `--publish-properties` shape.
    Pgoutbox(Shape, Metrics),
    /// `target/release/pgoutbox run --journal`, full shape, metrics on: the delivery
    /// journal's cost, drained next to [`Relay::Pgoutbox`] full on the same backlog.
    PgoutboxJournal,
    /// `relay.js` of the Node peer (persistent, mandatory, messageId = message LSN).
    Node,
}

impl Relay {
    /// Short and unique: used in database, exchange, queue, slot and log names.
    fn key(self) -> &'static str {
        match self {
            Relay::Pgoutbox(Shape::Full, Metrics::On) => "full",
            Relay::Pgoutbox(Shape::Full, Metrics::Off) => "fulloff",
            Relay::Pgoutbox(Shape::Minimal, Metrics::On) => "minimal",
            Relay::Pgoutbox(Shape::Minimal, Metrics::Off) => "minimaloff",
            Relay::PgoutboxJournal => "fulljournal",
            Relay::Node => "node",
        }
    }

    fn label(self) -> &'static str {
        match self {
            Relay::Pgoutbox(Shape::Full, Metrics::On) => "pgoutbox full",
            Relay::Pgoutbox(Shape::Full, Metrics::Off) => "pgoutbox full, metrics off",
            Relay::Pgoutbox(Shape::Minimal, Metrics::On) => "pgoutbox minimal",
            Relay::Pgoutbox(Shape::Minimal, Metrics::Off) => "pgoutbox minimal, metrics off",
            Relay::PgoutboxJournal => "pgoutbox full, journal on",
            Relay::Node => "Node relay",
        }
    }

    fn program(self) -> &'static str {
        match self {
            Relay::Pgoutbox(..) | Relay::PgoutboxJournal => "pgoutbox",
            Relay::Node => "node",
        }
    }

    /// The shape it is asked to send; the Node relay's is the minimal one.
    fn shape(self) -> Shape {
        match self {
            Relay::Pgoutbox(shape, _) => shape,
            Relay::PgoutboxJournal => Shape::Full,
            Relay::Node => Shape::Minimal,
        }
    }

    fn metrics(self) -> &'static str {
        match self {
            Relay::Pgoutbox(_, Metrics::On) | Relay::PgoutboxJournal => "on",
            Relay::Pgoutbox(_, Metrics::Off) => "off",
            Relay::Node => "n/a",
        }
    }

    /// Whether it keeps the delivery journal (`--journal`).
    fn journal(self) -> &'static str {
        match self {
            Relay::PgoutboxJournal => "on",
            Relay::Pgoutbox(..) => "off",
            Relay::Node => "n/a",
        }
    }
}

/// The Node relay peer, installed under [`NODE_PEER_DIR`].
#[derive(Debug, Clone)]
struct NodePeer {
    dir: PathBuf,
    node_version: String,
}

/// The peer's source folder: `PGOUTBOX_BENCH_NODE_PEER`, else `../shared/peers/node` from
/// the repository (or from the directory above, for a worktree under `wt/`).
fn node_peer_source() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("PGOUTBOX_BENCH_NODE_PEER") {
        return Some(PathBuf::from(p));
    }
    [
        root().join("../shared/peers/node"),
        root().join("../../shared/peers/node"),
    ]
    .into_iter()
    .find(|p| p.join("relay.js").is_file())
}

/// Copies the Node relay to [`NODE_PEER_DIR`] and runs `npm ci` there unless its
/// `node_modules` was installed from the same `package-lock.json`. `Err` is the note that
/// says why the peer is skipped (no node or npm, no source folder, npm failed).
fn prepare_node_peer(log_dir: &Path) -> Result<NodePeer, String> {
    let version = |cmd: &str| {
        Command::new(cmd)
            .arg("--version")
            .output()
            .ok()
            .filter(|o| o.status.success())
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
    };
    let node_version = version("node").ok_or("node is not installed")?;
    version("npm").ok_or("npm is not installed")?;
    let src = node_peer_source().ok_or(
        "the Node relay's folder was not found (../shared/peers/node; set \
         PGOUTBOX_BENCH_NODE_PEER)",
    )?;
    let dir = root().join(NODE_PEER_DIR);
    fs::create_dir_all(&dir).map_err(|e| format!("create {}: {e}", dir.display()))?;
    let entries = fs::read_dir(&src).map_err(|e| format!("read {}: {e}", src.display()))?;
    for entry in entries.flatten() {
        let path = entry.path();
        if path.is_file() {
            let to = dir.join(entry.file_name());
            fs::copy(&path, &to)
                .map_err(|e| format!("copy {} to {}: {e}", path.display(), to.display()))?;
        }
    }
    // `npm ci` once per lock file: the stamp holds the lock file it installed.
    let lock = fs::read(dir.join("package-lock.json"))
        .map_err(|e| format!("read {}/package-lock.json: {e}", dir.display()))?;
    let stamp = dir.join("node_modules/.bench-installed-lock.json");
    if fs::read(&stamp).ok().as_deref() == Some(&lock[..]) {
        eprintln!(
            "bench: Node relay: node_modules in {} is up to date",
            dir.display()
        );
    } else {
        let log = log_dir.join("npm-ci.log");
        eprintln!(
            "bench: Node relay: npm ci in {} (log {})",
            dir.display(),
            log.display()
        );
        let file = fs::File::create(&log).map_err(|e| format!("create {}: {e}", log.display()))?;
        let st = Command::new("npm")
            .args(["ci", "--no-audit", "--no-fund"])
            .current_dir(&dir)
            .stdin(Stdio::null())
            .stdout(
                file.try_clone()
                    .map_err(|e| format!("log file {}: {e}", log.display()))?,
            )
            .stderr(file)
            .status()
            .map_err(|e| format!("run npm ci: {e}"))?;
        if !st.success() {
            return Err(format!("`npm ci` failed ({st}); see {}", log.display()));
        }
        fs::write(&stamp, &lock).map_err(|e| format!("write {}: {e}", stamp.display()))?;
    }
    Ok(NodePeer { dir, node_version })
}

/// Whether the release binary has `--publish-properties` (an older one ignores the
/// environment variable and sends the full shape).
fn binary_has_publish_properties() -> bool {
    let out = Command::new(pgoutbox_bin())
        .args(["run", "--help"])
        .output();
    matches!(out, Ok(o) if String::from_utf8_lossy(&o.stdout).contains("--publish-properties"))
}

/// Where a relay streams from and publishes to.
struct Target<'a> {
    db: &'a str,
    db_url: &'a str,
    slot: &'a str,
    exchange: &'a str,
}

struct Streamer {
    child: Child,
    pid: u32,
    log: PathBuf,
    program: &'static str,
}

impl Streamer {
    /// Starts `relay` on `target`; `node` is required for [`Relay::Node`].
    fn start(
        stack: &Stack,
        relay: Relay,
        node: Option<&NodePeer>,
        target: &Target<'_>,
        log: PathBuf,
    ) -> R<Streamer> {
        let file = fs::File::create(&log).map_err(|e| format!("create {}: {e}", log.display()))?;
        let mut cmd = match relay {
            Relay::Pgoutbox(..) | Relay::PgoutboxJournal => {
                let (shape, metrics) = match relay {
                    Relay::Pgoutbox(shape, metrics) => (shape, metrics),
                    _ => (Shape::Full, Metrics::On),
                };
                let mut cmd = Command::new(pgoutbox_bin());
                if relay == Relay::PgoutboxJournal {
                    // The variable too would do; the flag fails loudly on a binary without it.
                    cmd.env("PGOUTBOX_JOURNAL", "true");
                }
                cmd.args([
                    "run",
                    "--database-url",
                    target.db_url,
                    "--amqp-url",
                    stack.get("PGOUTBOX_AMQP_URL"),
                    "--slot",
                    target.slot,
                    "--publication",
                    PUBLICATION,
                    "--exchange",
                    target.exchange,
                    "--max-in-flight",
                    &PGOUTBOX_WINDOW.to_string(),
                ])
                // Through the environment: a binary without the option ignores it (the row
                // then reports the shape that really arrived).
                .env("PGOUTBOX_PUBLISH_PROPERTIES", shape.name())
                .env(
                    "PGOUTBOX_HTTP_ADDR",
                    match metrics {
                        Metrics::On => "127.0.0.1:0",
                        Metrics::Off => "off",
                    },
                );
                cmd
            }
            Relay::Node => {
                let peer = node.ok_or("the Node relay is not installed")?;
                let mut cmd = Command::new("node");
                cmd.arg("relay.js")
                    .current_dir(&peer.dir)
                    .env("PGHOST", "127.0.0.1")
                    .env("PGPORT", stack.get("PG_PORT"))
                    .env("PGUSER", "postgres")
                    .env("PGDATABASE", target.db)
                    .env("SLOT", target.slot)
                    .env("PUBLICATION", PUBLICATION)
                    .env("PREFIX", MESSAGE_PREFIX)
                    .env("AMQP_URL", stack.get("PGOUTBOX_AMQP_URL"))
                    .env("EXCHANGE", target.exchange)
                    .env("WINDOW", PGOUTBOX_WINDOW.to_string());
                cmd
            }
        };
        let child = cmd
            .stdin(Stdio::null())
            .stdout(
                file.try_clone()
                    .map_err(|e| format!("log file {}: {e}", log.display()))?,
            )
            .stderr(file)
            .spawn()
            .map_err(|e| format!("start {}: {e}", relay.program()))?;
        let pid = child.id();
        register(pid);
        Ok(Streamer {
            child,
            pid,
            log,
            program: relay.program(),
        })
    }

    /// The `/metrics` address pgoutbox logged at startup (waits up to 10 s for the line).
    async fn http_addr(&self) -> Option<String> {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let text = fs::read_to_string(&self.log).unwrap_or_default();
            if let Some(at) = text.find("http_addr=") {
                let rest = &text[at + "http_addr=".len()..];
                let addr: String = rest
                    .chars()
                    .take_while(|c| !c.is_whitespace() && *c != '"')
                    .collect();
                return Some(addr);
            }
            if Instant::now() > deadline {
                return None;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    fn log_tail(&self) -> String {
        let s = fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = s.lines().collect();
        lines[lines.len().saturating_sub(30)..].join("\n")
    }

    /// Fails if the process has exited.
    fn check_alive(&mut self, what: &str) -> R<()> {
        if let Ok(Some(st)) = self.child.try_wait() {
            unregister(self.pid);
            return Err(format!(
                "{what}: {} exited early ({st}); log {}:\n{}",
                self.program,
                self.log.display(),
                self.log_tail()
            ));
        }
        Ok(())
    }

    /// SIGTERM, then wait (40 s) for a clean exit. Returns the exit status text.
    async fn stop(mut self) -> String {
        let _ = Command::new("kill")
            .args(["-TERM", &self.pid.to_string()])
            .status();
        let deadline = Instant::now() + Duration::from_secs(40);
        let status = loop {
            match self.child.try_wait() {
                Ok(Some(st)) => break st.to_string(),
                Ok(None) if Instant::now() < deadline => {
                    tokio::time::sleep(Duration::from_millis(20)).await
                }
                _ => {
                    let _ = Command::new("kill")
                        .args(["-KILL", &self.pid.to_string()])
                        .status();
                    let _ = self.child.wait();
                    break "killed after 40 s without exiting on SIGTERM".into();
                }
            }
        };
        unregister(self.pid);
        if status != "exit status: 0" {
            eprintln!(
                "bench: WARNING: {} did not exit cleanly on SIGTERM: {status}; log {}:\n{}",
                self.program,
                self.log.display(),
                self.log_tail()
            );
        }
        status
    }
}

async fn decode_ceiling(stack: &Stack, db: &str, endpos: &str, n: u64) -> R<f64> {
    let bin = Path::new(stack.get("PG_BIN_DIR")).join("pg_recvlogical");
    let port = stack.get("PG_PORT").to_string();
    let args: Vec<String> = [
        "-h",
        "127.0.0.1",
        "-p",
        &port,
        "-U",
        "postgres",
        "-d",
        db,
        "--slot",
        TWIN,
        "--start",
        "-o",
        "proto_version=1",
        "-o",
        &format!("publication_names={PUBLICATION}"),
        "-o",
        "messages=true",
        "-E",
        endpos,
        "-f",
        "/dev/null",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let cmdline = format!("{} {}", bin.display(), args.join(" "));
    let t0 = Instant::now();
    let child = Command::new(&bin)
        .args(&args)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| format!("decode ceiling: start `{cmdline}`: {e}"))?;
    let pid = child.id();
    register(pid);
    let limit = Duration::from_secs(120 + n / 5_000);
    let waited = tokio::time::timeout(
        limit,
        tokio::task::spawn_blocking(move || child.wait_with_output()),
    )
    .await;
    let elapsed = secs(t0.elapsed());
    unregister(pid);
    let out = match waited {
        Err(_) => {
            let _ = Command::new("kill")
                .args(["-TERM", &pid.to_string()])
                .status();
            return Err(format!(
                "decode ceiling: `{cmdline}` did not reach the end position within {limit:?}"
            ));
        }
        Ok(j) => j
            .map_err(|e| format!("decode ceiling: join: {e}"))?
            .map_err(|e| format!("decode ceiling: wait for `{cmdline}`: {e}"))?,
    };
    if !out.status.success() {
        return Err(format!(
            "decode ceiling: `{cmdline}` failed ({}):\n{}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    Ok(n as f64 / elapsed)
}

// ---------------------------------------------------------------------------------------
// One backlog drained by each relay, with its ceilings

/// One scenario run's backlog and the ceilings measured on it.
#[derive(Debug, Clone, Serialize)]
struct CaseRun {
    scenario: String,
    run: u32,
    n: u64,
    size: usize,
    per_tx: u64,
    emit_s: f64,
    decode_s: f64,
    decode_msgs_per_s: f64,
    /// The relays in the order they drained the backlog.
    order: Vec<String>,
    broker: Vec<BrokerRun>,
    load_before: String,
}

impl CaseRun {
    /// The best broker-ceiling run with messages of `shape`.
    fn best_broker(&self, shape: Shape) -> Option<&BrokerRun> {
        self.broker
            .iter()
            .filter(|b| b.shape == shape)
            .max_by(|a, b| a.msgs_per_s.total_cmp(&b.msgs_per_s))
    }
}

/// One relay's drain of a [`CaseRun`]'s backlog.
#[derive(Debug, Clone, Serialize)]
struct DrainRun {
    scenario: String,
    run: u32,
    n: u64,
    size: usize,
    per_tx: u64,
    /// The row's label, e.g. "pgoutbox minimal" or "Node relay".
    relay: String,
    program: String,
    /// The shape it was asked to send (`PGOUTBOX_PUBLISH_PROPERTIES`; the Node relay: minimal).
    shape: Shape,
    /// The shape of a message taken from its queue after the drain: full, minimal, other.
    observed_shape: String,
    /// pgoutbox's `/metrics` server: on, off (n/a for the Node relay).
    metrics: String,
    /// pgoutbox's delivery journal (`--journal`): on, off (n/a for the Node relay).
    journal: String,
    /// 0-based position in the run's drain order.
    position: usize,
    decode_msgs_per_s: f64,
    drain_s: f64,
    msgs_per_s: f64,
    mb_per_s: f64,
    cpu_us_per_msg: f64,
    cpu_share_of_wall: f64,
    peak_rss_mb: f64,
    walsender_cpu_us_per_msg: Option<f64>,
    rabbit_cpu_us_per_msg: Option<f64>,
    window: usize,
    /// The shape whose broker ceiling the ratio uses: the observed one when it is known.
    ceiling_shape: Shape,
    broker_msgs_per_s: f64,
    broker_best_window: usize,
    /// The bare publisher of the best broker run: lapin or pgoutbox.
    broker_best_publisher: String,
    ceiling_msgs_per_s: f64,
    ceiling_is: String,
    ratio: f64,
    exit_status: String,
}

struct Ctx {
    stack: Stack,
    admin: tokio_postgres::Client,
    amqp: Connection,
    ch: Channel,
    tck: f64,
    log_dir: PathBuf,
    /// The Node relay, or why it is skipped.
    node: Result<NodePeer, String>,
}

impl Ctx {
    fn node(&self) -> Option<&NodePeer> {
        self.node.as_ref().ok()
    }
}

async fn fresh_db(ctx: &Ctx, db: &str) -> R<String> {
    sql(
        &ctx.admin,
        "fresh database",
        &format!("DROP DATABASE IF EXISTS {db} WITH (FORCE)"),
    )
    .await?;
    sql(
        &ctx.admin,
        "fresh database",
        &format!("CREATE DATABASE {db}"),
    )
    .await?;
    let url = ctx.stack.db_url(db)?;
    let bin = pgoutbox_bin();
    run_cmd(
        &format!("pgoutbox setup in {db}"),
        &bin,
        &[
            "setup",
            "--database-url",
            &url,
            "--slot",
            SLOT,
            "--publication",
            PUBLICATION,
        ],
    )?;
    Ok(url)
}

async fn drop_db(ctx: &Ctx, db: &str) -> R<()> {
    let c = pg(&ctx.stack.db_url(db)?, "drop database").await?;
    // The walsender may need a moment to release the slot after pgoutbox exits.
    let mut tries = 0;
    loop {
        let r = c
            .batch_execute(&format!(
                "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots \
                 WHERE database = '{db}'"
            ))
            .await;
        match r {
            Ok(()) => break,
            Err(e) if tries < 50 => {
                tries += 1;
                if tries == 50 {
                    return Err(format!("drop slots of {db}: {}", pg_err(&e)));
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(e) => return Err(format!("drop slots of {db}: {}", pg_err(&e))),
        }
    }
    drop(c);
    sql(
        &ctx.admin,
        "drop database",
        &format!("DROP DATABASE IF EXISTS {db} WITH (FORCE)"),
    )
    .await
}

async fn walsender_pid(c: &tokio_postgres::Client, slot: &str) -> Option<String> {
    let row = c
        .query_opt(
            &format!("SELECT active_pid FROM pg_replication_slots WHERE slot_name = '{slot}'"),
            &[],
        )
        .await
        .ok()??;
    row.try_get::<_, Option<i32>>(0)
        .ok()?
        .map(|p| p.to_string())
}

/// The shape of a message as it arrived: `full` (our LSN header and a content type),
/// `minimal` (no content type, no timestamp, no headers or an empty table: amqplib always
/// sends one), or `other`.
fn classify_shape(p: &BasicProperties) -> &'static str {
    let headers = p.headers().as_ref().map(|h| h.inner());
    if headers.is_some_and(|h| h.contains_key("x-pgoutbox-lsn")) && p.content_type().is_some() {
        "full"
    } else if headers.is_none_or(|h| h.is_empty())
        && p.content_type().is_none()
        && p.timestamp().is_none()
    {
        "minimal"
    } else {
        "other"
    }
}

/// Takes one message off `queue` and says which shape it has.
async fn observe_shape(ch: &Channel, queue: &str) -> String {
    match ch
        .basic_get(queue.into(), BasicGetOptions { no_ack: true })
        .await
    {
        Ok(Some(m)) => classify_shape(&m.delivery.properties).to_string(),
        Ok(None) => "none (queue empty)".into(),
        Err(e) => format!("unknown ({e})"),
    }
}

/// What one relay's drain measured.
struct Drained {
    drain_s: f64,
    cpu_s: f64,
    rss_mb: f64,
    walsender_cpu_s: Option<f64>,
    rabbit_cpu_s: Option<f64>,
    observed_shape: String,
    exit_status: String,
}

/// Starts `relay` on `target`, waits until `queue` holds `n` messages, and stops it.
async fn drain_relay(
    ctx: &Ctx,
    tag: &str,
    relay: Relay,
    target: &Target<'_>,
    queue: &str,
    n: u64,
    c: &tokio_postgres::Client,
) -> R<Drained> {
    let rpid = ctx.stack.rabbit_pid().map(|p| p.to_string());
    let r0 = rpid.as_deref().and_then(|p| cpu_secs(p, ctx.tck));
    let log = ctx
        .log_dir
        .join(format!("{}-{tag}-{}.log", relay.program(), relay.key()));
    let t0 = Instant::now();
    let mut streamer = Streamer::start(&ctx.stack, relay, ctx.node(), target, log)?;
    let limit = Duration::from_secs(120 + n / 2_000);
    let mut last = (0u64, Instant::now());
    let drain = loop {
        let depth = queue_depth(&ctx.ch, queue)
            .await
            .map_err(|e| format!("[{tag}] {e}"))?;
        if depth >= n {
            break t0.elapsed();
        }
        streamer.check_alive(&format!("[{tag}] {} drain", relay.label()))?;
        if depth != last.0 {
            last = (depth, Instant::now());
        }
        if t0.elapsed() > limit || last.1.elapsed() > Duration::from_secs(60) {
            let pid = streamer.pid;
            let tail = streamer.log_tail();
            let _ = streamer.stop().await;
            return Err(format!(
                "[{tag}] {} drain: queue {queue} holds {depth} of {n} after {:?} (no progress \
                 for {:?}); pid {pid} log:\n{tail}",
                relay.label(),
                t0.elapsed(),
                last.1.elapsed()
            ));
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let pid = streamer.pid.to_string();
    let cpu_s = cpu_secs(&pid, ctx.tck).ok_or(format!("[{tag}] read /proc/{pid}/stat"))?;
    let rss_mb = vm_hwm_mb(streamer.pid).ok_or(format!("[{tag}] read /proc/{pid}/status"))?;
    let walsender_cpu_s = match walsender_pid(c, target.slot).await {
        Some(p) => cpu_secs(&p, ctx.tck),
        None => None,
    };
    let r1 = rpid.as_deref().and_then(|p| cpu_secs(p, ctx.tck));
    let exit_status = streamer.stop().await;
    let depth = queue_depth(&ctx.ch, queue).await?;
    if depth != n {
        eprintln!(
            "bench: WARNING: [{tag}] {}: queue holds {depth} messages, expected exactly {n}",
            relay.label()
        );
    }
    let observed_shape = observe_shape(&ctx.ch, queue).await;
    Ok(Drained {
        drain_s: secs(drain),
        cpu_s,
        rss_mb,
        walsender_cpu_s,
        rabbit_cpu_s: match (r0, r1) {
            (Some(a), Some(b)) => Some(b - a),
            _ => None,
        },
        observed_shape,
        exit_status,
    })
}

/// The slot `relay` streams from in a drain case: pgoutbox full (metrics on) takes the one
/// `pgoutbox setup` made, the others their own.
fn slot_of(relay: Relay) -> String {
    match relay {
        Relay::Pgoutbox(Shape::Full, Metrics::On) => SLOT.to_string(),
        other => format!("{SLOT}_{}", other.key()),
    }
}

/// Writes one backlog, measures its decode ceiling, drains it with each of `relays` (in
/// this order) and measures the broker ceiling for each shape they send.
#[allow(clippy::too_many_arguments)]
async fn drain_case(
    ctx: &Ctx,
    scenario: &str,
    run: u32,
    n: u64,
    size: usize,
    per_tx: u64,
    relays: &[Relay],
) -> R<(CaseRun, Vec<DrainRun>)> {
    let tag = format!("{scenario}_r{run}");
    let db = format!("bench_{tag}");
    let order: Vec<&str> = relays.iter().map(|r| r.label()).collect();
    eprintln!(
        "bench: [{tag}] {n} x {size} B, {per_tx} per transaction; drains: {} (load {})",
        order.join(", "),
        loadavg()
    );
    let load_before = loadavg();
    let url = fresh_db(ctx, &db).await?;
    let c = pg(&url, &tag).await?;
    // The twin slot and every other relay's slot: right after pgoutbox's, before the backlog.
    let mut slots = vec![TWIN.to_string()];
    slots.extend(relays.iter().map(|r| slot_of(*r)).filter(|s| s != SLOT));
    for slot in &slots {
        sql(
            &c,
            &format!("[{tag}] create slot {slot}"),
            &format!("SELECT pg_create_logical_replication_slot('{slot}', 'pgoutput')"),
        )
        .await?;
    }
    for relay in relays {
        let name = format!("bench-{tag}-{}", relay.key());
        declare_bound_queue(&ctx.ch, &name, &name)
            .await
            .map_err(|e| format!("[{tag}] {e}"))?;
    }

    let emit_s = emit_backlog(&url, n, size, per_tx, &format!("bench.{scenario}"))
        .await
        .map_err(|e| format!("[{tag}] {e}"))?;
    let endpos = sql_text(&c, &tag, "SELECT pg_current_wal_lsn()::text").await?;
    eprintln!("bench: [{tag}] backlog written in {emit_s:.1} s, end {endpos}; decode ceiling");

    let t0 = Instant::now();
    let decode = decode_ceiling(&ctx.stack, &db, &endpos, n)
        .await
        .map_err(|e| format!("[{tag}] {e}"))?;
    let decode_s = secs(t0.elapsed());
    sql(
        &c,
        &format!("[{tag}] drop twin slot"),
        &format!("SELECT pg_drop_replication_slot('{TWIN}')"),
    )
    .await?;
    eprintln!("bench: [{tag}] decode ceiling {decode:.0} msg/s");

    let mut drained = Vec::new();
    for (position, relay) in relays.iter().enumerate() {
        let name = format!("bench-{tag}-{}", relay.key());
        let slot = slot_of(*relay);
        let target = Target {
            db: &db,
            db_url: &url,
            slot: &slot,
            exchange: &name,
        };
        let result = drain_relay(ctx, &tag, *relay, &target, &name, n, &c).await;
        delete_queue(&ctx.ch, &name, &name)
            .await
            .map_err(|e| format!("[{tag}] {e}"))?;
        // Free the WAL this slot held for the drains still to come.
        sql(
            &c,
            &format!("[{tag}] drop slot {slot}"),
            &format!(
                "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots \
                 WHERE slot_name = '{slot}' AND NOT active"
            ),
        )
        .await?;
        match result {
            Ok(d) => {
                eprintln!(
                    "bench: [{tag}] {}: {:.0} msg/s ({:.2} s), CPU {:.1} us/msg, sent {}",
                    relay.label(),
                    n as f64 / d.drain_s,
                    d.drain_s,
                    d.cpu_s * 1e6 / n as f64,
                    d.observed_shape
                );
                drained.push((position, *relay, d));
            }
            // A peer that fails is reported, not fatal: the bench is about pgoutbox.
            Err(e) if *relay == Relay::Node => {
                eprintln!("bench: WARNING: [{tag}] the Node relay failed, row left out: {e}")
            }
            Err(e) => return Err(e),
        }
    }
    drop(c);
    drop_db(ctx, &db)
        .await
        .map_err(|e| format!("[{tag}] {e}"))?;

    let mut shapes: Vec<Shape> = Vec::new();
    for relay in relays {
        if !shapes.contains(&relay.shape()) {
            shapes.push(relay.shape());
        }
    }
    let mut broker = Vec::new();
    let m = n.min(BROKER_CAP);
    for shape in shapes {
        for w in BROKER_WINDOWS {
            let b = broker_ceiling(&ctx.stack, &tag, m, size, w, shape, ctx.tck).await?;
            eprintln!(
                "bench: [{tag}] broker {} lapin W={w}: {:.0} msg/s",
                shape.name(),
                b.msgs_per_s
            );
            broker.push(b);
        }
        let w = OWN_PUBLISHER_WINDOW;
        let b = broker_ceiling_own(&ctx.stack, &tag, m, size, w, shape, ctx.tck).await?;
        eprintln!(
            "bench: [{tag}] broker {} own publisher W={w}: {:.0} msg/s",
            shape.name(),
            b.msgs_per_s
        );
        broker.push(b);
    }
    let case = CaseRun {
        scenario: scenario.to_string(),
        run,
        n,
        size,
        per_tx,
        emit_s,
        decode_s,
        decode_msgs_per_s: decode,
        order: order.iter().map(|s| s.to_string()).collect(),
        broker,
        load_before,
    };
    let mut rows = Vec::new();
    for (position, relay, d) in drained {
        let ceiling_shape = match d.observed_shape.as_str() {
            "full" => Shape::Full,
            "minimal" => Shape::Minimal,
            _ => relay.shape(),
        };
        // The ceiling of a shape no relay was asked for (an older binary sent full when
        // asked for minimal) was not measured: fall back to the requested shape's.
        let best = case
            .best_broker(ceiling_shape)
            .map(|b| (ceiling_shape, b))
            .or_else(|| case.best_broker(relay.shape()).map(|b| (relay.shape(), b)))
            .ok_or("no broker run")?;
        let (ceiling_shape, best) = (best.0, best.1.clone());
        let (ceiling, ceiling_is) = if decode <= best.msgs_per_s {
            (decode, "decode")
        } else {
            (best.msgs_per_s, "broker")
        };
        let rate = n as f64 / d.drain_s;
        rows.push(DrainRun {
            scenario: scenario.to_string(),
            run,
            n,
            size,
            per_tx,
            relay: relay.label().to_string(),
            program: relay.program().to_string(),
            shape: relay.shape(),
            observed_shape: d.observed_shape,
            metrics: relay.metrics().to_string(),
            journal: relay.journal().to_string(),
            position,
            decode_msgs_per_s: decode,
            drain_s: d.drain_s,
            msgs_per_s: rate,
            mb_per_s: rate * size as f64 / 1e6,
            cpu_us_per_msg: d.cpu_s * 1e6 / n as f64,
            cpu_share_of_wall: d.cpu_s / d.drain_s,
            peak_rss_mb: d.rss_mb,
            walsender_cpu_us_per_msg: d.walsender_cpu_s.map(|s| s * 1e6 / n as f64),
            rabbit_cpu_us_per_msg: d.rabbit_cpu_s.map(|s| s * 1e6 / n as f64),
            window: PGOUTBOX_WINDOW,
            ceiling_shape,
            broker_msgs_per_s: best.msgs_per_s,
            broker_best_window: best.window,
            broker_best_publisher: best.publisher.to_string(),
            ceiling_msgs_per_s: ceiling,
            ceiling_is: ceiling_is.to_string(),
            ratio: rate / ceiling,
            exit_status: d.exit_status,
        });
    }
    Ok((case, rows))
}

// ---------------------------------------------------------------------------------------
// Scenario 5: a stream against an AMQP queue, and the bare stream publisher's ceiling

/// The windows tried by the bare stream publisher; the best one counts.
const STREAM_WINDOWS: [usize; 2] = [10_000, 1_000];
/// The bare stream publisher's publisher id (one per connection).
const BARE_PUBLISHER_ID: u8 = 1;

/// One drain of scenario 5: pgoutbox into a stream or into an AMQP queue.
#[derive(Debug, Clone, Serialize)]
struct SinkDrain {
    /// `stream` or `amqp`.
    sink: &'static str,
    /// 0-based position in the run's order.
    position: usize,
    drain_s: f64,
    /// From pgoutbox's start to the last message confirmed (the AMQP rows of scenarios 1-3
    /// count the same way).
    msgs_per_s: f64,
    /// The stream drain only: from the first poll that saw a confirm to the last confirm
    /// (without pgoutbox's start-up, as the bare publisher is timed after its handshake).
    msgs_per_s_after_first_confirm: Option<f64>,
    /// pgoutbox's own utime + stime per message (/proc/PID/stat).
    cpu_us_per_msg: f64,
    /// pgoutbox's CPU seconds ÷ drain seconds (1.0: one core busy).
    cpu_share_of_wall: f64,
    walsender_cpu_us_per_msg: Option<f64>,
    /// pgoutbox's VmHWM.
    peak_rss_mb: f64,
    rabbit_cpu_us_per_msg: Option<f64>,
    exit_status: String,
}

/// One run of the bare stream publisher.
#[derive(Debug, Clone, Serialize)]
struct BareStreamRun {
    window: usize,
    n: u64,
    /// Bytes of one AMQP 1.0 message as published (the stream path's full shape).
    message_bytes: usize,
    /// Messages per `Publish` frame, at most.
    frame_messages: usize,
    /// From the first publish to the last confirm.
    elapsed_s: f64,
    msgs_per_s: f64,
    /// The bench process's CPU per message while it published (the client's own cost).
    client_cpu_us_per_msg: Option<f64>,
    rabbit_cpu_us_per_msg: Option<f64>,
}

/// One run of scenario 5.
#[derive(Debug, Clone, Serialize)]
struct StreamCaseRun {
    run: u32,
    n: u64,
    size: usize,
    per_tx: u64,
    emit_s: f64,
    /// `pg_recvlogical` on a twin slot (created with the others, before the backlog).
    decode_msgs_per_s: f64,
    load_before: String,
    drains: Vec<SinkDrain>,
    bare: Vec<BareStreamRun>,
    /// The best bare run's rate: the stream ceiling of this run.
    bare_msgs_per_s: f64,
    /// Stream drain (after its first confirm) ÷ bare stream ceiling (target ≥ 0.9).
    stream_over_bare: f64,
    /// Stream drain ÷ AMQP-queue drain (target ≥ 1.5).
    stream_over_amqp: f64,
    /// Stream drain ÷ min(decode ceiling, bare stream ceiling).
    stream_over_ceiling: f64,
}

impl StreamCaseRun {
    fn drain(&self, sink: &str) -> Option<&SinkDrain> {
        self.drains.iter().find(|d| d.sink == sink)
    }
}

fn stream_url(stack: &Stack) -> R<String> {
    let port = stack.get("RABBITMQ_STREAM_PORT");
    if port.is_empty() {
        return Err(
            "the stack has no stream listener (RABBITMQ_STREAM_PORT missing from its env: \
                    started without PGOUTBOX_STACK_PLUGINS=rabbitmq_stream)"
                .into(),
        );
    }
    Ok(format!(
        "rabbitmq-stream://guest:guest@127.0.0.1:{port}/%2f"
    ))
}

/// `pgoutbox run --stream-url ... --stream STREAM` on `slot` (full shape, metrics on), waits
/// until its `pgoutbox_messages_confirmed_total` reaches `n`, and stops it.
async fn drain_stream(
    ctx: &Ctx,
    tag: &str,
    db_url: &str,
    slot: &str,
    stream: &str,
    n: u64,
    c: &tokio_postgres::Client,
) -> R<(Drained, Option<f64>)> {
    let rpid = ctx.stack.rabbit_pid().map(|p| p.to_string());
    let r0 = rpid.as_deref().and_then(|p| cpu_secs(p, ctx.tck));
    let log = ctx.log_dir.join(format!("pgoutbox-{tag}-stream.log"));
    let file = fs::File::create(&log).map_err(|e| format!("create {}: {e}", log.display()))?;
    let t0 = Instant::now();
    let child = Command::new(pgoutbox_bin())
        .args([
            "run",
            "--database-url",
            db_url,
            "--stream",
            stream,
            "--slot",
            slot,
            "--publication",
            PUBLICATION,
            "--max-in-flight",
            &PGOUTBOX_WINDOW.to_string(),
        ])
        .env("PGOUTBOX_PUBLISH_PROPERTIES", Shape::Full.name())
        .env("PGOUTBOX_HTTP_ADDR", "127.0.0.1:0")
        // Through the environment: a password on the command line draws a warning.
        .env("PGOUTBOX_STREAM_URL", stream_url(&ctx.stack)?)
        .stdin(Stdio::null())
        .stdout(
            file.try_clone()
                .map_err(|e| format!("log file {}: {e}", log.display()))?,
        )
        .stderr(file)
        .spawn()
        .map_err(|e| format!("[{tag}] start pgoutbox: {e}"))?;
    let pid = child.id();
    register(pid);
    let mut streamer = Streamer {
        child,
        pid,
        log,
        program: "pgoutbox",
    };
    let addr = streamer.http_addr().await.ok_or(format!(
        "[{tag}] stream drain: pgoutbox logged no http_addr"
    ))?;
    let limit = Duration::from_secs(120 + n / 2_000);
    let mut last = (0u64, Instant::now());
    // The first poll that saw confirms: (when, how many).
    let mut first: Option<(Instant, u64)> = None;
    let drain = loop {
        let confirmed = scrape(&addr)
            .await
            .ok()
            .and_then(|text| {
                text.lines()
                    .find_map(|l| l.strip_prefix("pgoutbox_messages_confirmed_total "))
                    .and_then(|v| v.trim().parse::<f64>().ok())
            })
            .unwrap_or(0.0) as u64;
        if confirmed >= n {
            break t0.elapsed();
        }
        if confirmed > 0 && first.is_none() {
            first = Some((Instant::now(), confirmed));
        }
        streamer.check_alive(&format!("[{tag}] stream drain"))?;
        if confirmed != last.0 {
            last = (confirmed, Instant::now());
        }
        if t0.elapsed() > limit || last.1.elapsed() > Duration::from_secs(60) {
            let tail = streamer.log_tail();
            let _ = streamer.stop().await;
            return Err(format!(
                "[{tag}] stream drain: {confirmed} of {n} confirmed after {:?} (no progress \
                 for {:?}); pid {pid} log:\n{tail}",
                t0.elapsed(),
                last.1.elapsed()
            ));
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let steady = first
        .filter(|(_, c1)| *c1 < n)
        .map(|(t1, c1)| (n - c1) as f64 / secs(t1.elapsed()));
    let p = pid.to_string();
    let cpu_s = cpu_secs(&p, ctx.tck).ok_or(format!("[{tag}] read /proc/{p}/stat"))?;
    let rss_mb = vm_hwm_mb(pid).ok_or(format!("[{tag}] read /proc/{p}/status"))?;
    let walsender_cpu_s = match walsender_pid(c, slot).await {
        Some(p) => cpu_secs(&p, ctx.tck),
        None => None,
    };
    let r1 = rpid.as_deref().and_then(|p| cpu_secs(p, ctx.tck));
    let exit_status = streamer.stop().await;
    let d = Drained {
        drain_s: secs(drain),
        cpu_s,
        rss_mb,
        walsender_cpu_s,
        rabbit_cpu_s: match (r0, r1) {
            (Some(a), Some(b)) => Some(b - a),
            _ => None,
        },
        observed_shape: "full".into(),
        exit_status,
    };
    Ok((d, steady))
}

/// A stream-protocol connection of the bare publisher, before it publishes: the handshake
/// and the requests, one at a time.
struct BareConn {
    sock: tokio::net::TcpStream,
    inbuf: bytes::BytesMut,
    out: bytes::BytesMut,
    correlation: u32,
    frame_max: u32,
}

impl BareConn {
    async fn read_frame(&mut self) -> R<frames::ServerFrame> {
        use tokio::io::AsyncReadExt;
        loop {
            if let Some(len) = frames::frame_len(&self.inbuf, 0).map_err(|e| e.to_string())? {
                let f = self.inbuf.split_to(len);
                return frames::decode(&f).map_err(|e| e.to_string());
            }
            if self
                .sock
                .read_buf(&mut self.inbuf)
                .await
                .map_err(|e| format!("stream socket read: {e}"))?
                == 0
            {
                return Err("the broker closed the stream connection".into());
            }
        }
    }

    async fn flush(&mut self) -> R<()> {
        use tokio::io::AsyncWriteExt;
        self.sock
            .write_all(&self.out)
            .await
            .map_err(|e| format!("stream socket write: {e}"))?;
        self.out.clear();
        Ok(())
    }

    /// Sends what `out` holds (ending in a request of `key` with the current correlation)
    /// and waits for its response; anything but OK fails.
    async fn call(&mut self, key: u16, what: &str) -> R<frames::ResponseBody> {
        self.flush().await?;
        loop {
            match self.read_frame().await? {
                frames::ServerFrame::Response {
                    key: k,
                    correlation,
                    code,
                    body,
                } if k == key && correlation == self.correlation => {
                    return if code == frames::code::OK {
                        Ok(body)
                    } else {
                        Err(format!(
                            "{what}: {} ({code:#04x})",
                            frames::code::name(code)
                        ))
                    };
                }
                frames::ServerFrame::Close { code, reason, .. } => {
                    return Err(format!("{what}: the broker closed ({code:#04x}): {reason}"))
                }
                _ => {}
            }
        }
    }

    fn next(&mut self) -> u32 {
        self.correlation += 1;
        self.correlation
    }

    /// PeerProperties, SaslHandshake, SaslAuthenticate PLAIN (guest), Tune, Open `/`,
    /// Create `stream`, DeclarePublisher.
    async fn open(port: &str, stream: &str, reference: &str) -> R<BareConn> {
        let sock = tokio::net::TcpStream::connect(format!("127.0.0.1:{port}"))
            .await
            .map_err(|e| format!("connect to the stream port {port}: {e}"))?;
        sock.set_nodelay(true).ok();
        let mut c = BareConn {
            sock,
            inbuf: bytes::BytesMut::with_capacity(64 << 10),
            out: bytes::BytesMut::with_capacity(64 << 10),
            correlation: 0,
            frame_max: 1 << 20,
        };
        let e = |e: frames::EncodeError| e.to_string();
        let k = c.next();
        frames::peer_properties(&mut c.out, k, &[("product", "pgoutbox-bench")]).map_err(e)?;
        c.call(frames::PEER_PROPERTIES, "peer properties").await?;
        let k = c.next();
        frames::sasl_handshake(&mut c.out, k);
        c.call(frames::SASL_HANDSHAKE, "SASL handshake").await?;
        let k = c.next();
        frames::sasl_plain(&mut c.out, k, "guest", "guest").map_err(e)?;
        c.call(frames::SASL_AUTHENTICATE, "SASL PLAIN").await?;
        let (frame_max, heartbeat) = loop {
            if let frames::ServerFrame::Tune {
                frame_max,
                heartbeat,
            } = c.read_frame().await?
            {
                break (frame_max, heartbeat);
            }
        };
        frames::tune(&mut c.out, frame_max, heartbeat);
        if frame_max != 0 {
            c.frame_max = frame_max;
        }
        let k = c.next();
        frames::open(&mut c.out, k, "/").map_err(e)?;
        c.call(frames::OPEN, "open /").await?;
        let k = c.next();
        frames::create(&mut c.out, k, stream, &[]).map_err(e)?;
        c.call(frames::CREATE, "create the stream").await?;
        let k = c.next();
        frames::declare_publisher(&mut c.out, k, BARE_PUBLISHER_ID, reference, stream)
            .map_err(e)?;
        c.call(frames::DECLARE_PUBLISHER, "declare the publisher")
            .await?;
        Ok(c)
    }
}

/// The bare stream publisher: no Postgres, `n` pre-built AMQP 1.0 messages of the stream
/// path's full shape (`size`-byte body) into a fresh stream, publishing ids 1..=n, as many
/// messages per `Publish` frame as fit (frame_max), at most `window` unconfirmed; a task of
/// its own reads the `PublishConfirm`s, so writing never waits on reading.
async fn bare_stream_ceiling(
    ctx: &Ctx,
    tag: &str,
    n: u64,
    size: usize,
    window: usize,
) -> R<BareStreamRun> {
    use bytes::BufMut;
    use tokio::io::AsyncWriteExt;
    let stream = format!("bench-{tag}-bare-w{window}");
    let port = ctx.stack.get("RABBITMQ_STREAM_PORT").to_string();
    let conn = BareConn::open(&port, &stream, &stream)
        .await
        .map_err(|e| format!("[{tag}] bare stream publisher: {e}"))?;
    // Pre-built: the messages the stream path sends (properties, the three x-pgoutbox-*
    // application properties, the body as a data section).
    let body = vec![b'x'; size];
    let messages: Vec<bytes::Bytes> = (0..n)
        .map(|i| {
            let p = props(i, Shape::Full);
            let mut b = bytes::BytesMut::with_capacity(size + 256);
            amqp10::encode(
                &mut b,
                &amqp10::Message {
                    properties: &p,
                    subject: "bench.s5",
                    creation_time_ms: now_us() / 1000,
                    body: &body,
                },
            );
            b.freeze()
        })
        .collect();
    let message_bytes = messages.first().map_or(0, |m| m.len());
    let frame_max = conn.frame_max as usize;
    let BareConn {
        sock,
        mut inbuf,
        mut out,
        ..
    } = conn;
    let (mut rd, mut wr) = sock.into_split();
    // The confirm reader: confirmed counts (or the error) to the writer.
    let (tx, mut rx) = mpsc::unbounded_channel::<R<u64>>();
    let reader = tokio::spawn(async move {
        use tokio::io::AsyncReadExt;
        loop {
            loop {
                match frames::frame_len(&inbuf, 0) {
                    Ok(Some(len)) => {
                        let f = inbuf.split_to(len);
                        let r = match frames::decode(&f) {
                            Ok(frames::ServerFrame::PublishConfirm { ids, .. }) => {
                                Ok(ids.len() as u64)
                            }
                            Ok(frames::ServerFrame::PublishError { errors, .. }) => Err(format!(
                                "{} publish errors, first {:?}",
                                errors.len(),
                                errors.first()
                            )),
                            Ok(frames::ServerFrame::Close { code, reason, .. }) => {
                                Err(format!("the broker closed ({code:#04x}): {reason}"))
                            }
                            Ok(_) => continue,
                            Err(e) => Err(e.to_string()),
                        };
                        let fatal = r.is_err();
                        if tx.send(r).is_err() || fatal {
                            return;
                        }
                    }
                    Ok(None) => break,
                    Err(e) => {
                        let _ = tx.send(Err(e.to_string()));
                        return;
                    }
                }
            }
            match rd.read_buf(&mut inbuf).await {
                Ok(0) | Err(_) => {
                    let _ = tx.send(Err("the stream connection closed".into()));
                    return;
                }
                Ok(_) => {}
            }
        }
    });
    let rpid = ctx.stack.rabbit_pid().map(|p| p.to_string());
    let r0 = rpid.as_deref().and_then(|p| cpu_secs(p, ctx.tck));
    let me = std::process::id().to_string();
    let c0 = cpu_secs(&me, ctx.tck);
    let t0 = Instant::now();
    let (mut sent, mut confirmed) = (0u64, 0u64);
    let mut frame_messages = 0usize;
    let result: R<()> = async {
        while confirmed < n {
            // Fill the window: frames of as many messages as fit, one write for them all.
            while sent < n && sent - confirmed < window as u64 {
                let mut f = frames::PublishFrame::start(&mut out, BARE_PUBLISHER_ID);
                while sent < n && sent - confirmed < window as u64 {
                    let m = &messages[sent as usize];
                    if !f.try_push(&mut out, sent + 1, frame_max, |b| b.put_slice(m)) {
                        break;
                    }
                    sent += 1;
                }
                frame_messages = frame_messages.max(f.count() as usize);
                f.finish(&mut out);
            }
            if !out.is_empty() {
                wr.write_all(&out)
                    .await
                    .map_err(|e| format!("stream socket write: {e}"))?;
                out.clear();
            }
            let got = rx.recv().await.ok_or("the confirm reader stopped")??;
            confirmed += got;
            while let Ok(r) = rx.try_recv() {
                confirmed += r?;
            }
        }
        Ok(())
    }
    .await;
    let elapsed = t0.elapsed();
    let c1 = cpu_secs(&me, ctx.tck);
    let r1 = rpid.as_deref().and_then(|p| cpu_secs(p, ctx.tck));
    reader.abort();
    drop(wr);
    result.map_err(|e| format!("[{tag}] bare stream publisher W={window}: {e}"))?;
    // The stream is a queue to AMQP: delete it there.
    if let Err(e) = ctx
        .ch
        .queue_delete(stream.as_str().into(), QueueDeleteOptions::default())
        .await
    {
        eprintln!("bench: WARNING: [{tag}] delete stream {stream}: {e}");
    }
    Ok(BareStreamRun {
        window,
        n,
        message_bytes,
        frame_messages,
        elapsed_s: secs(elapsed),
        msgs_per_s: n as f64 / secs(elapsed),
        client_cpu_us_per_msg: match (c0, c1) {
            (Some(a), Some(b)) => Some((b - a) * 1e6 / n as f64),
            _ => None,
        },
        rabbit_cpu_us_per_msg: match (r0, r1) {
            (Some(a), Some(b)) => Some((b - a) * 1e6 / n as f64),
            _ => None,
        },
    })
}

/// Scenario 5: one backlog of `n` × `size` B (`per_tx` per transaction), drained by pgoutbox
/// into a stream and into an AMQP queue (full shape, each on its own slot created before the
/// backlog; the order reversed on every other run), and right after the stream drain the
/// bare stream publisher's ceiling at each of [`STREAM_WINDOWS`].
async fn stream_case(ctx: &Ctx, run: u32, n: u64, size: usize, per_tx: u64) -> R<StreamCaseRun> {
    let tag = format!("s5_r{run}");
    let db = format!("bench_{tag}");
    let load_before = loadavg();
    let order: [&'static str; 2] = if run % 2 == 0 {
        ["amqp", "stream"]
    } else {
        ["stream", "amqp"]
    };
    eprintln!(
        "bench: [{tag}] {n} x {size} B, {per_tx} per transaction; drains: pgoutbox into {} \
         (load {load_before})",
        order.join(", then ")
    );
    let url = fresh_db(ctx, &db).await?;
    let c = pg(&url, &tag).await?;
    let stream_slot = format!("{SLOT}_stream");
    for slot in [stream_slot.as_str(), TWIN] {
        sql(
            &c,
            &format!("[{tag}] create slot {slot}"),
            &format!("SELECT pg_create_logical_replication_slot('{slot}', 'pgoutput')"),
        )
        .await?;
    }
    let queue = format!("bench-{tag}-amqp");
    let stream = format!("bench-{tag}-stream");
    declare_bound_queue(&ctx.ch, &queue, &queue)
        .await
        .map_err(|e| format!("[{tag}] {e}"))?;
    let emit_s = emit_backlog(&url, n, size, per_tx, "bench.s5")
        .await
        .map_err(|e| format!("[{tag}] {e}"))?;
    let endpos = sql_text(&c, &tag, "SELECT pg_current_wal_lsn()::text").await?;
    let decode = decode_ceiling(&ctx.stack, &db, &endpos, n)
        .await
        .map_err(|e| format!("[{tag}] {e}"))?;
    sql(
        &c,
        &format!("[{tag}] drop twin slot"),
        &format!("SELECT pg_drop_replication_slot('{TWIN}')"),
    )
    .await?;
    eprintln!("bench: [{tag}] backlog written in {emit_s:.1} s; decode ceiling {decode:.0} msg/s");
    let mut drains = Vec::new();
    let mut bare = Vec::new();
    for (position, sink) in order.iter().enumerate() {
        let (d, slot) = if *sink == "stream" {
            let d = drain_stream(ctx, &tag, &url, &stream_slot, &stream, n, &c).await;
            if let Err(e) = ctx
                .ch
                .queue_delete(stream.as_str().into(), QueueDeleteOptions::default())
                .await
            {
                eprintln!("bench: WARNING: [{tag}] delete stream {stream}: {e}");
            }
            // The ceiling right after the stream drain, so that both see about the same
            // load from the machine's other work.
            if d.is_ok() {
                for w in STREAM_WINDOWS {
                    let b = bare_stream_ceiling(ctx, &tag, n, size, w).await?;
                    eprintln!(
                        "bench: [{tag}] bare stream publisher W={w}: {:.0} msg/s ({} B \
                         messages, up to {} per frame)",
                        b.msgs_per_s, b.message_bytes, b.frame_messages
                    );
                    bare.push(b);
                }
            }
            (d, stream_slot.clone())
        } else {
            let target = Target {
                db: &db,
                db_url: &url,
                slot: SLOT,
                exchange: &queue,
            };
            let relay = Relay::Pgoutbox(Shape::Full, Metrics::On);
            let d = drain_relay(ctx, &tag, relay, &target, &queue, n, &c)
                .await
                .map(|d| (d, None));
            delete_queue(&ctx.ch, &queue, &queue)
                .await
                .map_err(|e| format!("[{tag}] {e}"))?;
            (d, SLOT.to_string())
        };
        // Free the WAL this slot held for the drain still to come.
        sql(
            &c,
            &format!("[{tag}] drop slot {slot}"),
            &format!(
                "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots \
                 WHERE slot_name = '{slot}' AND NOT active"
            ),
        )
        .await?;
        let (d, steady) = d?;
        let rate = n as f64 / d.drain_s;
        eprintln!(
            "bench: [{tag}] pgoutbox into {sink}: {rate:.0} msg/s ({:.2} s; after the first \
             confirm {}), CPU {:.1} us/msg, peak RSS {:.1} MB",
            d.drain_s,
            steady.map_or("n/a".into(), |r| format!("{r:.0} msg/s")),
            d.cpu_s * 1e6 / n as f64,
            d.rss_mb
        );
        drains.push(SinkDrain {
            sink,
            position,
            drain_s: d.drain_s,
            msgs_per_s: rate,
            msgs_per_s_after_first_confirm: steady,
            cpu_us_per_msg: d.cpu_s * 1e6 / n as f64,
            cpu_share_of_wall: d.cpu_s / d.drain_s,
            walsender_cpu_us_per_msg: d.walsender_cpu_s.map(|s| s * 1e6 / n as f64),
            peak_rss_mb: d.rss_mb,
            rabbit_cpu_us_per_msg: d.rabbit_cpu_s.map(|s| s * 1e6 / n as f64),
            exit_status: d.exit_status,
        });
    }
    drop(c);
    drop_db(ctx, &db)
        .await
        .map_err(|e| format!("[{tag}] {e}"))?;
    let bare_msgs_per_s = bare.iter().map(|b| b.msgs_per_s).fold(0.0, f64::max);
    let rate = |sink: &str| {
        drains
            .iter()
            .find(|d| d.sink == sink)
            .map_or(f64::NAN, |d| d.msgs_per_s)
    };
    let steady = drains
        .iter()
        .find(|d| d.sink == "stream")
        .and_then(|d| d.msgs_per_s_after_first_confirm)
        .unwrap_or_else(|| rate("stream"));
    Ok(StreamCaseRun {
        run,
        n,
        size,
        per_tx,
        emit_s,
        decode_msgs_per_s: decode,
        load_before,
        stream_over_ceiling: steady / bare_msgs_per_s.min(decode),
        stream_over_bare: steady / bare_msgs_per_s,
        stream_over_amqp: rate("stream") / rate("amqp"),
        drains,
        bare,
        bare_msgs_per_s,
    })
}

/// Scenario 5's table: each path's median [min–max] over the runs, and the two ratios.
fn stream_table(runs: &[StreamCaseRun]) -> String {
    let mut md = String::from(
        "| path | msg/s | msg/s after the first confirm | CPU µs/msg | CPU / wall | peak RSS MB | walsender CPU µs/msg | RabbitMQ CPU µs/msg |\n|---|---|---|---|---|---|---|---|\n",
    );
    for (sink, label) in [
        ("stream", "pgoutbox → stream"),
        ("amqp", "pgoutbox → AMQP queue (full shape)"),
    ] {
        let ds: Vec<&SinkDrain> = runs.iter().filter_map(|r| r.drain(sink)).collect();
        if ds.is_empty() {
            continue;
        }
        let opt = |v: Vec<f64>, prec: usize| {
            if v.is_empty() {
                "n/a".to_string()
            } else {
                fmt_mmm(v, prec)
            }
        };
        let _ = writeln!(
            md,
            "| {label} | {} | {} | {} | {} | {} | {} | {} |",
            fmt_mmm(ds.iter().map(|d| d.msgs_per_s).collect(), 0),
            opt(
                ds.iter()
                    .filter_map(|d| d.msgs_per_s_after_first_confirm)
                    .collect(),
                0
            ),
            fmt_mmm(ds.iter().map(|d| d.cpu_us_per_msg).collect(), 1),
            fmt_mmm(ds.iter().map(|d| d.cpu_share_of_wall).collect(), 2),
            fmt_mmm(ds.iter().map(|d| d.peak_rss_mb).collect(), 1),
            opt(
                ds.iter()
                    .filter_map(|d| d.walsender_cpu_us_per_msg)
                    .collect(),
                1
            ),
            opt(
                ds.iter().filter_map(|d| d.rabbit_cpu_us_per_msg).collect(),
                1
            ),
        );
    }
    let best: Vec<&BareStreamRun> = runs
        .iter()
        .filter_map(|r| {
            r.bare
                .iter()
                .max_by(|a, b| a.msgs_per_s.total_cmp(&b.msgs_per_s))
        })
        .collect();
    if !best.is_empty() {
        let client: Vec<f64> = best
            .iter()
            .filter_map(|b| b.client_cpu_us_per_msg)
            .collect();
        let rabbit: Vec<f64> = best
            .iter()
            .filter_map(|b| b.rabbit_cpu_us_per_msg)
            .collect();
        let windows: Vec<String> = best.iter().map(|b| b.window.to_string()).collect();
        let _ = writeln!(
            md,
            "| bare stream publisher (best W: {}; {} B messages) | {} | | {} (client) | | n/a | | {} |",
            windows.join(", "),
            best[0].message_bytes,
            fmt_mmm(best.iter().map(|b| b.msgs_per_s).collect(), 0),
            if client.is_empty() {
                "n/a".into()
            } else {
                fmt_mmm(client, 1)
            },
            if rabbit.is_empty() {
                "n/a".into()
            } else {
                fmt_mmm(rabbit, 1)
            },
        );
    }
    let _ = writeln!(
        md,
        "| decode ceiling (pg_recvlogical, twin slot) | {} | | | | | | |",
        fmt_mmm(runs.iter().map(|r| r.decode_msgs_per_s).collect(), 0),
    );
    let _ = writeln!(
        md,
        "\nstream drain (after its first confirm) ÷ bare stream ceiling: **{}** (target ≥ 0.9); \
         stream drain ÷ AMQP-queue drain (both from start): **{}** (target ≥ 1.5); stream drain \
         (after its first confirm) ÷ min(decode, bare stream ceiling): {}; ratios per run, \
         median [min–max].",
        fmt_mmm(runs.iter().map(|r| r.stream_over_bare).collect(), 2),
        fmt_mmm(runs.iter().map(|r| r.stream_over_amqp).collect(), 2),
        fmt_mmm(runs.iter().map(|r| r.stream_over_ceiling).collect(), 2),
    );
    md
}

// ---------------------------------------------------------------------------------------
// Steady-state latency

/// Quantiles of latencies in milliseconds.
#[derive(Debug, Clone, Serialize)]
struct Quantiles {
    count: u64,
    p50_ms: f64,
    p95_ms: f64,
    p99_ms: f64,
    max_ms: f64,
}

impl Quantiles {
    fn of(mut us: Vec<i64>) -> Quantiles {
        us.sort_unstable();
        Quantiles {
            count: us.len() as u64,
            p50_ms: pct(&us, 0.50),
            p95_ms: pct(&us, 0.95),
            p99_ms: pct(&us, 0.99),
            max_ms: us.last().map(|v| *v as f64 / 1000.0).unwrap_or(f64::NAN),
        }
    }
}

/// pgoutbox's own `pgoutbox_confirm_latency_seconds` over one steady-state run: the
/// scrape after minus the scrape before, quantiles interpolated linearly within a bucket
/// (as Prometheus's `histogram_quantile` does).
#[derive(Debug, Clone, Serialize)]
struct ConfirmHistogram {
    count: u64,
    mean_ms: f64,
    p50_ms: f64,
    p99_ms: f64,
    /// (upper bound in seconds, observations in this bucket alone) of the difference.
    buckets: Vec<(f64, u64)>,
}

#[derive(Debug, Clone, Serialize)]
struct LatencyRun {
    /// The row's label ("pgoutbox full", "Node relay").
    relay: String,
    /// Which of the `--runs` repetitions (from 1).
    run: u32,
    /// Messages committed in the first `warmup_s` seconds are left out of the quantiles.
    warmup_s: f64,
    target_msgs_per_s: f64,
    rate_source: String,
    duration_s: u64,
    producers: usize,
    producer_synchronous_commit: String,
    sent: u64,
    received: u64,
    achieved_msgs_per_s: f64,
    /// Consumer receive time minus the producer's commit-return time, matched by
    /// message_id (pgoutbox) or by message LSN (the Node relay's message_id).
    from_commit_return: Quantiles,
    /// Received messages matched to no producer record (left out of the quantiles).
    unmatched: u64,
    /// Consumer receive time minus our `x-pgoutbox-commit-time-us` header (the server's
    /// commit timestamp), when the messages carry it (pgoutbox, full shape).
    from_commit_header: Option<Quantiles>,
    /// pgoutbox's commit-to-confirm histogram from `/metrics` (None for the Node relay, or
    /// when the scrape failed).
    confirm_histogram: Option<ConfirmHistogram>,
    /// pgoutbox's own residence time from `/metrics` (`pgoutbox_residence_seconds`: the
    /// replication read that completed a message to the broker write that published it).
    residence: Option<ConfirmHistogram>,
    cpu_us_per_msg: f64,
    peak_rss_mb: f64,
    /// Busy share of all the machine's CPUs while the producers ran (0..1, /proc/stat).
    machine_cpu_busy: f64,
    /// CPU of the Postgres cluster (producers' backends, walsender, ...) per message (µs).
    postgres_cpu_us_per_msg: f64,
    /// CPU of RabbitMQ per message (µs).
    rabbit_cpu_us_per_msg: f64,
    /// CPU of the bench process (producer clients and the consumer) per message (µs).
    bench_cpu_us_per_msg: f64,
    exit_status: String,
}

/// `X/Y` hex (either case, zero-padded or not) as a 64-bit WAL position.
fn parse_lsn(text: &str) -> Option<u64> {
    let (hi, lo) = text.trim().split_once('/')?;
    let hi = u64::from_str_radix(hi, 16).ok()?;
    let lo = u64::from_str_radix(lo, 16).ok()?;
    (hi <= u64::from(u32::MAX) && lo <= u64::from(u32::MAX)).then_some((hi << 32) | lo)
}

/// A plain HTTP/1.1 GET of `http://{addr}/metrics`; the body.
async fn scrape(addr: &str) -> R<String> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut sock =
        tokio::time::timeout(Duration::from_secs(5), tokio::net::TcpStream::connect(addr))
            .await
            .map_err(|_| format!("scrape {addr}: connect timed out"))?
            .map_err(|e| format!("scrape {addr}: connect: {e}"))?;
    sock.write_all(
        format!("GET /metrics HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n").as_bytes(),
    )
    .await
    .map_err(|e| format!("scrape {addr}: write: {e}"))?;
    let mut buf = Vec::new();
    tokio::time::timeout(Duration::from_secs(5), sock.read_to_end(&mut buf))
        .await
        .map_err(|_| format!("scrape {addr}: read timed out"))?
        .map_err(|e| format!("scrape {addr}: read: {e}"))?;
    let text = String::from_utf8_lossy(&buf).into_owned();
    let (head, body) = text
        .split_once("\r\n\r\n")
        .ok_or(format!("scrape {addr}: no HTTP header end"))?;
    if !head.starts_with("HTTP/1.1 200") {
        return Err(format!(
            "scrape {addr}: {}",
            head.lines().next().unwrap_or("")
        ));
    }
    Ok(body.to_string())
}

/// The cumulative buckets (upper bound in seconds, count) and the sum in seconds of the
/// histogram `name` in a Prometheus text exposition.
fn histogram(text: &str, name: &str) -> Option<(Vec<(f64, u64)>, f64)> {
    let bucket = format!("{name}_bucket{{");
    let mut buckets = Vec::new();
    let mut sum = None;
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix(&bucket) {
            let le = rest.split("le=\"").nth(1)?.split('"').next()?;
            let le = match le {
                "+Inf" => f64::INFINITY,
                v => v
                    .parse::<f64>()
                    .ok()
                    .map(|v| if v > 1e300 { f64::INFINITY } else { v })?,
            };
            let n = rest.rsplit(' ').next()?.trim().parse::<f64>().ok()? as u64;
            buckets.push((le, n));
        } else if let Some(rest) = line.strip_prefix(&format!("{name}_sum ")) {
            sum = rest.trim().parse::<f64>().ok();
        }
    }
    (!buckets.is_empty()).then_some((buckets, sum?))
}

/// The `q` quantile (0..1) of cumulative `buckets`, in seconds, interpolated within the
/// bucket it falls in; the lower bound of an open last bucket.
fn bucket_quantile(buckets: &[(f64, u64)], q: f64) -> f64 {
    let total = buckets.last().map(|b| b.1).unwrap_or(0);
    if total == 0 {
        return f64::NAN;
    }
    let rank = q * total as f64;
    let mut prev = (0.0, 0u64);
    for &(le, n) in buckets {
        if n as f64 >= rank {
            if le.is_infinite() {
                return prev.0;
            }
            let inside = (n - prev.1) as f64;
            let frac = if inside > 0.0 {
                (rank - prev.1 as f64) / inside
            } else {
                1.0
            };
            return prev.0 + (le - prev.0) * frac;
        }
        prev = (le, n);
    }
    prev.0
}

/// The histogram `name` of the scrape `after` minus the scrape `before`.
fn confirm_histogram(before: &str, after: &str, name: &str) -> Option<ConfirmHistogram> {
    let (b0, s0) = histogram(before, name)?;
    let (b1, s1) = histogram(after, name)?;
    if b0.len() != b1.len() {
        return None;
    }
    let cumulative: Vec<(f64, u64)> = b1
        .iter()
        .zip(&b0)
        .map(|(a, b)| (a.0, a.1.saturating_sub(b.1)))
        .collect();
    let count = cumulative.last().map(|b| b.1).unwrap_or(0);
    let mut prev = 0;
    let buckets = cumulative
        .iter()
        .map(|&(le, n)| {
            let own = n.saturating_sub(prev);
            prev = n;
            (le, own)
        })
        .collect();
    Some(ConfirmHistogram {
        count,
        mean_ms: (s1 - s0) * 1e3 / count.max(1) as f64,
        p50_ms: bucket_quantile(&cumulative, 0.50) * 1e3,
        p99_ms: bucket_quantile(&cumulative, 0.99) * 1e3,
        buckets,
    })
}

/// (busy, total) jiffies of all CPUs from the `cpu` line of /proc/stat; idle and iowait
/// count as not busy.
fn machine_jiffies() -> Option<(u64, u64)> {
    let stat = fs::read_to_string("/proc/stat").ok()?;
    let line = stat.lines().find(|l| l.starts_with("cpu "))?;
    let v: Vec<u64> = line
        .split_whitespace()
        .skip(1)
        .filter_map(|x| x.parse().ok())
        .collect();
    let total: u64 = v.iter().take(8).sum();
    let idle = v.get(3)? + v.get(4)?;
    Some((total - idle, total))
}

fn pct(sorted: &[i64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i.min(sorted.len() - 1)] as f64 / 1000.0
}

/// What the consumer saw of one message.
struct Received {
    message_id: Option<String>,
    recv_us: i64,
    header_commit_us: Option<i64>,
}

/// One steady-state run of `relay` at `rate` msg/s for `dur` seconds.
async fn latency_case(
    ctx: &Ctx,
    relay: Relay,
    rate: f64,
    rate_source: &str,
    dur: u64,
    run: u32,
) -> R<LatencyRun> {
    let tag = format!("s4_{rate:.0}_{}", relay.key());
    let db = format!("bench_{tag}");
    eprintln!(
        "bench: [{tag}] steady state, {} at {rate:.0} msg/s for {dur} s ({rate_source})",
        relay.label()
    );
    let url = fresh_db(ctx, &db).await?;
    let exchange = format!("bench-{tag}");
    let queue = exchange.clone();
    declare_bound_queue(&ctx.ch, &exchange, &queue)
        .await
        .map_err(|e| format!("[{tag}] {e}"))?;
    let c = pg(&url, &tag).await?;
    let log = ctx.log_dir.join(format!("{}-{tag}.log", relay.program()));
    let target = Target {
        db: &db,
        db_url: &url,
        slot: SLOT,
        exchange: &exchange,
    };
    let mut streamer = Streamer::start(&ctx.stack, relay, ctx.node(), &target, log)?;
    // Wait until it holds the slot.
    let t0 = Instant::now();
    while walsender_pid(&c, SLOT).await.is_none() {
        streamer.check_alive(&format!("[{tag}] start"))?;
        if t0.elapsed() > Duration::from_secs(30) {
            let _ = streamer.stop().await;
            return Err(format!(
                "[{tag}] {} did not take the slot within 30 s",
                relay.label()
            ));
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let http_addr = match relay {
        Relay::Pgoutbox(_, Metrics::On) => streamer.http_addr().await,
        _ => None,
    };
    let scrape_before = match &http_addr {
        Some(a) => scrape(a)
            .await
            .map_err(|e| eprintln!("bench: WARNING: [{tag}] {e}"))
            .ok(),
        None => None,
    };

    // Consumer.
    let cconn = amqp(ctx.stack.get("PGOUTBOX_AMQP_URL"), "[s4] consumer").await?;
    let cch = cconn
        .create_channel()
        .await
        .map_err(|e| format!("[{tag}] consumer channel: {e}"))?;
    cch.basic_qos(1000, BasicQosOptions::default())
        .await
        .map_err(|e| format!("[{tag}] basic_qos: {e}"))?;
    let mut consumer = cch
        .basic_consume(
            queue.as_str().into(),
            "bench".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .map_err(|e| format!("[{tag}] basic_consume: {e}"))?;
    let (done_tx, mut done_rx) = tokio::sync::watch::channel(u64::MAX);
    let ctag = tag.clone();
    let consumer_task = tokio::spawn(async move {
        let tag = ctag;
        let mut got: Vec<Received> = Vec::new();
        let mut since_ack = 0;
        loop {
            let target = *done_rx.borrow();
            if got.len() as u64 >= target {
                break;
            }
            let next = tokio::select! {
                d = consumer.next() => d,
                _ = done_rx.changed() => continue,
                _ = tokio::time::sleep(Duration::from_secs(30)) => {
                    return Err(format!("[{tag}] consumer: nothing for 30 s after {} messages", got.len()));
                }
            };
            let d = match next {
                Some(Ok(d)) => d,
                Some(Err(e)) => return Err(format!("[{tag}] consumer: {e}")),
                None => return Err(format!("[{tag}] consumer stream ended")),
            };
            let recv_us = now_us();
            let header_commit_us = match d
                .properties
                .headers()
                .as_ref()
                .and_then(|h| h.inner().get("x-pgoutbox-commit-time-us").cloned())
            {
                Some(AMQPValue::LongLongInt(t)) => Some(t),
                _ => None,
            };
            got.push(Received {
                message_id: d.properties.message_id().as_ref().map(|m| m.to_string()),
                recv_us,
                header_commit_us,
            });
            since_ack += 1;
            if since_ack >= 100 || got.len() as u64 >= *done_rx.borrow() {
                d.acker
                    .ack(BasicAckOptions { multiple: true })
                    .await
                    .map_err(|e| format!("[{tag}] ack: {e}"))?;
                since_ack = 0;
            }
        }
        Ok(got)
    });

    // Producers: one message per transaction, paced per millisecond; each records when its
    // commit returned, keyed by its own message_id and by the message's LSN.
    let per = rate / LATENCY_PRODUCERS as f64;
    let jiffies0 = machine_jiffies();
    let rabbit_pid = ctx.stack.rabbit_pid().map(|p| p.to_string());
    let cpu_of = |pid: &Option<String>| pid.as_deref().and_then(|p| cpu_secs(p, ctx.tck));
    let self_pid = Some(std::process::id().to_string());
    let (pg0, rabbit0, bench0) = (
        ctx.stack.postgres_cpu_secs(ctx.tck),
        cpu_of(&rabbit_pid),
        cpu_of(&self_pid),
    );
    let start = Instant::now();
    let measured_from_us = now_us() + LATENCY_WARMUP.as_micros() as i64;
    let end = start + Duration::from_secs(dur);
    let mut tasks = Vec::new();
    for p in 0..LATENCY_PRODUCERS {
        let url = url.clone();
        let phase = p as f64 / LATENCY_PRODUCERS as f64;
        tasks.push(tokio::spawn(async move {
            let c = pg(&url, "[s4] producer").await?;
            // The stack runs with synchronous_commit=off, where a commit reaches the
            // walsender only when the WAL writer flushes (wal_writer_delay, 200 ms): that
            // would measure the WAL writer, not the relay. Producers commit synchronously.
            sql(
                &c,
                "[s4] producer",
                &format!("SET synchronous_commit = {PRODUCER_SYNC_COMMIT}"),
            )
            .await?;
            let st = c
                .prepare(
                    "SELECT outbox.emit_bytes($1::text, $2::bytea, 'application/octet-stream', \
                     '{}'::jsonb, $3::text)::text",
                )
                .await
                .map_err(|e| format!("[s4] prepare: {}", pg_err(&e)))?;
            let payload = vec![b'x'; 256];
            let topic = "bench.s4";
            // (message_id, message LSN, commit-return time in µs)
            let mut sent: Vec<(String, Option<u64>, i64)> = Vec::new();
            loop {
                let now = Instant::now();
                if now >= end {
                    break;
                }
                // Producer p runs p/4 of an interval ahead of producer 0: four producers
                // started together would otherwise commit in bursts of four, in step.
                let due = (secs(now - start) * per + phase) as usize;
                while sent.len() < due {
                    let id = format!("s4-{p}-{}", sent.len());
                    // Autocommit: the statement's return is the commit's return.
                    let row = c
                        .query_one(&st, &[&topic, &payload, &id])
                        .await
                        .map_err(|e| format!("[s4] emit: {}", pg_err(&e)))?;
                    let at = now_us();
                    let lsn = row.try_get::<_, String>(0).ok().and_then(|t| parse_lsn(&t));
                    sent.push((id, lsn, at));
                }
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
            Ok::<_, String>(sent)
        }));
    }
    let mut by_id: HashMap<String, i64> = HashMap::new();
    let mut by_lsn: HashMap<u64, i64> = HashMap::new();
    for t in tasks {
        for (id, lsn, at) in t.await.map_err(|e| format!("[s4] producer task: {e}"))?? {
            by_id.insert(id, at);
            if let Some(lsn) = lsn {
                by_lsn.insert(lsn, at);
            }
        }
    }
    let sent = by_id.len() as u64;
    let produce_s = secs(start.elapsed());
    let per_msg = |a: Option<f64>, b: Option<f64>| match (a, b) {
        (Some(a), Some(b)) => (b - a) * 1e6 / sent.max(1) as f64,
        _ => f64::NAN,
    };
    let postgres_cpu_us_per_msg = per_msg(pg0, ctx.stack.postgres_cpu_secs(ctx.tck));
    let rabbit_cpu_us_per_msg = per_msg(rabbit0, cpu_of(&rabbit_pid));
    let bench_cpu_us_per_msg = per_msg(bench0, cpu_of(&self_pid));
    let machine_cpu_busy = match (jiffies0, machine_jiffies()) {
        (Some((b0, t0)), Some((b1, t1))) if t1 > t0 => (b1 - b0) as f64 / (t1 - t0) as f64,
        _ => f64::NAN,
    };
    done_tx.send(sent).ok();
    let got = match consumer_task.await {
        Ok(Ok(got)) => got,
        Ok(Err(e)) => {
            let _ = streamer.stop().await;
            return Err(e);
        }
        Err(e) => {
            let _ = streamer.stop().await;
            return Err(format!("[{tag}] consumer task: {e}"));
        }
    };
    let scrape_after = match &http_addr {
        Some(a) => scrape(a)
            .await
            .map_err(|e| eprintln!("bench: WARNING: [{tag}] {e}"))
            .ok(),
        None => None,
    };
    let pid = streamer.pid.to_string();
    let cpu = cpu_secs(&pid, ctx.tck).ok_or("[s4] read /proc stat")?;
    let rss = vm_hwm_mb(streamer.pid).ok_or("[s4] read /proc status")?;
    let exit_status = streamer.stop().await;
    let _ = tokio::time::timeout(
        Duration::from_secs(5),
        cconn.close(200, "bench done".into()),
    )
    .await;
    drop(c);
    delete_queue(&ctx.ch, &exchange, &queue)
        .await
        .map_err(|e| format!("[{tag}] {e}"))?;
    drop_db(ctx, &db)
        .await
        .map_err(|e| format!("[{tag}] {e}"))?;

    let mut from_return = Vec::new();
    let mut dump: Vec<(i64, i64)> = Vec::new();
    let mut from_header = Vec::new();
    let mut unmatched = 0;
    for r in &got {
        let committed = r.message_id.as_deref().and_then(|m| {
            by_id
                .get(m)
                .or_else(|| parse_lsn(m).and_then(|l| by_lsn.get(&l)))
        });
        match committed {
            Some(t) if *t < measured_from_us => continue,
            Some(t) => {
                from_return.push(r.recv_us - t);
                dump.push((*t, r.recv_us));
            }
            None => unmatched += 1,
        }
        if let Some(t) = r.header_commit_us {
            from_header.push(r.recv_us - t);
        }
    }
    // PGOUTBOX_BENCH_DUMP_LATENCY=DIR: one CSV per run (commit-return µs, receive µs), in
    // commit order, to see whether a tail is a few stalls or spread out.
    if let Some(dir) = std::env::var_os("PGOUTBOX_BENCH_DUMP_LATENCY") {
        dump.sort_unstable();
        let mut csv = String::from("commit_return_us,recv_us\n");
        for (c, r) in &dump {
            let _ = writeln!(csv, "{c},{r}");
        }
        let path = PathBuf::from(dir).join(format!("{tag}-run{run}.csv"));
        if let Err(e) = fs::write(&path, csv) {
            eprintln!("bench: WARNING: [{tag}] writing {}: {e}", path.display());
        }
    }
    let (confirm_histogram, residence) = match (&scrape_before, &scrape_after) {
        (Some(b), Some(a)) => (
            confirm_histogram(b, a, "pgoutbox_confirm_latency_seconds"),
            confirm_histogram(b, a, "pgoutbox_residence_seconds"),
        ),
        _ => (None, None),
    };
    Ok(LatencyRun {
        relay: relay.label().to_string(),
        run,
        warmup_s: LATENCY_WARMUP.as_secs_f64(),
        target_msgs_per_s: rate,
        rate_source: rate_source.to_string(),
        duration_s: dur,
        producers: LATENCY_PRODUCERS,
        producer_synchronous_commit: PRODUCER_SYNC_COMMIT.to_string(),
        sent,
        received: got.len() as u64,
        achieved_msgs_per_s: sent as f64 / produce_s,
        from_commit_return: Quantiles::of(from_return),
        unmatched,
        from_commit_header: (!from_header.is_empty()).then(|| Quantiles::of(from_header)),
        confirm_histogram,
        residence,
        cpu_us_per_msg: cpu * 1e6 / sent.max(1) as f64,
        peak_rss_mb: rss,
        machine_cpu_busy,
        postgres_cpu_us_per_msg,
        rabbit_cpu_us_per_msg,
        bench_cpu_us_per_msg,
        exit_status,
    })
}

// ---------------------------------------------------------------------------------------
// Report

fn median_min_max(mut v: Vec<f64>) -> (f64, f64, f64) {
    v.sort_by(f64::total_cmp);
    if v.is_empty() {
        return (f64::NAN, f64::NAN, f64::NAN);
    }
    let m = if v.len() % 2 == 1 {
        v[v.len() / 2]
    } else {
        (v[v.len() / 2 - 1] + v[v.len() / 2]) / 2.0
    };
    (m, v[0], v[v.len() - 1])
}

fn fmt_mmm(v: Vec<f64>, prec: usize) -> String {
    let n = v.len();
    let (m, lo, hi) = median_min_max(v);
    if n <= 1 {
        format!("{m:.prec$}")
    } else {
        format!("{m:.prec$} [{lo:.prec$}–{hi:.prec$}]")
    }
}

fn opt_vals(runs: &[&DrainRun], f: impl Fn(&DrainRun) -> Option<f64>) -> String {
    let v: Vec<f64> = runs.iter().filter_map(|r| f(r)).collect();
    if v.is_empty() {
        "–".into()
    } else {
        fmt_mmm(v, 1)
    }
}

fn table(drains: &[DrainRun]) -> String {
    let mut out = String::new();
    out.push_str(
        "| scenario | N × size | relay | sent | msg/s | MB/s | decode ceiling msg/s | broker ceiling msg/s (shape, best publisher and W) | ratio | CPU µs/msg | CPU / wall | peak RSS MB | walsender µs/msg | RabbitMQ µs/msg |\n\
         |---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n",
    );
    let mut keys: Vec<(String, usize, String)> = Vec::new();
    for d in drains {
        let k = (d.scenario.clone(), d.size, d.relay.clone());
        if !keys.contains(&k) {
            keys.push(k);
        }
    }
    for (sc, size, relay) in keys {
        let runs: Vec<&DrainRun> = drains
            .iter()
            .filter(|d| d.scenario == sc && d.size == size && d.relay == relay)
            .collect();
        let first = runs[0];
        let mut sent: Vec<&str> = Vec::new();
        let mut ceiling: Vec<String> = Vec::new();
        for r in &runs {
            if !sent.contains(&r.observed_shape.as_str()) {
                sent.push(&r.observed_shape);
            }
            ceiling.push(format!(
                "{}, {} W {}",
                r.ceiling_shape.name(),
                r.broker_best_publisher,
                r.broker_best_window
            ));
        }
        ceiling.dedup();
        let _ = writeln!(
            out,
            "| {sc} | {} × {} B ({}/tx) | {relay} | {} | {} | {} | {} | {} ({}) | {} | {} | {} | {} | {} | {} |",
            first.n,
            size,
            first.per_tx,
            sent.join("/"),
            fmt_mmm(runs.iter().map(|r| r.msgs_per_s).collect(), 0),
            fmt_mmm(runs.iter().map(|r| r.mb_per_s).collect(), 1),
            fmt_mmm(runs.iter().map(|r| r.decode_msgs_per_s).collect(), 0),
            fmt_mmm(runs.iter().map(|r| r.broker_msgs_per_s).collect(), 0),
            ceiling.join("/"),
            fmt_mmm(runs.iter().map(|r| r.ratio).collect(), 2),
            fmt_mmm(runs.iter().map(|r| r.cpu_us_per_msg).collect(), 1),
            fmt_mmm(runs.iter().map(|r| r.cpu_share_of_wall).collect(), 2),
            fmt_mmm(runs.iter().map(|r| r.peak_rss_mb).collect(), 1),
            opt_vals(&runs, |r| r.walsender_cpu_us_per_msg),
            opt_vals(&runs, |r| r.rabbit_cpu_us_per_msg),
        );
    }
    out
}

/// pgoutbox's CPU per message with `/metrics` on and off, paired by run (issue 7: within 5%).
fn metrics_table(drains: &[DrainRun]) -> String {
    let mut out = String::from(
        "| scenario | runs | CPU µs/msg, metrics on | CPU µs/msg, metrics off | on ÷ off | msg/s on | msg/s off |\n|---|---|---|---|---|---|---|\n",
    );
    let mut scenarios: Vec<&str> = Vec::new();
    for d in drains {
        if d.metrics == "off" && !scenarios.contains(&d.scenario.as_str()) {
            scenarios.push(&d.scenario);
        }
    }
    for sc in scenarios {
        let mut on = Vec::new();
        let mut off = Vec::new();
        let mut ratio = Vec::new();
        let (mut rate_on, mut rate_off) = (Vec::new(), Vec::new());
        for d_off in drains
            .iter()
            .filter(|d| d.scenario == sc && d.metrics == "off")
        {
            let Some(d_on) = drains.iter().find(|d| {
                d.scenario == sc
                    && d.run == d_off.run
                    && d.metrics == "on"
                    && d.journal == "off"
                    && d.program == "pgoutbox"
                    && d.shape == d_off.shape
            }) else {
                continue;
            };
            on.push(d_on.cpu_us_per_msg);
            off.push(d_off.cpu_us_per_msg);
            ratio.push(d_on.cpu_us_per_msg / d_off.cpu_us_per_msg);
            rate_on.push(d_on.msgs_per_s);
            rate_off.push(d_off.msgs_per_s);
        }
        let _ = writeln!(
            out,
            "| {sc} | {} | {} | {} | {} | {} | {} |",
            on.len(),
            fmt_mmm(on, 1),
            fmt_mmm(off, 1),
            fmt_mmm(ratio, 2),
            fmt_mmm(rate_on, 0),
            fmt_mmm(rate_off, 0),
        );
    }
    out
}

/// The delivery journal's cost: pgoutbox full with `--journal` and without, drained one
/// after the other on the same backlog, paired by run.
fn journal_table(drains: &[DrainRun]) -> String {
    let mut out = String::from(
        "| scenario | runs | CPU µs/msg, journal on | CPU µs/msg, journal off | CPU on ÷ off | msg/s on | msg/s off | msg/s on ÷ off |\n|---|---|---|---|---|---|---|---|\n",
    );
    let mut scenarios: Vec<&str> = Vec::new();
    for d in drains {
        if d.journal == "on" && !scenarios.contains(&d.scenario.as_str()) {
            scenarios.push(&d.scenario);
        }
    }
    for sc in scenarios {
        let (mut cpu_on, mut cpu_off, mut cpu_ratio) = (Vec::new(), Vec::new(), Vec::new());
        let (mut rate_on, mut rate_off, mut rate_ratio) = (Vec::new(), Vec::new(), Vec::new());
        for d_on in drains
            .iter()
            .filter(|d| d.scenario == sc && d.journal == "on")
        {
            let Some(d_off) = drains.iter().find(|d| {
                d.scenario == sc
                    && d.run == d_on.run
                    && d.journal == "off"
                    && d.metrics == "on"
                    && d.shape == Shape::Full
            }) else {
                continue;
            };
            cpu_on.push(d_on.cpu_us_per_msg);
            cpu_off.push(d_off.cpu_us_per_msg);
            cpu_ratio.push(d_on.cpu_us_per_msg / d_off.cpu_us_per_msg);
            rate_on.push(d_on.msgs_per_s);
            rate_off.push(d_off.msgs_per_s);
            rate_ratio.push(d_on.msgs_per_s / d_off.msgs_per_s);
        }
        let _ = writeln!(
            out,
            "| {sc} | {} | {} | {} | {} | {} | {} | {} |",
            cpu_on.len(),
            fmt_mmm(cpu_on, 1),
            fmt_mmm(cpu_off, 1),
            fmt_mmm(cpu_ratio, 2),
            fmt_mmm(rate_on, 0),
            fmt_mmm(rate_off, 0),
            fmt_mmm(rate_ratio, 2),
        );
    }
    out
}

fn broker_table(cases: &[CaseRun]) -> String {
    let mut out = String::from(
        "| scenario | size | shape | bare publisher | window | broker msg/s | bench client CPU µs/msg | RabbitMQ CPU µs/msg |\n|---|---|---|---|---|---|---|---|\n",
    );
    let mut keys: Vec<(String, usize, Shape, &str, usize)> = Vec::new();
    for c in cases {
        for b in &c.broker {
            let k = (c.scenario.clone(), c.size, b.shape, b.publisher, b.window);
            if !keys.contains(&k) {
                keys.push(k);
            }
        }
    }
    for (sc, size, shape, publisher, w) in keys {
        let bs: Vec<&BrokerRun> = cases
            .iter()
            .filter(|c| c.scenario == sc && c.size == size)
            .flat_map(|c| {
                c.broker
                    .iter()
                    .filter(|b| b.shape == shape && b.publisher == publisher && b.window == w)
            })
            .collect();
        let f = |g: &dyn Fn(&BrokerRun) -> Option<f64>, p: usize| {
            let v: Vec<f64> = bs.iter().filter_map(|b| g(b)).collect();
            if v.is_empty() {
                "–".to_string()
            } else {
                fmt_mmm(v, p)
            }
        };
        let _ = writeln!(
            out,
            "| {sc} | {size} B | {} | {publisher} | {w} | {} | {} | {} |",
            shape.name(),
            f(&|b| Some(b.msgs_per_s), 0),
            f(&|b| b.client_cpu_us_per_msg, 1),
            f(&|b| b.rabbit_cpu_us_per_msg, 1),
        );
    }
    out
}

fn ms_pair(a: f64, b: f64) -> String {
    format!("{a:.2} / {b:.2}")
}

/// Scenario 4: pgoutbox and the Node relay side by side per rate (median [min–max] over the
/// runs), then every run in detail.
fn latency_tables(runs: &[LatencyRun]) -> String {
    let mut out = String::from(
        "| target msg/s | pgoutbox shape | runs | achieved msg/s (pgoutbox / Node) | pgoutbox p50 ms | pgoutbox p99 ms | Node relay p50 ms | Node relay p99 ms | pgoutbox /metrics commit→confirm p50 / p99 ms | pgoutbox commit-header p50 / p99 ms | pgoutbox residence p50 / p99 µs | CPU µs/msg pgoutbox / Node | machine busy pgoutbox / Node |\n\
         |---|---|---|---|---|---|---|---|---|---|---|---|---|\n",
    );
    let mut rates: Vec<f64> = Vec::new();
    for r in runs {
        if !rates.contains(&r.target_msgs_per_s) {
            rates.push(r.target_msgs_per_s);
        }
    }
    let dash = || "–".to_string();
    let median = |v: Vec<f64>| median_min_max(v).0;
    let mut labels: Vec<&str> = Vec::new();
    for r in runs {
        if r.relay.starts_with("pgoutbox") && !labels.contains(&r.relay.as_str()) {
            labels.push(&r.relay);
        }
    }
    for (rate, label) in rates
        .iter()
        .flat_map(|rate| labels.iter().map(move |l| (*rate, *l)))
    {
        let p: Vec<&LatencyRun> = runs
            .iter()
            .filter(|r| r.target_msgs_per_s == rate && r.relay == label)
            .collect();
        let n: Vec<&LatencyRun> = runs
            .iter()
            .filter(|r| r.target_msgs_per_s == rate && r.relay == Relay::Node.label())
            .collect();
        let mmm = |v: &[&LatencyRun], f: &dyn Fn(&LatencyRun) -> f64, prec: usize| {
            if v.is_empty() {
                dash()
            } else {
                fmt_mmm(v.iter().map(|r| f(r)).collect(), prec)
            }
        };
        let med = |v: &[&LatencyRun], f: &dyn Fn(&LatencyRun) -> f64, prec: usize| {
            if v.is_empty() {
                dash()
            } else {
                format!("{:.prec$}", median(v.iter().map(|r| f(r)).collect()))
            }
        };
        let med_pair = |v: Vec<(f64, f64)>| {
            if v.is_empty() {
                dash()
            } else {
                ms_pair(
                    median(v.iter().map(|x| x.0).collect()),
                    median(v.iter().map(|x| x.1).collect()),
                )
            }
        };
        let _ = writeln!(
            out,
            "| {rate:.0} | {} | {} | {} / {} | {} | {} | {} | {} | {} | {} | {} | {} / {} | {} / {} |",
            label.trim_start_matches("pgoutbox "),
            p.len().max(n.len()),
            med(&p, &|r| r.achieved_msgs_per_s, 0),
            med(&n, &|r| r.achieved_msgs_per_s, 0),
            mmm(&p, &|r| r.from_commit_return.p50_ms, 2),
            mmm(&p, &|r| r.from_commit_return.p99_ms, 2),
            mmm(&n, &|r| r.from_commit_return.p50_ms, 2),
            mmm(&n, &|r| r.from_commit_return.p99_ms, 2),
            med_pair(
                p.iter()
                    .filter_map(|r| r.confirm_histogram.as_ref())
                    .map(|h| (h.p50_ms, h.p99_ms))
                    .collect()
            ),
            med_pair(
                p.iter()
                    .filter_map(|r| r.from_commit_header.as_ref())
                    .map(|h| (h.p50_ms, h.p99_ms))
                    .collect()
            ),
            {
                let v: Vec<(f64, f64)> = p
                    .iter()
                    .filter_map(|r| r.residence.as_ref())
                    .map(|h| (h.p50_ms * 1e3, h.p99_ms * 1e3))
                    .collect();
                if v.is_empty() {
                    dash()
                } else {
                    format!(
                        "{:.0} / {:.0}",
                        median(v.iter().map(|x| x.0).collect()),
                        median(v.iter().map(|x| x.1).collect())
                    )
                }
            },
            med(&p, &|r| r.cpu_us_per_msg, 1),
            med(&n, &|r| r.cpu_us_per_msg, 1),
            med(&p, &|r| r.machine_cpu_busy * 100.0, 0) + "%",
            med(&n, &|r| r.machine_cpu_busy * 100.0, 0) + "%",
        );
    }
    out.push_str(
        "\n| relay | run | target msg/s | achieved | received | unmatched | p50 ms | p95 ms | p99 ms | max ms | CPU µs/msg | peak RSS MB | machine busy | CPU µs/msg of Postgres / RabbitMQ / bench clients |\n\
         |---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n",
    );
    for r in runs {
        let l = &r.from_commit_return;
        let _ = writeln!(
            out,
            "| {} | {} | {:.0} | {:.0} | {} | {} | {:.2} | {:.2} | {:.2} | {:.2} | {:.1} | {:.1} | {:.0}% | {:.0} / {:.0} / {:.0} |",
            r.relay,
            r.run,
            r.target_msgs_per_s,
            r.achieved_msgs_per_s,
            r.received,
            r.unmatched,
            l.p50_ms,
            l.p95_ms,
            l.p99_ms,
            l.max_ms,
            r.cpu_us_per_msg,
            r.peak_rss_mb,
            r.machine_cpu_busy * 100.0,
            r.postgres_cpu_us_per_msg,
            r.rabbit_cpu_us_per_msg,
            r.bench_cpu_us_per_msg
        );
    }
    out
}

// ---------------------------------------------------------------------------------------
// Main

fn build_pgoutbox() -> R<()> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let st = Command::new(&cargo)
        .current_dir(root())
        .args(["build", "--release", "--bin", "pgoutbox"])
        .status()
        .map_err(|e| format!("build: running {cargo}: {e}"))?;
    if !st.success() {
        return Err(format!(
            "build: `{cargo} build --release --bin pgoutbox` failed ({st})"
        ));
    }
    Ok(())
}

async fn bench(args: Args, stack_slot: Arc<Mutex<Option<Stack>>>) -> R<()> {
    let sz = sizes(args.quick);
    let log_dir = root().join("target/bench");
    fs::create_dir_all(&log_dir).map_err(|e| format!("create {}: {e}", log_dir.display()))?;
    if std::env::var_os("PGOUTBOX_BENCH_SKIP_BUILD").is_none() {
        build_pgoutbox()?;
    }
    if std::env::var_os("PGOUTBOX_BENCH_BIN").is_some() {
        eprintln!(
            "bench: NOTE: measuring {} (PGOUTBOX_BENCH_BIN), not the release build: a smoke \
             of the benchmark, its figures are not the product's",
            pgoutbox_bin().display()
        );
    }
    let stamp = sh("date", &["-u", "+%Y%m%dT%H%M%SZ"]);
    let dir = PathBuf::from(format!("/tmp/pgoutbox-bench-{}", std::process::id()));
    eprintln!("bench: starting the stack in {}", dir.display());
    // Scenario 5 needs the stream plugin (and a stream listener, see deploy/stack.sh).
    let plugins = if args.scenarios.contains(&5) {
        "rabbitmq_stream"
    } else {
        ""
    };
    let stack = Stack::start(&dir, plugins)?;
    let env = stack.env.clone();
    *stack_slot.lock().map_err(|_| "lock")? = Some(stack);
    // The stack lives in stack_slot (stopped by main); Ctx gets its own handle to the env.
    let stack = Stack {
        dir: dir.clone(),
        env,
        stopped: true, // this copy never stops anything
    };
    let admin = pg(stack.get("PGOUTBOX_DATABASE_URL"), "admin").await?;
    let amqp_conn = amqp(stack.get("PGOUTBOX_AMQP_URL"), "admin").await?;
    let ch = amqp_conn
        .create_channel()
        .await
        .map_err(|e| format!("admin channel: {e}"))?;
    let tck = clk_tck();
    let node = prepare_node_peer(&log_dir);
    match &node {
        Ok(p) => eprintln!(
            "bench: Node relay {} (node {}) runs next to pgoutbox",
            p.dir.display(),
            p.node_version
        ),
        Err(why) => eprintln!("bench: NOTE: the Node relay rows are skipped: {why}"),
    }
    let has_publish_properties = binary_has_publish_properties();
    if !has_publish_properties {
        eprintln!(
            "bench: NOTE: {} has no --publish-properties: its \"minimal\" \
             rows send the full shape (the table says what arrived)",
            pgoutbox_bin().display()
        );
    }
    let ctx = Ctx {
        stack,
        admin,
        amqp: amqp_conn,
        ch,
        tck,
        log_dir: log_dir.clone(),
        node,
    };

    let pg_version = sql_text(&ctx.admin, "version", "SELECT version()").await?;
    let mut pg_settings = Vec::new();
    for s in [
        "fsync",
        "synchronous_commit",
        "full_page_writes",
        "wal_level",
        "shared_buffers",
    ] {
        let v = sql_text(&ctx.admin, "settings", &format!("SHOW {s}")).await?;
        pg_settings.push(format!("{s}={v}"));
    }
    let rabbit_version = {
        let v = sh(
            "bash",
            &[
                &root().join("deploy/stack.sh").to_string_lossy(),
                "ctl",
                &dir.to_string_lossy(),
                "-q",
                "version",
            ],
        );
        if v.is_empty() {
            "unknown".to_string()
        } else {
            v
        }
    };
    let cpuinfo = fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let cpu_model = cpuinfo
        .lines()
        .find(|l| l.starts_with("model name"))
        .and_then(|l| l.split_once(':'))
        .map(|(_, v)| v.trim().to_string())
        .unwrap_or_else(|| "unknown".into());
    let mem = fs::read_to_string("/proc/meminfo")
        .unwrap_or_default()
        .lines()
        .find(|l| l.starts_with("MemTotal"))
        .map(|l| l.split_whitespace().skip(1).collect::<Vec<_>>().join(" "))
        .unwrap_or_default();
    let machine = json!({
        "nproc": sh("nproc", &[]),
        "cpu_model": cpu_model,
        "mem_total": mem,
        "postgres": pg_version,
        "postgres_settings": pg_settings,
        "rabbitmq": rabbit_version,
        "date": sh("date", &["-u", "+%Y-%m-%dT%H:%M:%SZ"]),
        "load_at_start": loadavg(),
        "kernel": sh("uname", &["-r"]),
    });
    eprintln!("bench: machine {machine}");

    let t_all = Instant::now();
    let mut cases: Vec<CaseRun> = Vec::new();
    let mut drains: Vec<DrainRun> = Vec::new();
    let path = log_dir.join(format!("results-{stamp}.json"));
    // After every case: the table so far on stderr, the raw figures so far in the JSON file.
    let progress = |cases: &[CaseRun], drains: &[DrainRun]| {
        eprintln!("bench: results so far:\n{}", table(drains));
        let partial =
            json!({"complete": false, "machine": machine, "cases": cases, "drains": drains});
        if let Ok(text) = serde_json::to_string_pretty(&partial) {
            let _ = fs::write(&path, text);
        }
    };
    let has = |s: u32| args.scenarios.contains(&s);
    let with_node = |mut v: Vec<Relay>| {
        if ctx.node().is_some() {
            v.push(Relay::Node);
        }
        v
    };
    let s1_relays = with_node(vec![
        Relay::Pgoutbox(Shape::Full, Metrics::On),
        Relay::PgoutboxJournal,
        Relay::Pgoutbox(Shape::Full, Metrics::Off),
        Relay::Pgoutbox(Shape::Minimal, Metrics::On),
    ]);
    let s2_relays = with_node(vec![
        Relay::Pgoutbox(Shape::Full, Metrics::On),
        Relay::PgoutboxJournal,
        Relay::Pgoutbox(Shape::Minimal, Metrics::On),
    ]);
    let s3_relays = [Relay::Pgoutbox(Shape::Full, Metrics::On)];
    for run in 1..=args.runs {
        // Every other run drains in the reverse order, so that neither the first drain of a
        // fresh backlog nor the last one always falls to the same relay; metrics on and off
        // stay next to each other.
        let order = |relays: &[Relay]| {
            let mut v = relays.to_vec();
            if run % 2 == 0 {
                v.reverse();
            }
            v
        };
        if has(1) {
            let (c, d) =
                drain_case(&ctx, "s1", run, sz.s1_n, 256, 1000, &order(&s1_relays)).await?;
            cases.push(c);
            drains.extend(d);
            progress(&cases, &drains);
        }
        if has(2) {
            let (c, d) = drain_case(&ctx, "s2", run, sz.s2_n, 256, 1, &order(&s2_relays)).await?;
            cases.push(c);
            drains.extend(d);
            progress(&cases, &drains);
        }
        if has(3) {
            for size in [64usize, 1024, 16 << 10, 256 << 10] {
                let n = (sz.s3_bytes / size as u64).max(sz.s3_min_count);
                let per_tx = ((1u64 << 20) / size as u64).clamp(1, 1000);
                let sc = format!("s3_{size}");
                let (c, d) = drain_case(&ctx, &sc, run, n, size, per_tx, &s3_relays).await?;
                cases.push(c);
                drains.extend(d);
                progress(&cases, &drains);
            }
        }
    }
    let mut streams: Vec<StreamCaseRun> = Vec::new();
    if has(5) {
        for run in 1..=args.runs {
            let s = stream_case(&ctx, run, sz.s5_n, 256, 1000).await?;
            streams.push(s);
            eprintln!("bench: streams so far:\n{}", stream_table(&streams));
        }
    }
    let mut latency: Vec<LatencyRun> = Vec::new();
    if has(4) {
        let s2: Vec<f64> = drains
            .iter()
            .filter(|d| d.scenario == "s2" && d.relay == "pgoutbox full")
            .map(|d| d.msgs_per_s)
            .collect();
        let rates: Vec<(f64, String)> = if let Some(r) = &args.s4_rates {
            r.iter()
                .map(|r| (*r, "fixed (--s4-rate)".to_string()))
                .collect()
        } else if args.quick {
            vec![(QUICK_LATENCY_RATE, "fixed (--quick)".to_string())]
        } else {
            let (half, source) = if s2.is_empty() {
                (5000.0, "5000, scenario 2 not run".to_string())
            } else {
                let (m, _, _) = median_min_max(s2);
                (
                    (m / 2.0 / 100.0).round() * 100.0,
                    format!("half the scenario-2 median ({m:.0} msg/s)"),
                )
            };
            let mut v: Vec<(f64, String)> = LATENCY_RATES
                .iter()
                .filter(|r| **r == LATENCY_RATES[0] || **r < half * 0.9)
                .map(|r| (*r, "fixed".to_string()))
                .collect();
            if half > v.last().map(|r| r.0).unwrap_or(0.0) * 1.1 {
                v.push((half, source));
            }
            v
        };
        let relays = with_node(
            args.s4_shapes
                .iter()
                .map(|shape| Relay::Pgoutbox(*shape, Metrics::On))
                .collect(),
        );
        for run in 1..=args.runs {
            for (rate, source) in &rates {
                let rate = *rate;
                // As in scenarios 1-3, every other run takes the relays in the reverse order.
                let mut order = relays.clone();
                if run % 2 == 0 {
                    order.reverse();
                }
                for relay in &order {
                    match latency_case(&ctx, *relay, rate, source, sz.s4_secs, run).await {
                        Ok(l) => {
                            eprintln!(
                                "bench: [s4] {} at {rate:.0} msg/s: p50 {:.2} ms, p99 {:.2} ms",
                                l.relay, l.from_commit_return.p50_ms, l.from_commit_return.p99_ms
                            );
                            latency.push(l);
                        }
                        Err(e) if *relay == Relay::Node => eprintln!(
                            "bench: WARNING: [s4] the Node relay failed at {rate:.0} msg/s, row \
                         left out: {e}"
                        ),
                        Err(e) => return Err(e),
                    }
                }
            }
        }
    }
    let total_s = secs(t_all.elapsed());

    // Report.
    let mut md = String::new();
    let _ = writeln!(
        md,
        "## pgoutbox benchmark ({} mode, {} run(s) of each scenario, {:.0} s)\n",
        if args.quick { "quick" } else { "full" },
        args.runs,
        total_s
    );
    let _ = writeln!(
        md,
        "Machine: {} cores, {}, {} RAM; {}; RabbitMQ {}; load at start {}, at end {}.  ",
        machine["nproc"].as_str().unwrap_or("?"),
        machine["cpu_model"].as_str().unwrap_or("?"),
        machine["mem_total"].as_str().unwrap_or("?"),
        machine["postgres"]
            .as_str()
            .unwrap_or("?")
            .split(" on ")
            .next()
            .unwrap_or("?"),
        machine["rabbitmq"].as_str().unwrap_or("?"),
        machine["load_at_start"].as_str().unwrap_or("?"),
        loadavg()
    );
    let _ =
        writeln!(
        md,
        "Postgres runs with **{}** (deploy/stack.sh: no WAL durability; producers and decode are \
         faster than on a durable server); RabbitMQ with scheduler busy-waiting off (+sbwt none, \
         the advice for a node sharing its cores). Messages persistent (delivery_mode 2), durable classic \
         queue bound with `#`, publisher confirms; pgoutbox and the Node relay run with a window \
         of {PGOUTBOX_WINDOW}. Each backlog is drained once per relay, each on its own slot. \
         Values: median [min–max] over runs. sent = the shape of a message taken from the \
         relay's queue (full: our headers, content type, timestamp; minimal: message_id only). \
         ratio = msg/s ÷ min(decode, broker ceiling of the shape sent) per run. Broker ceiling: \
         the best of a bare lapin publisher at W={:?} and a bare publisher on pgoutbox's own \
         connection at W={OWN_PUBLISHER_WINDOW}, on min(N, {BROKER_CAP}) messages of that shape. \
         Decode ceiling: pg_recvlogical on a twin slot. CPU / wall: the relay's CPU seconds ÷ \
         drain seconds (1.0 = one core busy).{}\n",
        pg_settings.join(", "),
        BROKER_WINDOWS,
        match &ctx.node {
            Ok(p) => format!(" Node relay: `{}` on node {}.", NODE_PEER_DIR, p.node_version),
            Err(why) => format!(" **Node relay skipped**: {why}."),
        }
    );
    md.push_str(&table(&drains));
    if drains.iter().any(|d| d.metrics == "off") {
        md.push_str("\npgoutbox CPU per message with `/metrics` on and off (`PGOUTBOX_HTTP_ADDR=off`), drains of the same backlog back to back, paired by run:\n\n");
        md.push_str(&metrics_table(&drains));
    }
    if drains.iter().any(|d| d.journal == "on") {
        md.push_str("\nThe delivery journal's cost: pgoutbox full with `--journal` and without (metrics on in both), drains of the same backlog back to back, paired by run:\n\n");
        md.push_str(&journal_table(&drains));
    }
    if !cases.is_empty() {
        md.push_str("\nBroker ceiling by shape and window:\n\n");
        md.push_str(&broker_table(&cases));
    }
    if let Some(s) = streams.first() {
        let _ = writeln!(
            md,
            "\nStreams (scenario 5): one backlog of {} × {} B in transactions of {}, drained by \
             pgoutbox into a stream (`run --stream-url --stream`) and into a durable classic \
             queue (the AMQP path), full shape, window {PGOUTBOX_WINDOW}, each on its own slot; \
             the bare stream publisher (no Postgres: pre-built AMQP 1.0 messages of the same \
             shape, one fresh stream, confirms pipelined, best of W={:?}) measured in the same \
             run. CPU and peak RSS are pgoutbox's own (the bare publisher's row: the bench \
             client's CPU).\n",
            s.n, s.size, s.per_tx, STREAM_WINDOWS
        );
        md.push_str(&stream_table(&streams));
    }
    if let Some(l) = latency.first() {
        let _ = writeln!(
            md,
            "\nSteady-state latency, {} paced producers (synchronous_commit={}), one message \
             per transaction, 256 B, {} s per run. Latency = consumer receive time − the \
             producer's commit-return time (matched by message_id for pgoutbox, by message LSN \
             for the Node relay). pgoutbox runs the full shape unless `--s4-shapes` adds minimal (one row per shape). /metrics: pgoutbox's own \
             `pgoutbox_confirm_latency_seconds` (commit to broker confirm), scraped before and \
             after, differenced, quantiles interpolated within buckets. Commit-header: receive \
             time − `x-pgoutbox-commit-time-us`. The quantiles leave out the messages \
             committed in the first {:.0} s of each run (warm-up); CPU covers the whole run.\n",
            l.producers, l.producer_synchronous_commit, l.duration_s, l.warmup_s
        );
        md.push_str(&latency_tables(&latency));
    }
    let bad: Vec<String> = drains
        .iter()
        .filter(|d| d.exit_status != "exit status: 0")
        .map(|d| {
            format!(
                "{} {} run {}: {}",
                d.scenario, d.relay, d.run, d.exit_status
            )
        })
        .chain(streams.iter().flat_map(|s| {
            s.drains
                .iter()
                .filter(|d| d.exit_status != "exit status: 0")
                .map(move |d| format!("s5 into {} run {}: {}", d.sink, s.run, d.exit_status))
        }))
        .chain(
            latency
                .iter()
                .filter(|l| l.exit_status != "exit status: 0")
                .map(|l| {
                    format!(
                        "s4 {} at {:.0}: {}",
                        l.relay, l.target_msgs_per_s, l.exit_status
                    )
                }),
        )
        .collect();
    if !bad.is_empty() {
        let _ = writeln!(
            md,
            "\n**WARNING**: a relay did not exit 0 on SIGTERM: {}",
            bad.join("; ")
        );
    }
    let ignored: Vec<String> = drains
        .iter()
        .filter(|d| d.observed_shape != d.shape.name())
        .map(|d| {
            format!(
                "{} {} run {} sent {}",
                d.scenario, d.relay, d.run, d.observed_shape
            )
        })
        .collect();
    if !ignored.is_empty() {
        let _ = writeln!(
            md,
            "\n**NOTE**: rows that did not send the shape asked for (ratio against the shape \
             sent): {}{}",
            ignored.join("; "),
            if has_publish_properties {
                ""
            } else {
                " (this pgoutbox has no --publish-properties)"
            }
        );
    }
    let _ = writeln!(md, "\nRaw figures: {}", path.display());
    println!("{md}");
    let results = json!({
        "complete": true,
        "mode": if args.quick { "quick" } else { "full" },
        "runs": args.runs,
        "scenarios": args.scenarios,
        "total_s": total_s,
        "machine": machine,
        "load_at_end": loadavg(),
        "pgoutbox_window": PGOUTBOX_WINDOW,
        "broker_windows": BROKER_WINDOWS,
        "broker_cap": BROKER_CAP,
        "pgoutbox_has_publish_properties": has_publish_properties,
        "node_peer": match &ctx.node {
            Ok(p) => json!({"ran": true, "dir": p.dir, "node_version": p.node_version}),
            Err(why) => json!({"ran": false, "skipped_because": why}),
        },
        "cases": cases,
        "drains": drains,
        "streams": streams,
        "latency": latency,
        "markdown": md,
    });
    fs::write(
        &path,
        serde_json::to_string_pretty(&results).map_err(|e| format!("json: {e}"))?,
    )
    .map_err(|e| format!("write {}: {e}", path.display()))?;
    let _ = tokio::time::timeout(
        Duration::from_secs(5),
        ctx.amqp.close(200, "bench done".into()),
    )
    .await;
    Ok(())
}

fn main() {
    let args = match parse_args() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("bench: {e}");
            std::process::exit(2);
        }
    };
    let rt = match tokio::runtime::Runtime::new() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("bench: tokio runtime: {e}");
            std::process::exit(1);
        }
    };
    let stack: Arc<Mutex<Option<Stack>>> = Arc::new(Mutex::new(None));
    let result = rt.block_on(async {
        let mut term =
            match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                Ok(t) => t,
                Err(e) => return Err(format!("install SIGTERM handler: {e}")),
            };
        tokio::select! {
            r = bench(args, stack.clone()) => r,
            _ = tokio::signal::ctrl_c() => Err("interrupted (SIGINT)".to_string()),
            _ = term.recv() => Err("interrupted (SIGTERM)".to_string()),
        }
    });
    kill_registered();
    if let Ok(mut s) = stack.lock() {
        if let Some(mut s) = s.take() {
            s.stop();
        }
    }
    drop(rt);
    if let Err(e) = result {
        eprintln!("bench: FAILED: {e}");
        std::process::exit(1);
    }
}
