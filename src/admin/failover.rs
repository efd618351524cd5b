//! What a failover of the primary needs (PostgreSQL 17+ failover slots), read on the primary
//! and on a standby, for `check`, `status` and `run`'s start.
//!
//! On the primary: a failover slot with `synchronized_standby_slots` empty lets the walsender
//! send pgoutbox transactions a standby has not received; published, then lost with the
//! primary, they are phantom events (docs/src/operators/postgres-failover.md). That is a
//! problem once a standby exists (a physical slot, or a walsender serving no logical slot);
//! on a server with none it is only said, with the fix to apply before adding one. And each
//! physical slot listed there must exist and be streamed from, or logical decoding waits for
//! it (`run` stalls). On a standby: `sync_replication_slots`, `hot_standby_feedback`,
//! `primary_slot_name`, a `dbname` in `primary_conninfo`, and our slot synchronized, no longer
//! temporary (a temporary copy is dropped at promotion) and not invalidated. Each finding that
//! is not fine names the line of configuration that fixes it.

use tokio_postgres::Client;

use crate::error::Error;

/// How a failover need stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Level {
    /// Met.
    Ok,
    /// Met for now, or not checkable: an operator should look.
    Warning,
    /// Not met: a failover loses or invents events, or `run` stalls.
    Problem,
}

/// One finding about a failover need.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FailoverCheck {
    /// How it stands.
    pub level: Level,
    /// The setting or object looked at, e.g. `synchronized_standby_slots`.
    pub subject: &'static str,
    /// What was found and, unless [`Level::Ok`], the fix.
    pub text: String,
}

fn found(level: Level, subject: &'static str, text: impl Into<String>) -> FailoverCheck {
    FailoverCheck {
        level,
        subject,
        text: text.into(),
    }
}

/// The first PostgreSQL version (`server_version_num`) with failover slots.
const FAILOVER_SLOTS_SINCE: i32 = 170_000;

/// The fix for an empty `synchronized_standby_slots`, on the primary.
const GUARD_FIX: &str = "on the primary: ALTER SYSTEM SET synchronized_standby_slots = '<the physical slot of each standby that may be promoted>'; SELECT pg_reload_conf()";

/// The primary's side, for a failover slot `slot` (nothing when the server is older than 17,
/// the slot is missing or it is not a failover slot).
///
/// # Errors
/// [`Error::Sql`].
pub async fn on_primary(client: &Client, slot: &str) -> Result<Vec<FailoverCheck>, Error> {
    let row = client
        .query_one(
            "SELECT current_setting('server_version_num')::int,
                    current_setting('synchronized_standby_slots', true),
                    (SELECT (to_jsonb(s) ->> 'failover')::bool FROM pg_replication_slots s
                     WHERE s.slot_name = $1)",
            &[&slot],
        )
        .await
        .map_err(|e| Error::sql("reading synchronized_standby_slots", e))?;
    let (version, guard, failover): (i32, Option<String>, Option<bool>) =
        (row.get(0), row.get(1), row.get(2));
    if version < FAILOVER_SLOTS_SINCE || failover != Some(true) {
        return Ok(Vec::new());
    }
    let names = standby_slot_names(guard.as_deref().unwrap_or(""));
    if names.is_empty() && !has_standby(client).await? {
        return Ok(vec![found(
            Level::Ok,
            "synchronized_standby_slots",
            format!("empty, and no standby streams from this server or holds a physical slot on it: nothing can be promoted in its place yet; before one can be, {GUARD_FIX}"),
        )]);
    }
    if names.is_empty() {
        return Ok(vec![found(
            Level::Problem,
            "synchronized_standby_slots",
            format!("empty, and slot {slot:?} is a failover slot: the walsender sends pgoutbox transactions that no standby has received, so a failover can publish events the promoted server never committed (phantom events); {GUARD_FIX}"),
        )]);
    }
    let mut out = Vec::new();
    for name in names {
        let row = client
            .query_opt(
                "SELECT slot_type::text, active FROM pg_replication_slots WHERE slot_name = $1",
                &[&name],
            )
            .await
            .map_err(|e| Error::sql("reading the standbys' physical slots", e))?;
        out.push(match row.map(|r| (r.get::<_, String>(0), r.get::<_, bool>(1))) {
            None => found(
                Level::Problem,
                "synchronized_standby_slots",
                format!("lists {name:?}, which does not exist: logical decoding waits for it, so `run` stalls; on the primary: SELECT pg_create_physical_replication_slot('{name}'), and primary_slot_name = '{name}' on the standby (or take it out of synchronized_standby_slots)"),
            ),
            Some((kind, _)) if kind != "physical" => found(
                Level::Problem,
                "synchronized_standby_slots",
                format!("lists {name:?}, a {kind} slot: list the physical slots of the standbys"),
            ),
            Some((_, false)) => found(
                Level::Warning,
                "synchronized_standby_slots",
                format!("lists {name:?}, which no standby streams from: `run` waits (its walsender waits for that standby) until a standby with primary_slot_name = '{name}' connects"),
            ),
            Some((_, true)) => found(
                Level::Ok,
                "synchronized_standby_slots",
                format!("{name:?}: a standby streams from it"),
            ),
        });
    }
    Ok(out)
}

/// Whether a standby may be promoted in this server's place: a physical replication slot
/// exists, or a walsender serves something other than a logical slot (a standby without a
/// slot, a base backup). Without one there is nothing to fail over to, and an empty
/// `synchronized_standby_slots` cannot yet cause a phantom event.
///
/// # Errors
/// [`Error::Sql`].
async fn has_standby(client: &Client) -> Result<bool, Error> {
    let row = client
        .query_one(
            "SELECT EXISTS (SELECT FROM pg_replication_slots WHERE slot_type = 'physical')
                 OR EXISTS (SELECT FROM pg_stat_replication r
                            WHERE NOT EXISTS (SELECT FROM pg_replication_slots s
                                              WHERE s.slot_type = 'logical'
                                                AND s.active_pid = r.pid))",
            &[],
        )
        .await
        .map_err(|e| Error::sql("looking for standbys", e))?;
    Ok(row.get(0))
}

/// The names in a `synchronized_standby_slots` value (comma separated, maybe quoted).
fn standby_slot_names(value: &str) -> Vec<String> {
    value
        .split(',')
        .map(|n| n.trim().trim_matches('"').to_owned())
        .filter(|n| !n.is_empty())
        .collect()
}

/// `run`'s warning at start: the fix when `slot` is a failover slot and
/// `synchronized_standby_slots` is empty (`None` otherwise, or when it cannot be read).
pub async fn unguarded_warning(client: &Client, slot: &str) -> Option<String> {
    let checks = on_primary(client, slot).await.ok()?;
    checks
        .into_iter()
        .find(|c| c.level == Level::Problem && c.text.starts_with("empty"))
        .map(|c| format!("synchronized_standby_slots is {}", c.text))
}

/// The standby's side, for `slot`, read on `client` connected to the standby
/// (`--standby-url`).
///
/// # Errors
/// [`Error::Sql`].
pub async fn on_standby(client: &Client, slot: &str) -> Result<Vec<FailoverCheck>, Error> {
    let row = client
        .query_one(
            "SELECT pg_is_in_recovery(), current_setting('server_version_num')::int,
                    current_setting('hot_standby_feedback'),
                    current_setting('sync_replication_slots', true),
                    current_setting('primary_slot_name', true)",
            &[],
        )
        .await
        .map_err(|e| Error::sql("reading the standby's settings", e))?;
    let (recovery, version): (bool, i32) = (row.get(0), row.get(1));
    let feedback: String = row.get(2);
    let sync: Option<String> = row.get(3);
    let primary_slot: Option<String> = row.get(4);
    if !recovery {
        return Ok(vec![found(
            Level::Problem,
            "standby",
            "--standby-url names a server that is not in recovery (a primary): give the URL of a physical standby of the primary",
        )]);
    }
    if version < FAILOVER_SLOTS_SINCE {
        return Ok(vec![found(
            Level::Problem,
            "standby",
            "PostgreSQL older than 17 cannot synchronize logical slots: keep the slot across a failover another way (docs/src/operators/postgres-failover.md)",
        )]);
    }
    let on = |v: &str| matches!(v, "on" | "true" | "1" | "yes");
    let mut out = vec![
        if sync.as_deref().is_some_and(on) {
            found(Level::Ok, "sync_replication_slots", "on")
        } else {
            found(
                Level::Problem,
                "sync_replication_slots",
                "off: failover slots are not copied to this standby; on the standby: sync_replication_slots = on (then SELECT pg_reload_conf())",
            )
        },
        if on(&feedback) {
            found(Level::Ok, "hot_standby_feedback", "on")
        } else {
            found(
                Level::Problem,
                "hot_standby_feedback",
                "off: slot synchronization needs it; on the standby: hot_standby_feedback = on (then SELECT pg_reload_conf())",
            )
        },
        match primary_slot.as_deref().filter(|s| !s.is_empty()) {
            Some(name) => found(Level::Ok, "primary_slot_name", format!("{name:?}")),
            None => found(
                Level::Problem,
                "primary_slot_name",
                "empty: slot synchronization needs a physical slot; on the standby: primary_slot_name = '<a physical slot on the primary>' (listed in the primary's synchronized_standby_slots)",
            ),
        },
    ];
    // primary_conninfo may hold a password: only roles that may read all settings see it.
    match client
        .query_one("SELECT current_setting('primary_conninfo')", &[])
        .await
    {
        Ok(r) => {
            let conninfo: String = r.get(0);
            out.push(if conninfo.contains("dbname=") {
                found(Level::Ok, "primary_conninfo", "has a dbname")
            } else {
                found(
                    Level::Problem,
                    "primary_conninfo",
                    "has no dbname: slot synchronization needs one; on the standby: add dbname=<the outbox's database> to primary_conninfo",
                )
            });
        }
        Err(_) => out.push(found(
            Level::Warning,
            "primary_conninfo",
            "not readable by this role (it needs pg_read_all_settings): make sure it has a dbname=",
        )),
    }
    let row = client
        .query_opt(
            "SELECT synced, temporary, invalidation_reason, confirmed_flush_lsn::text
             FROM pg_replication_slots WHERE slot_name = $1",
            &[&slot],
        )
        .await
        .map_err(|e| Error::sql("reading the standby's copy of the slot", e))?;
    out.push(match row {
        None => found(
            Level::Problem,
            "slot on the standby",
            format!("{slot:?} is not on the standby: it is not a failover slot (pgoutbox setup makes it one), or not synchronized yet (the settings above)"),
        ),
        Some(r) => {
            let (synced, temporary): (bool, bool) = (r.get(0), r.get(1));
            let invalidated: Option<String> = r.get(2);
            let at: Option<String> = r.get(3);
            if let Some(reason) = invalidated {
                found(
                    Level::Problem,
                    "slot on the standby",
                    format!("{slot:?} is invalidated ({reason}): it cannot be used after a promotion; on the standby: SELECT pg_drop_replication_slot('{slot}') once the primary's slot is healthy, and the slotsync worker copies it again"),
                )
            } else if !synced {
                found(
                    Level::Problem,
                    "slot on the standby",
                    format!("{slot:?} exists on the standby but was not synchronized (created there by hand?): the slotsync worker does not overwrite it; on the standby: SELECT pg_drop_replication_slot('{slot}')"),
                )
            } else if temporary {
                found(
                    Level::Problem,
                    "slot on the standby",
                    format!("{slot:?} is synchronized but still temporary: it would be dropped at a promotion; it becomes persistent once the primary's slot moves past where the standby began (SELECT pg_log_standby_snapshot() on the primary speeds it up)"),
                )
            } else {
                found(
                    Level::Ok,
                    "slot on the standby",
                    format!(
                        "{slot:?} synchronized, persistent, confirmed_flush_lsn {}",
                        at.as_deref().unwrap_or("-")
                    ),
                )
            }
        }
    });
    Ok(out)
}

#[cfg(test)]
#[test]
fn standby_slot_names_are_split_and_unquoted() {
    assert_eq!(
        standby_slot_names(" a, \"B\" ,,c"),
        vec!["a".to_owned(), "B".to_owned(), "c".to_owned()]
    );
    assert!(standby_slot_names("").is_empty());
}
