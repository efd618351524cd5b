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
/// Publish attempts for a nacked message before it is dead-lettered.
pub const DEFAULT_MAX_ATTEMPTS: u32 = 5;
/// Payloads above this are dead-lettered as `too_large` (RabbitMQ's own limit is 128 MiB by
/// default; 16 MiB keeps one message within the default byte window).
pub const DEFAULT_MAX_MESSAGE_BYTES: usize = 16 * 1024 * 1024;

/// Default `--read-coalesce-us`: 1 ms between small reads of the replication socket.
pub const DEFAULT_READ_COALESCE: Duration = Duration::from_millis(1);

/// Largest accepted `--read-coalesce-us`: 100 ms.
pub const MAX_READ_COALESCE: Duration = Duration::from_millis(100);

/// Default `--stall-after-s`: unconfirmed messages with no settle for a minute are a stall
/// (a confirm round trip is milliseconds; a minute rules out a slow disk or a GC pause).
pub const DEFAULT_STALL_AFTER: Duration = Duration::from_secs(60);
/// Largest accepted `--stall-after-s`: one hour (a stall detected later is no alarm).
pub const MAX_STALL_AFTER: Duration = Duration::from_secs(3600);

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

/// How long a SIGINT/SIGTERM waits for outstanding publisher confirms.
pub const DEFAULT_SHUTDOWN_TIMEOUT: Duration = Duration::from_secs(30);
/// The logical decoding message prefix of our envelopes.
pub const MESSAGE_PREFIX: &str = "pgoutbox";

/// The environment variable that also sets a `--flag`: `PGOUTBOX_` and the flag in upper
/// case with `-` as `_` (the rule every option of the CLI follows).
pub fn env_of(flag: &str) -> Option<String> {
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

/// Replaces the password in a URL with `***` for logs and `Debug`.
pub fn redact_url(url: &str) -> String {
    match url::Url::parse(url) {
        Ok(mut u) if u.password().is_some() => {
            let _ = u.set_password(Some("***"));
            u.to_string()
        }
        Ok(u) => u.to_string(),
        Err(_) if url.contains("password") => "<redacted connection string>".into(),
        Err(_) => url.to_owned(),
    }
}

/// Parses a Postgres connection string (URL or key=value) with tokio-postgres' parser,
/// refusing TLS modes first.
///
/// # Errors
/// [`ValidationError`] for `--database-url` when it does not parse or asks for TLS.
pub fn parse_database_url(url: &str) -> Result<tokio_postgres::Config, ValidationError> {
    crate::replication::connect::refuse_tls(url).map_err(|e| ValidationError {
        setting: "--database-url",
        value: redact_url(url),
        rule: e.to_string(),
    })?;
    let config: tokio_postgres::Config = url.parse().map_err(|e| ValidationError {
        setting: "--database-url",
        value: redact_url(url),
        rule: format!("not a PostgreSQL connection string ({e}); expected postgres://user:password@host:port/dbname"),
    })?;
    if config.get_ssl_mode() == tokio_postgres::config::SslMode::Require {
        return Err(ValidationError {
            setting: "--database-url",
            value: redact_url(url),
            rule: "sslmode=require asks for TLS, which is not supported yet".into(),
        });
    }
    if config.get_user().is_none() {
        return Err(ValidationError {
            setting: "--database-url",
            value: redact_url(url),
            rule: "no user given; write postgres://USER@host/dbname".into(),
        });
    }
    Ok(config)
}

/// Settings of `pgoutbox run`.
#[derive(Clone)]
pub struct RunConfig {
    /// Postgres connection string (its database holds the slot).
    pub database_url: String,
    /// `amqp://` URL of the broker.
    pub amqp_url: String,
    /// Logical replication slot (pgoutput).
    pub slot: String,
    /// Publication named in `publication_names`.
    pub publication: String,
    /// Durable topic exchange messages are published to.
    pub exchange: String,
    /// In-flight window in messages (sent, not yet confirmed).
    pub max_in_flight: usize,
    /// In-flight window in payload bytes.
    pub max_in_flight_bytes: usize,
    /// How long to keep retrying a slot held by another process (`None`: forever).
    pub slot_busy_timeout: Option<Duration>,
    /// What to do with returned (unroutable) messages.
    pub on_unroutable: UnroutablePolicy,
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
    /// Minimum time between two reads of the replication socket when the previous read was
    /// small (ms-scale; zero reads as soon as bytes arrive). Bytes arriving on an idle stream
    /// are read at once; under a steady trickle of small transactions they are read at most
    /// once per interval, so one wake-up, one publish batch and one confirm batch cover
    /// many transactions. Reads of 64 KiB or more (a backlog, big messages) are never delayed.
    pub read_coalesce: Duration,
    /// Identifies this process in `application_name` and the RabbitMQ connection name.
    pub instance_id: String,
    /// Where `/metrics`, `/healthz` and `/readyz` are served (`None`: off).
    pub http_addr: Option<std::net::SocketAddr>,
    /// Unconfirmed messages with no settle for this long are a stall (`/readyz` 503, the
    /// `pgoutbox_stalled` gauge, a warning a minute).
    pub stall_after: Duration,
}

impl std::fmt::Debug for RunConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RunConfig")
            .field("database_url", &redact_url(&self.database_url))
            .field("amqp_url", &redact_url(&self.amqp_url))
            .field("slot", &self.slot)
            .field("publication", &self.publication)
            .field("exchange", &self.exchange)
            .field("max_in_flight", &self.max_in_flight)
            .field("max_in_flight_bytes", &self.max_in_flight_bytes)
            .field("slot_busy_timeout", &self.slot_busy_timeout)
            .field("shutdown_timeout", &self.shutdown_timeout)
            .field("read_coalesce", &self.read_coalesce)
            .field("on_unroutable", &self.on_unroutable)
            .field("max_attempts", &self.max_attempts)
            .field("max_message_bytes", &self.max_message_bytes)
            .field("broker_max_message_bytes", &self.broker_max_message_bytes)
            .field("instance_id", &self.instance_id)
            .field("http_addr", &self.http_addr)
            .field("stall_after", &self.stall_after)
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
        if !(self.amqp_url.starts_with("amqp://") || self.amqp_url.starts_with("amqps://")) {
            return Err(ValidationError {
                setting: "--amqp-url",
                value: redact_url(&self.amqp_url),
                rule: "expected amqp://user:password@host:port/vhost".into(),
            });
        }
        if self.amqp_url.starts_with("amqps://") {
            return Err(ValidationError {
                setting: "--amqp-url",
                value: redact_url(&self.amqp_url),
                rule: "amqps:// asks for TLS, which is not supported yet".into(),
            });
        }
        validate_identifier("--slot", &self.slot)?;
        validate_identifier("--publication", &self.publication)?;
        if self.exchange.is_empty() || self.exchange.len() > 255 {
            return Err(ValidationError {
                setting: "--exchange",
                value: self.exchange.clone(),
                rule: "use 1 to 255 bytes (the default exchange \"\" cannot be declared)".into(),
            });
        }
        if self.max_in_flight == 0 {
            return Err(ValidationError {
                setting: "--max-in-flight",
                value: "0".into(),
                rule: "must be at least 1".into(),
            });
        }
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
        if self.max_attempts == 0 {
            return Err(ValidationError {
                setting: "--max-attempts",
                value: "0".into(),
                rule: "must be at least 1".into(),
            });
        }
        if self.stall_after.is_zero() || self.stall_after > MAX_STALL_AFTER {
            return Err(ValidationError {
                setting: "--stall-after-s",
                value: self.stall_after.as_secs().to_string(),
                rule: format!(
                    "must be between 1 and {} seconds",
                    MAX_STALL_AFTER.as_secs()
                ),
            });
        }
        if self.max_in_flight_bytes == 0 {
            return Err(ValidationError {
                setting: "--max-in-flight-bytes",
                value: "0".into(),
                rule: "must be at least 1".into(),
            });
        }
        Ok(())
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

    #[test]
    fn validation_errors_name_the_flag_and_its_environment_variable() {
        // The rule env_of relies on holds for every option of every subcommand.
        use clap::CommandFactory;
        let cli = crate::cli::Cli::command();
        let mut checked = 0;
        let mut stack: Vec<&clap::Command> = vec![&cli];
        while let Some(cmd) = stack.pop() {
            stack.extend(cmd.get_subcommands());
            for arg in cmd.get_arguments() {
                if let (Some(long), Some(env)) = (arg.get_long(), arg.get_env()) {
                    assert_eq!(
                        env_of(&format!("--{long}")).as_deref(),
                        env.to_str(),
                        "--{long}"
                    );
                    checked += 1;
                }
            }
        }
        assert!(checked >= 15, "checked {checked} options");
        let e = ValidationError {
            setting: "--read-coalesce-us",
            value: "200000".into(),
            rule: "must be at most 100000".into(),
        };
        assert_eq!(
            e.to_string(),
            "invalid setting --read-coalesce-us (PGOUTBOX_READ_COALESCE_US) = \"200000\": must be at most 100000"
        );
    }

    #[test]
    fn http_addr_and_stall_after_are_validated() {
        use clap::Parser;
        assert_eq!(parse_http_addr("off"), Ok(None));
        assert_eq!(
            parse_http_addr("127.0.0.1:8432").unwrap().map(|a| a.port()),
            Some(8432)
        );
        let e = parse_http_addr("nonsense").unwrap_err();
        assert_eq!(e.setting, "--http-addr");
        assert!(e.to_string().contains("or off"), "{e}");
        let config = |stall: &str| {
            let cli = crate::cli::Cli::try_parse_from([
                "pgoutbox",
                "run",
                "--database-url",
                "postgres://u@h/db",
                "--amqp-url",
                "amqp://h",
                "--stall-after-s",
                stall,
            ])
            .unwrap();
            match cli.command {
                crate::cli::Command::Run(args) => args.into_config(),
                _ => unreachable!(),
            }
        };
        let ok = config("60");
        assert!(ok.validate().is_ok());
        assert_eq!(
            ok.http_addr.map(|a| a.to_string()).as_deref(),
            Some(crate::metrics::DEFAULT_HTTP_ADDR)
        );
        for bad in ["0", "3601"] {
            let e = config(bad).validate().unwrap_err();
            assert_eq!(e.setting, "--stall-after-s", "{e}");
        }
    }

    #[test]
    fn redacts_passwords() {
        assert_eq!(
            redact_url("postgres://u:secret@h:5/db"),
            "postgres://u:***@h:5/db"
        );
        assert!(!redact_url("amqp://guest:guest@h/%2f").contains("guest@"));
    }

    #[test]
    fn refuses_tls_modes() {
        for url in [
            "postgres://u@h/db?sslmode=require",
            "postgres://u@h/db?sslmode=verify-full",
            "host=h user=u sslmode=verify-ca",
        ] {
            let e = parse_database_url(url).unwrap_err();
            assert!(e.to_string().contains("TLS"), "{e}");
        }
        assert!(parse_database_url("postgres://u@h/db?sslmode=disable").is_ok());
    }
}
