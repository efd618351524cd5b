//! The pgoutbox benchmark: throughput, ceilings and latency on a throwaway local stack.
//!
//! ```text
//! cargo run --release --example bench -- [--quick] [--runs N] [--scenarios 1,2,3,4] [--s4-rate MSGS_PER_S]
//! bash deploy/bench.sh [same arguments]        # installs packages, builds, runs this
//! ```
//!
//! It starts its own PostgreSQL + RabbitMQ with `deploy/stack.sh start` (stopped again on exit,
//! error or ctrl-c), builds `target/release/pgoutbox`, and measures:
//!
//! 1. backlog drain, 1,000,000 x 256 B in transactions of 1,000 (quick: 20,000);
//! 2. backlog drain, 100,000 x 256 B, one message per transaction (quick: 10,000);
//! 3. a size sweep, 64 B / 1 KiB / 16 KiB / 256 KiB, about the same bytes per size;
//! 4. steady-state latency (consumer receive time minus the `x-pgoutbox-commit-time-us`
//!    header) with producers at half the scenario-2 rate (quick: 2,000 msg/s).
//!
//! For every drain it also measures, in the same run and on the same machine, the **decode
//! ceiling** (`pg_recvlogical` on a twin slot created together with pgoutbox's, before the
//! backlog) and the **broker ceiling** (a bare pipelined lapin publisher with confirms at
//! windows 10,000 and 1,000; the best counts). ratio = pgoutbox msg/s / min(ceilings).
//! Scenarios 1-3 are repeated `--runs` times (default 3, quick 1) and reported as median
//! [min-max]. A Markdown table goes to stdout, raw figures to
//! `target/bench/results-<timestamp>.json`, pgoutbox logs to `target/bench/`.

use std::collections::HashMap;
use std::fmt::Write as _;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use futures::StreamExt;
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicPublishOptions, BasicQosOptions,
    ConfirmSelectOptions, ExchangeDeclareOptions, ExchangeDeleteOptions, QueueBindOptions,
    QueueDeclareOptions, QueueDeleteOptions,
};
use lapin::types::{AMQPValue, FieldTable, ShortString};
use lapin::{
    BasicProperties, Channel, Confirmation, Connection, ConnectionProperties, ExchangeKind,
    PublisherConfirm,
};
use serde::Serialize;
use serde_json::json;
use tokio::sync::{mpsc, OwnedSemaphorePermit, Semaphore};

type R<T> = Result<T, String>;

/// pgoutbox's default `--max-in-flight` (the window it runs with here).
const PGOUTBOX_WINDOW: usize = 10_000;
/// Windows tried for the broker ceiling; the best one counts.
const BROKER_WINDOWS: [usize; 2] = [10_000, 1_000];
/// The broker ceiling publishes at most this many messages (its rate is flat well before).
const BROKER_CAP: u64 = 200_000;
/// Publish futures first-polled together by the bare publisher.
const PIPELINE: usize = 128;
/// Parallel producer connections that write a backlog.
const EMIT_CONNECTIONS: u64 = 2;
/// Producer connections for the steady-state scenario.
const LATENCY_PRODUCERS: usize = 4;
/// `synchronous_commit` of the steady-state producers (see [`latency_case`]).
const PRODUCER_SYNC_COMMIT: &str = "on";
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
    /// Scenario 4's producer rate (msg/s) instead of half the scenario-2 median.
    s4_rate: Option<f64>,
}

fn parse_args() -> R<Args> {
    let mut quick = false;
    let mut runs = None;
    let mut scenarios = vec![1, 2, 3, 4];
    let mut s4_rate = None;
    let mut it = std::env::args().skip(1);
    while let Some(a) = it.next() {
        match a.as_str() {
            "--quick" => quick = true,
            "--runs" => {
                let v = it.next().ok_or("--runs needs a number")?;
                runs = Some(v.parse::<u32>().map_err(|e| format!("--runs {v}: {e}"))?);
            }
            "--scenarios" => {
                let v = it.next().ok_or("--scenarios needs a list like 1,2,3,4")?;
                scenarios = v
                    .split(',')
                    .map(|s| {
                        s.trim()
                            .parse::<u32>()
                            .ok()
                            .filter(|n| (1..=4).contains(n))
                            .ok_or(format!("--scenarios: bad scenario {s:?} (1..4)"))
                    })
                    .collect::<R<Vec<_>>>()?;
            }
            "--s4-rate" => {
                let v = it.next().ok_or("--s4-rate needs messages per second")?;
                s4_rate = Some(
                    v.parse::<f64>()
                        .ok()
                        .filter(|r| *r > 0.0)
                        .ok_or(format!("--s4-rate {v}: expected a positive number"))?,
                );
            }
            "-h" | "--help" => {
                println!(
                    "usage: bench [--quick] [--runs N] [--scenarios 1,2,3,4] [--s4-rate MSGS_PER_S]\n\
                     full: ~11 min on 2 cores; --quick: ~2-3 min (1 run, small counts)"
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
        s4_rate,
    })
}

struct Sizes {
    s1_n: u64,
    s2_n: u64,
    s3_bytes: u64,
    s3_min_count: u64,
    s4_secs: u64,
}

fn sizes(quick: bool) -> Sizes {
    if quick {
        Sizes {
            s1_n: 20_000,
            s2_n: 10_000,
            s3_bytes: 2 << 20,
            s3_min_count: 32,
            s4_secs: 5,
        }
    } else {
        Sizes {
            s1_n: 1_000_000,
            s2_n: 100_000,
            s3_bytes: 32 << 20,
            s3_min_count: 512,
            s4_secs: 30,
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
    fn start(dir: &Path) -> R<Stack> {
        let _ = fs::remove_dir_all(dir);
        let out = Command::new("bash")
            .arg(root().join("deploy/stack.sh"))
            .arg("start")
            .arg(dir)
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

fn props(i: u64) -> BasicProperties {
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
    window: usize,
    n: u64,
    elapsed_s: f64,
    msgs_per_s: f64,
    client_cpu_us_per_msg: Option<f64>,
    rabbit_cpu_us_per_msg: Option<f64>,
}

/// A bare lapin publisher: persistent, mandatory, confirms on, `window` unconfirmed at most,
/// [`PIPELINE`] publish futures polled together, confirms awaited on another task.
async fn broker_ceiling(
    stack: &Stack,
    tag: &str,
    n: u64,
    size: usize,
    window: usize,
    tck: f64,
) -> R<BrokerRun> {
    let what = format!("broker ceiling {tag} W={window}");
    let conn = amqp(stack.get("PGOUTBOX_AMQP_URL"), &what).await?;
    let ch = conn
        .create_channel()
        .await
        .map_err(|e| format!("{what}: channel: {e}"))?;
    let exchange = format!("bench-ceil-{tag}-w{window}");
    let queue = format!("bench-ceil-{tag}-w{window}");
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
                    props(i + k),
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
    let _ = conn.close(200, "bench done".into()).await;
    let per = |a: Option<f64>, b: Option<f64>| Some((b? - a?) * 1e6 / n as f64);
    Ok(BrokerRun {
        window,
        n,
        elapsed_s: elapsed,
        msgs_per_s: n as f64 / elapsed,
        client_cpu_us_per_msg: per(c0, c1),
        rabbit_cpu_us_per_msg: per(r0, r1),
    })
}

// ---------------------------------------------------------------------------------------
// pgoutbox and pg_recvlogical as children

struct Streamer {
    child: Child,
    pid: u32,
    log: PathBuf,
}

impl Streamer {
    fn start(stack: &Stack, db_url: &str, exchange: &str, log: PathBuf) -> R<Streamer> {
        let bin = root().join("target/release/pgoutbox");
        let file = fs::File::create(&log).map_err(|e| format!("create {}: {e}", log.display()))?;
        let child = Command::new(&bin)
            .args([
                "run",
                "--database-url",
                db_url,
                "--amqp-url",
                stack.get("PGOUTBOX_AMQP_URL"),
                "--slot",
                SLOT,
                "--publication",
                PUBLICATION,
                "--exchange",
                exchange,
                "--max-in-flight",
                &PGOUTBOX_WINDOW.to_string(),
            ])
            // Metrics on an ephemeral port, so benchmarks never collide on the default
            // address; PGOUTBOX_HTTP_ADDR (e.g. off) overrides.
            .args(match std::env::var_os("PGOUTBOX_HTTP_ADDR") {
                Some(_) => vec![],
                None => vec!["--http-addr", "127.0.0.1:0"],
            })
            .stdin(Stdio::null())
            .stdout(
                file.try_clone()
                    .map_err(|e| format!("log file {}: {e}", log.display()))?,
            )
            .stderr(file)
            .spawn()
            .map_err(|e| format!("start {}: {e}", bin.display()))?;
        let pid = child.id();
        register(pid);
        Ok(Streamer { child, pid, log })
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
                "{what}: pgoutbox exited early ({st}); log {}:\n{}",
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
                "bench: WARNING: pgoutbox did not exit cleanly on SIGTERM: {status}; log {}:\n{}",
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
// One backlog drain with its ceilings

#[derive(Debug, Clone, Serialize)]
struct DrainRun {
    scenario: String,
    run: u32,
    n: u64,
    size: usize,
    per_tx: u64,
    emit_s: f64,
    decode_s: f64,
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
    broker: Vec<BrokerRun>,
    broker_msgs_per_s: f64,
    broker_best_window: usize,
    ceiling_msgs_per_s: f64,
    ceiling_is: String,
    ratio: f64,
    exit_status: String,
    load_before: String,
}

struct Ctx {
    stack: Stack,
    admin: tokio_postgres::Client,
    amqp: Connection,
    ch: Channel,
    tck: f64,
    log_dir: PathBuf,
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
    let bin = root().join("target/release/pgoutbox");
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

async fn walsender_pid(c: &tokio_postgres::Client) -> Option<String> {
    let row = c
        .query_opt(
            &format!("SELECT active_pid FROM pg_replication_slots WHERE slot_name = '{SLOT}'"),
            &[],
        )
        .await
        .ok()??;
    row.try_get::<_, Option<i32>>(0)
        .ok()?
        .map(|p| p.to_string())
}

async fn drain_case(
    ctx: &Ctx,
    scenario: &str,
    run: u32,
    n: u64,
    size: usize,
    per_tx: u64,
) -> R<DrainRun> {
    let tag = format!("{scenario}_r{run}");
    let db = format!("bench_{tag}");
    eprintln!(
        "bench: [{tag}] {n} x {size} B, {per_tx} per transaction (load {})",
        loadavg()
    );
    let load_before = loadavg();
    let url = fresh_db(ctx, &db).await?;
    let c = pg(&url, &tag).await?;
    // The twin slot: right after pgoutbox's, before the backlog.
    sql(
        &c,
        &format!("[{tag}] create twin slot"),
        &format!("SELECT pg_create_logical_replication_slot('{TWIN}', 'pgoutput')"),
    )
    .await?;
    let exchange = format!("bench-{tag}");
    let queue = format!("bench-{tag}");
    declare_bound_queue(&ctx.ch, &exchange, &queue)
        .await
        .map_err(|e| format!("[{tag}] {e}"))?;

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
    eprintln!("bench: [{tag}] decode ceiling {decode:.0} msg/s; pgoutbox drain");

    let rpid = ctx.stack.rabbit_pid().map(|p| p.to_string());
    let r0 = rpid.as_deref().and_then(|p| cpu_secs(p, ctx.tck));
    let log = ctx.log_dir.join(format!("pgoutbox-{tag}.log"));
    let t0 = Instant::now();
    let mut streamer = Streamer::start(&ctx.stack, &url, &exchange, log)?;
    let limit = Duration::from_secs(120 + n / 2_000);
    let mut last = (0u64, Instant::now());
    let drain = loop {
        let depth = queue_depth(&ctx.ch, &queue)
            .await
            .map_err(|e| format!("[{tag}] {e}"))?;
        if depth >= n {
            break t0.elapsed();
        }
        streamer.check_alive(&format!("[{tag}] drain"))?;
        if depth != last.0 {
            last = (depth, Instant::now());
        }
        if t0.elapsed() > limit || last.1.elapsed() > Duration::from_secs(60) {
            let pid = streamer.pid;
            let tail = streamer.log_tail();
            let _ = streamer.stop().await;
            return Err(format!(
                "[{tag}] drain: queue {queue} holds {depth} of {n} after {:?} (no progress for \
                 {:?}); pgoutbox pid {pid} log:\n{tail}",
                t0.elapsed(),
                last.1.elapsed()
            ));
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let drain_s = secs(drain);
    let pid = streamer.pid.to_string();
    let cpu = cpu_secs(&pid, ctx.tck).ok_or(format!("[{tag}] read /proc/{pid}/stat"))?;
    let rss = vm_hwm_mb(streamer.pid).ok_or(format!("[{tag}] read /proc/{pid}/status"))?;
    let ws = match walsender_pid(&c).await {
        Some(p) => cpu_secs(&p, ctx.tck),
        None => None,
    };
    let r1 = rpid.as_deref().and_then(|p| cpu_secs(p, ctx.tck));
    let exit_status = streamer.stop().await;
    drop(c);
    let depth = queue_depth(&ctx.ch, &queue).await?;
    if depth != n {
        eprintln!("bench: WARNING: [{tag}] queue holds {depth} messages, expected exactly {n}");
    }
    delete_queue(&ctx.ch, &exchange, &queue)
        .await
        .map_err(|e| format!("[{tag}] {e}"))?;
    drop_db(ctx, &db)
        .await
        .map_err(|e| format!("[{tag}] {e}"))?;
    let rate = n as f64 / drain_s;
    eprintln!(
        "bench: [{tag}] pgoutbox {rate:.0} msg/s ({drain_s:.2} s), CPU {:.1} us/msg; broker ceiling",
        cpu * 1e6 / n as f64
    );

    let mut broker = Vec::new();
    for w in BROKER_WINDOWS {
        let b = broker_ceiling(&ctx.stack, &tag, n.min(BROKER_CAP), size, w, ctx.tck).await?;
        eprintln!("bench: [{tag}] broker W={w}: {:.0} msg/s", b.msgs_per_s);
        broker.push(b);
    }
    let best = broker
        .iter()
        .max_by(|a, b| a.msgs_per_s.total_cmp(&b.msgs_per_s))
        .cloned()
        .ok_or("no broker run")?;
    let (ceiling, ceiling_is) = if decode <= best.msgs_per_s {
        (decode, "decode")
    } else {
        (best.msgs_per_s, "broker")
    };
    Ok(DrainRun {
        scenario: scenario.to_string(),
        run,
        n,
        size,
        per_tx,
        emit_s,
        decode_s,
        decode_msgs_per_s: decode,
        drain_s,
        msgs_per_s: rate,
        mb_per_s: rate * size as f64 / 1e6,
        cpu_us_per_msg: cpu * 1e6 / n as f64,
        cpu_share_of_wall: cpu / drain_s,
        peak_rss_mb: rss,
        walsender_cpu_us_per_msg: ws.map(|s| s * 1e6 / n as f64),
        rabbit_cpu_us_per_msg: match (r0, r1) {
            (Some(a), Some(b)) => Some((b - a) * 1e6 / n as f64),
            _ => None,
        },
        window: PGOUTBOX_WINDOW,
        broker,
        broker_msgs_per_s: best.msgs_per_s,
        broker_best_window: best.window,
        ceiling_msgs_per_s: ceiling,
        ceiling_is: ceiling_is.to_string(),
        ratio: rate / ceiling,
        exit_status,
        load_before,
    })
}

// ---------------------------------------------------------------------------------------
// Steady-state latency

#[derive(Debug, Clone, Serialize)]
struct LatencyRun {
    target_msgs_per_s: f64,
    rate_source: String,
    duration_s: u64,
    producers: usize,
    producer_synchronous_commit: String,
    sent: u64,
    received: u64,
    achieved_msgs_per_s: f64,
    p50_ms: f64,
    p95_ms: f64,
    p99_ms: f64,
    max_ms: f64,
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

async fn latency_case(ctx: &Ctx, rate: f64, rate_source: &str, dur: u64) -> R<LatencyRun> {
    let tag = "s4";
    let db = "bench_s4";
    eprintln!("bench: [s4] steady state at {rate:.0} msg/s for {dur} s ({rate_source})");
    let url = fresh_db(ctx, db).await?;
    let exchange = "bench-s4";
    let queue = "bench-s4";
    declare_bound_queue(&ctx.ch, exchange, queue)
        .await
        .map_err(|e| format!("[{tag}] {e}"))?;
    let c = pg(&url, tag).await?;
    let log = ctx.log_dir.join("pgoutbox-s4.log");
    let mut streamer = Streamer::start(&ctx.stack, &url, exchange, log)?;
    // Wait until it holds the slot.
    let t0 = Instant::now();
    while walsender_pid(&c).await.is_none() {
        streamer.check_alive("[s4] start")?;
        if t0.elapsed() > Duration::from_secs(30) {
            let _ = streamer.stop().await;
            return Err("[s4] pgoutbox did not take the slot within 30 s".into());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    // Consumer.
    let cconn = amqp(ctx.stack.get("PGOUTBOX_AMQP_URL"), "[s4] consumer").await?;
    let cch = cconn
        .create_channel()
        .await
        .map_err(|e| format!("[s4] consumer channel: {e}"))?;
    cch.basic_qos(1000, BasicQosOptions::default())
        .await
        .map_err(|e| format!("[s4] basic_qos: {e}"))?;
    let mut consumer = cch
        .basic_consume(
            queue.into(),
            "bench".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .map_err(|e| format!("[s4] basic_consume: {e}"))?;
    let (done_tx, mut done_rx) = tokio::sync::watch::channel(u64::MAX);
    let consumer_task = tokio::spawn(async move {
        let mut lat: Vec<i64> = Vec::new();
        let mut since_ack = 0;
        loop {
            let target = *done_rx.borrow();
            if lat.len() as u64 >= target {
                break;
            }
            let next = tokio::select! {
                d = consumer.next() => d,
                _ = done_rx.changed() => continue,
                _ = tokio::time::sleep(Duration::from_secs(30)) => {
                    return Err(format!("[s4] consumer: nothing for 30 s after {} messages", lat.len()));
                }
            };
            let d = match next {
                Some(Ok(d)) => d,
                Some(Err(e)) => return Err(format!("[s4] consumer: {e}")),
                None => return Err("[s4] consumer stream ended".into()),
            };
            let recv = now_us();
            let commit = d
                .properties
                .headers()
                .as_ref()
                .and_then(|h| h.inner().get("x-pgoutbox-commit-time-us").cloned());
            match commit {
                Some(AMQPValue::LongLongInt(t)) => lat.push(recv - t),
                other => {
                    return Err(format!(
                        "[s4] consumer: bad x-pgoutbox-commit-time-us header {other:?}"
                    ))
                }
            }
            since_ack += 1;
            if since_ack >= 100 {
                d.acker
                    .ack(BasicAckOptions { multiple: true })
                    .await
                    .map_err(|e| format!("[s4] ack: {e}"))?;
                since_ack = 0;
            } else if lat.len() as u64 >= *done_rx.borrow() {
                d.acker
                    .ack(BasicAckOptions { multiple: true })
                    .await
                    .map_err(|e| format!("[s4] ack: {e}"))?;
            }
        }
        Ok(lat)
    });

    // Producers: one message per transaction, paced per millisecond.
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
    let end = start + Duration::from_secs(dur);
    let mut tasks = Vec::new();
    for _ in 0..LATENCY_PRODUCERS {
        let url = url.clone();
        tasks.push(tokio::spawn(async move {
            let c = pg(&url, "[s4] producer").await?;
            // The stack runs with synchronous_commit=off, where a commit reaches the
            // walsender only when the WAL writer flushes (wal_writer_delay, 200 ms): that
            // would measure the WAL writer, not pgoutbox. Producers commit synchronously.
            sql(
                &c,
                "[s4] producer",
                &format!("SET synchronous_commit = {PRODUCER_SYNC_COMMIT}"),
            )
            .await?;
            let st = c
                .prepare("SELECT outbox.emit_bytes($1::text, $2::bytea)::text")
                .await
                .map_err(|e| format!("[s4] prepare: {}", pg_err(&e)))?;
            let payload = vec![b'x'; 256];
            let topic = "bench.s4";
            let mut sent = 0u64;
            loop {
                let now = Instant::now();
                if now >= end {
                    break;
                }
                let due = (secs(now - start) * per) as u64;
                while sent < due {
                    c.query_one(&st, &[&topic, &payload])
                        .await
                        .map_err(|e| format!("[s4] emit: {}", pg_err(&e)))?;
                    sent += 1;
                }
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
            Ok::<u64, String>(sent)
        }));
    }
    let mut sent = 0;
    for t in tasks {
        sent += t.await.map_err(|e| format!("[s4] producer task: {e}"))??;
    }
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
    let lat = consumer_task
        .await
        .map_err(|e| format!("[s4] consumer task: {e}"))??;
    let pid = streamer.pid.to_string();
    let cpu = cpu_secs(&pid, ctx.tck).ok_or("[s4] read /proc stat")?;
    let rss = vm_hwm_mb(streamer.pid).ok_or("[s4] read /proc status")?;
    let exit_status = streamer.stop().await;
    let _ = cconn.close(200, "bench done".into()).await;
    drop(c);
    delete_queue(&ctx.ch, exchange, queue)
        .await
        .map_err(|e| format!("[s4] {e}"))?;
    drop_db(ctx, db).await.map_err(|e| format!("[s4] {e}"))?;
    let mut sorted = lat.clone();
    sorted.sort_unstable();
    Ok(LatencyRun {
        target_msgs_per_s: rate,
        rate_source: rate_source.to_string(),
        duration_s: dur,
        producers: LATENCY_PRODUCERS,
        producer_synchronous_commit: PRODUCER_SYNC_COMMIT.to_string(),
        sent,
        received: lat.len() as u64,
        achieved_msgs_per_s: sent as f64 / produce_s,
        p50_ms: pct(&sorted, 0.50),
        p95_ms: pct(&sorted, 0.95),
        p99_ms: pct(&sorted, 0.99),
        max_ms: sorted
            .last()
            .map(|v| *v as f64 / 1000.0)
            .unwrap_or(f64::NAN),
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
        "| scenario | N × size | pgoutbox msg/s | MB/s | decode ceiling msg/s | broker ceiling msg/s (best W) | ratio | pgoutbox CPU µs/msg | pgoutbox CPU / wall | peak RSS MB | window | walsender µs/msg | RabbitMQ µs/msg |\n\
         |---|---|---|---|---|---|---|---|---|---|---|---|---|\n",
    );
    let mut keys: Vec<(String, usize)> = Vec::new();
    for d in drains {
        let k = (d.scenario.clone(), d.size);
        if !keys.contains(&k) {
            keys.push(k);
        }
    }
    for (sc, size) in keys {
        let runs: Vec<&DrainRun> = drains
            .iter()
            .filter(|d| d.scenario == sc && d.size == size)
            .collect();
        let first = runs[0];
        let bw: Vec<String> = runs
            .iter()
            .map(|r| r.broker_best_window.to_string())
            .collect();
        let _ = writeln!(
            out,
            "| {sc} | {} × {} B ({}/tx) | {} | {} | {} | {} (W {}) | {} | {} | {} | {} | {} | {} | {} |",
            first.n,
            size,
            first.per_tx,
            fmt_mmm(runs.iter().map(|r| r.msgs_per_s).collect(), 0),
            fmt_mmm(runs.iter().map(|r| r.mb_per_s).collect(), 1),
            fmt_mmm(runs.iter().map(|r| r.decode_msgs_per_s).collect(), 0),
            fmt_mmm(runs.iter().map(|r| r.broker_msgs_per_s).collect(), 0),
            bw.join("/"),
            fmt_mmm(runs.iter().map(|r| r.ratio).collect(), 2),
            fmt_mmm(runs.iter().map(|r| r.cpu_us_per_msg).collect(), 1),
            fmt_mmm(runs.iter().map(|r| r.cpu_share_of_wall).collect(), 2),
            fmt_mmm(runs.iter().map(|r| r.peak_rss_mb).collect(), 1),
            first.window,
            opt_vals(&runs, |r| r.walsender_cpu_us_per_msg),
            opt_vals(&runs, |r| r.rabbit_cpu_us_per_msg),
        );
    }
    out
}

fn broker_table(drains: &[DrainRun]) -> String {
    let mut out = String::from(
        "| scenario | size | window | broker msg/s | bench client CPU µs/msg | RabbitMQ CPU µs/msg |\n|---|---|---|---|---|---|\n",
    );
    let mut keys: Vec<(String, usize, usize)> = Vec::new();
    for d in drains {
        for b in &d.broker {
            let k = (d.scenario.clone(), d.size, b.window);
            if !keys.contains(&k) {
                keys.push(k);
            }
        }
    }
    for (sc, size, w) in keys {
        let bs: Vec<&BrokerRun> = drains
            .iter()
            .filter(|d| d.scenario == sc && d.size == size)
            .flat_map(|d| d.broker.iter().filter(|b| b.window == w))
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
            "| {sc} | {size} B | {w} | {} | {} | {} |",
            f(&|b| Some(b.msgs_per_s), 0),
            f(&|b| b.client_cpu_us_per_msg, 1),
            f(&|b| b.rabbit_cpu_us_per_msg, 1),
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
    let stamp = sh("date", &["-u", "+%Y%m%dT%H%M%SZ"]);
    let dir = PathBuf::from(format!("/tmp/pgoutbox-bench-{}", std::process::id()));
    eprintln!("bench: starting the stack in {}", dir.display());
    let stack = Stack::start(&dir)?;
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
    let ctx = Ctx {
        stack,
        admin,
        amqp: amqp_conn,
        ch,
        tck,
        log_dir: log_dir.clone(),
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
    let mut drains: Vec<DrainRun> = Vec::new();
    let path = log_dir.join(format!("results-{stamp}.json"));
    // After every case: the table so far on stderr, the raw figures so far in the JSON file.
    let progress = |drains: &[DrainRun]| {
        eprintln!("bench: results so far:\n{}", table(drains));
        let partial = json!({"complete": false, "machine": machine, "drains": drains});
        if let Ok(text) = serde_json::to_string_pretty(&partial) {
            let _ = fs::write(&path, text);
        }
    };
    let has = |s: u32| args.scenarios.contains(&s);
    for run in 1..=args.runs {
        if has(1) {
            drains.push(drain_case(&ctx, "s1", run, sz.s1_n, 256, 1000).await?);
            progress(&drains);
        }
        if has(2) {
            drains.push(drain_case(&ctx, "s2", run, sz.s2_n, 256, 1).await?);
            progress(&drains);
        }
        if has(3) {
            for size in [64usize, 1024, 16 << 10, 256 << 10] {
                let n = (sz.s3_bytes / size as u64).max(sz.s3_min_count);
                let per_tx = ((1u64 << 20) / size as u64).clamp(1, 1000);
                let sc = format!("s3_{size}");
                drains.push(drain_case(&ctx, &sc, run, n, size, per_tx).await?);
                progress(&drains);
            }
        }
    }
    let mut latency = None;
    if has(4) {
        let s2: Vec<f64> = drains
            .iter()
            .filter(|d| d.scenario == "s2")
            .map(|d| d.msgs_per_s)
            .collect();
        let (rate, source) = if let Some(r) = args.s4_rate {
            (r, "fixed (--s4-rate)".to_string())
        } else if args.quick {
            (2000.0, "fixed (--quick)".to_string())
        } else if s2.is_empty() {
            (5000.0, "fixed 5000 (scenario 2 not run)".to_string())
        } else {
            let (m, _, _) = median_min_max(s2);
            (
                m / 2.0,
                format!("half the scenario-2 median ({m:.0} msg/s)"),
            )
        };
        latency = Some(latency_case(&ctx, rate, &source, sz.s4_secs).await?);
    }
    let total_s = secs(t_all.elapsed());

    // Report.
    let mut md = String::new();
    let _ = writeln!(
        md,
        "## pgoutbox benchmark ({} mode, {} run(s) of scenarios 1-3, {:.0} s)\n",
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
    let _ = writeln!(
        md,
        "Postgres runs with **{}** (deploy/stack.sh: no WAL durability; producers and decode are \
         faster than on a durable server). Messages persistent (delivery_mode 2), durable classic \
         queue bound with `#`, publisher confirms. Values: median [min–max] over runs. \
         ratio = pgoutbox ÷ min(decode, broker) per run. Broker ceiling: bare lapin publisher, \
         best of W={:?}, on min(N, {BROKER_CAP}) messages. Decode ceiling: pg_recvlogical on a \
         twin slot. CPU / wall: pgoutbox CPU seconds ÷ drain seconds (1.0 = one core busy).\n",
        pg_settings.join(", "),
        BROKER_WINDOWS
    );
    md.push_str(&table(&drains));
    md.push_str("\nBroker ceiling by window:\n\n");
    md.push_str(&broker_table(&drains));
    if let Some(l) = &latency {
        let _ = writeln!(
            md,
            "\nSteady-state latency (commit → consumer receive), {} producers \
             (synchronous_commit={}), one message per transaction, 256 B, target {:.0} msg/s ({}), achieved {:.0} msg/s for {} s, {} \
             messages:\n\n| p50 ms | p95 ms | p99 ms | max ms | pgoutbox CPU µs/msg | peak RSS MB | machine CPU busy | CPU µs/msg of Postgres / RabbitMQ / bench clients |\n\
             |---|---|---|---|---|---|---|---|\n| {:.2} | {:.2} | {:.2} | {:.2} | {:.1} | {:.1} | {:.0}% | {:.0} / {:.0} / {:.0} |",
            l.producers,
            l.producer_synchronous_commit,
            l.target_msgs_per_s,
            l.rate_source,
            l.achieved_msgs_per_s,
            l.duration_s,
            l.received,
            l.p50_ms,
            l.p95_ms,
            l.p99_ms,
            l.max_ms,
            l.cpu_us_per_msg,
            l.peak_rss_mb,
            l.machine_cpu_busy * 100.0,
            l.postgres_cpu_us_per_msg,
            l.rabbit_cpu_us_per_msg,
            l.bench_cpu_us_per_msg
        );
    }
    let bad: Vec<String> = drains
        .iter()
        .filter(|d| d.exit_status != "exit status: 0")
        .map(|d| format!("{} run {}: {}", d.scenario, d.run, d.exit_status))
        .collect();
    if !bad.is_empty() {
        let _ = writeln!(
            md,
            "\n**WARNING**: pgoutbox did not exit 0 on SIGTERM: {}",
            bad.join("; ")
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
        "drains": drains,
        "latency": latency,
        "markdown": md,
    });
    fs::write(
        &path,
        serde_json::to_string_pretty(&results).map_err(|e| format!("json: {e}"))?,
    )
    .map_err(|e| format!("write {}: {e}", path.display()))?;
    let _ = ctx.amqp.close(200, "bench done".into()).await;
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
