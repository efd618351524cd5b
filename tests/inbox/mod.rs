//! The consumer-side inbox: `sql/inbox.sql` at the SQL level, and `pgoutbox::inbox` (in
//! process and as the `inbox_consumer` example process) against real RabbitMQ queues with a
//! dead-letter exchange: duplicates, SIGKILL and restart, two consumers, handler errors, and
//! the redelivery bound.

use std::path::PathBuf;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use lapin::options::{
    BasicPublishOptions, ConfirmSelectOptions, ExchangeDeclareOptions, QueueBindOptions,
    QueueDeclareOptions,
};
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use lapin::{BasicProperties, ExchangeKind};
use pgoutbox::inbox::{
    Handler, HandlerError, Inbox, InboxConfig, InboxMessage, InboxStats, INBOX_SQL,
};
use tokio_postgres::Transaction;

use crate::support::{
    amqp_connect, drain_queue, queue_len, scaled, unique, wait_until, Postgres, RabbitMq, Streamer,
};

/// A consumer database with `sql/inbox.sql` installed (on its own: no `pgoutbox setup`), and
/// a queue with a dead-letter exchange and queue.
struct Rig {
    pg: &'static Postgres,
    db: String,
    amqp_url: String,
    queue: String,
    dead_letters: String,
}

impl Rig {
    async fn new(name: &str, queue_type: &str) -> Rig {
        let pg = Postgres::shared();
        let rabbit = RabbitMq::shared();
        let db = pg.create_database(name).await;
        let client = pg.client(&db).await;
        client
            .batch_execute(INBOX_SQL)
            .await
            .expect("install sql/inbox.sql");
        client
            .batch_execute(
                "CREATE TABLE ledger (message_id text NOT NULL, tenant text, attempt int NOT NULL)",
            )
            .await
            .expect("ledger");
        let rig = Rig {
            pg,
            db,
            amqp_url: rabbit.url(),
            queue: unique(&format!("{name}_q")),
            dead_letters: unique(&format!("{name}_dlq")),
        };
        rig.declare(queue_type).await;
        rig
    }

    async fn declare(&self, queue_type: &str) {
        let conn = amqp_connect(&self.amqp_url).await;
        let ch = conn.create_channel().await.expect("channel");
        let dlx = format!("{}_dlx", self.queue);
        ch.exchange_declare(
            dlx.as_str().into(),
            ExchangeKind::Fanout,
            ExchangeDeclareOptions {
                durable: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await
        .expect("dlx");
        ch.queue_declare(
            self.dead_letters.as_str().into(),
            QueueDeclareOptions {
                durable: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await
        .expect("dlq");
        ch.queue_bind(
            self.dead_letters.as_str().into(),
            dlx.as_str().into(),
            "".into(),
            QueueBindOptions::default(),
            FieldTable::default(),
        )
        .await
        .expect("bind dlq");
        let mut args = FieldTable::default();
        args.insert(
            "x-queue-type".into(),
            AMQPValue::LongString(queue_type.into()),
        );
        args.insert(
            "x-dead-letter-exchange".into(),
            AMQPValue::LongString(dlx.as_str().into()),
        );
        ch.queue_declare(
            self.queue.as_str().into(),
            QueueDeclareOptions {
                durable: true,
                ..Default::default()
            },
            args,
        )
        .await
        .expect("queue");
        let _ = conn.close(200, "bye".into()).await;
    }

    /// Publishes `(message id, tenant, body)` to the queue (default exchange), confirmed.
    async fn publish(&self, messages: &[(Option<&str>, Option<&str>, Vec<u8>)]) {
        let conn = amqp_connect(&self.amqp_url).await;
        let ch = conn.create_channel().await.expect("channel");
        ch.confirm_select(ConfirmSelectOptions::default())
            .await
            .expect("confirm_select");
        let mut confirms = Vec::new();
        for (id, tenant, body) in messages {
            let mut props = BasicProperties::default().with_delivery_mode(2);
            if let Some(id) = id {
                props = props.with_message_id(ShortString::from(*id));
            }
            if let Some(t) = tenant {
                let mut h = FieldTable::default();
                h.insert(
                    "x-pgoutbox-tenant".into(),
                    AMQPValue::LongString(LongString::from(*t)),
                );
                props = props.with_headers(h);
            }
            confirms.push(
                ch.basic_publish(
                    "".into(),
                    self.queue.as_str().into(),
                    BasicPublishOptions::default(),
                    body,
                    props,
                )
                .await
                .expect("publish"),
            );
        }
        for c in confirms {
            assert!(c.await.expect("confirm").is_ack());
        }
        let _ = conn.close(200, "bye".into()).await;
    }

    fn url(&self) -> String {
        self.pg.url(&self.db)
    }

    fn sql(&self, sql: &str) -> String {
        self.pg.psql(&self.db, sql).trim().to_owned()
    }

    fn count(&self, sql: &str) -> i64 {
        self.sql(sql).parse().unwrap_or_else(|_| panic!("{sql}"))
    }

    /// Starts an in-process inbox with `handler`; stop it with [`Running::stop`].
    async fn start_inbox<H: Handler + 'static>(&self, config: InboxConfig, handler: H) -> Running {
        let client = self.pg.client(&self.db).await;
        let conn = amqp_connect(&self.amqp_url).await;
        let channel = conn.create_channel().await.expect("channel");
        let inbox = Inbox::new(config, client, channel, handler).expect("config");
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let task = tokio::spawn(inbox.run(async move {
            let _ = stopped.await;
        }));
        Running { stop, task, conn }
    }

    async fn queue_len(&self, queue: &str) -> u32 {
        queue_len(&self.amqp_url, queue).await
    }

    /// Starts the example consumer on this rig.
    fn consumer(&self, extra: &[&str]) -> Streamer {
        let mut args = vec![
            "--database-url".to_owned(),
            self.url(),
            "--amqp-url".into(),
            self.amqp_url.clone(),
            "--queue".into(),
            self.queue.clone(),
        ];
        args.extend(extra.iter().map(|s| s.to_string()));
        Streamer::spawn_program(
            example_binary().to_str().expect("utf-8 path"),
            &args,
            &[("RUST_LOG", "info,pgoutbox::inbox=debug")],
        )
    }

    /// `(ledger rows, distinct message ids)` of the example's ledger.
    fn applied(&self) -> (i64, i64) {
        let row =
            self.sql("SELECT count(*) || ',' || count(DISTINCT message_id) FROM account_ledger");
        let (a, b) = row.split_once(',').unwrap_or(("0", "0"));
        (a.parse().unwrap_or(0), b.parse().unwrap_or(0))
    }

    /// The example's ledger count, 0 until the example created its tables (names resolve at
    /// parse time, hence two statements).
    fn ledger_rows(&self) -> i64 {
        if self.sql("SELECT to_regclass('account_ledger') IS NOT NULL") != "t" {
            return 0;
        }
        self.count("SELECT count(*) FROM account_ledger")
    }
}

/// The example binary, built once per test process (`cargo test --test main` builds no
/// examples; a fresh `cargo build --example` is a no-op when it is up to date). When it is
/// at least as new as this test binary, the cargo invocation that built this binary built it
/// too (`cargo test --no-run`, as deploy/test.sh runs it), and it is used as it is: under
/// nextest every test is a process, and each `cargo build` waits for the target directory's
/// lock while another cargo (the fuzz smoke's build, say) holds it (an inbox test took 239 s
/// so in CI).
fn example_binary() -> PathBuf {
    static PATH: OnceLock<PathBuf> = OnceLock::new();
    PATH.get_or_init(|| {
        let exe = std::env::current_exe().expect("current_exe");
        // target/debug/deps/main-HASH -> target/debug/examples/inbox_consumer
        let path = exe
            .parent()
            .and_then(|d| d.parent())
            .expect("target dir")
            .join("examples")
            .join("inbox_consumer");
        let modified = |p: &std::path::Path| std::fs::metadata(p).and_then(|m| m.modified()).ok();
        if let (Some(example), Some(this)) = (modified(&path), modified(&exe)) {
            if example >= this {
                return path;
            }
        }
        let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
        let mut build = std::process::Command::new(cargo);
        // Without the CARGO_* variables cargo set for this test process: build scripts (ring's)
        // track CARGO_MANIFEST_DIR, CARGO_PKG_NAME, ..., and would rebuild under other values.
        for (k, _) in std::env::vars_os() {
            let k = k.to_string_lossy().into_owned();
            if (k.starts_with("CARGO_") && k != "CARGO_HOME" && k != "CARGO_TARGET_DIR")
                || k == "OUT_DIR"
            {
                build.env_remove(k);
            }
        }
        let status = build
            .args(["build", "--example", "inbox_consumer"])
            .current_dir(env!("CARGO_MANIFEST_DIR"))
            .status()
            .expect("run cargo build --example inbox_consumer");
        assert!(
            status.success(),
            "cargo build --example inbox_consumer failed"
        );
        assert!(path.exists(), "{} missing", path.display());
        path
    })
    .clone()
}

/// An in-process inbox.
struct Running {
    stop: tokio::sync::oneshot::Sender<()>,
    task: tokio::task::JoinHandle<Result<InboxStats, pgoutbox::inbox::Error>>,
    conn: lapin::Connection,
}

impl Running {
    async fn stop(self) -> InboxStats {
        let _ = self.stop.send(());
        let stats = self.task.await.expect("join").expect("inbox run");
        let _ = self.conn.close(200, "bye".into()).await;
        stats
    }
}

fn credit(account: &str, amount: i64) -> Vec<u8> {
    serde_json::to_vec(&serde_json::json!({"account": account, "amount": amount})).expect("json")
}

/// A handler that records each application in `ledger`, and fails (after writing, so the
/// rollback is visible) while `fail` says so.
struct Recording<F> {
    calls: Arc<AtomicU32>,
    fail: F,
}

impl<F: Fn(&InboxMessage) -> bool + Send + Sync> Handler for Recording<F> {
    async fn handle(
        &self,
        tx: &Transaction<'_>,
        message: &InboxMessage,
    ) -> Result<(), HandlerError> {
        self.calls.fetch_add(1, Ordering::SeqCst);
        tx.execute(
            "INSERT INTO ledger (message_id, tenant, attempt) VALUES ($1, $2, $3)",
            &[
                &message.message_id,
                &message.tenant,
                &(message.attempt as i32),
            ],
        )
        .await?;
        if (self.fail)(message) {
            return Err(format!(
                "refusing {} on attempt {}",
                message.message_id, message.attempt
            )
            .into());
        }
        Ok(())
    }
}

// ---------------------------------------------------------------------------------------
// SQL level

#[tokio::test]
async fn claim_is_true_once_per_consumer_tenant_and_id_and_never_null() {
    let pg = Postgres::shared();
    let db = pg.create_database("inbox_claim").await;
    let client = pg.client(&db).await;
    // Stands alone in a database pgoutbox never set up, and installs twice.
    client.batch_execute(INBOX_SQL).await.expect("install");
    client
        .batch_execute(INBOX_SQL)
        .await
        .expect("install again");
    let claim = |c: Option<&'static str>, m: Option<&'static str>, t: Option<&'static str>| {
        let client = &client;
        async move {
            let row = client
                .query_one("SELECT outbox.inbox_claim($1, $2, $3)", &[&c, &m, &t])
                .await?;
            Ok::<Option<bool>, tokio_postgres::Error>(row.get(0))
        }
    };
    let yes = Some(true);
    let no = Some(false);
    assert_eq!(claim(Some("c"), Some("m1"), None).await.unwrap(), yes);
    assert_eq!(claim(Some("c"), Some("m1"), None).await.unwrap(), no);
    assert_eq!(
        claim(Some("c"), Some("m1"), Some("")).await.unwrap(),
        no,
        "'' is the NULL tenant"
    );
    assert_eq!(claim(Some("c"), Some("m1"), Some("t1")).await.unwrap(), yes);
    assert_eq!(claim(Some("c"), Some("m1"), Some("t1")).await.unwrap(), no);
    assert_eq!(claim(Some("c"), Some("m1"), Some("t2")).await.unwrap(), yes);
    assert_eq!(claim(Some("other"), Some("m1"), None).await.unwrap(), yes);
    assert_eq!(claim(Some("c"), Some("m2"), None).await.unwrap(), yes);
    // The two-argument form (tenant defaults to NULL).
    let two: bool = client
        .query_one("SELECT outbox.inbox_claim('c', 'm2')", &[])
        .await
        .unwrap()
        .get(0);
    assert!(!two);
    let rows: i64 = client
        .query_one("SELECT count(*) FROM outbox.inbox WHERE tenant = ''", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(rows, 3, "NULL tenants stored as ''");

    for (c, m, arg) in [
        (None, Some("m"), "consumer"),
        (Some(""), Some("m"), "consumer"),
        (Some("c"), None, "message_id"),
        (Some("c"), Some(""), "message_id"),
    ] {
        let err = claim(c, m, None).await.expect_err(arg);
        let db = err.as_db_error().expect("db error");
        assert_eq!(db.code().code(), "22023", "{arg}");
        assert!(
            db.message().contains(&format!("argument {arg}")),
            "{}",
            db.message()
        );
        assert!(db.hint().is_some(), "{arg}: a hint");
    }
}

#[tokio::test]
async fn concurrent_claims_of_one_key_wait_and_only_one_commits() {
    let pg = Postgres::shared();
    let db = pg.create_database("inbox_race").await;
    let mut first = pg.client(&db).await;
    first.batch_execute(INBOX_SQL).await.expect("install");
    for first_commits in [true, false] {
        let id = if first_commits {
            "race-commit"
        } else {
            "race-rollback"
        };
        let tx = first.transaction().await.unwrap();
        let mine: bool = tx
            .query_one("SELECT outbox.inbox_claim('c', $1)", &[&id])
            .await
            .unwrap()
            .get(0);
        assert!(mine);
        let mut second = pg.client(&db).await;
        let pid: i32 = second
            .query_one("SELECT pg_backend_pid()", &[])
            .await
            .unwrap()
            .get(0);
        let waiter = tokio::spawn(async move {
            let tx = second.transaction().await.unwrap();
            let got: bool = tx
                .query_one("SELECT outbox.inbox_claim('c', $1)", &[&id])
                .await
                .unwrap()
                .get(0);
            tx.commit().await.unwrap();
            got
        });
        // The second claim blocks on the first transaction's row.
        let probe = pg.client(&db).await;
        let waiting = wait_until(scaled(Duration::from_secs(10)), || async {
            probe
                .query_one(
                    "SELECT coalesce(wait_event_type = 'Lock', false) FROM pg_stat_activity WHERE pid = $1",
                    &[&pid],
                )
                .await
                .map(|r| r.get::<_, bool>(0))
                .unwrap_or(false)
        })
        .await;
        assert!(
            waiting,
            "the second claim should wait for the first transaction"
        );
        assert!(!waiter.is_finished());
        if first_commits {
            tx.commit().await.unwrap();
        } else {
            tx.rollback().await.unwrap();
        }
        let second_claimed = waiter.await.unwrap();
        assert_eq!(
            second_claimed, !first_commits,
            "first_commits = {first_commits}"
        );
    }
}

#[tokio::test]
async fn purge_deletes_old_rows_in_batches_and_keeps_new_ones() {
    let pg = Postgres::shared();
    let db = pg.create_database("inbox_purge").await;
    let client = pg.client(&db).await;
    client.batch_execute(INBOX_SQL).await.expect("install");
    client
        .batch_execute(
            "INSERT INTO outbox.inbox (consumer, tenant, message_id, received_at)
               SELECT 'c', '', 'old-' || i, now() - interval '10 days' FROM generate_series(1, 2500) i;
             INSERT INTO outbox.inbox (consumer, message_id, received_at)
               SELECT 'c', 'new-' || i, now() - interval '1 day' FROM generate_series(1, 10) i;",
        )
        .await
        .unwrap();
    let purge = |retention: &'static str, batch: i32| {
        let client = &client;
        async move {
            client
                .query_one(
                    "SELECT outbox.inbox_purge($1::text::interval, $2)",
                    &[&retention, &batch],
                )
                .await
                .map(|r| r.get::<_, i64>(0))
        }
    };
    assert_eq!(purge("7 days", 1000).await.unwrap(), 2500);
    assert_eq!(purge("7 days", 1000).await.unwrap(), 0);
    let left: i64 = client
        .query_one("SELECT count(*) FROM outbox.inbox", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(left, 10);
    // The default batch size, and a batch size that divides nothing evenly.
    let default: i64 = client
        .query_one("SELECT outbox.inbox_purge(interval '12 hours')", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(default, 10);
    for (retention, batch, arg) in [("-1 day", 10, "retention"), ("1 day", 0, "batch_size")] {
        let err = purge(retention, batch).await.expect_err(arg);
        let db = err.as_db_error().expect("db error");
        assert_eq!(db.code().code(), "22023");
        assert!(
            db.message().contains(&format!("argument {arg}")),
            "{}",
            db.message()
        );
    }
}

// ---------------------------------------------------------------------------------------
// The Rust helper, in process

#[tokio::test]
async fn a_handler_error_rolls_back_and_the_message_is_applied_later_once() {
    let rig = Rig::new("inbox_retry", "classic").await;
    rig.publish(&[
        (Some("flaky"), Some("acme"), b"{}".to_vec()),
        (Some("steady"), None, b"{}".to_vec()),
    ])
    .await;
    let calls = Arc::new(AtomicU32::new(0));
    let handler = Recording {
        calls: calls.clone(),
        fail: |m: &InboxMessage| m.message_id == "flaky" && m.attempt < 3,
    };
    let inbox = rig
        .start_inbox(InboxConfig::new("svc", rig.queue.clone()), handler)
        .await;
    let done = wait_until(scaled(Duration::from_secs(20)), || async {
        rig.count("SELECT count(*) FROM ledger") >= 2 && rig.queue_len(&rig.queue).await == 0
    })
    .await;
    let stats = inbox.stop().await;
    assert!(done, "not applied: {stats:?}");
    // The two failed attempts wrote a ledger row each and were rolled back.
    assert_eq!(
        rig.sql("SELECT string_agg(message_id || '/' || coalesce(tenant, '-') || '/' || attempt, ' ' ORDER BY message_id) FROM ledger"),
        "flaky/acme/3 steady/-/1"
    );
    assert_eq!(calls.load(Ordering::SeqCst), 4);
    assert_eq!(
        (
            stats.applied,
            stats.requeued,
            stats.rejected,
            stats.duplicates
        ),
        (2, 2, 0, 0)
    );
    assert_eq!(
        rig.count("SELECT count(*) FROM outbox.inbox WHERE consumer = 'svc'"),
        2
    );
    assert_eq!(rig.queue_len(&rig.queue).await, 0);
    assert_eq!(rig.queue_len(&rig.dead_letters).await, 0);
}

async fn poison_is_dead_lettered_after_the_bound(queue_type: &str) {
    let rig = Rig::new(&format!("inbox_poison_{queue_type}"), queue_type).await;
    rig.publish(&[
        (Some("good-1"), None, b"{}".to_vec()),
        (Some("poison"), Some("t"), b"{}".to_vec()),
        (None, None, b"no id".to_vec()),
        (Some("good-2"), None, b"{}".to_vec()),
    ])
    .await;
    let calls = Arc::new(AtomicU32::new(0));
    let poison_calls = Arc::new(AtomicU32::new(0));
    let pc = poison_calls.clone();
    let handler = Recording {
        calls: calls.clone(),
        fail: move |m: &InboxMessage| {
            if m.message_id == "poison" {
                pc.fetch_add(1, Ordering::SeqCst);
                true
            } else {
                false
            }
        },
    };
    let mut config = InboxConfig::new("svc", rig.queue.clone());
    config.max_deliveries = 3;
    let inbox = rig.start_inbox(config, handler).await;
    let done = wait_until(scaled(Duration::from_secs(20)), || async {
        rig.count("SELECT count(*) FROM ledger") >= 2
            && rig.queue_len(&rig.dead_letters).await >= 2
            && rig.queue_len(&rig.queue).await == 0
    })
    .await;
    let stats = inbox.stop().await;
    assert!(done, "{queue_type}: not settled: {stats:?}");
    assert_eq!(
        poison_calls.load(Ordering::SeqCst),
        3,
        "attempted exactly max_deliveries times"
    );
    assert_eq!(
        rig.sql("SELECT string_agg(message_id, ' ' ORDER BY message_id) FROM ledger"),
        "good-1 good-2"
    );
    assert_eq!(
        (stats.applied, stats.requeued, stats.rejected),
        (2, 2, 2),
        "{queue_type}: {stats:?}"
    );
    assert_eq!(
        rig.count("SELECT count(*) FROM outbox.inbox WHERE message_id = 'poison'"),
        0
    );
    assert_eq!(rig.queue_len(&rig.queue).await, 0);
    // Both rejected messages reached the dead-letter queue: the poison one and the one without id.
    let dead = drain_queue(
        &rig.amqp_url,
        &rig.dead_letters,
        2,
        scaled(Duration::from_secs(5)),
    )
    .await;
    let mut ids: Vec<Option<String>> = dead.iter().map(|m| m.message_id.clone()).collect();
    ids.sort();
    assert_eq!(ids, vec![None, Some("poison".to_owned())]);
}

#[tokio::test]
async fn a_message_failing_every_time_is_dead_lettered_after_the_bound_classic() {
    poison_is_dead_lettered_after_the_bound("classic").await;
}

#[tokio::test]
async fn a_message_failing_every_time_is_dead_lettered_after_the_bound_quorum() {
    // Counted by the broker's x-delivery-count header here, not in process.
    poison_is_dead_lettered_after_the_bound("quorum").await;
}

#[tokio::test]
async fn inbox_refuses_a_database_without_the_inbox_sql() {
    let pg = Postgres::shared();
    let db = pg.create_database("inbox_missing").await;
    let conn = amqp_connect(&RabbitMq::shared().url()).await;
    let channel = conn.create_channel().await.expect("channel");
    let inbox = Inbox::new(
        InboxConfig::new("svc", "whatever"),
        pg.client(&db).await,
        channel,
        Recording {
            calls: Arc::new(AtomicU32::new(0)),
            fail: |_: &InboxMessage| false,
        },
    )
    .expect("config");
    let err = inbox
        .run(std::future::pending())
        .await
        .expect_err("not installed");
    let text = err.to_string();
    assert!(
        text.contains("outbox.inbox_claim") && text.contains("sql/inbox.sql") && text.contains(&db),
        "{text}"
    );
}

// ---------------------------------------------------------------------------------------
// The example consumer as a process

#[tokio::test]
async fn duplicates_published_on_purpose_are_applied_once() {
    let rig = Rig::new("inbox_dups", "classic").await;
    // Ids 0..10 were applied and committed by a consumer that crashed before its ack
    // (the commit-then-ack window): their claim is already in the inbox.
    rig.sql(
        "CREATE TABLE account_balance (account text PRIMARY KEY, balance bigint NOT NULL);
         CREATE TABLE account_ledger (message_id text NOT NULL, account text NOT NULL, amount bigint NOT NULL, applied_at timestamptz NOT NULL DEFAULT now());
         INSERT INTO outbox.inbox (consumer, message_id) SELECT 'inbox-example', 'e-' || i FROM generate_series(0, 9) i;",
    );
    let ids: Vec<String> = (0..200).map(|i| format!("e-{i}")).collect();
    let mut messages = Vec::new();
    for round in 0..2 {
        for (i, id) in ids.iter().enumerate() {
            let _ = round;
            messages.push((Some(id.as_str()), None, credit(&format!("a-{}", i % 7), 1)));
        }
    }
    rig.publish(&messages).await;
    let consumer = rig.consumer(&["--prefetch", "20"]);
    // Done when the consumer has handled all 400 deliveries. The queue's message count
    // alone is no sign: it counts ready messages only, and up to `--prefetch` deliveries
    // can still be unacked in the consumer when it reads 0.
    let done = wait_until(scaled(Duration::from_secs(60)), || async {
        rig.ledger_rows() >= 190 && consumer.log_count("inbox: duplicate") >= 210
    })
    .await;
    assert!(done, "not drained: {:?}\n{}", rig.applied(), consumer.log());
    consumer.stop(scaled(Duration::from_secs(10))).await;
    // With no consumer left, anything unacked would be back in the ready count.
    assert_eq!(rig.queue_len(&rig.queue).await, 0, "every delivery acked");
    assert_eq!(rig.applied(), (190, 190), "each new id applied once");
    assert_eq!(rig.count("SELECT sum(balance) FROM account_balance"), 190);
    assert_eq!(
        rig.count("SELECT count(*) FROM account_ledger WHERE message_id IN (SELECT 'e-' || i FROM generate_series(0, 9) i)"),
        0,
        "already claimed ids are not applied again"
    );
    assert_eq!(
        consumer.log_count("inbox: duplicate"),
        210,
        "{}",
        consumer.log()
    );
    assert_eq!(rig.queue_len(&rig.dead_letters).await, 0);
}

#[tokio::test]
async fn a_consumer_killed_mid_batch_and_restarted_applies_each_event_once() {
    let rig = Rig::new("inbox_kill", "classic").await;
    let n = 400;
    let ids: Vec<String> = (0..n).map(|i| format!("k-{i}")).collect();
    let messages: Vec<_> = ids
        .iter()
        .enumerate()
        .map(|(i, id)| {
            (
                Some(id.as_str()),
                Some("tenant-k"),
                credit(&format!("a-{}", i % 5), 2),
            )
        })
        .collect();
    rig.publish(&messages).await;
    let first = rig.consumer(&["--prefetch", "50", "--work-ms", "5"]);
    let started = wait_until(scaled(Duration::from_secs(60)), || async {
        rig.ledger_rows() >= 60
    })
    .await;
    assert!(started, "first consumer applied nothing:\n{}", first.log());
    first.kill9();
    let (applied_before, _) = rig.applied();
    assert!(
        applied_before < n as i64,
        "killed after the whole batch ({applied_before})"
    );
    // Everything not acked is back in the queue.
    let back = wait_until(scaled(Duration::from_secs(30)), || async {
        rig.queue_len(&rig.queue).await as i64 >= n as i64 - applied_before
    })
    .await;
    assert!(back, "unacked deliveries did not return to the queue");

    let second = rig.consumer(&["--prefetch", "50"]);
    let done = wait_until(scaled(Duration::from_secs(60)), || async {
        rig.ledger_rows() >= n as i64 && rig.queue_len(&rig.queue).await == 0
    })
    .await;
    assert!(done, "not drained: {:?}\n{}", rig.applied(), second.log());
    second.stop(scaled(Duration::from_secs(10))).await;
    assert_eq!(
        rig.applied(),
        (n as i64, n as i64),
        "each event applied exactly once"
    );
    assert_eq!(
        rig.count("SELECT sum(balance) FROM account_balance"),
        2 * n as i64
    );
    assert_eq!(
        rig.count("SELECT count(*) FROM outbox.inbox WHERE tenant = 'tenant-k'"),
        n as i64
    );
    // The kill did return in-flight deliveries: the restarted consumer saw redeliveries.
    let redelivered = second.log_count("redelivered=true");
    assert!(
        redelivered > 0,
        "no redelivery after the kill:\n{}",
        second.log()
    );
    eprintln!("killed after {applied_before} of {n}; {redelivered} redeliveries after the restart");
}

#[tokio::test]
async fn two_consumers_on_one_queue_apply_each_event_once() {
    let rig = Rig::new("inbox_two", "classic").await;
    let n = 300;
    let ids: Vec<String> = (0..n).map(|i| format!("t-{i}")).collect();
    let mut messages = Vec::new();
    // Each id twice in a row: the two copies usually go to different consumers.
    for (i, id) in ids.iter().enumerate() {
        for _ in 0..2 {
            messages.push((Some(id.as_str()), None, credit(&format!("a-{}", i % 3), 1)));
        }
    }
    let a = rig.consumer(&["--prefetch", "1", "--work-ms", "1"]);
    let b = rig.consumer(&["--prefetch", "1", "--work-ms", "1"]);
    // Both are consuming before the first message arrives.
    for c in [&a, &b] {
        assert!(
            c.wait_for_log("inbox consuming", scaled(Duration::from_secs(20)))
                .await,
            "{}",
            c.log()
        );
    }
    rig.publish(&messages).await;
    // Done when the two consumers together handled all 2n deliveries (see the duplicates
    // test: a ready count of 0 can still leave deliveries unacked in a consumer).
    let done = wait_until(scaled(Duration::from_secs(60)), || async {
        rig.ledger_rows() >= n as i64
            && a.log_count("inbox: duplicate") + b.log_count("inbox: duplicate") >= n
    })
    .await;
    assert!(
        done,
        "not drained: {:?}\n{}\n{}",
        rig.applied(),
        a.log(),
        b.log()
    );
    for c in [&a, &b] {
        c.sigterm();
        assert!(c.wait_exit(scaled(Duration::from_secs(10))).await.is_some());
    }
    assert_eq!(rig.queue_len(&rig.queue).await, 0, "every delivery acked");
    assert_eq!(
        rig.applied(),
        (n as i64, n as i64),
        "each event applied exactly once"
    );
    assert_eq!(
        rig.count("SELECT sum(balance) FROM account_balance"),
        n as i64
    );
    let (applied_a, applied_b) = (a.log_count("inbox: applied"), b.log_count("inbox: applied"));
    let (dup_a, dup_b) = (
        a.log_count("inbox: duplicate"),
        b.log_count("inbox: duplicate"),
    );
    assert_eq!(applied_a + applied_b, n);
    assert_eq!(dup_a + dup_b, n);
    assert!(
        applied_a > 0 && applied_b > 0,
        "both consumers worked: {applied_a} / {applied_b}"
    );
    eprintln!("applied {applied_a} + {applied_b}, duplicates {dup_a} + {dup_b}");
}

#[tokio::test]
async fn setup_installs_the_inbox() {
    let pg = Postgres::shared();
    let ob =
        crate::support::Outbox::new_without_queue(pg, &RabbitMq::shared().url(), "inbox_setup")
            .await;
    assert_eq!(
        ob.sql(
            "SELECT to_regclass('outbox.inbox') IS NOT NULL
                AND to_regprocedure('outbox.inbox_claim(text, text, text)') IS NOT NULL
                AND to_regprocedure('outbox.inbox_purge(interval, integer)') IS NOT NULL"
        )
        .trim(),
        "t"
    );
    assert_eq!(ob.sql("SELECT outbox.inbox_claim('c', 'm')").trim(), "t");
}

/// Issue 31: one inbox on several queues (`InboxConfig::with_queues`, as behind the
/// consistent-hash topology) applies each queue's messages once, and stops cleanly.
#[tokio::test]
async fn one_inbox_consumes_several_queues() {
    let rig = Rig::new("inbox_multi", "quorum").await;
    // A second queue, declared like the first (its database is not used).
    let other = Rig::new("inbox_multi_b", "quorum").await;
    let ids: Vec<String> = (0..20).map(|i| format!("m-{i}")).collect();
    let on = |range: std::ops::Range<usize>| -> Vec<(Option<&str>, Option<&str>, Vec<u8>)> {
        ids[range]
            .iter()
            .map(|id| (Some(id.as_str()), None, b"{}".to_vec()))
            .collect()
    };
    rig.publish(&on(0..10)).await;
    other.publish(&on(10..20)).await;
    let calls = Arc::new(AtomicU32::new(0));
    let handler = Recording {
        calls: calls.clone(),
        fail: |_: &InboxMessage| false,
    };
    let inbox = rig
        .start_inbox(
            InboxConfig::with_queues("svc", [rig.queue.clone(), other.queue.clone()]),
            handler,
        )
        .await;
    // Ready counts exclude what the inbox holds unacked: wait for the ledger too.
    let done = wait_until(scaled(Duration::from_secs(30)), || async {
        rig.count("SELECT count(*) FROM ledger") >= 20
            && rig.queue_len(&rig.queue).await == 0
            && rig.queue_len(&other.queue).await == 0
    })
    .await;
    let stats = inbox.stop().await;
    assert!(done, "both queues drained: {stats:?}");
    assert_eq!(
        rig.sql("SELECT count(*) || '/' || count(DISTINCT message_id) FROM ledger"),
        "20/20",
        "every message of both queues applied once"
    );
    assert_eq!(stats.applied, 20, "{stats:?}");
    assert_eq!(calls.load(Ordering::SeqCst), 20);
}
