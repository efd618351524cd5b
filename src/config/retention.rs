//! How long rows are kept, and the batches that delete them: `run`'s retention task
//! (`--idempotency-retention`, `--journal-retention`, `--maintenance-interval`), `pgoutbox
//! maintenance` and `dead-letters purge`.

use std::time::Duration;

use crate::validation::ValidationError;

/// Largest accepted `dead-letters list --limit`: 1,000,000 rows, more than a terminal or a
/// JSON reader wants at once (use SQL on `outbox.dead_letter` for more).
pub const DEAD_LETTER_LIST_CAP: i64 = 1_000_000;

/// Longest accepted `dead-letters purge --older-than`: 36,500 days (100 years), older than
/// any row can be.
pub const DEAD_LETTER_AGE_CAP: Duration = Duration::from_secs(36_500 * 86_400);

/// Default `--idempotency-retention` and `--journal-retention` (and `maintenance
/// --inbox-retention`): 7 days, longer than any retry loop of a producer or consumer, and
/// short enough that the tables stay small.
pub const DEFAULT_RETENTION: Duration = Duration::from_secs(7 * 86_400);

/// Longest accepted retention: 36,500 days (100 years), like `dead-letters purge`.
pub const RETENTION_CAP: Duration = DEAD_LETTER_AGE_CAP;

/// Default `--maintenance-interval`: how often `run` deletes expired idempotency keys and
/// journal rows. Five minutes: a retention of days needs no precision, and each pass is a
/// few small statements.
pub const DEFAULT_MAINTENANCE_INTERVAL: Duration = Duration::from_secs(300);

/// Bounds of `--maintenance-interval`: 1 s (tests) to 1 day.
pub const MAINTENANCE_INTERVAL_MIN: Duration = Duration::from_secs(1);

/// See [`MAINTENANCE_INTERVAL_MIN`].
pub const MAINTENANCE_INTERVAL_MAX: Duration = Duration::from_secs(86_400);

/// Rows deleted per statement by retention (`run`'s task and `maintenance --batch-size`'s
/// default): small enough that each delete holds its locks and WAL for milliseconds.
pub const DEFAULT_RETENTION_BATCH: u32 = 1000;

/// Largest `maintenance --batch-size`.
pub const RETENTION_BATCH_CAP: u32 = 100_000;

/// How long rows are kept before retention deletes them (`--idempotency-retention`,
/// `--journal-retention`, `--inbox-retention`): a duration in humantime's syntax (`7d`,
/// `12h`, `30m`, `1h 30m`), or `0` for off (nothing is deleted).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Retention(Option<Duration>);

impl Retention {
    /// Retention off: keep every row.
    pub const OFF: Retention = Retention(None);

    /// Rows older than `age` are deleted (`Duration::ZERO` means off).
    pub fn after(age: Duration) -> Retention {
        Retention((!age.is_zero()).then_some(age))
    }

    /// The age after which rows are deleted, `None` when off.
    pub fn age(self) -> Option<Duration> {
        self.0
    }

    /// Parses the text of `setting` (named in the error).
    ///
    /// # Errors
    /// [`ValidationError`] naming `setting`, the value and the accepted forms.
    pub fn parse(setting: &'static str, text: &str) -> Result<Retention, ValidationError> {
        let fail = |why: String| {
            ValidationError {
            setting,
            value: text.to_owned(),
            rule: format!(
                "{why}; write a duration such as 7d, 12h or 30m (at most {}d), or 0 to keep every row",
                RETENTION_CAP.as_secs() / 86_400
            ),
        }
        };
        let age = humantime::parse_duration(text.trim()).map_err(|e| fail(e.to_string()))?;
        if age > RETENTION_CAP {
            return Err(fail("too long".into()));
        }
        Ok(Retention::after(age))
    }
}

impl Default for Retention {
    fn default() -> Self {
        Retention::after(DEFAULT_RETENTION)
    }
}

impl std::fmt::Display for Retention {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.0 {
            Some(age) => write!(f, "{}", humantime::format_duration(age)),
            None => f.write_str("off"),
        }
    }
}

impl std::str::FromStr for Retention {
    type Err = ValidationError;
    fn from_str(text: &str) -> Result<Self, Self::Err> {
        Retention::parse("retention", text)
    }
}

/// What `run`'s background retention task deletes, and how often (see
/// [`crate::pipeline`]'s retention task).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RetentionSettings {
    /// `--idempotency-retention`: `outbox.idempotency` keys older than this.
    pub idempotency: Retention,
    /// `--journal-retention`: `outbox.journal` rows older than this.
    pub journal: Retention,
    /// `--maintenance-interval`: time between two passes (the first is at start); 1 s to
    /// 1 day, checked by [`super::RunSettings::validate`] (as are the retentions' caps, for
    /// settings built in code).
    pub interval: Duration,
}

impl Default for RetentionSettings {
    fn default() -> Self {
        RetentionSettings {
            idempotency: Retention::default(),
            journal: Retention::default(),
            interval: DEFAULT_MAINTENANCE_INTERVAL,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_retentions() {
        let p = |t| Retention::parse("--journal-retention", t);
        assert_eq!(
            p("7d").unwrap().age(),
            Some(Duration::from_secs(7 * 86_400))
        );
        assert_eq!(
            p("12h").unwrap().age(),
            Some(Duration::from_secs(12 * 3600))
        );
        assert_eq!(p(" 30m ").unwrap().age(), Some(Duration::from_secs(1800)));
        assert_eq!(p("1h 30m").unwrap().age(), Some(Duration::from_secs(5400)));
        assert_eq!(p("0").unwrap(), Retention::OFF);
        assert_eq!(Retention::default().to_string(), "7days");
        assert_eq!(Retention::OFF.to_string(), "off");
        for bad in ["", "7", "seven days", "-1d", "36501d"] {
            let e = p(bad).unwrap_err().to_string();
            assert!(
                e.contains("--journal-retention (PGOUTBOX_JOURNAL_RETENTION)")
                    && e.contains("7d, 12h or 30m")
                    && e.contains("0 to keep every row"),
                "{bad}: {e}"
            );
        }
    }
}
