//! Counters and latency histograms of a node, rendered as Prometheus text.
//!
//! Plain atomics with fixed buckets: recording is two relaxed increments on
//! the request path, and a scrape reads them without stopping anything.

use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use crate::cache::CacheStats;
use crate::memory::PoolStats;

/// Operations timed by the node.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    Put,
    Get,
    Exists,
    Delete,
    MatchPrefix,
}

impl Op {
    pub const ALL: [Op; 5] = [Op::Put, Op::Get, Op::Exists, Op::Delete, Op::MatchPrefix];

    pub fn name(self) -> &'static str {
        match self {
            Op::Put => "put",
            Op::Get => "get",
            Op::Exists => "exists",
            Op::Delete => "delete",
            Op::MatchPrefix => "match_prefix",
        }
    }
}

/// Upper bounds of the latency buckets, in seconds: 10 µs to 2.5 s, wide
/// enough for a 4 KiB hit and a 64 MiB batch alike.
const BUCKETS: [f64; 14] = [1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 0.1, 0.5, 2.5];

#[derive(Default)]
struct Histogram {
    buckets: [AtomicU64; BUCKETS.len()],
    count: AtomicU64,
    sum_ns: AtomicU64,
}

impl Histogram {
    fn record(&self, d: Duration) {
        let secs = d.as_secs_f64();
        if let Some(i) = BUCKETS.iter().position(|&b| secs <= b) {
            self.buckets[i].fetch_add(1, Ordering::Relaxed);
        }
        self.count.fetch_add(1, Ordering::Relaxed);
        self.sum_ns.fetch_add(d.as_nanos().min(u64::MAX as u128) as u64, Ordering::Relaxed);
    }
}

/// Everything a node counts besides what the cache and pool count themselves.
#[derive(Default)]
pub struct Metrics {
    latency: [Histogram; 5],
    /// Keys handled per operation (a batch of 32 counts 32).
    keys: [AtomicU64; 5],
    pub connections_open: AtomicU64,
    pub connections_total: AtomicU64,
    pub connections_refused: AtomicU64,
    pub protocol_errors: AtomicU64,
    pub checksum_failures: AtomicU64,
    pub bytes_received: AtomicU64,
    pub bytes_sent: AtomicU64,
}

impl Metrics {
    pub fn record(&self, op: Op, keys: usize, elapsed: Duration) {
        self.latency[op as usize].record(elapsed);
        self.keys[op as usize].fetch_add(keys as u64, Ordering::Relaxed);
    }

    pub fn requests(&self, op: Op) -> u64 {
        self.latency[op as usize].count.load(Ordering::Relaxed)
    }

    /// The counters sent in a STATS answer and printed by `kvplane stats`.
    pub fn snapshot(&self, cache: &CacheStats, pool: &PoolStats) -> Vec<(String, u64)> {
        let mut out = vec![
            ("hits".to_string(), cache.hits),
            ("misses".into(), cache.misses),
            ("evictions".into(), cache.evictions),
            ("inserts".into(), cache.inserts),
            ("removals".into(), cache.removals),
            ("entries".into(), cache.entries),
            ("pinned".into(), cache.pinned),
            ("bytes_stored".into(), cache.bytes_stored),
            ("memory_capacity_bytes".into(), pool.capacity_bytes as u64),
            ("memory_used_bytes".into(), pool.used_bytes as u64),
            ("memory_failed_allocations".into(), pool.failed_allocations),
            ("connections_open".into(), self.connections_open.load(Ordering::Relaxed)),
            ("connections_total".into(), self.connections_total.load(Ordering::Relaxed)),
            ("connections_refused".into(), self.connections_refused.load(Ordering::Relaxed)),
            ("protocol_errors".into(), self.protocol_errors.load(Ordering::Relaxed)),
            ("checksum_failures".into(), self.checksum_failures.load(Ordering::Relaxed)),
            ("bytes_received".into(), self.bytes_received.load(Ordering::Relaxed)),
            ("bytes_sent".into(), self.bytes_sent.load(Ordering::Relaxed)),
        ];
        for op in Op::ALL {
            out.push((format!("requests_{}", op.name()), self.requests(op)));
            out.push((format!("keys_{}", op.name()), self.keys[op as usize].load(Ordering::Relaxed)));
        }
        out
    }

    /// Prometheus text exposition format, version 0.0.4.
    pub fn render(&self, cache: &CacheStats, pool: &PoolStats) -> String {
        let mut s = String::new();
        let mut counter = |name: &str, help: &str, kind: &str, value: u64| {
            let _ = writeln!(s, "# HELP kvplane_{name} {help}\n# TYPE kvplane_{name} {kind}\nkvplane_{name} {value}");
        };
        counter("cache_hits_total", "GET keys found in the memory tier.", "counter", cache.hits);
        counter("cache_misses_total", "GET keys not found in the memory tier.", "counter", cache.misses);
        counter("cache_evictions_total", "Entries evicted to make room.", "counter", cache.evictions);
        counter("cache_inserts_total", "Blocks stored (new or replaced).", "counter", cache.inserts);
        counter("cache_entries", "Blocks currently stored.", "gauge", cache.entries);
        counter("cache_pinned_entries", "Blocks under an unexpired pin lease.", "gauge", cache.pinned);
        counter("cache_bytes_stored", "Payload bytes currently stored.", "gauge", cache.bytes_stored);
        counter("memory_capacity_bytes", "Size of the preallocated block pool.", "gauge", pool.capacity_bytes as u64);
        counter("memory_used_bytes", "Pool bytes held by live blocks (by size class).", "gauge", pool.used_bytes as u64);
        counter("memory_failed_allocations_total", "Block allocations refused for lack of memory.", "counter", pool.failed_allocations);
        counter("connections_open", "Client connections currently open.", "gauge", self.connections_open.load(Ordering::Relaxed));
        counter("connections_total", "Client connections accepted.", "counter", self.connections_total.load(Ordering::Relaxed));
        counter("connections_refused_total", "Connections refused (limit, token, handshake).", "counter", self.connections_refused.load(Ordering::Relaxed));
        counter("protocol_errors_total", "Frames refused as malformed or over a limit.", "counter", self.protocol_errors.load(Ordering::Relaxed));
        counter("checksum_failures_total", "PUT blocks whose payload failed its checksum.", "counter", self.checksum_failures.load(Ordering::Relaxed));
        counter("received_bytes_total", "Bytes read from clients.", "counter", self.bytes_received.load(Ordering::Relaxed));
        counter("sent_bytes_total", "Bytes written to clients.", "counter", self.bytes_sent.load(Ordering::Relaxed));
        let _ = writeln!(s, "# HELP kvplane_op_keys_total Keys handled, by operation.\n# TYPE kvplane_op_keys_total counter");
        for op in Op::ALL {
            let _ = writeln!(s, "kvplane_op_keys_total{{op=\"{}\"}} {}", op.name(), self.keys[op as usize].load(Ordering::Relaxed));
        }
        let _ = writeln!(s, "# HELP kvplane_op_duration_seconds Request latency inside the node, by operation.\n# TYPE kvplane_op_duration_seconds histogram");
        for op in Op::ALL {
            let h = &self.latency[op as usize];
            let mut cumulative = 0;
            for (i, bound) in BUCKETS.iter().enumerate() {
                cumulative += h.buckets[i].load(Ordering::Relaxed);
                let _ = writeln!(s, "kvplane_op_duration_seconds_bucket{{op=\"{}\",le=\"{bound}\"}} {cumulative}", op.name());
            }
            let count = h.count.load(Ordering::Relaxed);
            let _ = writeln!(s, "kvplane_op_duration_seconds_bucket{{op=\"{}\",le=\"+Inf\"}} {count}", op.name());
            let _ = writeln!(s, "kvplane_op_duration_seconds_sum{{op=\"{}\"}} {}", op.name(), h.sum_ns.load(Ordering::Relaxed) as f64 / 1e9);
            let _ = writeln!(s, "kvplane_op_duration_seconds_count{{op=\"{}\"}} {count}", op.name());
        }
        s
    }
}
