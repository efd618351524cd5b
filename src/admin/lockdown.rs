//! `setup --lockdown` / `setup --unlock`, reading the lockdown record (`run`, `status`,
//! `check`) and telling whether a lockdown still holds. What lockdown means for the
//! stream: [`crate::lockdown`].
//!
//! A lockdown holds against every role but a superuser only while no login role can
//! change, drop or shadow what the `SECURITY DEFINER` helpers run (issue 21): so
//! [`lock`] gives the schema `outbox`, the helpers and the tables they use to the
//! `NOLOGIN` role `pgoutbox_emitter`, and records a fingerprint of the helpers'
//! definitions; [`lockdown_state`] reports, as [`LockdownState::weakened`], every way
//! the lockdown was weakened since (an owner of any object of the schema that can log in,
//! a login member of an owner, a login role that may create in the schema or call
//! `pg_logical_emit_message`, `TRIGGER` on an outbox table or writes on `outbox.lockdown`
//! granted to a login role, a login role that may grant itself `pgoutbox_emitter`, a
//! trigger, rule or policy on `outbox.idempotency`, a changed definition). [`lock`] revokes
//! the grants and refuses what it cannot take back, naming the fix.
//!
//! [`lock`] runs in two steps, because PostgreSQL checks `EXECUTE` when a query starts:
//! a transaction that began before the `REVOKE` committed (a cursor declared then) can
//! still call `pg_logical_emit_message` after it, at an LSN after the lockdown
//! transaction's commit. So the marker, whose LSN is the trust boundary, is written only
//! after every transaction older than the `REVOKE` has ended ([`wait_for_older_transactions`]).

use std::time::{Duration, Instant};

use serde::Serialize;
use tokio_postgres::Client;

use crate::error::Error;
use crate::lsn::Lsn;

/// `sql/lockdown.sql`, the lockdown's first step: revoke `pg_logical_emit_message` from
/// `PUBLIC`, give the schema and the helpers to `pgoutbox_emitter`, helpers
/// `SECURITY DEFINER`, a pending record. Idempotent.
pub const LOCKDOWN_SQL: &str = include_str!("../../sql/lockdown.sql");
/// `sql/unlock.sql`: undoes [`LOCKDOWN_SQL`] and [`MARKER_SQL`]. Idempotent.
pub const UNLOCK_SQL: &str = include_str!("../../sql/unlock.sql");

/// The lockdown's second step, once every transaction older than the `REVOKE` has ended:
/// the marker (its LSN in the pending record) and the fingerprint. A no-op for a record
/// that has its LSN already (a repeated lockdown keeps the first marker).
pub const MARKER_SQL: &str = "LOCK TABLE outbox.lockdown IN EXCLUSIVE MODE;
UPDATE outbox.lockdown
   SET enabled_at_lsn = pg_catalog.pg_logical_emit_message(true, 'pgoutbox.lockdown', 'on'),
       enabled_at = pg_catalog.now(), enabled_by = session_user
 WHERE enabled_at_lsn IS NULL;";

/// The fingerprint of what the helpers run: md5 of the definitions (`pg_get_functiondef`:
/// body, `SECURITY DEFINER`, pinned `search_path`, ...) of every function named `emit`,
/// `emit_bytes` or `_envelope` in schema `outbox`, and of every trigger, rule and policy
/// on `outbox.idempotency` (there should be none). Computed here, never by a function in
/// the schema, which whoever weakened the lockdown could replace too.
const FINGERPRINT_SQL: &str =
    "SELECT pg_catalog.md5(coalesce(pg_catalog.string_agg(d, E'\n' ORDER BY d), ''))
  FROM (SELECT 'function ' || pg_catalog.pg_get_functiondef(p.oid) AS d
          FROM pg_catalog.pg_proc p
         WHERE p.pronamespace = pg_catalog.to_regnamespace('outbox')
           AND p.proname IN ('emit', 'emit_bytes', '_envelope')
        UNION ALL
        SELECT 'trigger ' || pg_catalog.pg_get_triggerdef(t.oid)
          FROM pg_catalog.pg_trigger t
         WHERE t.tgrelid = pg_catalog.to_regclass('outbox.idempotency') AND NOT t.tgisinternal
        UNION ALL
        SELECT 'rule ' || pg_catalog.pg_get_ruledef(r.oid)
          FROM pg_catalog.pg_rewrite r
         WHERE r.ev_class = pg_catalog.to_regclass('outbox.idempotency')
        UNION ALL
        SELECT 'policy ' || pol.polname
          FROM pg_catalog.pg_policy pol
         WHERE pol.polrelid = pg_catalog.to_regclass('outbox.idempotency')) s";

/// What runs inside the helpers besides them: triggers, rules and policies on
/// `outbox.idempotency` (they run as `pgoutbox_emitter`), each with the command that
/// removes it.
const EXTRAS_SQL: &str = "SELECT pg_catalog.format('the trigger %I on outbox.idempotency runs as pgoutbox_emitter inside the helpers; fix: DROP TRIGGER %I ON outbox.idempotency', t.tgname, t.tgname)
  FROM pg_catalog.pg_trigger t
 WHERE t.tgrelid = pg_catalog.to_regclass('outbox.idempotency') AND NOT t.tgisinternal
UNION ALL
SELECT pg_catalog.format('the rule %I on outbox.idempotency runs inside the helpers; fix: DROP RULE %I ON outbox.idempotency', r.rulename, r.rulename)
  FROM pg_catalog.pg_rewrite r
 WHERE r.ev_class = pg_catalog.to_regclass('outbox.idempotency')
UNION ALL
SELECT pg_catalog.format('the policy %I on outbox.idempotency runs inside the helpers; fix: DROP POLICY %I ON outbox.idempotency', pol.polname, pol.polname)
  FROM pg_catalog.pg_policy pol
 WHERE pol.polrelid = pg_catalog.to_regclass('outbox.idempotency')";

/// Every object of schema `outbox` whose owner matters to a lockdown, `(what, fix,
/// owner)`: each table, view and routine (a table's owner may put a trigger on it, which
/// runs as whoever writes the table: inside the helpers `pgoutbox_emitter`, in `setup` a
/// superuser; a routine's owner may replace what it runs). `sql/lockdown.sql` gives the
/// schema, the helpers and the tables they write to `pgoutbox_emitter`; [`preflight`]
/// refuses a login owner of any other.
const OWNED_SQL: &str = "SELECT 'table ' || c.oid::pg_catalog.regclass::text,
           'ALTER TABLE ' || c.oid::pg_catalog.regclass::text || ' OWNER TO pgoutbox_emitter', c.relowner,
           c.oid IN (pg_catalog.to_regclass('outbox.idempotency'), pg_catalog.to_regclass('outbox.lockdown'))
      FROM pg_catalog.pg_class c
     WHERE c.relnamespace = pg_catalog.to_regnamespace('outbox') AND c.relkind IN ('r', 'p', 'v', 'm', 'f')
    UNION ALL
    SELECT 'function ' || p.oid::pg_catalog.regprocedure::text,
           'ALTER ROUTINE ' || p.oid::pg_catalog.regprocedure::text || ' OWNER TO pgoutbox_emitter', p.proowner,
           p.proname IN ('emit', 'emit_bytes', '_envelope')
      FROM pg_catalog.pg_proc p
     WHERE p.pronamespace = pg_catalog.to_regnamespace('outbox')";

/// [`WEAKNESSES_SQL`] with its parts ([`OWNED_SQL`], [`GRANTS_SQL`],
/// [`ROLE_GRANTERS_SQL`]) in place, then [`EXTRAS_SQL`].
fn weaknesses_sql() -> String {
    format!(
        "{}{EXTRAS_SQL}",
        WEAKNESSES_SQL
            .replace("/*OWNED*/", OWNED_SQL)
            .replace("/*GRANTS*/", GRANTS_SQL)
            .replace("/*ROLE_GRANTERS*/", ROLE_GRANTERS_SQL)
    )
}

/// The grants on tables of schema `outbox` that a lockdown cannot coexist with, one row
/// per grant held by `PUBLIC` or by a role with a login member that is no superuser,
/// `(text, revoke)`: `TRIGGER` on any table (the common `GRANT ALL ON ALL TABLES IN SCHEMA
/// outbox TO app` gives it: a trigger on `outbox.idempotency` runs inside the `SECURITY
/// DEFINER` helpers as `pgoutbox_emitter` and can write any envelope), and `INSERT`,
/// `UPDATE`, `DELETE` or `TRUNCATE` on `outbox.lockdown` (the record the streamer
/// trusts). `sql/lockdown.sql` runs each `revoke` ([`revoke_grants`]).
const GRANTS_SQL: &str = "SELECT pg_catalog.format('%s holds %s on %s, so %s; fix: %s',
           CASE WHEN a.grantee = 0 THEN 'PUBLIC' ELSE 'the role ' || pg_catalog.quote_ident(pg_catalog.pg_get_userbyid(a.grantee)) END,
           a.privilege_type, c.oid::pg_catalog.regclass,
           CASE WHEN a.privilege_type = 'TRIGGER'
                THEN 'it may put a trigger on it, which runs as whoever writes the table (inside outbox.emit as pgoutbox_emitter, which may write any envelope)'
                ELSE 'it may rewrite or delete the lockdown record the streamer trusts' END,
           r.revoke) AS text,
       r.revoke
  FROM pg_catalog.pg_class c
 CROSS JOIN LATERAL pg_catalog.aclexplode(c.relacl) a
 CROSS JOIN LATERAL (SELECT pg_catalog.format('REVOKE %s ON %s FROM %s', a.privilege_type, c.oid::pg_catalog.regclass,
           CASE WHEN a.grantee = 0 THEN 'PUBLIC' ELSE pg_catalog.quote_ident(pg_catalog.pg_get_userbyid(a.grantee)) END) AS revoke) r
 WHERE c.relnamespace = pg_catalog.to_regnamespace('outbox') AND c.relkind IN ('r', 'p')
   AND a.grantee <> c.relowner
   AND (a.privilege_type = 'TRIGGER'
        OR (c.oid = pg_catalog.to_regclass('outbox.lockdown')
            AND a.privilege_type IN ('INSERT', 'UPDATE', 'DELETE', 'TRUNCATE')))
   AND (a.grantee = 0 OR EXISTS (SELECT 1 FROM pg_catalog.pg_roles l
                                  WHERE l.rolcanlogin AND NOT l.rolsuper
                                    AND pg_catalog.pg_has_role(l.oid, a.grantee, 'MEMBER')))";

/// Login roles (no superusers) that may make themselves members of `pgoutbox_emitter`,
/// `(text)`: on PostgreSQL 15 and older every `CREATEROLE` role may grant any role but a
/// superuser's; on 16 and later a role needs `ADMIN OPTION` on it.
const ROLE_GRANTERS_SQL: &str = "SELECT pg_catalog.format('the login role %s has CREATEROLE, which on PostgreSQL 15 and older lets it grant itself pgoutbox_emitter and then write any envelope; fix: ALTER ROLE %I NOCREATEROLE', r.rolname, r.rolname) AS text
  FROM pg_catalog.pg_roles r
 WHERE r.rolcanlogin AND NOT r.rolsuper AND r.rolcreaterole
   AND pg_catalog.current_setting('server_version_num')::int < 160000
UNION ALL
SELECT pg_catalog.format('the login role %s may grant pgoutbox_emitter (ADMIN OPTION), so it may make itself a member and write any envelope; fix: REVOKE ADMIN OPTION FOR pgoutbox_emitter FROM %I', r.rolname, r.rolname)
  FROM pg_catalog.pg_auth_members m
  JOIN pg_catalog.pg_roles r ON r.oid = m.member
 WHERE m.roleid = (SELECT oid FROM pg_catalog.pg_roles WHERE rolname = 'pgoutbox_emitter')
   AND m.admin_option AND r.rolcanlogin AND NOT r.rolsuper";

/// Every login role (not a superuser) that could change, drop or shadow what the helpers
/// run, or write an outbox message directly, each with the fix: members (or owners) of an
/// owner of the schema, the helpers or the tables they use; roles with `CREATE` on the
/// schema; roles that may execute `pg_logical_emit_message` (other than through `PUBLIC`,
/// reported on its own). Then [`EXTRAS_SQL`].
const WEAKNESSES_SQL: &str = "WITH owned(what, fix, owner, taken) AS (/*OWNED*/), objs(what, fix, owner) AS (
    SELECT 'schema outbox', 'ALTER SCHEMA outbox OWNER TO pgoutbox_emitter', n.nspowner
      FROM pg_catalog.pg_namespace n WHERE n.nspname = 'outbox'
    UNION ALL
    SELECT what, fix, owner FROM owned
), logins AS (
    SELECT r.oid, r.rolname FROM pg_catalog.pg_roles r WHERE r.rolcanlogin AND NOT r.rolsuper
), emitter AS (
    SELECT r.oid FROM pg_catalog.pg_roles r WHERE r.rolname = 'pgoutbox_emitter'
)
SELECT CASE WHEN l.oid = o.owner
            THEN pg_catalog.format('%s is owned by the login role %s, which may change, drop or replace it; fix: %s', o.what, l.rolname, o.fix)
            ELSE pg_catalog.format('the login role %s is a member of %s, the owner of %s, so it may change, drop or replace it; fix: REVOKE %I FROM %I', l.rolname, pg_catalog.pg_get_userbyid(o.owner), o.what, pg_catalog.pg_get_userbyid(o.owner), l.rolname)
       END
  FROM objs o JOIN logins l ON pg_catalog.pg_has_role(l.oid, o.owner, 'MEMBER')
UNION ALL
SELECT pg_catalog.format('the login role %s may create objects in schema outbox, and so shadow what the helpers run; fix: REVOKE CREATE ON SCHEMA outbox FROM %I', l.rolname, l.rolname)
  FROM logins l, pg_catalog.pg_namespace n
 WHERE n.nspname = 'outbox' AND pg_catalog.has_schema_privilege(l.oid, n.oid, 'CREATE')
   AND NOT pg_catalog.pg_has_role(l.oid, n.nspowner, 'MEMBER')
UNION ALL
SELECT g.text FROM (/*GRANTS*/) g
UNION ALL
SELECT r.text FROM (/*ROLE_GRANTERS*/) r
UNION ALL
SELECT pg_catalog.format('the login role %s may call %s directly, and so write any envelope; fix: REVOKE EXECUTE ON FUNCTION %s FROM %I', l.rolname, p.oid::pg_catalog.regprocedure, p.oid::pg_catalog.regprocedure, l.rolname)
  FROM pg_catalog.pg_proc p, logins l
 WHERE p.proname = 'pg_logical_emit_message' AND p.pronamespace = 'pg_catalog'::pg_catalog.regnamespace
   AND pg_catalog.has_function_privilege(l.oid, p.oid, 'EXECUTE')
   AND NOT pg_catalog.has_function_privilege('public', p.oid, 'EXECUTE')
   AND NOT coalesce(pg_catalog.pg_has_role(l.oid, (SELECT oid FROM emitter), 'MEMBER'), false)
UNION ALL
";

/// The lockdown state of a database, as `status --json` prints it (field `lockdown`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct LockdownState {
    /// Whether lockdown is in effect: `outbox.lockdown` holds a record with the marker's
    /// LSN.
    pub enabled: bool,
    /// Whether the lockdown's first step ran and its second (the marker) did not: the
    /// `REVOKE` is in place, emitters are not checked yet. Run `setup --lockdown` again.
    pub pending: bool,
    /// The lockdown marker's LSN (`X/Y`): pgoutbox messages after it must come through the
    /// helpers. `None` without lockdown.
    pub enabled_at_lsn: Option<String>,
    /// When it was applied (RFC 3339 UTC).
    pub enabled_at: Option<String>,
    /// The session user that applied it.
    pub enabled_by: Option<String>,
    /// Whether `PUBLIC` may execute some overload of `pg_logical_emit_message` (true by
    /// default; false after `setup --lockdown`). `None` when it could not be read.
    pub public_can_emit: Option<bool>,
    /// Under lockdown (or pending): every way it no longer holds against all roles but
    /// superusers, each a sentence with its fix. Empty when it holds (and without
    /// lockdown).
    pub weakened: Vec<String>,
}

impl LockdownState {
    /// The recorded lockdown LSN, parsed.
    #[must_use]
    pub fn since(&self) -> Option<Lsn> {
        self.enabled_at_lsn.as_deref().and_then(|s| s.parse().ok())
    }

    /// One line for `status` and `check`; starts `WEAKENED` when [`Self::weakened`] is not
    /// empty.
    #[must_use]
    pub fn describe(&self) -> String {
        let public = match self.public_can_emit {
            Some(true) => "PUBLIC may call pg_logical_emit_message",
            Some(false) => "pg_logical_emit_message is revoked from PUBLIC",
            None => "privileges of pg_logical_emit_message unknown",
        };
        let state = if self.enabled {
            format!(
                "on since {} ({} by {}); {public}; outbox messages after that LSN not written by outbox.emit/emit_bytes are dead-lettered as forged (superusers can still write any message)",
                self.enabled_at_lsn.as_deref().unwrap_or("-"),
                self.enabled_at.as_deref().unwrap_or("-"),
                self.enabled_by.as_deref().unwrap_or("-"),
            )
        } else if self.pending {
            format!(
                "pending (its marker was never written, so no emitter is checked yet); {public}"
            )
        } else {
            format!("off; {public} (pgoutbox setup --lockdown restricts it to the helpers)")
        };
        if self.weakened.is_empty() {
            state
        } else {
            format!(
                "WEAKENED (run goes on streaming; until this is fixed, the roles named may publish a message naming an emitter they are not): {}; then run `pgoutbox setup --lockdown` as a superuser. Lockdown {state}",
                self.weakened.join("; ")
            )
        }
    }
}

/// How `check`, `status` and `run` word one way a lockdown was weakened
/// ([`LockdownState::weakened`]): a warning in `check` and `status`, an error log in
/// `run`, and the same meaning in all three: `run` goes on streaming, the lockdown no
/// longer holds against the role named, and a human must fix it.
#[must_use]
pub fn weakened_text(weakness: &str) -> String {
    format!(
        "lockdown weakened: {weakness}; until it is fixed, that role may publish a message naming an emitter it is not (run goes on streaming); then run `pgoutbox setup --lockdown` as a superuser"
    )
}

/// Reads the lockdown record and the privileges of `pg_logical_emit_message`, and, under
/// lockdown, what weakened it ([`LockdownState::weakened`]). A database without
/// `outbox.lockdown` (schema not installed, or installed by an older pgoutbox) has no
/// lockdown.
///
/// # Errors
/// [`Error::Sql`] when the table exists and cannot be read.
pub async fn lockdown_state(client: &Client) -> Result<LockdownState, Error> {
    let row = client
        .query_one(
            "SELECT to_regclass('outbox.lockdown') IS NOT NULL,
                    bool_or(has_function_privilege('public', p.oid, 'EXECUTE'))
               FROM pg_catalog.pg_proc p
              WHERE p.proname = 'pg_logical_emit_message'
                AND p.pronamespace = 'pg_catalog'::regnamespace",
            &[],
        )
        .await
        .map_err(|e| Error::sql("reading the privileges of pg_logical_emit_message", e))?;
    let (has_table, public_can_emit): (bool, Option<bool>) = (row.get(0), row.get(1));
    let mut state = LockdownState {
        public_can_emit,
        ..LockdownState::default()
    };
    if !has_table {
        return Ok(state);
    }
    let has_fingerprint: bool = client
        .query_one(
            "SELECT EXISTS (SELECT 1 FROM pg_catalog.pg_attribute
                             WHERE attrelid = 'outbox.lockdown'::regclass
                               AND attname = 'helpers_fingerprint' AND NOT attisdropped)",
            &[],
        )
        .await
        .map_err(|e| Error::sql("reading the columns of outbox.lockdown", e))?
        .get(0);
    let fingerprint = if has_fingerprint {
        "helpers_fingerprint"
    } else {
        "NULL::text"
    };
    let record = client
        .query_opt(
            &format!(
                "SELECT enabled_at_lsn::text,
                        to_char(enabled_at AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS\"Z\"'),
                        enabled_by, {fingerprint}
                   FROM outbox.lockdown"
            ),
            &[],
        )
        .await
        .map_err(|e| Error::sql("reading outbox.lockdown", e))?;
    let Some(r) = record else {
        return Ok(state);
    };
    let lsn: Option<String> = r.get(0);
    state.enabled = lsn.is_some();
    state.pending = lsn.is_none();
    state.enabled_at_lsn = lsn;
    state.enabled_at = Some(r.get(1));
    state.enabled_by = Some(r.get(2));
    let recorded: Option<String> = r.get(3);
    state.weakened = weaknesses(client, &state, recorded.as_deref()).await?;
    Ok(state)
}

/// What weakens a recorded lockdown (see [`LockdownState::weakened`]).
async fn weaknesses(
    client: &Client,
    state: &LockdownState,
    recorded_fingerprint: Option<&str>,
) -> Result<Vec<String>, Error> {
    let mut out = Vec::new();
    if state.pending {
        out.push("the lockdown is pending: its first step (the REVOKE) ran and its marker was never written, so the streamer checks no emitter".to_owned());
    }
    if state.public_can_emit == Some(true) {
        out.push("PUBLIC may call pg_logical_emit_message again, so every role can write any envelope; fix: run `pgoutbox setup --lockdown` again".to_owned());
    }
    let rows = client
        .query(&weaknesses_sql(), &[])
        .await
        .map_err(|e| Error::sql("reading who may change the lockdown's helpers", e))?;
    out.extend(rows.iter().map(|r| r.get::<_, String>(0)));
    let now = fingerprint(client).await?;
    match recorded_fingerprint {
        Some(recorded) if recorded == now => {}
        Some(recorded) => out.push(format!(
            "the helpers' definitions changed since the lockdown (fingerprint {recorded} recorded, {now} now): outbox.emit, outbox.emit_bytes or outbox._envelope was replaced or altered, or a trigger, rule or policy was added to outbox.idempotency; fix: find who did it, then `pgoutbox setup --lockdown` reinstalls the helpers"
        )),
        None if state.enabled => out.push(
            "no fingerprint of the helpers was recorded (a lockdown applied by an older pgoutbox), so a replaced helper would go unnoticed; fix: run `pgoutbox setup --lockdown` again".to_owned(),
        ),
        None => {}
    }
    Ok(out)
}

/// The current fingerprint of the helpers ([`FINGERPRINT_SQL`]).
async fn fingerprint(client: &Client) -> Result<String, Error> {
    Ok(client
        .query_one(FINGERPRINT_SQL, &[])
        .await
        .map_err(|e| Error::sql("fingerprinting the helpers' definitions", e))?
        .get(0))
}

/// Records the current fingerprint of the helpers in the lockdown record, if there is
/// one: after `setup` (re)installed them, or the lockdown's second step.
///
/// # Errors
/// [`Error::Sql`] (for example when the session may not update `outbox.lockdown`: under
/// lockdown only a superuser may).
pub async fn record_fingerprint(client: &Client) -> Result<(), Error> {
    let locked: bool = client
        .query_one(
            "SELECT to_regclass('outbox.lockdown') IS NOT NULL AND EXISTS (SELECT 1 FROM outbox.lockdown)",
            &[],
        )
        .await
        .map_err(|e| Error::sql("reading outbox.lockdown", e))?
        .get(0);
    if !locked {
        return Ok(());
    }
    client
        .execute(
            &format!("UPDATE outbox.lockdown SET helpers_fingerprint = ({FINGERPRINT_SQL})"),
            &[],
        )
        .await
        .map_err(|e| Error::sql("recording the helpers' fingerprint in outbox.lockdown", e))?;
    Ok(())
}

/// Fails unless the session is a superuser: only a superuser (or the bootstrap superuser
/// that owns it) may change the privileges of `pg_catalog.pg_logical_emit_message`. `flag`
/// (`--lockdown` or `--unlock`) names what needs it.
///
/// # Errors
/// [`Error::Precondition`] naming the role and the fix; [`Error::Sql`].
pub async fn require_superuser(client: &Client, flag: &str) -> Result<(), Error> {
    let row = client
        .query_one(
            "SELECT current_user::text, rolsuper FROM pg_roles WHERE rolname = current_user",
            &[],
        )
        .await
        .map_err(|e| Error::sql("reading the role's attributes", e))?;
    let (user, superuser): (String, bool) = (row.get(0), row.get(1));
    if !superuser {
        return Err(Error::Precondition(format!(
            "setup {flag} changes the privileges of pg_catalog.pg_logical_emit_message, which only a superuser may do, and role {user:?} is none; run `pgoutbox setup {flag}` with a superuser's --database-url (the streamer itself need not be one)"
        )));
    }
    Ok(())
}

/// Fails unless `schema` is the default outbox's: lockdown revokes
/// `pg_logical_emit_message` from `PUBLIC` in the whole database, so the (SECURITY INVOKER)
/// helpers of every other outbox would stop working for ordinary roles, and its record
/// (`outbox.lockdown`) and markers are the default outbox's. `flag` names what was asked.
///
/// # Errors
/// [`Error::Precondition`] naming the flag, the schema and what to do instead.
pub fn require_default_schema(
    schema: &crate::outbox_schema::SchemaName,
    flag: &str,
) -> Result<(), Error> {
    if schema.is_default() {
        return Ok(());
    }
    Err(Error::Precondition(format!(
        "setup {flag} is supported for the default outbox (schema {}) only, not with --schema {schema}: lockdown revokes pg_logical_emit_message in the whole database, which would leave the producers of schema {schema} without a way to emit; run setup {flag} without --schema (or with --schema {}), and only in a database whose producers all use that outbox",
        crate::outbox_schema::DEFAULT_SCHEMA,
        crate::outbox_schema::DEFAULT_SCHEMA
    )))
}

/// Runs `sql` in one transaction.
async fn in_transaction(client: &Client, sql: &str, what: &str) -> Result<(), Error> {
    client
        .batch_execute(&format!("BEGIN;\n{sql}\nCOMMIT;"))
        .await
        .map_err(|e| Error::sql(what.to_owned(), e))?;
    Ok(())
}

/// Locks the database down (after `setup` installed `sql/outbox.sql`) and returns the
/// state after it: `sql/lockdown.sql` in one transaction, then
/// [`wait_for_older_transactions`], then [`MARKER_SQL`] and the fingerprint in another.
/// Idempotent: a second run keeps the first record and its LSN (and records the
/// fingerprint of the helpers `setup` just installed).
///
/// # Errors
/// [`Error::Precondition`] when the session is no superuser, when something it cannot
/// take over lets a login role change what the helpers run (a login member of
/// `pgoutbox_emitter`, a trigger on `outbox.idempotency`, ...: nothing is changed then,
/// and the error names the fix), or when the lockdown is in place but still weakened;
/// [`Error::Sql`].
pub async fn lock(client: &Client) -> Result<LockdownState, Error> {
    require_superuser(client, "--lockdown").await?;
    preflight(client).await?;
    let revoked = revoke_grants(client).await?;
    in_transaction(
        client,
        &format!("{LOCKDOWN_SQL}\n{}", revoked.join("\n")),
        "applying sql/lockdown.sql",
    )
    .await?;
    for revoke in &revoked {
        tracing::warn!(
            "setup --lockdown revoked a grant that lets a login role write any envelope: {revoke}"
        );
    }
    wait_for_older_transactions(client).await?;
    in_transaction(
        client,
        &format!(
            "{MARKER_SQL}\nUPDATE outbox.lockdown SET helpers_fingerprint = ({FINGERPRINT_SQL});"
        ),
        "writing the lockdown marker",
    )
    .await?;
    let state = lockdown_state(client).await?;
    if !state.weakened.is_empty() {
        return Err(Error::Precondition(format!(
            "setup --lockdown applied the lockdown, but it does not hold against every role but a superuser: {}; then run setup --lockdown again",
            state.weakened.join("; ")
        )));
    }
    Ok(state)
}

/// The `REVOKE` statements ([`GRANTS_SQL`]) that take back, with the lockdown, every
/// grant it cannot coexist with: `TRIGGER` on the outbox's tables, writes to
/// `outbox.lockdown`. No application needs either; each is logged as it is revoked.
async fn revoke_grants(client: &Client) -> Result<Vec<String>, Error> {
    let rows = client
        .query(GRANTS_SQL, &[])
        .await
        .map_err(|e| Error::sql("listing the grants on the outbox's tables", e))?;
    Ok(rows
        .iter()
        .map(|r| format!("{};", r.get::<_, String>(1)))
        .collect())
}

/// Refuses, before anything changes, what `sql/lockdown.sql` does not take over: a
/// trigger, rule or policy on `outbox.idempotency`, a login role that is a member of
/// `pgoutbox_emitter` or may create in schema `outbox` (other than as its owner, whose
/// ownership the lockdown takes), a login owner (or a login member of the owner) of any
/// other table or routine of schema `outbox`, a login role that may grant itself
/// `pgoutbox_emitter` (`CREATEROLE` on PostgreSQL 15 and older, `ADMIN OPTION` on it).
async fn preflight(client: &Client) -> Result<(), Error> {
    let rows = client
        .query(
            &format!(
                "SELECT pg_catalog.format('the login role %s is a member of pgoutbox_emitter, which will own the helpers and may call pg_logical_emit_message; fix: REVOKE pgoutbox_emitter FROM %I', r.rolname, r.rolname)
                   FROM pg_catalog.pg_roles r, pg_catalog.pg_roles e
                  WHERE e.rolname = 'pgoutbox_emitter' AND r.rolcanlogin AND NOT r.rolsuper
                    AND r.oid <> e.oid AND pg_catalog.pg_has_role(r.oid, e.oid, 'MEMBER')
                 UNION ALL
                 SELECT pg_catalog.format('the login role %s may create objects in schema outbox (a grant the lockdown keeps), and so shadow what the helpers run; fix: REVOKE CREATE ON SCHEMA outbox FROM %I', r.rolname, r.rolname)
                   FROM pg_catalog.pg_roles r, pg_catalog.pg_namespace n
                  WHERE n.nspname = 'outbox' AND r.rolcanlogin AND NOT r.rolsuper
                    AND pg_catalog.has_schema_privilege(r.oid, n.oid, 'CREATE')
                    AND NOT pg_catalog.pg_has_role(r.oid, n.nspowner, 'MEMBER')
                 UNION ALL
                 SELECT CASE WHEN l.oid = o.owner
                             THEN pg_catalog.format('%s is owned by the login role %s, which may put a trigger on it or replace it (the lockdown takes over only the schema, the helpers and the tables they write); fix: %s', o.what, l.rolname, o.fix)
                             ELSE pg_catalog.format('the login role %s is a member of %s, the owner of %s, which may put a trigger on it or replace it; fix: REVOKE %I FROM %I', l.rolname, pg_catalog.pg_get_userbyid(o.owner), o.what, pg_catalog.pg_get_userbyid(o.owner), l.rolname)
                        END
                   FROM ({OWNED_SQL}) o(what, fix, owner, taken)
                   JOIN pg_catalog.pg_roles l ON l.rolcanlogin AND NOT l.rolsuper
                                            AND pg_catalog.pg_has_role(l.oid, o.owner, 'MEMBER')
                  WHERE NOT o.taken
                 UNION ALL
                 SELECT g.text FROM ({ROLE_GRANTERS_SQL}) g
                 UNION ALL
                 {EXTRAS_SQL}"
            ),
            &[],
        )
        .await
        .map_err(|e| Error::sql("checking what the lockdown cannot take over", e))?;
    if rows.is_empty() {
        return Ok(());
    }
    let found: Vec<String> = rows.iter().map(|r| r.get(0)).collect();
    Err(Error::Precondition(format!(
        "setup --lockdown refused, nothing changed: {}; then run setup --lockdown again",
        found.join("; ")
    )))
}

/// Waits until every transaction that was running when this is called (after the
/// `REVOKE` committed) has ended: each holds the lock on its own virtual transaction id
/// (`pg_locks`, `locktype = 'virtualxid'`) until it ends, and one that began later sees
/// the `REVOKE`. Like `CREATE INDEX CONCURRENTLY`, it waits as long as it takes, and says
/// every 10 s on stderr which sessions it waits for (pid, user, application, since when;
/// never their query text).
///
/// # Errors
/// [`Error::Sql`].
pub async fn wait_for_older_transactions(client: &Client) -> Result<(), Error> {
    let older: Vec<String> = client
        .query(
            "SELECT virtualxid FROM pg_catalog.pg_locks
              WHERE locktype = 'virtualxid' AND granted AND mode = 'ExclusiveLock'
                AND virtualxid IS NOT NULL AND pid IS DISTINCT FROM pg_catalog.pg_backend_pid()",
            &[],
        )
        .await
        .map_err(|e| Error::sql("listing the running transactions", e))?
        .iter()
        .map(|r| r.get(0))
        .collect();
    let started = Instant::now();
    let mut said = Instant::now();
    loop {
        let rows = client
            .query(
                "SELECT pg_catalog.format('pid %s (user %s, application %s, in a transaction since %s)',
                        l.pid, coalesce(a.usename::text, '-'),
                        coalesce(nullif(a.application_name, ''), '-'), coalesce(a.xact_start::text, '-'))
                   FROM pg_catalog.pg_locks l
                   LEFT JOIN pg_catalog.pg_stat_activity a ON a.pid = l.pid
                  WHERE l.locktype = 'virtualxid' AND l.granted AND l.virtualxid = ANY($1)
                  ORDER BY l.pid",
                &[&older],
            )
            .await
            .map_err(|e| Error::sql("waiting for the transactions older than the lockdown", e))?;
        if rows.is_empty() {
            return Ok(());
        }
        if said.elapsed() >= Duration::from_secs(10) {
            said = Instant::now();
            let who: Vec<String> = rows.iter().map(|r| r.get(0)).collect();
            eprintln!(
                "setup --lockdown: waiting {} s for {} transaction(s) that began before the REVOKE (they may still call pg_logical_emit_message); the marker is written once they end: {}",
                started.elapsed().as_secs(),
                who.len(),
                who.join("; ")
            );
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Applies `sql/unlock.sql` and returns the state after it. Idempotent.
///
/// # Errors
/// [`Error::Precondition`] when the session is no superuser; [`Error::Sql`].
pub async fn unlock(client: &Client) -> Result<LockdownState, Error> {
    require_superuser(client, "--unlock").await?;
    in_transaction(client, UNLOCK_SQL, "applying sql/unlock.sql").await?;
    lockdown_state(client).await
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::outbox_schema::SchemaName;

    #[test]
    fn the_marker_is_written_with_its_own_prefix() {
        let on = format!(
            "'{}', '{}'",
            crate::lockdown::MARKER_PREFIX,
            std::str::from_utf8(crate::lockdown::MARKER_ON).unwrap()
        );
        assert!(MARKER_SQL.contains(&on), "{MARKER_SQL}");
        assert!(!LOCKDOWN_SQL.contains("pg_logical_emit_message(true"));
    }

    #[test]
    fn lockdown_is_only_for_the_default_schema() {
        let billing = SchemaName::parse("--schema", "billing").unwrap();
        let e = require_default_schema(&billing, "--lockdown")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("--lockdown") && e.contains("billing") && e.contains("schema outbox"),
            "{e}"
        );
        assert!(require_default_schema(&SchemaName::default(), "--lockdown").is_ok());
    }
}
