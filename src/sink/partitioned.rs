//! N sinks behind one, each message to the part of its key (`run --partitions N`, N > 1).
//!
//! What it owns: the choice of part ([`crate::partition::partition_for`], from the
//! delivery alone, so a retry and a replay go to the same part as the first attempt) and
//! the fair polling of the parts. What it does not own: the window (the loop's one bound
//! on unconfirmed messages spans all parts, so a stuck part cannot let the others run
//! ahead without bound, as Kafka Connect's `SubmittedRecords` bounds a task), the
//! settling rules and the flush LSN (the loop settles by [`Seq`], whatever part carried
//! it: parts confirm out of order relative to each other, and the watermark only moves
//! past a message once it and everything before it settled).
//!
//! Order: a key's messages go through one part, and the loop hands first attempts over in
//! WAL order, so each part sends its keys' messages in commit order and settles them in
//! its own wire order. Between parts there is no order.
//!
//! Failure: a part whose connection fails settles its unsettled publishes as
//! [`PublishOutcome::Failed`] and then reports [`SinkError::Lost`]; the loop ends the
//! session on the first `Failed`, every part is closed, and the next session replays
//! from the flush LSN (nothing lost; a key's first deliveries are not reordered, since
//! nothing of it after the failed message was acknowledged).

use std::task::{Context, Poll};

use futures::future::BoxFuture;

use super::{Delivery, PartFigures, PublishOutcome, Seq, Sink, SinkError, SinkHealth};
use crate::partition::{partition_for, PartitionKey};

/// Several sinks (one per partition) as one [`Sink`].
pub struct PartitionedSink {
    /// The parts, partition 0 first.
    parts: Vec<Box<dyn Sink>>,
    /// The envelope field that keys a message.
    key: PartitionKey,
    /// The part [`Sink::poll_settled`] polls first next time (rotates, so one busy part
    /// cannot starve the others' confirms).
    next_poll: usize,
    /// Span `partition` (field `partition = i`) for part `i`, entered while it publishes or is
    /// polled, so its log lines (blocked, unblocked, a protocol violation) name it.
    spans: Vec<tracing::Span>,
}

impl std::fmt::Debug for PartitionedSink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PartitionedSink")
            .field("parts", &self.parts.len())
            .field("key", &self.key)
            .finish()
    }
}

impl PartitionedSink {
    /// `parts[i]` carries partition `i`; `key` picks each message's partition.
    ///
    /// # Panics
    /// When `parts` is empty or holds more than [`crate::partition::MAX_PARTITIONS`]; a
    /// [`crate::config::RunConfig`] never asks for that, since
    /// [`crate::config::RunSettings::validate`] refuses `--partitions` outside 1 to 64
    /// ([`crate::config::numeric::PARTITIONS`]).
    pub fn new(parts: Vec<Box<dyn Sink>>, key: PartitionKey) -> Self {
        assert!(
            !parts.is_empty() && parts.len() <= usize::from(crate::partition::MAX_PARTITIONS),
            "1 to {} parts, not {}",
            crate::partition::MAX_PARTITIONS,
            parts.len()
        );
        let spans = (0..parts.len())
            .map(|i| tracing::info_span!("partition", partition = i))
            .collect();
        PartitionedSink {
            parts,
            key,
            next_poll: 0,
            spans,
        }
    }

    /// The number of parts.
    pub fn len(&self) -> usize {
        self.parts.len()
    }

    /// Never true (there is at least one part).
    pub fn is_empty(&self) -> bool {
        self.parts.is_empty()
    }

    /// The part of `delivery`.
    fn part_of(&self, delivery: &Delivery) -> usize {
        usize::from(partition_for(
            &delivery.envelope,
            delivery.commit_lsn,
            self.key,
            self.parts.len() as u16,
        ))
    }
}

/// `error` of part `i`, with the part named.
fn named(i: usize, error: SinkError) -> SinkError {
    match error {
        SinkError::Unsendable(m) => SinkError::Unsendable(m),
        SinkError::Unencodable(m) => SinkError::Unencodable(format!("partition {i}: {m}")),
        SinkError::Lost(m) => SinkError::Lost(format!("partition {i}: {m}")),
        SinkError::Violated(m) => SinkError::Violated(format!("partition {i}: {m}")),
    }
}

impl Sink for PartitionedSink {
    fn publish(&mut self, delivery: Delivery) -> Result<(), SinkError> {
        let i = self.part_of(&delivery);
        let _span = self.spans[i].enter();
        self.parts[i].publish(delivery).map_err(|e| named(i, e))
    }

    /// Polls every part once, from a rotating start, and returns what they settled
    /// together. A part's `Violated` wins at once (nothing is settled); a part's `Lost`
    /// is returned only when no part settled anything in this poll (its `Failed`
    /// outcomes came first, and the part keeps reporting `Lost`).
    fn poll_settled(
        &mut self,
        cx: &mut Context<'_>,
    ) -> Poll<Result<Vec<(Seq, PublishOutcome)>, SinkError>> {
        let n = self.parts.len();
        let start = self.next_poll;
        self.next_poll = (start + 1) % n;
        let mut settled = Vec::new();
        let mut lost = None;
        for k in 0..n {
            let i = (start + k) % n;
            let polled = {
                let _span = self.spans[i].enter();
                self.parts[i].poll_settled(cx)
            };
            match polled {
                Poll::Ready(Ok(outcomes)) => {
                    settled.extend(outcomes.into_iter().map(|(seq, outcome)| match outcome {
                        // The session ends on it: say which connection failed.
                        PublishOutcome::Failed(mut failure) => {
                            failure.partition = Some(i as u16);
                            (seq, PublishOutcome::Failed(failure))
                        }
                        other => (seq, other),
                    }))
                }
                Poll::Ready(Err(e @ SinkError::Violated(_))) => {
                    return Poll::Ready(Err(named(i, e)))
                }
                Poll::Ready(Err(e)) => {
                    lost.get_or_insert_with(|| named(i, e));
                }
                Poll::Pending => {}
            }
        }
        match (settled.is_empty(), lost) {
            (false, _) => Poll::Ready(Ok(settled)),
            (true, Some(e)) => Poll::Ready(Err(e)),
            (true, None) => Poll::Pending,
        }
    }

    /// True when every part is: the next message may be for any of them.
    fn is_writable(&self) -> bool {
        self.parts.iter().all(|p| p.is_writable())
    }

    fn health(&self) -> SinkHealth {
        SinkHealth {
            parts: self.parts.iter().flat_map(|p| p.health().parts).collect(),
        }
    }

    fn unsettled(&self) -> usize {
        self.parts.iter().map(|p| p.unsettled()).sum()
    }

    fn parts(&self) -> Vec<PartFigures> {
        self.parts.iter().flat_map(|p| p.parts()).collect()
    }

    fn close(self: Box<Self>) -> BoxFuture<'static, ()> {
        let closing: Vec<_> = self.parts.into_iter().map(|p| p.close()).collect();
        Box::pin(async move {
            futures::future::join_all(closing).await;
        })
    }
}

#[cfg(test)]
mod tests {
    use std::collections::VecDeque;
    use std::sync::{Arc, Mutex};

    use super::*;
    use crate::envelope::{Envelope, Metadata};
    use crate::lsn::Lsn;
    use crate::sink::{Exchange, FailureCause, PartHealth, SinkFailure};

    /// What one poll of a part returns.
    type Settled = Result<Vec<(Seq, PublishOutcome)>, SinkError>;

    /// A part that records what it was given and settles what the test queues.
    #[derive(Default)]
    struct Part {
        published: Arc<Mutex<Vec<Seq>>>,
        ready: VecDeque<Settled>,
    }

    impl Sink for Part {
        fn publish(&mut self, d: Delivery) -> Result<(), SinkError> {
            if let Ok(mut log) = self.published.lock() {
                log.push(d.seq);
            }
            Ok(())
        }
        fn poll_settled(
            &mut self,
            _: &mut Context<'_>,
        ) -> Poll<Result<Vec<(Seq, PublishOutcome)>, SinkError>> {
            match self.ready.pop_front() {
                Some(r) => Poll::Ready(r),
                None => Poll::Pending,
            }
        }
        fn is_writable(&self) -> bool {
            true
        }
        fn health(&self) -> SinkHealth {
            SinkHealth::single(PartHealth::Connected)
        }
        fn unsettled(&self) -> usize {
            self.published.lock().unwrap().len()
        }
        fn close(self: Box<Self>) -> BoxFuture<'static, ()> {
            Box::pin(async {})
        }
    }

    fn delivery(seq: Seq, aggregate: Option<&str>, commit: u64) -> Delivery {
        Delivery {
            seq,
            envelope: Envelope {
                version: 3,
                message_id: format!("m{seq}"),
                topic: "t".into(),
                content_type: "application/json".into(),
                headers: Default::default(),
                payload: Default::default(),
                emitted_by: None,
                emitted_by_unchecked: false,
                exchange: None,
                meta: Metadata {
                    aggregate_id: aggregate.map(str::to_owned),
                    ..Default::default()
                },
            },
            exchange: Exchange::Configured,
            lsn: Lsn(commit - 1),
            commit_lsn: Lsn(commit),
            commit_time_us: 0,
            index_in_txn: 0,
            emitter_checked: false,
            attempt: 1,
            read_at: None,
        }
    }

    fn sink(n: usize) -> (PartitionedSink, Vec<Arc<Mutex<Vec<Seq>>>>) {
        let logs: Vec<_> = (0..n).map(|_| Arc::new(Mutex::new(Vec::new()))).collect();
        let parts = logs
            .iter()
            .map(|l| {
                Box::new(Part {
                    published: l.clone(),
                    ready: VecDeque::new(),
                }) as Box<dyn Sink>
            })
            .collect();
        (PartitionedSink::new(parts, PartitionKey::AggregateId), logs)
    }

    #[test]
    fn each_key_goes_to_its_partition_in_order() {
        let (mut s, logs) = sink(4);
        let keys = ["a", "b", "c", "d", "e", "f"];
        for seq in 0..60u64 {
            let key = keys[seq as usize % keys.len()];
            s.publish(delivery(seq, Some(key), 100)).unwrap();
        }
        for key in keys {
            let p = crate::partition::partition_of(key.as_bytes(), 4) as usize;
            let want: Vec<Seq> = (0..60u64)
                .filter(|seq| keys[*seq as usize % keys.len()] == key)
                .collect();
            let got: Vec<Seq> = logs[p]
                .lock()
                .unwrap()
                .iter()
                .copied()
                .filter(|seq| keys[*seq as usize % keys.len()] == key)
                .collect();
            assert_eq!(got, want, "key {key} on partition {p}");
        }
        // Keyless: all of one transaction on one part.
        let (mut s, logs) = sink(4);
        for seq in 0..10 {
            s.publish(delivery(seq, None, 0x1000)).unwrap();
        }
        assert_eq!(
            logs.iter()
                .filter(|l| !l.lock().unwrap().is_empty())
                .count(),
            1
        );
        assert_eq!(s.unsettled(), 10);
    }

    fn poll(s: &mut PartitionedSink) -> Poll<Result<Vec<(Seq, PublishOutcome)>, SinkError>> {
        let waker = futures::task::noop_waker();
        s.poll_settled(&mut Context::from_waker(&waker))
    }

    fn with_ready(per_part: Vec<Vec<Settled>>) -> PartitionedSink {
        let parts = per_part
            .into_iter()
            .map(|r| {
                Box::new(Part {
                    published: Default::default(),
                    ready: r.into(),
                }) as Box<dyn Sink>
            })
            .collect();
        PartitionedSink::new(parts, PartitionKey::AggregateId)
    }

    #[test]
    fn settled_outcomes_of_all_parts_come_back_and_a_loss_after_them() {
        let mut s = with_ready(vec![
            vec![Ok(vec![(1, PublishOutcome::Routed)])],
            vec![
                Ok(vec![(
                    2,
                    PublishOutcome::Failed(SinkFailure::new(FailureCause::ConnectionLost(
                        "gone".into(),
                    ))),
                )]),
                Err(SinkError::Lost("gone".into())),
            ],
        ]);
        let Poll::Ready(Ok(mut got)) = poll(&mut s) else {
            panic!("outcomes first")
        };
        got.sort_by_key(|(seq, _)| *seq);
        assert_eq!(
            got,
            vec![
                (1, PublishOutcome::Routed),
                (
                    2,
                    PublishOutcome::Failed(SinkFailure {
                        partition: Some(1),
                        cause: FailureCause::ConnectionLost("gone".into()),
                    })
                )
            ]
        );
        match poll(&mut s) {
            Poll::Ready(Err(SinkError::Lost(m))) => assert_eq!(m, "partition 1: gone"),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_violation_settles_nothing() {
        let mut s = with_ready(vec![
            vec![Ok(vec![(1, PublishOutcome::Routed)])],
            vec![Err(SinkError::Violated("ack for nothing".into()))],
        ]);
        match poll(&mut s) {
            Poll::Ready(Err(SinkError::Violated(m))) => {
                assert_eq!(m, "partition 1: ack for nothing")
            }
            other => panic!("{other:?}"),
        }
        let mut idle = with_ready(vec![vec![], vec![]]);
        assert!(poll(&mut idle).is_pending());
        assert_eq!(idle.health().parts.len(), 2);
    }
}
