//! Which partition a message goes to under `run --partitions N`: decided by the message
//! alone (never by arrival time or load), so the same key always goes through the same
//! partition, and a restart maps every key to the same partition as before.
//!
//! # The rule (fixed: a tool may compute it)
//!
//! 1. The key is a field of the message's envelope chosen by `--partition-key`
//!    ([`PartitionKey`]): `aggregate_id` (the default), `tenant` or `topic`, as UTF-8
//!    bytes. A message whose envelope lacks the field (no `aggregate_id`, say) is keyed by
//!    its transaction instead: the 8 bytes of its commit LSN, big-endian (the LSN
//!    `0/16B3748` is `00 00 00 00 01 6B 37 48`), so a transaction's keyless messages stay
//!    together, in their order.
//! 2. The hash is 64-bit FNV-1a of those bytes (offset basis `0xcbf29ce484222325`, prime
//!    `0x100000001b3`, wrapping multiplication): [`fnv1a64`].
//! 3. The partition is the hash modulo N, numbered 0 to N - 1: [`partition_of`].
//!
//! With N = 1 every message is partition 0 (and `run` uses one connection exactly as
//! without partitions). Pure: no I/O.

use crate::envelope::Envelope;
use crate::lsn::Lsn;

/// The most partitions `run --partitions` accepts.
pub const MAX_PARTITIONS: u16 = 64;

/// The envelope field a message's partition is computed from (`--partition-key`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum PartitionKey {
    /// `meta.aggregate_id` (`outbox.emit(..., aggregate_id => ...)`): one aggregate's
    /// events stay in commit order. The default.
    #[default]
    AggregateId,
    /// `meta.tenant`: one tenant's events stay in commit order.
    Tenant,
    /// The topic: one topic's events stay in commit order.
    Topic,
}

impl PartitionKey {
    /// The name `--partition-key` takes (`aggregate_id`, `tenant`, `topic`).
    pub fn name(self) -> &'static str {
        match self {
            PartitionKey::AggregateId => "aggregate_id",
            PartitionKey::Tenant => "tenant",
            PartitionKey::Topic => "topic",
        }
    }
}

/// 64-bit FNV-1a of `bytes` (offset basis `0xcbf29ce484222325`, prime `0x100000001b3`).
pub fn fnv1a64(bytes: &[u8]) -> u64 {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for &b in bytes {
        hash ^= u64::from(b);
        hash = hash.wrapping_mul(0x0000_0100_0000_01b3);
    }
    hash
}

/// The partition (0 to `partitions - 1`) of a key's bytes: [`fnv1a64`] modulo
/// `partitions`. `partitions` of 0 is taken as 1.
pub fn partition_of(key: &[u8], partitions: u16) -> u16 {
    (fnv1a64(key) % u64::from(partitions.max(1))) as u16
}

/// The partition of one message: its `key` field of `envelope` when set, else its
/// transaction (`commit_lsn`, 8 bytes big-endian), by [`partition_of`].
pub fn partition_for(
    envelope: &Envelope,
    commit_lsn: Lsn,
    key: PartitionKey,
    partitions: u16,
) -> u16 {
    if partitions <= 1 {
        return 0;
    }
    let field = match key {
        PartitionKey::AggregateId => envelope.meta.aggregate_id.as_deref(),
        PartitionKey::Tenant => envelope.meta.tenant.as_deref(),
        PartitionKey::Topic => Some(envelope.topic.as_str()),
    };
    match field {
        Some(text) => partition_of(text.as_bytes(), partitions),
        None => partition_of(&commit_lsn.0.to_be_bytes(), partitions),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The published FNV-1a 64 test vectors (Fowler, Noll, Vo), so the documented hash is
    /// the one computed.
    #[test]
    fn fnv1a64_matches_the_published_vectors() {
        assert_eq!(fnv1a64(b""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(fnv1a64(b"a"), 0xaf63_dc4c_8601_ec8c);
        assert_eq!(fnv1a64(b"foobar"), 0x8594_4171_f739_67e8);
    }

    #[test]
    fn partitions_are_stable_and_in_range() {
        // Fixed values: a change of the rule breaks every consumer that computes it.
        assert_eq!(
            partition_of(b"order-42", 8),
            (fnv1a64(b"order-42") % 8) as u16
        );
        for n in 1..=MAX_PARTITIONS {
            for key in ["", "a", "order-1", "order-2", "ünïcode"] {
                let p = partition_of(key.as_bytes(), n);
                assert!(p < n);
                assert_eq!(p, partition_of(key.as_bytes(), n));
            }
        }
        assert_eq!(partition_of(b"x", 0), 0);
    }

    fn envelope(aggregate: Option<&str>, tenant: Option<&str>, topic: &str) -> Envelope {
        Envelope {
            version: 3,
            message_id: "m".into(),
            topic: topic.into(),
            content_type: "application/json".into(),
            headers: Default::default(),
            payload: Default::default(),
            emitted_by: None,
            emitted_by_unchecked: false,
            exchange: None,
            meta: crate::envelope::Metadata {
                aggregate_id: aggregate.map(str::to_owned),
                tenant: tenant.map(str::to_owned),
                ..Default::default()
            },
        }
    }

    #[test]
    fn a_message_goes_by_its_key_and_a_keyless_one_by_its_transaction() {
        let commit = Lsn(0x16B_3748);
        let e = envelope(Some("order-42"), Some("acme"), "orders.created");
        assert_eq!(
            partition_for(&e, commit, PartitionKey::AggregateId, 8),
            partition_of(b"order-42", 8)
        );
        assert_eq!(
            partition_for(&e, commit, PartitionKey::Tenant, 8),
            partition_of(b"acme", 8)
        );
        assert_eq!(
            partition_for(&e, commit, PartitionKey::Topic, 8),
            partition_of(b"orders.created", 8)
        );
        // No aggregate id: the transaction's commit LSN, 8 bytes big-endian.
        let keyless = envelope(None, None, "t");
        assert_eq!(
            partition_for(&keyless, commit, PartitionKey::AggregateId, 8),
            partition_of(&[0, 0, 0, 0, 0x01, 0x6B, 0x37, 0x48], 8)
        );
        // Another key moves nothing of the first: the same key, another message.
        let other = envelope(Some("order-42"), None, "orders.paid");
        assert_eq!(
            partition_for(&other, Lsn(1), PartitionKey::AggregateId, 8),
            partition_for(&e, commit, PartitionKey::AggregateId, 8)
        );
        assert_eq!(partition_for(&e, commit, PartitionKey::AggregateId, 1), 0);
    }

    #[test]
    fn keys_spread_over_the_partitions() {
        let mut counts = [0usize; 8];
        for i in 0..8000 {
            counts[partition_of(format!("order-{i}").as_bytes(), 8) as usize] += 1;
        }
        assert!(
            counts.iter().all(|&c| (700..1300).contains(&c)),
            "{counts:?}"
        );
    }
}
