//! The main loop of `pgoutbox run`: WAL in, publishes out, confirms back, flush LSN out.
//!
//! ```text
//!  walsender ──XLogData/keepalive──▶ ReplicationStream ──pgoutput──▶ Begin/Message/Commit
//!      ▲                                                                  │ envelope
//!      │ standby status update (flush = AckWatermark::flushed)            ▼
//!  AckWatermark ◀──(ticket, outcome)── confirm task ◀── publish task ◀── OutboundMessage
//! ```
//!
//! The invariant: the flush LSN reported to Postgres only moves over transactions whose
//! every outbox message the broker confirmed as routed (acked and not returned), or to a
//! primary keepalive's `walEnd` when nothing at all is pending. It starts at the slot's
//! `confirmed_flush_lsn`, read after `START_REPLICATION` succeeded (so nobody else can move
//! it meanwhile), and never goes lower.
//!
//! Backpressure: when the window (messages or payload bytes in flight) is full, the loop
//! stops reading the replication socket but keeps sending standby status updates on a timer
//! well inside `wal_sender_timeout`; the walsender reads replies while its own send blocks.
//! Sources: PostgreSQL docs, "Streaming Replication Protocol" and "Logical Streaming
//! Replication Protocol".

use std::time::Duration;

use bytes::Bytes;
use lapin::types::ShortString;
use lapin::BasicProperties;
use tokio::sync::watch;
use tokio::time::Instant;

use crate::admin;
use crate::config::{
    parse_database_url, RunConfig, MAX_STATUS_INTERVAL, MESSAGE_PREFIX, STATUS_COALESCE,
};
use crate::envelope;
use crate::error::Error;
use crate::lsn::Lsn;
use crate::pgoutput::{self, LogicalMessage};
use crate::publisher::message::{
    headers_from_json, insert_i64, insert_text, DELIVERY_MODE_PERSISTENT,
};
use crate::publisher::{OutboundMessage, PublishOutcome, Publisher, PublisherConfig};
use crate::replication::connect::ReplicationConnection;
use crate::replication::session::ReplicationStream;
use crate::replication::stream::{
    now_pg_time_us, ReplicationMessage, StandbyStatusUpdate, StatusUpdateKind,
};
use crate::watermark::{AckWatermark, TxnSeq};

/// Header with the message's own LSN (`X/Y`); also the key that matches returns.
pub const HEADER_LSN: &str = crate::publisher::MATCH_KEY_HEADER;
/// Header with the LSN of the transaction's commit record (`X/Y`, pgoutput Begin's final
/// LSN): increases with commit order.
pub const HEADER_COMMIT_LSN: &str = "x-pgoutbox-commit-lsn";
/// Header with the commit time, microseconds since the Unix epoch.
pub const HEADER_COMMIT_TIME_US: &str = "x-pgoutbox-commit-time-us";

/// Frames handled per loop turn before confirms and timers get another look.
const FRAME_BATCH: usize = 2048;

/// What a run did, returned on a clean shutdown.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RunSummary {
    /// Messages published.
    pub published: u64,
    /// Messages confirmed as routed.
    pub confirmed: u64,
    /// The last flush LSN reported to Postgres.
    pub flushed: Lsn,
}

/// Carried with each publish and handed back with its outcome.
#[derive(Debug, Clone, Copy)]
struct Ticket {
    txn: TxnSeq,
    bytes: usize,
    lsn: Lsn,
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
        "s" => n * 1000,
        "min" => n * 60_000,
        "h" => n * 3_600_000,
        "d" => n * 86_400_000,
        _ => return None,
    };
    Some(Duration::from_millis(ms))
}

/// The periodic status interval for a server `wal_sender_timeout` (`None`: unknown or 0 =
/// disabled): a third of the timeout, at most [`MAX_STATUS_INTERVAL`], at least 100 ms.
fn status_interval(wal_sender_timeout: Option<Duration>) -> Duration {
    match wal_sender_timeout {
        Some(t) if !t.is_zero() => (t / 3).clamp(Duration::from_millis(100), MAX_STATUS_INTERVAL),
        _ => MAX_STATUS_INTERVAL,
    }
}

/// Connects everything and streams until `shutdown` turns true (then drains) or an error.
///
/// # Errors
/// Configuration and precondition errors (definite), connection errors, a delivery failure
/// (nack, return, channel loss: [`Error::Delivery`]) and [`Error::ShutdownTimeout`]. On
/// every error path nothing past the last confirmed transaction has been acknowledged.
pub async fn run(config: RunConfig, shutdown: watch::Receiver<bool>) -> Result<RunSummary, Error> {
    config.validate()?;
    let pg = parse_database_url(&config.database_url)?;
    let sql = admin::connect(&pg).await?;
    admin::preflight(&sql, &config.slot, &config.publication).await?;

    let mut publisher = Publisher::<Ticket>::connect(&PublisherConfig {
        amqp_url: config.amqp_url.clone(),
        exchange: config.exchange.clone(),
        connection_name: format!("pgoutbox {}", config.instance_id),
    })
    .await?;

    let application_name = format!("pgoutbox-{}", config.instance_id);
    let (stream, interval) = start_stream(&config, &pg, &sql, &application_name).await?;
    // We hold the slot now: nobody else can move confirmed_flush_lsn under us.
    let start = admin::confirmed_flush_lsn(&sql, &config.slot).await?;
    drop(sql);
    tracing::info!(
        slot = %config.slot,
        publication = %config.publication,
        exchange = %config.exchange,
        start_lsn = %start,
        status_interval_ms = interval.as_millis() as u64,
        max_in_flight = config.max_in_flight,
        max_in_flight_bytes = config.max_in_flight_bytes,
        "streaming"
    );
    let mut core = Core {
        stream,
        wm: AckWatermark::new(start),
        received: start,
        last_sent_flush: Lsn::ZERO,
        last_status_at: Instant::now(),
        next_periodic: Instant::now(),
        interval,
        bytes_in_flight: 0,
        current_txn: None,
        summary: RunSummary::default(),
        max_in_flight: config.max_in_flight as u64,
        max_in_flight_bytes: config.max_in_flight_bytes,
    };
    let result = core
        .run_loop(&mut publisher, shutdown, config.shutdown_timeout)
        .await;
    core.summary.flushed = core.last_sent_flush;
    publisher.close().await;
    core.stream.close().await;
    match &result {
        Ok(()) => tracing::info!(
            published = core.summary.published,
            confirmed = core.summary.confirmed,
            flushed_lsn = %core.last_sent_flush,
            "stopped"
        ),
        Err(e) => {
            tracing::error!(error = %e, flushed_lsn = %core.last_sent_flush, "stopping on error")
        }
    }
    result.map(|()| core.summary)
}

/// Opens the replication connection and starts streaming, retrying "slot is active" with
/// backoff for `slot_busy_timeout`.
async fn start_stream(
    config: &RunConfig,
    pg: &tokio_postgres::Config,
    sql: &tokio_postgres::Client,
    application_name: &str,
) -> Result<(ReplicationStream, Duration), Error> {
    use backon::BackoffBuilder;
    let began = Instant::now();
    let mut delays = backon::ExponentialBuilder::default()
        .with_min_delay(Duration::from_millis(250))
        .with_max_delay(Duration::from_secs(5))
        .with_jitter()
        .without_max_times()
        .build();
    let options = [
        ("proto_version", "1"),
        ("publication_names", config.publication.as_str()),
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
        match conn
            .start_logical_replication(&config.slot, Lsn::ZERO, &options)
            .await
        {
            Ok(stream) => return Ok((stream, status_interval(timeout))),
            Err(e) if e.code() == Some(crate::replication::error::SQLSTATE_OBJECT_IN_USE) => {
                let status = admin::slot_status(sql, &config.slot).await.ok();
                let holder_pid = status
                    .as_ref()
                    .and_then(|s| s.active_pid)
                    .map(|p| p.to_string())
                    .unwrap_or_else(|| "unknown".into());
                let holder_name = status
                    .and_then(|s| s.holder)
                    .unwrap_or_else(|| "unknown".into());
                let waited = began.elapsed();
                if waited >= config.slot_busy_timeout {
                    return Err(Error::SlotBusy {
                        slot: config.slot.clone(),
                        holder_pid,
                        holder_name,
                        waited_s: waited.as_secs(),
                    });
                }
                let delay = delays.next().unwrap_or(Duration::from_secs(5));
                tracing::warn!(
                    slot = %config.slot,
                    holder_pid = %holder_pid,
                    holder = %holder_name,
                    retry_in_ms = delay.as_millis() as u64,
                    "slot is active in another process; waiting"
                );
                tokio::time::sleep(delay).await;
            }
            Err(e) => return Err(e.into()),
        }
    }
}

struct Core {
    stream: ReplicationStream,
    wm: AckWatermark,
    /// Highest WAL position seen (commit ends and keepalive ends): the "write" position.
    received: Lsn,
    last_sent_flush: Lsn,
    last_status_at: Instant,
    next_periodic: Instant,
    interval: Duration,
    bytes_in_flight: usize,
    /// Begin of the open transaction: (commit record LSN, commit time µs since Unix epoch).
    current_txn: Option<(Lsn, i64)>,
    summary: RunSummary,
    max_in_flight: u64,
    max_in_flight_bytes: usize,
}

impl Core {
    fn has_room(&self) -> bool {
        self.wm.unconfirmed() < self.max_in_flight
            && self.bytes_in_flight < self.max_in_flight_bytes
    }

    /// The main loop: one `select!` with written priorities.
    ///
    /// Priorities (highest first):
    /// 1. shutdown signal (stop reading, start the bounded drain);
    /// 2. the drain deadline;
    /// 3. the status update deadline (never starved by confirms or WAL);
    /// 4. broker confirm outcomes (a batch per turn);
    /// 5. new WAL from the socket, only while the window has room;
    /// 6. frames already buffered (when a turn's frame batch ran out).
    async fn run_loop(
        &mut self,
        publisher: &mut Publisher<Ticket>,
        mut shutdown: watch::Receiver<bool>,
        shutdown_timeout: Duration,
    ) -> Result<(), Error> {
        let mut draining = *shutdown.borrow();
        let mut drain_deadline = Instant::now() + shutdown_timeout;
        let mut buffered = true;
        self.send_status(StatusUpdateKind::Periodic).await?;
        loop {
            if !draining {
                let mut handled = 0;
                while handled < FRAME_BATCH && self.has_room() {
                    match self.stream.next_buffered()? {
                        Some(msg) => {
                            self.handle(msg, publisher).await?;
                            handled += 1;
                        }
                        None => {
                            buffered = false;
                            break;
                        }
                    }
                }
            } else if self.wm.unconfirmed() == 0 {
                self.send_status(StatusUpdateKind::ShutdownFlush).await?;
                return Ok(());
            }
            let status_deadline = if self.wm.flushed() > self.last_sent_flush {
                self.next_periodic
                    .min(self.last_status_at + STATUS_COALESCE)
            } else {
                self.next_periodic
            };
            let room = self.has_room();
            tokio::select! {
                biased;
                // PRIORITY 1: shutdown. Cancel safety: watch::Receiver::changed is cancel safe.
                changed = shutdown.changed(), if !draining => {
                    if changed.is_err() || *shutdown.borrow() {
                        tracing::info!(unconfirmed = self.wm.unconfirmed(), "shutdown requested; draining confirms");
                        draining = true;
                        drain_deadline = Instant::now() + shutdown_timeout;
                    }
                }
                // PRIORITY 2: drain deadline. Cancel safety: sleep_until is cancel safe.
                _ = tokio::time::sleep_until(drain_deadline), if draining => {
                    self.send_status(StatusUpdateKind::ShutdownFlush).await?;
                    return Err(Error::ShutdownTimeout { unconfirmed: self.wm.unconfirmed(), flushed: self.wm.flushed() });
                }
                // PRIORITY 3: standby status update deadline. Cancel safety: sleep_until.
                _ = tokio::time::sleep_until(status_deadline) => {
                    self.send_status(StatusUpdateKind::Periodic).await?;
                }
                // PRIORITY 4: broker confirms. Cancel safety: mpsc recv is cancel safe.
                batch = publisher.recv_outcomes() => {
                    let batch = batch.ok_or(crate::publisher::Error::Closed)?;
                    self.apply_outcomes(batch).await?;
                }
                // PRIORITY 5: new WAL, guarded by the window. Cancel safety: read_buf.
                read = self.stream.fill(), if !draining && room && !buffered => {
                    read?;
                    buffered = true;
                }
                // PRIORITY 6: frames left in the buffer from a full batch.
                _ = std::future::ready(()), if !draining && room && buffered => {}
            }
        }
    }

    async fn apply_outcomes(&mut self, batch: Vec<(Ticket, PublishOutcome)>) -> Result<(), Error> {
        for (ticket, outcome) in batch {
            self.bytes_in_flight = self.bytes_in_flight.saturating_sub(ticket.bytes);
            if outcome.is_routed() {
                self.wm
                    .confirm(ticket.txn)
                    .map_err(|e| Error::Stream(e.to_string()))?;
                self.summary.confirmed += 1;
            } else {
                self.wm
                    .fail(ticket.txn)
                    .map_err(|e| Error::Stream(e.to_string()))?;
                // Report what is safely confirmed, then stop: retries and dead letters are
                // not built yet, and nothing at or after this message may be acknowledged.
                let flushed = self.wm.flushed();
                let _ = self.send_status(StatusUpdateKind::Periodic).await;
                return Err(Error::Delivery {
                    lsn: ticket.lsn,
                    outcome,
                    flushed,
                });
            }
        }
        Ok(())
    }

    async fn send_status(&mut self, kind: StatusUpdateKind) -> Result<(), Error> {
        let flush = self.wm.flushed();
        debug_assert!(flush >= self.last_sent_flush, "flush LSN moved backwards");
        let update = StandbyStatusUpdate {
            write: self.received.max(flush),
            flush,
            apply: flush,
            client_time_us: now_pg_time_us(),
            kind,
        };
        self.stream.send_status(&update).await?;
        if flush != self.last_sent_flush {
            tracing::debug!(flush_lsn = %flush, "standby status update");
        }
        self.last_sent_flush = flush;
        self.last_status_at = Instant::now();
        self.next_periodic = self.last_status_at + self.interval;
        Ok(())
    }

    async fn handle(
        &mut self,
        msg: ReplicationMessage,
        publisher: &mut Publisher<Ticket>,
    ) -> Result<(), Error> {
        match msg {
            ReplicationMessage::PrimaryKeepalive {
                wal_end,
                reply_requested,
                ..
            } => {
                self.received = self.received.max(wal_end);
                // Every XLogData before this keepalive has been handled (frames are handled
                // in arrival order), so an idle watermark may move to walEnd.
                self.wm.keepalive(wal_end);
                if reply_requested {
                    self.send_status(StatusUpdateKind::KeepaliveReply).await?;
                }
            }
            ReplicationMessage::XLogData { data, .. } => self.handle_logical(data, publisher)?,
        }
        Ok(())
    }

    fn handle_logical(
        &mut self,
        data: Bytes,
        publisher: &mut Publisher<Ticket>,
    ) -> Result<(), Error> {
        let decoded = pgoutput::decode(data).map_err(|e| Error::Stream(e.to_string()))?;
        match decoded {
            LogicalMessage::Begin(b) => {
                self.wm.begin().map_err(|e| Error::Stream(e.to_string()))?;
                self.current_txn =
                    Some((b.final_lsn, pgoutput::pg_time_to_unix_us(b.commit_time_us)));
            }
            LogicalMessage::Commit(c) => {
                self.wm
                    .commit(c.end_lsn)
                    .map_err(|e| Error::Stream(e.to_string()))?;
                self.received = self.received.max(c.end_lsn);
                self.current_txn = None;
            }
            LogicalMessage::Message(m) if m.has_prefix(MESSAGE_PREFIX.as_bytes()) => {
                let Some((commit_lsn, commit_time_us)) =
                    self.current_txn.filter(|_| m.transactional)
                else {
                    tracing::error!(
                        lsn = %m.lsn,
                        "non-transactional logical message with prefix pgoutbox (outbox.emit never writes one); skipping it and acknowledging nothing past it until restart"
                    );
                    self.wm.block_here();
                    return Ok(());
                };
                match build_message(m.lsn, commit_lsn, commit_time_us, m.content) {
                    Ok((routing_key, body, properties)) => {
                        let txn = self
                            .wm
                            .add_message()
                            .map_err(|e| Error::Stream(e.to_string()))?;
                        let bytes = body.len();
                        self.bytes_in_flight += bytes;
                        self.summary.published += 1;
                        publisher.publish(OutboundMessage {
                            tag: Ticket {
                                txn,
                                bytes,
                                lsn: m.lsn,
                            },
                            routing_key,
                            body,
                            properties,
                            match_key: m.lsn.to_string(),
                        })?;
                    }
                    Err(reason) => {
                        tracing::error!(
                            lsn = %m.lsn,
                            reason = %reason,
                            "undecodable outbox message (poison); skipping it and acknowledging nothing past it until restart"
                        );
                        self.wm.block_here();
                    }
                }
            }
            LogicalMessage::Message(_) | LogicalMessage::Other { .. } => {}
        }
        Ok(())
    }
}

/// Maps one envelope to routing key, body and AMQP properties.
fn build_message(
    lsn: Lsn,
    commit_lsn: Lsn,
    commit_time_us: i64,
    content: Bytes,
) -> Result<(ShortString, Bytes, BasicProperties), String> {
    let env = envelope::decode(content).map_err(|e| e.to_string())?;
    let routing_key = ShortString::try_new(env.topic).map_err(|e| e.to_string())?;
    let message_id = ShortString::try_new(env.message_id).map_err(|e| e.to_string())?;
    let content_type = ShortString::try_new(env.content_type).map_err(|e| e.to_string())?;
    let mut headers = headers_from_json(&env.headers);
    insert_text(&mut headers, HEADER_LSN, lsn.to_string());
    insert_text(&mut headers, HEADER_COMMIT_LSN, commit_lsn.to_string());
    insert_i64(&mut headers, HEADER_COMMIT_TIME_US, commit_time_us);
    let properties = BasicProperties::default()
        .with_message_id(message_id)
        .with_content_type(content_type)
        .with_delivery_mode(DELIVERY_MODE_PERSISTENT)
        .with_timestamp(u64::try_from(commit_time_us / 1_000_000).unwrap_or(0))
        .with_headers(headers);
    Ok((routing_key, env.payload, properties))
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
    }

    #[test]
    fn status_interval_stays_well_inside_the_timeout() {
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
}
