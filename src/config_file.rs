//! `--config FILE` (env `PGOUTBOX_CONFIG`): a TOML file of flat keys named like the long
//! flags of `run` with `_` for `-` (`database_url`, `slot`, `max_in_flight`, ...).
//!
//! The keys are not written down here: they are derived from clap's command tree (every
//! long option of `run` except [`crate::cli::NOT_FILE_KEYS`]), and each value goes through
//! the same clap value parser as the flag, so a file value is checked exactly as a flag
//! or a variable would be, and an error names the file and the key.
//!
//! Precedence is flag > environment variable > file > built-in default. The command line
//! is parsed once; for each key of the file whose option the command line and the
//! environment left alone (clap's [`ArgMatches::value_source`]), the value is turned into
//! the option's command-line form (a string or a number as it is, `true` as the bare flag,
//! an array as the flag repeated) and checked by the option's value parser; then the
//! command line is parsed again with those options appended. What comes out is the same
//! `RunArgs` that flags and variables give, validated by the same
//! [`crate::cli::RunArgs::into_config`].
//!
//! This lives at the edge beside the CLI, not in `config`: the merge needs clap, and the
//! settings stay free of it.

use std::ffi::OsString;
use std::path::{Path, PathBuf};

use clap::parser::ValueSource;
use clap::{ArgMatches, CommandFactory, FromArgMatches};

use crate::cli::reference::{file_key, is_repeatable, value_form, ValueForm};
use crate::cli::{Cli, Command, RunArgs, NOT_FILE_KEYS};

/// Settings given two ways that exclude each other (a connection string, or a file holding
/// it): one given by flag or variable keeps the file from supplying the other.
const ALTERNATIVES: &[[&str; 2]] = &[
    ["database_url", "database_url_file"],
    ["amqp_url", "amqp_url_file"],
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

/// One `key = value` of a config file.
#[derive(Debug, Clone)]
pub struct FileEntry {
    /// The key.
    pub key: String,
    /// The line it is on (1-based).
    pub line: usize,
    /// The value.
    pub value: toml::Value,
}

/// Reads a config file and parses it as TOML: its entries in file order.
///
/// # Errors
/// [`ConfigFileError::Read`], or [`ConfigFileError::Invalid`] for text that is not TOML.
pub fn load(path: &Path) -> Result<Vec<FileEntry>, ConfigFileError> {
    let text = std::fs::read_to_string(path).map_err(|source| ConfigFileError::Read {
        path: path.to_owned(),
        source,
    })?;
    parse(path, &text)
}

fn line_at(text: &str, offset: usize) -> usize {
    text[..offset.min(text.len())].matches('\n').count() + 1
}

fn parse(path: &Path, text: &str) -> Result<Vec<FileEntry>, ConfigFileError> {
    let table: std::collections::BTreeMap<String, toml::Spanned<toml::Value>> =
        toml::from_str(text).map_err(|e| {
            let at = e
                .span()
                .map(|s| format!(" (line {})", line_at(text, s.start)))
                .unwrap_or_default();
            ConfigFileError::Invalid {
                path: path.to_owned(),
                what: format!("not valid TOML{at}: {}", e.message().trim()),
                fix: "write flat `key = value` lines (https://toml.io)".into(),
            }
        })?;
    let mut entries: Vec<(usize, FileEntry)> = table
        .into_iter()
        .map(|(key, value)| {
            let start = value.span().start;
            (
                start,
                FileEntry {
                    key,
                    line: line_at(text, start),
                    value: value.into_inner(),
                },
            )
        })
        .collect();
    entries.sort_by_key(|(start, _)| *start);
    Ok(entries.into_iter().map(|(_, e)| e).collect())
}

/// The options of `cmd` a file may set, by key.
fn file_args(cmd: &clap::Command) -> Vec<(String, &clap::Arg)> {
    cmd.get_arguments()
        .filter(|a| !a.is_global_set())
        .filter(|a| {
            !matches!(
                a.get_action(),
                clap::ArgAction::Help | clap::ArgAction::Version
            )
        })
        .filter_map(|a| {
            let long = a.get_long()?;
            (!NOT_FILE_KEYS.contains(&long)).then(|| (file_key(long), a))
        })
        .collect()
}

/// The valid key nearest to `key` (by edit distance), when one is close enough to be a
/// typo of it.
fn nearest<'a>(key: &str, keys: impl Iterator<Item = &'a str>) -> Option<&'a str> {
    keys.map(|k| (strsim::levenshtein(key, k), k))
        .filter(|(d, k)| *d <= 3.max(k.len() / 4))
        .min_by_key(|(d, _)| *d)
        .map(|(_, k)| k)
}

/// How to write `key`'s value, for an error's fix.
fn form_text(key: &str, arg: &clap::Arg) -> String {
    let form = match value_form(arg) {
        ValueForm::Switch => "true or false".to_owned(),
        ValueForm::Number => "a whole number".to_owned(),
        ValueForm::OneOf(values) => values
            .iter()
            .map(|v| format!("{v:?}"))
            .collect::<Vec<_>>()
            .join(" or "),
        ValueForm::Text => "a string".to_owned(),
    };
    let form = if is_repeatable(arg) && value_form(arg) != ValueForm::Switch {
        format!("{form}, or an array of them")
    } else {
        form
    };
    let help = arg.get_help().map(|h| h.to_string()).unwrap_or_default();
    format!(
        "write {key} = {form} (--{}: {})",
        arg.get_long().unwrap_or_default(),
        help.trim_end_matches('.')
    )
}

/// A TOML value's type, as serde names it in its own errors.
fn toml_type(value: &toml::Value) -> String {
    match value {
        toml::Value::String(s) => format!("string {s:?}"),
        toml::Value::Integer(i) => format!("integer `{i}`"),
        toml::Value::Float(f) => format!("floating point `{f}`"),
        toml::Value::Boolean(b) => format!("boolean `{b}`"),
        toml::Value::Datetime(d) => format!("datetime `{d}`"),
        toml::Value::Array(_) => "array".into(),
        toml::Value::Table(_) => "table".into(),
    }
}

/// The command-line values of one file entry: one string per value (an array gives one per
/// element), or `None` for a switch set to `false` (the flag is left out). `Err` says why
/// the TOML type does not fit the option.
fn values_of(arg: &clap::Arg, value: &toml::Value) -> Result<Option<Vec<String>>, String> {
    let form = value_form(arg);
    let expected = match &form {
        ValueForm::Switch => "a boolean",
        ValueForm::Number => "an integer",
        _ if is_repeatable(arg) => "a string or an array of strings",
        _ => "a string",
    };
    let wrong = || format!("invalid type: {}, expected {expected}", toml_type(value));
    let one = |v: &toml::Value| match (&form, v) {
        (ValueForm::Number, toml::Value::Integer(i)) => Ok(i.to_string()),
        (ValueForm::OneOf(_) | ValueForm::Text, toml::Value::String(s)) => Ok(s.clone()),
        _ => Err(wrong()),
    };
    match (&form, value) {
        (ValueForm::Switch, toml::Value::Boolean(true)) => Ok(Some(Vec::new())),
        (ValueForm::Switch, toml::Value::Boolean(false)) => Ok(None),
        (ValueForm::Switch, _) => Err(wrong()),
        // An empty array is one empty value, as an empty string would be (an empty list of
        // nodes is then reported as missing; an empty exchange list allows only
        // --exchange).
        (_, toml::Value::Array(items)) if is_repeatable(arg) && items.is_empty() => {
            Ok(Some(vec![String::new()]))
        }
        (_, toml::Value::Array(items)) if is_repeatable(arg) => {
            items.iter().map(one).collect::<Result<_, _>>().map(Some)
        }
        _ => one(value).map(|v| Some(vec![v])),
    }
}

/// Runs `arg`'s value parser on one file value, as clap runs it on the flag's value: in a
/// command holding only that option (no variable, no default, no other option to
/// conflict with), so the parser and its possible values are exactly the flag's.
fn parse_value(arg: &clap::Arg, value: &str) -> Result<(), clap::Error> {
    let only = clap::Arg::new("value")
        .long("value")
        .action(clap::ArgAction::Set)
        .value_parser(arg.get_value_parser().clone());
    clap::Command::new("config-file")
        .no_binary_name(true)
        .arg(only)
        .try_get_matches_from([format!("--value={value}")])
        .map(drop)
}

/// Why clap's value parser refused a file value, without clap's `error:` prefix and tips.
fn parser_message(e: &clap::Error, value: &str) -> String {
    use clap::error::{ContextKind, ContextValue};
    if let Some(source) = std::error::Error::source(e) {
        return source.to_string();
    }
    if let Some(ContextValue::Strings(valid)) = e.get(ContextKind::ValidValue) {
        return format!(
            "{value:?} is not one of {}",
            valid
                .iter()
                .map(|v| format!("{v:?}"))
                .collect::<Vec<_>>()
                .join(", ")
        );
    }
    e.kind().to_string()
}

/// Where the file named by `--config` came into the settings: the file and the keys whose
/// values it supplied.
#[derive(Debug, Clone)]
pub struct FileOrigin {
    /// The file.
    pub path: PathBuf,
    /// Keys whose value was taken from it (not overridden by a flag or variable).
    pub keys: Vec<String>,
}

impl FileOrigin {
    /// For a validation error of `setting` (e.g. `--max-in-flight`): a note naming the
    /// file and key, when the bad value came from the file.
    pub fn note_for(&self, setting: &str) -> Option<String> {
        let key = file_key(setting.strip_prefix("--")?);
        self.keys.iter().find(|k| **k == key).map(|k| {
            format!(
                "the value comes from {k} in config file {}: fix it there",
                self.path.display()
            )
        })
    }
}

/// The command-line options a config file adds to a subcommand's command line: for each
/// entry whose option the command line and the environment left alone, `--flag=value`
/// (repeated for an array; the bare flag for `true`), each value checked by the option's
/// value parser. Returns them with the keys they came from.
///
/// # Errors
/// [`ConfigFileError::Invalid`] naming the file, the key, its line and the fix: an unknown
/// key (with the nearest valid one), a value of the wrong type, a value the option's
/// parser refuses.
pub fn file_options(
    path: &Path,
    entries: &[FileEntry],
    cmd: &clap::Command,
    matches: &ArgMatches,
) -> Result<(Vec<OsString>, Vec<String>), ConfigFileError> {
    let args = file_args(cmd);
    let given = |key: &str| {
        args.iter()
            .find(|(k, _)| k == key)
            .and_then(|(_, a)| matches.value_source(a.get_id().as_str()))
            .is_some_and(|s| matches!(s, ValueSource::CommandLine | ValueSource::EnvVariable))
    };
    let invalid = |what: String, fix: String| ConfigFileError::Invalid {
        path: path.to_owned(),
        what,
        fix,
    };
    let mut extra = Vec::new();
    let mut keys = Vec::new();
    for entry in entries {
        let key = entry.key.as_str();
        let at = format!(" (line {})", entry.line);
        let Some((_, arg)) = args.iter().find(|(k, _)| k == key) else {
            let known: Vec<&str> = args.iter().map(|(k, _)| k.as_str()).collect();
            let hint = match nearest(key, known.iter().copied()) {
                Some(k) => format!("did you mean {k:?}? "),
                None if NOT_FILE_KEYS.contains(&key.replace('_', "-").as_str()) => format!(
                    "--{} is given on the command line each time, not in a file; ",
                    key.replace('_', "-")
                ),
                None => String::new(),
            };
            return Err(invalid(
                format!("unknown key {key:?}{at}"),
                format!(
                    "{hint}remove it or correct its spelling; the keys are the long flags of `run` with _ for -: {}",
                    known.join(", ")
                ),
            ));
        };
        // Flag and variable beat the file; so does the other form of the same setting.
        let alternative_given = ALTERNATIVES
            .iter()
            .filter(|pair| pair.contains(&key))
            .flat_map(|pair| pair.iter())
            .any(|k| given(k));
        if given(key) || alternative_given {
            continue;
        }
        let values = values_of(arg, &entry.value)
            .map_err(|why| invalid(format!("key {key:?}{at}: {why}"), form_text(key, arg)))?;
        let long = arg.get_long().unwrap_or_default();
        match values {
            None => {}
            Some(values) if values.is_empty() => extra.push(OsString::from(format!("--{long}"))),
            Some(values) => {
                for value in values {
                    parse_value(arg, &value).map_err(|e| {
                        invalid(
                            format!("key {key:?}{at}: {}", parser_message(&e, &value)),
                            form_text(key, arg),
                        )
                    })?;
                    extra.push(OsString::from(format!("--{long}={value}")));
                }
            }
        }
        keys.push(key.to_owned());
    }
    Ok((extra, keys))
}

/// Parses the command line like `Cli::parse` (a clap error is returned, not exited on), then, for `run`
/// and `check`, merges the config file, if one is named.
///
/// # Errors
/// [`CliError::Usage`] for what clap refuses; [`CliError::File`] for an unreadable or
/// invalid file, or a required URL found nowhere.
pub fn parse_cli() -> Result<(Cli, Option<FileOrigin>), CliError> {
    parse_cli_from(std::env::args_os())
}

/// [`parse_cli`] of the given arguments (the first is the program name).
///
/// # Errors
/// As [`parse_cli`].
pub fn parse_cli_from(
    argv: impl IntoIterator<Item = impl Into<OsString>>,
) -> Result<(Cli, Option<FileOrigin>), CliError> {
    let argv: Vec<OsString> = argv.into_iter().map(Into::into).collect();
    // The URLs are required, but may come from a file or the config file: clap does not
    // insist on them (they are optional there), `check_required` and `secrets::resolve` do.
    let matches = Cli::command()
        .try_get_matches_from(&argv)
        .map_err(CliError::Usage)?;
    let mut cli = Cli::from_arg_matches(&matches).map_err(CliError::Usage)?;
    let name = match &cli.command {
        Command::Run(_) => "run",
        Command::Check(_) => "check",
        _ => return Ok((cli, None)),
    };
    let sub = matches.subcommand_matches(name).unwrap_or(&matches);
    // Before the file's values are appended: they are not on the command line.
    let passwords = passwords_on_argv(sub);
    let file = match sub.get_one::<PathBuf>("config") {
        None => None,
        Some(path) => {
            let entries = load(path)?;
            let mut command = Cli::command();
            command.build();
            let cmd = command.find_subcommand(name).unwrap_or(&command);
            let (extra, keys) = file_options(path, &entries, cmd, sub)?;
            if !extra.is_empty() {
                let mut all = argv.clone();
                all.extend(extra);
                let matches = Cli::command()
                    .try_get_matches_from(&all)
                    .map_err(CliError::Usage)?;
                cli = Cli::from_arg_matches(&matches).map_err(CliError::Usage)?;
            }
            Some(FileOrigin {
                path: path.clone(),
                keys,
            })
        }
    };
    match &mut cli.command {
        Command::Run(args) => {
            args.passwords_on_argv = passwords;
            check_required(args)?;
        }
        Command::Check(args) => check_required(&args.run)?,
        _ => {}
    }
    Ok((cli, file))
}

/// The URL flags of `run` given on the command line (not by a variable or a file) with a
/// password in them: the process list shows it to every user of the machine.
fn passwords_on_argv(matches: &ArgMatches) -> Vec<&'static str> {
    let on_argv = |id: &str| matches.value_source(id) == Some(ValueSource::CommandLine);
    let with_password = |id: &str| {
        matches
            .get_many::<crate::secrets::Secret>(id)
            .is_some_and(|mut v| v.any(|u| crate::secrets::has_password(&u.0)))
    };
    ["database_url", "amqp_url", "stream_url"]
        .into_iter()
        .filter(|id| on_argv(id) && with_password(id))
        .map(|id| match id {
            "database_url" => "--database-url",
            "stream_url" => "--stream-url",
            _ => "--amqp-url",
        })
        .collect()
}

/// The connection strings `run` cannot do without, given some way.
fn check_required(args: &RunArgs) -> Result<(), ConfigFileError> {
    let db = &args.postgres.db.url;
    if db.database_url.is_none() && db.database_url_file.is_none() {
        return Err(ConfigFileError::Missing {
            flag: "--database-url",
            env: "PGOUTBOX_DATABASE_URL",
            key: "database_url",
        });
    }
    let broker = &args.broker;
    // `--stream-url` replaces `--amqp-url` (RunArgs::into_config names what is missing).
    let streams = !broker.stream_url.is_empty() || broker.stream.is_some();
    if !streams
        && broker.amqp_url.iter().all(|u| u.0.trim().is_empty())
        && broker.amqp_url_file.is_none()
    {
        return Err(ConfigFileError::Missing {
            flag: "--amqp-url",
            env: "PGOUTBOX_AMQP_URL",
            key: "amqp_url",
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::BrokerUrl;

    /// `pgoutbox ARGS` with the config file `contents`, with no `PGOUTBOX_*` variable.
    fn with_file(contents: &str, args: &[&str]) -> Result<(Cli, Option<FileOrigin>), String> {
        let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
        let path = dir.path().join("p.toml");
        std::fs::write(&path, contents).map_err(|e| e.to_string())?;
        let mut argv = vec!["pgoutbox".to_owned()];
        argv.extend(args.iter().map(|a| a.to_string()));
        argv.extend(["--config".into(), path.display().to_string()]);
        parse_cli_from(argv).map_err(|e| match e {
            CliError::Usage(e) => e.to_string(),
            CliError::File(e) => e.to_string(),
        })
    }

    const URLS: &str = "database_url = \"postgres://u@h/db\"\namqp_url = \"amqp://h\"\n";

    fn run_args(cli: Cli) -> RunArgs {
        match cli.command {
            Command::Run(a) => a,
            Command::Check(a) => a.run,
            _ => unreachable!(),
        }
    }

    #[test]
    fn every_run_option_but_the_one_offs_is_a_file_key() {
        let mut cli = Cli::command();
        cli.build();
        let run = cli.find_subcommand("run").expect("run");
        let keys: Vec<String> = file_args(run).into_iter().map(|(k, _)| k).collect();
        for key in [
            "database_url",
            "max_in_flight",
            "amqp_url",
            "journal",
            "cloudevents_prefix",
        ] {
            assert!(keys.iter().any(|k| k == key), "{key}: {keys:?}");
        }
        for key in ["config", "accept_gap", "failpoint", "help", "log_format"] {
            assert!(!keys.iter().any(|k| k == key), "{key}");
        }
        // Every key is an option that a flag and a variable also set.
        for (key, arg) in file_args(run) {
            assert!(arg.get_env().is_some(), "{key} has no variable");
        }
    }

    #[test]
    fn errors_name_the_key_the_file_and_the_fix() {
        let p = Path::new("/etc/pgoutbox.toml");
        let cmd = {
            let mut c = Cli::command();
            c.build();
            c.find_subcommand("run").unwrap().clone()
        };
        let matches = cmd
            .clone()
            .try_get_matches_from(["run", "--database-url", "x", "--amqp-url", "y"])
            .unwrap();
        let check = |text: &str| {
            let entries = parse(p, text).map_err(|e| e.to_string())?;
            file_options(p, &entries, &cmd, &matches).map_err(|e| e.to_string())
        };
        let e = check("slot = \"a\"\nslott = \"b\"\n").unwrap_err();
        assert!(
            e.contains("/etc/pgoutbox.toml")
                && e.contains("unknown key \"slott\" (line 2)")
                && e.contains("did you mean \"slot\"?")
                && e.contains("max_in_flight"),
            "{e}"
        );
        let e = check("max_inflight = 5\n").unwrap_err();
        assert!(e.contains("did you mean \"max_in_flight\"?"), "{e}");
        let e = check("accept_gap = true\n").unwrap_err();
        assert!(e.contains("unknown key \"accept_gap\""), "{e}");
        let e = check("max_in_flight = \"many\"\n").unwrap_err();
        assert!(
            e.contains("key \"max_in_flight\" (line 1): invalid type: string \"many\"")
                && e.contains("write max_in_flight = a whole number")
                && e.contains("1 to 1000000"),
            "{e}"
        );
        let e = check("max_in_flight = -1\n").unwrap_err();
        assert!(
            e.contains("\"max_in_flight\"") && e.contains("not a whole number"),
            "{e}"
        );
        let e = check("on_unroutable = \"drop\"\n").unwrap_err();
        assert!(
            e.contains("key \"on_unroutable\" (line 1): \"drop\" is not one of")
                && e.contains("\"block\""),
            "{e}"
        );
        let e = check("journal = \"yes\"\n").unwrap_err();
        assert!(
            e.contains("expected a boolean") && e.contains("true or false"),
            "{e}"
        );
        let e = check("slot = \n").unwrap_err();
        assert!(
            e.contains("/etc/pgoutbox.toml") && e.contains("not valid TOML"),
            "{e}"
        );
        let e = check("cloudevents_prefix = \"ce-\"\n").unwrap_err();
        assert!(e.contains("\"cloudevents_prefix\" (line 1)"), "{e}");
        let e = check("http_addr = \"nonsense\"\n").unwrap_err();
        assert!(e.contains("\"http_addr\"") && e.contains("or off"), "{e}");
        let e = check("maintenance_interval = \"5 fortnights\"\n").unwrap_err();
        assert!(
            e.contains("\"maintenance_interval\"") && e.contains("1s to 1d"),
            "{e}"
        );
        let (extra, keys) = check(
            "slot = \"s\"\non_unroutable = \"block\"\nmax_in_flight = 5\njournal = true\ncloudevents = false\n",
        )
        .expect("valid");
        assert_eq!(
            extra,
            [
                "--slot=s",
                "--on-unroutable=block",
                "--max-in-flight=5",
                "--journal"
            ]
            .map(OsString::from)
        );
        assert_eq!(
            keys,
            [
                "slot",
                "on_unroutable",
                "max_in_flight",
                "journal",
                "cloudevents"
            ]
        );
    }

    #[test]
    fn the_file_fills_what_flags_and_variables_left_alone() {
        let (cli, origin) = with_file(
            &format!("{URLS}slot = \"from_file\"\nmax_in_flight = 5\namqp_url_order = \"shuffle\"\nallowed_exchanges = [\"a\", \"b\"]\njournal = true\n"),
            &["run", "--max-in-flight", "7"],
        )
        .unwrap();
        let origin = origin.unwrap();
        assert!(origin.keys.contains(&"slot".to_owned()));
        assert!(
            !origin.keys.contains(&"max_in_flight".to_owned()),
            "the flag won"
        );
        assert!(origin
            .note_for("--slot")
            .unwrap()
            .contains("slot in config file"));
        assert_eq!(origin.note_for("--max-in-flight"), None);
        let args = run_args(cli);
        assert!(args.passwords_on_argv.is_empty());
        let config = args.into_config().unwrap();
        assert_eq!(config.postgres.slot, "from_file");
        assert_eq!(config.bounds.max_in_flight, 7);
        assert_eq!(
            config.broker.amqp_url_order,
            crate::config::AmqpUrlOrder::Shuffle
        );
        assert_eq!(config.broker.allowed_exchanges.to_string(), "a,b");
        assert_eq!(config.observability.journal, crate::config::JournalMode::On);
        // An array of nodes is the flag repeated; a comma-separated string is one value
        // that splits later.
        let (cli, _) = with_file(
            "database_url = \"postgres://u@h/db\"\namqp_url = [\"amqp://a\", \"amqp://b\"]\n",
            &["check"],
        )
        .unwrap();
        assert_eq!(
            run_args(cli).into_config().unwrap().broker.amqp_urls,
            [BrokerUrl::new("amqp://a"), BrokerUrl::new("amqp://b")]
        );
        // A URL given as a file on the command line keeps the file's URL out.
        let dir = tempfile::tempdir().unwrap();
        let url_file = dir.path().join("url");
        std::fs::write(&url_file, "postgres://v@h/other\n").unwrap();
        let (cli, _) = with_file(
            URLS,
            &["run", "--database-url-file", url_file.to_str().unwrap()],
        )
        .unwrap();
        let config = run_args(cli).into_config().unwrap();
        assert_eq!(config.postgres.database.get_dbname(), Some("other"));
        // Nothing anywhere: the missing URL is named with its three sources.
        let e = with_file("slot = \"s\"\n", &["run"]).unwrap_err();
        assert!(
            e.contains("missing --database-url") && e.contains("database_url in a --config file"),
            "{e}"
        );
    }
}
