//! The commit-to-confirm latency histogram ([`super::CONFIRM_LATENCY_SECONDS`]): atomic
//! buckets the loop adds a turn's batch to at once, encoded through `prometheus-client`'s
//! histogram encoder.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use prometheus_client::encoding::{EncodeMetric, MetricEncoder};
use prometheus_client::metrics::MetricType;

/// Upper bounds of the confirm-latency buckets, in seconds.
const LATENCY_BOUNDS: [f64; 14] = [
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 60.0,
];

/// A commit-to-confirm histogram with atomic buckets (the crate's own histogram takes a
/// mutex per observation); encoded through `prometheus-client`'s histogram encoder. Clones
/// share the buckets.
#[derive(Debug, Default, Clone)]
pub struct ConfirmLatency {
    inner: Arc<LatencyBuckets>,
}

#[derive(Debug, Default)]
struct LatencyBuckets {
    /// Non-cumulative counts per bound in [`LATENCY_BOUNDS`], then +Inf.
    buckets: [AtomicU64; LATENCY_BOUNDS.len() + 1],
    sum_us: AtomicU64,
}

/// Latencies gathered during one loop turn, added to [`ConfirmLatency`] at once.
#[derive(Debug, Default, Clone)]
pub struct LatencyBatch {
    buckets: [u64; LATENCY_BOUNDS.len() + 1],
    sum_us: u64,
    count: u64,
}

impl LatencyBatch {
    /// Records one latency in microseconds (negative: clock skew, counted as 0).
    pub fn observe_us(&mut self, us: i64) {
        let us = us.max(0) as u64;
        let secs = us as f64 / 1e6;
        let i = LATENCY_BOUNDS
            .iter()
            .position(|b| secs <= *b)
            .unwrap_or(LATENCY_BOUNDS.len());
        self.buckets[i] += 1;
        self.sum_us += us;
        self.count += 1;
    }
}

impl ConfirmLatency {
    /// Adds a batch and clears it.
    pub fn add(&self, batch: &mut LatencyBatch) {
        if batch.count == 0 {
            return;
        }
        let inner = &self.inner;
        for (b, n) in inner.buckets.iter().zip(batch.buckets) {
            if n > 0 {
                b.fetch_add(n, Ordering::Relaxed);
            }
        }
        inner.sum_us.fetch_add(batch.sum_us, Ordering::Relaxed);
        *batch = LatencyBatch::default();
    }
}

impl EncodeMetric for ConfirmLatency {
    fn encode(&self, mut encoder: MetricEncoder) -> Result<(), std::fmt::Error> {
        let buckets: Vec<(f64, u64)> = LATENCY_BOUNDS
            .iter()
            .copied()
            .chain(std::iter::once(f64::MAX))
            .zip(self.inner.buckets.iter().map(|b| b.load(Ordering::Relaxed)))
            .collect();
        let count = buckets.iter().map(|(_, n)| n).sum();
        let sum = self.inner.sum_us.load(Ordering::Relaxed) as f64 / 1e6;
        encoder
            .encode_histogram::<prometheus_client::encoding::NoLabelSet>(sum, count, &buckets, None)
    }

    fn metric_type(&self) -> MetricType {
        MetricType::Histogram
    }
}

#[cfg(test)]
impl LatencyBatch {
    /// Observations in the batch (cleared by [`ConfirmLatency::add`]).
    pub(super) fn count(&self) -> u64 {
        self.count
    }
}
