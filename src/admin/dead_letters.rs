//! `outbox.dead_letter`: the row the streamer writes, and the `dead-letters` commands (list,
//! requeue, purge). The streamer's writer session lives in `pipeline::dead_letter`.

use serde::Serialize;
use tokio_postgres::Client;

use crate::error::Error;
use crate::lsn::Lsn;
use crate::outbox_schema::{MessagePrefix, SchemaName};

/// One row of `outbox.dead_letter`, as `dead-letters list` shows it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct DeadLetter {
    /// Row id (for `requeue --id` and `purge --id`).
    pub id: i64,
    /// The message id, if the envelope could be decoded.
    pub message_id: Option<String>,
    /// The topic (routing key), if decoded.
    pub topic: Option<String>,
    /// The message's LSN, `X/Y`.
    pub lsn: String,
    /// `nacked`, `returned`, `poison` or `too_large`.
    pub reason: String,
    /// Publish attempts made.
    pub attempts: i32,
    /// The first error.
    pub first_error: Option<String>,
    /// The last error.
    pub last_error: Option<String>,
    /// When it was dead-lettered (RFC 3339 text).
    pub dead_lettered_at: String,
    /// When it was requeued, if it was.
    pub requeued_at: Option<String>,
}

/// A dead letter about to be written by the streamer.
#[derive(Debug, Clone)]
pub struct NewDeadLetter<'a> {
    /// The message id, if decoded.
    pub message_id: Option<&'a str>,
    /// The topic, if decoded.
    pub topic: Option<&'a str>,
    /// The message's LSN.
    pub lsn: Lsn,
    /// Its transaction's commit LSN, if it was in one.
    pub commit_lsn: Option<Lsn>,
    /// The logical message content exactly as emitted.
    pub envelope: &'a [u8],
    /// `nacked`, `returned`, `poison` or `too_large`.
    pub reason: &'a str,
    /// Publish attempts made (0 when never published).
    pub attempts: i32,
    /// The first error.
    pub first_error: Option<&'a str>,
    /// The last error.
    pub last_error: &'a str,
}

/// Writes one dead letter and returns once it is committed. A second write for the same
/// LSN (a replay after a crash) is a no-op.
///
/// # Errors
/// [`Error::Sql`] (for example when `outbox.dead_letter` is missing: run `pgoutbox setup`).
pub async fn write_dead_letter(
    client: &Client,
    schema: &SchemaName,
    dl: &NewDeadLetter<'_>,
) -> Result<(), Error> {
    let lsn = dl.lsn.to_string();
    let commit_lsn = dl.commit_lsn.map(|l| l.to_string());
    client
        .execute(
            &*schema.rewrite("INSERT INTO outbox.dead_letter
                (message_id, topic, lsn, commit_lsn, envelope, reason, attempts, first_error, last_error)
             VALUES ($1, $2, $3::text::pg_lsn, $4::text::pg_lsn, $5, $6, $7, $8, $9)
             ON CONFLICT (lsn) DO NOTHING"),
            &[
                &dl.message_id,
                &dl.topic,
                &lsn,
                &commit_lsn,
                &dl.envelope,
                &dl.reason,
                &dl.attempts,
                &dl.first_error,
                &dl.last_error,
            ],
        )
        .await
        .map_err(|e| Error::sql(format!("writing a dead letter to {}{}", schema.qualify("dead_letter"), dead_letter_hint(&e)), e))?;
    Ok(())
}

/// A hint for a failed statement on `outbox.dead_letter`: run `setup` when the table or
/// schema is missing (`42P01`, `3F000`), grant when a privilege is (`42501`).
fn dead_letter_hint(e: &tokio_postgres::Error) -> &'static str {
    match e.code().map(|c| c.code()) {
        Some("42P01" | "3F000") => {
            "; it does not exist in this database: run `pgoutbox setup --slot NAME` (as the database owner) first"
        }
        Some("42501") => {
            "; the role lacks a privilege: grant what sql/roles.example.sql grants to the streamer"
        }
        _ => "",
    }
}

/// Which dead letters a command applies to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Selection {
    /// These row ids.
    Ids(Vec<i64>),
    /// Rows dead-lettered more than this many seconds ago.
    OlderThanSecs(i64),
    /// Every row.
    All,
}

impl Selection {
    fn clause(&self) -> (&'static str, Vec<i64>) {
        match self {
            Selection::Ids(ids) => ("id = ANY($1)", ids.clone()),
            Selection::OlderThanSecs(s) => (
                "dead_lettered_at < now() - make_interval(secs => ($1::bigint[])[1])",
                vec![*s],
            ),
            Selection::All => ("$1::bigint[] IS NOT NULL", Vec::new()),
        }
    }
}

/// Lists dead letters, oldest first; requeued ones only with `include_requeued`.
///
/// # Errors
/// [`Error::Sql`].
pub async fn list_dead_letters(
    client: &Client,
    schema: &SchemaName,
    include_requeued: bool,
    limit: i64,
) -> Result<Vec<DeadLetter>, Error> {
    let rows = client
        .query(
            &*schema.rewrite("SELECT id, message_id, topic, lsn::text, reason, attempts, first_error, last_error,
                    to_char(dead_lettered_at AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS\"Z\"'),
                    to_char(requeued_at AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS\"Z\"')
             FROM outbox.dead_letter
             WHERE $1 OR requeued_at IS NULL
             ORDER BY id LIMIT $2"),
            &[&include_requeued, &limit],
        )
        .await
        .map_err(|e| {
            Error::sql(
                format!("listing {}{}", schema.qualify("dead_letter"), dead_letter_hint(&e)),
                e,
            )
        })?;
    Ok(rows
        .iter()
        .map(|r| DeadLetter {
            id: r.get(0),
            message_id: r.get(1),
            topic: r.get(2),
            lsn: r.get(3),
            reason: r.get(4),
            attempts: r.get(5),
            first_error: r.get(6),
            last_error: r.get(7),
            dead_lettered_at: r.get(8),
            requeued_at: r.get(9),
        })
        .collect())
}

/// Why `requeue` refused one selected row.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RequeueRefusal {
    /// No row has this id.
    NotFound,
    /// The row was requeued already (at this time, RFC 3339 text): requeueing it again
    /// would deliver it twice.
    AlreadyRequeued(String),
    /// Its envelope does not decode (the decoder's reason): re-emitting it would only make
    /// the streamer dead-letter it again as `poison`.
    Undecodable(String),
}

/// Re-emits the selected dead letters of the outbox in `schema` through
/// `pg_logical_emit_message(true, prefix, envelope)` (`prefix`: the outbox's) in one
/// transaction, in id order, and marks them `requeued_at`. Returns the ids requeued.
///
/// All or nothing: when any selected row cannot be requeued (an `--id` that does not
/// exist, a row requeued already, an envelope this pgoutbox cannot decode), nothing is
/// requeued and the error names every such row with its reason. A selection other than
/// ids (`--all`) selects only the rows not requeued yet.
///
/// Each keeps its trust verdict: a dead letter whose `emitted_by` was not checked when it
/// was streamed (its LSN not after the current lockdown's marker, or reason `forged`) is
/// re-emitted with `emitted_by_unchecked` in its envelope, so the streamer never publishes
/// it as checked; under lockdown a requeue needs a superuser, who may write any envelope.
///
/// # Errors
/// [`Error::Precondition`] listing the refused rows and the fix; [`Error::Sql`].
pub async fn requeue_dead_letters(
    client: &mut Client,
    schema: &SchemaName,
    prefix: &MessagePrefix,
    selection: &Selection,
) -> Result<Vec<i64>, Error> {
    let (clause, arg) = selection.clause();
    let unrequeued = if !matches!(selection, Selection::Ids(_)) {
        " AND requeued_at IS NULL"
    } else {
        ""
    };
    // The trust boundary: only a message after the lockdown marker had its emitter
    // checked (or could only have come through the helpers). Lockdown is the default
    // outbox's only.
    let since = if schema.is_default() {
        super::lockdown::lockdown_state(client).await?.since()
    } else {
        None
    };
    let tx = client
        .transaction()
        .await
        .map_err(|e| Error::sql("starting the requeue transaction", e))?;
    let rows = tx
        .query(
            &*schema.rewrite(&format!(
                "SELECT id,
                        to_char(requeued_at AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS\"Z\"')
                 FROM outbox.dead_letter WHERE {clause}{unrequeued} ORDER BY id FOR UPDATE"
            )),
            &[&arg],
        )
        .await
        .map_err(|e| {
            Error::sql(
                format!(
                    "reading the dead letters to requeue from {}{}",
                    schema.qualify("dead_letter"),
                    dead_letter_hint(&e)
                ),
                e,
            )
        })?;
    let mut refused: Vec<(i64, RequeueRefusal)> = Vec::new();
    if let Selection::Ids(ids) = selection {
        let found: std::collections::BTreeSet<i64> = rows.iter().map(|r| r.get(0)).collect();
        let missing: std::collections::BTreeSet<i64> = ids
            .iter()
            .copied()
            .filter(|id| !found.contains(id))
            .collect();
        refused.extend(missing.into_iter().map(|id| (id, RequeueRefusal::NotFound)));
    }
    let mut picked: Vec<(i64, Option<Vec<u8>>)> = Vec::with_capacity(rows.len());
    for row in &rows {
        let (id, requeued_at): (i64, Option<String>) = (row.get(0), row.get(1));
        if let Some(at) = requeued_at {
            refused.push((id, RequeueRefusal::AlreadyRequeued(at)));
            continue;
        }
        // One envelope in memory at a time: too_large rows are large by definition.
        let dl = tx
            .query_one(
                &*schema.rewrite(
                    "SELECT envelope, lsn::text, reason FROM outbox.dead_letter WHERE id = $1",
                ),
                &[&id],
            )
            .await
            .map_err(|e| Error::sql(format!("reading dead letter {id}"), e))?;
        let (envelope, lsn, reason): (Vec<u8>, String, String) = (dl.get(0), dl.get(1), dl.get(2));
        let checked =
            reason != "forged" && since.is_some_and(|s| lsn.parse::<Lsn>().is_ok_and(|l| l > s));
        match crate::envelope::decode(bytes::Bytes::from(envelope)) {
            Ok(env) => picked.push((id, keep_verdict(env, checked))),
            Err(e) => refused.push((id, RequeueRefusal::Undecodable(e.to_string()))),
        }
    }
    if !refused.is_empty() {
        refused.sort_by_key(|(id, _)| *id);
        return Err(Error::Precondition(describe_refusals(&refused)));
    }
    for (id, rewritten) in &picked {
        let emitted = match rewritten {
            None => {
                tx.execute(
                    &*schema.rewrite(
                        "SELECT pg_logical_emit_message(true, $2, envelope) FROM outbox.dead_letter WHERE id = $1",
                    ),
                    &[id, &prefix.as_str()],
                )
                .await
            }
            Some(envelope) => {
                tx.execute(
                    "SELECT pg_logical_emit_message(true, $1, $2::bytea)",
                    &[&prefix.as_str(), envelope],
                )
                .await
            }
        };
        emitted.map_err(|e| Error::sql(format!("re-emitting dead letter {id}"), e))?;
    }
    let ids: Vec<i64> = picked.iter().map(|(id, _)| *id).collect();
    tx.execute(
        &*schema.rewrite("UPDATE outbox.dead_letter SET requeued_at = now() WHERE id = ANY($1)"),
        &[&ids],
    )
    .await
    .map_err(|e| Error::sql("marking dead letters requeued", e))?;
    tx.commit()
        .await
        .map_err(|e| Error::sql("committing the requeue", e))?;
    Ok(ids)
}

/// The operator's message for refused requeues: one clause per row, then the fix.
fn describe_refusals(refused: &[(i64, RequeueRefusal)]) -> String {
    let rows: Vec<String> = refused
        .iter()
        .map(|(id, why)| match why {
            RequeueRefusal::NotFound => format!("id {id} does not exist"),
            RequeueRefusal::AlreadyRequeued(at) => {
                format!("id {id} was requeued already at {at} (requeueing it again would deliver it twice)")
            }
            RequeueRefusal::Undecodable(reason) => format!(
                "id {id} holds an envelope pgoutbox cannot decode ({reason}), so requeueing it would only dead-letter it again as poison; inspect it with SQL, then purge it"
            ),
        })
        .collect();
    format!(
        "requeued nothing: {}; fix the selection (`pgoutbox dead-letters list --all` shows every row) and run it again",
        rows.join("; ")
    )
}

/// The envelope to re-emit for a dead letter whose emitter was `checked` (or not) when it
/// was first streamed: `None` to re-emit the stored bytes as they are; `Some` with the
/// envelope re-encoded with `emitted_by_unchecked` when its `emitted_by` was never
/// checked (written before the lockdown, or dead-lettered as `forged`), so that the
/// re-emit, after the lockdown, is not published as checked (issue 21, item 3).
fn keep_verdict(mut env: crate::envelope::Envelope, checked: bool) -> Option<Vec<u8>> {
    if checked || env.emitted_by.is_none() || env.emitted_by_unchecked {
        return None;
    }
    env.emitted_by_unchecked = true;
    Some(crate::envelope::encode(&env))
}

/// Deletes the selected dead letters. Returns how many were deleted.
///
/// # Errors
/// [`Error::Sql`].
pub async fn purge_dead_letters(
    client: &Client,
    schema: &SchemaName,
    selection: &Selection,
) -> Result<u64, Error> {
    let (clause, arg) = selection.clause();
    client
        .execute(
            &*schema.rewrite(&format!("DELETE FROM outbox.dead_letter WHERE {clause}")),
            &[&arg],
        )
        .await
        .map_err(|e| {
            Error::sql(
                format!(
                    "purging dead letters from {}{}",
                    schema.qualify("dead_letter"),
                    dead_letter_hint(&e)
                ),
                e,
            )
        })
}
