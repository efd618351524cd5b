//! Issue 8, "Secrets": the connection strings from files, the passwords alone from files,
//! the warning for a password on the command line, and a distinctive password that appears
//! nowhere: not in stdout or stderr of setup, status --json, check and run (passing and
//! failing), not in the streamer's log, its /metrics, or RabbitMQ's record of the connection
//! (`list_connections name client_properties`).
//!
//! Real password authentication: a private PostgreSQL whose `pw_scram` role gets the test
//! password (SCRAM), and a RabbitMQ user of the shared broker created for this test.

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::Output;
use std::time::Duration;

use crate::support::cli::pgoutbox_env;
use crate::support::{
    declare_bound_queue, drain_queue, free_port, scaled, unique, Postgres, RabbitMq, Streamer,
};

/// The part of every test password that must never be shown (each password below
/// contains it, and characters a URL must percent-encode).
const MARK: &str = "Sekr1tXq9";
const PG_PASSWORD: &str = "Sekr1tXq9-pg@ss/w:rd?#";
const AMQP_PASSWORD: &str = "Sekr1tXq9-mq@ss/w:rd%";
const WRONG_PASSWORD: &str = "Sekr1tXq9-wrong";

fn text(out: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// An HTTP GET of `path` on 127.0.0.1:`port`: the body of a 200, else None.
fn http_get(port: u16, path: &str) -> Option<String> {
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    )
    .ok()?;
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).ok()?;
    let text = String::from_utf8_lossy(&raw).into_owned();
    (text.split(' ').nth(1)? == "200").then(|| {
        text.split_once("\r\n\r\n")
            .map(|(_, b)| b.to_owned())
            .unwrap_or_default()
    })
}

fn url_with(base: &str, user: &str, password: &str) -> String {
    let mut u = url::Url::parse(base).unwrap();
    u.set_username(user).unwrap();
    u.set_password((!password.is_empty()).then_some(password))
        .unwrap();
    u.to_string()
}

fn write_file(dir: &Path, name: &str, content: &str) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, content).unwrap();
    p
}

/// Every place we collected: (where, what it said).
struct Seen(Vec<(String, String)>);

impl Seen {
    fn add(&mut self, what: impl Into<String>, text: impl Into<String>) {
        self.0.push((what.into(), text.into()));
    }

    fn assert_clean(&self) {
        let mut checked = 0;
        for (what, text) in &self.0 {
            assert!(
                !text.contains(MARK),
                "the test password appears in {what}:\n{text}"
            );
            checked += text.len();
        }
        println!("{} outputs, {checked} bytes: no password", self.0.len());
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn passwords_from_argv_env_and_files_appear_nowhere() {
    let pg = Postgres::start_private(&[]);
    let rabbit = RabbitMq::shared();
    let db = "secrets";
    pg.psql(
        "postgres",
        &format!(
            "ALTER ROLE pw_scram PASSWORD '{}'",
            PG_PASSWORD.replace('\'', "''")
        ),
    );
    pg.psql("postgres", &format!("CREATE DATABASE {db} OWNER pw_scram"));
    let amqp_user = unique("secrets_user");
    rabbit.ctl_ok(&["add_user", &amqp_user, AMQP_PASSWORD]);
    rabbit.ctl_ok(&["set_permissions", "-p", "/", &amqp_user, ".*", ".*", ".*"]);
    let slot = unique("secrets_slot");
    let publication = unique("secrets_pub");
    let exchange = unique("secrets_x");
    let queue = unique("secrets_q");
    let pg_base = format!("postgres://127.0.0.1:{}/{db}", pg.port());
    let pg_url = url_with(&pg_base, "pw_scram", PG_PASSWORD);
    let pg_url_nopw = url_with(&pg_base, "pw_scram", "");
    let pg_url_wrong = url_with(&pg_base, "pw_scram", WRONG_PASSWORD);
    let amqp_base = rabbit.url();
    let amqp_url = url_with(&amqp_base, &amqp_user, AMQP_PASSWORD);
    let amqp_url_nopw = url_with(&amqp_base, &amqp_user, "");
    let amqp_url_wrong = url_with(&amqp_base, &amqp_user, WRONG_PASSWORD);
    let dir = tempfile::tempdir().unwrap();
    let pg_url_file = write_file(dir.path(), "pg_url", &format!("{pg_url}\n"));
    let amqp_url_file = write_file(dir.path(), "amqp_url", &format!("{amqp_url}\n"));
    let pg_pw_file = write_file(dir.path(), "pg_pw", &format!("{PG_PASSWORD}\n"));
    let amqp_pw_file = write_file(dir.path(), "amqp_pw", &format!("{AMQP_PASSWORD}\n"));
    let p = |p: &PathBuf| p.display().to_string();
    let mut seen = Seen(Vec::new());
    let names = ["--slot", &slot, "--publication", &publication];

    // setup, the URL on the command line (real SCRAM with the password).
    let out = pgoutbox_env(
        &[&["setup", "--database-url", &pg_url][..], &names].concat(),
        &[],
    );
    assert!(out.status.success(), "setup: {}", text(&out));
    seen.add("setup (argv)", text(&out));
    declare_bound_queue(&rabbit.url(), &exchange, &queue, "#").await;

    // status --json, the URL from PGOUTBOX_DATABASE_URL.
    let out = pgoutbox_env(
        &[&["status", "--json"][..], &names].concat(),
        &[("PGOUTBOX_DATABASE_URL", &pg_url)],
    );
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("\"slot_exists\":true"),
        "status: {}",
        text(&out)
    );
    seen.add("status --json (env)", text(&out));

    // check, both URLs from files (flag and variable).
    let out = pgoutbox_env(
        &[
            &[
                "check",
                "--database-url-file",
                &p(&pg_url_file),
                "--exchange",
                &exchange,
            ][..],
            &names,
        ]
        .concat(),
        &[("PGOUTBOX_AMQP_URL_FILE", &p(&amqp_url_file))],
    );
    assert_eq!(out.status.code(), Some(0), "check: {}", text(&out));
    seen.add("check (url files)", text(&out));

    // status with the password alone from a file.
    let out = pgoutbox_env(
        &[
            &["status", "--json", "--database-url", &pg_url_nopw][..],
            &names,
        ]
        .concat(),
        &[("PGOUTBOX_DATABASE_PASSWORD_FILE", &p(&pg_pw_file))],
    );
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("\"slot_exists\":true"),
        "status with a password file: {}",
        text(&out)
    );
    seen.add("status --json (password file)", text(&out));

    // Failing cases: a wrong password, a wrong port, a wrong broker password, an
    // unreadable file, the URL given twice.
    let out = pgoutbox_env(
        &[
            &["status", "--json", "--database-url", &pg_url_wrong][..],
            &names,
        ]
        .concat(),
        &[],
    );
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));
    assert!(
        text(&out).contains("password authentication failed"),
        "{}",
        text(&out)
    );
    seen.add("status (wrong password)", text(&out));
    let dead_port = free_port();
    let pg_url_dead = pg_url.replace(&format!(":{}/", pg.port()), &format!(":{dead_port}/"));
    assert_ne!(pg_url_dead, pg_url);
    let out = pgoutbox_env(
        &[&["setup", "--database-url", &pg_url_dead][..], &names].concat(),
        &[],
    );
    assert!(!out.status.success(), "{}", text(&out));
    seen.add("setup (wrong port)", text(&out));
    let amqp_url_dead =
        amqp_url.replace(&format!(":{}/", rabbit.port()), &format!(":{dead_port}/"));
    assert_ne!(amqp_url_dead, amqp_url);
    for (what, broker) in [
        ("wrong password", &amqp_url_wrong),
        ("wrong port", &amqp_url_dead),
    ] {
        let out = pgoutbox_env(
            &[
                &[
                    "check",
                    "--database-url",
                    &pg_url,
                    "--amqp-url",
                    broker,
                    "--exchange",
                    &exchange,
                ][..],
                &names,
            ]
            .concat(),
            &[],
        );
        assert_eq!(out.status.code(), Some(1), "check ({what}): {}", text(&out));
        assert!(text(&out).contains("RabbitMQ"), "{}", text(&out));
        seen.add(format!("check (broker {what})"), text(&out));
    }
    let out = pgoutbox_env(
        &[
            &["setup", "--database-url-file", "/nonexistent/pg_url"][..],
            &names,
        ]
        .concat(),
        &[],
    );
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));
    assert!(
        text(&out).contains(
            "invalid setting --database-url-file (PGOUTBOX_DATABASE_URL_FILE) = \"/nonexistent/pg_url\": cannot read the file"
        ),
        "{}",
        text(&out)
    );
    let out = pgoutbox_env(
        &[
            &[
                "status",
                "--database-url",
                &pg_url,
                "--database-url-file",
                &p(&pg_url_file),
            ][..],
            &names,
        ]
        .concat(),
        &[],
    );
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));
    assert!(
        text(&out).contains("--database-url is given too"),
        "{}",
        text(&out)
    );
    seen.add("status (url twice)", text(&out));

    // run with both passwords on the command line: it warns (naming the flags, not the
    // passwords), streams, and shows no password in its log, metrics or connection name.
    pg.psql(
        db,
        "SELECT outbox.emit('secrets.one', '{\"n\": 1}', '{}', 'secret-1')",
    );
    let http_port = free_port();
    let http_addr = format!("127.0.0.1:{http_port}");
    let run_args = |db_url: &str, broker: &str| -> Vec<String> {
        [
            "run",
            "--database-url",
            db_url,
            "--amqp-url",
            broker,
            "--exchange",
            &exchange,
            "--instance-id",
            "secrets-argv",
            "--http-addr",
            &http_addr,
        ]
        .iter()
        .chain(names.iter())
        .map(|s| s.to_string())
        .collect()
    };
    let streamer = Streamer::spawn(&run_args(&pg_url, &amqp_url), &[] as &[(&str, &str)]);
    let got = drain_queue(&rabbit.url(), &queue, 1, scaled(Duration::from_secs(30))).await;
    assert_eq!(got.len(), 1, "{}", streamer.log());
    assert!(
        streamer
            .log()
            .contains("a password was given on the command line (--database-url, --amqp-url)"),
        "{}",
        streamer.log()
    );
    let metrics = http_get(http_port, "/metrics").expect("scrape /metrics");
    assert!(metrics.contains("pgoutbox_"), "{metrics}");
    seen.add("/metrics", metrics);
    let connections = rabbit.ctl_ok(&[
        "-q",
        "list_connections",
        "name",
        "user",
        "client_properties",
    ]);
    let ours = connections
        .lines()
        .find(|l| l.contains(&amqp_user))
        .unwrap_or_else(|| panic!("no connection of {amqp_user}:\n{connections}"))
        .to_owned();
    assert!(ours.contains("pgoutbox secrets-argv"), "{ours}");
    seen.add("rabbitmqctl list_connections", connections);
    streamer.sigterm();
    let status = streamer.wait_exit(scaled(Duration::from_secs(30))).await;
    assert_eq!(status.and_then(|s| s.code()), Some(0), "{}", streamer.log());
    seen.add("run (argv) log", streamer.log());

    // run with the passwords alone from files (variables): no warning, it streams.
    pg.psql(
        db,
        "SELECT outbox.emit('secrets.two', '{\"n\": 2}', '{}', 'secret-2')",
    );
    let streamer = Streamer::spawn(
        &run_args(&pg_url_nopw, &amqp_url_nopw),
        &[
            ("PGOUTBOX_DATABASE_PASSWORD_FILE", p(&pg_pw_file).as_str()),
            ("PGOUTBOX_AMQP_PASSWORD_FILE", p(&amqp_pw_file).as_str()),
        ],
    );
    let got = drain_queue(&rabbit.url(), &queue, 1, scaled(Duration::from_secs(30))).await;
    assert_eq!(
        got.first().and_then(|m| m.message_id.as_deref()),
        Some("secret-2"),
        "{}",
        streamer.log()
    );
    assert!(
        !streamer.log().contains("on the command line"),
        "{}",
        streamer.log()
    );
    streamer.sigterm();
    let status = streamer.wait_exit(scaled(Duration::from_secs(30))).await;
    assert_eq!(status.and_then(|s| s.code()), Some(0), "{}", streamer.log());
    seen.add("run (password files) log", streamer.log());

    // run against a broker that refuses the password, and a database that refuses its:
    // both retry, and say why without the password.
    for (what, db_url, broker, expect) in [
        (
            "broker password",
            pg_url.as_str(),
            amqp_url_wrong.as_str(),
            "403",
        ),
        (
            "database password",
            pg_url_wrong.as_str(),
            amqp_url.as_str(),
            "password authentication failed",
        ),
    ] {
        let streamer = Streamer::spawn(&run_args(db_url, broker), &[] as &[(&str, &str)]);
        let failed = streamer
            .wait_for_log(expect, scaled(Duration::from_secs(30)))
            .await;
        streamer.sigterm();
        let _ = streamer.wait_exit(scaled(Duration::from_secs(30))).await;
        assert!(
            failed,
            "run ({what}) never said {expect:?}:\n{}",
            streamer.log()
        );
        seen.add(format!("run ({what}) log"), streamer.log());
    }
    seen.add(
        "rabbitmqctl list_connections (end)",
        rabbit.ctl_ok(&["-q", "list_connections", "name", "client_properties"]),
    );
    rabbit.ctl_ok(&["delete_user", &amqp_user]);
    seen.assert_clean();
}

/// Issue 21, item 14: a malformed URL (`amqp//`, `amqp:/`, no scheme, `postgres//`, a typo
/// in the second URL of a comma-separated list) is a usage error (exit 2) that never shows
/// the password, in text or JSON logs, from `run` or `check`, and is never sent anywhere
/// (the glued-on second URL is refused rather than becoming part of a vhost). No server is
/// needed: these fail before connecting.
#[test]
fn malformed_urls_are_usage_errors_that_never_show_the_password() {
    let pw = MARK;
    let good_pg = "postgres://pgoutbox_streamer@127.0.0.1:1/db";
    let good_amqp = "amqp://guest:guest@127.0.0.1:1/%2f";
    let bad_amqp = [
        format!("amqp//u:{pw}@127.0.0.1:5672/%2f"),
        format!("amqp:/u:{pw}@127.0.0.1:5672/%2f"),
        format!("u:{pw}@127.0.0.1:5672/%2f"),
        format!("amqp://guest:guest@127.0.0.1:5672/%2f,amqp//u:{pw}@127.0.0.1:5673/%2f"),
        format!("amqp://guest:guest@127.0.0.1:5672/%2f,amqp:/u:{pw}@127.0.0.1:5673/%2f"),
    ];
    let bad_pg = [
        format!("postgres//u:{pw}@127.0.0.1:5432/db"),
        format!("postgres:/u:{pw}@127.0.0.1:5432/db"),
        format!("u:{pw}@127.0.0.1:5432/db"),
        format!("postgres://u:x@127.0.0.1:5432/db,postgres//u:{pw}@127.0.0.1:5433/db"),
    ];
    let cases = bad_amqp
        .iter()
        .map(|a| (good_pg.to_owned(), a.clone()))
        .chain(bad_pg.iter().map(|p| (p.clone(), good_amqp.to_owned())));
    let mut checked = 0;
    for (pg, amqp) in cases {
        for command in ["run", "check"] {
            for format in ["text", "json"] {
                let args = [
                    command,
                    "--database-url",
                    &pg,
                    "--amqp-url",
                    &amqp,
                    "--slot",
                    "s",
                    "--publication",
                    "p",
                    "--log-format",
                    format,
                ];
                let out = pgoutbox_env(&args, &[]);
                let shown = text(&out);
                assert_eq!(
                    out.status.code(),
                    Some(2),
                    "{command} {format} with {pg} / {amqp}: a usage error\n{shown}"
                );
                assert!(
                    !shown.contains(pw),
                    "{command} {format} with {pg} / {amqp} shows the password:\n{shown}"
                );
                checked += 1;
            }
        }
    }
    println!("{checked} runs: usage errors, no password");
}
