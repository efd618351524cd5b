//! Typed, validated settings. Defaults are named consts whose docs say why.
//!
//! The CLI (`cli.rs`) fills these structs; library code never reads argv or the environment.

use std::time::Duration;

/// Default slot name.
pub const DEFAULT_SLOT: &str = "pgoutbox";
/// Default publication name (an empty publication: logical messages need one to exist).
pub const DEFAULT_PUBLICATION: &str = "pgoutbox";
/// Default exchange (durable topic).
pub const DEFAULT_EXCHANGE: &str = "pgoutbox";
/// Default in-flight window in messages: RabbitMQ needs 1,000 to 10,000 unconfirmed
/// persistent publishes to approach its ceiling on these machines (FACTS.md).
pub const DEFAULT_MAX_IN_FLIGHT: usize = 10_000;
/// Default in-flight window in payload bytes (16 MiB): bounds memory when messages are large.
pub const DEFAULT_MAX_IN_FLIGHT_BYTES: usize = 16 * 1024 * 1024;
/// Upper bound of the periodic standby status update interval (the server's own
/// `wal_receiver_status_interval` default is 10 s); it is lowered to a third of the server's
/// `wal_sender_timeout` so a stalled broker never gets the connection killed.
pub const MAX_STATUS_INTERVAL: Duration = Duration::from_secs(10);
/// Status updates after the watermark moved are coalesced to at most one per this interval:
/// one update per message costs the walsender ~7 µs each (FACTS.md).
pub const STATUS_COALESCE: Duration = Duration::from_millis(200);
/// How long `run` keeps retrying a slot that another process holds before exiting; 0 means
/// forever (a standby replica). After a SIGKILL the old walsender can hold the slot until it
/// notices the closed socket, so a restart also waits here.
pub const DEFAULT_SLOT_BUSY_TIMEOUT: Duration = Duration::from_secs(0);
/// Default `--standby-poll-ms`: while another process holds the slot, a standby looks at
/// `pg_replication_slots` this often (each poll is one small catalog query on the ordinary
/// SQL connection) and tries `START_REPLICATION` as soon as the slot is free, so a takeover
/// comes within about one poll after the holder's walsender ended.
pub const DEFAULT_STANDBY_POLL: Duration = Duration::from_millis(1000);
/// Smallest accepted `--standby-poll-ms`: 10 ms (a catalog query per standby that often
/// still costs the server little).
pub const MIN_STANDBY_POLL: Duration = Duration::from_millis(10);
/// Largest accepted `--standby-poll-ms`: one minute (a longer poll makes the takeover
/// slower than the walsender timeout that usually bounds it).
pub const STANDBY_POLL_CAP: Duration = Duration::from_secs(60);
/// Publish attempts for a nacked message before it is dead-lettered.
pub const DEFAULT_MAX_ATTEMPTS: u32 = 5;
/// Payloads above this are dead-lettered as `too_large` (RabbitMQ's own limit is 128 MiB by
/// default; 16 MiB keeps one message within the default byte window).
pub const DEFAULT_MAX_MESSAGE_BYTES: usize = 16 * 1024 * 1024;

/// Default `--read-coalesce-us`: 0, no delay between small reads of the replication socket.
///
/// The loop batches by itself: whatever arrived while a turn ran is read in one piece, and a
/// publish no longer wakes another thread. Measured side by side (bench scenario 4, 2,000 and
/// 4,000 msg/s, 2026-12-02), a 1 ms delay saved no CPU per message and added 0.5–1.1 ms to
/// the median, so it is off unless asked for.
pub const DEFAULT_READ_COALESCE: Duration = Duration::ZERO;

/// Largest accepted `--read-coalesce-us`: 100 ms.
pub const MAX_READ_COALESCE: Duration = Duration::from_millis(100);

// Upper bounds of the numeric and duration settings. Each is far above any sensible
// value, so it only catches typos and values that would overflow a clock or a counter
// (`Instant::now() + Duration::from_secs(u64::MAX)` panics).

/// Largest accepted `--max-in-flight`: 1,000,000 messages, 100 times the default.
/// RabbitMQ reaches its ceiling by 10,000 unconfirmed publishes (FACTS.md), and every
/// message in the window is held in memory until it is confirmed.
pub const MAX_IN_FLIGHT_CAP: usize = 1_000_000;
/// Largest accepted `--max-in-flight-bytes`: 4 GiB, 256 times the default. The window's
/// payloads are held in memory, so this is the memory an operator agrees to spend on them.
pub const MAX_IN_FLIGHT_BYTES_CAP: usize = 4 * 1024 * 1024 * 1024;
/// Largest accepted `--max-message-bytes` and `--broker-max-message-bytes`: 512 MiB,
/// RabbitMQ's hard upper limit for its own `max_message_size`: a larger message could never
/// be published.
pub const MAX_MESSAGE_BYTES_CAP: usize = 512 * 1024 * 1024;
/// Largest accepted `--max-attempts`: 1,000. With the nack retry backoff capped at 5 s that
/// is more than an hour of retrying one message while everything behind it waits.
pub const MAX_ATTEMPTS_CAP: u32 = 1_000;
/// Largest accepted `--slot-busy-timeout-s`: 30 days. A bounded wait longer than that is a
/// standby in all but name (0 waits forever).
pub const SLOT_BUSY_TIMEOUT_CAP: Duration = Duration::from_secs(30 * 86_400);
/// Largest accepted `--shutdown-timeout-s`: one day. A drain waits only for confirms the
/// broker owes (milliseconds when it is healthy); a service manager kills a process long
/// before a day has passed (the shipped unit waits 45 s).
pub const SHUTDOWN_TIMEOUT_CAP: Duration = Duration::from_secs(86_400);
/// Largest accepted `dead-letters list --limit`: 1,000,000 rows, more than a terminal or a
/// JSON reader wants at once (use SQL on `outbox.dead_letter` for more).
pub const DEAD_LETTER_LIST_CAP: i64 = 1_000_000;
/// Longest accepted `dead-letters purge --older-than`: 36,500 days (100 years), older than
/// any row can be.
pub const DEAD_LETTER_AGE_CAP: Duration = Duration::from_secs(36_500 * 86_400);

/// Default `--stall-after-s`: unconfirmed messages with no settle for a minute are a stall
/// (a confirm round trip is milliseconds; a minute rules out a slow disk or a GC pause).
pub const DEFAULT_STALL_AFTER: Duration = Duration::from_secs(60);
/// Largest accepted `--stall-after-s`: one hour (a stall detected later is no alarm).
pub const MAX_STALL_AFTER: Duration = Duration::from_secs(3600);

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
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Deserialize)]
#[serde(try_from = "String")]
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

/// For the config file, whose error names the key: the rule alone.
impl TryFrom<String> for Retention {
    type Error = String;
    fn try_from(text: String) -> Result<Self, Self::Error> {
        Retention::parse("retention", &text).map_err(|e| e.rule)
    }
}

/// Whether `run` keeps the delivery journal (`--journal`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum JournalMode {
    /// No journal (the default).
    #[default]
    Off,
    /// One `outbox.journal` row per confirmed message, written in batches.
    On,
}

/// What `run`'s background retention task deletes, and how often (see
/// [`crate::pipeline`]'s retention task).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RetentionSettings {
    /// `--idempotency-retention`: `outbox.idempotency` keys older than this.
    pub idempotency: Retention,
    /// `--journal-retention`: `outbox.journal` rows older than this.
    pub journal: Retention,
    /// `--maintenance-interval`: time between two passes (the first is at start).
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

/// Parses `--http-addr`: `HOST:PORT` (an IP address, `localhost`) or `off`.
///
/// # Errors
/// [`ValidationError`] for `--http-addr` naming the accepted forms.
pub fn parse_http_addr(text: &str) -> Result<Option<std::net::SocketAddr>, ValidationError> {
    use std::net::ToSocketAddrs;
    let text = text.trim();
    if text.eq_ignore_ascii_case("off") {
        return Ok(None);
    }
    let bad = |why: String| ValidationError {
        setting: "--http-addr",
        value: text.to_owned(),
        rule: format!(
            "{why}; write HOST:PORT (e.g. 127.0.0.1:8432, 0.0.0.0:8432 in a container) or off"
        ),
    };
    let mut addrs = text
        .to_socket_addrs()
        .map_err(|e| bad(format!("not an address ({e})")))?;
    addrs
        .next()
        .map(Some)
        .ok_or_else(|| bad("resolves to no address".into()))
}

/// A deliberate crash for fault tests: the process aborts (like a SIGKILL) at a point that
/// is hard to hit from outside.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Failpoint {
    /// Abort as soon as this many messages were confirmed by the broker, before any standby
    /// status update could report them.
    AbortAfterConfirms(u64),
}

impl std::str::FromStr for Failpoint {
    type Err = String;

    /// Parses `abort-after-confirms=N`.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.split_once('=') {
            Some(("abort-after-confirms", n)) => n
                .parse()
                .map(Failpoint::AbortAfterConfirms)
                .map_err(|_| format!("invalid count in failpoint {s:?}")),
            _ => Err(format!(
                "unknown failpoint {s:?}; known: abort-after-confirms=N"
            )),
        }
    }
}

/// What happens to a message the broker returns as unroutable (312 NO_ROUTE).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum UnroutablePolicy {
    /// Dead-letter it and go on.
    DeadLetter,
    /// Retry forever, holding the watermark, logging each attempt.
    Block,
}

/// What each published message carries besides its body and routing key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PublishProperties {
    /// `message_id`, `content_type`, `delivery_mode` 2, `timestamp` (s), the producer's
    /// headers, and ours: `x-pgoutbox-lsn` and `x-pgoutbox-commit-lsn` (`X/Y` text),
    /// `x-pgoutbox-commit-time-us` (integer).
    Full,
    /// `delivery_mode` 2, `message_id` and the producer's own headers only; returns are
    /// matched by `message_id`.
    Minimal,
}

/// The exchanges producers may name with `outbox.emit(..., exchange => ...)`
/// (`--allowed-exchanges`). The configured `--exchange` is always allowed, named or not.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum AllowedExchanges {
    /// No `--allowed-exchanges`: producers may name any exchange (routing by a field of the
    /// event, as Debezium's outbox event router does).
    #[default]
    Any,
    /// Only these (and `--exchange`); any other is dead-lettered as
    /// `exchange_not_allowed`. Empty: producers may name only `--exchange`.
    Only(std::collections::BTreeSet<String>),
}

impl AllowedExchanges {
    /// Parses `--allowed-exchanges`: exchange names separated by commas, blanks around each
    /// trimmed, empty pieces dropped (so `""` allows only `--exchange`).
    ///
    /// # Errors
    /// [`ValidationError`] for `--allowed-exchanges` when a name is longer than 255 bytes.
    pub fn parse(text: &str) -> Result<Self, ValidationError> {
        let mut names = std::collections::BTreeSet::new();
        for name in text.split(',').map(str::trim).filter(|n| !n.is_empty()) {
            if name.len() > 255 {
                return Err(ValidationError {
                    setting: "--allowed-exchanges",
                    value: text.to_owned(),
                    rule: format!(
                        "the exchange name starting {:?} is {} bytes long; AMQP exchange names are 1 to 255 bytes (separate names with commas)",
                        name.chars().take(40).collect::<String>(),
                        name.len()
                    ),
                });
            }
            names.insert(name.to_owned());
        }
        Ok(AllowedExchanges::Only(names))
    }

    /// Whether a producer may name `exchange` (the configured `--exchange` is checked by
    /// the caller: it is always allowed).
    pub fn allows(&self, exchange: &str) -> bool {
        match self {
            AllowedExchanges::Any => true,
            AllowedExchanges::Only(names) => names.contains(exchange),
        }
    }
}

impl std::fmt::Display for AllowedExchanges {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            AllowedExchanges::Any => write!(f, "any"),
            AllowedExchanges::Only(names) => {
                let list: Vec<&str> = names.iter().map(String::as_str).collect();
                write!(f, "{}", list.join(","))
            }
        }
    }
}

/// How `run` makes sure an exchange exists before publishing to it: `--exchange` at
/// connect, and each exchange a producer names on its first use on a connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ExchangeDeclare {
    /// `exchange.declare` durable topic: created when absent (the default).
    #[default]
    DurableTopic,
    /// `--no-declare`: a passive `exchange.declare`, which only checks that it exists.
    /// A missing `--exchange` stops `run`; a missing producer-named exchange dead-letters
    /// the message as `exchange_not_found`.
    Passive,
}

/// How long a SIGINT/SIGTERM waits for outstanding publisher confirms.
pub const DEFAULT_SHUTDOWN_TIMEOUT: Duration = Duration::from_secs(30);
/// How long a session whose Postgres connection broke keeps collecting broker confirms
/// (`--postgres-loss-drain-ms`), so that messages the broker already has are not sent again
/// after the reconnect: a few seconds cover a healthy broker's confirm latency many times over.
pub const DEFAULT_POSTGRES_LOSS_DRAIN: Duration = Duration::from_secs(5);
/// Largest `--postgres-loss-drain-ms`: ten minutes; the reconnect waits that long at worst.
pub const POSTGRES_LOSS_DRAIN_CAP: Duration = Duration::from_secs(600);
/// The logical decoding message prefix of the default outbox's envelopes (another outbox
/// stores its own: [`crate::outbox_schema`]).
pub const MESSAGE_PREFIX: &str = crate::outbox_schema::DEFAULT_PREFIX;

/// Options that select what one invocation acts on (or how it prints) rather than
/// configure pgoutbox: they read no environment variable.
pub const FLAGS_WITHOUT_ENV: &[&str] = &[
    "--accept-gap",
    "--all",
    "--batch-size",
    "--create-roles",
    "--force",
    "--id",
    "--json",
    "--limit",
    "--lockdown",
    "--older-than",
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

/// Replaces the password in a URL with `***` for logs and `Debug`; a URL without one is
/// returned as written (not normalised), so an error shows the value the operator typed.
pub fn redact_url(url: &str) -> String {
    match url::Url::parse(url) {
        Ok(mut u) if u.password().is_some() || u.query_pairs().any(|(k, _)| k == "password") => {
            if u.password().is_some() {
                let _ = u.set_password(Some("***"));
            }
            // libpq also reads `?password=`.
            if u.query_pairs().any(|(k, _)| k == "password") {
                let pairs: Vec<(String, String)> = u
                    .query_pairs()
                    .map(|(k, v)| {
                        let v = if k == "password" {
                            "***".into()
                        } else {
                            v.into_owned()
                        };
                        (k.into_owned(), v)
                    })
                    .collect();
                u.query_pairs_mut().clear().extend_pairs(pairs);
            }
            u.to_string()
        }
        Ok(_) => url.to_owned(),
        Err(_) if url.contains("password") => "<redacted connection string>".into(),
        // Not a URL the parser accepts, yet it may carry `user:secret@`: mask what lies
        // between the first ':' after the scheme and the last '@' (indices of ASCII
        // characters, so always character boundaries).
        Err(_) => match url.split_once("://") {
            Some((scheme, rest)) => match rest.rsplit_once('@') {
                Some((userinfo, host)) => match userinfo.split_once(':') {
                    Some((user, _)) => format!("{scheme}://{user}:***@{host}"),
                    None => url.to_owned(),
                },
                None => url.to_owned(),
            },
            None => url.to_owned(),
        },
    }
}

/// How long a Postgres connection handshake (TCP connect, startup, authentication, up to
/// the first ReadyForQuery) may take when the URL sets no `connect_timeout`: long enough for
/// a loaded server or a slow SCRAM exchange, short enough that a host that accepts TCP and
/// never answers is reported promptly instead of hanging `status` or `run`.
pub const DEFAULT_CONNECT_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

/// The handshake timeout for a Postgres connection: libpq's `connect_timeout` from the URL
/// (seconds), else [`DEFAULT_CONNECT_TIMEOUT`]. tokio-postgres' parser drops
/// `connect_timeout=0` (libpq: wait for ever), so 0 also means the default: pgoutbox never
/// waits for ever on a handshake.
pub fn connect_timeout(config: &tokio_postgres::Config) -> std::time::Duration {
    config
        .get_connect_timeout()
        .copied()
        .filter(|t| !t.is_zero())
        .unwrap_or(DEFAULT_CONNECT_TIMEOUT)
}

/// `PostgreSQL user@host:port/dbname` of a connection config, for error messages (no
/// password). The first host and port are shown.
pub fn describe_postgres_target(config: &tokio_postgres::Config) -> String {
    let host = match config.get_hosts().first() {
        Some(tokio_postgres::config::Host::Tcp(h)) => h.clone(),
        Some(tokio_postgres::config::Host::Unix(p)) => p.display().to_string(),
        None => "localhost".into(),
    };
    format!(
        "PostgreSQL {}@{}:{}/{}",
        config.get_user().unwrap_or("?"),
        host,
        config.get_ports().first().copied().unwrap_or(5432),
        config.get_dbname().unwrap_or("?")
    )
}

/// A parsed `--database-url`: tokio-postgres' settings and the TLS settings
/// ([`crate::postgres_tls`]) that its parser does not know. Derefs to the former, so code
/// that needs only host, user or timeouts reads it as a `tokio_postgres::Config`.
#[derive(Debug, Clone)]
pub struct DatabaseConfig {
    /// Host, port, user, password, dbname, options, timeouts; its `ssl_mode` and
    /// `channel_binding` are set from `tls` for the SQL connection.
    pub pg: tokio_postgres::Config,
    /// `sslmode`, `sslrootcert`, `sslcert`, `sslkey`, `channel_binding` with libpq's meanings.
    pub tls: crate::postgres_tls::PostgresTls,
}

impl std::ops::Deref for DatabaseConfig {
    type Target = tokio_postgres::Config;

    fn deref(&self) -> &tokio_postgres::Config {
        &self.pg
    }
}

/// Parses a Postgres connection string (URL or key=value) as libpq does: the TLS
/// parameters (`sslmode` with all six of libpq's modes, `sslrootcert`, `sslcert`,
/// `sslkey`, `channel_binding`) are taken out by [`split_tls_parameters`], the rest is read
/// by tokio-postgres' parser.
///
/// # Errors
/// [`ValidationError`] for `--database-url` when it does not parse, when a TLS parameter
/// has a bad value or an unsupported `ssl*` parameter is given, or the TLS settings do not
/// fit together ([`crate::postgres_tls::PostgresTls::validate`]).
pub fn parse_database_url(url: &str) -> Result<DatabaseConfig, ValidationError> {
    let invalid = |rule: String| ValidationError {
        setting: "--database-url",
        value: redact_url(url),
        rule,
    };
    let (rest, tls) = split_tls_parameters(url).map_err(invalid)?;
    tls.validate().map_err(invalid)?;
    let mut config: tokio_postgres::Config = rest.parse().map_err(|e| invalid(format!("not a PostgreSQL connection string ({e}); expected postgres://user:password@host:port/dbname")))?;
    if config.get_user().is_none() {
        return Err(invalid(
            "no user given; write postgres://USER@host/dbname".into(),
        ));
    }
    use crate::postgres_tls::{ChannelBindingMode, SslMode};
    let unix = matches!(
        config.get_hosts().first(),
        Some(tokio_postgres::config::Host::Unix(_))
    );
    config.ssl_mode(match tls.mode {
        // libpq ignores sslmode on Unix-domain sockets; `allow` tries plaintext first
        // (admin::connect retries with TLS).
        _ if unix => tokio_postgres::config::SslMode::Disable,
        SslMode::Disable | SslMode::Allow => tokio_postgres::config::SslMode::Disable,
        SslMode::Prefer => tokio_postgres::config::SslMode::Prefer,
        SslMode::Require | SslMode::VerifyCa | SslMode::VerifyFull => {
            tokio_postgres::config::SslMode::Require
        }
    });
    config.channel_binding(match tls.channel_binding {
        ChannelBindingMode::Disable => tokio_postgres::config::ChannelBinding::Disable,
        ChannelBindingMode::Prefer => tokio_postgres::config::ChannelBinding::Prefer,
        ChannelBindingMode::Require => tokio_postgres::config::ChannelBinding::Require,
    });
    Ok(DatabaseConfig { pg: config, tls })
}

/// Takes the TLS parameters out of a connection string: returns the string without them
/// (everything else exactly as written) and the TLS settings. A `postgres://` or
/// `postgresql://` URL has them in its query (percent-decoded); a key=value string as
/// `key=value` pairs (values optionally single-quoted, with `\'` and `\\` escapes).
///
/// # Errors
/// A message naming the parameter ([`crate::postgres_tls::PostgresTls::take_parameter`]),
/// or an unterminated quote.
pub fn split_tls_parameters(
    text: &str,
) -> Result<(String, crate::postgres_tls::PostgresTls), String> {
    let mut tls = crate::postgres_tls::PostgresTls::default();
    if text.starts_with("postgres://") || text.starts_with("postgresql://") {
        let Some((base, query)) = text.split_once('?') else {
            return Ok((text.to_owned(), tls));
        };
        let mut kept = Vec::new();
        for pair in query.split('&') {
            let (key, value) = pair.split_once('=').unwrap_or((pair, ""));
            let decode = |s: &str| {
                percent_encoding::percent_decode_str(s)
                    .decode_utf8()
                    .map(|c| c.into_owned())
                    .map_err(|_| {
                        format!("the URL parameter {s:?} is not UTF-8 once percent-decoded")
                    })
            };
            if !tls.take_parameter(&decode(key)?, &decode(value)?)? {
                kept.push(pair);
            }
        }
        let rest = if kept.is_empty() {
            base.to_owned()
        } else {
            format!("{base}?{}", kept.join("&"))
        };
        return Ok((rest, tls));
    }
    let mut rest = String::new();
    let mut last = 0;
    for (start, end, key, value) in key_value_pairs(text)? {
        if tls.take_parameter(&key, &value)? {
            rest.push_str(&text[last..start]);
            last = end;
        }
    }
    rest.push_str(&text[last..]);
    Ok((rest, tls))
}

/// The `key = value` pairs of a libpq key/value connection string, each with its byte span.
fn key_value_pairs(text: &str) -> Result<Vec<(usize, usize, String, String)>, String> {
    let bytes = text.as_bytes();
    let mut pairs = Vec::new();
    let mut i = 0;
    let skip_space = |mut i: usize| {
        while i < bytes.len() && bytes[i].is_ascii_whitespace() {
            i += 1;
        }
        i
    };
    loop {
        i = skip_space(i);
        if i >= bytes.len() {
            return Ok(pairs);
        }
        let start = i;
        while i < bytes.len() && bytes[i] != b'=' && !bytes[i].is_ascii_whitespace() {
            i += 1;
        }
        let key = text[start..i].to_owned();
        i = skip_space(i);
        if bytes.get(i) != Some(&b'=') {
            // Not ours to judge: tokio-postgres' parser reports it.
            return Ok(pairs);
        }
        i = skip_space(i + 1);
        let mut value = Vec::new();
        if bytes.get(i) == Some(&b'\'') {
            i += 1;
            loop {
                match bytes.get(i) {
                    None => return Err(format!("the value of {key} has an unterminated quote")),
                    Some(b'\'') => {
                        i += 1;
                        break;
                    }
                    Some(b'\\') if i + 1 < bytes.len() => {
                        value.push(bytes[i + 1]);
                        i += 2;
                    }
                    Some(&b) => {
                        value.push(b);
                        i += 1;
                    }
                }
            }
        } else {
            while let Some(&b) = bytes.get(i) {
                if b.is_ascii_whitespace() {
                    break;
                }
                if b == b'\\' && i + 1 < bytes.len() {
                    value.push(bytes[i + 1]);
                    i += 2;
                } else {
                    value.push(b);
                    i += 1;
                }
            }
        }
        pairs.push((start, i, key, String::from_utf8_lossy(&value).into_owned()));
    }
}

/// Settings of `pgoutbox run`.
#[derive(Clone)]
pub struct RunConfig {
    /// Postgres connection string (its database holds the slot).
    pub database_url: String,
    /// `amqp://` or `amqps://` URLs of the broker's nodes (TLS parameters in each query),
    /// at least one, as given (see [`split_amqp_urls`]); [`RunConfig::amqp_url_order`]
    /// says in which order they are tried.
    pub amqp_urls: Vec<String>,
    /// The order the nodes of `amqp_urls` are tried in (`--amqp-url-order`).
    pub amqp_url_order: AmqpUrlOrder,
    /// Logical replication slot (pgoutput).
    pub slot: String,
    /// The outbox's schema (`--schema`): where its dead letters, stream state and prefix
    /// setting live.
    pub schema: crate::outbox_schema::SchemaName,
    /// The logical-message prefix to publish (`--prefix`); `None`: the one `setup` stored
    /// in the schema's `settings` table (`pgoutbox` for schema `outbox` without one).
    pub prefix: Option<crate::outbox_schema::MessagePrefix>,
    /// Publication named in `publication_names`.
    pub publication: String,
    /// Durable topic exchange messages are published to when their producer named none.
    pub exchange: String,
    /// Which other exchanges producers may name (`--allowed-exchanges`).
    pub allowed_exchanges: AllowedExchanges,
    /// Declare exchanges, or only check them (`--no-declare`).
    pub exchange_declare: ExchangeDeclare,
    /// In-flight window in messages (sent, not yet confirmed).
    pub max_in_flight: usize,
    /// In-flight window in payload bytes.
    pub max_in_flight_bytes: usize,
    /// How long to keep retrying a slot held by another process (`None`: forever).
    pub slot_busy_timeout: Option<Duration>,
    /// How often a standby polls the slot's holder (`--standby-poll-ms`, jittered down
    /// by up to a fifth).
    pub standby_poll: Duration,
    /// What to do with returned (unroutable) messages.
    pub on_unroutable: UnroutablePolicy,
    /// What each message carries (`--publish-properties`).
    pub publish_properties: PublishProperties,
    /// Publish attempts for a nacked message before it is dead-lettered (at least 1).
    pub max_attempts: u32,
    /// Logical messages (the whole envelope, in bytes) larger than this are dead-lettered
    /// as `too_large`.
    pub max_message_bytes: usize,
    /// The broker's `max_message_size` (payload bytes), when the operator knows it: larger
    /// payloads are dead-lettered as `too_large` before publishing. `None`: learned from
    /// the broker's channel close the first time it refuses a message.
    pub broker_max_message_bytes: Option<usize>,
    /// A crash injected for fault tests (`None` in production).
    pub failpoint: Option<Failpoint>,
    /// How long shutdown waits for outstanding confirms.
    pub shutdown_timeout: Duration,
    /// How long to keep collecting broker confirms after the Postgres connection broke
    /// (it ends early once nothing is unconfirmed).
    pub postgres_loss_drain: Duration,
    /// Minimum time between two reads of the replication socket when the previous read was
    /// small and 4 or more publishes are unconfirmed (ms-scale; zero reads as soon as bytes
    /// arrive). With fewer unconfirmed (an idle stream, a low rate) bytes are read at once; under a
    /// steady stream of small transactions they are read at most once per interval, so one
    /// wake-up, one publish batch and one confirm batch cover many transactions. Reads of
    /// 64 KiB or more (a backlog, big messages) are never delayed.
    pub read_coalesce: Duration,
    /// Identifies this process in `application_name` and the RabbitMQ connection name.
    pub instance_id: String,
    /// Where `/metrics`, `/healthz` and `/readyz` are served (`None`: off).
    pub http_addr: Option<std::net::SocketAddr>,
    /// Unconfirmed messages with no settle for this long are a stall (`/readyz` 503, the
    /// `pgoutbox_stalled` gauge, a warning a minute).
    pub stall_after: Duration,
    /// Start even when the slot's history has a gap (`--accept-gap`; see
    /// [`crate::stream_state`]): the gap is logged and recorded in `outbox.stream_state`.
    pub accept_gap: bool,
    /// Publish in the CloudEvents AMQP binding's binary content mode (`--cloudevents`), with
    /// this source and prefix; `None`: plain messages.
    pub cloudevents: Option<crate::cloudevents::Binding>,
    /// `--journal`: record every confirmed message in `outbox.journal`.
    pub journal: JournalMode,
    /// What the background retention task deletes, and how often.
    pub retention: RetentionSettings,
}

impl std::fmt::Debug for RunConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RunConfig")
            .field("database_url", &redact_url(&self.database_url))
            .field(
                "amqp_urls",
                &self
                    .amqp_urls
                    .iter()
                    .map(|u| redact_url(u))
                    .collect::<Vec<_>>(),
            )
            .field("amqp_url_order", &self.amqp_url_order)
            .field("slot", &self.slot)
            .field("schema", &self.schema)
            .field("prefix", &self.prefix)
            .field("publication", &self.publication)
            .field("exchange", &self.exchange)
            .field("allowed_exchanges", &self.allowed_exchanges)
            .field("exchange_declare", &self.exchange_declare)
            .field("max_in_flight", &self.max_in_flight)
            .field("max_in_flight_bytes", &self.max_in_flight_bytes)
            .field("slot_busy_timeout", &self.slot_busy_timeout)
            .field("standby_poll", &self.standby_poll)
            .field("shutdown_timeout", &self.shutdown_timeout)
            .field("postgres_loss_drain", &self.postgres_loss_drain)
            .field("read_coalesce", &self.read_coalesce)
            .field("on_unroutable", &self.on_unroutable)
            .field("publish_properties", &self.publish_properties)
            .field("max_attempts", &self.max_attempts)
            .field("max_message_bytes", &self.max_message_bytes)
            .field("broker_max_message_bytes", &self.broker_max_message_bytes)
            .field("instance_id", &self.instance_id)
            .field("http_addr", &self.http_addr)
            .field("stall_after", &self.stall_after)
            .field("accept_gap", &self.accept_gap)
            .field("cloudevents", &self.cloudevents)
            .field("journal", &self.journal)
            .field("retention", &self.retention)
            .finish()
    }
}

impl RunConfig {
    /// Validates every field.
    ///
    /// # Errors
    /// The first [`ValidationError`] found.
    pub fn validate(&self) -> Result<(), ValidationError> {
        parse_database_url(&self.database_url)?;
        validate_amqp_urls(&self.amqp_urls)?;
        validate_identifier("--slot", &self.slot)?;
        validate_identifier("--publication", &self.publication)?;
        if self.exchange.is_empty() || self.exchange.len() > 255 {
            return Err(ValidationError {
                setting: "--exchange",
                value: self.exchange.clone(),
                rule: "use 1 to 255 bytes (the default exchange \"\" cannot be declared)".into(),
            });
        }
        check_range(
            "--max-in-flight",
            self.max_in_flight,
            1,
            MAX_IN_FLIGHT_CAP,
            "messages",
        )?;
        check_range(
            "--max-in-flight-bytes",
            self.max_in_flight_bytes,
            1,
            MAX_IN_FLIGHT_BYTES_CAP,
            "bytes",
        )?;
        check_range(
            "--max-message-bytes",
            self.max_message_bytes,
            1,
            MAX_MESSAGE_BYTES_CAP,
            "bytes",
        )?;
        if let Some(broker_max) = self.broker_max_message_bytes {
            check_range(
                "--broker-max-message-bytes",
                broker_max,
                1,
                MAX_MESSAGE_BYTES_CAP,
                "bytes",
            )?;
        }
        check_range(
            "--max-attempts",
            self.max_attempts,
            1,
            MAX_ATTEMPTS_CAP,
            "attempts",
        )?;
        check_range(
            "--slot-busy-timeout-s",
            self.slot_busy_timeout.map_or(0, |d| d.as_secs()),
            0,
            SLOT_BUSY_TIMEOUT_CAP.as_secs(),
            "seconds (0 waits forever)",
        )?;
        check_range(
            "--standby-poll-ms",
            self.standby_poll.as_millis(),
            MIN_STANDBY_POLL.as_millis(),
            STANDBY_POLL_CAP.as_millis(),
            "milliseconds",
        )?;
        check_range(
            "--shutdown-timeout-s",
            self.shutdown_timeout.as_secs(),
            0,
            SHUTDOWN_TIMEOUT_CAP.as_secs(),
            "seconds",
        )?;
        check_range(
            "--postgres-loss-drain-ms",
            self.postgres_loss_drain.as_millis(),
            0,
            POSTGRES_LOSS_DRAIN_CAP.as_millis(),
            "milliseconds",
        )?;
        if self.read_coalesce > MAX_READ_COALESCE {
            return Err(ValidationError {
                setting: "--read-coalesce-us",
                value: self.read_coalesce.as_micros().to_string(),
                rule: format!(
                    "must be at most {} (it delays every small read, and with it the replies to the server's keepalives)",
                    MAX_READ_COALESCE.as_micros()
                ),
            });
        }
        check_range(
            "--stall-after-s",
            self.stall_after.as_secs(),
            1,
            MAX_STALL_AFTER.as_secs(),
            "seconds",
        )?;
        if let Some(binding) = &self.cloudevents {
            binding.validate().map_err(|rule| ValidationError {
                setting: "--cloudevents-source",
                value: binding.source.clone(),
                rule: format!(
                    "{rule} (when not given, it is {}:///DATABASE/SLOT)",
                    crate::cloudevents::DEFAULT_SOURCE_SCHEME
                ),
            })?;
        }
        let interval = self.retention.interval;
        if !(MAINTENANCE_INTERVAL_MIN..=MAINTENANCE_INTERVAL_MAX).contains(&interval) {
            return Err(ValidationError {
                setting: "--maintenance-interval",
                value: humantime::format_duration(interval).to_string(),
                rule: "write a duration from 1s to 1d, such as 5m".into(),
            });
        }
        Ok(())
    }
}

/// The order in which the nodes named by `--amqp-url` are tried (`--amqp-url-order`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum AmqpUrlOrder {
    /// As given: the first pass starts at the first URL.
    #[default]
    InOrder,
    /// Shuffled once when `run` starts, so several streamers spread over the nodes; the
    /// shuffled order is then kept like an order given.
    Shuffle,
}

/// Splits `--amqp-url` values into one URL per node: each value may itself be a
/// comma-separated list (`PGOUTBOX_AMQP_URL=amqp://a,amqp://b`). A comma splits only where
/// `amqp://` or `amqps://` follows it, so a comma inside a URL (a password, a query) is
/// kept. Blanks around each URL are trimmed and empty pieces dropped.
pub fn split_amqp_urls<S: AsRef<str>>(values: &[S]) -> Vec<String> {
    let mut out = Vec::new();
    for value in values {
        let value = value.as_ref();
        let mut current = String::new();
        for (i, piece) in value.split(',').enumerate() {
            let trimmed = piece.trim_start();
            let starts_node = trimmed.starts_with("amqp://") || trimmed.starts_with("amqps://");
            if i > 0 && !starts_node {
                current.push(',');
                current.push_str(piece);
                continue;
            }
            push_url(&mut out, &current);
            current = piece.to_owned();
        }
        push_url(&mut out, &current);
    }
    out
}

/// Pushes one URL of [`split_amqp_urls`], without surrounding blanks or trailing commas
/// (`amqp://a,` ends a list), unless nothing is left.
fn push_url(out: &mut Vec<String>, piece: &str) {
    let url = piece.trim().trim_end_matches(',').trim_end();
    if !url.is_empty() {
        out.push(url.to_owned());
    }
}

/// The nodes in the order `run` tries them: `urls` as given for
/// [`AmqpUrlOrder::InOrder`], shuffled with `seed` for [`AmqpUrlOrder::Shuffle`] (the
/// caller passes a random seed; a fixed one makes the order reproducible in tests).
pub fn order_amqp_urls(urls: &[String], order: AmqpUrlOrder, seed: u64) -> Vec<String> {
    let mut urls = urls.to_vec();
    if order == AmqpUrlOrder::Shuffle {
        fastrand::Rng::with_seed(seed).shuffle(&mut urls);
    }
    urls
}

/// Validates every `--amqp-url` (at least one, each `amqp://` or `amqps://` and parsed as
/// the publisher will parse it, TLS parameters included, so a malformed URL is a usage
/// error at start, not a connect failure retried for ever; the TLS files are read when
/// connecting).
///
/// # Errors
/// [`ValidationError`] for `--amqp-url` naming the (redacted) URL at fault, and which of
/// several it is.
pub fn validate_amqp_urls(urls: &[String]) -> Result<(), ValidationError> {
    if urls.is_empty() {
        return Err(ValidationError {
            setting: "--amqp-url",
            value: String::new(),
            rule: "give at least one amqp://user:password@host:port/vhost (repeat --amqp-url, or separate URLs with commas, for the nodes of a cluster)".into(),
        });
    }
    for (i, url) in urls.iter().enumerate() {
        let which = if urls.len() > 1 {
            format!(" (URL {} of {})", i + 1, urls.len())
        } else {
            String::new()
        };
        if !(url.starts_with("amqp://") || url.starts_with("amqps://")) {
            return Err(ValidationError {
                setting: "--amqp-url",
                value: format!("{}{which}", redact_url(url)),
                rule: "expected amqp://user:password@host:port/vhost".into(),
            });
        }
        if let Err(e) = crate::publisher::socket::Endpoint::parse(url) {
            return Err(ValidationError {
                setting: "--amqp-url",
                value: format!("{}{which}", redact_url(url)),
                rule: e.to_string(),
            });
        }
    }
    Ok(())
}

/// Checks `min <= value <= max` for a numeric setting.
///
/// # Errors
/// [`ValidationError`] naming `setting`, with the range and its `unit` in the rule.
fn check_range<T>(
    setting: &'static str,
    value: T,
    min: T,
    max: T,
    unit: &str,
) -> Result<(), ValidationError>
where
    T: PartialOrd + std::fmt::Display,
{
    if value < min || value > max {
        return Err(ValidationError {
            setting,
            value: value.to_string(),
            rule: format!("must be from {min} to {max} {unit}"),
        });
    }
    Ok(())
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

    #[test]
    fn connect_timeout_is_the_urls_or_ten_seconds() {
        let timeout = |url: &str| connect_timeout(&parse_database_url(url).unwrap());
        assert_eq!(
            timeout("postgres://u@h/db?connect_timeout=3"),
            std::time::Duration::from_secs(3)
        );
        assert_eq!(
            timeout("host=h user=u connect_timeout=45"),
            std::time::Duration::from_secs(45)
        );
        assert_eq!(timeout("postgres://u@h/db"), DEFAULT_CONNECT_TIMEOUT);
        assert_eq!(
            timeout("postgres://u@h/db?connect_timeout=0"),
            DEFAULT_CONNECT_TIMEOUT
        );
        assert_eq!(
            describe_postgres_target(&parse_database_url("postgres://u:secret@h:6543/db").unwrap()),
            "PostgreSQL u@h:6543/db"
        );
    }

    #[test]
    fn redacts_passwords() {
        assert_eq!(
            redact_url("postgres://u:secret@h:5/db"),
            "postgres://u:***@h:5/db"
        );
        assert!(!redact_url("amqp://guest:guest@h/%2f").contains("guest@"));
        // Unparseable, with a password: masked all the same.
        assert_eq!(
            redact_url("amqp://g:s3cr@t@h:99999999/%2f"),
            "amqp://g:***@h:99999999/%2f"
        );
        assert_eq!(
            redact_url("postgres://日:é@[::1/db"),
            "postgres://日:***@[::1/db"
        );
        // Without a password, the text as written.
        assert_eq!(redact_url("postgres://u@h/é"), "postgres://u@h/é");
    }

    #[test]
    fn reads_libpq_tls_parameters_from_urls_and_key_value_strings() {
        use crate::postgres_tls::{ChannelBindingMode, RootCert, SslMode};
        use tokio_postgres::config::SslMode as Pg;
        let c = parse_database_url("postgres://u:p%40ss@h:6543/db?sslmode=verify-full&sslrootcert=%2Fetc%2Fca%20x.pem&connect_timeout=3&channel_binding=require").unwrap();
        assert_eq!(c.tls.mode, SslMode::VerifyFull);
        assert_eq!(
            c.tls.root_cert,
            Some(RootCert::File("/etc/ca x.pem".into()))
        );
        assert_eq!(c.tls.channel_binding, ChannelBindingMode::Require);
        assert_eq!(c.get_ssl_mode(), Pg::Require);
        assert_eq!(c.get_password(), Some(&b"p@ss"[..]));
        assert_eq!(connect_timeout(&c), std::time::Duration::from_secs(3));
        let c = parse_database_url(
            "host=h user=u sslmode = verify-ca sslrootcert='/ca dir/it\\'s.pem' sslcert=/c.pem sslkey=/k.pem dbname=d",
        )
        .unwrap();
        assert_eq!(c.tls.mode, SslMode::VerifyCa);
        assert_eq!(
            c.tls.root_cert,
            Some(RootCert::File("/ca dir/it's.pem".into()))
        );
        assert_eq!(c.tls.client_cert, Some(("/c.pem".into(), "/k.pem".into())));
        assert_eq!(c.get_dbname(), Some("d"));
        // The default is prefer, as in libpq; allow starts in plaintext.
        let c = parse_database_url("postgres://u@h/db").unwrap();
        assert_eq!(
            (c.tls.mode, c.get_ssl_mode()),
            (SslMode::Prefer, Pg::Prefer)
        );
        let c = parse_database_url("postgres://u@h/db?sslmode=allow").unwrap();
        assert_eq!(
            (c.tls.mode, c.get_ssl_mode()),
            (SslMode::Allow, Pg::Disable)
        );
        // A Unix-domain socket never uses TLS (libpq ignores sslmode there).
        let c = parse_database_url("host=/tmp user=u sslmode=require").unwrap();
        assert_eq!(c.get_ssl_mode(), Pg::Disable);
        // require with a root certificate verifies the chain, as libpq does.
        let c =
            parse_database_url("postgres://u@h/db?sslmode=require&sslrootcert=/ca.pem").unwrap();
        assert!(c.tls.verifies_chain());
        assert!(!parse_database_url("postgres://u@h/db?sslmode=require")
            .unwrap()
            .tls
            .verifies_chain());
        let c =
            parse_database_url("postgres://u@h/db?sslmode=verify-full&sslrootcert=system").unwrap();
        assert_eq!(c.tls.root_cert, Some(RootCert::System));
    }

    #[test]
    fn refuses_bad_or_unsupported_tls_parameters_naming_them() {
        for (url, want) in [
            (
                "postgres://u:secret@h/db?sslmode=verify_full",
                "sslmode=verify_full is not an sslmode; use disable, allow, prefer",
            ),
            ("host=h user=u sslmode=on", "sslmode=on is not an sslmode"),
            (
                "postgres://u@h/db?channel_binding=always",
                "channel_binding=always is not a channel_binding mode",
            ),
            (
                "postgres://u@h/db?sslmode=verify-full",
                "needs sslrootcert=",
            ),
            (
                "postgres://u@h/db?sslmode=verify-ca",
                "does not read libpq's default ~/.postgresql/root.crt",
            ),
            (
                "postgres://u@h/db?sslmode=require&sslrootcert=system",
                "sslrootcert=system needs sslmode=verify-full",
            ),
            (
                "postgres://u@h/db?sslmode=require&sslcert=/c.pem",
                "sslcert= needs sslkey=",
            ),
            (
                "postgres://u@h/db?sslmode=require&sslkey=/k.pem",
                "sslkey= needs sslcert=",
            ),
            ("postgres://u@h/db?sslrootcert=", "sslrootcert= is empty"),
            (
                "postgres://u@h/db?sslcrl=/crl.pem",
                "sslcrl= is not supported by pgoutbox",
            ),
            (
                "postgres://u@h/db?sslnegotiation=direct",
                "sslnegotiation=direct is not supported",
            ),
            (
                "host=h user=u sslfoo=1",
                "sslfoo= is not a TLS setting pgoutbox knows",
            ),
            (
                "postgres://u@h/db?sslmode=disable&channel_binding=require",
                "channel_binding=require needs TLS",
            ),
            (
                "host=h user=u sslrootcert='/unterminated",
                "unterminated quote",
            ),
        ] {
            let e = parse_database_url(url).unwrap_err();
            assert_eq!(e.setting, "--database-url");
            let text = e.to_string();
            assert!(text.contains(want), "{url}: {text}");
            assert!(!text.contains("secret"), "{text}");
        }
        // Other parameters are left exactly as written for tokio-postgres' parser.
        let (rest, _) =
            split_tls_parameters("host=h  sslmode=require user='a b' sslrootcert=/x").unwrap();
        assert_eq!(rest, "host=h   user='a b' ");
        let (rest, _) =
            split_tls_parameters("postgres://u@h/db?sslmode=require&application_name=x%20y")
                .unwrap();
        assert_eq!(rest, "postgres://u@h/db?application_name=x%20y");
    }

    /// A valid configuration with the defaults the CLI gives.
    #[test]
    fn cloudevents_source_is_validated() {
        let with = |source: &str| RunConfig {
            cloudevents: Some(crate::cloudevents::Binding {
                source: source.into(),
                prefix: crate::cloudevents::Prefix::Colon,
            }),
            ..base()
        };
        assert_eq!(with("pgoutbox:///db/pgoutbox").validate(), Ok(()));
        let e = with("my source").validate().unwrap_err();
        assert_eq!(e.setting, "--cloudevents-source");
        let text = e.to_string();
        assert!(
            text.starts_with(
                "invalid setting --cloudevents-source (PGOUTBOX_CLOUDEVENTS_SOURCE) = \"my source\": not a URI-reference"
            ) && text.contains("pgoutbox:///DATABASE/SLOT"),
            "{text}"
        );
    }

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
        let mut c = base();
        c.retention.interval = Duration::from_millis(500);
        let e = c.validate().unwrap_err();
        assert_eq!(e.setting, "--maintenance-interval");
        c.retention.interval = Duration::from_secs(1);
        c.validate().unwrap();
    }

    fn base() -> RunConfig {
        let config = RunConfig {
            database_url: "postgres://u@h/db".into(),
            amqp_urls: vec!["amqp://g:g@h/%2f".into()],
            amqp_url_order: AmqpUrlOrder::InOrder,
            slot: DEFAULT_SLOT.into(),
            schema: crate::outbox_schema::SchemaName::default(),
            prefix: None,
            publication: DEFAULT_PUBLICATION.into(),
            exchange: DEFAULT_EXCHANGE.into(),
            allowed_exchanges: AllowedExchanges::Any,
            exchange_declare: ExchangeDeclare::DurableTopic,
            max_in_flight: DEFAULT_MAX_IN_FLIGHT,
            max_in_flight_bytes: DEFAULT_MAX_IN_FLIGHT_BYTES,
            slot_busy_timeout: None,
            standby_poll: DEFAULT_STANDBY_POLL,
            on_unroutable: UnroutablePolicy::DeadLetter,
            publish_properties: PublishProperties::Full,
            max_attempts: DEFAULT_MAX_ATTEMPTS,
            max_message_bytes: DEFAULT_MAX_MESSAGE_BYTES,
            broker_max_message_bytes: None,
            failpoint: None,
            shutdown_timeout: DEFAULT_SHUTDOWN_TIMEOUT,
            postgres_loss_drain: DEFAULT_POSTGRES_LOSS_DRAIN,
            read_coalesce: DEFAULT_READ_COALESCE,
            instance_id: "test".into(),
            http_addr: None,
            stall_after: DEFAULT_STALL_AFTER,
            accept_gap: false,
            cloudevents: None,
            journal: JournalMode::Off,
            retention: RetentionSettings::default(),
        };
        config.validate().unwrap();
        config
    }

    #[test]
    fn http_addr_and_stall_after_are_validated() {
        assert_eq!(parse_http_addr("off"), Ok(None));
        assert_eq!(
            parse_http_addr("127.0.0.1:8432").unwrap().map(|a| a.port()),
            Some(8432)
        );
        let e = parse_http_addr("nonsense").unwrap_err();
        assert_eq!(e.setting, "--http-addr");
        assert!(e.to_string().contains("or off"), "{e}");
        for bad in [0, 3601] {
            let config = RunConfig {
                stall_after: Duration::from_secs(bad),
                ..base()
            };
            let e = config.validate().unwrap_err();
            assert_eq!(e.setting, "--stall-after-s", "{e}");
        }
    }

    #[test]
    fn malformed_broker_urls_are_refused_without_their_password() {
        for (url, why) in [
            ("amqp://g:secret@h:99999999/%2f", "invalid port number"),
            ("amqp://g:secret@h/%2f?heartbeat=é", "invalid digit"),
            ("amqp://g:secret@h/%2f?channel_max=70000", "too large"),
            ("amqp://g:secret@[::1/%2f", "invalid IPv6"),
        ] {
            let mut c = base();
            c.amqp_urls = vec![url.into()];
            let e = c.validate().unwrap_err();
            assert_eq!(e.setting, "--amqp-url", "{url}");
            let text = e.to_string();
            assert!(
                text.contains(why)
                    && text.contains("expected amqp://user:password@host:port/vhost"),
                "{url}: {text}"
            );
            assert!(!text.contains("secret"), "{text}");
        }
    }

    #[test]
    fn amqp_url_lists_split_on_commas_before_a_scheme_only() {
        let one = |v: &str| split_amqp_urls(&[v]);
        assert_eq!(one("amqp://a"), ["amqp://a"]);
        assert_eq!(
            one("amqp://a:1/%2f,amqps://b:2/%2f, amqp://c:3/%2f"),
            ["amqp://a:1/%2f", "amqps://b:2/%2f", "amqp://c:3/%2f"]
        );
        // A comma inside a password or a query stays in its URL.
        assert_eq!(
            one("amqp://u:p,w@a/%2f?heartbeat=5,amqp://u:x@b/%2f"),
            ["amqp://u:p,w@a/%2f?heartbeat=5", "amqp://u:x@b/%2f"]
        );
        // Repeated flags and lists mix; empty pieces are dropped.
        assert_eq!(
            split_amqp_urls(&["amqp://a,", " ", "amqp://b,amqp://c"]),
            ["amqp://a", "amqp://b", "amqp://c"]
        );
        assert!(split_amqp_urls::<&str>(&[]).is_empty());
        // Something that is not a URL is kept as one piece, so validation names it.
        assert_eq!(one("rabbit1,rabbit2"), ["rabbit1,rabbit2"]);
    }

    #[test]
    fn amqp_url_order_keeps_or_shuffles_every_node() {
        let urls: Vec<String> = (1..=5).map(|i| format!("amqp://n{i}")).collect();
        assert_eq!(order_amqp_urls(&urls, AmqpUrlOrder::InOrder, 7), urls);
        let shuffled = order_amqp_urls(&urls, AmqpUrlOrder::Shuffle, 7);
        assert_eq!(shuffled, order_amqp_urls(&urls, AmqpUrlOrder::Shuffle, 7));
        let mut sorted = shuffled.clone();
        sorted.sort();
        assert_eq!(sorted, urls, "a shuffle keeps every node once");
        // Over a few seeds every node comes first at least once.
        let firsts: std::collections::HashSet<String> = (0..64)
            .map(|seed| order_amqp_urls(&urls, AmqpUrlOrder::Shuffle, seed)[0].clone())
            .collect();
        assert_eq!(firsts.len(), urls.len());
    }

    #[test]
    fn every_amqp_url_is_validated_and_named() {
        let mut c = base();
        c.amqp_urls = vec![];
        let e = c.validate().unwrap_err();
        assert_eq!(e.setting, "--amqp-url");
        assert!(e.to_string().contains("at least one"), "{e}");
        c.amqp_urls = vec![
            "amqp://g:g@a/%2f".into(),
            "amqp://g:secret@b:99999999/%2f".into(),
        ];
        let e = c.validate().unwrap_err().to_string();
        assert!(
            e.contains("URL 2 of 2") && e.contains("invalid port number") && !e.contains("secret"),
            "{e}"
        );
        c.amqp_urls = vec!["amqp://g:g@a/%2f".into(), "http://b".into()];
        let e = c.validate().unwrap_err().to_string();
        assert!(
            e.contains("URL 2 of 2") && e.contains("expected amqp://"),
            "{e}"
        );
        c.amqp_urls = vec!["amqp://g:g@a/%2f".into(), "amqps://g:g@b/%2f".into()];
        assert!(c.validate().is_ok());
    }

    #[test]
    fn every_numeric_and_duration_setting_has_bounds() {
        type Set = fn(&mut RunConfig, u64);
        // (setting, how to set it, lowest accepted, highest accepted)
        let cases: [(&str, Set, u64, u64); 10] = [
            (
                "--max-in-flight",
                |c, v| c.max_in_flight = v as usize,
                1,
                1_000_000,
            ),
            (
                "--max-in-flight-bytes",
                |c, v| c.max_in_flight_bytes = v as usize,
                1,
                1 << 32,
            ),
            (
                "--max-message-bytes",
                |c, v| c.max_message_bytes = v as usize,
                1,
                512 << 20,
            ),
            (
                "--broker-max-message-bytes",
                |c, v| c.broker_max_message_bytes = Some(v as usize),
                1,
                512 << 20,
            ),
            ("--max-attempts", |c, v| c.max_attempts = v as u32, 1, 1_000),
            (
                "--slot-busy-timeout-s",
                |c, v| c.slot_busy_timeout = Some(Duration::from_secs(v)),
                0,
                30 * 86_400,
            ),
            (
                "--standby-poll-ms",
                |c, v| c.standby_poll = Duration::from_millis(v),
                10,
                60_000,
            ),
            (
                "--shutdown-timeout-s",
                |c, v| c.shutdown_timeout = Duration::from_secs(v),
                0,
                86_400,
            ),
            (
                "--postgres-loss-drain-ms",
                |c, v| c.postgres_loss_drain = Duration::from_millis(v),
                0,
                600_000,
            ),
            (
                "--read-coalesce-us",
                |c, v| c.read_coalesce = Duration::from_micros(v),
                0,
                100_000,
            ),
        ];
        for (setting, set, low, high) in cases {
            for ok in [low, high] {
                let mut c = base();
                set(&mut c, ok);
                assert_eq!(c.validate(), Ok(()), "{setting} = {ok}");
            }
            let mut bad = vec![high + 1];
            if low > 0 {
                bad.push(low - 1);
            }
            // The inputs that used to panic or wrap: u64::MAX seconds overflows `Instant`.
            if setting != "--max-attempts" {
                bad.push(u64::MAX);
            }
            for value in bad {
                let mut c = base();
                set(&mut c, value);
                let e = c.validate().unwrap_err();
                assert_eq!(e.setting, setting, "{value}");
                assert_eq!(e.value, value.to_string());
                let env = env_of(setting).unwrap();
                assert!(
                    e.to_string().starts_with(&format!(
                        "invalid setting {setting} ({env}) = \"{value}\": must be"
                    )) && e.to_string().contains(&high.to_string()),
                    "{e}"
                );
            }
        }
        // 0 seconds of slot-busy timeout means "wait forever", not an out-of-range value.
        let mut c = base();
        c.slot_busy_timeout = None;
        assert_eq!(c.validate(), Ok(()));
    }
}
