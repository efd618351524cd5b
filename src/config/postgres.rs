//! What `run` reads from PostgreSQL: the parsed connection string, the slot, the
//! publication, the outbox's schema and prefix, how a busy slot is waited for, whether a
//! gap in the slot's history is accepted, and the retention task's settings.

use std::time::Duration;

use super::database::DatabaseConfig;
use super::retention::RetentionSettings;
use crate::outbox_schema::{MessagePrefix, SchemaName};
use crate::validation::{validate_identifier, ValidationError};

/// Default slot name.
pub const DEFAULT_SLOT: &str = "pgoutbox";

/// Default publication name (an empty publication: logical messages need one to exist).
pub const DEFAULT_PUBLICATION: &str = "pgoutbox";

/// How long `run` keeps retrying a slot that another process holds before exiting; 0 means
/// forever (a standby replica). After a SIGKILL the old walsender can hold the slot until it
/// notices the closed socket, so a restart also waits here.
pub const DEFAULT_SLOT_BUSY_TIMEOUT: Duration = Duration::from_secs(0);

/// Default `--standby-poll-ms`: while another process holds the slot, a standby looks at
/// `pg_replication_slots` this often (each poll is one small catalog query on the ordinary
/// SQL connection) and tries `START_REPLICATION` as soon as the slot is free, so a takeover
/// comes within about one poll after the holder's walsender ended.
pub const DEFAULT_STANDBY_POLL: Duration = Duration::from_millis(1000);

/// Smallest accepted `--standby-poll-ms`: 10 ms (a catalog query per standby that often
/// still costs the server little).
pub const MIN_STANDBY_POLL: Duration = Duration::from_millis(10);

/// Largest accepted `--standby-poll-ms`: one minute (a longer poll makes the takeover
/// slower than the walsender timeout that usually bounds it).
pub const STANDBY_POLL_CAP: Duration = Duration::from_secs(60);

/// Largest accepted `--slot-busy-timeout-s`: 30 days. A bounded wait longer than that is a
/// standby in all but name (0 waits forever).
pub const SLOT_BUSY_TIMEOUT_CAP: Duration = Duration::from_secs(30 * 86_400);

/// The logical decoding message prefix of the default outbox's envelopes (another outbox
/// stores its own: [`crate::outbox_schema`]).
pub const MESSAGE_PREFIX: &str = crate::outbox_schema::DEFAULT_PREFIX;

/// The Postgres side of `run` (`--database-url` and its files, `--slot`, `--publication`,
/// `--schema`, `--prefix`, `--slot-busy-timeout-s`, `--standby-poll-ms`, `--accept-gap`,
/// the retention flags).
#[derive(Debug, Clone)]
pub struct PostgresSettings {
    /// The connection string, parsed (its database holds the slot; `Debug` shows no
    /// password).
    pub database: DatabaseConfig,
    /// Logical replication slot (pgoutput).
    pub slot: String,
    /// Publication named in `publication_names`.
    pub publication: String,
    /// The outbox's schema (`--schema`): where its dead letters, stream state and prefix
    /// setting live.
    pub schema: SchemaName,
    /// The logical-message prefix to publish (`--prefix`); `None`: the one `setup` stored
    /// in the schema's `settings` table (`pgoutbox` for schema `outbox` without one).
    pub prefix: Option<MessagePrefix>,
    /// How long to keep retrying a slot held by another process (`None`: forever).
    pub slot_busy_timeout: Option<Duration>,
    /// How often a standby polls the slot's holder (`--standby-poll-ms`, jittered down
    /// by up to a fifth).
    pub standby_poll: Duration,
    /// Start even when the slot's history has a gap (`--accept-gap`; see
    /// [`crate::stream_state`]): the gap is logged and recorded in `outbox.stream_state`.
    pub accept_gap: bool,
    /// What the background retention task deletes, and how often.
    pub retention: RetentionSettings,
}

impl PostgresSettings {
    /// Checks the slot and publication names (the connection string was checked when
    /// parsed; the timings and the retention, numeric settings, by
    /// [`super::RunSettings::validate`] from [`super::numeric`]).
    ///
    /// # Errors
    /// The first [`ValidationError`].
    pub fn validate(&self) -> Result<(), ValidationError> {
        validate_identifier("--slot", &self.slot)?;
        validate_identifier("--publication", &self.publication)
    }
}
