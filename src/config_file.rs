//! `--config FILE` (env `PGOUTBOX_CONFIG`): a TOML file of flat keys named like the long
//! flags of `run` with `_` for `-` (`database_url`, `slot`, `max_in_flight`, ...).
//!
//! Precedence is flag > environment variable > file > built-in default. The file is read
//! into [`FileSettings`] (serde, every key optional, unknown keys refused), then, for each
//! key the command line and the environment left alone (clap's
//! [`ArgMatches::value_source`]), its value replaces the default in [`RunArgs`]. The
//! result goes through the same `RunConfig::validate` as flags and variables.
//!
//! This lives beside the CLI, not in `config.rs`: the merge needs clap's record of where
//! each value came from, and `config.rs` stays free of clap.

use std::path::{Path, PathBuf};

use clap::parser::ValueSource;
use clap::{ArgMatches, CommandFactory, FromArgMatches};
use serde::Deserialize;

use crate::cli::{AmqpUrlOrderArg, Cli, Command, OnUnroutable, PublishPropertiesArg, RunArgs};
use crate::secrets::Secret;

/// The keys a config file may hold, each an optional value of its flag's type.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileSettings {
    /// `--database-url`.
    pub database_url: Option<Secret>,
    /// `--database-url-file`.
    pub database_url_file: Option<PathBuf>,
    /// `--database-password-file`.
    pub database_password_file: Option<PathBuf>,
    /// `--amqp-url-file`.
    pub amqp_url_file: Option<PathBuf>,
    /// `--amqp-password-file`.
    pub amqp_password_file: Option<PathBuf>,
    /// `--amqp-ca-file`.
    pub amqp_ca_file: Option<PathBuf>,
    /// `--amqp-cert-file`.
    pub amqp_cert_file: Option<PathBuf>,
    /// `--amqp-key-file`.
    pub amqp_key_file: Option<PathBuf>,
    /// `--slot`.
    pub slot: Option<String>,
    /// `--schema`.
    pub schema: Option<String>,
    /// `--prefix`.
    pub prefix: Option<String>,
    /// `--amqp-url`: one URL (which may be a comma-separated list) or an array of them,
    /// one per node of a cluster.
    pub amqp_url: Option<OneOrMany>,
    /// `--amqp-url-order` (`in-order` or `shuffle`).
    pub amqp_url_order: Option<AmqpUrlOrderArg>,
    /// `--publication`.
    pub publication: Option<String>,
    /// `--exchange`.
    pub exchange: Option<String>,
    /// `--allowed-exchanges`: one comma-separated string, or an array of names.
    pub allowed_exchanges: Option<NamesOrList>,
    /// `--no-declare`.
    pub no_declare: Option<bool>,
    /// `--max-in-flight` (messages).
    pub max_in_flight: Option<usize>,
    /// `--max-in-flight-bytes`.
    pub max_in_flight_bytes: Option<usize>,
    /// `--slot-busy-timeout-s` (seconds).
    pub slot_busy_timeout_s: Option<u64>,
    /// `--standby-poll-ms` (milliseconds).
    pub standby_poll_ms: Option<u64>,
    /// `--shutdown-timeout-s` (seconds).
    pub shutdown_timeout_s: Option<u64>,
    /// `--instance-id`.
    pub instance_id: Option<String>,
    /// `--on-unroutable` (`dead-letter` or `block`).
    pub on_unroutable: Option<OnUnroutable>,
    /// `--publish-properties` (`full` or `minimal`).
    pub publish_properties: Option<PublishPropertiesArg>,
    /// `--max-attempts`.
    pub max_attempts: Option<u32>,
    /// `--max-message-bytes`.
    pub max_message_bytes: Option<usize>,
    /// `--read-coalesce-us` (microseconds).
    pub read_coalesce_us: Option<u64>,
    /// `--broker-max-message-bytes`.
    pub broker_max_message_bytes: Option<usize>,
    /// `--http-addr` (`HOST:PORT` or `off`).
    pub http_addr: Option<String>,
    /// `--stall-after-s` (seconds).
    pub stall_after_s: Option<u64>,
    /// `--postgres-loss-drain-ms` (milliseconds).
    pub postgres_loss_drain_ms: Option<u64>,
    /// `--cloudevents`.
    pub cloudevents: Option<bool>,
    /// `--cloudevents-source`.
    pub cloudevents_source: Option<String>,
    /// `--cloudevents-prefix` (`cloudEvents_` or `cloudEvents:`).
    pub cloudevents_prefix: Option<crate::cloudevents::Prefix>,
    /// `--journal`.
    pub journal: Option<bool>,
    /// `--journal-retention` (`"7d"`, `"12h"`, `"0"`).
    pub journal_retention: Option<crate::config::Retention>,
    /// `--idempotency-retention` (`"7d"`, `"12h"`, `"0"`).
    pub idempotency_retention: Option<crate::config::Retention>,
    /// `--maintenance-interval` (`"5m"`).
    pub maintenance_interval: Option<String>,
}

/// A comma-separated string, or an array of strings (`allowed_exchanges = ["a", "b"]`).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(untagged)]
pub enum NamesOrList {
    /// `"a,b"`.
    Text(String),
    /// `["a", "b"]`.
    List(Vec<String>),
}

impl NamesOrList {
    fn into_text(self) -> Option<String> {
        Some(match self {
            NamesOrList::Text(s) => s,
            NamesOrList::List(v) => v.join(","),
        })
    }
}

/// A string, or an array of strings (`amqp_url = ["amqp://a", "amqp://b"]`).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(untagged)]
pub enum OneOrMany {
    /// One string.
    One(Secret),
    /// An array of strings.
    Many(Vec<Secret>),
}

impl OneOrMany {
    fn into_vec(self) -> Vec<Secret> {
        match self {
            OneOrMany::One(s) => vec![s],
            OneOrMany::Many(v) => v,
        }
    }
}

/// The file keys with the form of their values, for error messages. Must list every field
/// of [`FileSettings`] (a unit test checks it against the `run` flags).
const KEYS: &[(&str, &str)] = &[
    (
        "database_url",
        "a string, postgres://user:password@host:port/db",
    ),
    (
        "database_url_file",
        "a string, the path of a file holding database_url",
    ),
    (
        "database_password_file",
        "a string, the path of a file holding the database password",
    ),
    (
        "amqp_url_file",
        "a string, the path of a file holding amqp_url",
    ),
    (
        "amqp_password_file",
        "a string, the path of a file holding the RabbitMQ password",
    ),
    ("amqp_ca_file", "a string, the path of a PEM file"),
    ("amqp_cert_file", "a string, the path of a PEM file"),
    ("amqp_key_file", "a string, the path of a PEM file"),
    ("slot", "a string of a-z, 0-9 and _"),
    ("schema", "a string of a-z, 0-9 and _"),
    ("prefix", "a string of A-Z, a-z, 0-9, '.', '_', ':' and '-'"),
    (
        "amqp_url",
        "a string, amqp://user:password@host:port/vhost, or an array of them (one per node)",
    ),
    ("amqp_url_order", "\"in-order\" or \"shuffle\""),
    ("publication", "a string of a-z, 0-9 and _"),
    ("exchange", "a string"),
    (
        "allowed_exchanges",
        "a string of exchange names separated by commas, or an array of names",
    ),
    ("no_declare", "true or false"),
    ("max_in_flight", "a whole number of messages, 1 to 1000000"),
    (
        "max_in_flight_bytes",
        "a whole number of bytes, 1 to 4294967296",
    ),
    (
        "slot_busy_timeout_s",
        "a whole number of seconds, 0 to 2592000",
    ),
    (
        "standby_poll_ms",
        "a whole number of milliseconds, 10 to 60000",
    ),
    (
        "shutdown_timeout_s",
        "a whole number of seconds, 0 to 86400",
    ),
    ("instance_id", "a string"),
    ("on_unroutable", "\"dead-letter\" or \"block\""),
    ("publish_properties", "\"full\" or \"minimal\""),
    ("max_attempts", "a whole number, 1 to 1000"),
    (
        "max_message_bytes",
        "a whole number of bytes, 1 to 536870912",
    ),
    (
        "read_coalesce_us",
        "a whole number of microseconds, 0 to 100000",
    ),
    (
        "broker_max_message_bytes",
        "a whole number of bytes, 1 to 536870912",
    ),
    ("http_addr", "a string, HOST:PORT or \"off\""),
    ("stall_after_s", "a whole number of seconds, 1 to 3600"),
    (
        "postgres_loss_drain_ms",
        "a whole number of milliseconds, 0 to 600000",
    ),
    ("cloudevents", "true or false"),
    (
        "cloudevents_source",
        "a string, a URI-reference of at most 255 bytes",
    ),
    ("cloudevents_prefix", "\"cloudEvents_\" or \"cloudEvents:\""),
    ("journal", "true or false"),
    (
        "journal_retention",
        "a string, a duration such as \"7d\", \"12h\", \"30m\", or \"0\" (keep every row)",
    ),
    (
        "idempotency_retention",
        "a string, a duration such as \"7d\", \"12h\", \"30m\", or \"0\" (keep every key)",
    ),
    (
        "maintenance_interval",
        "a string, a duration from \"1s\" to \"1d\", such as \"5m\"",
    ),
];

/// A config file that cannot be used. Displays as one line naming the file, the key (when
/// one is at fault) and the fix.
#[derive(Debug, thiserror::Error)]
pub enum ConfigFileError {
    /// The file could not be read.
    #[error("cannot read config file {path} (--config, PGOUTBOX_CONFIG): {source}; fix the path or the file's permissions")]
    Read {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The file is not valid TOML, has an unknown key, or a value of the wrong type.
    #[error("config file {path}: {what}; fix: {fix}")]
    Invalid {
        /// The file.
        path: PathBuf,
        /// What is wrong, naming the key when there is one.
        what: String,
        /// What to write instead.
        fix: String,
    },
    /// A setting required by `run` is in none of the flag, the variable and the file.
    #[error("missing {flag} <{}>: pass it, set {env}, name a file holding it with {flag}-file ({env}_FILE), or set {key} in a --config file", key.to_uppercase())]
    Missing {
        /// The flag, e.g. `--database-url`.
        flag: &'static str,
        /// Its environment variable.
        env: &'static str,
        /// Its file key.
        key: &'static str,
    },
}

/// Why the command line could not be read: clap refused it (including `--help` and
/// `--version`, which clap reports as errors to display), or the config file is unusable.
#[derive(Debug)]
pub enum CliError {
    /// clap's error, to be shown (and exited with) by the binary.
    Usage(clap::Error),
    /// The `--config` file.
    File(ConfigFileError),
}

impl From<ConfigFileError> for CliError {
    fn from(e: ConfigFileError) -> Self {
        CliError::File(e)
    }
}

/// Reads and type-checks a config file.
///
/// # Errors
/// [`ConfigFileError::Read`], or [`ConfigFileError::Invalid`] naming the key (an unknown
/// one, or one whose value has the wrong type) and its expected form.
pub fn load(path: &Path) -> Result<FileSettings, ConfigFileError> {
    let text = std::fs::read_to_string(path).map_err(|source| ConfigFileError::Read {
        path: path.to_owned(),
        source,
    })?;
    parse(path, &text)
}

fn parse(path: &Path, text: &str) -> Result<FileSettings, ConfigFileError> {
    toml::from_str(text).map_err(|e| {
        let line_no = e
            .span()
            .map(|s| text[..s.start.min(text.len())].matches('\n').count() + 1);
        // The key on the offending line (keys are flat, so `key = value`).
        let key = line_no
            .and_then(|n| text.lines().nth(n - 1))
            .and_then(|line| line.split_once('='))
            .map(|(k, _)| k.trim().trim_matches('"').to_owned())
            .filter(|k| !k.is_empty());
        let message = e.message().trim().to_owned();
        let at = line_no.map(|n| format!(" (line {n})")).unwrap_or_default();
        let known = KEYS.iter().map(|(k, _)| *k).collect::<Vec<_>>().join(", ");
        match key {
            Some(key) if message.starts_with("unknown field") => ConfigFileError::Invalid {
                path: path.to_owned(),
                what: format!("unknown key {key:?}{at}"),
                fix: format!("remove it or correct its spelling; the keys are the long flags of `run` with _ for -: {known}"),
            },
            Some(key) => {
                let form = KEYS.iter().find(|(k, _)| *k == key).map(|(_, f)| *f);
                ConfigFileError::Invalid {
                    path: path.to_owned(),
                    what: format!("key {key:?}{at}: {message}"),
                    fix: match form {
                        Some(form) => format!("write {key} = {form}"),
                        None => format!("the keys are: {known}"),
                    },
                }
            }
            None => ConfigFileError::Invalid {
                path: path.to_owned(),
                what: format!("not valid TOML{at}: {message}"),
                fix: "write flat `key = value` lines (https://toml.io)".into(),
            },
        }
    })
}

/// Where the file named by `--config` came into the settings: the file and the keys whose
/// values it supplied.
#[derive(Debug, Clone)]
pub struct FileOrigin {
    /// The file.
    pub path: PathBuf,
    /// Keys whose value was taken from it (not overridden by a flag or variable).
    pub keys: Vec<&'static str>,
}

impl FileOrigin {
    /// For a validation error of `setting` (e.g. `--max-in-flight`): a note naming the
    /// file and key, when the bad value came from the file.
    pub fn note_for(&self, setting: &str) -> Option<String> {
        let key = setting.strip_prefix("--")?.replace('-', "_");
        self.keys.iter().find(|k| **k == key).map(|k| {
            format!(
                "the value comes from {k} in config file {}: fix it there",
                self.path.display()
            )
        })
    }
}

/// Parses the command line like `Cli::parse` (a clap error is returned, not exited on), then, for `run`
/// and `check`, merges the config file, if one is named.
///
/// # Errors
/// [`CliError::Usage`] for what clap refuses; [`CliError::File`] for an unreadable or
/// invalid file, or a required URL found nowhere.
pub fn parse_cli() -> Result<(Cli, Option<FileOrigin>), CliError> {
    // The URLs are required, but may come from a file or the config file: clap does not
    // insist on them (they are optional there), `merge` and `secrets::resolve` do.
    let matches = Cli::command().try_get_matches().map_err(CliError::Usage)?;
    let mut cli = Cli::from_arg_matches(&matches).map_err(CliError::Usage)?;
    let origin = match &mut cli.command {
        Command::Run(args) => {
            let m = matches.subcommand_matches("run");
            args.passwords_on_argv = passwords_on_argv(args, m);
            merge(args, m)?
        }
        Command::Check(args) => merge(args, matches.subcommand_matches("check"))?,
        _ => None,
    };
    Ok((cli, origin))
}

/// The URL flags of `run` given on the command line (not by a variable or a file) with a
/// password in them: the process list shows it to every user of the machine.
fn passwords_on_argv(args: &RunArgs, matches: Option<&ArgMatches>) -> Vec<&'static str> {
    let on_argv =
        |id: &str| matches.and_then(|m| m.value_source(id)) == Some(ValueSource::CommandLine);
    let mut flags = Vec::new();
    if on_argv("database_url")
        && args
            .db
            .url
            .database_url
            .as_ref()
            .is_some_and(|u| crate::secrets::has_password(&u.0))
    {
        flags.push("--database-url");
    }
    if on_argv("amqp_url")
        && args
            .amqp_url
            .iter()
            .any(|u| crate::secrets::has_password(&u.0))
    {
        flags.push("--amqp-url");
    }
    flags
}

fn merge(
    args: &mut RunArgs,
    matches: Option<&ArgMatches>,
) -> Result<Option<FileOrigin>, ConfigFileError> {
    let given = |id: &str| {
        matches
            .and_then(|m| m.value_source(id))
            .is_some_and(|s| matches!(s, ValueSource::CommandLine | ValueSource::EnvVariable))
    };
    let origin = match args.config.clone() {
        None => None,
        Some(path) => {
            let mut file = load(&path)?;
            let mut keys = Vec::new();
            macro_rules! take {
                ($($key:ident => $target:expr, $wrap:expr;)*) => {$(
                    if let Some(v) = file.$key {
                        if !given(stringify!($key)) {
                            $target = $wrap(v);
                            keys.push(stringify!($key));
                        }
                    }
                )*};
            }
            use std::convert::identity as same;
            // A connection string given one way by flag or variable is not also taken
            // from the file another way (that would be "given twice").
            let db_given = given("database_url") || given("database_url_file");
            let amqp_given = given("amqp_url") || given("amqp_url_file");
            if db_given {
                file.database_url = None;
                file.database_url_file = None;
            }
            if amqp_given {
                file.amqp_url = None;
                file.amqp_url_file = None;
            }
            take! {
                database_url => args.db.url.database_url, Some;
                database_url_file => args.db.url.database_url_file, Some;
                database_password_file => args.db.url.database_password_file, Some;
                slot => args.db.slot, same;
                schema => args.db.schema, same;
                prefix => args.prefix, Some;
                amqp_url => args.amqp_url, OneOrMany::into_vec;
                amqp_url_order => args.amqp_url_order, same;
                amqp_url_file => args.amqp_url_file, Some;
                amqp_password_file => args.amqp_password_file, Some;
                amqp_ca_file => args.amqp_ca_file, Some;
                amqp_cert_file => args.amqp_cert_file, Some;
                amqp_key_file => args.amqp_key_file, Some;
                publication => args.publication, same;
                exchange => args.exchange, same;
                allowed_exchanges => args.allowed_exchanges, NamesOrList::into_text;
                no_declare => args.no_declare, same;
                instance_id => args.instance_id, Some;
                max_in_flight => args.max_in_flight, same;
                max_in_flight_bytes => args.max_in_flight_bytes, same;
                max_message_bytes => args.max_message_bytes, same;
                broker_max_message_bytes => args.broker_max_message_bytes, Some;
                slot_busy_timeout_s => args.slot_busy_timeout_s, same;
                standby_poll_ms => args.standby_poll_ms, same;
                shutdown_timeout_s => args.shutdown_timeout_s, same;
                read_coalesce_us => args.read_coalesce_us, same;
                max_attempts => args.max_attempts, same;
                on_unroutable => args.on_unroutable, same;
                publish_properties => args.publish_properties, same;
                stall_after_s => args.stall_after_s, same;
                postgres_loss_drain_ms => args.postgres_loss_drain_ms, same;
                cloudevents => args.cloudevents, same;
                cloudevents_source => args.cloudevents_source, Some;
                cloudevents_prefix => args.cloudevents_prefix, Some;
                journal => args.journal, same;
                journal_retention => args.journal_retention, same;
                idempotency_retention => args.idempotency_retention, same;
            }
            if let Some(text) = file.maintenance_interval {
                if !given("maintenance_interval") {
                    args.maintenance_interval = crate::cli::parse_maintenance_interval(&text)
                        .map_err(|e| ConfigFileError::Invalid {
                            path: path.clone(),
                            what: format!("key \"maintenance_interval\": {e}"),
                            fix: "write maintenance_interval = \"5m\" (1s to 1d)".into(),
                        })?;
                    keys.push("maintenance_interval");
                }
            }
            if let Some(text) = file.http_addr {
                if !given("http_addr") {
                    let addr = crate::config::parse_http_addr(&text).map_err(|e| {
                        ConfigFileError::Invalid {
                            path: path.clone(),
                            what: format!("key \"http_addr\": {e}"),
                            fix: "write http_addr = \"HOST:PORT\" or \"off\"".into(),
                        }
                    })?;
                    args.http_addr = crate::cli::HttpAddr(addr);
                    keys.push("http_addr");
                }
            }
            Some(FileOrigin { path, keys })
        }
    };
    if args.db.url.database_url.is_none() && args.db.url.database_url_file.is_none() {
        return Err(ConfigFileError::Missing {
            flag: "--database-url",
            env: "PGOUTBOX_DATABASE_URL",
            key: "database_url",
        });
    }
    if args.amqp_url.iter().all(|u| u.0.trim().is_empty())
        && !given("amqp_url")
        && args.amqp_url_file.is_none()
    {
        return Err(ConfigFileError::Missing {
            flag: "--amqp-url",
            env: "PGOUTBOX_AMQP_URL",
            key: "amqp_url",
        });
    }
    Ok(origin)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_run_flag_has_a_file_key() {
        // A new `run` option must get a key here (and a `take!` line in `merge`).
        let cli = Cli::command();
        let run = cli.find_subcommand("run").expect("run");
        let mut flags: Vec<String> = run
            .get_arguments()
            .filter_map(|a| a.get_long())
            // --accept-gap is a one-off decision, deliberately not a file key.
            .filter(|l| !["config", "failpoint", "help", "accept-gap"].contains(l))
            .map(|l| l.replace('-', "_"))
            .collect();
        flags.sort();
        let mut keys: Vec<String> = KEYS.iter().map(|(k, _)| k.to_string()).collect();
        keys.sort();
        assert_eq!(flags, keys);
        // And every key deserializes (deny_unknown_fields knows it).
        for (key, _) in KEYS {
            // (`amqp_url = []` is even valid: an array of URLs, found empty later.)
            if let Err(e) = parse(Path::new("f.toml"), &format!("{key} = []")) {
                assert!(!e.to_string().contains("unknown key"), "{key}: {e}");
            }
        }
    }

    #[test]
    fn errors_name_the_key_the_file_and_the_fix() {
        let p = Path::new("/etc/pgoutbox.toml");
        let e = parse(p, "slot = \"a\"\nslott = \"b\"\n")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("/etc/pgoutbox.toml")
                && e.contains("unknown key \"slott\" (line 2)")
                && e.contains("max_in_flight"),
            "{e}"
        );
        let e = parse(p, "max_in_flight = \"many\"\n")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("key \"max_in_flight\" (line 1)")
                && e.contains("write max_in_flight = a whole number"),
            "{e}"
        );
        let e = parse(p, "max_in_flight = -1\n").unwrap_err().to_string();
        assert!(e.contains("\"max_in_flight\""), "{e}");
        let e = parse(p, "on_unroutable = \"drop\"\n")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("\"on_unroutable\"") && e.contains("block"),
            "{e}"
        );
        let e = parse(p, "slot = \n").unwrap_err().to_string();
        assert!(e.contains("/etc/pgoutbox.toml"), "{e}");
        let ok = parse(
            p,
            "slot = \"s\"\non_unroutable = \"block\"\nmax_in_flight = 5\n",
        )
        .expect("valid");
        assert_eq!(ok.slot.as_deref(), Some("s"));
        assert_eq!(ok.on_unroutable, Some(OnUnroutable::Block));
        assert_eq!(ok.max_in_flight, Some(5));
        let nodes = parse(
            p,
            "amqp_url = [\"amqp://a\", \"amqp://b\"]\namqp_url_order = \"shuffle\"\n",
        )
        .expect("valid");
        assert_eq!(
            nodes.amqp_url.map(OneOrMany::into_vec),
            Some(vec![Secret("amqp://a".into()), Secret("amqp://b".into())])
        );
        assert_eq!(nodes.amqp_url_order, Some(AmqpUrlOrderArg::Shuffle));
        let one = parse(p, "amqp_url = \"amqp://a,amqp://b\"\n").expect("valid");
        assert_eq!(
            one.amqp_url.map(OneOrMany::into_vec),
            Some(vec![Secret("amqp://a,amqp://b".into())])
        );
        let e = parse(p, "amqp_url_order = \"random\"\n")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("\"amqp_url_order\"") && e.contains("shuffle"),
            "{e}"
        );
    }
}
