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

/// The secret in the generated URLs below: letters and digits only, so that it is the
/// same percent-encoded or not.
const URL_MARK: &str = "Zq7SecretMark";

/// A malformed (or well-formed) connection string carrying [`URL_MARK`] where a secret
/// goes: typos in the scheme and separators, lists, percent-encoding, unencoded `@` and `:`
/// in the userinfo, secret query keys (misspelt too) and values, key=value strings.
fn url_with_a_secret() -> impl proptest::strategy::Strategy<Value = String> {
    use proptest::prelude::*;
    let m = URL_MARK;
    let scheme = prop::sample::select(vec![
        "postgres://",
        "postgresql://",
        "postgres//",
        "postgres:/",
        "postgres:",
        "postgresql:///",
        "amqp://",
        "amqps://",
        "amqp//",
        "amqp:/",
        "amqp:",
        "",
        "://",
        "http://",
        "Postgres://",
    ]);
    let user = prop::sample::select(vec!["u", "", "us%zzer", "u%40x", "日"]);
    let secret = prop::sample::select(vec![
        format!(":{m}"),
        format!(":ab@{m}"),
        format!(":{m}@x"),
        format!(":{m}%zz"),
        format!(":a:{m}"),
        format!(":{m}%40x"),
        format!(":{m}/x"),
        format!(":{m}?x"),
        format!(":{m}#x"),
        format!(":{m} x"),
        String::new(),
    ]);
    let host = prop::sample::select(vec![
        "h",
        "127.0.0.1",
        "h1,h2",
        "[::1",
        "[::1]",
        "h:99999",
        "h:",
        "",
        "h:5432,h2:x",
        "h h",
    ]);
    let path = prop::sample::select(vec!["", "/db", "/%2f", "/d@b", "/db/x", "/%zz"]);
    let query = prop::sample::select(vec![
        String::new(),
        "?sslmode=require".into(),
        format!("?password={m}"),
        format!("?sslpassword={m}"),
        format!("?sslpasword={m}"),
        format!("?pasword={m}"),
        format!("?x={m}"),
        format!("?sslmode=bad&password={m}"),
        format!("?password={m}&sslmode=require"),
        format!("?heartbeat=x&password={m}"),
        format!("?Password={m}"),
        "?password".into(),
    ]);
    let one = (scheme, user, secret, host, path, query).prop_map(|(s, u, p, h, d, q)| {
        let at = if p.is_empty() && u.is_empty() {
            ""
        } else {
            "@"
        };
        format!("{s}{u}{p}{at}{h}{d}{q}")
    });
    let keywords = prop::sample::select(vec![
        format!("host=h password={m}"),
        format!("host=h password='{m} x'"),
        format!("host=h password='a\\' {m}'"),
        format!("host=h sslpassword={m} port=zz"),
        format!("password={m} port=zz"),
        format!("host=h pasword={m}"),
        format!("host=h password = {m}"),
        format!("host='h password={m}"),
        format!("dbname=x password={m}x host=h,"),
    ]);
    let single = prop_oneof![3 => one, 1 => keywords];
    (
        prop::collection::vec(single, 1..=3),
        prop::sample::select(vec![",", " ", "", ", "]),
    )
        .prop_map(|(parts, glue)| parts.join(glue))
}

/// Issue 32, item 1: thousands of generated connection strings carrying a secret, through
/// the URL types (`PgUrl`, `BrokerUrl`: their Display and Debug), every parser and error of a
/// URL (`--database-url` and `--amqp-url`, as `run` and `check` validate them) and the
/// redaction every shown URL goes through: the secret is in no error (Display and Debug)
/// and in no parsed value's Debug. `PGOUTBOX_TEST_URL_CASES`
/// sets the number (default 5,000); the seed is printed on failure (proptest).
#[test]
fn generated_urls_never_show_their_secret() {
    use proptest::test_runner::{Config, TestRunner};
    let cases: u32 = std::env::var("PGOUTBOX_TEST_URL_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(5_000);
    let mut runner = TestRunner::new(Config {
        cases,
        failure_persistence: None,
        ..Config::default()
    });
    let amqp_check = |url: &str| {
        pgoutbox::publisher::socket::Endpoint::parse(url)
            .map(|e| {
                let shown = format!("{e:?} {}", e.address());
                assert!(!shown.contains(URL_MARK), "{url}: {shown}");
            })
            .map_err(|e| e.to_string())
    };
    let result = runner.run(&url_with_a_secret(), |url| {
        let pg = pgoutbox::config::PgUrl::new(url.as_str());
        let mut shown = vec![
            pgoutbox::config::redact_url(&url),
            pg.to_string(),
            format!("{pg:?}"),
        ];
        match pgoutbox::config::parse_database_url(&pg) {
            Ok(config) => shown.push(format!("{config:?}")),
            Err(e) => shown.push(format!("{e} {e:?}")),
        }
        let urls: Vec<pgoutbox::config::BrokerUrl> =
            pgoutbox::config::split_amqp_urls(std::slice::from_ref(&url))
                .into_iter()
                .map(pgoutbox::config::BrokerUrl::new)
                .collect();
        shown.push(format!("{urls:?}"));
        shown.extend(urls.iter().map(ToString::to_string));
        if let Err(e) = pgoutbox::config::validate_amqp_urls(&urls, &amqp_check) {
            shown.push(format!("{e} {e:?}"));
        }
        for s in shown {
            proptest::prop_assert!(!s.contains(URL_MARK), "{url:?} shows its secret: {s}");
        }
        Ok(())
    });
    if let Err(e) = result {
        panic!("{e}");
    }
    println!("{cases} generated URLs: no secret shown");
}

/// Issue 32, item 1: a sample of those shapes (the three the operator's trial found first)
/// through `run`, `check` and `status`, in text and JSON logs: the secret is in no output.
/// Nothing listens where they point (port 1), and a command still running after 15 s is
/// stopped (`run` retries a refused connection).
#[test]
fn a_sample_of_bad_urls_through_run_check_and_status_shows_no_secret() {
    let m = URL_MARK;
    let good_pg = "postgres://pgoutbox_streamer@127.0.0.1:1/db".to_owned();
    let good_amqp = "amqp://guest:guest@127.0.0.1:1/%2f".to_owned();
    let pg = [
        format!("postgres//u:{m}@127.0.0.1:1,postgresql://u:x@127.0.0.2:1/db"),
        format!("postgresql://u:ab@{m}@127.0.0.1:1/db"),
        format!("postgresql://u@127.0.0.1:1/db?sslpassword={m}"),
        format!("postgresql://u@127.0.0.1:1/db?sslpasword={m}"),
        format!("postgresql://u:{m}%zz@127.0.0.1:1/db"),
        format!("host=127.0.0.1 port=1 password='{m} x' dbname=db user=u sslmode=bad"),
    ];
    let amqp = [
        format!("amqp://u:ab@{m}@127.0.0.1:1/%2f"),
        format!("amqp//u:{m}@127.0.0.1:1,amqp://u:x@127.0.0.1:1/%2f"),
        format!("amqp://u@127.0.0.1:1/%2f?password={m}"),
        format!("amqp://u:{m}@127.0.0.1:99999/%2f"),
    ];
    let cases = pg
        .iter()
        .map(|p| (p.clone(), good_amqp.clone()))
        .chain(amqp.iter().map(|a| (good_pg.clone(), a.clone())));
    let mut failures = Vec::new();
    let mut runs = 0;
    for (pg, amqp) in cases {
        for command in ["run", "check", "status"] {
            for format in ["text", "json"] {
                let mut args = vec![command, "--database-url", &pg, "--log-format", format];
                if command != "status" {
                    args.extend(["--amqp-url", &amqp, "--slot", "s", "--publication", "p"]);
                }
                let out_file = tempfile::tempfile().expect("tempfile");
                let err_file = tempfile::tempfile().expect("tempfile");
                let mut child = crate::support::cli::command()
                    .args(&args)
                    .stdout(out_file.try_clone().expect("clone"))
                    .stderr(err_file.try_clone().expect("clone"))
                    .spawn()
                    .expect("spawn pgoutbox");
                let deadline = std::time::Instant::now() + scaled(Duration::from_secs(15));
                while child.try_wait().expect("try_wait").is_none() {
                    if std::time::Instant::now() > deadline {
                        let _ = child.kill();
                    }
                    std::thread::sleep(Duration::from_millis(50));
                }
                let read = |mut f: std::fs::File| {
                    use std::io::Seek;
                    let mut text = String::new();
                    f.seek(std::io::SeekFrom::Start(0)).expect("seek");
                    let mut bytes = Vec::new();
                    f.read_to_end(&mut bytes).expect("read");
                    text.push_str(&String::from_utf8_lossy(&bytes));
                    text
                };
                let shown = format!("{}{}", read(out_file), read(err_file));
                if shown.contains(m) {
                    failures.push(format!("{command} {format} {pg} / {amqp}:\n{shown}"));
                }
                runs += 1;
            }
        }
    }
    assert!(
        failures.is_empty(),
        "{} of {runs} runs show the secret:\n{}",
        failures.len(),
        failures.join("\n")
    );
    println!("{runs} runs of run, check and status: no secret shown");
}
