//! PostgreSQL failover end to end (issue 33), on real PostgreSQL 17 clusters: a primary and a
//! streaming standby with a physical slot, slot synchronization and
//! `synchronized_standby_slots`; `run` on a multi-host URL while producers emit and write a
//! ledger row in the same transaction; the primary stopped in immediate mode mid-stream, the
//! standby promoted, the old primary rebuilt as a standby of the new one (a copy of its cleanly
//! stopped data directory: the npm builds have no pg_basebackup), and again, back and forth.
//! `run` must go on by itself (no `--accept-gap`), and the queue must hold every ledger row of
//! the last primary's history (0 lost) and nothing else (0 invented).
//!
//! The server is PostgreSQL 17 whatever `PGOUTBOX_TEST_PG` says (failover slots are 17's):
//! the pinned build of `deploy/pg-version.sh 17`. When it cannot be installed the test fails.
//!
//! Sizes: `PGOUTBOX_TEST_FAILOVER_EVENTS` (default 3,000 × `PGOUTBOX_TEST_SCALE`); the issue's
//! target is 10,000.

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::support::{self, scaled, scaled_count, Outbox, Postgres, RabbitMq};

/// The physical slot of the standby, on whichever server is the primary (and listed in
/// `synchronized_standby_slots` on both).
const STANDBY_SLOT: &str = "fo_standby";

/// The bin directory of the pinned PostgreSQL 17 (installed and cached by
/// `deploy/pg-version.sh 17`); panics when it cannot be had.
fn pg17_bin() -> PathBuf {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy/pg-version.sh");
    let out = Command::new("bash")
        .arg(&script)
        .arg("17")
        .stdin(Stdio::null())
        .stderr(Stdio::inherit())
        .output()
        .unwrap_or_else(|e| panic!("spawn {}: {e}", script.display()));
    assert!(
        out.status.success(),
        "PostgreSQL 17 is required for the failover tests and {} 17 failed: {}",
        script.display(),
        out.status
    );
    let bin = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
    assert!(
        bin.join("postgres").exists(),
        "{} has no postgres",
        bin.display()
    );
    bin
}

/// Runs `cmd`, panicking with its stderr when it fails.
fn run_ok(cmd: &mut Command) {
    let out = cmd
        .output()
        .unwrap_or_else(|e| panic!("spawn {cmd:?}: {e}"));
    assert!(
        out.status.success(),
        "{cmd:?} failed: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// One PostgreSQL 17 server of the pair: `root/data`, its log and socket in `root`. Removed
/// (stopped, then its directory) on Drop, and by the harness's watchdog if the test process
/// dies.
struct Node {
    pg: Postgres,
    name: &'static str,
    root: PathBuf,
    port: u16,
}

impl Node {
    /// A new primary, initdb'd with the failover settings.
    fn primary(bin: &Path, name: &'static str) -> Node {
        let node = Node::empty(bin, name);
        let mut init = node.pg.pg_cmd("initdb");
        init.arg("-D").arg(node.data()).args([
            "-U",
            "postgres",
            "--auth=trust",
            "-E",
            "UTF8",
            "--locale=C",
            "--no-sync",
        ]);
        run_ok(&mut init);
        // Shared by both servers (a copy carries it); what differs per server is in node.conf.
        let conf = format!(
            "\n# --- pgoutbox failover test ---\n\
             include_if_exists = 'node.conf'\n\
             listen_addresses = '127.0.0.1'\n\
             wal_level = logical\n\
             max_replication_slots = 16\n\
             max_wal_senders = 16\n\
             max_connections = 100\n\
             fsync = off\n\
             full_page_writes = off\n\
             hot_standby = on\n\
             hot_standby_feedback = on\n\
             sync_replication_slots = on\n\
             synchronized_standby_slots = '{STANDBY_SLOT}'\n\
             wal_sender_timeout = '20s'\n\
             wal_receiver_status_interval = '1s'\n\
             log_line_prefix = '%m [%p] %q%u@%d '\n"
        );
        append(&node.data().join("postgresql.conf"), &conf);
        std::fs::write(
            node.data().join("pg_hba.conf"),
            "local all all trust\nhost all all 127.0.0.1/32 trust\n\
             local replication all trust\nhost replication all 127.0.0.1/32 trust\n",
        )
        .expect("pg_hba.conf");
        node.write_node_conf(None);
        node.pg.start();
        // The roles Postgres::create_database grants to.
        node.psql(
            "postgres",
            "CREATE ROLE pw_md5 LOGIN; CREATE ROLE pw_scram LOGIN; \
             CREATE ROLE pw_cleartext LOGIN; CREATE ROLE norepl LOGIN",
        );
        node
    }

    /// A server directory with no data directory yet.
    fn empty(bin: &Path, name: &'static str) -> Node {
        let root = support::make_server_dir("pgoutbox-fo-");
        let port = support::free_port();
        let pg = Postgres::attach(&format!(
            "root={}\nbin={}\nport={port}\n",
            root.display(),
            bin.display()
        ));
        let pg_ctl = support::sh_quote(&bin.join("pg_ctl").display().to_string());
        let data = support::sh_quote(&root.join("data").display().to_string());
        let runas = if support::is_root() {
            "runuser -u postgres -- "
        } else {
            ""
        };
        std::fs::write(
            root.join("cleanup.sh"),
            format!(
                "[ -e {data}/postmaster.pid ] || exit 0\n\
                 {runas}{pg_ctl} -D {data} -m immediate -w -t 30 stop\ntrue\n"
            ),
        )
        .expect("cleanup.sh");
        support::spawn_watchdog(&root);
        if support::is_root() {
            run_ok(Command::new("chown").arg("-R").arg("postgres:").arg(&root));
        }
        Node {
            pg,
            name,
            root,
            port,
        }
    }

    fn data(&self) -> PathBuf {
        self.root.join("data")
    }

    /// This server's own settings: its port and socket, and as a standby of `primary` (with
    /// `db` for slot synchronization) its primary_conninfo and primary_slot_name.
    fn write_node_conf(&self, standby_of: Option<(&Node, &str)>) {
        let mut conf = format!(
            "port = {}\nunix_socket_directories = '{}'\n",
            self.port,
            self.root.display()
        );
        if let Some((primary, db)) = standby_of {
            conf.push_str(&format!(
                "primary_conninfo = 'host=127.0.0.1 port={} user=postgres dbname={db} application_name={STANDBY_SLOT}'\n\
                 primary_slot_name = '{STANDBY_SLOT}'\n",
                primary.port
            ));
        }
        std::fs::write(self.data().join("node.conf"), conf).expect("node.conf");
        if support::is_root() {
            run_ok(
                Command::new("chown")
                    .arg("postgres:")
                    .arg(self.data().join("node.conf")),
            );
        }
    }

    /// Makes this server a standby of `primary`, which must be stopped cleanly: a copy of
    /// its data directory without its slots, `standby.signal`. Starts neither.
    fn rebuild_as_standby_of(&self, primary: &Node, db: &str) {
        let _ = std::fs::remove_dir_all(self.data());
        run_ok(
            Command::new("cp")
                .arg("-a")
                .arg(primary.data())
                .arg(self.data()),
        );
        let _ = std::fs::remove_file(self.data().join("postmaster.pid"));
        for slot in std::fs::read_dir(self.data().join("pg_replslot")).expect("pg_replslot") {
            let _ = std::fs::remove_dir_all(slot.expect("slot dir").path());
        }
        std::fs::write(self.data().join("standby.signal"), "").expect("standby.signal");
        self.write_node_conf(Some((primary, db)));
        if support::is_root() {
            run_ok(
                Command::new("chown")
                    .arg("-R")
                    .arg("postgres:")
                    .arg(self.data()),
            );
        }
    }

    fn psql(&self, db: &str, sql: &str) -> String {
        self.pg.psql(db, sql).trim().to_owned()
    }

    /// `psql` that may fail (a server going down, a standby): `None` then.
    fn try_psql(&self, db: &str, sql: &str) -> Option<String> {
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.psql(db, sql))).ok()
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        support::cleanup_now(&self.root);
    }
}

fn append(path: &Path, text: &str) {
    use std::io::Write;
    let mut f = std::fs::OpenOptions::new()
        .append(true)
        .open(path)
        .unwrap_or_else(|e| panic!("open {}: {e}", path.display()));
    f.write_all(text.as_bytes()).expect("append");
}

/// Creates the standby's physical slot on `primary` when missing.
fn ensure_standby_slot(primary: &Node) {
    primary.psql(
        "postgres",
        &format!(
            "SELECT pg_create_physical_replication_slot('{STANDBY_SLOT}', true) \
             WHERE NOT EXISTS (SELECT FROM pg_replication_slots WHERE slot_name = '{STANDBY_SLOT}')"
        ),
    );
}

/// Waits until `standby` streams from `primary` and holds a usable copy of `slot` (synced,
/// no longer temporary: only such a copy survives a promotion).
async fn wait_standby_ready(primary: &Node, standby: &Node, db: &str, slot: &str) {
    let t0 = Instant::now();
    let tick = AtomicUsize::new(0);
    let ok = support::wait_until(scaled(Duration::from_secs(180)), || async {
        // The new standby's copy waits until the slot moved past where the standby began:
        // with the producers idle (their budget spent) only pgoutbox's idle flush moves it,
        // after 64 KiB of WAL. A WAL switch and a standby snapshot (FACTS.md) move it on.
        if tick.fetch_add(1, Ordering::SeqCst) % 5 == 4 {
            let _ = primary.try_psql("postgres", "SELECT pg_switch_wal()");
        }
        let _ = primary.try_psql("postgres", "SELECT pg_log_standby_snapshot()");
        // The slotsync worker naps up to 30 s after a round that synchronized nothing (a
        // remote slot that still needs WAL the new standby does not have, until pgoutbox
        // moves it on); a reload wakes it.
        let _ = standby.try_psql("postgres", "SELECT pg_reload_conf()");
        let streaming = primary
            .try_psql(
                "postgres",
                &format!(
                    "SELECT count(*) FROM pg_stat_replication \
                     WHERE application_name = '{STANDBY_SLOT}' AND state = 'streaming'"
                ),
            )
            .is_some_and(|n| n == "1");
        let synced = standby
            .try_psql(
                db,
                &format!(
                    "SELECT synced AND NOT temporary AND invalidation_reason IS NULL \
                     FROM pg_replication_slots WHERE slot_name = '{slot}'"
                ),
            )
            .is_some_and(|v| v == "t");
        if !(streaming && synced) {
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        streaming && synced
    })
    .await;
    assert!(
        ok,
        "{} did not become a standby of {} with slot {slot} synced and persistent\n--- {} log ---\n{}",
        standby.name,
        primary.name,
        standby.name,
        tail(&standby.pg.log_contents(), 30)
    );
    eprintln!(
        "[failover] {} streams from {} with {slot} synced ({:.1?})",
        standby.name,
        primary.name,
        t0.elapsed()
    );
}

fn tail(text: &str, n: usize) -> String {
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

/// What the producers committed (as their COMMIT returned), per phase.
#[derive(Default)]
struct Ledger {
    committed: Mutex<Vec<(usize, String)>>,
    count: AtomicUsize,
}

/// Emits one event per transaction, with its ledger row, `fo-<p>-<n>`, through `url`
/// (multi-host, read-write), until stopped; reconnects after any error (the primary went
/// away) and goes on with the next id (the outcome of a failed COMMIT is the promoted
/// server's to tell).
fn producer(
    url: String,
    p: usize,
    ledger: Arc<Ledger>,
    budget: Arc<Budget>,
    stop: Arc<AtomicBool>,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let mut client: Option<tokio_postgres::Client> = None;
        let mut n = 0u64;
        while !stop.load(Ordering::SeqCst) {
            if ledger.count.load(Ordering::SeqCst) >= budget.allowed() {
                tokio::time::sleep(Duration::from_millis(20)).await;
                continue;
            }
            let c = match &client {
                Some(c) if !c.is_closed() => c,
                _ => match Postgres::client_url(&url).await {
                    Ok(c) => client.insert(c),
                    Err(_) => {
                        tokio::time::sleep(Duration::from_millis(200)).await;
                        continue;
                    }
                },
            };
            n += 1;
            let id = format!("fo-{p}-{n}");
            let sql = format!(
                "BEGIN; INSERT INTO ledger (id) VALUES ('{id}'); \
                 SELECT outbox.emit('failover', '{{\"id\": \"{id}\"}}', '{{}}', '{id}'); COMMIT"
            );
            match c.batch_execute(&sql).await {
                Ok(()) => {
                    let at = budget.phase.load(Ordering::SeqCst);
                    ledger.committed.lock().unwrap().push((at, id));
                    ledger.count.fetch_add(1, Ordering::SeqCst);
                    // At most about 100 transactions a second each: the test acts between
                    // two of them.
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
                Err(_) => {
                    client = None;
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            }
        }
    })
}

/// How many events the producers may have committed (`limit`), raised by the test so that
/// the producers are emitting when a primary dies; and the phase they commit in (0 before the
/// first failover, `p` after the `p`th).
struct Budget {
    phase: AtomicUsize,
    limit: AtomicUsize,
}

impl Budget {
    fn allowed(&self) -> usize {
        self.limit.load(Ordering::SeqCst)
    }

    fn allow(&self, n: usize) {
        self.limit.fetch_max(n, Ordering::SeqCst);
    }
}

/// The process id of `standby`'s WAL receiver.
fn wal_receiver_pid(standby: &Node) -> String {
    let pid = standby.psql("postgres", "SELECT pid FROM pg_stat_wal_receiver");
    assert!(!pid.is_empty(), "{} has no WAL receiver", standby.name);
    pid
}

fn signal(pid: &str, sig: &str) {
    run_ok(Command::new("kill").arg(format!("-{sig}")).arg(pid));
}

fn lsn_of(text: &str) -> u64 {
    support::lsn(text)
}

/// 3 failovers back and forth between two PostgreSQL 17 servers while producers emit, the
/// second with the standby lagging at the moment the primary dies (its WAL receiver stopped:
/// its flushed WAL, which bounds the synced slot, lags, and `synchronized_standby_slots` holds
/// pgoutbox back to it), which before the promoted-server gap rule made `run` refuse with a
/// false gap. `run` goes on by itself each time; every ledger row of the last primary's history
/// is delivered, and nothing else.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failovers_back_and_forth_lose_and_invent_nothing() {
    let t0 = Instant::now();
    let events: usize = std::env::var("PGOUTBOX_TEST_FAILOVER_EVENTS")
        .ok()
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| scaled_count(3_000));
    let failovers = 3usize;
    let bin = pg17_bin();
    let rabbit = RabbitMq::shared();
    let a = Node::primary(&bin, "A");
    assert_eq!(a.pg.major(), 17);
    ensure_standby_slot(&a);
    let ob = Outbox::new(&a.pg, &rabbit.url(), "failover").await;
    let db = ob.db.clone();
    let slot = ob.slot.clone();
    assert_eq!(
        a.psql(
            &db,
            &format!("SELECT failover FROM pg_replication_slots WHERE slot_name = '{slot}'")
        ),
        "t",
        "setup made a failover slot"
    );
    a.psql(&db, "CREATE TABLE ledger (id text PRIMARY KEY)");
    // B: a copy of A stopped cleanly.
    a.pg.stop_fast();
    let b = Node::empty(&bin, "B");
    b.rebuild_as_standby_of(&a, &db);
    a.pg.start();
    b.pg.start();

    let url = |user: &str| {
        format!(
            "postgres://{user}@127.0.0.1:{},127.0.0.1:{}/{db}?target_session_attrs=read-write&connect_timeout=5",
            a.port, b.port
        )
    };
    let run = ob.run_with_url(
        &url(support::fixture::STREAMER_ROLE),
        &["--reconnect-backoff-max-ms", "1000"],
    );
    assert!(
        run.wait_for_log(": streaming slot=", scaled(Duration::from_secs(60)))
            .await,
        "{}",
        run.log()
    );
    let ledger = Arc::new(Ledger::default());
    // The last slice is for after the last failover.
    let slice = events / (failovers + 1);
    // Before the first round: a quarter of a slice, so that the producers are still
    // emitting when the first primary dies half-way through it.
    let budget = Arc::new(Budget {
        phase: AtomicUsize::new(0),
        limit: AtomicUsize::new(slice / 4),
    });
    let stop = Arc::new(AtomicBool::new(false));
    let producers: Vec<_> = (0..4)
        .map(|p| {
            producer(
                url("postgres"),
                p,
                ledger.clone(),
                budget.clone(),
                stop.clone(),
            )
        })
        .collect();
    // The standby's copy of the slot becomes usable once pgoutbox moved the slot past
    // where the standby began.
    wait_standby_ready(&a, &b, &db, &slot).await;

    let (mut primary, mut standby) = (&a, &b);
    let mut promoted_ahead_seen = 0usize;
    for round in 1..=failovers {
        let lagging = round == 2;
        // Mid-stream: the kill comes half-way through this round's slice, the producers
        // still emitting.
        budget.allow(round * slice);
        let quota = (round - 1) * slice + slice / 2;
        let reached = support::wait_until(scaled(Duration::from_secs(300)), || async {
            ledger.count.load(Ordering::SeqCst) >= quota
        })
        .await;
        assert!(
            reached,
            "round {round}: the producers did not reach {quota} events"
        );
        let mut stopped_receiver = None;
        if lagging {
            // The standby stops receiving WAL: the slot can be synced only up to what it
            // flushed, pgoutbox is held there by synchronized_standby_slots, and the record of
            // what pgoutbox reports from now on is WAL the standby never gets.
            let pid = wal_receiver_pid(standby);
            signal(&pid, "STOP");
            stopped_receiver = Some(pid);
            let at = ledger.count.load(Ordering::SeqCst);
            let last_replay: Mutex<Option<(String, Instant)>> = Mutex::new(None);
            let last_seen = Mutex::new(String::new());
            let behind = support::wait_until(scaled(Duration::from_secs(120)), || async {
                let slot_on_standby = standby.try_psql(
                    &db,
                    &format!(
                        "SELECT confirmed_flush_lsn FROM pg_replication_slots WHERE slot_name = '{slot}'"
                    ),
                );
                let record = standby.try_psql(
                    &db,
                    &format!(
                        "SELECT flush_lsn FROM outbox.stream_state WHERE slot_name = '{slot}'"
                    ),
                );
                // Replay stopped for a second: the standby replayed what it flushed (up to
                // the last whole record), so its record is the one the promoted server has.
                let replay = standby.try_psql("postgres", "SELECT pg_last_wal_replay_lsn()");
                let replayed = {
                    let mut last = last_replay.lock().unwrap();
                    match (&*last, replay) {
                        (Some((was, since)), Some(now)) if *was == now => {
                            since.elapsed() >= Duration::from_secs(1)
                        }
                        (_, now) => {
                            *last = now.map(|n| (n, Instant::now()));
                            false
                        }
                    }
                };
                let false_gap = matches!((&slot_on_standby, &record),
                    (Some(s), Some(r)) if !s.is_empty() && !r.is_empty() && lsn_of(s) > lsn_of(r));
                let count = ledger.count.load(Ordering::SeqCst);
                *last_seen.lock().unwrap() = format!(
                    "standby's slot {slot_on_standby:?}, its record {record:?}, replay stopped {replayed}, {} events since the receiver stopped",
                    count - at
                );
                replayed && false_gap && count >= at + slice / 8
            })
            .await;
            assert!(
                behind,
                "round {round}: the standby's synced slot never passed its copy of the record (the false-gap case was not set up): {}\n{}",
                last_seen.lock().unwrap(),
                tail(&run.log(), 40)
            );
            eprintln!(
                "[failover] round {round}: {}'s WAL receiver stopped; synced slot {} ahead of its record {}",
                standby.name,
                standby.psql(&db, &format!("SELECT confirmed_flush_lsn FROM pg_replication_slots WHERE slot_name = '{slot}'")),
                standby.psql(&db, &format!("SELECT flush_lsn FROM outbox.stream_state WHERE slot_name = '{slot}'"))
            );
        }
        budget.phase.store(round, Ordering::SeqCst);
        budget.allow(round * slice + slice / 4);
        let streaming_before = run.log_count(": streaming slot=");
        primary.pg.stop_immediate();
        if stopped_receiver.is_some() {
            // The stopped receiver's socket still holds WAL the kernel took in for it: a
            // restart of the standby drops what it never read, as a cut network would (the
            // synced slot is saved on disk at each update and survives it).
            standby.pg.stop_immediate();
            standby.pg.start();
            let synced = standby.psql(&db, &format!("SELECT confirmed_flush_lsn FROM pg_replication_slots WHERE slot_name = '{slot}'"));
            let record = standby.psql(
                &db,
                &format!("SELECT flush_lsn FROM outbox.stream_state WHERE slot_name = '{slot}'"),
            );
            eprintln!(
                "[failover] round {round}: the standby restarted with synced slot {synced} and record {record}"
            );
            assert!(
                lsn_of(&synced) > lsn_of(&record),
                "round {round}: the restarted standby's synced slot {synced} is not ahead of its record {record}: the false-gap case was not set up"
            );
        }
        standby.psql("postgres", "SELECT pg_promote(true, 120)");
        ensure_standby_slot(standby);
        eprintln!(
            "[failover] round {round}: {} killed, {} promoted (timeline {}) at {:.1?}",
            primary.name,
            standby.name,
            standby.psql(
                "postgres",
                "SELECT ('x' || substr(pg_walfile_name(pg_current_wal_lsn()), 1, 8))::bit(32)::int"
            ),
            t0.elapsed()
        );
        // run reconnects to the promoted server and goes on (no --accept-gap).
        let resumed = support::wait_until(scaled(Duration::from_secs(120)), || async {
            run.log_count(": streaming slot=") > streaming_before || run.try_status().is_some()
        })
        .await;
        assert!(
            resumed && run.try_status().is_none(),
            "round {round}: run did not go on on the promoted server\n{}",
            tail(&run.log(), 60)
        );
        let ahead = run.log_count("its synchronized failover slot begins after");
        if lagging {
            assert!(
                ahead > promoted_ahead_seen,
                "round {round}: the lagging standby's slot was ahead of its record, and run did not say it went on from it\n{}",
                tail(&run.log(), 60)
            );
        }
        promoted_ahead_seen = ahead;
        // The old primary comes back as a standby of the new one (a copy of the new
        // primary's data directory, stopped cleanly for it), so pgoutbox, held by
        // synchronized_standby_slots, goes on.
        standby.pg.stop_fast();
        primary.rebuild_as_standby_of(standby, &db);
        standby.pg.start();
        primary.pg.start();
        std::mem::swap(&mut primary, &mut standby);
        wait_standby_ready(primary, standby, &db, &slot).await;
    }
    budget.allow(events);
    let reached = support::wait_until(scaled(Duration::from_secs(300)), || async {
        ledger.count.load(Ordering::SeqCst) >= events
    })
    .await;
    assert!(reached, "the producers did not reach {events} events");
    stop.store(true, Ordering::SeqCst);
    for p in producers {
        p.await.expect("producer");
    }
    // What the last primary's history holds.
    let rows: HashSet<String> = primary
        .psql(&db, "SELECT id FROM ledger")
        .lines()
        .map(str::to_owned)
        .collect();
    let got = ob.drain(rows.len(), scaled(Duration::from_secs(120))).await;
    let mut seen: HashMap<String, usize> = HashMap::new();
    for m in &got {
        *seen
            .entry(m.message_id.clone().expect("message_id"))
            .or_default() += 1;
    }
    let lost: Vec<&String> = rows.iter().filter(|id| !seen.contains_key(*id)).collect();
    let invented: Vec<&String> = seen.keys().filter(|id| !rows.contains(*id)).collect();
    let duplicates = got.len() - seen.len();
    // Committed on a primary that died before its standby received them: not in the last
    // primary's history (the lagging round must have some).
    let committed = ledger.committed.lock().unwrap().clone();
    let mut gone_per_round = vec![0usize; failovers + 1];
    for (at, id) in &committed {
        if !rows.contains(id) {
            gone_per_round[*at] += 1;
        }
    }
    eprintln!(
        "[failover] {} events committed by producers, {} in the last primary's ledger, {failovers} failovers, {} delivered: {} lost, {} invented, {duplicates} duplicates; committed and absent from the last primary, per phase (before failover 1, 2, 3, after): {:?}; {:.1?}",
        committed.len(),
        rows.len(),
        got.len(),
        lost.len(),
        invented.len(),
        &gone_per_round[..=failovers],
        t0.elapsed()
    );
    let log = run.log();
    assert!(
        lost.is_empty(),
        "lost: {:?}\n{}",
        &lost[..lost.len().min(20)],
        tail(&log, 60)
    );
    assert!(
        invented.is_empty(),
        "invented (no ledger row on the promoted server): {:?}",
        &invented[..invented.len().min(20)]
    );
    assert!(
        gone_per_round[1] > 0,
        "the lagging round lost no transaction from the database's history: the standby did not lag"
    );
    assert!(!log.contains("--accept-gap)"), "{log}");
    run.stop_ok(scaled(Duration::from_secs(60))).await;
}

/// `check` and `status` report what a failover needs, each missing piece with its fix: on
/// the primary, a failover slot without `synchronized_standby_slots` (phantom events: `check`
/// fails, `run` warns at start), a listed physical slot that is missing or not streamed from;
/// on the standby of `--standby-url`, `hot_standby_feedback` off, then (fixed) the slot
/// synchronized and persistent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn check_and_status_name_what_a_failover_needs() {
    let t0 = Instant::now();
    let step = |what: &str| eprintln!("[failover] {what} at {:.1?}", t0.elapsed());
    let bin = pg17_bin();
    let rabbit = RabbitMq::shared();
    let a = Node::primary(&bin, "A");
    let ob = Outbox::new(&a.pg, &rabbit.url(), "fo_check").await;
    let (db, slot) = (ob.db.clone(), ob.slot.clone());
    let check = |standby: Option<&Node>| {
        let mut args = vec![
            "check".to_owned(),
            "--amqp-url".into(),
            rabbit.url(),
            "--publication".into(),
            ob.publication.clone(),
            "--exchange".into(),
            ob.exchange.clone(),
        ];
        if let Some(s) = standby {
            args.extend(["--standby-url".into(), s.pg.url(&db)]);
        }
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let out = ob.cli(&args);
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
        )
    };
    let status = |standby: Option<&Node>| {
        let mut args = vec!["status".to_owned()];
        if let Some(s) = standby {
            args.extend(["--standby-url".into(), s.pg.url(&db)]);
        }
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        String::from_utf8_lossy(&ob.cli(&args).stdout).into_owned()
    };
    let reload = |node: &Node, sql: &str| {
        node.psql("postgres", sql);
        node.psql("postgres", "SELECT pg_reload_conf()");
    };

    // A failover slot with synchronized_standby_slots empty on a server with no standby
    // (no physical slot, no physical walsender): nothing can be promoted, check passes and
    // says what to set before a standby is added (setup makes failover slots by default on
    // 17+, so a lone server must not fail check for it; it did).
    reload(&a, "ALTER SYSTEM SET synchronized_standby_slots = ''");
    let (ok, out) = check(None);
    assert!(ok, "{out}");
    assert!(
        out.contains("ok      synchronized_standby_slots:")
            && out.contains("no standby streams from this server"),
        "{out}"
    );
    // With a standby's physical slot: check fails naming it, run warns.
    ensure_standby_slot(&a);
    let (ok, out) = check(None);
    assert!(!ok, "{out}");
    assert!(
        out.contains("PROBLEM synchronized_standby_slots:")
            && out.contains("phantom events")
            && out.contains("ALTER SYSTEM SET synchronized_standby_slots"),
        "{out}"
    );
    let run = ob.run(&[]);
    assert!(
        run.wait_for_log(": streaming slot=", scaled(Duration::from_secs(60)))
            .await,
        "{}",
        run.log()
    );
    let log = run.log();
    assert!(
        log.contains("WARN") && log.contains("synchronized_standby_slots is empty"),
        "{log}"
    );
    run.stop_ok(scaled(Duration::from_secs(30))).await;

    step("run warned");
    // Listed, but the physical slot is missing: run would stall.
    a.psql(
        "postgres",
        &format!("SELECT pg_drop_replication_slot('{STANDBY_SLOT}')"),
    );
    reload(&a, "ALTER SYSTEM RESET synchronized_standby_slots");
    let (ok, out) = check(None);
    assert!(!ok, "{out}");
    assert!(
        out.contains(&format!("lists \"{STANDBY_SLOT}\", which does not exist"))
            && out.contains("pg_create_physical_replication_slot"),
        "{out}"
    );
    // Present, but no standby streams from it yet: a warning.
    ensure_standby_slot(&a);
    let (ok, out) = check(None);
    assert!(ok, "{out}");
    assert!(out.contains("which no standby streams from"), "{out}");
    assert!(
        status(None).contains("failover (primary):")
            && status(None).contains("which no standby streams from"),
        "{}",
        status(None)
    );

    step("primary side checked");
    // A standby with hot_standby_feedback off.
    a.pg.stop_fast();
    let b = Node::empty(&bin, "B");
    b.rebuild_as_standby_of(&a, &db);
    append(
        &b.data().join("postgresql.auto.conf"),
        "hot_standby_feedback = off\n",
    );
    a.pg.start();
    b.pg.start();
    let (ok, out) = check(Some(&b));
    assert!(!ok, "{out}");
    assert!(
        out.contains("PROBLEM standby hot_standby_feedback:")
            && out.contains("hot_standby_feedback = on"),
        "{out}"
    );
    step("standby's feedback off found");
    // Fixed: with run streaming, the slot is synchronized and made persistent.
    let text = std::fs::read_to_string(b.data().join("postgresql.auto.conf")).unwrap();
    std::fs::write(
        b.data().join("postgresql.auto.conf"),
        text.replace("hot_standby_feedback = off\n", ""),
    )
    .unwrap();
    b.psql("postgres", "SELECT pg_reload_conf()");
    let run = ob.run(&[]);
    assert!(
        run.wait_for_log(": streaming slot=", scaled(Duration::from_secs(60)))
            .await,
        "{}",
        run.log()
    );
    ob.emit("fo_check", "fo-check-1");
    wait_standby_ready(&a, &b, &db, &slot).await;
    step("standby ready");
    let (ok, out) = check(Some(&b));
    assert!(ok, "{out}");
    assert!(
        out.contains("ok      standby hot_standby_feedback: on")
            && out.contains("standby slot on the standby:")
            && out.contains("synchronized, persistent"),
        "{out}"
    );
    let report = status(Some(&b));
    assert!(
        report.contains("failover (standby):") && report.contains("synchronized, persistent"),
        "{report}"
    );
    step("standby side checked");
    run.stop_ok(scaled(Duration::from_secs(30))).await;
    step("run stopped");
}

/// An old primary that comes back writable after a failover (split brain), listed first in
/// the multi-host URL: `run`, which followed the failover to the promoted server (timeline
/// 2), refuses the old one (timeline 1) with a gap naming both timelines and the fix, instead
/// of streaming a history the new primary does not have.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_old_primary_that_comes_back_is_refused() {
    let bin = pg17_bin();
    let rabbit = RabbitMq::shared();
    let a = Node::primary(&bin, "A");
    ensure_standby_slot(&a);
    let ob = Outbox::new(&a.pg, &rabbit.url(), "fo_old").await;
    let (db, slot) = (ob.db.clone(), ob.slot.clone());
    a.pg.stop_fast();
    let b = Node::empty(&bin, "B");
    b.rebuild_as_standby_of(&a, &db);
    a.pg.start();
    b.pg.start();
    let url = format!(
        "postgres://{}@127.0.0.1:{},127.0.0.1:{}/{db}?target_session_attrs=read-write&connect_timeout=5",
        support::fixture::STREAMER_ROLE,
        a.port,
        b.port
    );
    let run = ob.run_with_url(&url, &["--reconnect-backoff-max-ms", "1000"]);
    assert!(
        run.wait_for_log(": streaming slot=", scaled(Duration::from_secs(60)))
            .await,
        "{}",
        run.log()
    );
    ob.emit("fo_old", "fo-old-1");
    wait_standby_ready(&a, &b, &db, &slot).await;
    // A dies, B is promoted, run follows it.
    a.pg.stop_immediate();
    b.psql("postgres", "SELECT pg_promote(true, 120)");
    ensure_standby_slot(&b);
    assert!(
        run.wait_for_log("timeline=2", scaled(Duration::from_secs(120)))
            .await
            && support::wait_until(scaled(Duration::from_secs(60)), || async {
                run.log_count(": streaming slot=") >= 2
            })
            .await,
        "{}",
        tail(&run.log(), 40)
    );
    // The old primary comes back as a primary; the new one goes away for a moment, so run
    // reconnects, to the first writable host: the old primary.
    a.pg.start();
    b.pg.stop_immediate();
    let exited = run.wait_exit(scaled(Duration::from_secs(120))).await;
    let log = run.log();
    assert!(
        exited.is_some_and(|s| !s.success()),
        "run did not stop at the old primary: {exited:?}\n{}",
        tail(&log, 40)
    );
    assert!(
        log.contains("this server is on timeline 1")
            && log.contains("already streamed from timeline 2")
            && log.contains("old primary")
            && log.contains("phantom events"),
        "{}",
        tail(&log, 40)
    );
    eprintln!(
        "[failover] run refused the old primary: {}",
        log.lines()
            .find(|l| l.contains("old primary"))
            .unwrap_or_default()
    );
}
