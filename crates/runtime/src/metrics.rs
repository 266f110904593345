//! What the host measures about plugins, apart from what plugins report.
//!
//! Two kinds of series, never mixed, so a plugin cannot forge or hide the
//! host's view of it:
//! - `kvplane_plugin_calls_total`, `kvplane_plugin_faults_total`,
//!   `kvplane_plugin_fail_open_total` and `kvplane_plugin_call_duration_seconds`
//!   are counted by the host around every call.
//! - `kvplane_plugin_reported_*` carry what a plugin recorded through the
//!   contract's `metrics` interface, labelled with the plugin and the name it
//!   chose (bounded per plugin, see `host.rs`).
//! - `kvplane_plugin_log_records_*` count what became of the records a
//!   plugin wrote through `log`: written, dropped past its log rate, cut to
//!   the longest record.

use std::fmt;
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet, EncodeMetric};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;
use std::sync::atomic::AtomicU64;

use crate::error::Fault;
use crate::host::{MetricValue, PluginShared};

/// See [`RuntimeMetrics::call_handles`].
#[derive(Clone, Debug)]
pub(crate) struct CallHandles {
    calls: Counter,
    duration: Histogram,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct CallLabels {
    plugin: String,
    function: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct FaultLabels {
    plugin: String,
    function: &'static str,
    fault: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PluginLabels {
    plugin: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct LimitLabels {
    plugin: String,
    limit: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ReportedLabels {
    plugin: String,
    name: String,
}

type HistogramFamily<L> = Family<L, Histogram, fn() -> Histogram>;

fn call_histogram() -> Histogram {
    // 1 µs to ~4 s: a placement call is microseconds, a backend call with
    // network I/O may take seconds before its deadline stops it.
    Histogram::new(prometheus_client::metrics::histogram::exponential_buckets(1e-6, 4.0, 12))
}

/// The host's counters for every plugin of one runtime.
pub struct RuntimeMetrics {
    calls: Family<CallLabels, Counter>,
    faults: Family<FaultLabels, Counter>,
    fail_open: Family<PluginLabels, Counter>,
    duration: HistogramFamily<CallLabels>,
    /// Loaded plugins, for their self-reported series at scrape time.
    plugins: Mutex<Vec<Weak<PluginShared>>>,
}

impl fmt::Debug for RuntimeMetrics {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RuntimeMetrics").finish_non_exhaustive()
    }
}

impl Default for RuntimeMetrics {
    fn default() -> Self {
        RuntimeMetrics {
            calls: Family::default(),
            faults: Family::default(),
            fail_open: Family::default(),
            duration: Family::new_with_constructor(call_histogram),
            plugins: Mutex::new(Vec::new()),
        }
    }
}

/// The label a fault is counted under.
fn fault_label(fault: &Fault) -> &'static str {
    match fault {
        Fault::Trap { .. } => "trap",
        Fault::Deadline { .. } => "deadline",
        Fault::MemoryCap { .. } => "memory_cap",
        Fault::StackOverflow => "stack_overflow",
        Fault::BadOutput(_) => "bad_output",
        Fault::Instantiate(_) => "instantiate",
        Fault::Configure(_) => "configure",
        Fault::Broken { .. } => "broken",
        Fault::Returned(_) => "returned_error",
    }
}

impl RuntimeMetrics {
    /// Registers the host's series and the plugins' reported series.
    pub fn register(self: &Arc<Self>, registry: &mut Registry) {
        registry.register("kvplane_plugin_calls", "Calls into a plugin, by function", self.calls.clone());
        registry.register(
            "kvplane_plugin_faults",
            "Plugin calls that ended in a fault (trap, deadline, memory cap, bad output, ...) or a returned error",
            self.faults.clone(),
        );
        registry.register(
            "kvplane_plugin_fail_open",
            "Faults answered with the world's default under failurePolicy failOpen",
            self.fail_open.clone(),
        );
        registry.register(
            "kvplane_plugin_call_duration_seconds",
            "Time spent in a plugin call, including host I/O it waited on",
            self.duration.clone(),
        );
        registry.register_collector(Box::new(Reported(Arc::clone(self))));
    }

    pub(crate) fn track(&self, plugin: &Arc<PluginShared>) {
        if let Ok(mut plugins) = self.plugins.lock() {
            plugins.retain(|p| p.strong_count() > 0);
            plugins.push(Arc::downgrade(plugin));
        }
    }

    /// The call counter and latency histogram of one (plugin, function),
    /// resolved once: they share their values with the registered families,
    /// so a call records with an atomic add and one observation instead of
    /// a label allocation and two family lookups.
    pub(crate) fn call_handles(&self, plugin: &str, function: &'static str) -> CallHandles {
        let labels = CallLabels { plugin: plugin.to_owned(), function };
        CallHandles { calls: self.calls.get_or_create(&labels).clone(), duration: self.duration.get_or_create(&labels).clone() }
    }

    pub(crate) fn record_call(
        &self,
        plugin: &str,
        function: &'static str,
        handles: &CallHandles,
        elapsed: Duration,
        fault: Option<&Fault>,
    ) {
        handles.calls.inc();
        handles.duration.observe(elapsed.as_secs_f64());
        if let Some(fault) = fault {
            self.faults.get_or_create(&FaultLabels { plugin: plugin.to_owned(), function, fault: fault_label(fault) }).inc();
        }
    }

    pub(crate) fn record_fail_open(&self, plugin: &str) {
        self.fail_open.get_or_create(&PluginLabels { plugin: plugin.to_owned() }).inc();
    }

    /// Fail-open fallbacks of one plugin so far.
    pub fn fail_open_count(&self, plugin: &str) -> u64 {
        self.fail_open.get(&PluginLabels { plugin: plugin.to_owned() }).map(|c| c.get()).unwrap_or(0)
    }

    /// Calls of one plugin's function so far.
    pub fn call_count(&self, plugin: &str, function: &'static str) -> u64 {
        self.calls.get(&CallLabels { plugin: plugin.to_owned(), function }).map(|c| c.get()).unwrap_or(0)
    }

    /// Faults of one kind (`trap`, `deadline`, ...) of one plugin's function so far.
    pub fn fault_count(&self, plugin: &str, function: &'static str, fault: &'static str) -> u64 {
        self.faults.get(&FaultLabels { plugin: plugin.to_owned(), function, fault }).map(|c| c.get()).unwrap_or(0)
    }
}

/// Encodes the plugins' self-reported series at scrape time.
#[derive(Debug)]
struct Reported(Arc<RuntimeMetrics>);

impl prometheus_client::collector::Collector for Reported {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), fmt::Error> {
        let counters: Family<ReportedLabels, Counter> = Family::default();
        let gauges: Family<ReportedLabels, Gauge<f64, AtomicU64>> = Family::default();
        let histogram_counts: Family<ReportedLabels, Counter> = Family::default();
        let histogram_sums: Family<ReportedLabels, Gauge<f64, AtomicU64>> = Family::default();
        let limit_hits: Family<LimitLabels, Counter> = Family::default();
        let log_written: Family<PluginLabels, Counter> = Family::default();
        let log_dropped: Family<PluginLabels, Counter> = Family::default();
        let log_truncated: Family<PluginLabels, Counter> = Family::default();
        let plugins: Vec<Arc<PluginShared>> =
            self.0.plugins.lock().map(|p| p.iter().filter_map(Weak::upgrade).collect()).unwrap_or_default();
        for plugin in plugins {
            for (limit, hits) in plugin.limit_hits_snapshot() {
                limit_hits.get_or_create(&LimitLabels { plugin: plugin.decl.name.clone(), limit }).inc_by(hits);
            }
            let logs = plugin.log_counts();
            let labels = PluginLabels { plugin: plugin.decl.name.clone() };
            log_written.get_or_create(&labels).inc_by(logs.written);
            log_dropped.get_or_create(&labels).inc_by(logs.dropped);
            log_truncated.get_or_create(&labels).inc_by(logs.truncated);
            for (name, value) in plugin.metrics_snapshot() {
                let labels = ReportedLabels { plugin: plugin.decl.name.clone(), name };
                match value {
                    MetricValue::Counter { value } => {
                        counters.get_or_create(&labels).inc_by(value);
                    }
                    MetricValue::Gauge { value } => {
                        gauges.get_or_create(&labels).set(value);
                    }
                    MetricValue::Histogram { count, sum } => {
                        histogram_counts.get_or_create(&labels).inc_by(count);
                        histogram_sums.get_or_create(&labels).set(sum);
                    }
                }
            }
        }
        if !limit_hits.is_empty() {
            let help = "Times a plugin was refused by one of its declared host limits (connections, queued-bytes, buffers, buffer-bytes, handles, metric-series, log-rate; handles-recycled counts instances retired with their handles spent)";
            limit_hits.encode(encoder.encode_descriptor("kvplane_plugin_limit_hits", help, None, limit_hits.metric_type())?)?;
        }
        for (name, help, family) in [
            ("kvplane_plugin_log_records", "Log records a plugin wrote to the node log", &log_written as &dyn EncodeMetric),
            (
                "kvplane_plugin_log_records_dropped",
                "Log records of a plugin dropped past its log rate (limits.logRecordsPerSecond, limits.logBurst)",
                &log_dropped,
            ),
            (
                "kvplane_plugin_log_records_truncated",
                "Log records of a plugin cut to the longest record the host writes (4096 bytes)",
                &log_truncated,
            ),
            ("kvplane_plugin_reported", "Counters a plugin reported about itself (label name: the plugin's own name)", &counters),
            ("kvplane_plugin_reported_gauge", "Gauges a plugin reported about itself", &gauges),
            ("kvplane_plugin_reported_observations", "Observations a plugin recorded in its own histograms", &histogram_counts),
            ("kvplane_plugin_reported_observation_sum", "Sum of the observations a plugin recorded in its own histograms", &histogram_sums),
        ] {
            if !family.is_empty() {
                family.encode(encoder.encode_descriptor(name, help, None, family.metric_type())?)?;
            }
        }
        Ok(())
    }
}
