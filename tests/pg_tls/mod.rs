//! TLS to PostgreSQL against a real cluster that takes TCP only over TLS
//! ([`TlsPostgres`], `hostssl` lines only, certificates made by the test): `setup`, `run`
//! and `status` with `sslmode=require`, `verify-ca`, `verify-full` and the default
//! `prefer` (both connections seen as TLS in `pg_stat_ssl`); a host name the certificate
//! does not list, a wrong CA and `sslmode=disable` each refused with what happened and the
//! fix, without retries; SCRAM-SHA-256-PLUS with `channel_binding=require` over TLS, and a
//! clear failure against the plaintext shared cluster.

use std::time::{Duration, Instant};

use pgoutbox::config::parse_database_url;
use pgoutbox::replication::connect::ReplicationConnection;

use crate::support::fixture::STREAMER_ROLE;
use crate::support::{scaled, Outbox, Postgres, RabbitMq, TlsPostgres};

/// An outbox on the TLS cluster: its database, `setup --create-roles` run through the binary
/// with `url` (which must point at that database; a superuser's), the queue declared on the
/// shared broker.
async fn outbox<'a>(tls: &'a TlsPostgres, name: &str, db: String, url: &str) -> Outbox<'a> {
    let ob = Outbox {
        pg: &tls.pg,
        db,
        slot: crate::support::unique(&format!("{name}_slot")),
        publication: crate::support::unique(&format!("{name}_pub")),
        exchange: crate::support::unique(&format!("{name}_x")),
        queue: crate::support::unique(&format!("{name}_q")),
        amqp_url: RabbitMq::shared().url(),
    };
    let out = pgoutbox(&[
        "setup",
        "--create-roles",
        "--database-url",
        url,
        "--slot",
        &ob.slot,
        "--publication",
        &ob.publication,
    ]);
    assert_eq!(out.0, Some(0), "setup over {url}: {}", out.1);
    crate::support::declare_bound_queue(&ob.amqp_url, &ob.exchange, &ob.queue, "#").await;
    ob
}

/// `url` (a superuser's, from [`TlsPostgres::url`]) as the streamer role: what `run` gets.
fn as_streamer(url: &str) -> String {
    let streamer = url.replacen(
        "postgres://postgres@",
        &format!("postgres://{STREAMER_ROLE}@"),
        1,
    );
    assert_ne!(streamer, url, "not a superuser's URL: {url}");
    streamer
}

/// Runs the binary to completion: (exit code, stdout and stderr).
fn pgoutbox(args: &[&str]) -> (Option<i32>, String) {
    let (code, out, err) = pgoutbox_split(args);
    (code, format!("{out}{err}"))
}

/// Runs the binary to completion: (exit code, stdout, stderr).
fn pgoutbox_split(args: &[&str]) -> (Option<i32>, String, String) {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_pgoutbox"))
        .args(args)
        .env("NO_COLOR", "1")
        .env("PGOUTBOX_HTTP_ADDR", "off")
        .output()
        .expect("run pgoutbox");
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// `(backend_type, ssl)` of every TCP backend of `db` (the harness' psql uses the socket).
fn tcp_backends(ob: &Outbox<'_>) -> Vec<(String, String)> {
    ob.sql(&format!(
        "SELECT a.backend_type, s.ssl FROM pg_stat_activity a JOIN pg_stat_ssl s USING (pid) \
         WHERE a.datname = '{}' AND a.client_addr IS NOT NULL ORDER BY 1",
        ob.db
    ))
    .lines()
    .filter_map(|l| l.split_once('|'))
    .map(|(t, s)| (t.to_owned(), s.to_owned()))
    .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn setup_run_and_status_over_tls_in_each_verifying_mode_and_prefer() {
    let tls = TlsPostgres::shared();
    let db = tls.create_database("pgtls_modes");
    let root = tls.rootcert();
    // require without a root certificate (nothing verified), verify-ca by address,
    // verify-full by name, and the default (prefer) with nothing in the URL.
    let urls = [
        ("require", tls.url("127.0.0.1", &db, "sslmode=require")),
        (
            "verify-ca",
            tls.url("127.0.0.1", &db, &format!("sslmode=verify-ca&{root}")),
        ),
        (
            "verify-full",
            tls.url("localhost", &db, &format!("sslmode=verify-full&{root}")),
        ),
        ("prefer", tls.url("127.0.0.1", &db, "connect_timeout=10")),
    ];
    let ob = outbox(tls, "pgtls_modes", db.clone(), &urls[0].1).await;
    let mut sent = 0;
    for (mode, url) in &urls {
        // setup is idempotent: run it again in each mode.
        let (code, text) = pgoutbox(&[
            "setup",
            "--database-url",
            url,
            "--slot",
            &ob.slot,
            "--publication",
            &ob.publication,
        ]);
        assert_eq!(code, Some(0), "setup with sslmode={mode}: {text}");
        let instance = format!("pgtls-{}", mode.replace('-', ""));
        let streamer = ob.run_with_url(&as_streamer(url), &["--instance-id", &instance]);
        ob.sql(&format!(
            "DO $$ BEGIN FOR i IN {}..{} LOOP PERFORM outbox.emit('pgtls.' || i, jsonb_build_object('n', i), '{{}}', 'pgtls-' || i); COMMIT; END LOOP; END $$",
            sent + 1,
            sent + 20
        ));
        let got = ob.drain(20, scaled(Duration::from_secs(30))).await;
        let ids: Vec<String> = got.iter().filter_map(|m| m.message_id.clone()).collect();
        let want: Vec<String> = (sent + 1..=sent + 20)
            .map(|i| format!("pgtls-{i}"))
            .collect();
        assert_eq!(ids, want, "sslmode={mode}:\n{}", streamer.log());
        sent += 20;
        ob.assert_streams_as_streamer(scaled(Duration::from_secs(10)), &format!("sslmode={mode}"))
            .await;

        // Both connections are TLS: the walsender (joined by pid with pg_stat_replication)
        // and the SQL sessions.
        let walsender_ssl = ob.sql(&format!(
            "SELECT s.ssl FROM pg_stat_replication r JOIN pg_stat_ssl s USING (pid) WHERE r.application_name = 'pgoutbox-{instance}'"
        ));
        assert_eq!(
            walsender_ssl.trim(),
            "t",
            "sslmode={mode}: walsender not over TLS"
        );
        let backends = tcp_backends(&ob);
        println!("sslmode={mode}: {backends:?}");
        assert!(
            backends.iter().any(|(t, _)| t == "walsender"),
            "{backends:?}"
        );
        assert!(
            backends.iter().any(|(t, _)| t == "client backend"),
            "{backends:?}"
        );
        assert!(backends.iter().all(|(_, ssl)| ssl == "t"), "{backends:?}");

        let (code, stdout, text) = pgoutbox_split(&[
            "status",
            "--json",
            "--database-url",
            url,
            "--slot",
            &ob.slot,
            "--publication",
            &ob.publication,
        ]);
        let json: serde_json::Value = serde_json::from_str(&stdout).unwrap_or_else(|e| {
            panic!("status with sslmode={mode} printed no JSON ({e}): {stdout}{text}")
        });
        assert_eq!(
            json["holder"],
            format!("pgoutbox-{instance}"),
            "sslmode={mode}: {text}"
        );
        assert!(
            code == Some(0) || code == Some(1),
            "sslmode={mode}: {code:?} {text}"
        );

        streamer.sigterm();
        let exit = streamer.wait_exit(scaled(Duration::from_secs(20))).await;
        assert!(
            exit.is_some_and(|s| s.success()),
            "sslmode={mode}: {exit:?}\n{}",
            streamer.log()
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_name_a_wrong_ca_and_plaintext_are_refused_at_once_with_the_fix() {
    let tls = TlsPostgres::shared();
    let db = tls.create_database("pgtls_refused");
    let root = tls.rootcert();
    let ob = outbox(
        tls,
        "pgtls_refused",
        db.clone(),
        &tls.url("127.0.0.1", &db, "sslmode=require"),
    )
    .await;
    let before = ob.confirmed_flush();
    // verify-full by a name the certificate does not list (TCP to the right address).
    let wrong_name = tls.url(
        "db.other.example",
        &db,
        &format!("hostaddr=127.0.0.1&sslmode=verify-full&{root}"),
    );
    let wrong_ca = tls.url(
        "127.0.0.1",
        &db,
        &format!("sslmode=verify-ca&sslrootcert={}", tls.other_ca.display()),
    );
    let plaintext = tls.url("127.0.0.1", &db, "sslmode=disable");
    for (url, want) in [
        (
            &wrong_name,
            "not valid for the host name \"db.other.example\"",
        ),
        (&wrong_ca, "did not verify against sslrootcert="),
        (&plaintext, "no encryption"),
    ] {
        let (code, text) = pgoutbox(&[
            "status",
            "--database-url",
            url,
            "--slot",
            &ob.slot,
            "--publication",
            &ob.publication,
        ]);
        println!("status: {text}");
        assert_ne!(code, Some(0), "{text}");
        assert!(text.contains(want), "{url}: {text}");
        // run stops at once: a definite error, not a retry loop.
        let started = Instant::now();
        let streamer = ob.run_with_url(&as_streamer(url), &["--instance-id", "pgtls-refused"]);
        let exit = streamer.wait_exit(scaled(Duration::from_secs(15))).await;
        let log = streamer.log();
        assert!(
            exit.is_some_and(|s| !s.success()),
            "run kept going with {url}:\n{log}"
        );
        assert!(
            started.elapsed() < scaled(Duration::from_secs(10)),
            "{:?}",
            started.elapsed()
        );
        assert_eq!(
            streamer.log_count("session failed; reconnecting"),
            0,
            "{log}"
        );
        assert!(log.contains(want), "{log}");
    }
    // The fixes are named.
    let (_, text) = pgoutbox(&["status", "--database-url", &plaintext, "--slot", &ob.slot]);
    assert!(
        text.contains(
            "only over TLS (hostssl in pg_hba.conf) and sslmode=disable connected in plaintext"
        ),
        "{text}"
    );
    let (_, text) = pgoutbox(&["status", "--database-url", &wrong_name, "--slot", &ob.slot]);
    assert!(
        text.contains("connect by a name the certificate lists"),
        "{text}"
    );
    assert!(!ob.slot_active());
    assert_eq!(ob.confirmed_flush(), before, "the slot moved");

    // The replication connection (our own client) refuses the same way.
    for (url, want) in [
        (
            &wrong_name,
            "not valid for the host name \"db.other.example\"",
        ),
        (&wrong_ca, "did not verify against sslrootcert="),
        (&plaintext, "sslmode=disable connected in plaintext"),
    ] {
        let config = parse_database_url(&url.as_str().into()).expect("url");
        let e = ReplicationConnection::connect(&config, "pgtls-refused")
            .await
            .expect_err(url);
        let error = pgoutbox::error::Error::Replication(e);
        assert!(error.to_string().contains(want), "{url}: {error}");
        assert!(!error.is_retryable(), "{url}: {error}");
    }
}

/// libpq's `allow`: plaintext first, and TLS when the server refuses it (this one takes TCP
/// only over TLS), on both connections.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sslmode_allow_retries_over_tls_when_the_server_refuses_plaintext() {
    let tls = TlsPostgres::shared();
    let config =
        parse_database_url(&tls.url("127.0.0.1", "postgres", "sslmode=allow").into()).expect("url");
    let client = pgoutbox::postgres::connect(&config)
        .await
        .expect("allow, then TLS");
    let row = client
        .query_one(
            "SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()",
            &[],
        )
        .await
        .unwrap();
    assert!(row.get::<_, bool>(0));
    let mut conn = ReplicationConnection::connect(&config, "pgtls-allow")
        .await
        .expect("allow, then TLS");
    conn.identify_system().await.expect("IDENTIFY_SYSTEM");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn channel_binding_require_binds_over_tls_and_fails_clearly_in_plaintext() {
    let tls = TlsPostgres::shared();
    let db = tls.create_database("pgtls_cb");
    let scram =
        |pg: &Postgres, query: &str| format!("{}?{query}", pg.url_as("pw_scram", "pw_scram", &db));
    // Over TLS: both connections authenticate with SCRAM-SHA-256-PLUS.
    let verify_ca = format!(
        "sslmode=verify-ca&channel_binding=require&{}",
        tls.rootcert()
    );
    for query in [
        "sslmode=require&channel_binding=require",
        "channel_binding=require",
        &verify_ca,
    ] {
        let config = parse_database_url(&scram(&tls.pg, query).into()).expect("url");
        let client = pgoutbox::postgres::connect(&config)
            .await
            .unwrap_or_else(|e| panic!("{query}: {e}"));
        let row = client
            .query_one(
                "SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()",
                &[],
            )
            .await
            .unwrap();
        assert!(row.get::<_, bool>(0), "{query}");
        let mut conn = ReplicationConnection::connect(&config, "pgtls-cb")
            .await
            .unwrap_or_else(|e| panic!("replication with {query}: {e}"));
        let identity = conn.identify_system().await.expect("IDENTIFY_SYSTEM");
        assert_eq!(identity.dbname.as_deref(), Some(db.as_str()));
    }
    // The server log shows SCRAM authentication for pw_scram (no other method exists for it).

    // The shared cluster has ssl = off: prefer falls back to plaintext, and
    // channel_binding=require refuses it on both connections.
    let shared = Postgres::shared();
    let url = format!(
        "{}?channel_binding=require",
        shared.url_as("pw_scram", "pw_scram", "postgres")
    );
    let config = parse_database_url(&url.into()).expect("url");
    let e = pgoutbox::error::Error::from(
        pgoutbox::postgres::connect(&config)
            .await
            .expect_err("no TLS, no binding"),
    );
    let text = e.to_string();
    println!("sql: {text}");
    assert!(
        text.contains("channel_binding=require") && text.contains("connect over TLS"),
        "{text}"
    );
    assert!(!e.is_retryable(), "{text}");
    let e = ReplicationConnection::connect(&config, "pgtls-cb")
        .await
        .expect_err("no TLS, no binding");
    let error = pgoutbox::error::Error::Replication(e);
    let text = error.to_string();
    println!("replication: {text}");
    assert!(
        text.contains("channel_binding=require") && text.contains("not over TLS"),
        "{text}"
    );
    assert!(!error.is_retryable(), "{text}");
    // And require over a server without TLS says so.
    let url = format!(
        "{}?sslmode=require",
        shared.url_as("pw_scram", "pw_scram", "postgres")
    );
    let config = parse_database_url(&url.into()).expect("url");
    let e = ReplicationConnection::connect(&config, "pgtls-cb")
        .await
        .expect_err("ssl = off");
    assert!(
        e.to_string()
            .contains("answered the SSLRequest with N: ssl = off"),
        "{e}"
    );
    let e = pgoutbox::error::Error::from(
        pgoutbox::postgres::connect(&config)
            .await
            .expect_err("ssl = off"),
    );
    assert!(
        e.to_string()
            .contains("answered the SSLRequest with N: ssl = off")
            && !e.is_retryable(),
        "{e}"
    );
}

/// Issue 32, item 4: `channel_binding=require` is refused without TLS, end to end: against
/// a real server without TLS (the shared one, trust authentication), `check` names the
/// problem and `run` never streams; neither connects in a way that skips the binding.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn channel_binding_require_is_refused_without_tls() {
    let pg = crate::support::Postgres::shared();
    let ob = crate::support::Outbox::new(
        pg,
        &crate::support::RabbitMq::shared().url(),
        "pgtls_cb_plain",
    )
    .await;
    let url = format!("{}?channel_binding=require", ob.streamer_url());
    let out = crate::support::cli::pgoutbox(&[
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
    ]);
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    println!("check: exit {:?}\n{text}", out.status.code());
    assert_ne!(out.status.code(), Some(0), "{text}");
    assert!(text.contains("channel"), "{text}");
    let streamer = ob.run_with_url(&url, &[]);
    let refused = streamer
        .wait_for_log(
            "channel",
            crate::support::scaled(std::time::Duration::from_secs(30)),
        )
        .await;
    let log = streamer.log();
    println!("run:\n{log}");
    assert!(refused, "{log}");
    assert!(
        log.contains("did not offer SCRAM-SHA-256-PLUS") && log.contains("channel_binding=prefer"),
        "the refusal names the setting and the fixes: {log}"
    );
    let status = streamer
        .wait_exit(crate::support::scaled(std::time::Duration::from_secs(30)))
        .await;
    assert_eq!(
        status.and_then(|s| s.code()),
        Some(1),
        "a definite error: run stops instead of retrying: {log}"
    );
    assert!(!log.contains("streaming slot="), "run streamed: {log}");
}

/// Runs the binary to completion with `env` added: (exit code, stdout and stderr).
fn pgoutbox_env(args: &[&str], env: &[(&str, &str)]) -> (Option<i32>, String) {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_pgoutbox"))
        .args(args)
        .envs(env.iter().copied())
        .env("NO_COLOR", "1")
        .env("PGOUTBOX_HTTP_ADDR", "off")
        .output()
        .expect("run pgoutbox");
    (
        out.status.code(),
        format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ),
    )
}

/// Issue 32 item 4: a client certificate and `sslrootcert=system`, end to end. The role
/// `pw_cert` may log in only by a certificate its CA signed (`cert` in `pg_hba.conf`). `run`
/// with `sslcert=`/`sslkey=` of that certificate and `sslrootcert=system` (the system trust
/// store, here the test CA through `SSL_CERT_FILE`, which rustls-native-certs reads) streams
/// 10 messages, and the walsender's `pg_stat_ssl` shows the certificate's subject. Without
/// the certificate the server refuses the login; without the CA in the system store the
/// server's certificate does not verify; each names what happened.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_certificate_logs_in_and_sslrootcert_system_reads_the_system_store() {
    let tls = TlsPostgres::shared();
    let db = tls.create_database("pgtls_cert");
    let root = tls.rootcert();
    let superuser = tls.url("localhost", &db, &format!("sslmode=verify-full&{root}"));
    let ob = outbox(tls, "pgtls_cert", db.clone(), &superuser).await;
    ob.sql(&format!("GRANT {STREAMER_ROLE} TO pw_cert"));
    let cert = format!(
        "sslcert={}&sslkey={}",
        tls.client_cert.display(),
        tls.client_key.display()
    );
    let ca = tls.ca.display().to_string();
    let system_store = [("SSL_CERT_FILE", ca.as_str())];
    let url = tls.url_as(
        "pw_cert",
        "localhost",
        &db,
        &format!("sslmode=verify-full&sslrootcert=system&{cert}"),
    );
    let status = |url: &str, env: &[(&str, &str)]| {
        pgoutbox_env(
            &[
                "status",
                "--database-url",
                url,
                "--slot",
                &ob.slot,
                "--publication",
                &ob.publication,
            ],
            env,
        )
    };

    // Without the certificate: pg_hba.conf's cert line refuses the login.
    let no_cert = tls.url_as(
        "pw_cert",
        "localhost",
        &db,
        "sslmode=verify-full&sslrootcert=system",
    );
    let (code, text) = status(&no_cert, &system_store);
    assert!(code.is_some_and(|c| c != 0), "{code:?} {text}");
    assert!(
        text.contains("certificate") && text.contains("sslcert="),
        "no certificate: {text}"
    );
    eprintln!("without sslcert=: {text}");
    // Without the test CA in the system store: the server's certificate does not verify.
    let (code, text) = status(&url, &[("SSL_CERT_FILE", "/nonexistent/ca.pem")]);
    assert!(code.is_some_and(|c| c != 0), "{code:?} {text}");
    assert!(text.contains("sslrootcert=system"), "empty store: {text}");
    eprintln!("without the CA in the system store: {text}");

    let streamer = crate::support::Streamer::spawn(
        &[
            "run",
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
            "--instance-id",
            "pgtls-cert",
        ],
        &[("SSL_CERT_FILE", ca.as_str()), ("RUST_LOG", "info")],
    );
    ob.sql(
        "DO $$ BEGIN FOR i IN 1..10 LOOP PERFORM outbox.emit('cert.' || i, jsonb_build_object('n', i), '{}', 'cert-' || i); COMMIT; END LOOP; END $$",
    );
    let got = ob.drain(10, scaled(Duration::from_secs(30))).await;
    let ids: Vec<String> = got.iter().filter_map(|m| m.message_id.clone()).collect();
    let want: Vec<String> = (1..=10).map(|i| format!("cert-{i}")).collect();
    assert_eq!(ids, want, "{}", streamer.log());
    let walsender = ob.sql(
        "SELECT r.usename || ' ' || s.ssl || ' ' || coalesce(s.client_dn, '-') FROM pg_stat_replication r JOIN pg_stat_ssl s USING (pid) WHERE r.application_name = 'pgoutbox-pgtls-cert'",
    );
    assert_eq!(
        walsender.trim(),
        "pw_cert true /CN=pw_cert",
        "{}",
        streamer.log()
    );
    let (code, text) = status(&url, &system_store);
    assert!(code == Some(0) || code == Some(1), "{code:?} {text}");
    assert!(
        text.contains("pgoutbox-pgtls-cert"),
        "status names the holder: {text}"
    );
    eprintln!("client certificate and sslrootcert=system: 10 of 10, walsender {walsender}");
    streamer.sigterm();
    let exit = streamer.wait_exit(scaled(Duration::from_secs(20))).await;
    assert!(
        exit.is_some_and(|s| s.success()),
        "{exit:?}\n{}",
        streamer.log()
    );
}

/// Issue 32 item 4: channel binding shown to be used. `run` as `pw_scram` (authenticated by
/// `scram-sha-256` in `pg_hba.conf`) over TLS with `channel_binding=require` logs that its
/// replication connection authenticated with SCRAM-SHA-256-PLUS (the server accepts that
/// mechanism only when the `tls-server-end-point` data bound into the exchange matches its
/// own certificate) and streams; with `channel_binding=disable` the same role authenticates
/// with plain SCRAM-SHA-256. Both connections of `run` are over TLS.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn run_authenticates_with_scram_sha_256_plus_under_channel_binding() {
    let tls = TlsPostgres::shared();
    let db = tls.create_database("pgtls_plus");
    let superuser = tls.url("127.0.0.1", &db, "sslmode=require");
    let ob = outbox(tls, "pgtls_plus", db.clone(), &superuser).await;
    ob.sql(&format!("GRANT {STREAMER_ROLE} TO pw_scram"));
    let mut sent = 0;
    for (binding, method) in [
        ("require", "SCRAM-SHA-256-PLUS"),
        ("disable", "SCRAM-SHA-256"),
    ] {
        let url = format!(
            "{}?sslmode=require&channel_binding={binding}",
            tls.pg.url_as("pw_scram", "pw_scram", &db)
        );
        let instance = format!("pgtls-cb-{binding}");
        let streamer = ob.run_with_url(&url, &["--instance-id", &instance]);
        assert!(
            streamer
                .wait_for_log(
                    "replication connection authenticated",
                    scaled(Duration::from_secs(30))
                )
                .await,
            "channel_binding={binding}: {}",
            streamer.log()
        );
        let line = streamer
            .log()
            .lines()
            .find(|l| l.contains("replication connection authenticated"))
            .map(str::to_owned)
            .unwrap_or_default();
        assert!(
            line.contains(&format!("method=\"{method}\""))
                && (method.ends_with("PLUS") || !line.contains("PLUS")),
            "channel_binding={binding}: {line}"
        );
        eprintln!("channel_binding={binding}: {line}");
        ob.sql(&format!(
            "DO $$ BEGIN FOR i IN {}..{} LOOP PERFORM outbox.emit('cb.' || i, jsonb_build_object('n', i), '{{}}', 'cb-' || i); COMMIT; END LOOP; END $$",
            sent + 1,
            sent + 5
        ));
        let got = ob.drain(5, scaled(Duration::from_secs(30))).await;
        assert_eq!(
            got.len(),
            5,
            "channel_binding={binding}: {}",
            streamer.log()
        );
        sent += 5;
        let ssl = ob.sql(&format!(
            "SELECT bool_and(s.ssl) FROM pg_stat_activity a JOIN pg_stat_ssl s USING (pid) WHERE a.application_name = 'pgoutbox-{instance}'"
        ));
        assert_eq!(ssl.trim(), "t", "channel_binding={binding}");
        streamer.sigterm();
        let exit = streamer.wait_exit(scaled(Duration::from_secs(20))).await;
        assert!(
            exit.is_some_and(|s| s.success()),
            "{exit:?}\n{}",
            streamer.log()
        );
    }
}
