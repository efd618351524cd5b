//! pgoutbox's own residence time ([`super::RESIDENCE_SECONDS`]): from the socket read that
//! completed a message's frame on the replication stream to the socket write that put its
//! last byte on the broker connection, first publishes only. End-to-end latency on a shared
//! machine measures the host (PostgreSQL's commit, the broker's fsync, the scheduler); this
//! measures the relay.
//!
//! Atomic buckets, one relaxed add per message at the write that completes it; encoded
//! through `prometheus-client`'s histogram encoder.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use prometheus_client::encoding::{EncodeMetric, MetricEncoder};
use prometheus_client::metrics::MetricType;

/// Upper bounds of the residence buckets, in seconds (25 µs to 1 s).
pub const RESIDENCE_BOUNDS: [f64; 14] = [
    0.000_025, 0.000_05, 0.000_1, 0.000_25, 0.000_5, 0.001, 0.002_5, 0.005, 0.01, 0.025, 0.05, 0.1,
    0.25, 1.0,
];

/// The residence histogram; clones share the buckets.
#[derive(Debug, Default, Clone)]
pub struct Residence {
    inner: Arc<Buckets>,
}

#[derive(Debug, Default)]
struct Buckets {
    /// Non-cumulative counts per bound in [`RESIDENCE_BOUNDS`], then +Inf.
    counts: [AtomicU64; RESIDENCE_BOUNDS.len() + 1],
    /// Sum of the observations, in nanoseconds.
    sum_ns: AtomicU64,
}

impl Residence {
    /// Records one message's residence.
    pub fn observe(&self, residence: Duration) {
        let secs = residence.as_secs_f64();
        let i = RESIDENCE_BOUNDS
            .iter()
            .position(|b| secs <= *b)
            .unwrap_or(RESIDENCE_BOUNDS.len());
        self.inner.counts[i].fetch_add(1, Ordering::Relaxed);
        let ns = u64::try_from(residence.as_nanos()).unwrap_or(u64::MAX);
        self.inner.sum_ns.fetch_add(ns, Ordering::Relaxed);
    }

    /// Observations so far.
    pub fn count(&self) -> u64 {
        self.inner
            .counts
            .iter()
            .map(|c| c.load(Ordering::Relaxed))
            .sum()
    }
}

impl EncodeMetric for Residence {
    fn encode(&self, mut encoder: MetricEncoder) -> Result<(), std::fmt::Error> {
        let buckets: Vec<(f64, u64)> = RESIDENCE_BOUNDS
            .iter()
            .copied()
            .chain(std::iter::once(f64::MAX))
            .zip(self.inner.counts.iter().map(|b| b.load(Ordering::Relaxed)))
            .collect();
        let count = buckets.iter().map(|(_, n)| n).sum();
        let sum = self.inner.sum_ns.load(Ordering::Relaxed) as f64 / 1e9;
        encoder
            .encode_histogram::<prometheus_client::encoding::NoLabelSet>(sum, count, &buckets, None)
    }

    fn metric_type(&self) -> MetricType {
        MetricType::Histogram
    }
}

/// The `q` quantile (0 to 1) of a histogram given as cumulative `(upper bound, count)`
/// pairs in bound order (the Prometheus text form, `+Inf` last), interpolated linearly inside
/// the bucket it falls in, as Prometheus' `histogram_quantile` does. `None` when empty.
pub fn quantile(cumulative: &[(f64, u64)], q: f64) -> Option<f64> {
    let total = cumulative.last()?.1;
    if total == 0 {
        return None;
    }
    let rank = q.clamp(0.0, 1.0) * total as f64;
    let mut lower = (0.0, 0u64);
    for &(bound, count) in cumulative {
        if count as f64 >= rank {
            if !bound.is_finite() || bound == f64::MAX {
                return Some(lower.0);
            }
            let inside = (count - lower.1) as f64;
            let frac = if inside > 0.0 {
                (rank - lower.1 as f64) / inside
            } else {
                1.0
            };
            return Some(lower.0 + (bound - lower.0) * frac);
        }
        lower = (bound, count);
    }
    Some(lower.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn observations_land_in_their_buckets_and_quantiles_interpolate() {
        let r = Residence::default();
        for _ in 0..90 {
            r.observe(Duration::from_micros(40));
        }
        for _ in 0..10 {
            r.observe(Duration::from_millis(3));
        }
        assert_eq!(r.count(), 100);
        let mut text = String::new();
        let mut registry = prometheus_client::registry::Registry::default();
        registry.register("r_seconds", "test", r.clone());
        prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
        assert!(
            text.contains("r_seconds_bucket{le=\"0.00005\"} 90"),
            "{text}"
        );
        assert!(
            text.contains("r_seconds_bucket{le=\"0.005\"} 100"),
            "{text}"
        );
        let cumulative = [
            (0.000_025, 0),
            (0.000_05, 90),
            (0.005, 100),
            (f64::MAX, 100),
        ];
        let p50 = quantile(&cumulative, 0.5).unwrap();
        assert!((0.000_025..=0.000_05).contains(&p50), "{p50}");
        let p99 = quantile(&cumulative, 0.99).unwrap();
        assert!((0.000_05..=0.005).contains(&p99), "{p99}");
        assert_eq!(quantile(&[(1.0, 0), (f64::MAX, 0)], 0.5), None);
    }
}
