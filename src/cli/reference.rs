//! The reference of every setting, read from the clap command tree: for each long option of
//! a subcommand, its flag, environment variable, config-file key, default, the form of its
//! value and its doc. The CLI's declarations ([`super::run`] and the other argument
//! structs) are the one source; the config file ([`crate::config_file`]) reads the same
//! keys with the same value forms, and the generated reference (`docs/`) is written from
//! [`settings`], so the three cannot drift. The numeric and duration settings of `run`
//! take their doc, range, default and parser from [`crate::config::numeric`]; the range is
//! also read from there into [`Setting::range`].
//!
//! Call [`run_settings`] for `run` (and `check`, which takes the same options), or
//! [`settings`] with a subcommand path (`["dead-letters", "list"]`) for another.

use std::any::TypeId;

use clap::builder::ArgAction;
use clap::CommandFactory;

use super::{Cli, NOT_FILE_KEYS};

/// How a setting's value is written on the command line, in its variable and in the file.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case", tag = "kind", content = "values")]
pub enum ValueForm {
    /// A switch: the flag alone turns it on; `true`/`false` in the variable and the file.
    Switch,
    /// A whole number (digits only); a TOML integer in the file.
    Number,
    /// One of these words; a TOML string in the file.
    OneOf(Vec<String>),
    /// Text (a name, a URL, a path, a duration such as `5m`); a TOML string in the file.
    Text,
}

/// One setting of a subcommand, as its reference shows it.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Setting {
    /// The long flag, e.g. `--max-in-flight`.
    pub flag: String,
    /// The environment variable that also sets it, e.g. `PGOUTBOX_MAX_IN_FLIGHT`; `None`
    /// for the options that pick what one invocation acts on.
    pub env: Option<String>,
    /// Its key in a `--config` file (`max_in_flight`); `None` where the subcommand reads no
    /// file, or for the options a file may not set ([`NOT_FILE_KEYS`]).
    pub config_key: Option<String>,
    /// The default as written on the command line (`10000`, `7d`, `127.0.0.1:8432`);
    /// `None` when unset means "not given" (or, for a URL, required from some source).
    pub default: Option<String>,
    /// The form of the value.
    pub value: ValueForm,
    /// The accepted range of a numeric or duration setting of `run` and `check`, from the
    /// one table of [`crate::config::numeric`] (`1 to 1000000 messages`, `1s to 1d`);
    /// `None` for the other settings.
    pub range: Option<String>,
    /// The value's placeholder in `--help` (`MAX_IN_FLIGHT`); `None` for a switch.
    pub value_name: Option<String>,
    /// Whether the flag may be repeated (each adds a value; a file gives an array).
    pub repeatable: bool,
    /// The `--help` section it is listed under (`PostgreSQL`, `RabbitMQ`, `Pipeline
    /// bounds`, `Observability`, `Publishing`); `None` for the general options.
    pub heading: Option<String>,
    /// Hidden from `--help` (test hooks such as `--failpoint`).
    pub hidden: bool,
    /// The doc comment, as `--help` shows it (plain text, paragraphs kept).
    pub doc: String,
}

/// The form of `arg`'s value: a switch (`SetTrue`), one of its possible values (a
/// `ValueEnum`), a number (an integer value parser), or text.
pub fn value_form(arg: &clap::Arg) -> ValueForm {
    if matches!(arg.get_action(), ArgAction::SetTrue | ArgAction::SetFalse) {
        return ValueForm::Switch;
    }
    let possible: Vec<String> = arg
        .get_possible_values()
        .iter()
        .filter(|v| !v.is_hide_set())
        .map(|v| v.get_name().to_owned())
        .collect();
    if !possible.is_empty() {
        return ValueForm::OneOf(possible);
    }
    let id = arg.get_value_parser().type_id();
    let integers = [
        TypeId::of::<u8>(),
        TypeId::of::<u16>(),
        TypeId::of::<u32>(),
        TypeId::of::<u64>(),
        TypeId::of::<usize>(),
        TypeId::of::<i8>(),
        TypeId::of::<i16>(),
        TypeId::of::<i32>(),
        TypeId::of::<i64>(),
    ];
    if integers.iter().any(|t| id == *t) {
        ValueForm::Number
    } else {
        ValueForm::Text
    }
}

/// Whether `arg` takes several values by repeating the flag.
pub fn is_repeatable(arg: &clap::Arg) -> bool {
    matches!(arg.get_action(), ArgAction::Append)
}

/// The config-file key of a long flag: the flag with `_` for `-` (`max-in-flight` →
/// `max_in_flight`).
pub fn file_key(long: &str) -> String {
    long.replace('-', "_")
}

/// Whether a subcommand reads a `--config` file (`run`, `check`).
fn reads_a_file(cmd: &clap::Command) -> bool {
    cmd.get_arguments().any(|a| a.get_long() == Some("config"))
}

/// The settings of the subcommand at `path` (`["run"]`, `["dead-letters", "list"]`; `[]`
/// for the options every subcommand takes, like `--log-format`), in `--help` order; `None`
/// when there is no such subcommand. `--help` and `--version` are left out.
pub fn settings(path: &[&str]) -> Option<Vec<Setting>> {
    let mut cmd = Cli::command();
    cmd.build();
    let mut cmd = &cmd;
    for name in path {
        cmd = cmd.find_subcommand(name)?;
    }
    let file = reads_a_file(cmd);
    let settings = cmd
        .get_arguments()
        .filter(|a| !matches!(a.get_action(), ArgAction::Help | ArgAction::Version))
        .filter(|a| path.is_empty() || !a.is_global_set())
        .filter_map(|arg| {
            let long = arg.get_long()?;
            let value = value_form(arg);
            Some(Setting {
                flag: format!("--{long}"),
                env: arg.get_env().map(|e| e.to_string_lossy().into_owned()),
                config_key: (file && !NOT_FILE_KEYS.contains(&long)).then(|| file_key(long)),
                default: match arg.get_default_values() {
                    [] => None,
                    values => Some(
                        values
                            .iter()
                            .map(|v| v.to_string_lossy())
                            .collect::<Vec<_>>()
                            .join(","),
                    ),
                },
                range: file
                    .then(|| crate::config::numeric::by_flag(&format!("--{long}")))
                    .flatten()
                    .map(|s| s.range_text()),
                value_name: (value != ValueForm::Switch)
                    .then(|| {
                        arg.get_value_names()
                            .and_then(|n| n.first())
                            .map(|n| n.to_string())
                    })
                    .flatten(),
                value,
                repeatable: is_repeatable(arg),
                heading: arg.get_help_heading().map(str::to_owned),
                hidden: arg.is_hide_set(),
                doc: arg
                    .get_long_help()
                    .or(arg.get_help())
                    .map(|h| h.to_string())
                    .unwrap_or_default(),
            })
        })
        .collect();
    Some(settings)
}

/// The settings of `run` (the same as `check`'s), for the generated reference.
pub fn run_settings() -> Vec<Setting> {
    settings(&["run"]).unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn run_settings_name_flag_variable_key_default_form_and_doc() {
        let all = run_settings();
        let get = |flag: &str| {
            all.iter()
                .find(|s| s.flag == flag)
                .unwrap_or_else(|| panic!("{flag} missing"))
        };
        let window = get("--max-in-flight");
        assert_eq!(window.env.as_deref(), Some("PGOUTBOX_MAX_IN_FLIGHT"));
        assert_eq!(window.config_key.as_deref(), Some("max_in_flight"));
        assert_eq!(window.default.as_deref(), Some("10000"));
        assert_eq!(window.value, ValueForm::Number);
        assert_eq!(window.heading.as_deref(), Some("Pipeline bounds"));
        assert!(window.doc.contains("1 to 1000000"), "{}", window.doc);
        assert_eq!(window.range.as_deref(), Some("1 to 1000000 messages"));
        assert_eq!(
            get("--maintenance-interval").range.as_deref(),
            Some("1s to 1d")
        );
        assert_eq!(get("--slot").range, None);
        let order = get("--amqp-url-order");
        assert_eq!(
            order.value,
            ValueForm::OneOf(vec!["in-order".into(), "shuffle".into()])
        );
        assert!(get("--amqp-url").repeatable);
        assert_eq!(get("--journal").value, ValueForm::Switch);
        assert_eq!(get("--slot").heading.as_deref(), Some("PostgreSQL"));
        assert_eq!(get("--maintenance-interval").value, ValueForm::Text);
        // One-off decisions and the file itself are no file keys.
        for flag in ["--accept-gap", "--config", "--failpoint"] {
            assert_eq!(get(flag).config_key, None, "{flag}");
        }
        assert!(get("--failpoint").hidden);
        assert_eq!(get("--accept-gap").env, None);
        // Every option that is a file key has a variable, and each flag appears once.
        let mut flags: Vec<&str> = all.iter().map(|s| s.flag.as_str()).collect();
        flags.sort();
        flags.dedup();
        assert_eq!(flags.len(), all.len());
        assert!(all.len() >= 40, "{} settings", all.len());
        // check's are run's, and the standby it may inspect.
        let (standby, check): (Vec<_>, Vec<_>) = settings(&["check"])
            .unwrap()
            .into_iter()
            .partition(|s| s.flag == "--standby-url");
        assert_eq!(check, all);
        assert_eq!(standby.len(), 1);
        assert_eq!(standby[0].config_key, None);
        assert_eq!(standby[0].heading.as_deref(), Some("Failover"));
        assert!(settings(&["nope"]).is_none());
        let list = settings(&["dead-letters", "list"]).unwrap();
        assert!(list.iter().all(|s| s.config_key.is_none()));
        assert!(list.iter().any(|s| s.flag == "--limit"));
        assert_eq!(
            settings(&[]).unwrap()[0].env.as_deref(),
            Some("PGOUTBOX_LOG_FORMAT")
        );
    }
}
