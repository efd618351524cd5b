//! The counters of `run` (`*_total`): publishes, confirms, nacks, returns, retries, dead
//! letters by reason, reconnects by cause, sessions, journal rows, retention deletes. The
//! loop's own totals are synced once per turn ([`Counters::sync_turn`]); the rest count
//! events as they happen.

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::registry::Registry;

use super::{
    Turn, JOURNAL_DROP_REASONS, JOURNAL_ROWS_DROPPED_TOTAL, JOURNAL_ROWS_WRITTEN_TOTAL,
    LOG_LINES_DROPPED_TOTAL, MESSAGES_CONFIRMED_TOTAL, MESSAGES_DEAD_LETTERED_TOTAL,
    MESSAGES_NACKED_TOTAL, MESSAGES_PUBLISHED_TOTAL, MESSAGES_RETRIED_TOTAL,
    MESSAGES_RETURNED_TOTAL, RECONNECTS_TOTAL, RECONNECT_CAUSES, RETENTION_ROWS_DELETED_TOTAL,
    RETENTION_TABLES, SESSIONS_STARTED_TOTAL,
};
use crate::contract::dead_letter_reason;

/// A counter with one label.
type Labelled = Family<[(&'static str, &'static str); 1], Counter>;

/// Registers under the name without the suffix the encoder appends (`_total`, `_info`).
pub(super) fn base_name<'a>(name: &'a str, suffix: &str) -> &'a str {
    name.strip_suffix(suffix).unwrap_or(name)
}

/// Every counter; clones share the values.
#[derive(Debug, Default)]
pub struct Counters {
    published: Counter,
    confirmed: Counter,
    nacked: Counter,
    returned: Counter,
    retried: Counter,
    dead_lettered: Labelled,
    reconnects: Labelled,
    sessions: Counter,
    log_dropped: Counter,
    journal_written: Counter,
    journal_dropped: Labelled,
    retention_deleted: Labelled,
    stream: StreamCounters,
}

/// The counters `run --stream`'s publisher moves itself (a handle: clones count into the same
/// series).
#[derive(Debug, Clone, Default)]
pub struct StreamCounters {
    skipped: Counter,
    errors: Labelled,
}

impl StreamCounters {
    /// `n` messages were counted as stored without being sent
    /// ([`super::STREAM_SKIPPED_AT_START_TOTAL`]).
    pub fn skipped(&self, n: u64) {
        self.skipped.inc_by(n);
    }

    /// A publish error with `code` (one of [`super::STREAM_ERROR_CODES`]; another value
    /// counts as `other`).
    pub fn publish_error(&self, code: &'static str) {
        let code = if super::STREAM_ERROR_CODES.contains(&code) {
            code
        } else {
            "other"
        };
        self.errors.get_or_create(&[("code", code)]).inc();
    }
}

impl Counters {
    /// Registers every counter in `registry`, with every label value at 0 from the start
    /// (a query sees the series before its first event, and the reference lists them).
    pub fn register(&self, registry: &mut Registry) {
        let total = |n| base_name(n, "_total");
        let zero = |family: &Labelled, label, values: &[&'static str]| {
            for value in values {
                let _ = family.get_or_create(&[(label, *value)]);
            }
        };
        let reasons: Vec<&'static str> = dead_letter_reason::ALL.iter().map(|(r, _)| *r).collect();
        zero(&self.dead_lettered, "reason", &reasons);
        zero(&self.reconnects, "cause", RECONNECT_CAUSES);
        zero(&self.journal_dropped, "reason", JOURNAL_DROP_REASONS);
        zero(&self.retention_deleted, "table", RETENTION_TABLES);
        zero(&self.stream.errors, "code", super::STREAM_ERROR_CODES);
        registry.register(
            total(MESSAGES_PUBLISHED_TOTAL),
            "Publishes made (every attempt: first publishes, retries, re-sends after a reconnect)",
            self.published.clone(),
        );
        registry.register(
            total(MESSAGES_CONFIRMED_TOTAL),
            "Messages confirmed by the broker as routed",
            self.confirmed.clone(),
        );
        registry.register(
            total(MESSAGES_NACKED_TOTAL),
            "Publishes nacked by the broker",
            self.nacked.clone(),
        );
        registry.register(
            total(MESSAGES_RETURNED_TOTAL),
            "Publishes returned as unroutable",
            self.returned.clone(),
        );
        registry.register(
            total(MESSAGES_DEAD_LETTERED_TOTAL),
            "Messages written to outbox.dead_letter, by reason",
            self.dead_lettered.clone(),
        );
        registry.register(
            total(MESSAGES_RETRIED_TOTAL),
            "Publishes that retried a nacked or returned message",
            self.retried.clone(),
        );
        registry.register(
            total(RECONNECTS_TOTAL),
            "Retryable failures the process reconnected after, by cause: a session that ended or a connection attempt that failed (each retry counts)",
            self.reconnects.clone(),
        );
        registry.register(
            total(SESSIONS_STARTED_TOTAL),
            "Sessions that started streaming",
            self.sessions.clone(),
        );
        registry.register(
            total(LOG_LINES_DROPPED_TOTAL),
            "Log lines dropped because stderr did not take them (a full queue of the log's writer)",
            self.log_dropped.clone(),
        );
        registry.register(
            total(JOURNAL_ROWS_WRITTEN_TOTAL),
            "Rows written to outbox.journal (run --journal)",
            self.journal_written.clone(),
        );
        registry.register(
            total(JOURNAL_ROWS_DROPPED_TOTAL),
            "Journal rows dropped (never written), by reason",
            self.journal_dropped.clone(),
        );
        registry.register(
            total(RETENTION_ROWS_DELETED_TOTAL),
            "Rows deleted by the retention task, by table",
            self.retention_deleted.clone(),
        );
        registry.register(
            total(super::STREAM_SKIPPED_AT_START_TOTAL),
            "Messages run --stream counted as confirmed without sending them: the broker had stored their publishing ids already (deduplication at start)",
            self.stream.skipped.clone(),
        );
        registry.register(
            total(super::STREAM_PUBLISH_ERRORS_TOTAL),
            "Publish errors of run --stream, by the stream protocol's code",
            self.stream.errors.clone(),
        );
    }

    /// The handle of the stream publisher's counters.
    pub fn stream(&self) -> StreamCounters {
        self.stream.clone()
    }

    /// The loop's process-wide totals of one turn: each counter moves up to its total.
    pub fn sync_turn(&self, turn: &Turn) {
        fn sync(c: &Counter, total: u64) {
            let cur = c.get();
            if total > cur {
                c.inc_by(total - cur);
            }
        }
        sync(&self.published, turn.published);
        sync(&self.retried, turn.retried);
        sync(&self.confirmed, turn.confirmed);
    }

    /// Raises the dropped log lines' counter to `dropped`, the count so far.
    pub fn sync_log_drops(&self, dropped: u64) {
        let seen = self.log_dropped.get();
        if dropped > seen {
            self.log_dropped.inc_by(dropped - seen);
        }
    }

    /// A session started streaming.
    pub fn session_started(&self) {
        self.sessions.inc();
    }

    /// A session ended with a retryable failure of `cause`.
    pub fn reconnect(&self, cause: &'static str) {
        debug_assert!(
            RECONNECT_CAUSES.contains(&cause),
            "{cause}: add it to RECONNECT_CAUSES"
        );
        self.reconnects.get_or_create(&[("cause", cause)]).inc();
    }

    /// `rows` journal rows were written.
    pub fn journal_written(&self, rows: u64) {
        self.journal_written.inc_by(rows);
    }

    /// `rows` journal rows were dropped for `reason`.
    pub fn journal_dropped(&self, reason: &'static str, rows: u64) {
        debug_assert!(
            JOURNAL_DROP_REASONS.contains(&reason),
            "{reason}: add it to JOURNAL_DROP_REASONS"
        );
        self.journal_dropped
            .get_or_create(&[("reason", reason)])
            .inc_by(rows);
    }

    /// The retention task deleted `rows` rows of `table`.
    pub fn retention_deleted(&self, table: &'static str, rows: u64) {
        debug_assert!(
            RETENTION_TABLES.contains(&table),
            "{table}: add it to RETENTION_TABLES"
        );
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
        debug_assert!(
            dead_letter_reason::ALL.iter().any(|(r, _)| *r == reason),
            "{reason}: add it to contract::dead_letter_reason::ALL"
        );
        self.dead_lettered
            .get_or_create(&[("reason", reason)])
            .inc();
    }
}
