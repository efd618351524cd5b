//! A model-based test of [`AckWatermark`]: random interleavings of what the pipeline feeds it,
//! checked step by step against a reference model that keeps every message's state.
//!
//! The model is deliberately naive: a list of transactions in commit order, each with the state
//! of each of its messages, and no counters. After every step it derives two bounds from that
//! list and the real watermark's flush LSN must lie between them:
//!
//! - **at most** what the acknowledgement rule allows: never at or past the end of a committed
//!   transaction with a message that is neither confirmed as routed nor dead-lettered, or that is
//!   blocked (a nack, a return, a poison entry); never past what the stream had shown when an
//!   open transaction began or a poison entry arrived; never past the highest LSN the stream has
//!   shown at all;
//! - **at least** the end of the longest settled prefix of commits, and any keepalive's `walEnd`
//!   received while nothing at all was pending (the watermark acknowledges promptly).
//!
//! It must also never go backwards, and at the end, once every message is settled and nothing is
//! blocked, it reaches the last commit's end LSN, and the `walEnd` of one more keepalive.
//!
//! Cases: `PROPTEST_CASES` (default [`DEFAULT_CASES`]). A failure is shrunk, printed as the list
//! of steps, and its seed saved under `proptest-regressions/`, so the next run replays it first.

use proptest::prelude::*;
use proptest::sample::Index;

use super::{AckWatermark, TxnSeq, WatermarkError};
use crate::lsn::Lsn;

/// Cases run when `PROPTEST_CASES` is not set: a few hundred keep a debug build well under 10 s.
const DEFAULT_CASES: u32 = 300;

/// Steps in one generated interleaving, at most.
const MAX_STEPS: usize = 300;

/// One thing the pipeline can tell the watermark, as the stream or the broker produces it.
#[derive(Clone, Debug)]
enum Step {
    /// A Begin (a misuse while a transaction is open: must be refused).
    Begin,
    /// One outbox message of the open transaction is published (refused outside one).
    Message,
    /// A Commit whose end LSN is `gap` bytes past anything the stream has shown so far.
    Commit { gap: u64 },
    /// The broker confirms one unconfirmed message (picked at random) as routed.
    Confirm(Index),
    /// One unconfirmed message is nacked or returned: `fail`, which blocks its transaction.
    Fail(Index),
    /// One unconfirmed message is durably dead-lettered: the pipeline then calls `confirm`.
    DeadLetter(Index),
    /// A confirm for a transaction with no unconfirmed message (a bookkeeping bug upstream):
    /// must be refused and change nothing.
    StrayConfirm(Index),
    /// `block_here`: a poison entry, inside the open transaction or on its own outside one.
    Block,
    /// A primary keepalive whose `walEnd` is `ahead` bytes past the last LSN the stream has
    /// shown, as a real walsender's is (it only reports what it has sent).
    Keepalive { ahead: u64 },
    /// The streamer restarts: a new watermark at the flush LSN, and the stream resumes there.
    Restart,
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        8 => Just(Step::Begin),
        10 => Just(Step::Message),
        8 => (1..=1_000u64).prop_map(|gap| Step::Commit { gap }),
        12 => any::<Index>().prop_map(Step::Confirm),
        1 => any::<Index>().prop_map(Step::Fail),
        3 => any::<Index>().prop_map(Step::DeadLetter),
        1 => any::<Index>().prop_map(Step::StrayConfirm),
        1 => Just(Step::Block),
        5 => (0..=1_000u64).prop_map(|ahead| Step::Keepalive { ahead }),
        1 => Just(Step::Restart),
    ]
}

/// What has become of one published message.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum MessageState {
    /// Sent, no outcome yet.
    Unconfirmed,
    /// The broker confirmed it as routed.
    Confirmed,
    /// Nacked or returned: its transaction can never be acknowledged in this run.
    Failed,
    /// Written as a dead letter.
    DeadLettered,
}

impl MessageState {
    fn settled(self) -> bool {
        matches!(self, MessageState::Confirmed | MessageState::DeadLettered)
    }
}

/// One entry of the model, in stream order.
#[derive(Debug)]
struct ModelTxn {
    /// What the real watermark returned from `begin`; `None` for a poison entry outside any
    /// transaction.
    seq: Option<TxnSeq>,
    /// Commit end LSN; `None` while open, and for good for a poison entry.
    end: Option<Lsn>,
    messages: Vec<MessageState>,
    /// `block_here` was called for it.
    poisoned: bool,
    /// The highest LSN the stream had shown when it began: nothing past it may be flushed
    /// while this entry is pending.
    seen_at_start: Lsn,
}

impl ModelTxn {
    fn blocked(&self) -> bool {
        self.poisoned || self.messages.contains(&MessageState::Failed)
    }

    /// Committed, every message settled, not blocked: the watermark may pass it.
    fn acknowledgeable(&self) -> bool {
        self.end.is_some() && !self.blocked() && self.messages.iter().all(|m| m.settled())
    }

    fn unconfirmed(&self) -> usize {
        self.messages
            .iter()
            .filter(|m| **m == MessageState::Unconfirmed)
            .count()
    }
}

/// The reference model, run side by side with the real watermark.
#[derive(Debug)]
struct Model {
    /// The flush LSN the current watermark was started at.
    start: Lsn,
    /// Every entry since the last restart, acknowledged ones included.
    txns: Vec<ModelTxn>,
    open: bool,
    /// The highest LSN the stream has shown: commit ends and keepalive `walEnd`s.
    last_seen: Lsn,
    /// The highest `walEnd` of a keepalive received while nothing was pending.
    idle_keepalive: Lsn,
}

impl Model {
    fn new(start: Lsn) -> Self {
        Model {
            start,
            txns: Vec::new(),
            open: false,
            last_seen: start,
            idle_keepalive: start,
        }
    }

    /// Nothing open, nothing unconfirmed, nothing blocked: the only state in which a keepalive
    /// may move the watermark.
    fn is_idle(&self) -> bool {
        !self.open && self.txns.iter().all(ModelTxn::acknowledgeable)
    }

    fn unconfirmed(&self) -> usize {
        self.txns.iter().map(ModelTxn::unconfirmed).sum()
    }

    /// `(entry, message)` of every unconfirmed message, in stream order.
    fn unconfirmed_messages(&self) -> Vec<(usize, usize)> {
        let mut out = Vec::new();
        for (t, txn) in self.txns.iter().enumerate() {
            for (m, state) in txn.messages.iter().enumerate() {
                if *state == MessageState::Unconfirmed {
                    out.push((t, m));
                }
            }
        }
        out
    }

    /// The end of the longest prefix of acknowledgeable commits (or the start).
    fn settled_prefix(&self) -> Lsn {
        self.txns
            .iter()
            .take_while(|t| t.acknowledgeable())
            .filter_map(|t| t.end)
            .fold(self.start, Lsn::max)
    }

    /// The highest flush LSN the acknowledgement rule allows now.
    fn upper_bound(&self) -> Lsn {
        let mut bound = self.last_seen;
        for txn in self.txns.iter().filter(|t| !t.acknowledgeable()) {
            let below = match txn.end {
                // Acknowledging `end` would skip the transaction on a restart; commit ends and
                // keepalive `walEnd`s are the only values the flush takes, so this means
                // staying at or below the previous one.
                Some(end) => Lsn(end.0 - 1),
                None => txn.seen_at_start,
            };
            bound = bound.min(below);
        }
        bound.max(self.start)
    }

    /// The lowest flush LSN the watermark must have reached by now.
    fn lower_bound(&self) -> Lsn {
        self.settled_prefix().max(self.idle_keepalive)
    }
}

/// Drives one interleaving through the real watermark and the model, checking after each step.
fn run(start: Lsn, steps: &[Step]) -> Result<(), TestCaseError> {
    let mut wm = AckWatermark::new(start);
    let mut model = Model::new(start);
    let mut previous = wm.flushed();
    check(&wm, &model, previous, "start")?;

    for (i, step) in steps.iter().enumerate() {
        apply(&mut wm, &mut model, step)?;
        let at = format!("step {i} ({step:?})");
        check(&wm, &model, previous, &at)?;
        previous = wm.flushed();
    }

    // Settle everything: commit what is open, confirm what is unconfirmed (none of this is
    // refused), then one keepalive as the idle walsender would send.
    if model.open {
        apply(&mut wm, &mut model, &Step::Commit { gap: 1 })?;
        check(&wm, &model, previous, "final commit")?;
        previous = wm.flushed();
    }
    while let Some(&message) = model.unconfirmed_messages().first() {
        settle(&mut wm, &mut model, message, MessageState::Confirmed)?;
        check(&wm, &model, previous, "final confirm")?;
        previous = wm.flushed();
    }
    prop_assert_eq!(wm.unconfirmed(), 0);
    let blocked = model.txns.iter().any(ModelTxn::blocked);
    if blocked {
        prop_assert!(!wm.is_idle(), "a blocked entry remains: not idle");
        return Ok(());
    }
    let last_commit = model.txns.iter().filter_map(|t| t.end).max();
    // At least: a watermark that also remembered a keepalive received while busy, and
    // applied it on turning idle, would be within the rule (the upper bound checks that).
    prop_assert!(
        wm.flushed() >= model.lower_bound() && last_commit.is_none_or(|end| wm.flushed() >= end),
        "all settled: flushed {} short of the last commit ({:?}) or a later idle keepalive ({})",
        wm.flushed(),
        last_commit,
        model.idle_keepalive
    );
    prop_assert!(wm.is_idle());
    apply(&mut wm, &mut model, &Step::Keepalive { ahead: 7 })?;
    check(&wm, &model, previous, "final keepalive")?;
    prop_assert_eq!(
        wm.flushed(),
        model.last_seen,
        "idle: the keepalive is acknowledged"
    );
    Ok(())
}

/// Feeds one step to both sides; misuse must be refused by the watermark.
fn apply(wm: &mut AckWatermark, model: &mut Model, step: &Step) -> Result<(), TestCaseError> {
    match *step {
        Step::Begin => {
            if model.open {
                prop_assert_eq!(wm.begin(), Err(WatermarkError::NestedBegin));
            } else {
                let seq = wm.begin().map_err(fail_with)?;
                model.open = true;
                model.txns.push(ModelTxn {
                    seq: Some(seq),
                    end: None,
                    messages: Vec::new(),
                    poisoned: false,
                    seen_at_start: model.last_seen,
                });
            }
        }
        Step::Message => {
            if model.open {
                let seq = wm.add_message(0).map_err(fail_with)?;
                let txn = model.txns.last_mut().expect("an open transaction");
                prop_assert_eq!(Some(seq), txn.seq, "add_message names the open transaction");
                txn.messages.push(MessageState::Unconfirmed);
            } else {
                prop_assert_eq!(wm.add_message(0), Err(WatermarkError::NoOpenTransaction));
            }
        }
        Step::Commit { gap } => {
            let end = Lsn(model.last_seen.0 + gap);
            if model.open {
                wm.commit(end).map_err(fail_with)?;
                model.open = false;
                model.last_seen = end;
                model.txns.last_mut().expect("an open transaction").end = Some(end);
            } else {
                prop_assert_eq!(wm.commit(end), Err(WatermarkError::NoOpenTransaction));
            }
        }
        Step::Confirm(pick) | Step::Fail(pick) | Step::DeadLetter(pick) => {
            let candidates = model.unconfirmed_messages();
            if candidates.is_empty() {
                return Ok(());
            }
            let (t, m) = candidates[pick.index(candidates.len())];
            let outcome = match step {
                Step::Fail(_) => MessageState::Failed,
                Step::DeadLetter(_) => MessageState::DeadLettered,
                _ => MessageState::Confirmed,
            };
            settle(wm, model, (t, m), outcome)?;
        }
        Step::StrayConfirm(pick) => {
            let candidates: Vec<TxnSeq> = model
                .txns
                .iter()
                .filter(|t| t.unconfirmed() == 0)
                .filter_map(|t| t.seq)
                .collect();
            if candidates.is_empty() {
                return Ok(());
            }
            let seq = candidates[pick.index(candidates.len())];
            let before = (wm.flushed(), wm.unconfirmed());
            prop_assert_eq!(wm.confirm(seq, 0), Err(WatermarkError::UnknownConfirm));
            prop_assert_eq!(wm.fail(seq, 0), Err(WatermarkError::UnknownConfirm));
            prop_assert_eq!((wm.flushed(), wm.unconfirmed()), before);
        }
        Step::Block => {
            wm.block_here();
            if model.open {
                model.txns.last_mut().expect("an open transaction").poisoned = true;
            } else {
                model.txns.push(ModelTxn {
                    seq: None,
                    end: None,
                    messages: Vec::new(),
                    poisoned: true,
                    seen_at_start: model.last_seen,
                });
            }
        }
        Step::Keepalive { ahead } => {
            let wal_end = Lsn(model.last_seen.0 + ahead);
            let before = wm.flushed();
            let moved = wm.keepalive(wal_end);
            prop_assert_eq!(
                moved,
                wm.flushed() > before,
                "keepalive says whether it moved"
            );
            model.last_seen = wal_end;
            if model.is_idle() {
                model.idle_keepalive = model.idle_keepalive.max(wal_end);
            }
        }
        Step::Restart => {
            // The stream resumes at the acknowledged position; whatever was pending is sent
            // again, as new entries of the new watermark.
            *wm = AckWatermark::new(wm.flushed());
            *model = Model::new(wm.flushed());
        }
    }
    Ok(())
}

/// The broker's outcome for message `m` of entry `t`, fed to the watermark as the pipeline
/// does.
fn settle(
    wm: &mut AckWatermark,
    model: &mut Model,
    (t, m): (usize, usize),
    outcome: MessageState,
) -> Result<(), TestCaseError> {
    let seq = model.txns[t].seq.expect("messages belong to transactions");
    match outcome {
        MessageState::Failed => wm.fail(seq, 0).map_err(fail_with)?,
        // A dead letter is durable once written: from the watermark's view, settled.
        MessageState::Confirmed | MessageState::DeadLettered => {
            wm.confirm(seq, 0).map_err(fail_with)?;
        }
        MessageState::Unconfirmed => unreachable!("not an outcome"),
    }
    model.txns[t].messages[m] = outcome;
    Ok(())
}

/// The invariants that hold after every step.
fn check(wm: &AckWatermark, model: &Model, previous: Lsn, at: &str) -> Result<(), TestCaseError> {
    let flushed = wm.flushed();
    prop_assert!(
        flushed >= previous,
        "{at}: the flush LSN went backwards, {previous} -> {flushed}"
    );
    let upper = model.upper_bound();
    prop_assert!(
        flushed <= upper,
        "{at}: flushed {flushed} passes a pending entry or what the stream showed (at most \
         {upper}); model {model:#?}"
    );
    let lower = model.lower_bound();
    prop_assert!(
        flushed >= lower,
        "{at}: flushed {flushed} lags the settled prefix or an idle keepalive (at least \
         {lower}); model {model:#?}"
    );
    prop_assert_eq!(
        wm.unconfirmed(),
        model.unconfirmed() as u64,
        "{}: unconfirmed count",
        at
    );
    prop_assert_eq!(wm.in_transaction(), model.open, "{}: in_transaction", at);
    prop_assert_eq!(wm.is_idle(), model.is_idle(), "{}: is_idle", at);
    Ok(())
}

fn fail_with(e: WatermarkError) -> TestCaseError {
    TestCaseError::fail(format!("the watermark refused a valid step: {e}"))
}

fn cases() -> u32 {
    std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(DEFAULT_CASES)
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: cases(),
        ..ProptestConfig::default()
    })]

    #[test]
    fn watermark_matches_the_model(
        start in 0..1_000_000u64,
        steps in prop::collection::vec(step(), 0..MAX_STEPS),
    ) {
        run(Lsn(start), &steps)?;
    }
}
