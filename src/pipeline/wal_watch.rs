//! Between sessions, the server's end of WAL, so the lag gauges stay true while nothing
//! streams.
//!
//! While a session streams, the walsender reports its end of WAL in every keepalive and
//! XLogData header, and the loop writes it to the gauges once per turn. Between sessions (a
//! broker outage, a reconnect backoff) no session turns: this task reads
//! `pg_current_wal_lsn()` on a SQL session of its own every [`WATCH_EVERY`], and the lag
//! gauge is that minus the flush LSN last reported (which no one moves meanwhile). When
//! Postgres cannot be reached either, the gauges keep the last value read: no WAL can be
//! written where the server is down, and where only our route to it is, what the server
//! wrote cannot be known from here (`pgoutbox status` from another host can).
//!
//! It reads nothing while a session streams or drains, while this process stands by (the
//! slot is another process's), or before any session reported a flush LSN.

use std::sync::Arc;
use std::time::Duration;

use crate::config::DatabaseConfig;
use crate::metrics::{Phase, Telemetry};

/// How often the WAL end is read between sessions.
pub const WATCH_EVERY: Duration = Duration::from_secs(1);

/// Bound on one connect, and on one query (`statement_timeout` too).
const WATCH_TIMEOUT: Duration = Duration::from_secs(2);

/// The task; aborted when dropped.
pub(super) struct WalWatch(tokio::task::JoinHandle<()>);

impl Drop for WalWatch {
    fn drop(&mut self) {
        self.0.abort();
    }
}

impl WalWatch {
    /// Starts reading the WAL end between sessions, on its own SQL session to `pg`.
    pub fn start(pg: &DatabaseConfig, telemetry: &Arc<Telemetry>) -> Self {
        let (pg, telemetry) = (pg.clone(), Arc::clone(telemetry));
        WalWatch(tokio::spawn(async move { watch(pg, telemetry).await }))
    }
}

/// Whether the WAL end is this task's to read now.
fn between_sessions(telemetry: &Telemetry) -> bool {
    let phase = telemetry.phase();
    matches!(phase, Phase::BrokerDisconnected | Phase::ReplicationLost)
        && telemetry.flush_lsn_reported() > 0
}

async fn watch(pg: DatabaseConfig, telemetry: Arc<Telemetry>) {
    let mut client: Option<tokio_postgres::Client> = None;
    let mut ticks = tokio::time::interval(WATCH_EVERY);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        ticks.tick().await;
        if !between_sessions(&telemetry) {
            client = None;
            continue;
        }
        if client.is_none() {
            let connecting = crate::postgres::connect_background(
                &pg,
                "off",
                WATCH_TIMEOUT,
                WATCH_TIMEOUT,
                "wal watch",
            );
            client = tokio::time::timeout(WATCH_TIMEOUT, connecting)
                .await
                .ok()
                .and_then(Result::ok);
        }
        let Some(c) = client.as_ref() else {
            continue;
        };
        let read = tokio::time::timeout(
            WATCH_TIMEOUT,
            c.query_one("SELECT (pg_current_wal_lsn() - '0/0'::pg_lsn)::text", &[]),
        )
        .await;
        match read {
            Ok(Ok(row)) => {
                let end = row
                    .try_get::<_, String>(0)
                    .ok()
                    .and_then(|t| t.parse::<u64>().ok());
                if let Some(end) = end {
                    telemetry.set_server_wal_end(end);
                }
            }
            _ => client = None,
        }
    }
}
