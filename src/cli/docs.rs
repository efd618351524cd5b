//! The documentation generated from the code: the book's Reference pages
//! (`docs/src/reference/`), the man pages and the shell completions, all read from the one
//! clap command tree ([`super::Cli`]), the metrics registry ([`crate::metrics::catalog`]),
//! the dead-letter reasons ([`crate::contract::dead_letter_reason`]) and the exit statuses
//! ([`super::exit_code`]).
//!
//! `pgoutbox docs reference --out docs/src/reference` writes [`reference_pages`]; the test
//! `reference::` of the integration binary fails when the checked-in pages differ from what
//! this module generates, so a flag, variable, key, metric or reason cannot be added,
//! renamed or redocumented without the book following. `pgoutbox docs man --out DIR` writes
//! one man page per command ([`write_man_pages`]); `pgoutbox completions SHELL` prints a
//! completion script ([`completions`]).
//!
//! Also here: the book page that explains a flag ([`page_for_flag`]), which the binary
//! names under an error about that flag.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::io;
use std::path::{Path, PathBuf};

use clap::CommandFactory;

use super::exit_code;
use super::reference::{settings, Setting, ValueForm};
use super::Cli;
use crate::contract::dead_letter_reason;
use crate::metrics::catalog::{catalog, MetricDoc};

/// The command that regenerates the pages, named in their header and in the test's hint.
pub const REGENERATE: &str = "cargo run -- docs reference --out docs/src/reference";

/// The book pages that explain each command (relative to `docs/src/`): (command path,
/// [(title, page)]).
const COMMAND_PAGES: &[(&str, &[(&str, &str)])] = &[
    (
        "setup",
        &[
            ("Requirements", "operators/postgres.md"),
            ("Roles", "operators/roles.md"),
            ("Lockdown", "producers/lockdown.md"),
        ],
    ),
    (
        "run",
        &[
            ("Deploy", "operators/deploy.md"),
            ("Configure", "operators/configuration.md"),
        ],
    ),
    (
        "check",
        &[("Check, status, peek, teardown", "operators/inspect.md")],
    ),
    (
        "status",
        &[("Check, status, peek, teardown", "operators/inspect.md")],
    ),
    (
        "peek",
        &[("Check, status, peek, teardown", "operators/inspect.md")],
    ),
    (
        "teardown",
        &[("Check, status, peek, teardown", "operators/inspect.md")],
    ),
    (
        "maintenance",
        &[("Retention and maintenance", "operators/retention.md")],
    ),
    (
        "journal",
        &[("The delivery journal", "operators/journal.md")],
    ),
    (
        "dead-letters",
        &[("Dead letters", "operators/dead-letters.md")],
    ),
    (
        "completions",
        &[(
            "Deploy",
            "operators/deploy.md#shell-completions-and-man-pages",
        )],
    ),
    (
        "docs",
        &[(
            "Deploy",
            "operators/deploy.md#shell-completions-and-man-pages",
        )],
    ),
];

/// The book page (relative to `docs/src/`) that explains a flag: the topic page of the
/// flag or its group, else the generated command-line reference.
pub fn page_for_flag(flag: &str) -> &'static str {
    let flag = flag.split([' ', '=']).next().unwrap_or(flag);
    const BY_FLAG: &[(&str, &str)] = &[
        ("--database-url", "operators/configuration.md"),
        ("--database-url-file", "operators/secrets.md"),
        ("--database-password-file", "operators/secrets.md"),
        ("--amqp-url-file", "operators/secrets.md"),
        ("--amqp-password-file", "operators/secrets.md"),
        ("--amqp-url", "operators/rabbitmq-cluster.md"),
        ("--amqp-url-order", "operators/rabbitmq-cluster.md"),
        ("--amqp-ca-file", "operators/tls-rabbitmq.md"),
        ("--amqp-cert-file", "operators/tls-rabbitmq.md"),
        ("--amqp-key-file", "operators/tls-rabbitmq.md"),
        ("--exchange", "producers/routing.md"),
        ("--allowed-exchanges", "producers/routing.md"),
        ("--no-declare", "producers/routing.md"),
        ("--partitions", "consumers/scaling.md"),
        ("--stream-url", "consumers/streams.md"),
        ("--stream", "consumers/streams.md"),
        ("--stream-producer-name", "consumers/streams.md"),
        ("--stream-max-age", "consumers/streams.md"),
        ("--stream-max-length-bytes", "consumers/streams.md"),
        ("--partition-key", "consumers/scaling.md"),
        ("--config", "operators/configuration.md"),
        ("--accept-gap", "operators/gaps.md"),
        ("--slot-busy-timeout-s", "operators/standby-replicas.md"),
        ("--standby-poll-ms", "operators/standby-replicas.md"),
        ("--journal", "operators/journal.md"),
        ("--journal-retention", "operators/retention.md"),
        ("--idempotency-retention", "operators/retention.md"),
        ("--inbox-retention", "operators/retention.md"),
        ("--maintenance-interval", "operators/retention.md"),
        ("--batch-size", "operators/retention.md"),
        ("--max-message-bytes", "operators/dead-letters.md"),
        ("--broker-max-message-bytes", "operators/dead-letters.md"),
        ("--max-attempts", "operators/dead-letters.md"),
        ("--on-unroutable", "operators/dead-letters.md"),
        ("--older-than", "operators/dead-letters.md"),
        ("--cloudevents", "consumers/cloudevents.md"),
        ("--cloudevents-source", "consumers/cloudevents.md"),
        ("--cloudevents-prefix", "consumers/cloudevents.md"),
        ("--publish-properties", "consumers/message.md"),
        ("--http-addr", "operators/monitoring.md"),
        ("--stall-after-s", "operators/monitoring.md"),
        ("--instance-id", "operators/monitoring.md"),
        ("--log-format", "operators/monitoring.md"),
        ("--warn-lag-bytes", "operators/inspect.md"),
        ("--crit-lag-bytes", "operators/inspect.md"),
        ("--schema", "producers/several-outboxes.md"),
        ("--prefix", "producers/several-outboxes.md"),
        ("--lockdown", "producers/lockdown.md"),
        ("--unlock", "producers/lockdown.md"),
        ("--create-roles", "operators/roles.md"),
        ("--streamer-role", "operators/roles.md"),
        ("--producer-role", "operators/roles.md"),
        ("--failover", "operators/postgres-failover.md"),
        ("--slot", "operators/postgres.md"),
        ("--publication", "operators/postgres.md"),
    ];
    const BY_PREFIX: &[(&str, &str)] = &[
        ("--max-in-flight", "operators/tuning.md"),
        ("--read-coalesce", "operators/tuning.md"),
        ("--shutdown-timeout", "operators/deploy.md"),
        ("--postgres-loss-drain", "operators/tuning.md"),
    ];
    BY_FLAG
        .iter()
        .find(|(f, _)| *f == flag)
        .or_else(|| BY_PREFIX.iter().find(|(p, _)| flag.starts_with(p)))
        .map(|(_, page)| *page)
        .unwrap_or("reference/cli.md")
}

/// Every page [`page_for_flag`] and the command table can name, for the test that they
/// exist (paths relative to `docs/src/`, perhaps with an `#anchor`).
pub fn pages_named() -> Vec<&'static str> {
    let mut pages: Vec<&'static str> = COMMAND_PAGES
        .iter()
        .flat_map(|(_, pages)| pages.iter().map(|(_, p)| *p))
        .collect();
    let mut cmd = Cli::command();
    cmd.build();
    for (_, sub) in commands(&cmd) {
        for arg in sub.get_arguments() {
            if let Some(long) = arg.get_long() {
                pages.push(page_for_flag(&format!("--{long}")));
            }
        }
    }
    pages.sort_unstable();
    pages.dedup();
    pages
}

/// Every command of the tree, depth first, with its path (`[]` for `pgoutbox` itself,
/// `["dead-letters", "list"]`); hidden commands and clap's `help` are left out.
pub fn commands(root: &clap::Command) -> Vec<(Vec<String>, &clap::Command)> {
    fn walk<'a>(
        cmd: &'a clap::Command,
        path: Vec<String>,
        out: &mut Vec<(Vec<String>, &'a clap::Command)>,
    ) {
        out.push((path.clone(), cmd));
        for sub in cmd.get_subcommands() {
            if sub.is_hide_set() || sub.get_name() == "help" {
                continue;
            }
            let mut p = path.clone();
            p.push(sub.get_name().to_owned());
            walk(sub, p, out);
        }
    }
    let mut out = Vec::new();
    walk(root, Vec::new(), &mut out);
    out
}

/// The anchor of a command's section in `cli.md` (`run`, `dead-letters-list`; `pgoutbox`
/// for the top level).
fn command_anchor(path: &[String]) -> String {
    if path.is_empty() {
        "pgoutbox".to_owned()
    } else {
        path.join("-")
    }
}

/// The anchor of a flag's entry in `cli.md` (`run-max-in-flight`).
pub fn flag_anchor(path: &[String], flag: &str) -> String {
    format!("{}-{}", command_anchor(path), flag.trim_start_matches('-'))
}

/// The header of every generated page.
fn generated_note(source: &str) -> String {
    format!(
        "<!-- Generated from {source} by `{REGENERATE}`. Do not edit: the test\n     `reference::` fails when this page differs from what the code generates. -->\n\n"
    )
}

/// Text for a Markdown table cell: one line, pipes escaped.
fn cell(text: &str) -> String {
    text.replace("\n\n", "<br><br>")
        .replace('\n', " ")
        .replace('|', "\\|")
}

/// The first sentence of a doc (up to the first `. ` or `; ` outside parentheses), for a
/// table.
fn first_sentence(doc: &str) -> String {
    let doc = doc.replace('\n', " ");
    let mut depth = 0i32;
    let mut end = doc.len();
    let bytes = doc.as_bytes();
    for (i, b) in bytes.iter().enumerate() {
        match b {
            b'(' => depth += 1,
            b')' => depth -= 1,
            b'.' | b';' if depth <= 0 && bytes.get(i + 1) == Some(&b' ') => {
                end = i;
                break;
            }
            _ => {}
        }
    }
    doc[..end].trim_end_matches('.').to_owned()
}

/// The generated Reference pages: (file name in `docs/src/reference/`, content).
pub fn reference_pages() -> Vec<(&'static str, String)> {
    let mut cmd = Cli::command();
    cmd.build();
    vec![
        ("cli.md", cli_page(&cmd)),
        ("environment.md", environment_page(&cmd)),
        ("config-file.md", config_file_page()),
        ("metrics.md", metrics_page(&catalog())),
        ("exit-codes.md", exit_codes_page()),
        ("dead-letter-reasons.md", dead_letter_reasons_page()),
    ]
}

/// Writes [`reference_pages`] into `dir`; returns the files written.
///
/// # Errors
/// The I/O error of a write.
pub fn write_reference(dir: &Path) -> io::Result<Vec<PathBuf>> {
    std::fs::create_dir_all(dir)?;
    reference_pages()
        .into_iter()
        .map(|(file, text)| {
            let path = dir.join(file);
            std::fs::write(&path, text)?;
            Ok(path)
        })
        .collect()
}

/// One line of facts about a setting: variable, file key, default, value form.
fn setting_facts(s: &Setting) -> String {
    let mut facts = Vec::new();
    if let Some(env) = &s.env {
        facts.push(format!("variable `{env}`"));
    }
    if let Some(key) = &s.config_key {
        facts.push(format!("file key `{key}`"));
    }
    if let Some(default) = &s.default {
        facts.push(format!("default `{default}`"));
    }
    if let Some(range) = &s.range {
        facts.push(format!("range {range}"));
    }
    match &s.value {
        ValueForm::Switch => facts.push("a switch".to_owned()),
        ValueForm::Number => facts.push("a whole number".to_owned()),
        ValueForm::OneOf(values) => facts.push(format!(
            "one of {}",
            values
                .iter()
                .map(|v| format!("`{v}`"))
                .collect::<Vec<_>>()
                .join(", ")
        )),
        ValueForm::Text => {}
    }
    if s.repeatable {
        facts.push("repeatable".to_owned());
    }
    facts.join(" · ")
}

fn cli_page(root: &clap::Command) -> String {
    let mut out = generated_note("the clap command tree (`src/cli/`)");
    out.push_str("# Command line\n\n");
    out.push_str(
        "Every command and option of `pgoutbox`, with its environment variable, its config-file key \
         (for `run` and `check`), its default and its doc: the same text `pgoutbox COMMAND --help` \
         prints. Precedence: flag, then variable, then config file, then default. The man pages \
         (`pgoutbox docs man`) and the shell completions (`pgoutbox completions`) are generated \
         from the same tree.\n\n",
    );
    out.push_str("| command | does | explained in |\n|---|---|---|\n");
    let all = commands(root);
    for (path, cmd) in all.iter().skip(1) {
        let pages = COMMAND_PAGES
            .iter()
            .find(|(c, _)| *c == path[0])
            .map(|(_, pages)| {
                pages
                    .iter()
                    .map(|(title, page)| format!("[{title}](../{page})"))
                    .collect::<Vec<_>>()
                    .join(", ")
            })
            .unwrap_or_default();
        let _ = writeln!(
            out,
            "| [`pgoutbox {}`](#{}) | {} | {} |",
            path.join(" "),
            command_anchor(path),
            cell(&first_sentence(
                &cmd.get_about().map(|a| a.to_string()).unwrap_or_default()
            )),
            pages
        );
    }
    for (path, cmd) in &all {
        command_section(&mut out, path, cmd);
    }
    out
}

fn command_section(out: &mut String, path: &[String], cmd: &clap::Command) {
    let name = if path.is_empty() {
        "pgoutbox".to_owned()
    } else {
        format!("pgoutbox {}", path.join(" "))
    };
    let _ = writeln!(out, "\n## {name} {{#{}}}\n", command_anchor(path));
    if let Some(about) = cmd.get_long_about().or(cmd.get_about()) {
        let _ = writeln!(out, "{about}\n");
    }
    let _ = writeln!(
        out,
        "```text\n{}\n```\n",
        cmd.clone().render_usage().to_string().trim_end()
    );
    let positionals: Vec<&clap::Arg> = cmd.get_positionals().filter(|a| !a.is_hide_set()).collect();
    if !positionals.is_empty() {
        out.push_str("Arguments:\n\n");
        for arg in positionals {
            let value = arg
                .get_value_names()
                .and_then(|n| n.first())
                .map(|n| n.to_string())
                .unwrap_or_else(|| arg.get_id().to_string().to_uppercase());
            let doc = arg
                .get_long_help()
                .or(arg.get_help())
                .map(|h| h.to_string())
                .unwrap_or_default();
            let possible: Vec<String> = arg
                .get_possible_values()
                .iter()
                .filter(|v| !v.is_hide_set())
                .map(|v| format!("`{}`", v.get_name()))
                .collect();
            let values = if possible.is_empty() {
                String::new()
            } else {
                format!(" (one of {})", possible.join(", "))
            };
            let _ = writeln!(out, "- `<{value}>`: {}{values}", doc.replace('\n', " "));
        }
        out.push('\n');
    }
    let path_str: Vec<&str> = path.iter().map(String::as_str).collect();
    let options: Vec<Setting> = settings(&path_str)
        .unwrap_or_default()
        .into_iter()
        .filter(|s| !s.hidden)
        .collect();
    let mut heading: Option<Option<String>> = None;
    for s in &options {
        if heading.as_ref() != Some(&s.heading) {
            let _ = writeln!(
                out,
                "### {} options\n",
                s.heading.as_deref().unwrap_or("General")
            );
            heading = Some(s.heading.clone());
        }
        let value = s
            .value_name
            .as_ref()
            .map(|v| format!(" <{v}>"))
            .unwrap_or_default();
        let _ = writeln!(
            out,
            "#### `{}{value}` {{#{}}}\n\n{}\n\n{}\n",
            s.flag,
            flag_anchor(path, &s.flag),
            s.doc.trim_end(),
            setting_facts(s)
        );
    }
    if let Some(examples) = cmd.get_after_long_help() {
        let _ = writeln!(
            out,
            "### Examples\n\n```text\n{}\n```",
            examples.to_string().trim_end()
        );
    }
}

/// Where one variable is read: its flag, the commands (with the anchor of each entry), the
/// defaults, the first sentence of its doc.
struct EnvUse {
    flag: String,
    users: Vec<(String, String)>,
    defaults: Vec<String>,
    doc: String,
}

fn environment_page(root: &clap::Command) -> String {
    let mut out = generated_note("the `env` of every clap argument (`src/cli/`)");
    out.push_str("# Environment variables\n\n");
    out.push_str(
        "Every variable a flag reads. The rule: a flag `--some-setting` reads \
         `PGOUTBOX_SOME_SETTING`; flags that choose what one command acts on or how it prints \
         (`--json`, `--limit`, `--force`, `--accept-gap`, ...) read none. Precedence: flag, then \
         variable, then config file, then default.\n\n",
    );
    out.push_str("| variable | flag | read by | default | meaning |\n|---|---|---|---|---|\n");
    let mut vars: BTreeMap<String, EnvUse> = BTreeMap::new();
    for (path, _) in commands(root) {
        let path_str: Vec<&str> = path.iter().map(String::as_str).collect();
        for s in settings(&path_str).unwrap_or_default() {
            let Some(env) = s.env.clone() else { continue };
            if s.hidden {
                continue;
            }
            let entry = vars.entry(env).or_insert_with(|| EnvUse {
                flag: s.flag.clone(),
                users: Vec::new(),
                defaults: Vec::new(),
                doc: first_sentence(&s.doc),
            });
            let command = if path.is_empty() {
                "every command".to_owned()
            } else {
                path.join(" ")
            };
            entry.users.push((command, flag_anchor(&path, &s.flag)));
            if let Some(d) = s.default {
                if !entry.defaults.contains(&d) {
                    entry.defaults.push(d);
                }
            }
        }
    }
    for (
        env,
        EnvUse {
            flag,
            users,
            defaults,
            doc,
        },
    ) in &vars
    {
        let _ = writeln!(
            out,
            "| `{env}` | `{flag}` | {} | {} | {} |",
            users
                .iter()
                .map(|(c, a)| format!("[{c}](cli.md#{a})"))
                .collect::<Vec<_>>()
                .join(", "),
            defaults
                .iter()
                .map(|d| format!("`{d}`"))
                .collect::<Vec<_>>()
                .join(" / "),
            cell(doc)
        );
    }
    out.push_str(
        "\nVariables pgoutbox reads that are not flags: `RUST_LOG` (the log filter, default \
         `info`) and, for `amqps://` without `cacertfile=` and for PostgreSQL TLS without \
         `sslrootcert`, `SSL_CERT_FILE` and `SSL_CERT_DIR` (where the system's CA certificates \
         are).\n\nVariables of the scripts and the tests (`PGOUTBOX_TEST_*`, `PGOUTBOX_BENCH_*`, \
         `PGOUTBOX_STACK_*`, `PGOUTBOX_CHAOS_*`) are not the binary's; see \
         [Tests, fuzzing and the throwaway stack](../internals/testing.md).\n",
    );
    out
}

fn config_file_page() -> String {
    let mut out = generated_note("`pgoutbox::cli::reference::run_settings()`");
    out.push_str("# Config file keys\n\n");
    out.push_str(
        "`run` and `check` read a TOML file given by `--config FILE` (`PGOUTBOX_CONFIG`). Its keys \
         are the long flags of `run` with `_` for `-`, flat (no tables), each optional. A flag or a \
         variable overrides the file. Each value goes through the same parser as its flag: an \
         unknown key (with the nearest valid key), a value of the wrong type or out of range fails \
         at start (exit 2), naming the key, its line and the file. `config` itself, `accept_gap` \
         (a one-off decision) and the test hook `failpoint` are no keys.\n\n\
         ```toml\ndatabase_url_file = \"/run/secrets/pgoutbox-db\"\namqp_url = [\"amqps://pgoutbox@rmq-1/\", \"amqps://pgoutbox@rmq-2/\"]\nmax_in_flight = 10000\njournal = true\njournal_retention = \"30d\"\n```\n\n",
    );
    out.push_str("| key | TOML value | default | flag | meaning |\n|---|---|---|---|---|\n");
    let run = vec!["run".to_owned()];
    for s in super::reference::run_settings() {
        let Some(key) = &s.config_key else { continue };
        if s.hidden {
            continue;
        }
        let mut form = match &s.value {
            ValueForm::Switch => "`true` or `false`".to_owned(),
            ValueForm::Number => "an integer".to_owned(),
            ValueForm::OneOf(v) => format!(
                "a string: {}",
                v.iter()
                    .map(|v| format!("`\"{v}\"`"))
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
            ValueForm::Text => "a string".to_owned(),
        };
        if s.repeatable {
            form.push_str(", or an array of strings");
        }
        let _ = writeln!(
            out,
            "| `{key}` | {form} | {} | [`{}`](cli.md#{}) | {} |",
            s.default
                .as_deref()
                .map(|d| format!("`{d}`"))
                .unwrap_or_default(),
            s.flag,
            flag_anchor(&run, &s.flag),
            cell(&match (&s.range, first_sentence(&s.doc)) {
                (Some(range), first) if !first.contains(range.as_str()) =>
                    format!("{first} ({range})"),
                (_, first) => first,
            })
        );
    }
    out
}

fn metrics_page(metrics: &[MetricDoc]) -> String {
    let mut out = generated_note("the metrics registry (`src/metrics/`)");
    out.push_str("# Metrics\n\n");
    out.push_str(
        "Every metric `pgoutbox run` serves on `/metrics` (OpenMetrics text; see \
         [Metrics, health and alerts](../operators/monitoring.md)), with its type, its labels and \
         the values each label takes (all present from the start, at 0), and its help text. LSNs \
         are numbers: bytes since `0/0`.\n\n",
    );
    out.push_str("| metric | type | labels | help |\n|---|---|---|---|\n");
    for m in metrics {
        let labels = m
            .labels
            .iter()
            .map(|(label, values)| {
                if values.is_empty() {
                    format!("`{label}`")
                } else {
                    format!(
                        "`{label}`: {}",
                        values
                            .iter()
                            .map(|v| format!("`{v}`"))
                            .collect::<Vec<_>>()
                            .join(", ")
                    )
                }
            })
            .collect::<Vec<_>>()
            .join("; ");
        let buckets = if m.buckets.is_empty() {
            String::new()
        } else {
            format!(
                " (buckets, seconds: {})",
                m.buckets
                    .iter()
                    .map(|b| format!("`{b}`"))
                    .collect::<Vec<_>>()
                    .join(", ")
            )
        };
        let _ = writeln!(
            out,
            "| `{}` | {} | {labels} | {}{buckets} |",
            m.name,
            m.kind,
            cell(&m.help)
        );
    }
    out
}

fn exit_codes_page() -> String {
    let mut out = generated_note("`pgoutbox::cli::exit_code`");
    out.push_str("# Exit codes\n\n| exit | meaning |\n|---|---|\n");
    for (code, meaning) in exit_code::GENERAL {
        let _ = writeln!(out, "| {code} | {} |", cell(meaning));
    }
    out.push_str("\nCommands that exit by other rules:\n\n| command | exit |\n|---|---|\n");
    for (command, rule) in exit_code::BY_COMMAND {
        let _ = writeln!(
            out,
            "| [`pgoutbox {command}`](cli.md#{command}) | {} |",
            cell(rule)
        );
    }
    out.push_str(
        "\nSee [Check, status, peek, teardown](../operators/inspect.md) for `status`, and \
         [Troubleshooting by symptom](../operators/troubleshooting.md) for the messages.\n",
    );
    out
}

fn dead_letter_reasons_page() -> String {
    let mut out = generated_note("`pgoutbox::contract::dead_letter_reason::ALL`");
    out.push_str("# Dead-letter reasons\n\n");
    out.push_str(
        "Every value of `outbox.dead_letter.reason` (and of the `reason` label of \
         `pgoutbox_messages_dead_lettered_total`). What to do about each is on \
         [Dead letters](../operators/dead-letters.md#the-reasons).\n\n| reason | what happened |\n|---|---|\n",
    );
    for (reason, meaning) in dead_letter_reason::ALL {
        let _ = writeln!(out, "| `{reason}` | {} |", cell(meaning));
    }
    out
}

/// Writes one man page per command (`pgoutbox.1`, `pgoutbox-run.1`,
/// `pgoutbox-dead-letters-list.1`, ...) into `dir`; returns the files written.
///
/// # Errors
/// The I/O error of a write.
pub fn write_man_pages(dir: &Path) -> io::Result<Vec<PathBuf>> {
    std::fs::create_dir_all(dir)?;
    let mut root = Cli::command().disable_help_subcommand(true);
    root.build();
    commands(&root)
        .into_iter()
        .map(|(_, cmd)| clap_mangen::Man::new(cmd.clone()).generate_to(dir))
        .collect()
}

/// Writes the completion script for `shell` to `out`.
///
/// The script is generated into memory first and written in one `write_all`:
/// clap_complete's generators panic on a write error (`pgoutbox completions zsh | head -1`
/// exited 101 on the closed pipe), our write does not.
///
/// # Errors
/// The I/O error of the write (a closed pipe: the caller drops it).
pub fn completions(shell: clap_complete::Shell, out: &mut dyn io::Write) -> io::Result<()> {
    let mut script = Vec::new();
    clap_complete::generate(shell, &mut Cli::command(), "pgoutbox", &mut script);
    out.write_all(&script)?;
    out.flush()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::metrics::catalog::unknown_metric_names;

    /// Every text `--help` can print: each command's about and examples, each argument's
    /// help.
    fn help_texts() -> Vec<(String, String)> {
        let mut root = Cli::command();
        root.build();
        let mut texts = Vec::new();
        for (path, cmd) in commands(&root) {
            let name = path.join(" ");
            for text in [
                cmd.get_about(),
                cmd.get_long_about(),
                cmd.get_after_long_help(),
            ]
            .into_iter()
            .flatten()
            {
                texts.push((name.clone(), text.to_string()));
            }
            for arg in cmd.get_arguments() {
                for text in [arg.get_help(), arg.get_long_help()].into_iter().flatten() {
                    texts.push((format!("{name} --{}", arg.get_id()), text.to_string()));
                }
            }
        }
        texts
    }

    #[test]
    fn help_texts_name_only_metrics_the_registry_serves() {
        let known = catalog();
        let bad: Vec<String> = help_texts()
            .into_iter()
            .flat_map(|(place, text)| {
                unknown_metric_names(&text, &known)
                    .into_iter()
                    .map(move |name| format!("{place}: {name}"))
            })
            .collect();
        assert!(
            bad.is_empty(),
            "help names metrics that do not exist: {bad:?}"
        );
    }

    #[test]
    fn every_command_has_examples_in_its_long_help() {
        let mut root = Cli::command();
        root.build();
        for (path, cmd) in commands(&root).into_iter().skip(1) {
            // A command with subcommands shows its subcommands' examples.
            if cmd.has_subcommands() {
                continue;
            }
            let examples = cmd
                .get_after_long_help()
                .map(|e| e.to_string())
                .unwrap_or_default();
            let invocation = format!("pgoutbox {}", path.join(" "));
            assert!(
                examples.starts_with("Examples:") && examples.contains(&invocation),
                "{invocation}: its after_long_help has no example of it: {examples:?}"
            );
        }
    }

    #[test]
    fn a_flag_points_to_its_page() {
        assert_eq!(page_for_flag("--max-in-flight"), "operators/tuning.md");
        assert_eq!(
            page_for_flag("--max-in-flight-bytes <MAX_IN_FLIGHT_BYTES>"),
            "operators/tuning.md"
        );
        assert_eq!(page_for_flag("--accept-gap"), "operators/gaps.md");
        assert_eq!(page_for_flag("--amqp-ca-file"), "operators/tls-rabbitmq.md");
        assert_eq!(page_for_flag("--nope"), "reference/cli.md");
        assert!(pages_named().len() > 10);
    }

    #[test]
    fn the_pages_list_every_flag_variable_key_metric_and_reason() {
        let pages: BTreeMap<&str, String> = reference_pages().into_iter().collect();
        let cli = &pages["cli.md"];
        for s in super::super::reference::run_settings()
            .iter()
            .filter(|s| !s.hidden)
        {
            assert!(
                cli.contains(&format!("{{#run-{}}}", s.flag.trim_start_matches('-'))),
                "{}",
                s.flag
            );
            if let Some(env) = &s.env {
                assert!(
                    pages["environment.md"].contains(&format!("`{env}`")),
                    "{env}"
                );
            }
            if let Some(key) = &s.config_key {
                assert!(
                    pages["config-file.md"].contains(&format!("`{key}`")),
                    "{key}"
                );
            }
        }
        assert!(!cli.contains("--failpoint"), "test hooks stay out");
        for name in crate::metrics::NAMES {
            assert!(pages["metrics.md"].contains(&format!("`{name}`")), "{name}");
        }
        for (reason, _) in dead_letter_reason::ALL {
            assert!(
                pages["dead-letter-reasons.md"].contains(&format!("`{reason}`")),
                "{reason}"
            );
        }
        assert!(cli.contains("## pgoutbox dead-letters list {#dead-letters-list}"));
    }
}
