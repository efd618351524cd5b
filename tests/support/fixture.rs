//! A provisioned outbox per test: its own database, slot, publication, exchange and queue.

use std::time::Duration;

use super::{declare_bound_queue, drain_queue, unique, Postgres, Received, Streamer};

/// The least-privilege role `run` connects as by default (`setup --create-roles` creates it:
/// LOGIN REPLICATION, not a superuser, and the grants `run` needs). Trust auth in the harness.
pub const STREAMER_ROLE: &str = "pgoutbox_streamer";

/// The producer role `setup --create-roles` creates (NOLOGIN: EXECUTE on the emit helpers).
pub const PRODUCER_ROLE: &str = "pgoutbox_producer";

/// One test's outbox on a given Postgres and RabbitMQ.
pub struct Outbox<'a> {
    /// The cluster.
    pub pg: &'a Postgres,
    /// The database (holds the slot).
    pub db: String,
    /// Slot name.
    pub slot: String,
    /// Publication name.
    pub publication: String,
    /// Exchange name.
    pub exchange: String,
    /// A durable queue bound with `#`.
    pub queue: String,
    /// Broker URL.
    pub amqp_url: String,
}

impl<'a> Outbox<'a> {
    /// Creates the database, runs `pgoutbox setup --create-roles` through the binary (as
    /// the superuser), declares and binds the queue. `run` then connects as
    /// [`STREAMER_ROLE`] unless a test opts out ([`Outbox::run_as_superuser`]).
    pub async fn new(pg: &'a Postgres, amqp_url: &str, name: &str) -> Outbox<'a> {
        let ob = Outbox::new_without_queue(pg, amqp_url, name).await;
        declare_bound_queue(amqp_url, &ob.exchange, &ob.queue, "#").await;
        ob
    }

    /// Like [`Outbox::new`] but declares nothing on the broker: the caller declares
    /// `queue` (a quorum queue, say) and binds it to `exchange`.
    pub async fn new_without_queue(pg: &'a Postgres, amqp_url: &str, name: &str) -> Outbox<'a> {
        let db = pg.create_database(name).await;
        let slot = unique(&format!("{name}_slot"));
        let publication = unique(&format!("{name}_pub"));
        let exchange = unique(&format!("{name}_x"));
        let queue = unique(&format!("{name}_q"));
        let ob = Outbox {
            pg,
            db,
            slot,
            publication,
            exchange,
            queue,
            amqp_url: amqp_url.to_owned(),
        };
        let out = ob.cli(&["setup", "--create-roles", "--publication", &ob.publication]);
        assert!(
            out.status.success(),
            "setup failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        ob
    }

    /// The database URL (TCP, trust, superuser).
    pub fn url(&self) -> String {
        self.pg.url(&self.db)
    }

    /// Runs a `pgoutbox` subcommand with `--database-url` and `--slot` to completion.
    pub fn cli(&self, args: &[&str]) -> std::process::Output {
        let mut full: Vec<String> = args.iter().map(|s| s.to_string()).collect();
        full.extend([
            "--database-url".into(),
            self.url(),
            "--slot".into(),
            self.slot.clone(),
        ]);
        std::process::Command::new(crate::support::cli::bin())
            .args(&full)
            .env("NO_COLOR", "1")
            .env("PGOUTBOX_HTTP_ADDR", "off")
            .output()
            .expect("run pgoutbox")
    }

    /// The database URL of the least-privilege streamer role (TCP, trust).
    pub fn streamer_url(&self) -> String {
        self.pg.url_as(STREAMER_ROLE, "", &self.db)
    }

    /// The database URL of [`STREAMER_ROLE`] through another port on 127.0.0.1 than the
    /// cluster's: a [`super::Proxy`] in front of it, which a test cuts or stalls.
    pub fn streamer_url_via(&self, port: u16) -> String {
        let mut u = url::Url::parse(&self.streamer_url()).expect("streamer URL");
        u.set_port(Some(port)).expect("a port");
        u.to_string()
    }

    /// The sessions `run` holds for this outbox, once a walsender holds the slot (waiting up
    /// to `timeout`; whatever was there at the end when none did): the session holding the
    /// slot first, then every other session of this database named `pgoutbox-…` (the
    /// `application_name` `run` gives its sessions).
    pub async fn run_sessions(&self, timeout: Duration) -> Vec<RunSession> {
        let query = format!(
            "SELECT a.usename, a.backend_type, coalesce(a.application_name, ''), \
                    coalesce(a.pid = s.active_pid, false) AS holds \
             FROM pg_stat_activity a LEFT JOIN pg_replication_slots s ON s.slot_name = '{}' \
             WHERE a.pid = s.active_pid \
                OR (a.datname = current_database() AND starts_with(a.application_name, 'pgoutbox-')) \
             ORDER BY holds DESC, a.pid",
            self.slot
        );
        let mut sessions = Vec::new();
        super::wait_until(timeout, || {
            sessions = self
                .sql(&query)
                .lines()
                .filter_map(|l| {
                    let f: Vec<&str> = l.split('|').collect();
                    let [role, backend_type, application_name, holds] = f[..] else {
                        return None;
                    };
                    Some(RunSession {
                        role: role.to_owned(),
                        backend_type: backend_type.to_owned(),
                        application_name: application_name.to_owned(),
                        holds_slot: holds == "t",
                    })
                })
                .collect();
            let held = sessions.first().is_some_and(|s| s.holds_slot);
            async move { held }
        })
        .await;
        sessions
    }

    /// Asserts that `run` streams this outbox as the least-privilege [`STREAMER_ROLE`], not
    /// as the superuser: the session holding the slot (a walsender), and every other session
    /// of `run` in the database, connected as that role (`pg_stat_activity.usename`). Waits
    /// up to `timeout` for a walsender to hold the slot; `what` names the moment.
    ///
    /// `run`'s SQL sessions carry no `application_name` yet, so today the walsender is what
    /// this sees; they connect with the same `--database-url`, so as the same role.
    pub async fn assert_streams_as_streamer(&self, timeout: Duration, what: &str) {
        let sessions = self.run_sessions(timeout).await;
        assert!(
            sessions
                .first()
                .is_some_and(|s| s.holds_slot && s.backend_type == "walsender"),
            "{what}: no walsender held slot {} within {timeout:?}: {sessions:?}",
            self.slot
        );
        assert!(
            sessions.iter().all(|s| s.role == STREAMER_ROLE),
            "{what}: run must connect as {STREAMER_ROLE}, not as the superuser: {sessions:?}"
        );
        eprintln!("{what}: run streams as {STREAMER_ROLE}: {sessions:?}");
    }

    /// Starts `pgoutbox run` with this outbox's names plus `extra` arguments, connected as
    /// the least-privilege [`STREAMER_ROLE`].
    pub fn run(&self, extra: &[&str]) -> Streamer {
        self.run_with_url(&self.streamer_url(), extra)
    }

    /// Like [`Outbox::run`], connected as the superuser: only for tests that need what the
    /// streamer role may not do.
    pub fn run_as_superuser(&self, extra: &[&str]) -> Streamer {
        self.run_with_url(&self.url(), extra)
    }

    /// Like [`Outbox::run`] with another database URL (auth variants, Unix socket).
    pub fn run_with_url(&self, url: &str, extra: &[&str]) -> Streamer {
        self.run_with_urls(url, &self.amqp_url, extra)
    }

    /// Like [`Outbox::run`] with another broker URL for the streamer (`amqps://`); the
    /// outbox's own URL stays the tests' for queues and consumers.
    pub fn run_with_amqp_url(&self, amqp_url: &str, extra: &[&str]) -> Streamer {
        self.run_with_urls(&self.streamer_url(), amqp_url, extra)
    }

    fn run_with_urls(&self, url: &str, amqp_url: &str, extra: &[&str]) -> Streamer {
        Streamer::spawn(
            &self.run_args(url, amqp_url, extra),
            &[("RUST_LOG", "info,pgoutbox=trace")],
        )
    }

    /// Like [`Outbox::run`] with stderr a pipe nobody reads until the test does (see
    /// [`Streamer::spawn_with_stderr_pipe`]).
    pub fn run_with_stderr_pipe(&self, extra: &[&str]) -> (Streamer, std::process::ChildStderr) {
        Streamer::spawn_with_stderr_pipe(
            &self.run_args(&self.streamer_url(), &self.amqp_url, extra),
            &[("RUST_LOG", "info,pgoutbox=trace")],
        )
    }

    /// The arguments of `run` against this outbox.
    fn run_args(&self, url: &str, amqp_url: &str, extra: &[&str]) -> Vec<String> {
        let mut args: Vec<String> = vec![
            "run".into(),
            "--database-url".into(),
            url.into(),
            "--amqp-url".into(),
            amqp_url.into(),
            "--slot".into(),
            self.slot.clone(),
            "--publication".into(),
            self.publication.clone(),
        ];
        if !extra.contains(&"--exchange") {
            args.extend(["--exchange".into(), self.exchange.clone()]);
        }
        args.extend(extra.iter().map(|s| s.to_string()));
        args
    }

    /// Runs SQL as the superuser in this database.
    pub fn sql(&self, sql: &str) -> String {
        self.pg.psql(&self.db, sql)
    }

    /// The slot's confirmed_flush_lsn as a u64.
    pub fn confirmed_flush(&self) -> u64 {
        let text = self.sql(&format!(
            "SELECT confirmed_flush_lsn - '0/0'::pg_lsn FROM pg_replication_slots WHERE slot_name = '{}'",
            self.slot
        ));
        text.trim().parse::<f64>().expect("confirmed_flush_lsn") as u64
    }

    /// The start LSN of the commit record of the transaction that wrote the logical message
    /// ending at `message_lsn` (what `outbox.emit` and `pg_logical_emit_message` return),
    /// read from the WAL with `pg_walinspect`.
    ///
    /// Postgres skips, when a slot is read again, exactly the transactions whose commit
    /// record starts before the slot's confirmed_flush_lsn (`SnapBuildXactNeedsSkip` on the
    /// commit's start), so a message is not acknowledged while `confirmed_flush() <=` this.
    /// A keepalive may legitimately move the slot up to the message's own end (the walsender
    /// had read that far before it decoded the commit), which is why `< message_lsn` is the
    /// wrong test.
    pub fn commit_start_of(&self, message_lsn: u64) -> u64 {
        self.sql("CREATE EXTENSION IF NOT EXISTS pg_walinspect");
        let text_of = |l: u64| format!("{:X}/{:X}", l >> 32, l & 0xFFFF_FFFF);
        let at = text_of(message_lsn);
        // The message record is small: it starts well within 64 KiB before its end.
        let xid = self.sql(&format!(
            "SELECT xid FROM pg_get_wal_records_info('{}', '{at}') \
             WHERE end_lsn = '{at}' AND resource_manager = 'LogicalMessage'",
            text_of(message_lsn.saturating_sub(1 << 16).max(1))
        ));
        let xid = xid.trim();
        assert!(!xid.is_empty(), "no logical message record ends at {at}");
        // Its commit follows it: read forward a growing stretch at a time (one query over all
        // the WAL written since can take minutes on a busy shared cluster).
        // pg_walinspect reads only flushed WAL, which under synchronous_commit = off (the
        // test clusters) may end short of the commit for a moment.
        let deadline = std::time::Instant::now() + super::scaled(Duration::from_secs(30));
        let (mut from, mut len) = (message_lsn, 1u64 << 20);
        while std::time::Instant::now() < deadline {
            let flushed = lsn(&self.sql("SELECT pg_current_wal_flush_lsn()"));
            if from >= flushed {
                std::thread::sleep(Duration::from_millis(50));
                continue;
            }
            let to = (from + len).min(flushed);
            let text = self.sql(&format!(
                "SELECT min(start_lsn) - '0/0'::pg_lsn FROM pg_get_wal_records_info('{}', '{}') \
                 WHERE resource_manager = 'Transaction' AND record_type LIKE 'COMMIT%' AND xid = {xid}",
                text_of(from),
                text_of(to)
            ));
            if let Ok(commit) = text.trim().parse::<f64>() {
                return commit as u64;
            }
            (from, len) = (to, len * 2);
        }
        panic!("no commit record of xid {xid} after the message ending at {at}")
    }

    /// Whether the message ending at `message_lsn` is still unacknowledged: the slot's
    /// confirmed_flush_lsn is at or before its transaction's commit record
    /// ([`Outbox::commit_start_of`]), so the next session is sent it again.
    pub fn not_acknowledged(&self, message_lsn: u64) -> bool {
        let commit = self.commit_start_of(message_lsn);
        let flush = self.confirmed_flush();
        eprintln!(
            "message ending at {message_lsn:X}: commit record at {commit:X}, slot at {flush:X}"
        );
        flush <= commit
    }

    /// Waits up to `timeout` until the slot's confirmed_flush_lsn is past `lsn` (a message's
    /// LSN: its commit, after it, has been acknowledged); false when it never was.
    pub async fn flushed_past(&self, lsn: u64, timeout: Duration) -> bool {
        super::wait_until(timeout, || async { self.confirmed_flush() > lsn }).await
    }

    /// Waits up to `timeout` until everything committed before this call is at or below the
    /// slot's confirmed_flush_lsn; false when it never was.
    ///
    /// It commits a marker (a transaction holding only a logical message of another prefix,
    /// which the streamer acknowledges without publishing) and waits for the slot to pass it.
    /// Waiting for `pg_current_wal_lsn()` instead is a race: WAL after the last commit
    /// (pgoutbox's own `outbox.stream_state` write, the server's running_xacts, other tests'
    /// WAL on the shared cluster) is acknowledged only once it exceeds the record's slack, so
    /// such a wait passes or fails by which write came first.
    pub async fn settled_through_now(&self, timeout: Duration) -> bool {
        let marker = lsn(&self.sql(
            "SELECT pg_logical_emit_message(true, 'pgoutbox-test-marker', 'settled through now')",
        ));
        self.flushed_past(marker, timeout).await
    }

    /// Emits one message in its own transaction (`outbox.emit(topic, '{}', '{}', id)`, as
    /// the superuser) and returns its LSN.
    pub fn emit(&self, topic: &str, id: &str) -> u64 {
        lsn(&self.sql(&format!(
            "SELECT outbox.emit('{topic}', '{{}}', '{{}}', '{id}')"
        )))
    }

    /// `pg_wal_lsn_diff(pg_current_wal_lsn(), confirmed_flush_lsn)` for the slot.
    pub fn lag_bytes(&self) -> i64 {
        let text = self.sql(&format!(
            "SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), confirmed_flush_lsn)::bigint FROM pg_replication_slots WHERE slot_name = '{}'",
            self.slot
        ));
        text.trim().parse().expect("lag")
    }

    /// Whether a walsender holds the slot.
    pub fn slot_active(&self) -> bool {
        self.sql(&format!(
            "SELECT active FROM pg_replication_slots WHERE slot_name = '{}'",
            self.slot
        ))
        .trim()
            == "t"
    }

    /// Drains the queue until `expected` messages arrived or `idle` passed without one.
    pub async fn drain(&self, expected: usize, idle: Duration) -> Vec<Received> {
        drain_queue(&self.amqp_url, &self.queue, expected, idle).await
    }
}

/// Parses an `X/Y` LSN into a u64.
pub fn lsn(text: &str) -> u64 {
    let (hi, lo) = text.trim().split_once('/').expect("X/Y");
    (u64::from_str_radix(hi, 16).expect("hex") << 32) | u64::from_str_radix(lo, 16).expect("hex")
}

/// One session of `run` in `pg_stat_activity` ([`Outbox::run_sessions`]).
#[derive(Debug, Clone)]
pub struct RunSession {
    /// `usename`: the role the session connected as.
    pub role: String,
    /// `backend_type` (`walsender` for the replication connection).
    pub backend_type: String,
    /// `application_name` (`pgoutbox-<instance id>` for `run`'s sessions).
    pub application_name: String,
    /// Whether this session is the slot's `active_pid`.
    pub holds_slot: bool,
}
