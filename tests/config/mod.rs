//! `--config FILE` (precedence flag > env > file > default, errors naming the key and the
//! file) and `pgoutbox check` (read-only inspection of both servers) against real servers.

use std::process::Output;
use std::time::Duration;

use crate::support::cli::pgoutbox_env;
use crate::support::{scaled, unique, wait_until, Outbox, Postgres, RabbitMq, Streamer};

fn text(out: &Output) -> String {
    format!(
        "exit {:?}\n--- stdout\n{}--- stderr\n{}",
        out.status.code(),
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// A config file in its own temporary directory (removed on drop).
struct ConfigFile {
    _dir: tempfile::TempDir,
    path: String,
}

impl ConfigFile {
    fn new(contents: &str) -> ConfigFile {
        let dir = tempfile::tempdir().expect("temp dir");
        let path = dir.path().join("pgoutbox.toml");
        std::fs::write(&path, contents).expect("write config");
        ConfigFile {
            path: path.to_str().expect("utf-8 path").to_owned(),
            _dir: dir,
        }
    }
}

/// `run` takes everything from the file (both URLs, names, the window), an environment
/// variable beats the file, a flag beats both; the streaming log line shows the result and
/// a message emitted afterwards is delivered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn run_takes_the_file_below_env_and_flags() {
    let pg = Postgres::shared();
    let ob = Outbox::new(pg, &RabbitMq::shared().url(), "cfg_run").await;
    let file = ConfigFile::new(&format!(
        "# every connection setting from the file\n\
         database_url = \"{}\"\n\
         amqp_url = \"{}\"\n\
         slot = \"{}\"\n\
         publication = \"{}\"\n\
         exchange = \"{}\"\n\
         max_in_flight = 111\n\
         max_in_flight_bytes = 2222\n",
        ob.streamer_url(),
        ob.amqp_url,
        ob.slot,
        ob.publication,
        ob.exchange
    ));
    let run = Streamer::spawn(
        &["run", "--config", &file.path, "--max-in-flight", "333"],
        &[
            ("PGOUTBOX_MAX_IN_FLIGHT", "222"),
            ("PGOUTBOX_MAX_IN_FLIGHT_BYTES", "3333"),
        ],
    );
    // Until it streams, or exits (an older binary refuses --config at once).
    wait_until(scaled(Duration::from_secs(60)), || async {
        run.log().contains("streaming") || run.try_status().is_some()
    })
    .await;
    assert!(
        run.log().contains("streaming"),
        "no streaming line: {}",
        run.log()
    );
    let log = run.log();
    let line = log
        .lines()
        .find(|l| l.contains("streaming"))
        .expect("streaming line");
    println!("{line}");
    assert!(
        line.contains(&format!("slot={}", ob.slot)),
        "slot from the file: {line}"
    );
    assert!(
        line.contains("max_in_flight=333"),
        "the flag beats env and file: {line}"
    );
    assert!(
        line.contains("max_in_flight_bytes=3333"),
        "the variable beats the file: {line}"
    );
    ob.sql("SELECT outbox.emit('cfg.run', '{\"n\": 1}')");
    let got = ob.drain(1, scaled(Duration::from_secs(20))).await;
    assert_eq!(
        got.len(),
        1,
        "delivered with the file's URLs: {}",
        run.log()
    );
}

/// Through `check`'s output: the slot comes from the file, then the variable, then the
/// flag. With everything right `check` exits 0 and prints what it found.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn check_reports_a_healthy_setup_and_the_winning_setting() {
    let pg = Postgres::shared();
    let ob = Outbox::new(pg, &RabbitMq::shared().url(), "cfg_check").await;
    let file = ConfigFile::new(&format!(
        "database_url = \"{}\"\namqp_url = \"{}\"\nslot = \"{}\"\npublication = \"{}\"\nexchange = \"{}\"\n",
        ob.url(),
        ob.amqp_url,
        ob.slot,
        ob.publication,
        ob.exchange
    ));
    let slots_before =
        ob.sql("SELECT count(*) FROM pg_replication_slots WHERE database = current_database()");
    let out = pgoutbox_env(&["check", "--config", &file.path], &[]);
    let all = text(&out);
    println!("{all}");
    assert_eq!(out.status.code(), Some(0), "{all}");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let version = format!("postgres version:       {}", pg.major());
    for want in [
        version.as_str(),
        "wal_level:              logical",
        "max_replication_slots:  512 (",
        "max_wal_senders:",
        "REPLICATION yes",
        &format!(
            "slot:                   \"{}\" plugin pgoutput, wal_status reserved",
            ob.slot
        ),
        &format!("publication:            \"{}\" exists", ob.publication),
        "max_slot_wal_keep_size:",
        "broker version:         RabbitMQ 3.",
        &format!("exchange:               \"{}\" exists", ob.exchange),
        "check: 0 problem(s)",
    ] {
        assert!(stdout.contains(want), "{want:?} in\n{all}");
    }

    // The variable beats the file, the flag beats both; `check` names the slot it looked at.
    let env_slot = unique("cfg_env_slot");
    let flag_slot = unique("cfg_flag_slot");
    let out = pgoutbox_env(
        &["check", "--config", &file.path],
        &[("PGOUTBOX_SLOT", &env_slot)],
    );
    let all = text(&out);
    assert!(
        all.contains(&format!("replication slot {env_slot:?} does not exist")),
        "{all}"
    );
    assert_eq!(
        out.status.code(),
        Some(1),
        "a missing slot stops run: {all}"
    );
    let out = pgoutbox_env(
        &["check", "--config", &file.path, "--slot", &flag_slot],
        &[("PGOUTBOX_SLOT", &env_slot)],
    );
    let all = text(&out);
    println!("{all}");
    assert!(
        all.contains(&format!("replication slot {flag_slot:?} does not exist"))
            && all.contains(&format!("pgoutbox setup --slot {flag_slot}"))
            && !all.contains(&env_slot),
        "{all}"
    );
    assert_eq!(out.status.code(), Some(1), "{all}");

    // A missing exchange is a warning (run declares it); check declares nothing.
    let missing_x = unique("cfg_missing_x");
    for _ in 0..2 {
        let out = pgoutbox_env(
            &["check", "--config", &file.path, "--exchange", &missing_x],
            &[],
        );
        let all = text(&out);
        assert!(
            all.contains(&format!(
                "WARNING exchange:               \"{missing_x}\" does not exist: `run` declares it"
            )),
            "{all}"
        );
        assert_eq!(out.status.code(), Some(0), "{all}");
    }
    assert_eq!(
        ob.sql("SELECT count(*) FROM pg_replication_slots WHERE database = current_database()"),
        slots_before,
        "check created no slot"
    );
}

/// An unknown key, a value of the wrong type and a value out of range each fail at
/// startup (exit 2) naming the key and the file.
#[test]
fn bad_config_files_name_the_key_and_the_file() {
    let cases = [
        ("slot = \"s\"\nmax_inflight = 5\n", "unknown key \"max_inflight\" (line 2)"),
        (
            "max_in_flight = \"many\"\n",
            "key \"max_in_flight\" (line 1): invalid type: string \"many\"",
        ),
        ("on_unroutable = \"drop\"\n", "key \"on_unroutable\" (line 1)"),
        (
            "database_url = \"postgres://u@127.0.0.1:1/db\"\namqp_url = \"amqp://127.0.0.1:1\"\nmax_in_flight = 0\n",
            "the value comes from max_in_flight in config file",
        ),
    ];
    for sub in ["run", "check"] {
        for (contents, want) in cases {
            let file = ConfigFile::new(contents);
            let out = pgoutbox_env(&[sub, "--config", &file.path], &[]);
            let all = text(&out);
            println!("{sub}: {all}");
            assert_eq!(out.status.code(), Some(2), "{all}");
            let stderr = String::from_utf8_lossy(&out.stderr);
            assert!(
                stderr.contains(want) && stderr.contains(&file.path),
                "{want:?} and {} in\n{all}",
                file.path
            );
        }
        // PGOUTBOX_CONFIG names the file too.
        let file = ConfigFile::new("slott = \"s\"\n");
        let out = pgoutbox_env(&[sub], &[("PGOUTBOX_CONFIG", &file.path)]);
        let all = text(&out);
        assert_eq!(out.status.code(), Some(2), "{all}");
        assert!(all.contains("unknown key \"slott\""), "{all}");
    }
}

/// `wal_level = replica`: check names the setting and the fix, and exits 1.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn check_names_the_fix_for_wal_level_replica() {
    let pg = Postgres::start_private(&[("wal_level", "replica")]);
    let db = pg.create_database("cfg_replica").await;
    let url = pg.url(&db);
    let amqp = RabbitMq::shared().url();
    let out = pgoutbox_env(&["check", "--database-url", &url, "--amqp-url", &amqp], &[]);
    let all = text(&out);
    println!("{all}");
    assert_eq!(out.status.code(), Some(1), "{all}");
    assert!(
        all.contains("wal_level:              replica")
            && all.contains("PROBLEM wal_level:")
            && all.contains("set wal_level = logical in postgresql.conf"),
        "{all}"
    );
}

/// A role without `REPLICATION`: check names the `ALTER ROLE` and exits 1.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn check_names_the_fix_for_a_role_without_replication() {
    let pg = Postgres::shared();
    let ob = Outbox::new(pg, &RabbitMq::shared().url(), "cfg_norepl").await;
    let url = pg.url_as("norepl", "", &ob.db);
    let out = pgoutbox_env(
        &[
            "check",
            "--database-url",
            &url,
            "--amqp-url",
            &ob.amqp_url,
            "--slot",
            &ob.slot,
            "--publication",
            &ob.publication,
            "--exchange",
            &ob.exchange,
        ],
        &[],
    );
    let all = text(&out);
    println!("{all}");
    assert_eq!(out.status.code(), Some(1), "{all}");
    assert!(
        all.contains("\"norepl\", REPLICATION no")
            && all.contains("PROBLEM role:")
            && all.contains("ALTER ROLE \"norepl\" REPLICATION"),
        "{all}"
    );
}

/// Issue 32, item 8: before `setup`, check printed `ok outbox` for a schema that does not
/// exist. The outbox line is a problem naming the missing schema and `setup`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn check_before_setup_says_the_outbox_is_missing() {
    let pg = Postgres::shared();
    let db = pg.create_database("cfg_no_setup").await;
    let url = pg.url(&db);
    let amqp = RabbitMq::shared().url();
    for schema in [None, Some("billing")] {
        let mut args = vec!["check", "--database-url", &url, "--amqp-url", &amqp];
        if let Some(s) = schema {
            args.extend(["--schema", s]);
        }
        let out = pgoutbox_env(&args, &[]);
        let all = text(&out);
        println!("{all}");
        assert_eq!(out.status.code(), Some(1), "{all}");
        let outbox: Vec<&str> = all.lines().filter(|l| l.contains("outbox:")).collect();
        assert!(
            outbox.iter().all(|l| !l.trim_start().starts_with("ok")),
            "an outbox that does not exist is not ok:\n{all}"
        );
        assert!(
            outbox
                .iter()
                .any(|l| l.contains("PROBLEM outbox:") && l.contains("pgoutbox setup")),
            "the problem names setup:\n{all}"
        );
    }
}
