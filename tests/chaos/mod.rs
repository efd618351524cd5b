//! The chaos test: producers on several connections (with rollbacks and rolled-back
//! savepoints) while, for a bounded number of rounds, the streamer is SIGKILLed, RabbitMQ is
//! restarted, the broker and Postgres connections are cut through a proxy, and Postgres is
//! restarted. At the end an audit compares what committed (recorded by the producers in the
//! same transaction as each emit) with what reached the queue.
//!
//! `PGOUTBOX_CHAOS_ROUNDS` (default 6, at least 5 so every fault kind runs) and
//! `PGOUTBOX_CHAOS_SEED` (default: from the clock; printed) make a run reproducible.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::support::{self, scaled, Outbox, Postgres, Proxy, RabbitMq, Streamer};

/// xorshift64*: a small deterministic generator so a seed replays a run.
#[derive(Clone)]
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
    fn chance(&mut self, percent: u64) -> bool {
        self.below(100) < percent
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
enum Fault {
    KillStreamer,
    RestartBroker,
    CutBroker,
    CutPostgres,
    RestartPostgres,
}

const ALL_FAULTS: [Fault; 5] = [
    Fault::KillStreamer,
    Fault::RestartBroker,
    Fault::CutBroker,
    Fault::CutPostgres,
    Fault::RestartPostgres,
];

/// One producer: transactions of 1 to 3 messages, sometimes a rolled-back savepoint with an
/// extra message, sometimes a rollback of the whole transaction. Every committed message is
/// recorded in `audit` in the same transaction as its emit.
async fn producer(
    url: String,
    p: i32,
    mut rng: Rng,
    stop: Arc<AtomicBool>,
    rolled_back: Arc<Mutex<(u64, u64)>>,
) {
    let mut seq = 0i32;
    let mut client = None;
    while !stop.load(Ordering::SeqCst) {
        if client.is_none() {
            match Postgres::client_url(&url).await {
                Ok(c) => client = Some(c),
                Err(_) => {
                    tokio::time::sleep(Duration::from_millis(200)).await;
                    continue;
                }
            }
        }
        let Some(c) = client.as_mut() else { continue };
        seq += 1;
        let messages = 1 + rng.below(3) as i32;
        let savepoint = rng.chance(15);
        let rollback = rng.chance(10);
        let result: Result<(), tokio_postgres::Error> = async {
            let tx = c.transaction().await?;
            for j in 0..messages {
                let id = format!("c{p}-{seq}-{j}");
                let payload = serde_json::json!({"p": p, "s": seq, "j": j, "pad": "é".repeat((seq % 7) as usize)}).to_string();
                tx.execute("SELECT outbox.emit('chaos.' || $1::text, $2::text::jsonb, '{}', $3)", &[&p.to_string(), &payload, &id]).await?;
                tx.execute("INSERT INTO audit (producer, seq, j, message_id, body) VALUES ($1, $2, $3, $4, convert_to(($5::text::jsonb)::text, 'UTF8'))", &[&p, &seq, &j, &id, &payload]).await?;
                if savepoint && j == 0 {
                    tx.batch_execute("SAVEPOINT sp").await?;
                    let rb = format!("rb-sp-{p}-{seq}");
                    tx.execute("SELECT outbox.emit('chaos.rb', '{}', '{}', $1)", &[&rb]).await?;
                    tx.batch_execute("ROLLBACK TO SAVEPOINT sp").await?;
                    rolled_back.lock().unwrap().1 += 1;
                }
            }
            if rollback {
                let rb = format!("rb-tx-{p}-{seq}");
                tx.execute("SELECT outbox.emit('chaos.rb', '{}', '{}', $1)", &[&rb]).await?;
                tx.rollback().await?;
                rolled_back.lock().unwrap().0 += 1;
            } else {
                tx.commit().await?;
            }
            Ok(())
        }
        .await;
        if result.is_err() {
            client = None;
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        tokio::time::sleep(Duration::from_millis(2 + rng.below(6))).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chaos_rounds_lose_nothing_and_invent_nothing() {
    let rounds: usize = std::env::var("PGOUTBOX_CHAOS_ROUNDS")
        .ok()
        .and_then(|r| r.parse().ok())
        .unwrap_or(6)
        .max(5);
    let seed: u64 = std::env::var("PGOUTBOX_CHAOS_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_nanos() as u64
                | 1
        });
    eprintln!("chaos: seed {seed} (PGOUTBOX_CHAOS_SEED={seed} replays this run), {rounds} rounds");
    let mut rng = Rng(seed);

    let pg = Postgres::start_private(&[("wal_sender_timeout", "10s")]);
    let rmq = RabbitMq::start_private();
    let pg_proxy = Proxy::start(pg.port());
    let amqp_proxy = Proxy::start(rmq.port());
    let ob = Outbox::new(&pg, &rmq.url(), "chaos").await;
    ob.sql("CREATE TABLE audit (producer int, seq int, j int, message_id text PRIMARY KEY, body bytea)");
    let streamer_args: Vec<String> = vec![
        "run".into(),
        "--database-url".into(),
        // The least-privilege role through the proxy: chaos streams as a deployment would.
        ob.streamer_url_via(pg_proxy.port()),
        "--amqp-url".into(),
        format!("amqp://guest:guest@127.0.0.1:{}/%2f", amqp_proxy.port()),
        "--slot".into(),
        ob.slot.clone(),
        "--publication".into(),
        ob.publication.clone(),
        "--exchange".into(),
        ob.exchange.clone(),
        "--max-in-flight".into(),
        "1000".into(),
    ];
    let spawn = || Streamer::spawn(&streamer_args, &[("RUST_LOG", "info")]);
    let mut streamer = spawn();
    let mut logs = String::new();

    let stop = Arc::new(AtomicBool::new(false));
    let rolled_back = Arc::new(Mutex::new((0u64, 0u64)));
    let producers: Vec<_> = (0..3)
        .map(|p| {
            tokio::spawn(producer(
                ob.url(),
                p,
                Rng(seed ^ (0x9E37_79B9 * (p as u64 + 1))),
                stop.clone(),
                rolled_back.clone(),
            ))
        })
        .collect();

    // Fault schedule: every kind once, then random ones, shuffled.
    let mut schedule: Vec<Fault> = ALL_FAULTS.to_vec();
    while schedule.len() < rounds {
        schedule.push(ALL_FAULTS[rng.below(5) as usize]);
    }
    for i in (1..schedule.len()).rev() {
        schedule.swap(i, rng.below(i as u64 + 1) as usize);
    }
    let queue_len = || support::queue_len(&ob.amqp_url, &ob.queue);
    let mut injected: BTreeMap<Fault, usize> = BTreeMap::new();
    // Faults whose effect was seen: a new session (a reconnect, or the new process after a
    // kill) and the slot moving past where the WAL was at the fault.
    let mut recovered: BTreeMap<Fault, usize> = BTreeMap::new();
    // Messages taken from the queue during the run (at each kill), in queue order.
    let mut consumed: Vec<support::Received> = Vec::new();
    // Per kill: where `consumed` stood, and the ids delivered before it that the slot had
    // not passed (they must be delivered again after it).
    let mut kills: Vec<(usize, HashSet<String>)> = Vec::new();
    let sessions = |s: &Streamer| s.log_count(": streaming slot=");
    for (round, fault) in schedule.iter().enumerate() {
        // Let traffic flow, then inject. After round 0 the previous round's recovery check
        // (a new session, the slot moving past the fault) has shown it flowing already.
        if round == 0 {
            let before = queue_len().await;
            let flowing = support::wait_until(scaled(Duration::from_secs(60)), || async {
                queue_len().await >= before + 100
            })
            .await;
            assert!(
                flowing,
                "round {round}: no progress before the fault (seed {seed})\n{logs}{}",
                streamer.log()
            );
        }
        tokio::time::sleep(Duration::from_millis(200 + rng.below(800))).await;
        eprintln!("chaos: round {round}: {fault:?}");
        let reconnects_before = streamer.log_count("session failed; reconnecting");
        let sessions_before = sessions(&streamer);
        match fault {
            Fault::KillStreamer => {
                // Land the kill with broker-confirmed messages the slot has not passed:
                // freeze the streamer, read the slot, take the queue; if nothing in it lies
                // past the slot (a status update just went out), let it run and try again.
                let mut attempts = 0;
                let must_repeat = loop {
                    attempts += 1;
                    streamer.signal("STOP");
                    let at = ob.confirmed_flush();
                    consumed.extend(ob.drain(0, Duration::from_millis(300)).await);
                    let past: HashSet<String> = consumed
                        .iter()
                        .filter(|m| support::lsn(&m.headers["x-pgoutbox-lsn"]) >= at)
                        .filter_map(|m| m.message_id.clone())
                        .collect();
                    if !past.is_empty() || attempts >= 20 {
                        break past;
                    }
                    streamer.signal("CONT");
                    tokio::time::sleep(Duration::from_millis(30 + rng.below(100))).await;
                };
                streamer.kill9();
                streamer.wait_exit(Duration::from_secs(10)).await;
                assert!(
                    !must_repeat.is_empty(),
                    "round {round}: the kill never landed with unacknowledged messages in the queue ({attempts} attempts, seed {seed})"
                );
                eprintln!(
                    "chaos: round {round}: killed with {} delivered messages past the slot",
                    must_repeat.len()
                );
                kills.push((consumed.len(), must_repeat));
                logs.push_str(&streamer.log());
                streamer = spawn();
            }
            Fault::RestartBroker => {
                rmq.stop_app();
                tokio::time::sleep(Duration::from_millis(rng.below(1500))).await;
                rmq.start_app();
            }
            Fault::CutBroker => amqp_proxy.cut(),
            Fault::CutPostgres => pg_proxy.cut(),
            Fault::RestartPostgres => {
                pg.stop_fast();
                pg.start();
            }
        }
        *injected.entry(*fault).or_default() += 1;
        assert!(
            streamer.try_status().is_none(),
            "round {round}: streamer exited (seed {seed}):\n{}",
            streamer.log()
        );
        // What the fault did: the session ended and a new one started (a kill starts a new
        // process, whose first session counts), then the slot moved past the WAL written
        // before the fault.
        let (reconnects_before, sessions_before) = match fault {
            Fault::KillStreamer => (0, 0),
            _ => (reconnects_before, sessions_before),
        };
        let new_session = support::wait_until(scaled(Duration::from_secs(60)), || async {
            sessions(&streamer) > sessions_before
                && (*fault == Fault::KillStreamer
                    || streamer.log_count("session failed; reconnecting") > reconnects_before)
        })
        .await;
        assert!(
            new_session,
            "round {round}: {fault:?} was not followed by a reconnect (seed {seed}):\n{}",
            streamer.log()
        );
        let mark = support::lsn(&ob.sql("SELECT pg_current_wal_lsn()"));
        let moved = ob.flushed_past(mark, scaled(Duration::from_secs(60))).await;
        assert!(
            moved,
            "round {round}: the slot did not move again after {fault:?}: confirmed_flush {:#x}, WAL at the fault {mark:#x} (seed {seed})\n{}",
            ob.confirmed_flush(),
            streamer.log()
        );
        // Every session after a fault (a new process, a reconnect through the proxy, after a
        // restart of Postgres) connects as the streamer role again.
        ob.assert_streams_as_streamer(
            scaled(Duration::from_secs(60)),
            &format!("chaos round {round} after {fault:?}"),
        )
        .await;
        *recovered.entry(*fault).or_default() += 1;
    }
    stop.store(true, Ordering::SeqCst);
    for p in producers {
        p.await.unwrap();
    }

    // Every producer has stopped: wait until the slot is acknowledged past everything they
    // committed (a marker committed after them); from then on every committed message must
    // already be in the queue (nothing at or below an acknowledged LSN may be missing), so
    // the drain below is a proof, not a race with a streamer still in reconnect backoff.
    // (Waiting for pg_current_wal_lsn() instead failed when the streamer's own stream_state
    // write came before that read: seed 1796339546540565201, 184 bytes short.)
    let caught_up = ob
        .settled_through_now(scaled(Duration::from_secs(120)))
        .await;
    assert!(
        caught_up,
        "the slot never passed the producers' last commits (seed {seed}): confirmed_flush {:#x}\n{logs}{}",
        ob.confirmed_flush(),
        streamer.log()
    );

    // The audit: what committed versus what arrived.
    let audit: HashMap<String, (i32, i32, i32, Vec<u8>)> = {
        let client = Postgres::client_url(&ob.url()).await.unwrap();
        client
            .query("SELECT message_id, producer, seq, j, body FROM audit", &[])
            .await
            .unwrap()
            .into_iter()
            .map(|r| (r.get(0), (r.get(1), r.get(2), r.get(3), r.get(4))))
            .collect()
    };
    let taken: HashSet<String> = consumed
        .iter()
        .filter_map(|m| m.message_id.clone())
        .collect();
    let remaining = audit.keys().filter(|id| !taken.contains(*id)).count();
    let mut got = consumed;
    got.extend(ob.drain(remaining, scaled(Duration::from_secs(60))).await);
    logs.push_str(&streamer.log());
    // Each kill's unacknowledged deliveries came again after it.
    let mut redelivered_after_kills = 0;
    for (k, (from, must_repeat)) in kills.iter().enumerate() {
        let later: HashSet<&String> = got[*from..]
            .iter()
            .filter_map(|m| m.message_id.as_ref())
            .collect();
        let missing: Vec<&String> = must_repeat
            .iter()
            .filter(|id| !later.contains(id))
            .collect();
        assert!(
            missing.is_empty(),
            "kill {k}: {} of {} unacknowledged messages were not sent again, e.g. {:?} (seed {seed})",
            missing.len(),
            must_repeat.len(),
            &missing[..missing.len().min(10)]
        );
        redelivered_after_kills += must_repeat.len();
    }
    let delivered: HashSet<String> = got.iter().filter_map(|m| m.message_id.clone()).collect();
    let lost: Vec<&String> = audit.keys().filter(|id| !delivered.contains(*id)).collect();
    let invented: Vec<&String> = delivered
        .iter()
        .filter(|id| !audit.contains_key(*id))
        .collect();
    let duplicates = got.len() - delivered.len();
    let mut first_seen = HashSet::new();
    let mut last_per_producer: HashMap<i32, (i32, i32)> = HashMap::new();
    let mut inversions = 0;
    for m in &got {
        let id = m.message_id.clone().unwrap();
        if let Some((p, s, j, body)) = audit.get(&id) {
            assert_eq!(&m.body, body, "payload of {id} byte-exact (seed {seed})");
            if first_seen.insert(id.clone()) {
                let prev = last_per_producer.insert(*p, (*s, *j));
                if prev.is_some_and(|prev| prev >= (*s, *j)) {
                    inversions += 1;
                }
            }
        }
    }
    let reconnects = logs.matches("session failed; reconnecting").count();
    eprintln!(
        "chaos: seed {seed}; committed {} (plus {:?} rolled-back transactions and savepoints), delivered {} ({} distinct, {duplicates} duplicates), lost {}, invented {}, first-delivery order inversions {inversions}, streamer reconnects {reconnects}; faults injected: {:?}",
        audit.len(),
        *rolled_back.lock().unwrap(),
        got.len(),
        delivered.len(),
        lost.len(),
        invented.len(),
        injected
    );
    assert!(
        lost.is_empty(),
        "lost {:?} (seed {seed})",
        &lost[..lost.len().min(10)]
    );
    assert!(
        invented.is_empty(),
        "invented {:?} (seed {seed})",
        &invented[..invented.len().min(10)]
    );
    assert_eq!(
        inversions, 0,
        "first deliveries per producer in commit order (seed {seed})"
    );
    assert!(audit.len() > 500, "the producers did real work");
    // Every fault here is an outage, never a malformed stream: a Postgres restart ends COPY
    // BOTH with CommandComplete, which must read as a shutdown, not a protocol violation.
    assert!(
        !logs.contains("protocol violation"),
        "a fault was reported as a protocol violation (seed {seed}):\n{logs}"
    );
    let (rollbacks, savepoints) = *rolled_back.lock().unwrap();
    assert!(
        rollbacks > 0 && savepoints > 0,
        "rollbacks and savepoint rollbacks were exercised"
    );
    for fault in ALL_FAULTS {
        assert!(
            recovered.get(&fault).copied().unwrap_or(0) >= 1,
            "{fault:?} was injected and followed by a reconnect and the slot moving (seed {seed}): {recovered:?}"
        );
    }
    assert_eq!(
        recovered, injected,
        "every injected fault was seen to act (seed {seed})"
    );
    assert!(
        !kills.is_empty() && redelivered_after_kills > 0 && duplicates > 0,
        "the kills caused redeliveries: {redelivered_after_kills} after {} kills, {duplicates} duplicates (seed {seed})",
        kills.len()
    );
    eprintln!(
        "chaos: {} kills redelivered {redelivered_after_kills} messages delivered before them",
        kills.len()
    );
}
