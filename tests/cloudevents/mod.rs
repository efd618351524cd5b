//! `run --cloudevents`: the CloudEvents AMQP binding's binary content mode, checked field by
//! field on what a consumer receives, with both prefixes; and the settings refused with the
//! setting named.
//!
//! One database per test on the shared Postgres and RabbitMQ.

use std::collections::BTreeMap;
use std::time::Duration;

use crate::support::amqp::HeaderKind;
use crate::support::cli::pgoutbox_env;
use crate::support::{scaled, Outbox, Postgres, RabbitMq, Received};

const COMMIT_TIME_US: &str = "x-pgoutbox-commit-time-us";

/// The commit-time header (µs since the Unix epoch) as RFC 3339 UTC text with
/// microseconds, written by PostgreSQL (an implementation independent of ours).
fn sql_rfc3339(ob: &Outbox<'_>, us: &str) -> String {
    let us: i64 = us.parse().expect("commit time header is an integer");
    ob.sql(&format!(
        "SELECT to_char((timestamptz 'epoch' + {us} * interval '1 microsecond') AT TIME ZONE 'UTC', \
         'YYYY-MM-DD\"T\"HH24:MI:SS.US\"Z\"')"
    ))
    .trim()
    .to_owned()
}

/// The headers of `m` whose names start with `cloudEvents` (either separator).
fn cloudevents_headers(m: &Received) -> BTreeMap<String, String> {
    m.headers
        .iter()
        .filter(|(k, _)| k.starts_with("cloudEvents"))
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect()
}

/// Asserts the CloudEvent of `m`: exactly the attributes expected under `prefix` (plus
/// `extra`, the producer's extension headers), each a string; datacontenttype as the
/// content-type property; body and our LSN headers as without CloudEvents.
fn assert_event(
    ob: &Outbox<'_>,
    m: &Received,
    prefix: &str,
    source: &str,
    subject: Option<&str>,
    extra: &[(&str, &str)],
) {
    let commit_us = m
        .headers
        .get(COMMIT_TIME_US)
        .unwrap_or_else(|| panic!("no commit time header: {m:?}"));
    let mut want: BTreeMap<String, String> = [
        ("specversion", "1.0".to_owned()),
        ("id", m.message_id.clone().expect("a message_id")),
        ("source", source.to_owned()),
        ("type", m.routing_key.clone()),
        ("time", sql_rfc3339(ob, commit_us)),
    ]
    .into_iter()
    .chain(subject.map(|s| ("subject", s.to_owned())))
    .map(|(k, v)| (format!("{prefix}{k}"), v))
    .collect();
    want.extend(extra.iter().map(|(k, v)| (k.to_string(), v.to_string())));
    assert_eq!(cloudevents_headers(m), want, "{m:?}");
    for key in want.keys() {
        assert_eq!(m.header_kind(key), Some(HeaderKind::Text), "{key}: {m:?}");
    }
    // The id is the message id, the type the routing key: the AMQP message is unchanged.
    assert!(m.headers.contains_key("x-pgoutbox-lsn"), "{m:?}");
    assert!(m.headers.contains_key("x-pgoutbox-commit-lsn"), "{m:?}");
    assert_eq!(m.delivery_mode, Some(2));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn binary_mode_field_by_field_with_the_default_prefix() {
    let pg = Postgres::shared();
    let ob = Outbox::new(pg, &RabbitMq::shared().url(), "ce_default").await;
    let streamer = ob.run(&["--cloudevents"]);
    ob.sql(
        "BEGIN;
         SELECT outbox.emit('orders.created', '{\"n\": 1}', aggregate_id => 'order-42');
         SELECT outbox.emit('orders.noted', '{\"n\": 2}',
                            '{\"tenant\": \"acme\", \"cloudEvents:partitionkey\": \"p1\"}', 'fixed-id');
         COMMIT;",
    );
    ob.sql("SELECT outbox.emit_bytes('files.stored', '\\x00ff'::bytea, 'application/x-thing')");
    let got = ob.drain(3, scaled(Duration::from_secs(20))).await;
    assert_eq!(got.len(), 3, "{}", streamer.log());
    let source = format!("pgoutbox:///{}/{}", ob.db, ob.slot);
    let prefix = "cloudEvents_";

    assert_event(&ob, &got[0], prefix, &source, Some("order-42"), &[]);
    assert_eq!(got[0].routing_key, "orders.created");
    assert_eq!(got[0].content_type.as_deref(), Some("application/json"));
    assert_eq!(got[0].body_json(), serde_json::json!({"n": 1}));

    // No aggregate id: no subject. The producer's extension header written with the other
    // separator arrives with ours (one separator per message); its other headers as ever.
    assert_event(
        &ob,
        &got[1],
        prefix,
        &source,
        None,
        &[("cloudEvents_partitionkey", "p1")],
    );
    assert_eq!(got[1].message_id.as_deref(), Some("fixed-id"));
    assert_eq!(
        got[1].headers.get("tenant").map(String::as_str),
        Some("acme")
    );
    // One transaction, one commit time.
    assert_eq!(
        got[0].headers.get("cloudEvents_time"),
        got[1].headers.get("cloudEvents_time")
    );

    assert_event(&ob, &got[2], prefix, &source, None, &[]);
    assert_eq!(got[2].content_type.as_deref(), Some("application/x-thing"));
    assert_eq!(got[2].body, b"\x00\xff");
    // Another transaction, a later commit time (RFC 3339 text in UTC sorts as time).
    assert!(
        got[2].headers["cloudEvents_time"] >= got[0].headers["cloudEvents_time"],
        "{got:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn colon_prefix_and_a_given_source() {
    let pg = Postgres::shared();
    let ob = Outbox::new(pg, &RabbitMq::shared().url(), "ce_colon").await;
    let source = "https://example.com/orders?region=eu";
    let streamer = ob.run(&[
        "--cloudevents",
        "--cloudevents-prefix",
        "cloudEvents:",
        "--cloudevents-source",
        source,
    ]);
    ob.sql(
        "SELECT outbox.emit('orders.created', '{}', '{\"cloudEvents_partitionkey\": \"p2\"}',
                            aggregate_id => 'order-7')",
    );
    ob.sql("SELECT outbox.emit('orders.other', '[]')");
    let got = ob.drain(2, scaled(Duration::from_secs(20))).await;
    assert_eq!(got.len(), 2, "{}", streamer.log());
    assert_event(
        &ob,
        &got[0],
        "cloudEvents:",
        source,
        Some("order-7"),
        &[("cloudEvents:partitionkey", "p2")],
    );
    assert_event(&ob, &got[1], "cloudEvents:", source, None, &[]);
    for m in &got {
        assert!(
            !m.headers.keys().any(|k| k.starts_with("cloudEvents_")),
            "one separator per message: {m:?}"
        );
    }
}

/// `run` with unreachable servers: settings are checked before anything connects.
fn run_refused(extra: &[&str], env: &[(&str, &str)]) -> String {
    let mut args = vec![
        "run",
        "--database-url",
        "postgres://u@127.0.0.1:1/orders",
        "--amqp-url",
        "amqp://g:g@127.0.0.1:1/%2f",
    ];
    args.extend_from_slice(extra);
    let out = pgoutbox_env(&args, env);
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert_eq!(out.status.code(), Some(2), "{args:?} {env:?}: {stderr}");
    stderr
}

#[test]
fn bad_settings_are_refused_naming_the_setting() {
    // Any prefix but the binding's two, from the flag or the variable.
    for (extra, env) in [
        (
            &["--cloudevents", "--cloudevents-prefix", "cloudevents_"][..],
            &[][..],
        ),
        (
            &["--cloudevents"][..],
            &[("PGOUTBOX_CLOUDEVENTS_PREFIX", "cloudEvents.")][..],
        ),
    ] {
        let e = run_refused(extra, env);
        assert!(
            e.contains("--cloudevents-prefix")
                && e.contains("is not a CloudEvents AMQP property prefix: use cloudEvents_")
                && e.contains("or cloudEvents: (the released 1.0.2 text)"),
            "{e}"
        );
    }
    // A source that is no URI-reference; PGOUTBOX_CLOUDEVENTS=true turns the mode on.
    let e = run_refused(
        &["--cloudevents-source", "orders db"],
        &[("PGOUTBOX_CLOUDEVENTS", "true")],
    );
    assert!(
        e.contains(
            "invalid setting --cloudevents-source (PGOUTBOX_CLOUDEVENTS_SOURCE) = \"orders db\": \
             not a URI-reference; the CloudEvents source must be a non-empty URI-reference (RFC 3986)"
        ),
        "{e}"
    );
    // A CloudEvents setting without --cloudevents is a mistake, not ignored.
    let e = run_refused(&["--cloudevents-prefix", "cloudEvents:"], &[]);
    assert!(
        e.contains(
            "invalid setting --cloudevents-prefix (PGOUTBOX_CLOUDEVENTS_PREFIX) = \"cloudEvents:\": \
             is used only with --cloudevents"
        ),
        "{e}"
    );
    // A config file: the key and the file are named.
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("pgoutbox.toml");
    std::fs::write(&path, "cloudevents = true\ncloudevents_prefix = \"ce_\"\n").unwrap();
    let e = run_refused(&["--config", path.to_str().unwrap()], &[]);
    assert!(
        e.contains(path.to_str().unwrap())
            && e.contains("\"cloudevents_prefix\" (line 2)")
            && e.contains("\"ce_\" is not a CloudEvents AMQP property prefix"),
        "{e}"
    );
}
