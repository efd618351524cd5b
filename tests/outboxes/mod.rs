//! Several outboxes in one database (`--schema`, `--prefix`): two services, each with its
//! own schema, prefix, slot, publication and exchange, beside the default outbox (schema
//! `outbox`, prefix `pgoutbox`), all in one database of the shared Postgres.

use std::time::Duration;

use crate::support::cli::{stderr, stdout};
use crate::support::{
    declare_bound_queue, drain_queue, scaled, unique, Outbox, Postgres, RabbitMq, Streamer,
};

/// A second outbox in the database of a default one (`ob`).
struct Service<'a> {
    ob: &'a Outbox<'a>,
    schema: String,
    prefix: String,
    slot: String,
    publication: String,
    exchange: String,
    queue: String,
}

impl<'a> Service<'a> {
    /// `setup --schema S --prefix P --create-roles` with its own slot and publication, and
    /// a queue bound with `#` to its own exchange.
    async fn new(ob: &'a Outbox<'a>, name: &str) -> Service<'a> {
        let s = Service {
            ob,
            schema: unique(&format!("{name}_s")),
            prefix: format!("svc.{}", unique(name)),
            slot: unique(&format!("{name}_slot")),
            publication: unique(&format!("{name}_pub")),
            exchange: unique(&format!("{name}_x")),
            queue: unique(&format!("{name}_q")),
        };
        let out = s.cli(&["setup", "--create-roles", "--prefix", &s.prefix]);
        assert!(out.status.success(), "setup {name}: {}", stderr(&out));
        assert!(
            stdout(&out).contains(&format!("schema {}, prefix {}", s.schema, s.prefix)),
            "{}",
            stdout(&out)
        );
        declare_bound_queue(&ob.amqp_url, &s.exchange, &s.queue, "#").await;
        s
    }

    /// A `pgoutbox` subcommand with this service's database, schema, slot and publication.
    /// (`dead-letters`, `journal` and `maintenance` take no slot or publication).
    fn cli(&self, args: &[&str]) -> std::process::Output {
        let url = self.ob.url();
        let mut full: Vec<&str> = args.to_vec();
        full.extend(["--database-url", &url, "--schema", &self.schema]);
        if !["dead-letters", "journal", "maintenance"].contains(&args[0]) {
            full.extend(["--slot", &self.slot, "--publication", &self.publication]);
        }
        std::process::Command::new(env!("CARGO_BIN_EXE_pgoutbox"))
            .args(&full)
            .env("NO_COLOR", "1")
            .env("PGOUTBOX_HTTP_ADDR", "off")
            .output()
            .expect("run pgoutbox")
    }

    /// `run` for this outbox, as the least-privilege streamer role.
    fn run(&self) -> Streamer {
        self.run_with(&[])
    }

    /// `run` for this outbox with `extra` arguments.
    fn run_with(&self, extra: &[&str]) -> Streamer {
        let url = self.ob.streamer_url();
        let mut args = vec![
            "run",
            "--database-url",
            &url,
            "--amqp-url",
            &self.ob.amqp_url,
            "--schema",
            &self.schema,
            "--slot",
            &self.slot,
            "--publication",
            &self.publication,
            "--exchange",
            &self.exchange,
        ];
        args.extend_from_slice(extra);
        Streamer::spawn(&args, &[("RUST_LOG", "info,pgoutbox=debug")])
    }

    /// Emits `n` messages through this schema's helper, ids `{tag}-{i}`, one transaction.
    fn emit(&self, tag: &str, n: usize) -> String {
        emit(self.ob, &self.schema, tag, n)
    }
}

/// Emits `n` messages through `schema.emit`, ids `{tag}-{i}`, in one transaction; returns
/// the LSN of the last.
fn emit(ob: &Outbox<'_>, schema: &str, tag: &str, n: usize) -> String {
    ob.sql(&format!(
        "SELECT max(\"{schema}\".emit('t.{tag}', jsonb_build_object('i', i), message_id => '{tag}-' || i)::text)
           FROM generate_series(1, {n}) i"
    ))
    .trim()
    .to_owned()
}

fn slot_flush(ob: &Outbox<'_>, slot: &str) -> u64 {
    let text = ob.sql(&format!(
        "SELECT confirmed_flush_lsn - '0/0'::pg_lsn FROM pg_replication_slots WHERE slot_name = '{slot}'"
    ));
    text.trim().parse::<f64>().expect("confirmed_flush_lsn") as u64
}

/// Waits until the slot's confirmed position reaches `lsn`.
async fn wait_flushed(ob: &Outbox<'_>, slot: &str, lsn: &str, who: &str) {
    let target = crate::support::lsn(lsn);
    let deadline = std::time::Instant::now() + scaled(Duration::from_secs(20));
    while slot_flush(ob, slot) < target {
        assert!(
            std::time::Instant::now() < deadline,
            "{who}: slot {slot} never acknowledged {lsn} (at {})",
            slot_flush(ob, slot)
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

fn sorted_ids(got: &[crate::support::Received]) -> Vec<String> {
    let mut ids: Vec<String> = got
        .iter()
        .map(|m| m.message_id.clone().unwrap_or_default())
        .collect();
    ids.sort();
    ids
}

fn expected_ids(tags: &[(&str, usize)]) -> Vec<String> {
    let mut ids: Vec<String> = tags
        .iter()
        .flat_map(|(tag, n)| (1..=*n).map(move |i| format!("{tag}-{i}")))
        .collect();
    ids.sort();
    ids
}

/// `reason|last_error` of every dead letter in `schema`.
fn dead_letters(ob: &Outbox<'_>, schema: &str) -> Vec<String> {
    ob.sql(&format!(
        "SELECT reason || '|' || coalesce(message_id, '-') FROM \"{schema}\".dead_letter ORDER BY id"
    ))
    .lines()
    .filter(|l| !l.is_empty())
    .map(str::to_owned)
    .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_outboxes_beside_the_default_one_each_publish_only_their_own() {
    let pg = Postgres::shared();
    let ob = Outbox::new(pg, &RabbitMq::shared().url(), "outboxes").await;
    let billing = Service::new(&ob, "billing").await;
    let shipping = Service::new(&ob, "shipping").await;

    // Each schema holds its helpers writing its own prefix, and its own tables.
    for s in [&billing, &shipping] {
        assert_eq!(
            ob.sql(&format!(
                "SELECT message_prefix FROM \"{}\".settings",
                s.schema
            ))
            .trim(),
            s.prefix
        );
        let body = ob.sql(&format!(
            "SELECT prosrc FROM pg_proc WHERE oid = '\"{}\".emit_bytes'::regproc",
            s.schema
        ));
        assert!(body.contains(&format!("'{}'", s.prefix)), "{body}");
        assert!(
            !body.contains("'pgoutbox'") && !body.contains("outbox._envelope"),
            "{body}"
        );
    }

    let streamers = [ob.run(&[]), billing.run(), shipping.run()];
    for st in &streamers {
        assert!(
            st.wait_for_log("streaming", scaled(Duration::from_secs(20)))
                .await,
            "{}",
            st.log()
        );
    }

    // Interleaved: separate transactions per outbox, and one transaction writing to all three.
    emit(&ob, "outbox", "default", 4);
    billing.emit("billing", 6);
    shipping.emit("shipping", 3);
    ob.sql(&format!(
        "BEGIN;
         SELECT outbox.emit('t.mixed', '{{}}', message_id => 'mixed-default');
         SELECT \"{b}\".emit('t.mixed', '{{}}', message_id => 'mixed-billing');
         SELECT \"{s}\".emit('t.mixed', '{{}}', message_id => 'mixed-shipping');
         COMMIT;",
        b = billing.schema,
        s = shipping.schema
    ));
    // Poison per outbox: a non-transactional message with billing's prefix, an undecodable
    // transactional one with shipping's. Each lands in its own schema's dead letters.
    ob.sql(&format!(
        "SELECT pg_logical_emit_message(false, '{}', 'not an envelope')",
        billing.prefix
    ));
    ob.sql(&format!(
        "SELECT pg_logical_emit_message(true, '{}', 'not an envelope')",
        shipping.prefix
    ));
    let last_default = emit(&ob, "outbox", "late-default", 2);
    let last_billing = billing.emit("late-billing", 2);
    let last_shipping = shipping.emit("late-shipping", 2);

    let idle = scaled(Duration::from_secs(20));
    let got_default = ob.drain(4 + 1 + 2, idle).await;
    let got_billing = drain_queue(&ob.amqp_url, &billing.queue, 6 + 1 + 2, idle).await;
    let got_shipping = drain_queue(&ob.amqp_url, &shipping.queue, 3 + 1 + 2, idle).await;
    let mut want_default = expected_ids(&[("default", 4), ("late-default", 2)]);
    want_default.push("mixed-default".into());
    want_default.sort();
    assert_eq!(sorted_ids(&got_default), want_default, "default outbox");
    let mut want_billing = expected_ids(&[("billing", 6), ("late-billing", 2)]);
    want_billing.push("mixed-billing".into());
    want_billing.sort();
    assert_eq!(sorted_ids(&got_billing), want_billing, "billing outbox");
    let mut want_shipping = expected_ids(&[("shipping", 3), ("late-shipping", 2)]);
    want_shipping.push("mixed-shipping".into());
    want_shipping.sort();
    assert_eq!(sorted_ids(&got_shipping), want_shipping, "shipping outbox");
    // Each on its own exchange.
    assert!(got_billing.iter().all(|m| m.exchange == billing.exchange));
    assert!(got_shipping.iter().all(|m| m.exchange == shipping.exchange));
    assert!(got_default.iter().all(|m| m.exchange == ob.exchange));

    // Dead letters in the right schema, none in the default one.
    assert_eq!(
        dead_letters(&ob, &billing.schema),
        vec!["poison|-".to_owned()]
    );
    assert_eq!(
        dead_letters(&ob, &shipping.schema),
        vec!["poison|-".to_owned()]
    );
    assert_eq!(dead_letters(&ob, "outbox"), Vec::<String>::new());
    // And the log says where they went.
    let billing_log = streamers[1].log();
    assert!(
        billing_log.contains(&format!(
            "message dead-lettered to {}.dead_letter (inspect with `pgoutbox dead-letters list --schema {}`)",
            billing.schema, billing.schema
        )),
        "{billing_log}"
    );
    assert!(!billing_log.contains("outbox.dead_letter"), "{billing_log}");

    // Every slot acknowledged past all of it, the other outboxes' messages included.
    let last = [&last_default, &last_billing, &last_shipping]
        .into_iter()
        .max_by_key(|l| crate::support::lsn(l))
        .unwrap()
        .clone();
    wait_flushed(&ob, &ob.slot, &last, "default").await;
    wait_flushed(&ob, &billing.slot, &last, "billing").await;
    wait_flushed(&ob, &shipping.slot, &last, "shipping").await;
    // Each stream_state holds its own slot only.
    for (schema, slot) in [
        ("outbox", &ob.slot),
        (billing.schema.as_str(), &billing.slot),
        (shipping.schema.as_str(), &shipping.slot),
    ] {
        assert_eq!(
            ob.sql(&format!(
                "SELECT string_agg(slot_name, ',') FROM \"{schema}\".stream_state"
            ))
            .trim(),
            slot.as_str(),
            "{schema}.stream_state"
        );
    }

    for st in &streamers {
        st.sigterm();
    }
    for st in &streamers {
        assert!(
            st.wait_exit(scaled(Duration::from_secs(20)))
                .await
                .is_some_and(|s| s.success()),
            "{}",
            st.log()
        );
    }

    // With the streamers stopped: peek and status count only the outbox's own prefix.
    emit(&ob, "outbox", "waiting-default", 1);
    billing.emit("waiting-billing", 3);
    shipping.emit("waiting-shipping", 2);
    let deadline = std::time::Instant::now() + scaled(Duration::from_secs(10));
    loop {
        let out = billing.cli(&["peek", "--json"]);
        assert!(out.status.success(), "peek: {}", stderr(&out));
        let json: serde_json::Value = serde_json::from_str(&stdout(&out)).unwrap();
        let ids: Vec<&str> = json["messages"]
            .as_array()
            .unwrap()
            .iter()
            .map(|m| m["message_id"].as_str().unwrap_or("-"))
            .collect();
        if ids.len() == 3 || std::time::Instant::now() > deadline {
            assert_eq!(
                ids,
                [
                    "waiting-billing-1",
                    "waiting-billing-2",
                    "waiting-billing-3"
                ]
            );
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // status reads only flushed WAL (asynchronous commits show up within wal_writer_delay).
    let status = |cli: &dyn Fn() -> std::process::Output, pending: i64| {
        let deadline = std::time::Instant::now() + scaled(Duration::from_secs(10));
        loop {
            let out = cli();
            let json: serde_json::Value = serde_json::from_str(&stdout(&out)).unwrap();
            if json["pending_outbox_messages"] == pending || std::time::Instant::now() > deadline {
                return json;
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    };
    let json = status(&|| shipping.cli(&["status", "--json"]), 2);
    assert_eq!(json["schema"], shipping.schema.as_str(), "{json}");
    assert_eq!(json["prefix"], shipping.prefix.as_str(), "{json}");
    assert_eq!(json["pending_outbox_messages"], 2, "{json}");
    assert_eq!(json["dead_letters"], 1, "{json}");
    let json = status(
        &|| ob.cli(&["status", "--json", "--publication", &ob.publication]),
        1,
    );
    assert_eq!(json["prefix"], "pgoutbox", "{json}");
    assert_eq!(json["pending_outbox_messages"], 1, "{json}");
    assert_eq!(json["dead_letters"], 0, "{json}");

    // Dead-letter commands act on their schema only.
    let out = billing.cli(&["dead-letters", "list", "--json"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let rows: serde_json::Value = serde_json::from_str(&stdout(&out)).unwrap();
    assert_eq!(rows.as_array().map(Vec::len), Some(1), "{rows}");
    let out = billing.cli(&["dead-letters", "purge", "--all"]);
    assert!(
        stdout(&out).contains("purged 1 dead letters"),
        "{}{}",
        stdout(&out),
        stderr(&out)
    );
    assert_eq!(dead_letters(&ob, &shipping.schema).len(), 1);

    // Teardown counts the schema's own waiting messages: shipping has 2, so it refuses.
    let out = shipping.cli(&["teardown"]);
    assert!(!out.status.success());
    assert!(
        stderr(&out).contains("still holds 2 unsent outbox messages"),
        "{}",
        stderr(&out)
    );
    let out = billing.cli(&["teardown", "--force"]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(
        ob.sql(&format!(
            "SELECT count(*) FROM \"{}\".stream_state",
            billing.schema
        ))
        .trim(),
        "0"
    );
    assert_eq!(
        ob.sql("SELECT count(*) FROM outbox.stream_state").trim(),
        "1",
        "the default outbox's record is kept"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn schemas_and_prefixes_are_validated_and_lockdown_stays_with_the_default_outbox() {
    let pg = Postgres::shared();
    let ob = Outbox::new(pg, &RabbitMq::shared().url(), "outboxes_bad").await;
    let setup = |extra: &[&str]| {
        let mut args = vec!["setup", "--publication", &ob.publication];
        args.extend_from_slice(extra);
        ob.cli(&args)
    };
    let refused = |extra: &[&str], needles: &[&str]| {
        let out = setup(extra);
        assert!(!out.status.success(), "{extra:?} succeeded");
        let e = stderr(&out);
        for n in needles {
            assert!(e.contains(n), "{extra:?}: {n:?} not in {e}");
        }
    };
    refused(
        &["--schema", "Billing"],
        &["--schema (PGOUTBOX_SCHEMA)", "\"Billing\"", "a-z"],
    );
    refused(&["--schema", "pg_billing"], &["--schema", "reserved"]);
    refused(
        &["--schema", "billing"],
        &["--schema billing needs --prefix"],
    );
    refused(
        &["--schema", "billing", "--prefix", "pgoutbox.lockdown"],
        &["--prefix (PGOUTBOX_PREFIX)", "lockdown markers"],
    );
    refused(
        &["--schema", "billing", "--prefix", "it's"],
        &["--prefix", "A-Z"],
    );
    refused(
        &["--schema", "billing", "--prefix", "pgoutbox"],
        &["schema outbox already writes prefix pgoutbox"],
    );
    refused(
        &["--schema", "billing", "--prefix", "billing", "--lockdown"],
        &[
            "--lockdown is supported for the default outbox",
            "--schema billing",
        ],
    );
    // Nothing was installed by the refusals.
    assert_eq!(
        ob.sql("SELECT count(*) FROM pg_namespace WHERE nspname = 'billing'")
            .trim(),
        "0"
    );

    let slot = unique("bad_b_slot");
    let run = |args: &[&str]| {
        std::process::Command::new(env!("CARGO_BIN_EXE_pgoutbox"))
            .args(args)
            .env("PGOUTBOX_HTTP_ADDR", "off")
            .output()
            .expect("run pgoutbox")
    };
    let url = ob.url();
    let pubname = unique("bad_b_pub");
    let base = [
        "setup",
        "--database-url",
        &url,
        "--slot",
        &slot,
        "--publication",
        &pubname,
        "--schema",
        "billing",
    ];
    let out = run(&[&base[..], &["--prefix", "billing"]].concat());
    assert!(out.status.success(), "{}", stderr(&out));
    // Again without --prefix: the stored one.
    let out = run(&base);
    assert!(
        stdout(&out).contains("schema billing, prefix billing"),
        "{}{}",
        stdout(&out),
        stderr(&out)
    );
    // Another prefix for the same schema is refused.
    let out = run(&[&base[..], &["--prefix", "billing2"]].concat());
    assert!(!out.status.success());
    assert!(
        stderr(&out).contains("writes prefix billing"),
        "{}",
        stderr(&out)
    );
    // And another schema may not take billing's prefix.
    let out = run(&[
        "setup",
        "--database-url",
        &url,
        "--slot",
        &unique("bad_c_slot"),
        "--publication",
        &pubname,
        "--schema",
        "other",
        "--prefix",
        "billing",
    ]);
    assert!(
        stderr(&out).contains("schema billing already writes prefix billing"),
        "{}",
        stderr(&out)
    );
    // run/check on a schema that was never set up name the fix.
    let out = run(&[
        "check",
        "--database-url",
        &url,
        "--amqp-url",
        &ob.amqp_url,
        "--slot",
        &slot,
        "--publication",
        &pubname,
        "--schema",
        "nosuch",
    ]);
    assert!(!out.status.success());
    assert!(
        stdout(&out).contains("setup --schema nosuch --prefix NAME")
            || stderr(&out).contains("setup --schema nosuch --prefix NAME"),
        "{}{}",
        stdout(&out),
        stderr(&out)
    );
    let out = run(&[
        "setup",
        "--database-url",
        &url,
        "--slot",
        &slot,
        "--publication",
        &pubname,
        "--schema",
        "billing",
        "--unlock",
    ]);
    assert!(
        stderr(&out).contains("--unlock is supported for the default outbox"),
        "{}",
        stderr(&out)
    );
    let out = run(&[
        "teardown",
        "--database-url",
        &url,
        "--slot",
        &slot,
        "--publication",
        &pubname,
        "--schema",
        "billing",
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
}

/// The delivery journal and the idempotency keys of a non-default outbox live in its schema:
/// `run --schema S --journal` writes `S.journal`, its retention task trims `S.idempotency`,
/// and `journal --schema S` reads them (regression: both used schema `outbox` whatever
/// `--schema` said, so a service's keys were never deleted).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_services_journal_and_idempotency_keys_live_in_its_schema() {
    let pg = Postgres::shared();
    let rmq = RabbitMq::shared();
    let ob = Outbox::new(pg, &rmq.url(), "ob_journal").await;
    let svc = Service::new(&ob, "jr").await;
    let schema = &svc.schema;
    ob.sql(&format!(
        "INSERT INTO \"{schema}\".idempotency (tenant, idempotency_key, message_id, created_at)
         VALUES ('', 'expired', 'm-old', now() - interval '30 days')"
    ));
    let streamer = svc.run_with(&["--journal", "--maintenance-interval", "1s"]);
    ob.sql(&format!(
        "SELECT \"{schema}\".emit('t.j', '{{}}', message_id => 'jr-1', idempotency_key => 'fresh')"
    ));
    let got = drain_queue(&ob.amqp_url, &svc.queue, 1, scaled(Duration::from_secs(20))).await;
    assert_eq!(sorted_ids(&got), ["jr-1"], "{}", streamer.log());
    let count = |table: &str, cond: &str| -> i64 {
        ob.sql(&format!("SELECT count(*) FROM {table} WHERE {cond}"))
            .trim()
            .parse()
            .unwrap()
    };
    let journal = format!("\"{schema}\".journal");
    let keys = format!("\"{schema}\".idempotency");
    assert!(
        crate::support::wait_until(scaled(Duration::from_secs(20)), || async {
            count(&journal, "message_id = 'jr-1'") == 1
                && count(&keys, "idempotency_key = 'expired'") == 0
        })
        .await,
        "journal rows {}, expired keys {}:\n{}",
        count(&journal, "message_id = 'jr-1'"),
        count(&keys, "idempotency_key = 'expired'"),
        streamer.log()
    );
    assert_eq!(
        count(&keys, "idempotency_key = 'fresh'"),
        1,
        "the new key is kept"
    );
    assert_eq!(
        count("outbox.journal", "true"),
        0,
        "nothing in the default outbox's journal"
    );
    // The retention task's log names the service's table, not outbox's.
    let log = streamer.log();
    assert!(
        log.contains(&format!(
            "deleted expired idempotency keys (\"{schema}\".idempotency)"
        )),
        "{log}"
    );
    assert!(!log.contains("outbox.idempotency"), "{log}");
    let out = svc.cli(&["journal", "jr-1"]);
    assert!(
        out.status.success() && stdout(&out).contains("id=jr-1"),
        "{}{}",
        stdout(&out),
        stderr(&out)
    );
}

/// `dead-letters requeue --schema S` re-emits under the service's own prefix, so the
/// service's streamer (the only one running) publishes it again; with the default prefix
/// it would wait in no stream that is read and never arrive.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_services_dead_letter_is_requeued_into_its_own_stream() {
    let pg = Postgres::shared();
    let rmq = RabbitMq::shared();
    let ob = Outbox::new(pg, &rmq.url(), "ob_requeue").await;
    let svc = Service::new(&ob, "rq").await;
    let schema = &svc.schema;
    // An exchange nobody is bound to yet: the message is returned and dead-lettered.
    let nowhere = unique("rq_nowhere");
    let nowhere_q = unique("rq_nowhere_q");
    let streamer = svc.run();
    assert!(
        streamer
            .wait_for_log("streaming", scaled(Duration::from_secs(20)))
            .await,
        "{}",
        streamer.log()
    );
    ob.sql(&format!(
        "SELECT \"{schema}\".emit('t.rq', '{{\"n\": 1}}', message_id => 'rq-1', exchange => '{nowhere}')"
    ));
    let deadline = std::time::Instant::now() + scaled(Duration::from_secs(20));
    while dead_letters(&ob, schema) != ["returned|rq-1"] {
        assert!(
            std::time::Instant::now() < deadline,
            "not dead-lettered: {:?}\n{}",
            dead_letters(&ob, schema),
            streamer.log()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(dead_letters(&ob, "outbox"), Vec::<String>::new());

    // Bind a queue, then requeue through the service's schema.
    declare_bound_queue(&ob.amqp_url, &nowhere, &nowhere_q, "#").await;
    let out = svc.cli(&["dead-letters", "requeue", "--all"]);
    assert!(
        out.status.success() && stdout(&out).contains("requeued 1 dead letters"),
        "{}{}",
        stdout(&out),
        stderr(&out)
    );
    let got = drain_queue(&ob.amqp_url, &nowhere_q, 1, scaled(Duration::from_secs(20))).await;
    assert_eq!(sorted_ids(&got), ["rq-1"], "{}", streamer.log());
    assert_eq!(got[0].body, b"{\"n\": 1}".to_vec());
    assert_eq!(got[0].exchange, nowhere);
    assert_eq!(
        ob.sql(&format!(
            "SELECT count(*) FROM \"{schema}\".dead_letter WHERE requeued_at IS NOT NULL"
        ))
        .trim(),
        "1"
    );
    // Requeued once: a second requeue finds nothing left to requeue.
    let out = svc.cli(&["dead-letters", "requeue", "--all"]);
    assert!(
        stdout(&out).contains("requeued 0 dead letters"),
        "{}{}",
        stdout(&out),
        stderr(&out)
    );
}
