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
//!
//! The parts, by concept: [`counters`] (`*_total`), [`gauges`] (current values, and the
//! ones derived at scrape time), [`latency`] (the confirm histogram), [`probe`] (phase,
//! role, heartbeat, stall clock: what the probes answer from), and [`http`] (the endpoint
//! that serves them, the one part that does I/O).

use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use prometheus_client::metrics::info::Info;
use prometheus_client::registry::Registry;

pub mod catalog;
pub mod counters;
pub mod gauges;
pub mod http;
pub mod latency;
pub mod partitions;
pub mod probe;
pub mod residence;

pub use counters::Counters;
pub use gauges::Gauges;
pub use latency::{ConfirmLatency, LatencyBatch};
pub use partitions::{
    PartTurn, Partitions, PARTITION_BLOCKED, PARTITION_CONNECTED, PARTITION_PUBLISHED_TOTAL,
    PARTITION_UNSETTLED_MESSAGES,
};
pub use probe::{Phase, Probe, Readiness, Role};
pub use residence::Residence;

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

/// Counter: messages written to `outbox.dead_letter`, label `reason` (one of
/// [`crate::contract::dead_letter_reason::ALL`]).
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

/// Histogram: pgoutbox's own residence time per message, from the socket read that completed
/// its frame on the replication stream to the socket write that put its last byte on the
/// broker connection, in seconds (first publishes only; [`residence`]).
pub const RESIDENCE_SECONDS: &str = "pgoutbox_residence_seconds";

/// Counter: retryable failures followed by a reconnect, label `cause` (`broker`,
/// `postgres`, `slot_busy`: one per standby poll that found the slot held by another
/// process). A session that ended counts once, and so does each connection attempt that
/// failed before a session started (a broker down for a minute counts every retry), so it
/// is no count of sessions: [`SESSIONS_STARTED_TOTAL`] is.
pub const RECONNECTS_TOTAL: &str = "pgoutbox_reconnects_total";

/// Counter: log lines dropped because stderr did not take them: the log's writer thread
/// holds a bounded queue (the binary's `LOG_BUFFER_LINES`), and a line logged while it is
/// full is dropped rather than wait, so that a stalled stderr never stops the stream. Read
/// from the source set with [`count_log_drops_with`] at each scrape.
pub const LOG_LINES_DROPPED_TOTAL: &str = "pgoutbox_log_lines_dropped_total";

/// Where [`LOG_LINES_DROPPED_TOTAL`] is read from: set once by the binary, which owns the
/// log's writer (a library never sets up tracing).
static LOG_DROPS: std::sync::OnceLock<Box<dyn Fn() -> u64 + Send + Sync>> =
    std::sync::OnceLock::new();

/// Sets, once, the function that answers how many log lines were dropped so far (a
/// monotonic count); later calls are ignored.
pub fn count_log_drops_with(read: impl Fn() -> u64 + Send + Sync + 'static) {
    let _ = LOG_DROPS.set(Box::new(read));
}

/// The log lines dropped so far (0 when no source is set).
#[must_use]
pub fn log_lines_dropped() -> u64 {
    LOG_DROPS.get().map_or(0, |read| read())
}

/// Counter: rows written to `outbox.journal` (`run --journal`).
pub const JOURNAL_ROWS_WRITTEN_TOTAL: &str = "pgoutbox_journal_rows_written_total";

/// Counter: journal rows dropped, label `reason` (`buffer_full`: more confirms in one
/// interval than the buffer holds; `write_failed`: the batch's INSERT failed).
pub const JOURNAL_ROWS_DROPPED_TOTAL: &str = "pgoutbox_journal_rows_dropped_total";

/// Counter: rows deleted by `run`'s retention task, label `table` (`idempotency`,
/// `journal`).
pub const RETENTION_ROWS_DELETED_TOTAL: &str = "pgoutbox_retention_rows_deleted_total";

/// Counter: messages `run --stream` counted as confirmed without sending them, because the
/// broker had already stored their publishing ids for the producer name (deduplication at
/// start, after a crash or a takeover; docs/src/internals/stream-ids.md).
pub const STREAM_SKIPPED_AT_START_TOTAL: &str = "pgoutbox_stream_skipped_at_start_total";

/// Counter: `PublishError`s of `run --stream`, label `code` ([`STREAM_ERROR_CODES`]).
pub const STREAM_PUBLISH_ERRORS_TOTAL: &str = "pgoutbox_stream_publish_errors_total";

/// The values of [`STREAM_PUBLISH_ERRORS_TOTAL`]'s label `code`: the stream protocol's
/// response codes a publish error carries (PROTOCOL.adoc, "Response Codes"), `other` for any
/// other code.
pub const STREAM_ERROR_CODES: &[&str] = &[
    "stream_does_not_exist",
    "stream_not_available",
    "access_refused",
    "precondition_failed",
    "publisher_does_not_exist",
    "internal_error",
    "other",
];

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

/// Every metric name above, in the order they are registered (the catalogue's test checks
/// that each is served, and that nothing else is).
pub const NAMES: &[&str] = &[
    MESSAGES_PUBLISHED_TOTAL,
    MESSAGES_CONFIRMED_TOTAL,
    MESSAGES_NACKED_TOTAL,
    MESSAGES_RETURNED_TOTAL,
    MESSAGES_DEAD_LETTERED_TOTAL,
    MESSAGES_RETRIED_TOTAL,
    RECONNECTS_TOTAL,
    SESSIONS_STARTED_TOTAL,
    LOG_LINES_DROPPED_TOTAL,
    JOURNAL_ROWS_WRITTEN_TOTAL,
    JOURNAL_ROWS_DROPPED_TOTAL,
    RETENTION_ROWS_DELETED_TOTAL,
    STREAM_SKIPPED_AT_START_TOTAL,
    STREAM_PUBLISH_ERRORS_TOTAL,
    UNACKNOWLEDGED_MESSAGES,
    UNACKNOWLEDGED_BYTES,
    UNCONFIRMED_MESSAGES,
    FLUSH_LSN_BYTES,
    RECEIVED_LSN_BYTES,
    SERVER_WAL_END_BYTES,
    REPLICATION_LAG_BYTES,
    OLDEST_UNCONFIRMED_AGE_SECONDS,
    SINCE_STATUS_UPDATE_SECONDS,
    STALLED,
    BROKER_BLOCKED,
    ROLE,
    PARTITION_PUBLISHED_TOTAL,
    PARTITION_UNSETTLED_MESSAGES,
    PARTITION_CONNECTED,
    PARTITION_BLOCKED,
    CONFIRM_LATENCY_SECONDS,
    RESIDENCE_SECONDS,
    BUILD_INFO,
];

/// The values of [`RECONNECTS_TOTAL`]'s label `cause`, registered at 0 from the start.
pub const RECONNECT_CAUSES: &[&str] = &["broker", "postgres", "slot_busy"];

/// The values of [`JOURNAL_ROWS_DROPPED_TOTAL`]'s label `reason`.
pub const JOURNAL_DROP_REASONS: &[&str] = &["buffer_full", "write_failed"];

/// The values of [`RETENTION_ROWS_DELETED_TOTAL`]'s label `table` (the tables `run`'s
/// retention task deletes from).
pub const RETENTION_TABLES: &[&str] = &["idempotency", "journal"];

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

/// The wall clock in microseconds since the Unix epoch.
pub fn unix_now_us() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| i64::try_from(d.as_micros()).unwrap_or(i64::MAX))
        .unwrap_or(0)
}

/// Metrics and probe state shared by the driver, the event loop, the publisher's event
/// watcher and the HTTP task: the counters, the gauges, the latency histogram and the probe
/// state, registered once. Every value the loop writes is an atomic.
#[derive(Debug)]
pub struct Telemetry {
    registry: Registry,
    counters: Counters,
    gauges: Gauges,
    partitions: Partitions,
    latency: ConfirmLatency,
    residence: Residence,
    probe: Probe,
}

impl Telemetry {
    /// Registers every metric; `stall_after` is `--stall-after-s`.
    pub fn new(stall_after: Duration) -> Arc<Telemetry> {
        let mut registry = Registry::default();
        let counters = Counters::default();
        let gauges = Gauges::default();
        let partitions = Partitions::default();
        let latency = ConfirmLatency::default();
        counters.register(&mut registry);
        gauges.register(&mut registry);
        partitions.register(&mut registry);
        registry.register(
            CONFIRM_LATENCY_SECONDS,
            "Commit-to-confirm latency, in seconds",
            latency.clone(),
        );
        let residence = Residence::default();
        registry.register(
            RESIDENCE_SECONDS,
            "pgoutbox's own time per message: the socket read that completed it on the replication stream to the socket write that published it, in seconds (first publishes)",
            residence.clone(),
        );
        registry.register(
            counters::base_name(BUILD_INFO, "_info"),
            "Build information",
            Info::new([("version", env!("CARGO_PKG_VERSION"))]),
        );
        Arc::new(Telemetry {
            registry,
            counters,
            gauges,
            partitions,
            latency,
            residence,
            probe: Probe::new(stall_after),
        })
    }

    /// A beat: the loop (or the driver) is turning.
    pub fn beat(&self) {
        self.probe.beat();
    }

    /// The driver's phase changed.
    pub fn set_phase(&self, phase: Phase) {
        self.probe.set_phase(phase);
    }

    /// Sets the role (and, for a standby, the holder's `application_name`); returns
    /// whether either changed, so the caller logs every change once.
    pub fn set_role(&self, role: Role, holder: Option<&str>) -> bool {
        let (before, holder_changed) = self.probe.set_role(role, holder);
        self.gauges.set_role(role);
        before != role || holder_changed
    }

    /// The current role.
    pub fn role(&self) -> Role {
        self.probe.role()
    }

    /// The slot holder's `application_name` while standing by.
    pub fn holder(&self) -> Option<String> {
        self.probe.holder()
    }

    /// The current phase.
    pub fn phase(&self) -> Phase {
        self.probe.phase()
    }

    /// The residence histogram, which the broker connections observe into.
    pub fn residence(&self) -> Residence {
        self.residence.clone()
    }

    /// Sets how many broker connections a session has (`--partitions`).
    pub fn set_partitions(&self, n: usize) {
        self.probe.set_partitions(n);
    }

    /// The flags broker connection `i`'s publisher writes: `(blocked, lost)` (`None` past
    /// [`crate::partition::MAX_PARTITIONS`]). `lost` is true until the connection opens.
    pub fn connection_flags(&self, i: usize) -> Option<(Arc<AtomicBool>, Arc<AtomicBool>)> {
        self.probe.connection_flags(i)
    }

    /// The partitions whose broker connection is not open now.
    pub fn disconnected(&self) -> Vec<usize> {
        self.probe.disconnected()
    }

    /// A session's broker connections were closed, or a connect did not open them all:
    /// every partition reads disconnected, unblocked and with nothing unsettled.
    pub fn connections_closed(&self) {
        self.probe.connections_closed();
        for i in 0..self.probe.partitions() {
            self.partitions.set(
                i,
                PartTurn {
                    published: 0,
                    unsettled: 0,
                },
            );
        }
    }

    /// The server's end of WAL, read by the driver between sessions (`pg_current_wal_lsn()`,
    /// as a number): the WAL end and lag gauges follow it while no session streams.
    pub fn set_server_wal_end(&self, wal_end: u64) {
        self.gauges.set_server_wal_end(wal_end);
    }

    /// The flush LSN last reported to Postgres, as a number (0 before the first session
    /// reported one).
    pub fn flush_lsn_reported(&self) -> u64 {
        self.gauges.flush_lsn()
    }

    /// Partition `i`'s figures of one turn (`pgoutbox_partition_*`).
    pub fn partition(&self, i: usize, turn: PartTurn) {
        self.partitions.set(i, turn);
    }

    /// A session started streaming.
    pub fn session_started(&self) {
        self.counters.session_started();
        self.probe.session_started();
    }

    /// A session ended with a retryable failure of `cause` (`broker`, `postgres`,
    /// `slot_busy`).
    pub fn reconnect(&self, cause: &'static str) {
        self.counters.reconnect(cause);
    }

    /// `rows` journal rows were written.
    pub fn journal_written(&self, rows: u64) {
        self.counters.journal_written(rows);
    }

    /// `rows` journal rows were dropped for `reason` (`buffer_full`, `write_failed`).
    pub fn journal_dropped(&self, reason: &'static str, rows: u64) {
        self.counters.journal_dropped(reason, rows);
    }

    /// The retention task deleted `rows` rows of `table` (`idempotency`, `journal`).
    pub fn retention_deleted(&self, table: &'static str, rows: u64) {
        self.counters.retention_deleted(table, rows);
    }

    /// A publish was nacked.
    pub fn nacked(&self) {
        self.counters.nacked();
    }

    /// The counters `run --stream`'s publisher moves ([`counters::StreamCounters`]).
    pub fn stream_counters(&self) -> counters::StreamCounters {
        self.counters.stream()
    }

    /// A publish was returned.
    pub fn returned(&self) {
        self.counters.returned();
    }

    /// A message was dead-lettered for `reason`.
    pub fn dead_lettered(&self, reason: &'static str) {
        self.counters.dead_lettered(reason);
    }

    /// A standby status update was sent.
    pub fn status_sent(&self) {
        self.probe.status_sent();
    }

    /// The stall clock restarts now (a settle, or the first unconfirmed message).
    pub fn progress_at(&self, at: Instant) {
        self.probe.progress_at(at);
    }

    /// The loop's report for one turn: counters move to the totals, gauges take the values,
    /// the latency batch is added (and cleared), and the loop beats.
    pub fn turn(&self, turn: &Turn, latency: &mut LatencyBatch) {
        self.counters.sync_turn(turn);
        self.gauges.set_turn(turn);
        self.probe
            .set_oldest_commit_time_us(turn.oldest_commit_time_us);
        self.latency.add(latency);
        self.probe.beat();
    }

    /// Messages not settled, as of the loop's last turn.
    pub fn unconfirmed(&self) -> i64 {
        self.gauges.unconfirmed()
    }

    /// Whether the stream is stalled now: unconfirmed messages and no settle for
    /// `--stall-after-s`.
    pub fn is_stalled(&self) -> bool {
        self.probe.is_stalled(self.unconfirmed())
    }

    /// Whether RabbitMQ blocks any of the connections.
    pub fn is_broker_blocked(&self) -> bool {
        self.probe.is_broker_blocked()
    }

    /// Time since the last beat.
    pub fn since_beat(&self) -> Duration {
        self.probe.since_beat()
    }

    /// Liveness: the loop beat within [`HEALTH_STALE_AFTER`].
    pub fn is_healthy(&self) -> bool {
        self.probe.is_healthy()
    }

    /// Readiness, with the reason when not ready.
    pub fn readiness(&self) -> Readiness {
        self.probe.readiness(self.unconfirmed())
    }

    /// Age of the oldest unconfirmed message in seconds (0 when none).
    pub fn oldest_unconfirmed_age(&self) -> f64 {
        self.probe.oldest_unconfirmed_age()
    }

    /// The text exposition (OpenMetrics), derived gauges computed now.
    pub fn encode(&self) -> String {
        self.gauges.set_derived(&self.probe);
        self.counters.sync_log_drops(log_lines_dropped());
        for i in 0..self.probe.partitions() {
            self.partitions
                .set_connection(i, self.probe.is_connected(i), self.probe.is_blocked(i));
        }
        let mut text = String::new();
        if prometheus_client::encoding::text::encode(&mut text, &self.registry).is_err() {
            text.clear();
        }
        text
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
        assert_eq!(batch.count(), 0, "the batch is cleared");
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

    /// Issue 31 item 2: the per-partition gauges are read from each connection's flags at
    /// scrape time (they were written once per turn of a session, and froze between
    /// sessions), and one partition's unblock no longer clears another's block.
    #[test]
    fn partition_gauges_are_true_when_scraped() {
        let t = Telemetry::new(Duration::from_secs(60));
        t.set_partitions(4);
        let flags: Vec<_> = (0..4).map(|i| t.connection_flags(i).unwrap()).collect();
        for (_, lost) in &flags {
            lost.store(false, std::sync::atomic::Ordering::Relaxed);
        }
        t.session_started();
        assert_eq!(t.readiness(), Readiness::Ready);
        flags[1].0.store(true, std::sync::atomic::Ordering::Relaxed);
        flags[2]
            .0
            .store(false, std::sync::atomic::Ordering::Relaxed);
        assert!(t.is_broker_blocked(), "partition 1 is still blocked");
        flags[3].1.store(true, std::sync::atomic::Ordering::Relaxed);
        let text = t.encode();
        assert!(
            text.contains("pgoutbox_partition_connected{partition=\"3\"} 0"),
            "{text}"
        );
        assert!(
            text.contains("pgoutbox_partition_connected{partition=\"2\"} 1"),
            "{text}"
        );
        assert!(
            text.contains("pgoutbox_partition_blocked{partition=\"1\"} 1"),
            "{text}"
        );
        assert_eq!(t.disconnected(), [3]);
        assert_eq!(t.readiness(), Readiness::NotReady("broker_disconnected"));
        t.connections_closed();
        let text = t.encode();
        for i in 0..4 {
            assert!(
                text.contains(&format!(
                    "pgoutbox_partition_connected{{partition=\"{i}\"}} 0"
                )),
                "{text}"
            );
        }
        assert!(!t.is_broker_blocked());
        // Between sessions the WAL end read by the driver moves the lag.
        t.turn(
            &Turn {
                flush_lsn: 400,
                server_wal_end: 1000,
                ..Turn::default()
            },
            &mut LatencyBatch::default(),
        );
        t.set_server_wal_end(5000);
        assert!(t.encode().contains("pgoutbox_replication_lag_bytes 4600"));
    }

    #[test]
    fn readiness_names_the_reason() {
        let t = Telemetry::new(Duration::from_millis(0));
        assert_eq!(t.readiness(), Readiness::NotReady("connecting"));
        let (blocked, lost) = t.connection_flags(0).unwrap();
        t.session_started();
        assert_eq!(
            t.readiness(),
            Readiness::NotReady("broker_disconnected"),
            "no connection opened yet"
        );
        lost.store(false, std::sync::atomic::Ordering::Relaxed);
        assert_eq!(t.readiness(), Readiness::Ready);
        t.turn(
            &Turn {
                unconfirmed: 1,
                ..Turn::default()
            },
            &mut LatencyBatch::default(),
        );
        assert_eq!(t.readiness(), Readiness::NotReady("stalled"));
        blocked.store(true, std::sync::atomic::Ordering::Relaxed);
        assert_eq!(t.readiness(), Readiness::NotReady("broker_blocked"));
        lost.store(true, std::sync::atomic::Ordering::Relaxed);
        assert_eq!(t.readiness(), Readiness::NotReady("broker_disconnected"));
        t.set_phase(Phase::Draining);
        assert_eq!(t.readiness(), Readiness::NotReady("draining"));
        // Between sessions the reason names the side that failed.
        t.set_phase(Phase::BrokerDisconnected);
        assert_eq!(t.readiness(), Readiness::NotReady("broker_disconnected"));
        t.set_phase(Phase::ReplicationLost);
        assert_eq!(t.readiness(), Readiness::NotReady("replication_lost"));
        assert!(t.is_healthy());
    }
}
