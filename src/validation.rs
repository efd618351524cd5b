//! The error every check of a setting returns, and the naming rule that ties a flag to its
//! environment variable: a bad value is reported as
//! `invalid setting --flag (PGOUTBOX_FLAG) = "value": rule`, whichever layer found it (the
//! settings, the outbox's schema and prefix names, the broker URL list, the CLI's own
//! parsers). Pure: no I/O, no dependency on the settings or the CLI, so the lowest layer
//! (`outbox_schema`, `routing`) can return it too.

/// Options that select what one invocation acts on (or how it prints) rather than
/// configure pgoutbox: they read no environment variable.
pub const FLAGS_WITHOUT_ENV: &[&str] = &[
    "--accept-gap",
    "--all",
    "--batch-size",
    "--check",
    "--create-roles",
    "--force",
    "--id",
    "--json",
    "--limit",
    "--lockdown",
    "--older-than",
    "--out",
    "--payload",
    "--unlock",
];

/// The environment variable that also sets a `--flag`: `PGOUTBOX_` and the flag in upper
/// case with `-` as `_` (the rule every setting of the CLI follows); `None` for
/// [`FLAGS_WITHOUT_ENV`].
pub fn env_of(flag: &str) -> Option<String> {
    if FLAGS_WITHOUT_ENV.contains(&flag) {
        return None;
    }
    let name = flag.strip_prefix("--")?;
    Some(format!(
        "PGOUTBOX_{}",
        name.to_uppercase().replace('-', "_")
    ))
}

/// A setting that failed validation. Displays as
/// `invalid setting --flag (PGOUTBOX_FLAG) = "value": rule`, naming the environment variable
/// too, since an operator may have set either.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid setting {setting}{} = {value:?}: {rule}", env_of(setting).map(|e| format!(" ({e})")).unwrap_or_default())]
pub struct ValidationError {
    /// The setting's name as the operator writes it, e.g. `--slot`.
    pub setting: &'static str,
    /// The offending value (URLs redacted).
    pub value: String,
    /// The rule that was broken and how to fix it.
    pub rule: String,
}

/// Checks a slot or publication name: 1 to 63 of `a-z`, `0-9`, `_` (PostgreSQL's rule for
/// replication slot names; we apply it to publications too so names never need quoting).
///
/// # Errors
/// [`ValidationError`] naming `setting`.
pub fn validate_identifier(setting: &'static str, value: &str) -> Result<(), ValidationError> {
    let ok = !value.is_empty()
        && value.len() <= 63
        && value
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_');
    if ok {
        Ok(())
    } else {
        Err(ValidationError {
            setting,
            value: value.to_owned(),
            rule: "use 1 to 63 characters of a-z, 0-9 and _".into(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn identifiers() {
        assert!(validate_identifier("--slot", "pgoutbox_1").is_ok());
        for bad in ["", "Upper", "a-b", "x\"y", &"a".repeat(64)] {
            let e = validate_identifier("--slot", bad).unwrap_err();
            assert_eq!(e.setting, "--slot");
        }
    }
}
