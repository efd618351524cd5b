//! Issue 31, item 4, "Consumers that scale out": `pgoutbox declare-topology` declares the
//! topology people run (Q quorum queues with single active consumer behind a consistent-hash
//! exchange hashing `x-pgoutbox-aggregate-id`), idempotently, says what differs on an
//! existing one, and refuses with the command that enables the plugin when it is off.

use std::collections::BTreeSet;

use lapin::options::QueueDeclareOptions;
use lapin::types::FieldTable;

use crate::support::cli::{pgoutbox, stderr, stdout};
use crate::support::{self, amqp_connect, RabbitMq};

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
