//! Every numeric and duration setting of `run` (and `check`) in one table: its flag, its
//! unit, the range it accepts, its default, its doc, and where it lives in
//! [`RunSettings`]. This table is the one source every reader of a bounded setting uses:
//!
//! ```text
//!                      ┌──▶ cli::run: --help text (doc + range), default, value parser
//!  NUMERIC_SETTINGS ───┼──▶ config_file: the same parsers (a file key is the flag's)
//!   (this module)      ├──▶ RunSettings::validate: every range, for settings built anywhere
//!                      └──▶ cli::reference / docs: the range beside the default and the doc
//! ```
//!
//! So a range is written once, and a [`RunSettings`] built in code (a test, an embedding
//! program) is held to it exactly as one parsed from flags, variables or a config file:
//! 65 partitions is a [`ValidationError`] naming `--partitions`, never a panic in the sink.
//! The environment variable and the config key follow from the flag
//! ([`crate::validation::env_of`], `_` for `-`); the numbers themselves are the named
//! consts of [`super::bounds`], [`super::postgres`], [`super::observability`] and
//! [`super::retention`], whose docs say why.
//!
//! Adding a setting: add its static here and to [`NUMERIC_SETTINGS`], and give the clap
//! argument `help = X.help()`, `default_value = X.default_text()` and a parser of `X`. The
//! unit tests enumerate this table (every range is enforced at both ends) and walk clap's
//! `run` command (every numeric or duration option is in the table), so a setting cannot be
//! left out of either.

use std::sync::OnceLock;
use std::time::Duration;

use super::bounds::{
    DEFAULT_MAX_ATTEMPTS, DEFAULT_MAX_IN_FLIGHT, DEFAULT_MAX_IN_FLIGHT_BYTES,
    DEFAULT_MAX_MESSAGE_BYTES, DEFAULT_POSTGRES_LOSS_DRAIN, DEFAULT_READ_COALESCE,
    DEFAULT_RECONNECT_BACKOFF_MAX, DEFAULT_SHUTDOWN_TIMEOUT, MAX_ATTEMPTS_CAP,
    MAX_IN_FLIGHT_BYTES_CAP, MAX_IN_FLIGHT_CAP, MAX_MESSAGE_BYTES_CAP, MAX_READ_COALESCE,
    POSTGRES_LOSS_DRAIN_CAP, RECONNECT_BACKOFF_MAX_CAP, RECONNECT_BACKOFF_MAX_MIN,
    SHUTDOWN_TIMEOUT_CAP,
};
use super::observability::{DEFAULT_STALL_AFTER, MAX_STALL_AFTER};
use super::postgres::{
    DEFAULT_SLOT_BUSY_TIMEOUT, DEFAULT_STANDBY_POLL, MIN_STANDBY_POLL, SLOT_BUSY_TIMEOUT_CAP,
    STANDBY_POLL_CAP,
};
use super::retention::{
    Retention, DEFAULT_MAINTENANCE_INTERVAL, DEFAULT_RETENTION, MAINTENANCE_INTERVAL_MAX,
    MAINTENANCE_INTERVAL_MIN, RETENTION_CAP,
};
use super::RunSettings;
use crate::partition::MAX_PARTITIONS;
use crate::validation::ValidationError;

/// What a numeric setting counts, which fixes how its value is written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unit {
    /// A count of things, named in the plural (`messages`, `bytes`, `attempts`): a whole
    /// number.
    Count(&'static str),
    /// A duration in whole seconds (flags ending `-s`).
    Seconds,
    /// A duration in whole milliseconds (flags ending `-ms`).
    Milliseconds,
    /// A duration in whole microseconds (flags ending `-us`).
    Microseconds,
    /// A duration in humantime's syntax (`30s`, `5m`, `7d`, `1h 30m`), counted in this
    /// table in milliseconds.
    Duration,
}

impl Unit {
    /// Nanoseconds in one of this unit's steps, for a setting stored as a [`Duration`]
    /// (a [`Unit::Count`] has none; it is never stored as a duration).
    fn nanos(self) -> u128 {
        match self {
            Unit::Seconds | Unit::Count(_) => 1_000_000_000,
            Unit::Milliseconds | Unit::Duration => 1_000_000,
            Unit::Microseconds => 1_000,
        }
    }

    /// `d` in this unit's steps, rounded down.
    fn of_duration(self, d: Duration) -> u128 {
        d.as_nanos() / self.nanos()
    }

    /// `n` steps of this unit as a [`Duration`] (saturating at [`Duration::MAX`]).
    fn to_duration(self, n: u64) -> Duration {
        let nanos = u128::from(n) * self.nanos();
        let secs = u64::try_from(nanos / 1_000_000_000).unwrap_or(u64::MAX);
        // The remainder is below 10^9 and fits.
        Duration::new(secs, (nanos % 1_000_000_000) as u32)
    }

    /// A value as the operator writes it: digits, or for [`Unit::Duration`] the largest
    /// whole unit of humantime's (`300000` ms is `5m`, `604800000` is `7d`, `1500` is
    /// `1500ms`).
    pub fn render(self, value: u128) -> String {
        if self != Unit::Duration || value == 0 {
            return value.to_string();
        }
        const STEPS: [(u128, &str); 4] = [
            (86_400_000, "d"),
            (3_600_000, "h"),
            (60_000, "m"),
            (1_000, "s"),
        ];
        STEPS.iter().find(|(ms, _)| value % ms == 0).map_or_else(
            || format!("{value}ms"),
            |(ms, u)| format!("{}{u}", value / ms),
        )
    }

    /// The word after a range (`messages`, `seconds`); empty for a [`Unit::Duration`],
    /// whose values carry their unit.
    fn label(self) -> &'static str {
        match self {
            Unit::Count(things) => things,
            Unit::Seconds => "seconds",
            Unit::Milliseconds => "milliseconds",
            Unit::Microseconds => "microseconds",
            Unit::Duration => "",
        }
    }
}

/// A field of [`RunSettings`] that holds a numeric setting, read and written in the
/// setting's [`Unit`].
pub trait Stored {
    /// The value in `unit`'s steps (a duration rounded down); `None` when the setting is
    /// unset and so has nothing to check (`--broker-max-message-bytes` not given).
    fn read(&self, unit: Unit) -> Option<u128>;
    /// Stores `value` (in `unit`'s steps), saturating where the field is narrower: how
    /// code (a test) sets the field without knowing its type.
    fn write(&mut self, value: u64, unit: Unit);
}

macro_rules! stored_integer {
    ($($t:ty),*) => {$(
        impl Stored for $t {
            fn read(&self, _: Unit) -> Option<u128> {
                u128::try_from(*self).ok()
            }
            fn write(&mut self, value: u64, _: Unit) {
                *self = <$t>::try_from(value).unwrap_or(<$t>::MAX);
            }
        }
    )*};
}
stored_integer!(u16, u32, u64, usize);

/// An optional count: `None` is unset (nothing to check).
impl Stored for Option<usize> {
    fn read(&self, unit: Unit) -> Option<u128> {
        self.as_ref().and_then(|n| n.read(unit))
    }
    fn write(&mut self, value: u64, unit: Unit) {
        self.get_or_insert(0).write(value, unit);
    }
}

/// An optional byte count: `None` is unset (nothing to check).
impl Stored for Option<u64> {
    fn read(&self, unit: Unit) -> Option<u128> {
        self.as_ref().and_then(|n| n.read(unit))
    }
    fn write(&mut self, value: u64, unit: Unit) {
        self.get_or_insert(0).write(value, unit);
    }
}

impl Stored for Duration {
    fn read(&self, unit: Unit) -> Option<u128> {
        Some(unit.of_duration(*self))
    }
    fn write(&mut self, value: u64, unit: Unit) {
        *self = unit.to_duration(value);
    }
}

/// An optional limit whose `None` is written `0` (`--slot-busy-timeout-s 0` waits forever).
impl Stored for Option<Duration> {
    fn read(&self, unit: Unit) -> Option<u128> {
        Some(self.map_or(0, |d| unit.of_duration(d)))
    }
    fn write(&mut self, value: u64, unit: Unit) {
        *self = (value > 0).then(|| unit.to_duration(value));
    }
}

/// A retention: off is written `0`.
impl Stored for Retention {
    fn read(&self, unit: Unit) -> Option<u128> {
        Some(self.age().map_or(0, |d| unit.of_duration(d)))
    }
    fn write(&mut self, value: u64, unit: Unit) {
        *self = Retention::after(unit.to_duration(value));
    }
}

/// Where a setting lives in [`RunSettings`].
pub type Field = for<'a> fn(&'a mut RunSettings) -> &'a mut dyn Stored;

/// One numeric or duration setting: its name, unit, range, default, doc and field.
#[derive(Debug)]
pub struct NumericSetting {
    /// The long flag, e.g. `--max-in-flight` (its variable is
    /// [`crate::validation::env_of`] of it, its config key the flag with `_` for `-`).
    pub flag: &'static str,
    /// What it counts.
    pub unit: Unit,
    /// The smallest accepted value, in `unit`'s steps.
    pub min: u64,
    /// The largest accepted value, in `unit`'s steps.
    pub max: u64,
    /// The default, in `unit`'s steps; `None` when unset by default.
    pub default: Option<u64>,
    /// The doc `--help` shows, without the range (added by [`NumericSetting::help`]) and
    /// without a final period.
    pub doc: &'static str,
    /// Said after a refused value's range (what `0` means, why the bound): `None` for
    /// nothing.
    pub note: Option<&'static str>,
    /// Its field in [`RunSettings`].
    pub field: Field,
    /// [`NumericSetting::default_text`], made once.
    default_text: OnceLock<String>,
}

impl NumericSetting {
    /// The accepted range as written in `--help` and the reference: `1 to 1000000
    /// messages`, `1s to 1d`.
    pub fn range_text(&self) -> String {
        let text = format!(
            "{} to {} {}",
            self.unit.render(self.min.into()),
            self.unit.render(self.max.into()),
            self.unit.label()
        );
        text.trim_end().to_owned()
    }

    /// The `--help` text: the doc and the range.
    pub fn help(&self) -> String {
        format!("{} ({})", self.doc, self.range_text())
    }

    /// The default as written on the command line (`10000`, `5m`), for clap's
    /// `default_value`; empty when there is none (such an option has no `default_value`).
    pub fn default_text(&'static self) -> &'static str {
        self.default_text.get_or_init(|| {
            self.default
                .map(|d| self.unit.render(d.into()))
                .unwrap_or_default()
        })
    }

    /// Checks the setting's value in `settings` against the range.
    ///
    /// # Errors
    /// [`ValidationError`] naming the flag, the value as the operator writes it, and the
    /// range.
    pub fn check(&self, settings: &mut RunSettings) -> Result<(), ValidationError> {
        let Some(value) = (self.field)(settings).read(self.unit) else {
            return Ok(());
        };
        if (u128::from(self.min)..=u128::from(self.max)).contains(&value) {
            return Ok(());
        }
        Err(ValidationError {
            setting: self.flag,
            value: self.unit.render(value),
            rule: match self.note {
                Some(note) => format!("must be from {} ({note})", self.range_text()),
                None => format!("must be from {}", self.range_text()),
            },
        })
    }

    /// A clap value parser for a whole-number option (digits only) of type `T`: what
    /// is not a whole number is refused naming the form and the range; the range itself is
    /// checked by [`RunSettings::validate`] (so a value from the command line, a variable,
    /// a config file or code is refused the same way).
    pub fn whole_number<T: std::str::FromStr>(
        &'static self,
    ) -> impl Fn(&str) -> Result<T, String> + Clone + Send + Sync + 'static {
        move |text: &str| {
            let fix = || {
                format!(
                    "write digits only (no sign, unit, decimal point or separator), {}",
                    self.range_text()
                )
            };
            if text.is_empty() || !text.bytes().all(|b| b.is_ascii_digit()) {
                return Err(format!("{text:?} is not a whole number: {}", fix()));
            }
            text.parse()
                .map_err(|_| format!("{text:?} is far too large: {}", fix()))
        }
    }

    /// A clap value parser for a [`Unit::Duration`] option: humantime's syntax; the range
    /// is checked by [`RunSettings::validate`].
    pub fn duration(
        &'static self,
    ) -> impl Fn(&str) -> Result<Duration, String> + Clone + Send + Sync + 'static {
        move |text: &str| {
            humantime::parse_duration(text.trim()).map_err(|e| {
                format!(
                    "{e}: write a duration from {}, such as {}",
                    self.range_text(),
                    self.default_text()
                )
            })
        }
    }
}

/// The setting constructor of this table (`default_text` is private).
const fn setting(
    flag: &'static str,
    unit: Unit,
    (min, max): (u64, u64),
    default: Option<u64>,
    doc: &'static str,
    note: Option<&'static str>,
    field: Field,
) -> NumericSetting {
    NumericSetting {
        flag,
        unit,
        min,
        max,
        default,
        doc,
        note,
        field,
        default_text: OnceLock::new(),
    }
}

/// Milliseconds of a duration const, for this table (every one fits).
const fn ms(d: Duration) -> u64 {
    d.as_millis() as u64
}

// PostgreSQL.

/// `--slot-busy-timeout-s`.
pub static SLOT_BUSY_TIMEOUT_S: NumericSetting = setting(
    "--slot-busy-timeout-s",
    Unit::Seconds,
    (0, SLOT_BUSY_TIMEOUT_CAP.as_secs()),
    Some(DEFAULT_SLOT_BUSY_TIMEOUT.as_secs()),
    "Seconds to keep retrying a slot held by another process before exiting; 0 waits \
     forever as a standby",
    Some("0 waits forever"),
    |s| &mut s.postgres.slot_busy_timeout,
);

/// `--standby-poll-ms`.
pub static STANDBY_POLL_MS: NumericSetting = setting(
    "--standby-poll-ms",
    Unit::Milliseconds,
    (ms(MIN_STANDBY_POLL), ms(STANDBY_POLL_CAP)),
    Some(ms(DEFAULT_STANDBY_POLL)),
    "Milliseconds between two looks of a standby at the slot's holder \
     (pg_replication_slots): START_REPLICATION is tried within one poll after the slot is \
     free. Jittered down by up to a fifth so standbys do not poll in step",
    None,
    |s| &mut s.postgres.standby_poll,
);

/// `--journal-retention`.
pub static JOURNAL_RETENTION: NumericSetting = setting(
    "--journal-retention",
    Unit::Duration,
    (0, ms(RETENTION_CAP)),
    Some(ms(DEFAULT_RETENTION)),
    "Delete outbox.journal rows confirmed longer ago than this: a duration such as 7d, \
     12h, 30m, or 0 to keep them all",
    Some("0 keeps every row"),
    |s| &mut s.postgres.retention.journal,
);

/// `--idempotency-retention`.
pub static IDEMPOTENCY_RETENTION: NumericSetting = setting(
    "--idempotency-retention",
    Unit::Duration,
    (0, ms(RETENTION_CAP)),
    Some(ms(DEFAULT_RETENTION)),
    "Delete outbox.idempotency keys older than this (7d, 12h, 30m; 0 keeps them): after \
     it, a retried emit with the same key emits again",
    Some("0 keeps every row"),
    |s| &mut s.postgres.retention.idempotency,
);

/// `--maintenance-interval`.
pub static MAINTENANCE_INTERVAL: NumericSetting = setting(
    "--maintenance-interval",
    Unit::Duration,
    (ms(MAINTENANCE_INTERVAL_MIN), ms(MAINTENANCE_INTERVAL_MAX)),
    Some(ms(DEFAULT_MAINTENANCE_INTERVAL)),
    "How often the retention task deletes expired keys and journal rows (first once the \
     pre-flight checks passed), in batches of 1000 with a pause between: a duration such \
     as 5m",
    None,
    |s| &mut s.postgres.retention.interval,
);

// RabbitMQ.

/// `--partitions`.
pub static PARTITIONS: NumericSetting = setting(
    "--partitions",
    Unit::Count("partitions"),
    (1, MAX_PARTITIONS as u64),
    Some(1),
    "Publish over this many AMQP connections, each with its own channel and confirm \
     window; every message goes to the partition of its key (--partition-key), so one \
     key's messages stay in commit order while different keys go side by side. With \
     several --amqp-url nodes, partition i starts at node i mod the number of nodes. The \
     window (--max-in-flight) bounds all partitions together. 1: one connection, exactly \
     as without partitions",
    None,
    |s| &mut s.broker.partitions.count,
);

/// `--stream-max-length-bytes`.
pub static STREAM_MAX_LENGTH_BYTES: NumericSetting = setting(
    "--stream-max-length-bytes",
    Unit::Count("bytes"),
    (1, i64::MAX as u64),
    None,
    "With --stream: the stream's maximum size in bytes when run creates it (RabbitMQ's \
     x-max-length-bytes; the oldest segments go first). Unset: no limit",
    None,
    |s| &mut s.broker.stream_max_length_bytes,
);

// Pipeline bounds.

/// `--max-in-flight`.
pub static MAX_IN_FLIGHT: NumericSetting = setting(
    "--max-in-flight",
    Unit::Count("messages"),
    (1, MAX_IN_FLIGHT_CAP as u64),
    Some(DEFAULT_MAX_IN_FLIGHT as u64),
    "Window: outbox messages read and not yet acknowledged to Postgres (unconfirmed, or \
     confirmed behind an earlier unconfirmed one). A transaction is acknowledged whole, so \
     one larger than the window is still read to its end",
    None,
    |s| &mut s.bounds.max_in_flight,
);

/// `--max-in-flight-bytes`.
pub static MAX_IN_FLIGHT_BYTES: NumericSetting = setting(
    "--max-in-flight-bytes",
    Unit::Count("bytes"),
    (1, MAX_IN_FLIGHT_BYTES_CAP as u64),
    Some(DEFAULT_MAX_IN_FLIGHT_BYTES as u64),
    "Window: bytes (logical message content) read and not yet acknowledged to Postgres",
    None,
    |s| &mut s.bounds.max_in_flight_bytes,
);

/// `--max-message-bytes`.
pub static MAX_MESSAGE_BYTES: NumericSetting = setting(
    "--max-message-bytes",
    Unit::Count("bytes"),
    (1, MAX_MESSAGE_BYTES_CAP as u64),
    Some(DEFAULT_MAX_MESSAGE_BYTES as u64),
    "Messages larger than this many bytes are dead-lettered as too_large, never \
     published. The size counted is the whole envelope as emitted: the payload plus its \
     JSON header (id, topic, content type, producer headers) and 5 bytes of framing",
    None,
    |s| &mut s.bounds.max_message_bytes,
);

/// `--broker-max-message-bytes`.
pub static BROKER_MAX_MESSAGE_BYTES: NumericSetting = setting(
    "--broker-max-message-bytes",
    Unit::Count("bytes"),
    (1, MAX_MESSAGE_BYTES_CAP as u64),
    None,
    "The broker's max_message_size in bytes, if known: payloads larger than this are \
     dead-lettered as too_large without publishing. Unset: pgoutbox learns the limit the \
     first time RabbitMQ refuses a message for its size (406, channel closed). At most \
     RabbitMQ's own ceiling",
    None,
    |s| &mut s.bounds.broker_max_message_bytes,
);

/// `--max-attempts`.
pub static MAX_ATTEMPTS: NumericSetting = setting(
    "--max-attempts",
    Unit::Count("attempts"),
    (1, MAX_ATTEMPTS_CAP as u64),
    Some(DEFAULT_MAX_ATTEMPTS as u64),
    "Publish attempts for a nacked message before it is dead-lettered",
    None,
    |s| &mut s.bounds.max_attempts,
);

/// `--read-coalesce-us`.
pub static READ_COALESCE_US: NumericSetting = setting(
    "--read-coalesce-us",
    Unit::Microseconds,
    (0, MAX_READ_COALESCE.as_micros() as u64),
    Some(DEFAULT_READ_COALESCE.as_micros() as u64),
    "Microseconds between two small reads of the replication stream while 4 or more \
     publishes are unconfirmed: one read (and one publish batch) per interval instead of \
     one per transaction. Adds up to this much latency (plus the timer's 1 ms resolution) \
     for fewer wake-ups; the default 0 reads every transaction as it arrives",
    Some("it delays every small read, and with it the replies to the server's keepalives"),
    |s| &mut s.bounds.read_coalesce,
);

/// `--shutdown-timeout-s`.
pub static SHUTDOWN_TIMEOUT_S: NumericSetting = setting(
    "--shutdown-timeout-s",
    Unit::Seconds,
    (0, SHUTDOWN_TIMEOUT_CAP.as_secs()),
    Some(DEFAULT_SHUTDOWN_TIMEOUT.as_secs()),
    "Seconds a SIGINT/SIGTERM waits for outstanding confirms",
    None,
    |s| &mut s.bounds.shutdown_timeout,
);

/// `--postgres-loss-drain-ms`.
pub static POSTGRES_LOSS_DRAIN_MS: NumericSetting = setting(
    "--postgres-loss-drain-ms",
    Unit::Milliseconds,
    (0, ms(POSTGRES_LOSS_DRAIN_CAP)),
    Some(ms(DEFAULT_POSTGRES_LOSS_DRAIN)),
    "Milliseconds to keep collecting broker confirms after the Postgres connection broke, \
     so messages the broker already has are not sent again after the reconnect; it ends \
     early once nothing is unconfirmed",
    None,
    |s| &mut s.bounds.postgres_loss_drain,
);

/// `--reconnect-backoff-max-ms`.
pub static RECONNECT_BACKOFF_MAX_MS: NumericSetting = setting(
    "--reconnect-backoff-max-ms",
    Unit::Milliseconds,
    (ms(RECONNECT_BACKOFF_MAX_MIN), ms(RECONNECT_BACKOFF_MAX_CAP)),
    Some(ms(DEFAULT_RECONNECT_BACKOFF_MAX)),
    "Longest wait in milliseconds between two reconnect attempts: the backoff doubles \
     from 500 ms up to it, with jitter, and starts over after a session that streamed",
    None,
    |s| &mut s.bounds.reconnect_backoff_max,
);

// Observability.

/// `--stall-after-s`.
pub static STALL_AFTER_S: NumericSetting = setting(
    "--stall-after-s",
    Unit::Seconds,
    (1, MAX_STALL_AFTER.as_secs()),
    Some(DEFAULT_STALL_AFTER.as_secs()),
    "Seconds without any settle, while messages are unconfirmed, after which the stream \
     counts as stalled (/readyz 503 \"stalled\", a warning once a minute)",
    None,
    |s| &mut s.observability.stall_after,
);

/// Every numeric and duration setting of `run`, in `--help` order: what
/// [`RunSettings::validate`] checks, the tests enumerate, and the reference shows.
pub static NUMERIC_SETTINGS: &[&NumericSetting] = &[
    &SLOT_BUSY_TIMEOUT_S,
    &STANDBY_POLL_MS,
    &JOURNAL_RETENTION,
    &IDEMPOTENCY_RETENTION,
    &MAINTENANCE_INTERVAL,
    &PARTITIONS,
    &STREAM_MAX_LENGTH_BYTES,
    &MAX_IN_FLIGHT,
    &MAX_IN_FLIGHT_BYTES,
    &MAX_MESSAGE_BYTES,
    &BROKER_MAX_MESSAGE_BYTES,
    &MAX_ATTEMPTS,
    &READ_COALESCE_US,
    &SHUTDOWN_TIMEOUT_S,
    &POSTGRES_LOSS_DRAIN_MS,
    &RECONNECT_BACKOFF_MAX_MS,
    &STALL_AFTER_S,
];

/// The numeric setting named `flag` (`--max-in-flight`), if it is one.
pub fn by_flag(flag: &str) -> Option<&'static NumericSetting> {
    NUMERIC_SETTINGS.iter().copied().find(|s| s.flag == flag)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_render_in_their_largest_whole_unit_and_parse_back() {
        let d = Unit::Duration;
        for (ms, text) in [
            (0, "0"),
            (1_500, "1500ms"),
            (1_000, "1s"),
            (300_000, "5m"),
            (5_400_000, "90m"),
            (86_400_000, "1d"),
            (604_800_000, "7d"),
        ] {
            assert_eq!(d.render(ms), text);
            assert_eq!(
                humantime::parse_duration(text).unwrap(),
                Duration::from_millis(ms as u64)
            );
        }
        assert_eq!(Unit::Seconds.render(5), "5");
        assert_eq!(
            Unit::Microseconds.to_duration(u64::MAX).as_micros(),
            u128::from(u64::MAX)
        );
        assert_eq!(Unit::Seconds.to_duration(u64::MAX).as_secs(), u64::MAX);
    }

    #[test]
    fn each_flag_is_in_the_table_once_with_a_default_in_range() {
        let mut flags: Vec<&str> = NUMERIC_SETTINGS.iter().map(|s| s.flag).collect();
        flags.sort_unstable();
        flags.dedup();
        assert_eq!(flags.len(), NUMERIC_SETTINGS.len());
        for s in NUMERIC_SETTINGS {
            assert!(s.min <= s.max, "{}", s.flag);
            if let Some(d) = s.default {
                assert!((s.min..=s.max).contains(&d), "{} default {d}", s.flag);
            }
            assert!(!s.doc.ends_with('.') && !s.doc.is_empty(), "{}", s.flag);
            assert!(by_flag(s.flag).is_some_and(|b| std::ptr::eq(b, *s)));
        }
        assert_eq!(PARTITIONS.range_text(), "1 to 64 partitions");
        assert_eq!(MAINTENANCE_INTERVAL.range_text(), "1s to 1d");
        assert_eq!(MAINTENANCE_INTERVAL.default_text(), "5m");
        assert_eq!(JOURNAL_RETENTION.default_text(), "7d");
        assert_eq!(BROKER_MAX_MESSAGE_BYTES.default_text(), "");
        assert!(by_flag("--slot").is_none());
    }

    #[test]
    fn the_parsers_take_digits_only_and_name_the_range() {
        let p = MAX_ATTEMPTS.whole_number::<u32>();
        assert_eq!(p("7"), Ok(7));
        // The range is not the parser's: validate names the setting and its variable.
        assert_eq!(p("0"), Ok(0));
        for bad in ["", "-1", "1e3", "1_000", " 5"] {
            let e = p(bad).unwrap_err();
            assert!(
                e.contains("is not a whole number") && e.contains("1 to 1000 attempts"),
                "{bad}: {e}"
            );
        }
        assert!(p("4294967296").unwrap_err().contains("far too large"));
        let d = MAINTENANCE_INTERVAL.duration();
        assert_eq!(d(" 5m "), Ok(Duration::from_secs(300)));
        let e = d("5 fortnights").unwrap_err();
        assert!(e.contains("1s to 1d") && e.contains("such as 5m"), "{e}");
    }
}
