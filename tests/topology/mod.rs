//! Issue 31, item 4, "Consumers that scale out": `pgoutbox declare-topology` declares the
//! topology people run (Q quorum queues with single active consumer behind a consistent-hash
//! exchange hashing `x-pgoutbox-aggregate-id`), idempotently, says what differs on an
//! existing one, and refuses with the command that enables the plugin when it is off; two
//! consumer processes on the same queues stand by for each other, and each aggregate's order
//! holds across a takeover.

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use lapin::options::QueueDeclareOptions;
use lapin::types::FieldTable;

use crate::support::cli::{pgoutbox, stderr, stdout};
use crate::support::{self, amqp_connect, scaled, Outbox, Postgres, RabbitMq, Streamer};

/// `pgoutbox declare-topology` against `url`, with `args` after it.
fn declare(url: &str, args: &[&str]) -> std::process::Output {
    let mut all = vec!["declare-topology", "--amqp-url", url];
    all.extend_from_slice(args);
    pgoutbox(&all)
}

/// `(source, destination, routing key)` of every binding on the node.
fn bindings(rmq: &RabbitMq) -> BTreeSet<(String, String, String)> {
    rmq.ctl_ok(&[
        "-q",
        "list_bindings",
        "source_name",
        "destination_name",
        "routing_key",
        "--no-table-headers",
    ])
    .lines()
    .filter_map(|l| {
        let mut f = l.split('\t');
        Some((
            f.next()?.to_owned(),
            f.next()?.to_owned(),
            f.next()?.to_owned(),
        ))
    })
    .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn declare_topology_is_idempotent_and_names_what_differs() {
    let rmq = RabbitMq::shared();
    let url = rmq.url();
    let exchange = support::unique("topo_x");
    let hash = support::unique("topo_hash");
    let prefix = support::unique("topo_q");
    let names = [
        "--exchange",
        &exchange,
        "--hash-exchange",
        &hash,
        "--queue-prefix",
        &prefix,
        "--queues",
        "3",
    ];
    let run = |extra: &[&str]| {
        let mut args = names.to_vec();
        args.extend_from_slice(extra);
        let out = declare(&url, &args);
        let text = format!("{}{}", stdout(&out), stderr(&out));
        assert!(
            !text.contains("guest:guest"),
            "the password is never printed:\n{text}"
        );
        (out.status.code(), stdout(&out), stderr(&out))
    };

    // Nothing there yet: --check reports it all missing and changes nothing.
    let (code, out, err) = run(&["--check"]);
    assert_eq!(code, Some(1), "{out}\n{err}");
    assert_eq!(out.matches(": MISSING").count(), 5, "{out}");
    assert!(err.contains("run it without --check"), "{err}");
    assert!(!out.contains("created"), "--check creates nothing:\n{out}");

    // Declared: 2 exchanges and 3 queues created, 4 bindings.
    let (code, out, err) = run(&[]);
    assert_eq!(code, Some(0), "{out}\n{err}");
    assert_eq!(out.matches(": created").count(), 5, "{out}");
    assert_eq!(out.matches(": bound").count(), 4, "{out}");
    let queues: Vec<String> = (0..3).map(|i| format!("{prefix}.{i}")).collect();
    let on_broker = bindings(rmq);
    assert!(
        on_broker.contains(&(exchange.clone(), hash.clone(), "#".into())),
        "{on_broker:?}"
    );
    for q in &queues {
        assert!(
            on_broker.contains(&(hash.clone(), q.clone(), "1".into())),
            "{q}: {on_broker:?}"
        );
    }
    let listed = rmq.ctl_ok(&[
        "-q",
        "list_queues",
        "name",
        "type",
        "arguments",
        "--no-table-headers",
    ]);
    for q in &queues {
        let line = listed
            .lines()
            .find(|l| l.starts_with(&format!("{q}\t")))
            .unwrap_or_else(|| panic!("{q} not listed:\n{listed}"));
        assert!(line.contains("quorum"), "{line}");
        assert!(line.contains("x-single-active-consumer"), "{line}");
    }
    let exchanges = rmq.ctl_ok(&[
        "-q",
        "list_exchanges",
        "name",
        "type",
        "arguments",
        "--no-table-headers",
    ]);
    let line = exchanges
        .lines()
        .find(|l| l.starts_with(&format!("{hash}\t")))
        .unwrap_or_else(|| panic!("{hash} not listed:\n{exchanges}"));
    assert!(
        line.contains("x-consistent-hash") && line.contains("x-pgoutbox-aggregate-id"),
        "{line}"
    );

    // Again: everything exists as declared, nothing created; --check agrees.
    let (code, out, err) = run(&[]);
    assert_eq!(code, Some(0), "{out}\n{err}");
    assert_eq!(out.matches(": exists, as declared").count(), 5, "{out}");
    assert!(!out.contains("created"), "{out}");
    let (code, out, err) = run(&["--check"]);
    assert_eq!(code, Some(0), "{out}\n{err}");

    // Fewer queues than declared: the one past them is a difference (keys would still go
    // there while it is bound).
    let mut fewer = names.to_vec();
    fewer[7] = "2";
    let out = declare(&url, &fewer);
    assert_eq!(out.status.code(), Some(1), "{}", stdout(&out));
    assert!(
        stdout(&out).contains(&format!(
            "queue \"{prefix}.2\": DIFFERS: it exists, past the 2 queues"
        )),
        "{}",
        stdout(&out)
    );

    // An existing classic queue where a quorum queue belongs: RabbitMQ's words name the
    // (first) differing argument; nothing is bound while something differs.
    let prefix2 = support::unique("topo_q2");
    let conn = amqp_connect(&url).await;
    let ch = conn.create_channel().await.expect("channel");
    ch.queue_declare(
        format!("{prefix2}.1").as_str().into(),
        QueueDeclareOptions {
            durable: true,
            ..Default::default()
        },
        FieldTable::default(),
    )
    .await
    .expect("classic queue");
    let _ = conn.close(200, "declared".into()).await;
    let out = declare(
        &url,
        &[
            "--exchange",
            &exchange,
            "--hash-exchange",
            &hash,
            "--queue-prefix",
            &prefix2,
            "--queues",
            "2",
        ],
    );
    let text = stdout(&out);
    assert_eq!(out.status.code(), Some(1), "{text}\n{}", stderr(&out));
    assert!(
        text.contains(&format!("queue \"{prefix2}.1\" (quorum, durable, x-single-active-consumer): DIFFERS: PRECONDITION_FAILED - inequivalent arg ")),
        "{text}"
    );
    assert!(
        text.contains(&format!(
            "queue \"{prefix2}.0\" (quorum, durable, x-single-active-consumer): created"
        )),
        "{text}"
    );
    assert_eq!(
        text.matches("not declared while something above differs")
            .count(),
        3,
        "{text}"
    );
    assert!(
        stderr(&out).contains("nothing that exists was changed"),
        "{}",
        stderr(&out)
    );
}

/// A node without the plugin: declare-topology refuses before declaring a queue, naming the
/// `rabbitmq-plugins` command for that very node; that command, run as printed (with the
/// node's Erlang environment), enables it, and declare-topology then succeeds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn declare_topology_names_the_command_that_enables_the_plugin() {
    let rmq = RabbitMq::start_private_with_plugins(&[]);
    let url = rmq.url();
    let out = declare(&url, &["--queues", "2"]);
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(1), "{}\n{err}", stdout(&out));
    let command = format!(
        "rabbitmq-plugins --node {} enable --online rabbitmq_consistent_hash_exchange",
        rmq.nodename()
    );
    assert!(err.contains(&command), "{err}");
    assert!(!err.contains("guest:guest"), "{err}");
    let queues = rmq.ctl_ok(&["-q", "list_queues", "name", "--no-table-headers"]);
    assert!(
        queues.trim().is_empty(),
        "no queue declared before the refusal: {queues}"
    );
    let args: Vec<&str> = command.split(' ').skip(1).collect();
    let enabled = rmq.plugins(&args);
    assert!(
        enabled.status.success(),
        "the printed command works: {}{}",
        String::from_utf8_lossy(&enabled.stdout),
        String::from_utf8_lossy(&enabled.stderr)
    );
    let out = declare(&url, &["--queues", "2"]);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}{}",
        stdout(&out),
        stderr(&out)
    );
    assert_eq!(
        stdout(&out).matches(": created").count(),
        3,
        "{}",
        stdout(&out)
    );
}

/// One line of the `consume --queues` example: the queue, the message id, its aggregate and
/// its `(commit LSN, message LSN)`.
#[derive(Debug, Clone)]
struct Line {
    queue: String,
    id: String,
    aggregate: String,
    position: (u64, u64),
}

fn parse_lines(log: &str) -> Vec<Line> {
    log.lines()
        .filter_map(|l| {
            let field = |name: &str| {
                l.split(' ')
                    .find_map(|f| f.strip_prefix(name))
                    .map(str::to_owned)
            };
            let id = field("id=")?;
            Some(Line {
                queue: l.split(' ').next()?.to_owned(),
                aggregate: field("aggregate=")?,
                position: (
                    support::lsn(&field("commit_lsn=")?),
                    support::lsn(&field("lsn=")?),
                ),
                id,
            })
        })
        .collect()
}

/// Emits `txns` transactions of two events each for aggregates `agg-0` to `agg-{keys-1}`,
/// ids `{tag}-{t}-{0|1}`, pausing `pause` between transactions.
async fn producer(url: String, tag: String, txns: usize, keys: usize, pause: Duration) {
    let mut client = support::Postgres::client_url(&url).await.expect("producer");
    for t in 0..txns {
        let tx = client.transaction().await.expect("begin");
        for e in 0..2 {
            tx.execute(
                "SELECT outbox.emit('sac', '{}', '{}', $1, aggregate_id => $2)",
                &[
                    &format!("{tag}-{t}-{e}"),
                    &format!("agg-{}", (t * 7 + e) % keys),
                ],
            )
            .await
            .expect("emit");
        }
        tx.commit().await.expect("commit");
        tokio::time::sleep(pause).await;
    }
}

/// Kills `active` and waits until `standby` prints its first message: the takeover time.
async fn take_over(active: &Streamer, standby: &Streamer, what: &str) -> Duration {
    assert!(
        parse_lines(&standby.log()).is_empty(),
        "{what}: the standby received nothing while the active consumer lived:\n{}",
        standby.log()
    );
    let killed = Instant::now();
    active.kill9();
    active.wait_exit(Duration::from_secs(10)).await;
    assert!(
        support::wait_until(scaled(Duration::from_secs(60)), || async {
            !parse_lines(&standby.log()).is_empty()
        })
        .await,
        "{what}: the standby took over:\n{}",
        standby.log()
    );
    killed.elapsed()
}

/// Issue 31's test of the scale-out topology: 3 quorum queues with single active consumer
/// behind the hash exchange (declared by `declare-topology`), `run --partitions 2`, two
/// `consume --queues` processes on all three queues (one active on each, the other standing
/// by), 2 producers; the active one is SIGKILLed mid-stream, the standby takes over, a new
/// standby starts, and the new active one is killed too. Nothing lost, each aggregate on one
/// queue, each aggregate's first deliveries in `(commit LSN, LSN)` order across both
/// takeovers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn single_active_consumers_take_over_and_keep_each_aggregates_order() {
    const KEYS: usize = 40;
    const TXNS: usize = 900; // per producer, two events each: 3,600 in all
    let pg = Postgres::shared();
    let rmq = RabbitMq::shared();
    let url = rmq.url();
    let ob = Outbox::new_without_queue(pg, &url, "sac").await;
    let hash = support::unique("sac_hash");
    let prefix = support::unique("sac_q");
    let out = declare(
        &url,
        &[
            "--exchange",
            &ob.exchange,
            "--hash-exchange",
            &hash,
            "--queue-prefix",
            &prefix,
            "--queues",
            "3",
        ],
    );
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}{}",
        stdout(&out),
        stderr(&out)
    );
    let queues = format!("{prefix}.0,{prefix}.1,{prefix}.2");
    let consume = support::example_binary("consume");
    let consumer = || {
        Streamer::spawn_program(
            consume.to_str().expect("path"),
            &["--queues", &queues, &url, "1000000", "600"],
            &[("RUST_LOG", "warn")],
        )
    };
    let started = |c: &Streamer| c.log().contains("consuming from queues");
    let first = consumer();
    assert!(
        support::wait_until(scaled(Duration::from_secs(30)), || async {
            started(&first)
        })
        .await,
        "{}",
        first.log()
    );
    let second = consumer();
    assert!(
        support::wait_until(scaled(Duration::from_secs(30)), || async {
            started(&second)
        })
        .await,
        "{}",
        second.log()
    );
    let streamer = ob.run(&["--partitions", "2"]);
    let producers: Vec<_> = ["p", "r"]
        .iter()
        .map(|tag| {
            tokio::spawn(producer(
                ob.url(),
                (*tag).to_owned(),
                TXNS,
                KEYS,
                Duration::from_millis(5),
            ))
        })
        .collect();
    let total = 2 * TXNS * 2;

    // The first takeover, once a fifth has arrived.
    assert!(
        support::wait_until(scaled(Duration::from_secs(120)), || async {
            parse_lines(&first.log()).len() >= total / 5
        })
        .await,
        "a fifth arrives:\n{}\n{}",
        first.log(),
        streamer.log()
    );
    let first_takeover = take_over(&first, &second, "first takeover").await;
    let third = consumer();
    assert!(
        support::wait_until(scaled(Duration::from_secs(30)), || async {
            started(&third)
        })
        .await,
        "{}",
        third.log()
    );
    // The second, once half has arrived.
    assert!(
        support::wait_until(scaled(Duration::from_secs(120)), || async {
            parse_lines(&first.log()).len() + parse_lines(&second.log()).len() >= total / 2
        })
        .await,
        "half arrives:\n{}",
        streamer.log()
    );
    let second_takeover = take_over(&second, &third, "second takeover").await;
    for p in producers {
        p.await.expect("producer");
    }
    let all = |logs: &[&Streamer]| -> Vec<Line> {
        logs.iter().flat_map(|c| parse_lines(&c.log())).collect()
    };
    assert!(
        support::wait_until(scaled(Duration::from_secs(120)), || async {
            let ids: BTreeSet<String> = all(&[&first, &second, &third])
                .into_iter()
                .map(|l| l.id)
                .collect();
            ids.len() >= total
        })
        .await,
        "every event arrives:\n{}",
        streamer.log()
    );
    streamer.stop_ok(scaled(Duration::from_secs(30))).await;

    // The audit, in arrival order: each queue had one consumer at a time, so the first
    // consumer's lines, then the second's, then the third's are each queue's order.
    let got = all(&[&first, &second, &third]);
    let want: BTreeSet<String> = ["p", "r"]
        .iter()
        .flat_map(|tag| (0..TXNS).flat_map(move |t| (0..2).map(move |e| format!("{tag}-{t}-{e}"))))
        .collect();
    let distinct: BTreeSet<String> = got.iter().map(|l| l.id.clone()).collect();
    let lost: Vec<_> = want.difference(&distinct).take(10).collect();
    let invented: Vec<_> = distinct.difference(&want).take(10).collect();
    assert!(lost.is_empty(), "lost, e.g. {lost:?}");
    assert!(invented.is_empty(), "invented, e.g. {invented:?}");
    let mut seen = BTreeSet::new();
    let mut queue_of: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    let mut last: BTreeMap<String, (u64, u64)> = BTreeMap::new();
    let mut inversions = Vec::new();
    for line in &got {
        queue_of
            .entry(line.aggregate.clone())
            .or_default()
            .insert(line.queue.clone());
        if !seen.insert(line.id.clone()) {
            continue;
        }
        if let Some(prev) = last.insert(line.aggregate.clone(), line.position) {
            if prev >= line.position {
                inversions.push((line.aggregate.clone(), line.id.clone()));
            }
        }
    }
    let spread: Vec<_> = queue_of.iter().filter(|(_, q)| q.len() != 1).collect();
    let used: BTreeSet<&String> = queue_of.values().flatten().collect();
    eprintln!(
        "topology: {total} events over {KEYS} aggregates, 3 queues ({} used), {} deliveries ({} duplicates), takeovers after SIGKILL: {:.2?} and {:.2?}, first-arrival inversions {}",
        used.len(),
        got.len(),
        got.len() - distinct.len(),
        first_takeover,
        second_takeover,
        inversions.len()
    );
    assert!(
        spread.is_empty(),
        "aggregates on several queues: {spread:?}"
    );
    assert_eq!(queue_of.len(), KEYS, "every aggregate arrived");
    assert!(
        used.len() >= 2,
        "40 aggregates over 3 queues use more than one"
    );
    assert!(
        inversions.is_empty(),
        "first arrivals per aggregate in (commit LSN, LSN) order, e.g. {:?}",
        &inversions[..inversions.len().min(10)]
    );
}
