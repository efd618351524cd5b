//! Several outboxes in one database: the schema an outbox lives in ([`SchemaName`]) and the
//! logical-message prefix its producers write ([`MessagePrefix`]).
//!
//! One outbox is a schema holding the producer helpers (`emit`, `emit_bytes`, ...), the
//! tables the streamer writes (`dead_letter`, `stream_state`, `lockdown`) and a one-row
//! `settings` table recording its prefix (`sql/settings.sql`), plus a slot and a publication
//! of its own. The default outbox is schema `outbox` with prefix `pgoutbox`, as before.
//!
//! Every SQL file under `sql/` and every statement in the code is written for schema
//! `outbox` (each object qualified as `outbox.name`) and prefix `'pgoutbox'`; for another
//! outbox [`SchemaName::rewrite`] and [`install_sql`] transform that text, so the files stay
//! the single source of the objects and need no templating. The transformation:
//!
//! - `outbox.<identifier>` becomes `"<schema>".<identifier>`, except `outbox.traceparent`
//!   and `outbox.tracestate`: those are settings (GUCs read with `current_setting`), not
//!   schema objects, and keep their names for every outbox;
//! - `SCHEMA outbox` (any case, as in `CREATE SCHEMA`, `COMMENT ON SCHEMA`, `GRANT ... ON
//!   SCHEMA`) becomes `SCHEMA "<schema>"`;
//! - [`install_sql`] also replaces the literal `'pgoutbox'` (the prefix argument of
//!   `pg_logical_emit_message`) by the outbox's prefix.
//!
//! A word counts only when it stands alone: `pgoutbox`, `outbox_pub` or `x-pgoutbox-lsn`
//! are left as they are. For the default schema and prefix both are the identity, so the
//! default outbox runs byte-for-byte the SQL it ran before.
//!
//! Names are restricted so that they never need escaping inside a literal or an identifier:
//! a schema is 1 to 63 of `a-z`, `0-9`, `_`, not starting with a digit or `pg_`; a prefix
//! is 1 to 255 of `A-Za-z0-9._:-`, and not `pgoutbox.lockdown` (the lockdown marker's).
//!
//! Lockdown (`setup --lockdown`) revokes `pg_logical_emit_message` database-wide, which
//! would leave the producers of every other outbox without a way to emit: it is therefore
//! supported for the default schema only, and refused with an error for any other.

use std::borrow::Cow;

use crate::validation::ValidationError;

/// The default outbox's schema, as before several outboxes were possible.
pub const DEFAULT_SCHEMA: &str = "outbox";

/// The default outbox's logical-message prefix.
pub const DEFAULT_PREFIX: &str = "pgoutbox";

/// The settings (GUCs) named `outbox.*` that the rewrite keeps: they are read with
/// `current_setting` and are not objects of the schema.
pub const KEPT_SETTINGS: &[&str] = &[
    crate::contract::envelope_key::TRACEPARENT,
    crate::contract::envelope_key::TRACESTATE,
];

/// `sql/settings.sql`: the one-row table that records an outbox's prefix.
pub const SETTINGS_SQL: &str = include_str!("../sql/settings.sql");

/// The schema of one outbox (`--schema`), validated: 1 to 63 of `a-z`, `0-9`, `_`, not
/// starting with a digit or with `pg_` (reserved by PostgreSQL for system schemas).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct SchemaName(String);

impl Default for SchemaName {
    fn default() -> Self {
        SchemaName(DEFAULT_SCHEMA.to_owned())
    }
}

impl std::fmt::Display for SchemaName {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::str::FromStr for SchemaName {
    type Err = ValidationError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        SchemaName::parse("--schema", s)
    }
}

impl SchemaName {
    /// Validates a schema name given as `setting`.
    ///
    /// # Errors
    /// [`ValidationError`] naming `setting`, the value and the rule.
    pub fn parse(setting: &'static str, value: &str) -> Result<Self, ValidationError> {
        let bad = |rule: &str| ValidationError {
            setting,
            value: value.to_owned(),
            rule: rule.to_owned(),
        };
        if value.is_empty()
            || value.len() > 63
            || !value
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_')
        {
            return Err(bad(
                "use 1 to 63 characters of a-z, 0-9 and _ (a schema name that never needs quoting)",
            ));
        }
        if value.as_bytes()[0].is_ascii_digit() {
            return Err(bad("must not start with a digit; start it with a-z or _"));
        }
        if value.starts_with("pg_") {
            return Err(bad(
                "names starting with pg_ are reserved for PostgreSQL's system schemas; pick another name",
            ));
        }
        Ok(SchemaName(value.to_owned()))
    }

    /// The name as given.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// Whether this is [`DEFAULT_SCHEMA`].
    pub fn is_default(&self) -> bool {
        self.0 == DEFAULT_SCHEMA
    }

    /// The name as a quoted SQL identifier, `"name"` (the name holds no `"`).
    pub fn quoted(&self) -> String {
        format!("\"{}\"", self.0)
    }

    /// `"schema".object`, for messages and statements built here.
    pub fn qualify(&self, object: &str) -> String {
        if self.is_default() {
            format!("{DEFAULT_SCHEMA}.{object}")
        } else {
            format!("{}.{object}", self.quoted())
        }
    }

    /// `sql`, written for schema `outbox`, transformed for this schema (see the module
    /// doc). The identity for the default schema.
    pub fn rewrite<'a>(&self, sql: &'a str) -> Cow<'a, str> {
        if self.is_default() {
            return Cow::Borrowed(sql);
        }
        Cow::Owned(rewrite_schema(sql, &self.quoted()))
    }
}

/// The logical decoding message prefix of one outbox (`--prefix`), validated: 1 to 255 of
/// `A-Za-z0-9._:-`, not [`crate::lockdown::MARKER_PREFIX`]. Serializes as its text.
#[derive(Debug, Clone, PartialEq, Eq, Hash, serde::Serialize)]
#[serde(transparent)]
pub struct MessagePrefix(String);

impl Default for MessagePrefix {
    fn default() -> Self {
        MessagePrefix(DEFAULT_PREFIX.to_owned())
    }
}

impl std::fmt::Display for MessagePrefix {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::str::FromStr for MessagePrefix {
    type Err = ValidationError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        MessagePrefix::parse("--prefix", s)
    }
}

impl MessagePrefix {
    /// Validates a prefix given as `setting`.
    ///
    /// # Errors
    /// [`ValidationError`] naming `setting`, the value and the rule.
    pub fn parse(setting: &'static str, value: &str) -> Result<Self, ValidationError> {
        let bad = |rule: String| ValidationError {
            setting,
            value: value.to_owned(),
            rule,
        };
        if value.is_empty()
            || value.len() > 255
            || !value
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b':' | b'-'))
        {
            return Err(bad(
                "use 1 to 255 characters of A-Z, a-z, 0-9, '.', '_', ':' and '-'".into(),
            ));
        }
        if value == crate::lockdown::MARKER_PREFIX {
            return Err(bad(format!(
                "{} is the prefix of pgoutbox's lockdown markers; pick another prefix",
                crate::lockdown::MARKER_PREFIX
            )));
        }
        Ok(MessagePrefix(value.to_owned()))
    }

    /// The prefix as given.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The prefix as an SQL string literal, `'prefix'` (the prefix holds no `'` or `\`).
    pub fn literal(&self) -> String {
        format!("'{}'", self.0)
    }
}

/// `sql` (a file of `sql/`, written for schema `outbox` and prefix `'pgoutbox'`) for the
/// outbox in `schema` writing `prefix` (see the module doc). The identity for the default
/// outbox.
pub fn install_sql(sql: &str, schema: &SchemaName, prefix: &MessagePrefix) -> String {
    let sql = schema.rewrite(sql);
    if prefix.as_str() == DEFAULT_PREFIX {
        sql.into_owned()
    } else {
        sql.replace(&format!("'{DEFAULT_PREFIX}'"), &prefix.literal())
    }
}

fn is_ident_byte(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b == b'_' || b == b'$'
}

/// Whether `before` ends with the keyword `SCHEMA`, perhaps followed by `IF EXISTS` or
/// `IF NOT EXISTS` (any case, across white space): the next word names a schema.
fn follows_schema_keyword(before: &str) -> bool {
    /// `text` without a trailing whole word `word` (any case) and the white space before it.
    fn strip_word<'a>(text: &'a str, word: &str) -> Option<&'a str> {
        let t = text.trim_end();
        let n = t.len();
        let w = word.len();
        (n >= w
            && t.as_bytes()[n - w..].eq_ignore_ascii_case(word.as_bytes())
            && (n == w || !is_ident_byte(t.as_bytes()[n - w - 1])))
        .then(|| &t[..n - w])
    }
    let mut rest = before;
    if let Some(r) = strip_word(rest, "exists") {
        let r = strip_word(r, "not").unwrap_or(r);
        match strip_word(r, "if") {
            Some(r) => rest = r,
            None => return false,
        }
    }
    strip_word(rest, "schema").is_some()
}

/// The rewrite of [`SchemaName::rewrite`], with `quoted` as the new schema.
fn rewrite_schema(sql: &str, quoted: &str) -> String {
    let bytes = sql.as_bytes();
    let word = DEFAULT_SCHEMA.as_bytes();
    let mut out = String::with_capacity(sql.len() + 64);
    let mut copied = 0;
    let mut i = 0;
    while let Some(found) = sql[i..].find(DEFAULT_SCHEMA) {
        let at = i + found;
        let end = at + word.len();
        i = end;
        let next = bytes.get(end).copied();
        // `"outbox"`, quoted: the same schema.
        if at > 0 && bytes[at - 1] == b'"' && next == Some(b'"') {
            out.push_str(&sql[copied..at - 1]);
            out.push_str(quoted);
            copied = end + 1;
            continue;
        }
        // A word of its own: no identifier character (or quote) right before or after it.
        if at > 0 && (is_ident_byte(bytes[at - 1]) || bytes[at - 1] == b'"') {
            continue;
        }
        let replace = match next {
            Some(b'.') => {
                // `outbox.<identifier>`: an object, unless it is one of the settings.
                let rest = &bytes[end + 1..];
                let len = rest.iter().take_while(|b| is_ident_byte(**b)).count();
                let name = &sql[end + 1..end + 1 + len];
                len > 0 && !KEPT_SETTINGS.contains(&name)
            }
            Some(b) if is_ident_byte(b) || b == b'"' => false,
            _ => follows_schema_keyword(&sql[..at]),
        };
        if replace {
            out.push_str(&sql[copied..at]);
            out.push_str(quoted);
            copied = end;
        }
    }
    out.push_str(&sql[copied..]);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    // The shipped SQL files, read here as `setup` installs them (admin and stream_state
    // embed the same files; this module sits below them).
    const OUTBOX_SQL: &str = include_str!("../sql/outbox.sql");
    const STREAM_STATE_SQL: &str = include_str!("../sql/stream_state.sql");
    const ROLES_SQL: &str = include_str!("../sql/roles.sql");

    fn schema(s: &str) -> SchemaName {
        SchemaName::parse("--schema", s).unwrap()
    }

    fn prefix(s: &str) -> MessagePrefix {
        MessagePrefix::parse("--prefix", s).unwrap()
    }

    /// Drops `--` comments (no literal in our files holds `--`).
    fn code_only(sql: &str) -> String {
        sql.lines()
            .map(|l| l.split_once("--").map_or(l, |(code, _)| code))
            .collect::<Vec<_>>()
            .join("\n")
    }

    /// Every place `sql` (comments dropped) still refers to schema `outbox` as an object:
    /// `outbox.<identifier>` other than the kept settings, `SCHEMA outbox`, `'outbox'`.
    fn references_left(sql: &str) -> Vec<String> {
        let code = code_only(sql);
        let b = code.as_bytes();
        let mut left = Vec::new();
        let mut i = 0;
        while let Some(found) = code[i..].find("outbox") {
            let at = i + found;
            let end = at + 6;
            i = end;
            if at > 0 && is_ident_byte(b[at - 1]) {
                continue;
            }
            let tail: String = code[end..].chars().take(24).collect();

            let object = tail.starts_with('.')
                && !KEPT_SETTINGS.iter().any(|s| {
                    tail[1..].starts_with(s)
                        && !tail
                            .as_bytes()
                            .get(1 + s.len())
                            .is_some_and(|c| is_ident_byte(*c))
                });
            let schema_word = follows_schema_keyword(&code[..at])
                && !tail.as_bytes().first().is_some_and(|c| is_ident_byte(*c));
            let literal = at > 0 && b[at - 1] == b'\'' && tail.starts_with('\'');
            let quoted = at > 0 && b[at - 1] == b'"' && tail.starts_with('"');
            if object || schema_word || literal || quoted {
                left.push(format!("…{}outbox{tail}", &code[at.saturating_sub(24)..at]));
            }
        }
        left
    }

    #[test]
    fn schema_names_follow_the_identifier_rules() {
        for ok in ["outbox", "billing", "_x", "a1", &"a".repeat(63)] {
            assert_eq!(schema(ok).as_str(), ok);
        }
        for bad in [
            "",
            "Billing",
            "1abc",
            "pg_outbox",
            "a-b",
            "a.b",
            "a\"b",
            "é",
            &"a".repeat(64),
        ] {
            let e = SchemaName::parse("--schema", bad).unwrap_err();
            assert_eq!(e.setting, "--schema");
            assert!(e.to_string().contains("--schema (PGOUTBOX_SCHEMA)"), "{e}");
        }
        assert!(schema("outbox").is_default());
        assert_eq!(schema("billing").quoted(), "\"billing\"");
        assert_eq!(
            schema("billing").qualify("dead_letter"),
            "\"billing\".dead_letter"
        );
        assert_eq!(
            SchemaName::default().qualify("dead_letter"),
            "outbox.dead_letter"
        );
    }

    #[test]
    fn prefixes_are_not_empty_and_not_the_lockdown_marker() {
        for ok in ["pgoutbox", "billing", "svc.orders:v1", "A-b_c"] {
            assert_eq!(prefix(ok).as_str(), ok);
        }
        for bad in [
            "",
            "pgoutbox.lockdown",
            "a'b",
            "a\\b",
            "a b",
            "a\0b",
            &"p".repeat(256),
        ] {
            let e = MessagePrefix::parse("--prefix", bad).unwrap_err();
            assert_eq!(e.setting, "--prefix");
            assert!(e.to_string().contains("--prefix (PGOUTBOX_PREFIX)"), "{e}");
        }
        let e = MessagePrefix::parse("--prefix", "pgoutbox.lockdown").unwrap_err();
        assert!(e.rule.contains("lockdown markers"), "{e}");
    }

    #[test]
    fn the_default_outbox_runs_its_sql_unchanged() {
        for sql in [OUTBOX_SQL, STREAM_STATE_SQL, SETTINGS_SQL] {
            assert_eq!(
                install_sql(sql, &SchemaName::default(), &MessagePrefix::default()),
                sql
            );
        }
    }

    #[test]
    fn installed_sql_names_no_object_of_schema_outbox_but_keeps_the_trace_settings() {
        let s = schema("billing");
        let p = prefix("billing.events");
        for (file, sql) in [
            ("sql/outbox.sql", OUTBOX_SQL),
            ("sql/stream_state.sql", STREAM_STATE_SQL),
            ("sql/settings.sql", SETTINGS_SQL),
            ("sql/roles.sql", ROLES_SQL),
        ] {
            assert!(
                !references_left(sql).is_empty(),
                "{file} names schema outbox"
            );
            let out = install_sql(sql, &s, &p);
            assert_eq!(references_left(&out), Vec::<String>::new(), "{file}");
            assert!(out.contains("\"billing\"."), "{file}");
            // The prefix literal is gone, the marker prefix kept.
            assert!(!code_only(&out).contains("'pgoutbox'"), "{file}");
        }
        let out = install_sql(OUTBOX_SQL, &s, &p);
        assert!(out.contains("CREATE SCHEMA IF NOT EXISTS \"billing\";"));
        assert!(out.contains("pg_logical_emit_message(true, 'billing.events', envelope)"));
        assert!(
            out.contains("x-pgoutbox-"),
            "reserved header names are kept"
        );
        // The trace settings (GUCs) keep their names; everything else moves.
        let sample = "SELECT current_setting('outbox.traceparent', true), \
                      current_setting('outbox.tracestate', true), outbox.tracestate_x(), \
                      outbox.emit('t', '{}'), 'outbox.dead_letter'::regclass, \
                      pgoutbox.x, my_outbox.y, \"outbox\".z, outbox_pub, \
                      GRANT USAGE ON SCHEMA outbox TO r; comment on schema\n  outbox is 'x'; \
                      CREATE SCHEMA IF NOT EXISTS outbox; drop schema if exists outbox; \
                      lockdown.sql: 'pgoutbox.lockdown', outbox emits";
        assert_eq!(
            install_sql(sample, &s, &p),
            "SELECT current_setting('outbox.traceparent', true), \
             current_setting('outbox.tracestate', true), \"billing\".tracestate_x(), \
             \"billing\".emit('t', '{}'), '\"billing\".dead_letter'::regclass, \
             pgoutbox.x, my_outbox.y, \"billing\".z, outbox_pub, \
             GRANT USAGE ON SCHEMA \"billing\" TO r; comment on schema\n  \"billing\" is 'x'; \
             CREATE SCHEMA IF NOT EXISTS \"billing\"; drop schema if exists \"billing\"; \
             lockdown.sql: 'pgoutbox.lockdown', outbox emits"
        );
    }

    #[test]
    fn lockdown_sql_is_only_for_the_default_schema() {
        // Lockdown is refused for other schemas (admin::lockdown::require_default_schema,
        // tested there); its files are written for schema outbox (the marker prefix stays
        // apart: admin::lockdown's tests).
        let lockdown = include_str!("../sql/lockdown.sql");
        assert!(!references_left(lockdown).is_empty());
    }
}
