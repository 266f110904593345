//! What a node measures, through the process's one Prometheus registry.
//!
//! Recording on the request path is relaxed atomic adds only: counters are
//! prometheus-client handles resolved once at start (one per operation, no
//! label lookup), and latency goes into fixed-bucket atomic histograms of our
//! own, because prometheus-client's `Histogram` takes a mutex per
//! observation, which every connection serving the same operation would
//! contend on. The histograms, and the cache's and the pool's own counters,
//! are read at scrape time by a collector.

use std::fmt;
use std::sync::atomic::Ordering;
use std::sync::Weak;
use std::time::Duration;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::DescriptorEncoder;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::Registry;

use super::NodeState;
use crate::cache::CacheStats;
use crate::memory::PoolStats;
use crate::telemetry::{counter, gauge, LatencyHistogram, OpLabel};

/// Operations timed by the node.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Op {
    Put,
    Get,
    Exists,
    Delete,
    MatchPrefix,
}

impl Op {
    pub(crate) const ALL: [Op; 5] = [Op::Put, Op::Get, Op::Exists, Op::Delete, Op::MatchPrefix];

    pub(crate) fn name(self) -> &'static str {
        match self {
            Op::Put => "put",
            Op::Get => "get",
            Op::Exists => "exists",
            Op::Delete => "delete",
            Op::MatchPrefix => "match_prefix",
        }
    }
}

/// Everything a node counts besides what the cache and pool count themselves.
pub(crate) struct Metrics {
    requests_family: Family<OpLabel, Counter>,
    keys_family: Family<OpLabel, Counter>,
    requests: [Counter; 5],
    keys: [Counter; 5],
    latency: [LatencyHistogram; 5],
    pub connections_open: Gauge,
    pub connections_total: Counter,
    pub connections_refused: Counter,
    /// Connections refused because their peer held its share.
    pub peer_share_refused: Counter,
    /// Handshakes that failed (token, HELLO, version, silence).
    pub handshake_failures: Counter,
    /// Connections refused because their peer failed too many handshakes.
    pub handshakes_throttled: Counter,
    /// Idle connections told they are closed.
    pub idle_closed: Counter,
    /// Frames cut for arriving too slowly.
    pub frames_stalled: Counter,
    pub protocol_errors: Counter,
    pub checksum_failures: Counter,
    pub bytes_received: Counter,
    pub bytes_sent: Counter,
}

impl Default for Metrics {
    fn default() -> Self {
        let requests_family = Family::<OpLabel, Counter>::default();
        let keys_family = Family::<OpLabel, Counter>::default();
        let label = |op: Op| OpLabel { op: op.name() };
        Metrics {
            requests: Op::ALL.map(|op| requests_family.get_or_create_owned(&label(op))),
            keys: Op::ALL.map(|op| keys_family.get_or_create_owned(&label(op))),
            latency: Default::default(),
            requests_family,
            keys_family,
            connections_open: Gauge::default(),
            connections_total: Counter::default(),
            connections_refused: Counter::default(),
            peer_share_refused: Counter::default(),
            handshake_failures: Counter::default(),
            handshakes_throttled: Counter::default(),
            idle_closed: Counter::default(),
            frames_stalled: Counter::default(),
            protocol_errors: Counter::default(),
            checksum_failures: Counter::default(),
            bytes_received: Counter::default(),
            bytes_sent: Counter::default(),
        }
    }
}

impl Metrics {
    pub(crate) fn record(&self, op: Op, keys: usize, elapsed: Duration) {
        self.requests[op as usize].inc();
        self.keys[op as usize].inc_by(keys as u64);
        self.latency[op as usize].record(elapsed);
    }

    pub(crate) fn requests(&self, op: Op) -> u64 {
        self.requests[op as usize].get()
    }

    /// Registers the node's series (and, through a collector, the cache's
    /// and the pool's) in `registry`.
    pub(super) fn register(&self, registry: &mut Registry, state: Weak<NodeState>) {
        registry.register("kvplane_requests", "Requests handled, by operation", self.requests_family.clone());
        registry.register("kvplane_op_keys", "Keys handled, by operation (a batch of 32 counts 32)", self.keys_family.clone());
        registry.register("kvplane_connections_open", "Client connections currently open", self.connections_open.clone());
        registry.register("kvplane_connections", "Client connections accepted", self.connections_total.clone());
        registry.register("kvplane_connections_refused", "Connections refused (limit, token, handshake)", self.connections_refused.clone());
        registry.register(
            "kvplane_connections_refused_peer_share",
            "Connections refused because their peer held its share (--max-connections-per-peer)",
            self.peer_share_refused.clone(),
        );
        registry.register(
            "kvplane_handshake_failures",
            "Handshakes that failed (token, HELLO, version, silence)",
            self.handshake_failures.clone(),
        );
        registry.register(
            "kvplane_handshakes_throttled",
            "Connections refused because their peer failed too many handshakes (--max-handshake-failures)",
            self.handshakes_throttled.clone(),
        );
        registry.register("kvplane_idle_closed", "Idle connections closed (--idle-timeout)", self.idle_closed.clone());
        registry.register(
            "kvplane_frames_stalled",
            "Frames cut for arriving too slowly (--frame-grace, --min-receive-rate)",
            self.frames_stalled.clone(),
        );
        registry.register("kvplane_protocol_errors", "Frames refused as malformed or over a limit", self.protocol_errors.clone());
        registry.register("kvplane_checksum_failures", "PUT blocks whose payload failed its checksum", self.checksum_failures.clone());
        registry.register("kvplane_received_bytes", "Bytes read from clients", self.bytes_received.clone());
        registry.register("kvplane_sent_bytes", "Bytes written to clients", self.bytes_sent.clone());
        registry.register_collector(Box::new(NodeCollector(state)));
    }

    /// The counters sent in a STATS answer and printed by `kvplane stats`.
    pub(crate) fn snapshot(&self, cache: &CacheStats, pool: &PoolStats) -> Vec<(String, u64)> {
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
            ("connections_open".into(), self.connections_open.get().max(0) as u64),
            ("connections_total".into(), self.connections_total.get()),
            ("connections_refused".into(), self.connections_refused.get()),
            ("connections_refused_peer_share".into(), self.peer_share_refused.get()),
            ("handshake_failures".into(), self.handshake_failures.get()),
            ("handshakes_throttled".into(), self.handshakes_throttled.get()),
            ("idle_closed".into(), self.idle_closed.get()),
            ("frames_stalled".into(), self.frames_stalled.get()),
            ("protocol_errors".into(), self.protocol_errors.get()),
            ("checksum_failures".into(), self.checksum_failures.get()),
            ("bytes_received".into(), self.bytes_received.get()),
            ("bytes_sent".into(), self.bytes_sent.get()),
        ];
        for op in Op::ALL {
            out.push((format!("requests_{}", op.name()), self.requests(op)));
            out.push((format!("keys_{}", op.name()), self.keys[op as usize].get()));
        }
        out
    }
}

/// Reads the memory tier's counters at scrape time.
struct NodeCollector(Weak<NodeState>);

impl fmt::Debug for NodeCollector {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("NodeCollector")
    }
}

impl Collector for NodeCollector {
    fn encode(&self, mut e: DescriptorEncoder) -> fmt::Result {
        let Some(state) = self.0.upgrade() else {
            return Ok(());
        };
        let cache = state.store.cache().stats();
        let pool = state.store.cache().pool().stats();
        counter(&mut e, "kvplane_cache_hits", "GET keys found in the memory tier", cache.hits)?;
        counter(&mut e, "kvplane_cache_misses", "GET keys not found in the memory tier", cache.misses)?;
        counter(&mut e, "kvplane_cache_evictions", "Entries evicted to make room", cache.evictions)?;
        counter(&mut e, "kvplane_cache_inserts", "Blocks stored (new or replaced)", cache.inserts)?;
        gauge(&mut e, "kvplane_cache_entries", "Blocks currently stored", cache.entries)?;
        gauge(&mut e, "kvplane_cache_pinned_entries", "Blocks under an unexpired pin lease", cache.pinned)?;
        gauge(&mut e, "kvplane_cache_bytes_stored", "Payload bytes currently stored", cache.bytes_stored)?;
        gauge(&mut e, "kvplane_memory_capacity_bytes", "Size of the preallocated block pool", pool.capacity_bytes as u64)?;
        gauge(&mut e, "kvplane_memory_used_bytes", "Pool bytes held by live blocks (by size class)", pool.used_bytes as u64)?;
        gauge(
            &mut e,
            "kvplane_receive_budget_bytes",
            "Bytes frames still arriving may hold (--receive-budget)",
            state.receive_budget.bytes() as u64,
        )?;
        gauge(
            &mut e,
            "kvplane_receive_budget_used_bytes",
            "Bytes held now for frames still arriving",
            state.receive_budget.used_bytes() as u64,
        )?;
        gauge(
            &mut e,
            "kvplane_receive_budget_per_peer_bytes",
            "Bytes of the receive budget one peer may hold (--receive-budget-per-peer)",
            state.receive_budget.per_peer_bytes() as u64,
        )?;
        counter(
            &mut e,
            "kvplane_receive_budget_waits",
            "Reservations that waited for the receive budget or their peer's share",
            state.receive_budget.waits.load(Ordering::Relaxed),
        )?;
        counter(&mut e, "kvplane_memory_failed_allocations", "Block allocations refused for lack of memory", pool.failed_allocations)?;
        {
            let mut family = e.encode_descriptor(
                "kvplane_op_duration_seconds",
                "Request latency inside the node, by operation",
                None,
                MetricType::Histogram,
            )?;
            for op in Op::ALL {
                let (sum, count, buckets) = state.metrics.latency[op as usize].snapshot();
                family.encode_family(&OpLabel { op: op.name() })?.encode_histogram::<OpLabel>(sum, count, &buckets, None)?;
            }
        }
        state.store.encode_metrics(&mut e, &cache)?;
        if let Some(tls) = &state.tls {
            tls.encode_metrics(&mut e)?;
        }
        if let Some(cluster) = &state.cluster {
            cluster.encode_metrics(&mut e)?;
        }
        Ok(())
    }
}
