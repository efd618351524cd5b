//! The `pgoutbox` binary: parse arguments, set up tracing, run, map errors to an exit code.

use std::process::ExitCode;

// Output that never panics. `std`'s `println!` panics when stdout is a closed pipe
// (`pgoutbox maintenance | head -1` exited 101); these write and drop the error, so output
// to a reader that has gone ends quietly while the command finishes its work and exits
// with its own status. Defined before any use: they shadow `std`'s macros in this file.
macro_rules! println {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stdout(), $($arg)*);
    }};
}
// Once the log is set up, what this file writes to stderr goes through the log's writer
// ([`LOG`]), one whole line at a time, so an exit report never overtakes the log lines
// queued before it.
macro_rules! eprintln {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        match LOG.get() {
            Some(log) => {
                let line = format!("{}\n", format_args!($($arg)*));
                let _ = log.clone().write_all(line.as_bytes());
            }
            None => {
                let _ = writeln!(std::io::stderr(), $($arg)*);
            }
        }
    }};
}

use pgoutbox::admin::Force;
use pgoutbox::cli::exit_code::{STATUS_UNKNOWN as EXIT_STATUS_UNKNOWN, USAGE as EXIT_USAGE};
use pgoutbox::cli::{Command, DeadLetterCommand, DocsCommand, LogFormat};
use pgoutbox::config::{validate_identifier, RunConfig, ValidationError};
use pgoutbox::error::{render_report, Error};
use pgoutbox::{admin, pipeline};

fn main() -> ExitCode {
    // Flags, then variables, then the --config file (a bad file is a usage error too).
    let (cli, file) = match pgoutbox::config_file::parse_cli() {
        Ok(parsed) => parsed,
        Err(pgoutbox::config_file::CliError::Usage(e)) => return usage_error(e),
        Err(pgoutbox::config_file::CliError::File(e)) => {
            eprintln!("{}", render_report(&e));
            return ExitCode::from(EXIT_USAGE);
        }
    };
    // The commands that only print what this binary knows: no tracing, no runtime.
    let command = match cli.command {
        Command::Completions(args) => {
            // A reader that has gone (`| head -1`) is no error of ours: exit 0 quietly, as
            // the other printing commands do.
            let _ = pgoutbox::cli::docs::completions(args.shell, &mut std::io::stdout());
            return ExitCode::SUCCESS;
        }
        Command::Docs(cmd) => return docs(cmd),
        other => other,
    };
    // Held to the end of `main`: dropping it writes out the log lines still queued.
    let _log = init_tracing(cli.log_format);
    // Settings are parsed and checked once, here, before anything else happens, so a bad
    // one is a usage error (exit 2), like the ones clap finds, and never a panic later (a
    // shutdown timeout of u64::MAX seconds used to overflow `Instant` at SIGTERM). What
    // `run` and `check` are handed is valid by construction.
    let job = match Job::of(command) {
        Ok(job) => job,
        Err(e) => {
            report_exit(cli.log_format, &e);
            if let Some(note) = file.as_ref().and_then(|f| f.note_for(e.setting)) {
                eprintln!("  {note}");
            }
            see_page(cli.log_format, e.setting);
            return ExitCode::from(EXIT_USAGE);
        }
    };
    // One thread runs the whole pipeline (replication reader, core, publish and confirm
    // tasks): handing each message between worker threads cost more CPU than the work
    // itself. The publisher's socket is driven from this thread too (no I/O thread of its
    // own), and `check` uses the same connection.
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            let e = RuntimeStart(e);
            report_exit(cli.log_format, &e);
            return ExitCode::FAILURE;
        }
    };
    let is_status = matches!(job, Job::Other(Command::Status(_)));
    let format = cli.log_format;
    let result = runtime.block_on(try_main(job));
    // Dropping a runtime waits for its blocking tasks without bound: one may be stuck
    // reading a TLS file (a FIFO, a hung network file system) long after the process
    // decided to exit.
    runtime.shutdown_timeout(std::time::Duration::from_secs(1));
    let dropped = pgoutbox::metrics::log_lines_dropped();
    if dropped > 0 {
        tracing::warn!(
            target: "pgoutbox",
            dropped,
            "{dropped} log lines were dropped: stderr did not take them as fast as they were logged (pgoutbox_log_lines_dropped_total)"
        );
    }
    match result {
        Ok(code) => ExitCode::from(code),
        Err(e) => {
            report_exit(format, &e);
            if let Error::Config(v) = &e {
                see_page(format, v.setting);
            }
            if is_status {
                ExitCode::from(EXIT_STATUS_UNKNOWN)
            } else if matches!(e, Error::Config(_)) {
                ExitCode::from(EXIT_USAGE)
            } else {
                ExitCode::FAILURE
            }
        }
    }
}

/// `setup` just created `slot`, starting at `start`: when `outbox.stream_state` records
/// that a slot of this name streamed before, says so on stderr with the range that may
/// never have been delivered, as `run` will refuse it (the gap rule). A record that cannot
/// be read is left to `run`.
async fn warn_recreated_slot(
    client: &tokio_postgres::Client,
    schema: &pgoutbox::outbox_schema::SchemaName,
    slot: &str,
    start: &str,
) {
    let Ok(Some(record)) = pgoutbox::stream_state::load(client, schema, slot).await else {
        return;
    };
    eprintln!(
        "warning: slot {slot} was created now, but {} records that a slot of this name streamed up to {} (written {}): outbox messages committed between {} and {start} may never have been delivered. `run` refuses to start until the gap is accepted: recover those messages if they matter, then run once with --accept-gap (see docs/src/operators/gaps.md)",
        schema.rewrite("outbox.stream_state"),
        record.flush_lsn,
        record.updated_at,
        record.flush_lsn,
    );
}

/// Names, on stderr, the book page that explains `setting` (a flag such as
/// `--max-in-flight`), under an error about it. Text logs only: under `--log-format json`
/// the exit report stays the last line and one JSON object (it names the setting).
fn see_page(format: LogFormat, setting: &str) {
    if format == LogFormat::Text && setting.starts_with("--") {
        eprintln!(
            "  see docs/src/{} (pgoutbox's book)",
            pgoutbox::cli::docs::page_for_flag(setting)
        );
    }
}

/// `docs reference|man --out DIR`: writes the generated pages and lists them.
fn docs(cmd: DocsCommand) -> ExitCode {
    let (dir, written) = match &cmd {
        DocsCommand::Reference(args) => {
            (&args.out, pgoutbox::cli::docs::write_reference(&args.out))
        }
        DocsCommand::Man(args) => (&args.out, pgoutbox::cli::docs::write_man_pages(&args.out)),
    };
    match written {
        Ok(files) => {
            for f in files {
                println!("wrote {}", f.display());
            }
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("error: cannot write into {}: {e}", dir.display());
            ExitCode::FAILURE
        }
    }
}

/// The tokio runtime could not be built (threads, file descriptors).
#[derive(Debug, thiserror::Error)]
#[error("cannot start the tokio runtime")]
struct RuntimeStart(#[source] std::io::Error);

/// Lines the log's writer thread may hold; a line logged while it holds this many is
/// dropped and counted: about 2 MB of log at 200 bytes a line.
const LOG_BUFFER_LINES: usize = 10_000;

/// The log's writer, set by [`init_tracing`]: a handle on a thread of its own
/// (`pgoutbox-log`) that writes the log's lines to stderr in the order they were logged.
///
/// The pipeline runs on one thread; writing to stderr from it stopped the whole pipeline
/// (replication reads, keepalive replies, publisher confirms) whenever stderr did not take
/// the write: a pipe nobody reads, a stalled log collector, a suspended terminal. With the
/// writer thread, logging costs a queue push. The queue is bounded and lossy: when
/// [`LOG_BUFFER_LINES`] lines wait, a new line is dropped rather than wait, and counted
/// (`pgoutbox_log_lines_dropped_total`; the count is written at exit). A lossless queue
/// (the first version) stopped the stream again once it was full (issue 32, item 6).
static LOG: std::sync::OnceLock<tracing_appender::non_blocking::NonBlocking> =
    std::sync::OnceLock::new();

/// Installs the stderr subscriber in `format`, behind the filters that keep secrets out,
/// writing through [`LOG`]. The returned guard flushes the queued lines when dropped (it
/// waits about a second at most for a stderr that takes nothing), so `main` holds it to the
/// end.
#[must_use = "dropping the guard stops the log's writer"]
fn init_tracing(format: LogFormat) -> tracing_appender::non_blocking::WorkerGuard {
    use tracing_subscriber::layer::SubscriberExt;
    use tracing_subscriber::util::SubscriberInitExt;
    use tracing_subscriber::Layer;
    // lapin logs returned messages (with their payload) at warn and its own connection
    // failures at error; pgoutbox reports both itself, so lapin stays silent by default.
    let filter = tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| {
        tracing_subscriber::EnvFilter::new("info,lapin=off,tokio_postgres=warn")
    });
    // Whatever RUST_LOG asks for, the client libraries never log below what is safe: lapin's
    // trace output carries the AMQP PLAIN credentials (connection.start-ok) and its warnings
    // returned payloads; tokio-postgres logs query parameters (dead-letter envelopes) at
    // debug. pgoutbox's own events never carry either. Both formats sit behind this filter.
    let secrets_safe = tracing_subscriber::filter::filter_fn(|meta| {
        let target = meta.target();
        if target.starts_with("lapin") || target.starts_with("amq_protocol") {
            false
        } else if target.starts_with("tokio_postgres") || target.starts_with("postgres_protocol") {
            *meta.level() <= tracing::Level::WARN
        } else {
            true
        }
    });
    let (writer, guard) = tracing_appender::non_blocking::NonBlockingBuilder::default()
        .lossy(true)
        .buffered_lines_limit(LOG_BUFFER_LINES)
        .thread_name("pgoutbox-log")
        .finish(std::io::stderr());
    let drops = writer.error_counter();
    pgoutbox::metrics::count_log_drops_with(move || drops.dropped_lines() as u64);
    let _ = LOG.set(writer.clone());
    let fmt = tracing_subscriber::fmt::layer().with_writer(writer);
    let layer = match format {
        LogFormat::Text => fmt
            .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
            .boxed(),
        // Fields at the top level next to `message`, so a log shipper reads `slot` or `lsn`
        // without digging into a nested object. The one span pgoutbox opens is `partition`
        // (`run --partitions N`: a partition's connect, publish and confirm lines), written as
        // `"span": {"partition": i, "name": "partition"}`.
        LogFormat::Json => fmt
            .json()
            .flatten_event(true)
            .with_current_span(true)
            .with_span_list(false)
            .boxed(),
    };
    tracing_subscriber::registry()
        .with(layer.with_filter(secrets_safe).with_filter(filter))
        .init();
    if format == LogFormat::Json {
        // A panic's message would otherwise be plain text on stderr.
        std::panic::set_hook(Box::new(|info| {
            tracing::error!(target: "pgoutbox", panic = %info, "pgoutbox panicked: this is a bug, please report it");
        }));
    }
    guard
}

/// Prints the report of an error that ends the process: with `text`, the error and its
/// cause chain on several lines; with `json`, one JSON object (through the same subscriber
/// as the log, so it has `timestamp`, `level`, `target` and `message`) whose `message` is
/// the error and whose `caused_by` lists the causes, outermost first, separated by ` <- `.
fn report_exit(format: LogFormat, error: &(dyn std::error::Error + 'static)) {
    match format {
        LogFormat::Text => eprintln!("{}", render_report(error)),
        LogFormat::Json => {
            let mut causes: Vec<String> = Vec::new();
            let mut last = error.to_string();
            let mut source = error.source();
            while let Some(cause) = source {
                let text = cause.to_string();
                // As in render_report: a cause that a message already repeats is shown once.
                if !last.contains(&text) {
                    causes.push(text.clone());
                }
                last = text;
                source = cause.source();
            }
            if causes.is_empty() {
                tracing::error!(target: "pgoutbox", "{error}");
            } else {
                tracing::error!(target: "pgoutbox", caused_by = %causes.join(" <- "), "{error}");
            }
        }
    }
}

/// Reports a command line clap refused and returns its exit status (2). `--help` and
/// `--version` go to stdout as usual. When `--log-format json` (or `PGOUTBOX_LOG_FORMAT=json`)
/// can be read from the raw arguments, the error is one JSON object on stderr: the
/// subscriber is not installed yet, since the format is itself a setting.
fn usage_error(e: clap::Error) -> ExitCode {
    use clap::error::ErrorKind;
    let wants_json = {
        let args: Vec<String> = std::env::args_os()
            .map(|a| a.to_string_lossy().into_owned())
            .collect();
        let from_args = args.iter().enumerate().find_map(|(i, a)| {
            a.strip_prefix("--log-format=")
                .map(str::to_owned)
                .or_else(|| {
                    (a == "--log-format").then(|| args.get(i + 1).cloned().unwrap_or_default())
                })
        });
        from_args
            .or_else(|| std::env::var("PGOUTBOX_LOG_FORMAT").ok())
            .as_deref()
            == Some("json")
    };
    let is_output = matches!(e.kind(), ErrorKind::DisplayHelp | ErrorKind::DisplayVersion);
    if is_output {
        e.exit();
    }
    // The flag the error is about, to name the page that explains it.
    let flag = match e.get(clap::error::ContextKind::InvalidArg) {
        Some(clap::error::ContextValue::String(arg)) => Some(arg.clone()),
        Some(clap::error::ContextValue::Strings(args)) => args.first().cloned(),
        _ => None,
    };
    if !wants_json {
        let _ = e.print();
        if let Some(flag) = &flag {
            see_page(LogFormat::Text, flag);
        }
        return ExitCode::from(u8::try_from(e.exit_code()).unwrap_or(EXIT_USAGE));
    }
    let _log = init_tracing(LogFormat::Json);
    let text = e.render().to_string();
    let text = text.trim_end();
    tracing::error!(target: "pgoutbox", "{}", text.strip_prefix("error: ").unwrap_or(text));
    ExitCode::from(u8::try_from(e.exit_code()).unwrap_or(EXIT_USAGE))
}

/// What to do: `run` and `check` with their settings parsed and validated, or another
/// subcommand.
enum Job {
    /// `run`, and the flags that carried a password on the command line (to warn about).
    Run(RunConfig, Vec<&'static str>),
    /// `check`, and the standby of `--standby-url`.
    Check(RunConfig, Option<Box<pgoutbox::config::DatabaseConfig>>),
    /// Every other subcommand (they validate their few arguments as they go).
    Other(Command),
}

impl Job {
    /// Builds the validated settings of `run` and `check`.
    fn of(command: Command) -> Result<Job, ValidationError> {
        Ok(match command {
            Command::Run(args) => {
                let passwords = args.passwords_on_argv.clone();
                Job::Run(args.into_config()?, passwords)
            }
            Command::Check(args) => {
                let standby = args.standby.config()?.map(Box::new);
                Job::Check(args.run.into_config()?, standby)
            }
            other => Job::Other(other),
        })
    }
}

/// Runs the command; `Ok` carries the exit status (`status` exits by health, the others 0).
async fn try_main(job: Job) -> Result<u8, Error> {
    let command = match job {
        Job::Run(config, passwords_on_argv) => return run(config, &passwords_on_argv).await,
        Job::Check(config, standby) => {
            let findings = pgoutbox::check::check(&config, standby.as_deref()).await;
            return match pgoutbox::check::print(&findings) {
                0 => Ok(0),
                n => Err(Error::Precondition(format!(
                    "check found {n} problem(s) that would stop `run`"
                ))),
            };
        }
        Job::Other(command) => command,
    };
    match command {
        Command::Setup(args) => {
            validate_identifier("--slot", &args.db.slot)?;
            validate_identifier("--publication", &args.publication)?;
            let schema = args.db.schema()?;
            let prefix = args
                .prefix
                .as_deref()
                .map(|p| pgoutbox::outbox_schema::MessagePrefix::parse("--prefix", p))
                .transpose()?;
            // Before anything changes: --lockdown / --unlock are the default outbox's and
            // need a superuser.
            if args.lockdown {
                admin::require_default_schema(&schema, "--lockdown")?;
            } else if args.unlock {
                admin::require_default_schema(&schema, "--unlock")?;
            }
            let client = pgoutbox::postgres::connect(&args.db.url.config()?).await?;
            if args.lockdown {
                admin::lockdown::require_superuser(&client, "--lockdown").await?;
            } else if args.unlock {
                admin::lockdown::require_superuser(&client, "--unlock").await?;
            }
            let failover = match args.failover {
                Some(true) => admin::provisioning::SlotFailover::On,
                Some(false) => admin::provisioning::SlotFailover::Off,
                None => admin::provisioning::SlotFailover::Auto,
            };
            let report = admin::setup(
                &client,
                &args.db.url.config()?,
                &schema,
                prefix.as_ref(),
                &args.db.slot,
                &args.publication,
                failover,
            )
            .await?;
            if args.create_roles {
                let roles =
                    admin::create_roles(&client, &schema, &args.streamer_role, &args.producer_role)
                        .await?;
                for (role, what) in [
                    (&args.streamer_role, "streamer role, LOGIN REPLICATION"),
                    (&args.producer_role, "producer role, NOLOGIN"),
                ] {
                    println!(
                        "role {role} ({what}): {}, granted in this database",
                        if roles.created.contains(role) {
                            "created"
                        } else {
                            "existed"
                        }
                    );
                }
            }
            if !schema.is_default()
                && admin::lockdown_state(&client)
                    .await
                    .is_ok_and(|l| l.enabled)
            {
                eprintln!(
                    "warning: this database is locked down (setup --lockdown of schema outbox): pg_logical_emit_message is revoked from PUBLIC, so only superusers can emit through the helpers of schema {schema}; run setup --unlock to let its producers emit"
                );
            }
            println!(
                "setup done: schema {schema}, prefix {}, slot {} ({}), publication {} ({}), confirmed_flush_lsn {}",
                report.prefix,
                args.db.slot,
                if report.slot_created {
                    "created"
                } else {
                    "existed"
                },
                args.publication,
                if report.publication_created {
                    "created"
                } else {
                    "existed"
                },
                report.confirmed_flush_lsn
            );
            match report.failover {
                Some(true) if report.failover_altered => println!(
                    "slot {} is now a failover slot (failover = true): standbys with sync_replication_slots = on keep a copy",
                    args.db.slot
                ),
                Some(true) => println!(
                    "slot {} is a failover slot (failover = true): standbys with sync_replication_slots = on keep a copy",
                    args.db.slot
                ),
                Some(false) => println!(
                    "slot {} is an ordinary slot (failover = false): it does not survive a failover of the primary",
                    args.db.slot
                ),
                None => {}
            }
            if let Some(note) = &report.failover_note {
                eprintln!("warning: {note}");
            }
            if report.slot_created {
                warn_recreated_slot(&client, &schema, &args.db.slot, &report.confirmed_flush_lsn)
                    .await;
            }
            let lockdown = if args.lockdown {
                Some(admin::lock(&client).await?)
            } else if args.unlock {
                Some(admin::unlock(&client).await?)
            } else {
                None
            };
            if let Some(state) = lockdown {
                println!("lockdown: {}", state.describe());
            }
            Ok(0)
        }
        Command::Status(args) => status(args).await,
        Command::DeclareTopology(args) => declare_topology(args).await,
        Command::Peek(args) => peek(args).await.map(|()| 0),
        Command::Teardown(args) => {
            validate_identifier("--slot", &args.db.slot)?;
            validate_identifier("--publication", &args.publication)?;
            let schema = args.db.schema()?;
            let client = pgoutbox::postgres::connect(&args.db.url.config()?).await?;
            let force = if args.force { Force::Yes } else { Force::No };
            let report =
                admin::teardown(&client, &schema, &args.db.slot, &args.publication, force).await?;
            println!(
                "teardown done: slot {} {}, publication {} {}",
                args.db.slot,
                if report.slot_dropped {
                    "dropped"
                } else {
                    "was absent"
                },
                args.publication,
                if report.publication_dropped {
                    "dropped"
                } else {
                    "was absent"
                }
            );
            Ok(0)
        }
        Command::DeadLetters(cmd) => dead_letters(cmd).await.map(|()| 0),
        Command::Maintenance(args) => maintenance(args).await,
        Command::Journal(args) => journal(args).await,
        Command::Run(_) | Command::Check(_) => unreachable!("built into a Job by Job::of"),
        Command::Completions(_) | Command::Docs(_) => unreachable!("handled before the runtime"),
    }
}

/// `declare-topology`: declares (or with `--check` only checks) the consumers' topology,
/// printing one line per object; exit 1 when something is missing or differs.
async fn declare_topology(args: pgoutbox::cli::DeclareTopologyArgs) -> Result<u8, Error> {
    use pgoutbox::publisher::socket::Endpoint;
    use pgoutbox::topology::{self, Mode};
    let topology = args.topology()?;
    let url = args.url()?;
    let endpoint = Endpoint::parse(url.expose_secret()).map_err(|e| ValidationError {
        setting: "--amqp-url",
        value: url.to_string(),
        rule: e.to_string(),
    })?;
    let opened = tokio::time::timeout(
        pgoutbox::publisher::CONNECT_TIMEOUT,
        pgoutbox::publisher::connection::open_session(&endpoint, "pgoutbox declare-topology"),
    )
    .await
    .map_err(|_| pgoutbox::publisher::Error::ConnectTimeout {
        url: endpoint.redacted_url.clone(),
        timeout_s: pgoutbox::publisher::CONNECT_TIMEOUT.as_secs(),
    })?;
    let mut session = opened?;
    let mode = if args.check {
        Mode::Check
    } else {
        Mode::Declare
    };
    let host = endpoint.address();
    let host = host.rsplit_once(':').map_or(host.as_str(), |(h, _)| h);
    let findings =
        topology::apply(&mut session, &topology, mode, &endpoint.redacted_url, host).await;
    let _ = tokio::time::timeout(std::time::Duration::from_secs(5), session.close()).await;
    let findings = findings?;
    for f in &findings {
        println!("{f}");
    }
    let problems = findings.iter().filter(|f| f.state.is_problem()).count();
    if problems > 0 {
        return Err(Error::Precondition(format!(
            "declare-topology found {problem} object(s) missing or different at {url}{hint}",
            problem = problems,
            url = endpoint.redacted_url,
            hint = if args.check {
                "; run it without --check to declare what is missing"
            } else {
                "; nothing that exists was changed"
            }
        )));
    }
    println!(
        "topology {}: {} -> {} -> {} quorum queue(s) {}.0 to {}.{}",
        if args.check { "checked" } else { "declared" },
        topology.exchange,
        topology.hash_exchange,
        topology.queue_count,
        topology.queue_prefix,
        topology.queue_prefix,
        topology.queue_count - 1
    );
    Ok(0)
}

/// `run`: streams until SIGINT or SIGTERM.
async fn run(config: RunConfig, passwords_on_argv: &[&str]) -> Result<u8, Error> {
    if !passwords_on_argv.is_empty() {
        tracing::warn!(
            flags = %passwords_on_argv.join(", "),
            "a password was given on the command line ({}): every user of this machine can read it in the process list; set it through the environment (PGOUTBOX_DATABASE_URL, PGOUTBOX_AMQP_URL, PGOUTBOX_STREAM_URL) or a file instead (--database-url-file, --amqp-url-file, PGOUTBOX_DATABASE_PASSWORD_FILE, PGOUTBOX_AMQP_PASSWORD_FILE)",
            passwords_on_argv.join(", ")
        );
    }
    let (tx, rx) = tokio::sync::watch::channel(false);
    tokio::spawn(async move {
        wait_for_signal().await;
        let _ = tx.send(true);
    });
    pipeline::run(config, rx).await.map(|_| 0)
}

/// Waits for SIGINT or SIGTERM.
async fn wait_for_signal() {
    use tokio::signal::unix::{signal, SignalKind};
    match signal(SignalKind::terminate()) {
        Ok(mut term) => {
            tokio::select! {
                _ = term.recv() => {}
                _ = tokio::signal::ctrl_c() => {}
            }
        }
        Err(_) => {
            let _ = tokio::signal::ctrl_c().await;
        }
    }
}

async fn dead_letters(cmd: DeadLetterCommand) -> Result<(), Error> {
    match cmd {
        DeadLetterCommand::List(args) => {
            let schema = args.db.schema()?;
            let client = pgoutbox::postgres::connect(&args.db.url.config()?).await?;
            let rows = admin::list_dead_letters(&client, &schema, args.all, args.limit).await?;
            if args.json {
                println!("{}", serde_json::to_string(&rows).unwrap_or_default());
            } else if rows.is_empty() {
                println!("no dead letters");
            } else {
                for r in rows {
                    println!(
                        "{:>6}  {}  lsn={}  id={}  topic={}  reason={}  attempts={}  last_error={}{}",
                        r.id,
                        r.dead_lettered_at,
                        r.lsn,
                        r.message_id.as_deref().unwrap_or("-"),
                        r.topic.as_deref().unwrap_or("-"),
                        r.reason,
                        r.attempts,
                        r.last_error.as_deref().unwrap_or("-"),
                        r.requeued_at
                            .map(|t| format!("  requeued_at={t}"))
                            .unwrap_or_default(),
                    );
                }
            }
            Ok(())
        }
        DeadLetterCommand::Requeue(args) => {
            let schema = args.db.schema()?;
            let mut client = pgoutbox::postgres::connect(&args.db.url.config()?).await?;
            let selection = if args.all {
                admin::Selection::All
            } else {
                admin::Selection::Ids(args.id)
            };
            let prefix = admin::resolve_prefix(&client, &schema, None).await?;
            let ids =
                admin::requeue_dead_letters(&mut client, &schema, &prefix, &selection).await?;
            println!(
                "requeued {} dead letters{}",
                ids.len(),
                if ids.is_empty() {
                    String::new()
                } else {
                    format!(
                        " (ids {})",
                        ids.iter()
                            .map(i64::to_string)
                            .collect::<Vec<_>>()
                            .join(", ")
                    )
                }
            );
            Ok(())
        }
        DeadLetterCommand::Purge(args) => {
            let schema = args.db.schema()?;
            let client = pgoutbox::postgres::connect(&args.db.url.config()?).await?;
            let selection = match (args.all, args.older_than) {
                (true, _) => admin::Selection::All,
                (false, Some(secs)) => admin::Selection::OlderThanSecs(secs),
                (false, None) => admin::Selection::Ids(args.id),
            };
            let n = admin::purge_dead_letters(&client, &schema, &selection).await?;
            println!("purged {n} dead letters");
            Ok(())
        }
    }
}

/// `maintenance`: one retention pass over the idempotency keys, the journal and the inbox,
/// printing one line per table. Exit 0 when every step ran (or was off, or skipped because
/// its table or function is not installed), 1 when one failed (the others still run), 2
/// for bad arguments (clap).
async fn maintenance(args: pgoutbox::cli::MaintenanceArgs) -> Result<u8, Error> {
    use pgoutbox::admin::retention::{purge, Purgeable, Purged};
    let schema = args.db.schema()?;
    let client = pgoutbox::postgres::connect(&args.db.url.config()?).await?;
    let mut failed = 0;
    for (table, retention) in [
        (Purgeable::IdempotencyKeys, args.idempotency_retention),
        (Purgeable::Journal, args.journal_retention),
        (Purgeable::Inbox, args.inbox_retention),
    ] {
        let what = table.describe_in(&schema);
        match purge(&client, &schema, table, retention, args.batch_size, MAINTENANCE_PAUSE).await {
            Ok(Purged::Deleted { rows, batches }) => println!(
                "{what}: deleted {rows} older than {retention} ({batches} statement{} of at most {} rows)",
                if batches == 1 { "" } else { "s" },
                args.batch_size
            ),
            Ok(Purged::Off) => println!("{what}: retention off (0), nothing deleted"),
            Ok(Purged::Missing) => println!("{what}: skipped, {}", table.missing_note()),
            Err(e) => {
                failed += 1;
                println!("{what}: failed");
                eprintln!("{}", render_report(&e));
            }
        }
    }
    Ok(if failed > 0 { 1 } else { 0 })
}

/// Pause between two delete statements of `maintenance`.
const MAINTENANCE_PAUSE: std::time::Duration = std::time::Duration::from_millis(50);

/// `journal MESSAGE_ID`: prints the entries (exit 0), or says there are none (exit 1).
async fn journal(args: pgoutbox::cli::JournalArgs) -> Result<u8, Error> {
    let client = pgoutbox::postgres::connect(&args.db.url.config()?).await?;
    let rows =
        admin::journal::journal_entries(&client, &args.db.schema()?, &args.message_id).await?;
    if args.json {
        println!("{}", serde_json::to_string(&rows).unwrap_or_default());
    } else {
        for r in &rows {
            println!(
                "{}  id={}  topic={}  exchange={}  lsn={}  commit_lsn={}  attempts={}  slot={}",
                r.confirmed_at,
                r.message_id,
                r.topic,
                r.exchange.as_deref().unwrap_or("-"),
                r.lsn,
                r.commit_lsn,
                r.attempts,
                r.slot_name
            );
        }
    }
    if rows.is_empty() {
        eprintln!(
            "no journal entries for message id {:?} (was `run --journal` on when it was confirmed, and within --journal-retention?)",
            args.message_id
        );
        return Ok(1);
    }
    Ok(0)
}

/// `status`: prints the report and returns its severity as the exit status (0 healthy,
/// 1 warning, 2 critical); each problem also goes to stderr, one line each.
async fn status(args: pgoutbox::cli::StatusArgs) -> Result<u8, Error> {
    validate_identifier("--slot", &args.db.slot)?;
    validate_identifier("--publication", &args.publication)?;
    let schema = args.db.schema()?;
    if args.crit_lag_bytes < args.warn_lag_bytes {
        return Err(Error::Config(pgoutbox::config::ValidationError {
            setting: "--crit-lag-bytes",
            value: args.crit_lag_bytes.to_string(),
            rule: format!(
                "must be at least --warn-lag-bytes ({}); raise it or lower --warn-lag-bytes",
                args.warn_lag_bytes
            ),
        }));
    }
    let mut client = pgoutbox::postgres::connect(&args.db.url.config()?).await?;
    let lag = admin::LagThresholds {
        warn_bytes: args.warn_lag_bytes,
        crit_bytes: args.crit_lag_bytes,
    };
    let prefix = admin::resolve_prefix(&client, &schema, None).await?;
    let mut r = admin::health(
        &mut client,
        &schema,
        &prefix,
        &args.db.slot,
        &args.publication,
        lag,
    )
    .await?;
    if let Some(standby) = args.standby.config()? {
        let checks = match pgoutbox::postgres::connect(&standby).await {
            Ok(c) => admin::failover::on_standby(&c, &args.db.slot).await,
            Err(e) => Err(e.into()),
        };
        r.add_failover(
            "standby",
            checks.unwrap_or_else(|e| {
                vec![admin::failover::FailoverCheck {
                    level: admin::failover::Level::Problem,
                    subject: "standby",
                    text: format!("cannot be read: {}", pgoutbox::report::one_line(&e)),
                }]
            }),
        );
    }
    if args.json {
        println!("{}", serde_json::to_string(&r).unwrap_or_default());
    } else {
        let or_dash = |v: Option<String>| v.unwrap_or_else(|| "-".into());
        let num = |v: Option<i64>| or_dash(v.map(|n| n.to_string()));
        println!(
            "outbox:                 schema {}, prefix {}",
            r.schema, r.prefix
        );
        println!(
            "slot:                   {}{}",
            r.slot,
            if r.slot_exists { "" } else { " (missing)" }
        );
        println!(
            "active:                 {}{}",
            r.active,
            match (&r.active_pid, &r.holder) {
                (Some(pid), Some(h)) => format!(" (pid {pid}, {h})"),
                (Some(pid), None) => format!(" (pid {pid})"),
                _ => String::new(),
            }
        );
        println!(
            "standbys:               {}",
            if r.standbys.is_empty() {
                "-".to_owned()
            } else {
                r.standbys.join(", ")
            }
        );
        println!(
            "confirmed_flush_lsn:    {}",
            or_dash(r.confirmed_flush_lsn.clone())
        );
        println!("lag_bytes:              {}", num(r.lag_bytes));
        println!("wal_status:             {}", or_dash(r.wal_status.clone()));
        println!(
            "restart_lsn:            {}",
            or_dash(r.retention.restart_lsn.clone())
        );
        println!(
            "retained_wal_bytes:     {}",
            num(r.retention.retained_wal_bytes)
        );
        println!("safe_wal_size:          {}", num(r.retention.safe_wal_size));
        println!(
            "max_slot_wal_keep_size: {}",
            or_dash(r.retention.max_slot_wal_keep_size.clone())
        );
        println!(
            "publication:            {}{}",
            r.publication,
            if r.publication_exists {
                ""
            } else {
                " (missing)"
            }
        );
        println!(
            "waiting messages:       {}",
            match (
                r.pending_outbox_messages,
                &r.pending_outbox_messages_unknown
            ) {
                (Some(n), _) if r.pending_outbox_messages_at_least => format!("at least {n}"),
                (Some(n), _) => n.to_string(),
                (None, Some(why)) => why.clone(),
                (None, None) => "-".into(),
            }
        );
        println!("dead letters:           {}", num(r.dead_letters));
        println!(
            "lockdown:               {}",
            r.lockdown
                .as_ref()
                .map(admin::LockdownState::describe)
                .unwrap_or_else(|| "unknown".into())
        );
        if r.newest_dead_letter_reason.is_some() {
            println!(
                "newest dead letter:     {} at {}: {}",
                or_dash(r.newest_dead_letter_reason.clone()),
                or_dash(r.newest_dead_letter_at.clone()),
                or_dash(r.newest_dead_letter_error.clone())
            );
        }
        match &r.stream_state {
            Some(st) => {
                println!(
                    "recorded flush_lsn:     {} (system {}, timeline {}, at {})",
                    st.flush_lsn, st.system_identifier, st.timeline, st.updated_at
                );
                for g in &st.accepted_gaps {
                    println!(
                        "accepted gap:           {} to {} ({}, accepted {})",
                        g.from_lsn, g.to_lsn, g.reason, g.accepted_at
                    );
                }
            }
            None => println!("recorded flush_lsn:     - (no record yet)"),
        }
        println!(
            "gap:                    {}",
            r.gap
                .as_ref()
                .map(|g| format!("{} to {} ({})", g.from_lsn, g.to_lsn, g.reason))
                .unwrap_or_else(|| "none".into())
        );
        for f in &r.failover {
            println!(
                "failover ({}):{:width$}{} {}: {}",
                f.on,
                "",
                f.level,
                f.subject,
                f.text,
                width = 13usize.saturating_sub(f.on.len())
            );
        }
        println!(
            "severity:               {}",
            match r.severity {
                admin::Severity::Healthy => "healthy",
                admin::Severity::Warning => "warning",
                admin::Severity::Critical => "critical",
            }
        );
    }
    for p in &r.problems {
        let level = match p.severity {
            admin::Severity::Critical => "critical",
            _ => "warning",
        };
        eprintln!("{level}: {}", p.message);
    }
    Ok(r.severity as u8)
}

/// `peek`: lists the outbox messages waiting in the slot.
async fn peek(args: pgoutbox::cli::PeekArgs) -> Result<(), Error> {
    validate_identifier("--slot", &args.db.slot)?;
    validate_identifier("--publication", &args.publication)?;
    let schema = args.db.schema()?;
    let mut client = pgoutbox::postgres::connect(&args.db.url.config()?).await?;
    let prefix = admin::resolve_prefix(&client, &schema, None).await?;
    let payloads = if args.payload {
        admin::Payloads::Include
    } else {
        admin::Payloads::Omit
    };
    let report = admin::peek_waiting(
        &mut client,
        &args.db.slot,
        &args.publication,
        &prefix,
        args.limit,
        payloads,
    )
    .await?;
    if args.json {
        println!("{}", serde_json::to_string(&report).unwrap_or_default());
        return Ok(());
    }
    if report.messages.is_empty() {
        println!("no outbox messages waiting in slot {}", args.db.slot);
    }
    for m in &report.messages {
        let e = &m.envelope;
        // Exchange and metadata only when the producer gave them.
        let mut extra = String::new();
        if let Some(x) = &e.exchange {
            extra.push_str(&format!("  exchange={x}"));
        }
        if let Some(meta) = e.metadata.as_ref().filter(|m| !m.is_empty()) {
            extra.push_str(&format!(
                "  metadata={}",
                serde_json::Value::Object(meta.clone())
            ));
        }
        println!(
            "lsn={}  commit_lsn={}  commit_time={}  size={}  topic={}  id={}  headers={}{extra}{}",
            m.lsn,
            m.commit_lsn.as_deref().unwrap_or("-"),
            m.commit_time.as_deref().unwrap_or("-"),
            m.size_bytes,
            e.topic.as_deref().unwrap_or("-"),
            e.message_id.as_deref().unwrap_or("-"),
            e.headers
                .as_ref()
                .map(|h| serde_json::Value::Object(h.clone()).to_string())
                .unwrap_or_else(|| "-".into()),
            e.decode_error
                .as_deref()
                .map(|err| format!("  undecodable: {err}"))
                .unwrap_or_default(),
        );
        match (&e.payload, e.payload_encoding) {
            (Some(p), Some(admin::PayloadEncoding::Base64)) => {
                println!("  payload (base64, not UTF-8): {p}");
            }
            (Some(p), _) => println!("  payload: {p}"),
            (None, _) => {}
        }
    }
    if report.more {
        println!("(more waiting beyond --limit {})", args.limit);
    } else if report.scan_bounded {
        println!("(the scan stopped at its bound of decoded changes; more may wait)");
    }
    Ok(())
}
