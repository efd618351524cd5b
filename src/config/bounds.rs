//! The pipeline's bounds: the window of unacknowledged messages (count and bytes), the
//! largest message, publish attempts, read coalescing, and how long shutdown and a lost
//! Postgres connection wait for confirms. Defaults are named consts whose docs say why;
//! every bound has an upper cap far above any sensible value, so that it only catches typos
//! and values that would overflow a clock or a counter. Each setting's range is checked by
//! [`super::RunSettings::validate`] from the one table of [`super::numeric`].

use std::time::Duration;

/// Default in-flight window in messages: RabbitMQ needs 1,000 to 10,000 unconfirmed
/// persistent publishes to approach its ceiling on these machines (FACTS.md).
pub const DEFAULT_MAX_IN_FLIGHT: usize = 10_000;

/// Default in-flight window in payload bytes (16 MiB): bounds memory when messages are large.
pub const DEFAULT_MAX_IN_FLIGHT_BYTES: usize = 16 * 1024 * 1024;

/// Upper bound of the periodic standby status update interval (the server's own
/// `wal_receiver_status_interval` default is 10 s); it is lowered to a third of the server's
/// `wal_sender_timeout` so a stalled broker never gets the connection killed.
pub const MAX_STATUS_INTERVAL: Duration = Duration::from_secs(10);

/// Status updates after the watermark moved are coalesced to at most one per this interval:
/// one update per message costs the walsender ~7 µs each (FACTS.md).
pub const STATUS_COALESCE: Duration = Duration::from_millis(200);

/// Publish attempts for a nacked message before it is dead-lettered.
pub const DEFAULT_MAX_ATTEMPTS: u32 = 5;

/// Payloads above this are dead-lettered as `too_large` (RabbitMQ's own limit is 128 MiB by
/// default; 16 MiB keeps one message within the default byte window).
pub const DEFAULT_MAX_MESSAGE_BYTES: usize = 16 * 1024 * 1024;

/// Default `--read-coalesce-us`: 0, no delay between small reads of the replication socket.
///
/// The loop batches by itself: whatever arrived while a turn ran is read in one piece, and a
/// publish no longer wakes another thread. Measured side by side (bench scenario 4, 2,000 and
/// 4,000 msg/s, 2026-12-02), a 1 ms delay saved no CPU per message and added 0.5–1.1 ms to
/// the median, so it is off unless asked for.
pub const DEFAULT_READ_COALESCE: Duration = Duration::ZERO;

/// Largest accepted `--read-coalesce-us`: 100 ms.
pub const MAX_READ_COALESCE: Duration = Duration::from_millis(100);

// Upper bounds of the numeric and duration settings. Each is far above any sensible
// value, so it only catches typos and values that would overflow a clock or a counter
// (`Instant::now() + Duration::from_secs(u64::MAX)` panics).

/// Largest accepted `--max-in-flight`: 1,000,000 messages, 100 times the default.
/// RabbitMQ reaches its ceiling by 10,000 unconfirmed publishes (FACTS.md), and every
/// message in the window is held in memory until it is confirmed.
pub const MAX_IN_FLIGHT_CAP: usize = 1_000_000;

/// Largest accepted `--max-in-flight-bytes`: 4 GiB, 256 times the default. The window's
/// payloads are held in memory, so this is the memory an operator agrees to spend on them.
pub const MAX_IN_FLIGHT_BYTES_CAP: usize = 4 * 1024 * 1024 * 1024;

/// Largest accepted `--max-message-bytes` and `--broker-max-message-bytes`: 512 MiB,
/// RabbitMQ's hard upper limit for its own `max_message_size`: a larger message could never
/// be published.
pub const MAX_MESSAGE_BYTES_CAP: usize = 512 * 1024 * 1024;

/// Largest accepted `--max-attempts`: 1,000. With the nack retry backoff capped at 5 s that
/// is more than an hour of retrying one message while everything behind it waits.
pub const MAX_ATTEMPTS_CAP: u32 = 1_000;

/// Largest accepted `--shutdown-timeout-s`: one day. A drain waits only for confirms the
/// broker owes (milliseconds when it is healthy); a service manager kills a process long
/// before a day has passed (the shipped unit waits 45 s).
pub const SHUTDOWN_TIMEOUT_CAP: Duration = Duration::from_secs(86_400);

/// How long a SIGINT/SIGTERM waits for outstanding publisher confirms.
pub const DEFAULT_SHUTDOWN_TIMEOUT: Duration = Duration::from_secs(30);

/// How long a session whose Postgres connection broke keeps collecting broker confirms
/// (`--postgres-loss-drain-ms`), so that messages the broker already has are not sent again
/// after the reconnect: a few seconds cover a healthy broker's confirm latency many times over.
pub const DEFAULT_POSTGRES_LOSS_DRAIN: Duration = Duration::from_secs(5);

/// Largest `--postgres-loss-drain-ms`: ten minutes; the reconnect waits that long at worst.
pub const POSTGRES_LOSS_DRAIN_CAP: Duration = Duration::from_secs(600);

/// The longest wait between two sessions (`--reconnect-backoff-max-ms`): the reconnect
/// backoff doubles from 0.5 s up to it, with jitter.
pub const DEFAULT_RECONNECT_BACKOFF_MAX: Duration = Duration::from_secs(30);

/// Smallest `--reconnect-backoff-max-ms`: the backoff's first step, 0.5 s.
pub const RECONNECT_BACKOFF_MAX_MIN: Duration = Duration::from_millis(500);

/// Largest `--reconnect-backoff-max-ms`: ten minutes.
pub const RECONNECT_BACKOFF_MAX_CAP: Duration = Duration::from_secs(600);

/// How much `run` holds and for how long (`--max-in-flight`, `--max-in-flight-bytes`,
/// `--max-message-bytes`, `--broker-max-message-bytes`, `--max-attempts`,
/// `--read-coalesce-us`, `--shutdown-timeout-s`, `--postgres-loss-drain-ms`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PipelineBounds {
    /// In-flight window in messages (read, not yet acknowledged to Postgres).
    pub max_in_flight: usize,
    /// In-flight window in payload bytes.
    pub max_in_flight_bytes: usize,
    /// Logical messages (the whole envelope, in bytes) larger than this are dead-lettered
    /// as `too_large`.
    pub max_message_bytes: usize,
    /// The broker's `max_message_size` (payload bytes), when the operator knows it: larger
    /// payloads are dead-lettered as `too_large` before publishing. `None`: learned from
    /// the broker's channel close the first time it refuses a message.
    pub broker_max_message_bytes: Option<usize>,
    /// Publish attempts for a nacked message before it is dead-lettered (at least 1).
    pub max_attempts: u32,
    /// Minimum time between two reads of the replication socket when the previous read was
    /// small and 4 or more publishes are unconfirmed (ms-scale; zero reads as soon as bytes
    /// arrive). With fewer unconfirmed (an idle stream, a low rate) bytes are read at once;
    /// under a steady stream of small transactions they are read at most once per interval,
    /// so one wake-up, one publish batch and one confirm batch cover many transactions.
    /// Reads of 64 KiB or more (a backlog, big messages) are never delayed.
    pub read_coalesce: Duration,
    /// How long shutdown waits for outstanding confirms.
    pub shutdown_timeout: Duration,
    /// How long to keep collecting broker confirms after the Postgres connection broke
    /// (it ends early once nothing is unconfirmed).
    pub postgres_loss_drain: Duration,
    /// The longest wait between two sessions: the reconnect backoff's cap.
    pub reconnect_backoff_max: Duration,
}

impl Default for PipelineBounds {
    fn default() -> Self {
        PipelineBounds {
            max_in_flight: DEFAULT_MAX_IN_FLIGHT,
            max_in_flight_bytes: DEFAULT_MAX_IN_FLIGHT_BYTES,
            max_message_bytes: DEFAULT_MAX_MESSAGE_BYTES,
            broker_max_message_bytes: None,
            max_attempts: DEFAULT_MAX_ATTEMPTS,
            read_coalesce: DEFAULT_READ_COALESCE,
            shutdown_timeout: DEFAULT_SHUTDOWN_TIMEOUT,
            postgres_loss_drain: DEFAULT_POSTGRES_LOSS_DRAIN,
            reconnect_backoff_max: DEFAULT_RECONNECT_BACKOFF_MAX,
        }
    }
}
