//! What `/healthz` and `/readyz` answer from: the driver's phase, this process's role on
//! the slot, the loop's heartbeat, the stall clock and each broker connection's flags.
//! Atomics written by the driver, the loop and each connection's publisher; read when a
//! probe or a scrape asks, so what they answer is true at that moment, between sessions
//! too.

use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, AtomicU8, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::HEALTH_STALE_AFTER;

/// What the driver is doing, for `/readyz`.
///
/// After a session fails, the phase names the side that failed ([`Phase::BrokerDisconnected`]
/// or [`Phase::ReplicationLost`]) until the next session streams: through the backoff and
/// the reconnect attempts, each failed attempt naming its own side again.
/// [`Phase::Connecting`] is only the first connect of the process.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Phase {
    /// The first connect of the process, before any session streamed or failed.
    Connecting = 0,
    /// Another process holds the slot; standing by.
    SlotBusy = 1,
    /// The replication stream and the broker channel are open.
    Streaming = 2,
    /// Shutdown requested: draining confirms.
    Draining = 3,
    /// The replication connection or PostgreSQL failed: collecting confirms before
    /// reconnecting, backing off, or reconnecting.
    ReplicationLost = 4,
    /// The broker connection or channel failed: backing off or reconnecting.
    BrokerDisconnected = 5,
}

impl Phase {
    fn from_u8(v: u8) -> Phase {
        match v {
            1 => Phase::SlotBusy,
            2 => Phase::Streaming,
            3 => Phase::Draining,
            4 => Phase::ReplicationLost,
            5 => Phase::BrokerDisconnected,
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
            Phase::BrokerDisconnected => Some("broker_disconnected"),
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

/// The probe state shared by the driver, the event loop, the publisher's event watcher and
/// the HTTP task. Every field the loop writes is an atomic; times are milliseconds since
/// `base`.
#[derive(Debug)]
pub struct Probe {
    base: Instant,
    stall_after: Duration,
    role: AtomicU8,
    /// The slot holder's `application_name` while this process stands by (written on a
    /// role change only, never by the event loop).
    holder: Mutex<Option<String>>,
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
    /// Per broker connection (partition `i`; one connection is partition 0), up to
    /// [`crate::partition::MAX_PARTITIONS`]: written by its publisher.
    connections: Vec<ConnectionFlags>,
    /// How many connections a session has (`--partitions`): the flags read.
    partitions: AtomicUsize,
}

/// One broker connection's flags, shared with its publisher (`BrokerSignals`).
#[derive(Debug)]
struct ConnectionFlags {
    /// True while the broker blocks the connection (`connection.blocked`).
    blocked: Arc<AtomicBool>,
    /// True while there is no open connection: from the start, once it failed, and once
    /// its session ended; false from the moment it opened.
    lost: Arc<AtomicBool>,
}

impl ConnectionFlags {
    fn new() -> Self {
        ConnectionFlags {
            blocked: Arc::new(AtomicBool::new(false)),
            lost: Arc::new(AtomicBool::new(true)),
        }
    }
}

/// Milliseconds since `base`, saturating.
fn ms_since(base: Instant, at: Instant) -> u64 {
    u64::try_from(at.saturating_duration_since(base).as_millis()).unwrap_or(u64::MAX)
}

impl Probe {
    /// A process that is connecting, with no beat yet; `stall_after` is `--stall-after-s`.
    pub fn new(stall_after: Duration) -> Probe {
        Probe {
            base: Instant::now(),
            stall_after,
            role: AtomicU8::new(Role::None as u8),
            holder: Mutex::new(None),
            oldest_commit_time_us: AtomicI64::new(0),
            heartbeat_ms: AtomicU64::new(0),
            status_at_ms: AtomicU64::new(u64::MAX),
            progress_at_ms: AtomicU64::new(0),
            phase: AtomicU8::new(Phase::Connecting as u8),
            connections: (0..crate::partition::MAX_PARTITIONS)
                .map(|_| ConnectionFlags::new())
                .collect(),
            partitions: AtomicUsize::new(1),
        }
    }

    fn now_ms(&self) -> u64 {
        ms_since(self.base, Instant::now())
    }

    /// A beat: the loop (or the driver) is turning.
    pub fn beat(&self) {
        self.heartbeat_ms.store(self.now_ms(), Ordering::Relaxed);
    }

    /// The driver's phase changed (a beat too).
    pub fn set_phase(&self, phase: Phase) {
        self.phase.store(phase as u8, Ordering::Relaxed);
        self.beat();
    }

    /// The current phase.
    pub fn phase(&self) -> Phase {
        Phase::from_u8(self.phase.load(Ordering::Relaxed))
    }

    /// Sets the role (and, for a standby, the holder's `application_name`); returns the
    /// role before and whether the holder changed.
    pub fn set_role(&self, role: Role, holder: Option<&str>) -> (Role, bool) {
        let holder = holder.filter(|_| role == Role::Standby).map(str::to_owned);
        let before = Role::from_u8(self.role.swap(role as u8, Ordering::Relaxed));
        let mut slot = self.holder.lock().unwrap_or_else(|e| e.into_inner());
        let holder_changed = *slot != holder;
        *slot = holder;
        (before, holder_changed)
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

    /// Sets how many broker connections a session has (`--partitions`, 1 to
    /// [`crate::partition::MAX_PARTITIONS`]; clamped).
    pub fn set_partitions(&self, n: usize) {
        self.partitions
            .store(n.clamp(1, self.connections.len()), Ordering::Relaxed);
    }

    /// How many broker connections a session has.
    pub fn partitions(&self) -> usize {
        self.partitions.load(Ordering::Relaxed)
    }

    /// The flags of connection `i` for its publisher: `(blocked, lost)`, `None` past
    /// [`crate::partition::MAX_PARTITIONS`].
    pub fn connection_flags(&self, i: usize) -> Option<(Arc<AtomicBool>, Arc<AtomicBool>)> {
        let c = self.connections.get(i)?;
        Some((Arc::clone(&c.blocked), Arc::clone(&c.lost)))
    }

    /// Whether connection `i` is open now.
    pub fn is_connected(&self, i: usize) -> bool {
        self.connections
            .get(i)
            .is_some_and(|c| !c.lost.load(Ordering::Relaxed))
    }

    /// Whether the broker blocks connection `i` now.
    pub fn is_blocked(&self, i: usize) -> bool {
        self.connections
            .get(i)
            .is_some_and(|c| c.blocked.load(Ordering::Relaxed))
    }

    /// The connections (partition numbers) that are not open now.
    pub fn disconnected(&self) -> Vec<usize> {
        (0..self.partitions())
            .filter(|&i| !self.is_connected(i))
            .collect()
    }

    /// A session's connections were closed (or never all opened): none is open or
    /// blocked, whatever their publishers last wrote.
    pub fn connections_closed(&self) {
        for c in &self.connections {
            c.lost.store(true, Ordering::Relaxed);
            c.blocked.store(false, Ordering::Relaxed);
        }
    }

    /// A session started streaming: the phase is streaming.
    pub fn session_started(&self) {
        self.set_phase(Phase::Streaming);
    }

    /// A standby status update was sent.
    pub fn status_sent(&self) {
        self.status_at_ms.store(self.now_ms(), Ordering::Relaxed);
    }

    /// Seconds since the last status update (0 before the first).
    pub fn since_status_secs(&self) -> f64 {
        match self.status_at_ms.load(Ordering::Relaxed) {
            u64::MAX => 0.0,
            at => self.now_ms().saturating_sub(at) as f64 / 1e3,
        }
    }

    /// The stall clock restarts now (a settle, or the first unconfirmed message).
    pub fn progress_at(&self, at: Instant) {
        self.progress_at_ms
            .store(ms_since(self.base, at), Ordering::Relaxed);
    }

    /// The commit time of the oldest unconfirmed message (µs since the Unix epoch; `None`:
    /// nothing in flight).
    pub fn set_oldest_commit_time_us(&self, at: Option<i64>) {
        self.oldest_commit_time_us
            .store(at.unwrap_or(0), Ordering::Relaxed);
    }

    /// Age of the oldest unconfirmed message in seconds (0 when none).
    pub fn oldest_unconfirmed_age(&self) -> f64 {
        match self.oldest_commit_time_us.load(Ordering::Relaxed) {
            0 => 0.0,
            at => (super::unix_now_us().saturating_sub(at)).max(0) as f64 / 1e6,
        }
    }

    /// Whether the stream is stalled now, with `unconfirmed` messages unsettled: some, and
    /// no settle for `--stall-after-s`.
    pub fn is_stalled(&self, unconfirmed: i64) -> bool {
        unconfirmed > 0
            && self
                .now_ms()
                .saturating_sub(self.progress_at_ms.load(Ordering::Relaxed))
                >= u64::try_from(self.stall_after.as_millis()).unwrap_or(u64::MAX)
    }

    /// Whether RabbitMQ blocks any of the connections.
    pub fn is_broker_blocked(&self) -> bool {
        (0..self.partitions()).any(|i| self.is_blocked(i))
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

    /// Readiness, with `unconfirmed` messages unsettled, and the reason when not ready.
    pub fn readiness(&self, unconfirmed: i64) -> Readiness {
        if let Some(reason) = self.phase().reason() {
            return Readiness::NotReady(reason);
        }
        if !self.disconnected().is_empty() {
            return Readiness::NotReady("broker_disconnected");
        }
        if self.is_broker_blocked() {
            return Readiness::NotReady("broker_blocked");
        }
        if self.is_stalled(unconfirmed) {
            return Readiness::NotReady("stalled");
        }
        Readiness::Ready
    }
}
