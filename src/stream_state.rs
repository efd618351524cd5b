//! `outbox.stream_state`: our record of the slot's history, and the gap rule.
//!
//! A slot that was dropped and recreated, a failover to a server whose slot lags, or a
//! restore of the data directory changes the slot's history under the streamer. Resuming
//! from the later of two positions then silently skips what lies between them. So `run`
//! keeps, per slot, IDENTIFY_SYSTEM's system identifier and timeline and the last flush LSN it
//! reported (`sql/stream_state.sql`), and compares on every session start:
//!
//! ```text
//!   system identifier changed                          -> gap (another cluster): refuse
//!   timeline below the record's or below the highest
//!     this process streamed from (same system)          -> gap (an old primary back): refuse
//!   slot confirmed_flush_lsn  <  recorded flush_lsn   -> duplicates only: warn, go on
//!   slot confirmed_flush_lsn  >  recorded flush_lsn:
//!     same timeline as the record                      -> gap (recreated slot): refuse
//!     higher timeline (a promoted standby), the slot
//!       failover and synced, at or before the switch
//!       point into the server's timeline               -> ours: info, go on, record it
//!     higher timeline, anything else                   -> gap (unproven): refuse
//! ```
//!
//! `--accept-gap` starts anyway and appends the gap to `accepted_gaps` (and the log).
//!
//! Why a promoted server's synchronized slot may be ahead of the record, and why its
//! position is then one pgoutbox reported (so nothing was lost): the record of a flush
//! position F is committed at an LSN after F (F was already in the WAL the walsender sent),
//! while the slot that F was reported to is copied to the standby out of band, up to the
//! standby's flushed WAL. A standby that holds WAL up to somewhere between F and the
//! record's commit has the slot at F and the record before it. The proof, with its
//! assumptions, is in docs/src/operators/postgres-failover.md ("The gap rule after a
//! promotion").
//!
//! The record is never behind what the server was told: the session start writes it before
//! the first standby status update, and the [`FlushGate`] lets the pipeline report only
//! `min(watermark, recorded)` while a [`recorder`] task raises `recorded` with a small
//! committed `UPDATE` at most every [`RECORD_INTERVAL`]. The pipeline core stays a plain
//! state machine: it publishes the position it would like to report and reads the one it
//! may report, once per loop turn (never per message).
//!
//! In process, the position a session ended at is reused by the next one only while the
//! server's history is the same ([`resume_position`]): same system identifier and timeline,
//! `xlogpos` not below it, and the database's record not behind what this process
//! recorded (a restored data directory or a promoted standby carries an older record).

use std::time::Duration;

use serde::Serialize;
use tokio::sync::watch;
use tokio_postgres::Client;

use crate::lsn::Lsn;
use crate::outbox_schema::SchemaName;
use crate::replication::connect::SystemIdentity;

/// What reading, writing or judging the record can fail with. Converts into the
/// top-level [`crate::error::Error`] (as `Sql`, `Precondition` and `SlotGap`), which
/// decides what is retried.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A statement on `outbox.stream_state` failed.
    #[error("postgres: {context}")]
    Sql {
        /// What we were doing.
        context: String,
        /// tokio-postgres' error (carries the SQLSTATE).
        #[source]
        source: tokio_postgres::Error,
    },
    /// The table is missing and cannot be created; the message names the fix.
    #[error("{0}")]
    Precondition(String),
    /// The slot's history has a gap and `--accept-gap` is off.
    #[error("{0}")]
    Gap(Gap),
}

impl Error {
    /// Wraps a tokio-postgres error with what we were doing.
    fn sql(context: impl Into<String>, source: tokio_postgres::Error) -> Self {
        Error::Sql {
            context: context.into(),
            source,
        }
    }
}

/// The table's DDL, installed by `setup` (idempotent).
pub const STREAM_STATE_SQL: &str = include_str!("../sql/stream_state.sql");

/// Shortest time between two writes of the recorded flush LSN: the status-update coalescing
/// interval, so a moving flush position costs one small commit per status update at most.
pub const RECORD_INTERVAL: Duration = crate::config::STATUS_COALESCE;

/// What `outbox.stream_state` holds for one slot.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Recorded {
    /// The slot.
    pub slot: String,
    /// IDENTIFY_SYSTEM's `systemid` at the last session start.
    pub system_identifier: String,
    /// IDENTIFY_SYSTEM's `timeline` at the last session start.
    pub timeline: u32,
    /// The last flush LSN reported to the server (or about to be), `X/Y`.
    #[serde(serialize_with = "lsn_text")]
    pub flush_lsn: Lsn,
    /// When the row was last written, RFC 3339 UTC.
    pub updated_at: String,
    /// Gaps accepted with `--accept-gap`, oldest first.
    pub accepted_gaps: Vec<AcceptedGap>,
}

/// A gap started over with `--accept-gap`, as stored in `accepted_gaps`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, serde::Deserialize)]
pub struct AcceptedGap {
    /// The recorded flush LSN (`X/Y`): the last position known to be delivered.
    pub from_lsn: String,
    /// Where the slot began instead (`X/Y`).
    pub to_lsn: String,
    /// Why it is a gap (`slot_recreated`, `system_changed`).
    pub reason: String,
    /// When it was accepted, RFC 3339 UTC.
    pub accepted_at: String,
}

fn lsn_text<S: serde::Serializer>(lsn: &Lsn, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(&lsn.to_string())
}

/// Why the slot's history has a gap.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum GapReason {
    /// The slot now begins after the last flush LSN we reported: it was dropped and
    /// recreated (or advanced by someone else).
    SlotRecreated,
    /// IDENTIFY_SYSTEM names another cluster than the one recorded.
    SystemChanged {
        /// The recorded system identifier.
        recorded: String,
        /// The server's now.
        now: String,
    },
    /// The server was promoted (a higher timeline than the record's) and its slot begins
    /// after the record, but nothing proves that pgoutbox reported that position: the slot
    /// is not a synchronized failover slot, or it lies past the point where the server's
    /// timeline began.
    PromotedSlotUnproven {
        /// The record's timeline.
        recorded_timeline: u32,
        /// The server's timeline now.
        timeline: u32,
        /// What is missing from the proof, as one clause.
        missing: String,
    },
    /// The server is on a lower timeline than the record, or than a server of the same
    /// cluster this process already streamed from: an old primary that came back after a
    /// failover (its history after the switch point never happened on the new primary).
    TimelineBehind {
        /// The server's timeline now.
        timeline: u32,
        /// The highest timeline seen (the record's, or this process's).
        highest: u32,
    },
    /// `run --stream`: the broker stored publishing ids of our producer name from commits
    /// beyond this server's WAL end, so they were made from WAL this server does not have
    /// (a restore to an earlier point): ids at or below them would be dropped as
    /// duplicates of other messages (docs/src/internals/stream-ids.md).
    StreamAhead {
        /// The stream.
        stream: String,
        /// The producer name.
        producer: String,
    },
}

impl GapReason {
    /// The short name stored in `accepted_gaps.reason`.
    pub fn name(&self) -> &'static str {
        match self {
            GapReason::SlotRecreated => "slot_recreated",
            GapReason::SystemChanged { .. } => "system_changed",
            GapReason::PromotedSlotUnproven { .. } => "promoted_slot_unproven",
            GapReason::TimelineBehind { .. } => "timeline_behind",
            GapReason::StreamAhead { .. } => "stream_ahead_of_wal",
        }
    }
}

/// A range of the outbox that may never have been delivered.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Gap {
    /// The slot.
    pub slot: String,
    /// The recorded flush LSN: everything up to it was delivered.
    pub from: Lsn,
    /// Where the slot begins now (its `confirmed_flush_lsn`).
    pub to: Lsn,
    /// Why.
    pub reason: GapReason,
}

impl std::fmt::Display for Gap {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let why = match &self.reason {
            GapReason::SlotRecreated => format!(
                "slot {:?} now begins at {} but pgoutbox last reported {} as flushed (the slot was dropped and recreated, or advanced by someone else)",
                self.slot, self.to, self.from
            ),
            GapReason::SystemChanged { recorded, now } => format!(
                "the server's system identifier is {now}, but slot {:?} was streamed from system {recorded} (another cluster, restored from a logical dump or recreated)",
                self.slot
            ),
            GapReason::PromotedSlotUnproven {
                recorded_timeline,
                timeline,
                missing,
            } => format!(
                "this server was promoted (timeline {recorded_timeline} in outbox.stream_state, {timeline} now) and slot {:?} begins at {}, after the {} pgoutbox recorded, but {missing}, so nothing proves pgoutbox reported that position (see docs/src/operators/postgres-failover.md)",
                self.slot, self.to, self.from
            ),
            GapReason::TimelineBehind { timeline, highest } => format!(
                "this server is on timeline {timeline}, but slot {:?} was already streamed from timeline {highest} of the same cluster: it is an old primary that came back after a failover, and what it committed after the switch point is not in the new primary's history. Point the database URL at the current primary, or rebuild this server as a standby of it (pg_rewind or a new base backup); --accept-gap streams from it anyway",
                self.slot
            ),
            GapReason::StreamAhead { stream, producer } => format!(
                "stream {stream:?} holds messages of producer {producer:?} from commits up to {}, beyond this server's WAL end {}: they were published from WAL this server does not have (a restore to an earlier point, or another server). Their publishing ids would make the broker drop new messages as duplicates. --accept-gap starts a new producer name (the old one's messages stay in the stream)",
                self.to, self.from
            ),
        };
        match &self.reason {
            GapReason::StreamAhead { .. } => write!(
                f,
                "{why}: outbox messages committed from {} on would be lost",
                self.from
            ),
            // Nothing is missing there: what the old primary committed after the switch
            // point would be published although the current primary never had it.
            GapReason::TimelineBehind { .. } => write!(
                f,
                "{why}: events streamed from this server from {} on may contradict the current primary's database (phantom events)",
                self.from
            ),
            _ => write!(
                f,
                "{why}: outbox messages committed between {} and {} may never have been delivered",
                self.from, self.to
            ),
        }
    }
}

/// The slot as the gap rule sees it, read while this session holds it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SlotAt {
    /// Its `confirmed_flush_lsn`.
    pub confirmed_flush: Lsn,
    /// Whether the slot was copied by PostgreSQL's slot synchronization: `failover` and
    /// `synced` both true in `pg_replication_slots` (PostgreSQL 17+; false on older servers).
    pub sync: SlotSync,
}

/// Whether a slot's position came from PostgreSQL's slot synchronization.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SlotSync {
    /// `failover = true` and `synced = true`: a copy of a primary's failover slot, made by
    /// the slotsync worker of a standby (which this server then was).
    SyncedFailover,
    /// Anything else: an ordinary slot, a failover slot created here, or a server older
    /// than 17.
    NotSynced,
}

/// The server's history as the gap rule sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ServerHistory<'a> {
    /// IDENTIFY_SYSTEM's answer.
    pub identity: &'a SystemIdentity,
    /// Where the server's current timeline began: the last switch point in
    /// `TIMELINE_HISTORY` of its timeline (`None` on timeline 1, or when unknown).
    pub switch_point: Option<Lsn>,
    /// The highest timeline this process streamed from on this system (`None`: none yet,
    /// or another system).
    pub highest_seen: Option<u32>,
}

/// How the slot compares with the record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// No record yet (a new slot, or a database set up by an older version), or the slot
    /// begins exactly where the record says.
    Continuous,
    /// The slot begins before the recorded flush LSN (a server crash, a restored slot, a
    /// failover to a standby whose slot lags): only duplicates.
    SlotBehind {
        /// The slot's confirmed_flush_lsn.
        slot: Lsn,
        /// The recorded flush LSN.
        recorded: Lsn,
    },
    /// A promoted server whose synchronized failover slot begins after the record: the
    /// record's last write was in WAL the standby never received, while the slot holds a
    /// position pgoutbox reported (the proof is in docs/src/operators/postgres-failover.md).
    /// Nothing lost: go on from the slot and raise the record to it.
    PromotedAhead {
        /// The slot's confirmed_flush_lsn.
        slot: Lsn,
        /// The recorded flush LSN.
        recorded: Lsn,
        /// The record's timeline.
        recorded_timeline: u32,
        /// The server's timeline.
        timeline: u32,
        /// Where the server's timeline began.
        switch_point: Lsn,
    },
    /// A gap: refuse unless `--accept-gap`.
    Gap(Gap),
}

/// Compares the slot and the server's history with the record (the module doc has the
/// table; the proof of the promoted server's row is in docs/src/operators/postgres-failover.md).
pub fn assess(
    slot: &str,
    at: &SlotAt,
    server: &ServerHistory<'_>,
    record: Option<&Recorded>,
) -> Verdict {
    let identity = server.identity;
    let slot_confirmed = at.confirmed_flush;
    let gap = |from: Lsn, reason: GapReason| {
        Verdict::Gap(Gap {
            slot: slot.to_owned(),
            from,
            to: slot_confirmed,
            reason,
        })
    };
    if let Some(r) = record {
        if r.system_identifier != identity.system_id {
            return gap(
                r.flush_lsn,
                GapReason::SystemChanged {
                    recorded: r.system_identifier.clone(),
                    now: identity.system_id.clone(),
                },
            );
        }
    }
    // An old primary back after a failover: its own record may well match its slot, so
    // only the highest timeline seen (the record's, this process's) tells.
    let highest = record
        .map(|r| r.timeline)
        .into_iter()
        .chain(server.highest_seen)
        .max();
    if let Some(highest) = highest.filter(|h| *h > identity.timeline) {
        return gap(
            record.map_or(slot_confirmed, |r| r.flush_lsn),
            GapReason::TimelineBehind {
                timeline: identity.timeline,
                highest,
            },
        );
    }
    let Some(r) = record else {
        return Verdict::Continuous;
    };
    match slot_confirmed.cmp(&r.flush_lsn) {
        std::cmp::Ordering::Greater if identity.timeline > r.timeline => {
            let missing = match (at.sync, server.switch_point) {
                (SlotSync::NotSynced, _) => {
                    "the slot is not a synchronized failover slot (failover and synced are not both true in pg_replication_slots)".to_owned()
                }
                (SlotSync::SyncedFailover, None) => {
                    "the point where this server's timeline began is unknown (TIMELINE_HISTORY)".to_owned()
                }
                (SlotSync::SyncedFailover, Some(switch)) if slot_confirmed > switch => format!(
                    "it lies past {switch}, where this server's timeline began, so it was not synchronized while this server was a standby"
                ),
                (SlotSync::SyncedFailover, Some(switch_point)) => {
                    return Verdict::PromotedAhead {
                        slot: slot_confirmed,
                        recorded: r.flush_lsn,
                        recorded_timeline: r.timeline,
                        timeline: identity.timeline,
                        switch_point,
                    }
                }
            };
            gap(
                r.flush_lsn,
                GapReason::PromotedSlotUnproven {
                    recorded_timeline: r.timeline,
                    timeline: identity.timeline,
                    missing,
                },
            )
        }
        std::cmp::Ordering::Greater => gap(r.flush_lsn, GapReason::SlotRecreated),
        std::cmp::Ordering::Less => Verdict::SlotBehind {
            slot: slot_confirmed,
            recorded: r.flush_lsn,
        },
        std::cmp::Ordering::Equal => Verdict::Continuous,
    }
}

/// What this process saw of the server's history in its last session.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SeenHistory {
    /// IDENTIFY_SYSTEM's `systemid`.
    pub system_id: String,
    /// IDENTIFY_SYSTEM's `timeline`.
    pub timeline: u32,
    /// The highest timeline this process streamed from on this system: a server of it on
    /// a lower one is an old primary back after a failover ([`GapReason::TimelineBehind`]).
    pub highest_timeline: u32,
    /// The highest flush LSN this process recorded in `outbox.stream_state`.
    pub recorded: Lsn,
}

/// Why an in-process resume position was dropped.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ResumeDropped {
    /// Another system identifier.
    SystemChanged,
    /// Another timeline (a promoted standby).
    TimelineChanged {
        /// The last session's timeline.
        was: u32,
        /// The server's now.
        now: u32,
    },
    /// The server's WAL ends before the resume position (a restored data directory, a
    /// standby that lags).
    WalBehind {
        /// IDENTIFY_SYSTEM's `xlogpos`.
        xlogpos: Lsn,
    },
    /// The database's record is behind what this process recorded: the database went back
    /// in time (restored, or a standby that had not replayed it).
    RecordBehind {
        /// What the database holds now (`0/0`: no row for the slot).
        record: Lsn,
        /// What this process wrote.
        recorded: Lsn,
    },
}

/// The START_REPLICATION position for a session: the last session's settled LSN when the
/// server's history is the one this process streamed from, else `Err` with the reason (the
/// caller starts from the slot and applies the gap rule). `None` resume is `Ok(None)`.
///
/// # Errors
/// [`ResumeDropped`] when the history changed.
pub fn resume_position(
    resume: Option<Lsn>,
    seen: Option<&SeenHistory>,
    identity: &SystemIdentity,
    record: Option<Lsn>,
) -> Result<Option<Lsn>, ResumeDropped> {
    let Some(resume) = resume else {
        return Ok(None);
    };
    if let Some(seen) = seen {
        if seen.system_id != identity.system_id {
            return Err(ResumeDropped::SystemChanged);
        }
        if seen.timeline != identity.timeline {
            return Err(ResumeDropped::TimelineChanged {
                was: seen.timeline,
                now: identity.timeline,
            });
        }
        // No row at all is behind too: the database went back to before this process's
        // first record (restored from an older backup), or the row was deleted.
        let record = record.unwrap_or(Lsn::ZERO);
        if record < seen.recorded {
            return Err(ResumeDropped::RecordBehind {
                record,
                recorded: seen.recorded,
            });
        }
    }
    if identity.xlogpos < resume {
        return Err(ResumeDropped::WalBehind {
            xlogpos: identity.xlogpos,
        });
    }
    Ok(Some(resume))
}

/// Whether `outbox.stream_state` exists; creates it when missing (a database set up by an
/// older version), when this role may.
///
/// # Errors
/// [`Error::Precondition`] naming the fix (`pgoutbox setup` again) when it is missing and
/// cannot be created; [`Error::Sql`].
pub async fn ensure_table(client: &Client, schema: &SchemaName) -> Result<(), Error> {
    let exists: bool = client
        .query_one(
            &*schema.rewrite("SELECT to_regclass('outbox.stream_state') IS NOT NULL"),
            &[],
        )
        .await
        .map_err(|e| Error::sql(schema.rewrite("looking up outbox.stream_state"), e))?
        .get(0);
    if exists {
        return Ok(());
    }
    match client.batch_execute(&schema.rewrite(STREAM_STATE_SQL)).await {
        Ok(()) => {
            tracing::info!(schema = %schema, "created the stream_state table (this database was set up by an older pgoutbox)");
            Ok(())
        }
        Err(e) => Err(Error::Precondition(schema.rewrite(&format!(
            "table outbox.stream_state is missing (this database was set up by an older pgoutbox) and this role cannot create it ({}): run `pgoutbox setup` again (as the role that ran it before), then start `run`",
            e.as_db_error().map(|d| d.message().to_owned()).unwrap_or_else(|| e.to_string())
        )).into_owned())),
    }
}

/// How many gaps `--accept-gap` accepted for `slot` (0 without a record): `run --stream`
/// appends it to its default producer name.
///
/// # Errors
/// [`Error::Sql`].
pub async fn accepted_gap_count(
    client: &Client,
    schema: &SchemaName,
    slot: &str,
) -> Result<usize, Error> {
    Ok(load(client, schema, slot)
        .await?
        .map_or(0, |r| r.accepted_gaps.len()))
}

/// Reads the record of `slot` (`None`: no row, or no table).
///
/// # Errors
/// [`Error::Sql`].
pub async fn load(
    client: &Client,
    schema: &SchemaName,
    slot: &str,
) -> Result<Option<Recorded>, Error> {
    let row = client
        .query_opt(
            &*schema.rewrite(
                "SELECT system_identifier, timeline, flush_lsn::text,
                    to_char(updated_at AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS.US\"Z\"'),
                    accepted_gaps::text
             FROM outbox.stream_state WHERE slot_name = $1",
            ),
            &[&slot],
        )
        .await;
    let row = match row {
        Ok(row) => row,
        // 42P01: no table (a database set up by an older version).
        Err(e) if e.code().is_some_and(|c| c.code() == "42P01") => return Ok(None),
        Err(e) => return Err(Error::sql(schema.rewrite("reading outbox.stream_state"), e)),
    };
    let Some(row) = row else {
        return Ok(None);
    };
    let flush: String = row.get(2);
    let timeline: i32 = row.get(1);
    let gaps: String = row.get(4);
    Ok(Some(Recorded {
        slot: slot.to_owned(),
        system_identifier: row.get(0),
        timeline: u32::try_from(timeline).unwrap_or_default(),
        flush_lsn: flush.parse().unwrap_or_default(),
        updated_at: row.get(3),
        accepted_gaps: serde_json::from_str(&gaps).unwrap_or_default(),
    }))
}

/// Writes the session start: identity, the flush LSN about to be reported first, and
/// (with `--accept-gap`) the gap accepted. One committed statement.
///
/// # Errors
/// [`Error::Sql`].
pub async fn record_start(
    client: &Client,
    schema: &SchemaName,
    slot: &str,
    identity: &SystemIdentity,
    flush: Lsn,
    gap: Option<&Gap>,
) -> Result<(), Error> {
    let gap_json = gap
        .map(|g| {
            serde_json::json!([{
                "from_lsn": g.from.to_string(),
                "to_lsn": g.to.to_string(),
                "reason": g.reason.name(),
            }])
            .to_string()
        })
        .unwrap_or_else(|| "[]".into());
    let timeline = i32::try_from(identity.timeline).unwrap_or(i32::MAX);
    client
        .execute(
            &*schema.rewrite("INSERT INTO outbox.stream_state AS s
                 (slot_name, system_identifier, timeline, flush_lsn, updated_at, accepted_gaps)
             VALUES ($1, $2, $3, $4::text::pg_lsn, now(),
                     (SELECT coalesce(jsonb_agg(g || jsonb_build_object('accepted_at',
                          to_char(now() AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS\"Z\"'))), '[]'::jsonb)
                      FROM jsonb_array_elements($5::text::jsonb) g))
             ON CONFLICT (slot_name) DO UPDATE SET
                 system_identifier = EXCLUDED.system_identifier,
                 timeline = EXCLUDED.timeline,
                 flush_lsn = EXCLUDED.flush_lsn,
                 updated_at = EXCLUDED.updated_at,
                 accepted_gaps = s.accepted_gaps || EXCLUDED.accepted_gaps"),
            &[
                &slot,
                &identity.system_id,
                &timeline,
                &flush.to_string(),
                &gap_json,
            ],
        )
        .await
        .map_err(|e| {
            if e.code().is_some_and(|c| c.code() == "42501") {
                return Error::Precondition(schema.rewrite(&format!(
                    "this role may not write outbox.stream_state ({}); as the owner of schema outbox or a superuser, run: GRANT SELECT, INSERT, UPDATE ON outbox.stream_state TO <the role pgoutbox runs as> (sql/roles.example.sql grants the same)",
                    e.as_db_error().map(|d| d.message().to_owned()).unwrap_or_default()
                )).into_owned());
            }
            Error::sql(schema.rewrite("writing outbox.stream_state at session start"), e)
        })?;
    Ok(())
}

/// Raises the recorded flush LSN (never lowers it). One committed statement.
///
/// # Errors
/// [`Error::Sql`].
pub async fn record_flush(
    client: &Client,
    schema: &SchemaName,
    slot: &str,
    flush: Lsn,
) -> Result<(), Error> {
    client
        .execute(
            &*schema.rewrite(
                "UPDATE outbox.stream_state SET flush_lsn = $2::text::pg_lsn, updated_at = now()
             WHERE slot_name = $1 AND flush_lsn < $2::text::pg_lsn",
            ),
            &[&slot, &flush.to_string()],
        )
        .await
        .map_err(|e| Error::sql(schema.rewrite("writing outbox.stream_state"), e))?;
    Ok(())
}

/// Deletes the record of `slot` (`teardown`); a missing table is fine.
///
/// # Errors
/// [`Error::Sql`].
pub async fn forget(client: &Client, schema: &SchemaName, slot: &str) -> Result<(), Error> {
    match client
        .execute(
            &*schema.rewrite("DELETE FROM outbox.stream_state WHERE slot_name = $1"),
            &[&slot],
        )
        .await
    {
        Ok(_) => Ok(()),
        Err(e) if e.code().is_some_and(|c| c.code() == "42P01") => Ok(()),
        Err(e) => Err(Error::sql(
            schema.rewrite("deleting the slot's row in outbox.stream_state"),
            e,
        )),
    }
}

/// The START_REPLICATION position for a session of a process that streamed before: the
/// last session's settled LSN when [`resume_position`] keeps it, else `0/0` (the slot's
/// own position), with a warning naming why.
///
/// # Errors
/// [`Error::Sql`] when the record cannot be read.
pub async fn start_hint(
    client: &Client,
    schema: &SchemaName,
    slot: &str,
    resume: Option<Lsn>,
    seen: Option<&SeenHistory>,
    identity: &SystemIdentity,
) -> Result<Lsn, Error> {
    let Some(at) = resume else {
        return Ok(Lsn::ZERO);
    };
    let record = load(client, schema, slot).await?.map(|r| r.flush_lsn);
    Ok(match resume_position(resume, seen, identity, record) {
        Ok(kept) => kept.unwrap_or(Lsn::ZERO),
        Err(why) => {
            tracing::warn!(
                resume_lsn = %at,
                reason = ?why,
                system_id = %identity.system_id,
                timeline = identity.timeline,
                xlogpos = %identity.xlogpos,
                "the server's history is not the one this process streamed from (restored, failed over or replaced): not resuming from the last settled LSN; starting from the slot and checking it against outbox.stream_state"
            );
            Lsn::ZERO
        }
    })
}

/// Where a session's START_REPLICATION position came from ([`start_hint`]), which decides
/// whether a slot behind the record means messages sent again.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StartFrom {
    /// The slot's own position: the process's first session, or one whose in-process resume
    /// position was dropped (another system or timeline, a record behind). Whatever lies
    /// between the slot and the record is published again.
    Slot,
    /// This process's last settled position (the LSN asked for), on the server it streamed
    /// from: what it settled above the slot is acknowledged without being sent again
    /// (`pipeline::delivered`), so a slot behind the record (the last status update not yet
    /// applied when the session ended, as after a broker restart) costs no duplicate.
    OwnResume(Lsn),
}

/// The session start, once the slot is held: applies the gap rule ([`assess`]) to the
/// slot (`at`) and the server's history, records the session (`start` is the first flush
/// LSN to be reported; on a promoted server whose synchronized slot is ahead of the record,
/// the slot's position) and starts the [`recorder`] on `client`. `from` says whether this
/// process resumes its own history: only when it does not is a slot behind the record
/// reported as messages sent again (a warning).
///
/// `stream_stored` (`run --stream`): the commit LSN of the highest publishing id the broker
/// stored for the producer name, and the name; a commit beyond the server's WAL end is a gap
/// ([`GapReason::StreamAhead`]). The answer's `bool` is true when a gap was accepted
/// (`--accept-gap`) just now.
///
/// # Errors
/// [`Error::Gap`] when the slot's history has a gap and `config.postgres.accept_gap` is off;
/// [`Error::Sql`].
pub async fn session_start(
    client: Client,
    config: &crate::config::RunConfig,
    server: &ServerHistory<'_>,
    at: &SlotAt,
    start: Lsn,
    from: StartFrom,
    stream_stored: Option<(Lsn, &str)>,
) -> Result<(FlushGate, RecordedHandle, bool), Error> {
    let slot = config.postgres.slot.as_str();
    let schema = &config.postgres.schema;
    // Like the dead letters: never wait for a synchronous standby that may be us.
    client
        .batch_execute("SET synchronous_commit = local")
        .await
        .map_err(|e| Error::sql("setting synchronous_commit for outbox.stream_state", e))?;
    let record = load(&client, schema, slot).await?;
    let mut accepted = None;
    let mut verdict = assess(slot, at, server, record.as_ref());
    if let (Some((stored, producer)), Some(stream)) = (stream_stored, &config.broker.stream) {
        if stored > server.identity.xlogpos && !matches!(verdict, Verdict::Gap(_)) {
            verdict = Verdict::Gap(Gap {
                slot: slot.to_owned(),
                from: server.identity.xlogpos,
                to: stored,
                reason: GapReason::StreamAhead {
                    stream: stream.stream.clone(),
                    producer: producer.to_owned(),
                },
            });
        }
    }
    match verdict {
        Verdict::Continuous => {}
        Verdict::SlotBehind { slot: at, recorded } if start < recorded => match from {
            StartFrom::OwnResume(resume) => tracing::debug!(
                slot,
                slot_confirmed_flush_lsn = %at,
                recorded_flush_lsn = %recorded,
                resume_lsn = %resume,
                "the slot begins before the flush LSN recorded in outbox.stream_state (its last status update was not applied before the session ended): this process settled the messages between them and acknowledges them without sending them again"
            ),
            StartFrom::Slot => tracing::warn!(
                slot,
                slot_confirmed_flush_lsn = %at,
                recorded_flush_lsn = %recorded,
                "the slot begins before the flush LSN pgoutbox last reported (a server crash, a restored slot or a failover): messages between them are sent again (duplicates, nothing lost)"
            ),
        },
        Verdict::SlotBehind { .. } => {}
        Verdict::PromotedAhead {
            slot: at,
            recorded,
            recorded_timeline,
            timeline,
            switch_point,
        } => {
            tracing::info!(
                slot,
                slot_confirmed_flush_lsn = %at,
                recorded_flush_lsn = %recorded,
                recorded_timeline,
                timeline,
                switch_point = %switch_point,
                "this server was promoted and its synchronized failover slot begins after the flush LSN recorded here (the record's last write was in WAL the standby never received): the slot holds a position pgoutbox reported, so nothing was lost; going on from the slot and recording it"
            );
        }
        Verdict::Gap(gap) if !config.postgres.accept_gap => return Err(Error::Gap(gap)),
        Verdict::Gap(gap) => {
            tracing::error!(
                slot,
                gap_from_lsn = %gap.from,
                gap_to_lsn = %gap.to,
                reason = gap.reason.name(),
                "starting despite a gap in the slot's history (--accept-gap): {gap}; recorded in outbox.stream_state"
            );
            accepted = Some(gap);
        }
    }
    record_start(
        &client,
        schema,
        slot,
        server.identity,
        start,
        accepted.as_ref(),
    )
    .await?;
    let accepted_gap = accepted.is_some();
    let (gate, recorded) = recorder(client, schema.clone(), slot.to_owned(), start);
    Ok((gate, recorded, accepted_gap))
}

/// Whether `slot` is a synchronized failover slot (`failover` and `synced` true in
/// `pg_replication_slots`; both columns are PostgreSQL 17's, read through `to_jsonb` so that
/// an older server answers [`SlotSync::NotSynced`]).
///
/// # Errors
/// [`Error::Sql`].
pub async fn slot_sync(client: &Client, slot: &str) -> Result<SlotSync, Error> {
    let synced: Option<bool> = client
        .query_opt(
            "SELECT coalesce((to_jsonb(s) ->> 'failover')::bool AND (to_jsonb(s) ->> 'synced')::bool, false)
             FROM pg_replication_slots s WHERE s.slot_name = $1",
            &[&slot],
        )
        .await
        .map_err(|e| Error::sql("reading the slot's failover and synced flags", e))?
        .map(|r| r.get(0));
    Ok(if synced == Some(true) {
        SlotSync::SyncedFailover
    } else {
        SlotSync::NotSynced
    })
}

/// A gap `status` sees before `run` does, for its report.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct GapReport {
    /// The recorded flush LSN, `X/Y`.
    pub from_lsn: String,
    /// Where the slot begins now, `X/Y`.
    pub to_lsn: String,
    /// [`GapReason::name`]: `slot_recreated`, `system_changed`, `promoted_slot_unproven`
    /// or `timeline_behind`.
    pub reason: String,
    /// The whole explanation, as `run`'s refusal words it.
    pub message: String,
}

/// For `status`: the record of `slot` and the gap `run` would refuse, from the slot's
/// `confirmed_flush_lsn` and flags, `pg_control_system()` (the system identifier check is
/// skipped when that function may not be called) and the timeline of the current WAL file
/// (the record's on a standby). A SQL session cannot run `TIMELINE_HISTORY`, so a
/// synchronized failover slot ahead of the record on a promoted server is taken to lie
/// before the switch point: `run` checks that too, and refuses in the rare case it does not.
///
/// # Errors
/// [`Error::Sql`] when the record cannot be read.
pub async fn inspect(
    client: &Client,
    schema: &SchemaName,
    slot: &str,
    confirmed_flush_lsn: Option<&str>,
) -> Result<(Option<Recorded>, Option<GapReport>), Error> {
    let Some(record) = load(client, schema, slot).await? else {
        return Ok((None, None));
    };
    let system_id = client
        .query_one(
            "SELECT system_identifier::text FROM pg_control_system()",
            &[],
        )
        .await
        .map(|r| r.get::<_, String>(0))
        .unwrap_or_else(|_| record.system_identifier.clone());
    // The first 8 hex digits of a WAL file's name are its timeline.
    let timeline = client
        .query_one(
            "SELECT CASE WHEN pg_is_in_recovery() THEN NULL
                    ELSE ('x' || substr(pg_walfile_name(pg_current_wal_lsn()), 1, 8))::bit(32)::int END",
            &[],
        )
        .await
        .ok()
        .and_then(|r| r.get::<_, Option<i32>>(0))
        .and_then(|t| u32::try_from(t).ok())
        .unwrap_or(record.timeline);
    let identity = SystemIdentity {
        system_id,
        timeline,
        xlogpos: Lsn::ZERO,
        dbname: None,
    };
    let sync = slot_sync(client, slot).await.unwrap_or(SlotSync::NotSynced);
    let gap = confirmed_flush_lsn
        .and_then(|c| c.parse::<Lsn>().ok())
        .and_then(|confirmed_flush| {
            let at = SlotAt {
                confirmed_flush,
                sync,
            };
            let server = ServerHistory {
                identity: &identity,
                switch_point: Some(confirmed_flush),
                highest_seen: None,
            };
            match assess(slot, &at, &server, Some(&record)) {
                Verdict::Gap(g) => Some(GapReport {
                    from_lsn: g.from.to_string(),
                    to_lsn: g.to.to_string(),
                    reason: g.reason.name().to_owned(),
                    message: g.to_string(),
                }),
                _ => None,
            }
        });
    Ok((Some(record), gap))
}

/// The pipeline's side of the record: what it would like to report, and what it may.
///
/// [`FlushGate::want`] is called once per loop turn with the watermark; [`FlushGate::allowed`]
/// is read when a standby status update is built, which reports `min(watermark, allowed)`.
#[derive(Debug)]
pub struct FlushGate {
    wanted: watch::Sender<Lsn>,
    recorded: watch::Receiver<Lsn>,
    last_wanted: Lsn,
    /// The end LSN of the last commit seen in the stream ([`FlushGate::note_commit`]).
    last_commit_end: Lsn,
}

/// How far the flush LSN may move over WAL without outbox commits (primary keepalives
/// only) before it is recorded: 64 KiB. The reported flush LSN may pass the record only by
/// recording it first (the gap rule reads a slot ahead of the record as lost history), so
/// this is how far an idle slot may stay behind the server's WAL: at most 64 KiB plus the
/// record's own last write. It must stay well above that write (a few hundred bytes, or a
/// full-page image of about 8 KiB after a checkpoint), which the next keepalive reports:
/// otherwise each record would ask for the next one, and an idle streamer would write its
/// record every [`RECORD_INTERVAL`] for ever. Other WAL (another database's, unpublished
/// tables') costs one record write of a few hundred bytes per 64 KiB of it, under 1 %.
pub const IDLE_RECORD_SLACK: u64 = 64 << 10;

impl FlushGate {
    /// The flush LSN that may be reported now (committed to `outbox.stream_state`).
    pub fn allowed(&self) -> Lsn {
        *self.recorded.borrow()
    }

    /// Whether the recorder ended because its SQL connection closed (PostgreSQL shutting
    /// down or restarting): nothing more can be recorded, so nothing more may be reported,
    /// and the session should end (a fast shutdown waits for our flush position).
    pub fn recorder_gone(&self) -> bool {
        self.recorded.has_changed().is_err()
    }

    /// Resolves when the recorder committed a higher position than the last one this
    /// resolved for, or when the recorder ended (then at once, every time:
    /// [`FlushGate::recorder_gone`] tells the two apart, and the session ends).
    ///
    /// # Cancel safety
    /// Cancel safe (`watch::Receiver::changed`).
    pub async fn recorded_changed(&mut self) {
        let _ = self.recorded.changed().await;
    }

    /// Notes a commit seen in the stream (its end LSN): a flush position past it is
    /// recorded promptly.
    pub fn note_commit(&mut self, end_lsn: Lsn) {
        self.last_commit_end = self.last_commit_end.max(end_lsn);
    }

    /// Asks the recorder to record `flush` when it moved forward over a commit, or by at
    /// least [`IDLE_RECORD_SLACK`] bytes of WAL without one (no-op otherwise: what is
    /// reported then stays at the record, which is always allowed).
    pub fn want(&mut self, flush: Lsn) {
        if flush <= self.last_wanted {
            return;
        }
        // The watermark passes a commit beyond last_wanted only by confirming it, or by a
        // keepalive once nothing is in flight (then every commit seen is at or below it):
        // either way a commit lies in (last_wanted, flush] when one was seen past last_wanted.
        let over_commit = self.last_commit_end > self.last_wanted;
        let far = flush.0.saturating_sub(self.last_wanted.0) >= IDLE_RECORD_SLACK;
        if over_commit || far {
            self.force(flush);
        }
    }

    fn force(&mut self, flush: Lsn) {
        if flush > self.last_wanted {
            self.last_wanted = flush;
            self.wanted.send_replace(flush);
        }
    }

    /// Asks for `flush` and waits up to `timeout` for it to be recorded (the final update
    /// of a shutdown). Returns what may be reported then.
    ///
    /// # Cancel safety
    /// Cancel safe.
    pub async fn settle(&mut self, flush: Lsn, timeout: Duration) -> Lsn {
        self.force(flush);
        let _ = tokio::time::timeout(timeout, self.recorded.wait_for(|r| *r >= flush)).await;
        self.allowed()
    }
}

/// Starts the recorder task on `client` (whose session start already recorded `start`):
/// it raises `flush_lsn` to what the gate wants, at most every [`RECORD_INTERVAL`], and
/// ends when the gate is dropped. A failed write is logged and retried after
/// [`RECORD_INTERVAL`] × 5; until it succeeds nothing beyond the record is reported. It
/// also ends when its SQL session closes, idle or not ([`FlushGate::recorder_gone`]), and
/// the session then ends.
///
/// Returns the gate and a handle to the highest position recorded so far.
pub fn recorder(
    client: Client,
    schema: SchemaName,
    slot: String,
    start: Lsn,
) -> (FlushGate, RecordedHandle) {
    let (wanted_tx, mut wanted_rx) = watch::channel(start);
    let (recorded_tx, recorded_rx) = watch::channel(start);
    let handle = RecordedHandle(recorded_rx.clone());
    tokio::spawn(async move {
        let client = client;
        loop {
            tokio::select! {
                changed = wanted_rx.changed() => {
                    if changed.is_err() {
                        return;
                    }
                }
                // An idle recorder has nothing to write, so only this notices its SQL
                // session ending (a PostgreSQL shutdown terminates it first): the gate
                // then reports the recorder gone and the session ends at once, instead of
                // keeping a fast shutdown waiting for a flush position it cannot record.
                () = closed(&client) => {
                    tracing::debug!("the SQL session recording the flush LSN closed");
                    return;
                }
            }
            let target = *wanted_rx.borrow_and_update();
            if target <= *recorded_tx.borrow() {
                continue;
            }
            match record_flush(&client, &schema, &slot, target).await {
                Ok(()) => {
                    recorded_tx.send_replace(target);
                    tokio::time::sleep(RECORD_INTERVAL).await;
                }
                Err(e) => {
                    tracing::warn!(error = %crate::report::one_line(&e), flush_lsn = %target, "could not record the flush LSN in outbox.stream_state; not reporting it yet");
                    if client.is_closed() {
                        return;
                    }
                    tokio::time::sleep(RECORD_INTERVAL * 5).await;
                    // Try again with whatever is wanted then.
                    wanted_rx.mark_changed();
                }
            }
        }
    });
    (
        FlushGate {
            wanted: wanted_tx,
            recorded: recorded_rx,
            last_wanted: start,
            last_commit_end: Lsn::ZERO,
        },
        handle,
    )
}

/// How often an idle recorder checks that its SQL session is still open.
const CLOSED_POLL: Duration = Duration::from_millis(100);

/// Resolves once `client`'s connection has closed (checked every [`CLOSED_POLL`]; a
/// local flag, no round trip).
///
/// # Cancel safety
/// Cancel safe: it only sleeps and reads a flag.
async fn closed(client: &Client) {
    while !client.is_closed() {
        tokio::time::sleep(CLOSED_POLL).await;
    }
}

/// The highest flush LSN the recorder committed (kept by the driver across sessions).
#[derive(Debug, Clone)]
pub struct RecordedHandle(watch::Receiver<Lsn>);

impl RecordedHandle {
    /// What is recorded now.
    pub fn get(&self) -> Lsn {
        *self.0.borrow()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn identity(system: &str, timeline: u32, xlogpos: u64) -> SystemIdentity {
        SystemIdentity {
            system_id: system.into(),
            timeline,
            xlogpos: Lsn(xlogpos),
            dbname: None,
        }
    }

    fn record(system: &str, flush: u64) -> Recorded {
        record_on(system, 1, flush)
    }

    fn record_on(system: &str, timeline: u32, flush: u64) -> Recorded {
        Recorded {
            slot: "s".into(),
            system_identifier: system.into(),
            timeline,
            flush_lsn: Lsn(flush),
            updated_at: String::new(),
            accepted_gaps: vec![],
        }
    }

    fn plain(lsn: u64) -> SlotAt {
        SlotAt {
            confirmed_flush: Lsn(lsn),
            sync: SlotSync::NotSynced,
        }
    }

    fn synced(lsn: u64) -> SlotAt {
        SlotAt {
            confirmed_flush: Lsn(lsn),
            sync: SlotSync::SyncedFailover,
        }
    }

    /// The server as `run` sees it: no switch point on timeline 1, else `switch`.
    fn server(identity: &SystemIdentity, switch: Option<u64>) -> ServerHistory<'_> {
        ServerHistory {
            identity,
            switch_point: switch.map(Lsn),
            highest_seen: None,
        }
    }

    fn judge(at: SlotAt, identity: SystemIdentity, record: Option<&Recorded>) -> Verdict {
        let switch = (identity.timeline > 1).then_some(0x1000);
        assess("s", &at, &server(&identity, switch), record)
    }

    fn gap_reason(v: &Verdict) -> &GapReason {
        match v {
            Verdict::Gap(g) => &g.reason,
            other => panic!("not a gap: {other:?}"),
        }
    }

    #[test]
    fn a_slot_ahead_of_the_record_is_a_gap_naming_both_lsns() {
        let v = judge(
            plain(0x200),
            identity("7", 1, 0x300),
            Some(&record("7", 0x100)),
        );
        let Verdict::Gap(gap) = v else {
            panic!("{v:?}")
        };
        assert_eq!((gap.from, gap.to), (Lsn(0x100), Lsn(0x200)));
        assert_eq!(gap.reason, GapReason::SlotRecreated);
        let text = gap.to_string();
        assert!(text.contains("between 0/100 and 0/200"), "{text}");
        // On the same timeline even a synchronized failover slot ahead is a gap: the slot
        // on a primary moves only by pgoutbox's reports, which never pass the record.
        assert_eq!(
            gap_reason(&judge(
                synced(0x200),
                identity("7", 1, 0x300),
                Some(&record("7", 0x100))
            )),
            &GapReason::SlotRecreated
        );
        assert_eq!(
            judge(
                plain(0x100),
                identity("7", 2, 0x300),
                Some(&record("7", 0x100))
            ),
            Verdict::Continuous
        );
        assert_eq!(
            judge(
                plain(0x80),
                identity("7", 1, 0x300),
                Some(&record("7", 0x100))
            ),
            Verdict::SlotBehind {
                slot: Lsn(0x80),
                recorded: Lsn(0x100)
            }
        );
        assert_eq!(
            judge(plain(0x80), identity("7", 1, 0x300), None),
            Verdict::Continuous
        );
        let v = judge(
            plain(0x80),
            identity("8", 1, 0x300),
            Some(&record("7", 0x100)),
        );
        assert!(
            matches!(gap_reason(&v), GapReason::SystemChanged { .. }),
            "{v:?}"
        );
    }

    #[test]
    fn a_promoted_server_whose_synced_slot_is_behind_the_record_replays() {
        // Synced or not, a slot behind the record on a higher timeline re-sends: duplicates.
        for at in [synced(0x80), plain(0x80)] {
            assert_eq!(
                judge(at, identity("7", 2, 0x2000), Some(&record("7", 0x100))),
                Verdict::SlotBehind {
                    slot: Lsn(0x80),
                    recorded: Lsn(0x100)
                }
            );
        }
    }

    #[test]
    fn a_promoted_server_whose_synced_slot_is_ahead_of_the_record_goes_on() {
        let id = identity("7", 2, 0x2000);
        let v = assess(
            "s",
            &synced(0x800),
            &server(&id, Some(0x1000)),
            Some(&record("7", 0x100)),
        );
        assert_eq!(
            v,
            Verdict::PromotedAhead {
                slot: Lsn(0x800),
                recorded: Lsn(0x100),
                recorded_timeline: 1,
                timeline: 2,
                switch_point: Lsn(0x1000),
            }
        );
        // Exactly at the switch point is still the shared history.
        assert!(matches!(
            assess(
                "s",
                &synced(0x1000),
                &server(&id, Some(0x1000)),
                Some(&record("7", 0x100))
            ),
            Verdict::PromotedAhead { .. }
        ));
        // Several promotions since the record (timeline 1 to 4): the same proof.
        let id4 = identity("7", 4, 0x9000);
        assert!(matches!(
            assess(
                "s",
                &synced(0x800),
                &server(&id4, Some(0x5000)),
                Some(&record("7", 0x100))
            ),
            Verdict::PromotedAhead { timeline: 4, .. }
        ));
    }

    #[test]
    fn a_promoted_server_whose_slot_ahead_is_not_provably_ours_is_a_gap() {
        let id = identity("7", 2, 0x2000);
        let rec = record("7", 0x100);
        // An ordinary slot (or a failover slot created on the new primary).
        let v = assess("s", &plain(0x800), &server(&id, Some(0x1000)), Some(&rec));
        let GapReason::PromotedSlotUnproven {
            recorded_timeline,
            timeline,
            missing,
        } = gap_reason(&v)
        else {
            panic!("{v:?}")
        };
        assert_eq!((*recorded_timeline, *timeline), (1, 2));
        assert!(
            missing.contains("not a synchronized failover slot"),
            "{missing}"
        );
        let text = v_text(&v);
        assert!(text.contains("between 0/100 and 0/800"), "{text}");
        assert!(
            text.contains("timeline 1 in outbox.stream_state, 2 now"),
            "{text}"
        );
        // Past the switch point: not synchronized while the server was a standby.
        let v = assess("s", &synced(0x1001), &server(&id, Some(0x1000)), Some(&rec));
        assert!(v_text(&v).contains("lies past 0/1000"), "{v:?}");
        // No switch point known.
        let v = assess("s", &synced(0x800), &server(&id, None), Some(&rec));
        assert!(v_text(&v).contains("unknown"), "{v:?}");
    }

    fn v_text(v: &Verdict) -> String {
        match v {
            Verdict::Gap(g) => g.to_string(),
            other => panic!("not a gap: {other:?}"),
        }
    }

    #[test]
    fn a_server_on_a_lower_timeline_than_seen_is_an_old_primary_and_a_gap() {
        // The record was written on timeline 3; this server is on 2.
        let id = identity("7", 2, 0x2000);
        let v = assess(
            "s",
            &plain(0x100),
            &server(&id, Some(0x1000)),
            Some(&record_on("7", 3, 0x100)),
        );
        assert_eq!(
            gap_reason(&v),
            &GapReason::TimelineBehind {
                timeline: 2,
                highest: 3
            }
        );
        let text = v_text(&v);
        assert!(text.contains("old primary"), "{text}");
        assert!(text.contains("rebuild this server as a standby"), "{text}");
        assert!(
            text.contains("phantom events") && !text.contains("never have been delivered"),
            "{text}"
        );
        // Its own record agrees with it, but this process streamed from timeline 3: the old
        // primary came back after a failover this process followed.
        let old = identity("7", 1, 0x2000);
        let v = assess(
            "s",
            &plain(0x500),
            &ServerHistory {
                identity: &old,
                switch_point: None,
                highest_seen: Some(3),
            },
            Some(&record_on("7", 1, 0x500)),
        );
        assert_eq!(
            gap_reason(&v),
            &GapReason::TimelineBehind {
                timeline: 1,
                highest: 3
            }
        );
        // Even with no record at all.
        let v = assess(
            "s",
            &plain(0x500),
            &ServerHistory {
                identity: &old,
                switch_point: None,
                highest_seen: Some(2),
            },
            None,
        );
        assert!(matches!(gap_reason(&v), GapReason::TimelineBehind { .. }));
        // The same or a higher timeline than seen is fine.
        let v = assess(
            "s",
            &plain(0x500),
            &ServerHistory {
                identity: &identity("7", 3, 0x2000),
                switch_point: Some(Lsn(0x1000)),
                highest_seen: Some(3),
            },
            Some(&record_on("7", 3, 0x500)),
        );
        assert_eq!(v, Verdict::Continuous);
        // Another system: its own gap, whatever its timeline.
        let v = assess(
            "s",
            &plain(0x500),
            &server(&identity("8", 1, 0x2000), None),
            Some(&record_on("7", 3, 0x500)),
        );
        assert!(matches!(gap_reason(&v), GapReason::SystemChanged { .. }));
    }

    #[test]
    fn the_resume_position_survives_only_the_same_history() {
        let seen = SeenHistory {
            system_id: "7".into(),
            timeline: 1,
            highest_timeline: 1,
            recorded: Lsn(0x500),
        };
        let same = identity("7", 1, 0x900);
        assert_eq!(
            resume_position(Some(Lsn(0x500)), Some(&seen), &same, Some(Lsn(0x500))),
            Ok(Some(Lsn(0x500)))
        );
        assert_eq!(resume_position(None, Some(&seen), &same, None), Ok(None));
        assert_eq!(
            resume_position(
                Some(Lsn(0x500)),
                Some(&seen),
                &identity("8", 1, 0x900),
                None
            ),
            Err(ResumeDropped::SystemChanged)
        );
        assert_eq!(
            resume_position(
                Some(Lsn(0x500)),
                Some(&seen),
                &identity("7", 2, 0x900),
                None
            ),
            Err(ResumeDropped::TimelineChanged { was: 1, now: 2 })
        );
        // A restored data directory: its WAL ends before where we were.
        assert_eq!(
            resume_position(
                Some(Lsn(0x500)),
                Some(&seen),
                &identity("7", 1, 0x300),
                Some(Lsn(0x500))
            ),
            Err(ResumeDropped::WalBehind {
                xlogpos: Lsn(0x300)
            })
        );
        // A database without the slot's row (restored from before the first record, or the
        // row deleted) is behind what this process recorded.
        assert_eq!(
            resume_position(Some(Lsn(0x500)), Some(&seen), &same, None),
            Err(ResumeDropped::RecordBehind {
                record: Lsn::ZERO,
                recorded: Lsn(0x500)
            })
        );
        // ... and once its WAL grew past that again, its older record still tells.
        assert_eq!(
            resume_position(Some(Lsn(0x500)), Some(&seen), &same, Some(Lsn(0x200))),
            Err(ResumeDropped::RecordBehind {
                record: Lsn(0x200),
                recorded: Lsn(0x500)
            })
        );
    }
}
