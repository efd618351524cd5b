//! Everything pgoutbox does over ordinary SQL (tokio-postgres), by concept:
//! - [`provisioning`]: `setup` and `teardown`, and the server checks they make;
//! - [`inspection`]: the slot's state and health (`status`), the messages waiting in it
//!   (`peek`), the pre-flight checks `run` makes before it
//!   takes the slot (including the privileges it needs to write dead letters), and the outbox
//!   messages a slot still holds;
//! - [`dead_letters`]: `outbox.dead_letter`: the streamer's writes, and the `dead-letters`
//!   commands (list, requeue, purge);
//! - [`lockdown`]: `setup --lockdown` / `--unlock` and the lockdown record;
//! - [`journal`]: `outbox.journal`, the delivery journal (`run --journal`, `pgoutbox journal`);
//! - [`failover`]: what a failover of the primary needs (failover slots, PostgreSQL 17+),
//!   on the primary and on a standby (`check`, `status`, `run`'s start);
//! - [`server`]: what the server offers (`wal_level`, `REPLICATION`, the publication);
//! - [`retention`]: deleting expired idempotency keys, journal rows and inbox records in
//!   small batches (`run`'s retention task, `pgoutbox maintenance`).
//!
//! The connections themselves are made by [`crate::postgres`] (below this module, and the
//! pipeline's and `check`'s too).

pub mod dead_letters;
pub mod failover;
pub mod inspection;
pub mod journal;
pub mod lockdown;
pub mod provisioning;
pub mod retention;
pub mod server;

pub use dead_letters::{
    list_dead_letters, purge_dead_letters, requeue_dead_letters, write_dead_letter, DeadLetter,
    NewDeadLetter, RequeueRefusal, Selection,
};
pub use inspection::{
    background_grants, check_background_privileges, check_dead_letter_privileges,
    confirmed_flush_lsn, count_waiting, dead_letter_grants, health, peek_waiting,
    pending_outbox_messages, preflight, schema_flag, slot_retention, slot_status, HealthReport,
    LagThresholds, PayloadEncoding, Payloads, PeekReport, Problem, Severity, SlotRetention,
    SlotStatus, WaitingCount, WaitingEnvelope, WaitingMessage,
};
pub use lockdown::{lock, lockdown_state, require_default_schema, unlock, LockdownState};
pub use provisioning::{
    create_roles, outbox_installed, outboxes, resolve_prefix, setup, stored_prefix, teardown,
    Force, RolesReport, SetupReport, TeardownReport, DEFAULT_PRODUCER_ROLE, DEFAULT_STREAMER_ROLE,
};
pub use server::{check_replication_role, check_wal_level, publication_exists};

/// The producer helpers, installed by `setup` (idempotent).
pub const OUTBOX_SQL: &str = include_str!("../../sql/outbox.sql");
