//! Settling publishes in wire order: delivery tags, `basic.return`, `basic.ack` and
//! `basic.nack`, as a plain state machine with no I/O.
//!
//! Source: AMQP 0-9-1 `confirm.select`, `basic.ack`, `basic.nack` (with `multiple`),
//! `basic.return`; RabbitMQ "Consumer Acknowledgements and Publisher Confirms":
//! - after `confirm.select` the broker numbers the channel's publishes 1, 2, 3, …: we count
//!   them ourselves, in the order we encode them;
//! - `ack(N, multiple)` confirms every tag up to N; acks of different tags may come in any
//!   order;
//! - an unroutable `mandatory` message is returned (`basic.return`) and **then** acked;
//!   `basic.return` carries no delivery tag, so the returned message is recognised by a key
//!   it carries (our `x-pgoutbox-lsn` header, or its `message_id` when we send no header).
//!
//! Only that "return before ack" rule is relied on: a return marks the unsettled publish
//! with its key, and the ack that later covers it settles it as returned, not routed.

use std::collections::{HashMap, VecDeque};

use super::message::MatchKey;
use super::PublishOutcome;
use crate::lsn::Lsn;
use crate::sink::{FailureCause, SinkFailure};

/// What a `basic.return` carried that can identify the returned message.
#[derive(Debug, Clone, Copy, Default)]
pub struct ReturnedKey<'a> {
    /// Our `x-pgoutbox-lsn` header, parsed, when present.
    pub lsn: Option<Lsn>,
    /// The `message_id` property, when present.
    pub message_id: Option<&'a str>,
}

/// A broker behaviour the settling rule cannot accept: the channel's state is unknown, so
/// nothing more may be settled on it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Violation {
    /// A `basic.return` with neither our header nor (for publishes keyed by it) a message id.
    #[error("RabbitMQ returned a message ({reply_code} {reply_text}) that carries no x-pgoutbox-lsn header and no message_id: it cannot be matched to a publish")]
    ReturnWithoutKey {
        /// The return's reply code, e.g. 312.
        reply_code: u16,
        /// The return's reply text, e.g. `NO_ROUTE`.
        reply_text: String,
    },
    /// A `basic.return` whose key matches no unsettled publish (for example one that came
    /// after its own ack).
    #[error("RabbitMQ returned a message ({reply_code} {reply_text}) with key {key} that matches no unconfirmed publish (a return must come before its ack)")]
    ReturnMatchesNothing {
        /// The return's reply code.
        reply_code: u16,
        /// The return's reply text.
        reply_text: String,
        /// The key it carried, as text.
        key: String,
    },
    /// A `basic.ack`, `basic.nack` or `basic.return` (or a content frame) on a channel we
    /// never published on: its delivery tags are not ours to settle.
    #[error("RabbitMQ sent {what} on channel {channel}, but pgoutbox publishes only on channel {expected}")]
    WrongChannel {
        /// The frame, e.g. `basic.ack`.
        what: &'static str,
        /// The channel it came on.
        channel: u16,
        /// The publishing channel.
        expected: u16,
    },
    /// An ack or nack of a delivery tag that was never published or is already settled.
    #[error("RabbitMQ sent basic.{kind} for delivery tag {tag} (multiple: {multiple}), but the last tag published is {last} and that tag is not unconfirmed")]
    UnknownTag {
        /// `ack` or `nack`.
        kind: &'static str,
        /// The delivery tag.
        tag: u64,
        /// The `multiple` flag.
        multiple: bool,
        /// The highest tag published so far.
        last: u64,
    },
}

#[derive(Debug)]
struct Entry<T> {
    tag: T,
    key: MatchKey,
    /// Set by a `basic.return` seen before this publish's ack: (reply code, reply text).
    returned: Option<(u16, String)>,
}

/// Unsettled publishes by delivery tag, and the settling rule.
///
/// Memory is one slot per delivery tag from the oldest unsettled one to the newest, so it
/// follows the window of unconfirmed publishes, plus an index from each unsettled
/// publish's key to its delivery tags, so that a `basic.return` costs a lookup, not a scan
/// of the window (a window of every message unroutable would otherwise cost its size
/// squared).
#[derive(Debug)]
pub struct Confirms<T> {
    /// The delivery tag of `slots[0]`.
    base: u64,
    /// `None` once settled.
    slots: VecDeque<Option<Entry<T>>>,
    unsettled: usize,
    /// Unsettled delivery tags by [`MatchKey::Lsn`], ascending.
    by_lsn: HashMap<Lsn, Tags, LsnHash>,
    /// Unsettled delivery tags by [`MatchKey::MessageId`], ascending.
    by_id: HashMap<String, Tags>,
}

/// The unsettled delivery tags under one key, ascending: one, nearly always (an LSN is
/// unique among unsettled publishes; a message id is shared only by duplicates), so the
/// index allocates nothing per publish for it.
#[derive(Debug)]
enum Tags {
    /// One tag.
    One(u64),
    /// Several (ascending).
    Many(Vec<u64>),
}

impl Tags {
    fn push(&mut self, tag: u64) {
        match self {
            Tags::One(first) => *self = Tags::Many(vec![*first, tag]),
            Tags::Many(tags) => tags.push(tag),
        }
    }

    fn as_slice(&self) -> &[u64] {
        match self {
            Tags::One(tag) => std::slice::from_ref(tag),
            Tags::Many(tags) => tags,
        }
    }

    /// Removes `tag`; true when none is left.
    fn remove(&mut self, tag: u64) -> bool {
        match self {
            Tags::One(t) => *t == tag,
            Tags::Many(tags) => {
                if let Some(at) = tags.iter().position(|t| *t == tag) {
                    tags.remove(at);
                }
                tags.is_empty()
            }
        }
    }
}

/// The hasher of the LSN index: one multiply and a fold per key (an LSN is a `u64` we read
/// from our own server, not attacker-chosen input that needs SipHash's flooding defence; its
/// low bits are mostly zero, 8-byte aligned records, hence the fold).
type LsnHash = std::hash::BuildHasherDefault<LsnHasher>;

/// See [`LsnHash`].
#[derive(Debug, Default)]
struct LsnHasher(u64);

impl std::hash::Hasher for LsnHasher {
    fn write(&mut self, bytes: &[u8]) {
        for b in bytes {
            self.write_u64(u64::from(*b));
        }
    }

    fn write_u64(&mut self, v: u64) {
        let h = (self.0 ^ v).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        self.0 = h ^ (h >> 29);
    }

    fn finish(&self) -> u64 {
        self.0
    }
}

impl<T> Default for Confirms<T> {
    fn default() -> Self {
        Confirms {
            base: 1,
            slots: VecDeque::new(),
            unsettled: 0,
            by_lsn: HashMap::default(),
            by_id: HashMap::new(),
        }
    }
}

/// Adds `tag` to the index entry `entry`.
fn index<K>(entry: std::collections::hash_map::Entry<'_, K, Tags>, tag: u64) {
    match entry {
        std::collections::hash_map::Entry::Occupied(mut tags) => tags.get_mut().push(tag),
        std::collections::hash_map::Entry::Vacant(slot) => {
            slot.insert(Tags::One(tag));
        }
    }
}

/// Removes the settled `tag`, published with `key`, from the return index.
fn forget(
    by_lsn: &mut HashMap<Lsn, Tags, LsnHash>,
    by_id: &mut HashMap<String, Tags>,
    key: &MatchKey,
    tag: u64,
) {
    match key {
        MatchKey::Lsn(lsn) => unindex(by_lsn, lsn, tag),
        MatchKey::MessageId(id) => unindex(by_id, id.as_str(), tag),
    }
}

/// Removes `tag` from the index entry under `key`, and the entry once it is empty.
fn unindex<
    K: std::hash::Hash + Eq + ?Sized,
    Q: std::borrow::Borrow<K> + std::hash::Hash + Eq,
    S: std::hash::BuildHasher,
>(
    index: &mut HashMap<Q, Tags, S>,
    key: &K,
    tag: u64,
) {
    if index.get_mut(key).is_some_and(|tags| tags.remove(tag)) {
        index.remove(key);
    }
}

impl<T> Confirms<T> {
    /// Records a publish; returns its delivery tag (1 for the first after `confirm.select`).
    pub fn published(&mut self, tag: T, key: MatchKey) -> u64 {
        let delivery_tag = self.base + self.slots.len() as u64;
        match &key {
            MatchKey::Lsn(lsn) => index(self.by_lsn.entry(*lsn), delivery_tag),
            MatchKey::MessageId(id) => {
                index(self.by_id.entry(id.as_str().to_owned()), delivery_tag)
            }
        }
        self.slots.push_back(Some(Entry {
            tag,
            key,
            returned: None,
        }));
        self.unsettled += 1;
        delivery_tag
    }

    /// The highest delivery tag handed out (0 before the first publish).
    pub fn last_tag(&self) -> u64 {
        self.base + self.slots.len() as u64 - 1
    }

    /// Publishes not yet acked or nacked.
    pub fn unsettled(&self) -> usize {
        self.unsettled
    }

    /// A `basic.return`: marks the unsettled publish(es) carrying `key` as returned. A
    /// publish keyed by its LSN is unique among unsettled ones; several unsettled publishes
    /// may share a message id, and then all of them are marked (a duplicate is acceptable,
    /// a loss is not), so the returns of the others find them marked already. Returns how
    /// many were marked (0 when every match was marked already).
    ///
    /// # Errors
    /// [`Violation::ReturnWithoutKey`], [`Violation::ReturnMatchesNothing`].
    pub fn returned(
        &mut self,
        key: ReturnedKey<'_>,
        reply_code: u16,
        reply_text: &str,
    ) -> Result<usize, Violation> {
        if key.lsn.is_none() && key.message_id.is_none() {
            return Err(Violation::ReturnWithoutKey {
                reply_code,
                reply_text: reply_text.to_owned(),
            });
        }
        let mut marked = 0;
        let mut matched = false;
        // A publish keyed by its LSN is unique among unsettled ones: its first unmarked
        // match is marked. Every unmarked publish sharing the message id is marked.
        let by_lsn = key.lsn.and_then(|lsn| self.by_lsn.get(&lsn));
        let by_id = key.message_id.and_then(|id| self.by_id.get(id));
        let lsn_tags = by_lsn.map(Tags::as_slice).unwrap_or_default();
        let id_tags = by_id.map(Tags::as_slice).unwrap_or_default();
        for (tags, only_first) in [(lsn_tags, true), (id_tags, false)] {
            for tag in tags {
                let Some(Some(entry)) = self.slots.get_mut((tag - self.base) as usize) else {
                    continue;
                };
                matched = true;
                if entry.returned.is_none() {
                    entry.returned = Some((reply_code, reply_text.to_owned()));
                    marked += 1;
                    if only_first {
                        break;
                    }
                }
            }
        }
        // Matching only publishes already marked is expected when publishes share a
        // message id: the first of their returns marked them all.
        if !matched {
            let key = match (key.lsn, key.message_id) {
                (Some(lsn), _) => format!("x-pgoutbox-lsn {lsn}"),
                (None, Some(id)) => format!("message_id {id:?}"),
                (None, None) => String::new(),
            };
            return Err(Violation::ReturnMatchesNothing {
                reply_code,
                reply_text: reply_text.to_owned(),
                key,
            });
        }
        Ok(marked)
    }

    /// A `basic.ack`: settles `delivery_tag` (and, with `multiple`, every unsettled tag
    /// below it) as [`PublishOutcome::Routed`], or [`PublishOutcome::Returned`] when a
    /// return marked it. Outcomes are appended to `out` in tag order.
    ///
    /// # Errors
    /// [`Violation::UnknownTag`]; nothing is settled then.
    pub fn ack(
        &mut self,
        delivery_tag: u64,
        multiple: bool,
        out: &mut Vec<(T, PublishOutcome)>,
    ) -> Result<(), Violation> {
        self.settle(
            "ack",
            delivery_tag,
            multiple,
            out,
            |returned| match returned {
                None => PublishOutcome::Routed,
                Some((reply_code, reply_text)) => PublishOutcome::Returned {
                    reply_code,
                    reply_text,
                },
            },
        )
    }

    /// A `basic.nack`: settles like [`Confirms::ack`], every one as
    /// [`PublishOutcome::Nacked`].
    ///
    /// # Errors
    /// [`Violation::UnknownTag`]; nothing is settled then.
    pub fn nack(
        &mut self,
        delivery_tag: u64,
        multiple: bool,
        out: &mut Vec<(T, PublishOutcome)>,
    ) -> Result<(), Violation> {
        self.settle("nack", delivery_tag, multiple, out, |_| {
            PublishOutcome::Nacked
        })
    }

    /// The connection or channel failed: every unsettled publish becomes
    /// [`PublishOutcome::Failed`] with `cause`, in tag order.
    pub fn fail_all(&mut self, cause: &FailureCause, out: &mut Vec<(T, PublishOutcome)>) {
        let released = self.slots.len() as u64;
        for entry in self.slots.drain(..).flatten() {
            out.push((
                entry.tag,
                PublishOutcome::Failed(SinkFailure::new(cause.clone())),
            ));
        }
        self.base += released;
        self.unsettled = 0;
        self.by_lsn.clear();
        self.by_id.clear();
    }

    fn settle(
        &mut self,
        kind: &'static str,
        delivery_tag: u64,
        multiple: bool,
        out: &mut Vec<(T, PublishOutcome)>,
        outcome: impl Fn(Option<(u16, String)>) -> PublishOutcome,
    ) -> Result<(), Violation> {
        let unknown = Violation::UnknownTag {
            kind,
            tag: delivery_tag,
            multiple,
            last: self.last_tag(),
        };
        if delivery_tag == 0 || delivery_tag > self.last_tag() {
            return Err(unknown);
        }
        let index = (delivery_tag.saturating_sub(self.base)) as usize;
        if multiple {
            // Tags below `base` are settled already; `ack(N, multiple)` may repeat them.
            if delivery_tag >= self.base {
                for (i, slot) in self.slots.iter_mut().take(index + 1).enumerate() {
                    if let Some(entry) = slot.take() {
                        self.unsettled -= 1;
                        forget(
                            &mut self.by_lsn,
                            &mut self.by_id,
                            &entry.key,
                            self.base + i as u64,
                        );
                        out.push((entry.tag, outcome(entry.returned)));
                    }
                }
            }
        } else {
            let entry = match delivery_tag.checked_sub(self.base) {
                Some(_) => self.slots.get_mut(index).and_then(Option::take),
                None => None,
            };
            let Some(entry) = entry else {
                return Err(unknown);
            };
            self.unsettled -= 1;
            forget(&mut self.by_lsn, &mut self.by_id, &entry.key, delivery_tag);
            out.push((entry.tag, outcome(entry.returned)));
        }
        while matches!(self.slots.front(), Some(None)) {
            self.slots.pop_front();
            self.base += 1;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lsn(n: u64) -> MatchKey {
        MatchKey::Lsn(Lsn(n))
    }

    fn returned_lsn(n: u64) -> ReturnedKey<'static> {
        ReturnedKey {
            lsn: Some(Lsn(n)),
            message_id: None,
        }
    }

    fn three() -> Confirms<u32> {
        let mut c = Confirms::default();
        assert_eq!(c.published(1, lsn(10)), 1);
        assert_eq!(c.published(2, lsn(20)), 2);
        assert_eq!(c.published(3, lsn(30)), 3);
        c
    }

    fn returned_312() -> PublishOutcome {
        PublishOutcome::Returned {
            reply_code: 312,
            reply_text: "NO_ROUTE".into(),
        }
    }

    /// The ordering: return(#1), ack(3), ack(1), ack(2) gives #1 returned.
    #[test]
    fn return_then_later_ack_then_its_own_ack() {
        let mut c = three();
        let mut out = Vec::new();
        assert_eq!(c.returned(returned_lsn(10), 312, "NO_ROUTE"), Ok(1));
        c.ack(3, false, &mut out).unwrap();
        c.ack(1, false, &mut out).unwrap();
        c.ack(2, false, &mut out).unwrap();
        assert_eq!(
            out,
            vec![
                (3, PublishOutcome::Routed),
                (1, returned_312()),
                (2, PublishOutcome::Routed)
            ]
        );
        assert_eq!(c.unsettled(), 0);
        assert_eq!(c.slots.len(), 0, "settled slots are released");
    }

    #[test]
    fn multiple_ack_covers_a_returned_tag_and_others() {
        let mut c = three();
        let mut out = Vec::new();
        c.returned(returned_lsn(20), 312, "NO_ROUTE").unwrap();
        c.ack(3, true, &mut out).unwrap();
        assert_eq!(
            out,
            vec![
                (1, PublishOutcome::Routed),
                (2, returned_312()),
                (3, PublishOutcome::Routed)
            ]
        );
    }

    #[test]
    fn multiple_nack_after_a_single_ack() {
        let mut c = three();
        let mut out = Vec::new();
        c.ack(2, false, &mut out).unwrap();
        c.nack(3, true, &mut out).unwrap();
        assert_eq!(
            out,
            vec![
                (2, PublishOutcome::Routed),
                (1, PublishOutcome::Nacked),
                (3, PublishOutcome::Nacked)
            ]
        );
        // A repeated multiple ack below the base settles nothing and is not an error.
        c.published(4, lsn(40));
        c.ack(3, true, &mut out).unwrap();
        assert_eq!(out.len(), 3);
        assert_eq!(c.unsettled(), 1);
    }

    #[test]
    fn violations_settle_nothing() {
        let mut c = three();
        let mut out = Vec::new();
        assert!(matches!(
            c.returned(ReturnedKey::default(), 312, "NO_ROUTE"),
            Err(Violation::ReturnWithoutKey { .. })
        ));
        assert!(matches!(
            c.returned(returned_lsn(99), 312, "NO_ROUTE"),
            Err(Violation::ReturnMatchesNothing { .. })
        ));
        assert!(matches!(
            c.ack(4, false, &mut out),
            Err(Violation::UnknownTag { tag: 4, .. })
        ));
        assert!(matches!(
            c.ack(0, true, &mut out),
            Err(Violation::UnknownTag { .. })
        ));
        c.ack(1, false, &mut out).unwrap();
        assert!(matches!(
            c.ack(1, false, &mut out),
            Err(Violation::UnknownTag { tag: 1, .. })
        ));
        // A return after its own ack matches nothing.
        assert!(matches!(
            c.returned(returned_lsn(10), 312, "NO_ROUTE"),
            Err(Violation::ReturnMatchesNothing { .. })
        ));
        assert_eq!(out, vec![(1, PublishOutcome::Routed)]);
        assert_eq!(c.unsettled(), 2);
    }

    #[test]
    fn message_id_keys_mark_every_unsettled_publish_sharing_the_id() {
        let mut c: Confirms<u32> = Confirms::default();
        let id = |s: &str| MatchKey::MessageId(s.to_owned().into());
        c.published(1, id("a"));
        c.published(2, id("b"));
        c.published(3, id("a"));
        let key = ReturnedKey {
            lsn: None,
            message_id: Some("a"),
        };
        assert_eq!(c.returned(key, 312, "NO_ROUTE"), Ok(2));
        // The second publish's own return finds it marked: expected, not a violation.
        assert_eq!(c.returned(key, 312, "NO_ROUTE"), Ok(0));
        let mut out = Vec::new();
        c.ack(3, true, &mut out).unwrap();
        assert_eq!(
            out,
            vec![
                (1, returned_312()),
                (2, PublishOutcome::Routed),
                (3, returned_312())
            ]
        );
    }

    #[test]
    fn fail_all_reports_every_unsettled_publish_in_tag_order() {
        let mut c = three();
        let mut out = Vec::new();
        c.ack(2, false, &mut out).unwrap();
        out.clear();
        c.fail_all(
            &FailureCause::ConnectionLost("socket closed".into()),
            &mut out,
        );
        let tags: Vec<u32> = out.iter().map(|(t, _)| *t).collect();
        assert_eq!(tags, vec![1, 3]);
        assert!(out.iter().all(
            |(_, o)| matches!(o, PublishOutcome::Failed(f) if f.to_string() == "socket closed")
        ));
        assert_eq!(c.unsettled(), 0);
    }

    /// The return index gives what a scan of the whole window gives, through any mix of
    /// publishes (keys shared by message id), returns, acks and nacks (single and
    /// multiple) and a failed connection; and it holds exactly the unsettled publishes.
    mod index_model {
        use super::*;
        use proptest::prelude::*;

        #[derive(Debug, Clone)]
        enum Op {
            PublishLsn(u64),
            PublishId(u8),
            ReturnLsn(u64),
            ReturnId(u8),
            Ack(u64, bool),
            Nack(u64, bool),
            FailAll,
        }

        fn op() -> impl Strategy<Value = Op> {
            prop_oneof![
                4 => (0u64..40).prop_map(Op::PublishLsn),
                4 => (0u8..4).prop_map(Op::PublishId),
                2 => (0u64..40).prop_map(Op::ReturnLsn),
                2 => (0u8..5).prop_map(Op::ReturnId),
                3 => (0u64..30, any::<bool>()).prop_map(|(t, m)| Op::Ack(t, m)),
                1 => (0u64..30, any::<bool>()).prop_map(|(t, m)| Op::Nack(t, m)),
                1 => Just(Op::FailAll),
            ]
        }

        /// The window as a plain list: (delivery tag, key, returned, settled).
        #[derive(Default)]
        struct Naive {
            next: u64,
            entries: Vec<(u64, MatchKey, bool, bool)>,
        }

        impl Naive {
            fn returned(&mut self, key: ReturnedKey<'_>) -> Result<usize, ()> {
                let (mut marked, mut matched) = (0, false);
                // The LSN match first (unique), then every id match: as the index does.
                for e in self.entries.iter_mut().filter(|e| !e.3) {
                    if matches!(&e.1, MatchKey::Lsn(l) if key.lsn == Some(*l)) {
                        matched = true;
                        if !e.2 {
                            e.2 = true;
                            marked += 1;
                            break;
                        }
                    }
                }
                for e in self.entries.iter_mut().filter(|e| !e.3) {
                    if matches!(&e.1, MatchKey::MessageId(id) if key.message_id == Some(id.as_str()))
                    {
                        matched = true;
                        if !e.2 {
                            e.2 = true;
                            marked += 1;
                        }
                    }
                }
                if matched {
                    Ok(marked)
                } else {
                    Err(())
                }
            }
        }

        proptest! {
            #[test]
            fn the_index_matches_a_scan(ops in proptest::collection::vec(op(), 1..120)) {
                let mut c: Confirms<u64> = Confirms::default();
                let mut naive = Naive { next: 1, ..Naive::default() };
                for op in ops {
                    match op {
                        Op::PublishLsn(l) => {
                            // Unique among unsettled publishes, as the publisher keeps it.
                            if naive.entries.iter().any(|e| !e.3 && e.1 == MatchKey::Lsn(Lsn(l))) {
                                continue;
                            }
                            let tag = c.published(naive.next, MatchKey::Lsn(Lsn(l)));
                            prop_assert_eq!(tag, naive.next);
                            naive.entries.push((tag, MatchKey::Lsn(Lsn(l)), false, false));
                            naive.next += 1;
                        }
                        Op::PublishId(i) => {
                            let key = MatchKey::MessageId(format!("id-{i}").into());
                            let tag = c.published(naive.next, key.clone());
                            naive.entries.push((tag, key, false, false));
                            naive.next += 1;
                        }
                        Op::ReturnLsn(l) => {
                            let key = ReturnedKey { lsn: Some(Lsn(l)), message_id: None };
                            prop_assert_eq!(c.returned(key, 312, "NO_ROUTE").ok(), naive.returned(key).ok());
                        }
                        Op::ReturnId(i) => {
                            let id = format!("id-{i}");
                            let key = ReturnedKey { lsn: None, message_id: Some(id.as_str()) };
                            prop_assert_eq!(c.returned(key, 312, "NO_ROUTE").ok(), naive.returned(key).ok());
                        }
                        Op::Ack(t, m) | Op::Nack(t, m) => {
                            let ack = matches!(op, Op::Ack(..));
                            let mut out = Vec::new();
                            let r = if ack { c.ack(t, m, &mut out) } else { c.nack(t, m, &mut out) };
                            let mut want = Vec::new();
                            let known = naive.entries.iter().any(|e| e.0 == t && !e.3)
                                || (m && t >= 1 && t < naive.next);
                            if known {
                                for e in naive.entries.iter_mut().filter(|e| !e.3 && (e.0 == t || (m && e.0 < t))) {
                                    e.3 = true;
                                    want.push((e.0, match (ack, e.2) {
                                        (false, _) => "nacked",
                                        (true, true) => "returned",
                                        (true, false) => "routed",
                                    }));
                                }
                            }
                            prop_assert_eq!(r.is_ok(), known, "{:?}", r);
                            let got: Vec<(u64, &str)> = out.iter().map(|(tag, o)| (*tag, match o {
                                PublishOutcome::Nacked => "nacked",
                                PublishOutcome::Returned { .. } => "returned",
                                PublishOutcome::Routed => "routed",
                                _ => "other",
                            })).collect();
                            prop_assert_eq!(got, want);
                        }
                        Op::FailAll => {
                            let mut out = Vec::new();
                            c.fail_all(&FailureCause::ConnectionLost("lost".into()), &mut out);
                            for e in naive.entries.iter_mut() {
                                e.3 = true;
                            }
                        }
                    }
                    let indexed: usize = c.by_lsn.values().chain(c.by_id.values()).map(|t| t.as_slice().len()).sum();
                    prop_assert_eq!(indexed, c.unsettled());
                    prop_assert_eq!(c.unsettled(), naive.entries.iter().filter(|e| !e.3).count());
                }
            }
        }
    }
}
