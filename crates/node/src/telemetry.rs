//! What the node's parts share to report themselves in `/metrics`: a
//! latency histogram recorded with relaxed atomic adds, and the helpers that
//! write a counter, a gauge or a labelled family at scrape time. The server,
//! the second tier and the cluster each encode their own series with these;
//! none imports another's metrics.

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet, EncodeMetric};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::MetricType;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct OpLabel {
    pub(crate) op: &'static str,
}

/// Upper bounds of the latency buckets, in seconds: 10 µs to 2.5 s, wide
/// enough for a 4 KiB hit and a 64 MiB batch alike.
const BUCKETS: [f64; 14] = [1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 0.1, 0.5, 2.5];

/// A latency histogram recorded with relaxed atomic adds.
#[derive(Default)]
pub(crate) struct LatencyHistogram {
    buckets: [AtomicU64; BUCKETS.len()],
    count: AtomicU64,
    sum_ns: AtomicU64,
}

impl LatencyHistogram {
    pub(crate) fn record(&self, d: Duration) {
        let secs = d.as_secs_f64();
        if let Some(i) = BUCKETS.iter().position(|&b| secs <= b) {
            self.buckets[i].fetch_add(1, Ordering::Relaxed);
        }
        self.count.fetch_add(1, Ordering::Relaxed);
        self.sum_ns.fetch_add(d.as_nanos().min(u64::MAX as u128) as u64, Ordering::Relaxed);
    }

    /// (sum in seconds, count, per-bucket counts) as the encoder wants them;
    /// observations above the last bound count only toward `+Inf`.
    pub(crate) fn snapshot(&self) -> (f64, u64, Vec<(f64, u64)>) {
        let buckets: Vec<(f64, u64)> = BUCKETS.iter().zip(&self.buckets).map(|(b, c)| (*b, c.load(Ordering::Relaxed))).collect();
        let count = self.count.load(Ordering::Relaxed);
        let in_buckets: u64 = buckets.iter().map(|(_, c)| c).sum();
        let mut with_inf = buckets;
        with_inf.push((f64::INFINITY, count.saturating_sub(in_buckets)));
        (self.sum_ns.load(Ordering::Relaxed) as f64 / 1e9, count, with_inf)
    }
}

pub(crate) fn counter(encoder: &mut DescriptorEncoder, name: &str, help: &str, value: u64) -> fmt::Result {
    let metric = ConstCounter::new(value);
    metric.encode(encoder.encode_descriptor(name, help, None, metric.metric_type())?)
}

pub(crate) fn gauge(encoder: &mut DescriptorEncoder, name: &str, help: &str, value: u64) -> fmt::Result {
    let metric = ConstGauge::<i64>::new(i64::try_from(value).unwrap_or(i64::MAX));
    metric.encode(encoder.encode_descriptor(name, help, None, metric.metric_type())?)
}

/// A counter family with one series per `(labels, value)`.
pub(crate) fn counters<L: EncodeLabelSet + fmt::Debug>(
    e: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    series: &[(L, u64)],
) -> fmt::Result {
    let mut family = e.encode_descriptor(name, help, None, MetricType::Counter)?;
    for (labels, value) in series {
        ConstCounter::new(*value).encode(family.encode_family(labels)?)?;
    }
    Ok(())
}
