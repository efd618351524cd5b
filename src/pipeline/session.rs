//! One session's start: connect both sides, and what one session leaves to the next.
//!
//! In order: the SQL session (pre-flight checks, the background tasks' privileges,
//! `outbox.stream_state`, the outbox's prefix, the lockdown record), the dead-letter
//! writer, the sink ([`SinkChoice::connect`]), the replication stream (waiting as a
//! standby while another process holds the slot), the slot's `confirmed_flush_lsn`, and the
//! session's record in `outbox.stream_state`. Every wait is bounded or raced against
//! shutdown by the caller.
//!
//! What one session hands to the next ([`SessionMemory`]): the LSN it knows to be settled
//! (so a reconnect re-sends at most what was not confirmed), the broker's message size
//! limit once RabbitMQ revealed it by closing the channel, what other closes of the
//! publishing channel taught ([`super::refusal`]), the broker node to try first,
//! and how often the same WAL position failed to decode.

use std::time::Duration;

use super::admission::BrokerLimit;
use super::dead_letter::DeadLetterWriter;
use super::refusal::Refusals;
use super::sinks::{BrokerNodes, ConnectedSink, SinkChoice};
use super::standby::Standby;
use crate::admin;
use crate::config::RunConfig;
use crate::error::Error;
use crate::lockdown::Lockdown;
use crate::lsn::Lsn;
use crate::metrics::Telemetry;
use crate::outbox_schema::MessagePrefix;
use crate::replication::connect::{ReplicationConnection, SystemIdentity};
use crate::replication::session::ReplicationStream;
use crate::sink::Sink;
use crate::stream_publisher::ids;
use crate::stream_state::{self, FlushGate, RecordedHandle, SeenHistory};

/// How long closing the sink and the replication stream may take.
pub(super) const CLOSE_TIMEOUT: Duration = Duration::from_secs(2);
/// A frame that fails to decode this many times in a row at the same LSN is a definite
/// error: reconnecting will only read the same bytes again.
pub const DECODE_FAILURE_LIMIT: u32 = 3;

/// What one session leaves to the next.
#[derive(Debug, Default)]
pub(super) struct SessionMemory {
    /// The last LSN this process knows to be settled (`None` before the first session).
    /// Reused only while the server's history is the same ([`SeenHistory`]).
    pub resume: Option<Lsn>,
    /// The server's identity and the flush LSN recorded in the last session.
    pub seen: Option<SeenHistory>,
    /// The broker's `max_message_size` in bytes, from `--broker-max-message-bytes` or learned
    /// from a channel close (406 PRECONDITION_FAILED, "message size N is larger than
    /// configured max size M"), with the broker's text.
    pub broker_limit: Option<BrokerLimit>,
    /// What closes of the publishing channel taught ([`super::refusal`]).
    pub refusals: Refusals,
    /// Messages not settled when the last session ended.
    pub unsettled_at_end: u64,
    /// The last session's stall clock when it ended with messages unsettled: the next
    /// session's stall goes on from there ([`super::feedback::StallWatch::stalled_since`]).
    pub stalled_since: Option<tokio::time::Instant>,
    /// When the last session started streaming (both sides connected); `None` when it
    /// failed before. Decides whether the reconnect backoff starts over.
    pub streaming_since: Option<tokio::time::Instant>,
    /// The broker's nodes and which one the next session tries first.
    pub nodes: BrokerNodes,
    /// What this process settled above the recorded flush LSN: the next session resumes
    /// from the record and does not send those again ([`super::delivered`]).
    pub delivered: super::delivered::Delivered,
    /// The LSN of the last frame that failed to decode, and how many sessions in a row
    /// failed there.
    decode_failures: Option<(Lsn, u32)>,
}

impl SessionMemory {
    /// What the first session starts with: the broker's size limit when configured, and
    /// the broker's nodes in the order they are tried.
    pub fn new(broker_limit: Option<BrokerLimit>, nodes: BrokerNodes) -> Self {
        SessionMemory {
            broker_limit,
            nodes,
            ..SessionMemory::default()
        }
    }

    /// What a session's end leaves for the next one's start: it resumes from the record,
    /// not the watermark (`flushed`), when the watermark is ahead of it (the record's
    /// slack, confirms collected after PostgreSQL went away): a database restored
    /// meanwhile may hold other transactions in that range. What this process settled
    /// there (`delivered`) is not sent again ([`super::delivered`]). Call after `seen` is
    /// set.
    pub fn resume_after(&mut self, flushed: Lsn, delivered: super::delivered::Delivered) {
        let resume = self
            .seen
            .as_ref()
            .map_or(flushed, |seen| flushed.min(seen.recorded));
        self.resume = Some(resume);
        self.delivered = delivered;
        if !self.delivered.is_empty() {
            tracing::debug!(
                resume_lsn = %resume,
                settled_above = self.delivered.len(),
                "the next session resumes from the recorded flush LSN; the messages settled above it are not sent again"
            );
        }
    }

    /// Counts the failures that reading the same WAL again repeats (a frame that does not
    /// decode, [`Error::Decode`]; a frame that breaks the transaction order,
    /// [`Error::StreamOrder`]) at one LSN across sessions; the [`DECODE_FAILURE_LIMIT`]th
    /// in a row becomes definite ([`Error::UndecodableWal`],
    /// [`Error::StreamOrderRepeated`]). Any other outcome resets the count.
    pub fn note_decode_failure(&mut self, error: Error) -> Error {
        let lsn = match &error {
            Error::Decode { lsn, .. } | Error::StreamOrder { lsn, .. } => *lsn,
            _ => {
                self.decode_failures = None;
                return error;
            }
        };
        let count = match self.decode_failures {
            Some((at, n)) if at == lsn => n + 1,
            _ => 1,
        };
        self.decode_failures = Some((lsn, count));
        if count < DECODE_FAILURE_LIMIT {
            return error;
        }
        match error {
            Error::Decode { reason, .. } => Error::UndecodableWal {
                lsn,
                attempts: count,
                reason,
            },
            Error::StreamOrder { source, .. } => Error::StreamOrderRepeated {
                lsn,
                attempts: count,
                reason: source.to_string(),
            },
            other => other,
        }
    }
}

/// Both connections and the sink, ready to stream.
pub(super) struct Connected {
    pub stream: ReplicationStream,
    pub interval: Duration,
    pub sink: Box<dyn Sink>,
    /// The broker node of each of the sink's connections, partition 0 first (into
    /// [`BrokerNodes::urls`]).
    pub nodes: Vec<usize>,
    pub dead_letters: DeadLetterWriter,
    pub start: Lsn,
    pub lockdown: Lockdown,
    pub gate: FlushGate,
    pub recorded: RecordedHandle,
    pub identity: SystemIdentity,
    /// The prefix this session publishes ([`admin::resolve_prefix`]).
    pub prefix: MessagePrefix,
}

/// A started replication stream ([`start_stream`]).
struct Started {
    stream: ReplicationStream,
    /// The periodic status interval ([`status_interval`]).
    interval: Duration,
    identity: SystemIdentity,
    /// The position asked for ([`stream_state::start_hint`]).
    hint: Lsn,
    /// Where the server's timeline began (`TIMELINE_HISTORY`; `None` on timeline 1).
    switch_point: Option<Lsn>,
}

/// Connects the SQL session, runs the pre-flight checks (then turns `preflight_passed`
/// true), connects the dead-letter writer and the sink, and starts streaming.
///
/// # Errors
/// Whatever fails first; the replication stream is closed again when the session's record
/// cannot be written.
pub(super) async fn connect(
    config: &RunConfig,
    pg: &crate::config::DatabaseConfig,
    sinks: &SinkChoice,
    memory: &SessionMemory,
    telemetry: &Telemetry,
    preflight_passed: &tokio::sync::watch::Sender<bool>,
) -> Result<Connected, Error> {
    let sql = crate::postgres::connect(pg).await?;
    let prefix = prepare(&sql, config).await?;
    preflight_passed.send_if_modified(|passed| !std::mem::replace(passed, true));
    let application_name = format!("pgoutbox-{}", config.observability.instance_id);
    warn_if_synchronous_standby(&sql, &application_name).await;
    let lockdown = read_lockdown(&sql, config).await?;
    let dead_letters = DeadLetterWriter::connect(pg, &config.postgres.schema).await?;
    let (
        ConnectedSink {
            mut sink,
            mut nodes,
            stream_stored,
        },
        accepted_before,
    ) = connect_sink(config, &sql, sinks, memory).await?;
    let started = start_stream(
        config,
        pg,
        &sql,
        &application_name,
        memory,
        telemetry,
        &mut *sink,
    )
    .await?;
    let stream_check = stream_stored
        .as_ref()
        .map(|(stored, name)| (ids::commit_lsn_of(*stored), name.as_str()));
    let (
        started,
        Recorded {
            start,
            slot_lsn,
            gate,
            recorded,
            gap_accepted,
        },
    ) = record_start(config, sql, memory, started, stream_check).await?;
    if gap_accepted && config.broker.stream.is_some() {
        // A gap accepted just now starts a new producer name: the new history's ids are
        // never compared with what the old name stored.
        let name = config.stream_producer_name(accepted_before + 1);
        tracing::warn!(producer = %name, "a gap was accepted: the stream publisher starts a new producer name");
        let _ = tokio::time::timeout(CLOSE_TIMEOUT, sink.close()).await;
        let connected = sinks.connect(&memory.nodes, &name).await?;
        sink = connected.sink;
        nodes = connected.nodes;
    }
    log_streaming(
        config,
        &prefix,
        &lockdown,
        start,
        slot_lsn,
        started.interval,
    );
    Ok(Connected {
        stream: started.stream,
        interval: started.interval,
        sink,
        nodes,
        dead_letters,
        start,
        lockdown,
        gate,
        recorded,
        identity: started.identity,
        prefix,
    })
}

/// Connects the sink; for `run --stream`, with the producer name of the gaps accepted so far
/// (their count is the answer's second half).
async fn connect_sink(
    config: &RunConfig,
    sql: &tokio_postgres::Client,
    sinks: &SinkChoice,
    memory: &SessionMemory,
) -> Result<(ConnectedSink, usize), Error> {
    let accepted = if config.broker.stream.is_some() {
        stream_state::accepted_gap_count(sql, &config.postgres.schema, &config.postgres.slot)
            .await?
    } else {
        0
    };
    let connected = sinks
        .connect(&memory.nodes, &config.stream_producer_name(accepted))
        .await?;
    Ok((connected, accepted))
}

/// What [`record_start`] found and started.
struct Recorded {
    /// Where the session starts.
    start: Lsn,
    /// The slot's `confirmed_flush_lsn`.
    slot_lsn: Lsn,
    gate: FlushGate,
    recorded: RecordedHandle,
    /// A gap was accepted (`--accept-gap`) just now.
    gap_accepted: bool,
}

/// The gap rule and the session's record, once the slot is held: where the session starts,
/// the slot's `confirmed_flush_lsn`, the flush gate and the record's handle, and whether a gap
/// was accepted just now. Closes the replication stream when the record cannot be written.
async fn record_start(
    config: &RunConfig,
    sql: tokio_postgres::Client,
    memory: &SessionMemory,
    started: Started,
    stream_check: Option<(Lsn, &str)>,
) -> Result<(Started, Recorded), Error> {
    // We hold the slot now: nobody else can move confirmed_flush_lsn under us.
    let slot_lsn = admin::confirmed_flush_lsn(&sql, &config.postgres.slot).await?;
    let at = stream_state::SlotAt {
        confirmed_flush: slot_lsn,
        sync: stream_state::slot_sync(&sql, &config.postgres.slot).await?,
    };
    let server = stream_state::ServerHistory {
        identity: &started.identity,
        switch_point: started.switch_point,
        highest_seen: memory
            .seen
            .as_ref()
            .filter(|seen| seen.system_id == started.identity.system_id)
            .map(|seen| seen.highest_timeline),
    };
    let start = slot_lsn.max(started.hint);
    // start_hint gives 0/0 unless this process resumes its own history.
    let from = if started.hint == Lsn::ZERO {
        stream_state::StartFrom::Slot
    } else {
        stream_state::StartFrom::OwnResume(started.hint)
    };
    match stream_state::session_start(sql, config, &server, &at, start, from, stream_check).await {
        Ok((gate, recorded, gap_accepted)) => Ok((
            started,
            Recorded {
                start,
                slot_lsn,
                gate,
                recorded,
                gap_accepted,
            },
        )),
        Err(e) => {
            let _ = tokio::time::timeout(CLOSE_TIMEOUT, started.stream.close()).await;
            Err(e.into())
        }
    }
}

/// The SQL side's checks before anything streams: pre-flight, the background tasks'
/// privileges (warnings), `outbox.stream_state`; returns the outbox's prefix.
async fn prepare(sql: &tokio_postgres::Client, config: &RunConfig) -> Result<MessagePrefix, Error> {
    admin::preflight(
        sql,
        &config.postgres.schema,
        &config.postgres.slot,
        &config.postgres.publication,
    )
    .await?;
    let warnings = admin::check_background_privileges(
        sql,
        &config.postgres.schema,
        &config.postgres.slot,
        config.observability.journal == crate::config::JournalMode::On,
        config.postgres.retention.idempotency.age().is_some(),
        config.postgres.retention.journal.age().is_some(),
    )
    .await?;
    stream_state::ensure_table(sql, &config.postgres.schema).await?;
    let prefix = admin::resolve_prefix(
        sql,
        &config.postgres.schema,
        config.postgres.prefix.as_ref(),
    )
    .await?;
    // After every check that can fail: a warning never comes before the error to fix.
    for warning in warnings {
        tracing::warn!("{warning}");
    }
    if let Some(warning) = admin::failover::unguarded_warning(sql, &config.postgres.slot).await {
        tracing::warn!(slot = %config.postgres.slot, "{warning}");
    }
    Ok(prefix)
}

/// The lockdown record. Read before START_REPLICATION: a lockdown committed after this read
/// is decoded in the stream (its marker), one committed before it is in the record
/// (crate::lockdown). Lockdown is the default outbox's only (admin::require_default_schema):
/// another schema's streamer checks no emitter and ignores the markers.
async fn read_lockdown(
    sql: &tokio_postgres::Client,
    config: &RunConfig,
) -> Result<Lockdown, Error> {
    if !config.postgres.schema.is_default() {
        return Ok(Lockdown::from_record(None));
    }
    let lockdown_state = admin::lockdown_state(sql).await?;
    for weakness in &lockdown_state.weakened {
        tracing::error!("{}", admin::lockdown::weakened_text(weakness));
    }
    Ok(Lockdown::from_record(lockdown_state.since()))
}

/// The session's start line, with what it streams and from where.
fn log_streaming(
    config: &RunConfig,
    prefix: &MessagePrefix,
    lockdown: &Lockdown,
    start: Lsn,
    slot_lsn: Lsn,
    interval: Duration,
) {
    tracing::info!(
        slot = %config.postgres.slot,
        schema = %config.postgres.schema,
        prefix = %prefix,
        publication = %config.postgres.publication,
        exchange = %config.broker.exchange,
        allowed_exchanges = %config.broker.allowed_exchanges,
        no_declare = config.broker.exchange_declare == crate::config::ExchangeDeclare::Passive,
        start_lsn = %start,
        slot_confirmed_flush_lsn = %slot_lsn,
        status_interval_ms = interval.as_millis() as u64,
        max_in_flight = config.bounds.max_in_flight,
        max_in_flight_bytes = config.bounds.max_in_flight_bytes,
        lockdown_lsn = %lockdown.since().map(|l| l.to_string()).unwrap_or_else(|| "off".into()),
        "streaming"
    );
}

/// Warns when `synchronous_standby_names` could pick this streamer's walsender as a
/// synchronous standby: producers' commits would then wait for pgoutbox's flush LSN, which
/// waits for the broker. (pgoutbox's own dead-letter commits use `synchronous_commit =
/// local`, so they never wait on themselves.)
async fn warn_if_synchronous_standby(sql: &tokio_postgres::Client, application_name: &str) {
    let Ok(row) = sql.query_one("SHOW synchronous_standby_names", &[]).await else {
        return;
    };
    let names: String = row.get(0);
    if synchronous_names_may_select(&names, application_name) {
        tracing::warn!(
            synchronous_standby_names = %names,
            application_name,
            "synchronous_standby_names can select pgoutbox's walsender as a synchronous standby: commits would wait for the outbox to reach RabbitMQ. Name the physical standbys explicitly instead of '*'"
        );
    }
}

/// Whether a `synchronous_standby_names` value may name `application_name` (or `*`).
fn synchronous_names_may_select(names: &str, application_name: &str) -> bool {
    let names = names.trim();
    if names.is_empty() {
        return false;
    }
    names
        .split(|c: char| c == ',' || c == '(' || c == ')' || c.is_whitespace())
        .map(|n| n.trim().trim_matches('"'))
        .any(|n| n == "*" || n.eq_ignore_ascii_case(application_name))
}

/// Parses a PostgreSQL duration setting as `SHOW` prints it (`60s`, `1min`, `500ms`, `0`).
fn parse_pg_duration(text: &str) -> Option<Duration> {
    let text = text.trim();
    let split = text
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(text.len());
    let (num, unit) = text.split_at(split);
    let n: u64 = num.parse().ok()?;
    let ms = match unit.trim() {
        "" | "ms" => n,
        "s" => n.checked_mul(1000)?,
        "min" => n.checked_mul(60_000)?,
        "h" => n.checked_mul(3_600_000)?,
        "d" => n.checked_mul(86_400_000)?,
        _ => return None,
    };
    Some(Duration::from_millis(ms))
}

/// The periodic status interval for a server `wal_sender_timeout` (`None`: unknown or 0 =
/// disabled): a third of the timeout, at most [`crate::config::MAX_STATUS_INTERVAL`], at
/// least 100 ms.
fn status_interval(wal_sender_timeout: Option<Duration>) -> Duration {
    use crate::config::MAX_STATUS_INTERVAL;
    match wal_sender_timeout {
        Some(t) if !t.is_zero() => (t / 3).clamp(Duration::from_millis(100), MAX_STATUS_INTERVAL),
        _ => MAX_STATUS_INTERVAL,
    }
}

/// Opens the replication connection and starts streaming at `start` (the server starts at
/// the slot's confirmed_flush_lsn when that is further). While another process holds the
/// slot this process is a standby ([`super::standby`]): it polls the holder every
/// `--standby-poll-ms` and tries again as soon as the slot is free, for `slot_busy_timeout`
/// (forever when `None`), polling the connected `sink` meanwhile, so its heartbeats go on
/// (RabbitMQ drops a connection silent for two heartbeats). The caller races this against
/// shutdown.
async fn start_stream(
    config: &RunConfig,
    pg: &crate::config::DatabaseConfig,
    sql: &tokio_postgres::Client,
    application_name: &str,
    memory: &SessionMemory,
    telemetry: &Telemetry,
    sink: &mut dyn Sink,
) -> Result<Started, Error> {
    let mut standby = Standby::new(
        config.postgres.standby_poll,
        config.postgres.slot_busy_timeout,
        application_name,
    );
    let options = [
        ("proto_version", "1"),
        ("publication_names", config.postgres.publication.as_str()),
        ("messages", "true"),
    ];
    loop {
        let mut conn = ReplicationConnection::connect(pg, application_name).await?;
        let identity = conn.identify_system().await?;
        let timeout = conn
            .show("wal_sender_timeout")
            .await?
            .as_deref()
            .and_then(parse_pg_duration);
        tracing::debug!(system_id = %identity.system_id, timeline = identity.timeline, xlogpos = %identity.xlogpos, "identified system");
        // For the gap rule on a promoted server: a synchronized slot lies before it.
        let switch_point = conn.timeline_switch_point(identity.timeline).await?;
        // Before START_REPLICATION: a resume position from another history would make the
        // server skip the new history's commits below it.
        let start = stream_state::start_hint(
            sql,
            &config.postgres.schema,
            &config.postgres.slot,
            memory.resume,
            memory.seen.as_ref(),
            &identity,
        )
        .await?;
        match conn
            .start_logical_replication(&config.postgres.slot, start, &options)
            .await
        {
            Ok(stream) => {
                standby.leave(sql).await;
                return Ok(Started {
                    stream,
                    interval: status_interval(timeout),
                    identity,
                    hint: start,
                    switch_point,
                });
            }
            Err(e) if e.code() == Some(crate::replication::error::SQLSTATE_OBJECT_IN_USE) => {
                // Cancel safety: the standby's wait keeps nothing that a drop would lose
                // (its next round polls again); recv_settled is cancel safe.
                tokio::select! {
                    waited = standby.wait(sql, &config.postgres.slot, telemetry) => waited?,
                    lost = crate::sink::recv_settled(&mut *sink) => return Err(standby_sink_lost(lost)),
                }
            }
            // PostgreSQL 15: "can no longer get changes from replication slot" once
            // max_slot_wal_keep_size invalidated it.
            Err(e) if e.code() == Some("55000") => {
                return Err(Error::SlotLost {
                    slot: config.postgres.slot.clone(),
                    confirmed_flush_lsn: admin::slot_status(sql, &config.postgres.slot)
                        .await
                        .ok()
                        .and_then(|s| s.confirmed_flush_lsn)
                        .unwrap_or_else(|| e.to_string()),
                })
            }
            Err(e) => return Err(e.into()),
        }
    }
}

/// The sink failed (or, with nothing published, settled something) while this process
/// stood by: the session ends and reconnects.
fn standby_sink_lost(
    polled: Result<Vec<(crate::sink::Seq, crate::sink::PublishOutcome)>, crate::sink::SinkError>,
) -> Error {
    match polled {
        Err(crate::sink::SinkError::Lost(reason)) => Error::BrokerLost(format!(
            "the broker connection was lost while standing by: {reason}"
        )),
        Err(e) => Error::Sink(e),
        Ok(_) => Error::BrokerLost(
            "the sink settled a publish while standing by, with nothing published".into(),
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_pg_durations() {
        assert_eq!(parse_pg_duration("1min"), Some(Duration::from_secs(60)));
        assert_eq!(parse_pg_duration("10s"), Some(Duration::from_secs(10)));
        assert_eq!(parse_pg_duration("500ms"), Some(Duration::from_millis(500)));
        assert_eq!(parse_pg_duration("0"), Some(Duration::ZERO));
        assert_eq!(parse_pg_duration("abc"), None);
        assert_eq!(parse_pg_duration("18446744073709551615d"), None);
    }

    #[test]
    fn status_interval_stays_well_inside_the_timeout() {
        use crate::config::MAX_STATUS_INTERVAL;
        assert_eq!(
            status_interval(Some(Duration::from_secs(60))),
            Duration::from_secs(10)
        );
        assert_eq!(
            status_interval(Some(Duration::from_secs(5))).as_millis(),
            1666
        );
        assert_eq!(status_interval(Some(Duration::ZERO)), MAX_STATUS_INTERVAL);
        assert_eq!(status_interval(None), MAX_STATUS_INTERVAL);
    }

    #[test]
    fn the_same_decode_failure_three_times_is_definite() {
        let mut memory = SessionMemory::default();
        let at = |lsn| Error::Decode {
            lsn: Lsn(lsn),
            reason: "truncated".into(),
        };
        assert!(memory.note_decode_failure(at(5)).is_retryable());
        assert!(memory.note_decode_failure(at(5)).is_retryable());
        let e = memory.note_decode_failure(at(5));
        assert!(!e.is_retryable());
        assert!(e.to_string().contains("0/5"), "{e}");
        // Another LSN, or any other failure in between, starts over.
        let mut memory = SessionMemory::default();
        memory.note_decode_failure(at(5));
        memory.note_decode_failure(Error::BrokerLost("x".into()));
        memory.note_decode_failure(at(5));
        assert!(memory.note_decode_failure(at(6)).is_retryable());
    }

    /// A frame that breaks the transaction order (issue 21 item 9: it was retried forever)
    /// is retried, and definite once it recurs at the same LSN; an internal contradiction
    /// is definite at once.
    #[test]
    fn a_broken_transaction_order_at_one_lsn_becomes_definite() {
        use crate::watermark::WatermarkError;
        let mut memory = SessionMemory::default();
        let at = |lsn| Error::StreamOrder {
            lsn: Lsn(lsn),
            source: WatermarkError::NestedBegin,
        };
        assert!(memory.note_decode_failure(at(7)).is_retryable());
        assert!(memory.note_decode_failure(at(7)).is_retryable());
        let e = memory.note_decode_failure(at(7));
        assert!(!e.is_retryable(), "{e}");
        assert!(
            e.to_string().contains("0/7") && e.to_string().contains("another was still open"),
            "{e}"
        );
        // A decode failure and an order failure at one LSN count together: the same WAL.
        let mut memory = SessionMemory::default();
        memory.note_decode_failure(at(9));
        memory.note_decode_failure(Error::Decode {
            lsn: Lsn(9),
            reason: "truncated".into(),
        });
        assert!(!memory.note_decode_failure(at(9)).is_retryable());
        assert!(!Error::Internal("a confirm for nothing".into()).is_retryable());
    }

    #[test]
    fn synchronous_standby_names_that_can_pick_us() {
        let me = "pgoutbox-abc";
        assert!(!synchronous_names_may_select("", me));
        assert!(synchronous_names_may_select("*", me));
        assert!(synchronous_names_may_select("ANY 1 (*)", me));
        assert!(synchronous_names_may_select(
            "FIRST 2 (s1, \"pgoutbox-abc\")",
            me
        ));
        assert!(!synchronous_names_may_select("FIRST 1 (s1, s2)", me));
    }
}
