//! The gauges of `run`: the window (messages, bytes), unconfirmed messages, the LSNs
//! (flush, received, server end, lag), and the derived values computed when a scrape asks
//! (oldest unconfirmed age, seconds since the last status update, stalled, broker
//! blocked, role).

use std::sync::atomic::AtomicU64;

use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

use super::{
    Probe, Role, Turn, BROKER_BLOCKED, FLUSH_LSN_BYTES, OLDEST_UNCONFIRMED_AGE_SECONDS,
    RECEIVED_LSN_BYTES, REPLICATION_LAG_BYTES, ROLE, SERVER_WAL_END_BYTES,
    SINCE_STATUS_UPDATE_SECONDS, STALLED, UNACKNOWLEDGED_BYTES, UNACKNOWLEDGED_MESSAGES,
    UNCONFIRMED_MESSAGES,
};

fn as_gauge(v: u64) -> i64 {
    i64::try_from(v).unwrap_or(i64::MAX)
}

/// Every gauge; clones share the values.
#[derive(Debug, Default)]
pub struct Gauges {
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
    blocked: Gauge,
    role: Family<[(&'static str, &'static str); 1], Gauge>,
}

impl Gauges {
    /// Registers every gauge in `registry` (both roles shown, at 0, from the start).
    pub fn register(&self, registry: &mut Registry) {
        registry.register(
            UNACKNOWLEDGED_MESSAGES,
            "Outbox messages read and not yet acknowledged to Postgres",
            self.unacknowledged_messages.clone(),
        );
        registry.register(
            UNACKNOWLEDGED_BYTES,
            "Payload bytes read and not yet acknowledged to Postgres",
            self.unacknowledged_bytes.clone(),
        );
        registry.register(
            UNCONFIRMED_MESSAGES,
            "Messages neither confirmed as routed nor dead-lettered",
            self.unconfirmed.clone(),
        );
        registry.register(
            FLUSH_LSN_BYTES,
            "Flush LSN last reported to Postgres, as a number",
            self.flush_lsn.clone(),
        );
        registry.register(
            RECEIVED_LSN_BYTES,
            "Newest WAL position received, as a number",
            self.received_lsn.clone(),
        );
        registry.register(
            SERVER_WAL_END_BYTES,
            "Server end of WAL as last reported by the walsender, as a number",
            self.server_wal_end.clone(),
        );
        registry.register(
            REPLICATION_LAG_BYTES,
            "Server WAL end minus the flush LSN reported, in bytes",
            self.lag.clone(),
        );
        registry.register(
            OLDEST_UNCONFIRMED_AGE_SECONDS,
            "Age of the oldest unconfirmed message since its commit, in seconds (0 when none)",
            self.oldest_age.clone(),
        );
        registry.register(
            SINCE_STATUS_UPDATE_SECONDS,
            "Seconds since the last standby status update",
            self.since_status.clone(),
        );
        registry.register(
            STALLED,
            "1 while messages are unconfirmed and none settled for --stall-after-s",
            self.stalled.clone(),
        );
        registry.register(
            BROKER_BLOCKED,
            "1 while RabbitMQ blocks the connection (memory or disk alarm)",
            self.blocked.clone(),
        );
        for role in [Role::Active, Role::Standby] {
            let _ = self.role.get_or_create(&[("role", role.as_str())]);
        }
        registry.register(
            ROLE,
            "1 for this process's role on the slot (active streams, standby waits to take over)",
            self.role.clone(),
        );
    }

    /// The loop's current values of one turn.
    pub fn set_turn(&self, turn: &Turn) {
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
    }

    /// The server's WAL end read between sessions: the WAL end gauge takes it, and the lag
    /// is measured from the flush LSN last reported.
    pub fn set_server_wal_end(&self, wal_end: u64) {
        self.server_wal_end.set(as_gauge(wal_end));
        self.lag
            .set(as_gauge(wal_end.saturating_sub(self.flush_lsn())));
    }

    /// The flush LSN last reported, as a number.
    pub fn flush_lsn(&self) -> u64 {
        u64::try_from(self.flush_lsn.get()).unwrap_or(0)
    }

    /// Messages not settled, as of the last turn.
    pub fn unconfirmed(&self) -> i64 {
        self.unconfirmed.get()
    }

    /// 1 for `role`, 0 for the other.
    pub fn set_role(&self, role: Role) {
        for r in [Role::Active, Role::Standby] {
            self.role
                .get_or_create(&[("role", r.as_str())])
                .set(i64::from(r == role));
        }
    }

    /// The values a scrape derives from the probe state, computed now.
    pub fn set_derived(&self, probe: &Probe) {
        let unconfirmed = self.unconfirmed();
        self.oldest_age.set(probe.oldest_unconfirmed_age());
        self.since_status.set(probe.since_status_secs());
        self.stalled.set(i64::from(probe.is_stalled(unconfirmed)));
        self.blocked.set(i64::from(probe.is_broker_blocked()));
    }
}
