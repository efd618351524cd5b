//! Issue 18 on the scripted fake broker: `run --partitions 2` against a real Postgres, its
//! two AMQP connections served by one [`FakeServer`] (found by their connection names,
//! `pgoutbox INSTANCE partition i/2`), so a test decides exactly what each partition's
//! broker acks, and when it goes away.
//!
//! - A stalled partition fills the one global bound (`--max-in-flight` messages or
//!   `--max-in-flight-bytes`, each counting what is not yet acknowledged to Postgres:
//!   unconfirmed messages, and confirmed ones behind an unconfirmed one), so the partition that acks everything runs ahead by the bound and
//!   no further; the flush LSN stays below the stalled partition's first unconfirmed
//!   message until it acks.
//! - A partition's socket closed mid-window settles nothing that was not acked: the flush
//!   LSN never passes its first unacked message, the next session publishes every unacked
//!   one again (on the same partition, in order), and what the other partition acked
//!   below that point is settled for good (not sent again).

use std::time::Duration;

use pgoutbox::partition::partition_of;

use crate::support::fake_broker::{FakeBroker, FakeConfig, FakeServer};
use crate::support::{self, scaled, Outbox, Postgres};

/// The tail of partition 0's connection name under `--partitions 2`.
const P0: &str = "partition 0/2";
/// The tail of partition 1's connection name.
const P1: &str = "partition 1/2";

/// An aggregate id that goes to `partition` of 2 (the documented FNV-1a rule).
fn key_on(partition: u16) -> String {
    (0..)
        .map(|i| format!("agg-{i}"))
        .find(|k| partition_of(k.as_bytes(), 2) == partition)
        .expect("a key")
}

/// One message in its own transaction, id `id`, aggregate `key`; returns its LSN.
fn emit(ob: &Outbox<'_>, id: &str, key: &str) -> u64 {
    support::lsn(&ob.sql(&format!(
        "SELECT outbox.emit('p.t', '{{}}', '{{}}', '{id}', aggregate_id => '{key}')"
    )))
}

/// The message ids a connection received, in arrival order.
fn ids(c: &FakeBroker) -> Vec<String> {
    c.publishes()
        .iter()
        .map(|p| p.message_id.clone().unwrap_or_default())
        .collect()
}

/// The ids the fake acked on a connection (its publishes up to its acked-through tag).
fn acked_ids(c: &FakeBroker) -> Vec<String> {
    let through = c.acked_through() as usize;
    ids(c).into_iter().take(through).collect()
}

/// `tag-from..tag-to`, inclusive.
fn range(tag: &str, from: usize, to: usize) -> Vec<String> {
    (from..=to).map(|k| format!("{tag}-{k}")).collect()
}

/// Connection `nth` of `partition` (its name tail), waited for up to `timeout`.
async fn partition_connection(
    server: &FakeServer,
    instance: &str,
    partition: &str,
    nth: usize,
    timeout: Duration,
    log: impl Fn() -> String,
) -> std::sync::Arc<FakeBroker> {
    server
        .wait_connection(&format!("{instance} {partition}"), nth, timeout)
        .await
        .unwrap_or_else(|| {
            panic!(
                "connection {nth} of {partition} did not complete its handshake within {timeout:?}; connections {:?}:\n{}",
                server
                    .connections()
                    .iter()
                    .map(|c| c.connection_name())
                    .collect::<Vec<_>>(),
                log()
            )
        })
}

/// Which part of the global bound a stall test sets low.
#[derive(Debug, Clone, Copy)]
enum Bound {
    /// `--max-in-flight 8`.
    Messages,
    /// `--max-in-flight-bytes`: the content bytes of `a-0` and `b-2`..`b-5`, plus 1.
    Bytes,
}

/// Partition 0's broker never acks, partition 1's acks every publish at once. Emitted, one
/// per transaction, before `run` starts: `b-0`, `b-1`, then `a-0` (partition 0), then
/// `b-2`..`b-21`, `a-1`, `a-2`, `b-22`..`b-25`. `b-0` and `b-1` are acked and acknowledged;
/// then the window fills with `a-0` and the B messages after it (confirmed, but behind
/// `a-0`) and nothing more goes out on either connection. Under `--max-in-flight 8` that
/// is `a-0` and `b-2`..`b-8` (B got exactly 9 publishes); under the bytes bound (the
/// content bytes of `a-0` and `b-2`..`b-5`, plus 1: room while below it, so one more is
/// read) `a-0` and `b-2`..`b-6` (B got exactly 7). In both, A got exactly 1, the streamer
/// reports the stall with the window full, and the slot's confirmed_flush_lsn is past
/// `b-1` but below `a-0`. Once A acks, everything flows, each message exactly once on its
/// partition, and the slot passes the last message.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_partition_fills_the_global_bound_and_holds_the_flush_lsn() {
    stalled_partition_fills_the_bound(Bound::Messages).await;
}

/// [`a_stalled_partition_fills_the_global_bound_and_holds_the_flush_lsn`] with the bound in
/// bytes (`--max-in-flight-bytes`) instead of messages.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_partition_fills_the_global_byte_bound_and_holds_the_flush_lsn() {
    stalled_partition_fills_the_bound(Bound::Bytes).await;
}

/// The content size (`sz`) of every outbox message a test_decoding slot saw, in WAL order.
fn message_sizes(ob: &Outbox<'_>, slot: &str) -> Vec<u64> {
    ob.sql(&format!(
        "SELECT data FROM pg_logical_slot_peek_changes('{slot}', NULL, NULL) \
         WHERE data LIKE 'message: transactional: 1 prefix: pgoutbox, sz: %'"
    ))
    .lines()
    .map(|l| {
        let sz = l.split("sz: ").nth(1).expect("sz");
        sz[..sz.find(' ').expect("sz end")].parse().expect("a size")
    })
    .collect()
}

async fn stalled_partition_fills_the_bound(bound: Bound) {
    let pg = Postgres::shared();
    let server = FakeServer::start(FakeConfig::default(), |name| !name.ends_with(P0)).await;
    let ob = Outbox::new_without_queue(pg, &server.url(), "part_stall").await;
    // A second slot, only to read each message's content size (the bytes the window counts).
    let peek = support::unique("part_stall_peek");
    ob.sql(&format!(
        "SELECT pg_create_logical_replication_slot('{peek}', 'test_decoding')"
    ));

    let (ka, kb) = (key_on(0), key_on(1));
    let mut order = Vec::new();
    let mut lsns = std::collections::BTreeMap::new();
    let mut put = |id: String, key: &str| {
        let lsn = emit(&ob, &id, key);
        order.push(id.clone());
        lsns.insert(id, lsn);
    };
    put("b-0".into(), &kb);
    put("b-1".into(), &kb);
    put("a-0".into(), &ka);
    for k in 2..=21 {
        put(format!("b-{k}"), &kb);
    }
    put("a-1".into(), &ka);
    put("a-2".into(), &ka);
    for k in 22..=25 {
        put(format!("b-{k}"), &kb);
    }
    let last = lsns["b-25"];
    // Decoding reads only flushed WAL: wait until the WAL writer flushed all of it.
    let mut sizes = Vec::new();
    support::wait_until_blocking(scaled(Duration::from_secs(30)), || {
        sizes = message_sizes(&ob, &peek);
        sizes.len() >= order.len()
    });
    ob.sql(&format!("SELECT pg_drop_replication_slot('{peek}')"));
    assert_eq!(sizes.len(), order.len(), "one size per message: {sizes:?}");
    let size: std::collections::BTreeMap<&str, u64> = order
        .iter()
        .map(String::as_str)
        .zip(sizes.iter().copied())
        .collect();

    // What fills the window: a-0 and the B messages after it up to b-{last_held}.
    let (flags, last_held) = match bound {
        Bound::Messages => (vec!["--max-in-flight".to_owned(), "8".to_owned()], 8),
        Bound::Bytes => {
            let bytes = size["a-0"]
                + (2..=5)
                    .map(|k| size[format!("b-{k}").as_str()])
                    .sum::<u64>()
                + 1;
            (
                vec!["--max-in-flight-bytes".to_owned(), bytes.to_string()],
                6,
            )
        }
    };
    // Unacknowledged when full: a-0 and b-2..b-{last_held}.
    let window = last_held;
    let instance = support::unique("part-stall");
    let mut args = vec![
        "--partitions",
        "2",
        "--instance-id",
        &instance,
        "--stall-after-s",
        "1",
    ];
    args.extend(flags.iter().map(String::as_str));
    let streamer = ob.run(&args);
    let long = scaled(Duration::from_secs(60));
    let a = partition_connection(&server, &instance, P0, 0, long, || streamer.log()).await;
    let b = partition_connection(&server, &instance, P1, 0, long, || streamer.log()).await;

    // The bound is reached: A holds a-0 unconfirmed, B ran ahead to b-{last_held}.
    let b_at_bound = last_held + 1;
    assert!(
        server
            .wait_until(long, || (!a.publishes().is_empty()
                && b.publishes().len() >= b_at_bound)
                .then_some(()))
            .await
            .is_some(),
        "A got {:?}, B got {:?}:\n{}",
        ids(&a),
        ids(&b),
        streamer.log()
    );
    assert!(
        ob.flushed_past(lsns["b-1"], long).await,
        "B's acks of b-0 and b-1 (before a-0) are acknowledged: flush {:X}:\n{}",
        ob.confirmed_flush(),
        streamer.log()
    );
    // The witness that nothing more is coming: a status tick found no settle for
    // --stall-after-s while the window was full. (A stall warning comes at most once a
    // minute: on a loaded machine an earlier one, before the window filled, delays it.)
    let stalled_full = |log: &str| {
        log.lines()
            .find(|l| l.contains("stalled: no message settled") && l.contains("window_full=true"))
            .map(str::to_owned)
    };
    assert!(
        support::wait_until(scaled(Duration::from_secs(150)), || async {
            stalled_full(&streamer.log()).is_some()
        })
        .await,
        "the streamer reports the stall with the window full; A got {:?}, B got {:?}:\n{}",
        ids(&a),
        ids(&b),
        streamer.log()
    );
    let stall = stalled_full(&streamer.log()).expect("the stall line");
    assert!(
        stall.contains(&format!("unacknowledged={window}")),
        "the full window ({bound:?}) is {window} unacknowledged: {stall}"
    );
    assert_eq!(ids(&a), vec!["a-0".to_owned()], "A: its first message only");
    assert_eq!(
        ids(&b),
        range("b", 0, b_at_bound - 1),
        "B ran ahead by the bound ({bound:?}: {window} unacknowledged with a-0) and no further"
    );
    let flush = ob.confirmed_flush();
    assert!(
        flush < lsns["a-0"],
        "the flush LSN {flush:X} stays below a-0 ({:X}), A's first unconfirmed message",
        lsns["a-0"]
    );

    // A acks: everything flows.
    a.set_auto_ack(true).await;
    assert!(
        ob.flushed_past(last, long).await,
        "the slot passes the last message once A acks: flush {:X}, last {last:X}; A got {:?}, B got {:?}:\n{}",
        ob.confirmed_flush(),
        ids(&a),
        ids(&b),
        streamer.log()
    );
    assert_eq!(
        ids(&a),
        range("a", 0, 2),
        "A: each of its messages once, in order"
    );
    assert_eq!(
        ids(&b),
        range("b", 0, 25),
        "B: each of its messages once, in order"
    );
    assert_eq!(server.connections().len(), 2, "no reconnect");
    for c in [&a, &b] {
        assert_eq!(c.violations(), Vec::<String>::new());
    }
    streamer.stop_ok(long).await;
}

/// Partition 1's broker acks everything; partition 0's acks what the test says. Emitted,
/// one per transaction, alternating: `a-0`, `b-0`, `a-1`, `b-1`, ..., `a-4`, `b-4`. A acks
/// `a-0` and `a-1` (tags 1 and 2, one multiple ack), so the flush LSN passes `b-1`; then A
/// closes its socket with `a-2`..`a-4` unacked. The flush LSN never passes `a-2` while
/// those stay unacked, through the reconnect; the next session publishes `a-2`..`a-4`
/// again on partition 0's new connection, in order (a loss would leave one out), and
/// nothing on partition 1's: `b-0` and `b-1` were acked below the flush LSN, and `b-2`..`b-4`,
/// acked but behind `a-2`, are read again and recognised as settled by this process
/// (issue 21 item 8: the same WAL position and content), so B's acks count and nothing of
/// them is lost or sent twice. Once A's new connection acks, the slot passes the last
/// message.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_partition_closed_mid_window_settles_nothing_it_did_not_ack() {
    let pg = Postgres::shared();
    let server = FakeServer::start(FakeConfig::default(), |name| !name.ends_with(P0)).await;
    let ob = Outbox::new_without_queue(pg, &server.url(), "part_close").await;
    let instance = support::unique("part-close");
    let streamer = ob.run(&["--partitions", "2", "--instance-id", &instance]);
    let long = scaled(Duration::from_secs(60));
    let a1 = partition_connection(&server, &instance, P0, 0, long, || streamer.log()).await;
    let b1 = partition_connection(&server, &instance, P1, 0, long, || streamer.log()).await;

    let (ka, kb) = (key_on(0), key_on(1));
    let mut lsns = std::collections::BTreeMap::new();
    for k in 0..5 {
        for (tag, key) in [("a", &ka), ("b", &kb)] {
            let id = format!("{tag}-{k}");
            lsns.insert(id.clone(), emit(&ob, &id, key));
        }
    }
    assert!(
        server
            .wait_until(long, || (a1.publishes().len() >= 5
                && b1.acked_through() >= 5)
                .then_some(()))
            .await
            .is_some(),
        "A got {:?}, B acked {:?}:\n{}",
        ids(&a1),
        acked_ids(&b1),
        streamer.log()
    );
    assert_eq!(ids(&a1), range("a", 0, 4));
    assert_eq!(ids(&b1), range("b", 0, 4));

    a1.ack_through(2).await;
    assert!(
        ob.flushed_past(lsns["b-1"], long).await,
        "A's acks of a-0, a-1 and B's of b-0, b-1 are acknowledged: flush {:X}:\n{}",
        ob.confirmed_flush(),
        streamer.log()
    );
    let first_unacked = lsns["a-2"];
    let before_close = ob.confirmed_flush();
    assert!(
        before_close < first_unacked,
        "flush {before_close:X} below a-2 ({first_unacked:X}) while a-2 is unacked"
    );

    a1.close_socket().await;
    let a2 = partition_connection(&server, &instance, P0, 1, long, || streamer.log()).await;
    let b2 = partition_connection(&server, &instance, P1, 1, long, || streamer.log()).await;
    // Until A's new connection acks, the flush LSN must stay below a-2: sampled on every
    // poll of the wait for the replays (which ends early when it does not).
    let mut highest = before_close;
    support::wait_until(long, || {
        highest = highest.max(ob.confirmed_flush());
        let done = highest >= first_unacked || a2.publishes().len() >= 3;
        async move { done }
    })
    .await;
    assert!(
        highest < first_unacked,
        "the flush LSN reached {highest:X}, past a-2 ({first_unacked:X}), which nothing acked; A's new connection got {:?}:\n{}",
        ids(&a2),
        streamer.log()
    );
    assert!(
        a2.publishes().len() >= 3,
        "after the reconnect: A got {:?}:\n{}",
        ids(&a2),
        streamer.log()
    );
    assert_eq!(
        ids(&a2),
        range("a", 2, 4),
        "A's unacked messages published again, in order, and only those"
    );
    let now = ob.confirmed_flush();
    assert!(
        now < first_unacked,
        "the flush LSN reached {now:X}, past a-2 ({first_unacked:X}), before A's new connection acked:\n{}",
        streamer.log()
    );
    assert!(
        now >= before_close,
        "the flush LSN went back from {before_close:X} to {now:X}"
    );

    a2.set_auto_ack(true).await;
    assert!(
        ob.flushed_past(lsns["b-4"], long).await,
        "the slot passes the last message once A's new connection acks: flush {:X}:\n{}",
        ob.confirmed_flush(),
        streamer.log()
    );
    // Every message read again was settled on B already: B's new connection got none.
    assert_eq!(
        ids(&b2),
        Vec::<String>::new(),
        "B: nothing again (b-0, b-1 acknowledged; b-2..b-4 settled before the reconnect)"
    );
    // Nothing lost: every message was acked on some connection of its partition.
    let mut acked: Vec<String> = [&a1, &a2, &b1, &b2]
        .iter()
        .flat_map(|c| acked_ids(c))
        .collect();
    acked.sort();
    acked.dedup();
    let mut all: Vec<String> = lsns.keys().cloned().collect();
    all.sort();
    assert_eq!(acked, all, "every message acked somewhere");
    assert_eq!(
        server.connections().len(),
        4,
        "one reconnect of both partitions"
    );
    for c in [&a1, &a2, &b1, &b2] {
        assert_eq!(c.violations(), Vec::<String>::new());
    }
    streamer.stop_ok(long).await;
}
