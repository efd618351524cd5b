//! `pgoutbox check`: what `run` needs, inspected without creating or changing anything.
//!
//! Each finding is `ok` (a value found), a `warning` (printed; `run` works) or a `problem`
//! (`run` would stop), with the fix. Postgres is read over plain SQL with the same checks
//! `run`'s pre-flight makes ([`crate::admin`]); the broker is asked twice, over the
//! publisher's own socket (so `amqps://` and its TLS settings work as in `run`): an AMQP
//! handshake up to `connection.start` for its product and version, then the publisher's
//! connect step with a passive `exchange.declare` (nothing is created).

use std::io::Write as _;
use std::time::Duration;

use amq_protocol::frame::{parse_frame, AMQPFrame};
use amq_protocol::protocol::{connection::AMQPMethod, AMQPClass};
use amq_protocol::types::AMQPValue;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::admin;
use crate::config::{BrokerUrl, RunConfig};
use crate::error::Error;
use crate::publisher::{
    self,
    connection::{self, Declare},
    socket::{self, Endpoint},
};
use crate::report::render_report;

/// How bad a finding is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Severity {
    /// A value found; nothing to do.
    Ok,
    /// `run` works, but an operator should look.
    Warning,
    /// `run` would stop.
    Problem,
}

/// One line of `check`'s report.
#[derive(Debug, Clone)]
pub struct Finding {
    /// How bad.
    pub severity: Severity,
    /// What was looked at, e.g. `wal_level`.
    pub subject: String,
    /// What was found (and, for a warning or problem, the fix).
    pub text: String,
}

fn finding(severity: Severity, subject: &str, text: impl Into<String>) -> Finding {
    Finding {
        severity,
        subject: subject.to_owned(),
        text: text.into(),
    }
}

/// How long each server may take to answer `check`.
const CHECK_TIMEOUT: Duration = Duration::from_secs(10);

/// Inspects both servers for `config` (already validated), and the physical standby of
/// `standby` (`--standby-url`) when given. Never fails: an unreachable server is a problem
/// finding.
pub async fn check(
    config: &RunConfig,
    standby: Option<&crate::config::DatabaseConfig>,
) -> Vec<Finding> {
    let mut out = vec![
        finding(Severity::Ok, "settings", "valid"),
        finding(Severity::Ok, "routing", routing_summary(config)),
    ];
    postgres(config, &mut out).await;
    if let Some(standby) = standby {
        standby_side(standby, &config.postgres.slot, &mut out).await;
    }
    broker(config, &mut out).await;
    out
}

/// What a failover needs on the standby of `--standby-url` ([`admin::failover::on_standby`]).
async fn standby_side(standby: &crate::config::DatabaseConfig, slot: &str, out: &mut Vec<Finding>) {
    let client = match crate::postgres::connect(standby).await {
        Ok(c) => c,
        Err(e) => {
            out.push(finding(Severity::Problem, "standby", report(&e.into())));
            return;
        }
    };
    match admin::failover::on_standby(&client, slot).await {
        Ok(checks) => add_failover(out, "standby ", checks),
        Err(e) => out.push(finding(Severity::Problem, "standby", report(&e))),
    }
}

/// Failover findings as `check`'s: one not met is a problem (a failover would lose or invent
/// events, or `run` stalls), a warning stays one.
fn add_failover(out: &mut Vec<Finding>, prefix: &str, checks: Vec<admin::failover::FailoverCheck>) {
    use admin::failover::Level;
    for c in checks {
        let severity = match c.level {
            Level::Ok => Severity::Ok,
            Level::Warning => Severity::Warning,
            Level::Problem => Severity::Problem,
        };
        out.push(finding(severity, &format!("{prefix}{}", c.subject), c.text));
    }
}

/// What producers may name and how exchanges are declared (docs/src/producers/routing.md).
fn routing_summary(config: &RunConfig) -> String {
    use crate::config::{AllowedExchanges, ExchangeDeclare};
    let allowed = match &config.broker.allowed_exchanges {
        AllowedExchanges::Any => "producers may name any exchange".to_owned(),
        AllowedExchanges::Only(names) if names.is_empty() => {
            "producers may name no exchange but --exchange".to_owned()
        }
        AllowedExchanges::Only(_) => format!(
            "producers may name only {} (--allowed-exchanges) besides --exchange",
            config.broker.allowed_exchanges
        ),
    };
    let declare = match config.broker.exchange_declare {
        ExchangeDeclare::DurableTopic => "declared as durable topic exchanges on first use",
        ExchangeDeclare::Passive => {
            "only checked (--no-declare): a missing one dead-letters its messages as exchange_not_found"
        }
    };
    format!(
        "default exchange {:?}; {allowed}; exchanges {declare}",
        config.broker.exchange
    )
}

fn precondition(out: &mut Vec<Finding>, subject: &str, result: Result<(), Error>) {
    if let Err(e) = result {
        out.push(finding(Severity::Problem, subject, report(&e)));
    }
}

/// The error and its causes on one line, without the `error: ` that `render_report`
/// starts with (the line's tag says it).
fn report(e: &Error) -> String {
    let text = render_report(e);
    text.strip_prefix("error: ")
        .unwrap_or(&text)
        .replace("\n  ", "; ")
}

async fn postgres(config: &RunConfig, out: &mut Vec<Finding>) {
    let client = match crate::postgres::connect(&config.postgres.database).await {
        Ok(c) => c,
        Err(e) => {
            out.push(finding(Severity::Problem, "postgres", report(&e.into())));
            return;
        }
    };
    let row = match client
        .query_one(
            "SELECT current_setting('server_version'),
                    current_setting('server_version_num')::int,
                    current_setting('wal_level'),
                    current_setting('max_replication_slots')::int,
                    (SELECT count(*)::int FROM pg_replication_slots),
                    current_setting('max_wal_senders')::int,
                    (SELECT count(*)::int FROM pg_stat_replication),
                    current_setting('max_slot_wal_keep_size'),
                    current_user::text,
                    (SELECT rolreplication OR rolsuper FROM pg_roles WHERE rolname = current_user)",
            &[],
        )
        .await
    {
        Ok(r) => r,
        Err(e) => {
            let e = Error::sql("reading the server settings", e);
            out.push(finding(Severity::Problem, "postgres", report(&e)));
            return;
        }
    };
    let (version, version_num): (String, i32) = (row.get(0), row.get(1));
    let wal_level: String = row.get(2);
    let (max_slots, used_slots, max_senders, used_senders): (i32, i32, i32, i32) =
        (row.get(3), row.get(4), row.get(5), row.get(6));
    let keep: String = row.get(7);
    let (user, replication): (String, Option<bool>) = (row.get(8), row.get(9));
    out.push(finding(
        if version_num >= 140_000 {
            Severity::Ok
        } else {
            Severity::Problem
        },
        "postgres version",
        if version_num >= 140_000 {
            version
        } else {
            format!("{version}; pgoutbox needs PostgreSQL 14 or newer: upgrade the server")
        },
    ));
    out.push(finding(Severity::Ok, "wal_level", wal_level));
    precondition(out, "wal_level", admin::check_wal_level(&client).await);
    out.push(finding(
        Severity::Ok,
        "max_replication_slots",
        format!("{max_slots} ({used_slots} used)"),
    ));
    out.push(finding(
        Severity::Ok,
        "max_wal_senders",
        format!("{max_senders} ({used_senders} used)"),
    ));
    out.push(finding(
        Severity::Ok,
        "role",
        format!(
            "{user:?}, REPLICATION {}",
            if replication == Some(true) {
                "yes"
            } else {
                "no"
            }
        ),
    ));
    precondition(out, "role", admin::check_replication_role(&client).await);
    // Information (setup --lockdown), unless a lockdown no longer holds: then each
    // weakening is a warning, as in `status`; `run` streams on and logs each as an error
    // (admin::lockdown::weakened_text).
    match admin::lockdown_state(&client).await {
        Ok(state) => out.push(finding(
            if state.weakened.is_empty() {
                Severity::Ok
            } else {
                Severity::Warning
            },
            "lockdown",
            state.describe(),
        )),
        Err(e) => out.push(finding(
            Severity::Ok,
            "lockdown",
            format!("unknown: {}", report(&e)),
        )),
    }
    let slot = &config.postgres.slot;
    match admin::slot_status(&client, slot).await {
        Ok(s) => {
            out.push(finding(
                Severity::Ok,
                "slot",
                format!(
                    "{slot:?} plugin {}, wal_status {}, confirmed_flush_lsn {}, lag {} bytes, {}",
                    s.plugin.as_deref().unwrap_or("(none)"),
                    s.wal_status.as_deref().unwrap_or("-"),
                    s.confirmed_flush_lsn.as_deref().unwrap_or("-"),
                    s.lag_bytes.map(|l| l.to_string()).unwrap_or("-".into()),
                    match (s.active, s.active_pid, &s.holder) {
                        (false, _, _) => "inactive".to_owned(),
                        (true, pid, holder) => format!(
                            "active (pid {}, {})",
                            pid.map(|p| p.to_string()).unwrap_or("?".into()),
                            holder.as_deref().unwrap_or("unknown application")
                        ),
                    }
                ),
            ));
            if s.plugin.as_deref() != Some("pgoutput") {
                out.push(finding(
                    Severity::Problem,
                    "slot",
                    format!("slot {slot:?} does not use pgoutput; pick another --slot, or drop it (SELECT pg_drop_replication_slot('{slot}')) and recreate it with `pgoutbox setup --slot {slot}`"),
                ));
            }
            match s.wal_status.as_deref() {
                Some("lost") => out.push(finding(
                    Severity::Problem,
                    "slot",
                    report(&Error::SlotLost {
                        slot: slot.clone(),
                        confirmed_flush_lsn: s.confirmed_flush_lsn.clone().unwrap_or_default(),
                    }),
                )),
                Some("unreserved") => out.push(finding(
                    Severity::Warning,
                    "slot",
                    format!("slot {slot:?} is unreserved: the WAL it needs is about to be removed; start `pgoutbox run` now, or raise max_slot_wal_keep_size"),
                )),
                _ => {}
            }
            if s.active {
                out.push(finding(
                    Severity::Warning,
                    "slot",
                    "another process holds the slot: `run` waits for it as a standby (--slot-busy-timeout-s)",
                ));
            } else if used_senders >= max_senders {
                out.push(finding(
                    Severity::Problem,
                    "max_wal_senders",
                    format!("all {max_senders} WAL senders are in use, so `run` cannot open its replication connection; raise max_wal_senders and restart PostgreSQL"),
                ));
            }
        }
        Err(e) => {
            let mut text = report(&e);
            if used_slots >= max_slots {
                text.push_str(&format!("; and all {max_slots} replication slots are in use: raise max_replication_slots or drop an unused slot first"));
            }
            out.push(finding(Severity::Problem, "slot", text));
        }
    }
    match admin::failover::on_primary(&client, slot).await {
        Ok(checks) => add_failover(out, "", checks),
        Err(e) => out.push(finding(
            Severity::Warning,
            "synchronized_standby_slots",
            report(&e),
        )),
    }
    let publication = &config.postgres.publication;
    match admin::publication_exists(&client, publication).await {
        Ok(true) => out.push(finding(
            Severity::Ok,
            "publication",
            format!("{publication:?} exists"),
        )),
        Ok(false) => out.push(finding(
            Severity::Problem,
            "publication",
            format!("publication {publication:?} does not exist in this database; run `pgoutbox setup --slot {slot} --publication {publication}` or fix --publication"),
        )),
        Err(e) => out.push(finding(Severity::Problem, "publication", report(&e))),
    }
    match admin::resolve_prefix(
        &client,
        &config.postgres.schema,
        config.postgres.prefix.as_ref(),
    )
    .await
    {
        Ok(prefix) => match admin::outbox_installed(&client, &config.postgres.schema).await {
            Ok(true) => out.push(finding(
                Severity::Ok,
                "outbox",
                format!("schema {}, prefix {prefix}", config.postgres.schema),
            )),
            Ok(false) => out.push(finding(
                Severity::Problem,
                "outbox",
                format!(
                    "schema {schema} holds no pgoutbox outbox ({} or {} is missing): setup has not run in this database; run `pgoutbox setup --slot {slot} --publication {publication}{}` first, or fix --database-url{}",
                    config.postgres.schema.qualify("emit"),
                    config.postgres.schema.qualify("dead_letter"),
                    if config.postgres.schema.is_default() {
                        String::new()
                    } else {
                        format!(" --schema {}", config.postgres.schema)
                    },
                    if config.postgres.schema.is_default() {
                        ""
                    } else {
                        " or --schema"
                    },
                    schema = config.postgres.schema,
                    publication = config.postgres.publication,
                ),
            )),
            Err(e) => out.push(finding(Severity::Problem, "outbox", report(&e))),
        },
        Err(e) => out.push(finding(Severity::Problem, "outbox", report(&e))),
    }
    precondition(
        out,
        "dead letters",
        admin::check_dead_letter_privileges(&client, &config.postgres.schema, slot).await,
    );
    match admin::check_background_privileges(
        &client,
        &config.postgres.schema,
        slot,
        config.observability.journal == crate::config::JournalMode::On,
        config.postgres.retention.idempotency.age().is_some(),
        config.postgres.retention.journal.age().is_some(),
    )
    .await
    {
        Ok(warnings) => {
            for w in warnings {
                out.push(finding(Severity::Warning, "journal and retention", w));
            }
        }
        Err(e) => out.push(finding(
            Severity::Problem,
            "journal and retention",
            report(&e),
        )),
    }
    if keep == "-1" {
        out.push(finding(
            Severity::Warning,
            "max_slot_wal_keep_size",
            "-1 (unlimited): a slot left behind keeps WAL until the disk is full; set a bound, e.g. ALTER SYSTEM SET max_slot_wal_keep_size = '10GB'; SELECT pg_reload_conf()",
        ));
    } else {
        out.push(finding(Severity::Ok, "max_slot_wal_keep_size", keep));
    }
}

/// Checks every `--amqp-url` node. With several, each finding's text starts with the node
/// (URL without its password), and a node that fails while another passes is a warning,
/// not a problem: `run` fails over to the nodes that answer.
async fn broker(config: &RunConfig, out: &mut Vec<Finding>) {
    if config.broker.stream.is_some() {
        for url in &config.broker.amqp_urls {
            stream_node(config, url, out).await;
        }
        return;
    }
    if config.broker.amqp_urls.len() <= 1 {
        for url in &config.broker.amqp_urls {
            broker_node(config, url, out).await;
        }
        return;
    }
    let total = config.broker.amqp_urls.len();
    let mut per_node = Vec::with_capacity(total);
    for url in &config.broker.amqp_urls {
        let mut found = Vec::new();
        broker_node(config, url, &mut found).await;
        per_node.push((url.to_string(), found));
    }
    let healthy = per_node
        .iter()
        .filter(|(_, f)| f.iter().all(|f| f.severity != Severity::Problem))
        .count();
    for (i, (url, found)) in per_node.into_iter().enumerate() {
        for mut f in found {
            f.text = format!("node {} of {total} ({url}): {}", i + 1, f.text);
            if f.severity == Severity::Problem && healthy > 0 {
                f.severity = Severity::Warning;
                f.text.push_str(&format!(
                    " ({healthy} of {total} nodes pass: `run` fails over to those, but this one cannot take over)"
                ));
            }
            out.push(f);
        }
    }
}

/// `run --stream`: the node answers the stream protocol and takes the login, the stream
/// exists (or `run` creates it), and the producer name's stored publishing id.
async fn stream_node(config: &RunConfig, url: &BrokerUrl, out: &mut Vec<Finding>) {
    let Some(settings) = &config.broker.stream else {
        return;
    };
    let shown = url.to_string();
    let accepted = match crate::postgres::connect(&config.postgres.database).await {
        Ok(client) => crate::stream_state::accepted_gap_count(
            &client,
            &config.postgres.schema,
            &config.postgres.slot,
        )
        .await
        .unwrap_or(0),
        Err(_) => 0,
    };
    let producer = config.stream_producer_name(accepted);
    match crate::stream_publisher::inspect(url.expose_secret(), &settings.stream, &producer).await {
        Err(e) => out.push(finding(Severity::Problem, "stream", report(&e.into()))),
        Ok(found) => {
            out.push(finding(
                Severity::Ok,
                "stream node",
                format!("{shown} answers the stream protocol and takes the login"),
            ));
            match (found.exists, found.stored, config.broker.exchange_declare) {
                (false, _, crate::config::ExchangeDeclare::Passive) => out.push(finding(
                    Severity::Problem,
                    "stream",
                    format!("stream {:?} does not exist and run has --no-declare: create it, or drop --no-declare", settings.stream),
                )),
                (false, _, _) => out.push(finding(
                    Severity::Warning,
                    "stream",
                    format!("stream {:?} does not exist yet: run creates it", settings.stream),
                )),
                (true, stored, _) => {
                    let stored = stored.unwrap_or(0);
                    out.push(finding(
                        Severity::Ok,
                        "stream",
                        format!(
                            "stream {:?} exists; producer {producer:?} stored publishing id {stored} (commits up to {})",
                            settings.stream,
                            crate::stream_publisher::ids::commit_lsn_of(stored)
                        ),
                    ));
                }
            }
        }
    }
}

async fn broker_node(config: &RunConfig, amqp_url: &BrokerUrl, out: &mut Vec<Finding>) {
    let endpoint = match Endpoint::parse(amqp_url.expose_secret()) {
        Ok(e) => e,
        Err(e) => {
            out.push(finding(Severity::Problem, "broker", e.to_string()));
            return;
        }
    };
    match tokio::time::timeout(CHECK_TIMEOUT, broker_product(&endpoint)).await {
        Ok(Ok(product)) => out.push(finding(Severity::Ok, "broker version", product)),
        // The login would fail the same way (TCP, TLS, not RabbitMQ): one line says it.
        Ok(Err(e)) => {
            out.push(finding(Severity::Problem, "broker", e));
            return;
        }
        Err(_) => {
            out.push(finding(
                Severity::Problem,
                "broker",
                format!("no AMQP connection.start from {} within {} s; check host and port in --amqp-url (PGOUTBOX_AMQP_URL)", endpoint.address(), CHECK_TIMEOUT.as_secs()),
            ));
            return;
        }
    }
    let exchange = &config.broker.exchange;
    let opened = connection::open(&endpoint, exchange, Declare::Passive, "pgoutbox check");
    match tokio::time::timeout(CHECK_TIMEOUT, opened).await {
        Ok(Ok(opened)) => {
            out.push(finding(
                Severity::Ok,
                "exchange",
                format!("{exchange:?} exists"),
            ));
            let _ = tokio::time::timeout(CHECK_TIMEOUT, opened.close()).await;
        }
        Ok(Err(publisher::Error::Declare { reply_code: 404, .. }))
            if config.broker.exchange_declare == crate::config::ExchangeDeclare::Passive =>
        {
            out.push(finding(
                Severity::Problem,
                "exchange",
                format!("{exchange:?} does not exist, and with --no-declare `run` does not declare it: declare it as a durable topic exchange, or drop --no-declare"),
            ))
        }
        Ok(Err(publisher::Error::Declare { reply_code: 404, .. })) => out.push(finding(
            Severity::Warning,
            "exchange",
            format!("{exchange:?} does not exist: `run` declares it (durable topic) when it starts; bind your queues to it before messages flow, or they are returned as unroutable"),
        )),
        Ok(Err(publisher::Error::Declare {
            reply_code,
            reply_text,
            ..
        })) => out.push(finding(
            Severity::Problem,
            "exchange",
            format!("cannot check exchange {exchange:?}: RabbitMQ answered {reply_code} {reply_text}; give the --amqp-url user configure and write permission on it"),
        )),
        Ok(Err(e)) => out.push(finding(
            Severity::Problem,
            "broker",
            format!("cannot open an AMQP connection: {e}"),
        )),
        Err(_) => out.push(finding(
            Severity::Problem,
            "broker",
            format!(
                "the AMQP login and the passive exchange.declare did not finish within {} s",
                CHECK_TIMEOUT.as_secs()
            ),
        )),
    }
}

/// Connects (TCP, and TLS for `amqps://`), sends the AMQP 0-9-1 protocol header and reads
/// the server's `connection.start` for `product` and `version`; then closes the socket (no
/// login).
async fn broker_product(endpoint: &Endpoint) -> Result<String, String> {
    let address = endpoint.address();
    let mut socket = socket::connect(endpoint).await.map_err(|e| e.to_string())?;
    socket
        .write_all(b"AMQP\x00\x00\x09\x01")
        .await
        .map_err(|e| format!("writing to {address}: {e}"))?;
    socket
        .flush()
        .await
        .map_err(|e| format!("writing to {address}: {e}"))?;
    // connection.start is a few hundred bytes; more than 64 KiB is not an AMQP server.
    let mut buf = Vec::with_capacity(4096);
    loop {
        match parse_frame(&buf[..]) {
            Ok((_, AMQPFrame::Method(_, AMQPClass::Connection(AMQPMethod::Start(start))))) => {
                let text = |key: &str| match start.server_properties.inner().get(key) {
                    Some(AMQPValue::LongString(s)) => s.to_string(),
                    Some(other) => format!("{other:?}"),
                    None => "?".into(),
                };
                return Ok(format!("{} {}", text("product"), text("version")));
            }
            Ok((_, frame)) => {
                return Err(format!(
                    "{address} answered {frame:?}, not connection.start: is it RabbitMQ?"
                ))
            }
            Err(e) if e.is_incomplete() && buf.len() < 65_536 => {}
            Err(_) if endpoint.tls.is_none() && matches!(buf[..], [0x15 | 0x16, 0x03, ..]) => {
                return Err(format!(
                    "{address} answered in TLS: it is a TLS listener; use amqps:// for it, or the plain AMQP port (5672 by default)"
                ))
            }
            Err(_) => return Err(format!("{address} does not speak AMQP 0-9-1: is it RabbitMQ?")),
        }
        let mut chunk = [0u8; 4096];
        let n = socket
            .read(&mut chunk)
            .await
            .map_err(|e| format!("reading from {address}: {e}"))?;
        if n == 0 {
            return Err(format!(
                "{address} closed the connection before connection.start: is it RabbitMQ{}?",
                if endpoint.tls.is_none() {
                    ", or a TLS listener (use amqps://)"
                } else {
                    ""
                }
            ));
        }
        buf.extend_from_slice(&chunk[..n]);
    }
}

/// Prints the findings, one per line, and a summary; returns the number of problems.
pub fn print(findings: &[Finding]) -> usize {
    for f in findings {
        let tag = match f.severity {
            Severity::Ok => "ok     ",
            Severity::Warning => "WARNING",
            Severity::Problem => "PROBLEM",
        };
        // Written, not `println!`: a closed stdout (`check | head -1`) must not panic.
        let _ = writeln!(
            std::io::stdout(),
            "{tag} {:<23} {}",
            format!("{}:", f.subject),
            f.text
        );
    }
    let count = |s| findings.iter().filter(|f| f.severity == s).count();
    let (problems, warnings) = (count(Severity::Problem), count(Severity::Warning));
    let _ = writeln!(
        std::io::stdout(),
        "check: {problems} problem(s), {warnings} warning(s){}",
        if problems > 0 {
            ": `run` would stop, or a failover lose or invent events; fix the problems above"
        } else {
            ": `run` can start"
        }
    );
    problems
}
