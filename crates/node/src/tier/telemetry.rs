//! The second tier's series in `/metrics`: hits and misses per tier,
//! backend latency, bytes, errors, retries, what the ingest did, whether the
//! store answers and what failed its check. Encoded at scrape time from the
//! tier's own counters.

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};

use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet};
use prometheus_client::metrics::MetricType;

use super::{operation_name, SecondTier, OPERATIONS};
use crate::cache::CacheStats;
use crate::telemetry::{counter, counters, gauge, OpLabel};

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct TierLabel {
    tier: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct OutcomeLabel {
    outcome: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ErrorLabel {
    op: &'static str,
    error: String,
}

/// The second tier's series: hits and misses per tier, backend latency,
/// bytes, errors, retries and what the ingest did.
impl SecondTier {
    pub(crate) fn encode_metrics(&self, e: &mut DescriptorEncoder, cache: &CacheStats) -> fmt::Result {
        let tier = self;
        let m = tier.metrics();
        let load = |c: &AtomicU64| c.load(Ordering::Relaxed);
        let memory = TierLabel { tier: "memory" };
        let backend = TierLabel { tier: "backend" };
        counters(e, "kvplane_tier_hits", "GET keys found, by tier", &[(memory.clone(), cache.hits), (backend.clone(), load(&m.hits))])?;
        counters(e, "kvplane_tier_misses", "GET keys not found, by tier", &[(memory, cache.misses), (backend, load(&m.misses))])?;
        counter(e, "kvplane_backend_read_bytes", "Bytes read from the second tier into pool blocks", load(&m.read_bytes))?;
        counter(e, "kvplane_backend_written_bytes", "Bytes written to the second tier", load(&m.written_bytes))?;
        counter(e, "kvplane_backend_retries", "Second-tier calls retried", load(&m.retries))?;
        counter(e, "kvplane_backend_failed_open", "Second-tier failures answered as misses (fail-open)", load(&m.failed_open))?;
        gauge(
            e,
            "kvplane_backend_reachable",
            "1 while the second tier's store answers, 0 while it is unreachable",
            u64::from(m.reachable.load(Ordering::Relaxed)),
        )?;
        counter(e, "kvplane_backend_corrupt", "Second-tier blocks that failed their trailer's check (never served)", load(&m.corrupt))?;
        counter(
            e,
            "kvplane_backend_corrupt_rereads",
            "Second-tier blocks read again because they disagreed with their trailer (a read racing an overwrite looks so)",
            load(&m.corrupt_rereads),
        )?;
        counter(e, "kvplane_backend_unsealed", "Second-tier blocks without a trailer, answered as misses", load(&m.unsealed))?;
        let errors: Vec<(ErrorLabel, u64)> = m
            .errors
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .map(|((op, kind), n)| (ErrorLabel { op: operation_name(*op), error: kind.to_string() }, *n))
            .collect();
        counters(e, "kvplane_backend_errors", "Second-tier call failures, by operation and error", &errors)?;
        counters(
            e,
            "kvplane_tier_ingest",
            "Blocks offered to the second tier, by outcome",
            &[
                (OutcomeLabel { outcome: "stored" }, load(&m.ingest_stored)),
                (OutcomeLabel { outcome: "failed" }, load(&m.ingest_failed)),
                (OutcomeLabel { outcome: "skipped" }, load(&m.ingest_skipped)),
            ],
        )?;
        counter(e, "kvplane_tier_ingest_waits", "PUTs that waited for room in the second tier's queue", load(&m.ingest_waited))?;
        gauge(e, "kvplane_tier_ingest_in_flight_bytes", "Bytes queued for or being written to the second tier", tier.in_flight_bytes())?;
        let mut family =
            e.encode_descriptor("kvplane_backend_duration_seconds", "Second-tier call latency, by operation", None, MetricType::Histogram)?;
        for op in OPERATIONS {
            let (sum, count, buckets) = m.latency[op as usize].snapshot();
            family.encode_family(&OpLabel { op: operation_name(op) })?.encode_histogram::<OpLabel>(sum, count, &buckets, None)?;
        }
        Ok(())
    }
}
