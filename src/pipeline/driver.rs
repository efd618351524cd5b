//! Sessions and reconnects: connect both sides, stream until shutdown or the first failure,
//! and decide what comes next.
//!
//! Every wait here (connecting to Postgres or RabbitMQ, a handshake, the slot held by
//! another process, the backoff between sessions) ends promptly on SIGINT/SIGTERM; nothing
//! is in flight during those waits, so such an exit is clean (exit status 0).
//!
//! What one session hands to the next ([`SessionMemory`]): the LSN it knows to be settled
//! (so a reconnect re-sends at most what was not confirmed), the broker's message size
//! limit once RabbitMQ revealed it by closing the channel, and how often the same WAL
//! position failed to decode.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;
use tokio::time::Instant;

use super::dead_letter::DeadLetterWriter;
use super::event_loop::Core;
use super::journal::{JournalHandle, JournalWriter};
use super::retention::RetentionTask;
use super::standby::{note_role, Standby};
use super::RunSummary;
use crate::admin;
use crate::config::RunConfig;
use crate::error::Error;
use crate::lsn::Lsn;
use crate::metrics::{Phase, Role, Telemetry, DRIVER_BEAT};
use crate::publisher::{Publisher, PublisherConfig};
use crate::replication::connect::ReplicationConnection;
use crate::replication::session::ReplicationStream;
use crate::stream_state::{self, FlushGate, RecordedHandle, SeenHistory};

/// How long closing the broker connection and the replication stream may take.
const CLOSE_TIMEOUT: Duration = Duration::from_secs(2);
/// Healthy-session length after which the reconnect backoff starts again from its minimum.
const HEALTHY_SESSION: Duration = Duration::from_secs(60);
/// Bounds of the delay between two sessions; jitter stays inside the cap.
pub const RECONNECT_MIN: Duration = Duration::from_millis(500);
/// See [`RECONNECT_MIN`]: the longest wait between two sessions.
pub const RECONNECT_MAX: Duration = Duration::from_secs(30);
/// A frame that fails to decode this many times in a row at the same LSN is a definite
/// error: reconnecting will only read the same bytes again.
pub const DECODE_FAILURE_LIMIT: u32 = 3;

/// Capped exponential backoff with jitter (backon), the cap applied after the jitter.
fn backoff(min: Duration, max: Duration) -> impl Iterator<Item = Duration> {
    use backon::BackoffBuilder;
    backon::ExponentialBuilder::default()
        .with_min_delay(min)
        .with_max_delay(max)
        .with_jitter()
        .without_max_times()
        .build()
        .map(move |d| d.min(max))
}

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
    /// Messages not settled when the last session ended.
    pub unsettled_at_end: u64,
    /// The broker's nodes and which one the next session tries first.
    pub nodes: BrokerNodes,
    /// The LSN of the last frame that failed to decode, and how many sessions in a row
    /// failed there.
    decode_failures: Option<(Lsn, u32)>,
}

/// The broker's nodes (`--amqp-url`, in `--amqp-url-order`) and where the next connect
/// pass starts.
///
/// A pass tries every node once, starting at `next`, and takes the first that completes
/// the AMQP handshake and the exchange declare. After the connection to node `i` was lost
/// the next pass starts at `i + 1` (wrapping), so a node that went down is tried last; after
/// a session that ended for another reason (Postgres, say) it starts at `i` again, so a
/// healthy node is kept. The first pass starts at the first node.
#[derive(Debug, Default)]
pub(super) struct BrokerNodes {
    /// The nodes' URLs, in the order they are tried.
    pub urls: Vec<String>,
    /// Index into `urls` of the node the next pass tries first.
    pub next: usize,
}

impl BrokerNodes {
    /// The indices of one connect pass, in the order they are tried.
    fn pass(&self) -> impl Iterator<Item = usize> + '_ {
        let n = self.urls.len();
        (0..n).map(move |k| (self.next + k) % n)
    }

    /// Records how a session on node `used` ended: after a broker failure the next pass
    /// starts at the following node.
    fn session_ended(&mut self, used: usize, broker_lost: bool) {
        let n = self.urls.len().max(1);
        self.next = if broker_lost {
            (used + 1) % n
        } else {
            used % n
        };
    }
}

/// The broker's message body size limit.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct BrokerLimit {
    /// Largest body RabbitMQ accepts, in bytes.
    pub max_bytes: usize,
    /// Where the figure comes from, for the dead letter's error text.
    pub source: String,
}

/// Runs `fut` while beating the heartbeat every [`DRIVER_BEAT`]: the driver is turning
/// while it connects, backs off or waits for the slot (each of those waits is bounded or
/// ends on a signal).
///
/// # Cancel safety
/// As cancel safe as `fut`.
async fn beating<F: Future>(telemetry: &Telemetry, fut: F) -> F::Output {
    let mut ticks = tokio::time::interval(DRIVER_BEAT);
    tokio::pin!(fut);
    loop {
        tokio::select! {
            biased;
            out = &mut fut => return out,
            _ = ticks.tick() => telemetry.beat(),
        }
    }
}

/// The reconnect cause of a retryable session failure, for `pgoutbox_reconnects_total`.
fn reconnect_cause(error: &Error) -> &'static str {
    match error {
        Error::BrokerLost(_) | Error::Publisher(_) => "broker",
        _ => "postgres",
    }
}

/// Aborts the HTTP task when `run` returns.
struct ServerGuard(Option<tokio::task::JoinHandle<()>>);

impl Drop for ServerGuard {
    fn drop(&mut self) {
        if let Some(task) = self.0.take() {
            task.abort();
        }
    }
}

/// Resolves once shutdown was requested (or the sender is gone).
///
/// # Cancel safety
/// Cancel safe (`watch::Receiver::wait_for`).
async fn shutdown_requested(shutdown: &mut watch::Receiver<bool>) {
    let _ = shutdown.wait_for(|stop| *stop).await;
}

/// Streams until `shutdown` turns true (then drains) or a definite error, reconnecting with
/// capped exponential backoff and jitter ([`RECONNECT_MIN`] to [`RECONNECT_MAX`]) after every
/// retryable failure (broker or Postgres connection lost, channel closed, server restart).
///
/// Each session starts from the slot (and from the last LSN this process knows to be
/// settled, when that is further), so a reconnect re-sends at most what was not confirmed.
///
/// With `config.observability.http_addr` set, `/metrics`, `/healthz` and `/readyz` are served there (see
/// [`crate::metrics`]) for as long as this runs.
///
/// # Errors
/// Definite errors only: configuration and precondition errors (including an
/// `--http-addr` that cannot be listened on), a lost slot,
/// [`Error::SlotBusy`] when `slot_busy_timeout` is set, [`Error::ShutdownTimeout`],
/// [`Error::DrainInterrupted`] when a connection was lost while shutdown was draining
/// confirms, [`Error::UndecodableWal`]. On every path nothing past the last settled
/// transaction has been acknowledged.
pub async fn run(
    config: RunConfig,
    mut shutdown: watch::Receiver<bool>,
) -> Result<RunSummary, Error> {
    let pg = config.postgres.database.clone();
    let telemetry = Telemetry::new(config.observability.stall_after);
    let _server = match config.observability.http_addr {
        Some(addr) => ServerGuard(Some(
            crate::metrics::http::serve(addr, Arc::clone(&telemetry))
                .await
                .map_err(|e| crate::config::ValidationError {
                    setting: "--http-addr",
                    value: addr.to_string(),
                    rule: format!(
                        "cannot listen there ({e}); pick a free port, or write off to disable the HTTP server"
                    ),
                })?,
        )),
        None => ServerGuard(None),
    };
    let mut memory = SessionMemory {
        broker_limit: config
            .bounds
            .broker_max_message_bytes
            .map(|max_bytes| BrokerLimit {
                max_bytes,
                source: format!("--broker-max-message-bytes {max_bytes}"),
            }),
        nodes: BrokerNodes {
            urls: crate::config::order_amqp_urls(
                &config.broker.amqp_urls,
                config.broker.amqp_url_order,
                fastrand::u64(..),
            ),
            next: 0,
        },
        ..SessionMemory::default()
    };
    if memory.nodes.urls.len() > 1 {
        tracing::info!(
            nodes = %memory
                .nodes
                .urls
                .iter()
                .map(|u| crate::config::redact_url(u))
                .collect::<Vec<_>>()
                .join(", "),
            order = ?config.broker.amqp_url_order,
            "RabbitMQ nodes, in the order they are tried"
        );
    }
    // Both background tasks have their own SQL session and never hold back the stream.
    let _retention = RetentionTask::start(
        config.postgres.retention,
        &pg,
        &config.postgres.schema,
        &telemetry,
    );
    let journal = JournalWriter::start(
        config.observability.journal,
        &pg,
        &config.postgres.schema,
        &config.postgres.slot,
        &config.broker.exchange,
        crate::config::MAX_STATUS_INTERVAL,
        &telemetry,
    );
    let journal_handle = journal.handle();
    let result: Result<RunSummary, Error> = async {
    let mut summary = RunSummary::default();
    let mut delays = backoff(RECONNECT_MIN, RECONNECT_MAX);
    loop {
        let began = Instant::now();
        let result = run_session(
            &config,
            &pg,
            shutdown.clone(),
            &mut memory,
            &mut summary,
            &telemetry,
            &journal_handle,
        )
        .await;
        telemetry.set_phase(Phase::Connecting);
        if result.is_err() {
            note_role(&telemetry, &config.postgres.slot, Role::None, None);
        }
        let error = match result {
            Ok(()) => return Ok(summary),
            Err(e) => e,
        };
        let error = memory.note_decode_failure(error);
        if !error.is_retryable() {
            return Err(error);
        }
        if *shutdown.borrow() {
            if memory.unsettled_at_end > 0 {
                return Err(Error::DrainInterrupted {
                    unsettled: memory.unsettled_at_end,
                    flushed: summary.flushed,
                    cause: Box::new(error),
                });
            }
            tracing::warn!(error = %error, "session failed during shutdown with nothing in flight");
            return Ok(summary);
        }
        if began.elapsed() > HEALTHY_SESSION {
            delays = backoff(RECONNECT_MIN, RECONNECT_MAX);
        }
        let delay = delays.next().unwrap_or(RECONNECT_MAX);
        summary.reconnects += 1;
        telemetry.reconnect(reconnect_cause(&error));
        tracing::warn!(
            error = %crate::error::one_line(&error),
            retry_in_ms = delay.as_millis() as u64,
            resume_lsn = %memory.resume.unwrap_or_default(),
            "session failed; reconnecting"
        );
        tokio::select! {
            biased;
            _ = shutdown_requested(&mut shutdown) => return Ok(summary),
            _ = beating(&telemetry, tokio::time::sleep(delay)) => {}
        }
    }
    }
    .await;
    // The journal's last rows (the messages are settled whatever happens to them).
    journal.close().await;
    result
}

impl SessionMemory {
    /// Counts decode failures at one LSN across sessions; the [`DECODE_FAILURE_LIMIT`]th
    /// becomes [`Error::UndecodableWal`]. Any other outcome resets the count.
    fn note_decode_failure(&mut self, error: Error) -> Error {
        let Error::Decode { lsn, reason } = &error else {
            self.decode_failures = None;
            return error;
        };
        let count = match self.decode_failures {
            Some((at, n)) if at == *lsn => n + 1,
            _ => 1,
        };
        self.decode_failures = Some((*lsn, count));
        if count >= DECODE_FAILURE_LIMIT {
            return Error::UndecodableWal {
                lsn: *lsn,
                attempts: count,
                reason: reason.clone(),
            };
        }
        error
    }
}

/// Both connections and the broker, ready to stream.
struct Connected {
    stream: ReplicationStream,
    interval: Duration,
    publisher: Publisher<u64>,
    /// Index of the broker node `publisher` is connected to (into [`BrokerNodes::urls`]).
    node: usize,
    dead_letters: DeadLetterWriter,
    start: Lsn,
    lockdown: crate::lockdown::Lockdown,
    gate: FlushGate,
    recorded: RecordedHandle,
    identity: crate::replication::connect::SystemIdentity,
    /// The prefix this session publishes ([`admin::resolve_prefix`]).
    prefix: crate::outbox_schema::MessagePrefix,
}

/// One session: connect (racing shutdown), stream, and return on shutdown (`Ok`) or the
/// first failure. `memory` carries what the next session needs.
async fn run_session(
    config: &RunConfig,
    pg: &crate::config::DatabaseConfig,
    mut shutdown: watch::Receiver<bool>,
    memory: &mut SessionMemory,
    summary: &mut RunSummary,
    telemetry: &Arc<Telemetry>,
    journal: &JournalHandle,
) -> Result<(), Error> {
    memory.unsettled_at_end = 0;
    telemetry.set_phase(Phase::Connecting);
    let connected = tokio::select! {
        biased;
        _ = shutdown_requested(&mut shutdown) => {
            tracing::info!("shutdown requested while connecting; nothing was in flight");
            return Ok(());
        }
        c = beating(telemetry, connect(config, pg, memory, telemetry)) => c?,
    };
    let Connected {
        stream,
        interval,
        mut publisher,
        node,
        dead_letters,
        start,
        lockdown,
        gate,
        recorded,
        identity,
        prefix,
    } = connected;
    telemetry.session_started();
    note_role(telemetry, &config.postgres.slot, Role::Active, None);
    journal.set_interval(interval);
    let mut core = Core::new(
        config.clone(),
        stream,
        dead_letters,
        start,
        interval,
        gate,
        memory.broker_limit.clone(),
        std::mem::take(summary),
        Arc::clone(telemetry),
        lockdown,
        prefix,
        journal.clone(),
    );
    let result = core.run_loop(&mut publisher, shutdown).await;
    memory.nodes.session_ended(
        node,
        result
            .as_ref()
            .is_err_and(|e| reconnect_cause(e) == "broker"),
    );
    memory.resume = Some(core.flushed());
    memory.seen = Some(SeenHistory {
        system_id: identity.system_id,
        timeline: identity.timeline,
        recorded: recorded.get(),
    });
    memory.unsettled_at_end = core.unsettled();
    if let Some(limit) = core.broker_limit() {
        memory.broker_limit = Some(limit);
    }
    let (stream, dead_letters, finished) = core.into_parts();
    *summary = finished;
    // Closing talks to peers that may be gone or black-holed: never wait long for it.
    let _ = tokio::time::timeout(CLOSE_TIMEOUT, publisher.close()).await;
    let _ = tokio::time::timeout(CLOSE_TIMEOUT, stream.close()).await;
    dead_letters.stop();
    telemetry
        .broker_blocked_flag()
        .store(false, std::sync::atomic::Ordering::Relaxed);
    if result.is_ok() {
        tracing::info!(
            published = summary.published,
            retried = summary.retried,
            confirmed = summary.confirmed,
            dead_lettered = summary.dead_lettered,
            reconnects = summary.reconnects,
            flushed_lsn = %summary.flushed,
            "stopped; every message was settled (published counts every attempt, including retries and re-sends after reconnects)"
        );
    }
    result
}

/// Connects the SQL session, runs the pre-flight checks, connects the broker and the
/// dead-letter writer, and starts streaming.
async fn connect(
    config: &RunConfig,
    pg: &crate::config::DatabaseConfig,
    memory: &SessionMemory,
    telemetry: &Telemetry,
) -> Result<Connected, Error> {
    let sql = crate::postgres::connect(pg).await?;
    admin::preflight(
        &sql,
        &config.postgres.schema,
        &config.postgres.slot,
        &config.postgres.publication,
    )
    .await?;
    for warning in admin::check_background_privileges(
        &sql,
        &config.postgres.schema,
        &config.postgres.slot,
        config.observability.journal == crate::config::JournalMode::On,
        config.postgres.retention.idempotency.age().is_some(),
        config.postgres.retention.journal.age().is_some(),
    )
    .await?
    {
        tracing::warn!("{warning}");
    }
    stream_state::ensure_table(&sql, &config.postgres.schema).await?;
    let prefix = admin::resolve_prefix(
        &sql,
        &config.postgres.schema,
        config.postgres.prefix.as_ref(),
    )
    .await?;
    let application_name = crate::postgres::application_name(&config.observability.instance_id);
    warn_if_synchronous_standby(&sql, &application_name).await;
    // Read before START_REPLICATION: a lockdown committed after this read is decoded in the
    // stream (its marker), one committed before it is in the record (crate::lockdown).
    // Lockdown is the default outbox's only (admin::require_default_schema): another
    // schema's streamer checks no emitter and ignores the markers.
    let lockdown = if config.postgres.schema.is_default() {
        let lockdown_state = admin::lockdown_state(&sql).await?;
        crate::lockdown::Lockdown::from_record(lockdown_state.since())
    } else {
        crate::lockdown::Lockdown::from_record(None)
    };
    let dead_letters = DeadLetterWriter::connect(pg, &config.postgres.schema).await?;
    let publisher_config = PublisherConfig {
        amqp_url: String::new(),
        exchange: config.broker.exchange.clone(),
        declare: match config.broker.exchange_declare {
            crate::config::ExchangeDeclare::DurableTopic => {
                crate::publisher::connection::Declare::DurableTopic
            }
            crate::config::ExchangeDeclare::Passive => {
                crate::publisher::connection::Declare::Passive
            }
        },
        connection_name: format!("pgoutbox {}", config.observability.instance_id),
        signals: crate::publisher::BrokerSignals {
            blocked: telemetry.broker_blocked_flag(),
            lost: telemetry.broker_lost_flag(),
        },
    };
    let (publisher, node) = connect_broker(&memory.nodes, publisher_config).await?;
    let (stream, interval, identity, hint) =
        start_stream(config, pg, &sql, &application_name, memory, telemetry).await?;
    // We hold the slot now: nobody else can move confirmed_flush_lsn under us.
    let slot_lsn = admin::confirmed_flush_lsn(&sql, &config.postgres.slot).await?;
    let start = slot_lsn.max(hint);
    let (gate, recorded) =
        match stream_state::session_start(sql, config, &identity, slot_lsn, start).await {
            Ok(r) => r,
            Err(e) => {
                let _ = tokio::time::timeout(CLOSE_TIMEOUT, stream.close()).await;
                return Err(e.into());
            }
        };
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
    Ok(Connected {
        stream,
        interval,
        publisher,
        node,
        dead_letters,
        start,
        lockdown,
        gate,
        recorded,
        identity,
        prefix,
    })
}

/// One connect pass over the broker's nodes ([`BrokerNodes::pass`]): the first node that
/// completes the handshake and the exchange declare wins, and is logged (URL without its
/// password). Each node gets [`crate::publisher::CONNECT_TIMEOUT`].
///
/// A definite refusal from one node (403 login refused, 530 vhost, a 403/406 declare, an
/// unusable TLS file) does not end the pass: users, permissions and exchanges are
/// cluster-wide in RabbitMQ, so it usually means the same on every node, but a URL that
/// points at a node outside the cluster, or one not yet synced, must not stop a healthy
/// one from being used. Each failure is logged with its node.
///
/// # Errors
/// When no node connected: the first definite error if every node answered with one (so
/// one URL behaves as before: a refused login stops `run`), otherwise the first retryable
/// error (a node down or unreachable), and the pass is tried again after the backoff.
async fn connect_broker(
    nodes: &BrokerNodes,
    mut publisher_config: PublisherConfig,
) -> Result<(Publisher<u64>, usize), Error> {
    let total = nodes.urls.len();
    let mut first_retryable: Option<Error> = None;
    let mut first_definite: Option<Error> = None;
    for i in nodes.pass() {
        publisher_config.amqp_url.clone_from(&nodes.urls[i]);
        let url = crate::config::redact_url(&nodes.urls[i]);
        match Publisher::<u64>::connect(&publisher_config).await {
            Ok(publisher) => {
                tracing::info!(
                    node = %url,
                    index = i + 1,
                    of = total,
                    "connected to RabbitMQ"
                );
                return Ok((publisher, i));
            }
            Err(e) => {
                let e = Error::from(e);
                if total > 1 {
                    tracing::warn!(
                        node = %url,
                        index = i + 1,
                        of = total,
                        definite = !e.is_retryable(),
                        error = %crate::error::one_line(&e),
                        "RabbitMQ node did not accept the connection; trying the next"
                    );
                }
                let slot = if e.is_retryable() {
                    &mut first_retryable
                } else {
                    &mut first_definite
                };
                if slot.is_none() {
                    *slot = Some(e);
                }
            }
        }
    }
    Err(first_retryable
        .or(first_definite)
        .unwrap_or_else(|| Error::BrokerLost("no RabbitMQ node is configured".into())))
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
/// (forever when `None`). The caller races this against shutdown.
async fn start_stream(
    config: &RunConfig,
    pg: &crate::config::DatabaseConfig,
    sql: &tokio_postgres::Client,
    application_name: &str,
    memory: &SessionMemory,
    telemetry: &Telemetry,
) -> Result<
    (
        ReplicationStream,
        Duration,
        crate::replication::connect::SystemIdentity,
        Lsn,
    ),
    Error,
> {
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
                return Ok((stream, status_interval(timeout), identity, start));
            }
            Err(e) if e.code() == Some(crate::replication::error::SQLSTATE_OBJECT_IN_USE) => {
                standby.wait(sql, &config.postgres.slot, telemetry).await?;
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
    fn backoff_never_exceeds_its_cap() {
        let max = backoff(RECONNECT_MIN, RECONNECT_MAX)
            .take(200)
            .max()
            .unwrap_or_default();
        assert!(max <= RECONNECT_MAX, "{max:?}");
        assert!(max >= RECONNECT_MAX / 2, "the cap is reached: {max:?}");
        let first = backoff(RECONNECT_MIN, RECONNECT_MAX)
            .next()
            .unwrap_or_default();
        assert!(
            first >= RECONNECT_MIN && first <= RECONNECT_MIN * 2,
            "{first:?}"
        );
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
