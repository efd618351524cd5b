//! `amqps://` against a real RabbitMQ with a TLS listener (one node shared by these tests,
//! certificates made by the test): the stream over TLS with `cacertfile=` and a client
//! certificate; a wrong CA, a plaintext port and a TLS port reached with `amqp://` each
//! refused with what happened and the fix, nothing acknowledged; `check` over TLS.

use std::time::Duration;

use crate::support::tls::CLIENT_CN;
use crate::support::{scaled, Outbox, Postgres, Streamer, TlsRabbit};

/// Emits `n` messages with ids `tls-1` .. `tls-n`, one transaction each.
fn emit(ob: &Outbox<'_>, n: usize) {
    emit_range(ob, 1, n, true);
}

/// Emits ids `tls-FROM` .. `tls-TO` (1 KiB payloads), one transaction each or all in one.
fn emit_range(ob: &Outbox<'_>, from: usize, to: usize, commit_each: bool) {
    let commit = if commit_each { "COMMIT;" } else { "" };
    ob.sql(&format!(
        "DO $$ BEGIN FOR i IN {from}..{to} LOOP PERFORM outbox.emit('tls.' || i, jsonb_build_object('n', i, 'pad', repeat('x', 1024)), '{{}}', 'tls-' || i); {commit} END LOOP; END $$"
    ));
}

/// `pgoutbox check` for `ob` against `amqp_url`: (exit code, stdout and stderr).
fn check(ob: &Outbox<'_>, amqp_url: &str) -> (Option<i32>, String) {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_pgoutbox"))
        .args([
            "check",
            "--database-url",
            &ob.url(),
            "--amqp-url",
            amqp_url,
            "--slot",
            &ob.slot,
            "--publication",
            &ob.publication,
            "--exchange",
            &ob.exchange,
        ])
        .env("NO_COLOR", "1")
        .env("PGOUTBOX_HTTP_ADDR", "off")
        .output()
        .expect("run pgoutbox check");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.code(), text)
}

/// Waits for `pattern` in the streamer's log; fails the test with the log otherwise.
async fn expect_log(streamer: &Streamer, pattern: &str) {
    assert!(
        streamer
            .wait_for_log(pattern, scaled(Duration::from_secs(30)))
            .await,
        "{pattern:?} never appeared in the log:\n{}",
        streamer.log()
    );
    let log = streamer.log();
    let line = log
        .lines()
        .find(|l| l.contains(pattern))
        .unwrap_or_default();
    println!("{line}");
}

/// A streamer that cannot connect: it keeps retrying (the error is retryable), holds no
/// slot, publishes nothing and acknowledges nothing.
async fn assert_nothing_acknowledged(ob: &Outbox<'_>, streamer: &Streamer, flushed_before: u64) {
    // Two failed attempts: it retried rather than exiting.
    let retried = crate::support::wait_until(scaled(Duration::from_secs(30)), || async {
        streamer.log_count("session failed; reconnecting") >= 2
    })
    .await;
    assert!(retried, "no second attempt:\n{}", streamer.log());
    assert!(streamer.try_status().is_none(), "{}", streamer.log());
    assert!(!streamer.log().contains("streaming"), "{}", streamer.log());
    assert!(!ob.slot_active(), "the slot was taken");
    assert_eq!(ob.confirmed_flush(), flushed_before, "the slot moved");
    let got = ob.drain(1, Duration::from_millis(300)).await;
    assert!(got.is_empty(), "published {} messages", got.len());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streams_over_amqps_verified_by_cacertfile_with_a_client_certificate() {
    let tls = TlsRabbit::shared();
    let pg = Postgres::shared();
    let ob = Outbox::new(pg, &tls.rabbit.url(), "tls_e2e").await;
    let before = ob.confirmed_flush();
    // 300 one-message transactions, then one of 5,000 (about 6 MB written at once: partial
    // writes, and TLS records left in rustls' buffer until a flush).
    emit(&ob, 300);
    emit_range(&ob, 301, 5_300, false);
    let url = tls.amqps_url(&format!(
        "{}&certfile={}&keyfile={}",
        tls.cacertfile(),
        tls.client_cert.display(),
        tls.client_key.display()
    ));
    let streamer = ob.run_with_amqp_url(&url, &["--instance-id", "tls-e2e"]);
    let started = std::time::Instant::now();
    let got = ob.drain(5_300, scaled(Duration::from_secs(60))).await;
    println!(
        "drained {} messages over amqps in {:.1?}",
        got.len(),
        started.elapsed()
    );
    let ids: Vec<String> = got.iter().filter_map(|m| m.message_id.clone()).collect();
    let want: Vec<String> = (1..=5_300).map(|i| format!("tls-{i}")).collect();
    assert_eq!(
        ids,
        want,
        "each message once, in commit order:\n{}",
        streamer.log()
    );

    // The broker saw this connection over TLS, with our client certificate.
    let connections = tls.rabbit.ctl_ok(&[
        "-q",
        "list_connections",
        "client_properties",
        "ssl",
        "peer_cert_subject",
    ]);
    let ours = connections
        .lines()
        .find(|l| l.contains("pgoutbox tls-e2e"))
        .unwrap_or_else(|| panic!("no connection named pgoutbox tls-e2e in:\n{connections}"));
    assert!(ours.contains("\ttrue\t"), "not TLS: {ours}");
    assert!(
        ours.contains(&format!("CN={CLIENT_CN}")),
        "no client certificate: {ours}"
    );

    // The slot advances over what was confirmed.
    let advanced = crate::support::wait_until(scaled(Duration::from_secs(20)), || async {
        ob.confirmed_flush() > before && ob.lag_bytes() < 16 * 1024 * 1024
    })
    .await;
    assert!(advanced, "the slot did not advance:\n{}", streamer.log());
    streamer.sigterm();
    let status = streamer.wait_exit(scaled(Duration::from_secs(30))).await;
    assert_eq!(status.and_then(|s| s.code()), Some(0), "{}", streamer.log());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_ca_is_refused_with_the_fix_and_nothing_is_acknowledged() {
    let tls = TlsRabbit::shared();
    let pg = Postgres::shared();
    let ob = Outbox::new(pg, &tls.rabbit.url(), "tls_wrong_ca").await;
    emit(&ob, 20);
    let before = ob.confirmed_flush();
    let streamer = ob.run_with_amqp_url(
        &tls.amqps_url(&format!("cacertfile={}", tls.other_ca.display())),
        &[],
    );
    expect_log(
        &streamer,
        &format!(
            "certificate verification failed for \"127.0.0.1\" against cacertfile={}",
            tls.other_ca.display()
        ),
    )
    .await;
    expect_log(
        &streamer,
        "set cacertfile= in the URL to the CA that signed the broker's certificate",
    )
    .await;
    assert!(
        streamer.log().contains("UnknownIssuer"),
        "{}",
        streamer.log()
    );
    assert_nothing_acknowledged(&ob, &streamer, before).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_wrong_listener_is_named_either_way() {
    let tls = TlsRabbit::shared();
    let pg = Postgres::shared();
    let ob = Outbox::new(pg, &tls.rabbit.url(), "tls_ports").await;
    emit(&ob, 5);
    let before = ob.confirmed_flush();

    // amqps:// to the plain AMQP port.
    let plain = tls.rabbit.port();
    let url = format!(
        "amqps://guest:guest@127.0.0.1:{plain}/%2f?{}",
        tls.cacertfile()
    );
    let streamer = ob.run_with_amqp_url(&url, &[]);
    expect_log(
        &streamer,
        &format!("the server at 127.0.0.1:{plain} did not answer in TLS"),
    )
    .await;
    expect_log(
        &streamer,
        &format!("is 127.0.0.1:{plain} the TLS listener?"),
    )
    .await;
    assert_nothing_acknowledged(&ob, &streamer, before).await;
    drop(streamer);

    // amqp:// to the TLS port.
    let url = format!("amqp://guest:guest@127.0.0.1:{}/%2f", tls.tls_port);
    let streamer = ob.run_with_amqp_url(&url, &[]);
    expect_log(&streamer, "use amqps:// for").await;
    assert!(
        streamer
            .log()
            .contains(&format!("127.0.0.1:{}", tls.tls_port)),
        "{}",
        streamer.log()
    );
    assert_nothing_acknowledged(&ob, &streamer, before).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn check_works_over_amqps_and_names_a_certificate_for_another_name() {
    let tls = TlsRabbit::shared();
    let pg = Postgres::shared();
    let ob = Outbox::new(pg, &tls.rabbit.url(), "tls_check").await;

    let (code, text) = check(&ob, &tls.amqps_url(&tls.cacertfile()));
    println!("{text}");
    assert_eq!(code, Some(0), "{text}");
    for want in [
        "broker version:         RabbitMQ 3.",
        &format!("exchange:               \"{}\" exists", ob.exchange),
    ] {
        assert!(text.contains(want), "{want:?} in\n{text}");
    }

    // The broker's certificate names localhost and 127.0.0.1, not this.
    let (code, text) = check(
        &ob,
        &tls.amqps_url(&format!(
            "{}&server_name_indication=broker.example",
            tls.cacertfile()
        )),
    );
    println!("{text}");
    assert_eq!(code, Some(1), "{text}");
    assert!(
        text.contains("the broker's certificate is not valid for the name \"broker.example\"")
            && text.contains("set server_name_indication= to one of them"),
        "{text}"
    );

    // Without cacertfile= the system trust store does not know the test CA.
    let (code, text) = check(&ob, &tls.amqps_url(""));
    println!("{text}");
    assert_eq!(code, Some(1), "{text}");
    assert!(
        text.contains("certificate verification failed for \"127.0.0.1\"")
            && (text.contains("against the system trust store")
                || text.contains("cannot use the system trust store")),
        "{text}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_tls_files_can_be_flags_and_a_conflict_with_the_url_names_both() {
    let tls = TlsRabbit::shared();
    let pg = Postgres::shared();
    let ob = Outbox::new(pg, &tls.rabbit.url(), "tls_flags").await;
    emit(&ob, 50);
    // The CA as a flag, the client certificate and key as variables: no TLS parameter in
    // the URL at all.
    let ca = tls.ca.display().to_string();
    let url = tls.amqps_url("");
    let streamer = Streamer::spawn(
        &[
            "run",
            "--database-url",
            &ob.streamer_url(),
            "--amqp-url",
            &url,
            "--amqp-ca-file",
            &ca,
            "--slot",
            &ob.slot,
            "--publication",
            &ob.publication,
            "--exchange",
            &ob.exchange,
            "--instance-id",
            "tls-flags",
        ],
        &[
            (
                "PGOUTBOX_AMQP_CERT_FILE",
                &tls.client_cert.display().to_string(),
            ),
            (
                "PGOUTBOX_AMQP_KEY_FILE",
                &tls.client_key.display().to_string(),
            ),
        ],
    );
    let got = ob.drain(50, scaled(Duration::from_secs(60))).await;
    let ids: Vec<String> = got.iter().filter_map(|m| m.message_id.clone()).collect();
    let want: Vec<String> = (1..=50).map(|i| format!("tls-{i}")).collect();
    assert_eq!(ids, want, "{}", streamer.log());
    let connections = tls.rabbit.ctl_ok(&[
        "-q",
        "list_connections",
        "client_properties",
        "ssl",
        "peer_cert_subject",
    ]);
    let ours = connections
        .lines()
        .find(|l| l.contains("pgoutbox tls-flags"))
        .unwrap_or_else(|| panic!("no connection named pgoutbox tls-flags in:\n{connections}"));
    assert!(ours.contains("\ttrue\t"), "not TLS: {ours}");
    assert!(
        ours.contains(&format!("CN={CLIENT_CN}")),
        "no client certificate: {ours}"
    );
    streamer.sigterm();
    let status = streamer.wait_exit(scaled(Duration::from_secs(30))).await;
    assert_eq!(status.and_then(|s| s.code()), Some(0), "{}", streamer.log());

    // The same CA in both places is fine (check passes); another one in the URL is a usage
    // error naming the flag, its value and the URL's parameter.
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_pgoutbox"))
        .args([
            "check",
            "--database-url",
            &ob.url(),
            "--amqp-url",
            &tls.amqps_url(&format!("cacertfile={}", tls.other_ca.display())),
            "--amqp-ca-file",
            &ca,
            "--slot",
            &ob.slot,
            "--publication",
            &ob.publication,
        ])
        .env("PGOUTBOX_HTTP_ADDR", "off")
        .output()
        .expect("run pgoutbox check");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains(&format!(
            "invalid setting --amqp-ca-file (PGOUTBOX_AMQP_CA_FILE) = \"{ca}\": conflicts with cacertfile={} in --amqp-url",
            tls.other_ca.display()
        )),
        "{stderr}"
    );
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_pgoutbox"))
        .args([
            "check",
            "--database-url",
            &ob.url(),
            "--amqp-url",
            &tls.amqps_url(&tls.cacertfile()),
            "--amqp-ca-file",
            &ca,
            "--slot",
            &ob.slot,
            "--publication",
            &ob.publication,
            "--exchange",
            &ob.exchange,
        ])
        .env("PGOUTBOX_HTTP_ADDR", "off")
        .output()
        .expect("run pgoutbox check");
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Issue 32 item 4: a RabbitMQ node with no plain listener at all (`listeners.tcp = none`,
/// no plugin opening a port of its own): `run` streams to it over `amqps://` alone, and
/// `check` passes over it. The test's own queue is declared and bound with `rabbitmqctl
/// eval` (the harness' consumers speak AMQP in plaintext only), and what arrived is counted
/// with `rabbitmqctl list_queues`; the slot moves past the last message.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streams_to_a_node_with_no_plain_listener() {
    let tls = TlsRabbit::start_tls_only();
    let listeners = tls.rabbit.ctl_ok(&["status"]);
    let amqp_lines: Vec<&str> = listeners
        .lines()
        .filter(|l| l.contains("protocol: amqp"))
        .collect();
    assert!(
        !amqp_lines.is_empty() && amqp_lines.iter().all(|l| l.contains("amqp/ssl")),
        "the node must listen for AMQP over TLS only: {amqp_lines:?}\n{listeners}"
    );
    let url = tls.amqps_url(&tls.cacertfile());
    let pg = Postgres::shared();
    let ob = Outbox::new_without_queue(pg, &url, "tls_only").await;
    let streamer = ob.run_with_amqp_url(&url, &[]);
    expect_log(&streamer, "streaming").await;
    let declare = format!(
        "Q = rabbit_misc:r(<<\"/\">>, queue, <<\"{q}\">>), \
         X = rabbit_misc:r(<<\"/\">>, exchange, <<\"{x}\">>), \
         {{new, _}} = rabbit_amqqueue:declare(Q, true, false, [], none, <<\"guest\">>), \
         ok = rabbit_binding:add({{binding, X, <<\"#\">>, Q, []}}, <<\"guest\">>), ok.",
        q = ob.queue,
        x = ob.exchange
    );
    tls.rabbit.ctl_ok(&["eval", &declare]);
    emit(&ob, 20);
    let queued = || {
        tls.rabbit
            .ctl_ok(&["list_queues", "-q", "name", "messages"])
            .lines()
            .find_map(|l| {
                let mut parts = l.split_whitespace();
                (parts.next() == Some(ob.queue.as_str()))
                    .then(|| parts.next().and_then(|n| n.parse::<u64>().ok()))
                    .flatten()
            })
            .unwrap_or(0)
    };
    let arrived =
        crate::support::wait_until(scaled(Duration::from_secs(60)), || async { queued() >= 20 })
            .await;
    assert!(arrived, "{} of 20 queued:\n{}", queued(), streamer.log());
    assert!(
        ob.settled_through_now(scaled(Duration::from_secs(60)))
            .await,
        "the slot did not move past the last message:\n{}",
        streamer.log()
    );
    let (code, text) = check(&ob, &url);
    assert_eq!(code, Some(0), "check over the TLS-only node:\n{text}");
    eprintln!("TLS-only node: 20 of 20 queued, check passes");
    streamer.sigterm();
    let status = streamer.wait_exit(scaled(Duration::from_secs(30))).await;
    assert_eq!(status.and_then(|s| s.code()), Some(0), "{}", streamer.log());
    assert_eq!(queued(), 20, "{}", streamer.log());
}
