//! Metrics, health and readiness of `pgoutbox run`, and the small HTTP server that serves
//! them (`/metrics`, `/healthz`, `/readyz`).
//!
//! ```text
//!  driver ──phase (connecting, slot_busy, streaming, draining)──┐
//!  event loop ──once per turn: counters, gauges, heartbeat──────┼──▶ Telemetry (atomics)
//!  publisher ──connection.blocked / unblocked──────────────────┘        │
//!                                  HTTP task on the same runtime ◀──────┘ reads, encodes
//! ```
//!
//! The loop never takes a lock for a metric: it writes plain atomics once per turn (a turn
//! handles up to a batch of frames or of confirms), and derived values (ages, seconds since
//! the last status update, `stalled`) are computed when a scrape or a probe asks. Names are
//! the consts below, with Prometheus unit suffixes; the text exposition is the
//! `prometheus-client` crate's (OpenMetrics text).
//!
//! Probes: `/healthz` answers 200 while the process's loop is turning (the event loop beats
//! at least once per status interval, the driver while it connects or waits), 503 when no
//! beat came for [`HEALTH_STALE_AFTER`]: restart such a process (liveness). `/readyz`
//! answers 200 only while the replication stream is open, the broker connection is not
//! blocked and the stream is not stalled; otherwise 503 with `{"status":"not_ready",
//! "reason":...}` (readiness, alerting; a standby waiting for the slot reports `slot_busy`,
//! with `"role":"standby"` and the holder's `application_name` in `holder`).

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, AtomicU8, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use prometheus_client::encoding::{EncodeMetric, MetricEncoder};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::info::Info;
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::Registry;

/// Default `--http-addr`: loopback only (metrics are not for the world), port 8432. The
/// Prometheus project's registry of exporter ports, 9100-9999, is fully allocated (9187 is
/// postgres_exporter, 9419 rabbitmq_exporter), so any port there collides with some
/// exporter; 8432 lies outside it and outside the usual HTTP ports (8000, 8080, 8443).
pub const DEFAULT_HTTP_ADDR: &str = "127.0.0.1:8432";
/// `/healthz` turns 503 when the loop has not turned for this long. The event loop turns at
/// least once per status interval (at most 10 s) and the driver beats every second while it
/// connects or waits, so only a wedged loop (a blocked write, a busy loop) gets here.
pub const HEALTH_STALE_AFTER: Duration = Duration::from_secs(30);
/// How often the driver beats while it connects, backs off or waits for the slot.
pub const DRIVER_BEAT: Duration = Duration::from_secs(1);

/// Counter: publishes made, every attempt (first publishes, retries, re-sends after a
/// reconnect).
pub const MESSAGES_PUBLISHED_TOTAL: &str = "pgoutbox_messages_published_total";
/// Counter: messages confirmed by the broker as routed.
pub const MESSAGES_CONFIRMED_TOTAL: &str = "pgoutbox_messages_confirmed_total";
/// Counter: publishes nacked by the broker.
pub const MESSAGES_NACKED_TOTAL: &str = "pgoutbox_messages_nacked_total";
/// Counter: publishes returned as unroutable (312 NO_ROUTE).
pub const MESSAGES_RETURNED_TOTAL: &str = "pgoutbox_messages_returned_total";
/// Counter: messages written to `outbox.dead_letter`, label `reason` (`nacked`,
/// `returned`, `poison`, `too_large`, `forged`).
pub const MESSAGES_DEAD_LETTERED_TOTAL: &str = "pgoutbox_messages_dead_lettered_total";
/// Counter: publishes that were retries of a nacked or returned message.
pub const MESSAGES_RETRIED_TOTAL: &str = "pgoutbox_messages_retried_total";
/// Gauge: outbox messages read and not yet acknowledged to Postgres (the window's count).
pub const UNACKNOWLEDGED_MESSAGES: &str = "pgoutbox_unacknowledged_messages";
/// Gauge: payload bytes (logical message content) read and not yet acknowledged.
pub const UNACKNOWLEDGED_BYTES: &str = "pgoutbox_unacknowledged_bytes";
/// Gauge: messages not yet settled (neither confirmed as routed nor dead-lettered).
pub const UNCONFIRMED_MESSAGES: &str = "pgoutbox_unconfirmed_messages";
/// Gauge: the flush LSN last reported to Postgres, as a number (bytes since 0/0).
pub const FLUSH_LSN_BYTES: &str = "pgoutbox_flush_lsn_bytes";
/// Gauge: the newest WAL position received (commit ends, keepalive ends), as a number.
pub const RECEIVED_LSN_BYTES: &str = "pgoutbox_received_lsn_bytes";
/// Gauge: the server's end of WAL as last reported by the walsender, as a number.
pub const SERVER_WAL_END_BYTES: &str = "pgoutbox_server_wal_end_bytes";
/// Gauge: replication lag, the server's WAL end minus the flush LSN reported, in bytes.
pub const REPLICATION_LAG_BYTES: &str = "pgoutbox_replication_lag_bytes";
/// Gauge: age of the oldest published and unconfirmed message, from its commit time
/// (server clock) to now, in seconds; 0 when none.
pub const OLDEST_UNCONFIRMED_AGE_SECONDS: &str = "pgoutbox_oldest_unconfirmed_age_seconds";
/// Histogram: commit-to-confirm latency (commit time, server clock, to the broker's
/// confirm as routed), in seconds.
pub const CONFIRM_LATENCY_SECONDS: &str = "pgoutbox_confirm_latency_seconds";
/// Counter: sessions ended by a retryable failure, label `cause` (`broker`, `postgres`,
/// `slot_busy`: one per standby poll that found the slot held by another process).
pub const RECONNECTS_TOTAL: &str = "pgoutbox_reconnects_total";
/// Counter: rows written to `outbox.journal` (`run --journal`).
pub const JOURNAL_ROWS_WRITTEN_TOTAL: &str = "pgoutbox_journal_rows_written_total";
/// Counter: journal rows dropped, label `reason` (`buffer_full`: more confirms in one
/// interval than the buffer holds; `write_failed`: the batch's INSERT failed).
pub const JOURNAL_ROWS_DROPPED_TOTAL: &str = "pgoutbox_journal_rows_dropped_total";
/// Counter: rows deleted by `run`'s retention task, label `table` (`idempotency`,
/// `journal`).
pub const RETENTION_ROWS_DELETED_TOTAL: &str = "pgoutbox_retention_rows_deleted_total";
/// Counter: sessions that started streaming.
pub const SESSIONS_STARTED_TOTAL: &str = "pgoutbox_sessions_started_total";
/// Gauge: seconds since the last standby status update was sent (0 before the first).
pub const SINCE_STATUS_UPDATE_SECONDS: &str = "pgoutbox_since_status_update_seconds";
/// Gauge: 1 while messages are unconfirmed and none was settled for `--stall-after-s`.
pub const STALLED: &str = "pgoutbox_stalled";
/// Gauge: 1 while RabbitMQ blocks the connection (`connection.blocked`: memory or disk
/// alarm).
pub const BROKER_BLOCKED: &str = "pgoutbox_broker_blocked";
/// Gauge: this process's role on the slot, label `role` (`active`: it streams from the
/// slot; `standby`: another process holds the slot and this one waits to take over); 1 for
/// the current role, 0 for the other, both 0 while connecting or reconnecting.
pub const ROLE: &str = "pgoutbox_role";
/// Info: `version` label with the crate version.
pub const BUILD_INFO: &str = "pgoutbox_build_info";

/// Upper bounds of the confirm-latency buckets, in seconds.
const LATENCY_BOUNDS: [f64; 14] = [
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 60.0,
];

/// What the driver is doing, for `/readyz`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Phase {
    /// Connecting to Postgres or RabbitMQ, or backing off between sessions.
    Connecting = 0,
    /// Another process holds the slot; standing by.
    SlotBusy = 1,
    /// The replication stream and the broker channel are open.
    Streaming = 2,
    /// Shutdown requested: draining confirms.
    Draining = 3,
    /// The replication connection broke: collecting confirms before reconnecting.
    ReplicationLost = 4,
}

impl Phase {
    fn from_u8(v: u8) -> Phase {
        match v {
            1 => Phase::SlotBusy,
            2 => Phase::Streaming,
            3 => Phase::Draining,
            4 => Phase::ReplicationLost,
            _ => Phase::Connecting,
        }
    }

    /// The readiness reason for this phase (`None`: streaming).
    fn reason(self) -> Option<&'static str> {
        match self {
            Phase::Connecting => Some("connecting"),
            Phase::SlotBusy => Some("slot_busy"),
            Phase::Streaming => None,
            Phase::Draining => Some("draining"),
            Phase::ReplicationLost => Some("replication_lost"),
        }
    }
}

/// This process's role on the slot, for the log, `/readyz` and [`ROLE`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Role {
    /// Neither: connecting, reconnecting, or stopped.
    None = 0,
    /// Streaming from the slot.
    Active = 1,
    /// Another process holds the slot; waiting to take over.
    Standby = 2,
}

impl Role {
    fn from_u8(v: u8) -> Role {
        match v {
            1 => Role::Active,
            2 => Role::Standby,
            _ => Role::None,
        }
    }

    /// `none`, `active` or `standby`.
    pub fn as_str(self) -> &'static str {
        match self {
            Role::None => "none",
            Role::Active => "active",
            Role::Standby => "standby",
        }
    }
}

/// Why a process is not ready, or that it is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Readiness {
    /// Streaming, broker not blocked, not stalled.
    Ready,
    /// Not ready, with the reason (`connecting`, `slot_busy`, `broker_disconnected`,
    /// `broker_blocked`, `stalled`, `draining`, `replication_lost`).
    NotReady(&'static str),
}

/// A commit-to-confirm histogram with atomic buckets (the crate's own histogram takes a
/// mutex per observation); encoded through `prometheus-client`'s histogram encoder. Clones
/// share the buckets.
#[derive(Debug, Default, Clone)]
pub struct ConfirmLatency {
    inner: Arc<LatencyBuckets>,
}

#[derive(Debug, Default)]
struct LatencyBuckets {
    /// Non-cumulative counts per bound in [`LATENCY_BOUNDS`], then +Inf.
    buckets: [AtomicU64; LATENCY_BOUNDS.len() + 1],
    sum_us: AtomicU64,
}

/// Latencies gathered during one loop turn, added to [`ConfirmLatency`] at once.
#[derive(Debug, Default, Clone)]
pub struct LatencyBatch {
    buckets: [u64; LATENCY_BOUNDS.len() + 1],
    sum_us: u64,
    count: u64,
}

impl LatencyBatch {
    /// Records one latency in microseconds (negative: clock skew, counted as 0).
    pub fn observe_us(&mut self, us: i64) {
        let us = us.max(0) as u64;
        let secs = us as f64 / 1e6;
        let i = LATENCY_BOUNDS
            .iter()
            .position(|b| secs <= *b)
            .unwrap_or(LATENCY_BOUNDS.len());
        self.buckets[i] += 1;
        self.sum_us += us;
        self.count += 1;
    }
}

impl ConfirmLatency {
    /// Adds a batch and clears it.
    pub fn add(&self, batch: &mut LatencyBatch) {
        if batch.count == 0 {
            return;
        }
        let inner = &self.inner;
        for (b, n) in inner.buckets.iter().zip(batch.buckets) {
            if n > 0 {
                b.fetch_add(n, Ordering::Relaxed);
            }
        }
        inner.sum_us.fetch_add(batch.sum_us, Ordering::Relaxed);
        *batch = LatencyBatch::default();
    }
}

impl EncodeMetric for ConfirmLatency {
    fn encode(&self, mut encoder: MetricEncoder) -> Result<(), std::fmt::Error> {
        let buckets: Vec<(f64, u64)> = LATENCY_BOUNDS
            .iter()
            .copied()
            .chain(std::iter::once(f64::MAX))
            .zip(self.inner.buckets.iter().map(|b| b.load(Ordering::Relaxed)))
            .collect();
        let count = buckets.iter().map(|(_, n)| n).sum();
        let sum = self.inner.sum_us.load(Ordering::Relaxed) as f64 / 1e6;
        encoder
            .encode_histogram::<prometheus_client::encoding::NoLabelSet>(sum, count, &buckets, None)
    }

    fn metric_type(&self) -> MetricType {
        MetricType::Histogram
    }
}

/// What the event loop reports once per turn (process-wide totals and current values).
#[derive(Debug, Clone, Copy, Default)]
pub struct Turn {
    /// Publishes made so far (every attempt).
    pub published: u64,
    /// Retries so far.
    pub retried: u64,
    /// Messages confirmed as routed so far.
    pub confirmed: u64,
    /// Messages not yet acknowledged (the watermark's backlog).
    pub unacknowledged_messages: u64,
    /// Payload bytes not yet acknowledged.
    pub unacknowledged_bytes: u64,
    /// Messages not settled.
    pub unconfirmed: u64,
    /// The flush LSN last reported, as a number.
    pub flush_lsn: u64,
    /// The newest WAL position received, as a number.
    pub received_lsn: u64,
    /// The server's WAL end, as a number.
    pub server_wal_end: u64,
    /// Commit time of the oldest published, unconfirmed message, µs since the Unix epoch
    /// (`None`: nothing in flight).
    pub oldest_commit_time_us: Option<i64>,
}

/// Metrics and probe state shared by the driver, the event loop, the publisher's event
/// watcher and the HTTP task. Every field the loop writes is an atomic.
#[derive(Debug)]
pub struct Telemetry {
    registry: Registry,
    base: Instant,
    stall_after: Duration,
    published: Counter,
    confirmed: Counter,
    nacked: Counter,
    returned: Counter,
    retried: Counter,
    dead_lettered: Family<[(&'static str, &'static str); 1], Counter>,
    reconnects: Family<[(&'static str, &'static str); 1], Counter>,
    sessions: Counter,
    journal_written: Counter,
    journal_dropped: Family<[(&'static str, &'static str); 1], Counter>,
    retention_deleted: Family<[(&'static str, &'static str); 1], Counter>,
    unacknowledged_messages: Gauge,
    unacknowledged_bytes: Gauge,
    unconfirmed: Gauge,
    flush_lsn: Gauge,
    received_lsn: Gauge,
    server_wal_end: Gauge,
    lag: Gauge,
    oldest_age: Gauge<f64, AtomicU64>,
    since_status: Gauge<f64, AtomicU64>,
    stalled: Gauge,
    blocked_gauge: Gauge,
    role_gauge: Family<[(&'static str, &'static str); 1], Gauge>,
    role: AtomicU8,
    /// The slot holder's `application_name` while this process stands by (written on a
    /// role change only, never by the event loop).
    holder: std::sync::Mutex<Option<String>>,
    latency: ConfirmLatency,
    /// Commit time of the oldest unconfirmed message, µs since the Unix epoch; 0: none.
    oldest_commit_time_us: AtomicI64,
    /// Milliseconds since `base` of the last beat.
    heartbeat_ms: AtomicU64,
    /// Milliseconds since `base` of the last status update; `u64::MAX`: none yet.
    status_at_ms: AtomicU64,
    /// Milliseconds since `base` when the stall clock last restarted (a settle, or
    /// messages became unconfirmed with none before).
    progress_at_ms: AtomicU64,
    phase: AtomicU8,
    broker_blocked: Arc<AtomicBool>,
    broker_lost: Arc<AtomicBool>,
}

/// Milliseconds since `base`, saturating.
fn ms_since(base: Instant, at: Instant) -> u64 {
    u64::try_from(at.saturating_duration_since(base).as_millis()).unwrap_or(u64::MAX)
}

/// The wall clock in microseconds since the Unix epoch.
pub fn unix_now_us() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| i64::try_from(d.as_micros()).unwrap_or(i64::MAX))
        .unwrap_or(0)
}

/// Registers under the name without the suffix the encoder appends (`_total`, `_info`).
fn base_name<'a>(name: &'a str, suffix: &str) -> &'a str {
    name.strip_suffix(suffix).unwrap_or(name)
}

fn as_gauge(v: u64) -> i64 {
    i64::try_from(v).unwrap_or(i64::MAX)
}

impl Telemetry {
    /// Registers every metric; `stall_after` is `--stall-after-s`.
    pub fn new(stall_after: Duration) -> Arc<Telemetry> {
        let mut registry = Registry::default();
        let t = Telemetry {
            registry: Registry::default(),
            base: Instant::now(),
            stall_after,
            published: Counter::default(),
            confirmed: Counter::default(),
            nacked: Counter::default(),
            returned: Counter::default(),
            retried: Counter::default(),
            dead_lettered: Family::default(),
            reconnects: Family::default(),
            sessions: Counter::default(),
            journal_written: Counter::default(),
            journal_dropped: Family::default(),
            retention_deleted: Family::default(),
            unacknowledged_messages: Gauge::default(),
            unacknowledged_bytes: Gauge::default(),
            unconfirmed: Gauge::default(),
            flush_lsn: Gauge::default(),
            received_lsn: Gauge::default(),
            server_wal_end: Gauge::default(),
            lag: Gauge::default(),
            oldest_age: Gauge::default(),
            since_status: Gauge::default(),
            stalled: Gauge::default(),
            blocked_gauge: Gauge::default(),
            role_gauge: Family::default(),
            role: AtomicU8::new(Role::None as u8),
            holder: std::sync::Mutex::new(None),
            latency: ConfirmLatency::default(),
            oldest_commit_time_us: AtomicI64::new(0),
            heartbeat_ms: AtomicU64::new(0),
            status_at_ms: AtomicU64::new(u64::MAX),
            progress_at_ms: AtomicU64::new(0),
            phase: AtomicU8::new(Phase::Connecting as u8),
            broker_blocked: Arc::new(AtomicBool::new(false)),
            broker_lost: Arc::new(AtomicBool::new(false)),
        };
        let total = |n| base_name(n, "_total");
        registry.register(
            total(MESSAGES_PUBLISHED_TOTAL),
            "Publishes made (every attempt: first publishes, retries, re-sends after a reconnect)",
            t.published.clone(),
        );
        registry.register(
            total(MESSAGES_CONFIRMED_TOTAL),
            "Messages confirmed by the broker as routed",
            t.confirmed.clone(),
        );
        registry.register(
            total(MESSAGES_NACKED_TOTAL),
            "Publishes nacked by the broker",
            t.nacked.clone(),
        );
        registry.register(
            total(MESSAGES_RETURNED_TOTAL),
            "Publishes returned as unroutable",
            t.returned.clone(),
        );
        registry.register(
            total(MESSAGES_DEAD_LETTERED_TOTAL),
            "Messages written to outbox.dead_letter, by reason",
            t.dead_lettered.clone(),
        );
        registry.register(
            total(MESSAGES_RETRIED_TOTAL),
            "Publishes that retried a nacked or returned message",
            t.retried.clone(),
        );
        registry.register(
            UNACKNOWLEDGED_MESSAGES,
            "Outbox messages read and not yet acknowledged to Postgres",
            t.unacknowledged_messages.clone(),
        );
        registry.register(
            UNACKNOWLEDGED_BYTES,
            "Payload bytes read and not yet acknowledged to Postgres",
            t.unacknowledged_bytes.clone(),
        );
        registry.register(
            UNCONFIRMED_MESSAGES,
            "Messages neither confirmed as routed nor dead-lettered",
            t.unconfirmed.clone(),
        );
        registry.register(
            FLUSH_LSN_BYTES,
            "Flush LSN last reported to Postgres, as a number",
            t.flush_lsn.clone(),
        );
        registry.register(
            RECEIVED_LSN_BYTES,
            "Newest WAL position received, as a number",
            t.received_lsn.clone(),
        );
        registry.register(
            SERVER_WAL_END_BYTES,
            "Server end of WAL as last reported by the walsender, as a number",
            t.server_wal_end.clone(),
        );
        registry.register(
            REPLICATION_LAG_BYTES,
            "Server WAL end minus the flush LSN reported, in bytes",
            t.lag.clone(),
        );
        registry.register(
            OLDEST_UNCONFIRMED_AGE_SECONDS,
            "Age of the oldest unconfirmed message since its commit, in seconds (0 when none)",
            t.oldest_age.clone(),
        );
        registry.register(
            CONFIRM_LATENCY_SECONDS,
            "Commit-to-confirm latency, in seconds",
            t.latency.clone(),
        );
        registry.register(
            total(RECONNECTS_TOTAL),
            "Sessions ended by a retryable failure, by cause",
            t.reconnects.clone(),
        );
        registry.register(
            total(SESSIONS_STARTED_TOTAL),
            "Sessions that started streaming",
            t.sessions.clone(),
        );
        registry.register(
            total(JOURNAL_ROWS_WRITTEN_TOTAL),
            "Rows written to outbox.journal (run --journal)",
            t.journal_written.clone(),
        );
        for reason in ["buffer_full", "write_failed"] {
            let _ = t.journal_dropped.get_or_create(&[("reason", reason)]);
        }
        registry.register(
            total(JOURNAL_ROWS_DROPPED_TOTAL),
            "Journal rows dropped (never written), by reason",
            t.journal_dropped.clone(),
        );
        registry.register(
            total(RETENTION_ROWS_DELETED_TOTAL),
            "Rows deleted by the retention task, by table",
            t.retention_deleted.clone(),
        );
        registry.register(
            SINCE_STATUS_UPDATE_SECONDS,
            "Seconds since the last standby status update",
            t.since_status.clone(),
        );
        registry.register(
            STALLED,
            "1 while messages are unconfirmed and none settled for --stall-after-s",
            t.stalled.clone(),
        );
        registry.register(
            BROKER_BLOCKED,
            "1 while RabbitMQ blocks the connection (memory or disk alarm)",
            t.blocked_gauge.clone(),
        );
        for role in [Role::Active, Role::Standby] {
            let _ = t.role_gauge.get_or_create(&[("role", role.as_str())]);
        }
        registry.register(
            ROLE,
            "1 for this process's role on the slot (active streams, standby waits to take over)",
            t.role_gauge.clone(),
        );
        registry.register(
            base_name(BUILD_INFO, "_info"),
            "Build information",
            Info::new([("version", env!("CARGO_PKG_VERSION"))]),
        );
        Arc::new(Telemetry { registry, ..t })
    }

    fn now_ms(&self) -> u64 {
        ms_since(self.base, Instant::now())
    }

    /// A beat: the loop (or the driver) is turning.
    pub fn beat(&self) {
        self.heartbeat_ms.store(self.now_ms(), Ordering::Relaxed);
    }

    /// The driver's phase changed.
    pub fn set_phase(&self, phase: Phase) {
        self.phase.store(phase as u8, Ordering::Relaxed);
        self.beat();
    }

    /// Sets the role (and, for a standby, the holder's `application_name`); returns
    /// whether either changed, so the caller logs every change once.
    pub fn set_role(&self, role: Role, holder: Option<&str>) -> bool {
        let holder = holder.filter(|_| role == Role::Standby).map(str::to_owned);
        let before = Role::from_u8(self.role.swap(role as u8, Ordering::Relaxed));
        let mut slot = self.holder.lock().unwrap_or_else(|e| e.into_inner());
        let changed = before != role || *slot != holder;
        *slot = holder;
        for r in [Role::Active, Role::Standby] {
            self.role_gauge
                .get_or_create(&[("role", r.as_str())])
                .set(i64::from(r == role));
        }
        changed
    }

    /// The current role.
    pub fn role(&self) -> Role {
        Role::from_u8(self.role.load(Ordering::Relaxed))
    }

    /// The slot holder's `application_name` while standing by.
    pub fn holder(&self) -> Option<String> {
        self.holder
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// The current phase.
    pub fn phase(&self) -> Phase {
        Phase::from_u8(self.phase.load(Ordering::Relaxed))
    }

    /// The flag the publisher's event watcher sets while RabbitMQ blocks the connection.
    pub fn broker_blocked_flag(&self) -> Arc<AtomicBool> {
        Arc::clone(&self.broker_blocked)
    }

    /// The flag the publisher's event watcher sets when the broker connection or channel
    /// fails.
    pub fn broker_lost_flag(&self) -> Arc<AtomicBool> {
        Arc::clone(&self.broker_lost)
    }

    /// A session started streaming.
    pub fn session_started(&self) {
        self.sessions.inc();
        self.broker_blocked.store(false, Ordering::Relaxed);
        self.broker_lost.store(false, Ordering::Relaxed);
        self.set_phase(Phase::Streaming);
    }

    /// A session ended with a retryable failure of `cause` (`broker`, `postgres`,
    /// `slot_busy`).
    pub fn reconnect(&self, cause: &'static str) {
        self.reconnects.get_or_create(&[("cause", cause)]).inc();
    }

    /// `rows` journal rows were written.
    pub fn journal_written(&self, rows: u64) {
        self.journal_written.inc_by(rows);
    }

    /// `rows` journal rows were dropped for `reason` (`buffer_full`, `write_failed`).
    pub fn journal_dropped(&self, reason: &'static str, rows: u64) {
        self.journal_dropped
            .get_or_create(&[("reason", reason)])
            .inc_by(rows);
    }

    /// The retention task deleted `rows` rows of `table` (`idempotency`, `journal`).
    pub fn retention_deleted(&self, table: &'static str, rows: u64) {
        self.retention_deleted
            .get_or_create(&[("table", table)])
            .inc_by(rows);
    }

    /// A publish was nacked.
    pub fn nacked(&self) {
        self.nacked.inc();
    }

    /// A publish was returned.
    pub fn returned(&self) {
        self.returned.inc();
    }

    /// A message was dead-lettered for `reason`.
    pub fn dead_lettered(&self, reason: &'static str) {
        self.dead_lettered
            .get_or_create(&[("reason", reason)])
            .inc();
    }

    /// A standby status update was sent.
    pub fn status_sent(&self) {
        self.status_at_ms.store(self.now_ms(), Ordering::Relaxed);
    }

    /// The stall clock restarts now (a settle, or the first unconfirmed message).
    pub fn progress_at(&self, at: Instant) {
        self.progress_at_ms
            .store(ms_since(self.base, at), Ordering::Relaxed);
    }

    /// The loop's report for one turn: counters move to the totals, gauges take the values,
    /// the latency batch is added (and cleared), and the loop beats.
    pub fn turn(&self, turn: &Turn, latency: &mut LatencyBatch) {
        fn sync(c: &Counter, total: u64) {
            let cur = c.get();
            if total > cur {
                c.inc_by(total - cur);
            }
        }
        sync(&self.published, turn.published);
        sync(&self.retried, turn.retried);
        sync(&self.confirmed, turn.confirmed);
        self.unacknowledged_messages
            .set(as_gauge(turn.unacknowledged_messages));
        self.unacknowledged_bytes
            .set(as_gauge(turn.unacknowledged_bytes));
        self.unconfirmed.set(as_gauge(turn.unconfirmed));
        self.flush_lsn.set(as_gauge(turn.flush_lsn));
        self.received_lsn.set(as_gauge(turn.received_lsn));
        self.server_wal_end.set(as_gauge(turn.server_wal_end));
        self.lag
            .set(as_gauge(turn.server_wal_end.saturating_sub(turn.flush_lsn)));
        self.oldest_commit_time_us
            .store(turn.oldest_commit_time_us.unwrap_or(0), Ordering::Relaxed);
        self.latency.add(latency);
        self.beat();
    }

    /// Whether the stream is stalled at `now`: unconfirmed messages and no settle for
    /// `--stall-after-s`.
    pub fn is_stalled(&self) -> bool {
        self.unconfirmed.get() > 0
            && self
                .now_ms()
                .saturating_sub(self.progress_at_ms.load(Ordering::Relaxed))
                >= u64::try_from(self.stall_after.as_millis()).unwrap_or(u64::MAX)
    }

    /// Whether RabbitMQ blocks the connection.
    pub fn is_broker_blocked(&self) -> bool {
        self.broker_blocked.load(Ordering::Relaxed)
    }

    /// Time since the last beat.
    pub fn since_beat(&self) -> Duration {
        Duration::from_millis(
            self.now_ms()
                .saturating_sub(self.heartbeat_ms.load(Ordering::Relaxed)),
        )
    }

    /// Liveness: the loop beat within [`HEALTH_STALE_AFTER`].
    pub fn is_healthy(&self) -> bool {
        self.since_beat() < HEALTH_STALE_AFTER
    }

    /// Readiness, with the reason when not ready.
    pub fn readiness(&self) -> Readiness {
        if let Some(reason) = self.phase().reason() {
            return Readiness::NotReady(reason);
        }
        if self.broker_lost.load(Ordering::Relaxed) {
            return Readiness::NotReady("broker_disconnected");
        }
        if self.is_broker_blocked() {
            return Readiness::NotReady("broker_blocked");
        }
        if self.is_stalled() {
            return Readiness::NotReady("stalled");
        }
        Readiness::Ready
    }

    /// Age of the oldest unconfirmed message in seconds (0 when none).
    pub fn oldest_unconfirmed_age(&self) -> f64 {
        match self.oldest_commit_time_us.load(Ordering::Relaxed) {
            0 => 0.0,
            at => (unix_now_us().saturating_sub(at)).max(0) as f64 / 1e6,
        }
    }

    /// The text exposition (OpenMetrics), derived gauges computed now.
    pub fn encode(&self) -> String {
        self.oldest_age.set(self.oldest_unconfirmed_age());
        let since = match self.status_at_ms.load(Ordering::Relaxed) {
            u64::MAX => 0.0,
            at => self.now_ms().saturating_sub(at) as f64 / 1e3,
        };
        self.since_status.set(since);
        self.stalled.set(i64::from(self.is_stalled()));
        self.blocked_gauge.set(i64::from(self.is_broker_blocked()));
        let mut text = String::new();
        if prometheus_client::encoding::text::encode(&mut text, &self.registry).is_err() {
            text.clear();
        }
        text
    }
}

/// Binds `addr` and serves `/metrics`, `/healthz` and `/readyz` on the current runtime
/// until the returned task is aborted.
///
/// # Errors
/// The bind error (address in use, not permitted).
pub async fn serve(
    addr: SocketAddr,
    telemetry: Arc<Telemetry>,
) -> std::io::Result<tokio::task::JoinHandle<()>> {
    use axum::routing::get;
    let listener = tokio::net::TcpListener::bind(addr).await?;
    let addr = listener.local_addr().unwrap_or(addr);
    let app = axum::Router::new()
        .route("/metrics", get(metrics_handler))
        .route("/healthz", get(healthz_handler))
        .route("/readyz", get(readyz_handler))
        .with_state(telemetry);
    tracing::info!(http_addr = %addr, "serving /metrics, /healthz and /readyz");
    Ok(tokio::spawn(async move {
        if let Err(error) = axum::serve(listener, app).await {
            tracing::warn!(error = %error, "the metrics HTTP server stopped");
        }
    }))
}

type Shared = axum::extract::State<Arc<Telemetry>>;

async fn metrics_handler(axum::extract::State(t): Shared) -> impl axum::response::IntoResponse {
    (
        [(
            axum::http::header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        t.encode(),
    )
}

fn json_response(
    ok: bool,
    body: serde_json::Value,
) -> (
    axum::http::StatusCode,
    [(axum::http::HeaderName, &'static str); 1],
    String,
) {
    let status = if ok {
        axum::http::StatusCode::OK
    } else {
        axum::http::StatusCode::SERVICE_UNAVAILABLE
    };
    (
        status,
        [(axum::http::header::CONTENT_TYPE, "application/json")],
        body.to_string(),
    )
}

async fn healthz_handler(axum::extract::State(t): Shared) -> impl axum::response::IntoResponse {
    let since = t.since_beat();
    let ok = t.is_healthy();
    json_response(
        ok,
        serde_json::json!({
            "status": if ok { "ok" } else { "unhealthy" },
            "reason": if ok { serde_json::Value::Null } else { "loop_not_turning".into() },
            "since_last_turn_ms": since.as_millis() as u64,
        }),
    )
}

async fn readyz_handler(axum::extract::State(t): Shared) -> impl axum::response::IntoResponse {
    match t.readiness() {
        Readiness::Ready => json_response(true, serde_json::json!({ "status": "ready" })),
        Readiness::NotReady(reason) => json_response(
            false,
            serde_json::json!({
                "status": "not_ready",
                "reason": reason,
                "role": t.role().as_str(),
                "holder": t.holder(),
                "unconfirmed": t.unconfirmed.get(),
                "oldest_unconfirmed_age_s": t.oldest_unconfirmed_age(),
            }),
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exposes_every_name_through_the_crate() {
        let t = Telemetry::new(Duration::from_secs(60));
        t.dead_lettered("poison");
        t.reconnect("broker");
        let mut batch = LatencyBatch::default();
        batch.observe_us(3_000);
        batch.observe_us(2_000_000);
        t.turn(
            &Turn {
                published: 5,
                confirmed: 4,
                server_wal_end: 1000,
                flush_lsn: 400,
                ..Turn::default()
            },
            &mut batch,
        );
        assert_eq!(batch.count, 0, "the batch is cleared");
        let text = t.encode();
        for name in [
            MESSAGES_PUBLISHED_TOTAL,
            MESSAGES_CONFIRMED_TOTAL,
            MESSAGES_NACKED_TOTAL,
            MESSAGES_RETURNED_TOTAL,
            MESSAGES_DEAD_LETTERED_TOTAL,
            MESSAGES_RETRIED_TOTAL,
            UNACKNOWLEDGED_MESSAGES,
            UNACKNOWLEDGED_BYTES,
            UNCONFIRMED_MESSAGES,
            FLUSH_LSN_BYTES,
            RECEIVED_LSN_BYTES,
            SERVER_WAL_END_BYTES,
            REPLICATION_LAG_BYTES,
            OLDEST_UNCONFIRMED_AGE_SECONDS,
            RECONNECTS_TOTAL,
            SESSIONS_STARTED_TOTAL,
            SINCE_STATUS_UPDATE_SECONDS,
            STALLED,
            BROKER_BLOCKED,
            ROLE,
            BUILD_INFO,
        ] {
            assert!(
                text.lines().any(|l| l.starts_with(name)),
                "{name} missing:\n{text}"
            );
        }
        assert!(
            text.contains("pgoutbox_messages_published_total 5"),
            "{text}"
        );
        assert!(
            text.contains("pgoutbox_replication_lag_bytes 600"),
            "{text}"
        );
        assert!(
            text.contains("pgoutbox_confirm_latency_seconds_count 2"),
            "{text}"
        );
        assert!(
            text.contains("pgoutbox_confirm_latency_seconds_bucket{le=\"0.005\"} 1"),
            "{text}"
        );
        assert!(
            text.contains("pgoutbox_messages_dead_lettered_total{reason=\"poison\"} 1"),
            "{text}"
        );
        assert!(text.contains("version=\""), "{text}");
        assert!(text.contains("pgoutbox_role{role=\"active\"} 0"), "{text}");
        assert!(t.set_role(Role::Standby, Some("pgoutbox-a")));
        assert!(!t.set_role(Role::Standby, Some("pgoutbox-a")), "no change");
        assert!(
            t.set_role(Role::Standby, Some("pgoutbox-b")),
            "a new holder"
        );
        assert_eq!(t.holder().as_deref(), Some("pgoutbox-b"));
        let text = t.encode();
        assert!(text.contains("pgoutbox_role{role=\"standby\"} 1"), "{text}");
        assert!(text.contains("pgoutbox_role{role=\"active\"} 0"), "{text}");
        assert!(t.set_role(Role::Active, Some("ignored")));
        assert_eq!(t.holder(), None);
        assert!(t.encode().contains("pgoutbox_role{role=\"active\"} 1"));
    }

    #[test]
    fn readiness_names_the_reason() {
        let t = Telemetry::new(Duration::from_millis(0));
        assert_eq!(t.readiness(), Readiness::NotReady("connecting"));
        t.session_started();
        assert_eq!(t.readiness(), Readiness::Ready);
        t.turn(
            &Turn {
                unconfirmed: 1,
                ..Turn::default()
            },
            &mut LatencyBatch::default(),
        );
        assert_eq!(t.readiness(), Readiness::NotReady("stalled"));
        t.broker_blocked_flag().store(true, Ordering::Relaxed);
        assert_eq!(t.readiness(), Readiness::NotReady("broker_blocked"));
        t.broker_lost_flag().store(true, Ordering::Relaxed);
        assert_eq!(t.readiness(), Readiness::NotReady("broker_disconnected"));
        t.set_phase(Phase::Draining);
        assert_eq!(t.readiness(), Readiness::NotReady("draining"));
        assert!(t.is_healthy());
    }
}
